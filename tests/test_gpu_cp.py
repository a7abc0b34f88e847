"""Ring attention's block kernels on one GPU (`pytest -m gpu`; any GPU count, one is enough): every CP rank's blocks
in one process (CP=2 and CP=4, bf16), with the log-sum-exp from the flash, cuDNN and efficient SDPA ops, merged and
backpropagated as the ring does, against one full attention. The bf16 rule, per tensor (output, dq, dk, dv):
the blockwise error against an fp32 full attention at most 2x that of one bf16 full attention (SDPA, as the model
runs it at CP=1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe_overlap.distributed.context_parallel import split_sequence
from moe_overlap.layers.ring_attention import KERNELS, blockwise_backward, blockwise_forward

pytestmark = pytest.mark.gpu

BATCH, HEADS, KV_HEADS, SEQ, DIM = 1, 16, 4, 8192, 128


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def sdpa_with_grads(q, k, v, dout):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kernel", ["flash", "cudnn", "efficient"])
def test_blockwise_bf16_within_twice_full_attention_error(kernel, cp):
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU")  # a GPU test that did not run did not pass
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(BATCH, heads, SEQ, DIM, device="cuda", generator=g)
                     for heads in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    reference = sdpa_with_grads(q, k, v, dout)  # fp32
    bf16 = [x.bfloat16() for x in (q, k, v, dout)]
    full_bf16 = sdpa_with_grads(*bf16)
    parts = [[split_sequence(x, 2, r, cp) for x in bf16] for r in range(cp)]
    qs, douts = [p[0] for p in parts], [p[3] for p in parts]
    kvs = [torch.stack((p[1], p[2])) for p in parts]
    scale = 1 / math.sqrt(DIM)
    forward = blockwise_forward(qs, kvs, KERNELS[kernel], scale)
    dqs, dkvs = blockwise_backward(douts, qs, kvs, forward, KERNELS[kernel], scale)
    order = torch.argsort(torch.cat([split_sequence(torch.arange(SEQ), 0, r, cp) for r in range(cp)])).cuda()

    def whole(local_parts):  # the ranks' local sequences back in sequence order
        return torch.cat(local_parts, 2)[:, :, order]

    blockwise = (whole([out for out, _, _ in forward]), whole(dqs), whole([dkv[0] for dkv in dkvs]),
                 whole([dkv[1] for dkv in dkvs]))
    report = {}
    for name, got, full, want in zip(("out", "dq", "dk", "dv"), blockwise, full_bf16, reference):
        report[name] = (rel(got, want), rel(full, want))
    print(kernel, cp, {name: f"{a:.2e} vs full {b:.2e}" for name, (a, b) in report.items()})
    for name, (blockwise_err, full_err) in report.items():
        assert blockwise_err <= 2 * full_err, (name, report)
