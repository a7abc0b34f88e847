"""The MoE block: router -> permute -> dispatch -> grouped experts -> combine -> unpermute, plus an
optional shared expert. ``overlap.moe_pipeline`` runs the exchange as a pipeline of chunks beside the grouped
GEMMs (dispatch_pipeline.py), its sizes planned on the host (dispatcher.py) or the device (device_plan.py);
otherwise the serial reference (dispatcher.py). The math is the same. With one EP rank (and no expert-TP) there
is nothing to exchange, so every setting runs the local path: permute, grouped experts, unpermute."""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch import nn

from moe_overlap.config import ModelConfig, OverlapConfig
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.distributed.streams import carveout_for, prepare_device_clock
from moe_overlap.kernels.permute import Permute, Unpermute, copy_rows
from moe_overlap.layers.device_plan import DevicePlanner
from moe_overlap.layers.dispatch_pipeline import Combine, DispatchStart, Experts, PipelineState
from moe_overlap.layers.dispatcher import (DispatchPlanner, chunk_bounds, expert_tp_counts, plan_expert_tp,
                                            serial_dispatch_combine, start_counts_fetch)
from moe_overlap.layers.experts import GroupedExperts, expert_offsets
from moe_overlap.layers.mlp import GatedSharedExpert, SwiGLUMLP
from moe_overlap.layers.router import Router

log = logging.getLogger(__name__)

# What ``overlap.gemm_sm_carveout: auto`` sizes an SM push by (README, "What overlaps on Hopper"; `benchmarks/moe_layer.py
# --carveout-probe` measures both on the GPU in hand): a push CTA's bytes per ms (235 MB in 3.24 ms by 8 CTAs over
# NVLink, 2xH200; 8.4-10 GB/s per CTA at 8 CTAs into its own memory on one H200, moe_layer_1xh200_ep1.json), and the
# grouped GEMMs' forward rate (690-720 TFLOP/s on the mixtral and fine shapes there, 550 on hidden 2048 / ffn 1024).
PUSH_BYTES_PER_CTA_MS = 9.0e6
GROUPED_GEMM_FLOPS_PER_MS = 6.0e11
MAX_PUSH_CTAS = 32  # already NVLink speed


def auto_push_sms(rows: int, hidden: int, ffn: int, chunks: int, element_size: int) -> int:
    """SMs the grouped GEMMs leave free for the pushes beside them, as many as the pushes' CTAs: enough for a
    chunk's rows (the push moves the local ones through the region too), one chunk each way (the next dispatch,
    the previous combine), to move in one chunk's forward GEMM time (6 x rows x hidden x ffn flops), for rows
    spread evenly over the chunks."""
    chunk_rows = rows / chunks
    moved_bytes = 2 * chunk_rows * hidden * element_size
    gemm_ms = 6 * chunk_rows * hidden * ffn / GROUPED_GEMM_FLOPS_PER_MS
    return max(1, min(MAX_PUSH_CTAS, math.ceil(moved_bytes / (gemm_ms * PUSH_BYTES_PER_CTA_MS))))


