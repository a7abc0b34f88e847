"""Rows pushed to other ranks' buffers by SM stores, with every size on the device: the sync-free dispatch.

    push_rows(src_RH, num_rows, dst_rank_R, dst_row_R, dst_base_ptrs)
        for every row r < num_rows[0]:  buffer of rank dst_rank_R[r], row dst_row_R[r]  =  src_RH[r]

``num_rows`` is a one-element device tensor, so no host ever needs the count: the grid covers the static
worst case and rows past the count are masked off. ``dst_base_ptrs`` holds each rank's buffer address as
int64 (peers' symmetric-memory buffers, mapped into this process), read by the kernel and cast to pointers.
The copy engine cannot do this: its sizes are host integers. 32 CTAs already reach NVLink speed (measured
on 2xH200: 64 MiB in 0.195 ms, the copy engine 0.177 ms).

The torch twin takes the destination buffers as tensors (one process, or a CPU test standing in for peers).
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    def _push_rows_kernel(src_ptr, num_rows_ptr, dst_rank_ptr, dst_row_ptr, dst_ptr, H, stride_src,
                          ROUTED: tl.constexpr, BLOCK_H: tl.constexpr):
        # One program per row of the static worst case; rows at or past the device count are masked off.
        # ROUTED: dst_ptr holds every rank's buffer address; else it is the buffer and rows keep their index.
        row = tl.program_id(0).to(tl.int64)
        valid = row < tl.load(num_rows_ptr)
        if ROUTED:
            rank = tl.load(dst_rank_ptr + row, mask=valid, other=0)
            dst_row = tl.load(dst_row_ptr + row, mask=valid, other=0).to(tl.int64)
            base = tl.load(dst_ptr + rank).to(tl.pointer_type(src_ptr.dtype.element_ty))
        else:
            dst_row, base = row, dst_ptr
        cols = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            mask = valid & (h0 + cols < H)
            v = tl.load(src_ptr + row * stride_src + h0 + cols, mask=mask)
            tl.store(base + dst_row * H + h0 + cols, v, mask=mask)

    _push_rows = Kernel(_push_rows_kernel)


def push_rows_torch(src_RH: torch.Tensor, num_rows: torch.Tensor, dst_rank_R: torch.Tensor, dst_row_R: torch.Tensor,
                    dst_buffers: list[torch.Tensor]) -> None:
    """Twin of :func:`push_rows` with the destination buffers as (rows, H) tensors, one per rank."""
    n = int(num_rows.reshape(-1)[0])
    for rank, dst_RH in enumerate(dst_buffers):
        mine = (dst_rank_R[:n] == rank).nonzero().squeeze(1)
        dst_RH.index_copy_(0, dst_row_R[:n][mine].long(), src_RH[:n][mine])


def push_rows(src_RH: torch.Tensor, num_rows: torch.Tensor, dst_rank_R: torch.Tensor, dst_row_R: torch.Tensor,
              dst_base_ptrs: torch.Tensor) -> None:
    """Triton kernel (CUDA, or interpreted under TRITON_INTERPRET=1): each rank's destination buffer holds
    rows of ``src_RH.shape[1]`` contiguous elements of ``src_RH.dtype`` from the address in ``dst_base_ptrs``."""
    rows, H = src_RH.shape
    if src_RH.stride(1) != 1:
        raise ValueError(f"src_RH rows must be contiguous, got strides {src_RH.stride()}")
    for name, t in (("dst_rank_R", dst_rank_R), ("dst_row_R", dst_row_R)):
        if t.shape != (rows,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({rows},): one entry per source row")
    if not use_triton(src_RH, "push_rows"):
        raise RuntimeError("push_rows writes through raw peer addresses: it needs triton (on CUDA, or "
                           "TRITON_INTERPRET=1); push_rows_torch is the twin that takes buffers")
    if rows == 0 or H == 0:
        return
    _launch(src_RH, num_rows, dst_rank_R, dst_row_R, dst_base_ptrs, routed=True)


def copy_counted_rows(src_RH: torch.Tensor, num_rows: torch.Tensor, out_RH: torch.Tensor) -> torch.Tensor:
    """out_RH[:num_rows[0]] = src_RH[:num_rows[0]], the count on the device (rows past it stay as they were):
    a received worst-case buffer copied out at the cost of its counted rows. Triton on CUDA (or interpreted)."""
    if out_RH.shape != src_RH.shape or not out_RH.is_contiguous():
        raise ValueError(f"out_RH must be a contiguous {tuple(src_RH.shape)} tensor, got {tuple(out_RH.shape)}")
    if not use_triton(src_RH, "push_rows"):
        n = int(num_rows.reshape(-1)[0])
        out_RH[:n] = src_RH[:n]
        return out_RH
    if src_RH.numel():
        _launch(src_RH, num_rows, num_rows, num_rows, out_RH, routed=False)
    return out_RH


def _launch(src_RH, num_rows, dst_rank_R, dst_row_R, dst, routed: bool) -> None:
    block_h = min(4096, triton.next_power_of_2(src_RH.shape[1]))
    _push_rows[(src_RH.shape[0],), src_RH.device](src_RH, num_rows, dst_rank_R, dst_row_R, dst, src_RH.shape[1],
                                                  src_RH.stride(0), ROUTED=routed, BLOCK_H=block_h,
                                                  num_warps=8 if block_h >= 2048 else 4)
