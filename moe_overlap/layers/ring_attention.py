"""Ring attention: causal self-attention over a sequence split across the context-parallel group, computed block
by block and merged by log-sum-exp, forward and backward (the split and the ring: distributed/context_parallel.py).

CP rank r holds the queries, keys and values of chunks r and 2N-1-r of every sequence (N = CP size, each local
sequence L = two chunks of c tokens). At step i of the ring it holds the keys and values of rank s = (r-i) mod N
and attends to what the causal mask lets it see of them (:func:`ring_schedule`):
  i = 0   its own block, causal (its local positions increase)
  s < r   all its queries against s's first chunk (chunk s precedes chunks r and 2N-1-r; chunk 2N-1-s follows both)
  s > r   its second chunk's queries against all of s's block (both precede chunk 2N-1-r, neither precedes chunk r)
so every step past the first does 2c^2 query-key pairs, and every rank the same work.

Each block returns its output and log-sum-exp (fp32); they merge as out = sum_i exp(lse_i - lse) out_i with
lse = logaddexp_i(lse_i), accumulated in fp32. Backward is the flash contract: a block's gradients need only the
merged output and log-sum-exp. The keys and values travel the ring again, their gradients (fp32) with them, one
step behind, so each block's gradient reaches its owner after N hops. With the overlap switch on, the next
transfer runs under the current block's attention (and a gradient's hop under the next block's); off, each
transfer completes before the compute that follows (the reference). The same math either way.

Kernels (:class:`BlockKernel`): ``math`` (any device, the reference: explicit scores, computed in fp32 or wider)
and, on CUDA, the aten SDPA ops that return the log-sum-exp: ``flash`` (grouped-query attention native),
``efficient`` and ``cudnn`` (keys and values repeated per query head, their gradients summed back).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from moe_overlap.distributed.context_parallel import CPComm
from moe_overlap.distributed.ring import Pending

log = logging.getLogger(__name__)

aten = torch.ops.aten


@dataclass(frozen=True)
class Block:
    """One ring step's attention on one rank: local query rows against rows of the held keys and values."""

    step: int
    source: int  # the CP rank whose keys and values these are
    queries: slice  # rows of the local queries (sequence dim)
    keys: slice  # rows of the source's local keys and values
    causal: bool  # the mask within the block (only the first step's, whose rows line up)


def ring_schedule(rank: int, size: int, local_length: int) -> list[Block]:
    """What CP rank ``rank`` attends at each step of the ring (see the module docstring)."""
    if local_length % 2:
        raise ValueError(f"a local sequence of {local_length} tokens is not two equal chunks")
    whole, half = slice(0, local_length), local_length // 2
    blocks = [Block(0, rank, whole, whole, True)]
    for step in range(1, size):
        source = (rank - step) % size
        if source < rank:
            blocks.append(Block(step, source, whole, slice(0, half), False))
        else:
            blocks.append(Block(step, source, slice(half, local_length), whole, False))
    return blocks


# ----------------------------------------------------------------------------------------------- kernels


