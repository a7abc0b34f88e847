"""The device-planned dispatch (``overlap.moe_planning: device``): every size stays on the GPU, so a layer call
never waits for the host and can be captured in a CUDA graph.

The host-planned plan (host_plan.py) fetches every rank's counts to the host once per layer, because NCCL and
copy-engine exchanges take host sizes. Here the transport gathers the counts on the device (or they are static:
padded capacity), and the routes of both directions follow from them with static shapes:

  permuted rows   this rank's token copies ordered (chunk, destination rank, local expert), as on the host, in a
                  buffer of R rows: T x K (dropless; with drops the kept copies come first) or E x capacity
                  (padded); rows past the count are never read
  dispatch route  each permuted row's destination rank and row in that rank's compact receive buffer, where the
                  chunks follow each other, each in grouped (local expert, source rank) order
  chunks          each chunk's rows copied out of the receive buffer to row 0 of a tensor of static rows (its
                  bound, below), whose grouped GEMMs read the device offsets and skip rows past the last one
  combine route   each received row's source rank and its row in the source's permuted buffer

Static sizes, the receive bound (``overlap.moe_expert_rank_capacity_factor``, Megatron's name): a chunk of n of the
L local experts receives at most ``ceil(factor x R x n / L)`` rows (factor x its balanced share: with every rank
routing R copies evenly, each rank receives R), so the compact receive buffer (``receive_rows``: the chunks' bounds
summed, plus one spare row), the chunk tensors, the tensors they stash for the backward and the transport's
symmetric regions hold O(R x factor) rows whatever the EP size. null: the worst case, every rank's R copies
landing in the chunk (EP x R rows, never exceeded; the buffer EP x R + 1). Padded capacity is exact: EP x capacity
rows per local expert. A rank's rows past its chunk's bound are *overflow*: every sender sees every rank's counts,
so the dispatch route sends them all to the spare row (memory is never written out of bounds), the GEMM offsets
stop at the bound, and the plan counts them on the device (``overflow_rows``, summed into the transport selector's
counter). The step's result is then wrong: the trainer skips its update on the device and runs it again planned on
the host (training/trainer.py), so training stays dropless. With no overflow the rows, their order and the math
are the host plan's: the same rows meet the same weights in the same (local expert, source rank) order.

The overflow chunk (``overlap.moe_overflow_capacity_factor``): the rows past their chunk's bound go instead to one
more chunk over all the local experts, of ``ceil(overflow factor x R)`` static rows, after the chunks in the compact
receive buffer and in (local expert, source rank) order too. They travel with their own chunk's rows (only their
route differs), its grouped GEMMs run after the last chunk's, and its rows go back like a chunk's: a skewed layer
call stays inside its CUDA graph at the cost of one more GEMM. Only rows past the overflow chunk's bound too go to
the spare row and make the step run again. Each row meets the same weights; an expert's weight gradient is then
summed from two runs of its rows. With one chunk there is no overflow chunk: its room joins the chunk's bound
(:func:`planned_factors`).

With wire rows (each token once per rank, wire_rows.py) a copy past its chunk's bound leaves its wire row (which still
carries the token's other copies) and crosses again as a row of its own, one copy, after this rank's wire rows (at
most the overflow chunk's rows a rank sends; the first ones of each block in slot order); the output comes back to
that row and the token sums it with its wire rows'. A chunk's wire rows may then pass their own bound (they follow
the copies past it): they share the overflow chunk's room in the receive buffer, so that the buffer does not grow,
and every wire row fits wherever every copy found a place (a wire row that does not, never comes back: a copy there
was counted, and the step runs again).

Wire rows in slots (``overlap.moe_transport: copy_engine``). The copy engines take host sizes, so with device
planning each rank lays its wire rows for each (rank, chunk) target in a slot of the micro-batch's T rows: its tokens
for that target first, then rows that carry no copy. Every rank receives a slot from every rank. The routes are then
the same on every call of one micro-batch shape (host routes made once, :meth:`DevicePlanner.slot_routes`), and a
slot never overflows; the copies' grouped rows are planned as above. The rows no token takes cross too, but no SM
moves any row.

Letters: E global experts, L local experts, S source rank, D destination rank, B a slot's block (an expert's
rows in the permuted order), C chunk, R permuted rows, W compact receive rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch

from moe_overlap.config import OverlapConfig
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.a2a_exchange import Transport
from moe_overlap.distributed.a2a_routes import DeviceRoutes, HostRoutes, exchange_layout
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.exchange_rules import slots_refusal
from moe_overlap.kernels.routes import fill_routes
from moe_overlap.layers.exchange_plan import Planner, exclusive_cumsum
from moe_overlap.layers.router import Routing
from moe_overlap.layers.wire_rows import WireRows


@dataclass
class DevicePlan:
    """One layer call's plan with every size on the device (see exchange_plan.Plan)."""

    row_of_copy_TK: torch.Tensor  # int32 permuted row of each copy, -1 if dropped
    num_rows: int  # static rows of the permuted buffer (wire: of the wire send buffer)
    all_rows_mapped: bool  # no zero fill: every row is a copy's or never read (only padding must be zero)
    chunk_experts: list[tuple[int, int]]
    routes: DeviceRoutes
    offsets: list[torch.Tensor]  # per chunk: int32 grouped-GEMM end offsets within its tensor
    transport: Transport
    overflow_rows: torch.Tensor  # int64 scalar: rows this rank receives past its chunks' bounds (0: exact)
    wire: WireRows | None = None  # moe_dispatch_once_per_rank: the routes move these
    grouped_row_of_copy_TK: torch.Tensor | None = None  # wire: each copy's grouped row at its destination
    grouped_rows: list[int] | None = None  # wire: static rows of each chunk's grouped tensor (its bound)
    overflow_chunk: bool = False  # the last chunk is the overflow chunk (all local experts, after the others)
    expert_tp = None  # device planning with expert-TP > 1 is refused (exchange_rules.expert_tp_refusal)


