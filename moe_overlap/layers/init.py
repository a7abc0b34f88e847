"""Layout-independent weight initialisation.

A parameter's initial value depends only on the seed, its logical name and (for experts) the global expert
index: never on the parallel layout. Each parameter's record (layers/param_info.py) says how it is initialised
and, for expert weights, which global experts its leading dimension holds, so no rank ever builds the whole model
to slice it. A tensor-parallel parameter's record says which block of its logical tensor it holds (TPShard); it
is initialised by generating that one logical tensor and keeping the block, and checkpointed by logical
coordinates, so both are independent of the TP size.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from moe_overlap.layers.param_info import ParamInfo, TPShard

ONES = "ones"
ZEROS = "zeros"  # biases, as Megatron
NORMAL = "normal"
SCALED_NORMAL = "scaled_normal"  # output projections: std / sqrt(2 * num_layers), as Megatron
EMBEDDING = "embedding"  # the token embedding: normal with model.embedding_init_std (None: std)


def make_param(shape: tuple[int, ...], init: str, device=None, dtype=None, first_expert: int | None = None,
               tp: TPShard | None = None) -> nn.Parameter:
    """An uninitialised parameter with its record (layers/param_info.py): its init rule; ``first_expert`` marks
    expert weights (dim 0), ``tp`` a tensor-parallel block of a larger logical tensor."""
    param = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    param.info = ParamInfo(init_rule=init, first_expert=first_expert, tp_shard=tp)
    return param


def expert_key(name: str, global_expert: int) -> str:
    """Logical name of one expert's slice: ``layers.1.mlp.experts.w13`` -> ``layers.1.mlp.experts.5.w13``."""
    module, _, leaf = name.rpartition(".")
    return f"{module}.{global_expert}.{leaf}"


def _generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _fill(target: torch.Tensor, rule: str, key: str, seed: int, std: float, num_layers: int,
          shard: TPShard | None = None, embedding_std: float | None = None) -> None:
    if rule in (ONES, ZEROS):
        target.fill_(1.0 if rule == ONES else 0.0)
        return
    scale = (std / math.sqrt(2.0 * num_layers) if rule == SCALED_NORMAL
             else embedding_std if rule == EMBEDDING and embedding_std is not None else std)
    shape = target.shape if shard is None else shard.logical_shape(target.shape)
    values = torch.empty(shape, dtype=torch.float32).normal_(0.0, scale, generator=_generator(seed, key))
    target.copy_(values if shard is None else shard.take(values, target.shape))


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float, num_layers: int,
                    embedding_std: float | None = None) -> None:
    """Initialise every tagged parameter of ``model`` from (seed, logical name[, global expert]); the token
    embedding's std is ``embedding_std`` where given, else ``std``."""
    for name, param in model.named_parameters():
        info = getattr(param, "info", None)
        if info is None:
            raise RuntimeError(f"parameter {name} was not made with make_param; it has no init rule")
        if param.device.type == "meta":
            continue
        if info.first_expert is not None:  # an expert-TP shard's dims are those of one expert's tensor
            for local, expert in enumerate(range(info.first_expert, info.first_expert + param.shape[0])):
                _fill(param[local], info.init_rule, expert_key(name, expert), seed, std, num_layers, info.tp_shard)
        else:
            _fill(param, info.init_rule, name, seed, std, num_layers, info.tp_shard, embedding_std)
