"""Bias-free linear layer with a tagged init rule (weight: out_features x in_features, as Megatron)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.layers.init import NORMAL, make_param


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, init: str = NORMAL, device=None, dtype=None):
        super().__init__()
        self.weight = make_param((out_features, in_features), init, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
