"""Each token once per destination (layers/wire_rows.py): a token's distinct targets and where each of its copies
rides, one Triton program per token, with their torch twins.

    distinct_targets(experts_TK, keep_TK, target_of_expert_E, slot_of_target_V, C) -> (target_TK, slots_TC)
        target_TK[t, k]   the copy's target (its expert's (rank, chunk) target; V if the copy is not kept)
        slots_TC[t, :]    the token's distinct targets in descending order, each as its slot in the (chunk, rank)
                          order, V past them
    wire_copies(target_TK, row_TC, num_rows) -> (row_of_copy_TK, slot_TK, token_of_row_R)
        row_of_copy_TK    the wire row carrying each copy (row_TC of its target's place; num_rows if not kept)
        slot_TK           the copy's place among its wire row's copies (earlier kept copies with its target)
        token_of_row_R    each wire row's token (0 for rows no token has)

Between the two, kernels/copy_rows.copy_rows packs the tokens by slot (row_TC). Two kernels instead of about forty
small torch ops: a replayed graph pays each node its launch gap (benchmarks/layer_ops.py counts them).
Letters: T tokens, K copies per token, C a token's distinct targets (at most min(K, V)), V targets, R wire rows.
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, check_2d, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe_overlap.kernels.launch import max_combine, sum_combine

    def _distinct_targets_kernel(experts_ptr, keep_ptr, target_of_expert_ptr, slot_of_target_ptr, target_ptr,
                                 slots_ptr, K, E, V, C, HAS_KEEP: tl.constexpr, K_PAD: tl.constexpr,
                                 C_PAD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, K_PAD)
        in_k = k < K
        e = tl.load(experts_ptr + t * K + k, mask=in_k, other=-1).to(tl.int32)
        kept = in_k & (e >= 0) & (e < E)
        if HAS_KEEP:
            kept = kept & (tl.load(keep_ptr + t * K + k, mask=in_k, other=0) != 0)
        target = tl.where(kept, tl.load(target_of_expert_ptr + tl.where(kept, e, 0), mask=kept, other=0).to(tl.int32),
                          V)
        tl.store(target_ptr + t * K + k, target, mask=in_k)
        # a target's first kept copy, and its place among the token's distinct targets in descending order
        same = (target[:, None] == target[None, :]) & kept[:, None] & kept[None, :]
        first = kept & (tl.reduce((same & (k[None, :] < k[:, None])).to(tl.int32), 1, sum_combine) == 0)
        place = tl.reduce((first[None, :] & (target[None, :] > target[:, None])).to(tl.int32), 1, sum_combine)
        c = tl.arange(0, C_PAD)
        at_c = first[None, :] & (place[None, :] == c[:, None])  # (C_PAD, K_PAD): one copy or none per place
        target_c = tl.reduce(tl.where(at_c, target[None, :], -1), 1, max_combine)
        has = target_c >= 0
        slot = tl.load(slot_of_target_ptr + tl.where(has, target_c, 0), mask=has, other=0).to(tl.int32)
        tl.store(slots_ptr + t * C + c, tl.where(has, slot, V), mask=c < C)

    def _wire_copies_kernel(target_ptr, row_tc_ptr, row_of_copy_ptr, slot_ptr, token_of_row_ptr, K, C, V, R,
                            K_PAD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, K_PAD)
        in_k = k < K
        target = tl.load(target_ptr + t * K + k, mask=in_k, other=V)
        kept = in_k & (target < V)
        same = (target[:, None] == target[None, :]) & kept[:, None] & kept[None, :]
        slot = tl.reduce((same & (k[None, :] < k[:, None])).to(tl.int32), 1, sum_combine)
        first = kept & (slot == 0)
        place = tl.reduce((first[None, :] & (target[None, :] > target[:, None])).to(tl.int32), 1, sum_combine)
        row = tl.load(row_tc_ptr + t * C + place, mask=kept, other=0)
        tl.store(row_of_copy_ptr + t * K + k, tl.where(kept, row.to(tl.int64), R), mask=in_k)
        tl.store(slot_ptr + t * K + k, slot.to(tl.int64), mask=in_k)
        tl.store(token_of_row_ptr + tl.where(first, row, 0), t.to(tl.int32), mask=first)

    _distinct_targets = Kernel(_distinct_targets_kernel)
    _wire_copies = Kernel(_wire_copies_kernel)


def distinct_targets_torch(experts_TK: torch.Tensor, keep_TK: torch.Tensor | None, target_of_expert_E: torch.Tensor,
                           slot_of_target_V: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`distinct_targets`."""
    T, K = experts_TK.shape
    E, V = target_of_expert_E.numel(), slot_of_target_V.numel()
    kept_TK = (experts_TK >= 0) & (experts_TK < E)
    if keep_TK is not None:
        kept_TK &= keep_TK.bool()
    target_TK = torch.where(kept_TK, target_of_expert_E[experts_TK.long().clamp(0, E - 1)], V)
    has_TV = torch.zeros((T, V + 1), dtype=torch.int8, device=experts_TK.device).scatter_(1, target_TK.long(), 1)
    every_V = torch.arange(V, device=experts_TK.device)
    target_TC = torch.where(has_TV[:, :V].bool(), every_V, -1).sort(1, descending=True).values[:, :C]
    slots_TC = torch.where(target_TC >= 0, slot_of_target_V[target_TC.clamp(min=0)], V)
    return target_TK.to(torch.int32), slots_TC.to(torch.int32)


