"""Where a training step's time goes: ``train.profile_steps=[a, b]`` profiles steps a..b with torch.profiler and
writes, per profiled rank (``train.profile_ranks``), under ``<output_dir>/profile/``:

  trace_rank{r}.json      the Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev)
  timeline_rank{r}.png    one lane per CUDA stream: kernels, copies, NCCL; the compute stream's gaps show
  breakdown_rank{r}.json  per step: the compute stream's time by kind (GEMMs, grouped GEMMs, attention,
                          elementwise, copies, optimizer, communication, idle), its longest gaps, the time no
                          stream runs anything, and the part of the compute stream's idle time the host caused
                          (kernels launched after the stream ran dry)

The same summaries serve the benchmarks (benchmarks/train_step.py, dp_overlap.py, moe_layer.py).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import re
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)

# Kernel name -> kind of work, first match wins (CUDA kernel names of torch 2.11, cuBLAS, CUTLASS, NCCL, ours).
# Communication is every kernel that moves data to or waits for another rank: NCCL's, our SM pushes, peer copies,
# and symmetric memory's signal kernels (a wait for a peer spins on the stream, so its time is exposed there).
KINDS = (
    ("communication", r"nccl|push_rows|copy_counted|memcpy.*peer|cross_device|wait_signal|put_signal|"
                      r"symmetric_memory|barrier_kernel"),
    ("optimizer", r"adamw|multi_tensor_apply|foreach|lpnorm|norm_kernel"),
    ("attention", r"flash|fmha|attention|cudnn.*sdpa|sdpa"),
    ("grouped GEMM", r"grouped|grouped_mm|_grouped_wgrad"),
    ("GEMM", r"gemm|nvjet|sm90_xmma|cutlass|cublas|matmul|splitk"),
    ("copies", r"memcpy|memset|copy_kernel|direct_copy|cat_|catarray|index_select|gather|scatter|_rows_kernel|"
               r"indexing|index_put"),
    ("elementwise", r"."),
)
_KIND_PATTERNS = [(kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in KINDS]


def kernel_kind(name: str) -> str:
    return next(kind for kind, pattern in _KIND_PATTERNS if pattern.search(name))


def span_kind(name: str) -> str:
    """A timeline lane's colour: peer/host copies, NCCL, or compute kernels."""
    name = name.lower()
    return "copy" if "memcpy" in name else ("nccl" if "nccl" in name else "kernel")


def device_spans(prof) -> list[tuple[int, str, float, float]]:
    """(stream, kernel or copy name, start us, end us) of every device event a torch profiler recorded: kernels,
    copies and sets, not the annotations that mirror host ranges onto the streams (``nccl:all_to_all`` beside
    its NCCL kernel would count that kernel's time twice)."""
    spans = []
    for event in prof.profiler.kineto_results.events():
        if event.device_type().name == "CUDA" and event.duration_ns() > 0 and not _is_annotation(event):
            start = event.start_ns() / 1e3
            spans.append((event.device_resource_id(), event.name(), start, start + event.duration_ns() / 1e3))
    return spans


def _is_annotation(event) -> bool:
    """A host range mirrored onto a stream. torch 2.13 says so (activity type, is_user_annotation); torch 2.11's
    event has neither, so c10d's collective annotations are also known by name (``nccl:all_to_all``, whose kernel
    is ``ncclDevKernel_...``)."""
    kind = getattr(event, "activity_type", None)
    flagged = getattr(event, "is_user_annotation", None)
    return (kind is not None and "annotation" in str(kind())) or (flagged is not None and bool(flagged())) \
        or event.name().startswith("nccl:")


