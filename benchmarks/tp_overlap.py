"""TP communication overlap: all-gather -> GEMM and GEMM -> reduce-scatter, serial vs overlapped vs the limit.

    torchrun --nproc-per-node 2 benchmarks/tp_overlap.py --json benchmarks/results/tp_overlap_2xh200.json \\
        --timeline benchmarks/results/tp_overlap_2xh200.png

TP = the world size; 8192 tokens in total, 8192/TP rows per rank (sequence parallel), bf16 on GPU. Rows:
  ag     hidden 4096 -> 28672/TP and 8192 -> 10240/TP: y = all_gather(x) @ W^T
  rs     14336/TP -> 4096 and 10240/TP -> 8192:        y = reduce_scatter(x @ W^T)
  layer  one transformer layer (attention + dense SwiGLU MLP, Mixtral-size) forward + backward, every TP
         switch off vs on (tp_comm_overlap_ag, _rs, bulk_dgrad, bulk_wgrad).
A GEMM row times, round-robin (clocks drift under sustained load) and reports medians (the slowest
rank's): serial (the collective, then the GEMM, or the reverse), overlapped (the ring), the ring's transport
alone, the NCCL collective alone, the GEMM alone, limit = max(faster communication alone, GEMM alone), and
torch's torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter (CUDA only). Multicast is off
(benchmarks/common.py) unless --allow-multicast. ``--smoke``: tiny shapes, fp32, gloo on CPU (the tests run it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import round_robin, run_header, set_run_env, write_json  # noqa: E402

# (direction, rows in total, in features, out features before the TP split of the split side)
GEMM_SHAPES = [("ag", 8192, 4096, 28672), ("ag", 8192, 8192, 10240), ("rs", 8192, 14336, 4096),
               ("rs", 8192, 10240, 8192)]
SMOKE_SHAPES = [("ag", 64, 32, 64), ("rs", 64, 64, 32)]
LAYER = dict(hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8, seq_length=8192)
SMOKE_LAYER = dict(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=64)
LAYER_SWITCHES = dict(ag=True, rs=True, bulk_dgrad=True, bulk_wgrad=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, fp32, CPU gloo")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 25; smoke 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 5; smoke 1)")
    parser.add_argument("--num-splits", default="1,2", help="tp_comm_num_splits values to time (comma list)")
    parser.add_argument("--transports", default=None,
                        help="ring transports to time, comma list (default p2p,symm on GPU, p2p on CPU; symm needs "
                             "CUDA ranks of one host)")
    parser.add_argument("--no-layer", action="store_true", help="skip the transformer-layer rows")
    parser.add_argument("--json", default=None, help="write the results here (benchmarks/results/...)")
    parser.add_argument("--timeline", default=None, help="PNG of a profiled overlapped run (+ its Chrome trace)")
    parser.add_argument("--allow-multicast", action="store_true", help="leave NVLink multicast as the machine has it")
    return parser.parse_args(argv)


def main() -> None:
    args = parse(None)
    set_run_env(args.allow_multicast)
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=300))
    try:
        run(sys.argv[1:])
    finally:
        dist.destroy_process_group()


def run(argv: list[str]) -> list[dict]:
    """Every row, on every rank of the initialised default group; rank 0 prints and writes the JSON."""
    import torch
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import GroupHandle
    from moe_overlap.distributed.ring import TPComm, TPOverlap, make_ring_transport

    args = parse(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not args.smoke \
        else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rounds = args.rounds or (3 if args.smoke else 25)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    world, rank = dist.get_world_size(), dist.get_rank()
    group = GroupHandle(ranks=list(range(world)), group=dist.group.WORLD, rank=rank, size=world)
    splits = [int(v) for v in args.num_splits.split(",")]
    transports = {name: make_ring_transport(name, group, device, max(splits), timeout_s=300)
                  for name in (args.transports or ("p2p,symm" if device.type == "cuda" else "p2p")).split(",")}
    # (a transport that cannot run here is refused with the reason)
    comms = {f"{name}/{n}": TPComm(group, sequence_parallel=True, overlap=TPOverlap(num_splits=n), transport=t)
             for name, t in transports.items() for n in splits}
    torch.manual_seed(1234 + rank)
    rows = []
    for direction, total, k, n in SMOKE_SHAPES if args.smoke else GEMM_SHAPES:
        variants = (_ag_variants if direction == "ag" else _rs_variants)(comms, total, k, n, device, dtype)
        errors = _errors_against_serial(variants)
        times = round_robin(variants, rounds, warmup, device)
        ring = {name: ms for name, ms in times.items() if name.startswith("ring_comm")}
        overlapped = {name.split(":")[1]: ms for name, ms in times.items() if name.startswith("overlapped:")}
        best = min(overlapped, key=overlapped.get)
        comm_ms = min(min(ring.values()), times["collective"])
        rows.append({
            "shape": f"{total}x{k}->{n // world}" if direction == "ag" else f"{total}x{k // world}->{n}",
            "direction": direction, "serial_ms": times["serial"], "overlapped_ms": overlapped[best],
            "limit_ms": max(comm_ms, times["gemm"]), "gemm_ms": times["gemm"],
            "ring_comm_ms": {name.split(":")[1]: ms for name, ms in ring.items()},
            "collective_ms": times["collective"], "torch_fused_ms": times.get("torch_fused"),
            "transport": best.split("/")[0], "num_splits": int(best.split("/")[1]),
            "overlapped_by_variant_ms": overlapped, **errors,
            "gemm_chunked_ms": {name.split(":")[1]: ms for name, ms in times.items()
                                if name.startswith("gemm_chunked")},
        })
    if not args.no_layer:
        rows.append(_layer_row(comms, SMOKE_LAYER if args.smoke else LAYER, rounds, warmup, device, dtype))
    if args.timeline:
        _timeline(args.timeline, comms, SMOKE_SHAPES if args.smoke else GEMM_SHAPES, device, dtype, rank)
    if rank == 0:
        _print(rows)
        write_json(args.json, run_header(world), rows)
    return rows


# ---------------------------------------------------------------------------------------------- variants


def _ag_variants(comms: dict, total: int, k: int, n: int, device, dtype) -> dict[str, Callable[[], object]]:
    import torch

    from moe_overlap.distributed.ring import gather_rows

    comm = next(iter(comms.values()))
    x_RK = torch.randn(total // comm.size, k, device=device, dtype=dtype)
    w_NK = torch.randn(n // comm.size, k, device=device, dtype=dtype) / k ** 0.5
    x_SK = gather_rows(x_RK, comm.group)
    variants = {"serial": lambda: comm.gather_matmul(x_RK, w_NK.t(), overlap=False)[0]}
    variants.update(_ring_variants(comms, x_RK, lambda c: c.gather_matmul(x_RK, w_NK.t(), overlap=True)[0]))
    variants.update(collective=lambda: gather_rows(x_RK, comm.group), gemm=lambda: torch.mm(x_SK, w_NK.t()))
    variants.update(_chunked_gemm_variants(comms, x_SK, w_NK.t()))
    fused = _torch_fused_ops(device)
    if fused is not None:
        group_name = comm.group.group.group_name
        variants["torch_fused"] = lambda: fused[0](x_RK, [w_NK.t()], 0, group_name)[1][0]
    return variants


def _rs_variants(comms: dict, total: int, k: int, n: int, device, dtype) -> dict[str, Callable[[], object]]:
    import torch

    from moe_overlap.distributed.ring import scatter_rows

    comm = next(iter(comms.values()))
    a_SK = torch.randn(total, k // comm.size, device=device, dtype=dtype)
    w_NK = torch.randn(n, k // comm.size, device=device, dtype=dtype) / k ** 0.5
    y_SN = torch.mm(a_SK, w_NK.t())
    # The reduce-scatter ring's transfers: the same hops and chunks as an all-gather ring of the output block
    # (its additions are computation, not communication).
    variants = {"serial": lambda: comm.matmul_scatter(a_SK, w_NK.t(), overlap=False)}
    variants.update(_ring_variants(comms, y_SN[:total // comm.size],
                                   lambda c: c.matmul_scatter(a_SK, w_NK.t(), overlap=True)))
    variants.update(collective=lambda: scatter_rows(y_SN, comm.group), gemm=lambda: torch.mm(a_SK, w_NK.t()))
    variants.update(_chunked_gemm_variants(comms, a_SK, w_NK.t()))
    fused = _torch_fused_ops(device)
    if fused is not None:
        group_name = comm.group.group.group_name
        variants["torch_fused"] = lambda: fused[1](a_SK, w_NK.t(), "sum", 0, group_name)
    return variants


def _chunked_gemm_variants(comms: dict, a_SK, b_KN) -> dict[str, Callable[[], object]]:
    """``gemm_chunked:<splits>``: the GEMM as the ring runs it, in size x splits row chunks, with no
    communication: what GEMM efficiency at chunk size costs."""
    import torch

    out_SN = torch.empty(a_SK.shape[0], b_KN.shape[1], device=a_SK.device, dtype=a_SK.dtype)

    def chunked(pieces: int):
        for a_CK, out_CN in zip(a_SK.chunk(pieces), out_SN.chunk(pieces)):
            torch.mm(a_CK, b_KN, out=out_CN)
        return out_SN

    comm = next(iter(comms.values()))
    return {f"gemm_chunked:{n}": (lambda n=n: chunked(comm.size * n)) for n in sorted({c.overlap.num_splits
                                                                                       for c in comms.values()})}


def _ring_variants(comms: dict, moved_RK, overlapped: Callable) -> dict[str, Callable[[], object]]:
    """``overlapped:<transport>/<splits>`` for every TPComm, and ``ring_comm:<transport>/<splits>``: its ring
    moving ``moved_RK`` alone."""
    from moe_overlap.distributed.ring import ring_all_gather

    variants = {}
    for name, comm in comms.items():
        variants[f"overlapped:{name}"] = lambda c=comm: overlapped(c)
        variants[f"ring_comm:{name}"] = lambda c=comm: ring_all_gather(moved_RK, c.group, c.transport,
                                                                       c.overlap.num_splits, lambda chunk, first: None)
    return variants


def _torch_fused_ops(device):
    """torch's own fused ops (symmetric memory, CUDA only), or None."""
    if device.type != "cuda":
        return None
    import torch
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory

    with warnings.catch_warnings():  # deprecated (unneeded) in newer torch; torch 2.11 may still need it
        warnings.simplefilter("ignore")
        _symmetric_memory.enable_symm_mem_for_group(dist.group.WORLD.group_name)
    return torch.ops.symm_mem.fused_all_gather_matmul, torch.ops.symm_mem.fused_matmul_reduce_scatter


