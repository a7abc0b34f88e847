"""All-to-all transports behind one interface: ``nccl`` / ``gloo`` collectives, and ``symm``, a copy-engine
exchange through torch symmetric memory (no SMs move the data; see DESIGN.md for why it overlaps a GEMM
where NCCL does not).

An exchange moves rows in chunks. Both buffers are chunk-major: chunk i's rows for (or from) every peer are
contiguous, in peer order, so one chunk is one contiguous region on each side. ``ExchangeLayout`` holds
where every chunk's rows sit on both sides (host integers), derived from the full count matrix that every
rank holds after the counts all-gather.

    ex = transport.exchange(send_RH, layout)   # the receive buffer is ex.recv_buffer
    ex.send(i)        # start chunk i (after the current stream's writes to its rows)
    rows = ex.recv(i) # the current stream waits until chunk i's rows have landed
    ex.finish()       # the receive buffer has been read: a symmetric slot may be reused
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moe_overlap.distributed.collectives import ProcessGroup, all_to_all_equal, all_to_all_rows
from moe_overlap.distributed.streams import exposed_wait
from moe_overlap.distributed.symm import DEFAULT_TIMEOUT_MS, SymmRegions, choose_transport, symm_unavailable_reason
from moe_overlap.kernels.push_rows import copy_counted_rows, push_rows

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "symm", "gloo")


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


class Exchange:
    def __init__(self, send_RH: torch.Tensor, recv_RH: torch.Tensor, layout: ExchangeLayout):
        self.send_buffer, self.recv_buffer, self.layout = send_RH, recv_RH, layout

    def chunk_view(self, chunk: int) -> torch.Tensor:
        start, stop = self.layout.recv_range(chunk)
        return self.recv_buffer[start:stop]

    def result(self) -> torch.Tensor:
        """The whole receive buffer as a tensor the caller may keep (call before ``finish``)."""
        return self.recv_buffer


class CollectiveExchange(Exchange):
    """One asynchronous all_to_all_single per chunk (NCCL on its own stream, or gloo's thread)."""

    def __init__(self, send_RH, recv_RH, layout, group: ProcessGroup):
        super().__init__(send_RH, recv_RH, layout)
        self.group, self.works = group, {}

    def send(self, chunk: int) -> None:
        send_start, send_stop = self.layout.send_range(chunk)
        recv_start, recv_stop = self.layout.recv_range(chunk)
        if self.send_buffer.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("CUDA-graph capture of the MoE exchange needs overlap.moe_a2a_backend='symm': "
                               "a ProcessGroupNCCL all-to-all does not replay from a graph (measured: the capture "
                               "fails with cudaErrorStreamCaptureImplicit)")
        if self.group is None:  # one rank: its own rows are all there is
            self.recv_buffer[recv_start:recv_stop].copy_(self.send_buffer[send_start:send_stop])
            return
        self.works[chunk] = dist.all_to_all_single(
            self.recv_buffer[recv_start:recv_stop], self.send_buffer[send_start:send_stop],
            self.layout.recv_rows[chunk], self.layout.send_rows[chunk], group=self.group, async_op=True)

    def recv(self, chunk: int) -> torch.Tensor:
        work = self.works.pop(chunk, None)
        if work is not None:
            with exposed_wait("ep"):
                work.wait()
        return self.chunk_view(chunk)

    def finish(self) -> None:
        assert not self.works, f"chunks {sorted(self.works)} were sent but never received"


class CollectiveTransport:
    def __init__(self, name: str, group: ProcessGroup):
        self.name, self.group = name, group

    def exchange(self, send_RH: torch.Tensor, layout: ExchangeLayout) -> CollectiveExchange:
        recv_RH = send_RH.new_empty((layout.recv_total,) + tuple(send_RH.shape[1:]))
        return CollectiveExchange(send_RH, recv_RH, layout, self.group)


class SymmExchange(Exchange):
    """Pushes each chunk into the peers' registered receive slots with copy-engine peer copies on a copy
    stream, then raises one signal per (peer, chunk); the receiver's stream waits on those signals. Slots
    are the regions of :class:`SymmRegions`, which owns the flow control."""

    def __init__(self, transport: SymmTransport, send_RH: torch.Tensor, layout: ExchangeLayout):
        regions = transport.regions
        self.row_shape = tuple(send_RH.shape[1:])
        stream = transport.copy_stream
        stream.wait_stream(torch.cuda.current_stream())
        send_RH.record_stream(stream)
        self.slot = regions.claim(stream)
        recv_RH = regions.view(regions.rank, self.slot, (layout.recv_total,) + self.row_shape, send_RH.dtype)
        super().__init__(send_RH, recv_RH, layout)
        self.transport = transport
        self.row_bytes = send_RH[0:1].numel() * send_RH.element_size() if send_RH.shape[0] else 0
        self.landed = {}

    def send(self, chunk: int) -> None:
        transport, regions, layout = self.transport, self.transport.regions, self.layout
        stream = transport.copy_stream
        stream.wait_stream(torch.cuda.current_stream())  # the chunk's rows were written on this stream
        with torch.cuda.stream(stream):
            for peer in range(regions.size):
                rows = layout.send_rows[chunk][peer]
                if rows == 0:
                    continue
                start = layout.send_offsets[chunk][peer]
                dest = regions.view(peer, self.slot, (rows,) + self.row_shape, self.send_buffer.dtype,
                                    layout.remote_recv_offsets[chunk][peer] * self.row_bytes)
                dest.copy_(self.send_buffer[start:start + rows], non_blocking=True)
            for peer in regions.peers:
                regions.signal(peer, self.slot, chunk)
            self.landed[chunk] = torch.cuda.Event()
            self.landed[chunk].record(stream)  # covers the local rows, which no signal announces

    def recv(self, chunk: int) -> torch.Tensor:
        current = torch.cuda.current_stream()
        with exposed_wait("ep"):
            current.wait_event(self.landed.pop(chunk))
            for peer in self.transport.regions.peers:
                self.transport.regions.wait(peer, self.slot, chunk)
        return self.chunk_view(chunk)

    def result(self) -> torch.Tensor:
        return self.recv_buffer.clone()  # the slot is reused once released

    def finish(self) -> None:
        assert not self.landed, f"chunks {sorted(self.landed)} were sent but never received"
        self.transport.regions.release(self.slot)  # on the current stream: after everything that read the slot


class SymmTransport:
    """Copy-engine exchange over ``slots`` symmetric receive slots used in turn.

    A slot holds the worst case of one exchange (every token copy of every rank landing here, dropless),
    so several exchanges (dispatch and combine of two micro-batches, by default) can be in flight.
    """

    name = "symm"

    def __init__(self, group: dist.ProcessGroup, slot_bytes: int, device: torch.device, max_chunks: int,
                 slots: int = 4, timeout_ms: int = DEFAULT_TIMEOUT_MS):
        self.max_chunks = max_chunks
        self.regions = SymmRegions(group, slot_bytes, slots, max_chunks, device, timeout_ms)
        self.slot_bytes = self.regions.region_bytes
        self.copy_stream = torch.cuda.Stream(device=device)

    def exchange(self, send_RH: torch.Tensor, layout: ExchangeLayout) -> SymmExchange:
        if layout.num_chunks > self.max_chunks:
            raise ValueError(f"{layout.num_chunks} chunks exceed the transport's {self.max_chunks}")
        need = max(layout.recv_total, 1) * send_RH[0:1].numel() * send_RH.element_size()
        if need > self.slot_bytes:
            raise ValueError(f"an exchange of {layout.recv_total} rows ({need} bytes) does not fit the "
                             f"{self.slot_bytes}-byte receive slot; the workspace was sized too small")
        return SymmExchange(self, send_RH, layout)


@dataclass
class Route:
    """A sync-free exchange, sized on the device: rows [0, num_rows) of the source travel, row r to rank
    dst_rank_R[r], row dst_row_R[r] of a receive buffer of ``out_rows`` rows (static), of which ``recv_rows``
    arrive on this rank."""

    num_rows: torch.Tensor  # (1,) int64
    dst_rank_R: torch.Tensor  # int32
    dst_row_R: torch.Tensor  # int64
    out_rows: int
    recv_rows: torch.Tensor  # (1,) int64


class SymmPusher:
    """Sync-free row exchange: every rank pushes its rows into the peers' symmetric regions with SM stores
    (kernels.push_rows), all sizes on the device; the flow control is :class:`SymmRegions`' (a collective:
    all ranks construct it, and every rank pushes the same sequence of exchanges).

    ``push`` returns a tensor of its own (the region is reused once released): rows past the received count
    hold whatever the region held, and callers read only the counted rows.
    """

    name = "symm"

    def __init__(self, group: dist.ProcessGroup, region_bytes: int, device: torch.device, regions: int = 4,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS):
        self.regions = SymmRegions(group, region_bytes, regions, 1, device, timeout_ms)
        size, ptrs = self.regions.region_bytes, self.regions.workspace.handle.buffer_ptrs
        # Every rank's address of each region, as the kernel reads them.
        self._bases = [torch.tensor([ptr + region * size for ptr in ptrs], dtype=torch.int64, device=device)
                       for region in range(regions)]

    def push(self, src_RH: torch.Tensor, route: Route) -> torch.Tensor:
        regions = self.regions
        region = regions.claim(torch.cuda.current_stream())
        push_rows(src_RH, route.num_rows, route.dst_rank_R, route.dst_row_R, self._bases[region])
        for peer in regions.peers:  # after the kernel, on its stream: its stores have landed
            regions.signal(peer, region, 0)
        with exposed_wait("ep"):
            for peer in regions.peers:
                regions.wait(peer, region, 0)
        shape = (route.out_rows,) + tuple(src_RH.shape[1:])
        landed_RH = regions.view(regions.rank, region, shape, src_RH.dtype)
        out_RH = copy_counted_rows(landed_RH, route.recv_rows, src_RH.new_empty(shape))
        regions.release(region)
        return out_RH


class CollectivePusher:
    """The process group's twin of :class:`SymmPusher` (gloo on CPU): the same routes, moved by an uneven
    all-to-all, which needs the counts on the host (one sync per push)."""

    def __init__(self, name: str, group: ProcessGroup):
        self.name, self.group = name, group

    def push(self, src_RH: torch.Tensor, route: Route) -> torch.Tensor:
        n = int(route.num_rows.reshape(-1)[0])
        dst_rank_R = route.dst_rank_R[:n]
        order = torch.argsort(dst_rank_R, stable=True)
        peers = 1 if self.group is None else dist.get_world_size(self.group)
        send_rows = torch.bincount(dst_rank_R.long(), minlength=peers)
        with exposed_wait("ep"):
            recv_rows = send_rows if self.group is None else all_to_all_equal(send_rows.view(peers, 1), self.group)
            send, recv = send_rows.tolist(), recv_rows.view(-1).tolist()
            rows_RH = all_to_all_rows(src_RH[:n][order], recv, send, self.group)
            index_R = all_to_all_rows(route.dst_row_R[:n][order].long(), recv, send, self.group)
        out_RH = src_RH.new_zeros((route.out_rows,) + tuple(src_RH.shape[1:]))
        out_RH[index_R] = rows_RH
        return out_RH


class TransportSelector:
    """Picks the EP transport once (logging which and why) and sizes the symmetric one lazily.

    The symmetric workspace is sized for the worst exchange of the first call (every rank's copies landing
    on one rank, dropless); all EP ranks see the same micro-batch shape, so they grow it together.
    """

    def __init__(self, requested: str, group: ProcessGroup, group_ranks: list[int], device: torch.device,
                 max_chunks: int, timeout_s: float):
        reason = symm_unavailable_reason(group, device) if device.type == "cuda" else "the device is the CPU"
        local = int(os.environ.get("LOCAL_WORLD_SIZE", len(group_ranks)))
        self.name, why = choose_backend(requested, device.type, group_ranks, local, reason)
        self.group, self.device, self.max_chunks = group, device, max_chunks
        self.timeout_ms = int(timeout_s * 1000)
        self._symm: dict[type, object] = {}  # SymmTransport and/or SymmPusher, by class
        self._retired: list = []  # outgrown ones (the first micro-batches only)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("MoE all-to-all transport: %s (moe_a2a_backend=%s: %s)", self.name, requested, why)

    def transport(self, worst_case_bytes: int):
        """The chunked exchange: copy-engine pushes over symm, or the process group's all-to-all."""
        if self.name != "symm":
            return CollectiveTransport(self.name, self.group)
        return self._sized(SymmTransport, worst_case_bytes, lambda: SymmTransport(
            self.group, worst_case_bytes, self.device, self.max_chunks, timeout_ms=self.timeout_ms))

    def pusher(self, worst_case_bytes: int):
        """The sync-free exchange: SM pushes over symm, or the process group's twin (one host sync a push)."""
        if self.name != "symm":
            return CollectivePusher(self.name, self.group)
        return self._sized(SymmPusher, worst_case_bytes, lambda: SymmPusher(
            self.group, worst_case_bytes, self.device, timeout_ms=self.timeout_ms))

    def _sized(self, kind: type, worst_case_bytes: int, make):
        current = self._symm.get(kind)
        if current is None or current.regions.region_bytes < worst_case_bytes:
            if current is not None:  # exchanges in flight and peers' signals may still use it: kept
                self._retired.append(current)
            self._symm[kind] = current = make()
        return current


def choose_backend(requested: str, device_type: str, group_ranks: list[int], local_world_size: int,
                   symm_reason: str | None) -> tuple[str, str]:
    """The EP transport to use and why: symm on one host with peer access, else nccl (gloo on CPU)."""
    return choose_transport("overlap.moe_a2a_backend", requested, BACKENDS, "gloo" if device_type == "cpu" else "nccl",
                            group_ranks, local_world_size, symm_reason)
