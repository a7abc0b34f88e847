"""kernels/wire_targets.py: a token's distinct targets and each copy's wire row, the Triton kernels (interpreted)
against their torch twins, and the twins against the definition (set by set, token by token)."""

import pytest
import torch

from moe_overlap.kernels.copy_rows import copy_rows
from moe_overlap.kernels.wire_targets import (distinct_targets, distinct_targets_torch, wire_copies,
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
