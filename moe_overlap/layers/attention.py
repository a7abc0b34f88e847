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
from moe_overlap.kernels.rope import qkv_rotary, qkv_rotary_backward, rotary_tables
from moe_overlap.layers.init import SCALED_NORMAL
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
        cos, sin = self.rotary(qkv_SF.shape[0] // batch, x_BRH.device)
        q_BSND, k_BSGD, v_BSGD = QKVRotary.apply(qkv_SF, cos, sin, batch, t, self.num_groups, self.head_dim)
        q_BNSD, k_BGSD, v_BGSD = q_BSND.transpose(1, 2), k_BSGD.transpose(1, 2), v_BSGD.transpose(1, 2)
        if self.cp.size > 1:
            out_BNSD = ring_attention(q_BNSD, k_BGSD, v_BGSD, self.cp)
        else:
            out_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, is_causal=True,
                                                      enable_gqa=self.num_heads > self.num_groups)
        out_RH = self.linear_proj(rearrange(out_BNSD, "b n (t s) d -> (t b s) (n d)", t=t))
        return out_RH.view_as(x_BRH)
