"""AdamW on fp32 master weights with fp32 main-grad accumulation and plain all-reduce data parallelism.

Megatron's precision recipe: the model computes in its own dtype (bf16 on GPU), every backward adds its
gradient into the parameter's fp32 ``main_grad``, and the optimizer updates fp32 masters, then copies them
back. ``grad_sync_dtype`` is only the payload of the gradient all-reduce. The loss each rank backpropagates
is already divided by (micro-batches x data-parallel size), so the reduction is a plain sum: dense grads
over the data-parallel group, expert grads over the expert-data-parallel group. Under tensor parallelism,
see training/tp_grads.py; a TP-split parameter's checkpoint keys are its block of the logical tensor.
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
from moe_overlap.layers.init import expert_key, is_expert_param, is_tp_split, tp_shard
from moe_overlap.training.checkpoint import tp_logical_tensor
from moe_overlap.training.tp_grads import counts_in_dense_norm, sum_sequence_parallel_grads, sum_shared_embedding_grads

log = logging.getLogger(__name__)

_PAYLOAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    return [(expert_key(name, param.first_expert + local), local * per_expert, shape)
            for local in range(param.shape[0])]


def clip_scale(norm: float, step_index: int, cfg: TrainConfig) -> float | None:
    """The factor that clips the gradients to ``cfg.clip_grad``, or None when the step must be skipped: a
    NaN/inf norm under on_nonfinite_grad 'skip' (with a warning naming the step); 'stop' raises.
    ``step_index`` counts from 0; messages count from 1, as the metrics do."""
    if not math.isfinite(norm):
        if cfg.on_nonfinite_grad == "stop":
            raise FloatingPointError(f"step {step_index + 1}: gradient norm is {norm}; stopping "
                                     "(train.on_nonfinite_grad=stop)")
        log.warning("step %d: gradient norm is %s; skipping the optimizer step", step_index + 1, norm)
        return None
    return cfg.clip_grad / (norm + 1e-6) if 0 < cfg.clip_grad < norm else 1.0


def logical_grad_copies(name: str, param: torch.Tensor, grad: torch.Tensor, tp: GroupHandle) -> dict[str, torch.Tensor]:
    """Copies of one parameter's gradient (contiguous, shaped like it) by logical name; a TP-split one
    gathered into its logical tensor (a collective over ``tp``: TP, or expert-TP for expert weights)."""
    if is_tp_split(param):
        blocks = [torch.empty_like(grad) for _ in range(tp.size)]
        torch.distributed.all_gather(blocks, grad, group=tp.group)
        shard = tp_shard(param)
        if not is_expert_param(param):
            return {name: shard.assemble(blocks)}
        return {expert_key(name, param.first_expert + local): shard.assemble([block[local] for block in blocks])
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

    def logical_slices(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``tensor`` (contiguous, shaped like the parameter) keyed by logical name; experts one
        key each; a tensor-parallel block as its logical tensor (a ShardedTensor)."""
        flat = tensor.view(-1)
        return {key: tp_logical_tensor(flat[offset:offset + shape.numel()].view(shape), tp_shard(self.param))
                for key, offset, shape in logical_parts(self.name, self.param)}


