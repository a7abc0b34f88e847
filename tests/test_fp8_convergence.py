"""benchmarks/fp8_convergence.py, issue 39's convergence check: an FP8 run's final loss (the mean of the last steps,
and the last validation loss) within twice the gap between two bf16 seeds, or exit status 1 naming the miss."""

from __future__ import annotations

import json

import pytest

from benchmarks.fp8_convergence import main


def write_run(directory, final: float, val: float) -> str:
    """100 steps whose loss falls linearly to ``final`` (the last 50 average to final + 0.245), validated at 50 and
    100 (``val`` last)."""
    directory.mkdir()
    with open(directory / "metrics.jsonl", "w") as f:
        for step in range(1, 101):
            record = {"step": step, "loss": final + (100 - step) / 100}
            if step % 50 == 0:
                record["val_loss"] = val if step == 100 else val + 1
            f.write(json.dumps(record) + "\n")
    return str(directory)


def test_fp8_within_twice_the_bf16_seeds_gap_is_met(tmp_path, capsys):
    bf16 = [write_run(tmp_path / "a", 3.00, 3.10), write_run(tmp_path / "b", 3.10, 3.20)]
    fp8 = [write_run(tmp_path / "fa", 3.15, 3.25), write_run(tmp_path / "fb", 3.05, 3.15)]
    assert main(["--bf16", *bf16, "--fp8", *fp8, "--json", str(tmp_path / "out.json")]) == 0
    check = json.loads((tmp_path / "out.json").read_text())["check"]
    assert check["tail_mean_loss"]["bf16_seeds_gap"] == pytest.approx(0.10, abs=1e-9)
    assert check["tail_mean_loss"]["fp8_gaps"] == [pytest.approx(0.15, abs=1e-9), pytest.approx(0.05, abs=1e-9)]
    assert check["val_loss"]["met"] and "MET" in capsys.readouterr().out


def test_fp8_past_twice_the_gap_on_either_measure_misses(tmp_path, capsys):
    bf16 = [write_run(tmp_path / "a", 3.00, 3.10), write_run(tmp_path / "b", 3.10, 3.20)]
    fp8 = [write_run(tmp_path / "fa", 3.05, 3.35)]  # training loss within, validation 0.25 off (bound 0.20)
    assert main(["--bf16", *bf16, "--fp8", *fp8, "--json", str(tmp_path / "out.json")]) == 1
    check = json.loads((tmp_path / "out.json").read_text())["check"]
    assert check["tail_mean_loss"]["met"] and not check["val_loss"]["met"]
    assert "val_loss: FP8 against bf16 0.2500" in capsys.readouterr().out
