"""`moe-overlap train | info | bench | hf | data`: the command line.

Bad input is printed as one line naming the field, the value and what is allowed, without a traceback (exit
2; ``--debug`` shows it); so are failed collectives (a peer rank died, or did not answer within
train.distributed_timeout_s: exit 3, naming the rank and its phase), failed checkpoint saves (exit 4) and a
non-finite gradient under train.on_nonfinite_grad=stop (exit 5). A stop request (SIGTERM, SIGINT,
train.exit_duration_min) ends with a checkpoint and exit 0.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import itertools
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

from moe_overlap.config import Config, ConfigError, config_yaml, load_config

EXIT_BAD_INPUT = 2
EXIT_SAVE_FAILED = 4  # 3: a peer rank failed (moe_overlap.distributed.monitor)
EXIT_NONFINITE = 5
EXIT_SIGINT = 130


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
    for command in (train, info):
        command.add_argument("--debug", action="store_true", help="show the traceback behind an error message")
    sub.add_parser("bench", help=f"run a benchmark under torchrun: bench {{{','.join(BENCHMARKS)}}} [--nproc N] ... "
                                 "(bench --help lists them)")
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
    vocabulary = prepare.add_mutually_exclusive_group(required=True)
    vocabulary.add_argument("--tokenizer", help="a tokenizer directory or a name in the local HF cache")
    vocabulary.add_argument("--train-bpe", type=int, default=None, metavar="VOCAB",
                            help="train a byte-level BPE of VOCAB tokens on the inputs (deterministic for the same "
                                 "inputs in the same order), saved as PREFIX.tokenizer/, and tokenize with it")
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

            index = prepare(args.inputs, args.tokenizer, args.out, args.field, args.workers, args.train_bpe)
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


BENCHMARKS = {"moe": "moe_layer.py", "tp": "tp_overlap.py", "dp": "dp_overlap.py", "train": "train_step.py",
              "pp": "pp_schedule.py"}


_HELP = ("-h", "--help")


def _bench_script(name: str) -> Path:
    return Path(__file__).resolve().parents[1] / "benchmarks" / BENCHMARKS[name]


def _bench_usage() -> str:
    """What `moe-overlap bench --help` prints: the usage and each benchmark's first docstring line."""
    lines = ["usage: moe-overlap bench NAME [--nproc N] [the benchmark's options]",
             "", "Runs benchmarks/SCRIPT under torchrun with N local ranks (default 2); "
             "`moe-overlap bench NAME --help` lists its options.", ""]
    for name, script_name in BENCHMARKS.items():
        script = _bench_script(name)
        summary = "(missing: the benchmarks ship with the source checkout)"
        if script.is_file():  # the docstring's opening lines, up to its first blank or indented one
            doc = (ast.get_docstring(ast.parse(script.read_text())) or "").splitlines()
            opening = " ".join(itertools.takewhile(lambda line: line and not line[0].isspace(), doc))
            summary = textwrap.shorten(opening, 96, placeholder=" ...")
        lines.append(f"  {name:<6}{script_name}: {summary}")
    return "\n".join(lines)


