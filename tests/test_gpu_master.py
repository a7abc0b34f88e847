"""The master test over NCCL in bf16 (`pytest -m gpu`), layout by layout on 2 and 4 GPUs.

The bf16 rule: each layout's error against an fp32 single-process run is at most 2x the single-process bf16 run's
own error against it, per gradient of the first step (normwise) and for the loss curve of the steps.

Each layout runs on a fixed number of ranks, which is part of what it means (EP=2 is two ranks): the 2-rank
layouts run on 2 GPUs at any GPU count >= 2 (on a 4-GPU machine too, on its first two), the 4-rank ones on 4, and
a layout with fewer GPUs than it needs is skipped. One torchrun launch per rank count runs its layouts one after
another, each built and run inside its own guard: a layout that fails on any rank fails only its own case, and
every rank's report says which rank failed it and why (see ``run_layout``).

2 ranks: EP=2 (plain all-reduce optimizer; distributed optimizer with both overlaps; the host-planned MoE
pipeline over the auto-chosen transport), TP=2 with SP and expert-TP=2: serial, every TP overlap over the
copy-engine ring (symm), the pipelined ones over NCCL p2p; EP=2 with the device-planned MoE pipeline (SM pushes)
and its MoE layers replayed from CUDA graphs (train.moe_cuda_graph); the distributed optimizer with both overlaps
and those graphed layers, its communicators at 2 CTAs (and the EP one at 4) and the GEMMs beside its syncs 8 SMs
short (overlap.dp_comm_ctas, overlap.ep_comm_ctas, overlap.gemm_sm_carveout); PP=2 (one layer, then two): 1F1B
with batched P2P, ZB-H1 with overlapped P2P over the per-direction groups.
4 ranks: EP=4 (serial; the graphed device-planned pipeline), TP=2 x EP=2 (x DP=2, every TP overlap), PP=2 x
EP=2 (ZB-H1, the host-planned MoE pipeline; 1F1B with the MoE layers replayed from graphs, a copy per
micro-batch in flight), CP=2 x EP=2 (x DP=2, the overlapped ring, the distributed
optimizer), EP=2 x expert-DP=2 (DP=4) with the distributed optimizer and both its overlaps.

The per-rank work is ``gpu_equivalence``; under MOE_GPU_TEST_DRYRUN=1 (tests/gpu_launch.py) it runs on CPU gloo
ranks, skipping the layouts only CUDA runs: ``test_every_layout_builds_and_steps_on_cpu_gloo`` below (-m slow), or
by hand: ``MOE_GPU_TEST_DRYRUN=1 PYTHONPATH=. torchrun --nproc-per-node 4 tests/test_gpu_master.py OUTDIR``.
"""

from __future__ import annotations

import gc
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch

from tests.gpu_launch import (bf16_rule, cpu_skip_reason, init_worker, launch_ranks, require_gpus,
                              worker_device_type, write_report)
from tests.test_master import ALL_TP_OVERLAPS, tp_layout

STEPS = 3
MESH_TIMEOUT_S = 60  # every collective's; a layout's steps take seconds
AGREEMENT_TIMEOUT_S = 300  # the status group's: longer than any one layout's build or steps


@dataclass(frozen=True)
class Layout:
    world: int  # the ranks it runs on
    ep: int
    overrides: dict


DIST_OPT = {"train.use_distributed_optimizer": "true", "overlap.overlap_grad_sync": "true",
            "overlap.overlap_param_sync": "true"}
HOST_PIPELINE = {"overlap.moe_pipeline": "true", "overlap.moe_planning": "host", "overlap.moe_pipeline_chunks": 2,
                 "overlap.delay_wgrad_compute": "true"}
GRAPHED_DEVICE_PIPELINE = {"overlap.moe_pipeline": "true", "overlap.moe_planning": "device",
                           "overlap.moe_pipeline_chunks": 2, "train.moe_cuda_graph": "true"}


def pp2(first_stage_layers: int) -> dict:
    """PP=2 over small_config's 3 layers (dense, MoE, MoE)."""
    return {"parallel.pipeline_model_parallel_size": 2,
            "parallel.num_layers_in_first_pipeline_stage": first_stage_layers}


