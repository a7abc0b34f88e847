"""Cross-entropy over (a vocabulary block of) logits in their own dtype, fp32 arithmetic: per row the max, the
sum of exponentials and the label's logit in one pass (online softmax) forward; backward, one pass that writes
(softmax - onehot) x the row's loss gradient in the logits' dtype. The eager version made an fp32 copy of the
logits and kept an fp32 softmax for the backward: many full passes over (tokens x vocabulary) and twice the
memory.

Vocabulary-parallel (TP > 1): each rank's block gives partial statistics, combined across the TP group
between the two passes (layers/embedding.py).
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe_overlap.kernels.launch import max_combine as _max_combine
    from moe_overlap.kernels.launch import sum_combine as _sum_combine

    def _ce_stats_kernel(logits_ptr, labels_ptr, max_ptr, sum_ptr, label_logit_ptr, V, stride,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        m = tl.load(base).to(tl.float32)  # any start below the max will do
        s = m * 0.0
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.reduce(x, 0, _max_combine))
            s = s * tl.exp(m - new_m) + tl.reduce(tl.exp(x - new_m), 0, _sum_combine)
            m = new_m
        label = tl.load(labels_ptr + row)
        label_logit = tl.load(base + tl.maximum(label, 0)).to(tl.float32)
        tl.store(max_ptr + row, m)
        tl.store(sum_ptr + row, s)
        tl.store(label_logit_ptr + row, tl.where(label >= 0, label_logit, 0.0))

    def _ce_grad_kernel(logits_ptr, labels_ptr, max_ptr, sum_ptr, scale_ptr, grad_ptr, V, stride,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(logits_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - tl.load(max_ptr + row)) / tl.load(sum_ptr + row)
        p = tl.where(cols == tl.load(labels_ptr + row), p - 1.0, p) * tl.load(scale_ptr + row)
        tl.store(grad_ptr + row * V + cols, p.to(grad_ptr.dtype.element_ty), mask=mask)

    _stats = Kernel(_ce_stats_kernel)
    _grad = Kernel(_ce_grad_kernel)

_BLOCK = 4096


def cross_entropy_stats_torch(logits_TV: torch.Tensor, labels_T: torch.Tensor):
    x = logits_TV.float()
    max_T = x.max(-1).values
    label_T = torch.where(labels_T >= 0, x.gather(1, labels_T.clamp(min=0)[:, None]).squeeze(1), 0.0)
    return max_T, (x - max_T[:, None]).exp().sum(-1), label_T


def cross_entropy_grad_torch(logits_TV, labels_T, max_T, sum_T, scale_T) -> torch.Tensor:
    grad = (logits_TV.float() - max_T[:, None]).exp_().div_(sum_T[:, None])
    inside = labels_T >= 0
    rows = torch.arange(grad.shape[0], device=grad.device)
    grad[rows, labels_T.clamp(min=0)] -= inside.to(grad.dtype)
    return grad.mul_(scale_T[:, None]).to(logits_TV.dtype)


def _checked(logits_TV: torch.Tensor) -> torch.Tensor:
    return logits_TV if logits_TV.stride(1) == 1 else logits_TV.contiguous()


def cross_entropy_stats_triton(logits_TV: torch.Tensor, labels_T: torch.Tensor):
    logits_TV = _checked(logits_TV)
    rows, vocab = logits_TV.shape
    max_T, sum_T, label_T = (torch.empty(rows, dtype=torch.float32, device=logits_TV.device) for _ in range(3))
    if rows and vocab:
        _stats[(rows,), logits_TV.device](logits_TV, labels_T.contiguous(), max_T, sum_T, label_T, vocab,
                                          logits_TV.stride(0), BLOCK=_BLOCK, num_warps=8)
    return max_T, sum_T, label_T


def cross_entropy_grad_triton(logits_TV, labels_T, max_T, sum_T, scale_T) -> torch.Tensor:
    logits_TV = _checked(logits_TV)
    rows, vocab = logits_TV.shape
    grad_TV = torch.empty((rows, vocab), dtype=logits_TV.dtype, device=logits_TV.device)
    if rows and vocab:
        _grad[(rows, triton.cdiv(vocab, _BLOCK)), logits_TV.device](
            logits_TV, labels_T.contiguous(), max_T, sum_T, scale_T.float().contiguous(), grad_TV, vocab,
            logits_TV.stride(0), BLOCK=_BLOCK, num_warps=8)
    return grad_TV


def cross_entropy_stats(logits_TV: torch.Tensor, labels_T: torch.Tensor):
    """Per row, fp32: the max logit, the sum of exp(logit - max), and the logit of the label (``labels_T``:
    column in this block, -1 when the label lies in another rank's block, whose logit then counts 0)."""
    if use_triton(logits_TV, "cross_entropy"):
        return cross_entropy_stats_triton(logits_TV, labels_T)
    return cross_entropy_stats_torch(logits_TV, labels_T)


def cross_entropy_grad(logits_TV: torch.Tensor, labels_T: torch.Tensor, max_T: torch.Tensor, sum_T: torch.Tensor,
                       scale_T: torch.Tensor) -> torch.Tensor:
    """(softmax(logits) - onehot(label)) x scale per row (the loss's gradient), in the logits' dtype, from the
    (global) max and sum."""
    if use_triton(logits_TV, "cross_entropy"):
        return cross_entropy_grad_triton(logits_TV, labels_T, max_T, sum_T, scale_T)
    return cross_entropy_grad_torch(logits_TV, labels_T, max_T, sum_T, scale_T)
