"""The training-step benchmark runs end to end on CPU (one process, the tiny config) and writes the JSON the GPU
runs commit: throughput, MFU with its peak, memory, exposed communication per kind, one row per variant."""

from __future__ import annotations

import json

from benchmarks.train_step import main
from moe_overlap.distributed.streams import EXPOSED_KINDS


def test_train_step_benchmark_smoke(tmp_path):
    out = tmp_path / "train.json"
    main(["configs/tiny.yaml", "parallel.expert_model_parallel_size=1", "train.micro_batch_size=2",
          "train.global_batch_size=4", "--steps", "2", "--warmup", "1", "--profile-steps", "1",
          "--variant", "device_planned:overlap.moe_pipeline=true,overlap.moe_planning=device", "--json", str(out)])
    result = json.loads(out.read_text())
    assert {"device", "world_size", "date", "command", "env", "rows"} <= set(result)
    assert [row["variant"] for row in result["rows"]] == ["config", "device_planned"]
    for row in result["rows"]:
        assert row["steps_timed"] == 2 and row["tokens_per_step"] == 4 * 128
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["peak_tflops"] == 788.0
        assert set(row["exposed_comm_ms"]) == set(EXPOSED_KINDS)
        assert row["profile"]["steps"] == [4, 4]
