"""``overlap.overlap_moe_expert_parallel_comm``: one micro-batch's forward interleaved segment by segment with
another's backward (training/microbatch_overlap.py, run by the one executor): at PP=1 micro-batch i's backward
with micro-batch i+1's forward; under PP the steady state's pairs of 1F1B, interleaved 1F1B and ZB-H1.

On equals off: every layout reproduces the single-process losses and gradients within 1e-5 normwise (fp32,
gloo) -- EP=2 and EP=4, 2/3/4/8 micro-batches per rank, dense and MoE layers mixed, host and device planning,
chunks, capacity (dropping and padded), the shared expert, expert-TP, TP with sequence parallelism, the
distributed optimizer with both overlaps; PP=2 x EP=2 under each paired schedule equals the same layout off.
The paired schedules keep their unpaired bubble; the recorded order shows the interleaving; bad settings are
one line.
"""

from __future__ import annotations

import pytest

from moe_overlap.config import ConfigError, load_config, validate_for_world
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.training.schedules import (Compute, Pair, Schedule, ScheduleError, build_schedule, in_flight,
                                            in_flight_bound, simulate, validate)
from moe_overlap.training.trainer import Trainer
from tests.test_master import CPU, TOL, rel_err, small_config, world_and_mesh
from tests.test_pipeline import LAYERS, check, pipeline_case, pp_layout, unit_costs

TINY = "configs/tiny.yaml"
ON = {"overlap.overlap_moe_expert_parallel_comm": "true"}
PIPELINE = {**ON, "overlap.moe_pipeline": "true"}
DIST_OPT = {"train.use_distributed_optimizer": "true", "overlap.overlap_grad_sync": "true",
            "overlap.overlap_param_sync": "true", "overlap.bucket_size_mb": 0.01}


def layout(ep: int, **extra) -> dict:
    return pp_layout(1, **{"parallel.expert_model_parallel_size": ep, **PIPELINE, **extra})


