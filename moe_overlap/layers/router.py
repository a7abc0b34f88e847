"""Top-k token router, Megatron-Core semantics, computed in fp32 (or wider, for float64 gradient checks).

Scores: softmax (Mixtral: softmax over the k largest logits; ``pre_softmax``: softmax over all experts, then
top-k) or sigmoid (weights = the chosen scores, normalised to sum 1 when k > 1). Optional group-limited
top-k: experts form ``num_groups`` contiguous groups, each scored by the sum of its top ``topk // group_topk``
scores; only the best ``group_topk`` groups stay eligible. Optional expert bias (aux-loss-free balancing,
sigmoid only): added to the scores for selection only, never to the weights; :meth:`Router.update_load` moves
it after each optimizer step.

Forced load balancing (``force_load_balancing``, for benchmarks, as torchtitan's debug switch): the experts are
assigned, not chosen: copy j of token t (its row in this micro-batch) goes to expert order[(t + j) mod E] of a
fixed shuffled order of the experts (one of 16, changing every E tokens: kernels/router.forced_experts), so every
expert receives exactly T*k/E copies when E divides T, and a token's copies spread over the EP ranks as a random
top-k's do. (torchtitan's round-robin, (t*k + j) mod E, keeps a fine-grained model's token on one rank, so an
exchange that sends a token once per rank would move about a quarter of what learned routing makes it move at
EP=4.) The weights are the scores at those experts, normalised as the score function normalises chosen ones;
group limits and the expert bias then select nothing. Every layout routes a micro-batch whole, in the
single-process token order (under sequence and context parallelism the gathered micro-batch:
layers/sp_router.py), so the assignment is the same on every layout.

Auxiliary losses follow Megatron: they use the normalised scores of every expert and the load of a plain
top-k over them (no bias, no group limit, no capacity), so they measure what the router prefers; under forced
balancing, the load of the assigned experts.
  aux_loss         E * sum_e(mean score_e * fraction of copies to e) over this micro-batch's tokens.
  seq_aux_loss     the same per sequence (consecutive runs of ``seq_length`` tokens), averaged over sequences.
  global_aux_loss  the load fractions are those of the previous optimizer step's whole global batch (every
                   micro-batch of every data-parallel rank; zero before the first step, so no loss then).
                   Megatron sums counts over the micro-batches run so far, which depends on which rank runs
                   which micro-batch; the previous step's load is known identically by every layout and costs
                   no extra communication (the trainer reduces the counts anyway).
Capacity (``capacity_factor``, per micro-batch, Megatron's token drop): each expert takes at most
C = ceil(tokens * topk / num_experts * capacity_factor) copies; ``drop_policy`` "probs" keeps the C
highest-weight copies, "position" the earliest tokens (ties go to the earlier copy). Dropped copies keep
their expert index, get weight 0 and are not counted in ``tokens_per_expert_E``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.config import ModelConfig
from moe_overlap.kernels.router import forced_expert_orders, forced_experts, topk_route
from moe_overlap.layers.init import NORMAL, make_param
from moe_overlap.layers.param_info import param_info


@dataclass
class Routing:
    probs_TK: torch.Tensor  # fp32 routing weights of the k chosen experts per token; 0 for dropped copies
    experts_TK: torch.Tensor  # int64 global expert indices (dropped copies keep theirs)
    tokens_per_expert_E: torch.Tensor  # int64 copies actually sent to each global expert
    aux_loss: torch.Tensor  # fp32 scalar, already scaled by its coefficient (0 when off)
    z_loss: torch.Tensor  # fp32 scalar, already scaled by its coefficient (0 when off)
    keep_TK: Optional[torch.Tensor] = None  # bool, False for copies over capacity; None when dropless
    capacity: Optional[int] = None  # copies each expert takes from this micro-batch; None when dropless

    def tokens(self, start: int, stop: int) -> Routing:
        """The routing of tokens [start, stop) of this one (a token slice, overlap.moe_token_slices): their copies,
        counted per expert; no auxiliary losses (they are the whole micro-batch's, this routing's)."""
        experts_TK = self.experts_TK[start:stop]
        keep_TK = None if self.keep_TK is None else self.keep_TK[start:stop]
        zero = self.aux_loss.new_zeros(())
        return Routing(self.probs_TK[start:stop], experts_TK,
                       count_copies(experts_TK, keep_TK, self.tokens_per_expert_E.numel()), zero, zero, keep_TK,
                       self.capacity)


def count_copies(experts_TK: torch.Tensor, keep_TK: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """Copies per expert (kept ones only). A scatter-add, not bincount or a boolean mask: both would sync with the
    host on CUDA, and the layer allows itself one sync at most."""
    ones = torch.ones_like(experts_TK, dtype=torch.int64) if keep_TK is None else keep_TK.to(torch.int64)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=experts_TK.device)
    return counts_E.scatter_add_(0, experts_TK.flatten(), ones.flatten())


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 matrices summed and returned in fp32: on CUDA the tensor cores' GEMM with an fp32 output, on
    the CPU its twin in fp32 (a bf16 product is exact in fp32, so both are the fp32 GEMM's sums, in their order)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def bf16_parts(x: torch.Tensor) -> torch.Tensor:
    """An fp32 x (rows, cols) as three bf16 parts side by side (rows, 3 * cols): hi + mid + lo hold its 24 bits, so a
    GEMM over them is the fp32 GEMM's exact products."""
    hi = x.to(torch.bfloat16)
    rest = x - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.cat([hi, mid, (rest - mid.float()).to(torch.bfloat16)], dim=1)


