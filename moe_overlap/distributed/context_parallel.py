"""Context parallelism's communication: the load-balanced sequence split and the ring that moves blocks.

Split: every sequence of S tokens is cut into 2*CP chunks of S/(2*CP) tokens; CP rank r holds chunks r and
2*CP-1-r, in that order (its "local sequence"). Under a causal mask the early chunk attends to little and the
late one to much, so every rank gets the same work (layers/ring_attention.py counts it). Token ids, labels,
rotary positions and every per-token tensor follow the same split; :func:`positions` says where a rank's tokens
sit in the sequence.

Ring: a block (a rank's keys and values, or their gradients) is passed to CP rank r+1 while the block from rank
r-1 arrives, over :class:`~moe_overlap.distributed.ring.P2PTransport` (gloo or NCCL batch_isend_irecv), every
wait bounded by the group's timeout. ``overlap`` says when a caller waits: off, right after starting (exchange,
then compute: the reference); on, after the computation that does not need the block.

Nothing here knows what attention is.
"""

from __future__ import annotations

import torch

from moe_overlap.distributed.collectives import all_gather_into
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.distributed.ring import P2PTransport, Pending, RingTransport


def chunk_ids(rank: int, size: int) -> tuple[int, int]:
    """The two sequence chunks (of 2*size) that CP rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * size - 1 - rank


def positions(seq_length: int, rank: int, size: int, device=None) -> torch.Tensor:
    """Positions in the sequence (int64) of CP rank ``rank``'s local sequence, in its order."""
    if size == 1:
        return torch.arange(seq_length, device=device)
    if seq_length % (2 * size):
        raise ValueError(f"model.seq_length={seq_length} must be divisible by 2 x context_parallel_size={2 * size}")
    chunk = seq_length // (2 * size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(rank, size)])


def split_sequence(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """CP rank ``rank``'s local sequence of ``x`` along ``dim`` (a copy; ``x`` itself when size is 1)."""
    if size == 1:
        return x
    if x.shape[dim] % (2 * size):
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not split into 2 x context_parallel_size = "
                         f"{2 * size} equal chunks")
    chunks = x.chunk(2 * size, dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, size)], dim)


class CPComm:
    """A CP group's communication for layers: where the local tokens sit, the ring pass, the sequence gather."""

    def __init__(self, group: GroupHandle, overlap: bool = False, transport: RingTransport | None = None):
        self.group, self.overlap = group, overlap
        self.size, self.rank = group.size, group.rank
        self.transport = transport if transport is not None or group.size == 1 else P2PTransport(group)
        if self.transport is not None:
            self.transport.kind = "cp"  # its waits count as context-parallel exposed communication

    @classmethod
    def single(cls) -> "CPComm":
        """No context parallelism: the local sequence is the sequence."""
        return cls(GroupHandle(ranks=[0], group=None, rank=0, size=1))

    def positions(self, local_length: int, device=None) -> torch.Tensor:
        """Positions in the sequence of this rank's ``local_length`` tokens."""
        return positions(local_length * self.size, self.rank, self.size, device)

    def pass_on(self, block: torch.Tensor) -> Pending:
        """Send ``block`` to the next rank and receive the previous rank's block (same shape and dtype);
        ``wait()`` on the result gives the received block. ``block`` must stay unchanged until then."""
        ring = self.transport.open(1, tuple(block.shape), block.dtype, block.device)
        ring.start(0, block)

        def received() -> torch.Tensor:
            got = ring.wait(0)
            ring.finish()
            return got

        return Pending(complete=received)


class GatherSequence(torch.autograd.Function):
    """Per-token rows of every CP rank -> whole sequences in sequence order, for a computation each rank repeats
    on all of them (the router's choices and its auxiliary losses over the micro-batch). ``x_T_``: this rank's
    rows, (batch, local sequence) flattened batch-major. Backward keeps this rank's rows only: each rank holds
    the full gradient of the repeated computation, so summing the copies would count it ``size`` times."""

    @staticmethod
    def forward(ctx, x_T_: torch.Tensor, batch: int, comm: CPComm) -> torch.Tensor:
        ctx.batch, ctx.comm = batch, comm
        if comm.size == 1:
            return x_T_
        gathered = x_T_.new_empty((comm.size, *x_T_.shape))
        all_gather_into(gathered.view(-1, *x_T_.shape[1:]), x_T_.contiguous(), comm.group.group)
        local = x_T_.shape[0] // batch
        order = torch.cat([positions(local * comm.size, rank, comm.size) for rank in range(comm.size)])
        in_rank_order = gathered.view(comm.size, batch, local, *x_T_.shape[1:]).transpose(0, 1).flatten(1, 2)
        return in_rank_order[:, torch.argsort(order).to(x_T_.device)].flatten(0, 1)

    @staticmethod
    def backward(ctx, grad_S_: torch.Tensor):
        return local_rows(grad_S_, ctx.batch, ctx.comm), None, None


def local_rows(x_S_: torch.Tensor, batch: int, comm: CPComm) -> torch.Tensor:
    """This rank's rows of whole sequences (batch, sequence) flattened batch-major: its local sequences."""
    if comm.size == 1:
        return x_S_
    whole = x_S_.view(batch, -1, *x_S_.shape[1:])
    return whole[:, comm.positions(whole.shape[1] // comm.size, x_S_.device)].flatten(0, 1)
