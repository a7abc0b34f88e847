"""Dense SwiGLU MLP; fc1 holds [gate; up] stacked on the output dimension, as Megatron's swiglu.

Tensor parallel: fc1 is column-parallel with each of gate and up split over the ranks (a rank holds
[gate_r; up_r], so SwiGLU stays local), fc2 row-parallel.

Under rowwise FP8 on one TP rank, with both linears in FP8, the MLP runs as one autograd Function
(:class:`Fp8SwiGLUMLP`), as the experts do (layers/experts.py): SwiGLU's forward writes its output only as the FP8
rows fc2 reads (no bf16 activation written, quantized again, or kept), and its backward writes fc1's output
gradient as FP8 rows for fc1's input gradient beside the bf16 one, rebuilding the activation for fc2's weight
gradient. The same bytes reach every GEMM as through the two linears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.distributed.ring import TPComm
from moe_overlap.kernels.swiglu import swiglu_backward, swiglu_backward_fp8, swiglu_forward, swiglu_forward_fp8
from moe_overlap.layers.deferred_wgrad import weight_grads
from moe_overlap.layers.fp8 import Fp8, Fp8Rows, fp8_matmul
from moe_overlap.layers.init import NORMAL, SCALED_NORMAL, make_param
from moe_overlap.layers.tp_linear import ColumnParallelLinear, RowParallelLinear
from moe_overlap.layers.wgrad import linear_wgrad


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


class Fp8SwiGLUMLP(torch.autograd.Function):
    """fc2(swiglu(fc1(x))) on one TP rank, both GEMMs of each linear in rowwise FP8, SwiGLU's kernels handing them FP8
    rows (see the module docstring). Keeps x and fc1's output; the activation is rebuilt in the backward."""

    @staticmethod
    def forward(ctx, x_RH: torch.Tensor, w1_FH: torch.Tensor, w2_HF: torch.Tensor, fp8: Fp8) -> torch.Tensor:
        h_RF2 = fp8_matmul(x_RH, w1_FH, True, fp8, fast_accum=True)
        a_rows = Fp8Rows(*swiglu_forward_fp8(h_RF2), h_RF2.dtype)
        ctx.save_for_backward(x_RH, h_RF2)
        ctx.weights, ctx.fp8 = (w1_FH, w2_HF), fp8  # the parameters themselves (their main_grad)
        return fp8_matmul(a_rows, w2_HF, True, fp8, fast_accum=True)

    @staticmethod
    def backward(ctx, grad_y_RH: torch.Tensor):
        (x_RH, h_RF2), (w1_FH, w2_HF) = ctx.saved_tensors, ctx.weights
        grad_y_RH = grad_y_RH.contiguous()
        grad_a_RF = fp8_matmul(grad_y_RH, w2_HF, False, ctx.fp8)
        grad_h_RF2, a_RF, *rows = swiglu_backward_fp8(h_RF2, grad_a_RF)
        grad_x_RH = fp8_matmul(Fp8Rows(*rows, grad_h_RF2.dtype), w1_FH, False, ctx.fp8)
        grad_w2, = weight_grads(linear_wgrad, (w2_HF, grad_y_RH, a_RF), (w2_HF,))
        grad_w1, = weight_grads(linear_wgrad, (w1_FH, grad_h_RF2, x_RH), (w1_FH,))
        return grad_x_RH, grad_w1, grad_w2, None


class SwiGLUMLP(nn.Module):
    """Maps (..., H) to (..., H); under sequence parallelism the leading dims are this rank's rows."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, device=None, dtype=None, comm: TPComm | None = None):
        super().__init__()
        comm = comm or TPComm.single()
        self.linear_fc1 = ColumnParallelLinear(hidden_size, 2 * ffn_hidden_size, comm, stack=2, device=device,
                                               dtype=dtype)
        self.linear_fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, comm, SCALED_NORMAL, device, dtype)

    def fused_fp8(self) -> Fp8 | None:
        """The recipe :class:`Fp8SwiGLUMLP` runs under, or None: the two linears, each its own way (more than one TP
        rank, either linear bf16, blockwise)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        fp8 = fc1.fp8
        if fp8 is None or fc2.fp8 != fp8 or fp8.recipe != "rowwise" or fc1.comm.size > 1:
            return None
        return fp8 if fp8.covers(*fc1.weight.shape[::-1]) and fp8.covers(*fc2.weight.shape[::-1]) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_RH = x.reshape(-1, x.shape[-1])
        fp8 = self.fused_fp8()
        if fp8 is not None:
            out_RH = Fp8SwiGLUMLP.apply(x_RH, self.linear_fc1.weight, self.linear_fc2.weight, fp8)
        else:
            out_RH = self.linear_fc2(swiglu(self.linear_fc1(x_RH)))
        return out_RH.view_as(x)


class GatedSharedExpert(SwiGLUMLP):
    """A MoE layer's shared expert whose output each token scales by sigmoid(x . gate_weight) (Qwen2-MoE;
    Megatron's moe_shared_expert_gate). Runs on this rank's tokens, as the shared expert does."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, device=None, dtype=None):
        super().__init__(hidden_size, ffn_hidden_size, device, dtype)
        self.gate_weight = make_param((1, hidden_size), NORMAL, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.sigmoid(F.linear(x, self.gate_weight))
