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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.a2a_exchange import Transport
from moe_overlap.distributed.a2a_routes import DeviceRoutes, HostRoutes
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.kernels.permute import copy_rows
from moe_overlap.layers.router import Routing


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

    @property
    def num_rows(self) -> int: ...  # rows of the permuted buffer

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


class Planner:
    """What both planners share: the row order, the permutation of a call's copies into it, and the transport
    sized for the call's worst case. ``transports``: the model's selector (None: the serial reference);
    ``row_bytes``: the bytes of one row that moves (hidden x element size)."""

    def __init__(self, num_experts: int, ep: GroupHandle, chunks: int, pad_to_capacity: bool,
                 transports: TransportSelector | None, device: torch.device, row_bytes: int):
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

    def transport(self, routing: Routing) -> Transport | None:
        """The transport, its regions holding the worst case of this call: every rank's copies landing on this
        rank (padded: exactly E x capacity rows)."""
        if self.transports is None:
            return None
        rows = self.permuted_rows(routing)
        return self.transports.transport((rows if self.padded(routing) else self.ep.size * rows) * self.row_bytes)
