"""The FP8 recipes on one GPU (`pytest -m gpu`; needs FP8 tensor cores: H100/H200): the Triton quantize
kernels equal their torch twins bit for bit (a weight's two copies in one call, the two kernels'); each FP8
GEMM (forward, dgrad, and the rowwise dgrad in fast accumulation: train.fp8_dgrad_accumulation=fast;
torch._scaled_mm and torch._scaled_grouped_mm) within 0.05 normwise of fp32 on the same inputs and within 1e-2 of
the emulated path;
the weight gradients (FP8 by train.fp8_wgrad, and bf16) into the fp32 main_grad; the experts' layer and a linear
whole against the emulated path; a small model's training steps with each train.fp8_recipe (eager, and with its MoE
layers replayed from CUDA graphs; rowwise with fast input gradients too) with finite losses close to bf16's, the graphed
run equal to the eager one, and every
replay reading FP8 weights that the pre-hook refreshed after the last optimizer step. The train-step test needs
train.fp8_recipe wired into the trainer (MixtralModel.use_fp8).

    CUDA_VISIBLE_DEVICES=0 python -m pytest -m gpu tests/test_gpu_fp8.py
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from moe_overlap.kernels.fp8_blockwise import quantize_blocks, quantize_blocks_torch
from moe_overlap.kernels.fp8_quant import (column_amax, dequantize, dequantize_rows, quantize_columns,
                                           quantize_columns_torch, quantize_rows, quantize_rows_and_columns,
                                           quantize_rows_torch, row_amax)
from moe_overlap.layers.experts import GroupedSwiGLU, WgradInputs, expert_offsets, experts_wgrad
from moe_overlap.layers.fp8 import Fp8, fp8_matmul, grouped_mm
from moe_overlap.layers.param_info import param_info
from moe_overlap.layers.wgrad import mark_own_grad
from tests.gpu_launch import require_fp8_gpu

pytestmark = pytest.mark.gpu

FP8_TOL = 0.05  # an FP8 GEMM against fp32 on the same inputs (bf16's is about 0.004)
EMULATED_TOL = 1e-2  # the FP8 GEMM against the emulated one (bf16 output, accumulation order)
RECIPES = ["rowwise", "blockwise"]


def real_and_emulated(recipe: str) -> tuple[Fp8, Fp8]:
    return Fp8(recipe=recipe), Fp8(emulate=True, recipe=recipe)


@pytest.fixture(autouse=True)
def fp8_gpu():
    require_fp8_gpu()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -------------------------------------------------------------------------------------------- quantize kernels


@pytest.mark.parametrize("shape", [(8, 1024, 2048), (3, 333, 1041)], ids=["experts", "odd"])
def test_gpu_fp8_weight_quantizers_read_a_master_as_its_bf16_values(shape):
    """``as_dtype`` (train.fp8_param: the copies quantized from the fp32 master, rounded to bf16 in registers): every
    weight quantizer's compiled kernel fed the master equals it fed the master's bf16 values, bit for bit, and
    differs from the master read unrounded."""
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(shape, device="cuda") * torch.logspace(-2, 2, shape[-1], device="cuda")
    x_bf16 = x.to(bf16)
    for quantize in (quantize_rows, quantize_columns):
        (q, scale), (q_want, scale_want) = quantize(x, as_dtype=bf16), quantize(x_bf16)
        assert same_fp8(q, q_want) and torch.equal(scale, scale_want), quantize.__name__
        assert not torch.equal(scale, quantize(x)[1]), quantize.__name__
    for got, want in zip(quantize_rows_and_columns(x, as_dtype=bf16), quantize_rows_and_columns(x_bf16)):
        assert same_fp8(got[0], want[0]) and torch.equal(got[1], want[1])
    for amax_of in (row_amax, column_amax):
        assert torch.equal(amax_of(x, as_dtype=bf16), amax_of(x_bf16)), amax_of.__name__
    if shape[-1] % 128 == 0 and shape[-2] % 128 == 0:
        for transpose in (False, True):
            (q, scale), (q_want, scale_want) = (quantize_blocks(x, transpose=transpose, as_dtype=bf16),
                                                quantize_blocks(x_bf16, transpose=transpose))
            assert same_fp8(q, q_want) and torch.equal(scale, scale_want), transpose


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_triton_quantize_equals_twin(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(3, 333, 1040, device="cuda", generator=g) * 4).to(dtype)
    x[0, 7] = 0  # a row of zeros
    x[1, :, 5] = 0  # a column of zeros
    x[2, 9, 11] = 3e4  # an outlier
    for got, want in ((quantize_rows(x), quantize_rows_torch(x)), (quantize_rows(x[1]), quantize_rows_torch(x[1])),
                      (quantize_columns(x), quantize_columns_torch(x)),
                      (quantize_columns(x[2]), quantize_columns_torch(x[2]))):
        assert torch.equal(got[1], want[1]), "scales"
        differ = (got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum()
        assert differ == 0, f"{int(differ)} of {got[0].numel()} FP8 values differ from the twin"
    bound = torch.tensor([100], dtype=torch.int32, device="cuda")  # rows from 100 on are not written
    q, scale = torch.zeros(333, 1040, dtype=torch.float8_e4m3fn, device="cuda"), torch.full((333,), -1.0, device="cuda")
    quantize_rows(x[0], q, scale, rows_bound=bound)
    want_q, want_scale = quantize_rows_torch(x[0, :100])
    assert same_fp8(q[:100], want_q) and torch.equal(scale[:100], want_scale)
    assert (scale[100:] == -1).all() and (q[100:].float() == 0).all()
    # a worst-case buffer's counted rows: more rows than a bounded launch has programs, so each strides
    rows = (torch.randn(30000, 256, device="cuda", generator=g) * 4).to(dtype)
    bound = torch.tensor([25000], dtype=torch.int32, device="cuda")
    q, scale = torch.zeros(30000, 256, dtype=torch.float8_e4m3fn, device="cuda"), torch.full((30000,), -1.0,
                                                                                               device="cuda")
    quantize_rows(rows, q, scale, rows_bound=bound)
    want_q, want_scale = quantize_rows_torch(rows[:25000])
    assert same_fp8(q[:25000], want_q) and torch.equal(scale[:25000], want_scale)
    assert (scale[25000:] == -1).all() and (q[25000:].float() == 0).all()
    got = dequantize_rows(q, scale.clamp(min=0), torch.bfloat16, rows_bound=bound)
    assert torch.equal(got[:25000], dequantize(want_q, want_scale).bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [-1, -2], ids=["rows", "columns"])
def test_fp8_scales_from_a_shared_amax_equal_twin(dtype, dim):
    """The scales tensor and expert-TP share: row_amax / column_amax, then quantize_rows / quantize_columns from a
    given (larger) amax, bit for bit the twin's quantization with that amax, on a 2-D x and a weight's matrices."""
    amax_of, quantize, twin = ((row_amax, quantize_rows, quantize_rows_torch) if dim == -1 else
                               (column_amax, quantize_columns, quantize_columns_torch))
    g = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(3, 333, 1040, device="cuda", generator=g) * 4).to(dtype)
    x[0, 7] = 0  # a row of zeros
    x[1, :, 5] = 0  # a column of zeros
    x[2, 9, 11] = 3e4  # an outlier
    for part in (x, x[1]):
        amax = amax_of(part)
        assert torch.equal(amax, part.float().abs().amax(dim))
        shared = amax * torch.rand(amax.shape, device="cuda", generator=g).add(1.0)
        q, scale = quantize(part, amax=shared)
        q_want, scale_want = twin(part, amax=shared)
        assert torch.equal(scale, scale_want) and same_fp8(q, q_want)


def test_fp8_packed_wire_rows_equal_twins():
    """The FP8 dispatch's wire rows: quantized straight into strided views of packed rows (bytes, then the float32
    scale), dequantized by one Triton pass into bf16: the same bytes and values as the torch twins."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(517, 2048, device="cuda", generator=g) * 3).bfloat16()
    rows = torch.zeros(517, 1040, dtype=torch.bfloat16, device="cuda")  # 2,080 bytes: 2,048 + scale + 28 spare
    bytes_ = rows.view(torch.uint8)
    q, scale = bytes_[:, :2048].view(torch.float8_e4m3fn), bytes_[:, 2048:2052].view(torch.float32)[:, 0]
    quantize_rows(x, q, scale)
    want_q, want_scale = quantize_rows_torch(x)
    assert same_fp8(q, want_q) and torch.equal(scale, want_scale)
    assert (bytes_[:, 2052:] == 0).all()
    got = dequantize_rows(q, scale, torch.bfloat16)
    assert torch.equal(got, dequantize(want_q, want_scale).bfloat16())


