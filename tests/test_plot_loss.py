"""benchmarks/plot_loss.py: a run's metrics log as the quick-start table's numbers and the routing-balance check
("no expert below 25% of the mean load from step 50 on"); the loss curve as a PNG, or a message without matplotlib."""

from __future__ import annotations

import importlib.util
import json

from benchmarks.plot_loss import main


def write_run(directory, low_expert_at: dict[int, float]) -> None:
    """60 logged steps of a 2-layer MoE run with 4 experts of 100 copies each, except that at each step in
    ``low_expert_at`` layer 2's expert 3 gets that share of the mean."""
    directory.mkdir()
    with open(directory / "metrics.jsonl", "w") as f:
        for step in range(1, 61):
            low = round(100 * low_expert_at.get(step, 1.0))
            record = {"step": step, "loss": 10.0 - step / 10, "tokens_per_s": 1000.0 * (step > 5) + 10,
                      "tflops_per_gpu": 300.0, "mfu": 0.4 if step > 5 else 0.01, "peak_memory_gib": 50.0 + step / 60,
                      "moe_dead_experts": int(low == 0), "step_time_s": 1.5 - (step > 5),
                      "exposed_comm_ms": {"ep": 100.0 + step, "dp": 1.0},
                      "ep_imbalance": {"1": 1.0, "2": 1.1},
                      "ep_imbalance_micro_batch": {"1": {"mean": 1.2, "max": 2.0}, "2": {"mean": 1.4, "max": 3.0}},
                      "tokens_per_expert": {"1": [100, 100, 100, 100], "2": [100 + 100 - low, 100, 100, low]}}
            if step % 25 == 0:
                record["val_loss"] = 9.0
            f.write(json.dumps(record) + "\n")


def test_a_balanced_run_passes_and_reports_the_table_numbers(tmp_path, capsys):
    write_run(tmp_path / "run", {10: 0.0, 49: 0.1})  # a collapse before step 50 is not checked
    out = tmp_path / "summary.json"
    assert main([str(tmp_path / "run"), "--json", str(out), "--machine", "test"]) == 0
    text = capsys.readouterr().out
    assert "60 steps logged, loss 4.000 after step 60 (val 9.000 at step 50)" in text
    assert "tokens/s 1,010, MFU 0.400 (300 TFLOP/s per GPU; medians after step 5), peak memory 51.0 GiB" in text
    assert "at most 1 dead experts in a step; the last step with an expert under 1% of its layer's mean: 10" in text
    assert ("step 0.500 s, exposed EP 133 ms; EP imbalance 1.05 pooled over a step, 1.30 per micro-batch (mean over "
            "layers, median over steps; the worst micro-batch of the run 3.00)" in text)
    assert "no expert below 25% of mean load from step 50 on: PASS (11 steps;" in text
    summary = json.loads(out.read_text())
    assert summary["machine"] == "test" and summary["runs"][str(tmp_path / "run")]["balanced"] is True


def test_an_expert_below_the_share_after_step_50_fails_naming_where(tmp_path, capsys):
    write_run(tmp_path / "run", {10: 0.0, 55: 0.1, 57: 0.2, 58: 0.3})
    out = tmp_path / "summary.json"
    assert main([str(tmp_path / "run" / "metrics.jsonl"), "--labels", "bias", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert ("bias: 60 steps logged" in text and "FAIL (2 of 11 steps had an expert below, the last at step 57; "
            "lowest 10% of the mean: layer 2 expert 3 at step 55)" in text)
    # where the dips sit, from the first step: step 10's (before the check) and 55's and 57's, all in layer 2
    assert json.loads(out.read_text())["runs"]["bias"]["below_by_layer"] == {"2": 3}
    # the early collapse's end: step 10 starved the expert (0%); 55's 10% is a dip, not starvation
    assert json.loads(out.read_text())["runs"]["bias"]["last_starved_step"] == 10
    assert main([str(tmp_path / "run"), "--min-share", "0.05"]) == 0  # the share is a parameter


def test_a_gzipped_metrics_file_reads_as_the_plain_one(tmp_path, capsys):
    """benchmarks/results keeps the examples' metrics gzipped (``_metrics.jsonl.gz``)."""
    import gzip

    write_run(tmp_path / "run", {55: 0.1})
    packed = tmp_path / "run_metrics.jsonl.gz"
    packed.write_bytes(gzip.compress((tmp_path / "run" / "metrics.jsonl").read_bytes()))
    assert main([str(packed)]) == 1
    assert "FAIL (1 of 11 steps had an expert below, the last at step 55" in capsys.readouterr().out


def test_the_png_or_a_clear_message_without_matplotlib(tmp_path, capsys):
    write_run(tmp_path / "a", {})
    write_run(tmp_path / "b", {})
    assert main([str(tmp_path / "a")]) == 0
    assert "the last step with an expert under 1% of its layer's mean: -" in capsys.readouterr().out
    png = tmp_path / "loss.png"
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--labels", "a,b", "--png", str(png)]) == 0
    text = capsys.readouterr().out
    if importlib.util.find_spec("matplotlib") is None:
        assert not png.exists()
        assert f"matplotlib is not installed (pip install -e '.[plot]'): no PNG written to {png}" in text
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"loss curve: {png}" in text


def test_the_loads_swing_is_measured_by_its_autocorrelation(tmp_path, capsys):
    """An expert whose share swings with a period of 8 steps (and its partner the other way, so the layer's mean
    holds) shows a trough at lag 4; loads that never move are said to; too few steps measure nothing."""
    import math

    from benchmarks.plot_loss import load_swing, swing_line

    def records(shares: list[float]) -> list[dict]:
        return [{"step": step, "tokens_per_expert": {"1": [round(100 * share), round(100 * (2 - share)), 100, 100]}}
                for step, share in enumerate(shares, start=1)]

    swinging = records([1 + 0.6 * math.sin(2 * math.pi * step / 8) for step in range(1, 101)])
    swing = load_swing(swinging, from_step=50)
    assert swing["trough_lag"] == 4 and swing["trough"] < -0.8 and swing["log_share_std"] > 0.2
    steady = load_swing(records([1.0] * 100), from_step=50)  # nothing moves: nothing to correlate
    assert steady["autocorrelation"] is None and steady["log_share_std"] == 0.0
    assert swing_line(steady) == "expert loads' swing from step 50: the loads never moved; log share std 0.00"
    assert load_swing(swinging[:60], from_step=50) is None
    write_run(tmp_path / "run", {})
    main([str(tmp_path / "run")])
    assert "expert loads' swing: not measured (too few steps of loads)" in capsys.readouterr().out
