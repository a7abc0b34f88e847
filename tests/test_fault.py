"""A rank that dies makes the others exit with a clear error within the configured timeout: no hang."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_rank_stops_the_others_with_a_clear_error(tmp_path):
    port = _free_port()
    args = [sys.executable, "-m", "moe_overlap", "train", str(REPO / "configs" / "tiny.yaml"),
            "train.max_steps=100000", "train.eval_interval=0", "checkpoint.save_final=false",
            f"train.output_dir={tmp_path}", f"train.distributed_timeout_s={TIMEOUT_S}"]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # both ranks are training
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = procs[0].communicate(timeout=TIMEOUT_S + 30)
        waited = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode != 0
    assert "rank 0: a collective failed" in stderr and "distributed_timeout_s" in stderr, stderr[-2000:]
    assert waited < TIMEOUT_S + 30
