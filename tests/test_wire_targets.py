"""kernels/wire_targets.py: a token's distinct targets and each copy's wire row, the Triton kernels (interpreted)
against their torch twins, and the twins against the definition (set by set, token by token)."""

import pytest
import torch

from moe_overlap.kernels.copy_rows import copy_rows
from moe_overlap.kernels.wire_targets import (copy_grads, copy_grads_torch, distinct_targets, distinct_targets_torch,
                                              grouped_rows_of_copies, grouped_rows_of_copies_torch, pack_copies,
                                              pack_copies_torch, unpack_copies, unpack_copies_torch, wire_copies,
                                              wire_copies_torch)


def _routing(T, K, E, V, seed, drops):
    g = torch.Generator().manual_seed(seed)
    experts_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    experts_TK[0, -1] = -1  # an expert id outside [0, E): not counted
    keep_TK = torch.rand(T, K, generator=g) > 0.3 if drops else None
    target_of_expert_E = torch.randint(0, V, (E,), generator=g)
    slot_of_target_V = torch.randperm(V, generator=g)
    return experts_TK, keep_TK, target_of_expert_E, slot_of_target_V


def _plan(experts_TK, keep_TK, target_of_expert_E, slot_of_target_V):
    T, K = experts_TK.shape
    V = slot_of_target_V.numel()
    C = min(K, V)
    target_TK, slots_TC = distinct_targets(experts_TK, keep_TK, target_of_expert_E, slot_of_target_V, C)
    row_TC, _, _ = copy_rows(slots_TC, V)
    return (target_TK, slots_TC, row_TC) + wire_copies(target_TK, row_TC, V, T * C)


@pytest.mark.parametrize("T,K,E,V,drops", [(9, 4, 16, 6, False), (13, 8, 64, 4, True), (5, 2, 8, 8, True),
                                           (7, 3, 12, 2, False)])
def test_wire_targets_kernels_equal_their_twins_and_the_definition(monkeypatch, T, K, E, V, drops):
    routing = _routing(T, K, E, V, T * K + V, drops)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    twin = _plan(*routing)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = _plan(*routing)
    for name, a, b in zip(("target", "slots", "row_TC", "row_of_copy", "slot", "token_of_row"), got, twin):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # the definition, token by token
    experts_TK, keep_TK, target_of_expert_E, slot_of_target_V = routing
    target_TK, slots_TC, row_TC, row_of_copy_TK, slot_TK, token_of_row_R = twin
    R = T * min(K, V)
    for t in range(T):
        kept = [k for k in range(K) if experts_TK[t, k] >= 0 and (keep_TK is None or keep_TK[t, k])]
        targets = sorted({int(target_of_expert_E[experts_TK[t, k]]) for k in kept}, reverse=True)
        want_slots = [int(slot_of_target_V[v]) for v in targets] + [V] * (min(K, V) - len(targets))
        assert slots_TC[t].tolist() == want_slots
        for k in range(K):
            if k not in kept:
                assert target_TK[t, k] == V and row_of_copy_TK[t, k] == R
                continue
            v = int(target_of_expert_E[experts_TK[t, k]])
            row = int(row_TC[t, targets.index(v)])
            assert row_of_copy_TK[t, k] == row and token_of_row_R[row] == t
            assert slot_TK[t, k] == sum(1 for j in kept if j < k and int(target_of_expert_E[experts_TK[t, j]]) == v)


@pytest.mark.parametrize("drops,count", [(False, None), (True, 11)])
def test_copies_packed_unpacked_and_their_gradients_equal_the_twins(monkeypatch, drops, count):
    """pack_copies / unpack_copies / copy_grads, interpreted against their twins: the same int32 columns (the
    probs' raw bits), the grouped rows past the limit or the count -1, each kept copy's gradient read back from
    its slot, 0 for a dropped one; the columns read through a strided view of wider rows."""
    T, K, E, V = 13, 8, 64, 4
    routing = _routing(T, K, E, V, 5, drops)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, _, _, row_of_copy_TK, slot_TK, _ = _plan(*routing)
    R, J, M = T * min(K, V), 8, 16
    g = torch.Generator().manual_seed(3)
    grouped_TK = torch.randint(-1, 40, (T, K), generator=g, dtype=torch.int32)
    probs_TK = torch.rand(T, K, generator=g)
    limit = torch.tensor([30], dtype=torch.int32)
    count_t = None if count is None else torch.tensor([count])
    results = []
    for interpreted in (False, True):
        if interpreted:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        meta_RM = pack_copies(row_of_copy_TK, slot_TK, grouped_TK, probs_TK, R, M, J)
        wide = torch.full((R, M + 6), 7, dtype=torch.int32)
        wide[:, 6:] = meta_RM
        grouped_WJ, probs_WJ = unpack_copies(wide[:, 6:], J, limit, count_t)
        grads = copy_grads(wide[:, 6:].view(torch.float32)[:, J:], row_of_copy_TK, slot_TK)
        results.append((meta_RM, grouped_WJ, probs_WJ, grads))
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a, b)
    meta_RM, grouped_WJ, probs_WJ, grads = results[0]
    kept = row_of_copy_TK < R
    assert torch.equal(grads[kept], probs_TK[kept]) and (grads[~kept] == 0).all()  # the probs read back
    rows, slots = row_of_copy_TK[kept], slot_TK[kept]
    want = torch.where((grouped_TK[kept] >= 0) & (grouped_TK[kept] < 30), grouped_TK[kept], -1)
    if count is not None:
        want = torch.where(rows < count, want, -1)
    assert torch.equal(grouped_WJ[rows, slots], want)
    assert int((meta_RM != 0).sum()) <= 2 * int(kept.sum())  # nothing but the kept copies' columns written


