"""FP8 on CPU (train.fp8_recipe=rowwise): the quantize kernels' torch twins (and the Triton kernels under the
interpreter, within its known FP8 rounding faults), the weights' FP8 cache, the emulated FP8 GEMMs against fp32
(each within 0.05 normwise), a model with emulated FP8 at EP=2 against one process with the same emulation, and
the config's refusals. The real FP8 GEMMs and the Triton kernels' exactness are in tests/test_gpu_fp8.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from moe_overlap.config import ConfigError, load_config, validate_for_world
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.distributed.ring import TPComm
from moe_overlap.kernels.swiglu import swiglu_backward
from moe_overlap.kernels.fp8_quant import (AMAX_FLOOR, FP8, FP8_MAX, column_amax, dequantize, dequantize_rows,
                                           quantize_along_torch, quantize_columns, quantize_columns_torch,
                                           quantize_rows, quantize_rows_and_columns, quantize_rows_torch, row_amax)
from moe_overlap.layers import fp8 as fp8_layers
from moe_overlap.layers.experts import GroupedSwiGLU, expert_offsets, experts_wgrad, WgradInputs
from moe_overlap.layers.fp8 import (Fp8, Fp8Rows, check_fp8_device, fp8_matmul, grouped_mm, refresh_weights,
                                    weight_copy_bytes, weight_operand, weights_updated)
from moe_overlap.layers.param_info import param_info
from moe_overlap.layers.tp_linear import ColumnParallelLinear, RowParallelLinear
from moe_overlap.layers.wire_rows import copies_rows
from moe_overlap.training.trainer import Trainer
from moe_overlap.tuning import FP8_GEMM_MIN_DIM, FP8_GEMM_MIN_DIM_FAST
from tests.test_master import CPU, small_config, world_and_mesh

EMULATED = Fp8(emulate=True)
GEMM_TOL = 0.05  # an FP8 GEMM against fp32 (E4M3 keeps 3 mantissa bits: about 0.03 on normal data)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------- quantize twins


@pytest.mark.parametrize("shape", [(37, 200), (3, 16, 48)], ids=["2d", "3d"])
def test_fp8_rows_twin_round_trip_and_shapes(shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-2]).unsqueeze(-1)  # rows of very different ranges
    q, scale = quantize_rows_torch(x)
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    amax = x.abs().amax(-1)
    assert torch.allclose(scale, amax / FP8_MAX, rtol=1e-6)
    assert torch.equal(q.float().abs().amax(-1), torch.full_like(amax, FP8_MAX))  # each row's largest at 448
    back = dequantize(q, scale)
    # E4M3 rounds to nearest: half an ulp, 2^-4 relative for normals; subnormals (below 2^-6) step by 2^-9
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale.unsqueeze(-1) * 2.0 ** -10)
    assert ((back - x).abs() <= bound * 1.0001).all()
    assert rel_err(back, x) < 0.04


def test_fp8_columns_twin_is_the_rows_twin_of_the_transpose():
    torch.manual_seed(1)
    x = torch.randn(4, 40, 24)
    q, scale = quantize_columns_torch(x)
    q_rows, scale_rows = quantize_rows_torch(x.transpose(-2, -1))
    assert q.shape == (4, 24, 40) and q.is_contiguous() and scale.shape == (4, 24)
    assert torch.equal(q.view(torch.uint8), q_rows.view(torch.uint8)) and torch.equal(scale, scale_rows)
    assert rel_err(dequantize(q, scale).transpose(-2, -1), x) < 0.04


def test_fp8_zero_rows_and_saturation():
    x = torch.randn(4, 32)
    x[1] = 0
    x[2, 5] = 3e38  # one huge value: its row's scale follows it, nothing overflows
    q, scale = quantize_rows_torch(x)
    assert torch.equal(q[1].float(), torch.zeros(32)) and scale[1] == pytest.approx(AMAX_FLOOR / FP8_MAX)
    assert torch.isfinite(q.float()).all() and q[2, 5].float() == FP8_MAX
    # a row's largest value can land just past 448 in fp32 (x * (448 / amax) rounds up): it saturates to 448
    y = torch.tensor([[4.349596977233887, -1.0]])
    assert (y * (FP8_MAX / y.abs().amax())).max() > FP8_MAX
    q, scale = quantize_rows_torch(y)
    assert q[0, 0].float() == FP8_MAX


def test_fp8_twins_quantize_bf16_in_fp32_as_the_kernels():
    """A bf16 tensor's amax, inverse scale and products are fp32, as in the Triton kernels: rounding them to bf16
    moved scales and values off the kernels' on the GPU."""
    x = (torch.randn(6, 64, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    for quantize in (quantize_rows_torch, quantize_columns_torch):
        q, scale = quantize(x)
        q32, scale32 = quantize(x.float())
        assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(scale, scale32)
        assert scale.dtype == torch.float32


def test_fp8_twins_write_into_given_buffers():
    x = torch.randn(8, 32)
    q_out, scale_out = torch.empty(8, 32, dtype=FP8), torch.empty(8)
    q, scale = quantize_rows(x, q_out, scale_out)
    assert q is q_out and scale is scale_out and torch.equal(scale, quantize_rows_torch(x)[1])
    with pytest.raises(ValueError, match="contiguous"):
        quantize_columns(x, torch.empty(8, 32, dtype=FP8), torch.empty(32))  # the transposed shape is (32, 8)


def assert_twin_but_interpreter_faults(q: torch.Tensor, q_twin: torch.Tensor) -> None:
    """q from a kernel under TRITON_INTERPRET=1 equals the twin's but where the interpreter's own fp32 -> E4M3 cast
    is wrong, in two known ways: a value that rounds up into the next power of two keeps the old exponent;
    subnormals truncate instead of rounding. Exactly those elements are excused."""
    twin = q_twin.float().abs()
    interpreter_fault = (twin < 2.0 ** -6) | (torch.log2(twin) == torch.log2(twin).round())
    differs = q.float() != q_twin.float()
    assert not (differs & ~interpreter_fault).any(), int((differs & ~interpreter_fault).sum())
    assert differs.float().mean() < 0.2


def test_fp8_triton_kernels_under_the_interpreter(monkeypatch):
    """TRITON_INTERPRET=1 runs the kernels' indexing, masking and scales on CPU; q may be off by the interpreter's
    own E4M3 cast (:func:`assert_twin_but_interpreter_faults`). On GPU the kernels must equal the twin exactly."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(2)
    x = torch.randn(3, 37, 72) * 3
    x[0, 4] = 0
    cases = [(quantize_rows(x), quantize_rows_torch(x)), (quantize_columns(x), quantize_columns_torch(x))]
    for (q, scale), (q_twin, scale_twin) in cases:
        assert torch.equal(scale, scale_twin)
        assert_twin_but_interpreter_faults(q, q_twin)
    # rows_bound: rows from the bound on are left as they were
    bound = torch.tensor([20], dtype=torch.int32)
    q_out = torch.zeros(37, 72, dtype=FP8)
    scale_out = torch.full((37,), -1.0)
    quantize_rows(x[1], q_out, scale_out, rows_bound=bound)
    assert (scale_out[20:] == -1).all() and (q_out[20:].float() == 0).all()
    q_twin, scale_twin = quantize_rows_torch(x[1, :20])
    assert torch.equal(scale_out[:20], scale_twin)  # 3 programs striding over the 20 rows (kernels/fp8_quant.py)
    assert_twin_but_interpreter_faults(q_out[:20], q_twin)
    # dequantize_rows bounded: the rows below the bound (blocks of rows, 3 programs striding), the rest unwritten
    # (fp32 out: the interpreter's fp32 -> bf16 cast truncates)
    out = dequantize_rows(q_twin.repeat(3, 1), scale_twin.repeat(3), torch.float32,
                          rows_bound=torch.tensor([45], dtype=torch.int32))
    assert torch.equal(out[:45], dequantize(q_twin.repeat(3, 1)[:45], scale_twin.repeat(3)[:45]))


@pytest.mark.parametrize("dim", [-1, -2], ids=["rows", "columns"])
def test_fp8_scales_from_a_shared_amax_under_the_interpreter(monkeypatch, dim):
    """The row and column kernels' passes apart, for the scales ranks share (tensor and expert-TP): row_amax /
    column_amax is each row's / column's absolute maximum exactly; quantize_rows / quantize_columns from a given
    amax (here larger than x's own, as another rank's part may make it; and a row and a column of zeros) equals the
    twin's quantization with that amax (scales exactly; q but for the interpreter's E4M3 faults), on a 2-D x and on
    a weight's matrices."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(3)
    amax_of, quantize, twin = ((row_amax, quantize_rows, quantize_rows_torch) if dim == -1 else
                               (column_amax, quantize_columns, quantize_columns_torch))
    for x in (torch.randn(37, 72) * 3, torch.randn(3, 21, 70)):
        x[..., 4, :] = 0
        x[..., 6] = 0
        amax = amax_of(x)
        assert torch.equal(amax, x.abs().amax(dim))
        shared = amax * torch.rand(amax.shape).add(1.0)  # another rank's part held larger values on most of them
        q, scale = quantize(x, amax=shared)
        q_twin, scale_twin = twin(x, amax=shared)
        assert torch.equal(scale, scale_twin) and torch.equal(scale_twin, quantize_along_torch(x, dim, shared)[1])
        assert_twin_but_interpreter_faults(q, q_twin)


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("interpreted", [False, True])
@pytest.mark.parametrize("shape", [(3, 70, 200), (130, 96), (300, 260), (2, 64, 128), (2, 5, 3)])
def test_fp8_rows_and_columns_equal_the_two_quantizations(monkeypatch, interpreted, shape):
    """quantize_rows_and_columns: quantize_rows and quantize_columns of the same x in one call (2-D and 3-D, sizes
    that are not multiples of its tiles, 128 x 128 for the maxima and 64 x 64 to quantize, several of each along
    both dimensions; a matrix of zeros, a row and a column of zeros): the scales bit for bit. Through the twin
    (CPU, bf16 too) q bit for bit; interpreted (the Triton kernels, fp32: the interpreter's E4M3 cast) q equals the
    twins' but for the interpreter's known faults, and equals the two functions' own kernels, interpreted too, bit
    for bit."""
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(9)
    x = torch.randn(shape) * 3 * torch.logspace(-2, 2, shape[-1])  # columns of very different ranges
    x[..., 1, :] = 0
    x[..., 2] = 0
    if x.dim() == 3:
        x[-1] = 0  # a matrix of zeros: every scale the floor's, every value 0
    for x_in in (x,) if interpreted else (x, x.bfloat16()):
        (q_rows, scale_rows), (q_cols, scale_cols) = quantize_rows_and_columns(x_in)
        (q_rows_twin, scale_rows_twin), (q_cols_twin, scale_cols_twin) = (quantize_rows_torch(x_in),
                                                                          quantize_columns_torch(x_in))
        assert q_rows.shape == x.shape and q_cols.shape == (*x.shape[:-2], x.shape[-1], x.shape[-2])
        assert q_rows.is_contiguous() and q_cols.is_contiguous()
        assert torch.equal(scale_rows, scale_rows_twin) and torch.equal(scale_cols, scale_cols_twin)
        if interpreted:
            assert_twin_but_interpreter_faults(q_rows, q_rows_twin)
            assert_twin_but_interpreter_faults(q_cols, q_cols_twin)
            (q_rows_alone, _), (q_cols_alone, _) = quantize_rows(x_in), quantize_columns(x_in)
            assert same_fp8(q_rows, q_rows_alone) and same_fp8(q_cols, q_cols_alone)
        else:
            assert same_fp8(q_rows, q_rows_twin) and same_fp8(q_cols, q_cols_twin)
    if x.dim() == 3:
        assert (scale_rows[-1] == AMAX_FLOOR / FP8_MAX).all() and not q_cols[-1].float().any()


@pytest.mark.parametrize("interpreted", [False, True])
def test_fp8_rows_and_columns_write_into_given_buffers(monkeypatch, interpreted):
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(2, 70, 40, generator=torch.Generator().manual_seed(10))
    rows_out = torch.zeros(2, 70, 40, dtype=FP8), torch.zeros(2, 70)
    columns_out = torch.zeros(2, 40, 70, dtype=FP8), torch.zeros(2, 40)
    rows, columns = quantize_rows_and_columns(x, rows_out, columns_out)
    assert rows[0] is rows_out[0] and rows[1] is rows_out[1]
    assert columns[0] is columns_out[0] and columns[1] is columns_out[1]
    assert torch.equal(rows[1], quantize_rows_torch(x)[1]) and torch.equal(columns[1], quantize_columns_torch(x)[1])
    assert same_fp8(rows[0], quantize_rows(x)[0]) and same_fp8(columns[0], quantize_columns(x)[0])
    (q_rows, _), (q_cols, _) = quantize_rows_and_columns(x, columns_out=columns_out)  # one given, one new
    assert q_cols is columns_out[0] and same_fp8(q_rows, rows[0])
    with pytest.raises(ValueError, match="contiguous"):
        quantize_rows_and_columns(x, columns_out=rows_out)  # the columns' copy is transposed: (2, 40, 70)


@pytest.mark.parametrize("interpreted", [False, True])
def test_fp8_packed_rows_quantize_and_dequantize_in_place(monkeypatch, interpreted):
    """The FP8 dispatch's packing: a row's E4M3 bytes, then its float32 scale, written by quantize_rows through
    strided views and read back by dequantize_rows (one pass each, Triton when interpreted): the scales bit for
    bit, the values those of q * scale (rounded once to bf16 by the twin), and the bytes around them untouched."""
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(5)
    x = (torch.randn(9, 48) * 2).to(torch.bfloat16)
    rows = torch.full((9, 40), 7.0, dtype=torch.bfloat16)  # 80 bytes: 48 of q, 4 of scale, 28 left alone
    bytes_ = rows.view(torch.uint8)
    q, scale = bytes_[:, :48].view(FP8), bytes_[:, 48:52].view(torch.float32)[:, 0]
    quantize_rows(x, q, scale)
    q_twin, scale_twin = quantize_rows_torch(x)
    assert torch.equal(scale, scale_twin)
    assert (rows[:, 26:] == 7.0).all()
    dtype = torch.float32 if interpreted else torch.bfloat16  # the interpreter's fp32 -> bf16 cast truncates
    back = dequantize_rows(q, scale, dtype)
    assert back.dtype == dtype and back.shape == (9, 48)
    assert torch.equal(back, dequantize(q, scale).to(dtype))
    if not interpreted:  # the interpreter's own E4M3 cast may be off (test above); the twin's q is exact
        assert torch.equal(q.view(torch.uint8), q_twin.view(torch.uint8))
    with pytest.raises(ValueError, match="one scale per row"):
        dequantize_rows(q, scale[:4], torch.bfloat16)


@pytest.mark.parametrize("interpreted", [False, True])
def test_fp8_rows_reach_their_copies_as_fp8(monkeypatch, interpreted):
    """The FP8 dispatch's rows fed straight to an FP8 GEMM (wire_rows.copies_rows): each received row's E4M3 bytes
    and scale, read through the packed rows' strided views, land in its copies' grouped rows (contiguous, bit for
    bit; rows no copy maps to zero below the bound); dequantized for the weight gradient, up to the bound only."""
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(6)
    x = torch.randn(6, 32)
    q_W, scale_W = quantize_rows_torch(x)
    packed = torch.zeros(6, 12)  # 48 bytes a row: 32 of q, 4 of scale, 12 of padding
    packed.view(torch.uint8)[:, :32].view(FP8).copy_(q_W)
    packed.view(torch.uint8)[:, 32:36].view(torch.float32)[:, 0].copy_(scale_W)
    bytes_ = packed.view(torch.uint8)
    rows = Fp8Rows(bytes_[:, :32].view(FP8), bytes_[:, 32:36].view(torch.float32)[:, 0], torch.float32)
    grouped_WJ = torch.tensor([[0, 3], [1, -1], [2, 5], [4, -1], [6, -1], [-1, -1]], dtype=torch.int32)
    bound = torch.tensor([8])
    grouped = copies_rows(rows, grouped_WJ, 10, False, bound)
    assert grouped.q_RK.is_contiguous() and grouped.scales.is_contiguous() and grouped.q_RK.shape == (10, 32)
    for w, row in ((w, row) for w, rows_J in enumerate(grouped_WJ.tolist()) for row in rows_J if row >= 0):
        assert torch.equal(grouped.q_RK[row].view(torch.uint8), q_W[w].view(torch.uint8))
        assert grouped.scales[row] == scale_W[w]
    assert not grouped.q_RK[7].float().any() and grouped.scales[7] == 0  # no copy: zero, below the bound
    values = grouped.dequantized(bound)
    assert torch.equal(values[:8], dequantize(grouped.q_RK[:8], grouped.scales[:8]))


# ---------------------------------------------------------------------------------------------- weight cache


def test_fp8_weights_quantized_once_per_step_refreshed_in_place():
    torch.manual_seed(3)
    w = torch.nn.Parameter(torch.randn(4, 32, 48))
    q, scale = weight_operand(w, contract_last=False)
    assert q.shape == (4, 48, 32) and scale.shape == (4, 48)
    again = weight_operand(w, contract_last=False)
    assert again[0] is q and again[1] is scale  # cached: no second quantization within a step
    assert weight_operand(w, contract_last=True)[0].shape == (4, 32, 48)  # the other orientation, its own copy

    w.data.mul_(2)  # the optimizers write through .data, which the version counter does not see ...
    assert weight_operand(w, contract_last=False)[0] is q and torch.equal(weight_operand(w, False)[1], scale)
    weights_updated()  # ... so they say so
    q2, scale2 = weight_operand(w, contract_last=False)
    assert q2 is q and torch.allclose(scale2, 2 * quantize_columns_torch(w.detach() / 2)[1])  # in place, new values
    with torch.no_grad():
        w.add_(1)  # a write through the parameter bumps its version
    assert torch.equal(weight_operand(w, False)[1], quantize_columns_torch(w.detach())[1])

    run = w[1:3]  # a run of experts (the pipeline's chunk): a slice of the whole weight's copy, of its values
    q_run, scale_run = weight_operand(run, contract_last=True)
    assert torch.equal(scale_run, quantize_rows_torch(run.detach())[1])
    assert q_run.data_ptr() == weight_operand(w, True)[0][1].data_ptr() and len(w.fp8_cache) == 2

    layer = torch.nn.Module()
    layer.w = w
    weights_updated()
    with torch.no_grad():
        w.data.mul_(-1)
    refresh_weights(layer)  # what a graphed layer's pre-hook does: every cached copy made current, in place
    for entry in w.fp8_cache.values():
        assert entry.state[0] > 0
    assert weight_operand(run, True)[0].data_ptr() == q_run.data_ptr()
    assert torch.equal(scale_run, quantize_rows_torch(run.detach())[1])


def test_fp8_weight_copies_of_a_view_refreshed_together_in_one_call(monkeypatch):
    """After an optimizer step, asking for one rowwise copy of a weight (or of a view: a run of experts) refreshes
    both of that view's copies with one quantize_rows_and_columns, in place; the first use of each copy, and a copy
    whose partner is current, go alone. Each refreshed copy equals a fresh quantization."""
    calls = {"rows": 0, "columns": 0, "rows_and_columns": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    for layout in ("rows", "columns"):
        monkeypatch.setitem(fp8_layers._QUANTIZE, layout, counted(layout, fp8_layers._QUANTIZE[layout]))
    monkeypatch.setattr(fp8_layers, "quantize_rows_and_columns",
                        counted("rows_and_columns", fp8_layers.quantize_rows_and_columns))

    def current(view: torch.Tensor) -> None:  # both copies of the view cached equal fresh quantizations
        for contract_last, quantize in ((True, quantize_rows_torch), (False, quantize_columns_torch)):
            q, scale = weight_operand(view, contract_last)
            q_want, scale_want = quantize(view.detach())
            assert same_fp8(q, q_want) and torch.equal(scale, scale_want)

    torch.manual_seed(11)
    w = torch.nn.Parameter(torch.randn(4, 32, 48))
    q_cols, scale_cols = weight_operand(w, contract_last=False)  # the first use of each copy: alone
    q_rows, scale_rows = weight_operand(w, contract_last=True)
    assert calls == {"rows": 1, "columns": 1, "rows_and_columns": 0}

    weights_updated()
    with torch.no_grad():
        w.data.mul_(-2)
    q, scale = weight_operand(w, contract_last=False)
    assert q is q_cols and scale is scale_cols  # in place ...
    assert calls == {"rows": 1, "columns": 1, "rows_and_columns": 1}  # ... both copies, one call
    q, scale = weight_operand(w, contract_last=True)
    assert q is q_rows and scale is scale_rows and calls["rows_and_columns"] == 1  # current: no call
    current(w)
    with torch.no_grad():
        w.add_(1)  # an in-place write through the parameter: both stale too
    assert weight_operand(w, contract_last=True)[0] is q_rows and calls["rows_and_columns"] == 2
    current(w)
    assert calls == {"rows": 1, "columns": 1, "rows_and_columns": 2}

    run = w[1:3]  # a run of experts: slices of the whole weight's pair, no call of its own, current or made so
    current(run)
    weights_updated()
    current(run)
    assert calls == {"rows": 1, "columns": 1, "rows_and_columns": 3}
    part = w[:, :16]  # a view that is no run of whole matrices: its own pair
    weight_operand(part, contract_last=True)
    weights_updated()
    weight_operand(part, contract_last=False)  # the first columns copy of the view: alone; its rows copy stays stale
    assert calls == {"rows": 2, "columns": 2, "rows_and_columns": 3}
    weight_operand(part, contract_last=True)  # stale, its partner current: alone
    assert calls == {"rows": 3, "columns": 2, "rows_and_columns": 3}

    layer = torch.nn.Module()
    layer.w = w
    weights_updated()
    with torch.no_grad():
        w.data.mul_(0.5)
    refresh_weights(layer)  # a graphed layer's pre-hook: one call per view
    assert calls == {"rows": 3, "columns": 2, "rows_and_columns": 5}
    assert all(entry.state == fp8_layers._state(w) for entry in w.fp8_cache.values())
    current(w)
    current(run)
    current(part)
    assert calls == {"rows": 3, "columns": 2, "rows_and_columns": 5}


def test_fp8_blockwise_weight_copies_are_one_quantization_in_both_orientations():
    """The dgrad's copy is the forward's transposed (a block's scale does not depend on the orientation), each
    refreshed in place."""
    torch.manual_seed(7)
    w = torch.nn.Parameter(torch.randn(2, 256, 128))
    q, scale = weight_operand(w, contract_last=True, recipe="blockwise")
    assert q.shape == (2, 256, 128) and scale.shape == (2, 2, 1)
    assert torch.equal(scale[1, 1, 0], w.detach()[1, 128:, :].abs().max() / FP8_MAX)
    q_t, scale_t = weight_operand(w, contract_last=False, recipe="blockwise")
    assert q_t.shape == (2, 128, 256) and q_t.is_contiguous()
    assert torch.equal(q_t.float(), q.float().transpose(-2, -1)) and torch.equal(scale_t, scale.transpose(-2, -1))
    before = scale.clone()
    weights_updated()
    with torch.no_grad():
        w.data.mul_(3)
    layer = torch.nn.Module()
    layer.w = w
    refresh_weights(layer)  # in place, as a graphed layer's pre-hook does
    assert weight_operand(w, True, recipe="blockwise")[1] is scale and torch.allclose(scale, 3 * before)
    assert weight_operand(w, False, recipe="blockwise")[0] is q_t and torch.allclose(scale_t, 3 * before.mT)
    assert sorted(layout for layout, _ in w.fp8_cache) == ["blocks", "blocks_t"]


def test_fp8_blockwise_emulated_gemms_against_fp32_and_rows_fed_as_they_crossed():
    """The blockwise recipe's emulated GEMMs (dense both ways, grouped with an empty group and unused tail rows)
    within the FP8 tolerance of fp32; rows quantized with one scale each (the FP8 dispatch's) go in as they are:
    the GEMM of their exact dequantized values."""
    torch.manual_seed(8)
    blockwise = Fp8(emulate=True, recipe="blockwise")
    x, w = torch.randn(40, 256), torch.randn(128, 256)
    assert rel_err(fp8_matmul(x, w, True, blockwise), x @ w.t()) < GEMM_TOL
    g = torch.randn(40, 128)
    assert rel_err(fp8_matmul(g, w, False, blockwise), g @ w) < GEMM_TOL
    rows = [5, 0, 9, 2]
    xg, wg = torch.randn(sum(rows) + 3, 128), torch.randn(4, 128, 256)
    offsets = expert_offsets(torch.tensor(rows))
    reference = torch.cat([xg[sum(rows[:e]):sum(rows[:e + 1])] @ wg[e] for e in range(4)])
    assert rel_err(grouped_mm(xg, wg, offsets, blockwise)[:sum(rows)], reference) < GEMM_TOL
    q, scale = quantize_rows_torch(xg)
    crossed = Fp8Rows(q, scale, torch.float32)
    exact = torch.cat([dequantize(q, scale)[sum(rows[:e]):sum(rows[:e + 1])] @ wg[e] for e in range(4)])
    fed = grouped_mm(crossed, wg, offsets, blockwise)[:sum(rows)]
    assert rel_err(fed, exact) < GEMM_TOL and rel_err(fed, grouped_mm(xg, wg, offsets, blockwise)[:sum(rows)]) < 0.1


# ------------------------------------------------------------------------------------- emulated FP8 GEMMs


def test_fp8_emulated_dense_gemms_against_fp32():
    torch.manual_seed(4)
    x, w = torch.randn(40, 64), torch.randn(48, 64)
    assert rel_err(fp8_matmul(x, w, True, EMULATED), x @ w.t()) < GEMM_TOL  # forward: x @ W^T
    g = torch.randn(40, 48)
    assert rel_err(fp8_matmul(g, w, False, EMULATED), g @ w) < GEMM_TOL  # dgrad: grad_y @ W


def test_fp8_emulated_grouped_gemm_is_per_group_dense():
    torch.manual_seed(5)
    rows = [5, 0, 9, 2]
    x, w = torch.randn(sum(rows) + 3, 32), torch.randn(4, 32, 48)  # 3 unused tail rows
    offsets = expert_offsets(torch.tensor(rows))
    out = grouped_mm(x, w, offsets, EMULATED)
    start = 0
    for e, n in enumerate(rows):
        assert torch.allclose(out[start:start + n], fp8_matmul(x[start:start + n], w[e], False, EMULATED),
                              rtol=1e-6, atol=1e-6)
        start += n
    reference = torch.cat([x[sum(rows[:e]):sum(rows[:e + 1])] @ w[e] for e in range(4)])
    assert rel_err(out[:start], reference) < GEMM_TOL
    assert rel_err(grouped_mm(x, w, offsets, None)[:start], reference) < 1e-6  # bf16 path unchanged (fp32 here)


def test_fp8_gemm_min_dim_leaves_narrow_gemms_in_bf16():
    """train.fp8_gemm_min_dim: a forward or dgrad GEMM narrower than the bound in its contraction or its output is
    the bf16 product itself (rows that crossed as FP8 dequantized first), a wide one the FP8 GEMM's; a narrow
    weight gets no FP8 copy (weight_copy_bytes counts none)."""
    torch.manual_seed(7)
    rows = [5, 0, 9, 2]
    used = slice(0, sum(rows))  # the rows the GEMMs compute (3 unused tail rows: left unwritten)
    offsets = expert_offsets(torch.tensor(rows))
    x, w_wide, w_narrow = torch.randn(sum(rows) + 3, 64), torch.randn(4, 64, 48), torch.randn(4, 64, 16)
    bound = dataclasses.replace(EMULATED, min_dim=32)

    def gemm(a, w, fp8, transpose_w=False):
        return grouped_mm(a, w, offsets, fp8, transpose_w=transpose_w)[used]

    assert torch.equal(gemm(x, w_narrow, bound), gemm(x, w_narrow, None))
    assert torch.equal(gemm(x, w_wide, bound), gemm(x, w_wide, EMULATED))
    assert not torch.equal(gemm(x, w_wide, bound), gemm(x, w_wide, None))
    g = torch.randn(sum(rows), 16)  # the dgrad contracts along the weight's narrow dimension: bf16 too
    assert torch.equal(gemm(g, w_narrow, bound, True), gemm(g, w_narrow, None, True))
    crossed = Fp8Rows(*quantize_rows(x), torch.float32)
    assert torch.equal(gemm(crossed, w_narrow, bound), gemm(crossed.dequantized(), w_narrow, None))
    dense = torch.randn(48, 16)  # (N, K): the forward contracts 16
    assert torch.equal(fp8_matmul(x[:, :16], dense, True, bound), x[:, :16] @ dense.t())
    layer = torch.nn.Module()
    layer.wide, layer.narrow = torch.nn.Parameter(w_wide), torch.nn.Parameter(w_narrow)
    assert weight_copy_bytes(layer, min_dim=32) == weight_copy_bytes(layer) - 4 * (2 * 64 * 16 + 4 * (64 + 16)) > 0


def test_fp8_gemm_min_dim_field(caplog):
    """train.fp8_gemm_min_dim: refused without a recipe or below 0; auto resolves to the measured bound for the input
    gradients' accumulation: with exact ones it logs which GEMMs stay bf16 (the fine-grained bench model's experts'
    and shared expert's fc2, ffn 1,024; none of the Mixtral-like one's), with fast ones (rowwise's default) every GEMM
    runs in FP8; a value set is kept."""
    for value in ("0", "4096"):
        with pytest.raises(ConfigError, match=r"^train\.fp8_gemm_min_dim=\d+: has no effect without train\.fp8_rec"):
            load_config(None, [f"train.fp8_gemm_min_dim={value}"])
    with pytest.raises(ConfigError, match=r"^train\.fp8_gemm_min_dim=-1: must be >= 0"):
        load_config(None, ["train.device=cuda", "train.precision=bf16", "train.fp8_recipe=rowwise",
                           "train.fp8_gemm_min_dim=-1"])
    assert load_config(None, []).train.fp8_gemm_min_dim == "auto"
    exact = ["train.device=cuda", "train.precision=bf16", "train.fp8_recipe=rowwise",
             "train.fp8_dgrad_accumulation=exact"]
    with caplog.at_level("INFO"):
        assert load_config("configs/bench_fine_8l.yaml", exact).train.fp8_gemm_min_dim == FP8_GEMM_MIN_DIM
    assert "stay bf16, measured slower in FP8 (tuning.py): experts' fc2, shared expert fc2" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        load_config("configs/bench_mixtral_2l.yaml", exact)
    assert "measured slower in FP8 (tuning.py): none here" in caplog.text
    assert load_config("configs/bench_fine_8l.yaml", [*exact, "train.fp8_gemm_min_dim=0"]).train.fp8_gemm_min_dim == 0
    caplog.clear()
    with caplog.at_level("INFO"):  # fast input gradients (auto's, rowwise): the narrow GEMMs measured faster in FP8
        fast = load_config("configs/bench_fine_8l.yaml", exact[:-1])
    assert fast.train.fp8_gemm_min_dim == FP8_GEMM_MIN_DIM_FAST == 0
    assert "fp8_gemm_min_dim=auto -> 0: every GEMM of the FP8 layers in FP8" in caplog.text


def test_fp8_dgrad_accumulation_field(caplog):
    """train.fp8_dgrad_accumulation: auto (the default) resolves to fast with rowwise and exact with blockwise, and
    says so; refused when set without a recipe, and fast with blockwise (which sums every 128-deep slice exactly);
    a value set is kept."""
    with pytest.raises(ConfigError, match=r"^train\.fp8_dgrad_accumulation='exact': has no effect without"):
        load_config(None, ["train.fp8_dgrad_accumulation=exact"])
    gpu = ["train.device=cuda", "train.precision=bf16", "model.hidden_size=256", "model.ffn_hidden_size=512",
           "model.num_attention_heads=4", "model.num_query_groups=2"]
    with pytest.raises(ConfigError, match=r"^train\.fp8_dgrad_accumulation='fast': not implemented yet for"):
        load_config(None, [*gpu, "train.fp8_recipe=blockwise", "train.fp8_dgrad_accumulation=fast"])
    assert load_config(None, []).train.fp8_dgrad_accumulation == "auto"
    with caplog.at_level("INFO"):
        assert load_config(None, [*gpu, "train.fp8_recipe=rowwise"]).train.fp8_dgrad_accumulation == "fast"
    assert "train.fp8_dgrad_accumulation=auto -> fast: the input gradients in the forward's fast" in caplog.text
    assert load_config(None, [*gpu, "train.fp8_recipe=blockwise"]).train.fp8_dgrad_accumulation == "exact"
    assert load_config(None, [*gpu, "train.fp8_recipe=rowwise",
                              "train.fp8_dgrad_accumulation=exact"]).train.fp8_dgrad_accumulation == "exact"


@pytest.mark.parametrize("fast_dgrad", [False, True], ids=["exact", "fast"])
def test_fp8_dgrad_accumulation_reaches_the_scaled_gemms(monkeypatch, fast_dgrad):
    """The accumulation torch's scaled GEMMs are asked for (recorded in place of the GEMMs, which need a GPU):
    an expert layer's and a linear's forwards always fast; their input gradients fast only under
    ``Fp8(fast_dgrad=True)`` (train.fp8_dgrad_accumulation=fast)."""
    asked = []

    def record(name):
        def gemm(a, b, *args, use_fast_accum, **kwargs):
            asked.append((name, use_fast_accum))
            return torch.zeros(a.shape[0], b.shape[-1], dtype=kwargs["out_dtype"])
        return gemm

    monkeypatch.setattr(torch, "_scaled_grouped_mm", record("grouped"))
    monkeypatch.setattr(torch, "_scaled_mm", record("dense"))
    fp8 = Fp8(fast_dgrad=fast_dgrad)
    torch.manual_seed(0)
    rows = [16, 32]
    offsets = expert_offsets(torch.tensor(rows))
    x, w = torch.randn(sum(rows), 32), torch.randn(2, 32, 48)
    grouped_mm(x, w, offsets, fp8, fast_accum=True)  # a forward
    grouped_mm(torch.randn(sum(rows), 48), w, offsets, fp8, transpose_w=True)  # its input gradient
    weight = torch.randn(48, 32)
    fp8_matmul(x, weight, True, fp8, fast_accum=True)
    fp8_matmul(torch.randn(sum(rows), 48), weight, False, fp8)
    assert asked == [("grouped", True), ("grouped", fast_dgrad), ("dense", True), ("dense", fast_dgrad)]


def test_fp8_fused_quantizations_change_no_bit_of_an_expert_step(monkeypatch):
    """The FP8 kernels fused for speed compute what they replace, bit for bit, through an expert layer's forward and
    backward over two optimizer steps (the weights' copies refreshed between them): the along-token quantization of
    the weight gradient's operands in one launch per group (against two launches over the chunks), and a weight's
    two rowwise copies from one kernel (against each quantized alone). The Triton kernels under the interpreter;
    the GEMMs emulated (the same in both runs)."""
    import functools

    from moe_overlap.kernels import fp8_wgrad as W

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fp8 = dataclasses.replace(EMULATED, wgrad=True)
    rows = torch.tensor([70, 0, 131, 5])
    offsets = expert_offsets(rows)

    def two_steps() -> list[torch.Tensor]:
        torch.manual_seed(11)
        w13, w2 = torch.nn.Parameter(torch.randn(4, 48, 2 * 40)), torch.nn.Parameter(torch.randn(4, 40, 48))
        results = []
        for _ in range(2):
            fp8_layers.weights_updated()  # an optimizer step: every cached copy is stale
            x = torch.randn(int(rows.sum()) + 3, 48, requires_grad=True)
            out = GroupedSwiGLU.apply(x, offsets, w13, w2, None, fp8)
            out[:int(rows.sum())].backward(torch.randn(int(rows.sum()), 48))
            results += [out.detach().clone(), x.grad, w13.grad.clone(), w2.grad.clone()]
            with torch.no_grad():  # the next step's weights
                w13.add_(0.01)
                w2.mul_(0.9)
        return results

    paired = []
    monkeypatch.setattr(fp8_layers, "quantize_rows_and_columns",
                        lambda *a, real=fp8_layers.quantize_rows_and_columns, **k: paired.append(a) or real(*a, **k))
    fused = two_steps()
    assert len(paired) == 2  # the second step refreshed each weight's two copies in one call
    monkeypatch.setattr(fp8_layers, "quantize_along_tokens", functools.partial(W.quantize_along_tokens,
                                                                                one_pass=False))
    monkeypatch.setattr(fp8_layers, "_ROWWISE_PARTNER", {})
    calls = []
    monkeypatch.setattr(fp8_layers, "quantize_rows_and_columns", lambda *a, **k: calls.append(a))
    separate = two_steps()
    assert not calls
    for got, want in zip(fused, separate):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fp8, ffn, handed", [(EMULATED, 64, 2), (Fp8(emulate=True, min_dim=100), 64, 1),
                                               (Fp8(emulate=True, recipe="blockwise"), 128, 0)])
