"""The training step's kernels alone, on one GPU, variants round-robin (medians of CUDA-event timings):

  wgrad      an expert weight gradient into fp32 main_grad: the bf16 grouped GEMM then a separate add (before),
             the Triton grouped kernel accumulating in place (each tile config), per-expert addmm with an fp32
             output (host offsets), and the bf16 grouped GEMM alone (the limit: no accumulation at all)
  attention  causal GQA attention forward+backward through SDPA: its default choice and each backend forced
             (flash, cuDNN, memory-efficient), with grouped KV heads and with them expanded
  rows       the row kernels of the MoE exchange at the fine-grained model's EP=4 shapes (each token once per
             rank: a wire row carries 2.2 of its J=8 slots; the grouped buffers sized for the worst case, 4x the
             rows that arrive) and at EP=1: the gather-sum kernel (unpermute, permute_backward) per block and
             warps, the permute, and SwiGLU over a worst-case buffer beside one of the counted rows, against a
             device copy of the same bytes (the limit). Its first run (step_kernels_rows_1xh100.json) also timed
             the tile form the gather-sum kernel had before (tile_*): 1.2-4.2x the limit where the loop is 1.0x.
             SwiGLU's forward also as a grid-stride candidate (programs per SM x SMs, each looping over the
             counted rows), not yet run on a GPU. With the overflow chunk's columns (token_sum_overflow: a
             token's 4 wire rows, then 8 overflow columns, empty) the combine's sum with those columns in the same
             loop (sum_dense) and in a loop run only for a token with one (sum_sparse)
  fp8_blockwise  the blockwise FP8 recipe's grouped GEMM (kernels/fp8_blockwise.py: a 1x128 and 128x128 scale
             per 128-deep slice) at the wgrad section's expert shapes, forward (a @ w^T) and dgrad (g @ w, the
             same weight copy read N-major), each tile config, against the rowwise recipe's
             torch._scaled_grouped_mm (one scale per row and column) and bf16 torch._grouped_mm (the limit
             without FP8); its error against bf16 normwise
  push       the SM push (kernels/push_rows.py) into local memory, 64 MiB of rows of the bench models' widths: per
             CTA count and bytes a program loads per step (``in_flight``), alone and beside a grouped bf16 GEMM
             carved out by as many SMs (the GEMM launched first, the push on a side stream), with twice the CTAs
             (two programs per free SM) at 16 KiB too; the GEMM alone at each carve-out; MB per CTA per ms
  waiters    a grouped GEMM, a dense GEMM and causal attention alone and with 1 or 2 one-CTA spin kernels resident
             on other streams (a signal wait's footprint): what a micro-batch's wait costs the other's kernels
  swiglu_fp8 SwiGLU under the rowwise FP8 recipe at the Mixtral-like (8,192 rows, ffn 14,336) and fine (65,536
             rows, ffn 1,024) expert shapes: the fused kernels writing FP8 rows (kernels/swiglu.py swiglu_forward_fp8,
             swiglu_backward_fp8: fc1's output gradient) against SwiGLU then quantize_rows (two passes), and
             SwiGLU alone (bf16); row programs per SM swept
  permute_fp8 the permutation around rowwise FP8 experts at one EP rank (fine and Mixtral-like shapes): permute
             and unpermute_backward writing the rows' FP8 copies in the same pass (kernels/permute.py ``fp8_out``)
             against each then quantize_rows, and each alone
  weight_fp8 a weight's two rowwise FP8 copies (the forward's per row, the dgrad's per column, written transposed:
             kernels/fp8_quant.py), refreshed once per optimizer step, at the Mixtral-like expert weights and a fine
             one: quantize_rows and quantize_columns (two passes over the weight each) against
             quantize_rows_and_columns (two passes in all), into the cached copies in place; GB/s of the bytes that
             must move (the weight read once, both copies and their scales written)
  fp8_tokens the FP8 weight gradient's operands quantized along the tokens per group (the rowwise recipe,
             kernels/fp8_wgrad.py quantize_along_tokens): every operand of an expert layer's two weight gradients
             (Mixtral-like at 1,024 and 4,096 rows per expert, fine-grained), the one-launch kernel at 16-128
             columns a program against the two launches over the chunks, and per chunk (one read)
  fp8_param  a weight's optimizer step and the refresh of its two rowwise FP8 copies, kept apart from the bf16
             weight against held in it (train.fp8_param: the tiled step leaving the maxima, per tile config)
  fp8_wgrad  the FP8 weight gradient (kernels/fp8_wgrad.py, train.fp8_wgrad) at the wgrad section's shapes: the
             bf16 Triton kernel it replaces (its default config), and the FP8 kernel per group (rowwise: each
             128-token chunk summed in fp32, or fast: the tensor cores' own accumulation across chunks) and per
             chunk (blockwise), each tile config, operands quantized outside the timing; then each recipe whole
             (both operands quantized along the tokens inside the timing, the default kernel), and the quantize
             passes alone (64 and 128 columns a program); errors against fp32 normwise; ``--rows``: at those rows
             per expert; ``--segments N``: each call sums N micro-batches' shares (the calls of
             train.expert_wgrad_micro_batches=N, which a one-segment sweep mistimed: benchmarks/RESULTS.md,
             section "FP8")

    python benchmarks/step_kernels.py --json benchmarks/results/step_kernels_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import round_robin, run_header, write_json  # noqa: E402

WGRAD_SHAPES = {  # name: (experts, rows per expert, M, N) -- M x N per expert, summed over its rows
    "mixtral_fc1": (8, 1024, 4096, 2 * 14336), "mixtral_fc2": (8, 1024, 14336, 4096),
    "fine_fc1": (64, 1024, 2048, 2 * 1024), "fine_fc2": (64, 1024, 1024, 2048),
}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Tried and dropped on an H200 (step_kernels_*_h200.json): a load +
# store epilogue instead of the atomic add (10-20% slower), a persistent flattened tile loop (no gain). On an H100
# (commit b72a5bd, phase tma1: step_kernels_wgrad_tma_1xh100.json, step_kernels_fp8_wgrad_tma_1xh100.json,
# train_step_tma_*): the TMA's bulk reduction (cp.reduce.async.bulk.tensor) instead of the atomic add, in this
# kernel and the FP8 one: -7% to +6% by shape, the Mixtral-like FP8 step 0.6% slower. main_grad_rmw times the
# read-modify-write alone: the kernels take about its time plus the GEMM's.
TILE_CONFIGS = [(128, 128, 32, 4, 5), (128, 128, 64, 4, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                (256, 128, 64, 8, 3), (128, 256, 32, 8, 4)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the blockwise kernel: BLOCK_N and BLOCK_K are the scale blocks' 128.
# 64 rows in one warp group fit two programs per SM (one scales its slice while the other multiplies), 128 in two
# only one (registers: ptxas for sm_90).
# (BLOCK_M, BLOCK_N, warps, stages) of the FP8 wgrad kernel (the depth is a 128-token chunk). Swept first on an
# H100 with (128, 128, 8, 3) and (128, 128, 4, 4) too (step_kernels_fp8_wgrad_1xh100.json), when its loads went
# through pointers; (128, 256, 8, 3), the per-group default since the TMA feeds it (fp8_wgrad_tma_1xh200.json).
FP8_WGRAD_CONFIGS = [(64, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3)]
# (BLOCK_M, warps, stages): the shipped tile, fewer stages (2 or 3 programs an SM: one's scaling beside another's
# products), 64 rows over two warp groups, 128 rows in 2 and 3 stages
BLOCKWISE_CONFIGS = [(64, 4, 4), (64, 4, 3), (64, 4, 2), (64, 8, 4), (64, 8, 3), (128, 8, 2), (128, 8, 3)]
WEIGHT_FP8_SHAPES = {"mixtral_w13": (8, 4096, 28672), "mixtral_w2": (8, 14336, 4096), "fine": (64, 2048, 2048),
                     "fine_w2": (64, 1024, 2048)}
ATTENTION_SHAPES = {"mixtral": (1, 32, 8, 4096, 128), "fine": (2, 16, 4, 4096, 128)}  # batch, heads, kv, seq, dim
TOKEN_QUANTIZE_SHAPES = {  # name: (experts, rows per expert, the four operands' widths: x, grad_y, a, grad_h)
    "mixtral_1gpu": (8, 1024, (4096, 4096, 14336, 2 * 14336)),
    "mixtral_ep4": (2, 4096, (4096, 4096, 14336, 2 * 14336)),
    "fine_ep1": (64, 1024, (2048, 2048, 1024, 2 * 1024)),
}


def timed(fns: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median ms per call of every variant, round-robin. A variant whose calls take the host about as long to
    launch as the GPU to run is named on stderr: its time is the host's (:func:`timed_graphed` times the GPU)."""
    import torch

    samples = {name: [] for name in fns}
    host = {name: [] for name in fns}
    for fn in fns.values():  # warm-up (compiles, autotunes, allocates)
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launched = time.perf_counter()
            for _ in range(reps):
                fn()
            host[name].append((time.perf_counter() - launched) * 1e3 / reps)
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / reps)
    ms = {name: statistics.median(values) for name, values in samples.items()}
    for name, gpu_ms in ms.items():
        if statistics.median(host[name]) >= 0.9 * gpu_ms:
            print(f"host-bound: {name} takes the host {statistics.median(host[name]):.4f} ms a call to launch against "
                  f"{gpu_ms:.4f} ms measured: that is the host's time (timed_graphed times the GPU's)", file=sys.stderr)
    return ms


