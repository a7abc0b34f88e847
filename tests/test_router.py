"""The router against straightforward per-token references: score functions, group-limited top-k, expert bias
(selection only; its update, identical on every rank and kept in checkpoints), the auxiliary losses, capacity
with both drop policies, forced load balancing, gradients, and the config rules. tests/test_master.py runs the
variants on 2 ranks."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from moe_overlap.config import ConfigError, load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.kernels.router import FORCED_ORDERS, forced_expert_orders, forced_experts
from moe_overlap.layers.router import Bf16Logits, Router, bf16_parts
from moe_overlap.models.mixtral import build_model
from moe_overlap.training.trainer import Trainer
from tests.test_dist_optimizer import parameters
from tests.test_master import CPU, TOL, equivalence_case, small_config, tp_layout, world_and_mesh

H, E, TOKENS, SEQ = 16, 8, 24, 6


def make_router(topk: int = 2, dtype=torch.float32, seed: int = 0, **options) -> Router:
    """A router with spread-out random weights (no near-ties); options are Router's keyword arguments."""
    balancing = options.pop("load_balancing_type", "aux_loss")
    pre_softmax = options.pop("pre_softmax", False)
    aux_coeff, z_coeff = options.pop("aux_loss_coeff", 0.1), options.pop("z_loss_coeff", 0.01)
    router = Router(H, E, topk, pre_softmax, balancing, aux_coeff, z_coeff, dtype=dtype, seq_length=SEQ, **options)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(seed)))
    return router


