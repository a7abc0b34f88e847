"""Routing replay: a run that routes every token as an earlier run of the same batches did (Megatron-Core's router
replay), for a benchmark's reference. ``benchmarks/train_step.py``'s compute_only row replays its config row's
routing: the reference never computes the MoE outputs that later layers route on, so on real text it would route
otherwise and wait for another most loaded rank than the run it is the limit of (2xH200, 2026-11-30: the Mixtral-like
bench model's second layer at 1.03x the mean rank load against the config row's 1.92x).

``RoutingReplay()`` records each MoE layer's chosen experts per (step, micro-batch, layer) as a run trains;
``RoutingReplay(recorded)`` makes a later run with the same steps and micro-batches choose them. Its routing weights
are its own scores at those experts, normalised as the score function normalises chosen ones (forced balancing's
rule), so its losses are its own. A layer routes through a slot: a (tokens, top-k) tensor per graphed copy of the
layer (capture_moe_layers), which its router reads (replay) or writes (record) inside the copy's graph, and which the
host fills before or reads after each training call, on the micro-batch's stream (MoELayer.routing_slot). Not under
sequence or context parallelism (the router gathers the micro-batch's logits first) nor with full recomputation (a
recomputed forward would route from a slot a later micro-batch may have refilled)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from moe_overlap.config import Config
from moe_overlap.kernels.router import forced_expert_orders, forced_experts
from moe_overlap.layers.router import Router, Routing

Key = tuple[int, int, int]  # (step, micro-batch, layer)


def replay_refusal(cfg: Config) -> str | None:
    """Why ``cfg``'s run cannot record or replay its routing; None where it can."""
    p = cfg.parallel
    if p.sequence_parallel and p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1:
        return "routing replay: not implemented under sequence or context parallelism (the router gathers logits)"
    if cfg.train.recompute_granularity == "full":
        return "routing replay: not implemented with train.recompute_granularity='full'"
    return None


class RoutingReplay:
    def __init__(self, recorded: dict[Key, torch.Tensor] | None = None):
        self.replaying = recorded is not None
        self.recorded: dict[Key, torch.Tensor] = {} if recorded is None else recorded  # int16 (tokens, top-k)
        self.slots: dict[int, tuple[torch.Tensor, ...]] = {}  # by layer: one per graphed copy
        self.step = 0  # the trainer's, set as each step starts

    def attach(self, router: Router, layer: int, tokens: int, copies: int) -> None:
        """``layer``'s slots, one per graphed copy, first holding forced balancing's assignment (what a graph's
        warm-up calls route by before any step fills them)."""
        experts_TK = forced_experts(tokens, router.topk, forced_expert_orders(router.num_experts,
                                                                               router.weight.device))
        self.slots[layer] = tuple(experts_TK.clone() for _ in range(copies))

    def route(self, router: Router, x_TH: torch.Tensor, layer: int, copy: int) -> Routing:
        """A training call's routing through its copy's slot: the slot's experts (a clone: the backward reads them
        after the slot is refilled), or the router's choice kept in the slot."""
        slot_TK = self.slots[layer][copy]
        if self.replaying:
            return router(x_TH, slot_TK.clone())
        routing = router(x_TH)
        slot_TK.copy_(routing.experts_TK)
        return routing

    @contextlib.contextmanager
    def around(self, micro_batch: int, layer: int, copy: int) -> Iterator[None]:
        """Around a training call that routes ``micro_batch`` through ``copy``'s slot, on its stream: the recorded
        experts filled before (replay), or the choice kept after (record; a step run again records over its first
        attempt)."""
        key, slot_TK = (self.step, micro_batch, layer), self.slots[layer][copy]
        if self.replaying:
            if key not in self.recorded:
                raise KeyError(f"routing replay: nothing recorded for step {key[0]}, micro-batch {key[1]}, layer "
                               f"{key[2]} (the recorded run had other steps or micro-batches)")
            slot_TK.copy_(self.recorded[key])
        yield
        if not self.replaying:
            self.recorded[key] = slot_TK.to(torch.int16)
