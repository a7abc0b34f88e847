"""The serial EP MoE layer against a naive dense formula, including skewed routing, on 1, 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from types import SimpleNamespace

from moe_overlap.config import ModelConfig, OverlapConfig
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.layers.experts import GroupedSwiGLU, expert_offsets, grouped_swiglu_reference
from moe_overlap.layers.moe import MoELayer
from moe_overlap.layers.mlp import swiglu

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
    """Stands in for the router so a test can dictate where every token goes (and, with a capacity,
    which copies are dropped: the later ones, Megatron's "position" policy)."""

    def __init__(self, probs_TK: torch.Tensor, experts_TK: torch.Tensor, capacity: int | None):
        super().__init__()
        self.probs_TK, self.experts_TK, self.capacity = probs_TK, experts_TK, capacity

    def forward(self, x_TH):
        keep_TK = None
        if self.capacity is not None:
            one_hot = torch.nn.functional.one_hot(self.experts_TK.flatten(), E)
            position = ((one_hot.cumsum(0) - 1) * one_hot).sum(1).view_as(self.experts_TK)
            keep_TK = position < self.capacity
        kept = self.experts_TK if keep_TK is None else self.experts_TK[keep_TK]
        zero = torch.zeros(())
        probs = self.probs_TK if keep_TK is None else self.probs_TK * keep_TK
        return SimpleNamespace(probs_TK=probs, experts_TK=self.experts_TK, keep_TK=keep_TK, capacity=self.capacity,
                               tokens_per_expert_E=torch.bincount(kept.flatten(), minlength=E),
                               aux_loss=zero, z_loss=zero)


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


SHARED_F = 16


def moe_case(routing: str, topk: int, chunks: int = 0, capacity: int | None = None, pad: bool = False,
             shared: str = "off", delay_wgrad: bool = False, etp: int = 1, sync_free: bool = False) -> float:
    """Runs on every rank of the pool: the EP layer's output and gradients against the naive formula.

    chunks 0 is the serial path (or, with sync_free, the sync-free one); >= 1 the overlapped pipeline with
    that many chunks. shared: off, serial (shared expert outside the pipeline), overlap (inside the dispatch gap).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = Mesh.create(MeshLayout(world, ep=world // etp, etp=etp), timeout_s=60) if world > 1 else Mesh.single()
    try:
        cfg = ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=topk,
                          moe_pad_expert_input_to_capacity=pad,
                          moe_shared_expert_intermediate_size=SHARED_F if shared != "off" else None,
                          moe_shared_expert_overlap=shared == "overlap")
        overlap = OverlapConfig(moe_overlap_dispatch=chunks > 0, moe_a2a_chunks=max(chunks, 1),
                                delay_wgrad_compute=delay_wgrad, moe_sync_free_dispatch=sync_free)
        transports = (TransportSelector("auto", mesh.ep.group, mesh.ep.ranks, torch.device("cpu"), max(chunks, 1), 60)
                      if chunks or sync_free else None)
        layer = MoELayer(cfg, overlap, mesh.ep, transports, etp=mesh.etp, expert_mp=mesh.expert_mp)
        w13, w2 = full_expert_weights()
        ffn_slice = slice(mesh.etp.rank * F // etp, (mesh.etp.rank + 1) * F // etp)

        def my_slice(t13, t2):  # this rank's FFN slice under expert-TP: gate and up columns, fc2 rows
            return torch.cat((t13[..., :F][..., ffn_slice], t13[..., F:][..., ffn_slice]), -1), t2[:, ffn_slice]

        g = torch.Generator().manual_seed(7)
        shared_fc1, shared_fc2 = torch.randn(2 * SHARED_F, H, generator=g) * 0.3, torch.randn(H, SHARED_F, generator=g) * 0.3
        local = slice(layer.experts.first_expert, layer.experts.first_expert + layer.experts.num_local_experts)
        with torch.no_grad():
            mine13, mine2 = my_slice(w13[local], w2[local])
            layer.experts.w13.copy_(mine13)
            layer.experts.w2.copy_(mine2)
            if layer.shared_expert is not None:
                layer.shared_expert.linear_fc1.weight.copy_(shared_fc1)
                layer.shared_expert.linear_fc2.weight.copy_(shared_fc2)
        x, upstream, probs, experts = rank_inputs(rank, routing, topk)
        x.requires_grad_(True)
        probs.requires_grad_(True)
        layer.router = FixedRouter(probs, experts, capacity)
        out, _, tokens_per_expert = layer(x.unsqueeze(0))
        kept = FixedRouter(probs, experts, capacity)(x)
        assert torch.equal(tokens_per_expert, kept.tokens_per_expert_E)
        out.squeeze(0).backward(upstream)

        # Reference: every rank's tokens through the naive formula; expert grads sum over all of them.
        ref_w13, ref_w2 = w13.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        ref_fc1, ref_fc2 = shared_fc1.clone().requires_grad_(True), shared_fc2.clone().requires_grad_(True)
        errors = []
        for r in range(world):
            rx, rup, rprobs, rexperts = rank_inputs(r, routing, topk)
            rx.requires_grad_(True)
            rprobs.requires_grad_(True)
            rkept = FixedRouter(rprobs, rexperts, capacity)(rx)
            ref_out = naive_moe(rx, rkept.probs_TK, rexperts, ref_w13, ref_w2)
            if shared != "off":
                ref_out = ref_out + swiglu(rx @ ref_fc1.T) @ ref_fc2.T
            ref_fc1.grad, ref_fc2.grad = None, None  # the shared expert sees one rank's tokens only
            ref_out.backward(rup)
            if r == rank and rx.shape[0] > 0:
                errors += [rel_err(out.squeeze(0), ref_out), rel_err(x.grad, rx.grad), rel_err(probs.grad, rprobs.grad)]
                if shared != "off":
                    errors += [rel_err(layer.shared_expert.linear_fc1.weight.grad, ref_fc1.grad),
                               rel_err(layer.shared_expert.linear_fc2.weight.grad, ref_fc2.grad)]
        want13, want2 = my_slice(ref_w13.grad[local], ref_w2.grad[local])
        for got, want in ((layer.experts.w13.grad, want13), (layer.experts.w2.grad, want2)):
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


# The overlapped pipeline against the same formula (the serial path passes it too): chunks, capacity with
# and without padding, shared expert in and out of the dispatch gap, deferred wgrad, skewed routing.
OVERLAP_CASES = [
    dict(chunks=1), dict(chunks=2), dict(chunks=4), dict(chunks=4, delay_wgrad=True),
    dict(chunks=2, capacity=3), dict(chunks=2, capacity=3, pad=True), dict(capacity=3, pad=True),
    dict(chunks=2, shared="overlap"), dict(chunks=2, shared="serial", delay_wgrad=True), dict(shared="serial"),
]


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("routing", ["random", "sparse"])
def test_overlapped_dispatch_ep2(rank_pool, routing, case):
    assert max(rank_pool(2).run(moe_case, routing, 2, **case)) < 1e-5


@pytest.mark.parametrize("routing", ["random", "first_rank_only", "last_rank_only"])
@pytest.mark.parametrize("chunks", [1, 2])
def test_overlapped_dispatch_ep4_skewed(rank_pool, routing, chunks):
    assert max(rank_pool(4).run(moe_case, routing, 2, chunks=chunks, delay_wgrad=chunks == 2)) < 1e-5


@pytest.mark.parametrize("world,routing,capacity", [(2, "random", None), (2, "sparse", None), (4, "random", None),
                                                    (4, "last_rank_only", None), (4, "sparse", 3)])
def test_expert_tensor_parallel_serial_dispatch(rank_pool, world, routing, capacity):
    """Expert-TP=2 (EP=1 on 2 ranks, EP=2 on 4): each expert's FFN split in two, rows gathered and the
    partial outputs summed back; with padded capacity the sizes are static."""
    errors = rank_pool(world).run(moe_case, routing, 2, capacity=capacity, pad=capacity is not None, etp=2)
    assert max(errors) < 1e-5


@pytest.mark.parametrize("world,routing,capacity,delay", [(2, "random", None, True), (2, "sparse", None, False),
                                                          (4, "random", None, True), (4, "sparse", 3, False)])
def test_expert_tensor_parallel_overlapped_dispatch(rank_pool, world, routing, capacity, delay):
    """The chunked pipeline with expert-TP=2: each chunk's rows gathered over expert-TP, summed back."""
    errors = rank_pool(world).run(moe_case, routing, 2, chunks=2, capacity=capacity, pad=capacity is not None,
                                  delay_wgrad=delay, etp=2)
    assert max(errors) < 1e-5


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("routing", ["first_rank_only", "last_rank_only", "sparse"])
@pytest.mark.parametrize("shared", ["off", "serial"])
def test_sync_free_dispatch(rank_pool, world, routing, shared):
    """Routes computed on the device, rows pushed to their (local expert, source) place and back: the
    process group's twin of the SM pushes on CPU, against the naive formula."""
    if world == 1:
        assert moe_case(routing, 2, shared=shared, sync_free=True) < 1e-5
    else:
        assert max(rank_pool(world).run(moe_case, routing, 2, shared=shared, sync_free=True)) < 1e-5


def test_sync_free_dispatch_refuses_ranks_with_different_token_counts(rank_pool):
    """Its static sizes assume one micro-batch shape on every EP rank: a rank with no tokens is caught."""
    with pytest.raises(Exception, match="must route"):
        rank_pool(2).run(moe_case, "random", 2, sync_free=True)


def test_cuda_graph_capture_refuses_layers_that_sync_with_the_host():
    from moe_overlap.distributed.mesh import GroupHandle
    from moe_overlap.layers.moe import capture_moe_layers
    two_ranks = GroupHandle(ranks=[0, 1], group=None, rank=0, size=2)  # the serial dropless dispatch syncs at EP=2
    layer = MoELayer(ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=2),
                     OverlapConfig(), two_ranks)
    assert not layer.local
    with pytest.raises(ValueError, match="moe_sync_free_dispatch"):
        capture_moe_layers((layer,), (1, TOKENS, H))


