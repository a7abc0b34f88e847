"""Shared by the long-run tests: a small 2-rank config, jobs as real processes, and the losses a run logged."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# train.distributed_timeout_s of the runs where a rank dies (a dead rank is found within 3 s): KILL_TIMEOUT;
# the others get more, so that a busy machine cannot starve a heartbeat for half of it.
TIMEOUT_S = 6
KILL_TIMEOUT = f"train.distributed_timeout_s={TIMEOUT_S}"
STEPS = 8
SMALL = [  # on configs/tiny.yaml: 3 layers, hidden 32, 8 experts top-2, EP=2, 8 steps, a checkpoint every 2
    "model.num_layers=3", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.seq_length=16", "model.moe_layer_freq=[0,1,1]", "model.moe_ffn_hidden_size=32",
    "train.micro_batch_size=2", "train.global_batch_size=8", f"train.max_steps={STEPS}", "train.lr_warmup_steps=1",
    f"train.lr_decay_steps={STEPS}", "train.eval_interval=0", "train.distributed_timeout_s=30",
    "checkpoint.save_interval=2",
]


def train_argv(output_dir: Path, *extra: str) -> list[str]:
    return ["train", str(REPO / "configs" / "tiny.yaml"), *SMALL, f"train.output_dir={output_dir}", *extra]


def logged_losses(output_dir: Path) -> dict[int, float]:
    """Loss by step as metrics.jsonl last logged it: a resumed run's steps replace the interrupted run's."""
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def latest(output_dir: Path) -> dict:
    return json.loads((Path(output_dir) / "checkpoints" / "latest").read_text())


_reference: dict[tuple, dict[int, float]] = {}


def uninterrupted_losses(rank_pool, output_dir: Path, *extra: str) -> dict[int, float]:
    """The losses of the same run with nothing going wrong (computed once per session and overrides)."""
    from tests.faults import fault_case

    if extra not in _reference:
        code, text = rank_pool(2).run(fault_case, train_argv(output_dir, *extra))[0]
        assert code == 0, text
        _reference[extra] = logged_losses(output_dir)
        assert sorted(_reference[extra]) == list(range(1, STEPS + 1))
    return _reference[extra]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(argv: list[str], cwd: Path, faults: str = "", world_size: int = 2,
                 env: dict | None = None) -> list[subprocess.Popen]:
    """``world_size`` ranks of ``moe-overlap argv`` as plain processes (the rendezvous of torchrun's env://
    without its agent), each with the faults of ``faults`` (tests/faults.py) that name its rank. Each rank's
    output goes to ``cwd/rankN.log`` (a file, not a pipe: nothing blocks on a full one)."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MOE_OVERLAP_TEST_FAULT=faults, **(env or {}))
        with open(Path(cwd) / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "faults.py"), *argv], env=rank_env,
                                          cwd=cwd, stdout=log, stderr=subprocess.STDOUT))
    return procs


def finish(procs: list[subprocess.Popen], cwd: Path, timeout_s: float) -> tuple[list[int], list[str], list[float]]:
    """Wait for every rank: exit codes, outputs, and when each exited (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    ended: dict[int, float] = {}
    try:
        while len(ended) < len(procs):
            assert time.monotonic() < deadline, f"ranks {sorted(set(range(len(procs))) - set(ended))} still run"
            for rank, proc in enumerate(procs):
                if rank not in ended and proc.poll() is not None:
                    ended[rank] = time.monotonic()
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    outputs = [(Path(cwd) / f"rank{rank}.log").read_text() for rank in range(len(procs))]
    return [proc.wait() for proc in procs], outputs, [ended.get(rank, 0.0) for rank in range(len(procs))]
