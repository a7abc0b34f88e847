"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs in one step.

Compute actions: ``F`` (one micro-batch forward through one model chunk), ``B`` (its backward), or B's two
halves for zero-bubble schedules, ``I`` (the input gradient, which the previous stage waits for) and ``W``
(the weight gradients, which nobody waits for); and a :class:`Pair`, one micro-batch's F run together with
another's B or I (``overlap.overlap_moe_expert_parallel_comm``: the executor alternates their segments, so
that each one's MoE exchanges run beside the other's compute). Model chunk c on pipeline rank r holds virtual
stage s = c * PP + r. Communication actions: ``Post`` starts sends and receives (one batched call, or one call
per transfer) and ``Wait`` blocks until they are done. PP=1 is a one-stage pipeline: its lists hold no
transfers (1F1B there is plain gradient accumulation, F0 B0 F1 B1 ...).

A builder gives each rank's compute order (:func:`compute_orders`); paired, it runs one more warm-up forward
(as Megatron-Core's combined 1F1B), so that every steady-state forward has another micro-batch's backward to
pair with. :func:`lower` adds the transfers for the blocking or the overlapped policy
(``overlap.overlap_p2p_comm``); :func:`validate` checks a list (every transfer has its other end, in the same
order on both ends of a channel, F before B, a pair's halves independent, the activations in flight within
the schedule's bound, no deadlock); :func:`simulate` times it from per-action costs, which gives the timeline
and the bubble fraction that ``moe-overlap info --schedule`` prints and the benchmark checks against
measurement. One executor (training/pipeline.py) runs any list.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, PAIR = "F", "B", "I", "W", "P"
ACTIVATION, GRADIENT = "act", "grad"

# train.pipeline_schedule values; null picks 1f1b, or interleaved_1f1b with virtual stages.
SCHEDULES = ("all_forward_all_backward", "1f1b", "interleaved_1f1b", "zb_h1")


class ScheduleError(ValueError):
    """An action list that cannot run as given (or a schedule that cannot be built for the sizes)."""


@dataclass(frozen=True)
class Compute:
    kind: str  # F, B, I or W
    micro_batch: int
    chunk: int  # model chunk on this rank

    @property
    def parts(self) -> tuple[Compute, ...]:
        return (self,)

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Pair:
    """One micro-batch's forward and another's backward (B or I) of this rank run together, segment by segment
    in turn (``overlap_moe_expert_parallel_comm``). Its transfers are those of both halves: every receive waited
    for before it starts, every send started after it ends; so the halves must not depend on each other."""

    forward: Compute
    backward: Compute
    kind = PAIR

    @property
    def parts(self) -> tuple[Compute, ...]:
        return self.forward, self.backward

    def __str__(self) -> str:
        return f"{self.forward}+{self.backward}"


@dataclass(frozen=True)
class Message:
    """What crosses between stages: a forward output (to stage + 1) or an input gradient (to stage - 1)."""

    kind: str  # act or grad
    micro_batch: int
    stage: int  # the virtual stage that produces it

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@{self.stage}"


@dataclass(frozen=True)
class P2POp:
    send: bool
    message: Message
    peer: int  # pipeline rank at the other end

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.message} {'to' if self.send else 'from'} {self.peer}"


@dataclass(frozen=True)
class Post:
    ops: tuple[P2POp, ...]  # started together: one batched call, or one call each


@dataclass(frozen=True)
class Wait:
    ops: tuple[P2POp, ...]


ComputeAction = Union[Compute, Pair]
Action = Union[Compute, Pair, Post, Wait]


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    vpp: int
    micro_batches: int
    overlap_p2p: bool
    batch_p2p: bool
    ranks: tuple[tuple[Action, ...], ...]  # by pipeline rank
    paired: bool = False  # forwards paired with backwards (overlap_moe_expert_parallel_comm)

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

    def computes(self, rank: int) -> list[ComputeAction]:
        return [a for a in self.ranks[rank] if isinstance(a, (Compute, Pair))]

    def units(self, rank: int) -> list[Compute]:
        """The compute actions with each pair as its two halves, forward first."""
        return [part for action in self.computes(rank) for part in action.parts]


def default_schedule(vpp: int) -> str:
    return "interleaved_1f1b" if vpp > 1 else "1f1b"


# ------------------------------------------------------------------------------------------- builders


def compute_orders(name: str, pp: int, vpp: int, micro_batches: int,
                   paired: bool = False) -> list[list[tuple[ComputeAction, ...]]]:
    """Each pipeline rank's compute actions in the order it runs them, in steps: the blocking policy
    exchanges between steps (Megatron's: after every action, or after each forward-backward pair of the
    interleaved steady state, whose transfers both ends then start together). ``paired``: one more warm-up
    forward on every rank, and each steady-state forward and backward one :class:`Pair`."""
    if name not in SCHEDULES:
        raise ScheduleError(f"schedule {name!r}: allowed {', '.join(SCHEDULES)}")
    if paired and name == "all_forward_all_backward":
        raise ScheduleError(f"schedule {name!r} runs no forward beside a backward: nothing to pair")
    if name in ("1f1b", "zb_h1") and vpp != 1:
        raise ScheduleError(f"schedule {name!r} has one model chunk per rank; virtual stages need interleaved_1f1b")
    if vpp > 1 and micro_batches % pp:
        raise ScheduleError(f"virtual stages take micro-batches in groups of PP={pp}; {micro_batches} is not a "
                            "multiple")
    build = {"all_forward_all_backward": _all_forward_all_backward, "1f1b": _one_f_one_b,
             "interleaved_1f1b": _interleaved, "zb_h1": _zb_h1}[name]
    return [build(pp, vpp, micro_batches, rank, paired) for rank in range(pp)]


def _warm_up(pp: int, rank: int, paired: bool) -> int:
    """Forwards a one-chunk rank runs before its first backward: PP - rank - 1; paired, 2 (PP - rank - 1) + 1,
    the interleaved warm-up at VPP = 1 plus one (Megatron-Core's combined 1F1B). A pair sends its forward's
    output only when both halves end, and its backward needs the next rank's gradient when it starts: with
    two forwards of lead per later rank, that gradient was sent a pair earlier, and the steady state has no
    bubble; with one, each pair would wait for the next rank's pair."""
    return 2 * (pp - rank - 1) + 1 if paired else pp - rank - 1


def _all_forward_all_backward(pp: int, vpp: int, m: int, rank: int, paired: bool) -> list[tuple[Compute, ...]]:
    """Every forward, then every backward (GPipe): the reference, holding all micro-batches at once. With
    virtual stages, in the interleaved order (a chunk at a time over all micro-batches would have each rank
    wait, in a blocking send, for a receive that its peer reaches only after its own sends)."""
    if vpp > 1:
        return _interleaved(pp, vpp, m, rank, paired, warm_up=m * vpp)
    return [(Compute(FORWARD, mb, 0),) for mb in range(m)] + [(Compute(BACKWARD, mb, 0),) for mb in range(m)]


def _one_f_one_b(pp: int, vpp: int, m: int, rank: int, paired: bool) -> list[tuple[ComputeAction, ...]]:
    """The warm-up forwards (:func:`_warm_up`), then one forward and one backward in turn (paired: together),
    then the cool-down."""
    warm = min(_warm_up(pp, rank, paired), m)
    order = [(Compute(FORWARD, mb, 0),) for mb in range(warm)]
    for i in range(m - warm):
        forward, backward = Compute(FORWARD, warm + i, 0), Compute(BACKWARD, i, 0)
        order += [(Pair(forward, backward),)] if paired else [(forward,), (backward,)]
    return order + [(Compute(BACKWARD, mb, 0),) for mb in range(m - warm, m)]


def _interleaved(pp: int, vpp: int, m: int, rank: int, paired: bool,
                 warm_up: int | None = None) -> list[tuple[ComputeAction, ...]]:
    """Megatron-Core's interleaved 1F1B: micro-batches go through the chunks in groups of PP, so each
    rank's warm-up is (PP - rank - 1) * 2 + (VPP - 1) * PP chunk-forwards (one more paired) and the bubble
    shrinks by VPP."""
    total = m * vpp

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, in_group = divmod(k, pp * vpp)
        chunk = in_group // pp
        return group * pp + in_group % pp, chunk if forward else vpp - 1 - chunk

    warm = min((pp - rank - 1) * 2 + (vpp - 1) * pp + paired if warm_up is None else warm_up, total)
    order = [(Compute(FORWARD, *unit(k, True)),) for k in range(warm)]
    for i in range(total - warm):
        forward, backward = Compute(FORWARD, *unit(warm + i, True)), Compute(BACKWARD, *unit(i, False))
        order.append((Pair(forward, backward),) if paired else (forward, backward))
    return order + [(Compute(BACKWARD, *unit(k, False)),) for k in range(total - warm, total)]


def _zb_h1(pp: int, vpp: int, m: int, rank: int, paired: bool) -> list[tuple[ComputeAction, ...]]:
    """Zero-bubble H1 (Qi et al., 2023): in the steady state rank r runs F(x), I(x - (PP - 1 - r)),
    W(x - (PP - 1)), so I leaves as early as 1F1B's B and each W waits until a bubble would open; warm-up
    and cool-down are the same rule with the out-of-range micro-batches left out. Rank 0 holds PP
    micro-batches' activations, as in 1F1B; a later rank also holds the weight-gradient inputs of up to
    ``rank`` more. The bubble falls from (PP - 1)(F + B) to (PP - 1)(F + I - W). Paired, I runs as far
    behind F as 1F1B's B (:func:`_warm_up`), W as far as rank 0's I, and each F with its I is one pair: the
    same bubble, with up to 2 PP micro-batches in flight on every rank."""
    behind, weights_behind = _warm_up(pp, rank, paired), _warm_up(pp, 0, paired)
    order = []
    for x in range(m + weights_behind):
        forward, backward = Compute(FORWARD, x, 0), Compute(INPUT_GRAD, x - behind, 0)
        weights = [Compute(WEIGHT_GRAD, x - weights_behind, 0)] if 0 <= x - weights_behind < m else []
        if paired and 0 <= backward.micro_batch and forward.micro_batch < m:
            # one step: the pair's sends wait for the next pair's receives, not for both ends' W
            order.append((Pair(forward, backward), *weights))
        else:
            order += [(c,) for c in [forward, backward, *weights] if 0 <= c.micro_batch < m]
    return order


# ---------------------------------------------------------------------------------------- transfers


def needs(action: ComputeAction, rank: int, pp: int, stages: int) -> list[P2POp]:
    """The receives a compute action consumes."""
    ops = []
    for part in action.parts:
        stage = part.chunk * pp + rank
        if part.kind == FORWARD and stage > 0:
            ops.append(P2POp(False, Message(ACTIVATION, part.micro_batch, stage - 1), (rank - 1) % pp))
        elif part.kind in (BACKWARD, INPUT_GRAD) and stage < stages - 1:
            ops.append(P2POp(False, Message(GRADIENT, part.micro_batch, stage + 1), (rank + 1) % pp))
    return ops


def produces(action: ComputeAction, rank: int, pp: int, stages: int) -> list[P2POp]:
    """The sends of what a compute action produces."""
    ops = []
    for part in action.parts:
        stage = part.chunk * pp + rank
        if part.kind == FORWARD and stage < stages - 1:
            ops.append(P2POp(True, Message(ACTIVATION, part.micro_batch, stage), (rank + 1) % pp))
        elif part.kind in (BACKWARD, INPUT_GRAD) and stage > 0:
            ops.append(P2POp(True, Message(GRADIENT, part.micro_batch, stage), (rank - 1) % pp))
    return ops


def lower(steps: Sequence[Sequence[tuple[ComputeAction, ...]]], pp: int, vpp: int,
          overlap: bool) -> list[list[Action]]:
    """Add the transfers to each rank's compute order.

    Blocking (``overlap`` false, Megatron's): between two steps, the sends of the first and the receives
    of the second start together and are waited for at once. Overlapped: a receive starts one compute
    action before the one that needs its buffer and is waited for just before use; a send starts as soon
    as its data exists and is waited for one compute action later; so in the steady state both run under
    the neighbouring micro-batch's compute.
    """
    stages = pp * vpp
    lowered = []
    for rank, rank_steps in enumerate(steps):
        actions: list[Action] = []
        if not overlap:
            pending: list[P2POp] = []
            for step in rank_steps:
                exchange = pending + [op for action in step for op in needs(action, rank, pp, stages)]
                if exchange:
                    actions += [Post(tuple(exchange)), Wait(tuple(exchange))]
                actions += step
                pending = [op for action in step for op in produces(action, rank, pp, stages)]
            if pending:
                actions += [Post(tuple(pending)), Wait(tuple(pending))]
            lowered.append(actions)
            continue
        order = [action for step in rank_steps for action in step]
        recvs = [needs(a, rank, pp, stages) for a in order]
        sends = [produces(a, rank, pp, stages) for a in order]
        early = [op for k in range(min(2, len(order))) for op in recvs[k]]
        if early:
            actions.append(Post(tuple(early)))
        for k, action in enumerate(order):
            waits = (sends[k - 2] if k >= 2 else []) + recvs[k]
            if waits:
                actions.append(Wait(tuple(waits)))
            actions.append(action)
            posts = sends[k] + (recvs[k + 2] if k + 2 < len(order) else [])
            if posts:
                actions.append(Post(tuple(posts)))
        tail = [op for k in range(max(0, len(order) - 2), len(order)) for op in sends[k]]
        if tail:
            actions.append(Wait(tuple(tail)))
        lowered.append(actions)
    return lowered


def build_schedule(name: str, pp: int, vpp: int, micro_batches: int, overlap_p2p: bool = False,
                   batch_p2p: bool = False, forward_only: bool = False, paired: bool = False) -> Schedule:
    """The validated schedule ``name``; ``forward_only`` keeps just the forwards (evaluation); ``paired``: its
    steady-state forwards and backwards in pairs (see compute_orders)."""
    if forward_only:
        steps = [[(a,) for step in rank_steps for a in step if a.kind == FORWARD]
                 for rank_steps in compute_orders(name, pp, vpp, micro_batches)]
    else:
        steps = compute_orders(name, pp, vpp, micro_batches, paired)
    schedule = Schedule(name, pp, vpp, micro_batches, overlap_p2p, batch_p2p,
                        tuple(tuple(actions) for actions in lower(steps, pp, vpp, overlap_p2p)),
                        paired and not forward_only)
    validate(schedule, forward_only=forward_only)
    return schedule


# --------------------------------------------------------------------------------------- validation


def in_flight_bound(name: str, pp: int, vpp: int, micro_batches: int, rank: int, paired: bool = False) -> int:
    """Most (micro-batch, chunk) units whose forward has run and whose backward (all of it) has not (see
    :func:`_warm_up` for the paired schedules' longer warm-up)."""
    total = micro_batches * vpp
    if name == "all_forward_all_backward":
        return total
    if name == "interleaved_1f1b":
        return min(total, (pp - rank - 1) * 2 + (vpp - 1) * pp + 1 + paired)
    if name == "zb_h1":  # in flight until W, on every rank as on rank 0 (activations: rank 0 only)
        return min(total, _warm_up(pp, 0, paired) + 1)
    return min(total, _warm_up(pp, rank, paired) + 1)  # 1f1b


def _units(actions: Sequence[Action], chunk: int | None = None) -> list[Compute]:
    """One rank's compute units in order (a pair's forward before its backward), of model ``chunk`` only if given."""
    return [part for a in actions if isinstance(a, (Compute, Pair)) for part in a.parts
            if chunk is None or part.chunk == chunk]


def in_flight(actions: Sequence[Action], chunk: int | None = None) -> int:
    """Peak units in flight in one rank's list, of model ``chunk`` only if given (W, where there is one, ends a
    unit; else B; a pair's forward counts before its backward)."""
    units = _units(actions, chunk)
    split = {(a.micro_batch, a.chunk) for a in units if a.kind == WEIGHT_GRAD}
    live = peak = 0
    for a in units:
        if a.kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind == WEIGHT_GRAD or (a.kind in (BACKWARD, INPUT_GRAD) and (a.micro_batch, a.chunk) not in split):
            live -= 1
    return peak


def graph_copies(actions: Sequence[Action], chunk: int = 0) -> int:
    """Graphed copies of each MoE layer of model ``chunk`` that one rank's list needs (train.moe_cuda_graph): the
    chunk's units in flight, n, so that micro-batch i replays copy i mod n (MoELayer.for_micro_batch) and each
    copy's next forward comes after its last backward (checked: ValueError otherwise). A split backward frees the
    copy at I: a graph replays a layer's whole backward, its weight gradients with it, so W holds none of a graphed
    layer's (the other layers' W still come later)."""
    units = _units(actions, chunk)
    live = n = 0
    for part in units:
        live += 1 if part.kind == FORWARD else -1 if part.kind in (BACKWARD, INPUT_GRAD) else 0
        n = max(n, live)
    done = set()
    for part in units:
        if part.kind == FORWARD and part.micro_batch >= n and (part.micro_batch - n, part.chunk) not in done:
            raise ValueError(f"micro-batch {part.micro_batch}'s forward comes before micro-batch "
                             f"{part.micro_batch - n}'s backward, which replays the same graphed copy")
        if part.kind in (BACKWARD, INPUT_GRAD):
            done.add((part.micro_batch, part.chunk))
    return n


def validate(schedule: Schedule, forward_only: bool = False) -> None:
    """Raise ScheduleError unless the lists can run: compute complete and ordered, transfers matched and
    ordered alike on both ends, activations in flight within the bound, and no deadlock (simulated)."""
    pp, m, stages = schedule.pp, schedule.micro_batches, schedule.stages
    posted: set[tuple[int, P2POp]] = set()
    for rank, actions in enumerate(schedule.ranks):
        _check_computes(schedule, rank, forward_only)
        waited: set[P2POp] = set()
        received: set[Message] = set()
        done: set[Compute] = set()
        for index, action in enumerate(actions):
            where = f"rank {rank} action {index}"
            if isinstance(action, Post):
                for op in action.ops:
                    if (rank, op) in posted:
                        raise ScheduleError(f"{where}: {op} posted twice")
                    if op.send and not any(_produced_by(a, op.message, rank, pp, stages) for a in done):
                        raise ScheduleError(f"{where}: {op} before the compute that produces it")
                    posted.add((rank, op))
            elif isinstance(action, Wait):
                for op in action.ops:
                    if (rank, op) not in posted or op in waited:
                        raise ScheduleError(f"{where}: waits for {op}, which is not in flight")
                    waited.add(op)
                    if not op.send:
                        received.add(op.message)
            else:
                for op in needs(action, rank, pp, stages):
                    if op.message not in received:
                        raise ScheduleError(f"{where}: {action} runs before waiting for {op}")
                done.add(action)
        unwaited = [str(op) for (r, op) in posted if r == rank and op not in waited]
        if unwaited:
            raise ScheduleError(f"rank {rank}: never waits for {', '.join(unwaited)}")
        bound = (m * schedule.vpp if forward_only
                 else in_flight_bound(schedule.name, pp, schedule.vpp, m, rank, schedule.paired))
        if in_flight(actions) > bound:
            raise ScheduleError(f"rank {rank}: {in_flight(actions)} micro-batch chunks in flight, over the "
                                f"schedule's bound {bound}")
    for rank, op in posted:
        if (op.peer, P2POp(not op.send, op.message, rank)) not in posted:
            raise ScheduleError(f"rank {rank}: {op} has no matching {'receive' if op.send else 'send'} on rank "
                                f"{op.peer}")
    for (src, dst), sends in _channels(schedule, send=True).items():
        recvs = _channels(schedule, send=False).get((src, dst), [])
        if sends != recvs:
            first = next(i for i, (a, b) in enumerate(zip(sends + [None], recvs + [None])) if a != b)
            raise ScheduleError(f"channel {src}->{dst}: transfer {first} is {sends[first]} at the sender but "
                                f"{recvs[first]} at the receiver (NCCL matches by order, not by tag)")
    simulate(schedule, lambda rank, action: 1.0)  # raises on a deadlock


def _check_computes(schedule: Schedule, rank: int, forward_only: bool) -> None:
    for pair in (a for a in schedule.computes(rank) if isinstance(a, Pair)):
        f, b = pair.parts
        if f.kind != FORWARD or b.kind not in (BACKWARD, INPUT_GRAD) or (f.micro_batch, f.chunk) == (
                b.micro_batch, b.chunk):
            raise ScheduleError(f"rank {rank}: {pair} must pair a forward with another unit's B or I")
    seen: dict[tuple[str, int, int], int] = {}
    last_of_kind: dict[tuple[str, int], int] = {}
    for index, action in enumerate(schedule.units(rank)):
        key = (action.kind, action.micro_batch, action.chunk)
        if key in seen:
            raise ScheduleError(f"rank {rank}: {action} runs twice")
        if action.kind != FORWARD:
            before = FORWARD if action.kind in (BACKWARD, INPUT_GRAD) else INPUT_GRAD
            if (before, action.micro_batch, action.chunk) not in seen:
                raise ScheduleError(f"rank {rank}: {action} runs before {before}{action.micro_batch}")
            # The distributed optimizer starts a bucket's reduce-scatter at the last micro-batch's gradient:
            # within a chunk, each kind of backward must take the micro-batches in order.
            if last_of_kind.get((action.kind, action.chunk), -1) > action.micro_batch:
                raise ScheduleError(f"rank {rank}: {action} after a later micro-batch's {action.kind}")
            last_of_kind[(action.kind, action.chunk)] = action.micro_batch
        seen[key] = index
    for mb in range(schedule.micro_batches):
        for chunk in range(schedule.vpp):
            kinds = {k for (k, b, c) in seen if (b, c) == (mb, chunk)}
            complete = kinds in ({FORWARD},) if forward_only else kinds in (
                {FORWARD, BACKWARD}, {FORWARD, INPUT_GRAD, WEIGHT_GRAD})
            if not complete:
                raise ScheduleError(f"rank {rank}: micro-batch {mb} chunk {chunk} runs {sorted(kinds)}")


def _produced_by(action: Compute, message: Message, rank: int, pp: int, stages: int) -> bool:
    return any(op.message == message for op in produces(action, rank, pp, stages))


def _channels(schedule: Schedule, send: bool) -> dict[tuple[int, int], list[Message]]:
    """(sender, receiver) -> the messages in the order one end posts them."""
    channels: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            if isinstance(action, Post):
                for op in action.ops:
                    if op.send == send:
                        channels[(rank, op.peer) if send else (op.peer, rank)].append(op.message)
    return channels


# ---------------------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Span:
    rank: int
    action: ComputeAction
    start: float
    end: float


@dataclass
class Timeline:
    """Compute spans of every rank; idle time is whatever they leave uncovered up to the makespan."""

    pp: int
    spans: list[Span] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.spans), default=0.0) - min((s.start for s in self.spans), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.spans if s.rank == rank)

    def bubble(self, rank: int | None = None) -> float:
        """Idle fraction of one rank's compute over the makespan, or the mean over ranks."""
        if rank is None:
            return sum(self.bubble(r) for r in range(self.pp)) / self.pp
        return 1.0 - self.busy(rank) / self.makespan if self.makespan else 0.0


