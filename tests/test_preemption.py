"""Preemption and restarts: SIGTERM / SIGINT or train.exit_duration_min stop every rank after the same step with
a checkpoint and exit 0; a second signal exits at once; a job restarted by torchrun --max-restarts, or run
again, resumes from the newest checkpoint by itself and continues the uninterrupted loss curve bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from moe_overlap.training.preemption import DUPLICATE_WINDOW_S
from tests.faults import fault_case
from tests.long_run import (KILL_TIMEOUT, REPO, STEPS, finish, latest, launch_ranks, logged_losses, train_argv,
                            uninterrupted_losses)


def test_sigterm_to_one_rank_stops_all_after_the_same_step_with_a_checkpoint(rank_pool, tmp_path):
    reference = uninterrupted_losses(rank_pool, tmp_path / "reference")
    run = tmp_path / "run"
    (code, text), (code1, text1) = rank_pool(2).run(fault_case, train_argv(run), "sigterm:1:3")
    assert code == code1 == 0, text + text1
    assert f"moe-overlap: stopped by SIGTERM after step 3; checkpoint: {run / 'checkpoints' / 'step_00000003'}" in text
    assert latest(run) == {"step": 3, "stopped_by": "SIGTERM"} and sorted(logged_losses(run)) == [1, 2, 3]
    code, text = rank_pool(2).run(fault_case, train_argv(run))[0]  # the same command again
    assert code == 0 and "resumed from" in text, text
    assert logged_losses(run) == reference


def test_exit_duration_stops_with_a_checkpoint(rank_pool, tmp_path):
    reference = uninterrupted_losses(rank_pool, tmp_path / "reference")
    run = tmp_path / "run"
    code, text = rank_pool(2).run(fault_case, train_argv(run, "train.exit_duration_min=1e-5"))[0]
    assert code == 0 and "stopped by train.exit_duration_min=1e-05 after step 1" in text, text
    assert latest(run) == {"step": 1, "stopped_by": "train.exit_duration_min=1e-05"}
    code, text = rank_pool(2).run(fault_case, train_argv(run))[0]
    assert code == 0, text
    assert logged_losses(run) == reference


def test_second_signal_exits_at_once_and_a_relayed_duplicate_does_not(tmp_path):
    """A launcher's relay arrives within DUPLICATE_WINDOW_S of the first signal and changes nothing; a later
    signal ends the process at once, mid-step, without a checkpoint."""
    run = tmp_path / "run"
    argv = train_argv(run, "parallel.expert_model_parallel_size=1")
    procs = launch_ranks(argv, tmp_path, "slow:0:4", world_size=1)
    deadline = time.monotonic() + 90
    while "faults: step 4 sleeps 30 s" not in (tmp_path / "rank0.log").read_text():  # in the step, not between
        assert time.monotonic() < deadline and procs[0].poll() is None, (tmp_path / "rank0.log").read_text()
        time.sleep(0.1)
    procs[0].send_signal(signal.SIGTERM)
    procs[0].send_signal(signal.SIGTERM)  # relayed: ignored
    time.sleep(DUPLICATE_WINDOW_S + 0.5)
    assert procs[0].poll() is None
    procs[0].send_signal(signal.SIGTERM)
    sent = time.monotonic()
    codes, outputs, ended = finish(procs, tmp_path, timeout_s=20)
    assert codes == [128 + signal.SIGTERM] and ended[0] - sent < 2.0, outputs[0][-2000:]
    assert "moe-overlap: rank 0: second SIGTERM: exiting now without saving" in outputs[0]
    assert latest(run)["step"] == 2  # the interval checkpoint; nothing written for the stop


def test_torchrun_max_restarts_resumes_from_the_newest_checkpoint(rank_pool, tmp_path):
    """Rank 1 dies at step 5; torchrun restarts both ranks, which resume from step 4 (train.resume=auto) and
    reach step 8 on the uninterrupted curve. torchrun's agent hosts one store for every attempt: the ranks'
    keys are kept apart by attempt (collectives.rendezvous_store), or the restart cannot connect."""
    reference = uninterrupted_losses(rank_pool, tmp_path / "reference")
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MOE_OVERLAP_TEST_FAULT="start:1:5")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "--max-restarts=1", str(REPO / "tests" / "faults.py"), *train_argv(run, KILL_TIMEOUT)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resumed from {run / 'checkpoints' / 'step_00000004'} at step 4" in done.stderr, done.stderr[-4000:]
    assert logged_losses(run) == reference and len(reference) == STEPS


def test_nproc_launcher_exits_0_after_a_signal_once_the_ranks_saved(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    launcher = subprocess.Popen([sys.executable, "-m", "moe_overlap", *train_argv(run, "train.max_steps=100000"),
                                 "--nproc", "2"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ((run / "metrics.jsonl").is_file() and len(logged_losses(run)) >= 3):
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
            time.sleep(0.1)
        launcher.send_signal(signal.SIGINT)  # as Ctrl-C: torchrun relays it to the ranks
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    step = latest(run)["step"]
    assert latest(run) == {"step": step, "stopped_by": "SIGINT"} and step >= 3
    assert f"stopped by SIGINT after step {step}" in err and "Traceback" not in err, err[-3000:]