def tp2_etp2(*overlaps: str, **extra) -> dict:
    return tp_layout(2, *overlaps, **{"parallel.expert_tensor_parallel_size": 2, **extra})


LAYOUTS = {
    "layout_bf16": Layout(2, 2, {}),
    "layout_bf16_distributed_optimizer_overlap": Layout(2, 2, DIST_OPT),
    "layout_bf16_overlapped_dispatch": Layout(2, 2, HOST_PIPELINE),
    "layout_bf16_tp2_sp_etp2": Layout(2, 1, tp2_etp2()),
    "layout_bf16_tp2_sp_etp2_all_overlaps_symm": Layout(2, 1, tp2_etp2(*ALL_TP_OVERLAPS, **{
        "overlap.tp_comm_backend": "symm", "overlap.tp_comm_num_splits": 2})),
    "layout_bf16_tp2_sp_etp2_pipelined_overlaps_p2p": Layout(2, 1, tp2_etp2(
        "tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_bulk_dgrad",
        **{"overlap.tp_comm_backend": "p2p"})),
    "layout_bf16_device_planned_pipeline_cuda_graph": Layout(2, 2, GRAPHED_DEVICE_PIPELINE),
    # graphed sync-free MoE layers beside the distributed optimizer, its communicators at 2 CTAs (the EP one at 4)
    # and the GEMMs 8 SMs short (captured so too); unpaired (auto would pair them on two streams at EP=2)
    "layout_bf16_distributed_optimizer_overlap_cuda_graph_dp_2_ctas_gemm_carveout_8": Layout(2, 2, {
        **DIST_OPT, "overlap.dp_comm_ctas": 2, "overlap.ep_comm_ctas": 4, "overlap.gemm_sm_carveout": 8,
        "overlap.moe_pipeline": "true", "overlap.moe_planning": "device", "train.moe_cuda_graph": "true",
        "overlap.overlap_moe_expert_parallel_comm": "false"}),
    "layout_bf16_pp2_1f1b_batched_p2p": Layout(2, 1, {**pp2(1), "overlap.batch_p2p_comm": "true"}),
    # paired micro-batches with graphed (one-rank) MoE layers under PP: each pair's halves on two streams, the
    # transfers between the stages on their micro-batches' streams
    "layout_bf16_pp2_1f1b_cuda_graph_paired_streams": Layout(2, 1, {
        **pp2(2), "train.moe_cuda_graph": "true", "overlap.overlap_moe_expert_parallel_comm": "true"}),
    "layout_bf16_pp2_zb_h1_overlapped_p2p": Layout(2, 1, {**pp2(1), "train.pipeline_schedule": "zb_h1",
                                                          "overlap.overlap_p2p_comm": "true"}),
    "layout_bf16_ep4": Layout(4, 4, {}),
    "layout_bf16_ep4_device_planned_pipeline_cuda_graph": Layout(4, 4, GRAPHED_DEVICE_PIPELINE),
    "layout_bf16_tp2_sp_ep2_dp2_all_overlaps": Layout(4, 2, tp_layout(2, *ALL_TP_OVERLAPS, **{
        "overlap.tp_comm_num_splits": 2})),
    # two layers, then one: a MoE layer on each stage, so both stages' EP groups exchange
    "layout_bf16_pp2_ep2_zb_h1_overlapped_dispatch": Layout(4, 2, {
        **pp2(2), "train.pipeline_schedule": "zb_h1", "overlap.overlap_p2p_comm": "true", **HOST_PIPELINE}),
    # graphed MoE layers under PP (1F1B): the first stage keeps two micro-batches in flight, each replaying its own
    # copy of the graphs
    "layout_bf16_pp2_ep2_1f1b_cuda_graph": Layout(4, 2, {**pp2(2), **GRAPHED_DEVICE_PIPELINE}),
    # (the same paired on two streams is refused: at PP=2 x EP=2 the stages' transfers hung, benchmarks/RESULTS.md)
    "layout_bf16_cp2_ep2_dp2_overlap_distributed_optimizer": Layout(4, 2, {
        "parallel.context_parallel_size": 2, "overlap.cp_comm_overlap": "true", **DIST_OPT}),
    "layout_bf16_ep2_edp2_dp4_distributed_optimizer_overlap": Layout(4, 2, DIST_OPT),
    # 8 ranks (issue 40's layouts; skipped with fewer GPUs)
    "layout_bf16_ep8": Layout(8, 8, {}),
    "layout_bf16_tp2_sp_ep4_all_overlaps": Layout(8, 4, tp_layout(2, *ALL_TP_OVERLAPS)),
    "layout_bf16_tp2_sp_ep2_pp2": Layout(8, 2, {**tp_layout(2), **pp2(2)}),
    "layout_bf16_pp2_ep2_edp2_dp4_distributed_optimizer_overlap": Layout(8, 2, {**pp2(2), **DIST_OPT}),
    "layout_bf16_cp2_ep4_overlap": Layout(8, 4, {"parallel.context_parallel_size": 2,
                                                 "overlap.cp_comm_overlap": "true"}),
}
CARVEOUT_LAYOUT = "layout_bf16_distributed_optimizer_overlap_cuda_graph_dp_2_ctas_gemm_carveout_8"
OUT_OF_STEP = "all ranks"  # the errors' key for what concerns every rank: their process groups out of step


