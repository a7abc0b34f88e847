"""Experts as grouped GEMMs (torch._grouped_mm): SwiGLU fc1 -> fc2 over rows sorted by local expert.
Rows past the last offset are not computed (a static worst-case buffer of the device-planned exchange): the
GEMMs skip them (measured: no cost, and garbage there reaches no valid output or weight gradient), and so
does the SwiGLU kernel.

The forward and backward are explicit so the overlapped pipeline can run dgrad and wgrad separately.
w13 holds [gate | up] along its last dimension. Under ``fp8`` (train.fp8_recipe) the forward and dgrad GEMMs run
in FP8 (layers/fp8.py), and so do the weight gradients into main_grad unless train.fp8_wgrad is off. Under expert-TP
fc2's forward and fc1's dgrad contract over the split FFN dimension: their scales are shared over the group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from moe_overlap.kernels.permute import Fp8Handoff
from moe_overlap.kernels.swiglu import (swiglu_backward, swiglu_backward_fp8, swiglu_forward, swiglu_forward_fp8,
                                        swiglu_forward_torch)

from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.layers.init import NORMAL, SCALED_NORMAL, make_param
from moe_overlap.layers.param_info import TPShard
from moe_overlap.layers.deferred_wgrad import weight_grads
from moe_overlap.layers.fp8 import Fp8, Fp8Rows, grouped_mm
from moe_overlap.layers.wgrad import grouped_wgrad, main_grad_of, mark_own_grad, placeholder


def expert_offsets(rows_per_expert: torch.Tensor) -> torch.Tensor:
    """End offset of each expert's rows, int32 as torch._grouped_mm wants."""
    return torch.cumsum(rows_per_expert, dim=0).to(torch.int32)


