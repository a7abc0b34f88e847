"""Layout-independent weight initialisation.

A parameter's initial value depends only on the seed, its logical name and (for experts) the global expert
index: never on the parallel layout. Each parameter records how it is initialised and, for expert weights,
which global experts its leading dimension holds, so no rank ever builds the whole model to slice it. A
tensor-parallel parameter records which block of its logical tensor it holds (:class:`TPShard`); it is
initialised by generating that one logical tensor and keeping the block, and checkpointed by logical
coordinates, so both are independent of the TP size.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

ONES = "ones"
ZEROS = "zeros"  # biases, as Megatron
NORMAL = "normal"
SCALED_NORMAL = "scaled_normal"  # output projections: std / sqrt(2 * num_layers), as Megatron


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


def make_param(shape: tuple[int, ...], init: str, device=None, dtype=None, first_expert: int | None = None,
               tp: TPShard | None = None) -> nn.Parameter:
    """An uninitialised parameter tagged with its init rule; ``first_expert`` marks expert weights (dim 0),
    ``tp`` a tensor-parallel block of a larger logical tensor."""
    param = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    param.init_rule = init
    param.first_expert = first_expert
    param.tp_shard = tp
    return param


def tp_shard(param: torch.Tensor) -> TPShard | None:
    return getattr(param, "tp_shard", None)


def is_tp_split(param: torch.Tensor) -> bool:
    """True if the TP ranks hold different blocks of this parameter (TP size > 1)."""
    shard = tp_shard(param)
    return shard is not None and shard.size > 1


def is_expert_param(param: torch.Tensor) -> bool:
    return getattr(param, "first_expert", None) is not None


def expert_key(name: str, global_expert: int) -> str:
    """Logical name of one expert's slice: ``layers.1.mlp.experts.w13`` -> ``layers.1.mlp.experts.5.w13``."""
    module, _, leaf = name.rpartition(".")
    return f"{module}.{global_expert}.{leaf}"


def _generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _fill(target: torch.Tensor, rule: str, key: str, seed: int, std: float, num_layers: int,
          shard: TPShard | None = None) -> None:
    if rule in (ONES, ZEROS):
        target.fill_(1.0 if rule == ONES else 0.0)
        return
    scale = std / math.sqrt(2.0 * num_layers) if rule == SCALED_NORMAL else std
    shape = target.shape if shard is None else shard.logical_shape(target.shape)
    values = torch.empty(shape, dtype=torch.float32).normal_(0.0, scale, generator=_generator(seed, key))
    target.copy_(values if shard is None else shard.take(values, target.shape))


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float, num_layers: int) -> None:
    """Initialise every tagged parameter of ``model`` from (seed, logical name[, global expert])."""
    for name, param in model.named_parameters():
        rule = getattr(param, "init_rule", None)
        if rule is None:
            raise RuntimeError(f"parameter {name} was not made with make_param; it has no init rule")
        if param.device.type == "meta":
            continue
        if is_expert_param(param):  # an expert-TP shard's dims are those of one expert's tensor
            for local, expert in enumerate(range(param.first_expert, param.first_expert + param.shape[0])):
                _fill(param[local], rule, expert_key(name, expert), seed, std, num_layers, tp_shard(param))
        else:
            _fill(param, rule, name, seed, std, num_layers, tp_shard(param))
