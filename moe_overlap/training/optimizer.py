"""AdamW on fp32 master weights with fp32 main-grad accumulation and plain all-reduce data parallelism.

Megatron's precision recipe: the model computes in its own dtype (bf16 on GPU), every backward adds its
gradient into the parameter's fp32 ``main_grad``, and the optimizer updates fp32 masters, then copies them
back. ``grad_sync_dtype`` is only the payload of the gradient all-reduce. The loss each rank backpropagates
is already divided by (micro-batches x data-parallel size), so the reduction is a plain sum: dense grads
over the data- and context-parallel group (each CP rank's loss is its share of the micro-batch's), expert
grads over the expert-data-parallel group. Under tensor parallelism, see training/tp_grads.py; a TP-split
parameter's checkpoint keys are its block of the logical tensor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from moe_overlap.config import TrainConfig
from moe_overlap.distributed.collectives import all_reduce_
from moe_overlap.distributed.mesh import GroupHandle, Mesh
from moe_overlap.distributed.streams import exposed_wait
from moe_overlap.kernels.adamw import AdamWHyper, adamw_update
from moe_overlap.layers.fp8 import step_maxima, weights_updated
from moe_overlap.layers.init import expert_key
from moe_overlap.layers.param_info import is_expert_param, is_tp_split, param_info, tp_shard
from moe_overlap.layers.wgrad import take_grad
from moe_overlap.precision import DTYPES
from moe_overlap.training.checkpoint import tp_logical_tensor
from moe_overlap.training.tp_grads import counts_in_dense_norm, sum_sequence_parallel_grads, sum_shared_embedding_grads

log = logging.getLogger(__name__)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``lr_warmup_steps``, then decay to ``min_lr`` at ``lr_decay_steps``."""
    if cfg.lr_warmup_steps > 0 and step < cfg.lr_warmup_steps:
        return cfg.lr * (step + 1) / cfg.lr_warmup_steps
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    decay_steps = (cfg.lr_decay_steps or cfg.max_steps) - cfg.lr_warmup_steps
    progress = min(1.0, (step - cfg.lr_warmup_steps) / max(1, decay_steps))
    if cfg.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


def decays(param: torch.Tensor) -> bool:
    """Megatron's rule: weight decay on matrices, none on 1-D parameters (norm weights)."""
    return param.dim() > 1


def logical_parts(name: str, param: torch.Tensor) -> list[tuple[str, int, torch.Size]]:
    """(logical key, element offset in the parameter, logical shape) of each checkpointed tensor: the
    parameter itself, or one per expert for expert weights (global experts [first_expert, +shape[0])). A
    tensor-parallel parameter's shape is its block's, in the logical tensor's axes (TPShard.local_shape)."""
    if not is_expert_param(param):
        shard = tp_shard(param)
        return [(name, 0, param.shape if shard is None else shard.local_shape(param.shape))]
    per_expert, shard = param[0].numel(), tp_shard(param)
    shape = param.shape[1:] if shard is None else shard.local_shape(param.shape[1:])
    return [(expert_key(name, param_info(param).first_expert + local), local * per_expert, shape)
            for local in range(param.shape[0])]


def clip_control(norm: torch.Tensor, steps_made: torch.Tensor, cfg: TrainConfig,
                 skip: torch.Tensor | None = None) -> torch.Tensor:
    """The AdamW kernels' control tensor (grad scale, step, apply) from the global gradient norm, on the device:
    the factor that clips to ``cfg.clip_grad``, and no update at all for a NaN/inf norm, or where ``skip`` (a
    device bool, the same on every rank: the step will run again) is set. ``steps_made`` (updates so far) counts
    this one in place when it applies. The host learns of a skip later (check_nonfinite)."""
    apply = torch.isfinite(norm)
    if skip is not None:
        apply = apply & ~skip
    scale = torch.ones_like(norm)
    if cfg.clip_grad > 0:
        scale = torch.where(apply & (norm > cfg.clip_grad), cfg.clip_grad / (norm + 1e-6), scale)
    steps_made.add_(apply.to(steps_made.dtype))
    return torch.stack([scale.to(torch.float32), steps_made.to(torch.float32), apply.to(torch.float32)])


def check_nonfinite(norm: float, step_index: int, cfg: TrainConfig, nonfinite_names: list[str]) -> None:
    """After a step whose gradient norm was NaN/inf (the update was skipped on the device): a warning naming
    the step and where the non-finite values were under on_nonfinite_grad 'skip'; 'stop' raises.
    ``step_index`` counts from 0; messages count from 1, as the metrics do. ``nonfinite_names``: this rank's
    gradients that held them, in model order (the deepest is where a backward pass went bad first)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    where = (f"{len(nonfinite_names)} of rank {rank}'s gradient tensors; the deepest: {nonfinite_names[-1]}"
             if nonfinite_names else f"none of rank {rank}'s gradients: another rank's are")
    if cfg.on_nonfinite_grad == "stop":
        raise FloatingPointError(f"step {step_index + 1}: gradient norm is {norm} ({where}); stopping "
                                 "(train.on_nonfinite_grad=stop)")
    log.warning("step %d: gradient norm is %s (%s); skipping the optimizer step", step_index + 1, norm, where)


def adam_group(param: torch.Tensor) -> tuple[bool, float]:
    """What AdamW's hyper-parameters depend on for a parameter: whether it decays, and its learning-rate scale."""
    return decays(param), param_info(param).lr_scale