def tokens(num_tokens: int = TOKENS, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def logits_of(router: Router, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, router.weight).detach()


def reference_routing(logits_TE, topk, score_function="softmax", pre_softmax=False, num_groups=None,
                      group_topk=None, bias_E=None):
    """Token by token: scores, the eligible groups, the k best experts, their weights."""
    probs, experts = [], []
    for logits_E in logits_TE:
        if score_function == "sigmoid":
            scores = torch.sigmoid(logits_E)
        else:
            scores = torch.softmax(logits_E, 0) if pre_softmax else logits_E
        select = scores if bias_E is None else scores + bias_E
        eligible = range(E)
        if num_groups is not None:
            size = E // num_groups
            group_score = [sorted(select[g * size:(g + 1) * size].tolist(), reverse=True)[:topk // group_topk]
                           for g in range(num_groups)]
            best = sorted(range(num_groups), key=lambda g: -sum(group_score[g]))[:group_topk]
            eligible = [e for e in range(E) if e // size in best]
        chosen = sorted(eligible, key=lambda e: -float(select[e]))[:topk]
        weights = scores[chosen]
        if score_function == "sigmoid":
            weights = weights / weights.sum() if topk > 1 else weights
        elif not pre_softmax:
            weights = torch.softmax(weights, 0)
        probs.append(weights)
        experts.append(chosen)
    return torch.stack(probs), torch.tensor(experts)


def reference_aux_loss(logits_TE, topk, kind, score_function="softmax", previous_load_E=None):
    """E * sum_e(mean score_e * fraction of a plain top-k's copies to e), per sequence for seq_aux_loss."""
    if score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        scores_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
    else:
        scores_TE = torch.softmax(logits_TE, -1)
    if kind == "global_aux_loss":
        return E * float((scores_TE.mean(0) * previous_load_E).sum())
    length = SEQ if kind == "seq_aux_loss" else scores_TE.shape[0]
    losses = []
    for start in range(0, scores_TE.shape[0], length):
        seq_TE = scores_TE[start:start + length]
        counts = torch.zeros(E)
        for scores_E in seq_TE:
            for e in scores_E.argsort(descending=True)[:topk]:
                counts[e] += 1
        losses.append(E * float((seq_TE.mean(0) * counts / (length * topk)).sum()))
    return sum(losses) / len(losses)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ selection

VARIANTS = {
    "softmax": dict(topk=2),
    "pre_softmax": dict(topk=2, pre_softmax=True),
    "sigmoid": dict(topk=3, score_function="sigmoid"),
    "sigmoid_top1": dict(topk=1, score_function="sigmoid"),
    "sigmoid_bias": dict(topk=2, score_function="sigmoid", enable_expert_bias=True),
    "softmax_groups": dict(topk=2, num_groups=4, group_topk=2),
    "pre_softmax_groups": dict(topk=3, pre_softmax=True, num_groups=2, group_topk=1),
    "sigmoid_groups_bias": dict(topk=4, score_function="sigmoid", num_groups=4, group_topk=2,
                                enable_expert_bias=True),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_routing_matches_reference(variant):
    options = dict(VARIANTS[variant])
    router = make_router(**options)
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(7)) * 0.1)
    x = tokens()
    routing = router(x)
    logits = logits_of(router, x)
    want_probs, want_experts = reference_routing(
        logits, options["topk"], options.get("score_function", "softmax"), options.get("pre_softmax", False),
        options.get("num_groups"), options.get("group_topk"), router.expert_bias)
    assert torch.equal(routing.experts_TK, want_experts)
    assert rel_err(routing.probs_TK, want_probs) < 1e-6
    assert torch.equal(routing.tokens_per_expert_E, torch.bincount(want_experts.flatten(), minlength=E))
    assert routing.keep_TK is None and routing.capacity is None
    assert routing.probs_TK.dtype == torch.float32


@pytest.mark.parametrize("options", [dict(topk=2), dict(topk=3, pre_softmax=True), dict(topk=2, capacity_factor=0.5),
                                     dict(topk=2, force_load_balancing=True),
                                     dict(topk=3, pre_softmax=True, force_load_balancing=True)],
                         ids=["softmax", "pre_softmax_top3", "capacity", "forced", "pre_softmax_top3_forced"])
def test_merged_router_kernel_routes_like_its_twin(monkeypatch, options):
    """The softmax router's top-k, weights and counts as one kernel (interpreted), against the torch twin: the
    same experts, weights, counts and gradients reaching the router weight, with capacity drops after it."""
    from moe_overlap.kernels import router as kernels

    x = tokens(2 * SEQ)
    runs = []
    for interpret in (True, False):
        if interpret:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        router = make_router(**options)
        routing = router(x)
        (routing.probs_TK * torch.arange(1.0, 1 + routing.probs_TK.numel()).view_as(routing.probs_TK)).sum().backward()
        runs.append((routing, router.weight.grad))
    (fused, fused_grad), (twin, twin_grad) = runs
    assert torch.equal(fused.experts_TK, twin.experts_TK)
    assert torch.equal(fused.tokens_per_expert_E, twin.tokens_per_expert_E)
    assert rel_err(fused.probs_TK, twin.probs_TK) < 1e-6 and rel_err(fused_grad, twin_grad) < 1e-5
    assert kernels.HAVE_TRITON


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_merged_router_kernel_keeps_experts_in_range_on_non_finite_logits(monkeypatch, pre_softmax):
    """NaN logits (a diverged step) route each token to k distinct experts in [0, E), never past the last one
    (an index past it crashed a GPU run with a device-side assert in the dispatch); the step's non-finite loss
    and gradients report it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from moe_overlap.kernels.router import topk_route_triton

    logits_TE = torch.randn(6, 8)
    logits_TE[1] = float("nan")
    logits_TE[3, 2] = float("nan")
    probs_TK, experts_TK, copies_E = topk_route_triton(logits_TE, 3, pre_softmax)
    assert int(experts_TK.min()) >= 0 and int(experts_TK.max()) < 8
    assert all(len(set(row.tolist())) == 3 for row in experts_TK)
    assert int(copies_E.sum()) == 6 * 3 and torch.isfinite(probs_TK).all()


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,K,pre_softmax,force", [(8192, 8, 2, False, False), (4096, 64, 8, True, False),
                                                     (32768, 256, 8, False, False), (8192, 8, 2, False, True),
                                                     (4096, 64, 8, True, True)])
def test_merged_router_kernel_matches_twin_on_gpu(T, E, K, pre_softmax, force):
    """On CUDA the kernel and the twin agree, forward and backward, with no host sync, also with forced load
    balancing. Each token's logits are a shuffle of evenly spaced values: no ties, whose order torch.topk leaves
    unspecified."""
    from moe_overlap.kernels.router import TopKRoute, topk_route_torch

    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(T)
    logits = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1).float() * (8.0 / E) - 4.0
    grad = torch.randn(T, K, device="cuda")
    fused_in, twin_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    orders_ME = forced_expert_orders(E, "cuda") if force else None
    torch.cuda.set_sync_debug_mode("error")
    try:
        probs, experts, copies = TopKRoute.apply(fused_in, K, pre_softmax, orders_ME)
        probs.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want_probs, want_experts, want_copies = topk_route_torch(twin_in, K, pre_softmax, orders_ME)
    if force:
        assert torch.equal(copies, torch.full_like(copies, T * K // E))
    want_probs.backward(grad)
    assert torch.equal(experts, want_experts) and torch.equal(copies, want_copies)
    assert rel_err(probs, want_probs) < 1e-6 and rel_err(fused_in.grad, twin_in.grad) < 1e-5


def test_router_math_is_fp32_under_bf16():
    router = make_router(score_function="sigmoid", enable_expert_bias=True, dtype=torch.bfloat16)
    routing = router(tokens(dtype=torch.bfloat16))
    assert router.expert_bias.dtype == torch.float32
    assert {routing.probs_TK.dtype, routing.aux_loss.dtype, routing.z_loss.dtype} == {torch.float32}


def test_bf16_parts_hold_every_bit_of_the_fp32_gradient():
    g = torch.randn(64, 24, dtype=torch.float64).mul(torch.logspace(-20, 20, 24, dtype=torch.float64)).float()
    parts = bf16_parts(g)
    assert parts.dtype == torch.bfloat16 and parts.shape == (64, 72)
    hi, mid, lo = parts.float().split(24, dim=1)
    assert torch.equal((hi + mid) + lo, g)


def bf16_rounded_sums(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether got (bf16) is a @ b (fp64 from the bf16 a, b) rounded once to bf16 after fp32 sums: within half a bf16
    step of it (relative 2^-8) plus the fp32 sums' error bound (2^-20 of the sum of the products' magnitudes)."""
    want, magnitudes = a.double() @ b.double(), a.double().abs() @ b.double().abs()
    return bool(((got.double() - want).abs() <= 0.51 * 2.0 ** -7 * want.abs() + 2.0 ** -20 * magnitudes).all())


def test_bf16_router_logits_are_the_fp32_gemms_products():
    """Bf16Logits (bf16 tokens and weight): the logits are exact products summed in fp32, as the fp32 GEMM of the
    values cast up; the gradients, through the fp32 gradient's three bf16 parts, are the exact products rounded
    once to bf16 (within half a bf16 step of the fp64 result, plus the fp32 sum's own error)."""
    torch.manual_seed(0)
    x = torch.randn(96, 256).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(16, 256) * 0.02).to(torch.bfloat16).requires_grad_()
    logits = Bf16Logits.apply(x, w)
    want = x.detach().double() @ w.detach().double().t()
    assert logits.dtype == torch.float32
    assert (logits.double() - want).abs().max() <= 1e-6 * want.abs().max()
    g = torch.randn(96, 16) * 1e-3
    logits.backward(g)
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert bf16_rounded_sums(x.grad, g, w.detach()) and bf16_rounded_sums(w.grad, g.t(), x.detach())
    assert not bf16_rounded_sums(x.grad, g.to(torch.bfloat16).float() * (1 + 2.0 ** -6), w.detach())
    reference = F.linear(x.detach().float().requires_grad_(), w.detach().float())  # the fp32 GEMM they replace
    assert torch.allclose(logits, reference, rtol=1e-6, atol=1e-6)


def test_group_limited_never_picks_a_masked_group():
    topk, groups, group_topk = 4, 4, 2
    router = make_router(topk, score_function="sigmoid", num_groups=groups, group_topk=group_topk,
                         enable_expert_bias=True)
    router.expert_bias.copy_(torch.tensor([0.3, 0.3, 0.3, 0.3, 0.0, 0.0, -0.2, -0.2]))  # pulls towards group 0
    x = tokens(512)
    experts_TK = router(x).experts_TK
    select_TGX = (torch.sigmoid(logits_of(router, x)) + router.expert_bias).view(-1, groups, E // groups)
    group_scores_TG = select_TGX.topk(topk // group_topk, dim=-1).values.sum(-1)
    kept_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(
        1, group_scores_TG.topk(group_topk, dim=-1).indices, True)
    assert kept_TG.gather(1, experts_TK // (E // groups)).all()
    # The limit binds: without it, some tokens would have picked from a third group.
    free = make_router(topk, score_function="sigmoid", enable_expert_bias=True)
    free.expert_bias.copy_(router.expert_bias)
    free_groups_TK = free(x).experts_TK // (E // groups)
    assert max(len(set(row.tolist())) for row in free_groups_TK) > group_topk


def test_expert_bias_changes_selection_not_weights():
    router = make_router(2, score_function="sigmoid", enable_expert_bias=True)
    x = tokens()
    unbiased = router(x)
    router.expert_bias[5] = 10.0  # every token now picks expert 5
    biased = router(x)
    assert (biased.experts_TK == 5).any(1).all() and not (unbiased.experts_TK == 5).any(1).all()
    scores_TE = torch.sigmoid(logits_of(router, x))
    chosen_TK = scores_TE.gather(1, biased.experts_TK)  # weights from the unbiased scores of the chosen
    assert rel_err(biased.probs_TK, chosen_TK / chosen_TK.sum(-1, keepdim=True)) < 1e-6
    router.expert_bias.fill_(3.0)  # a uniform shift changes nothing
    shifted = router(x)
    assert torch.equal(shifted.experts_TK, unbiased.experts_TK) and torch.equal(shifted.probs_TK, unbiased.probs_TK)


def test_bias_update_moves_towards_the_mean_load():
    router = make_router(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01)
    router.update_load(torch.tensor([10, 2, 6, 6, 0, 14, 6, 4]))  # mean 6
    want = 0.01 * torch.tensor([-1.0, 1.0, 0.0, 0.0, 1.0, -1.0, 0.0, 1.0])
    assert torch.equal(router.expert_bias, want)
    assert make_router().expert_bias is None  # off by default: no buffer, nothing in checkpoints


# -------------------------------------------------------------------------------------------- losses


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
@torch.no_grad()
def test_aux_losses_match_reference(kind, score_function):
    router = make_router(2, score_function=score_function, load_balancing_type=kind, num_groups=4, group_topk=2,
                         aux_loss_coeff=0.1, z_loss_coeff=0.01)
    x = tokens()
    logits = logits_of(router, x)
    previous_load_E = None
    if kind == "global_aux_loss":
        assert float(router(x).aux_loss) == 0.0  # before the first step: no load yet
        counts = torch.tensor([30, 2, 8, 8, 0, 12, 4, 0])
        router.update_load(counts)
        previous_load_E = counts / counts.sum()
    routing = router(x)
    want = 0.1 * reference_aux_loss(logits, 2, kind, score_function, previous_load_E)
    assert abs(float(routing.aux_loss) - want) < 1e-6 * want
    want_z = 0.01 * float((torch.logsumexp(logits, -1) ** 2).mean())
    assert abs(float(routing.z_loss) - want_z) < 1e-6 * want_z


@torch.no_grad()
def test_seq_aux_loss_is_per_sequence():
    x = tokens()
    seq = make_router(load_balancing_type="seq_aux_loss")(x).aux_loss
    whole = make_router(load_balancing_type="aux_loss")(x).aux_loss
    assert abs(float(seq - whole)) > 1e-4  # balance within each sequence is a stronger demand
    with pytest.raises(ValueError, match="seq_aux_loss: 20 tokens are not whole sequences of seq_length=6"):
        make_router(load_balancing_type="seq_aux_loss")(tokens(20))


@torch.no_grad()
def test_load_balancing_none_has_no_aux_loss():
    routing = make_router(load_balancing_type="none")(tokens())
    assert float(routing.aux_loss) == 0.0 and float(routing.z_loss) > 0


# --------------------------------------------------------------------------------- forced load balancing

FORCED = {
    "softmax": dict(topk=2),
    "pre_softmax": dict(topk=3, pre_softmax=True),
    "sigmoid_top1": dict(topk=1, score_function="sigmoid"),
    "sigmoid_groups_bias": dict(topk=4, score_function="sigmoid", num_groups=4, group_topk=2, enable_expert_bias=True),
    "softmax_groups": dict(topk=2, num_groups=4, group_topk=2),
}


@pytest.mark.parametrize("variant", FORCED)
def test_forced_balancing_assigns_windows_of_shuffled_orders_weighted_by_the_scores(variant):
    """Copy j of token t goes to expert order_m[(t + j) mod E] (m = t // E mod 16) whatever the scores, groups or
    bias: every expert gets exactly T*k/E copies. The weights are the scores there, normalised as the score
    function does; the aux loss counts the assigned load (balanced: E * sum_e mean score_e / E = 1 x the
    coefficient)."""
    options = FORCED[variant]
    k = options["topk"]
    router = make_router(**options, force_load_balancing=True)
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.linspace(0.0, 5.0, E))  # would pull every token to the last experts
    x = tokens()
    routing = router(x)
    orders = forced_expert_orders(E).tolist()
    want_experts = torch.tensor([[orders[t // E % FORCED_ORDERS][(t + j) % E] for j in range(k)]
                                 for t in range(TOKENS)])
    assert torch.equal(routing.experts_TK, want_experts)
    assert torch.equal(routing.tokens_per_expert_E, torch.full((E,), TOKENS * k // E))
    logits = logits_of(router, x)
    if options.get("score_function") == "sigmoid":
        chosen = torch.sigmoid(logits).gather(1, want_experts)
        want_probs = chosen / chosen.sum(-1, keepdim=True) if k > 1 else chosen
    elif options.get("pre_softmax"):
        want_probs = torch.softmax(logits, -1).gather(1, want_experts)
    else:
        want_probs = torch.softmax(logits.gather(1, want_experts), -1)
    assert rel_err(routing.probs_TK, want_probs) < 1e-6
    unforced = make_router(**options)(x)
    assert not torch.equal(unforced.experts_TK, want_experts)  # the router alone would have chosen otherwise
    aux_loss, z_loss, unforced_z_loss = (float(loss.detach()) for loss in (routing.aux_loss, routing.z_loss,
                                                                              unforced.z_loss))
    assert abs(aux_loss - 0.1) < 1e-6 and abs(z_loss - unforced_z_loss) < 1e-6 * unforced_z_loss


def test_forced_balancing_spreads_a_token_over_ranks_as_a_random_top_k_does():
    """The fine-grained bench model's routing (8 of 64 experts) over a micro-batch of 8,192 tokens: every expert
    gets exactly its share, every token k different experts, and the EP ranks a token reaches average what a
    uniformly random top-k reaches (EP=4: 3.66; torchtitan's round-robin reaches 1, the exchange's best case)."""
    experts, k, tokens_ = 64, 8, 8192
    experts_TK = forced_experts(tokens_, k, forced_expert_orders(experts))
    assert torch.equal(torch.bincount(experts_TK.flatten(), minlength=experts),
                       torch.full((experts,), tokens_ * k // experts))
    assert all(len(set(row)) == k for row in experts_TK.tolist())
    for ep in (2, 4, 8):
        per_rank = experts // ep
        random_top_k = ep * (1 - math.comb(experts - per_rank, k) / math.comb(experts, k))
        ranks_T = torch.tensor([len(set(row)) for row in (experts_TK // per_rank).tolist()], dtype=torch.float64)
        assert abs(float(ranks_T.mean()) - random_top_k) < 0.1, (ep, float(ranks_T.mean()), random_top_k)
    assert forced_expert_orders(experts).tolist() == forced_expert_orders(experts).tolist()  # the same each time


def test_forced_balancing_keeps_capacity_and_its_drops():
    """Capacity acts on the assigned copies: T*k/E each fit a factor of 1, a factor of 0.5 keeps half of each."""
    x = tokens()
    full = make_router(2, capacity_factor=1.0, force_load_balancing=True)(x)
    assert full.keep_TK.all() and int(full.tokens_per_expert_E.sum()) == TOKENS * 2
    half = make_router(2, capacity_factor=0.5, force_load_balancing=True)(x)
    assert torch.equal(half.tokens_per_expert_E, torch.full((E,), TOKENS * 2 // E // 2))
    assert torch.equal(half.probs_TK, torch.where(half.keep_TK, full.probs_TK, 0.0))


FORCED_CONFIG = {"model.moe_router_force_load_balancing": "true", "data.path": "synthetic:zipf:1.0"}


def test_forced_balancing_in_training_warns_and_balances_every_layer(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="moe_overlap.training.trainer")
    trainer = Trainer(small_config(str(tmp_path), 1, 4, **FORCED_CONFIG), Mesh.single(), CPU)
    warnings = [r.getMessage() for r in caplog.records if "moe_router_force_load_balancing" in r.getMessage()]
    assert warnings == ["model.moe_router_force_load_balancing=true: every token's experts are assigned (each expert "
                        "the same load); the model does not learn routing (a benchmark setting)"]
    loads = trainer.train_step()["tokens_per_expert"]
    per_expert = 4 * 16 * 2 // 8  # global batch x seq_length x top-k / experts
    assert loads == {"1": [per_expert] * 8, "2": [per_expert] * 8}
    caplog.clear()
    Trainer(small_config(str(tmp_path), 1, 4), Mesh.single(), CPU)
    assert not [r for r in caplog.records if "moe_router_force_load_balancing" in r.getMessage()]


@pytest.mark.parametrize("world,ep,layout", [(2, 2, {}), (2, 2, tp_layout(2))], ids=["ep2", "tp2_sp_ep2"])
def test_forced_balancing_matches_single_process(rank_pool, tmp_path, world, ep, layout):
    """EP=2, and TP=2 with sequence parallelism (each rank routes the gathered micro-batch in the single-process
    order, so token t is the same token): the same assignment, losses and gradients as one process."""
    both = dict(FORCED_CONFIG, **({"model.num_query_groups": 4, "train.adam_eps": 1e-4} if layout else {}))
    worst = rank_pool(world).run(equivalence_case, ep, 2, str(tmp_path), router=both, layout=layout)
    assert all(max(w.values()) < TOL for w in worst)


# ---------------------------------------------------------------------------------------- gradients

GRAD_VARIANTS = {
    "softmax_aux": dict(topk=2),
    "pre_softmax_seq_aux": dict(topk=2, pre_softmax=True, load_balancing_type="seq_aux_loss"),
    "sigmoid_groups_bias": dict(topk=2, score_function="sigmoid", num_groups=2, group_topk=1,
                                enable_expert_bias=True),
    "capacity_probs": dict(topk=2, capacity_factor=0.5),
    "global_aux": dict(topk=2, load_balancing_type="global_aux_loss"),
}


@pytest.mark.parametrize("variant", GRAD_VARIANTS)
def test_gradients_flow_to_router_weights(variant):
    """gradcheck in float64 (the router widens to float64 when given it): selection is piecewise constant,
    so the check covers the weights, the auxiliary losses and the z-loss where they are differentiable."""
    router = make_router(dtype=torch.float64, **GRAD_VARIANTS[variant])
    if router.expert_bias is not None:
        router.expert_bias.copy_(torch.linspace(-0.2, 0.2, E))
    if router.previous_step_load is not None:
        router.update_load(torch.arange(E))
    x = tokens(2 * SEQ, dtype=torch.float64).requires_grad_(True)
    weight = router.weight.detach().clone().requires_grad_(True)

    def route(x, weight):
        routing = torch.func.functional_call(router, {"weight": weight}, (x,))
        return routing.probs_TK, routing.aux_loss, routing.z_loss

    assert torch.autograd.gradcheck(route, (x, weight), eps=1e-6, atol=1e-8)
    probs_TK, aux_loss, _ = route(x, weight)
    (probs_TK.sum() + aux_loss).backward()
    assert weight.grad.abs().sum() > 0


@pytest.mark.parametrize("variant", ["softmax_aux", "pre_softmax_seq_aux", "global_aux"])
def test_loss_detach_input_moves_the_router_weight_alone(variant):
    """model.moe_router_loss_detach_input: the same routing, losses and router-weight gradient; the tokens get the
    routing weights' gradient only, none from the auxiliary and z losses."""
    def grads(detach: bool, with_losses: bool):
        router = make_router(**GRAD_VARIANTS[variant], loss_detach_input=detach)
        if router.previous_step_load is not None:
            router.update_load(torch.arange(E))
        x = tokens(2 * SEQ).requires_grad_(True)
        routing = router(x)
        probs_weights = torch.linspace(0.5, 1.5, routing.probs_TK.numel()).view_as(routing.probs_TK)
        loss = (routing.probs_TK * probs_weights).sum()
        if with_losses:
            loss = loss + 10 * routing.aux_loss + 10 * routing.z_loss
        loss.backward()
        return routing, x.grad, router.weight.grad

    plain, plain_x, plain_w = grads(False, True)
    detached, detached_x, detached_w = grads(True, True)
    _, probs_only_x, _ = grads(False, False)
    assert torch.equal(plain.experts_TK, detached.experts_TK) and torch.equal(plain.probs_TK, detached.probs_TK)
    assert torch.equal(plain.aux_loss, detached.aux_loss) and torch.equal(plain.z_loss, detached.z_loss)
    torch.testing.assert_close(detached_w, plain_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(detached_x, probs_only_x, rtol=1e-6, atol=1e-7)
    assert (plain_x - probs_only_x).abs().max() > 1e-3  # the losses do reach the tokens by default


def test_loss_detach_input_matches_single_process_under_sequence_parallelism(rank_pool, tmp_path):
    """TP=2 with sequence parallelism: the losses' logits are gathered as the routing's (layers/sp_router.py)."""
    both = {"model.moe_router_loss_detach_input": "true", "model.moe_aux_loss_coeff": 0.1,
            "model.num_query_groups": 4, "train.adam_eps": 1e-4}
    worst = rank_pool(2).run(equivalence_case, 2, 2, str(tmp_path), router=both, layout=tp_layout(2))
    assert all(max(w.values()) < TOL for w in worst)


# ----------------------------------------------------------------------------------------- capacity


def reference_keep(probs_TK, experts_TK, capacity, policy):
    """Per expert: its copies by weight (descending) or by token, the first ``capacity`` of them kept."""
    keep = torch.zeros_like(experts_TK, dtype=torch.bool)
    for e in range(E):
        copies = [(t, j) for t in range(experts_TK.shape[0]) for j in range(experts_TK.shape[1])
                  if experts_TK[t, j] == e]
        if policy == "probs":
            copies.sort(key=lambda c: (-float(probs_TK[c]), c))
        for t, j in copies[:capacity]:
            keep[t, j] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_keeps_the_right_copies(policy):
    factor = 0.75
    router = make_router(2, capacity_factor=factor, drop_policy=policy)
    dropless = make_router(2)
    with torch.no_grad():  # skew the load onto expert 0 so that it overflows
        router.weight[0] += 2.0 * router.weight[1]
        dropless.weight.copy_(router.weight)
    x = tokens(40)
    routing, free = router(x), dropless(x)
    capacity = math.ceil(40 * 2 / E * factor)
    assert routing.capacity == capacity
    assert torch.equal(routing.experts_TK, free.experts_TK)  # dropped copies keep their expert
    want_keep = reference_keep(free.probs_TK.detach(), free.experts_TK, capacity, policy)
    assert torch.equal(routing.keep_TK, want_keep) and not want_keep.all()
    assert torch.equal(routing.probs_TK, torch.where(want_keep, free.probs_TK, 0.0))
    kept_E = torch.bincount(free.experts_TK[want_keep], minlength=E)
    assert torch.equal(routing.tokens_per_expert_E, kept_E) and int(kept_E.max()) <= capacity


def test_capacity_large_enough_drops_nothing():
    routing = make_router(2, capacity_factor=float(E))(tokens())
    assert routing.keep_TK.all() and int(routing.tokens_per_expert_E.sum()) == TOKENS * 2


# ------------------------------------------------------------------------------------ model and config

ROUTER_CONFIG = {"model.moe_router_score_function": "sigmoid", "model.moe_router_num_groups": 4,
                 "model.moe_router_group_topk": 2, "model.moe_router_enable_expert_bias": "true",
                 "model.moe_router_bias_update_rate": 0.01, "model.moe_router_load_balancing_type": "seq_aux_loss"}


def test_model_routers_follow_the_config(tmp_path):
    cfg = small_config(str(tmp_path), 1, 4, **ROUTER_CONFIG)
    model = build_model(cfg.model, Mesh.single(), "cpu", torch.bfloat16, seed=1)
    routers = model.routers()
    assert sorted(routers) == [1, 2]
    for router in routers.values():
        assert (router.score_function, router.num_groups, router.group_topk) == ("sigmoid", 4, 2)
        assert router.load_balancing_type == "seq_aux_loss" and router.seq_length == cfg.model.seq_length
        assert router.expert_bias.dtype == torch.float32 and router.weight.dtype == torch.bfloat16


def bias_and_checkpoint_case(output_dir: str) -> list[float]:
    """Two steps on this layout: the bias moves by rate * sign(mean load - load) with the step's whole load,
    then survives a checkpoint into a fresh trainer."""
    cfg = small_config(output_dir, 2, 8, **ROUTER_CONFIG)
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        key = "model.layers.1.mlp.router.expert_bias"
        for _ in range(2):
            before = trainer.model_buffers()[key].clone()
            load = torch.tensor(trainer.train_step()["tokens_per_expert"]["1"], dtype=torch.float32)
            assert int(load.sum()) == 8 * cfg.model.seq_length * 2  # the global batch's copies, every rank
            step = trainer.model_buffers()[key] - before
            assert torch.allclose(step, 0.01 * torch.sign(load.mean() - load)), (step, load)
        saved = {k: v.clone() for k, v in trainer.model_buffers().items()}
        trainer.save()
        resumed = Trainer(cfg, mesh, CPU)
        assert resumed.model_buffers()[key].abs().sum() == 0
        assert resumed.resume()
        assert all(torch.equal(resumed.model_buffers()[k], v) for k, v in saved.items())
        return saved[key].tolist()
    finally:
        mesh.destroy()


def test_expert_bias_is_identical_on_every_rank_and_checkpointed(rank_pool, tmp_path):
    biases = rank_pool(2).run(bias_and_checkpoint_case, str(tmp_path))
    assert biases[0] == biases[1] and any(biases[0])


def router_lr_scale_case(output_dir: str, distributed: bool) -> list[str]:
    """One step from the same weights with the routers' learning rate at 1 and at 0.25 of the schedule (EP=2, the
    dense parameters over DP=2): the parameters the scaled run moved, by name, after checking every move."""
    extra = {"train.use_distributed_optimizer": str(distributed).lower()}
    runs = []
    for scale in (1.0, 0.25):
        cfg = small_config(output_dir, 2, 8, **extra, **{"model.moe_router_lr_scale": scale})
        _, mesh = world_and_mesh(cfg)
        try:
            trainer = Trainer(cfg, mesh, CPU)
            before = parameters(trainer)
            trainer.train_step()
            runs.append((before, parameters(trainer)))
        finally:
            mesh.destroy()
    (start, plain), (same_start, scaled) = runs
    routers = []
    for name, weight in start.items():
        assert torch.equal(weight, same_start[name]), name
        if ".router." in name:  # AdamW's first move is lr x g / |g| (plus the decay's lr x wd x w): linear in lr
            torch.testing.assert_close(scaled[name] - weight, 0.25 * (plain[name] - weight), rtol=1e-4, atol=1e-9)
            routers.append(name)
        else:
            assert torch.equal(scaled[name], plain[name]), name
    return routers


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_router_lr_scale_moves_only_the_routers_less(rank_pool, tmp_path, distributed):
    routers = rank_pool(2).run(router_lr_scale_case, str(tmp_path), distributed)
    assert routers[0] == routers[1] and len(routers[0]) == 2  # the two MoE layers of small_config


BASE = ["model.num_moe_experts=8", "model.moe_router_topk=2"]
BAD_ROUTER = [
    (["model.moe_expert_capacity_factor=0"], "model.moe_expert_capacity_factor", "must be > 0"),
    (["model.moe_router_topk=9"], "model.moe_router_topk", "must be in [1, model.num_moe_experts=8]"),
    (["model.moe_router_num_groups=4"], "model.moe_router_group_topk", "must be set with"),
    (["model.moe_router_group_topk=2"], "model.moe_router_num_groups", "must be set with"),
    (["model.moe_router_num_groups=3", "model.moe_router_group_topk=1"], "model.moe_router_num_groups",
     "divide model.num_moe_experts=8"),
    (["model.moe_router_num_groups=4", "model.moe_router_group_topk=5"], "model.moe_router_group_topk",
     "must be in [1, model.moe_router_num_groups=4]"),
    (["model.moe_router_num_groups=4", "model.moe_router_group_topk=0"], "model.moe_router_group_topk",
     "must be in [1"),
    (["model.moe_router_num_groups=2", "model.moe_router_group_topk=2", "model.moe_router_topk=1"],
     "model.moe_router_group_topk", "must be <= model.moe_router_topk=1"),
    (["model.moe_router_num_groups=4", "model.moe_router_group_topk=1", "model.moe_router_topk=3"],
     "model.moe_router_topk", "= 2"),
    (["model.moe_router_enable_expert_bias=true"], "model.moe_router_enable_expert_bias", "'sigmoid'"),
    (["model.moe_router_bias_update_rate=0"], "model.moe_router_bias_update_rate", "must be > 0"),
    (["model.moe_router_lr_scale=0"], "model.moe_router_lr_scale", "must be a finite number > 0"),
    (["model.moe_router_loss_detach_input=true", "model.moe_aux_loss_coeff=0", "model.moe_z_loss_coeff=0"],
     "model.moe_router_loss_detach_input", "needs model.moe_aux_loss_coeff or model.moe_z_loss_coeff > 0"),
    (["model.moe_router_lr_scale=-0.5"], "model.moe_router_lr_scale", "must be a finite number > 0"),
    (["model.num_moe_experts=null", "model.moe_router_lr_scale=0.1"], "model.moe_router_lr_scale",
     "has no effect on a dense model"),
    (["model.num_moe_experts=null", "model.moe_router_force_load_balancing=true"],
     "model.moe_router_force_load_balancing", "has no effect on a dense model"),
]


@pytest.mark.parametrize("overrides,field,fragment", BAD_ROUTER, ids=[" ".join(c[0]) for c in BAD_ROUTER])
def test_bad_router_config_names_the_field(overrides, field, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, BASE + overrides)
    assert info.value.field_name == field and fragment in str(info.value), str(info.value)


def test_router_fields_are_accepted():
    cfg = load_config(None, BASE + [f"{k}={v}" for k, v in ROUTER_CONFIG.items()])
    assert cfg.model.moe_router_score_function == "sigmoid" and cfg.model.moe_router_enable_expert_bias
    load_config(None, BASE + ["model.moe_router_load_balancing_type=global_aux_loss",
                              "model.moe_expert_capacity_factor=1.25", "model.moe_token_drop_policy=position"])
