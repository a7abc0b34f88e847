"""FP8 of the blockwise recipe on CPU: the quantize twins (1x128 tiles, 128x128 blocks: scales, round trip, given
buffers, a per-row scale broadcast along a row's tiles), the refusals of dimensions not a multiple of 128, and the
GEMM's Triton kernel under the interpreter against its torch twin (dense and grouped, both orientations of one
weight copy, a ragged last tile, an empty group, a group smaller than a tile, the rows past the last offset left
unwritten, a stride-0 scale), fed FP8 and float32 holding the same E4M3 values. The kernel on Hopper's FP8 tensor
cores is in tests/test_gpu_fp8_blockwise.py."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.kernels import fp8_blockwise as B
from moe_overlap.kernels.fp8_quant import AMAX_FLOOR, FP8, FP8_MAX, dequantize, quantize_rows
from moe_overlap.kernels.launch import HAVE_TRITON

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not importable")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def assert_rounding_bound(back: torch.Tensor, x: torch.Tensor, scale_like_x: torch.Tensor) -> None:
    """E4M3 rounds to nearest: half an ulp, 2^-4 relative for normals; subnormals (below 2^-6) step by 2^-9."""
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale_like_x * 2.0 ** -10)
    assert ((back - x).abs() <= bound * 1.0001).all()


# ------------------------------------------------------------------------------------------- quantize twins


def test_fp8_tiles_twin_scales_and_round_trip():
    torch.manual_seed(0)
    x = torch.randn(2, 37, 384) * torch.logspace(-3, 3, 37).unsqueeze(-1)  # rows of very different ranges
    x[0, 5, 128:256] = 0  # a tile of zeros
    x[1, 9, 300] = 3e4  # an outlier: only its own tile's scale grows
    q, scale = B.quantize_tiles(x)
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (2, 37, 3)
    amax = x.reshape(2, 37, 3, 128).abs().amax(-1)
    assert torch.equal(scale, amax.clamp(min=AMAX_FLOOR) / FP8_MAX)
    largest = q.float().reshape(2, 37, 3, 128).abs().amax(-1)
    assert torch.equal(largest, torch.where(amax > 0, FP8_MAX, 0.0))  # each tile's largest at 448, zeros stay 0
    assert scale[1, 9, 2] > 10 * scale[1, 9, 1]
    back = B.dequantize_tiles(q, scale)
    assert torch.equal(back, q.float() * scale.repeat_interleave(128, -1))  # q times its tile's scale
    assert_rounding_bound(back, x, scale.repeat_interleave(128, -1))
    assert rel_err(back, x) < 0.04


def test_fp8_blocks_twin_scales_round_trip_and_given_buffers():
    torch.manual_seed(1)
    w = torch.randn(2, 256, 384) * torch.logspace(-2, 2, 256).unsqueeze(-1)
    w[1, :128, 256:] = 0  # a block of zeros
    q, scale = B.quantize_blocks(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.shape == (2, 2, 3)
    blocks = w.reshape(2, 2, 128, 3, 128).transpose(2, 3)  # (E, P / 128, Q / 128, 128, 128)
    amax = blocks.abs().amax((-2, -1))
    assert torch.equal(scale, amax.clamp(min=AMAX_FLOOR) / FP8_MAX)
    largest = q.float().reshape(2, 2, 128, 3, 128).transpose(2, 3).abs().amax((-2, -1))
    assert torch.equal(largest, torch.where(amax > 0, FP8_MAX, 0.0))
    scale_like_w = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)
    back = B.dequantize_blocks(q, scale)
    assert torch.equal(back, q.float() * scale_like_w)
    assert_rounding_bound(back, w, scale_like_w)
    assert rel_err(back, w) < 0.04

    q_out, scale_out = torch.zeros_like(q), torch.full_like(scale, -1.0)  # a cached copy refreshed in place
    got_q, got_scale = B.quantize_blocks(w, q_out, scale_out)
    assert got_q is q_out and got_scale is scale_out
    assert torch.equal(q_out.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale_out, scale)
    with pytest.raises(ValueError, match="contiguous"):
        B.quantize_blocks(w, q_out, torch.empty(2, 3, 2).transpose(-2, -1))


def test_fp8_blocks_transposed_are_the_blocks_of_the_transpose():
    torch.manual_seed(3)
    w = torch.randn(3, 256, 384)
    q, scale = B.quantize_blocks(w)
    q_t, scale_t = B.quantize_blocks(w, transpose=True)
    assert q_t.shape == (3, 384, 256) and q_t.is_contiguous() and scale_t.shape == (3, 3, 2)
    assert torch.equal(q_t.view(torch.uint8), q.transpose(-2, -1).contiguous().view(torch.uint8))
    assert torch.equal(scale_t, scale.transpose(-2, -1))
    assert torch.equal(q_t.view(torch.uint8), B.quantize_blocks(w.transpose(-2, -1).contiguous())[0].view(torch.uint8))


def test_fp8_blockwise_quantize_kernels_under_the_interpreter(monkeypatch):
    """The block kernel's indexing, scales and transposed stores on CPU, and the tiles kernel's; q may differ from
    the twin only where the interpreter's own E4M3 cast is known to be wrong (tests/test_fp8.py says how), on GPU
    it must equal it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(4)
    w = torch.randn(2, 256, 384) * torch.logspace(-1, 1, 256).unsqueeze(-1)
    w[1, :128, 256:] = 0
    for transpose in (False, True):
        (q, scale), (q_twin, scale_twin) = B.quantize_blocks(w, transpose=transpose), B.quantize_blocks_torch(
            w, transpose)
        assert torch.equal(scale, scale_twin), transpose
        twin = q_twin.float().abs()
        interpreter_fault = (twin < 2.0 ** -6) | (torch.log2(twin) == torch.log2(twin).round())
        differs = q.float() != q_twin.float()
        assert not (differs & ~interpreter_fault).any(), int((differs & ~interpreter_fault).sum())
        assert differs.float().mean() < 0.2
    q_out, scale_out = torch.zeros(2, 384, 256, dtype=FP8), torch.zeros(2, 3, 2)
    got = B.quantize_blocks(w.bfloat16(), q_out, scale_out, transpose=True)  # bf16 in, into given buffers
    assert got[0] is q_out and torch.equal(scale_out, B.quantize_blocks_torch(w.bfloat16(), True)[1])

    x = w[0, :70]  # the tiles' kernel: 70 rows (not a multiple of its 32), rows from the bound on unwritten
    (q, scale), (q_twin, scale_twin) = B.quantize_tiles(x), B.quantize_tiles_torch(x)
    assert torch.equal(scale, scale_twin) and scale.stride() == (1, 70)  # column-major, as cuBLAS reads them
    assert (q.float() != q_twin.float()).float().mean() < 0.2
    (q3, scale3) = B.quantize_tiles(torch.stack([x, -x]))  # more than two dimensions: row-major
    assert scale3.is_contiguous() and torch.equal(scale3[1], scale_twin)
    _, scale_bounded = B.quantize_tiles(x, rows_bound=torch.tensor([50], dtype=torch.int32))
    assert torch.equal(scale_bounded[:50], scale_twin[:50])


