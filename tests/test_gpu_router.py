"""The merged router kernel compiled for the GPU (`pytest -m gpu`; tests/test_router.py runs it interpreted on CPU)
against its torch twin at the bench models' shapes, the router choosing and forced: the same experts and counts,
the weights within 1e-6; forced, every expert exactly its share.

    CUDA_VISIBLE_DEVICES=0 python -m pytest -m gpu tests/test_gpu_router.py
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap.kernels.router import forced_expert_orders, topk_route, topk_route_torch

pytestmark = pytest.mark.gpu

SHAPES = {"fine": (8192, 64, 8), "mixtral": (4096, 8, 2)}  # tokens, experts, top-k


@pytest.mark.parametrize("forced", [False, True], ids=["chosen", "forced"])
@pytest.mark.parametrize("pre_softmax", [False, True], ids=["mixtral_softmax", "pre_softmax"])
@pytest.mark.parametrize("shape", SHAPES)
def test_router_kernel_equals_its_twin_on_the_gpu(shape, pre_softmax, forced):
    if not torch.cuda.is_available():
        pytest.fail("no CUDA GPU is visible (a GPU test that did not run did not pass)")
    tokens, experts, k = SHAPES[shape]
    logits_TE = torch.randn(tokens, experts, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    orders_ME = forced_expert_orders(experts, "cuda") if forced else None
    probs_TK, experts_TK, copies_E = topk_route(logits_TE, k, pre_softmax, orders_ME)
    want_probs_TK, want_experts_TK, want_copies_E = topk_route_torch(logits_TE, k, pre_softmax, orders_ME)
    assert torch.equal(experts_TK, want_experts_TK)
    assert torch.equal(copies_E, want_copies_E)
    assert float((probs_TK - want_probs_TK).abs().max()) < 1e-6
    if forced:
        assert torch.equal(copies_E, torch.full_like(copies_E, tokens * k // experts))
