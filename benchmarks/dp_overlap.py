"""Data-parallel communication overlap of the distributed optimizer: training-step time with the gradient
reduce-scatter and parameter all-gather serial (overlap off), overlapped (overlap on), and replaced by
no-ops (compute only: the limit), in one run; plus a probe of the DP collectives beside a full-chip GEMM.

    torchrun --nproc-per-node 2 benchmarks/dp_overlap.py --fabric nvlink --probe \
        --json benchmarks/results/dp_overlap_2xh200_nvlink.json
    torchrun --nproc-per-node 2 benchmarks/dp_overlap.py --fabric slow --rounds 24 --block 6 \
        overlap.dp_comm_ctas=2 overlap.gemm_sm_carveout=8 \
        --extra nccl+carveout12 nccl_default+carveout0 compute_only+carveout8 \
        --timeline benchmarks/results/dp_overlap_2xh200_slow_timeline.png \
        --json benchmarks/results/dp_overlap_2xh200_slow.json
    torchrun --nproc-per-node 2 benchmarks/dp_overlap.py --smoke      # CPU, gloo: the code path, no claims

Rows:
  step      per variant: median step time, from the start of one training step to the start of the next,
            so an all-gather left running by a step counts where the next forward waits for it. serial and
            overlapped run as configured; compute_only replaces the DP collectives by no-ops and gives the
            GEMMs the whole chip (the limit); --extra adds overlapped variants on other NCCL groups (CTA
            caps, NCCL's default, a high-priority stream) and/or another GEMM SM carve-out. Variants run
            round-robin in blocks of --block steps (A B C A B C ...: clocks drift under load); a block's
            first step follows a switch and is left out.
  buckets   each bucket's reduce-scatter (with its payload cast) and all-gather, alone
  summary   exposed communication (overlapped - compute_only) against the serial cost (serial -
            compute_only), the largest bucket's communication, and the targets of the issue
  timeline  (--timeline) two profiled steps of each variant: the compute stream's busy and idle time, NCCL's
            time beside it, the longest idle gaps; against compute_only, more busy time is interference and
            more idle time is waiting
  probe     (--probe) one bucket's reduce-scatter and all-gather alone, beside back-to-back bf16 GEMMs
            of 8192^3 on the compute stream, and the GEMMs alone: plain NCCL, NCCL held to 2 and 8 CTAs
            (ProcessGroupNCCL.Options), and on NVLink a copy-engine all-gather and copy-then-add
            reduce-scatter through symmetric memory
The default model is configs/small_gpu.yaml as pure data parallelism (EP=1: DP=2 reduces dense and expert
gradients alike, about 515M parameters, 1 GB of bf16 payload each way) with one micro-batch of 16 x 1024
tokens per rank: in slow-fabric mode the reduce-scatter and the all-gather each take about as long as the
backward and the forward they hide under, so communication matters and can still hide.
`--fabric slow` sets NCCL_P2P_DISABLE=1 before init (NCCL through host memory: an inter-node stand-in).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_header, set_run_env, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GPU_OVERRIDES = ["parallel.expert_model_parallel_size=1", "train.micro_batch_size=16", "train.global_batch_size=32",
                 "overlap.grad_sync_dtype=bf16"]
SMOKE_OVERRIDES = ["model.num_layers=2", "model.moe_layer_freq=[0,1]", "model.hidden_size=64",
                   "model.ffn_hidden_size=128", "model.moe_ffn_hidden_size=64", "model.seq_length=32",
                   "parallel.expert_model_parallel_size=1", "train.micro_batch_size=2", "train.global_batch_size=4",
                   "train.device=cpu"]
# Every variant runs the distributed optimizer; only its switches and collectives change between blocks.
FORCED = ["train.use_distributed_optimizer=true", "train.eval_interval=0", "checkpoint.save_final=false",
          "checkpoint.save_interval=0", "train.max_steps=100000", "train.lr=1e-5", "train.min_lr=0"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=None, help="YAML config (default: configs/small_gpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="section.field=value, after the benchmark's own")
    parser.add_argument("--fabric", choices=("nvlink", "slow"), default="nvlink")
    parser.add_argument("--rounds", type=int, default=6, help="round-robin rounds of the three variants")
    parser.add_argument("--block", type=int, default=5, help="steps per variant per round (>= 3)")
    parser.add_argument("--probe", action="store_true", help="also time DP collectives beside a big GEMM")
    parser.add_argument("--probe-rounds", type=int, default=15)
    parser.add_argument("--extra", nargs="*", default=[], metavar="VARIANT",
                        help="more step variants in the same round-robin: TRANSPORT[+carveoutN] runs overlapped "
                             "through TRANSPORT (nccl: as configured; nccl_default: NCCL's choice of CTAs; "
                             "nccl_Nctas, nccl_hp, nccl_hp_Nctas: a CTA cap and/or a high-priority stream) with GEMMs "
                             "N SMs short (default: overlap.gemm_sm_carveout); "
                             "compute_only+carveoutN: the no-op run so"),
    parser.add_argument("--timeline", default=None, metavar="PNG",
                        help="profile two steps of every step variant; summarise the compute and NCCL streams as "
                             "timeline rows and draw the overlapped steps to PNG")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU with gloo (CI)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--allow-multicast", action="store_true", help="do not force NVLink multicast off")
    args = parser.parse_args(argv)
    if args.config is not None and "=" in args.config:  # no config file given: the first word is an override
        args.config, args.overrides = None, [args.config] + args.overrides
    if args.block < 3:
        parser.error("--block must be >= 3: a block's first step is left out and its last only ends a sample")
    if args.smoke:
        args.rounds, args.block, args.probe_rounds = min(args.rounds, 2), 3, min(args.probe_rounds, 2)
    for spec in args.extra:
        try:
            Variant.parse(spec)
        except ValueError as error:
            parser.error(f"--extra {spec!r}: {error}")
    return args


def main(argv=None) -> list[dict]:
    """Run under torchrun (or on ranks that already share a process group); returns the rows."""
    args = parse_args(argv)
    set_run_env(args.allow_multicast, args.fabric)

    import torch.distributed as dist

    from moe_overlap.config import load_config
    from moe_overlap.training.run_setup import init_distributed
    from moe_overlap.training.trainer import Trainer

    owns_process_group = not dist.is_initialized()
    config = args.config or str(REPO / ("configs/tiny.yaml" if args.smoke else "configs/small_gpu.yaml"))
    cfg = load_config(config, (SMOKE_OVERRIDES if args.smoke else GPU_OVERRIDES) + args.overrides + FORCED)
    mesh, device = init_distributed(cfg)
    try:
        if args.timeline and device.type != "cuda":
            raise SystemExit(f"--timeline profiles CUDA streams; this run is on {device.type}")
        if mesh.dp.size != mesh.world_size:
            raise SystemExit(f"dp_overlap measures pure data parallelism; DP={mesh.dp.size} of world "
                             f"{mesh.world_size} (set parallel sizes to 1)")
        bench = StepBench(Trainer(cfg, mesh, device), mesh, args)
        rows = bench.run()
        if args.timeline:
            rows += bench.timeline(args.timeline)
        if args.probe:
            rows += Probe(mesh, device, bench.largest_bucket_numel(), args).run()
        if mesh.rank == 0:
            print_rows(rows)
            write_json(args.json, run_header(mesh.world_size), rows)
        return rows
    finally:
        mesh.destroy()
        if owns_process_group:
            dist.destroy_process_group()


class _Done:
    def wait(self) -> bool:
        return True


class NoCollectives:
    """The DP collectives as no-ops: the same run's computation alone."""

    @staticmethod
    def start_reduce_scatter(output, tensor, group):
        return _Done()

    @staticmethod
    def start_all_gather(output, tensor, group):
        return _Done()


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(values: list[float], device) -> list[float]:
    """Each value's maximum over ranks: a data-parallel step is as slow as its slowest rank."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


TRANSPORT = re.compile(r"^(?:gloo|nccl|nccl_default|nccl(_hp)?(?:_(\d+)ctas)?)$")


@dataclass(frozen=True)
class Variant:
    overlap: bool  # overlap_grad_sync and overlap_param_sync
    transport: str | None  # where the DP collectives run (TRANSPORT); None: no-ops (compute only)
    carveout: int | None = None  # SMs every GEMM leaves free (overlap.gemm_sm_carveout); None: as configured

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        """``TRANSPORT[+carveoutN]`` (overlapped) or ``compute_only[+carveoutN]``."""
        transport, _, carveout = spec.partition("+")
        if carveout and not re.fullmatch(r"carveout\d+", carveout):
            raise ValueError(f"{carveout!r} is not carveoutN")
        if transport != "compute_only" and not TRANSPORT.match(transport):
            raise ValueError(f"transport {transport!r}: allowed are compute_only, gloo, nccl (as configured), "
                             "nccl_default (NCCL's choice of CTAs), nccl_Nctas, nccl_hp, nccl_hp_Nctas")
        return cls(transport != "compute_only", None if transport == "compute_only" else transport,
                   int(carveout[len("carveout"):]) if carveout else (0 if transport == "compute_only" else None))


class OnGroup:
    """The DP collectives on one fixed process group: the benchmark measures pure data parallelism, so every
    bucket's group has the same ranks, and the same ranks' group with other NCCL options can stand in."""

    def __init__(self, group):
        self.group = group

    def start_reduce_scatter(self, output, tensor, group):
        from moe_overlap.distributed import collectives

        return collectives.start_reduce_scatter(output, tensor, self.group)

    def start_all_gather(self, output, tensor, group):
        from moe_overlap.distributed import collectives

        return collectives.start_all_gather(output, tensor, self.group)


def transport_collectives(name: str | None, mesh):
    """What the optimizer calls for transport ``name``: the product's own collectives on the mesh's groups
    for nccl (as configured) and gloo, no-ops for None, else the same ranks' collectives on a new NCCL group
    with NCCL's choice of CTAs (nccl_default), a CTA cap (min = max) and/or a high-priority stream."""
    import torch.distributed as dist

    from moe_overlap.distributed import collectives

    if name is None:
        return NoCollectives
    if name in ("nccl", "gloo"):
        return collectives
    match = TRANSPORT.match(name)
    options = collectives.nccl_cta_options(int(match.group(2))) if match.group(2) else dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = bool(match.group(1))
    return OnGroup(dist.new_group(mesh.dp.ranks, backend="nccl", pg_options=options))


