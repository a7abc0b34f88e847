"""Training-step throughput of a config at any world size: tokens/s, TFLOP/s per GPU, MFU (with the peak it
used and this GPU's measured bf16 GEMM rate), peak memory, exposed communication per kind, and where the step's
time goes (a profiled window of the last steps: the compute stream's time by kind of work, and a timeline).

    python benchmarks/train_step.py configs/bench_mixtral_2l.yaml --json benchmarks/results/x.json \
        --timeline benchmarks/results/x.png                       # one GPU
    torchrun --nproc-per-node 2 benchmarks/train_step.py CONFIG parallel.expert_model_parallel_size=2 ...

Each ``--variant NAME:section.field=value,...`` runs the same config with those overrides, one after another
in this launch (each builds its own model; the first variant is the config as given, named ``config``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_header, set_run_env, write_json  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.field=value for every variant")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps profiled after the timed ones (0: none)")
    parser.add_argument("--variant", action="append", default=[], help="NAME:section.field=value,...")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeline", default=None, help="PNG of the profiled steps (per variant: NAME inserted)")
    return parser.parse_args(argv)


def variants(args) -> list[tuple[str, list[str]]]:
    out = [("config", [])]
    for spec in args.variant:
        name, _, overrides = spec.partition(":")
        out.append((name, [item for item in overrides.split(",") if item]))
    return out


def run_variant(name: str, overrides: list[str], args, out_dir: Path) -> dict | None:
    import torch
    import torch.distributed as dist

    from moe_overlap.config import load_config
    from moe_overlap.models.mixtral import count_parameters
    from moe_overlap.training.profiling import measured_gemm_tflops
    from moe_overlap.training.trainer import Trainer, init_distributed

    total = args.warmup + args.steps + args.profile_steps
    profile = [f"train.profile_steps=[{total - args.profile_steps + 1},{total}]"] if args.profile_steps else []
    cfg = load_config(args.config, args.overrides + overrides + profile + [
        f"train.max_steps={total}", "train.eval_interval=0", "checkpoint.save_final=false",
        "checkpoint.save_interval=0", "train.resume=false", f"train.output_dir={out_dir / name}"])
    mesh, device = init_distributed(cfg)
    if device.type == "cuda" and torch.cuda.is_initialized():  # an earlier variant's peak is not this one's
        torch.cuda.reset_peak_memory_stats(device)
    history = Trainer(cfg, mesh, device).fit()
    if mesh.rank != 0:
        return None
    timed = history[args.warmup:args.warmup + args.steps]
    median = lambda key: statistics.median(m[key] for m in timed)  # noqa: E731
    row = {
        "variant": name, "overrides": args.overrides + overrides, "config": args.config,
        "parameters": count_parameters(cfg.model), "world_size": mesh.world_size,
        "tokens_per_step": cfg.train.global_batch_size * cfg.model.seq_length,
        "micro_batch_size": cfg.train.micro_batch_size, "global_batch_size": cfg.train.global_batch_size,
        "steps_timed": len(timed), "tokens_per_s": median("tokens_per_s"), "step_time_s": median("step_time_s"),
        "tflops_per_gpu": median("tflops_per_gpu"), "mfu": median("mfu"), "peak_tflops": cfg.train.peak_tflops,
        "gemm_tflops_measured": measured_gemm_tflops(device) if device.type == "cuda" else None,
        "peak_memory_gib": max((m.get("peak_memory_gib", 0.0) for m in history), default=0.0),
        "exposed_comm_ms": {kind: statistics.median(m["exposed_comm_ms"][kind] for m in timed)
                            for kind in timed[0]["exposed_comm_ms"]},
        "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
    }
    breakdown = out_dir / name / "profile" / f"breakdown_rank{mesh.rank}.json"
    if breakdown.is_file():
        row["profile"] = json.loads(breakdown.read_text())
        timeline = out_dir / name / "profile" / f"timeline_rank{mesh.rank}.png"
        if args.timeline and timeline.is_file():
            target = Path(args.timeline)
            if name != "config":
                target = target.with_name(f"{target.stem}_{name}{target.suffix}")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(timeline, target)
    if dist.is_initialized():
        dist.barrier()
    return row


def release_memory() -> None:
    """Drop the finished variant's model, optimizer and graphs (autograd keeps reference cycles) and return the
    cached blocks, so the next variant starts from an empty device."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    args = parse_args(argv)
    set_run_env()
    import torch.distributed as dist

    rows = []
    with tempfile.TemporaryDirectory(prefix="train_step_") as tmp:
        for name, overrides in variants(args):
            row = run_variant(name, overrides, args, Path(tmp))
            release_memory()  # the next variant's peak memory is its own
            if row is not None:
                rows.append(row)
                summary = {k: row[k] for k in ("variant", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_gib")}
                print(json.dumps(summary), flush=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rows:
        write_json(args.json, run_header(world), rows)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
