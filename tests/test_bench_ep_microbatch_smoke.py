"""The cross-micro-batch benchmark runs end to end on CPU: one process at EP=1 (off, on; compute-only is off
there) and two gloo ranks at EP=2 (off, on, compute-only), writing the JSON the GPU runs commit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from benchmarks.ep_microbatch_overlap import main
from tests.gpu_launch import REPO

SMALL = ["train.micro_batch_size=2", "train.global_batch_size=8", "--rounds", "2", "--block", "2", "--warmup", "1"]


def test_one_rank_off_and_on(tmp_path):
    rows = main(["configs/tiny.yaml", "parallel.expert_model_parallel_size=1", *SMALL, "--json",
                 str(tmp_path / "ep1.json"), "--timeline", str(tmp_path / "ep1.png")])
    result = json.loads((tmp_path / "ep1.json").read_text())
    assert [row["variant"] for row in rows] == ["off", "on"] and result["ep"] == 1
    assert "off is the limit" in result["notes"]["compute_only"]
    assert all(row["steps_timed"] == 2 and row["tokens_per_s"] > 0 and "streams" in row for row in rows)


def test_two_ranks_with_the_compute_only_limit(tmp_path):
    out = tmp_path / "ep2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "benchmarks/ep_microbatch_overlap.py", "configs/tiny.yaml", "overlap.moe_pipeline=true", *SMALL,
           "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["variant"] for row in rows] == ["off", "on", "compute_only"]
    on = rows[1]
    # the overlapped run waits for its exchanges inside labelled stages; the local copy never waits for a peer
    assert on["exposed_comm_by_stage_ms"] and all(key.startswith("ep ") for key in on["exposed_comm_by_stage_ms"])
    assert all(math.isfinite(row["loss_last"]) for row in rows)  # the local copy leaves no garbage behind
