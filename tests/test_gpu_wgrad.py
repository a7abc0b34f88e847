"""The bf16 grouped weight-gradient kernel on a GPU (`pytest -m gpu`; kernels/grouped_wgrad.py): one, two
and four segments (micro-batches' rows) added into fp32 main_grad equal fp64 sums of the bf16 rows within fp32's
rounding, tile edges ragged (neither dimension a multiple of the 128 x 128 tile), an expert without rows untouched,
the rows past the last offset NaN (never read). Times nothing: see benchmarks/step_kernels.py --sections wgrad.

    CUDA_VISIBLE_DEVICES=0 python -m pytest -m gpu tests/test_gpu_wgrad.py
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap.kernels.grouped_wgrad import grouped_wgrad_accumulate_triton
from tests.test_gpu_fp8_blockwise import offsets_of, rel
from tests.test_gpu_fp8_wgrad import rows_of

pytestmark = pytest.mark.gpu

ROWS = [[700, 0, 1000, 13, 555], [1, 0, 333, 1024, 64], [9, 0, 0, 500, 3], [128, 0, 77, 1, 0]]  # expert 1: none
M, N = 1000, 744  # neither a multiple of the 128 x 128 tile


@pytest.mark.parametrize("expert_loop", [False, True], ids=["program_per_expert", "expert_loop"])
@pytest.mark.parametrize("segments", [1, 2, 4])
def test_grouped_wgrad_kernel_against_fp64(segments, expert_loop):
    parts = [(rows_of(M, 2 * s, rows=ROWS[s]), rows_of(N, 2 * s + 1, rows=ROWS[s]), offsets_of(ROWS[s]))
             for s in range(segments)]
    start = torch.randn(len(ROWS[0]), M, N, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    got, want = start.clone(), start.clone().double()
    grouped_wgrad_accumulate_triton(parts, got, expert_loop=expert_loop)
    for a, b, offsets in parts:
        ends = [0] + offsets.tolist()
        want += torch.stack([a[s:e].double().t() @ b[s:e].double() for s, e in zip(ends, ends[1:])])
    assert torch.equal(got[1], start[1])  # no rows: untouched
    assert rel(got - start, want - start) < 1e-5
