"""The device-sized MoE transport, ``sm_push``: every size stays on the GPU (a2a_routes.DeviceRoutes, static
buffers bounded by layers/device_plan.py), so a layer call never waits for the host and can be captured in a CUDA
graph. A Triton kernel (kernels/push_rows.py) stores each row straight into its destination's claimed region of
symmetric memory, announced by one signal per (peer, chunk); on CPU its twin moves the same routes over gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_overlap.distributed.a2a_exchange import (ExchangeStreams, FromExperts, GatheredRows, ToExperts, Transport,
                                                   gather_through_regions)
from moe_overlap.distributed.a2a_routes import DeviceRoutes
from moe_overlap.distributed.collectives import ProcessGroup, all_gather_counts, all_to_all_equal, all_to_all_rows
from moe_overlap.distributed.streams import Event, exposed_wait
from moe_overlap.distributed.symm import LocalRegions
from moe_overlap.kernels.push_rows import Gather, copy_rows_out, full_width, push_rows, repeat_rows, whole_rows


class _PushExchange:
    """SM pushes of the device routes into the claimed region of every rank (``move``), each chunk announced
    by one signal per (peer, chunk). The push runs on the side stream with ``sms`` CTAs while a GEMM leaves
    that many SMs free, else on the compute stream at full width."""

    def _open(self, transport: PushTransport, device: torch.device, sms: int) -> None:
        self.transport, self.regions = transport, transport.regions
        self.streams = ExchangeStreams(device, transport.stream if sms else None)
        self.ctas = sms or transport.alone_ctas
        with self._exposed():
            self.region = self.regions.claim(self.streams.side or self.streams.compute)

    def _exposed(self):
        """Pushes, claims and signals on the compute stream hold it: exposed; on the side stream they are not."""
        return exposed_wait("ep" if self.streams.side is None else None)

    def _own(self, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        return self.regions.view(self.regions.rank, self.region, (rows, width), dtype)

    def _push(self, chunk: int, src_RH: torch.Tensor, src_start: torch.Tensor, count: torch.Tensor,
              dst_rank_Q: torch.Tensor, dst_row_Q: torch.Tensor, route_start: torch.Tensor,
              landing: tuple[torch.Tensor, torch.Tensor], alone: bool, gather: Gather | None = None) -> None:
        """``alone``: no GEMM runs beside this one (the pipeline's first transfer, or its last): full width.
        ``landing``: the (start, count) of this rank's own rows that this chunk's peers write, which a compute-only
        reference makes from the rank's own rows instead. ``gather``: the rows' first columns are read from their
        source rows (GatheredRows)."""
        ctas = self.transport.alone_ctas if alone else self.ctas
        with self._exposed():
            if self.transport.compute_only:
                self.transport.land_own(src_RH, src_start, count, self.own_RH, *landing, ctas, gather)
            else:
                self.transport.move(src_RH, src_start, count, dst_rank_Q, dst_row_Q, route_start, self.region, ctas,
                                    gather)
            for peer in self.regions.peers:  # after the kernel, on its stream: its stores have landed
                self.regions.signal(peer, self.region, chunk)

    def _wait_peers(self, chunk: int) -> None:
        for peer in self.regions.peers:
            self.regions.wait(peer, self.region, chunk)


class PushToExperts(_PushExchange, ToExperts):
    def __init__(self, transport: PushTransport, send: torch.Tensor | GatheredRows, routes: DeviceRoutes, sms: int):
        gathered = isinstance(send, GatheredRows)
        self.send_RH, self.gather = (send.rest_RM, send.gather) if gathered else (send, None)
        self.width = send.width if gathered else send.shape[1]
        self._open(transport, self.send_RH.device, sms)
        self.routes, self.sent = routes, {}
        self.streams.lend(self.send_RH, *(self.gather or ()))
        self.own_RH = self._own(routes.recv_rows, self.width, self.send_RH.dtype)

    def send(self, chunk: int, alone: bool = False) -> None:
        r = self.routes
        start = r.send_start_C[chunk:chunk + 1]
        with self.streams.on_side():
            self._push(chunk, self.send_RH, start, r.send_rows_C[chunk:chunk + 1], r.dst_rank_R, r.dst_row_R, start,
                       (r.recv_start_C[chunk:chunk + 1], r.recv_rows_C[chunk:chunk + 1]), alone, self.gather)
            self.sent[chunk] = self.streams.mark()  # covers the local rows, which no signal announces

    def recv(self, chunk: int, read_once: bool = False) -> torch.Tensor:
        """The chunk's rows copied out of the region to row 0 of a tensor of its static rows, at full width; the
        first chunk's rows read once are the region's own first rows instead (a view: the first chunk lands at row
        0, and no copy-out costs the compute stream its time)."""
        r = self.routes
        self.streams.compute_waits(self.sent.pop(chunk))
        with exposed_wait("ep"):
            self._wait_peers(chunk)
        if read_once and chunk == 0:
            return self.own_RH[:r.chunk_rows[0]]
        grouped_RH = self.send_RH.new_empty((r.chunk_rows[chunk], self.width))
        copy_rows_out(self.own_RH, r.recv_start_C[chunk:chunk + 1], r.recv_rows_C[chunk:chunk + 1], grouped_RH,
                      full_width(grouped_RH.device))
        return grouped_RH

    def finish(self) -> None:
        assert not self.sent, f"chunks {sorted(self.sent)} were sent but never received"
        with exposed_wait("ep"):
            self.regions.release(self.region)  # on the compute stream: after the last copy-out read it


class PushFromExperts(_PushExchange, FromExperts):
    transient = True  # result() is the claimed region: read it before finish()

    def __init__(self, transport: PushTransport, routes: DeviceRoutes, width: int, like: torch.Tensor, sms: int):
        self._open(transport, like.device, sms)
        self.routes, self.chunks, self.last = routes, 0, None
        self.own_RH = self._own(routes.send_rows, width, like.dtype)
        self.zero = torch.zeros(1, dtype=torch.int64, device=like.device)

    def send(self, chunk: int, grouped_RH: torch.Tensor, ready: Event, alone: bool = False) -> None:
        r = self.routes
        self.streams.lend(grouped_RH)
        with self.streams.on_side():
            self.streams.side_waits(ready)
            landing = (r.send_start_C[chunk:chunk + 1], r.send_rows_C[chunk:chunk + 1])  # this rank's rows back
            self._push(chunk, grouped_RH, self.zero, r.recv_rows_C[chunk:chunk + 1], r.back_rank_W, r.back_row_W,
                       r.recv_start_C[chunk:chunk + 1], landing, alone)
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


class PushTransport(Transport):
    """``sm_push``: device sizes, rows stored by a Triton kernel into every rank's region of symmetric memory
    (:class:`LocalRegions` on a group of one rank). With ``twin`` it is the CPU twin instead: the same
    routes, the rows moved by ``twin_group`` (gloo), one host sync per move. ``push_ctas``: the CTAs of a push with
    no carve-out beside it (``overlap.ep_comm_ctas``; None: full width)."""

    to_class, from_class = PushToExperts, PushFromExperts

    def __init__(self, regions, device: torch.device, twin: bool = False, twin_group: ProcessGroup = None,
                 push_ctas: int | None = None):
        self.regions, self.device, self.twin_group = regions, device, twin_group
        self.alone_ctas = push_ctas or full_width(device)
        self.symmetric, self.compute_only = not twin, False
        self.needs_sms = self.gathers = self.symmetric
        if self.symmetric:
            self.name = "sm_push"
            self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
            size = regions.region_bytes

            def bases(ptrs: list[int]) -> list[torch.Tensor]:  # per region, every rank's address in the kernel's
                return [torch.tensor([ptr + region * size for ptr in ptrs], dtype=torch.int64, device=device)
                        for region in range(regions.count)]

            self._bases = bases(regions.buffer_ptrs)
            # gather_counts' routes, made once: row r of a (ranks, E) table to rank r, at this rank's row there
            ranks = regions.size
            self._every_rank = torch.arange(ranks, dtype=torch.int32, device=device)
            self._at_my_row = torch.full((ranks,), regions.rank, dtype=torch.int64, device=device)
            self._zero, self._ranks = (torch.tensor([v], dtype=torch.int64, device=device) for v in (0, ranks))
        else:
            self.name, self.stream = "gloo", None

    def move(self, src_RH, src_start, count, dst_rank_Q, dst_row_Q, route_start, region: int, ctas: int,
             gather: Gather | None = None) -> None:
        if self.symmetric:
            push_rows(src_RH, src_start, count, dst_rank_Q, dst_row_Q, route_start, self._bases[region], ctas, gather)
            return
        first, n, q0 = (int(v.reshape(-1)[0]) for v in (src_start, count, route_start))
        rows_RH, ranks, dst_rows = whole_rows(src_RH, gather, first, n), dst_rank_Q[q0:q0 + n], dst_row_Q[q0:q0 + n]
        own_RH = self.regions.view(self.regions.rank, region, (self.regions.region_bytes // (
            rows_RH.shape[1] * src_RH.element_size()), rows_RH.shape[1]), src_RH.dtype)
        _exchange_routed(rows_RH, ranks, dst_rows, own_RH, self.twin_group, self.regions.size)

    def land_own(self, src_RH, src_start, count, own_RH, land_start, land_count, ctas: int,
                 gather: Gather | None = None) -> None:
        """compute_only's move: the ``land_count`` rows that would land here from peers, made from this rank's own
        ``count`` rows (repeated as often as needed: as many bytes written as would land, every row written this
        time). The twin still exchanges one element per peer, to wait for the slowest (the signals do on CUDA)."""
        if not self.symmetric and self.twin_group is not None:
            with exposed_wait("ep"):
                all_to_all_equal(torch.zeros((self.regions.size, 1), dtype=torch.int64), self.twin_group)
        repeat_rows(src_RH, src_start, count, own_RH, land_start, land_count, ctas, gather)

    def gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Every EP rank's copies per global expert, [source rank, expert], on the device: by the process group
        for the twin; else pushed like rows (one row to every rank), so a CUDA graph of the layer holds no
        collective."""
        if not self.symmetric:
            return all_gather_counts(counts_E, self.twin_group)

        def put(counts_SE: torch.Tensor, region: int) -> None:  # row r of the table to rank r, at this rank's row
            push_rows(counts_SE, self._zero, self._ranks, self._every_rank, self._at_my_row, self._zero,
                      self._bases[region], ctas=1)
        return gather_through_regions(self.regions, counts_E, put)


class TwinRegions:
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
                     group: ProcessGroup, size: int) -> None:
    """Rows to the ranks and rows the routes name, by an uneven all-to-all (its sizes read on the host)."""
    order = torch.argsort(ranks, stable=True)
    send_rows = torch.bincount(ranks.long(), minlength=size)
    with exposed_wait("ep"):
        recv_rows = send_rows if group is None else all_to_all_equal(send_rows.view(size, 1), group)
        send, recv = send_rows.tolist(), recv_rows.view(-1).tolist()
        landed_RH = all_to_all_rows(rows_RH[order], recv, send, group)
        index_R = all_to_all_rows(dst_rows[order].long(), recv, send, group)
    out_RH[index_R] = landed_RH
