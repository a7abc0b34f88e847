"""Each token once per destination (layers/wire_rows.py): a token's distinct targets and where each of its copies
rides, one Triton program per token, with their torch twins.

    distinct_targets(experts_TK, keep_TK, target_of_expert_E, slot_of_target_V, C) -> (target_TK, slots_TC)
        target_TK[t, k]   the copy's target (its expert's (rank, chunk) target; V if the copy is not kept)
        slots_TC[t, :]    the token's distinct targets in descending order, each as its slot in the (chunk, rank)
                          order, V past them
    wire_copies(target_TK, row_TC, V, num_rows) -> (row_of_copy_TK, slot_TK, token_of_row_R)
        row_of_copy_TK    the wire row carrying each copy (row_TC of its target's place; num_rows if not kept)
        slot_TK           the copy's place among its wire row's copies (earlier kept copies with its target)
        token_of_row_R    each wire row's token (0 for rows no token has)

Between the two, kernels/copy_rows.copy_rows packs the tokens by slot (row_TC). Then a wire row carries its
copies in M extra int32 columns (J grouped rows stored plus one, 0: none; then J fp32 probs as raw bits; zero
padded):

    grouped_rows_of_copies(row_of_copy_TK, experts_TK, shift_E, kept_E) -> grouped_TK
        each copy's grouped row at its destination: its row plus its expert's shift (-1 if dropped, or at or past
        its expert's kept rows)
    pack_copies(row_of_copy_TK, slot_TK, grouped_TK, probs_TK, R, M, J) -> meta_RM
    unpack_copies(meta_WM, J, limit, count) -> (grouped_row_WJ int32, -1: none or past the limit / count; probs_WJ)
    copy_grads(grads_RM, row_of_copy_TK, slot_TK) -> grad_probs_TK (fp32; 0 for a copy not kept)

One kernel each instead of six to eleven small torch ops: a replayed graph pays each node its launch gap
(benchmarks/layer_ops.py counts them). Letters: T tokens, K copies per token, C a token's distinct targets (at most
min(K, V)), V targets, R wire rows (W: received ones), J a wire row's copies, M its extra columns.
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

    def _pack_copies_kernel(row_of_copy_ptr, slot_ptr, grouped_ptr, probs_ptr, meta_ptr, meta_f32_ptr, K, J, R, M,
                            K_PAD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, K_PAD)
        in_k = k < K
        row = tl.load(row_of_copy_ptr + t * K + k, mask=in_k, other=R)
        kept = in_k & (row < R)
        slot = tl.load(slot_ptr + t * K + k, mask=kept, other=0)
        grouped = tl.load(grouped_ptr + t * K + k, mask=kept, other=-1)
        at = tl.where(kept, row, 0) * M + slot
        tl.store(meta_ptr + at, tl.maximum(grouped + 1, 0).to(tl.int32), mask=kept)
        tl.store(meta_f32_ptr + at + J, tl.load(probs_ptr + t * K + k, mask=kept, other=0.0).to(tl.float32),
                 mask=kept)

    def _unpack_copies_kernel(meta_ptr, meta_f32_ptr, limit_ptr, count_ptr, grouped_ptr, probs_ptr, W, J, stride,
                              HAS_COUNT: tl.constexpr, BLOCK_W: tl.constexpr, J_PAD: tl.constexpr):
        w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
        j = tl.arange(0, J_PAD)
        live = w < W
        if HAS_COUNT:
            live = live & (w < tl.load(count_ptr))
        inside = (w < W)[:, None] & (j < J)[None, :]
        at = w.to(tl.int64)[:, None] * stride + j[None, :]
        grouped = tl.load(meta_ptr + at, mask=inside, other=0) - 1
        valid = live[:, None] & (grouped >= 0) & (grouped < tl.load(limit_ptr))
        out = w.to(tl.int64)[:, None] * J + j[None, :]
        tl.store(grouped_ptr + out, tl.where(valid, grouped, -1), mask=inside)
        tl.store(probs_ptr + out, tl.load(meta_f32_ptr + at + J, mask=inside, other=0.0), mask=inside)

    def _copy_grads_kernel(grads_f32_ptr, row_of_copy_ptr, slot_ptr, out_ptr, K, R, stride, K_PAD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, K_PAD)
        in_k = k < K
        row = tl.load(row_of_copy_ptr + t * K + k, mask=in_k, other=R)
        kept = in_k & (row < R)
        slot = tl.load(slot_ptr + t * K + k, mask=kept, other=0)
        grad = tl.load(grads_f32_ptr + tl.where(kept, row, 0) * stride + slot, mask=kept, other=0.0)
        tl.store(out_ptr + t * K + k, grad, mask=in_k)

    def _grouped_rows_kernel(row_of_copy_ptr, experts_ptr, shift_ptr, kept_ptr, out_ptr, N, E,
                             HAS_KEPT: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < N
        row = tl.load(row_of_copy_ptr + i, mask=inside, other=-1).to(tl.int64)
        e = tl.minimum(tl.maximum(tl.load(experts_ptr + i, mask=inside, other=0).to(tl.int64), 0), E - 1)
        valid = inside & (row >= 0)
        grouped = row + tl.load(shift_ptr + e, mask=valid, other=0)
        if HAS_KEPT:
            valid = valid & (grouped < tl.load(kept_ptr + e, mask=valid, other=0))
        tl.store(out_ptr + i, tl.where(valid, grouped, -1).to(tl.int32), mask=inside)

    _distinct_targets = Kernel(_distinct_targets_kernel)
    _grouped_rows = Kernel(_grouped_rows_kernel, do_not_specialize=["N"])
    _wire_copies = Kernel(_wire_copies_kernel)
    _pack_copies = Kernel(_pack_copies_kernel)
    _unpack_copies = Kernel(_unpack_copies_kernel, do_not_specialize=["W"])
    _copy_grads = Kernel(_copy_grads_kernel)


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
        keep = experts if keep_TK is None else keep_TK.contiguous()  # an unused pointer without keep_TK
        if keep.dtype == torch.bool:
            keep = keep.view(torch.uint8)
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


def grouped_rows_of_copies_torch(row_of_copy_TK: torch.Tensor, experts_TK: torch.Tensor, shift_E: torch.Tensor,
                                 kept_E: torch.Tensor | None) -> torch.Tensor:
    """Twin of :func:`grouped_rows_of_copies`."""
    expert_TK = experts_TK.long().clamp(0, shift_E.numel() - 1)
    grouped_TK = row_of_copy_TK.long() + shift_E[expert_TK]
    valid = row_of_copy_TK >= 0
    if kept_E is not None:
        valid &= grouped_TK < kept_E[expert_TK]
    return torch.where(valid, grouped_TK, -1).to(torch.int32)


def grouped_rows_of_copies(row_of_copy_TK: torch.Tensor, experts_TK: torch.Tensor, shift_E: torch.Tensor,
                           kept_E: torch.Tensor | None = None) -> torch.Tensor:
    """int32 (T, K): each copy's row in its destination's grouped tensor, ``row_of_copy_TK`` (-1: dropped) plus its
    expert's ``shift_E``; -1 where dropped or (``kept_E``: per expert, the rows its owner keeps) past them."""
    if not use_triton(row_of_copy_TK, "wire_targets"):
        return grouped_rows_of_copies_torch(row_of_copy_TK, experts_TK, shift_E, kept_E)
    out_TK = torch.empty(row_of_copy_TK.shape, dtype=torch.int32, device=row_of_copy_TK.device)
    N = out_TK.numel()
    if N:
        block = 1024
        _grouped_rows[(triton.cdiv(N, block),), out_TK.device](
            row_of_copy_TK.contiguous(), experts_TK.contiguous(), shift_E.contiguous(),
            shift_E if kept_E is None else kept_E.contiguous(), out_TK, N, shift_E.numel(),
            HAS_KEPT=kept_E is not None, BLOCK=block)
    return out_TK


