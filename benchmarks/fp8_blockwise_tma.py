"""Whether the blockwise FP8 recipe's grouped GEMM (kernels/fp8_blockwise.py) gains from TMA-fed loads; one CUDA
GPU, the experts' forward and input-gradient shapes (1,024 rows per expert), every variant checked against the
shipped kernel on uneven experts (one without rows, rows past the last offset untouched) and timed round-robin
from CUDA graphs beside the rowwise recipe's torch._scaled_grouped_mm and bf16:

    PYTHONPATH=. python benchmarks/fp8_blockwise_tma.py --json OUT.json [--rounds 10]

Why: compiled for sm_90 (ptxas's resource usage of the cubin Triton 3.6 builds, read on a CPU machine) the
shipped kernel's loop over the 128-deep slices is not pipelined (no asynchronous copies in its TTGIR, 24-32 KiB
of shared memory) and spills 1.4 KB a thread at both of its tiles, as the weight gradients' kernels did
(benchmarks/RESULTS.md, "The experts' kernels fed by the TMA"). Here each expert's rows come through a ragged TMA
descriptor and the weight (E, N, K), K-major as the layers pass it, through a 3-D one; per slice a fresh product,
times the rows' tile scales and the block's scale, into the fp32 sum, as the shipped kernel computes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.ragged_tma import create_ragged_descriptor, load_ragged, store_ragged  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from benchmarks.common import run_header, write_json  # noqa: E402
from benchmarks.fp8_grouped_tma import SHAPES, bf16_operands, expert_tile, normwise  # noqa: E402
from benchmarks.step_kernels import timed_graphed  # noqa: E402
from moe_overlap.kernels.fp8_blockwise import blockwise_mm_triton, quantize_blocks, quantize_tiles  # noqa: E402
from moe_overlap.kernels.fp8_quant import quantize_rows  # noqa: E402

# (BLOCK_M, warps, stages); BLOCK_N and BLOCK_K are the scale blocks' 128
CONFIGS = [(64, 4, 4), (64, 4, 6), (128, 8, 3), (128, 8, 4), (128, 4, 3)]


@triton.jit
def _blockwise_tma_kernel(a_desc, a_scale_ptr, w_desc, w_scale_ptr, offsets_ptr, out_desc, N, K, E, tiles_m,
                          stride_asm, stride_wse, stride_wsn, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
                          STAGES: tl.constexpr):
    expert, start_row, end_row, local_row, pid_n = expert_tile(offsets_ptr, N, E, tiles_m, BLOCK_M, 128, GROUP_M)
    if expert >= 0:
        rows = end_row - start_row
        rm = start_row + local_row + tl.arange(0, BLOCK_M)
        rows_in = rm < end_row
        a_scale_M = a_scale_ptr + rm.to(tl.int64) * stride_asm
        w_scale = w_scale_ptr + expert.to(tl.int64) * stride_wse + pid_n * stride_wsn
        acc_MN = tl.full((BLOCK_M, 128), 0.0, tl.float32)
        for k in tl.range(0, K // 128, num_stages=STAGES):
            a_MK = load_ragged(a_desc, start_row, rows, [local_row, k * 128])
            w_NK = w_desc.load([expert, pid_n * 128, k * 128]).reshape(128, 128)
            partial_MN = tl.dot(a_MK, tl.trans(w_NK))
            scale_M = tl.load(a_scale_M + k, mask=rows_in, other=0.0) * tl.load(w_scale + k)
            acc_MN += partial_MN * scale_M[:, None]
        store_ragged(out_desc, start_row, rows, [local_row, pid_n * 128], acc_MN.to(tl.bfloat16))


def blockwise_tma(a_q, a_scale, w_q, w_scale, offsets, config):
    """Rows of expert e times w_q[e]^T (w_q (E, N, K), K-major; w_scale (E, N / 128, K / 128)) in bf16."""
    block_m, warps, stages = config
    (T, K), (E, N, _) = a_q.shape, w_q.shape
    out = torch.empty((T, N), dtype=torch.bfloat16, device=a_q.device)
    a_desc = create_ragged_descriptor(a_q, [block_m, 128])
    w_desc = TensorDescriptor(w_q, list(w_q.shape), list(w_q.stride()), [1, 128, 128])
    out_desc = create_ragged_descriptor(out, [block_m, 128])
    tiles_m = triton.cdiv(T, block_m) + E
    _blockwise_tma_kernel[(tiles_m * (N // 128),)](a_desc, a_scale, w_desc, w_scale, offsets, out_desc, N, K, E,
                                                   tiles_m, a_scale.stride(0), w_scale.stride(0), w_scale.stride(1),
                                                   BLOCK_M=block_m, GROUP_M=8, STAGES=stages, num_warps=warps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
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
                shipped = blockwise_mm_triton(a_q, a_scale, w_q, w_scale, True, offsets)[:rows_in]
                reference = torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)[:rows_in]
                checks["shipped_vs_bf16"] = normwise(shipped, reference)
                for config in CONFIGS:
                    tag = "tma_" + "x".join(map(str, config))
                    try:
                        got = blockwise_tma(a_q, a_scale, w_q, w_scale, offsets, config)
                        torch.cuda.synchronize()
                        checks[tag] = {"max_abs_vs_shipped": (got[:rows_in].float() - shipped.float()).abs().max().item(),
                                       "vs_bf16": normwise(got[:rows_in], reference)}
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
                tag = "tma_" + "x".join(map(str, config))
                if tag not in failed:
                    fns[tag] = lambda config=config: blockwise_tma(a_q, a_scale, w_q, w_scale, offsets, config)
        ms = timed_graphed(fns, args.rounds, calls=10)
        best = min((k for k in ms if k.startswith("tma")), key=ms.get, default=None)
        rows.append({"shape": name, "experts": experts, "rows_per_expert": per_expert, "k": K, "n": N, "ms": ms,
                     "checks": checks, "failed": failed, "best_tma": best,
                     "shipped_over_best_tma": ms["shipped"] / ms[best] if best else None})
        print(name, {k: round(v, 4) for k, v in sorted(ms.items(), key=lambda kv: kv[1])}, flush=True)
        print(name, "checks", checks, flush=True)
    write_json(args.json, run_header(1), rows)


if __name__ == "__main__":
    main()
