"""Checkpoints through torch.distributed.checkpoint, in logical coordinates, written atomically.

Every tensor is saved under its logical name (one key per expert), so a checkpoint written under one
layout loads under another: a rank asks only for the keys it holds. Replicas of the same key are written
once (DCP deduplicates them). A save goes to ``step_N.tmp`` and is renamed to ``step_N`` only when
complete, then ``latest`` is replaced atomically: a crash mid-save leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from moe_overlap.distributed.collectives import barrier

_STEP_DIR = re.compile(r"^step_(\d{8})$")
LATEST = "latest"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_step(root: Path) -> int | None:
    """The step of the newest complete checkpoint under ``root`` (None if there is none)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    step = json.loads(pointer.read_text())["step"]
    return step if step_dir(root, step).is_dir() else None


def save_checkpoint(root: Path, step: int, tensors: dict[str, torch.Tensor], per_rank: dict[str, Any],
                    keep_last: int) -> Path:
    """Save on every rank together. ``per_rank`` (RNG states and the like) goes to one small file per rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final, tmp = step_dir(root, step), root / f"step_{step:08d}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        tmp.mkdir()
    barrier()
    dcp.save(tensors, checkpoint_id=str(tmp))
    torch.save(per_rank, tmp / f"rank_{rank:05d}.pt")
    barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_atomically(root / LATEST, json.dumps({"step": step}))
        for old in sorted(_complete_steps(root))[:-keep_last]:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)
    barrier()
    return final


def _complete_steps(root: Path) -> list[int]:
    return [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]


def load_checkpoint(root: Path, step: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """Load the keys of ``tensors`` in place; returns this rank's per-rank file, or None if the saving
    layout had no such rank (a resume onto more ranks)."""
    path = step_dir(root, step)
    dcp.load(tensors, checkpoint_id=str(path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    per_rank = path / f"rank_{rank:05d}.pt"
    return torch.load(per_rank, weights_only=False) if per_rank.is_file() else None
