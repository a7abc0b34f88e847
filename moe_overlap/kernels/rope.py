"""Rotary embedding fused with the split of the fused QKV projection: one pass reads qkv and writes q, k, v in
the (batch, seq, heads, head_dim) layout attention reads, rotating q and k on the way (fp32 arithmetic);
the backward is one pass the other way, rotating back. The eager version cast q and k to fp32, chunked,
multiplied, concatenated and cast back: several full passes each way, plus the copies of the split.

qkv_SF rows are tokens in the TP region's order, (seq shard t, batch b, position s within the shard); its
columns Megatron's grouped layout, per query group g: its R - 2 query heads, then its key, then its value
head, D wide each. Channel pairs (i, i + D/2) rotate by the angle of the token's position (GPT-NeoX / Llama).
"""

from __future__ import annotations

import torch
from einops import rearrange

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, batch, shard_len, seq, groups,
                     q_sb, q_ss, q_sn, k_sb, k_ss, k_sn, v_sb, v_ss, v_sn,
                     R: tl.constexpr, R_PAD: tl.constexpr, HALF: tl.constexpr, BACKWARD: tl.constexpr):
        # One program per (token row, query group): its R heads of D = 2 * HALF channels. Forward reads qkv and
        # writes q/k/v (strided: any layout with unit channel stride); backward reads their gradients and writes
        # qkv's, rotating by the negative angle.
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1).to(tl.int64)
        per_shard = batch * shard_len
        b = (row % per_shard) // shard_len
        s = (row // per_shard) * shard_len + row % shard_len  # position in the whole sequence
        r = tl.arange(0, R_PAD)
        c = tl.arange(0, HALF)
        cos = tl.load(cos_ptr + s * HALF + c)[None, :]
        sin = tl.load(sin_ptr + s * HALF + c)[None, :]
        heads_q = R - 2
        is_q = r < heads_q
        is_k = r == heads_q
        rotate = (r < R - 1)[:, None]
        valid = (r < R)[:, None]
        # Where head r of this group lives in q, k or v.
        head = tl.where(is_q, group * heads_q + r, group)
        other = tl.where(is_q, b * q_sb + s * q_ss + head * q_sn,
                         tl.where(is_k, b * k_sb + s * k_ss + head * k_sn, b * v_sb + s * v_ss + head * v_sn))
        dst_q = q_ptr + other[:, None]
        dst_k = k_ptr + other[:, None]
        dst_v = v_ptr + other[:, None]
        mine = qkv_ptr + row * (groups * R * 2 * HALF) + (group * R + r)[:, None] * (2 * HALF)
        if BACKWARD:
            sign = -1.0
        else:
            sign = 1.0
        if BACKWARD:
            x1 = tl.where(is_q[:, None], tl.load(dst_q + c[None, :], mask=valid & is_q[:, None], other=0.0),
                          tl.where(is_k[:, None], tl.load(dst_k + c[None, :], mask=valid & is_k[:, None], other=0.0),
                                   tl.load(dst_v + c[None, :], mask=valid & (r == R - 1)[:, None], other=0.0)))
            x2 = tl.where(is_q[:, None], tl.load(dst_q + HALF + c[None, :], mask=valid & is_q[:, None], other=0.0),
                          tl.where(is_k[:, None],
                                   tl.load(dst_k + HALF + c[None, :], mask=valid & is_k[:, None], other=0.0),
                                   tl.load(dst_v + HALF + c[None, :], mask=valid & (r == R - 1)[:, None],
                                           other=0.0)))
        else:
            x1 = tl.load(mine + c[None, :], mask=valid, other=0.0)
            x2 = tl.load(mine + HALF + c[None, :], mask=valid, other=0.0)
        a = x1.to(tl.float32)
        bb = x2.to(tl.float32)
        y1 = tl.where(rotate, a * cos - sign * bb * sin, a)
        y2 = tl.where(rotate, bb * cos + sign * a * sin, bb)
        if BACKWARD:
            tl.store(mine + c[None, :], y1.to(qkv_ptr.dtype.element_ty), mask=valid)
            tl.store(mine + HALF + c[None, :], y2.to(qkv_ptr.dtype.element_ty), mask=valid)
        else:
            out_ty = q_ptr.dtype.element_ty
            tl.store(dst_q + c[None, :], y1.to(out_ty), mask=valid & is_q[:, None])
            tl.store(dst_q + HALF + c[None, :], y2.to(out_ty), mask=valid & is_q[:, None])
            tl.store(dst_k + c[None, :], y1.to(out_ty), mask=valid & is_k[:, None])
            tl.store(dst_k + HALF + c[None, :], y2.to(out_ty), mask=valid & is_k[:, None])
            tl.store(dst_v + c[None, :], y1.to(out_ty), mask=valid & (r == R - 1)[:, None])
            tl.store(dst_v + HALF + c[None, :], y2.to(out_ty), mask=valid & (r == R - 1)[:, None])

    _rope = Kernel(_rope_kernel)


def rotary_tables(positions_S: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (S, head_dim/2) in fp32 at the given token positions (a rank's own, under context
    parallelism); the kernels index them by the token's place in the local sequence."""
    device = positions_S.device
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(positions_S.to(torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rotate_pairs(x_BSHD: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor) -> torch.Tensor:
    """(B, S, heads, D) rotated pair-wise by the position's angle, in torch ops (where something must come
    between the QKV split and the rotation, such as a query / key norm)."""
    return _rotate(x_BSHD, cos_SD2, sin_SD2, 1.0)


def _rotate(x: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor, sign: float) -> torch.Tensor:
    """(..., S, heads, D) rotated pair-wise by sign x the position's angle, in fp32, back in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos_SD2[:, None, :], sign * sin_SD2[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def qkv_rotary_torch(qkv_SF: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor, batch: int, shards: int,
                     groups: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin: q (B, S, N, D), k and v (B, S, G, D), contiguous."""
    qkv = rearrange(qkv_SF, "(t b s) (g r d) -> b (t s) g r d", t=shards, b=batch, g=groups, d=head_dim)
    q = rearrange(qkv[:, :, :, :-2], "b s g r d -> b s (g r) d")
    k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
    return _rotate(q, cos_SD2, sin_SD2, 1.0), _rotate(k, cos_SD2, sin_SD2, 1.0), v.contiguous()


def qkv_rotary_backward_torch(grad_q, grad_k, grad_v, cos_SD2, sin_SD2, shards: int) -> torch.Tensor:
    """Twin of the backward: the gradients (B, S, heads, D) back to the fused QKV rows."""
    batch, seq, groups = grad_k.shape[:3]
    grad_q = _rotate(grad_q, cos_SD2, sin_SD2, -1.0).view(batch, seq, groups, -1, grad_q.shape[-1])
    grad_k, grad_v = _rotate(grad_k, cos_SD2, sin_SD2, -1.0), grad_v
    qkv = torch.cat((grad_q, grad_k.unsqueeze(3), grad_v.unsqueeze(3)), dim=3)
    return rearrange(qkv, "b (t s) g r d -> (t b s) (g r d)", t=shards)


def _launch(qkv_SF, cos_SD2, sin_SD2, q, k, v, batch: int, shards: int, groups: int, backward: bool) -> None:
    rows = qkv_SF.shape[0]
    heads_per_group = q.shape[2] // groups + 2
    half = q.shape[-1] // 2
    seq = q.shape[1]
    strides = [t.stride(i) for t in (q, k, v) for i in (0, 1, 2)]
    _rope[(rows, groups), qkv_SF.device](qkv_SF, cos_SD2, sin_SD2, q, k, v, batch, seq // shards, seq, groups,
                                         *strides, R=heads_per_group, R_PAD=triton.next_power_of_2(heads_per_group),
                                         HALF=half, BACKWARD=backward, num_warps=4)


def qkv_rotary_triton(qkv_SF, cos_SD2, sin_SD2, batch: int, shards: int, groups: int, head_dim: int):
    qkv_SF = qkv_SF.contiguous()
    seq = qkv_SF.shape[0] // batch
    heads = qkv_SF.shape[1] // head_dim - 2 * groups
    q = qkv_SF.new_empty((batch, seq, heads, head_dim))
    k, v = (qkv_SF.new_empty((batch, seq, groups, head_dim)) for _ in range(2))
    if qkv_SF.numel():
        _launch(qkv_SF, cos_SD2, sin_SD2, q, k, v, batch, shards, groups, backward=False)
    return q, k, v


def qkv_rotary_backward_triton(grad_q, grad_k, grad_v, cos_SD2, sin_SD2, shards: int) -> torch.Tensor:
    batch, seq, groups, head_dim = grad_k.shape
    grads = [g if g.stride(-1) == 1 else g.contiguous() for g in (grad_q, grad_k, grad_v)]
    grad_qkv = grad_q.new_empty((batch * seq, (grad_q.shape[2] + 2 * groups) * head_dim))
    if grad_qkv.numel():
        _launch(grad_qkv, cos_SD2, sin_SD2, *grads, batch, shards, groups, backward=True)
    return grad_qkv


def qkv_rotary(qkv_SF: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor, batch: int, shards: int,
               groups: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, S, N, D), k (B, S, G, D), v (B, S, G, D) from the fused QKV rows, q and k rotated."""
    if use_triton(qkv_SF, "rope"):
        return qkv_rotary_triton(qkv_SF, cos_SD2, sin_SD2, batch, shards, groups, head_dim)
    return qkv_rotary_torch(qkv_SF, cos_SD2, sin_SD2, batch, shards, groups, head_dim)


def qkv_rotary_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, cos_SD2: torch.Tensor,
                        sin_SD2: torch.Tensor, shards: int) -> torch.Tensor:
    """The fused QKV rows' gradient from q's, k's and v's ((B, S, heads, D), any layout)."""
    if use_triton(grad_q, "rope"):
        return qkv_rotary_backward_triton(grad_q, grad_k, grad_v, cos_SD2, sin_SD2, shards)
    return qkv_rotary_backward_torch(grad_q, grad_k, grad_v, cos_SD2, sin_SD2, shards)
