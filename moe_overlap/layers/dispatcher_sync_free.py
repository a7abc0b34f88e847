"""The sync-free twin of the serial dispatch (``overlap.moe_sync_free_dispatch``): dropless, no host sync.

The serial and chunked paths fetch every rank's counts to the host once per layer, because their exchanges
(NCCL all-to-all, copy-engine copies) take host sizes; the host then stalls until the GPU has caught up, and
the GPU idles while the host plans and issues the rest. Here the counts stay on the device:

  counts     every EP rank's copies per global expert, all-gathered on the device (by the pusher below)
  routes     from them, for every row, the rank and row it goes to (torch ops, static shapes)
  dispatch   permuted rows pushed by SM stores straight into their expert's grouped order on the owner
             (the regroup of the serial path is folded into the push)                       PushRows
  experts    grouped GEMMs on the static worst-case buffer; the device offsets bound the rows they read
  combine    grouped rows pushed back into their source's permuted order                    PushRows
  permute / unpermute as everywhere else.

Buffers have static worst-case shapes (every rank's copies landing on one rank: EP x T x K rows), so the
layer can be captured in a CUDA graph. The math is the serial path's: the same rows meet the same expert
weights in the same (local expert, source rank) order. One chunk: an SM push beside a full-chip GEMM would
slow it rather than hide (DESIGN.md), so nothing here overlaps; what it removes is the host's share.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moe_overlap.distributed.a2a import Route
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.kernels.permute import Permute, Unpermute


@dataclass
class SyncFreeRoutes:
    dispatch: Route  # the T*K permuted rows -> the expert owners' grouped (local expert, source) order
    combine: Route  # the grouped rows (static worst case) -> their sources' permuted order
    offsets_L: torch.Tensor  # int32 grouped-GEMM end offsets of this rank's local experts


def _exclusive_cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


def sync_free_routes(counts_SE: torch.Tensor, rank: int, copies: int) -> SyncFreeRoutes:
    """Routes of both directions from ``counts_SE[source rank, global expert]`` (dropless: each rank's
    ``copies`` = T x K copies all counted), with no host sync: static shapes only (``repeat_interleave`` is
    given its output size)."""
    ranks, experts = counts_SE.shape
    local = experts // ranks
    device = counts_SE.device
    # The static sizes assume every EP rank routes T x K copies (one micro-batch shape); checked on the device.
    torch._assert_async(torch.all(counts_SE.sum(1) == copies),
                        f"overlap.moe_sync_free_dispatch: every EP rank must route {copies} copies (the same "
                        f"micro-batch shape); the counts differ")
    # Send side: my permuted rows are blocks (destination d, local expert l), in that order.
    mine_B = counts_SE[rank]
    # Receive side of every rank d: grouped blocks (local expert l, source s), in that order.
    rows_DLS = counts_SE.view(ranks, ranks, local).permute(1, 2, 0)
    grouped_start_DLS = _exclusive_cumsum(rows_DLS.reshape(ranks, local * ranks)).view(ranks, local, ranks)
    send_start_SB = _exclusive_cumsum(counts_SE)  # every source's permuted-block starts
    rank_of_block_B = torch.arange(ranks, device=device, dtype=torch.int32).repeat_interleave(local)
    shift_B = grouped_start_DLS[:, :, rank].reshape(-1) - send_start_SB[rank]
    # My grouped rows go back: block (l, s) to source s, where its block (me, l) of permuted rows starts.
    rows_LS = rows_DLS[rank]
    worst = ranks * copies
    received = rows_LS.sum().view(1)
    dispatch = Route(mine_B.sum().view(1),
                     torch.repeat_interleave(rank_of_block_B, mine_B, output_size=copies),
                     torch.arange(copies, device=device) + torch.repeat_interleave(shift_B, mine_B, output_size=copies),
                     worst, received)
    sizes = torch.cat([rows_LS.reshape(-1), worst - received])  # a last block pads to the static worst case
    source_of_block = torch.arange(ranks, device=device, dtype=torch.int32).repeat(local)
    back_shift = (send_start_SB[:, rank * local:(rank + 1) * local].T - grouped_start_DLS[rank]).reshape(-1)
    pad = torch.zeros(1, dtype=counts_SE.dtype, device=device)
    combine = Route(received,
                    torch.repeat_interleave(torch.cat([source_of_block, pad.int()]), sizes, output_size=worst),
                    torch.arange(worst, device=device)
                    + torch.repeat_interleave(torch.cat([back_shift, pad]), sizes, output_size=worst),
                    copies, mine_B.sum().view(1))
    return SyncFreeRoutes(dispatch, combine, torch.cumsum(rows_LS.sum(1), 0).to(torch.int32))


class PushRows(torch.autograd.Function):
    """rows = pusher.push(src along ``route``); the backward pushes the gradient along ``back`` (the adjoint
    route: the combine's for the dispatch and the other way round)."""

    @staticmethod
    def forward(ctx, src_RH: torch.Tensor, route: Route, back: Route, pusher) -> torch.Tensor:
        ctx.back, ctx.pusher = back, pusher
        return pusher.push(src_RH, route)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):
        return ctx.pusher.push(grad_RH.contiguous(), ctx.back), None, None, None


def gather_counts(tokens_per_expert_E: torch.Tensor, ep: GroupHandle, pusher) -> torch.Tensor:
    """Every EP rank's copies per global expert, [source rank, expert], gathered on the device by the same
    pusher as the rows (an all-gather as a push of one row to every rank): no NCCL call in the layer, so a
    CUDA graph of it holds no collective."""
    copies_PE = tokens_per_expert_E.view(1, -1).expand(ep.size, -1).contiguous()
    return pusher.push(copies_PE, _all_gather_route(ep.size, ep.rank, tokens_per_expert_E.device))


@functools.lru_cache(maxsize=None)
def _all_gather_route(ranks: int, rank: int, device: torch.device) -> Route:
    every = torch.full((1,), ranks, dtype=torch.int64, device=device)
    return Route(every, torch.arange(ranks, dtype=torch.int32, device=device),
                 torch.full((ranks,), rank, dtype=torch.int64, device=device), ranks, every)


def sync_free_dispatch_combine(x_TH: torch.Tensor, probs_TK: torch.Tensor, row_of_copy_TK: torch.Tensor,
                               routes: SyncFreeRoutes, pusher, experts) -> torch.Tensor:
    """Permute, push to the experts' owners, grouped experts, push back, unpermute: no host sync."""
    permuted_RH = Permute.apply(x_TH, row_of_copy_TK, row_of_copy_TK.numel(), True)
    grouped_RH = PushRows.apply(permuted_RH, routes.dispatch, routes.combine, pusher)
    expert_out_RH = experts(grouped_RH, routes.offsets_L)
    combined_RH = PushRows.apply(expert_out_RH, routes.combine, routes.dispatch, pusher)
    return Unpermute.apply(combined_RH, row_of_copy_TK, probs_TK, True)
