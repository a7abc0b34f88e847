"""The blockwise FP8 GEMM's Triton kernel on Hopper's FP8 tensor cores (`pytest -m gpu`; H100/H200): bf16 out
within 1e-2 normwise of its torch twin (fp32 on the dequantized operands) and within 0.05 of fp32 on the
unquantized inputs, dense and grouped (uneven groups, empty ones, rows past the last offset left unwritten), in
both orientations of one weight copy, at Mixtral-like sizes; blockwise_mm runs it on CUDA, and the dense a @ w^T
on cuBLAS's blockwise GEMM (within the twin's tolerance; what cuBLAS does not take stays on the kernel); replayed
from a CUDA graph it equals the eager call, also after the group offsets changed in place on the device. The
quantize kernels (tiles through the rows kernel, blocks as they are and transposed) equal their twins bit for bit.
Times nothing: see benchmarks/step_kernels.py --sections fp8_blockwise.

    CUDA_VISIBLE_DEVICES=0 python -m pytest -m gpu tests/test_gpu_fp8_blockwise.py
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moe_overlap.kernels.fp8_blockwise import (blockwise_mm, blockwise_mm_torch, blockwise_mm_triton, cublas_takes,
                                               quantize_blocks, quantize_blocks_torch, quantize_tiles,
                                               quantize_tiles_torch)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp8_kernel_gpu")]

FP8_TOL = 0.05  # the FP8 GEMM against fp32 on the unquantized inputs
TWIN_TOL = 1e-2  # against the twin: bf16 output, the order of the fp32 sums
M, K_HIDDEN, K_FFN, E = 4096, 1024, 2048, 8  # w (E, 2048, 1024): fc2's shape read forward, fc1's read in dgrad
GROUP_ROWS = [700, 0, 1000, 13, 555, 900, 128, 300]  # 3596 of 4096 rows: the last 500 past the last offset


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def offsets_of(rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, device="cuda").cumsum(0).to(torch.int32)


def inputs(contract_last: bool, grouped: bool, seed: int):
    """a (M, K) and w bf16, and their blockwise FP8 operands: a_q, a_scale, w_q, w_scale."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    K = K_HIDDEN if contract_last else K_FFN
    a = (torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-1, 1, M, device="cuda")[:, None]).bfloat16()
    w = (torch.randn(*((E,) if grouped else ()), K_FFN, K_HIDDEN, device="cuda", generator=g) * 0.02).bfloat16()
    return a, w, (*quantize_tiles(a), *quantize_blocks(w))


