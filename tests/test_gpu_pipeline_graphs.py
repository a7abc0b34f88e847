"""Graphed MoE layers under every pipeline schedule on GPUs in bf16 (`pytest -m gpu`), the bf16 rule: each run's
error against an fp32 single-process run is at most 2x the single-process bf16 run's own, per gradient of the first
step (normwise) and for the loss curve. PP=2 on 2 GPUs (one expert rank) and PP=2 x EP=2 on 4 (the device-planned
exchange): interleaved 1F1B (VPP=2), ZB-H1 and all-forward-all-backward, eager against graphed, and (one expert
rank: with an exchange it is refused under PP) graphed with paired micro-batches on two streams.

Each model chunk's MoE layers replay a copy of their graphs per micro-batch of that chunk in flight
(schedules.graph_copies; under ZB-H1 until I, where a graph replays a layer's whole backward), captured apart from
the other chunk's (a capture's graphs share one memory pool, which needs them called in capture order: captured
together under interleaving, a grouped GEMM found its group sizes overwritten); the report's copies per layer are
checked against the schedule. The per-rank work is `gpu_case`, launched once under torchrun per test; under
MOE_GPU_TEST_DRYRUN=1 (tests/gpu_launch.py) it runs on CPU gloo ranks, skipping the graphed runs (`-m slow`).
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.gpu_launch import (bf16_rule, cpu_skip_reason, launch_ranks, train_side_by_side, worker_device_type,
                              write_report)

STEPS = 3
MICRO_BATCHES = 8  # of 2 sequences a pipeline
SCHEDULES = {"interleaved": {"parallel.virtual_pipeline_model_parallel_size": 2},
             "zb_h1": {"train.pipeline_schedule": "zb_h1"},
             "afab": {"train.pipeline_schedule": "all_forward_all_backward"}}
# each pipeline rank's MoE layers' graphed copies (layer -> copies) by layout, from the schedules at PP=2 with 8
# micro-batches over tests/test_pipeline.LAYERS (MoE at 0, 2 and 3): interleaved, rank 0 holds layers 0 and 2 (its
# chunks' 4 and 2 micro-batches in flight), rank 1 layer 3 (1; its first chunk, layer 1, is dense); ZB-H1 until I
# (2 and 1); all-forward-all-backward every micro-batch; pairs on two streams an even count of the paired schedule's
COPIES = {"interleaved_eager": [{0: 1, 2: 1}, {3: 1}], "interleaved_graphed": [{0: 4, 2: 2}, {3: 1}],
          "interleaved_graphed_paired_streams": [{0: 4, 2: 2}, {3: 2}],
          "zb_h1_eager": [{0: 1}, {2: 1, 3: 1}], "zb_h1_graphed": [{0: 2}, {2: 1, 3: 1}],
          "zb_h1_graphed_paired_streams": [{0: 4}, {2: 2, 3: 2}], "afab_graphed": [{0: 8}, {2: 8, 3: 8}]}
STREAMS = {name for name in COPIES if name.endswith("paired_streams")}
EAGER = {name for name in COPIES if name.endswith("eager")}


def gpu_case(output_dir: str) -> dict:
    import os

    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.run_setup import init_distributed
    from moe_overlap.training.trainer import Trainer
    from tests.test_master import small_config
    from tests.test_pipeline import LAYERS

    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = {"train.device": worker_device_type(), **LAYERS}
    bf16 = {**fp32, "train.precision": "bf16"}
    world = int(os.environ.get("WORLD_SIZE", 2))
    ep = world // 2
    pp2 = {**bf16, "parallel.pipeline_model_parallel_size": 2,
           "overlap.overlap_moe_expert_parallel_comm": "false"}  # auto could pair over NCCL
    graphed = {"train.moe_cuda_graph": "true"}
    if ep > 1:
        graphed.update({"overlap.moe_pipeline": "true", "overlap.moe_planning": "device"})
    layouts = {}
    for name in COPIES:
        if name in STREAMS and ep > 1:
            continue
        schedule = next(overrides for key, overrides in SCHEDULES.items() if name.startswith(key))
        extra = {} if name in EAGER else graphed
        paired = {"overlap.overlap_moe_expert_parallel_comm": "true"} if name in STREAMS else {}
        layouts[name] = {**pp2, **schedule, **extra, **paired}
    global_batch = 2 * MICRO_BATCHES * ep
    mesh, device = init_distributed(small_config(output_dir, ep, global_batch, **pp2))
    runs, skipped = {}, {}
    for name, overrides in layouts.items():
        cfg = small_config(output_dir, ep, global_batch, **overrides)
        skipped[name] = cpu_skip_reason(cfg, world)
        if not skipped[name]:
            runs[name] = Trainer(cfg, mesh, device)
    layouts = [name for name in layouts if not skipped[name]]
    copies = {name: {index: 1 + len(layer.graph_copies) for index, layer in
                     ((int(i), block.mlp) for i, block in runs[name].model.layers.items() if block.is_moe)}
              for name in layouts}
    runs["single_bf16"] = Trainer(small_config(output_dir, 1, global_batch, **bf16), Mesh.single(), device)
    runs["single_fp32"] = Trainer(small_config(output_dir, 1, global_batch, **fp32), Mesh.single(), device)
    losses, grads = train_side_by_side(runs, STEPS)
    tensors, violations = bf16_rule(layouts, grads, losses)
    report = {"rank": mesh.rank, "pp_rank": mesh.pp.rank, "losses": losses, "violations": violations,
              "tensors": tensors, "copies": copies, "skipped": {name: why for name, why in skipped.items() if why}}
    mesh.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


def check(reports: list[dict], world: int, skipped: set[str] = frozenset()) -> None:
    assert len(reports) == world
    expected = set(COPIES) - (STREAMS if world > 2 else set())
    for report in reports:
        assert report["tensors"] > 0 and not report["violations"], report["violations"]
        assert set(report["skipped"]) == skipped, report["skipped"]
        assert set(report["copies"]) | skipped == expected, sorted(report["copies"])
        for name, per_layer in report["copies"].items():
            assert {int(i): n for i, n in per_layer.items()} == COPIES[name][report["pp_rank"]], (name, report)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_graphed_moe_layers_under_every_pp_schedule_bf16(tmp_path, world):
    check(launch_ranks(__file__, tmp_path, timeout_s=400, world=world), world)


@pytest.mark.slow  # the dry-run, not in CI: the eager runs only
@pytest.mark.parametrize("world", [2, 4])
def test_dry_run_on_cpu_gloo(tmp_path, world):
    check(launch_ranks(__file__, tmp_path, timeout_s=600, world=world, dry_run=True), world,
          set(COPIES) - EAGER - (STREAMS if world > 2 else set()))


if __name__ == "__main__":
    write_report(sys.argv[1], gpu_case(sys.argv[1]))
