"""Tensor-parallel communication, serial or overlapped with the GEMM next to it (userbuffer-style).

Two kinds of overlap, as Transformer Engine's userbuffers:
  pipelined  a GEMM that needs an all-gather, or feeds a reduce-scatter, runs chunk by chunk while the chunks
             travel a ring: step k sends one chunk to the next rank and receives one from the previous rank.
             All-gather: each arriving chunk's GEMM starts at once (and the chunk is forwarded).
             Reduce-scatter: each rank computes the partial for the block the ring reaches next, adds the
             partial sum that arrived, and passes it on; after size-1 hops every rank holds its sum.
  bulk       an all-gather or reduce-scatter that the next GEMM does not need is started before it and waited
             on after it (an async collective).
Every overlapped call sits beside its serial twin (the reference) below; :class:`TPComm` picks by switch.
A GEMM's right operand is a matrix B, or a :class:`Gemm` that multiplies rows by it some other way (FP8:
layers/fp8.py); the rings take rows a block at a time either way.

Nothing here knows what a transformer is. Tensors are 2-D token rows; a TP group's gathered row order is
rank-major: rank r's R rows are rows [r*R, (r+1)*R). With ``sequence_parallel`` off the "gather" is the
identity and the "scatter" an all-reduce (Megatron's f and g), and the overlaps do not exist.

Transports move the ring's chunks, one hop per step, and run the bulk collectives (:class:`RingTransport`):
  p2p   torch.distributed batch_isend_irecv and async all-gather / reduce-scatter: gloo on CPU, NCCL on GPU.
        ProcessGroupNCCL runs on its own stream, ordered after the work the current stream has queued when the
        call is made; ``wait`` makes the current stream wait without blocking the host.
  symm  copy-engine peer copies into registered buffers (distributed/symm.py), GPU ranks of one host: the data
        moves without SMs, so it hides under a full-chip GEMM where NCCL's kernels compete with it for SMs
        (measured on H200: a 128 MiB push beside a full-chip GEMM about 57-76% hidden, 32 MiB or less hardly).
Every wait is bounded: gloo and NCCL by the group's timeout (set in Mesh.create), symm signals by their own.

Letters: R this rank's rows, S the TP region's rows (every rank's, rank-major), N ranks, C a ring chunk's rows,
J the columns (any width: the transports move rows whatever they hold).
"""

from __future__ import annotations

import logging
import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from moe_overlap.distributed.collectives import all_reduce_, start_all_gather, start_reduce_scatter
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.distributed.streams import exposed_wait
from moe_overlap.distributed.symm import DEFAULT_TIMEOUT_MS, SymmRegions, choose_transport, symm_unavailable_reason

log = logging.getLogger(__name__)

BACKENDS = ("auto", "p2p", "symm")

# ------------------------------------------------------------------------------------------ transports


class RingRound(ABC):
    """One round of ``num_steps`` hops. Step k sends a chunk to rank+1 and receives the twin chunk from
    rank-1 into slot k; every rank starts the same steps in the same order."""

    @abstractmethod
    def start(self, step: int, send_CJ: torch.Tensor) -> None:
        """Begin step ``step``; ``send_CJ`` stays untouched until the step has been waited on."""

    @abstractmethod
    def wait(self, step: int) -> torch.Tensor:
        """The chunk received at ``step``, ready for the current stream; valid until the round is finished."""

    @abstractmethod
    def finish(self) -> None:
        """End the round: every step has been waited on; buffers may be reused by the next round."""


