"""Whether the blockwise FP8 GEMM (kernels/fp8_blockwise.py) gains from issuing each 128-deep slice's product
before the previous slice's is scaled into the sum; one CUDA GPU, prepared 2026-11-29, not run yet:

    PYTHONPATH=. python benchmarks/fp8_blockwise_gluon.py --json OUT.json [--rounds 10]

Why: per slice the blockwise recipe multiplies a fresh FP8 product by its rows' and its block's scales before adding
it to the fp32 sum (DeepGEMM's promotion). Triton 3.6 places the wait for a product right after it is issued (its
TTGIR: ``warp_group_dot_wait {pendings = 0}`` before the next ``warp_group_dot``, even with two products written in
flight), so within a program the tensor cores idle while the warp group scales. The shipped kernel runs two
programs an SM to cover that. Here the loop is written in Gluon (triton.experimental.gluon), where the wait is
explicit: slice k's ``warpgroup_mma`` is issued, then ``warpgroup_mma_wait(num_outstanding=1)`` returns slice
k - 1's product, which is scaled while slice k runs; the TMA refills the stage that product read. The arithmetic
per slice is the shipped kernel's, so the outputs should match it bit for bit. Each variant is checked against the
shipped kernel on uneven experts (one without rows, rows past the last offset untouched) and timed round-robin from
CUDA graphs beside it, the rowwise recipe's torch._scaled_grouped_mm and bf16.

The rows come through a plain 2-D descriptor: rows past a group's end belong to the next group (or read as zeros
past the tensor); their products are computed with this group's weight and not stored (masked stores).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,  # noqa: E402
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from benchmarks.common import run_header, write_json  # noqa: E402
from benchmarks.fp8_grouped_tma import SHAPES, bf16_operands, lab_args, normwise  # noqa: E402
from benchmarks.step_kernels import timed_graphed  # noqa: E402
from moe_overlap.kernels.fp8_blockwise import blockwise_mm_triton, quantize_blocks, quantize_tiles  # noqa: E402
from moe_overlap.kernels.fp8_quant import quantize_rows  # noqa: E402

CONFIGS = [(64, 4, 4), (64, 4, 3), (64, 4, 6), (128, 8, 4), (128, 8, 3)]  # (BLOCK_M, warps, stages)


@gluon.jit
def _blockwise_gluon_kernel(a_desc, a_scale_ptr, w_desc, w_scale_ptr, offsets_ptr, out_ptr, N, K, E, tiles_m,
                            stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk, stride_om,
                            BLOCK_M: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                            num_warps: gl.constexpr):
    # This program's (expert, row tile, column tile): the shipped kernel's order (kernels/launch.tile_in_groups,
    # kernels/fp8_blockwise.expert_tile), written out here in Gluon.
    pid = gl.program_id(0)
    width = GROUP_M * (N // 128)
    first_tile = pid // width * GROUP_M
    rows_of_group = gl.minimum(tiles_m - first_tile, GROUP_M)
    tile = first_tile + (pid % width) % rows_of_group
    pid_n = (pid % width) // rows_of_group
    expert = gl.to_tensor(-1)
    first_row = gl.to_tensor(0)
    end_row = gl.to_tensor(0)
    before = gl.to_tensor(0)
    start = gl.to_tensor(0)
    for e in range(0, E):
        end = gl.load(offsets_ptr + e)
        tiles_e = (end - start + BLOCK_M - 1) // BLOCK_M
        hit = (tile >= before) & (tile < before + tiles_e)
        expert = gl.where(hit, e, expert)
        first_row = gl.where(hit, start + (tile - before) * BLOCK_M, first_row)
        end_row = gl.where(hit, end, end_row)
        before += tiles_e
        start = end
    if expert >= 0:
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, 128, 32])
        rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        rm = first_row + gl.arange(0, BLOCK_M, layout=rows_layout)
        rows_in = rm < end_row
        a_scale_M = a_scale_ptr + rm.to(gl.int64) * stride_asm
        w_scale = w_scale_ptr + expert.to(gl.int64) * stride_wse + pid_n * stride_wsn
        w_row = expert * N + pid_n * 128  # w (E, N, K) viewed (E N, K)

        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, 128], a_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 128, 128], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        slices = K // 128
        stage_bytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
        for i in gl.static_range(STAGES):  # the first STAGES slices' loads
            mbarrier.expect(ready.index(i), stage_bytes, pred=i < slices)
            tma.async_copy_global_to_shared(a_desc, [first_row, i * 128], ready.index(i), a_smem.index(i),
                                            pred=i < slices)
            tma.async_copy_global_to_shared(w_desc, [w_row, i * 128], ready.index(i), w_smem.index(i),
                                            pred=i < slices)

        zeros = gl.zeros((BLOCK_M, 128), gl.float32, mma_layout)
        acc = gl.zeros((BLOCK_M, 128), gl.float32, mma_layout)
        # Slice 0's product issued before the loop: the loop carries the product in flight (an asynchronous token)
        mbarrier.wait(ready.index(0), 0)
        last = warpgroup_mma(a_smem.index(0), w_smem.index(0).permute((1, 0)), zeros, use_acc=False, is_async=True)
        last_scale = gl.load(a_scale_M, mask=rows_in, other=0.0) * gl.load(w_scale)
        for k in range(1, slices):
            stage = k % STAGES
            mbarrier.wait(ready.index(stage), (k // STAGES) & 1)
            product = warpgroup_mma(a_smem.index(stage), w_smem.index(stage).permute((1, 0)), zeros, use_acc=False,
                                    is_async=True)
            # Slice k - 1's product, while slice k's runs: scaled into the sum
            done = warpgroup_mma_wait(num_outstanding=1, deps=(last, ))
            acc += done * last_scale[:, None]
            # Slice k - 1's stage is free (its product is done): its refill is slice k - 1 + STAGES
            free = (k - 1) % STAGES
            refill = k - 1 + STAGES < slices
            mbarrier.expect(ready.index(free), stage_bytes, pred=refill)
            tma.async_copy_global_to_shared(a_desc, [first_row, (k - 1 + STAGES) * 128], ready.index(free),
                                            a_smem.index(free), pred=refill)
            tma.async_copy_global_to_shared(w_desc, [w_row, (k - 1 + STAGES) * 128], ready.index(free),
                                            w_smem.index(free), pred=refill)
            last = product
            last_scale = gl.load(a_scale_M + k * stride_ask, mask=rows_in, other=0.0) * \
                gl.load(w_scale + k * stride_wsk)
        done = warpgroup_mma_wait(num_outstanding=0, deps=(last, ))
        acc += done * last_scale[:, None]
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))

        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        out_MN = gl.convert_layout(acc.to(gl.bfloat16), store_layout)
        rm_store = first_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store_layout))
        rn_store = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, store_layout))
        gl.store(out_ptr + rm_store[:, None].to(gl.int64) * stride_om + rn_store[None, :], out_MN,
                 mask=(rm_store < end_row)[:, None])


def blockwise_gluon(a_q, a_scale, w_q, w_scale, offsets, config):
    """Rows of expert e times w_q[e]^T (w_q (E, N, K), K-major; w_scale (E, N / 128, K / 128)) in bf16."""
    block_m, warps, stages = config
    (T, K), (E, N, _) = a_q.shape, w_q.shape
    out = torch.empty((T, N), dtype=torch.bfloat16, device=a_q.device)
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, 128], gl.float8e4nv)
    a_desc = TensorDescriptor(a_q, list(a_q.shape), list(a_q.stride()), [block_m, 128], a_layout)
    w_EN_K = w_q.view(E * N, K)
    w_layout = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
    w_desc = TensorDescriptor(w_EN_K, list(w_EN_K.shape), list(w_EN_K.stride()), [128, 128], w_layout)
    tiles_m = triton.cdiv(T, block_m) + E
    _blockwise_gluon_kernel[(tiles_m * (N // 128),)](
        a_desc, a_scale, w_desc, w_scale, offsets, out, N, K, E, tiles_m, a_scale.stride(0), a_scale.stride(1),
        w_scale.stride(0), w_scale.stride(1), w_scale.stride(2), out.stride(0), BLOCK_M=block_m, STAGES=stages,
        GROUP_M=8, num_warps=warps)
    return out


def main() -> None:
    args = lab_args(__doc__)
    rows = []
    for name in args.shapes.split(","):
        experts, per_expert, K, N = SHAPES[name]
        checks, failed, fns = {}, {}, {}
        for ragged in (True, False):
            a, w, offsets = bf16_operands(name, ragged)
            a_q, a_scale = quantize_tiles(a)
            w_q, w_scale = quantize_blocks(w)
            if ragged:  # correctness: against the shipped kernel on the same operands
                rows_in = int(offsets[-1])
                shipped = blockwise_mm_triton(a_q, a_scale, w_q, w_scale, True, offsets)
                reference = torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)[:rows_in]
                checks["shipped_vs_bf16"] = normwise(shipped[:rows_in], reference)
                for config in CONFIGS:
                    tag = "gluon_" + "x".join(map(str, config))
                    try:
                        got = blockwise_gluon(a_q, a_scale, w_q, w_scale, offsets, config)
                        torch.cuda.synchronize()
                        checks[tag] = {"max_abs_vs_shipped": (got[:rows_in].float() - shipped[:rows_in].float())
                                       .abs().max().item(), "vs_bf16": normwise(got[:rows_in], reference)}
                    except Exception as e:
                        failed[tag] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                        print(name, tag, "failed:", failed[tag], flush=True)
                continue
            r_q, r_scale = quantize_rows(a)
            wr_q, wr_scale = quantize_rows(w.reshape(-1, K))
            wr_q, wr_scale = wr_q.view(experts, N, K), wr_scale.view(experts, N)
            fns = {"shipped": lambda: blockwise_mm_triton(a_q, a_scale, w_q, w_scale, True, offsets),
                   "rowwise_torch_fast": lambda: torch._scaled_grouped_mm(
                       r_q, wr_q.transpose(-2, -1), r_scale, wr_scale, offs=offsets, out_dtype=torch.bfloat16,
                       use_fast_accum=True),
                   "bf16": lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)}
            for config in CONFIGS:
                tag = "gluon_" + "x".join(map(str, config))
                if tag not in failed:
                    fns[tag] = lambda config=config: blockwise_gluon(a_q, a_scale, w_q, w_scale, offsets, config)
        ms = timed_graphed(fns, args.rounds, calls=10)
        best = min((k for k in ms if k.startswith("gluon")), key=ms.get, default=None)
        rows.append({"shape": name, "experts": experts, "rows_per_expert": per_expert, "k": K, "n": N, "ms": ms,
                     "checks": checks, "failed": failed, "best_gluon": best,
                     "shipped_over_best_gluon": ms["shipped"] / ms[best] if best else None})
        print(name, {k: round(v, 4) for k, v in sorted(ms.items(), key=lambda kv: kv[1])}, flush=True)
        print(name, "checks", checks, flush=True)
    write_json(args.json, run_header(1), rows)


if __name__ == "__main__":
    main()