CostFn = Callable[[int, Compute], float]


def simulate(schedule: Schedule, cost: CostFn, latency: float = 0.0,
             post_cost: Callable[[int, Post], float] | None = None) -> Timeline:
    """Run the lists against per-action costs. A compute takes ``cost(rank, action)`` (a pair the sum of its
    halves': what it hides is communication, which the costs leave out); a Post holds its
    rank for ``post_cost(rank, action)`` (default 0: starting a transfer is free); a transfer ends
    ``latency`` after both of its ends have started it and (as on NCCL, strictest) after the transfer
    before it on its channel, or, batched, after the whole batch before it on either rank. A Wait blocks
    its rank until its transfers end. Raises ScheduleError naming the stuck ranks on a deadlock."""
    pp = schedule.pp
    timeline = Timeline(pp)
    pc, clock = [0] * pp, [0.0] * pp
    post_time: dict[tuple[int, P2POp], float] = {}
    end_time: dict[tuple[int, P2POp], float] = {}
    batches: list[list[tuple[float, tuple[P2POp, ...]]]] = [[] for _ in range(pp)]  # per rank, in post order
    batch_of: dict[tuple[int, P2POp], int] = {}
    batch_end: list[list[float]] = [[] for _ in range(pp)]
    channel_last: dict[tuple[int, int], float] = defaultdict(float)
    channel_next: dict[tuple[int, int], list[tuple[int, P2POp]]] = defaultdict(list)

    def partner(rank: int, op: P2POp) -> tuple[int, P2POp]:
        return op.peer, P2POp(not op.send, op.message, rank)

    def resolve() -> bool:
        """Fix the end times that have become known; True if any did."""
        changed = False
        if schedule.batch_p2p:
            for rank in range(pp):
                while len(batch_end[rank]) < len(batches[rank]):
                    index = len(batch_end[rank])
                    posted_at, ops = batches[rank][index]
                    start = max(posted_at, batch_end[rank][-1] if index else 0.0)
                    ends = []
                    for op in ops:
                        other = partner(rank, op)
                        if other not in batch_of:
                            break
                        other_index = batch_of[other]
                        if other_index > len(batch_end[other[0]]):
                            break  # the batch before the partner's has not ended yet
                        other_start = max(batches[other[0]][other_index][0],
                                          batch_end[other[0]][other_index - 1] if other_index else 0.0)
                        ends.append(max(start, other_start) + latency)
                    else:
                        finish = max(ends, default=start)
                        batch_end[rank].append(finish)
                        for op in ops:
                            end_time[(rank, op)] = finish
                        changed = True
                        continue
                    break
        else:
            for channel, queue in channel_next.items():
                while queue:
                    rank, op = queue[0]
                    other = partner(rank, op)
                    if other not in post_time:
                        break
                    finish = max(post_time[(rank, op)], post_time[other], channel_last[channel]) + latency
                    end_time[(rank, op)] = end_time[other] = channel_last[channel] = finish
                    queue.pop(0)
                    changed = True
        return changed

    while any(pc[r] < len(schedule.ranks[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):
            actions = schedule.ranks[rank]
            while pc[rank] < len(actions):
                action = actions[pc[rank]]
                if isinstance(action, (Compute, Pair)):
                    duration = sum(cost(rank, part) for part in action.parts)
                    timeline.spans.append(Span(rank, action, clock[rank], clock[rank] + duration))
                    clock[rank] += duration
                elif isinstance(action, Post):
                    clock[rank] += post_cost(rank, action) if post_cost else 0.0
                    batches[rank].append((clock[rank], action.ops))
                    for op in action.ops:
                        post_time[(rank, op)] = clock[rank]
                        batch_of[(rank, op)] = len(batches[rank]) - 1
                        if op.send:  # a channel's queue holds its sends; each meets its receive there
                            channel_next[(rank, op.peer)].append((rank, op))
                else:
                    if not all((rank, op) in end_time for op in action.ops):
                        break
                    clock[rank] = max([clock[rank]] + [end_time[(rank, op)] for op in action.ops])
                pc[rank] += 1
                progressed = True
        if not progressed and not resolve():
            stuck = "; ".join(f"rank {r} at {schedule.ranks[r][pc[r]]}" for r in range(pp)
                              if pc[r] < len(schedule.ranks[r]))
            raise ScheduleError(f"{schedule.name}: deadlock ({stuck})")
    return timeline


def predicted_bubble(name: str, pp: int, vpp: int, micro_batches: int) -> float | None:
    """The textbook bubble fraction at F = B / 2 (None where there is no closed form here)."""
    if name == "1f1b":
        return (pp - 1) / (micro_batches + pp - 1)
    if name == "interleaved_1f1b":
        return (pp - 1) / (vpp * micro_batches + pp - 1)
    return None


# ------------------------------------------------------------------------------------------ rendering


def render(schedule: Schedule, timeline: Timeline, width: int = 96) -> str:
    """Text timeline: one row per rank (F/B/I/W, P a pair, a chunk > 0 in lower case; '.' idle), its action
    order, and the bubble fractions."""
    t0 = min((s.start for s in timeline.spans), default=0.0)
    scale = timeline.makespan / width if timeline.makespan else 1.0
    lines = [f"{schedule.name}: PP={schedule.pp} VPP={schedule.vpp} micro-batches={schedule.micro_batches} "
             f"overlap_p2p_comm={schedule.overlap_p2p} batch_p2p_comm={schedule.batch_p2p}"
             + (" paired (overlap_moe_expert_parallel_comm)" if schedule.paired else "")]
    for rank in range(schedule.pp):
        row = ["."] * width
        for span in (s for s in timeline.spans if s.rank == rank):
            letter = span.action.kind if _first_chunk(span.action) else span.action.kind.lower()
            for col in range(int((span.start - t0) / scale + 0.5), int((span.end - t0) / scale + 0.5)):
                row[min(col, width - 1)] = letter
        lines.append(f"rank {rank} |{''.join(row)}| bubble {timeline.bubble(rank):.3f}")
    for rank in range(schedule.pp):
        lines.append(f"rank {rank} order: {' '.join(str(a) for a in schedule.computes(rank))}")
    formula = None if schedule.paired else predicted_bubble(schedule.name, schedule.pp, schedule.vpp,
                                                             schedule.micro_batches)
    lines.append(f"bubble (mean over ranks): {timeline.bubble():.4f}"
                 + ("" if formula is None else f"; textbook at B = 2F: {formula:.4f}")
                 + "; peak micro-batch chunks in flight per rank: "
                 + ", ".join(str(in_flight(actions)) for actions in schedule.ranks))
    return "\n".join(lines)


def _first_chunk(action: ComputeAction) -> bool:
    return all(part.chunk == 0 for part in action.parts)


def draw(timelines: Sequence[tuple[str, Timeline]], path: str, unit: str = "ms") -> None:
    """One panel per timeline, one lane per rank; bars coloured by action kind and labelled by micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {FORWARD: "tab:blue", BACKWARD: "tab:green", INPUT_GRAD: "tab:olive", WEIGHT_GRAD: "tab:purple",
              PAIR: "tab:red"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(14, 0.3 + 0.55 * sum(t.pp + 1 for _, t in timelines)),
                             squeeze=False)
    for ax, (title, timeline) in zip(axes[:, 0], timelines):
        t0 = min((s.start for s in timeline.spans), default=0.0)
        for span in timeline.spans:
            left, width = span.start - t0, span.end - span.start
            ax.broken_barh([(left, width)], (span.rank - 0.4, 0.8), color=colors[span.action.kind],
                           alpha=1.0 if _first_chunk(span.action) else 0.6, edgecolor="white", linewidth=0.5)
            ax.text(left + width / 2, span.rank, "+".join(str(part.micro_batch) for part in span.action.parts),
                    ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(timeline.pp), [f"rank {r}" for r in range(timeline.pp)])
        ax.invert_yaxis()
        ax.set_title(f"{title}: makespan {timeline.makespan:.1f} {unit}, bubble {timeline.bubble():.3f}", fontsize=9)
    axes[-1, 0].set_xlabel(f"{unit}; F blue, B green, I olive, W purple, F+B pair red; lighter: chunk 1+")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
