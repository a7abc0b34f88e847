"""Whether the experts' FP8 weight gradient (kernels/fp8_wgrad.py, the rowwise recipe: per-group scales, the tensor
cores accumulating across the 128-token chunks) gains from TMA-fed loads; one CUDA GPU, the Mixtral-like expert
shapes at 1,024 rows per expert and micro-batch, one and four micro-batches a call (the Mixtral-like bench's
``train.expert_wgrad_micro_batches: 4``), every variant's sums checked against the shipped kernel's, timed
round-robin from CUDA graphs:

    PYTHONPATH=. python benchmarks/fp8_wgrad_tma.py --json OUT.json [--rounds 10]

Why: compiled for sm_90 the shipped kernel's chunk loop is not pipelined (pointer loads into registers, no
asynchronous copies in its TTGIR) and spills (976 bytes a thread at one segment, 2,016 at four: ptxas's resource
usage of the cubin Triton builds). Its operands are quantized transposed, the tokens contiguous and each group's
chunks aligned to 128, so plain 2-D descriptors read them: tiles (BLOCK_M, 128) of a and (BLOCK_N, 128) of b.
``_atomic``: the shipped element-wise adds into main_grad; ``_reduce``: the TMA's bulk reduction.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from benchmarks.common import run_header, write_json  # noqa: E402
from benchmarks.step_kernels import WGRAD_SHAPES, timed_graphed, wgrad_operands  # noqa: E402
from moe_overlap.kernels import fp8_wgrad as W  # noqa: E402

SHIPPED = (128, 128, 8, 4)  # kernels/fp8_wgrad.py's per-group tile
CONFIGS = [(128, 128, 8, 4), (128, 128, 8, 3), (128, 128, 4, 4), (128, 256, 8, 3), (64, 128, 4, 4)]


@triton.jit
def _fp8_wgrad_tma_kernel(a0, a1, a2, a3, a_scale_ptrs, b0, b1, b2, b3, b_scale_ptrs, chunk_ends_ptrs, out_ptr,
                          out_desc, M, N, stride_oe, stride_om, SEGMENTS: tl.constexpr, REDUCE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    group = tl.program_id(1)
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    first_m = pid // (GROUP_M * tiles_n) * GROUP_M
    rows_of_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_of_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_of_group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_MN = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    chunks_seen = 0
    for segment in tl.static_range(SEGMENTS):
        # one descriptor argument each (triton 3.6's launcher takes no descriptors inside tuples)
        if segment == 0:
            a_desc, b_desc = a0, b0
        elif segment == 1:
            a_desc, b_desc = a1, b1
        elif segment == 2:
            a_desc, b_desc = a2, b2
        else:
            a_desc, b_desc = a3, b3
        chunk_ends = chunk_ends_ptrs[segment]
        first = tl.load(chunk_ends + group - 1, mask=group > 0, other=0)
        end = tl.load(chunk_ends + group)
        chunks_seen += end - first
        segment_MN = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for chunk in tl.range(first, end, num_stages=STAGES):
            a_MK = a_desc.load([pid_m * BLOCK_M, chunk * 128])
            b_NK = b_desc.load([pid_n * BLOCK_N, chunk * 128])
            segment_MN = tl.dot(a_MK, tl.trans(b_NK), segment_MN)
        if end > first:  # the group's scales, the same in each of its chunks
            scale_a = tl.load(a_scale_ptrs[segment] + first.to(tl.int64) * M + rm, mask=rm < M, other=0.0)
            scale_b = tl.load(b_scale_ptrs[segment] + first.to(tl.int64) * N + rn, mask=rn < N, other=0.0)
            acc_MN += segment_MN * scale_a[:, None] * scale_b[None, :]
    if chunks_seen > 0:
        if REDUCE:
            out_desc.atomic_add([group, pid_m * BLOCK_M, pid_n * BLOCK_N], acc_MN.reshape(1, BLOCK_M, BLOCK_N))
        else:
            out = out_ptr + group.to(tl.int64) * stride_oe + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
            tl.atomic_add(out, acc_MN, mask=(rm[:, None] < M) & (rn[None, :] < N), sem="relaxed")


def fp8_wgrad_tma(segments, out, config, reduce: bool):
    block_m, block_n, warps, stages = config
    groups, M, N = out.shape
    a_all, b_all = zip(*segments)
    a_descs = tuple(TensorDescriptor(a.q_MP, list(a.q_MP.shape), list(a.q_MP.stride()), [block_m, 128]) for a in a_all)
    b_descs = tuple(TensorDescriptor(b.q_MP, list(b.q_MP.shape), list(b.q_MP.stride()), [block_n, 128]) for b in b_all)
    out_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [1, block_m, block_n])
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), groups)
    assert len(segments) <= 4, "four descriptor arguments a side"
    a_descs, b_descs = (a_descs + a_descs[:1] * 3)[:4], (b_descs + b_descs[:1] * 3)[:4]
    _fp8_wgrad_tma_kernel[grid](*a_descs, tuple(a.scale_CM for a in a_all), *b_descs, tuple(b.scale_CM for b in b_all),
                                tuple(a.chunk_ends_E for a in a_all), out, out_desc, M, N, out.stride(0),
                                out.stride(1), SEGMENTS=len(segments), REDUCE=reduce, BLOCK_M=block_m,
                                BLOCK_N=block_n, GROUP_M=8, STAGES=stages, num_warps=warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--shapes", default="mixtral_fc1,mixtral_fc2")
    args = parser.parse_args()
    rows = []
    for name in args.shapes.split(","):
        experts, per_expert, m, n = WGRAD_SHAPES[name]
        for segments in (1, 4):
            main_grad = wgrad_operands(name, 1)[3]
            parts = [wgrad_operands(name, per_expert)[:3] for _ in range(segments)]
            ragged = parts[0][2].clone()
            ragged[: experts // 2] -= 37  # uneven groups in the check (one without rows)
            ragged[1] = ragged[0]
            quantized = [(W.quantize_along_tokens(a, offsets, False), W.quantize_along_tokens(b, offsets, False))
                         for a, b, offsets in parts]
            checked = [(W.quantize_along_tokens(a, ragged, False), W.quantize_along_tokens(b, ragged, False))
                       for a, b, _ in parts]
            reference = torch.zeros_like(main_grad)
            W.fp8_wgrad_accumulate_triton(checked, reference, False, True, SHIPPED)
            fns = {"shipped": lambda: W.fp8_wgrad_accumulate_triton(quantized, main_grad, False, True, SHIPPED)}
            errors, failed = {}, {}
            for config in CONFIGS:
                for reduce in (False, True):
                    tag = "tma_" + "x".join(map(str, config)) + ("_reduce" if reduce else "_atomic")
                    got = torch.zeros_like(main_grad)
                    try:
                        fp8_wgrad_tma(checked, got, config, reduce)
                        torch.cuda.synchronize()
                        errors[tag] = (got - reference).abs().max().item()
                        fns[tag] = lambda config=config, reduce=reduce: fp8_wgrad_tma(quantized, main_grad, config,
                                                                                      reduce)
                    except Exception as e:
                        failed[tag] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                        print(name, segments, tag, "failed:", failed[tag], flush=True)
                    del got
            ms = timed_graphed(fns, args.rounds, calls=5)
            rows.append({"shape": name, "experts": experts, "rows_per_expert_per_segment": per_expert,
                         "segments": segments, "m": m, "n": n, "ms_per_call": ms, "max_abs_diff_vs_shipped": errors,
                         "failed": failed, "best": min(ms, key=ms.get),
                         "shipped_over_best": ms["shipped"] / min(ms.values())})
            print(name, segments, {k: round(v, 3) for k, v in sorted(ms.items(), key=lambda kv: kv[1])}, flush=True)
            print(name, segments, "nonzero |diff|", {k: v for k, v in errors.items() if v}, flush=True)
    write_json(args.json, run_header(1), rows)


if __name__ == "__main__":
    main()
