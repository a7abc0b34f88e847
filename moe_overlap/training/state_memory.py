"""The model's own memory on each rank, before activations: the weights in the compute dtype, their fp32 gradients
(``main_grad``) and the optimizer's fp32 master weights and AdamW moments, which the distributed optimizer shards
over the data-parallel ranks (dense parameters over DP x CP, experts over expert-DP); under ``train.fp8_recipe`` the
FP8 copies of the weights its GEMMs read (layers/fp8.py). Counted from the rank's part
of the model built on the meta device, so the layout rules (TP splits, PP stages, local experts, tied embeddings)
are the model code's own. The distributed optimizer pads each bucket to equal shards: a few KiB, not counted."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.config import Config, ConfigError
from moe_overlap.config.defaults import fp8_gemm_min_dim, fp8_param
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.layers.fp8 import weight_copy_bytes
from moe_overlap.layers.param_info import is_expert_param
from moe_overlap.models.mixtral import MixtralModel
from moe_overlap.models.pipeline_stages import PipelineStages
from moe_overlap.precision import DTYPES

FP32_BYTES = 4


@dataclass(frozen=True)
class StateBytes:
    weights: int  # in the compute dtype (train.precision)
    gradients: int  # fp32 main_grad, every local parameter
    optimizer: int  # fp32 master weights (unless the weights are fp32) and the two AdamW moments, this rank's shard
    # train.fp8_recipe: the FP8 GEMMs' weights in E4M3, both orientations, with their scales (train.fp8_param: the
    # scales alone, the E4M3 bytes held in the weights' own memory)
    fp8_copies: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.fp8_copies


def state_bytes(cfg: Config, mesh: Mesh) -> StateBytes:
    """This rank's model state in bytes (``mesh`` may be ``Mesh.planned``: nothing is allocated)."""
    t = cfg.train
    dtype = DTYPES[t.precision]
    model = MixtralModel(cfg.model, mesh, "meta", dtype, **PipelineStages.from_config(cfg).model_kwargs(mesh.pp.rank))
    # per element: a separate fp32 master unless the weights are fp32, and the two moments
    optimizer_per_element = (0 if dtype == torch.float32 else FP32_BYTES) + 2 * FP32_BYTES
    weights = gradients = optimizer = 0
    for param in model.parameters():
        weights += param.numel() * param.element_size()
        gradients += param.numel() * FP32_BYTES
        optimizer += param.numel() * optimizer_per_element // (_shards(mesh, param) if t.use_distributed_optimizer
                                                               else 1)
    fp8_modules = model.fp8_modules(t.num_layers_at_start_in_bf16, t.num_layers_at_end_in_bf16) if t.fp8_recipe else []
    fp8_copies = sum(weight_copy_bytes(module, t.fp8_recipe, fp8_gemm_min_dim(t), fp8_param(t) and (
        not t.use_distributed_optimizer or _shards(mesh, next(module.parameters())) == 1)) for module in fp8_modules)
    return StateBytes(weights, gradients, optimizer, fp8_copies)


def _shards(mesh: Mesh, param: torch.Tensor) -> int:
    """Over how many ranks the distributed optimizer shards a parameter."""
    return (mesh.edp if is_expert_param(param) else mesh.dp_cp).size


def largest_state(cfg: Config, layout: MeshLayout) -> tuple[int, StateBytes]:
    """(rank, its state) of the rank that holds the most; ranks that differ only by their data-parallel and
    context-parallel coordinates hold the same parts and are counted once."""
    seen: dict[tuple, tuple[int, StateBytes]] = {}
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        key = tuple(coords[axis] for axis in ("tp", "pp", "etp", "ep"))
        if key not in seen:
            seen[key] = (rank, state_bytes(cfg, Mesh.planned(layout, rank)))
    return max(seen.values(), key=lambda item: item[1].total)


def describe_state_memory(cfg: Config, layout: MeshLayout) -> list[str]:
    """``moe-overlap info``'s line: the largest rank's model state, part by part."""
    rank, state = largest_state(cfg, layout)
    gib = 2**30
    sharding = ("sharded over data-parallel ranks by the distributed optimizer" if cfg.train.use_distributed_optimizer
                else "not sharded: train.use_distributed_optimizer=false")
    held = (", held in the bf16 weights' memory: their scales alone counted here (train.fp8_param" + (
        "; with the distributed optimizer, the weights whose shard is whole" if cfg.train.use_distributed_optimizer
        else "") + ")" if fp8_param(cfg.train) else "")
    fp8 = (f" + FP8 copies {state.fp8_copies / gib:.1f} (train.fp8_recipe={cfg.train.fp8_recipe}: the FP8 GEMMs' "
           f"weights in E4M3, both orientations, made once per step{held})" if cfg.train.fp8_recipe else "")
    return [f"model state per rank, before activations (the most on any rank: rank {rank}): "
            f"{state.total / gib:.1f} GiB = weights {state.weights / gib:.1f} ({cfg.train.precision}) + gradients "
            f"{state.gradients / gib:.1f} (fp32) + optimizer {state.optimizer / gib:.1f} (fp32 master and AdamW "
            f"moments, {sharding}){fp8}"]


def check_state_fits(rank: int, state: StateBytes, gpu_bytes: int) -> None:
    """Refuse a model state (``rank``'s) that alone exceeds a GPU's memory: it could only run out of memory once the
    ranks have built their parts. Activations need room on top, which this does not check."""
    if state.total > gpu_bytes:
        gib = 2**30
        total = state.total / gib
        shown = round(total, 1) if total >= 0.1 else float(f"{total:.2g}")  # a tiny model keeps 2 digits
        fp8 = f", FP8 copies {state.fp8_copies / gib:.1f}" if state.fp8_copies else ""
        raise ConfigError(f"model state (GiB, rank {rank})", shown, (
            f"weights {state.weights / gib:.1f}, gradients {state.gradients / gib:.1f}{fp8} and optimizer "
            f"{state.optimizer / gib:.1f} GiB (moe-overlap info) need more than a GPU here holds "
            f"({gpu_bytes / gib:.1f} GiB): shard them further (train.use_distributed_optimizer, more ranks for expert "
            f"data parallelism, parallel.pipeline_model_parallel_size) or train a smaller model"))
