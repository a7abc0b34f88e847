"""Dense SwiGLU MLP; fc1 holds [gate; up] stacked on the output dimension, as Megatron's swiglu."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.layers.init import SCALED_NORMAL
from moe_overlap.layers.linear import Linear


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, device=None, dtype=None):
        super().__init__()
        self.linear_fc1 = Linear(hidden_size, 2 * ffn_hidden_size, device=device, dtype=dtype)
        self.linear_fc2 = Linear(ffn_hidden_size, hidden_size, SCALED_NORMAL, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x)))