def test_fp8_moe_permutation_hands_its_experts_fp8_rows(monkeypatch, fp8, ffn, handed):
    """At one EP rank under rowwise FP8, the permutation around the experts writes their rows in FP8 too, in the
    same pass (kernels/permute.Fp8Handoff): fc1's forward and fc2's input gradient take them instead of quantizing
    the rows again (``handed``: the quantizations of those rows the GEMMs skip; fc1's alone where the min-dim rule
    keeps fc2 (64 wide) bf16; none under blockwise, where it measured no faster). The same bytes, so the layer's
    output and every gradient are bit for bit those of the path without the handoff. The Triton kernels under the
    interpreter (fp32); the GEMMs emulated."""
    from moe_overlap.config import ModelConfig, OverlapConfig
    from moe_overlap.layers.experts import GroupedExperts
    from moe_overlap.layers.moe import MoELayer

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = ModelConfig(hidden_size=256, ffn_hidden_size=ffn, num_moe_experts=4, moe_router_topk=2)
    quantized = []
    for name in ("quantize_rows", "quantize_tiles"):
        monkeypatch.setattr(fp8_layers, name, lambda x, *a, real=getattr(fp8_layers, name), **k:
                            quantized.append(x.shape) or real(x, *a, **k))

    def step() -> list[torch.Tensor]:
        torch.manual_seed(5)
        layer = MoELayer(cfg, OverlapConfig(moe_pipeline=False), Mesh.single().ep)
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(0.0, 0.1)
        layer.experts.fp8 = fp8
        fp8_layers.weights_updated()
        x = torch.randn(1, 37, 256, requires_grad=True)
        out, _, _ = layer(x)
        out.backward(torch.randn_like(out))
        return [out.detach(), x.grad, layer.router.weight.grad, layer.experts.w13.grad, layer.experts.w2.grad]

    handed_off = step()
    rows_quantized = quantized.count(torch.Size([37 * 2, 256]))
    monkeypatch.setattr(GroupedExperts, "fp8_handoff", lambda self: None)
    quantized.clear()
    alone = step()
    assert quantized.count(torch.Size([37 * 2, 256])) - rows_quantized == handed
    for got, want in zip(handed_off, alone):
        assert torch.equal(got, want)