def test_fp8_row_scale_broadcast_along_tiles_is_the_rows_dequantization():
    """Rows quantized with one scale each (the rowwise quantizer) read as tiles through a stride-0 view."""
    torch.manual_seed(2)
    x = torch.randn(50, 256) * torch.logspace(-2, 2, 50).unsqueeze(-1)
    q, scale_R = quantize_rows(x)
    scale_view = scale_R[:, None].expand(50, 2)
    assert scale_view.stride() == (1, 0)
    assert torch.equal(B.dequantize_tiles(q, scale_view), dequantize(q, scale_R))


def test_fp8_blockwise_refuses_dimensions_not_multiples_of_128():
    with pytest.raises(ValueError, match="quantized rows' length a multiple of 128, got 200"):
        B.quantize_tiles(torch.randn(4, 200))
    with pytest.raises(ValueError, match="every weight dimension a multiple of 128, got 200"):
        B.quantize_blocks(torch.randn(256, 200))
    fp8 = {"dtype": FP8}
    a, a_scale = torch.zeros(4, 200, **fp8), torch.ones(4, 2)
    w, w_scale = torch.zeros(256, 200, **fp8), torch.ones(2, 2)
    with pytest.raises(ValueError, match="contraction K a multiple of 128, got 200"):
        B.blockwise_mm(a, a_scale, w, w_scale, contract_last=True)
    with pytest.raises(ValueError, match="weight's rows P a multiple of 128, got 200"):
        B.blockwise_mm(torch.zeros(4, 256, **fp8), a_scale, torch.zeros(200, 256, **fp8), w_scale, True)
    with pytest.raises(ValueError, match="weight's columns Q a multiple of 128, got 200"):
        B.blockwise_mm(torch.zeros(4, 256, **fp8), a_scale, torch.zeros(256, 200, **fp8), w_scale, False)


