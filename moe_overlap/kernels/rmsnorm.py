"""RMSNorm, fused: one read of x and one write of y forward; one read of x and dy, one write of dx backward,
with the weight's gradient summed in fp32 per block of rows. fp32 arithmetic in registers, tensors in their
own dtype (the eager version makes an fp32 copy of x and several more full passes, each way).

    y = x * rstd * w,   rstd = 1 / sqrt(mean(x^2) + eps)
    dx = rstd * (w*dy - xhat * mean(xhat * w*dy)),   xhat = x * rstd;   dw = sum over rows of dy * xhat
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe_overlap.kernels.launch import sum_combine as _sum_combine

    def _rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, rows, H, eps, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        cols = tl.arange(0, BLOCK_H)
        in_h = cols < H
        w = tl.load(w_ptr + cols, mask=in_h, other=0.0).to(tl.float32)
        for i in range(ROWS):
            row = tl.program_id(0).to(tl.int64) * ROWS + i
            if row < rows:
                x = tl.load(x_ptr + row * H + cols, mask=in_h, other=0.0).to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 0, _sum_combine) / H + eps)
                tl.store(y_ptr + row * H + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=in_h)
                tl.store(rstd_ptr + row, rstd)

    def _rmsnorm_bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, rows, H,
                            ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
        cols = tl.arange(0, BLOCK_H)
        in_h = cols < H
        w = tl.load(w_ptr + cols, mask=in_h, other=0.0).to(tl.float32)
        dw = tl.full((BLOCK_H,), 0.0, tl.float32)
        for i in range(ROWS):
            row = tl.program_id(0).to(tl.int64) * ROWS + i
            if row < rows:
                x = tl.load(x_ptr + row * H + cols, mask=in_h, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * H + cols, mask=in_h, other=0.0).to(tl.float32)
                rstd = tl.load(rstd_ptr + row)
                xhat = x * rstd
                wdy = w * dy
                mean = tl.reduce(xhat * wdy, 0, _sum_combine) / H
                tl.store(dx_ptr + row * H + cols, (rstd * (wdy - xhat * mean)).to(dx_ptr.dtype.element_ty), mask=in_h)
                dw += dy * xhat
        tl.store(dw_partial_ptr + tl.program_id(0).to(tl.int64) * H + cols, dw, mask=in_h)

    _fwd = Kernel(_rmsnorm_fwd_kernel, do_not_specialize=["rows"])
    _bwd = Kernel(_rmsnorm_bwd_kernel, do_not_specialize=["rows"])

_ROWS = 16  # rows per program: the weight's gradient is summed over them in registers


def rmsnorm_forward_torch(x_TH: torch.Tensor, w_H: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x_TH.float()
    rstd_T = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    return (x32 * rstd_T[:, None] * w_H.float()).to(x_TH.dtype), rstd_T


def rmsnorm_backward_torch(x_TH, w_H, dy_TH, rstd_T) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw in fp32)."""
    xhat = x_TH.float() * rstd_T[:, None]
    wdy = w_H.float() * dy_TH.float()
    dx = rstd_T[:, None] * (wdy - xhat * (xhat * wdy).mean(-1, keepdim=True))
    return dx.to(x_TH.dtype), (dy_TH.float() * xhat).sum(0)


def _block_h(H: int) -> tuple[int, int]:
    block = triton.next_power_of_2(H)
    return block, 8 if block >= 4096 else 4


def rmsnorm_forward_triton(x_TH: torch.Tensor, w_H: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x_TH = x_TH.contiguous()
    rows, H = x_TH.shape
    y_TH = torch.empty_like(x_TH)
    rstd_T = torch.empty(rows, dtype=torch.float32, device=x_TH.device)
    if rows:
        block, warps = _block_h(H)
        _fwd[(triton.cdiv(rows, _ROWS),), x_TH.device](x_TH, w_H, y_TH, rstd_T, rows, H, eps, ROWS=_ROWS,
                                                       BLOCK_H=block, num_warps=warps)
    return y_TH, rstd_T


def rmsnorm_backward_triton(x_TH, w_H, dy_TH, rstd_T) -> tuple[torch.Tensor, torch.Tensor]:
    x_TH, dy_TH = x_TH.contiguous(), dy_TH.contiguous()
    rows, H = x_TH.shape
    dx_TH = torch.empty_like(x_TH)
    programs = triton.cdiv(rows, _ROWS)
    dw_partial = torch.empty((programs, H), dtype=torch.float32, device=x_TH.device)
    if rows:
        block, warps = _block_h(H)
        _bwd[(programs,), x_TH.device](x_TH, w_H, dy_TH, rstd_T, dx_TH, dw_partial, rows, H, ROWS=_ROWS,
                                       BLOCK_H=block, num_warps=warps)
    return dx_TH, dw_partial.sum(0)


def rmsnorm_forward(x_TH: torch.Tensor, w_H: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's dtype, rstd (T,) fp32 for the backward)."""
    if use_triton(x_TH, "rmsnorm"):
        return rmsnorm_forward_triton(x_TH, w_H, eps)
    return rmsnorm_forward_torch(x_TH, w_H, eps)


def rmsnorm_backward(x_TH: torch.Tensor, w_H: torch.Tensor, dy_TH: torch.Tensor,
                     rstd_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw (H,) in fp32)."""
    if use_triton(x_TH, "rmsnorm"):
        return rmsnorm_backward_triton(x_TH, w_H, dy_TH, rstd_T)
    return rmsnorm_backward_torch(x_TH, w_H, dy_TH, rstd_T)
