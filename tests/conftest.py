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