def cuda_only(layout: Layout) -> bool:
    """What the dry-run skips (the library refuses it on CPU): CUDA graphs (and with them the NCCL CTA caps and the
    GEMM carve-out of the layout that sets them) and the copy-engine TP ring."""
    return (layout.overrides.get("train.moe_cuda_graph") == "true"
            or layout.overrides.get("overlap.tp_comm_backend") == "symm")


def layout_config(output_dir: str, world: int, ep: int, **overrides):
    """small_config in bf16 on the worker's device, 4 sequences per rank in every global batch (2 micro-batches of
    2 at DP = world), the same batch for the layouts of one world and their single-process references."""
    from tests.test_master import small_config

    return small_config(output_dir, ep, 4 * world, **{
        "train.precision": "bf16", "train.device": worker_device_type(),
        "train.distributed_timeout_s": MESH_TIMEOUT_S, **overrides})


# --------------------------------------------------------------------------------------------- per rank


def run_steps(trainer) -> dict:
    """STEPS optimizer steps: their losses, the first step's reduced gradients by logical name, and the GEMM SM
    carve-out each forward of the embedding held (the first pipeline stage's ranks: the others have none)."""
    carveouts, grads, losses = [], {}, []
    if trainer.model.embedding is not None:
        trainer.model.embedding.register_forward_hook(
            lambda *_: carveouts.append(torch._C._get_sm_carveout_experimental()))
    for step in range(STEPS):
        captured = {}
        losses.append(trainer.train_step(lambda opt: captured.update(opt.logical_grads()))["loss"])
        if step == 0:
            grads = captured
    return {"losses": losses, "grads": grads, "carveouts": carveouts}


def agree(status, error: str | None) -> dict[int, str]:
    """Every rank's error of one phase by rank (None: fine), over the gloo status group: all ranks go on, or
    stop the layout, together."""
    import torch.distributed as dist

    errors = [None] * dist.get_world_size(status)
    dist.all_gather_object(errors, error, group=status)
    return {rank: e for rank, e in enumerate(errors) if e is not None}


def groups_made(status) -> list[int]:
    """How many process groups each rank has made. torch names a group by its rank's count so far: once a layout
    failed part-way through making its groups on some ranks only, later groups would pair up wrongly."""
    import torch.distributed as dist

    counts = [None] * dist.get_world_size(status)
    dist.all_gather_object(counts, dist.distributed_c10d._world.group_count, group=status)
    return counts