def _layer_row(comms: dict, shape: dict, rounds: int, warmup: int, device, dtype) -> dict:
    """One dense transformer layer, forward + backward, serial vs every switch on (the same layer), over each
    transport and split count."""
    import torch

    from moe_overlap.config import ModelConfig, OverlapConfig
    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.distributed.ring import TPOverlap
    from moe_overlap.layers.init import init_parameters
    from moe_overlap.models.mixtral import TransformerLayer

    cfg = ModelConfig(num_layers=1, **shape)
    comm = next(iter(comms.values()))
    # A dense layer: its mesh (used only for a MoE layer's EP group) may be the single one; comm is the TP group.
    layer = TransformerLayer(cfg, OverlapConfig(moe_pipeline=False), 0, Mesh.single(), None, comm, device, dtype)
    init_parameters(layer, seed=1, std=0.02, num_layers=1)
    x = torch.randn(1, cfg.seq_length // comm.size, cfg.hidden_size, device=device, dtype=dtype,
                    requires_grad=True)
    grad = torch.randn_like(x)

    def step(source, overlap: TPOverlap) -> Callable[[], object]:
        def fwd_bwd():
            comm.overlap, comm.transport = overlap, source.transport
            out = layer(x)[0]
            out.backward(grad)
            x.grad = None
            for param in layer.parameters():
                param.grad = None
        return fwd_bwd

    variants = {"serial": step(comm, TPOverlap())}
    for name, source in comms.items():
        variants[name] = step(source, TPOverlap(**LAYER_SWITCHES, num_splits=source.overlap.num_splits))
    times = round_robin(variants, rounds, warmup, device)
    comm.overlap, comm.transport = TPOverlap(), comms[next(iter(comms))].transport
    overlapped = {name: ms for name, ms in times.items() if name != "serial"}
    best = min(overlapped, key=overlapped.get)
    return {"shape": "layer", "layer": f"h{cfg.hidden_size} ffn{cfg.ffn_hidden_size} heads{cfg.num_attention_heads}"
            f"/{cfg.num_query_groups} seq{cfg.seq_length}", "serial_fwdbwd_ms": times["serial"],
            "overlapped_fwdbwd_ms": overlapped[best], "overlapped_by_variant_ms": overlapped,
            "switches": [f"tp_comm_{'overlap_' if name in ('ag', 'rs') else ''}{name}" for name in LAYER_SWITCHES],
            "transport": best.split("/")[0], "num_splits": int(best.split("/")[1])}


