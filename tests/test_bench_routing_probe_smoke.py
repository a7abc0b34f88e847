"""The routing probe trains its scaled-down model through the Trainer (here on a synthetic Zipf stream, two steps
of one variant) and summarises a run's balance the way plot_loss.py checks it."""

from __future__ import annotations

from benchmarks.routing_probe import VARIANTS, run_variant, summarize


def test_a_variant_runs_and_records_every_layer_each_step():
    run = run_variant("aux1e-2+bias1e-3", *VARIANTS["aux1e-2+bias1e-3"], steps=2, data="synthetic:zipf:1.1")
    assert [row["step"] for row in run["steps"]] == [1, 2]
    for row in run["steps"]:
        assert len(row["min_share"]) == len(row["max_share"]) == 4  # the probe's 4 MoE layers
        assert all(0 <= low <= 1 <= high <= 8 for low, high in zip(row["min_share"], row["max_share"]))  # top-8 of 64
        assert row["aux_loss"] > 0


def test_summary_finds_where_balance_starts_and_holds():
    def row(step, low):
        return {"step": step, "loss": 1.0, "min_share": [0.9, low], "max_share": [1.1, 2.0], "dead_experts": low == 0}

    lows = [0.0, 0.3, 0.1, 0.5, 0.4, 0.3]  # below 0.25 last at step 3
    run = {"variant": "v", "seconds": 1.0, "steps": [row(step, low) for step, low in enumerate(lows, 1)]}
    summary = summarize(run, from_step=2, min_share=0.25)
    assert summary["balanced_from"] == 4
    assert summary["min_share_from_2"] == 0.1 and summary["worst_step"] == 3
    assert summary["steps_with_dead_experts"] == 1