def test_fp8_experts_with_no_rows():
    w13, w2 = torch.nn.Parameter(torch.randn(2, 32, 64)), torch.nn.Parameter(torch.randn(2, 32, 32))
    x = torch.zeros(0, 32, requires_grad=True)
    out = GroupedSwiGLU.apply(x, expert_offsets(torch.zeros(2, dtype=torch.long)), w13, w2, None, EMULATED)
    out.sum().backward()
    assert out.shape == (0, 32) and w13.grad.abs().max() == 0 and x.grad.shape == (0, 32)


@pytest.mark.parametrize("fp8, fed_fp8_rows", [
    (EMULATED, [False, True, False, True]), (Fp8(emulate=True, recipe="blockwise"), [False, True, False, True]),
    (Fp8(emulate=True, min_dim=200), [False, False, False, True])])  # fc2 (128 wide) bf16, fc1 (256) FP8
def test_fp8_swiglu_feeds_its_gemms_fp8_rows(monkeypatch, fp8, fed_fp8_rows):
    """SwiGLU's kernels hand fc2's forward and fc1's dgrad their operands as FP8 rows (kernels/swiglu.py *_fp8;
    under blockwise with one scale per 1x128 tile), not bf16 tensors the GEMM quantizes again; the outputs are those
    of SwiGLU then the FP8 GEMM quantizing them (the same bytes). A GEMM the min-dim rule leaves bf16 takes bf16."""
    from moe_overlap.kernels import swiglu as S
    from moe_overlap.layers import experts as X

    torch.manual_seed(8)
    rows = [3, 0, 5, 8]
    offsets = expert_offsets(torch.tensor(rows))
    x, grad_y = torch.randn(sum(rows), 256), torch.randn(sum(rows), 256)
    w13, w2 = torch.randn(4, 256, 2 * 128) / 16, torch.randn(4, 128, 256) / 16
    fed = []
    monkeypatch.setattr(X, "grouped_mm", lambda a, *args, **kwargs: fed.append(isinstance(a, Fp8Rows)) or
                        grouped_mm(a, *args, **kwargs))
    y, h = X.experts_forward(x, offsets, w13, w2, fp8)
    grad_x, grad_h, a = X.experts_dgrad(grad_y, h.clone(), offsets, w13, w2, fp8)  # it spends h (FP8: over_h)
    assert fed == fed_fp8_rows  # fc1, fc2 forward; fc2, fc1 dgrad
    unfused_y = grouped_mm(S.swiglu_forward(h), w2, offsets, fp8, fast_accum=True)
    unfused_grad_h, unfused_a = S.swiglu_backward(h, grouped_mm(grad_y, w2, offsets, fp8, transpose_w=True))
    assert torch.equal(y, unfused_y) and torch.equal(grad_h, unfused_grad_h) and torch.equal(a, unfused_a)
    assert torch.equal(grad_x, grouped_mm(unfused_grad_h, w13, offsets, fp8, transpose_w=True))


