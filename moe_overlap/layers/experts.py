"""Experts as grouped GEMMs (torch._grouped_mm): SwiGLU fc1 -> fc2 over rows sorted by local expert.
Rows past the last offset are not computed (a static worst-case buffer of the sync-free dispatch): the
GEMMs skip them (measured: no cost, and garbage there reaches no valid output or weight gradient), and so
does the SwiGLU kernel.

The forward and backward are explicit so the overlapped pipeline can run dgrad and wgrad separately.
w13 holds [gate | up] along its last dimension.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.kernels.swiglu import swiglu_backward, swiglu_forward, swiglu_forward_torch

from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.layers.init import NORMAL, SCALED_NORMAL, TPShard, make_param
from moe_overlap.layers.wgrad import weight_grads


def expert_offsets(rows_per_expert: torch.Tensor) -> torch.Tensor:
    """End offset of each expert's rows, int32 as torch._grouped_mm wants."""
    return torch.cumsum(rows_per_expert, dim=0).to(torch.int32)


def experts_forward(x_TH: torch.Tensor, offsets_E: torch.Tensor, w13_EHF2: torch.Tensor,
                    w2_EFH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1 -> SwiGLU -> fc2; returns the output and fc1's output (kept for the backward)."""
    h_TF2 = torch._grouped_mm(x_TH, w13_EHF2, offs=offsets_E)
    return torch._grouped_mm(swiglu_forward(h_TF2, offsets_E[-1:]), w2_EFH, offs=offsets_E), h_TF2


def experts_dgrad(grad_y_TH: torch.Tensor, h_TF2: torch.Tensor, offsets_E: torch.Tensor, w13_EHF2: torch.Tensor,
                  w2_EFH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input gradient; also fc1's output gradient and the SwiGLU activation, which the weight gradients need
    (the fused backward rebuilds the activation in the same pass, so the forward need not keep it)."""
    grad_a_TF = torch._grouped_mm(grad_y_TH, w2_EFH.transpose(-2, -1), offs=offsets_E)
    grad_h_TF2, a_TF = swiglu_backward(h_TF2, grad_a_TF, offsets_E[-1:])
    return torch._grouped_mm(grad_h_TF2, w13_EHF2.transpose(-2, -1), offs=offsets_E), grad_h_TF2, a_TF


def experts_wgrad(x_TH: torch.Tensor, a_TF: torch.Tensor, grad_h_TF2: torch.Tensor, grad_y_TH: torch.Tensor,
                  offsets_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight gradients (separate from dgrad so a pipeline can defer them into communication gaps)."""
    grad_w2_EFH = torch._grouped_mm(a_TF.t(), grad_y_TH, offs=offsets_E)
    grad_w13_EHF2 = torch._grouped_mm(x_TH.t(), grad_h_TF2, offs=offsets_E)
    return grad_w13_EHF2, grad_w2_EFH


class GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, offsets_E: torch.Tensor, w13_EHF2: torch.Tensor,
                w2_EFH: torch.Tensor) -> torch.Tensor:
        y_TH, h_TF2 = experts_forward(x_TH, offsets_E, w13_EHF2, w2_EFH)
        ctx.save_for_backward(x_TH, offsets_E, w13_EHF2, w2_EFH, h_TF2)
        ctx.weights = (w13_EHF2, w2_EFH)
        return y_TH

    @staticmethod
    def backward(ctx, grad_y_TH: torch.Tensor):
        x_TH, offsets_E, w13_EHF2, w2_EFH, h_TF2 = ctx.saved_tensors
        if x_TH.shape[0] == 0:  # no rows reached these experts: grouped_mm rejects empty gradients' strides
            return torch.zeros_like(x_TH), None, torch.zeros_like(w13_EHF2), torch.zeros_like(w2_EFH)
        grad_y_TH = grad_y_TH.contiguous()  # grouped_mm's kernels reject expanded gradients
        grad_x_TH, grad_h_TF2, a_TF = experts_dgrad(grad_y_TH, h_TF2, offsets_E, w13_EHF2, w2_EFH)
        grad_w13_EHF2, grad_w2_EFH = weight_grads(experts_wgrad, (x_TH, a_TF, grad_h_TF2, grad_y_TH, offsets_E),
                                                  ctx.weights)
        return grad_x_TH, None, grad_w13_EHF2, grad_w2_EFH


def grouped_swiglu_reference(x_TH: torch.Tensor, rows_per_expert: list[int], w13_EHF2: torch.Tensor,
                             w2_EFH: torch.Tensor) -> torch.Tensor:
    """Loop twin of GroupedSwiGLU (one matmul pair per expert), for tests."""
    outputs, start = [], 0
    for expert, rows in enumerate(rows_per_expert):
        x = x_TH[start:start + rows]
        outputs.append(swiglu_forward_torch(x @ w13_EHF2[expert]) @ w2_EFH[expert])
        start += rows
    return torch.cat(outputs) if outputs else x_TH.new_zeros((0, w2_EFH.shape[-1]))


class GroupedExperts(nn.Module):
    """The experts this rank holds: global experts [first_expert, first_expert + num_local_experts), each
    split over the expert-tensor-parallel group ``etp`` along its FFN dimension (fc1's gate and up each
    split, so SwiGLU stays local; fc2 split by rows). One expert's logical tensors are w13 (H, 2, F) and
    w2 (F, H) whatever the split, so checkpoints and init do not depend on it."""

    def __init__(self, num_local_experts: int, first_expert: int, hidden_size: int, ffn_hidden_size: int,
                 device=None, dtype=None, etp: GroupHandle | None = None):
        super().__init__()
        self.num_local_experts, self.first_expert = num_local_experts, first_expert
        rank, size, ranks = (etp.rank, etp.size, tuple(etp.ranks)) if etp is not None else (0, 1, ())
        local_ffn = ffn_hidden_size // size
        self.w13 = make_param((num_local_experts, hidden_size, 2 * local_ffn), NORMAL, device, dtype,
                              first_expert=first_expert, tp=TPShard(1, rank, size, ranks, stack=2))
        self.w2 = make_param((num_local_experts, local_ffn, hidden_size), SCALED_NORMAL, device, dtype,
                             first_expert=first_expert, tp=TPShard(0, rank, size, ranks))

    def forward(self, x_TH: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return GroupedSwiGLU.apply(x_TH, offsets_E, self.w13, self.w2)
