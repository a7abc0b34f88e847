"""Vocab-parallel token embedding and the output layer's fp32 vocab-parallel cross-entropy.

Each TP rank holds a contiguous block of the vocabulary (rows of the embedding / output weight). No rank
ever holds full-vocabulary logits: the loss needs only three per-token numbers reduced over the TP group
(max logit, sum of exponentials, the label's logit), as Megatron's vocab-parallel cross-entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_overlap.distributed.collectives import all_reduce_
from moe_overlap.distributed.ring import TPComm
from moe_overlap.kernels.cross_entropy import cross_entropy_grad, cross_entropy_stats
from moe_overlap.layers.init import EMBEDDING, make_param
from moe_overlap.layers.param_info import TPShard
from moe_overlap.layers.tp_linear import ColumnParallelLinearFn, ScatterToRegion, region_rows
from moe_overlap.layers.wgrad import main_grad_of, mark_own_grad, placeholder


class EmbeddingLookup(torch.autograd.Function):
    """Rows of the table; the weight gradient is the rows' gradients summed into the table's fp32 main_grad (an
    index_add of T rows), never a dense (V, H) gradient in the table's dtype."""

    @staticmethod
    def forward(ctx, ids_S: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids_S)
        ctx.weight = weight_VH  # the parameter itself (its main_grad), also under recomputation
        return F.embedding(ids_S, weight_VH)

    @staticmethod
    def backward(ctx, grad_SH: torch.Tensor):
        (ids_S,), weight_VH = ctx.saved_tensors, ctx.weight
        main_grad = main_grad_of(weight_VH)
        if main_grad is None:
            return None, torch.ops.aten.embedding_dense_backward(grad_SH, ids_S, weight_VH.shape[0], -1, False)
        main_grad.index_add_(0, ids_S.reshape(-1), grad_SH.reshape(-1, grad_SH.shape[-1]).float())
        return None, placeholder(weight_VH)


class Embedding(nn.Module):
    """Rows [rank*V/TP, (rank+1)*V/TP) of the (V, H) table; returns this rank's (batch, seq block, H)."""

    def __init__(self, vocab_size: int, hidden_size: int, comm: TPComm, device=None, dtype=None):
        super().__init__()
        self.comm = comm
        self.vocab_start = comm.rank * (vocab_size // comm.size)
        shard = TPShard(dim=0, rank=comm.rank, size=comm.size, ranks=tuple(comm.group.ranks))
        self.weight = make_param((vocab_size // comm.size, hidden_size), EMBEDDING, device, dtype, tp=shard)
        mark_own_grad(self.weight)  # also when tied to the output layer, whose GEMM adds its part itself

    def forward(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        ids_S = region_rows(input_ids_BS, self.comm)
        if self.comm.size == 1:
            return EmbeddingLookup.apply(ids_S, self.weight).view(*input_ids_BS.shape, -1)
        local_S = ids_S - self.vocab_start
        outside_S = (local_S < 0) | (local_S >= self.weight.shape[0])
        partial_SH = EmbeddingLookup.apply(local_S.masked_fill(outside_S, 0), self.weight)
        partial_SH = partial_SH.masked_fill(outside_S[:, None], 0)
        x_RH = ScatterToRegion.apply(partial_SH, self.comm)
        return x_RH.view(input_ids_BS.shape[0], -1, x_RH.shape[-1])


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from this rank's vocabulary block of logits (any dtype; fp32 arithmetic), the same on
    every TP rank. It keeps the logits and three numbers per token; the backward writes the gradient in one
    pass (kernels/cross_entropy.py)."""

    @staticmethod
    def forward(ctx, logits_TV: torch.Tensor, labels_T: torch.Tensor, vocab_start: int, comm: TPComm) -> torch.Tensor:
        group = comm.group.group
        local_T = labels_T - vocab_start
        local_T = torch.where((local_T >= 0) & (local_T < logits_TV.shape[1]), local_T, -1)
        max_T, sum_exp_T, label_logit_T = cross_entropy_stats(logits_TV, local_T)
        if group is not None:  # combine the blocks' statistics: the global max, then sums rescaled to it
            global_max_T = all_reduce_(max_T.clone(), group, dist.ReduceOp.MAX)
            sums_2T = all_reduce_(torch.stack((sum_exp_T * (max_T - global_max_T).exp(), label_logit_T)), group)
            max_T, sum_exp_T, label_logit_T = global_max_T, sums_2T[0], sums_2T[1]
        ctx.save_for_backward(logits_TV, local_T, max_T, sum_exp_T)
        return sum_exp_T.log() + max_T - label_logit_T

    @staticmethod
    def backward(ctx, grad_loss_T: torch.Tensor):
        logits_TV, local_T, max_T, sum_exp_T = ctx.saved_tensors
        return cross_entropy_grad(logits_TV, local_T, max_T, sum_exp_T, grad_loss_T), None, None, None


def lm_cross_entropy(hidden_BRH: torch.Tensor, output_weight_VH: torch.Tensor, labels_BS: torch.Tensor,
                     comm: TPComm) -> torch.Tensor:
    """Mean next-token loss over the micro-batch; the output layer is column-parallel over the vocabulary
    (its logits in the model's dtype; the loss in fp32)."""
    logits_SV = ColumnParallelLinearFn.apply(hidden_BRH.reshape(-1, hidden_BRH.shape[-1]), output_weight_VH, comm)
    labels_S = region_rows(labels_BS, comm).reshape(-1)
    vocab_start = comm.rank * output_weight_VH.shape[0]
    return VocabParallelCrossEntropy.apply(logits_SV, labels_S, vocab_start, comm).mean()