@pytest.mark.parametrize("contract_last", [True, False], ids=["forward_a_wT", "dgrad_a_w"])
@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_fp8_blockwise_kernel_against_twin_and_fp32(contract_last, grouped):
    a, w, operands = inputs(contract_last, grouped, seed=0)
    offsets = offsets_of(GROUP_ROWS) if grouped else None
    rows = sum(GROUP_ROWS) if grouped else M
    out = torch.full((M, K_FFN if contract_last else K_HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = blockwise_mm_triton(*operands, contract_last, offsets, out=out)
    twin = blockwise_mm_torch(*operands, contract_last, offsets)
    assert got.isfinite()[:rows].all()
    assert rel(got[:rows], twin[:rows]) < TWIN_TOL
    if grouped:
        assert got[rows:].isnan().all()  # rows past the last offset left unwritten
        bounds = [0, *offsets.tolist()]
        want = torch.cat([a[s:t].float() @ (w[e].float().T if contract_last else w[e].float())
                          for e, (s, t) in enumerate(zip(bounds, bounds[1:]))])
    else:
        want = a.float() @ (w.float().T if contract_last else w.float())
    assert rel(got[:rows], want) < FP8_TOL
    if cublas_takes(operands[0], contract_last, offsets, torch.bfloat16):  # the dense a @ w^T: cuBLAS, next test
        assert rel(blockwise_mm(*operands, contract_last, offsets), twin) < TWIN_TOL
    else:
        assert torch.equal(blockwise_mm(*operands, contract_last, offsets)[:rows], got[:rows])  # the kernel on CUDA


@pytest.mark.parametrize("scales", ["as_quantized", "rows_major", "one_per_row"])
def test_fp8_blockwise_dense_products_go_to_cublas(scales, monkeypatch):
    """A dense a @ w^T whose contraction is a multiple of 512 runs on cuBLAS's blockwise GEMM, within the twin's
    tolerance of the twin and of the Triton kernel, from the tile scales as quantize_tiles writes them
    (column-major), row-major, or one per row (a stride-0 view, as rows that crossed the FP8 dispatch carry them);
    what cuBLAS does not take stays on the Triton kernel, bit for bit."""
    import moe_overlap.kernels.fp8_blockwise as B
    a, w, (a_q, a_scale, w_q, w_scale) = inputs(True, False, seed=3)
    assert a_scale.stride() == (1, M)  # quantize_tiles' layout, what cuBLAS reads
    if scales == "rows_major":
        a_scale = a_scale.contiguous()
    elif scales == "one_per_row":
        a_scale = a_scale[:, :1].expand(-1, a_scale.shape[1])
    triton_out, twin = blockwise_mm_triton(a_q, a_scale, w_q, w_scale, True), blockwise_mm_torch(
        a_q, a_scale, w_q, w_scale, True)
    calls = []
    monkeypatch.setattr(B, "blockwise_mm_triton", lambda *args: calls.append(args) or blockwise_mm_triton(*args))
    assert cublas_takes(a_q, True, None, torch.bfloat16)
    got = blockwise_mm(a_q, a_scale, w_q, w_scale, True)
    assert not calls  # cuBLAS ran, not the kernel
    assert got.dtype == torch.bfloat16 and rel(got, twin) < TWIN_TOL and rel(got, triton_out) < TWIN_TOL
    if scales != "one_per_row":  # (those scales are not a's own)
        assert rel(got, a.float() @ w.float().T) < FP8_TOL

    offsets = torch.tensor([M], device="cuda", dtype=torch.int32)
    declined = [(a_q[:, :640], a_scale[:, :5], w_q[:, :640], w_scale[:, :5], True, None),  # not a multiple of 512
                (a_q, a_scale, w_q[None], w_scale[None], True, offsets),  # grouped
                (a_q[:999], a_scale[:999], w_q, w_scale, True, None)]  # rows not a multiple of 4
    for operands in declined:
        assert not cublas_takes(operands[0], operands[4], operands[5], torch.bfloat16)
        assert torch.equal(blockwise_mm(*operands), blockwise_mm_triton(*operands))
    assert len(calls) == 3
    assert not cublas_takes(a_q, True, None, torch.float32) and not cublas_takes(a_q, False, None, torch.bfloat16)


@pytest.mark.parametrize("rows", [4080, 4076, 272, 12])
def test_fp8_blockwise_cublas_takes_rows_in_fours(rows):
    """Row counts a multiple of 4 but not of 128 (a micro-batch's tokens need not be): cuBLAS takes them, at the
    twin's distance. Which others torch._scaled_mm takes is reported as a warning (cublas_takes asks for fours)."""
    _, _, (a_q, a_scale, w_q, w_scale) = inputs(True, False, seed=5)
    a_q, a_scale = a_q[:rows].contiguous(), a_scale[:rows].t().contiguous().t()
    assert cublas_takes(a_q, True, None, torch.bfloat16)
    got = blockwise_mm(a_q, a_scale, w_q, w_scale, True)
    assert rel(got, blockwise_mm_torch(a_q, a_scale, w_q, w_scale, True)) < TWIN_TOL
    taken = {}
    for other in (rows - 4, rows - 2, rows - 1):
        q, sc = a_q[:other].contiguous(), a_scale[:other].t().contiguous().t()
        try:
            torch._scaled_mm(q, w_q.t(), scale_a=sc, scale_b=w_scale.t(), out_dtype=torch.bfloat16)
            taken[other] = True
        except RuntimeError:
            taken[other] = False
    assert all(ok for other, ok in taken.items() if other % 4 == 0), taken
    warnings.warn(f"cuBLAS's blockwise GEMM takes rows: {taken}")


def test_fp8_blockwise_cublas_product_replays_in_a_cuda_graph():
    """cuBLAS's dense product, scales copied to column-major inside the capture, replays to the eager result."""
    _, _, (a_q, a_scale, w_q, w_scale) = inputs(True, False, seed=4)
    a_scale = a_scale.contiguous()  # row-major: the capture holds the layout's copy too
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        blockwise_mm(a_q, a_scale, w_q, w_scale, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = blockwise_mm(a_q, a_scale, w_q, w_scale, True)
    a_q.copy_(a_q.flip(0))
    a_scale.copy_(a_scale.flip(0))
    graph.replay()
    assert torch.equal(out, blockwise_mm(a_q, a_scale, w_q, w_scale, True))


def test_fp8_blockwise_kernel_ragged_dense_rows():
    """A dense M that no tile divides: the last tile's rows masked."""
    _, _, (a_q, a_scale, w_q, w_scale) = inputs(True, False, seed=1)
    got = blockwise_mm_triton(a_q[:4001], a_scale[:4001], w_q, w_scale, True)
    twin = blockwise_mm_torch(a_q[:4001], a_scale[:4001], w_q, w_scale, True)
    assert got.shape == (4001, K_FFN) and rel(got, twin) < TWIN_TOL


@pytest.mark.parametrize("contract_last", [True, False], ids=["forward_a_wT", "dgrad_a_w"])
def test_fp8_blockwise_kernel_replays_in_a_cuda_graph(contract_last):
    """Captured once, replayed with the group offsets rewritten in place: the static grid reads the group sizes on
    the device (a host sync would fail the capture), so each replay equals an eager call on the offsets of then."""
    _, _, operands = inputs(contract_last, True, seed=2)
    offsets = offsets_of(GROUP_ROWS)
    out = torch.zeros(M, K_FFN if contract_last else K_HIDDEN, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled before the capture
        blockwise_mm_triton(*operands, contract_last, offsets, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        blockwise_mm_triton(*operands, contract_last, offsets, out=out)

    first = blockwise_mm_triton(*operands, contract_last, offsets)
    out.zero_()
    graph.replay()
    rows = sum(GROUP_ROWS)
    assert torch.equal(out[:rows], first[:rows])
    assert (out[rows:] == 0).all()

    moved = [1024, 1024, 0, 7, 900, 1000, 1, 140]  # 4096 rows: every row counted, groups moved
    offsets.copy_(offsets_of(moved))
    graph.replay()
    again = blockwise_mm_triton(*operands, contract_last, offsets)
    assert torch.equal(out, again)
    assert not torch.equal(out[:rows], first[:rows])  # the replay read the new offsets


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_blockwise_quantize_kernels_equal_twins(dtype):
    g = torch.Generator(device="cuda").manual_seed(5)
    w = (torch.randn(3, 384, 1024, device="cuda", generator=g) * 4).to(dtype)
    w[1, :128, 512:640] = 0  # a block of zeros
    w[2, 7, 9] = 3e4  # an outlier
    for transpose in (False, True):
        (q, scale), (q_twin, scale_twin) = quantize_blocks(w, transpose=transpose), quantize_blocks_torch(w, transpose)
        assert torch.equal(q.view(torch.uint8), q_twin.view(torch.uint8)) and torch.equal(scale, scale_twin)
    x = w[0, :300]
    (q, scale), (q_twin, scale_twin) = quantize_tiles(x), quantize_tiles_torch(x)
    assert torch.equal(q.view(torch.uint8), q_twin.view(torch.uint8)) and torch.equal(scale, scale_twin)


@pytest.mark.parametrize("config", [(64, 4, 4), (64, 4, 3), (128, 8, 3), (64, 8, 4)],
                         ids=["64-rows", "64-rows-3-stages", "128-rows", "64-rows-8-warps"])
def test_fp8_blockwise_kernel_configs_against_twin(config):
    """The default tile configs (by the contraction's depth) and some that step_kernels.py sweeps."""
    _, _, operands = inputs(True, True, seed=6)
    offsets = offsets_of(GROUP_ROWS)
    rows = sum(GROUP_ROWS)
    got = blockwise_mm_triton(*operands, True, offsets, config=config)
    assert rel(got[:rows], blockwise_mm_torch(*operands, True, offsets)[:rows]) < TWIN_TOL
