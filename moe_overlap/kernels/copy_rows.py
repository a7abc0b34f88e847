"""Where each routed copy of a token goes: its rank among its expert's copies (a stable counting sort) and the
permuted row it lives in, Triton kernels and their torch twins (kernels/permute.py moves the rows there).

Vocabulary (suffixes name dimensions: T tokens, K copies per token, E experts):

  copy (t, k)        the k-th routed copy of token t, going to expert experts_TK[t, k]
  position_TK        stable rank of a copy among the copies of its expert, in flat order t*K + k
                     (a counting-sort rank; -1 for a copy that is not counted: not kept, or an expert id
                     outside [0, E))
  row_of_copy_TK     the permuted row a copy lives in; -1: no row (the copy was dropped)
                       dropless  rows packed by expert: expert_start[e] + position (start = exclusive cumsum)
                       capacity  static layout: expert e owns rows [e*C, (e+1)*C); row e*C + position,
                                 and a copy whose position is >= C is dropped

Every public function dispatches as kernels/permute.py's do (Triton on CUDA or under TRITON_INTERPRET=1, else
the twin), and none syncs with the host. The kernels call only triton builtins (see kernels/launch.py).
"""

from typing import Optional

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, check_2d, require_triton, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe_overlap.kernels.launch import sum_combine as _sum_combine

__all__ = [
    "copy_positions", "copy_positions_torch", "copy_positions_triton",
    "rows_from_positions", "copy_rows", "copy_rows_torch", "copy_rows_triton",
]