# ------------------------------------------------------------------------------------------------ timing


def _errors_against_serial(variants: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Normwise relative error of the overlapped and torch-fused results against the serial one (checked once,
    before timing: a fast wrong answer fails here)."""
    import torch

    serial = variants["serial"]()
    tolerance = 1e-5 if serial.dtype == torch.float32 else 2e-2  # bf16: the ring sums partials in another order
    serial = serial.float()
    errors = {name: float((variants[name]().float() - serial).norm() / serial.norm())
              for name in variants if name.startswith("overlapped:") or name == "torch_fused"}
    for name, error in errors.items():
        if name != "torch_fused" and error > tolerance:
            raise RuntimeError(f"{name} differs from serial: relative error {error:.2e}")
    return {"rel_err_vs_serial": errors}


def _print(rows: list[dict]) -> None:
    print(f"{'row':<24}{'serial':>10}{'overlap':>10}{'limit':>10}{'gemm':>10}{'ring':>10}{'coll.':>10}"
          f"{'torch':>10}{'ovl/limit':>11}")
    for row in rows:
        if row["shape"] == "layer":
            print(f"{'layer fwd+bwd':<24}{row['serial_fwdbwd_ms']:>10.3f}{row['overlapped_fwdbwd_ms']:>10.3f}"
                  f"   ({row['layer']})")
            continue
        fused = "n/a" if row["torch_fused_ms"] is None else f"{row['torch_fused_ms']:.3f}"
        print(f"{row['direction'] + ' ' + row['shape']:<24}{row['serial_ms']:>10.3f}{row['overlapped_ms']:>10.3f}"
              f"{row['limit_ms']:>10.3f}{row['gemm_ms']:>10.3f}{min(row['ring_comm_ms'].values()):>10.3f}"
              f"{row['collective_ms']:>10.3f}{fused:>10}{row['overlapped_ms'] / row['limit_ms']:>11.2f}"
              f"  best {row['transport']}/{row['num_splits']}")
    for row in rows:
        print(f"  {row['shape']}: " + ", ".join(f"{name} {ms:.3f}"
                                                for name, ms in row["overlapped_by_variant_ms"].items()))
    print("ms, medians of the slowest rank; limit = max(faster communication alone, GEMM alone); torch = "
          "torch.ops.symm_mem fused ops; overlapped = the best transport/splits (all listed below the table)")


# ---------------------------------------------------------------------------------------------- timeline


def _timeline(png_path: str, comms: dict, shapes, device, dtype, rank: int) -> None:
    """Profile one overlapped run of the first ag and rs shapes over each transport (fewest splits); Chrome
    trace per rank, PNG of rank 0."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    runs = [next(s for s in shapes if s[0] == d) for d in ("ag", "rs")]
    chosen = {}
    for name, comm in comms.items():  # one TPComm per transport
        chosen.setdefault(name.split("/")[0], (name, comm))
    prepared = [(_ag_variants if d == "ag" else _rs_variants)(dict([pick]), total, k, n, device, dtype)
                [f"overlapped:{pick[0]}"] for pick in chosen.values() for d, total, k, n in runs]
    for fn in prepared:  # warm
        fn()
    with profile(activities=activities) as prof:
        for fn in prepared:
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    trace = Path(png_path).with_suffix(f".rank{rank}.trace.json")
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    if rank != 0:
        return
    try:
        import matplotlib
    except ImportError:
        print(f"timeline: matplotlib is not installed (pip install -e '.[plot]'); wrote only the Chrome trace {trace}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device_cats = {"kernel", "gpu_memcpy", "gpu_memset"}
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e
              and (e.get("cat") in device_cats if device.type == "cuda" else e.get("cat") == "cpu_op")]
    if not events:
        print(f"timeline: no events profiled; see {trace}")
        return
    lanes = sorted({(e["pid"], e["tid"]) for e in events}, key=str)
    t0 = min(e["ts"] for e in events)
    fig, ax = plt.subplots(figsize=(14, 1 + 0.5 * len(lanes)))
    for lane, key in enumerate(lanes):
        for is_comm, color in ((False, "tab:blue"), (True, "tab:orange")):  # computation / communication
            spans = [((e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in events if (e["pid"], e["tid"]) == key
                     and _is_comm(e["name"]) == is_comm]
            ax.broken_barh(spans, (lane - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(lanes)), [f"{'stream' if device.type == 'cuda' else 'thread'} {tid}" for _, tid in lanes])
    ax.set_xlabel("ms")
    ax.set_title(f"rank 0: all-gather->GEMM, then GEMM->reduce-scatter, over {', '.join(chosen)} in turn "
                 "(orange: communication)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    print(f"timeline: {png_path} (trace {trace})")


def _is_comm(name: str) -> bool:
    return any(word in name.lower() for word in ("nccl", "memcpy", "gloo", "send", "recv", "all_gather", "scatter"))


if __name__ == "__main__":
    main()