def experts_forward(x_TH: torch.Tensor | Fp8Rows, offsets_E: torch.Tensor, w13_EHF2: torch.Tensor,
                    w2_EFH: torch.Tensor, fp8: Fp8 | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1 -> SwiGLU -> fc2; returns the output and fc1's output (kept for the backward). Rows already in FP8
    (:class:`Fp8Rows`, under ``fp8``) go to fc1 as they are; an FP8 fc2 gets SwiGLU's output as FP8 rows straight
    from the SwiGLU kernel (no bf16 pass written and quantized after)."""
    h_TF2 = grouped_mm(x_TH, w13_EHF2, offsets_E, fp8, fast_accum=True)
    if _fed_fp8(fp8, w2_EFH):
        a_TF = Fp8Rows(*swiglu_forward_fp8(h_TF2, offsets_E[-1:], tiles=fp8.recipe == "blockwise"), h_TF2.dtype)
    else:
        a_TF = swiglu_forward(h_TF2, offsets_E[-1:])
    return grouped_mm(a_TF, w2_EFH, offsets_E, fp8, fast_accum=True, split=True), h_TF2


def experts_dgrad(grad_y_TH: torch.Tensor, h_TF2: torch.Tensor, offsets_E: torch.Tensor, w13_EHF2: torch.Tensor,
                  w2_EFH: torch.Tensor, fp8: Fp8 | None = None, grad_y_fp8: list[Fp8Rows] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input gradient; also fc1's output gradient and the SwiGLU activation, which the weight gradients need
    (the fused backward rebuilds the activation in the same pass, so the forward need not keep it). An FP8 fc1
    dgrad gets fc1's output gradient as FP8 rows from the SwiGLU kernel; fc2's takes grad_y's rows already in FP8
    where given: ``grad_y_fp8``, a one-element list that fc2's dgrad empties, so that they are freed before fc1's
    dgrad, as fc2's output gradient is (the backward's peak: the experts' input gradient). The SwiGLU kernel writes
    fc1's FP8 output-gradient rows over h, whose last reader it is, so FP8 adds no buffer to that peak: the caller
    reads h no more."""
    grad_a_TF = grouped_mm(grad_y_TH if grad_y_fp8 is None else grad_y_fp8.pop(), w2_EFH, offsets_E, fp8,
                           transpose_w=True)
    if _fed_fp8(fp8, w13_EHF2):  # fc1's output gradient as FP8 rows too, from the same kernel
        grad_h_TF2, a_TF, *rows = swiglu_backward_fp8(h_TF2, grad_a_TF, offsets_E[-1:],
                                                      tiles=fp8.recipe == "blockwise", over_h=True)
        del grad_a_TF
        return (grouped_mm(Fp8Rows(*rows, grad_h_TF2.dtype), w13_EHF2, offsets_E, fp8, transpose_w=True), grad_h_TF2,
                a_TF)
    grad_h_TF2, a_TF = swiglu_backward(h_TF2, grad_a_TF, offsets_E[-1:])
    del grad_a_TF
    return grouped_mm(grad_h_TF2, w13_EHF2, offsets_E, fp8, transpose_w=True, split=True), grad_h_TF2, a_TF


def _fed_fp8(fp8: Fp8 | None, w: torch.Tensor) -> bool:
    """Whether a GEMM with weight ``w`` runs in FP8 with its left operand fed as FP8 rows by the SwiGLU kernels:
    per row (rowwise) or per 1x128 tile (blockwise). Not rowwise under expert-TP, where those rows are the FFN
    dimension's part on this rank and their scales are shared over the group (layers/fp8.py) instead; a tile lies
    on one rank."""
    return fp8 is not None and fp8.covers(*w.shape[-2:]) and (fp8.recipe == "blockwise" or fp8.expert_tp is None)


@dataclass
class WgradInputs:
    """What the experts' weight gradients of one micro-batch (or one chunk of it) need."""

    x_TH: torch.Tensor | Fp8Rows  # FP8 rows: dequantized when the weight gradients run (only those need them so)
    a_TF: torch.Tensor
    grad_h_TF2: torch.Tensor
    grad_y_TH: torch.Tensor
    offsets_E: torch.Tensor


def experts_wgrad(w13_EHF2: torch.Tensor, w2_EFH: torch.Tensor, inputs: list[WgradInputs],
                  experts: slice = slice(None), fp8: Fp8 | None = None, few_rows: bool = False
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Weight gradients of the local experts ``experts`` from one or two micro-batches' inputs (separate from
    dgrad so a pipeline can defer them into communication gaps): added into the parameters' fp32 main_grad
    inside the grouped kernel (returns Nones), or returned where the parameters have none. ``fp8``: in FP8 under
    train.fp8_wgrad. ``few_rows``: most experts have none (an overflow chunk's rows)."""
    def rows(x_TH: torch.Tensor | Fp8Rows, offsets_E: torch.Tensor) -> torch.Tensor:
        return x_TH.dequantized(offsets_E[-1:]) if isinstance(x_TH, Fp8Rows) else x_TH

    return (grouped_wgrad(w13_EHF2, [(rows(i.x_TH, i.offsets_E), i.grad_h_TF2, i.offsets_E) for i in inputs],
                          experts, fp8, few_rows),
            grouped_wgrad(w2_EFH, [(i.a_TF, i.grad_y_TH, i.offsets_E) for i in inputs], experts, fp8, few_rows))


def weight_grad_for_autograd(param: torch.Tensor, chunk_grads: list[torch.Tensor | None]) -> torch.Tensor:
    """What a backward returns for an expert weight whose gradient it computed in runs of experts: a
    placeholder when the runs went into main_grad, else the runs joined (one run: no copy)."""
    if main_grad_of(param) is not None:
        return placeholder(param)
    return chunk_grads[0] if len(chunk_grads) == 1 else torch.cat(chunk_grads)


def expert_weight_grads(w13_EHF2: torch.Tensor, w2_EFH: torch.Tensor, inputs: list[WgradInputs],
                        fp8: Fp8 | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both expert weights' gradients from one or two micro-batches' inputs (none: no rows reached them), as
    autograd takes them (see weight_grad_for_autograd)."""
    if not inputs:
        grads = (None, None) if main_grad_of(w13_EHF2) is not None else (torch.zeros_like(w13_EHF2),
                                                                         torch.zeros_like(w2_EFH))
    else:
        grads = experts_wgrad(w13_EHF2, w2_EFH, inputs, fp8=fp8)
    return weight_grad_for_autograd(w13_EHF2, [grads[0]]), weight_grad_for_autograd(w2_EFH, [grads[1]])


class ExpertWgradGroups:
    """``train.expert_wgrad_micro_batches``: the experts' weight gradients of ``size`` consecutive micro-batches
    summed at once. A micro-batch's wgrad inputs wait for the next ones', and one grouped kernel adds them all into
    main_grad: the fp32 main_grad is read and written once per group instead of per micro-batch (the expert wgrad's
    largest cost beside its GEMM when experts are few and large), at the price of keeping size - 1 micro-batches'
    wgrad inputs per layer. The step's last micro-batch never waits, so main_grad is whole when its backward ends.
    A micro-batch whose rows reached none of these experts adds nothing and counts toward no group."""

    def __init__(self, size: int):
        self.size = size
        self.waiting: list[WgradInputs] = []
        self.last = True

    def start_micro_batch(self, first: bool, last: bool) -> None:
        if first:
            self.waiting = []
        self.last = last

    def take(self, inputs: WgradInputs | None) -> list[WgradInputs] | None:
        """The inputs whose gradients to add now (up to ``size`` micro-batches'), or None: they wait."""
        if inputs is not None:
            self.waiting.append(inputs)
        if not self.last and len(self.waiting) < self.size:
            return None
        ready, self.waiting = self.waiting, []
        return ready


class GroupedSwiGLU(torch.autograd.Function):
    """``handoff``: the permutation around the experts also writes their rows in FP8 (kernels/permute.Fp8Handoff):
    fc1's input, and in the backward fc2's output gradient, reach their rowwise FP8 GEMMs so, with no pass of
    their own to quantize them (the weight gradients still read the bf16 rows)."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, offsets_E: torch.Tensor, w13_EHF2: torch.Tensor, w2_EFH: torch.Tensor,
                groups: ExpertWgradGroups | None = None, fp8: Fp8 | None = None,
                handoff: Fp8Handoff | None = None) -> torch.Tensor:
        x_rows = handoff.take_forward() if handoff is not None else None
        y_TH, h_TF2 = experts_forward(x_TH if x_rows is None else Fp8Rows(*x_rows, x_TH.dtype), offsets_E, w13_EHF2,
                                      w2_EFH, fp8)
        ctx.save_for_backward(x_TH, offsets_E, h_TF2)
        ctx.weights = w13_EHF2, w2_EFH  # the parameters themselves (their main_grad), also under recomputation
        ctx.fp8, ctx.handoff = fp8, handoff
        ctx.groups = groups if main_grad_of(w13_EHF2) is not None else None
        return y_TH

    @staticmethod
    def backward(ctx, grad_y_TH: torch.Tensor):
        (x_TH, offsets_E, h_TF2), (w13_EHF2, w2_EFH) = ctx.saved_tensors, ctx.weights
        grad_y_rows = ctx.handoff.take_backward(grad_y_TH) if ctx.handoff is not None else None
        # held by the list alone, which fc2's dgrad empties (experts_dgrad)
        grad_y_fp8 = None if grad_y_rows is None else [Fp8Rows(*grad_y_rows, grad_y_TH.dtype)]
        del grad_y_rows
        if x_TH.shape[0] == 0:  # no rows reached these experts: grouped_mm rejects empty gradients' strides
            grad_x_TH, inputs = torch.zeros_like(x_TH), None
        else:
            grad_y_TH = grad_y_TH.contiguous()  # grouped_mm's kernels reject expanded gradients
            grad_x_TH, grad_h_TF2, a_TF = experts_dgrad(grad_y_TH, h_TF2, offsets_E, w13_EHF2, w2_EFH, ctx.fp8,
                                                        grad_y_fp8)
            inputs = WgradInputs(x_TH, a_TF, grad_h_TF2, grad_y_TH, offsets_E)
        ready = ctx.groups.take(inputs) if ctx.groups is not None else [i for i in (inputs,) if i is not None]
        grad_w13_EHF2, grad_w2_EFH = weight_grads(expert_weight_grads, (w13_EHF2, w2_EFH, ready, ctx.fp8), ctx.weights)
        return grad_x_TH, None, grad_w13_EHF2, grad_w2_EFH, None, None, None


def grouped_swiglu_reference(x_TH: torch.Tensor, rows_per_expert: list[int], w13_EHF2: torch.Tensor,
                             w2_EFH: torch.Tensor) -> torch.Tensor:
    """Loop twin of GroupedSwiGLU (one matmul pair per expert), for tests."""
    outputs, start = [], 0
    for expert, rows in enumerate(rows_per_expert):
        x = x_TH[start:start + rows]
        outputs.append(swiglu_forward_torch(x @ w13_EHF2[expert]) @ w2_EFH[expert])
        start += rows
    return torch.cat(outputs) if outputs else x_TH.new_zeros((0, w2_EFH.shape[-1]))


class GroupedExperts(nn.Module):
    """The experts this rank holds: global experts [first_expert, first_expert + num_local_experts), each
    split over the expert-tensor-parallel group ``etp`` along its FFN dimension (fc1's gate and up each
    split, so SwiGLU stays local; fc2 split by rows). One expert's logical tensors are w13 (H, 2, F) and
    w2 (F, H) whatever the split, so checkpoints and init do not depend on it."""

    def __init__(self, num_local_experts: int, first_expert: int, hidden_size: int, ffn_hidden_size: int,
                 device=None, dtype=None, etp: GroupHandle | None = None):
        super().__init__()
        self.num_local_experts, self.first_expert = num_local_experts, first_expert
        self.wgrad_groups: ExpertWgradGroups | None = None  # train.expert_wgrad_micro_batches (MixtralModel sets it)
        self.expert_tp = etp if etp is not None and etp.size > 1 else None
        self.fp8 = None  # train.fp8_recipe (MixtralModel.use_fp8 sets it)
        rank, size, ranks = (etp.rank, etp.size, tuple(etp.ranks)) if etp is not None else (0, 1, ())
        local_ffn = ffn_hidden_size // size
        self.w13 = make_param((num_local_experts, hidden_size, 2 * local_ffn), NORMAL, device, dtype,
                              first_expert=first_expert, tp=TPShard(1, rank, size, ranks, stack=2))
        self.w2 = make_param((num_local_experts, local_ffn, hidden_size), SCALED_NORMAL, device, dtype,
                             first_expert=first_expert, tp=TPShard(0, rank, size, ranks))
        mark_own_grad(self.w13, self.w2)

    @property
    def fp8(self) -> Fp8 | None:
        return self._fp8

    @fp8.setter
    def fp8(self, fp8: Fp8 | None) -> None:
        """The recipe, with the expert-TP group the split GEMMs share their scales over (Fp8.expert_tp)."""
        self._fp8 = fp8 if fp8 is None or self.expert_tp is None else dataclasses.replace(fp8, expert_tp=self.expert_tp)

    def fp8_handoff(self) -> Fp8Handoff | None:
        """A handoff for the permutation around these experts (every row mapped), where their rowwise FP8 GEMMs
        would quantize its rows: fc1's forward, fc2's input gradient. Rowwise only: a per-tile form for blockwise
        ran no faster than quantize_tiles after the permutation on the fine shape (unpermute_backward 0.305 against
        0.216 ms; step_kernels_fp8_tiles_handoff_1xh200.json) and was removed."""
        if self.fp8 is None or self.fp8.recipe != "rowwise":
            return None
        fc1, fc2 = _fed_fp8(self.fp8, self.w13), _fed_fp8(self.fp8, self.w2)
        return Fp8Handoff(fc1, fc2) if fc1 or fc2 else None

    def forward(self, x_TH: torch.Tensor, offsets_E: torch.Tensor, handoff: Fp8Handoff | None = None) -> torch.Tensor:
        return GroupedSwiGLU.apply(x_TH, offsets_E, self.w13, self.w2, self.wgrad_groups, self.fp8, handoff)
