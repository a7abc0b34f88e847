"""Training-step throughput of a config at any world size, with the two rows that say what it means: the same
run without the exchange's transfers (``compute_only``) and the config on one GPU (``ep1``).

    python benchmarks/train_step.py configs/bench_mixtral_2l.yaml --json out.json --timeline out.png   # one GPU
    torchrun --nproc-per-node 4 benchmarks/train_step.py configs/bench_fine_8l.yaml \\
        parallel.expert_model_parallel_size=4 train.use_distributed_optimizer=true \\
        --variant pipeline2:overlap.moe_pipeline=true,overlap.moe_pipeline_chunks=2 \\
        --compute-only --ep1 --json out.json --timeline out.png

Rows (one launch; ep1 first, the others in this order, the reference rows before the variants, so that a variant
that hangs or runs out of memory costs them nothing; each builds its own model, so they run one after another, not
round-robin: compare rows of one launch, and repeat a launch to see its spread):
  config        the config with the command line's overrides
  compute_only  (``--compute-only``) the config with ``overlap.moe_compute_only=true`` (and the MoE pipeline on
                if the config has it off: the serial path has no such mode): every exchange keeps its sizes, signals
                and small messages, so each layer still waits for the most loaded rank, but rows stay on their
                rank; each rank's expert GEMMs run on exactly the rows it would have received. The limit of
                hiding the transfers. Its loss means nothing. It routes every token as the config row did
                (layers/routing_replay.py: its MoE outputs, which later layers route on, are not the config
                row's), so that both wait for the same most loaded rank; where that is not implemented (SP, CP,
                full recomputation) or with ``--compute-only-routing own``, by its own routing (its row's
                ``routing`` says which). So does every variant that sets overlap.moe_compute_only=true.
  ep1           (``--ep1``) the config as the file has it (or with ``--ep1-overrides``) on one GPU of the same
                machine, rank 0's, first (in a process of its own, while the other ranks wait to join); per-GPU
                tokens/s over ep1's is the weak-scaling efficiency
  NAME          each ``--variant NAME:section.field=value,...``: those overrides on top
Weak scaling: unless ``--no-scale-batch``, train.global_batch_size is multiplied by the data-parallel size, so each
rank runs the config's micro-batches at any world size (the ep1 row runs the file's own batch).

Each row: tokens/s of the job, per-GPU TFLOP/s and MFU (medians of the timed steps; MFU against
train.peak_tflops, beside this GPU's measured bf16 GEMM rate), every timed step's time and their mean, ``vs_ep1``
(per-GPU tokens/s over ep1's) and ``vs_compute_only`` (step time over compute_only's; none where compute_only's loss
is not finite, a row then marked ``not_a_limit``), the maximum over ranks of peak memory (torch's allocator peak
plus symmetric-memory regions, which that allocator does not see), exposed communication per kind (every wait of
the compute stream or host for another rank, CUDA-graph replays included: median over steps, per rank and its
maximum), the pipelined exchange's bytes to other ranks per step (``moe_exchange_gib``: the most any rank sent), routing
imbalance per MoE layer (copies on the most loaded EP rank over the mean, and on the most
loaded expert over the mean; median over steps; and per micro-batch, which is what each exchange waits for), the
profiled steps' compute-stream time by kind of work per rank, and ``resolved``: the settings the run used once
``auto`` was resolved. A timeline PNG per row (rank 0).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_header, set_run_env, write_json  # noqa: E402
from benchmarks.memory_peak import peak_summary, pools_and_streams, recording  # noqa: E402

# What torchrun sets for its ranks: the ep1 row's single process must not see them.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "GROUP_WORLD_SIZE", "ROLE_NAME")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.field=value for every row but ep1")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps profiled after the timed ones (0: none)")
    parser.add_argument("--variant", action="append", default=[], help="NAME:section.field=value,...")
    parser.add_argument("--compute-only", action="store_true", help="add the compute_only row")
    parser.add_argument("--compute-only-routing", choices=("replayed", "own"), default="replayed",
                        help="how the compute-only rows route: as the config row did (default), or by their own "
                             "routing (as before 2026-11-30: real text then routes otherwise)")
    parser.add_argument("--ep1", action="store_true", help="add the ep1 row (the config on one GPU)")
    parser.add_argument("--ep1-overrides", default="", help="section.field=value,... for the ep1 row only")
    parser.add_argument("--no-scale-batch", action="store_true",
                        help="keep train.global_batch_size as given (default: times the data-parallel size)")
    parser.add_argument("--fabric", choices=("nvlink", "slow"), default="nvlink",
                        help="slow: NCCL through host memory (NCCL_P2P_DISABLE=1), an inter-node stand-in")
    parser.add_argument("--memory-peak", action="store_true",
                        help="record the allocator's history and report what is live at each row's peak "
                             "(benchmarks/memory_peak.py; the row's times then mean nothing)")
    parser.add_argument("--memory-pools", action="store_true",
                        help="report what the allocator holds after each row's steps, per memory pool and stream")
    parser.add_argument("--memory-cap-gib", type=float, default=None,
                        help="cap torch's allocator at this many GiB per GPU (set_per_process_memory_fraction): "
                             "a smaller card's memory, for whether a row fits it and what the cap costs")
    parser.add_argument("--stacks-after-s", type=float, default=None,
                        help="a row still running after this many seconds prints every thread's Python stack on "
                             "every rank (where each rank's host is when a row hangs)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeline", default=None, help="PNG of the profiled steps (per row: NAME inserted)")
    return parser.parse_args(argv)


def rows_to_run(args) -> list[tuple[str, list[str]]]:
    out = [("config", [])]
    if args.compute_only:
        out.append(("compute_only", ["overlap.moe_pipeline=true", "overlap.moe_compute_only=true"]))
    for spec in args.variant:
        name, _, overrides = spec.partition(":")
        if not name or name in ("config", "compute_only", "ep1") or name in dict(out):
            raise SystemExit(f"--variant {spec!r}: needs a new NAME (not config, compute_only or ep1) before ':'")
        out.append((name, [item for item in overrides.split(",") if item]))
    return out


def load_row_config(args, overrides: list[str], out_dir: Path, world_size: int):
    """The row's config: the benchmark's own settings (steps, profile, no checkpoints) last, the global batch
    scaled to the data-parallel size (weak scaling)."""
    from moe_overlap.config import load_config

    total = args.warmup + args.steps + args.profile_steps
    profile = [f"train.profile_steps=[{total - args.profile_steps + 1},{total}]",
               f"train.profile_ranks={list(range(world_size))}"] if args.profile_steps else []
    fixed = profile + [f"train.max_steps={total}", "train.eval_interval=0", "checkpoint.save_final=false",
                       "checkpoint.save_interval=0", "train.resume=false", f"train.output_dir={out_dir}"]
    cfg = load_config(args.config, overrides + fixed)
    if not args.no_scale_batch:
        cfg.train.global_batch_size *= cfg.data_parallel_size(world_size)
    return cfg


def median_of(steps: list[dict], key: str) -> float:
    return statistics.median(m[key] for m in steps)


def per_layer_median(steps: list[dict], key: str) -> dict[str, float]:
    layers = steps[0].get(key, {})
    return {layer: round(statistics.median(m[key][layer] for m in steps), 4) for layer in layers}


def run_row(name: str, overrides: list[str], args, out_dir: Path, replay=None) -> dict | None:
    """Train the row's steps on every rank; rank 0 returns the row (every rank's part gathered), others None.
    ``replay``: the RoutingReplay the row records its routing into, or replays (layers/routing_replay.py)."""
    import torch
    import torch.distributed as dist

    from moe_overlap.models.mixtral import count_parameters
    from moe_overlap.training.profiling import measured_gemm_tflops
    from moe_overlap.training.run_setup import init_distributed
    from moe_overlap.training.trainer import Trainer

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    all_overrides = args.overrides + overrides
    cfg = load_row_config(args, all_overrides, out_dir / name, world)
    mesh, device = init_distributed(cfg)
    left_gib = 0.0  # what earlier rows of this process left allocated (counted in this row's peak)
    if device.type == "cuda" and torch.cuda.is_initialized():  # an earlier row's peak is not this one's
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
        left_gib = torch.cuda.memory_allocated(device) / 2**30
    used_at_start_gib = 0.0  # on the whole device, this process's CUDA context and earlier rows' leftovers included
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_at_start_gib = (total - free) / 2**30
    if args.stacks_after_s:
        faulthandler.dump_traceback_later(args.stacks_after_s)
    if device.type == "cuda" and args.memory_cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), device)
    recorded = args.memory_peak and device.type == "cuda"
    if recorded:
        recording()
    trainer = Trainer(cfg, mesh, device, routing_replay=replay)
    history = trainer.fit()
    faulthandler.cancel_dump_traceback_later()
    timed = history[args.warmup:args.warmup + args.steps]
    mine = {  # this rank's part
        "rank": mesh.rank,
        "peak_memory_gib": rank_peak_gib(device),  # the metrics' peak_memory_gib is the maximum over ranks already
        "reserved_memory_gib": rank_peak_gib(device, reserved=True),
        "symmetric_memory_gib": max((m.get("symmetric_memory_gib", 0.0) for m in history), default=0.0),
        "exposed_comm_ms": {kind: round(statistics.median(m["exposed_comm_ms"][kind] for m in timed), 3)
                            for kind in timed[0]["exposed_comm_ms"]},
        "step_time_s": median_of(timed, "step_time_s"),
        "left_allocated_gib": left_gib,
        "used_at_start_gib": used_at_start_gib,
    }
    if recorded:
        mine["memory_peak"] = peak_summary(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # the allocator ran out of room and freed its cached blocks to try again (a capped row's cost), and what this
        # process holds outside the allocator (the CUDA context, NCCL, symmetric regions): with the cap, the card
        # it needs
        mine["alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        mine["outside_allocator_gib"] = (total - free - torch.cuda.memory_reserved(device)) / 2**30
        if args.memory_pools:
            mine["pools_and_streams"] = pools_and_streams(device)
    breakdown = Path(cfg.train.output_dir) / "profile" / f"breakdown_rank{mesh.rank}.json"
    if breakdown.is_file():
        mine["profile"] = json.loads(breakdown.read_text())
    parts = [mine]
    if dist.is_initialized():
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    resolved, losses = trainer.resolved_settings(), (history[0]["loss"], history[-1]["loss"])
    # before the release: its GEMM's cuBLAS workspace goes with the row's
    gemm_tflops = measured_gemm_tflops(device) if device.type == "cuda" and mesh.rank == 0 else None
    del trainer, history
    release_memory()
    if dist.is_initialized():  # the next row builds its own groups; this one's communicators go
        dist.barrier()
        mesh.destroy()
    if mesh.rank != 0:
        return None
    row = {
        "variant": name, "overrides": all_overrides, "config": args.config,
        "parameters": count_parameters(cfg.model), "world_size": world,
        "tokens_per_step": cfg.train.global_batch_size * cfg.model.seq_length,
        "micro_batch_size": cfg.train.micro_batch_size, "global_batch_size": cfg.train.global_batch_size,
        "micro_batches_per_rank": cfg.num_micro_batches(world),
        "steps_timed": len(timed), "tokens_per_s": median_of(timed, "tokens_per_s"),
        "tokens_per_s_per_gpu": median_of(timed, "tokens_per_s") / world,
        "step_time_s": median_of(timed, "step_time_s"), "step_time_s_per_rank": [p["step_time_s"] for p in parts],
        # every timed step, rank 0's: a median hides a step that ran again (moe_overflow_reruns)
        "step_times_s": [round(m["step_time_s"], 5) for m in timed],
        "step_time_s_mean": statistics.fmean(m["step_time_s"] for m in timed),
        "tflops_per_gpu": median_of(timed, "tflops_per_gpu"), "mfu": median_of(timed, "mfu"),
        "peak_tflops": cfg.train.peak_tflops,
        "gemm_tflops_measured": gemm_tflops,
        "peak_memory_gib": max(p["peak_memory_gib"] for p in parts),
        "peak_memory_gib_per_rank": [round(p["peak_memory_gib"], 3) for p in parts],
        # the allocator's reserved peak plus symmetric memory: graph pools and the allocator's cache included
        "reserved_memory_gib": max(p["reserved_memory_gib"] for p in parts),
        "symmetric_memory_gib": max(p["symmetric_memory_gib"] for p in parts),
        "left_allocated_gib": round(max(p["left_allocated_gib"] for p in parts), 4),
        "device_used_at_start_gib": round(max(p["used_at_start_gib"] for p in parts), 3),
        "memory_cap_gib": args.memory_cap_gib,
        "alloc_retries_per_rank": [p.get("alloc_retries") for p in parts],
        "outside_allocator_gib": round(max(p.get("outside_allocator_gib", 0.0) for p in parts), 3),
        **({"pools_and_streams_per_rank": [p.get("pools_and_streams") for p in parts]} if args.memory_pools else {}),
        **({"memory_peak_per_rank": [p.get("memory_peak") for p in parts]} if args.memory_peak else {}),
        "exposed_comm_ms": {kind: max(p["exposed_comm_ms"][kind] for p in parts)
                            for kind in parts[0]["exposed_comm_ms"]},
        "exposed_comm_ms_per_rank": [p["exposed_comm_ms"] for p in parts],
        "ep_imbalance": per_layer_median(timed, "ep_imbalance") if "ep_imbalance" in timed[0] else {},
        "expert_imbalance": per_layer_median(timed, "expert_imbalance") if "expert_imbalance" in timed[0] else {},
        # each micro-batch's exchange waits for its own most loaded rank: per layer, the median over the timed steps
        # of a step's mean over its micro-batches, and the worst micro-batch of any timed step (absent at EP=1)
        "ep_imbalance_micro_batch": {
            layer: {"mean": round(statistics.median(m["ep_imbalance_micro_batch"][layer]["mean"] for m in timed), 4),
                    "max": round(max(m["ep_imbalance_micro_batch"][layer]["max"] for m in timed), 4)}
            for layer in timed[0].get("ep_imbalance_micro_batch", {})},
        "resolved": resolved,
        "routing": {"data_path": cfg.data.path or "bundled byte-level corpus",
                    "force_load_balancing": cfg.model.moe_router_force_load_balancing,
                    "replayed_from_config": replay is not None and replay.replaying},
        "loss_first": losses[0], "loss_last": losses[1],
        # the device-planned exchange's bound (overlap.moe_expert_rank_capacity_factor): steps run again, rows past
        # the chunks' bounds, and of those the ones no overflow chunk took, over the timed steps (a step run again:
        # its step_time_s counts the wasted attempt)
        "moe_overflow_reruns": sum(m.get("moe_overflow_reruns", 0) for m in timed),
        "moe_overflow_rows": sum(m.get("moe_overflow_rows", 0) for m in timed),
        "moe_rerun_rows": sum(m.get("moe_rerun_rows", 0) for m in timed),
        # the pipelined exchange's bytes to other ranks per step, the most any rank sent (median over the timed steps)
        "moe_exchange_gib": (median_of(timed, "moe_exchange_gib") if "moe_exchange_gib" in timed[0] else None),
    }
    if "profile" in parts[0]:
        row["profile_per_rank"] = [p.get("profile") for p in parts]
    copy_timeline(args, name, Path(cfg.train.output_dir) / "profile" / "timeline_rank0.png")
    return row


def routing_replays(args, world: int, rows: list[tuple[str, list[str]]]) -> dict:
    """By row name: the config row records its routing, and each compute-only row (``compute_only``, or a variant
    with overlap.moe_compute_only=true) replays it, where the layout can replay routing (else they route by their
    own)."""
    from moe_overlap.layers.routing_replay import RoutingReplay, replay_refusal

    replaying = [name for name, overrides in rows if "overlap.moe_compute_only=true" in args.overrides + overrides]
    if not replaying or "config" in replaying or args.compute_only_routing == "own":
        return {}
    refusal = replay_refusal(load_row_config(args, args.overrides, Path(tempfile.gettempdir()), world))
    if refusal is not None:
        print(f"train_step: the compute-only rows route by their own routing ({refusal})", file=sys.stderr)
        return {}
    recording = RoutingReplay()
    return {"config": recording, **{name: RoutingReplay(recording.recorded) for name in replaying}}


def rank_peak_gib(device, reserved: bool = False) -> float:
    """This rank's peak: torch's allocator peak (allocated, or ``reserved``: what it holds, graph pools included) plus
    the symmetric memory it does not see."""
    import torch

    from moe_overlap.distributed.symm import symmetric_memory_bytes

    if device.type != "cuda":
        return 0.0
    peak = torch.cuda.max_memory_reserved(device) if reserved else torch.cuda.max_memory_allocated(device)
    return (peak + symmetric_memory_bytes()) / 2**30


def copy_timeline(args, name: str, timeline: Path) -> None:
    if args.timeline and timeline.is_file():
        target = Path(args.timeline)
        if name != "config":
            target = target.with_name(f"{target.stem}_{name}{target.suffix}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(timeline, target)


def run_ep1(args, tmp: Path) -> dict:
    """The config on one GPU (rank 0's), in a process of its own, before rank 0 touches its GPU: after the other
    rows, memory this process still held (its CUDA context, symmetric regions) left ep1 short of it. The other
    ranks wait meanwhile to join the first row's group (collectives.JOIN_TIMEOUT)."""
    import torch

    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[local] if visible else str(local)
    out = tmp / "ep1.json"
    timeline = [] if not args.timeline else ["--timeline", str(Path(args.timeline).with_name(
        f"{Path(args.timeline).stem}_ep1{Path(args.timeline).suffix}"))]
    cmd = [sys.executable, str(Path(__file__).resolve()), args.config,
           *[item for item in args.ep1_overrides.split(",") if item], "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--profile-steps", str(args.profile_steps), "--json", str(out), *timeline]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"variant": "ep1", "error": f"exit {done.returncode}: {done.stderr[-3000:]}"}
    result = json.loads(out.read_text())
    return dict(result["rows"][0], variant="ep1", device=result["device"])