def run_layout(name: str, output_dir: str, world: int, device, meshes: dict, references: dict, status,
               trainers: list) -> dict:
    """Build and run one layout, each phase guarded and agreed over ``status``. The result: ``errors`` (rank ->
    why, from every rank), or ``skipped`` (dry-run), or the rule's ``violations`` with the tensors compared. The
    trainer joins ``trainers``, alive to the end: its symmetric workspaces must not be freed under a later
    layout's graph capture, nor while a peer may still signal into them."""
    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.run_setup import mesh_group_options, mesh_layout
    from moe_overlap.training.trainer import Trainer

    layout = LAYOUTS[name]
    cfg = layout_config(output_dir, world, layout.ep, **layout.overrides)
    skip = cpu_skip_reason(cfg, world)
    if skip:  # the same on every rank
        return {"skipped": skip}
    error = trainer = mesh = key = None
    try:
        # layouts of one mesh (and CTA caps) share its groups; every rank makes them in LAYOUTS order
        key = (mesh_layout(cfg, world), cfg.overlap.dp_comm_ctas, cfg.overlap.ep_comm_ctas)
        if key not in meshes:
            meshes[key] = Mesh.create(key[0], timeout_s=MESH_TIMEOUT_S, pg_options=mesh_group_options(cfg))
        mesh = meshes[key]
        trainer = Trainer(cfg, mesh, device)
        trainers.append(trainer)
    except Exception:
        error = f"build: {traceback.format_exc()[-3000:]}"
    errors = agree(status, error)
    if not errors:
        try:
            run = run_steps(trainer)
        except Exception:
            error = f"steps: {traceback.format_exc()[-3000:]}"
        errors = agree(status, error)
    if errors:
        # Its communicators may hold a collective some ranks started and others never joined: a later layout of
        # the same mesh gets a new one (its destroy could wait on that collective: left alone).
        meshes.pop(key, None)
        gc.collect()  # what a failed build left (symmetric workspaces) freed now, not inside a later capture
        counts = groups_made(status)
        if len(set(counts)) > 1:
            errors[OUT_OF_STEP] = f"process groups out of step after this layout: made per rank {counts}"
        return {"errors": errors}
    tensors, violations = bf16_rule([name], {name: run["grads"], **references["grads"]},
                                    {name: run["losses"], **references["losses"]})
    result = {"tensors": tensors, "violations": violations, "losses": run["losses"], "keys": sorted(run["grads"]),
              "carveouts": run["carveouts"]}
    options = mesh_group_options(cfg)
    if options and device.type == "cuda":  # the CTA caps this rank's communicators were made with
        result["comm_ctas"] = {}
        for kind in options:
            group = getattr(mesh, kind).group
            if group is not None:
                config = group._get_backend(device).options.config
                result["comm_ctas"][kind] = [config.min_ctas, config.max_ctas]
    return result


def gpu_equivalence(output_dir: str) -> dict:
    """Every layout of this world size, in LAYOUTS order, after the two single-process references (each rank
    runs them itself). The report is rewritten after each layout."""
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.trainer import Trainer

    torch.backends.cuda.matmul.allow_tf32 = False
    device = init_worker(MESH_TIMEOUT_S)
    world, rank = dist.get_world_size(), dist.get_rank()
    status = dist.new_group(backend="gloo", timeout=timedelta(seconds=AGREEMENT_TIMEOUT_S))
    report = {"rank": rank, "world": world, "layouts": {}}
    write_report(output_dir, report)
    references = {"losses": {}, "grads": {}}
    for name, precision in (("single_bf16", "bf16"), ("single_fp32", "fp32")):
        run = run_steps(Trainer(layout_config(output_dir, world, 1, **{"train.precision": precision}),
                                Mesh.single(), device))
        references["losses"][name], references["grads"][name] = run["losses"], run["grads"]
    report.update(reference_losses=references["losses"], reference_keys=sorted(references["grads"]["single_fp32"]))
    meshes, trainers, out_of_step = {}, [], None
    for name in (name for name, layout in LAYOUTS.items() if layout.world == world):
        if out_of_step:  # any group made now would pair up wrongly
            report["layouts"][name] = {"errors": {OUT_OF_STEP: f"not run: process groups out of step since "
                                                               f"{out_of_step}"}}
            continue
        report["layouts"][name] = result = run_layout(name, output_dir, world, device, meshes, references, status,
                                                      trainers)
        out_of_step = name if OUT_OF_STEP in result.get("errors", {}) else None
        write_report(output_dir, report)
    report["carveout_after_steps"] = torch._C._get_sm_carveout_experimental()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for mesh in meshes.values():
        mesh.destroy()
    dist.destroy_process_group()
    write_report(output_dir, report)
    return report


# ------------------------------------------------------------------------------------------------ tests

_launches: dict[tuple[int, bool], list[dict]] = {}


