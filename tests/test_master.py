"""The master test: every parallel layout reproduces the single-process losses and gradients (fp32, 1e-5).

Also resume (bit for bit on the same layout; within tolerance onto another EP/DP size) and recompute.
Cases run on the spawned gloo rank pool; each rank computes the single-process reference itself.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from moe_overlap.config import load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.training.run_setup import mesh_layout
from moe_overlap.training.trainer import Optimizer, Trainer

TOL = 1e-5
CPU = torch.device("cpu")


def small_config(output_dir: str, ep: int, global_batch_size: int, **extra: str):
    overrides = {
        "model.num_layers": 3, "model.hidden_size": 32, "model.ffn_hidden_size": 64, "model.num_attention_heads": 4,
        "model.num_query_groups": 2, "model.seq_length": 16, "model.num_moe_experts": 8,
        "model.moe_layer_freq": "[0,1,1]", "model.moe_ffn_hidden_size": 32, "model.moe_router_topk": 2,
        "model.moe_aux_loss_coeff": 0.01, "model.moe_z_loss_coeff": 0.001,
        "parallel.expert_model_parallel_size": ep,
        "train.micro_batch_size": 2, "train.global_batch_size": global_batch_size, "train.lr": 0.003,
        "train.lr_warmup_steps": 1, "train.lr_decay_steps": 8, "train.max_steps": 8, "train.eval_interval": 0,
        "train.output_dir": output_dir, "checkpoint.save_final": "false",
        # eager unless a test asks: on GPUs auto would replay device-planned layers from graphs, and the layouts
        # compare what they name (tests/test_gpu_exposed_comm.py's default case leaves it to auto)
        "train.moe_cuda_graph": "false",
    }
    overrides.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def logical_grads(optimizer: Optimizer) -> dict[str, torch.Tensor]:
    return optimizer.logical_grads()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def world_and_mesh(cfg) -> tuple[int, Mesh]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = Mesh.create(mesh_layout(cfg, world), timeout_s=60) if world > 1 else Mesh.single()
    return world, mesh


def equivalence_case(ep: int, steps: int, output_dir: str, recompute: str = "none",
                     router: dict | None = None, layout: dict | None = None) -> dict:
    """Layout run vs the single-process run of the same global batch, step by step; ``router``: overrides
    of the router variant both runs use; ``layout``: overrides only the layout run uses (TP, overlap)."""
    world = dist.get_world_size()
    layout = layout or {}
    dp = world // (int(layout.get("parallel.tensor_model_parallel_size", 1))
                   * int(layout.get("parallel.context_parallel_size", 1)))  # pp = 1
    global_batch = 2 * 2 * dp  # micro-batch 2, two micro-batches per data-parallel rank
    router = router or {}
    cfg = small_config(output_dir, ep, global_batch, **{"train.recompute_granularity": recompute}, **router,
                       **layout)
    _, mesh = world_and_mesh(cfg)
    try:
        layout_run = Trainer(cfg, mesh, CPU)
        reference = Trainer(small_config(output_dir, 1, global_batch, **router), Mesh.single(), CPU)
        worst = {"loss": 0.0, "grad": 0.0, "grad_norm": 0.0}
        for _ in range(steps):
            got, want = {}, {}
            m = layout_run.train_step(lambda opt: got.update(logical_grads(opt)))
            r = reference.train_step(lambda opt: want.update(logical_grads(opt)))
            worst["loss"] = max(worst["loss"], abs(m["loss"] - r["loss"]) / abs(r["loss"]),
                                abs(m["aux_loss"] - r["aux_loss"]) / max(abs(r["aux_loss"]), 1e-30))
            worst["grad_norm"] = max(worst["grad_norm"], abs(m["grad_norm"] - r["grad_norm"]) / r["grad_norm"])
            for key, grad in got.items():
                err = rel_err(grad, want[key])
                assert err < TOL, f"step {m['step']} {key}: {err:.2e}"
                worst["grad"] = max(worst["grad"], err)
            assert m["tokens_per_expert"] == r["tokens_per_expert"]
            want_buffers = reference.model_buffers()
            for key, buffer in layout_run.model_buffers().items():  # expert bias, previous step's load
                assert torch.equal(buffer, want_buffers[key]), f"step {m['step']} {key}"
        assert max(worst.values()) < TOL, worst
        assert r["aux_loss"] > 0  # the auxiliary losses were on, so they were compared
        return worst
    finally:
        mesh.destroy()


@pytest.mark.parametrize("world,ep", [(2, 2), (2, 1), (4, 2), (4, 4)], ids=["ep2", "dp2", "ep2xdp2", "ep4"])
def test_layouts_match_single_process(rank_pool, tmp_path, world, ep):
    worst = rank_pool(world).run(equivalence_case, ep, 3, str(tmp_path))
    assert all(max(w.values()) < TOL for w in worst)


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_expert_wgrad_groups_match_single_process(rank_pool, tmp_path, micro_batches):
    """EP=2 x the distributed optimizer with its overlaps, the experts' weight gradients summed two or three
    micro-batches at a time: the bucket's reduce-scatter must still see the whole gradient on the last micro-batch
    (three: a group the step's last micro-batch cuts short)."""
    layout = {"train.expert_wgrad_micro_batches": micro_batches, "train.use_distributed_optimizer": "true",
              "overlap.overlap_grad_sync": "true", "overlap.overlap_param_sync": "true"}
    worst = rank_pool(2).run(equivalence_case, 2, 2, str(tmp_path), layout=layout)
    assert all(max(w.values()) < TOL for w in worst)


# Tensor parallelism, with sequence parallelism (MoE needs it) and expert-TP 1: experts fold over the TP ranks.
def tp_layout(tp: int, *overlaps: str, **extra) -> dict:
    layout = {"parallel.tensor_model_parallel_size": tp, "parallel.sequence_parallel": "true",
              "parallel.expert_tensor_parallel_size": 1, **extra}
    if overlaps:
        layout.update({"overlap.tp_comm_overlap": "true", **{f"overlap.{name}": "true" for name in overlaps}})
    return layout


ALL_TP_OVERLAPS = ("tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_bulk_dgrad", "tp_comm_bulk_wgrad")


@pytest.mark.parametrize("world,ep,layout", [
    (2, 1, tp_layout(2)),
    (2, 2, tp_layout(2)),  # TP=2 with EP=2 on the same 2 ranks
    (4, 2, tp_layout(2, *ALL_TP_OVERLAPS, **{"overlap.tp_comm_num_splits": 2})),  # x DP=2, every overlap on
    (4, 2, tp_layout(4, "tp_comm_overlap_rs_dgrad", "tp_comm_bulk_dgrad")),
], ids=["tp2", "tp2_ep2_folded", "tp2xep2xdp2_overlap", "tp4_ep2"])
def test_tensor_parallel_layouts_match_single_process(rank_pool, tmp_path, world, ep, layout):
    # Both runs: 4 query groups (TP=4 needs them), and an Adam eps above round-off. TP sums GEMM partials in
    # another order (~3e-7 here); Adam's early steps scale each element by its own magnitude, so the elements
    # whose gradient is round-off sized move by O(lr) either way, and step 2 would compare that noise (1e-5).
    both = {"model.num_query_groups": 4, "train.adam_eps": 1e-4}
    worst = rank_pool(world).run(equivalence_case, ep, 2, str(tmp_path), router=both, layout=layout)
    assert all(max(w.values()) < TOL for w in worst)


# Router variants (tests/test_router.py checks each against a reference); the bias and the previous step's load
# move after every step, so three steps also check that every layout updates them alike.
ROUTER_VARIANTS = {
    "sigmoid_groups_bias": {"model.moe_router_score_function": "sigmoid", "model.moe_router_num_groups": 4,
                            "model.moe_router_group_topk": 2, "model.moe_router_enable_expert_bias": "true",
                            "model.moe_router_bias_update_rate": 0.01},
    "seq_aux_loss": {"model.moe_router_load_balancing_type": "seq_aux_loss"},
    "global_aux_loss": {"model.moe_router_load_balancing_type": "global_aux_loss"},
    "pre_softmax": {"model.moe_router_pre_softmax": "true"},
    "capacity": {"model.moe_expert_capacity_factor": 1.0},  # per micro-batch: the same drops on every layout
    # the losses' logits of detached tokens (a strong aux loss, so that what its gradient reaches matters)
    "loss_detach_input": {"model.moe_router_loss_detach_input": "true", "model.moe_aux_loss_coeff": 0.1},
}


@pytest.mark.parametrize("variant", sorted(ROUTER_VARIANTS))
def test_router_variants_match_single_process(rank_pool, tmp_path, variant):
    worst = rank_pool(2).run(equivalence_case, 2, 3, str(tmp_path), router=ROUTER_VARIANTS[variant])
    assert all(max(w.values()) < TOL for w in worst)


def test_recompute_matches_single_process(rank_pool, tmp_path):
    worst = rank_pool(2).run(equivalence_case, 2, 2, str(tmp_path), "full")
    assert all(max(w.values()) < TOL for w in worst)


# ----------------------------------------------------------------------------------------- resume


def run_and_save(output_dir: str, ep: int, steps: int, save_at: int | None, global_batch: int = 8,
                 **overrides) -> list[float]:
    """Train to step ``steps`` from the latest checkpoint (or from scratch), saving after step ``save_at``;
    the losses of the steps run. Shared by every resume and reshard test."""
    cfg = small_config(output_dir, ep, global_batch, **{"train.resume": "true"}, **overrides)
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        trainer.resume()
        losses = []
        while trainer.step < steps:
            losses.append(trainer.train_step()["loss"])
            if trainer.step == save_at:
                trainer.save()
        return losses
    finally:
        mesh.destroy()


def test_resume_is_bit_for_bit_and_reshards_onto_more_experts_ranks(rank_pool, tmp_path):
    straight = rank_pool(2).run(run_and_save, str(tmp_path / "straight"), 2, 8, None)[0]
    first_half = rank_pool(2).run(run_and_save, str(tmp_path / "resumed"), 2, 4, 4)[0]
    second_half = rank_pool(2).run(run_and_save, str(tmp_path / "resumed"), 2, 8, None)[0]
    assert first_half + second_half == straight  # bit for bit
    # The same step-4 checkpoint, resumed on 4 ranks with EP=4 (and DP=4): same loss at step 5.
    resharded = rank_pool(4).run(run_and_save, str(tmp_path / "resumed"), 4, 5, None)[0]
    assert len(resharded) == 1 and abs(resharded[0] - straight[4]) / straight[4] < TOL


def test_crash_mid_save_leaves_previous_checkpoint_loadable(rank_pool, tmp_path):
    rank_pool(2).run(run_and_save, str(tmp_path), 2, 2, 2)
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step_00000003.tmp").mkdir()  # what a crash during the next save leaves behind
    (ckpt / "step_00000003.tmp" / "__0_0.distcp").write_bytes(b"partial")
    losses = rank_pool(2).run(run_and_save, str(tmp_path), 2, 3, None)[0]
    assert len(losses) == 1  # resumed from step 2, ran step 3


def test_metrics_and_checkpoint_of_a_short_fit(tmp_path):
    cfg = small_config(str(tmp_path), 1, 4, **{"train.max_steps": 3, "train.eval_interval": 3,
                                               "checkpoint.save_final": "true"})
    history = Trainer(cfg, Mesh.single(), CPU).fit()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and len(history) == 3
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_expert"} <= set(history[0])
    assert "val_loss" in history[-1] and history[-1]["val_loss"] > 0
    assert (tmp_path / "checkpoints" / "step_00000003").is_dir()
    assert dataclasses.asdict(cfg)["train"]["max_steps"] == 3


# The EP pipeline inside the full model (forward and backward, every micro-batch) against the
# serial single-process run: chunks, deferred wgrad, the shared expert beside the combine, the full router,
# padded capacity (static exchange sizes), and the device-planned pipeline (sizes on the device), with drops too.
OVERLAP = {"overlap.moe_pipeline": "true", "overlap.moe_planning": "host", "overlap.moe_pipeline_chunks": 2,
           "overlap.delay_wgrad_compute": "true"}
DEVICE_PLANNED = {**OVERLAP, "overlap.moe_planning": "device"}


@pytest.mark.parametrize("world,ep,both,layout", [
    (2, 2, {"model.moe_shared_expert_intermediate_size": 16, **ROUTER_VARIANTS["sigmoid_groups_bias"]},
     {**OVERLAP, "model.moe_shared_expert_overlap": "true"}),
    (4, 4, {"model.moe_expert_capacity_factor": 1.0, "model.moe_pad_expert_input_to_capacity": "true"}, OVERLAP),
    (4, 2, {"model.moe_expert_capacity_factor": 1.5, "model.moe_token_drop_policy": "position"}, OVERLAP),
    (4, 4, {"model.moe_shared_expert_intermediate_size": 16}, DEVICE_PLANNED),
    (4, 2, {"model.moe_expert_capacity_factor": 1.5}, DEVICE_PLANNED),
], ids=["ep2_shared_sigmoid", "ep4_padded_capacity", "ep2xdp2_capacity_position", "ep4_device_planned",
        "ep2xdp2_device_planned_capacity"])
def test_moe_pipeline_matches_single_process(rank_pool, tmp_path, world, ep, both, layout):
    worst = rank_pool(world).run(equivalence_case, ep, 3, str(tmp_path), router=both, layout=layout)
    assert all(max(w.values()) < TOL for w in worst)


# Expert tensor parallelism (serial dispatch): each expert's FFN split over expert-TP ranks, alone, with EP,
# and folded over TP (expert-TP defaults to TP).
@pytest.mark.parametrize("world,ep,layout", [
    (2, 1, {"parallel.expert_tensor_parallel_size": 2}),
    (4, 2, {"parallel.expert_tensor_parallel_size": 2}),
    (2, 1, tp_layout(2, **{"parallel.expert_tensor_parallel_size": 2})),
    (4, 2, tp_layout(2, "tp_comm_overlap_ag", "tp_comm_overlap_rs", **{"parallel.expert_tensor_parallel_size": 2})),
    (4, 2, {"parallel.expert_tensor_parallel_size": 2, **OVERLAP}),
], ids=["etp2", "etp2xep2", "tp2_etp2", "tp2_etp2_ep2_overlap", "etp2xep2_overlapped_dispatch"])
def test_expert_tensor_parallel_layouts_match_single_process(rank_pool, tmp_path, world, ep, layout):
    both = {"model.num_query_groups": 4, "train.adam_eps": 1e-4}  # as the TP cases, for the same reasons
    worst = rank_pool(world).run(equivalence_case, ep, 2, str(tmp_path), router=both, layout=layout)
    assert all(max(w.values()) < TOL for w in worst)


def test_checkpoint_moves_between_expert_tp_sizes(rank_pool, tmp_path):
    """Saved at EP=2 x expert-TP=2 on 4 ranks, resumed at EP=2 (expert-TP 1) on 2: the same next loss."""
    etp2 = {"parallel.expert_tensor_parallel_size": 2}
    straight = rank_pool(4).run(run_and_save, str(tmp_path / "straight"), 2, 3, None, **etp2)[0]
    rank_pool(4).run(run_and_save, str(tmp_path / "moved"), 2, 2, 2, **etp2)
    moved = rank_pool(2).run(run_and_save, str(tmp_path / "moved"), 2, 3, None)[0]
    assert len(moved) == 1 and abs(moved[0] - straight[2]) / straight[2] < TOL


# Every overlap switch at once, in the largest layout the 2-core budget runs: TP=2 (sequence parallel, every
# tp_comm overlap) x DP=2, EP=2 folded over TP (the chunked dispatch pipeline with deferred weight gradients and
# the shared expert in its gap), and the distributed optimizer overlapping both its syncs over small buckets.
EVERY_SWITCH = dict(tp_layout(2, *ALL_TP_OVERLAPS, **{"overlap.tp_comm_num_splits": 2}), **{
    "overlap.moe_pipeline": "true", "overlap.moe_pipeline_chunks": 2, "overlap.delay_wgrad_compute": "true",
    "model.moe_shared_expert_overlap": "true", "train.use_distributed_optimizer": "true",
    "overlap.overlap_grad_sync": "true", "overlap.overlap_param_sync": "true", "overlap.bucket_size_mb": 0.01})
EVERY_SWITCH_OFF = tp_layout(2)


@pytest.mark.parametrize("layout", [EVERY_SWITCH, EVERY_SWITCH_OFF], ids=["every_switch_on", "every_switch_off"])
def test_every_switch_composed_matches_single_process(rank_pool, tmp_path, layout):
    both = {"model.num_query_groups": 4, "train.adam_eps": 1e-4, "model.moe_shared_expert_intermediate_size": 16}
    worst = rank_pool(4).run(equivalence_case, 2, 2, str(tmp_path), router=both, layout=layout)
    assert all(max(w.values()) < TOL for w in worst)
