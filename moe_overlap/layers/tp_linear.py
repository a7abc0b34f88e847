"""Tensor-parallel linears (Megatron's column / row parallel), optionally sequence parallel.

R: this rank's token rows (its sequence block under SP); S: the rows of the TP region (all ranks' blocks,
rank-major, under SP; the same rows as R without SP); J: any width. Every communication goes through a TPComm, which
picks the serial path or its overlapped twin by switch; the math here is the same either way.

  column  y_SF = gather(x_RH) @ W_FH^T        (W split on its output dim)
          dgrad  grad_x_RH = scatter(grad_y_SF @ W_FH)       pipelined: tp_comm_overlap_rs_dgrad
          wgrad  grad_W_FH = grad_y_SF^T @ gather(x_RH)      that gather hides under dgrad: tp_comm_bulk_dgrad;
                                                             dgrad's scatter hides under wgrad: tp_comm_bulk_wgrad
  row     y_RH = scatter(x_SF @ W_HF^T)        (W split on its input dim)   pipelined: tp_comm_overlap_rs
          dgrad  grad_x_SF = gather(grad_y_RH) @ W_HF        pipelined: tp_comm_overlap_ag (keeps the gather)
          wgrad  grad_W_HF = gather(grad_y_RH)^T @ x_SF
The column forward's gather is pipelined with tp_comm_overlap_ag. Under SP only the local rows of x are saved
for backward (re-gathered there), which is the point of sequence parallelism. Weight gradients go straight
into the weights' fp32 main_grad (layers/wgrad.py). Under ``fp8`` (train.fp8_recipe) the forward and dgrad GEMMs
run in FP8 (layers/fp8.py: :func:`_gemm` hands the collectives an FP8 GEMM in place of W), serial or pipelined by
the same switches; wgrad stays bf16 (an FP8 one,
kernels/fp8_wgrad.py with every row one group, measured 16% slower on a Mixtral-sized fc1 than cuBLAS's bf16 GEMM
into main_grad: fp8_gemm_wgrad_1xh100.json). Where the
contraction is split over the ranks (the row forward, the column dgrad) the FP8 scales of both operands are shared
over them (one all-reduce of the maxima: of the activations' rows per call, of the weight's columns per step), so
the partial products are the one process's.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from moe_overlap.distributed.mesh import GroupHandle
from moe_overlap.distributed.ring import Gemm, Pending, TPComm, as_gemm
from moe_overlap.layers.init import NORMAL, make_param
from moe_overlap.layers.param_info import TPShard
from moe_overlap.layers.deferred_wgrad import weight_grads
from moe_overlap.layers.fp8 import Fp8, Fp8Rows, fp8_gemm, start_split_contraction_rows
from moe_overlap.layers.wgrad import linear_wgrad, mark_own_grad


def _contraction_split(comm: TPComm) -> GroupHandle | None:
    """The ranks that each hold part of a GEMM's contraction when the weight is split along it (FP8 shares its
    scales over them), or None with one rank."""
    return comm.group if comm.size > 1 else None


def _start_rows(a: torch.Tensor, w: torch.Tensor, contract_last: bool, fp8: Fp8 | None, comm: TPComm,
                split: bool = False) -> Pending:
    """a's rows as the GEMM by w takes them (see :func:`_gemm`), started: in FP8 with the contraction ``split``,
    their shared maxima cross until ``wait()``."""
    if fp8 is None:
        return Pending(a)
    return start_split_contraction_rows(a, w, contract_last, fp8, _contraction_split(comm) if split else None)


def _operand(w: torch.Tensor, contract_last: bool, fp8: Fp8 | None, comm: TPComm, split: bool = False,
             fast_accum: bool = False) -> torch.Tensor | Gemm:
    """B of :func:`_gemm`."""
    if fp8 is None:
        return w.t() if contract_last else w
    return fp8_gemm(w, contract_last, fp8, fast_accum, _contraction_split(comm) if split else None)


def _gemm(a: torch.Tensor, w: torch.Tensor, contract_last: bool, fp8: Fp8 | None, comm: TPComm,
          split: bool = False, fast_accum: bool = False) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor | Gemm]:
    """(a, B) for ``a @ B`` through the TP collectives, B = w^T if ``contract_last`` else w: the matrix itself in
    bf16; in FP8 the GEMM by w, and where the contraction is ``split`` over the ranks, a's rows quantized once with
    their scales shared (layers/fp8.py)."""
    return (_start_rows(a, w, contract_last, fp8, comm, split).wait(),
            _operand(w, contract_last, fp8, comm, split, fast_accum))


# -------------------------------------------------------------------------------------- column parallel


def column_dgrad_start(grad_y: Pending, w_FH: torch.Tensor, comm: TPComm, fp8: Fp8 | None = None) -> Pending:
    """grad_x = scatter(grad_y @ W) from grad_y's rows as ``_start_rows`` started them: pipelined, or the GEMM now
    and its scatter in flight (bulk) or done."""
    grad_y, b = grad_y.wait(), _operand(w_FH, False, fp8, comm, split=True)  # the contraction over F is split
    if comm.overlap.rs_dgrad:
        return Pending(comm.matmul_scatter(grad_y, b, overlap=True))
    return comm.start_scatter(as_gemm(b).product(grad_y, None), overlap=comm.overlap.bulk_wgrad)


class ColumnParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RH: torch.Tensor, w_FH: torch.Tensor, comm: TPComm, fp8: Fp8 | None = None) -> torch.Tensor:
        ctx.save_for_backward(x_RH)
        ctx.comm, ctx.weights = comm, (w_FH,)  # the parameter itself (its main_grad), also under recomputation
        ctx.fp8 = fp8
        return comm.gather_matmul(*_gemm(x_RH, w_FH, True, fp8, comm, fast_accum=True), overlap=comm.overlap.ag)[0]

    @staticmethod
    def backward(ctx, grad_y_SF: torch.Tensor):
        (x_RH,), (w_FH,) = ctx.saved_tensors, ctx.weights
        comm = ctx.comm
        grad_y_SF = grad_y_SF.contiguous()
        # FP8: the output gradient's shared maxima start first, so the serial gather of x queues behind them and
        # one wait covers both (2xH100: about 1 ms of exposed TP wait per all-reduce of maxima waited for alone)
        grad_y = _start_rows(grad_y_SF, w_FH, False, ctx.fp8, comm, split=True)
        x_gather = comm.start_gather(x_RH, overlap=comm.overlap.bulk_dgrad)
        grad_x = column_dgrad_start(grad_y, w_FH, comm, ctx.fp8)
        grad_w_FH, = weight_grads(linear_wgrad, (w_FH, grad_y_SF, x_gather.wait()), ctx.weights)
        return grad_x.wait(), grad_w_FH, None, None


# ----------------------------------------------------------------------------------------- row parallel


def row_dgrad(grad_y_RH: torch.Tensor, w_HF: torch.Tensor, comm: TPComm, fp8: Fp8 | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather(grad_y) @ W, gather(grad_y)): the gathered gradient is what wgrad needs."""
    return comm.gather_matmul(*_gemm(grad_y_RH, w_HF, False, fp8, comm), overlap=comm.overlap.ag, keep_gathered=True)


class RowParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SF: torch.Tensor, w_HF: torch.Tensor, comm: TPComm, fp8: Fp8 | None = None) -> torch.Tensor:
        ctx.save_for_backward(x_SF)
        ctx.comm, ctx.weights, ctx.fp8 = comm, (w_HF,), fp8
        x, b = _gemm(x_SF, w_HF, True, fp8, comm, split=True, fast_accum=True)  # the contraction over F is split
        return comm.matmul_scatter(x, b, overlap=comm.overlap.rs)

    @staticmethod
    def backward(ctx, grad_y_RH: torch.Tensor):
        (x_SF,), (w_HF,) = ctx.saved_tensors, ctx.weights
        grad_x_SF, grad_y_SH = row_dgrad(grad_y_RH.contiguous(), w_HF, ctx.comm, ctx.fp8)
        grad_w_HF, = weight_grads(linear_wgrad, (w_HF, grad_y_SH, x_SF), ctx.weights)
        return grad_x_SF, grad_w_HF, None, None


# ------------------------------------------------------------------------------------ region boundaries


class ScatterToRegion(torch.autograd.Function):
    """Partial sums of every row -> this rank's rows, summed (SP: reduce-scatter; else all-reduce).
    Backward: gather (SP: all-gather; else identity). The vocab-parallel embedding ends with it."""

    @staticmethod
    def forward(ctx, x_SH: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return comm.scatter(x_SH)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):
        return ctx.comm.gather(grad_RH.contiguous()), None


