"""One micro-batch's exchange under another's compute (``overlap.overlap_moe_expert_parallel_comm``): training
steps of one model with the switch off (plain accumulation, the config's dispatch), on, and compute-only (on, with
``overlap.moe_compute_only``: each rank's rows stay in its own memory while sizes and signals still travel, the
limit; at EP=1 the same as off: nothing is exchanged), round-robin in blocks of steps on ONE trainer, so that every
variant sees the same weights, memory and clocks. Any world size; EP = the config's. Each block trains on its own
steps' batches, so compute-only routes by its own routing, not off's or on's (benchmarks/train_step.py's
compute_only row routes as its config row did: layers/routing_replay.py); compare them with balanced routing.

    python benchmarks/ep_microbatch_overlap.py configs/bench_fine_8l.yaml --json out.json --timeline out.png
    torchrun --nproc-per-node 2 benchmarks/ep_microbatch_overlap.py configs/bench_fine_8l.yaml \
        parallel.expert_model_parallel_size=2 overlap.moe_pipeline=true overlap.ep_comm_ctas=4 --fabric slow

Per variant: median step time, tokens/s and MFU, peak memory, exposed communication per kind and (on) per stage
("ep F.experts": the forward's expert stage waiting for its dispatch, ...), the routing imbalance per MoE layer
(copies on the most loaded EP rank over the mean), and a profiled step's stream summary and timeline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_header, set_run_env, write_json  # noqa: E402

VARIANTS = ("off", "on", "compute_only")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    parser.add_argument("--rounds", type=int, default=6, help="timed blocks per variant")
    parser.add_argument("--block", type=int, default=2, help="steps per block (the first of each is not timed)")
    parser.add_argument("--warmup", type=int, default=3, help="steps per variant before the timed rounds")
    parser.add_argument("--fabric", choices=("nvlink", "slow"), default="nvlink")
    parser.add_argument("--allow-multicast", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeline", default=None, help="PNG of one profiled step per variant (NAME inserted)")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    set_run_env(args.allow_multicast, args.fabric)
    import contextlib

    import torch
    import torch.distributed as dist

    from moe_overlap.config import load_config
    from moe_overlap.training.profiling import StepProfiler
    from moe_overlap.training.run_setup import init_distributed
    from moe_overlap.training.trainer import Trainer

    out_dir = Path(tempfile.mkdtemp(prefix="ep_mb_overlap_"))
    cfg = load_config(args.config, args.overrides + [
        "overlap.overlap_moe_expert_parallel_comm=true", "train.eval_interval=0", "checkpoint.save_final=false",
        "checkpoint.save_interval=0", "train.resume=false", f"train.output_dir={out_dir}"])
    mesh, device = init_distributed(cfg)
    trainer = Trainer(cfg, mesh, device)
    selectors = {layer.mlp.transports for layer in trainer.model.layers.values()
                 if layer.is_moe and layer.mlp.transports is not None}  # the model's MoE layers share one
    exchanging = mesh.ep.size * mesh.etp.size > 1 and bool(selectors)
    variants = [v for v in VARIANTS if v != "compute_only" or exchanging]
    notes = {} if exchanging else {"compute_only": "not run: one EP rank exchanges nothing, so off is the limit"}

    def run_steps(variant: str, count: int, profiler=None) -> list[dict]:
        cfg.overlap.overlap_moe_expert_parallel_comm = variant != "off"
        for selector in selectors:
            selector.compute_only = variant == "compute_only"
        metrics = []
        for _ in range(count):
            with profiler.step(trainer.step + 1) if profiler else contextlib.nullcontext():
                metrics.append(trainer.train_step())
        return metrics

    timed: dict[str, list[dict]] = {v: [] for v in variants}
    peak: dict[str, float] = dict.fromkeys(variants, 0.0)
    for variant in variants:
        run_steps(variant, args.warmup)
    for _ in range(args.rounds):
        for variant in variants:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            timed[variant] += run_steps(variant, args.block)[1:]  # the first step of a block follows a switch
            if device.type == "cuda":
                peak[variant] = max(peak[variant], torch.cuda.max_memory_allocated(device) / 2**30)
    rows = []
    for variant in variants:
        profile = out_dir / variant
        profiler = StepProfiler(trainer.step + 1, trainer.step + 1, profile, mesh.rank) if args.timeline else None
        run_steps(variant, 1, profiler)
        steps = timed[variant]
        median = lambda key: statistics.median(m[key] for m in steps)  # noqa: E731
        by_stage = {}
        for m in steps:
            for key, ms in m.get("exposed_comm_by_stage_ms", {}).items():
                by_stage.setdefault(key, []).append(ms)
        row = {"variant": variant, "steps_timed": len(steps), "step_time_s": median("step_time_s"),
               "tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"), "peak_memory_gib": peak[variant],
               "exposed_comm_ms": {kind: statistics.median(m["exposed_comm_ms"][kind] for m in steps)
                                   for kind in steps[0]["exposed_comm_ms"]},
               "exposed_comm_by_stage_ms": {key: statistics.median(v) for key, v in sorted(by_stage.items())},
               "ep_imbalance": {layer: statistics.median(m["ep_imbalance"][layer] for m in steps)
                                for layer in steps[0].get("ep_imbalance", {})},
               "loss_last": steps[-1]["loss"]}
        breakdown = profile / f"breakdown_rank{mesh.rank}.json"
        if breakdown.is_file():
            row["streams"] = json.loads(breakdown.read_text())["streams"]
            png = profile / f"timeline_rank{mesh.rank}.png"
            if png.is_file() and mesh.rank == 0:
                target = Path(args.timeline)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.with_name(f"{target.stem}_{variant}{target.suffix}").write_bytes(png.read_bytes())
        rows.append(row)
    base = rows[0]["step_time_s"]
    for row in rows:
        row["vs_off"] = row["step_time_s"] / base
    if mesh.rank == 0:
        for row in rows:
            print(json.dumps({k: row[k] for k in ("variant", "step_time_s", "vs_off", "tokens_per_s", "mfu",
                                                  "peak_memory_gib")}), flush=True)
        header = dict(run_header(mesh.world_size), config=args.config, overrides=args.overrides, notes=notes,
                      micro_batches=cfg.num_micro_batches(mesh.world_size), ep=mesh.ep.size)
        write_json(args.json, header, rows)
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