class Bf16Logits(torch.autograd.Function):
    """The fp32 router logits of bf16 tokens and weight, x_TH @ w_EH^T, on the tensor cores: every product is exact
    in fp32 and summed in fp32, as the fp32 GEMM of the tokens and weight cast up (Megatron's fp32 router) computes
    them, but for the order of the sums (the fp32 GEMMs ran on the CUDA cores: 13 ms of the fine bench model's step
    on an H200). The backward splits the logits' fp32 gradient into three bf16 parts (:func:`bf16_parts`), so both
    gradients are again exact products summed in fp32, rounded once to the inputs' dtype."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TH, w_EH)
        return mm_fp32(x_TH, w_EH.t())

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_TH, w_EH = ctx.saved_tensors
        E = w_EH.shape[0]
        grad_T3E = bf16_parts(grad_TE.float())
        grad_x = mm_fp32(grad_T3E, w_EH.repeat(3, 1)).to(x_TH.dtype) if ctx.needs_input_grad[0] else None
        grad_w = mm_fp32(grad_T3E.t(), x_TH).view(3, E, -1).sum(0).to(w_EH.dtype)
        return grad_x, grad_w


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, topk: int, pre_softmax: bool, load_balancing_type: str,
                 aux_loss_coeff: float, z_loss_coeff: float, device=None, dtype=None, *,
                 score_function: str = "softmax", num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                 enable_expert_bias: bool = False, bias_update_rate: float = 1e-3,
                 capacity_factor: Optional[float] = None, drop_policy: str = "probs",
                 seq_length: Optional[int] = None, force_load_balancing: bool = False, lr_scale: float = 1.0,
                 loss_detach_input: bool = False):
        super().__init__()
        self.num_experts, self.topk, self.pre_softmax = num_experts, topk, pre_softmax
        self.force_load_balancing = force_load_balancing
        self.score_function, self.num_groups, self.group_topk = score_function, num_groups, group_topk
        self.capacity_factor, self.drop_policy, self.bias_update_rate = capacity_factor, drop_policy, bias_update_rate
        self.load_balancing_type, self.seq_length = load_balancing_type, seq_length
        self.aux_loss_coeff = aux_loss_coeff if load_balancing_type != "none" else 0.0
        self.z_loss_coeff = z_loss_coeff
        self.loss_detach_input = loss_detach_input  # the losses' logits from detached tokens: see loss_logits
        self.weight = make_param((num_experts, hidden_size), NORMAL, device, dtype)
        param_info(self.weight).lr_scale = lr_scale  # the optimizers read it
        # Buffers, not parameters: the optimizer never sees them; the trainer checkpoints them by logical name.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
                             if enable_expert_bias else None)
        self.register_buffer("previous_step_load", torch.zeros(num_experts, dtype=torch.float32, device=device)
                             if load_balancing_type == "global_aux_loss" and self.aux_loss_coeff > 0 else None)
        # Not persistent: the same table every run (no checkpoint needs it), on the device before any graph capture.
        self.register_buffer("forced_orders_ME", forced_expert_orders(num_experts, device)
                             if force_load_balancing else None, persistent=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig, device=None, dtype=None) -> "Router":
        return cls(cfg.hidden_size, cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_router_pre_softmax,
                   cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff, device, dtype,
                   score_function=cfg.moe_router_score_function, num_groups=cfg.moe_router_num_groups,
                   group_topk=cfg.moe_router_group_topk, enable_expert_bias=cfg.moe_router_enable_expert_bias,
                   bias_update_rate=cfg.moe_router_bias_update_rate, capacity_factor=cfg.moe_expert_capacity_factor,
                   drop_policy=cfg.moe_token_drop_policy, seq_length=cfg.seq_length,
                   force_load_balancing=cfg.moe_router_force_load_balancing, lr_scale=cfg.moe_router_lr_scale,
                   loss_detach_input=cfg.moe_router_loss_detach_input)

    def forward(self, x_TH: torch.Tensor, experts_TK: torch.Tensor | None = None) -> Routing:
        """Route the tokens of one micro-batch; ``x_TH`` is (batch, seq) flattened sequence-major. ``experts_TK``:
        each token's experts chosen elsewhere (a routing replay: layers/routing_replay.py), weighted as forced
        balancing weights its assigned ones."""
        return self.route(self.logits(x_TH), self.loss_logits(x_TH), experts_TK)

    def loss_logits(self, x_TH: torch.Tensor) -> torch.Tensor | None:
        """model.moe_router_loss_detach_input: the logits the auxiliary and z losses see, of the tokens detached, so
        that their gradients reach this router's weight only (the same values as :meth:`logits`: a second GEMM of
        the tokens by the experts' few rows); else None (the losses see the routing's own logits)."""
        return self.logits(x_TH.detach()) if self.loss_detach_input else None

    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        if x_TH.dtype == self.weight.dtype == torch.bfloat16:
            return Bf16Logits.apply(x_TH, self.weight)
        compute_dtype = torch.promote_types(self.weight.dtype, torch.float32)
        return F.linear(x_TH.to(compute_dtype), self.weight.to(compute_dtype))

    def route(self, logits_TE: torch.Tensor, loss_logits_TE: torch.Tensor | None = None,
              experts_TK: torch.Tensor | None = None) -> Routing:
        """Routing from the logits of one micro-batch's tokens (a separate step so that, under sequence
        parallelism, the logits of the whole micro-batch can be gathered first: layers/sp_router.py); the auxiliary
        and z losses from ``loss_logits_TE`` where given (:meth:`loss_logits`); ``experts_TK``: assigned (forward)."""
        assigned = experts_TK is not None or self.force_load_balancing
        probs_TK, experts_TK, copies_E = self._choose(logits_TE, experts_TK)
        keep_TK = capacity = None
        if self.capacity_factor is not None:
            capacity = math.ceil(logits_TE.shape[0] * self.topk / self.num_experts * self.capacity_factor)
            keep_TK = self._within_capacity(probs_TK, experts_TK, capacity)
            probs_TK = probs_TK * keep_TK
        if keep_TK is None and copies_E is not None:
            tokens_per_expert_E = copies_E
        else:
            tokens_per_expert_E = count_copies(experts_TK, keep_TK, self.num_experts)
        zero = logits_TE.new_zeros(())
        if loss_logits_TE is None:
            loss_logits_TE = logits_TE
        aux_loss = (self._aux_loss(loss_logits_TE, experts_TK if assigned else None)
                    if self.aux_loss_coeff > 0 else zero)
        z_loss = (self.z_loss_coeff * torch.logsumexp(loss_logits_TE, dim=-1).square().mean()
                  if self.z_loss_coeff > 0 else zero)
        return Routing(probs_TK, experts_TK, tokens_per_expert_E, aux_loss, z_loss, keep_TK, capacity)

    @torch.no_grad()
    def update_load(self, tokens_per_expert_E: torch.Tensor, applied: torch.Tensor | None = None) -> None:
        """After an optimizer step, with the step's copies per expert summed over every micro-batch and the
        whole data-parallel group (so identical on every rank): nudge the expert bias towards the mean load
        (DeepSeek's aux-loss-free balancing) and keep the load fractions for global_aux_loss. ``applied`` (a
        device flag): 0 when the optimizer skipped the step (a non-finite gradient), which then changes nothing
        here either; decided on the device, so no host sync."""
        load_E = tokens_per_expert_E.to(torch.float32)
        keep = None if applied is None else applied.to(torch.bool)
        if self.expert_bias is not None:
            step_E = self.bias_update_rate * torch.sign(load_E.mean() - load_E)
            self.expert_bias += step_E if keep is None else torch.where(keep, step_E, 0.0)
        if self.previous_step_load is not None:
            fractions_E = load_E / load_E.sum().clamp_min(1.0)
            self.previous_step_load.copy_(fractions_E if keep is None else
                                          torch.where(keep, fractions_E, self.previous_step_load))

    # ------------------------------------------------------------------------------------------ internals
    def _choose(self, logits_TE: torch.Tensor, experts_TK: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Routing weights and global expert indices of each token's k experts (``experts_TK`` where given), and the
        copies per expert (None: counted later). The softmax router without groups chooses in one kernel
        (kernels/router.py)."""
        if experts_TK is None and self.score_function == "softmax" and self.num_groups is None:
            return topk_route(logits_TE, self.topk, self.pre_softmax, self.forced_orders_ME)
        # What the experts are chosen by; Mixtral's: the logits, the k largest renormalised by a softmax over them.
        if self.score_function == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
        else:
            scores_TE = torch.softmax(logits_TE, dim=-1) if self.pre_softmax else logits_TE
        if experts_TK is None and self.force_load_balancing:
            experts_TK = forced_experts(logits_TE.shape[0], self.topk, self.forced_orders_ME)
        elif experts_TK is None:
            experts_TK = self._top_k(scores_TE if self.expert_bias is None else scores_TE + self.expert_bias)
        probs_TK = scores_TE.gather(1, experts_TK)
        if self.score_function == "sigmoid" and self.topk > 1:
            probs_TK = probs_TK / (probs_TK.sum(-1, keepdim=True) + 1e-20)
        elif self.score_function == "softmax" and not self.pre_softmax:
            probs_TK = torch.softmax(probs_TK, dim=-1)
        return probs_TK, experts_TK, None

    def _top_k(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """Indices of the k best experts; with groups, only among each token's best ``group_topk`` groups."""
        scores_TE = scores_TE.detach()
        if self.num_groups is not None:
            scores_TGX = scores_TE.view(scores_TE.shape[0], self.num_groups, -1)
            group_scores_TG = scores_TGX.topk(self.topk // self.group_topk, dim=-1).values.sum(-1)
            best_groups_TJ = group_scores_TG.topk(self.group_topk, dim=-1).indices
            eligible_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, best_groups_TJ, True)
            scores_TE = scores_TGX.masked_fill(~eligible_TG.unsqueeze(-1), float("-inf")).flatten(1)
        return scores_TE.topk(self.topk, dim=-1).indices

    def _within_capacity(self, probs_TK: torch.Tensor, experts_TK: torch.Tensor, capacity: int) -> torch.Tensor:
        """Which copies fit their expert's capacity: rank the copies of each expert by the drop policy."""
        experts_C = experts_TK.flatten()
        if self.drop_policy == "probs":  # highest weight first; a stable sort gives ties to the earlier copy
            priority_C = torch.argsort(probs_TK.detach().flatten(), descending=True, stable=True)
        else:  # "position": earliest token first (a token holds at most one copy per expert)
            priority_C = torch.arange(experts_C.numel(), device=experts_C.device)
        order_C = priority_C[torch.argsort(experts_C[priority_C], stable=True)]  # by expert, priority within
        copies_E = count_copies(experts_C, None, self.num_experts)
        first_slot_E = torch.cumsum(copies_E, 0) - copies_E
        slot_C = torch.arange(order_C.numel(), device=order_C.device) - first_slot_E[experts_C[order_C]]
        keep_C = torch.empty_like(experts_C, dtype=torch.bool)
        keep_C[order_C] = slot_C < capacity
        return keep_C.view_as(experts_TK)

    def _aux_loss(self, logits_TE: torch.Tensor, assigned_TK: torch.Tensor | None) -> torch.Tensor:
        """Switch-Transformer balance loss in Megatron's form: E * sum_e(mean score_e * load fraction_e); the load
        of a plain top-k, or of ``assigned_TK`` (forced balancing)."""
        if self.score_function == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
            scores_TE = scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)
        else:
            scores_TE = torch.softmax(logits_TE, dim=-1)
        if self.load_balancing_type == "global_aux_loss":
            return self.aux_loss_coeff * self.num_experts * (scores_TE.mean(0) * self.previous_step_load).sum()
        num_tokens = scores_TE.shape[0]
        if self.load_balancing_type == "seq_aux_loss":
            if self.seq_length is None or num_tokens % self.seq_length:
                raise ValueError(f"seq_aux_loss: {num_tokens} tokens are not whole sequences of "
                                 f"seq_length={self.seq_length}")
            num_sequences = num_tokens // self.seq_length
        else:
            num_sequences = 1
        if assigned_TK is None:
            assigned_TK = scores_TE.detach().topk(self.topk, dim=-1).indices
        chosen_TE = torch.zeros_like(scores_TE).scatter_(1, assigned_TK, 1.0)
        scores_BSE = scores_TE.view(num_sequences, -1, self.num_experts)
        fraction_BE = chosen_TE.view_as(scores_BSE).mean(1) / self.topk
        return self.aux_loss_coeff * self.num_experts * (scores_BSE.mean(1) * fraction_BE).sum(-1).mean()
