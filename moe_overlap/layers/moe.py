"""The MoE block: router -> permute -> dispatch -> grouped experts -> combine -> unpermute, plus an
optional shared expert. ``overlap.moe_overlap_dispatch`` picks the chunked pipeline (dispatcher_overlap),
``overlap.moe_sync_free_dispatch`` the dropless path without a host sync (dispatcher_sync_free); otherwise
the serial reference (dispatcher). The math is the same. With one EP rank (and no expert-TP) there is
nothing to exchange, so every setting runs the local path: permute, grouped experts, unpermute."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from moe_overlap.config import ModelConfig, OverlapConfig
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.kernels.permute import Permute, Unpermute, copy_rows
from moe_overlap.layers.dispatcher import (DispatchPlanner, expert_tp_counts, plan_expert_tp,
                                            serial_dispatch_combine, start_counts_fetch)
from moe_overlap.layers.dispatcher_overlap import DispatchStart, ExpertsCombine, PipelineState
from moe_overlap.layers.dispatcher_sync_free import gather_counts, sync_free_dispatch_combine, sync_free_routes
from moe_overlap.layers.experts import GroupedExperts, expert_offsets
from moe_overlap.layers.mlp import GatedSharedExpert, SwiGLUMLP
from moe_overlap.layers.router import Router

log = logging.getLogger(__name__)


class MoELayer(nn.Module):
    """Top-k MoE over the expert-parallel group ``ep``; rank r holds experts [r*E/EP, (r+1)*E/EP).

    ``transports`` (shared by the model's MoE layers) is needed only with the overlapped dispatch.
    ``router``: the sequence-parallel router under SP; by default the plain one from the config.
    """

    def __init__(self, cfg: ModelConfig, overlap: OverlapConfig, ep: GroupHandle,
                 transports: TransportSelector | None = None, device=None, dtype=None, router: Router | None = None,
                 etp: GroupHandle | None = None, expert_mp: GroupHandle | None = None):
        super().__init__()
        self.ep, self.transports = ep, transports
        # Expert-TP > 1: each expert's FFN split over ``etp``; ``expert_mp`` (EP x expert-TP) shares the counts.
        self.etp = etp if etp is not None and etp.size > 1 else None
        self.expert_mp = expert_mp
        self.num_experts, self.topk = cfg.num_moe_experts, cfg.moe_router_topk
        self.pad_to_capacity = cfg.moe_pad_expert_input_to_capacity
        self.overlap_dispatch, self.chunks = overlap.moe_overlap_dispatch, overlap.moe_a2a_chunks
        self.delay_wgrad, self.shared_overlap = overlap.delay_wgrad_compute, cfg.moe_shared_expert_overlap
        self.sync_free = overlap.moe_sync_free_dispatch
        if (self.overlap_dispatch or self.sync_free) and transports is None:
            raise ValueError("overlap.moe_overlap_dispatch / moe_sync_free_dispatch need the model's TransportSelector")
        if self.sync_free and self.etp is not None:
            raise ValueError("overlap.moe_sync_free_dispatch is not implemented with expert-TP > 1")
        self.local = ep.size == 1 and self.etp is None  # nothing to exchange: no transport, no host sync
        if (self.overlap_dispatch or self.sync_free) and self.local:
            log.info("MoE dispatch: one EP rank, so the exchange is the identity; overlap.moe_overlap_dispatch / "
                     "moe_sync_free_dispatch have nothing to move and the layer runs the local path")
        elif self.sync_free and transports.device.type == "cuda" and transports.name != "symm":
            raise ValueError(f"overlap.moe_sync_free_dispatch needs the symm transport on CUDA (SM stores into "
                             f"peers' symmetric memory); the EP group got {transports.name!r}")
        local_experts = self.num_experts // ep.size
        self.router = router if router is not None else Router.from_config(cfg, device, dtype)
        self.experts = GroupedExperts(local_experts, ep.rank * local_experts, cfg.hidden_size,
                                      cfg.expert_ffn_hidden_size, device, dtype, self.etp)
        shared_expert = GatedSharedExpert if cfg.moe_shared_expert_gate else SwiGLUMLP
        self.shared_expert = (shared_expert(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, device, dtype)
                              if cfg.moe_shared_expert_intermediate_size else None)
        self._planners: dict[int, DispatchPlanner] = {}  # by chunk count

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the output, the auxiliary losses (load balancing + z, already scaled) and the copies
        routed to each global expert (for metrics; an output, so recomputation does not count twice)."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        routing = self.router(x_TH)
        if self.local:
            out_TH = self._local(x_TH, routing)
        elif self.sync_free:
            out_TH = self._sync_free(x_TH, routing)
        else:
            out_TH = self._host_planned(x_TH, routing)
        return out_TH.view_as(x_BSH), routing.aux_loss + routing.z_loss, routing.tokens_per_expert_E

    def _local(self, x_TH: torch.Tensor, routing) -> torch.Tensor:
        """One EP rank: the permuted rows are already in the experts' order, so the grouped GEMMs read device
        offsets and the buffers have static sizes (T x K rows, or E x capacity when padded; rows past the last
        offset are skipped by the GEMMs and read by no one). No host sync: the layer can be graphed."""
        capacity = routing.capacity if self.pad_to_capacity else None
        row_of_copy_TK, _, rows_per_expert_E = copy_rows(routing.experts_TK, self.num_experts, capacity,
                                                         routing.keep_TK)
        num_rows = routing.experts_TK.numel() if capacity is None else self.num_experts * capacity
        all_rows_mapped = routing.keep_TK is None
        permuted_RH = Permute.apply(x_TH, row_of_copy_TK, num_rows, all_rows_mapped)
        expert_out_RH = self.experts(permuted_RH, expert_offsets(rows_per_expert_E))
        out_TH = Unpermute.apply(expert_out_RH, row_of_copy_TK, routing.probs_TK, all_rows_mapped)
        return out_TH if self.shared_expert is None else out_TH + self.shared_expert(x_TH)

    def _host_planned(self, x_TH: torch.Tensor, routing) -> torch.Tensor:
        """The serial and the chunked paths: their exchanges take sizes from the host."""
        keep_TK, capacity = routing.keep_TK, routing.capacity
        static = capacity is not None and self.pad_to_capacity
        # Static (padded capacity) sizes need no counts; otherwise one host sync fetches every rank's, over
        # EP, or over EP x expert-TP, whose counts the expert-TP gather needs too.
        counts = None if static else start_counts_fetch(routing.tokens_per_expert_E,
                                                         self.ep if self.etp is None else self.expert_mp)
        fetch = None if counts is None else functools.partial(self._ep_group_counts, counts)
        plan = self._planner(x_TH.device).plan(routing.experts_TK, keep_TK, capacity, fetch)
        rows_PL = None if self.etp is None else self._expert_tp_rows(counts, capacity)
        if not self.overlap_dispatch:
            expert_tp = None if rows_PL is None else (plan_expert_tp(rows_PL, x_TH.device), self.etp)
            out_TH = serial_dispatch_combine(x_TH, routing.probs_TK, plan, self.ep, self.experts, expert_tp)
            if self.shared_expert is not None:
                out_TH = out_TH + self.shared_expert(x_TH)
        else:
            worst_rows = (self.num_experts * capacity if static  # full capacity blocks from every rank
                          else self.ep.size * x_TH.shape[0] * self.topk)  # every rank's copies landing here
            expert_tp = None if rows_PL is None else (
                [plan_expert_tp(rows_PL[:, a:b], x_TH.device) for a, b in plan.chunk_experts], self.etp)
            out_TH = self._pipelined(x_TH, routing.probs_TK, plan, worst_rows, expert_tp)
        return out_TH

    def _expert_tp_rows(self, fetch_counts, capacity: int | None) -> torch.Tensor:
        """Rows each expert-TP peer received per local expert, [peer, local expert]: from the fetched counts,
        or static (padded capacity: every EP rank sends ``capacity`` rows per expert)."""
        if fetch_counts is None:
            return torch.full((self.etp.size, self.num_experts // self.ep.size), self.ep.size * capacity,
                              dtype=torch.int64)
        return expert_tp_counts(fetch_counts().view(self.ep.size, self.etp.size, -1), self.ep)

    def _ep_group_counts(self, fetch_counts) -> torch.Tensor:
        """[EP rank, global expert] copies of this rank's EP group, from the fetched counts."""
        if self.etp is None:
            return fetch_counts()
        return fetch_counts().view(self.ep.size, self.etp.size, -1)[:, self.etp.rank]

    def _planner(self, device: torch.device) -> DispatchPlanner:
        chunks = self.chunks if self.overlap_dispatch else 1
        if chunks not in self._planners:
            self._planners[chunks] = DispatchPlanner(self.num_experts, self.ep, chunks, device)
        return self._planners[chunks]

    def _sync_free(self, x_TH: torch.Tensor, routing) -> torch.Tensor:
        if routing.capacity is not None:
            raise ValueError("overlap.moe_sync_free_dispatch is dropless: the router has a capacity factor")
        copies = x_TH.shape[0] * self.topk
        # worst case: every rank's copies landing on this one
        pusher = self.transports.pusher(self.ep.size * copies * x_TH.shape[1] * x_TH.element_size())
        routes = sync_free_routes(gather_counts(routing.tokens_per_expert_E, self.ep, pusher), self.ep.rank, copies)
        row_of_copy_TK, _, _ = copy_rows(routing.experts_TK, self.num_experts)
        out_TH = sync_free_dispatch_combine(x_TH, routing.probs_TK, row_of_copy_TK, routes, pusher, self.experts)
        return out_TH if self.shared_expert is None else out_TH + self.shared_expert(x_TH)

    def _pipelined(self, x_TH: torch.Tensor, probs_TK: torch.Tensor, plan, worst_rows: int,
                   expert_tp) -> torch.Tensor:
        shared_TH = None
        if self.shared_expert is not None and not self.shared_overlap:
            shared_TH = self.shared_expert(x_TH)
        permuted_RH = Permute.apply(x_TH, plan.row_of_copy_TK, plan.num_rows, plan.all_rows_mapped)
        transport = self.transports.transport(worst_rows * x_TH.shape[1] * x_TH.element_size())
        state = PipelineState(plan.exchange, transport, self.delay_wgrad, expert_tp)
        token = DispatchStart.apply(permuted_RH, state)
        if self.shared_expert is not None and self.shared_overlap:  # runs while the dispatch travels
            shared_TH = self.shared_expert(x_TH)
        combined_RH = ExpertsCombine.apply(token, self.experts.w13, self.experts.w2, state)
        out_TH = Unpermute.apply(combined_RH, plan.row_of_copy_TK, probs_TK, plan.all_rows_mapped)
        return out_TH if shared_TH is None else out_TH + shared_TH


def capture_moe_layers(moe_layers: tuple[MoELayer, ...], input_shape: tuple[int, ...]) -> None:
    """Capture each layer's forward and backward in CUDA graphs (torch.cuda.make_graphed_callables, one
    memory pool, forward in order and backward in reverse, as training runs them); from then on a
    training-mode call replays them. Needs layers without a host sync or a collective (the sync-free dispatch,
    or one EP rank) and inputs of ``input_shape``. A collective: every EP rank captures the same layers
    together (the warm-up calls exchange rows)."""
    if not all(layer.sync_free or layer.local for layer in moe_layers):
        raise ValueError("CUDA graphs of MoE layers need overlap.moe_sync_free_dispatch=true (or one EP rank)")
    weight = moe_layers[0].experts.w13
    samples = tuple((torch.randn(input_shape, device=weight.device, dtype=weight.dtype, requires_grad=True),)
                    for _ in moe_layers)
    # NCCL's watchdog thread queries events during a capture, which the default "global" capture mode
    # counts as an illegal call from another thread: capture in "thread_local" mode.
    graph = torch.cuda.graph
    torch.cuda.graph = functools.partial(graph, capture_error_mode="thread_local")
    try:
        torch.cuda.make_graphed_callables(moe_layers, samples)
    finally:
        torch.cuda.graph = graph
