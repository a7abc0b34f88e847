"""What every benchmark records beside its numbers: device, world size, date, command, environment."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

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
