"""The training-step benchmark runs end to end on CPU, in one process and at 2 gloo ranks under torchrun (several
rows in one launch, the compute_only and ep1 reference rows), and writes the JSON the GPU runs commit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.train_step import main
from moe_overlap.distributed.streams import EXPOSED_KINDS

REPO = Path(__file__).resolve().parents[1]
RESOLVED = {"moe_path", "moe_pipeline", "moe_planning", "moe_transport", "moe_pipeline_chunks", "moe_cuda_graph",
            "moe_compute_only", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "ep_comm_ctas",
            "moe_gemm_sm_carveout", "use_distributed_optimizer", "moe_dispatch_once_per_rank"}


def check_row(row: dict, world: int) -> None:
    assert row["steps_timed"] == 2 and row["world_size"] == world
    assert len(row["step_times_s"]) == 2 and math.isclose(row["step_time_s_mean"], sum(row["step_times_s"]) / 2,
                                                          rel_tol=1e-3)
    assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["peak_tflops"] == 788.0
    assert math.isclose(row["tokens_per_s_per_gpu"] * world, row["tokens_per_s"])
    assert set(row["exposed_comm_ms"]) == set(EXPOSED_KINDS) and len(row["exposed_comm_ms_per_rank"]) == world
    assert RESOLVED <= set(row["resolved"])
    assert set(row["ep_imbalance"]) == set(row["expert_imbalance"]) and row["ep_imbalance"]
    assert all(value >= 1.0 for value in row["ep_imbalance"].values())
    assert len(row["profile_per_rank"]) == world and all(p["steps"] == [4, 4] for p in row["profile_per_rank"])
    assert math.isfinite(row["loss_last"])


def test_train_step_benchmark_one_process(tmp_path):
    out = tmp_path / "train.json"
    main(["configs/tiny.yaml", "parallel.expert_model_parallel_size=1", "train.micro_batch_size=2",
          "train.global_batch_size=4", "--steps", "2", "--warmup", "1", "--profile-steps", "1",
          "--variant", "device_planned:overlap.moe_pipeline=true,overlap.moe_planning=device", "--json", str(out)])
    result = json.loads(out.read_text())
    assert {"device", "world_size", "date", "command", "env", "rows", "order"} <= set(result)
    assert result["order"] == ["config", "device_planned"]
    for row in result["rows"]:
        check_row(row, 1)
        assert row["tokens_per_step"] == 4 * 128 and row["resolved"]["moe_path"] == "local"
        assert set(row["ep_imbalance"].values()) == {1.0}  # one EP rank holds every expert
        assert row["ep_imbalance_micro_batch"] == {}  # nothing waits for a peer


def test_train_step_benchmark_two_ranks_with_reference_rows(tmp_path):
    """2 gloo ranks (EP=2): two rows, compute_only and ep1 in one launch; every rank meets every collective
    (a rank that left early used to hang the others at the last barrier)."""
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "benchmarks" / "train_step.py"), "configs/tiny.yaml", "train.micro_batch_size=2",
           "train.global_batch_size=4", "--steps", "2", "--warmup", "1", "--profile-steps", "1",
           "--variant", "pipeline:overlap.moe_pipeline=true,overlap.moe_pipeline_chunks=2",
           "--compute-only", "--ep1", "--ep1-overrides",
           "parallel.expert_model_parallel_size=1,train.micro_batch_size=2,train.global_batch_size=4",
           "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["weak_scaling"]
    # ep1 first (rank 0 holds nothing yet), then the reference rows before the variants
    assert result["order"] == ["ep1", "config", "compute_only", "pipeline"]
    rows = {row["variant"]: row for row in result["rows"]}
    for name in ("config", "pipeline", "compute_only"):
        check_row(rows[name], 2)
        assert rows[name]["global_batch_size"] == 8 and rows[name]["micro_batches_per_rank"] == 2  # weak scaling
        assert rows[name]["resolved"]["moe_transport"] == "gloo"
        assert rows[name]["vs_ep1"] > 0 and rows[name]["vs_compute_only"] > 0
        per_micro_batch = rows[name]["ep_imbalance_micro_batch"]
        assert set(per_micro_batch) == set(rows[name]["ep_imbalance"])
        assert all(1.0 <= v["mean"] <= v["max"] for v in per_micro_batch.values())
    assert rows["config"]["resolved"]["moe_path"] == "pipeline" and rows["config"]["exposed_comm_ms"]["ep"] > 0
    assert rows["pipeline"]["resolved"]["moe_pipeline_chunks"] == 2
    assert rows["compute_only"]["resolved"]["moe_compute_only"] is True
    # compute_only routed as the config row did (its own MoE outputs would route otherwise), so it waited for the
    # same most loaded rank
    assert rows["compute_only"]["routing"]["replayed_from_config"] and not rows["config"]["routing"][
        "replayed_from_config"]
    for key in ("ep_imbalance", "expert_imbalance", "ep_imbalance_micro_batch"):
        assert rows["compute_only"][key] == rows["config"][key], key
    check_row(rows["ep1"], 1)
    assert rows["ep1"]["global_batch_size"] == 4 and rows["ep1"]["vs_ep1"] == 1.0


def test_a_compute_only_row_with_a_nan_loss_is_no_limit():
    """Nothing is divided by a compute-only row whose loss went NaN (its optimizer skipped steps), and it says so."""
    from benchmarks.train_step import relate

    def row(variant, step, loss):
        return {"variant": variant, "step_time_s": step, "tokens_per_s_per_gpu": 1 / step, "loss_first": 10.0,
                "loss_last": loss}
    finite = [row("config", 1.1, 4.0), row("compute_only", 1.0, 10.0)]
    relate(finite)
    assert finite[0]["vs_compute_only"] == 1.1 and "not_a_limit" not in finite[1]
    broken = [row("config", 1.1, 4.0), row("compute_only", 0.9, float("nan"))]
    relate(broken)
    assert "vs_compute_only" not in broken[0] and "not finite" in broken[1]["not_a_limit"]


def test_a_profiled_row_is_split_against_compute_only_over_every_stream():
    """With profiles, each row's kernel time by kind (both micro-batch streams summed), window and GPU idle time are
    set against compute_only's per rank: the split of a step that misses its ratio to the limit."""
    from benchmarks.train_step import relate

    def profile(comm, copies, window, idle):
        return {"breakdown": {"compute_stream_ms": {"GEMM": 100.0, "communication": comm, "idle": 50.0},
                              "other_streams_ms": {"GEMM": 90.0, "copies": copies}},
                "streams": {"window_ms": window, "device_idle_ms": idle}}

    def row(variant, step, profiles):
        return {"variant": variant, "step_time_s": step, "tokens_per_s_per_gpu": 1 / step, "loss_first": 10.0,
                "loss_last": 9.0, "profile_per_rank": profiles}
    skipped = {"breakdown": {"skipped": "the profiler recorded no device events"}, "streams": {"skipped": "..."}}
    rows = [row("config", 0.62, [profile(30.0, 50.0, 605.0, 8.0), None, skipped]),
            row("compute_only", 0.59, [profile(10.0, 75.0, 593.0, 10.5), profile(12.0, 70.0, 593.0, 9.0),
                                       profile(12.0, 70.0, 593.0, 9.0)])]
    relate(rows)
    split = rows[0]["split_vs_compute_only"]
    assert split[1] is None and split[2] is None  # rank 1 of the row has no profile, rank 2 no device events (CPU)
    assert split[0] == {"GEMM": 0.0, "communication": 20.0, "copies": -25.0, "window": 12.0,
                        "no_stream_running": -2.5}
    assert "split_vs_compute_only" not in rows[1]


