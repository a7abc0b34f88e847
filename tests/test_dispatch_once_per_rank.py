"""``overlap.moe_dispatch_once_per_rank``: each token crosses to an EP rank once per chunk (layers/wire_rows.py).

Same math: the layer with the switch on against the naive formula (which the serial reference passes too; outputs,
input, prob and weight gradients within 1e-5 normwise, fp32 on gloo ranks) for host and device planning, 1 and 2
chunks, dropless and dropping capacity, the shared expert beside the combine with delayed weight gradients, a rank
that receives nothing and one without tokens; the copy engine and the SM push kernel (interpreted) on one rank;
training steps with paired micro-batches, under a zero-bubble pipeline schedule, and with a bounded device-planned
exchange that overflows and runs again; the compute-only reference stays finite.
The wire carries fewer rows: at most one per token, chunk and destination rank. Refused combinations are one line.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from moe_overlap.config import ConfigError, ModelConfig, OverlapConfig, load_config
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.mesh import GroupHandle, Mesh, MeshLayout
from moe_overlap.layers.exchange_memory import wire_region_bytes
from moe_overlap.layers.exchange_plan import chunk_bounds
from moe_overlap.layers.moe import MoELayer
from moe_overlap.layers.wire_rows import token_wire_rows
from tests.test_moe_layer import CAPACITIES, SHARED, TOKENS, E, H, OneRankTransports, moe_case, moe_cases

ONCE = dict(once_per_rank=True)


# ------------------------------------------------------------------------------------------ the token side
def test_token_wire_rows_one_per_target_in_chunk_rank_token_order():
    """4 experts on 2 ranks, 2 chunks of one local expert: expert e is rank e // 2's chunk e % 2, target
    rank x chunks + chunk = e; slot order (chunk, rank): targets 0, 2, 1, 3. A token's copies on one target share
    its wire row; a dropped copy (keep False, or expert -1) has none."""
    experts_TK = torch.tensor([[0, 2], [2, 0], [1, 3], [3, 0], [0, -1]])
    keep_TK = torch.tensor([[True, True], [True, True], [True, True], [True, False], [True, True]])
    target_of_expert = torch.arange(4)
    slot_of_target = torch.tensor([0, 2, 1, 3])
    wire = token_wire_rows(experts_TK, keep_TK, target_of_expert, slot_of_target, copies=1)
    # in slot order: target 0 <- tokens 0, 1, 4; target 2 <- tokens 0, 1; target 1 <- token 2; target 3 <- tokens 2, 3
    assert wire.counts_V.tolist() == [3, 1, 2, 2] and wire.num_rows == 5 * 2
    want = {0: {0: 0, 2: 3}, 1: {0: 1, 2: 4}, 2: {1: 5, 3: 6}, 3: {3: 7}, 4: {0: 2}}
    for t, rows in want.items():
        got = sorted(r for r in wire.row_TC[t].tolist() if r >= 0)
        assert got == sorted(rows.values()), (t, wire.row_TC[t])
        for k in range(2):
            e = int(experts_TK[t, k])
            kept = bool(keep_TK[t, k]) and e >= 0
            assert int(wire.row_of_copy_TK[t, k]) == (rows[e] if kept else wire.num_rows)
    assert (wire.slot_TK == 0).all()


def test_a_tokens_copies_on_one_rank_and_chunk_share_a_row_in_slot_order():
    experts_TK = torch.tensor([[0, 1, 2, 3]])  # one chunk of 2 local experts per rank: targets 0, 0, 1, 1
    wire = token_wire_rows(experts_TK, None, torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1]), copies=2)
    assert wire.row_of_copy_TK.tolist() == [[0, 0, 1, 1]] and wire.slot_TK.tolist() == [[0, 1, 0, 1]]
    assert wire.counts_V.tolist() == [1, 1]


# ------------------------------------------------------------------------------------------ same math
@pytest.mark.parametrize("world,routing", [(2, "sparse"), (2, "first_rank_only"), (4, "sparse")])
def test_once_per_rank_every_planning_chunks_capacity_and_shared_expert(rank_pool, world, routing):
    """first_rank_only: rank 1 receives nothing (and rank 0 everything)."""
    settings = [dict(planning=p, chunks=c, **cap, **sh, **ONCE) for p in ("host", "device") for c in (1, 2)
                for cap in CAPACITIES[:2] for sh in SHARED[:2]]
    if world == 4:  # the fewest: every planning and chunks once
        settings = [dict(planning=p, chunks=c, **SHARED[1], **ONCE) for p in ("host", "device") for c in (1, 2)]
    errors = rank_pool(world).run(moe_cases, routing, 2, settings)
    assert max(max(e) for e in errors) < 1e-5


def test_once_per_rank_host_planned_with_a_rank_without_tokens(rank_pool):
    settings = [dict(planning="host", chunks=c, **cap, **ONCE) for c in (1, 2) for cap in CAPACITIES[:2]]
    assert max(max(e) for e in rank_pool(2).run(moe_cases, "random", 2, settings)) < 1e-5


@pytest.mark.parametrize("transport,planning", [("copy_engine", "host"), ("copy_engine", "device"),
                                                ("sm_push", "device")])
def test_once_per_rank_over_one_rank_through_symmetric_regions(monkeypatch, transport, planning):
    """The rows' extra columns (grouped rows, probs and their gradients as raw bits) through the copy engine's
    region (host sizes, or device-planned: the wire rows in slots, the counts copied through a region too) and the
    Triton push kernel and copy-out (interpreted): bit-exact, or the math would be off."""
    if transport == "sm_push":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    selector = OneRankTransports(transport, planning=planning)
    for setting in (dict(chunks=1), dict(chunks=4, capacity=3, **SHARED[1])):
        assert moe_case("sparse", 2, planning=planning, force_pipeline=True, selectors={planning: selector},
                        **setting, **ONCE) < 1e-5
    if (transport, planning) == ("copy_engine", "device"):  # info's estimate of the slots' regions, aligned
        predicted = wire_region_bytes(1, TOKENS, 2, chunk_bounds(E, 4), None, H, 4, slots=True)
        assert selector.made.regions.region_bytes == -(-predicted // 256) * 256


# ------------------------------------------------------------------------------------------ fewer rows
def wire_rows_case(topk: int, experts: int, chunks: int) -> dict:
    """The rows each planning's routes send per chunk, with the switch off and on, for T tokens routed top-k of
    ``experts`` at random (every rank the same micro-batch shape)."""
    world, tokens, hidden = dist.get_world_size(), 32, 8
    mesh = Mesh.create(MeshLayout(world, ep=world), timeout_s=60)
    try:
        g = torch.Generator().manual_seed(10 + mesh.ep.rank)
        experts_TK = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
        routing = SimpleNamespace(experts_TK=experts_TK, keep_TK=None, capacity=None,
                                  probs_TK=torch.full((tokens, topk), 1.0 / topk),
                                  tokens_per_expert_E=torch.bincount(experts_TK.flatten(), minlength=experts))
        cfg = ModelConfig(hidden_size=hidden, ffn_hidden_size=8, num_moe_experts=experts, moe_router_topk=topk)
        sent = {}
        for planning in ("host", "device"):
            for once in (False, True):  # a selector each: its regions grow to the largest exchange they carried
                selector = TransportSelector(planning, "auto", mesh.ep.group, mesh.ep.ranks, torch.device("cpu"),
                                             chunks, 60)
                overlap = OverlapConfig(moe_pipeline=True, moe_pipeline_chunks=chunks, moe_planning=planning,
                                        moe_dispatch_once_per_rank=once, delay_wgrad_compute=False)
                layer = MoELayer(cfg, overlap, mesh.ep, selector)
                plan = layer._planner(torch.zeros(tokens, hidden)).plan(routing)
                if planning == "host":
                    rows_C = [sum(rows) for rows in plan.routes.layout.send_rows]
                else:
                    rows_C = plan.routes.send_rows_C.tolist()
                sent[(planning, once)] = rows_C
            if planning == "device":  # what `info` prints (exchange_memory.py): the regions hold the wire rows
                predicted = wire_region_bytes(world, tokens, topk, plan.chunk_experts, None, hidden, 4)
                region_bytes = (selector.transport(0).regions.region_bytes, predicted)
        local = experts // world  # (token, rank) pairs per chunk of local experts
        distinct = [sum(len({e // local for e in row.tolist() if start <= e % local < stop}) for row in experts_TK)
                    for start, stop in plan.chunk_experts]
        return dict(sent=sent, tokens=tokens, distinct=distinct, region_bytes=region_bytes)
    finally:
        mesh.destroy()


@pytest.mark.parametrize("chunks", [1, 2])
def test_the_wire_carries_a_token_once_per_rank_and_chunk(rank_pool, chunks):
    """Fine routing, top-8 of 16 experts at EP=2: 8 copies per token, at most 2 rows per token and chunk (one per
    rank), the same count from either planner; the symmetric regions are sized for wire rows, as `info` says."""
    for result in rank_pool(2).run(wire_rows_case, 8, 16, chunks):
        sent, tokens = result["sent"], result["tokens"]
        assert sent[("host", False)] == sent[("device", False)] and sum(sent[("host", False)]) == 8 * tokens
        assert sent[("host", True)] == sent[("device", True)]
        assert all(rows <= 2 * tokens for rows in sent[("host", True)])
        assert sum(sent[("host", True)]) <= 2 * chunks * tokens < 8 * tokens
        assert sent[("host", True)] == result["distinct"]
        allocated, predicted = result["region_bytes"]
        assert predicted <= allocated < predicted + 256  # up to the regions' alignment


# ------------------------------------------------------------------------------------------ training steps
def test_paired_micro_batches_match_single_process(rank_pool, tmp_path):
    """overlap_moe_expert_parallel_comm runs the same three Functions, their exchanges between another
    micro-batch's stages: host and device planning, 2 chunks, delayed weight gradients."""
    from tests.test_microbatch_overlap import layout
    from tests.test_pipeline import check, pipeline_case

    once = {"overlap.moe_dispatch_once_per_rank": "true"}
    variants = {"host": layout(2, **once, **{"overlap.moe_planning": "host"}),
                "device_chunks2_delay_wgrad": layout(2, **once, **{"overlap.moe_planning": "device",
                                                                   "overlap.moe_pipeline_chunks": 2,
                                                                   "overlap.delay_wgrad_compute": "true"})}
    check(rank_pool(2).run(pipeline_case, str(tmp_path), 4, 1, variants))