# ------------------------------------------------------------------------------ the Triton kernel, interpreted


def operands(M: int, K: int, w_shape: tuple[int, ...], seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g) * torch.logspace(-1, 1, M).unsqueeze(-1)
    w = torch.randn(*w_shape, generator=g) * 0.05
    return (*B.quantize_tiles(a), *B.quantize_blocks(w))


def held(q: torch.Tensor, as_fp8: bool) -> torch.Tensor:
    """The FP8 tensor itself, or float32 holding its values (the kernel is dtype-generic)."""
    return q if as_fp8 else q.float()


def assert_matches_twin(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # only the order of fp32 sums differs


@needs_triton
@pytest.mark.parametrize("as_fp8", [True, False], ids=["fp8", "float32"])
@pytest.mark.parametrize("contract_last", [True, False], ids=["a_wT", "a_w"])
def test_fp8_blockwise_kernel_dense_equals_twin(monkeypatch, contract_last, as_fp8):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a_q, a_scale, w_q, w_scale = operands(100, 256, (384, 256) if contract_last else (256, 384), seed=3)
    want = B.blockwise_mm_torch(a_q, a_scale, w_q, w_scale, contract_last)
    got = B.blockwise_mm_triton(held(a_q, as_fp8), a_scale, held(w_q, as_fp8), w_scale, contract_last,
                                out_dtype=torch.float32)
    assert got.shape == (100, 384)  # 100 rows: the last tile ragged
    assert_matches_twin(got, want)


@needs_triton
@pytest.mark.parametrize("as_fp8", [True, False], ids=["fp8", "float32"])
@pytest.mark.parametrize("contract_last", [True, False], ids=["a_wT", "a_w"])
def test_fp8_blockwise_kernel_grouped_equals_twin(monkeypatch, contract_last, as_fp8):
    """Groups of 30, 0, 7 (under the interpreter's 16-row tile) and 53 rows; rows 90 to 99 past the last offset.
    One weight copy (E, 256, 384) serves both orientations."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    K, N = (384, 256) if contract_last else (256, 384)
    a_q, a_scale, w_q, w_scale = operands(100, K, (4, 256, 384), seed=4)
    a_q[90:], a_scale[90:] = FP8_MAX, 1e30  # never read: in a group's rows they would be huge (finite)
    offsets = torch.tensor([30, 30, 37, 90], dtype=torch.int32)
    want = B.blockwise_mm_torch(a_q, a_scale, w_q, w_scale, contract_last, offsets)
    out = torch.full((100, N), float("nan"))
    got = B.blockwise_mm_triton(held(a_q, as_fp8), a_scale, held(w_q, as_fp8), w_scale, contract_last, offsets,
                                out_dtype=torch.float32, out=out)
    assert got is out
    assert_matches_twin(got[:90], want[:90])
    assert got[90:].isnan().all()  # rows past the last offset left unwritten
    new = B.blockwise_mm_triton(held(a_q, as_fp8), a_scale, held(w_q, as_fp8), w_scale, contract_last, offsets,
                                out_dtype=torch.float32)  # a new output: the same rows computed
    assert torch.equal(new[:90], got[:90])


@needs_triton
@pytest.mark.parametrize("K", [128, 640], ids=["1-slice", "5-slices"])
def test_fp8_blockwise_kernel_slices_equal_twin(monkeypatch, K):
    """One 128-deep slice, and more slices than the loop's stages: each slice's product scaled into the sum."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a_q, a_scale, w_q, w_scale = operands(100, K, (3, 256, K), seed=6)
    offsets = torch.tensor([41, 41, 97], dtype=torch.int32)
    want = B.blockwise_mm_torch(a_q, a_scale, w_q, w_scale, True, offsets)
    got = B.blockwise_mm_triton(a_q, a_scale, w_q, w_scale, True, offsets, out_dtype=torch.float32,
                                config=(64, 4, 2))
    assert_matches_twin(got[:97], want[:97])


@needs_triton
@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_fp8_blockwise_kernel_stride0_row_scales_equal_twin(monkeypatch, grouped):
    """a quantized with one scale per row, its scales a stride-0 view along the tiles (not materialized)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(5)
    a_q, scale_R = quantize_rows(torch.randn(70, 256, generator=g) * torch.logspace(-1, 1, 70).unsqueeze(-1))
    a_scale = scale_R[:, None].expand(70, 2)
    w_q, w_scale = B.quantize_blocks(torch.randn(*((2,) if grouped else ()), 128, 256, generator=g))
    offsets = torch.tensor([33, 70], dtype=torch.int32) if grouped else None
    want = B.blockwise_mm_torch(a_q, a_scale, w_q, w_scale, True, offsets)
    got = B.blockwise_mm_triton(a_q, a_scale, w_q, w_scale, True, offsets, out_dtype=torch.float32)
    assert_matches_twin(got, want)


@needs_triton
def test_fp8_blockwise_kernel_column_major_and_unaligned_operands_equal_twin(monkeypatch):
    """Operands whose columns are not contiguous, or whose rows are not 16-byte aligned (the TMA reads aligned rows
    of contiguous columns): copied first."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a_q, a_scale, w_q, w_scale = operands(50, 256, (2, 128, 256), seed=8)
    offsets = torch.tensor([20, 50], dtype=torch.int32)
    want = B.blockwise_mm_torch(a_q, a_scale, w_q, w_scale, True, offsets)
    a_cm, w_cm = a_q.float().t().contiguous().t(), w_q.float().transpose(-2, -1).contiguous().transpose(-2, -1)
    assert a_cm.stride(1) != 1 and w_cm.stride(2) != 1
    got = B.blockwise_mm_triton(a_cm, a_scale, w_cm, w_scale, True, offsets, out_dtype=torch.float32)
    assert_matches_twin(got, want)
    # rows starting 4 bytes past a 16-byte boundary (the interpreter's descriptors check the base as the TMA does)
    a_off = torch.empty(a_q.numel() + 4)[1:1 + a_q.numel()].view(a_q.shape).copy_(a_q.float())
    assert a_off.data_ptr() % 16
    got = B.blockwise_mm_triton(a_off, a_scale, w_q.float(), w_scale, True, offsets, out_dtype=torch.float32)
    assert_matches_twin(got, want)


@needs_triton
def test_fp8_blockwise_kernel_bf16_out_and_empty_rows(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a_q, a_scale, w_q, w_scale = operands(40, 128, (3, 128, 256), seed=6)
    offsets = torch.tensor([0, 40, 40], dtype=torch.int32)  # an empty group either side
    want = B.blockwise_mm_torch(a_q, a_scale, w_q, w_scale, False, offsets)
    got = B.blockwise_mm_triton(a_q, a_scale, w_q, w_scale, False, offsets)  # bf16 by default
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 4e-3  # one rounding to bf16
    empty = B.blockwise_mm_triton(a_q[:0], a_scale[:0], w_q, w_scale, False, torch.zeros(3, dtype=torch.int32))
    assert empty.shape == (0, 256)
    with pytest.raises(ValueError, match=r"config is \(BLOCK_M, warps, stages\)"):
        B.blockwise_mm_triton(a_q, a_scale, w_q, w_scale, False, offsets, config=(64, 128, 128, 4, 4, False))
    with pytest.raises(ValueError, match="out must be"):
        B.blockwise_mm_triton(a_q, a_scale, w_q, w_scale, False, offsets, out=torch.empty(40, 256))
    with pytest.raises(ValueError, match="unit column stride"):  # the TMA writes rows of contiguous columns
        B.blockwise_mm_triton(a_q, a_scale, w_q, w_scale, False, offsets,
                              out=torch.empty(256, 40, dtype=torch.bfloat16).t())


@needs_triton
def test_fp8_blockwise_mm_runs_the_kernel_only_when_interpreted_or_on_cuda(monkeypatch):
    calls = []
    kernel = B.blockwise_mm_triton
    monkeypatch.setattr(B, "blockwise_mm_triton", lambda *args: calls.append(args) or kernel(*args))
    a_q, a_scale, w_q, w_scale = operands(20, 128, (128, 128), seed=7)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    twin = B.blockwise_mm(a_q, a_scale, w_q, w_scale, True, out_dtype=torch.float32)
    assert not calls
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = B.blockwise_mm(a_q, a_scale, w_q, w_scale, True, out_dtype=torch.float32)
    assert len(calls) == 1
    assert_matches_twin(interpreted, twin)
    assert not B.cublas_takes(a_q, True, None, torch.bfloat16)  # cuBLAS's blockwise GEMM: CUDA only