CE_SHADOW_RUN = """
import json, os, sys
import torch
import moe_overlap.distributed.symm as symm

copies = []


class HostScratch:  # symmetric memory's stand-in on gloo ranks: every rank's scratch is a host buffer here
    def __init__(self, group, nbytes, device):
        self.nbytes = nbytes

    def view(self, rank, shape, dtype):
        copies.append([rank, shape[0]])
        return torch.zeros(shape, dtype=dtype)


symm.SymmWorkspace = HostScratch
import benchmarks.ce_shadow as ce_shadow

ce_shadow.main(sys.argv[2:])
with open(sys.argv[1] + os.environ["RANK"], "w") as f:
    json.dump(copies, f)
"""


def test_the_copy_engine_shadow_rows_copy_a_slot_to_the_peer_at_every_transfer(tmp_path):
    """benchmarks/ce_shadow.py at 2 gloo ranks: only the ``_ce`` row copies, a micro-batch's tokens at each
    transfer's row width, to the other rank; the rows are train_step.py's."""
    script, out = tmp_path / "run.py", tmp_path / "shadow.json"
    script.write_text(CE_SHADOW_RUN)
    compute_only = "overlap.moe_pipeline=true,overlap.moe_compute_only=true"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(tmp_path / "copies"), "configs/tiny.yaml", "overlap.moe_planning=device", "train.micro_batch_size=2",
           "train.global_batch_size=4", "--steps", "1", "--warmup", "1", "--profile-steps", "0", "--compute-only",
           "--variant", f"compute_only_ce:{compute_only}", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text())["order"] == ["config", "compute_only", "compute_only_ce"]
    tokens = 2 * 128  # tiny.yaml: a micro-batch of 2 sequences of 128 tokens
    for rank in (0, 1):
        copies = json.loads((tmp_path / f"copies{rank}").read_text())
        # 2 steps x 2 micro-batches a rank x 3 MoE layers x the dispatch and combine, forward and backward
        assert len(copies) == 2 * 2 * 3 * 4
        assert {peer for peer, _ in copies} == {1 - rank}
        assert {nbytes for _, nbytes in copies} == {tokens * 128 * 4}  # rows 128 wide (the hidden), fp32