class MixedPrecisionAdamW:
    def __init__(self, model: nn.Module, mesh: Mesh, cfg: TrainConfig, grad_sync_dtype: str = "fp32"):
        self.mesh, self.cfg = mesh, cfg
        self.payload_dtype = _PAYLOAD_DTYPES[grad_sync_dtype]
        self.entries: list[ParamEntry] = []
        for name, param in model.named_parameters():
            master = param if param.dtype == torch.float32 else param.detach().float().clone()
            main_grad = torch.zeros_like(param, dtype=torch.float32)
            param.main_grad = main_grad
            param.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
            self.entries.append(ParamEntry(name, param, master, main_grad, is_expert_param(param)))
        decay = [e.master for e in self.entries if decays(e.param)]
        no_decay = [e.master for e in self.entries if not decays(e.param)]
        self.adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, foreach=False)
        for entry in self.entries:  # states exist up front, so a checkpoint can load into them
            self.adamw.state[entry.master] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(entry.master),
                "exp_avg_sq": torch.zeros_like(entry.master),
            }

    def start_micro_batch(self, is_last: bool) -> None:
        """Nothing to arm: this optimizer all-reduces after the whole backward (reduce_grads)."""

    def arm_grad_sync(self, armed: bool) -> None:
        """Nothing to arm (see start_micro_batch)."""

    def zero_grad(self) -> None:
        for entry in self.entries:
            entry.main_grad.zero_()
            entry.param.grad = None

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Sum main grads over data-parallel replicas: dense over DP, experts over expert-DP (and the
        sequence-parallel ones over TP first)."""
        sum_sequence_parallel_grads(((e.param, e.main_grad) for e in self.entries), self.mesh.tp)
        sum_shared_embedding_grads(((e.param, e.main_grad) for e in self.entries), self.mesh.embedding)
        for entry in self.entries:
            group = self.mesh.edp.group if entry.is_expert else self.mesh.dp.group
            if group is None:
                continue
            if self.payload_dtype == torch.float32:
                all_reduce_(entry.main_grad, group)
            else:
                entry.main_grad.copy_(all_reduce_(entry.main_grad.to(self.payload_dtype), group))

    @torch.no_grad()
    def grad_norm(self) -> float:
        """Global L2 norm over every distinct gradient: experts differ across EP ranks, dense ones across TP
        ranks when TP-split (replicated ones count once)."""
        device = self.entries[0].main_grad.device
        dense_sq = torch.zeros((), dtype=torch.float64, device=device)  # fp64: any split sums alike
        expert_sq = torch.zeros((), dtype=torch.float64, device=device)
        for entry in self.entries:
            square = entry.main_grad.square().sum(dtype=torch.float64)
            if entry.is_expert:
                expert_sq += square
            elif counts_in_dense_norm(entry.param, self.mesh.tp):
                dense_sq += square
        all_reduce_(expert_sq, self.mesh.expert_mp.group)  # experts differ over EP and expert-TP (and PP)
        all_reduce_(dense_sq, self.mesh.mp.group)
        return math.sqrt(float(dense_sq + expert_sq))

    @torch.no_grad()
    def step(self, lr: float, step_index: int) -> tuple[float, bool]:
        """Clip, update the masters and copy them into the model; returns (grad norm, whether stepped)."""
        norm = self.grad_norm()
        scale = clip_scale(norm, step_index, self.cfg)
        if scale is None:
            self.zero_grad()
            return norm, False
        for group in self.adamw.param_groups:
            group["lr"] = lr
        for entry in self.entries:
            if scale != 1.0:
                entry.main_grad.mul_(scale)
            entry.master.grad = entry.main_grad
        self.adamw.step()
        for entry in self.entries:
            entry.master.grad = None
            if entry.master is not entry.param:
                entry.param.copy_(entry.master)
        self.zero_grad()
        return norm, True

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
            moments = self.adamw.state[entry.master]
            for key, view in entry.logical_slices(entry.param.data).items():
                state[f"model.{key}"] = view
            for suffix, tensor in (("exp_avg", moments["exp_avg"]), ("exp_avg_sq", moments["exp_avg_sq"])):
                for key, view in entry.logical_slices(tensor).items():
                    state[f"optimizer.{key}.{suffix}"] = view
            if entry.master is not entry.param:
                for key, view in entry.logical_slices(entry.master.data).items():
                    state[f"optimizer.{key}.master"] = view
        state["optimizer.step"] = self.adamw.state[self.entries[0].master]["step"]
        return state

    def after_load(self) -> None:
        """Share the loaded step count with every parameter and refresh the model copies from the masters."""
        step = self.adamw.state[self.entries[0].master]["step"]
        for entry in self.entries:
            self.adamw.state[entry.master]["step"] = step.clone()
            if entry.master is not entry.param:
                entry.param.data.copy_(entry.master)


def _accumulate_into_main_grad(param: nn.Parameter) -> None:
    if param.grad is None:  # its layer deferred it to a zero-bubble schedule's W (layers/wgrad.py)
        return
    param.main_grad.add_(param.grad)
    param.grad = None