def test_zero_bubble_pipeline_stages_match_single_process(rank_pool, tmp_path):
    """PP=2 x EP=2 under ZB-H1: the weight gradients deferred to the schedule's W (the expert-side copies and the
    probs' gradients made in its I), host-planned with delayed wgrad and device-planned with 2 chunks."""
    from tests.test_pipeline import check, pipeline_case, pp_layout

    once = {"parallel.expert_model_parallel_size": 2, "overlap.moe_pipeline": "true",
            "overlap.moe_dispatch_once_per_rank": "true", "overlap.moe_pipeline_chunks": 2}
    variants = {"ep2_zb_host_delay_wgrad": pp_layout(2, "zb_h1", **once, **{"overlap.moe_planning": "host",
                                                                            "overlap.delay_wgrad_compute": "true"}),
                "ep2_zb_device": pp_layout(2, "zb_h1", **once, **{"overlap.moe_planning": "device"})}
    check(rank_pool(4).run(pipeline_case, str(tmp_path), 4, 1, variants))


def test_bounded_device_plan_overflows_runs_again_and_equals_the_reference(rank_pool, tmp_path):
    """Factor 1.0 with learned routing overflows every step on the most loaded rank: the wire rows past their
    bound land in the spare row, the step is skipped and run again planned on the host; its losses and gradients
    are the host-planned run's without the switch."""
    from tests.test_overflow import FACTOR, _check, overflow_case

    bounded = {FACTOR: 1.0, "overlap.moe_dispatch_once_per_rank": "true"}
    _check(rank_pool(2).run(overflow_case, str(tmp_path), 2, 2, bounded, {"overlap.moe_pipeline_chunks": 2}), True)


