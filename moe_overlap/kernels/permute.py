"""Fused permute / unpermute of the MoE token dispatch: Triton kernels, their torch twins, autograd Functions.

Vocabulary (suffixes name dimensions: T tokens, K copies per token, E experts, R permuted rows, H hidden):

  copy (t, k)        the k-th routed copy of token t, going to expert experts_TK[t, k]
  row_of_copy_TK     the permuted row a copy lives in; -1: no row (the copy was dropped): kernels/copy_rows.py
                     computes it from the routing

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

`fp8_out` (permute, unpermute_backward; every row mapped): the rows written also as E4M3 with one float32 scale
each, bit for bit what kernels/fp8_quant.quantize_rows makes of them, in the same pass; `Fp8Handoff` carries them
from Permute and Unpermute to the rowwise FP8 GEMMs that read those rows next (layers/experts.py).

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

from moe_overlap.kernels.fp8_quant import FP8, quantize_rows_torch
from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, check_2d, require_triton, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe_overlap.kernels.fp8_quant import TL_AMAX_FLOOR as _AMAX_FLOOR, TL_FP8_MAX as _FP8_MAX
    from moe_overlap.kernels.launch import DeviceFunction, max_combine, sum_combine as _sum_combine

__all__ = [
    "HAVE_TRITON",
    "permute", "permute_torch", "permute_triton",
    "permute_backward", "permute_backward_torch", "permute_backward_triton",
    "unpermute", "unpermute_torch", "unpermute_triton",
    "unpermute_backward", "unpermute_backward_torch", "unpermute_backward_triton",
    "Fp8Handoff", "Permute", "Unpermute",
]


def _check_copies(row_of_copy_TK: torch.Tensor, num_tokens: int, name: str = "row_of_copy_TK") -> None:
    check_2d(name, row_of_copy_TK)
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

    def _scatter_rows_kernel(src_ptr, rows_ptr, probs_ptr, out_ptr, y_ptr, dot_ptr, q_ptr, scale_ptr,
                             stride_src, stride_out, stride_y, stride_q, H, K, R,
                             HAS_PROBS: tl.constexpr, DOT: tl.constexpr, QUANT: tl.constexpr,
                             K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
        # One program per token t: src row t is read once (BLOCK_H at a time) and written to the rows of its
        # K copies, scaled by probs[t, k] when HAS_PROBS (unpermute backward). DOT: also dot[t, k] =
        # <y[row of (t, k)], src[t]> in fp32 (the probs gradient). QUANT: each written row also as E4M3 with its
        # scale (kernels/fp8_quant.quantize_rows of the written row, bit for bit), from the token row's amax (a first
        # pass; the second reads the row from L2): a copy row is probs[t, k] * src[t] rounded to out's dtype, and
        # both roundings are monotone, so its amax is that of the token's amax times probs[t, k], rounded alike.
        # A token without a valid copy reads nothing (a static buffer's rows past the ones received: wire rows).
        t = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, K_PAD)
        rows = tl.load(rows_ptr + t * K + kk, mask=kk < K, other=-1).to(tl.int64)
        valid = (rows >= 0) & (rows < R)
        if HAS_PROBS:
            w = tl.load(probs_ptr + t * K + kk, mask=valid, other=0.0).to(tl.float32)
        if DOT:
            dot = tl.full((K_PAD,), 0.0, tl.float32)
        hh0 = tl.arange(0, BLOCK_H)
        H_live = tl.where(tl.reduce(valid.to(tl.int32), 0, max_combine) > 0, H, 0)  # no copy: no pass over the row
        if QUANT:
            amax_H = tl.full((BLOCK_H,), 0.0, tl.float32)
            for h0 in range(0, H_live, BLOCK_H):
                v = tl.load(src_ptr + t * stride_src + h0 + hh0, mask=h0 + hh0 < H, other=0.0)
                amax_H = tl.maximum(amax_H, tl.abs(v.to(tl.float32)))
            amax_K = tl.full((K_PAD,), 0.0, tl.float32) + tl.reduce(amax_H, 0, max_combine)
            if HAS_PROBS:
                amax_K = (w * amax_K).to(out_ptr.dtype.element_ty).to(tl.float32)
            amax_K = tl.maximum(amax_K, _AMAX_FLOOR)
            tl.store(scale_ptr + rows, tl.math.div_rn(amax_K, _FP8_MAX), mask=valid)
            inverse_K = tl.math.div_rn(_FP8_MAX, amax_K)
        for h0 in range(0, H_live, BLOCK_H):
            hh = h0 + hh0
            hm = hh < H
            m = valid[:, None] & hm[None, :]
            v = tl.load(src_ptr + t * stride_src + hh, mask=hm, other=0.0)
            if HAS_PROBS:
                tile = (w[:, None] * v.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
            else:
                tile = tl.broadcast_to(v[None, :], (K_PAD, BLOCK_H)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * stride_out + hh[None, :], tile, mask=m)
            if QUANT:
                q = tl.minimum(tl.maximum(tile.to(tl.float32) * inverse_K[:, None], -_FP8_MAX), _FP8_MAX)
                tl.store(q_ptr + rows[:, None] * stride_q + hh[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
            if DOT:
                yv = tl.load(y_ptr + rows[:, None] * stride_y + hh[None, :], mask=m, other=0.0).to(tl.float32)
                dot += tl.reduce(yv * v.to(tl.float32)[None, :], 1, _sum_combine)
        if DOT:
            tl.store(dot_ptr + t * K + kk, dot, mask=kk < K)

    def _gathered(src_ptr, rows_ptr, probs_ptr, copy_ptr, t, k, in_range, R, K, hh, hm, stride_src, stride_copy,
                  HAS_PROBS: tl.constexpr, COPY: tl.constexpr):
        """Copy k's row of token t (zeros where k is out of range or the copy is not valid), weighted by its
        prob (HAS_PROBS), in fp32; copied into copy's same row too (COPY)."""
        row = tl.load(rows_ptr + t * K + k, mask=in_range, other=-1).to(tl.int64)
        ok = (row >= 0) & (row < R)
        m = hm & ok
        raw = tl.load(src_ptr + row * stride_src + hh, mask=m, other=0.0)
        if COPY:
            tl.store(copy_ptr + row * stride_copy + hh, raw, mask=m)
        v = raw.to(tl.float32)
        if HAS_PROBS:
            v = v * tl.load(probs_ptr + t * K + k, mask=ok, other=0.0).to(tl.float32)
        return v

    gathered = DeviceFunction(_gathered)

    def _gather_sum_kernel(src_ptr, rows_ptr, probs_ptr, out_ptr, copy_ptr, stride_src, stride_out, stride_copy,
                           H, K, R, split, HAS_PROBS: tl.constexpr, COPY: tl.constexpr, K_PAD: tl.constexpr,
                           EARLY_PAD: tl.constexpr, LATE_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
        # One program per token t: out[t] = sum_k (probs[t, k] *) src[row of (t, k)], fp32 accumulation.
        # COPY: every row read is also written to the same row of copy (src is a buffer about to be reused).
        # The copies one row at a time, unrolled (every load in flight at once, no reduction across warps): at the
        # copy's speed where a (K_PAD, BLOCK_H) tile reduced over K ran 1.7x (all K valid) to 4.2x (2 of 8 valid,
        # each token once per rank) slower (1xH100, benchmarks/results/step_kernels_rows_1xh100.json).
        # A token without a valid copy only writes its zeros (a static buffer's rows past the ones received).
        # Columns from ``split`` on (LATE_PAD of them) are rarely valid: their loop runs only for a token with one.
        t = tl.program_id(0).to(tl.int64)
        hh0 = tl.arange(0, BLOCK_H)
        kk = tl.arange(0, K_PAD)
        rows_K = tl.load(rows_ptr + t * K + kk, mask=kk < K, other=-1).to(tl.int64)
        valid_K = ((rows_K >= 0) & (rows_K < R)).to(tl.int32)
        has_copies = tl.reduce(valid_K, 0, max_combine) > 0
        if LATE_PAD > 0:
            has_late = tl.reduce(tl.where(kk >= split, valid_K, 0), 0, max_combine) > 0
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + hh0
            hm = hh < H
            acc = tl.full((BLOCK_H,), 0.0, tl.float32)
            if has_copies:
                for k in tl.static_range(EARLY_PAD):
                    acc += gathered(src_ptr, rows_ptr, probs_ptr, copy_ptr, t, k, k < split, R, K, hh, hm,
                                     stride_src, stride_copy, HAS_PROBS, COPY)
                if LATE_PAD > 0:
                    if has_late:
                        for k in tl.static_range(LATE_PAD):
                            acc += gathered(src_ptr, rows_ptr, probs_ptr, copy_ptr, t, split + k, split + k < K,
                                             R, K, hh, hm, stride_src, stride_copy, HAS_PROBS, COPY)
            tl.store(out_ptr + t * stride_out + hh, acc.to(out_ptr.dtype.element_ty), mask=hm)

    def _zero_rows_kernel(out_ptr, count_ptr, stride_out, H, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        # Rows [0, count) of out set to zero, count read on the device; programs past it return at once (the grid
        # covers the worst case). H and the stride are specialized (fixed per model): their divisibility by 16 is
        # what lets the masked stores be 16-byte vectors (unspecialized, they were scalar: 0.7 ms for 256 MB on
        # H100, twice torch's fill of the whole worst-case buffer).
        count = tl.load(count_ptr).to(tl.int64)
        first = tl.program_id(0).to(tl.int64) * BLOCK_R
        if first < count:
            rows = first + tl.arange(0, BLOCK_R)
            hh0 = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
            zeros = tl.full((BLOCK_R, BLOCK_H), 0.0, out_ptr.dtype.element_ty)
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + hh0
                tl.store(out_ptr + rows[:, None] * stride_out + hh[None, :], zeros,
                         mask=(rows[:, None] < count) & (hh[None, :] < H))

    _zero_rows = Kernel(_zero_rows_kernel)
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
    block_h = min(_next_pow2(H), 1024)
    block_r = max(1, 16384 // block_h)  # 16 rows of 2048: 4 x 16-byte stores per lane per step at 8 warps
    _zero_rows[(triton.cdiv(R, block_r),), out_RH.device](out_RH, zero_below.reshape(-1)[:1], out_RH.stride(0), H,
                                                          BLOCK_R=block_r, BLOCK_H=block_h, num_warps=8)


def _check_out(out: Optional[torch.Tensor], num_rows: int, x_TH: torch.Tensor) -> None:
    if out is not None and (out.shape != (num_rows, x_TH.shape[1]) or out.dtype != x_TH.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be a ({num_rows}, {x_TH.shape[1]}) {x_TH.dtype} tensor with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")


Fp8Out = tuple[torch.Tensor, torch.Tensor]  # (q_RH E4M3, scale_R float32): rows quantized as quantize_rows does


def fp8_buffers(num_rows: int, H: int, device: torch.device) -> Fp8Out:
    """Empty buffers for ``fp8_out``: (q (num_rows, H) E4M3, scales (num_rows,) float32)."""
    return (torch.empty((num_rows, H), dtype=FP8, device=device),
            torch.empty(num_rows, dtype=torch.float32, device=device))


def _check_fp8_out(fp8_out: Optional[Fp8Out], num_rows: int, H: int, all_rows_mapped: bool) -> None:
    if fp8_out is None:
        return
    q, scale = fp8_out
    if not all_rows_mapped:
        raise ValueError("fp8_out needs all_rows_mapped=True (an unmapped row's FP8 copy would be left unwritten)")
    if q.shape != (num_rows, H) or q.dtype != FP8 or q.stride(1) != 1 or scale.shape != (num_rows,) \
            or scale.dtype != torch.float32 or scale.stride(0) != 1:
        raise ValueError(f"fp8_out must be a ({num_rows}, {H}) E4M3 tensor with contiguous rows and ({num_rows},) "
                         f"contiguous float32 scales, got {tuple(q.shape)} {q.dtype}, "
                         f"{tuple(scale.shape)} {scale.dtype}")


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
                  zero_below: Optional[torch.Tensor] = None, fp8_out: Optional[Fp8Out] = None) -> torch.Tensor:
    """Twin of `permute`: index_copy_ of the expanded copies into num_rows + 1 rows (the spare row takes -1);
    every unmapped row zero, also past ``zero_below``; then ``fp8_out`` quantized from the result."""
    check_2d("x_TH", x_TH)
    _check_copies(row_of_copy_TK, x_TH.shape[0])
    _check_out(out, num_rows, x_TH)
    _check_fp8_out(fp8_out, num_rows, x_TH.shape[1], all_rows_mapped)
    T, H = x_TH.shape
    K = row_of_copy_TK.shape[1]
    buf = x_TH.new_zeros((num_rows + 1, H))
    _, index = _copy_index(row_of_copy_TK, num_rows)
    buf.index_copy_(0, index, x_TH.unsqueeze(1).expand(T, K, H).reshape(T * K, H))
    out = buf[:num_rows] if out is None else out.copy_(buf[:num_rows])
    if fp8_out is not None:
        quantize_rows_torch(out, *fp8_out)
    return out


def permute_triton(x_TH: torch.Tensor, row_of_copy_TK: torch.Tensor, num_rows: int,
                   all_rows_mapped: bool = False, out: Optional[torch.Tensor] = None, *,
                   zero_below: Optional[torch.Tensor] = None, fp8_out: Optional[Fp8Out] = None,
                   block_h: Optional[int] = None) -> torch.Tensor:
    """Triton `permute`: one program per token; its row read once, written to its K rows BLOCK_H at a time."""
    require_triton("the *_triton permute kernels")
    check_2d("x_TH", x_TH)
    _check_copies(row_of_copy_TK, x_TH.shape[0])
    _check_out(out, num_rows, x_TH)
    _check_fp8_out(fp8_out, num_rows, x_TH.shape[1], all_rows_mapped)
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
    q, scale = (out, out) if fp8_out is None else fp8_out
    _scatter_rows[(T,), x.device](x, rows, x, out, x, x, q, scale, x.stride(0), out.stride(0), 0, q.stride(0), H, K,
                                  num_rows, HAS_PROBS=False, DOT=False, QUANT=fp8_out is not None, K_PAD=k_pad,
                                  BLOCK_H=bh, num_warps=warps)
    return out


def permute(x_TH: torch.Tensor, row_of_copy_TK: torch.Tensor, num_rows: int,
            all_rows_mapped: bool = False, out: Optional[torch.Tensor] = None, *,
            zero_below: Optional[torch.Tensor] = None, fp8_out: Optional[Fp8Out] = None) -> torch.Tensor:
    """x_RH (num_rows, H): row row_of_copy_TK[t, k] = x_TH[t]; rows no copy maps to are zero (unless
    all_rows_mapped; only those below ``zero_below``, when given); -1 copies are skipped. num_rows comes from the
    caller (no host sync here). ``out``: written into (and returned) instead of a new tensor, e.g. the first H
    columns of a wider buffer (rows may be strided). ``fp8_out`` (q (num_rows, H) E4M3, scales (num_rows,) fp32;
    every row mapped): the rows also as kernels/fp8_quant.quantize_rows makes them, bit for bit, in the same pass."""
    if use_triton(x_TH, "permute"):
        return permute_triton(x_TH, row_of_copy_TK, num_rows, all_rows_mapped, out, zero_below=zero_below,
                              fp8_out=fp8_out)
    return permute_torch(x_TH, row_of_copy_TK, num_rows, all_rows_mapped, out, zero_below=zero_below,
                         fp8_out=fp8_out)


def permute_backward_torch(grad_RH: torch.Tensor, row_of_copy_TK: torch.Tensor) -> torch.Tensor:
    """Twin of `permute_backward`: gather the copies' rows, fp32 sum over k."""
    check_2d("grad_RH", grad_RH)
    _check_copies(row_of_copy_TK, row_of_copy_TK.shape[0])
    g, _ = _gather_copies(grad_RH, row_of_copy_TK)
    return g.sum(1).to(grad_RH.dtype)


def _launch_gather_sum(src_RH: torch.Tensor, row_of_copy_TK: torch.Tensor, probs_TK: Optional[torch.Tensor],
                       block_h: Optional[int], copy_out: Optional[torch.Tensor] = None, *,
                       num_warps: int = 4, out: Optional[torch.Tensor] = None,
                       sparse_from: Optional[int] = None) -> torch.Tensor:
    """out[t] = sum_k (probs[t, k] *) src[row of (t, k)]: the one kernel behind permute_backward and unpermute.
    ``sparse_from``: the columns from it on are rarely valid (read only for a token with one valid there)."""
    T, K = row_of_copy_TK.shape
    R, H = src_RH.shape
    if T == 0 or H == 0 or K == 0 or R == 0:
        return src_RH.new_zeros((T, H)) if out is None else out.zero_()
    out = src_RH.new_empty((T, H)) if out is None else out
    src = _rows_2d(src_RH)
    probs = src if probs_TK is None else probs_TK.contiguous()  # an unused pointer without probs
    copy = src if copy_out is None else copy_out
    bh = min(_next_pow2(H), 1024) if block_h is None else _power_of_two("block_h", block_h)
    split = K if sparse_from is None else min(max(sparse_from, 0), K)
    _gather_sum[(T,), src.device](src, row_of_copy_TK.contiguous(), probs, out, copy, src.stride(0), out.stride(0),
                                  copy.stride(0), H, K, R, split, HAS_PROBS=probs_TK is not None,
                                  COPY=copy_out is not None, K_PAD=max(2, _next_pow2(K)),
                                  EARLY_PAD=_next_pow2(split) if split else 0,
                                  LATE_PAD=_next_pow2(K - split) if K > split else 0, BLOCK_H=max(16, bh),
                                  num_warps=num_warps)
    return out


def permute_backward_triton(grad_RH: torch.Tensor, row_of_copy_TK: torch.Tensor, *,
                            block_h: Optional[int] = None, out: Optional[torch.Tensor] = None,
                            sparse_from: Optional[int] = None) -> torch.Tensor:
    """Triton `permute_backward`: one program per token, its K rows summed in fp32 BLOCK_H at a time."""
    require_triton("the *_triton permute kernels")
    check_2d("grad_RH", grad_RH)
    _check_copies(row_of_copy_TK, row_of_copy_TK.shape[0])
    return _launch_gather_sum(grad_RH, row_of_copy_TK, None, block_h, out=out, sparse_from=sparse_from)


def permute_backward(grad_RH: torch.Tensor, row_of_copy_TK: torch.Tensor,
                     out: Optional[torch.Tensor] = None, sparse_from: Optional[int] = None) -> torch.Tensor:
    """grad_TH[t] = sum_k grad_RH[row_of_copy_TK[t, k]] (fp32 accumulation, grad's dtype); -1 copies add nothing.
    ``out``: a (T, H) tensor with contiguous rows to write into (the first columns of wider rows: no copy after).
    ``sparse_from``: the columns from it on are rarely valid (the kernel reads them only for a token with one
    valid there; the overflow chunk's rows of a wire-row plan)."""
    T, H = row_of_copy_TK.shape[0], grad_RH.shape[1]
    if out is not None and (out.shape != (T, H) or out.dtype != grad_RH.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be a ({T}, {H}) {grad_RH.dtype} tensor with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if use_triton(grad_RH, "permute"):
        return permute_backward_triton(grad_RH, row_of_copy_TK, out=out, sparse_from=sparse_from)
    grad_TH = permute_backward_torch(grad_RH, row_of_copy_TK)
    return grad_TH if out is None else out.copy_(grad_TH)


# ----------------------------------------------------------------------------------------------------------
# Unpermute
# ----------------------------------------------------------------------------------------------------------

def _check_unpermute(y_RH, row_of_copy_TK, probs_TK, copy_out) -> None:
    check_2d("y_RH", y_RH)
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
    require_triton("the *_triton permute kernels")
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
    check_2d("grad_out_TH", grad_out_TH)
    _check_copies(row_of_copy_TK, grad_out_TH.shape[0])
    _check_probs(probs_TK, row_of_copy_TK)
    if y_RH is not None:
        check_2d("y_RH", y_RH)
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
                             num_rows: Optional[int] = None, zero_below: Optional[torch.Tensor] = None,
                             fp8_out: Optional[Fp8Out] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Twin of `unpermute_backward` (every unmapped row zero, also past ``zero_below``; ``fp8_out`` quantized from
    grad_y)."""
    num_rows = _unpermute_backward_args(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, num_rows)
    _check_fp8_out(fp8_out, num_rows, grad_out_TH.shape[1], all_rows_mapped)
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
    if fp8_out is not None:
        quantize_rows_torch(buf[:num_rows], *fp8_out)
    return buf[:num_rows], grad_probs


def unpermute_backward_triton(grad_out_TH: torch.Tensor, y_RH: Optional[torch.Tensor],
                              row_of_copy_TK: torch.Tensor, probs_TK: torch.Tensor, all_rows_mapped: bool = False,
                              *, num_rows: Optional[int] = None, zero_below: Optional[torch.Tensor] = None,
                              fp8_out: Optional[Fp8Out] = None, block_h: Optional[int] = None
                              ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Triton `unpermute_backward`: one program per token reads grad_out[t] once, writes probs * grad_out to its
    K rows and (with y_RH) accumulates the K dot products in fp32, BLOCK_H at a time."""
    require_triton("the *_triton permute kernels")
    num_rows = _unpermute_backward_args(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, num_rows)
    _check_fp8_out(fp8_out, num_rows, grad_out_TH.shape[1], all_rows_mapped)
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
    q, scale = (g, g) if fp8_out is None else fp8_out
    _scatter_rows[(T,), g.device](g, rows, probs, grad_y, y, g if dot is None else dot, q, scale,
                                  g.stride(0), grad_y.stride(0), y.stride(0), q.stride(0), H, K, num_rows,
                                  HAS_PROBS=True, DOT=dot is not None, QUANT=fp8_out is not None, K_PAD=k_pad,
                                  BLOCK_H=bh, num_warps=warps)
    return grad_y, dot


def unpermute_backward(grad_out_TH: torch.Tensor, y_RH: Optional[torch.Tensor], row_of_copy_TK: torch.Tensor,
                       probs_TK: torch.Tensor, all_rows_mapped: bool = False, *,
                       num_rows: Optional[int] = None, zero_below: Optional[torch.Tensor] = None,
                       fp8_out: Optional[Fp8Out] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(grad_y_RH, grad_probs_TK) of `unpermute`.

    grad_y_RH[row_of_copy_TK[t, k]] = probs_TK[t, k] * grad_out_TH[t] (grad_out's dtype); rows no copy maps to
    are zero unless all_rows_mapped (only those below ``zero_below``, when given). grad_probs_TK[t, k] =
    <y_RH[row], grad_out_TH[t]> in fp32, 0 for -1 copies; computed only when y_RH is given (pass y_RH=None and
    num_rows when probs need no gradient). ``fp8_out``: grad_y's rows also as quantize_rows makes them (as
    :func:`permute`'s).
    """
    if use_triton(grad_out_TH, "permute"):
        return unpermute_backward_triton(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, all_rows_mapped,
                                         num_rows=num_rows, zero_below=zero_below, fp8_out=fp8_out)
    return unpermute_backward_torch(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, all_rows_mapped,
                                    num_rows=num_rows, zero_below=zero_below, fp8_out=fp8_out)


# ----------------------------------------------------------------------------------------------------------
# Autograd Functions
# ----------------------------------------------------------------------------------------------------------

class Fp8Handoff:
    """The rows Permute and Unpermute write, also in FP8 for the rowwise FP8 GEMM that reads them next (the
    experts' fc1 forward, fc2's input gradient: layers/experts.py), quantized in the same pass (``fp8_out``) instead
    of a second pass over every row. ``forward``: the permuted rows' (q, scales), left by Permute's forward;
    ``backward``: (grad_y, q, scales), left by Unpermute's backward. Each is taken once."""

    def __init__(self, forward: bool, backward: bool):
        self.wants_forward, self.wants_backward = forward, backward
        self.forward: Optional[Fp8Out] = None
        self.backward: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def take_forward(self) -> Optional[Fp8Out]:
        rows, self.forward = self.forward, None
        return rows

    def take_backward(self, grad_y_RH: torch.Tensor) -> Optional[Fp8Out]:
        """The FP8 rows of ``grad_y_RH``, if Unpermute left them for this very tensor (autograd passed it on as
        it was made: not summed with another gradient, not cast)."""
        rows, self.backward = self.backward, None
        return rows[1:] if rows is not None and rows[0] is grad_y_RH else None


class Permute(torch.autograd.Function):
    """x_RH = permute(x_TH, row_of_copy_TK, num_rows); backward = permute_backward.
    apply(x_TH, row_of_copy_TK, num_rows, all_rows_mapped=False, fp8=None) (positional); ``fp8`` (every row
    mapped): a :class:`Fp8Handoff` that wants the rows in FP8 too."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, row_of_copy_TK: torch.Tensor, num_rows: int,
                all_rows_mapped: bool = False, fp8: Optional[Fp8Handoff] = None) -> torch.Tensor:
        ctx.save_for_backward(row_of_copy_TK)
        ctx.x_dtype = x_TH.dtype
        fp8_out = fp8_buffers(num_rows, x_TH.shape[1], x_TH.device) if fp8 is not None and fp8.wants_forward else None
        out = permute(x_TH, row_of_copy_TK, num_rows, all_rows_mapped, fp8_out=fp8_out)
        if fp8_out is not None:
            fp8.forward = fp8_out
        return out

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):
        (row_of_copy_TK,) = ctx.saved_tensors
        grad_TH = permute_backward(grad_RH, row_of_copy_TK)
        return grad_TH.to(ctx.x_dtype), None, None, None, None


class Unpermute(torch.autograd.Function):
    """out_TH = unpermute(y_RH, row_of_copy_TK, probs_TK); backward = unpermute_backward.
    apply(y_RH, row_of_copy_TK, probs_TK, all_rows_mapped=False, fp8=None) (positional); all_rows_mapped skips
    zeroing the unmapped rows of grad_y; ``fp8`` (every row mapped): a :class:`Fp8Handoff` that wants grad_y in FP8
    too. y_RH is saved only when probs_TK needs a gradient."""

    @staticmethod
    def forward(ctx, y_RH: torch.Tensor, row_of_copy_TK: torch.Tensor, probs_TK: torch.Tensor,
                all_rows_mapped: bool = False, fp8: Optional[Fp8Handoff] = None) -> torch.Tensor:
        need_probs_grad = ctx.needs_input_grad[2]
        ctx.save_for_backward(y_RH if need_probs_grad else None, row_of_copy_TK, probs_TK)
        ctx.num_rows = y_RH.shape[0]
        ctx.y_dtype = y_RH.dtype
        ctx.all_rows_mapped = all_rows_mapped
        ctx.fp8 = fp8 if fp8 is not None and fp8.wants_backward else None
        return unpermute(y_RH, row_of_copy_TK, probs_TK)

    @staticmethod
    def backward(ctx, grad_out_TH: torch.Tensor):
        y_RH, row_of_copy_TK, probs_TK = ctx.saved_tensors
        handoff = ctx.fp8 if ctx.needs_input_grad[0] and grad_out_TH.dtype == ctx.y_dtype else None
        fp8_out = None if handoff is None else fp8_buffers(ctx.num_rows, grad_out_TH.shape[1], grad_out_TH.device)
        grad_y, grad_probs = unpermute_backward(grad_out_TH, y_RH, row_of_copy_TK, probs_TK, ctx.all_rows_mapped,
                                                num_rows=ctx.num_rows, fp8_out=fp8_out)
        if not ctx.needs_input_grad[0]:
            grad_y = None
        elif grad_y.dtype != ctx.y_dtype:
            grad_y = grad_y.to(ctx.y_dtype)
        if fp8_out is not None:
            handoff.backward = (grad_y, *fp8_out)
        if grad_probs is not None:
            grad_probs = grad_probs.to(probs_TK.dtype)
        return grad_y, None, grad_probs, None, None
