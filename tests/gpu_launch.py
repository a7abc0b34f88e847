"""What the GPU tests (`pytest -m gpu`) share: how many GPUs a test gets, one torchrun launch of a test module's
per-rank worker, the JSON report each rank writes, the bf16 rule, and the CPU dry-run.

GPU counts: with no GPU visible a GPU test fails (a GPU test that did not run did not pass); a test or layout
that needs more ranks than there are GPUs is skipped with both counts in its reason (the one allowed skip).

Dry-run (``MOE_GPU_TEST_DRYRUN=1`` in a worker's environment; ``launch_ranks(..., dry_run=True)`` sets it): the
workers that support it join with gloo on the CPU instead of NCCL on GPUs, in the same precision, and skip what
only CUDA runs (the library's own device check, :func:`cpu_skip_reason`), so that the layouts' building and
wiring can be checked at 2 and 4 ranks without a GPU, e.g.
``MOE_GPU_TEST_DRYRUN=1 torchrun --nproc-per-node 4 tests/test_gpu_master.py OUTDIR``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from benchmarks.common import MULTICAST_OFF

REPO = Path(__file__).resolve().parents[1]
DRYRUN_ENV = "MOE_GPU_TEST_DRYRUN"


def dry_run() -> bool:
    return os.environ.get(DRYRUN_ENV) == "1"


def require_gpus(count: int) -> None:
    """Fail without any GPU; skip, naming both counts, with fewer than ``count``."""
    visible = torch.cuda.device_count()
    if visible == 0:
        pytest.fail("no CUDA GPU is visible (a GPU test that did not run did not pass)")
    if visible < count:
        pytest.skip(f"needs {count} GPUs, {visible} visible")


def require_fp8_gpu() -> None:
    """Fail, not skip, without a CUDA GPU with FP8 tensor cores (a GPU test that did not run did not pass)."""
    if not torch.cuda.is_available():
        pytest.fail("no CUDA GPU is visible (a GPU test that did not run did not pass)")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.fail(f"{torch.cuda.get_device_name()} has no FP8 tensor cores (a GPU test that did not run did not "
                    "pass)")


def ranks_for_every_gpu(limit: int = 8) -> int:
    """One rank per visible GPU, at most ``limit``, rounded down to a power of two (so the ranks divide the
    tests' 8 experts and their batches); fails without a GPU."""
    require_gpus(1)
    return 1 << (min(torch.cuda.device_count(), limit).bit_length() - 1)


def write_report(out_dir: str, report: dict) -> None:
    """This rank's report (rewritten as cases finish: a rank that dies still reports the cases before)."""
    path = Path(out_dir, f"report_rank{report['rank']}.json")
    path.with_suffix(".tmp").write_text(json.dumps(report))
    path.with_suffix(".tmp").replace(path)


def init_worker(timeout_s: float = 120) -> torch.device:
    """Join torchrun's job from a worker: NCCL with one GPU per rank, or gloo on the CPU under the dry-run. A
    worker stopped by torchrun (a launch past its time) prints every thread's stack first: where it hung."""
    import torch.distributed as dist

    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    if dry_run():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s))
    return device


def worker_device_type() -> str:
    """``train.device`` of a worker's configs: cuda, or cpu under the dry-run."""
    return "cpu" if dry_run() else "cuda"


def cpu_skip_reason(cfg, world: int) -> str | None:
    """Under the dry-run, why ``cfg`` cannot run on the CPU (CUDA graphs, symmetric memory, NCCL's CTA caps,
    the GEMM carve-out: the library's own check, one line); None if it can, or outside the dry-run."""
    from moe_overlap.config import ConfigError, validate_for_world

    if not dry_run():
        return None
    try:
        validate_for_world(cfg, world, "cpu")
    except ConfigError as err:
        return f"dry-run on CPU: {err}"
    return None


