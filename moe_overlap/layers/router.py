"""Top-k token router in fp32: softmax scores, the switch-style load-balancing loss and the z-loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.layers.init import NORMAL, make_param


@dataclass
class Routing:
    probs_TK: torch.Tensor  # fp32 routing weights of the k chosen experts per token
    experts_TK: torch.Tensor  # int64 global expert indices
    tokens_per_expert_E: torch.Tensor  # int64 copies routed to each global expert
    aux_loss: torch.Tensor  # fp32 scalar, already scaled by its coefficient (0 when off)
    z_loss: torch.Tensor  # fp32 scalar, already scaled by its coefficient (0 when off)


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, topk: int, pre_softmax: bool, load_balancing_type: str,
                 aux_loss_coeff: float, z_loss_coeff: float, device=None, dtype=None):
        super().__init__()
        self.num_experts, self.topk, self.pre_softmax = num_experts, topk, pre_softmax
        self.aux_loss_coeff = aux_loss_coeff if load_balancing_type == "aux_loss" else 0.0
        self.z_loss_coeff = z_loss_coeff
        self.weight = make_param((num_experts, hidden_size), NORMAL, device, dtype)

    def forward(self, x_TH: torch.Tensor) -> Routing:
        logits_TE = F.linear(x_TH.float(), self.weight.float())
        if self.pre_softmax:
            probs_TK, experts_TK = torch.topk(torch.softmax(logits_TE, dim=-1), self.topk, dim=-1)
        else:  # Mixtral: the k largest logits, renormalised by a softmax over just those
            top_logits_TK, experts_TK = torch.topk(logits_TE, self.topk, dim=-1)
            probs_TK = torch.softmax(top_logits_TK, dim=-1)
        tokens_per_expert_E = torch.bincount(experts_TK.flatten(), minlength=self.num_experts)
        zero = logits_TE.new_zeros(())
        aux_loss = self._aux_loss(logits_TE, tokens_per_expert_E) if self.aux_loss_coeff > 0 else zero
        z_loss = self.z_loss_coeff * torch.logsumexp(logits_TE, dim=-1).square().mean() if self.z_loss_coeff > 0 else zero
        return Routing(probs_TK, experts_TK, tokens_per_expert_E, aux_loss, z_loss)

    def _aux_loss(self, logits_TE: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Switch-Transformer balance loss, as Megatron: E * sum_e(mean prob_e * fraction of copies to e)."""
        num_tokens = logits_TE.shape[0]
        mean_prob_E = torch.softmax(logits_TE, dim=-1).mean(dim=0)
        fraction_E = tokens_per_expert_E.float() / (num_tokens * self.topk)
        return self.aux_loss_coeff * self.num_experts * (mean_prob_E * fraction_E).sum()
