"""Expert-parallel token dispatch: the host-planned plan, and the serial path (the reference).

Stages, each a separately callable unit with its own forward and backward:
  permute    token copies into rows ordered (chunk, destination EP rank, local expert)  kernels.Permute
  dispatch   rows to the EP rank that holds their expert                              AllToAllRows
  regroup    received rows from (source rank, expert) to (expert, source rank) order  PermuteRows
  experts    grouped GEMMs                                                            experts.GroupedSwiGLU
  ungroup    back to (source rank, expert) order                                      PermuteRows
  combine    rows back to the rank that owns their token                              AllToAllRows
  unpermute  weighted sum of each token's k expert outputs                            kernels.Unpermute
The pipeline (dispatch_pipeline.py) runs the same units chunk by chunk, with this plan or the device-planned
one (device_plan.py); with one chunk the row order is the serial one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from moe_overlap.distributed.a2a import ExchangeLayout, HostRoutes, exchange_layout
from moe_overlap.distributed.collectives import AllToAllRows, all_gather_into, all_to_all_rows
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.distributed.streams import exposed_wait
from moe_overlap.kernels.permute import Permute, Unpermute, copy_rows


class PermuteRows(torch.autograd.Function):
    """rows = x[index] for a permutation ``index`` of x's rows; the backward gathers through ``inverse``
    (no scatter, no atomics, no fp32 round trip: every gradient row has exactly one source)."""

    @staticmethod
    def forward(ctx, x_RH: torch.Tensor, index_R: torch.Tensor, inverse_R: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse_R)
        return x_RH.index_select(0, index_R)

    @staticmethod
    def backward(ctx, grad_rows_RH: torch.Tensor):
        (inverse_R,) = ctx.saved_tensors
        return grad_rows_RH.index_select(0, inverse_R), None, None


def chunk_bounds(local_experts: int, chunks: int) -> list[tuple[int, int]]:
    """Local experts cut into ``chunks`` contiguous runs, as even as possible (larger runs first)."""
    base, extra = divmod(local_experts, chunks)
    bounds, start = [], 0
    for chunk in range(chunks):
        stop = start + base + (chunk < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass
class ExchangePlan:
    """The host-derived part of a dispatch: the exchange layout, each chunk's local regrouping (in ``routes``)
    and its grouped-GEMM offsets."""

    routes: HostRoutes  # the dispatch exchange; combine is its layout reversed
    chunk_experts: list[tuple[int, int]]  # local experts of each chunk
    offsets: list[torch.Tensor]  # per chunk: int32 grouped-GEMM end offsets of its experts

    @property
    def layout(self) -> ExchangeLayout:
        return self.routes.layout


class DispatchPlan:
    """Where every token copy goes and comes back for one layer call.

    The exchange part is built on first use: for a dropless plan that waits for the counts (the layer's one
    host sync), so work that does not need it, the permutation, is queued first and runs meanwhile.
    """

    def __init__(self, row_of_copy_TK: torch.Tensor, all_rows_mapped: bool, chunk_experts: list[tuple[int, int]],
                 exchange: ExchangePlan | Callable[[], ExchangePlan]):
        self.row_of_copy_TK = row_of_copy_TK  # int32 permuted row of each copy, -1 if dropped
        self.all_rows_mapped = all_rows_mapped  # every permuted row holds a copy (no capacity padding, no drops)
        self.chunk_experts = chunk_experts  # local experts of each chunk
        self._exchange = exchange

    @property
    def exchange(self) -> ExchangePlan:
        if callable(self._exchange):
            self._exchange = self._exchange()
        return self._exchange

    @property
    def num_rows(self) -> int:
        """Rows of the permuted (send) buffer: every copy's when all are mapped (known without the counts)."""
        return self.row_of_copy_TK.numel() if self.all_rows_mapped else self.exchange.layout.send_total

    @property
    def routes(self) -> HostRoutes:
        return self.exchange.routes

    @property
    def offsets(self) -> list[torch.Tensor]:
        return self.exchange.offsets


