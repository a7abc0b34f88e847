"""Where the experts' bf16 weight gradient into fp32 main_grad (kernels/grouped_wgrad.py) spends its time, and
whether TMA-fed loops shorten it; one CUDA GPU, every variant that adds checked against the shipped kernel on
uneven experts (one without rows), timed round-robin from CUDA graphs, one JSON row per shape:

    PYTHONPATH=. python benchmarks/wgrad_tma.py --json OUT.json [--rounds 10] [--shapes fine_fc1,...]

Why: compiled for sm_90 the shipped kernel's loop is not pipelined (plain loads into registers, then shared
memory; no asynchronous copies) and it spills 1.6 KB a thread (its [BLOCK_K, BLOCK_M] pointer tensors and the
epilogue's 64-bit addresses). Variants (one segment: one micro-batch's rows a call, unless ``_<n>seg``):
  shipped           the package's kernel (pointer loads, masked rows, atomic adds into main_grad)
  mainloop_only     the same loop, the tile's add skipped (a runtime flag the compiler cannot fold): the GEMM alone
  epilogue_only     no loop, a zero tile added: main_grad's read-modify-write alone through the atomics
  tma_<tile>_*      each expert's rows read by the TMA through a ragged descriptor (rows past the expert read as
                    zero by the hardware, no masks), pipelined; ``_atomic``: the shipped element-wise adds;
                    ``_reduce``: the TMA's bulk reduction of the tile through shared memory (no per-element
                    addresses: no spills); ``_prefetch``: main_grad's tile read by the TMA before the loop and
                    written back after it (one program owns a tile: no atomics); ``_mainloop_only``: no add.
                    (wgrad_tma1's first sweep also had persistent forms, n programs an SM over every (expert, tile),
                    flattened or not: all slower.)
  *_<n>seg          n micro-batches' rows summed per call (train.expert_wgrad_micro_batches=n, ``--segments``):
                    ms per call
  grouped_mm_alone  torch's bf16 grouped GEMM of the same rows, bf16 out (no accumulation): the GEMM's own limit
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.ragged_tma import create_ragged_descriptor, load_ragged  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from benchmarks.common import run_header, write_json  # noqa: E402
from benchmarks.step_kernels import WGRAD_SHAPES, timed_graphed, wgrad_operands  # noqa: E402
from moe_overlap.kernels.grouped_wgrad import grouped_wgrad_accumulate_triton  # noqa: E402
from moe_overlap.kernels.launch import tile_in_groups  # noqa: E402


@triton.jit
def _add_tile(acc, out_ptr, expert, pid_m, pid_n, M, N, stride_oe, stride_om, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = out_ptr + expert.to(tl.int64) * stride_oe + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.atomic_add(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N), sem="relaxed")


@triton.jit
def _ptr_kernel(a_ptr, b_ptr, offsets, out_ptr, M, N, step_a, step_b, stride_oe, stride_om, add_flag,
                LOOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr):
    expert = tl.program_id(1)
    pid_m, pid_n = tile_in_groups(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    start = tl.load(offsets + expert - 1, mask=expert > 0, other=0)
    end = tl.load(offsets + expert)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    if LOOP:
        a_KM = a_ptr + start.to(tl.int64) * step_a + rk[:, None] * step_a + rm[None, :]
        b_KN = b_ptr + start.to(tl.int64) * step_b + rk[:, None] * step_b + rn[None, :]
        for k in range(0, end - start, BLOCK_K):
            in_rows = rk[:, None] < end - start - k
            acc = tl.dot(tl.trans(tl.load(a_KM, mask=in_rows, other=0.0)), tl.load(b_KN, mask=in_rows, other=0.0),
                         acc)
            a_KM += BLOCK_K * step_a
            b_KN += BLOCK_K * step_b
    if add_flag != 0:
        _add_tile(acc, out_ptr, expert, pid_m, pid_n, M, N, stride_oe, stride_om, BLOCK_M, BLOCK_N)


@triton.jit
def _segment_sum(acc, a_desc, b_desc, offsets, expert, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    start = tl.load(offsets + expert - 1, mask=expert > 0, other=0)
    rows = tl.load(offsets + expert) - start
    for k in tl.range(0, rows, BLOCK_K, num_stages=STAGES):
        a_KM = load_ragged(a_desc, start, rows, [k, pid_m * BLOCK_M])
        b_KN = load_ragged(b_desc, start, rows, [k, pid_n * BLOCK_N])
        acc = tl.dot(tl.trans(a_KM), b_KN, acc)
    return acc, rows


@triton.jit
def _tma_tile(a0, b0, offsets0, a1, b1, offsets1, a2, b2, offsets2, a3, b3, offsets3, out_ptr, out_desc, expert,
              pid_m, pid_n, M, N, stride_oe, stride_om, add_flag, SEGMENTS: tl.constexpr, EPILOGUE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    if EPILOGUE == 2:  # main_grad's tile read first, while the loop runs; then added and written, not atomically
        old = out_desc.load([expert, pid_m * BLOCK_M, pid_n * BLOCK_N])
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc, rows = _segment_sum(acc, a0, b0, offsets0, expert, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
    if SEGMENTS >= 2:
        acc, more = _segment_sum(acc, a1, b1, offsets1, expert, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        rows += more
    if SEGMENTS >= 3:
        acc, more = _segment_sum(acc, a2, b2, offsets2, expert, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        rows += more
    if SEGMENTS >= 4:
        acc, more = _segment_sum(acc, a3, b3, offsets3, expert, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
        rows += more
    if (add_flag != 0) & (rows > 0):
        if EPILOGUE == 1:  # the TMA's bulk reduction: the tile leaves through shared memory, no per-element addresses
            out_desc.atomic_add([expert, pid_m * BLOCK_M, pid_n * BLOCK_N], acc.reshape(1, BLOCK_M, BLOCK_N))
        elif EPILOGUE == 2:
            out_desc.store([expert, pid_m * BLOCK_M, pid_n * BLOCK_N], old + acc.reshape(1, BLOCK_M, BLOCK_N))
        else:
            _add_tile(acc, out_ptr, expert, pid_m, pid_n, M, N, stride_oe, stride_om, BLOCK_M, BLOCK_N)


@triton.jit
def _tma_kernel(a0, b0, offsets0, a1, b1, offsets1, a2, b2, offsets2, a3, b3, offsets3, out_ptr, out_desc, M, N,
                stride_oe, stride_om, add_flag, SEGMENTS: tl.constexpr, EPILOGUE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                STAGES: tl.constexpr):
    pid_m, pid_n = tile_in_groups(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    _tma_tile(a0, b0, offsets0, a1, b1, offsets1, a2, b2, offsets2, a3, b3, offsets3, out_ptr, out_desc,
              tl.program_id(1), pid_m, pid_n, M, N, stride_oe, stride_om, add_flag, SEGMENTS, EPILOGUE, BLOCK_M,
              BLOCK_N, BLOCK_K, STAGES)


def ptr_call(a, b, offsets, out, config, loop: bool, add: bool):
    block_m, block_n, block_k, warps, stages = config
    experts, M, N = out.shape
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), experts)
    _ptr_kernel[grid](a, b, offsets, out, M, N, a.stride(0), b.stride(0), out.stride(0), out.stride(1), int(add),
                      LOOP=loop, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps,
                      num_stages=stages)


_DESCS: dict = {}


def descriptors(a, b, out, block_m, block_n, block_k):
    """Host TMA descriptors, made once per buffer and tile (a graph replays the launch's parameters)."""
    key = tuple((t.data_ptr(), t.shape, t.stride()) for t in (a, b, out)) + (block_m, block_n, block_k)
    if key not in _DESCS:
        _DESCS[key] = (create_ragged_descriptor(a, [block_k, block_m]), create_ragged_descriptor(b, [block_k, block_n]),
                       TensorDescriptor(out, list(out.shape), list(out.stride()), [1, block_m, block_n]))
    return _DESCS[key]


EPILOGUES = {"atomic": 0, "reduce": 1, "prefetch": 2}


def tma_call(segments, out, config, epilogue: str, add: bool = True):
    """Up to four segments, each one (descriptor, descriptor, offsets) argument triple (triton 3.6's launcher takes
    no descriptors inside tuples); the unused triples repeat the first, which the kernel never reads."""
    block_m, block_n, block_k, warps, stages = config
    experts, M, N = out.shape
    triples = []
    for a, b, offsets in segments:
        a_desc, b_desc, out_desc = descriptors(a, b, out, block_m, block_n, block_k)
        triples += [a_desc, b_desc, offsets]
    triples += triples[:3] * (4 - len(segments))
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    _tma_kernel[(tiles, experts)](*triples, out, out_desc, M, N, out.stride(0), out.stride(1), int(add),
                                  SEGMENTS=len(segments), EPILOGUE=EPILOGUES[epilogue], BLOCK_M=block_m,
                                  BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, STAGES=stages, num_warps=warps)


SHIPPED = (128, 128, 32, 4, 5)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); wgrad_tma1 swept 8 (persistent forms too: all slower)
TMA_CONFIGS = [(128, 128, 32, 4, 4), (128, 128, 32, 4, 3), (128, 128, 64, 4, 3), (64, 128, 64, 4, 4),
               (128, 256, 64, 8, 3)]


