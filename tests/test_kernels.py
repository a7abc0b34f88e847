"""Permute / unpermute kernels: Triton (interpreted on CPU, fp32) against the torch twins, the twins against
brute-force references; on CUDA (`-m gpu`), bf16 Triton kernels against the twins at realistic sizes.

How the interpreter is switched on: `moe_overlap.kernels.permute` builds every kernel both ways (compiled and
interpreted) and picks per launch: interpreted whenever the tensors are not on CUDA or TRITON_INTERPRET=1 is set
at call time. Its kernels call only triton builtins, so this works even when triton was imported earlier in
the process without TRITON_INTERPRET (the usual case under pytest: other test modules import triton first).
The autouse fixture below sets TRITON_INTERPRET=1 for each CPU test (restored afterwards, so it never leaks
into other modules), which also routes the dispatching functions (`permute`, `Permute`, ...) to Triton.
`test_interpreter_set_before_triton_import` covers the other way in, in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_overlap.kernels import copy_rows as CR
from moe_overlap.kernels import permute as P

REPO_ROOT = Path(__file__).resolve().parent.parent
# The interpreter converts runtime loop bounds with int(1-element array), which numpy 1.25+ deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

needs_triton = pytest.mark.skipif(not P.HAVE_TRITON, reason="triton is not installed (pip install -e .[test])")


def cuda_and_triton_or_fail() -> None:
    """GPU tests fail without CUDA or triton: a GPU test that did not run did not pass."""
    if not (torch.cuda.is_available() and P.HAVE_TRITON):
        pytest.fail("needs CUDA and triton")


@pytest.fixture(autouse=True)
def _interpret_on_cpu(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_close_normwise(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    if b.numel() == 0:
        return
    assert torch.isfinite(a).all()
    if b.norm() == 0:
        assert a.norm() == 0
    else:
        assert rel_err(a, b) <= tol, rel_err(a, b)


# ----------------------------------------------------------------------------------------------------------
# Routing cases and brute-force references
# ----------------------------------------------------------------------------------------------------------

def make_experts(T: int, K: int, E: int, kind: str, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """(T, K) int64 expert ids; distinct per token (top-k) unless kind says otherwise."""
    if kind == "one_expert":  # every copy to expert E - 1 (repeats within a token, too)
        return torch.full((T, K), E - 1, dtype=torch.int64, device=device)
    scores = torch.rand((T, E), generator=gen, device="cpu")
    if kind == "empty_expert":
        scores[:, 1] = -1.0  # expert 1 never chosen (needs K < E)
    elif kind == "skewed":
        scores[:, 0] += 0.6
    experts = scores.topk(K, dim=1).indices
    if kind == "repeats":  # not a top-k: ids may repeat inside a token
        experts = torch.randint(0, E, (T, K), generator=gen)
    return experts.to(device)


def ref_positions(experts_TK, E, keep_TK=None):
    """Loop: position = copies of the same expert seen before in flat order."""
    T, K = experts_TK.shape
    pos = torch.full((T, K), -1, dtype=torch.int32)
    counts = [0] * E
    for t in range(T):
        for k in range(K):
            e = int(experts_TK[t, k])
            if 0 <= e < E and (keep_TK is None or bool(keep_TK[t, k])):
                pos[t, k] = counts[e]
                counts[e] += 1
    return pos, torch.tensor(counts, dtype=torch.int64)


def ref_rows_argsort(experts_TK, E, capacity=None, keep_TK=None):
    """Rows from a stable argsort of the (kept) copies by expert: the row of the j-th copy in sorted order is j
    (dropless), or e*C + (j - first sorted index of e) while that is < C (capacity)."""
    flat = experts_TK.reshape(-1).clone()
    valid = (flat >= 0) & (flat < E)
    if keep_TK is not None:
        valid &= keep_TK.reshape(-1)
    key = torch.where(valid, flat, E)
    order = torch.argsort(key, stable=True)
    n_valid = int(valid.sum())
    rows = torch.full_like(flat, -1)
    if capacity is None:
        rows[order[:n_valid]] = torch.arange(n_valid)
    else:
        sorted_e = key[order[:n_valid]]
        first = torch.searchsorted(sorted_e, sorted_e, right=False)
        pos = torch.arange(n_valid) - first
        rows[order[:n_valid]] = torch.where(pos < capacity, sorted_e * capacity + pos, -1)
    return rows.view(experts_TK.shape).to(torch.int32)


def ref_permute(x_TH, rows_TK, R):
    out = torch.zeros((R, x_TH.shape[1]), dtype=x_TH.dtype)
    for t in range(rows_TK.shape[0]):
        for k in range(rows_TK.shape[1]):
            r = int(rows_TK[t, k])
            if r >= 0:
                out[r] = x_TH[t]
    return out


def ref_unpermute(y_RH, rows_TK, probs_TK):
    """Also the permute backward with probs = 1; float64."""
    T, K = rows_TK.shape
    out = torch.zeros((T, y_RH.shape[1]), dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            r = int(rows_TK[t, k])
            if r >= 0:
                out[t] += float(probs_TK[t, k]) * y_RH[r].double()
    return out


def ref_unpermute_backward(grad_out_TH, y_RH, rows_TK, probs_TK):
    T, K = rows_TK.shape
    grad_y = torch.zeros(y_RH.shape, dtype=torch.float64)
    grad_p = torch.zeros((T, K), dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            r = int(rows_TK[t, k])
            if r >= 0:
                grad_y[r] = float(probs_TK[t, k]) * grad_out_TH[t].double()
                grad_p[t, k] = (y_RH[r].double() * grad_out_TH[t].double()).sum()
    return grad_y, grad_p


# ----------------------------------------------------------------------------------------------------------
# Index computation
# ----------------------------------------------------------------------------------------------------------

ROUTING_CASES = [
    # T, K, E, kind
    (0, 2, 4, "random"),
    (1, 1, 4, "random"),
    (1, 8, 8, "random"),
    (5, 3, 7, "random"),
    (40, 2, 8, "random"),
    (33, 4, 6, "empty_expert"),
    (29, 8, 8, "one_expert"),
    (50, 5, 40, "skewed"),
    (37, 3, 5, "repeats"),
    (17, 2, 256, "random"),
    (300, 8, 64, "skewed"),
]


@needs_triton
@pytest.mark.parametrize("T,K,E,kind", ROUTING_CASES)
@pytest.mark.parametrize("with_keep", [False, True])
def test_copy_positions_triton_twin_and_reference(T, K, E, kind, with_keep):
    gen = torch.Generator().manual_seed(T * 1000 + K * 10 + E)
    experts = make_experts(T, K, E, kind, gen)
    keep = (torch.rand((T, K), generator=gen) > 0.3) if with_keep else None
    ref_pos, ref_counts = ref_positions(experts, E, keep)
    pos_twin, counts_twin = CR.copy_positions_torch(experts, E, keep)
    assert pos_twin.dtype == torch.int32 and counts_twin.dtype == torch.int64
    assert torch.equal(pos_twin, ref_pos) and torch.equal(counts_twin, ref_counts)
    for block_n in (16, 64):  # several blocks per expert, and one block
        pos, counts = CR.copy_positions_triton(experts, E, keep, block_n=block_n)
        assert pos.dtype == torch.int32 and counts.dtype == torch.int64
        assert torch.equal(pos, ref_pos), block_n
        assert torch.equal(counts, ref_counts), block_n
    pos, counts = CR.copy_positions(experts, E, keep)  # dispatches to Triton under TRITON_INTERPRET=1
    assert torch.equal(pos, ref_pos) and torch.equal(counts, ref_counts)


@needs_triton
def test_copy_positions_ignore_out_of_range_experts():
    experts = torch.tensor([[0, -1], [3, 1], [1, 9]])  # -1 and 9 are not experts of E=4: not counted
    pos, counts = CR.copy_positions_triton(experts, 4, block_n=16)
    assert pos.tolist() == [[0, -1], [0, 0], [1, -1]]
    assert counts.tolist() == [1, 2, 0, 1]
    pos_twin, counts_twin = CR.copy_positions_torch(experts, 4)
    assert torch.equal(pos, pos_twin) and torch.equal(counts, counts_twin)


ROWS_CASES = [(*case, capacity) for case in ROUTING_CASES[:-1] for capacity in (None, 0, 3, 1000)]
ROWS_CASES += [(*ROUTING_CASES[-1], capacity) for capacity in (None, 3)]  # the large one: keep it short


@needs_triton
@pytest.mark.parametrize("T,K,E,kind,capacity", ROWS_CASES)
def test_rows_dropless_and_capacity(T, K, E, kind, capacity):
    gen = torch.Generator().manual_seed(7 + T + K + E)
    experts = make_experts(T, K, E, kind, gen)
    for keep in (None, torch.rand((T, K), generator=gen) > 0.4):
        expected = ref_rows_argsort(experts, E, capacity, keep)
        pos, counts = CR.copy_positions_torch(experts, E, keep)
        rows, rows_per_expert = CR.rows_from_positions(experts, pos, counts, capacity, keep)
        assert rows.dtype == torch.int32 and torch.equal(rows, expected)
        if capacity is None:
            assert torch.equal(rows_per_expert, counts)
        else:
            assert rows_per_expert.tolist() == [capacity] * E
        twin = CR.copy_rows_torch(experts, E, capacity, keep)
        assert torch.equal(twin[0], expected) and torch.equal(twin[1], counts) and torch.equal(twin[2], rows_per_expert)
        for block_n in ((16, 64) if T * K <= 512 else (64,)):
            fused = CR.copy_rows_triton(experts, E, capacity, keep, block_n=block_n)
            assert fused[0].dtype == torch.int32
            for a, b in zip(fused, twin):
                assert torch.equal(a, b), block_n
        assert all(torch.equal(a, b) for a, b in zip(CR.copy_rows(experts, E, capacity, keep), twin))
        # every kept row appears once; dropless rows are exactly 0..sum(counts)-1
        valid_rows = rows[rows >= 0]
        assert valid_rows.unique().numel() == valid_rows.numel()
        if capacity is None:
            assert torch.equal(valid_rows.sort().values, torch.arange(int(counts.sum()), dtype=torch.int32))


# ----------------------------------------------------------------------------------------------------------
# Permute / unpermute
# ----------------------------------------------------------------------------------------------------------

LAYOUT_CASES = [
    # T, K, E, H, kind, layout, block_h (None: the default tile)
    (0, 2, 4, 24, "random", "dropless", None),
    (0, 2, 4, 24, "random", "capacity", None),  # no tokens, but rows (a chunk without tokens)
    (1, 1, 4, 24, "random", "dropless", None),
    (6, 3, 5, 72, "random", "dropless", 32),
    (9, 8, 8, 24, "random", "dropless", 16),
    (12, 2, 6, 72, "empty_expert", "dropless", None),
    (10, 4, 4, 24, "one_expert", "dropless", 16),
    (11, 2, 8, 24, "random", "dropped", 16),
    (8, 5, 6, 72, "skewed", "dropped", None),
    (10, 2, 4, 72, "skewed", "capacity", 32),
    (7, 8, 8, 24, "random", "capacity", None),
    (9, 3, 5, 24, "one_expert", "capacity", 16),
    (5, 2, 4, 24, "random", "all_dropped", None),
    (64, 8, 16, 72, "skewed", "capacity", None),
    (48, 6, 16, 24, "random", "dropless", None),
]


def make_layout(T, K, E, kind, layout, gen):
    """(row_of_copy_TK, num_rows, all_rows_mapped) of a routing case."""
    experts = make_experts(T, K, E, kind, gen)
    keep = None
    capacity = None
    if layout == "dropped":
        keep = torch.rand((T, K), generator=gen) > 0.35
    elif layout == "capacity":
        capacity = max(1, (T * K) // E)  # skew and one_expert overflow it; others leave padding
        keep = torch.rand((T, K), generator=gen) > 0.2
    elif layout == "all_dropped":
        keep = torch.zeros((T, K), dtype=torch.bool)
    rows, counts, _ = CR.copy_rows_torch(experts, E, capacity, keep)
    num_rows = int(counts.sum()) if capacity is None else E * capacity
    return rows, num_rows, layout == "dropless"


@needs_triton
@pytest.mark.parametrize("T,K,E,H,kind,layout,block_h", LAYOUT_CASES)
def test_permute_unpermute_triton_twin_and_reference(T, K, E, H, kind, layout, block_h):
    gen = torch.Generator().manual_seed(100 * T + 10 * K + H)
    rows, R, mapped = make_layout(T, K, E, kind, layout, gen)
    if layout in ("dropped", "capacity") and T > 0:
        assert (rows < 0).any()
    x = torch.randn((T, H), generator=gen)
    grad_R = torch.randn((R, H), generator=gen)
    probs = torch.rand((T, K), generator=gen)
    grad_out = torch.randn((T, H), generator=gen)

    # permute forward: exact copies, unmapped rows zero
    ref = ref_permute(x, rows, R)
    twin = P.permute_torch(x, rows, R)
    assert torch.equal(twin, ref)
    assert torch.equal(P.permute_triton(x, rows, R, block_h=block_h), ref)
    assert torch.equal(P.permute(x, rows, R), ref)
    if mapped:  # dropless without drops: every row written, the zero fill skipped
        assert torch.equal(P.permute_triton(x, rows, R, all_rows_mapped=True, block_h=block_h), ref)

    # permute backward: sum of the copies' gradient rows, fp32
    ref = ref_unpermute(grad_R, rows, torch.ones(T, K)).float()
    twin = P.permute_backward_torch(grad_R, rows)
    assert_close_normwise(twin, ref, 1e-6)
    tri = P.permute_backward_triton(grad_R, rows, block_h=block_h)
    assert_close_normwise(tri, twin, 1e-6)
    assert_close_normwise(P.permute_backward(grad_R, rows), twin, 1e-6)

    # unpermute forward: weighted sum, fp32
    ref = ref_unpermute(grad_R, rows, probs).float()
    twin = P.unpermute_torch(grad_R, rows, probs)
    assert_close_normwise(twin, ref, 1e-6)
    tri = P.unpermute_triton(grad_R, rows, probs, block_h=block_h)
    assert_close_normwise(tri, twin, 1e-6)
    assert_close_normwise(P.unpermute(grad_R, rows, probs), twin, 1e-6)

    # unpermute backward: grad_y exact (one product per element), grad_probs fp32 dots
    ref_gy, ref_gp = ref_unpermute_backward(grad_out, grad_R, rows, probs)
    gy_twin, gp_twin = P.unpermute_backward_torch(grad_out, grad_R, rows, probs)
    assert_close_normwise(gy_twin, ref_gy.float(), 1e-7)
    assert_close_normwise(gp_twin, ref_gp.float(), 1e-6)
    assert gp_twin.dtype == torch.float32
    gy, gp = P.unpermute_backward_triton(grad_out, grad_R, rows, probs, block_h=block_h)
    assert torch.equal(gy, gy_twin)
    assert_close_normwise(gp, gp_twin, 1e-6)
    assert torch.equal(gp[rows < 0], torch.zeros_like(gp[rows < 0]))
    gy, gp = P.unpermute_backward(grad_out, grad_R, rows, probs, mapped)
    assert torch.equal(gy, gy_twin)
    assert_close_normwise(gp, gp_twin, 1e-6)
    # without y: no probs gradient, same grad_y
    gy, gp = P.unpermute_backward_triton(grad_out, None, rows, probs, num_rows=R, block_h=block_h)
    assert gp is None and torch.equal(gy, gy_twin)


@needs_triton
def check_zero_fill_bounded(T: int, K: int, R: int, H: int, bound: int, device: str, dtype: torch.dtype) -> None:
    """zero_below: rows below the count that no copy maps to are zero, rows at or past it untouched (a worst-case
    buffer is zeroed only as far as it is read), mapped rows as the twin's; the same in the backward's rows."""
    g = torch.Generator().manual_seed(bound)
    rows_TK = torch.randperm(R, generator=g)[:T * K].view(T, K)
    rows_TK[T // 2, 0] = -1  # a dropped copy
    mapped_R = torch.zeros(R, dtype=torch.bool)
    mapped_R[rows_TK[rows_TK >= 0]] = True
    untouched = ((torch.arange(R) >= bound) & ~mapped_R).to(device)
    x_TH = torch.randn(T, H, generator=g).to(device, dtype)
    probs_TK = torch.rand(T, K, generator=g).to(device)
    rows_TK, count = rows_TK.to(device), torch.tensor([bound], dtype=torch.int32, device=device)
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # the count stays on the device
    try:
        got = P.permute_triton(x_TH, rows_TK, R, out=torch.full((R, H), 7.0, dtype=dtype, device=device),
                               zero_below=count)
        grad_got, _ = P.unpermute_backward_triton(x_TH, None, rows_TK, probs_TK, num_rows=R, zero_below=count)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    want = P.permute_torch(x_TH, rows_TK, R)
    assert torch.equal(got[~untouched], want[~untouched]) and bool((got[untouched] == 7.0).all())
    grad_want, _ = P.unpermute_backward_torch(x_TH, None, rows_TK, probs_TK, num_rows=R)
    assert torch.equal(grad_got[~untouched], grad_want[~untouched])


@needs_triton
@pytest.mark.parametrize("bound", [0, 5, 13, 24])
def test_zero_fill_bounded_by_a_device_count(bound):
    check_zero_fill_bounded(6, 2, 24, 40, bound, "cpu", torch.float32)


def test_kernels_read_strided_rows():
    """Row-strided views (e.g. slices of a wider buffer) go in without a copy and give the same result."""
    gen = torch.Generator().manual_seed(3)
    T, K, E, H = 6, 2, 4, 24
    rows, R, _ = make_layout(T, K, E, "random", "dropless", gen)
    x_wide = torch.randn((T, H + 8), generator=gen)
    y_wide = torch.randn((R, H + 8), generator=gen)
    probs = torch.rand((T, K), generator=gen)
    x, y = x_wide[:, :H], y_wide[:, 4:4 + H]
    assert torch.equal(P.permute_triton(x, rows, R), P.permute_torch(x.contiguous(), rows, R))
    assert_close_normwise(P.unpermute_triton(y, rows, probs), P.unpermute_torch(y.contiguous(), rows, probs), 1e-6)
    assert_close_normwise(P.permute_backward_triton(y, rows), P.permute_backward_torch(y.contiguous(), rows), 1e-6)


@pytest.mark.parametrize("interpreted", [False, True])
def test_permute_backward_into_the_first_columns_of_wider_rows(monkeypatch, interpreted):
    """out=: the sums land in the first H columns of wider rows (the dgrad rows with their probs' gradients
    beside), the other columns untouched; a wrong shape is refused."""
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(4)
    T, K, E, H = 5, 3, 4, 24
    rows, R, _ = make_layout(T, K, E, "random", "dropless", gen)
    y = torch.randn((R, H), generator=gen)
    wide = torch.full((T, H + 4), 9.0)
    got = P.permute_backward(y, rows, out=wide[:, :H])
    assert got.data_ptr() == wide.data_ptr() and bool((wide[:, H:] == 9.0).all())
    assert_close_normwise(wide[:, :H], P.permute_backward_torch(y, rows), 1e-6)
    with pytest.raises(ValueError, match="out must be"):
        P.permute_backward(y, rows, out=wide[:, :H - 1])


@pytest.mark.parametrize("late_valid", [0, 1, 3])
def test_permute_backward_sparse_columns_read_only_where_valid(late_valid):
    """``sparse_from`` (the overflow chunk's columns of a wire-row plan): the sums equal the twin's whether no token,
    one or several have a valid copy past it; the columns past it are skipped only for the others."""
    gen = torch.Generator().manual_seed(late_valid)
    T, C, K, H, R = 6, 4, 8, 40, 64
    rows = torch.full((T, C + K), -1, dtype=torch.int32)
    rows[:, :C] = torch.randperm(R, generator=gen)[:T * C].view(T, C).to(torch.int32)
    rows[0, 1] = -1  # a missing early copy
    late = torch.randperm(R, generator=gen)[:late_valid].to(torch.int32)
    for i, row in enumerate(late):  # distinct tokens, distinct late columns
        rows[i, C + 2 * i] = row
    y = torch.randn((R, H), generator=gen)
    want = P.permute_backward_torch(y, rows)
    for sparse_from in (None, C, C + K, 1):
        assert_close_normwise(P.permute_backward(y, rows, sparse_from=sparse_from), want, 1e-6)


# ----------------------------------------------------------------------------------------------------------
# Autograd Functions
# ----------------------------------------------------------------------------------------------------------

def _functions_vs_autograd_reference(T, K, E, H, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    rows, R, mapped = make_layout(T, K, E, "random", layout, gen)
    x = torch.randn((T, H), generator=gen)
    probs = torch.rand((T, K), generator=gen)
    w = torch.randn((R, H), generator=gen)  # an elementwise "expert" between the two
    grad_out = torch.randn((T, H), generator=gen)

    def run(permute_fn, unpermute_fn):
        xr = x.clone().requires_grad_()
        pr = probs.clone().requires_grad_()
        y = permute_fn(xr) * w
        out = unpermute_fn(y, pr)
        gx, gp = torch.autograd.grad(out, (xr, pr), grad_out)
        return out.detach(), gx, gp

    # plain autograd reference: gather by token, masked
    valid = rows >= 0
    token_of_row = torch.zeros(R, dtype=torch.long)
    token_of_row[rows[valid].long()] = torch.arange(T).unsqueeze(1).expand(T, K)[valid]
    row_mapped = torch.zeros(R, dtype=torch.bool)
    row_mapped[rows[valid].long()] = True

    def ref_permute_fn(xr):
        return torch.where(row_mapped.unsqueeze(1), xr[token_of_row], 0.0)

    def ref_unpermute_fn(y, pr):
        g = y[rows.long().clamp(min=0)] * torch.where(valid, pr, 0.0).unsqueeze(-1)
        return torch.where(valid.unsqueeze(-1), g, 0.0).sum(1)

    ref = run(ref_permute_fn, ref_unpermute_fn)
    got = run(lambda xr: P.Permute.apply(xr, rows, R, mapped), lambda y, pr: P.Unpermute.apply(y, rows, pr, mapped))
    for a, b in zip(got, ref):
        assert_close_normwise(a, b, 1e-6)
    # probs without a gradient: y is not saved, only x gets one
    xr = x.clone().requires_grad_()
    out = P.Unpermute.apply(P.Permute.apply(xr, rows, R, mapped) * w, rows, probs, mapped)
    (gx,) = torch.autograd.grad(out, (xr,), grad_out)
    assert_close_normwise(gx, ref[1], 1e-6)


@needs_triton
@pytest.mark.parametrize("layout", ["dropless", "capacity", "dropped"])
def test_autograd_functions_triton(layout):
    _functions_vs_autograd_reference(9, 3, 5, 24, layout, seed=11)


@pytest.mark.parametrize("layout", ["dropless", "capacity"])
def test_autograd_functions_torch_twin(layout, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    _functions_vs_autograd_reference(9, 3, 5, 24, layout, seed=12)


@needs_triton
def test_dispatch_follows_device_and_interpreter(monkeypatch):
    calls = []
    monkeypatch.setattr(P, "permute_triton", lambda *a, **k: calls.append("triton") or P.permute_torch(*a, **k))
    x = torch.randn(3, 8)
    rows = torch.tensor([[0], [1], [2]], dtype=torch.int32)
    P.permute(x, rows, 3)
    assert calls == ["triton"]  # CPU under TRITON_INTERPRET=1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    P.permute(x, rows, 3)
    assert calls == ["triton"]  # CPU without it: the twin


def _fp8_bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("H,block_h", [(40, None), (300, 64)])
def test_fp8_out_rows_are_quantize_rows_of_the_rows_written(H, block_h):
    """``fp8_out``: the rows permute and unpermute_backward write, also as E4M3 with their scales, bit for bit what
    kernels/fp8_quant.quantize_rows makes of them (the Triton kernels against Triton's quantize_rows, the interpreter
    casting to E4M3 its own way; the twins against the twin), in one pass over each token row. A copy whose prob is
    0, a token of zeros and one of large values included; a layout with unmapped rows is refused."""
    from moe_overlap.kernels.fp8_quant import quantize_rows, quantize_rows_torch

    gen = torch.Generator().manual_seed(H)
    T, K, E = 23, 3, 5
    rows, R, mapped = make_layout(T, K, E, "random", "dropless", gen)
    assert mapped
    x = torch.randn((T, H), generator=gen) * torch.rand((T, 1), generator=gen) * 10
    x[3] = 0.0
    x[4] *= 1e4
    probs = torch.rand((T, K), generator=gen)
    probs[0, 1] = 0.0
    for permute, backward, quantize in ((P.permute_triton, P.unpermute_backward_triton, quantize_rows),
                                        (P.permute_torch, P.unpermute_backward_torch, quantize_rows_torch)):
        kwargs = {"block_h": block_h} if permute is P.permute_triton else {}
        fp8_out = P.fp8_buffers(R, H, x.device)
        out = permute(x, rows, R, True, fp8_out=fp8_out, **kwargs)
        assert torch.equal(out, P.permute_torch(x, rows, R))
        q, scale = quantize(out)
        assert _fp8_bytes_equal(fp8_out[0], q) and torch.equal(fp8_out[1], scale)
        fp8_out = P.fp8_buffers(R, H, x.device)
        grad_y, _ = backward(x, None, rows, probs, True, num_rows=R, fp8_out=fp8_out, **kwargs)
        q, scale = quantize(grad_y)
        assert _fp8_bytes_equal(fp8_out[0], q) and torch.equal(fp8_out[1], scale)
    rows, R, mapped = make_layout(T, K, E, "random", "dropped", gen)
    with pytest.raises(ValueError, match="all_rows_mapped"):
        P.permute(x, rows, R, False, fp8_out=P.fp8_buffers(R, H, x.device))


def test_bad_inputs_fail_early():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="row_of_copy_TK"):
        P.permute_torch(x, torch.zeros((3, 2), dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="int32 or int64"):
        P.permute_torch(x, torch.zeros((4, 2)), 4)
    with pytest.raises(ValueError, match="probs_TK shape"):
        P.unpermute_torch(x, torch.zeros((4, 2), dtype=torch.int32), torch.rand(4, 3))
    with pytest.raises(ValueError, match="experts_TK"):
        CR.copy_positions_torch(torch.zeros(4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="num_rows"):
        P.unpermute_backward_torch(x, None, torch.zeros((4, 2), dtype=torch.int32), torch.rand(4, 2))


@needs_triton
def test_interpreter_set_before_triton_import():
    """The classic way in: TRITON_INTERPRET=1 before triton is imported (every tl function interpreted)."""
    code = (
        "import torch\n"
        "from moe_overlap.kernels import copy_rows as CR, permute as P\n"
        "from triton.runtime.interpreter import InterpretedFunction\n"
        "import triton.language as tl\n"
        "assert isinstance(tl.standard._sum_combine, InterpretedFunction)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "e = torch.randint(0, 5, (13, 3), generator=g)\n"
        "rows, counts, _ = CR.copy_rows(e, 5, 4)\n"
        "twin = CR.copy_rows_torch(e, 5, 4)\n"
        "assert torch.equal(rows, twin[0]) and torch.equal(counts, twin[1])\n"
        "x = torch.randn(13, 24, generator=g); p = torch.rand(13, 3, generator=g)\n"
        "assert torch.equal(P.permute(x, rows, 20), P.permute_torch(x, rows, 20))\n"
        "y = torch.randn(20, 24, generator=g)\n"
        "assert torch.allclose(P.unpermute(y, rows, p), P.unpermute_torch(y, rows, p), atol=1e-6)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------------
# GPU: bf16 Triton kernels against the twins at realistic sizes (no timing here: see benchmarks/)
# ----------------------------------------------------------------------------------------------------------

GPU_CASES = [(4096, 4096, 2, 8), (4096, 4096, 8, 8), (4096, 4096, 2, 32), (4096, 4096, 8, 32)]


def _gpu_layout(T, K, E, layout, gen):
    dev = "cuda"
    experts = make_experts(T, K, E, "skewed", gen, device=dev)
    capacity = None if layout == "dropless" else (T * K) // E  # capacity factor 1: skew drops and pads
    rows, counts, rows_per_expert = CR.copy_rows_triton(experts, E, capacity)
    twin = CR.copy_rows_torch(experts, E, capacity)
    for a, b in zip((rows, counts, rows_per_expert), twin):
        assert torch.equal(a, b)
    num_rows = T * K if capacity is None else E * capacity
    return rows, num_rows, capacity is None


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,K,E", GPU_CASES)
@pytest.mark.parametrize("layout", ["dropless", "capacity"])
def test_gpu_bf16_kernels_match_twins(T, H, K, E, layout):
    cuda_and_triton_or_fail()
    gen = torch.Generator().manual_seed(T + H + K + E)
    rows, R, mapped = _gpu_layout(T, K, E, layout, gen)
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn((T, H), generator=gen).to(dev, bf16)
    y = torch.randn((R, H), generator=gen).to(dev, bf16)
    probs = torch.rand((T, K), generator=gen).to(dev)
    grad_out = torch.randn((T, H), generator=gen).to(dev, bf16)

    torch.cuda.set_sync_debug_mode("error")  # the kernels must not sync with the host
    try:
        xp = P.permute_triton(x, rows, R, mapped)
        gx = P.permute_backward_triton(y, rows)
        gx_sparse = P.permute_backward_triton(y, rows, sparse_from=K // 2)
        out = P.unpermute_triton(y, rows, probs)
        gy, gp = P.unpermute_backward_triton(grad_out, y, rows, probs, mapped)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(xp, P.permute_torch(x, rows, R))
    # fp32 sums cast to bf16: the order of the k terms may flip a last bit
    assert_close_normwise(gx, P.permute_backward_torch(y, rows), 2e-3)
    assert torch.equal(gx_sparse, gx)  # the same sums, in the same order, with the late columns in a loop of their own
    assert_close_normwise(out, P.unpermute_torch(y, rows, probs), 2e-3)
    gy_twin, gp_twin = P.unpermute_backward_torch(grad_out, y, rows, probs)
    assert torch.equal(gy, gy_twin)
    assert_close_normwise(gp, gp_twin, 1e-5)
    # the Functions dispatch to Triton on CUDA and match the twins' pieces
    xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
    o = P.Unpermute.apply(P.Permute.apply(xr, rows, R, mapped), rows, pr, mapped)
    gxr, gpr = torch.autograd.grad(o, (xr, pr), grad_out)
    xp_twin = P.permute_torch(x, rows, R)
    assert_close_normwise(o, P.unpermute_torch(xp_twin, rows, probs), 2e-3)
    gy_twin, gp_twin = P.unpermute_backward_torch(grad_out, xp_twin, rows, probs)
    assert_close_normwise(gxr, P.permute_backward_torch(gy_twin, rows), 2e-3)
    assert gpr.dtype == probs.dtype
    assert_close_normwise(gpr, gp_twin, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,K,E", GPU_CASES)
def test_gpu_fp8_out_rows_match_quantize_rows(T, H, K, E):
    """In bf16 on the GPU: the E4M3 rows and scales that permute and unpermute_backward write beside their rows are
    those quantize_rows makes of the rows written, bit for bit, with no host sync."""
    from moe_overlap.kernels.fp8_quant import quantize_rows_torch

    cuda_and_triton_or_fail()
    gen = torch.Generator().manual_seed(T + H + K + E)
    rows, R, mapped = _gpu_layout(T, K, E, "dropless", gen)
    x = (torch.randn((T, H), generator=gen) * torch.rand((T, 1), generator=gen) * 8).to("cuda", torch.bfloat16)
    probs = torch.rand((T, K), generator=gen).to("cuda")
    fwd, bwd = P.fp8_buffers(R, H, x.device), P.fp8_buffers(R, H, x.device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = P.permute_triton(x, rows, R, True, fp8_out=fwd)
        grad_y, _ = P.unpermute_backward_triton(x, None, rows, probs, True, num_rows=R, fp8_out=bwd)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for rows_RH, (q, scale) in ((out, fwd), (grad_y, bwd)):
        want_q, want_scale = quantize_rows_torch(rows_RH)
        assert _fp8_bytes_equal(q, want_q) and torch.equal(scale, want_scale)


@pytest.mark.gpu
def test_gpu_bf16_zero_fill_bounded_by_a_device_count():
    """A worst-case grouped buffer at EP=4 (4 x T x K rows) zeroed only below the rows in use, without a sync."""
    cuda_and_triton_or_fail()
    check_zero_fill_bounded(4096, 8, 4 * 4096 * 8, 2048, 4096 * 8, "cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("T,K,E", [(4096, 8, 256), (8192, 8, 256), (4096, 2, 8), (1, 8, 64)])
def test_gpu_copy_positions_match_twin(T, K, E):
    cuda_and_triton_or_fail()
    gen = torch.Generator().manual_seed(T + K + E)
    experts = make_experts(T, K, E, "skewed", gen, device="cuda")
    keep = (torch.rand((T, K), generator=gen) > 0.1).cuda()
    for kp in (None, keep):
        torch.cuda.set_sync_debug_mode("error")
        try:
            pos, counts = CR.copy_positions_triton(experts, E, kp)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        pos_twin, counts_twin = CR.copy_positions_torch(experts, E, kp)
        assert torch.equal(pos, pos_twin) and torch.equal(counts, counts_twin)