class StepBench:
    def __init__(self, trainer, mesh, args):
        from moe_overlap.distributed.streams import check_gemm_sm_carveout

        self.trainer, self.mesh, self.args = trainer, mesh, args
        self.optimizer, self.device = trainer.optimizer, trainer.device
        self.configured_carveout = trainer.cfg.overlap.gemm_sm_carveout
        default = "nccl" if self.device.type == "cuda" else "gloo"
        # compute_only is the limit: no collectives, and GEMMs on the whole chip.
        self.variants = {"serial": Variant(False, default), "overlapped": Variant(True, default),
                         "compute_only": Variant(False, None, 0)}
        self.variants.update({spec: Variant.parse(spec) for spec in args.extra})
        for variant in self.variants.values():  # before any step: a carve-out the device cannot take fails now
            check_gemm_sm_carveout(variant.carveout or 0, self.device)
        transports = {v.transport: None for v in self.variants.values()}  # groups made in one order on all ranks
        self.collectives = {name: transport_collectives(name, mesh) for name in transports}

    def largest_bucket_numel(self) -> int:
        return max(bucket.numel for bucket in self.optimizer.buckets)

    def block(self, variant: str) -> list[float]:
        """Milliseconds between the starts of consecutive steps of one block of ``variant``."""
        optimizer = self.optimizer
        optimizer.finish_param_sync()  # the previous block's last all-gathers: outside every sample
        _synchronize(self.device)
        self.switch(variant)
        starts = []
        for _ in range(self.args.block):
            starts.append(time.perf_counter())
            self.trainer.train_step()
        return [(b - a) * 1e3 for a, b in zip(starts[1:], starts[2:])]

    def switch(self, variant: str) -> None:
        spec = self.variants[variant]
        optimizer = self.optimizer
        # compute-only runs its no-op collectives the overlapped way: the trainer holds to the carve-out the GEMMs
        # that overlapped syncs run beside (every GEMM here: one micro-batch a step), so it lands where it would
        optimizer.overlap_grad_sync = optimizer.overlap_param_sync = spec.overlap or spec.transport is None
        optimizer.collectives = self.collectives[spec.transport]
        carveout = self.configured_carveout if spec.carveout is None else spec.carveout
        self.trainer.cfg.overlap.gemm_sm_carveout = carveout

    def bucket_syncs(self) -> list[tuple[float, float]]:
        """(reduce-scatter, all-gather) milliseconds of each bucket alone, through the real collectives."""
        from moe_overlap.distributed import collectives

        times = []
        for bucket in self.optimizer.buckets:
            pair = []
            for start, finish in ((bucket.start_grad_sync, bucket.finish_grad_sync),
                                  (bucket.start_param_sync, bucket.finish_param_sync)):
                _synchronize(self.device)
                t0 = time.perf_counter()
                start(collectives)
                finish()
                _synchronize(self.device)
                pair.append((time.perf_counter() - t0) * 1e3)
            times.append(tuple(pair))
        return times

    def run(self) -> list[dict]:
        import torch.distributed as dist

        for variant in self.variants:  # warm-up: one block each
            self.block(variant)
        samples = {variant: [] for variant in self.variants}
        bucket_samples = []
        for _ in range(self.args.rounds):
            for variant in self.variants:
                dist.barrier()
                samples[variant] += self.block(variant)
            self.optimizer.finish_param_sync()
            bucket_samples.append(self.bucket_syncs())
        step_ms = dict(zip(samples, _max_over_ranks([statistics.median(v) for v in samples.values()],
                                                    self.device)))
        buckets = self.optimizer.buckets
        rs_ms = _max_over_ranks([statistics.median(r[i][0] for r in bucket_samples) for i in range(len(buckets))],
                                self.device)
        ag_ms = _max_over_ranks([statistics.median(r[i][1] for r in bucket_samples) for i in range(len(buckets))],
                                self.device)
        return self.rows(step_ms, rs_ms, ag_ms, samples)

    def timeline(self, path: str) -> list[dict]:
        """Two profiled steps of every variant, each after a block of it: where the compute stream is busy,
        where it idles, and how much NCCL runs beside it. Against compute_only, a longer busy time is
        interference (kernels slowed by the collectives beside them); a longer idle time is waiting."""
        import torch.distributed as dist
        from torch.profiler import ProfilerActivity, profile

        from moe_overlap.training.profiling import device_spans, draw_timeline, stream_summary

        rows = []
        for variant in self.variants:
            self.block(variant)
            self.optimizer.finish_param_sync()
            _synchronize(self.device)
            dist.barrier()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    self.trainer.train_step()
                self.optimizer.finish_param_sync()
                _synchronize(self.device)
            rows.append(dict({"section": "timeline", "variant": variant}, **stream_summary(device_spans(prof), 2)))
            if variant == "overlapped" and self.mesh.rank == 0:
                draw_timeline(prof, path, f"two overlapped training steps, DP={self.mesh.dp.size}, "
                                          f"{self.args.fabric} fabric (rank 0)")
        return rows

    def rows(self, step_ms, rs_ms, ag_ms, samples) -> list[dict]:
        cfg, trainer = self.trainer.cfg, self.trainer
        buckets = self.optimizer.buckets
        rows = [{"section": "step", "variant": v, "step_ms": round(ms, 3),
                 "minus_compute_only_ms": round(ms - step_ms["compute_only"], 3), "samples": len(samples[v]),
                 "step_ms_spread": [round(min(samples[v]), 3), round(max(samples[v]), 3)]}
                for v, ms in step_ms.items()]
        for index, bucket in enumerate(buckets):
            rows.append({"section": "buckets", "bucket": index, "first_part": bucket.first_unit,
                         "group_size": bucket.group.size, "numel": bucket.numel,
                         "params": ([slot.name for slot in bucket.slots][:4]
                                    + (["..."] if len(bucket.slots) > 4 else [])),
                         "reduce_scatter_ms": round(rs_ms[index], 3), "all_gather_ms": round(ag_ms[index], 3)})
        exposed = step_ms["overlapped"] - step_ms["compute_only"]
        serial_comm = step_ms["serial"] - step_ms["compute_only"]
        bucket_comm = [rs + ag for rs, ag in zip(rs_ms, ag_ms)]
        off_ratio = step_ms["serial"] / step_ms["compute_only"]
        on_ratio = step_ms["overlapped"] / step_ms["compute_only"]
        summary = {
            "section": "summary", "fabric": self.args.fabric,
            "dp_comm_ctas": cfg.overlap.dp_comm_ctas, "gemm_sm_carveout": self.configured_carveout,
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "buckets": len(buckets), "grad_sync_dtype": cfg.overlap.grad_sync_dtype,
            "precision": cfg.train.precision, "tokens_per_step": cfg.train.global_batch_size * cfg.model.seq_length,
            "micro_batches_per_rank": trainer.num_micro_batches,
            "exposed_comm_ms": round(exposed, 3), "serial_comm_ms": round(serial_comm, 3),
            "hidden_fraction": round(1 - exposed / serial_comm, 3) if serial_comm > 0 else None,
            "comm_alone_ms": round(sum(bucket_comm), 3), "largest_bucket_comm_ms": round(max(bucket_comm), 3),
            "overlap_off_vs_compute_only": round(off_ratio, 4), "overlap_on_vs_compute_only": round(on_ratio, 4),
        }
        if self.args.fabric == "nvlink":
            summary["target_overlap_on_within_3pct"] = on_ratio <= 1.03
        else:
            summary["target_overlap_off_at_least_1.15x"] = off_ratio >= 1.15
            summary["target_exposed_at_most_one_bucket"] = exposed <= max(bucket_comm)
        return rows + [summary]


