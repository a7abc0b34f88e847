"""``overlap_moe_expert_parallel_comm`` on GPUs in bf16 (`pytest -m gpu`), DESIGN.md's rule: each run's error
against an fp32 single-process run is at most 2x the single-process bf16 run's own, per gradient of the first
step (normwise) and for the loss curve. EP = the number of GPUs (one: no exchange, each layer attention | MLP,
eager and with graphed MoE layers; two: the host-planned pipeline over NCCL with its CTA cap and carve-out, and
the device-planned one over SM pushes in 2 chunks, each layer cut at its exchanges). The per-rank work is
`gpu_case`, launched once under torchrun per GPU count.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.gpu_launch import bf16_rule, launch_ranks, write_report

STEPS = 3


def gpu_case(output_dir: str) -> dict:
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.trainer import Trainer, init_distributed
    from tests.test_master import small_config
    from tests.test_pipeline import LAYERS

    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = {"train.device": "cuda", **LAYERS}
    bf16 = {**cuda, "train.precision": "bf16"}
    on = {**bf16, "overlap.overlap_moe_expert_parallel_comm": "true"}
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
        layouts = {"off_host_nccl": host, "on_host_nccl": host, "off_device_push": device_planned,
                   "on_device_push": device_planned}
    runs = {name: Trainer(small_config(output_dir, world, global_batch, **(on if name.startswith("on") else bf16),
                                       **extra), mesh, device) for name, extra in layouts.items()}
    runs["single_bf16"] = Trainer(small_config(output_dir, 1, global_batch, **bf16), Mesh.single(), device)
    runs["single_fp32"] = Trainer(small_config(output_dir, 1, global_batch, **cuda), Mesh.single(), device)
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
    report = {"rank": mesh.rank, "world": world, "losses": losses, "violations": violations, "tensors": tensors,
              "orders": {name: sorted({name for _, _, name in runs[name].stage_order}) for name in layouts}}
    mesh.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


def check(reports: list[dict], split: bool) -> None:
    for report in reports:
        assert report["tensors"] > 0 and not report["violations"], report["violations"]
        for name, stages in report["orders"].items():
            # the switch ran the stages (off: none), a MoE layer cut at its exchanges when there are any
            assert bool(stages) == name.startswith("on"), (name, stages)
            if stages:
                assert ("0.experts" in stages) == split and "1.mlp" in stages, stages


@pytest.mark.gpu
def test_on_equals_off_bf16_one_gpu(tmp_path):
    check(launch_ranks(__file__, tmp_path, timeout_s=300, world=1), split=False)


@pytest.mark.gpu
def test_on_equals_off_bf16_two_gpus(tmp_path):
    check(launch_ranks(__file__, tmp_path, timeout_s=300, world=2), split=True)


if __name__ == "__main__":
    write_report(sys.argv[1], gpu_case(sys.argv[1]))
