"""Pipeline schedules: every schedule with overlap.overlap_p2p_comm off and on, round-robin in blocks (A B C A B C
...) in one launch, measured against the simulator (moe_overlap/training/schedules.py) fed the same run's median costs.

    # 2 GPUs, PP=2 (configs/small_gpu.yaml: 8 layers; 8 micro-batches of 8 x 1024 tokens), NVLink, then NCCL through
    # host memory (an inter-node stand-in); each prints its expected duration after its first round:
    torchrun --nproc-per-node 2 benchmarks/pp_schedule.py configs/small_gpu.yaml --rounds 10 --max-minutes 1.25 \
        --json benchmarks/results/pp_schedule_2xh100_nvlink.json \
        --timeline benchmarks/results/pp_schedule_2xh100_nvlink.png
    torchrun --nproc-per-node 2 benchmarks/pp_schedule.py configs/small_gpu.yaml --rounds 10 --max-minutes 1.25 \
        --fabric slow --json benchmarks/results/pp_schedule_2xh100_slow.json
    # CPU, gloo, PP=2, one core a rank (the committed run; without a config file the model is sized for CPU):
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/pp_schedule.py --rounds 12 \
        --json benchmarks/results/pp_schedule_cpu_gloo.json --timeline benchmarks/results/pp_schedule_cpu_gloo.png

Every step is traced by the executor: each action's start and end on its rank (host clock on CPU; CUDA events on
the compute stream on GPU, so a Wait lasts as long as the stream stalls) and the peak bytes it counts (saved for
backward + P2P buffers in flight). A rank's span runs from its first compute's start to its last compute's end;
the step is the longest span (the first stage's: it starts first and ends last), so no two ranks' clocks are
compared. The first step of each block follows a switch and is left out.

Rows:
  variant   per schedule x overlap_p2p_comm, medians over the steps in use:
            step_ms            the step, as above (speed-ups: the median over rounds of two variants' per-round
                               step ratio; each round starts its round-robin at another variant)
            bubble_measured    idle share of the step, mean over ranks: 1 - a rank's compute time / the step
            bubble_predicted   the simulator's, from median per-action costs: each rank's F, B, I, W per model
                               chunk and each kind of Post (the host time of starting transfers: gloo writes a
                               message in the caller; ~0 on CUDA, where a post queues work), with the measured P2P
                               latency (target: the measured bubble within 15% of it); step_ms_predicted likewise
            bubble_replayed    diagnostic: each step replayed with its own action durations (tells a model error
                               from the spread of costs)
            p2p_exposed        what the transfers add to the step: the step minus the same step replayed with
                               instant transfers and free posts (each compute at its measured duration, every
                               dependency of the schedule kept). Any gap between computes counts, so this bounds
                               exposed P2P from above (target: < 2% of the step with overlap_p2p_comm on)
            peak_mib_per_rank  the executor's count, largest over steps
            On CPU only uncontended steps count (every rank's thread held its core >= 90% of its compute time, by
            thread CPU time: another process on a shared machine would otherwise be what the step measures), when
            there are 3 or more; else the row uses all its steps and is marked contended, and the targets that
            compare it say not measured (met: null) rather than met or missed.
  summary   each target, met or missed: exposed P2P < 2% (overlap on); bubble within 15% of the prediction; ZB-H1
            faster than 1F1B at no more peak memory; interleaved 1F1B (VPP=2) faster than 1F1B (each against 1F1B
            with the same P2P setting).
The interleaved variants run with virtual_pipeline_model_parallel_size=2, the others without; every variant is the
same model from the same seed, on its own trainer. `--fabric slow` sets NCCL_P2P_DISABLE=1 before init. Needs
pipeline ranks: world >= 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_header, set_run_env, write_json  # noqa: E402
from moe_overlap.training.schedules import Compute, Post, Span, Timeline, simulate  # noqa: E402

SCHEDULE_NAMES = ("all_forward_all_backward", "1f1b", "interleaved_1f1b", "zb_h1")
CPU_OVERRIDES = ["model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=768",
                 "model.num_attention_heads=8", "model.num_query_groups=4", "model.seq_length=128",
                 "model.num_moe_experts=8", "model.moe_layer_freq=1", "model.moe_ffn_hidden_size=384",
                 "model.moe_router_topk=2", "model.moe_aux_loss_coeff=0.01", "model.vocab_size=256",
                 "train.micro_batch_size=3", "train.global_batch_size=24", "train.device=cpu",
                 "parallel.expert_model_parallel_size=1"]
# With a config file (the GPU runs): 8 micro-batches a step at PP=2 x DP=1, of the small GPU config's 8 x 1024 tokens.
GPU_OVERRIDES = ["parallel.expert_model_parallel_size=1", "train.micro_batch_size=8", "train.global_batch_size=64"]
FORCED = ["train.eval_interval=0", "checkpoint.save_final=false", "checkpoint.save_interval=0",
          "train.max_steps=100000", "parallel.pipeline_model_parallel_size=2"]
BUBBLE_TOLERANCE = 0.15
EXPOSED_P2P_TARGET = 0.02  # of the step, with overlap_p2p_comm on
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
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no round that would end past this many minutes after the benchmark started "
                             "(torch imported); the JSON records the rounds run")
    parser.add_argument("--fabric", choices=("nvlink", "slow"), default="nvlink")
    parser.add_argument("--timeline", default=None, metavar="PNG",
                        help="draw one measured step of each variant beside its prediction (needs matplotlib)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--note", default=None, help="free text recorded in the JSON (where and how it ran)")
    parser.add_argument("--allow-multicast", action="store_true", help="do not force NVLink multicast off")
    args = parser.parse_args(argv)
    if args.config is not None and "=" in args.config:  # no config file given: the first word is an override
        args.config, args.overrides = None, [args.config] + args.overrides
    if args.block < 2:
        parser.error("--block must be >= 2: a block's first step follows a switch and is left out")
    if args.timeline and importlib.util.find_spec("matplotlib") is None:  # found out now, not after the run
        parser.error(f"--timeline {args.timeline}: needs matplotlib (pip install -e '.[plot]'), which is not installed")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    set_run_env(args.allow_multicast, args.fabric)
    started = time.perf_counter()

    import torch
    import torch.distributed as dist

    from moe_overlap.config import ConfigError, load_config
    from moe_overlap.training.run_setup import init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    owns_process_group = not dist.is_initialized()
    base = (CPU_OVERRIDES if args.config is None else GPU_OVERRIDES) + args.overrides + FORCED
    try:  # every variant's config, checked before any process group exists
        configs = {(name, p2p == "on"): load_config(args.config, base + variant_overrides(name, p2p == "on"))
                   for name in args.schedules for p2p in args.p2p}
    except ConfigError as err:
        raise SystemExit(f"pp_schedule: {err}") from None
    if int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1)) < 2:
        raise SystemExit("pp_schedule measures pipeline parallelism: run it on 2 or more ranks (PP=2)")
    mesh, device = init_distributed(next(iter(configs.values())))

    def slowest(seconds: float) -> float:  # the same on every rank, so that every rank decides alike
        value = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    try:
        load_before = os.getloadavg()
        variants = [Variant(name, overlap, cfg, mesh, device) for (name, overlap), cfg in configs.items()]
        latency = p2p_latency(variants[0], device)
        say = print if mesh.rank == 0 else (lambda *a, **k: None)
        say(f"{len(variants)} variants x {args.rounds} rounds x {args.block} steps; set-up took "
            f"{time.perf_counter() - started:.0f} s", flush=True)
        loads = []
        for round_index in range(args.rounds):
            round_started = time.perf_counter()
            start = round_index % len(variants)  # each round starts elsewhere: no variant always follows another
            for variant in variants[start:] + variants[:start]:
                for index in range(args.block):
                    variant.step(round_index, keep=index > 0)
            loads.append(os.getloadavg()[0])
            took, elapsed = slowest(time.perf_counter() - round_started), slowest(time.perf_counter() - started)
            left = args.rounds - round_index - 1
            if round_index == 0:
                say(f"round 1 took {took:.1f} s: about {left * took:.0f} s more for {left} rounds", flush=True)
            if left and args.max_minutes is not None and elapsed + took > args.max_minutes * 60:
                say(f"stopping after {round_index + 1} rounds: another would pass --max-minutes "
                    f"{args.max_minutes}", flush=True)
                break
        load_after = os.getloadavg()
        rows = [variant.summary(latency) for variant in variants]
        rows += summary_rows(rows)
        if mesh.rank == 0:
            print_rows(rows, latency, load_before, load_after)
            header = dict(run_header(mesh.world_size), fabric=args.fabric, note=args.note,
                          rounds_run=len(loads), rounds_asked=args.rounds, block=args.block,
                          wall_s=time.perf_counter() - started,
                          targets={"p2p_exposed_fraction_max": EXPOSED_P2P_TARGET,
                                   "bubble_rel_diff_max": BUBBLE_TOLERANCE},
                          load_average_1_5_15_min={"before": load_before, "after": load_after},
                          load_average_1_min_after_each_round=loads,
                          p2p_latency_ms=latency * 1e3, config=args.config, overrides=base)
            write_json(args.json, header, rows)
            if args.timeline:
                draw_timelines(variants, args.timeline)
            print(f"took {time.perf_counter() - started:.0f} s", flush=True)
        return rows
    finally:
        mesh.destroy()
        if owns_process_group:
            dist.destroy_process_group()


def post_key(post: Post) -> str:
    """A Post's kind, for its median cost: what it starts (e.g. 'post recv act+send grad')."""
    return "post " + "+".join(sorted(f"{'send' if op.send else 'recv'} {op.message.kind}" for op in post.ops))


