"""Pipeline schedules: step time of every schedule with overlap.overlap_p2p_comm off and on, the per-action
costs measured in the same run, the measured bubble (idle time of each rank's compute) against the
simulator's prediction from those costs, and the peak memory the executor counts (bytes saved for backward
plus P2P buffers in flight, per rank). Variants run round-robin in blocks (A B C A B C ...), one launch.

    # CPU, gloo, PP=2, one core a rank (the committed run):
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/pp_schedule.py --rounds 12 \
        --json benchmarks/results/pp_schedule_cpu_gloo.json --timeline benchmarks/results/pp_schedule_cpu_gloo.png
    # 2 GPUs, NCCL, NCCL through host memory (an inter-node stand-in):
    torchrun --nproc-per-node 2 benchmarks/pp_schedule.py configs/small_gpu.yaml --fabric slow \
        --json benchmarks/results/pp_schedule_2xh200_slow.json --timeline benchmarks/results/pp_schedule_2xh200_slow.png

Rows:
  variant   per schedule x overlap_p2p_comm: median step time (from a barrier to the end of the pipeline's
            forward and backward, slowest rank; the optimizer is not in it), the measured bubble (per
            rank: 1 - its compute time / the step time; mean over ranks; median over steps), the simulator's
            bubble for each step replayed from that step's measured action durations (computes, and the host
            time of each post: gloo writes a message in the caller when its receive is already posted) and
            the measured P2P latency, median over steps; their relative difference (target <= 15%); the
            simulator's bubble and step time from the median compute costs alone (free posts); peak bytes
            per rank. On CPU only uncontended steps count (every rank's thread held its core >= 90% of its
            compute time, by thread CPU time: another process on the shared machine would otherwise be what
            the step measures), when there are 3 or more; the row says how many of its steps it used
  costs     median milliseconds of each rank's F / B / I / W per model chunk, per variant
  summary   the issue's targets: every variant's bubble within 15% of the simulator's; ZB-H1 faster than
            1F1B at no more peak memory; interleaved 1F1B (VPP=2) faster than 1F1B. A speed-up is the median
            over rounds of the two variants' step-time ratio within the round (each round starts its
            round-robin at another variant), over the rounds where both have steps in use
The interleaved variants run with virtual_pipeline_model_parallel_size=2, the others without; every variant
is the same model from the same seed. Without a config file the model is sized for CPU (one F of a stage
takes tens of milliseconds on one core). On CUDA the step is timed after a synchronize and actions by CUDA
events. `--fabric slow` sets NCCL_P2P_DISABLE=1 before init. Needs pipeline ranks: world >= 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_header, set_run_env, write_json  # noqa: E402
from moe_overlap.training.schedules import Compute  # noqa: E402

SCHEDULE_NAMES = ("all_forward_all_backward", "1f1b", "interleaved_1f1b", "zb_h1")
CPU_OVERRIDES = ["model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=768",
                 "model.num_attention_heads=8", "model.num_query_groups=4", "model.seq_length=128",
                 "model.num_moe_experts=8", "model.moe_layer_freq=1", "model.moe_ffn_hidden_size=384",
                 "model.moe_router_topk=2", "model.moe_aux_loss_coeff=0.01", "model.vocab_size=256",
                 "train.micro_batch_size=3", "train.global_batch_size=24", "train.device=cpu",
                 "parallel.expert_model_parallel_size=1"]
GPU_OVERRIDES = ["parallel.expert_model_parallel_size=1", "train.micro_batch_size=4", "train.global_batch_size=32"]
FORCED = ["train.eval_interval=0", "checkpoint.save_final=false", "checkpoint.save_interval=0",
          "train.max_steps=100000", "parallel.pipeline_model_parallel_size=2"]
BUBBLE_TOLERANCE = 0.15
ON_CPU = 0.9  # a CPU step counts when every rank's computes held their core at least this much of the time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=None, help="YAML config (default: a CPU-sized model)")
    parser.add_argument("overrides", nargs="*", help="section.field=value, after the benchmark's own")
    parser.add_argument("--schedules", nargs="*", default=list(SCHEDULE_NAMES), choices=SCHEDULE_NAMES)
    parser.add_argument("--p2p", nargs="*", default=["off", "on"], choices=("off", "on"),
                        help="overlap.overlap_p2p_comm settings to run")
    parser.add_argument("--rounds", type=int, default=6, help="round-robin rounds over the variants")
    parser.add_argument("--block", type=int, default=3, help="steps per variant per round; the first is left out")
    parser.add_argument("--fabric", choices=("nvlink", "slow"), default="nvlink")
    parser.add_argument("--timeline", default=None, metavar="PNG",
                        help="draw one measured step of each variant with overlap on beside its simulation")
    parser.add_argument("--json", default=None)
    parser.add_argument("--allow-multicast", action="store_true", help="do not force NVLink multicast off")
    args = parser.parse_args(argv)
    if args.config is not None and "=" in args.config:  # no config file given: the first word is an override
        args.config, args.overrides = None, [args.config] + args.overrides
    if args.block < 2:
        parser.error("--block must be >= 2: a block's first step follows a switch and is left out")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    set_run_env(args.allow_multicast, args.fabric)

    import torch
    import torch.distributed as dist

    from moe_overlap.config import load_config
    from moe_overlap.training.trainer import init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    owns_process_group = not dist.is_initialized()
    base = (CPU_OVERRIDES if args.config is None else GPU_OVERRIDES) + args.overrides + FORCED
    cfg = load_config(args.config, base)
    if int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1)) < 2:
        raise SystemExit("pp_schedule measures pipeline parallelism: run it on 2 or more ranks (PP=2)")
    mesh, device = init_distributed(cfg)
    try:
        load_before = os.getloadavg()
        variants = [Variant(name, p2p == "on", args, base, mesh, device) for name in args.schedules
                    for p2p in args.p2p]
        latency = p2p_latency(variants[0], mesh, device)
        loads = []
        for round_index in range(args.rounds):
            start = round_index % len(variants)  # each round starts elsewhere: no variant always follows another
            for variant in variants[start:] + variants[:start]:
                for index in range(args.block):
                    variant.step(round_index, keep=index > 0)
            loads.append(os.getloadavg()[0])
        load_after = os.getloadavg()
        rows = [variant.summary(latency) for variant in variants]
        rows += summary_rows(rows)
        if mesh.rank == 0:
            print_rows(rows, latency, load_before, load_after)
            header = dict(run_header(mesh.world_size), load_average_1_5_15_min={"before": load_before,
                                                                                "after": load_after},
                          load_average_1_min_after_each_round=loads,
                          p2p_latency_ms=latency * 1e3, config=args.config, overrides=base)
            write_json(args.json, header, rows)
            if args.timeline:
                draw_timelines(variants, latency, args.timeline)
        return rows
    finally:
        mesh.destroy()
        if owns_process_group:
            dist.destroy_process_group()


class Variant:
    """One schedule with overlap_p2p_comm off or on: its own trainer (the same model and seed)."""

    def __init__(self, schedule: str, overlap: bool, args, base: list[str], mesh, device):
        from moe_overlap.config import load_config
        from moe_overlap.training.trainer import Trainer

        self.name = schedule + ("+p2p_overlap" if overlap else "")
        self.schedule_name, self.overlap = schedule, overlap
        extra = [f"train.pipeline_schedule={schedule}", f"overlap.overlap_p2p_comm={str(overlap).lower()}"]
        if schedule == "interleaved_1f1b":
            extra.append("parallel.virtual_pipeline_model_parallel_size=2")
        self.cfg = load_config(args.config, base + extra)
        self.trainer = Trainer(self.cfg, mesh, device)
        self.mesh, self.device = mesh, device
        self.executor = self.trainer.pipeline
        self.samples: list[dict] = []  # per kept step: step s (slowest rank), busy s, peak, trace, on_cpu
        self.steps_run = 0

    def step(self, round_index: int, keep: bool) -> None:
        import torch
        import torch.distributed as dist

        trainer = self.trainer
        batches = list(trainer.sampler.micro_batches(self.steps_run))
        scale = 1.0 / (trainer.num_micro_batches * self.mesh.dp.size)
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.thread_time()
        result = self.executor.run(batches, scale, measure=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
        trainer.optimizer.reduce_grads()
        trainer.optimizer.zero_grad()
        self.steps_run += 1
        slowest = torch.tensor([elapsed], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if keep:
            busy = sum(end - begin for a, begin, end in result.trace if isinstance(a, Compute))
            # On CPU the computes hold this thread on a core; less CPU time than compute time means another
            # process had the core (the machine is shared), and the step measures that, not the schedule.
            self.samples.append({"round": round_index, "step": float(slowest), "busy": busy,
                                 "peak": result.peak_bytes, "trace": result.trace, "on_cpu": cpu / busy})

    def costs(self) -> dict[tuple[str, int], float]:
        """This rank's median seconds per (kind, chunk) over the kept steps."""
        durations: dict[tuple[str, int], list[float]] = {}
        for sample in self.samples:
            for action, begin, end in sample["trace"]:
                if isinstance(action, Compute):
                    durations.setdefault((action.kind, action.chunk), []).append(end - begin)
        return {key: statistics.median(values) for key, values in durations.items()}

    def summary(self, latency: float) -> dict:
        """Measured against simulated, on the first pipeline's ranks. Two predictions: each step replayed
        with its own actions' measured durations (the target's), and the median action costs."""
        import torch.distributed as dist

        from moe_overlap.training.schedules import simulate

        everyone = [None] * self.mesh.world_size
        dist.all_gather_object(everyone, {"costs": self.costs(), "samples": self.samples})
        ranks = [everyone[global_rank] for global_rank in self.mesh.pp.ranks]  # this pipeline, by stage
        schedule = self.executor.schedule
        clean = [i for i in range(len(self.samples))
                 if self.device.type == "cuda" or min(r["samples"][i]["on_cpu"] for r in ranks) >= ON_CPU]
        kept = clean if len(clean) >= 3 else list(range(len(self.samples)))
        steps = [self.samples[i]["step"] for i in kept]
        measured, replayed = [], []
        for i in kept:
            step = self.samples[i]["step"]
            measured.append(statistics.mean(1 - r["samples"][i]["busy"] / step for r in ranks))
            durations = [{action: end - begin for action, begin, end in r["samples"][i]["trace"]} for r in ranks]
            replay = simulate(schedule, lambda rank, a: durations[rank][a], latency, lambda rank, a: durations[rank][a])
            replayed.append(replay.bubble())
        costs = [r["costs"] for r in ranks]
        self.simulated = simulate(schedule, lambda rank, a: costs[rank][(a.kind, a.chunk)], latency)
        self.measured_trace = [r["samples"][kept[-1]]["trace"] for r in ranks]
        bubble, predicted = statistics.median(measured), statistics.median(replayed)
        return {"row": "variant", "variant": self.name, "schedule": self.schedule_name,
                "overlap_p2p_comm": self.overlap, "vpp": schedule.vpp, "micro_batches": schedule.micro_batches,
                "steps": len(self.samples), "steps_uncontended": len(clean), "steps_used": len(kept),
                "on_cpu_min_per_step": [min(r["samples"][i]["on_cpu"] for r in ranks)
                                        for i in range(len(self.samples))],
                "step_ms": statistics.median(steps) * 1e3,
                "step_ms_by_round": {r: statistics.median(self.samples[i]["step"] for i in kept
                                                          if self.samples[i]["round"] == r) * 1e3
                                     for r in sorted({self.samples[i]["round"] for i in kept})},
                "step_ms_min": min(steps) * 1e3,
                "step_ms_max": max(steps) * 1e3, "bubble_measured": bubble, "bubble_simulated": predicted,
                "bubble_rel_diff": abs(bubble - predicted) / predicted if predicted else None,
                "bubble_simulated_median_costs": self.simulated.bubble(),
                "simulated_step_ms_median_costs": self.simulated.makespan * 1e3,
                "peak_mib_per_rank": [max(x["peak"] for x in r["samples"]) / 2**20 for r in ranks],
                "costs_ms_per_rank": [{f"{kind}{chunk}": v * 1e3 for (kind, chunk), v in sorted(c.items())}
                                      for c in costs]}


