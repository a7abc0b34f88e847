"""``overlap.overlap_moe_expert_parallel_comm`` with PP=1: one micro-batch's exchanges in flight while another
micro-batch computes (Megatron-Core's batch-level overlap, DeepSeek-V3's DualPipe pairs).

The model runs as stages (MixtralModel.stages: per MoE layer attention + router + permute with the dispatch
started | expert GEMMs with the combine started | combine waited + unpermute; a dense or one-rank layer:
attention | MLP). Each micro-batch runs them with the autograd graph cut between stages (StagedMicroBatch), so
that one stage's backward runs on its own. The schedule:

    F(0)                                       alone (the parameter all-gathers' carve-out, as the first forward)
    B(i) and F(i+1), one stage each in turn:   B(i)'s last stage, F(i+1)'s first, B(i)'s next, ...
    B(m-1)                                     alone (the gradient reduce-scatters start here, as before)

Backward walks the layers down while forward walks them up, and each exchange started at the end of one stage
is waited for at the start of the same micro-batch's next stage, so one stage of the other micro-batch is
issued in between: B's combine-backward exchange runs beside F's attention, F's dispatch beside B's expert
backward, B's dispatch-backward beside F's expert GEMMs, F's combine beside B's attention backward. Activations
in flight stay about one micro-batch's: F(i+1) holds the lower layers while B(i) still holds the upper ones.
The losses and gradients are those of plain accumulation (tests/test_microbatch_overlap.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from moe_overlap.distributed.streams import stage_label
from moe_overlap.models.mixtral import ModelOutput, Stage


class StagedMicroBatch:
    """One micro-batch run stage by stage. A stage's tensor outputs that need gradients are handed on as
    detached leaves that collect the later stages' gradients, so the stage's backward is
    ``torch.autograd.backward(its outputs, their leaves' gradients)``; the last stage's loss starts it."""

    def __init__(self, stages: list[tuple[str, Stage]], index: int, input_ids_BS: torch.Tensor,
                 labels_BS: torch.Tensor, loss_scale: float):
        self.stages, self.loss_scale = stages, loss_scale
        self.carry: dict = {"input_ids": input_ids_BS, "labels": labels_BS, "micro_batch": index}
        self.cuts: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []
        self.output: ModelOutput | None = None

    def forward(self, k: int) -> None:
        added = self.stages[k][1](self.carry)
        cut = []
        for key, value in added.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                leaf = value.detach().requires_grad_()
                cut.append((value, leaf))
                added[key] = leaf
        self.carry.update(added)
        self.cuts.append(cut)
        if k == len(self.stages) - 1:
            self.output = self.carry["output"]

    def backward(self, k: int) -> None:
        if k == len(self.stages) - 1:
            torch.autograd.backward(self.output.loss * self.loss_scale)
            self.cuts[k] = None
            return
        cut, self.cuts[k] = self.cuts[k], None
        pairs = [(out, leaf.grad) for out, leaf in cut if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


@dataclass
class PairedRun:
    """What :func:`run_paired` hands back: per micro-batch outputs, and the order its stages ran in."""

    outputs: list[ModelOutput]
    order: list[tuple[str, int, str]] = field(default_factory=list)  # (F | B, micro-batch, stage name)


def run_paired(stages: list[tuple[str, Stage]], micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
               loss_scale: float, before_backward, first_forward=contextlib.nullcontext,
               last_backward=contextlib.nullcontext, paired=contextlib.nullcontext) -> PairedRun:
    """Every micro-batch's forward and backward under the schedule of the module docstring. ``before_backward(
    index, is_last)`` runs before each micro-batch's backward (the optimizer arms its gradient sync on the last,
    the experts' weight-gradient pairs follow the backward order); the contexts wrap the first forward, the last
    backward and the paired part (their GEMMs' SM carve-outs)."""
    run = PairedRun([])
    count = len(stages)

    def step(direction: str, micro_batch: StagedMicroBatch, index: int, k: int) -> None:
        with stage_label(f"{direction}.{stages[k][0].split('.')[-1]}"):
            (micro_batch.forward if direction == "F" else micro_batch.backward)(k)
        run.order.append((direction, index, stages[k][0]))

    previous = StagedMicroBatch(stages, 0, *micro_batches[0], loss_scale)
    with first_forward():
        for k in range(count):
            step("F", previous, 0, k)
    for index in range(1, len(micro_batches)):
        before_backward(index - 1, False)
        current = StagedMicroBatch(stages, index, *micro_batches[index], loss_scale)
        with paired():
            for k in range(count):
                step("B", previous, index - 1, count - 1 - k)
                step("F", current, index, k)
        run.outputs.append(previous.output)
        previous = current
    before_backward(len(micro_batches) - 1, True)
    with last_backward():
        for k in reversed(range(count)):
            step("B", previous, len(micro_batches) - 1, k)
    run.outputs.append(previous.output)
    return run
