"""SwiGLU of the expert FFN, fused: one pass over fc1's output forward, one pass backward that also
rebuilds the activation the fc2 weight gradient needs. fp32 arithmetic in registers, the tensors in their
own dtype (bf16 on GPU): the torch twin's fp32 temporaries cost several full passes over T x 2F.

h_TF2 holds [gate | up] along its last dimension; a = silu(gate) * up.

Under the FP8 recipes the forward writes a straight as the FP8 rows fc2 reads (:func:`swiglu_forward_fp8`: E4M3
values and one scale per row, the values of ``quantize_rows(swiglu_forward(h))``, or with ``tiles`` one per 1x128
tile, ``quantize_tiles``'s), so a is neither written in bf16 nor read back by a quantize pass; the backward
rebuilds a itself, and writes fc1's output gradient in FP8 beside its bf16 values (:func:`swiglu_backward_fp8`),
where asked over h's bytes: it is h's last reader.
"""

from __future__ import annotations

import math

import torch

from moe_overlap.kernels.fp8_blockwise import BLOCK as TILE, quantize_tiles_torch
from moe_overlap.kernels.fp8_quant import FP8, quantize_rows_torch
from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, max_combine, strided_programs, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe_overlap.kernels.fp8_blockwise import tiles_fp8
    from moe_overlap.kernels.fp8_quant import TL_AMAX_FLOOR as _FP8_FLOOR, TL_FP8_MAX as _FP8_MAX
    from moe_overlap.kernels.launch import DeviceFunction

    # Programs stride over the rows below the device count, each on one block of FF columns: a static worst-case
    # buffer costs what its counted rows cost (one program per buffer row ran 2x that, 3 in 4 returning at once:
    # step_kernels_swiglu_1xh100.json); no per-element division (an int64 div/mod per element made the flat-index
    # version 3-4x slower than memory on an H200).
    def _swiglu_fwd_kernel(h_ptr, a_ptr, rows_ptr, FF, BLOCK: tl.constexpr):
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < FF
        for row in range(tl.program_id(0).to(tl.int64), tl.load(rows_ptr), tl.num_programs(0)):
            gate = tl.load(h_ptr + row * 2 * FF + col, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(h_ptr + row * 2 * FF + FF + col, mask=mask, other=0.0).to(tl.float32)
            silu = gate * (1.0 / (1.0 + tl.exp(-gate)))  # the backward's formula: both passes give the same a
            tl.store(a_ptr + row * FF + col, (silu * up).to(a_ptr.dtype.element_ty), mask=mask)

    def _swiglu_bwd_kernel(h_ptr, grad_a_ptr, grad_h_ptr, a_ptr, rows_ptr, FF, BLOCK: tl.constexpr):
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < FF
        out_ty = grad_h_ptr.dtype.element_ty
        for row in range(tl.program_id(0).to(tl.int64), tl.load(rows_ptr), tl.num_programs(0)):
            gate = tl.load(h_ptr + row * 2 * FF + col, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(h_ptr + row * 2 * FF + FF + col, mask=mask, other=0.0).to(tl.float32)
            grad = tl.load(grad_a_ptr + row * FF + col, mask=mask, other=0.0).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-gate))
            silu = gate * sig
            tl.store(grad_h_ptr + row * 2 * FF + col, (grad * up * sig * (1.0 + gate * (1.0 - sig))).to(out_ty),
                     mask=mask)
            tl.store(grad_h_ptr + row * 2 * FF + FF + col, (grad * silu).to(out_ty), mask=mask)
            tl.store(a_ptr + row * FF + col, (silu * up).to(a_ptr.dtype.element_ty), mask=mask)

    def _gate_up_rows(h_ptr, first, n_rows, cols, FF, ROWS: tl.constexpr):
        """ROWS rows of h (T, 2 FF) from row ``first``, the block ``cols`` of each: (the rows, which are below
        ``n_rows``, the tile's mask, its offsets in h's gate half, gate and up in fp32)."""
        rows = first + tl.arange(0, ROWS)
        live = rows < n_rows
        mask = live[:, None] & (cols < FF)[None, :]
        at = rows[:, None] * 2 * FF + cols[None, :]
        gate = tl.load(h_ptr + at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + at + FF, mask=mask, other=0.0).to(tl.float32)
        return rows, live, mask, at, gate, up

    gate_up_rows = DeviceFunction(_gate_up_rows)

    def _store_tile_scales(scale_row, start, scale, live, FF):
        """The (rows, BLOCK / 128) tile scales of a block of columns from ``start`` (a multiple of 128) into their
        rows' scales at ``scale_row``, the tiles past FF left out."""
        tiles = start // 128 + tl.arange(0, scale.shape[1])
        tl.store(scale_row + tiles[None, :], scale, mask=live[:, None] & (tiles < FF // 128)[None, :])

    store_tile_scales = DeviceFunction(_store_tile_scales)

    # a's rows as FP8 (kernels/fp8_quant.py's row scale and rounding). A row in one block (ONE_BLOCK: FF <= BLOCK)
    # stays in registers: one read of h, ROWS rows a program at a time (a tile, its maxima along the columns). A
    # longer one, a row a program at a time: a in the activations' dtype from the first pass over the row's blocks
    # gives its amax, the second (h from L2) the values. TILES: one scale per 1x128 tile (kernels/fp8_blockwise.py's
    # arithmetic), so a longer row takes one pass.
    def _swiglu_fwd_fp8_kernel(h_ptr, q_ptr, scale_ptr, rows_ptr, FF, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
                               ROWS: tl.constexpr, TILES: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        n_rows = tl.load(rows_ptr)
        if ONE_BLOCK:
            fp8_max = tl.full((ROWS,), _FP8_MAX, tl.float32)
            for first in range(tl.program_id(0).to(tl.int64) * ROWS, n_rows, tl.num_programs(0) * ROWS):
                rows, live, mask, at, gate, up = gate_up_rows(h_ptr, first, n_rows, cols, FF, ROWS)
                a = (gate * (1.0 / (1.0 + tl.exp(-gate))) * up).to(h_ptr.dtype.element_ty).to(tl.float32)
                if TILES:
                    q, scale = tiles_fp8(a)
                    store_tile_scales(scale_ptr + rows[:, None] * (FF // 128), 0, scale, live, FF)
                else:
                    row_amax = tl.maximum(tl.reduce(tl.abs(a), 1, max_combine), _FP8_FLOOR)
                    tl.store(scale_ptr + rows, tl.math.div_rn(row_amax, fp8_max), mask=live)
                    q = tl.minimum(tl.maximum(a * tl.math.div_rn(fp8_max, row_amax)[:, None], -_FP8_MAX), _FP8_MAX)
                tl.store(q_ptr + rows[:, None] * FF + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        elif TILES:  # a tile's scale is its own: one pass over the row's blocks
            for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
                for start in range(0, FF, BLOCK):
                    mask = start + cols < FF
                    gate = tl.load(h_ptr + row * 2 * FF + start + cols, mask=mask, other=0.0).to(tl.float32)
                    up = tl.load(h_ptr + row * 2 * FF + FF + start + cols, mask=mask, other=0.0).to(tl.float32)
                    a = (gate * (1.0 / (1.0 + tl.exp(-gate))) * up).to(h_ptr.dtype.element_ty).to(tl.float32)
                    q, scale = tiles_fp8(tl.reshape(a, (1, BLOCK)))
                    store_tile_scales(scale_ptr + row * (FF // 128), start, scale, tl.arange(0, 1) < 1, FF)
                    tl.store(q_ptr + row * FF + start + cols, tl.reshape(q, (BLOCK,)).to(q_ptr.dtype.element_ty),
                             mask=mask)
        else:
            for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
                amax = tl.full((BLOCK,), 0.0, tl.float32)
                inverse = 0.0
                for second in tl.static_range(2):
                    if second == 1:
                        row_amax = tl.maximum(tl.reduce(amax, 0, max_combine), _FP8_FLOOR)
                        tl.store(scale_ptr + row, tl.math.div_rn(row_amax, _FP8_MAX))
                        inverse = tl.math.div_rn(_FP8_MAX, row_amax)
                    for start in range(0, FF, BLOCK):
                        mask = start + cols < FF
                        gate = tl.load(h_ptr + row * 2 * FF + start + cols, mask=mask, other=0.0).to(tl.float32)
                        up = tl.load(h_ptr + row * 2 * FF + FF + start + cols, mask=mask, other=0.0).to(tl.float32)
                        a = (gate * (1.0 / (1.0 + tl.exp(-gate))) * up).to(h_ptr.dtype.element_ty).to(tl.float32)
                        if second == 0:
                            amax = tl.maximum(amax, tl.abs(a))
                        else:
                            q = tl.minimum(tl.maximum(a * inverse, -_FP8_MAX), _FP8_MAX)
                            tl.store(q_ptr + row * FF + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)

    # The backward, and fc1's output gradient as FP8 rows too (for its FP8 dgrad): grad_h and a written as the
    # backward does, grad_h's amax taken, then grad_h quantized. Rows in one block (ONE_BLOCK: FF <= BLOCK), ROWS a
    # program at a time, are quantized from registers. A longer row, one a program at a time, is read back (from L2;
    # after a barrier: other threads wrote it) in a second pass. TILES: one scale per 1x128 tile (gate's tiles,
    # then up's), each block's tiles quantized as they are written. q's rows are q_stride apart: OVER_H, they lie in
    # h's own rows, so a program writes them only after a barrier behind its reads of those rows.
    def _swiglu_bwd_fp8_kernel(h_ptr, grad_a_ptr, grad_h_ptr, a_ptr, q_ptr, scale_ptr, rows_ptr, FF, q_stride,
                               BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
                               OVER_H: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        out_ty = grad_h_ptr.dtype.element_ty
        q_ty = q_ptr.dtype.element_ty
        n_rows = tl.load(rows_ptr)
        if ONE_BLOCK:
            fp8_max = tl.full((ROWS,), _FP8_MAX, tl.float32)
            for first in range(tl.program_id(0).to(tl.int64) * ROWS, n_rows, tl.num_programs(0) * ROWS):
                rows, live, mask, at, gate, up = gate_up_rows(h_ptr, first, n_rows, cols, FF, ROWS)
                grad = tl.load(grad_a_ptr + rows[:, None] * FF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                sig = 1.0 / (1.0 + tl.exp(-gate))
                silu = gate * sig
                grad_gate = (grad * up * sig * (1.0 + gate * (1.0 - sig))).to(out_ty).to(tl.float32)
                grad_up = (grad * silu).to(out_ty).to(tl.float32)
                tl.store(grad_h_ptr + at, grad_gate.to(out_ty), mask=mask)
                tl.store(grad_h_ptr + at + FF, grad_up.to(out_ty), mask=mask)
                tl.store(a_ptr + rows[:, None] * FF + cols[None, :], (silu * up).to(a_ptr.dtype.element_ty), mask=mask)
                if TILES:  # gate's tiles, then up's: grad_h's row is [gate | up]
                    q_gate, scale_gate = tiles_fp8(grad_gate)
                    q_up, scale_up = tiles_fp8(grad_up)
                    scale_row = scale_ptr + rows[:, None] * (2 * FF // 128)
                    store_tile_scales(scale_row, 0, scale_gate, live, FF)
                    store_tile_scales(scale_row + FF // 128, 0, scale_up, live, FF)
                else:
                    amax = tl.reduce(tl.maximum(tl.abs(grad_gate), tl.abs(grad_up)), 1, max_combine)
                    amax = tl.maximum(amax, _FP8_FLOOR)
                    tl.store(scale_ptr + rows, tl.math.div_rn(amax, fp8_max), mask=live)
                    inverse = tl.math.div_rn(fp8_max, amax)[:, None]
                    q_gate = tl.minimum(tl.maximum(grad_gate * inverse, -_FP8_MAX), _FP8_MAX)
                    q_up = tl.minimum(tl.maximum(grad_up * inverse, -_FP8_MAX), _FP8_MAX)
                if OVER_H:
                    tl.debug_barrier()
                q_at = rows[:, None] * q_stride + cols[None, :]
                tl.store(q_ptr + q_at, q_gate.to(q_ty), mask=mask)
                tl.store(q_ptr + q_at + FF, q_up.to(q_ty), mask=mask)
        else:
            for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
                amax = tl.full((BLOCK,), 0.0, tl.float32)
                for start in range(0, FF, BLOCK):
                    mask = start + cols < FF
                    gate = tl.load(h_ptr + row * 2 * FF + start + cols, mask=mask, other=0.0).to(tl.float32)
                    up = tl.load(h_ptr + row * 2 * FF + FF + start + cols, mask=mask, other=0.0).to(tl.float32)
                    grad = tl.load(grad_a_ptr + row * FF + start + cols, mask=mask, other=0.0).to(tl.float32)
                    sig = 1.0 / (1.0 + tl.exp(-gate))
                    silu = gate * sig
                    grad_gate = (grad * up * sig * (1.0 + gate * (1.0 - sig))).to(out_ty)
                    grad_up = (grad * silu).to(out_ty)
                    tl.store(grad_h_ptr + row * 2 * FF + start + cols, grad_gate, mask=mask)
                    tl.store(grad_h_ptr + row * 2 * FF + FF + start + cols, grad_up, mask=mask)
                    tl.store(a_ptr + row * FF + start + cols, (silu * up).to(a_ptr.dtype.element_ty), mask=mask)
                    if TILES:  # a tile's scale is its own: quantized as it is written, no second pass
                        one_row = tl.arange(0, 1) < 1
                        q, scale = tiles_fp8(tl.reshape(grad_gate.to(tl.float32), (1, BLOCK)))
                        store_tile_scales(scale_ptr + row * (2 * FF // 128), start, scale, one_row, FF)
                        tl.store(q_ptr + row * q_stride + start + cols, tl.reshape(q, (BLOCK,)).to(q_ty), mask=mask)
                        q, scale = tiles_fp8(tl.reshape(grad_up.to(tl.float32), (1, BLOCK)))
                        store_tile_scales(scale_ptr + row * (2 * FF // 128) + FF // 128, start, scale, one_row, FF)
                        tl.store(q_ptr + row * q_stride + FF + start + cols, tl.reshape(q, (BLOCK,)).to(q_ty),
                                 mask=mask)
                    else:
                        amax = tl.maximum(amax, tl.maximum(tl.abs(grad_gate.to(tl.float32)),
                                                           tl.abs(grad_up.to(tl.float32))))
                if not TILES:  # the row's scale, then its values read back
                    amax = tl.maximum(tl.reduce(amax, 0, max_combine), _FP8_FLOOR)
                    tl.store(scale_ptr + row, tl.math.div_rn(amax, _FP8_MAX))
                    inverse = tl.math.div_rn(_FP8_MAX, amax)
                    tl.debug_barrier()
                    for start in range(0, 2 * FF, BLOCK):
                        mask = start + cols < 2 * FF
                        v = tl.load(grad_h_ptr + row * 2 * FF + start + cols, mask=mask, other=0.0).to(tl.float32)
                        q = tl.minimum(tl.maximum(v * inverse, -_FP8_MAX), _FP8_MAX)
                        tl.store(q_ptr + row * q_stride + start + cols, q.to(q_ty), mask=mask)
                    tl.debug_barrier()  # the next row's first pass must not overtake this row's reads

    _fwd = Kernel(_swiglu_fwd_kernel)
    _bwd = Kernel(_swiglu_bwd_kernel)
    _fwd_fp8 = Kernel(_swiglu_fwd_fp8_kernel)
    _bwd_fp8 = Kernel(_swiglu_bwd_fp8_kernel)

_BLOCK = 1024
_PROGRAMS_PER_SM = 64  # row programs per SM: 64 ran at the counted rows' own cost, 4 about 10% slower (H100)


def swiglu_forward_torch(h_TF2: torch.Tensor) -> torch.Tensor:
    gate, up = h_TF2.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(h_TF2.dtype)


def swiglu_backward_torch(h_TF2: torch.Tensor, grad_a_TF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = h_TF2.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    grad = grad_a_TF.float()
    grad_gate = grad * up * sig * (1 + gate * (1 - sig))
    grad_h = torch.cat((grad_gate, grad * gate * sig), dim=-1).to(h_TF2.dtype)
    return grad_h, (gate * sig * up).to(h_TF2.dtype)


def _grid(a_TF: torch.Tensor) -> tuple[int, int]:
    """Row programs (at most the buffer's rows; a few in the interpreter) x blocks of FF columns."""
    return (strided_programs(a_TF.numel() // a_TF.shape[-1], _PROGRAMS_PER_SM, a_TF.device, off_gpu=4),
            triton.cdiv(a_TF.shape[-1], _BLOCK))


def _row_count(valid_rows: torch.Tensor | None, h_TF2: torch.Tensor) -> torch.Tensor:
    if valid_rows is None:
        return torch.full((1,), h_TF2.shape[0], dtype=torch.int64, device=h_TF2.device)
    return valid_rows


def swiglu_forward_triton(h_TF2: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    h_TF2 = h_TF2.contiguous()
    ffn = h_TF2.shape[-1] // 2
    a_TF = h_TF2.new_empty(h_TF2.shape[:-1] + (ffn,))
    if a_TF.numel():
        _fwd[_grid(a_TF), h_TF2.device](h_TF2, a_TF, _row_count(valid_rows, h_TF2), ffn, BLOCK=_BLOCK)
    return a_TF


def swiglu_backward_triton(h_TF2: torch.Tensor, grad_a_TF: torch.Tensor,
                           valid_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    h_TF2, grad_a_TF = h_TF2.contiguous(), grad_a_TF.contiguous()
    ffn = h_TF2.shape[-1] // 2
    grad_h_TF2 = torch.empty_like(h_TF2)
    a_TF = h_TF2.new_empty(grad_a_TF.shape)
    if a_TF.numel():
        _bwd[_grid(a_TF), h_TF2.device](h_TF2, grad_a_TF, grad_h_TF2, a_TF, _row_count(valid_rows, h_TF2), ffn,
                                        BLOCK=_BLOCK)
    return grad_h_TF2, a_TF


def swiglu_forward(h_TF2: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """a = silu(gate) * up. ``valid_rows`` (a one-element device tensor): only the first rows count, the
    kernel leaves the others unwritten (a static worst-case buffer; the twin computes them all)."""
    if use_triton(h_TF2, "swiglu"):
        return swiglu_forward_triton(h_TF2, valid_rows)
    return swiglu_forward_torch(h_TF2)


_FP8_BLOCK = 2048  # columns per step of the FP8 forward's row program
# (rows a program takes at a time, warps a program) where a row fits one block; longer rows: (1, 8). Measured on an
# H200 at the fine-grained experts' 65,536 rows of ffn 1,024, timed from CUDA graphs
# (step_kernels_fp8_row_tiles_graphed_1xh200.json): the forward 0.088 ms at (2, 4) against 0.112 at (1, 8); the
# backward 0.2425 at (1, 8), none faster (0.2435 at (2, 8), 0.29-0.38 with 4-8 rows at once).
_FP8_FORWARD_TILE, _FP8_BACKWARD_TILE, _FP8_LONG_ROW_TILE = (2, 4), (1, 8), (1, 8)


def _fp8_programs_per_sm(device: torch.device, row_bytes: int) -> int:
    """Row programs per SM for the FP8 kernels: as many as keep the rows in flight within 3/4 of L2 (the second
    pass re-reads each row from there), a power of two in [2, 32]. Measured on an H100 (50 MB L2;
    step_kernels_swiglu_fp8_1xh100.json): the Mixtral-like rows (57 KB of h) ran fastest at 4 per SM, 0.346 ms against
    0.390 at 2 and 0.389 at 16; the fine ones (4 KB) at 32, 0.221 ms against 0.242 at 8."""
    props = torch.cuda.get_device_properties(device)
    fits = 0.75 * getattr(props, "L2_cache_size", 50 << 20) / (props.multi_processor_count * max(row_bytes, 1))
    return max(2, min(32, 2 ** int(math.log2(max(fits, 1.0)))))


def swiglu_forward_fp8(h_TF2: torch.Tensor, valid_rows: torch.Tensor | None = None,
                       programs_per_sm: int | None = None, one_block: bool | None = None,
                       tile: tuple[int, int] | None = None, tiles: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_TF E4M3, scale_T float32): a = silu(gate) * up in the activations' dtype, quantized per row as
    kernels/fp8_quant.quantize_rows does, in one kernel that writes no bf16 a; ``tiles``: per 1x128 tile as
    kernels/fp8_blockwise.quantize_tiles does, scales (T, F / 128). ``valid_rows``: rows from it on are left
    unwritten by the kernel (the twin computes them all). ``programs_per_sm``: a benchmark's sweep (None: by the
    row's bytes against L2). ``one_block``: whether a row is read once, in registers (None: where it fits one
    block; False: the passes longer rows take, for a benchmark or a test). ``tile``: (rows a program takes at a
    time, warps a program) where a row fits one block, a benchmark's sweep (None: the measured default)."""
    if not use_triton(h_TF2, "swiglu"):
        return _quantized_torch(swiglu_forward_torch(h_TF2), tiles)
    h_TF2 = h_TF2.contiguous()
    ffn = h_TF2.shape[-1] // 2
    q_TF = torch.empty(h_TF2.shape[:-1] + (ffn,), dtype=FP8, device=h_TF2.device)
    scale_T = _fp8_scales(h_TF2, ffn, tiles)
    rows = h_TF2.numel() // max(h_TF2.shape[-1], 1)
    if rows and ffn:
        one = _one_block(ffn, one_block)
        rows_at_once, warps = (tile or _FP8_FORWARD_TILE) if one else _FP8_LONG_ROW_TILE
        _fwd_fp8[(_fp8_programs(h_TF2, rows, programs_per_sm, rows_at_once),), h_TF2.device](
            h_TF2, q_TF, scale_T, _row_count(valid_rows, h_TF2), ffn,
            BLOCK=min(_FP8_BLOCK, triton.next_power_of_2(ffn)), ONE_BLOCK=one, ROWS=rows_at_once, TILES=tiles,
            num_warps=warps)
    return q_TF, scale_T


def _fp8_scales(h_TF2: torch.Tensor, width: int, tiles: bool) -> torch.Tensor:
    """The FP8 kernels' scales of rows ``width`` wide: one a row, or (``tiles``) one a 1x128 tile."""
    if tiles and width % TILE:
        raise ValueError(f"SwiGLU's FP8 tiles need the rows' width a multiple of {TILE}, got {width}")
    return torch.empty(h_TF2.shape[:-1] + ((width // TILE,) if tiles else ()), dtype=torch.float32,
                       device=h_TF2.device)


def _quantized_torch(x: torch.Tensor, tiles: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_tiles_torch(x) if tiles else quantize_rows_torch(x)


def _one_block(ffn: int, asked: bool | None) -> bool:
    """Whether the FP8 kernels keep a row in registers: where it fits one block, unless asked not to."""
    return ffn <= _FP8_BLOCK and asked is not False


def _fp8_programs(h_TF2: torch.Tensor, rows: int, programs_per_sm: int | None, rows_at_once: int) -> int:
    """The FP8 kernels' row programs: per SM as given or by the row's bytes against L2 (a few in the
    interpreter), at most one per ``rows_at_once`` rows."""
    needed = triton.cdiv(rows, rows_at_once)
    if not h_TF2.is_cuda:
        return min(needed, 4)
    per_sm = programs_per_sm or _fp8_programs_per_sm(h_TF2.device, h_TF2.shape[-1] * h_TF2.element_size())
    return strided_programs(needed, per_sm, h_TF2.device, off_gpu=4)


def swiglu_backward_fp8(h_TF2: torch.Tensor, grad_a_TF: torch.Tensor, valid_rows: torch.Tensor | None = None,
                        programs_per_sm: int | None = None, one_block: bool | None = None,
                        tile: tuple[int, int] | None = None, tiles: bool = False, over_h: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h, a, q, scale): :func:`swiglu_backward`'s two, and grad_h quantized per row as
    kernels/fp8_quant.quantize_rows does (the FP8 dgrad's operand), or per tile (``tiles``), in one kernel.
    ``valid_rows``, ``programs_per_sm``, ``one_block`` and ``tile`` as for :func:`swiglu_forward_fp8`.
    ``over_h``: the caller reads h no more, so q may take the first 2F bytes of each of h's rows (strided rows, no
    buffer of their own), where a row is read whole before its q is written: not per tile over a row longer than a
    block, whose first tiles would overwrite values not yet read."""
    if not use_triton(h_TF2, "swiglu"):
        grad_h_TF2, a_TF = swiglu_backward_torch(h_TF2, grad_a_TF)
        q_TF2, scale_T = _quantized_torch(grad_h_TF2, tiles)
        if over_h and h_TF2.is_contiguous():
            q_TF2 = _rows_over(h_TF2).copy_(q_TF2)
        return grad_h_TF2, a_TF, q_TF2, scale_T
    h_TF2, grad_a_TF = h_TF2.contiguous(), grad_a_TF.contiguous()
    ffn = h_TF2.shape[-1] // 2
    grad_h_TF2, a_TF = torch.empty_like(h_TF2), h_TF2.new_empty(grad_a_TF.shape)
    one = _one_block(ffn, one_block)
    over = over_h and (one or not tiles)
    q_TF2 = _rows_over(h_TF2) if over else torch.empty(h_TF2.shape, dtype=FP8, device=h_TF2.device)
    if tiles and ffn % TILE:  # a tile must not straddle gate's and up's halves
        raise ValueError(f"SwiGLU's FP8 tiles need the FFN width a multiple of {TILE}, got {ffn}")
    scale_T = _fp8_scales(h_TF2, 2 * ffn, tiles)
    rows = h_TF2.numel() // max(h_TF2.shape[-1], 1)
    if rows and ffn:
        rows_at_once, warps = (tile or _FP8_BACKWARD_TILE) if one else _FP8_LONG_ROW_TILE
        _bwd_fp8[(_fp8_programs(h_TF2, rows, programs_per_sm, rows_at_once),), h_TF2.device](
            h_TF2, grad_a_TF, grad_h_TF2, a_TF, q_TF2, scale_T, _row_count(valid_rows, h_TF2), ffn, q_TF2.stride(-2),
            BLOCK=min(_FP8_BLOCK, triton.next_power_of_2(ffn)), ONE_BLOCK=one, ROWS=rows_at_once, TILES=tiles,
            OVER_H=over, num_warps=warps)
    return grad_h_TF2, a_TF, q_TF2, scale_T


def _rows_over(h_TF2: torch.Tensor) -> torch.Tensor:
    """grad_h's FP8 rows (..., 2F) in contiguous h's bytes: each in the first 2F bytes of its own row of h."""
    return h_TF2.view(FP8)[..., :h_TF2.shape[-1]]


def swiglu_backward(h_TF2: torch.Tensor, grad_a_TF: torch.Tensor,
                    valid_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_h, a): fc1's output gradient, and the activation again for fc2's weight gradient."""
    if use_triton(h_TF2, "swiglu"):
        return swiglu_backward_triton(h_TF2, grad_a_TF, valid_rows)
    return swiglu_backward_torch(h_TF2, grad_a_TF)