@pytest.mark.parametrize("config,overrides,fragment", [
    (None, [], "needs MoE layers"),  # the defaults: a dense model
    (TINY, ["parallel.pipeline_model_parallel_size=2", "train.pipeline_schedule=all_forward_all_backward"],
     "all_forward_all_backward has none to pair"),
    (TINY, ["train.recompute_granularity=full"], "not implemented yet (with train.recompute_granularity='full'"),
    (TINY, ["overlap.moe_pipeline=false"], "needs overlap.moe_pipeline=true with more than one EP or expert-TP rank"),
])
def test_bad_setting_is_one_line_naming_the_field(config, overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(config, ["overlap.overlap_moe_expert_parallel_comm=true", *overrides])
    message = str(err.value)
    assert message.startswith("overlap.overlap_moe_expert_parallel_comm=True: ")
    assert fragment in message and "\n" not in message, message


@pytest.mark.parametrize("transport, global_batch, paired", [("nccl", 32, True), ("nccl", 8, False),
                                                              ("sm_push", 32, False), ("copy_engine", 32, False)])
def test_auto_pairs_where_the_exchange_runs_over_nccl(monkeypatch, transport, global_batch, paired):
    """``auto`` on a CUDA config of few large experts is left to the fabric: the trainer pairs where the exchange it
    would run goes over NCCL (no peer copies) with micro-batches to pair (4 or 1 here, at micro-batch 8)."""
    import torch

    from moe_overlap.training import run_setup

    cfg = load_config(TINY, ["train.device=cuda", f"train.global_batch_size={global_batch}"])
    assert cfg.overlap.overlap_moe_expert_parallel_comm == "auto"
    asked = []
    monkeypatch.setattr(run_setup, "exchange_choice", lambda *args: asked.append(args[:2]) or ("host", transport, ""))
    run_setup.resolve_by_fabric(cfg, Mesh.single(), torch.device("cpu"))
    assert cfg.overlap.overlap_moe_expert_parallel_comm is paired
    assert asked == [("auto", "auto")]  # the config's own planning and transport, resolved by the fabric


def test_one_micro_batch_per_step_is_refused_with_the_world_size():
    on = ["overlap.overlap_moe_expert_parallel_comm=true", "overlap.moe_pipeline=true"]
    validate_for_world(load_config(TINY, on), 2, "cpu")  # 32 = 2 micro-batches of 8 x DP=2
    cfg = load_config(TINY, [*on, "train.global_batch_size=16"])
    with pytest.raises(ConfigError, match=r"^overlap.overlap_moe_expert_parallel_comm=True: pairs micro-batches: "
                                          r"train.global_batch_size=16 gives 1 per data-parallel rank"):
        validate_for_world(cfg, 2, "cpu")


@pytest.mark.parametrize("both", [{}, {"train.expert_wgrad_micro_batches": 2}], ids=["plain", "expert_wgrad_pairs"])
def test_one_rank_is_bit_identical_to_plain_accumulation_and_interleaves(tmp_path, monkeypatch, both):
    """EP=1 (no exchange: each layer is attention | MLP): the same floating-point operations in another order,
    so bit-identical losses and gradients (also with the experts' weight gradients summed in pairs, which follow
    the backward order); the order alternates B(i) and F(i+1) stage by stage."""
    from moe_overlap.layers.experts import ExpertWgradGroups

    taken = []  # micro-batches per weight-gradient call of the paired experts
    take = ExpertWgradGroups.take
    monkeypatch.setattr(ExpertWgradGroups, "take", lambda self, inputs: taken.append(take(self, inputs)) or taken[-1])
    runs = []
    for extra in ({}, ON):
        cfg = small_config(str(tmp_path), 1, 8, **LAYERS, **both, **extra)  # 4 micro-batches of 2
        trainer = Trainer(cfg, Mesh.single(), CPU)
        grads = {}
        metrics = [trainer.train_step(lambda opt: grads.update(opt.logical_grads())) for _ in range(2)]
        runs.append(([(m["loss"], m["aux_loss"], m["grad_norm"], m["tokens_per_expert"]) for m in metrics], grads,
                     trainer.stage_order))
    (off, off_grads, _), (on, on_grads, order) = runs
    if both:  # 4 micro-batches, 3 MoE layers, 2 steps: two pairs per layer and step, in both runs
        assert [len(t) for t in taken if t is not None] == [2] * 24
    assert on == off
    assert all((on_grads[k] == off_grads[k]).all() for k in off_grads)
    stages = ["embedding"] + [f"{i}.{s}" for i in range(4) for s in ("attention", "mlp")] + ["head"]
    want = [("F", 0, s) for s in stages]
    for i in range(1, 4):
        for k in range(len(stages)):
            want += [("B", i - 1, stages[-1 - k]), ("F", i, stages[k])]
    want += [("B", 3, s) for s in reversed(stages)]
    assert order == want


def order_case(output_dir: str) -> list:
    cfg = small_config(output_dir, 2, 8, **LAYERS, **PIPELINE)
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        trainer.train_step()
        return trainer.stage_order
    finally:
        mesh.destroy()


def test_ep2_splits_moe_layers_at_their_exchanges_and_interleaves(rank_pool, tmp_path):
    """Between F(i+1)'s stage that starts an exchange and its stage that waits for it, a stage of B(i) runs (and
    the other way round): MoE layers run as attention (dispatch started) | experts (combine started) | combine."""
    order = rank_pool(2).run(order_case, str(tmp_path))[0]
    names = [name for kind, mb, name in order if (kind, mb) == ("F", 0)]
    assert names == ["embedding", "0.attention", "0.experts", "0.combine", "1.attention", "1.mlp", "2.attention",
                     "2.experts", "2.combine", "3.attention", "3.experts", "3.combine", "head"]
    n = len(names)  # 2 micro-batches per rank (DP=2): F(0) alone, B(0) with F(1), B(1) alone
    assert order[n:3 * n] == [step for k in range(n) for step in (("B", 0, names[-1 - k]), ("F", 1, names[k]))]
    assert order[3 * n:] == [("B", 1, name) for name in reversed(names)]


def test_ep2_matches_single_process(rank_pool, tmp_path):
    """EP=2 x DP=2 over 2 ranks; 2, 3 and 8 micro-batches per rank."""
    variants = {
        "host": layout(2, **{"overlap.moe_planning": "host"}),
        "device_chunks2_delay_wgrad": layout(2, **{"overlap.moe_planning": "device", "overlap.moe_pipeline_chunks": 2,
                                                   "overlap.delay_wgrad_compute": "true"}),
        "host_dist_opt": layout(2, **DIST_OPT),
    }
    check(rank_pool(2).run(pipeline_case, str(tmp_path), 4, 2, variants))
    three = {"host_chunks2": layout(2, **{"overlap.moe_pipeline_chunks": 2}),
             "device_dist_opt": layout(2, **{"overlap.moe_planning": "device", **DIST_OPT})}
    check(rank_pool(2).run(pipeline_case, str(tmp_path), 6, 1, three))
    check(rank_pool(2).run(pipeline_case, str(tmp_path), 16, 1, {"host": variants["host"]}))


def test_ep2_capacity_and_shared_expert_match_single_process(rank_pool, tmp_path):
    shared = {"model.moe_shared_expert_intermediate_size": 16}
    check(rank_pool(2).run(pipeline_case, str(tmp_path), 4, 1,
                           {"shared": layout(2, **{"overlap.moe_planning": "device"})}, shared))
    dropping = {"model.moe_expert_capacity_factor": 1.0}
    check(rank_pool(2).run(pipeline_case, str(tmp_path), 6, 1, {"capacity": layout(2)}, dropping))
    padded = {"model.moe_expert_capacity_factor": 1.0, "model.moe_pad_expert_input_to_capacity": "true"}
    check(rank_pool(2).run(pipeline_case, str(tmp_path), 4, 1,
                           {"padded_device": layout(2, **{"overlap.moe_planning": "device"})}, padded))


def test_ep4_expert_tp_and_tp_match_single_process(rank_pool, tmp_path):
    """4 ranks: EP=4 (4 micro-batches per rank), EP=2 x expert-TP=2, TP=2 (sequence parallel) x EP=2."""
    variants = {
        "ep4_device": layout(4, **{"overlap.moe_planning": "device"}),
        "ep2_etp2": layout(2, **{"parallel.expert_tensor_parallel_size": 2}),
        "tp2_ep2_overlapped": layout(2, **{"parallel.tensor_model_parallel_size": 2,
                                           "parallel.sequence_parallel": "true",
                                           "parallel.expert_tensor_parallel_size": 1,
                                           "overlap.tp_comm_overlap": "true", "overlap.tp_comm_overlap_ag": "true",
                                           "overlap.tp_comm_overlap_rs": "true"}),
    }
    both = {"model.num_query_groups": 4, "train.adam_eps": 1e-4}  # as the TP cases in test_master.py
    check(rank_pool(4).run(pipeline_case, str(tmp_path), 16, 1, {"ep4_device": variants.pop("ep4_device")}, both))
    check(rank_pool(4).run(pipeline_case, str(tmp_path), 8, 1, variants, both))


# ----------------------------------------------------------------------------------- paired schedules


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)])
@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (3, 6), (4, 16)])
def test_paired_schedules_pair_independent_units_and_keep_the_bubble(name, vpp, pp, m):
    """Every steady-state forward runs beside another unit's backward; the bubble stays the unpaired schedule's
    (from 2 PP micro-batches on; ZB-H1 with overlapped transfers, as it needs unpaired) at up to 2 (PP - rank)
    micro-batches in flight (1F1B), one more (interleaved), 2 PP (ZB-H1)."""
    if vpp > 1 and m % pp:
        pytest.skip(f"virtual stages take micro-batches in groups of PP={pp}; {m} is not a multiple")
    for overlap, batch in ((False, False), (False, True), (True, False)):
        paired = build_schedule(name, pp, vpp, m, overlap, batch, paired=True)  # validates: raises on any fault
        plain = build_schedule(name, pp, vpp, m, overlap, batch)
        for rank, actions in enumerate(paired.ranks):
            pairs = [a for a in actions if isinstance(a, Pair)]
            assert len(pairs) >= m * vpp - in_flight_bound(name, pp, vpp, m, rank, paired=True)
            assert all(p.forward.micro_batch != p.backward.micro_batch or p.forward.chunk != p.backward.chunk
                       for p in pairs)
            assert in_flight(actions) <= in_flight_bound(name, pp, vpp, m, rank, paired=True)
        if m >= 2 * pp and (overlap or name != "zb_h1"):
            assert simulate(paired, unit_costs(vpp)).bubble() == pytest.approx(
                simulate(plain, unit_costs(vpp)).bubble(), abs=1e-12)
    assert max(in_flight(a) for a in paired.ranks) == {"1f1b": min(m, 2 * pp), "zb_h1": min(m, 2 * pp),
                                                       "interleaved_1f1b": min(m * vpp, 2 * pp - 1 + (vpp - 1) * pp + 1)
                                                       }[name]


