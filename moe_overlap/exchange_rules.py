"""The MoE exchange's rules: which planning, transport, device, expert-TP size and CUDA-graph capture run together.

One table (``NEEDS``: what each transport needs) and one function per rule, each refusing in one message, read by
config validation (before any rank starts), the transport choice (distributed/a2a.py, TransportSelector, through
:func:`choose_exchange`) and graph capture (layers/moe.py, capture_moe_layers). README's "What runs where" table
is printed from them (:func:`what_runs_where`). Pure data and functions, no torch: config and distributed/ both
import it.
"""

from __future__ import annotations

from dataclasses import dataclass

PLANNINGS = ("auto", "host", "device")
TRANSPORTS = ("auto", "nccl", "copy_engine", "sm_push", "gloo")
PLANNING, TRANSPORT, GRAPH = "overlap.moe_planning", "overlap.moe_transport", "train.moe_cuda_graph"


@dataclass(frozen=True)
class TransportNeeds:
    """What a transport (``overlap.moe_transport``) needs to run."""

    sizes: tuple[str, ...]  # the planning modes whose sizes it takes (host: fetched counts; device: on the GPU)
    device: str  # "cuda" or "cpu"
    one_host: bool  # through symmetric memory: every EP rank on one host, with peer access
    one_rank: str  # what it does over a group of one rank (the pipeline forced at EP=1: a measurement)


NEEDS: dict[str, TransportNeeds] = {
    "nccl": TransportNeeds(("host",), "cuda", False, "the group's copy"),
    "copy_engine": TransportNeeds(("host", "device"), "cuda", True, "its own memory"),  # device: wire rows in slots
    "sm_push": TransportNeeds(("device",), "cuda", True, "its own memory"),
    "gloo": TransportNeeds(("host", "device"), "cpu", False, "the group's copy"),  # device: the twin of sm_push
}


@dataclass(frozen=True)
class Refusal:
    """A setting that cannot run: the field, its value and why (``str``: the config error's one line), and the
    short form README's table prints."""

    field: str
    value: object
    reason: str
    label: str

    def __str__(self) -> str:
        return f"{self.field}={self.value!r}: {self.reason}"