def test_fp8_experts_dgrad_frees_or_reuses_fc2s_operands_before_fc1s_dgrad(monkeypatch):
    """The experts' backward peaks in fc1's dgrad (the input gradient): by then grad_y's FP8 rows (handed in a list
    that fc2's dgrad empties) and fc2's output gradient are freed, not held beside fc1's operands, and fc1's FP8
    operand lies in h's bytes (SwiGLU, h's last reader, wrote its rows there): no buffer of its own; the input
    gradient is the one the FP8 GEMM makes quantizing grad_y itself (the same bytes)."""
    import weakref

    from moe_overlap.layers import experts as X

    torch.manual_seed(8)
    rows = [3, 0, 5, 8]
    offsets = expert_offsets(torch.tensor(rows))
    x, grad_y = torch.randn(sum(rows), 256), torch.randn(sum(rows), 256)
    w13, w2 = torch.randn(4, 256, 2 * 128) / 16, torch.randn(4, 128, 256) / 16
    _, h = X.experts_forward(x, offsets, w13, w2, EMULATED)
    q, scales = quantize_rows(grad_y)
    handed, grad_y_q = [Fp8Rows(q, scales, torch.float32)], weakref.ref(q)
    del q, scales
    made, at_fc1 = [], []

    def gemm(a, *args, **kwargs):
        if made:  # fc1's dgrad: what of fc2's is still alive, where its operand lies
            at_fc1.extend([grad_y_q() is not None, made[0]() is not None,
                           a.q_RK.untyped_storage().data_ptr() == h_bytes.untyped_storage().data_ptr()])
        out = grouped_mm(a, *args, **kwargs)
        made.append(weakref.ref(out))
        return out

    h_bytes, h_before = h, h.clone()
    monkeypatch.setattr(X, "grouped_mm", gemm)
    grad_x = X.experts_dgrad(grad_y, h, offsets, w13, w2, EMULATED, handed)[0]
    assert handed == [] and at_fc1 == [False, False, True]
    monkeypatch.undo()
    assert torch.equal(grad_x, X.experts_dgrad(grad_y, h_before, offsets, w13, w2, EMULATED)[0])


