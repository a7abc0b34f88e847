"""The MoE layer's pipeline (``overlap.moe_pipeline``): the exchange cut into chunks of local experts and run
beside the grouped GEMMs, forward and backward, on a plan made on the host or the device (exchange_plan.py) with
its transport (distributed/a2a_exchange.py); the serial path (dispatcher.py) is its reference.

Forward, in the order the host issues the work (so that each GEMM is launched before the transfers that run
beside it: a push launched first would hold SMs that the GEMM's launch waits for):

    permute; chunk 0 on its way                                   DispatchStart
    for chunk i:  wait for chunk i, take its rows out of the receive buffer; its grouped GEMMs (carve-out on)
                  chunk i-1's outputs start back to their tokens' ranks     } beside GEMM i
                  chunk i+1 starts to the experts                           }
    the last chunk's outputs back                                 Experts
    (the layer's shared expert, with moe_shared_expert_overlap: runs while they travel)
    unpermute reads them where they landed                        Combine

Backward mirrors it: the output gradient's rows travel to the experts chunk by chunk under the dgrad GEMMs and
go back the same way; with ``delay_wgrad`` every chunk's weight-gradient GEMMs run after the last dgrad, beside
the last transfer. Received rows are read where they landed when a kernel can take them: the unpermute copies
the rows it needs for the backward in the same pass, the permutation's backward reads its gradient rows
in place (the copy-out of a symmetric region fused with them). Three autograd Functions bracket the work, each
starting an exchange that the next one waits for (the backward likewise, in reverse), so that whatever the
caller runs between them fills the gaps: the shared expert (between Experts and Combine), or, with
``overlap_moe_expert_parallel_comm``, another micro-batch's stages (training/microbatch_overlap.py), the autograd
graph cut between them. MoELayer's three steps (start_dispatch, run_experts, finish_combine) call them:

    token = DispatchStart.apply(x_TH, probs_TK, state)
    token = Experts.apply(token, w13, w2, state)
    shared_out = shared_expert(x)   # its backward: between Combine's and Experts' (made between them)
    out_TH = Combine.apply(token, probs_TK, state)

With ``overlap.moe_token_slices`` MoELayer cuts the micro-batch's tokens into slices and runs each slice's three
Functions interleaved, so that one slice's transfers run beside another's GEMMs (the slices' transfers handed over
through a :class:`Handoff`: sent right after the other slice's first GEMM is launched):

    forward    dispatch 0 | dispatch 1 beside GEMM 0 | combine 0 beside GEMM 1 | combine 1
    backward   (autograd runs the latest-made ready node first) the output gradient's rows of slice 1 | of slice 0
               beside the dgrad of slice 1 | slice 1's rows back beside the dgrad of slice 0 (and slice 1's delayed
               weight gradients) | slice 0's beside its delayed weight gradients

With ``overlap.moe_dispatch_once_per_rank`` (the plan's ``wire``, layers/wire_rows.py) the rows that cross are wire
rows, one per (token, chunk, destination rank): the routing probs travel with them and weight the expert outputs
on the expert side, so the probs' gradient is made there and returned by DispatchStart's backward (Combine's
carries none); without it the probs are Combine's (DispatchStart's gradient for them is None).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from moe_overlap.distributed.a2a_exchange import FromExperts, ToExperts
from moe_overlap.distributed.a2a_routes import DeviceRoutes
from moe_overlap.distributed.streams import Event, gemm_sm_carveout
from moe_overlap.kernels.permute import permute, permute_backward, unpermute, unpermute_backward
from moe_overlap.layers.deferred_wgrad import is_deferring, weight_grads
from moe_overlap.layers.dispatcher import gather_from_expert_tp, sum_to_expert_tp_owners
from moe_overlap.layers.exchange_plan import Plan
from moe_overlap.layers.fp8 import Fp8, Fp8Rows
from moe_overlap.layers.paged_stash import PagedStash, Stashed
from moe_overlap.layers.wgrad import main_grad_of
from moe_overlap.layers.experts import (WgradInputs, experts_dgrad, experts_forward, experts_wgrad,
                                        weight_grad_for_autograd)
from moe_overlap.layers.wire_rows import (ArrivedRows, arrived_rows, copies_rows, dgrad_rows, dispatch_rows,
                                          extra_columns, hidden_states, packed_hidden, token_grads, token_rows)


class Handoff:
    """Transfers another token slice hands to a layer call, to send right after the call's first grouped GEMM (of
    the forward, or the backward's first dgrad) is launched: a push launched before the GEMM it should run beside
    holds SMs that the GEMM's launch waits for, and nothing overlaps. Once that GEMM is launched, a transfer handed
    over later is sent at once."""

    def __init__(self) -> None:
        self.sends: list = []
        self.launched = False

    def add(self, send) -> None:
        if self.launched:
            send()
        else:
            self.sends.append(send)

    def launch(self) -> None:
        self.launched = True
        sends, self.sends = self.sends, []
        for send in sends:
            send()


def _send(handoff: Handoff | None, send, *args, alone: bool) -> None:
    """``send(*args, alone=alone)`` now, or handed to another slice's call, beside its GEMM (not alone)."""
    if handoff is None:
        send(*args, alone=alone)
    else:
        handoff.add(lambda: send(*args, alone=False))