def cost_key(action) -> str:
    return f"{action.kind}{action.chunk}" if isinstance(action, Compute) else post_key(action)


def measured_timeline(traces: list[list]) -> Timeline:
    """The computes of one step, each rank on its own clock."""
    return Timeline(len(traces), [Span(rank, action, begin, end) for rank, trace in enumerate(traces)
                                  for action, begin, end in trace if isinstance(action, Compute)])


def step_and_bubble(timeline: Timeline) -> tuple[float, float]:
    """(step, bubble): the longest rank's span from its first compute's start to its last compute's end, and
    the mean over ranks of the idle share of that. Alike for measured and simulated timelines."""
    spans = [[s for s in timeline.spans if s.rank == rank] for rank in range(timeline.pp)]
    step = max(max(s.end for s in mine) - min(s.start for s in mine) for mine in spans)
    return step, statistics.mean(1 - timeline.busy(rank) / step for rank in range(timeline.pp))


def variant_overrides(schedule: str, overlap: bool) -> list[str]:
    extra = [f"train.pipeline_schedule={schedule}", f"overlap.overlap_p2p_comm={str(overlap).lower()}"]
    return extra + (["parallel.virtual_pipeline_model_parallel_size=2"] if schedule == "interleaved_1f1b" else [])


def step_measures(schedule, timeline: Timeline, durations: list[dict], latency: float) -> dict[str, float]:
    """One step: ``timeline`` its computes, ``durations`` each rank's seconds per action (computes and posts).
    step and bubble as measured; bubble_replayed: the step replayed through the simulator with these durations
    and ``latency``; p2p_exposed: the step minus its replay with instant transfers and free posts."""
    def own(rank: int, action) -> float:
        return durations[rank][action]

    step, bubble = step_and_bubble(timeline)
    return {"step": step, "bubble": bubble,
            "bubble_replayed": step_and_bubble(simulate(schedule, own, latency, own))[1],
            "p2p_exposed": step - step_and_bubble(simulate(schedule, own))[0]}


