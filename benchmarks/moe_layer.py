"""One MoE layer's forward and forward+backward under expert parallelism: serial, the pipeline per planning mode,
the limit, and a plain-torch baseline, measured side by side in one run (also `moe-overlap bench moe`).

    torchrun --nproc-per-node 2 benchmarks/moe_layer.py --shapes mixtral,fine,fine_small --fabric nvlink \\
        --json benchmarks/results/moe_layer_2xh200_nvlink.json --timeline benchmarks/results/moe_layer_fine.png
    torchrun --nproc-per-node 1 benchmarks/moe_layer.py ...    # EP=1: the layer's own work against its GEMMs

Rows per shape, one per planning mode (key ``planning``), each with the keys below:
  host        the pipeline with host-planned sizes: every (transport, chunks, delay_wgrad) setting timed, the
              best reported as ``overlapped``
  device      the pipeline with device-planned sizes (SM pushes; gloo's twin on CPU), every (chunks, delay_wgrad,
              carve-out) setting eagerly, and replayed from CUDA graphs as train.moe_cuda_graph does it (CUDA;
              the ``--graph-chunks`` counts, default 1)
  local       (one rank) what the layer runs at EP=1: no exchange at all, eagerly and graphed
At EP=1 the host and device rows run the pipeline over the one-rank group (its rows pushed into its own
memory): the pipeline's own cost, which a two-GPU run adds to its communication.
  serial      the serial reference path (pipeline off; the local path at EP=1)
  comm        the fastest transport moving the full, unchunked dispatch and combine (forward), and their
              gradients too (forward+backward), for the same routing; the rows the layers move: each token once
              per rank (wire rows) where ``--once-per-rank`` (auto: as training, from top-4) has it
  gemm        the unchunked expert GEMMs alone on the same per-expert counts: fc1, SwiGLU, fc2 (forward),
              plus dgrad and wgrad (forward+backward; into the fp32 main_grad that the layer's parameters carry,
              as a training step has them)
  limit       max(comm, gemm)
  baseline    plain torch: router, argsort permute, all_to_all_single, torch._grouped_mm, all_to_all_single
``--carveout-probe`` adds, per shape, what a carve-out of N SMs costs the grouped GEMMs and what the push kernel
moves per CTA alone and beside a carved-out GEMM (into its own memory on one GPU, a peer's on more): the values
``overlap.gemm_sm_carveout: auto`` sizes pushes by (layers/moe.py).
Variants run round-robin (A B C A B C ...) and report medians: clocks drift under sustained load (the same
grouped FFN took 4.29-5.82 ms within one H200 run).
`--fabric slow` sets NCCL_P2P_DISABLE=1 (NCCL through host memory, standing in for an inter-node link) and
forces the nccl transport. `--shapes tiny` runs on CPU with gloo (the CI smoke test).
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

from benchmarks.common import run_header, set_run_env, write_json  # noqa: E402

CTAS = (1, 2, 4, 8, 16, 32)  # the carve-out probe's push widths
BULK_STAGES = ((2, 65536), (6, 32768), (8, 16384), (12, 16384))  # (stages, bytes a stage) beside bulk_push's 4 x 32K


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


@dataclass(frozen=True)
class Setting:
    """One way to run the layer: the pipeline's planning and transport (None: the serial path), chunks,
    delay_wgrad, carve-out, and whether it replays from CUDA graphs."""

    planning: str | None
    transport: str = "auto"
    chunks: int = 1
    delay: bool = False
    sms: int | str = 0
    graphed: bool = False

    @property
    def name(self) -> str:
        if self.planning is None:
            return "local_graph" if self.graphed else "serial"
        return f"{self.planning}:{self.transport}:{self.chunks}:{int(self.delay)}:{self.sms}" + (
            ":graph" if self.graphed else "")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral,fine,fine_small")
    parser.add_argument("--fabric", choices=("nvlink", "slow"), default="nvlink")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeline", default=None,
                        help="PNG of one forward+backward (GPU only), and a .txt kernel table beside it")
    parser.add_argument("--timeline-shape", default=None, help="shape of the timeline (default: the last one)")
    parser.add_argument("--timeline-variant", choices=("host", "device", "device_graph", "local_graph"),
                        default="device", help="the pipeline (4 chunks, deferred wgrad; device: carve-out auto), "
                                               "replayed from CUDA graphs, or the graphed local path (EP=1)")
    parser.add_argument("--skew", action="store_true", help="add skewed-routing rows per shape")
    parser.add_argument("--chunks", default="1,2,4", help="chunk counts to try (capped at the local experts)")
    parser.add_argument("--carveouts", default="0,auto",
                        help="GEMM SM carve-outs of the device-planned pipeline (eager and graphed, with chunks)")
    parser.add_argument("--graph-chunks", default="1",
                        help="chunk counts also replayed from CUDA graphs (default 1, as training graphs it); each "
                             "graph keeps its own worst-case buffers (the Mixtral shape at EP=4 ran out of 80 GB "
                             "with two)")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="overlap.moe_expert_rank_capacity_factor of the device-planned layers (default null, the "
                             "worst case); the rows record what overflowed, which this benchmark does not run again")
    parser.add_argument("--once-per-rank", choices=("auto", "true", "false"), default="auto",
                        help="overlap.moe_dispatch_once_per_rank of the pipelined layers and the exchange probes: "
                             "each token's wire rows cross to a rank once, or one row per (token, expert) copy; auto "
                             "as training resolves it, on from top-k tuning.ONCE_PER_RANK_MIN_TOPK")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--transport-probe", action="store_true",
                        help="also time the dispatch transports alone and beside the expert GEMMs, chunked and not")
    parser.add_argument("--carveout-probe", action="store_true",
                        help="also time the grouped GEMMs under SM carve-outs and the push kernel per CTA count")
    parser.add_argument("--probe-only", action="store_true", help="only the probes, not the layer's settings")
    parser.add_argument("--allow-multicast", action="store_true", help="do not force NVLink multicast off")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    set_run_env(args.allow_multicast, args.fabric)

    import torch.distributed as dist

    bench = Bench.launched(args)
    mesh, cuda, world = bench.mesh, bench.device.type == "cuda", bench.mesh.world_size
    rows = []
    for name in args.shapes.split(","):
        if not args.probe_only:
            rows += bench.run_shape(name, SHAPES[name], skew=False)
        if args.skew:
            rows += bench.run_shape(name, SHAPES[name], skew=True)
        if args.transport_probe:
            rows.append(bench.transport_probe(name, SHAPES[name]))
        if args.carveout_probe and cuda:
            rows.append(bench.carveout_probe(name, SHAPES[name]))
        if dist.get_rank() == 0:  # after every shape: a run cut short keeps what it measured
            write_json(args.json, run_header(world), rows)
    if dist.get_rank() == 0:
        print_table(rows)
    if args.timeline and cuda:
        bench.timeline(args.timeline, SHAPES[args.timeline_shape or args.shapes.split(",")[-1]])
    mesh.destroy()
    dist.destroy_process_group()


class Bench:
    @classmethod
    def launched(cls, args) -> Bench:
        """The bench of this torchrun process: its GPU (or the CPU), the process group, EP over every rank."""
        import torch
        import torch.distributed as dist

        from moe_overlap.distributed.mesh import Mesh, MeshLayout

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        world = dist.get_world_size()
        mesh = Mesh.create(MeshLayout(world, ep=world), timeout_s=300) if world > 1 else Mesh.single()
        return cls(mesh, torch.device("cuda") if cuda else torch.device("cpu"), args)

    def __init__(self, mesh, device, args):
        import torch

        self.torch, self.mesh, self.device, self.args = torch, mesh, device, args
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if device.type != "cuda":
            self.transports = {"host": ["gloo"], "device": ["gloo"]}
        elif args.fabric == "slow":
            self.transports = {"host": ["nccl"], "device": []}
        else:  # one host (or one GPU: regions in its own memory)
            self.transports = {"host": ["copy_engine", "nccl"], "device": ["sm_push"]}
        self.local = mesh.ep.size == 1
        self._selectors = {}

    def once_per_rank(self, shape: Shape) -> bool:
        """Whether the shape's layers and probes send each token once per rank (``--once-per-rank``)."""
        from moe_overlap.tuning import ONCE_PER_RANK_MIN_TOPK

        if self.args.once_per_rank == "auto":
            return shape.topk >= ONCE_PER_RANK_MIN_TOPK
        return self.args.once_per_rank == "true"

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
                torch.distributed.barrier()
                samples[name].append(timer(fn))
        medians = torch.tensor([statistics.median(v) for v in samples.values()], dtype=torch.float64,
                               device=self.device)
        torch.distributed.all_reduce(medians, op=torch.distributed.ReduceOp.MAX)
        return dict(zip(variants, medians.tolist()))

    # ---------------------------------------------------------------------------------------- setup
    def selector(self, planning: str, transport: str, local_experts: int):
        """One selector per (planning, transport, local experts), as a model shares one between its layers: its
        regions hold one data channel per chunk, and the chunks are capped at the local experts (a shape with
        fewer must not leave its regions to the next)."""
        from moe_overlap.distributed.a2a import TransportSelector

        key = (planning, transport, local_experts)
        if key not in self._selectors:
            self._selectors[key] = TransportSelector(planning, transport, self.mesh.ep.group, self.mesh.ep.ranks,
                                                     self.device, max(local_experts, 1), 300)
        return self._selectors[key]

    def build_layer(self, shape: Shape, setting: Setting = Setting(None)):
        torch = self.torch
        from moe_overlap.config import ModelConfig, OverlapConfig
        from moe_overlap.layers.init import init_parameters
        from moe_overlap.layers.moe import MoELayer
        from moe_overlap.layers.param_info import param_info
        from moe_overlap.layers.wgrad import take_grad

        cfg = ModelConfig(hidden_size=shape.hidden, ffn_hidden_size=shape.ffn, num_moe_experts=shape.experts,
                          moe_router_topk=shape.topk, moe_aux_loss_coeff=0.0)
        overlap = OverlapConfig(moe_pipeline=False, moe_expert_rank_capacity_factor=self.args.capacity_factor,
                                moe_dispatch_once_per_rank=self.once_per_rank(shape))
        layer = MoELayer(cfg, overlap, self.mesh.ep, None, self.device, self.dtype)
        init_parameters(layer, seed=1234, std=0.02, num_layers=1)
        for param in layer.parameters():  # as the optimizer attaches them: weight gradients land as in training
            param_info(param).main_grad = torch.zeros_like(param, dtype=torch.float32)
            param.register_post_accumulate_grad_hook(take_grad)
        return self.configure(layer, shape, setting)

    def configure(self, layer, shape: Shape, setting: Setting):
        """The layer runs ``setting`` from now on (the fields MoELayer reads from the config)."""
        local_experts = shape.experts // self.mesh.ep.size
        layer.pipelined = setting.planning is not None
        layer.local = self.local and not layer.pipelined  # EP=1: the pipeline over the one-rank group
        layer.chunks, layer.delay_wgrad, layer.carveout = min(setting.chunks, local_experts), setting.delay, setting.sms
        if layer.pipelined:
            layer.transports = self.selector(setting.planning, setting.transport, local_experts)
            layer.planning = layer.transports.planning
        return layer

    def graphed(self, like, shape: Shape, setting: Setting, x):
        """A second layer with ``like``'s weights, captured the way the trainer does it (train.moe_cuda_graph):
        training-mode calls replay its forward and backward graphs."""
        from moe_overlap.layers.moe import capture_moe_layers

        layer = self.build_layer(shape, setting)
        layer.load_state_dict(like.state_dict())
        capture_moe_layers((layer,), tuple(x.shape))
        return layer

    def inputs(self, shape: Shape, skew: bool):
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(100 + self.mesh.rank)
        x = torch.randn(shape.tokens, shape.hidden, device=self.device, dtype=self.dtype, generator=g)
        if skew:  # half the tokens lean towards the first rank's experts
            x[: shape.tokens // 2] += 0.5
        grad = torch.randn(shape.tokens, shape.hidden, device=self.device, dtype=self.dtype, generator=g)
        return x.unsqueeze(0).requires_grad_(True), grad.unsqueeze(0)

    def settings(self, shape: Shape) -> dict[str, list[Setting]]:
        local = shape.experts // self.mesh.ep.size
        chunks = sorted({min(int(c), local) for c in self.args.chunks.split(",")})
        carveouts = [c if c == "auto" else int(c) for c in self.args.carveouts.split(",")]
        out = {"host": [Setting("host", t, c, d) for t in self.transports["host"] for c in chunks
                        for d in ((False, True) if c > 1 else (False,))],
               "device": [Setting("device", t, c, d, s) for t in self.transports["device"] for c in chunks
                          for d in ((False, True) if c > 1 else (False,)) for s in (carveouts if c > 1 else [0])]}
        if self.device.type == "cuda":  # replayed from graphs, as training runs it
            graphed = sorted({min(int(c), local) for c in self.args.graph_chunks.split(",")})
            out["device"] += [Setting("device", t, c, False, s, True) for t in self.transports["device"]
                              for c in graphed for s in (carveouts if c > 1 else [0])]
        if self.local:
            out["local"] = [Setting(None, graphed=True)] if self.device.type == "cuda" else []
        return {planning: found for planning, found in out.items() if found or planning == "local"}

    # ------------------------------------------------------------------------------------------ rows
    def run_shape(self, name: str, shape: Shape, skew: bool) -> list[dict]:
        torch = self.torch
        layer = self.build_layer(shape)
        if skew:
            with torch.no_grad():  # a router that prefers the first rank's experts
                layer.router.weight[: shape.experts // self.mesh.ep.size] += 0.05
        x, grad = self.inputs(shape, skew)
        by_planning = self.settings(shape)
        layers = {s.name: self.graphed(layer, shape, s, x) for found in by_planning.values() for s in found
                  if s.graphed}

        def layer_fn(setting: Setting, backward: bool):
            def fn():
                run = layers[setting.name] if setting.graphed else self.configure(layer, shape, setting)
                run.zero_grad(set_to_none=True)  # time the layer, not the accumulation into old grads
                x.grad = None
                out, _, _ = run(x)
                if backward:
                    out.backward(grad)
            return fn

        probe = Probe(self, layer, shape, x)
        baseline = Baseline(layer, self.mesh, shape)
        times = {}
        for backward, suffix in ((False, "fwd"), (True, "fwdbwd")):
            variants = {"serial": layer_fn(Setting(None), backward)}
            for found in by_planning.values():
                for s in found:
                    if not (s.delay and not backward):  # deferring wgrad changes nothing in the forward
                        variants[s.name] = layer_fn(s, backward)
            variants.update(probe.variants(backward))
            variants["baseline"] = baseline.fn(x, grad, backward)
            times[suffix] = self.round_robin(variants)
            self.configure(layer, shape, Setting(None))
        rows = []
        for planning, found in by_planning.items():
            names = [s.name for s in found] or ["serial"]  # local, CPU: the eager local path is the serial one
            row = {"shape": name + ("_skew" if skew else ""), "fabric": self.args.fabric, "planning": planning}
            for suffix, measured in times.items():
                best = min((n for n in names if n in measured), key=measured.get)
                comm = min(measured[k] for k in measured if k.startswith("comm:"))
                row.update({f"serial_{suffix}_ms": measured["serial"], f"overlapped_{suffix}_ms": measured[best],
                            f"comm_{suffix}_ms": comm, f"gemm_{suffix}_ms": measured["gemm"],
                            f"limit_{suffix}_ms": max(comm, measured["gemm"]),
                            f"baseline_{suffix}_ms": measured["baseline"]})
                row[f"variants_{suffix}_ms"] = {k: round(v, 4) for k, v in measured.items()}
                if suffix == "fwdbwd":
                    setting = next((s for s in found if s.name == best), Setting(None))
                    row["best"], row["backend"] = best, setting.transport if setting.planning else best
                    row["chunks"], row["delay_wgrad"], row["carveout"] = setting.chunks, setting.delay, setting.sms
            row.update(probe.tokens_per_rank())
            row["capacity_factor"], row["once_per_rank"] = self.args.capacity_factor, self.once_per_rank(shape)
            row["overflow_rows"] = sum(int(sel.overflow_rows) for sel in self._selectors.values())  # 0: every row
            rows.append(row)
        return rows

    def transport_probe(self, name: str, shape: Shape) -> dict:
        """Each transport moving one dispatch alone, and beside the forward expert GEMMs on the compute
        stream (sent before the GEMMs, received after), unchunked and in chunks."""
        layer = self.build_layer(shape)
        x, _ = self.inputs(shape, skew=False)
        local = shape.experts // self.mesh.ep.size
        variants = {}
        for chunks in sorted({1, min(4, local)}):
            variants.update(Probe(self, layer, shape, x, chunks).exchange_variants(f":{chunks}"))
        times = self.round_robin(variants)
        return {"shape": name, "fabric": self.args.fabric, "kind": "transport_probe",
                "times_ms": {k: round(v, 4) for k, v in times.items()}}

    def carveout_probe(self, name: str, shape: Shape) -> dict:
        """The grouped FFN (forward, and dgrad) under carve-outs of N SMs; the push kernel moving a quarter of a
        rank's rows with N CTAs, alone and beside the FFN carved out by N (the FFN launched first); local stores
        on one GPU, the next rank's region on more."""
        torch = self.torch
        from benchmarks.bulk_push import bulk_push_rows
        from moe_overlap.kernels.push_rows import push_rows
        from moe_overlap.layers.experts import experts_dgrad, experts_forward

        from moe_overlap.distributed.streams import gemm_sm_carveout

        layer = self.build_layer(shape)
        rows = shape.tokens * shape.topk
        local = shape.experts // self.mesh.ep.size
        x = torch.randn(rows, shape.hidden, device=self.device, dtype=self.dtype)
        offsets = torch.linspace(rows / local, rows, local, device=self.device).to(torch.int32)
        w13, w2 = layer.experts.w13.detach(), layer.experts.w2.detach()
        y, h = experts_forward(x, offsets, w13, w2)
        moved = rows // 4
        dest = torch.empty_like(x)
        peer = (self.mesh.ep.rank + 1) % self.mesh.ep.size
        if self.mesh.ep.size > 1:  # a peer's region, as the pipeline pushes
            transport = self.selector("device", "sm_push", local).transport(x.numel() * x.element_size())
            bases = transport._bases[0]
        else:
            bases = torch.tensor([dest.data_ptr()], dtype=torch.int64, device=self.device)
        zero, count = torch.zeros(1, dtype=torch.int64, device=self.device), torch.tensor([moved], device=self.device)
        ranks = torch.full((rows,), peer if self.mesh.ep.size > 1 else 0, dtype=torch.int32, device=self.device)
        dst_rows = torch.arange(rows, device=self.device)
        side = torch.cuda.Stream()

        def ffn(sms):
            with gemm_sm_carveout(sms):
                experts_forward(x, offsets, w13, w2)

        def dgrad(sms):
            with gemm_sm_carveout(sms):
                experts_dgrad(y, h, offsets, w13, w2)

        def push(ctas):
            push_rows(x, zero, count, ranks, dst_rows, zero, bases, ctas)

        def bulk(ctas):
            bulk_push_rows(x, zero, count, ranks, dst_rows, zero, bases, ctas)

        def beside(ctas, mover=push):
            side.wait_stream(torch.cuda.current_stream())
            ffn(ctas)  # launched first, then the push on the free SMs
            with torch.cuda.stream(side):
                mover(ctas)
            torch.cuda.current_stream().wait_stream(side)

        # The bulk-copy push moves what the Triton push moves (into this rank's own memory, checked here).
        mine = torch.tensor([dest.data_ptr()], dtype=torch.int64, device=self.device)
        local = torch.zeros_like(ranks)
        dest.zero_()
        bulk_push_rows(x, zero, count, local, dst_rows, zero, mine, 8)
        bulk_out = dest[:moved].clone()
        push_rows(x, zero, count, local, dst_rows, zero, mine, 8)
        bulk_matches = bool(torch.equal(bulk_out, dest[:moved]) and torch.equal(bulk_out, x[:moved]))
        variants = {}
        for sms in (0, 4, 8, 16, 32):
            variants[f"ffn_c{sms}"] = lambda sms=sms: ffn(sms)
            variants[f"dgrad_c{sms}"] = lambda sms=sms: dgrad(sms)
        for ctas in CTAS:
            variants[f"push_{ctas}"] = lambda ctas=ctas: push(ctas)
            variants[f"bulk_{ctas}"] = lambda ctas=ctas: bulk(ctas)
        for ctas in (4, 8, 16):
            variants[f"ffn_c{ctas}+push_{ctas}"] = lambda ctas=ctas: beside(ctas)
            variants[f"ffn_c{ctas}+bulk_{ctas}"] = lambda ctas=ctas: beside(ctas, bulk)
        for stages, stage_bytes in BULK_STAGES:  # the bulk push's depth at 8 CTAs
            variants[f"bulk_{stages}x{stage_bytes >> 10}k_8"] = lambda stages=stages, stage_bytes=stage_bytes: (
                bulk_push_rows(x, zero, count, ranks, dst_rows, zero, bases, 8, stages, stage_bytes))
        times = self.round_robin(variants)
        nbytes = moved * shape.hidden * x.element_size()
        return {"shape": name, "kind": "carveout_probe", "push_bytes": nbytes, "peer": self.mesh.ep.size > 1,
                "bulk_matches_push": bulk_matches, "times_ms": {k: round(v, 4) for k, v in times.items()},
                **{f"{mover}_bytes_per_cta_ms": {ctas: round(nbytes / times[f"{mover}_{ctas}"] / ctas)
                                                 for ctas in CTAS} for mover in ("push", "bulk")}}

    # -------------------------------------------------------------------------------------- timeline
    def timeline(self, path: str, shape: Shape):
        """Profile one forward+backward and draw compute and transport as lanes."""
        torch = self.torch
        from torch.profiler import ProfilerActivity, profile

        from moe_overlap.training.profiling import draw_timeline

        variant = self.args.timeline_variant
        x, grad = self.inputs(shape, skew=False)
        planning = "host" if variant == "host" else "device"
        setting = (Setting(None, graphed=True) if variant == "local_graph" else
                   Setting(planning, self.transports[planning][0], 4, True, "auto" if planning == "device" else 0,
                           graphed=variant == "device_graph"))
        layer = self.build_layer(shape)
        if setting.graphed:
            layer = self.graphed(layer, shape, setting, x)
        else:
            self.configure(layer, shape, setting)
        title = f"MoE layer fwd+bwd, {setting.name}"
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
    """The limit's two halves for the same routing: the transports alone (moving wire rows where each token
    crosses once per rank, as the layers do) and the expert GEMMs alone (over every copy's row)."""

    def __init__(self, bench: Bench, layer, shape: Shape, x, chunks: int = 1):
        torch = bench.torch
        from moe_overlap.layers.device_plan import DevicePlanner
        from moe_overlap.layers.host_plan import HostPlanner

        self.bench, self.layer, self.shape = bench, layer, shape
        ep, local = bench.mesh.ep, shape.experts // bench.mesh.ep.size
        with torch.no_grad():
            x_TH = x.detach().reshape(-1, shape.hidden)
            routing = layer.router(x_TH)
            row_bytes = shape.hidden * x.element_size()
            setting = (shape.experts, ep, chunks, False)
            self.experts_plan = HostPlanner(*setting, None, x.device, row_bytes).plan(routing)  # the GEMMs' rows
            once = bench.once_per_rank(shape)
            wire = dict(once_per_rank=once, topk=shape.topk)
            host = HostPlanner(*setting, None, x.device, row_bytes, **wire)  # the rows moved: wire rows, or the same
            self.plans = {"host": host.plan(routing) if once else self.experts_plan}
            sent_bytes = host.wire_bytes if once else row_bytes
            self.worst_bytes = ep.size * shape.tokens * shape.topk * sent_bytes
            for transport in bench.transports["device"]:  # the plan's counts gathered by that transport
                self.plans["device"] = DevicePlanner(*setting, bench.selector("device", transport, local), x.device,
                                                     row_bytes, bench.args.capacity_factor, **wire).plan(routing)
        layout = self.experts_plan.exchange.layout
        self.send_RH = torch.randn(shape.tokens * shape.topk, sent_bytes // x.element_size(), device=x.device,
                                   dtype=x.dtype)  # wire rows: the hidden columns and each copy's weight and slot
        self.back_RH = {}  # the combine's hidden-wide rows, by the rows a rank received
        self.grouped_RH = torch.randn(layout.recv_total, shape.hidden, device=x.device, dtype=x.dtype)
        self.grad_y_RH = torch.randn_like(self.grouped_RH)

    def tokens_per_rank(self) -> dict:
        from moe_overlap.distributed.collectives import all_gather_into

        torch = self.bench.torch
        received = torch.tensor([float(self.experts_plan.exchange.layout.recv_total)], device=self.bench.device)
        every = all_gather_into(torch.zeros(self.bench.mesh.ep.size, device=self.bench.device), received,
                                self.bench.mesh.ep.group)
        return {"tokens_per_rank_max": int(every.max()), "tokens_per_rank_mean": float(every.mean())}

    def _back(self, rows: int):
        if rows not in self.back_RH:
            self.back_RH[rows] = self.bench.torch.randn(rows, self.shape.hidden, device=self.bench.device,
                                                        dtype=self.send_RH.dtype)
        return self.back_RH[rows]

    def _exchanges(self):
        """(name, transport, plan) of every transport the bench runs, its regions sized as the plan sized them (the
        layers' bound, ``--capacity-factor``)."""
        bench, local = self.bench, self.shape.experts // self.bench.mesh.ep.size
        for planning, transports in bench.transports.items():
            for transport in transports:
                chosen = (self.plans["device"].transport if planning == "device" else
                          bench.selector(planning, transport, local).transport(self.worst_bytes))
                yield f"{planning}:{transport}", chosen, self.plans[planning]

    def _move(self, transport, plan, chunks: int, gemm=None) -> None:
        """One dispatch (all chunks sent), optionally with the GEMMs between, then received (an SM push with no
        carve-out runs at full width before the GEMMs: the carve-out probe times it beside them)."""
        from moe_overlap.distributed.streams import Event

        to = transport.to_experts(self.send_RH[:plan.num_rows], plan.routes, 0)
        for chunk in range(chunks):
            to.send(chunk)
        if gemm is not None:
            gemm()
        received = [to.recv(chunk) for chunk in range(chunks)]
        to.finish()
        return received, Event(self.bench.device).record()

    def exchange_variants(self, suffix: str) -> dict:
        """One dispatch exchange per transport, alone and beside the GEMMs; and the GEMMs alone."""
        from moe_overlap.layers.experts import experts_forward

        host, chunk_experts = self.experts_plan.exchange, self.experts_plan.chunk_experts
        w13, w2 = self.layer.experts.w13.detach(), self.layer.experts.w2.detach()
        chunks = len(chunk_experts)

        def gemm():
            for chunk, (first, last) in enumerate(chunk_experts):
                start, stop = host.layout.recv_range(chunk)
                experts_forward(self.grouped_RH[start:stop], host.offsets[chunk], w13[first:last], w2[first:last])

        out = {f"gemm{suffix}": gemm}
        for name, transport, plan in self._exchanges():
            out[f"{name}_alone{suffix}"] = lambda t=transport, p=plan: self._move(t, p, chunks)
            out[f"{name}_beside_gemm{suffix}"] = lambda t=transport, p=plan: self._move(t, p, chunks, gemm)
        return out

    def variants(self, backward: bool) -> dict:
        from moe_overlap.layers.experts import WgradInputs, experts_dgrad, experts_forward, experts_wgrad

        offsets = self.experts_plan.exchange.offsets[0]
        w13, w2 = self.layer.experts.w13.detach(), self.layer.experts.w2.detach()
        out = {}
        for name, transport, plan in self._exchanges():
            def comm(transport=transport, plan=plan):
                for _ in range(2 if backward else 1):  # dispatch and combine (, their gradients)
                    (rows,), made = self._move(transport, plan, 1)
                    back_rows = self._back(rows.shape[0])  # the combine sends hidden-wide rows back
                    back = transport.from_experts(plan.routes, back_rows.shape[1], back_rows, 0)
                    back.send(0, back_rows, made)
                    back.result()
                    back.finish()
            out[f"comm:{name}"] = comm

        params = self.layer.experts.w13, self.layer.experts.w2  # their main_grad: the training step's wgrad

        def gemm():
            y, h = experts_forward(self.grouped_RH, offsets, w13, w2)
            if backward:
                gx, gh, a = experts_dgrad(self.grad_y_RH, h, offsets, w13, w2)
                experts_wgrad(*params, [WgradInputs(self.grouped_RH, a, gh, self.grad_y_RH, offsets)])
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
        if row.get("kind") in ("transport_probe", "carveout_probe"):
            print(f"\n{row['kind']} {row['shape']}: "
                  + "  ".join(f"{k}={v:.3f}" for k, v in sorted(row["times_ms"].items())))
            if "push_bytes_per_cta_ms" in row:
                print("  push bytes per CTA per ms: " + "  ".join(
                    f"{ctas}: {rate:.3g}" for ctas, rate in row["push_bytes_per_cta_ms"].items()))
    rows = [row for row in rows if row.get("kind") is None]
    cols = ("serial", "overlapped", "comm", "gemm", "limit", "baseline")
    for suffix in ("fwd", "fwdbwd"):
        print(f"\n{suffix} ms" + " " * 16 + "".join(f"{c:>12}" for c in cols) + "   overlapped/limit  best fwd+bwd")
        for row in rows:
            ratio = row[f"overlapped_{suffix}_ms"] / row[f"limit_{suffix}_ms"]
            label = f"{row['shape']} {row['fabric']} {row['planning']}"
            print(f"{label:<30}" + "".join(f"{row[f'{c}_{suffix}_ms']:12.3f}" for c in cols)
                  + f"   {ratio:8.3f}        {row['best']}")


if __name__ == "__main__":
    main()
