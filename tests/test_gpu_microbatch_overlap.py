"""``overlap_moe_expert_parallel_comm`` on GPUs in bf16 (`pytest -m gpu`), the bf16 rule: each run's error
against an fp32 single-process run is at most 2x the single-process bf16 run's own, per gradient of the first
step (normwise) and for the loss curve. On one GPU (EP=1: no exchange, each layer attention | MLP, eager; and with
graphed MoE layers, each pair's halves whole on two streams), and with EP = every GPU (2 or 4; skipped on one: the
host-planned pipeline over NCCL with its CTA cap and carve-out, and the device-planned one over SM pushes in 2
chunks, each layer cut at its exchanges; and the device-planned one chunk graphed, the pairs on two streams, each
copy of the graphs exchanging through its own regions, unbounded, with a bound of 1.5 and wire rows, and moved by
the copy engines in slots). The
per-rank work is `gpu_case`, launched once under torchrun per test; under MOE_GPU_TEST_DRYRUN=1
(tests/gpu_launch.py) it runs on CPU gloo ranks, skipping what only CUDA runs (`-m slow`: the dry-run tests).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.gpu_launch import (bf16_rule, cpu_skip_reason, launch_ranks, ranks_for_every_gpu, require_gpus,
                              train_side_by_side, worker_device_type, write_report)

STEPS = 3


def gpu_case(output_dir: str) -> dict:
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.run_setup import init_distributed, mesh_group_options, mesh_layout
    from moe_overlap.training.trainer import Trainer
    from tests.test_master import small_config
    from tests.test_pipeline import LAYERS

    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = {"train.device": worker_device_type(), **LAYERS}
    bf16 = {**fp32, "train.precision": "bf16"}
    on = {**bf16, "overlap.overlap_moe_expert_parallel_comm": "true"}
    off = {**bf16, "overlap.overlap_moe_expert_parallel_comm": "false"}  # auto would pair over NCCL
    world = int(os.environ.get("WORLD_SIZE", 1))
    global_batch = 8 * world  # 4 micro-batches of 2 per rank
    first = small_config(output_dir, world, global_batch, **bf16)
    mesh, device = init_distributed(first)
    if world == 1:
        layouts = {"off": {}, "on": {}, "off_graphed": {"train.moe_cuda_graph": "true"},
                   "on_graphed": {"train.moe_cuda_graph": "true"}}
    else:
        host = {"overlap.moe_pipeline": "true", "overlap.moe_planning": "host", "overlap.moe_transport": "nccl",
                "overlap.ep_comm_ctas": 4, "overlap.gemm_sm_carveout": 8}
        device_planned = {"overlap.moe_pipeline": "true", "overlap.moe_planning": "device",
                          "overlap.moe_pipeline_chunks": 2, "overlap.delay_wgrad_compute": "true"}
        graphed = {"overlap.moe_pipeline": "true", "overlap.moe_planning": "device", "train.moe_cuda_graph": "true"}
        bounded = {**graphed, "overlap.moe_expert_rank_capacity_factor": 1.5,  # wire rows: on streams, these hung
                   "overlap.moe_dispatch_once_per_rank": "true"}  # until each graph set had its cuBLAS workspace
        copies = {**graphed, "overlap.moe_transport": "copy_engine",  # each token's wire rows in slots
                  "overlap.moe_dispatch_once_per_rank": "true"}
        layouts = {"off_host_nccl": host, "on_host_nccl": host, "off_device_push": device_planned,
                   "on_device_push": device_planned, "off_graphed": graphed, "on_graphed": graphed,
                   "on_graphed_bounded": bounded, "on_graphed_copy_engine": copies}
    runs, skipped = {}, {}
    meshes = {(None, None): mesh}  # by the CTA caps (dp_comm_ctas, ep_comm_ctas) its communicators are made with
    for name, extra in layouts.items():
        cfg = small_config(output_dir, world, global_batch, **(on if name.startswith("on") else off), **extra)
        skipped[name] = cpu_skip_reason(cfg, world)  # the dry-run's: what only CUDA runs
        if not skipped[name]:
            caps = (cfg.overlap.dp_comm_ctas, cfg.overlap.ep_comm_ctas)
            if caps not in meshes:
                meshes[caps] = Mesh.create(mesh_layout(cfg, world), timeout_s=cfg.train.distributed_timeout_s,
                                           pg_options=mesh_group_options(cfg))
            runs[name] = Trainer(cfg, meshes[caps], device)
    layouts = [name for name in layouts if not skipped[name]]
    runs["single_bf16"] = Trainer(small_config(output_dir, 1, global_batch, **bf16), Mesh.single(), device)
    runs["single_fp32"] = Trainer(small_config(output_dir, 1, global_batch, **fp32), Mesh.single(), device)
    losses, grads = train_side_by_side(runs, STEPS)
    tensors, violations = bf16_rule(layouts, grads, losses)
    report = {"rank": mesh.rank, "world": world, "losses": losses, "violations": violations, "tensors": tensors,
              "orders": {name: sorted({name for _, _, name in runs[name].stage_order}) for name in layouts},
              "sequences": {name: [f"{d}{mb}" for d, mb, _ in runs[name].stage_order] for name in layouts},
              "skipped": {name: why for name, why in skipped.items() if why}}
    for each in meshes.values():
        each.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


def check(reports: list[dict], split: bool, skipped: set[str] = frozenset()) -> None:
    for report in reports:
        assert report["tensors"] > 0 and not report["violations"], report["violations"]
        assert set(report["skipped"]) == skipped, report["skipped"]
        for name, stages in report["orders"].items():
            # the switch ran the stages (off: none), a MoE layer cut at its exchanges when there are any
            assert bool(stages) == name.startswith("on"), (name, stages)
            if stages and name.startswith("on_graphed"):  # graphed: a pair's halves whole, each on its own stream
                assert stages == ["stage0"], stages
                assert report["sequences"][name] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"], report
            elif stages:
                assert ("0.experts" in stages) == split and "1.mlp" in stages, stages


@pytest.mark.gpu
def test_on_equals_off_bf16_one_gpu(tmp_path):
    check(launch_ranks(__file__, tmp_path, timeout_s=300, world=1), split=False)


@pytest.mark.gpu
def test_on_equals_off_bf16_ep_over_every_gpu(tmp_path):
    require_gpus(2)
    world = ranks_for_every_gpu(limit=4)  # 8 experts: 2 chunks of local experts need EP <= 4
    check(launch_ranks(__file__, tmp_path, timeout_s=300, world=world), split=True)


@pytest.mark.slow  # the dry-run, not in CI: 25 s at 1 rank, 50 s at 2, 115 s at 4 on 2 shared cores
@pytest.mark.parametrize("world", [1, 2, 4])
def test_dry_run_on_cpu_gloo(tmp_path, world):
    """What the CPU can run of each world's cases (gloo, bf16), under the same checks; it skips the graphed MoE
    layers on one rank, the host-planned pipeline over NCCL (CTA cap, carve-out) on more."""
    cuda_only = {"off_graphed", "on_graphed"} | (set() if world == 1 else {"off_host_nccl", "on_host_nccl",
                                                                         "on_graphed_bounded",
                                                                         "on_graphed_copy_engine"})
    check(launch_ranks(__file__, tmp_path, timeout_s=600, world=world, dry_run=True), world > 1, cuda_only)


if __name__ == "__main__":
    write_report(sys.argv[1], gpu_case(sys.argv[1]))