@pytest.mark.parametrize("with_kept", [False, True])
def test_grouped_rows_of_copies_kernel_equals_its_twin(monkeypatch, with_kept):
    """Each copy's grouped row at its destination: its row plus its expert's shift; -1 if dropped (row -1) or,
    with kept rows per expert, at or past them; an expert id outside [0, E) clamped as the twin does."""
    g = torch.Generator().manual_seed(9)
    T, K, E = 37, 4, 16
    row_of_copy_TK = torch.randint(-1, 200, (T, K), generator=g, dtype=torch.int32)
    experts_TK = torch.randint(-1, E + 1, (T, K), generator=g)
    shift_E = torch.randint(-50, 300, (E,), generator=g)
    kept_E = torch.randint(0, 400, (E,), generator=g) if with_kept else None
    want = grouped_rows_of_copies_torch(row_of_copy_TK, experts_TK, shift_E, kept_E)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = grouped_rows_of_copies(row_of_copy_TK, experts_TK, shift_E, kept_E)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert (want[row_of_copy_TK < 0] == -1).all() and (want >= 0).any()


@pytest.mark.gpu
def test_gpu_wire_targets_and_copies_equal_the_twins():
    """On CUDA (compiled), the fine-grained bench shape at EP=4 (8 of 64 experts, 4 targets) and with 2 chunks
    (8 targets): every output equal to the twins' (run on the same device), no host sync in the kernels."""
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    for V, drops in ((4, False), (8, True)):
        routing = [t.cuda() if t is not None else None for t in _routing(8192, 8, 64, V, V, drops)]
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = _plan(*routing)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        experts_TK, keep_TK, target_of_expert_E, slot_of_target_V = routing
        C = min(8, V)
        target_TK, slots_TC = distinct_targets_torch(experts_TK, keep_TK, target_of_expert_E, slot_of_target_V, C)
        row_TC, _, _ = copy_rows(slots_TC, V)
        twin = (target_TK, slots_TC, row_TC) + wire_copies_torch(target_TK, row_TC, V, 8192 * C)
        for name, a, b in zip(("target", "slots", "row_TC", "row_of_copy", "slot", "token_of_row"), got, twin):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        row_of_copy_TK, slot_TK = got[3], got[4]
        R, J, M = 8192 * C, 8, 16
        grouped_TK = torch.randint(-1, 9000, (8192, 8), dtype=torch.int32, device="cuda")
        probs_TK = torch.rand(8192, 8, device="cuda")
        meta_RM = pack_copies(row_of_copy_TK, slot_TK, grouped_TK, probs_TK, R, M, J)
        assert torch.equal(meta_RM, pack_copies_torch(row_of_copy_TK, slot_TK, grouped_TK, probs_TK, R, M, J))
        limit, count = torch.tensor([8000], device="cuda"), torch.tensor([R - 100], device="cuda")
        for a, b in zip(unpack_copies(meta_RM, J, limit, count), unpack_copies_torch(meta_RM, J, limit, count)):
            assert torch.equal(a, b)
        shift_E, kept_E = torch.randint(0, 5000, (64,), device="cuda"), torch.randint(0, 9000, (64,), device="cuda")
        assert torch.equal(grouped_rows_of_copies(row_of_copy_TK, experts_TK, shift_E, kept_E),
                           grouped_rows_of_copies_torch(row_of_copy_TK, experts_TK, shift_E, kept_E))
        grads_RM = meta_RM.view(torch.float32)[:, J:]
        assert torch.equal(copy_grads(grads_RM, row_of_copy_TK, slot_TK),
                           copy_grads_torch(grads_RM, row_of_copy_TK, slot_TK))