@dataclass
class _Layout:
    """Every destination's compact receive layout from every rank's counts (DevicePlanner.layout). What only the
    routes read is made when first read (each op a kernel: a copies' layout under wire rows needs none of it)."""

    counts_SE: torch.Tensor
    rows_DLS: torch.Tensor  # [destination, local expert, source]
    within_DLS: torch.Tensor  # each block's first row within its chunk, unbounded
    end_DL: torch.Tensor
    first_row_DC: torch.Tensor  # each chunk's first row, as if unbounded
    arrived_DC: torch.Tensor
    kept_DC: torch.Tensor  # rows that fit the chunk's bound
    start_DC: torch.Tensor
    expert_of_slot: torch.Tensor  # the planner's tables that the routes' fields read
    chunk_of_expert: torch.Tensor
    bound_C: torch.Tensor  # each chunk's static rows
    overflow_bound: int = 0  # the overflow chunk's static rows (0: none)
    # wire rows: each source sends at most this many overflow rows, as their own rows after its wire rows (0: the
    # overflow rows travel with their chunks' rows, no cap)
    send_cap: int = 0
    slot_of_expert: torch.Tensor | None = None  # (with send_cap) the planner's table
    receive_start_D: torch.Tensor | None = None  # (wire rows) the overflow chunk's first row: after the wire rows
    room_D: torch.Tensor | None = None  # (wire rows) the receive buffer's rows the wire rows left the overflow chunk

    @cached_property
    def blocks_SB(self) -> torch.Tensor:  # every source's permuted blocks, in slot order
        return self.counts_SE[:, self.expert_of_slot]

    @cached_property
    def send_start_SB(self) -> torch.Tensor:
        return exclusive_cumsum(self.blocks_SB)

    @cached_property
    def recv_start_DLS(self) -> torch.Tensor:  # each block's first row in its destination's compact buffer
        return self.start_DC[:, self.chunk_of_expert, None] + self.within_DLS

    @cached_property
    def limit_DC(self) -> torch.Tensor:  # a row at or past it does not fit: the spare row takes it
        return self.start_DC + self.kept_DC

    # the overflow chunk's layout (made when first read, with one)
    @cached_property
    def fit_DLS(self) -> torch.Tensor:  # each block's rows within its chunk's bound (the first ones)
        bound_DLS = self.bound_C[self.chunk_of_expert][None, :, None]
        return torch.minimum(self.rows_DLS, (bound_DLS - self.within_DLS).clamp(min=0))

    @cached_property
    def over_SB(self) -> torch.Tensor:  # every source's rows past the bound that it sends, per block in slot order
        D, L, S = self.rows_DLS.shape
        over_SB = (self.rows_DLS - self.fit_DLS).permute(2, 0, 1).reshape(S, D * L)[:, self.expert_of_slot]
        if not self.send_cap:
            return over_SB
        return torch.minimum(over_SB, (self.send_cap - exclusive_cumsum(over_SB)).clamp(min=0))  # the first ones

    @cached_property
    def over_send_start_SB(self) -> torch.Tensor:  # (send_cap) each block's first overflow row in its source's run
        return exclusive_cumsum(self.over_SB)

    @cached_property
    def over_DLS(self) -> torch.Tensor:  # each block's rows that its source sends past the bound
        if not self.send_cap:
            return self.rows_DLS - self.fit_DLS
        D, L, S = self.rows_DLS.shape
        return self.over_SB[:, self.slot_of_expert].view(S, D, L).permute(1, 2, 0)

    @cached_property
    def over_within_DLS(self) -> torch.Tensor:  # each block's first row past its bound within the overflow chunk
        D, L, S = self.rows_DLS.shape
        return exclusive_cumsum(self.over_DLS.reshape(D, L * S)).view(D, L, S)

    @cached_property
    def over_start_D(self) -> torch.Tensor:  # the overflow chunk's first row: after the chunks' kept rows
        return self.kept_DC.sum(1) if self.receive_start_D is None else self.receive_start_D

    @cached_property
    def over_kept_D(self) -> torch.Tensor:  # the overflow chunk's rows that fit its bound (and room)
        kept_D = torch.clamp(self.over_DLS.sum((1, 2)), max=self.overflow_bound)
        return kept_D if self.room_D is None else torch.minimum(kept_D, self.room_D)

    @cached_property
    def over_limit_D(self) -> torch.Tensor:
        return self.over_start_D + self.over_kept_D


