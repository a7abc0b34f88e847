"""The merged router kernel compiled for the GPU (`pytest -m gpu`; tests/test_router.py runs it interpreted on CPU)
against its torch twin at the bench models' shapes, the router choosing and forced: the same experts and counts,
the weights within 1e-6; forced, every expert exactly its share. The bf16 router's logits on the tensor cores
against the fp64 products and the fp32 GEMM they replace.

    CUDA_VISIBLE_DEVICES=0 python -m pytest -m gpu tests/test_gpu_router.py
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap.kernels.router import forced_expert_orders, topk_route, topk_route_torch
from moe_overlap.layers.router import Bf16Logits
from tests.test_router import bf16_rounded_sums

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


@pytest.mark.parametrize("shape", [(8192, 2048, 64), (4096, 4096, 8)], ids=["fine", "mixtral"])
def test_bf16_router_logits_on_tensor_cores_are_the_fp32_gemms(shape):
    """Bf16Logits on the GPU (cuBLAS, bf16 in, fp32 out): the logits within the fp32 sums' error bound (2^-20 of the
    summed magnitudes; the tensor cores' sums measured 1.1e-5 on logits of about 1, 2026-11-28) of the fp64 products,
    and within twice it of the fp32 GEMM of the values cast up (the router's path before); both gradients within
    half a bf16 step (plus the fp32 sums' error) of fp64's."""
    T, H, E = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(E, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    logits = Bf16Logits.apply(x, w)
    want = x.detach().double() @ w.detach().double().t()
    fp32_sums = 2.0 ** -20 * (x.detach().double().abs() @ w.detach().double().abs().t())  # fp32 sums' error bound
    assert ((logits.double() - want).abs() <= fp32_sums).all()
    fp32 = torch.nn.functional.linear(x.detach().float(), w.detach().float())
    assert ((logits.double() - fp32.double()).abs() <= 2 * fp32_sums).all()
    assert not ((logits.detach().to(torch.bfloat16).double() - want).abs() <= fp32_sums).all()  # tells bf16's apart
    grad = torch.randn(T, E, device="cuda", generator=g) * 1e-4
    logits.backward(grad)
    assert bf16_rounded_sums(x.grad, grad, w.detach()) and bf16_rounded_sums(w.grad, grad.t(), x.detach())
