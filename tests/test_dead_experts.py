"""Dead experts: each step's metrics count the experts that received no token (``moe_dead_experts``, summed over the
MoE layers), and the log warns once per (layer, expert) that has received nothing for DEAD_EXPERT_STEPS steps."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from moe_overlap.config import load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.training.expert_load import DEAD_EXPERT_STEPS, DeadExperts
from moe_overlap.training.trainer import Trainer

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
LOGGER = "moe_overlap.training.expert_load"


def warnings_of(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER and "no token" in
            record.getMessage()]


def test_counts_each_step_and_warns_once_per_expert_after_its_run_of_idle_steps(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    dead = DeadExperts(warn=True)
    # layer 1: expert 2 never receives a token; layer 3: expert 0 revives at step 10, then dies for good
    for step in range(1, 2 * DEAD_EXPERT_STEPS + 11):
        counts = {"1": [5, 3, 0, 8], "3": [int(step == 10), 4, 4, 8]}
        assert dead.update(step, counts) == 2 - (step == 10)
        expected = [("1", 2)] * (step >= DEAD_EXPERT_STEPS) + [("3", 0)] * (step >= 10 + DEAD_EXPERT_STEPS)
        assert len(warnings_of(caplog)) == len(expected), step
    first, second = warnings_of(caplog)
    assert first.startswith("MoE layer 1, expert 2: no token for 20 consecutive steps (steps 1-20)"), first
    assert second.startswith("MoE layer 3, expert 0: no token for 20 consecutive steps (steps 11-30)"), second


def test_a_quiet_rank_counts_without_warning(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    dead = DeadExperts(warn=False)
    for step in range(1, DEAD_EXPERT_STEPS + 2):
        assert dead.update(step, {"0": [0, 0, 6, 6]}) == 2
    assert warnings_of(caplog) == []


def test_a_collapsed_router_is_reported_by_the_trainer(tmp_path, caplog):
    """A tiny model whose routers' expert bias pins every token to experts 0 and 1 (top-2 of 8, sigmoid scores in
    (0, 1) against a bias of 10; the bias barely moves at this update rate): 6 dead experts in each of the 2 MoE
    layers every step, and after step DEAD_EXPERT_STEPS one warning for each of them, and no more."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    cfg = load_config(TINY, [
        "model.num_layers=3", "model.moe_layer_freq=[0,1,1]", "model.hidden_size=32", "model.ffn_hidden_size=64",
        "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=16",
        "model.moe_ffn_hidden_size=16", "model.moe_router_score_function=sigmoid",
        "model.moe_router_enable_expert_bias=true", "model.moe_router_bias_update_rate=1e-6",
        "parallel.expert_model_parallel_size=1", "train.device=cpu", "train.precision=fp32",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_interval=0",
        f"train.output_dir={tmp_path}", "checkpoint.save_final=false"])
    trainer = Trainer(cfg, Mesh.single(), torch.device("cpu"))
    routers = trainer.model.routers()
    assert sorted(routers) == [1, 2]
    for router in routers.values():
        router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0, 0, 0, 0, 0, 0]))
    for step in range(1, DEAD_EXPERT_STEPS + 2):
        metrics = trainer.train_step()
        assert metrics["tokens_per_expert"]["1"][2:] == [0] * 6 and metrics["tokens_per_expert"]["2"][2:] == [0] * 6
        assert metrics["moe_dead_experts"] == 12
        assert len(warnings_of(caplog)) == (12 if step >= DEAD_EXPERT_STEPS else 0), step
    assert sorted(message.split(":")[0] for message in warnings_of(caplog)) == [
        f"MoE layer {layer}, expert {expert}" for layer in (1, 2) for expert in range(2, 8)]
