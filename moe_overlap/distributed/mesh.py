"""Process-group mesh: which ranks talk to which, for every kind of parallelism.

Rank order is Megatron-Core's ``tp-cp-ep-dp-pp`` (TP innermost, so TP and EP groups stay on one host).
Dense layers split the world as TP x CP x DP x PP::

    tp = r % TP
    cp = (r // TP) % CP
    dp = (r // (TP*CP)) % DP
    pp = r // (TP*CP*DP)

Expert layers fold the same ranks (MoE parallel folding) as expert-TP x EP x expert-DP x PP::

    etp = r % ETP
    ep  = (r // ETP) % EP
    edp = (r // (ETP*EP)) % EDP
    pp  = r // (ETP*EP*EDP)          # the same stage as above: TP*CP*DP == ETP*EP*EDP == world / PP

A group of kind ``k`` is a set of ranks that agree on every coordinate of k's family except k's own.
``MeshLayout`` is plain arithmetic (testable without processes); ``Mesh`` turns it into torch process
groups for one rank and is passed down explicitly -- there are no module-level globals.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from math import prod
from typing import TYPE_CHECKING, Any, Mapping

import torch.distributed as dist

from moe_overlap.distributed.streams import set_exposed_kind

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_DENSE_AXES = ("tp", "cp", "dp", "pp")
_EXPERT_AXES = ("etp", "ep", "edp", "pp")

# kind -> (coordinate family, axes that vary inside one group of that kind)
_GROUP_AXES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tp": (_DENSE_AXES, ("tp",)),
    "cp": (_DENSE_AXES, ("cp",)),
    "dp": (_DENSE_AXES, ("dp",)),
    "pp": (_DENSE_AXES, ("pp",)),
    # dense gradient reduction (distributed optimizer) spans data and context parallel ranks
    "dp_cp": (_DENSE_AXES, ("dp", "cp")),
    # dense grad-norm: dense parameters are sharded over TP and PP, replicated over DP and CP
    "mp": (_DENSE_AXES, ("tp", "pp")),
    "etp": (_EXPERT_AXES, ("etp",)),
    "ep": (_EXPERT_AXES, ("ep",)),
    "edp": (_EXPERT_AXES, ("edp",)),
    # expert grad-norm: expert parameters are sharded over expert-TP, EP and PP, replicated over expert-DP
    "expert_mp": (_EXPERT_AXES, ("etp", "ep", "pp")),
    # a MoE layer's token counts: expert-TP x EP within one pipeline stage (Megatron's
    # expert_tensor_and_model_parallel group)
    "etp_ep": (_EXPERT_AXES, ("etp", "ep")),
}

#: Every group kind a Mesh holds, in the order Mesh.create makes its new_group calls.
GROUP_KINDS: tuple[str, ...] = (*_GROUP_AXES, "embedding")

_MEGATRON_NAMES = {
    "tp": "tensor_model_parallel_size",
    "cp": "context_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}

# The exposed-communication kind (distributed/streams.py) of each axis: expert-TP's gathers are part of the MoE
# exchange. A group counts as the kind of the first of its varying axes (in _GROUP_AXES order) with more than one
# rank (the gradient-norm group mp of TP=1 x PP=2 is pipeline traffic); the tied embedding's gradient sum, between
# the first and last pipeline stages, as PP.
_AXIS_EXPOSED_KIND = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "etp": "ep", "ep": "ep", "edp": "dp"}

# Groups whose traffic is too heavy for an inter-host link, with the names messages use.
_HOST_LOCAL_KINDS = {"tp": "TP", "ep": "EP", "etp": "expert-TP"}


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of every parallel dimension; ``etp=None`` means expert-TP = TP (resolved on construction)."""

    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for field in ("world_size", *_MEGATRON_NAMES):
            name, value = _MEGATRON_NAMES.get(field, field), getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: allowed values are integers >= 1")
        world = self.world_size
        for field in ("tp", "cp", "pp"):
            size = getattr(self, field)
            if world % size:
                raise ValueError(
                    f"{_MEGATRON_NAMES[field]}={size} does not divide world_size={world}; "
                    f"allowed: divisors of {world} ({_divisors(world)})"
                )
        if world % (self.tp * self.cp * self.pp):
            raise ValueError(
                f"tensor_model_parallel_size={self.tp} x context_parallel_size={self.cp} x "
                f"pipeline_model_parallel_size={self.pp} = {self.tp * self.cp * self.pp} does not divide "
                f"world_size={world}; allowed: a product that divides {world}"
            )
        stage_ranks = world // self.pp
        for field in ("ep", "etp"):
            size = getattr(self, field)
            if stage_ranks % size:
                raise ValueError(
                    f"{_MEGATRON_NAMES[field]}={size} does not divide world_size / pipeline_model_parallel_size"
                    f" = {stage_ranks}; allowed: divisors of {stage_ranks} ({_divisors(stage_ranks)})"
                )
        if stage_ranks % (self.ep * self.etp):
            raise ValueError(
                f"expert_model_parallel_size={self.ep} x expert_tensor_parallel_size={self.etp} = "
                f"{self.ep * self.etp} does not divide world_size / pipeline_model_parallel_size = "
                f"{stage_ranks}; allowed: a product that divides {stage_ranks}"
            )

    @property
    def dp(self) -> int:
        """Dense data-parallel size."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size."""
        return self.world_size // (self.pp * self.ep * self.etp)

    def _axis_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp,
                "etp": self.etp, "ep": self.ep, "edp": self.edp}

    def exposed_kind(self, kind: str) -> str:
        """What a blocking collective over a group of ``kind`` counts as (see _AXIS_EXPOSED_KIND)."""
        if kind == "embedding":
            return "pp"
        sizes = self._axis_sizes()
        varying = self._kind_axes(kind)[1]
        return _AXIS_EXPOSED_KIND[next((axis for axis in varying if sizes[axis] > 1), varying[0])]

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``: keys tp, cp, dp, pp (dense) and etp, ep, edp (expert)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is out of range; allowed: 0..{self.world_size - 1}")
        tp, cp, dp, etp, ep = self.tp, self.cp, self.dp, self.etp, self.ep
        return {
            "tp": rank % tp,
            "cp": rank // tp % cp,
            "dp": rank // (tp * cp) % dp,
            "pp": rank // (tp * cp * dp),
            "etp": rank % etp,
            "ep": rank // etp % ep,
            "edp": rank // (etp * ep) % self.edp,
        }

    def group_size(self, kind: str) -> int:
        """Size of every group of ``kind`` (all groups of one kind have the same size)."""
        if kind == "embedding":
            return min(self.pp, 2)
        _, varying = self._kind_axes(kind)
        sizes = self._axis_sizes()
        return prod(sizes[axis] for axis in varying)

    def group_ranks(self, kind: str) -> list[list[int]]:
        """All groups of ``kind``, each sorted, ordered by their lowest rank.

        ``embedding``: for each (tp, cp, dp), the first and last pipeline stage -- the ranks that
        all-reduce tied embedding gradients. Ranks on middle stages belong to no embedding group.
        """
        if kind == "embedding":
            return [sorted({ranks[0], ranks[-1]}) for ranks in self.group_ranks("pp")]
        family, varying = self._kind_axes(kind)
        fixed = [axis for axis in family if axis not in varying]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coords(rank)
            groups.setdefault(tuple(coords[axis] for axis in fixed), []).append(rank)
        return list(groups.values())  # insertion order = ascending lowest rank; members ascending

    def table(self) -> str:
        """Printable rank table: one row per rank with its dense and expert coordinates."""
        sizes = self._axis_sizes()
        dense, expert = ("tp", "cp", "dp", "pp"), ("etp", "ep", "edp")
        widths = {axis: max(len(axis), len(str(sizes[axis] - 1))) for axis in (*dense, *expert)}
        rank_width = max(len("rank"), len(str(self.world_size - 1)))

        def row(rank_cell: str, cells: dict[str, str]) -> str:
            dense_cells = " ".join(cells[a].rjust(widths[a]) for a in dense)
            expert_cells = " ".join(cells[a].rjust(widths[a]) for a in expert)
            return f"{rank_cell.rjust(rank_width)} | {dense_cells} | {expert_cells}"

        lines = [
            f"{self!r}: dp={self.dp} edp={self.edp}",
            row("rank", {axis: axis for axis in widths}),
            *(row(str(r), {k: str(v) for k, v in self.coords(r).items()}) for r in range(self.world_size)),
        ]
        return "\n".join(lines)

    def check_host_locality(self, local_world_size: int) -> None:
        """Raise ValueError if a TP, EP or expert-TP group spans hosts (host = rank // local_world_size)."""
        problems = []
        for kind, label in _HOST_LOCAL_KINDS.items():
            spanning = self._groups_spanning_hosts(kind, local_world_size)
            if spanning:
                ranks = spanning[0]
                hosts = sorted({r // local_world_size for r in ranks})
                problems.append(
                    f"{label} group {ranks} ({_MEGATRON_NAMES[kind]}={getattr(self, kind)}) "
                    f"spans hosts {hosts}"
                )
        if problems:
            raise ValueError(
                "; ".join(problems) + f" with local_world_size={local_world_size}. TP, EP and expert-TP groups "
                "must stay on one host: use sizes whose groups fit in local_world_size ranks"
            )

    def ep_within_host(self, local_world_size: int) -> bool:
        """True if every EP group lies on one host (so a copy-engine all-to-all can serve it)."""
        return not self._groups_spanning_hosts("ep", local_world_size)

    def _groups_spanning_hosts(self, kind: str, local_world_size: int) -> list[list[int]]:
        if local_world_size < 1 or self.world_size % local_world_size:
            raise ValueError(
                f"local_world_size={local_world_size} must divide world_size={self.world_size}; "
                f"allowed: {_divisors(self.world_size)}"
            )
        return [
            ranks for ranks in self.group_ranks(kind)
            if len({r // local_world_size for r in ranks}) > 1
        ]

    @staticmethod
    def _kind_axes(kind: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if kind not in _GROUP_AXES:
            raise ValueError(f"unknown group kind {kind!r}; allowed: {', '.join(GROUP_KINDS)}")
        return _GROUP_AXES[kind]


@dataclass
class GroupHandle:
    """This rank's view of one group.

    ``group`` is None when the group has one rank (collectives are no-ops) or when this rank is in no
    group of the kind (a middle pipeline stage's embedding handle: ``ranks == []``, ``size == 0``,
    ``rank == -1``).
    """

    ranks: list[int]
    group: ProcessGroup | None
    rank: int
    size: int


def _handle(layout: MeshLayout, kind: str, rank: int, group: ProcessGroup | None) -> GroupHandle:
    """``rank``'s handle on its group of ``kind`` (none: a rank outside every group of the kind)."""
    mine = next((ranks for ranks in layout.group_ranks(kind) if rank in ranks), [])
    return GroupHandle(ranks=mine, group=group, rank=mine.index(rank) if mine else -1, size=len(mine))


class Mesh:
    """Every group this rank belongs to, one GroupHandle per kind (see GROUP_KINDS)."""

    tp: GroupHandle
    cp: GroupHandle
    dp: GroupHandle
    pp: GroupHandle
    dp_cp: GroupHandle
    mp: GroupHandle
    etp: GroupHandle
    ep: GroupHandle
    edp: GroupHandle
    expert_mp: GroupHandle
    etp_ep: GroupHandle
    embedding: GroupHandle

    def __init__(
        self, layout: MeshLayout, rank: int, handles: dict[str, GroupHandle], owned_groups: list[ProcessGroup]
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.world_size = layout.world_size
        self.coords = layout.coords(rank)
        for kind in GROUP_KINDS:
            setattr(self, kind, handles[kind])
        self._owned_groups = owned_groups

    @classmethod
    def create(cls, layout: MeshLayout, timeout_s: float, backend: str | None = None,
               pg_options: Mapping[str, Any] | None = None) -> Mesh:
        """Build every group from the initialized default group; a collective call on every rank.
        ``pg_options`` maps a group kind to the backend options its groups are made with.

        Every rank calls new_group for every group of every kind in the same order (torch requires it,
        members or not). Kinds whose groups have one rank get no process group; that decision comes
        from the layout alone, so all ranks agree on it. Kinds with identical rank sets still get
        separate groups: separate communicators let e.g. DP gradient reduction and EP all-to-all run
        concurrently instead of queueing on one NCCL stream.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "Mesh.create needs an initialized torch.distributed default group "
                "(call init_process_group first); use Mesh.single() for a single process"
            )
        world_size = dist.get_world_size()
        if world_size != layout.world_size:
            raise ValueError(
                f"torch.distributed world size is {world_size} but the mesh layout has "
                f"world_size={layout.world_size}; they must be equal"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: allowed values are > 0 (a hang is a bug)")
        rank = dist.get_rank()
        timeout = timedelta(seconds=timeout_s)
        handles: dict[str, GroupHandle] = {}
        owned_groups: list[ProcessGroup] = []
        for kind in GROUP_KINDS:
            my_group = None
            if layout.group_size(kind) > 1:
                for ranks in layout.group_ranks(kind):
                    group = dist.new_group(ranks, timeout=timeout, backend=backend, group_desc=f"mesh_{kind}",
                                           pg_options=(pg_options or {}).get(kind))
                    if rank in ranks:
                        my_group = group
                        owned_groups.append(group)
                        set_exposed_kind(group, layout.exposed_kind(kind))
            handles[kind] = _handle(layout, kind, rank, my_group)
        return cls(layout, rank, handles, owned_groups)

    @classmethod
    def single(cls) -> Mesh:
        """World-1 mesh without torch.distributed: the single-process reference run."""
        handles = {kind: GroupHandle(ranks=[0], group=None, rank=0, size=1) for kind in GROUP_KINDS}
        return cls(MeshLayout(world_size=1), 0, handles, [])

    @classmethod
    def planned(cls, layout: MeshLayout, rank: int) -> Mesh:
        """``rank``'s groups as sizes and ranks only, no process group: for building its part of a model on the meta
        device (planning, ``moe-overlap info``). A collective through it would be a no-op: never run one."""
        return cls(layout, rank, {kind: _handle(layout, kind, rank, None) for kind in GROUP_KINDS}, [])

    def own(self, group: ProcessGroup) -> None:
        """Destroy ``group`` with the mesh's own (a group made beside the mesh, e.g. a pipeline channel)."""
        self._owned_groups.append(group)

    def destroy(self) -> None:
        """Destroy the process groups this mesh created, so a worker can build another mesh.

        The handles keep their (now destroyed) groups, so a collective through the mesh afterwards is not skipped
        as on a one-rank group: NCCL refuses it; gloo may still run it over the old connections, so never reuse a
        destroyed mesh (the test suite's rank pool fails a case that leaves one reachable)."""
        for group in self._owned_groups:
            set_exposed_kind(group, None)
            dist.destroy_process_group(group)
        self._owned_groups = []

    def __repr__(self) -> str:
        return f"Mesh(rank={self.rank}, coords={self.coords}, layout={self.layout!r})"
