"""The training step's kernels alone, on one GPU, variants round-robin (medians of CUDA-event timings):

  wgrad      an expert weight gradient into fp32 main_grad: the bf16 grouped GEMM then a separate add (before),
             the Triton grouped kernel accumulating in place (each tile config), per-expert addmm with an fp32
             output (host offsets), and the bf16 grouped GEMM alone (the limit: no accumulation at all)
  attention  causal GQA attention forward+backward through SDPA: its default choice and each backend forced
             (flash, cuDNN, memory-efficient), with grouped KV heads and with them expanded

    python benchmarks/step_kernels.py --json benchmarks/results/step_kernels_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_header, write_json  # noqa: E402

WGRAD_SHAPES = {  # name: (experts, rows per expert, M, N) -- M x N per expert, summed over its rows
    "mixtral_fc1": (8, 1024, 4096, 2 * 14336), "mixtral_fc2": (8, 1024, 14336, 4096),
    "fine_fc1": (64, 1024, 2048, 2 * 1024), "fine_fc2": (64, 1024, 1024, 2048),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Tried and dropped on an H200 (step_kernels_*_h200.json): a load +
# store epilogue instead of the atomic add (10-20% slower), a persistent flattened tile loop (no gain).
TILE_CONFIGS = [(128, 128, 32, 4, 5), (128, 128, 64, 4, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                (256, 128, 64, 8, 3), (128, 256, 32, 8, 4)]
ATTENTION_SHAPES = {"mixtral": (1, 32, 8, 4096, 128), "fine": (2, 16, 4, 4096, 128)}  # batch, heads, kv, seq, dim


def timed(fns: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median ms per call of every variant, round-robin."""
    import torch

    samples = {name: [] for name in fns}
    for fn in fns.values():  # warm-up (compiles, autotunes, allocates)
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / reps)
    return {name: statistics.median(values) for name, values in samples.items()}


