"""An experiment beside kernels/push_rows.py: rows pushed into peers' memory by the SM's bulk-copy unit (the TMA's
one-dimensional ``cp.async.bulk``, sm_90) instead of by its threads' loads and stores.

    bulk_push_rows(src_RH, src_start, count, dst_rank_Q, dst_row_Q, route_start, dst_bases, ctas)
        the same contract as push_rows (every start and count a one-element int64 device tensor; dst_row_Q int64,
        dst_rank_Q int32, dst_bases int64 addresses), contiguous source rows of 16-byte multiples

Why: a Triton push program moves about its bytes in flight per load latency, 12-14 GB/s per CTA into a peer at
64 KiB a step (benchmarks/RESULTS.md, "The push's bytes in flight"), so a push beside a GEMM needs a carve-out of
16-32 SMs, which slows the GEMM by as much as the overlap hides. A bulk copy keeps whole stages in flight with no
registers: one warp per CTA loads a step of source rows into shared memory with one bulk copy (completing on an
mbarrier), each lane stores one row of it to its destination with another, and ``STAGES`` steps are in flight. If a
few CTAs reach the link's rate this way, a push beside a GEMM costs the GEMM a few SMs. Measured by
``moe_layer.py --carveout-probe`` (its ``bulk_*`` rows); compiled at first use by NVRTC
(``torch.cuda._compile_kernel``), CUDA only.
"""

from __future__ import annotations

import ctypes

import torch

SOURCE = r"""
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void load_step(const unsigned char* src, unsigned char* stage, unsigned long long* bar,
                                          unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(shared_address(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(shared_address(stage)), "l"(src), "r"(bytes), "r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void wait_phase(unsigned long long* bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(shared_address(bar)), "r"(parity) : "memory");
    }
}

// One warp per CTA. Step k of this CTA is rows [first, first + rows) with first = (blockIdx.x + k * gridDim.x) *
// rows_per_step; lane r stores row first + r. Stage k % stages holds step k; its mbarrier's phase k / stages.
extern "C" __global__ void __launch_bounds__(32) bulk_push_rows(
        const unsigned char* src, const long long* src_start_p, const long long* count_p,
        const long long* route_start_p, const int* dst_rank, const long long* dst_row,
        const long long* dst_bases, int row_bytes, int dst_stride_bytes, int rows_per_step, int stages) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem);
    unsigned char* buffer = smem + 128;
    const long long count = *count_p, src_start = *src_start_p, route_start = *route_start_p;
    const long long steps = (count + rows_per_step - 1) / rows_per_step;
    if (blockIdx.x >= steps) return;
    const long long mine = (steps - blockIdx.x + gridDim.x - 1) / gridDim.x;
    const int step_bytes = rows_per_step * row_bytes;
    const int lane = threadIdx.x;
    if (lane == 0) {
        for (int s = 0; s < stages; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(shared_address(bars + s)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (long long k = 0; k < mine && k < stages; ++k) {
            const long long first = (blockIdx.x + k * gridDim.x) * (long long)rows_per_step;
            const long long rows = min((long long)rows_per_step, count - first);
            load_step(src + (src_start + first) * row_bytes, buffer + (k % stages) * step_bytes, bars + k % stages,
                      (unsigned)(rows * row_bytes));
        }
    }
    __syncwarp();
    for (long long k = 0; k < mine; ++k) {
        const int s = k % stages;
        const long long first = (blockIdx.x + k * gridDim.x) * (long long)rows_per_step;
        const long long rows = min((long long)rows_per_step, count - first);
        unsigned char* to = nullptr;
        if (lane < rows) {  // the destination's address, fetched while the step's rows arrive
            const long long q = route_start + first + lane;
            to = reinterpret_cast<unsigned char*>(dst_bases[dst_rank[q]]) + dst_row[q] * (long long)dst_stride_bytes;
        }
        wait_phase(bars + s, (unsigned)((k / stages) & 1));
        if (lane < rows) {
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         :: "l"(to), "r"(shared_address(buffer + s * step_bytes + lane * row_bytes)), "r"(row_bytes)
                         : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
        if (k + stages < mine) {  // the stage is loaded again once every lane's store has read it
            if (lane < rows) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            __syncwarp();
            if (lane == 0) {
                const long long next = (blockIdx.x + (k + stages) * gridDim.x) * (long long)rows_per_step;
                const long long next_rows = min((long long)rows_per_step, count - next);
                load_step(src + (src_start + next) * row_bytes, buffer + s * step_bytes, bars + s,
                          (unsigned)(next_rows * row_bytes));
            }
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

STAGES = 4
STAGE_BYTES = 32768  # 4 stages of 32 KiB: 128 KiB of shared memory, one CTA per SM

_KERNEL: list = []


def _kernel():
    if not _KERNEL:
        _KERNEL.append(torch.cuda._compile_kernel(SOURCE, "bulk_push_rows"))
    return _KERNEL[0]


def _allow_shared(kernel, nbytes: int) -> None:
    if hasattr(kernel, "set_shared_memory_config"):
        kernel.set_shared_memory_config(nbytes)
        return
    libcuda = ctypes.CDLL("libcuda.so.1")  # an older torch: the attribute set directly
    if libcuda.cuFuncSetAttribute(kernel.func, 8, nbytes):  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        raise RuntimeError(f"could not allow {nbytes} bytes of dynamic shared memory")


def bulk_push_rows(src_RH: torch.Tensor, src_start: torch.Tensor, count: torch.Tensor, dst_rank_Q: torch.Tensor,
                   dst_row_Q: torch.Tensor, route_start: torch.Tensor, dst_bases: torch.Tensor, ctas: int,
                   stages: int = STAGES, stage_bytes: int = STAGE_BYTES) -> None:
    row_bytes = src_RH.shape[1] * src_RH.element_size()
    if not src_RH.is_contiguous() or row_bytes % 16:
        raise ValueError(f"bulk_push_rows needs contiguous rows of 16-byte multiples, got {tuple(src_RH.shape)} "
                         f"{src_RH.dtype} strides {src_RH.stride()}")
    for name, t, dtype in (("src_start", src_start, torch.int64), ("count", count, torch.int64),
                           ("route_start", route_start, torch.int64), ("dst_rank_Q", dst_rank_Q, torch.int32),
                           ("dst_row_Q", dst_row_Q, torch.int64), ("dst_bases", dst_bases, torch.int64)):
        if t.dtype != dtype:
            raise ValueError(f"bulk_push_rows: {name} must be {dtype}, got {t.dtype}")
    rows_per_step = max(1, min(32, stage_bytes // row_bytes))
    shared = 128 + stages * rows_per_step * row_bytes
    kernel = _kernel()
    _allow_shared(kernel, shared)
    kernel(grid=(ctas, 1, 1), block=(32, 1, 1), shared_mem=shared,
           args=[src_RH, src_start, count, route_start, dst_rank_Q, dst_row_Q, dst_bases, row_bytes, row_bytes,
                 rows_per_step, stages])
