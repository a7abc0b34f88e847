"""Gradients under tensor and pipeline parallelism, for either optimizer (the TP and PP parts of Megatron's
finalize_model_grads).

Sequence-parallel parameters (replicated over TP: norms, routers) get each rank's gradient from its own
sequence block only, so they are summed over the TP group, in one coalesced all-reduce. In the global gradient
norm a TP-split parameter counts on every TP rank (each holds another block) and a replicated dense one on TP
rank 0 only; the dense squares are then summed over the model-parallel group (TP x PP). Tied embeddings under
PP: the first and the last stage each hold the table; their gradients are summed over the embedding group,
and the last stage's copy (its record's ``tied_copy``) does not count in the norm.
"""

from __future__ import annotations

from typing import Iterable

import torch

from moe_overlap.distributed.collectives import all_reduce_
from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.layers.param_info import is_tp_split, param_info


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return param_info(param).sequence_parallel


@torch.no_grad()
def sum_sequence_parallel_grads(params_and_grads: Iterable[tuple[torch.Tensor, torch.Tensor]],
                                tp: GroupHandle) -> None:
    """Sum the gradients of sequence-parallel parameters over the TP group, in place."""
    grads = [grad for param, grad in params_and_grads if is_sequence_parallel(param)]
    if not grads or tp.group is None:
        return
    flat = all_reduce_(torch.cat([grad.reshape(-1) for grad in grads]), tp.group)
    for grad, summed in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(summed.view_as(grad))


def counts_in_dense_norm(param: torch.Tensor, tp: GroupHandle) -> bool:
    """Whether this rank adds a dense parameter's squares to the norm (before the sum over TP x PP)."""
    return not param_info(param).tied_copy and (tp.rank == 0 or is_tp_split(param))


def is_shared_embedding(param: torch.Tensor) -> bool:
    return param_info(param).tied_embedding


@torch.no_grad()
def sum_shared_embedding_grads(params_and_grads: Iterable[tuple[torch.Tensor, torch.Tensor]],
                               embedding: GroupHandle) -> None:
    """Sum the tied embedding's gradients over its copies on the first and the last pipeline stage."""
    for param, grad in params_and_grads:
        if is_shared_embedding(param):
            all_reduce_(grad, embedding.group)
