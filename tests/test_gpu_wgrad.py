"""The grouped weight-gradient kernels' epilogue on a GPU (`pytest -m gpu`; Hopper: kernels/grouped_wgrad.py): the
bf16 kernel into fp32 main_grad against fp32; the TMA's bulk reduction adds exactly the bits the element-wise atomic
adds do, in the bf16 and the FP8 kernel, with ragged tile edges (the TMA clips them) and one or two segments; a
main_grad the TMA cannot address (not 16-byte aligned) takes the atomic adds. Times nothing: see
benchmarks/step_kernels.py --sections wgrad,fp8_wgrad.

    CUDA_VISIBLE_DEVICES=0 python -m pytest -m gpu tests/test_gpu_wgrad.py
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap.kernels import fp8_wgrad as W
from moe_overlap.kernels.grouped_wgrad import grouped_wgrad_accumulate_triton, tile_target
from tests.test_gpu_fp8_blockwise import offsets_of, rel
from tests.test_gpu_fp8_wgrad import rows_of

pytestmark = pytest.mark.gpu

ROWS = [[700, 0, 1000, 13, 555], [1, 0, 333, 1024, 64]]  # expert 1 gets no rows from either segment
M, N = 1000, 744  # neither a multiple of the 128 x 128 tile: the TMA clips the last tiles


def bf16_segments(count: int) -> list:
    return [(rows_of(M, 2 * s, rows=ROWS[s]), rows_of(N, 2 * s + 1, rows=ROWS[s]), offsets_of(ROWS[s]))
            for s in range(count)]


def added(accumulate, tma: bool | None, start: torch.Tensor) -> torch.Tensor:
    out = start.clone()
    accumulate(out, tma)
    return out


@pytest.fixture
def start() -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(9)
    return torch.randn(len(ROWS[0]), M, N, device="cuda", generator=g)


@pytest.mark.parametrize("segments", [1, 2])
def test_grouped_wgrad_kernel_against_fp32(segments, start):
    parts = bf16_segments(segments)
    assert tile_target(start, 128, 128)[1], "an H100/H200 main_grad is the TMA's"
    got = added(lambda out, tma: grouped_wgrad_accumulate_triton(parts, out, tma=tma), None, start)
    want = start.clone()
    for a, b, offsets in parts:
        ends = [0] + offsets.tolist()
        want += torch.stack([a[s:e].double().t() @ b[s:e].double() for s, e in zip(ends, ends[1:])]).float()
    assert torch.equal(got[1], start[1])  # no rows: untouched
    assert rel(got - start, want - start) < 1e-5


@pytest.mark.parametrize("kernel", ["bf16", "fp8-group", "fp8-chunk"])
@pytest.mark.parametrize("segments", [1, 2])
def test_tma_reduction_adds_the_bits_of_the_atomic_adds(kernel, segments, start, fp8_kernel_gpu):
    parts = bf16_segments(segments)
    if kernel == "bf16":
        def accumulate(out, tma):
            grouped_wgrad_accumulate_triton(parts, out, tma=tma)
    else:
        per_chunk = kernel == "fp8-chunk"
        quantized = [(W.quantize_along_tokens(a, offsets, per_chunk), W.quantize_along_tokens(b, offsets, per_chunk))
                     for a, b, offsets in parts]

        def accumulate(out, tma):
            W.fp8_wgrad_accumulate_triton(quantized, out, per_chunk, tma=tma)
    by_tma, by_atomics = added(accumulate, True, start), added(accumulate, False, start)
    assert not torch.equal(by_tma, start)
    assert torch.equal(by_tma, by_atomics)


def test_unaligned_main_grad_takes_the_atomic_adds(start):
    parts = bf16_segments(2)
    flat = torch.empty(start.numel() + 1, device="cuda")
    unaligned = flat[1:].view(start.shape)  # 4 bytes past 16-byte alignment
    unaligned.copy_(start)
    assert not tile_target(unaligned, 128, 128)[1]
    with pytest.raises(ValueError, match="16-byte alignment"):
        grouped_wgrad_accumulate_triton(parts, unaligned, tma=True)
    grouped_wgrad_accumulate_triton(parts, unaligned)
    assert torch.equal(unaligned, added(lambda out, tma: grouped_wgrad_accumulate_triton(parts, out, tma=tma), True,
                                        start))
