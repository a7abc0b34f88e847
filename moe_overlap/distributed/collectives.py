"""The one place that calls torch collectives whose names or behaviour differ between torch 2.11 and 2.13.

Every function takes a process group that may be ``None``: a group of one rank, where the collective is
the identity. Timeouts are set when the groups are made (``Mesh.create``), so every call here inherits one.
A blocking call here holds the compute stream (or the host) until the collective is done: it counts as exposed
communication of its group's kind (streams.exposed_wait; ``Mesh.create`` names every group's kind).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from moe_overlap.distributed.streams import exposed_kind, exposed_wait

ProcessGroup = Optional[dist.ProcessGroup]


def nccl_cta_options(ctas: int) -> "dist.ProcessGroupNCCL.Options":
    """Options for an NCCL process group whose communicator runs every collective on exactly ``ctas`` CTAs."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.min_ctas = options.config.max_ctas = ctas
    return options


def group_size(group: ProcessGroup) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_(tensor: torch.Tensor, group: ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; the identity on a one-rank group."""
    if group is not None:
        with exposed_wait(exposed_kind(group)):
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _Completed:
    """The handle of a collective that finished when it was called: a one-rank group."""

    def wait(self) -> bool:
        return True


_COMPLETED = _Completed()


def _copy_unless_same(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """A one-rank collective: a copy, skipped when ``tensor`` already is ``output`` (an in-place call)."""
    if (output.data_ptr(), output.shape) != (tensor.data_ptr(), tensor.shape):
        output.copy_(tensor)


def start_all_gather(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup):
    """Start gathering equal dim-0 shards into ``output``; returns a handle to ``wait()`` on before reading.

    ``tensor`` may be this rank's own shard of ``output`` (in place: NCCL and gloo both allow it).
    torch 2.13 renamed all_gather_into_tensor to all_gather_single; torch 2.11 lacks the new name.
    """
    if group is None:
        _copy_unless_same(output, tensor)
        return _COMPLETED
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=True)


def start_all_reduce(tensor: torch.Tensor, group: ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM):
    """Start an in-place all-reduce; returns a handle to ``wait()`` on before reading ``tensor``."""
    if group is None:
        return _COMPLETED
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def start_reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup,
                         op: dist.ReduceOp = dist.ReduceOp.SUM):
    """Start summing ``tensor`` over the group into this rank's dim-0 shard ``output``; returns a handle.

    ``output`` may be this rank's own shard of ``tensor`` (in place). Renamed in torch 2.13 too.
    """
    if group is None:
        _copy_unless_same(output, tensor)
        return _COMPLETED
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, op=op, group=group, async_op=True)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Gather equal shards along dim 0 into ``output`` (blocking)."""
    with exposed_wait(exposed_kind(group)):
        start_all_gather(output, tensor, group).wait()
    return output


def all_gather_counts(counts_E: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's counts, [rank, expert] (blocking): what a device-planned exchange gathers through symmetric
    regions on GPUs, over the process group (gloo)."""
    ranks = 1 if group is None else dist.get_world_size(group)
    return all_gather_into(counts_E.new_empty(ranks * counts_E.numel()), counts_E.contiguous(), group).view(ranks, -1)


def all_to_all_equal(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-to-all of equal dim-0 slices, no autograd (used for the per-expert token counts)."""
    if group is None:
        return tensor.clone()
    output = torch.empty_like(tensor)
    with exposed_wait(exposed_kind(group)):
        dist.all_to_all_single(output, tensor.contiguous(), group=group)
    return output


def all_to_all_rows(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                    group: ProcessGroup) -> torch.Tensor:
    """All-to-all of uneven row blocks, no autograd: rank r's block i goes to rank i."""
    if group is None:
        return x.clone()
    output = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    with exposed_wait(exposed_kind(group)):
        dist.all_to_all_single(output, x.contiguous(), list(output_splits), list(input_splits), group=group)
    return output


class AllToAllRows(torch.autograd.Function):
    """Differentiable uneven all-to-all; its backward is the all-to-all with the splits swapped.

    Written here because torch 2.13 deprecates torch.distributed.nn.functional; the MoE stages call its
    forward and backward as separate steps.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                group: ProcessGroup) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return all_to_all_rows(x, output_splits, input_splits, group)  # the whole exchange is exposed

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return all_to_all_rows(grad_output, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


class AllReduceSum(torch.autograd.Function):
    """Differentiable sum over ``group`` (torch.distributed.nn.functional is deprecated in 2.13): every rank
    uses the sum, so each input's gradient is the sum of every rank's output gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_reduce_(x.clone(), group)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return all_reduce_(grad_output.clone(), ctx.group), None


def default_store() -> "dist.Store":
    """The key-value store the default process group rendezvoused through (a private accessor in both
    torch 2.11 and 2.13)."""
    return dist.distributed_c10d._get_default_store()


# How long a rank waits for the others to join the rendezvous: start-up (imports, CUDA contexts, a checkpoint read)
# differs between ranks by far more than a collective may take, so joining does not use the collective timeout.
JOIN_TIMEOUT = timedelta(minutes=5)


def rendezvous_store(timeout: timedelta) -> "dist.Store | None":
    """The store to initialize the default group with, or None for torch's own (no MASTER_ADDR: a group made by
    the caller). Joining waits up to max(``timeout``, JOIN_TIMEOUT); call ``store.set_timeout(timeout)`` once
    the group exists, so that a rank that dies later is noticed within the collective timeout.

    Under torchrun the agent hosts one store for every restart of a job (TORCHELASTIC_USE_AGENT_STORE), and the
    ranks of a restart would read the previous attempt's keys (gloo addresses, NCCL ids) and fail to connect;
    this client prefixes its keys with the attempt (TORCHELASTIC_RESTART_COUNT). Without the agent (env://, as
    the tests launch ranks) rank 0 hosts the store."""
    if "MASTER_ADDR" not in os.environ:
        return None
    join = max(timeout, JOIN_TIMEOUT)
    addr, port, world = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=join)
        return dist.PrefixStore(f"moe_overlap/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return dist.TCPStore(addr, port, world, is_master=int(os.environ["RANK"]) == 0, timeout=join, multi_tenant=True)
