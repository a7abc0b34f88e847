"""Soak (`pytest -m slow tests/test_soak.py`, not in CI; about 10 minutes on 2 idle cores): 2000 steps on 2 CPU
ranks with a checkpoint every 50, once straight through and once stopped by SIGTERM about every 300 steps and
started again with the same command. The two loss curves are equal bit for bit, and neither run's host memory
grows (resident set size at the end within 5% + 32 MiB of that at step 200)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.long_run import finish, latest, launch_ranks, logged_losses, train_argv

STEPS, SAVE_EVERY, STOP_EVERY = 2000, 50, 300


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _run(argv: list[str], cwd: Path, run: Path, stop_at: int | None, rss: dict[int, list[float]]) -> int:
    """One launch until it ends, or until it logged ``stop_at``, when both ranks get SIGTERM; returns the step
    it stopped at. Records each rank's resident memory by step."""
    procs = launch_ranks(argv, cwd)
    metrics = run / "metrics.jsonl"
    step = 0
    while all(proc.poll() is None for proc in procs):
        try:
            step = max(logged_losses(run)) if metrics.is_file() and metrics.stat().st_size else 0
        except ValueError:  # a line half written
            pass
        for rank, proc in enumerate(procs):
            rss.setdefault(step, []).append(_rss_mib(proc.pid))
        if stop_at is not None and step >= stop_at:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)  # a scheduler's preemption reaches every rank
            break
        time.sleep(0.5)
    codes, outputs, _ = finish(procs, cwd, timeout_s=3600)
    assert codes == [0, 0], outputs[0][-3000:]
    return latest(run)["step"]


def _memory_does_not_grow(rss: dict[int, list[float]], run: str) -> None:
    early = max(value for step, values in rss.items() if 200 <= step < 260 for value in values)
    late = max(value for step, values in rss.items() if step >= STEPS - 100 for value in values)
    print(f"{run}: largest rank's resident memory {early:.0f} MiB at steps 200-259, {late:.0f} MiB at the end")
    assert late <= 1.05 * early + 32, f"resident memory grew from {early:.0f} MiB to {late:.0f} MiB"


@pytest.mark.slow
def test_soak_preempted_every_300_steps_equals_the_straight_run(tmp_path):
    extra = (f"train.max_steps={STEPS}", f"train.lr_decay_steps={STEPS}", f"checkpoint.save_interval={SAVE_EVERY}")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    straight_rss: dict[int, list[float]] = {}
    _run(train_argv(straight, *extra), tmp_path, straight, None, straight_rss)
    stopped_rss: dict[int, list[float]] = {}
    stops, step = [], 0
    while step < STEPS:
        step = _run(train_argv(stopped, *extra), tmp_path, stopped, min(step + STOP_EVERY, STEPS + 1), stopped_rss)
        stops.append(step)
    print(f"stopped by SIGTERM after steps {stops[:-1]}, then ran to {stops[-1]}")
    assert len(stops) >= STEPS // STOP_EVERY, stops
    assert logged_losses(stopped) == logged_losses(straight) and len(logged_losses(straight)) == STEPS
    _memory_does_not_grow(straight_rss, "straight")
    _memory_does_not_grow(stopped_rss, "stopped and restarted")
