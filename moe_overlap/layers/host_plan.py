"""The host-planned exchange (``overlap.moe_planning: host``, and the serial reference): every rank's counts are
fetched to the host once per layer call, and the layout, the regrouping and the grouped-GEMM offsets of each chunk
follow from them exactly (numpy on a few hundred integers), for transports that take host sizes (nccl,
copy_engine, gloo). Padded capacity has static sizes: its plan is built once (no host sync, CUDA-graph capturable).

With ``overlap.moe_dispatch_once_per_rank`` the fetch carries every rank's wire rows per (rank, chunk) target too:
the routes move wire rows (the same layout over targets, one "local expert" per chunk: no regrouping), the
offsets and each copy's grouped row at its destination follow from the copies' counts.

The fetch is the layer's one device-to-host sync: it is started before the permutation is queued and waited for
only when the sizes are first needed (:class:`HostPlan`). With expert-TP > 1 the counts come from every EP x
expert-TP rank, and the expert-TP gather of each chunk is planned from them too.

Letters: S source rank, D destination rank, L local expert, C chunk, P expert-TP peer, G a rank of the counts'
group (EP, or EP x expert-TP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.a2a_exchange import Transport
from moe_overlap.distributed.a2a_routes import ExchangeLayout, HostRoutes, exchange_layout
from moe_overlap.distributed.collectives import all_gather_into
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.distributed.streams import exposed_wait
from moe_overlap.layers.exchange_plan import ExpertTPPlan, Planner
from moe_overlap.layers.router import Routing
from moe_overlap.layers.wire_rows import WireRows


@dataclass
class HostExchange:
    """The part of a host plan that needs the counts: the exchange's routes (combine is their layout reversed),
    each chunk's grouped-GEMM offsets, and its expert-TP gather."""

    routes: HostRoutes
    offsets: list[torch.Tensor]  # per chunk: int32 grouped-GEMM end offsets of its experts
    expert_tp: list[ExpertTPPlan] | None  # per chunk, with expert-TP > 1
    grouped_row_of_copy_TK: torch.Tensor | None = None  # wire: each copy's grouped row at its destination
    grouped_rows: list[int] | None = None  # wire: rows of each chunk's grouped tensor

    @property
    def layout(self) -> ExchangeLayout:
        return self.routes.layout


class HostPlan:
    """Where every token copy goes and comes back for one layer call (see exchange_plan.Plan).

    The exchange part is built on first use: for a dropless plan that waits for the counts (the layer's one
    host sync), so work that does not need it, the permutation, is queued first and runs meanwhile.
    """

    overflow_chunk = False  # exact sizes: nothing overflows

    def __init__(self, row_of_copy_TK: torch.Tensor, all_rows_mapped: bool, chunk_experts: list[tuple[int, int]],
                 transport: Transport | None, exchange: HostExchange | Callable[[], HostExchange],
                 wire: WireRows | None = None):
        self.row_of_copy_TK = row_of_copy_TK
        self.all_rows_mapped = all_rows_mapped  # no capacity padding, no drops: known without the counts
        self.chunk_experts, self.transport = chunk_experts, transport
        self._exchange = exchange
        self.wire = wire

    @property
    def exchange(self) -> HostExchange:
        if callable(self._exchange):
            self._exchange = self._exchange()
        return self._exchange

    @property
    def num_rows(self) -> int:
        """Rows of the permuted (send) buffer: every copy's when all are mapped (known without the counts)."""
        if self.wire is not None:
            return self.wire.num_rows
        return self.row_of_copy_TK.numel() if self.all_rows_mapped else self.exchange.layout.send_total

    @property
    def routes(self) -> HostRoutes:
        return self.exchange.routes

    @property
    def offsets(self) -> list[torch.Tensor]:
        return self.exchange.offsets

    @property
    def expert_tp(self) -> list[ExpertTPPlan] | None:
        return self.exchange.expert_tp

    @property
    def grouped_row_of_copy_TK(self) -> torch.Tensor:
        return self.exchange.grouped_row_of_copy_TK

    @property
    def grouped_rows(self) -> list[int]:
        return self.exchange.grouped_rows


