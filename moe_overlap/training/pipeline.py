"""The pipeline executor: runs this pipeline rank's action list (training/schedules.py) over its model chunks.

One executor runs any schedule. F runs a chunk's forward (the first stage reads token ids, a later one the
activations received from the stage before) and keeps what backward needs; B runs the chunk's backward
from the received gradient of its output (the last stage: from its loss) and leaves the gradient of its
input to send; I does the same with the weight gradients of the linears and experts deferred
(layers/deferred_wgrad.py), and W computes them. Post and Wait start and finish the transfers
(distributed/p2p.py); receive buffers have the static activation shape (micro-batch, sequence block,
hidden), so no shape is ever exchanged.

The loss of each micro-batch is scaled as gradient accumulation scales it; MoE auxiliary losses enter their
own stage's backward (models/pipeline_stages.AttachAuxLoss). The distributed optimizer's backward hooks
are armed only during the last micro-batch's backward actions of each chunk, so a bucket's reduce-scatter
starts when its last gradient of the step has arrived; its parameter all-gathers are waited for by the
forward pre-hooks, at the bucket's first forward. Losses and token counts stay on the device and are
shared over the pipeline group once per step.

With ``measure``, the executor also records each action's start and end and the peak bytes this
rank holds for the pipeline: tensors saved for backward (parameters excluded, each storage once), stage
outputs kept for backward, inputs kept for deferred weight gradients, and P2P buffers in flight.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from moe_overlap.config import Config
from moe_overlap.distributed.collectives import all_reduce_
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.distributed.p2p import PipelineP2P
from moe_overlap.distributed.streams import exposed_wait
from moe_overlap.layers.deferred_wgrad import WeightGradStore
from moe_overlap.models.mixtral import MixtralModel
from moe_overlap.models.pipeline_stages import PipelineStages, model_chunks
from moe_overlap.training.schedules import (ACTIVATION, BACKWARD, FORWARD, GRADIENT, INPUT_GRAD, Action, Compute,
                                            Message, P2POp, Post, Schedule, Wait, build_schedule, default_schedule)


@dataclass
class PipelineResult:
    lm_loss: torch.Tensor  # mean over micro-batches of the last stage's cross-entropy (the same on every rank)
    aux_loss: torch.Tensor  # mean over micro-batches of the auxiliary losses of every stage
    tokens_per_expert: dict[int, torch.Tensor]  # every MoE layer's copies per expert, whichever rank holds it
    peak_bytes: int | None = None  # with measure
    trace: list[tuple[Action, float, float]] | None = None  # with measure: every action's (start, end) in s


@dataclass
class _Step:
    """What one run holds between actions, keyed by (micro-batch, chunk) or by message."""

    batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    loss_scale: float
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    received: dict[Message, torch.Tensor] = field(default_factory=dict)
    to_send: dict[Message, torch.Tensor] = field(default_factory=dict)
    in_flight: dict[P2POp, tuple[list, torch.Tensor]] = field(default_factory=dict)
    deferred: dict[tuple[int, int], WeightGradStore] = field(default_factory=dict)
    held: dict[object, list] = field(default_factory=dict)  # measure: ledger holds by owner
    lm_sum: torch.Tensor | None = None
    aux_sum: torch.Tensor | None = None
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    trace: list[tuple[Action, float, float]] | None = None


class PipelineExecutor:
    def __init__(self, cfg: Config, mesh: Mesh, model: MixtralModel, stages: PipelineStages, optimizer,
                 device: torch.device, dtype: torch.dtype):
        self.cfg, self.mesh, self.model, self.optimizer = cfg, mesh, model, optimizer
        self.device, self.dtype = device, dtype
        self.rank = mesh.pp.rank
        self.chunks = model_chunks(model, stages, self.rank)
        self.p2p = PipelineP2P(mesh, cfg.train.distributed_timeout_s)
        m, t = cfg.model, cfg.train
        self.shape = (t.micro_batch_size, m.seq_length // model.tp_comm.sequence_shards, m.hidden_size)
        self.schedule_name = t.pipeline_schedule or default_schedule(stages.vpp)
        self.schedule = self.build(cfg.num_micro_batches(mesh.world_size))
        self._eval_schedules: dict[int, Schedule] = {}

    def build(self, micro_batches: int, forward_only: bool = False) -> Schedule:
        o = self.cfg.overlap
        return build_schedule(self.schedule_name, self.mesh.pp.size, len(self.chunks), micro_batches,
                              o.overlap_p2p_comm, o.batch_p2p_comm, forward_only)

    # ------------------------------------------------------------------------------------------- runs
    def run(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_scale: float,
            measure: bool = False) -> PipelineResult:
        """One step's forward and backward over ``batches`` (every micro-batch; each rank reads what its
        stages need): the gradients accumulate as gradient accumulation would accumulate them."""
        self.optimizer.start_micro_batch(is_last=False)  # forget last step's readiness; hooks disarmed
        return self._execute(self.schedule, batches, loss_scale, measure)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean cross-entropy over ``batches``, forward only (the same on every rank of the pipeline)."""
        m = len(batches)
        if m not in self._eval_schedules:
            self._eval_schedules[m] = self.build(m, forward_only=True)
        return float(self._execute(self._eval_schedules[m], batches, 1.0, False).lm_loss)

    def _execute(self, schedule: Schedule, batches, loss_scale: float, measure: bool) -> PipelineResult:
        if len(batches) != schedule.micro_batches:
            raise ValueError(f"the schedule runs {schedule.micro_batches} micro-batches; got {len(batches)}")
        step = _Step(batches, loss_scale, trace=[] if measure else None)
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        step.lm_sum, step.aux_sum = zero, zero.clone()
        ledger = _MemoryLedger(self.model.parameters()) if measure else None
        clock = _Clock(self.device) if measure else None
        for action in schedule.ranks[self.rank]:
            start = clock.mark() if clock else None
            if isinstance(action, Post):
                self._post(action, step, ledger)
            elif isinstance(action, Wait):
                self._wait(action, step, ledger)
            else:
                with ledger.saving() if ledger else contextlib.nullcontext():
                    self._compute(action, step, schedule, ledger)
            if clock:
                step.trace.append((action, start, clock.mark()))
        totals = torch.stack([step.lm_sum, step.aux_sum]) / schedule.micro_batches
        all_reduce_(totals, self.mesh.pp.group)  # the loss from the last stage, auxiliary losses from all
        return PipelineResult(totals[0], totals[1], self._share_tokens(step.tokens),
                              ledger.peak if ledger else None, clock.resolve(step.trace) if clock else None)

    # ----------------------------------------------------------------------------------------- compute
    def _compute(self, action: Compute, step: _Step, schedule: Schedule, ledger) -> None:
        if action.kind == FORWARD:
            self._forward(action, step, schedule, ledger)
            return
        # The distributed optimizer may start a bucket's reduce-scatter only on its last gradient.
        self.optimizer.arm_grad_sync(action.micro_batch == schedule.micro_batches - 1)
        key = (action.micro_batch, action.chunk)
        if action.kind in (BACKWARD, INPUT_GRAD):
            self._backward(action, step, schedule, ledger)
        else:
            step.deferred.pop(key).run()
            _release(ledger, step, ("deferred", key))

    def _forward(self, action: Compute, step: _Step, schedule: Schedule, ledger) -> None:
        chunk, key = self.chunks[action.chunk], (action.micro_batch, action.chunk)
        stage = schedule.stage(self.rank, action.chunk)
        input_ids, labels = step.batches[action.micro_batch]
        if chunk.first:
            x = input_ids.to(self.device)
        else:
            x = step.received.pop(Message(ACTIVATION, action.micro_batch, stage - 1))
            x.requires_grad_(torch.is_grad_enabled())
        out = chunk(x, labels.to(self.device), step.loss_scale)
        _release(ledger, step, ("recv", x))  # now saved for backward, or gone
        if not chunk.last:
            step.to_send[Message(ACTIVATION, action.micro_batch, stage)] = out.output.detach()
        if torch.is_grad_enabled():
            step.inputs[key], step.outputs[key] = x, out.output
            _hold(ledger, step, ("output", key), [out.output])
        if out.lm_loss is not None:
            step.lm_sum = step.lm_sum + out.lm_loss
        step.aux_sum = step.aux_sum + out.aux_loss
        for layer, counts in out.tokens_per_expert.items():
            step.tokens[layer] = step.tokens.get(layer, 0) + counts

    def _backward(self, action: Compute, step: _Step, schedule: Schedule, ledger) -> None:
        chunk, key = self.chunks[action.chunk], (action.micro_batch, action.chunk)
        stage = schedule.stage(self.rank, action.chunk)
        output = step.outputs.pop(key)
        grad = None
        if not chunk.last:
            grad = step.received.pop(Message(GRADIENT, action.micro_batch, stage + 1))
        if action.kind == INPUT_GRAD:
            store = step.deferred[key] = WeightGradStore()
            with store.deferring():
                torch.autograd.backward(output, grad)
            _hold(ledger, step, ("deferred", key), store.tensors())
        else:
            torch.autograd.backward(output, grad)
        _release(ledger, step, ("output", key))
        if grad is not None:
            _release(ledger, step, ("recv", grad))
        x = step.inputs.pop(key)
        if not chunk.first:
            step.to_send[Message(GRADIENT, action.micro_batch, stage)] = x.grad

    # ------------------------------------------------------------------------------------------ transfers
    def _post(self, action: Post, step: _Step, ledger) -> None:
        tensors = [step.to_send.pop(op.message) if op.send
                   else torch.empty(self.shape, dtype=self.dtype, device=self.device) for op in action.ops]
        works = self.p2p.post([(op.send, t, op.peer) for op, t in zip(action.ops, tensors)],
                              batch=self.cfg.overlap.batch_p2p_comm)
        for op, tensor, work in zip(action.ops, tensors, works):
            step.in_flight[op] = (work, tensor)
            _hold(ledger, step, ("send" if op.send else "recv", tensor), [tensor])

    def _wait(self, action: Wait, step: _Step, ledger) -> None:
        for op in action.ops:
            works, tensor = step.in_flight.pop(op)
            with exposed_wait("pp"):
                for work in works:
                    work.wait()
            if op.send:
                _release(ledger, step, ("send", tensor))
            else:
                step.received[op.message] = tensor  # held until the compute that consumes it

    # --------------------------------------------------------------------------------------------- totals
    def _share_tokens(self, tokens: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every MoE layer's counts on every rank of the pipeline (for the metrics; routers use their own)."""
        m = self.cfg.model
        moe_layers = [index for index in range(m.num_layers) if m.is_moe_layer(index)]
        if not moe_layers:
            return {}
        table = torch.zeros((m.num_layers, m.num_moe_experts), dtype=torch.int64, device=self.device)
        for layer, counts in tokens.items():
            table[layer] = counts
        all_reduce_(table, self.mesh.pp.group)
        return {layer: table[layer] for layer in moe_layers}


# ------------------------------------------------------------------------------------------- measuring


class _Clock:
    """Marks on the host clock, or CUDA events (resolved after the step) so that marks do not sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.origin = self.mark()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, trace) -> list[tuple[Action, float, float]]:
        if not self.cuda:
            return [(action, start - self.origin, end - self.origin) for action, start, end in trace]
        torch.cuda.synchronize()
        return [(action, self.origin.elapsed_time(start) / 1e3, self.origin.elapsed_time(end) / 1e3)
                for action, start, end in trace]


class _MemoryLedger:
    """Bytes held for the pipeline, each storage counted once, parameters never; with the peak."""

    def __init__(self, params):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.counts: dict[int, tuple[int, int]] = {}  # storage -> (holders, bytes)
        self.bytes = self.peak = 0

    def hold(self, tensor: torch.Tensor) -> int | None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.param_storages:
            return None
        holders, nbytes = self.counts.get(ptr, (0, storage.nbytes()))
        if holders == 0:
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)
        self.counts[ptr] = (holders + 1, nbytes)
        return ptr

    def release(self, ptr: int | None) -> None:
        if ptr is None:
            return
        holders, nbytes = self.counts[ptr]
        if holders == 1:
            del self.counts[ptr]
            self.bytes -= nbytes
        else:
            self.counts[ptr] = (holders - 1, nbytes)

    def saving(self):
        """Count what autograd saves for backward, until autograd lets it go."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor):
        ptr = self.hold(tensor)
        if ptr is None:
            return tensor
        return _Saved(tensor, self, ptr)


class _Saved:
    """A tensor autograd saved, counted in a ledger until autograd frees it."""

    def __init__(self, tensor: torch.Tensor, ledger: _MemoryLedger, ptr: int):
        self.tensor, self.ledger, self.ptr = tensor, ledger, ptr

    def __del__(self):
        self.ledger.release(self.ptr)


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved


def _hold(ledger: _MemoryLedger | None, step: _Step, owner, tensors) -> None:
    if ledger is not None:
        step.held[_owner_key(owner)] = [ledger.hold(t) for t in tensors]


def _release(ledger: _MemoryLedger | None, step: _Step, owner) -> None:
    if ledger is not None:
        for ptr in step.held.pop(_owner_key(owner), []):
            ledger.release(ptr)


def _owner_key(owner):
    kind, what = owner
    return (kind, id(what)) if isinstance(what, torch.Tensor) else owner
