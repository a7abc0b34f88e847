"""Kernels one MoE layer call launches, forward and backward, counted on CPU: every aten op that is neither a view
nor an allocation (one kernel each on CUDA, one node of a replayed graph) and every Triton kernel launch
(interpreted here), by the function that issued it. A replayed graph still pays each node its launch gap and its
own minimum time (a few microseconds on H100), so a plan made of many small ops costs the step even graphed.
Each layer is called once before the counted call (its planner's one-time setup is not a step's cost).

    TRITON_INTERPRET=1 python benchmarks/layer_ops.py --json benchmarks/results/layer_ops_cpu.json

Rows: ``local`` (what the layer runs at EP=1: the ``ep1`` row's layer), and the pipeline over a one-rank group with
its regions in this process's memory (device-planned ``sm_push``, one chunk, each token once per rank on and off:
the EP>1 default's ops, less the signals to peers, of which a one-rank group has none). The counts do not depend
on the shape's sizes, only on its top-k and expert counts through a few per-chunk loops.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.common import run_header, write_json  # noqa: E402
from moe_overlap.config import ModelConfig, OverlapConfig  # noqa: E402
from moe_overlap.distributed.a2a_push import PushTransport  # noqa: E402
from moe_overlap.distributed.mesh import Mesh  # noqa: E402
from moe_overlap.distributed.symm import LocalRegions  # noqa: E402
from moe_overlap.kernels import launch  # noqa: E402
from moe_overlap.layers.init import init_parameters  # noqa: E402
from moe_overlap.layers.moe import MoELayer  # noqa: E402

NO_KERNEL = {"set_", "empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "view", "_unsafe_view",
             "view_as", "reshape", "_reshape_alias", "as_strided", "slice", "select", "split", "unbind", "detach",
             "lift_fresh", "alias", "unsqueeze", "squeeze", "expand", "permute", "t", "transpose"}


class OneRankPush:
    """A one-rank group's sm_push transport (the interface MoELayer asks of a TransportSelector)."""

    name, planning = "sm_push", "device"

    def __init__(self):
        self.made = None

    def count_overflow(self, rows: torch.Tensor, unplaced: torch.Tensor | None = None) -> None:
        pass

    def transport(self, nbytes: int) -> PushTransport:
        if self.made is None or self.made.regions.region_bytes < nbytes:
            self.made = PushTransport(LocalRegions(nbytes, 4, 8, torch.device("cpu")), torch.device("cpu"))
        return self.made


class Launches(TorchDispatchMode):
    """Aten ops that launch a kernel, and Triton launches, by the issuing function (the innermost frame of the
    package); the interpreter's own tensor traffic is not counted."""

    def __init__(self):
        super().__init__()
        self.by_site: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()

    def count(self, op: str) -> None:
        stack = traceback.extract_stack()
        site = next((f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.name}" for f in reversed(stack)
                     if "moe_overlap" in f.filename and "launch.py" not in f.filename), "?")
        self.by_site[site] += 1
        self.by_op[op] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL and not any("triton" in f.filename for f in traceback.extract_stack()):
            self.count(name)
        return func(*args, **(kwargs or {}))


def counted(layer: MoELayer, x: torch.Tensor, upstream: torch.Tensor) -> dict:
    launched = []
    real = launch.Kernel.__getitem__

    def triton_launch(kernel, grid_and_device):
        launched[-1].count("triton:" + (kernel.name or kernel.fn.__name__))
        return real(kernel, grid_and_device)

    launch.Kernel.__getitem__ = triton_launch
    try:
        result = {}
        for phase in ("forward", "backward"):
            launched.append(Launches())
            with launched[-1]:
                if phase == "forward":
                    out = layer(x.unsqueeze(0))[0]
                else:
                    out.squeeze(0).backward(upstream)
            result[phase] = {"launches": sum(launched[-1].by_op.values()),
                             "triton": sum(n for op, n in launched[-1].by_op.items() if op.startswith("triton:")),
                             "by_site": dict(launched[-1].by_site.most_common()),
                             "by_op": dict(launched[-1].by_op.most_common())}
        return result
    finally:
        launch.Kernel.__getitem__ = real


def build(args, pipeline: bool, once: bool) -> MoELayer:
    cfg = ModelConfig(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_moe_experts=args.experts,
                      moe_router_topk=args.topk, moe_aux_loss_coeff=0.0)
    overlap = OverlapConfig(moe_pipeline=pipeline, moe_planning="device", moe_dispatch_once_per_rank=once,
                            delay_wgrad_compute=True, moe_expert_rank_capacity_factor=None)
    layer = MoELayer(cfg, overlap, Mesh.single().ep, OneRankPush() if pipeline else None)
    init_parameters(layer, seed=1234, std=0.02, num_layers=1)
    layer.local = not pipeline  # the pipeline over the one-rank group, as at EP>1
    return layer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=32)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the push kernel writes through addresses: no torch twin on CPU
    torch.manual_seed(0)
    x, upstream = torch.randn(args.tokens, args.hidden), torch.randn(args.tokens, args.hidden)
    rows = []
    for name, pipeline, once in (("local", False, False), ("device_sm_push_once", True, True),
                                 ("device_sm_push", True, False)):
        layer = build(args, pipeline, once)
        layer(x.clone().requires_grad_(True).unsqueeze(0))[0].squeeze(0).backward(upstream)  # one-time setup first
        counts = counted(layer, x.clone().requires_grad_(True), upstream)
        rows.append({"variant": name, **counts})
        print(f"{name:22s} forward {counts['forward']['launches']:4d} ({counts['forward']['triton']} Triton)  "
              f"backward {counts['backward']['launches']:4d} ({counts['backward']['triton']} Triton)")
    for row in rows[1:2]:
        print(f"where {row['variant']}'s forward launches come from:")
        for site, n in list(row["forward"]["by_site"].items())[:15]:
            print(f"  {n:4d}  {site}")
    write_json(args.json, {**run_header(1), "shape": vars(args)}, rows)


if __name__ == "__main__":
    main()
