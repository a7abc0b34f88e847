"""``as_dtype`` of the FP8 weight quantizers (kernels/fp8_quant.py, kernels/fp8_blockwise.py): an fp32 master weight
quantized as its bf16 model copy would be, with no copy made. ``f(x, as_dtype=bf16)`` must equal ``f(x.bfloat16())``
bit for bit (q as bytes, scales and maxima exactly), through the torch twins and through the Triton kernels under
TRITON_INTERPRET=1 (both sides run the same kernels on the same fp32 values, so the interpreter's own E4M3 faults
cancel out); and differ from ``f(x)``, so an ignored argument fails. The inputs are fp32 values that bf16 does not
hold, rows and columns of very different ranges, and one value that rounds up across a power of two in bf16 and is
its row's, column's and block's amax (the scale moves with it)."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.kernels import fp8_blockwise as B
from moe_overlap.kernels import fp8_quant as Q
from moe_overlap.kernels.launch import HAVE_TRITON

BF16 = torch.bfloat16
PATHS = ["twin", pytest.param("interpreted", marks=pytest.mark.skipif(not HAVE_TRITON,
                                                                        reason="triton is not importable"))]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """'twin': the torch twins (CPU); 'interpreted': the Triton kernels under TRITON_INTERPRET=1, the twins made to
    fail so that a fallback cannot pass for the kernels."""
    if request.param == "interpreted":
        monkeypatch.setenv("TRITON_INTERPRET", "1")

        def no_twin(*args, **kwargs):
            raise AssertionError("the torch twin ran instead of the interpreted kernel")

        for name in ("quantize_rows_torch", "quantize_columns_torch", "amax_along"):
            monkeypatch.setattr(Q, name, no_twin)
        monkeypatch.setattr(B, "quantize_blocks_torch", no_twin)
    return request.param


def master(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """fp32 values bf16 does not hold; x[..., 0, 3] of each matrix is just under a power of two above all of its
    matrix's other values, so it is the amax of its row, column and block, and rounds up to that power in bf16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[-2]).unsqueeze(-1)
    x = x * torch.logspace(-1, 1, shape[-1])
    top = torch.exp2(torch.ceil(torch.log2(x.abs().amax((-2, -1)))) + 1)
    x[..., 0, 3] = -top * (1 - 2.0 ** -10)
    rounded = x.to(BF16).float()
    assert torch.equal(rounded[..., 0, 3], -top) and (rounded != x).float().mean() > 0.9
    return x


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Two (q, scales) bit for bit."""
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


SHAPES = [pytest.param((64, 96), id="2d"), pytest.param((3, 64, 96), id="3d")]


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_as_dtype_rows_columns_and_both_quantize_the_bf16_copy(path, shape):
    x = master(shape, 0)
    x_bf16 = x.to(BF16)
    for f in (Q.quantize_rows, Q.quantize_columns):
        got = f(x, as_dtype=BF16)
        assert got[0].dtype == Q.FP8 and same(got, f(x_bf16)), f.__name__
        assert not torch.equal(got[1], f(x)[1]), f.__name__  # the scales of the row / column of x[..., 0, 3]
    rows, cols = Q.quantize_rows_and_columns(x, as_dtype=BF16)
    rows_bf16, cols_bf16 = Q.quantize_rows_and_columns(x_bf16)
    assert same(rows, rows_bf16) and same(cols, cols_bf16)
    rows_fp32, cols_fp32 = Q.quantize_rows_and_columns(x)
    assert not same(rows, rows_fp32) and not same(cols, cols_fp32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dim", [-1, -2], ids=["rows", "columns"])
def test_fp8_as_dtype_shared_amax_then_quantize_from_it(path, shape, dim):
    """row_amax / column_amax with as_dtype: the bf16 copy's maxima exactly; quantize_rows / quantize_columns from
    a given amax (here larger than x's own on most rows, as another rank's part may make it) with as_dtype: the bf16
    copy's quantization from that amax."""
    amax_of, quantize = (Q.row_amax, Q.quantize_rows) if dim == -1 else (Q.column_amax, Q.quantize_columns)
    x = master(shape, 1)
    x_bf16 = x.to(BF16)
    amax = amax_of(x, as_dtype=BF16)
    assert torch.equal(amax, amax_of(x_bf16)) and torch.equal(amax, x_bf16.float().abs().amax(dim))
    assert not torch.equal(amax, amax_of(x))
    shared = amax * torch.rand(amax.shape, generator=torch.Generator().manual_seed(2)).add(1.0)
    got = quantize(x, amax=shared, as_dtype=BF16)
    assert same(got, quantize(x_bf16, amax=shared))
    assert not torch.equal(got[0].view(torch.uint8), quantize(x, amax=shared)[0].view(torch.uint8))


@pytest.mark.parametrize("shape", [pytest.param((256, 128), id="2d"), pytest.param((2, 128, 256), id="3d")])
@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
def test_fp8_as_dtype_blocks_quantize_the_bf16_copy(path, shape, transpose):
    x = master(shape, 3)
    got = B.quantize_blocks(x, transpose=transpose, as_dtype=BF16)
    assert same(got, B.quantize_blocks(x.to(BF16), transpose=transpose))
    assert not torch.equal(got[1], B.quantize_blocks(x, transpose=transpose)[1])  # x[..., 0, 3]'s block
    q_out, scale_out = torch.empty_like(got[0]), torch.empty_like(got[1])  # into given buffers
    into = B.quantize_blocks(x, q_out, scale_out, transpose=transpose, as_dtype=BF16)
    assert into[0] is q_out and same(into, got)


def test_fp8_as_dtype_fp16_own_dtype_and_refusals(path):
    """fp16 rounds as x.half() does; as_dtype equal to x's dtype changes nothing; other dtypes are refused."""
    x = master((64, 128), 4)
    x_half = x.half()
    assert same(Q.quantize_rows(x, as_dtype=torch.float16), Q.quantize_rows(x_half))
    assert same(Q.quantize_columns(x, as_dtype=torch.float16), Q.quantize_columns(x_half))
    assert same(B.quantize_blocks(x[:, :128].repeat(2, 1), as_dtype=torch.float16),
                B.quantize_blocks(x_half[:, :128].repeat(2, 1)))
    x_bf16 = x.to(BF16)
    assert same(Q.quantize_rows(x_bf16, as_dtype=BF16), Q.quantize_rows(x_bf16))
    assert same(Q.quantize_rows(x, as_dtype=torch.float32), Q.quantize_rows(x))
    for call in (lambda: Q.quantize_rows(x, as_dtype=torch.float64), lambda: Q.row_amax(x_bf16, as_dtype=torch.float32),
                 lambda: Q.quantize_rows_and_columns(x, as_dtype=torch.int8),
                 lambda: B.quantize_blocks(x[:, :128].repeat(2, 1), as_dtype=torch.float8_e4m3fn)):
        with pytest.raises(ValueError, match="as_dtype must be"):
            call()
