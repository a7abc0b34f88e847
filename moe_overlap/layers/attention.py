"""Grouped-query self-attention with rotary position embeddings, through scaled_dot_product_attention.

Tensor parallel: each rank holds num_heads/TP query heads and num_query_groups/TP key-value groups
(column-parallel QKV, row-parallel output projection). Under sequence parallelism the input is this rank's
sequence block and the QKV projection gathers the whole sequence (rank-major rows, see tp_linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from moe_overlap.distributed.ring import TPComm
from moe_overlap.layers.init import SCALED_NORMAL, ZEROS, TPShard, make_param
from moe_overlap.layers.norm import QKLayerNorm
from moe_overlap.layers.tp_linear import ColumnParallelLinear, RowParallelLinear


def rotary_tables(seq_length: int, head_dim: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (S, head_dim/2) in fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x_BNSD: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2), the GPT-NeoX / Llama convention, in fp32."""
    x1, x2 = x_BNSD.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos_SD2 - x2 * sin_SD2, x2 * cos_SD2 + x1 * sin_SD2), dim=-1)
    return rotated.to(x_BNSD.dtype)


class SelfAttention(nn.Module):
    """Fused QKV in Megatron's grouped layout: for each query group, its queries, then its key and value.

    Grouping the rows by query group keeps a tensor-parallel shard (whole groups) contiguous. Optional: a
    bias on the fused projection (same layout), ``head_dim`` other than hidden / heads, and ``qk_norm``
    (the scope of a QKLayerNorm on queries and keys, and its epsilon).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_query_groups: int, rotary_base: float,
                 comm: TPComm, device=None, dtype=None, head_dim: int | None = None, qkv_bias: bool = False,
                 qk_norm: tuple[str, float] | None = None):
        super().__init__()
        self.comm = comm
        self.num_heads, self.num_groups = num_heads // comm.size, num_query_groups // comm.size  # this rank's
        self.head_dim = head_dim or hidden_size // num_heads
        self.rotary_base = rotary_base
        qkv_rows = (num_heads + 2 * num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(hidden_size, qkv_rows, comm, device=device, dtype=dtype)
        self.qkv_bias = None if not qkv_bias else make_param(
            (qkv_rows // comm.size,), ZEROS, device, dtype,
            tp=TPShard(dim=0, rank=comm.rank, size=comm.size, ranks=tuple(comm.group.ranks)))
        self.q_layernorm = self.k_layernorm = None
        if qk_norm is not None:
            scope, eps = qk_norm
            self.q_layernorm = QKLayerNorm(self.num_heads, self.head_dim, eps, scope, comm, device, dtype)
            self.k_layernorm = QKLayerNorm(self.num_groups, self.head_dim, eps, scope, comm, device, dtype)
        self.linear_proj = RowParallelLinear(num_heads * self.head_dim, hidden_size, comm, SCALED_NORMAL, device,
                                             dtype)

    def forward(self, x_BRH: torch.Tensor) -> torch.Tensor:
        batch, t = x_BRH.shape[0], self.comm.sequence_shards
        heads_per_group = self.num_heads // self.num_groups
        qkv_SF = self.linear_qkv(x_BRH.reshape(-1, x_BRH.shape[-1]))
        if self.qkv_bias is not None:
            qkv_SF = qkv_SF + self.qkv_bias
        qkv = rearrange(qkv_SF, "(t b s) (g r d) -> b g r (t s) d", t=t, b=batch, g=self.num_groups,
                        d=self.head_dim)
        q_BNSD = rearrange(qkv[:, :, :heads_per_group], "b g r s d -> b (g r) s d")
        k_BGSD, v_BGSD = qkv[:, :, heads_per_group], qkv[:, :, heads_per_group + 1]
        if self.q_layernorm is not None:
            q_BNSD, k_BGSD = self.q_layernorm(q_BNSD), self.k_layernorm(k_BGSD)
        cos, sin = rotary_tables(q_BNSD.shape[2], self.head_dim, self.rotary_base, x_BRH.device)
        q_BNSD, k_BGSD = apply_rotary(q_BNSD, cos, sin), apply_rotary(k_BGSD, cos, sin)
        out_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, is_causal=True,
                                                  enable_gqa=heads_per_group > 1)
        out_RH = self.linear_proj(rearrange(out_BNSD, "b n (t s) d -> (t b s) (n d)", t=t))
        return out_RH.view_as(x_BRH)
