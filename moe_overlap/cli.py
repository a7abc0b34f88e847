"""`moe-overlap train | info | bench`: the command line.

Config errors are printed as one line naming the field, without a traceback; so are failed collectives
(a peer rank died, or did not answer within train.distributed_timeout_s).
"""

from __future__ import annotations

import argparse
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
    sub.add_parser("bench", help=f"run a benchmark under torchrun: bench {{{','.join(BENCHMARKS)}}} [--nproc N] ...")
    return parser


BENCHMARKS = {"moe": "moe_layer.py", "tp": "tp_overlap.py", "dp": "dp_overlap.py", "train": "train_step.py"}


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
            return _info(cfg, args.world_size)
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


def _info(cfg: Config, world_size: int | None) -> int:
    from moe_overlap.config import validate_for_world
    from moe_overlap.models.mixtral import count_parameters
    from moe_overlap.training.trainer import mesh_layout

    p = cfg.parallel
    world_size = world_size or (p.tensor_model_parallel_size * p.context_parallel_size
                                * p.pipeline_model_parallel_size * p.expert_model_parallel_size)
    validate_for_world(cfg, world_size, "cpu")
    print(f"parameters: {count_parameters(cfg.model) / 1e6:.2f} M")
    print(f"world size {world_size}: data parallel {cfg.data_parallel_size(world_size)}, "
          f"micro-batches per step {cfg.num_micro_batches(world_size)}")
    print(mesh_layout(cfg, world_size).table())
    return 0
