"""``overlap.moe_dispatch_once_per_rank`` on GPUs (`pytest -m gpu`; EP = every GPU, 2 or 4, skipped on one).

bf16: each layout runs with the switch off and on, and both follow the bf16 rule against an fp32 single-process run
(the loss curve over STEPS steps, every gradient of the first): SM pushes device-planned and replayed from CUDA
graphs (one chunk), SM pushes eager (2 chunks, delayed weight gradients), the copy engine and NCCL host-planned (2
chunks), the copy engine device-planned and graphed (wire rows in slots: the switch on only), and paired
micro-batches over NCCL. Routing is forced there (model.moe_router_force_load_balancing): with
the switch on, the expert side sums a token's copies before they cross, one bf16 rounding at another place than the
single run's. With the router choosing, on 2 and 4 H100s one or two experts' weight gradients then missed the
rule by 2.5-5x while the other tensors passed and fp32 matched: the signature of a near-tied top-4 choice flipped
by that rounding, one token moving between two experts. The report gives that comparison for one layout, with the
router choosing, and whether its expert loads differ from the single run's (not ruled). fp32 (no TF32), router
choosing: the NCCL layout, off and on, equals the fp32 single-process run within 1e-4. The report gives each
layout's gradients on against off. A graphed step with the switch on queues without one host sync
(``torch.cuda.set_sync_debug_mode("error")`` around ``launch_step``). Top-4 of 8 experts.

The per-rank work is `gpu_case`, launched once under torchrun; under MOE_GPU_TEST_DRYRUN=1 (tests/gpu_launch.py) it
runs on CPU gloo ranks, skipping what only CUDA runs (symmetric memory, graphs, the sync check).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.gpu_launch import (bf16_rule, cpu_skip_reason, dry_run, launch_ranks, ranks_for_every_gpu,
                              step_queued_without_host_sync, worker_device_type, write_report)

STEPS = 3
ONCE = "overlap.moe_dispatch_once_per_rank"
DEVICE = {"overlap.moe_pipeline": "true", "overlap.moe_planning": "device", "overlap.moe_transport": "sm_push"}
CHUNKS2 = {"overlap.moe_pipeline_chunks": 2}
LAYOUTS = {
    "sm_push_graphed": {**DEVICE, "train.moe_cuda_graph": "true", "overlap.delay_wgrad_compute": "false"},
    # one chunk: the backward's transfer back on the side stream beside the delayed weight gradients (auto's choice)
    "sm_push_graphed_delay_wgrad": {**DEVICE, "train.moe_cuda_graph": "true", "overlap.delay_wgrad_compute": "true"},
    "sm_push_chunks2_delay_wgrad": {**DEVICE, **CHUNKS2, "overlap.delay_wgrad_compute": "true"},
    "copy_engine_chunks2": {"overlap.moe_pipeline": "true", "overlap.moe_transport": "copy_engine", **CHUNKS2},
    # device-planned copy engines: each token's wire rows in slots (layers/device_plan.py), replayed from graphs
    "copy_engine_slots_graphed": {**DEVICE, "overlap.moe_transport": "copy_engine", "train.moe_cuda_graph": "true",
                                  "overlap.delay_wgrad_compute": "false"},
    "nccl_chunks2": {"overlap.moe_pipeline": "true", "overlap.moe_transport": "nccl", **CHUNKS2},
    "nccl_paired": {"overlap.moe_pipeline": "true", "overlap.moe_transport": "nccl",
                    "overlap.overlap_moe_expert_parallel_comm": "true"},
}


def switches(layout: str) -> tuple[str, ...]:
    """The copy engines with device planning need each token once per rank: that layout runs with the switch on."""
    return ("on",) if LAYOUTS[layout].get("overlap.moe_transport") == "copy_engine" and "overlap.moe_planning" in \
        LAYOUTS[layout] else ("off", "on")


def gpu_case(output_dir: str) -> dict:
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.run_setup import init_distributed
    from moe_overlap.training.trainer import Trainer
    from tests.test_master import rel_err, small_config
    from tests.test_pipeline import LAYERS

    torch.backends.cuda.matmul.allow_tf32 = False
    routed = {"train.device": worker_device_type(), **LAYERS, "model.moe_router_topk": 4}
    forced = {**routed, "model.moe_router_force_load_balancing": "true"}
    world = int(os.environ.get("WORLD_SIZE", 1))
    global_batch = 8 * world  # 4 micro-batches of 2 per rank

    def config(ranks: int, base: dict, precision: str, extra: dict):
        if dry_run():  # gloo on the CPU: the host-planned collective, or the device-planned twin of the push
            extra = {key: value for key, value in extra.items() if key != "overlap.moe_transport"}
        return small_config(output_dir, ranks, global_batch, **{**base, "train.precision": precision, **extra})

    # bf16: routing forced (token t's copies to experts 4t..4t+3 mod 8: all on one rank at EP=2, pairs at EP=4),
    # so that a rounding difference cannot flip a near-tied top-4 choice and move a token between experts
    layouts = {f"{name}_{switch}": {**extra, ONCE: str(switch == "on").lower()}
               for name, extra in LAYOUTS.items() for switch in switches(name)}
    mesh, device = init_distributed(config(world, forced, "bf16", {}))
    runs, skipped = {}, {}
    for name, extra in layouts.items():
        cfg = config(world, forced, "bf16", extra)
        skipped[name] = cpu_skip_reason(cfg, world)
        if not skipped[name]:
            runs[name] = Trainer(cfg, mesh, device)
    layouts = [name for name in layouts if not skipped[name]]
    runs["single_bf16"] = Trainer(config(1, forced, "bf16", {}), Mesh.single(), device)
    runs["single_fp32"] = Trainer(config(1, forced, "fp32", {}), Mesh.single(), device)
    # fp32 with the router choosing: same math, within the summation order
    for switch in ("off", "on"):
        runs[f"nccl_chunks2_{switch}_fp32"] = Trainer(config(world, routed, "fp32", {
            **LAYOUTS["nccl_chunks2"], ONCE: str(switch == "on").lower()}), mesh, device)
    runs["single_fp32_routed"] = Trainer(config(1, routed, "fp32", {}), Mesh.single(), device)
    # bf16 with the router choosing (reported, not ruled): does a layout route a token differently?
    runs["nccl_paired_on_routed"] = Trainer(config(world, routed, "bf16", {**LAYOUTS["nccl_paired"], ONCE: "true"}),
                                            mesh, device)
    runs["single_bf16_routed"] = Trainer(config(1, routed, "bf16", {}), Mesh.single(), device)
    losses, grads, loads = {name: [] for name in runs}, {}, {}
    for step in range(STEPS):
        for name, trainer in runs.items():
            captured = {}
            metrics = trainer.train_step(lambda opt, captured=captured: captured.update(opt.logical_grads()))
            losses[name].append(metrics["loss"])
            if step == 0:
                grads[name], loads[name] = captured, metrics.get("tokens_per_expert")
    tensors, violations = bf16_rule(layouts, grads, losses)
    on_vs_off = {name: max(rel_err(grads[f"{name}_on"][k], grads[f"{name}_off"][k]) for k in grads[f"{name}_off"])
                 for name in LAYOUTS if f"{name}_on" in grads and f"{name}_off" in grads}
    fp32_worst = {name: max((rel_err(grads[name][k], grads["single_fp32_routed"][k]), k) for k in grads[name])
                  for name in grads if name.endswith("_fp32") and not name.startswith("single")}
    routed_bf16 = {"loads_differ_from_single": loads["nccl_paired_on_routed"] != loads["single_bf16_routed"],
                   "worst_grad": max((rel_err(grads["nccl_paired_on_routed"][k], grads["single_fp32_routed"][k]),
                                      rel_err(grads["single_bf16_routed"][k], grads["single_fp32_routed"][k]), k)
                                     for k in grads["nccl_paired_on_routed"])}  # (its error, the single run's, which)
    report = {"rank": mesh.rank, "world": world, "violations": violations, "tensors": tensors,
              "fp32_worst_grad": fp32_worst, "routed_bf16": routed_bf16,
              "on_vs_off_worst_grad": on_vs_off, "skipped": {name: why for name, why in skipped.items() if why},
              "syncs_checked": False}
    if not dry_run():  # the graphed layers with the switch on: no host sync in a step
        step_queued_without_host_sync(runs["sm_push_graphed_on"])
        step_queued_without_host_sync(runs["copy_engine_slots_graphed_on"])
        report["syncs_checked"] = True
    mesh.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


@pytest.mark.gpu
def test_once_per_rank_follows_the_bf16_rule_on_every_gpu(tmp_path):
    world = ranks_for_every_gpu(limit=4)  # 8 experts: 2 chunks of local experts need EP <= 4
    for report in launch_ranks(__file__, tmp_path, timeout_s=600, world=world):
        assert report["tensors"] > 0 and not report["violations"], report["violations"]
        assert not report["skipped"] and report["syncs_checked"], report
        check_fp32(report)


@pytest.mark.slow  # the dry-run, not in CI
def test_once_per_rank_dry_run_on_cpu_gloo(tmp_path):
    """Every layout but the graphed ones on 2 gloo ranks, each transport replaced by gloo (host-planned, or the
    device-planned twin of the push)."""
    graphed = {f"{name}_{switch}" for name, extra in LAYOUTS.items() if extra.get("train.moe_cuda_graph") == "true"
               for switch in switches(name)}
    for report in launch_ranks(__file__, tmp_path, timeout_s=900, world=2, dry_run=True):
        assert report["tensors"] > 0 and not report["violations"], report["violations"]
        assert set(report["skipped"]) == graphed, report["skipped"]
        check_fp32(report)


def check_fp32(report: dict) -> None:
    assert len(report["fp32_worst_grad"]) == 2, report["fp32_worst_grad"]
    for name, (err, key) in report["fp32_worst_grad"].items():  # fp32, no TF32: the summation order only
        assert err < 1e-4, (name, key, err)


if __name__ == "__main__":
    write_report(sys.argv[1], gpu_case(sys.argv[1]))
