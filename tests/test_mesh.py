"""Rank layout of the process-group mesh, checked against memberships derived by hand from
Megatron-Core's tp-cp-ep-dp-pp order (expert layers folded as etp-ep-edp-pp)."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from moe_overlap.distributed import mesh as mesh_module
from moe_overlap.distributed.mesh import GROUP_KINDS, GroupHandle, Mesh, MeshLayout

PARTITIONING_KINDS = [kind for kind in GROUP_KINDS if kind != "embedding"]


def singletons(world: int) -> list[list[int]]:
    return [[r] for r in range(world)]


def valid_layouts(world: int) -> list[MeshLayout]:
    sizes = [d for d in range(1, world + 1) if world % d == 0]
    layouts = []
    for tp, cp, pp, ep, etp in itertools.product(sizes, repeat=5):
        if world % (tp * cp * pp) == 0 and (world // pp) % (ep * etp) == 0:
            layouts.append(MeshLayout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp))
    return layouts


# (layout, {kind: groups}) -- every expectation worked out by hand from the rank formulas.
HAND_DERIVED = [
    (
        MeshLayout(8, tp=2, pp=2),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "cp": singletons(8),
            "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "mp": [[0, 1, 4, 5], [2, 3, 6, 7]],
            "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "ep": singletons(8),
            "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    (
        MeshLayout(8, tp=2, ep=2, pp=2),  # etp = tp = 2, edp = 1
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "edp": singletons(8),
            "expert_mp": [list(range(8))],
            "etp_ep": [[0, 1, 2, 3], [4, 5, 6, 7]],  # a MoE layer's counts stay within its pipeline stage
            "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    (
        MeshLayout(8, tp=2, cp=2, ep=4),  # dp = 2, etp = 2, edp = 1
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "pp": singletons(8),
            "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "mp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "etp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "ep": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "edp": singletons(8),
            "embedding": singletons(8),
        },
    ),
    (
        MeshLayout(8, tp=2, cp=2, ep=4, etp=1),  # edp = 2
        {
            "etp": singletons(8),
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "expert_mp": [[0, 1, 2, 3], [4, 5, 6, 7]],
        },
    ),
    (
        MeshLayout(16, tp=2, pp=2, ep=4, etp=1),  # dp = 4, edp = 2
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
            "pp": [[r, r + 8] for r in range(8)],
            "mp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
            "etp": singletons(16),
            "ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
            "edp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
            "expert_mp": [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]],
            "embedding": [[r, r + 8] for r in range(8)],
        },
    ),
    (
        MeshLayout(16, tp=2, ep=4),  # dp = 8, etp = 2, edp = 2
        {
            "dp": [list(range(0, 16, 2)), list(range(1, 16, 2))],
            "ep": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
            "edp": [[r, r + 8] for r in range(8)],
            "embedding": singletons(16),
        },
    ),
    (
        MeshLayout(16, tp=2, cp=2, pp=2, ep=2, etp=1),  # dp = 2, edp = 4
        {
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
            "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
            "ep": [[r, r + 1] for r in range(0, 16, 2)],
            "edp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        },
    ),
    (
        MeshLayout(16, tp=2, pp=4),  # dp = 2: middle stages hold no embedding group
        {
            "pp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
            "embedding": [[0, 12], [1, 13], [2, 14], [3, 15]],
        },
    ),
]


@pytest.mark.parametrize(("layout", "expected"), HAND_DERIVED,
                         ids=lambda x: repr(x) if isinstance(x, MeshLayout) else "")
def test_hand_derived_groups(layout: MeshLayout, expected: dict[str, list[list[int]]]) -> None:
    print(layout.table())
    for kind, groups in expected.items():
        assert layout.group_ranks(kind) == groups, kind


def test_table_rows() -> None:
    layout = MeshLayout(8, tp=2, ep=2, pp=2)
    table = layout.table()
    print(table)
    lines = table.splitlines()
    assert lines[0] == "MeshLayout(world_size=8, tp=2, cp=1, pp=2, ep=2, etp=2): dp=2 edp=1"
    assert lines[1].split() == ["rank", "|", "tp", "cp", "dp", "pp", "|", "etp", "ep", "edp"]
    assert len(lines) == 2 + 8
    # rank 7: tp 1, cp 0, dp 1, pp 1 | etp 1, ep 1, edp 0
    assert lines[-1].split() == ["7", "|", "1", "0", "1", "1", "|", "1", "1", "0"]


def test_coords_follow_megatron_order() -> None:
    layout = MeshLayout(16, tp=2, pp=2, ep=4, etp=1)
    assert layout.coords(13) == {"tp": 1, "cp": 0, "dp": 2, "pp": 1, "etp": 0, "ep": 1, "edp": 1}
    with pytest.raises(ValueError, match="rank=16"):
        layout.coords(16)


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
def test_every_layout_partitions_and_folds(world: int) -> None:
    for layout in valid_layouts(world):
        sizes = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp,
                 "etp": layout.etp, "ep": layout.ep, "edp": layout.edp}
        assert layout.tp * layout.cp * layout.dp * layout.pp == world
        assert layout.etp * layout.ep * layout.edp * layout.pp == world
        all_coords = [layout.coords(r) for r in range(world)]
        # both families are bijections onto their coordinate grids and agree on the pipeline stage
        assert len({tuple(c[a] for a in ("tp", "cp", "dp", "pp")) for c in all_coords}) == world
        assert len({tuple(c[a] for a in ("etp", "ep", "edp", "pp")) for c in all_coords}) == world
        assert all(0 <= c[a] < sizes[a] for c in all_coords for a in sizes)
        for kind in PARTITIONING_KINDS:
            groups = layout.group_ranks(kind)
            assert sorted(r for g in groups for r in g) == list(range(world)), (layout, kind)
            assert all(len(g) == layout.group_size(kind) and g == sorted(g) for g in groups), (layout, kind)
            assert [g[0] for g in groups] == sorted(g[0] for g in groups), (layout, kind)
        for single in ("tp", "cp", "dp", "pp", "etp", "ep", "edp"):
            for group in layout.group_ranks(single):
                # inside one group only that axis varies, and it takes every value once
                assert sorted(all_coords[r][single] for r in group) == list(range(sizes[single]))
        embedding = layout.group_ranks("embedding")
        assert len(embedding) == world // layout.pp
        assert all(all_coords[r]["pp"] in (0, layout.pp - 1) for g in embedding for r in g)


def test_expert_tp_defaults_to_tp_and_folds() -> None:
    layout = MeshLayout(4, tp=2, ep=2)
    assert layout.etp == 2 and layout.edp == 1 and layout.dp == 2
    assert layout == MeshLayout(4, tp=2, ep=2, etp=2)
    assert layout.group_ranks("ep") == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 x expert_tensor_parallel_size=2"):
        MeshLayout(2, tp=2, ep=2)
    # TP=2 with EP=2 on two ranks, by folding with expert-TP 1
    folded = MeshLayout(2, tp=2, ep=2, etp=1)
    assert folded.group_ranks("tp") == [[0, 1]]
    assert folded.group_ranks("ep") == [[0, 1]]
    assert folded.group_ranks("etp") == [[0], [1]]
    assert folded.dp == 1 and folded.edp == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, r"world_size=0 .*integers >= 1"),
        ({"world_size": 8, "cp": 0}, r"context_parallel_size=0 .*integers >= 1"),
        ({"world_size": 8, "tp": 2.0}, r"tensor_model_parallel_size=2\.0 .*integers >= 1"),
        ({"world_size": 8, "tp": 3}, r"tensor_model_parallel_size=3 does not divide world_size=8.*1, 2, 4, 8"),
        ({"world_size": 8, "pp": 16}, r"pipeline_model_parallel_size=16 does not divide world_size=8"),
        ({"world_size": 8, "tp": 2, "cp": 2, "pp": 4}, r"tensor_model_parallel_size=2 x context_parallel_size=2 x"),
        ({"world_size": 8, "ep": 3}, r"expert_model_parallel_size=3 does not divide .* = 8"),
        ({"world_size": 8, "pp": 4, "etp": 4}, r"expert_tensor_parallel_size=4 does not divide .* = 2.*1, 2"),
        ({"world_size": 8, "tp": 4, "ep": 4}, r"expert_model_parallel_size=4 x expert_tensor_parallel_size=4"),
    ],
)
def test_bad_layout_names_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MeshLayout(**kwargs)


def test_unknown_group_kind() -> None:
    with pytest.raises(ValueError, match="unknown group kind 'sp'.*tp, cp"):
        MeshLayout(2).group_ranks("sp")


def test_two_host_locality() -> None:
    local = MeshLayout(16, tp=2, ep=4)
    local.check_host_locality(local_world_size=8)
    assert local.ep_within_host(8)

    ep_across = MeshLayout(16, tp=2, ep=8)
    assert not ep_across.ep_within_host(8)
    with pytest.raises(ValueError, match=r"EP group \[0, 2, 4, 6, 8, 10, 12, 14\] .*spans hosts \[0, 1\]") as err:
        ep_across.check_host_locality(local_world_size=8)
    print(err.value)
    assert str(err.value).startswith("EP group")  # TP and expert-TP groups (size 2) stay on one host

    tp_across = MeshLayout(16, tp=16, etp=1)
    with pytest.raises(ValueError, match=r"^TP group \[0, 1, .*15\] \(tensor_model_parallel_size=16\)"):
        tp_across.check_host_locality(local_world_size=8)
    etp_across = MeshLayout(16, tp=1, etp=16)
    with pytest.raises(ValueError, match=r"^expert-TP group \[0, 1, .*15\] \(expert_tensor_parallel_size=16\)"):
        etp_across.check_host_locality(local_world_size=8)
    with pytest.raises(ValueError, match="local_world_size=6 must divide world_size=16"):
        local.check_host_locality(local_world_size=6)


class FakeDist:
    """Stands in for torch.distributed on one rank of a larger world, recording new_group calls."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.calls: list[tuple[list[int], dict]] = []
        self.destroyed: list[object] = []

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world_size

    def new_group(self, ranks: list[int], **kwargs: object) -> object:
        self.calls.append((list(ranks), kwargs))
        return ("pg", len(self.calls) - 1) if self.rank in ranks else dist.GroupMember.NON_GROUP_MEMBER

    def destroy_process_group(self, group: object) -> None:
        self.destroyed.append(group)


