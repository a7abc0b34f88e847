"""The training loop's fused kernels (AdamW, RMSNorm, rotary QKV split, cross-entropy) against their torch twins
and against plain torch autograd: interpreted in fp32 on CPU; compiled in bf16 on CUDA (`-m gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_overlap.kernels import adamw as A
from moe_overlap.kernels import cross_entropy as CE
from moe_overlap.kernels import fp8_quant as Q
from moe_overlap.kernels import rmsnorm as N
from moe_overlap.kernels import rope as R


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


HYPER = A.AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def adam_state(n: int, device="cpu"):
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(n, generator=g, device=device), torch.randn(n, generator=g, device=device),
            torch.randn(n, generator=g, device=device) * 0.1, torch.rand(n, generator=g, device=device) * 0.01]


def test_adamw_twin_is_torch_adamw():
    master, grad, exp_avg, exp_avg_sq = adam_state(1000)
    param = master.clone().requires_grad_(True)
    reference = torch.optim.AdamW([param], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                  weight_decay=HYPER.weight_decay)
    reference.state[param] = {"step": torch.tensor(2.0), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    param.grad = grad * 0.5
    reference.step()
    A.adamw_update_torch(master, grad, exp_avg, exp_avg_sq, None, torch.tensor([0.5, 3.0, 1.0]), HYPER)
    assert torch.equal(master, param.detach())
    assert torch.equal(exp_avg, reference.state[param]["exp_avg"])


@pytest.mark.parametrize("apply", [1.0, 0.0])
def test_adamw_kernel_matches_twin_writes_the_copy_and_skips(interpret, apply):
    got, want = adam_state(5000), adam_state(5000)
    control = torch.tensor([0.5, 3.0, apply])
    copy_got, copy_want = torch.zeros(5000, dtype=torch.float16), torch.zeros(5000, dtype=torch.float16)
    A.adamw_update_triton(*got, copy_got, control, HYPER)
    A.adamw_update_torch(*want, copy_want, control, HYPER)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-6
    if apply:  # the copy is the kernel's own master, rounded
        assert torch.equal(copy_got, got[0].half()) and torch.equal(copy_want, want[0].half())
    else:
        assert all(torch.equal(g, w) for g, w in zip(got, adam_state(5000))) and not copy_got.any()


@pytest.mark.parametrize("apply", [1.0, 0.0])
@pytest.mark.parametrize("shape", [(3, 70, 200), (130, 96)], ids=["experts", "matrix"])
@pytest.mark.parametrize("blocks", [None, (2, 64, 8)], ids=["default", "strips"])
def test_adamw_maxima_kernel_steps_as_the_flat_one_and_leaves_the_bf16_maxima(interpret, apply, shape, blocks):
    """With maxima (train.fp8_param): the tiled step writes the master and moments the flat kernel writes, bit for
    bit, and each matrix's row and column maxima of the new weights read as bf16 (the rowwise FP8 copies' first
    pass: quantize_rows_and_columns with them equals it without), also where the step does not apply, with strips
    of several tiles that end past the rows and columns too; the twin agrees."""
    n = torch.Size(shape).numel()
    control = torch.tensor([0.5, 3.0, apply])
    tiled_update = A.adamw_update if blocks is None else (
        lambda *args: A.adamw_maxima_triton(*args[:4], *args[5:], blocks=blocks))
    for update, flat_update in ((tiled_update, A.adamw_update_triton), (A.adamw_update_torch, A.adamw_update_torch)):
        flat = adam_state(n)
        flat_update(*flat, None, control, HYPER)
        tiled = [t.view(shape) for t in adam_state(n)]
        M, K = shape[-2:]
        B = n // (M * K)
        maxima = A.WeightMaxima(torch.full((B * M,), 7.0), torch.full((B * K,), 7.0), torch.bfloat16)
        update(*tiled, None, control, HYPER, maxima)
        assert all(torch.equal(t.reshape(-1), f) for t, f in zip(tiled, flat)), update
        weights = tiled[0].view(B, M, K).to(torch.bfloat16).float().abs()
        assert torch.equal(maxima.rows_BM, weights.amax(-1).reshape(-1)), update
        assert torch.equal(maxima.columns_BK, weights.amax(-2).reshape(-1)), update
        given = Q.quantize_rows_and_columns(tiled[0], as_dtype=torch.bfloat16, amax=(
            maxima.rows_BM.view(*shape[:-1]), maxima.columns_BK.view(*shape[:-2], K)))
        made = Q.quantize_rows_and_columns(tiled[0], as_dtype=torch.bfloat16)
        for (q, scale), (q_want, scale_want) in zip(given, made):
            assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(scale, scale_want)
    with pytest.raises(ValueError, match="maxima in place of a model copy"):
        A.adamw_update(*tiled, tiled[0].half(), control, HYPER, maxima)


def rmsnorm_reference(x, w, eps, dy):
    x, w = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    y.backward(dy.float())
    return y, x.grad, w.grad


@pytest.mark.parametrize("rows,hidden", [(37, 48), (16, 128), (0, 32)])
def test_rmsnorm_kernels_match_twin_and_autograd(interpret, rows, hidden):
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g), torch.randn(rows, hidden,
                                                                                                       generator=g)
    y, rstd = N.rmsnorm_forward_triton(x, w, 1e-5)
    dx, dw = N.rmsnorm_backward_triton(x, w, dy, rstd)
    if rows == 0:
        assert y.shape == (0, hidden) and torch.equal(dw, torch.zeros(hidden))
        return
    ref_y, ref_dx, ref_dw = rmsnorm_reference(x, w, 1e-5, dy)
    assert rel_err(y, ref_y) < 1e-6 and rel_err(dx, ref_dx) < 1e-6 and rel_err(dw, ref_dw) < 1e-6
    twin_y, twin_rstd = N.rmsnorm_forward_torch(x, w, 1e-5)
    assert rel_err(y, twin_y) < 1e-6 and rel_err(N.rmsnorm_backward_torch(x, w, dy, twin_rstd)[0], dx) < 1e-6


def rope_reference(qkv_SF, batch, shards, groups, head_dim, base=10000.0):
    """The obvious formula: split by rearrange, rotate pairs (i, i + D/2) by position x inverse frequency."""
    from einops import rearrange

    seq = qkv_SF.shape[0] // batch
    qkv = rearrange(qkv_SF, "(t b s) (g r d) -> b (t s) g r d", t=shards, b=batch, g=groups, d=head_dim)
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angle = torch.arange(seq).float()[:, None] * inv_freq
    cos, sin = angle.cos()[None, :, None, None, :], angle.sin()[None, :, None, None, :]
    x1, x2 = qkv[..., :head_dim // 2], qkv[..., head_dim // 2:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    q = rearrange(rotated[:, :, :, :-2], "b s g r d -> b s (g r) d")
    return q, rotated[:, :, :, -2], qkv[:, :, :, -1]


@pytest.mark.parametrize("batch,seq,groups,q_per_group,head_dim,shards",
                         [(2, 8, 2, 2, 16, 1), (1, 12, 3, 4, 8, 2), (2, 6, 1, 1, 32, 3)])
def test_rotary_qkv_split_matches_reference_both_ways(interpret, batch, seq, groups, q_per_group, head_dim, shards):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(batch * seq, groups * (q_per_group + 2) * head_dim, generator=g, requires_grad=True)
    cos, sin = R.rotary_tables(torch.arange(seq), head_dim, 10000.0)
    got = R.qkv_rotary_triton(qkv.detach(), cos, sin, batch, shards, groups, head_dim)
    want = rope_reference(qkv, batch, shards, groups, head_dim)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-6
    grads = [torch.randn(w.shape, generator=g) for w in want]
    torch.autograd.backward(want, grads)
    # The gradients as attention returns them: (B, S, heads, D) views of a (B, heads, S, D) tensor.
    strided = [grad.transpose(1, 2).contiguous().transpose(1, 2) for grad in grads]
    assert rel_err(R.qkv_rotary_backward_triton(*strided, cos, sin, shards), qkv.grad) < 1e-6
    assert rel_err(R.qkv_rotary_backward_torch(*grads, cos, sin, shards), qkv.grad) < 1e-6


def test_cross_entropy_kernels_match_torch(interpret):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 10000, generator=g) * 3
    labels = torch.randint(0, 10000, (7,), generator=g)
    local = labels.clone()
    local[2] = -1  # its label lies in another rank's vocabulary block
    max_T, sum_T, label_T = CE.cross_entropy_stats_triton(logits, local)
    for got, want in zip((max_T, sum_T, label_T), CE.cross_entropy_stats_torch(logits, local)):
        assert rel_err(got, want) < 1e-6
    assert label_T[2] == 0
    ones = torch.ones(7)
    grad = CE.cross_entropy_grad_triton(logits, local, max_T, sum_T, ones)
    assert rel_err(grad, CE.cross_entropy_grad_torch(logits, local, max_T, sum_T, ones)) < 1e-6
    scale = torch.rand(7, generator=g)
    assert rel_err(CE.cross_entropy_grad_triton(logits, local, max_T, sum_T, scale), grad * scale[:, None]) < 1e-6
    keep = [0, 1, 3, 4, 5, 6]
    x = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(x[keep], labels[keep], reduction="sum")
    loss.backward()
    assert abs(float((sum_T.log() + max_T - label_T)[keep].sum()) - float(loss)) < 1e-4
    assert rel_err(grad[keep], x.grad[keep]) < 1e-6


# ------------------------------------------------------------------------------------------------ GPU, bf16


def cuda_or_fail():
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")


@pytest.mark.gpu
def test_gpu_adamw_matches_twin():
    cuda_or_fail()
    n = 3 * 2**20 + 17
    got, want = adam_state(n, "cuda"), adam_state(n, "cuda")
    control = torch.tensor([0.5, 3.0, 1.0], device="cuda")
    copy_got = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    copy_want = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    A.adamw_update_triton(*got, copy_got, control, HYPER)
    A.adamw_update_torch(*want, copy_want, control, HYPER)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-6
    assert rel_err(copy_got, copy_want) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", [(8192, 2048), (4096, 4096), (5, 40)])
def test_gpu_rmsnorm_bf16_matches_twin(rows, hidden):
    cuda_or_fail()
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) * 2
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    y, rstd = N.rmsnorm_forward_triton(x, w, 1e-5)
    ref_y, ref_dx, ref_dw = rmsnorm_reference(x, w, 1e-5, dy)
    dx, dw = N.rmsnorm_backward_triton(x, w, dy, rstd)
    assert rel_err(y, ref_y) < 5e-3 and rel_err(dx, ref_dx) < 5e-3 and rel_err(dw, ref_dw) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("batch,seq,groups,q_per_group", [(1, 4096, 8, 4), (2, 4096, 4, 4)])
def test_gpu_rotary_qkv_split_bf16(batch, seq, groups, q_per_group):
    cuda_or_fail()
    head_dim = 128
    qkv = torch.randn(batch * seq, groups * (q_per_group + 2) * head_dim, device="cuda", dtype=torch.bfloat16)
    cos, sin = R.rotary_tables(torch.arange(seq, device="cuda"), head_dim, 10000.0)
    got = R.qkv_rotary_triton(qkv, cos, sin, batch, 1, groups, head_dim)
    want = R.qkv_rotary_torch(qkv, cos, sin, batch, 1, groups, head_dim)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 5e-3
    grads = [torch.randn_like(w).transpose(1, 2).contiguous().transpose(1, 2) for w in want]
    assert rel_err(R.qkv_rotary_backward_triton(*grads, cos, sin, 1),
                   R.qkv_rotary_backward_torch(*grads, cos, sin, 1)) < 5e-3


@pytest.mark.gpu
def test_gpu_cross_entropy_bf16():
    cuda_or_fail()
    logits = (torch.randn(4096, 32000, device="cuda") * 4).to(torch.bfloat16)
    labels = torch.randint(0, 32000, (4096,), device="cuda")
    stats = CE.cross_entropy_stats_triton(logits, labels)
    want = CE.cross_entropy_stats_torch(logits, labels)
    for a, b in zip(stats, want):
        assert rel_err(a, b) < 1e-5
    loss = stats[1].log() + stats[0] - stats[2]
    assert rel_err(loss, F.cross_entropy(logits.float(), labels, reduction="none")) < 1e-5
    scale = torch.full((4096,), 1 / 4096, device="cuda")
    grad = CE.cross_entropy_grad_triton(logits, labels, stats[0], stats[1], scale)
    assert rel_err(grad, CE.cross_entropy_grad_torch(logits, labels, stats[0], stats[1], scale)) < 5e-3
