"""Rows moved by SM stores with every size on the device: the device-planned MoE exchange's pushes and copy-outs.

    push_rows(src_RH, src_start, count, dst_rank_Q, dst_row_Q, route_start, dst_bases, ctas)
        for i < count[0]:  q = route_start[0] + i
                           row dst_row_Q[q] of the buffer of rank dst_rank_Q[q] (at address dst_bases[rank])
                               = src_RH[src_start[0] + i]
    push_rows(..., gather=(source_TX, source_row_R))
        the same, row r's first X columns read from source_TX[source_row_R[r]] and the others from src_RH[r]:
        wire rows pushed straight from their tokens' rows (no send buffer written first)
    copy_rows_out(src_RH, src_start, count, out_RH, ctas)
        out_RH[i] = src_RH[src_start[0] + i] for i < count[0]    (rows past the count stay as they were)
    repeat_rows(src_RH, src_start, src_count, dst_RH, dst_start, count, ctas, gather=None)
        dst_RH[dst_start[0] + i] = src_RH[src_start[0] + i % src_count[0]] for i < count[0]    (0 if no source;
        ``gather`` as for push_rows)

Every start and count (``src_start``, ``count``, ``route_start``, ...) is a one-element device tensor, so no host
ever needs them. The kernel is persistent: ``ctas`` programs loop over the rows, so a push takes no more SMs than it
is given (the grouped GEMM it runs beside leaves that many free: README, "What overlaps on Hopper"; default: full
width). Each program moves ``ROWS`` whole rows per step with 16-byte vector loads and stores (dims are multiples of
8, so bf16 rows start on 16 bytes; the address hints below tell the compiler): its loads of a step are in flight
together, so a program's rate is about its bytes per step over a load's latency (``IN_FLIGHT_BYTES``).
``dst_bases`` holds each rank's buffer address as int64, 16-byte aligned (peers' symmetric memory is mapped into
this process; a CPU test passes its own buffers' addresses).

The torch twins take the destination buffers as tensors (one process, or a CPU test standing in for peers).
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, use_triton

# Bytes a program loads per step (then stores). Into local memory on one H100 (2026-11-28, step_kernels.py
# --sections push, step_kernels_push_1xh100.json; 64 MiB of rows 2,048 / 4,096 / 7,168 wide): 16 KiB moved 9-13 GB/s
# per CTA, 64 KiB 12-18 (1.2-1.5x; 32 KiB in between); beside a grouped GEMM carved out by 8 SMs, 8 CTAs of 64 KiB
# finished under it (0.83-0.90 ms with the GEMM alone 0.84-0.87), 16 KiB's stuck out (0.97-1.10). 128 KiB spills
# (ptxas, sm_90).
IN_FLIGHT_BYTES = 65536


if HAVE_TRITON:
    import triton
    import triton.language as tl

    def _move_rows_kernel(src_ptr, src_start_ptr, count_ptr, route_start_ptr, dst_rank_ptr, dst_row_ptr, dst_ptr,
                          gather_ptr, gather_row_ptr, H, X, stride_src, stride_dst, stride_gather,
                          ROUTED: tl.constexpr, GATHER: tl.constexpr, ALIGNED: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        # ROUTED: dst_ptr holds every rank's buffer address, and row i goes to (dst_rank, dst_row)[route_start + i];
        # else dst_ptr is the buffer and row i goes to its row i. GATHER: a row's first X columns come from row
        # gather_row[r] of gather_ptr, its other H - X from row r of src_ptr (H - X columns wide).
        count = tl.load(count_ptr)
        src_start = tl.load(src_start_ptr)
        rr = tl.arange(0, ROWS)
        cols = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_H), BLOCK_H), BLOCK_H)
        for first in range(tl.program_id(0) * ROWS, count, tl.num_programs(0) * ROWS):
            i = first + rr
            valid = i < count
            src_rows = (src_start + i).to(tl.int64)
            if ROUTED:
                q = tl.load(route_start_ptr) + i
                rank = tl.load(dst_rank_ptr + q, mask=valid, other=0)
                dst_rows = tl.load(dst_row_ptr + q, mask=valid, other=0).to(tl.int64)
                address = tl.load(dst_ptr + rank, mask=valid, other=0)
                if ALIGNED:  # 16-byte rows in 16-byte aligned buffers: vector stores
                    address = tl.multiple_of(address, 16)
                base = address.to(tl.pointer_type(src_ptr.dtype.element_ty))
                dst = base[:, None] + dst_rows[:, None] * stride_dst
            else:
                dst = dst_ptr + i.to(tl.int64)[:, None] * stride_dst
            src = src_ptr + src_rows[:, None] * stride_src
            if GATHER:
                gathered = tl.load(gather_row_ptr + src_rows, mask=valid, other=0).to(tl.int64)
                src_gathered = gather_ptr + gathered[:, None] * stride_gather
            for h0 in range(0, H, BLOCK_H):
                c = h0 + cols
                mask = valid[:, None] & (c < H)[None, :]
                if GATHER:
                    mine = (c < X)[None, :]
                    v = tl.where(mine, tl.load(src_gathered + c[None, :], mask=mask & mine),
                                 tl.load(src + (c - X)[None, :], mask=mask & ~mine))
                else:
                    v = tl.load(src + c[None, :], mask=mask)
                tl.store(dst + c[None, :], v, mask=mask)

    def _repeat_rows_kernel(src_ptr, src_start_ptr, src_count_ptr, dst_ptr, dst_start_ptr, count_ptr, gather_ptr,
                            gather_row_ptr, H, X, stride_src, stride_dst, stride_gather, GATHER: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        # dst row dst_start + i = src row src_start + i % src_count, for i < count; zeros when src_count is 0;
        # GATHER as in _move_rows_kernel
        count, src_count = tl.load(count_ptr), tl.load(src_count_ptr)
        src_start, dst_start = tl.load(src_start_ptr), tl.load(dst_start_ptr)
        rr = tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_H)
        for first in range(tl.program_id(0) * ROWS, count, tl.num_programs(0) * ROWS):
            i = first + rr
            valid = i < count
            src_rows = (src_start + i % tl.maximum(src_count, 1)).to(tl.int64)
            src = src_ptr + src_rows[:, None] * stride_src
            dst = dst_ptr + (dst_start + i).to(tl.int64)[:, None] * stride_dst
            if GATHER:
                gathered = tl.load(gather_row_ptr + src_rows, mask=valid & (src_count > 0), other=0).to(tl.int64)
                src_gathered = gather_ptr + gathered[:, None] * stride_gather
            for h0 in range(0, H, BLOCK_H):
                c = h0 + cols
                mask = valid[:, None] & (c < H)[None, :]
                if GATHER:
                    mine = (c < X)[None, :]
                    v = tl.where(mine, tl.load(src_gathered + c[None, :], mask=mask & mine & (src_count > 0),
                                               other=0.0),
                                 tl.load(src + (c - X)[None, :], mask=mask & ~mine & (src_count > 0), other=0.0))
                else:
                    v = tl.load(src + c[None, :], mask=mask & (src_count > 0), other=0.0)
                tl.store(dst + c[None, :], v, mask=mask)

    # One kernel under two names, so that a profile tells a transfer to peers from a local copy.
    _push_rows = Kernel(_move_rows_kernel, name="_push_rows_kernel")
    _copy_rows_out = Kernel(_move_rows_kernel, name="_copy_rows_out_kernel")
    _repeat_rows = Kernel(_repeat_rows_kernel)


def full_width(device: torch.device) -> int:
    """CTAs of a push or copy with no carve-out to respect: two per SM, enough to keep HBM busy (32 already reach
    NVLink speed, measured on 2xH200); a few for the interpreter."""
    if device.type != "cuda":
        return 4
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


Gather = tuple[torch.Tensor, torch.Tensor]  # (source_TX, source_row_R): row r's first X columns are source row
#                                             source_row_R[r]; the rows' other columns are src_RH's


def _scalar(value: torch.Tensor | int, like: torch.Tensor) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor([value], device=like.device)


def _width(src_RH: torch.Tensor, gather: Gather | None) -> int:
    return src_RH.shape[1] + (0 if gather is None else gather[0].shape[1])


def whole_rows(src_RH: torch.Tensor, gather: Gather | None, first: int = 0, n: int | None = None) -> torch.Tensor:
    """Rows [first, first + n) as whole rows, the gathered columns first (the twins; a transport that cannot
    gather)."""
    n = src_RH.shape[0] - first if n is None else n
    if gather is None:
        return src_RH[first:first + n]
    source_TX, source_row_R = gather
    return torch.cat((source_TX[source_row_R[first:first + n].long()], src_RH[first:first + n]), 1)


def _check_gather(src_RH: torch.Tensor, gather: Gather | None) -> None:
    if src_RH.dim() != 2 or (src_RH.shape[1] and src_RH.stride(1) != 1):
        raise ValueError(f"src_RH must be 2-D with contiguous rows, got shape {tuple(src_RH.shape)} strides "
                         f"{src_RH.stride()}")
    if gather is not None:
        source_TX, source_row_R = gather
        if (source_TX.dim() != 2 or source_TX.stride(1) != 1 or source_TX.dtype != src_RH.dtype
                or source_row_R.shape != src_RH.shape[:1]):
            raise ValueError(f"gather: a 2-D {src_RH.dtype} source with contiguous rows and one source row per row of "
                             f"src_RH, got {tuple(source_TX.shape)} {source_TX.dtype} and {tuple(source_row_R.shape)}")


def push_rows_torch(src_RH: torch.Tensor, src_start, count, dst_rank_Q: torch.Tensor, dst_row_Q: torch.Tensor,
                    route_start, dst_buffers: list[torch.Tensor], gather: Gather | None = None) -> None:
    """Twin of :func:`push_rows` with the destination buffers as (rows, H) tensors, one per rank."""
    first, n, q0 = (int(_scalar(v, src_RH).reshape(-1)[0]) for v in (src_start, count, route_start))
    rows_RH = whole_rows(src_RH, gather, first, n)
    ranks, dst_rows = dst_rank_Q[q0:q0 + n], dst_row_Q[q0:q0 + n].long()
    for rank, dst_RH in enumerate(dst_buffers):
        mine = (ranks == rank).nonzero().squeeze(1)
        dst_RH.index_copy_(0, dst_rows[mine], rows_RH[mine])


def push_rows(src_RH: torch.Tensor, src_start, count, dst_rank_Q: torch.Tensor, dst_row_Q: torch.Tensor,
              route_start, dst_bases: torch.Tensor, ctas: int | None = None, gather: Gather | None = None,
              in_flight: int = IN_FLIGHT_BYTES, dst_row_stride: int | None = None) -> None:
    """Triton kernel (CUDA, or interpreted under TRITON_INTERPRET=1): each rank's destination buffer holds
    rows of the rows' width (``gather``: its columns and src_RH's) of ``src_RH.dtype`` from the address in
    ``dst_bases``, ``dst_row_stride`` elements apart (default: contiguous rows). ``in_flight``: bytes a program loads
    per step (a benchmark's sweep)."""
    _check_gather(src_RH, gather)
    if dst_rank_Q.shape != dst_row_Q.shape or dst_rank_Q.dim() != 1:
        raise ValueError(f"dst_rank_Q {tuple(dst_rank_Q.shape)} and dst_row_Q {tuple(dst_row_Q.shape)} must be one "
                         "1-D route, one entry per routed row")
    if not use_triton(src_RH, "push_rows"):
        raise RuntimeError("push_rows writes through raw peer addresses: it needs triton (on CUDA, or "
                           "TRITON_INTERPRET=1); push_rows_torch is the twin that takes buffers")
    if _width(src_RH, gather):
        _launch(src_RH, _scalar(src_start, src_RH), _scalar(count, src_RH), _scalar(route_start, src_RH),
                dst_rank_Q, dst_row_Q, dst_bases, dst_row_stride or _width(src_RH, gather), ctas, routed=True,
                gather=gather, in_flight=in_flight)


def copy_rows_out(src_RH: torch.Tensor, src_start, count, out_RH: torch.Tensor,
                  ctas: int | None = None) -> torch.Tensor:
    """out_RH[:count] = src_RH[src_start:src_start + count], both on the device (rows past the count stay as
    they were): a chunk of a received buffer copied out at the cost of its counted rows. Triton on CUDA (or
    interpreted), else torch with the two values read on the host."""
    if out_RH.dim() != 2 or out_RH.shape[1] != src_RH.shape[1] or not out_RH.is_contiguous():
        raise ValueError(f"out_RH must be a contiguous (rows, {src_RH.shape[1]}) tensor, got {tuple(out_RH.shape)}")
    if not use_triton(src_RH, "push_rows"):
        first, n = (int(_scalar(v, src_RH).reshape(-1)[0]) for v in (src_start, count))
        out_RH[:n] = src_RH[first:first + n]
        return out_RH
    if src_RH.shape[1]:
        start = _scalar(src_start, src_RH)
        _launch(src_RH, start, _scalar(count, src_RH), start, start, start, out_RH, out_RH.stride(0), ctas,
                routed=False)
    return out_RH


def repeat_rows(src_RH: torch.Tensor, src_start, src_count, dst_RH: torch.Tensor, dst_start, count,
                ctas: int | None = None, gather: Gather | None = None) -> None:
    """dst_RH[dst_start + i] = src_RH[src_start + i % src_count] for i < count (zeros when src_count is 0), every
    start and count on the device (``gather``: the rows' first columns from their source rows, as for
    :func:`push_rows`): a compute-only reference's received rows, made from the rank's own. Triton on CUDA (or
    interpreted), else torch with the values read on the host."""
    _check_gather(src_RH, gather)
    H = _width(src_RH, gather)
    if dst_RH.dim() != 2 or dst_RH.shape[1] != H or dst_RH.stride(1) != 1:
        raise ValueError(f"dst_RH {tuple(dst_RH.shape)} must be 2-D with contiguous rows of the source rows' width "
                         f"{H}")
    if not use_triton(src_RH, "push_rows"):
        first, n_src, at, n = (int(_scalar(v, src_RH).reshape(-1)[0])
                               for v in (src_start, src_count, dst_start, count))
        repeat_rows_host(whole_rows(src_RH, gather, first, n_src), dst_RH[at:at + n])
        return
    if H:
        block_h, rows = _row_steps(H, src_RH.element_size())
        source_TX, source_row_R = gather if gather is not None else (src_RH, src_RH)
        _repeat_rows[(ctas or full_width(src_RH.device),), src_RH.device](
            src_RH, _scalar(src_start, src_RH), _scalar(src_count, src_RH), dst_RH, _scalar(dst_start, src_RH),
            _scalar(count, src_RH), source_TX, source_row_R, H, H - src_RH.shape[1], _row_stride(src_RH),
            dst_RH.stride(0), source_TX.stride(0), GATHER=gather is not None, ROWS=rows, BLOCK_H=block_h,
            num_warps=8)


def repeat_rows_host(src_RH: torch.Tensor, dst_RH: torch.Tensor) -> None:
    """dst_RH = src_RH's rows repeated as often as needed (zeros when it has none), sizes on the host: a
    compute-only reference's received rows, made from the rank's own (the host-planned transports, and
    :func:`repeat_rows` without Triton)."""
    done = 0
    while done < dst_RH.shape[0]:
        rows = min(src_RH.shape[0], dst_RH.shape[0] - done)
        if rows == 0:  # nothing of its own to copy
            dst_RH[done:].zero_()
            return
        dst_RH[done:done + rows].copy_(src_RH[:rows])
        done += rows


def _row_steps(width: int, element_size: int, in_flight: int = IN_FLIGHT_BYTES) -> tuple[int, int]:
    """Columns a program moves per step (up to 8 KiB of a row) and rows per step (``in_flight`` bytes, a power of
    two; narrow rows: one per 4 KiB of it)."""
    block_h = min(8192 // element_size, triton.next_power_of_2(width))
    return block_h, max(1, min(in_flight // 4096, in_flight // (block_h * element_size)))


def _row_stride(t_RH: torch.Tensor) -> int:
    return t_RH.stride(0) if t_RH.shape[1] else 0  # a row of no columns: never read


def _launch(src_RH, src_start, count, route_start, dst_rank, dst_row, dst, stride_dst: int, ctas: int | None,
            routed: bool, gather: Gather | None = None, in_flight: int = IN_FLIGHT_BYTES) -> None:
    ctas = full_width(src_RH.device) if ctas is None else ctas
    if not ctas >= 1:
        raise ValueError(f"ctas={ctas}: a push needs at least one CTA")
    H = _width(src_RH, gather)
    block_h, rows = _row_steps(H, src_RH.element_size(), in_flight)
    source_TX, source_row_R = gather if gather is not None else (src_RH, src_start)
    X = H - src_RH.shape[1]
    aligned = all(n * src_RH.element_size() % 16 == 0
                  for n in (H, X, _row_stride(src_RH), stride_dst, _row_stride(source_TX)))
    kernel = _push_rows if routed else _copy_rows_out
    kernel[(ctas,), src_RH.device](src_RH, src_start, count, route_start, dst_rank, dst_row, dst, source_TX,
                                   source_row_R, H, X, _row_stride(src_RH), stride_dst, source_TX.stride(0),
                                   ROUTED=routed, GATHER=gather is not None, ALIGNED=aligned, ROWS=rows,
                                   BLOCK_H=block_h, num_warps=8)