def pack_copies_torch(row_of_copy_TK: torch.Tensor, slot_TK: torch.Tensor, grouped_TK: torch.Tensor,
                      probs_TK: torch.Tensor, R: int, M: int, J: int) -> torch.Tensor:
    """Twin of :func:`pack_copies`."""
    meta_RM = torch.zeros((R + 1, M), dtype=torch.int32, device=row_of_copy_TK.device)  # the spare row: dropped
    rows, slots = row_of_copy_TK.reshape(-1).long(), slot_TK.reshape(-1).long()
    meta_RM[rows, slots] = (grouped_TK.reshape(-1).to(torch.int32) + 1).clamp(min=0)
    meta_RM.view(torch.float32)[rows, slots + J] = probs_TK.reshape(-1).float()
    return meta_RM[:R]


def pack_copies(row_of_copy_TK: torch.Tensor, slot_TK: torch.Tensor, grouped_TK: torch.Tensor,
                probs_TK: torch.Tensor, R: int, M: int, J: int) -> torch.Tensor:
    """meta_RM (int32, R x M): each kept copy's grouped row plus one (0 for -1: past a bound) at column slot of its
    wire row, its prob's bits at column J + slot; every other column zero."""
    if not use_triton(row_of_copy_TK, "wire_targets"):
        return pack_copies_torch(row_of_copy_TK, slot_TK, grouped_TK, probs_TK, R, M, J)
    T, K = row_of_copy_TK.shape
    meta_RM = torch.zeros((R, M), dtype=torch.int32, device=row_of_copy_TK.device)
    if T:
        _pack_copies[(T,), row_of_copy_TK.device](
            row_of_copy_TK.contiguous(), slot_TK.contiguous(), grouped_TK.contiguous(), probs_TK.contiguous(),
            meta_RM, meta_RM.view(torch.float32), K, J, R, M, K_PAD=max(2, triton.next_power_of_2(K)))
    return meta_RM