def test_fp8_emulated_experts_and_linears_forward_backward_into_main_grad():
    """GroupedSwiGLU and the linears under FP8: outputs and input gradients within the FP8 tolerance of fp32 (a
    chain of two FP8 GEMMs: twice the per-GEMM tolerance); weight gradients into main_grad exactly as the FP8 wgrad
    makes them from the same activations, within an FP8 GEMM's tolerance of fp32's, and with train.fp8_wgrad off
    exactly fp32's (bf16 GEMMs on GPU)."""
    torch.manual_seed(6)
    rows = [3, 0, 5, 8]
    x = torch.randn(sum(rows), 32, requires_grad=True)
    w13, w2 = torch.nn.Parameter(torch.randn(4, 32, 64) * 0.3), torch.nn.Parameter(torch.randn(4, 32, 32) * 0.3)
    for param in (w13, w2):
        param_info(param).main_grad = torch.zeros_like(param)
        param_info(param).adds_own_grad = True
    offsets = expert_offsets(torch.tensor(rows))
    out = GroupedSwiGLU.apply(x, offsets, w13, w2, None, EMULATED)
    reference = GroupedSwiGLU.apply(x, offsets, w13.detach().clone().requires_grad_(), w2.detach().clone(), None, None)
    assert rel_err(out, reference) < 2 * GEMM_TOL
    grad = torch.randn_like(out)
    (grad_x,) = torch.autograd.grad(out, x, grad)
    (want_x,) = torch.autograd.grad(reference, x, grad)
    assert rel_err(grad_x, want_x) < 2 * GEMM_TOL
    assert w13.fp8_cache and w2.fp8_cache  # the FP8 path ran
    # wgrad from the FP8 run's own activations, recomputed: main_grad holds exactly the FP8 wgrad of those
    got13, got2 = param_info(w13).main_grad, param_info(w2).main_grad
    assert got13.abs().sum() > 0 and got2.abs().sum() > 0
    h = grouped_mm(x.detach(), w13, offsets, EMULATED)
    grad_h, a = swiglu_backward(h, grouped_mm(grad, w2, offsets, EMULATED, transpose_w=True), offsets[-1:])
    inputs = [WgradInputs(x.detach(), a, grad_h, grad, offsets)]
    for fp8 in (EMULATED, None, Fp8(emulate=True, wgrad=False)):
        param_info(w13).main_grad, param_info(w2).main_grad = torch.zeros_like(w13), torch.zeros_like(w2)
        experts_wgrad(w13, w2, inputs, fp8=fp8)
        if fp8 is EMULATED:
            assert torch.allclose(param_info(w13).main_grad, got13, rtol=1e-6, atol=1e-6)
            assert torch.allclose(param_info(w2).main_grad, got2, rtol=1e-6, atol=1e-6)
        elif fp8 is None:
            fp32_13, fp32_2 = param_info(w13).main_grad, param_info(w2).main_grad
            assert 1e-3 < rel_err(got13, fp32_13) < GEMM_TOL and 1e-3 < rel_err(got2, fp32_2) < GEMM_TOL
        else:
            assert torch.equal(param_info(w13).main_grad, fp32_13) and torch.equal(param_info(w2).main_grad, fp32_2)

    comm = TPComm.single()
    fc1, fc2 = ColumnParallelLinear(32, 64, comm), RowParallelLinear(64, 32, comm)
    for linear in (fc1, fc2):
        torch.nn.init.normal_(linear.weight, std=0.2)
    y_ref = fc2(fc1(x))
    grad_ref, *weight_grads_ref = torch.autograd.grad(y_ref, [x, fc1.weight, fc2.weight], torch.ones_like(y_ref))
    fc1.fp8 = fc2.fp8 = EMULATED
    y = fc2(fc1(x))
    assert rel_err(y, y_ref) < 2 * GEMM_TOL
    grad_x, *weight_grads = torch.autograd.grad(y, [x, fc1.weight, fc2.weight], torch.ones_like(y))
    assert rel_err(grad_x, grad_ref) < 2 * GEMM_TOL
    assert all(rel_err(g, want) < 2 * GEMM_TOL for g, want in zip(weight_grads, weight_grads_ref))