def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a, b) -> list[tuple[float, float]]:
    """Of two sorted lists of disjoint intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def compute_stream_of(spans) -> int | None:
    """The stream with the most non-communication kernel time."""
    busy: dict[int, float] = {}
    for stream, name, start, end in spans:
        if kernel_kind(name) != "communication":
            busy[stream] = busy.get(stream, 0.0) + end - start
    return max(busy, key=busy.get) if busy else None


def stream_summary(spans, steps: int, gaps_listed: int = 8) -> dict:
    """Per step: the profiled window, the compute stream's busy and idle time, the time no stream runs anything,
    NCCL's busy time and the part of it beside compute, and the compute stream's longest idle gaps (where, how
    long, what ran next)."""
    compute_stream = compute_stream_of(spans)
    if compute_stream is None:
        return {"skipped": "the profiler recorded no device events"}
    compute_events = sorted((b, e, n) for s, n, b, e in spans if s == compute_stream)
    compute = union((b, e) for b, e, _ in compute_events)
    nccl = union((b, e) for _, name, b, e in spans if span_kind(name) == "nccl")
    t0, t1 = min(b for _, _, b, _ in spans), max(e for _, _, _, e in spans)
    starts = [b for b, _, _ in compute_events]
    gaps = []
    for (_, end), (start, _) in zip(compute, compute[1:]):  # the kernel that ends a gap: a bisection, not a scan
        following = compute_events[bisect.bisect_left(starts, start)][2]  # (a scan per gap took hours at 100K)
        gaps.append((start - end, end - t0, following))
    per_step = lambda us: round(us / steps / 1e3, 3)  # noqa: E731
    any_stream = length(union((b, e) for _, _, b, e in spans))
    return {
        "window_ms": per_step(t1 - t0), "compute_busy_ms": per_step(length(compute)),
        "compute_idle_ms": per_step(t1 - t0 - length(compute)),
        # the GPU's own idle time: no stream runs anything (a graph's forked branches run on streams of their own)
        "device_idle_ms": per_step(t1 - t0 - any_stream), "nccl_busy_ms": per_step(length(nccl)),
        "nccl_beside_compute_ms": per_step(length(intersection(compute, nccl))),
        "longest_compute_gaps": [{"at_ms": round(at / 1e3, 3), "ms": round(gap / 1e3, 3), "next": following[:80]}
                                 for gap, at, following in sorted(gaps, reverse=True)[:gaps_listed]],
    }


_LAUNCH_CALL = re.compile(r"^(cuda|cu)(LaunchKernel|LaunchCooperativeKernel|GraphLaunch|Memcpy|Memset)", re.IGNORECASE)


def host_late_idle(trace: dict, steps: int, listed: int = 10) -> dict:
    """How much of the compute stream's idle time the host caused, from a Chrome trace (``export_chrome_trace``):
    per gap, the part before the host had queued the kernel that ends it (the launch call's end, joined to the
    kernel by its correlation id; a graph's kernels by their graph launch, so a replay's inner gaps are not the
    host's). Per step: that time, the idle time it is part of, and the kernels that waited longest for their
    launch (by name, summed)."""
    calls, spans = {}, []
    for event in trace.get("traceEvents", []):
        args, cat = event.get("args") or {}, event.get("cat", "")
        if "dur" not in event or "correlation" not in args:
            continue
        if cat in ("cuda_runtime", "cuda_driver") and _LAUNCH_CALL.match(event.get("name", "")):
            calls[args["correlation"]] = event["ts"] + event["dur"]
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset") and event["dur"] > 0:
            spans.append((args.get("stream", -1), event["name"], event["ts"], event["ts"] + event["dur"],
                          args["correlation"]))
    compute_stream = compute_stream_of([span[:4] for span in spans])
    if compute_stream is None:
        return {"skipped": "the trace holds no device events"}
    kernels = sorted((start, end, name, corr) for stream, name, start, end, corr in spans if stream == compute_stream)
    late_by_next: dict[str, list[float]] = {}
    idle = late = 0.0
    busy_until = kernels[0][1]
    for start, end, name, corr in kernels[1:]:
        if start > busy_until:
            gap = start - busy_until
            queued = calls.get(corr)
            waited = 0.0 if queued is None else min(max(queued - busy_until, 0.0), gap)
            idle, late = idle + gap, late + waited
            if waited > 0:
                entry = late_by_next.setdefault(name[:80], [0.0, 0])
                entry[0] += waited
                entry[1] += 1
        busy_until = max(busy_until, end)
    per_step = lambda us: round(us / steps / 1e3, 3)  # noqa: E731
    return {"compute_idle_ms": per_step(idle), "host_late_ms": per_step(late),
            "launches_joined": sum(corr in calls for *_, corr in kernels), "kernels": len(kernels),
            "host_late_before": [{"next": name, "ms": per_step(us), "gaps": count // steps} for name, (us, count)
                                 in sorted(late_by_next.items(), key=lambda kv: -kv[1][0])[:listed]]}


def step_breakdown(spans, steps: int, top_kernels: int = 45) -> dict:
    """Per step, the compute stream's time by kind of work (ms), idle time, the window, and the kernels that
    took the most; communication on other streams is listed beside (it overlaps, it does not add)."""
    compute_stream = compute_stream_of(spans)
    if compute_stream is None:
        return {"skipped": "the profiler recorded no device events"}
    t0, t1 = min(b for _, _, b, _ in spans), max(e for _, _, _, e in spans)
    by_kind: dict[str, float] = {kind: 0.0 for kind, _ in KINDS}
    by_kernel: dict[str, list[float]] = {}
    beside: dict[str, float] = {}
    for stream, name, start, end in spans:
        kind = kernel_kind(name)
        if stream == compute_stream:
            by_kind[kind] += end - start
            entry = by_kernel.setdefault(name, [0.0, 0])
            entry[0] += end - start
            entry[1] += 1
        else:
            beside[kind] = beside.get(kind, 0.0) + end - start
    busy = length(union((b, e) for s, _, b, e in spans if s == compute_stream))
    ms = lambda us: round(us / steps / 1e3, 3)  # noqa: E731
    return {
        "step_ms": ms(t1 - t0),
        "compute_stream_ms": {**{kind: ms(us) for kind, us in by_kind.items()}, "idle": ms(t1 - t0 - busy)},
        "other_streams_ms": {kind: ms(us) for kind, us in sorted(beside.items())},
        "top_kernels": [{"kernel": name[:120], "kind": kernel_kind(name), "ms": ms(us), "calls": calls // steps}
                        for name, (us, calls) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top_kernels]],
    }


def draw_timeline(prof, path: str, title: str) -> None:
    """Lanes per CUDA stream from the profiler's device events: kernels, peer copies, NCCL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [(f"stream {stream} {span_kind(name)}", start, end) for stream, name, start, end in device_spans(prof)]
    if not spans:
        log.warning("timeline: the profiler recorded no device events")
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
    log.info("timeline: %s", path)


def profiler_activities() -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


class StepProfiler:
    """Profiles the training steps ``first..last`` (1-based) on this rank, if it is one of the profiled ranks."""

    def __init__(self, first: int | None, last: int | None, out_dir: Path | None, rank: int):
        self.first, self.last, self.out_dir, self.rank = first, last, out_dir, rank
        self._prof = None

    @classmethod
    def from_config(cls, cfg, rank: int, output_dir: Path) -> "StepProfiler":
        if not cfg.profile_steps or rank not in cfg.profile_ranks:
            return cls(None, None, None, rank)
        return cls(cfg.profile_steps[0], cfg.profile_steps[1], output_dir / "profile", rank)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap the queueing of training step ``step``."""
        if self.first is None:
            yield
            return
        if step == self.first:
            _synchronize()  # the window starts with this step's work, not the previous step's tail
            self._prof = torch.profiler.profile(activities=profiler_activities())
            self._prof.__enter__()
        yield
        if self._prof is not None and step == self.last:
            self._finish()

    def close(self) -> None:
        """At the end of training: a window cut short by max_steps is written as far as it got."""
        if self._prof is not None:
            self._finish()

    def _finish(self) -> None:
        _synchronize()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        steps = self.last - self.first + 1
        trace = self.out_dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        spans = device_spans(prof)
        report = {"steps": [self.first, self.last], "breakdown": step_breakdown(spans, steps),
                  "streams": stream_summary(spans, steps),
                  "host_late": host_late_idle(json.loads(trace.read_text()), steps)}
        (self.out_dir / f"breakdown_rank{self.rank}.json").write_text(json.dumps(report, indent=2) + "\n")
        if spans:
            draw_timeline(prof, str(self.out_dir / f"timeline_rank{self.rank}.png"),
                          f"training steps {self.first}-{self.last}, rank {self.rank}")
        log.info("profile of steps %d-%d: %s", self.first, self.last, self.out_dir)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measured_gemm_tflops(device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    """This GPU's bf16 GEMM rate on random data (n^3, after a warm-up), logged beside the configured peak."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.mm(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12
