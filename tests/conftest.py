"""Session-wide test setup: single-threaded torch, and the multi-rank pool fixture."""

from __future__ import annotations

import os

# Before torch is imported anywhere: the machines have 2 cores, shared by the test process and its ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Callable, Iterator  # noqa: E402

import pytest  # noqa: E402

from tests.rankpool import RankPool, get_pool, shutdown_all  # noqa: E402


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[Callable[..., RankPool]]:
    """`rank_pool(world_size, timeout_s=...)`: the session's gloo rank pool, fresh after any failure."""
    yield get_pool
    shutdown_all()


@pytest.fixture
def fp8_kernel_gpu() -> Iterator[None]:
    """A GPU test of FP8 kernels: fails (not skips) without FP8 tensor cores; TF32 off meanwhile, so that its fp32
    references are fp32."""
    import torch

    from tests.gpu_launch import require_fp8_gpu

    require_fp8_gpu()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32
