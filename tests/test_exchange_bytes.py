"""The bytes the pipelined MoE exchange sends to other ranks, as its transports count them on the device
(``TransportSelector.bytes_sent``; per step, the most any rank sent: the ``moe_exchange_gib`` metric): the rows that
cross to another rank in each of a layer call's four exchanges (forward dispatch and combine, and their backward's),
times their width. A rank's rows to itself cross no link and are not counted, nor is anything in a compute-only
reference. Host and device planning move the same rows; FP8 on the wire halves the two exchanges that carry it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe_overlap.config import ModelConfig, OverlapConfig
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.a2a_routes import DeviceRoutes, exchange_layout
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.layers.moe import MoELayer
from moe_overlap.layers.wire_rows import hidden_columns


def test_exchange_bytes_remote_rows_of_host_and_device_routes():
    rows_SDC = np.array([[[3, 1], [2, 0]], [[4, 0], [5, 6]]])  # [source, destination, chunk]
    assert exchange_layout(rows_SDC, 0).remote_rows(0) == (2, 4)  # to rank 1: 2 + 0; back to rank 1: 4 + 0
    assert exchange_layout(rows_SDC, 1).remote_rows(1) == (4, 2)
    routes = DeviceRoutes(send_start_C=torch.tensor([0, 4]), send_rows_C=torch.tensor([3, 2]),
                          dst_rank_R=torch.tensor([0, 1, 1, 9, 0, 1, 1]), dst_row_R=torch.zeros(7),
                          recv_start_C=torch.tensor([0, 3]), recv_rows_C=torch.tensor([2, 1]),
                          back_rank_W=torch.tensor([1, 0, 1, 1, 1]), back_row_W=torch.zeros(5), send_rows=7,
                          recv_rows=5, chunk_rows=[3, 2])
    to_experts, back = routes.remote_rows(0)
    # rows 0-2 and 4-5 are sent (rows 3 and 6 lie outside every chunk): 1, 2, 5 go to rank 1; rows 0, 3 come back
    # to rank 1 (row 2 lies past chunk 0's count)
    assert int(to_experts) == 3 and int(back) == 2


T, K, E = 32, 2, 8


def layer_bytes(settings: list[dict], hidden: int = 16, ffn: int = 8) -> list[dict]:
    """Per setting, one layer call forward and backward on this rank: the bytes counted, and those the rows'
    routing predicts for a plain (not once per rank) exchange: every copy whose expert another rank owns crosses
    there and back, and the rows other ranks' copies bring cross back to them, each twice (forward and backward),
    a row of ``hidden`` float32."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh.create(MeshLayout(world, ep=world), timeout_s=60)
    out = []
    try:
        for setting in settings:
            selector = TransportSelector(setting["planning"], "auto", mesh.ep.group, mesh.ep.ranks,
                                         torch.device("cpu"), 2, 60, setting.get("compute_only", False))
            overlap = OverlapConfig(moe_pipeline=True, moe_planning=setting["planning"], moe_pipeline_chunks=2,
                                    moe_dispatch_once_per_rank=setting.get("once", False),
                                    moe_dispatch_dtype=setting.get("dtype", "bf16"), delay_wgrad_compute=False,
                                    moe_compute_only=setting.get("compute_only", False))
            cfg = ModelConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_moe_experts=E, moe_router_topk=K,
                              moe_router_force_load_balancing=setting.get("balanced", False))
            layer = MoELayer(cfg, overlap, mesh.ep, selector, etp=mesh.etp, expert_mp=mesh.expert_mp)
            torch.manual_seed(rank)  # the same weights (made empty) and rows for every setting
            for param in layer.parameters():
                torch.nn.init.normal_(param, std=0.1)
            x_TH = torch.randn(T, hidden, requires_grad=True)
            out_BSH, _, _ = layer(x_TH.view(1, T, hidden))
            out_BSH.square().sum().backward()
            experts_STK = [torch.empty(T, K, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(experts_STK, layer.router(x_TH.detach()).experts_TK.contiguous())
            owner_STK = torch.stack(experts_STK) // (E // world)
            sent = int((owner_STK[rank] != rank).sum())
            received = int(sum((owner_STK[s] == rank).sum() for s in range(world) if s != rank))
            out.append({"counted": int(selector.bytes_sent), "plain": 2 * (sent + received) * hidden * 4})
    finally:
        mesh.destroy()
    return out


def test_exchange_bytes_count_the_rows_that_cross(rank_pool):
    """Host and device planning count what the routing predicts; a compute-only reference counts nothing."""
    settings = [dict(planning="host"), dict(planning="device"), dict(planning="device", compute_only=True)]
    for host, device, compute_only in rank_pool(4).run(layer_bytes, settings):
        assert host["counted"] == device["counted"] == host["plain"] > 0, (host, device)
        assert compute_only["counted"] == 0


def test_exchange_bytes_fp8_on_the_wire(rank_pool):
    """Each token once per rank, bf16 against FP8 rows (forced balance: the same rows either way): the forward
    dispatch and the combine's backward carry hidden_columns(fp8) columns of float32 where bf16 carries hidden ones,
    so the counted bytes differ by exactly that on those two exchanges."""
    settings = [dict(planning=p, once=True, dtype=d, balanced=True)
                for p in ("host", "device") for d in ("bf16", "fp8")]
    hidden = 64
    for host_bf16, host_fp8, device_bf16, device_fp8 in rank_pool(2).run(layer_bytes, settings, hidden):
        assert host_bf16["counted"] == device_bf16["counted"] and host_fp8["counted"] == device_fp8["counted"]
        saved = host_bf16["counted"] - host_fp8["counted"]
        per_row = (hidden - hidden_columns(hidden, torch.float32, fp8=True)) * 4
        assert saved > 0 and saved % per_row == 0, (host_bf16, host_fp8)


@pytest.mark.parametrize("planning", ["host", "device"])
def test_exchange_bytes_metric_per_step(rank_pool, tmp_path, planning):
    """Forced balance routes the same rows every step: the metric is the same, and counted from zero each step."""
    for result in rank_pool(2).run(_metric_case, str(tmp_path), planning,
                                   {"model.moe_router_force_load_balancing": "true"}):
        assert all(g > 0 for g in result["gib"]) and len(set(result["gib"])) == 1, result


def _metric_case(output_dir: str, planning: str, both: dict) -> dict:
    from moe_overlap.training.trainer import Trainer
    from tests.test_master import CPU, small_config, world_and_mesh

    cfg = small_config(output_dir, 2, 8, **{"overlap.moe_pipeline": "true", "overlap.moe_planning": planning, **both})
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        return {"gib": [trainer.train_step()["moe_exchange_gib"] for _ in range(2)]}
    finally:
        mesh.destroy()
