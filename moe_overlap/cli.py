"""`moe-overlap train | info | bench`: the command line.

Config errors are printed as one line naming the field, without a traceback; so are failed collectives
(a peer rank died, or did not answer within train.distributed_timeout_s).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path

from moe_overlap.config import Config, ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-overlap", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model from a YAML config")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="section.field=value, e.g. train.max_steps=20")
    train.add_argument("--nproc", type=int, default=None,
                       help="launch this many local ranks through torch.distributed.run (torchrun)")
    info = sub.add_parser("info", help="print the validated config, parameter count and rank layout")
    info.add_argument("config")
    info.add_argument("overrides", nargs="*")
    info.add_argument("--world-size", type=int, default=None, help="layout to print (default: the smallest valid)")
    info.add_argument("--schedule", action="store_true",
                      help="also simulate the pipeline schedule: every rank's action timeline and the bubble")
    info.add_argument("--costs", default=None, metavar="F=..,B=..,I=..,W=..",
                      help="per-action costs for --schedule (any unit, per model chunk; default: model GFLOPs of "
                           "each chunk's forward, B = 2F, I = W = F)")
    info.add_argument("--png", default=None, metavar="PATH", help="with --schedule: draw the timeline (matplotlib)")
    sub.add_parser("bench", help=f"run a benchmark under torchrun: bench {{{','.join(BENCHMARKS)}}} [--nproc N] ...")
    return parser


BENCHMARKS = {"moe": "moe_layer.py", "tp": "tp_overlap.py", "dp": "dp_overlap.py", "train": "train_throughput.py",
              "pp": "pp_schedule.py"}


def _bench(argv: list[str]) -> int:
    """`moe-overlap bench NAME [--nproc N] [benchmark options]`: the benchmark script under torchrun."""
    if not argv or argv[0] not in BENCHMARKS:
        print(f"moe-overlap: bench: name one of {', '.join(BENCHMARKS)} (got {argv[0] if argv else 'nothing'})",
              file=sys.stderr)
        return 2
    name, rest, nproc = argv[0], list(argv[1:]), 2
    if "--nproc" in rest:
        at = rest.index("--nproc")
        nproc = int(rest[at + 1])
        del rest[at:at + 2]
    script = Path(__file__).resolve().parents[1] / "benchmarks" / BENCHMARKS[name]
    if not script.is_file():
        print(f"moe-overlap: bench: {script} is missing: the benchmarks ship with the source checkout "
              "(git clone, then pip install -e .)", file=sys.stderr)
        return 2
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", f"--nproc-per-node={nproc}", str(script), *rest])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    parser = _parser()
    # Overrides may come after options (`train CFG --nproc 2 train.max_steps=5`), which argparse does not
    # gather into one positional list by itself.
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides += extra
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "info":
            return _info(cfg, args.world_size, args.schedule, args.costs, args.png)
        if args.nproc is not None:
            return _launch(args)
        return _train(cfg)
    except ConfigError as err:
        print(f"moe-overlap: config error: {err}", file=sys.stderr)
        return 2


def _launch(args: argparse.Namespace) -> int:
    """Re-run this command under torchrun with --nproc local ranks (standalone rendezvous)."""
    if args.nproc < 1:
        raise ConfigError("--nproc", args.nproc, "must be >= 1")
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", f"--nproc-per-node={args.nproc}", "-m", "moe_overlap", "train", args.config,
              *args.overrides])
    return 0


def _train(cfg: Config) -> int:
    import torch.distributed as dist

    from moe_overlap.training.trainer import Trainer, init_distributed

    rank = int(os.environ.get("RANK", 0))
    try:
        mesh, device = init_distributed(cfg)
        history = Trainer(cfg, mesh, device).fit()
    except (dist.DistError, RuntimeError) as err:
        if not dist.is_initialized() or not _is_collective_failure(err):
            raise
        print(f"moe-overlap: rank {rank}: a collective failed: a peer rank exited or did not answer within "
              f"train.distributed_timeout_s={cfg.train.distributed_timeout_s}s ({type(err).__name__}: "
              f"{str(err).splitlines()[0] if str(err) else ''})", file=sys.stderr)
        os._exit(3)  # the process group cannot be torn down cleanly with a dead peer
    if rank == 0 and history:
        last = history[-1]
        print(f"done: step {last['step']} loss {last['loss']:.4f}"
              + (f" val_loss {last['val_loss']:.4f}" if "val_loss" in last else ""))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _is_collective_failure(err: BaseException) -> bool:
    import torch.distributed as dist

    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(
        word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def _info(cfg: Config, world_size: int | None, schedule: bool = False, costs: str | None = None,
          png: str | None = None) -> int:
    from moe_overlap.config import validate_for_world
    from moe_overlap.models.mixtral import count_parameters
    from moe_overlap.training.trainer import mesh_layout

    p = cfg.parallel
    world_size = world_size or (p.tensor_model_parallel_size * p.context_parallel_size
                                * p.pipeline_model_parallel_size * p.expert_model_parallel_size)
    validate_for_world(cfg, world_size, "cpu")
    wants_schedule = schedule or costs is not None or png is not None
    if wants_schedule and p.pipeline_model_parallel_size == 1:
        raise ConfigError("--schedule", True, "needs parallel.pipeline_model_parallel_size > 1")
    given = None if costs is None else _parse_costs(costs)
    if png is not None and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--png", png, "needs matplotlib: pip install -e '.[plot]'")
    print(f"parameters: {count_parameters(cfg.model) / 1e6:.2f} M")
    print(f"world size {world_size}: data parallel {cfg.data_parallel_size(world_size)}, "
          f"micro-batches per step {cfg.num_micro_batches(world_size)}")
    print(mesh_layout(cfg, world_size).table())
    if wants_schedule:
        _print_schedule(cfg, world_size, given, png)
    return 0


def _print_schedule(cfg: Config, world_size: int, given: dict[str, float] | None, png: str | None) -> None:
    """The configured schedule simulated from per-action costs: each rank's timeline and the bubble."""
    from moe_overlap.models.pipeline_stages import PipelineStages, stage_forward_flops
    from moe_overlap.training.schedules import build_schedule, default_schedule, draw, render, simulate

    t = cfg.train
    stages = PipelineStages.from_config(cfg)
    name = t.pipeline_schedule or default_schedule(stages.vpp)
    plan = build_schedule(name, stages.pp, stages.vpp, cfg.num_micro_batches(world_size), cfg.overlap.overlap_p2p_comm,
                          cfg.overlap.batch_p2p_comm)
    if given is None:
        tokens = t.micro_batch_size * cfg.model.seq_length
        forward = {stage: stage_forward_flops(cfg.model, layers, stage == stages.num_stages - 1, tokens) / 1e9
                   for stage, layers in enumerate(stages.layers)}

        def cost(rank, action):
            return forward[stages.stage(rank, action.chunk)] * (2.0 if action.kind == "B" else 1.0)
        unit = "GFLOP"
    else:
        def cost(rank, action):
            return given[action.kind]
        unit = "cost units"
    timeline = simulate(plan, cost)
    print(render(plan, timeline))
    print(f"makespan {timeline.makespan:.4g} {unit}")
    if png:
        draw([(name, timeline)], png, unit)
        print(f"timeline: {png}")


def _parse_costs(text: str) -> dict[str, float]:
    """``F=1,B=2,I=1,W=1``: F and B required; I and W default to B / 2."""
    costs = {}
    for item in text.split(","):
        kind, _, value = item.partition("=")
        try:
            costs[kind.strip()] = float(value)
        except ValueError:
            raise ConfigError("--costs", text, "expected F=..,B=..[,I=..,W=..] with numbers") from None
    if not {"F", "B"} <= set(costs) or not set(costs) <= {"F", "B", "I", "W"} or min(costs.values()) < 0:
        raise ConfigError("--costs", text, "expected F=..,B=..[,I=..,W=..] with numbers >= 0")
    costs.setdefault("I", costs["B"] / 2)
    costs.setdefault("W", costs["B"] / 2)
    return costs
