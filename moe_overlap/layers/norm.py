"""RMSNorm, computed in fp32 whatever the activation dtype (fused kernels: kernels/rmsnorm.py)."""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward
from moe_overlap.layers.init import ONES, make_param
from moe_overlap.layers.wgrad import fp32_wgrad, mark_own_grad


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_H: torch.Tensor, eps: float) -> torch.Tensor:
        x_TH = x.reshape(-1, x.shape[-1])
        y_TH, rstd_T = rmsnorm_forward(x_TH, weight_H, eps)
        ctx.save_for_backward(x_TH, rstd_T)
        ctx.weight = weight_H  # the parameter itself (its main_grad), also under recomputation
        return y_TH.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x_TH, rstd_T = ctx.saved_tensors
        grad_x_TH, grad_w_H = rmsnorm_backward(x_TH, ctx.weight, grad_y.reshape(x_TH.shape), rstd_T)
        return grad_x_TH.view(grad_y.shape), fp32_wgrad(ctx.weight, grad_w_H), None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = make_param((hidden_size,), ONES, device, dtype)
        mark_own_grad(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFn.apply(x, self.weight, self.eps)