class MoELayer(nn.Module):
    """Top-k MoE over the expert-parallel group ``ep``; rank r holds experts [r*E/EP, (r+1)*E/EP).

    ``transports`` (shared by the model's MoE layers) is needed only with the pipeline.
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
        self.pipelined, self.chunks = overlap.moe_pipeline, overlap.moe_pipeline_chunks
        self.delay_wgrad, self.shared_overlap = overlap.delay_wgrad_compute, cfg.moe_shared_expert_overlap
        self.carveout, self.ep_comm_ctas = overlap.gemm_sm_carveout, overlap.ep_comm_ctas
        self.local = ep.size == 1 and self.etp is None  # nothing to exchange: no transport, no host sync
        if self.pipelined and self.local:
            log.info("MoE dispatch: one EP rank, so the exchange is the identity; overlap.moe_pipeline has "
                     "nothing to move and the layer runs the local path")
        elif self.pipelined and transports is None:
            raise ValueError("overlap.moe_pipeline needs the model's TransportSelector")
        self.planning = transports.planning if self.pipelined and transports is not None else "host"
        if self.planning == "device" and self.etp is not None:
            raise ValueError("overlap.moe_planning=device is not implemented with expert-TP > 1: the expert-TP "
                             "gather takes host sizes (use overlap.moe_planning=host)")
        local_experts = self.num_experts // ep.size
        self.router = router if router is not None else Router.from_config(cfg, device, dtype)
        self.experts = GroupedExperts(local_experts, ep.rank * local_experts, cfg.hidden_size,
                                      cfg.expert_ffn_hidden_size, device, dtype, self.etp)
        shared_expert = GatedSharedExpert if cfg.moe_shared_expert_gate else SwiGLUMLP
        self.shared_expert = (shared_expert(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, device, dtype)
                              if cfg.moe_shared_expert_intermediate_size else None)
        self._planners: dict[tuple[str, int], DispatchPlanner | DevicePlanner] = {}  # by planning and chunks
        self.graphed_twin: nn.Module | None = None  # capture_moe_layers(copies=2): the second graphed copy
        self.last_overlap_sms: int | None = None  # the pipeline's GEMM carve-out in its last call

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the output, the auxiliary losses (load balancing + z, already scaled) and the copies
        routed to each global expert (for metrics; an output, so recomputation does not count twice)."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        routing = self.router(x_TH)
        if self.local:
            out_TH = self._local(x_TH, routing)
        elif self.pipelined:
            out_TH = self._pipelined(x_TH, routing)
        else:
            out_TH = self._serial(x_TH, routing)
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

    def _host_plan(self, x_TH: torch.Tensor, routing, chunks: int):
        """The host-planned plan, and the counts fetch when sizes vary (None: padded capacity, static sizes)."""
        static = routing.capacity is not None and self.pad_to_capacity
        # Otherwise one host sync fetches every rank's counts, over EP, or over EP x expert-TP, whose counts the
        # expert-TP gather needs too.
        counts = None if static else start_counts_fetch(routing.tokens_per_expert_E,
                                                         self.ep if self.etp is None else self.expert_mp)
        fetch = None if counts is None else functools.partial(self._ep_group_counts, counts)
        plan = self._planner("host", chunks, x_TH.device).plan(routing.experts_TK, routing.keep_TK,
                                                               routing.capacity, fetch)
        rows_PL = None if self.etp is None else self._expert_tp_rows(counts, routing.capacity)
        return plan, rows_PL

    def _serial(self, x_TH: torch.Tensor, routing) -> torch.Tensor:
        """The reference: one all-to-all each way over the EP process group, sizes from the host."""
        plan, rows_PL = self._host_plan(x_TH, routing, 1)
        expert_tp = None if rows_PL is None else (plan_expert_tp(rows_PL, x_TH.device), self.etp)
        out_TH = serial_dispatch_combine(x_TH, routing.probs_TK, plan, self.ep, self.experts, expert_tp)
        return out_TH if self.shared_expert is None else out_TH + self.shared_expert(x_TH)

    def _pipelined(self, x_TH: torch.Tensor, routing) -> torch.Tensor:
        shared_TH = None
        if self.shared_expert is not None and not self.shared_overlap:
            shared_TH = self.shared_expert(x_TH)
        token, state = self.start_dispatch(x_TH, routing)
        if self.shared_expert is not None and self.shared_overlap:  # runs while the first chunk travels
            shared_TH = self.shared_expert(x_TH)
        out_TH = self.combine(self.run_experts(token, state), routing.probs_TK, state)
        return out_TH if shared_TH is None else out_TH + shared_TH

    # The pipeline's three steps, each starting an exchange the next one waits for (dispatch_pipeline.py); with
    # ``overlap_moe_expert_parallel_comm`` another micro-batch's stages run between them (models/mixtral.py).
    def start_dispatch(self, x_TH: torch.Tensor, routing, paired: bool = False) -> tuple[torch.Tensor, PipelineState]:
        """Plan the exchange, permute, and start the first chunk to the experts; ``paired``: another micro-batch's
        compute runs beside the first and last transfers."""
        tokens, hidden = x_TH.shape
        padded = routing.capacity is not None and self.pad_to_capacity
        rows = self.num_experts * routing.capacity if padded else tokens * self.topk  # a rank's permuted rows
        expert_tp = None
        if self.planning == "device":
            # the compact receive buffer: every rank's rows landing here (padded: exactly E x capacity)
            transport = self.transports.transport((rows if padded else self.ep.size * rows) * hidden
                                                  * x_TH.element_size())
            planner = self._planner("device", self.chunks, x_TH.device)
            counts_SE = (planner.static_counts(routing.capacity) if padded
                         else transport.gather_counts(routing.tokens_per_expert_E))
            plan = planner.plan(routing.experts_TK, routing.keep_TK, routing.capacity, padded, counts_SE)
        else:
            plan, rows_PL = self._host_plan(x_TH, routing, self.chunks)
            worst_rows = rows if padded else self.ep.size * rows  # every rank's copies landing here
            transport = self.transports.transport(worst_rows * hidden * x_TH.element_size())
            if rows_PL is not None:
                expert_tp = ([plan_expert_tp(rows_PL[:, a:b], x_TH.device) for a, b in plan.chunk_experts], self.etp)
        sms = self._overlap_sms(transport, rows, hidden, x_TH.element_size(), paired)
        self.last_overlap_sms = sms  # what the last call chose (a benchmark reports it)
        state = PipelineState(plan, transport, sms, self.delay_wgrad, expert_tp, paired)
        return DispatchStart.apply(x_TH, state), state

    def run_experts(self, token: torch.Tensor, state: PipelineState) -> torch.Tensor:
        """Every chunk's grouped GEMMs as its rows arrive; the outputs start back."""
        return Experts.apply(token, self.experts.w13, self.experts.w2, state)

    def combine(self, token: torch.Tensor, probs_TK: torch.Tensor, state: PipelineState) -> torch.Tensor:
        """The outputs back at their tokens, weighted and summed: (tokens, hidden)."""
        return Combine.apply(token, probs_TK, state)

    def _overlap_sms(self, transport, rows: int, hidden: int, element_size: int, paired: bool) -> int:
        """``overlap.gemm_sm_carveout`` for the pipeline's GEMMs (none with one chunk and no other micro-batch
        beside: nothing moves beside them); auto: the measured pairing for NCCL (2 x its CTAs, none without a cap),
        for SM pushes from the bytes a chunk moves and the GEMM's time."""
        if self.chunks == 1 and not paired:
            return 0
        if self.carveout != "auto":
            return self.carveout
        if not transport.needs_sms or transport.name == "gloo":
            return 0
        if transport.name == "nccl":
            return carveout_for("auto", self.ep_comm_ctas, 2)
        return auto_push_sms(rows, hidden, self.experts.w2.shape[1], self.chunks, element_size)

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

    def _planner(self, planning: str, chunks: int, device: torch.device):
        if (planning, chunks) not in self._planners:
            local = self.num_experts // self.ep.size
            self._planners[planning, chunks] = (
                DispatchPlanner(self.num_experts, self.ep, chunks, device) if planning == "host"
                else DevicePlanner(self.num_experts, self.ep, chunk_bounds(local, chunks), device))
        return self._planners[planning, chunks]


