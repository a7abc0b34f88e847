"""Whether cuBLAS's blockwise FP8 GEMM (torch._scaled_mm with 1x128 activation and 128x128 weight scales, which
torch accepts on Hopper with CUDA 12.9 and later) beats our Triton kernel (kernels/fp8_blockwise.py) on the dense
linears the blockwise recipe runs: QKV, the attention projection and the shared expert of the bench models, and a
Mixtral-sized fc1; one CUDA GPU:

    PYTHONPATH=. python benchmarks/fp8_blockwise_cublas.py --json OUT.json [--rounds 10]

The scales' layout cuBLAS wants is not documented by torch, so each combination of the activation scales row-major
or column-major and the weight blocks' scales transposed as a view or copied is tried; what fails is reported,
what runs is checked against the recipe's fp32
twin (the dequantized operands' product, normwise under 1e-2 as tests/test_gpu_fp8_blockwise.py holds the Triton
kernel) and timed round-robin from CUDA graphs beside the Triton kernel, the rowwise recipe's torch._scaled_mm and
bf16. In the dense case (fp8_gemm.py's dense row, 1xH200) the Triton kernel ran 0.89x bf16 where rowwise ran 1.28x.

Run 2026-11-29 (1xH200, torch 2.11+cu130, fp8_blockwise_cublas_1xh200.json): only column-major activation scales
beside the weight scales' transposed view run ("Invalid scaling configuration" otherwise); that form was 18-27%
faster than the Triton kernel at all seven shapes, at the kernel's distance from the twin. Since then the dense
blockwise products run on cuBLAS (kernels/fp8_blockwise.cublas_takes) and quantize_tiles writes its scales
column-major, so "rows" below is a copy made for the lab.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import run_header, write_json  # noqa: E402
from benchmarks.fp8_grouped_tma import lab_args, normwise  # noqa: E402
from benchmarks.step_kernels import timed_graphed  # noqa: E402
from moe_overlap.kernels.fp8_blockwise import (blockwise_mm_torch, blockwise_mm_triton, quantize_blocks,  # noqa: E402
                                               quantize_tiles)
from moe_overlap.kernels.fp8_quant import quantize_rows  # noqa: E402

# name: (rows, K contracted, N out): the bench models' dense linears per micro-batch, and fp8_gemm.py's dense row
SHAPES = {
    "fine_qkv": (8192, 2048, 3072), "fine_proj": (8192, 2048, 2048), "fine_shared_fc1": (8192, 2048, 2048),
    "fine_shared_fc2": (8192, 1024, 2048), "mixtral_qkv": (4096, 4096, 6144), "mixtral_proj": (4096, 4096, 4096),
    "mixtral_dense_fc1": (8192, 4096, 14336),
}


def main() -> None:
    args = lab_args(__doc__, SHAPES)
    rows = []
    for name in args.shapes.split(","):
        M, K, N = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
        a_q, a_scale = quantize_tiles(a)  # (M, K / 128)
        w_q, w_scale = quantize_blocks(w)  # (N / 128, K / 128)
        twin = blockwise_mm_torch(a_q, a_scale, w_q, w_scale, True)
        scales_a = {"rows": a_scale.contiguous(), "cols": a_scale.t().contiguous().t()}
        scales_b = {"view": w_scale.t(), "copy": w_scale.t().contiguous()}
        fns = {"triton": lambda: blockwise_mm_triton(a_q, a_scale, w_q, w_scale, True)}
        checks, failed = {"triton_vs_twin": normwise(fns["triton"](), twin)}, {}
        for a_name, sa in scales_a.items():
            for b_name, sb in scales_b.items():
                tag = f"cublas_a{a_name}_b{b_name}"
                fn = (lambda sa=sa, sb=sb: torch._scaled_mm(a_q, w_q.t(), scale_a=sa, scale_b=sb,
                                                            out_dtype=torch.bfloat16))
                try:
                    checks[f"{tag}_vs_twin"] = normwise(fn(), twin)
                    torch.cuda.synchronize()
                    fns[tag] = fn
                except Exception as e:
                    failed[tag] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                    print(name, tag, "failed:", failed[tag], flush=True)
        r_q, r_scale = quantize_rows(a)
        wr_q, wr_scale = quantize_rows(w)
        fns["rowwise_torch_fast"] = lambda: torch._scaled_mm(r_q, wr_q.t(), scale_a=r_scale[:, None],
                                                             scale_b=wr_scale[None, :], out_dtype=torch.bfloat16,
                                                             use_fast_accum=True)
        fns["bf16"] = lambda: a @ w.t()
        ms = timed_graphed(fns, args.rounds, calls=10)
        rows.append({"shape": name, "m": M, "k": K, "n": N, "ms": ms, "checks": checks, "failed": failed,
                     "tflops": {k: 2 * M * K * N / v / 1e9 for k, v in ms.items()}})
        print(name, {k: round(v, 4) for k, v in sorted(ms.items(), key=lambda kv: kv[1])}, flush=True)
        print(name, "checks", {k: round(v, 5) for k, v in checks.items()}, flush=True)
    write_json(args.json, run_header(1), rows)


if __name__ == "__main__":
    main()
