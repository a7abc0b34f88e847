"""Grouped-query self-attention with rotary position embeddings, through scaled_dot_product_attention.

Tensor parallel: each rank holds num_heads/TP query heads and num_query_groups/TP key-value groups
(column-parallel QKV, row-parallel output projection). Under sequence parallelism the input is this rank's
sequence block and the QKV projection gathers the whole sequence (rank-major rows, see tp_linear). The split
of the fused QKV into q, k, v and the rotation of q and k are one kernel each way (kernels/rope.py), writing
the (batch, seq, heads, head_dim) layout the flash kernels read, so SDPA gets transposed views, not copies.
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
from moe_overlap.kernels.rope import qkv_rotary, qkv_rotary_backward, rotary_tables, rotate_pairs
from moe_overlap.layers.init import SCALED_NORMAL, ZEROS, make_param
from moe_overlap.layers.param_info import TPShard
from moe_overlap.layers.norm import QKLayerNorm
from moe_overlap.layers.ring_attention import ring_attention
from moe_overlap.layers.tp_linear import ColumnParallelLinear, RowParallelLinear


class QKVRotary(torch.autograd.Function):
    """Fused QKV rows -> q (B, S, N, D), k and v (B, S, G, D), q and k rotated; backward the other way."""

    @staticmethod
    def forward(ctx, qkv_SF: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor, batch: int, shards: int,
                groups: int, head_dim: int):
        ctx.save_for_backward(cos_SD2, sin_SD2)
        ctx.shards = shards
        return qkv_rotary(qkv_SF, cos_SD2, sin_SD2, batch, shards, groups, head_dim)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        cos_SD2, sin_SD2 = ctx.saved_tensors
        return qkv_rotary_backward(grad_q, grad_k, grad_v, cos_SD2, sin_SD2, ctx.shards), *([None] * 6)


class SelfAttention(nn.Module):
    """Fused QKV in Megatron's grouped layout: for each query group, its queries, then its key and value.

    Grouping the rows by query group keeps a tensor-parallel shard (whole groups) contiguous. Optional: a
    bias on the fused projection (same layout), ``head_dim`` other than hidden / heads, and ``qk_norm``
    (the scope of a QKLayerNorm on queries and keys, and its epsilon).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_query_groups: int, rotary_base: float,
                 comm: TPComm, device=None, dtype=None, cp: CPComm | None = None, head_dim: int | None = None,
                 qkv_bias: bool = False, qk_norm: tuple[str, float] | None = None):
        super().__init__()
        self.comm, self.cp = comm, cp or CPComm.single()
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
        self._tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def rotary(self, local_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (S, D/2) at this rank's token positions, fp32, made once per length and device."""
        key = (local_length, device)
        if key not in self._tables:
            self._tables[key] = rotary_tables(self.cp.positions(local_length, device), self.head_dim,
                                              self.rotary_base)
        return self._tables[key]

    def forward(self, x_BRH: torch.Tensor) -> torch.Tensor:
        batch, t = x_BRH.shape[0], self.comm.sequence_shards
        qkv_SF = self.linear_qkv(x_BRH.reshape(-1, x_BRH.shape[-1]))
        if self.qkv_bias is not None:
            qkv_SF = qkv_SF + self.qkv_bias
        cos, sin = self.rotary(qkv_SF.shape[0] // batch, x_BRH.device)
        if self.q_layernorm is None:
            q_BSND, k_BSGD, v_BSGD = QKVRotary.apply(qkv_SF, cos, sin, batch, t, self.num_groups, self.head_dim)
        else:  # the query and key norms come between the split and the rotation (Qwen3, OLMoE)
            qkv = rearrange(qkv_SF, "(t b s) (g r d) -> b (t s) g r d", t=t, b=batch, g=self.num_groups,
                            d=self.head_dim)
            q_BNSD = rearrange(qkv[:, :, :, :-2], "b s g r d -> b (g r) s d")
            k_BGSD, v_BSGD = qkv[:, :, :, -2].transpose(1, 2), qkv[:, :, :, -1]
            q_BSND = rotate_pairs(self.q_layernorm(q_BNSD).transpose(1, 2), cos, sin)
            k_BSGD = rotate_pairs(self.k_layernorm(k_BGSD).transpose(1, 2), cos, sin)
        q_BNSD, k_BGSD, v_BGSD = q_BSND.transpose(1, 2), k_BSGD.transpose(1, 2), v_BSGD.transpose(1, 2)
        if self.cp.size > 1:
            out_BNSD = ring_attention(q_BNSD, k_BGSD, v_BGSD, self.cp)
        else:
            out_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, is_causal=True,
                                                      enable_gqa=self.num_heads > self.num_groups)
        out_RH = self.linear_proj(rearrange(out_BNSD, "b n (t s) d -> (t b s) (n d)", t=t))
        return out_RH.view_as(x_BRH)