def adamw_hyper(cfg: TrainConfig, lr: float, decay: bool, lr_scale: float = 1.0) -> AdamWHyper:
    return AdamWHyper(lr * lr_scale, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.weight_decay if decay else 0.0)


class GradNorms:
    """Per-tensor L2 norms of a fixed list of gradients (one multi-tensor kernel, no host sync): the global norm
    sums the counted ones' squares, and a non-finite one names the tensors that hold NaN/inf."""

    def __init__(self, names: list[str], counted: list[bool], device: torch.device):
        self.names, self.device = names, device
        self.counted = torch.tensor(counted, dtype=torch.bool, device=device)
        self.norms = torch.zeros(len(names), dtype=torch.float32, device=device)

    def measure(self, grads: list[torch.Tensor]) -> None:
        if grads:
            torch.stack(torch._foreach_norm(grads), out=self.norms)

    def squares(self, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of the counted (and ``mask``ed) tensors' squared norms, fp64 (any split sums alike)."""
        keep = self.counted if mask is None else self.counted & mask
        return torch.where(keep, self.norms.double().square(), 0.0).sum()

    def nonfinite_flags(self) -> torch.Tensor:
        return (~torch.isfinite(self.norms)).double()


def logical_grad_copies(name: str, param: torch.Tensor, grad: torch.Tensor, tp: GroupHandle) -> dict[str, torch.Tensor]:
    """Copies of one parameter's gradient (contiguous, shaped like it) by logical name; a TP-split one
    gathered into its logical tensor (a collective over ``tp``: TP, or expert-TP for expert weights)."""
    if is_tp_split(param):
        blocks = [torch.empty_like(grad) for _ in range(tp.size)]
        torch.distributed.all_gather(blocks, grad, group=tp.group)
        shard = tp_shard(param)
        if not is_expert_param(param):
            return {name: shard.assemble(blocks)}
        first = param_info(param).first_expert
        return {expert_key(name, first + local): shard.assemble([block[local] for block in blocks])
                for local in range(param.shape[0])}
    flat = grad.view(-1)
    return {key: flat[offset:offset + shape.numel()].view(shape).clone()
            for key, offset, shape in logical_parts(name, param)}


@dataclass
class ParamEntry:
    name: str  # logical name in the model
    param: nn.Parameter
    master: torch.Tensor  # fp32; the parameter itself when it is already fp32
    main_grad: torch.Tensor  # fp32 accumulation buffer
    is_expert: bool
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    @property
    def model_copy(self) -> torch.Tensor | None:
        """Where the update writes the model's weights too: the parameter, unless it is its own master or its storage
        holds its FP8 copies instead (train.fp8_param: they are quantized from the master)."""
        return None if self.master is self.param or param_info(self.param).holds_fp8 else self.param.data

    @property
    def model_values(self) -> torch.Tensor:
        """The model's weights as a checkpoint holds them: the parameter, or the master rounded to its dtype where
        the parameter's storage holds FP8 copies (a new tensor: loading into it restores nothing, the master
        loads beside it)."""
        return self.master.to(self.param.dtype) if param_info(self.param).holds_fp8 else self.param.data

    def logical_slices(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``tensor`` (contiguous, shaped like the parameter) keyed by logical name; experts one
        key each; a tensor-parallel block as its logical tensor (a ShardedTensor)."""
        flat = tensor.view(-1)
        return {key: tp_logical_tensor(flat[offset:offset + shape.numel()].view(shape), tp_shard(self.param))
                for key, offset, shape in logical_parts(self.name, self.param)}


class MixedPrecisionAdamW:
    def __init__(self, model: nn.Module, mesh: Mesh, cfg: TrainConfig, grad_sync_dtype: str = "fp32"):
        self.mesh, self.cfg = mesh, cfg
        self.payload_dtype = DTYPES[grad_sync_dtype]
        self.entries: list[ParamEntry] = []
        for name, param in model.named_parameters():
            master = param if param.dtype == torch.float32 else param.detach().float().clone()
            main_grad = torch.zeros_like(param, dtype=torch.float32)
            param_info(param).main_grad = main_grad
            param.register_post_accumulate_grad_hook(take_grad)
            self.entries.append(ParamEntry(name, param, master, main_grad, is_expert_param(param),
                                           torch.zeros_like(master), torch.zeros_like(master)))
        self.device = self.entries[0].main_grad.device
        self.steps_made = torch.zeros((), dtype=torch.float32, device=self.device)  # checkpointed as optimizer.step
        self.norms = GradNorms([e.name for e in self.entries],  # experts, and dense ones split or on TP rank 0
                               [e.is_expert or counts_in_dense_norm(e.param, mesh.tp) for e in self.entries],
                               self.device)
        self._is_expert = torch.tensor([e.is_expert for e in self.entries], device=self.device)

    def hold_fp8_weights(self) -> None:
        """train.fp8_param: the weights whose GEMMs run in FP8 keep only their FP8 copies, in their own storage,
        quantized from the masters (layers/fp8.py); the others' values are written as before."""
        for entry in self.entries:
            if entry.master is not entry.param:
                param_info(entry.param).fp8_master = entry.master

    def start_micro_batch(self, is_last: bool) -> None:
        """Nothing to arm: this optimizer all-reduces after the whole backward (reduce_grads)."""

    def arm_grad_sync(self, armed: bool) -> None:
        """Nothing to arm (see start_micro_batch)."""

    @property
    def norm_names(self) -> list[str]:
        """The gradients :meth:`nonfinite_flags` speaks of, in order."""
        return self.norms.names

    def nonfinite_flags(self) -> torch.Tensor:
        """1.0 for each gradient of the last step's norm that held NaN/inf (fp64, on the device)."""
        return self.norms.nonfinite_flags()

    def zero_grad(self) -> None:
        torch._foreach_zero_([entry.main_grad for entry in self.entries])
        for entry in self.entries:
            entry.param.grad = None

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sum main grads over data-parallel replicas: dense over DP x CP, experts over expert-DP (and the
        sequence-parallel ones over TP first)."""
        sum_sequence_parallel_grads(((e.param, e.main_grad) for e in self.entries), self.mesh.tp)
        sum_shared_embedding_grads(((e.param, e.main_grad) for e in self.entries), self.mesh.embedding)
        for entry in self.entries:
            group = self.mesh.edp.group if entry.is_expert else self.mesh.dp_cp.group
            if group is None:
                continue
            with exposed_wait("dp"):
                if self.payload_dtype == torch.float32:
                    all_reduce_(entry.main_grad, group)
                else:
                    entry.main_grad.copy_(all_reduce_(entry.main_grad.to(self.payload_dtype), group))

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm over every distinct gradient (fp64, on the device): experts differ across EP ranks,
        dense ones across TP ranks when TP-split (replicated ones count once)."""
        self.norms.measure([e.main_grad for e in self.entries])
        expert_sq, dense_sq = self.norms.squares(self._is_expert), self.norms.squares(~self._is_expert)
        all_reduce_(expert_sq, self.mesh.expert_mp.group)  # experts differ over EP and expert-TP (and PP)
        all_reduce_(dense_sq, self.mesh.mp.group)
        return (dense_sq + expert_sq).sqrt()

    @torch.no_grad()
    def step(self, lr: float, step_index: int, skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and update the masters, writing the model's copies in the same pass; returns the gradient norm
        and whether the update applied (device tensors: the host reads them once per step). ``skip``: see
        clip_control."""
        norm = self.grad_norm()
        control = clip_control(norm, self.steps_made, self.cfg, skip)
        with_maxima = []
        for entry in self.entries:
            maxima = step_maxima(entry.param)  # train.fp8_param: the first pass of the FP8 copies' refresh
            adamw_update(entry.master, entry.main_grad, entry.exp_avg, entry.exp_avg_sq, entry.model_copy, control,
                         adamw_hyper(self.cfg, lr, *adam_group(entry.param)), maxima)
            if maxima is not None:
                with_maxima.append(entry.param)
        weights_updated(with_maxima)  # the FP8 copies of the weights (train.fp8_recipe) are stale
        self.zero_grad()
        return norm, control[2]

    def logical_grads(self) -> dict[str, torch.Tensor]:
        """Copies of the reduced gradients by logical name, tensor-parallel blocks gathered into their logical
        tensors (after reduce_grads; a collective over TP, for tests)."""
        grads = {}
        for e in self.entries:
            grads.update(logical_grad_copies(e.name, e.param, e.main_grad,
                                             self.mesh.etp if e.is_expert else self.mesh.tp))
        return grads

    def logical_state(self) -> dict[str, torch.Tensor]:
        """Model and optimizer tensors keyed by logical name (views: loading into them restores in place)."""
        state: dict[str, torch.Tensor] = {}
        for entry in self.entries:
            for key, view in entry.logical_slices(entry.model_values).items():
                state[f"model.{key}"] = view
            for suffix, tensor in (("exp_avg", entry.exp_avg), ("exp_avg_sq", entry.exp_avg_sq)):
                for key, view in entry.logical_slices(tensor).items():
                    state[f"optimizer.{key}.{suffix}"] = view
            if entry.master is not entry.param:
                for key, view in entry.logical_slices(entry.master.data).items():
                    state[f"optimizer.{key}.master"] = view
        state["optimizer.step"] = self.steps_made
        return state

    @torch.no_grad()
    def after_load(self) -> None:
        """Refresh the model copies from the loaded masters."""
        for entry in self.entries:
            if entry.model_copy is not None:
                entry.model_copy.copy_(entry.master)
        weights_updated()
