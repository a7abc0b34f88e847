"""SwiGLU of the expert FFN, fused: one pass over fc1's output forward, one pass backward that also
rebuilds the activation the fc2 weight gradient needs. fp32 arithmetic in registers, the tensors in their
own dtype (bf16 on GPU): the torch twin's fp32 temporaries cost several full passes over T x 2F.

h_TF2 holds [gate | up] along its last dimension; a = silu(gate) * up.
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # Programs stride over the rows below the device count, each on one block of FF columns: a static worst-case
    # buffer costs what its counted rows cost (one program per buffer row ran 2x that, 3 in 4 returning at once:
    # step_kernels_swiglu_1xh100.json); no per-element division (an int64 div/mod per element made the flat-index
    # version 3-4x slower than memory on an H200).
    def _swiglu_fwd_kernel(h_ptr, a_ptr, rows_ptr, FF, BLOCK: tl.constexpr):
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < FF
        for row in range(tl.program_id(0).to(tl.int64), tl.load(rows_ptr), tl.num_programs(0)):
            gate = tl.load(h_ptr + row * 2 * FF + col, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(h_ptr + row * 2 * FF + FF + col, mask=mask, other=0.0).to(tl.float32)
            silu = gate * (1.0 / (1.0 + tl.exp(-gate)))  # the backward's formula: both passes give the same a
            tl.store(a_ptr + row * FF + col, (silu * up).to(a_ptr.dtype.element_ty), mask=mask)

    def _swiglu_bwd_kernel(h_ptr, grad_a_ptr, grad_h_ptr, a_ptr, rows_ptr, FF, BLOCK: tl.constexpr):
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < FF
        out_ty = grad_h_ptr.dtype.element_ty
        for row in range(tl.program_id(0).to(tl.int64), tl.load(rows_ptr), tl.num_programs(0)):
            gate = tl.load(h_ptr + row * 2 * FF + col, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(h_ptr + row * 2 * FF + FF + col, mask=mask, other=0.0).to(tl.float32)
            grad = tl.load(grad_a_ptr + row * FF + col, mask=mask, other=0.0).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-gate))
            silu = gate * sig
            tl.store(grad_h_ptr + row * 2 * FF + col, (grad * up * sig * (1.0 + gate * (1.0 - sig))).to(out_ty),
                     mask=mask)
            tl.store(grad_h_ptr + row * 2 * FF + FF + col, (grad * silu).to(out_ty), mask=mask)
            tl.store(a_ptr + row * FF + col, (silu * up).to(a_ptr.dtype.element_ty), mask=mask)

    _fwd = Kernel(_swiglu_fwd_kernel)
    _bwd = Kernel(_swiglu_bwd_kernel)

_BLOCK = 1024
_PROGRAMS_PER_SM = 64  # row programs per SM: 64 ran at the counted rows' own cost, 4 about 10% slower (H100)


def swiglu_forward_torch(h_TF2: torch.Tensor) -> torch.Tensor:
    gate, up = h_TF2.float().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(h_TF2.dtype)


def swiglu_backward_torch(h_TF2: torch.Tensor, grad_a_TF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = h_TF2.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    grad = grad_a_TF.float()
    grad_gate = grad * up * sig * (1 + gate * (1 - sig))
    grad_h = torch.cat((grad_gate, grad * gate * sig), dim=-1).to(h_TF2.dtype)
    return grad_h, (gate * sig * up).to(h_TF2.dtype)


def _grid(a_TF: torch.Tensor) -> tuple[int, int]:
    """Row programs (at most the buffer's rows; a few in the interpreter) x blocks of FF columns."""
    most = 4
    if a_TF.is_cuda:
        most = _PROGRAMS_PER_SM * torch.cuda.get_device_properties(a_TF.device).multi_processor_count
    return min(a_TF.numel() // a_TF.shape[-1], most), triton.cdiv(a_TF.shape[-1], _BLOCK)


def _row_count(valid_rows: torch.Tensor | None, h_TF2: torch.Tensor) -> torch.Tensor:
    if valid_rows is None:
        return torch.full((1,), h_TF2.shape[0], dtype=torch.int64, device=h_TF2.device)
    return valid_rows


def swiglu_forward_triton(h_TF2: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    h_TF2 = h_TF2.contiguous()
    ffn = h_TF2.shape[-1] // 2
    a_TF = h_TF2.new_empty(h_TF2.shape[:-1] + (ffn,))
    if a_TF.numel():
        _fwd[_grid(a_TF), h_TF2.device](h_TF2, a_TF, _row_count(valid_rows, h_TF2), ffn, BLOCK=_BLOCK)
    return a_TF


def swiglu_backward_triton(h_TF2: torch.Tensor, grad_a_TF: torch.Tensor,
                           valid_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    h_TF2, grad_a_TF = h_TF2.contiguous(), grad_a_TF.contiguous()
    ffn = h_TF2.shape[-1] // 2
    grad_h_TF2 = torch.empty_like(h_TF2)
    a_TF = h_TF2.new_empty(grad_a_TF.shape)
    if a_TF.numel():
        _bwd[_grid(a_TF), h_TF2.device](h_TF2, grad_a_TF, grad_h_TF2, a_TF, _row_count(valid_rows, h_TF2), ffn,
                                        BLOCK=_BLOCK)
    return grad_h_TF2, a_TF


def swiglu_forward(h_TF2: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """a = silu(gate) * up. ``valid_rows`` (a one-element device tensor): only the first rows count, the
    kernel leaves the others unwritten (a static worst-case buffer; the twin computes them all)."""
    if use_triton(h_TF2, "swiglu"):
        return swiglu_forward_triton(h_TF2, valid_rows)
    return swiglu_forward_torch(h_TF2)


def swiglu_backward(h_TF2: torch.Tensor, grad_a_TF: torch.Tensor,
                    valid_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_h, a): fc1's output gradient, and the activation again for fc2's weight gradient."""
    if use_triton(h_TF2, "swiglu"):
        return swiglu_backward_triton(h_TF2, grad_a_TF, valid_rows)
    return swiglu_backward_torch(h_TF2, grad_a_TF)