class BlockKernel(Protocol):
    """One block's attention. q (B, N, Lq, D); k, v (B, G, Lk, D) with G dividing N (query head n reads group
    n // (N/G), as SDPA's enable_gqa). forward -> (out (B, N, Lq, D), lse (B, N, Lq) fp32 or wider, what backward
    needs); backward -> (dq, dk, dv) in the inputs' dtypes, from the *merged* out and lse of these query rows."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor, Any]:
        ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float, saved: Any) -> tuple[torch.Tensor, ...]:
        ...


class MathKernel:
    """Explicit scores in fp32 (or the inputs' dtype when wider): the CPU path and the reference."""

    name = "math"

    @staticmethod
    def _scores(q5: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
        scores = torch.einsum("bgrqd,bgkd->bgrqk", q5, k) * scale
        if causal:
            above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(above, float("-inf"))
        return scores

    def forward(self, q, k, v, causal, scale):
        dtype = torch.promote_types(q.dtype, torch.float32)
        q5 = q.to(dtype).unflatten(1, (k.shape[1], -1))  # (B, G, N/G, Lq, D)
        scores = self._scores(q5, k.to(dtype), causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.einsum("bgrqk,bgkd->bgrqd", torch.exp(scores - lse[..., None]), v.to(dtype))
        return out.flatten(1, 2), lse.flatten(1, 2), None

    def backward(self, dout, q, k, v, out, lse, causal, scale, saved):
        dtype = torch.promote_types(q.dtype, torch.float32)
        groups = k.shape[1]
        q5, dout5, out5 = (x.to(dtype).unflatten(1, (groups, -1)) for x in (q, dout, out))
        k_, v_ = k.to(dtype), v.to(dtype)
        probs = torch.exp(self._scores(q5, k_, causal, scale) - lse.to(dtype).unflatten(1, (groups, -1))[..., None])
        dv = torch.einsum("bgrqk,bgrqd->bgkd", probs, dout5)
        dprobs = torch.einsum("bgrqd,bgkd->bgrqk", dout5, v_)
        dscores = probs * (dprobs - (dout5 * out5).sum(-1, keepdim=True))
        dq = torch.einsum("bgrqk,bgkd->bgrqd", dscores, k_) * scale
        dk = torch.einsum("bgrqk,bgrqd->bgkd", dscores, q5) * scale
        return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashKernel:
    """aten._scaled_dot_product_flash_attention and its backward (fp16/bf16, head dim a multiple of 8, <= 256)."""

    name = "flash"

    def forward(self, q, k, v, causal, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, causal, scale, saved):
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _repeat_kv(x_BGLD: torch.Tensor, heads: int) -> torch.Tensor:
    return x_BGLD.repeat_interleave(heads // x_BGLD.shape[1], dim=1)


def _sum_kv(dx_BNLD: torch.Tensor, groups: int) -> torch.Tensor:
    return dx_BNLD.unflatten(1, (groups, -1)).sum(2)


class EfficientKernel:
    """aten._scaled_dot_product_efficient_attention (any float dtype; its log-sum-exp rows padded to 32)."""

    name = "efficient"

    def forward(self, q, k, v, causal, scale):
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]), None, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]], (seed, offset, lse.shape[-1])

    def backward(self, dout, q, k, v, out, lse, causal, scale, saved):
        seed, offset, padded = saved
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]), None, out,
            F.pad(lse, (0, padded - lse.shape[-1])), seed, offset, 0.0, [True, True, True, False], causal,
            scale=scale)
        return dq, _sum_kv(dk, k.shape[1]), _sum_kv(dv, k.shape[1])


class CudnnKernel:
    """aten._scaled_dot_product_cudnn_attention (fp16/bf16); contiguous (B, N, L, D) operands throughout."""

    name = "cudnn"

    def forward(self, q, k, v, causal, scale):
        heads = q.shape[1]
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q.contiguous(), _repeat_kv(k, heads).contiguous(), _repeat_kv(v, heads).contiguous(), None, True, 0.0,
            causal, False, scale=scale)
        return out, lse.reshape(q.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset, lse.shape)

    def backward(self, dout, q, k, v, out, lse, causal, scale, saved):
        cum_q, cum_k, max_q, max_k, seed, offset, lse_shape = saved
        heads = q.shape[1]
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dout.contiguous(), q.contiguous(), _repeat_kv(k, heads).contiguous(), _repeat_kv(v, heads).contiguous(),
            out.contiguous(), lse.reshape(lse_shape), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
            scale=scale)
        return dq, _sum_kv(dk, k.shape[1]), _sum_kv(dv, k.shape[1])


KERNELS: dict[str, BlockKernel] = {k.name: k for k in (MathKernel(), FlashKernel(), EfficientKernel(), CudnnKernel())}


@functools.lru_cache(maxsize=None)
def choose_kernel(device_type: str, dtype: torch.dtype, head_dim: int) -> BlockKernel:
    """The block kernel for these inputs, logged once with the reason: math on CPU; on CUDA cuDNN where it runs
    (fp16/bf16, head dim a multiple of 8 up to 128: 1.5-1.7x faster than flash for the Mixtral head shape on an
    H200, benchmarks/results/cp_attention_1xh200.json), else flash (head dim up to 256), else efficient (head
    dim a multiple of 8), else math."""
    half = dtype in (torch.float16, torch.bfloat16)
    if device_type != "cuda":
        name, why = "math", "the device is the CPU"
    elif half and head_dim % 8 == 0 and head_dim <= 128:
        name, why = "cudnn", f"{dtype} with head dim {head_dim}"
    elif half and head_dim % 8 == 0 and head_dim <= 256:
        name, why = "flash", f"{dtype} with head dim {head_dim} (cuDNN takes up to 128)"
    elif head_dim % 8 == 0:
        name, why = "efficient", f"flash needs fp16/bf16 and head dim <= 256 (here {dtype}, {head_dim})"
    else:
        name, why = "math", f"flash and efficient need a head dim that is a multiple of 8 (here {head_dim})"
    log.info("ring attention kernel: %s (%s)", name, why)
    return KERNELS[name]


