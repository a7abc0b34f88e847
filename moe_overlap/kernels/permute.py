"""Fused permute / unpermute of the MoE token dispatch: Triton kernels, their torch twins, autograd Functions.

Vocabulary (suffixes name dimensions: T tokens, K copies per token, E experts, R permuted rows, H hidden):

  copy (t, k)        the k-th routed copy of token t, going to expert experts_TK[t, k]
  position_TK        stable rank of a copy among the copies of its expert, in flat order t*K + k
                     (a counting-sort rank; -1 for a copy that is not counted: not kept, or an expert id
                     outside [0, E))
  row_of_copy_TK     the permuted row a copy lives in; -1: no row (the copy was dropped)
                       dropless  rows packed by expert: expert_start[e] + position (start = exclusive cumsum)
                       capacity  static layout: expert e owns rows [e*C, (e+1)*C); row e*C + position,
                                 and a copy whose position is >= C is dropped

  permute            x_TH -> x_RH: each token row read once and written to its k rows
  permute_backward   grad_RH -> grad_TH: sum over k of the copies' gradient rows (fp32 accumulation)
  unpermute          y_RH -> out_TH = sum_k probs[t, k] * y[row of (t, k)] (fp32 accumulation)
  unpermute_backward grad_y_RH[row of (t, k)] = probs[t, k] * grad_out[t];
                     grad_probs_TK[t, k] = <y[row of (t, k)], grad_out[t]> (fp32)

Rows that no copy maps to are zero in every output (capacity padding), unless the caller passes
`all_rows_mapped=True`, promising that every row in [0, num_rows) is the target of exactly one copy
(dropless without drops); then the zero fill (a full extra pass over the output) is skipped. `zero_below` (a
one-element device count) bounds the fill instead: only rows below it are read (a static buffer sized for the
worst case, used up to its grouped offsets), so only they are zeroed and the fill costs the rows in use.

Every public function dispatches: the Triton kernel when the tensors live on CUDA, or when TRITON_INTERPRET=1
is set (CPU tests; read at call time), the torch twin otherwise. `*_triton` and `*_torch` name each side
explicitly. No function here syncs with the host: sizes the host needs (num_rows) come from the caller.

The kernels are built from plain functions, compiled (`JITFunction`) or interpreted (`InterpretedFunction`)
at launch time: the interpreter runs whenever the tensors are not on CUDA or TRITON_INTERPRET=1 is set, so it
works whether or not TRITON_INTERPRET was set before triton was imported. For that reason the kernels call
only triton builtins: sums go through `tl.reduce(x, axis, _sum_combine)` (what `tl.sum` does), because
`tl.sum` itself is a JIT function decorated when triton is imported, and an interpreted kernel cannot call it
unless the interpreter was on at that time. The interpreter computes bf16 wrongly: test it in fp32.
"""

from typing import Optional

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe_overlap.kernels.launch import sum_combine as _sum_combine

__all__ = [
    "HAVE_TRITON",
    "copy_positions", "copy_positions_torch", "copy_positions_triton",
    "rows_from_positions", "copy_rows", "copy_rows_torch", "copy_rows_triton",
    "permute", "permute_torch", "permute_triton",
    "permute_backward", "permute_backward_torch", "permute_backward_triton",
    "unpermute", "unpermute_torch", "unpermute_triton",
    "unpermute_backward", "unpermute_backward_torch", "unpermute_backward_triton",
    "Permute", "Unpermute",
]

def _require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable: the *_triton permute kernels cannot run "
                           "(install triton==3.6.0, or call the *_torch twins)")


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def _check_copies(row_of_copy_TK: torch.Tensor, num_tokens: int, name: str = "row_of_copy_TK") -> None:
    _check_2d(name, row_of_copy_TK)
    if row_of_copy_TK.shape[0] != num_tokens:
        raise ValueError(f"{name} has {row_of_copy_TK.shape[0]} tokens, expected {num_tokens}")
    if row_of_copy_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {row_of_copy_TK.dtype}")


def _check_probs(probs_TK: torch.Tensor, row_of_copy_TK: torch.Tensor) -> None:
    if probs_TK.shape != row_of_copy_TK.shape:
        raise ValueError(f"probs_TK shape {tuple(probs_TK.shape)} != row_of_copy_TK shape "
                         f"{tuple(row_of_copy_TK.shape)}")
    if not probs_TK.is_floating_point():
        raise ValueError(f"probs_TK must be floating point, got {probs_TK.dtype}")


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------