def timed_graphed(fns: dict, rounds: int, calls: int = 20) -> dict[str, float]:
    """Median ms per call of every variant, round-robin, each variant's ``calls`` calls replayed from one CUDA graph:
    the GPU's time alone, where :func:`timed` of a kernel shorter than its launch's host time measures the host."""
    import torch

    graphs = {}
    for name, fn in fns.items():
        fn()  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graphs[name] = graph
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / calls)
    return {name: statistics.median(values) for name, values in samples.items()}


def wgrad_operands(name: str, per_expert: int):
    """A weight gradient's operands at an expert shape, ``per_expert`` rows each: (a_TM, b_TN bf16, int32 end
    offsets, the fp32 main_grad (E, M, N) they add into)."""
    import torch

    experts, _, m, n = WGRAD_SHAPES[name]
    a = torch.randn(experts * per_expert, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(experts * per_expert, n, device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * per_expert
    return a, b, offsets, torch.zeros(experts, m, n, device="cuda", dtype=torch.float32)


def wgrad_rows(rounds: int, shapes: list[str]) -> list[dict]:
    import torch

    from moe_overlap.kernels.grouped_wgrad import grouped_wgrad_accumulate_triton

    rows = []
    for name in shapes:
        experts, per_expert, m, n = WGRAD_SHAPES[name]
        tokens = experts * per_expert
        a, b, offsets, main_grad = wgrad_operands(name, per_expert)
        host_offsets = [0] + offsets.tolist()
        fns = {
            "grouped_mm_alone": lambda: torch._grouped_mm(a.t(), b, offs=offsets),
            "grouped_mm_then_add": lambda: main_grad.add_(torch._grouped_mm(a.t(), b, offs=offsets)),
            "main_grad_rmw": lambda: main_grad.add_(1.0),
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


def fp8_blockwise_rows(rounds: int, shapes: list[str]) -> list[dict]:
    """Per expert shape and orientation: the blockwise kernel's tile configs, the rowwise scaled grouped GEMM and
    the bf16 grouped GEMM on the same rows (operands quantized once, outside the timing)."""
    import torch

    from moe_overlap.kernels.fp8_blockwise import blockwise_mm_triton, quantize_blocks, quantize_tiles
    from moe_overlap.kernels.fp8_quant import quantize_rows

    rows = []
    for name in shapes:
        experts, per_expert, k_in, n_out = WGRAD_SHAPES[name]
        tokens = experts * per_expert
        offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * per_expert
        w_ENK = torch.randn(experts, n_out, k_in, device="cuda", dtype=torch.bfloat16) * 0.02  # as the layer holds it
        copies = {"forward": quantize_blocks(w_ENK), "dgrad": quantize_blocks(w_ENK, transpose=True)}
        for orientation, contract, out_dim in (("forward", k_in, n_out), ("dgrad", n_out, k_in)):
            forward = orientation == "forward"
            a_TC = torch.randn(tokens, contract, device="cuda", dtype=torch.bfloat16)
            a_q, a_scale = quantize_tiles(a_TC)
            a_rows_q, a_rows_scale = quantize_rows(a_TC)
            # The rowwise GEMM's right operand column-major: (E, out, contract) contiguous, transposed.
            b_q, b_scale = quantize_rows(w_ENK if forward else w_ENK.transpose(-2, -1).contiguous())
            w_bf16 = w_ENK.transpose(-2, -1) if forward else w_ENK
            fns = {
                "rowwise_scaled_grouped_mm": lambda: torch._scaled_grouped_mm(
                    a_rows_q, b_q.transpose(-2, -1), a_rows_scale, b_scale, offs=offsets, out_dtype=torch.bfloat16),
                "bf16_grouped_mm": lambda: torch._grouped_mm(a_TC, w_bf16, offs=offsets),
            }
            # what the layers run: the copy laid out along this orientation's contraction (the dgrad's transposed)
            b_copy_q, b_copy_scale = copies[orientation]
            for config in BLOCKWISE_CONFIGS:
                fns["triton_" + "x".join(map(str, config))] = (
                    lambda config=config: blockwise_mm_triton(a_q, a_scale, b_copy_q, b_copy_scale, True, offsets,
                                                              config=config))
            if not forward:  # the forward's copy read through strides: the kernel transposes each tile itself
                fns["triton_strided_default"] = lambda: blockwise_mm_triton(a_q, a_scale, *copies["forward"], False,
                                                                            offsets)
            want = fns["bf16_grouped_mm"]().float()
            errors = {k: float((fn().float() - want).norm() / want.norm()) for k, fn in fns.items()
                      if k != "bf16_grouped_mm"}
            ms = timed(fns, rounds, reps=5)
            flops = 2 * tokens * contract * out_dim
            rows.append({"section": "fp8_blockwise", "shape": name, "orientation": orientation, "experts": experts,
                         "rows_per_expert": per_expert, "contract": contract, "out": out_dim, "ms": ms,
                         "tflops": {k: flops / v / 1e9 for k, v in ms.items()}, "rel_err_vs_bf16": errors,
                         "best_triton": min((k for k in ms if k.startswith("triton")), key=ms.get)})
            print(name, orientation, {k: round(v, 3) for k, v in ms.items()}, flush=True)
    return rows


def fp8_wgrad_rows(rounds: int, shapes: list[str], rows_per_expert: list[int] | None = None,
                   segments: int = 1) -> list[dict]:
    """Per expert shape (and rows per expert: the shape's own, or each of ``rows_per_expert``): the FP8 wgrad
    kernel's modes and tile configs beside the bf16 kernel it replaces, all into the same fp32 main_grad.
    ``segments`` N: the rows per expert in N micro-batches' segments of a share each, every kernel summing them in
    one call, as the step does with train.expert_wgrad_micro_batches=N."""
    import torch

    from moe_overlap.kernels import fp8_wgrad as W
    from moe_overlap.kernels.grouped_wgrad import grouped_wgrad_accumulate_triton

    rows = []
    for name, per_expert in [(name, per) for name in shapes for per in rows_per_expert or [WGRAD_SHAPES[name][1]]]:
        experts, _, m, n = WGRAD_SHAPES[name]
        tokens = experts * per_expert
        parts = [wgrad_operands(name, per_expert // segments) for _ in range(segments)]  # (a, b, offsets, main_grad)
        main_grad = parts[0][3]
        bf16_segments = [(a, b, offsets) for a, b, offsets, _ in parts]

        def quantized(per_chunk: bool, columns: int | None = None) -> list:
            return [(W.quantize_along_tokens(a, offsets, per_chunk, columns),
                     W.quantize_along_tokens(b, offsets, per_chunk, columns)) for a, b, offsets in bf16_segments]

        operands = {mode: quantized(mode == "chunk") for mode in ("group", "chunk")}
        modes = {"group": (False, False), "group_fast": (False, True), "chunk": (True, False)}  # per_chunk, fast
        # main_grad's read-modify-write alone (one add of a scalar): what the kernels' epilogues stream through HBM
        fns = {"main_grad_rmw": lambda: main_grad.add_(1.0),
               "bf16_triton": lambda: grouped_wgrad_accumulate_triton(bf16_segments, main_grad)}
        for mode, (per_chunk, fast) in modes.items():
            for config in FP8_WGRAD_CONFIGS:
                fns[f"fp8_{mode}_" + "x".join(map(str, config))] = (
                    lambda q=operands["chunk" if per_chunk else "group"], per_chunk=per_chunk, fast=fast,
                    config=config: W.fp8_wgrad_accumulate_triton(q, main_grad, per_chunk, fast, config))
        for mode in ("group", "chunk"):
            for columns in (64, 128):  # a quantize program's columns
                fns[f"quantize_{mode}" + ("" if columns == 64 else f"_c{columns}")] = (
                    lambda per_chunk=mode == "chunk", columns=columns: quantized(per_chunk, columns))
            fns[f"whole_{mode}"] = lambda per_chunk=mode == "chunk": W.fp8_wgrad_accumulate(
                quantized(per_chunk), main_grad, per_chunk)
        want = sum(torch.stack([a[s:e].float().t() @ b[s:e].float() for s, e in zip(
            [0] + offsets[:-1].tolist(), offsets.tolist())]) for a, b, offsets in bf16_segments)
        errors = {}
        for key, fn in fns.items():
            if not key.startswith(("quantize", "main_grad")):
                main_grad.zero_()
                fn()
                errors[key] = float((main_grad - want).norm() / want.norm())
        ms = timed(fns, rounds, reps=5)
        flops = 2 * tokens * m * n
        rows.append({"section": "fp8_wgrad", "shape": name, "experts": experts, "rows_per_expert": per_expert,
                     "segments": segments, "m": m, "n": n, "ms": ms,
                     "tflops": {k: flops / v / 1e9 for k, v in ms.items()}, "rel_err_vs_fp32": errors,
                     "best": {mode: min((k for k in ms if k.startswith(f"fp8_{mode}_")), key=ms.get)
                              for mode in modes}})
        print(name, per_expert, segments, {k: round(v, 3) for k, v in ms.items()}, flush=True)
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
                     "seq": seq, "head_dim": dim, "ms": ms,
                     "tflops_causal": {k: flops / v / 1e9 for k, v in ms.items()}, "unavailable": errors})
        print(name, {k: round(v, 3) for k, v in ms.items()}, errors, flush=True)
    return rows


# name: (programs T, copies K, valid copies, programs with any, source rows, hidden). The fine model at EP=4 with each
# token once per rank, balanced routing (train_step_fine_8l_ep4_*balanced_4xh100.json): 8192 tokens per micro-batch and
# rank, 65536 copies in 30000 wire rows of the 32768 static; the grouped rows' buffer 4 x 65536 (unbounded).
ROW_SHAPES = {"expert_unpermute": (32768, 8, 65536, 30000, 4 * 65536, 2048),
              "token_sum": (8192, 4, 30000, 8192, 32768, 2048),
              "ep1_unpermute": (8192, 8, 65536, 8192, 65536, 2048),
              # the fine layer at EP=1, 4 chunks, wire rows with the overflow chunk (f2 = 0.25) and nothing past the
              # bound: a token's 4 wire-row columns, then 8 overflow columns, all empty
              "token_sum_overflow": (8192, 12, 32000, 8192, 32768 + 16384, 2048)}
SPARSE_FROM = {"token_sum_overflow": 4}  # the overflow columns: permute_backward's sparse_from


def _row_index(T: int, K: int, valid: int, filled: int, source_rows: int):
    """Each program's K source rows: ``valid`` distinct rows over the first ``filled`` programs, a program's valid
    ones first (as wire rows fill their slots), -1 after them; the other programs empty."""
    import torch

    per = torch.full((T,), 0, dtype=torch.int64)
    per[:filled] = valid // filled
    per[:valid % filled] += 1
    per.clamp_(max=K)
    slot = torch.arange(K).unsqueeze(0)
    rows = torch.randperm(source_rows)[:int(per.sum())]
    index = torch.full((T, K), -1, dtype=torch.int64)
    index[slot < per.unsqueeze(1)] = rows
    return index.to(torch.int32).cuda()


def row_kernel_rows(rounds: int) -> list[dict]:
    import torch

    from moe_overlap.kernels import permute as P
    from moe_overlap.kernels import swiglu as S

    out = []
    for name, (T, K, valid, filled, source_rows, H) in ROW_SHAPES.items():
        index = _row_index(T, K, valid, filled, source_rows)
        src = torch.randn(source_rows, H, device="cuda", dtype=torch.bfloat16)
        probs = torch.rand(T, K, device="cuda")
        moved = int((index >= 0).sum()) * H * 2 + T * H * 2  # rows read, rows written
        copy_in = torch.empty(moved, device="cuda", dtype=torch.uint8)  # half read, half written
        fns = {"copy_limit_same_bytes": lambda: copy_in[:moved // 2].copy_(copy_in[moved // 2:])}
        for block_h, warps in ((None, 4), (2048, 4), (2048, 8), (1024, 2), (512, 4)):
            fns[f"loop_{block_h or 'auto'}x{warps}"] = (
                lambda block_h=block_h, warps=warps: P._launch_gather_sum(src, index, probs, block_h,
                                                                           num_warps=warps))
        fns["torch_twin"] = lambda: P.unpermute_torch(src, index, probs)
        if name in SPARSE_FROM:  # the combine's sum of a token's rows (no probs), the late columns dense or sparse
            fns["sum_dense"] = lambda: P._launch_gather_sum(src, index, None, None)
            fns["sum_sparse"] = lambda: P._launch_gather_sum(src, index, None, None, sparse_from=SPARSE_FROM[name])
        want, summed = P.unpermute_torch(src, index, probs).float(), P.permute_backward_torch(src, index).float()
        errors = {k: float((fn().float() - (summed if k.startswith("sum_") else want)).abs().max())
                  for k, fn in fns.items() if k != "copy_limit_same_bytes"}
        x_TH = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)  # the permute: a program's row to its K rows
        fns["permute_scatter"] = lambda: P.permute(x_TH, index, source_rows, all_rows_mapped=True)
        ms = timed(fns, rounds, reps=5)
        out.append({"section": "rows", "shape": name, "programs": T, "copies": K, "valid_copies": valid,
                    "source_rows": source_rows, "hidden": H, "bytes": moved, "ms": ms,
                    "vs_limit": {k: v / ms["copy_limit_same_bytes"] for k, v in ms.items()}, "max_abs_error": errors,
                    "best_gather": min((k for k in ms if k.startswith("loop")), key=ms.get)})
        print(name, {k: round(v, 4) for k, v in ms.items()}, flush=True)
    h = torch.randn(4 * 65536, 2048, device="cuda", dtype=torch.bfloat16)  # SwiGLU over fc1's output, ffn 1024
    grad_a = torch.randn(4 * 65536, 1024, device="cuda", dtype=torch.bfloat16)
    counted = torch.tensor([65536], device="cuda")
    fns = {"fwd_worst_case_buffer": lambda: S.swiglu_forward_triton(h, counted),
           "fwd_counted_rows_alone": lambda: S.swiglu_forward_triton(h[:65536]),
           "bwd_worst_case_buffer": lambda: S.swiglu_backward_triton(h, grad_a, counted),
           "bwd_counted_rows_alone": lambda: S.swiglu_backward_triton(h[:65536], grad_a[:65536])}
    got, want = fns["fwd_worst_case_buffer"]()[:65536].float(), S.swiglu_forward_torch(h[:65536]).float()
    errors = {"fwd_worst_case_buffer": float((got - want).abs().max())}
    ms = timed(fns, rounds, reps=5)
    out.append({"section": "rows", "shape": "swiglu_65536_of_262144_rows", "ms": ms, "max_abs_error": errors})
    print("swiglu", {k: round(v, 4) for k, v in ms.items()}, flush=True)
    return out


PUSH_WIDTHS = {"fine_bench": 2048, "mixtral": 4096, "fine": 7168}  # hidden sizes: the rows a push moves
PUSH_IN_FLIGHT = (16384, 32768, 65536)


def push_rows_rows(rounds: int) -> list[dict]:
    import torch

    from moe_overlap.distributed.streams import gemm_sm_carveout
    from moe_overlap.kernels.push_rows import push_rows

    out = []
    side = torch.cuda.Stream()
    # the GEMM beside: the fine bench model's fc1 (64 experts x 1,024 rows, 2048 -> 2 x 1024), forward
    x_gemm = torch.randn(65536, 2048, device="cuda", dtype=torch.bfloat16)
    w_gemm = torch.randn(64, 2048, 2048, device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(1, 65, device="cuda", dtype=torch.int32) * 1024

    def gemm(sms: int) -> None:
        with gemm_sm_carveout(sms):
            torch._grouped_mm(x_gemm, w_gemm, offs=offsets)

    for name, width in PUSH_WIDTHS.items():
        rows = (64 << 20) // (width * 2)
        src = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        dest = torch.empty_like(src)
        bases = torch.tensor([dest.data_ptr()], dtype=torch.int64, device="cuda")
        zero = torch.zeros(1, dtype=torch.int64, device="cuda")
        count = torch.tensor([rows], device="cuda")
        ranks = torch.zeros(rows, dtype=torch.int32, device="cuda")
        dst_rows = torch.arange(rows, device="cuda")

        def push(ctas: int, in_flight: int) -> None:
            push_rows(src, zero, count, ranks, dst_rows, zero, bases, ctas, in_flight=in_flight)

        def beside(sms: int, ctas: int, in_flight: int) -> None:
            side.wait_stream(torch.cuda.current_stream())
            gemm(sms)  # launched first: the push takes the SMs it leaves free
            with torch.cuda.stream(side):
                push(ctas, in_flight)
            torch.cuda.current_stream().wait_stream(side)

        fns = {}
        for in_flight in PUSH_IN_FLIGHT:
            for ctas in (1, 4, 8, 16, 32):
                fns[f"push_{ctas}_{in_flight // 1024}k"] = lambda c=ctas, f=in_flight: push(c, f)
        fns["push_full_16k"] = lambda: push(264, 16384)
        for sms in (8, 16):
            fns[f"gemm_c{sms}"] = lambda sms=sms: gemm(sms)
            for in_flight in PUSH_IN_FLIGHT:
                fns[f"gemm_c{sms}+push_{sms}_{in_flight // 1024}k"] = lambda sms=sms, f=in_flight: beside(sms, sms, f)
            fns[f"gemm_c{sms}+push_{2 * sms}_16k"] = lambda sms=sms: beside(sms, 2 * sms, 16384)
        fns["gemm_c0"] = lambda: gemm(0)
        push(8, 65536)
        assert torch.equal(dest, src), "the push moved the wrong rows"
        ms = timed(fns, rounds, reps=3)
        nbytes = rows * width * 2
        per_cta = {k: round(nbytes / (v * 1e3) / int(k.split("_")[1]) / 1e3, 2)
                   for k, v in ms.items() if k.startswith("push_") and k != "push_full_16k"}
        out.append({"section": "push", "shape": name, "hidden": width, "bytes": nbytes, "ms": ms,
                    "gb_per_s_per_cta": per_cta})
        print(name, {k: round(v, 4) for k, v in ms.items()}, per_cta, flush=True)
    return out


def waiters_rows(rounds: int) -> list[dict]:
    """Each kernel alone and with 1 or 2 one-CTA spin kernels resident beside it on other streams
    (torch.cuda._sleep, standing in for a symmetric-memory signal wait, a spinning <<<1, 32>>> kernel): what one
    micro-batch's wait for its rows costs the other micro-batch's kernels on two streams."""
    import torch
    import torch.nn.functional as F

    sleepers = [torch.cuda.Stream() for _ in range(2)]
    x_grouped = torch.randn(65536, 2048, device="cuda", dtype=torch.bfloat16)  # fine fc1 at EP=2: 32 experts
    w_grouped = torch.randn(32, 2048, 2048, device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(1, 33, device="cuda", dtype=torch.int32) * 2048
    a, b = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16), torch.randn(
        2048, 6144, device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(2, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kernels = {"grouped_fc1": lambda: torch._grouped_mm(x_grouped, w_grouped, offs=offsets),
               "mm_16384x2048x6144": lambda: torch.mm(a, b),
               "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    alone = timed(kernels, rounds, reps=3)
    fns = {}
    for name, fn in kernels.items():
        cycles = int(alone[name] * 3 * 1.5 * 2.0e6)  # past the three timed calls at up to 2 GHz

        def beside(fn=fn, n=0, cycles=cycles) -> None:
            for stream in sleepers[:n]:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(cycles)
            for _ in range(3):
                fn()

        for n in (0, 1, 2):
            fns[f"{name}+{n}_spinning"] = lambda beside=beside, n=n: beside(n=n)
    # the device drained before each timing (round_robin): no spin kernel outlives its variant's
    ms = {k: val / 3 for k, val in round_robin(fns, rounds, 2, torch.device("cuda")).items()}
    print("waiters", {k: round(val, 4) for k, val in ms.items()}, flush=True)
    return [{"section": "waiters", "ms": ms,
             "slowdown": {k: ms[k] / ms[k.rsplit("+", 1)[0] + "+0_spinning"] for k in ms}}]


def swiglu_fp8_rows(rounds: int) -> list[dict]:
    import torch

    from moe_overlap.kernels import swiglu as S
    from moe_overlap.kernels.fp8_blockwise import quantize_tiles
    from moe_overlap.kernels.fp8_quant import quantize_rows

    out = []
    for name, (rows, ffn) in {"mixtral": (8192, 14336), "fine": (65536, 1024)}.items():
        h = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16) * 3
        fns = {"fused_fp8": lambda: S.swiglu_forward_fp8(h),
               "fused_fp8_two_pass": lambda: S.swiglu_forward_fp8(h, one_block=False),  # before 2026-11-28 afternoon
               "swiglu_then_quantize_rows": lambda: quantize_rows(S.swiglu_forward(h)),
               "swiglu_bf16_alone": lambda: S.swiglu_forward(h)}
        for per_sm in (2, 4, 16, 32):
            fns[f"fused_fp8_{per_sm}_per_sm"] = lambda per_sm=per_sm: S.swiglu_forward_fp8(h, programs_per_sm=per_sm)
        grad_a = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
        fns["bwd_fused_fp8"] = lambda: S.swiglu_backward_fp8(h, grad_a)
        fns["bwd_fused_fp8_two_pass"] = lambda: S.swiglu_backward_fp8(h, grad_a, one_block=False)  # before 11-28 late
        fns["bwd_then_quantize_rows"] = lambda: quantize_rows(S.swiglu_backward(h, grad_a)[0])
        fns["bwd_bf16_alone"] = lambda: S.swiglu_backward(h, grad_a)
        for per_sm in (2, 8, 32):
            fns[f"bwd_fused_fp8_{per_sm}_per_sm"] = (
                lambda per_sm=per_sm: S.swiglu_backward_fp8(h, grad_a, programs_per_sm=per_sm))
        # the blockwise recipe's: per 1x128 tile, fused and then quantize_tiles (what its GEMMs did before)
        fns["fused_fp8_tiles"] = lambda: S.swiglu_forward_fp8(h, tiles=True)
        fns["swiglu_then_quantize_tiles"] = lambda: quantize_tiles(S.swiglu_forward(h))
        fns["bwd_fused_fp8_tiles"] = lambda: S.swiglu_backward_fp8(h, grad_a, tiles=True)
        fns["bwd_then_quantize_tiles"] = lambda: quantize_tiles(S.swiglu_backward(h, grad_a)[0])
        q, scale = fns["fused_fp8"]()
        q_want, scale_want = fns["swiglu_then_quantize_rows"]()
        q_bwd, scale_bwd = fns["bwd_fused_fp8"]()[2:]
        q_bwd_want, scale_bwd_want = fns["bwd_then_quantize_rows"]()
        same = bool(torch.equal(scale, scale_want) and torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))
                    and torch.equal(scale_bwd, scale_bwd_want)
                    and torch.equal(q_bwd.view(torch.uint8), q_bwd_want.view(torch.uint8)))
        ms = timed(fns, rounds, reps=5)
        out.append({"section": "swiglu_fp8", "shape": name, "rows": rows, "ffn": ffn, "ms": ms,
                    "bit_for_bit": same})
        print(name, {k: round(v, 4) for k, v in ms.items()}, "bit for bit" if same else "DIFFERS", flush=True)
    return out


def fp8_row_tiles_rows(rounds: int) -> list[dict]:
    """The FP8 SwiGLU kernels' tiles (rows a program at a time, warps, programs per SM) at the fine-grained model's
    shapes (its experts' 65,536 rows and its shared expert's 8,192, ffn 1,024), each against one row a program at
    8 warps (the default before 2026-11-28 night), whose bytes every tile must give (checked bit for bit). Timed
    from CUDA graphs (:func:`timed_graphed`). (At 54342dd this section also swept quantize_rows' tiles: every tile
    within 1% of one row a program, at HBM speed, so that kernel kept its one path:
    step_kernels_fp8_row_tiles_graphed_1xh200.json.)"""
    import torch

    from moe_overlap.kernels import swiglu as S

    def same(got, want) -> bool:
        return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn
                   else torch.equal(a, b) for a, b in zip(got, want))

    out = []
    for name, (rows, ffn) in {"fine_experts": (65536, 1024), "fine_shared": (8192, 1024)}.items():
        h = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16) * 3
        grad_a = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
        fns = {}
        for tile in ((1, 8), (1, 4), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8)):
            for per_sm in (None, 4, 8):
                label = f"{tile[0]}x{tile[1]}_{per_sm or 'auto'}"
                fns[f"fwd_{label}"] = lambda t=tile, p=per_sm: S.swiglu_forward_fp8(h, programs_per_sm=p, tile=t)
                fns[f"bwd_{label}"] = lambda t=tile, p=per_sm: S.swiglu_backward_fp8(h, grad_a, programs_per_sm=p,
                                                                                     tile=t)
        fns["fwd_bf16_alone"], fns["bwd_bf16_alone"] = lambda: S.swiglu_forward(h), lambda: S.swiglu_backward(h, grad_a)
        want_fwd, want_bwd = fns["fwd_1x8_auto"](), fns["bwd_1x8_auto"]()
        checked = {n: same(fn(), want_fwd if n.startswith("fwd") else want_bwd) for n, fn in fns.items()
                   if "bf16" not in n}
        ms = timed_graphed(fns, rounds)
        out.append({"section": "fp8_row_tiles", "kernel": "swiglu_fp8", "shape": name, "rows": rows, "ffn": ffn,
                    "ms": ms, "bit_for_bit": checked})
        print("swiglu_fp8", name, {n: round(v, 4) for n, v in ms.items()},
              "all bit for bit" if all(checked.values()) else f"DIFFERS {checked}", flush=True)
    return out


def permute_fp8_rows(rounds: int) -> list[dict]:
    """The permutation around rowwise FP8 experts at one EP rank, at the fine-grained shape (8,192 tokens, hidden
    2,048, top-8 of 64: 65,536 rows) and the Mixtral-like one (8,192 tokens, hidden 4,096, top-2 of 8): the forward's
    permute and the backward's unpermute_backward writing the rows' FP8 copies in the same pass (``fp8_out``) against
    each then quantize_rows over the rows written (what the expert GEMMs did), and each alone (bf16)."""
    import torch

    from moe_overlap.kernels import copy_rows as CR
    from moe_overlap.kernels import permute as P
    from moe_overlap.kernels.fp8_quant import quantize_rows

    out = []
    for name, (tokens, hidden, topk, experts) in {"fine": (8192, 2048, 8, 64), "mixtral": (8192, 4096, 2, 8)}.items():
        chosen = torch.rand(tokens, experts, device="cuda").topk(topk, dim=1).indices
        rows_TK = CR.copy_rows(chosen, experts)[0]
        num_rows = tokens * topk
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) * 3
        probs = torch.rand(tokens, topk, device="cuda")
        fwd, bwd = P.fp8_buffers(num_rows, hidden, x.device), P.fp8_buffers(num_rows, hidden, x.device)
        fns = {"permute_fp8_out": lambda: P.permute(x, rows_TK, num_rows, True, fp8_out=fwd),
               "permute_then_quantize_rows": lambda: quantize_rows(P.permute(x, rows_TK, num_rows, True)),
               "permute_bf16_alone": lambda: P.permute(x, rows_TK, num_rows, True),
               "bwd_fp8_out": lambda: P.unpermute_backward(x, None, rows_TK, probs, True, num_rows=num_rows,
                                                           fp8_out=bwd),
               "bwd_then_quantize_rows": lambda: quantize_rows(
                   P.unpermute_backward(x, None, rows_TK, probs, True, num_rows=num_rows)[0]),
               "bwd_bf16_alone": lambda: P.unpermute_backward(x, None, rows_TK, probs, True, num_rows=num_rows)}
        fns["permute_fp8_out"]()
        fns["bwd_fp8_out"]()
        same = all(torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(scale, scale_want)
                   for (q, scale), (q_want, scale_want) in ((fwd, fns["permute_then_quantize_rows"]()),
                                                             (bwd, fns["bwd_then_quantize_rows"]())))
        ms = timed(fns, rounds, reps=5)
        out.append({"section": "permute_fp8", "shape": name, "tokens": tokens, "hidden": hidden, "topk": topk,
                    "experts": experts, "ms": ms, "bit_for_bit": same})
        print(name, {k: round(v, 4) for k, v in ms.items()}, "bit for bit" if same else "DIFFERS", flush=True)
    return out


def router_logits_rows(rounds: int) -> list[dict]:
    """The router's logits forward + backward at the bench models' shapes (8,192 tokens; the fine model's hidden
    2,048 and 64 experts, the Mixtral-like's 4,096 and 8): bf16 tokens and weight on the tensor cores
    (layers/router.Bf16Logits) against the fp32 GEMMs of the values cast up (the path before)."""
    import torch
    import torch.nn.functional as F

    from moe_overlap.layers.router import Bf16Logits

    out = []
    for name, (tokens, hidden, experts) in {"fine": (8192, 2048, 64), "mixtral": (8192, 4096, 8)}.items():
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(experts, hidden, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
        grad = torch.randn(tokens, experts, device="cuda") * 1e-4

        def run(logits_of):
            x.grad = w.grad = None
            logits_of().backward(grad)

        fns = {"bf16_tensor_cores": lambda: run(lambda: Bf16Logits.apply(x, w)),
               "fp32_cast_up": lambda: run(lambda: F.linear(x.float(), w.float()))}
        ms = timed(fns, rounds, reps=10)
        out.append({"section": "router_logits", "shape": name, "tokens": tokens, "hidden": hidden,
                    "experts": experts, "ms": ms})
        print(name, {k: round(v, 4) for k, v in ms.items()}, flush=True)
    return out


def weight_fp8_rows(rounds: int) -> list[dict]:
    """Per expert weight (E, M, K) bf16: its rows and columns FP8 copies made by the two kernels one after the
    other, and by the one function that makes both, each into the same preallocated copies (as the weight cache
    refreshes them); each kernel alone beside them."""
    import torch

    from moe_overlap.kernels.fp8_quant import quantize_columns, quantize_rows, quantize_rows_and_columns

    out = []
    for name, (experts, m, k) in WEIGHT_FP8_SHAPES.items():
        w = torch.randn(experts, m, k, device="cuda", dtype=torch.bfloat16) * 0.02
        rows_copy, columns_copy = quantize_rows(w), quantize_columns(w)
        fns = {"rows_then_columns": lambda: (quantize_rows(w, *rows_copy), quantize_columns(w, *columns_copy)),
               "rows_and_columns": lambda: quantize_rows_and_columns(w, rows_copy, columns_copy),
               "rows_alone": lambda: quantize_rows(w, *rows_copy),
               "columns_alone": lambda: quantize_columns(w, *columns_copy)}
        rows_want, columns_want = quantize_rows(w), quantize_columns(w)
        quantize_rows_and_columns(w, rows_copy, columns_copy)
        same = all(torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                   for got, want in ((rows_copy, rows_want), (columns_copy, columns_want)))
        ms = timed(fns, rounds, reps=3)
        elements = experts * m * k
        moved = {"rows_alone": 3 * elements + 4 * experts * m, "columns_alone": 3 * elements + 4 * experts * k}
        moved["rows_then_columns"] = moved["rows_and_columns"] = 4 * elements + 4 * experts * (m + k)
        out.append({"section": "weight_fp8", "shape": name, "experts": experts, "m": m, "k": k, "ms": ms,
                    "bytes": moved, "gb_per_s": {key: moved[key] / v / 1e6 for key, v in ms.items()},
                    "bit_for_bit": same})
        print(name, {key: round(v, 3) for key, v in ms.items()}, "bit for bit" if same else "DIFFERS", flush=True)
    return out


def fp8_param_rows(rounds: int) -> list[dict]:
    """What an optimizer step and the refresh of a weight's two rowwise FP8 copies cost per weight, kept apart from
    the bf16 weight (the flat AdamW writing the bf16 copy, then quantize_rows_and_columns' two passes over it)
    against held in it (train.fp8_param: the tiled AdamW leaving the row and column maxima, per tile and strip
    config, each checked against torch's maxima; then the second pass alone over the fp32 master; and that pass's
    two over the master without the maxima); the flat step without a copy is the bytes' floor."""
    import torch

    from moe_overlap.kernels.adamw import AdamWHyper, WeightMaxima, adamw_maxima_triton, adamw_update_triton
    from moe_overlap.kernels.fp8_quant import quantize_rows_and_columns

    hyper = AdamWHyper(1e-6, 0.9, 0.95, 1e-8, 0.1)
    control = torch.tensor([1.0, 3.0, 1.0], device="cuda")

    def one_weight(name: str) -> dict:  # its tensors freed on return
        experts, m, k = WEIGHT_FP8_SHAPES[name]
        master, grad, exp_avg = (torch.randn(experts, m, k, device="cuda") * 0.02 for _ in range(3))
        exp_avg_sq = torch.rand(experts, m, k, device="cuda") * 1e-4
        bf16 = master.to(torch.bfloat16)
        rows, cols = quantize_rows_and_columns(bf16)
        maxima = WeightMaxima(torch.zeros(experts * m, device="cuda"), torch.zeros(experts * k, device="cuda"),
                              torch.bfloat16)
        amax = (maxima.rows_BM.view(experts, m), maxima.columns_BK.view(experts, k))
        fns = {"kept_adamw": lambda: adamw_update_triton(master, grad, exp_avg, exp_avg_sq, bf16, control, hyper),
               "kept_refresh": lambda: quantize_rows_and_columns(bf16, rows, cols),
               "held_refresh": lambda: quantize_rows_and_columns(master, rows, cols, as_dtype=torch.bfloat16,
                                                                 amax=amax),
               "held_refresh_two_passes": lambda: quantize_rows_and_columns(master, rows, cols,
                                                                            as_dtype=torch.bfloat16)}
        fns["flat_no_copy"] = lambda: adamw_update_triton(master, grad, exp_avg, exp_avg_sq, None, control, hyper)
        for blocks, warps, per_sm in (  # (BLOCK_M, BLOCK_K, SPAN_M): a tile, and the rows of a program's strip
                ((4, 1024, 4), 4, 8), ((8, 512, 64), 4, 8), ((4, 1024, 4), 8, 4), ((8, 512, 8), 8, 4),
                ((8, 512, 64), 8, 4), ((4, 512, 64), 8, 4), ((2, 1024, 64), 8, 4), ((2, 512, 64), 4, 8),
                ((1, 1024, 16), 8, 4), ((1, 1024, 32), 8, 4), ((1, 1024, 64), 8, 4), ((1, 1024, 128), 8, 4),
                ((1, 1024, 64), 8, 8), ((1, 1024, 64), 4, 8), ((1, 2048, 64), 8, 4), ((1, 512, 64), 4, 8),
                ((2, 1024, 32), 8, 4), ((1, 1024, 32), 4, 8)):
            fns["held_adamw_{}x{}x{}_{}w_{}".format(*blocks, warps, per_sm)] = (
                lambda blocks=blocks, warps=warps, per_sm=per_sm: adamw_maxima_triton(
                    master, grad, exp_avg, exp_avg_sq, control, hyper, maxima, blocks, warps, per_sm))
        fns["held_adamw_default"] = lambda: adamw_maxima_triton(master, grad, exp_avg, exp_avg_sq, control, hyper,
                                                                maxima)
        exact = {}
        for key, fn in fns.items():  # each strip config's maxima against torch's of the master it leaves
            if key.startswith("held_adamw"):
                fn()
                weights = master.to(torch.bfloat16).float().abs()
                exact[key] = bool(torch.equal(maxima.rows_BM, weights.amax(-1).reshape(-1))
                                  and torch.equal(maxima.columns_BK, weights.amax(-2).reshape(-1)))
        ms = timed(fns, rounds, reps=2)
        ms["kept_total"] = ms["kept_adamw"] + ms["kept_refresh"]
        ms["held_total_default"] = ms["held_adamw_default"] + ms["held_refresh"]
        ms["held_total_unfused"] = ms["flat_no_copy"] + ms["held_refresh_two_passes"]  # no maxima from the step
        print(name, {key: round(v, 3) for key, v in ms.items()}, "maxima exact" if all(exact.values()) else
              f"maxima DIFFER: {[key for key, ok in exact.items() if not ok]}", flush=True)
        return {"section": "fp8_param", "shape": name, "experts": experts, "m": m, "k": k, "ms": ms,
                "maxima_exact": exact}

    out = []
    for name in ("fine", "fine_w2", "mixtral_w13", "mixtral_w2"):
        out.append(one_weight(name))
        torch.cuda.empty_cache()
    return out


def fp8_tokens_rows(rounds: int) -> list[dict]:
    """The FP8 weight gradient's operands quantized along the tokens per group (the rowwise recipe): the one-launch
    kernel at 16-128 columns a program against the two launches over the chunks (the kernel before), and per chunk
    (one read: the floor); every operand of an expert layer's two weight gradients, ms for the four, and GB/s for
    one read of the rows and the FP8 write."""
    import torch

    from moe_overlap.kernels import fp8_wgrad as W

    out = []
    for name, (experts, per_expert, widths) in TOKEN_QUANTIZE_SHAPES.items():
        offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * per_expert
        operands = [torch.randn(experts * per_expert, m, device="cuda", dtype=torch.bfloat16) for m in widths]

        def each(per_chunk: bool, columns: int, one_pass: bool):
            return lambda: [W.quantize_along_tokens(x, offsets, per_chunk, columns, one_pass) for x in operands]

        fns = {"two_launches_c64": each(False, 64, False)}
        for columns in (16, 32, 64, 128):
            fns[f"one_pass_c{columns}"] = each(False, columns, True)
        fns["per_chunk_c64"] = each(True, 64, True)
        want = fns["two_launches_c64"]()
        same = {}
        for key in fns:
            if key.startswith("one_pass"):
                got = fns[key]()
                same[key] = all(torch.equal(g.scale_CM[:int(w.chunk_ends_E[-1])], w.scale_CM[:int(w.chunk_ends_E[-1])])
                                and torch.equal(g.q_MP[:, :int(w.chunk_ends_E[-1]) * 128].view(torch.uint8),
                                                w.q_MP[:, :int(w.chunk_ends_E[-1]) * 128].view(torch.uint8))
                                for g, w in zip(got, want))
        ms = timed(fns, rounds, reps=5)
        nbytes = sum(x.numel() * 3 for x in operands)  # one bf16 read and one E4M3 write
        out.append({"section": "fp8_tokens", "shape": name, "experts": experts, "rows_per_expert": per_expert,
                    "widths": list(widths), "ms": ms, "gb_per_s": {k: nbytes / v / 1e6 for k, v in ms.items()},
                    "bit_equal_to_two_launches": same})
        print(name, {k: round(v, 3) for k, v in ms.items()}, same, flush=True)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sections", default="wgrad,adamw,attention,rows",
                        help="comma-separated, of wgrad, adamw, attention, rows, push, waiters, swiglu_fp8, "
                             "permute_fp8, fp8_row_tiles, weight_fp8, router_logits, "
                             "fp8_tokens, fp8_param, fp8_blockwise, fp8_wgrad")
    parser.add_argument("--shapes", default=",".join(WGRAD_SHAPES), help="wgrad, fp8_blockwise, fp8_wgrad shapes")
    parser.add_argument("--rows", default=None,
                        help="fp8_wgrad: rows per expert, comma-separated (default: the shape's)")
    parser.add_argument("--segments", type=int, choices=(1, 2, 4), default=1,
                        help="fp8_wgrad: the rows per expert in that many micro-batches' segments, as "
                             "train.expert_wgrad_micro_batches sums them")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    rows = (wgrad_rows(args.rounds, args.shapes.split(",")) if "wgrad" in sections else []) + (
        adamw_rows(args.rounds) if "adamw" in sections else []) + (
        attention_rows(args.rounds) if "attention" in sections else []) + (
        row_kernel_rows(args.rounds) if "rows" in sections else []) + (
        push_rows_rows(args.rounds) if "push" in sections else []) + (
        waiters_rows(args.rounds) if "waiters" in sections else []) + (
        swiglu_fp8_rows(args.rounds) if "swiglu_fp8" in sections else []) + (
        permute_fp8_rows(args.rounds) if "permute_fp8" in sections else []) + (
        fp8_row_tiles_rows(args.rounds) if "fp8_row_tiles" in sections else []) + (
        weight_fp8_rows(args.rounds) if "weight_fp8" in sections else []) + (
        router_logits_rows(args.rounds) if "router_logits" in sections else []) + (
        fp8_tokens_rows(args.rounds) if "fp8_tokens" in sections else []) + (
        fp8_param_rows(args.rounds) if "fp8_param" in sections else []) + (
        fp8_blockwise_rows(args.rounds, args.shapes.split(",")) if "fp8_blockwise" in sections else []) + (
        fp8_wgrad_rows(args.rounds, args.shapes.split(","), args.rows and [int(r) for r in args.rows.split(",")],
                       args.segments)
        if "fp8_wgrad" in sections else [])
    write_json(args.json, run_header(1), rows)


if __name__ == "__main__":
    main()
