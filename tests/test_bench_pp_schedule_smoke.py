"""The pipeline-schedule benchmark end to end on CPU at PP=2 (two gloo ranks), its measures on simulated steps
whose transfers are known, and its refusal of a bad config before any rank starts."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.pp_schedule import EXPOSED_P2P_TARGET, main, step_measures, summary_rows
from moe_overlap.training.schedules import Compute, build_schedule, simulate

TINY = ["model.num_layers=4", "train.micro_batch_size=1", "train.global_batch_size=4"]


def pp_schedule_case(json_path: str) -> list[dict]:
    return main([*TINY, "--schedules", "1f1b", "zb_h1", "--rounds", "2", "--block", "2", "--json", json_path])


def test_two_ranks_measure_every_variant_against_its_prediction(rank_pool, tmp_path):
    path = tmp_path / "pp.json"
    rows = rank_pool(2).run(pp_schedule_case, str(path))[0]
    saved = json.loads(path.read_text())
    assert saved["world_size"] == 2 and saved["fabric"] == "nvlink" and saved["rounds_run"] == 2
    assert saved["p2p_latency_ms"] > 0 and saved["targets"]["p2p_exposed_fraction_max"] == EXPOSED_P2P_TARGET
    variants = [row for row in saved["rows"] if row["row"] == "variant"]
    assert [row["variant"] for row in variants] == ["1f1b", "1f1b+p2p_overlap", "zb_h1", "zb_h1+p2p_overlap"]
    for row in variants:
        assert row["steps"] == 2 and 0 < row["steps_used"] <= 2, row  # 2 rounds x (block 2 - the first)
        assert row["step_ms"] > 0 and row["step_ms_predicted"] > 0
        for name in ("bubble_measured", "bubble_predicted", "bubble_replayed"):
            assert 0 < row[name] < 1, (name, row[name])
        assert math.isclose(row["bubble_rel_diff"], abs(row["bubble_measured"] - row["bubble_predicted"])
                            / row["bubble_predicted"])
        # what the transfers add: finite, and less than the step (whose computes are in it too)
        assert math.isfinite(row["p2p_exposed_ms"]) and row["p2p_exposed_fraction"] < 1
        kinds = {"F0", "I0", "W0"} if row["schedule"] == "zb_h1" else {"F0", "B0"}
        for costs in row["costs_ms_per_rank"]:  # both ranks: every compute kind and some posts, all timed
            assert kinds <= set(costs) and any(key.startswith("post ") for key in costs), costs
            assert all(value >= 0 for value in costs.values())
        assert len(row["peak_mib_per_rank"]) == 2 and min(row["peak_mib_per_rank"]) > 0
    contended = {row["variant"]: row["contended"] for row in variants}
    assert all(row["contended"] == (row["steps_uncontended"] < 3) for row in variants)  # 2 steps: always, here

    def judged(entry: dict, met: bool, *names: str) -> bool:
        """met as computed, or null (with the reason) where a row compared ran on a contended CPU"""
        if any(contended[name] for name in names):
            return entry["met"] is None and "fewer than 3 uncontended steps" in entry["why"]
        return entry["met"] is met

    summary = [row for row in saved["rows"] if row["row"] == "summary"]
    exposed = [row for row in summary if "p2p_exposed_fraction" in row]
    assert [row["variant"] for row in exposed] == ["1f1b+p2p_overlap", "zb_h1+p2p_overlap"]  # overlap on only
    assert all(judged(row, row["p2p_exposed_fraction"] < EXPOSED_P2P_TARGET, row["variant"]) for row in exposed)
    bubbles = [row for row in summary if "rel_diff" in row]
    assert len(bubbles) == 4 and all(judged(row, row["rel_diff"] <= 0.15, row["variant"]) for row in bubbles)
    zb = [row for row in summary if row["target"].startswith("ZB-H1")]
    assert [row["variant"] for row in zb] == ["zb_h1", "zb_h1+p2p_overlap"]
    assert all(judged(row, row["speedup_vs_1f1b"] > 1 and row["peak_memory_vs_1f1b"] <= 1, row["variant"],
                      row["variant"].replace("zb_h1", "1f1b")) for row in zb)
    assert len(rows) == len(saved["rows"])


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_exposed_p2p_is_what_transfers_add_to_a_step(overlap):
    """A step simulated with a known latency, taken as measured: with instant transfers nothing is exposed; with
    latency, at least one transfer (the first activation's) is; the overlapped lists expose less of it."""
    cost = {"F": 1.0, "B": 2.0}

    def exposed(latency: float, overlapped: bool) -> dict:
        schedule = build_schedule("1f1b", 2, 1, 8, overlap_p2p=overlapped)
        durations = [{a: cost[a.kind] if isinstance(a, Compute) else 0.0 for a in actions}
                     for actions in schedule.ranks]
        timeline = simulate(schedule, lambda rank, a: durations[rank][a], latency)
        return step_measures(schedule, timeline, durations, latency)

    assert exposed(0.0, overlap)["p2p_exposed"] == 0.0
    slow = exposed(0.25, overlap)
    assert slow["p2p_exposed"] >= 0.25 and slow["bubble_replayed"] == pytest.approx(slow["bubble"])
    if overlap:
        assert slow["p2p_exposed"] < exposed(0.25, False)["p2p_exposed"]


def test_a_bad_variant_config_is_one_line_before_any_rank_starts(capsys):
    with pytest.raises(SystemExit) as info:
        main(["model.num_layers=2", "--schedules", "interleaved_1f1b"])  # 2 layers over PP=2 x VPP=2
    message = str(info.value)
    assert message.startswith("pp_schedule: model.num_layers=2: must be divisible") and "\n" not in message


def test_a_speed_up_without_a_shared_round_is_the_ratio_of_medians():
    """On a loaded CPU the steps in use of two variants may come from different rounds."""
    base = {"row": "variant", "overlap_p2p_comm": False, "bubble_rel_diff": 0.0, "peak_mib_per_rank": [2.0, 1.0],
            "contended": False}
    rows = [dict(base, variant="1f1b", step_ms=10.0, step_ms_by_round={0: 10.0}),
            dict(base, variant="zb_h1", step_ms=8.0, step_ms_by_round={1: 8.0})]
    (zb,) = [row for row in summary_rows(rows) if row["target"].startswith("ZB-H1")]
    assert zb["speedup_vs_1f1b"] == 1.25 and zb["rounds"] == 0 and zb["met"] is True