if HAVE_TRITON:

    def _rank_hist_kernel(experts_ptr, keep_ptr, rank_ptr, hist_ptr, N, E, NB,
                          HAS_KEEP: tl.constexpr, BLOCK_N: tl.constexpr):
        # Block b of BLOCK_N copies: each copy's rank among the earlier copies of its expert inside the block
        # (a BLOCK_N x BLOCK_N comparison), and the block's per-expert count, written to the zeroed row b of
        # hist (expert-major: hist[e, b], so the prefix over blocks is an inner-dim scan) by the block's last copy of
        # each expert (rank + 1). Deterministic: no atomics, independent of E.
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK_N)
        offs = b * BLOCK_N + i
        inb = offs < N
        e = tl.load(experts_ptr + offs, mask=inb, other=-1).to(tl.int32)
        valid = inb & (e >= 0) & (e < E)
        if HAS_KEEP:
            kept = tl.load(keep_ptr + offs, mask=inb, other=0)
            valid = valid & (kept != 0)
        e = tl.where(valid, e, -1)
        same = (e[:, None] == e[None, :]) & valid[None, :]
        rank = tl.reduce((same & (i[None, :] < i[:, None])).to(tl.int32), 1, _sum_combine)
        later = tl.reduce((same & (i[None, :] > i[:, None])).to(tl.int32), 1, _sum_combine)
        tl.store(rank_ptr + offs, rank, mask=inb)
        tl.store(hist_ptr + e * NB + b, rank + 1, mask=valid & (later == 0))

    def _position_kernel(experts_ptr, keep_ptr, base_ptr, start_ptr, pos_ptr, row_ptr, N, E, C, NB,
                         HAS_KEEP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        # position = block base of the copy's expert + rank inside the block (already in pos_ptr);
        # ROWS: 0 positions only, 1 dropless rows (start_ptr: exclusive cumsum of counts), 2 capacity rows (C).
        b = tl.program_id(0)
        offs = b * BLOCK_N + tl.arange(0, BLOCK_N)
        inb = offs < N
        e = tl.load(experts_ptr + offs, mask=inb, other=-1).to(tl.int32)
        valid = inb & (e >= 0) & (e < E)
        if HAS_KEEP:
            kept = tl.load(keep_ptr + offs, mask=inb, other=0)
            valid = valid & (kept != 0)
        rank = tl.load(pos_ptr + offs, mask=inb, other=0)
        base = tl.load(base_ptr + e * NB + b, mask=valid, other=0).to(tl.int32)
        pos = tl.where(valid, rank + base, -1)
        tl.store(pos_ptr + offs, pos, mask=inb)
        if ROWS == 1:
            start = tl.load(start_ptr + e, mask=valid, other=0).to(tl.int32)
            tl.store(row_ptr + offs, tl.where(valid, start + pos, -1), mask=inb)
        if ROWS == 2:
            keep_row = valid & (pos < C)
            tl.store(row_ptr + offs, tl.where(keep_row, e * C + pos, -1), mask=inb)

    def _scatter_rows_kernel(src_ptr, rows_ptr, probs_ptr, out_ptr, y_ptr, dot_ptr,
                             stride_src, stride_out, stride_y, H, K, R,
                             HAS_PROBS: tl.constexpr, DOT: tl.constexpr,
                             K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
        # One program per token t: src row t is read once (BLOCK_H at a time) and written to the rows of its
        # K copies, scaled by probs[t, k] when HAS_PROBS (unpermute backward). DOT: also dot[t, k] =
        # <y[row of (t, k)], src[t]> in fp32 (the probs gradient).
        t = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, K_PAD)
        rows = tl.load(rows_ptr + t * K + kk, mask=kk < K, other=-1).to(tl.int64)
        valid = (rows >= 0) & (rows < R)
        if HAS_PROBS:
            w = tl.load(probs_ptr + t * K + kk, mask=valid, other=0.0).to(tl.float32)
        if DOT:
            dot = tl.full((K_PAD,), 0.0, tl.float32)
        hh0 = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + hh0
            hm = hh < H
            m = valid[:, None] & hm[None, :]
            v = tl.load(src_ptr + t * stride_src + hh, mask=hm, other=0.0)
            if HAS_PROBS:
                tile = (w[:, None] * v.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
            else:
                tile = tl.broadcast_to(v[None, :], (K_PAD, BLOCK_H)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * stride_out + hh[None, :], tile, mask=m)
            if DOT:
                yv = tl.load(y_ptr + rows[:, None] * stride_y + hh[None, :], mask=m, other=0.0).to(tl.float32)
                dot += tl.reduce(yv * v.to(tl.float32)[None, :], 1, _sum_combine)
        if DOT:
            tl.store(dot_ptr + t * K + kk, dot, mask=kk < K)

    def _gather_sum_kernel(src_ptr, rows_ptr, probs_ptr, out_ptr, copy_ptr, stride_src, stride_out, stride_copy,
                           H, K, R, HAS_PROBS: tl.constexpr, COPY: tl.constexpr, K_PAD: tl.constexpr,
                           BLOCK_H: tl.constexpr):
        # One program per token t: out[t] = sum_k (probs[t, k] *) src[row of (t, k)], fp32 accumulation.
        # COPY: every row read is also written to the same row of copy (src is a buffer about to be reused).
        # The copies one row at a time, unrolled (every load in flight at once, no reduction across warps): at the
        # copy's speed where a (K_PAD, BLOCK_H) tile reduced over K ran 1.7x (all K valid) to 4.2x (2 of 8 valid,
        # each token once per rank) slower (1xH100, benchmarks/results/step_kernels_rows_1xh100.json).
        t = tl.program_id(0).to(tl.int64)
        hh0 = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + hh0
            hm = hh < H
            acc = tl.full((BLOCK_H,), 0.0, tl.float32)
            for k in tl.static_range(K_PAD):
                row = tl.load(rows_ptr + t * K + k, mask=k < K, other=-1).to(tl.int64)
                ok = (row >= 0) & (row < R)
                m = hm & ok
                raw = tl.load(src_ptr + row * stride_src + hh, mask=m, other=0.0)
                if COPY:
                    tl.store(copy_ptr + row * stride_copy + hh, raw, mask=m)
                v = raw.to(tl.float32)
                if HAS_PROBS:
                    v = v * tl.load(probs_ptr + t * K + k, mask=ok, other=0.0).to(tl.float32)
                acc += v
            tl.store(out_ptr + t * stride_out + hh, acc.to(out_ptr.dtype.element_ty), mask=hm)

    def _zero_rows_kernel(out_ptr, count_ptr, stride_out, H, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        # Rows [0, count) of out set to zero, count read on the device; programs past it return at once (the grid
        # covers the worst case).
        count = tl.load(count_ptr).to(tl.int64)
        first = tl.program_id(0).to(tl.int64) * BLOCK_R
        if first < count:
            rows = first + tl.arange(0, BLOCK_R)
            hh0 = tl.arange(0, BLOCK_H)
            zeros = tl.full((BLOCK_R, BLOCK_H), 0.0, out_ptr.dtype.element_ty)
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + hh0
                tl.store(out_ptr + rows[:, None] * stride_out + hh[None, :], zeros,
                         mask=(rows[:, None] < count) & (hh[None, :] < H))

    _rank_hist = Kernel(_rank_hist_kernel)
    _zero_rows = Kernel(_zero_rows_kernel, do_not_specialize=["H"])
    _position = Kernel(_position_kernel)
    _scatter_rows = Kernel(_scatter_rows_kernel, do_not_specialize=["R"])  # dropless R changes every step
    _gather_sum = Kernel(_gather_sum_kernel, do_not_specialize=["R"])


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _power_of_two(name: str, n: int) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{name} must be a power of two, got {n}")
    return n


def _row_tile(K: int, H: int, block_h: Optional[int]) -> tuple[int, int, int]:
    """(K_PAD, BLOCK_H, num_warps): a (K_PAD, BLOCK_H) tile of at most 8K elements, rows moved in BLOCK_H chunks."""
    k_pad = max(2, _next_pow2(K))
    if block_h is None:
        block_h = min(_next_pow2(H), 4096, max(256, 8192 // k_pad))
    else:
        _power_of_two("block_h", block_h)
    num_warps = 8 if k_pad * block_h >= 4096 else 4
    return k_pad, max(16, block_h), num_warps


def _rows_2d(t: torch.Tensor) -> torch.Tensor:
    """A (rows, H) tensor with unit stride along H (row stride free)."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


# ----------------------------------------------------------------------------------------------------------
# Index computation
# ----------------------------------------------------------------------------------------------------------

def _valid_copies(experts_flat: torch.Tensor, num_experts: int, keep_flat: Optional[torch.Tensor]) -> torch.Tensor:
    valid = (experts_flat >= 0) & (experts_flat < num_experts)
    if keep_flat is not None:
        valid &= keep_flat.bool()
    return valid


def _check_routing(experts_TK: torch.Tensor, num_experts: int, keep_TK: Optional[torch.Tensor]) -> None:
    _check_2d("experts_TK", experts_TK)
    if experts_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"experts_TK must be int32 or int64, got {experts_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if keep_TK is not None and keep_TK.shape != experts_TK.shape:
        raise ValueError(f"keep_TK shape {tuple(keep_TK.shape)} != experts_TK shape {tuple(experts_TK.shape)}")


def copy_positions_torch(experts_TK: torch.Tensor, num_experts: int,
                         keep_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `copy_positions`: stable argsort by expert, rank = sorted index - expert start."""
    _check_routing(experts_TK, num_experts, keep_TK)
    flat = experts_TK.reshape(-1).long()
    n = flat.numel()
    valid = _valid_copies(flat, num_experts, None if keep_TK is None else keep_TK.reshape(-1))
    key = torch.where(valid, flat, num_experts)  # uncounted copies sort last, into a spare bucket
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    # first sorted index of every expert (and of the spare bucket): no atomics, no host sync
    bounds = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=flat.device))
    rank_sorted = torch.arange(n, device=flat.device) - bounds[sorted_key]
    position = torch.empty(n, dtype=torch.int32, device=flat.device)
    position[order] = rank_sorted.to(torch.int32)
    position = torch.where(valid, position, -1)
    return position.view(experts_TK.shape), bounds.diff()


def _copy_positions_triton(experts_TK, num_experts, keep_TK, capacity, rows: int, block_n: int):
    """Shared body of copy_positions_triton / copy_rows_triton. rows: 0 none, 1 dropless, 2 capacity."""
    _require_triton()
    _check_routing(experts_TK, num_experts, keep_TK)
    dev = experts_TK.device
    experts = experts_TK.reshape(-1).contiguous()
    n = experts.numel()
    position = torch.empty(experts_TK.shape, dtype=torch.int32, device=dev)
    row = torch.empty(experts_TK.shape, dtype=torch.int32, device=dev) if rows else position
    if n == 0:
        counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
        return position, row, counts
    keep = experts if keep_TK is None else keep_TK.reshape(-1).contiguous()
    if keep.dtype == torch.bool:
        keep = keep.view(torch.uint8)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    num_blocks = triton.cdiv(n, block_n)
    hist = torch.zeros((num_experts, num_blocks), dtype=torch.int32, device=dev)
    _rank_hist[(num_blocks,), dev](experts, keep, position, hist, n, num_experts, num_blocks,
                                   HAS_KEEP=keep_TK is not None, BLOCK_N=block_n, num_warps=8)
    incl = torch.cumsum(hist, 1)  # int64; experts x blocks: a scan along the inner dim (the outer one is slow)
    counts = incl[:, -1]
    base = incl - hist  # exclusive prefix over blocks
    start = torch.cumsum(counts, 0) - counts if rows == 1 else counts
    _position[(num_blocks,), dev](experts, keep, base, start, position, row, n, num_experts,
                                  0 if capacity is None else int(capacity), num_blocks,
                                  HAS_KEEP=keep_TK is not None, ROWS=rows, BLOCK_N=block_n, num_warps=4)
    return position, row, counts


def copy_positions_triton(experts_TK: torch.Tensor, num_experts: int, keep_TK: Optional[torch.Tensor] = None,
                          *, block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `copy_positions`: per block of `block_n` copies a rank-in-block and a per-expert count (one
    kernel), an exclusive prefix sum of the counts over blocks (torch cumsum of a (blocks, E) table), then
    position = base + rank (one kernel). No atomics: the result does not depend on scheduling."""
    position, _, counts = _copy_positions_triton(experts_TK, num_experts, keep_TK, None, 0, block_n)
    return position, counts


def copy_positions(experts_TK: torch.Tensor, num_experts: int,
                   keep_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_TK int32, tokens_per_expert_E int64) of the copies experts_TK (T, K).

    position_TK[t, k] counts the copies of the same expert that come before (t, k) in flat order t*K + k: a
    stable counting-sort rank, deterministic. Only counted copies take part: with keep_TK (bool (T, K)) only
    kept ones, and never a copy whose expert id lies outside [0, num_experts); an uncounted copy gets
    position -1 and is not in tokens_per_expert_E. Capacity mode ranks kept copies only: pass keep_TK.
    """
    if use_triton(experts_TK, "permute"):
        return copy_positions_triton(experts_TK, num_experts, keep_TK)
    return copy_positions_torch(experts_TK, num_experts, keep_TK)


def rows_from_positions(experts_TK: torch.Tensor, position_TK: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                        capacity: Optional[int] = None,
                        keep_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_of_copy_TK int32, rows_per_expert_E int64) from positions (torch on every device; a few
    elementwise ops, no host sync).

    capacity None (dropless): rows packed by expert, row = exclusive_cumsum(tokens_per_expert)[e] + position;
      rows_per_expert_E = tokens_per_expert_E; num_rows = tokens_per_expert_E.sum() (the caller's host sync).
    capacity C: static layout, expert e owns rows [e*C, (e+1)*C); row = e*C + position for a counted copy with
      position < C, else -1 (a later copy is dropped); rows_per_expert_E = C for every expert, num_rows = E*C.
    A copy with position -1, or not in keep_TK, gets row -1. Positions must come from `copy_positions` with
    the same keep_TK (capacity mode ranks kept copies only).
    """
    num_experts = tokens_per_expert_E.numel()
    valid = position_TK >= 0
    if keep_TK is not None:
        valid &= keep_TK.bool()
    e = experts_TK.long().clamp(0, max(num_experts - 1, 0))
    pos = position_TK.long()
    if capacity is None:
        counts = tokens_per_expert_E.long()
        start = torch.cumsum(counts, 0) - counts
        row = torch.where(valid, start[e] + pos, -1)
        rows_per_expert = counts
    else:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        valid &= pos < capacity
        row = torch.where(valid, e * capacity + pos, -1)
        rows_per_expert = torch.full((num_experts,), int(capacity), dtype=torch.int64, device=experts_TK.device)
    return row.to(torch.int32), rows_per_expert


def copy_rows_torch(experts_TK: torch.Tensor, num_experts: int, capacity: Optional[int] = None,
                    keep_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of `copy_rows`: copy_positions_torch, then rows_from_positions."""
    position, counts = copy_positions_torch(experts_TK, num_experts, keep_TK)
    row, rows_per_expert = rows_from_positions(experts_TK, position, counts, capacity, keep_TK)
    return row, counts, rows_per_expert


def copy_rows_triton(experts_TK: torch.Tensor, num_experts: int, capacity: Optional[int] = None,
                     keep_TK: Optional[torch.Tensor] = None, *,
                     block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `copy_rows`: the rows are written by the second kernel of copy_positions_triton."""
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    _, row, counts = _copy_positions_triton(experts_TK, num_experts, keep_TK, capacity,
                                            1 if capacity is None else 2, block_n)
    if capacity is None:
        rows_per_expert = counts
    else:
        rows_per_expert = torch.full((num_experts,), int(capacity), dtype=torch.int64, device=experts_TK.device)
    return row, counts, rows_per_expert


def copy_rows(experts_TK: torch.Tensor, num_experts: int, capacity: Optional[int] = None,
              keep_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_of_copy_TK int32, tokens_per_expert_E int64, rows_per_expert_E int64) in one call:
    `copy_positions` + `rows_from_positions`, fused into the index kernels on the Triton side."""
    if use_triton(experts_TK, "permute"):
        return copy_rows_triton(experts_TK, num_experts, capacity, keep_TK)
    return copy_rows_torch(experts_TK, num_experts, capacity, keep_TK)


# ----------------------------------------------------------------------------------------------------------
# Permute
# ----------------------------------------------------------------------------------------------------------

def _new_rows(num_rows: int, like: torch.Tensor, all_rows_mapped: bool,
              zero_below: Optional[torch.Tensor] = None) -> torch.Tensor:
    alloc = torch.zeros if not all_rows_mapped and zero_below is None else torch.empty
    out = alloc((num_rows, like.shape[1]), dtype=like.dtype, device=like.device)
    if not all_rows_mapped and zero_below is not None:
        _zero_rows_below(out, zero_below)
    return out


def _zero_rows_below(out_RH: torch.Tensor, zero_below: torch.Tensor) -> None:
    """out_RH[:zero_below] = 0 with the count on the device (Triton; the twins fill every row instead)."""
    R, H = out_RH.shape
    if R == 0 or H == 0:
        return
    block_r, block_h = 16, min(_next_pow2(H), 256)
    _zero_rows[(triton.cdiv(R, block_r),), out_RH.device](out_RH, zero_below.reshape(-1)[:1], out_RH.stride(0), H,
                                                          BLOCK_R=block_r, BLOCK_H=block_h)


def _check_out(out: Optional[torch.Tensor], num_rows: int, x_TH: torch.Tensor) -> None:
    if out is not None and (out.shape != (num_rows, x_TH.shape[1]) or out.dtype != x_TH.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be a ({num_rows}, {x_TH.shape[1]}) {x_TH.dtype} tensor with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")


def _copy_index(row_of_copy_TK: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid copies (T*K,), row index (T*K,) int64 with uncounted copies sent to the spare row num_rows)."""
    rows = row_of_copy_TK.reshape(-1).long()
    valid = rows >= 0
    return valid, torch.where(valid, rows, num_rows)


def _gather_copies(src_RH: torch.Tensor, row_of_copy_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 rows of every copy (T, K, H), zero for -1 copies; valid (T, K))."""
    T, K = row_of_copy_TK.shape
    rows = row_of_copy_TK.long()
    valid = rows >= 0
    if src_RH.shape[0] == 0:
        return src_RH.new_zeros((T, K, src_RH.shape[1]), dtype=torch.float32), valid
    g = src_RH.index_select(0, rows.clamp(min=0).reshape(-1)).view(T, K, src_RH.shape[1]).float()
    return torch.where(valid.unsqueeze(-1), g, 0.0), valid


def permute_torch(x_TH: torch.Tensor, row_of_copy_TK: torch.Tensor, num_rows: int,
                  all_rows_mapped: bool = False, out: Optional[torch.Tensor] = None, *,
                  zero_below: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Twin of `permute`: index_copy_ of the expanded copies into num_rows + 1 rows (the spare row takes -1);
    every unmapped row zero, also past ``zero_below``."""
    _check_2d("x_TH", x_TH)
    _check_copies(row_of_copy_TK, x_TH.shape[0])
    _check_out(out, num_rows, x_TH)
    T, H = x_TH.shape
    K = row_of_copy_TK.shape[1]
    buf = x_TH.new_zeros((num_rows + 1, H))
    _, index = _copy_index(row_of_copy_TK, num_rows)
    buf.index_copy_(0, index, x_TH.unsqueeze(1).expand(T, K, H).reshape(T * K, H))
    return buf[:num_rows] if out is None else out.copy_(buf[:num_rows])


def permute_triton(x_TH: torch.Tensor, row_of_copy_TK: torch.Tensor, num_rows: int,
                   all_rows_mapped: bool = False, out: Optional[torch.Tensor] = None, *,
                   zero_below: Optional[torch.Tensor] = None, block_h: Optional[int] = None) -> torch.Tensor:
    """Triton `permute`: one program per token; its row read once, written to its K rows BLOCK_H at a time."""
    _require_triton()
    _check_2d("x_TH", x_TH)
    _check_copies(row_of_copy_TK, x_TH.shape[0])
    _check_out(out, num_rows, x_TH)
    if out is None:
        out = _new_rows(num_rows, x_TH, all_rows_mapped, zero_below)
    elif not all_rows_mapped and zero_below is not None:
        _zero_rows_below(out, zero_below)
    elif not all_rows_mapped:
        out.zero_()
    T, H = x_TH.shape
    K = row_of_copy_TK.shape[1]
    if T == 0 or K == 0 or H == 0 or num_rows == 0:
        return out
    x = _rows_2d(x_TH)
    rows = row_of_copy_TK.contiguous()
    k_pad, bh, warps = _row_tile(K, H, block_h)
    _scatter_rows[(T,), x.device](x, rows, x, out, x, x, x.stride(0), out.stride(0), 0, H, K, num_rows,
                                  HAS_PROBS=False, DOT=False, K_PAD=k_pad, BLOCK_H=bh, num_warps=warps)
    return out


def permute(x_TH: torch.Tensor, row_of_copy_TK: torch.Tensor, num_rows: int,
            all_rows_mapped: bool = False, out: Optional[torch.Tensor] = None, *,
            zero_below: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x_RH (num_rows, H): row row_of_copy_TK[t, k] = x_TH[t]; rows no copy maps to are zero (unless
    all_rows_mapped; only those below ``zero_below``, when given); -1 copies are skipped. num_rows comes from the
    caller (no host sync here). ``out``: written into (and returned) instead of a new tensor, e.g. the first H
    columns of a wider buffer (rows may be strided)."""
    if use_triton(x_TH, "permute"):
        return permute_triton(x_TH, row_of_copy_TK, num_rows, all_rows_mapped, out, zero_below=zero_below)
    return permute_torch(x_TH, row_of_copy_TK, num_rows, all_rows_mapped, out, zero_below=zero_below)


def permute_backward_torch(grad_RH: torch.Tensor, row_of_copy_TK: torch.Tensor) -> torch.Tensor:
    """Twin of `permute_backward`: gather the copies' rows, fp32 sum over k."""
    _check_2d("grad_RH", grad_RH)
    _check_copies(row_of_copy_TK, row_of_copy_TK.shape[0])
    g, _ = _gather_copies(grad_RH, row_of_copy_TK)
    return g.sum(1).to(grad_RH.dtype)


def _launch_gather_sum(src_RH: torch.Tensor, row_of_copy_TK: torch.Tensor, probs_TK: Optional[torch.Tensor],
                       block_h: Optional[int], copy_out: Optional[torch.Tensor] = None, *,
                       num_warps: int = 4) -> torch.Tensor:
    """out[t] = sum_k (probs[t, k] *) src[row of (t, k)]: the one kernel behind permute_backward and unpermute."""
    T, K = row_of_copy_TK.shape
    R, H = src_RH.shape
    if T == 0 or H == 0 or K == 0 or R == 0:
        return src_RH.new_zeros((T, H))
    out = src_RH.new_empty((T, H))
    src = _rows_2d(src_RH)
    probs = src if probs_TK is None else probs_TK.contiguous()  # an unused pointer without probs
    copy = src if copy_out is None else copy_out
    bh = min(_next_pow2(H), 1024) if block_h is None else _power_of_two("block_h", block_h)
    _gather_sum[(T,), src.device](src, row_of_copy_TK.contiguous(), probs, out, copy, src.stride(0), out.stride(0),
                                  copy.stride(0), H, K, R, HAS_PROBS=probs_TK is not None, COPY=copy_out is not None,
                                  K_PAD=max(2, _next_pow2(K)), BLOCK_H=max(16, bh), num_warps=num_warps)
    return out


def permute_backward_triton(grad_RH: torch.Tensor, row_of_copy_TK: torch.Tensor, *,
                            block_h: Optional[int] = None) -> torch.Tensor:
    """Triton `permute_backward`: one program per token, its K rows summed in fp32 BLOCK_H at a time."""
    _require_triton()
    _check_2d("grad_RH", grad_RH)
    _check_copies(row_of_copy_TK, row_of_copy_TK.shape[0])
    return _launch_gather_sum(grad_RH, row_of_copy_TK, None, block_h)


def permute_backward(grad_RH: torch.Tensor, row_of_copy_TK: torch.Tensor) -> torch.Tensor:
    """grad_TH[t] = sum_k grad_RH[row_of_copy_TK[t, k]] (fp32 accumulation, grad's dtype); -1 copies add nothing."""
    if use_triton(grad_RH, "permute"):
        return permute_backward_triton(grad_RH, row_of_copy_TK)
    return permute_backward_torch(grad_RH, row_of_copy_TK)


# ----------------------------------------------------------------------------------------------------------
# Unpermute
# ----------------------------------------------------------------------------------------------------------

def _check_unpermute(y_RH, row_of_copy_TK, probs_TK, copy_out) -> None:
    _check_2d("y_RH", y_RH)
    _check_copies(row_of_copy_TK, probs_TK.shape[0] if probs_TK.dim() == 2 else -1)
    _check_probs(probs_TK, row_of_copy_TK)
    if copy_out is not None and (copy_out.shape != y_RH.shape or copy_out.dtype != y_RH.dtype
                                 or copy_out.stride(1) != 1):
        raise ValueError(f"copy_out must be a {tuple(y_RH.shape)} {y_RH.dtype} tensor with contiguous rows, got "
                         f"{tuple(copy_out.shape)} {copy_out.dtype}")


def unpermute_torch(y_RH: torch.Tensor, row_of_copy_TK: torch.Tensor, probs_TK: torch.Tensor,
                    copy_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Twin of `unpermute`: gather the copies' rows, fp32 weighted sum over k."""
    _check_unpermute(y_RH, row_of_copy_TK, probs_TK, copy_out)
    if copy_out is not None:
        rows = row_of_copy_TK.reshape(-1).long()
        rows = rows[rows >= 0]
        copy_out[rows] = y_RH[rows]
    g, valid = _gather_copies(y_RH, row_of_copy_TK)
    w = torch.where(valid, probs_TK.float(), 0.0)
    return (g * w.unsqueeze(-1)).sum(1).to(y_RH.dtype)


def unpermute_triton(y_RH: torch.Tensor, row_of_copy_TK: torch.Tensor, probs_TK: torch.Tensor,
                     copy_out: Optional[torch.Tensor] = None, *, block_h: Optional[int] = None) -> torch.Tensor:
    """Triton `unpermute`: one program per token, its K rows weighted and summed in fp32 BLOCK_H at a time."""
    _require_triton()
    _check_unpermute(y_RH, row_of_copy_TK, probs_TK, copy_out)
    return _launch_gather_sum(y_RH, row_of_copy_TK, probs_TK, block_h, copy_out)


def unpermute(y_RH: torch.Tensor, row_of_copy_TK: torch.Tensor, probs_TK: torch.Tensor,
              copy_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out_TH[t] = sum_k probs_TK[t, k] * y_RH[row_of_copy_TK[t, k]], fp32 accumulation, y's dtype;
    -1 copies add nothing. ``copy_out``: also copy every row read into the same row of it, in the same pass (the
    copy-out of a received buffer about to be reused, fused with the unpermute)."""
    if use_triton(y_RH, "permute"):
        return unpermute_triton(y_RH, row_of_copy_TK, probs_TK, copy_out)
    return unpermute_torch(y_RH, row_of_copy_TK, probs_TK, copy_out)


def _unpermute_backward_args(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, num_rows):
    _check_2d("grad_out_TH", grad_out_TH)
    _check_copies(row_of_copy_TK, grad_out_TH.shape[0])
    _check_probs(probs_TK, row_of_copy_TK)
    if y_RH is not None:
        _check_2d("y_RH", y_RH)
        if y_RH.shape[1] != grad_out_TH.shape[1]:
            raise ValueError(f"y_RH hidden {y_RH.shape[1]} != grad_out_TH hidden {grad_out_TH.shape[1]}")
        if num_rows is None:
            num_rows = y_RH.shape[0]
        elif num_rows != y_RH.shape[0]:
            raise ValueError(f"num_rows {num_rows} != y_RH rows {y_RH.shape[0]}")
    elif num_rows is None:
        raise ValueError("unpermute_backward needs y_RH or num_rows")
    return num_rows


def unpermute_backward_torch(grad_out_TH: torch.Tensor, y_RH: Optional[torch.Tensor], row_of_copy_TK: torch.Tensor,
                             probs_TK: torch.Tensor, all_rows_mapped: bool = False, *,
                             num_rows: Optional[int] = None, zero_below: Optional[torch.Tensor] = None
                             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Twin of `unpermute_backward` (every unmapped row zero, also past ``zero_below``)."""
    num_rows = _unpermute_backward_args(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, num_rows)
    T, K = row_of_copy_TK.shape
    H = grad_out_TH.shape[1]
    g32 = grad_out_TH.float()
    _, index = _copy_index(row_of_copy_TK, num_rows)
    src = (probs_TK.float().unsqueeze(-1) * g32.unsqueeze(1)).to(grad_out_TH.dtype).reshape(T * K, H)
    buf = grad_out_TH.new_zeros((num_rows + 1, H))
    buf.index_copy_(0, index, src)
    grad_probs = None
    if y_RH is not None:
        ycopies, _ = _gather_copies(y_RH, row_of_copy_TK)
        grad_probs = (ycopies * g32.unsqueeze(1)).sum(-1)
    return buf[:num_rows], grad_probs


def unpermute_backward_triton(grad_out_TH: torch.Tensor, y_RH: Optional[torch.Tensor],
                              row_of_copy_TK: torch.Tensor, probs_TK: torch.Tensor, all_rows_mapped: bool = False,
                              *, num_rows: Optional[int] = None, zero_below: Optional[torch.Tensor] = None,
                              block_h: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Triton `unpermute_backward`: one program per token reads grad_out[t] once, writes probs * grad_out to its
    K rows and (with y_RH) accumulates the K dot products in fp32, BLOCK_H at a time."""
    _require_triton()
    num_rows = _unpermute_backward_args(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, num_rows)
    T, K = row_of_copy_TK.shape
    H = grad_out_TH.shape[1]
    grad_y = _new_rows(num_rows, grad_out_TH, all_rows_mapped, zero_below)
    dot = None if y_RH is None else torch.zeros((T, K), dtype=torch.float32, device=grad_out_TH.device)
    if T == 0 or H == 0 or K == 0 or num_rows == 0:
        return grad_y, dot
    g = _rows_2d(grad_out_TH)
    y = g if y_RH is None else _rows_2d(y_RH)
    rows = row_of_copy_TK.contiguous()
    probs = probs_TK.contiguous()
    k_pad, bh, warps = _row_tile(K, H, block_h)
    _scatter_rows[(T,), g.device](g, rows, probs, grad_y, y, g if dot is None else dot,
                                  g.stride(0), grad_y.stride(0), y.stride(0), H, K, num_rows,
                                  HAS_PROBS=True, DOT=dot is not None, K_PAD=k_pad, BLOCK_H=bh, num_warps=warps)
    return grad_y, dot


def unpermute_backward(grad_out_TH: torch.Tensor, y_RH: Optional[torch.Tensor], row_of_copy_TK: torch.Tensor,
                       probs_TK: torch.Tensor, all_rows_mapped: bool = False, *,
                       num_rows: Optional[int] = None, zero_below: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(grad_y_RH, grad_probs_TK) of `unpermute`.

    grad_y_RH[row_of_copy_TK[t, k]] = probs_TK[t, k] * grad_out_TH[t] (grad_out's dtype); rows no copy maps to
    are zero unless all_rows_mapped (only those below ``zero_below``, when given). grad_probs_TK[t, k] =
    <y_RH[row], grad_out_TH[t]> in fp32, 0 for -1 copies; computed only when y_RH is given (pass y_RH=None and
    num_rows when probs need no gradient).
    """
    if use_triton(grad_out_TH, "permute"):
        return unpermute_backward_triton(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, all_rows_mapped,
                                         num_rows=num_rows, zero_below=zero_below)
    return unpermute_backward_torch(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, all_rows_mapped,
                                    num_rows=num_rows, zero_below=zero_below)


# ----------------------------------------------------------------------------------------------------------
# Autograd Functions
# ----------------------------------------------------------------------------------------------------------

class Permute(torch.autograd.Function):
    """x_RH = permute(x_TH, row_of_copy_TK, num_rows); backward = permute_backward.
    apply(x_TH, row_of_copy_TK, num_rows, all_rows_mapped=False) (positional)."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, row_of_copy_TK: torch.Tensor, num_rows: int,
                all_rows_mapped: bool = False) -> torch.Tensor:
        ctx.save_for_backward(row_of_copy_TK)
        ctx.x_dtype = x_TH.dtype
        return permute(x_TH, row_of_copy_TK, num_rows, all_rows_mapped)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):
        (row_of_copy_TK,) = ctx.saved_tensors
        grad_TH = permute_backward(grad_RH, row_of_copy_TK)
        return grad_TH.to(ctx.x_dtype), None, None, None


class Unpermute(torch.autograd.Function):
    """out_TH = unpermute(y_RH, row_of_copy_TK, probs_TK); backward = unpermute_backward.
    apply(y_RH, row_of_copy_TK, probs_TK, all_rows_mapped=False) (positional); all_rows_mapped skips zeroing
    the unmapped rows of grad_y. y_RH is saved only when probs_TK needs a gradient."""

    @staticmethod
    def forward(ctx, y_RH: torch.Tensor, row_of_copy_TK: torch.Tensor, probs_TK: torch.Tensor,
                all_rows_mapped: bool = False) -> torch.Tensor:
        need_probs_grad = ctx.needs_input_grad[2]
        ctx.save_for_backward(y_RH if need_probs_grad else None, row_of_copy_TK, probs_TK)
        ctx.num_rows = y_RH.shape[0]
        ctx.y_dtype = y_RH.dtype
        ctx.all_rows_mapped = all_rows_mapped
        return unpermute(y_RH, row_of_copy_TK, probs_TK)

    @staticmethod
    def backward(ctx, grad_out_TH: torch.Tensor):
        y_RH, row_of_copy_TK, probs_TK = ctx.saved_tensors
        grad_y, grad_probs = unpermute_backward(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, ctx.all_rows_mapped,
                                                num_rows=ctx.num_rows)
        if not ctx.needs_input_grad[0]:
            grad_y = None
        elif grad_y.dtype != ctx.y_dtype:
            grad_y = grad_y.to(ctx.y_dtype)
        if grad_probs is not None:
            grad_probs = grad_probs.to(probs_TK.dtype)
        return grad_y, None, grad_probs, None