def variants(segments, out) -> dict:
    (a, b, offsets) = segments[0]
    tag2 = f"_{len(segments)}seg" if len(segments) > 1 else ""
    fns = {"shipped" + tag2: lambda: grouped_wgrad_accumulate_triton(segments, out, SHIPPED)}
    if not tag2:
        fns.update({
            "mainloop_only": lambda: ptr_call(a, b, offsets, out, SHIPPED, loop=True, add=False),
            "epilogue_only": lambda: ptr_call(a, b, offsets, out, SHIPPED, loop=False, add=True),
            "grouped_mm_alone": lambda: torch._grouped_mm(a.t(), b, offs=offsets),
        })
    for config in TMA_CONFIGS:
        tag = "x".join(map(str, config))
        if not tag2:
            fns[f"tma_{tag}_mainloop_only"] = lambda config=config: tma_call(segments, out, config, "reduce", False)
        for epilogue in EPILOGUES:
            fns[f"tma_{tag}_{epilogue}{tag2}"] = (lambda config=config, epilogue=epilogue:
                                                  tma_call(segments, out, config, epilogue))
    return fns


def check(fns: dict, segments, ragged_segments, main_grad, errors: dict, failed: dict) -> None:
    """Every variant that adds, once into zeros on the uneven experts, against the shipped kernel; one that fails
    (compiling, or out of shared memory) is recorded and dropped."""
    reference = torch.zeros_like(main_grad)
    grouped_wgrad_accumulate_triton(ragged_segments, reference, SHIPPED)
    for variant in list(fns):
        adds = not (variant in ("mainloop_only", "epilogue_only", "grouped_mm_alone") or variant.endswith("only"))
        got = torch.zeros_like(main_grad)
        try:
            (variants(ragged_segments, got)[variant] if adds else fns[variant])()
            torch.cuda.synchronize()
            if adds:
                errors[variant] = (got - reference).abs().max().item()
        except Exception as e:
            failed[variant] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            fns.pop(variant)
            print(variant, "failed:", failed[variant], flush=True)
        _DESCS.clear()  # they hold the tensors they describe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--shapes", default=",".join(WGRAD_SHAPES))
    parser.add_argument("--segments", default="1,2", help="micro-batches a call, comma-separated (up to 4)")
    args = parser.parse_args()
    counts = [int(x) for x in args.segments.split(",")]
    rows = []
    for name in args.shapes.split(","):
        experts, per_expert, m, n = WGRAD_SHAPES[name]
        a, b, offsets, main_grad = wgrad_operands(name, per_expert)
        # further micro-batches' rows (train.expert_wgrad_micro_batches)
        more = [(torch.randn_like(a), torch.randn_like(b)) for _ in range(max(counts) - 1)]
        ragged = offsets.clone()
        ragged[: experts // 2] -= 37  # uneven experts: the first half 37 rows short, the next one 37 more,
        ragged[1] = ragged[0]  # and the second none
        errors, failed, fns = {}, {}, {}
        for count in counts:
            operands = [(a, b)] + more[:count - 1]
            segments = [(x, y, offsets) for x, y in operands]
            ragged_segments = [(x, y, ragged) for x, y in operands]
            some = variants(segments, main_grad)
            check(some, segments, ragged_segments, main_grad, errors, failed)
            fns.update(some)
        ms = timed_graphed(fns, args.rounds, calls=10)
        flops = 2 * experts * per_expert * m * n
        rows.append({"shape": name, "experts": experts, "rows_per_expert": per_expert, "m": m, "n": n,
                     "ms_per_call": ms, "tflops_per_micro_batch": {
                         k: flops * (int(k.split("_")[-1][:-3]) if k.endswith("seg") else 1) / v / 1e9
                         for k, v in ms.items()},
                     "max_abs_diff_vs_shipped": errors, "failed": failed})
        print(name, {k: round(v, 3) for k, v in sorted(ms.items(), key=lambda kv: kv[1])}, flush=True)
        print(name, "nonzero |diff|", {k: v for k, v in errors.items() if v}, flush=True)
        del fns, some, a, b, more, main_grad
        _DESCS.clear()
    write_json(args.json, run_header(1), rows)


if __name__ == "__main__":
    main()
