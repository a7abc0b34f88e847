"""Pipeline P2P channels are connected when they are made: one transfer per channel, in one global
(sender, receiver) order on every rank (distributed/p2p.py says why: on NCCL a channel made lazily, at the first
gradient posted ahead, hung a 4xH100 host)."""

from __future__ import annotations

import torch.distributed as dist

from moe_overlap.distributed import p2p as p2p_module
from moe_overlap.distributed.mesh import Mesh, MeshLayout


def connect_order(pp: int, world: int) -> dict:
    """This rank's warm-up transfers, as (sender, receiver) in the order it made them, and its channels."""
    mesh = Mesh.create(MeshLayout(world, pp=pp), timeout_s=60)
    order = []
    send, recv = dist.send, dist.recv

    def recorded_send(tensor, dst, group=None, **kwargs):
        order.append((dist.get_rank(), dst))
        return send(tensor, dst, group, **kwargs)

    def recorded_recv(tensor, src=None, group=None, **kwargs):
        order.append((src, dist.get_rank()))
        return recv(tensor, src, group, **kwargs)

    p2p_module.dist.send, p2p_module.dist.recv = recorded_send, recorded_recv
    try:
        channels = sorted(p2p_module.PipelineP2P(mesh, 60)._channels)
    finally:
        p2p_module.dist.send, p2p_module.dist.recv = send, recv
        mesh.destroy()
    return {"rank": dist.get_rank(), "order": order, "channels": channels}


def test_every_channel_is_connected_once_in_one_global_order(rank_pool):
    for result in rank_pool(4).run(connect_order, 4, 4):  # PP=4: ring neighbours both ways
        me = result["rank"]
        want = sorted({(me, (me + 1) % 4), ((me + 1) % 4, me), (me, (me - 1) % 4), ((me - 1) % 4, me)})
        assert result["channels"] == want and result["order"] == want, result
    for result in rank_pool(4).run(connect_order, 2, 4):  # PP=2 x DP=2: stages 0 and 1 are ranks r and r + 2
        me, peer = result["rank"], (result["rank"] + 2) % 4
        assert result["order"] == sorted({(me, peer), (peer, me)}), result
