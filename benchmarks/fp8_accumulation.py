"""What cuBLAS's fast FP8 accumulation costs in accuracy, per contraction length (train.fp8_dgrad_accumulation):

    python benchmarks/fp8_accumulation.py --json benchmarks/results/fp8_accumulation_<gpu>.json

For each contraction K, a rowwise FP8 GEMM of random normal operands (M rows of activations or gradients, N output
columns, weights at std 0.02, both quantized as the recipe quantizes them) in exact and in fast accumulation, each
against the emulated path (fp32 products of the same dequantized operands: the accumulation's own error) and against
fp32 of the bf16 operands (the whole error, quantization included), normwise. The K swept are the bench models'
contractions: 1,024 and 2,048 (the fine-grained experts' fc2 forward and dgrad), 4,096 (Mixtral's fc1 forward),
14,336 (its fc2 forward, which has always run fast), 28,672 (its fc1 dgrad).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import run_header, write_json  # noqa: E402
from moe_overlap.layers.fp8 import Fp8, fp8_matmul  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contractions", default="1024,2048,4096,14336,28672")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--out-width", type=int, default=2048)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_accumulation: needs a GPU with FP8 tensor cores", file=sys.stderr)
        return 1
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for k in (int(value) for value in args.contractions.split(",")):
        a = torch.randn(args.rows, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(args.out_width, k, device="cuda", generator=g) * 0.02).bfloat16()
        reference = a.float() @ w.float().t()
        emulated = fp8_matmul(a, w, True, Fp8(emulate=True))
        row = {"contraction": k, "rows": args.rows, "out_width": args.out_width,
               "quantization_error": rel(emulated, reference)}
        for name, fp8 in (("exact", Fp8()), ("fast", Fp8(fast_dgrad=True))):
            got = fp8_matmul(a, w, True, fp8)  # contract_last: the forward's call, fast only under fast_dgrad
            row[f"{name}_vs_emulated"] = rel(got, emulated)
            row[f"{name}_vs_fp32"] = rel(got, reference)
        rows.append(row)
        print(f"K {k:6d}: quantization {row['quantization_error']:.4f}; exact: accumulation "
              f"{row['exact_vs_emulated']:.2e}, whole {row['exact_vs_fp32']:.4f}; fast: accumulation "
              f"{row['fast_vs_emulated']:.2e}, whole {row['fast_vs_fp32']:.4f}", flush=True)
    write_json(args.json, run_header(1), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
