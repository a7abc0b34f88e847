"""Grouped weight-gradient GEMM that accumulates into fp32 in place: out[e] += a_e^T @ b_e (one micro-batch's
rows, or several micro-batches' summed in the same program: see layers/experts.py,
``train.expert_wgrad_micro_batches``).

The rows of expert e are [offsets[e-1], offsets[e]) of a_TM and b_TN (offsets int32 on the device, rows past
the last offset never read), so the kernel serves the static worst-case buffers of the device-planned exchange and
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

    from moe_overlap.kernels.launch import DeviceFunction, tile_in_groups

    def _expert_tile(a_ptrs, b_ptrs, offsets_ptrs, strides_a, strides_b, out_ptr, expert, rm, rn, rk, M, N,
                     stride_oe, stride_om, SEGMENTS: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One expert's (rm, rn) tile: its rows of every segment summed, added into ``out``."""
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        rows_seen = 0
        for segment in tl.static_range(SEGMENTS):  # each further segment: another micro-batch's rows, same sum
            a_base, b_base, offsets = a_ptrs[segment], b_ptrs[segment], offsets_ptrs[segment]
            step_a, step_b = strides_a[segment], strides_b[segment]
            start = tl.load(offsets + expert - 1, mask=expert > 0, other=0)
            end = tl.load(offsets + expert)
            rows_seen += end - start
            # Pointers made once and stepped (int64 only for the expert's first row): the per-iteration address
            # arithmetic of a [BLOCK_K, BLOCK_M] tile otherwise competes with the tensor cores.
            a_KM = a_base + start.to(tl.int64) * step_a + rk[:, None] * step_a + rm[None, :]
            b_KN = b_base + start.to(tl.int64) * step_b + rk[:, None] * step_b + rn[None, :]
            for k in range(0, end - start, BLOCK_K):
                in_rows = rk[:, None] < end - start - k
                mask_a = in_rows if EVEN_M else in_rows & (rm[None, :] < M)
                mask_b = in_rows if EVEN_N else in_rows & (rn[None, :] < N)
                acc = tl.dot(tl.trans(tl.load(a_KM, mask=mask_a, other=0.0)), tl.load(b_KN, mask=mask_b, other=0.0),
                             acc)
                a_KM += BLOCK_K * step_a
                b_KN += BLOCK_K * step_b
        if rows_seen > 0:  # an expert without rows adds nothing
            out = out_ptr + expert.to(tl.int64) * stride_oe + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
            mask = (rm[:, None] < M) & (rn[None, :] < N)
            # An add in L2 rather than a load and a store: the SM does not wait for the old value (measured: a
            # quarter of the epilogue's cost). One program owns each element, so the sum is deterministic.
            tl.atomic_add(out, acc, mask=mask, sem="relaxed")

    expert_tile = DeviceFunction(_expert_tile)

    # Per segment (a micro-batch's rows), one element of each tuple: a, b, their end offsets and row strides.
    # EXPERT_LOOP: each program walks every expert's tile in turn (few rows, as an overflow chunk's), instead of one
    # program per (tile, expert): the heavy programs of experts without rows would cost their launch each.
    def _grouped_wgrad_kernel(a_ptrs, b_ptrs, offsets_ptrs, strides_a, strides_b, out_ptr, M, N, stride_oe, stride_om,
                              experts, SEGMENTS: tl.constexpr,
                              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                              EXPERT_LOOP: tl.constexpr):
        pid = tl.program_id(0)
        pid_m, pid_n = tile_in_groups(pid, (M + BLOCK_M - 1) // BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        if EXPERT_LOOP:
            for expert in range(0, experts):  # (pid * 0 + expert: a tensor for the interpreter too)
                expert_tile(a_ptrs, b_ptrs, offsets_ptrs, strides_a, strides_b, out_ptr, pid * 0 + expert, rm, rn, rk,
                            M, N, stride_oe, stride_om, SEGMENTS, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            expert_tile(a_ptrs, b_ptrs, offsets_ptrs, strides_a, strides_b, out_ptr, tl.program_id(1), rm, rn, rk, M,
                        N, stride_oe, stride_om, SEGMENTS, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K)

    _grouped_wgrad = Kernel(_grouped_wgrad_kernel)

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the best of benchmarks/step_kernels.py on an H200.
_CONFIG = (128, 128, 32, 4, 5)


Segment = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (a_TM, b_TN, int32 end offsets per expert)


def grouped_wgrad_accumulate_torch(segments: list[Segment], out_EMN: torch.Tensor) -> None:
    """Twin: each segment's grouped GEMM in the operands' dtype, then the fp32 sum."""
    for a_TM, b_TN, offsets_E in segments:
        if a_TM.shape[0]:
            out_EMN.add_(torch._grouped_mm(a_TM.t(), b_TN, offs=offsets_E).float())


def grouped_wgrad_accumulate_triton(segments: list[Segment], out_EMN: torch.Tensor,
                                    config: tuple[int, ...] = _CONFIG, expert_loop: bool = False) -> None:
    experts, M, N = out_EMN.shape
    if out_EMN.numel() == 0:
        return
    if not segments:
        raise ValueError("grouped_wgrad_accumulate sums one or more segments, got none")
    if any(a.stride(1) != 1 or b.stride(1) != 1 for a, b, _ in segments) or out_EMN.stride(2) != 1:
        raise ValueError("grouped_wgrad_accumulate needs unit column strides (rows may be strided)")
    a = segments[0][0]
    block_m, block_n, block_k, warps, stages = config
    if not a.is_cuda or interpreter_requested():  # the interpreter: small tiles keep the CPU tests quick
        block_m, block_n, block_k = min(block_m, 32), min(block_n, 32), min(block_k, 16)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), 1 if expert_loop else experts)
    a_all, b_all, offsets_all = zip(*segments)
    _grouped_wgrad[grid, a.device](
        a_all, b_all, offsets_all, tuple(x.stride(0) for x in a_all), tuple(x.stride(0) for x in b_all), out_EMN, M, N,
        out_EMN.stride(0), out_EMN.stride(1), experts, SEGMENTS=len(segments), EVEN_M=M % block_m == 0,
        EVEN_N=N % block_n == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        EXPERT_LOOP=expert_loop, num_warps=warps, num_stages=stages)


def grouped_wgrad_accumulate(segments: list[Segment], out_EMN: torch.Tensor, few_rows: bool = False) -> None:
    """out_EMN[e] += sum over segments of a_TM[rows of e]^T @ b_TN[rows of e], in fp32 (``out_EMN`` fp32; a
    segment's rows of e between its int32 end offsets[e-1] and offsets[e]; one segment, or several: as many
    micro-batches' rows summed in registers, one add into ``out_EMN``). ``few_rows``: most experts have none (an
    overflow chunk's), so each program walks every expert's tile instead of one program per expert and tile."""
    if use_triton(segments[0][0], "grouped_wgrad"):
        grouped_wgrad_accumulate_triton(segments, out_EMN, expert_loop=few_rows)
    else:
        grouped_wgrad_accumulate_torch(segments, out_EMN)
