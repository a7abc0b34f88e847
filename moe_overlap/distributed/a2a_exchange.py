"""The MoE pipeline's row exchange, the interface every transport implements, and the streams it runs on.

An exchange moves rows in chunks of local experts, in one of two directions:
  to the experts    a rank's permuted rows (ordered chunk, destination rank, local expert) to their experts'
                    owners, handed over per chunk in the experts' grouped order (local expert, source rank), in
                    a private tensor the grouped GEMM reads from row 0 (rows past the chunk's offsets: unused)
  from the experts  a chunk's grouped rows back to the ranks that own their tokens, in those ranks' permuted
                    order; ``result()`` holds every chunk's rows once all arrived
The backward uses the same two: a gradient travels the other way.

    to = transport.to_experts(send_RH, routes, sms)       from_ = transport.from_experts(routes, width, like, sms)
                              # send_RH: a tensor, or GatheredRows (wire rows read from their tokens' rows)
    to.send(i, alone)         # chunk i starts moving (alone: no GEMM beside it, so at full width)
    rows = to.recv(i)         # the compute stream waits for chunk i (an exposed EP wait) and takes its rows
    from_.send(i, rows, ready)   # after the ``ready`` event (the GEMM that made the rows)
    all_rows = from_.result(); ...; from_.finish()   # ``transient``: a symmetric region, read before finish
    to.finish()

The routes come from the layer's plan (a2a_routes.py). Transports (``overlap.moe_transport``; a2a.py picks one):
  nccl          the EP process group's all-to-all (its communicator held to ``overlap.ep_comm_ctas``); host sizes
  copy_engine   peer copies into symmetric memory on a copy stream, no SMs; host sizes, one host   (a2a_host.py)
  sm_push       a Triton kernel stores rows into the peers' symmetric memory (kernels/push_rows.py); device
                sizes, one host                                                                     (a2a_push.py)
  gloo          the CPU process group; host sizes, or with device planning the twin of sm_push (same routes)
``overlap.moe_compute_only`` (a benchmark's reference) keeps every exchange's sizes, signals and small messages but
makes the rows each rank would receive from its own rows (repeated as often as needed, every transport alike), in
its own memory: the step without the transfers' cost, each layer still waiting for its slowest peer, and every
row it reads written this time (finite). The loss means nothing then.
Transfers run on the transport's side stream (NCCL's own, the copy stream, or the push stream); a push takes as
many CTAs as the GEMMs beside it leave SMs free (``sms``), and with none free it runs on the compute stream
between them at full width, where it cannot stall a GEMM's launch (README, "What overlaps on Hopper"). A chunk's rows
are taken out of the receive buffer on the compute stream, at full width, just before its GEMMs: a local copy of
a few tens of microseconds, which beside the GEMMs would need as many SMs as the transfer itself. Wire rows (each
token once per rank), which the receiver expands into grouped rows anyway, skip that copy where they land at row 0
(the first chunk): the expansion reads the receive buffer itself (``recv(chunk, read_once=True)``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from moe_overlap.distributed.streams import Event, exposed_wait, use_stream


class ExchangeStreams:
    """The compute stream and the side stream an exchange's work runs on beside it (CUDA); on CPU, or with no
    side stream, everything runs in order on the compute stream."""

    def __init__(self, device: torch.device, side: torch.cuda.Stream | None):
        self.device = device
        self.compute = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.side = side if device.type == "cuda" else None
        if self.side is not None:
            self.side.wait_stream(self.compute)  # sees everything queued so far (and forks a CUDA-graph capture)

    def on_side(self):
        return use_stream(self.side)

    def mark(self) -> Event:
        return Event(self.device).record(self.side or self.compute)

    def side_waits(self, event: Event) -> None:
        if self.side is not None:
            event.wait(self.side)

    def compute_waits(self, event: Event) -> None:
        if self.side is not None:
            with exposed_wait("ep"):
                event.wait(self.compute)

    def join(self) -> None:
        """The compute stream waits for everything queued on the side stream so far (a CUDA-graph capture must
        join every stream it forked)."""
        if self.side is not None:
            self.compute_waits(self.mark())

    def lend(self, *tensors: torch.Tensor) -> None:
        """Tensors of the compute stream that side-stream work reads or writes: not reused before it is done."""
        if self.side is not None:
            for t in tensors:
                t.record_stream(self.side)


@dataclass
class GatheredRows:
    """Rows to send whose first columns are other rows' (``source_TX[source_row_R[r]]``: a wire row's token's) and
    whose other columns are ``rest_RM``'s: a transport that ``gathers`` reads them from there as it moves them (no
    send buffer written first); any other sends ``write()``, the rows written out."""

    rest_RM: torch.Tensor
    source_TX: torch.Tensor
    source_row_R: torch.Tensor  # int32, one per row
    write: Callable[[], torch.Tensor]

    @property
    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source_TX, self.source_row_R

    @property
    def width(self) -> int:
        return self.source_TX.shape[1] + self.rest_RM.shape[1]


class ToExperts(ABC):
    """One layer call's rows on their way to the experts."""

    @abstractmethod
    def send(self, chunk: int, alone: bool = False) -> None:
        """Chunk ``chunk`` starts moving; ``alone``: no GEMM beside it, so at full width."""

    @abstractmethod
    def recv(self, chunk: int, read_once: bool = False) -> torch.Tensor:
        """The compute stream waits for the chunk (an exposed EP wait); its rows in grouped order, from row 0.
        ``read_once``: the caller reads the rows before ``finish()`` and keeps none of them (wire rows, which it
        expands), so a transport may hand over its receive buffer itself instead of a copy."""

    @abstractmethod
    def finish(self) -> None:
        """Every chunk sent was received; the buffers go back."""


