"""What is allocated at a run's peak: torch's allocator history (``torch.cuda.memory._record_memory_history``) walked
to the moment the most bytes were allocated, and the blocks live then grouped by the code that made them.

    recording()                 # before the run: the allocator records every allocation and free, with its stack
    summary = peak_summary(device)   # after it: the peak and what held it (recording stops)

``benchmarks/train_step.py --memory-peak`` reports it per row. Recording stacks slows the host's allocations, so a
row measured this way has no meaningful times. The peak is torch's own (what ``max_memory_allocated`` counts): a
CUDA graph's static tensors count while they are allocated during its capture; its replays allocate nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

GIB = 2**30
MAX_ENTRIES = 3_000_000  # allocator events kept (the oldest go first): a fine bench model's row takes about 1M


def recording() -> None:
    import torch

    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def where(frames: list[dict], depth: int = 3) -> str:
    """The innermost ``depth`` frames of this project's code that made a block (file:line:function)."""
    ours = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames
            if "moe_overlap" in f["filename"] or "benchmarks" in f["filename"]]
    return " < ".join(ours[:depth]) or "(no frame of ours)"


def phase(frames: list[dict]) -> str:
    """Which part of a training run made a block: the outermost frame of the trainer (its construction, the
    graphs' capture included, or a step) or the optimizer."""
    names = [f["name"] for f in frames if f["filename"].endswith(("trainer.py", "optimizer.py"))]
    return names[-1] if names else "(outside the trainer)"


def grouped(blocks: Iterable[tuple[int, tuple]]) -> list[list]:
    """Blocks (bytes, key) summed per key: [GiB, blocks, *key], largest first."""
    groups: dict[tuple, list[int]] = {}
    for size, key in blocks:
        group = groups.setdefault(key, [0, 0])
        group[0] += size
        group[1] += 1
    return sorted(([round(size / GIB, 3), count, *key] for key, (size, count) in groups.items()), reverse=True)


def peak_of(trace: list[dict], top: int = 40) -> dict:
    """The most bytes allocated at once over ``trace`` (one device's events, oldest first; a block freed whose
    allocation fell out of the history is not counted), the event that reached it, and the blocks live then,
    grouped by where and when they were made, largest first."""
    live: dict[int, dict] = {}
    total = peak = 0
    peak_at = -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, peak_at = total, index
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    live = {}
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    blocks = grouped((event["size"], (phase(event.get("frames", [])), where(event.get("frames", []))))
                     for event in live.values())
    last = trace[peak_at] if peak_at >= 0 else {}
    return {"peak_gib": round(peak / GIB, 3), "events": len(trace), "peak_event": peak_at,
            "peak_reached_by": [phase(last.get("frames", [])), where(last.get("frames", []), 6)],
            "live_at_peak": blocks[:top], "live_groups": len(blocks)}


def pools_and_streams(device) -> list[list]:
    """What the allocator holds now on ``device``, per (memory pool, stream): [segment GiB, allocated GiB, segments,
    pool, stream], largest first. Pool (0, 0) is the allocator's own, where a block freed on one stream serves only
    that stream's later allocations; a CUDA graph's private pool holds its captured allocations for every replay.
    Stream ``default`` is the device's default stream; others by handle."""
    import torch

    default = torch.cuda.default_stream(device).cuda_stream
    held: dict[tuple, list[int]] = {}
    for seg in torch.cuda.memory_snapshot():
        if seg["device"] != device.index:
            continue
        stream = "default" if seg["stream"] == default else str(seg["stream"])
        entry = held.setdefault((str(tuple(seg.get("segment_pool_id", (0, 0)))), stream), [0, 0, 0])
        entry[0] += seg["total_size"]
        entry[1] += seg["allocated_size"]
        entry[2] += 1
    return sorted(([round(total / GIB, 3), round(allocated / GIB, 3), count, *key]
                   for key, (total, allocated, count) in held.items()), reverse=True)


def peak_summary(device, top: int = 40) -> dict:
    """The recorded history's peak on ``device`` (:func:`peak_of`); recording stops."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot["device_traces"]
    return peak_of(traces[device.index if device.index is not None else torch.cuda.current_device()], top)
