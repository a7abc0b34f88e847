"""Weight gradients accumulated straight into fp32 ``main_grad`` (Megatron's gradient_accumulation_fusion).

Under the precision recipe every weight's gradient is summed over the micro-batches of a step in the fp32
``main_grad`` that the optimizer attaches to the parameter. A layer whose backward computes a weight
gradient adds it there itself, in the GEMM that computes it where it can (``addmm(..., out_dtype=float32,
out=main_grad)`` for dense weights on CUDA, the grouped kernel of kernels/grouped_wgrad.py for experts),
instead of returning a bf16 gradient that a hook adds in a second pass over every weight, every
micro-batch. Such a parameter is marked at construction (:func:`mark_own_grad`) and the optimizers' hook
(:func:`take_grad`) does not add it again. Autograd still receives a gradient-shaped placeholder (an
uninitialised tensor, as Megatron's; under a graph's capture one per shape: :func:`placeholder`), so the hooks the
distributed optimizer counts on still fire. A parameter without ``main_grad`` (a model without an optimizer) gets its
gradient returned the ordinary way.
"""

from __future__ import annotations

import weakref

import torch

from moe_overlap.kernels.grouped_wgrad import grouped_wgrad_accumulate
from moe_overlap.layers.fp8 import Fp8, fp8_wgrad
from moe_overlap.layers.param_info import param_info


def mark_own_grad(*params: torch.Tensor) -> None:
    """These parameters' layers add their gradients into ``main_grad`` themselves."""
    for param in params:
        param_info(param).adds_own_grad = True


def adds_own_grad(param: torch.Tensor) -> bool:
    return param_info(param).adds_own_grad


def take_grad(param: torch.Tensor) -> None:
    """The optimizers' post-accumulate-grad hook: the gradient autograd accumulated goes into ``main_grad``
    (unless the layer already put it there) and ``param.grad`` is dropped. No gradient: its layer deferred it
    to a zero-bubble schedule's W (layers/deferred_wgrad.py)."""
    if param.grad is None:
        return
    if not adds_own_grad(param):
        param_info(param).main_grad.add_(param.grad)
    param.grad = None


# (shape, dtype, device) -> the one uninitialised tensor, while a parameter of that shape holds it (param_info)
_PLACEHOLDERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def placeholder(param: torch.Tensor) -> torch.Tensor:
    """What a layer returns to autograd for a gradient it added into ``main_grad``: shaped and laid out like
    ``param`` (so autograd keeps it instead of copying), never read (autograd may add two of them in place, a tied
    weight's: garbage into garbage); the hook drops it at once. Eager, a fresh tensor per call, gone with the hook.
    Under a CUDA graph's capture, one tensor per shape, shared by every parameter and capture, each given a fresh
    alias (which autograd takes as it is): a graphed layer's backward keeps what it returns as its graph's static
    output, so a placeholder of its own would hold every graphed expert weight's size for the whole run (6 GiB in
    the fine bench model's 8 MoE layers at EP=1, one set of graphs). Only there: shared by eager layers too, it stayed
    allocated for the whole run (2.6 GiB in the Mixtral-like bench model, its experts' two shapes)."""
    if not _capturing(param):
        return torch.empty(param.shape, dtype=param.dtype, device=param.device)
    info = param_info(param)
    key = (tuple(param.shape), param.dtype, param.device)
    held = info.grad_placeholder
    if held is None or (tuple(held.shape), held.dtype, held.device) != key:
        held = _PLACEHOLDERS.get(key)
        if held is None:
            held = _PLACEHOLDERS[key] = torch.empty(key[0], dtype=param.dtype, device=param.device)
        info.grad_placeholder = held
    return held.detach()


def _capturing(param: torch.Tensor) -> bool:
    return param.is_cuda and torch.cuda.is_current_stream_capturing()


def main_grad_of(param: torch.Tensor) -> torch.Tensor | None:
    return param_info(param).main_grad


def linear_wgrad(param: torch.Tensor, grad_out_SF: torch.Tensor, x_SH: torch.Tensor) -> torch.Tensor:
    """The gradient of a (F, H) weight, grad_out^T @ x: into ``main_grad`` (fp32, in the GEMM), or returned."""
    main_grad = main_grad_of(param)
    if main_grad is None:
        return torch.mm(grad_out_SF.t(), x_SH)
    if grad_out_SF.dtype == torch.float32:
        main_grad.addmm_(grad_out_SF.t(), x_SH)
    elif grad_out_SF.is_cuda:  # bf16 operands, fp32 accumulation and output, no bf16 gradient in between
        torch.addmm(main_grad, grad_out_SF.t(), x_SH, out_dtype=torch.float32, out=main_grad)
    else:  # CPU has no mixed-dtype addmm: the bf16 product, then the sum
        main_grad.add_(torch.mm(grad_out_SF.t(), x_SH))
    return placeholder(param)


def grouped_wgrad(param: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  experts: slice = slice(None), fp8: Fp8 | None = None, few_rows: bool = False) -> torch.Tensor | None:
    """The gradient of an expert weight (E, M, N) from one or two micro-batches' rows (``segments``: (x_TM,
    grad_TN, int32 end offsets per expert); rows past the last offset are skipped), per expert the sum of
    x_e^T @ grad_e: accumulated into ``main_grad[experts]`` in fp32 inside the grouped kernel (returns None: the
    caller returns :func:`placeholder` once for the whole parameter), or returned in the parameter's dtype
    (``experts``: the run of local experts this call covers). ``fp8`` (train.fp8_wgrad): in FP8. ``few_rows``: most
    experts have none (an overflow chunk's rows: kernels/grouped_wgrad.grouped_wgrad_accumulate)."""
    main_grad = main_grad_of(param)
    if fp8 is not None and fp8.wgrad:
        out = main_grad[experts] if main_grad is not None else torch.zeros(
            param[experts].shape, dtype=torch.float32, device=param.device)
        fp8_wgrad(segments, out, fp8)
        return None if main_grad is not None else out.to(param.dtype)
    if main_grad is None:
        return sum(torch._grouped_mm(x.t(), grad, offs=offsets) for x, grad, offsets in segments)
    grouped_wgrad_accumulate(segments, main_grad[experts], few_rows)
    return None


def fp32_wgrad(param: torch.Tensor, grad_fp32: torch.Tensor) -> torch.Tensor:
    """A weight gradient a kernel already summed in fp32 (norm weights): into ``main_grad``, or returned in the
    parameter's dtype."""
    main_grad = main_grad_of(param)
    if main_grad is None:
        return grad_fp32.to(param.dtype)
    main_grad.add_(grad_fp32)
    return placeholder(param)
