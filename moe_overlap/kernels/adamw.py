"""AdamW in one pass over fp32 master weights, that also writes the model's own (bf16) copy.

One read of master, gradient and both moments, one write of master, moments and the model copy: torch's
fused AdamW followed by the copy into the bf16 parameters moves a sixth more bytes, the ``_foreach_``
version several times more. The gradient-clipping factor and whether to update at all (a non-finite norm
skips the step) are read from a small device tensor, so the step never waits for the host:

    control = (grad_scale, step, apply)   fp32: the clip factor; the update's 1-based step count (bias
                                          correction); 1 to update, 0 to leave every tensor as it is

The math is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments). The torch twin runs on
CPU and where triton is missing.

Where the model holds a weight only as its FP8 copies (train.fp8_param) there is no model copy to write: the
step, tile by tile of each matrix, leaves the new weights' row and column maxima instead (:class:`WeightMaxima`),
the first of the rowwise copies' two passes (kernels/fp8_quant.py), so the copies are made by reading the master
once more, not twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.kernels.fp8_quant import amax_along, round_mode
from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, strided_programs, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from moe_overlap.kernels.fp8_quant import as_stored
    from moe_overlap.kernels.launch import DeviceFunction, max_combine

    def _factors(control_ptr, lr, beta1, beta2):
        """(grad_scale, step_size, sqrt_bias_correction2) of the step the control tensor describes."""
        grad_scale = tl.load(control_ptr)
        step = tl.load(control_ptr + 1)
        bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
        return grad_scale, lr / bias_correction1, tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))

    def _adamw_values(master, grad, grad_scale, exp_avg, exp_avg_sq, step_size, sqrt_bias_correction2, lr, beta1,
                      beta2, eps, weight_decay):
        """One AdamW step of loaded values (the gradient before its scale): (master, exp_avg, exp_avg_sq). Every
        multiply an add or subtract takes is written as a fused multiply-add, so the compiler has none left to fuse
        or not: ptxas chooses by how a tile is laid out over the threads, and left the moments of one-row tiles at 4
        values a thread 1 ulp off the flat step's (2026-11-28, 1xH200). Compiling with no fusion at all made the
        same rounding but ran the flat step 10-15% slower (step_kernels_fp8_param_nofma_1xh200.json)."""
        exp_avg = tl.fma(tl.fma(grad, grad_scale, -exp_avg), 1.0 - beta1, exp_avg)
        grad = grad * grad_scale
        exp_avg_sq = tl.fma(exp_avg_sq, beta2, (1.0 - beta2) * grad * grad)
        denom = tl.sqrt(exp_avg_sq) / sqrt_bias_correction2 + eps
        return tl.fma(master, 1.0 - lr * weight_decay, -(step_size * exp_avg / denom)), exp_avg, exp_avg_sq

    factors, adamw_values = DeviceFunction(_factors), DeviceFunction(_adamw_values)

    def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, control_ptr, n, lr, beta1, beta2,
                      eps, weight_decay, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        # Each program walks blocks PROGRAMS apart: the control is read once per program, not once per block.
        if tl.load(control_ptr + 2) != 0.0:
            grad_scale, step_size, sqrt_bias_correction2 = factors(control_ptr, lr, beta1, beta2)
            for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, PROGRAMS * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                master, exp_avg, exp_avg_sq = adamw_values(
                    tl.load(master_ptr + offs, mask=mask, other=0.0), tl.load(grad_ptr + offs, mask=mask, other=0.0),
                    grad_scale, tl.load(exp_avg_ptr + offs, mask=mask, other=0.0),
                    tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0), step_size, sqrt_bias_correction2, lr,
                    beta1, beta2, eps, weight_decay)
                tl.store(master_ptr + offs, master, mask=mask)
                tl.store(exp_avg_ptr + offs, exp_avg, mask=mask)
                tl.store(exp_avg_sq_ptr + offs, exp_avg_sq, mask=mask)
                if HAS_COPY:
                    tl.store(copy_ptr + offs, master.to(copy_ptr.dtype.element_ty), mask=mask)

    # With maxima (train.fp8_param): strips of SPAN_M rows and BLOCK_K columns of the matrices (master (B, M, K)),
    # each program walking strips PROGRAMS apart as the flat kernel walks blocks, and each strip in (BLOCK_M, BLOCK_K)
    # tiles: a tile's step, then its new values' row maxima (as ROUND stores them) into the rowwise FP8 copies'
    # buffer by atomic maxima; the column maxima are kept in registers down the strip and leave it as one atomic
    # maximum per column (a tile's own would be one per BLOCK_M elements). Also where the step does not apply (the
    # copies are made again all the same).
    def _adamw_maxima_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, control_ptr, amax_rows_ptr,
                             amax_cols_ptr, M, K, strips, lr, beta1, beta2, eps, weight_decay, ROUND: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPAN_M: tl.constexpr,
                             PROGRAMS: tl.constexpr):
        apply = tl.load(control_ptr + 2) != 0.0
        grad_scale, step_size, sqrt_bias_correction2 = factors(control_ptr, lr, beta1, beta2)
        strips_k = (K + BLOCK_K - 1) // BLOCK_K
        strips_per_matrix = (M + SPAN_M - 1) // SPAN_M * strips_k
        for strip in range(tl.program_id(0), strips, PROGRAMS):
            matrix = (strip // strips_per_matrix).to(tl.int64)
            first_m = (strip % strips_per_matrix // strips_k) * SPAN_M
            rk = (strip % strips_k) * BLOCK_K + tl.arange(0, BLOCK_K)
            in_k = rk < K
            columns_max = tl.full((BLOCK_K,), 0.0, tl.float32)
            for m0 in range(0, SPAN_M, BLOCK_M):
                rm = first_m + m0 + tl.arange(0, BLOCK_M)
                in_m = rm < M
                mask = in_m[:, None] & in_k[None, :]
                offs = matrix * M * K + rm[:, None].to(tl.int64) * K + rk[None, :]
                master = tl.load(master_ptr + offs, mask=mask, other=0.0)
                if apply:
                    master, exp_avg, exp_avg_sq = adamw_values(
                        master, tl.load(grad_ptr + offs, mask=mask, other=0.0), grad_scale,
                        tl.load(exp_avg_ptr + offs, mask=mask, other=0.0),
                        tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0), step_size, sqrt_bias_correction2, lr,
                        beta1, beta2, eps, weight_decay)
                    tl.store(master_ptr + offs, master, mask=mask)
                    tl.store(exp_avg_ptr + offs, exp_avg, mask=mask)
                    tl.store(exp_avg_sq_ptr + offs, exp_avg_sq, mask=mask)
                x_abs = tl.where(mask, tl.abs(as_stored(master, ROUND)), 0.0)
                tl.atomic_max(amax_rows_ptr + matrix * M + rm, tl.reduce(x_abs, 1, max_combine), mask=in_m,
                              sem="relaxed")
                columns_max = tl.maximum(columns_max, tl.reduce(x_abs, 0, max_combine))
            tl.atomic_max(amax_cols_ptr + matrix * K + rk, columns_max, mask=in_k, sem="relaxed")

    _adamw = Kernel(_adamw_kernel, do_not_specialize=["n", "lr"])
    _adamw_maxima = Kernel(_adamw_maxima_kernel, do_not_specialize=["strips", "lr"])

# 1024 elements a block, 8 warps, 4 programs an SM walking the blocks: the best of benchmarks/step_kernels.py on an
# H200 (3.8 TB/s counting every byte; torch's fused AdamW and then the copy: 3.2).
_BLOCK, _WARPS, _PROGRAMS_PER_SM = 1024, 8, 4


# (BLOCK_M, BLOCK_K, SPAN_M), warps, programs an SM: the best of benchmarks/step_kernels.py fp8_param on an H200
# (step_kernels_fp8_param_strips2_1xh200.json; again with the multiply-adds written out, ..._fma2_1xh200.json): strips
# of 32 one-row tiles at 8 warps hold the flat step's registers (4 values of each tensor a thread): fine fc1 1.98 ms and
# Mixtral fc1 6.71 against 2.24 / 7.33 for 4 x 1,024 tiles at 4 warps (32 values a thread), the flat step writing the
# bf16 copy 2.10 / 7.21
_MAXIMA_BLOCKS, _MAXIMA_WARPS, _MAXIMA_PROGRAMS_PER_SM = (1, 1024, 32), 8, 4


@dataclass(frozen=True)
class WeightMaxima:
    """Where a step also leaves its new weights' maxima, per row and per column of each matrix (master viewed
    (B, M, K)), read as ``as_dtype``: the first pass of the rowwise FP8 copies' quantization
    (kernels/fp8_quant.quantize_rows_and_columns' ``amax``), made while the step has the weights in hand
    (train.fp8_param, layers/fp8.py)."""

    rows_BM: torch.Tensor  # float32 (B * M,)
    columns_BK: torch.Tensor  # float32 (B * K,)
    as_dtype: torch.dtype


@dataclass(frozen=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def adamw_update_torch(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       model_copy: torch.Tensor | None, control: torch.Tensor, hyper: AdamWHyper,
                       maxima: WeightMaxima | None = None) -> None:
    """Twin of :func:`adamw_update`, in torch ops (the host reads ``apply``: CPU, or CUDA without triton)."""
    _adamw_torch(master, grad, exp_avg, exp_avg_sq, model_copy, control, hyper)
    if maxima is not None:
        matrices = master.view(-1, *master.shape[-2:])
        maxima.rows_BM.copy_(amax_along(matrices, -1, as_dtype=maxima.as_dtype).reshape(-1))
        maxima.columns_BK.copy_(amax_along(matrices, -2, as_dtype=maxima.as_dtype).reshape(-1))


def _adamw_torch(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 model_copy: torch.Tensor | None, control: torch.Tensor, hyper: AdamWHyper) -> None:
    grad_scale, step, apply = control.tolist()
    if not apply:
        return
    g = grad * grad_scale
    master.mul_(1.0 - hyper.lr * hyper.weight_decay)
    exp_avg.lerp_(g, 1.0 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
    denom = (exp_avg_sq.sqrt() / (1.0 - hyper.beta2 ** step) ** 0.5).add_(hyper.eps)
    master.addcdiv_(exp_avg, denom, value=-hyper.lr / (1.0 - hyper.beta1 ** step))
    if model_copy is not None:
        model_copy.copy_(master)


def adamw_update_triton(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        model_copy: torch.Tensor | None, control: torch.Tensor, hyper: AdamWHyper,
                        block: int = _BLOCK, warps: int = _WARPS,
                        programs_per_sm: int | None = _PROGRAMS_PER_SM) -> None:
    n = master.numel()
    if n == 0:
        return
    tensors = (master, grad, exp_avg, exp_avg_sq) + (() if model_copy is None else (model_copy,))
    if not all(t.is_contiguous() and t.numel() == n for t in tensors):
        raise ValueError("adamw_update needs contiguous tensors of one size")
    programs = _programs(triton.cdiv(n, block), programs_per_sm, master.device)
    _adamw[(programs,), master.device](
        master, grad, exp_avg, exp_avg_sq, master if model_copy is None else model_copy, control, n, hyper.lr,
        hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, HAS_COPY=model_copy is not None, BLOCK=block,
        PROGRAMS=programs, num_warps=warps)


def _programs(work: int, programs_per_sm: int | None, device: torch.device) -> int:
    """Programs of a kernel that walks ``work`` blocks or tiles: one each, or at most that many an SM (CUDA)."""
    return work if programs_per_sm is None else strided_programs(work, programs_per_sm, device, off_gpu=work)


def adamw_maxima_triton(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                        control: torch.Tensor, hyper: AdamWHyper, maxima: WeightMaxima,
                        blocks: tuple[int, int, int] = _MAXIMA_BLOCKS, warps: int = _MAXIMA_WARPS,
                        programs_per_sm: int | None = _MAXIMA_PROGRAMS_PER_SM) -> None:
    """``blocks``: (BLOCK_M, BLOCK_K, SPAN_M), a tile and the rows of a program's strip (a multiple of BLOCK_M)."""
    if not all(t.is_contiguous() and t.shape == master.shape for t in (grad, exp_avg, exp_avg_sq)):
        raise ValueError("adamw_update needs contiguous tensors of one shape")
    M, K = master.shape[-2:]
    block_m, block_k, span_m = blocks
    if span_m % block_m:
        raise ValueError(f"a strip of {span_m} rows is not a multiple of {block_m}-row tiles")
    strips = master.numel() // (M * K) * triton.cdiv(M, span_m) * triton.cdiv(K, block_k)
    programs = _programs(strips, programs_per_sm, master.device)
    maxima.rows_BM.zero_()  # the atomic maxima start from zeros
    maxima.columns_BK.zero_()
    _adamw_maxima[(programs,), master.device](
        master, grad, exp_avg, exp_avg_sq, control, maxima.rows_BM, maxima.columns_BK, M, K, strips, hyper.lr,
        hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, ROUND=round_mode(master, maxima.as_dtype),
        BLOCK_M=block_m, BLOCK_K=block_k, SPAN_M=span_m, PROGRAMS=programs, num_warps=warps)


def adamw_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 model_copy: torch.Tensor | None, control: torch.Tensor, hyper: AdamWHyper,
                 maxima: WeightMaxima | None = None) -> None:
    """One AdamW step of fp32 ``master`` in place from fp32 ``grad`` (scaled by ``control[0]``), writing the
    moments and, with ``model_copy``, the updated weights in that tensor's dtype; nothing when ``control[2]`` is 0.
    With ``maxima`` (no model copy then: train.fp8_param holds the weights as FP8 copies), the new weights' row and
    column maxima too, in the same pass over the master (and where the step does not apply, of the weights as they
    are)."""
    if maxima is not None and model_copy is not None:
        raise ValueError("adamw_update writes maxima in place of a model copy, not both")
    if not use_triton(master, "adamw"):
        adamw_update_torch(master, grad, exp_avg, exp_avg_sq, model_copy, control, hyper, maxima)
    elif maxima is not None:
        adamw_maxima_triton(master, grad, exp_avg, exp_avg_sq, control, hyper, maxima)
    else:
        adamw_update_triton(master, grad, exp_avg, exp_avg_sq, model_copy, control, hyper)
