"""FP8 (E4M3) quantization with one float32 scale per row or per column, for torch's rowwise-scaled GEMMs.

A row's scale is amax / 448 (E4M3's largest finite value; amax clamped to >= 1e-12, so a row of zeros gets a
tiny scale and quantizes to zeros): the row divided by it fits E4M3 exactly at its largest element. The
division is a multiplication by 448 / amax (one correctly rounded division per row), then a clamp to
[-448, 448] (saturation) and the cast, which rounds to nearest even. Dequantized: q * scale.

- :func:`quantize_rows`: per row of the last dimension (2D (M, K) -> scales (M,); 3D (E, M, K) -> (E, M)):
  activations, and a weight whose last dimension is the GEMM's contraction.
- :func:`dequantize_rows`: back, per row, into bf16 / fp32 in one pass (the FP8 dispatch's receiver, and the
  weight gradient of rows the dispatch fed straight to an FP8 GEMM).
- :func:`quantize_columns`: per column, written transposed (2D (M, K) -> q (K, M), scales (K,); 3D per matrix):
  the column-major right operand a scaled GEMM wants when the contraction runs down the columns, in one pass
  (quantize-then-transpose would be a second pass over the FP8 copy).
- :func:`quantize_rows_and_columns`: both, bit for bit, from two reads of x instead of four: a weight's two
  copies (the forward's and the dgrad's), refreshed together once per optimizer step (layers/fp8.py).
- :func:`row_amax`, :func:`column_amax`, and :func:`quantize_rows` / :func:`quantize_columns` from a given
  ``amax``: the two passes apart, for scales shared over the ranks that each hold part of the rows or columns (tensor
  and expert-TP's split contractions: layers/fp8.py); :func:`amax_along` is the maxima's twin.
Both read any float dtype (the cast to FP8 is the only cast: bf16 or fp32 in, FP8 out; but with ``as_dtype``, the
weight quantizers' and maxima's keyword, x's values are first rounded to bf16 / fp16 in registers, bit for bit as
``x.to(as_dtype)``: an fp32 master weight quantized as its model copy would be, with no copy made) and can write into
given buffers (a weight's cached FP8 copy refreshed in place: layers/fp8.py). ``rows_bound`` (a device int tensor of
one element) skips the rows from it on, as the expert GEMMs do (a static worst-case buffer's unused tail).

The torch twins are the reference (CPU, tests); the Triton kernels run on CUDA.
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, max_combine, strided_programs, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-12

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe_overlap.kernels.launch import DeviceFunction

    _MAX = TL_FP8_MAX = tl.constexpr(FP8_MAX)  # the kernels' constants (kernels/fp8_blockwise.py's too)
    _FLOOR = TL_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)

    def _as_stored(x, ROUND: tl.constexpr):
        """x (fp32) as the kernels' ROUND says: 0 as it is; 1 its values rounded to bf16, 2 to fp16, back in fp32
        (:func:`round_mode`), bit for bit as x.to(bf16 / fp16) holds them. bf16's round to nearest even is done in
        integers (the interpreter's fp32 -> bf16 cast truncates; a NaN stays a NaN), fp16's by the cast."""
        if ROUND == 1:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + (bits >> 16 & 1)) >> 16 << 16
            x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
        elif ROUND == 2:
            x = x.to(tl.float16).to(tl.float32)
        return x

    as_stored = DeviceFunction(_as_stored)  # kernels/fp8_blockwise.py's too

    def _tile_maxima(x, amax_rows_ptr, amax_cols_ptr, rm, rk, in_m, in_k, ROUND: tl.constexpr):
        """A tile x (rows rm, columns rk of a matrix; fp32, read as ROUND stores it) into its matrix's row and column
        maxima (buffers of zeros at first) by atomic maxima: a maximum is exact in any order, so any tiling gives
        the one-program kernels' amax bit for bit (quantize_rows_and_columns' first pass)."""
        x_abs = tl.abs(as_stored(x, ROUND))
        tl.atomic_max(amax_rows_ptr + rm, tl.reduce(x_abs, 1, max_combine), mask=in_m, sem="relaxed")
        tl.atomic_max(amax_cols_ptr + rk, tl.reduce(x_abs, 0, max_combine), mask=in_k, sem="relaxed")

    tile_maxima = DeviceFunction(_tile_maxima)

    # A row per step, read twice (its amax, then the quantized values), the second time from L2. Programs stride
    # over the rows below the bound (n_rows, or the device count at bound_ptr): unbounded one program a row; bounded
    # a few programs an SM (:func:`_row_programs`), so a static worst-case buffer's unused tail launches nothing (one
    # program per buffer row: 0.38 ms for 65,536 rows of a 262,144-row buffer, H200, where the rows take 0.1; the
    # SwiGLU kernels' measurement too). AMAX: 0 the row's own; 1 the row's amax stored in amax_ptr and nothing else
    # (ranks that each hold part of the row share it: layers/fp8.py); 2 the amax read from amax_ptr (one pass).
    # ROUND (here and in the column, rows-and-columns and blocks kernels, at every load of x): :func:`_as_stored`'s.
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, amax_ptr, bound_ptr, n_rows, K, stride_x, stride_q,
                              stride_scale, HAS_BOUND: tl.constexpr, AMAX: tl.constexpr, ROUND: tl.constexpr,
                              BLOCK: tl.constexpr):
        limit = n_rows
        if HAS_BOUND:
            limit = tl.minimum(tl.load(bound_ptr), n_rows)
        cols = tl.arange(0, BLOCK)
        for row in range(tl.program_id(0).to(tl.int64), limit, tl.num_programs(0)):
            if AMAX == 2:
                amax = tl.load(amax_ptr + row)
            else:
                amax_B = tl.full((BLOCK,), 0.0, tl.float32)
                for start in range(0, K, BLOCK):
                    mask = start + cols < K
                    x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
                    x = as_stored(x, ROUND)
                    amax_B = tl.maximum(amax_B, tl.abs(x))
                amax = tl.reduce(amax_B, 0, max_combine)
            if AMAX == 1:
                tl.store(amax_ptr + row, amax)
            else:
                amax = tl.maximum(amax, _FLOOR)
                tl.store(scale_ptr + row * stride_scale, tl.math.div_rn(amax, _MAX))
                inverse = tl.math.div_rn(_MAX, amax)
                for start in range(0, K, BLOCK):
                    mask = start + cols < K
                    x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
                    x = as_stored(x, ROUND)
                    q = tl.minimum(tl.maximum(x * inverse, -_MAX), _MAX)
                    tl.store(q_ptr + row * stride_q + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)

    # q * scale in fp32, rounded once to the output's dtype, a block of rows per step; programs stride over the
    # blocks below the bound as the row kernel's. Rows at or past the bound are left unwritten.
    def _dequantize_rows_kernel(q_ptr, scale_ptr, out_ptr, bound_ptr, n_rows, K, stride_q, stride_scale, stride_out,
                                HAS_BOUND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        limit = n_rows
        if HAS_BOUND:
            limit = tl.minimum(tl.load(bound_ptr), n_rows)
        cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        for first in range(tl.program_id(0).to(tl.int64) * BLOCK_R, limit, tl.num_programs(0) * BLOCK_R):
            rows = first + tl.arange(0, BLOCK_R)
            live = rows < limit
            scale = tl.load(scale_ptr + rows * stride_scale, mask=live, other=0.0)
            for start in range(0, K, BLOCK_K):
                mask = live[:, None] & (start + cols < K)[None, :]
                q = tl.load(q_ptr + rows[:, None] * stride_q + start + cols[None, :], mask=mask, other=0.0)
                v = q.to(tl.float32) * scale[:, None]
                tl.store(out_ptr + rows[:, None] * stride_out + start + cols[None, :], v.to(out_ptr.dtype.element_ty),
                         mask=mask)

    # One program per (block of columns, matrix): the columns' amax down all M rows, then each (BLOCK_M, BLOCK_K)
    # tile quantized and stored transposed into q (K, M). AMAX as the row kernel's: 0 own, 1 the amax stored alone
    # (in amax_ptr, (matrices, K)), 2 read from amax_ptr. ROUND as the row kernel's.
    def _quantize_columns_kernel(x_ptr, q_ptr, scale_ptr, amax_ptr, M, K, stride_xb, stride_xm, AMAX: tl.constexpr,
                                 ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        matrix = tl.program_id(1).to(tl.int64)
        rk = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        rm = tl.arange(0, BLOCK_M)
        x_base = x_ptr + matrix * stride_xb
        if AMAX == 2:
            amax = tl.load(amax_ptr + matrix * K + rk, mask=rk < K, other=0.0)
        else:
            amax = tl.full((BLOCK_K,), 0.0, tl.float32)
            for start in range(0, M, BLOCK_M):
                mask = ((start + rm)[:, None] < M) & (rk[None, :] < K)
                x = tl.load(x_base + (start + rm)[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                x = as_stored(x, ROUND)
                amax = tl.maximum(amax, tl.reduce(tl.abs(x), 0, max_combine))
        if AMAX == 1:
            tl.store(amax_ptr + matrix * K + rk, amax, mask=rk < K)
        else:
            amax = tl.maximum(amax, _FLOOR)
            fp8_max = tl.full((BLOCK_K,), _MAX, tl.float32)
            tl.store(scale_ptr + matrix * K + rk, tl.math.div_rn(amax, fp8_max), mask=rk < K)
            inverse = tl.math.div_rn(fp8_max, amax)
            q_base = q_ptr + matrix * M * K
            for start in range(0, M, BLOCK_M):
                mask = ((start + rm)[:, None] < M) & (rk[None, :] < K)
                x = tl.load(x_base + (start + rm)[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                x = as_stored(x, ROUND)
                q = tl.minimum(tl.maximum(x * inverse[None, :], -_MAX), _MAX)
                tl.store(q_base + rk[None, :].to(tl.int64) * M + (start + rm)[:, None], q.to(q_ptr.dtype.element_ty),
                         mask=mask)

    # quantize_rows_and_columns, pass 1: one program per (BLOCK_M, BLOCK_K) tile of a matrix (the tile index runs
    # along K first): the tile's row and column maxima, combined over the tiles by atomic maxima into buffers of
    # zeros. A maximum is exact in any order, so the amax is the one-program kernels' bit for bit. Its tiles need
    # not be pass 2's. ROUND (both passes) as the row kernel's.
    def _rows_and_columns_amax_kernel(x_ptr, amax_rows_ptr, amax_cols_ptr, M, K, stride_xb, stride_xm,
                                      ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        matrix = tl.program_id(1).to(tl.int64)
        tiles_k = (K + BLOCK_K - 1) // BLOCK_K
        rm = (tl.program_id(0) // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = (tl.program_id(0) % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
        in_m, in_k = rm < M, rk < K
        x = tl.load(x_ptr + matrix * stride_xb + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=in_m[:, None] & in_k[None, :], other=0.0).to(tl.float32)
        tile_maxima(x, amax_rows_ptr + matrix * M, amax_cols_ptr + matrix * K, rm, rk, in_m, in_k, ROUND)

    # Pass 2, one program per tile: the tile quantized twice, by its rows' scales into q_rows (M, K) and by its
    # columns' into q_cols (K, M), stored transposed. The first tile of a row (of a column) writes its scale.
    def _rows_and_columns_quantize_kernel(x_ptr, q_rows_ptr, scale_rows_ptr, q_cols_ptr, scale_cols_ptr,
                                          amax_rows_ptr, amax_cols_ptr, M, K, stride_xb, stride_xm,
                                          ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        matrix = tl.program_id(1).to(tl.int64)
        tiles_k = (K + BLOCK_K - 1) // BLOCK_K
        tile_m, tile_k = tl.program_id(0) // tiles_k, tl.program_id(0) % tiles_k
        rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
        in_m, in_k = rm < M, rk < K
        mask = in_m[:, None] & in_k[None, :]
        x = tl.load(x_ptr + matrix * stride_xb + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        x = as_stored(x, ROUND)
        amax_m = tl.maximum(tl.load(amax_rows_ptr + matrix * M + rm, mask=in_m, other=0.0), _FLOOR)
        amax_k = tl.maximum(tl.load(amax_cols_ptr + matrix * K + rk, mask=in_k, other=0.0), _FLOOR)
        fp8_max_m = tl.full((BLOCK_M,), _MAX, tl.float32)
        fp8_max_k = tl.full((BLOCK_K,), _MAX, tl.float32)
        tl.store(scale_rows_ptr + matrix * M + rm, tl.math.div_rn(amax_m, fp8_max_m), mask=in_m & (tile_k == 0))
        tl.store(scale_cols_ptr + matrix * K + rk, tl.math.div_rn(amax_k, fp8_max_k), mask=in_k & (tile_m == 0))
        q_base = matrix * M * K
        q = tl.minimum(tl.maximum(x * tl.math.div_rn(fp8_max_m, amax_m)[:, None], -_MAX), _MAX)
        tl.store(q_rows_ptr + q_base + rm[:, None].to(tl.int64) * K + rk[None, :], q.to(q_rows_ptr.dtype.element_ty),
                 mask=mask)
        q = tl.minimum(tl.maximum(x * tl.math.div_rn(fp8_max_k, amax_k)[None, :], -_MAX), _MAX)
        tl.store(q_cols_ptr + q_base + rk[None, :].to(tl.int64) * M + rm[:, None], q.to(q_cols_ptr.dtype.element_ty),
                 mask=mask)

    _rows = Kernel(_quantize_rows_kernel)
    _dequantize_rows = Kernel(_dequantize_rows_kernel, do_not_specialize=["n_rows"])
    _columns = Kernel(_quantize_columns_kernel)
    _rows_and_columns_amax = Kernel(_rows_and_columns_amax_kernel)
    _rows_and_columns_quantize = Kernel(_rows_and_columns_quantize_kernel)


def fp8_outputs(q_shape: tuple[int, ...], scale_shape: tuple[int, ...], x: torch.Tensor,
                q_out: torch.Tensor | None, scale_out: torch.Tensor | None,
                strided: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs, given or new; ``strided`` (2-D rows only): q's rows and the scales may sit apart in memory (the
    packed wire rows of layers/wire_rows.py: a row's bytes, then its scale)."""
    q = q_out if q_out is not None else torch.empty(q_shape, dtype=FP8, device=x.device)
    scale = scale_out if scale_out is not None else torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    laid_out = (q.dim() == 2 and q.stride(1) == 1 and scale.dim() == 1 if strided
                else q.is_contiguous() and scale.is_contiguous())
    if q.shape != q_shape or scale.shape != scale_shape or not laid_out:
        what = "2-D rows with unit column stride and 1-D" if strided else "contiguous"
        raise ValueError(f"FP8 outputs must be {what} {q_shape} and {scale_shape}, got {tuple(q.shape)} strides "
                         f"{q.stride()} and {tuple(scale.shape)} strides {scale.stride()}")
    return q, scale