def unpack_copies_torch(meta_WM: torch.Tensor, J: int, limit: torch.Tensor, count: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of :func:`unpack_copies`."""
    grouped_WJ = meta_WM[:, :J] - 1
    valid = (grouped_WJ >= 0) & (grouped_WJ < limit)
    if count is not None:
        valid &= torch.arange(meta_WM.shape[0], device=meta_WM.device).unsqueeze(1) < count
    return torch.where(valid, grouped_WJ, -1), meta_WM[:, J:2 * J].contiguous().view(torch.float32)


def unpack_copies(meta_WM: torch.Tensor, J: int, limit: torch.Tensor, count: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(grouped_row_WJ int32, probs_WJ fp32) of received wire rows' copies, read from their int32 columns
    ``meta_WM`` (rows may be strided: the received rows themselves): a grouped row at or past ``limit`` (a device
    scalar: the chunk's last grouped-GEMM offset), or of a row at or past ``count`` (a device scalar: the rows
    received; None: every row), is -1."""
    if meta_WM.dim() != 2 or meta_WM.stride(1) != 1:
        raise ValueError(f"meta_WM must be 2-D with unit column stride, got strides {meta_WM.stride()}")
    if not use_triton(meta_WM, "wire_targets"):
        return unpack_copies_torch(meta_WM, J, limit, count)
    W = meta_WM.shape[0]
    grouped_WJ = torch.empty((W, J), dtype=torch.int32, device=meta_WM.device)
    probs_WJ = torch.empty((W, J), dtype=torch.float32, device=meta_WM.device)
    if W:
        block_w = 128
        _unpack_copies[(triton.cdiv(W, block_w),), meta_WM.device](
            meta_WM, meta_WM.view(torch.float32), limit.reshape(-1)[:1], limit if count is None else count.reshape(-1),
            grouped_WJ, probs_WJ, W, J, meta_WM.stride(0), HAS_COUNT=count is not None, BLOCK_W=block_w,
            J_PAD=max(2, triton.next_power_of_2(J)))
    return grouped_WJ, probs_WJ


def copy_grads_torch(grads_RM: torch.Tensor, row_of_copy_TK: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`copy_grads`."""
    R, M = grads_RM.shape
    flat = torch.cat((grads_RM.reshape(-1), grads_RM.new_zeros(1)))
    index = torch.where(row_of_copy_TK < R, row_of_copy_TK * M + slot_TK, flat.numel() - 1)  # dropped: zero
    return flat[index]


def copy_grads(grads_RM: torch.Tensor, row_of_copy_TK: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """grad_probs_TK (fp32): each kept copy's value at column slot of its wire row's fp32 columns ``grads_RM``
    (rows may be strided), 0 for a copy not kept."""
    if grads_RM.dim() != 2 or grads_RM.stride(1) != 1 or grads_RM.dtype != torch.float32:
        raise ValueError(f"grads_RM must be 2-D float32 with unit column stride, got {grads_RM.dtype} strides "
                         f"{grads_RM.stride()}")
    if not use_triton(row_of_copy_TK, "wire_targets"):
        return copy_grads_torch(grads_RM, row_of_copy_TK, slot_TK)
    T, K = row_of_copy_TK.shape
    out_TK = torch.empty((T, K), dtype=torch.float32, device=row_of_copy_TK.device)
    if T:
        _copy_grads[(T,), row_of_copy_TK.device](grads_RM, row_of_copy_TK.contiguous(), slot_TK.contiguous(), out_TK,
                                                K, grads_RM.shape[0], grads_RM.stride(0),
                                                K_PAD=max(2, triton.next_power_of_2(K)))
    return out_TK
