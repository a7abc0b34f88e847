"""The serial EP MoE layer against a naive dense formula, including skewed routing, on 1, 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_overlap.config import ModelConfig
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.layers.experts import GroupedSwiGLU, expert_offsets, grouped_swiglu_reference
from moe_overlap.layers.moe import MoELayer
from moe_overlap.layers.router import Routing

H, F, E, TOKENS = 16, 24, 8, 12


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def test_grouped_swiglu_matches_loop_twin_forward_and_backward():
    torch.manual_seed(0)
    rows = [3, 0, 5, 2]  # an expert with no rows too
    x = torch.randn(sum(rows), H, requires_grad=True)
    w13 = torch.randn(len(rows), H, 2 * F, requires_grad=True)
    w2 = torch.randn(len(rows), F, H, requires_grad=True)
    out = GroupedSwiGLU.apply(x, expert_offsets(torch.tensor(rows)), w13, w2)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w13, w2), grad)
    ref = grouped_swiglu_reference(x, rows, w13, w2)
    ref_grads = torch.autograd.grad(ref, (x, w13, w2), grad)
    assert rel_err(out, ref) < 1e-6
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-6
    assert grads[1][1].abs().max() == 0 and grads[2][1].abs().max() == 0  # the empty expert gets no gradient


def test_grouped_swiglu_with_no_rows_at_all():
    w13 = torch.randn(2, H, 2 * F, requires_grad=True)
    w2 = torch.randn(2, F, H, requires_grad=True)
    x = torch.zeros(0, H, requires_grad=True)
    out = GroupedSwiGLU.apply(x, expert_offsets(torch.zeros(2, dtype=torch.long)), w13, w2)
    out.sum().backward()
    assert out.shape == (0, H) and w13.grad.abs().max() == 0 and w2.grad.abs().max() == 0


# ------------------------------------------------------------------------------------------ helpers


def full_expert_weights(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, H, 2 * F, generator=g) * 0.3, torch.randn(E, F, H, generator=g) * 0.3


def naive_moe(x_TH, probs_TK, experts_TK, w13, w2):
    """Every expert on every token, then pick: the obviously-right formula."""
    h = torch.einsum("th,ehf->etf", x_TH, w13)
    gate, up = h.chunk(2, dim=-1)
    y_ETH = torch.einsum("etf,efh->eth", torch.nn.functional.silu(gate) * up, w2)
    picked = y_ETH[experts_TK, torch.arange(x_TH.shape[0]).unsqueeze(1)]  # (T, K, H)
    return (probs_TK.unsqueeze(-1) * picked).sum(1)


class FixedRouter(torch.nn.Module):
    """Stands in for the router so a test can dictate where every token goes."""

    def __init__(self, probs_TK: torch.Tensor, experts_TK: torch.Tensor):
        super().__init__()
        self.probs_TK, self.experts_TK = probs_TK, experts_TK

    def forward(self, x_TH):
        counts = torch.bincount(self.experts_TK.flatten(), minlength=E)
        zero = torch.zeros(())
        return Routing(self.probs_TK, self.experts_TK, counts, zero, zero)


def rank_inputs(rank: int, routing: str, topk: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g)
    upstream = torch.randn(TOKENS, H, generator=g)
    probs = torch.softmax(torch.randn(TOKENS, topk, generator=g), -1)
    if routing == "random":
        experts = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(TOKENS)])
    elif routing == "first_rank_only":  # experts 0..k-1: every other rank and expert receives nothing
        experts = torch.arange(topk).repeat(TOKENS, 1)
    elif routing == "last_rank_only":
        experts = (E - 1 - torch.arange(topk)).repeat(TOKENS, 1)
    elif routing == "sparse":  # some tokens' copies all on one expert, experts 2 and 5 idle
        experts = torch.stack([torch.tensor([0, 7][: topk]) if t % 2 else torch.tensor([3, 4][: topk])
                               for t in range(TOKENS)])
    else:
        raise ValueError(routing)
    if rank == 1 and routing == "random":
        x, upstream, probs, experts = x[:0], upstream[:0], probs[:0], experts[:0]  # a rank with no tokens
    return x, upstream, probs, experts


def moe_case(routing: str, topk: int) -> float:
    """Runs on every rank of the pool: the EP layer's output and gradients against the naive formula."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = Mesh.create(MeshLayout(world, ep=world), timeout_s=60) if world > 1 else Mesh.single()
    try:
        cfg = ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=topk)
        layer = MoELayer(cfg, mesh.ep)
        w13, w2 = full_expert_weights()
        local = slice(layer.experts.first_expert, layer.experts.first_expert + layer.experts.num_local_experts)
        with torch.no_grad():
            layer.experts.w13.copy_(w13[local])
            layer.experts.w2.copy_(w2[local])
        x, upstream, probs, experts = rank_inputs(rank, routing, topk)
        x.requires_grad_(True)
        probs.requires_grad_(True)
        layer.router = FixedRouter(probs, experts)
        out, _, tokens_per_expert = layer(x.unsqueeze(0))
        assert torch.equal(tokens_per_expert, torch.bincount(experts.flatten(), minlength=E))
        out.squeeze(0).backward(upstream)

        # Reference: every rank's tokens through the naive formula; expert grads sum over all of them.
        ref_w13, ref_w2 = w13.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        errors = []
        for r in range(world):
            rx, rup, rprobs, rexperts = rank_inputs(r, routing, topk)
            rx.requires_grad_(True)
            rprobs.requires_grad_(True)
            ref_out = naive_moe(rx, rprobs, rexperts, ref_w13, ref_w2)
            ref_out.backward(rup)
            if r == rank and rx.shape[0] > 0:
                errors += [rel_err(out.squeeze(0), ref_out), rel_err(x.grad, rx.grad), rel_err(probs.grad, rprobs.grad)]
        for got, want in ((layer.experts.w13.grad, ref_w13.grad[local]), (layer.experts.w2.grad, ref_w2.grad[local])):
            if want.norm() == 0:
                assert got.abs().max() == 0, "an expert that received nothing has a gradient"
            else:
                errors.append(rel_err(got, want))
        assert max(errors, default=0.0) < 1e-5, errors
        return max(errors, default=0.0)
    finally:
        mesh.destroy()


@pytest.mark.parametrize("routing", ["random", "first_rank_only", "last_rank_only", "sparse"])
@pytest.mark.parametrize("topk", [1, 2])
def test_moe_layer_single_process(routing, topk):
    assert moe_case(routing, topk) < 1e-5


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("routing", ["random", "first_rank_only", "last_rank_only", "sparse"])
def test_moe_layer_expert_parallel_skewed_routing(rank_pool, world, routing):
    errors = rank_pool(world).run(moe_case, routing, 2)
    assert max(errors) < 1e-5
