"""What an overflowing MoE layer call costs with the in-graph overflow chunk (``overlap.moe_overflow_capacity_factor``)
against the same call unbounded, and against the re-run it replaces: one MoE layer's forward+backward, device-planned
over SM pushes and replayed from CUDA graphs as training runs it, round-robin in one run.

    torchrun --nproc-per-node 1 benchmarks/overflow_chunk.py --shape fine --chunks 4 --json out.json
    torchrun --nproc-per-node 4 benchmarks/overflow_chunk.py ...   # EP=4

At EP=1 the pipeline runs over the one-rank group (its rows pushed into its own memory), so a chunk of local experts
overflows its bound (``--factor`` x its balanced share) when the routing leans on its experts. Routing: ``skew``, a
router that prefers the first chunk's experts (so that its bound overflows), and ``balanced``, every chunk its
balanced share exactly (model.moe_router_force_load_balancing: nothing overflows). Variants, per routing:
  unbounded        the worst-case bound (null): nothing overflows, the reference
  overflow_chunk   the bound and the overflow chunk (``--overflow`` x T x k rows), which takes the rows past it
  bounded          the bound without an overflow chunk: an overflowing call's attempt (its result is wrong)
  host, host_fwd   the host-planned eager call, and its forward alone: what the re-run adds per layer (the re-run
                   recomputes, so one more forward)
Each row gives the ratios ``overflow_chunk / unbounded`` and, for skew, the re-run's
``(bounded + host + host_fwd) / unbounded``; the rows past the bounds (``overflow_rows``, ``rerun_rows``) of one
call; and, for skew, how far the overflow chunk's output and input gradient are from the unbounded call's (bf16: the
same rows meet the same weights; only the grouped GEMMs' row groups differ). ``--profile N``: each row also lists
the GPU kernels of N calls of the unbounded, overflow_chunk and bounded variants (ms per call, from torch.profiler),
to see what the overflow chunk adds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import kernel_times, run_header, set_run_env, write_json  # noqa: E402
from benchmarks.moe_layer import SHAPES, Bench  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="fine", choices=sorted(SHAPES))
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--factor", type=float, default=1.0, help="overlap.moe_expert_rank_capacity_factor")
    parser.add_argument("--overflow", type=float, default=1.0, help="overlap.moe_overflow_capacity_factor")
    parser.add_argument("--once-per-rank", action="store_true",
                        help="overlap.moe_dispatch_once_per_rank (wire rows) in every variant")
    parser.add_argument("--skew", type=float, default=0.05, help="router weight added to the first chunk's experts")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, help="calls per variant under torch.profiler (0: none)")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    set_run_env()
    import torch.distributed as dist

    bench = Bench.launched(argparse.Namespace(rounds=args.rounds, warmup=args.warmup, fabric="nvlink"))
    rows = [run_routing(bench, args, routing) for routing in ("skew", "balanced")]
    if dist.get_rank() == 0:
        write_json(args.json, run_header(bench.mesh.world_size), rows)
        for row in rows:
            print({k: v for k, v in row.items() if not isinstance(v, dict)})
    bench.mesh.destroy()
    dist.destroy_process_group()


def run_routing(bench: Bench, args, routing: str) -> dict:
    import torch

    from moe_overlap.config import ModelConfig, OverlapConfig
    from moe_overlap.layers.init import init_parameters
    from moe_overlap.layers.moe import MoELayer, capture_moe_layers
    from moe_overlap.layers.param_info import param_info
    from moe_overlap.layers.wgrad import take_grad

    shape, mesh, device = SHAPES[args.shape], bench.mesh, bench.device
    local = shape.experts // mesh.ep.size
    chunks = min(args.chunks, local - 1)  # the overflow chunk takes one more of the regions' data channels
    transport = "sm_push" if device.type == "cuda" else "gloo"
    selector = bench.selector("device", transport, local)
    host_selector = bench.selector("host", "nccl" if device.type == "cuda" else "gloo", local)
    x = torch.randn(shape.tokens, shape.hidden, device=device, dtype=bench.dtype,
                    generator=torch.Generator(device=device).manual_seed(100 + mesh.rank)).unsqueeze(0)
    grad = torch.randn_like(x)

    def layer(factor: float | None, overflow: float | None, planning: str = "device", graphed: bool = True):
        cfg = ModelConfig(hidden_size=shape.hidden, ffn_hidden_size=shape.ffn, num_moe_experts=shape.experts,
                          moe_router_topk=shape.topk, moe_aux_loss_coeff=0.0,
                          moe_router_force_load_balancing=routing == "balanced")
        overlap = OverlapConfig(moe_pipeline=True, moe_pipeline_chunks=chunks, moe_planning=planning,
                                moe_dispatch_once_per_rank=args.once_per_rank, delay_wgrad_compute=False,
                                moe_expert_rank_capacity_factor=factor, moe_overflow_capacity_factor=overflow)
        made = MoELayer(cfg, overlap, mesh.ep, selector if planning == "device" else host_selector, device,
                        bench.dtype)
        made.local = False  # EP=1: the pipeline over the one-rank group
        init_parameters(made, seed=1234, std=0.02, num_layers=1)
        if routing == "skew":
            with torch.no_grad():  # a router that prefers the first chunk's experts
                made.router.weight[:local // chunks] += args.skew
        for param in made.parameters():  # as the optimizer attaches them: weight gradients land as in training
            param_info(param).main_grad = torch.zeros_like(param, dtype=torch.float32)
            param.register_post_accumulate_grad_hook(take_grad)
        if graphed and device.type == "cuda":
            capture_moe_layers((made,), tuple(x.shape))
        return made

    layers = {"unbounded": layer(None, None), "overflow_chunk": layer(args.factor, args.overflow),
              "bounded": layer(args.factor, None), "host": layer(None, None, "host", graphed=False)}

    def call(made, backward: bool = True):
        def fn():
            made.zero_grad(set_to_none=True)
            x_in = x.detach().requires_grad_(True)
            out, _, _ = made(x_in)
            if backward:
                out.backward(grad)
            return out, x_in.grad
        return fn

    counts = {}
    for name in ("unbounded", "overflow_chunk", "bounded"):  # one call each: the rows past the bounds
        selector.zero_counters()
        call(layers[name])()
        overflow, unplaced, _ = selector.counters()
        counts[name] = {"overflow_rows": int(overflow), "rerun_rows": int(unplaced)}
    variants = {name: call(made) for name, made in layers.items()}
    variants["host_fwd"] = call(layers["host"], backward=False)
    ms = bench.round_robin(variants)
    row = {"shape": args.shape, "routing": routing, "ep": mesh.ep.size, "chunks": chunks,
           "once_per_rank": args.once_per_rank, "factor": args.factor,
           "overflow_factor": args.overflow, "ms": {k: round(v, 4) for k, v in ms.items()}, "rows": counts,
           "overflow_chunk_vs_unbounded": ms["overflow_chunk"] / ms["unbounded"],
           "rerun_vs_unbounded": (ms["bounded"] + ms["host"] + ms["host_fwd"]) / ms["unbounded"]}
    if args.profile and device.type == "cuda":
        row["kernels_ms"] = {}
        for name in ("unbounded", "overflow_chunk", "bounded"):
            kernels = kernel_times(variants[name], args.profile)
            row["kernels_ms"][name] = {"total": round(sum(ms for ms, _ in kernels.values()), 4),
                                       **{key[:100]: round(ms, 4) for key, (ms, _) in kernels.items()}}
    if routing == "skew":
        (want, want_grad), (got, got_grad) = call(layers["unbounded"])(), call(layers["overflow_chunk"])()
        row["rel_err_out"] = float((got - want).detach().float().norm() / want.detach().float().norm())
        row["rel_err_grad_x"] = float((got_grad - want_grad).float().norm() / want_grad.float().norm())
    return row


if __name__ == "__main__":
    main()
