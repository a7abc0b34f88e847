"""The router under sequence or context parallelism: every rank routes the whole micro-batch, dispatches its own
tokens.

A TP rank holds one sequence block of every sequence (sequence parallelism); a CP rank its local sequence, two
chunks of every sequence (distributed/context_parallel.py); under both, its TP block of that. Routing choices are
per token, but the auxiliary losses, capacity and the per-sequence statistics are over the micro-batch, so each
rank gathers the micro-batch's router logits (tokens x experts: small), routes all of it in the single-process
token order exactly as the reference does, and keeps its own tokens' choices. The repeated part's gradient is
not summed over the ranks (GatherReplicated over TP, GatherSequence over CP); the router weight's gradient, from
each rank's own tokens, is (a sequence-parallel parameter over TP; over CP every parameter's gradient is summed).
``tokens_per_expert_E`` counts this rank's copies: the trainer sums them over the TP and CP groups.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_overlap.config import ModelConfig
from moe_overlap.distributed.context_parallel import CPComm, GatherSequence, local_rows
from moe_overlap.distributed.ring import TPComm
from moe_overlap.layers.router import Router, Routing
from moe_overlap.layers.tp_linear import GatherReplicated, batch_major, local_of_batch_major


class SequenceParallelRouter(Router):
    comm: TPComm
    cp: CPComm

    @classmethod
    def from_config(cls, cfg: ModelConfig, device=None, dtype=None, *, comm: TPComm,
                    cp: CPComm | None = None) -> "SequenceParallelRouter":
        router = super().from_config(cfg, device, dtype)
        router.comm, router.cp = comm, cp or CPComm.single()
        return router

    def forward(self, x_TH: torch.Tensor) -> Routing:
        """``x_TH``: this rank's rows, (batch, sequence block) flattened."""
        block = self.seq_length // (self.comm.sequence_shards * self.cp.size)
        if x_TH.shape[0] % block:
            raise ValueError(f"sequence-parallel routing: {x_TH.shape[0]} rows are not whole sequence blocks of "
                             f"seq_length / (TP x CP) = {block}")
        batch = x_TH.shape[0] // block

        def whole(local_logits: torch.Tensor | None) -> torch.Tensor | None:  # the micro-batch's, in token order
            if local_logits is None:
                return None
            gathered = batch_major(GatherReplicated.apply(local_logits, self.comm), batch, self.comm)
            return GatherSequence.apply(gathered, batch, self.cp)

        full = self.route(whole(self.logits(x_TH)), whole(self.loss_logits(x_TH)))
        mine = {name: None if value is None else local_of_batch_major(local_rows(value, batch, self.cp), batch,
                                                                      self.comm)
                for name, value in (("probs_TK", full.probs_TK), ("experts_TK", full.experts_TK),
                                    ("keep_TK", full.keep_TK))}
        sent_E = mine["experts_TK"] if mine["keep_TK"] is None else mine["experts_TK"][mine["keep_TK"]]
        return dataclasses.replace(full, **mine,
                                   tokens_per_expert_E=torch.bincount(sent_E.flatten(), minlength=self.num_experts))
