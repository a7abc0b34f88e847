"""Ring attention (context parallelism): one causal attention layer's forward+backward, blockwise vs full.

    # 2 GPUs, CP=2, the default kernel (cuDNN in bf16): NVLink, then NCCL through host memory (an inter-node stand-in)
    torchrun --nproc-per-node 2 benchmarks/cp_attention.py --json benchmarks/results/cp_attention_2xh100_nvlink.json
    torchrun --nproc-per-node 2 benchmarks/cp_attention.py --fabric slow \
        --json benchmarks/results/cp_attention_2xh100_slow.json
    # one GPU: the work of CP=2 in one process against one full attention
    python benchmarks/cp_attention.py --json benchmarks/results/cp_attention_1xh200.json

Shapes: sequences of 32K and 128K tokens, batch 1, 32 query heads, 8 key-value heads, head dim 128, bf16 on GPU.
Every row's headline is the default block kernel, the one the model runs (layers/ring_attention.choose_kernel:
cuDNN in bf16 with head dim <= 128 on GPU, math on CPU); ``--kernels`` adds others beside it (``by_kernel``), never
in its place. Its targets, each met or missed in the JSON's ``summary`` (``met: null`` where the comparison did not
run):
World size 1 (``--cp``, default 2): ``blockwise`` runs every CP rank's blocks one after another in one process,
merged by log-sum-exp, no transfers; ``full`` is the same kernel over the whole sequence (forward and backward
op); ``sdpa`` is F.scaled_dot_product_attention with autograd, what the model runs at CP=1. Target: blockwise
<= 1.05 x full, what the split and the merges cost.
World size N > 1 (CP = N, each rank its local sequence): ``serial`` (each transfer, then the compute:
overlap.cp_comm_overlap off), ``overlapped`` (on), ``transfers`` (the ring's passes alone), ``compute`` (the same
blocks without transfers), limit = max(transfers, compute), and ``torch``, torch's own context_parallel ring
attention (all-to-all rotation, its head-tail load balancing: the same split; entered once per row, so
its sharding copies are not timed; grouped-query attention as ours, else with the key-value heads repeated per
query head; where it cannot run, the row says why). Targets: overlapped <= 1.05 x the limit and faster than torch's
on NVLink (``--fabric nvlink``), <= 1.15 x on the slow fabric (``--fabric slow``: NCCL_P2P_DISABLE=1 before init).
Medians of round-robin rounds, the slowest rank's. Multicast is off (benchmarks/common.py) unless
--allow-multicast. ``--smoke``: tiny shapes, fp32, CPU (gloo with more ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import round_robin, run_header, set_run_env, write_json  # noqa: E402
from moe_overlap.training.profiling import draw_timeline  # noqa: E402

SHAPE = dict(seqs="32768,131072", heads=32, kv_heads=8, head_dim=128, batch=1)
SMOKE_SHAPE = dict(seqs="32,64", heads=4, kv_heads=2, head_dim=8, batch=2)
TARGET_ONE_PROCESS = 1.05  # blockwise / full
TARGET_RING = {"nvlink": 1.05, "slow": 1.15}  # overlapped / limit


def parse(argv: list[str] | None) -> argparse.Namespace:
    from moe_overlap.layers.ring_attention import KERNELS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, fp32, CPU")
    parser.add_argument("--seqs", default=None, help="sequence lengths, comma list (default 32768,131072)")
    parser.add_argument("--cp", type=int, default=2, help="CP size simulated at world size 1")
    parser.add_argument("--kernels", default=None, help=f"block kernels timed beside the default one, comma list "
                                                         f"of {', '.join(KERNELS)}")
    parser.add_argument("--fabric", choices=("nvlink", "slow"), default="nvlink",
                        help="slow: NCCL through host memory (NCCL_P2P_DISABLE=1), an inter-node stand-in")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; smoke 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2; smoke 1)")
    parser.add_argument("--json", default=None, help="write the results here (benchmarks/results/...)")
    parser.add_argument("--timeline", default=None, help="PNG of a profiled blockwise / overlapped run of the "
                                                         "first sequence length (+ its Chrome trace)")
    parser.add_argument("--allow-multicast", action="store_true", help="leave NVLink multicast as the machine has it")
    args = parser.parse_args(argv)
    unknown = [name for name in (args.kernels or "").split(",") if name and name not in KERNELS]
    if unknown:
        parser.error(f"--kernels={args.kernels}: unknown {', '.join(unknown)}; allowed {', '.join(KERNELS)}")
    return args


def main() -> None:
    args = parse(None)
    set_run_env(args.allow_multicast, args.fabric)
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=600))
    try:
        run(sys.argv[1:])
    finally:
        if world > 1:
            dist.destroy_process_group()


def run(argv: list[str]) -> list[dict]:
    """Every row, on every rank (of the initialised default group, or this process alone); rank 0 prints and
    writes the JSON."""
    import torch
    import torch.distributed as dist

    from moe_overlap.layers.ring_attention import choose_kernel

    started = time.perf_counter()
    args = parse(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not args.smoke \
        else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(SMOKE_SHAPE if args.smoke else SHAPE)
    seqs = [int(s) for s in (args.seqs or shape.pop("seqs")).split(",")]
    shape.pop("seqs", None)
    default = choose_kernel(device.type, dtype, shape["head_dim"]).name  # the headline: what the model runs
    kernels = [default] + [name for name in dict.fromkeys((args.kernels or "").split(",")) if name and name != default]
    rounds = args.rounds or (2 if args.smoke else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    rows = []
    for seq in seqs:
        inputs = _inputs(seq, device, dtype, **shape)
        if world == 1:
            rows.append(_one_process_row(inputs, args.cp, kernels, rounds, warmup, device))
        else:
            rows.append(_ring_row(inputs, kernels, rounds, warmup, device, args.fabric))
        if rank == 0:
            print(f"seq {seq}: done at {time.perf_counter() - started:.0f} s", flush=True)
    summary = _summary(rows, world, args.fabric)
    if rank == 0:
        _print(rows, world, summary)
        header = dict(run_header(world), fabric=args.fabric if world > 1 else None, default_kernel=default,
                      shape=dict(shape, seqs=seqs),
                      target=TARGET_ONE_PROCESS if world == 1 else TARGET_RING[args.fabric], summary=summary,
                      wall_s=time.perf_counter() - started)
        write_json(args.json, header, rows)
    if args.timeline:
        _timeline(args.timeline, _inputs(seqs[0], device, dtype, **shape), args.cp, default, device, rank, world)
    return rows


def _summary(rows: list[dict], world: int, fabric: str) -> list[dict]:
    """The targets of the default kernel, row by row: met true / false, or null where not measured (and why)."""
    out = []
    for row in rows:
        where = {"seq": row["seq"], "kernel": row["kernel"]}
        if world == 1:
            out.append(dict(where, target=f"blockwise <= {TARGET_ONE_PROCESS}x full (CP={row['cp_simulated']} in "
                                          "one process)", value=row["ratio"], met=row["met"]))
            continue
        out.append(dict(where, target=f"overlapped <= {TARGET_RING[fabric]}x the limit ({fabric})",
                        value=row["overlapped_over_limit"], met=row["met"]))
        if fabric == "nvlink":
            measured = row["torch_ms"] is not None and row["overlapped_ms"] is not None
            out.append(dict(where, target="faster than torch's context_parallel ring attention (nvlink)",
                            value=row["torch_ms"] / row["overlapped_ms"] if measured else None,
                            met=row["ahead_of_torch"], **({} if measured else {"why": row["torch_note"]})))
    return out


def _inputs(seq: int, device, dtype, heads: int, kv_heads: int, head_dim: int, batch: int) -> dict:
    """The whole sequence's q, k, v and output gradient (the same on every rank: one seed), (batch, heads, seq,
    dim) tensors laid out (batch, seq, heads, dim) in memory, as the flash kernel writes its outputs and the
    model's projections produce them."""
    import torch

    g = torch.Generator(device=device).manual_seed(1234)

    def randn(heads_: int):
        return torch.randn(batch, seq, heads_, head_dim, device=device, dtype=dtype, generator=g).transpose(1, 2)

    return dict(seq=seq, q=randn(heads), k=randn(kv_heads), v=randn(kv_heads), dout=randn(heads),
                scale=1 / math.sqrt(head_dim))