class GatherReplicated(torch.autograd.Function):
    """Every rank's rows, for a computation each rank repeats on all of them (the router's choices and its
    auxiliary losses over the whole micro-batch). Backward keeps this rank's rows only: each rank holds the
    full gradient of the repeated computation, so summing the copies would count it ``size`` times."""

    @staticmethod
    def forward(ctx, x_RJ: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm, ctx.rows = comm, x_RJ.shape[0]
        return comm.gather(x_RJ.contiguous())

    @staticmethod
    def backward(ctx, grad_SJ: torch.Tensor):
        if not ctx.comm.sequence_parallel:
            return grad_SJ, None
        rank, rows = ctx.comm.rank, ctx.rows
        return grad_SJ[rank * rows:(rank + 1) * rows], None


def region_rows(x_BS_: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Per-token tensor (batch, seq, ...) -> rows in the TP region's order: rank-major sequence blocks."""
    return rearrange(x_BS_, "b (t s) ... -> (t b s) ...", t=comm.sequence_shards)


def batch_major(x_S_: torch.Tensor, batch: int, comm: TPComm) -> torch.Tensor:
    """Rows in the TP region's order -> (batch, seq) flattened batch-major, the single-process token order."""
    return rearrange(x_S_, "(t b s) ... -> (b t s) ...", t=comm.sequence_shards, b=batch)


def local_of_batch_major(x_T_: torch.Tensor, batch: int, comm: TPComm) -> torch.Tensor:
    """This rank's rows of a batch-major per-token tensor (its sequence block of every sequence)."""
    t = comm.sequence_shards
    if t == 1:
        return x_T_
    return x_T_.unflatten(0, (batch, t, -1))[:, comm.rank].flatten(0, 1)


# ------------------------------------------------------------------------------------------------ modules


class ColumnParallelLinear(nn.Module):
    """Bias-free; the weight holds this rank's rows of the logical (out_features, in_features) weight.

    ``stack``: the logical weight is that many blocks stacked on the output dim (SwiGLU's [gate; up]), each
    split over the ranks, so a rank's rows are its slice of every block.
    """

    def __init__(self, in_features: int, out_features: int, comm: TPComm, init: str = NORMAL, stack: int = 1,
                 device=None, dtype=None):
        super().__init__()
        self.comm = comm
        shard = TPShard(dim=0, rank=comm.rank, size=comm.size, ranks=tuple(comm.group.ranks), stack=stack)
        self.weight = make_param((out_features // comm.size, in_features), init, device, dtype, tp=shard)
        mark_own_grad(self.weight)
        self.fp8: Fp8 | None = None  # train.fp8_recipe (MixtralModel.use_fp8 sets it)

    def forward(self, x_RH: torch.Tensor) -> torch.Tensor:
        return ColumnParallelLinearFn.apply(x_RH, self.weight, self.comm, self.fp8)


class RowParallelLinear(nn.Module):
    """Bias-free; the weight holds this rank's columns of the logical (out_features, in_features) weight."""

    def __init__(self, in_features: int, out_features: int, comm: TPComm, init: str = NORMAL, device=None,
                 dtype=None):
        super().__init__()
        self.comm = comm
        shard = TPShard(dim=1, rank=comm.rank, size=comm.size, ranks=tuple(comm.group.ranks))
        self.weight = make_param((out_features, in_features // comm.size), init, device, dtype, tp=shard)
        mark_own_grad(self.weight)
        self.fp8: Fp8 | None = None  # train.fp8_recipe (MixtralModel.use_fp8 sets it)

    def forward(self, x_SF: torch.Tensor) -> torch.Tensor:
        return RowParallelLinearFn.apply(x_SF, self.weight, self.comm, self.fp8)
