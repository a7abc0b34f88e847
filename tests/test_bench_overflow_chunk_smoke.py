"""The overflow chunk's benchmark (benchmarks/overflow_chunk.py) runs end to end on CPU with gloo (the `tiny` shape, at
world size 1) and writes the JSON a GPU run commits: per routing every variant's time, the rows past the bounds of
one call of each (skewed: past the chunks' bounds and all taken by the overflow chunk, none without it; forced
balance: none), and the overflow chunk's output equal to the unbounded call's; with each token once per rank too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("once", [False, True], ids=["copies", "wire_rows"])
def test_overflow_chunk_benchmark_smoke(tmp_path, once):
    out = tmp_path / "overflow.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(REPO / "benchmarks" / "overflow_chunk.py"), "--shape", "tiny", "--chunks", "4", "--rounds", "2",
           "--warmup", "1", "--skew", "2.0", "--json", str(out)] + ["--once-per-rank"] * once
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"device", "world_size", "date", "command", "rows"} <= set(result)
    skew, balanced = result["rows"]
    assert (skew["routing"], balanced["routing"]) == ("skew", "balanced") and skew["once_per_rank"] is once
    for row in (skew, balanced):
        assert set(row["ms"]) == {"unbounded", "overflow_chunk", "bounded", "host", "host_fwd"}
        assert all(ms > 0 for ms in row["ms"].values()) and row["overflow_chunk_vs_unbounded"] > 0
    rows = skew["rows"]
    assert rows["unbounded"] == {"overflow_rows": 0, "rerun_rows": 0}
    assert rows["overflow_chunk"]["overflow_rows"] > 0 and rows["overflow_chunk"]["rerun_rows"] == 0
    assert rows["bounded"]["rerun_rows"] == rows["bounded"]["overflow_rows"] == rows["overflow_chunk"]["overflow_rows"]
    assert all(counts == {"overflow_rows": 0, "rerun_rows": 0} for counts in balanced["rows"].values())
    assert skew["rel_err_out"] < 1e-6 and skew["rel_err_grad_x"] < 1e-6
