"""Whether a TMA-fed Triton grouped GEMM in the rowwise FP8 recipe beats torch's ``_scaled_grouped_mm`` on the
experts' shapes (the forward and the input gradient of fc1 and fc2, 1,024 rows per expert on average, even and
skewed); one CUDA GPU, every
variant checked against torch's (normwise, and both against bf16), timed round-robin from CUDA graphs:

    PYTHONPATH=. python benchmarks/fp8_grouped_tma.py --json OUT.json [--rounds 10]

Why: the Triton grouped GEMMs tried before (kernels/fp8_blockwise.py's loop, its removed rowwise mode) read their
operands through pointer tensors, and compiled for sm_90 such a loop is not pipelined (benchmarks/wgrad_tma.py's
finding: plain loads, no asynchronous copies). Here each expert's rows come through a ragged TMA descriptor (rows
past the expert read as zero, the output's rows past it never written) and the weight through a 3-D one; the
tensor cores accumulate fast (as the experts' GEMMs ask torch: ``use_fast_accum``), the row and column scales
applied once after the loop. A program finds its expert by walking the end offsets on the device (no host sync).
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
from benchmarks.step_kernels import timed_graphed  # noqa: E402
from moe_overlap.kernels.fp8_blockwise import expert_tile  # noqa: E402

# name: (experts, rows per expert, K contracted, N out)
SHAPES = {
    "fine_fc1_fwd": (64, 1024, 2048, 2048), "fine_fc1_dgrad": (64, 1024, 2048, 2048),
    "fine_fc2_fwd": (64, 1024, 1024, 2048), "fine_fc2_dgrad": (64, 1024, 2048, 1024),
    "mixtral_fc1_fwd": (8, 1024, 4096, 28672), "mixtral_fc1_dgrad": (8, 1024, 28672, 4096),
    "mixtral_fc2_fwd": (8, 1024, 14336, 4096), "mixtral_fc2_dgrad": (8, 1024, 4096, 14336),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = [(128, 128, 128, 4, 4), (128, 128, 128, 4, 3), (128, 256, 128, 8, 3), (128, 256, 64, 8, 4),
           (64, 128, 128, 4, 5), (128, 128, 64, 4, 5), (256, 128, 128, 8, 3)]


@triton.jit
def _fp8_grouped_kernel(a_desc, a_scale_ptr, w_desc, w_scale_ptr, offsets_ptr, out_desc, N, K, E, tiles_m,
                        stride_wse, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    expert, start_row, end_row, local_row, pid_n = expert_tile(offsets_ptr, 0, N, E, tiles_m, True, BLOCK_M,
                                                               BLOCK_N, GROUP_M)
    if expert >= 0:
        rows = end_row - start_row
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            a_MK = load_ragged(a_desc, start_row, rows, [local_row, k])
            w_NK = w_desc.load([expert, pid_n * BLOCK_N, k]).reshape(BLOCK_N, BLOCK_K)
            acc = tl.dot(a_MK, tl.trans(w_NK), acc)
        rm = start_row + local_row + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        scale_M = tl.load(a_scale_ptr + rm, mask=rm < end_row, other=0.0)
        scale_N = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_wse + rn, mask=rn < N, other=0.0)
        out = (acc * scale_M[:, None] * scale_N[None, :]).to(tl.bfloat16)
        store_ragged(out_desc, start_row, rows, [local_row, pid_n * BLOCK_N], out)


_DESCS: dict = {}


def fp8_grouped_tma(a_q, a_scale, w_q, w_scale, offsets, out, config):
    """out[rows of e] = (a_q[rows of e] @ w_q[e]^T) * a_scale[rows] * w_scale[e] in bf16; a_q (T, K), w_q (E, N, K)."""
    block_m, block_n, block_k, warps, stages = config
    (T, K), (E, N, _) = a_q.shape, w_q.shape
    key = tuple((t.data_ptr(), t.shape) for t in (a_q, w_q, out)) + tuple(config)
    if key not in _DESCS:
        _DESCS[key] = (create_ragged_descriptor(a_q, [block_m, block_k]),
                       TensorDescriptor(w_q, list(w_q.shape), list(w_q.stride()), [1, block_n, block_k]),
                       create_ragged_descriptor(out, [block_m, block_n]))
    a_desc, w_desc, out_desc = _DESCS[key]
    tiles_m = triton.cdiv(T, block_m) + E
    grid = (tiles_m * triton.cdiv(N, block_n),)
    _fp8_grouped_kernel[grid](a_desc, a_scale, w_desc, w_scale, offsets, out_desc, N, K, E, tiles_m,
                              w_scale.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                              STAGES=stages, num_warps=warps)
    return out


def bf16_operands(name: str, ragged: bool):
    """A shape's bf16 rows, weights (E, N, K) and int32 end offsets; ``ragged``: uneven experts, one without rows,
    and the last rows past every offset."""
    experts, per_expert, K, N = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(experts * per_expert, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(experts, N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * per_expert
    if ragged:
        offsets[: experts // 2] -= 37
        offsets[1] = offsets[0]
        offsets[-1] -= 5
    return a, w, offsets


def operands(name: str, ragged: bool):
    a, w, offsets = bf16_operands(name, ragged)
    a_amax = a.float().abs().amax(1).clamp(min=1e-12)
    a_scale = (a_amax / 448.0).float()
    a_q = (a.float() / a_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_amax = w.float().abs().amax(2).clamp(min=1e-12)
    w_scale = (w_amax / 448.0).float()
    w_q = (w.float() / w_scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return a, w, offsets, a_q, a_scale, w_q, w_scale


def torch_fp8(a_q, a_scale, w_q, w_scale, offsets):
    return torch._scaled_grouped_mm(a_q, w_q.transpose(-2, -1), a_scale, w_scale, offs=offsets,
                                    out_dtype=torch.bfloat16, use_fast_accum=True)


def normwise(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def lab_args(doc: str, shapes: dict = SHAPES) -> argparse.Namespace:
    """The FP8 GEMM labs' command line: --json, --rounds, --shapes (names of ``shapes``, comma-separated)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--shapes", default=",".join(shapes))
    return parser.parse_args()