class Variant:
    """One schedule with overlap_p2p_comm off or on: its own trainer (the same model and seed)."""

    def __init__(self, schedule: str, overlap: bool, cfg, mesh, device):
        from moe_overlap.training.trainer import Trainer

        self.name = schedule + ("+p2p_overlap" if overlap else "")
        self.schedule_name, self.overlap = schedule, overlap
        self.trainer = Trainer(cfg, mesh, device)
        self.mesh, self.device = mesh, device
        self.executor = self.trainer.pipeline
        self.samples: list[dict] = []  # per kept step: round, trace, peak bytes, thread CPU seconds
        self.steps_run = 0

    def step(self, round_index: int, keep: bool) -> None:
        import torch.distributed as dist

        trainer = self.trainer
        batches = list(trainer.sampler.micro_batches(self.steps_run))
        scale = 1.0 / (trainer.num_micro_batches * self.mesh.dp.size)
        dist.barrier()
        cpu_start = time.thread_time()
        result = self.executor.run(batches, scale, measure=True)  # on CUDA: resolves its events after a sync
        cpu = time.thread_time() - cpu_start
        trainer.optimizer.reduce_grads()
        trainer.optimizer.zero_grad()
        self.steps_run += 1
        if keep:
            self.samples.append({"round": round_index, "trace": result.trace, "peak": result.peak_bytes,
                                 "cpu": cpu})

    def summary(self, latency: float) -> dict:
        """Measured against predicted, on the first pipeline's ranks."""
        import torch.distributed as dist

        everyone = [None] * self.mesh.world_size
        dist.all_gather_object(everyone, self.samples)
        ranks = [everyone[global_rank] for global_rank in self.mesh.pp.ranks]  # this pipeline, by stage
        schedule = self.executor.schedule
        steps = len(self.samples)
        timelines = [measured_timeline([r[i]["trace"] for r in ranks]) for i in range(steps)]
        if self.device.type == "cuda":
            on_cpu, clean = None, list(range(steps))
        else:  # thread CPU time over compute time: below 1 when another process had the core
            on_cpu = [min(r[i]["cpu"] / timelines[i].busy(k) for k, r in enumerate(ranks)) for i in range(steps)]
            clean = [i for i in range(steps) if on_cpu[i] >= ON_CPU]
        kept = clean if len(clean) >= 3 else list(range(steps))
        costs = [_median_costs([r[i]["trace"] for i in kept]) for r in ranks]
        self.predicted = simulate(schedule, lambda rank, a: costs[rank][cost_key(a)], latency,
                                  lambda rank, a: costs[rank][cost_key(a)])
        step_predicted, bubble_predicted = step_and_bubble(self.predicted)
        measured = {i: step_measures(schedule, timelines[i], [{action: end - begin for action, begin, end
                                                               in r[i]["trace"]} for r in ranks], latency)
                    for i in kept}
        self.measured_trace = [r[kept[-1]]["trace"] for r in ranks]
        step_ms = {i: m["step"] * 1e3 for i, m in measured.items()}
        bubble = statistics.median(m["bubble"] for m in measured.values())
        return {"row": "variant", "variant": self.name, "schedule": self.schedule_name,
                "overlap_p2p_comm": self.overlap, "vpp": schedule.vpp, "micro_batches": schedule.micro_batches,
                "steps": steps, "steps_uncontended": len(clean) if on_cpu else None, "steps_used": len(kept),
                "contended": on_cpu is not None and len(clean) < 3,
                "on_cpu_min_per_step": on_cpu,
                "step_ms": statistics.median(step_ms.values()),
                "step_ms_by_round": {r: statistics.median(ms for i, ms in step_ms.items()
                                                          if self.samples[i]["round"] == r)
                                     for r in sorted({self.samples[i]["round"] for i in kept})},
                "step_ms_min": min(step_ms.values()), "step_ms_max": max(step_ms.values()),
                "bubble_measured": bubble, "bubble_predicted": bubble_predicted,
                "bubble_rel_diff": abs(bubble - bubble_predicted) / bubble_predicted if bubble_predicted else None,
                "step_ms_predicted": step_predicted * 1e3,
                "bubble_replayed": statistics.median(m["bubble_replayed"] for m in measured.values()),
                "p2p_exposed_ms": statistics.median(m["p2p_exposed"] for m in measured.values()) * 1e3,
                "p2p_exposed_fraction": statistics.median(m["p2p_exposed"] / m["step"] for m in measured.values()),
                "peak_mib_per_rank": [max(x["peak"] for x in r) / 2**20 for r in ranks],
                "costs_ms_per_rank": [{k: v * 1e3 for k, v in sorted(c.items())} for c in costs]}


