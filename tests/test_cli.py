"""The command line: config errors as one line (no traceback, exit 2), `info` output, argument parsing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_overlap.cli import main

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
    (["train", TINY, "parallel.pipeline_model_parallel_size=2", "overlap.overlap_moe_expert_parallel_comm=true"],
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
