"""Which tile torch's rowwise FP8 grouped GEMM picks, and what it costs, on the expert shapes.

torch 2.11's ``torch._scaled_grouped_mm`` (2D rows x 3D weights) picks its CUTLASS tile from the rows *per group* it
estimates as the left operand's rows / groups: 256 x 128 x 128 where two of (rows, K, N) are >= 2048 ("large"),
else 128 x 256 x 64. Rows past the last offset are not computed, so a left operand with spare rows behind the
offsets' end changes the estimate, not the result's rows. This times each expert GEMM (forward and dgrad of fc1 and
fc2, fast accumulation as the rowwise recipe runs them) with the exact rows and with the operand's rows doubled
(the spare half unread), round-robin, and records the kernel each ran (its mangled name holds the tile) and the two
results' difference.

    PYTHONPATH=. python benchmarks/fp8_grouped_tiles.py --json benchmarks/results/fp8_grouped_tiles_1xh200.json
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import round_robin, run_header, write_json

# name: (experts, rows per expert, hidden, ffn): the fine bench model at EP=1 and at EP=4 (16 local experts, each
# receiving 4 ranks' share), and the Mixtral-like one at EP=1
SHAPES = {"fine_ep1": (64, 1024, 2048, 1024), "fine_ep4": (16, 4096, 2048, 1024), "mixtral_ep1": (8, 2048, 4096, 14336)}


def gemms(hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
    """(K, N) of each expert GEMM: a (rows, K) times the weight's (K, N) per group."""
    return {"fc1_fwd": (hidden, 2 * ffn), "fc1_dgrad": (2 * ffn, hidden), "fc2_fwd": (ffn, hidden),
            "fc2_dgrad": (hidden, ffn)}


def kernel_name(fn) -> str:
    """The CUTLASS GEMM kernel ``fn`` launches (its mangled name holds the tile shape). (Until 2026-11-28 evening:
    the first kernel naming cutlass, which is torch's prep kernel of the groups' pointers, the same for every
    GEMM: fp8_grouped_tiles_1xh200.json's ``kernel`` and ``same_kernel`` name that one.)"""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "device_kernel" in e.name]  # not the grouped data's prep kernel
    return names[0] if names else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows_out = []
    for shape in args.shapes.split(","):
        experts, per_expert, hidden, ffn = SHAPES[shape]
        rows = experts * per_expert
        offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * per_expert
        for gemm, (k, n) in gemms(hidden, ffn).items():
            a_q = torch.randn(2 * rows, k, device=device).to(torch.float8_e4m3fn)
            a_scale = torch.rand(2 * rows, device=device) + 0.5
            w_q = torch.randn(experts, n, k, device=device).to(torch.float8_e4m3fn)  # the weight, contraction last
            w_scale = torch.rand(experts, n, device=device) + 0.5
            variants = {}
            for label, kept in (("exact", rows), ("doubled", 2 * rows)):
                def run(kept=kept):
                    return torch._scaled_grouped_mm(a_q[:kept], w_q.transpose(-2, -1), a_scale[:kept], w_scale,
                                                    offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True)
                variants[label] = run
            results = {label: fn()[:rows].float() for label, fn in variants.items()}
            difference = ((results["doubled"] - results["exact"]).norm() / results["exact"].norm()).item()
            names = {label: kernel_name(fn) for label, fn in variants.items()}
            ms = round_robin(variants, args.rounds, args.warmup, device)
            flops = 2 * rows * k * n
            row = {"shape": shape, "gemm": gemm, "experts": experts, "rows_per_expert": per_expert, "k": k, "n": n,
                   "ms": ms, "tflops": {label: flops / t / 1e9 for label, t in ms.items()},
                   "same_kernel": names["exact"] == names["doubled"],
                   "kernel": {label: name[:3000] for label, name in names.items()},
                   "normwise_difference": difference}
            rows_out.append(row)
            print(f"{shape:12s} {gemm:10s} exact {ms['exact']:.3f} ms, doubled {ms['doubled']:.3f} ms, same kernel "
                  f"{row['same_kernel']}, difference {difference:.2e}", flush=True)
    write_json(args.json, run_header(1), rows_out)


if __name__ == "__main__":
    main()
