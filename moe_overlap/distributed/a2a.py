"""The MoE pipeline's choice of transport: which planning and transport a run uses (``overlap.moe_planning``,
``overlap.moe_transport``, auto resolved by the rules of exchange_rules.py), and the one transport every MoE layer
of the model shares, its symmetric regions grown to the largest exchange seen (device-planned: the bounded receive
buffer of layers/device_plan.py). It also holds what the device-planned layers report, the rows past their bound
(``overflow_rows``) and those that fit no bound, not even the overflow chunk's (``unplaced_rows``: the step runs
again), and the host-planned transport a step that overflowed runs again on (``host_planned``).

The exchange itself: its interface and streams in a2a_exchange.py, where rows go in a2a_routes.py, the host-sized
transports (nccl, gloo, copy_engine) in a2a_host.py, the device-sized one (sm_push, and its gloo twin) in
a2a_push.py.
"""

from __future__ import annotations

import copy
import logging
import os

import torch
import torch.distributed as dist

from moe_overlap.distributed.a2a_exchange import Transport
from moe_overlap.distributed.a2a_host import CollectiveTransport, CopyEngineTransport
from moe_overlap.distributed.a2a_push import PushTransport, TwinRegions
from moe_overlap.distributed.collectives import ProcessGroup
from moe_overlap.distributed.symm import LocalRegions, SymmRegions, symm_unavailable_reason
from moe_overlap.exchange_rules import NEEDS, choose_exchange

log = logging.getLogger(__name__)

# Regions per transport, claimed in turn by successive exchanges (and count gathers), so one can be filled while
# peers still read the last; every MoE layer of the model shares them.
REGIONS = 4