def wgrad_rows(rounds: int, shapes: list[str]) -> list[dict]:
    import torch

    from moe_overlap.kernels.grouped_wgrad import grouped_wgrad_accumulate_triton

    rows = []
    for name in shapes:
        experts, per_expert, m, n = WGRAD_SHAPES[name]
        tokens = experts * per_expert
        a = torch.randn(tokens, m, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * per_expert
        main_grad = torch.zeros(experts, m, n, device="cuda", dtype=torch.float32)
        host_offsets = [0] + offsets.tolist()
        fns = {
            "grouped_mm_alone": lambda: torch._grouped_mm(a.t(), b, offs=offsets),
            "grouped_mm_then_add": lambda: main_grad.add_(torch._grouped_mm(a.t(), b, offs=offsets)),
            "addmm_per_expert": lambda: [torch.addmm(main_grad[e], a[s:t].t(), b[s:t], out_dtype=torch.float32,
                                                     out=main_grad[e])
                                         for e, (s, t) in enumerate(zip(host_offsets, host_offsets[1:]))],
        }
        for config in TILE_CONFIGS:
            fns["triton_" + "x".join(map(str, config))] = (
                lambda config=config: grouped_wgrad_accumulate_triton([(a, b, offsets)], main_grad, config))
        ms = timed(fns, rounds, reps=5)
        flops = 2 * tokens * m * n
        rows.append({"section": "wgrad", "shape": name, "experts": experts, "rows_per_expert": per_expert, "m": m,
                     "n": n, "ms": ms, "tflops": {k: flops / v / 1e9 for k, v in ms.items()},
                     "best_triton": min((k for k in ms if k.startswith("triton")), key=ms.get)})
        print(rows[-1]["shape"], {k: round(v, 3) for k, v in ms.items()}, flush=True)
    return rows


def adamw_rows(rounds: int) -> list[dict]:
    """AdamW over a Mixtral-size layer's experts (1.4G fp32 elements in 4 tensors + a bf16 copy): the kernel's
    block and warps, and torch's fused AdamW followed by the bf16 copy, against the bytes' memory time."""
    import torch

    from moe_overlap.kernels.adamw import AdamWHyper, adamw_update_triton

    n = 2**28
    master, grad, exp_avg = (torch.randn(n, device="cuda") for _ in range(3))
    exp_avg_sq = torch.rand(n, device="cuda")
    copy = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    control = torch.tensor([1.0, 3.0, 1.0], device="cuda")
    hyper = AdamWHyper(1e-4, 0.9, 0.95, 1e-8, 0.1)
    step = torch.tensor(3.0, device="cuda")
    fns = {f"triton_{block}x{warps}_{per_sm or 'all'}": (lambda block=block, warps=warps, per_sm=per_sm:
                                                            adamw_update_triton(master, grad, exp_avg, exp_avg_sq,
                                                                                copy, control, hyper, block, warps,
                                                                                per_sm))
           for block, warps, per_sm in ((1024, 8, None), (1024, 4, None), (512, 4, None), (1024, 8, 4),
                                        (1024, 8, 8), (2048, 8, 4), (1024, 4, 16), (512, 4, 16), (2048, 16, 2))}

    def torch_fused():
        torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [step], lr=1e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        copy.copy_(master)
    fns["torch_fused_then_copy"] = torch_fused
    copy_in = torch.empty(2 * n, device="cuda", dtype=torch.bfloat16)
    fns["copy_limit_same_bytes"] = lambda: copy_in.copy_(copy_in.flip(0))  # 30 B/element: 16 read, 14 written
    ms = timed(fns, rounds, reps=3)
    limit_gb = 30 * n / 1e9
    row = {"section": "adamw", "elements": n, "bytes_per_element": 30, "ms": ms,
           "tb_per_s": {k: limit_gb / v for k, v in ms.items() if k != "copy_limit_same_bytes"}}
    print("adamw", {k: round(v, 3) for k, v in ms.items()}, flush=True)
    return [row]


def attention_rows(rounds: int) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, (batch, heads, kv, seq, dim) in ATTENTION_SHAPES.items():
        q = torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(batch, seq, kv, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(batch, seq, kv, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        grad = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16)
        for t in (q, k, v):
            t.requires_grad_(True)

        def run(backend=None, expand=False):
            kk, vv = (k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)) if expand else (k, v)
            if backend is None:
                out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
            else:
                with sdpa_kernel([backend]):
                    out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
            out.backward(grad)

        fns = {"default_gqa": lambda: run(), "default_expanded": lambda: run(expand=True)}
        errors = {}
        for label, backend in backends.items():
            for expand in (False, True):
                key = f"{label}_{'expanded' if expand else 'gqa'}"
                try:
                    run(backend, expand)
                    fns[key] = lambda backend=backend, expand=expand: run(backend, expand)
                except RuntimeError as error:
                    errors[key] = str(error).splitlines()[0][:160]
        ms = timed(fns, rounds, reps=3)
        flops = 4 * batch * seq * seq * heads * dim * 3 / 2  # causal: half the full forward+backward
        rows.append({"section": "attention", "shape": name, "batch": batch, "heads": heads, "kv_heads": kv,
                     "seq": seq, "head_dim": dim, "ms": ms, "tflops_causal": {k: flops / v / 1e9 for k, v in ms.items()},
                     "unavailable": errors})
        print(name, {k: round(v, 3) for k, v in ms.items()}, errors, flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sections", default="wgrad,adamw,attention")
    parser.add_argument("--shapes", default=",".join(WGRAD_SHAPES), help="wgrad shapes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    rows = (wgrad_rows(args.rounds, args.shapes.split(",")) if "wgrad" in sections else []) + (
        adamw_rows(args.rounds) if "adamw" in sections else []) + (
        attention_rows(args.rounds) if "attention" in sections else [])
    write_json(args.json, run_header(1), rows)


if __name__ == "__main__":
    main()
