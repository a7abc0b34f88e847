"""The overlapped twin of the serial dispatch: the exchange cut into chunks of local experts, pipelined
under the grouped GEMMs, forward and backward.

Forward: every dispatch chunk is queued on the transport at once; chunk i's GEMM starts as soon as its
rows have landed, and its combine leaves while chunk i+1 computes. Backward mirrors it: the gradient
rows travel the dispatch way chunk by chunk under the dgrad GEMMs, and go back the combine way; with
``delay_wgrad`` each chunk's weight-gradient GEMMs run after its gradient has left, filling the gap.

Two autograd Functions bracket the work so that whatever the caller runs between them (the shared
expert) fills the dispatch gap in the forward and the combine gap in the backward:
    token = DispatchStart.apply(permuted_RH, state)      # queue every dispatch chunk
    shared_out = shared_expert(x)                         # runs while rows travel
    combined_RH = ExpertsCombine.apply(token, w13, w2, state)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_overlap.distributed.a2a import Exchange
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.layers.dispatcher import ExchangePlan, ExpertTPPlan, gather_from_expert_tp, sum_to_expert_tp_owners
from moe_overlap.layers.deferred_wgrad import is_deferring, weight_grads
from moe_overlap.layers.experts import (WgradInputs, experts_dgrad, experts_forward, experts_wgrad,
                                        weight_grad_for_autograd)


@dataclass
class PipelineState:
    """What the two Functions of one layer call share."""

    plan: ExchangePlan
    transport: object  # a2a transport: CollectiveTransport or SymmTransport
    delay_wgrad: bool
    expert_tp: tuple[list[ExpertTPPlan], GroupHandle] | None = None  # per chunk, with expert-TP > 1
    dispatch: Exchange | None = None
    grad_combine: Exchange | None = None
    saved: list = field(default_factory=list)  # per chunk: (grouped rows, fc1 output)


def _rows_for_experts(rows_RH: torch.Tensor, chunk: int, state: PipelineState) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's rows as its grouped GEMMs take them, with their offsets: under expert-TP, every peer's
    rows gathered (each rank runs its FFN slice on all of them) and regrouped by expert."""
    if state.expert_tp is None:
        return rows_RH, state.plan.offsets[chunk]
    plans, etp = state.expert_tp
    gathered_RH = gather_from_expert_tp(rows_RH, plans[chunk], etp)
    return gathered_RH.index_select(0, plans[chunk].regroup_index), plans[chunk].offsets


def _rows_from_experts(rows_RH: torch.Tensor, chunk: int, state: PipelineState) -> torch.Tensor:
    """The adjoint of :func:`_rows_for_experts`: under expert-TP, each peer's rows back to it, summed."""
    if state.expert_tp is None:
        return rows_RH
    plans, etp = state.expert_tp
    return sum_to_expert_tp_owners(rows_RH.index_select(0, plans[chunk].ungroup_index), plans[chunk], etp)


class DispatchStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted_RH: torch.Tensor, state: PipelineState) -> torch.Tensor:
        state.dispatch = state.transport.exchange(permuted_RH, state.plan.layout)
        for chunk in range(state.plan.layout.num_chunks):
            state.dispatch.send(chunk)
        ctx.state = state
        return permuted_RH.new_empty(0)  # orders ExpertsCombine after this; carries no data

    @staticmethod
    def backward(ctx, _grad_token: torch.Tensor):
        """Collect the input gradient rows that ExpertsCombine.backward sent back the combine way."""
        state, exchange = ctx.state, ctx.state.grad_combine
        for chunk in range(state.plan.layout.num_chunks):
            exchange.recv(chunk)
        grad_RH = exchange.result()
        exchange.finish()
        state.grad_combine = None
        return grad_RH, None


class ExpertsCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, _token: torch.Tensor, w13_EHF2: torch.Tensor, w2_EFH: torch.Tensor,
                state: PipelineState) -> torch.Tensor:
        plan, dispatch = state.plan, state.dispatch
        expert_out_RH = dispatch.send_buffer.new_empty((plan.layout.recv_total, w2_EFH.shape[-1]))
        combine = state.transport.exchange(expert_out_RH, plan.layout.reversed())
        state.saved = []
        for chunk, (first, last) in enumerate(plan.chunk_experts):
            grouped_RH, offsets = _rows_for_experts(dispatch.recv(chunk).index_select(0, plan.regroup_index[chunk]),
                                                    chunk, state)
            y_RH, h_RF2 = experts_forward(grouped_RH, offsets, w13_EHF2[first:last], w2_EFH[first:last])
            start, stop = plan.layout.recv_range(chunk)
            torch.index_select(_rows_from_experts(y_RH, chunk, state), 0, plan.ungroup_index[chunk],
                               out=expert_out_RH[start:stop])
            combine.send(chunk)
            state.saved.append((grouped_RH, h_RF2))
        dispatch.finish()
        state.dispatch = None
        for chunk in range(plan.layout.num_chunks):
            combine.recv(chunk)
        combined_RH = combine.result()
        combine.finish()
        ctx.state = state
        ctx.weights = w13_EHF2, w2_EFH  # the parameters themselves (their main_grad)
        return combined_RH

    @staticmethod
    def backward(ctx, grad_combined_RH: torch.Tensor):
        state = ctx.state
        plan = state.plan
        w13_EHF2, w2_EFH = ctx.weights
        wgrads = []  # per chunk: its experts' fc1, fc2 weight gradients (None: added into main_grad)
        chunk_inputs = []  # per chunk: what its weight gradients need (None: no rows)
        deferred = is_deferring()  # a zero-bubble schedule's W computes them: keep their inputs instead
        grad_dispatch = state.transport.exchange(grad_combined_RH.contiguous(), plan.layout)
        for chunk in range(plan.layout.num_chunks):
            grad_dispatch.send(chunk)
        grad_in_RH = grad_combined_RH.new_empty((plan.layout.recv_total, w13_EHF2.shape[1]))
        grad_combine = state.transport.exchange(grad_in_RH, plan.layout.reversed())
        for chunk, (first, last) in enumerate(plan.chunk_experts):
            grouped_RH, h_RF2 = state.saved[chunk]
            grad_y_RH, offsets = _rows_for_experts(grad_dispatch.recv(chunk).index_select(0, plan.regroup_index[chunk]),
                                                   chunk, state)
            weights = (w13_EHF2[first:last], w2_EFH[first:last])
            start, stop = plan.layout.recv_range(chunk)
            # grouped_mm rejects empty gradients; no rows (on every expert-TP peer alike): zero weight gradient
            if grouped_RH.shape[0] == 0:
                chunk_inputs.append(None)
                wgrads.append((torch.zeros_like(weights[0]), torch.zeros_like(weights[1])))
                grad_combine.send(chunk)
                continue
            grad_x_RH, grad_h_RF2, a_RF = experts_dgrad(grad_y_RH, h_RF2, offsets, *weights)
            chunk_inputs.append(WgradInputs(grouped_RH, a_RF, grad_h_RF2, grad_y_RH, offsets))
            wgrad = (w13_EHF2, w2_EFH, chunk_inputs[-1:], slice(first, last))
            if not (state.delay_wgrad or deferred):
                wgrads.append(experts_wgrad(*wgrad))
            torch.index_select(_rows_from_experts(grad_x_RH, chunk, state), 0, plan.ungroup_index[chunk],
                               out=grad_in_RH[start:stop])
            grad_combine.send(chunk)
            if state.delay_wgrad and not deferred:  # fills the gap while this chunk's gradient travels
                wgrads.append(experts_wgrad(*wgrad))
        grad_dispatch.finish()
        state.saved = []
        state.grad_combine = grad_combine
        if deferred:
            grad_w13, grad_w2 = weight_grads(_chunk_weight_grads, (w13_EHF2, w2_EFH, chunk_inputs, plan.chunk_experts),
                                             ctx.weights)
        else:
            grad_w13 = weight_grad_for_autograd(w13_EHF2, [g for g, _ in wgrads])
            grad_w2 = weight_grad_for_autograd(w2_EFH, [g for _, g in wgrads])
        return grad_combined_RH.new_zeros(0), grad_w13, grad_w2, None


def _chunk_weight_grads(w13_EHF2: torch.Tensor, w2_EFH: torch.Tensor, chunk_inputs: list[WgradInputs | None],
                        chunk_experts: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chunk's weight gradients from the inputs its backward kept, as autograd takes them."""
    grads = [(torch.zeros_like(w13_EHF2[first:last]), torch.zeros_like(w2_EFH[first:last])) if inputs is None
             else experts_wgrad(w13_EHF2, w2_EFH, [inputs], slice(first, last))
             for inputs, (first, last) in zip(chunk_inputs, chunk_experts)]
    return (weight_grad_for_autograd(w13_EHF2, [g for g, _ in grads]),
            weight_grad_for_autograd(w2_EFH, [g for _, g in grads]))