MAX_GEMMS = 64


class Probe:
    """One bucket's DP collectives alone and beside back-to-back GEMMs that hold the whole chip."""

    def __init__(self, mesh, device, numel: int, args):
        import torch

        self.torch, self.mesh, self.device, self.args = torch, mesh, device, args
        self.numel = numel
        cuda = device.type == "cuda"
        self.dtype = torch.bfloat16 if cuda else torch.float32
        size = 8192 if cuda else 256
        self.a = torch.randn(size, size, dtype=self.dtype, device=device)
        self.b = torch.randn(size, size, dtype=self.dtype, device=device)
        self.c = torch.empty(size, size, dtype=self.dtype, device=device)
        self.gemm_shape = [size, size, size]
        shard = numel // mesh.dp.size
        self.grads = torch.zeros(numel, dtype=self.dtype, device=device)
        self.params = torch.zeros(numel, dtype=self.dtype, device=device)
        self.shard = slice(mesh.dp.rank * shard, (mesh.dp.rank + 1) * shard)
        self.skipped: list[dict] = []

    def transports(self) -> dict:
        """name -> {op: start function returning a handle}."""
        import torch.distributed as dist

        from moe_overlap.distributed import collectives

        groups = {"nccl" if self.device.type == "cuda" else "gloo": self.mesh.dp.group}
        if self.device.type == "cuda":
            for ctas in (2, 8):
                groups[f"nccl_{ctas}_ctas"] = dist.new_group(self.mesh.dp.ranks, backend="nccl",
                                                             pg_options=collectives.nccl_cta_options(ctas))
        ops = {name: {
            "reduce_scatter": lambda g=group: collectives.start_reduce_scatter(self.grads[self.shard], self.grads, g),
            "all_gather": lambda g=group: collectives.start_all_gather(self.params, self.params[self.shard], g),
        } for name, group in groups.items()}
        reason = self.copy_engine_unavailable()
        if reason is None:
            try:  # optional: a failure here is recorded, and the NCCL rows still come
                copy_engine = CopyEngineCollectives(self.mesh.dp.group, self.grads, self.params, self.device).ops()
                for start in copy_engine.values():
                    self.timed(lambda s=start: s().wait())
                ops["copy_engine"] = copy_engine
            except Exception as error:  # noqa: BLE001 -- any failure of the optional transport is reported
                reason = f"{type(error).__name__}: {error}"
        if reason is not None:
            self.skipped.append({"section": "probe", "transport": "copy_engine", "skipped": reason})
        return ops

    def copy_engine_unavailable(self) -> str | None:
        from moe_overlap.distributed.symm import symm_unavailable_reason

        if self.args.fabric == "slow":
            return "slow fabric: NCCL_P2P_DISABLE=1 slows NCCL only, symmetric memory would still use NVLink; NCCL only"
        return symm_unavailable_reason(self.mesh.dp.group, self.device)

    def timed(self, fn) -> float:
        _synchronize(self.device)
        t0 = time.perf_counter()
        fn()
        _synchronize(self.device)
        return (time.perf_counter() - t0) * 1e3

    def gemms(self, count: int) -> None:
        for _ in range(count):
            self.torch.mm(self.a, self.b, out=self.c)

    def run(self) -> list[dict]:
        import torch.distributed as dist

        transports = self.transports()
        cases = {(name, op): start for name, ops in transports.items() for op, start in ops.items()}
        # Enough GEMMs to cover the slowest collective alone (up to MAX_GEMMS), so that a collective that
        # hides costs nothing extra.
        for start in cases.values():
            self.timed(lambda s=start: s().wait())
        gemm_ms = statistics.median(self.timed(lambda: self.gemms(1)) for _ in range(3))
        slowest = max(self.timed(lambda s=start: s().wait()) for start in cases.values())
        count = int(_max_over_ranks([min(MAX_GEMMS, max(1, math.ceil(slowest / gemm_ms)))], self.device)[0])

        def beside(start):
            work = start()
            self.gemms(count)
            work.wait()

        variants = {("gemm", "alone"): lambda: self.gemms(count)}
        for key, start in cases.items():
            variants[key + ("alone",)] = lambda s=start: s().wait()
            variants[key + ("beside_gemm",)] = lambda s=start: beside(s)
        samples = {key: [] for key in variants}
        for _ in range(self.args.probe_rounds):
            for key, fn in variants.items():
                dist.barrier()
                samples[key].append(self.timed(fn))
        medians = dict(zip(samples, _max_over_ranks([statistics.median(v) for v in samples.values()], self.device)))
        gemm_block = medians[("gemm", "alone")]
        rows = []
        for (name, op) in cases:
            alone, together = medians[(name, op, "alone")], medians[(name, op, "beside_gemm")]
            exposed = together - gemm_block
            rows.append({"section": "probe", "transport": name, "op": op,
                         "payload_mb": round(self.numel * self.grads.element_size() / 2**20, 2),
                         "gemm_shape": self.gemm_shape, "gemm_count": count, "gemm_alone_ms": round(gemm_block, 3),
                         "alone_ms": round(alone, 3), "beside_gemm_ms": round(together, 3),
                         "back_to_back_ms": round(gemm_block + alone, 3), "exposed_ms": round(exposed, 3),
                         "hidden_fraction": round(1 - exposed / alone, 3)})
        return rows + self.skipped


