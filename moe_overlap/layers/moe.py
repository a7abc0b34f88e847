"""The MoE block: router -> permute -> dispatch -> grouped experts -> combine -> unpermute, plus an optional shared
expert. With one EP rank (and no expert-TP) there is nothing to exchange, so every setting runs the local path:
permute, grouped experts, unpermute. Otherwise a planner (exchange_plan.py: host_plan.py or device_plan.py) plans
each call's exchange, and ``overlap.moe_pipeline`` runs it as a pipeline of chunks beside the grouped GEMMs
(dispatch_pipeline.py) in three steps, which the stage split of ``overlap_moe_expert_parallel_comm``
(models/mixtral.py) runs apart:

    start_dispatch   route, plan (the counts: fetched to the host, or gathered on the device), permute, and start
                     the first chunk to the experts
    run_experts      every chunk's grouped GEMMs as its rows arrive, the outputs started back; then the shared
                     expert (model.moe_shared_expert_overlap) beside that transfer, and so (autograd runs the
                     latest-made ready node first) its backward beside the output gradient's transfer to the experts
    finish_combine   wait for the outputs, unpermute; add the shared expert (run here when not in the gap)

otherwise the serial reference (dispatcher.py). The math is the same. With ``overlap.moe_dispatch_once_per_rank`` the
pipeline moves each token once per (chunk, destination rank) and weights the expert outputs on the expert side
(wire_rows.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterator

import torch
from torch import nn

from moe_overlap.config import ModelConfig, OverlapConfig
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.a2a_exchange import Transport
from moe_overlap.distributed.a2a_routes import DeviceRoutes
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.distributed.streams import (carveout_for, expect_gradients_from_other_streams, pair_stream_work,
                                             prepare_device_clock)
from moe_overlap.exchange_rules import expert_tp_refusal, graph_refusal, slots_refusal
from moe_overlap.kernels.copy_rows import copy_rows
from moe_overlap.kernels.permute import Permute, Unpermute
from moe_overlap.layers.device_plan import DevicePlanner
from moe_overlap.layers.dispatch_pipeline import Combine, DispatchStart, Experts, Handoff, PipelineState
from moe_overlap.layers.dispatcher import serial_dispatch_combine
from moe_overlap.layers.experts import GroupedExperts, expert_offsets
from moe_overlap.layers.host_plan import HostPlanner
from moe_overlap.layers.mlp import GatedSharedExpert, SwiGLUMLP
from moe_overlap.layers.paged_stash import PagedStash
from moe_overlap.layers.router import Router, Routing
from moe_overlap.layers.routing_replay import RoutingReplay
from moe_overlap.tuning import EP_NCCL_SMS_PER_CTA, auto_push_sms

log = logging.getLogger(__name__)


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
        self.token_slices = overlap.moe_token_slices  # the micro-batch's tokens in slices, interleaved (_sliced)
        self.capacity_factor = overlap.moe_expert_rank_capacity_factor  # the device-planned receive bound
        self.overflow_factor = overlap.moe_overflow_capacity_factor  # and its overflow chunk's
        self.once_per_rank = overlap.moe_dispatch_once_per_rank  # wire rows: a token once per (chunk, rank)
        if self.pipelined and self.once_per_rank == "auto":
            raise ValueError("overlap.moe_dispatch_once_per_rank='auto' is resolved when the config is validated "
                             "(config.validate); a pipelined layer takes true or false")
        self.once_per_rank = self.once_per_rank is True  # without the pipeline: unused
        self.fp8_wire = overlap.moe_dispatch_dtype == "fp8"  # the rows into the experts cross as FP8 (wire rows)
        if self.fp8_wire and not (self.pipelined and self.once_per_rank):
            raise ValueError("overlap.moe_dispatch_dtype='fp8': not implemented yet without the pipeline and each "
                             "token once per rank (overlap.moe_dispatch_once_per_rank=true)")
        self.host_planned_rerun = False  # host_planned_rerun(): plan on the host whatever the selector planned
        self.delay_wgrad, self.shared_overlap = overlap.delay_wgrad_compute, cfg.moe_shared_expert_overlap
        if self.pipelined and self.shared_overlap == "auto" and cfg.moe_shared_expert_intermediate_size:
            raise ValueError("model.moe_shared_expert_overlap='auto' is resolved when the config is validated "
                             "(config.validate); a pipelined layer takes true or false")
        self.shared_overlap = self.shared_overlap is True  # without a shared expert or the pipeline: unused
        if self.pipelined and self.delay_wgrad == "auto":
            raise ValueError("overlap.delay_wgrad_compute='auto' is resolved when the config is validated "
                             "(config.validate); a pipelined layer takes true or false")
        self.delay_wgrad = self.delay_wgrad is True  # without the pipeline: unused
        self.carveout, self.ep_comm_ctas = overlap.gemm_sm_carveout, overlap.ep_comm_ctas
        self.local = ep.size == 1 and self.etp is None  # nothing to exchange: no transport, no host sync
        if self.pipelined and self.local:
            log.info("MoE dispatch: one EP rank, so the exchange is the identity; overlap.moe_pipeline has "
                     "nothing to move and the layer runs the local path")
        elif self.pipelined and transports is None:
            raise ValueError("overlap.moe_pipeline needs the model's TransportSelector")
        self.planning = transports.planning if self.pipelined and transports is not None else "host"
        refusal = (expert_tp_refusal(self.planning, 1 if self.etp is None else self.etp.size)
                   or slots_refusal(self.planning, getattr(transports, "name", None), self.once_per_rank,
                                    self.overflow_factor is not None and self.chunks > 1))
        if refusal is not None:  # a selector made for another expert-TP size, or wire rows the copy engines need
            raise ValueError(str(refusal))
        if self.once_per_rank and (self.etp is not None or self.pad_to_capacity):
            raise ValueError("overlap.moe_dispatch_once_per_rank=True: not implemented yet with "
                             + ("expert-TP > 1" if self.etp is not None else "model.moe_pad_expert_input_to_capacity"))
        local_experts = self.num_experts // ep.size
        self.router = router if router is not None else Router.from_config(cfg, device, dtype)
        self.experts = GroupedExperts(local_experts, ep.rank * local_experts, cfg.hidden_size,
                                      cfg.expert_ffn_hidden_size, device, dtype, self.etp)
        shared_expert = GatedSharedExpert if cfg.moe_shared_expert_gate else SwiGLUMLP
        self.shared_expert = (shared_expert(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, device, dtype)
                              if cfg.moe_shared_expert_intermediate_size else None)
        self._planners: dict[tuple, HostPlanner | DevicePlanner] = {}  # by the exchange settings they plan for
        self.graph_copies: tuple[nn.Module, ...] = ()  # capture_moe_layers(copies=n): the graphed copies 2..n
        self.last_overlap_sms: int | None = None  # the pipeline's GEMM carve-out in its last call
        # overlap.moe_paged_stash_factor: the pool every MoE layer's device-planned calls keep their backward's
        # tensors in (layers/paged_stash.py; the trainer makes it, knowing the calls in flight)
        self.stash: PagedStash | None = None
        # a routing replay (routing_replay.py, attach_replay), and the graphed copy whose slot this call routes by
        self.replay: RoutingReplay | None = None
        self.replay_slot, self.layer_index = 0, -1

    def for_micro_batch(self, micro_batch: int) -> nn.Module:
        """What runs ``micro_batch``: with graphed copies (capture_moe_layers), the copy its index picks in turn (the
        layer itself is the first), so that a copy's next forward comes after its last one's backward; else, and
        in eval mode, the layer. (A copy is not a submodule, so model.eval() does not reach it: it would replay its
        training graphs, rewriting a training call's static tensors and adding into the exchange's device counters;
        the layer in eval mode runs eagerly.)"""
        return (self, *self.graph_copies)[self._copy_of(micro_batch)]

    def _copy_of(self, micro_batch: int) -> int:
        return micro_batch % (1 + len(self.graph_copies)) if self.training else 0

    def attach_replay(self, replay: RoutingReplay, layer_index: int, tokens: int, copies: int) -> None:
        """Route every training call through ``replay`` (layers/routing_replay.py; before graphs capture the layer's
        ``copies`` sets, each routing ``tokens``)."""
        replay.attach(self.router, layer_index, tokens, copies)
        self.replay, self.layer_index = replay, layer_index

    def routing_slot(self, micro_batch: int):
        """Around a training call that routes ``micro_batch``: with a routing replay, its copy's slot filled before
        or kept after, on the current stream, the micro-batch's."""
        if self.replay is None or not self.training:
            return contextlib.nullcontext()
        return self.replay.around(micro_batch, self.layer_index, self._copy_of(micro_batch))

    def run_micro_batch(self, micro_batch: int, x_BSH: torch.Tensor):
        """:meth:`forward` of ``micro_batch`` by the copy that runs it (:meth:`for_micro_batch`)."""
        with self.routing_slot(micro_batch):
            return self.for_micro_batch(micro_batch)(x_BSH)

    def _route(self, x_TH: torch.Tensor) -> Routing:
        if self.replay is None or not self.training:
            return self.router(x_TH)
        return self.replay.route(self.router, x_TH, self.layer_index, self.replay_slot)

    @property
    def stepped(self) -> bool:
        """The exchange runs as the pipeline's three steps (more than one EP or expert-TP rank), which the
        stage split may run apart."""
        return self.pipelined and not self.local

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the output, the auxiliary losses (load balancing + z, already scaled) and the copies
        routed to each global expert (for metrics; an output, so recomputation does not count twice)."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        if self.stepped and self.token_slices > 1:
            out_TH, routing = self._sliced(x_TH)
        elif self.stepped:
            routing, token, state = self.start_dispatch(x_TH)
            token, shared_TH = self.run_experts(x_TH, token, state)
            out_TH = self.finish_combine(x_TH, token, routing.probs_TK, state, shared_TH)
        else:
            routing = self._route(x_TH)
            out_TH = self._with_shared(x_TH, self._local(x_TH, routing) if self.local else self._serial(x_TH, routing))
        return out_TH.view_as(x_BSH), routing.aux_loss + routing.z_loss, routing.tokens_per_expert_E

    def _local(self, x_TH: torch.Tensor, routing: Routing) -> torch.Tensor:
        """One EP rank: the permuted rows are already in the experts' order, so the grouped GEMMs read device
        offsets and the buffers have static sizes (T x K rows, or E x capacity when padded; rows past the last
        offset are skipped by the GEMMs and read by no one). No host sync: the layer can be graphed."""
        capacity = routing.capacity if self.pad_to_capacity else None
        row_of_copy_TK, _, rows_per_expert_E = copy_rows(routing.experts_TK, self.num_experts, capacity,
                                                         routing.keep_TK)
        num_rows = routing.experts_TK.numel() if capacity is None else self.num_experts * capacity
        all_rows_mapped = routing.keep_TK is None
        # rowwise FP8 experts: their rows quantized as the permutation writes them (each row mapped, unpadded)
        handoff = self.experts.fp8_handoff() if all_rows_mapped and capacity is None else None
        permuted_RH = Permute.apply(x_TH, row_of_copy_TK, num_rows, all_rows_mapped, handoff)
        expert_out_RH = self.experts(permuted_RH, expert_offsets(rows_per_expert_E), handoff)
        return Unpermute.apply(expert_out_RH, row_of_copy_TK, routing.probs_TK, all_rows_mapped, handoff)

    def _serial(self, x_TH: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The reference: one all-to-all each way over the EP process group, sizes from the host."""
        return serial_dispatch_combine(x_TH, routing.probs_TK, self._planner(x_TH).plan(routing), self.ep,
                                       self.experts)

    def _with_shared(self, x_TH: torch.Tensor, out_TH: torch.Tensor, shared_TH: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """The routed experts' output plus the shared expert's (run now unless ``shared_TH`` holds it)."""
        if self.shared_expert is None:
            return out_TH
        return out_TH + (self.shared_expert(x_TH) if shared_TH is None else shared_TH)

    # The pipeline's three steps, each starting an exchange the next one waits for (dispatch_pipeline.py); with
    # ``overlap_moe_expert_parallel_comm`` another micro-batch's stages run between them (models/mixtral.py).
    def start_dispatch(self, x_TH: torch.Tensor, paired: bool = False
                       ) -> tuple[Routing, torch.Tensor, PipelineState]:
        """Route, plan the exchange, permute, and start the first chunk to the experts: the routing (its probs go
        to :meth:`finish_combine`), the token that orders the next step, the state the steps share. ``paired``:
        another micro-batch's compute runs beside the first and last transfers."""
        routing = self._route(x_TH)
        return (routing, *self._dispatch(x_TH, routing, paired=paired))

    def _dispatch(self, x_TH: torch.Tensor, routing: Routing, paired: bool = False,
                  handoffs: dict[str, Handoff | None] | None = None) -> tuple[torch.Tensor, PipelineState]:
        """Plan the exchange of ``routing``'s copies, permute, and start the first chunk (or hand it to another
        token slice: ``handoffs``, PipelineState's fields)."""
        planner = self._planner(x_TH)
        plan = planner.plan(routing)
        sms = self._overlap_sms(plan.transport, planner.permuted_rows(routing), x_TH.shape[1], x_TH.element_size(),
                                paired or handoffs is not None)
        self.last_overlap_sms = sms  # what the last call chose (a benchmark reports it)
        # only a device plan's tensors are bounded, and only a call whose backward runs returns its pages
        paged = isinstance(plan.routes, DeviceRoutes) and plan.expert_tp is None and torch.is_grad_enabled()
        state = PipelineState(plan, sms, self.delay_wgrad, paired, fp8=self.experts.fp8, fp8_wire=self.fp8_wire,
                              stash=self.stash if paged else None, **(handoffs or {}))
        return DispatchStart.apply(x_TH, routing.probs_TK, state), state

    def _sliced(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """``overlap.moe_token_slices``: the tokens routed together (the auxiliary losses are the micro-batch's), then
        cut into slices whose three steps interleave, each slice's transfers handed to another's GEMMs
        (dispatch_pipeline.Handoff): slice i's dispatch runs beside the GEMMs of slice i - 1, its combine beside those
        of slice i + 1; in the backward, its output gradient's rows beside the dgrad of slice i + 1. So only the first
        slice's dispatch and the last slice's combine and output-gradient rows cross with no GEMM beside. The same
        math: each token meets the same experts. Returns the output rows and the routing."""
        routing = self._route(x_TH)
        n = self.token_slices
        edges = [x_TH.shape[0] * i // n for i in range(n + 1)]
        after_gemm, after_dgrad = [Handoff() for _ in range(n)], [Handoff() for _ in range(n)]
        parts, tokens, states = [], [], []
        for i in range(n):
            handoffs = dict(after_gemm=after_gemm[i], after_dgrad=after_dgrad[i],
                            dispatch_to=after_gemm[i - 1] if i > 0 else None,
                            combine_to=after_gemm[i + 1] if i < n - 1 else None,
                            grad_dispatch_to=after_dgrad[i + 1] if i < n - 1 else None)
            parts.append(routing.tokens(edges[i], edges[i + 1]))
            token, state = self._dispatch(x_TH[edges[i]:edges[i + 1]], parts[i], handoffs=handoffs)
            tokens.append(token)
            states.append(state)
            if i > 0:  # after slice i's dispatch was handed to it
                tokens[i - 1] = self._experts(tokens[i - 1], states[i - 1])
        tokens[-1], shared_TH = self.run_experts(x_TH, tokens[-1], states[-1])  # the shared expert: every token
        out_TH = torch.cat([Combine.apply(t, part.probs_TK, s) for t, part, s in zip(tokens, parts, states)])
        return self._with_shared(x_TH, out_TH, shared_TH), routing

    def _experts(self, token: torch.Tensor, state: PipelineState) -> torch.Tensor:
        """Every chunk's grouped GEMMs as its rows arrive; the outputs start back (dispatch_pipeline.Experts)."""
        return Experts.apply(token, self.experts.w13, self.experts.w2, state)

    def run_experts(self, x_TH: torch.Tensor, token: torch.Tensor, state: PipelineState
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every chunk's grouped GEMMs as its rows arrive; the outputs start back. Then the shared expert
        (model.moe_shared_expert_overlap; else None) while they travel: queued before the combine's wait for them,
        and made after the experts' autograd node, so that the backward runs it after the combine's backward has
        started the output gradient's rows to the experts and before the experts' backward waits for them (the
        pipeline's first transfer each way, which one chunk leaves with nothing else beside it). Returns the next
        token and the shared expert's output."""
        token = self._experts(token, state)
        shared_TH = self.shared_expert(x_TH) if self.shared_expert is not None and self.shared_overlap else None
        return token, shared_TH

    def finish_combine(self, x_TH: torch.Tensor, token: torch.Tensor, probs_TK: torch.Tensor, state: PipelineState,
                       shared_TH: torch.Tensor | None) -> torch.Tensor:
        """The outputs back at their tokens, weighted and summed, plus the shared expert's: (tokens, hidden)."""
        return self._with_shared(x_TH, Combine.apply(token, probs_TK, state), shared_TH)

    def _overlap_sms(self, transport: Transport, rows: int, hidden: int, element_size: int, beside: bool) -> int:
        """``overlap.gemm_sm_carveout`` for the pipeline's GEMMs (none with one chunk, no delayed weight gradients
        and no other micro-batch or token slice ``beside``: nothing moves beside them); auto: the measured pairing
        for NCCL
        (tuning.EP_NCCL_SMS_PER_CTA per CTA, none without a cap), for SM pushes from the bytes a chunk moves and
        the GEMM's time. With one chunk and ``delay_wgrad`` the backward's transfer back runs beside the weight
        gradients."""
        if self.chunks == 1 and not beside and not self.delay_wgrad:
            return 0
        if self.carveout != "auto":
            return self.carveout
        if not transport.needs_sms:
            return 0
        if transport.name == "nccl":
            return carveout_for("auto", self.ep_comm_ctas, EP_NCCL_SMS_PER_CTA)
        return auto_push_sms(rows, hidden, self.experts.w2.shape[1], self.chunks, element_size)

    def _planner(self, x_TH: torch.Tensor) -> HostPlanner | DevicePlanner:
        """The planner for the layer's exchange settings (a benchmark may switch them between calls), made at the
        first call with them: rows of ``x_TH``'s width and dtype, on its device."""
        if not self.pipelined:
            key = ("host", 1, None)
        elif self.host_planned_rerun:
            key = ("host", self.chunks, self.transports.host_planned())
        else:
            key = (self.planning, self.chunks, self.transports)
        if key not in self._planners:
            planning, chunks, transports = key
            setting = (self.num_experts, self.ep, chunks, self.pad_to_capacity, transports, x_TH.device,
                       x_TH.shape[1] * x_TH.element_size())
            wire = dict(once_per_rank=self.once_per_rank and transports is not None, topk=self.topk)
            self._planners[key] = (HostPlanner(*setting, self.etp, self.expert_mp, **wire) if planning == "host"
                                   else DevicePlanner(*setting, self.capacity_factor, **wire,
                                                      overflow_factor=self.overflow_factor))
        return self._planners[key]


@contextlib.contextmanager
def host_planned_rerun(moe_layers: list[MoELayer]) -> Iterator[None]:
    """Inside: every pipelined layer plans its exchange on the host over the process group's all-to-all, eagerly
    (a graphed layer's and its copies' captured forwards are set aside, so nothing replays): how the trainer runs
    again a step whose device-planned exchange overflowed its bound (layers/device_plan.py). The same math."""
    set_aside = []
    for layer in moe_layers:
        layer.host_planned_rerun = True
        for module in (layer, *layer.graph_copies):
            if "forward" in module.__dict__:  # make_graphed_callables' replaying forward
                set_aside.append((module, module.__dict__.pop("forward")))
    try:
        yield
    finally:
        for layer in moe_layers:
            layer.host_planned_rerun = False
        for module, forward in set_aside:
            module.forward = forward


class _GraphCopy(nn.Module):
    """A further graphed copy of a MoE layer (its own static buffers, the same parameters), for a further
    micro-batch in flight: capture_moe_layers(copies=n). ``index``: its set (1 to n - 1), whose routing slot it
    routes by (routing_replay.py); ``transports``: its exchange's own regions (copies that run side by side on
    streams of their own), else the layer's."""

    def __init__(self, layer: MoELayer, index: int, transports: TransportSelector | None = None):
        super().__init__()
        self.layer, self.index, self.transports = layer, index, transports

    def forward(self, x_BSH: torch.Tensor):
        """The eager forward (the layer's own is the first copy's replay), through the copy's regions (its planners
        key on them: _planner) and routing slot."""
        layer, shared = self.layer, (self.layer.transports, self.layer.replay_slot)
        layer.replay_slot = self.index
        if self.transports is not None:
            layer.transports = self.transports
        try:
            return MoELayer.forward(layer, x_BSH)
        finally:
            layer.transports, layer.replay_slot = shared


def capture_moe_layers(moe_layers: tuple[MoELayer, ...], input_shape: tuple[int, ...], copies: int = 1,
                       replay_streams: tuple[torch.cuda.Stream, ...] | None = None) -> None:
    """Capture each layer's forward and backward in CUDA graphs (torch.cuda.make_graphed_callables, one
    memory pool, forward in order and backward in reverse, as training runs them); from then on a
    training-mode call replays them. Needs layers without a host sync or a collective (the device-planned
    pipeline, or one EP rank) and inputs of ``input_shape``. A collective: every EP rank captures the same layers
    together (the warm-up calls exchange rows).

    A graph holds one call's activations until its backward replays, so with n micro-batches in flight (paired
    micro-batches, or a pipeline stage's 1F1B) ``copies=n`` captures n - 1 further sets, each in its own pool:
    ``layer.for_micro_batch(i)`` picks set i mod n. Each set still runs its forwards in order and backwards in
    reverse, as long as micro-batch i's backward comes before micro-batch i + n's forward.

    ``replay_streams``: the streams on which the sets replay side by side, set i on stream i mod their count. Each
    further set then exchanges through regions of its own (TransportSelector.twin), and each set is captured on
    the stream it replays on. None: the sets replay one after another, each captured on a stream of its own."""
    for layer in moe_layers:
        refusal = graph_refusal(layer.pipelined, layer.planning, exchanging=not layer.local)
        if refusal is not None:
            raise ValueError(str(refusal))
    weight = moe_layers[0].experts.w13
    prepare_device_clock(weight.device)  # the graphs time their waits for peers on it (streams.exposed_wait)
    expect_gradients_from_other_streams()  # the warm-up's backward runs on the capture stream

    def samples() -> tuple[tuple[torch.Tensor], ...]:
        """Each set's own static inputs: a replay copies its input there, and a layer may save its input for the
        backward (the router's logits do), so a set's must outlive the next set's forward."""
        return tuple((torch.randn(input_shape, device=weight.device, dtype=weight.dtype, requires_grad=True),)
                     for _ in moe_layers)

    sets = []
    for index in range(1, copies):
        twins = {}  # one twin per selector the layers share
        for layer in moe_layers:
            if replay_streams and layer.transports is not None and id(layer.transports) not in twins:
                twins[id(layer.transports)] = layer.transports.twin()
        sets.append(tuple(_GraphCopy(layer, index, twins.get(id(layer.transports))) for layer in moe_layers))
    # NCCL's watchdog thread queries events during a capture, which the default "global" capture mode counts as an
    # illegal call from another thread: capture in "thread_local" mode. Not on torch's one default capture stream:
    # torch hands cuBLAS a workspace per (handle, stream) and a graph keeps the one it was captured with, so sets
    # captured there share one, and two sets replaying side by side then hang (RESULTS.md "Pairs on two streams":
    # a GEMM's blocks spinning). Captured on its replay stream, a set shares its workspace only with work that
    # stream runs in turn.
    graph = torch.cuda.graph
    # captured for a pair's streams: their waits count where neither stream computes (streams.pair_stream_work)
    paired = pair_stream_work(weight.device, block=False) if replay_streams else contextlib.nullcontext()
    try:
        with paired:
            for index, graph_set in enumerate((moe_layers, *sets)):  # a call each: its own memory pool
                stream = (replay_streams[index % len(replay_streams)] if replay_streams
                          else torch.cuda.Stream(weight.device))
                torch.cuda.graph = functools.partial(graph, capture_error_mode="thread_local", stream=stream)
                torch.cuda.make_graphed_callables(graph_set, samples())
    finally:
        torch.cuda.graph = graph
    for index, layer in enumerate(moe_layers):  # not submodules: the parameters stay the layer's
        object.__setattr__(layer, "graph_copies", tuple(graph_set[index] for graph_set in sets))
