"""The master test over NCCL in bf16 on 2 GPUs (`pytest -m gpu`): DESIGN.md's bf16 tolerance rule.

The bf16 runs' error against an fp32 single-process run must be at most 2x the single-process bf16 run's own
error against it, per tensor (normwise), for every gradient of the first step and the loss curve of the steps. Layouts: EP=2
(plain all-reduce optimizer; distributed optimizer with both overlaps; the host-planned MoE pipeline over the
auto-chosen transport), TP=2 with SP and expert-TP=2: serial, every TP overlap over the copy-engine ring
(symm), the pipelined ones over NCCL p2p; EP=2 with the device-planned MoE pipeline (SM pushes) and its MoE
layers replayed from CUDA graphs (train.moe_cuda_graph); the distributed optimizer with both overlaps and those
graphed layers, its communicators at 2 CTAs (and the EP one at 4) and the GEMMs beside its syncs 8 SMs short
(overlap.dp_comm_ctas, overlap.ep_comm_ctas, overlap.gemm_sm_carveout).
PP=2 (one layer, then two): 1F1B with batched P2P, ZB-H1 with overlapped P2P over the per-direction groups.
Launched once under torchrun; the per-rank work is `gpu_equivalence` below.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.gpu_launch import REPO, bf16_rule, launch_two_ranks, write_report


def gpu_equivalence(output_dir: str, steps: int = 3) -> dict:
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.trainer import Trainer, init_distributed, mesh_group_options, mesh_layout
    from tests.test_master import ALL_TP_OVERLAPS, logical_grads, small_config, tp_layout

    torch.backends.cuda.matmul.allow_tf32 = False
    global_batch = 8
    layout_cfg = small_config(output_dir, 2, global_batch, **{"train.precision": "bf16", "train.device": "cuda"})
    mesh, device = init_distributed(layout_cfg)
    dist_cfg = small_config(output_dir, 2, global_batch, **{
        "train.precision": "bf16", "train.device": "cuda", "train.use_distributed_optimizer": "true",
        "overlap.overlap_grad_sync": "true", "overlap.overlap_param_sync": "true"})
    # The same with graphed sync-free MoE layers, the data-parallel communicators at 2 CTAs (its own mesh) and
    # the GEMMs 8 SMs short (captured so too).
    dp_resources_cfg = small_config(output_dir, 2, global_batch, **{
        "train.precision": "bf16", "train.device": "cuda", "train.use_distributed_optimizer": "true",
        "overlap.overlap_grad_sync": "true", "overlap.overlap_param_sync": "true", "overlap.dp_comm_ctas": 2,
        "overlap.ep_comm_ctas": 4, "overlap.gemm_sm_carveout": 8, "overlap.moe_pipeline": "true", "overlap.moe_planning": "device",
        "train.moe_cuda_graph": "true"})
    dp_resources_mesh = Mesh.create(mesh_layout(dp_resources_cfg, 2), timeout_s=120,
                                    pg_options=mesh_group_options(dp_resources_cfg))
    overlap_cfg = small_config(output_dir, 2, global_batch, **{
        "train.precision": "bf16", "train.device": "cuda", "overlap.moe_pipeline": "true",
        "overlap.moe_planning": "host", "overlap.moe_pipeline_chunks": 2, "overlap.delay_wgrad_compute": "true"})

    graph_cfg = small_config(output_dir, 2, global_batch, **{
        "train.precision": "bf16", "train.device": "cuda", "overlap.moe_pipeline": "true",
        "overlap.moe_planning": "device", "overlap.moe_pipeline_chunks": 2, "train.moe_cuda_graph": "true"})

    def tp_cfg(*overlaps: str, **extra):
        return small_config(output_dir, 1, global_batch, **{"train.precision": "bf16", "train.device": "cuda"},
                            **tp_layout(2, *overlaps, **{"parallel.expert_tensor_parallel_size": 2, **extra}))

    tp_mesh = Mesh.create(mesh_layout(tp_cfg(), 2), timeout_s=120)

    def pp_cfg(**extra):
        return small_config(output_dir, 1, global_batch, **{
            "train.precision": "bf16", "train.device": "cuda", "parallel.pipeline_model_parallel_size": 2,
            "parallel.num_layers_in_first_pipeline_stage": 1, **extra})

    pp_mesh = Mesh.create(mesh_layout(pp_cfg(), 2), timeout_s=120)
    layouts = LAYOUTS
    runs = {
        layouts[0]: Trainer(layout_cfg, mesh, device),
        layouts[1]: Trainer(dist_cfg, mesh, device),
        layouts[2]: Trainer(overlap_cfg, mesh, device),
        layouts[3]: Trainer(tp_cfg(), tp_mesh, device),
        layouts[4]: Trainer(tp_cfg(*ALL_TP_OVERLAPS, **{"overlap.tp_comm_backend": "symm",
                                                        "overlap.tp_comm_num_splits": 2}), tp_mesh, device),
        layouts[5]: Trainer(tp_cfg("tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad",
                                   "tp_comm_bulk_dgrad", **{"overlap.tp_comm_backend": "p2p"}), tp_mesh, device),
        layouts[6]: Trainer(graph_cfg, mesh, device),
        layouts[7]: Trainer(dp_resources_cfg, dp_resources_mesh, device),
        layouts[8]: Trainer(pp_cfg(**{"overlap.batch_p2p_comm": "true"}), pp_mesh, device),
        layouts[9]: Trainer(pp_cfg(**{"train.pipeline_schedule": "zb_h1", "overlap.overlap_p2p_comm": "true"}),
                            pp_mesh, device),
        "single_bf16": Trainer(small_config(output_dir, 1, global_batch, **{"train.precision": "bf16"}),
                               Mesh.single(), device),
        "single_fp32": Trainer(small_config(output_dir, 1, global_batch), Mesh.single(), device),
    }
    losses = {name: [] for name in runs}
    grads = {}
    carveouts = {name: [] for name in runs}  # the GEMM SM carve-out each run's forwards held, in order
    for name, trainer in runs.items():
        trainer.model.embedding.register_forward_hook(
            lambda *_, name=name: carveouts[name].append(torch._C._get_sm_carveout_experimental()))

    def inspect(name, captured):
        def hook(optimizer):
            captured.update(logical_grads(optimizer))
        return hook

    for step in range(steps):
        for name, trainer in runs.items():
            captured = {}
            losses[name].append(trainer.train_step(inspect(name, captured))["loss"])
            if step == 0:
                grads[name] = captured
    dp_backend = dp_resources_mesh.dp_cp.group._get_backend(torch.device("cuda"))
    ep_backend = dp_resources_mesh.ep.group._get_backend(torch.device("cuda"))
    tensors, violations = bf16_rule(layouts, grads, losses)
    report = {"rank": dist.get_rank(), "losses": losses, "violations": violations, "tensors": tensors,
              "carveouts": carveouts, "carveout_after_steps": torch._C._get_sm_carveout_experimental(),
              "dp_comm_ctas": [dp_backend.options.config.min_ctas, dp_backend.options.config.max_ctas],
              "ep_comm_ctas": [ep_backend.options.config.min_ctas, ep_backend.options.config.max_ctas]}
    tp_mesh.destroy()
    pp_mesh.destroy()
    dp_resources_mesh.destroy()
    mesh.destroy()
    dist.destroy_process_group()
    return report


LAYOUTS = ("layout_bf16", "layout_bf16_distributed_optimizer_overlap", "layout_bf16_overlapped_dispatch",
           "layout_bf16_tp2_sp_etp2", "layout_bf16_tp2_sp_etp2_all_overlaps_symm",
           "layout_bf16_tp2_sp_etp2_pipelined_overlaps_p2p", "layout_bf16_device_planned_pipeline_cuda_graph",
           "layout_bf16_distributed_optimizer_overlap_cuda_graph_dp_2_ctas_gemm_carveout_8",
           "layout_bf16_pp2_1f1b_batched_p2p", "layout_bf16_pp2_zb_h1_overlapped_p2p")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """One torchrun launch runs every layout; each test below checks one layout's part of the reports."""
    return launch_two_ranks(__file__, tmp_path_factory.mktemp("gpu_master"), timeout_s=300)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_master_over_nccl_bf16(reports, layout):
    for report in reports:
        assert report["tensors"] > 0
        violations = [v for v in report["violations"] if v[0] == layout]
        assert not violations, violations


@pytest.mark.gpu
def test_comm_ctas_and_gemm_carveout_reach_nccl_and_the_step(reports):
    for report in reports:
        assert report["dp_comm_ctas"] == [2, 2] and report["ep_comm_ctas"] == [4, 4]
        carve = report["carveouts"]  # per forward: 2 micro-batches a step, the first beside the all-gathers
        assert carve[LAYOUTS[7]][:2] == [8, None] and set(carve[LAYOUTS[1]]) <= {None, 0}
        assert report["carveout_after_steps"] in (None, 0)


if __name__ == "__main__":  # one rank under torchrun
    sys.path.insert(0, str(REPO))
    write_report(sys.argv[1], gpu_equivalence(sys.argv[1]))
