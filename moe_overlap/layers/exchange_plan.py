"""What a MoE layer call's exchange plan is, and what its two planners share.

A planner turns one call's routing into a plan, ``planner.plan(routing) -> Plan``: every token copy's row in
the permuted buffer, the rows ordered (chunk, destination EP rank, local expert) so that each chunk (a run of
local experts) is contiguous on both sides of the exchange; where each row goes and comes back (the routes);
each chunk's grouped-GEMM offsets; and the transport that moves the rows, its buffers sized for the call's worst
case. Each planner owns how it learns every rank's counts:

  host_plan.HostPlanner      one fetch of every rank's counts to the host per layer call (its one host sync),
                             exact buffers; nccl, copy_engine, gloo; the serial reference too
  device_plan.DevicePlanner  the counts gathered on the device by the transport, static worst-case buffers, no
                             host sync (CUDA-graph capturable); sm_push, or its gloo twin

Padded capacity needs neither: every (rank, expert) block holds exactly ``capacity`` rows.

With ``overlap.moe_dispatch_once_per_rank`` (layers/wire_rows.py) the rows that cross are a token's wire rows, one
per (chunk, destination rank) holding any of its experts: the plan's routes move those, and the copies' grouped
rows at their destination (from the same counts) travel beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.a2a_exchange import Transport
from moe_overlap.distributed.a2a_routes import DeviceRoutes, HostRoutes
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.kernels.copy_rows import copy_rows
from moe_overlap.kernels.wire_targets import grouped_rows_of_copies
from moe_overlap.layers.router import Routing
from moe_overlap.layers.wire_rows import WireRows, copies_per_wire_row, token_wire_rows, wire_row_bytes


@dataclass
class ExpertTPPlan:
    """Expert tensor parallelism around one chunk's grouped GEMMs: every expert-TP rank gathers the rows its peers
    received, runs its FFN slice on all of them, and the partial outputs are summed back to their owners."""

    group: GroupHandle  # the expert-TP group
    rows_per_peer: list[int]  # rows each expert-TP rank received from its EP exchange, by expert-TP rank
    regroup_index: torch.Tensor  # gathered rows from (peer, local expert) to (local expert, peer) order
    ungroup_index: torch.Tensor
    offsets: torch.Tensor  # int32 grouped-GEMM end offsets over the gathered rows


class Plan(Protocol):
    """What the pipeline (dispatch_pipeline.py) reads of one layer call's plan: host_plan.HostPlan or
    device_plan.DevicePlan."""

    row_of_copy_TK: torch.Tensor  # int32 permuted row of each copy, -1 if dropped
    all_rows_mapped: bool  # every permuted row holds a copy or is never read (no zero fill)
    chunk_experts: list[tuple[int, int]]  # local experts of each chunk
    transport: Transport | None  # what moves the rows (None: the serial reference's process group)
    wire: WireRows | None  # moe_dispatch_once_per_rank: the token side's wire rows (the routes move those)
    overflow_chunk: bool  # the last chunk is a bounded device plan's overflow chunk (all local experts)

    @property
    def num_rows(self) -> int: ...  # rows of the permuted buffer (wire: of the wire send buffer)

    @property
    def grouped_row_of_copy_TK(self) -> torch.Tensor: ...  # wire: each copy's grouped row at its destination

    @property
    def grouped_rows(self) -> list[int]: ...  # wire: rows of each chunk's grouped tensor

    @property
    def routes(self) -> HostRoutes | DeviceRoutes: ...

    @property
    def offsets(self) -> list[torch.Tensor]: ...  # per chunk: int32 grouped-GEMM end offsets of its experts

    @property
    def expert_tp(self) -> list[ExpertTPPlan] | None: ...  # per chunk, with expert-TP > 1


def chunk_bounds(local_experts: int, chunks: int) -> list[tuple[int, int]]:
    """Local experts cut into ``chunks`` contiguous runs, as even as possible (larger runs first)."""
    base, extra = divmod(local_experts, chunks)
    bounds, start = [], 0
    for chunk in range(chunks):
        stop = start + base + (chunk < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def exclusive_cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


class Planner:
    """What both planners share: the row order, the permutation of a call's copies into it, and the transport
    sized for the call's worst case. ``transports``: the model's selector (None: the serial reference);
    ``row_bytes``: the bytes of one row that moves (hidden x element size). ``topk``: with
    ``once_per_rank``, the copies per token (the wire rows' geometry: :attr:`targets`, the same planner over
    (rank, chunk) targets, one "expert" per chunk)."""

    def __init__(self, num_experts: int, ep: GroupHandle, chunks: int, pad_to_capacity: bool,
                 transports: TransportSelector | None, device: torch.device, row_bytes: int,
                 once_per_rank: bool = False, topk: int = 0):
        self.num_experts, self.ep, self.pad_to_capacity = num_experts, ep, pad_to_capacity
        self.transports, self.device, self.row_bytes = transports, device, row_bytes
        self.local = num_experts // ep.size
        self.chunk_experts = chunk_bounds(self.local, chunks)
        # slots: global experts in row order (chunk, destination rank, local expert)
        order = [d * self.local + l for start, stop in self.chunk_experts for d in range(ep.size)
                 for l in range(start, stop)]
        self.expert_of_slot = torch.tensor(order, dtype=torch.long, device=device)
        self.slot_of_expert = torch.empty_like(self.expert_of_slot)
        self.slot_of_expert[self.expert_of_slot] = torch.arange(num_experts, device=device)
        bounds = self.chunk_experts
        self.first_expert = torch.tensor([start for start, _ in bounds], device=device)
        self.chunk_of_expert = torch.tensor([c for c, (a, b) in enumerate(bounds) for _ in range(a, b)], device=device)
        self.targets: Planner | None = None
        self.slots = False  # wire rows in slots of T rows per (chunk, rank) target (DevicePlanner: copy engines)
        if once_per_rank:  # not with padded capacity nor expert-TP > 1 (MoELayer refuses them)
            self.copies = copies_per_wire_row(topk, bounds)
            self.targets = type(self)(ep.size * chunks, ep, chunks, False, transports, device, row_bytes)
            self.wire_bytes = wire_row_bytes(row_bytes, self.copies)
            # each global expert's target: its rank's chunk, rank x chunks + chunk
            self.target_of_expert = (torch.arange(num_experts, device=device) // self.local * chunks
                                     + self.chunk_of_expert.repeat(ep.size))

    def padded(self, routing: Routing) -> bool:
        """Every (rank, expert) block holds exactly ``capacity`` rows: static sizes."""
        return routing.capacity is not None and self.pad_to_capacity

    def permuted_rows(self, routing: Routing) -> int:
        """Static rows of a rank's permuted buffer: every copy's (dropless, or the kept ones first), or E x capacity
        (padded)."""
        return self.num_experts * routing.capacity if self.padded(routing) else routing.experts_TK.numel()

    def permute_copies(self, routing: Routing) -> torch.Tensor:
        """Each copy's row in the permuted buffer (int32, -1 if dropped)."""
        row_of_copy_TK, _, _ = copy_rows(self.slot_of_expert[routing.experts_TK], self.num_experts,
                                         routing.capacity if self.padded(routing) else None, routing.keep_TK)
        return row_of_copy_TK

    def wire_rows(self, routing: Routing) -> WireRows:
        """The token side's wire rows (moe_dispatch_once_per_rank)."""
        return token_wire_rows(routing.experts_TK, routing.keep_TK, self.target_of_expert,
                               self.targets.slot_of_expert, self.copies, self.slots)

    def grouped_blocks(self, counts_SE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every destination's grouped order of its received copies, each chunk in (local expert, source rank)
        blocks, from every rank's copies per global expert, [source rank, expert]: the blocks' rows
        [destination, local expert, source], their first rows within their chunk, and each chunk's first row
        (the chunks one after the other, unbounded)."""
        D, L = self.ep.size, self.local
        rows_DLS = counts_SE.view(D, D, L).permute(1, 2, 0)
        start_DLS = exclusive_cumsum(rows_DLS.reshape(D, L * D)).view(D, L, D)
        first_row_DC = start_DLS[:, self.first_expert, 0]
        return rows_DLS, start_DLS - first_row_DC[:, self.chunk_of_expert, None], first_row_DC

    def grouped_row_of_copies(self, counts_SE: torch.Tensor, row_of_copy_TK: torch.Tensor, experts_TK: torch.Tensor,
                              kept_E: torch.Tensor | None = None, within_DLS: torch.Tensor | None = None
                              ) -> torch.Tensor:
        """Each of this rank's copies' row in its destination's grouped tensor of the copy's chunk (int32; -1
        dropped): its block's first row there plus its place in this rank's block of that expert. ``kept_E``: per
        global expert, the rows its chunk keeps at its owner (a copy past them: -1). ``within_DLS``: the blocks'
        first rows within their chunks (:meth:`grouped_blocks`), if the caller has them."""
        E, me = self.num_experts, self.ep.rank
        if within_DLS is None:
            _, within_DLS, _ = self.grouped_blocks(counts_SE)
        send_start_E = exclusive_cumsum(counts_SE[me][self.expert_of_slot])[self.slot_of_expert]
        shift_E = within_DLS[:, :, me].reshape(E) - send_start_E
        return grouped_rows_of_copies(row_of_copy_TK, experts_TK, shift_E, kept_E)

    def transport(self, routing: Routing) -> Transport | None:
        """The transport, its regions holding the worst case of this call: every rank's copies landing on this
        rank (padded: exactly E x capacity rows)."""
        if self.transports is None:
            return None
        rows = self.permuted_rows(routing)
        if self.targets is not None:  # every source's wire rows, at most T x min(K, chunks) each, or the send buffer
            rows = routing.experts_TK.shape[0] * min(routing.experts_TK.shape[1], len(self.chunk_experts))
            return self.transports.transport(self.ep.size * rows * self.wire_bytes)
        return self.transports.transport((rows if self.padded(routing) else self.ep.size * rows) * self.row_bytes)