def chunk_bounds_rows(ranks: int, rows: int, chunk_experts: list[tuple[int, int]], factor: float | None) -> list[int]:
    """Static rows each chunk of a rank's local experts may receive per layer call: ``ceil(factor x rows x its
    share of the local experts)`` (``rows``: the copies every rank routes, T x K; factor x the balanced share), at
    most every rank's copies (``ranks x rows``); ``factor`` None: that worst case, which no routing exceeds."""
    local = chunk_experts[-1][1]
    worst = ranks * rows
    if factor is None:
        return [worst] * len(chunk_experts)
    return [min(worst, math.ceil(factor * rows * (stop - start) / local)) for start, stop in chunk_experts]


def planned_factors(chunks: int, factor: float | None, overflow: float | None) -> tuple[float | None, float | None]:
    """(the chunks' bound, the overflow chunk's) as planned from ``overlap.moe_expert_rank_capacity_factor`` and
    ``moe_overflow_capacity_factor``: no overflow chunk without a bound, and none with one chunk either. There its
    room joins the chunk's bound (factor + overflow): the same static rows (fewer with wire rows, which then need no
    room of their own) without a second exchange in every layer call (at EP=2 the overflow chunk with nothing to take
    cost 1.029x the unbounded step, the bound alone 1.002x). Rows past ``factor`` still count as overflow
    (``moe_overflow_rows``); only rows past both make the step run again, as with the overflow chunk."""
    if factor is None or overflow is None:
        return factor, None
    return (factor + overflow, None) if chunks == 1 else (factor, overflow)


def overflow_chunks(overlap: OverlapConfig) -> int:
    """The chunks the overflow chunk adds to a MoE layer call as ``overlap`` plans it: 1 or 0 (planned_factors)."""
    return int(planned_factors(overlap.moe_pipeline_chunks, overlap.moe_expert_rank_capacity_factor,
                               overlap.moe_overflow_capacity_factor)[1] is not None)


def overflow_chunk_rows(ranks: int, rows: int, factor: float | None) -> int:
    """Static rows of the overflow chunk: ``ceil(factor x rows)``, at most every rank's copies; 0 without one."""
    return 0 if factor is None else min(ranks * rows, math.ceil(factor * rows))


def receive_rows(ranks: int, rows: int, chunk_experts: list[tuple[int, int]], factor: float | None,
                 overflow_factor: float | None = None) -> int:
    """Static rows of the compact receive buffer (and the transport's symmetric regions, in rows): the chunks'
    bounds summed (the overflow chunk's too), at most every rank's copies, plus the spare row that rows past them
    land in."""
    bounds = sum(chunk_bounds_rows(ranks, rows, chunk_experts, factor))
    return min(ranks * rows, bounds + overflow_chunk_rows(ranks, rows, overflow_factor)) + 1


def wire_chunk_rows(ranks: int, rows: int, tokens: int, chunk_experts: list[tuple[int, int]],
                    factor: float | None, overflow_factor: float | None = None) -> list[int]:
    """moe_dispatch_once_per_rank: static wire rows each chunk of a rank's local experts may receive per layer
    call: at most its copies' bound (a wire row carries one copy or more) and every rank's ``tokens`` (a token
    crosses once per chunk and rank). Wire rows past the bound only arrive where copies overflowed theirs too, so
    with the overflow chunk a chunk's wire rows may pass it by that chunk's rows."""
    over = overflow_chunk_rows(ranks, rows, overflow_factor)
    return [min(ranks * tokens, bound + over) for bound in chunk_bounds_rows(ranks, rows, chunk_experts, factor)]


def wire_receive_rows(ranks: int, rows: int, tokens: int, chunk_experts: list[tuple[int, int]],
                      factor: float | None, overflow_factor: float | None = None) -> int:
    """moe_dispatch_once_per_rank: static rows of the compact receive buffer of wire rows: the chunks' wire rows
    (:func:`wire_chunk_rows`), the overflow chunk's rows (one copy each), the spare row. The wire rows past their
    bounds are at most the copies past theirs, so where the overflow chunk takes every such copy (``over`` rows)
    they need ``over`` rows more: the room both share is twice the overflow chunk's rows."""
    over = overflow_chunk_rows(ranks, rows, overflow_factor)
    bounds = sum(wire_chunk_rows(ranks, rows, tokens, chunk_experts, factor))
    passing = sum(wire_chunk_rows(ranks, rows, tokens, chunk_experts, factor, overflow_factor))
    return min(bounds + over, passing) + over + 1


