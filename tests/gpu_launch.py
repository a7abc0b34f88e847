"""One torchrun launch of a GPU test module on 2 GPUs (or any number); each rank writes its report as JSON
(``write_report``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.common import MULTICAST_OFF

REPO = Path(__file__).resolve().parents[1]


def write_report(out_dir: str, report: dict) -> None:
    Path(out_dir, f"report_rank{report['rank']}.json").write_text(json.dumps(report))


def bf16_rule(layouts, grads: dict[str, dict], losses: dict[str, list[float]]) -> tuple[int, list[tuple]]:
    """DESIGN.md's bf16 rule for each layout run against ``single_fp32``, beside ``single_bf16``: every gradient
    (normwise) and the loss curve within 2x the single-process bf16 run's own error. Returns the tensors
    compared and the violations (layout, what, its error, the single run's)."""
    from tests.test_master import rel_err

    ref, tensors, violations = grads["single_fp32"], 0, []
    for layout in layouts:
        for key, grad in grads[layout].items():
            layout_err, single_err = rel_err(grad, ref[key]), rel_err(grads["single_bf16"][key], ref[key])
            tensors += 1
            if layout_err > 2 * single_err:
                violations.append((layout, key, layout_err, single_err))
        # The loss curve is one tensor, compared normwise like the gradients: a single step's mean loss carries
        # rounding noise far below bf16's resolution (both errors ~1e-5 relative), so one scalar against
        # another is a coin flip, not a rule.
        curve = torch.tensor(losses["single_fp32"], dtype=torch.float64)
        layout_err, single_err = (float((torch.tensor(losses[name], dtype=torch.float64) - curve).norm())
                                  for name in (layout, "single_bf16"))
        if layout_err > 2 * single_err:
            violations.append((layout, f"loss curve over {len(curve)} steps", layout_err, single_err))
    return tensors, violations


def launch_two_ranks(module_file: str, out_dir: Path, timeout_s: int) -> list[dict]:
    """Run ``module_file`` under torchrun (2 ranks, multicast off; argv[1] = ``out_dir``) and return the ranks'
    reports, printed for the log. Fails (not skips) without 2 GPUs: a GPU test that did not run did not pass."""
    if torch.cuda.device_count() < 2:
        pytest.fail("needs 2 CUDA GPUs")
    return launch_ranks(module_file, out_dir, timeout_s, 2)


def launch_ranks(module_file: str, out_dir: Path, timeout_s: int, world: int) -> list[dict]:
    """The same with ``world`` ranks (one GPU each)."""
    if torch.cuda.device_count() < max(world, 1):
        pytest.fail(f"needs {world} CUDA GPUs")
    env = dict(os.environ, **MULTICAST_OFF, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", module_file,
           str(out_dir)]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    found = [json.loads(p.read_text()) for p in sorted(out_dir.glob("report_rank*.json"))]
    for report in found:
        print(json.dumps(report, indent=1))
    fatal = [line for line in done.stdout.splitlines() if "FATAL" in line or "Error" in line]
    assert len(found) == world, "\n".join(fatal[-20:]) + "\n" + done.stderr[-6000:]
    return found
