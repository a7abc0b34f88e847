"""A rank that dies (mid-step, mid-collective, mid-save, or while a peer is blocked where no collective timeout
reaches) makes the others exit within train.distributed_timeout_s with one line naming that rank and its phase;
the last good checkpoint then resumes the run onto the uninterrupted loss curve, bit for bit. And a non-finite
gradient skips the step or stops the run per train.on_nonfinite_grad, naming the step and the tensor.

The dying rank is a real process (tests/faults.py SIGKILLs it at the named point); the survivor's exit is timed
from the moment the dead rank's process ended.
"""

from __future__ import annotations

import signal

import pytest

from tests.faults import NAN_PARAM, fault_case
from tests.long_run import (KILL_TIMEOUT, STEPS, TIMEOUT_S, finish, latest, launch_ranks, logged_losses,
                            train_argv, uninterrupted_losses)


@pytest.mark.parametrize("fault,phase,last_good", [
    ("forward:1:5", "train step 5", 4),
    ("collective:1:5", "train step 5", 4),
    ("save:1:6", "checkpoint save of step 6", 4),  # killed between its DCP shards and its own file
], ids=["mid-step", "mid-collective", "mid-save"])
def test_killed_rank_is_named_and_the_run_resumes_onto_the_same_curve(rank_pool, tmp_path, fault, phase, last_good):
    reference = uninterrupted_losses(rank_pool, tmp_path / "reference")
    run = tmp_path / "run"
    codes, outputs, ended = finish(launch_ranks(train_argv(run, KILL_TIMEOUT), tmp_path, fault), tmp_path,
                                   timeout_s=120)
    assert codes == [3, -signal.SIGKILL], outputs[0][-3000:]
    line = next(line for line in outputs[0].splitlines() if "moe-overlap: rank 0" in line)
    assert f"(in {phase})" in line and "rank 1 is gone" in line and f"(it was in {phase})" in line, line
    assert ended[0] - ended[1] < TIMEOUT_S, line  # within train.distributed_timeout_s of the death
    assert latest(run)["step"] == last_good  # a crash mid-save leaves the previous checkpoint as latest
    code, text = rank_pool(2).run(fault_case, train_argv(run))[0]  # train.resume=auto, the default
    assert code == 0 and f"resumed from {run / 'checkpoints' / f'step_{last_good:08d}'}" in text, text
    assert logged_losses(run) == reference  # bit for bit: the interrupted steps re-run identically


def test_a_rank_that_starts_later_than_the_collective_timeout_still_joins(tmp_path):
    """Joining waits longer than a collective (collectives.JOIN_TIMEOUT): rank 0, which hosts the store, starts
    twice the collective timeout after rank 1, and the run still trains to the end on both ranks."""
    argv = train_argv(tmp_path / "run", KILL_TIMEOUT, "train.max_steps=2", "checkpoint.save_interval=0")
    codes, outputs, _ = finish(launch_ranks(argv, tmp_path, f"latejoin:0:{2 * TIMEOUT_S}"), tmp_path, timeout_s=120)
    assert codes == [0, 0], [o[-2000:] for o in outputs]


def test_rank_blocked_where_no_timeout_reaches_is_ended_by_the_monitor(tmp_path):
    """Rank 0 waits forever in something that never fails (as a device-side symmetric-memory wait on a GPU,
    which only its own timeout ends) while rank 1 dies: the heartbeat monitor ends rank 0."""
    argv = train_argv(tmp_path / "run", KILL_TIMEOUT)
    codes, outputs, ended = finish(launch_ranks(argv, tmp_path, "block:0:5,start:1:5"), tmp_path, timeout_s=120)
    assert codes == [3, -signal.SIGKILL], outputs[0][-3000:]
    line = next(line for line in outputs[0].splitlines() if "moe-overlap: rank 0" in line)
    assert "rank 1 is gone" in line and "(it was in train step 5)" in line and "collective" not in line, line
    assert ended[0] - ended[1] < TIMEOUT_S, line


def test_nonfinite_gradient_skips_the_step_naming_step_and_tensor(rank_pool, tmp_path):
    reference = uninterrupted_losses(rank_pool, tmp_path / "reference")
    results = rank_pool(2).run(fault_case, train_argv(tmp_path / "run", "checkpoint.save_interval=0"), "nan:0:3")
    (code, text), (code1, text1) = results
    assert code == code1 == 0, text
    assert f"step 3: gradient norm is nan (1 of rank 0's gradient tensors; the deepest: {NAN_PARAM})" in text, text
    assert "skipping the optimizer step" in text and "another rank's are" in text1, text1
    losses = logged_losses(tmp_path / "run")
    assert [losses[s] for s in (1, 2, 3)] == [reference[s] for s in (1, 2, 3)]  # the step ran, its update not
    assert losses[4] != reference[4] and len(losses) == STEPS


def test_nonfinite_gradient_stops_with_the_state_before_it_saved(rank_pool, tmp_path):
    reference = uninterrupted_losses(rank_pool, tmp_path / "reference")
    run = tmp_path / "run"
    results = rank_pool(2).run(fault_case, train_argv(run, "train.on_nonfinite_grad=stop"), "nan:0:3")
    assert [code for code, _ in results] == [5, 5]
    line = results[0][1].strip().splitlines()[-1]
    assert line.startswith("moe-overlap: stopped: step 3: gradient norm is nan") and NAN_PARAM in line, line
    assert f"the state after step 2 is in {run / 'checkpoints' / 'step_00000002'}" in line, line
    code, text = rank_pool(2).run(fault_case, train_argv(run, "train.on_nonfinite_grad=stop"))[0]
    assert code == 0, text
    assert logged_losses(run) == reference


def test_the_store_host_waits_for_its_peers_to_read_the_failure(monkeypatch):
    """Rank 0 hosts the store: after a failure record it waits (a few polls at most) until every live peer has read
    it, so that a third rank does not find the store gone and blame rank 0 (4 GPUs, tests/test_gpu_fault.py)."""
    import threading
    import time

    import torch.distributed as dist

    from moe_overlap.distributed.monitor import RankMonitor

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = dist.HashStore()
    host, peer = (RankMonitor(store, rank, 4, timeout_s=20.0, prefix="run/") for rank in (0, 2))

    def late_peers():  # rank 2 reads it 0.3 s late and rank 3 0.6 s late; rank 1 is the one that died
        time.sleep(0.3)
        peer._let_peers_read_it()
        time.sleep(0.3)
        store.add("run/seen", 1)

    started = time.monotonic()
    threading.Thread(target=late_peers).start()
    host._let_peers_read_it()
    waited = time.monotonic() - started
    assert 0.5 < waited < 2 * host.interval_s + 1, waited  # until both had read it, not the whole deadline
    assert store.add("run/seen", 0) == 3
