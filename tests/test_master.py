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
from moe_overlap.training.optimizer import MixedPrecisionAdamW
from moe_overlap.training.trainer import Trainer, mesh_layout

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
    }
    overrides.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def logical_grads(optimizer: MixedPrecisionAdamW) -> dict[str, torch.Tensor]:
    return {key: view.clone() for e in optimizer.entries for key, view in e.logical_slices(e.main_grad).items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def world_and_mesh(cfg) -> tuple[int, Mesh]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = Mesh.create(mesh_layout(cfg, world), timeout_s=60) if world > 1 else Mesh.single()
    return world, mesh


def equivalence_case(ep: int, steps: int, output_dir: str, recompute: str = "none") -> dict:
    """Layout run vs the single-process run of the same global batch, step by step."""
    world = dist.get_world_size()
    dp = world  # tp = cp = pp = 1
    global_batch = 2 * 2 * dp  # micro-batch 2, two micro-batches per data-parallel rank
    cfg = small_config(output_dir, ep, global_batch, **{"train.recompute_granularity": recompute})
    _, mesh = world_and_mesh(cfg)
    try:
        layout_run = Trainer(cfg, mesh, CPU)
        reference = Trainer(small_config(output_dir, 1, global_batch), Mesh.single(), CPU)
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
        assert max(worst.values()) < TOL, worst
        assert r["aux_loss"] > 0  # the auxiliary losses were on, so they were compared
        return worst
    finally:
        mesh.destroy()


@pytest.mark.parametrize("world,ep", [(2, 2), (2, 1), (4, 2), (4, 4)], ids=["ep2", "dp2", "ep2xdp2", "ep4"])
def test_layouts_match_single_process(rank_pool, tmp_path, world, ep):
    worst = rank_pool(world).run(equivalence_case, ep, 3, str(tmp_path))
    assert all(max(w.values()) < TOL for w in worst)


def test_recompute_matches_single_process(rank_pool, tmp_path):
    worst = rank_pool(2).run(equivalence_case, 2, 2, str(tmp_path), "full")
    assert all(max(w.values()) < TOL for w in worst)


# ----------------------------------------------------------------------------------------- resume


def run_and_save(output_dir: str, ep: int, steps: int, save_at: int | None) -> list[float]:
    """Train ``steps`` steps from scratch (or from the latest checkpoint), saving after step ``save_at``."""
    cfg = small_config(output_dir, ep, 8, **{"train.resume": "true"})
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