def compute_only_case(output_dir: str, planning: str) -> list[float]:
    """overlap.moe_compute_only lands each rank's own rows, whose copies belong elsewhere: they are dropped, and the
    step stays finite."""
    from tests.test_master import small_config, world_and_mesh
    from moe_overlap.training.trainer import Trainer

    cfg = small_config(output_dir, 2, 8, **{"overlap.moe_pipeline": "true", "overlap.moe_compute_only": "true",
                                            "overlap.moe_planning": planning, "overlap.moe_pipeline_chunks": 2,
                                            "overlap.moe_dispatch_once_per_rank": "true"})
    _, mesh = world_and_mesh(cfg)
    try:
        return [Trainer(cfg, mesh, torch.device("cpu")).train_step()["grad_norm"]]
    finally:
        mesh.destroy()


@pytest.mark.parametrize("planning", ["host", "device"])
def test_compute_only_reference_runs(rank_pool, tmp_path, planning):
    for norms in rank_pool(2).run(compute_only_case, str(tmp_path), planning):
        assert all(torch.isfinite(torch.tensor(norms))) and all(n > 0 for n in norms), norms


# ------------------------------------------------------------------------------------------ refused
@pytest.mark.parametrize("overrides,fragment", [
    (["overlap.moe_pipeline=false"], "needs overlap.moe_pipeline=true"),
    (["overlap.moe_pipeline=true", "model.moe_expert_capacity_factor=1.0",
      "model.moe_pad_expert_input_to_capacity=true"],
     "not implemented yet (with model.moe_pad_expert_input_to_capacity=true)"),
    (["overlap.moe_pipeline=true", "parallel.expert_tensor_parallel_size=2"],
     "not implemented yet (with expert_tensor_parallel_size > 1)"),
])
def test_refusals_are_one_line(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", ["overlap.moe_dispatch_once_per_rank=true", *overrides])
    message = str(err.value)
    assert message.startswith("overlap.moe_dispatch_once_per_rank=True: ") and fragment in message, message
    assert "\n" not in message


def test_the_layer_refuses_padded_capacity():
    two_ranks = GroupHandle(ranks=[0, 1], group=None, rank=0, size=2)
    cfg = ModelConfig(hidden_size=8, ffn_hidden_size=8, num_moe_experts=4, moe_router_topk=2,
                      moe_pad_expert_input_to_capacity=True)
    with pytest.raises(ValueError, match="not implemented yet with model.moe_pad_expert_input_to_capacity"):
        MoELayer(cfg, OverlapConfig(moe_pipeline=True, moe_dispatch_once_per_rank=True, delay_wgrad_compute=False),
                 two_ranks, SimpleNamespace(planning="host"))


# ------------------------------------------------------------------------------------------ wire rows in slots
@contextlib.contextmanager
def in_slots(slot_rows: list) -> Iterator[None]:
    """Inside: the device planner lays its wire rows in slots of T rows per (source, target), as it does for the
    copy engines, and its static host-sized routes are moved by the CPU's transport of host sizes (gloo's all-to-all
    standing in for the copy engines' peer copies); each plan's slot sizes are appended to ``slot_rows``."""
    from moe_overlap.distributed.a2a_host import CollectiveTransport
    from moe_overlap.layers import device_plan

    init, plan, make = device_plan.DevicePlanner.__init__, device_plan.DevicePlanner.plan, TransportSelector._make

    def slotted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.slots = self.targets is not None

    def planned(self, routing):
        made = plan(self, routing)
        if self.slots:
            slot_rows.append(sorted({rows for chunk in made.routes.layout.send_rows for rows in chunk}))
        return made

    def host_sized(self, nbytes):
        return CollectiveTransport("gloo", self.group, self.device)

    device_plan.DevicePlanner.__init__, device_plan.DevicePlanner.plan = slotted, planned
    TransportSelector._make = host_sized
    try:
        yield
    finally:
        device_plan.DevicePlanner.__init__, device_plan.DevicePlanner.plan = init, plan
        TransportSelector._make = make


def slotted_cases(routing: str, topk: int, settings: list[dict]) -> list[float]:
    """Runs on every rank of the pool: :func:`moe_cases` with the wire rows in slots (:func:`in_slots`)."""
    slot_rows = []
    with in_slots(slot_rows):
        errors = moe_cases(routing, topk, settings)
    assert slot_rows and all(rows == [TOKENS] for rows in slot_rows), slot_rows  # a slot of T to every target
    return errors


@pytest.mark.parametrize("world,routing", [(2, "sparse"), (2, "first_rank_only"), (4, "sparse")])
def test_wire_rows_in_slots_are_the_same_math(rank_pool, world, routing):
    """Every target's rows in a slot of T (rows no token takes cross too, carrying no copy): outputs and every
    gradient as the formula's, one chunk and two, the shared expert beside the combine, delayed weight gradients,
    FP8 on the wire (the rows no token takes are dequantized too, and read by nothing)."""
    settings = [dict(planning="device", chunks=c, **sh, **ONCE) for c in (1, 2) for sh in SHARED[:2]]
    settings.append(dict(planning="device", chunks=1, dispatch_dtype="fp8", **ONCE))
    errors = rank_pool(world).run(slotted_cases, routing, 2, settings)
    assert max(max(e) for e in errors) < 1e-5


def slotted_overflow_case(output_dir: str) -> dict:
    """Runs on every rank: the bounded run of :func:`tests.test_overflow.overflow_case` with its wire rows in slots."""
    from tests.test_overflow import FACTOR, overflow_case

    slot_rows = []
    with in_slots(slot_rows):
        result = overflow_case(output_dir, 2, 2, {FACTOR: 1.0, "overlap.moe_dispatch_once_per_rank": "true"},
                               {"overlap.moe_pipeline_chunks": 2})
    assert slot_rows, "no plan in slots"
    return result


def test_copy_engines_with_device_planning_refuse_copies_without_wire_rows():
    """A layer whose selector is swapped for the copy engines' (as benchmarks do) without wire rows refuses in one
    line when it plans, instead of handing device routes to a transport of host sizes."""
    from moe_overlap.exchange_rules import slots_refusal
    from moe_overlap.layers.device_plan import DevicePlanner

    one = GroupHandle([0], None, 0, 1)
    planner = DevicePlanner(8, one, 1, False, SimpleNamespace(name="copy_engine"), torch.device("cpu"), 64)
    routing = SimpleNamespace(experts_TK=torch.zeros((4, 2), dtype=torch.long), capacity=None)
    with pytest.raises(ValueError) as err:
        planner.plan(routing)
    assert str(err.value) == str(slots_refusal("device", "copy_engine", once_per_rank=False, overflow_chunk=False))


def test_wire_rows_in_slots_overflow_their_copies_bound_and_run_again(rank_pool, tmp_path):
    """Training steps: a slot never overflows, but the copies it carries are bounded as before. Factor 1.0 with
    learned routing overflows every step; the step runs again planned on the host and equals the host-planned run."""
    from tests.test_overflow import _check

    _check(rank_pool(2).run(slotted_overflow_case, str(tmp_path)), True)