def step_queued_without_host_sync(trainer) -> dict:
    """One training step whose launch may not sync with the host (``set_sync_debug_mode("error")`` around
    ``launch_step``: a sync raises); its metrics, read after."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = trainer.launch_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return trainer.finish_step(pending)


def train_side_by_side(runs: dict, steps: int) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """``steps`` optimizer steps of every trainer in ``runs``, one step of each in turn: each run's losses and its
    first step's gradients by logical name (what :func:`bf16_rule` compares)."""
    losses, grads = {name: [] for name in runs}, {}
    for step in range(steps):
        for name, trainer in runs.items():
            captured = {}
            losses[name].append(trainer.train_step(lambda opt, captured=captured: captured.update(
                opt.logical_grads()))["loss"])
            if step == 0:
                grads[name] = captured
    return losses, grads


def bf16_rule(layouts, grads: dict[str, dict], losses: dict[str, list[float]] | None,
              single: str | dict[str, str] = "single_bf16") -> tuple[int, list[tuple]]:
    """The bf16 rule for each layout run against ``single_fp32``, beside ``single``: every gradient (normwise)
    and the loss curve (unless ``losses`` is None) within 2x the single-process run's own error (bf16's; an FP8
    layout's, its recipe's single run: ``single`` maps each layout to it). Returns the tensors compared and the
    violations (layout, what, its error, the single run's)."""
    from tests.test_master import rel_err

    ref, tensors, violations = grads["single_fp32"], 0, []
    for layout in layouts:
        own = single if isinstance(single, str) else single[layout]
        for key, grad in grads[layout].items():
            layout_err, single_err = rel_err(grad, ref[key]), rel_err(grads[own][key], ref[key])
            tensors += 1
            if layout_err > 2 * single_err:
                violations.append((layout, key, layout_err, single_err))
        if losses is None:
            continue
        # The loss curve is one tensor, compared normwise like the gradients: a single step's mean loss carries
        # rounding noise far below bf16's resolution (both errors ~1e-5 relative), so one scalar against
        # another is a coin flip, not a rule.
        curve = torch.tensor(losses["single_fp32"], dtype=torch.float64)
        layout_err, single_err = (float((torch.tensor(losses[name], dtype=torch.float64) - curve).norm())
                                  for name in (layout, own))
        if layout_err > 2 * single_err:
            violations.append((layout, f"loss curve over {len(curve)} steps", layout_err, single_err))
    return tensors, violations


def launch_ranks(module_file: str, out_dir: Path, timeout_s: int, world: int, dry_run: bool = False) -> list[dict]:
    """Run ``module_file`` under torchrun with ``world`` ranks (one GPU each, NVLink multicast off; argv[1] =
    ``out_dir``) and return the ranks' reports, printed for the log. Skips with fewer GPUs (fails with none);
    ``dry_run``: gloo ranks on the CPU instead, any ``world``. After ``timeout_s`` torchrun is stopped (it stops
    its ranks; they stay in this process group, so a ``timeout`` around pytest reaches them too). When the job did
    not end cleanly, every report carries its output's tail under ``launch_tail``."""
    if not dry_run:
        require_gpus(world)
    env = dict(os.environ, **MULTICAST_OFF, PYTHONPATH=str(REPO))
    if dry_run:
        env.update({DRYRUN_ENV: "1", "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", module_file,
           str(out_dir)]
    log_path = Path(out_dir, "torchrun.log")
    with open(log_path, "w") as log:  # a file, not a pipe: nothing blocks on a full one
        job = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = job.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # its ranks hold GPUs the next tests need
            job.terminate()  # torchrun passes SIGTERM on to its ranks, then kills them
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
            code = f"stopped after {timeout_s} s"
    output = log_path.read_text(errors="replace")
    found = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("report_rank*.json"))]
    for report in found:
        print(json.dumps(report, indent=1))
    if code != 0:
        print(f"torchrun exit: {code}; its output ends:\n{output[-6000:]}")
        for report in found:
            report["launch_tail"] = f"torchrun exit: {code}\n{output[-6000:]}"
    assert len(found) == world, f"{len(found)} of {world} ranks reported (torchrun exit: {code}):\n{output[-8000:]}"
    return found
