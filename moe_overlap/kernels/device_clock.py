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


def add_clock(acc_K: torch.Tensor, slot: int, sign: int) -> None:
    """``acc_K[slot] += sign * now`` (atomically) on the current stream, ``now`` in nanoseconds of the GPU's global
    timer."""
    if not (HAVE_TRITON and acc_K.is_cuda and acc_K.dtype == torch.int64):
        raise RuntimeError("add_clock reads the GPU's timer: it needs triton and an int64 CUDA tensor")
    _add_clock[(1,), acc_K.device](acc_K, slot, SIGN=sign, num_warps=1)
