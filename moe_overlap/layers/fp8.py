"""FP8 GEMMs (``train.fp8_recipe``), E4M3 operands, bf16 out.

- rowwise: one float32 scale per row of the left operand and per column of the right one (kernels/fp8_quant.py),
  through torch's scaled GEMMs: ``torch._scaled_mm`` for the dense linears, ``torch._scaled_grouped_mm`` for the
  experts (rows grouped by int32 end offsets). Both need the right operand column-major and every weight
  dimension a multiple of 16.
- blockwise: one scale per 1x128 tile of an activation row and per 128x128 block of a weight
  (kernels/fp8_blockwise.py, its Triton GEMM for the experts and the linears). Every dimension a multiple of 128.
  The dgrad reads a transposed copy of the weight's blocks (the same values and scales, transposed): FP8 tensor
  cores read only operands laid out along the contraction, and the GEMM transposing each tile itself ran 5-6x
  slower (``step_kernels_fp8_blockwise_1xh100.json``).

What runs in FP8: the forward GEMMs, the input-gradient (dgrad) GEMMs and, under ``train.fp8_wgrad``, the
experts' weight-gradient GEMMs. Rows that crossed the FP8 dispatch reach the experts' first GEMM as they crossed
(:class:`Fp8Rows`: their E4M3 bytes and scales, not dequantized and quantized again); its weight gradient reads
them dequantized. The experts' FP8 weight gradients (:func:`fp8_wgrad`) are a Triton kernel in both recipes
(kernels/fp8_wgrad.py): each operand quantized along the tokens (the contraction), per column of each group
(rowwise) or per 128 tokens (blockwise), summed in fp32 per 128 tokens and added in place into the fp32
``main_grad``. torch 2.11's rowwise scaled GEMMs cannot: they give only bf16 outputs (a bf16 gradient, then a
second pass over the fp32 main_grad), and their grouped 2D x 2D form needs every expert's rows padded to a
multiple of 16, which the exchange does not do. The other weight gradients (the dense linears', and the experts'
with the wgrad off) are bf16 GEMMs that accumulate in fp32 into ``main_grad`` (layers/wgrad.py).

Weights are quantized once per optimizer step, not per micro-batch: each weight's FP8 copy (one per orientation,
the forward's and the dgrad's) is cached on the parameter and refreshed in place when stale: after an optimizer
step (the optimizers call :func:`weights_updated`; they write through ``param.data`` or flat buffers, which leave
``param._version`` alone), after an in-place write through the parameter (its ``_version``) or a move of its
storage. A run of a parameter's matrices (the MoE pipeline's chunk of experts) is served as a slice of the whole
parameter's copy (every scale is per matrix), so a weight has one copy per orientation, quantized once a step,
however the chunks split it; another view caches its own copy on the parameter. A stale rowwise copy whose
other orientation is cached and stale too is refreshed with it by one kernel, which reads the weight twice, not
four times (:func:`quantize_rows_and_columns`; not where TP shares the scales). Graphed MoE layers: the
capture reads the cached copies that the eager warm-up made (no quantize kernel in the graph: the weights are
still quantized once per step, not per replay), and the layer's forward pre-hook (:func:`refresh_weights`, which
the model installs after the capture) refreshes them in place before a replay.

Under ``train.fp8_param`` a weight whose GEMMs run in FP8 is held only as its FP8 copies: they live in the storage of
its bf16 values, which nothing reads any more (both its GEMMs are FP8: :meth:`Fp8.covers`), the forward's
orientation in the first half of its bytes, the dgrad's in the second, 1 byte an element each. The copies are
quantized from the optimizer's fp32 master, rounded to bf16 by the quantize kernels as they read it: bit for bit
the copies of the bf16 weight the optimizer no longer writes (``ParamInfo.fp8_master``; the optimizer sets it and
reads ``ParamInfo.holds_fp8``). Rowwise, the optimizer's step leaves the new weights' row and column maxima
(:func:`step_maxima`, kernels/adamw.py) while it has them in hand, so the refresh of the two copies reads the fp32
master once (the second pass), where the bf16 weight was read twice.

Tensor parallelism: where a linear's contraction is split over the TP ranks (the row-parallel forward, the
column-parallel dgrad; under expert-TP the experts' fc2 forward and fc1 dgrad, over ``Fp8.expert_tp``), each rank
holds part of every row being quantized. ``split_over`` shares the rowwise
scales over them (an all-reduce of the maxima between the quantize kernels' two passes), so that each rank's part
is quantized as one process quantizes the whole and the partial products sum to its product. Blockwise needs
nothing shared: each rank's part of a dimension is a multiple of 128, so every tile and block lies on one rank and
is the one process's.

The emulated path (``Fp8(emulate=True)``: the same quantization, then fp32 GEMMs of the dequantized operands)
is the reference the tests compare with, and the only FP8 path on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from moe_overlap.config.rules import FP8_NEEDS_GPU
from moe_overlap.config.schema import ConfigError
from moe_overlap.distributed.collectives import start_all_reduce
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.distributed.ring import Gemm, Pending
from moe_overlap.distributed.streams import exposed_kind
from moe_overlap.kernels.adamw import WeightMaxima
from moe_overlap.kernels.fp8_blockwise import (BLOCK, blockwise_mm, blockwise_mm_torch, dequantize_tiles,
                                               quantize_blocks, quantize_tiles)
from moe_overlap.kernels.fp8_quant import (FP8, column_amax, dequantize, dequantize_rows, quantize_columns,
                                           quantize_rows, quantize_rows_and_columns, row_amax)
from moe_overlap.kernels.fp8_wgrad import fp8_wgrad_accumulate, fp8_wgrad_accumulate_torch, quantize_along_tokens
from moe_overlap.layers.param_info import param_info


@dataclass(frozen=True)
class Fp8:
    """How a layer's GEMMs run in FP8: the recipe (``train.fp8_recipe``), on FP8 tensor cores or emulated (fp32
    GEMMs of dequantized operands)."""

    emulate: bool = False
    recipe: Literal["rowwise", "blockwise"] = "rowwise"
    wgrad: bool = True  # train.fp8_wgrad: the experts' weight gradients in FP8 too (False: bf16 GEMMs)
    min_dim: int = 0  # train.fp8_gemm_min_dim: narrower forward / dgrad GEMMs stay bf16 (0: none)
    fast_dgrad: bool = False  # train.fp8_dgrad_accumulation=fast: rowwise input gradients accumulate as the forward
    # expert-TP (set by GroupedExperts): the group each expert's FFN dimension is split over, along which fc2's
    # forward and fc1's dgrad contract, so their rowwise scales are shared over it (as tensor parallelism's)
    expert_tp: GroupHandle | None = field(default=None, compare=False)

    def covers(self, contraction: int, out_width: int) -> bool:
        """Whether a forward or input-gradient GEMM of this contraction and output width runs in FP8."""
        return min(contraction, out_width) >= self.min_dim


@dataclass(frozen=True)
class Fp8Rows:
    """A GEMM's left operand already in E4M3 with float32 scales, fed to the FP8 GEMM as it is, not dequantized and
    quantized again: one scale per row (the FP8 dispatch's rows, expanded to the experts' grouped rows:
    overlap.moe_dispatch_dtype=fp8; the rowwise recipe's rows from the permutation and SwiGLU), or one per 1x128
    tile (the blockwise recipe's from SwiGLU). ``dtype``: the activations' (the GEMM's output, and what the weight
    gradient reads them as: :meth:`dequantized`)."""

    q_RK: torch.Tensor  # unit column stride; the received rows' views and SwiGLU's rows over h are strided
    scales: torch.Tensor  # (R,) a row, or (R, K / 128) a tile
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q_RK.shape

    @property
    def device(self) -> torch.device:
        return self.q_RK.device

    def __getitem__(self, rows: slice) -> Fp8Rows:
        """A block of the rows with their scales (a TP ring multiplies them a block at a time)."""
        return Fp8Rows(self.q_RK[rows], self.scales[rows], self.dtype)

    def dequantized(self, rows_bound: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' values in ``dtype`` (rows from ``rows_bound`` on left unwritten: no GEMM reads them; with tile
        scales, the twin's arithmetic, every row)."""
        if self.scales.dim() == 2:
            return dequantize_tiles(self.q_RK, self.scales).to(self.dtype)
        return dequantize_rows(self.q_RK, self.scales, self.dtype, rows_bound)


_generation = 0  # bumped by every optimizer step: every cached FP8 weight is stale


def weights_updated(with_maxima: Iterable[torch.Tensor] = ()) -> None:
    """The optimizers' call after they wrote new weights (a step, a checkpoint load); ``with_maxima``: the
    parameters whose :func:`step_maxima` the step filled (they are the new weights')."""
    global _generation
    _generation += 1
    for param in with_maxima:
        param.__dict__["fp8_maxima"].state = _state(param)


@dataclass
class _StepMaxima:
    record: WeightMaxima
    state: tuple[int, int, int] | None = None  # the parameter's state (_state) the maxima are of


def step_maxima(param: torch.Tensor) -> WeightMaxima | None:
    """Under train.fp8_param, rowwise: where the optimizer's step leaves the parameter's new row and column maxima
    (kernels/adamw.py), so that the refresh of its two copies reads the master once, not twice (their first pass
    made by the step, which has the values in hand). None where no pair of copies would read them (blockwise,
    scales shared over tensor-parallel ranks, a parameter that holds no copies)."""
    cache = param.__dict__.get("fp8_cache", {})
    if not param_info(param).holds_fp8 or not any(
            layout == "rows" and entry.split_over is None and cache.get(("columns", view)) is not None
            for (layout, view), entry in cache.items()):
        return None
    if "fp8_maxima" not in param.__dict__:
        M, K = param.shape[-2:]
        B = param.numel() // (M * K)
        buffers = torch.zeros(B * (M + K), dtype=torch.float32, device=param.device)
        param.__dict__["fp8_maxima"] = _StepMaxima(WeightMaxima(buffers[:B * M], buffers[B * M:], param.dtype))
    return param.__dict__["fp8_maxima"].record


def _maxima_of_view(param: torch.Tensor, view: tuple[torch.Size, tuple[int, ...], int],
                    state: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step's maxima of a view of ``param`` ((..., M), (..., K)) if they are of its weights at ``state`` (its
    current one) and the view is a run of whole matrices, else None."""
    maxima = param.__dict__.get("fp8_maxima")
    shape, stride, offset = view
    M, K = param.shape[-2:]
    if maxima is None or maxima.state != state or not _whole_matrices(param, shape, stride, offset):
        return None
    first, count = offset // (M * K), math.prod(shape[:-2])
    record = maxima.record
    return (record.rows_BM[first * M:(first + count) * M].view(*shape[:-2], M),
            record.columns_BK[first * K:(first + count) * K].view(*shape[:-2], K))


def _whole_matrices(param: torch.Tensor, shape: torch.Size, stride: tuple[int, ...], offset: int) -> bool:
    """Whether a view (shape, stride, element offset) of a contiguous parameter is a run of its whole matrices."""
    expected, contiguous = 1, True
    for size, step in reversed(list(zip(shape, stride))):
        contiguous &= size == 1 or step == expected
        expected *= size
    return (param.dim() >= 2 and param.is_contiguous() and contiguous and tuple(shape[-2:]) == tuple(param.shape[-2:])
            and offset % param.shape[-2:].numel() == 0)


@dataclass
class _CachedWeight:
    state: tuple[int, int, int]  # (_generation, the parameter's _version, its data_ptr) it was made at
    view: tuple[torch.Size, tuple[int, ...], int]  # the quantized view: shape, strides, offset in the parameter
    q: torch.Tensor
    scale: torch.Tensor
    split_over: GroupHandle | None = None  # the ranks that share its contraction dimension (their scales shared)


# How a cached copy is quantized: rowwise per row of w (the contraction along w's last dimension) or per column
# (along its dim -2, written transposed); blockwise per 128x128 block, as w or written transposed. Every copy has
# the GEMM's contraction along its last dimension.
Layout = Literal["rows", "columns", "blocks", "blocks_t"]
_QUANTIZE = {"rows": quantize_rows, "columns": quantize_columns, "blocks": quantize_blocks,
             "blocks_t": partial(quantize_blocks, transpose=True)}
_ROWWISE_PARTNER = {"rows": "columns", "columns": "rows"}  # the copies quantize_rows_and_columns makes together


def _layout(contract_last: bool, recipe: str) -> Layout:
    if recipe == "blockwise":
        return "blocks" if contract_last else "blocks_t"
    return "rows" if contract_last else "columns"


def _state(param: torch.Tensor) -> tuple[int, int, int]:
    return _generation, param._version, param.data_ptr()


def _start_shared_quantization(x: torch.Tensor, dim: int, split_over: GroupHandle,
                               as_dtype: torch.dtype | None = None) -> Pending:
    """x quantized along ``dim``, which ``split_over``'s ranks each hold a part of: each scale from the largest
    value on any of them (one all-reduce of the maxima), so every rank quantizes its part as one process would
    quantize the whole: the row (column) kernel's two passes with the all-reduce between them. Started: the
    maxima cross until ``wait()``, which quantizes and gives (q, scale). A collective of the same group started
    before that wait queues behind the maxima on the group's stream, so the two wait out the ranks' skew once.
    ``as_dtype``: x's values rounded to it first (a master weight, :class:`_Source`)."""
    amax = row_amax(x, as_dtype=as_dtype) if dim == -1 else column_amax(x, as_dtype=as_dtype)
    work = start_all_reduce(amax, split_over.group, dist.ReduceOp.MAX)
    quantize = quantize_rows if dim == -1 else quantize_columns
    return Pending(work=work, kind=exposed_kind(split_over.group),
                   complete=lambda: quantize(x, amax=amax, as_dtype=as_dtype))


def _shared_quantization(x: torch.Tensor, dim: int, split_over: GroupHandle,
                         as_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _start_shared_quantization(x, dim, split_over, as_dtype).wait()


@dataclass(frozen=True)
class _Source:
    """What a weight's FP8 copies are quantized from: the weight (a view of a parameter), or under train.fp8_param
    the same view of the parameter's fp32 master, read as ``as_dtype`` (the weight's: the kernels round each value
    to it as they read it), so the copies are the bf16 weight's bit for bit."""

    values: torch.Tensor
    as_dtype: torch.dtype | None = None

    @staticmethod
    def of(w: torch.Tensor, param: torch.Tensor) -> _Source:
        master = param_info(param).fp8_master
        if master is None:
            return _Source(w.detach())
        offset = w.storage_offset() - param.storage_offset()  # the master is laid out as the parameter
        return _Source(master.as_strided(w.shape, w.stride(), master.storage_offset() + offset), w.dtype)


CopyOut = tuple[torch.Tensor | None, torch.Tensor | None]  # (q, scale) to write into, or None for new ones


def _quantize_weight(source: _Source, layout: Layout, out: CopyOut = (None, None),
                     split_over: GroupHandle | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's copy in ``layout``, written into ``out`` (q, scale) where given (in place: a graph may hold
    them)."""
    if split_over is None or layout.startswith("blocks"):  # a block lies on one rank: nothing to share
        return _QUANTIZE[layout](source.values, *out, as_dtype=source.as_dtype)
    q, scale = _shared_quantization(source.values, -1 if layout == "rows" else -2, split_over, source.as_dtype)
    q_out, scale_out = out
    return q if q_out is None else q_out.copy_(q), scale if scale_out is None else scale_out.copy_(scale)


def _place_in_param(param: torch.Tensor, layout: Layout, w: torch.Tensor) -> torch.Tensor | None:
    """Under train.fp8_param, where the copy of ``w`` (a view of ``param``) in ``layout`` lives in the parameter's
    own storage: the forward's orientation in the first half of its bytes, the dgrad's in the second, at w's element
    offset (see the module docstring); the parameter is marked as holding FP8 copies from then on. None (the copy
    gets memory of its own) without train.fp8_param, or where w is not a run of whole matrices of a contiguous
    2-byte parameter."""
    info = param_info(param)
    offset = w.storage_offset() - param.storage_offset()
    if info.fp8_master is None or param.element_size() != 2 or not _whole_matrices(param, w.shape, w.stride(), offset):
        return None
    second_half = layout in ("columns", "blocks_t")
    start = 2 * param.storage_offset() + (param.numel() if second_half else 0) + offset  # in bytes
    if start % 16:  # the scaled GEMMs' operands are 16-byte aligned
        return None
    shape = (*w.shape[:-2], w.shape[-1], w.shape[-2]) if second_half else tuple(w.shape)
    info.holds_fp8 = True
    return torch.empty(0, dtype=FP8, device=param.device).set_(param.untyped_storage(), start, shape)


def _refresh(w: torch.Tensor, param: torch.Tensor, layout: Layout, entry: _CachedWeight,
             split_over: GroupHandle | None) -> None:
    """Quantize w (a view of ``param``) into its stale cached copy, in place; with it the other rowwise orientation
    of the same view, if cached and stale too: both from one kernel."""
    cache, state, source = param.__dict__["fp8_cache"], _state(param), _Source.of(w, param)
    partner = cache.get((_ROWWISE_PARTNER.get(layout), entry.view))
    if split_over is None and partner is not None and partner.split_over is None and partner.state != state:
        rows, columns = (entry, partner) if layout == "rows" else (partner, entry)
        quantize_rows_and_columns(source.values, (rows.q, rows.scale), (columns.q, columns.scale),
                                  as_dtype=source.as_dtype, amax=_maxima_of_view(param, entry.view, state))
        partner.state = state
    else:
        _quantize_weight(source, layout, (entry.q, entry.scale), split_over)
    entry.state = state


def _view_of(w: torch.Tensor, param: torch.Tensor) -> tuple[torch.Size, tuple[int, ...], int]:
    """The cache's key for a view of ``param``: its shape, strides and element offset in the parameter."""
    return w.shape, w.stride(), w.storage_offset() - param.storage_offset()


def _matrices_run(w: torch.Tensor, param: torch.Tensor) -> slice | None:
    """Which of a batched parameter's matrices ``w`` is, where it is a run of them along the first dimension (the
    MoE pipeline's chunk of experts, the overflow chunk's all of them) and not the parameter itself; else None.
    Every scale is per matrix, so such a run's copy is the same slice of the whole parameter's."""
    if w is param or param.dim() < 3 or w.dim() != param.dim() or w.shape[1:] != param.shape[1:]:
        return None
    _, stride, offset = _view_of(w, param)
    if not _whole_matrices(param, w.shape, stride, offset):
        return None
    first = offset // param.shape[1:].numel()
    return slice(first, first + w.shape[0])


def weight_operand(w: torch.Tensor, contract_last: bool, split_over: GroupHandle | None = None,
                   recipe: str = "rowwise") -> tuple[torch.Tensor, torch.Tensor]:
    """A weight (or a view of one: a run of experts) as the right operand B (K, N) of ``a @ B``, per matrix:
    B = w^T when ``contract_last`` (the contraction runs along w's last dimension), else B = w. rowwise: returns
    (q (..., N, K) contiguous, so that ``q.transpose(-2, -1)`` is B column-major; scales (..., N), one per
    column of B); blockwise: (q = B^T contiguous, its 128x128 blocks' scales (..., N / 128, K / 128)). From the
    parameter's cache (see the module docstring). ``split_over``: the ranks that each hold part of the contraction
    (a tensor-parallel weight): the rowwise scales are the whole dimension's."""
    param = w if w._base is None else w._base
    cache: dict = param.__dict__.setdefault("fp8_cache", {})
    layout, view = _layout(contract_last, recipe), _view_of(w, param)
    capturing = w.is_cuda and torch.cuda.is_current_stream_capturing()
    run = _matrices_run(w, param)
    if run is not None:  # a run of whole matrices: a slice of the whole weight's copy, current or made so
        whole = cache.get((layout, _view_of(param, param)))
        if not capturing or (whole is not None and whole.state == _state(param)):
            q, scale = weight_operand(param, contract_last, split_over, recipe)
            return q[run], scale[run]
    entry = cache.get((layout, view))
    if entry is not None and entry.state == _state(param):
        return entry.q, entry.scale
    if capturing:  # stale at capture: quantize inside the graph
        return _quantize_weight(_Source.of(w, param), layout, split_over=split_over)
    if entry is None:  # the first use: this orientation alone
        q, scale = _quantize_weight(_Source.of(w, param), layout, (_place_in_param(param, layout, w), None),
                                    split_over)
        cache[(layout, view)] = _CachedWeight(_state(param), view, q, scale, split_over)
        return q, scale
    _refresh(w, param, layout, entry, split_over)
    return entry.q, entry.scale


def weight_copy_bytes(module: nn.Module, recipe: str = "rowwise", min_dim: int = 0, in_weights: bool = False) -> int:
    """The bytes of the FP8 copies a module's weights get once its GEMMs ran forward and backward: per weight
    matrix (N, K) an E4M3 copy in each orientation (2 N K bytes) and their float32 scales: rowwise one per column
    of the right operand (4 (N + K) bytes), blockwise one per 128x128 block in each copy. None for a weight
    narrower than ``min_dim`` (its GEMMs stay bf16: :meth:`Fp8.covers`). Biases stay in their dtype.
    ``in_weights`` (train.fp8_param): the E4M3 bytes live in the weights' own storage; the scales are more, and
    rowwise the optimizer step's maxima (:func:`step_maxima`: as many as the scales)."""
    total = 0
    for param in module.parameters(recurse=False):
        if param.dim() >= 2 and min(param.shape[-2:]) >= min_dim:
            *batch, n, k = param.shape
            scales = 2 * (n // BLOCK) * (k // BLOCK) if recipe == "blockwise" else n + k
            if in_weights:
                total += math.prod(batch) * 4 * scales * (2 if recipe == "rowwise" else 1)
            else:
                total += math.prod(batch) * (2 * n * k + 4 * scales)
    return total


@torch.no_grad()
def refresh_weights(module: nn.Module, *_) -> None:
    """Refresh, in place, the stale FP8 copies of ``module``'s weights (a forward pre-hook of a graphed layer,
    whose replays read the copies without running Python)."""
    for param in module.parameters():
        for (layout, (shape, stride, offset)), entry in param.__dict__.get("fp8_cache", {}).items():
            if entry.state != _state(param):  # (a rowwise partner refreshed along with an earlier entry is not)
                w = param.as_strided(shape, stride, param.storage_offset() + offset)
                _refresh(w, param, layout, entry, entry.split_over)


def _out_width(w: torch.Tensor, contract_last: bool) -> int:
    """The width of ``a @ B`` where B = w^T if ``contract_last`` else w."""
    return w.shape[-2] if contract_last else w.shape[-1]


def fp8_matmul(a_MK: torch.Tensor | Fp8Rows, w: torch.Tensor, contract_last: bool, fp8: Fp8,
               offsets_E: torch.Tensor | None = None, fast_accum: bool = False,
               split_over: GroupHandle | None = None) -> torch.Tensor:
    """``a @ B`` in FP8 (B = w^T if ``contract_last`` else w: see :func:`weight_operand`), in a's dtype. With
    ``offsets_E`` (int32 end offsets of each group's rows; w (E, ., .)): group e's rows times B[e]; rows past the
    last offset are neither quantized nor computed. ``a`` as :class:`Fp8Rows`: taken as it is. ``fast_accum``
    (rowwise): cuBLAS's faster, less exact FP8 accumulation (the forward's, as Transformer Engine and torchao; the
    input gradients accumulate exactly unless ``fp8.fast_dgrad``; blockwise always sums each 128-deep slice
    exactly). ``split_over``: the ranks that each hold part of the contraction (a tensor-parallel linear's partial
    product): a's and B's rowwise scales are shared over them, so the partial products sum to the one process's."""
    if not fp8.covers(a_MK.shape[-1], _out_width(w, contract_last)):
        return _bf16_matmul(a_MK, w, contract_last, offsets_E)
    if fp8.recipe == "blockwise":
        return _blockwise_matmul(a_MK, w, contract_last, fp8, offsets_E)
    b_q, b_scale = weight_operand(w, contract_last, split_over)
    if isinstance(a_MK, Fp8Rows):
        a_q, a_scale, dtype = a_MK.q_RK, a_MK.scales, a_MK.dtype
    elif split_over is not None:
        a_q, a_scale = _shared_quantization(a_MK, -1, split_over)
        dtype = a_MK.dtype
    else:
        a_q, a_scale = quantize_rows(a_MK, rows_bound=None if offsets_E is None else offsets_E[-1:])
        dtype = a_MK.dtype
    if a_q.shape[0] == 0:  # no rows (an EP rank no token chose): nothing to multiply
        return torch.empty((0, b_q.shape[-2]), dtype=dtype, device=a_q.device)
    if fp8.emulate:
        return _emulated(a_q, a_scale, b_q, b_scale, offsets_E).to(dtype)
    fast_accum = fast_accum or fp8.fast_dgrad
    if offsets_E is None:
        return torch._scaled_mm(a_q, b_q.t(), a_scale[:, None], b_scale[None, :], out_dtype=dtype,
                                use_fast_accum=fast_accum)
    return torch._scaled_grouped_mm(a_q, b_q.transpose(-2, -1), a_scale, b_scale, offs=offsets_E, out_dtype=dtype,
                                    use_fast_accum=fast_accum)


def fp8_gemm(w: torch.Tensor, contract_last: bool, fp8: Fp8, fast_accum: bool = False,
             split_over: GroupHandle | None = None) -> Gemm:
    """:func:`fp8_matmul` by w as a :class:`~moe_overlap.distributed.ring.Gemm`: what the tensor-parallel linears
    hand their gathers and scatters, serial or pipelined, so FP8 runs beside the same overlaps as bf16. A ring takes
    the rows a block at a time: rowwise, each row's scale is its own, so a block's product is the whole's; where the
    contraction is split, quantize the rows once first (:func:`start_split_contraction_rows`)."""
    def product(a_MK: torch.Tensor | Fp8Rows, out: torch.Tensor | None) -> torch.Tensor:
        y = fp8_matmul(a_MK, w, contract_last, fp8, fast_accum=fast_accum, split_over=split_over)
        return y if out is None else out.copy_(y)

    return Gemm(_out_width(w, contract_last), product)


def start_split_contraction_rows(a_MK: torch.Tensor, w: torch.Tensor, contract_last: bool, fp8: Fp8,
                                 split_over: GroupHandle | None) -> Pending:
    """a's rows for a rowwise FP8 GEMM whose contraction ``split_over``'s ranks each hold a part of, quantized once
    with their scales shared over those ranks: a ring's ranks multiply different blocks of rows at each hop, so no
    block could share its own. ``a`` itself where the GEMM quantizes nothing shared (blockwise: a tile lies on one
    rank; no split; a GEMM that train.fp8_gemm_min_dim leaves bf16). Started: ``wait()`` gives the rows, their
    maxima crossing until then (:func:`_start_shared_quantization`)."""
    if fp8.recipe != "rowwise" or split_over is None or not fp8.covers(a_MK.shape[-1], _out_width(w, contract_last)):
        return Pending(a_MK)
    quantizing = _start_shared_quantization(a_MK, -1, split_over)
    return Pending(complete=lambda: Fp8Rows(*quantizing.wait(), a_MK.dtype))


def _bf16_matmul(a_MK: torch.Tensor | Fp8Rows, w: torch.Tensor, contract_last: bool,
                 offsets_E: torch.Tensor | None) -> torch.Tensor:
    """``a @ B`` without FP8 (B as :func:`fp8_matmul` reads w; grouped with ``offsets_E``): the layers' GEMMs
    outside train.fp8_recipe, and those ``train.fp8_gemm_min_dim`` leaves in bf16 (rows that crossed as FP8
    dequantized first)."""
    if isinstance(a_MK, Fp8Rows):
        a_MK = a_MK.dequantized(None if offsets_E is None else offsets_E[-1:])
    b = w.transpose(-2, -1) if contract_last else w
    return a_MK @ b if offsets_E is None else torch._grouped_mm(a_MK, b, offs=offsets_E)


def _blockwise_matmul(a_MK: torch.Tensor | Fp8Rows, w: torch.Tensor, contract_last: bool, fp8: Fp8,
                      offsets_E: torch.Tensor | None) -> torch.Tensor:
    """:func:`fp8_matmul` in the blockwise recipe, against the weight's copy laid out along the contraction. Rows
    that crossed the FP8 dispatch carry one scale per row: the GEMM reads it as each of the row's tiles' (a
    stride-0 view, no copy); rows from SwiGLU carry their tiles' own."""
    b_q, b_scale = weight_operand(w, contract_last, recipe="blockwise")
    if isinstance(a_MK, Fp8Rows):
        a_q, a_scale, dtype = a_MK.q_RK, a_MK.scales, a_MK.dtype
        if a_scale.dim() == 1:
            a_scale = a_scale[:, None].expand(-1, a_q.shape[1] // BLOCK)
    else:
        a_q, a_scale = quantize_tiles(a_MK, rows_bound=None if offsets_E is None else offsets_E[-1:])
        dtype = a_MK.dtype
    gemm = blockwise_mm_torch if fp8.emulate else blockwise_mm
    return gemm(a_q, a_scale, b_q, b_scale, True, offsets_E, dtype)


def _emulated(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
              offsets_E: torch.Tensor | None) -> torch.Tensor:
    """The scaled GEMM's math in fp32 (a host loop over the groups: a reference, not a fast path)."""
    a, b_NK = dequantize(a_q, a_scale), dequantize(b_q, b_scale)
    if offsets_E is None:
        return a @ b_NK.t()
    out = a.new_zeros((a.shape[0], b_NK.shape[-2]))
    start = 0
    for group, end in enumerate(offsets_E.tolist()):
        out[start:end] = a[start:end] @ b_NK[group].t()
        start = end
    return out


def grouped_mm(a_TK: torch.Tensor | Fp8Rows, w: torch.Tensor, offsets_E: torch.Tensor, fp8: Fp8 | None,
               transpose_w: bool = False, fast_accum: bool = False, split: bool = False) -> torch.Tensor:
    """Each group's rows times w[e] (or w[e]^T): torch._grouped_mm, or in FP8 under ``fp8`` (which takes
    :class:`Fp8Rows` too). ``split``: the contraction is the experts' FFN dimension, split over ``fp8.expert_tp``
    (the rowwise scales shared over it)."""
    if fp8 is None:
        return _bf16_matmul(a_TK, w, transpose_w, offsets_E)
    # a @ w[e] contracts along w's dim -2; a @ w[e]^T along its last
    return fp8_matmul(a_TK, w, transpose_w, fp8, offsets_E, fast_accum, fp8.expert_tp if split else None)


def fp8_wgrad(segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], out_EMN: torch.Tensor,
              fp8: Fp8) -> None:
    """out_EMN[e] (fp32) += the sum over ``segments`` ((a_TM, b_TN, int32 end offsets per group): one micro-batch's
    rows, or two) of a_e^T @ b_e in FP8: a weight gradient (kernels/fp8_wgrad.py). Both operands quantized along
    the tokens, per group (rowwise: the group's rows share each column's scale) or per 128 tokens (blockwise:
    DeepSeek-V3's 128x1 tiles); each 128-token chunk's product summed in fp32."""
    per_chunk = fp8.recipe == "blockwise"
    quantized = [(quantize_along_tokens(a_TM, offsets_E, per_chunk), quantize_along_tokens(b_TN, offsets_E, per_chunk))
                 for a_TM, b_TN, offsets_E in segments]
    if fp8.emulate:
        fp8_wgrad_accumulate_torch(quantized, out_EMN)
    else:
        fp8_wgrad_accumulate(quantized, out_EMN, per_chunk)


def check_fp8_device(device: torch.device, recipe: str = "rowwise") -> None:
    """FP8 tensor cores and torch's scaled grouped GEMM: compute capability 9.0 (Hopper) or newer (asked of the GPU
    itself, so once the ranks run; torch._scaled_mm alone would take 8.9, its grouped twin needs 9.0)."""
    if device.type != "cuda":
        raise ConfigError("train.fp8_recipe", recipe, f"{FP8_NEEDS_GPU}; the device is {device.type!r}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        raise ConfigError("train.fp8_recipe", recipe,
                          f"{FP8_NEEDS_GPU}; {torch.cuda.get_device_name(device)} has compute capability "
                          f"{capability[0]}.{capability[1]}")