if HAVE_TRITON:

    def _rank_hist_kernel(experts_ptr, keep_ptr, rank_ptr, hist_ptr, N, E, NB,
                          HAS_KEEP: tl.constexpr, BLOCK_N: tl.constexpr):
        # Block b of BLOCK_N copies: each copy's rank among the earlier copies of its expert inside the block
        # (a BLOCK_N x BLOCK_N comparison), and the block's per-expert count, written to the zeroed row b of
        # hist (expert-major: hist[e, b], so the prefix over blocks is an inner-dim scan) by the block's last copy of
        # each expert (rank + 1). Deterministic: no atomics, independent of E.
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK_N)
        offs = b * BLOCK_N + i
        inb = offs < N
        e = tl.load(experts_ptr + offs, mask=inb, other=-1).to(tl.int32)
        valid = inb & (e >= 0) & (e < E)
        if HAS_KEEP:
            kept = tl.load(keep_ptr + offs, mask=inb, other=0)
            valid = valid & (kept != 0)
        e = tl.where(valid, e, -1)
        same = (e[:, None] == e[None, :]) & valid[None, :]
        rank = tl.reduce((same & (i[None, :] < i[:, None])).to(tl.int32), 1, _sum_combine)
        later = tl.reduce((same & (i[None, :] > i[:, None])).to(tl.int32), 1, _sum_combine)
        tl.store(rank_ptr + offs, rank, mask=inb)
        tl.store(hist_ptr + e * NB + b, rank + 1, mask=valid & (later == 0))

    def _position_kernel(experts_ptr, keep_ptr, incl_ptr, hist_ptr, cum_ptr, pos_ptr, row_ptr, N, E, C, NB,
                         HAS_KEEP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
        # position = block base of the copy's expert (incl - hist: the exclusive prefix over blocks) + rank inside
        # the block (already in pos_ptr); ROWS: 0 positions only, 1 dropless rows (the expert's start: cum, the
        # inclusive cumsum of the counts, less its count incl[e, NB - 1]), 2 capacity rows (C).
        b = tl.program_id(0)
        offs = b * BLOCK_N + tl.arange(0, BLOCK_N)
        inb = offs < N
        e = tl.load(experts_ptr + offs, mask=inb, other=-1).to(tl.int32)
        valid = inb & (e >= 0) & (e < E)
        if HAS_KEEP:
            kept = tl.load(keep_ptr + offs, mask=inb, other=0)
            valid = valid & (kept != 0)
        rank = tl.load(pos_ptr + offs, mask=inb, other=0)
        base = (tl.load(incl_ptr + e * NB + b, mask=valid, other=0)
                - tl.load(hist_ptr + e * NB + b, mask=valid, other=0)).to(tl.int32)
        pos = tl.where(valid, rank + base, -1)
        tl.store(pos_ptr + offs, pos, mask=inb)
        if ROWS == 1:
            start = (tl.load(cum_ptr + e, mask=valid, other=0)
                     - tl.load(incl_ptr + e * NB + NB - 1, mask=valid, other=0)).to(tl.int32)
            tl.store(row_ptr + offs, tl.where(valid, start + pos, -1), mask=inb)
        if ROWS == 2:
            keep_row = valid & (pos < C)
            tl.store(row_ptr + offs, tl.where(keep_row, e * C + pos, -1), mask=inb)

    _rank_hist = Kernel(_rank_hist_kernel)
    _position = Kernel(_position_kernel)


def _valid_copies(experts_flat: torch.Tensor, num_experts: int, keep_flat: Optional[torch.Tensor]) -> torch.Tensor:
    valid = (experts_flat >= 0) & (experts_flat < num_experts)
    if keep_flat is not None:
        valid &= keep_flat.bool()
    return valid


def _check_routing(experts_TK: torch.Tensor, num_experts: int, keep_TK: Optional[torch.Tensor]) -> None:
    check_2d("experts_TK", experts_TK)
    if experts_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"experts_TK must be int32 or int64, got {experts_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if keep_TK is not None and keep_TK.shape != experts_TK.shape:
        raise ValueError(f"keep_TK shape {tuple(keep_TK.shape)} != experts_TK shape {tuple(experts_TK.shape)}")


def copy_positions_torch(experts_TK: torch.Tensor, num_experts: int,
                         keep_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `copy_positions`: stable argsort by expert, rank = sorted index - expert start."""
    _check_routing(experts_TK, num_experts, keep_TK)
    flat = experts_TK.reshape(-1).long()
    n = flat.numel()
    valid = _valid_copies(flat, num_experts, None if keep_TK is None else keep_TK.reshape(-1))
    key = torch.where(valid, flat, num_experts)  # uncounted copies sort last, into a spare bucket
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    # first sorted index of every expert (and of the spare bucket): no atomics, no host sync
    bounds = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=flat.device))
    rank_sorted = torch.arange(n, device=flat.device) - bounds[sorted_key]
    position = torch.empty(n, dtype=torch.int32, device=flat.device)
    position[order] = rank_sorted.to(torch.int32)
    position = torch.where(valid, position, -1)
    return position.view(experts_TK.shape), bounds.diff()


def _copy_positions_triton(experts_TK, num_experts, keep_TK, capacity, rows: int, block_n: int):
    """Shared body of copy_positions_triton / copy_rows_triton. rows: 0 none, 1 dropless, 2 capacity."""
    require_triton("the *_triton index kernels")
    _check_routing(experts_TK, num_experts, keep_TK)
    dev = experts_TK.device
    experts = experts_TK.reshape(-1).contiguous()
    n = experts.numel()
    position = torch.empty(experts_TK.shape, dtype=torch.int32, device=dev)
    row = torch.empty(experts_TK.shape, dtype=torch.int32, device=dev) if rows else position
    if n == 0:
        counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
        return position, row, counts
    keep = experts if keep_TK is None else keep_TK.reshape(-1).contiguous()
    if keep.dtype == torch.bool:
        keep = keep.view(torch.uint8)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    num_blocks = triton.cdiv(n, block_n)
    hist = torch.zeros((num_experts, num_blocks), dtype=torch.int32, device=dev)
    _rank_hist[(num_blocks,), dev](experts, keep, position, hist, n, num_experts, num_blocks,
                                   HAS_KEEP=keep_TK is not None, BLOCK_N=block_n, num_warps=8)
    incl = torch.cumsum(hist, 1)  # int64; experts x blocks: a scan along the inner dim (the outer one is slow)
    counts = incl[:, -1]
    cum = torch.cumsum(counts, 0) if rows == 1 else counts  # the subtractions happen in the kernel: no launches
    _position[(num_blocks,), dev](experts, keep, incl, hist, cum, position, row, n, num_experts,
                                  0 if capacity is None else int(capacity), num_blocks,
                                  HAS_KEEP=keep_TK is not None, ROWS=rows, BLOCK_N=block_n, num_warps=4)
    return position, row, counts


def copy_positions_triton(experts_TK: torch.Tensor, num_experts: int, keep_TK: Optional[torch.Tensor] = None,
                          *, block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `copy_positions`: per block of `block_n` copies a rank-in-block and a per-expert count (one
    kernel), an exclusive prefix sum of the counts over blocks (torch cumsum of a (blocks, E) table), then
    position = base + rank (one kernel). No atomics: the result does not depend on scheduling."""
    position, _, counts = _copy_positions_triton(experts_TK, num_experts, keep_TK, None, 0, block_n)
    return position, counts


def copy_positions(experts_TK: torch.Tensor, num_experts: int,
                   keep_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_TK int32, tokens_per_expert_E int64) of the copies experts_TK (T, K).

    position_TK[t, k] counts the copies of the same expert that come before (t, k) in flat order t*K + k: a
    stable counting-sort rank, deterministic. Only counted copies take part: with keep_TK (bool (T, K)) only
    kept ones, and never a copy whose expert id lies outside [0, num_experts); an uncounted copy gets
    position -1 and is not in tokens_per_expert_E. Capacity mode ranks kept copies only: pass keep_TK.
    """
    if use_triton(experts_TK, "copy_rows"):
        return copy_positions_triton(experts_TK, num_experts, keep_TK)
    return copy_positions_torch(experts_TK, num_experts, keep_TK)


def rows_from_positions(experts_TK: torch.Tensor, position_TK: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                        capacity: Optional[int] = None,
                        keep_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_of_copy_TK int32, rows_per_expert_E int64) from positions (torch on every device; a few
    elementwise ops, no host sync).

    capacity None (dropless): rows packed by expert, row = exclusive_cumsum(tokens_per_expert)[e] + position;
      rows_per_expert_E = tokens_per_expert_E; num_rows = tokens_per_expert_E.sum() (the caller's host sync).
    capacity C: static layout, expert e owns rows [e*C, (e+1)*C); row = e*C + position for a counted copy with
      position < C, else -1 (a later copy is dropped); rows_per_expert_E = C for every expert, num_rows = E*C.
    A copy with position -1, or not in keep_TK, gets row -1. Positions must come from `copy_positions` with
    the same keep_TK (capacity mode ranks kept copies only).
    """
    num_experts = tokens_per_expert_E.numel()
    valid = position_TK >= 0
    if keep_TK is not None:
        valid &= keep_TK.bool()
    e = experts_TK.long().clamp(0, max(num_experts - 1, 0))
    pos = position_TK.long()
    if capacity is None:
        counts = tokens_per_expert_E.long()
        start = torch.cumsum(counts, 0) - counts
        row = torch.where(valid, start[e] + pos, -1)
        rows_per_expert = counts
    else:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        valid &= pos < capacity
        row = torch.where(valid, e * capacity + pos, -1)
        rows_per_expert = torch.full((num_experts,), int(capacity), dtype=torch.int64, device=experts_TK.device)
    return row.to(torch.int32), rows_per_expert


def copy_rows_torch(experts_TK: torch.Tensor, num_experts: int, capacity: Optional[int] = None,
                    keep_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of `copy_rows`: copy_positions_torch, then rows_from_positions."""
    position, counts = copy_positions_torch(experts_TK, num_experts, keep_TK)
    row, rows_per_expert = rows_from_positions(experts_TK, position, counts, capacity, keep_TK)
    return row, counts, rows_per_expert


def copy_rows_triton(experts_TK: torch.Tensor, num_experts: int, capacity: Optional[int] = None,
                     keep_TK: Optional[torch.Tensor] = None, *,
                     block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `copy_rows`: the rows are written by the second kernel of copy_positions_triton."""
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    _, row, counts = _copy_positions_triton(experts_TK, num_experts, keep_TK, capacity,
                                            1 if capacity is None else 2, block_n)
    if capacity is None:
        rows_per_expert = counts
    else:
        rows_per_expert = torch.full((num_experts,), int(capacity), dtype=torch.int64, device=experts_TK.device)
    return row, counts, rows_per_expert


def copy_rows(experts_TK: torch.Tensor, num_experts: int, capacity: Optional[int] = None,
              keep_TK: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_of_copy_TK int32, tokens_per_expert_E int64, rows_per_expert_E int64) in one call:
    `copy_positions` + `rows_from_positions`, fused into the index kernels on the Triton side."""
    if use_triton(experts_TK, "copy_rows"):
        return copy_rows_triton(experts_TK, num_experts, capacity, keep_TK)
    return copy_rows_torch(experts_TK, num_experts, capacity, keep_TK)
