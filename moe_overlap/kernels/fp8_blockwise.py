"""FP8 (E4M3) of the blockwise recipe (``train.fp8_recipe=blockwise``; DeepSeek-V3's, Transformer Engine's on
Hopper): activations with one float32 scale per 1x128 tile of a row, weights one per 128x128 block; a GEMM sums
each 128-deep slice of the contraction in fp32 and multiplies it by its two scales before adding it up.

A tile's or block's scale is made as a row's in kernels/fp8_quant.py (amax / 448, the amax clamped to >= 1e-12;
the values times 448 / amax, clamped, rounded to nearest even): a tile is a row of 128, a block 128 rows of 128
flattened. Every quantized dimension must be a multiple of 128 (the config refuses others, naming the field).

- :func:`quantize_tiles`: x (..., M, K) per 1x128 tile along K: q like x, scales (..., M, K / 128). On CUDA the
  rows kernel of kernels/fp8_quant.py over x viewed as rows of 128.
- :func:`quantize_blocks`: w (..., P, Q) per 128x128 block: q like w, scales (..., P / 128, Q / 128). Weights
  only, once per optimizer step: torch ops. One copy serves both orientations (forward and dgrad): a block's
  scale is the same whichever way the GEMM contracts it.
- :func:`blockwise_mm`: ``a @ w^T`` (``contract_last``) or ``a @ w`` per group of rows (int32 end offsets, w
  (E, P, Q)), or dense (no offsets, w (P, Q)).

The torch twins dequantize and multiply in fp32: they are the recipe's emulated path too (layers/fp8.py).
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.fp8_quant import _outputs, _quantize_torch, quantize_rows

BLOCK = 128


def _check_multiple(what: str, size: int) -> None:
    if size % BLOCK:
        raise ValueError(f"blockwise FP8 needs {what} a multiple of {BLOCK}, got {size}")


def quantize_tiles_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, K = x.shape
    _check_multiple("the quantized rows' length", K)
    q, scale = _quantize_torch(x.reshape(*lead, K // BLOCK, BLOCK), -1)
    return q.reshape(x.shape), scale


def quantize_tiles(x: torch.Tensor, rows_bound: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): x (..., M, K) quantized per 1x128 tile of its last dimension; q contiguous like x, scales
    (..., M, K / 128) float32. ``rows_bound`` (a device int tensor of one element): rows of x (viewed as (rows,
    K)) from it on are left unwritten on CUDA (the twin writes them)."""
    *lead, K = x.shape
    _check_multiple("the quantized rows' length", K)
    if not x.is_cuda:
        return quantize_tiles_torch(x)
    tiles = x.contiguous().view(-1, BLOCK)
    bound = None if rows_bound is None else rows_bound * (K // BLOCK)
    q, scale = quantize_rows(tiles, rows_bound=bound)
    return q.view(x.shape), scale.view(*lead, K // BLOCK)


def _blocks_view(w: torch.Tensor) -> torch.Tensor:
    """w (..., P, Q) as (..., P / 128, Q / 128, 128 * 128): each block's values in one row."""
    *lead, P, Q = w.shape
    _check_multiple("every weight dimension", P)
    _check_multiple("every weight dimension", Q)
    return (w.reshape(*lead, P // BLOCK, BLOCK, Q // BLOCK, BLOCK).transpose(-3, -2)
            .reshape(*lead, P // BLOCK, Q // BLOCK, BLOCK * BLOCK))


def quantize_blocks(w: torch.Tensor, q_out: torch.Tensor | None = None,
                    scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): w (..., P, Q) quantized per 128x128 block; q contiguous like w, scales (..., P / 128,
    Q / 128) float32; into the given outputs when given (a cached copy refreshed in place)."""
    *lead, P, Q = w.shape
    blocks = _blocks_view(w)
    q, scale = _outputs(tuple(w.shape), (*lead, P // BLOCK, Q // BLOCK), w, q_out, scale_out)
    q_blocks, scale_new = _quantize_torch(blocks, -1)
    q.copy_(q_blocks.reshape(*lead, P // BLOCK, Q // BLOCK, BLOCK, BLOCK).transpose(-3, -2).reshape(w.shape))
    scale.copy_(scale_new)
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


def blockwise_mm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 contract_last: bool, offsets_E: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ w^T`` (``contract_last``) or ``a @ w`` in blockwise FP8: a (M, K) E4M3 with scales (M, K / 128)
    (a view with stride 0 along the second dimension takes rows quantized with one scale each); w (P, Q), or
    (E, P, Q) with ``offsets_E`` (int32 end offsets of each group's rows), E4M3 with scales (..., P / 128,
    Q / 128). Out (M, P or Q) in ``out_dtype``; rows past the last offset are not computed."""
    return blockwise_mm_torch(a_q, a_scale, w_q, w_scale, contract_last, offsets_E, out_dtype)