def _local(x_BHSD, rank: int, size: int):
    """Rank ``rank``'s local sequence of a (batch, heads, sequence, dim) tensor, in the same memory layout."""
    from moe_overlap.distributed.context_parallel import split_sequence

    return split_sequence(x_BHSD.transpose(1, 2), 1, rank, size).transpose(1, 2)


def _split(inputs: dict, rank: int, size: int) -> dict:
    """Rank ``rank``'s local q, kv (2, B, G, L, D) and output gradient."""
    import torch

    return dict(q=_local(inputs["q"], rank, size), dout=_local(inputs["dout"], rank, size),
                kv=torch.stack((_local(inputs["k"], rank, size), _local(inputs["v"], rank, size))))


def _rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------- one process


def _one_process_row(inputs: dict, cp: int, kernels: list[str], rounds: int, warmup: int, device) -> dict:
    import torch.nn.functional as F

    from moe_overlap.layers.ring_attention import KERNELS, blockwise_backward, blockwise_forward

    parts = [_split(inputs, r, cp) for r in range(cp)]
    q, k, v, dout, scale = (inputs[name] for name in ("q", "k", "v", "dout", "scale"))
    qs, kvs, douts = ([p[name] for p in parts] for name in ("q", "kv", "dout"))

    def full(kernel):
        out, lse, saved = kernel.forward(q, k, v, True, scale)
        return kernel.backward(dout, q, k, v, out, lse, True, scale, saved), out

    def blockwise(kernel):
        forward = blockwise_forward(qs, kvs, kernel, scale)
        return blockwise_backward(douts, qs, kvs, forward, kernel, scale), [out for out, _, _ in forward]

    def sdpa():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(dout)

    variants: dict[str, Callable[[], object]] = {"sdpa": sdpa}
    errors, failed = {}, {}
    for name in kernels:
        kernel = KERNELS[name]
        try:  # check once before timing: a fast wrong answer fails here, a kernel that cannot run says why
            (dq, dk, dv), out = full(kernel)
            (dqs, dkvs), outs = blockwise(kernel)
            errors[name] = max(_rel(got, _local(want, r, cp)) for r in range(cp) for got, want in (
                (outs[r], out), (dqs[r], dq), (dkvs[r][0], dk), (dkvs[r][1], dv)))
            del dq, dk, dv, out, dqs, dkvs, outs
        except Exception:
            failed[name] = traceback.format_exc(limit=3)[-1500:]
            continue
        variants[f"full:{name}"] = lambda kernel=kernel: full(kernel)
        variants[f"blockwise:{name}"] = lambda kernel=kernel: blockwise(kernel)
    times = round_robin(variants, rounds, warmup, device)
    by_kernel = {name: {"full_ms": times[f"full:{name}"], "blockwise_ms": times[f"blockwise:{name}"],
                        "ratio": times[f"blockwise:{name}"] / times[f"full:{name}"], "max_rel_err": errors[name]}
                 for name in kernels if name not in failed}
    head = by_kernel.get(kernels[0], {})  # the default kernel's, or nothing where it failed
    return {"seq": inputs["seq"], "cp_simulated": cp, "kernel": kernels[0], "sdpa_ms": times["sdpa"],
            "full_ms": head.get("full_ms"), "blockwise_ms": head.get("blockwise_ms"), "ratio": head.get("ratio"),
            "max_rel_err": head.get("max_rel_err"), "met": bool(head) and head["ratio"] <= TARGET_ONE_PROCESS,
            "by_kernel": by_kernel, "failed": failed}


