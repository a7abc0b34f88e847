"""Graphed MoE layers under interleaved 1F1B on GPUs in bf16 (`pytest -m gpu`), the bf16 rule: each run's error
against an fp32 single-process run is at most 2x the single-process bf16 run's own, per gradient of the first step
(normwise) and for the loss curve. PP=2 x VPP=2 on 2 GPUs (one expert rank) and PP=2 x VPP=2 x EP=2 on 4 (the
device-planned exchange). Each model chunk's MoE layers replay a copy of their graphs per micro-batch of that chunk
in flight (schedules.graph_copies), captured apart from the other chunk's (a capture's graphs share one memory
pool, which needs them called in capture order: captured together, a grouped GEMM found its group sizes
overwritten); the report's copies are checked against the schedule. Eager, graphed, and (one expert rank: with an
exchange it is refused under PP) graphed with paired micro-batches on two streams (an even count of copies). The
per-rank work is `gpu_case`, launched once under torchrun per test; under MOE_GPU_TEST_DRYRUN=1
(tests/gpu_launch.py) it runs on CPU gloo ranks, skipping the graphed runs (`-m slow`: the dry-run test).
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.gpu_launch import bf16_rule, cpu_skip_reason, launch_ranks, worker_device_type, write_report

STEPS = 3
MICRO_BATCHES = 8  # of 2 sequences: rank 0 keeps 4 of its first chunk in flight and 2 of its second


def gpu_case(output_dir: str) -> dict:
    import os

    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.run_setup import init_distributed
    from moe_overlap.training.trainer import Trainer
    from tests.test_master import small_config
    from tests.test_pipeline import LAYERS  # 4 layers, MoE at 0, 2 and 3: one per virtual stage but rank 1's first

    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = {"train.device": worker_device_type(), **LAYERS}
    bf16 = {**fp32, "train.precision": "bf16"}
    world = int(os.environ.get("WORLD_SIZE", 2))
    ep = world // 2
    interleaved = {**bf16, "parallel.pipeline_model_parallel_size": 2,
                   "parallel.virtual_pipeline_model_parallel_size": 2,
                   "overlap.overlap_moe_expert_parallel_comm": "false"}  # auto could pair over NCCL
    graphed = {"train.moe_cuda_graph": "true"}
    if ep > 1:
        graphed.update({"overlap.moe_pipeline": "true", "overlap.moe_planning": "device"})
    layouts = {"eager": {}, "graphed": graphed}
    if ep == 1:
        layouts["graphed_paired_streams"] = {**graphed, "overlap.overlap_moe_expert_parallel_comm": "true"}
    global_batch = 2 * MICRO_BATCHES * ep  # 8 micro-batches of 2 per pipeline
    first = small_config(output_dir, ep, global_batch, **interleaved)
    mesh, device = init_distributed(first)
    runs, skipped = {}, {}
    for name, extra in layouts.items():
        cfg = small_config(output_dir, ep, global_batch, **{**interleaved, **extra})
        skipped[name] = cpu_skip_reason(cfg, world)
        if not skipped[name]:
            runs[name] = Trainer(cfg, mesh, device)
    layouts = [name for name in layouts if not skipped[name]]
    copies = {name: {index: 1 + len(layer.graph_copies) for index, layer in
                     ((int(i), block.mlp) for i, block in runs[name].model.layers.items() if block.is_moe)}
              for name in layouts}
    runs["single_bf16"] = Trainer(small_config(output_dir, 1, global_batch, **bf16), Mesh.single(), device)
    runs["single_fp32"] = Trainer(small_config(output_dir, 1, global_batch, **fp32), Mesh.single(), device)
    losses = {name: [] for name in runs}
    grads = {}
    for step in range(STEPS):
        for name, trainer in runs.items():
            captured = {}
            losses[name].append(trainer.train_step(lambda opt, captured=captured: captured.update(
                opt.logical_grads()))["loss"])
            if step == 0:
                grads[name] = captured
    tensors, violations = bf16_rule(layouts, grads, losses)
    report = {"rank": mesh.rank, "pp_rank": mesh.pp.rank, "losses": losses, "violations": violations,
              "tensors": tensors, "copies": copies, "skipped": {name: why for name, why in skipped.items() if why}}
    mesh.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


# each rank's MoE layers' graphed copies (layer -> copies): rank 0 holds layers 0 and 2 (its chunks' 4 and 2
# micro-batches in flight), rank 1 layer 3 (1; its first chunk, layer 1, is dense); on two streams, even
COPIES = {"eager": [{0: 1, 2: 1}, {3: 1}], "graphed": [{0: 4, 2: 2}, {3: 1}],
          "graphed_paired_streams": [{0: 4, 2: 2}, {3: 2}]}


def check(reports: list[dict], world: int, skipped: set[str] = frozenset()) -> None:
    assert len(reports) == world
    for report in reports:
        assert report["tensors"] > 0 and not report["violations"], report["violations"]
        assert set(report["skipped"]) == skipped, report["skipped"]
        assert set(report["copies"]) | skipped == set(COPIES) - ({"graphed_paired_streams"} if world > 2 else set())
        for name, per_layer in report["copies"].items():
            assert {int(i): n for i, n in per_layer.items()} == COPIES[name][report["pp_rank"]], (name, report)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_graphed_moe_layers_under_interleaved_1f1b_bf16(tmp_path, world):
    check(launch_ranks(__file__, tmp_path, timeout_s=300, world=world), world)


@pytest.mark.slow  # the dry-run, not in CI: the eager runs only
@pytest.mark.parametrize("world", [2, 4])
def test_dry_run_on_cpu_gloo(tmp_path, world):
    graphed = {"graphed", "graphed_paired_streams"} if world == 2 else {"graphed"}
    check(launch_ranks(__file__, tmp_path, timeout_s=600, world=world, dry_run=True), world, graphed)


if __name__ == "__main__":
    write_report(sys.argv[1], gpu_case(sys.argv[1]))