@pytest.mark.parametrize("setting", [dict(sync_free=True), dict(chunks=2), dict(capacity=3),
                                     dict(capacity=3, pad=True), dict(shared="serial", sync_free=True)],
                         ids=["sync_free", "chunked", "capacity", "padded", "shared"])
def test_one_ep_rank_runs_the_local_path_for_every_dispatch_setting(setting):
    """EP=1: no exchange and no host sync whatever the dispatch switches say, against the naive formula."""
    assert moe_case("sparse", 2, **setting) < 1e-5


def test_overlapped_dispatch_single_process_chunk_without_rows():
    assert moe_case("first_rank_only", 2, chunks=4) < 1e-5  # chunks 1..3 carry no rows at all


def test_dropless_plan_sizes_the_permutation_before_the_counts_arrive():
    """All copies mapped: the permuted rows are known without the counts, so the permutation is queued before
    the layer's one host sync; the exchange plan waits for the counts once, on first use."""
    from moe_overlap.distributed.mesh import GroupHandle
    from moe_overlap.layers.dispatcher import DispatchPlanner

    ep = GroupHandle(ranks=[0, 1], group=None, rank=0, size=2)
    experts_TK = torch.tensor([[0, 3], [1, 2], [3, 0]])
    counts_SE = torch.tensor([[2, 1, 1, 2], [1, 1, 2, 2]])
    fetches = []
    plan = DispatchPlanner(4, ep, 1, torch.device("cpu")).plan(experts_TK, None, None,
                                                               lambda: fetches.append(1) or counts_SE)
    assert plan.num_rows == 6 and not fetches
    assert plan.exchange.layout.send_total == 6 and plan.exchange.layout.recv_total == 5 and fetches == [1]
    plan.exchange
    assert fetches == [1]
