"""Communication / compute streams and events, with the same calls on CPU (where they are no-ops).

Code that overlaps communication with computation orders work across streams with events; on CPU there is
one stream of execution, so the same code runs there unchanged and is testable with gloo.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Iterator, Optional

import torch

from moe_overlap.kernels.device_clock import BIG, BLOCK, WAIT, add_clock, edge
from moe_overlap.tuning import MAX_AUTO_CARVEOUT_SMS

EXPOSED_KINDS = ("ep", "tp", "dp", "pp", "cp")
PAIR_STREAMS = 2  # streams side by side (training/microbatch_overlap.PairStreams)
# The device clock's slots: waits inside CUDA graphs per kind, those of waits on a pair's streams per kind, then the
# time the pair's streams were all held with a wait open, then the pair's state (kernels/device_clock.py).
_PAIR_WAITS, _PAIR_EXPOSED, _PAIR_STATE = len(EXPOSED_KINDS), 2 * len(EXPOSED_KINDS), 2 * len(EXPOSED_KINDS) + 1


def check_gemm_sm_carveout(sms: int | str, device: torch.device) -> None:
    """``overlap.gemm_sm_carveout`` must leave the GEMMs at least one SM of the device (0 everywhere; auto takes
    at most MAX_AUTO_CARVEOUT_SMS)."""
    if sms in (0, "auto"):
        return
    if device.type != "cuda":
        raise ValueError(f"overlap.gemm_sm_carveout={sms}: a CUDA setting; the device is {device.type!r}")
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < sms < total:
        raise ValueError(f"overlap.gemm_sm_carveout={sms}: must be >= 0 and below the {total} SMs of "
                         f"{torch.cuda.get_device_name(device)}")


def carveout_for(setting: int | str, comm_ctas: int | None, sms_per_cta: int) -> int:
    """The SMs ``overlap.gemm_sm_carveout`` leaves free beside a NCCL communicator held to ``comm_ctas``: the
    setting, or for ``auto`` the measured pairing of ``sms_per_cta`` per CTA (at most MAX_AUTO_CARVEOUT_SMS; none
    without a cap)."""
    if setting != "auto":
        return setting
    return min(MAX_AUTO_CARVEOUT_SMS, sms_per_cta * comm_ctas) if comm_ctas else 0


@contextlib.contextmanager
def gemm_sm_carveout(sms: int) -> Iterator[None]:
    """Inside the block, every cuBLAS GEMM and grouped GEMM leaves at least ``sms`` SMs free (a carve-out around
    it stays: communication beside an inner GEMM may be the outer block's too), so that a communication kernel
    launched beside one starts at once on the free SMs; beside a full-chip grid it queues, and once it holds SMs
    the GEMM's last wave waits for it. A CUDA-graph capture keeps the setting of its GEMMs. torch's setting is
    process-wide: the block restores the one before it."""
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(max(sms, before or 0) or None)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


@contextlib.contextmanager
def use_stream(stream: Optional[torch.cuda.Stream]) -> Iterator[None]:
    """Make ``stream`` current inside the block; a no-op for None (CPU)."""
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def wait_stream(waiter: Optional[torch.cuda.Stream], waited: Optional[torch.cuda.Stream]) -> None:
    """Work queued on ``waiter`` from now on starts after what ``waited`` has queued so far."""
    if waiter is not None and waited is not None and waiter != waited:
        waiter.wait_stream(waited)


class Event:
    """A point in a stream's work: a CUDA event on GPU, the host clock on CPU (where work is synchronous)."""

    def __init__(self, device: torch.device, timing: bool = False):
        self._cuda = torch.cuda.Event(enable_timing=timing) if device.type == "cuda" else None
        self._host_s: float | None = None

    def record(self, stream: Optional[torch.cuda.Stream] = None) -> "Event":
        if self._cuda is not None:
            self._cuda.record(stream)
        else:
            self._host_s = time.perf_counter()
        return self

    def wait(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """``stream`` (default: the current one) waits for this event; the host never blocks."""
        if self._cuda is not None:
            self._cuda.wait(stream)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end`` (both recorded with ``timing``); synchronises on GPU."""
        if self._cuda is not None:
            end._cuda.synchronize()
            return self._cuda.elapsed_time(end._cuda)
        return (end._host_s - self._host_s) * 1e3


class HostCopy:
    """A device tensor's copy on its way to the host: queued now (pinned buffer, no wait), read by ``wait``,
    which waits for the work queued before it and nothing after."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type != "cuda":
            self._host, self._landed = tensor, None
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._landed = torch.cuda.Event()
        self._landed.record()

    def wait(self) -> torch.Tensor:
        if self._landed is not None:
            self._landed.synchronize()
        return self._host


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without the host waiting (through pinned memory on CUDA)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ExposedComm:
    """The time one training step's compute stream (on CPU: the host) spent waiting for communication, per
    kind: an event pair around every wait that blocks it (host waits included: the compute stream idles once its
    queue drains), plus what the device clock added up inside CUDA-graph replays during the step; summed once the
    step's work is done. On a pair's two CUDA streams (:func:`pair_stream_work`), where one stream's wait is hidden
    while the other computes, the time both were held with a wait open instead, shared among the kinds as the
    pair's waits were."""

    def __init__(self, device: torch.device):
        self.device = device
        self.spans: list[tuple[str, str | None, Event, Event]] = []  # kind, stage label, start, end
        clock = _DEVICE_CLOCKS.get(_clock_key(device))
        self._clock_start = None if clock is None else clock.clone()  # graphs replayed before the step: not ours
        self._graph_waits_ns: HostCopy | None = None

    def close(self) -> None:
        """The step's work is queued: what the graphs' device clock adds from here on is the next step's. Its
        part comes to the host by its own copy, which waits for this step's work only."""
        if self._clock_start is not None:
            self._graph_waits_ns = HostCopy(_DEVICE_CLOCKS[_clock_key(self.device)] - self._clock_start)

    def totals_ms(self) -> dict[str, float]:
        totals = dict.fromkeys(EXPOSED_KINDS, 0.0)
        for kind, _, start, end in self.spans:
            totals[kind] += start.elapsed_ms(end)
        if self._graph_waits_ns is not None:
            clock_ns = self._graph_waits_ns.wait().tolist()
            paired_ns = clock_ns[_PAIR_WAITS:_PAIR_EXPOSED]
            for index, kind in enumerate(EXPOSED_KINDS):
                totals[kind] += clock_ns[index] / 1e6
                if sum(paired_ns) > 0:
                    totals[kind] += clock_ns[_PAIR_EXPOSED] * paired_ns[index] / sum(paired_ns) / 1e6
        return totals

    def by_stage_ms(self) -> dict[str, float]:
        """Per "kind stage" for the waits inside a labelled stage (:func:`stage_label`); eager waits only."""
        totals: dict[str, float] = {}
        for kind, label, start, end in self.spans:
            if label is not None:
                totals[f"{kind} {label}"] = totals.get(f"{kind} {label}", 0.0) + start.elapsed_ms(end)
        return totals


_MEASURING: list[ExposedComm] = []  # the tally of the step in flight, if the trainer measures one
_STAGE: list[str] = []  # the label of the stage running (overlap_moe_expert_parallel_comm)
_OPEN: list[str] = []  # the exposed wait being timed: a wait inside it is part of it, not counted again
_PAIRED: list[bool] = []  # work queued now runs on one of a pair's streams (pair_stream_work)
# Per CUDA device, the device clock: nanoseconds of waits, ever growing, and the pair's state (slots above).
_DEVICE_CLOCKS: dict[int, torch.Tensor] = {}  # by CUDA device index
# Process group -> the kind of exposed communication its collectives are (Mesh.create names them).
_GROUP_KINDS: dict[object, str] = {}


def set_exposed_kind(group, kind: str | None) -> None:
    """The blocking collectives over ``group`` (distributed/collectives.py) count as exposed ``kind``; None
    forgets the group (it is being destroyed)."""
    if kind is None:
        _GROUP_KINDS.pop(group, None)
        return
    if kind not in EXPOSED_KINDS:
        raise ValueError(f"exposed kind {kind!r}: allowed {', '.join(EXPOSED_KINDS)}")
    _GROUP_KINDS[group] = kind


def exposed_kind(group) -> str | None:
    """The kind a collective over ``group`` counts as; None for a group no mesh named (not timed)."""
    return _GROUP_KINDS.get(group)


def prepare_device_clock(device: torch.device) -> None:
    """Make the device's wait clock before a CUDA-graph capture (a tensor made inside one would live in the
    graph's pool, and its zero fill would replay)."""
    if device.type == "cuda" and _clock_key(device) not in _DEVICE_CLOCKS:
        clock = _DEVICE_CLOCKS[_clock_key(device)] = torch.zeros(_PAIR_STATE + 1, dtype=torch.int64, device=device)
        clock[_PAIR_STATE] = PAIR_STREAMS * BIG  # no stream of the pair computing, no wait open
        add_clock(clock, 0, -1)  # compiled and loaded now, not inside the capture; adds a few microseconds
        add_clock(clock, 0, +1)
        for delta, sign in ((-BLOCK, 0), (WAIT, -1), (-WAIT, 1), (BLOCK, 0)):  # likewise, the state as it was
            _pair_edge(clock, delta, 0, sign)


def _pair_edge(clock: torch.Tensor, delta: int, kind: int = 0, sign: int = 0) -> None:
    edge(clock, _PAIR_STATE, _PAIR_EXPOSED, PAIR_STREAMS, delta, _PAIR_WAITS + kind, sign)


@contextlib.contextmanager
def pair_stream_work(device: torch.device, block: bool = True) -> Iterator[None]:
    """Work queued inside runs on one of a pair's CUDA streams side by side: its exposed waits count where no stream
    of the pair computes (:class:`ExposedComm`). ``block``: the work is one block of that stream's (the stream computes
    from its start to its end, but in its waits); else only its waits are marked (a capture for such a stream). A
    no-op off CUDA, where a pair runs one half after the other."""
    if device.type != "cuda":
        yield
        return
    prepare_device_clock(device)
    clock = _DEVICE_CLOCKS[_clock_key(device)]
    if block:
        _pair_edge(clock, -BLOCK)
    _PAIRED.append(True)
    try:
        yield
    finally:
        _PAIRED.pop()
        if block:
            _pair_edge(clock, BLOCK)


def _clock_key(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


def expect_gradients_from_other_streams() -> None:
    """Autograd warns when a parameter's AccumulateGrad node (one per parameter, kept alive by the optimizers'
    post-accumulate hooks, with the stream it was made on) receives a gradient made on another stream. A graph
    capture's warm-up on its capture stream and pairs on two streams do that by design; autograd then orders the
    accumulation after the producing stream (an event wait), which is what they need. Not shown from then on."""
    warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match", category=UserWarning)


@contextlib.contextmanager
def stage_label(label: str) -> Iterator[None]:
    """Waits inside the block are tallied under ``label`` too (ExposedComm.by_stage_ms)."""
    _STAGE.append(label)
    try:
        yield
    finally:
        _STAGE.pop()


@contextlib.contextmanager
def measuring_exposed_comm(device: torch.device) -> Iterator[ExposedComm]:
    """Inside the block, :func:`exposed_wait` records into the returned tally."""
    tally = ExposedComm(device)
    _MEASURING.append(tally)
    try:
        yield tally
    finally:
        _MEASURING.remove(tally)
        tally.close()


@contextlib.contextmanager
def exposed_wait(kind: str | None) -> Iterator[None]:
    """Wrap anything that holds the compute stream (or the host) up for another rank: a stream's wait for a
    transfer, a host wait for a fetch, a device-side signal wait, a transfer kernel on the compute stream. Timed
    by events while a step measures; inside a CUDA-graph capture by the device clock, which every replay then
    advances (measured or not: a step's tally takes the difference); on a pair's stream (:func:`pair_stream_work`)
    by the device clock's pair slots, eager or captured. ``kind`` None: not timed (a group no mesh named); a wait
    inside another is part of the outer one."""
    if kind is None or _OPEN:
        yield
        return
    if _PAIRED:  # on a pair's stream: the device clock's pair slots, eager or captured alike
        clock, slot = _DEVICE_CLOCKS[torch.cuda.current_device()], EXPOSED_KINDS.index(kind)
        _pair_edge(clock, WAIT, slot, -1)
        _OPEN.append(kind)
        try:
            yield
        finally:
            _OPEN.pop()
        _pair_edge(clock, -WAIT, slot, 1)
        return
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if capturing:
        clock, slot = _DEVICE_CLOCKS[torch.cuda.current_device()], EXPOSED_KINDS.index(kind)
        add_clock(clock, slot, -1)
    elif not _MEASURING:
        yield
        return
    else:
        tally = _MEASURING[-1]
        start = Event(tally.device, timing=True).record()
    _OPEN.append(kind)
    try:
        yield
    finally:
        _OPEN.pop()
    if capturing:
        add_clock(clock, slot, +1)
    else:
        tally.spans.append((kind, _STAGE[-1] if _STAGE else None, start, Event(tally.device, timing=True).record()))
