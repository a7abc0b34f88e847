"""Routing replay (layers/routing_replay.py): a run records each MoE layer's chosen experts per (step, micro-batch,
layer); another run of the same batches, with other weights, routes exactly so; the benchmark's compute_only
reference uses it to wait for the config row's most loaded rank."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.config import load_config
from moe_overlap.layers.router import Router
from moe_overlap.layers.routing_replay import RoutingReplay, replay_refusal
from moe_overlap.training.trainer import Trainer
from tests.test_master import small_config, world_and_mesh

STEPS = 2


@pytest.mark.parametrize("score_function,pre_softmax", [("softmax", False), ("softmax", True), ("sigmoid", False)])
def test_a_router_given_the_experts_weights_them_by_its_own_scores(score_function, pre_softmax):
    """The given experts are the routing's, weighted as the score function weights chosen ones: the weights the
    router gives its own top-k choice when the given experts are that choice."""
    torch.manual_seed(0)
    router = Router(16, 8, 2, pre_softmax, "aux_loss", 0.01, 0.0, dtype=torch.float32, score_function=score_function)
    with torch.no_grad():  # made uninitialised (a model's init_weights fills it): NaNs were possible
        router.weight.normal_(0, 0.1)
    x_TH = torch.randn(12, 16)
    own = router(x_TH)
    given = router(x_TH, own.experts_TK.flip(-1))  # the same experts, the other order
    assert torch.equal(given.experts_TK, own.experts_TK.flip(-1))
    torch.testing.assert_close(given.probs_TK, own.probs_TK.flip(-1))
    assert torch.equal(given.tokens_per_expert_E, own.tokens_per_expert_E)
    other_TK = (own.experts_TK + 1) % 8  # experts it did not choose
    assert torch.equal(router(x_TH, other_TK).experts_TK, other_TK)


def replay_case(output_dir: str, paired: bool) -> dict:
    """EP = the ranks: a run records its routing; a compute-only run from other weights replays it, and another does
    not. Each step's copies per expert and micro-batch (what every exchange and GEMM is sized by), per run."""
    import torch.distributed as dist

    world = dist.get_world_size()
    extra = {"overlap.moe_pipeline": "true", "overlap.overlap_moe_expert_parallel_comm": str(paired).lower()}
    other = {**extra, "overlap.moe_compute_only": "true", "train.seed": "7"}
    runs = {}
    recording = RoutingReplay()
    for name, overrides, replay in (("recorded", extra, recording), ("replayed", other, RoutingReplay(
            recording.recorded)), ("own", other, None)):
        cfg = small_config(output_dir, world, 4 * world, **overrides)  # two micro-batches a rank
        _, mesh = world_and_mesh(cfg)
        try:
            trainer = Trainer(cfg, mesh, torch.device("cpu"), routing_replay=replay)
            runs[name] = []
            for _ in range(STEPS):
                trainer.train_step()
                runs[name].append({layer: counts.clone() for layer, counts in trainer.tokens_per_micro_batch.items()})
        finally:
            mesh.destroy()
    same = {name: all(torch.equal(a[layer], b[layer]) for a, b in zip(runs["recorded"], runs[name]) for layer in a)
            for name in ("replayed", "own")}
    return {"same": same, "keys": sorted(recording.recorded), "layers": sorted(runs["recorded"][0])}


@pytest.mark.parametrize("world,paired", [(2, False), (2, True), (4, False)])
def test_a_compute_only_run_replays_the_recorded_routing(rank_pool, tmp_path, world, paired):
    """Paired: the layer's steps run apart (MoELayer.start_dispatch under the slot), not its forward."""
    for result in rank_pool(world).run(replay_case, str(tmp_path), paired):
        assert result["same"] == {"replayed": True, "own": False}, result
        assert result["keys"] == [(step, mb, layer) for step in range(STEPS) for mb in range(2)
                                  for layer in result["layers"]]


def test_a_replay_without_a_recording_of_the_step_fails_naming_it(tmp_path):
    cfg = small_config(str(tmp_path), 1, 4)
    trainer = Trainer(cfg, world_and_mesh(cfg)[1], torch.device("cpu"), routing_replay=RoutingReplay({}))
    with pytest.raises(KeyError, match="nothing recorded for step 0, micro-batch 0, layer 1"):
        trainer.train_step()


@pytest.mark.parametrize("overrides,fragment", [
    (["train.recompute_granularity=full"], "recompute_granularity='full'"),
    (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"], "sequence or context parallelism"),
    (["parallel.context_parallel_size=2"], "sequence or context parallelism"),
])
def test_routing_replay_is_refused_where_it_is_not_implemented(overrides, fragment):
    assert fragment in replay_refusal(load_config("configs/tiny.yaml", overrides))


def test_routing_replay_is_refused_by_a_model_it_cannot_replay(tmp_path):
    cfg = small_config(str(tmp_path), 1, 4, **{"train.recompute_granularity": "full"})
    with pytest.raises(ValueError, match="recompute_granularity='full'"):
        Trainer(cfg, world_and_mesh(cfg)[1], torch.device("cpu"), routing_replay=RoutingReplay())
