"""Grouped weight-gradient GEMM that accumulates into fp32 in place: out[e] += a_e^T @ b_e.

The rows of expert e are [offsets[e-1], offsets[e]) of a_TM and b_TN (offsets int32 on the device, rows past
the last offset never read), so the kernel serves the static worst-case buffers of the sync-free dispatch and
runs inside CUDA graphs. Each program owns one (BLOCK_M, BLOCK_N) tile of one expert's output: it sums the
expert's rows in fp32 on the tensor cores and adds the tile into ``out`` (the parameter's fp32 main_grad)
once, so the bf16 gradient and the separate pass that added it never exist. torch._grouped_mm cannot do this
on torch 2.11 (it refuses an fp32 output for bf16 operands).

The torch twin (CPU, or without triton) is the grouped GEMM followed by the sum.
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel, interpreter_requested, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    def _grouped_wgrad_kernel(a_ptr, b_ptr, offsets_ptr, out_ptr, M, N, stride_a, stride_b, stride_oe, stride_om,
                              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        expert = tl.program_id(1)
        start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
        end = tl.load(offsets_ptr + expert)
        # Tiles in groups of GROUP_M rows of tiles, so neighbouring programs share a's and b's columns in L2.
        tiles_m = (M + BLOCK_M - 1) // BLOCK_M
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        rows_of_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_of_group
        pid_n = (pid % (GROUP_M * tiles_n)) // rows_of_group
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k in range(start, end, BLOCK_K):
            rows = (k + rk).to(tl.int64)
            in_rows = rows < end
            mask_a = in_rows[:, None] if EVEN_M else in_rows[:, None] & (rm[None, :] < M)
            mask_b = in_rows[:, None] if EVEN_N else in_rows[:, None] & (rn[None, :] < N)
            a_KM = tl.load(a_ptr + rows[:, None] * stride_a + rm[None, :], mask=mask_a, other=0.0)
            b_KN = tl.load(b_ptr + rows[:, None] * stride_b + rn[None, :], mask=mask_b, other=0.0)
            acc = tl.dot(tl.trans(a_KM), b_KN, acc)
        if end > start:  # an expert without rows adds nothing
            out = out_ptr + expert.to(tl.int64) * stride_oe + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            # An add in L2 rather than a load and a store: the SM does not wait for the old value (measured: a
            # quarter of the epilogue's cost). One program owns each element, so the sum is deterministic.
            tl.atomic_add(out, acc, mask=mask, sem="relaxed")

    _grouped_wgrad = Kernel(_grouped_wgrad_kernel)

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the best of benchmarks/step_kernels.py on an H200.
_CONFIG = (128, 128, 32, 4, 5)


def grouped_wgrad_accumulate_torch(a_TM: torch.Tensor, b_TN: torch.Tensor, offsets_E: torch.Tensor,
                                   out_EMN: torch.Tensor) -> None:
    """Twin: the grouped GEMM in the operands' dtype, then the fp32 sum."""
    if a_TM.shape[0] == 0:
        return
    out_EMN.add_(torch._grouped_mm(a_TM.t(), b_TN, offs=offsets_E).float())


def grouped_wgrad_accumulate_triton(a_TM: torch.Tensor, b_TN: torch.Tensor, offsets_E: torch.Tensor,
                                    out_EMN: torch.Tensor, config: tuple[int, ...] = _CONFIG) -> None:
    experts, M, N = out_EMN.shape
    if a_TM.shape[0] == 0 or out_EMN.numel() == 0:
        return
    if a_TM.stride(1) != 1 or b_TN.stride(1) != 1 or out_EMN.stride(2) != 1:
        raise ValueError("grouped_wgrad_accumulate needs unit column strides (rows may be strided)")
    block_m, block_n, block_k, warps, stages = config
    if not a_TM.is_cuda or interpreter_requested():  # the interpreter: small tiles keep the CPU tests quick
        block_m, block_n, block_k = min(block_m, 32), min(block_n, 32), min(block_k, 16)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), experts)
    _grouped_wgrad[grid, a_TM.device](
        a_TM, b_TN, offsets_E, out_EMN, M, N, a_TM.stride(0), b_TN.stride(0), out_EMN.stride(0), out_EMN.stride(1),
        EVEN_M=M % block_m == 0, EVEN_N=N % block_n == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=8, num_warps=warps, num_stages=stages)


def grouped_wgrad_accumulate(a_TM: torch.Tensor, b_TN: torch.Tensor, offsets_E: torch.Tensor,
                             out_EMN: torch.Tensor) -> None:
    """out_EMN[e] += a_TM[rows of e]^T @ b_TN[rows of e] in fp32 (``out_EMN`` fp32; rows of e between the
    int32 end offsets ``offsets_E[e-1]`` and ``offsets_E[e]``)."""
    if use_triton(a_TM, "grouped_wgrad"):
        grouped_wgrad_accumulate_triton(a_TM, b_TN, offsets_E, out_EMN)
    else:
        grouped_wgrad_accumulate_torch(a_TM, b_TN, offsets_E, out_EMN)
