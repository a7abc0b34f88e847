"""Layout-independent weight initialisation.

A parameter's initial value depends only on the seed, its logical name and (for experts) the global expert
index: never on the parallel layout. Each parameter records how it is initialised and, for expert weights,
which global experts its leading dimension holds, so no rank ever builds the whole model to slice it.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

ONES = "ones"
NORMAL = "normal"
SCALED_NORMAL = "scaled_normal"  # output projections: std / sqrt(2 * num_layers), as Megatron


def make_param(shape: tuple[int, ...], init: str, device=None, dtype=None, first_expert: int | None = None) -> nn.Parameter:
    """An uninitialised parameter tagged with its init rule; ``first_expert`` marks expert weights (dim 0)."""
    param = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    param.init_rule = init
    param.first_expert = first_expert
    return param


def is_expert_param(param: torch.Tensor) -> bool:
    return getattr(param, "first_expert", None) is not None


def expert_key(name: str, global_expert: int) -> str:
    """Logical name of one expert's slice: ``layers.1.mlp.experts.w13`` -> ``layers.1.mlp.experts.5.w13``."""
    module, _, leaf = name.rpartition(".")
    return f"{module}.{global_expert}.{leaf}"


def _generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _fill(target: torch.Tensor, rule: str, key: str, seed: int, std: float, num_layers: int) -> None:
    if rule == ONES:
        target.fill_(1.0)
        return
    scale = std / math.sqrt(2.0 * num_layers) if rule == SCALED_NORMAL else std
    values = torch.empty(target.shape, dtype=torch.float32).normal_(0.0, scale, generator=_generator(seed, key))
    target.copy_(values)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float, num_layers: int) -> None:
    """Initialise every tagged parameter of ``model`` from (seed, logical name[, global expert])."""
    for name, param in model.named_parameters():
        rule = getattr(param, "init_rule", None)
        if rule is None:
            raise RuntimeError(f"parameter {name} was not made with make_param; it has no init rule")
        if param.device.type == "meta":
            continue
        if is_expert_param(param):
            for local, expert in enumerate(range(param.first_expert, param.first_expert + param.shape[0])):
                _fill(param[local], rule, expert_key(name, expert), seed, std, num_layers)
        else:
            _fill(param, rule, name, seed, std, num_layers)
