"""The MoE block: router -> permute -> dispatch -> grouped experts -> combine -> unpermute (serial path)."""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.config import ModelConfig
from moe_overlap.distributed.collectives import AllToAllRows
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.layers.dispatcher import GatherRows, WeightedUnpermute, plan_dispatch
from moe_overlap.layers.experts import GroupedExperts
from moe_overlap.layers.router import Router


class MoELayer(nn.Module):
    """Dropless top-k MoE over the expert-parallel group ``ep``; rank r holds experts [r*E/EP, (r+1)*E/EP)."""

    def __init__(self, cfg: ModelConfig, ep: GroupHandle, device=None, dtype=None):
        super().__init__()
        self.ep = ep
        num_experts = cfg.num_moe_experts
        local_experts = num_experts // ep.size
        self.router = Router(cfg.hidden_size, num_experts, cfg.moe_router_topk, cfg.moe_router_pre_softmax,
                             cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff,
                             device, dtype)
        self.experts = GroupedExperts(local_experts, ep.rank * local_experts, cfg.hidden_size,
                                      cfg.expert_ffn_hidden_size, device, dtype)

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the output, the auxiliary losses (load balancing + z, already scaled) and the copies
        routed to each global expert (for metrics; an output, so recomputation does not count twice)."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        routing = self.router(x_TH)
        plan = plan_dispatch(routing.experts_TK, routing.tokens_per_expert_E, self.ep.size, self.ep.group)
        permuted_RH = GatherRows.apply(x_TH, plan.token_of_row)
        received_RH = AllToAllRows.apply(permuted_RH, plan.output_splits, plan.input_splits, self.ep.group)
        grouped_RH = GatherRows.apply(received_RH, plan.regroup_index)
        expert_out_RH = self.experts(grouped_RH, plan.offsets)
        ungrouped_RH = GatherRows.apply(expert_out_RH, plan.ungroup_index)
        combined_RH = AllToAllRows.apply(ungrouped_RH, plan.input_splits, plan.output_splits, self.ep.group)
        out_TH = WeightedUnpermute.apply(combined_RH, routing.probs_TK, plan.copy_of_row)
        return out_TH.view_as(x_BSH), routing.aux_loss + routing.z_loss, routing.tokens_per_expert_E