def test_one_stage_paired_schedule_is_plain_accumulation_paired():
    """PP=1: 1F1B is F0 B0 F1 B1 ...; paired, F0 alone, then B(i) beside F(i+1), then the last B alone."""
    assert [str(a) for a in build_schedule("1f1b", 1, 1, 4).ranks[0]] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3",
                                                                         "B3"]
    assert [str(a) for a in build_schedule("1f1b", 1, 1, 4, paired=True).ranks[0]] == ["F0", "F1+B0", "F2+B1",
                                                                                       "F3+B2", "B3"]
    with pytest.raises(ScheduleError, match="nothing to pair"):
        build_schedule("all_forward_all_backward", 2, 1, 4, paired=True)


def test_validation_refuses_a_pair_of_one_unit():
    good = build_schedule("1f1b", 1, 1, 4, paired=True)
    bad = (Compute("F", 0, 0), Pair(Compute("F", 1, 0), Compute("B", 1, 0)), Compute("B", 0, 0),
           Compute("F", 2, 0), Compute("B", 2, 0), Compute("F", 3, 0), Compute("B", 3, 0))
    with pytest.raises(ScheduleError, match="must pair a forward with another unit's B or I"):
        validate(Schedule(good.name, 1, 1, 4, False, False, (bad,), True))


