"""Experts as grouped GEMMs (torch._grouped_mm): SwiGLU fc1 -> fc2 over rows sorted by local expert.

The forward and backward are explicit so the overlapped pipeline can run dgrad and wgrad separately.
w13 holds [gate | up] along its last dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.layers.init import NORMAL, SCALED_NORMAL, make_param


def expert_offsets(rows_per_expert: torch.Tensor) -> torch.Tensor:
    """End offset of each expert's rows, int32 as torch._grouped_mm wants."""
    return torch.cumsum(rows_per_expert, dim=0).to(torch.int32)


def _swiglu_fwd(h_TF2: torch.Tensor) -> torch.Tensor:
    gate, up = h_TF2.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_bwd(h_TF2: torch.Tensor, grad_a_TF: torch.Tensor) -> torch.Tensor:
    gate, up = h_TF2.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    grad = grad_a_TF.float()
    grad_gate = grad * up * sig * (1 + gate * (1 - sig))
    return torch.cat((grad_gate, grad * gate * sig), dim=-1).to(h_TF2.dtype)


class GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, offsets_E: torch.Tensor, w13_EHF2: torch.Tensor,
                w2_EFH: torch.Tensor) -> torch.Tensor:
        h_TF2 = torch._grouped_mm(x_TH, w13_EHF2, offs=offsets_E)
        a_TF = _swiglu_fwd(h_TF2)
        ctx.save_for_backward(x_TH, offsets_E, w13_EHF2, w2_EFH, h_TF2)
        return torch._grouped_mm(a_TF, w2_EFH, offs=offsets_E)

    @staticmethod
    def backward(ctx, grad_y_TH: torch.Tensor):
        x_TH, offsets_E, w13_EHF2, w2_EFH, h_TF2 = ctx.saved_tensors
        if x_TH.shape[0] == 0:  # no rows reached these experts: grouped_mm rejects empty gradients' strides
            return torch.zeros_like(x_TH), None, torch.zeros_like(w13_EHF2), torch.zeros_like(w2_EFH)
        grad_y_TH = grad_y_TH.contiguous()  # grouped_mm's kernels reject expanded gradients
        a_TF = _swiglu_fwd(h_TF2)
        grad_a_TF = torch._grouped_mm(grad_y_TH, w2_EFH.transpose(-2, -1), offs=offsets_E)
        grad_w2_EFH = torch._grouped_mm(a_TF.t(), grad_y_TH, offs=offsets_E)
        grad_h_TF2 = _swiglu_bwd(h_TF2, grad_a_TF)
        grad_x_TH = torch._grouped_mm(grad_h_TF2, w13_EHF2.transpose(-2, -1), offs=offsets_E)
        grad_w13_EHF2 = torch._grouped_mm(x_TH.t(), grad_h_TF2, offs=offsets_E)
        return grad_x_TH, None, grad_w13_EHF2, grad_w2_EFH


def grouped_swiglu_reference(x_TH: torch.Tensor, rows_per_expert: list[int], w13_EHF2: torch.Tensor,
                             w2_EFH: torch.Tensor) -> torch.Tensor:
    """Loop twin of GroupedSwiGLU (one matmul pair per expert), for tests."""
    outputs, start = [], 0
    for expert, rows in enumerate(rows_per_expert):
        x = x_TH[start:start + rows]
        outputs.append(_swiglu_fwd(x @ w13_EHF2[expert]) @ w2_EFH[expert])
        start += rows
    return torch.cat(outputs) if outputs else x_TH.new_zeros((0, w2_EFH.shape[-1]))


class GroupedExperts(nn.Module):
    """The experts this rank holds: global experts [first_expert, first_expert + num_local_experts)."""

    def __init__(self, num_local_experts: int, first_expert: int, hidden_size: int, ffn_hidden_size: int,
                 device=None, dtype=None):
        super().__init__()
        self.num_local_experts, self.first_expert = num_local_experts, first_expert
        self.w13 = make_param((num_local_experts, hidden_size, 2 * ffn_hidden_size), NORMAL, device, dtype,
                              first_expert=first_expert)
        self.w2 = make_param((num_local_experts, ffn_hidden_size, hidden_size), SCALED_NORMAL, device, dtype,
                             first_expert=first_expert)

    def forward(self, x_TH: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return GroupedSwiGLU.apply(x_TH, offsets_E, self.w13, self.w2)
