"""The bounded device-planned exchange past its bound, on GPUs in bf16 (`pytest -m gpu`; EP = every GPU, 2 or 4,
skipped on one). ``overlap.moe_expert_rank_capacity_factor=1.0`` with learned routing overflows on every step: each
step's update is skipped on the device and the step runs again planned on the host. The result follows the bf16 rule
against an fp32 single-process run (the loss curve over STEPS steps, every gradient of the first), with the MoE
layers replayed from CUDA graphs (one chunk) and eager (2 chunks, delayed weight gradients); and a bound that is
never passed (factor = EP: the worst case) queues a graphed step without one host sync
(``torch.cuda.set_sync_debug_mode("error")`` around ``launch_step``; the metrics are read after it, their reserved
memory at least their allocated peak). The paged stash (``overlap.moe_paged_stash_factor``) likewise: graphed, a
pool of the worst case (never past) and of the balanced rows (past on the most loaded rank, run again); its pages in
the sync check too. The overflow chunk (``overlap.moe_overflow_capacity_factor`` = EP, never past): the same
overflow taken inside the step, graphed (one chunk: its room in the chunk's bound) and eager with 2 chunks, and
graphed with 2 chunks and each token once per rank (its copies past the bound as rows of their own), no step run
again, the same bf16 rule.

The per-rank work is `gpu_case`, launched once under torchrun; under MOE_GPU_TEST_DRYRUN=1 (tests/gpu_launch.py) it
runs on CPU gloo ranks, skipping the graphed layout and the sync check, which only CUDA runs.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.gpu_launch import (bf16_rule, cpu_skip_reason, dry_run, launch_ranks, ranks_for_every_gpu,
                              require_gpus, step_queued_without_host_sync, worker_device_type,
                              write_report)

STEPS = 3
FACTOR = "overlap.moe_expert_rank_capacity_factor"
PAGED = "overlap.moe_paged_stash_factor"
OVERFLOW = "overlap.moe_overflow_capacity_factor"


def gpu_case(output_dir: str) -> dict:
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.run_setup import init_distributed
    from moe_overlap.training.trainer import Trainer
    from tests.test_master import small_config
    from tests.test_pipeline import LAYERS

    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = {"train.device": worker_device_type(), **LAYERS}
    bf16 = {**fp32, "train.precision": "bf16"}
    world = int(os.environ.get("WORLD_SIZE", 1))
    global_batch = 8 * world  # 4 micro-batches of 2 per rank
    device_planned = {"overlap.moe_pipeline": "true", "overlap.moe_planning": "device"}
    layouts = {"overflow_graphed": {**device_planned, FACTOR: 1.0, "train.moe_cuda_graph": "true"},
               "overflow_eager_chunks2": {**device_planned, FACTOR: 1.0, "overlap.moe_pipeline_chunks": 2,
                                          "overlap.delay_wgrad_compute": "true"},
               # the paged stash: a pool of the worst case never overflows; of the balanced rows it does
               "paged_graphed": {**device_planned, PAGED: float(world), "train.moe_cuda_graph": "true"},
               "paged_overflow_graphed": {**device_planned, PAGED: 1.0, "train.moe_cuda_graph": "true"},
               # the overflow chunk takes it inside the step (one chunk: its room in the chunk's bound)
               "in_graph_graphed": {**device_planned, FACTOR: 1.0, OVERFLOW: float(world),
                                    "train.moe_cuda_graph": "true"},
               "in_graph_eager_chunks2": {**device_planned, FACTOR: 1.0, OVERFLOW: float(world),
                                          "overlap.moe_pipeline_chunks": 2, "overlap.delay_wgrad_compute": "true"},
               # each token once per rank: the copies past the bound cross again as rows of their own
               "in_graph_wire_graphed": {**device_planned, FACTOR: 1.0, OVERFLOW: float(world),
                                         "overlap.moe_dispatch_once_per_rank": "true", "train.moe_cuda_graph": "true",
                                         "overlap.moe_pipeline_chunks": 2}}
    mesh, device = init_distributed(small_config(output_dir, world, global_batch, **bf16))
    runs, skipped = {}, {}
    for name, extra in layouts.items():
        cfg = small_config(output_dir, world, global_batch, **bf16, **extra)
        skipped[name] = cpu_skip_reason(cfg, world)
        if not skipped[name]:
            runs[name] = Trainer(cfg, mesh, device)
    layouts = [name for name in layouts if not skipped[name]]
    runs["single_bf16"] = Trainer(small_config(output_dir, 1, global_batch, **bf16), Mesh.single(), device)
    runs["single_fp32"] = Trainer(small_config(output_dir, 1, global_batch, **fp32), Mesh.single(), device)
    losses, grads, reruns = {name: [] for name in runs}, {}, {name: 0 for name in layouts}
    overflow_rows = dict.fromkeys(layouts, 0)
    for step in range(STEPS):
        for name, trainer in runs.items():
            captured = {}  # a step run again reports its gradients again: the re-run's are kept
            metrics = trainer.train_step(lambda opt, captured=captured: captured.update(opt.logical_grads()))
            losses[name].append(metrics["loss"])
            if name in reruns:
                reruns[name] += metrics["moe_overflow_reruns"]
                overflow_rows[name] += metrics["moe_overflow_rows"]
            if step == 0:
                grads[name] = captured
    tensors, violations = bf16_rule(layouts, grads, losses)
    report = {"rank": mesh.rank, "world": world, "violations": violations, "tensors": tensors, "reruns": reruns,
              "overflow_rows": overflow_rows,
              "skipped": {name: why for name, why in skipped.items() if why}, "syncs_checked": False}
    if not dry_run():  # a bound never passed: the graphed step queues without a host sync
        bounded = Trainer(small_config(output_dir, world, global_batch, **bf16, **device_planned,
                                       **{FACTOR: float(world), PAGED: float(world), "train.moe_cuda_graph": "true"}),
                          mesh, device)
        bounded.train_step()  # the first step sizes what later steps reuse
        metrics = step_queued_without_host_sync(bounded)
        report["syncs_checked"] = metrics["moe_overflow_rows"] == 0
        # the allocator's reserved peak holds the graph pools: never below the allocated peak (both with symmetric)
        report["memory_gib"] = [metrics[key] for key in ("symmetric_memory_gib", "peak_memory_gib",
                                                          "reserved_memory_gib")]
    mesh.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


@pytest.mark.gpu
def test_overflow_runs_again_and_equals_single_process_bf16_on_every_gpu(tmp_path):
    require_gpus(2)
    world = ranks_for_every_gpu(limit=4)  # 8 experts: 2 chunks of local experts need EP <= 4
    for report in launch_ranks(__file__, tmp_path, timeout_s=300, world=world):
        assert report["tensors"] > 0 and not report["violations"], report["violations"]
        assert not report["skipped"] and set(report["reruns"]) == {
            "overflow_graphed", "overflow_eager_chunks2", "paged_graphed",
            "paged_overflow_graphed", "in_graph_graphed", "in_graph_eager_chunks2", "in_graph_wire_graphed"}
        assert all((reruns > 0) == ("overflow" in name) for name, reruns in report["reruns"].items()), report
        assert all(report["overflow_rows"][name] > 0 for name in report["overflow_rows"] if name.startswith("in_graph"))
        assert report["syncs_checked"], report
        symmetric, peak, reserved = report["memory_gib"]
        assert 0 < symmetric < peak <= reserved, report["memory_gib"]


@pytest.mark.slow  # the dry-run, not in CI
def test_overflow_dry_run_on_cpu_gloo(tmp_path):
    """The eager layout on 2 gloo ranks under the same checks (the graphed one and the sync check are CUDA's)."""
    for report in launch_ranks(__file__, tmp_path, timeout_s=600, world=2, dry_run=True):
        assert report["tensors"] > 0 and not report["violations"], report["violations"]
        assert set(report["skipped"]) == {"overflow_graphed", "paged_graphed",
                                          "paged_overflow_graphed", "in_graph_graphed", "in_graph_wire_graphed"}
        assert report["reruns"]["overflow_eager_chunks2"] > 0
        assert report["reruns"]["in_graph_eager_chunks2"] == 0 and report["overflow_rows"]["in_graph_eager_chunks2"] > 0


if __name__ == "__main__":
    write_report(sys.argv[1], gpu_case(sys.argv[1]))
