"""RMSNorm, computed in fp32 whatever the activation dtype."""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.layers.init import ONES, make_param


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = make_param((hidden_size,), ONES, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)
