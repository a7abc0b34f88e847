"""One MoE layer's forward and forward+backward under expert parallelism: serial, overlapped, the limit,
and a plain-torch baseline, measured side by side in one run (also `moe-overlap bench moe`).

    torchrun --nproc-per-node 2 benchmarks/moe_layer.py --shapes mixtral,fine,fine_small --fabric nvlink \
        --json benchmarks/results/moe_layer_2xh200_nvlink.json --timeline benchmarks/results/moe_layer_fine.png
    torchrun --nproc-per-node 1 benchmarks/moe_layer.py ...    # EP=1: the layer's own work against its GEMMs

Rows per shape:
  serial      the serial reference path (overlap off)
  overlapped  the chunked pipeline; every (backend, chunks, delay_wgrad) setting is timed, the best reported;
              with them the sync-free dropless dispatch (symm, or gloo's twin on CPU), eagerly and (CUDA)
              replayed from CUDA graphs as train.moe_cuda_graph does it (a second layer, same weights)
  comm        the fastest transport moving the full, unchunked dispatch and combine (forward), and their
              gradients too (forward+backward), for the same routing
  gemm        the unchunked expert GEMMs alone on the same per-expert counts: fc1, SwiGLU, fc2 (forward),
              plus dgrad and wgrad (forward+backward)
  limit       max(comm, gemm)
  baseline    plain torch: router, argsort permute, all_to_all_single, torch._grouped_mm, all_to_all_single
Variants run round-robin (A B C A B C ...) and report medians: clocks drift under sustained load (DESIGN.md).
`--fabric slow` sets NCCL_P2P_DISABLE=1 (NCCL through host memory, standing in for an inter-node link) and
forces the nccl transport for every variant. `--shapes tiny` runs on CPU with gloo (the CI smoke test).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import disable_multicast, run_header, write_json  # noqa: E402


@dataclass(frozen=True)
class Shape:
    tokens: int  # per rank
    hidden: int
    ffn: int
    experts: int
    topk: int


SHAPES = {
    "mixtral": Shape(4096, 4096, 14336, 8, 2),
    "fine": Shape(4096, 7168, 2048, 32, 8),
    "fine_small": Shape(4096, 2048, 1024, 32, 4),
    "tiny": Shape(64, 64, 64, 8, 2),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral,fine,fine_small")
    parser.add_argument("--fabric", choices=("nvlink", "slow"), default="nvlink")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeline", default=None,
                        help="PNG of one overlapped forward+backward (GPU only), and a .txt kernel table beside it")
    parser.add_argument("--timeline-shape", default=None, help="shape of the timeline (default: the last one)")
    parser.add_argument("--timeline-variant", choices=("chunked", "sync_free_graph"), default="chunked",
                        help="the chunked pipeline (4 chunks, deferred wgrad) or the graphed sync-free layer (symm)")
    parser.add_argument("--skew", action="store_true", help="add a skewed-routing row per shape")
    parser.add_argument("--chunks", default="1,2,4", help="chunk counts to try (capped at the local experts)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--transport-probe", action="store_true",
                        help="also time the dispatch transports alone and beside the expert GEMMs, chunked and not")
    parser.add_argument("--allow-multicast", action="store_true", help="do not force NVLink multicast off")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    disable_multicast(args.allow_multicast)
    if args.fabric == "slow":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # before init_process_group

    import torch
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh, MeshLayout

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    mesh = Mesh.create(MeshLayout(world, ep=world), timeout_s=300)
    bench = Bench(mesh, torch.device("cuda") if cuda else torch.device("cpu"), args)
    rows = []
    for name in args.shapes.split(","):
        rows.append(bench.run_shape(name, SHAPES[name], skew=False))
        if args.skew:
            rows.append(bench.run_shape(name, SHAPES[name], skew=True))
        if args.transport_probe:
            rows.append(bench.transport_probe(name, SHAPES[name]))
    if mesh.rank == 0:
        print_table(rows)
        write_json(args.json, run_header(world), rows)
    if args.timeline and cuda:
        bench.timeline(args.timeline, SHAPES[args.timeline_shape or args.shapes.split(",")[-1]])
    mesh.destroy()
    dist.destroy_process_group()


class Bench:
    def __init__(self, mesh, device, args):
        import torch

        self.torch, self.mesh, self.device, self.args = torch, mesh, device, args
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.backends = ["nccl"] if args.fabric == "slow" or device.type != "cuda" else ["symm", "nccl"]
        if mesh.ep.size == 1:  # nothing to exchange: one transport stands for all (the layer runs its local path)
            self.backends = ["nccl"]
        if device.type != "cuda":
            self.backends = ["gloo"]

    # ---------------------------------------------------------------------------------------- timing
    def _timer(self):
        torch = self.torch
        if self.device.type == "cuda":
            def run(fn):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                return start.elapsed_time(stop)
        else:
            def run(fn):
                t0 = time.perf_counter()
                fn()
                return (time.perf_counter() - t0) * 1e3
        return run

    def round_robin(self, variants: dict) -> dict[str, float]:
        """Median milliseconds of each variant, timed in turns; every rank times the same sequence and the
        slowest rank's time counts (a layer is as fast as its slowest rank)."""
        torch, timer = self.torch, self._timer()
        for fn in variants.values():
            for _ in range(self.args.warmup):
                fn()
        samples = {name: [] for name in variants}
        for _ in range(self.args.rounds):
            for name, fn in variants.items():
                self.torch.distributed.barrier()
                samples[name].append(timer(fn))
        medians = torch.tensor([statistics.median(v) for v in samples.values()], dtype=torch.float64,
                               device=self.device)
        torch.distributed.all_reduce(medians, op=torch.distributed.ReduceOp.MAX)
        return dict(zip(variants, medians.tolist()))

    # ---------------------------------------------------------------------------------------- setup
    def build_layer(self, shape: Shape):
        from moe_overlap.config import ModelConfig, OverlapConfig
        from moe_overlap.distributed.a2a import TransportSelector
        from moe_overlap.layers.init import init_parameters
        from moe_overlap.layers.moe import MoELayer

        cfg = ModelConfig(hidden_size=shape.hidden, ffn_hidden_size=shape.ffn, num_moe_experts=shape.experts,
                          moe_router_topk=shape.topk, moe_aux_loss_coeff=0.0)
        local = shape.experts // self.mesh.ep.size
        selectors = {b: TransportSelector(b, self.mesh.ep.group, self.mesh.ep.ranks, self.device, max(local, 1), 300)
                     for b in self.backends}
        layer = MoELayer(cfg, OverlapConfig(moe_overlap_dispatch=True, moe_a2a_chunks=1), self.mesh.ep,
                         selectors[self.backends[0]], self.device, self.dtype)
        init_parameters(layer, seed=1234, std=0.02, num_layers=1)
        return layer, selectors

    def inputs(self, shape: Shape, skew: bool):
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(100 + self.mesh.rank)
        x = torch.randn(shape.tokens, shape.hidden, device=self.device, dtype=self.dtype, generator=g)
        if skew:  # half the tokens lean towards the first rank's experts
            x[: shape.tokens // 2] += 0.5
        grad = torch.randn(shape.tokens, shape.hidden, device=self.device, dtype=self.dtype, generator=g)
        return x.unsqueeze(0).requires_grad_(True), grad.unsqueeze(0)

    # ------------------------------------------------------------------------------------------ rows
    def run_shape(self, name: str, shape: Shape, skew: bool) -> dict:
        torch = self.torch
        layer, selectors = self.build_layer(shape)
        if skew:
            with torch.no_grad():  # a router that prefers the first rank's experts
                layer.router.weight[: shape.experts // self.mesh.ep.size] += 0.05
        x, grad = self.inputs(shape, skew)
        local = shape.experts // self.mesh.ep.size
        chunk_options = sorted({min(int(c), local) for c in self.args.chunks.split(",")})

        def layer_fn(backend, chunks, delay, backward, overlap=True, sync_free=False):
            def fn():
                layer.overlap_dispatch, layer.chunks, layer.delay_wgrad = overlap and not sync_free, chunks, delay
                layer.sync_free = sync_free
                layer.transports = selectors[backend]
                layer.zero_grad(set_to_none=True)  # time the layer, not the accumulation into old grads
                x.grad = None
                out, _, _ = layer(x)
                if backward:
                    out.backward(grad)
            return fn

        settings = [(b, c, d) for b in self.backends for c in chunk_options for d in (False, True)]
        sync_free = ("symm" if "symm" in self.backends else "gloo" if "gloo" in self.backends
                     else self.backends[0] if self.mesh.ep.size == 1 else None)  # one rank: the local path
        graph_layer = (self.graphed_layer(layer, shape, selectors[sync_free], x)
                       if sync_free and self.device.type == "cuda" else None)

        def graph_fn(backward):
            def fn():
                graph_layer.zero_grad(set_to_none=True)
                x.grad = None
                out, _, _ = graph_layer(x)
                if backward:
                    out.backward(grad)
            return fn

        probe = self.probe(layer, shape, x, selectors)
        baseline = Baseline(layer, self.mesh, shape)
        row = {"shape": name + ("_skew" if skew else ""), "fabric": self.args.fabric}
        for backward, suffix in ((False, "fwd"), (True, "fwdbwd")):
            variants = {"serial": layer_fn(self.backends[0], 1, False, backward, overlap=False)}
            for b, c, d in settings:
                if d and not backward:
                    continue  # deferring wgrad changes nothing in the forward
                variants[f"overlapped:{b}:{c}:{int(d)}"] = layer_fn(b, c, d, backward)
            if sync_free:  # dropless without a host sync: eager, and (CUDA) replayed from CUDA graphs
                variants["overlapped:sync_free:1:0"] = layer_fn(sync_free, 1, False, backward, sync_free=True)
            if graph_layer is not None:
                variants["overlapped:sync_free_graph:1:0"] = graph_fn(backward)
            variants.update(probe.variants(backward))
            variants["baseline"] = baseline.fn(x, grad, backward)
            times = self.round_robin(variants)
            best = min((k for k in times if k.startswith("overlapped")), key=times.get)
            comm = min(times[k] for k in times if k.startswith("comm:"))
            row.update({f"serial_{suffix}_ms": times["serial"], f"overlapped_{suffix}_ms": times[best],
                        f"comm_{suffix}_ms": comm, f"gemm_{suffix}_ms": times["gemm"],
                        f"limit_{suffix}_ms": max(comm, times["gemm"]), f"baseline_{suffix}_ms": times["baseline"]})
            row[f"variants_{suffix}_ms"] = {k: round(v, 4) for k, v in times.items()}
            if backward:
                _, row["backend"], row["chunks"], row["delay_wgrad"] = best.split(":")
                row["chunks"], row["delay_wgrad"] = int(row["chunks"]), bool(int(row["delay_wgrad"]))
        row.update(probe.tokens_per_rank())
        return row

    def graphed_layer(self, like, shape: Shape, selector, x):
        """A second layer with ``like``'s weights and the sync-free dispatch, captured the way the trainer does
        it (``train.moe_cuda_graph``): training-mode calls replay its forward and backward graphs."""
        from moe_overlap.layers.moe import capture_moe_layers

        layer, _ = self.build_layer(shape)
        layer.load_state_dict(like.state_dict())
        layer.overlap_dispatch, layer.sync_free, layer.transports = False, True, selector
        capture_moe_layers((layer,), tuple(x.shape))
        return layer

    def transport_probe(self, name: str, shape: Shape) -> dict:
        """Each transport moving one dispatch alone, and beside the forward expert GEMMs on the compute
        stream (sent before the GEMMs, received after), unchunked and in chunks."""
        layer, selectors = self.build_layer(shape)
        x, _ = self.inputs(shape, skew=False)
        local = shape.experts // self.mesh.ep.size
        variants = {}
        for chunks in sorted({1, min(4, local)}):
            probe = Probe(self, layer, shape, x, selectors, chunks)
            variants.update(probe.exchange_variants(f":{chunks}"))
        times = self.round_robin(variants)
        return {"shape": name, "fabric": self.args.fabric, "kind": "transport_probe",
                "times_ms": {k: round(v, 4) for k, v in times.items()}}

    def probe(self, layer, shape, x, selectors):
        return Probe(self, layer, shape, x, selectors)

    # -------------------------------------------------------------------------------------- timeline
    def timeline(self, path: str, shape: Shape):
        """Profile one overlapped forward+backward and draw compute and transport as lanes."""
        torch = self.torch
        from torch.profiler import ProfilerActivity, profile

        from moe_overlap.training.profiling import draw_timeline

        layer, selectors = self.build_layer(shape)
        x, grad = self.inputs(shape, skew=False)
        local = shape.experts // self.mesh.ep.size
        layer.chunks, layer.delay_wgrad = min(4, local), True
        title = f"overlapped MoE layer fwd+bwd, {layer.chunks} chunks, {selectors[self.backends[0]].name}"
        if self.args.timeline_variant == "sync_free_graph":
            layer = self.graphed_layer(layer, shape, selectors[self.backends[0]], x)
            title = "MoE layer fwd+bwd, sync-free dispatch (symm), replayed from CUDA graphs"
        for _ in range(3):
            layer(x)[0].backward(grad)
        torch.cuda.synchronize()
        torch.distributed.barrier()  # ranks enter together: else the counts all-gather shows one rank's wait
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            layer(x)[0].backward(grad)
            torch.cuda.synchronize()
        if self.mesh.rank == 0:
            draw_timeline(prof, path, title)
            Path(path).with_suffix(".txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
                + "\n\nhost side, by CPU time:\n"
                + prof.key_averages().table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=60))


class Probe:
    """The limit's two halves for the same routing: the transports alone and the expert GEMMs alone."""

    def __init__(self, bench: Bench, layer, shape: Shape, x, selectors, chunks: int = 1):
        torch = bench.torch
        from moe_overlap.layers.dispatcher import DispatchPlanner, start_counts_fetch

        self.bench, self.layer, self.shape, self.selectors = bench, layer, shape, selectors
        with torch.no_grad():
            x_TH = x.detach().reshape(-1, shape.hidden)
            routing = layer.router(x_TH)
            planner = DispatchPlanner(shape.experts, bench.mesh.ep, chunks, x.device)
            self.plan = planner.plan(routing.experts_TK, None, None,
                                     start_counts_fetch(routing.tokens_per_expert_E, bench.mesh.ep))
        layout = self.plan.exchange.layout
        self.send_RH = torch.randn(layout.send_total, shape.hidden, device=x.device, dtype=x.dtype)
        self.grouped_RH = torch.randn(layout.recv_total, shape.hidden, device=x.device, dtype=x.dtype)
        self.grad_y_RH = torch.randn_like(self.grouped_RH)

    def tokens_per_rank(self) -> dict:
        from moe_overlap.distributed.collectives import all_gather_into

        torch = self.bench.torch
        received = torch.tensor([float(self.plan.exchange.layout.recv_total)], device=self.bench.device)
        every = all_gather_into(torch.zeros(self.bench.mesh.ep.size, device=self.bench.device), received,
                                self.bench.mesh.ep.group)
        return {"tokens_per_rank_max": int(every.max()), "tokens_per_rank_mean": float(every.mean())}

    def exchange_variants(self, suffix: str) -> dict:
        """One dispatch exchange per transport, alone and beside the GEMMs; and the GEMMs alone."""
        from moe_overlap.layers.experts import experts_forward

        layout, offsets = self.plan.exchange.layout, self.plan.exchange.offsets
        w13, w2 = self.layer.experts.w13.detach(), self.layer.experts.w2.detach()
        bounds = self.plan.exchange.chunk_experts
        shape, ep = self.shape, self.bench.mesh.ep.size
        worst_bytes = ep * shape.tokens * shape.topk * shape.hidden * self.send_RH.element_size()

        def gemm():
            for chunk, (first, last) in enumerate(bounds):
                start, stop = layout.recv_range(chunk)
                experts_forward(self.grouped_RH[start:stop], offsets[chunk], w13[first:last], w2[first:last])

        out = {f"gemm{suffix}": gemm}
        for name, selector in self.selectors.items():
            def exchange(beside: bool, selector=selector):
                ex = selector.transport(worst_bytes).exchange(self.send_RH, layout)
                for chunk in range(layout.num_chunks):
                    ex.send(chunk)
                if beside:
                    gemm()
                for chunk in range(layout.num_chunks):
                    ex.recv(chunk)
                ex.finish()
            out[f"{name}_alone{suffix}"] = lambda exchange=exchange: exchange(False)
            out[f"{name}_beside_gemm{suffix}"] = lambda exchange=exchange: exchange(True)
        return out

    def variants(self, backward: bool) -> dict:
        from moe_overlap.layers.experts import WgradInputs, experts_dgrad, experts_forward, experts_wgrad

        layout, offsets = self.plan.exchange.layout, self.plan.exchange.offsets[0]
        w13, w2 = self.layer.experts.w13.detach(), self.layer.experts.w2.detach()
        out = {}
        # The layer's worst case, identical on every rank (a symmetric workspace is made collectively).
        shape, ep = self.shape, self.bench.mesh.ep.size
        worst_bytes = ep * shape.tokens * shape.topk * shape.hidden * self.send_RH.element_size()
        for name, selector in self.selectors.items():
            def comm(selector=selector):
                transport = selector.transport(worst_bytes)
                for i in range(4 if backward else 2):  # dispatch, combine (, their gradients)
                    lay = layout if i % 2 == 0 else layout.reversed()
                    src = self.send_RH if i % 2 == 0 else self.grouped_RH
                    ex = transport.exchange(src, lay)
                    ex.send(0)
                    ex.recv(0)
                    ex.finish()
            out[f"comm:{name}"] = comm

        def gemm():
            y, h = experts_forward(self.grouped_RH, offsets, w13, w2)
            if backward:
                gx, gh, a = experts_dgrad(self.grad_y_RH, h, offsets, w13, w2)
                experts_wgrad(w13, w2, [WgradInputs(self.grouped_RH, a, gh, self.grad_y_RH, offsets)])
        out["gemm"] = gemm
        return out


class Baseline:
    """Plain torch, as a user would write it: argsort permute, all_to_all_single, torch._grouped_mm."""

    def __init__(self, layer, mesh, shape: Shape):
        self.layer, self.mesh, self.shape = layer, mesh, shape

    def fn(self, x, grad, backward: bool):
        import torch
        import torch.nn.functional as F

        from moe_overlap.distributed.collectives import AllToAllRows, all_to_all_equal

        layer, mesh, shape = self.layer, self.mesh, self.shape
        ep, local = mesh.ep.size, shape.experts // mesh.ep.size

        def run():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            x_TH = x.reshape(-1, shape.hidden)
            logits = x_TH.float() @ layer.router.weight.float().t()
            top, experts = torch.topk(logits, shape.topk, dim=-1)
            probs = torch.softmax(top, dim=-1)
            flat = experts.flatten()
            order = torch.argsort(flat, stable=True)
            sent = x_TH[order // shape.topk]
            counts = torch.bincount(flat, minlength=shape.experts)
            received = all_to_all_equal(counts.view(ep, local), mesh.ep.group)
            send_splits = counts.view(ep, local).sum(1).tolist()
            recv_splits = received.sum(1).tolist()
            rows = AllToAllRows.apply(sent, recv_splits, send_splits, mesh.ep.group)
            key = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received.flatten())
            regroup = torch.argsort(key, stable=True)
            grouped = rows[regroup]
            offs = torch.cumsum(received.sum(0), 0).to(torch.int32)
            h = torch._grouped_mm(grouped, layer.experts.w13, offs=offs)
            gate, up = h.chunk(2, dim=-1)
            y = torch._grouped_mm(F.silu(gate) * up, layer.experts.w2, offs=offs)
            back = torch.empty_like(y)
            back[regroup] = y
            combined = AllToAllRows.apply(back, send_splits, recv_splits, mesh.ep.group)
            weighted = combined * probs.flatten()[order].unsqueeze(-1).to(combined.dtype)
            out = torch.zeros_like(x_TH).index_add(0, order // shape.topk, weighted)
            if backward:
                out.backward(grad.reshape_as(out))
        return run


def print_table(rows: list[dict]) -> None:
    for row in rows:
        if row.get("kind") == "transport_probe":
            print(f"\ntransport probe {row['shape']} {row['fabric']}: "
                  + "  ".join(f"{k}={v:.3f}" for k, v in sorted(row["times_ms"].items())))
    rows = [row for row in rows if row.get("kind") != "transport_probe"]
    cols = ("serial", "overlapped", "comm", "gemm", "limit", "baseline")
    for suffix in ("fwd", "fwdbwd"):
        print(f"\n{suffix} ms" + "".join(f"{c:>12}" for c in cols) + "   overlapped/limit  best")
        for row in rows:
            ratio = row[f"overlapped_{suffix}_ms"] / row[f"limit_{suffix}_ms"]
            print(f"{row['shape'] + ' ' + row['fabric']:<22}" + "".join(f"{row[f'{c}_{suffix}_ms']:12.3f}" for c in cols)
                  + f"   {ratio:8.3f}        {row['backend']}:{row['chunks']}:{int(row['delay_wgrad'])}")


if __name__ == "__main__":
    main()