def test_info_schedule_shows_the_paired_schedule(capsys):
    from moe_overlap.cli import main
    assert main(["info", "configs/tiny.yaml", "parallel.pipeline_model_parallel_size=2", "overlap.moe_pipeline=true",
                 "overlap.overlap_moe_expert_parallel_comm=true", "train.global_batch_size=64", "--schedule", "--costs",
                 "F=1,B=2"]) == 0  # world 4 (PP x EP), DP=2: 4 micro-batches of 8
    out = capsys.readouterr().out
    assert "1f1b: PP=2 VPP=1 micro-batches=4" in out and "paired (overlap_moe_expert_parallel_comm)" in out
    assert "rank 0 order: F0 F1 F2 F3+B0 B1 B2 B3" in out and "rank 1 order: F0 F1+B0 F2+B1 F3+B2 B3" in out
    assert "bubble (mean over ranks): 0.2000" in out  # 1F1B's (PP - 1) / (m + PP - 1)


# ------------------------------------------------------------------------------ paired under PP, same math


def on_off_case(output_dir: str, micro_batches: int, steps: int, layouts: dict[str, dict]) -> dict[str, dict]:
    """Each layout with the switch off and on, step by step: the worst relative error of on against off (losses,
    gradient norm, every gradient), and the on run's schedule and segment order of its last step."""
    out = {}
    for name, layout in layouts.items():
        runs = []
        for extra in ({}, ON):
            cfg = small_config(output_dir, int(layout["parallel.expert_model_parallel_size"]), 2 * micro_batches,
                               **LAYERS, **layout, **extra)
            _, mesh = world_and_mesh(cfg)
            try:
                trainer = Trainer(cfg, mesh, CPU)
                metrics = []
                for _ in range(steps):
                    grads = {}
                    metrics.append((trainer.train_step(lambda opt: grads.update(opt.logical_grads())), grads))
                computes = [str(a) for a in trainer.pipeline.schedule.computes(mesh.pp.rank)]
                runs.append((metrics, computes, trainer.stage_order))
            finally:
                mesh.destroy()
        (off, _, _), (on, computes, order) = runs
        worst = 0.0
        for (m_off, g_off), (m_on, g_on) in zip(off, on):
            assert m_on["tokens_per_expert"] == m_off["tokens_per_expert"] and sorted(g_on) == sorted(g_off), name
            worst = max(worst, *(abs(m_on[k] - m_off[k]) / abs(m_off[k]) for k in ("loss", "aux_loss", "grad_norm")),
                        *(rel_err(g_on[k], g_off[k]) for k in g_off))
        out[name] = {"worst": worst, "computes": computes, "order": order}
    return out


def test_pp2_ep2_paired_equals_unpaired(rank_pool, tmp_path):
    """4 ranks, PP=2 x EP=2 (DP=2), 8 micro-batches per pipeline, the distributed optimizer with both overlaps:
    1F1B with the MoE layers' delayed weight gradients (host-planned), interleaved 1F1B over VPP=2 (device-planned,
    overlapped P2P), ZB-H1 (its deferred weight gradients; 2 exchange chunks). Each pair alternates the two
    micro-batches' segments, the MoE layers cut at their exchanges."""
    common = {"parallel.expert_model_parallel_size": 2, "overlap.moe_pipeline": "true", **DIST_OPT}
    layouts = {
        "1f1b_delay_wgrad": pp_layout(2, **common, **{"overlap.moe_planning": "host",
                                                      "overlap.delay_wgrad_compute": "true"}),
        "interleaved_vpp2_device": pp_layout(2, vpp=2, **common, **{"overlap.moe_planning": "device",
                                                                     "overlap.overlap_p2p_comm": "true"}),
        "zb_h1_chunks2": pp_layout(2, "zb_h1", **common, **{"overlap.overlap_p2p_comm": "true",
                                                            "overlap.moe_pipeline_chunks": 2}),
    }
    per_rank = rank_pool(4).run(on_off_case, str(tmp_path), 16, 2, layouts)
    for got in per_rank:
        for name, result in got.items():
            assert result["worst"] < TOL, (name, result["worst"])
    # 1F1B: stage 0 (global ranks 0, 1) runs 3 forwards ahead, stage 1 (global ranks 2, 3; the last) one.
    for rank, warm, names in ((0, 3, ["embedding", "0.attention", "0.experts", "0.combine", "1.attention", "1.mlp",
                                      "stage0.output"]),
                              (2, 1, ["2.attention", "2.experts", "2.combine", "3.attention", "3.experts",
                                      "3.combine", "head"])):
        result = per_rank[rank]["1f1b_delay_wgrad"]
        assert result["computes"] == ([f"F{i}" for i in range(warm)] + [f"F{i + warm}+B{i}" for i in range(8 - warm)]
                                      + [f"B{i}" for i in range(8 - warm, 8)])
        order, n = result["order"], len(names)
        assert [name for kind, mb, name in order if (kind, mb) == ("F", 0)] == names
        assert order[warm * n:(warm + 2) * n] == [step for k in range(n) for step in (
            ("B", 0, names[-1 - k]), ("F", warm, names[k]))]
    assert any("+" in c for c in per_rank[0]["interleaved_vpp2_device"]["computes"])
    assert any(c.startswith("F") and "+I" in c for c in per_rank[2]["zb_h1_chunks2"]["computes"])


