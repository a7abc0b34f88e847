"""What the training loop needs to know of a parameter beyond its values, in one record per parameter
(``param_info(param)``): how it is initialised, which experts and which tensor-parallel block of its logical tensor
it holds, how its gradient is summed across ranks and where that gradient accumulates. The layer that makes a
parameter fills its record in (layers/init.py make_param, and the layers that know more); the optimizers, the
gradient syncs and checkpoints read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPShard:
    """The block of its logical tensor that a tensor-parallel parameter holds.

    The logical tensor is the parameter's shape with ``dim`` ``size`` times longer, or, with ``stack`` > 1,
    ``stack`` blocks along ``dim`` each split over the ranks (SwiGLU's [gate; up]): then its logical shape has
    an extra leading axis of ``stack`` before ``dim`` ((2, F, H) for a (2F/TP, H) shard), so that every rank's
    block is one box. The logical shape does not depend on the TP size; checkpoints use it.
    """

    dim: int
    rank: int
    size: int
    ranks: tuple[int, ...] = ()  # global ranks of the TP group, by TP rank (empty for one rank)
    stack: int = 1

    @property
    def split_dim(self) -> int:
        """The logical dim the ranks split."""
        return self.dim + (self.stack > 1)

    def local_shape(self, param_shape: torch.Size) -> torch.Size:
        """This rank's block, in logical axes (the parameter viewed with the stack axis split out)."""
        shape = list(param_shape)
        if self.stack > 1:
            shape[self.dim:self.dim + 1] = [self.stack, shape[self.dim] // self.stack]
        return torch.Size(shape)

    def logical_shape(self, param_shape: torch.Size) -> torch.Size:
        return self.full_shape(self.local_shape(param_shape))

    def full_shape(self, local_shape: torch.Size) -> torch.Size:
        """The logical tensor's shape, from a block's (in logical axes)."""
        shape = list(local_shape)
        shape[self.split_dim] *= self.size
        return torch.Size(shape)

    def block_offsets(self, local_shape: torch.Size, rank: int) -> tuple[int, ...]:
        """Where TP rank ``rank``'s block (of ``local_shape``, in logical axes) starts in the logical tensor."""
        offsets = [0] * len(local_shape)
        offsets[self.split_dim] = rank * local_shape[self.split_dim]
        return tuple(offsets)

    def take(self, logical: torch.Tensor, param_shape: torch.Size) -> torch.Tensor:
        """This rank's block of the logical tensor, shaped like the parameter."""
        return logical.chunk(self.size, self.split_dim)[self.rank].reshape(param_shape)

    def assemble(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The logical tensor from every rank's block (parameter-shaped, by TP rank)."""
        return torch.cat([block.view(self.local_shape(block.shape)) for block in blocks], self.split_dim)


@dataclass
class ParamInfo:
    init_rule: str  # layers/init.py: ones, zeros, normal, scaled_normal
    first_expert: int | None = None  # expert weights: the global expert of dim 0's first slice
    tp_shard: TPShard | None = None  # a tensor-parallel block of a larger logical tensor
    # replicated over TP, each rank's gradient from its own sequence block (norms, routers under SP): summed over TP
    sequence_parallel: bool = False
    tied_embedding: bool = False  # the word embedding on the first or last PP stage: gradients summed over the two
    tied_copy: bool = False  # the last stage's copy of a tied embedding: not saved, counted once in the norm
    adds_own_grad: bool = False  # its layer adds the gradient into main_grad itself (layers/wgrad.py)
    main_grad: torch.Tensor | None = None  # the fp32 gradient the optimizer attaches and the step sums into
    # layers/wgrad.placeholder's tensor for its shape, shared with every parameter of that shape (held here, so that
    # it goes when the last of them does)
    grad_placeholder: torch.Tensor | None = None
    lr_scale: float = 1.0  # its learning rate as a multiple of the schedule's (a router's: model.moe_router_lr_scale)
    # train.fp8_param: the fp32 master its FP8 copies are quantized from (the optimizer sets it), and whether its own
    # storage holds them now in place of its values (layers/fp8.py sets it; the optimizer then writes no values)
    fp8_master: torch.Tensor | None = None
    holds_fp8: bool = False


def param_info(param: torch.Tensor) -> ParamInfo:
    """The parameter's record; one made without make_param (a test's bare parameter) gets an empty one."""
    info = getattr(param, "info", None)
    if info is None:
        info = param.info = ParamInfo(init_rule="")
    return info


def tp_shard(param: torch.Tensor) -> TPShard | None:
    return param_info(param).tp_shard


def is_tp_split(param: torch.Tensor) -> bool:
    """True if the TP ranks hold different blocks of this parameter (TP size > 1)."""
    shard = tp_shard(param)
    return shard is not None and shard.size > 1


def is_expert_param(param: torch.Tensor) -> bool:
    return param_info(param).first_expert is not None
