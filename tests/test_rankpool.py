"""The multi-rank pool: collectives through it, reuse, and each way a case can fail."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from tests.rankpool import RankPool, RankPoolError


def case_all_reduce_of_rank_plus_one(scale: float = 1.0, *, offset: float = 0.0) -> float:
    values = torch.tensor([scale * (dist.get_rank() + 1)])
    dist.all_reduce(values)
    return values.item() + offset


def case_rank_and_pid() -> tuple[int, int]:
    return dist.get_rank(), os.getpid()


def case_rank_1_raises() -> None:
    if dist.get_rank() == 1:
        print("rank 1 is about to raise")
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 is left waiting for rank 1


def case_rank_0_waits_alone() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.zeros(1))


def case_rank_1_exits() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_gives_the_sum_on_every_rank(rank_pool, world_size: int) -> None:
    expected = world_size * (world_size + 1) / 2
    assert rank_pool(world_size).run(case_all_reduce_of_rank_plus_one) == [expected] * world_size


def test_arguments_and_string_form(rank_pool) -> None:
    results = rank_pool(2).run("tests.test_rankpool:case_all_reduce_of_rank_plus_one", 2.0, offset=0.5)
    assert results == [6.5, 6.5]


def test_results_are_ordered_by_rank_and_workers_are_reused(rank_pool) -> None:
    pool = rank_pool(2)
    first = pool.run(case_rank_and_pid)
    second = rank_pool(2).run(case_rank_and_pid)
    assert [rank for rank, _ in first] == [0, 1]
    assert first == second
    assert [pid for _, pid in first] == pool.pids


def test_bad_cases_fail_in_the_caller_and_keep_the_pool(rank_pool) -> None:
    def local_case() -> None:
        pass

    pool = rank_pool(2)
    with pytest.raises(TypeError, match="not a module-level function"):
        pool.run(local_case)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pool.run(case_all_reduce_of_rank_plus_one, lambda: 1.0)
    assert not pool.broken
    assert pool.run(case_all_reduce_of_rank_plus_one) == [3.0, 3.0]


def _assert_fresh_pool_works(rank_pool, failed_pool: RankPool, timeout_s: float | None = None) -> None:
    assert failed_pool.broken
    pool = rank_pool(2) if timeout_s is None else rank_pool(2, timeout_s=timeout_s)
    assert pool is not failed_pool
    assert set(pool.pids).isdisjoint(failed_pool.pids)
    assert pool.run(case_all_reduce_of_rank_plus_one) == [3.0, 3.0]


def test_an_exception_on_one_rank_reports_its_traceback(rank_pool) -> None:
    pool = rank_pool(2)
    with pytest.raises(RankPoolError) as failure:
        pool.run(case_rank_1_raises)
    message = str(failure.value)
    assert "--- rank 1 raised" in message
    assert "ValueError: boom from rank 1" in message
    assert "in case_rank_1_raises" in message
    assert "[output of rank 1]\nrank 1 is about to raise" in message
    _assert_fresh_pool_works(rank_pool, pool)


def test_a_hang_times_out_with_the_stuck_stack(rank_pool) -> None:
    pool = rank_pool(2, timeout_s=3.0)
    started = time.monotonic()
    with pytest.raises(RankPoolError) as failure:
        pool.run(case_rank_0_waits_alone)
    assert time.monotonic() - started < 3.0 + 3.0
    message = str(failure.value)
    assert "rank 0 timed out, rank 1 ok" in message
    assert "in case_rank_0_waits_alone" in message.split("[output of rank 0]", 1)[1]  # its stack
    _assert_fresh_pool_works(rank_pool, pool, timeout_s=3.0)


def test_a_dead_worker_is_reported_promptly(rank_pool) -> None:
    pool = rank_pool(2)
    started = time.monotonic()
    with pytest.raises(RankPoolError) as failure:
        pool.run(case_rank_1_exits)
    assert time.monotonic() - started < 5.0  # the pool timeout is 120 s
    assert "--- rank 1 died: worker pid" in str(failure.value)
    assert "exit code 3" in str(failure.value)
    _assert_fresh_pool_works(rank_pool, pool)
