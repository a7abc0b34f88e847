"""AdamW in one pass over fp32 master weights, that also writes the model's own (bf16) copy.

One read of master, gradient and both moments, one write of master, moments and the model copy: torch's
fused AdamW followed by the copy into the bf16 parameters moves a sixth more bytes, the ``_foreach_``
version several times more. The gradient-clipping factor and whether to update at all (a non-finite norm
skips the step) are read from a small device tensor, so the step never waits for the host:

    control = (grad_scale, step, apply)   fp32: the clip factor; the update's 1-based step count (bias
                                          correction); 1 to update, 0 to leave every tensor as it is

The math is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments). The torch twin runs on
CPU and where triton is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, control_ptr, n, lr, beta1, beta2,
                      eps, weight_decay, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        # Each program walks blocks PROGRAMS apart: the control is read once per program, not once per block.
        if tl.load(control_ptr + 2) != 0.0:
            grad_scale = tl.load(control_ptr)
            step = tl.load(control_ptr + 1)
            bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
            step_size = lr / bias_correction1
            sqrt_bias_correction2 = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
            for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, PROGRAMS * BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                grad = tl.load(grad_ptr + offs, mask=mask, other=0.0) * grad_scale
                master = tl.load(master_ptr + offs, mask=mask, other=0.0)
                exp_avg = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
                exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
                master = master * (1.0 - lr * weight_decay)
                exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
                exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
                denom = tl.sqrt(exp_avg_sq) / sqrt_bias_correction2 + eps
                master = master - step_size * exp_avg / denom
                tl.store(master_ptr + offs, master, mask=mask)
                tl.store(exp_avg_ptr + offs, exp_avg, mask=mask)
                tl.store(exp_avg_sq_ptr + offs, exp_avg_sq, mask=mask)
                if HAS_COPY:
                    tl.store(copy_ptr + offs, master.to(copy_ptr.dtype.element_ty), mask=mask)

    _adamw = Kernel(_adamw_kernel, do_not_specialize=["n", "lr"])

# 1024 elements a block, 8 warps, 4 programs an SM walking the blocks: the best of benchmarks/step_kernels.py on an
# H200 (3.8 TB/s counting every byte; torch's fused AdamW and then the copy: 3.2).
_BLOCK, _WARPS, _PROGRAMS_PER_SM = 1024, 8, 4


@dataclass(frozen=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def adamw_update_torch(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       model_copy: torch.Tensor | None, control: torch.Tensor, hyper: AdamWHyper) -> None:
    """Twin of :func:`adamw_update`, in torch ops (the host reads ``apply``: CPU, or CUDA without triton)."""
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
                        block: int = _BLOCK, warps: int = _WARPS, programs_per_sm: int | None = _PROGRAMS_PER_SM) -> None:
    n = master.numel()
    if n == 0:
        return
    tensors = (master, grad, exp_avg, exp_avg_sq) + (() if model_copy is None else (model_copy,))
    if not all(t.is_contiguous() and t.numel() == n for t in tensors):
        raise ValueError("adamw_update needs contiguous tensors of one size")
    programs = triton.cdiv(n, block)
    if programs_per_sm is not None and master.is_cuda:
        programs = min(programs, programs_per_sm * torch.cuda.get_device_properties(master.device).multi_processor_count)
    _adamw[(programs,), master.device](
        master, grad, exp_avg, exp_avg_sq, master if model_copy is None else model_copy, control, n, hyper.lr,
        hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, HAS_COPY=model_copy is not None, BLOCK=block,
        PROGRAMS=programs, num_warps=warps)


def adamw_update(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 model_copy: torch.Tensor | None, control: torch.Tensor, hyper: AdamWHyper) -> None:
    """One AdamW step of fp32 ``master`` in place from fp32 ``grad`` (scaled by ``control[0]``), writing the
    moments and, with ``model_copy``, the updated weights in that tensor's dtype; nothing when ``control[2]`` is 0."""
    if use_triton(master, "adamw"):
        adamw_update_triton(master, grad, exp_avg, exp_avg_sq, model_copy, control, hyper)
    else:
        adamw_update_torch(master, grad, exp_avg, exp_avg_sq, model_copy, control, hyper)
