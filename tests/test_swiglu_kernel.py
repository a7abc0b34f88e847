"""The fused SwiGLU kernels against their torch twins (interpreter, fp32) and autograd; bf16 on GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_overlap.kernels import swiglu as S


def reference(h_TF2: torch.Tensor, grad_a_TF: torch.Tensor):
    h = h_TF2.detach().double().requires_grad_(True)
    gate, up = h.chunk(2, dim=-1)
    a = F.silu(gate) * up
    a.backward(grad_a_TF.double())
    return a, h.grad


@pytest.mark.parametrize("rows,ffn", [(0, 8), (1, 8), (7, 24), (33, 72)])
def test_kernels_match_twin_and_autograd_in_the_interpreter(monkeypatch, rows, ffn):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 2 * ffn, generator=g) * 3
    grad_a = torch.randn(rows, ffn, generator=g)
    want_a, want_grad_h = reference(h, grad_a)
    for forward, backward in ((S.swiglu_forward_triton, S.swiglu_backward_triton),
                              (S.swiglu_forward_torch, S.swiglu_backward_torch)):
        a = forward(h)
        grad_h, a_again = backward(h, grad_a)
        torch.testing.assert_close(a.double(), want_a.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a_again, a, rtol=0, atol=0)
        torch.testing.assert_close(grad_h.double(), want_grad_h, rtol=1e-5, atol=1e-6)


def test_kernels_compute_only_the_counted_rows(monkeypatch):
    """A static worst-case buffer: rows past ``valid_rows`` are skipped (NaN there stays out of the rest)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(3)
    h, grad_a = torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)
    h[9:], grad_a[9:] = float("nan"), float("nan")
    valid = torch.tensor([9])
    a = S.swiglu_forward_triton(h, valid)
    grad_h, a_again = S.swiglu_backward_triton(h, grad_a, valid)
    torch.testing.assert_close(a[:9], S.swiglu_forward_torch(h[:9]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a_again[:9], a[:9], rtol=0, atol=0)
    torch.testing.assert_close(grad_h[:9], S.swiglu_backward_torch(h[:9], grad_a[:9])[0], rtol=1e-6, atol=1e-6)
    full = S.swiglu_forward_triton(h)  # no count: every row, NaN ones included
    assert full[9:].isnan().all()


def test_dispatch_picks_the_twin_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h = torch.randn(4, 16)
    assert not S.use_triton(h, "swiglu")
    torch.testing.assert_close(S.swiglu_forward(h), S.swiglu_forward_torch(h))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,ffn", [(8192, 14336), (4096 * 8, 2048), (5, 24)])
def test_bf16_kernels_match_the_twin_on_gpu(rows, ffn):
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    h = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16) * 3
    grad_a = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(S.swiglu_forward_triton(h), S.swiglu_forward_torch(h), rtol=1.6e-2, atol=1e-2)
    got, want = S.swiglu_backward_triton(h, grad_a), S.swiglu_backward_torch(h, grad_a)
    for g, w in zip(got, want):
        assert float((g.float() - w.float()).norm() / w.float().norm()) < 5e-3