def start_counts_fetch(tokens_per_expert_E: torch.Tensor, ep: GroupHandle) -> Callable[[], torch.Tensor]:
    """Start gathering every EP rank's copies per global expert to the host; the returned function
    waits for them: [source rank, global expert], int64 on the CPU.

    Dropless routing needs them to size the exchange: this is the layer's one device-to-host sync. It is
    started before the permutation kernels and waited for only when the sizes are needed.
    """
    counts_SE = tokens_per_expert_E.new_empty((ep.size, tokens_per_expert_E.numel()))
    all_gather_into(counts_SE.view(-1), tokens_per_expert_E.contiguous(), ep.group)
    if counts_SE.device.type != "cuda":
        return lambda: counts_SE
    host_SE = torch.empty(counts_SE.shape, dtype=counts_SE.dtype, pin_memory=True)
    host_SE.copy_(counts_SE, non_blocking=True)
    landed = torch.cuda.Event()
    landed.record()

    def wait() -> torch.Tensor:
        with exposed_wait("ep"):  # the host stops queueing work until the counts land
            landed.synchronize()
        return host_SE

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


class DispatchPlanner:
    """Builds a layer's DispatchPlan each call. Rows are ordered (chunk, destination rank, local expert), so
    each chunk's rows are contiguous on both sides of the exchange; with one chunk this is the serial order.
    Padded-capacity plans have static sizes and are built once (no host sync, CUDA-graph capturable).
    """

    def __init__(self, num_experts: int, ep: GroupHandle, chunks: int, device: torch.device):
        self.num_experts, self.ep, self.device = num_experts, ep, device
        self.local = num_experts // ep.size
        self.bounds = chunk_bounds(self.local, chunks)
        order = [d * self.local + l for start, stop in self.bounds for d in range(ep.size) for l in range(start, stop)]
        slot_of_expert = torch.empty(num_experts, dtype=torch.long)
        slot_of_expert[torch.tensor(order)] = torch.arange(num_experts)
        self.slot_of_expert = slot_of_expert.to(device)
        self._static: dict[int, ExchangePlan] = {}

    def plan(self, experts_TK: torch.Tensor, keep_TK: torch.Tensor | None, capacity: int | None,
             fetch_counts: Callable[[], torch.Tensor] | None) -> DispatchPlan:
        """``fetch_counts`` (from :func:`start_counts_fetch`) sizes a variable exchange; None means the
        routing has a capacity and every (rank, expert) block is padded to exactly ``capacity`` rows."""
        static = fetch_counts is None
        row_of_copy_TK, _, _ = copy_rows(self.slot_of_expert[experts_TK], self.num_experts,
                                         capacity if static else None, keep_TK)
        if static:
            if capacity not in self._static:
                counts = torch.full((self.ep.size, self.num_experts), capacity, dtype=torch.int64)
                self._static[capacity] = self._exchange_plan(counts)
            return DispatchPlan(row_of_copy_TK, False, self.bounds, self._static[capacity])
        return DispatchPlan(row_of_copy_TK, keep_TK is None, self.bounds,
                            lambda: self._exchange_plan(fetch_counts()))

    def _exchange_plan(self, counts_SE: torch.Tensor) -> ExchangePlan:
        """Host work on every dropless call, after the sync: numpy on a few hundred integers."""
        ep = self.ep
        rows_SDL = counts_SE.numpy().reshape(ep.size, ep.size, self.local)  # [source, destination, local expert]
        rows_SDC = np.stack([rows_SDL[:, :, a:b].sum(-1) for a, b in self.bounds], axis=-1)
        host = []  # per chunk: regroup index (its rows arrive in (source, local expert) blocks; the grouped GEMM
        # takes (local expert, source)), its inverse, grouped-GEMM end offsets
        for start, stop in self.bounds:
            block_rows = rows_SDL[:, ep.rank, start:stop]  # [source, local expert] of this chunk
            host += [*block_transpose(block_rows), np.cumsum(block_rows.sum(0))]
        device = _to_device(host, self.device)
        offsets = [o.to(torch.int32) for o in device[2::3]]  # grouped_mm takes int32 offsets
        return ExchangePlan(HostRoutes(exchange_layout(rows_SDC, ep.rank), device[0::3], device[1::3]), self.bounds,
                            offsets)


@dataclass
class ExpertTPPlan:
    """Expert tensor parallelism around the grouped GEMMs: every expert-TP rank gathers the rows its peers
    received, runs its FFN slice on all of them, and the partial outputs are summed back to their owners."""

    rows_per_peer: list[int]  # rows each expert-TP rank received from its EP exchange, by expert-TP rank
    regroup_index: torch.Tensor  # gathered rows from (peer, local expert) to (local expert, peer) order
    ungroup_index: torch.Tensor
    offsets: torch.Tensor  # int32 grouped-GEMM end offsets over the gathered rows


