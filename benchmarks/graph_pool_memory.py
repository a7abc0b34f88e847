"""Where graphed MoE layers' memory goes, with and without the paged stash (``overlap.moe_paged_stash_factor``).

On 2xH200 the paged stash saved no peak memory on the default path (one device-planned chunk, graphed): the
allocator's reserved memory, graph pools included, stayed the same (RESULTS.md, "The paged stash"). This runs the
fine-grained bench model's MoE layers alone at EP=1 with the pipeline forced over the one-rank group (the same
device plan, push kernels and streams as between GPUs; every layer's bound is its own rows), captures them as the
trainer does (one make_graphed_callables call, one pool), and reads, per variant in a fresh process:

  after_capture   allocated / reserved bytes, the graph pool's segments and the bytes still allocated in them
  pool_blocks     the graph pool's largest allocated blocks after capture, each with the call that made it
  step            the peak of a forward over every layer and a backward in reverse (graphs replayed), and its time

    python benchmarks/graph_pool_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_header, set_run_env, write_json  # noqa: E402
from benchmarks.memory_peak import GIB, grouped, where  # noqa: E402


def _pools(snapshot: dict) -> dict:
    """Per memory pool (graph pools by id; (0, 0) the allocator's own): segment bytes, allocated bytes, and the
    largest allocated blocks with where they were made."""
    pools: dict = {}
    for seg in snapshot["segments"]:
        pool = pools.setdefault(str(tuple(seg.get("segment_pool_id", (0, 0)))),
                                {"segment_bytes": 0, "allocated_bytes": 0, "blocks": []})
        pool["segment_bytes"] += seg["total_size"]
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                pool["allocated_bytes"] += block["size"]
                pool["blocks"].append((block["size"], (where(block.get("frames", []), 4),)))
    for pool in pools.values():
        pool["blocks"] = grouped(pool["blocks"])[:12]
    return pools


def run_variant(args, stash_factor: float | None, once: bool) -> dict:
    import torch
    import torch.distributed as dist

    from moe_overlap.config import ModelConfig, OverlapConfig
    from moe_overlap.distributed.a2a import TransportSelector
    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.layers.init import init_parameters
    from moe_overlap.layers.moe import MoELayer, capture_moe_layers
    from moe_overlap.layers.paged_stash import PagedStash, aligned_bytes, page_rows_for
    from moe_overlap.layers.param_info import param_info

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=0, world_size=1)
    mesh = Mesh.single()
    T = args.micro_batch * args.seq
    overlap = OverlapConfig(moe_pipeline=True, moe_dispatch_once_per_rank=once, moe_pipeline_chunks=1,
                            delay_wgrad_compute=True, moe_planning="device", moe_transport="sm_push",
                            gemm_sm_carveout="auto", moe_expert_rank_capacity_factor=None,
                            moe_paged_stash_factor=stash_factor)
    cfg = ModelConfig(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_moe_experts=args.experts,
                      moe_router_topk=args.topk, moe_shared_expert_intermediate_size=args.ffn,
                      moe_shared_expert_overlap=True, moe_router_force_load_balancing=True)
    transports = TransportSelector("device", "sm_push", mesh.ep.group, mesh.ep.ranks, torch.device("cuda"),
                                   args.experts, 60)
    layers = []
    for i in range(args.layers):
        layer = MoELayer(cfg, overlap, mesh.ep, transports, "cuda", torch.bfloat16)
        layer.local = False  # EP=1: the pipeline over the one-rank group
        init_parameters(layer, seed=i, std=0.02, num_layers=args.layers)
        for param in (layer.experts.w13, layer.experts.w2):  # the experts' wgrad adds into main_grad, as trained
            param_info(param).main_grad = torch.zeros_like(param, dtype=torch.float32)
        layers.append(layer)
    stash = None
    if stash_factor is not None:
        rows = T * args.topk
        widths = [args.hidden, 2 * args.ffn] + ([args.hidden] if once else [])
        stash = PagedStash(int(stash_factor * rows * args.layers), args.layers,
                           sum(aligned_bytes(2 * w) for w in widths), torch.device("cuda"), transports.count_overflow,
                           page_rows_for(rows))
        for layer in layers:
            layer.stash = stash
    torch.cuda.synchronize()
    built = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1000)
    capture_moe_layers(tuple(layers), (args.micro_batch, args.seq, args.hidden))
    torch.cuda.synchronize()
    gc.collect()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    row = {"stash_factor": stash_factor, "once_per_rank": once, "built_gib": built / GIB,
           "stash_pool_gib": 0.0 if stash is None else stash.nbytes / GIB,
           "capture_peak_gib": torch.cuda.max_memory_allocated() / GIB,
           "after_capture_allocated_gib": torch.cuda.memory_allocated() / GIB,
           "after_capture_reserved_gib": torch.cuda.memory_reserved() / GIB,
           "pools": _pools(snapshot)}
    if args.snapshot_dir:
        import pickle
        name = f"graph_pool_snapshot_{'wire' if once else 'copies'}_{stash_factor}.pickle"
        with open(os.path.join(args.snapshot_dir, name), "wb") as f:
            pickle.dump(snapshot, f)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.micro_batch, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        if stash is not None:
            stash.reset()
        h = x.clone().requires_grad_(True)
        out = h
        for layer in layers:
            out = layer(out)[0]
        out.float().square().mean().backward()

    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        if i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    row.update(step_peak_gib=torch.cuda.max_memory_allocated() / GIB,
               step_reserved_gib=torch.cuda.memory_reserved() / GIB,
               step_ms=1e3 * sorted(times)[len(times) // 2], overflow_rows=int(transports.counters()[0]))
    dist.destroy_process_group()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", default="none:copies,1.25:copies,none:wire,1.25:wire",
                    help="stash factor (none: unpaged) : copies | wire (each token once per rank), comma-separated")
    ap.add_argument("--snapshot-dir", default=None, help="write each variant's allocator snapshot there")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a variant, in this process
    ap.add_argument("--port", type=int, default=29531, help=argparse.SUPPRESS)
    args = ap.parse_args()
    set_run_env()
    if args.one is not None:
        factor, kind = args.one.split(":")
        row = run_variant(args, None if factor == "none" else float(factor), kind == "wire")
        print("ROW " + json.dumps(row), flush=True)
        return
    rows = []
    for i, variant in enumerate(args.variants.split(",")):  # each in a fresh process: its own allocator
        argv = [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
                if key not in ("json", "one", "port", "variants") and value is not None]
        out = subprocess.run([sys.executable, __file__, *argv, "--one", variant, "--port", str(args.port + i)],
                             capture_output=True, text=True)
        found = [line[4:] for line in out.stdout.splitlines() if line.startswith("ROW ")]
        row = json.loads(found[0]) if found else {"variant": variant, "error": (out.stdout + out.stderr)[-3000:]}
        row["variant"] = variant
        print(json.dumps({k: v for k, v in row.items() if k != "pools"}), flush=True)
        for pool, info in row.get("pools", {}).items():
            print(f"  pool {pool}: segments {info['segment_bytes'] / GIB:.2f} GiB, allocated "
                  f"{info['allocated_bytes'] / GIB:.2f} GiB", flush=True)
            for size, n, made_by in info["blocks"]:
                print(f"    {size:7.3f} GiB x{n}  {made_by}", flush=True)
        rows.append(row)
    write_json(args.json, run_header(1), rows)


if __name__ == "__main__":
    main()