# ------------------------------------------------------------------------------------------ a model in FP8


# blockwise quantizes in 1x128 tiles and 128x128 blocks: every GEMM dimension on a rank a multiple of 128, at TP=2
# too (4 heads of 64: the projection's 256 inputs and the QKV's 512 outputs, 128 and 256 a rank; dense ffn 128 a
# rank)
BLOCKWISE_DIMS = {"model.hidden_size": 128, "model.ffn_hidden_size": 256, "model.moe_ffn_hidden_size": 128,
                  "model.num_attention_heads": 4, "model.num_query_groups": 2, "model.kv_channels": 64}


def emulated_fp8_case(ep: int, steps: int, output_dir: str, pipeline: str, extra: dict | None = None,
                      recipe: str = "rowwise", wgrad: bool = False) -> dict:
    """A layout (2 ranks, EP=ep, ``pipeline``: the MoE exchange's overlap.moe_pipeline, ``extra`` overrides) with
    every layer's GEMMs in emulated FP8 (``recipe``; the weight gradients too with ``wgrad``) against one process
    with the same emulation, step by step (the optimizer refreshes the FP8 weights every step); and the single
    process without FP8, which FP8 must change a little. The first step's gradients apart: the experts'
    (``first_step_expert_grad``) and the rest."""
    world = dist.get_world_size()
    global_batch = 2 * 2 * world  # micro-batch 2, two per data-parallel rank
    dims = BLOCKWISE_DIMS if recipe == "blockwise" else {}
    cfg = small_config(output_dir, ep, global_batch, **{**dims, "overlap.moe_pipeline": pipeline, **(extra or {})})
    _, mesh = world_and_mesh(cfg)
    try:
        layout_run = Trainer(cfg, mesh, CPU)
        reference = Trainer(small_config(output_dir, 1, global_batch, **dims), Mesh.single(), CPU)
        without_fp8 = Trainer(small_config(output_dir, 1, global_batch, **dims), Mesh.single(), CPU)
        for trainer in (layout_run, reference):
            trainer.model.use_fp8(Fp8(emulate=True, recipe=recipe, wgrad=wgrad))
        worst = {"loss": 0.0, "first_step_grad": 0.0, "first_step_expert_grad": 0.0, "grad": 0.0,
                 "fp8_vs_fp32_loss": 0.0}
        for step in range(steps):
            got, want = {}, {}
            m = layout_run.train_step(lambda opt: got.update(opt.logical_grads()))
            r = reference.train_step(lambda opt: want.update(opt.logical_grads()))
            plain = without_fp8.train_step()
            worst["loss"] = max(worst["loss"], abs(m["loss"] - r["loss"]) / abs(r["loss"]))
            grad_err = max(rel_err(grad, want[key]) for key, grad in got.items())
            worst["grad"] = max(worst["grad"], grad_err)
            if step == 0:
                for key, grad in got.items():
                    slot = "first_step_expert_grad" if ".experts." in key else "first_step_grad"
                    worst[slot] = max(worst[slot], rel_err(grad, want[key]))
            worst["fp8_vs_fp32_loss"] = max(worst["fp8_vs_fp32_loss"], abs(r["loss"] - plain["loss"]) / plain["loss"])
        return worst
    finally:
        mesh.destroy()


TP2_SP = {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": "true",  # MoE at TP > 1: SP
          "parallel.expert_model_parallel_size": 1, "parallel.expert_tensor_parallel_size": 1}
ETP2 = {"parallel.expert_model_parallel_size": 1, "parallel.expert_tensor_parallel_size": 2}  # each expert's ffn halved
TP_OVERLAPS = {"overlap.tp_comm_overlap": "true", "overlap.tp_comm_overlap_ag": "true",  # every pipelined ring, two
               "overlap.tp_comm_overlap_rs": "true", "overlap.tp_comm_overlap_rs_dgrad": "true",  # blocks a rank
               "overlap.tp_comm_bulk_dgrad": "true", "overlap.tp_comm_num_splits": 2}


@pytest.mark.parametrize("ep, pipeline, extra, later", [
    (1, "auto", None, 1e-3), (2, "false", None, 1e-3), (2, "true", None, 1e-3),
    (1, "auto", TP2_SP, 3e-3), (1, "auto", {**TP2_SP, **TP_OVERLAPS}, 3e-3), (1, "auto", ETP2, 3e-3),
    (1, "auto", {**TP2_SP, **ETP2}, 3e-3)],
    ids=["dp2", "ep2-serial", "ep2-pipeline", "tp2-sp", "tp2-sp-overlaps", "etp2", "tp2-sp-etp2"])
