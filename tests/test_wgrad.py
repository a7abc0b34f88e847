"""Weight gradients accumulated into fp32 main_grad inside the layers (gradient accumulation fusion)."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.config import load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.kernels.grouped_wgrad import (TokenRows, grouped_wgrad_accumulate_torch,
                                              grouped_wgrad_accumulate_triton)
from moe_overlap.layers.param_info import param_info
from moe_overlap.layers.wgrad import adds_own_grad
from moe_overlap.models.mixtral import build_model
from moe_overlap.training.dist_optimizer import DistributedOptimizer
from moe_overlap.training.optimizer import MixedPrecisionAdamW


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("shape", [(100, 48, 40, 3), (64, 32, 64, 4)], ids=["ragged", "even"])
def test_grouped_wgrad_kernel_matches_twin_and_skips_rows_past_the_last_offset(monkeypatch, shape):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows, m, n, experts = shape
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows + 8, m, generator=g), torch.randn(rows + 8, n, generator=g)
    a[rows:], b[rows:] = float("nan"), float("nan")  # a static worst-case buffer's unwritten tail
    ends = sorted(torch.randint(0, rows + 1, (experts - 1,), generator=g).tolist()) + [rows]
    ends[0] = 0  # expert 0 receives nothing
    offsets = torch.tensor(ends, dtype=torch.int32)
    start = torch.randn(experts, m, n, generator=g)
    got, want = start.clone(), start.clone()
    grouped_wgrad_accumulate_triton([(a, b, offsets)], got)
    grouped_wgrad_accumulate_torch([(a[:rows], b[:rows], offsets)], want)
    assert torch.isfinite(got).all()
    assert torch.equal(got[0], start[0])  # an expert without rows: untouched
    assert rel_err(got - start, want - start) < 1e-6


@pytest.mark.parametrize("segments", [2, 4])
def test_grouped_wgrad_kernel_sums_micro_batches(monkeypatch, segments):
    """Two or four segments (micro-batches' rows, each with its own offsets and row stride) add what as many calls
    add."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(1)
    first = (torch.randn(50, 24, generator=g), torch.randn(50, 40, generator=g), torch.tensor([0, 20, 50], dtype=torch.int32))
    wide = torch.randn(30, 32, generator=g)  # a strided view: row stride 32, 24 columns
    second = (wide[:, :24], torch.randn(30, 40, generator=g), torch.tensor([10, 10, 30], dtype=torch.int32))
    more = [(torch.randn(20, 24, generator=g), torch.randn(20, 40, generator=g), torch.tensor(ends, dtype=torch.int32))
            for ends in ([5, 19, 20], [0, 0, 20])]
    parts = [first, second, *more][:segments]
    start = torch.randn(3, 24, 40, generator=g)
    got, want = start.clone(), start.clone()
    grouped_wgrad_accumulate_triton(parts, got)
    for part in parts:
        grouped_wgrad_accumulate_torch([part], want)
    assert rel_err(got - start, want - start) < 1e-6


def token_rows_segment(g: torch.Generator, tokens: int, copies: int, m: int, n: int, experts: int,
                       device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[tuple, tuple]:
    """One micro-batch's weight-gradient operands both ways: gathered from token rows (TokenRows: a the tokens'
    rows, b each copy's probability times its token's gradient) and written out, rows sorted by expert."""
    x_TH = torch.randn(tokens, m, generator=g, device=device).to(dtype)
    grad_TH = torch.randn(tokens, n, generator=g, device=device).to(dtype)
    probs_C = torch.rand(tokens * copies, generator=g, device=device)
    experts_C = torch.randint(0, experts, (tokens * copies,), generator=g, device=device)
    copy_R = torch.sort(experts_C, stable=True).indices.to(torch.int32)  # rows in expert order
    offsets = torch.cumsum(torch.bincount(experts_C, minlength=experts), 0).to(torch.int32)
    gathered = (TokenRows(x_TH, copy_R, copies), TokenRows(grad_TH, copy_R, copies, probs_C), offsets)
    return gathered, (gathered[0].rows(), gathered[1].rows(), offsets)


def test_token_rows_are_the_rows_permute_and_unpermute_backward_write():
    """TokenRows' twin: a's rows are kernels/permute.permute's rows, b's what unpermute_backward writes."""
    from moe_overlap.kernels.permute import permute_torch, unpermute_backward_torch
    g = torch.Generator().manual_seed(4)
    (a, b, _), _ = token_rows_segment(g, 10, 3, 8, 6, 4, dtype=torch.bfloat16)
    row_of_copy = torch.empty(30, dtype=torch.int64)
    row_of_copy[a.copy_R.long()] = torch.arange(30)
    row_of_copy_TK = row_of_copy.view(10, 3)
    assert torch.equal(a.rows(), permute_torch(a.tokens_TH, row_of_copy_TK, 30, True))
    want, _ = unpermute_backward_torch(b.tokens_TH, None, row_of_copy_TK, b.scale_C.view(10, 3), True, num_rows=30)
    assert torch.equal(b.rows(), want)


@pytest.mark.parametrize("scale_side", ["b", "a"])
@pytest.mark.parametrize("segments", [1, 2])
def test_grouped_wgrad_kernel_gathers_token_rows(monkeypatch, segments, scale_side):
    """Operands given as TokenRows (gathered as the kernel reads them, b's scaled per copy: on b's rows, or on a's,
    the same product) add what their rows written out add."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(2)
    parts = [token_rows_segment(g, 13, 3, 24, 40, 4) for _ in range(segments)]
    start = torch.randn(4, 24, 40, generator=g)
    got, want = start.clone(), start.clone()
    grouped_wgrad_accumulate_triton([gathered for gathered, _ in parts], got, scale_side=scale_side)
    grouped_wgrad_accumulate_triton([written for _, written in parts], want)
    assert rel_err(got - start, want - start) < 1e-6
    twin = start.clone()
    grouped_wgrad_accumulate_torch([gathered for gathered, _ in parts], twin)
    assert rel_err(twin - start, want - start) < 1e-5
    with pytest.raises(ValueError, match="gathered in some segments"):
        grouped_wgrad_accumulate_triton([parts[0][0], parts[0][1]], start.clone())


def model_grads(with_optimizer: bool, group: int = 1, distributed: bool = False,
                micro_batches: int = 2) -> dict[str, torch.Tensor]:
    overrides = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
                 "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=16",
                 "model.num_moe_experts=4", "model.moe_layer_freq=[0,1]", "model.moe_ffn_hidden_size=32",
                 "model.moe_shared_expert_intermediate_size=16", "model.share_embeddings_and_output_weights=true",
                 "parallel.expert_model_parallel_size=1"]
    cfg = load_config(None, overrides)
    model = build_model(cfg.model, Mesh.single(), "cpu", torch.float32, seed=3)
    optimizer = None
    if with_optimizer:
        if group > 1:
            model.group_expert_wgrads(group)
        optimizer = (DistributedOptimizer(model, Mesh.single(), cfg.train, cfg.overlap) if distributed
                     else MixedPrecisionAdamW(model, Mesh.single(), cfg.train))
    g = torch.Generator().manual_seed(5)
    for index in range(micro_batches):  # main_grad sums them
        model.start_micro_batch(first=index == 0, last=index == micro_batches - 1)
        ids = torch.randint(0, 256, (2, 16), generator=g)
        model(ids, torch.roll(ids, -1, 1)).loss.backward()
    if optimizer is None:
        return {name: p.grad for name, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())  # the hooks dropped autograd's copies
    assert any(adds_own_grad(p) for p in model.parameters())
    return {name: param_info(p).main_grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("group,distributed,micro_batches", [(1, False, 2), (2, False, 3), (2, True, 4),
                                                              (2, False, 1), (3, False, 5), (4, True, 4)],
                         ids=["plain", "pairs_odd", "pairs_distributed_optimizer", "pairs_one_micro_batch",
                              "threes_remainder", "fours_distributed_optimizer"])
def test_main_grad_holds_the_autograd_gradients_summed_over_micro_batches(group, distributed, micro_batches):
    """Every parameter, the tied embedding (lookup and output GEMM) and the experts included: what the layers add
    into main_grad equals what plain autograd accumulates in .grad; with the experts' weight gradients summed
    several micro-batches at a time too (train.expert_wgrad_micro_batches: an odd count, a single micro-batch and a
    count the group does not divide leave none waiting)."""
    fused = model_grads(True, group, distributed, micro_batches)
    plain = model_grads(False, micro_batches=micro_batches)
    assert fused.keys() == plain.keys()
    for name, grad in plain.items():
        assert rel_err(fused[name], grad) < 1e-6, name


@pytest.mark.gpu
@pytest.mark.parametrize("rows,m,n,experts", [(8192, 4096, 2 * 14336 // 4, 8), (65536, 2048, 2048, 64),
                                              (1000, 72, 40, 3)], ids=["mixtral_fc1_quarter", "fine_fc1", "ragged"])
def test_gpu_grouped_wgrad_bf16_matches_twin(rows, m, n, experts):
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(rows + 64, m, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(rows + 64, n, device="cuda", generator=g).to(torch.bfloat16)
    a[rows:], b[rows:] = float("nan"), float("nan")  # the worst-case buffer's tail is never read
    ends = torch.sort(torch.randint(0, rows + 1, (experts,), device="cuda", generator=g)).values
    ends[0], ends[-1] = 0, rows
    offsets = ends.to(torch.int32)
    start = torch.randn(experts, m, n, device="cuda", generator=g)
    got, want = start.clone(), start.clone()
    grouped_wgrad_accumulate_triton([(a, b, offsets)], got)
    grouped_wgrad_accumulate_torch([(a[:rows], b[:rows], offsets)], want)
    assert torch.isfinite(got).all() and torch.equal(got[0], start[0])
    assert rel_err(got - start, want - start) < 5e-3  # the twin rounds its product to bf16 first


@pytest.mark.gpu
def test_gpu_grouped_wgrad_gathers_token_rows_bit_for_bit():
    """The fine model's fc1 and fc2 weight gradients at one EP rank (8,192 tokens, 8 copies, 64 experts), operands
    gathered from token rows: bit for bit the kernel on the rows written out (the same products in the same order)."""
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(3)
    for m, n in ((2048, 2048), (1024, 2048)):
        gathered, written = token_rows_segment(g, 8192, 8, m, n, 64, "cuda", torch.bfloat16)
        start = torch.randn(64, m, n, device="cuda", generator=g)
        got, want = start.clone(), start.clone()
        grouped_wgrad_accumulate_triton([gathered], got)
        grouped_wgrad_accumulate_triton([written], want)
        assert torch.equal(got, want)
