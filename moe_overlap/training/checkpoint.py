"""Checkpoints through torch.distributed.checkpoint, in logical coordinates, written atomically.

Every tensor is saved under its logical name (one key per expert), so a checkpoint written under one
layout loads under another: a rank asks only for the keys it holds. Replicas of the same key are written
once (DCP deduplicates them); a tensor split over ranks by element ranges (the distributed optimizer's
flat shards) is saved as the pieces each rank holds, in the same logical coordinates
(:func:`flat_range_tensor`), so it reloads under any other split, or as a whole; so is a tensor-parallel
parameter's block (:func:`tp_logical_tensor`). A save goes to ``step_N.tmp`` and is renamed to ``step_N`` only when
complete, then ``latest`` is replaced atomically: a crash mid-save leaves the previous checkpoint loadable.

A complete checkpoint holds ``manifest.json``: every file's size and CRC-32, written after all ranks' files
(each rank checksums a share). Resuming takes the newest checkpoint whose files match it; a damaged newer one
is moved aside to ``step_N.damaged`` (never deleted). A save that fails on any rank (disk full, read-only)
fails on every rank with one :class:`CheckpointSaveError`, leaves no partial directory and deletes nothing;
``keep_last`` prunes only after a save is complete, so the newest good checkpoint always survives.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import (Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata,
                                                     TensorProperties)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moe_overlap.config import ConfigError
from moe_overlap.layers.param_info import TPShard

_STEP_DIR = re.compile(r"^step_(\d{8})$")
LATEST = "latest"
MANIFEST = "manifest.json"
DAMAGED_SUFFIX = ".damaged"
_CRC_CHUNK = 1 << 24


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; raised on every rank. The earlier checkpoints are untouched."""


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
    """The step the ``latest`` pointer names, if that checkpoint is there (None if there is none)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    step = json.loads(pointer.read_text())["step"]
    return step if step_dir(root, step).is_dir() else None


def latest_pointer(root: Path) -> dict:
    """The ``latest`` pointer's fields ({} without one): ``step``, and ``stopped_by`` (a signal name or
    train.exit_duration_min) when a stop request wrote it."""
    try:
        return json.loads((root / LATEST).read_text())
    except (OSError, ValueError):
        return {}


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _agree(local: Any) -> list[Any]:
    """Every rank's ``local``, in rank order (a collective over the world: every rank decides alike)."""
    if not dist.is_initialized():
        return [local]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def _one_line(err: BaseException) -> str:
    """An exception as one line; DCP's CheckpointException as its first failing rank's own error."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (inner, _) = next(iter(sorted(err.failures.items(), key=lambda item: item[0])))
        return f"rank {rank}: {_one_line(inner)}"
    return " ".join(f"{type(err).__name__}: {err}".split())


def _raise_if_failed(errors: list[str | None], step: int, root: Path) -> None:
    failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if not failed:
        return
    rank, error = failed[0]
    where = error if error.startswith("rank ") else f"rank {rank}: {error}"
    previous = max(complete_steps(root), default=None)
    kept = (f"the newest complete checkpoint, {step_dir(root, previous)}, is kept" if previous is not None
            else "there is no earlier checkpoint")
    with contextlib.suppress(OSError):  # torch's writers report a full disk as a bare short write
        where += f" ({shutil.disk_usage(root).free / 2**30:.1f} GiB free there)"
    raise CheckpointSaveError(f"checkpoint save of step {step} to {step_dir(root, step)} failed on {where}; {kept}")


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def save_checkpoint(root: Path, step: int, tensors: dict[str, torch.Tensor], per_rank: dict[str, Any],
                    keep_last: int, stopped_by: str | None = None) -> Path:
    """Save on every rank together. ``per_rank`` (RNG states and the like) goes to one small file per rank.
    ``stopped_by`` is recorded in the ``latest`` pointer (a stop request's save). Raises
    :class:`CheckpointSaveError` on every rank if any rank's part failed."""
    rank, world = _rank_and_world()
    final, tmp = step_dir(root, step), root / f"step_{step:08d}.tmp"

    def rank0(action) -> str | None:
        """Run ``action`` on rank 0; its error (if any) as one line."""
        if rank != 0:
            return None
        try:
            action()
        except OSError as err:
            return _one_line(err)
        return None

    def fail_if_any(errors: list[str | None]) -> None:
        if any(errors):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # no partial directory stays behind
            _raise_if_failed(errors, step, root)

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        tmp.mkdir()

    fail_if_any(_agree(rank0(prepare)))
    error = None
    try:
        with _sharded_tensor_quiet():
            dcp.save(tensors, checkpoint_id=str(tmp))
        torch.save(per_rank, tmp / f"rank_{rank:05d}.pt")
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        error = _one_line(err)
    fail_if_any(_agree(error))
    # Every rank's files are written: each checksums a share of them (page-cache reads, in parallel).
    entries, error = {}, None
    try:
        names = sorted(p.name for p in tmp.iterdir())
        entries = {name: {"bytes": (tmp / name).stat().st_size, "crc32": _crc32(tmp / name)}
                   for name in names[rank::world]}
    except OSError as err:
        error = _one_line(err)
    gathered = _agree((error, entries))
    fail_if_any([error for error, _ in gathered])

    def publish() -> None:
        files = {name: entry for _, part in gathered for name, entry in part.items()}
        _write_atomically(tmp / MANIFEST, json.dumps({"step": step, "files": files}, sort_keys=True))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest = {"step": step} | ({"stopped_by": stopped_by} if stopped_by else {})
        _write_atomically(root / LATEST, json.dumps(latest))
        for old in sorted(complete_steps(root))[:-keep_last]:  # the new one is complete: prune the oldest
            shutil.rmtree(step_dir(root, old), ignore_errors=True)

    fail_if_any(_agree(rank0(publish)))
    return final


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root`` (none if it does not exist)."""
    if not root.is_dir():
        return []
    return [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]


def _damage(path: Path) -> str | None:
    """What is wrong with a complete checkpoint's files against its manifest (this rank's share of them),
    or None. A checkpoint written before manifests existed has nothing to check against."""
    rank, world = _rank_and_world()
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return None
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (OSError, ValueError, KeyError) as err:
        return f"its {MANIFEST} is unreadable ({_one_line(err)})"
    for name in sorted(files)[rank::world]:
        want = files[name]
        try:
            size = (path / name).stat().st_size
            if size != want["bytes"]:
                return f"{name} holds {size} bytes, the manifest says {want['bytes']} (truncated?)"
            if _crc32(path / name) != want["crc32"]:
                return f"{name} fails its CRC-32 check (corrupt)"
        except OSError as err:
            return f"{name}: {_one_line(err)}"
    return None


def newest_good_checkpoint(root: Path) -> tuple[int | None, list[tuple[int, str]]]:
    """The step of the newest complete checkpoint under ``root`` whose files match its manifest (None if
    none), and the newer ones that did not, with what is wrong; moved aside to ``step_N.damaged``. The
    same on every rank (a collective: each rank checks a share of the files)."""
    rank, _ = _rank_and_world()
    steps = sorted(complete_steps(root), reverse=True) if rank == 0 else []
    if dist.is_initialized():
        holder = [steps]
        dist.broadcast_object_list(holder, src=0)
        steps = holder[0]
    damaged = []
    for step in steps:
        problems = [p for p in _agree(_damage(step_dir(root, step))) if p is not None]
        if not problems:
            return step, damaged
        damaged.append((step, problems[0]))
        if rank == 0:
            path = step_dir(root, step)
            os.replace(path, path.with_name(path.name + DAMAGED_SUFFIX))
    return None, damaged


def check_checkpoint_matches(root: Path, step: int, tensors: dict[str, torch.Tensor]) -> None:
    """Raise a ConfigError naming every key this model needs that the checkpoint lacks or holds in another
    shape, and every model tensor it holds that this model lacks (a collective: the union of all ranks' keys).
    Extra optimizer tensors are no mismatch (a bf16 run's fp32 masters, resumed in fp32)."""
    path = step_dir(root, step)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    wanted: dict[str, tuple[int, ...]] = {}
    for part in _agree({key: tuple(tensor.size()) for key, tensor in tensors.items()}):
        wanted.update(part)
    problems = []
    for key, shape in sorted(wanted.items()):
        if key not in saved:
            problems.append(f"{key} {list(shape)} is missing")
        elif isinstance(saved[key], TensorStorageMetadata) and tuple(saved[key].size) != shape:
            problems.append(f"{key} is {list(saved[key].size)} there, {list(shape)} here")
    problems += [f"{key} is there, not in this model" for key in sorted(saved)
                 if key.startswith("model.") and key not in wanted]
    if problems:
        raise ConfigError("checkpoint.dir", str(path), f"holds a checkpoint of another model ({len(problems)} "
                          f"mismatches): {'; '.join(problems)}; resume it with the model it was saved with, or "
                          "point checkpoint.dir elsewhere")


def load_checkpoint(root: Path, step: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """Load the keys of ``tensors`` in place; returns this rank's per-rank file, or None if the saving
    layout had no such rank (a resume onto more ranks)."""
    path = step_dir(root, step)
    with _sharded_tensor_quiet():
        dcp.load(tensors, checkpoint_id=str(path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    per_rank = path / f"rank_{rank:05d}.pt"
    return torch.load(per_rank, weights_only=False) if per_rank.is_file() else None
