"""What a step's expert loads say: how unevenly the EP ranks were loaded (pooled over the step, and per
micro-batch, whose exchange waits for its own most loaded rank) and which experts received no token."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def imbalance(counts_E: list[int], groups: int) -> float:
    """How uneven a step's routing was: the copies on the most loaded of ``groups`` equal runs of experts over
    the mean (EP ranks: each holds one run; ``groups`` = experts: per expert). 1.0 is perfect balance; an
    exchange waits for the most loaded rank. ``micro_batch_imbalance`` of one micro-batch holding them all."""
    return float(micro_batch_imbalance(torch.tensor(counts_E, dtype=torch.float64).view(1, 1, -1), groups)[0])


def micro_batch_imbalance(counts_LME: torch.Tensor, ranks: int) -> torch.Tensor:
    """Per MoE layer, (mean, max) over micro-batches of the copies on the most loaded of ``ranks`` equal runs of
    experts over the mean, flattened, fp64. Each micro-batch's exchange waits for its own most loaded rank, so this
    is the wait a step sees; ``imbalance`` of the step's pooled counts hides it (two micro-batches skewed opposite
    ways pool to 1.0). A micro-batch with no copies counts as 1.0."""
    loads_LMR = counts_LME.unflatten(-1, (ranks, -1)).sum(-1).double()
    mean_LM = loads_LMR.mean(-1)
    ratio_LM = torch.where(mean_LM > 0, loads_LMR.amax(-1) / mean_LM.clamp_min(1e-9), torch.ones_like(mean_LM))
    return torch.stack([ratio_LM.mean(-1), ratio_LM.amax(-1)], dim=-1).flatten()


# Consecutive steps without a token after which an expert is reported dead: long enough that a few unlucky
# micro-batches do not trip it, short enough to be seen early in a run.
DEAD_EXPERT_STEPS = 20


class DeadExperts:
    """Experts that received no token in a step (after capacity drops): counted every step, and a warning once per
    (layer, expert) that has received nothing for DEAD_EXPERT_STEPS consecutive steps: its router has collapsed
    onto the other experts. The counts are the same on every rank; ``warn``: this rank logs."""

    def __init__(self, warn: bool):
        self.warn = warn
        self.idle_steps: dict[str, list[int]] = {}  # per MoE layer: each expert's steps without a token, so far
        self.warned: set[tuple[str, int]] = set()

    def update(self, step: int, tokens_per_expert: dict[str, list[int]]) -> int:
        """This step's experts without a token, summed over the MoE layers."""
        dead = 0
        for layer, counts_E in tokens_per_expert.items():
            idle_E = self.idle_steps.setdefault(layer, [0] * len(counts_E))
            for expert, count in enumerate(counts_E):
                idle_E[expert] = idle_E[expert] + 1 if count == 0 else 0
                dead += count == 0
                if idle_E[expert] >= DEAD_EXPERT_STEPS and (layer, expert) not in self.warned:
                    self.warned.add((layer, expert))
                    if self.warn:
                        log.warning("MoE layer %s, expert %d: no token for %d consecutive steps (steps %d-%d): its "
                                    "router has collapsed onto the other experts (balance routing with "
                                    "model.moe_router_enable_expert_bias or model.moe_aux_loss_coeff)", layer, expert,
                                    idle_E[expert], step - idle_E[expert] + 1, step)
        return dead
