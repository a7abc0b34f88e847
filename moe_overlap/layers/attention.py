"""Grouped-query self-attention with rotary position embeddings, through scaled_dot_product_attention.

Tensor parallel: each rank holds num_heads/TP query heads and num_query_groups/TP key-value groups
(column-parallel QKV, row-parallel output projection). Under sequence parallelism the input is this rank's
sequence block and the QKV projection gathers the whole sequence (rank-major rows, see tp_linear).
Context parallel: the sequence is this CP rank's local sequence (distributed/context_parallel.py): rotary
positions are where its tokens sit, and attention runs as a ring over the CP group (layers/ring_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from moe_overlap.distributed.context_parallel import CPComm
from moe_overlap.distributed.ring import TPComm
from moe_overlap.layers.init import SCALED_NORMAL
from moe_overlap.layers.ring_attention import ring_attention
from moe_overlap.layers.tp_linear import ColumnParallelLinear, RowParallelLinear


def rotary_tables(positions_S: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (S, head_dim/2) in fp32 at the given token positions."""
    device = positions_S.device
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(positions_S.to(torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x_BNSD: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2), the GPT-NeoX / Llama convention, in fp32."""
    x1, x2 = x_BNSD.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos_SD2 - x2 * sin_SD2, x2 * cos_SD2 + x1 * sin_SD2), dim=-1)
    return rotated.to(x_BNSD.dtype)


class SelfAttention(nn.Module):
    """Fused QKV in Megatron's grouped layout: for each query group, its queries, then its key and value.

    Grouping the rows by query group keeps a tensor-parallel shard (whole groups) contiguous.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_query_groups: int, rotary_base: float,
                 comm: TPComm, device=None, dtype=None, cp: CPComm | None = None):
        super().__init__()
        self.comm, self.cp = comm, cp or CPComm.single()
        self.num_heads, self.num_groups = num_heads // comm.size, num_query_groups // comm.size  # this rank's
        self.head_dim = hidden_size // num_heads
        self.rotary_base = rotary_base
        qkv_rows = (num_heads + 2 * num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(hidden_size, qkv_rows, comm, device=device, dtype=dtype)
        self.linear_proj = RowParallelLinear(num_heads * self.head_dim, hidden_size, comm, SCALED_NORMAL, device,
                                             dtype)

    def forward(self, x_BRH: torch.Tensor) -> torch.Tensor:
        batch, t = x_BRH.shape[0], self.comm.sequence_shards
        heads_per_group = self.num_heads // self.num_groups
        qkv_SF = self.linear_qkv(x_BRH.reshape(-1, x_BRH.shape[-1]))
        qkv = rearrange(qkv_SF, "(t b s) (g r d) -> b g r (t s) d", t=t, b=batch, g=self.num_groups,
                        d=self.head_dim)
        q_BNSD = rearrange(qkv[:, :, :heads_per_group], "b g r s d -> b (g r) s d")
        k_BGSD, v_BGSD = qkv[:, :, heads_per_group], qkv[:, :, heads_per_group + 1]
        cos, sin = rotary_tables(self.cp.positions(q_BNSD.shape[2], x_BRH.device), self.head_dim, self.rotary_base)
        q_BNSD, k_BGSD = apply_rotary(q_BNSD, cos, sin), apply_rotary(k_BGSD, cos, sin)
        if self.cp.size > 1:
            out_BNSD = ring_attention(q_BNSD, k_BGSD, v_BGSD, self.cp)
        else:
            out_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, is_causal=True,
                                                      enable_gqa=heads_per_group > 1)
        out_RH = self.linear_proj(rearrange(out_BNSD, "b n (t s) d -> (t b s) (n d)", t=t))
        return out_RH.view_as(x_BRH)
