"""The host-sized MoE transports: sizes read on the host (one fetch of every rank's counts per layer call), exact
buffers, the routes of a2a_routes.HostRoutes.

  nccl, gloo    the EP process group's all-to-all per chunk (CollectiveTransport; NCCL on its own stream, its
                communicator held to ``overlap.ep_comm_ctas``; gloo on the CPU)
  copy_engine   peer copies into the peers' symmetric memory on a copy stream, no SMs (CopyEngineTransport)

Either way a chunk's rows arrive in (source, local expert) blocks and are regrouped for the grouped GEMMs; rows
going back are ungrouped into (destination, local expert) blocks of a send buffer first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_overlap.distributed.a2a_exchange import (ExchangeStreams, FromExperts, ToExperts, Transport,
                                                   gather_through_regions)
from moe_overlap.distributed.a2a_routes import HostRoutes
from moe_overlap.distributed.collectives import ProcessGroup, all_gather_counts
from moe_overlap.distributed.streams import Event, exposed_wait
from moe_overlap.exchange_rules import graph_refusal
from moe_overlap.kernels.push_rows import repeat_rows_host


class _HostToExperts(ToExperts):
    """Rows arrive in (source, local expert) blocks; ``recv`` regroups them into a private tensor (the copy-out
    of a symmetric region, when they landed in one). Rows that arrive in the order their consumer takes (no
    ``regroup``: wire rows in slots) are handed over where they landed if read once, else copied out of a region."""

    lands_in_region = False  # the rows land in a symmetric region that finish() releases

    def __init__(self, streams: ExchangeStreams, routes: HostRoutes, width: int):
        self.streams, self.routes, self.layout, self.width = streams, routes, routes.layout, width

    def recv(self, chunk: int, read_once: bool = False) -> torch.Tensor:
        rows_RH = self._arrived(chunk)
        if self.routes.regroup is not None:
            return rows_RH.index_select(0, self.routes.regroup[chunk])
        return rows_RH if read_once or not self.lands_in_region else rows_RH.clone()


class _HostFromExperts(FromExperts):
    """A chunk's grouped rows are ungrouped into (destination, local expert) blocks of a send buffer, then sent;
    rows already in the order they leave in (no ``ungroup``: wire rows in slots) are sent from where they are."""

    def __init__(self, streams: ExchangeStreams, routes: HostRoutes, width: int, like: torch.Tensor):
        self.streams, self.routes, self.layout = streams, routes, routes.layout.reversed()
        self.width, self.dtype, self.send_RH = width, like.dtype, None
        if routes.ungroup is not None:
            self.send_RH = like.new_empty((self.layout.send_total, width))
            streams.lend(self.send_RH)

    def send(self, chunk: int, grouped_RH: torch.Tensor, ready: Event, alone: bool = False) -> None:
        start, stop = self.layout.send_range(chunk)
        self.streams.lend(grouped_RH)
        with self.streams.on_side():
            self.streams.side_waits(ready)
            rows_RH = grouped_RH
            if self.routes.ungroup is not None:
                rows_RH = torch.index_select(grouped_RH, 0, self.routes.ungroup[chunk],
                                             out=self.send_RH[start:stop])
            self._start(chunk, rows_RH)


class _CollectiveExchange:
    """One asynchronous all_to_all_single per chunk over the process group (NCCL on its own stream, ordered
    after the side stream; gloo's thread), or a copy on a group of one rank."""

    def _all_to_all(self, chunk: int, send_RH: torch.Tensor) -> None:
        """``send_RH``: the chunk's rows to send, in the layout's order."""
        recv_start, recv_stop = self.layout.recv_range(chunk)
        recv_RH = self.recv_RH[recv_start:recv_stop]
        if self.group is None:
            recv_RH.copy_(send_RH)
            return
        if recv_RH.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(str(graph_refusal(pipelined=True, planning="host", exchanging=True)))
        if self.compute_only:  # one element to every peer keeps the wait for the slowest; the rows stay here
            repeat_rows_host(send_RH, recv_RH)
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
    def __init__(self, transport: CollectiveTransport, send_RH: torch.Tensor, routes: HostRoutes, sms: int):
        _HostToExperts.__init__(self, ExchangeStreams(send_RH.device, transport.stream), routes, send_RH.shape[1])
        self.group, self.works, self.send_RH = transport.group, {}, send_RH
        self.compute_only = transport.compute_only
        self.recv_RH = send_RH.new_empty((self.layout.recv_total, self.width))
        self.streams.lend(send_RH, self.recv_RH)

    def send(self, chunk: int, alone: bool = False) -> None:
        start, stop = self.layout.send_range(chunk)
        with self.streams.on_side():
            self._all_to_all(chunk, self.send_RH[start:stop])

    def _arrived(self, chunk: int) -> torch.Tensor:
        self._wait(chunk)
        if self.group is None:  # the copy ran on the side stream
            self.streams.join()
        start, stop = self.layout.recv_range(chunk)
        return self.recv_RH[start:stop]

    def finish(self) -> None:
        assert not self.works, f"chunks {sorted(self.works)} were sent but never received"


class CollectiveFromExperts(_CollectiveExchange, _HostFromExperts):
    def __init__(self, transport: CollectiveTransport, routes: HostRoutes, width: int, like: torch.Tensor, sms: int):
        _HostFromExperts.__init__(self, ExchangeStreams(like.device, transport.stream), routes, width, like)
        self.group, self.works, self.compute_only = transport.group, {}, transport.compute_only
        self.recv_RH = like.new_empty((self.layout.recv_total, width))

    def _start(self, chunk: int, rows_RH: torch.Tensor) -> None:
        self._all_to_all(chunk, rows_RH)

    def result(self) -> torch.Tensor:
        for chunk in list(self.works):
            self._wait(chunk)
        if self.group is None:  # the copies ran on the side stream
            self.streams.join()
        return self.recv_RH

    def finish(self) -> None:
        assert not self.works, f"chunks {sorted(self.works)} were sent but never received"


class CollectiveTransport(Transport):
    """``nccl`` or ``gloo``: host sizes, the process group's all-to-all."""

    to_class, from_class = CollectiveToExperts, CollectiveFromExperts

    def __init__(self, name: str, group: ProcessGroup, device: torch.device):
        self.name, self.group, self.compute_only = name, group, False
        self.needs_sms = name == "nccl"
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Every EP rank's copies per global expert, [source rank, expert]: a device-planned plan's counts, where its
        routes take host sizes (wire rows in slots, device_plan.py), on the CPU."""
        return all_gather_counts(counts_E, self.group)


class _CopyEngineExchange:
    """Pushes a chunk's (peer) blocks into the peers' claimed region with copy-engine copies on the copy stream,
    then raises one signal per (peer, chunk); the local block lands by a local copy, which the event covers."""

    def _claim(self, transport: CopyEngineTransport, like: torch.Tensor, width: int) -> None:
        self.regions, self.compute_only = transport.regions, transport.compute_only
        self.row_bytes = width * like.element_size()
        self.region = self.regions.claim(self.streams.side)

    def _copy_chunk(self, chunk: int, rows_RH: torch.Tensor) -> None:
        """``rows_RH``: the chunk's rows to send, in the layout's order."""
        layout, regions = self.layout, self.regions
        if self.compute_only:  # the rows that would land here, made from this rank's own
            recv_start, recv_stop = layout.recv_range(chunk)
            own_RH = regions.view(regions.rank, self.region, (layout.recv_total, rows_RH.shape[1]), rows_RH.dtype)
            repeat_rows_host(rows_RH, own_RH[recv_start:recv_stop])
        else:
            first = layout.send_offsets[chunk][0]
            for peer in range(regions.size):
                rows = layout.send_rows[chunk][peer]
                if rows:
                    start = layout.send_offsets[chunk][peer] - first
                    dest = regions.view(peer, self.region, (rows, rows_RH.shape[1]), rows_RH.dtype,
                                        layout.remote_recv_offsets[chunk][peer] * self.row_bytes)
                    dest.copy_(rows_RH[start:start + rows], non_blocking=True)
        for peer in regions.peers:
            regions.signal(peer, self.region, chunk)

    def _wait_peers(self, chunk: int) -> None:
        for peer in self.regions.peers:
            self.regions.wait(peer, self.region, chunk)


class CopyEngineToExperts(_CopyEngineExchange, _HostToExperts):
    lands_in_region = True

    def __init__(self, transport: CopyEngineTransport, send_RH: torch.Tensor, routes: HostRoutes, sms: int):
        _HostToExperts.__init__(self, ExchangeStreams(send_RH.device, transport.stream), routes, send_RH.shape[1])
        self._claim(transport, send_RH, self.width)
        self.send_RH, self.sent = send_RH, {}
        self.streams.lend(send_RH)
        self.own_RH = self.regions.view(self.regions.rank, self.region, (self.layout.recv_total, self.width),
                                        send_RH.dtype)

    def send(self, chunk: int, alone: bool = False) -> None:
        start, stop = self.layout.send_range(chunk)
        with self.streams.on_side():
            self._copy_chunk(chunk, self.send_RH[start:stop])
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
        _HostFromExperts.__init__(self, ExchangeStreams(like.device, transport.stream), routes, width, like)
        self._claim(transport, like, width)
        self.chunks = 0

    def _start(self, chunk: int, rows_RH: torch.Tensor) -> None:
        self._copy_chunk(chunk, rows_RH)
        self.chunks += 1

    def result(self) -> torch.Tensor:
        self.streams.join()
        with exposed_wait("ep"):
            for chunk in range(self.chunks):
                self._wait_peers(chunk)
        return self.regions.view(self.regions.rank, self.region, (self.layout.recv_total, self.width), self.dtype)

    def finish(self) -> None:
        with exposed_wait("ep"):
            self.regions.release(self.region)  # on the compute stream: after everything that read the region


class CopyEngineTransport(Transport):
    """``copy_engine``: host sizes, copy-engine peer copies through symmetric memory (no SMs move the data)."""

    name, needs_sms, to_class, from_class = "copy_engine", False, CopyEngineToExperts, CopyEngineFromExperts

    def __init__(self, regions, device: torch.device):
        self.regions, self.compute_only = regions, False
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Every EP rank's copies per global expert, [source rank, expert], on the device, copied through the
        regions: a device-planned plan's counts (wire rows in slots, device_plan.py), no host sync and no
        collective (a CUDA graph of the layer replays the copies)."""
        def put(counts_SE: torch.Tensor, region: int) -> None:  # this rank's row into every rank's table
            regions = self.regions
            for rank in range(regions.size):
                regions.view(rank, region, counts_SE.shape, counts_SE.dtype)[regions.rank].copy_(
                    counts_SE[rank], non_blocking=True)
        return gather_through_regions(self.regions, counts_E, put)
