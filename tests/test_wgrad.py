"""Weight gradients accumulated into fp32 main_grad inside the layers (gradient accumulation fusion)."""

from __future__ import annotations

import gc

import pytest
import torch

from moe_overlap.config import load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.kernels.grouped_wgrad import grouped_wgrad_accumulate_torch, grouped_wgrad_accumulate_triton
from moe_overlap.layers.param_info import param_info
from moe_overlap.layers import wgrad
from moe_overlap.layers.wgrad import adds_own_grad, linear_wgrad, mark_own_grad, placeholder
from moe_overlap.models.mixtral import build_model
from moe_overlap.training.dist_optimizer import DistributedOptimizer
from moe_overlap.training.optimizer import MixedPrecisionAdamW


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("expert_loop", [False, True], ids=["program_per_expert", "expert_loop"])
@pytest.mark.parametrize("shape", [(100, 48, 40, 3), (64, 32, 64, 4)], ids=["ragged", "even"])
def test_grouped_wgrad_kernel_matches_twin_and_skips_rows_past_the_last_offset(monkeypatch, shape, expert_loop):
    """Also with each program walking every expert (an overflow chunk's few rows): the same sums."""
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
    grouped_wgrad_accumulate_triton([(a, b, offsets)], got, expert_loop=expert_loop)
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
    first = (torch.randn(50, 24, generator=g), torch.randn(50, 40, generator=g),
             torch.tensor([0, 20, 50], dtype=torch.int32))
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


def test_placeholders_autograd_keeps_without_a_copy_shared_only_under_capture(monkeypatch):
    """Two weights of one shape whose layers add their gradients into main_grad: autograd's gradient of each is the
    placeholder taken as it is (not copied: a copy would be a fresh allocation, and a graphed layer's static
    output), and main_grad still gets the gradient. Eager, each call's placeholder is its own (dropped with the
    hook: nothing stays allocated); under a graph's capture (simulated here) both are aliases of the one
    placeholder of their shape, which goes with the last parameter of that shape."""

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, grad_out):
            x, w = ctx.saved_tensors
            return grad_out @ w, linear_wgrad(w, grad_out, x)

    g = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(2)]
    for w in weights:
        param_info(w).main_grad = torch.zeros(5, 3)
        mark_own_grad(w)
    x = torch.randn(4, 3, generator=g)
    key = ((5, 3), torch.float32, torch.device("cpu"))
    for captured in (False, True):
        monkeypatch.setattr(wgrad, "_capturing", lambda param: captured)
        for w in weights:
            w.grad = None
        (Linear.apply(x, weights[0]) * 2 + Linear.apply(x, weights[1])).sum().backward()
        storage = {w.grad.untyped_storage().data_ptr() for w in weights}
        if captured:
            assert storage == {placeholder(weights[0]).untyped_storage().data_ptr()} and key in wgrad._PLACEHOLDERS
        else:
            assert len(storage) == 2 and key not in wgrad._PLACEHOLDERS
            assert param_info(weights[0]).grad_placeholder is None
    for w, scale in zip(weights, (2.0, 1.0)):
        assert torch.allclose(param_info(w).main_grad, 2 * scale * torch.ones(4, 5).t() @ x)  # both backwards
    del weights, w  # the last parameters of that shape: their placeholder goes with them
    gc.collect()
    assert key not in wgrad._PLACEHOLDERS


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
