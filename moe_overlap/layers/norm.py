"""RMSNorm, computed in fp32 whatever the activation dtype (fused kernels: kernels/rmsnorm.py); and the query /
key norm of attention."""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.distributed.collectives import AllReduceSum
from moe_overlap.distributed.ring import TPComm
from moe_overlap.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward
from moe_overlap.layers.init import ONES, make_param
from moe_overlap.layers.param_info import TPShard, param_info
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


class QKLayerNorm(nn.Module):
    """RMSNorm of queries or keys (batch, heads, seq, head_dim) before RoPE, in fp32.

    scope "head": over each head's channels, one (head_dim,) weight shared by every head (Qwen3; Megatron's
    qk_layernorm). Under TP each rank's heads add to that weight's gradient, so it is summed over TP as the
    sequence-parallel parameters' are. scope "all_heads": over a token's whole projection, a weight per
    channel (OLMoE); a TP rank holds its heads' block of the weight and the sum of squares is summed over TP.
    """

    def __init__(self, local_heads: int, head_dim: int, eps: float, scope: str, comm: TPComm, device=None,
                 dtype=None):
        super().__init__()
        self.eps, self.scope, self.comm = eps, scope, comm
        if scope == "head":
            self.weight = make_param((head_dim,), ONES, device, dtype)
            param_info(self.weight).sequence_parallel = comm.size > 1
        else:
            shard = TPShard(dim=0, rank=comm.rank, size=comm.size, ranks=tuple(comm.group.ranks))
            self.weight = make_param((local_heads * head_dim,), ONES, device, dtype, tp=shard)
            self.channels = local_heads * head_dim * comm.size

    def forward(self, x_BNSD: torch.Tensor) -> torch.Tensor:
        x32 = x_BNSD.float()
        if self.scope == "head":
            mean_square = x32.pow(2).mean(-1, keepdim=True)
            weight = self.weight.float()
        else:
            square_sum_BS = x32.pow(2).sum(dim=(1, 3))
            if self.comm.size > 1:
                square_sum_BS = AllReduceSum.apply(square_sum_BS, self.comm.group.group)
            mean_square = (square_sum_BS / self.channels)[:, None, :, None]
            weight = self.weight.float().view(x_BNSD.shape[1], 1, x_BNSD.shape[3])
        return (x32 * torch.rsqrt(mean_square + self.eps) * weight).to(x_BNSD.dtype)
