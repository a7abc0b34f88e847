"""Distributed optimizer: fp32 master weights and AdamW moments sharded over data-parallel ranks, with
bucketed gradient reduce-scatter and parameter all-gather that can run under backward and forward.

Megatron's design (NeMo's "Distributed Optimizer" and "Data-parallel Communication Overlap"). Parameters
are grouped into buckets, one Transformer layer per bucket by default (or ``overlap.bucket_size_mb``),
dense and expert parameters apart because they reduce over different groups: dense over the
data-parallel x context-parallel ranks, experts over the expert-data-parallel ranks. A bucket owns two
flat buffers its parameters view into: fp32 gradients (accumulated over micro-batches, so
``grad_sync_dtype`` is only the payload of the reduce-scatter) and the parameters in the compute dtype.
Both split into equal contiguous shards, one per rank of the bucket's group; a rank keeps master
weights and moments for its shard only.

A step: reduce-scatter each bucket's gradients, clip by the global norm, update the local shard, and
all-gather the updated shards back into the parameter buffer. With ``overlap_grad_sync`` a bucket's
reduce-scatter starts from the backward hook of its last gradient on the last micro-batch, so only the
last bucket's is exposed; with ``overlap_param_sync`` a bucket's all-gather is waited for only in the
forward pre-hook of the first module that uses it, so the next forward runs under the later ones. Off,
both run after backward and after the update, in one go. On CUDA, NCCL runs each collective on its
communicator's own stream, ordered after the work queued before the call, and ``wait()`` orders the
caller's stream after it: a bucket's collective runs beside the backward or forward kernels queued
after it.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_overlap.config import OverlapConfig, TrainConfig
from moe_overlap.distributed import collectives
from moe_overlap.distributed.collectives import all_gather_into, all_reduce_
from moe_overlap.distributed.mesh import GroupHandle, Mesh
from moe_overlap.distributed.streams import exposed_wait
from moe_overlap.kernels.adamw import adamw_update
from moe_overlap.layers.fp8 import step_maxima, weights_updated
from moe_overlap.layers.param_info import is_expert_param, param_info, tp_shard
from moe_overlap.layers.wgrad import take_grad
from moe_overlap.precision import DTYPES
from moe_overlap.training.checkpoint import flat_range_tensor, tp_logical_tensor
from moe_overlap.training.optimizer import (GradNorms, adam_group, adamw_hyper, clip_control, decays,
                                            logical_grad_copies, logical_parts)
from moe_overlap.training.tp_grads import (counts_in_dense_norm, is_shared_embedding, sum_sequence_parallel_grads,
                                           sum_shared_embedding_grads)

log = logging.getLogger(__name__)

# Shards start on 64-byte boundaries (16 fp32 elements), which keeps collectives on aligned, vectorised paths.
SHARD_ALIGN = 16


@dataclass
class _Slot:
    name: str  # logical name in the model
    param: nn.Parameter
    start: int  # element offset in the bucket's flat buffers

    @property
    def end(self) -> int:
        return self.start + self.param.numel()


class _Bucket:
    """Parameters that reduce over one group together, and this rank's shard of their optimizer state."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], group: GroupHandle, first_unit: int,
                 payload_dtype: torch.dtype, counts_in_norm: Callable[[nn.Parameter], bool]):
        self.group, self.first_unit, self.payload_dtype = group, first_unit, payload_dtype
        # Decayed (>= 2-D) parameters first, then by learning-rate scale: a shard then meets few runs of parameters
        # that AdamW updates alike (one decayed and one undecayed where every scale is 1).
        params = sorted(params, key=lambda item: (not decays(item[1]), param_info(item[1]).lr_scale))
        self.slots: list[_Slot] = []
        for name, param in params:
            self.slots.append(_Slot(name, param, self.slots[-1].end if self.slots else 0))
        dtypes = {param.dtype for _, param in params}
        if len(dtypes) != 1:
            raise ValueError(f"bucket of {[s.name for s in self.slots]} mixes parameter dtypes {dtypes}")
        dtype, device = params[0][1].dtype, params[0][1].device
        quantum = group.size * SHARD_ALIGN
        self.numel = -(-self.slots[-1].end // quantum) * quantum  # padded: equal, aligned shards
        self.shard_numel = self.numel // group.size
        self.shard = slice(group.rank * self.shard_numel, (group.rank + 1) * self.shard_numel)
        self.param_data = torch.zeros(self.numel, dtype=dtype, device=device)
        self.grad_data = torch.zeros(self.numel, dtype=torch.float32, device=device)
        for slot in self.slots:  # the parameters become views of the buffers (their old storage is freed)
            view = self.param_data[slot.start:slot.end].view_as(slot.param)
            view.copy_(slot.param.detach())
            slot.param.data = view
            param_info(slot.param).main_grad = self.grad_data[slot.start:slot.end].view_as(slot.param)
        self.param_shard, self.grad_shard = self.param_data[self.shard], self.grad_data[self.shard]
        # fp32 parameters are their own master weights, as in MixedPrecisionAdamW.
        self.master = self.param_shard if dtype == torch.float32 else self.param_shard.float()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        # The runs of slots with one adam_group, the padding in the last (zeros: no update moves it), each clipped
        # to this rank's shard: (where in the shard, decays, learning-rate scale).
        runs: list[list] = []
        for slot in self.slots:
            group = adam_group(slot.param)
            if runs and runs[-1][2] == group:
                runs[-1][1] = slot.end
            else:
                runs.append([slot.start, slot.end, group])
        runs[-1][1] = self.numel
        lo, hi = self.shard.start, self.shard.stop
        self.adam_ranges = [(slice(max(a, lo) - lo, min(b, hi) - lo), *group)
                            for a, b, group in runs if max(a, lo) < min(b, hi)]
        # Each parameter's part of the shard, and whether its squares count in the global norm (a TP-replicated
        # parameter counts on one TP rank).
        self.shard_parts: list[tuple[str, slice, bool]] = []
        for slot in self.slots:
            a, b = max(slot.start, lo) - lo, min(slot.end, hi) - lo
            if a < b:
                self.shard_parts.append((slot.name, slice(a, b), counts_in_norm(slot.param)))
        # A tied embedding under PP sums over its stages' copies first, after the whole pipeline's backward.
        self.after_backward = any(is_shared_embedding(slot.param) for slot in self.slots)
        self.ready: set[int] = set()  # slots whose gradient of the last micro-batch has arrived
        self.grad_work = self.param_work = None
        self.payload: Optional[torch.Tensor] = None

    @property
    def has_separate_master(self) -> bool:
        return self.master is not self.param_shard

    def start_grad_sync(self, comm) -> None:
        self.payload = self.grad_data if self.payload_dtype == torch.float32 else self.grad_data.to(self.payload_dtype)
        self.grad_work = comm.start_reduce_scatter(self.payload[self.shard], self.payload, self.group.group)

    def finish_grad_sync(self) -> None:
        with exposed_wait("dp"):
            self.grad_work.wait()
        if self.payload is not self.grad_data:
            self.grad_shard.copy_(self.payload[self.shard])
        self.grad_work = self.payload = None
        self.ready.clear()

    def update(self, lr: float, cfg: TrainConfig, control: torch.Tensor) -> list[nn.Parameter]:
        """AdamW on this rank's shard (``control``: see kernels/adamw.py), writing the model's copy of the shard in
        the same pass, but for the weights that hold their FP8 copies (train.fp8_param): each of those is updated
        alone, its master viewed as the weight, leaving its copies' maxima where :func:`step_maxima` says. Returns
        the weights whose maxima it left."""
        with_maxima = []
        for where, decay, lr_scale, held in self._update_parts():
            hyper = adamw_hyper(cfg, lr, decay, lr_scale)
            if held is None:
                adamw_update(self.master[where], self.grad_shard[where], self.exp_avg[where], self.exp_avg_sq[where],
                             self.param_shard[where] if self.has_separate_master else None, control, hyper)
                continue
            maxima = step_maxima(held)
            adamw_update(*(t[where].view(held.shape) for t in (self.master, self.grad_shard, self.exp_avg,
                                                                self.exp_avg_sq)), None, control, hyper, maxima)
            if maxima is not None:
                with_maxima.append(held)
        return with_maxima

    def _update_parts(self) -> list[tuple[slice, bool, float, nn.Parameter | None]]:
        """``adam_ranges`` with each weight that holds its FP8 copies cut out as a part of its own (the weight; None
        for the others). Only a one-rank bucket's weights hold them (its shard is the whole bucket, so shard and
        bucket offsets agree), and a weight lies in one range."""
        held = [slot for slot in self.slots if param_info(slot.param).holds_fp8]
        parts = []
        for where, decay, lr_scale in self.adam_ranges:
            at = where.start
            for slot in held:
                if where.start <= slot.start and slot.end <= where.stop:
                    if at < slot.start:
                        parts.append((slice(at, slot.start), decay, lr_scale, None))
                    parts.append((slice(slot.start, slot.end), decay, lr_scale, slot.param))
                    at = slot.end
            if at < where.stop:
                parts.append((slice(at, where.stop), decay, lr_scale, None))
        return parts

    def write_model_copy(self) -> None:
        """The model's copy of the shard from the master (after a load), but where a weight holds its FP8 copies."""
        for where, _, _, held in self._update_parts():
            if held is None:
                self.param_shard[where].copy_(self.master[where])

    def start_param_sync(self, comm) -> None:
        """All-gather the shards of the model copy (the update already wrote this rank's)."""
        self.param_work = comm.start_all_gather(self.param_data, self.param_shard, self.group.group)

    def finish_param_sync(self) -> None:
        if self.param_work is not None:
            with exposed_wait("dp"):
                self.param_work.wait()
            self.param_work = None

    def holders(self, start: int, end: int) -> dict[int, tuple[int, int]]:
        """Rank in the group -> the part of bucket elements [start, end) its shard holds, relative to start."""
        parts = {}
        for index in range(self.group.size):
            lo, hi = max(start, index * self.shard_numel), min(end, (index + 1) * self.shard_numel)
            if lo < hi:
                parts[index] = (lo - start, hi - start)
        return parts


class DistributedOptimizer:
    """The optimizer the trainer drives when ``train.use_distributed_optimizer`` is set; the same calls
    as :class:`MixedPrecisionAdamW`, its serial reference."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: TrainConfig, overlap: OverlapConfig):
        self.mesh, self.cfg = mesh, cfg
        # Plain attributes, so a benchmark can switch them between steps.
        self.overlap_grad_sync, self.overlap_param_sync = overlap.overlap_grad_sync, overlap.overlap_param_sync
        self.collectives = collectives  # anything with start_reduce_scatter / start_all_gather
        payload_dtype = DTYPES[overlap.grad_sync_dtype]
        units = model.forward_units()
        bucket_bytes = None if overlap.bucket_size_mb is None else overlap.bucket_size_mb * 2**20
        plans = _plan_buckets(model, units, bucket_bytes, payload_dtype.itemsize)
        self.buckets = [  # in the order forward first uses them
            _Bucket(params, mesh.edp if expert else mesh.dp_cp, first_unit, payload_dtype,
                    lambda param: is_expert_param(param) or counts_in_dense_norm(param, mesh.tp))
            for first_unit, expert, params in plans
        ]
        # Global ranks of each rank's dense data-parallel group: where the other TP ranks' shards live.
        self._dp_cp_group_of = {rank: ranks for ranks in mesh.layout.group_ranks("dp_cp") for rank in ranks}
        # ... and of each rank's expert-data-parallel group: where the other expert-TP ranks' shards live.
        self._edp_group_of = {rank: ranks for ranks in mesh.layout.group_ranks("edp") for rank in ranks}
        device = self.buckets[0].grad_data.device
        self.steps_made = torch.zeros((), dtype=torch.float32, device=device)  # updates made: optimizer.step
        parts = [part for bucket in self.buckets for part in bucket.shard_parts]
        self.norms = GradNorms([name for name, _, _ in parts], [counted for _, _, counted in parts], device)
        self._sync_in_backward = False
        for bucket_index, bucket in enumerate(self.buckets):
            for slot_index, slot in enumerate(bucket.slots):
                slot.param.register_post_accumulate_grad_hook(
                    functools.partial(_grad_hook, weakref.ref(self), bucket_index, slot_index))
        for index, (module, _) in enumerate(units):
            first_used_here = [bucket for bucket in self.buckets if bucket.first_unit == index]
            if first_used_here:
                module.register_forward_pre_hook(functools.partial(_wait_for_params, first_used_here))

    def hold_fp8_weights(self) -> None:
        """train.fp8_param, as MixedPrecisionAdamW's, where a bucket's shard is the whole bucket (a group of one rank:
        every bucket at data-parallel size 1, the experts' where expert parallelism spans the data-parallel ranks):
        its weights whose GEMMs run in FP8 keep only their FP8 copies, quantized from the masters. Where the shards
        split the weights a rank holds part of each master and the all-gather moves the bf16 values, so those keep
        their values beside their copies (gathering the copies instead is not implemented yet)."""
        for bucket in self.buckets:
            if bucket.group.size == 1 and bucket.has_separate_master:
                for slot in bucket.slots:
                    param_info(slot.param).fp8_master = bucket.master[slot.start:slot.end].view_as(slot.param)

    # ------------------------------------------------------------------------------ gradients
    def start_micro_batch(self, is_last: bool) -> None:
        """Arm the backward hooks to start each bucket's reduce-scatter, on the last micro-batch only."""
        self._sync_in_backward = self.overlap_grad_sync and is_last
        for bucket in self.buckets:
            bucket.ready.clear()

    def arm_grad_sync(self, armed: bool) -> None:
        """Under a pipeline schedule, before each backward action: whether the gradients it produces are
        their parameters' last of the step (its chunk's last micro-batch), keeping what is ready so far."""
        self._sync_in_backward = self.overlap_grad_sync and armed

    def _on_grad(self, bucket_index: int, slot_index: int, param: nn.Parameter) -> None:
        if param.grad is None:  # its layer deferred it to a zero-bubble schedule's W (layers/deferred_wgrad.py)
            return
        bucket = self.buckets[bucket_index]
        slot = bucket.slots[slot_index]
        take_grad(param)
        if not self._sync_in_backward:
            return
        if bucket.grad_work is not None:
            raise RuntimeError(f"the gradient of {slot.name} arrived after its bucket's reduce-scatter started: "
                               "a parameter used by two backward passes of one micro-batch cannot overlap "
                               "its gradient sync; set overlap.overlap_grad_sync=false")
        bucket.ready.add(id(slot))
        if len(bucket.ready) == len(bucket.slots) and not bucket.after_backward:
            self._start_grad_sync(bucket)

    def _start_grad_sync(self, bucket: _Bucket) -> None:
        """Sum the sequence-parallel gradients over TP (each TP rank saw its own sequence block), then
        start the bucket's reduce-scatter."""
        sum_sequence_parallel_grads(((slot.param, param_info(slot.param).main_grad) for slot in bucket.slots),
                                    self.mesh.tp)
        sum_shared_embedding_grads(((slot.param, param_info(slot.param).main_grad) for slot in bucket.slots),
                                   self.mesh.embedding)
        bucket.start_grad_sync(self.collectives)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.grad_data.zero_()
            for slot in bucket.slots:
                slot.param.grad = None

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Reduce-scatter every bucket not started from the backward hooks, then wait for all of them."""
        late = [bucket for bucket in self.buckets if bucket.grad_work is None]
        missing = [s.name for b in late for s in b.slots if id(s) not in b.ready]
        if self._sync_in_backward and missing:
            log.warning("overlap_grad_sync: no gradient reached %s in the last micro-batch; their buckets "
                        "reduce after backward instead", ", ".join(missing))
        for bucket in reversed(late):  # backward order, as the hooks would have started them
            self._start_grad_sync(bucket)
        for bucket in self.buckets:
            bucket.finish_grad_sync()
        self._sync_in_backward = False

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm: the reduced shards of all ranks are distinct (dense over DP, experts over
        expert-DP, different experts across EP, different blocks across TP; a TP-replicated parameter counts
        on TP rank 0 only), so the squares sum over all ranks. Accumulated in fp64, so that the clipping
        factor does not depend on how the sum is split."""
        self.norms.measure([bucket.grad_shard[where] for bucket in self.buckets for _, where, _ in bucket.shard_parts])
        squares = self.norms.squares()
        all_reduce_(squares, dist.group.WORLD if self.mesh.world_size > 1 else None)
        return squares.sqrt()

    @property
    def norm_names(self) -> list[str]:
        """The gradients :meth:`nonfinite_flags` speaks of, in order (this rank's shard of each)."""
        return self.norms.names

    def nonfinite_flags(self) -> torch.Tensor:
        """1.0 for each gradient shard of the last step's norm that held NaN/inf (fp64, on the device)."""
        return self.norms.nonfinite_flags()

    def logical_grads(self) -> dict[str, torch.Tensor]:
        """Full reduced gradients by logical name, all-gathered from the shards (after reduce_grads; a
        collective, for tests)."""
        grads = {}
        for bucket in self.buckets:
            full = all_gather_into(torch.empty_like(bucket.grad_data), bucket.grad_shard, bucket.group.group)
            for slot in bucket.slots:
                group = self.mesh.etp if is_expert_param(slot.param) else self.mesh.tp
                grads.update(logical_grad_copies(slot.name, slot.param, full[slot.start:slot.end].view_as(slot.param),
                                                 group))
        return grads

    # --------------------------------------------------------------------------------- update
    @torch.no_grad()
    def step(self, lr: float, step_index: int, skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, update the local shards and start the parameter all-gathers; returns the gradient norm and
        whether the update applied (device tensors). A skipped update (see clip_control for ``skip``) all-gathers
        the unchanged shards."""
        norm = self.grad_norm()
        control = clip_control(norm, self.steps_made, self.cfg, skip)
        with_maxima = []
        for bucket in self.buckets:  # forward order: the all-gather the next forward needs first starts first
            with_maxima += bucket.update(lr, self.cfg, control)
            bucket.start_param_sync(self.collectives)
        weights_updated(with_maxima)  # the FP8 copies of the weights (train.fp8_recipe) are stale
        if not self.overlap_param_sync:
            self.finish_param_sync()
        self.zero_grad()
        return norm, control[2]

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather (before reading parameters outside forward)."""
        for bucket in self.buckets:
            bucket.finish_param_sync()

    # ----------------------------------------------------------------------------- checkpoints
    def logical_state(self) -> dict[str, torch.Tensor]:
        """Model and optimizer tensors keyed by logical name, as MixedPrecisionAdamW's, so checkpoints of
        either load in the other. Model tensors are whole (every rank holds them); optimizer tensors are
        the parts of each logical tensor this rank's shards hold, in logical coordinates."""
        self.finish_param_sync()
        state: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            moments = {"exp_avg": bucket.exp_avg, "exp_avg_sq": bucket.exp_avg_sq}
            if bucket.has_separate_master:
                moments["master"] = bucket.master
            for slot in bucket.slots:
                # a weight that holds its FP8 copies: its master's values in its dtype (a new tensor; the master
                # loads beside it), as MixedPrecisionAdamW's
                param_flat = (bucket.master[slot.start:slot.end].to(slot.param.dtype)
                              if param_info(slot.param).holds_fp8 else bucket.param_data[slot.start:slot.end])
                for key, offset, shape in logical_parts(slot.name, slot.param):
                    view = param_flat[offset:offset + shape.numel()].view(shape)
                    state[f"model.{key}"] = tp_logical_tensor(view, tp_shard(slot.param))
                    start = slot.start + offset
                    parts = bucket.holders(start, start + shape.numel())
                    if bucket.group.rank not in parts:
                        continue
                    lo, hi = (start + bound - bucket.shard.start for bound in parts[bucket.group.rank])
                    logical_shape, ranges, blocks = self._holders_everywhere(bucket, slot.param, shape, parts)
                    for suffix, shard in moments.items():
                        state[f"optimizer.{key}.{suffix}"] = flat_range_tensor(logical_shape, shard[lo:hi], ranges,
                                                                               blocks)
        state["optimizer.step"] = self.steps_made
        return state

    def _holders_everywhere(self, bucket: _Bucket, param: nn.Parameter, shape: torch.Size,
                            parts: dict[int, tuple[int, int]]):
        """(logical shape, global rank -> element range, global rank -> TP block or None) of a logical tensor
        whose part ``shape`` the bucket's group holds as ``parts``: under TP, every TP rank's data-parallel
        group holds its own block of the tensor in the same ranges, as the bucket layouts are alike."""
        shard = tp_shard(param)
        if shard is None or shard.size == 1:
            return shape, {bucket.group.ranks[index]: part for index, part in parts.items()}, None
        group_of = self._edp_group_of if is_expert_param(param) else self._dp_cp_group_of
        ranges, blocks = {}, {}
        for tp_rank, rank in enumerate(shard.ranks):
            group = group_of[rank]
            for index, part in parts.items():
                ranges[group[index]] = part
                blocks[group[index]] = (shard.block_offsets(shape, tp_rank), shape)
        return shard.full_shape(shape), ranges, blocks

    @torch.no_grad()
    def after_load(self) -> None:
        """Refresh the model copies from the loaded master shards (the moments loaded in place)."""
        if any(bucket.has_separate_master for bucket in self.buckets):
            for bucket in self.buckets:
                bucket.write_model_copy()
                bucket.start_param_sync(self.collectives)
            self.finish_param_sync()
        weights_updated()


def _grad_hook(optimizer: weakref.ref, bucket_index: int, slot_index: int, param: nn.Parameter) -> None:
    """Post-accumulate-grad hook. It holds the optimizer weakly: torch keeps hooks out of the garbage
    collector's sight, so a strong reference would keep the optimizer (and its buffers) alive forever."""
    alive = optimizer()
    if alive is not None:
        alive._on_grad(bucket_index, slot_index, param)


def _wait_for_params(buckets: list[_Bucket], module: nn.Module, args) -> None:
    """Forward pre-hook: the all-gathers of the buckets this module is the first to use must be done."""
    for bucket in buckets:
        bucket.finish_param_sync()


def _plan_buckets(model: nn.Module, units: list[tuple[nn.Module, tuple[str, ...]]], bucket_bytes: float | None,
                  payload_itemsize: int) -> list[tuple[int, bool, list[tuple[str, nn.Parameter]]]]:
    """(first unit that uses it, expert?, parameters) for each bucket, in forward order.

    Buckets fill in backward order, the order gradients become ready: a unit (forward part) each, or
    until ``bucket_bytes`` of reduce-scatter payload. Dense and expert parameters never share a bucket.
    """
    members: dict[bool, list[tuple[int, str, nn.Parameter]]] = {False: [], True: []}
    for name, param in model.named_parameters():
        owners = [index for index, (_, prefixes) in enumerate(units)
                  if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)]
        if len(owners) != 1:
            raise ValueError(f"parameter {name} belongs to {len(owners)} of the model's forward_units(); "
                             "each parameter must belong to exactly one")
        members[is_expert_param(param)].append((owners[0], name, param))
    plans = []
    for expert, params in members.items():
        current: list[tuple[int, str, nn.Parameter]] = []
        for unit, name, param in reversed(params):
            if current and (unit != current[-1][0] if bucket_bytes is None
                            else sum(p.numel() for _, _, p in current) * payload_itemsize >= bucket_bytes):
                plans.append((expert, current))
                current = []
            current.append((unit, name, param))
        if current:
            plans.append((expert, current))
    return sorted(((min(unit for unit, _, _ in bucket), expert, [(name, param) for _, name, param in bucket])
                   for expert, bucket in plans), key=lambda plan: (plan[0], plan[1]))
