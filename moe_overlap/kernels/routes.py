"""The device-planned MoE exchange's per-row routes from per-block tables, in one kernel (the fused route ops).

    fill_routes(block_start_B, block_rows_B, block_rank_B, block_dst_start_B, rank_Q, row_Q, block_limit_B, past)
        for every block b and j < block_rows_B[b]:  q = block_start_B[b] + j
            rank_Q[q] = block_rank_B[b];   row_Q[q] = block_dst_start_B[b] + j
            (with block_limit_B: a row at or past block_limit_B[b] becomes row ``past`` instead)

Blocks are contiguous runs of rows (a permuted buffer's (chunk, destination, expert) blocks, or a received
buffer's (expert, source) blocks); the tables are a few dozen integers per rank, every size stays on the device,
and entries no block covers keep what they held (rows past the device count, never read). One program per block.
The limit is the bounded receive buffer's guard (layers/device_plan.py): rows that do not fit their chunk's bound
all land in one spare row instead of past the buffer.
The torch twin finds each row's block by a search over the block ends: static shapes, no host sync.
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, use_triton

if HAVE_TRITON:
    import triton.language as tl

    def _fill_routes_kernel(start_ptr, rows_ptr, rank_ptr, dst_start_ptr, limit_ptr, out_rank_ptr, out_row_ptr,
                            past, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        start = tl.load(start_ptr + b)
        rows = tl.load(rows_ptr + b)
        rank = tl.load(rank_ptr + b)
        dst_start = tl.load(dst_start_ptr + b)
        if CLAMP:
            limit = tl.load(limit_ptr + b)
        jj = tl.arange(0, BLOCK)
        for j0 in range(0, rows, BLOCK):
            j = j0 + jj
            mask = j < rows
            row = dst_start + j
            if CLAMP:
                row = tl.where(row < limit, row, past)
            tl.store(out_rank_ptr + start + j, rank + 0 * j, mask=mask)
            tl.store(out_row_ptr + start + j, row, mask=mask)

    _fill_routes = Kernel(_fill_routes_kernel)


def _check(tables: tuple[torch.Tensor, ...], rank_Q: torch.Tensor, row_Q: torch.Tensor) -> None:
    if len({t.shape for t in tables}) != 1 or tables[0].dim() != 1:
        raise ValueError(f"the block tables must be 1-D tensors of one length, got "
                         f"{[tuple(t.shape) for t in tables]}")
    if rank_Q.shape != row_Q.shape or rank_Q.dim() != 1:
        raise ValueError(f"rank_Q {tuple(rank_Q.shape)} and row_Q {tuple(row_Q.shape)} must be one 1-D route")


def fill_routes_torch(block_start_B: torch.Tensor, block_rows_B: torch.Tensor, block_rank_B: torch.Tensor,
                      block_dst_start_B: torch.Tensor, rank_Q: torch.Tensor, row_Q: torch.Tensor,
                      block_limit_B: torch.Tensor | None = None, past: int = 0) -> None:
    """Twin of :func:`fill_routes`."""
    tables = (block_start_B, block_rows_B, block_rank_B, block_dst_start_B)
    _check(tables if block_limit_B is None else tables + (block_limit_B,), rank_Q, row_Q)
    if block_start_B.numel() == 0:
        return
    q = torch.arange(rank_Q.numel(), device=rank_Q.device)
    ends_B = block_start_B + block_rows_B
    block_Q = torch.searchsorted(ends_B, q, right=True).clamp(max=ends_B.numel() - 1)
    start_Q = block_start_B[block_Q]
    covered = (q >= start_Q) & (q < ends_B[block_Q])
    dst_row_Q = block_dst_start_B[block_Q] + q - start_Q
    if block_limit_B is not None:
        dst_row_Q = torch.where(dst_row_Q < block_limit_B[block_Q], dst_row_Q, past)
    rank_Q.copy_(torch.where(covered, block_rank_B[block_Q].to(rank_Q.dtype), rank_Q))
    row_Q.copy_(torch.where(covered, dst_row_Q.to(row_Q.dtype), row_Q))


def fill_routes(block_start_B: torch.Tensor, block_rows_B: torch.Tensor, block_rank_B: torch.Tensor,
                block_dst_start_B: torch.Tensor, rank_Q: torch.Tensor, row_Q: torch.Tensor,
                block_limit_B: torch.Tensor | None = None, past: int = 0) -> None:
    """Triton on CUDA (or interpreted), the twin otherwise. The blocks must be contiguous runs, in order."""
    if not use_triton(rank_Q, "routes"):
        fill_routes_torch(block_start_B, block_rows_B, block_rank_B, block_dst_start_B, rank_Q, row_Q, block_limit_B,
                          past)
        return
    tables = (block_start_B, block_rows_B, block_rank_B, block_dst_start_B)
    _check(tables if block_limit_B is None else tables + (block_limit_B,), rank_Q, row_Q)
    if block_start_B.numel():
        clamp = block_limit_B is not None
        limit_B = block_limit_B.contiguous() if clamp else block_dst_start_B  # not read without the clamp
        _fill_routes[(block_start_B.numel(),), rank_Q.device](*(t.contiguous() for t in tables), limit_B, rank_Q,
                                                              row_Q, past, CLAMP=clamp, BLOCK=1024, num_warps=4)