def _median_costs(traces: list[list]) -> dict[str, float]:
    """One rank's median seconds per compute kind and chunk, and per kind of Post, over its steps' traces."""
    durations: dict[str, list[float]] = {}
    for trace in traces:
        for action, begin, end in trace:
            if isinstance(action, (Compute, Post)):
                durations.setdefault(cost_key(action), []).append(end - begin)
    return {key: statistics.median(values) for key, values in durations.items()}


def p2p_latency(variant: Variant, device, rounds: int = 20) -> float:
    """Median one-way time of an activation-sized transfer between the first two pipeline ranks, over the
    executor's own channels (a round trip halved; CUDA events on GPU)."""
    import torch
    import torch.distributed as dist

    from moe_overlap.distributed.streams import Event, synchronize

    executor = variant.executor
    buffer = torch.zeros(executor.shape, dtype=executor.dtype, device=device)
    pp = variant.mesh.pp
    order = {0: (True, False), 1: (False, True)}.get(pp.rank, ())  # rank 0 sends first, rank 1 answers
    times = []
    for _ in range(rounds):
        synchronize(device)
        dist.barrier()
        start = Event(device, timing=True).record()
        for send in order:
            for works in executor.p2p.post([(send, buffer, 1 - pp.rank)], batch=False):
                for work in works:
                    work.wait()
        end = Event(device, timing=True).record()
        times.append(start.elapsed_ms(end) / 2e3)
    mine = torch.tensor([statistics.median(times) if pp.rank == 0 else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def summary_rows(rows: list[dict]) -> list[dict]:
    by_name = {row["variant"]: row for row in rows}
    out = [_judged({"row": "summary", "target": f"exposed P2P < {EXPOSED_P2P_TARGET:.0%} of the step",
                    "variant": row["variant"], "p2p_exposed_fraction": row["p2p_exposed_fraction"]},
                   row["p2p_exposed_fraction"] < EXPOSED_P2P_TARGET, row)
           for row in rows if row["overlap_p2p_comm"]]
    out += [_judged({"row": "summary", "target": f"bubble within {BUBBLE_TOLERANCE:.0%} of the prediction from median "
                     "costs", "variant": row["variant"], "rel_diff": row["bubble_rel_diff"]},
                    row["bubble_rel_diff"] is not None and row["bubble_rel_diff"] <= BUBBLE_TOLERANCE, row)
            for row in rows]
    for suffix in ("", "+p2p_overlap"):
        one = by_name.get("1f1b" + suffix)
        for other, target in (("zb_h1", "ZB-H1 faster than 1F1B at no more peak memory"),
                              ("interleaved_1f1b", "interleaved 1F1B (VPP=2) faster than 1F1B")):
            row = by_name.get(other + suffix)
            if one is None or row is None:
                continue
            # Paired by round (the variants of one round ran minutes apart at most): robust to drift. On CPU the
            # steps in use may share no round; then the ratio of the medians.
            rounds = sorted(set(one["step_ms_by_round"]) & set(row["step_ms_by_round"]))
            ratios = [one["step_ms_by_round"][r] / row["step_ms_by_round"][r] for r in rounds]
            speed = statistics.median(ratios) if ratios else one["step_ms"] / row["step_ms"]
            memory = max(row["peak_mib_per_rank"]) / max(one["peak_mib_per_rank"])
            met = speed > 1 and (other != "zb_h1" or memory <= 1.0)
            out.append(_judged({"row": "summary", "target": target, "variant": other + suffix,
                                "speedup_vs_1f1b": speed, "speedup_by_round": ratios,
                                "rounds_faster": sum(r > 1 for r in ratios), "rounds": len(ratios),
                                "speedup_of_medians": one["step_ms"] / row["step_ms"],
                                "peak_memory_vs_1f1b": memory}, met, one, row))
    return out


def _judged(entry: dict, met: bool, *involved: dict) -> dict:
    """The entry with met, or with met null where a row it compares ran contended (and why)."""
    contended = [row["variant"] for row in involved if row["contended"]]
    if contended:
        return dict(entry, met=None, why=f"not measured: {', '.join(contended)} had fewer than 3 uncontended "
                                         "steps (another process held the CPU)")
    return dict(entry, met=met)


def print_rows(rows: list[dict], latency: float, load_before, load_after) -> None:
    print(f"P2P latency (activation-sized transfer, one way): {latency * 1e3:.3f} ms; load average before "
          f"{load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    print(f"{'variant':37} {'steps':>7} {'step ms':>9} {'min':>8} {'max':>8} {'bubble':>7} {'pred':>7} {'diff':>6} "
          f"{'replay':>7} {'pred ms':>8} {'P2P exp':>8}  peak MiB per rank")
    for row in rows:
        if row["row"] != "variant":
            continue
        print(f"{row['variant']:37} {row['steps_used']:3}/{row['steps']:<3} {row['step_ms']:9.1f} "
              f"{row['step_ms_min']:8.1f} {row['step_ms_max']:8.1f} "
              f"{row['bubble_measured']:7.4f} {row['bubble_predicted']:7.4f} {row['bubble_rel_diff']:6.1%} "
              f"{row['bubble_replayed']:7.4f} {row['step_ms_predicted']:8.1f} {row['p2p_exposed_fraction']:8.2%}  "
              f"{', '.join(f'{m:.1f}' for m in row['peak_mib_per_rank'])}")
    print("median action ms per rank (compute kind + chunk; posts by what they start):")
    for row in rows:
        if row["row"] == "variant":
            print(f"  {row['variant']:35} " + " | ".join(
                " ".join(f"{k}={v:.2f}" for k, v in costs.items()) for costs in row["costs_ms_per_rank"]))
    for row in rows:
        if row["row"] == "summary":
            if "p2p_exposed_fraction" in row:
                detail = f"exposed {row['p2p_exposed_fraction']:.2%} of the step"
            elif "rel_diff" in row:
                detail = f"rel diff {row['rel_diff']:.1%}"
            else:
                detail = (f"speed-up {row['speedup_vs_1f1b']:.3f}x (faster in {row['rounds_faster']}/"
                          f"{row['rounds']} rounds), peak memory {row['peak_memory_vs_1f1b']:.3f}x")
            verdict = {True: "met", False: "MISSED", None: "not measured (contended CPU)"}[row["met"]]
            print(f"target: {row['target']:54} {row['variant']:37} {detail:50} {verdict}")


def draw_timelines(variants: list[Variant], path: str) -> None:
    from moe_overlap.training.schedules import draw

    panels = []
    for variant in variants:
        measured = measured_timeline(variant.measured_trace)
        measured.spans = [Span(s.rank, s.action, s.start * 1e3, s.end * 1e3) for s in measured.spans]
        predicted = Timeline(variant.predicted.pp, [Span(s.rank, s.action, s.start * 1e3, s.end * 1e3)
                                                    for s in variant.predicted.spans])
        panels += [(f"{variant.name} measured", measured), (f"{variant.name} predicted (median costs)", predicted)]
    draw(panels, path, "ms")
    print(f"timeline: {path}")


if __name__ == "__main__":
    main()
