"""FP8 (E4M3) of the blockwise recipe (``train.fp8_recipe=blockwise``; DeepSeek-V3's, Transformer Engine's on
Hopper): activations with one float32 scale per 1x128 tile of a row, weights one per 128x128 block; a GEMM sums
each 128-deep slice of the contraction in fp32 and multiplies it by its two scales before adding it up.

A tile's or block's scale is made as a row's in kernels/fp8_quant.py (amax / 448, the amax clamped to >= 1e-12;
the values times 448 / amax, clamped, rounded to nearest even): a tile is a row of 128, a block 128 rows of 128
flattened. Every quantized dimension must be a multiple of 128 (the config refuses others, naming the field).

- :func:`quantize_tiles`: x (..., M, K) per 1x128 tile along K: q like x, scales (..., M, K / 128).
- :func:`quantize_blocks`: w (..., P, Q) per 128x128 block: q like w, scales (..., P / 128, Q / 128), or those
  of w^T written transposed in the same pass (a block's values and scale do not depend on the orientation).
  Weights, once per optimizer step; ``as_dtype``: an fp32 master's values rounded to bf16 / fp16 first, in registers
  (kernels/fp8_quant.py's).
- :func:`blockwise_mm`: ``a @ w^T`` (``contract_last``) or ``a @ w`` per group of rows (int32 end offsets, w
  (E, P, Q)), or dense (no offsets, w (P, Q)).

Its Triton kernel (:func:`blockwise_mm_triton`; CUDA, or TRITON_INTERPRET=1): one program per BLOCK_M rows of
one group by 128 output columns, on a static grid (cdiv(M, BLOCK_M) + E row tiles; each program finds its group by
walking the end offsets on the device, so it replays in CUDA graphs). The operands come through TMA descriptors
(the rows through a ragged one: rows past a group's end read as zeros, and are never written), so the loop over
the 128-deep slices is pipelined. Per slice, one tl.dot of the FP8 tiles into a fresh fp32 accumulator, times
the rows' tile scales and the weight block's scale, added to the fp32 sum (DeepGEMM's promotion: the tensor
cores' FP8 sum never spans more than one slice). The weight is read in either orientation; FP8 wgmma reads only
K-major operands from shared memory, so with ``contract_last=False`` each weight tile is transposed on chip (the
layers pass a copy laid out along the contraction and ``contract_last=True`` instead).

The quantize kernels run on CUDA (and under TRITON_INTERPRET=1), with the twins' arithmetic. The torch twins of the
GEMM dequantize and multiply in fp32: they are the recipe's emulated path too (layers/fp8.py).
"""

from __future__ import annotations

import functools

import torch

from moe_overlap.kernels.fp8_quant import FP8, fp8_outputs, quantize_along_torch, round_mode, rounded
from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, interpreter_requested, max_combine, use_triton