def test_create_makes_identical_calls_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = MeshLayout(8, tp=2, ep=2, pp=2)  # cp, edp groups have one rank: no process groups
    per_rank_calls = []
    for rank in range(layout.world_size):
        fake = FakeDist(rank, layout.world_size)
        monkeypatch.setattr(mesh_module, "dist", fake)
        mesh = Mesh.create(layout, timeout_s=30)
        per_rank_calls.append([ranks for ranks, _ in fake.calls])
        assert mesh.rank == rank and mesh.world_size == 8 and mesh.coords == layout.coords(rank)
        for kind in GROUP_KINDS:
            handle: GroupHandle = getattr(mesh, kind)
            assert rank in handle.ranks and handle.ranks in layout.group_ranks(kind)
            assert handle.size == len(handle.ranks) == layout.group_size(kind)
            assert handle.ranks[handle.rank] == rank
            if handle.size == 1:
                assert handle.group is None
            else:
                index = handle.group[1]
                assert fake.calls[index][0] == handle.ranks
                assert fake.calls[index][1]["timeout"].total_seconds() == 30
        assert mesh.cp.group is None and mesh.edp.group is None
        mesh.destroy()
        assert sorted(fake.destroyed) == sorted(getattr(mesh, k).group for k in GROUP_KINDS if getattr(mesh, k).group)
        mesh.destroy()  # idempotent: nothing destroyed twice
        assert len(fake.destroyed) == len(set(fake.destroyed))
    assert all(calls == per_rank_calls[0] for calls in per_rank_calls)
    expected = [g for kind in GROUP_KINDS if layout.group_size(kind) > 1 for g in layout.group_ranks(kind)]
    assert per_rank_calls[0] == expected


