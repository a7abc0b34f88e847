"""The serial expert-parallel exchange, the reference the pipeline is tested against, and the expert-TP row
exchange both share.

Stages of the serial path, each a separately callable unit with its own forward and backward, on a host plan
(host_plan.py) of one chunk:
  permute    token copies into rows ordered (destination EP rank, local expert)              kernels.Permute
  dispatch   rows to the EP rank that holds their expert                                     AllToAllRows
  regroup    received rows from (source rank, expert) to (expert, source rank) order         PermuteRows
  experts    grouped GEMMs (under expert-TP: every peer's rows gathered, partial outputs
             summed back)                                                                    experts.GroupedSwiGLU
  ungroup    back to (source rank, expert) order                                             PermuteRows
  combine    rows back to the rank that owns their token                                     AllToAllRows
  unpermute  weighted sum of each token's k expert outputs                                   kernels.Unpermute
The pipeline (dispatch_pipeline.py) runs the same units chunk by chunk; with one chunk its row order is this one.
"""

from __future__ import annotations

import torch

from moe_overlap.distributed.collectives import AllToAllRows, all_to_all_rows
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.kernels.permute import Permute, Unpermute
from moe_overlap.layers.exchange_plan import ExpertTPPlan
from moe_overlap.layers.host_plan import HostPlan


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


def gather_from_expert_tp(rows_RH: torch.Tensor, plan: ExpertTPPlan, all_to_all=all_to_all_rows) -> torch.Tensor:
    """Every expert-TP peer's rows, in peer order (an uneven all-gather as an all-to-all). Its adjoint is
    :func:`sum_to_expert_tp_owners`; ``all_to_all`` is AllToAllRows.apply where autograd should see it."""
    etp = plan.group
    mine, peers = plan.rows_per_peer[etp.rank], etp.size
    return all_to_all(rows_RH.repeat(peers, 1), plan.rows_per_peer, [mine] * peers, etp.group)


def sum_to_expert_tp_owners(rows_RH: torch.Tensor, plan: ExpertTPPlan, all_to_all=all_to_all_rows) -> torch.Tensor:
    """Each peer's block of rows (in peer order) back to that peer, summed there over the peers (an uneven
    reduce-scatter): the partial outputs of every FFN slice add up to the expert's output."""
    etp = plan.group
    mine, peers = plan.rows_per_peer[etp.rank], etp.size
    returned_PRH = all_to_all(rows_RH, [mine] * peers, plan.rows_per_peer, etp.group)
    return returned_PRH.view(peers, mine, rows_RH.shape[1]).float().sum(0).to(rows_RH.dtype)


def expert_tp_experts(grouped_RH: torch.Tensor, plan: ExpertTPPlan, experts) -> torch.Tensor:
    """Gather the peers' rows, run this rank's FFN slice on all of them, sum the partial outputs back."""
    gathered_RH = gather_from_expert_tp(grouped_RH, plan, AllToAllRows.apply)
    grouped_RH = PermuteRows.apply(gathered_RH, plan.regroup_index, plan.ungroup_index)
    partial_RH = PermuteRows.apply(experts(grouped_RH, plan.offsets), plan.ungroup_index, plan.regroup_index)
    return sum_to_expert_tp_owners(partial_RH, plan, AllToAllRows.apply)


def serial_dispatch_combine(x_TH: torch.Tensor, probs_TK: torch.Tensor, plan: HostPlan, ep: GroupHandle,
                            experts) -> torch.Tensor:
    """The reference path: permute, all-to-all, grouped experts (split over expert-TP), all-to-all,
    unpermute; one chunk."""
    permuted_RH = Permute.apply(x_TH, plan.row_of_copy_TK, plan.num_rows, plan.all_rows_mapped)
    exchange = plan.exchange  # after the permutation was queued (see HostPlan)
    layout = exchange.layout
    received_RH = AllToAllRows.apply(permuted_RH, layout.recv_rows[0], layout.send_rows[0], ep.group)
    regroup, ungroup = exchange.routes.regroup[0], exchange.routes.ungroup[0]
    grouped_RH = PermuteRows.apply(received_RH, regroup, ungroup)
    if exchange.expert_tp is None:
        expert_out_RH = experts(grouped_RH, exchange.offsets[0])
    else:
        expert_out_RH = expert_tp_experts(grouped_RH, exchange.expert_tp[0], experts)
    ungrouped_RH = PermuteRows.apply(expert_out_RH, ungroup, regroup)
    combined_RH = AllToAllRows.apply(ungrouped_RH, layout.send_rows[0], layout.recv_rows[0], ep.group)
    return Unpermute.apply(combined_RH, plan.row_of_copy_TK, probs_TK, plan.all_rows_mapped)