BLOCK = 128

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from triton.tools.ragged_tma import create_ragged_descriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moe_overlap.kernels.fp8_quant import TL_AMAX_FLOOR as _FLOOR, TL_FP8_MAX as _MAX, as_stored
    from moe_overlap.kernels.launch import DeviceFunction, tile_in_groups

    # Ragged TMA (triton.tools.ragged_tma's scheme): a descriptor over rows (R, C) gets two leading dimensions whose
    # strides wrap around 2**64, so that loading or storing at (BILLION, first + rows, BILLION - rows + row, col)
    # addresses row first + row, and the hardware's bounds check on the third dimension stops at the group's end:
    # rows past it read as zeros and are never written. Written here as device functions the interpreter can call.
    _BILLION = tl.constexpr(2 ** 30)

    def _load_rows(desc, first, rows, row, col):
        """The (BLOCK_M, C) tile at row ``row`` of the group of ``rows`` rows from ``first``, column ``col``."""
        tile = desc.load([_BILLION, first + rows, _BILLION - rows + row, col])
        return tile.reshape(tile.shape[2], tile.shape[3])

    def _store_rows(desc, first, rows, row, col, tile):
        desc.store([_BILLION, first + rows, _BILLION - rows + row, col],
                   tile.reshape(1, 1, tile.shape[0], tile.shape[1]))

    load_rows, store_rows = DeviceFunction(_load_rows), DeviceFunction(_store_rows)

    def _expert_tile(offsets_ptr, M, N, E, tiles_m, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """This program's (group, the group's first row, its end row, the tile's first row within the group, its
        column tile) on a static grid of ``tiles_m`` row tiles by cdiv(N, BLOCK_N) column tiles; group -1: a tile
        past the last group's (dead). Programs run in groups of GROUP_M row tiles, so that neighbouring programs
        share the weight's column tiles in L2. Dense (not GROUPED): one group of M rows."""
        tile, pid_n = tile_in_groups(tl.program_id(0), tiles_m, (N + BLOCK_N - 1) // BLOCK_N, GROUP_M)
        if GROUPED:
            # Group e owns row tiles [before_e, before_e + cdiv(rows_e, BLOCK_M)), found by walking the end offsets
            # on the device (no host sync). Tiles never straddle groups.
            group = tl.full((), -1, tl.int32)
            start_row = tl.full((), 0, tl.int32)
            end_row = tl.full((), 0, tl.int32)
            local_row = tl.full((), 0, tl.int32)
            before = tl.full((), 0, tl.int32)
            start = tl.full((), 0, tl.int32)
            for e in range(0, E):
                end = tl.load(offsets_ptr + e)
                tiles_e = (end - start + BLOCK_M - 1) // BLOCK_M
                hit = (tile >= before) & (tile < before + tiles_e)
                group = tl.where(hit, e, group)
                start_row = tl.where(hit, start, start_row)
                end_row = tl.where(hit, end, end_row)
                local_row = tl.where(hit, (tile - before) * BLOCK_M, local_row)
                before += tiles_e
                start = end
        else:
            group = tl.full((), 0, tl.int32)
            start_row = tl.full((), 0, tl.int32)
            end_row = M + tl.full((), 0, tl.int32)
            local_row = tile * BLOCK_M
        return group, start_row, end_row, local_row, pid_n

    expert_tile = DeviceFunction(_expert_tile)  # benchmarks/fp8_grouped_tma.py's too

    # One program per (BLOCK_M rows of one group, 128 output columns). Per 128-deep slice of the contraction: a's
    # tile through a ragged descriptor, w's block (E, N, K) or, CONTRACT_LAST off, (E, K, N) through a 3-D one, both
    # pipelined by the TMA; the slice's product into a fresh fp32 accumulator, times the rows' tile scales and the
    # block's scale, added to the fp32 sum (DeepGEMM's promotion: the tensor cores' FP8 sum spans one slice only).
    def _blockwise_mm_kernel(a_desc, a_scale_ptr, w_desc, w_scale_ptr, offsets_ptr, out_desc, M, N, K, E, tiles_m,
                             stride_asm, stride_ask, stride_wse, stride_wsk, stride_wsn, GROUPED: tl.constexpr,
                             CONTRACT_LAST: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
                             STAGES: tl.constexpr):
        group, start_row, end_row, local_row, pid_n = expert_tile(offsets_ptr, M, N, E, tiles_m, GROUPED, BLOCK_M,
                                                                  128, GROUP_M)
        if group >= 0:
            rows = end_row - start_row
            rm = start_row + local_row + tl.arange(0, BLOCK_M)
            rows_in = rm < end_row
            a_scale_M = a_scale_ptr + rm.to(tl.int64) * stride_asm
            w_scale = w_scale_ptr + group.to(tl.int64) * stride_wse + pid_n * stride_wsn
            acc_MN = tl.full((BLOCK_M, 128), 0.0, tl.float32)
            for k in tl.range(0, K // 128, num_stages=STAGES):
                a_MK = load_rows(a_desc, start_row, rows, local_row, k * 128)
                if CONTRACT_LAST:
                    w_KN = tl.trans(w_desc.load([group, pid_n * 128, k * 128]).reshape(128, 128))
                else:
                    w_KN = w_desc.load([group, k * 128, pid_n * 128]).reshape(128, 128)
                partial_MN = tl.dot(a_MK, w_KN)
                scale_M = tl.load(a_scale_M + k * stride_ask, mask=rows_in, other=0.0) * \
                    tl.load(w_scale + k * stride_wsk)
                acc_MN += partial_MN * scale_M[:, None]
            store_rows(out_desc, start_row, rows, local_row, pid_n * 128, acc_MN.to(out_desc.dtype))

    _blockwise_mm = Kernel(_blockwise_mm_kernel, do_not_specialize=["M", "tiles_m"])

    # One program per 128x128 block of one matrix: its amax, its scale, its values quantized with the twin's
    # arithmetic (kernels/fp8_quant.py), stored where w's block is or, TRANSPOSE, where w^T's is. ROUND as
    # kernels/fp8_quant.py's (_as_stored).
    def _quantize_blocks_kernel(w_ptr, q_ptr, scale_ptr, P, Q, stride_wb, stride_wp, TRANSPOSE: tl.constexpr,
                                ROUND: tl.constexpr):
        matrix = tl.program_id(1).to(tl.int64)
        blocks_q = Q // 128
        block_p, block_q = tl.program_id(0) // blocks_q, tl.program_id(0) % blocks_q
        rp = (block_p * 128 + tl.arange(0, 128)).to(tl.int64)
        rq = block_q * 128 + tl.arange(0, 128)
        x = tl.load(w_ptr + matrix * stride_wb + rp[:, None] * stride_wp + rq[None, :]).to(tl.float32)
        x = as_stored(x, ROUND)
        amax = tl.maximum(tl.reduce(tl.reduce(tl.abs(x), 1, max_combine), 0, max_combine), _FLOOR)
        scale_at = (block_q * (P // 128) + block_p) if TRANSPOSE else tl.program_id(0)
        tl.store(scale_ptr + matrix * (P // 128) * blocks_q + scale_at, tl.math.div_rn(amax, _MAX))
        q = tl.minimum(tl.maximum(x * tl.math.div_rn(_MAX, amax), -_MAX), _MAX).to(q_ptr.dtype.element_ty)
        q_base = q_ptr + matrix * P * Q
        if TRANSPOSE:  # q^T (Q, P): element (p, q) at q * P + p
            tl.store(q_base + rq[None, :].to(tl.int64) * P + rp[:, None], q)
        else:
            tl.store(q_base + rp[:, None] * Q + rq[None, :], q)

    _blocks = Kernel(_quantize_blocks_kernel)

    def _tiles_fp8(x):
        """x (R, C) fp32, C a multiple of 128: (its values as E4M3 before the cast, clamped; the scales (R, C / 128))
        per 1x128 tile, the twin's arithmetic. SwiGLU's kernels, writing FP8 tiles beside their own output, call
        it too, so theirs are quantize_tiles's bit for bit."""
        tiles = tl.reshape(x, (x.shape[0], x.shape[1] // 128, 128))
        amax = tl.maximum(tl.reduce(tl.abs(tiles), 2, max_combine), _FLOOR)
        q = tl.minimum(tl.maximum(tiles * tl.math.div_rn(_MAX, amax)[:, :, None], -_MAX), _MAX)
        return tl.reshape(q, (x.shape[0], x.shape[1])), tl.math.div_rn(amax, _MAX)

    tiles_fp8 = DeviceFunction(_tiles_fp8)

    # One program per (BLOCK_R rows, one 128-wide tile column): each row's tile amax, scale and values. Rows at or
    # past the bound are masked off.
    def _quantize_tiles_kernel(x_ptr, q_ptr, scale_ptr, bound_ptr, R, K, stride_x, stride_sr, stride_sk,
                               HAS_BOUND: tl.constexpr, BLOCK_R: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        limit = R
        if HAS_BOUND:
            limit = tl.minimum(tl.load(bound_ptr), R)
        live = rows < limit
        rows = rows.to(tl.int64)
        cols = tl.program_id(1) * 128 + tl.arange(0, 128)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        q, scale = tiles_fp8(x)
        tl.store(scale_ptr + rows[:, None] * stride_sr + tl.program_id(1) * stride_sk, scale, mask=live[:, None])
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=live[:, None])

    _tiles = Kernel(_quantize_tiles_kernel)


def _check_multiple(what: str, size: int) -> None:
    if size % BLOCK:
        raise ValueError(f"blockwise FP8 needs {what} a multiple of {BLOCK}, got {size}")


def quantize_tiles_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, K = x.shape
    _check_multiple("the quantized rows' length", K)
    q, scale = quantize_along_torch(x.reshape(*lead, K // BLOCK, BLOCK), -1)
    return q.reshape(x.shape), scale


def quantize_tiles(x: torch.Tensor, rows_bound: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): x (..., M, K) quantized per 1x128 tile of its last dimension; q contiguous like x, scales
    (..., M, K / 128) float32, by the kernel of a 2-D x laid out column-major (what cuBLAS's blockwise GEMM reads;
    the Triton GEMM reads either). ``rows_bound`` (a device int tensor of one element): rows of x (viewed as (rows,
    K)) from it on are left unwritten on CUDA (the twin writes them)."""
    *lead, K = x.shape
    _check_multiple("the quantized rows' length", K)
    if not use_triton(x, "fp8 quantize_tiles"):
        return quantize_tiles_torch(x)
    x_RK = x.reshape(-1, K)
    if x_RK.stride(1) != 1:
        x_RK = x_RK.contiguous()
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    if x.dim() == 2:
        scale = torch.empty((K // BLOCK, x.shape[0]), dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty((*lead, K // BLOCK), dtype=torch.float32, device=x.device)
    if x.numel():
        block_r = 32
        scale_RK = scale if x.dim() == 2 else scale.view(-1, K // BLOCK)
        _tiles[(triton.cdiv(x_RK.shape[0], block_r), K // BLOCK), x.device](
            x_RK, q, scale_RK, x_RK if rows_bound is None else rows_bound, x_RK.shape[0], K, x_RK.stride(0),
            scale_RK.stride(0), scale_RK.stride(1), HAS_BOUND=rows_bound is not None, BLOCK_R=block_r, num_warps=4)
    return q, scale


def _blocks_view(w: torch.Tensor) -> torch.Tensor:
    """w (..., P, Q) as (..., P / 128, Q / 128, 128 * 128): each block's values in one row."""
    *lead, P, Q = w.shape
    _check_multiple("every weight dimension", P)
    _check_multiple("every weight dimension", Q)
    return (w.reshape(*lead, P // BLOCK, BLOCK, Q // BLOCK, BLOCK).transpose(-3, -2)
            .reshape(*lead, P // BLOCK, Q // BLOCK, BLOCK * BLOCK))


def quantize_blocks_torch(w: torch.Tensor, transpose: bool = False, *, as_dtype: torch.dtype | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`quantize_blocks` (new outputs)."""
    w = rounded(w, as_dtype)
    *lead, P, Q = w.shape
    q_blocks, scale = quantize_along_torch(_blocks_view(w), -1)
    q = q_blocks.reshape(*lead, P // BLOCK, Q // BLOCK, BLOCK, BLOCK).transpose(-3, -2).reshape(w.shape)
    return (q.transpose(-2, -1).contiguous(), scale.transpose(-2, -1).contiguous()) if transpose else (q, scale)


def quantize_blocks(w: torch.Tensor, q_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                    transpose: bool = False, *, as_dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): w (..., P, Q) quantized per 128x128 block; q contiguous like w, scales (..., P / 128,
    Q / 128) float32; ``transpose``: those of w^T instead (a block's scale and values do not depend on the
    orientation), q (..., Q, P), written transposed in the same pass. Into the given outputs when given (a cached
    copy refreshed in place). One Triton pass on CUDA (the twin's fp32 copies of a whole expert weight would
    take GBs). ``as_dtype`` (bf16 or fp16): bit for bit the result for ``w.to(as_dtype)``, with no copy made (an
    fp32 master weight quantized as its model copy would be)."""
    round_ = round_mode(w, as_dtype)
    *lead, P, Q = w.shape
    _blocks_view(w)  # the dimensions' check
    shape, blocks = ((*lead, Q, P), (*lead, Q // BLOCK, P // BLOCK)) if transpose else (
        tuple(w.shape), (*lead, P // BLOCK, Q // BLOCK))
    q, scale = fp8_outputs(shape, blocks, w, q_out, scale_out)
    if not use_triton(w, "fp8 quantize_blocks"):
        q_new, scale_new = quantize_blocks_torch(w, transpose, as_dtype=as_dtype)
        q.copy_(q_new)
        scale.copy_(scale_new)
    elif w.numel():
        w_BPQ = w.reshape(-1, P, Q)
        if w_BPQ.stride(2) != 1:
            w_BPQ = w_BPQ.contiguous()
        _blocks[((P // BLOCK) * (Q // BLOCK), w_BPQ.shape[0]), w.device](
            w_BPQ, q, scale, P, Q, w_BPQ.stride(0), w_BPQ.stride(1), TRANSPOSE=transpose, ROUND=round_,
            num_warps=8)
    return q, scale


def dequantize_tiles(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of tiles quantized by :func:`quantize_tiles` (scales may be broadcast: one per row)."""
    *lead, K = q.shape
    return (q.float().reshape(*lead, K // BLOCK, BLOCK) * scale.expand(*lead, K // BLOCK)[..., None]).reshape(q.shape)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of blocks quantized by :func:`quantize_blocks`."""
    return q.float() * scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)


def blockwise_mm_torch(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                       contract_last: bool, offsets_E: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Twin: the dequantized operands' fp32 product (a host loop over the groups; rows past the last offset are
    zeros), rounded once to ``out_dtype``."""
    a, w = dequantize_tiles(a_q, a_scale), dequantize_blocks(w_q, w_scale)
    b = w.transpose(-2, -1) if contract_last else w
    if offsets_E is None:
        return (a @ b).to(out_dtype)
    out = a.new_zeros((a.shape[0], b.shape[-1]))
    start = 0
    for group, end in enumerate(offsets_E.tolist()):
        out[start:end] = a[start:end] @ b[group]
        start = end
    return out.to(out_dtype)


def _check_operands(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    contract_last: bool, offsets_E: torch.Tensor | None) -> tuple[int, int, int]:
    """(M, K, N) of a blockwise GEMM's operands, or a ValueError naming what does not fit."""
    if a_q.dim() != 2 or w_q.dim() != (2 if offsets_E is None else 3):
        raise ValueError(f"blockwise_mm needs a 2-D and w {'2' if offsets_E is None else '3'}-D, got "
                         f"{tuple(a_q.shape)} and {tuple(w_q.shape)}")
    M, K = a_q.shape
    *lead, P, Q = w_q.shape
    _check_multiple("the contraction K", K)
    _check_multiple("the weight's rows P", P)
    _check_multiple("the weight's columns Q", Q)
    if K != (Q if contract_last else P):
        raise ValueError(f"a's K = {K} does not match w {tuple(w_q.shape)} (contract_last={contract_last})")
    if a_scale.shape != (M, K // BLOCK) or w_scale.shape != (*lead, P // BLOCK, Q // BLOCK):
        raise ValueError(f"scales {tuple(a_scale.shape)} and {tuple(w_scale.shape)} do not fit a {tuple(a_q.shape)} "
                         f"and w {tuple(w_q.shape)} in blocks of {BLOCK}")
    if offsets_E is not None and (offsets_E.shape != tuple(lead) or offsets_E.dtype != torch.int32):
        raise ValueError(f"offsets_E must be int32 of shape {tuple(lead)}, got {offsets_E.dtype} "
                         f"{tuple(offsets_E.shape)}")
    return M, K, P if contract_last else Q


# (BLOCK_M, warps, stages); BLOCK_N and BLOCK_K are the scale blocks' 128. Measured on an H200 against the
# pointer-fed loop this kernel replaced (fp8_blockwise_tma_1xh200.json, 1,024 rows per expert, the experts' forward
# and input-gradient shapes, bit for bit the same outputs): 64 rows, 4 warps, 4 stages was the fastest of five tiles
# at all eight shapes, 4-12% below the old kernel's best tile (the fine fc1 forward 0.770 against 0.807 ms, the
# Mixtral-like fc2 input gradient 1.075 against 1.215). The old loop, compiled for sm_90 by triton 3.6, was not
# pipelined and spilled 1.4 KB a thread; this one is fed by the TMA. A second sweep (step_kernels_fp8_blockwise_tma_
# 1xh200.json; 2 stages, 8 warps, 128 rows all slower) had 3 stages 11-18% faster than 4 where the contraction is
# at most 2,048 deep (the fine experts' four GEMMs), and 0-18% slower where it is 4,096 or more (Mixtral's).
_CONFIG_SHORT = (64, 4, 3)  # contractions of at most SHORT
_CONFIG = (64, 4, 4)
SHORT = 2048


def _default_config(K: int) -> tuple[int, int, int]:
    return _CONFIG_SHORT if K <= SHORT else _CONFIG


def _tma_rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit column stride and 16-byte aligned rows, as a TMA descriptor reads it (a copy only where not: a
    fresh tensor, since a contiguous view past an aligned start would come back from .contiguous() as it is)."""
    aligned = t.stride(-1) == 1 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) and \
        t.data_ptr() % 16 == 0
    return t if aligned else t.clone(memory_format=torch.contiguous_format)


def blockwise_mm_triton(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                        contract_last: bool, offsets_E: torch.Tensor | None = None,
                        out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
                        config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """:func:`blockwise_mm` in one Triton launch of a static grid (CUDA-graph replayable: the group sizes are read
    on the device). Into ``out`` (M, N) of ``out_dtype`` when given (unit column stride); rows past the last offset
    are left unwritten (their values in a new output are undefined). Operands of any dtype tl.dot takes (FP8 on
    Hopper; float32 holding E4M3 values in the CPU interpreter). ``config``: (BLOCK_M, warps, stages); by default by
    the contraction's depth."""
    M, K, N = _check_operands(a_q, a_scale, w_q, w_scale, contract_last, offsets_E)
    if config is not None and len(config) != 3:
        raise ValueError(f"blockwise_mm_triton's config is (BLOCK_M, warps, stages), got {config}")
    block_m, warps, stages = config or _default_config(K)
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    elif out.shape != (M, N) or out.dtype != out_dtype or _tma_rows(out) is not out:
        raise ValueError(f"out must be {out_dtype} {(M, N)} with unit column stride and 16-byte aligned rows, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if M == 0:
        return out
    if not a_q.is_cuda or interpreter_requested():  # the interpreter: small row tiles keep the CPU tests quick
        block_m = min(block_m, 16)
    grouped = offsets_E is not None
    w_EPQ = _tma_rows(w_q if grouped else w_q[None])
    experts = w_EPQ.shape[0]
    tiles_m = triton.cdiv(M, block_m) + (experts if grouped else 0)  # a group's last tile may be partial
    # w's 128x128 block scales: (k, n) of b = w^T (contract_last) or w, by strides (no copy)
    w_k, w_n = (-1, -2) if contract_last else (-2, -1)
    _blockwise_mm[(tiles_m * (N // BLOCK),), a_q.device](
        create_ragged_descriptor(_tma_rows(a_q), [block_m, BLOCK]), a_scale,
        TensorDescriptor.from_tensor(w_EPQ, [1, BLOCK, BLOCK]), w_scale, offsets_E if grouped else a_scale,
        create_ragged_descriptor(out, [block_m, BLOCK]), M, N, K, experts, tiles_m, a_scale.stride(0),
        a_scale.stride(1), w_scale.stride(0) if grouped else 0, w_scale.stride(w_k), w_scale.stride(w_n),
        GROUPED=grouped, CONTRACT_LAST=contract_last, BLOCK_M=block_m, GROUP_M=8, STAGES=stages, num_warps=warps)
    return out


def cublas_takes(a_q: torch.Tensor, contract_last: bool, offsets_E: torch.Tensor | None,
                 out_dtype: torch.dtype) -> bool:
    """Whether :func:`blockwise_mm` hands this product to cuBLAS's blockwise FP8 GEMM: dense ``a @ w^T`` into bf16
    on Hopper, with CUDA 12.9 or later (torch._scaled_mm's 1x128 by 128x128 scaling), and a contraction of a
    multiple of 512 (torch versions disagree on whether the weight scales' rows are padded to four blocks; at a
    multiple of four they agree). Measured on an H200 (fp8_blockwise_cublas_1xh200.json): 18-27% faster than the
    Triton kernel on the bench models' dense linears; it has no grouped form. Rows a multiple of 4: the tile scales'
    column stride is the row count, and cuBLAS takes only 16-byte aligned ones (gpu_tests_blockwise_{dense,rows}_
    1xh200.txt: 8, 12, 268, 3996, 4076 taken; 10, 270, 4074, 4078 and odd counts refused)."""
    return (offsets_E is None and contract_last and out_dtype == torch.bfloat16 and a_q.is_cuda
            and a_q.shape[1] % (4 * BLOCK) == 0 and a_q.shape[0] % 4 == 0 and a_q.shape[0] > 0
            and not interpreter_requested() and _cublas_blockwise_on(a_q.device.index))


@functools.cache
def _cublas_blockwise_on(device_index: int | None) -> bool:
    """Whether this CUDA build and GPU run cuBLAS's blockwise FP8 GEMM: CUDA 12.9 or later, Hopper (asked once per
    GPU: every dense blockwise product asks)."""
    version = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    return version >= (12, 9) and torch.cuda.get_device_capability(device_index) == (9, 0)


def blockwise_mm_cublas(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ w^T`` by cuBLAS (:func:`cublas_takes` says where): the tile scales column-major (a copy only where
    they are not, as :func:`quantize_tiles` writes them), the block scales as a view of w's."""
    if a_scale.stride(0) != 1 or a_scale.stride(1) != a_q.shape[0]:
        a_scale = a_scale.t().contiguous().t()
    return torch._scaled_mm(a_q.contiguous(), w_q.contiguous().t(), scale_a=a_scale,
                            scale_b=w_scale.contiguous().t(), out_dtype=out_dtype)


def blockwise_mm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 contract_last: bool, offsets_E: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ w^T`` (``contract_last``) or ``a @ w`` in blockwise FP8: a (M, K) E4M3 with scales (M, K / 128)
    (a view with stride 0 along the second dimension takes rows quantized with one scale each); w (P, Q), or
    (E, P, Q) with ``offsets_E`` (int32 end offsets of each group's rows, the last at most M), E4M3 with scales
    (..., P / 128, Q / 128). Out (M, P or Q) in ``out_dtype``; rows past the last offset are not computed (left
    unwritten by the Triton kernel, zeros in the twin). Dense products go to cuBLAS where it takes them
    (:func:`cublas_takes`)."""
    if cublas_takes(a_q, contract_last, offsets_E, out_dtype):
        _check_operands(a_q, a_scale, w_q, w_scale, contract_last, offsets_E)
        return blockwise_mm_cublas(a_q, a_scale, w_q, w_scale, out_dtype)
    if use_triton(a_q, "fp8 blockwise_mm"):  # it checks the operands itself
        return blockwise_mm_triton(a_q, a_scale, w_q, w_scale, contract_last, offsets_E, out_dtype)
    _check_operands(a_q, a_scale, w_q, w_scale, contract_last, offsets_E)
    return blockwise_mm_torch(a_q, a_scale, w_q, w_scale, contract_last, offsets_E, out_dtype)