# ------------------------------------------------------------------------------------------ the ring


def _ring_row(inputs: dict, kernels: list[str], rounds: int, warmup: int, device, fabric: str) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from moe_overlap.distributed.context_parallel import CPComm
    from moe_overlap.distributed.mesh import GroupHandle
    from moe_overlap.layers.ring_attention import (KERNELS, LocalCollector, LocalRelay, RingAttention, ring_backward,
                                                   ring_forward, ring_schedule)

    size, rank = dist.get_world_size(), dist.get_rank()
    group = GroupHandle(ranks=list(range(size)), group=dist.group.WORLD, rank=rank, size=size)
    mine = _split(inputs, rank, size)
    q, kv, dout, scale = mine["q"], mine["kv"], mine["dout"], inputs["scale"]
    schedule = ring_schedule(rank, size, q.shape[2])
    serial, overlapped = CPComm(group, overlap=False), CPComm(group, overlap=True)

    def ring(comm, kernel):
        leaves = [x.detach().requires_grad_() for x in (q, kv[0], kv[1])]
        out = RingAttention.apply(*leaves, comm, kernel)
        out.backward(dout)
        return out, leaves

    dkv = kv.float()

    def transfers():  # the forward's KV passes, then the backward's KV and (fp32) gradient passes
        for block, hops in ((kv, size - 1), (kv, size - 1), (dkv, size)):
            for _ in range(hops):
                block = serial.pass_on(block).wait()

    def compute(kernel):
        relay = [kv] * size
        out, lse, saved = ring_forward(q, kv, schedule, LocalRelay(relay, rank), kernel, False, scale)
        ring_backward(dout, q, kv, out, lse, saved, schedule, LocalRelay(relay, rank),
                      LocalCollector([None] * size, rank), kernel, False, scale)

    leaves = [x.detach().requires_grad_() for x in (inputs["q"], inputs["k"], inputs["v"])]
    out_full = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    out_full.backward(inputs["dout"])
    want = [_local(x, rank, size) for x in (out_full, *(x.grad for x in leaves))]  # out, dq, dk, dv
    del leaves, out_full
    variants: dict[str, Callable[[], object]] = {"transfers": transfers}
    errors, failed = {}, {}
    for name in kernels:
        kernel = KERNELS[name]
        try:  # check once before timing: a fast wrong answer fails here, a kernel that cannot run says why
            out, got = ring(overlapped, kernel)
            errors[name] = max(_rel(a, b) for a, b in zip((out, *(x.grad for x in got)), want))
            del out, got
        except Exception:
            failed[name] = traceback.format_exc(limit=3)[-1500:]
            continue
        variants[f"serial:{name}"] = lambda kernel=kernel: ring(serial, kernel)
        variants[f"overlapped:{name}"] = lambda kernel=kernel: ring(overlapped, kernel)
        variants[f"compute:{name}"] = lambda kernel=kernel: compute(kernel)
    with contextlib.ExitStack() as torch_context:  # torch's context_parallel stays entered until the timing ends
        torch_ring, torch_note, torch_err = _torch_ring(inputs, device, want, torch_context)
        if torch_ring is not None:
            variants["torch"] = torch_ring
        times = round_robin(variants, rounds, warmup, device)
    by_kernel = {}
    for name in (k for k in kernels if k not in failed):
        limit = max(times["transfers"], times[f"compute:{name}"])
        by_kernel[name] = {"serial_ms": times[f"serial:{name}"], "overlapped_ms": times[f"overlapped:{name}"],
                           "compute_ms": times[f"compute:{name}"], "limit_ms": limit,
                           "overlapped_over_limit": times[f"overlapped:{name}"] / limit, "max_rel_err": errors[name]}
    head = by_kernel.get(kernels[0], {})  # the default kernel's, or nothing where it failed
    torch_ms = times.get("torch")
    return {"seq": inputs["seq"], "cp": size, "kernel": kernels[0], "serial_ms": head.get("serial_ms"),
            "overlapped_ms": head.get("overlapped_ms"), "transfers_ms": times["transfers"],
            "compute_ms": head.get("compute_ms"), "limit_ms": head.get("limit_ms"),
            "overlapped_over_limit": head.get("overlapped_over_limit"),
            "met": bool(head) and head["overlapped_over_limit"] <= TARGET_RING[fabric],
            "torch_ms": torch_ms, "torch_note": torch_note, "torch_max_rel_err": torch_err,
            "ahead_of_torch": None if torch_ms is None or not head else head["overlapped_ms"] < torch_ms,
            "max_rel_err": head.get("max_rel_err"), "by_kernel": by_kernel, "failed": failed}


