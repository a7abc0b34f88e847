"""Dense SwiGLU MLP; fc1 holds [gate; up] stacked on the output dimension, as Megatron's swiglu.

Tensor parallel: fc1 is column-parallel with each of gate and up split over the ranks (a rank holds
[gate_r; up_r], so SwiGLU stays local), fc2 row-parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.distributed.ring import TPComm
from moe_overlap.kernels.swiglu import swiglu_backward, swiglu_forward
from moe_overlap.layers.init import NORMAL, SCALED_NORMAL, make_param
from moe_overlap.layers.tp_linear import ColumnParallelLinear, RowParallelLinear


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up over [gate | up], fused each way (kernels/swiglu.py); keeps only its input."""

    @staticmethod
    def forward(ctx, h_TF2: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h_TF2)
        return swiglu_forward(h_TF2)

    @staticmethod
    def backward(ctx, grad_a_TF: torch.Tensor):
        (h_TF2,) = ctx.saved_tensors
        return swiglu_backward(h_TF2, grad_a_TF.contiguous())[0]


def swiglu(h: torch.Tensor) -> torch.Tensor:
    return SwiGLU.apply(h)


class SwiGLUMLP(nn.Module):
    """Maps (..., H) to (..., H); under sequence parallelism the leading dims are this rank's rows."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, device=None, dtype=None, comm: TPComm | None = None):
        super().__init__()
        comm = comm or TPComm.single()
        self.linear_fc1 = ColumnParallelLinear(hidden_size, 2 * ffn_hidden_size, comm, stack=2, device=device,
                                               dtype=dtype)
        self.linear_fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, comm, SCALED_NORMAL, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_RH = self.linear_fc2(swiglu(self.linear_fc1(x.reshape(-1, x.shape[-1]))))
        return out_RH.view_as(x)


class GatedSharedExpert(SwiGLUMLP):
    """A MoE layer's shared expert whose output each token scales by sigmoid(x . gate_weight) (Qwen2-MoE;
    Megatron's moe_shared_expert_gate). Runs on this rank's tokens, as the shared expert does."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, device=None, dtype=None):
        super().__init__(hidden_size, ffn_hidden_size, device, dtype)
        self.gate_weight = make_param((1, hidden_size), NORMAL, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.sigmoid(F.linear(x, self.gate_weight))
