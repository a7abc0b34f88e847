"""Pipeline parallelism: the schedules as data (their formulas and validity) and the master test's PP layouts.

Every PP layout reproduces the single-process losses and gradients within 1e-5 normwise (fp32, gloo): PP=2
and PP=4 under every schedule, 4 and 8 micro-batches, VPP=2, an uneven split, EP, TP x EP x PP x DP, the
distributed optimizer with its overlaps, recomputation, tied embeddings, the overlapped and the sync-free
dispatch; the P2P switches give bit-identical runs; checkpoints move between PP sizes. Each pool call runs
several layouts against one single-process reference, to keep the pool's per-call cost down.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from moe_overlap.config import ConfigError, load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.training.schedules import (SCHEDULES, Compute, Post, Schedule, ScheduleError, Wait, build_schedule,
                                            graph_copies, in_flight, in_flight_bound, predicted_bubble, render,
                                            simulate, validate)
from moe_overlap.training.trainer import Trainer
from tests.test_master import CPU, TOL, rel_err, run_and_save, small_config, world_and_mesh

# ----------------------------------------------------------------------------------------- schedules


def unit_costs(vpp: int):
    """F = 1, B = 2 (I = W = 1) per pipeline stage, split over its VPP chunks."""
    return lambda rank, action: {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[action.kind] / vpp


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_one_f_one_b_bubble_is_the_formula_under_every_transfer_policy(pp, m):
    for overlap, batch in ((False, False), (False, True), (True, False)):
        timeline = simulate(build_schedule("1f1b", pp, 1, m, overlap, batch), unit_costs(1))
        assert timeline.bubble() == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
        assert timeline.makespan == pytest.approx(3 * (m + pp - 1))


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (2, 4, 8), (4, 2, 16)])
def test_interleaved_bubble_is_the_formula(pp, vpp, m):
    for overlap, batch in ((False, False), (False, True), (True, False)):
        timeline = simulate(build_schedule("interleaved_1f1b", pp, vpp, m, overlap, batch), unit_costs(vpp))
        assert timeline.bubble() == pytest.approx((pp - 1) / (vpp * m + pp - 1), abs=1e-12)
    assert predicted_bubble("interleaved_1f1b", pp, vpp, m) == pytest.approx((pp - 1) / (vpp * m + pp - 1))


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 12)])
def test_zero_bubble_h1_beats_1f1b_at_its_peak_memory(pp, m):
    """ZB-H1's bubble is (PP - 1)(F + I - W), a third of 1F1B's at F = I = W, with transfers that overlap;
    at most PP micro-batches in flight on any rank (1F1B's peak, on rank 0), and rank 0 holds PP micro-batches'
    activations (F done, I not) as 1F1B does."""
    zb = build_schedule("zb_h1", pp, 1, m, overlap_p2p=True)
    one = build_schedule("1f1b", pp, 1, m, overlap_p2p=True)
    zb_time, one_time = simulate(zb, unit_costs(1)), simulate(one, unit_costs(1))
    assert zb_time.bubble() == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-12)
    assert zb_time.bubble() < one_time.bubble() and zb_time.makespan < one_time.makespan
    assert max(in_flight(a) for a in zb.ranks) == max(in_flight(a) for a in one.ranks) == pp
    activations = 0
    live = set()
    for action in zb.computes(0):
        live.add(action.micro_batch) if action.kind == "F" else live.discard(action.micro_batch) if (
            action.kind == "I") else None
        activations = max(activations, len(live))
    assert activations == pp


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (3, 6)])
def test_every_schedule_is_valid_and_in_flight_within_its_bound(name, pp, m):
    vpp = 2 if name in ("interleaved_1f1b", "all_forward_all_backward") else 1
    for overlap, batch in ((False, False), (False, True), (True, False)):
        schedule = build_schedule(name, pp, vpp, m, overlap, batch)  # validates: raises on any fault
        for rank, actions in enumerate(schedule.ranks):
            assert in_flight(actions) <= in_flight_bound(name, pp, vpp, m, rank)
    forward_only = build_schedule(name, pp, vpp, m, forward_only=True)
    assert all(a.kind == "F" for rank in range(pp) for a in forward_only.computes(rank))


def _edited(schedule: Schedule, rank: int, edit) -> Schedule:
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(edit(list(ranks[rank])))
    return Schedule(schedule.name, schedule.pp, schedule.vpp, schedule.micro_batches, schedule.overlap_p2p,
                    schedule.batch_p2p, tuple(ranks))


def _without_transfers_of(micro_batch: int):
    """Drop one micro-batch's receives from every Post and Wait."""
    def edit(actions):
        return [type(a)(tuple(op for op in a.ops if op.send or op.message.micro_batch != micro_batch))
                if isinstance(a, (Post, Wait)) else a for a in actions]
    return edit


def _first_two_computes_swapped(actions):
    i, j = [k for k, a in enumerate(actions) if isinstance(a, Compute)][:2]
    actions[i], actions[j] = actions[j], actions[i]
    return actions


def _sends_alone_first(actions):
    """Each step's transfers split one per call, sends first, each waited for at once: under rendezvous both
    ends of a 1F1B pair then wait in their sends for receives the other has not posted."""
    out = []
    for a in actions:
        if isinstance(a, Post):
            for op in sorted(a.ops, key=lambda op: not op.send):
                out += [Post((op,)), Wait((op,))]
        elif not isinstance(a, Wait):
            out.append(a)
    return out


@pytest.mark.parametrize("rank,edit,match", [
    (1, _without_transfers_of(0), "before waiting|no matching receive"),
    (1, lambda a: a + [a[-1] if isinstance(a[-1], Compute) else next(x for x in a if isinstance(x, Compute))],
     "runs twice"),
    (1, lambda a: [x for x in a if not isinstance(x, (Post, Wait))], "before waiting"),
    (1, lambda a: a[:-1], "never waits"),  # rank 1 (last stage) ends waiting for its last gradient's send
    (1, _first_two_computes_swapped, "runs before F"),
], ids=["missing-receive", "twice", "no-transfers", "never-waits", "b-before-f"])
def test_validation_catches_a_broken_list(rank, edit, match):
    with pytest.raises(ScheduleError, match=match):
        validate(_edited(build_schedule("1f1b", 2, 1, 4), rank, edit))


def test_validation_catches_channel_order_and_deadlock():
    # Rank 1 receives micro-batch 1's activations before micro-batch 0's, in one call; rank 0 sends them in
    # micro-batch order: NCCL (no tags) would pair them wrongly.
    good = build_schedule("all_forward_all_backward", 2, 1, 2)
    recvs = [a for a in good.ranks[1] if isinstance(a, Post) and not a.ops[0].send]
    both = tuple(op for post in reversed(recvs) for op in post.ops)
    rest = [a for a in good.ranks[1] if not (isinstance(a, (Post, Wait)) and not a.ops[0].send)]
    swapped = _edited(good, 1, lambda _: [Post(both), Wait(both)] + rest)
    with pytest.raises(ScheduleError, match="NCCL matches by order"):
        validate(swapped)
    dead = build_schedule("1f1b", 2, 1, 4)
    dead = _edited(_edited(dead, 0, _sends_alone_first), 1, _sends_alone_first)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(dead, unit_costs(1))


def test_render_shows_every_rank_and_the_bubble():
    schedule = build_schedule("interleaved_1f1b", 2, 2, 4, overlap_p2p=True)
    text = render(schedule, simulate(schedule, unit_costs(2)), width=40)
    assert "rank 0 |" in text and "rank 1 |" in text and "textbook" in text
    assert "rank 0 order: F0 F1 F0.1 F1.1" in text


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("overrides,field,fragment", [
    (["parallel.pipeline_model_parallel_size=3"], "model.num_layers", "or set parallel.num_layers_in_first"),
    (["parallel.virtual_pipeline_model_parallel_size=2"], "parallel.virtual_pipeline_model_parallel_size",
     "needs parallel.pipeline_model_parallel_size > 1"),
    (["parallel.pipeline_model_parallel_size=2", "parallel.num_layers_in_first_pipeline_stage=4"],
     "parallel.num_layers_in_first_pipeline_stage", "leaves 0 of model.num_layers=4"),
    (["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
      "parallel.num_layers_in_last_pipeline_stage=3"], "parallel.num_layers_in_last_pipeline_stage",
     "multiple of the virtual stages per rank, 2"),
    (["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
      "train.pipeline_schedule=1f1b"], "train.pipeline_schedule", "use interleaved_1f1b"),
    (["parallel.pipeline_model_parallel_size=2", "train.pipeline_schedule=interleaved_1f1b"],
     "train.pipeline_schedule", "needs parallel.virtual_pipeline_model_parallel_size > 1"),
    (["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
      "train.pipeline_schedule=zb_h1"], "train.pipeline_schedule", "not implemented yet over virtual stages"),
    (["parallel.pipeline_model_parallel_size=2", "train.pipeline_schedule=zb_h1",
      "train.recompute_granularity=full"], "train.pipeline_schedule", "not implemented yet with"),
    (["overlap.batch_p2p_comm=true"], "overlap.batch_p2p_comm", "no effect without pipeline parallelism"),
    (["train.pipeline_schedule=1f1b"], "train.pipeline_schedule", "no effect without pipeline parallelism"),
    (["parallel.pipeline_model_parallel_size=2", "overlap.overlap_p2p_comm=true", "overlap.batch_p2p_comm=true"],
     "overlap.batch_p2p_comm", "cannot both be set"),
    (["parallel.pipeline_model_parallel_size=2", "train.schedule=1f1b"], "train.schedule",
     "did you mean 'pipeline_schedule'"),
    (["parallel.pipeline_model_parallel_size=2", "train.expert_wgrad_micro_batches=2"],
     "train.expert_wgrad_micro_batches",
     "not implemented yet (under pipeline parallelism"),
])
def test_bad_pipeline_config_is_one_line_naming_the_field(overrides, field, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", overrides)
    message = str(err.value)
    assert message.startswith(f"{field}=") and fragment in message and "\n" not in message, message


def test_virtual_stages_need_micro_batches_in_groups_of_pp():
    from moe_overlap.config import validate_for_world
    common = ["parallel.expert_model_parallel_size=1", "train.global_batch_size=12", "train.micro_batch_size=4"]
    validate_for_world(load_config("configs/tiny.yaml", ["parallel.pipeline_model_parallel_size=2", *common]), 2,
                       "cpu")  # 1f1b takes any count
    cfg = load_config("configs/tiny.yaml", ["parallel.pipeline_model_parallel_size=2",
                                            "parallel.virtual_pipeline_model_parallel_size=2", *common])
    with pytest.raises(ConfigError, match=r"^train.global_batch_size=12: gives 3 micro-batches .* groups of "
                                          r"parallel.pipeline_model_parallel_size=2: need a multiple$"):
        validate_for_world(cfg, 2, "cpu")


# -------------------------------------------------------------------------------------- equivalence

LAYERS = {"model.num_layers": 4, "model.moe_layer_freq": "[1,0,1,1]"}


def pipeline_case(output_dir: str, micro_batches: int, steps: int, variants: dict[str, dict],
                  both: dict | None = None) -> dict[str, dict]:
    """Each variant (layout overrides) against the single-process run of the same global batch (one per
    distinct model), step by step: worst relative errors of losses, gradient norm and every gradient, and
    the losses themselves."""
    world = dist.get_world_size()
    both = {**LAYERS, **(both or {})}
    references: dict[tuple, list] = {}
    results = {}
    for name, layout in variants.items():
        # A variant's model.* overrides (tied embeddings) change the model: the reference runs them too.
        model = {k: v for k, v in layout.items() if k.startswith("model.")}
        if tuple(sorted(model.items())) not in references:
            reference = Trainer(small_config(output_dir, 1, 2 * micro_batches, **both, **model), Mesh.single(), CPU)
            want = references[tuple(sorted(model.items()))] = []
            for _ in range(steps):
                grads = {}
                metrics = reference.train_step(lambda opt: grads.update(opt.logical_grads()))
                want.append((metrics, grads))
        want = references[tuple(sorted(model.items()))]
        dp = world // (int(layout.get("parallel.tensor_model_parallel_size", 1))
                       * int(layout["parallel.pipeline_model_parallel_size"]))
        ep = int(layout.get("parallel.expert_model_parallel_size", 1))
        cfg = small_config(output_dir, ep, 2 * micro_batches, **both, **layout)
        assert cfg.num_micro_batches(world) * dp == micro_batches
        _, mesh = world_and_mesh(cfg)
        try:
            run = Trainer(cfg, mesh, CPU)
            worst = {"loss": 0.0, "grad": 0.0, "grad_norm": 0.0, "losses": [], "keys": [], "reference_keys": []}
            for metrics_want, grads_want in want:
                got = {}
                m = run.train_step(lambda opt: got.update(opt.logical_grads()))
                r = metrics_want
                worst["loss"] = max(worst["loss"], abs(m["loss"] - r["loss"]) / abs(r["loss"]),
                                    abs(m["aux_loss"] - r["aux_loss"]) / max(abs(r["aux_loss"]), 1e-30))
                worst["grad_norm"] = max(worst["grad_norm"], abs(m["grad_norm"] - r["grad_norm"]) / r["grad_norm"])
                for key, grad in got.items():
                    err = rel_err(grad, grads_want[key])
                    assert err < TOL, f"{name} step {m['step']} {key}: {err:.2e}"
                    worst["grad"] = max(worst["grad"], err)
                assert m["tokens_per_expert"] == r["tokens_per_expert"], name
                worst["losses"].append((m["loss"], m["aux_loss"]))
                worst["keys"], worst["reference_keys"] = sorted(got), sorted(grads_want)
            assert r["aux_loss"] > 0
            results[name] = worst
        finally:
            mesh.destroy()
    return results


def check(results: list[dict[str, dict]]) -> None:
    """Every variant within tolerance on every rank, and every parameter of the single-process model compared
    on some rank (a stage holds only its own layers' parameters)."""
    for name in results[0]:
        for per_rank in results:
            w = per_rank[name]
            assert max(w["loss"], w["grad"], w["grad_norm"]) < TOL, (name, w)
        keys = set().union(*(per_rank[name]["keys"] for per_rank in results))
        reference_keys = set(results[0][name]["reference_keys"])
        assert keys == reference_keys, (name, sorted(reference_keys ^ keys))


def pp_layout(pp: int, schedule: str | None = None, vpp: int | None = None, **extra) -> dict:
    layout = {"parallel.pipeline_model_parallel_size": pp, **extra}
    if schedule:
        layout["train.pipeline_schedule"] = schedule
    if vpp:
        layout["parallel.virtual_pipeline_model_parallel_size"] = vpp
    return layout


def test_pp2_every_schedule_and_p2p_switch_matches_single_process(rank_pool, tmp_path):
    variants = {
        "1f1b": pp_layout(2),
        "1f1b_overlap_p2p": pp_layout(2, **{"overlap.overlap_p2p_comm": "true"}),
        "1f1b_batch_p2p": pp_layout(2, **{"overlap.batch_p2p_comm": "true"}),
        "afab": pp_layout(2, "all_forward_all_backward"),
        "zb_h1": pp_layout(2, "zb_h1", **{"overlap.overlap_p2p_comm": "true"}),
        "interleaved_vpp2": pp_layout(2, vpp=2),
        "interleaved_vpp2_batch": pp_layout(2, vpp=2, **{"overlap.batch_p2p_comm": "true"}),
        "zb_h1_tied": pp_layout(2, "zb_h1", **{"overlap.overlap_p2p_comm": "true",
                                               "model.share_embeddings_and_output_weights": "true"}),
    }
    results = rank_pool(2).run(pipeline_case, str(tmp_path), 4, 2, variants)
    check(results)
    eight = {name: variants[name] for name in ("1f1b_overlap_p2p", "afab", "zb_h1", "interleaved_vpp2")}
    check(rank_pool(2).run(pipeline_case, str(tmp_path), 8, 2, eight))
    # The P2P switches change when transfers start and end, never the math: bit-identical losses.
    for per_rank in results:
        assert per_rank["1f1b_overlap_p2p"]["losses"] == per_rank["1f1b"]["losses"] == per_rank[
            "1f1b_batch_p2p"]["losses"]
        assert per_rank["interleaved_vpp2"]["losses"] == per_rank["interleaved_vpp2_batch"]["losses"]


EIGHT_LAYERS = {"model.num_layers": 8, "model.moe_layer_freq": "[1,0,1,1,0,1,1,1]"}


def test_pp4_every_schedule_with_8_and_4_micro_batches_matches_single_process(rank_pool, tmp_path):
    """PP=4 (and PP=4 x VPP=2, one layer per virtual stage) over 8 layers; an uneven split; recomputation."""
    variants = {
        "1f1b": pp_layout(4),
        "afab": pp_layout(4, "all_forward_all_backward", **{"overlap.batch_p2p_comm": "true"}),
        "zb_h1": pp_layout(4, "zb_h1", **{"overlap.overlap_p2p_comm": "true"}),
        "interleaved_vpp2": pp_layout(4, vpp=2, **{"overlap.overlap_p2p_comm": "true"}),
        "uneven_1_3_recompute": pp_layout(4, **{"parallel.num_layers_in_first_pipeline_stage": 1,
                                                "parallel.num_layers_in_last_pipeline_stage": 3,
                                                "train.recompute_granularity": "full"}),
    }
    check(rank_pool(4).run(pipeline_case, str(tmp_path), 8, 2, variants, EIGHT_LAYERS))
    four = {name: variants[name] for name in ("1f1b", "zb_h1", "interleaved_vpp2")}
    check(rank_pool(4).run(pipeline_case, str(tmp_path), 4, 2, four, EIGHT_LAYERS))


def test_pp2_composes_with_ep_tp_dp_and_the_distributed_optimizer(rank_pool, tmp_path):
    """4 ranks, PP=2 x (EP=2 | DP=2 | TP=2 | expert-TP=2): every dispatch path, tied embeddings summed over
    the embedding group, the distributed optimizer with both overlaps (a bucket's reduce-scatter inside the
    last micro-batch's backward of its stage), TP with every tp_comm overlap."""
    dist_opt = {"train.use_distributed_optimizer": "true", "overlap.overlap_grad_sync": "true",
                "overlap.overlap_param_sync": "true"}
    tp = {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": "true",
          "parallel.expert_tensor_parallel_size": 1, "overlap.tp_comm_overlap": "true",
          **{f"overlap.{name}": "true" for name in ("tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_bulk_dgrad",
                                                    "tp_comm_bulk_wgrad")}, "overlap.tp_comm_num_splits": 2}
    overlapped = {"overlap.moe_pipeline": "true", "overlap.moe_planning": "host", "overlap.moe_pipeline_chunks": 2,
                  "overlap.delay_wgrad_compute": "true"}
    variants = {
        "ep2_1f1b": pp_layout(2, **{"parallel.expert_model_parallel_size": 2}),
        "ep2_zb_overlapped_dispatch": pp_layout(2, "zb_h1", **{"parallel.expert_model_parallel_size": 2,
                                                               "overlap.overlap_p2p_comm": "true", **overlapped}),
        "ep2_interleaved_device_planned": pp_layout(2, vpp=2, **{"parallel.expert_model_parallel_size": 2,
                                                                 "overlap.moe_pipeline": "true",
                                                                 "overlap.moe_planning": "device"}),
        "ep2_zb_device_planned_chunks": pp_layout(2, "zb_h1", **{"parallel.expert_model_parallel_size": 2,
                                                                 "overlap.moe_pipeline": "true",
                                                                 "overlap.moe_planning": "device",
                                                                 "overlap.moe_pipeline_chunks": 2}),
        "dp2_dist_opt_tied": pp_layout(2, **dist_opt, **{"model.share_embeddings_and_output_weights": "true"}),
        "dp2_dist_opt_zb_buckets": pp_layout(2, "zb_h1", **dist_opt, **{"overlap.bucket_size_mb": 8 / 1024,
                                                                         "overlap.overlap_p2p_comm": "true"}),
        "tp2_ep2_interleaved": pp_layout(2, vpp=2, **tp, **{"parallel.expert_model_parallel_size": 2}),
        "etp2_zb": pp_layout(2, "zb_h1", **{"parallel.expert_tensor_parallel_size": 2}),
    }
    both = {"model.num_query_groups": 4, "train.adam_eps": 1e-4}  # as test_master's TP cases, for its reasons
    check(rank_pool(4).run(pipeline_case, str(tmp_path), 4, 2, variants, both))


def test_tp_ep_pp_dp_on_8_ranks_matches_single_process(rank_pool, tmp_path):
    """TP=2 x PP=2 x DP=2, experts folded as EP=2 x expert-DP=2 in each stage, interleaved over VPP=2, the
    distributed optimizer with its overlaps, overlapped P2P."""
    layout = pp_layout(2, vpp=2, **{
        "parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": "true",
        "parallel.expert_model_parallel_size": 2, "parallel.expert_tensor_parallel_size": 1,
        "train.use_distributed_optimizer": "true", "overlap.overlap_grad_sync": "true",
        "overlap.overlap_param_sync": "true", "overlap.overlap_p2p_comm": "true"})
    both = {"model.num_query_groups": 4, "train.adam_eps": 1e-4}
    check(rank_pool(8).run(pipeline_case, str(tmp_path), 4, 2, {"tp2_ep2_pp2_dp2": layout}, both))


def test_checkpoint_moves_between_pp_sizes(rank_pool, tmp_path):
    """Saved at PP=2, resumed at PP=4 (a stage's layers on other ranks, the tied embedding's head copy on
    another rank), saved again and resumed at PP=2: each next loss is the uninterrupted run's."""
    both = {**LAYERS, "model.share_embeddings_and_output_weights": "true", "train.use_distributed_optimizer": "true"}
    straight = rank_pool(2).run(run_and_save, str(tmp_path / "straight"), 1, 4, None, 8, **both, **pp_layout(2))[0]
    rank_pool(2).run(run_and_save, str(tmp_path / "moved"), 1, 2, 2, 8, **both, **pp_layout(2))
    on_pp4 = rank_pool(4).run(run_and_save, str(tmp_path / "moved"), 1, 3, 3, 8, **both, **pp_layout(4))[0]
    back = rank_pool(2).run(run_and_save, str(tmp_path / "moved"), 1, 4, None, 8, **both, **pp_layout(2))[0]
    assert len(on_pp4) == 1 and abs(on_pp4[0] - straight[2]) / straight[2] < TOL
    assert len(back) == 1 and abs(back[0] - straight[3]) / straight[3] < TOL


def executor_case(output_dir: str, variants: dict[str, dict]) -> dict[str, dict]:
    """One measured step of each variant through the executor: peak bytes, the traced compute actions, and
    which of the distributed optimizer's buckets had started their reduce-scatter when backward ended."""
    out = {}
    for name, layout in variants.items():
        cfg = small_config(output_dir, int(layout.get("parallel.expert_model_parallel_size", 1)), 8, **LAYERS,
                           **layout)
        _, mesh = world_and_mesh(cfg)
        try:
            trainer = Trainer(cfg, mesh, CPU)
            scale = 1.0 / (trainer.num_micro_batches * mesh.dp.size)
            result = trainer.pipeline.run(list(trainer.sampler.micro_batches(0)), scale, measure=True)
            buckets = getattr(trainer.optimizer, "buckets", [])
            computes = [(a, begin, end) for a, begin, end in result.trace if isinstance(a, Compute)]
            out[name] = {"peak": result.peak_bytes, "trace": [str(a) for a, _, _ in computes],
                         "ordered": len(result.trace) == len(trainer.pipeline.schedule.ranks[mesh.pp.rank]) and all(
                             b0 <= e0 <= b1 for (_, b0, e0), (_, b1, _) in zip(result.trace, result.trace[1:])),
                         "started_in_backward": [b.grad_work is not None for b in buckets if not b.after_backward],
                         "after_backward": sum(b.after_backward for b in buckets)}
            trainer.optimizer.reduce_grads()
        finally:
            mesh.destroy()
    return out


def test_executor_counts_memory_and_traces_every_compute_action(rank_pool, tmp_path):
    """4 micro-batches at PP=2: all-forward-all-backward holds all four on rank 0, 1F1B two, ZB-H1 no more
    than 1F1B (its rank 0 holds the same activations; rank 1 also holds weight-gradient inputs)."""
    variants = {"afab": pp_layout(2, "all_forward_all_backward"), "1f1b": pp_layout(2),
                "zb_h1": pp_layout(2, "zb_h1", **{"overlap.overlap_p2p_comm": "true"})}
    rank0, rank1 = rank_pool(2).run(executor_case, str(tmp_path), variants)
    assert rank0["afab"]["peak"] > 1.5 * rank0["1f1b"]["peak"] > 0
    assert rank0["zb_h1"]["peak"] <= 1.02 * rank0["1f1b"]["peak"]
    assert rank1["zb_h1"]["peak"] > rank1["1f1b"]["peak"]  # the deferred W's inputs are counted
    assert rank0["1f1b"]["trace"] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert rank1["zb_h1"]["trace"][:6] == ["F0", "I0", "F1", "I1", "W0", "F2"]
    assert all(r[name]["ordered"] for r in (rank0, rank1) for name in variants)


def test_distributed_optimizer_reduce_scatters_start_inside_the_pipeline_backward(rank_pool, tmp_path):
    """PP=2 x DP=2 with overlap_grad_sync: when the schedule ends every bucket's reduce-scatter has started
    (from its last micro-batch's backward, B or W, per chunk), except the tied embedding's, which first sums
    over the embedding group."""
    dist_opt = {"train.use_distributed_optimizer": "true", "overlap.overlap_grad_sync": "true",
                "overlap.overlap_param_sync": "true", "model.share_embeddings_and_output_weights": "true"}
    variants = {"1f1b": pp_layout(2, **dist_opt), "zb_h1": pp_layout(2, "zb_h1", **dist_opt),
                "interleaved": pp_layout(2, vpp=2, **dist_opt)}
    for per_rank in rank_pool(4).run(executor_case, str(tmp_path), variants):
        for name, got in per_rank.items():
            assert got["started_in_backward"] and all(got["started_in_backward"]), name
            assert got["after_backward"] == 1, name  # the embedding (first stage) or its copy (last)


def test_info_schedule_prints_every_ranks_timeline(capsys):
    from moe_overlap.cli import main
    assert main(["info", "configs/tiny.yaml", "parallel.pipeline_model_parallel_size=2",
                 "parallel.virtual_pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=1",
                 "--schedule"]) == 0
    out = capsys.readouterr().out
    assert "interleaved_1f1b: PP=2 VPP=2 micro-batches=4" in out and "rank 1 |" in out and "bubble (mean" in out
    assert main(["info", "configs/tiny.yaml", "--schedule"]) == 2
    assert "--schedule=True: needs parallel.pipeline_model_parallel_size > 1" in capsys.readouterr().err


@pytest.mark.parametrize("pp, micro_batches, paired", [(1, 4, False), (1, 4, True), (2, 8, False), (2, 8, True),
                                                        (4, 8, False), (4, 16, True)])
def test_graph_copies_one_per_micro_batch_in_flight_under_1f1b(pp, micro_batches, paired):
    """train.moe_cuda_graph under 1F1B: a rank's graphed copies are its micro-batches in flight (pp - rank
    unpaired), and micro-batch i's forward replays copy i mod n only after micro-batch i - n's backward."""
    schedule = build_schedule("1f1b", pp, 1, micro_batches, paired=paired)
    copies = [graph_copies(actions) for actions in schedule.ranks]
    assert copies == [in_flight(actions) for actions in schedule.ranks]
    if not paired:
        assert copies == [pp - rank for rank in range(pp)]


@pytest.mark.parametrize("pp, vpp, micro_batches, paired", [(2, 2, 8, False), (2, 2, 8, True), (4, 2, 8, False),
                                                              (2, 3, 6, False), (4, 2, 16, True)])
def test_graph_copies_per_model_chunk_under_interleaved_1f1b(pp, vpp, micro_batches, paired):
    """Under interleaved 1F1B each model chunk's MoE layers get that chunk's micro-batches in flight (at most
    the rank's over all its chunks), each copy's next forward after its last backward (graph_copies checks it)."""
    schedule = build_schedule("interleaved_1f1b", pp, vpp, micro_batches, paired=paired)
    for actions in schedule.ranks:
        copies = [graph_copies(actions, chunk) for chunk in range(vpp)]
        assert copies == [in_flight(actions, chunk) for chunk in range(vpp)]
        assert max(copies) <= in_flight(actions) <= sum(copies)
    assert [graph_copies(actions, c) for actions in build_schedule("interleaved_1f1b", 2, 2, 8).ranks
            for c in range(2)] == [4, 2, 3, 1]


def test_each_moe_layer_is_graphed_with_its_model_chunks_copies(monkeypatch):
    """The trainer gives each model chunk's layers its copies (PP=2 x VPP=2, 8 micro-batches: rank 0 holds
    layers 0 and 2, 4 and 2 in flight; rank 1 layers 1 and 3, 3 and 1; even on two streams), and the model
    captures each chunk apart and routes each layer with its count. CUDA graphs are recorded here, not captured."""
    import torch

    from moe_overlap.layers import moe as moe_module
    from moe_overlap.layers.routing_replay import RoutingReplay
    from moe_overlap.models.mixtral import build_model
    from moe_overlap.models.pipeline_stages import PipelineStages

    cfg = small_config("unused", 1, 16, **LAYERS, **{"parallel.pipeline_model_parallel_size": 2,
                                                     "parallel.virtual_pipeline_model_parallel_size": 2})
    stages = PipelineStages.from_config(cfg)
    schedule = build_schedule("interleaved_1f1b", 2, 2, 8)

    def trainer_copies(rank: int, on_streams: bool) -> dict[int, int]:
        trainer = SimpleNamespace(mesh=SimpleNamespace(pp=SimpleNamespace(rank=rank)),
                                  pipeline=SimpleNamespace(schedule=schedule))
        return Trainer._graph_copies(trainer, stages, on_streams)

    assert [trainer_copies(rank, False) for rank in range(2)] == [[((0,), 4), ((2,), 2)], [((1,), 3), ((3,), 1)]]
    assert [trainer_copies(rank, True) for rank in range(2)] == [[((0,), 4), ((2,), 2)], [((1,), 4), ((3,), 2)]]
    captures = []
    monkeypatch.setattr(moe_module, "prepare_device_clock", lambda device: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", lambda callables, samples: captures.append(
        [getattr(c, "layer", c) for c in callables]))
    model = build_model(cfg.model, Mesh.single(), "cpu", torch.float32, seed=7, **stages.model_kwargs(0))
    replay = RoutingReplay()
    model.replay_routing(replay, 2, trainer_copies(0, False))
    model.graph_moe_layers(2, trainer_copies(0, False))
    assert {i: 1 + len(model.layers[str(i)].mlp.graph_copies) for i in (0, 2)} == {0: 4, 2: 2}
    assert {i: len(replay.slots[i]) for i in (0, 2)} == {0: 4, 2: 2}
    # each chunk captured apart (a capture's graphs share one memory pool, in their call order): never together
    layer0, layer2 = model.layers["0"].mlp, model.layers["2"].mlp
    assert captures == [[layer0]] * 4 + [[layer2]] * 2


@pytest.mark.parametrize("paired", [False, True])
def test_graph_copies_under_zb_h1_are_freed_at_the_input_gradient(paired):
    """Under ZB-H1 a graphed layer's whole backward replays in I (W holds none of its weight gradients), so a copy
    is free again after I: fewer copies than the units in flight until W."""
    schedule = build_schedule("zb_h1", 2, 1, 8, paired=paired)
    copies = [graph_copies(actions) for actions in schedule.ranks]
    assert copies == ([4, 2] if paired else [2, 1])
    assert [in_flight(actions) for actions in schedule.ranks] == ([4, 4] if paired else [2, 2])
    assert [graph_copies(a) for a in build_schedule("all_forward_all_backward", 2, 1, 8).ranks] == [8, 8]


def test_graph_copies_refuse_a_copy_still_held():
    # two in flight, the backwards out of order: micro-batch 2 would replay copy 0 while micro-batch 0 holds it
    order = [Compute(kind, micro_batch, 0) for kind, micro_batch in (("F", 0), ("F", 1), ("B", 1), ("F", 2),
                                                                      ("B", 0), ("B", 2))]
    with pytest.raises(ValueError, match="micro-batch 2's forward comes before micro-batch 0's backward"):
        graph_copies(order)