@dataclass
class PipelineState:
    """What the three Functions of one layer call share: its plan (and the plan's transport) and the exchanges in
    flight between them."""

    plan: Plan
    sms: int  # SMs the GEMMs leave free while rows move beside them (a push's CTAs); 0: none
    delay_wgrad: bool
    paired: bool = False  # another micro-batch's compute runs beside the first and last transfers (never alone)
    dispatch: ToExperts | None = None
    combine: FromExperts | None = None
    grad_dispatch: ToExperts | None = None
    grad_combine: FromExperts | None = None
    # per chunk: what its backward needs (grouped rows, fc1 out; wire: and the outputs), and (wire) its copies
    saved: list[tuple] = field(default_factory=list)
    stash: PagedStash | None = None  # overlap.moe_paged_stash_factor: the chunks' tensors kept in the pool's pages
    probs_need_grad: bool = False  # wire: the expert side computes the probs' gradient
    fp8: Fp8 | None = None  # train.fp8_recipe: the expert GEMMs in FP8 (layers/fp8.py)
    fp8_wire: bool = False  # overlap.moe_dispatch_dtype=fp8: the rows into the experts cross as FP8 (wire_rows.py)
    # overlap.moe_token_slices (None: one slice): what other slices hand this call to send beside its first GEMM
    # (forward) and first dgrad (backward); where this slice's dispatch, combine and output-gradient rows go (None:
    # sent when made)
    after_gemm: Handoff | None = None
    after_dgrad: Handoff | None = None
    dispatch_to: Handoff | None = None
    combine_to: Handoff | None = None
    grad_dispatch_to: Handoff | None = None

    def carveout(self):
        """The carve-out around a GEMM: whenever rows move (and are made ready) beside it, i.e. with more than
        one chunk or token slice."""
        moving = len(self.plan.chunk_experts) - self.plan.overflow_chunk > 1 or self.after_gemm is not None
        return gemm_sm_carveout(self.sms) if moving and self.sms else contextlib.nullcontext()


def _grouped_rows_mapped(plan: Plan) -> bool:
    """Every grouped row within the offsets holds a copy, except in a compute-only reference (its rows' copies
    belong elsewhere), whose grouped tensors' rows within the offsets are zero filled, to stay finite (the grouped
    GEMMs read no row past them). A bounded device plan's wire row past its bound leaves a hole too, but only where a
    copy found no place (device_plan.py): that step runs again, its update skipped on the device as a non-finite
    gradient's is, so what the hole holds does not matter (filling it cost 3% of the fine layer, 1xH200)."""
    return not plan.transport.compute_only


def _received_count(chunk: int, state: PipelineState) -> torch.Tensor | None:
    """The wire rows a chunk receives, on the device (device-planned: its buffer is static, rows past the count
    were never written), or None (host-planned: every row of the buffer arrived). The backward's output-gradient
    rows come back into the forward's rows, so the same count holds."""
    routes = state.plan.routes
    return routes.recv_rows_C[chunk] if isinstance(routes, DeviceRoutes) else None


