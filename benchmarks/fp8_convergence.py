"""Issue 39's convergence check: does an FP8 run end where bf16 does, within the spread of bf16 itself?

    python benchmarks/fp8_convergence.py --bf16 runs/bf16_a runs/bf16_b --fp8 runs/fp8_a [runs/fp8_b] \
        --png benchmarks/results/fp8_convergence.png --json benchmarks/results/fp8_convergence.json

The runs train the same model on the same data (train.seed picks the initialisation and the order of the samples):
``--bf16`` two bf16 runs with different seeds, ``--fp8`` the same config with ``train.fp8_recipe`` on, the first
with the first bf16 run's seed (a second with the second's). The check: every FP8 run's final loss differs from its
seed's bf16 run's by less than ``--factor`` (2) times the two bf16 runs' difference. "Final loss" is read two ways,
both reported and both checked: the mean training loss over the last ``--tail`` steps (a single step's loss is one
batch's noise) and the last validation loss (the same held-out data for every run). Exit status 1 if a check fails.
The PNG: every run's loss curves (benchmarks/plot_loss.py's plot).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.plot_loss import plot, read_metrics  # noqa: E402


def final_losses(records: list[dict], tail: int) -> dict:
    """The mean training loss over the last ``tail`` steps and the last validation loss (None if never evaluated)."""
    evaluated = [record for record in records if "val_loss" in record]
    return {"last_step": records[-1]["step"],
            "tail_mean_loss": statistics.fmean(record["loss"] for record in records[-tail:]),
            "val_loss": evaluated[-1]["val_loss"] if evaluated else None}


def compare(bf16: list[dict], fp8: list[dict], factor: float) -> dict:
    """Per measure (tail mean, validation): the two bf16 runs' gap, each FP8 run's gap to its seed's bf16 run, and
    whether every such gap is under ``factor`` times the bf16 one."""
    result = {}
    for measure in ("tail_mean_loss", "val_loss"):
        if any(run[measure] is None for run in bf16 + fp8):
            result[measure] = {"checked": False, "why": "a run has no validation loss"}
            continue
        seeds_gap = abs(bf16[0][measure] - bf16[1][measure])
        fp8_gaps = [abs(run[measure] - bf16[i][measure]) for i, run in enumerate(fp8)]
        result[measure] = {"checked": True, "bf16_seeds_gap": seeds_gap, "fp8_gaps": fp8_gaps,
                           "bound": factor * seeds_gap, "met": all(gap < factor * seeds_gap for gap in fp8_gaps)}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", nargs=2, required=True, metavar="RUN", help="two bf16 runs, different seeds")
    parser.add_argument("--fp8", nargs="+", required=True, metavar="RUN",
                        help="FP8 runs with the bf16 runs' seeds, in the same order (one or two)")
    parser.add_argument("--tail", type=int, default=50, help="steps whose training loss is averaged")
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--png", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--machine", default=None, help="what ran it, for --json")
    args = parser.parse_args(argv)
    if len(args.fp8) > 2:
        parser.error("--fp8 takes one or two runs (the bf16 runs' seeds)")
    labels = ["bf16 seed A", "bf16 seed B"] + [f"fp8 seed {'AB'[i]}" for i in range(len(args.fp8))]
    runs = [(label, read_metrics(run)) for label, run in zip(labels, args.bf16 + args.fp8)]
    finals = {label: final_losses(records, args.tail) for label, records in runs}
    for label, final in finals.items():
        val = "-" if final["val_loss"] is None else f"{final['val_loss']:.4f}"
        print(f"{label}: step {final['last_step']}, mean loss of the last {args.tail} steps "
              f"{final['tail_mean_loss']:.4f}, validation {val}")
    values = list(finals.values())
    verdict = compare(values[:2], values[2:], args.factor)
    for measure, check in verdict.items():
        if not check["checked"]:
            print(f"{measure}: not checked ({check['why']})")
            continue
        gaps = ", ".join(f"{gap:.4f}" for gap in check["fp8_gaps"])
        print(f"{measure}: FP8 against bf16 {gaps}; the bf16 seeds {check['bf16_seeds_gap']:.4f} (bound "
              f"{check['bound']:.4f}): {'MET' if check['met'] else 'MISSED'}")
    if args.png:
        if importlib.util.find_spec("matplotlib") is None:
            print(f"fp8_convergence: matplotlib is not installed: no PNG written to {args.png}")
        else:
            plot(runs, args.png, from_step=0, min_share=0.25)
            print(f"loss curves: {args.png}")
    if args.json:
        header = {"machine": args.machine, "date": datetime.date.today().isoformat(),
                  "command": " ".join(["python benchmarks/fp8_convergence.py",
                                       *(sys.argv[1:] if argv is None else argv)])}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(header, runs=finals, check=verdict), indent=2) + "\n")
    return 0 if all(check.get("met", False) for check in verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
