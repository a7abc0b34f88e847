"""Token embedding and the output layer's fp32 cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.layers.init import NORMAL, make_param


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, device=None, dtype=None):
        super().__init__()
        self.weight = make_param((vocab_size, hidden_size), NORMAL, device, dtype)

    def forward(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids_BS, self.weight)


def lm_cross_entropy(hidden_BSH: torch.Tensor, output_weight_VH: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the micro-batch, with the logits upcast to fp32."""
    logits = F.linear(hidden_BSH, output_weight_VH).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels_BS.reshape(-1))
