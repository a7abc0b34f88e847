"""Checkpoints through torch.distributed.checkpoint, in logical coordinates, written atomically.

Every tensor is saved under its logical name (one key per expert), so a checkpoint written under one
layout loads under another: a rank asks only for the keys it holds. Replicas of the same key are written
once (DCP deduplicates them); a tensor split over ranks by element ranges (the distributed optimizer's
flat shards) is saved as the pieces each rank holds, in the same logical coordinates
(:func:`flat_range_tensor`), so it reloads under any other split, or as a whole; so is a tensor-parallel
parameter's block (:func:`tp_logical_tensor`). A save goes to ``step_N.tmp`` and is renamed to ``step_N`` only when
complete, then ``latest`` is replaced atomically: a crash mid-save leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import (Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata,
                                                     TensorProperties)

from moe_overlap.distributed.collectives import barrier
from moe_overlap.layers.init import TPShard

_STEP_DIR = re.compile(r"^step_(\d{8})$")
LATEST = "latest"


@contextlib.contextmanager
def _sharded_tensor_quiet():
    """ShardedTensor warns on every use that DTensor replaces it; DTensor cannot describe a flat range of
    a tensor (its shards are even splits of whole dimensions), so the warning has no remedy here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        yield


def _boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split the row-major element range [start, end) of a tensor of ``shape`` into (offsets, sizes)
    boxes, in order: a partial first row, whole rows, a partial last row (recursively). Each box is a
    contiguous run of the range, as DCP chunks must be boxes."""
    if start >= end:
        return []
    if len(shape) == 1:
        return [((start,), (end - start,))]
    row = math.prod(shape[1:])
    boxes = []
    first_row = start // row
    if start % row:  # partial first row
        stop = min(end, (first_row + 1) * row)
        boxes += [((first_row, *o), (1, *s)) for o, s in _boxes(shape[1:], start % row, stop - first_row * row)]
        start = stop
    last_row = end // row
    if start < last_row * row:  # whole rows
        boxes.append(((start // row,) + (0,) * (len(shape) - 1), (last_row - start // row, *shape[1:])))
        start = last_row * row
    if start < end:  # partial last row
        boxes += [((last_row, *o), (1, *s)) for o, s in _boxes(shape[1:], 0, end - start)]
    return boxes


def flat_range_tensor(shape: torch.Size, local: torch.Tensor, ranges: dict[int, tuple[int, int]],
                      blocks: dict[int, tuple[tuple[int, ...], torch.Size]] | None = None) -> torch.Tensor:
    """A logical tensor of ``shape`` held in row-major element ranges: global rank r holds
    ``ranges[r] = (start, end)``, this rank's in the 1-D ``local``. With ``blocks``, rank r's range is of
    the block ``blocks[r] = (offsets, block_shape)`` of the tensor (row-major within it): the block a
    tensor-parallel rank holds. A view of ``local`` when this rank holds all of it; else a ShardedTensor
    whose local shards are views of ``local``, so saving reads it and loading writes into it, with no copy."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if blocks is None and ranges[rank] == (0, shape.numel()):
        return local.view(shape)
    device = local.device
    all_boxes, local_shards = [], []
    for owner, (start, end) in sorted(ranges.items()):
        position = 0
        block_offsets, block_shape = blocks[owner] if blocks is not None else ((0,) * len(shape), shape)
        for offsets, sizes in _boxes(tuple(block_shape), start, end):
            offsets = tuple(a + b for a, b in zip(offsets, block_offsets))
            box = ShardMetadata(list(offsets), list(sizes), f"rank:{owner}/{device}")
            all_boxes.append(box)
            if owner == rank:
                numel = math.prod(sizes)
                local_shards.append(Shard(local[position:position + numel].view(sizes), box))
                position += numel
    metadata = ShardedTensorMetadata(all_boxes, torch.Size(shape), TensorProperties.create_from_tensor(local))
    with _sharded_tensor_quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)


def tp_logical_tensor(local: torch.Tensor, shard: TPShard | None) -> torch.Tensor:
    """A tensor-parallel rank's block (contiguous, in logical axes: ``TPShard.local_shape``) as the logical
    tensor it is part of; ``local`` itself without TP."""
    if shard is None or shard.size == 1:
        return local
    blocks = {rank: (shard.block_offsets(local.shape, index), local.shape) for index, rank in enumerate(shard.ranks)}
    return flat_range_tensor(shard.full_shape(local.shape), local.view(-1),
                             {rank: (0, local.numel()) for rank in shard.ranks}, blocks)


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
    with _sharded_tensor_quiet():
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
    with _sharded_tensor_quiet():
        dcp.load(tensors, checkpoint_id=str(path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    per_rank = path / f"rank_{rank:05d}.pt"
    return torch.load(per_rank, weights_only=False) if per_rank.is_file() else None
