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
RECORDED_ENV = tuple(MULTICAST_OFF) + ("NCCL_P2P_DISABLE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
                                       "PYTORCH_CUDA_ALLOC_CONF")


def set_run_env(allow_multicast: bool = False, fabric: str = "nvlink") -> None:
    """Before any process group exists: NVLink multicast off (unless opted in); ``fabric="slow"``: NCCL through
    host memory (NCCL_P2P_DISABLE=1), standing in for an inter-node link."""
    if not allow_multicast:
        os.environ.update(MULTICAST_OFF)
    if fabric == "slow":
        os.environ["NCCL_P2P_DISABLE"] = "1"


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
    """Median milliseconds of each variant, timed A B C A B C ... (clocks drift under load: README, "What overlaps on
    Hopper"), ranks aligned by a barrier before each run; the slowest rank's median (a single process needs no process
    group)."""
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


def kernel_times(fn: Callable[[], object], calls: int) -> dict[str, tuple[float, int]]:
    """The GPU kernels of ``calls`` calls of ``fn`` under torch.profiler (after one call unprofiled): per kernel name,
    (ms per call, launches per call), the longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = {e.key: (e.device_time_total / calls / 1000, e.count // calls) for e in prof.key_averages()
               if e.device_time_total > 0}
    return dict(sorted(kernels.items(), key=lambda kernel: -kernel[1][0]))