def release_memory() -> None:
    """Drop the finished row's model, optimizer and graphs (autograd keeps reference cycles) and return the
    cached blocks, so the next row starts from an empty device and its peak memory is its own. cuBLAS keeps a
    workspace per stream that ran a GEMM, allocated by torch and never freed: each row's new streams left 64 MiB
    more allocated, counted in every later row's peak (1xH200, evidence_gpu.sh rowmem1,
    train_step_row_memory_1xh200.txt: 0.19, 0.25, 0.31 GiB after three rows of the fine model; 0 once cleared)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # a CUDA build's
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


def relate(rows: list[dict]) -> None:
    """Each row against the reference rows of the same launch. A compute_only row whose loss is not finite is no
    limit: the optimizer skipped its steps and its GEMMs ran on NaN (2 and 4 H100s, 2026-11-27: faster than the
    same work can run); it is marked so and nothing is divided by it."""
    by_name = {row["variant"]: row for row in rows if "error" not in row}
    ep1, compute_only = by_name.get("ep1"), by_name.get("compute_only")
    if compute_only is not None and not all(math.isfinite(compute_only.get(key, 0.0))
                                            for key in ("loss_first", "loss_last")):
        compute_only["not_a_limit"] = "loss not finite: the optimizer skipped its steps, its GEMMs ran on NaN"
        print(f"train_step: compute_only is not a limit here ({compute_only['not_a_limit']})", file=sys.stderr)
        compute_only = None
    for row in by_name.values():
        if ep1 is not None:
            row["vs_ep1"] = round(row["tokens_per_s_per_gpu"] / ep1["tokens_per_s_per_gpu"], 4)
        if compute_only is not None:
            row["vs_compute_only"] = round(row["step_time_s"] / compute_only["step_time_s"], 4)
            if row is not compute_only and row.get("profile_per_rank") and compute_only.get("profile_per_rank"):
                row["split_vs_compute_only"] = [split_against(mine, limit) for mine, limit in
                                                zip(row["profile_per_rank"], compute_only["profile_per_rank"])]


def kernel_ms(profile: dict) -> dict[str, float]:
    """A rank's profiled step: kernel ms by kind, summed over every stream (with pairs on two streams a kind's
    kernels run on both), and the window and the time no stream ran anything."""
    breakdown, streams = profile["breakdown"], profile["streams"]
    by_kind: dict[str, float] = {}
    for part in (breakdown["compute_stream_ms"], breakdown["other_streams_ms"]):
        for kind, ms in part.items():
            if kind != "idle":
                by_kind[kind] = by_kind.get(kind, 0.0) + ms
    return dict(by_kind, window=streams["window_ms"], no_stream_running=streams["device_idle_ms"])


def split_against(profile: dict | None, limit: dict | None) -> dict[str, float] | None:
    """Where a rank's profiled step differs from compute_only's (ms, this row's minus the limit's): kernel time by
    kind over every stream, the window and the GPU's idle time. The split a missed step-vs-compute_only target asks
    for: more kernel time (the exchange's own kernels, others slowed beside them) or more idle (waits, the host)."""
    if not profile or not limit or "skipped" in profile["breakdown"] or "skipped" in limit["breakdown"]:
        return None  # no device events (the CPU)
    mine, theirs = kernel_ms(profile), kernel_ms(limit)
    return {kind: round(mine.get(kind, 0.0) - theirs.get(kind, 0.0), 1) for kind in sorted({*mine, *theirs})}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    set_run_env(fabric=args.fabric)
    import torch.distributed as dist

    rows: list[dict] = []
    world = int(os.environ.get("WORLD_SIZE", 1))

    def save() -> None:  # after every row: a launch cut short keeps what it measured
        relate(rows)
        header = dict(run_header(world), order=[row["variant"] for row in rows], config=args.config,
                      overrides=args.overrides, weak_scaling=not args.no_scale_batch, fabric=args.fabric)
        write_json(args.json, header, rows)

    with tempfile.TemporaryDirectory(prefix="train_step_") as tmp:
        if args.ep1 and int(os.environ.get("RANK", 0)) == 0:  # first: this process holds nothing on the GPU yet
            rows.append(run_ep1(args, Path(tmp)))
            save()
            print(json.dumps({k: rows[-1].get(k) for k in ("variant", "tokens_per_s", "mfu", "error")}), flush=True)
        replays = routing_replays(args, world, rows_to_run(args))
        for name, overrides in rows_to_run(args):
            row = run_row(name, overrides, args, Path(tmp), replays.get(name))
            if row is not None:
                rows.append(row)
                save()
                print(json.dumps({k: row[k] for k in ("variant", "tokens_per_s", "tflops_per_gpu", "mfu",
                                                      "peak_memory_gib", "reserved_memory_gib", "exposed_comm_ms",
                                                      "moe_overflow_reruns")}),
                      flush=True)
        if dist.is_initialized():
            dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