def test_create_middle_stage_has_empty_embedding_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = MeshLayout(8, pp=4)
    monkeypatch.setattr(mesh_module, "dist", FakeDist(rank=3, world_size=8))  # stage 1 of 4
    mesh = Mesh.create(layout, timeout_s=5)
    assert mesh.embedding == GroupHandle(ranks=[], group=None, rank=-1, size=0)


def test_create_rejects_world_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mesh_module, "dist", FakeDist(rank=0, world_size=4))
    with pytest.raises(ValueError, match="world size is 4 but the mesh layout has world_size=8"):
        Mesh.create(MeshLayout(8), timeout_s=5)


def test_single() -> None:
    mesh = Mesh.single()
    assert mesh.rank == 0 and mesh.world_size == 1
    for kind in GROUP_KINDS:
        assert getattr(mesh, kind) == GroupHandle(ranks=[0], group=None, rank=0, size=1)
    mesh.destroy()


def test_create_with_world_one_gloo(tmp_path) -> None:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = Mesh.create(MeshLayout(1), timeout_s=10, backend="gloo")
        assert mesh.coords == {"tp": 0, "cp": 0, "dp": 0, "pp": 0, "etp": 0, "ep": 0, "edp": 0}
        assert all(getattr(mesh, kind).group is None for kind in GROUP_KINDS)
        mesh.destroy()
    finally:
        dist.destroy_process_group()