def p2p_latency(variant: Variant, mesh, device, rounds: int = 20) -> float:
    """Median one-way time of an activation-sized transfer between the first two pipeline ranks."""
    import torch
    import torch.distributed as dist

    executor = variant.executor
    buffer = torch.zeros(executor.shape, dtype=executor.dtype, device=device)
    pp = mesh.pp
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        if pp.rank == 0:
            dist.send(buffer, pp.ranks[1])
            dist.recv(buffer, pp.ranks[1])
        elif pp.rank == 1:
            dist.recv(buffer, pp.ranks[0])
            dist.send(buffer, pp.ranks[0])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / 2)
    mine = torch.tensor([statistics.median(times) if pp.rank == 0 else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def summary_rows(rows: list[dict]) -> list[dict]:
    by_name = {row["variant"]: row for row in rows}
    out = [{"row": "summary", "target": "bubble within 15% of the simulator's", "variant": row["variant"],
            "rel_diff": row["bubble_rel_diff"],
            "met": row["bubble_rel_diff"] is not None and row["bubble_rel_diff"] <= BUBBLE_TOLERANCE}
           for row in rows]
    for suffix in ("", "+p2p_overlap"):
        one = by_name.get("1f1b" + suffix)
        for other, target in (("zb_h1", "ZB-H1 faster than 1F1B at no more peak memory"),
                              ("interleaved_1f1b", "interleaved 1F1B (VPP=2) faster than 1F1B")):
            row = by_name.get(other + suffix)
            if one is None or row is None:
                continue
            # Paired by round (the variants of one round ran minutes apart at most): robust to drift.
            rounds = sorted(set(one["step_ms_by_round"]) & set(row["step_ms_by_round"]))
            ratios = [one["step_ms_by_round"][r] / row["step_ms_by_round"][r] for r in rounds]
            speed = statistics.median(ratios)
            memory = max(row["peak_mib_per_rank"]) / max(one["peak_mib_per_rank"])
            met = speed > 1 and (other != "zb_h1" or memory <= 1.0)
            out.append({"row": "summary", "target": target, "variant": other + suffix,
                        "speedup_vs_1f1b": speed, "speedup_by_round": ratios,
                        "rounds_faster": sum(r > 1 for r in ratios), "rounds": len(ratios),
                        "speedup_of_medians": one["step_ms"] / row["step_ms"],
                        "peak_memory_vs_1f1b": memory, "met": met})
    return out


def print_rows(rows: list[dict], latency: float, load_before, load_after) -> None:
    print(f"P2P latency (activation-sized transfer, one way): {latency * 1e3:.3f} ms; load average before "
          f"{load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    print(f"{'variant':32} {'steps':>7} {'step ms':>9} {'min':>8} {'max':>8} {'bubble':>7} {'sim':>7} {'diff':>6} "
          f"{'sim med':>7} {'ms med':>8}  peak MiB per rank")
    for row in rows:
        if row["row"] != "variant":
            continue
        print(f"{row['variant']:32} {row['steps_used']:3}/{row['steps']:<3} {row['step_ms']:9.1f} "
              f"{row['step_ms_min']:8.1f} {row['step_ms_max']:8.1f} "
              f"{row['bubble_measured']:7.4f} {row['bubble_simulated']:7.4f} {row['bubble_rel_diff']:6.1%} "
              f"{row['bubble_simulated_median_costs']:7.4f} {row['simulated_step_ms_median_costs']:8.1f}  "
              f"{', '.join(f'{m:.1f}' for m in row['peak_mib_per_rank'])}")
    print("median action ms per rank (kind + chunk):")
    for row in rows:
        if row["row"] == "variant":
            print(f"  {row['variant']:30} " + " | ".join(
                " ".join(f"{k}={v:.1f}" for k, v in costs.items()) for costs in row["costs_ms_per_rank"]))
    for row in rows:
        if row["row"] == "summary":
            detail = (f"rel diff {row['rel_diff']:.1%}" if "rel_diff" in row else
                      f"speed-up {row['speedup_vs_1f1b']:.3f}x (faster in {row['rounds_faster']}/{row['rounds']} "
                      f"rounds), peak memory {row['peak_memory_vs_1f1b']:.3f}x")
            print(f"target: {row['target']:48} {row['variant']:32} {detail:40} {'met' if row['met'] else 'MISSED'}")


def draw_timelines(variants: list[Variant], latency: float, path: str) -> None:
    from moe_overlap.training.schedules import Span, Timeline, draw

    panels = []
    for variant in variants:
        measured = Timeline(len(variant.measured_trace))
        for rank, trace in enumerate(variant.measured_trace):
            measured.spans += [Span(rank, action, begin * 1e3, end * 1e3) for action, begin, end in trace
                               if isinstance(action, Compute)]
        simulated = Timeline(variant.simulated.pp, [Span(s.rank, s.action, s.start * 1e3, s.end * 1e3)
                                                    for s in variant.simulated.spans])
        panels += [(f"{variant.name} measured", measured), (f"{variant.name} simulated", simulated)]
    draw(panels, path, "ms")
    print(f"timeline: {path}")


if __name__ == "__main__":
    main()