def _torch_ring(inputs: dict, device, want: list, stack: contextlib.ExitStack):
    """torch's own context-parallel ring attention on this rank's shard, entered into ``stack``: first with
    grouped-query attention as ours runs it, else with the key-value heads repeated per query head. Returns (the
    timed call or None, what ran or why not, its largest error of output and dq against ``want``). Every rank
    tries the same and the ranks agree, so that a failure on one leaves none timing alone. (On CPU it fails: torch
    has no sharding rule for the CPU attention op; the smoke tests take that path.)"""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sdpa, failures = F.scaled_dot_product_attention, []
    for gqa in (True, False):
        attempt = contextlib.ExitStack()
        try:
            call = _enter_torch_ring(inputs, device, gqa, attempt)
            out, dq = call()
            err = max(_rel(out, want[0]), _rel(dq, want[1]))
        except Exception as exc:
            call = None
            failures.append(f"{'grouped-query' if gqa else 'KV repeated'}: {type(exc).__name__}: {exc}"[:400])
        ran = torch.tensor([call is not None], dtype=torch.int32, device=device)
        dist.all_reduce(ran, op=dist.ReduceOp.MIN)
        if ran.item():
            stack.enter_context(attempt)
            how = "grouped-query attention" if gqa else "KV heads repeated per query head (grouped-query failed: " \
                + failures[0] + ")"
            return call, f"torch context_parallel, all-to-all rotation, {how}; torch {torch.__version__}", err
        with contextlib.suppress(Exception):
            attempt.close()
        F.scaled_dot_product_attention = sdpa  # in case the context's own set-up failed after patching it
    return None, "not run: " + "; ".join(failures), None


