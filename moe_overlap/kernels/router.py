"""The softmax router's small kernels merged into one: its top-k, the k weights and the copies per expert.

    topk_route(logits_TE, k, pre_softmax, forced_orders_ME) -> (probs_TK fp32, experts_TK int64, copies_E int64)
        pre_softmax=False (Mixtral): the k largest logits, weighted by a softmax over those k
        pre_softmax=True: a softmax over every expert, its k largest scores as the weights
        forced_orders_ME (benchmarks, :func:`forced_expert_orders`): the experts are not chosen but assigned
        (:func:`forced_experts`), weighted as above from the scores at those experts

A program holds a block of tokens' E logits: k rounds of (largest, its lowest index, masked out), the softmax,
and the k experts added to the counts (integer atomics: the sums do not depend on the order). The separate torch ops
it replaces (topk, gather, softmax, the counts' ones / zeros / scatter-add) are its twin; torch.topk's choice
among equal values is unspecified, the kernel's is the lower expert index. ``TopKRoute`` is the autograd Function:
the backward is the softmax's, in torch (T x E elements, once per layer).
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe_overlap.kernels.launch import max_combine, min_combine, sum_combine

    def _topk_route_kernel(logits_ptr, probs_ptr, experts_ptr, copies_ptr, T, E, K: tl.constexpr,
                           K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                           orders_ptr, M, PRE_SOFTMAX: tl.constexpr, FORCE_BALANCE: tl.constexpr):
        # BLOCK_T tokens per program, a token's E logits along the second axis.
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        cols = tl.arange(0, E_PAD)
        kk = tl.arange(0, K_PAD)
        rows = t < T
        scores = tl.load(logits_ptr + t[:, None] * E + cols[None, :], mask=rows[:, None] & (cols < E)[None, :],
                         other=0.0).to(tl.float32)
        scores = tl.where((cols < E)[None, :], scores, float("-inf"))  # rows past T: zeros, never stored
        if PRE_SOFTMAX:
            shifted = tl.exp(scores - tl.reduce(scores, 1, max_combine)[:, None])
            scores = tl.where((cols < E)[None, :], shifted / tl.reduce(shifted, 1, sum_combine)[:, None], float("-inf"))
        # NaN (a diverged step) ranks below every number and above the chosen and padded -inf: a NaN equals no
        # maximum, and an index past E-1 would send rows out of bounds; the step's non-finite loss reports it
        scores = tl.where(scores == scores, scores, -3.0e38)
        values = tl.full((BLOCK_T, K_PAD), float("-inf"), tl.float32)
        chosen = tl.full((BLOCK_T, K_PAD), 0, tl.int64)
        for k in tl.static_range(K):
            if FORCE_BALANCE:  # assigned, not chosen: forced_experts' window of a shuffled order
                index = tl.load(orders_ptr + ((t // E) % M) * E + (t + k) % E)
                best = tl.reduce(tl.where(cols[None, :] == index[:, None], scores, float("-inf")), 1, max_combine)
            else:
                best = tl.reduce(scores, 1, max_combine)
                index = tl.reduce(tl.where(scores == best[:, None], cols[None, :], E_PAD), 1, min_combine)
            values = tl.where(kk[None, :] == k, best[:, None], values)
            chosen = tl.where(kk[None, :] == k, index[:, None].to(tl.int64), chosen)
            scores = tl.where(cols[None, :] == index[:, None], float("-inf"), scores)
        if PRE_SOFTMAX:
            probs = values
        else:  # a softmax over the k chosen logits
            shifted = tl.exp(values - tl.reduce(values, 1, max_combine)[:, None])
            probs = shifted / tl.reduce(shifted, 1, sum_combine)[:, None]
        out = rows[:, None] & (kk < K)[None, :]
        tl.store(probs_ptr + t[:, None] * K + kk[None, :], probs, mask=out)
        tl.store(experts_ptr + t[:, None] * K + kk[None, :], chosen, mask=out)
        tl.atomic_add(copies_ptr + chosen, tl.full((BLOCK_T, K_PAD), 1, tl.int64), mask=out)

    _topk_route = Kernel(_topk_route_kernel)


FORCED_ORDERS = 16  # shuffled expert orders that forced balancing cycles through, one per block of E tokens


def forced_expert_orders(num_experts: int, device=None) -> torch.Tensor:
    """(FORCED_ORDERS, E) int32: shuffles of the experts (Fisher-Yates over a fixed 64-bit LCG, not torch's
    generator, so every rank, device and torch version holds the same table)."""
    state, orders = 0x9E3779B97F4A7C15, []
    for _ in range(FORCED_ORDERS):
        order = list(range(num_experts))
        for i in range(num_experts - 1, 0, -1):
            state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
            j = (state >> 33) % (i + 1)
            order[i], order[j] = order[j], order[i]
        orders.append(order)
    return torch.tensor(orders, dtype=torch.int32, device=device)


def forced_experts(num_tokens: int, k: int, orders_ME: torch.Tensor) -> torch.Tensor:
    """Forced load balancing: copy j of token t goes to expert order_m[(t + j) mod E], m = (t // E) mod
    FORCED_ORDERS. Each block of E tokens sends every column j to every expert once, so each expert receives
    exactly T*k/E copies when E divides T, and a token's k copies go to k different experts (k <= E). A token's
    experts are a window of a shuffled order, so they spread over the EP ranks as a random top-k's would (the
    fine-grained bench model, 8 of 64 experts: 3.7 of 4 ranks on average at EP=4, as learned routing; a
    round-robin (t*k + j) mod E would keep every token on one rank and make the exchange look cheaper than
    any router makes it)."""
    M, E = orders_ME.shape
    t_T = torch.arange(num_tokens, device=orders_ME.device)
    column_TK = (t_T[:, None] + torch.arange(k, device=orders_ME.device)) % E
    return orders_ME[((t_T // E) % M)[:, None], column_TK].long()


def topk_route_torch(logits_TE: torch.Tensor, k: int, pre_softmax: bool,
                     forced_orders_ME: torch.Tensor | None = None):
    """Twin of :func:`topk_route` (differentiable through torch's own ops)."""
    T, E = logits_TE.shape
    scores_TE = torch.softmax(logits_TE, dim=-1) if pre_softmax else logits_TE  # what the experts are chosen by
    experts_TK = (forced_experts(T, k, forced_orders_ME) if forced_orders_ME is not None
                  else scores_TE.detach().topk(k, dim=-1).indices)
    probs_TK = scores_TE.gather(1, experts_TK)
    if not pre_softmax:  # Mixtral: a softmax over the k chosen logits
        probs_TK = torch.softmax(probs_TK, dim=-1)
    copies_E = torch.zeros(E, dtype=torch.int64, device=logits_TE.device)
    copies_E.scatter_add_(0, experts_TK.flatten(), torch.ones_like(experts_TK.flatten()))
    return probs_TK, experts_TK, copies_E


def topk_route_triton(logits_TE: torch.Tensor, k: int, pre_softmax: bool,
                      forced_orders_ME: torch.Tensor | None = None):
    """The kernel's forward (no autograd)."""
    T, E = logits_TE.shape
    logits = logits_TE.contiguous()
    probs_TK = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    experts_TK = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    copies_E = torch.zeros(E, dtype=torch.int64, device=logits.device)
    if T:
        e_pad = triton.next_power_of_2(E)
        block_t = max(1, min(64, 2048 // e_pad))  # up to 2048 logits a program
        _topk_route[(triton.cdiv(T, block_t),), logits.device](
            logits, probs_TK, experts_TK, copies_E, T, E, K=k, K_PAD=max(2, triton.next_power_of_2(k)), E_PAD=e_pad,
            BLOCK_T=block_t, orders_ptr=copies_E if forced_orders_ME is None else forced_orders_ME,
            M=1 if forced_orders_ME is None else forced_orders_ME.shape[0], PRE_SOFTMAX=pre_softmax,
            FORCE_BALANCE=forced_orders_ME is not None, num_warps=4)
    return probs_TK, experts_TK, copies_E


class TopKRoute(torch.autograd.Function):
    """(probs_TK, experts_TK, copies_E) of the logits; the weights' gradient flows back to the logits."""

    @staticmethod
    def forward(ctx, logits_TE: torch.Tensor, k: int, pre_softmax: bool, forced_orders_ME: torch.Tensor | None = None):
        probs_TK, experts_TK, copies_E = topk_route_triton(logits_TE, k, pre_softmax, forced_orders_ME)
        ctx.save_for_backward(logits_TE if pre_softmax else None, probs_TK, experts_TK)
        ctx.pre_softmax, ctx.experts = pre_softmax, logits_TE.shape[1]
        ctx.mark_non_differentiable(experts_TK, copies_E)
        return probs_TK, experts_TK, copies_E

    @staticmethod
    def backward(ctx, grad_probs_TK: torch.Tensor, _experts, _copies):
        logits_TE, probs_TK, experts_TK = ctx.saved_tensors
        grad_probs_TK = grad_probs_TK.float()
        if ctx.pre_softmax:  # probs are softmax scores gathered: the softmax's backward over every expert
            scores_TE = torch.softmax(logits_TE.float(), dim=-1)
            grad_TE = torch.zeros_like(scores_TE).scatter_(1, experts_TK, grad_probs_TK)
            grad_TE = scores_TE * (grad_TE - (scores_TE * grad_TE).sum(-1, keepdim=True))
        else:  # a softmax over the chosen logits: its backward, scattered to them
            chosen_TK = probs_TK * (grad_probs_TK - (probs_TK * grad_probs_TK).sum(-1, keepdim=True))
            grad_TE = grad_probs_TK.new_zeros((probs_TK.shape[0], ctx.experts)).scatter_(1, experts_TK, chosen_TK)
        return grad_TE, None, None, None


def topk_route(logits_TE: torch.Tensor, k: int, pre_softmax: bool, forced_orders_ME: torch.Tensor | None = None):
    """The kernel (CUDA, or interpreted) through :class:`TopKRoute` on fp32 logits, else the twin (which keeps a
    wider dtype: float64 gradient checks)."""
    if logits_TE.dim() != 2 or not 1 <= k <= logits_TE.shape[1]:
        raise ValueError(f"logits_TE must be (tokens, experts) with 1 <= k <= experts, got {tuple(logits_TE.shape)} "
                         f"and k={k}")
    if logits_TE.dtype == torch.float32 and use_triton(logits_TE, "router"):
        return TopKRoute.apply(logits_TE, k, pre_softmax, forced_orders_ME)
    return topk_route_torch(logits_TE, k, pre_softmax, forced_orders_ME)