def region_rows(receive_rows: int, permuted_rows: int) -> int:
    """Rows each of the transport's symmetric regions holds for a layer call: the compact receive buffer
    (dispatch) or a permuted buffer (combine: every row back at its source), whichever is larger."""
    return max(receive_rows, permuted_rows)


class DevicePlanner(Planner):
    """Builds a layer call's DevicePlan from the counts its transport gathers on the device; the row order is the
    host planner's (the same slots, the same chunks)."""

    def __init__(self, num_experts: int, ep: GroupHandle, chunks: int, pad_to_capacity: bool,
                 transports: TransportSelector, device: torch.device, row_bytes: int,
                 capacity_factor: float | None = None, once_per_rank: bool = False, topk: int = 0,
                 overflow_factor: float | None = None):
        super().__init__(num_experts, ep, chunks, pad_to_capacity, transports, device, row_bytes, once_per_rank, topk)
        # overlap.moe_expert_rank_capacity_factor (None: the worst case) and moe_overflow_capacity_factor (None: no
        # overflow chunk), as planned; with one chunk the overflow room is in the bound and rows past the
        # configured factor are counted against ``counted_factor``
        self.capacity_factor, self.overflow_factor = planned_factors(len(self.chunk_experts), capacity_factor,
                                                                     overflow_factor)
        folded = overflow_factor is not None and capacity_factor is not None and self.overflow_factor is None
        self.counted_factor = capacity_factor if folded else None
        ranks, bounds = ep.size, self.chunk_experts
        self.rank_of_slot = (self.expert_of_slot // self.local).to(torch.int32)
        self.source_of_block = torch.arange(ranks, dtype=torch.int32, device=device).repeat(self.local)  # (l, s)
        self.first_slot = torch.tensor([ranks * start for start, _ in bounds], device=device)
        self.last_slot = torch.tensor([ranks * stop - 1 for _, stop in bounds], device=device)
        self.last_expert = torch.tensor([stop - 1 for _, stop in bounds], device=device)
        self.chunk_of_slot = self.chunk_of_expert[self.expert_of_slot % self.local]
        self._static_counts: dict[int, torch.Tensor] = {}
        self._bounds: dict[tuple, tuple[list[int], torch.Tensor, int]] = {}
        self._counted: dict[int, torch.Tensor] = {}  # counted_factor's bound of each chunk, per R
        self._slot_routes: dict[int, HostRoutes] = {}  # per T
        # wire rows in slots: the copy engines move rows of host sizes only (transports.name: the choice made once;
        # MoELayer refuses them without wire rows)
        self.slots = self.targets is not None and getattr(transports, "name", None) == "copy_engine"

    def static_counts(self, capacity: int) -> torch.Tensor:
        """Padded capacity: every rank sends ``capacity`` rows to every expert."""
        if capacity not in self._static_counts:
            self._static_counts[capacity] = torch.full((self.ep.size, self.num_experts), capacity,
                                                       dtype=torch.int64, device=self.device)
        return self._static_counts[capacity]

    def bounds(self, padded: bool, rows: int) -> tuple[list[int], torch.Tensor, int]:
        """Each chunk's static receive rows (a list, and on the device) and the compact receive buffer's rows, the
        last of them the spare row (see the module docstring); padded: exact, every rank's capacity per expert.
        The list ends with the overflow chunk's rows where there is one (not the device tensor)."""
        key = (padded, rows)
        if key not in self._bounds:
            D = self.ep.size
            if padded:  # rows = E x capacity: every rank sends capacity rows to each of a chunk's experts
                chunk_rows = [D * rows // self.num_experts * (b - a) for a, b in self.chunk_experts]
                bound_C, buffer_rows = torch.tensor(chunk_rows, device=self.device), sum(chunk_rows) + 1
            else:
                chunk_rows = chunk_bounds_rows(D, rows, self.chunk_experts, self.capacity_factor)
                bound_C = torch.tensor(chunk_rows, device=self.device)
                buffer_rows = receive_rows(D, rows, self.chunk_experts, self.capacity_factor, self.overflow_factor)
                if self.overflow_factor is not None:
                    chunk_rows = chunk_rows + [overflow_chunk_rows(D, rows, self.overflow_factor)]
            self._bounds[key] = (chunk_rows, bound_C, buffer_rows)
        return self._bounds[key]

    def wire_bounds(self, rows: int, tokens: int) -> tuple[list[int], torch.Tensor, int]:
        """moe_dispatch_once_per_rank: each chunk's static wire rows (:func:`wire_chunk_rows`), and the compact
        receive buffer's rows: theirs, the overflow chunk's (if any), the spare last."""
        key = (False, rows, tokens)
        if key not in self._bounds:
            ranks, chunks, factor, over = self.ep.size, self.chunk_experts, self.capacity_factor, self.overflow_factor
            chunk_rows = wire_chunk_rows(ranks, rows, tokens, chunks, factor, over)
            W = wire_receive_rows(ranks, rows, tokens, chunks, factor, over)
            self._bounds[key] = (chunk_rows, torch.tensor(chunk_rows, device=self.device), W)
        return self._bounds[key]

    def slot_routes(self, tokens: int) -> HostRoutes:
        """Wire rows in slots (the copy engines' exchange): every rank sends every (rank, chunk) target a slot of
        ``tokens`` rows, its wire rows for that target first, then rows that carry no copy. The layout is then the
        same on every call of that micro-batch shape: made on the host once, taken by a transport of host sizes, and
        replayed from a CUDA graph. A chunk's slots arrive in source order, which is the order its one target asks:
        no regrouping either way."""
        if tokens not in self._slot_routes:
            P, C = self.ep.size, len(self.chunk_experts)
            self._slot_routes[tokens] = HostRoutes(exchange_layout(np.full((P, P, C), tokens), self.ep.rank),
                                                   None, None)
        return self._slot_routes[tokens]

    def plan(self, routing: Routing) -> DevicePlan:
        if self.targets is not None:
            return self._wire_plan(routing)
        if getattr(self.transports, "name", None) == "copy_engine":  # a layer whose transport was swapped (benchmarks)
            raise ValueError(str(slots_refusal("device", "copy_engine", once_per_rank=False, overflow_chunk=False)))
        padded = self.padded(routing)
        R = self.permuted_rows(routing)
        chunk_rows, bound_C, W = self.bounds(padded, R)  # W: the compact receive rows, the spare one last
        transport = self.transports.transport(region_rows(W, R) * self.row_bytes)
        # every rank's (kept) copies per global expert, [source rank, expert], on the device
        counts_SE = (self.static_counts(routing.capacity) if padded
                     else transport.gather_counts(routing.tokens_per_expert_E))
        row_of_copy_TK = self.permute_copies(routing)
        self._check_rows(counts_SE, R)
        overflow = not padded and self.overflow_factor is not None  # chunk_rows ends with the overflow chunk's
        layout = self.layout(counts_SE, bound_C, chunk_rows[-1] if overflow else 0)
        overflow_rows = self._count_overflow(layout, None if padded else R)
        chunk_experts = self.chunk_experts + [(0, self.local)] * overflow
        return DevicePlan(row_of_copy_TK, R, not padded, chunk_experts, self.routes(layout, R, W, chunk_rows),
                          self.offsets(layout), transport, overflow_rows, overflow_chunk=overflow)

    def _wire_plan(self, routing: Routing) -> DevicePlan:
        """moe_dispatch_once_per_rank: the copies' layout bounds the grouped tensors, places every copy and counts
        the overflow; the routes move wire rows within their own bounds (:func:`wire_chunk_rows`). With the
        overflow chunk, the copies past their chunk's bound cross again as rows of their own
        (:meth:`_wire_overflow`)."""
        E, T = self.num_experts, routing.experts_TK.shape[0]
        R = self.permuted_rows(routing)
        chunk_rows, bound_C, _ = self.bounds(False, R)  # ends with the overflow chunk's rows where there is one
        over = chunk_rows[-1] if self.overflow_factor is not None else 0
        wire = self.wire_rows(routing)
        if self.slots:  # every rank sends every (rank, chunk) target a slot of T rows
            W = self.ep.size * len(self.chunk_experts) * T + 1
        else:
            wire_chunk_rows, wire_bound_C, W = self.wire_bounds(R, T)
        transport = self.transports.transport(region_rows(W, wire.num_rows + over) * self.wire_bytes)
        # every rank's copies per expert, and (compact wire rows only: slots are static) its wire rows per target
        counts_SX = transport.gather_counts(routing.tokens_per_expert_E if self.slots
                                            else torch.cat((routing.tokens_per_expert_E, wire.counts_V)))
        counts_SE, wire_SV = counts_SX[:, :E].contiguous(), counts_SX[:, E:].contiguous()
        row_of_copy_TK = self.permute_copies(routing)
        self._check_rows(counts_SE, R)
        targets = self.targets
        wire_layout = None if self.slots else targets.layout(wire_SV, wire_bound_C, total_rows=W - 1)
        if not over:
            layout = self.layout(counts_SE, bound_C)
            kept_E = layout.kept_DC[:, self.chunk_of_expert].reshape(E)
            grouped_TK = self.grouped_row_of_copies(counts_SE, row_of_copy_TK, routing.experts_TK, kept_E,
                                                    layout.within_DLS)
            routes = (self.slot_routes(T) if self.slots
                      else targets.routes(wire_layout, wire.num_rows, W, wire_chunk_rows))
            return DevicePlan(row_of_copy_TK, wire.num_rows, True, self.chunk_experts, routes, self.offsets(layout),
                              transport, self._count_overflow(layout, R), wire, grouped_TK, chunk_rows)
        if self.slots:
            raise ValueError(str(slots_refusal("device", "copy_engine", once_per_rank=True, overflow_chunk=True)))
        # a destination's overflow chunk: after its wire rows, in the room they left
        wire_rows_D = wire_layout.kept_DC.sum(1)
        layout = self.layout(counts_SE, bound_C, over, send_cap=over, receive_start_D=wire_rows_D,
                             room_D=W - 1 - wire_rows_D)
        grouped_TK, sent = self._wire_overflow(layout, wire, row_of_copy_TK, routing.experts_TK, counts_SE)
        routes = self._wire_overflow_routes(layout, targets.routes(wire_layout, sent.num_rows, W, wire_chunk_rows),
                                            wire.num_rows)
        return DevicePlan(row_of_copy_TK, sent.num_rows, True, self.chunk_experts + [(0, self.local)], routes,
                          self.offsets(layout), transport, self._count_overflow(layout), sent, grouped_TK,
                          chunk_rows, overflow_chunk=True)

    def _wire_overflow(self, lay: _Layout, wire: WireRows, row_of_copy_TK: torch.Tensor, experts_TK: torch.Tensor,
                       counts_SE: torch.Tensor) -> tuple[torch.Tensor, WireRows]:
        """Wire rows with the overflow chunk: a copy past its chunk's bound leaves its wire row (which may still
        carry the token's other copies) and crosses as a row of its own, one copy each, after the wire rows (at
        most ``lay.send_cap`` a rank: each block's first ones), to the destination's overflow chunk in (local
        expert, source) order. Returns each copy's grouped row (in its chunk's tensor, or in the overflow chunk's;
        -1: dropped, or placed by no bound), and the wire rows with the overflow rows after them (a token's rows and
        its copies' rows and slots now name them)."""
        E, me, base, cap = self.num_experts, self.ep.rank, wire.num_rows, lay.send_cap
        T, K = experts_TK.shape
        grouped_TK = self.grouped_row_of_copies(counts_SE, row_of_copy_TK, experts_TK, None, lay.within_DLS).long()
        expert_TK = experts_TK.long().clamp(0, E - 1)

        def mine(table_DLS: torch.Tensor) -> torch.Tensor:  # each copy's block's value (this rank the source)
            return table_DLS[:, :, me].reshape(E)[expert_TK]

        past_TK = grouped_TK - mine(lay.within_DLS) - mine(lay.fit_DLS)  # its place past the bound (< 0: fits)
        kept_TK = grouped_TK >= 0
        fits_TK = kept_TK & (past_TK < 0)
        sent_TK = kept_TK & (past_TK >= 0) & (past_TK < mine(lay.over_DLS))
        over_row_TK = mine(lay.over_within_DLS) + past_TK
        placed_TK = sent_TK & (over_row_TK < lay.over_kept_D[expert_TK // self.local])  # within its room there
        grouped_TK = torch.where(fits_TK, grouped_TK, torch.where(placed_TK, over_row_TK, -1)).to(torch.int32)
        send_row_TK = base + lay.over_send_start_SB[me][self.slot_of_expert[expert_TK]] + past_TK
        row_TK = torch.where(sent_TK, send_row_TK, base + cap)  # not sent: the spare
        token_of_row_R = torch.zeros(base + cap + 1, dtype=wire.token_of_row_R.dtype, device=self.device)
        token_of_row_R[:base] = wire.token_of_row_R
        token_of_row_R.scatter_(0, row_TK.reshape(-1), torch.arange(T, dtype=token_of_row_R.dtype,
                                                                    device=self.device).repeat_interleave(K))
        in_wire_TK = torch.where(wire.row_of_copy_TK < base, wire.row_of_copy_TK, base + cap)  # dropped: the spare
        own_rows_TK = torch.where(sent_TK, row_TK, -1).to(wire.row_TC.dtype)  # a token's overflow rows
        sent = replace(wire, row_TC=torch.cat((wire.row_TC, own_rows_TK), 1), overflow_from=wire.row_TC.shape[1],
                       token_of_row_R=token_of_row_R[:-1],
                       row_of_copy_TK=torch.where(sent_TK, row_TK, in_wire_TK),
                       slot_TK=torch.where(sent_TK, 0, wire.slot_TK), num_rows=base + cap)
        return grouped_TK, sent

    def _wire_overflow_routes(self, lay: _Layout, routes: DeviceRoutes, base: int) -> DeviceRoutes:
        """The wire rows' routes with the overflow chunk's after them: this rank's overflow rows (send rows from
        ``base``, block by block in slot order) to their destinations' overflow chunks (past its bound: the spare
        row), and its own overflow chunk's rows back to their sources' overflow rows."""
        E, me, L, W = self.num_experts, self.ep.rank, self.local, routes.recv_rows
        rows_B = lay.over_SB[me]
        send_start_B = base + lay.over_send_start_SB[me]
        dst_rank_B = self.rank_of_slot.long()
        dst_start_B = lay.over_start_D[dst_rank_B] + lay.over_within_DLS[:, :, me].reshape(E)[self.expert_of_slot]
        fill_routes(send_start_B, rows_B, self.rank_of_slot, dst_start_B, routes.dst_rank_R, routes.dst_row_R,
                    lay.over_limit_D[dst_rank_B], W - 1)
        limit = lay.over_limit_D[me]
        recv_start_LS = torch.minimum(lay.over_start_D[me] + lay.over_within_DLS[me].reshape(-1), limit)
        recv_rows_LS = torch.minimum(recv_start_LS + lay.over_DLS[me].reshape(-1), limit) - recv_start_LS
        back_start_LS = base + lay.over_send_start_SB[:, self.slot_of_expert[me * L:(me + 1) * L]].T.reshape(-1)
        fill_routes(recv_start_LS, recv_rows_LS, self.source_of_block, back_start_LS, routes.back_rank_W,
                    routes.back_row_W)

        def then(values_C: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            return torch.cat((values_C, value.reshape(1).to(values_C.dtype)))

        return replace(routes, send_start_C=then(routes.send_start_C, routes.send_start_C.new_full((1,), base)),
                       send_rows_C=then(routes.send_rows_C, rows_B.sum()),
                       recv_start_C=then(routes.recv_start_C, lay.over_start_D[me]),
                       recv_rows_C=then(routes.recv_rows_C, lay.over_kept_D[me]),
                       chunk_rows=routes.chunk_rows + [lay.overflow_bound])

    def _check_rows(self, counts_SE: torch.Tensor, R: int) -> None:
        # Static sizes assume one micro-batch shape on every EP rank; checked on the device.
        torch._assert_async(torch.all(counts_SE.sum(1) <= R), f"overlap.moe_planning=device: every EP rank must "
                            f"route at most {R} copies (the same micro-batch shape on every rank)")

    def _count_overflow(self, layout: _Layout, rows: int | None = None) -> torch.Tensor:
        """This rank's rows past their chunks' bounds, counted; those past the overflow chunk's too (where there is
        one; else all of them) are the ones that make the step run again. With the overflow room in one chunk's
        bound (``counted_factor``) the rows past the configured factor are counted (``rows``: the copies each rank
        routes, R; None: padded capacity, exact)."""
        me = self.ep.rank
        arrived_C = layout.arrived_DC[me]
        unplaced = (arrived_C - layout.kept_DC[me]).sum()
        overflow_rows = unplaced
        if layout.overflow_bound:
            unplaced = overflow_rows - layout.over_kept_D[me]
        elif self.counted_factor is not None and rows is not None:
            if rows not in self._counted:
                self._counted[rows] = torch.tensor(chunk_bounds_rows(self.ep.size, rows, self.chunk_experts,
                                                                     self.counted_factor), device=self.device)
            overflow_rows = (arrived_C - torch.minimum(arrived_C, self._counted[rows])).sum()
        self.transports.count_overflow(overflow_rows, unplaced)
        return overflow_rows

    def layout(self, counts_SE: torch.Tensor, bound_C: torch.Tensor, overflow_bound: int = 0,
               total_rows: int | None = None, **wire) -> _Layout:
        """Every destination's compact layout: its chunks follow each other, each holding its rows up to its
        bound (and all of them up to ``total_rows``, if given), then the overflow chunk (``overflow_bound`` rows; 0:
        none; ``wire``: its fields under wire rows, see _Layout)."""
        rows_DLS, within_DLS, first_row_DC = self.grouped_blocks(counts_SE)
        end_DL = torch.cumsum(rows_DLS.sum(2), 1)
        arrived_DC = end_DL[:, self.last_expert] - first_row_DC
        kept_DC = torch.minimum(arrived_DC, bound_C)
        if total_rows is not None:  # the chunks' rows before the total's
            kept_DC = torch.minimum(kept_DC, (total_rows - exclusive_cumsum(kept_DC)).clamp(min=0))
        return _Layout(counts_SE, rows_DLS, within_DLS, end_DL, first_row_DC, arrived_DC, kept_DC,
                       exclusive_cumsum(kept_DC), self.expert_of_slot, self.chunk_of_expert, bound_C, overflow_bound,
                       slot_of_expert=self.slot_of_expert, **wire)

    def routes(self, lay: _Layout, R: int, W: int, chunk_rows: list[int]) -> DeviceRoutes:
        E, me, L = self.num_experts, self.ep.rank, self.local
        device = lay.counts_SE.device
        # Dispatch: my block of slot b goes to rank d = its expert's owner, at that rank's block (l, me).
        dst_start_B = lay.recv_start_DLS[:, :, me].reshape(E)[self.expert_of_slot]
        dst_limit_B = lay.limit_DC[self.rank_of_slot.long(), self.chunk_of_slot]
        block_B = (lay.send_start_SB[me], lay.blocks_SB[me], self.rank_of_slot, dst_start_B, dst_limit_B)
        # Combine: my received block (l, s) goes back to source s, where its block of slot (me, l) starts; only
        # the rows that fit came.
        back_start_LS = lay.send_start_SB[:, self.slot_of_expert[me * L:(me + 1) * L]].T
        limit_L1 = lay.limit_DC[me, self.chunk_of_expert, None]
        recv_start_LS = torch.minimum(lay.recv_start_DLS[me], limit_L1)  # blocks past the limit: empty, in order
        fitting_LS = torch.minimum(lay.recv_start_DLS[me] + lay.rows_DLS[me], limit_L1) - recv_start_LS
        back_LS = (recv_start_LS.reshape(-1), fitting_LS.reshape(-1), self.source_of_block, back_start_LS.reshape(-1))
        # Chunks: contiguous runs of my slots on the send side, of my local experts on the receive side.
        send_start_C = lay.send_start_SB[me][self.first_slot]
        send_rows_C = torch.cumsum(lay.blocks_SB[me], 0)[self.last_slot] - send_start_C
        recv_start_C, recv_rows_C = lay.start_DC[me], lay.kept_DC[me]
        if lay.overflow_bound:
            block_B, back_LS = self._overflow_segments(lay, block_B, back_LS)
            # the overflow chunk: nothing more to send (its rows went with their chunks' rows), its rows after theirs
            send_start_C = torch.cat((send_start_C, (send_start_C[-1:] + send_rows_C[-1:])))
            send_rows_C = torch.cat((send_rows_C, send_rows_C.new_zeros(1)))
            recv_start_C = torch.cat((recv_start_C, lay.over_start_D[me:me + 1]))
            recv_rows_C = torch.cat((recv_rows_C, lay.over_kept_D[me:me + 1]))
        dst_rank_R = torch.empty(R, dtype=torch.int32, device=device)
        dst_row_R = torch.empty(R, dtype=torch.int64, device=device)
        fill_routes(*block_B[:4], dst_rank_R, dst_row_R, block_B[4], W - 1)
        back_rank_W = torch.empty(W, dtype=torch.int32, device=device)
        back_row_W = torch.empty(W, dtype=torch.int64, device=device)
        fill_routes(*back_LS, back_rank_W, back_row_W)
        return DeviceRoutes(send_start_C, send_rows_C, dst_rank_R, dst_row_R, recv_start_C, recv_rows_C,
                            back_rank_W, back_row_W, R, W, chunk_rows)

    def _overflow_segments(self, lay: _Layout, block_B: tuple, back_LS: tuple) -> tuple[tuple, tuple]:
        """The routes' block tables with the overflow chunk: each of my send blocks cut in two, its rows within the
        bound (to their chunk, as without) and the rest (to the destination's overflow chunk, at the block's place
        in its (local expert, source) order; past its bound: the spare row); and my overflow chunk's received blocks
        after the chunks' ones, back to where their rows sit in their source's block (after the rows that fit)."""
        E, me = self.num_experts, self.ep.rank
        send_start_B, rows_B, rank_B, dst_start_B, dst_limit_B = block_B
        dst_rank_B = rank_B.long()
        fit_B = lay.fit_DLS[:, :, me].reshape(E)[self.expert_of_slot]
        over_start_B = lay.over_start_D[dst_rank_B] + lay.over_within_DLS[:, :, me].reshape(E)[self.expert_of_slot]

        def interleave(first: torch.Tensor, then: torch.Tensor) -> torch.Tensor:  # each block's two runs in order
            return torch.stack((first, then), 1).reshape(-1)

        block_B = (interleave(send_start_B, send_start_B + fit_B), interleave(fit_B, rows_B - fit_B),
                   interleave(rank_B, rank_B), interleave(dst_start_B, over_start_B),
                   interleave(dst_limit_B, lay.over_limit_D[dst_rank_B]))
        recv_start_LS, fitting_LS, source_LS, back_start_LS = back_LS
        limit = lay.over_limit_D[me]
        over_start_LS = torch.minimum(lay.over_start_D[me] + lay.over_within_DLS[me].reshape(-1), limit)
        over_LS = torch.minimum(over_start_LS + lay.over_DLS[me].reshape(-1), limit) - over_start_LS
        back_LS = (torch.cat((recv_start_LS, over_start_LS)), torch.cat((fitting_LS, over_LS)),
                   source_LS.repeat(2), torch.cat((back_start_LS, back_start_LS + fitting_LS)))
        return block_B, back_LS

    def offsets(self, lay: _Layout) -> list[torch.Tensor]:
        """Each chunk's grouped-GEMM end offsets, stopping at its bound (the overflow chunk's last)."""
        me = self.ep.rank
        offsets_L = torch.minimum(lay.end_DL[me] - lay.first_row_DC[me, self.chunk_of_expert],
                                  lay.kept_DC[me, self.chunk_of_expert]).to(torch.int32)
        offsets = [offsets_L[start:stop] for start, stop in self.chunk_experts]
        if lay.overflow_bound:
            over_L = lay.over_DLS[me].sum(1)
            offsets.append(torch.minimum(torch.cumsum(over_L, 0), lay.over_kept_D[me]).to(torch.int32))
        return offsets
