"""How every Triton kernel here is launched: compiled on CUDA tensors, interpreted on CPU tensors or under
TRITON_INTERPRET=1 (read at each launch, so tests can switch it per test), the torch twin when triton is
missing (with a warning naming the kernel, once).

An interpreted kernel cannot call triton's JIT helpers (tl.sum, tl.zeros) unless the interpreter was on when
triton was imported, so the kernels use builtins only: sums go through ``tl.reduce(x, axis, sum_combine)``.
"""

from __future__ import annotations

import os
import warnings

import torch

try:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    sum_combine = tl.standard._sum_combine  # the combine function tl.sum uses; the interpreter knows it
    max_combine = tl.standard._elementwise_max  # tl.max's, likewise
    min_combine = tl.standard._elementwise_min

    class DeviceFunction(JITFunction):
        """A function that kernels call: a compiled kernel inlines it (it is a JITFunction), an interpreted one
        (:class:`Kernel` on CPU) calls it as the Python it is (a plain JITFunction refuses to be called)."""

        def __call__(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

    def _tile_in_groups(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        """Program ``pid``'s (row tile, column tile) of a tiles_m x tiles_n grid walked in groups of GROUP_M row
        tiles, a group's column tiles in turn: neighbouring programs share the operands' row and column tiles in
        L2 (the GEMM kernels' program order)."""
        width = GROUP_M * tiles_n
        first_m = pid // width * GROUP_M
        rows_of_group = tl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (pid % width) % rows_of_group, (pid % width) // rows_of_group

    tile_in_groups = DeviceFunction(_tile_in_groups)

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a Linux dependency
    HAVE_TRITON = False

_TRUE = ("1", "true", "yes", "on", "y")
_warned: set[str] = set()


def interpreter_requested() -> bool:
    """TRITON_INTERPRET=1 in the environment now (read at every call, not at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def use_triton(t: torch.Tensor, what: str) -> bool:
    """Triton on CUDA tensors (or anywhere under TRITON_INTERPRET=1); the torch twin otherwise."""
    if not HAVE_TRITON:
        if t.is_cuda and what not in _warned:
            warnings.warn(f"triton is not importable: {what} runs its torch twin on CUDA instead of the fused "
                          "Triton kernel", RuntimeWarning, stacklevel=3)
            _warned.add(what)
        return False
    return t.is_cuda or interpreter_requested()


def require_triton(what: str) -> None:
    """A clear error where a ``*_triton`` function is called without triton."""
    if not HAVE_TRITON:
        raise RuntimeError(f"triton is not importable: {what} cannot run (install triton==3.6.0, or call the "
                           "*_torch twins)")


def strided_programs(work: int, per_sm: int, device: torch.device, off_gpu: int) -> int:
    """Programs of a kernel whose programs stride over ``work`` rows, blocks or tiles: at most ``per_sm`` an SM on
    CUDA, ``off_gpu`` elsewhere (the interpreter: a few, so that its tests stride), never more than the work."""
    if device.type != "cuda":
        return min(work, off_gpu)
    return min(work, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)


def check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


class Kernel:
    """One kernel function, compiled for CUDA or interpreted for CPU / TRITON_INTERPRET=1, chosen per launch."""

    def __init__(self, fn, do_not_specialize=(), name: str | None = None):
        self.fn = fn
        self.do_not_specialize = list(do_not_specialize)  # runtime sizes that change every step
        self.name = name  # the compiled kernel's name (profiles show it), if not the function's
        self._compiled = None
        self._interpreted = None

    def __getitem__(self, grid_and_device):
        grid, device = grid_and_device
        if device.type != "cuda" or interpreter_requested():
            if self._interpreted is None:
                self._interpreted = InterpretedFunction(self.fn)
            return self._interpreted[grid]
        if self._compiled is None:
            self._compiled = JITFunction(self.fn, do_not_specialize=self.do_not_specialize,
                                         repr=None if self.name is None else lambda _: self.name)
        return self._compiled[grid]