@pytest.mark.parametrize("shape", [(8, 4096, 28672), (8, 14336, 4096), (3, 333, 1041), (777, 130)],
                         ids=["mixtral_w13", "mixtral_w2", "odd", "odd_2d"])
def test_fp8_rows_and_columns_equal_the_two_kernels(shape):
    """A weight's two rowwise copies from one quantize_rows_and_columns (two passes over it, maxima combined by
    atomics): quantize_rows and quantize_columns bit for bit, on Mixtral's expert weights (0.9G and 0.5G elements)
    and odd sizes (rows and columns not multiples of the 64 x 64 tiles, K not of 16: unaligned rows); written in
    place into given buffers, as the weight cache does. The odd shapes against the twins too."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    x[..., 7, :] = 0  # a row of zeros
    x[..., 5] = 0  # a column of zeros
    x[..., 9, 11] = 3e4  # an outlier
    rows_want, columns_want = quantize_rows(x), quantize_columns(x)
    rows_out, columns_out = tuple(map(torch.empty_like, rows_want)), tuple(map(torch.empty_like, columns_want))
    rows, columns = quantize_rows_and_columns(x, rows_out, columns_out)
    assert rows[0] is rows_out[0] and columns[1] is columns_out[1]
    for got, want in ((rows, rows_want), (columns, columns_want)):
        assert torch.equal(got[1], want[1]), "scales"
        differ = int((got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum())
        assert differ == 0, f"{differ} of {got[0].numel()} FP8 values differ from the separate kernels"
    if x.numel() < 2**24:
        for got, want in ((rows, quantize_rows_torch(x)), (columns, quantize_columns_torch(x))):
            assert same_fp8(got[0], want[0]) and torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------------------------- FP8 GEMMs


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_dense_gemms_against_fp32_and_emulated(recipe):
    real_fp8, emulated_fp8 = real_and_emulated(recipe)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1000, 1024, device="cuda", generator=g).bfloat16()  # rows need not be a multiple of 16
    w = (torch.randn(768, 1024, device="cuda", generator=g) * 0.02).bfloat16()
    grad_y = torch.randn(1000, 768, device="cuda", generator=g).bfloat16()
    fast_dgrad = dataclasses.replace(real_fp8, fast_dgrad=True)  # train.fp8_dgrad_accumulation=fast (rowwise)
    cases = [("forward x @ W^T", x, True, True, real_fp8, x.float() @ w.float().t()),
             ("dgrad grad_y @ W", grad_y, False, False, real_fp8, grad_y.float() @ w.float())]
    if recipe == "rowwise":
        cases.append(("fast dgrad grad_y @ W", grad_y, False, False, fast_dgrad, grad_y.float() @ w.float()))
    for name, a, contract_last, fast, fp8, want in cases:
        got = fp8_matmul(a, w, contract_last, fp8, fast_accum=fast)
        assert got.dtype == torch.bfloat16 and rel(got, want) < FP8_TOL, (name, rel(got, want))
        assert rel(got, fp8_matmul(a, w, contract_last, emulated_fp8)) < EMULATED_TOL, name


def grouped_inputs(hidden=512, ffn=768, rows=(300, 0, 17, 640, 123), tail=40):
    """Rows of uneven groups (one empty, some not multiples of 16) and a tail past the last offset holding NaN (the
    static worst-case buffer's unused rows: no valid output may see them)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    total = sum(rows)
    x = torch.randn(total + tail, hidden, device="cuda", generator=g).bfloat16()
    x[total:] = float("nan")
    w13 = (torch.randn(len(rows), hidden, 2 * ffn, device="cuda", generator=g) * 0.03).bfloat16()
    w2 = (torch.randn(len(rows), ffn, hidden, device="cuda", generator=g) * 0.03).bfloat16()
    return x, w13, w2, expert_offsets(torch.tensor(rows, device="cuda")), list(rows), total


def loop_reference(a: torch.Tensor, w: torch.Tensor, rows: list[int], transpose_w: bool = False) -> torch.Tensor:
    outs, start = [], 0
    for e, n in enumerate(rows):
        b = w[e].float().t() if transpose_w else w[e].float()
        outs.append(a[start:start + n].float() @ b)
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_gemms_against_fp32_and_emulated(recipe):
    real_fp8, emulated_fp8 = real_and_emulated(recipe)
    x, w13, w2, offsets, rows, total = grouped_inputs()
    g = torch.Generator(device="cuda").manual_seed(3)
    grad_y = torch.randn(total + 40, w2.shape[-1], device="cuda", generator=g).bfloat16()
    cases = [("forward fc1 x @ w13[e]", x, w13, False, True, real_fp8),
             ("dgrad fc2 grad_y @ w2[e]^T", grad_y, w2, True, False, real_fp8)]
    if recipe == "rowwise":  # train.fp8_dgrad_accumulation=fast
        cases.append(("fast dgrad fc2 grad_y @ w2[e]^T", grad_y, w2, True, False,
                      dataclasses.replace(real_fp8, fast_dgrad=True)))
    for name, a, w, transposed, fast, fp8 in cases:
        got = grouped_mm(a, w, offsets, fp8, transpose_w=transposed, fast_accum=fast)[:total]
        assert torch.isfinite(got).all(), name  # the NaN tail reached no valid row
        want = loop_reference(a, w, rows, transposed)
        assert rel(got, want) < FP8_TOL, (name, rel(got, want))
        emulated = grouped_mm(a, w, offsets, emulated_fp8, transpose_w=transposed)[:total]
        assert rel(got, emulated) < EMULATED_TOL, (name, rel(got, emulated))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_expert_layer_and_wgrad_into_main_grad(recipe):
    """GroupedSwiGLU in FP8 against the emulated path (output, input gradient, both main_grads: their FP8 wgrad
    quantizes dgrad outputs that differ from the emulated ones by bf16 round-off, so an E4M3 value flips now and
    then: 2e-2); the weight gradient GEMMs themselves on the same bf16 inputs into main_grad: in FP8 (train.fp8_wgrad,
    kernels/fp8_wgrad.py) against fp32 and against the emulated path, and with the wgrad off (bf16, the Triton
    grouped kernel) against fp32."""
    real_fp8, emulated_fp8 = real_and_emulated(recipe)
    x, w13, w2, offsets, rows, total = grouped_inputs()
    x[total:] = 0  # the layer's backward reads every row's gradient: keep the tail finite here
    g = torch.Generator(device="cuda").manual_seed(4)
    grad_y = torch.randn(x.shape[0], x.shape[1], device="cuda", generator=g).bfloat16()
    grad_y[total:] = 0
    results = {}
    for name, fp8 in (("real", real_fp8), ("emulated", emulated_fp8)):
        params = [torch.nn.Parameter(w.clone()) for w in (w13, w2)]
        mark_own_grad(*params)
        for param in params:
            param_info(param).main_grad = torch.zeros_like(param, dtype=torch.float32)
        xi = x.clone().requires_grad_()
        out = GroupedSwiGLU.apply(xi, offsets, *params, None, fp8)
        out.backward(grad_y)
        results[name] = [out[:total], xi.grad[:total]] + [param_info(p).main_grad for p in params]
    for what, got, want in zip(("out", "grad_x", "main_grad w13", "main_grad w2"), results["real"],
                               results["emulated"]):
        tol = EMULATED_TOL if what.startswith(("out", "grad")) else 2 * EMULATED_TOL
        assert torch.isfinite(got).all() and rel(got, want) < tol, (what, rel(got, want))

    # the weight-gradient GEMMs themselves, given bf16 inputs: into main_grad in fp32
    a = torch.randn(x.shape[0], w2.shape[1], device="cuda", generator=g).bfloat16()
    grad_h = torch.randn(x.shape[0], w13.shape[-1], device="cuda", generator=g).bfloat16()
    x[total:] = float("nan")  # rows past the last offset: never read
    grads = {}
    for name, fp8 in (("real", real_fp8), ("emulated", emulated_fp8), ("bf16", Fp8(recipe=recipe, wgrad=False))):
        params = [torch.nn.Parameter(w.clone()) for w in (w13, w2)]
        for param in params:
            param_info(param).main_grad = torch.ones_like(param, dtype=torch.float32)  # accumulates onto it
        experts_wgrad(*params, [WgradInputs(x, a, grad_h, grad_y, offsets)], fp8=fp8)
        grads[name] = [param_info(param).main_grad - 1 for param in params]
    for index, (left, right) in enumerate(((x, grad_h), (a, grad_y))):
        want = torch.stack([left[s:e].float().t() @ right[s:e].float() for s, e in
                            zip([0] + offsets[:-1].tolist(), offsets.tolist())])
        assert rel(grads["bf16"][index], want) < 0.01  # bf16 operands, fp32 sums
        assert 0.01 < rel(grads["real"][index], want) < FP8_TOL, rel(grads["real"][index], want)
        assert rel(grads["real"][index], grads["emulated"][index]) < EMULATED_TOL


def test_fp8_moe_permutation_hands_its_experts_fp8_rows(monkeypatch):
    """One EP rank, rowwise FP8 on the GPU, bf16 (the fine-grained bench model's layer shape): the permutation's FP8
    rows (kernels/permute.Fp8Handoff) feed fc1's forward and fc2's input gradient, which then quantize nothing
    themselves, and the layer's output and the experts' weight gradients are bit for bit those without the handoff.
    The probs' gradient is the same sum of fp32 products, but the kernel that writes the FP8 rows beside it may sum
    them in another order, so the router's and the input's gradients are held to fp32 round-off through bf16."""
    from moe_overlap.config import ModelConfig, OverlapConfig
    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.layers import fp8 as fp8_layers
    from moe_overlap.layers.moe import MoELayer

    cfg = ModelConfig(hidden_size=2048, ffn_hidden_size=1024, num_moe_experts=64, moe_router_topk=8)
    quantized = []
    real_quantize = fp8_layers.quantize_rows
    monkeypatch.setattr(fp8_layers, "quantize_rows",
                        lambda x, *a, **k: quantized.append(x.shape[0]) or real_quantize(x, *a, **k))
    results, expert_rows = {}, {}
    for handoff in (True, False):
        torch.manual_seed(7)
        layer = MoELayer(cfg, OverlapConfig(moe_pipeline=False), Mesh.single().ep, device="cuda",
                         dtype=torch.bfloat16)
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(0.0, 0.02)
        layer.experts.fp8 = Fp8(recipe="rowwise", fast_dgrad=True)
        fp8_layers.weights_updated()
        if not handoff:
            layer.experts.fp8_handoff = lambda: None
        quantized.clear()
        x = torch.randn(1, 4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out, _, _ = layer(x)
        out.backward(torch.randn_like(out))
        expert_rows[handoff] = quantized.count(4096 * 8)  # the experts' grouped rows the GEMMs quantized
        results[handoff] = [out, layer.experts.w13.grad, layer.experts.w2.grad, x.grad, layer.router.weight.grad]
    assert expert_rows == {True: 0, False: 2}
    for index, (got, want) in enumerate(zip(results[True], results[False])):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want) if index < 3 else rel(got, want) < 1e-3, (index, rel(got, want))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linears_against_emulated(recipe):
    real_fp8, emulated_fp8 = real_and_emulated(recipe)
    from moe_overlap.distributed.ring import TPComm
    from moe_overlap.layers.tp_linear import ColumnParallelLinear, RowParallelLinear

    comm = TPComm.single()
    fc1 = ColumnParallelLinear(512, 1024, comm, device="cuda", dtype=torch.bfloat16)
    fc2 = RowParallelLinear(1024, 512, comm, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        fc1.weight.normal_(0, 0.03)
        fc2.weight.normal_(0, 0.03)
    x = torch.randn(999, 512, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn(999, 512, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name, fp8 in (("real", real_fp8), ("emulated", emulated_fp8), ("fp32", None)):
        fc1.fp8 = fc2.fp8 = fp8
        xi = (x.float() if fp8 is None else x).clone().requires_grad_()
        if fp8 is None:
            fc1.float(), fc2.float()
        y = fc2(torch.nn.functional.silu(fc1(xi)))  # smooth: a relu's mask would flip where FP8 moves h past 0
        y.backward(grad_y.to(y.dtype))
        results[name] = (y, xi.grad, fc1.weight.grad.clone(), fc2.weight.grad.clone())
        fc1.weight.grad = fc2.weight.grad = None
    for what, got, want, exact in zip(("out", "grad_x", "grad fc1", "grad fc2"), results["real"],
                                      results["emulated"], results["fp32"]):
        assert rel(got, want) < EMULATED_TOL, (what, rel(got, want))
        assert rel(got, exact) < 2 * FP8_TOL, (what, rel(got, exact))  # two FP8 GEMMs in a row


@pytest.mark.parametrize("shape", [(8, 1024, 4096), (3, 333, 1041)], ids=["experts", "odd"])
def test_gpu_adamw_step_leaves_the_bf16_maxima(shape):
    """The optimizer step that also leaves its new weights' row and column maxima (train.fp8_param, compiled): the
    master and moments the flat kernel writes, bit for bit, and the maxima of the new master read as bf16 exactly;
    quantize_rows_and_columns given them equals it making its own."""
    from moe_overlap.kernels.adamw import AdamWHyper, WeightMaxima, adamw_update, adamw_update_triton

    hyper = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    control = torch.tensor([0.5, 3.0, 1.0], device="cuda")

    def state() -> list[torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(0)
        return [torch.randn(shape, generator=g, device="cuda"), torch.randn(shape, generator=g, device="cuda"),
                torch.randn(shape, generator=g, device="cuda") * 0.1,
                torch.rand(shape, generator=g, device="cuda") * 0.01]

    flat, tiled = state(), state()
    adamw_update_triton(*flat, None, control, hyper)
    M, K = shape[-2:]
    B = flat[0].numel() // (M * K)
    maxima = WeightMaxima(torch.zeros(B * M, device="cuda"), torch.zeros(B * K, device="cuda"), torch.bfloat16)
    adamw_update(*tiled, None, control, hyper, maxima)
    assert all(torch.equal(t, f) for t, f in zip(tiled, flat))
    weights = tiled[0].view(B, M, K).to(torch.bfloat16).float().abs()
    assert torch.equal(maxima.rows_BM, weights.amax(-1).reshape(-1))
    assert torch.equal(maxima.columns_BK, weights.amax(-2).reshape(-1))
    given = quantize_rows_and_columns(tiled[0], as_dtype=torch.bfloat16,
                                      amax=(maxima.rows_BM.view(*shape[:-1]), maxima.columns_BK.view(*shape[:-2], K)))
    for got, want in zip(given, quantize_rows_and_columns(tiled[0], as_dtype=torch.bfloat16)):
        assert same_fp8(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------------------ training steps


def train_losses(tmp_path, fp8: bool, graphed: bool, steps: int = 6, recipe: str = "rowwise",
                 held: bool = True, distributed: bool = False, dgrad: str = "exact") -> list[float]:
    from moe_overlap.config import load_config
    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.trainer import Trainer

    overrides = {
        "model.num_layers": 4, "model.hidden_size": 256, "model.ffn_hidden_size": 512,
        "model.num_attention_heads": 4, "model.num_query_groups": 2, "model.seq_length": 256,
        "model.num_moe_experts": 8, "model.moe_layer_freq": "[0,1,1,1]", "model.moe_ffn_hidden_size": 256,
        "model.moe_router_topk": 2, "model.moe_shared_expert_intermediate_size": 256,
        "train.micro_batch_size": 2, "train.global_batch_size": 8, "train.lr": 1e-3, "train.lr_warmup_steps": 1,
        "train.max_steps": steps, "train.eval_interval": 0, "train.precision": "bf16", "train.device": "cuda",
        "train.moe_cuda_graph": str(graphed).lower(), "train.output_dir": str(tmp_path / "run"),
        "overlap.overlap_moe_expert_parallel_comm": "false",  # one set of graphs, one stream (auto pairs graphed)
        "checkpoint.save_final": "false", "train.use_distributed_optimizer": str(distributed).lower(),
    }
    if fp8:  # every GEMM and the experts' weight gradients in FP8 (auto leaves this narrow model's in bf16)
        overrides.update({"train.fp8_recipe": recipe, "train.num_layers_at_start_in_bf16": 1,
                          "train.fp8_wgrad": "true", "train.fp8_gemm_min_dim": 0,
                          "train.fp8_param": str(held).lower(), "train.fp8_dgrad_accumulation": dgrad})
    trainer = Trainer(load_config(None, [f"{k}={v}" for k, v in overrides.items()]), Mesh.single(),
                      torch.device("cuda"))
    experts = trainer.model.layers["1"].mlp.experts
    replays_checked = []
    if graphed and fp8:  # after the refresh hook graph_moe_layers installed: the copies are current
        def check_fresh(_module, _args):
            master = param_info(experts.w13).fp8_master  # train.fp8_param: the weight's values are its copies now
            weights = experts.w13.detach() if master is None else master.to(torch.bfloat16)
            for (layout, _), entry in experts.w13.fp8_cache.items():
                quantize = {"rows": quantize_rows_torch, "columns": quantize_columns_torch,
                            "blocks": quantize_blocks_torch, "blocks_t": partial(quantize_blocks_torch, transpose=True)}
                fresh = quantize[layout](weights)
                assert same_fp8(entry.q, fresh[0]) and torch.equal(entry.scale, fresh[1])
            replays_checked.append(True)

        trainer.model.layers["1"].mlp.register_forward_pre_hook(check_fresh)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    assert (experts.fp8 is not None) == fp8, "train.fp8_recipe did not reach the model (the trainer's wiring)"
    assert experts.fp8 is None or (experts.fp8.wgrad and experts.fp8.min_dim == 0
                                   and experts.fp8.fast_dgrad == (dgrad == "fast")), \
        "train.fp8_wgrad, train.fp8_gemm_min_dim or train.fp8_dgrad_accumulation did not reach the model"
    assert bool(getattr(experts.w13, "fp8_cache", None)) == fp8  # the FP8 path ran
    assert len(replays_checked) == (4 * steps if graphed and fp8 else 0)  # 4 micro-batches a step
    assert trainer.model.layers["0"].mlp.linear_fc1.fp8 is None  # the first layer stayed bf16
    assert param_info(experts.w13).holds_fp8 == (fp8 and held)  # train.fp8_param reached the optimizer
    assert not param_info(trainer.model.layers["0"].mlp.linear_fc1.weight).holds_fp8
    return losses


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_train_steps_close_to_bf16_and_graphed_equals_eager(tmp_path, recipe):
    bf16 = train_losses(tmp_path / "bf16", fp8=False, graphed=False)
    eager = train_losses(tmp_path / "eager", fp8=True, graphed=False, recipe=recipe)
    graphed = train_losses(tmp_path / "graphed", fp8=True, graphed=True, recipe=recipe)
    print("losses bf16", bf16, "fp8", eager, "fp8 graphed", graphed)
    assert all(torch.isfinite(torch.tensor(losses)).all() for losses in (bf16, eager, graphed))
    assert bf16[-1] < bf16[0] and eager[-1] < eager[0]  # both learn
    assert max(abs(f - b) / b for f, b in zip(eager, bf16)) < 0.02
    assert max(abs(g - e) / e for g, e in zip(graphed, eager)) < 2e-3


def test_fp8_fast_dgrad_train_steps_close_to_bf16_and_graphed_equals_eager(tmp_path):
    """train.fp8_dgrad_accumulation=fast (rowwise): the model's steps as close to bf16's as the exact input
    gradients' (test above), graphed as eager."""
    bf16 = train_losses(tmp_path / "bf16", fp8=False, graphed=False)
    eager = train_losses(tmp_path / "eager", fp8=True, graphed=False, dgrad="fast")
    graphed = train_losses(tmp_path / "graphed", fp8=True, graphed=True, dgrad="fast")
    print("losses bf16", bf16, "fp8 fast dgrad", eager, "graphed", graphed)
    assert all(torch.isfinite(torch.tensor(losses)).all() for losses in (eager, graphed))
    assert eager[-1] < eager[0]
    assert max(abs(f - b) / b for f, b in zip(eager, bf16)) < 0.02
    assert max(abs(g - e) / e for g, e in zip(graphed, eager)) < 2e-3


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed_optimizer"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_fp8_param_trains_as_the_bf16_weights(tmp_path, recipe, distributed):
    """train.fp8_param (the FP8 weights held only as their copies, quantized from the masters read as bf16) against
    the copies kept beside the bf16 weights: the first step bit for bit (the same copies, the same GEMMs); after it
    the runs part only by the weight gradients' unordered atomic sums, as two launches of one run do. With the
    distributed optimizer at one rank, whose shards are whole, as with the plain one."""
    held = train_losses(tmp_path / "held", fp8=True, graphed=False, recipe=recipe, held=True, distributed=distributed)
    kept = train_losses(tmp_path / "kept", fp8=True, graphed=False, recipe=recipe, held=False,
                        distributed=distributed)
    print("losses held", held, "kept", kept)
    assert held[0] == kept[0]
    assert max(abs(h - k) / k for h, k in zip(held, kept)) < 2e-3