def distinct_targets(experts_TK: torch.Tensor, keep_TK: torch.Tensor | None, target_of_expert_E: torch.Tensor,
                     slot_of_target_V: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target_TK int32, slots_TC int32): see the module docstring. ``C``: at least the most distinct targets a
    token can have (min(K, V))."""
    check_2d("experts_TK", experts_TK)
    if not use_triton(experts_TK, "wire_targets"):
        return distinct_targets_torch(experts_TK, keep_TK, target_of_expert_E, slot_of_target_V, C)
    T, K = experts_TK.shape
    target_TK = torch.empty((T, K), dtype=torch.int32, device=experts_TK.device)
    slots_TC = torch.empty((T, C), dtype=torch.int32, device=experts_TK.device)
    if T:
        experts = experts_TK.contiguous()
        keep = experts if keep_TK is None else keep_TK.contiguous().view(torch.uint8) if keep_TK.dtype == torch.bool \
            else keep_TK.contiguous()
        _distinct_targets[(T,), experts_TK.device](
            experts, keep, target_of_expert_E.contiguous(), slot_of_target_V.contiguous(), target_TK, slots_TC, K,
            target_of_expert_E.numel(), slot_of_target_V.numel(), C, HAS_KEEP=keep_TK is not None,
            K_PAD=max(2, triton.next_power_of_2(K)), C_PAD=max(2, triton.next_power_of_2(C)))
    return target_TK, slots_TC


def wire_copies_torch(target_TK: torch.Tensor, row_TC: torch.Tensor, V: int, num_rows: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of :func:`wire_copies`."""
    T, K = target_TK.shape
    C = row_TC.shape[1]
    kept_TK = target_TK < V
    first_TK = kept_TK.clone()
    earlier_KK = torch.ones((K, K), dtype=torch.bool, device=target_TK.device).tril(-1)
    same_TKK = (target_TK.unsqueeze(2) == target_TK.unsqueeze(1)) & kept_TK.unsqueeze(1) & earlier_KK
    slot_TK = same_TKK.sum(2)
    first_TK &= slot_TK == 0
    place_TK = ((target_TK.unsqueeze(1) > target_TK.unsqueeze(2)) & first_TK.unsqueeze(1)).sum(2)
    row_TK = row_TC.long().gather(1, place_TK.clamp(max=C - 1))
    row_of_copy_TK = torch.where(kept_TK, row_TK, num_rows)
    token_of_row_R = torch.zeros(num_rows + 1, dtype=torch.int32, device=target_TK.device)  # the spare: not kept
    token_TK = torch.arange(T, dtype=torch.int32, device=target_TK.device).unsqueeze(1).expand(T, K)
    token_of_row_R.scatter_(0, torch.where(first_TK, row_TK, num_rows).reshape(-1), token_TK.reshape(-1))
    return row_of_copy_TK, slot_TK, token_of_row_R[:num_rows]


def wire_copies(target_TK: torch.Tensor, row_TC: torch.Tensor, V: int, num_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_of_copy_TK int64, slot_TK int64, token_of_row_R int32): see the module docstring. ``row_TC``: each of a
    token's distinct targets' wire row, in :func:`distinct_targets`' order."""
    check_2d("target_TK", target_TK)
    if not use_triton(target_TK, "wire_targets"):
        return wire_copies_torch(target_TK, row_TC, V, num_rows)
    T, K = target_TK.shape
    row_of_copy_TK = torch.empty((T, K), dtype=torch.int64, device=target_TK.device)
    slot_TK = torch.empty((T, K), dtype=torch.int64, device=target_TK.device)
    token_of_row_R = torch.zeros(num_rows, dtype=torch.int32, device=target_TK.device)
    if T:
        _wire_copies[(T,), target_TK.device](target_TK.contiguous(), row_TC.contiguous(), row_of_copy_TK, slot_TK,
                                            token_of_row_R, K, row_TC.shape[1], V, num_rows,
                                            K_PAD=max(2, triton.next_power_of_2(K)))
    return row_of_copy_TK, slot_TK, token_of_row_R
