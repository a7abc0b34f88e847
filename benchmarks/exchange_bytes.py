"""Bytes the pipelined MoE exchange sends to other ranks per layer call, as its transports count them
(``TransportSelector.bytes_sent``, the ``moe_exchange_gib`` metric), for a config's MoE layer shape: bf16 rows against
FP8 on the wire (``overlap.moe_dispatch_dtype``), each token once per rank, forced balance (the same rows either way).
Bytes depend only on the routing and the rows' widths, so the count is the same on CPU (gloo, the device-planned
twin of sm_push) as on GPUs; the layer runs one forward and backward on ``--tokens`` tokens per rank.

    torchrun --nproc-per-node 4 benchmarks/exchange_bytes.py configs/bench_fine_8l.yaml --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import run_header, write_json  # noqa: E402
from moe_overlap.config import OverlapConfig, load_config  # noqa: E402
from moe_overlap.distributed.a2a import TransportSelector  # noqa: E402
from moe_overlap.distributed.mesh import Mesh, MeshLayout  # noqa: E402
from moe_overlap.layers.moe import MoELayer  # noqa: E402


def layer_call_bytes(model, dtype: str, tokens: int, planning: str, device: torch.device, mesh: Mesh) -> int:
    selector = TransportSelector(planning, "auto", mesh.ep.group, mesh.ep.ranks, device, 1, 120)
    overlap = OverlapConfig(moe_pipeline=True, moe_planning=planning, moe_dispatch_once_per_rank=True,
                            moe_dispatch_dtype=dtype, delay_wgrad_compute=False)
    layer = MoELayer(model, overlap, mesh.ep, selector, device=device, dtype=torch.bfloat16, etp=mesh.etp,
                     expert_mp=mesh.expert_mp)
    torch.manual_seed(dist.get_rank())
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    x_TH = torch.randn(tokens, model.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    out_BSH, _, _ = layer(x_TH.view(1, tokens, -1))
    out_BSH.float().square().sum().backward()
    return int(selector.bytes_sent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank in the layer call")
    parser.add_argument("--json")
    args = parser.parse_args()
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    world = dist.get_world_size()
    device = torch.device("cuda", dist.get_rank()) if torch.cuda.is_available() else torch.device("cpu")
    model = load_config(args.config, ["model.moe_router_force_load_balancing=true"]).model
    mesh = Mesh.create(MeshLayout(world, ep=world), timeout_s=120)
    planning = "device"
    counted = {dtype: layer_call_bytes(model, dtype, args.tokens, planning, device, mesh) for dtype in ("bf16", "fp8")}
    every = [None] * world
    dist.all_gather_object(every, counted)
    if dist.get_rank() == 0:
        rows = [{"dtype": d, "bytes_per_rank": [c[d] for c in every]} for d in ("bf16", "fp8")]
        ratio = sum(rows[1]["bytes_per_rank"]) / sum(rows[0]["bytes_per_rank"])
        header = dict(run_header(world), config=args.config, tokens_per_rank=args.tokens, ep=world,
                      planning=planning, routing="model.moe_router_force_load_balancing=true", fp8_over_bf16=ratio)
        print(json.dumps({"fp8_over_bf16": ratio, "rows": rows}))
        write_json(args.json, header, rows)
    mesh.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
