"""The MoE pipeline's row exchange: where its sizes are planned and what moves the rows, behind one interface.

An exchange moves rows in chunks of local experts, in one of two directions:
  to the experts    a rank's permuted rows (ordered chunk, destination rank, local expert) to their experts'
                    owners, handed over per chunk in the experts' grouped order (local expert, source rank), in
                    a private tensor the grouped GEMM reads from row 0 (rows past the chunk's offsets: unused)
  from the experts  a chunk's grouped rows back to the ranks that own their tokens, in those ranks' permuted
                    order; ``result()`` holds every chunk's rows once all arrived
The backward uses the same two: a gradient travels the other way.

    to = transport.to_experts(send_RH, routes, sms)       from_ = transport.from_experts(routes, width, like, sms)
    to.send(i, alone)         # chunk i starts moving (alone: no GEMM beside it, so at full width)
    rows = to.recv(i)         # the compute stream waits for chunk i (an exposed EP wait) and takes its rows
    from_.send(i, rows, ready)   # after the ``ready`` event (the GEMM that made the rows)
    all_rows = from_.result(); ...; from_.finish()   # ``transient``: a symmetric region, read before finish
    to.finish()

Sizes are planned on the host (one fetch of every rank's counts per layer: exact buffers) or on the device (no
host sync, static worst-case buffers, CUDA-graph capturable). Transports (``overlap.moe_transport``):
  nccl          the EP process group's all-to-all (its communicator held to ``overlap.ep_comm_ctas``); host sizes
  copy_engine   peer copies into symmetric memory on a copy stream, no SMs; host sizes, one host
  sm_push       a Triton kernel stores rows into the peers' symmetric memory (kernels/push_rows.py); device
                sizes, one host
  gloo          the CPU process group; host sizes, or with device planning the twin of sm_push (same routes)
``overlap.moe_compute_only`` (a benchmark's reference) keeps every exchange's sizes, signals and small messages but
lands each rank's rows in its own memory instead of the peers': the step without the transfers' cost, each layer
still waiting for its slowest peer. The loss means nothing then.
Transfers run on the transport's side stream (NCCL's own, the copy stream, or the push stream); a push takes as
many CTAs as the GEMMs beside it leave SMs free (``sms``), and with none free it runs on the compute stream
between them at full width, where it cannot stall a GEMM's launch (README, "What overlaps on Hopper"). A chunk's rows
are taken out of the receive buffer on the compute stream, at full width, just before its GEMMs: a local copy of
a few tens of microseconds, which beside the GEMMs would need as many SMs as the transfer itself.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moe_overlap.distributed.collectives import ProcessGroup, all_gather_into, all_to_all_equal, all_to_all_rows
from moe_overlap.distributed.streams import Event, exposed_wait, use_stream
from moe_overlap.distributed.symm import DEFAULT_TIMEOUT_MS, LocalRegions, SymmRegions, symm_unavailable_reason
from moe_overlap.kernels.push_rows import copy_rows_out, full_width, push_rows

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "nccl", "copy_engine", "sm_push", "gloo")
PLANNINGS = ("auto", "host", "device")
SYMMETRIC = ("copy_engine", "sm_push")  # through symmetric memory: GPUs of one host


@dataclass
class ExchangeLayout:
    """Rows per (chunk, peer) and their first row on each side; all lists are [chunk][peer]."""

    send_rows: list[list[int]]
    send_offsets: list[list[int]]  # in this rank's send buffer
    recv_rows: list[list[int]]
    recv_offsets: list[list[int]]  # in this rank's receive buffer
    remote_recv_offsets: list[list[int]]  # where this rank's rows land in each peer's receive buffer
    remote_send_offsets: list[list[int]]  # where each peer's rows for this rank sit in its send buffer
    send_total: int
    recv_total: int

    @property
    def num_chunks(self) -> int:
        return len(self.send_rows)

    def send_range(self, chunk: int) -> tuple[int, int]:
        return self.send_offsets[chunk][0], self.send_offsets[chunk][0] + sum(self.send_rows[chunk])

    def recv_range(self, chunk: int) -> tuple[int, int]:
        return self.recv_offsets[chunk][0], self.recv_offsets[chunk][0] + sum(self.recv_rows[chunk])

    def reversed(self) -> ExchangeLayout:
        """The same rows travelling back (combine after dispatch, or the gradients of either)."""
        return ExchangeLayout(self.recv_rows, self.recv_offsets, self.send_rows, self.send_offsets,
                              self.remote_send_offsets, self.remote_recv_offsets, self.recv_total, self.send_total)


def exchange_layout(rows_SDC: np.ndarray, rank: int) -> ExchangeLayout:
    """Layout of a chunked exchange from ``rows_SDC[source, destination, chunk]`` (every rank's counts).

    Host work on every layer call, so numpy on a few dozen integers rather than torch ops.
    """
    rows_SDC = np.asarray(rows_SDC, dtype=np.int64)
    peers, chunks = rows_SDC.shape[1], rows_SDC.shape[2]

    def exclusive_offsets(rows_RCP: np.ndarray) -> np.ndarray:  # per rank: chunk-major, peers inside a chunk
        flat = rows_RCP.reshape(peers, chunks * peers)
        return (np.cumsum(flat, axis=1) - flat).reshape(peers, chunks, peers)

    send_offsets_RCD = exclusive_offsets(rows_SDC.transpose(0, 2, 1))  # [rank, chunk, destination]
    recv_offsets_RCS = exclusive_offsets(rows_SDC.transpose(1, 2, 0))  # [rank, chunk, source]
    return ExchangeLayout(
        send_rows=rows_SDC[rank].T.tolist(),
        send_offsets=send_offsets_RCD[rank].tolist(),
        recv_rows=rows_SDC[:, rank].T.tolist(),
        recv_offsets=recv_offsets_RCS[rank].tolist(),
        remote_recv_offsets=recv_offsets_RCS[:, :, rank].T.tolist(),  # [chunk, destination]
        remote_send_offsets=send_offsets_RCD[:, :, rank].T.tolist(),  # [chunk, source]
        send_total=int(rows_SDC[rank].sum()),
        recv_total=int(rows_SDC[:, rank].sum()),
    )


@dataclass
class HostRoutes:
    """Host-planned: the layout, and per chunk the gather from arrival order (source, local expert) to the
    grouped order (local expert, source) and back."""

    layout: ExchangeLayout
    regroup: list[torch.Tensor]
    ungroup: list[torch.Tensor]


@dataclass
class DeviceRoutes:
    """Device-planned, every size a device tensor; buffers have static worst-case shapes.

    This rank's permuted rows of chunk c are rows [send_start_C[c], + send_rows_C[c]); permuted row r goes to
    rank dst_rank_R[r], row dst_row_R[r] of its compact receive buffer (chunks in order, each in grouped
    order). This rank's received rows of chunk c are compact rows [recv_start_C[c], + recv_rows_C[c]), copied
    out to row 0 of a ``chunk_rows[c]``-row tensor; compact row q goes back to rank back_rank_W[q], row
    back_row_W[q] of its ``send_rows``-row permuted buffer."""

    send_start_C: torch.Tensor
    send_rows_C: torch.Tensor
    dst_rank_R: torch.Tensor
    dst_row_R: torch.Tensor
    recv_start_C: torch.Tensor
    recv_rows_C: torch.Tensor
    back_rank_W: torch.Tensor
    back_row_W: torch.Tensor
    send_rows: int  # static rows of a permuted buffer
    recv_rows: int  # static rows of the compact receive buffer
    chunk_rows: list[int]  # static rows of each chunk's grouped tensor


class _Streams:
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

    def mark(self, stream=None) -> Event:
        return Event(self.device).record(stream if stream is not None else (self.side or self.compute))

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



# ------------------------------------------------------------------------------------- host-sized transports
class _HostToExperts:
    """Rows arrive in (source, local expert) blocks; ``recv`` regroups them into a private tensor (the copy-out
    of a symmetric region, when they landed in one)."""

    def __init__(self, streams: _Streams, routes: HostRoutes, width: int):
        self.streams, self.routes, self.layout, self.width = streams, routes, routes.layout, width

    def recv(self, chunk: int) -> torch.Tensor:
        return self._arrived(chunk).index_select(0, self.routes.regroup[chunk])


class _HostFromExperts:
    """A chunk's grouped rows are ungrouped into (destination, local expert) blocks of a send buffer, then sent."""

    def __init__(self, streams: _Streams, routes: HostRoutes, width: int, like: torch.Tensor):
        self.streams, self.routes, self.layout = streams, routes, routes.layout.reversed()
        self.send_RH = like.new_empty((self.layout.send_total, width))
        streams.lend(self.send_RH)

    def send(self, chunk: int, grouped_RH: torch.Tensor, ready: Event, alone: bool = False) -> None:
        start, stop = self.layout.send_range(chunk)
        self.streams.lend(grouped_RH)
        with self.streams.on_side():
            self.streams.side_waits(ready)
            torch.index_select(grouped_RH, 0, self.routes.ungroup[chunk], out=self.send_RH[start:stop])
            self._start(chunk)


class _CollectiveExchange:
    """One asynchronous all_to_all_single per chunk over the process group (NCCL on its own stream, ordered
    after the side stream; gloo's thread), or a copy on a group of one rank."""

    def _all_to_all(self, chunk: int) -> None:
        send_start, send_stop = self.layout.send_range(chunk)
        recv_start, recv_stop = self.layout.recv_range(chunk)
        recv_RH, send_RH = self.recv_RH[recv_start:recv_stop], self.send_RH[send_start:send_stop]
        if self.group is None:
            recv_RH.copy_(send_RH)
            return
        if recv_RH.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("CUDA-graph capture of the MoE exchange needs overlap.moe_planning=device (sm_push): "
                               "a ProcessGroupNCCL all-to-all does not replay from a graph (measured: the capture "
                               "fails with cudaErrorStreamCaptureImplicit)")
        if self.compute_only:  # one element to every peer keeps the wait for the slowest; the rows stay here
            _fill_from(recv_RH, send_RH)
            self.tokens = send_RH.new_zeros((2, self.group.size()))  # kept until the work is waited for
            self.works[chunk] = dist.all_to_all_single(self.tokens[0], self.tokens[1], group=self.group,
                                                       async_op=True)
            return
        self.works[chunk] = dist.all_to_all_single(recv_RH, send_RH, self.layout.recv_rows[chunk],
                                                   self.layout.send_rows[chunk], group=self.group, async_op=True)

    def _wait(self, chunk: int) -> None:
        work = self.works.pop(chunk, None)
        if work is not None:
            with exposed_wait("ep"):
                work.wait()  # the compute stream (gloo: the host) waits


class CollectiveToExperts(_CollectiveExchange, _HostToExperts):
    transient = False

    def __init__(self, transport: CollectiveTransport, send_RH: torch.Tensor, routes: HostRoutes, sms: int):
        _HostToExperts.__init__(self, _Streams(send_RH.device, transport.stream), routes, send_RH.shape[1])
        self.group, self.works, self.send_RH = transport.group, {}, send_RH
        self.compute_only = transport.compute_only
        self.recv_RH = send_RH.new_empty((self.layout.recv_total, self.width))
        self.streams.lend(send_RH, self.recv_RH)

    def send(self, chunk: int, alone: bool = False) -> None:
        with self.streams.on_side():
            self._all_to_all(chunk)

    def _arrived(self, chunk: int) -> torch.Tensor:
        self._wait(chunk)
        if self.group is None:  # the copy ran on the side stream
            self.streams.compute_waits(self.streams.mark())
        start, stop = self.layout.recv_range(chunk)
        return self.recv_RH[start:stop]

    def finish(self) -> None:
        assert not self.works, f"chunks {sorted(self.works)} were sent but never received"


class CollectiveFromExperts(_CollectiveExchange, _HostFromExperts):
    transient = False

    def __init__(self, transport: CollectiveTransport, routes: HostRoutes, width: int, like: torch.Tensor, sms: int):
        _HostFromExperts.__init__(self, _Streams(like.device, transport.stream), routes, width, like)
        self.group, self.works, self.compute_only = transport.group, {}, transport.compute_only
        self.recv_RH = like.new_empty((self.layout.recv_total, width))

    def _start(self, chunk: int) -> None:
        self._all_to_all(chunk)

    def result(self) -> torch.Tensor:
        for chunk in list(self.works):
            self._wait(chunk)
        if self.group is None:  # the copies ran on the side stream
            self.streams.compute_waits(self.streams.mark())
        return self.recv_RH

    def finish(self) -> None:
        assert not self.works, f"chunks {sorted(self.works)} were sent but never received"


class _Transport:
    """A transport opens one exchange per direction and layer call (the classes it names)."""

    to_class: type
    from_class: type

    def to_experts(self, send_RH: torch.Tensor, routes, sms: int):
        return self.to_class(self, send_RH, routes, sms)

    def from_experts(self, routes, width: int, like: torch.Tensor, sms: int):
        return self.from_class(self, routes, width, like, sms)


class CollectiveTransport(_Transport):
    """``nccl`` or ``gloo``: host sizes, the process group's all-to-all."""

    needs_sms, to_class, from_class = True, CollectiveToExperts, CollectiveFromExperts

    def __init__(self, name: str, group: ProcessGroup, device: torch.device):
        self.name, self.group, self.compute_only = name, group, False
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None


def _fill_from(recv_RH: torch.Tensor, send_RH: torch.Tensor) -> None:
    """compute_only: the rows this rank would receive, made from its own rows (repeated as often as needed):
    as many bytes written as the exchange would land, all finite."""
    done = 0
    while done < recv_RH.shape[0]:
        rows = min(send_RH.shape[0], recv_RH.shape[0] - done)
        if rows == 0:  # nothing of its own to copy
            recv_RH[done:].zero_()
            return
        recv_RH[done:done + rows].copy_(send_RH[:rows])
        done += rows


class _CopyEngineExchange:
    """Pushes a chunk's (peer) blocks into the peers' claimed region with copy-engine copies on the copy stream,
    then raises one signal per (peer, chunk); the local block lands by a local copy, which the event covers."""

    def _claim(self, transport: CopyEngineTransport, like: torch.Tensor, width: int) -> None:
        self.transport, self.regions, self.compute_only = transport, transport.regions, transport.compute_only
        self.row_bytes = width * like.element_size()
        self.region = self.regions.claim(self.streams.side)

    def _copy_chunk(self, chunk: int, send_RH: torch.Tensor) -> None:
        layout, regions = self.layout, self.regions
        for peer in range(regions.size):
            rows = layout.send_rows[chunk][peer]
            if rows:
                start = layout.send_offsets[chunk][peer]
                dest = regions.view(regions.rank if self.compute_only else peer, self.region,
                                    (rows, send_RH.shape[1]), send_RH.dtype,
                                    layout.remote_recv_offsets[chunk][peer] * self.row_bytes)
                dest.copy_(send_RH[start:start + rows], non_blocking=True)
        for peer in regions.peers:
            regions.signal(peer, self.region, chunk)

    def _wait_peers(self, chunk: int) -> None:
        for peer in self.regions.peers:
            self.regions.wait(peer, self.region, chunk)


class CopyEngineToExperts(_CopyEngineExchange, _HostToExperts):
    transient = False

    def __init__(self, transport: CopyEngineTransport, send_RH: torch.Tensor, routes: HostRoutes, sms: int):
        _HostToExperts.__init__(self, _Streams(send_RH.device, transport.stream), routes, send_RH.shape[1])
        self._claim(transport, send_RH, self.width)
        self.send_RH, self.sent = send_RH, {}
        self.streams.lend(send_RH)
        self.own_RH = self.regions.view(self.regions.rank, self.region, (self.layout.recv_total, self.width),
                                        send_RH.dtype)

    def send(self, chunk: int, alone: bool = False) -> None:
        with self.streams.on_side():
            self._copy_chunk(chunk, self.send_RH)
            self.sent[chunk] = self.streams.mark()  # covers the local block, which no signal announces

    def _arrived(self, chunk: int) -> torch.Tensor:
        self.streams.compute_waits(self.sent.pop(chunk))
        with exposed_wait("ep"):
            self._wait_peers(chunk)
        start, stop = self.layout.recv_range(chunk)
        return self.own_RH[start:stop]

    def finish(self) -> None:
        assert not self.sent, f"chunks {sorted(self.sent)} were sent but never received"
        with exposed_wait("ep"):  # a signal waits for the peer's slot to clear
            self.regions.release(self.region)  # on the compute stream: after the last regroup read it


class CopyEngineFromExperts(_CopyEngineExchange, _HostFromExperts):
    transient = True  # result() is the claimed region: read it before finish()

    def __init__(self, transport: CopyEngineTransport, routes: HostRoutes, width: int, like: torch.Tensor, sms: int):
        _HostFromExperts.__init__(self, _Streams(like.device, transport.stream), routes, width, like)
        self._claim(transport, like, width)
        self.chunks = 0

    def _start(self, chunk: int) -> None:
        self._copy_chunk(chunk, self.send_RH)
        self.chunks += 1

    def result(self) -> torch.Tensor:
        self.streams.compute_waits(self.streams.mark())
        with exposed_wait("ep"):
            for chunk in range(self.chunks):
                self._wait_peers(chunk)
        return self.regions.view(self.regions.rank, self.region, (self.layout.recv_total, self.send_RH.shape[1]),
                                 self.send_RH.dtype)

    def finish(self) -> None:
        with exposed_wait("ep"):
            self.regions.release(self.region)  # on the compute stream: after everything that read the region


class CopyEngineTransport(_Transport):
    """``copy_engine``: host sizes, copy-engine peer copies through symmetric memory (no SMs move the data)."""

    name, needs_sms, to_class, from_class = "copy_engine", False, CopyEngineToExperts, CopyEngineFromExperts

    def __init__(self, regions, device: torch.device):
        self.regions, self.compute_only = regions, False
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None


# ----------------------------------------------------------------------------------- device-sized transports
class _PushExchange:
    """SM pushes of the device routes into the claimed region of every rank (``move``), each chunk announced
    by one signal per (peer, chunk). The push runs on the side stream with ``sms`` CTAs while a GEMM leaves
    that many SMs free, else on the compute stream at full width."""

    def _open(self, transport: PushTransport, device: torch.device, sms: int) -> None:
        self.transport, self.regions = transport, transport.regions
        self.streams = _Streams(device, transport.stream if sms else None)
        self.ctas = sms or full_width(device)
        with self._exposed():
            self.region = self.regions.claim(self.streams.side or self.streams.compute)

    def _exposed(self):
        """Pushes, claims and signals on the compute stream hold it: exposed; on the side stream they are not."""
        return exposed_wait("ep" if self.streams.side is None else None)

    def _own(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        return self.regions.view(self.regions.rank, self.region, (rows, like.shape[1]), like.dtype)

    def _push(self, chunk: int, src_RH: torch.Tensor, src_start: torch.Tensor, count: torch.Tensor,
              dst_rank_Q: torch.Tensor, dst_row_Q: torch.Tensor, route_start: torch.Tensor, alone: bool) -> None:
        """``alone``: no GEMM runs beside this one (the pipeline's first transfer, or its last): full width."""
        with self._exposed():
            self.transport.move(src_RH, src_start, count, dst_rank_Q, dst_row_Q, route_start, self.region,
                                full_width(src_RH.device) if alone else self.ctas)
            for peer in self.regions.peers:  # after the kernel, on its stream: its stores have landed
                self.regions.signal(peer, self.region, chunk)

    def _wait_peers(self, chunk: int) -> None:
        for peer in self.regions.peers:
            self.regions.wait(peer, self.region, chunk)


class PushToExperts(_PushExchange):
    transient = False

    def __init__(self, transport: PushTransport, send_RH: torch.Tensor, routes: DeviceRoutes, sms: int):
        self._open(transport, send_RH.device, sms)
        self.send_RH, self.routes, self.sent = send_RH, routes, {}
        self.streams.lend(send_RH)
        self.own_RH = self._own(routes.recv_rows, send_RH)

    def send(self, chunk: int, alone: bool = False) -> None:
        r = self.routes
        start = r.send_start_C[chunk:chunk + 1]
        with self.streams.on_side():
            self._push(chunk, self.send_RH, start, r.send_rows_C[chunk:chunk + 1], r.dst_rank_R, r.dst_row_R, start,
                       alone)
            self.sent[chunk] = self.streams.mark()  # covers the local rows, which no signal announces

    def recv(self, chunk: int) -> torch.Tensor:
        """The chunk's rows copied out of the region to row 0 of a tensor of its static rows, at full width."""
        r = self.routes
        self.streams.compute_waits(self.sent.pop(chunk))
        with exposed_wait("ep"):
            self._wait_peers(chunk)
        grouped_RH = self.send_RH.new_empty((r.chunk_rows[chunk], self.send_RH.shape[1]))
        copy_rows_out(self.own_RH, r.recv_start_C[chunk:chunk + 1], r.recv_rows_C[chunk:chunk + 1], grouped_RH,
                      full_width(grouped_RH.device))
        return grouped_RH

    def finish(self) -> None:
        assert not self.sent, f"chunks {sorted(self.sent)} were sent but never received"
        with exposed_wait("ep"):
            self.regions.release(self.region)  # on the compute stream: after the last copy-out read it


class PushFromExperts(_PushExchange):
    transient = True  # result() is the claimed region: read it before finish()

    def __init__(self, transport: PushTransport, routes: DeviceRoutes, width: int, like: torch.Tensor, sms: int):
        self._open(transport, like.device, sms)
        self.routes, self.chunks, self.last = routes, 0, None
        self.own_RH = self._own(routes.send_rows, like.new_empty((0, width)))
        self.zero = torch.zeros(1, dtype=torch.int64, device=like.device)

    def send(self, chunk: int, grouped_RH: torch.Tensor, ready: Event, alone: bool = False) -> None:
        r = self.routes
        self.streams.lend(grouped_RH)
        with self.streams.on_side():
            self.streams.side_waits(ready)
            self._push(chunk, grouped_RH, self.zero, r.recv_rows_C[chunk:chunk + 1], r.back_rank_W, r.back_row_W,
                       r.recv_start_C[chunk:chunk + 1], alone)
            self.last = self.streams.mark()
        self.chunks += 1

    def result(self) -> torch.Tensor:
        if self.last is not None:
            self.streams.compute_waits(self.last)
        with exposed_wait("ep"):
            for chunk in range(self.chunks):
                self._wait_peers(chunk)
        return self.own_RH

    def finish(self) -> None:
        with exposed_wait("ep"):
            self.regions.release(self.region)  # on the compute stream: after everything that read the region


class PushTransport(_Transport):
    """``sm_push``: device sizes, rows stored by a Triton kernel into every rank's region of symmetric memory
    (:class:`LocalRegions` on a group of one rank). With ``twin`` it is the CPU twin instead: the same
    routes, the rows moved by ``twin_group`` (gloo), one host sync per move."""

    needs_sms, to_class, from_class = True, PushToExperts, PushFromExperts

    def __init__(self, regions, device: torch.device, twin: bool = False, twin_group: ProcessGroup = None):
        self.regions, self.device, self.twin_group = regions, device, twin_group
        self.symmetric, self.compute_only = not twin, False
        if self.symmetric:
            self.name = "sm_push"
            self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
            size = regions.region_bytes

            def bases(ptrs: list[int]) -> list[torch.Tensor]:  # per region, every rank's address in the kernel's
                return [torch.tensor([ptr + region * size for ptr in ptrs], dtype=torch.int64, device=device)
                        for region in range(regions.count)]

            self._bases = bases(regions.buffer_ptrs)
            self._own_bases = bases([regions.buffer_ptrs[regions.rank]] * regions.size)  # compute_only's
        else:
            self.name, self.stream = "gloo", None

    def move(self, src_RH, src_start, count, dst_rank_Q, dst_row_Q, route_start, region: int, ctas: int) -> None:
        if self.symmetric:
            bases = self._own_bases if self.compute_only else self._bases
            push_rows(src_RH, src_start, count, dst_rank_Q, dst_row_Q, route_start, bases[region], ctas)
            return
        first, n, q0 = (int(v.reshape(-1)[0]) for v in (src_start, count, route_start))
        rows_RH, ranks, dst_rows = src_RH[first:first + n], dst_rank_Q[q0:q0 + n], dst_row_Q[q0:q0 + n]
        own_RH = self.regions.view(self.regions.rank, region, (self.regions.region_bytes // (
            src_RH.shape[1] * src_RH.element_size()), src_RH.shape[1]), src_RH.dtype)
        _exchange_routed(rows_RH, ranks, dst_rows, own_RH, self.twin_group, self.regions.size, self.compute_only)

    def gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Every EP rank's copies per global expert, [source rank, expert], on the device: by the process group
        for the twin; else pushed like rows (one row to every rank), so a CUDA graph of the layer holds no
        collective."""
        ranks = self.regions.size
        if not self.symmetric:
            return all_gather_into(counts_E.new_empty(ranks * counts_E.numel()), counts_E.contiguous(),
                                   self.twin_group).view(ranks, -1)
        regions = self.regions
        region = regions.claim(torch.cuda.current_stream() if counts_E.is_cuda else None)
        every = torch.arange(ranks, dtype=torch.int32, device=counts_E.device)
        counts_SE = counts_E.view(1, -1).expand(ranks, -1).contiguous()
        zero = torch.zeros(1, dtype=torch.int64, device=counts_E.device)
        push_rows(counts_SE, zero, zero + ranks, every, torch.full_like(every, regions.rank, dtype=torch.int64),
                  zero, self._bases[region], ctas=1)
        for peer in regions.peers:
            regions.signal(peer, region, 0)
        with exposed_wait("ep"):
            for peer in regions.peers:
                regions.wait(peer, region, 0)
        gathered_SE = regions.view(regions.rank, region, counts_SE.shape, counts_SE.dtype).clone()
        regions.release(region)
        return gathered_SE


class _TwinRegions:
    """The gloo twin's stand-in for symmetric regions: private CPU buffers, no flow control needed."""

    def __init__(self, region_bytes: int, count: int, group: ProcessGroup, device: torch.device):
        self.local = LocalRegions(region_bytes, count, 1, device)
        self.region_bytes, self.count = self.local.region_bytes, count
        self.rank = 0 if group is None else dist.get_rank(group)
        self.size = 1 if group is None else dist.get_world_size(group)
        self.peers: list[int] = []  # the process group's exchange completes before it returns: nothing to signal

    def claim(self, stream) -> int:
        return self.local.claim(stream)

    def release(self, region: int) -> None:
        pass

    def view(self, rank: int, region: int, shape, dtype, offset_bytes: int = 0) -> torch.Tensor:
        return self.local.view(0, region, shape, dtype, offset_bytes)


def _exchange_routed(rows_RH: torch.Tensor, ranks: torch.Tensor, dst_rows: torch.Tensor, out_RH: torch.Tensor,
                     group: ProcessGroup, size: int, compute_only: bool = False) -> None:
    """Rows to the ranks and rows the routes name, by an uneven all-to-all (its sizes read on the host);
    ``compute_only``: the sizes travel, every row lands here."""
    order = torch.argsort(ranks, stable=True)
    send_rows = torch.bincount(ranks.long(), minlength=size)
    with exposed_wait("ep"):
        recv_rows = send_rows if group is None else all_to_all_equal(send_rows.view(size, 1), group)
        if compute_only:
            out_RH[dst_rows.long()] = rows_RH
            return
        send, recv = send_rows.tolist(), recv_rows.view(-1).tolist()
        landed_RH = all_to_all_rows(rows_RH[order], recv, send, group)
        index_R = all_to_all_rows(dst_rows[order].long(), recv, send, group)
    out_RH[index_R] = landed_RH


# ------------------------------------------------------------------------------------------------ selection
def choose_exchange(planning: str, transport: str, device_type: str, symm_reason: str | None) -> tuple[str, str, str]:
    """(planning, transport, why) for ``overlap.moe_planning`` and ``overlap.moe_transport``; ``symm_reason`` says
    why symmetric memory cannot run (None: it can). A combination that cannot run is an error that says why."""
    if planning not in PLANNINGS:
        raise ValueError(f"overlap.moe_planning={planning!r}: allowed {', '.join(PLANNINGS)}")
    if transport not in TRANSPORTS:
        raise ValueError(f"overlap.moe_transport={transport!r}: allowed {', '.join(TRANSPORTS)}")
    if device_type != "cuda":
        if transport not in ("auto", "gloo"):
            raise ValueError(f"overlap.moe_transport={transport!r} cannot run on the CPU; use 'auto' or 'gloo'")
        planned = "host" if planning == "auto" else planning
        why = "the CPU" + (": the twin of sm_push, the same device routes moved by gloo" if planned == "device" else "")
        return planned, "gloo", why
    if transport == "gloo":
        raise ValueError("overlap.moe_transport='gloo' is the CPU transport; on CUDA use 'auto', 'nccl', "
                         "'copy_engine' or 'sm_push'")
    if transport in SYMMETRIC and symm_reason is not None:
        raise ValueError(f"overlap.moe_transport={transport!r} cannot run: {symm_reason}; use 'auto' or 'nccl'")
    if transport == "auto":
        if symm_reason is None:
            transport = "copy_engine" if planning == "host" else "sm_push"
            why = "every EP rank shares one host with peer access"
        elif planning == "device":
            raise ValueError(f"overlap.moe_planning='device' needs overlap.moe_transport='sm_push', which cannot run: "
                             f"{symm_reason}; use overlap.moe_planning='auto' or 'host'")
        else:
            transport, why = "nccl", f"symmetric memory cannot run: {symm_reason}"
    else:
        why = "requested"
    device_sized = transport == "sm_push"
    if planning == "auto":
        planning = "device" if device_sized else "host"
    elif (planning == "device") != device_sized:
        raise ValueError(f"overlap.moe_transport={transport!r} takes {'device' if device_sized else 'host'} sizes: "
                         f"it cannot run with overlap.moe_planning={planning!r} (use 'auto' or "
                         f"'{'device' if device_sized else 'host'}')")
    return planning, transport, why


class TransportSelector:
    """Picks the EP pipeline's planning and transport once (logging which and why) and sizes the symmetric
    regions lazily: for the worst exchange of the first call (every rank's copies landing on one rank); all EP
    ranks see the same micro-batch shape, so they grow them together. A group of one rank (a one-GPU
    measurement of the pipeline) keeps its regions in ordinary memory."""

    def __init__(self, planning: str, transport: str, group: ProcessGroup, group_ranks: list[int],
                 device: torch.device, max_chunks: int, timeout_s: float, compute_only: bool = False):
        reason = None
        if device.type == "cuda" and group is None and transport not in SYMMETRIC:  # asked for: a one-GPU measure
            reason = "the group has one rank: nothing to exchange"
        elif device.type == "cuda" and group is not None:
            reason = symm_unavailable_reason(group, device)
            local = int(os.environ.get("LOCAL_WORLD_SIZE", len(group_ranks)))
            hosts = {r // max(local, 1) for r in group_ranks}
            if reason is None and len(hosts) > 1:
                reason = f"the ranks {group_ranks} span {len(hosts)} hosts (LOCAL_WORLD_SIZE={local})"
        self.planning, self.name, why = choose_exchange(planning, transport, device.type, reason)
        self.group, self.device, self.max_chunks = group, device, max(max_chunks, 1)
        self.timeout_ms = int(timeout_s * 1000)
        # overlap.moe_compute_only (a benchmark may switch it between steps of eager layers: every region holds
        # finite rows from its start, so a row no peer wrote is still a number)
        self.compute_only = compute_only
        self._transport = None
        self._retired: list = []  # outgrown ones (the first micro-batches only)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("MoE pipeline: %s-planned sizes over %s (moe_planning=%s, moe_transport=%s: %s)",
                     self.planning, self.name, planning, transport, why)

    def transport(self, worst_case_bytes: int):
        """The transport, its regions (if any) holding at least ``worst_case_bytes`` each."""
        current = self._transport
        if current is not None and getattr(current, "regions", None) is not None:
            if current.regions.region_bytes < worst_case_bytes:  # exchanges in flight may still use it: kept
                self._retired.append(current)
                current = None
        if current is None:
            current = self._transport = self._make(worst_case_bytes)
        current.compute_only = self.compute_only
        return current

    def _make(self, nbytes: int):
        if self.name in ("nccl", "gloo") and self.planning == "host":
            return CollectiveTransport(self.name, self.group, self.device)
        if self.name == "gloo":
            return PushTransport(_TwinRegions(nbytes, 4, self.group, self.device), self.device, twin=True,
                                 twin_group=self.group)
        regions = (LocalRegions(nbytes, 4, self.max_chunks, self.device) if self.group is None else
                   SymmRegions(self.group, nbytes, 4, self.max_chunks, self.device, self.timeout_ms))
        return CopyEngineTransport(regions, self.device) if self.name == "copy_engine" else PushTransport(regions,
                                                                                                          self.device)
