"""The FP8 recipes' GEMMs against bf16 on one GPU (train.fp8_recipe), round-robin in one run:

    python benchmarks/fp8_gemm.py --check          # writes benchmarks/results/fp8_gemm_<gpu>.json

Rows: the experts' grouped GEMMs forward+backward (fc1, SwiGLU, fc2; dgrad; wgrad into the fp32 main_grad the
parameters carry, as in training) on the mixtral and fine shapes of benchmarks/moe_layer.py at EP=1 (tokens x
top-k rows spread evenly over the experts), and one dense linear (column-parallel at TP=1: forward, dgrad, wgrad
into main_grad). Variants, milliseconds (median of the rounds):
  bf16         today's path
  fp8          the FP8 path as a micro-batch runs it in training: activations quantized (the Triton kernels are
               in the time), the weights' FP8 copies already made this step
  fp8_requant  the same with the weights quantized again every call (their once-per-step cost on every call:
               the bound for one micro-batch per step)
  fp8_fast_grads  fp8 with the dgrad GEMMs in fast accumulation too (train.fp8_dgrad_accumulation=fast)
  fp8_defaults  rowwise as the config's defaults run these shapes: fast dgrads, the weight gradients in bf16
               (train.fp8_wgrad=auto below 2,048 rows per expert a call)
  blockwise    train.fp8_recipe=blockwise as a micro-batch runs it (1x128 activation tiles quantized per call, the
               128x128 weight blocks made this step; the Triton blockwise GEMM)
  fp8_bf16_wgrad, blockwise_bf16_wgrad  the same with train.fp8_wgrad=false: the weight gradients in bf16
``ratio`` is bf16 / fp8 (> 1: FP8 faster), ``ratio_defaults`` bf16 / fp8_defaults, ``ratio_blockwise`` bf16 /
blockwise. In both recipes the forward, dgrad
and (train.fp8_wgrad, the default) wgrad GEMMs run in FP8 (kernels/fp8_wgrad.py for the wgrad).
``--check``: each recipe's outputs, input gradients and main_grads against bf16's, normwise (each under 0.1, or
exit 1).
``--profile PATH``: after the timing, each case's bf16, fp8 and blockwise variants under torch.profiler, the GPU
kernels' time per call (where the FP8 path's time goes: its GEMMs, the quantize kernels, the rest), written to PATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import kernel_times, round_robin, run_header, set_run_env, write_json  # noqa: E402
from benchmarks.moe_layer import SHAPES  # noqa: E402
from moe_overlap.distributed.ring import TPComm  # noqa: E402
from moe_overlap.layers.experts import GroupedExperts, expert_offsets  # noqa: E402
from moe_overlap.layers.fp8 import Fp8, weights_updated  # noqa: E402
from moe_overlap.layers.param_info import param_info  # noqa: E402
from moe_overlap.layers.tp_linear import ColumnParallelLinear  # noqa: E402
from moe_overlap.layers.wgrad import take_grad  # noqa: E402

DENSE = (8192, 4096, 14336)  # rows, in, out: a Mixtral-sized fc1 at TP=1
CHECK_TOL = 0.1
BLOCKWISE = Fp8(recipe="blockwise")
BF16_WGRAD = {"fp8": Fp8(wgrad=False), "blockwise": Fp8(recipe="blockwise", wgrad=False)}  # train.fp8_wgrad=false


def with_main_grads(module: torch.nn.Module) -> torch.nn.Module:
    """Parameters as the optimizer leaves them: an fp32 main_grad each, the hook that drops the placeholder."""
    for param in module.parameters():
        param_info(param).main_grad = torch.zeros_like(param, dtype=torch.float32)
        param.register_post_accumulate_grad_hook(take_grad)
    return module


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


class Case:
    """One module, its input and output gradient; ``step(fp8)`` runs forward+backward with that recipe."""

    def __init__(self, module: torch.nn.Module, call, x: torch.Tensor, grad: torch.Tensor):
        self.module, self.call, self.x, self.grad = module, call, x, grad

    def step(self, fp8: Fp8 | None, requantize: bool = False):
        for m in self.module.modules():
            if hasattr(m, "fp8"):
                m.fp8 = fp8
        if requantize:
            weights_updated()
        x = self.x.detach().requires_grad_()
        out = self.call(x)
        out.backward(self.grad)
        return out, x.grad

    def variants(self) -> dict:
        return {"bf16": lambda: self.step(None), "fp8": lambda: self.step(Fp8()),
                "fp8_requant": lambda: self.step(Fp8(), requantize=True),
                "fp8_fast_grads": lambda: self.step(Fp8(fast_dgrad=True)),
                "fp8_defaults": lambda: self.step(Fp8(fast_dgrad=True, wgrad=False)),
                "blockwise": lambda: self.step(BLOCKWISE),
                "fp8_bf16_wgrad": lambda: self.step(BF16_WGRAD["fp8"]),
                "blockwise_bf16_wgrad": lambda: self.step(BF16_WGRAD["blockwise"])}

    def check(self) -> dict[str, float]:
        """Each recipe against bf16: output, input gradient and each main_grad (one forward+backward each, from
        zero)."""
        results = {}
        recipes = {"fp8": Fp8(), "blockwise": BLOCKWISE, **{f"{k}_bf16_wgrad": v for k, v in BF16_WGRAD.items()}}
        for name, fp8 in (("bf16", None), *recipes.items()):
            for param in self.module.parameters():
                param_info(param).main_grad.zero_()
            out, grad_x = self.step(fp8)
            results[name] = [out, grad_x] + [param_info(p).main_grad.clone() for p in self.module.parameters()]
        names = ["out", "grad_x"] + [name for name, _ in self.module.named_parameters()]
        return {f"{recipe}_{name}": rel(got, want) for recipe in recipes
                for name, got, want in zip(names, results[recipe], results["bf16"])}


def expert_case(shape, device) -> Case:
    experts = with_main_grads(GroupedExperts(shape.experts, 0, shape.hidden, shape.ffn, device, torch.bfloat16))
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.02)
    rows = shape.tokens * shape.topk
    offsets = expert_offsets(torch.full((shape.experts,), rows // shape.experts, device=device))
    x = torch.randn(rows, shape.hidden, device=device, dtype=torch.bfloat16)
    grad = torch.randn(rows, shape.hidden, device=device, dtype=torch.bfloat16) * 1e-3
    return Case(experts, lambda x: experts(x, offsets), x, grad)


def dense_case(device) -> Case:
    rows, d_in, d_out = DENSE
    linear = with_main_grads(ColumnParallelLinear(d_in, d_out, TPComm.single(), device=device, dtype=torch.bfloat16))
    with torch.no_grad():
        linear.weight.normal_(0, 0.02)
    x = torch.randn(rows, d_in, device=device, dtype=torch.bfloat16)
    grad = torch.randn(rows, d_out, device=device, dtype=torch.bfloat16) * 1e-3
    return Case(linear, linear, x, grad)


def kernel_tables(name: str, case: Case, calls: int) -> str:
    """The bf16, fp8 and blockwise variants' GPU kernels, ``calls`` calls each under torch.profiler: time per call."""
    tables = []
    for variant in ("bf16", "fp8", "blockwise"):
        kernels = [(key, ms, count) for key, (ms, count) in kernel_times(case.variants()[variant], calls).items()]
        lines = [f"{name} {variant}: {sum(ms for _, ms, _ in kernels):.3f} ms of kernels per call"]
        lines += [f"  {ms:8.3f} ms  x{count:<3d} {key[:110]}" for key, ms, count in kernels[:25]]
        tables.append("\n".join(lines))
    text = "\n".join(tables)
    print(text, flush=True)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="mixtral,fine", help=f"of benchmarks/moe_layer.py: {','.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", default=None, help="default: benchmarks/results/fp8_gemm_<gpu>.json")
    parser.add_argument("--profile", default=None, metavar="PATH", help="write each variant's kernel times here")
    args = parser.parse_args(argv)
    set_run_env()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm: needs a CUDA GPU with FP8 tensor cores")
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name().lower().replace("nvidia ", "").split()[0]
    path = args.json or str(Path(__file__).parent / "results" / f"fp8_gemm_{gpu}.json")
    cases = {f"experts_{name}": lambda name=name: expert_case(SHAPES[name], device) for name in args.shapes.split(",")}
    cases["dense"] = lambda: dense_case(device)
    rows, failed, profiles = [], False, []
    for name, make in cases.items():
        case = make()
        ms = round_robin(case.variants(), args.rounds, args.warmup, device)
        row = {"case": name, "ms": ms, "ratio": ms["bf16"] / ms["fp8"], "ratio_requant": ms["bf16"] / ms["fp8_requant"],
               "ratio_defaults": ms["bf16"] / ms["fp8_defaults"], "ratio_blockwise": ms["bf16"] / ms["blockwise"]}
        if name == "dense":
            row["shape"] = dict(zip(("rows", "in", "out"), DENSE))
        else:
            row["shape"] = dataclasses.asdict(SHAPES[name.removeprefix("experts_")])
        if args.check:
            row["fp8_vs_bf16"] = errors = case.check()
            failed |= max(errors.values()) > CHECK_TOL
        print(f"{name:16s} " + "  ".join(f"{k} {v:8.3f} ms" for k, v in ms.items())
              + f"  bf16/fp8 {row['ratio']:.2f}x (requant {row['ratio_requant']:.2f}x, defaults "
              f"{row['ratio_defaults']:.2f}x, blockwise "
              f"{row['ratio_blockwise']:.2f}x)"
              + (f"  fp8 vs bf16 {max(row['fp8_vs_bf16'].values()):.3f}" if args.check else ""), flush=True)
        rows.append(row)
        if args.profile:
            profiles.append(kernel_tables(name, case, args.rounds))
        del case
        torch.cuda.empty_cache()
    write_json(path, run_header(1), rows)
    print(f"wrote {path}")
    if args.profile:
        Path(args.profile).write_text("\n\n".join(profiles) + "\n")
        print(f"wrote {args.profile}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