def _bench(argv: list[str]) -> int:
    """`moe-overlap bench NAME [--nproc N] [benchmark options]`: the benchmark script under torchrun;
    `bench --help` lists the benchmarks, `bench NAME --help` shows the script's own options (one process)."""
    if argv[:1] and argv[0] in _HELP:
        print(_bench_usage())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        print(f"moe-overlap: bench: name one of {', '.join(BENCHMARKS)} (got {argv[0] if argv else 'nothing'}; "
              "bench --help lists them)", file=sys.stderr)
        return 2
    name, rest, nproc = argv[0], list(argv[1:]), 2
    script = _bench_script(name)
    if not script.is_file():
        print(f"moe-overlap: bench: {script} is missing: the benchmarks ship with the source checkout "
              "(git clone, then pip install -e .)", file=sys.stderr)
        return 2
    if any(item in _HELP for item in rest):
        return subprocess.call([sys.executable, str(script), "--help"])
    if "--nproc" in rest:
        at = rest.index("--nproc")
        value = rest[at + 1] if at + 1 < len(rest) else ""
        if not value.isdigit() or int(value) < 1:
            print(f"moe-overlap: bench: --nproc {value or '(nothing)'}: give a number of ranks >= 1", file=sys.stderr)
            return 2
        nproc = int(value)
        del rest[at:at + 2]
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
            return _info(cfg, args.world_size, args.schedule, args.costs, args.png)
        if args.nproc is not None:
            return _launch(args, cfg)
        return _train(cfg, args.debug)
    except ConfigError as err:
        if args.debug:
            raise
        print(f"moe-overlap: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _launch(args: argparse.Namespace, cfg: Config) -> int:
    """Re-run this command under torchrun with --nproc local ranks (standalone rendezvous), after checking
    what can be checked before any rank starts."""
    if args.nproc < 1:
        raise ConfigError("--nproc", args.nproc, "must be >= 1")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    device_type = launch_device_type(cfg, args.nproc)
    check_before_launch(cfg, args.nproc, device_type)
    gpu_bytes = local_gpu_bytes() if device_type == "cuda" else None
    if gpu_bytes is not None:  # each rank checks its own part again (under a user's torchrun too)
        from moe_overlap.training.state_memory import check_state_fits, largest_state
        from moe_overlap.training.run_setup import mesh_layout
        check_state_fits(*largest_state(cfg, mesh_layout(cfg, args.nproc)), gpu_bytes)
    started = time.time()
    try:
        torchrun(["--standalone", f"--nproc-per-node={args.nproc}", "-m", "moe_overlap", "train", args.config,
                  *args.overrides, *(["--debug"] if args.debug else [])])
    except ChildFailedError as err:  # each rank said why; torchrun's own report would be a traceback
        rank, failure = min(err.failures.items())
        print(f"moe-overlap: rank {rank} exited with code {failure.exitcode} (its message is above)", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as err:  # torchrun relayed the signal to the ranks and waited for them
        return _stopped_by_signal(err.sigval, cfg, started)
    return 0


def launch_device_type(cfg: Config, nproc: int) -> str:
    """The kind of device ``nproc`` local ranks will train on (train.device; auto: CUDA if visible), checked: CUDA
    must be visible with a GPU for every rank."""
    import torch

    wanted = cfg.train.device
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return "cpu"
    visible = torch.cuda.device_count()
    if visible < nproc:
        raise ConfigError("--nproc", nproc, f"needs a GPU per rank (train.device={wanted}): {visible} visible")
    return "cuda"


def local_gpu_bytes() -> int | None:
    """The smallest local GPU's memory in bytes, from nvidia-smi (the launcher creates no CUDA context: it stays
    alive beside the ranks); None where nvidia-smi cannot say."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20, check=True)
        return min(int(line) for line in done.stdout.split()) * 2**20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def check_before_launch(cfg: Config, world_size: int, device_type: str) -> None:
    """What `moe-overlap train` checks before any rank starts: the layout and batch for ``world_size`` ranks on
    ``device_type`` (the rules each rank checks again), the data (the token file, its index, room for
    train.eval_iters) and train.resume against checkpoint.dir. Reads no GPU: a CPU host checks a GPU config."""
    from moe_overlap.config import validate_for_world
    from moe_overlap.training.run_setup import check_inputs

    validate_for_world(cfg, world_size, device_type)
    check_inputs(cfg)


def _stopped_by_signal(sig, cfg: Config, launched_at: float) -> int:
    """0 if the ranks saved a checkpoint for this stop (the ``latest`` pointer says so), else 128 + signal."""
    from moe_overlap.training.checkpoint import LATEST, latest_pointer, step_dir

    root = cfg.checkpoint_dir
    pointer = latest_pointer(root)
    if pointer.get("stopped_by") == sig.name and (root / LATEST).stat().st_mtime >= launched_at:
        return 0
    newest = f"the newest is {step_dir(root, pointer['step'])}" if "step" in pointer else "there is none"
    print(f"moe-overlap: {sig.name}: the ranks stopped without saving a checkpoint for it; {newest}", file=sys.stderr)
    return 128 + int(sig)


def _train(cfg: Config, debug: bool = False) -> int:
    """One rank's run (or the whole run in one process). Its own errors become one line on rank 0 (the other
    ranks' monitors name them to theirs); a failed collective, one line naming the rank that failed."""
    import torch.distributed as dist

    from moe_overlap.distributed.monitor import RankMonitor
    from moe_overlap.training.checkpoint import CheckpointSaveError, step_dir
    from moe_overlap.training.run_setup import init_distributed
    from moe_overlap.training.trainer import Trainer

    owns_group = not dist.is_initialized()  # a caller's group (tests) outlives this run
    monitor = mesh = None
    try:
        mesh, device = init_distributed(cfg)
        monitor = RankMonitor.start(cfg.train.distributed_timeout_s)
        trainer = Trainer(cfg, mesh, device)
        history = trainer.fit(monitor)
    except (ConfigError, CheckpointSaveError, FloatingPointError, KeyboardInterrupt) as err:
        kind, code = next((kind, code) for error_type, kind, code in (
            (ConfigError, "config error", EXIT_BAD_INPUT), (CheckpointSaveError, "checkpoint error", EXIT_SAVE_FAILED),
            (FloatingPointError, "stopped", EXIT_NONFINITE), (KeyboardInterrupt, "interrupted before training",
                                                               EXIT_SIGINT)) if isinstance(err, error_type))
        text = f"{kind}: {err}" if str(err) else kind
        if monitor is not None:
            monitor.finish(text)
        rank = _rank()
        _release_groups(mesh, owns_group)  # every rank stops here alike: nothing is left in flight
        if debug:
            raise
        if rank == 0:
            print(f"moe-overlap: {text}", file=sys.stderr)
        return code
    except (dist.DistError, RuntimeError) as err:
        if not dist.is_initialized() or not _is_collective_failure(err):
            raise
        _exit_on_failed_collective(err, cfg, monitor, debug)
    if monitor is not None:
        monitor.finish()
    rank = _rank()
    if rank == 0 and trainer.stopped_by:
        print(f"moe-overlap: stopped by {trainer.stopped_by} after step {trainer.step}; checkpoint: "
              f"{step_dir(cfg.checkpoint_dir, trainer.step)} (run the same command to resume)", file=sys.stderr)
    elif rank == 0 and history:
        last = history[-1]
        print(f"done: step {last['step']} loss {last['loss']:.4f}"
              + (f" val_loss {last['val_loss']:.4f}" if "val_loss" in last else ""))
    _release_groups(mesh, owns_group)
    return 0


def _release_groups(mesh, owns_group: bool) -> None:
    """The run's process groups go with it (the default group too, unless a caller made it)."""
    import torch.distributed as dist

    if mesh is not None:
        mesh.destroy()
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()


def _exit_on_failed_collective(err: BaseException, cfg: Config, monitor, debug: bool) -> None:
    """One line naming the rank that failed and what it was doing (from the monitor), then exit 3: the process
    group cannot be torn down cleanly with a dead peer."""
    from moe_overlap.distributed.monitor import EXIT_PEER_FAILED

    rank = _rank()
    # The backend's first sentence, without the source location gloo puts before it.
    first_line = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip().split("\n")[0])
    cause = f"{type(err).__name__}: {first_line.split('. ')[0]}"
    found = monitor.wait_for_failure() if monitor is not None else None
    if debug:
        traceback.print_exc()
    if found is not None:
        print(monitor.exit_line(f"a collective failed: {found} ({cause})"), file=sys.stderr, flush=True)
    else:
        print(f"moe-overlap: rank {rank}: a collective failed: a peer rank exited or did not answer within "
              f"train.distributed_timeout_s={cfg.train.distributed_timeout_s}s ({cause})", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_FAILED)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _is_collective_failure(err: BaseException) -> bool:
    import torch.distributed as dist

    text = str(err).lower()
    return isinstance(err, dist.DistError) or any(
        word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def _info(cfg: Config, world_size: int | None, schedule: bool = False, costs: str | None = None,
          png: str | None = None) -> int:
    from moe_overlap.config import validate_for_world
    from moe_overlap.layers.exchange_memory import describe_exchange_memory
    from moe_overlap.models.mixtral import count_parameters
    from moe_overlap.training.data import describe_source
    from moe_overlap.training.run_setup import mesh_layout
    from moe_overlap.training.state_memory import describe_state_memory
    from moe_overlap.training.streams_memory import describe_streams_memory

    p = cfg.parallel
    world_size = world_size or (p.tensor_model_parallel_size * p.context_parallel_size
                                * p.pipeline_model_parallel_size * p.expert_model_parallel_size)
    device_type = "cuda" if cfg.train.device == "cuda" else "cpu"
    validate_for_world(cfg, world_size, device_type)
    wants_schedule = schedule or costs is not None or png is not None
    if wants_schedule and p.pipeline_model_parallel_size == 1:
        raise ConfigError("--schedule", True, "needs parallel.pipeline_model_parallel_size > 1")
    given = None if costs is None else _parse_costs(costs)
    if png is not None and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--png", png, "needs matplotlib: pip install -e '.[plot]'")
    print("# the validated config (every field; `moe-overlap train` reads this YAML back as is)")
    print(config_yaml(cfg), end="")
    print(f"data: {describe_source(cfg)}")
    print(f"parameters: {count_parameters(cfg.model) / 1e6:.2f} M")
    print(f"world size {world_size}: data parallel {cfg.data_parallel_size(world_size)}, "
          f"micro-batches per step {cfg.num_micro_batches(world_size)}")
    for line in (describe_state_memory(cfg, mesh_layout(cfg, world_size))
                 + describe_exchange_memory(cfg, device_type, _moe_calls_in_flight(cfg, world_size))
                 + describe_streams_memory(cfg, mesh_layout(cfg, world_size))):
        print(line)
    print(mesh_layout(cfg, world_size).table())
    if wants_schedule:
        _print_schedule(cfg, world_size, given, png)
    return 0


def _moe_calls_in_flight(cfg: Config, world_size: int) -> int:
    """The MoE layer calls in flight on the first pipeline rank (the trainer's count, from the schedule's bound):
    its units in flight x the most MoE layers of one of its model chunks."""
    from moe_overlap.models.pipeline_stages import PipelineStages
    from moe_overlap.training.schedules import default_schedule, in_flight_bound

    stages = PipelineStages.from_config(cfg)
    name = cfg.train.pipeline_schedule or default_schedule(stages.vpp)
    units = in_flight_bound(name, stages.pp, stages.vpp, cfg.num_micro_batches(world_size), 0,
                            cfg.overlap.overlap_moe_expert_parallel_comm)
    return units * stages.most_moe_layers(0, cfg.model)


def _print_schedule(cfg: Config, world_size: int, given: dict[str, float] | None, png: str | None) -> None:
    """The configured schedule simulated from per-action costs: each rank's timeline and the bubble."""
    from moe_overlap.models.pipeline_stages import PipelineStages, stage_forward_flops
    from moe_overlap.training.schedules import build_schedule, default_schedule, draw, render, simulate

    t = cfg.train
    stages = PipelineStages.from_config(cfg)
    name = t.pipeline_schedule or default_schedule(stages.vpp)
    o = cfg.overlap
    plan = build_schedule(name, stages.pp, stages.vpp, cfg.num_micro_batches(world_size), o.overlap_p2p_comm,
                          o.batch_p2p_comm, paired=o.overlap_moe_expert_parallel_comm is True)
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
