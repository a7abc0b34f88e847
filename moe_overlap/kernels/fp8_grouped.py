"""The experts' rowwise FP8 grouped GEMM on Hopper, fed by the TMA: out[rows of e] = (a_q[rows of e] @ w_q[e]^T) x
a_scale[row] x w_scale[e, column], in bf16, the tensor cores accumulating fast (``use_fast_accum``).

It computes what ``torch._scaled_grouped_mm(a_q, w_q.transpose(-2, -1), a_scale, w_scale, offs=offsets,
use_fast_accum=True)`` computes, bit for bit (tests/test_gpu_fp8.py), 4-10% faster on the experts' shapes on an
H200 (benchmarks/fp8_grouped_tma.py, RESULTS.md "The experts' FP8 GEMMs fed by the TMA"). Each expert's rows come
through a ragged TMA descriptor (triton.tools.ragged_tma: rows past the expert read as zero, the output's rows past
it never written, so rows past the last offset are left as they are), the weight through a 3-D one; the scales
are applied once after the loop. A program finds its expert by walking the end offsets on the device (no host
sync), so the kernel serves the device-planned exchange's static buffers and runs inside CUDA graphs.

Why not Triton's pointer loads (the blockwise kernel's): compiled for sm_90, a loop over pointer tensors loads into
registers and is not pipelined (benchmarks/wgrad_tma.py); the TMA's loads are.
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.tools.ragged_tma import create_ragged_descriptor, load_ragged, store_ragged
    from triton.tools.tensor_descriptor import TensorDescriptor

    def _fp8_grouped_kernel(a_desc, a_scale_ptr, w_desc, w_scale_ptr, offsets_ptr, out_desc, N, K, E, tiles_m,
                            stride_wse, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, STAGES: tl.constexpr):
        # Programs in groups of GROUP_M row tiles, so that neighbours share the weight's column tiles in L2.
        pid = tl.program_id(0)
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        width = GROUP_M * tiles_n
        first_tile = pid // width * GROUP_M
        rows_of_group = tl.minimum(tiles_m - first_tile, GROUP_M)
        tile = first_tile + (pid % width) % rows_of_group
        pid_n = (pid % width) // rows_of_group
        # Expert e owns row tiles [before_e, before_e + cdiv(rows_e, BLOCK_M)); a tile past the last one's is idle.
        expert = tl.full((), -1, tl.int32)
        start_row = tl.full((), 0, tl.int32)
        end_row = tl.full((), 0, tl.int32)
        local_row = tl.full((), 0, tl.int32)
        before = tl.full((), 0, tl.int32)
        start = tl.full((), 0, tl.int32)
        for e in range(0, E):
            end = tl.load(offsets_ptr + e)
            tiles_e = (end - start + BLOCK_M - 1) // BLOCK_M
            hit = (tile >= before) & (tile < before + tiles_e)
            expert = tl.where(hit, e, expert)
            start_row = tl.where(hit, start, start_row)
            end_row = tl.where(hit, end, end_row)
            local_row = tl.where(hit, (tile - before) * BLOCK_M, local_row)
            before += tiles_e
            start = end
        if expert >= 0:
            rows = end_row - start_row
            acc_MN = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                a_MK = load_ragged(a_desc, start_row, rows, [local_row, k])
                w_NK = w_desc.load([expert, pid_n * BLOCK_N, k]).reshape(BLOCK_N, BLOCK_K)
                acc_MN = tl.dot(a_MK, tl.trans(w_NK), acc_MN)
            rm = start_row + local_row + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            scale_M = tl.load(a_scale_ptr + rm, mask=rm < end_row, other=0.0)
            scale_N = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_wse + rn, mask=rn < N, other=0.0)
            out_MN = (acc_MN * scale_M[:, None] * scale_N[None, :]).to(tl.bfloat16)
            store_ragged(out_desc, start_row, rows, [local_row, pid_n * BLOCK_N], out_MN)

    _fp8_grouped = Kernel(_fp8_grouped_kernel, do_not_specialize=["tiles_m"])

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the best of benchmarks/fp8_grouped_tma.py's 7 on an H200 in 7 of the
# 8 expert shapes (the fine fc2 forward: torch's 2% faster), fp8_grouped_tma_1xh200.json
_CONFIG = (128, 128, 128, 4, 3)


def _tma_ready(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base, unit last stride and the other strides multiples of 16 bytes."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(stride * size % 16 == 0 for stride in t.stride()[:-1]))


def fp8_grouped_mm_applies(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                           out_dtype: torch.dtype) -> bool:
    """Whether :func:`fp8_grouped_mm` takes these operands (else torch's scaled grouped GEMM does): compiled Triton
    on a Hopper GPU, bf16 out, operands the TMA can read."""
    return (HAVE_TRITON and a_q.is_cuda and torch.cuda.get_device_capability(a_q.device) == (9, 0)
            and out_dtype == torch.bfloat16 and a_q.dim() == 2 and w_q.dim() == 3 and _tma_ready(a_q)
            and _tma_ready(w_q) and a_scale.is_contiguous() and w_scale.stride(-1) == 1
            and w_q.shape[-2] % 8 == 0)  # the output's rows: multiples of 16 bytes


def fp8_grouped_mm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   offsets_E: torch.Tensor, config: tuple[int, ...] = _CONFIG) -> torch.Tensor:
    """Rows [offsets_E[e-1], offsets_E[e]) of ``a_q`` (T, K) E4M3 times ``w_q[e]``^T (w_q (E, N, K) E4M3), scaled by
    ``a_scale`` (T,) and ``w_scale`` (E, N), into a new (T, N) bf16 tensor whose rows past the last offset are not
    written (as torch's leaves them); check :func:`fp8_grouped_mm_applies` first."""
    block_m, block_n, block_k, warps, stages = config
    (T, K), (E, N, _) = a_q.shape, w_q.shape
    out = torch.empty((T, N), dtype=torch.bfloat16, device=a_q.device)
    # Made per call: a cached descriptor would keep the tensors it describes alive.
    a_desc = create_ragged_descriptor(a_q, [block_m, block_k])
    w_desc = TensorDescriptor(w_q, list(w_q.shape), list(w_q.stride()), [1, block_n, block_k])
    out_desc = create_ragged_descriptor(out, [block_m, block_n])
    tiles_m = triton.cdiv(T, block_m) + E  # at least every expert's row tiles
    grid = (tiles_m * triton.cdiv(N, block_n),)
    _fp8_grouped[grid, a_q.device](a_desc, a_scale, w_desc, w_scale, offsets_E, out_desc, N, K, E, tiles_m,
                                   w_scale.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                                   STAGES=stages, num_warps=warps)
    return out
