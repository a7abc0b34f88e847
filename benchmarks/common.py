"""What every benchmark records beside its numbers: device, world size, date, command, environment."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

# NVLink multicast stays off on shared hosts: set before any process group exists.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RECORDED_ENV = tuple(MULTICAST_OFF) + ("NCCL_P2P_DISABLE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def disable_multicast(opt_in: bool = False) -> None:
    if not opt_in:
        os.environ.update(MULTICAST_OFF)


def run_header(world_size: int) -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "device": f"{world_size}x {device}" if world_size > 1 else device,
        "world_size": world_size,
        "date": datetime.date.today().isoformat(),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "env": {name: os.environ.get(name) for name in RECORDED_ENV},
        "torch": torch.__version__,
    }


def write_json(path: str | None, header: dict, rows: list[dict]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(dict(header, rows=rows), indent=2) + "\n")


def round_robin(variants: dict[str, Callable[[], object]], rounds: int, warmup: int, device) -> dict[str, float]:
    """Median milliseconds of each variant, timed A B C A B C ... (clocks drift under load: DESIGN.md), ranks
    aligned by a barrier before each run; the slowest rank's median (a single process needs no process group)."""
    import torch.distributed as dist

    from moe_overlap.distributed.streams import Event, synchronize

    distributed = dist.is_initialized()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(warmup + rounds):
        for name, fn in variants.items():
            synchronize(device)
            if distributed:
                dist.barrier()
            start = Event(device, timing=True).record()
            fn()
            end = Event(device, timing=True).record()
            synchronize(device)
            if index >= warmup:
                samples[name].append(start.elapsed_ms(end))
    medians = torch.tensor([statistics.median(samples[name]) for name in variants], dtype=torch.float64,
                           device=device)  # NCCL reduces device tensors only
    if distributed:
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(variants, medians.tolist()))


def device_spans(prof) -> list[tuple[int, str, float, float]]:
    """(stream, kernel or copy name, start us, end us) of every device event a torch profiler recorded."""
    spans = []
    for event in prof.profiler.kineto_results.events():
        if event.device_type().name == "CUDA" and event.duration_ns() > 0:
            start = event.start_ns() / 1e3
            spans.append((event.device_resource_id(), event.name(), start, start + event.duration_ns() / 1e3))
    return spans


def span_kind(name: str) -> str:
    name = name.lower()
    return "copy" if "memcpy" in name else ("nccl" if "nccl" in name else "kernel")


def draw_timeline(prof, path: str, title: str) -> None:
    """Lanes per CUDA stream from the profiler's device events: kernels, peer copies, NCCL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [(f"stream {stream} {span_kind(name)}", start, end) for stream, name, start, end in device_spans(prof)]
    if not spans:
        print("timeline: the profiler recorded no device events")
        return
    t0 = min(start for _, start, _ in spans)
    lanes = sorted({lane for lane, _, _ in spans})
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(lanes)))
    colors = {"kernel": "tab:blue", "copy": "tab:orange", "nccl": "tab:red"}
    for y, lane in enumerate(lanes):
        bars = [((start - t0) / 1e3, (end - start) / 1e3) for l, start, end in spans if l == lane]
        ax.broken_barh(bars, (y - 0.4, 0.8), color=colors[lane.rsplit(" ", 1)[1]])
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("ms")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"timeline: {path}")