def _arrived(rows_WX: torch.Tensor, chunk: int, state: PipelineState, hidden: int) -> ArrivedRows:
    """A chunk's wire rows split into hidden states and their copies (device-planned: rows past the count
    carry none). FP8 rows stay FP8 for FP8 GEMMs (layers/fp8.Fp8Rows)."""
    plan = state.plan
    return arrived_rows(rows_WX, hidden, plan.wire.copies, plan.offsets[chunk], _received_count(chunk, state),
                        state.fp8_wire, keep_fp8=state.fp8 is not None)


def _keep(state: PipelineState, chunk: int, tensors: list) -> list | Stashed:
    """A chunk's tensors for its backward: as they are, or copied into the paged stash (its counted rows)."""
    if state.stash is None or tensors[0].shape[0] == 0:
        return tensors
    return state.stash.put(tensors, state.plan.offsets[chunk][-1:])


def _kept(state: PipelineState, kept: list | Stashed) -> list:
    """The tensors :func:`_keep` kept (out of the paged stash: fresh, its pages returned)."""
    return state.stash.take(kept) if isinstance(kept, Stashed) else kept


def _rows_for_experts(rows_RH: torch.Tensor, chunk: int, state: PipelineState, arrived: ArrivedRows | None = None
                      ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """A chunk's rows as its grouped GEMMs take them, with their offsets: wire rows expanded into their copies'
    grouped rows (FP8 ones for FP8 GEMMs, as they crossed); under expert-TP, every peer's rows gathered (each rank
    runs its FFN slice on all of them) and regrouped by expert."""
    plan = state.plan
    if arrived is not None:
        grouped_RH = copies_rows(arrived.x_WH, arrived.grouped_row_WJ, plan.grouped_rows[chunk],
                                 _grouped_rows_mapped(plan), zero_below=plan.offsets[chunk][-1:])
        return grouped_RH, plan.offsets[chunk]
    if state.plan.expert_tp is None:
        return rows_RH, state.plan.offsets[chunk]
    expert_tp = state.plan.expert_tp[chunk]
    gathered_RH = gather_from_expert_tp(rows_RH, expert_tp)
    return gathered_RH.index_select(0, expert_tp.regroup_index), expert_tp.offsets


def _rows_from_experts(rows_RH: torch.Tensor, chunk: int, state: PipelineState) -> torch.Tensor:
    """The adjoint of :func:`_rows_for_experts`: under expert-TP, each peer's rows back to it, summed."""
    if state.plan.expert_tp is None:
        return rows_RH
    expert_tp = state.plan.expert_tp[chunk]
    return sum_to_expert_tp_owners(rows_RH.index_select(0, expert_tp.ungroup_index), expert_tp)


class DispatchStart(torch.autograd.Function):
    """Permute, and start the first chunk to the experts; the backward collects the input gradient's rows
    and sums each token's copies straight from where they landed (wire: and the probs' gradients)."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, probs_TK: torch.Tensor, state: PipelineState) -> torch.Tensor:
        plan = state.plan
        if plan.wire is None:
            send_RH = permute(x_TH, plan.row_of_copy_TK, plan.num_rows, plan.all_rows_mapped)
        else:  # the grouped rows beside: host-planned, they wait for the counts, after the permutation was queued
            send_RH = dispatch_rows(x_TH, probs_TK, plan.wire, lambda: plan.grouped_row_of_copy_TK, state.fp8_wire)
            state.probs_need_grad = ctx.needs_input_grad[1]
        # host-planned: waits for the counts here, after the permutation was queued
        state.dispatch = plan.transport.to_experts(send_RH, plan.routes, state.sms)
        # the pipeline's fill: no expert GEMM beside it (but another slice's, handed over)
        _send(state.dispatch_to, state.dispatch.send, 0, alone=not state.paired)
        ctx.state, ctx.x_dtype, ctx.hidden = state, x_TH.dtype, x_TH.shape[1]
        ctx.probs_dtype = probs_TK.dtype if state.probs_need_grad else None
        return x_TH.new_empty(0)  # orders Experts after this; carries no data

    @staticmethod
    def backward(ctx, _grad_token: torch.Tensor):
        state = ctx.state
        exchange, state.grad_combine = state.grad_combine, None
        grad_probs_TK = None
        if state.plan.wire is None:
            grad_TH = permute_backward(exchange.result(), state.plan.row_of_copy_TK)
        else:
            grad_TH, grad_probs_TK = token_grads(exchange.result(), ctx.hidden, state.plan.wire, ctx.probs_dtype)
        exchange.finish()  # after the kernels that read the landed rows
        return grad_TH.to(ctx.x_dtype), grad_probs_TK, None


def _run_chunks(state: PipelineState, to_experts, from_experts, compute, last_alone: bool = True,
                after_first: Handoff | None = None, back_to: Handoff | None = None) -> None:
    """The schedule both directions share: ``compute(chunk, rows)`` runs a chunk's GEMMs on its rows and returns
    the rows to send back, and work for after them (or None); transfers beside GEMM i are issued after it (see
    the module docstring). ``last_alone``: no GEMM runs beside the last transfer back (the pipeline's drain).
    Token slices: ``after_first`` is launched after the first GEMM; the last transfer back goes to ``back_to``.
    The overflow chunk (last, and mostly empty) leaves the last chunk's transfer back the pipeline's drain: sent as
    its own is (at full width where that is alone), not narrowed for GEMMs that may have no rows."""
    chunks = len(state.plan.chunk_experts)
    waiting = None  # the previous chunk's rows to send back, and the event after the GEMM that made them
    for chunk in range(chunks):
        back_RH, then = compute(chunk, to_experts.recv(chunk, read_once=state.plan.wire is not None))
        made = Event(back_RH.device).record()
        if chunk == 0 and after_first is not None:
            after_first.launch()
        if then is not None:
            then()
        if waiting is not None:
            drain = state.plan.overflow_chunk and chunk == chunks - 1
            from_experts.send(chunk - 1, *waiting, alone=drain and last_alone)
        waiting = back_RH, made
        if chunk + 1 < chunks:
            to_experts.send(chunk + 1)
    _send(back_to, from_experts.send, chunks - 1, *waiting, alone=last_alone)


class Experts(torch.autograd.Function):
    """The chunks' grouped GEMMs with the exchange beside them; the last chunk's outputs start back."""

    @staticmethod
    def forward(ctx, _token: torch.Tensor, w13_EHF2: torch.Tensor, w2_EFH: torch.Tensor,
                state: PipelineState) -> torch.Tensor:
        plan, dispatch = state.plan, state.dispatch
        state.combine = plan.transport.from_experts(plan.routes, w2_EFH.shape[-1], w2_EFH, state.sms)
        state.saved = []

        def compute(chunk: int, rows_RH: torch.Tensor) -> torch.Tensor:
            first, last = plan.chunk_experts[chunk]
            arrived = None if plan.wire is None else _arrived(rows_RH, chunk, state, w2_EFH.shape[-1])
            grouped_RH, offsets = _rows_for_experts(rows_RH, chunk, state, arrived)
            with state.carveout():
                y_RH, h_RF2 = experts_forward(grouped_RH, offsets, w13_EHF2[first:last], w2_EFH[first:last],
                                               state.fp8)
            # kept for the backward after the rows back are made (a paged stash's copy does not delay them)
            if arrived is None:
                return _rows_from_experts(y_RH, chunk, state), lambda: state.saved.append(
                    (_keep(state, chunk, [grouped_RH, h_RF2, None]), None))
            # the expert outputs weighted by their probs and summed per wire row, on the expert side
            copies = arrived.grouped_row_WJ, arrived.probs_WJ  # not the received rows: they are in grouped_RH
            y_kept = y_RH if state.probs_need_grad else None
            return unpermute(y_RH, arrived.grouped_row_WJ, arrived.probs_WJ), lambda: state.saved.append(
                (_keep(state, chunk, [grouped_RH, h_RF2, y_kept]), copies))

        _run_chunks(state, dispatch, state.combine, compute, last_alone=not state.paired, after_first=state.after_gemm,
                    back_to=state.combine_to)
        dispatch.finish()
        state.dispatch = None
        ctx.state = state
        ctx.weights = w13_EHF2, w2_EFH  # the parameters themselves (their main_grad)
        return w2_EFH.new_empty(0)  # orders Combine after this; carries no data

    @staticmethod
    def backward(ctx, _grad_token: torch.Tensor):
        state = ctx.state
        plan = state.plan
        w13_EHF2, w2_EFH = ctx.weights
        grad_dispatch, state.grad_dispatch = state.grad_dispatch, None
        hidden = w13_EHF2.shape[1]
        width = hidden + (extra_columns(plan.wire.copies, w13_EHF2.dtype)  # the probs' gradients beside
                          if plan.wire is not None and state.probs_need_grad else 0)
        grad_combine = plan.transport.from_experts(plan.routes, width, w13_EHF2, state.sms)
        deferred = is_deferring()  # a zero-bubble schedule's W computes the weight gradients (deferred_wgrad.py)
        jobs = [None] * len(plan.chunk_experts)  # per chunk: what its weight gradients need (None: no rows)
        wgrads = [None] * len(plan.chunk_experts)  # per chunk: fc1, fc2 weight gradients (None: into main_grad)

        def wgrad(chunk: int) -> None:
            with state.carveout():
                wgrads[chunk] = experts_wgrad(*jobs[chunk])

        def compute(chunk: int, rows_RH: torch.Tensor):
            first, last = plan.chunk_experts[chunk]
            kept, copies = state.saved[chunk]
            grouped_RH, h_RF2, y_RH = _kept(state, kept)
            if grouped_RH.shape[0] == 0:  # grouped_mm rejects empty gradients; no rows (on every expert-TP peer)
                return rows_RH.new_empty((0, width)), None
            grad_probs_WJ = None
            wire = copies is not None
            if wire:  # each copy's output gradient: its prob times its wire row's; the prob's: <output, that row>
                grouped_row_WJ, probs_WJ = copies
                grad_WH = hidden_states(rows_RH, hidden, state.fp8_wire, _received_count(chunk, state))
                grad_y_RH, grad_probs_WJ = unpermute_backward(grad_WH, y_RH, grouped_row_WJ, probs_WJ,
                                                              _grouped_rows_mapped(plan), num_rows=grouped_RH.shape[0],
                                                              zero_below=plan.offsets[chunk][-1:])
                offsets = plan.offsets[chunk]
            else:
                grad_y_RH, offsets = _rows_for_experts(rows_RH, chunk, state)
            with state.carveout():
                grad_x_RH, grad_h_RF2, a_RF = experts_dgrad(grad_y_RH, h_RF2, offsets, w13_EHF2[first:last],
                                                            w2_EFH[first:last], state.fp8)
            overflow = plan.overflow_chunk and chunk == len(plan.chunk_experts) - 1  # few rows, any expert
            jobs[chunk] = (w13_EHF2, w2_EFH, [WgradInputs(grouped_RH, a_RF, grad_h_RF2, grad_y_RH, offsets)],
                           slice(first, last), state.fp8, overflow)
            later = state.delay_wgrad or deferred  # after the last dgrad, beside the last chunk's transfer back
            back_RH = (_rows_from_experts(grad_x_RH, chunk, state) if not wire else  # a wire row's copies summed
                       dgrad_rows(grad_x_RH, grouped_row_WJ, grad_probs_WJ))
            return back_RH, None if later else (lambda: wgrad(chunk))

        # the last transfer back runs beside the delayed weight gradients (or another micro-batch), else alone
        _run_chunks(state, grad_dispatch, grad_combine, compute,
                    last_alone=not (deferred or state.delay_wgrad or state.paired), after_first=state.after_dgrad)
        if deferred:
            grad_w13, grad_w2 = weight_grads(_deferred_weight_grads, (w13_EHF2, w2_EFH, jobs, plan), ctx.weights)
        else:
            for chunk in range(len(jobs)):
                if state.delay_wgrad and jobs[chunk] is not None:
                    wgrad(chunk)
            grad_w13, grad_w2 = _weight_grads(w13_EHF2, w2_EFH, wgrads, jobs, plan)
        grad_dispatch.finish()
        state.saved = []
        state.grad_combine = grad_combine
        return _grad_token.new_zeros(0), grad_w13, grad_w2, None


class Combine(torch.autograd.Function):
    """Wait for the expert outputs to come back, and unpermute them; the backward starts the output gradient's
    rows to the experts."""

    @staticmethod
    def forward(ctx, _token: torch.Tensor, probs_TK: torch.Tensor, state: PipelineState) -> torch.Tensor:
        plan, combine = state.plan, state.combine
        state.combine = None
        combined_RH = combine.result()
        ctx.state = state
        if plan.wire is not None:  # the rows came back weighted: a token's rows summed
            out_TH = permute_backward(combined_RH, plan.wire.row_TC, sparse_from=plan.wire.overflow_from)
            combine.finish()
            return out_TH
        keep = ctx.needs_input_grad[1]  # the probs' gradient reads the combined rows
        copy_RH = combined_RH.new_empty(combined_RH.shape) if keep and combine.transient else None
        out_TH = unpermute(combined_RH, plan.row_of_copy_TK, probs_TK, copy_RH)
        combine.finish()  # after the unpermute read the landed rows
        ctx.save_for_backward(probs_TK, None if not keep else combined_RH if copy_RH is None else copy_RH)
        ctx.rows_dtype = combined_RH.dtype
        return out_TH

    @staticmethod
    def backward(ctx, grad_out_TH: torch.Tensor):
        state = ctx.state
        plan = state.plan
        if plan.wire is not None:  # each wire row takes its token's gradient; the probs' come from the experts
            grad_rows = token_rows(packed_hidden(grad_out_TH.contiguous(), state.fp8_wire), plan.wire)
            state.grad_dispatch = plan.transport.to_experts(grad_rows, plan.routes, state.sms)
            _send(state.grad_dispatch_to, state.grad_dispatch.send, 0, alone=not state.paired)
            return grad_out_TH.new_zeros(0), None, None
        probs_TK, combined_RH = ctx.saved_tensors
        grad_rows_RH, grad_probs_TK = unpermute_backward(grad_out_TH.contiguous(), combined_RH, plan.row_of_copy_TK,
                                                         probs_TK, plan.all_rows_mapped, num_rows=plan.num_rows)
        state.grad_dispatch = plan.transport.to_experts(grad_rows_RH.to(ctx.rows_dtype), plan.routes, state.sms)
        _send(state.grad_dispatch_to, state.grad_dispatch.send, 0, alone=not state.paired)
        if grad_probs_TK is not None:
            grad_probs_TK = grad_probs_TK.to(probs_TK.dtype)
        return grad_out_TH.new_zeros(0), grad_probs_TK, None


def _weight_grads(w13_EHF2: torch.Tensor, w2_EFH: torch.Tensor, wgrads: list, jobs: list,
                  plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chunk's weight gradients as autograd takes them (see weight_grad_for_autograd); a chunk no rows
    reached contributes zeros. The overflow chunk's (all the local experts) add to the chunks' runs."""
    def grads(chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        first, last = plan.chunk_experts[chunk]
        if jobs[chunk] is None:
            return torch.zeros_like(w13_EHF2[first:last]), torch.zeros_like(w2_EFH[first:last])
        return wgrads[chunk]

    runs = [grads(chunk) for chunk in range(len(jobs) - plan.overflow_chunk)]
    grad_w13 = weight_grad_for_autograd(w13_EHF2, [g for g, _ in runs])
    grad_w2 = weight_grad_for_autograd(w2_EFH, [g for _, g in runs])
    if plan.overflow_chunk and jobs[-1] is not None and main_grad_of(w13_EHF2) is None:  # else in main_grad too
        over_w13, over_w2 = wgrads[-1]
        grad_w13, grad_w2 = grad_w13 + over_w13, grad_w2 + over_w2
    return grad_w13, grad_w2


def _deferred_weight_grads(w13_EHF2: torch.Tensor, w2_EFH: torch.Tensor, jobs: list,
                           plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """A zero-bubble W: every chunk's weight gradients from the inputs its I kept."""
    wgrads = [None if job is None else experts_wgrad(*job) for job in jobs]
    return _weight_grads(w13_EHF2, w2_EFH, wgrads, jobs, plan)