# ------------------------------------------------------------------- pairs run whole (graphed MoE layers' path)


def whole_pairs_case(output_dir: str) -> dict:
    """PP=2 (1F1B, 4 micro-batches; EP=1 over 2 ranks): unpaired, then paired with each pair's halves whole
    (PairStreams, as graphed MoE layers run pairs on two CUDA streams; on the CPU one stream: the executor's order,
    its transfers posted and waited one by one on their micro-batches' streams, its loss sums). Every rank's
    worst relative error of the paired run against the unpaired one (losses, every gradient) and its order."""
    from moe_overlap.training.microbatch_overlap import PairStreams

    runs = []
    for extra in ({}, ON):
        cfg = small_config(output_dir, 1, 8, **LAYERS, **pp_layout(2), **extra)
        _, mesh = world_and_mesh(cfg)
        try:
            trainer = Trainer(cfg, mesh, CPU)
            if extra:  # what graphed MoE layers choose on a GPU (train.moe_cuda_graph, CUDA only)
                trainer.pipeline.pair_streams = PairStreams(CPU)
            steps = []
            for _ in range(2):
                grads = {}
                steps.append((trainer.train_step(lambda opt: grads.update(opt.logical_grads())), grads))
            runs.append((steps, trainer.stage_order))
        finally:
            mesh.destroy()
    (off, _), (on, order) = runs
    worst = 0.0
    for (m_off, g_off), (m_on, g_on) in zip(off, on):
        assert sorted(g_on) == sorted(g_off)
        worst = max(worst, *(abs(m_on[k] - m_off[k]) / abs(m_off[k]) for k in ("loss", "aux_loss", "grad_norm")),
                    *(rel_err(g_on[k], g_off[k]) for k in g_off))
    return {"worst": worst, "order": [f"{kind}{mb}" for kind, mb, _ in order], "names": {n for _, _, n in order}}


def test_pairs_run_whole_equal_unpaired_under_pp(rank_pool, tmp_path):
    """The executor's path for graphed MoE layers, paired: each pair's forward, then its backward, each whole (one
    segment, named as the stage), in the paired 1F1B's order (stage 0 three forwards ahead, the last stage one),
    with the same losses and gradients as unpaired 1F1B."""
    first, last = rank_pool(2).run(whole_pairs_case, str(tmp_path))
    for got in (first, last):
        assert got["worst"] < TOL, got["worst"]
    assert first["names"] == {"stage0"} and last["names"] == {"stage1"}
    assert first["order"] == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert last["order"] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]


def test_the_switch_is_read_at_each_step(tmp_path):
    """``overlap_moe_expert_parallel_comm`` turned between steps of one trainer (as benchmarks/ep_microbatch_overlap.py
    turns it) changes the schedule the next step runs: off records no paired segments and runs unpaired 1F1B."""
    cfg = small_config(str(tmp_path), 1, 8, **LAYERS, **ON)  # 4 micro-batches of 2
    trainer = Trainer(cfg, Mesh.single(), CPU)
    for paired in (True, False, True):
        cfg.overlap.overlap_moe_expert_parallel_comm = paired
        trainer.train_step()
        assert trainer.pipeline.schedule.paired is paired
        assert bool(trainer.stage_order) is paired
        assert any(isinstance(a, Pair) for a in trainer.pipeline.schedule.ranks[0]) is paired
