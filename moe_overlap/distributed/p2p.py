"""Point-to-point transfers between pipeline ranks (activations forward, their gradients back).

A post starts a set of transfers, batched into one ``batch_isend_irecv`` on the pipeline group
(``overlap.batch_p2p_comm``) or one isend / irecv each. Each separate transfer goes over its own
direction's two-rank group: ProcessGroupNCCL runs all of one peer pair's point-to-point calls on one
communicator and stream, in call order, so a send one way would queue behind a receive the other way;
with a group per direction only same-direction transfers queue, and both ends post those in the same
order (the schedule's validation checks it). Tags are not used: NCCL ignores them. The groups inherit
the mesh's timeout, so a missing peer fails the wait instead of hanging.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from moe_overlap.distributed.mesh import Mesh


class PipelineP2P:
    """This rank's transfers to and from its pipeline neighbours (ring neighbours: with virtual stages
    the last rank sends on to the first)."""

    def __init__(self, mesh: Mesh, timeout_s: float):
        self.pp = mesh.pp
        self._channels: dict[tuple[int, int], dist.ProcessGroup] = {}  # (sender, receiver) global ranks
        timeout = timedelta(seconds=timeout_s)
        # Every rank makes every group, in the same order (torch requires it of non-members too).
        for ranks in mesh.layout.group_ranks("pp"):
            links = sorted({(ranks[i], ranks[(i + 1) % len(ranks)]) for i in range(len(ranks))}
                           | {(ranks[(i + 1) % len(ranks)], ranks[i]) for i in range(len(ranks))})
            for sender, receiver in links if len(ranks) > 1 else ():
                group = dist.new_group(sorted((sender, receiver)), timeout=timeout, group_desc="pipeline_p2p")
                if mesh.rank in (sender, receiver):
                    self._channels[(sender, receiver)] = group
                    mesh.own(group)
        self._connect()

    def _connect(self) -> None:
        """One tiny transfer over each channel, in the same (sender, receiver) order on every rank, each finished
        before the next: NCCL makes a group's communicator at its first transfer, and that creation waits for
        the peer and, it appears, for the device. On a 4xH100 host ZB-H1 with overlapped P2P at PP=2 hung at its
        first gradient transfer: the NCCL flight recorder shows both ranks' gradient channels never enqueued a
        transfer (both ranks in the communicator's creation), while the last stage's receive of the next
        activation sat scheduled on the device; made here, no channel's creation meets a transfer in flight. In
        one global order the first unmade channel always has both ends at it."""
        for (sender, receiver), group in sorted(self._channels.items()):
            nccl = dist.get_backend(group) == "nccl"
            token = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
            if self.pp.ranks[self.pp.rank] == sender:
                dist.send(token, receiver, group)
            else:
                dist.recv(token, sender, group)
            if nccl:
                torch.cuda.synchronize()

    def post(self, ops: Sequence[tuple[bool, torch.Tensor, int]], batch: bool) -> list[list[dist.Work]]:
        """Start (send?, tensor, peer pipeline rank) transfers; returns what to wait on for each."""
        me = self.pp.ranks[self.pp.rank]
        peers = [self.pp.ranks[peer] for _, _, peer in ops]
        if batch:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, tensor, peer, self.pp.group)
                                            for (send, tensor, _), peer in zip(ops, peers)])
            # NCCL returns one handle for the whole batch, gloo one per transfer.
            return [[work] for work in works] if len(works) == len(ops) else [works] * len(ops)
        return [[(dist.isend if send else dist.irecv)(tensor, peer,
                                                      self._channels[(me, peer) if send else (peer, me)])]
                for (send, tensor, _), peer in zip(ops, peers)]