def test_fp8_emulated_layouts_match_single_process(rank_pool, tmp_path, ep, pipeline, extra, later):
    """The first step (the same weights on both sides) within fp32's 1e-5. After it the two runs' weights differ by
    round-off (~1e-7: micro-batch gradients summed in another order, as without FP8), and a value that sits on an
    E4M3 rounding boundary can round the other way: one element moves by an E4M3 step (6%), which shows as ~1e-4
    in that expert's gradient. So later steps are held to ``later`` (1e-3; 3e-3 at TP=2, where every dense GEMM's
    partial sums are reduced in another order too: 1.4e-3 measured), and the losses to 1e-5 throughout. At TP=2 the
    row-parallel forward and the column-parallel dgrad contract over a split dimension: their scales are shared
    over the two ranks (layers/fp8.py); with each rank's own maximum instead, the first step's gradients were 0.5
    off. With every TP overlap on, the rings multiply a block of rows at a time: each row quantized as it arrives
    (the gathers), or every row once before the ring starts, its scale shared (the split contractions). Expert-TP 2
    (alone, and following TP=2) splits each expert's ffn: fc2's forward and fc1's dgrad contract over it and share
    their scales over the expert-TP group."""
    for worst in rank_pool(2).run(emulated_fp8_case, ep, 3, str(tmp_path), pipeline, extra):
        assert worst["loss"] < 1e-5 and worst["first_step_grad"] < 1e-5 and worst["grad"] < later, worst
        assert worst["first_step_expert_grad"] < 1e-5, worst  # the experts' too, expert-TP's split GEMMs included
        assert 1e-6 < worst["fp8_vs_fp32_loss"] < 0.02, worst  # FP8 ran, and stays close


@pytest.mark.parametrize("extra, first_step_grad", [(None, 1e-5), (TP2_SP, 3e-2)], ids=["ep2-pipeline", "tp2-sp"])
def test_fp8_blockwise_emulated_layouts_match_single_process(rank_pool, tmp_path, extra, first_step_grad):
    """The blockwise recipe's first step at EP=2 (the device-free pipeline) and at TP=2 against one process. Its
    dimensions are multiples of 128 (BLOCKWISE_DIMS), 4-8x the rowwise test's, and that makes the rowwise test's
    later steps unfit here: an E4M3 rounding flip moves a gradient by ~1e-4, the next FP8 GEMM quantizes that
    gradient (a perturbation d flips ~16 d of its elements by 6%: ~0.24 sqrt(d) normwise), and flips cascade down
    the backward. At EP=2 the first step computes every row as one process does: within 1e-5 (1e-7 measured). At
    TP=2 the partial sums of the split GEMMs are added in another order (1e-7), and that cascade ends at ~8e-3 in
    the first layer's gradients (measured; with the experts in bf16 4.5e-7, with only the experts in FP8 5e-5, the
    rowwise recipe at these dimensions likewise 1e-4). What TP=2 must get exactly right, each rank's tiles and
    blocks being the one process's with nothing shared, is tested linear by linear below; here the loss (the
    forward) within 1e-5."""
    pipeline = "true" if extra is None else "auto"
    for worst in rank_pool(2).run(emulated_fp8_case, 2 if extra is None else 1, 1, str(tmp_path), pipeline, extra,
                                  "blockwise"):
        assert worst["loss"] < 1e-5 and worst["first_step_grad"] < first_step_grad, worst
        assert 1e-6 < worst["fp8_vs_fp32_loss"] < 0.02, worst


@pytest.mark.parametrize("recipe, ep, pipeline, extra, dense_grad, expert_grad", [
    ("rowwise", 1, "auto", None, 1e-5, 1e-5), ("rowwise", 2, "true", None, 1e-5, GEMM_TOL),
    ("rowwise", 1, "auto", TP2_SP, 1e-3, GEMM_TOL), ("blockwise", 2, "true", None, 1e-5, GEMM_TOL),
    ("rowwise", 1, "auto", ETP2, 1e-5, GEMM_TOL)],
    ids=["dp2", "ep2-pipeline", "tp2-sp", "blockwise-ep2-pipeline", "etp2"])
def test_fp8_wgrad_emulated_layouts_match_single_process(rank_pool, tmp_path, recipe, ep, pipeline, extra,
                                                         dense_grad, expert_grad):
    """train.fp8_wgrad: the experts' weight gradients in FP8 too. Their operands are quantized along the tokens, per
    expert group (rowwise) or per 128 of its rows (blockwise), so an expert's scales depend on which rows its group
    holds: at DP=2 each rank's micro-batch is one of the single process's and the first step agrees to fp32's
    round-off (later steps as in the test above); at EP=2 an expert's group holds both ranks' rows, at TP=2 with SP
    each rank's half of the sequence, so the experts' weight gradients are other FP8 roundings of the same sums:
    within an FP8 GEMM's tolerance (2-3e-2 measured), while the loss and every other gradient of the first step stay
    the single process's (1e-5; 1e-3 at TP=2, where the dense GEMMs' partial sums are reduced in another order).
    Expert-TP 2 over the two data-parallel ranks: each holds part of every expert's ffn over both ranks' rows, so an
    expert's group holds rows of two micro-batches, as at EP=2."""
    steps = 3 if ep == 1 and extra is None else 1
    for worst in rank_pool(2).run(emulated_fp8_case, ep, steps, str(tmp_path), pipeline, extra, recipe, True):
        assert worst["loss"] < 1e-5 and worst["first_step_grad"] < dense_grad, worst
        assert 0 < worst["first_step_expert_grad"] < expert_grad, worst
        if steps > 1:  # later steps: an E4M3 rounding flip now and then, as without the FP8 wgrad (the test above)
            assert worst["grad"] < 1e-3, worst
        assert 1e-6 < worst["fp8_vs_fp32_loss"] < 0.02, worst


def blockwise_tp2_linears_case() -> dict[str, float]:
    """A column-parallel [gate; up] linear and a row-parallel one at TP=2 with sequence parallelism, in emulated
    blockwise FP8, against one process: each output and input gradient is one FP8 GEMM of the same tiles and
    blocks (a rank's part of every dimension is a multiple of 128; nothing shared), so they agree to fp32's
    round-off (the partial sums added in another order)."""
    from tests.test_tp import world_group

    group = world_group()
    comm, single = TPComm(group, sequence_parallel=True), TPComm.single()
    blockwise = Fp8(emulate=True, recipe="blockwise")
    g = torch.Generator().manual_seed(9)
    rows, hidden, ffn = 24, 256, 512  # rows per rank; the dense ffn splits 256 a rank (2 blocks of gate, of up)
    mine = slice(group.rank * rows, (group.rank + 1) * rows)
    errors = {}
    for name, make, inputs, outputs in (
            ("column", lambda c: ColumnParallelLinear(hidden, 2 * ffn, c, stack=2), hidden, 2 * ffn),
            ("row", lambda c: RowParallelLinear(ffn, hidden, c), ffn, hidden)):
        full, part = make(single), make(comm)
        with torch.no_grad():
            full.weight.normal_(0, 0.05, generator=g)
            shard = param_info(part.weight).tp_shard
            part.weight.copy_(shard.take(full.weight.view(shard.logical_shape(part.weight.shape)), part.weight.shape))
        x = torch.randn(2 * rows, inputs, generator=g)
        grad = torch.randn(2 * rows, outputs, generator=g)
        full.fp8 = part.fp8 = blockwise
        x_full = x.clone().requires_grad_()
        y_full = full(x_full)
        y_full.backward(grad)
        exact = x @ full.weight.detach().t()
        if name == "column":  # in: this rank's rows; out: every row, this rank's [gate_r; up_r] columns
            cols = torch.arange(2 * ffn).view(2, 2, ffn // 2)[:, group.rank].reshape(-1)
            x_part, grad_part = x[mine].clone().requires_grad_(), grad[:, cols]
            want_y, want_grad_x, exact = y_full[:, cols], x_full.grad[mine], exact[:, cols]
        else:  # in: every row, this rank's columns; out: this rank's rows
            cols = torch.arange(ffn).view(2, ffn // 2)[group.rank]
            x_part, grad_part = x[:, cols].clone().requires_grad_(), grad[mine]
            want_y, want_grad_x, exact = y_full[mine], x_full.grad[:, cols], exact[mine]
        y_part = part(x_part)
        y_part.backward(grad_part)
        errors[name] = max(rel_err(y_part, want_y), rel_err(x_part.grad, want_grad_x))
        errors[name + "_vs_fp32"] = rel_err(y_part, exact)
    return errors


def test_fp8_blockwise_tp2_linears_equal_one_process(rank_pool):
    for errors in rank_pool(2).run(blockwise_tp2_linears_case):
        assert errors["column"] < 1e-5 and errors["row"] < 1e-5, errors
        assert 1e-3 < errors["column_vs_fp32"] < GEMM_TOL and 1e-3 < errors["row_vs_fp32"] < GEMM_TOL, errors


def column_backward_collectives_case() -> list[str]:
    """The collectives a column-parallel linear's backward issues at TP=2 with SP in emulated rowwise FP8, in order
    (the maxima's all-reduce named by its op)."""
    from tests.test_tp import world_group

    comm = TPComm(world_group(), sequence_parallel=True)
    layer = ColumnParallelLinear(64, 128, comm)
    layer.fp8 = Fp8(emulate=True, recipe="rowwise", min_dim=0)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    y = layer(x)
    issued = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single", "all_gather_into_tensor",
                                                          "reduce_scatter_single", "reduce_scatter_tensor")
                 if hasattr(dist, name)}

    def recorder(name, fn):
        def call(*args, **kwargs):
            op = kwargs.get("op")
            issued.append(f"{name}:{'max' if op == dist.ReduceOp.MAX else 'sum'}" if name == "all_reduce" else name)
            return fn(*args, **kwargs)
        return call

    try:
        for name, fn in originals.items():
            setattr(dist, name, recorder(name, fn))
        y.backward(torch.ones_like(y))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return issued


