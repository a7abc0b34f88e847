"""One micro-batch through one model chunk, segment by segment; and
``overlap.overlap_moe_expert_parallel_comm``: one micro-batch's exchanges in flight while another micro-batch
computes (Megatron-Core's batch-level overlap and combined 1F1B, DeepSeek-V3's DualPipe pairs).

A chunk's forward is a list of segments (models/pipeline_stages.ModelChunk): one, the plain forward, or, paired,
the embedding | per layer the pieces of TransformerLayer.stages (a MoE layer whose exchange runs: attention +
router + permute with the dispatch started | expert GEMMs with the combine started + shared expert | combine
waited + unpermute; a dense or one-rank layer: attention | MLP) | the head or the PP stage's output. A
:class:`ChunkRun` hands each segment's outputs that need gradients on as detached leaves (the autograd graph cut between
segments), so that one segment's backward runs on its own. :func:`run_pair` runs a pair of the schedule (one
micro-batch's forward, another's backward) alternating segments: the backward's last, the forward's first, the
backward's next, ...

Backward walks the layers down while forward walks them up, and each exchange started at the end of one segment
is waited for at the start of the same micro-batch's next segment, so one segment of the other micro-batch is
issued in between: B's combine-backward exchange runs beside F's attention, F's dispatch beside B's expert
backward, B's dispatch-backward beside F's expert GEMMs, F's combine beside B's attention backward. Activations
in flight stay about one micro-batch's per pair: F holds the lower layers while B still holds the upper ones.
The losses and gradients are those of unpaired runs (tests/test_microbatch_overlap.py).

With graphed MoE layers (``train.moe_cuda_graph=true``) a layer is one graph, which no segment can cut, so the pair
runs on two CUDA streams instead (:class:`PairStreams`): micro-batch i's forward and backward on stream i mod 2,
each whole, so the GPU runs one micro-batch's kernels while the other's exchange waits for its peers.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from moe_overlap.distributed.streams import (Event, expect_gradients_from_other_streams, pair_stream_work, stage_label,
                                             use_stream, wait_stream)
from moe_overlap.layers.deferred_wgrad import WeightGradStore
from moe_overlap.models.pipeline_stages import ChunkOutput, Segment

_NO_CONTEXT = contextlib.nullcontext()  # reusable: it holds no state


class ChunkRun:
    """One micro-batch run through one chunk's segments. A segment's tensor outputs that need gradients are
    handed on as detached leaves that collect the later segments' gradients (the last segment's are not), so a
    segment's backward is ``torch.autograd.backward(its outputs, their leaves' gradients)``; the last one's
    starts from the chunk's output and ``grad``, the received gradient of it (none on the last stage). With
    ``order`` (split runs), it collects (F | B, micro-batch, segment name) as segments run, and waits inside a
    segment are tallied under ``F.name`` / ``B.name`` (the name's last part) in the exposed-communication labels."""

    def __init__(self, segments: list[tuple[str, Segment]], carry: dict,
                 order: list[tuple[str, int, str]] | None = None):
        self.segments, self.carry, self.order = segments, carry, order
        self.cuts: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []
        self.grad: torch.Tensor | None = None
        self.store: WeightGradStore | None = None  # ZB's I: weight gradients deferred into it

    @property
    def output(self) -> ChunkOutput:
        return self.carry["output"]

    def forward(self, k: int) -> None:
        name, segment = self.segments[k]
        with self._label("F", name):
            added = segment(self.carry)
        cut = []
        if k < len(self.segments) - 1:
            for key, value in added.items():
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    leaf = value.detach().requires_grad_()
                    cut.append((value, leaf))
                    added[key] = leaf
        self.carry.update(added)
        self.cuts.append(cut)
        if self.order is not None:
            self.order.append(("F", self.carry["micro_batch"], name))

    def backward(self, k: int) -> None:
        name = self.segments[k][0]
        with self._label("B", name), self.store.deferring() if self.store is not None else _NO_CONTEXT:
            if k == len(self.segments) - 1:
                torch.autograd.backward(self.output.output, self.grad)
            else:
                pairs = [(out, leaf.grad) for out, leaf in self.cuts[k] if leaf.grad is not None]
                if pairs:
                    torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        self.cuts[k] = None
        if self.order is not None:
            self.order.append(("B", self.carry["micro_batch"], name))

    def _label(self, direction: str, name: str):
        return stage_label(f"{direction}.{name.split('.')[-1]}") if self.order is not None else _NO_CONTEXT

    def forward_all(self) -> None:
        for k in range(len(self.segments)):
            self.forward(k)

    def backward_all(self) -> None:
        for k in reversed(range(len(self.segments))):
            self.backward(k)


def run_pair(forward: ChunkRun, backward: ChunkRun) -> None:
    """One micro-batch's forward and another's backward, one segment each in turn, the backward first; where one
    has more segments (chunks of different stages), its rest runs at the end."""
    count_f, count_b = len(forward.segments), len(backward.segments)
    for k in range(max(count_f, count_b)):
        if k < count_b:
            backward.backward(count_b - 1 - k)
        if k < count_f:
            forward.forward(k)


class PairStreams:
    """Micro-batch i's forward and backward on stream i mod 2 (autograd runs a backward on its forward's streams),
    so that a pair's forward (i + 1) and backward (i) run side by side on the GPU; the graphed copy i mod n of
    every MoE layer (MoELayer.for_micro_batch; n even, so each copy's micro-batches share a stream), with its own
    regions and captured on that stream (capture_moe_layers(replay_streams=...)), runs them. Forwards still follow
    forwards and backwards backwards, as on one stream (events): what a forward shares with the next (the routers'
    counts, the loss sums) and a backward with the next (the gradients) stays ordered. A step's streams start after
    the work queued before it and end before the work after it. On the CPU (one stream of execution) the same calls
    run the halves one after the other: the executor's path with whole pairs, testable there."""

    def __init__(self, device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
        self.done: dict[bool, Event | None] = {}
        expect_gradients_from_other_streams()  # both pair streams produce every parameter's gradients

    def _current(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def begin(self) -> None:
        for stream in self.streams:
            wait_stream(stream, self._current())
        self.done = {True: None, False: None}

    @contextlib.contextmanager
    def running(self, micro_batch: int, forward: bool) -> Iterator[None]:
        """Queue on micro-batch ``micro_batch``'s stream, after the last forward (``forward``) or backward."""
        stream = self.stream(micro_batch)
        if self.done[forward] is not None:
            self.done[forward].wait(stream)
        with use_stream(stream), pair_stream_work(self.device):  # its waits exposed only where neither computes
            yield
        self.done[forward] = Event(self.device).record(stream)

    def stream(self, micro_batch: int) -> torch.cuda.Stream | None:
        """Micro-batch ``micro_batch``'s stream (its transfers between pipeline stages queue there too: a send after
        what made its tensor, the consumer of a receive after its wait); None on the CPU."""
        return self.streams[micro_batch % 2]

    def end(self) -> None:
        for stream in self.streams:
            wait_stream(self._current(), stream)