def start_counts_fetch(tokens_per_expert_E: torch.Tensor, group: GroupHandle) -> Callable[[], torch.Tensor]:
    """Start gathering every rank's copies per global expert to the host; the returned function waits for them:
    [rank of ``group``, global expert], int64 on the CPU."""
    counts_GE = tokens_per_expert_E.new_empty((group.size, tokens_per_expert_E.numel()))
    all_gather_into(counts_GE.view(-1), tokens_per_expert_E.contiguous(), group.group)
    if counts_GE.device.type != "cuda":
        return lambda: counts_GE
    host_GE = torch.empty(counts_GE.shape, dtype=counts_GE.dtype, pin_memory=True)
    host_GE.copy_(counts_GE, non_blocking=True)
    landed = torch.cuda.Event()
    landed.record()

    def wait() -> torch.Tensor:
        with exposed_wait("ep"):  # the host stops queueing work until the counts land
            landed.synchronize()
        return host_GE

    return wait


def block_transpose(rows_AB: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows stored as blocks in (a, b) order, block (a, b) holding ``rows_AB[a, b]`` rows: the gather index
    that reorders them into (b, a) order, and its inverse. Linear in the rows (no sort): block (b, a) of the
    result is block (a, b) of the source shifted by the difference of the two blocks' offsets."""
    sizes_AB = np.asarray(rows_AB, dtype=np.int64)
    source_start_AB = (np.cumsum(sizes_AB.ravel()) - sizes_AB.ravel()).reshape(sizes_AB.shape)
    sizes_BA = sizes_AB.T
    target_start_BA = (np.cumsum(sizes_BA.ravel()) - sizes_BA.ravel()).reshape(sizes_BA.shape)
    positions = np.arange(sizes_AB.sum())
    index = np.repeat((source_start_AB.T - target_start_BA).ravel(), sizes_BA.ravel()) + positions
    inverse = np.repeat((target_start_BA.T - source_start_AB).ravel(), sizes_AB.ravel()) + positions
    return index, inverse


def _to_device(host_arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host index arrays to the device in one pinned, non-blocking copy (one launch, no stall; also legal
    in graph capture), returned as views of that one device buffer."""
    packed = torch.from_numpy(np.concatenate([a.astype(np.int64) for a in host_arrays]))
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    return list(torch.split(packed, [a.size for a in host_arrays]))


def expert_tp_rows(counts_SPE: torch.Tensor, ep: GroupHandle) -> torch.Tensor:
    """From every expert rank's copies per global expert, [EP rank, expert-TP rank, expert], the rows each
    expert-TP peer of this rank receives per local expert: [expert-TP rank, local expert]."""
    local = counts_SPE.shape[-1] // ep.size
    return counts_SPE[:, :, ep.rank * local:(ep.rank + 1) * local].sum(0)


def plan_expert_tp(rows_PL: torch.Tensor, etp: GroupHandle, device: torch.device) -> ExpertTPPlan:
    rows = rows_PL.numpy()
    regroup, ungroup, ends = _to_device([*block_transpose(rows), np.cumsum(rows.sum(0))], device)
    return ExpertTPPlan(etp, rows.sum(1).tolist(), regroup, ungroup, ends.to(torch.int32))


class HostPlanner(Planner):
    """Builds a layer call's HostPlan from the counts it fetches over ``ep`` (with expert-TP > 1: over
    ``expert_mp``, EP x expert-TP, whose counts the expert-TP gather needs too)."""

    def __init__(self, num_experts: int, ep: GroupHandle, chunks: int, pad_to_capacity: bool,
                 transports: TransportSelector | None, device: torch.device, row_bytes: int,
                 etp: GroupHandle | None = None, expert_mp: GroupHandle | None = None, once_per_rank: bool = False,
                 topk: int = 0):
        super().__init__(num_experts, ep, chunks, pad_to_capacity, transports, device, row_bytes, once_per_rank, topk)
        self.etp = etp
        self.counts_group = ep if etp is None else expert_mp
        self._static: dict[int, HostExchange] = {}  # padded capacity's exchange, by capacity

    def plan(self, routing: Routing) -> HostPlan:
        if self.padded(routing):
            capacity = routing.capacity
            if capacity not in self._static:
                counts_GE = torch.full((self.counts_group.size, self.num_experts), capacity, dtype=torch.int64)
                self._static[capacity] = self._exchange(counts_GE)
            return HostPlan(self.permute_copies(routing), False, self.chunk_experts, self.transport(routing),
                            self._static[capacity])
        if self.targets is not None:
            return self._wire_plan(routing)
        fetch = start_counts_fetch(routing.tokens_per_expert_E, self.counts_group)  # before the permutation
        return HostPlan(self.permute_copies(routing), routing.keep_TK is None, self.chunk_experts,
                        self.transport(routing), lambda: self._exchange(fetch()))

    def _wire_plan(self, routing: Routing) -> HostPlan:
        """moe_dispatch_once_per_rank: one fetch of every rank's copies per expert and wire rows per target."""
        wire = self.wire_rows(routing)
        E = self.num_experts
        fetch = start_counts_fetch(torch.cat((routing.tokens_per_expert_E, wire.counts_V)), self.counts_group)
        row_of_copy_TK = self.permute_copies(routing)

        def exchange() -> HostExchange:
            counts_GX = fetch()
            counts_SE, wire_SV = counts_GX[:, :E], counts_GX[:, E:]
            rows_SDL = counts_SE.numpy().reshape(self.ep.size, self.ep.size, self.local)
            routes, _ = self.targets._tables(wire_SV.numpy().reshape(self.ep.size, self.ep.size, -1), offsets=False)
            _, offsets = self._tables(rows_SDL, routes=False)
            on_device_SE = counts_GX.to(self.device, non_blocking=True)[:, :E]  # pinned: one async copy
            grouped_TK = self.grouped_row_of_copies(on_device_SE, row_of_copy_TK, routing.experts_TK)
            grouped_rows = [int(rows_SDL[:, self.ep.rank, a:b].sum()) for a, b in self.chunk_experts]
            return HostExchange(routes, offsets, None, grouped_TK, grouped_rows)

        return HostPlan(row_of_copy_TK, routing.keep_TK is None, self.chunk_experts, self.transport(routing),
                        exchange, wire)

    def _exchange(self, counts_GE: torch.Tensor) -> HostExchange:
        """Host work on every dropless call, after the sync: numpy on a few hundred integers."""
        ep = self.ep
        counts_SE, rows_PL = counts_GE, None
        if self.etp is not None:
            counts_SPE = counts_GE.view(ep.size, self.etp.size, -1)
            counts_SE, rows_PL = counts_SPE[:, self.etp.rank], expert_tp_rows(counts_SPE, ep)
        rows_SDL = counts_SE.numpy().reshape(ep.size, ep.size, self.local)  # [source, destination, local expert]
        routes, offsets = self._tables(rows_SDL)
        expert_tp = None if rows_PL is None else [plan_expert_tp(rows_PL[:, a:b], self.etp, self.device)
                                                  for a, b in self.chunk_experts]
        return HostExchange(routes, offsets, expert_tp)

    def _tables(self, rows_SDL: np.ndarray, routes: bool = True, offsets: bool = True
                ) -> tuple[HostRoutes | None, list[torch.Tensor] | None]:
        """The routes and each chunk's grouped-GEMM offsets (either may be left out) from every rank's rows
        [source, destination, local expert], its index arrays sent to the device in one copy."""
        me, parts = self.ep.rank, routes * 2 + offsets
        host = []  # per chunk: regroup index (its rows arrive in (source, local expert) blocks; the grouped GEMM
        # takes (local expert, source)), its inverse, grouped-GEMM end offsets
        for start, stop in self.chunk_experts:
            block_rows = rows_SDL[:, me, start:stop]  # [source, local expert] of this chunk
            host += [*block_transpose(block_rows)] * routes + [np.cumsum(block_rows.sum(0))] * offsets
        device = _to_device(host, self.device)
        host_routes = None
        if routes:
            rows_SDC = np.stack([rows_SDL[:, :, a:b].sum(-1) for a, b in self.chunk_experts], axis=-1)
            host_routes = HostRoutes(exchange_layout(rows_SDC, me), device[0::parts], device[1::parts])
        # grouped_mm takes int32 offsets
        return host_routes, [o.to(torch.int32) for o in device[parts - 1::parts]] if offsets else None