def test_fp8_column_dgrad_maxima_cross_before_the_gather_of_x(rank_pool):
    """The output gradient's shared maxima are started before the serial gather of x, which then queues behind them
    on the group's stream: one wait for both instead of two (FP8 at TP=2 on 2xH100: each maxima all-reduce waited
    for alone cost about 1 ms of exposed TP wait)."""
    for issued in rank_pool(2).run(column_backward_collectives_case):
        gathers = [i for i, name in enumerate(issued) if name.startswith("all_gather")]
        maxima = [i for i, name in enumerate(issued) if name == "all_reduce:max"]
        assert gathers and maxima and maxima[0] < gathers[0], issued


def test_fp8_first_and_last_layers_stay_bf16(tmp_path):
    cfg = small_config(str(tmp_path), 1, 4, **{"model.num_layers": 4, "model.moe_layer_freq": "[0,1,1,1]"})
    trainer = Trainer(cfg, Mesh.single(), CPU)
    model = trainer.model
    model.use_fp8(EMULATED, bf16_at_start=1, bf16_at_end=1)
    fp8_of = {index: {type(module).__name__: module.fp8 for module in layer.modules() if hasattr(module, "fp8")}
              for index, layer in model.layers.items()}
    assert set(fp8_of["0"].values()) == {None} and set(fp8_of["3"].values()) == {None}
    assert set(fp8_of["1"].values()) == {EMULATED} and set(fp8_of["2"].values()) == {EMULATED}
    assert {"ColumnParallelLinear", "RowParallelLinear", "GroupedExperts"} <= set(fp8_of["1"])
    assert model.output_layer.fp8 is None  # the output layer stays bf16
    with pytest.raises(ConfigError, match=r"^train\.fp8_recipe='rowwise': FP8 needs a GPU with FP8 tensor cores"):
        model.use_fp8(Fp8())  # real FP8 on a CPU model
    with pytest.raises(ConfigError, match="train.fp8_recipe"):
        check_fp8_device(torch.device("cpu"))


def test_fp8_recipe_reaches_the_model_through_the_trainer(tmp_path, monkeypatch):
    """train.fp8_recipe is not accepted and ignored: the trainer hands it to the model (MixtralModel.use_fp8), whose
    check of the device is what refuses this CPU run once the config's own device rule is set aside."""
    from moe_overlap.training import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "validate_for_world", lambda *args: None)
    cfg = small_config(str(tmp_path), 1, 4, **{"train.fp8_recipe": "rowwise", "train.precision": "bf16"})
    with pytest.raises(ConfigError, match=r"^train\.fp8_recipe='rowwise': FP8 needs a GPU .*the device is 'cpu'"):
        trainer_module.Trainer(cfg, Mesh.single(), CPU)


# ---------------------------------------------------------------------------------------------- refusals

GPU_FP8 = {"train.device": "cuda", "train.precision": "bf16", "train.fp8_recipe": "rowwise"}
MOE = {"model.num_moe_experts": "4", "model.moe_router_topk": "2", "model.hidden_size": "64",
       "model.ffn_hidden_size": "128", "model.num_attention_heads": "4"}


def refusal(**overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"{key}={value}" for key, value in overrides.items()])
    return str(caught.value)


def test_fp8_config_accepts_tensor_parallelism():
    """TP=2 with sequence parallelism and expert-TP 1: the split contractions share their scales (layers/fp8.py)."""
    overrides = {**MOE, **GPU_FP8, "parallel.tensor_model_parallel_size": "2", "parallel.sequence_parallel": "true",
                 "parallel.expert_tensor_parallel_size": "1"}
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    validate_for_world(cfg, 2, "cuda")
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.train.fp8_recipe == "rowwise"


def test_fp8_config_accepts_expert_tensor_parallelism():
    """Expert-TP 2 (following TP=2 with sequence parallelism, or set alone): fc2's forward and fc1's dgrad contract
    over the split FFN dimension and share their scales over the expert-TP group (layers/fp8.py)."""
    for overrides in ({"parallel.tensor_model_parallel_size": "2", "parallel.sequence_parallel": "true"},
                      {"parallel.expert_tensor_parallel_size": "2"}):
        cfg = load_config(None, [f"{k}={v}" for k, v in {**MOE, **GPU_FP8, **overrides}.items()])
        validate_for_world(cfg, 2, "cuda")
        assert cfg.expert_tensor_parallel_size == 2 and cfg.train.fp8_recipe == "rowwise"


def test_fp8_config_accepts_a_gpu_moe_model():
    cfg = load_config(None, [f"{k}={v}" for k, v in {**MOE, **GPU_FP8, "train.num_layers_at_start_in_bf16": "1",
                                                      "train.num_layers_at_end_in_bf16": "1"}.items()])
    assert cfg.train.fp8_recipe == "rowwise"
    validate_for_world(cfg, 1, "cuda")
    with pytest.raises(ConfigError, match=r"^train\.fp8_recipe='rowwise': FP8 needs a GPU .*the device is 'cpu'"):
        validate_for_world(cfg, 1, "cpu")  # train.device=auto resolved to a CPU


@pytest.mark.parametrize("overrides,field", [
    ({"train.fp8_recipe": "rowwise", "train.precision": "bf16"}, "train.fp8_recipe"),  # device auto: fine; cpu:
    ({**GPU_FP8, "train.device": "cpu"}, "train.fp8_recipe"),
    ({**GPU_FP8, **MOE, "train.fp8_recipe": "blockwise"}, "model.hidden_size"),  # 64: not a multiple of 128
    ({**GPU_FP8, "train.precision": "fp32"}, "train.fp8_recipe"),
    ({**GPU_FP8, "model.hidden_size": "40", "model.num_attention_heads": "5"}, "model.hidden_size"),
    ({**GPU_FP8, "model.ffn_hidden_size": "72"}, "model.ffn_hidden_size"),
    ({**GPU_FP8, **MOE, "model.moe_ffn_hidden_size": "24"}, "model.moe_ffn_hidden_size"),
    ({**GPU_FP8, **MOE, "model.moe_shared_expert_intermediate_size": "24"},
     "model.moe_shared_expert_intermediate_size"),
    # head dim 4, one key-value group: the QKV projection is (32 + 2) x 4 = 136 wide
    ({**GPU_FP8, "model.num_attention_heads": "32", "model.num_query_groups": "1"}, "model.num_attention_heads"),
    ({**GPU_FP8, "model.num_attention_heads": "6", "model.kv_channels": "4"}, "model.kv_channels"),  # 24 wide
    # TP=2 splits the dense MLP's ffn: 48 is 24 on a rank
    ({**GPU_FP8, "parallel.tensor_model_parallel_size": "2", "model.ffn_hidden_size": "48"}, "model.ffn_hidden_size"),
    # expert-TP splits the experts' ffn: 48 is 24 on a rank
    ({**GPU_FP8, **MOE, "parallel.expert_tensor_parallel_size": "2", "model.moe_ffn_hidden_size": "48"},
     "model.moe_ffn_hidden_size"),
    # expert-TP follows TP unless set
    ({**GPU_FP8, **MOE, "parallel.tensor_model_parallel_size": "2", "parallel.sequence_parallel": "true",
      "model.moe_ffn_hidden_size": "48"}, "model.moe_ffn_hidden_size"),
    ({"train.num_layers_at_start_in_bf16": "1"}, "train.num_layers_at_start_in_bf16"),
    ({**GPU_FP8, "train.num_layers_at_end_in_bf16": "-1"}, "train.num_layers_at_end_in_bf16"),
    ({**GPU_FP8, "train.num_layers_at_start_in_bf16": "2", "train.num_layers_at_end_in_bf16": "3"},
     "train.num_layers_at_end_in_bf16"),
], ids=["auto-device-ok", "cpu", "blockwise", "fp32", "hidden", "ffn", "expert-ffn", "shared-expert", "heads",
        "kv-channels", "tp-ffn", "expert-tp", "tp-folds-expert-tp", "bf16-layers-without-fp8", "negative", "too-many"])
def test_fp8_refusals_name_the_field(overrides, field):
    if field == "train.fp8_recipe" and overrides.get("train.device") is None:
        cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])  # checked where the device is known
        with pytest.raises(ConfigError, match=r"^train\.fp8_recipe='rowwise': FP8 needs a GPU"):
            validate_for_world(cfg, 1, "cpu")
        return
    message = refusal(**overrides)
    assert message.startswith(f"{field}="), message
    assert "\n" not in message