class FromExperts(ABC):
    """One layer call's grouped rows on their way back to their tokens' ranks."""

    transient = False  # result() is a symmetric region, valid until finish()

    @abstractmethod
    def send(self, chunk: int, grouped_RH: torch.Tensor, ready: Event, alone: bool = False) -> None:
        """The chunk's rows start back once ``ready`` (the GEMM that made them) has run."""

    @abstractmethod
    def result(self) -> torch.Tensor:
        """Every chunk's rows, in this rank's permuted order, once all arrived."""

    @abstractmethod
    def finish(self) -> None:
        """After everything that reads result() was queued: the buffers go back."""


def gather_through_regions(regions, counts_E: torch.Tensor, put: Callable[[torch.Tensor, int], None]
                           ) -> torch.Tensor:
    """Every EP rank's counts, [source rank, expert], on the device, through a claimed region of symmetric memory
    instead of a collective (a CUDA graph of the layer holds none): ``put(counts_SE, region)`` writes this rank's
    row of the table (``counts_E`` repeated) into every rank's region, then one signal per peer announces it."""
    ranks = regions.size
    region = regions.claim(torch.cuda.current_stream() if counts_E.is_cuda else None)
    counts_SE = counts_E.view(1, -1).expand(ranks, -1).contiguous()
    put(counts_SE, region)
    for peer in regions.peers:
        regions.signal(peer, region, 0)
    with exposed_wait("ep"):
        for peer in regions.peers:
            regions.wait(peer, region, 0)
    gathered_SE = regions.view(regions.rank, region, counts_SE.shape, counts_SE.dtype).clone()
    regions.release(region)
    return gathered_SE


class Transport:
    """A way of moving rows (``overlap.moe_transport``): opens one exchange per direction and layer call (the
    classes it names). ``needs_sms``: its transfers run on SMs, so a GEMM beside them leaves some free."""

    name: str
    needs_sms: bool
    gathers = False  # its transfers read GatheredRows where they are
    stream: torch.cuda.Stream | None  # the side stream its transfers run on (None on CPU)
    compute_only: bool  # overlap.moe_compute_only: the rows that would land are made from this rank's own
    to_class: type[ToExperts]
    from_class: type[FromExperts]
    # the bytes this rank sends to other ranks (a2a.TransportSelector's counter, on the device), and its index
    # among them; None: not counted
    bytes_sent: torch.Tensor | None = None
    peer_index: int = 0

    def to_experts(self, send_RH: torch.Tensor | GatheredRows, routes, sms: int) -> ToExperts:
        if isinstance(send_RH, GatheredRows) and not self.gathers:
            send_RH = send_RH.write()
        width, dtype = ((send_RH.width, send_RH.rest_RM.dtype) if isinstance(send_RH, GatheredRows)
                        else (send_RH.shape[1], send_RH.dtype))
        self._count(routes, 0, width * dtype.itemsize)
        return self.to_class(self, send_RH, routes, sms)

    def from_experts(self, routes, width: int, like: torch.Tensor, sms: int) -> FromExperts:
        self._count(routes, 1, width * like.element_size())
        return self.from_class(self, routes, width, like, sms)

    def _count(self, routes, direction: int, row_bytes: int) -> None:
        """An exchange's rows to other ranks (``direction`` 0: to the experts, 1: back), in bytes; none cross in a
        compute-only reference."""
        if self.bytes_sent is not None and not self.compute_only:
            self.bytes_sent.add_(routes.remote_rows(self.peer_index)[direction] * row_bytes)