# ------------------------------------------------------------------------------------------------- the ring


class BlockRing(Protocol):
    """Hands a block to the next rank and returns what the previous rank handed on (CPComm.pass_on)."""

    def pass_on(self, block: torch.Tensor) -> Pending:
        ...


def _merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running ones, in place (views of the accumulators are fine): the
    block's share of the softmax mass is sigmoid(lse - lse_acc), and logaddexp(a, b) = a - logsigmoid(a - b)."""
    out_acc.lerp_(out.to(out_acc.dtype), torch.sigmoid(lse - lse_acc).unsqueeze(-1))
    lse_acc.sub_(F.logsigmoid(lse_acc - lse))


def ring_forward(q_BNLD: torch.Tensor, kv_2BGLD: torch.Tensor, schedule: list[Block], ring: BlockRing,
                 kernel: BlockKernel, overlap: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(output in q's dtype, merged log-sum-exp (B, N, L), what each block's backward needs) of one rank."""
    acc_dtype = torch.promote_types(q_BNLD.dtype, torch.float32)
    out_acc = lse_acc = None
    saved = []
    kv = kv_2BGLD
    for block in schedule:
        incoming = ring.pass_on(kv) if block.step < len(schedule) - 1 else None
        if incoming is not None and not overlap:
            incoming.wait()  # the reference: the exchange completes before the compute
        out, lse, block_saved = kernel.forward(q_BNLD[:, :, block.queries], kv[0][:, :, block.keys],
                                               kv[1][:, :, block.keys], block.causal, scale)
        saved.append(block_saved)
        if out_acc is None:  # the first block covers every query row
            out_acc, lse_acc = out.to(acc_dtype), lse.to(acc_dtype).contiguous()
        else:
            _merge_(out_acc[:, :, block.queries], lse_acc[:, :, block.queries], out, lse)
        if incoming is not None:
            kv = incoming.wait()
    return out_acc.to(q_BNLD.dtype), lse_acc, saved


def ring_backward(dout_BNLD: torch.Tensor, q_BNLD: torch.Tensor, kv_2BGLD: torch.Tensor, out_BNLD: torch.Tensor,
                  lse_BNL: torch.Tensor, saved: list, schedule: list[Block], kv_ring: BlockRing,
                  dkv_ring: BlockRing, kernel: BlockKernel, overlap: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq in q's dtype, d(kv) of this rank's block in kv's dtype): the keys and values travel the ring again and
    the gradient of the block in hand travels one step behind them, accumulated in fp32."""
    acc_dtype = torch.promote_types(q_BNLD.dtype, torch.float32)
    dq_acc = None
    dkv_in_flight: Pending | None = None
    kv = kv_2BGLD
    for block in schedule:
        incoming = kv_ring.pass_on(kv) if block.step < len(schedule) - 1 else None
        if incoming is not None and not overlap:
            incoming.wait()
        rows = block.queries
        dq, dk, dv = kernel.backward(dout_BNLD[:, :, rows], q_BNLD[:, :, rows], kv[0][:, :, block.keys],
                                     kv[1][:, :, block.keys], out_BNLD[:, :, rows], lse_BNL[:, :, rows].contiguous(),
                                     block.causal, scale, saved[block.step])
        if dq_acc is None:
            dq_acc = dq.to(acc_dtype)
        else:
            dq_acc[:, :, rows] += dq
        if dkv_in_flight is None:  # the first block covers every key row
            dkv_acc = torch.stack((dk, dv)).to(acc_dtype)
        else:  # the sum so far of the block in hand, from the ranks that held it before
            dkv_acc = dkv_in_flight.wait()
            dkv_acc[0][:, :, block.keys] += dk
            dkv_acc[1][:, :, block.keys] += dv
        dkv_in_flight = dkv_ring.pass_on(dkv_acc)
        if not overlap:
            dkv_in_flight.wait()
        if incoming is not None:
            kv = incoming.wait()
    return dq_acc.to(q_BNLD.dtype), dkv_in_flight.wait().to(kv_2BGLD.dtype)  # the last hop ends at the owner


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's local queries against the whole sequence's keys and values."""

    @staticmethod
    def forward(ctx, q_BNLD: torch.Tensor, k_BGLD: torch.Tensor, v_BGLD: torch.Tensor, comm: CPComm,
                kernel: BlockKernel) -> torch.Tensor:
        kv_2BGLD = torch.stack((k_BGLD, v_BGLD))  # one block travels: only the key-value heads
        schedule = ring_schedule(comm.rank, comm.size, q_BNLD.shape[2])
        scale = 1.0 / math.sqrt(q_BNLD.shape[-1])
        out_BNLD, lse_BNL, saved = ring_forward(q_BNLD, kv_2BGLD, schedule, comm, kernel, comm.overlap, scale)
        ctx.save_for_backward(q_BNLD, kv_2BGLD, out_BNLD, lse_BNL)
        ctx.comm, ctx.kernel, ctx.schedule, ctx.saved, ctx.scale = comm, kernel, schedule, saved, scale
        return out_BNLD

    @staticmethod
    def backward(ctx, dout_BNLD: torch.Tensor):
        q_BNLD, kv_2BGLD, out_BNLD, lse_BNL = ctx.saved_tensors
        comm = ctx.comm
        dq, dkv = ring_backward(dout_BNLD, q_BNLD, kv_2BGLD, out_BNLD, lse_BNL, ctx.saved, ctx.schedule, comm, comm,
                                ctx.kernel, comm.overlap, ctx.scale)
        return dq, dkv[0], dkv[1], None, None


def ring_attention(q_BNLD: torch.Tensor, k_BGLD: torch.Tensor, v_BGLD: torch.Tensor, comm: CPComm) -> torch.Tensor:
    """Causal attention of the local queries (B, N, L, D) against the CP group's whole sequence; k and v
    (B, G, L, D) hold the local key-value heads."""
    kernel = choose_kernel(q_BNLD.device.type, q_BNLD.dtype, q_BNLD.shape[-1])
    return RingAttention.apply(q_BNLD, k_BGLD, v_BGLD, comm, kernel)


# ------------------------------------------------------------------------------- one process, no transfers


class LocalRelay:
    """The ring of one simulated rank in a single process: pass k hands back the block of rank (rank-k-1),
    as the real ring would, without moving anything."""

    def __init__(self, blocks: list[torch.Tensor], rank: int):
        self.blocks, self.rank, self.passes = blocks, rank, 0

    def pass_on(self, block: torch.Tensor) -> Pending:
        self.passes += 1
        return Pending(self.blocks[(self.rank - self.passes) % len(self.blocks)])


class LocalCollector:
    """The gradient ring of one simulated rank: pass k adds the block into its owner's total, rank (rank-k),
    and hands back zeros to accumulate into (the ranks run one after another, not in lockstep)."""

    def __init__(self, totals: list, rank: int):
        self.totals, self.rank, self.passes = totals, rank, 0

    def pass_on(self, block: torch.Tensor) -> Pending:
        owner = (self.rank - self.passes) % len(self.totals)
        self.passes += 1
        self.totals[owner] = block.clone() if self.totals[owner] is None else self.totals[owner].add_(block)
        return Pending(torch.zeros_like(block))


def blockwise_forward(q_parts: list[torch.Tensor], kv_parts: list[torch.Tensor], kernel: BlockKernel,
                      scale: float) -> list[tuple[torch.Tensor, torch.Tensor, list]]:
    """Every CP rank's forward, one rank after another in one process, no transfers: ``q_parts[r]`` (B, N, L, D)
    and ``kv_parts[r]`` (2, B, G, L, D) are rank r's local tensors. Returns each rank's (out, lse, saved)."""
    size = len(q_parts)
    return [ring_forward(q, kv_parts[r], ring_schedule(r, size, q.shape[2]), LocalRelay(kv_parts, r), kernel, False,
                         scale) for r, q in enumerate(q_parts)]


def blockwise_backward(dout_parts: list[torch.Tensor], q_parts: list[torch.Tensor], kv_parts: list[torch.Tensor],
                       forward: list[tuple[torch.Tensor, torch.Tensor, list]], kernel: BlockKernel,
                       scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The backward of :func:`blockwise_forward`: each rank's dq and d(kv) (fp32 sums, kv's dtype)."""
    size = len(q_parts)
    totals: list = [None] * size
    dq_parts = []
    for r, (q, (out, lse, saved)) in enumerate(zip(q_parts, forward)):
        dq, _ = ring_backward(dout_parts[r], q, kv_parts[r], out, lse, saved, ring_schedule(r, size, q.shape[2]),
                              LocalRelay(kv_parts, r), LocalCollector(totals, r), kernel, False, scale)
        dq_parts.append(dq)
    return dq_parts, [total.to(kv.dtype) for total, kv in zip(totals, kv_parts)]