def _quoted(names) -> str:
    names = [repr(n) for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _runs_on(device_type: str) -> tuple[str, ...]:
    return ("auto",) + tuple(name for name, needs in NEEDS.items() if needs.device == device_type)


# ------------------------------------------------------------------------------------------------ the rules
def value_refusal(field: str, value: str, allowed: tuple[str, ...]) -> Refusal | None:
    """A planning or transport name that does not exist."""
    if value in allowed:
        return None
    return Refusal(field, value, f"allowed {', '.join(allowed)}", "refused: unknown")


def device_refusal(transport: str, device_type: str) -> Refusal | None:
    """A transport runs on one kind of device: nccl, copy_engine and sm_push on CUDA, gloo on the CPU."""
    if transport == "auto" or NEEDS[transport].device == device_type:
        return None
    what = "needs CUDA" if NEEDS[transport].device == "cuda" else "is the CPU transport"
    where = "the CPU" if device_type == "cpu" else "CUDA"
    return Refusal(TRANSPORT, transport, f"{what}: it cannot run on {where}; use {_quoted(_runs_on(device_type))} "
                   f"on device {device_type!r}", "refused: " + ("needs CUDA" if device_type == "cpu" else "CPU only"))


def one_host_refusal(transport: str, symm_reason: str | None) -> Refusal | None:
    """copy_engine and sm_push move rows through symmetric memory: every EP rank on one host, with peer access
    (``symm_reason``: why symmetric memory cannot run here, None when it can)."""
    if transport == "auto" or not NEEDS[transport].one_host or symm_reason is None:
        return None
    return Refusal(TRANSPORT, transport, f"moves rows through symmetric memory, so {transport!r} cannot run: "
                   f"{symm_reason}; use 'auto' or 'nccl'", "refused: one host")


def sizes_refusal(planning: str, transport: str) -> Refusal | None:
    """A transport takes the sizes of one planning mode (gloo of both: host sizes, or the device routes of the
    sm_push twin)."""
    if "auto" in (planning, transport) or planning in NEEDS[transport].sizes:
        return None
    takes = NEEDS[transport].sizes[0]
    fitting = [name for name, needs in NEEDS.items() if planning in needs.sizes]
    return Refusal(TRANSPORT, transport, f"takes {takes} sizes: it cannot run with {PLANNING}={planning} (use "
                   f"{PLANNING}={takes} or auto, or {TRANSPORT}={' or '.join(fitting)} or auto)",
                   f"refused: takes {takes} sizes")


def host_sized(planning: str, transport: str) -> bool:
    """The exchange takes sizes fetched to the host, whose sync a CUDA graph cannot hold: host planning, or with
    ``planning`` auto a transport whose first sizes are the host's (choose_exchange picks them)."""
    if planning == "host" or transport == "auto":
        return planning == "host"
    return NEEDS[transport].sizes[0] == "host" if planning == "auto" else "device" not in NEEDS[transport].sizes


def slots_refusal(planning: str, transport: str, once_per_rank: bool, overflow_chunk: bool) -> Refusal | None:
    """copy_engine with device planning moves each token's wire rows in slots of a micro-batch's tokens per (rank,
    chunk) target, whose ranges do not depend on the routing (layers/device_plan.py): it needs each token once per
    rank, and has no overflow chunk."""
    if planning != "device" or transport != "copy_engine":
        return None
    if not once_per_rank:
        return Refusal(TRANSPORT, transport, f"with {PLANNING}=device needs overlap.moe_dispatch_once_per_rank=true "
                       "(the copy engines move each token's wire rows in slots)", "needs once per rank")
    if overflow_chunk:
        return Refusal(TRANSPORT, transport, f"with {PLANNING}=device: not implemented yet with the overflow chunk "
                       "(overlap.moe_overflow_capacity_factor and more than one chunk)", "refused: not implemented yet")
    return None


def device_planning_refusal(symm_reason: str | None) -> Refusal | None:
    """Device planning on CUDA takes the one CUDA transport with device sizes, sm_push (one host)."""
    if symm_reason is None:
        return None
    push = next(name for name, needs in NEEDS.items() if needs.sizes == ("device",))
    return Refusal(PLANNING, "device", f"needs {TRANSPORT}={push!r}, which cannot run: {symm_reason}; use "
                   f"{PLANNING}=auto or host", "refused: one host")


def expert_tp_refusal(planning: str, expert_tp: int) -> Refusal | None:
    """Device planning with expert-TP > 1 is not built: the expert-TP gather takes host sizes (auto plans on the
    host there)."""
    if planning != "device" or expert_tp == 1:
        return None
    return Refusal(PLANNING, planning, "not implemented yet with parallel.expert_tensor_parallel_size > 1 (the "
                   f"expert-TP gather takes host sizes); use {PLANNING}=host or auto", "refused: not implemented yet")


def graph_refusal(pipelined: bool, planning: str, exchanging: bool) -> Refusal | None:
    """A CUDA graph of a MoE layer holds no host sync and no ProcessGroupNCCL all-to-all (its capture fails with
    cudaErrorStreamCaptureImplicit): the device-planned pipeline, or no exchange at all (one EP and expert-TP
    rank). ``planning``: requested (config) or chosen (a built layer)."""
    if not exchanging or (pipelined and planning == "device"):
        return None
    return Refusal(GRAPH, True, f"needs overlap.moe_pipeline=true with {PLANNING}=device, or one EP rank (a graph "
                   "cannot hold the host-planned paths' host sync or an NCCL all-to-all)", "no: host sync")


def graph_device_refusal(device_type: str) -> Refusal | None:
    """CUDA graphs need CUDA."""
    if device_type == "cuda":
        return None
    return Refusal(GRAPH, True, f"CUDA graphs need train.device=cuda; the device is {device_type!r}", "no: CPU")


# ------------------------------------------------------------------------------------------ who reads them
def config_refusal(pipelined: bool, planning: str, transport: str, expert_tp: int, exchanging: bool,
                   graphed: bool) -> Refusal | None:
    """The rules config validation applies before any rank starts, independent of the world and device:
    planning and transport agree on sizes, device planning with expert-TP, graphs of layers that exchange."""
    return (sizes_refusal(planning, transport) or expert_tp_refusal(planning, expert_tp)
            or (graph_refusal(pipelined, planning, exchanging) if graphed else None))


def world_refusal(transport: str, device_type: str, graphed: bool) -> Refusal | None:
    """The rules config validation applies once the device is known."""
    return device_refusal(transport, device_type) or (graph_device_refusal(device_type) if graphed else None)


def choose_exchange(planning: str, transport: str, device_type: str, symm_reason: str | None,
                    expert_tp: int = 1) -> tuple[str, str, str]:
    """(planning, transport, why) for ``overlap.moe_planning`` and ``overlap.moe_transport``; ``symm_reason`` says
    why symmetric memory cannot run here (None: it can). auto: sm_push (device sizes) or copy_engine (host sizes,
    which expert-TP > 1 takes) on one host with peer access, else nccl; gloo on the CPU. A combination that cannot
    run raises ValueError with the rule's message."""
    refusal = (value_refusal(PLANNING, planning, PLANNINGS) or value_refusal(TRANSPORT, transport, TRANSPORTS)
               or device_refusal(transport, device_type) or one_host_refusal(transport, symm_reason)
               or sizes_refusal(planning, transport) or expert_tp_refusal(planning, expert_tp))
    if refusal is None and device_type == "cuda" and transport == "auto" and planning == "device":
        refusal = device_planning_refusal(symm_reason)
    if refusal is not None:
        raise ValueError(str(refusal))
    if device_type != "cuda":
        planned = "host" if planning == "auto" else planning
        return planned, "gloo", "the CPU" + (": the twin of sm_push, the same device routes moved by gloo"
                                             if planned == "device" else "")
    why = "requested"
    if transport == "auto" and symm_reason is None:
        host_sized = planning == "host" or (planning == "auto" and expert_tp > 1)
        transport = "copy_engine" if host_sized else "sm_push"
        why = "every EP rank shares one host with peer access" + (" (expert-TP > 1 takes host sizes)"
                                                                   if planning == "auto" and expert_tp > 1 else "")
    elif transport == "auto":
        transport, why = "nccl", f"symmetric memory cannot run: {symm_reason}"
    return NEEDS[transport].sizes[0] if planning == "auto" else planning, transport, why


# ---------------------------------------------------------------------------------------------- the README
PLACES = {  # column: (device type, why symmetric memory cannot run, EP ranks)
    "CPU (gloo ranks)": ("cpu", "the device is the CPU", 2),
    "one GPU (EP=1)": ("cuda", "the group has one rank", 1),
    "GPUs of one host": ("cuda", None, 2),
    "across hosts": ("cuda", "the ranks span 2 hosts", 2),
}


def _cell(planning: str, transport: str, place: str) -> str:
    device_type, symm_reason, ranks = PLACES[place]
    refusal = (sizes_refusal(planning, transport) or device_refusal(transport, device_type)
               or (one_host_refusal(transport, symm_reason) if ranks > 1 else None))
    if refusal is not None:
        return refusal.label
    if ranks == 1:
        return f"the local path (the pipeline forced: {NEEDS[transport].one_rank})"
    return "yes (the twin of sm_push)" if transport == "gloo" and planning == "device" else "yes"


def what_runs_where() -> str:
    """README's "What runs where" table, from the rules: each (planning, transport) in each place, with expert-TP
    > 1 and CUDA graphs of the layer; a combination refused everywhere by one rule is one cell."""
    places = list(PLACES)
    lines = ["| planning | transport | " + " | ".join(places) + " | expert-TP > 1 | CUDA graph (EP > 1) |",
             "| --- " * (len(places) + 4) + "|"]
    for planning in PLANNINGS[1:]:
        for transport in TRANSPORTS[1:]:
            cells = [_cell(planning, transport, place) for place in places]
            if sizes_refusal(planning, transport) is not None:
                cells = [cells[0]] + [""] * (len(places) + 1)
            else:
                etp = expert_tp_refusal(planning, 2)
                graph = (graph_device_refusal(NEEDS[transport].device)
                         or graph_refusal(True, planning, exchanging=True))
                cells += ["yes" if etp is None else etp.label, "yes" if graph is None else graph.label]
            lines.append(f"| {planning} | {transport} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