def _enter_torch_ring(inputs: dict, device, gqa: bool, stack: contextlib.ExitStack) -> Callable[[], tuple]:
    """Shard copies of the inputs by torch's context_parallel (entered into ``stack``); returns the call that runs
    torch's ring attention forward and backward on them, giving (local output, local dq)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method("alltoall")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    q, k, v, dout = (inputs[name].clone() for name in ("q", "k", "v", "dout"))
    if not gqa:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    buffers = [q, k, v, dout]
    stack.enter_context(context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4,
                                         no_restore_buffers=set(buffers)))

    def call():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=gqa)  # patched by the context
        out.backward(dout)
        return out, leaves[0].grad

    return call


# ------------------------------------------------------------------------------------------ reporting


def _print(rows: list[dict], world: int, summary: list[dict]) -> None:
    if world == 1:
        print(f"{'seq':>8}{'kernel':>10}{'full':>12}{'blockwise':>12}{'ratio':>8}{'sdpa':>12}")
        for row in rows:
            for name, k in row["by_kernel"].items():
                print(f"{row['seq']:>8}{name:>10}{k['full_ms']:>12.3f}{k['blockwise_ms']:>12.3f}{k['ratio']:>8.3f}"
                      f"{row['sdpa_ms']:>12.3f}  err {k['max_rel_err']:.1e}")
        print(f"ms, medians; blockwise = the work of CP={rows[0]['cp_simulated']} in one process (no transfers); "
              "full = the same kernel over the whole sequence; sdpa = F.scaled_dot_product_attention")
    else:
        print(f"{'seq':>8}{'kernel':>10}{'serial':>12}{'overlapped':>12}{'transfers':>12}{'compute':>12}{'limit':>12}"
              f"{'ovl/lim':>9}{'torch':>12}")
        for row in rows:
            torch_ms = "n/a" if row["torch_ms"] is None else f"{row['torch_ms']:.3f}"
            for name, k in row["by_kernel"].items():
                print(f"{row['seq']:>8}{name:>10}{k['serial_ms']:>12.3f}{k['overlapped_ms']:>12.3f}"
                      f"{row['transfers_ms']:>12.3f}{k['compute_ms']:>12.3f}{k['limit_ms']:>12.3f}"
                      f"{k['overlapped_over_limit']:>9.3f}{torch_ms:>12}  err {k['max_rel_err']:.1e}")
        print(f"ms, medians of the slowest rank, CP={world}; torch: {rows[0]['torch_note']}")
    for row in rows:
        for name, why in row["failed"].items():
            print(f"{row['seq']:>8}{name:>10}  failed: {why.strip().splitlines()[-1]}")
    for entry in summary:
        value = "n/a" if entry["value"] is None else f"{entry['value']:.3f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[entry["met"]]
        print(f"target: {entry['target']:62} seq {entry['seq']:>7} {entry['kernel']:>6} {value:>7}  {verdict}")


def _timeline(png_path: str, inputs: dict, cp: int, kernel_name: str, device, rank: int, world: int) -> None:
    """Profile one blockwise run (world 1) or overlapped ring (world > 1); Chrome trace per rank, PNG of rank 0."""
    from torch.profiler import ProfilerActivity, profile

    from moe_overlap.distributed.streams import synchronize
    from moe_overlap.layers.ring_attention import KERNELS, blockwise_backward, blockwise_forward, ring_attention

    kernel = KERNELS[kernel_name]
    if world == 1:
        parts = [_split(inputs, r, cp) for r in range(cp)]
        qs, kvs, douts = ([p[name] for p in parts] for name in ("q", "kv", "dout"))

        def once():
            forward = blockwise_forward(qs, kvs, kernel, inputs["scale"])
            blockwise_backward(douts, qs, kvs, forward, kernel, inputs["scale"])
    else:
        import torch.distributed as dist

        from moe_overlap.distributed.context_parallel import CPComm
        from moe_overlap.distributed.mesh import GroupHandle

        group = GroupHandle(ranks=list(range(world)), group=dist.group.WORLD, rank=rank, size=world)
        mine = _split(inputs, rank, world)

        def once():
            leaves = [x.detach().requires_grad_() for x in (mine["q"], mine["kv"][0], mine["kv"][1])]
            ring_attention(*leaves, CPComm(group, overlap=True)).backward(mine["dout"])

    once()  # warm
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        once()
        synchronize(device)
    trace = Path(png_path).with_suffix(f".rank{rank}.trace.json")
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    print(f"trace: {trace}")
    if rank == 0:
        what = f"CP={cp} blockwise in one process" if world == 1 else f"CP={world} ring, overlapped"
        draw_timeline(prof, png_path, f"{what}, seq {inputs['seq']}, kernel {kernel_name}")


if __name__ == "__main__":
    main()
