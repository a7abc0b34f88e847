"""`moe-overlap train | info | bench | hf | data`: the command line.

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
    hf = sub.add_parser("hf", help="import / export Hugging Face checkpoints").add_subparsers(dest="action",
                                                                                               required=True)
    hf_import = hf.add_parser("import", help="HF_DIR (safetensors) -> a checkpoint train.init_from reads")
    hf_import.add_argument("hf_dir")
    hf_import.add_argument("out_ckpt")
    hf_import.add_argument("--config-out", default=None, help="also write the training config here")
    hf_export = hf.add_parser("export", help="a checkpoint, its checkpoints root or its run -> HF_DIR")
    hf_export.add_argument("checkpoint", metavar="CKPT_OR_RUN")
    hf_export.add_argument("hf_dir")
    hf_export.add_argument("--config", default=None, help="the run's config (default: config.yaml beside it)")
    hf_export.add_argument("--arch", default=None, help="mixtral | qwen2_moe | qwen3_moe | olmoe (default: the "
                           "imported model's, else the one that expresses the config)")
    hf_export.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: as stored)")
    hf_export.add_argument("--max-shard-size", type=float, default=5.0, help="GB per safetensors file")
    data = sub.add_parser("data", help="prepare training data").add_subparsers(dest="action", required=True)
    prepare = data.add_parser("prepare", help="tokenize text / JSONL into OUT.bin + OUT.json (data.path)")
    prepare.add_argument("inputs", nargs="+", metavar="INPUT")
    prepare.add_argument("--tokenizer", required=True, help="a tokenizer directory or a name in the local HF cache")
    prepare.add_argument("--out", required=True, metavar="PREFIX")
    prepare.add_argument("--field", default="text", help="the text field of .jsonl records")
    prepare.add_argument("--workers", type=int, default=None, help="parallel files (default: CPU count)")
    return parser


def _tool(args: argparse.Namespace) -> int:
    """`hf import | hf export | data prepare`: single-process tools; their errors print as one line."""
    from moe_overlap.models.hf import HFConversionError

    try:
        if args.command == "data":
            from moe_overlap.training.data_prepare import prepare

            index = prepare(args.inputs, args.tokenizer, args.out, args.field, args.workers)
            print(f"{args.out}.bin: {index['documents']} documents, {index['tokens']} tokens ({index['dtype']}, "
                  f"vocabulary {index['vocab_size']}): set data.path={args.out}.bin data.dtype={index['dtype']}")
            return 0
        from moe_overlap.training.hf_checkpoint import export_hf, import_hf

        if args.action == "import":
            cfg = import_hf(args.hf_dir, args.out_ckpt, args.config_out)
            print(f"{args.out_ckpt}: train from it with train.init_from={cfg.train.init_from} (model config in "
                  f"{args.config_out or Path(args.out_ckpt) / 'config.yaml'})")
        else:
            out = export_hf(args.checkpoint, args.hf_dir, args.config, args.arch, args.dtype,
                            int(args.max_shard_size * 1e9))
            print(f"{out}: written")
        return 0
    except (HFConversionError, ConfigError, FileNotFoundError, FileExistsError, ValueError, ImportError) as err:
        print(f"moe-overlap: {args.command} {args.action}: {err}", file=sys.stderr)
        return 2


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
    if args.command in ("hf", "data"):
        return _tool(parser.parse_args(argv))
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