_ROUND_MODES = {torch.bfloat16: 1, torch.float16: 2}


def round_mode(x: torch.Tensor, as_dtype: torch.dtype | None) -> int:
    """The kernels' ROUND for ``as_dtype`` (x's values rounded to it first): 0 none (``None``, or x's own dtype), 1
    bf16, 2 fp16; a ValueError for any other."""
    if as_dtype is None or as_dtype == x.dtype:
        return 0
    if as_dtype not in _ROUND_MODES:
        raise ValueError(f"as_dtype must be None, x's dtype, torch.bfloat16 or torch.float16, got {as_dtype}")
    return _ROUND_MODES[as_dtype]


def rounded(x: torch.Tensor, as_dtype: torch.dtype | None) -> torch.Tensor:
    """The twins' ``as_dtype``: ``x.to(as_dtype)`` (a copy), x where ``None``."""
    return x.to(as_dtype) if round_mode(x, as_dtype) else x


def quantize_along_torch(x: torch.Tensor, dim: int,
                         amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin: (q like x, scales with ``dim`` reduced away), the kernels' arithmetic step for step; ``amax`` (``dim``
    reduced away): given instead of x's own."""
    x = x.float()  # as the kernels: a bf16 row's amax, inverse and products in fp32, not rounded to bf16
    amax = (x.abs().amax(dim, keepdim=True) if amax is None else amax.unsqueeze(dim)).clamp(min=AMAX_FLOOR)
    # Tensor by tensor, both divisions: on CUDA a Python scalar on either side of a division goes through a
    # reciprocal, one ulp off the kernels' correctly rounded division now and then (the CPU divides exactly). An
    # inverse one ulp off moves FP8 values on a rounding boundary (H100: 747 of 1M), a scale one ulp off the scales.
    fp8_max = torch.full_like(amax, FP8_MAX)
    q = (x * (fp8_max / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, (amax / fp8_max).squeeze(dim)


def quantize_rows_torch(x: torch.Tensor, q_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                        amax: torch.Tensor | None = None, *, as_dtype: torch.dtype | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = fp8_outputs(tuple(x.shape), tuple(x.shape[:-1]), x, q_out, scale_out, strided=x.dim() == 2)
    q_new, scale_new = quantize_along_torch(rounded(x, as_dtype), -1, amax)
    q.copy_(q_new)
    scale.copy_(scale_new)
    return q, scale


def quantize_columns_torch(x: torch.Tensor, q_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                           amax: torch.Tensor | None = None, *, as_dtype: torch.dtype | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = fp8_outputs((*x.shape[:-2], x.shape[-1], x.shape[-2]), (*x.shape[:-2], x.shape[-1]), x, q_out,
                        scale_out)
    q_new, scale_new = quantize_along_torch(rounded(x, as_dtype), -2, amax)
    q.copy_(q_new.transpose(-2, -1))
    scale.copy_(scale_new)
    return q, scale


_ROW_BLOCK = 1024
_COLUMN_BLOCKS = (64, 64)  # (BLOCK_M, BLOCK_K)
# Programs an SM of a row kernel bounded by a device count (each strides over the rows below it): as many as run at
# once (4 warps a quantize program, 8 a dequantize one), so a bounded launch moves as fast as one program a row.
_ROW_PROGRAMS_PER_SM = 16
_DEQUANTIZE_PROGRAMS_PER_SM = 8


def _row_programs(work: int, bounded: bool, device: torch.device, per_sm: int) -> int:
    """Programs of a row kernel over ``work`` rows (or blocks of rows): one each, or, ``bounded`` by a count on the
    device, strided (3 in the interpreter, so that its tests stride)."""
    return strided_programs(work, per_sm, device, off_gpu=3) if bounded else work


def quantize_rows(x: torch.Tensor, q_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                  rows_bound: torch.Tensor | None = None, amax: torch.Tensor | None = None, *,
                  as_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): x (..., K) quantized per row of its last dimension, q contiguous like x, scales (...) float32;
    for a 2-D x, given outputs may be strided (q's rows apart, scales at a stride). ``rows_bound``: rows from it on
    (of x viewed as (rows, K)) are left unwritten (the twin writes them). ``amax`` (float32 (...)): each row's
    absolute maximum, given (:func:`row_amax`, shared over the ranks that each hold part of the rows), not x's own:
    one pass over x. ``as_dtype`` (bf16 or fp16): bit for bit the result for ``x.to(as_dtype)``, with no copy made
    (an fp32 master weight quantized as its model copy would be; here and in the functions below)."""
    round_ = round_mode(x, as_dtype)
    if not use_triton(x, "fp8 quantize_rows"):
        return quantize_rows_torch(x, q_out, scale_out, amax, as_dtype=as_dtype)
    q, scale = fp8_outputs(tuple(x.shape), tuple(x.shape[:-1]), x, q_out, scale_out, strided=x.dim() == 2)
    if x.numel():
        _launch_rows(x, q, scale, 0 if amax is None else 2, amax, rows_bound, round_)
    return q, scale


def row_amax(x: torch.Tensor, *, as_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each row's absolute maximum of x (..., K), float32 (...): the first of :func:`quantize_rows`' passes alone,
    for scales shared over ranks that each hold part of the rows (one Triton pass; its twin in torch ops)."""
    round_ = round_mode(x, as_dtype)
    if not use_triton(x, "fp8 row_amax"):
        return amax_along(x, -1, as_dtype=as_dtype)
    amax = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if x.numel():
        _launch_rows(x, x, x, 1, amax, None, round_)
    return amax


def _launch_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mode: int, amax: torch.Tensor | None,
                 rows_bound: torch.Tensor | None, round_: int) -> None:
    """The row kernel over x's rows (AMAX ``mode``: 0 own, 1 amax only, 2 from ``amax``; ROUND ``round_``)."""
    K = x.shape[-1]
    x_rows = x.reshape(-1, K)
    if x_rows.stride(1) != 1:
        x_rows = x_rows.contiguous()
    stride_q, stride_scale = (q.stride(0), scale.stride(0)) if x.dim() == 2 and mode != 1 else (K, 1)
    block = min(_ROW_BLOCK, triton.next_power_of_2(K))
    programs = _row_programs(x_rows.shape[0], rows_bound is not None, x.device, _ROW_PROGRAMS_PER_SM)
    _rows[(programs,), x.device](x_rows, q, scale, x_rows if amax is None else amax.reshape(-1),
                                 x_rows if rows_bound is None else rows_bound, x_rows.shape[0], K, x_rows.stride(0),
                                 stride_q, stride_scale, HAS_BOUND=rows_bound is not None, AMAX=mode, ROUND=round_,
                                 BLOCK=block)


def quantize_columns(x: torch.Tensor, q_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                     amax: torch.Tensor | None = None, *, as_dtype: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): each column of x (..., M, K) quantized, q (..., K, M) contiguous (x's matrices transposed),
    scales (..., K) float32. ``amax`` (float32 (..., K)): each column's absolute maximum, given
    (:func:`column_amax`, shared over ranks), not x's own. ``as_dtype``: as :func:`quantize_rows`'."""
    round_ = round_mode(x, as_dtype)
    if not use_triton(x, "fp8 quantize_columns"):
        return quantize_columns_torch(x, q_out, scale_out, amax, as_dtype=as_dtype)
    M, K = x.shape[-2:]
    q, scale = fp8_outputs((*x.shape[:-2], K, M), (*x.shape[:-2], K), x, q_out, scale_out)
    if x.numel():
        _launch_columns(x, q, scale, 0 if amax is None else 2, amax, round_)
    return q, scale


def column_amax(x: torch.Tensor, *, as_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each column's absolute maximum of x (..., M, K), float32 (..., K): :func:`quantize_columns`' first pass
    alone (as :func:`row_amax`)."""
    round_ = round_mode(x, as_dtype)
    if not use_triton(x, "fp8 column_amax"):
        return amax_along(x, -2, as_dtype=as_dtype)
    amax = torch.empty((*x.shape[:-2], x.shape[-1]), dtype=torch.float32, device=x.device)
    if x.numel():
        _launch_columns(x, x, x, 1, amax, round_)
    return amax


def _launch_columns(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mode: int,
                    amax: torch.Tensor | None, round_: int) -> None:
    """The column kernel over x's matrices (AMAX ``mode``: 0 own, 1 amax only, 2 from ``amax``; ROUND ``round_``)."""
    M, K = x.shape[-2:]
    x_BMK = x.reshape(-1, M, K)
    if x_BMK.stride(2) != 1:
        x_BMK = x_BMK.contiguous()
    block_m, block_k = _COLUMN_BLOCKS
    _columns[(triton.cdiv(K, block_k), x_BMK.shape[0]), x.device](
        x_BMK, q, scale, x_BMK if amax is None else amax.reshape(-1), M, K, x_BMK.stride(0), x_BMK.stride(1),
        AMAX=mode, ROUND=round_, BLOCK_M=block_m, BLOCK_K=block_k)


# (BLOCK_M, BLOCK_K) of the two passes, from a sweep by hand on an H100 at (8, 4096, 28672) bf16 (2026-11-28): the
# maxima's pass 0.76 ms at 128 x 128 (0.92 at 64 x 64, slower at 256 wide or with 8 warps), the quantize pass at
# 64 x 64 (larger tiles were slower); both 2.10 ms against 3.36 for quantize_rows then quantize_columns
# (step_kernels_fp8_fuse_1xh100.json) and 0.66 for a copy of the FP8 bytes.
_AMAX_BLOCKS, _QUANTIZE_BLOCKS = (128, 128), (64, 64)


def quantize_rows_and_columns(x: torch.Tensor, rows_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                              columns_out: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                              as_dtype: torch.dtype | None = None,
                              amax: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(:func:`quantize_rows` (x), :func:`quantize_columns` (x)) bit for bit, x (..., M, K), in two passes over x
    (the maxima of each tile's rows and columns, then both quantized copies of the tile) where the two functions
    make four: a weight's two rowwise copies, refreshed together once per optimizer step. ``rows_out``,
    ``columns_out``: the (q, scales) to write into, contiguous. ``as_dtype``: as :func:`quantize_rows`'. ``amax``
    ((..., M), (..., K) float32): the rows' and columns' maxima, given (the optimizer's step made them:
    kernels/adamw.py): the second pass alone."""
    round_ = round_mode(x, as_dtype)
    if not use_triton(x, "fp8 quantize_rows_and_columns"):
        x = rounded(x, as_dtype)  # one copy for both twins
        rows_amax, columns_amax = (None, None) if amax is None else amax
        return (quantize_rows_torch(x, *(rows_out or (None, None)), amax=rows_amax),
                quantize_columns_torch(x, *(columns_out or (None, None)), amax=columns_amax))
    *batch, M, K = x.shape
    q_rows, scale_rows = fp8_outputs(tuple(x.shape), (*batch, M), x, *(rows_out or (None, None)))
    q_cols, scale_cols = fp8_outputs((*batch, K, M), (*batch, K), x, *(columns_out or (None, None)))
    if x.numel() == 0:
        return (q_rows, scale_rows), (q_cols, scale_cols)
    x_BMK = x.reshape(-1, M, K)
    if x_BMK.stride(2) != 1:
        x_BMK = x_BMK.contiguous()
    B = x_BMK.shape[0]
    if amax is None:
        both = torch.zeros(B * (M + K), dtype=torch.float32, device=x.device)  # one memset for both
        amax_BM, amax_BK = both[:B * M], both[B * M:]
        block_m, block_k = _AMAX_BLOCKS
        _rows_and_columns_amax[(triton.cdiv(M, block_m) * triton.cdiv(K, block_k), B), x.device](
            x_BMK, amax_BM, amax_BK, M, K, x_BMK.stride(0), x_BMK.stride(1), ROUND=round_, BLOCK_M=block_m,
            BLOCK_K=block_k)
    else:
        amax_BM, amax_BK = (a.reshape(-1) for a in amax)
    block_m, block_k = _QUANTIZE_BLOCKS
    _rows_and_columns_quantize[(triton.cdiv(M, block_m) * triton.cdiv(K, block_k), B), x.device](
        x_BMK, q_rows, scale_rows, q_cols, scale_cols, amax_BM, amax_BK, M, K, x_BMK.stride(0), x_BMK.stride(1),
        ROUND=round_, BLOCK_M=block_m, BLOCK_K=block_k)
    return (q_rows, scale_rows), (q_cols, scale_cols)


def amax_along(x: torch.Tensor, dim: int, *, as_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The fp32 absolute maximum of x along ``dim`` (reduced away): what a scale is made from, where ranks that
    each hold part of that dimension share their maximum first (layers/fp8.py, tensor parallelism). ``as_dtype``:
    of ``x.to(as_dtype)``."""
    return rounded(x.detach(), as_dtype).float().abs().amax(dim)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """fp32 values of ``q`` whose scales run along ``dim`` reduced away (-1: per row, -2: per column)."""
    return q.float() * scale.unsqueeze(dim)


def dequantize_rows(q_RK: torch.Tensor, scale_R: torch.Tensor, dtype: torch.dtype,
                    rows_bound: torch.Tensor | None = None) -> torch.Tensor:
    """(R, K) of ``dtype``: q_RK's rows times their scales in fp32, rounded once (as :func:`dequantize` then a
    cast); q's rows and the scales may be strided (read straight from packed wire rows). One pass in Triton.
    ``rows_bound`` (a device int tensor of one element): the rows from it on are left unwritten (the twin writes
    them)."""
    if q_RK.dim() != 2 or q_RK.stride(1) != 1 or scale_R.shape != q_RK.shape[:1]:
        raise ValueError(f"q_RK must be 2-D with unit column stride and scale_R one scale per row, got "
                         f"{tuple(q_RK.shape)} strides {q_RK.stride()} and {tuple(scale_R.shape)}")
    if not use_triton(q_RK, "fp8 dequantize_rows"):
        return dequantize(q_RK, scale_R).to(dtype)
    R, K = q_RK.shape
    out_RK = torch.empty((R, K), dtype=dtype, device=q_RK.device)
    if out_RK.numel():
        block_k = min(1024, triton.next_power_of_2(K))
        block_r = max(1, 8192 // block_k)
        programs = _row_programs(triton.cdiv(R, block_r), rows_bound is not None, q_RK.device,
                                 _DEQUANTIZE_PROGRAMS_PER_SM)
        _dequantize_rows[(programs,), q_RK.device](
            q_RK, scale_R, out_RK, q_RK if rows_bound is None else rows_bound, R, K, q_RK.stride(0),
            scale_R.stride(0), out_RK.stride(0), HAS_BOUND=rows_bound is not None, BLOCK_R=block_r, BLOCK_K=block_k,
            num_warps=8)
    return out_RK
