"""Each micro-batch's exchange waits for its own most loaded EP rank: the metrics report that wait per MoE layer
(``ep_imbalance_micro_batch``: mean and max over the step's micro-batches), which the step's pooled
``ep_imbalance`` hides."""

from __future__ import annotations

import math

import torch

from moe_overlap.training.expert_load import imbalance, micro_batch_imbalance
from moe_overlap.training.trainer import Trainer
from tests.test_master import CPU, small_config, world_and_mesh


def test_opposite_skews_pool_to_balance_while_each_micro_batch_waits():
    # 2 layers x 2 micro-batches x 4 experts on 2 ranks (experts 0-1 on rank 0, 2-3 on rank 1)
    counts_LME = torch.tensor([[[6, 6, 2, 2], [2, 2, 6, 6]],  # rank loads 12:4, then 4:12
                               [[4, 4, 4, 4], [0, 0, 0, 0]]])  # balanced, then no copies at all
    assert micro_batch_imbalance(counts_LME, 2).tolist() == [1.5, 1.5, 1.0, 1.0]
    assert imbalance(counts_LME[0].sum(0).tolist(), 2) == 1.0  # what the pooled metric shows for layer 0


def imbalance_case(output_dir: str) -> dict:
    cfg = small_config(output_dir, 2, 8, **{"train.device": "cpu", "train.precision": "fp32"})
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        metrics = trainer.train_step()
        return {"metrics": metrics, "local": {layer: counts_ME.tolist()
                                              for layer, counts_ME in trainer.tokens_per_micro_batch.items()}}
    finally:
        mesh.destroy()


def test_every_rank_reports_its_ep_groups_wait_per_micro_batch(rank_pool, tmp_path):
    """EP=2 over 2 ranks, 2 micro-batches each: both ranks report the same numbers, computed from both ranks'
    routing of each micro-batch; their mean is at least the pooled ``ep_imbalance`` (equal micro-batches)."""
    ranks = rank_pool(2).run(imbalance_case, str(tmp_path))
    reported = [r["metrics"]["ep_imbalance_micro_batch"] for r in ranks]
    assert reported[0] == reported[1] and sorted(reported[0]) == ["1", "2"]
    for layer, got in reported[0].items():
        both_ME = torch.tensor(ranks[0]["local"][int(layer)]) + torch.tensor(ranks[1]["local"][int(layer)])
        assert both_ME.shape == (2, 8)
        mean, worst = micro_batch_imbalance(both_ME.unsqueeze(0), 2).tolist()
        assert math.isclose(got["mean"], mean) and math.isclose(got["max"], worst)
        assert got["mean"] >= ranks[0]["metrics"]["ep_imbalance"][layer] - 1e-12


def test_counts_survive_a_layer_that_reuses_its_output_buffer(tmp_path, monkeypatch):
    """A graphed MoE layer returns its counts in the graph's output buffer, which its next replay overwrites: the
    step's counts per micro-batch, and their sum (the routers' load), are those of the layer run plainly (this
    bug shipped once: every micro-batch read as the last one)."""
    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.layers.moe import MoELayer

    def run() -> tuple[dict, dict]:
        cfg = small_config(str(tmp_path), 1, 8, **{"train.device": "cpu", "train.precision": "fp32"})
        torch.manual_seed(0)
        trainer = Trainer(cfg, Mesh.single(), CPU)
        metrics = trainer.train_step()
        return metrics["tokens_per_expert"], {layer: counts_ME.tolist()
                                              for layer, counts_ME in trainer.tokens_per_micro_batch.items()}

    plain_sum, plain_ME = run()
    assert all(len(counts_ME) == 4 and counts_ME[0] != counts_ME[-1] for counts_ME in plain_ME.values())
    original = MoELayer.for_micro_batch
    buffers: dict[int, torch.Tensor] = {}

    def static_output(self, micro_batch):
        layer = original(self, micro_batch)

        def run_layer(x_BSH):
            out, aux, counts_E = layer(x_BSH)
            buffer = buffers.setdefault(id(self), torch.zeros_like(counts_E))
            buffer.copy_(counts_E)  # as a replay writes its graph's output
            return out, aux, buffer
        return run_layer

    monkeypatch.setattr(MoELayer, "for_micro_batch", static_output)
    assert run() == (plain_sum, plain_ME)