def expert_tp_counts(counts_SPE: torch.Tensor, ep: GroupHandle) -> torch.Tensor:
    """From every expert rank's copies per global expert, [EP rank, expert-TP rank, expert], the rows each
    expert-TP peer of this rank receives per local expert: [expert-TP rank, local expert]."""
    local = counts_SPE.shape[-1] // ep.size
    return counts_SPE[:, :, ep.rank * local:(ep.rank + 1) * local].sum(0)


def plan_expert_tp(rows_PL: torch.Tensor, device: torch.device) -> ExpertTPPlan:
    rows = rows_PL.numpy()
    regroup, ungroup, ends = _to_device([*block_transpose(rows), np.cumsum(rows.sum(0))], device)
    return ExpertTPPlan(rows.sum(1).tolist(), regroup, ungroup, ends.to(torch.int32))


def gather_from_expert_tp(rows_RH: torch.Tensor, plan: ExpertTPPlan, etp: GroupHandle,
                          all_to_all=all_to_all_rows) -> torch.Tensor:
    """Every expert-TP peer's rows, in peer order (an uneven all-gather as an all-to-all). Its adjoint is
    :func:`sum_to_expert_tp_owners`; ``all_to_all`` is AllToAllRows.apply where autograd should see it."""
    mine, peers = plan.rows_per_peer[etp.rank], etp.size
    return all_to_all(rows_RH.repeat(peers, 1), plan.rows_per_peer, [mine] * peers, etp.group)


def sum_to_expert_tp_owners(rows_RH: torch.Tensor, plan: ExpertTPPlan, etp: GroupHandle,
                            all_to_all=all_to_all_rows) -> torch.Tensor:
    """Each peer's block of rows (in peer order) back to that peer, summed there over the peers (an uneven
    reduce-scatter): the partial outputs of every FFN slice add up to the expert's output."""
    mine, peers = plan.rows_per_peer[etp.rank], etp.size
    returned_PRH = all_to_all(rows_RH, [mine] * peers, plan.rows_per_peer, etp.group)
    return returned_PRH.view(peers, mine, rows_RH.shape[1]).float().sum(0).to(rows_RH.dtype)


def expert_tp_experts(grouped_RH: torch.Tensor, plan: ExpertTPPlan, etp: GroupHandle, experts) -> torch.Tensor:
    """Gather the peers' rows, run this rank's FFN slice on all of them, sum the partial outputs back."""
    gathered_RH = gather_from_expert_tp(grouped_RH, plan, etp, AllToAllRows.apply)
    grouped_RH = PermuteRows.apply(gathered_RH, plan.regroup_index, plan.ungroup_index)
    partial_RH = PermuteRows.apply(experts(grouped_RH, plan.offsets), plan.ungroup_index, plan.regroup_index)
    return sum_to_expert_tp_owners(partial_RH, plan, etp, AllToAllRows.apply)


def serial_dispatch_combine(x_TH: torch.Tensor, probs_TK: torch.Tensor, plan: DispatchPlan, ep: GroupHandle,
                            experts, expert_tp: tuple[ExpertTPPlan, GroupHandle] | None = None) -> torch.Tensor:
    """The reference path: permute, all-to-all, grouped experts (split over expert-TP), all-to-all,
    unpermute; one chunk."""
    permuted_RH = Permute.apply(x_TH, plan.row_of_copy_TK, plan.num_rows, plan.all_rows_mapped)
    exchange = plan.exchange  # after the permutation was queued (see DispatchPlan)
    layout = exchange.layout
    received_RH = AllToAllRows.apply(permuted_RH, layout.recv_rows[0], layout.send_rows[0], ep.group)
    regroup, ungroup = exchange.routes.regroup[0], exchange.routes.ungroup[0]
    grouped_RH = PermuteRows.apply(received_RH, regroup, ungroup)
    if expert_tp is None:
        expert_out_RH = experts(grouped_RH, exchange.offsets[0])
    else:
        expert_out_RH = expert_tp_experts(grouped_RH, *expert_tp, experts)
    ungrouped_RH = PermuteRows.apply(expert_out_RH, ungroup, regroup)
    combined_RH = AllToAllRows.apply(ungrouped_RH, layout.send_rows[0], layout.recv_rows[0], ep.group)
    return Unpermute.apply(combined_RH, plan.row_of_copy_TK, probs_TK, plan.all_rows_mapped)