def main() -> None:
    args = lab_args(__doc__)
    rows = []
    for name in args.shapes.split(","):
        experts, per_expert, K, N = SHAPES[name]
        # correctness on uneven experts: rows past the last offset untouched, each against torch's and bf16's
        a, w, offsets, a_q, a_scale, w_q, w_scale = operands(name, ragged=True)
        rows_in = int(offsets[-1])
        reference = torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)[:rows_in]
        theirs = torch_fp8(a_q, a_scale, w_q, w_scale, offsets)[:rows_in]
        checks, failed = {"torch_fp8_vs_bf16": normwise(theirs, reference)}, {}
        for config in CONFIGS:
            tag = "triton_" + "x".join(map(str, config))
            out = torch.full((a.shape[0], N), 7.0, device="cuda", dtype=torch.bfloat16)
            try:
                fp8_grouped_tma(a_q, a_scale, w_q, w_scale, offsets, out, config)
                torch.cuda.synchronize()
                checks[tag] = {"vs_bf16": normwise(out[:rows_in], reference),
                               "vs_torch_fp8": normwise(out[:rows_in], theirs),
                               "rows_past_untouched": bool((out[rows_in:] == 7.0).all())}
            except Exception as e:
                failed[tag] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                print(name, tag, "failed:", failed[tag], flush=True)
            _DESCS.clear()
        # timing: even experts, then skewed (expert i's share of the same rows ~ 1 / (i + 1): the bench corpus's
        # fresh routers crowd a few experts, benchmarks/RESULTS.md)
        a, w, even, a_q, a_scale, w_q, w_scale = operands(name, ragged=False)
        share = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        skewed_rows = (share / share.sum() * a.shape[0]).floor().long()
        skewed_rows[0] += a.shape[0] - int(skewed_rows.sum())
        skewed = torch.cumsum(skewed_rows, 0).to(torch.int32).cuda()
        out = torch.empty((a.shape[0], N), device="cuda", dtype=torch.bfloat16)
        for routing, offsets in (("even", even), ("skewed", skewed)):
            fns = {"torch_fp8_fast": lambda offsets=offsets: torch_fp8(a_q, a_scale, w_q, w_scale, offsets),
                   "torch_bf16": lambda offsets=offsets: torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)}
            for config in CONFIGS:
                tag = "triton_" + "x".join(map(str, config))
                if tag not in failed:
                    fns[tag] = (lambda config=config, offsets=offsets:
                                fp8_grouped_tma(a_q, a_scale, w_q, w_scale, offsets, out, config))
            ms = timed_graphed(fns, args.rounds, calls=10)
            flops = 2 * experts * per_expert * K * N
            best = min((k for k in ms if k.startswith("triton")), key=ms.get, default=None)
            rows.append({"shape": name, "routing": routing, "experts": experts, "rows_per_expert": per_expert,
                         "k": K, "n": N, "ms": ms, "tflops": {k: flops / v / 1e9 for k, v in ms.items()},
                         "checks": checks, "failed": failed, "best_triton": best,
                         "best_over_torch_fp8": ms["torch_fp8_fast"] / ms[best] if best else None})
            print(name, routing, {k: round(v, 4) for k, v in sorted(ms.items(), key=lambda kv: kv[1])}, flush=True)
        print(name, "checks", checks, flush=True)
        _DESCS.clear()
    write_json(args.json, run_header(1), rows)


if __name__ == "__main__":
    main()
