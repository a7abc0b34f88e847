"""The FP8 weight gradient on Hopper's FP8 tensor cores (`pytest -m gpu`; H100/H200; train.fp8_wgrad,
kernels/fp8_wgrad.py): the quantize kernel along the tokens equals its twin bit for bit (bf16 and fp32 rows, per
group and per 128-token chunk); the GEMM into the fp32 main_grad within 1e-2 normwise of its twin (fp32 on the
dequantized operands) and within 0.05 of fp32 on the unquantized rows, per group (each chunk summed in fp32, and the
tensor cores' own accumulation) and per chunk, one, two and four segments, every tile config step_kernels.py sweeps,
uneven and empty groups, the rows past the last offset NaN (never read); replayed from a CUDA graph it equals the
eager call, also after the group offsets changed in place. Times nothing: see benchmarks/step_kernels.py
--sections fp8_wgrad.

    CUDA_VISIBLE_DEVICES=0 python -m pytest -m gpu tests/test_gpu_fp8_wgrad.py
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap.kernels import fp8_wgrad as W
from tests.test_gpu_fp8_blockwise import offsets_of, rel

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp8_kernel_gpu")]

FP8_TOL = 0.05  # the FP8 GEMM against fp32 on the unquantized rows
TWIN_TOL = 1e-2  # against the twin: the tensor cores' FP8 products, the order of the fp32 sums
GROUP_ROWS = [700, 0, 1000, 13, 555, 900, 128, 300]  # 3596 rows, then 500 past the last offset
M, N = 1024, 768  # the weight's (E, M, N): a's columns and b's


def rows_of(columns: int, seed: int, dtype=torch.bfloat16, rows: list[int] = GROUP_ROWS) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(rows)
    x = torch.randn(total + 500, columns, device="cuda", generator=g) * torch.logspace(-1, 1, columns, device="cuda")
    x[total:] = float("nan")
    return x.to(dtype)


def fp32_wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    ends = offsets.tolist()
    return torch.stack([a[s:e].float().t() @ b[s:e].float() for s, e in zip([0] + ends[:-1], ends)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_chunk, one_pass, columns", [
    (True, True, None), (False, True, None), (False, True, 16), (False, True, 64), (False, False, None)],
    ids=["per-chunk", "per-group", "per-group-16", "per-group-64", "per-group-two-launches"])
def test_fp8_wgrad_quantize_kernel_equals_twin(dtype, per_chunk, one_pass, columns):
    x = rows_of(M + 40, 0, dtype)  # columns not a multiple of the kernel's block
    x[5, 7] = 3e4  # an outlier
    offsets = offsets_of(GROUP_ROWS)
    got = W.quantize_along_tokens(x, offsets, per_chunk, columns, one_pass)
    twin = W.quantize_along_tokens_torch(x, offsets, per_chunk)
    used = int(twin.chunk_ends_E[-1])
    assert torch.equal(got.chunk_ends_E, twin.chunk_ends_E)
    assert torch.equal(got.scale_CM[:used], twin.scale_CM[:used])
    assert torch.equal(got.q_MP[:, :used * 128].view(torch.uint8), twin.q_MP[:, :used * 128].view(torch.uint8))


@pytest.mark.parametrize("per_chunk, fast_accum", [(True, False), (False, False), (False, True)],
                         ids=["per-chunk", "per-group", "per-group-fast"])
@pytest.mark.parametrize("segments", [1, 2, 4])
def test_fp8_wgrad_kernel_against_twin_and_fp32(per_chunk, fast_accum, segments):
    pairs, exact = [], 0
    for seed in range(segments):
        rows = GROUP_ROWS if seed == 0 else [1, 0, 333, 1024, 64 * seed, 129, 900, 0]  # group 1: no rows in any
        offsets = offsets_of(rows)
        a, b = rows_of(M, 2 * seed, rows=rows), rows_of(N, 2 * seed + 1, rows=rows)
        pairs.append((W.quantize_along_tokens(a, offsets, per_chunk), W.quantize_along_tokens(b, offsets, per_chunk)))
        exact = exact + fp32_wgrad(a, b, offsets)
    start = torch.randn(len(GROUP_ROWS), M, N, device="cuda")
    got, twin = start.clone(), start.clone()
    W.fp8_wgrad_accumulate_triton(pairs, got, per_chunk, fast_accum)
    W.fp8_wgrad_accumulate_torch(pairs, twin)
    assert torch.isfinite(got).all()
    assert rel(got - start, twin - start) < TWIN_TOL, rel(got - start, twin - start)
    assert rel(got - start, exact) < FP8_TOL, rel(got - start, exact)
    assert torch.equal(got[1], start[1])  # a group without rows: nothing added


@pytest.mark.parametrize("config", [(128, 128, 8, 4), (128, 128, 8, 3), (128, 128, 4, 4), (128, 256, 8, 3),
                                    (64, 128, 4, 4), (256, 128, 8, 3)], ids=lambda c: "x".join(map(str, c)))
def test_fp8_wgrad_kernel_configs_against_twin(config):
    """Each tile config step_kernels.py sweeps (the default among them), per chunk."""
    offsets = offsets_of(GROUP_ROWS)
    a, b = rows_of(M, 5), rows_of(N, 6)
    pair = (W.quantize_along_tokens(a, offsets, True), W.quantize_along_tokens(b, offsets, True))
    got, twin = torch.zeros(len(GROUP_ROWS), M, N, device="cuda"), torch.zeros(len(GROUP_ROWS), M, N, device="cuda")
    W.fp8_wgrad_accumulate_triton([pair], got, True, config=config)
    W.fp8_wgrad_accumulate_torch([pair], twin)
    assert rel(got, twin) < TWIN_TOL


def test_fp8_wgrad_replays_in_a_cuda_graph():
    """Quantize and GEMM captured once, replayed with the group offsets rewritten in place: both kernels read the
    group sizes on the device, so each replay equals an eager call on the offsets of then."""
    offsets = offsets_of(GROUP_ROWS)
    a, b = rows_of(M, 7), rows_of(N, 8)
    a[sum(GROUP_ROWS):] = 0  # the moved groups below count every row
    b[sum(GROUP_ROWS):] = 0
    out = torch.zeros(len(GROUP_ROWS), M, N, device="cuda")

    def step():
        W.fp8_wgrad_accumulate([(W.quantize_along_tokens(a, offsets, False),
                                 W.quantize_along_tokens(b, offsets, False))], out, False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled before the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.zero_()
    step()
    eager = out.clone()
    out.zero_()
    graph.replay()
    assert torch.equal(out, eager)

    offsets.copy_(offsets_of([1024, 1024, 0, 7, 900, 1000, 1, 140]))  # all 4096 rows, groups moved
    out.zero_()
    graph.replay()
    replayed = out.clone()
    out.zero_()
    step()
    assert torch.equal(replayed, out)
    assert not torch.equal(replayed, eager)  # the replay read the new offsets