class _GraphedTwin(nn.Module):
    """A second graphed copy of a MoE layer (its own static buffers, the same parameters), for a second
    micro-batch in flight: capture_moe_layers(copies=2)."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.layer = layer

    def forward(self, x_BSH: torch.Tensor):
        return MoELayer.forward(self.layer, x_BSH)  # the eager forward: the layer's own is the first copy's replay


def capture_moe_layers(moe_layers: tuple[MoELayer, ...], input_shape: tuple[int, ...], copies: int = 1) -> None:
    """Capture each layer's forward and backward in CUDA graphs (torch.cuda.make_graphed_callables, one
    memory pool, forward in order and backward in reverse, as training runs them); from then on a
    training-mode call replays them. Needs layers without a host sync or a collective (the device-planned
    pipeline, or one EP rank) and inputs of ``input_shape``. A collective: every EP rank captures the same layers
    together (the warm-up calls exchange rows).

    A graph holds one call's activations until its backward replays, so with two micro-batches in flight
    (overlap_moe_expert_parallel_comm) ``copies=2`` captures a second set in its own pool: ``layer.graphed_twin``
    replays it (odd micro-batches); each set still runs its forwards in order and backwards in reverse."""
    if not all(layer.local or (layer.pipelined and layer.planning == "device") for layer in moe_layers):
        raise ValueError("CUDA graphs of MoE layers need overlap.moe_pipeline=true with overlap.moe_planning=device "
                         "(or one EP rank)")
    weight = moe_layers[0].experts.w13
    prepare_device_clock(weight.device)  # the graphs time their waits for peers on it (streams.exposed_wait)
    samples = tuple((torch.randn(input_shape, device=weight.device, dtype=weight.dtype, requires_grad=True),)
                    for _ in moe_layers)
    # NCCL's watchdog thread queries events during a capture, which the default "global" capture mode
    # counts as an illegal call from another thread: capture in "thread_local" mode.
    graph = torch.cuda.graph
    torch.cuda.graph = functools.partial(graph, capture_error_mode="thread_local")
    try:
        twins = [_GraphedTwin(layer) for layer in moe_layers] if copies == 2 else []
        torch.cuda.make_graphed_callables(moe_layers, samples)
        if twins:
            torch.cuda.make_graphed_callables(tuple(twins), samples)  # its own call: its own memory pool
    finally:
        torch.cuda.graph = graph
    for layer, twin in zip(moe_layers, twins):
        object.__setattr__(layer, "graphed_twin", twin)  # not a submodule: the parameters stay the layer's
