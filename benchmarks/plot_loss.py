"""A training run's metrics log as what the README's quick-start table reports, a routing-balance check and a loss
curve: throughput and MFU, peak memory, the loss after N steps, and whether every expert kept at least a share of
the mean load (by default "no expert below 25% of the mean load from step 50 on").

    python benchmarks/plot_loss.py runs/gpu2_mixtral --png benchmarks/results/loss_gpu2_mixtral.png
    python benchmarks/plot_loss.py runs/bias runs/aux --labels "expert bias,aux loss" --png loss.png --json out.json

Each RUN is a run directory (its metrics.jsonl, which `moe-overlap train` writes every train.log_interval steps: keep
it at 1 for the check to see every step) or the metrics file itself. Per run it prints the steps logged, the loss
and validation loss at the last step, the medians of tokens/s, per-GPU TFLOP/s and MFU over the steps after
``--skip`` (start-up and CUDA-graph capture), the highest peak memory, the most dead experts in a step (experts
that received no token, summed over the MoE layers) and the balance check: over the steps from ``--from-step`` on,
the lowest load of any expert in any MoE layer as a share of that layer's mean, and where it was; and how the loads
swing over those steps (:func:`load_swing`: the autocorrelation of each expert's log share, whose first trough is
about half the swing's period). Exit status 1 if a run fails the check (or has no MoE load to check), else 0.

The PNG (matplotlib: `pip install -e '.[plot]'`; without it the PNG is skipped with a message and the rest stands):
the loss (and validation loss) per step of every run, and below it each step's lowest expert share of the mean.
``--json`` writes the summaries with the date, the command and ``--machine``.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run directory or its metrics.jsonl")
    parser.add_argument("--labels", default=None, help="comma-separated names of the runs (default: their paths)")
    parser.add_argument("--from-step", type=int, default=50, help="the balance check covers the steps from this on")
    parser.add_argument("--min-share", type=float, default=0.25,
                        help="the lowest load an expert may get, as a share of its layer's mean load")
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the throughput medians")
    parser.add_argument("--png", default=None, help="write the loss curves here")
    parser.add_argument("--json", default=None, help="write the summaries here")
    parser.add_argument("--machine", default=None, help="what ran it, for --json (e.g. '2x H100 80GB, NV18')")
    args = parser.parse_args(argv)
    args.labels = args.labels.split(",") if args.labels else [str(run) for run in args.runs]
    if len(args.labels) != len(args.runs):
        parser.error(f"--labels names {len(args.labels)} runs, {len(args.runs)} given")
    return args


def read_metrics(run: str) -> list[dict]:
    """A run's metrics: its directory's metrics.jsonl, or such a file (gzipped: ``.jsonl.gz``, as
    benchmarks/results keeps them)."""
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise SystemExit(f"plot_loss: {path}: no such metrics file (a run directory holds metrics.jsonl)")
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"plot_loss: {path} is empty")
    # A resumed run appends: the last record of a step is the one that counts.
    return sorted({record["step"]: record for record in records}.values(), key=lambda record: record["step"])


def lowest_share(record: dict) -> tuple[float, str, int] | None:
    """The step's least loaded expert as (its load over its layer's mean load, layer, expert); None without MoE."""
    lowest = None
    for layer, counts in record.get("tokens_per_expert", {}).items():
        mean = sum(counts) / len(counts)
        if mean > 0:
            expert = min(range(len(counts)), key=counts.__getitem__)
            share = counts[expert] / mean
            if lowest is None or share < lowest[0]:
                lowest = (share, layer, expert)
    return lowest


def below_by_layer(records: list[dict], min_share: float) -> dict[str, int]:
    """Where a run's dips sit: every step's experts under ``min_share`` of their layer's mean, counted per layer,
    from the first step (the check itself starts later)."""
    counts: dict[str, int] = {}
    for record in records:
        for layer, loads in record.get("tokens_per_expert", {}).items():
            mean = sum(loads) / len(loads)
            under = sum(load < min_share * mean for load in loads) if mean > 0 else 0
            if under:
                counts[layer] = counts.get(layer, 0) + under
    return dict(sorted(counts.items(), key=lambda item: int(item[0])))


def last_starved_step(records: list[dict], share: float = 0.01) -> int | None:
    """The last step at which some expert received under ``share`` of its layer's mean load, from the first step: when
    an early routing collapse ended (None if no expert ever starved)."""
    starved = [record["step"] for record in records if (lowest := lowest_share(record)) and lowest[0] < share]
    return max(starved, default=None)


def load_swing(records: list[dict], from_step: int, max_lag: int = 12) -> dict | None:
    """How each expert's load swings from step to step, from ``from_step`` on: the autocorrelation, lag by lag, of the
    log of its share of its layer's mean load (shares under 2% taken as 2%), pooled over every expert of every MoE
    layer; its first trough (a negative minimum: about half the swing's period) and the log shares' spread (loads
    that never move: no autocorrelation, a spread of 0). None with fewer than 2 x ``max_lag`` steps of loads."""
    series: dict[tuple[str, int], list[float]] = {}
    steps = [record for record in records if record["step"] >= from_step and record.get("tokens_per_expert")]
    if len(steps) < 2 * max_lag:
        return None
    for record in steps:
        for layer, loads in record["tokens_per_expert"].items():
            mean = sum(loads) / len(loads)
            for expert, load in enumerate(loads):
                series.setdefault((layer, expert), []).append(math.log(max(load / mean, 0.02)) if mean > 0 else 0.0)
    centred = [[value - statistics.fmean(values) for value in values] for values in series.values()]
    energy = sum(value * value for values in centred for value in values)
    if energy == 0:
        return {"from_step": from_step, "autocorrelation": None, "trough_lag": None, "trough": None,
                "log_share_std": 0.0}
    correlation = [sum(values[i] * values[i + lag] for values in centred for i in range(len(values) - lag)) / energy
                   for lag in range(max_lag + 1)]
    trough = next((lag for lag in range(1, max_lag) if correlation[lag] < 0
                   and correlation[lag] <= min(correlation[lag - 1], correlation[lag + 1])), None)
    return {"from_step": from_step, "autocorrelation": [round(value, 3) for value in correlation],
            "trough_lag": trough, "trough": None if trough is None else round(correlation[trough], 3),
            "log_share_std": math.sqrt(energy / sum(len(values) for values in centred))}


def most(records: list[dict], key: str) -> float | None:
    return max((record[key] for record in records if key in record), default=None)


def summarize(records: list[dict], from_step: int, min_share: float, skip: int) -> dict:
    last = records[-1]
    timed = [record for record in records if record["step"] > skip] or records

    def median(key: str, of=lambda value: value) -> float | None:
        values = [of(record[key]) for record in timed if key in record]
        return statistics.median(values) if values else None

    def layer_mean(per_layer: dict, of=lambda value: value) -> float:
        return statistics.fmean(of(value) for value in per_layer.values()) if per_layer else 1.0

    evaluated = [record for record in records if "val_loss" in record]
    checked = [(record["step"], lowest_share(record)) for record in records if record["step"] >= from_step]
    checked = [(step, lowest) for step, lowest in checked if lowest is not None]
    summary = {
        "steps_logged": len(records), "last_step": last["step"], "loss": last["loss"],
        "val_loss": evaluated[-1]["val_loss"] if evaluated else None,
        "val_loss_step": evaluated[-1]["step"] if evaluated else None,
        "median_tokens_per_s": median("tokens_per_s"), "median_tflops_per_gpu": median("tflops_per_gpu"),
        "median_mfu": median("mfu"), "medians_after_step": skip,
        "median_step_time_s": median("step_time_s"),
        "median_exposed_ep_ms": median("exposed_comm_ms", lambda kinds: kinds.get("ep", 0.0)),
        # the exchanges wait for the most loaded EP rank: pooled over a step's micro-batches, and per micro-batch
        # (what each exchange sees); the mean over the MoE layers, the median over the steps
        "median_ep_imbalance": median("ep_imbalance", layer_mean),
        "median_ep_imbalance_micro_batch": median("ep_imbalance_micro_batch",
                                                  lambda layers: layer_mean(layers, lambda v: v["mean"])),
        # the most any micro-batch put on one EP rank (over the mean), from the first step on: the least
        # overlap.moe_expert_rank_capacity_factor that this run would never have overflowed with one chunk
        "max_ep_imbalance_micro_batch": max((v["max"] for record in records
                                             for v in record.get("ep_imbalance_micro_batch", {}).values()),
                                            default=None),
        "peak_memory_gib": most(records, "peak_memory_gib"),
        "reserved_memory_gib": most(records, "reserved_memory_gib"),  # graph pools and the allocator's cache too
        "max_dead_experts": max((record.get("moe_dead_experts", 0) for record in records), default=0),
        "last_starved_step": last_starved_step(records),
        "balance_from_step": from_step, "balance_min_share": min_share, "balance_steps_checked": len(checked),
        "below_by_layer": below_by_layer(records, min_share),
        "load_swing": load_swing(records, from_step),
    }
    if checked:
        step, (share, layer, expert) = min(checked, key=lambda item: item[1][0])
        below = [at for at, lowest in checked if lowest[0] < min_share]
        summary.update(lowest_share=share, lowest_share_at={"step": step, "layer": layer, "expert": expert},
                       steps_below=len(below), last_step_below=max(below, default=None), balanced=not below)
    else:
        summary["balanced"] = None
    return summary


def balance_line(summary: dict) -> str:
    rule = (f"no expert below {summary['balance_min_share']:.0%} of mean load from step "
            f"{summary['balance_from_step']} on")
    if summary["balanced"] is None:
        return f"{rule}: NOT CHECKED (no MoE load logged at those steps)"
    at = summary["lowest_share_at"]
    lowest = (f"lowest {summary['lowest_share']:.0%} of the mean: layer {at['layer']} expert {at['expert']} at step "
              f"{at['step']}")
    if summary["balanced"]:
        return f"{rule}: PASS ({summary['balance_steps_checked']} steps; {lowest})"
    return (f"{rule}: FAIL ({summary['steps_below']} of {summary['balance_steps_checked']} steps had an expert "
            f"below, the last at step {summary['last_step_below']}; {lowest})")


def report(label: str, summary: dict) -> str:
    def number(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    val = (f" (val {summary['val_loss']:.3f} at step {summary['val_loss_step']})" if summary["val_loss"] is not None
           else "")
    return "\n".join([
        f"{label}: {summary['steps_logged']} steps logged, loss {summary['loss']:.3f} after step "
        f"{summary['last_step']}{val}",
        f"  tokens/s {number(summary['median_tokens_per_s'], ',.0f')}, MFU {number(summary['median_mfu'], '.3f')} "
        f"({number(summary['median_tflops_per_gpu'], '.0f')} TFLOP/s per GPU; medians after step "
        f"{summary['medians_after_step']}), peak memory {number(summary['peak_memory_gib'], '.1f')} GiB (reserved "
        f"{number(summary['reserved_memory_gib'], '.1f')}), at most "
        f"{summary['max_dead_experts']} dead experts in a step; the last step with an expert under 1% of its "
        f"layer's mean: {number(summary['last_starved_step'], 'd')}",
        f"  step {number(summary['median_step_time_s'], '.3f')} s, exposed EP "
        f"{number(summary['median_exposed_ep_ms'], '.0f')} ms; EP imbalance "
        f"{number(summary['median_ep_imbalance'], '.2f')} pooled over a step, "
        f"{number(summary['median_ep_imbalance_micro_batch'], '.2f')} per micro-batch (mean over layers, median over "
        f"steps; the worst micro-batch of the run {number(summary['max_ep_imbalance_micro_batch'], '.2f')})",
        f"  {balance_line(summary)}",
        f"  {swing_line(summary['load_swing'])}",
    ])


def swing_line(swing: dict | None) -> str:
    if swing is None:
        return "expert loads' swing: not measured (too few steps of loads)"
    where = ("the loads never moved" if swing["autocorrelation"] is None else
             "no trough" if swing["trough_lag"] is None else
             f"autocorrelation {swing['trough']:+.2f} at lag {swing['trough_lag']} (a swing of about "
             f"{2 * swing['trough_lag']} steps)")
    return (f"expert loads' swing from step {swing['from_step']}: {where}; log share std "
            f"{swing['log_share_std']:.2f}")


def plot(runs: list[tuple[str, list[dict]]], path: str, from_step: int, min_share: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axes, share_axes) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                                      gridspec_kw={"height_ratios": [2, 1]})
    for label, records in runs:
        steps = [record["step"] for record in records]
        line, = loss_axes.plot(steps, [record["loss"] for record in records], label=f"{label} (train)")
        evaluated = [record for record in records if "val_loss" in record]
        if evaluated:
            loss_axes.plot([record["step"] for record in evaluated], [record["val_loss"] for record in evaluated],
                           "o--", color=line.get_color(), label=f"{label} (validation)")
        shares = [(record["step"], lowest_share(record)) for record in records]
        shares = [(step, lowest[0]) for step, lowest in shares if lowest is not None]
        if shares:
            share_axes.plot(*zip(*shares), color=line.get_color(), label=label)
    loss_axes.set_ylabel("loss (nats per token)")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    share_axes.axhline(min_share, color="red", linewidth=0.8, linestyle=":", label=f"{min_share:.0%} of the mean")
    share_axes.axvline(from_step, color="gray", linewidth=0.8, linestyle=":")
    share_axes.set_ylabel("least loaded expert\n/ its layer's mean")
    share_axes.set_xlabel("step")
    share_axes.set_ylim(bottom=0)
    share_axes.legend(fontsize="small")
    share_axes.grid(alpha=0.3)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = [(label, read_metrics(run)) for label, run in zip(args.labels, args.runs)]
    summaries = {}
    for label, records in runs:
        summaries[label] = summarize(records, args.from_step, args.min_share, args.skip)
        print(report(label, summaries[label]))
    if args.png:
        if importlib.util.find_spec("matplotlib") is None:
            print(f"plot_loss: matplotlib is not installed (pip install -e '.[plot]'): no PNG written to {args.png}; "
                  "the summaries and the check above stand")
        else:
            plot(runs, args.png, args.from_step, args.min_share)
            print(f"loss curve: {args.png}")
    if args.json:
        header = {"machine": args.machine, "date": datetime.date.today().isoformat(),
                  "command": " ".join(["python benchmarks/plot_loss.py", *(sys.argv[1:] if argv is None else argv)])}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(header, runs=summaries), indent=2) + "\n")
    return 0 if all(summary["balanced"] for summary in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
