"""The command line: config errors as one line (no traceback, exit 2), `info` output, `bench --help`, argument
parsing, and what a run prints: where train.init_from's weights came from, and progress a log can read."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moe_overlap.cli import BENCHMARKS, main
from moe_overlap.config import load_config
from tests.long_run import train_argv

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err and "Traceback" not in captured.out, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("moe-overlap: config error: "), err
    return lines[0]


@pytest.mark.parametrize("argv,fragments", [
    (["info", TINY, "model.hiden_size=3"], ["model.hiden_size=3", "did you mean 'hidden_size'"]),
    (["train", TINY, "model.hiden_size=3"], ["model.hiden_size=3", "did you mean 'hidden_size'"]),
    (["train", TINY, "train.recompute_granularity=full", "overlap.overlap_moe_expert_parallel_comm=true"],
     ["overlap.overlap_moe_expert_parallel_comm=True", "not implemented yet"]),
    (["train", TINY, "--nproc", "2", "overlap.overlap_p2p_comm=true"],
     ["overlap.overlap_p2p_comm=True", "no effect without pipeline parallelism"]),
    (["info", TINY, "model.moe_router_topk=9"], ["model.moe_router_topk=9", "model.num_moe_experts=8"]),
    (["info", TINY, "--world-size", "3"], ["parallel.expert_model_parallel_size=2", "world_size"]),
    (["info", TINY, "--world-size", "8"], ["train.global_batch_size=32", "data-parallel size"]),
    (["info", str(ROOT / "configs" / "missing.yaml")], ["missing.yaml", "no such file"]),
    (["info", TINY, "hidden_size=3"], ["override=", "expected section.field=value"]),
], ids=["unknown-field-info", "unknown-field-train", "not-implemented", "no-effect-nproc", "topk",
        "world-ep", "world-batch", "missing-file", "bad-override"])
def test_config_error_is_one_line_exit_2(capsys, argv, fragments):
    assert main(argv) == 2
    line = one_line_error(capsys)
    for fragment in fragments:
        assert fragment in line, line


def test_info_prints_parameters_and_rank_table(capsys):
    assert main(["info", TINY]) == 0
    out = capsys.readouterr().out
    assert "parameters: 1.59 M" in out
    assert "world size 2: data parallel 2, micro-batches per step 2" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank"))
    assert "ep" in lines[header] and "dp" in lines[header]
    rows = [line for line in lines[header + 1:] if line.strip()]
    assert [row.split("|")[0].strip() for row in rows] == ["0", "1"]


def test_info_world_size_and_override_after_option(capsys):
    assert main(["info", TINY, "--world-size", "4", "train.global_batch_size=64"]) == 0
    out = capsys.readouterr().out
    assert "world size 4: data parallel 4, micro-batches per step 2" in out
    header = next(i for i, line in enumerate(out.splitlines()) if line.lstrip().startswith("rank"))
    assert len([line for line in out.splitlines()[header + 1:] if line.strip()]) == 4


@pytest.mark.parametrize("argv,fragment", [
    (["info", TINY, "--bogus"], "unrecognized arguments: --bogus"),
    (["train", TINY, "--nproc", "2", "--max-steps=5"], "unrecognized arguments: --max-steps=5"),
    (["train", TINY, "--nproc", "2", "stray"], "unrecognized arguments: stray"),
    (["info", TINY, "--world-size", "two"], "invalid int value"),
    (["frobnicate", TINY], "invalid choice"),
    ([], "required"),
])
def test_argparse_rejects(capsys, argv, fragment):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err, err


def test_module_entry_point_subprocess():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "moe_overlap", "info", TINY, "train.micro_batch_size=0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "moe-overlap: config error: train.micro_batch_size=0: must be >= 1"]


def test_info_prints_the_validated_config_and_the_data(capsys):
    overrides = ["train.max_steps=7", "data.path=synthetic:zipf:1.5"]
    assert main(["info", TINY, *overrides]) == 0
    out = capsys.readouterr().out
    config_text, data_line = out.split("\ndata: ")[0], out.split("\ndata: ")[1].splitlines()[0]
    assert yaml.safe_load(config_text) == load_config(TINY, overrides).to_dict()  # every field, as train reads it
    assert data_line == ("synthetic:zipf:1.5: Zipf (s=1.5) ids over model.vocab_size=256 from train.seed=1234, "
                         "16,777,216 virtual tokens, the last 0.05 held out for validation")


def test_bench_help_lists_the_benchmarks(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: moe-overlap bench NAME [--nproc N]")
    for name, script in BENCHMARKS.items():
        assert re.search(rf"^  {name} +{script}: \w", out, re.MULTILINE), out
    assert main(["bench"]) == 2
    assert "bench --help lists them" in capsys.readouterr().err
    assert main(["bench", "train", "--nproc"]) == 2
    assert "--nproc (nothing): give a number of ranks >= 1" in capsys.readouterr().err


def test_bench_name_help_shows_the_script_options_without_launching(capfd):
    assert main(["bench", "train", "--help", "--nproc", "2"]) == 0
    out = capfd.readouterr().out
    assert "usage: train_step.py" in out and "--variant" in out and out.count("usage:") == 1  # one process, not 2


SINGLE = ["parallel.expert_model_parallel_size=1"]


def test_init_from_logs_where_the_weights_came_from(tmp_path, caplog):
    assert main(train_argv(tmp_path / "first", *SINGLE, "train.max_steps=1")) == 0
    caplog.set_level(logging.INFO, logger="moe_overlap.training.trainer")
    init_from = f"train.init_from={tmp_path / 'first'}"
    assert main(train_argv(tmp_path / "second", *SINGLE, "train.max_steps=1", init_from)) == 0
    lines = [record.getMessage() for record in caplog.records if "(train.init_from=" in record.getMessage()]
    assert lines == [f"model weights from {tmp_path / 'first' / 'checkpoints' / 'step_00000001'} "
                     f"(train.init_from={tmp_path / 'first'})"]


def test_progress_in_a_log_is_plain_lines_every_log_interval(tmp_path, capsys):
    assert main(train_argv(tmp_path, *SINGLE, "train.max_steps=3", "train.log_interval=2")) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/3", "3/3"], captured.out
    assert all(re.fullmatch(r"step [23]/3 loss=\d+\.\d{3} tok_s=\d+", line) for line in lines), lines
    assert "\r" not in captured.out + captured.err and "mfu" not in captured.out + captured.err  # no MFU on CPU


def test_progress_in_a_terminal_is_a_bar_without_mfu_on_cpu(tmp_path, capsys, monkeypatch):
    for stream in (sys.stdout, sys.stderr):
        monkeypatch.setattr(stream, "isatty", lambda: True)
    assert main(train_argv(tmp_path, *SINGLE, "train.max_steps=2")) == 0
    captured = capsys.readouterr()
    assert "\r" in captured.err and "3/3" not in captured.err and "2/2" in captured.err and "loss=" in captured.err
    assert "mfu" not in captured.err and not [line for line in captured.out.splitlines() if line.startswith("step ")]
