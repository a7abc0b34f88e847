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
                  worst case: every rank's rows landing in it, EP x R; padded: exactly EP x capacity x its
                  experts), whose grouped GEMMs read the device offsets and skip rows past the last one
  combine route   each received row's source rank and its row in the source's permuted buffer

The memory price of no host sync is the worst case: a chunk's tensors hold EP x R rows whatever the routing
(host planning sizes them exactly). The math is the host plan's: the same rows meet the same weights in the
same (local expert, source rank) order.

Letters: E global experts, L local experts, S source rank, D destination rank, B a slot's block (an expert's
rows in the permuted order), C chunk, R permuted rows, W compact receive rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.a2a_exchange import Transport
from moe_overlap.distributed.a2a_routes import DeviceRoutes
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.kernels.routes import fill_routes
from moe_overlap.layers.exchange_plan import Planner
from moe_overlap.layers.router import Routing


@dataclass
class DevicePlan:
    """One layer call's plan with every size on the device (see exchange_plan.Plan)."""

    row_of_copy_TK: torch.Tensor  # int32 permuted row of each copy, -1 if dropped
    num_rows: int  # static rows of the permuted buffer
    all_rows_mapped: bool  # no zero fill: every row is a copy's or never read (only padding must be zero)
    chunk_experts: list[tuple[int, int]]
    routes: DeviceRoutes
    offsets: list[torch.Tensor]  # per chunk: int32 grouped-GEMM end offsets within its tensor
    transport: Transport
    expert_tp = None  # device planning with expert-TP > 1 is refused (exchange_rules.expert_tp_refusal)


def _exclusive_cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


class DevicePlanner(Planner):
    """Builds a layer call's DevicePlan from the counts its transport gathers on the device; the row order is the
    host planner's (the same slots, the same chunks)."""

    def __init__(self, num_experts: int, ep: GroupHandle, chunks: int, pad_to_capacity: bool,
                 transports: TransportSelector, device: torch.device, row_bytes: int):
        super().__init__(num_experts, ep, chunks, pad_to_capacity, transports, device, row_bytes)
        ranks, bounds = ep.size, self.chunk_experts
        self.rank_of_slot = (self.expert_of_slot // self.local).to(torch.int32)
        self.source_of_block = torch.arange(ranks, dtype=torch.int32, device=device).repeat(self.local)  # (l, s)
        self.first_slot = torch.tensor([ranks * start for start, _ in bounds], device=device)
        self.last_slot = torch.tensor([ranks * stop - 1 for _, stop in bounds], device=device)
        self.first_expert = torch.tensor([start for start, _ in bounds], device=device)
        self.last_expert = torch.tensor([stop - 1 for _, stop in bounds], device=device)
        self.chunk_of_expert = torch.tensor([c for c, (a, b) in enumerate(bounds) for _ in range(a, b)], device=device)
        self._static_counts: dict[int, torch.Tensor] = {}

    def static_counts(self, capacity: int) -> torch.Tensor:
        """Padded capacity: every rank sends ``capacity`` rows to every expert."""
        if capacity not in self._static_counts:
            self._static_counts[capacity] = torch.full((self.ep.size, self.num_experts), capacity,
                                                       dtype=torch.int64, device=self.device)
        return self._static_counts[capacity]

    def plan(self, routing: Routing) -> DevicePlan:
        padded = self.padded(routing)
        transport = self.transport(routing)
        # every rank's (kept) copies per global expert, [source rank, expert], on the device
        counts_SE = (self.static_counts(routing.capacity) if padded
                     else transport.gather_counts(routing.tokens_per_expert_E))
        E, D, me = self.num_experts, self.ep.size, self.ep.rank
        L = self.local
        row_of_copy_TK = self.permute_copies(routing)
        R = self.permuted_rows(routing)
        # Static sizes assume one micro-batch shape on every EP rank; checked on the device.
        torch._assert_async(torch.all(counts_SE.sum(1) <= R), f"overlap.moe_planning=device: every EP rank must "
                            f"route at most {R} copies (the same micro-batch shape on every rank)")
        blocks_SB = counts_SE[:, self.expert_of_slot]  # every source's permuted blocks, in slot order
        send_start_SB = _exclusive_cumsum(blocks_SB)
        rows_DLS = counts_SE.view(D, D, L).permute(1, 2, 0)  # [destination, local expert, source]
        recv_start_DLS = _exclusive_cumsum(rows_DLS.reshape(D, L * D)).view(D, L, D)
        # Dispatch: my block of slot b goes to rank d = its expert's owner, at that rank's block (l, me).
        dst_start_B = recv_start_DLS[:, :, me].reshape(E)[self.expert_of_slot]
        dst_rank_R = torch.empty(R, dtype=torch.int32, device=counts_SE.device)
        dst_row_R = torch.empty(R, dtype=torch.int64, device=counts_SE.device)
        fill_routes(send_start_SB[me], blocks_SB[me], self.rank_of_slot, dst_start_B, dst_rank_R, dst_row_R)
        # Combine: my received block (l, s) goes back to source s, where its block of slot (me, l) starts.
        W = R if padded else D * R  # padded: every rank sends exactly capacity rows per expert
        back_start_LS = send_start_SB[:, self.slot_of_expert[me * L:(me + 1) * L]].T
        back_rank_W = torch.empty(W, dtype=torch.int32, device=counts_SE.device)
        back_row_W = torch.empty(W, dtype=torch.int64, device=counts_SE.device)
        fill_routes(recv_start_DLS[me].reshape(-1), rows_DLS[me].reshape(-1), self.source_of_block,
                    back_start_LS.reshape(-1), back_rank_W, back_row_W)
        # Chunks: contiguous runs of my slots on the send side, of my local experts on the receive side.
        send_start_C = send_start_SB[me][self.first_slot]
        send_rows_C = torch.cumsum(blocks_SB[me], 0)[self.last_slot] - send_start_C
        recv_end_L = torch.cumsum(rows_DLS[me].sum(1), 0)
        recv_start_C = recv_start_DLS[me, :, 0][self.first_expert]
        recv_rows_C = recv_end_L[self.last_expert] - recv_start_C
        offsets_L = (recv_end_L - recv_start_C[self.chunk_of_expert]).to(torch.int32)
        chunk_rows = [D * routing.capacity * (b - a) if padded else W for a, b in self.chunk_experts]
        routes = DeviceRoutes(send_start_C, send_rows_C, dst_rank_R, dst_row_R, recv_start_C, recv_rows_C,
                              back_rank_W, back_row_W, R, W, chunk_rows)
        offsets = [offsets_L[a:b] for a, b in self.chunk_experts]
        return DevicePlan(row_of_copy_TK, R, not padded, self.chunk_experts, routes, offsets, transport)