class CopyEngineCollectives:
    """A copy-engine all-gather (each rank pushes its shard into every peer's symmetric buffer) and a
    copy-then-add reduce-scatter (each rank pushes the peer's shard of its gradients to that peer, which
    adds it to its own), on a side stream: the copies take no SMs; only the add is a kernel."""

    def __init__(self, group, grads, params, device):
        import torch

        from moe_overlap.distributed.symm import SymmWorkspace

        self.torch, self.grads, self.params = torch, grads, params
        self.workspace = SymmWorkspace(group, grads.numel() * grads.element_size(), device, timeout_ms=10_000)
        self.rank, self.size = self.workspace.rank, self.workspace.size
        self.shard_numel = grads.numel() // self.size
        self.stream = torch.cuda.Stream(device)
        self.channel = 0

    def _slot(self, owner: int, sender: int):
        """``sender``'s slot in ``owner``'s buffer."""
        return self.workspace.view(owner, (self.shard_numel,), self.grads.dtype,
                                   sender * self.shard_numel * self.grads.element_size())

    def _exchange(self, payload_for) -> None:
        """Push ``payload_for(peer)`` into every peer's slot for us, then wait for every peer's push."""
        peers = [peer for peer in range(self.size) if peer != self.rank]
        for peer in peers:
            self._slot(peer, self.rank).copy_(payload_for(peer))
        for peer in peers:
            self.workspace.signal(peer, self.channel)
        for peer in peers:
            self.workspace.wait(peer, self.channel)

    def _run(self, body):
        torch = self.torch
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            body()

        class Handle:
            def wait(_self):
                caller.wait_stream(self.stream)
                return True

        return Handle()

    def ops(self) -> dict:
        n = self.shard_numel

        def all_gather():
            mine = self.params[self.rank * n:(self.rank + 1) * n]
            self._exchange(lambda peer: mine)
            for peer in range(self.size):  # gathered in our buffer; into the parameters, rank order
                if peer != self.rank:
                    self.params[peer * n:(peer + 1) * n].copy_(self._slot(self.rank, peer))

        def reduce_scatter():
            self._exchange(lambda peer: self.grads[peer * n:(peer + 1) * n])
            mine = self.grads[self.rank * n:(self.rank + 1) * n]
            for peer in range(self.size):
                if peer != self.rank:
                    mine.add_(self._slot(self.rank, peer))

        return {"reduce_scatter": lambda: self._run(reduce_scatter), "all_gather": lambda: self._run(all_gather)}


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)


if __name__ == "__main__":
    main()
