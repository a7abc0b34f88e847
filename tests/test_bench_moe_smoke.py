"""The MoE layer benchmark runs end to end on CPU with gloo (the `tiny` shape) at world size 1 and 2, and writes
the JSON the GPU runs commit: a row per planning mode with every field the issue names, limit = max(comm, gemm);
each token once per rank (wire rows) as training's auto resolves it, and asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("world, once_per_rank", [(1, "auto"), (2, "auto"), (2, "true")])
def test_moe_layer_benchmark_smoke(tmp_path, world, once_per_rank):
    out = tmp_path / "moe.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(REPO / "benchmarks" / "moe_layer.py"), "--shapes", "tiny", "--rounds", "2", "--warmup", "1",
           "--chunks", "1,2", "--skew", "--once-per-rank", once_per_rank, "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"device", "world_size", "date", "command", "env", "rows"} <= set(result)
    assert result["world_size"] == world and "TORCH_SYMM_MEM_DISABLE_MULTICAST" in result["env"]
    plannings = ["host", "device"] + (["local"] if world == 1 else [])
    assert [(row["shape"], row["planning"]) for row in result["rows"]] == [
        (shape, planning) for shape in ("tiny", "tiny_skew") for planning in plannings]
    for row in result["rows"]:
        for suffix in ("fwd", "fwdbwd"):
            for kind in ("serial", "overlapped", "comm", "gemm", "limit", "baseline"):
                assert row[f"{kind}_{suffix}_ms"] > 0, (kind, suffix)
            assert row[f"limit_{suffix}_ms"] == max(row[f"comm_{suffix}_ms"], row[f"gemm_{suffix}_ms"])
        if row["planning"] != "local":  # gloo, and on CPU the gloo twin of the SM push
            assert row["backend"] == "gloo" and row["chunks"] in (1, 2)
            assert row["best"].startswith(row["planning"] + ":gloo:")
        assert row["tokens_per_rank_max"] >= row["tokens_per_rank_mean"] > 0
        assert row["once_per_rank"] is (once_per_rank == "true")  # auto: off at the tiny shape's top-2