def reports(world: int, tmp_path_factory, dry_run: bool = False) -> list[dict]:
    """The ranks' reports of the one launch (per world size and mode) that runs every layout of ``world``."""
    if (world, dry_run) not in _launches:
        out = tmp_path_factory.mktemp(f"gpu_master_{world}{'_dry' if dry_run else ''}")
        _launches[world, dry_run] = launch_ranks(__file__, out, timeout_s=600 if dry_run else 300, world=world,
                                                 dry_run=dry_run)
    return _launches[world, dry_run]


def layout_result(name: str, report: dict) -> dict:
    result = report["layouts"].get(name)
    assert result is not None, (f"{name} did not finish on rank {report['rank']}: "
                                f"{report.get('launch_tail', 'no output tail (the job ended cleanly)')}")
    assert not result.get("errors"), "\n".join(f"rank {rank}: {why}" for rank, why in result["errors"].items())
    return result


def check_layout(name: str, found: list[dict]) -> None:
    """No errors; the rule held on every rank; every parameter's gradient compared on some rank."""
    results = [layout_result(name, report) for report in found]
    for report, result in zip(found, results):
        assert result["tensors"] > 0 and not result["violations"], (report["rank"], result["violations"])
    compared = set().union(*(result["keys"] for result in results))
    assert compared == set(found[0]["reference_keys"]), compared ^ set(found[0]["reference_keys"])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_master_over_nccl_bf16(tmp_path_factory, layout):
    require_gpus(LAYOUTS[layout].world)
    check_layout(layout, reports(LAYOUTS[layout].world, tmp_path_factory))


@pytest.mark.gpu
def test_comm_ctas_and_gemm_carveout_reach_nccl_and_the_step(tmp_path_factory):
    require_gpus(LAYOUTS[CARVEOUT_LAYOUT].world)
    for report in reports(LAYOUTS[CARVEOUT_LAYOUT].world, tmp_path_factory):
        capped = layout_result(CARVEOUT_LAYOUT, report)
        ctas = capped["comm_ctas"]
        assert ctas.pop("ep") == [4, 4] and ctas.pop("dp_cp") == [2, 2] and all(
            v == [2, 2] for v in ctas.values()), capped["comm_ctas"]
        # per forward: 2 micro-batches a step, the first beside the all-gathers
        assert capped["carveouts"][:2] == [8, None], capped["carveouts"]
        uncapped = layout_result("layout_bf16_distributed_optimizer_overlap", report)
        assert set(uncapped["carveouts"]) <= {None, 0}, uncapped["carveouts"]
        assert report["carveout_after_steps"] in (None, 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_config_is_valid_for_its_gpus(layout):
    """On CPU, at once: each layout's config passes the checks a GPU run makes before it builds anything."""
    from moe_overlap.config import validate_for_world
    from moe_overlap.training.run_setup import mesh_layout

    world = LAYOUTS[layout].world
    cfg = layout_config("unused", world, LAYOUTS[layout].ep, **LAYOUTS[layout].overrides)
    validate_for_world(cfg, world, "cuda")
    assert mesh_layout(cfg, world).world_size == world


@pytest.mark.slow  # not in CI: 40-70 s at 2 ranks, 60-95 s at 4, ~2 min at 8 on 2 shared cores (`-m slow -k cpu_gloo`)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_builds_and_steps_on_cpu_gloo(tmp_path_factory, world):
    """The dry-run: every layout of ``world`` that can run on the CPU builds and runs its steps on gloo ranks in
    bf16 and meets the rule there too; those only CUDA runs are skipped (the library refuses them on CPU)."""
    found = reports(world, tmp_path_factory, dry_run=True)
    names = [name for name, layout in LAYOUTS.items() if layout.world == world]
    ran = [name for name in names if "skipped" not in layout_result(name, found[0])]
    for name in ran:
        check_layout(name, found)
    skipped = {name: layout_result(name, found[0])["skipped"] for name in names if name not in ran}
    assert set(skipped) == {name for name in names if cuda_only(LAYOUTS[name])}, skipped


if __name__ == "__main__":  # one rank under torchrun (PYTHONPATH = the repository)
    gpu_equivalence(sys.argv[1])
