"""The executor: runs this pipeline rank's action list (training/schedules.py) over its model chunks. It runs every
micro-batch schedule: plain gradient accumulation (PP=1 is a one-stage pipeline, whose 1F1B is F0 B0 F1 B1 ...;
no transfers), paired micro-batches (``overlap.overlap_moe_expert_parallel_comm``) and every PP schedule.

F runs a chunk's forward (the first stage reads token ids, a later one the activations received from the stage
before) and keeps what backward needs; B runs the chunk's backward from the received gradient of its output (the
last stage: from its loss) and leaves the gradient of its input to send; I does the same with the weight
gradients of the linears and experts deferred (layers/deferred_wgrad.py), and W computes them; a Pair runs one
micro-batch's F and another's B or I segment by segment in turn (training/microbatch_overlap.py). A chunk runs
as one segment (its plain forward: no graph cut) unless the schedule pairs; then every training forward runs as
the chunk's segments, the autograd graph cut between them; with graphed MoE layers a pair's forward and backward
run whole instead, side by side on two CUDA streams (microbatch_overlap.PairStreams). Post and Wait start and
finish the transfers (distributed/p2p.py); receive buffers have the static activation shape (micro-batch, sequence
block, hidden), so no shape is ever exchanged.

Every hook of a step is armed here, from the action list:
- the optimizer's gradient sync, before each backward action (B, I, W, a pair's B or I): armed on its chunk's
  last micro-batch only, so that the distributed optimizer starts a bucket's reduce-scatter when the bucket's last
  gradient of the step has arrived (its parameter all-gathers are waited for by forward pre-hooks, at the
  bucket's first forward);
- the model's start_micro_batch (the experts' weight-gradient groups), before each backward, in backward order;
- the GEMMs' SM carve-outs (:class:`Carveouts`): beside the parameter all-gathers from the step's start through
  each chunk's first forward, beside the gradient reduce-scatters from the last micro-batch's first backward
  action to the end, beside the other micro-batch's exchanges in every pair.
The loss of each micro-batch is scaled as gradient accumulation scales it; MoE auxiliary losses enter their own
stage's backward (models/pipeline_stages.AttachAuxLoss). Losses (summed in fp64) and token counts stay on the
device and are shared over the pipeline group once per step.

With ``measure``, the executor also records each action's start and end and the peak bytes this rank holds for
the pipeline: tensors saved for backward (parameters excluded, each storage once), chunk outputs kept for
backward, inputs kept for deferred weight gradients, and P2P buffers in flight.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from moe_overlap.config import Config
from moe_overlap.config.defaults import pairs_on_streams
from moe_overlap.distributed.collectives import all_reduce_
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.distributed.p2p import PipelineP2P
from moe_overlap.distributed.streams import exposed_wait, gemm_sm_carveout, to_device_async, use_stream
from moe_overlap.layers.deferred_wgrad import WeightGradStore
from moe_overlap.models.mixtral import MixtralModel
from moe_overlap.models.pipeline_stages import PipelineStages, model_chunks
from moe_overlap.training.microbatch_overlap import ChunkRun, PairStreams, run_pair
from moe_overlap.training.schedules import (ACTIVATION, FORWARD, GRADIENT, INPUT_GRAD, WEIGHT_GRAD, Action, Compute,
                                            Message, P2POp, Pair, Post, Schedule, Wait, build_schedule,
                                            default_schedule)


@dataclass(frozen=True)
class Carveouts:
    """SMs the GEMMs of an action leave free to the communication beside them (``overlap.gemm_sm_carveout``)."""

    param_sync: int = 0  # the distributed optimizer's parameter all-gathers: through each chunk's first forward
    grad_sync: int = 0  # its gradient reduce-scatters: from the last micro-batch's first backward action on
    paired: int = 0  # the other micro-batch's exchanges: every pair

    def __bool__(self) -> bool:
        return bool(self.param_sync or self.grad_sync or self.paired)


@dataclass
class PipelineResult:
    losses: torch.Tensor  # (2,) fp64, the same on every rank: the mean over micro-batches of the last stage's
    # cross-entropy, and of the auxiliary losses of every stage
    # every MoE layer's copies per expert, whichever rank holds it: (micro-batches, experts), this rank's routing
    tokens_per_micro_batch: dict[int, torch.Tensor]
    peak_bytes: int | None = None  # with measure
    trace: list[tuple[Action, float, float]] | None = None  # with measure: every action's (start, end) in s
    order: list[tuple[str, int, str]] = field(default_factory=list)  # paired: (F | B, micro-batch, segment) as run

    @property
    def lm_loss(self) -> torch.Tensor:
        return self.losses[0]

    @property
    def aux_loss(self) -> torch.Tensor:
        return self.losses[1]


@dataclass
class _Run:
    """What one run holds between actions, keyed by (micro-batch, chunk) or by message."""

    batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    loss_scale: float
    split: bool  # chunks run as their segments (the schedule pairs)
    lm_sum: torch.Tensor
    aux_sum: torch.Tensor
    streams: PairStreams | None  # pairs side by side on two streams (graphed MoE layers)
    units: dict[tuple[int, int], ChunkRun] = field(default_factory=dict)  # forward run, backward not yet
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # received activations
    received: dict[Message, torch.Tensor] = field(default_factory=dict)
    to_send: dict[Message, torch.Tensor] = field(default_factory=dict)
    in_flight: dict[P2POp, tuple[list, torch.Tensor]] = field(default_factory=dict)
    deferred: dict[tuple[int, int], WeightGradStore] = field(default_factory=dict)
    held: dict[object, list] = field(default_factory=dict)  # measure: ledger holds by owner
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> copies, (micro-batches, experts)
    trace: list[tuple[Action, float, float]] | None = None
    order: list[tuple[str, int, str]] = field(default_factory=list)


class PipelineExecutor:
    """This rank's part of every step: its action list run over its model chunks (a one-stage pipeline at PP=1)."""

    def __init__(self, cfg: Config, mesh: Mesh, model: MixtralModel, stages: PipelineStages, optimizer,
                 device: torch.device, dtype: torch.dtype):
        self.cfg, self.mesh, self.model, self.optimizer = cfg, mesh, model, optimizer
        self.device, self.dtype = device, dtype
        self.rank = mesh.pp.rank
        self.chunks = model_chunks(model, stages, self.rank)
        self.p2p = PipelineP2P(mesh, cfg.train.distributed_timeout_s) if stages.pp > 1 else None
        m, t = cfg.model, cfg.train
        self.shape = (t.micro_batch_size, m.seq_length // model.tp_comm.sequence_shards, m.hidden_size)
        self.schedule_name = t.pipeline_schedule or default_schedule(stages.vpp)
        self.schedule = self.build(cfg.num_micro_batches(mesh.world_size))
        self._eval_schedules: dict[int, Schedule] = {}
        # paired micro-batches with graphed MoE layers: each pair's halves whole, on their micro-batches' streams
        self.pair_streams = PairStreams(device) if pairs_on_streams(cfg) else None

    def build(self, micro_batches: int, forward_only: bool = False) -> Schedule:
        o = self.cfg.overlap
        return build_schedule(self.schedule_name, self.mesh.pp.size, len(self.chunks), micro_batches,
                              o.overlap_p2p_comm, o.batch_p2p_comm, forward_only, o.overlap_moe_expert_parallel_comm)

    # ------------------------------------------------------------------------------------------- runs
    def run(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_scale: float, measure: bool = False,
            carveouts: Carveouts = Carveouts()) -> PipelineResult:
        """One step's forward and backward over ``batches`` (every micro-batch; each rank reads what its
        chunks need): the gradients accumulate as gradient accumulation would accumulate them."""
        self.optimizer.start_micro_batch(is_last=False)  # forget last step's readiness; hooks disarmed
        if self.schedule.paired != (self.cfg.overlap.overlap_moe_expert_parallel_comm is True):
            # the switch, read at each step as the carve-outs read it (a benchmark turns it between steps of one
            # trainer: benchmarks/ep_microbatch_overlap.py); graphed copies made for pairs serve unpaired too
            self.schedule = self.build(self.schedule.micro_batches)
        return self._execute(self.schedule, batches, loss_scale, measure, carveouts)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Mean cross-entropy over ``batches``, forward only (fp64 on the device, the same on every rank of the
        pipeline)."""
        m = len(batches)
        if m not in self._eval_schedules:
            self._eval_schedules[m] = self.build(m, forward_only=True)
        return self._execute(self._eval_schedules[m], batches, 1.0, False, Carveouts()).lm_loss

    def _execute(self, schedule: Schedule, batches, loss_scale: float, measure: bool,
                 carveouts: Carveouts) -> PipelineResult:
        if len(batches) != schedule.micro_batches:
            raise ValueError(f"the schedule runs {schedule.micro_batches} micro-batches; got {len(batches)}")
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        whole_pairs = schedule.paired and self.pair_streams is not None
        streams = self.pair_streams if whole_pairs else None
        run = _Run(batches, loss_scale, schedule.paired and not whole_pairs, zero, zero.clone(), streams,
                   trace=[] if measure else None)
        actions = schedule.ranks[self.rank]
        if streams is not None:
            streams.begin()
        sms = _carveout_sms(actions, schedule.micro_batches, carveouts) if carveouts else None
        ledger = _MemoryLedger(self.model.parameters()) if measure else None
        clock = _Clock(self.device) if measure else None
        for index, action in enumerate(actions):
            start = clock.mark() if clock else None
            if isinstance(action, Post):
                self._post(action, run, ledger)
            elif isinstance(action, Wait):
                self._wait(action, run, ledger)
            elif (sms and sms[index]) or ledger:
                with (gemm_sm_carveout(sms[index] if sms else 0),
                      ledger.saving() if ledger else contextlib.nullcontext()):
                    self._compute(action, run, schedule, ledger)
            else:  # plain accumulation's path: no context to enter
                self._compute(action, run, schedule, ledger)
            if clock:
                run.trace.append((action, start, clock.mark()))
        if streams is not None:
            streams.end()
        losses = torch.stack([run.lm_sum, run.aux_sum]) / schedule.micro_batches
        all_reduce_(losses, self.mesh.pp.group)  # the loss from the last stage, auxiliary losses from all
        return PipelineResult(losses, self._share_tokens(run.tokens, schedule.micro_batches),
                              ledger.peak if ledger else None, clock.resolve(run.trace) if clock else None, run.order)

    # ----------------------------------------------------------------------------------------- compute
    def _compute(self, action: Compute | Pair, run: _Run, schedule: Schedule, ledger) -> None:
        if isinstance(action, Pair) and not run.split:  # each half whole, on its own stream (or one after the other)
            self._compute(action.forward, run, schedule, ledger)
            self._compute(action.backward, run, schedule, ledger)
        elif isinstance(action, Pair):
            forward = self._start_forward(action.forward, run)
            backward = self._start_backward(action.backward, run, schedule)
            run_pair(forward, backward)
            self._finish_forward(action.forward, forward, run, ledger)
            self._finish_backward(action.backward, backward, run, ledger)
        elif action.kind == FORWARD:
            with _on_stream(run, action):
                unit = self._start_forward(action, run)
                unit.forward_all()
                self._finish_forward(action, unit, run, ledger)
        elif action.kind == WEIGHT_GRAD:
            self._arm_backward(action, schedule)
            key = (action.micro_batch, action.chunk)
            with _on_stream(run, action):  # on streams: after the backwards before it, as every gradient
                run.deferred.pop(key).run()
            _release(ledger, run, ("deferred", key))
        else:
            with _on_stream(run, action):
                unit = self._start_backward(action, run, schedule)
                unit.backward_all()
                self._finish_backward(action, unit, run, ledger)

    def _start_forward(self, action: Compute, run: _Run) -> ChunkRun:
        chunk, key = self.chunks[action.chunk], (action.micro_batch, action.chunk)
        input_ids, labels = run.batches[action.micro_batch]
        if chunk.first:
            x = to_device_async(input_ids, self.device)
        else:
            x = run.inputs[key] = run.received.pop(Message(ACTIVATION, action.micro_batch, chunk.stage - 1))
            x.requires_grad_(torch.is_grad_enabled())
        labels = to_device_async(labels, self.device) if chunk.last else None
        carry = chunk.carry(x, labels, action.micro_batch, run.loss_scale, run.split)
        if run.split:
            return ChunkRun(chunk.split, carry, run.order)
        # on streams: the pair's order recorded too, each half one segment
        return ChunkRun(chunk.whole, carry, run.order if run.streams is not None else None)

    def _finish_forward(self, action: Compute, unit: ChunkRun, run: _Run, ledger) -> None:
        chunk, key = self.chunks[action.chunk], (action.micro_batch, action.chunk)
        out = unit.output
        if not chunk.first:  # the received activations: now saved for backward, or gone
            _release(ledger, run, ("recv", run.inputs[key] if torch.is_grad_enabled() else run.inputs.pop(key)))
        if not chunk.last:
            run.to_send[Message(ACTIVATION, action.micro_batch, chunk.stage)] = out.output.detach()
        if torch.is_grad_enabled():
            run.units[key] = unit
            _hold(ledger, run, ("output", key), [out.output])
        if run.streams is not None and self.device.type == "cuda":  # the sums so far came from the other stream: not
            for total in (run.lm_sum, run.aux_sum):  # reused before this one read them
                total.record_stream(torch.cuda.current_stream())
        if out.lm_loss is not None:
            run.lm_sum = run.lm_sum + out.lm_loss
        run.aux_sum = run.aux_sum + out.aux_loss
        for layer, counts_E in out.tokens_per_expert.items():
            if layer not in run.tokens:
                run.tokens[layer] = counts_E.new_zeros((len(run.batches), counts_E.numel()))
            # copied now: a graphed layer's counts are its graph's output buffer, which its next replay overwrites
            run.tokens[layer][action.micro_batch].copy_(counts_E)

    def _arm_backward(self, action: Compute, schedule: Schedule) -> None:
        """Before a backward action: the distributed optimizer may start a bucket's reduce-scatter only on its
        last gradient; the experts' weight-gradient groups follow the backward order."""
        last = action.micro_batch == schedule.micro_batches - 1
        self.optimizer.arm_grad_sync(last)
        if action.kind != WEIGHT_GRAD:
            self.model.start_micro_batch(first=action.micro_batch == 0, last=last)

    def _start_backward(self, action: Compute, run: _Run, schedule: Schedule) -> ChunkRun:
        chunk, key = self.chunks[action.chunk], (action.micro_batch, action.chunk)
        self._arm_backward(action, schedule)
        unit = run.units.pop(key)
        if not chunk.last:
            unit.grad = run.received.pop(Message(GRADIENT, action.micro_batch, chunk.stage + 1))
        if action.kind == INPUT_GRAD:
            unit.store = run.deferred[key] = WeightGradStore()
        return unit

    def _finish_backward(self, action: Compute, unit: ChunkRun, run: _Run, ledger) -> None:
        chunk, key = self.chunks[action.chunk], (action.micro_batch, action.chunk)
        if unit.store is not None:
            _hold(ledger, run, ("deferred", key), unit.store.tensors())
        _release(ledger, run, ("output", key))
        if unit.grad is not None:
            _release(ledger, run, ("recv", unit.grad))
        if not chunk.first:
            run.to_send[Message(GRADIENT, action.micro_batch, chunk.stage)] = run.inputs.pop(key).grad

    # ------------------------------------------------------------------------------------------ transfers
    def _post(self, action: Post, run: _Run, ledger) -> None:
        if run.streams is None:
            self._post_ops(action.ops, run, ledger)
            return
        for op in action.ops:  # each on its micro-batch's stream (pairs on streams: no batched transfers)
            with use_stream(run.streams.stream(op.message.micro_batch)):
                self._post_ops((op,), run, ledger)

    def _post_ops(self, ops: Sequence[P2POp], run: _Run, ledger) -> None:
        tensors = [run.to_send.pop(op.message) if op.send
                   else torch.empty(self.shape, dtype=self.dtype, device=self.device) for op in ops]
        works = self.p2p.post([(op.send, t, op.peer) for op, t in zip(ops, tensors)],
                              batch=self.cfg.overlap.batch_p2p_comm)
        for op, tensor, work in zip(ops, tensors, works):
            run.in_flight[op] = (work, tensor)
            _hold(ledger, run, ("send" if op.send else "recv", tensor), [tensor])

    def _wait(self, action: Wait, run: _Run, ledger) -> None:
        for op in action.ops:
            works, tensor = run.in_flight.pop(op)
            stream = run.streams.stream(op.message.micro_batch) if run.streams is not None else None
            with exposed_wait("pp"), use_stream(stream):  # (None: the current stream)
                for work in works:
                    work.wait()
            if op.send:
                _release(ledger, run, ("send", tensor))
            else:
                run.received[op.message] = tensor  # held until the compute that consumes it

    # --------------------------------------------------------------------------------------------- totals
    def _share_tokens(self, tokens: dict[int, torch.Tensor], micro_batches: int) -> dict[int, torch.Tensor]:
        """Every MoE layer's counts per micro-batch, (micro-batches, experts), on every rank of the pipeline (for
        the metrics; routers use their own)."""
        if self.mesh.pp.size == 1:
            return tokens
        m = self.cfg.model
        moe_layers = [index for index in range(m.num_layers) if m.is_moe_layer(index)]
        if not moe_layers:
            return {}
        table = torch.zeros((m.num_layers, micro_batches, m.num_moe_experts), dtype=torch.int64, device=self.device)
        for layer, counts_ME in tokens.items():
            table[layer] = counts_ME
        all_reduce_(table, self.mesh.pp.group)
        return {layer: table[layer] for layer in moe_layers}


def _on_stream(run: _Run, action: Compute):
    """Where the action's work queues: its micro-batch's stream when pairs run on streams, else the current one."""
    if run.streams is None:
        return contextlib.nullcontext()
    return run.streams.running(action.micro_batch, action.kind == FORWARD)


def _carveout_sms(actions: Sequence[Action], micro_batches: int, carveouts: Carveouts) -> list[int]:
    """Per action, the SMs its GEMMs leave free: the parameter all-gathers are in flight from the step's start
    until each chunk's first forward has waited for its buckets; the gradient reduce-scatters from the first
    backward action of the last micro-batch (they start on its chunk's last gradients) to the end; the other
    micro-batch's exchanges during a pair."""
    parts = [a.parts if isinstance(a, (Compute, Pair)) else () for a in actions]
    first_forwards = [i for i, ps in enumerate(parts) if any(p.kind == FORWARD and p.micro_batch == 0 for p in ps)]
    last_backwards = [i for i, ps in enumerate(parts)
                      if any(p.kind != FORWARD and p.micro_batch == micro_batches - 1 for p in ps)]
    param_end, grad_start = max(first_forwards, default=-1), min(last_backwards, default=len(actions))
    return [max(carveouts.param_sync if i <= param_end else 0, carveouts.grad_sync if i >= grad_start else 0,
                carveouts.paired if isinstance(action, Pair) else 0) for i, action in enumerate(actions)]


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


def _hold(ledger: _MemoryLedger | None, run: _Run, owner, tensors) -> None:
    if ledger is not None:
        run.held[_owner_key(owner)] = [ledger.hold(t) for t in tensors]


def _release(ledger: _MemoryLedger | None, run: _Run, owner) -> None:
    if ledger is not None:
        for ptr in run.held.pop(_owner_key(owner), []):
            ledger.release(ptr)


def _owner_key(owner):
    kind, what = owner
    return (kind, id(what)) if isinstance(what, torch.Tensor) else owner