class RingTransport(ABC):
    """Moves fixed-shape chunks one hop along a group's ring; runs the bulk (started now, waited on later)
    all-gather and reduce-scatter of token rows. ``kind``: what its waits count as exposed communication."""

    name: str
    kind: str = "tp"

    @abstractmethod
    def open(self, num_steps: int, chunk_shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> RingRound:
        ...

    @abstractmethod
    def start_all_gather(self, x_RJ: torch.Tensor) -> "Pending":
        """Every rank's rows, rank-major."""

    @abstractmethod
    def start_reduce_scatter(self, x_SJ: torch.Tensor) -> "Pending":
        """This rank's block of the sum over ranks."""


class P2PTransport(RingTransport):
    """batch_isend_irecv over the group: gloo on CPU, NCCL on GPU."""

    name = "p2p"

    def __init__(self, group: GroupHandle):
        self.handle = group
        self.group = group.group
        self.next_rank = group.ranks[(group.rank + 1) % group.size]  # global ranks: torch 2.11 and 2.13 agree
        self.prev_rank = group.ranks[(group.rank - 1) % group.size]

    def open(self, num_steps, chunk_shape, dtype, device) -> RingRound:
        return _P2PRound(self, torch.empty((num_steps, *chunk_shape), dtype=dtype, device=device))

    def start_all_gather(self, x_RJ: torch.Tensor) -> "Pending":
        return start_gather_rows(x_RJ, self.handle)

    def start_reduce_scatter(self, x_SJ: torch.Tensor) -> "Pending":
        return start_scatter_rows(x_SJ, self.handle)


class _P2PRound(RingRound):
    def __init__(self, transport: P2PTransport, recv_NCJ: torch.Tensor):
        self.transport, self.recv_NCJ = transport, recv_NCJ
        self.pending: dict[int, tuple[list, torch.Tensor]] = {}

    def start(self, step: int, send_CJ: torch.Tensor) -> None:
        t = self.transport
        send_CJ = send_CJ.contiguous()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send_CJ, t.next_rank, t.group),
                                        dist.P2POp(dist.irecv, self.recv_NCJ[step], t.prev_rank, t.group)])
        self.pending[step] = (works, send_CJ)  # the send buffer lives until the step is waited on

    def wait(self, step: int) -> torch.Tensor:
        works, _ = self.pending.pop(step)
        with exposed_wait(self.transport.kind):
            for work in works:
                work.wait()
        return self.recv_NCJ[step]

    def finish(self) -> None:
        if self.pending:
            raise RuntimeError(f"ring round finished with steps {sorted(self.pending)} never waited on")


