"""The GPU's own clock, added into a device tensor: how long a wait inside a CUDA graph took.

A graph's replay runs no Python, so no host code can record an event around a wait inside it. Instead the
capture holds two one-thread kernels around the wait, on the same stream:

    add_clock(acc_K, slot, -1)     acc_K[slot] -= now    (runs when the stream reaches the wait)
    ...the wait...
    add_clock(acc_K, slot, +1)     acc_K[slot] += now    (runs when the wait is over)

so every replay adds the wait's length in nanoseconds to ``acc_K[slot]`` (int64; ``now`` is the GPU's global
nanosecond timer, ``%globaltimer``). The adds are atomic: graphs replayed side by side on two streams (paired
micro-batches, training/microbatch_overlap.PairStreams) add into the same slot at once, and a plain load and store
lost one of them (a lost ``-now`` left a step's sum off by the timer itself). CUDA only: the timer is a PTX
register the interpreter cannot read.

Two streams side by side (paired micro-batches) wait while the other computes, so their waits' sum is not the time
the GPU was held up. ``edge`` keeps a state instead, one int64 beside the sums: the streams not computing x
``BIG`` + the waits open. Each edge (a wait entered or left, a stream's block of work begun or ended) adds its delta
atomically and, from the state before and after, adds ``-now`` to the exposed slot when the state becomes "every
stream held, a wait open" and ``+now`` when it stops being so: the slot gains the time no stream computed while one
waited.
"""

from __future__ import annotations

import torch

from moe_overlap.kernels.launch import HAVE_TRITON, Kernel

if HAVE_TRITON:
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer

    def _add_clock_kernel(acc_ptr, slot, SIGN: tl.constexpr):
        tl.atomic_add(acc_ptr + slot, SIGN * globaltimer())

    _add_clock = Kernel(_add_clock_kernel)

    def _edge_kernel(acc_ptr, kind_slot, STATE: tl.constexpr, EXPOSED: tl.constexpr, DELTA: tl.constexpr,
                     KIND_SIGN: tl.constexpr, STREAMS: tl.constexpr, BIG: tl.constexpr):
        if KIND_SIGN != 0:  # a wait's own length, as add_clock
            tl.atomic_add(acc_ptr + kind_slot, KIND_SIGN * globaltimer())
        before = tl.atomic_add(acc_ptr + STATE, DELTA)
        after = before + DELTA
        now = globaltimer()
        was = (before // BIG == STREAMS) & (before % BIG > 0)
        is_now = (after // BIG == STREAMS) & (after % BIG > 0)
        tl.atomic_add(acc_ptr + EXPOSED, tl.where(is_now & ~was, -now, tl.where(was & ~is_now, now, 0)))

    _edge = Kernel(_edge_kernel)

BIG = 1 << 16  # the state's unit of streams not computing; the waits open stay below it
WAIT, BLOCK = BIG + 1, BIG  # a wait entered holds its stream and opens a wait; a block of work ended holds its stream


def add_clock(acc_K: torch.Tensor, slot: int, sign: int) -> None:
    """``acc_K[slot] += sign * now`` (atomically) on the current stream, ``now`` in nanoseconds of the GPU's global
    timer."""
    if not (HAVE_TRITON and acc_K.is_cuda and acc_K.dtype == torch.int64):
        raise RuntimeError("add_clock reads the GPU's timer: it needs triton and an int64 CUDA tensor")
    _add_clock[(1,), acc_K.device](acc_K, slot, SIGN=sign, num_warps=1)


def edge(acc_K: torch.Tensor, state_slot: int, exposed_slot: int, streams: int, delta: int, kind_slot: int = 0,
         kind_sign: int = 0) -> None:
    """On the current stream: the state ``acc_K[state_slot]`` += ``delta`` (``WAIT`` entering a wait, ``-WAIT``
    leaving it, ``-BLOCK`` beginning a block of work, ``BLOCK`` ending it) and ``acc_K[exposed_slot]`` timed as the
    module says, for ``streams`` streams side by side; ``kind_sign`` +-1 also adds +-now to ``acc_K[kind_slot]``."""
    if not (HAVE_TRITON and acc_K.is_cuda and acc_K.dtype == torch.int64):
        raise RuntimeError("edge reads the GPU's timer: it needs triton and an int64 CUDA tensor")
    _edge[(1,), acc_K.device](acc_K, kind_slot, STATE=state_slot, EXPOSED=exposed_slot, DELTA=delta,
                              KIND_SIGN=kind_sign, STREAMS=streams, BIG=BIG, num_warps=1)
