"""Serial expert-parallel token dispatch: the reference path every overlapped path is tested against.

Stages, each a separately callable unit with its own forward and backward:
  permute    token copies gathered in (destination EP rank, local expert) order      GatherRows
  dispatch   rows to the EP rank that holds their expert                             AllToAllRows
  regroup    received rows from (source rank, expert) to (expert, source rank) order GatherRows
  experts    grouped GEMMs                                                           experts.GroupedSwiGLU
  ungroup    back to (source rank, expert) order                                     GatherRows
  combine    rows back to the rank that owns their token                             AllToAllRows
  unpermute  weighted sum of each token's k expert outputs                           WeightedUnpermute
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.distributed.collectives import ProcessGroup, all_to_all_equal
from moe_overlap.layers.experts import expert_offsets


class GatherRows(torch.autograd.Function):
    """rows = x[index]; the backward scatter-adds in fp32 (a token's k copies meet there)."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, index_R: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index_R)
        ctx.num_rows = x_TH.shape[0]
        return x_TH.index_select(0, index_R)

    @staticmethod
    def backward(ctx, grad_rows_RH: torch.Tensor):
        (index_R,) = ctx.saved_tensors
        grad_TH = grad_rows_RH.new_zeros((ctx.num_rows, grad_rows_RH.shape[1]), dtype=torch.float32)
        grad_TH.index_add_(0, index_R, grad_rows_RH.float())
        return grad_TH.to(grad_rows_RH.dtype), None


class WeightedUnpermute(torch.autograd.Function):
    """out[t] = sum_k probs[t, k] * rows[slot of copy (t, k)], in fp32; differentiable in rows and probs."""

    @staticmethod
    def forward(ctx, rows_RH: torch.Tensor, probs_TK: torch.Tensor, copy_of_row_R: torch.Tensor) -> torch.Tensor:
        num_tokens, topk = probs_TK.shape
        copies_TKH = rows_RH.new_empty((num_tokens * topk, rows_RH.shape[1]))
        copies_TKH[copy_of_row_R] = rows_RH
        copies_TKH = copies_TKH.view(num_tokens, topk, rows_RH.shape[1])
        ctx.save_for_backward(copies_TKH, probs_TK, copy_of_row_R)
        return torch.einsum("tk,tkh->th", probs_TK, copies_TKH.float()).to(rows_RH.dtype)

    @staticmethod
    def backward(ctx, grad_out_TH: torch.Tensor):
        copies_TKH, probs_TK, copy_of_row_R = ctx.saved_tensors
        grad32_TH = grad_out_TH.float()
        grad_probs_TK = torch.einsum("tkh,th->tk", copies_TKH.float(), grad32_TH)
        grad_copies_TKH = (probs_TK.unsqueeze(-1) * grad32_TH.unsqueeze(1)).to(grad_out_TH.dtype)
        grad_rows_RH = grad_copies_TKH.flatten(0, 1).index_select(0, copy_of_row_R)
        return grad_rows_RH, grad_probs_TK, None


@dataclass
class DispatchPlan:
    """Where every token copy goes and comes back; built once per layer call from the routing."""

    copy_of_row: torch.Tensor  # (R,) flat copy index t*k + j of each permuted row, sorted by global expert
    token_of_row: torch.Tensor  # (R,) source token of each permuted row
    input_splits: list[int]  # rows sent to each EP rank
    output_splits: list[int]  # rows received from each EP rank
    regroup_index: torch.Tensor  # received rows in (local expert, source rank) order
    ungroup_index: torch.Tensor  # the inverse permutation
    rows_per_local_expert: list[int]
    offsets: torch.Tensor  # int32 end offsets per local expert, for grouped_mm


def plan_dispatch(experts_TK: torch.Tensor, tokens_per_expert_E: torch.Tensor, ep_size: int,
                  ep_group: ProcessGroup) -> DispatchPlan:
    """Sort copies by expert, exchange counts, and derive the splits and the local regrouping.

    Dropless routing needs the received counts on the host to size the exchange: this is the layer's one
    device-to-host sync (both count tables are fetched together).
    """
    num_experts = tokens_per_expert_E.numel()
    local_experts = num_experts // ep_size
    copy_of_row = torch.argsort(experts_TK.flatten(), stable=True)
    token_of_row = copy_of_row // experts_TK.shape[1]
    sent_RE = tokens_per_expert_E.view(ep_size, local_experts)  # [destination rank, local expert]
    received_SE = all_to_all_equal(sent_RE, ep_group)  # [source rank, local expert]
    counts = torch.cat((sent_RE.flatten(), received_SE.flatten())).cpu()  # the one host sync
    sent_rows = counts[:num_experts].view(ep_size, local_experts)
    received_rows = counts[num_experts:].view(ep_size, local_experts)
    # Received rows arrive in (source, expert) blocks; the grouped GEMM wants (expert, source).
    block_expert = torch.arange(local_experts, device=experts_TK.device).repeat(ep_size)
    block_source = torch.arange(ep_size, device=experts_TK.device).repeat_interleave(local_experts)
    rows_total = int(received_rows.sum())
    block_counts = received_SE.flatten()
    row_key = (block_expert * ep_size + block_source).repeat_interleave(block_counts, output_size=rows_total)
    regroup_index = torch.argsort(row_key, stable=True)
    ungroup_index = torch.empty_like(regroup_index)
    ungroup_index[regroup_index] = torch.arange(rows_total, device=regroup_index.device)
    return DispatchPlan(
        copy_of_row=copy_of_row,
        token_of_row=token_of_row,
        input_splits=sent_rows.sum(1).tolist(),
        output_splits=received_rows.sum(1).tolist(),
        regroup_index=regroup_index,
        ungroup_index=ungroup_index,
        rows_per_local_expert=received_rows.sum(0).tolist(),
        offsets=expert_offsets(received_SE.sum(0)),
    )
