"""Weight gradients put off to a later call: the W half of a zero-bubble schedule's backward.

While a :class:`WeightGradStore` is active (``with store.deferring():``), the layers whose backward computes
the input gradient and the weight gradients separately (the tensor-parallel linears, the grouped experts)
return no weight gradient: they hand the store the function and the tensors that compute it. ``store.run()``
computes them later and accumulates them as autograd would, into ``.grad``, firing the parameters'
post-accumulate hooks that the optimizers use. Parameters outside those layers (norms, routers, the
embedding) get their gradients in the backward itself. Outside a store nothing changes.

The active store is process-wide, not thread-local: on CUDA, autograd runs backward functions on its own
device threads.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch

_active: WeightGradStore | None = None


class WeightGradStore:
    def __init__(self) -> None:
        self.pending: list[tuple[Callable[..., object], tuple, tuple[torch.Tensor, ...]]] = []

    @contextlib.contextmanager
    def deferring(self) -> Iterator[WeightGradStore]:
        global _active
        if _active is not None:
            raise RuntimeError("a WeightGradStore is already deferring weight gradients")
        _active = self
        try:
            yield self
        finally:
            _active = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the deferred computations hold (for memory accounting)."""
        found, todo = [], [inputs for _, inputs, _ in self.pending]
        while todo:
            item = todo.pop()
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, (tuple, list)):
                todo.extend(item)
        return found

    def run(self) -> None:
        """Compute every deferred weight gradient and accumulate it into its parameter."""
        if not self.pending:
            return
        weights = [w for _, _, ws in self.pending for w in ws]
        with torch.enable_grad():
            _DeferredWeightGrads.apply(self, *weights).backward()

    def compute(self) -> list[torch.Tensor]:
        grads = []
        for compute, inputs, _ in self.pending:
            result = compute(*inputs)
            grads += [result] if isinstance(result, torch.Tensor) else list(result)
        self.pending.clear()
        return grads


class _DeferredWeightGrads(torch.autograd.Function):
    """The deferred gradients as the backward of a node whose inputs are the parameters: autograd then owns
    them and accumulates them as in any backward (taking each tensor as ``.grad`` where its layout fits;
    handing them over from outside would make it copy every one)."""

    @staticmethod
    def forward(ctx, store: WeightGradStore, *weights: torch.Tensor) -> torch.Tensor:
        ctx.store = store
        return weights[0].new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        with torch.no_grad():
            return (None, *ctx.store.compute())


def is_deferring() -> bool:
    return _active is not None


def weight_grads(compute: Callable[..., object], inputs: Sequence[object],
                 weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """``compute(*inputs)``: the gradients of the parameters ``weights`` (one tensor, or a tuple in their
    order), now; or, while a store defers, ``None`` for each (the store computes them in its ``run``).
    ``weights`` must be the parameter objects themselves (keep them on the autograd ctx): under saved-tensor
    hooks ``ctx.saved_tensors`` gives back other tensor objects, and accumulating into those would reach
    neither the parameter's hooks nor its main_grad."""
    if _active is None:
        result = compute(*inputs)
        return (result,) if isinstance(result, torch.Tensor) else tuple(result)
    _active.pending.append((compute, tuple(inputs), tuple(weights)))
    return (None,) * len(weights)