class SymmRingTransport(RingTransport):
    """Copy-engine ring through symmetric memory (CUDA ranks of one host).

    Step k of a round pushes the chunk into the next rank's region, slot k, with a peer copy on a copy stream
    (no SMs), then raises the next rank's signal for step k; ``wait`` makes the current stream wait on the
    previous rank's signal. Bulk collectives push straight to every peer (one host: every pair is joined)
    and are summed or copied out when waited on.

    Rounds use ``regions`` regions in turn (:class:`SymmRegions`, which owns the flow control), so a bulk
    collective stays in flight while ring rounds run (at most regions - 1 open at once). The regions grow
    when a round needs more than one holds; that is a collective, which holds because every rank of the
    group opens the same rounds in the same order.
    """

    name = "symm"

    def __init__(self, group: GroupHandle, device: torch.device, max_steps: int, regions: int = 4,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS):
        self.group, self.device, self.count, self.timeout_ms = group, device, regions, timeout_ms
        self.max_steps = max(max_steps, 1)  # a bulk collective uses step 0
        self.next_peer, self.prev_peer = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        self.copy_stream = torch.cuda.Stream(device=device)
        self.regions: SymmRegions | None = None
        self.retired: list[SymmRegions] = []  # outgrown ones (the first steps only, as shapes settle)

    def claim(self, nbytes: int) -> tuple[SymmRegions, int]:
        """The regions (at least ``nbytes`` each) and the next one, free to write once the copy stream gets there."""
        if self.regions is None or nbytes > self.regions.region_bytes:
            if self.regions is not None:  # rounds in flight and peers' signals may still use it: kept
                self.retired.append(self.regions)
            self.regions = SymmRegions(self.group.group, nbytes, self.count, self.max_steps, self.device,
                                       self.timeout_ms)
        return self.regions, self.regions.claim(self.copy_stream)

    def push(self, dest: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        """Copy-engine copy on the copy stream, after the current stream's writes to ``src``; the event marks
        its end (waiting on the whole copy stream would also wait for later rounds' pushes)."""
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        done = torch.cuda.Event()
        with torch.cuda.stream(self.copy_stream):
            dest.copy_(src, non_blocking=True)
            done.record()
        src.record_stream(self.copy_stream)
        return done

    def open(self, num_steps, chunk_shape, dtype, device) -> RingRound:
        if num_steps > self.max_steps:
            raise ValueError(f"a ring round of {num_steps} steps exceeds the transport's {self.max_steps}")
        shape = (num_steps, *chunk_shape)
        regions, region = self.claim(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        return _SymmRound(self, regions, region, regions.view(regions.rank, region, shape, dtype),
                          regions.view(self.next_peer, region, shape, dtype))

    def start_all_gather(self, x_RJ: torch.Tensor) -> "Pending":
        rows, rank = x_RJ.shape[0], self.group.rank
        shape = (self.group.size * rows, *x_RJ.shape[1:])
        regions, region = self.claim(x_RJ.numel() * self.group.size * x_RJ.element_size())
        x_RJ = x_RJ.contiguous()
        for peer in regions.peers + [rank]:  # our own block last: a local copy-engine copy
            landed = self.push(regions.view(peer, region, shape, x_RJ.dtype)[rank * rows:(rank + 1) * rows], x_RJ)
        own_SJ = regions.view(rank, region, shape, x_RJ.dtype)

        def gathered() -> torch.Tensor:
            torch.cuda.current_stream().wait_event(landed)
            return own_SJ.clone()

        return self._start_bulk(regions, region, gathered)

    def start_reduce_scatter(self, x_SJ: torch.Tensor) -> "Pending":
        _check_rows(x_SJ.shape[0], self.group.size)
        size, rank = self.group.size, self.group.rank
        x_NRK = x_SJ.contiguous().view(size, x_SJ.shape[0] // size, *x_SJ.shape[1:])
        regions, region = self.claim(x_SJ.numel() * x_SJ.element_size())
        for peer in regions.peers:  # slot q of a rank's region holds rank q's partial of that rank's block
            self.push(regions.view(peer, region, tuple(x_NRK.shape), x_SJ.dtype)[rank], x_NRK[peer])
        own_NRK = regions.view(rank, region, tuple(x_NRK.shape), x_SJ.dtype)

        def reduce() -> torch.Tensor:
            out_RJ = x_NRK[rank].clone()
            for peer in regions.peers:
                out_RJ.add_(own_NRK[peer])
            return out_RJ

        return self._start_bulk(regions, region, reduce)

    def _start_bulk(self, regions: SymmRegions, region: int, result: Callable[[], torch.Tensor]) -> "Pending":
        with torch.cuda.stream(self.copy_stream):
            for peer in regions.peers:
                regions.signal(peer, region, 0)

        def complete() -> torch.Tensor:
            with exposed_wait(self.kind):  # the compute stream waits for every peer's signal
                for peer in regions.peers:
                    regions.wait(peer, region, 0)
            out = result()
            regions.release(region)
            return out

        return Pending(complete=complete)


class _SymmRound(RingRound):
    def __init__(self, transport: SymmRingTransport, regions: SymmRegions, region: int, own_NCJ: torch.Tensor,
                 next_NCJ: torch.Tensor):
        self.transport, self.regions, self.region, self.own_NCJ, self.next_NCJ = (transport, regions, region,
                                                                                   own_NCJ, next_NCJ)
        self.started: set[int] = set()
        self.last_push: torch.cuda.Event | None = None

    def start(self, step: int, send_CJ: torch.Tensor) -> None:
        t = self.transport
        self.last_push = t.push(self.next_NCJ[step], send_CJ.contiguous())
        with torch.cuda.stream(t.copy_stream):
            self.regions.signal(t.next_peer, self.region, step)
        self.started.add(step)

    def wait(self, step: int) -> torch.Tensor:
        with exposed_wait(self.transport.kind):
            self.regions.wait(self.transport.prev_peer, self.region, step)
        self.started.discard(step)
        return self.own_NCJ[step]

    def finish(self) -> None:
        if self.started:
            raise RuntimeError(f"ring round finished with steps {sorted(self.started)} never waited on")
        if self.last_push is not None:  # forwarded chunks are read from our region
            torch.cuda.current_stream().wait_event(self.last_push)
        self.regions.release(self.region)


def make_ring_transport(requested: str, group: GroupHandle, device: torch.device, num_splits: int,
                        timeout_s: float) -> RingTransport:
    """The TP ring's transport for ``overlap.tp_comm_backend`` (auto: symm on one host with peer access, else
    p2p), logging which and why."""
    reason = symm_unavailable_reason(group.group, device) if device.type == "cuda" else "the device is the CPU"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", group.size))
    name, why = choose_transport("overlap.tp_comm_backend", requested, BACKENDS, "p2p", group.ranks, local, reason)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("TP communication transport: %s (tp_comm_backend=%s: %s)", name, requested, why)
    if name == "symm":
        return SymmRingTransport(group, device, max_steps=(group.size - 1) * num_splits,
                                 timeout_ms=int(timeout_s * 1000))
    return P2PTransport(group)


# ------------------------------------------------------------------------------------------- the rings


@dataclass(frozen=True)
class Gemm:
    """rows @ B, for the rings and their serial twins: B's width, and the product of a block of rows (anything
    with ``shape``, ``dtype`` and ``device`` that slices by rows: a tensor, or FP8 rows with their scales),
    written into ``out`` when one is given."""

    cols: int
    product: Callable[[object, Optional[torch.Tensor]], torch.Tensor]


def as_gemm(b: torch.Tensor | Gemm) -> Gemm:
    """``b`` as a :class:`Gemm`: a matrix (K, N) multiplies by torch.mm."""
    if isinstance(b, Gemm):
        return b
    return Gemm(b.shape[1], lambda a, out: torch.mm(a, b, out=out))


def ring_all_gather(x_RJ: torch.Tensor, group: GroupHandle, transport: RingTransport, num_splits: int,
                    consume: Callable[[torch.Tensor, int], None]) -> None:
    """Every rank's ``x_RJ``, chunk by chunk: ``consume(chunk_CJ, first_row)`` once per chunk of the gathered
    (size*R, K) rows, the local chunks first, the others as they arrive (each forwarded on at once)."""
    rows = x_RJ.shape[0]
    _check_splits(rows, num_splits)
    local = x_RJ.contiguous().chunk(num_splits)
    chunk_rows = rows // num_splits
    steps = (group.size - 1) * num_splits
    ring = transport.open(steps, local[0].shape, x_RJ.dtype, x_RJ.device) if steps else None
    if ring is not None:
        for j, chunk_CJ in enumerate(local):  # hop 0 sends the local chunks
            ring.start(j, chunk_CJ)
    for j, chunk_CJ in enumerate(local):
        consume(chunk_CJ, group.rank * rows + j * chunk_rows)
    for k in range(steps):
        hop, j = divmod(k, num_splits)
        chunk_CJ = ring.wait(k)
        if k + num_splits < steps:
            ring.start(k + num_splits, chunk_CJ)
        consume(chunk_CJ, (group.rank - hop - 1) % group.size * rows + j * chunk_rows)
    if ring is not None:
        ring.finish()


def ring_reduce_scatter(rows: int, group: GroupHandle, transport: RingTransport, num_splits: int,
                        partial: Callable[[int, int, Optional[torch.Tensor]], torch.Tensor],
                        out_RN: torch.Tensor) -> torch.Tensor:
    """This rank's ``rows`` rows of the sum over ranks of P, each rank's (size*rows, N) P produced chunk by chunk:
    ``partial(first_row, num_rows, out)`` returns a new tensor (or ``out`` when given) holding
    P[first_row:first_row+num_rows]. Hop h computes the block of rank (rank-h-1), then adds the partial sum
    that arrived for it (waited on only after the GEMM, so the transfer runs under it) and passes it on:
    the ring ends at the block's owner."""
    _check_splits(rows, num_splits)
    chunk_rows = rows // num_splits
    steps = (group.size - 1) * num_splits
    ring = transport.open(steps, (chunk_rows, out_RN.shape[1]), out_RN.dtype, out_RN.device) if steps else None
    for hop in range(group.size):
        block = (group.rank - hop - 1) % group.size
        last = hop == group.size - 1
        for j in range(num_splits):
            k = hop * num_splits + j
            out = out_RN[j * chunk_rows:(j + 1) * chunk_rows] if last else None
            sum_CN = partial(block * rows + j * chunk_rows, chunk_rows, out)
            if hop > 0:
                sum_CN.add_(ring.wait(k - num_splits))
            if not last:
                ring.start(k, sum_CN)
    if ring is not None:
        ring.finish()
    return out_RN


def _check_splits(rows: int, num_splits: int) -> None:
    if rows % num_splits:
        raise ValueError(f"overlap.tp_comm_num_splits={num_splits} must divide this rank's {rows} rows (micro-batch "
                         "x sequence block)")


# --------------------------------------------------------------------------- serial and overlapped ops


def all_gather_matmul(x_RJ: torch.Tensor, b: torch.Tensor | Gemm, group: GroupHandle,
                      keep_gathered: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Serial: gather the rows, then one GEMM. Returns (AG(x) @ b, AG(x) if ``keep_gathered``)."""
    x_SJ = gather_rows(x_RJ, group)
    return as_gemm(b).product(x_SJ, None), (x_SJ if keep_gathered else None)


def ring_all_gather_matmul(x_RJ: torch.Tensor, b: torch.Tensor | Gemm, group: GroupHandle, transport: RingTransport,
                           num_splits: int, keep_gathered: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Pipelined twin of :func:`all_gather_matmul`: each chunk's GEMM runs as the chunk arrives."""
    gemm = as_gemm(b)
    total = group.size * x_RJ.shape[0]
    y_SN = x_RJ.new_empty((total, gemm.cols))
    x_SJ = x_RJ.new_empty((total, x_RJ.shape[1])) if keep_gathered else None

    def consume(chunk_CJ: torch.Tensor, first: int) -> None:
        rows = slice(first, first + chunk_CJ.shape[0])
        gemm.product(chunk_CJ, y_SN[rows])
        if x_SJ is not None:
            x_SJ[rows].copy_(chunk_CJ)

    ring_all_gather(x_RJ, group, transport, num_splits, consume)
    return y_SN, x_SJ


def matmul_reduce_scatter(a_SJ: torch.Tensor, b: torch.Tensor | Gemm, group: GroupHandle) -> torch.Tensor:
    """Serial: one GEMM, then reduce-scatter its rows."""
    return scatter_rows(as_gemm(b).product(a_SJ, None), group)


def ring_matmul_reduce_scatter(a_SJ: torch.Tensor, b: torch.Tensor | Gemm, group: GroupHandle,
                               transport: RingTransport, num_splits: int) -> torch.Tensor:
    """Pipelined twin of :func:`matmul_reduce_scatter`: partial sums travel the ring while the next GEMM runs."""
    gemm = as_gemm(b)
    _check_rows(a_SJ.shape[0], group.size)
    rows = a_SJ.shape[0] // group.size
    out_RN = torch.empty((rows, gemm.cols), dtype=a_SJ.dtype, device=a_SJ.device)

    def partial(first: int, num: int, out: Optional[torch.Tensor]) -> torch.Tensor:
        return gemm.product(a_SJ[first:first + num], out)

    return ring_reduce_scatter(rows, group, transport, num_splits, partial, out_RN)


def gather_rows(x_RJ: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """All-gather along rows (rank-major), blocking."""
    if group.size == 1:
        return x_RJ
    out = x_RJ.new_empty((group.size * x_RJ.shape[0], *x_RJ.shape[1:]))
    with exposed_wait("tp"):
        start_all_gather(out, x_RJ.contiguous(), group.group).wait()
    return out


def scatter_rows(x_SJ: torch.Tensor, group: GroupHandle) -> torch.Tensor:
    """Reduce-scatter along rows (sum; rank r keeps block r), blocking."""
    return start_scatter_rows(x_SJ, group).wait()


def _check_rows(rows: int, size: int) -> None:
    if rows % size:
        raise ValueError(f"reduce-scatter of {rows} rows over {size} TP ranks: the rows must divide evenly")


class Pending:
    """A communication in flight; ``wait()`` returns its result, ready for the current stream: ``result``
    once ``work`` (a torch.distributed handle) is done, or what ``complete`` returns (called once)."""

    def __init__(self, result: torch.Tensor | None = None, work=None,
                 complete: Callable[[], torch.Tensor] | None = None, kind: str = "tp"):
        self._result, self._work, self._complete, self.kind = result, work, complete, kind

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with exposed_wait(self.kind):
                self._work.wait()
            self._work = None
        if self._complete is not None:
            self._result, self._complete = self._complete(), None
        return self._result


def start_gather_rows(x_RJ: torch.Tensor, group: GroupHandle) -> Pending:
    """Bulk twin of :func:`gather_rows`: started now, waited on later."""
    if group.size == 1:
        return Pending(x_RJ)
    out = x_RJ.new_empty((group.size * x_RJ.shape[0], *x_RJ.shape[1:]))
    return Pending(out, start_all_gather(out, x_RJ.contiguous(), group.group))


def start_scatter_rows(x_SJ: torch.Tensor, group: GroupHandle) -> Pending:
    """Bulk twin of :func:`scatter_rows`."""
    if group.size == 1:
        return Pending(x_SJ)
    _check_rows(x_SJ.shape[0], group.size)
    out = x_SJ.new_empty((x_SJ.shape[0] // group.size, *x_SJ.shape[1:]))
    return Pending(out, start_reduce_scatter(out, x_SJ.contiguous(), group.group))


# ------------------------------------------------------------------------------------------- TPComm


@dataclass(frozen=True)
class TPOverlap:
    """Which TP communications overlap (Megatron/NeMo switch names); all off: the serial reference."""

    ag: bool = False  # tp_comm_overlap_ag: pipelined all-gather -> GEMM
    rs: bool = False  # tp_comm_overlap_rs: pipelined GEMM -> reduce-scatter, forward
    rs_dgrad: bool = False  # tp_comm_overlap_rs_dgrad: the same for a column-parallel dgrad
    bulk_dgrad: bool = False  # tp_comm_bulk_dgrad: the wgrad's input all-gather under the dgrad GEMM
    bulk_wgrad: bool = False  # tp_comm_bulk_wgrad: the dgrad's reduce-scatter under the wgrad GEMM
    num_splits: int = 1  # tp_comm_num_splits: chunks per rank block in a pipelined overlap

    @property
    def any(self) -> bool:
        return self.ag or self.rs or self.rs_dgrad or self.bulk_dgrad or self.bulk_wgrad


class TPComm:
    """A TP group's communication for layers: gather / scatter token rows, alone or beside a GEMM.

    With ``sequence_parallel`` the rows are sharded over the group (gather = all-gather, scatter =
    reduce-scatter); without, they are replicated (gather = identity, scatter = all-reduce). Each call's
    ``overlap`` flag picks the overlapped twin; overlaps exist only under sequence parallelism.
    """

    def __init__(self, group: GroupHandle, sequence_parallel: bool, overlap: TPOverlap = TPOverlap(),
                 transport: RingTransport | None = None):
        if group.size > 1 and overlap.any and not sequence_parallel:
            raise ValueError(f"TP communication overlap {overlap} needs sequence parallelism")
        self.group, self.sequence_parallel, self.overlap = group, sequence_parallel, overlap
        self.size, self.rank = group.size, group.rank
        self.transport = transport if transport is not None or group.size == 1 else P2PTransport(group)

    @classmethod
    def single(cls) -> "TPComm":
        """No tensor parallelism: every call is the identity or a plain GEMM."""
        return cls(GroupHandle(ranks=[0], group=None, rank=0, size=1), sequence_parallel=False)

    @property
    def sequence_shards(self) -> int:
        """How many blocks a gathered tensor's rows form (rank-major): the TP size under SP, else 1."""
        return self.size if self.sequence_parallel else 1

    def _sharded(self) -> bool:
        return self.sequence_parallel and self.size > 1

    def gather(self, x_RJ: torch.Tensor) -> torch.Tensor:
        return gather_rows(x_RJ, self.group) if self._sharded() else x_RJ

    def scatter(self, x_SJ: torch.Tensor) -> torch.Tensor:
        return self.start_scatter(x_SJ, overlap=False).wait()

    def start_gather(self, x_RJ: torch.Tensor, overlap: bool) -> Pending:
        if not self._sharded():
            return Pending(x_RJ)
        return self.transport.start_all_gather(x_RJ) if overlap else Pending(gather_rows(x_RJ, self.group))

    def start_scatter(self, x_SJ: torch.Tensor, overlap: bool) -> Pending:
        if self.size == 1:
            return Pending(x_SJ.contiguous())
        if not self._sharded():
            with exposed_wait("tp"):
                return Pending(all_reduce_(x_SJ.contiguous(), self.group.group))
        return self.transport.start_reduce_scatter(x_SJ) if overlap else Pending(scatter_rows(x_SJ, self.group))

    def gather_matmul(self, x_RJ: torch.Tensor, b: torch.Tensor | Gemm, overlap: bool,
                      keep_gathered: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(gather(x) @ b, gather(x) if ``keep_gathered``)."""
        if not self._sharded():
            return as_gemm(b).product(x_RJ, None), (x_RJ if keep_gathered else None)
        if overlap:
            return ring_all_gather_matmul(x_RJ, b, self.group, self.transport, self.overlap.num_splits,
                                          keep_gathered)
        return all_gather_matmul(x_RJ, b, self.group, keep_gathered)

    def matmul_scatter(self, a_SJ: torch.Tensor, b: torch.Tensor | Gemm, overlap: bool) -> torch.Tensor:
        """scatter(a @ b)."""
        if not self._sharded():
            return all_reduce_(as_gemm(b).product(a_SJ, None), self.group.group)
        if overlap:
            return ring_matmul_reduce_scatter(a_SJ, b, self.group, self.transport, self.overlap.num_splits)
        return matmul_reduce_scatter(a_SJ, b, self.group)