def exchange_choice(planning: str, transport: str, group: ProcessGroup | None, group_ranks: list[int],
                    device: torch.device, expert_tp: int = 1) -> tuple[str, str, str]:
    """The planning and transport an exchange over ``group`` runs (``auto`` resolved by the fabric this rank sees:
    symmetric memory on one host with peer access, else NCCL), and why."""
    reason = None
    symmetric = transport in NEEDS and NEEDS[transport].one_host
    if device.type == "cuda" and group is None and not symmetric:  # asked for: a one-GPU measure
        reason = "the group has one rank: nothing to exchange"
    elif device.type == "cuda" and group is not None:
        reason = symm_unavailable_reason(group, device)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", len(group_ranks)))
        hosts = {r // max(local, 1) for r in group_ranks}
        if reason is None and len(hosts) > 1:
            reason = f"the ranks {group_ranks} span {len(hosts)} hosts (LOCAL_WORLD_SIZE={local})"
    return choose_exchange(planning, transport, device.type, reason, expert_tp)


class TransportSelector:
    """Picks the EP pipeline's planning and transport once (logging which and why) and sizes the symmetric
    regions lazily: for the largest exchange of the first call (host-planned: every rank's copies landing on one
    rank; device-planned: the bounded receive buffer); all EP ranks see the same micro-batch shape, so they grow
    them together. A group of one rank (a one-GPU measurement of the pipeline) keeps its regions in ordinary
    memory. ``expert_tp``: the expert-TP size of the layers it serves (auto plans on the host there). ``push_ctas``:
    an SM push's CTAs where no carve-out sizes it (``overlap.ep_comm_ctas``; None: full width)."""

    def __init__(self, planning: str, transport: str, group: ProcessGroup, group_ranks: list[int],
                 device: torch.device, max_chunks: int, timeout_s: float, compute_only: bool = False,
                 expert_tp: int = 1, push_ctas: int | None = None):
        self.planning, self.name, why = exchange_choice(planning, transport, group, group_ranks, device, expert_tp)
        self.group, self.group_ranks, self.device, self.max_chunks = group, group_ranks, device, max(max_chunks, 1)
        self.timeout_s, self.timeout_ms = timeout_s, int(timeout_s * 1000)
        self.push_ctas = push_ctas
        # overlap.moe_compute_only (a benchmark may switch it between steps of eager layers)
        self.compute_only = compute_only
        self._transport: Transport | None = None
        self._retired: list[Transport] = []  # outgrown ones (the first micro-batches only)
        self._host_planned: TransportSelector | None = None
        self.twins: list[TransportSelector] = []  # twin(): selectors whose exchanges run beside this one's
        # rows the device-planned layers could not receive within their bound since the trainer last zeroed it:
        # made before any CUDA graph is captured, so that the replays add into this very tensor
        self.overflow_rows = torch.zeros((), dtype=torch.int64, device=device)
        self.unplaced_rows = torch.zeros_like(self.overflow_rows)  # of those, the ones no overflow chunk took
        # bytes the exchanges sent from this rank to other ranks since the trainer last zeroed it (every layer call
        # and both directions, the backward's too; the host-planned re-run's selector adds into it as well)
        self.bytes_sent = torch.zeros((), dtype=torch.int64, device=device)
        me = dist.get_rank() if dist.is_initialized() else 0
        self.peer_index = group_ranks.index(me) if me in group_ranks else 0
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("MoE pipeline: %s-planned sizes over %s (moe_planning=%s, moe_transport=%s: %s)",
                     self.planning, self.name, planning, transport, why)

    def twin(self) -> TransportSelector:
        """A selector of the same choice over the same group with regions and counters of its own, for exchanges
        that run at the same time as this one's (a graphed copy of the MoE layers replayed on another stream:
        training/microbatch_overlap.PairStreams). Two streams cannot share regions: a region's signals say that a
        region is free or filled, not for which exchange. Its counters add into :meth:`counters`."""
        twin = copy.copy(self)
        twin._transport, twin._retired, twin._host_planned, twin.twins = None, [], None, []
        twin.overflow_rows, twin.unplaced_rows, twin.bytes_sent = (torch.zeros_like(self.overflow_rows),
                                                                   torch.zeros_like(self.overflow_rows),
                                                                   torch.zeros_like(self.bytes_sent))
        self.twins.append(twin)
        return twin

    def counters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows past their chunks' bounds, those no overflow chunk took, bytes sent) since :meth:`zero_counters`,
        this selector's and its twins', on the device."""
        return tuple(sum((getattr(t, name) for t in self.twins), getattr(self, name))
                     for name in ("overflow_rows", "unplaced_rows", "bytes_sent"))

    def zero_counters(self) -> None:
        for selector in (self, *self.twins):
            for counter in (selector.overflow_rows, selector.unplaced_rows, selector.bytes_sent):
                counter.zero_()

    def count_overflow(self, rows: torch.Tensor, unplaced: torch.Tensor | None = None) -> None:
        """A device-planned layer call's rows past its bound, and of those the ones no overflow chunk took (None:
        all of them), on the device, no host sync."""
        self.overflow_rows.add_(rows)
        self.unplaced_rows.add_(rows if unplaced is None else unplaced)

    def host_planned(self) -> TransportSelector:
        """The selector of the host-planned exchange over the same group (the process group's all-to-all: nccl, or
        gloo on the CPU) that a step whose device-planned exchange overflowed runs again on; made on first use."""
        if self._host_planned is None:
            self._host_planned = TransportSelector("host", "nccl" if self.device.type == "cuda" else "gloo",
                                                   self.group, self.group_ranks, self.device, self.max_chunks,
                                                   self.timeout_s)
            self._host_planned.bytes_sent = self.bytes_sent
        self._host_planned.compute_only = self.compute_only  # a compute-only reference runs again as one
        return self._host_planned

    def transport(self, worst_case_bytes: int) -> Transport:
        """The transport, its regions (if any) holding at least ``worst_case_bytes`` each (the call's largest)."""
        current = self._transport
        if current is not None and getattr(current, "regions", None) is not None:
            if current.regions.region_bytes < worst_case_bytes:  # exchanges in flight may still use it: kept
                self._retired.append(current)
                current = None
        if current is None:
            current = self._transport = self._make(worst_case_bytes)
            current.bytes_sent, current.peer_index = self.bytes_sent, self.peer_index
        current.compute_only = self.compute_only
        return current

    def _make(self, nbytes: int) -> Transport:
        if self.name in ("nccl", "gloo") and self.planning == "host":
            return CollectiveTransport(self.name, self.group, self.device)
        if self.name == "gloo":
            return PushTransport(TwinRegions(nbytes, REGIONS, self.group, self.device), self.device, twin=True,
                                 twin_group=self.group, push_ctas=self.push_ctas)
        regions = (LocalRegions(nbytes, REGIONS, self.max_chunks, self.device) if self.group is None else
                   SymmRegions(self.group, nbytes, REGIONS, self.max_chunks, self.device, self.timeout_ms))
        if self.name == "copy_engine":
            return CopyEngineTransport(regions, self.device)
        return PushTransport(regions, self.device, push_ctas=self.push_ctas)
