"""Whether pairs of micro-batches on two CUDA streams fit a GPU, which ``overlap_moe_expert_parallel_comm: auto``
asks on one host with peer access, or one GPU (training/run_setup.py). On two streams each half of a pair replays
its own graphed copy of the MoE layers, so a rank holds two graph sets and two micro-batches' other activations
where unpaired it holds one of each. Estimated from the config, as the allocator reserves it:

    model state (state_memory.py) + 2 x (a graph set + a micro-batch's dense activations)

A graph set is its MoE layer calls' stashes (layers/exchange_memory.py, sized by the bound or the worst case) and
``tuning.STREAMS_GRAPH_SPARE_CALLS`` calls' more of temporaries; the dense activations are
``tuning.STREAMS_DENSE_WIDTHS`` hidden-wide tensors per token and layer. tuning.py gives the reserved memory measured
on streams that those constants were set against."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from moe_overlap import tuning
from moe_overlap.config import Config
from moe_overlap.config.defaults import pairs_on_streams, streams_off_reason
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.layers.exchange_memory import exchange_memory, rows_per_call
from moe_overlap.layers.exchange_plan import chunk_bounds
from moe_overlap.precision import DTYPES
from moe_overlap.training.state_memory import state_bytes


@dataclass(frozen=True)
class StreamsBytes:
    state: int  # the model state (weights, fp32 gradients, the optimizer's shard)
    graph_set: int  # one graphed copy of the MoE layers: their stashes and temporaries
    dense: int  # one micro-batch's activations outside the MoE layers' graphs

    @property
    def total(self) -> int:
        return self.state + 2 * (self.graph_set + self.dense)


def streams_bytes(cfg: Config, mesh: Mesh) -> StreamsBytes:
    """This rank's estimate on two streams (``mesh`` may be ``Mesh.planned``), at PP=1 with a device-planned exchange
    or none (where auto pairs on streams)."""
    m, o = cfg.model, cfg.overlap
    element = DTYPES[cfg.train.precision].itemsize
    rows = rows_per_call(cfg)
    chunk_experts = chunk_bounds(m.num_moe_experts // cfg.parallel.expert_model_parallel_size, o.moe_pipeline_chunks)
    stash = exchange_memory(cfg.parallel.expert_model_parallel_size, rows, chunk_experts,
                            o.moe_expert_rank_capacity_factor, m.hidden_size, m.expert_ffn_hidden_size, element,
                            bool(o.moe_dispatch_once_per_rank), o.moe_overflow_capacity_factor).stash_bytes
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    tokens = rows // m.moe_router_topk
    return StreamsBytes(state_bytes(cfg, mesh).total, (moe_layers + tuning.STREAMS_GRAPH_SPARE_CALLS) * stash,
                        m.num_layers * tokens * m.hidden_size * element * tuning.STREAMS_DENSE_WIDTHS)


def allocator_budget(total: int, fraction: float) -> int:
    """What torch's allocator can reserve on a GPU of ``total`` bytes: the process's fraction of it
    (``torch.cuda.set_per_process_memory_fraction``), less what sits outside the allocator."""
    return min(int(total * fraction), total - tuning.OUTSIDE_ALLOCATOR_BYTES)


def streams_fit(need: StreamsBytes, budget: int) -> tuple[bool, str]:
    """Pairs on two streams where the estimate fits ``tuning.STREAMS_MEMORY_MARGIN`` of the allocator's budget; and
    why, in GiB."""
    gib, room = 2**30, tuning.STREAMS_MEMORY_MARGIN * budget
    shown = (f"{need.total / gib:.1f} GiB estimated (state {need.state / gib:.1f} + 2 x (graph set "
             f"{need.graph_set / gib:.1f} + activations {need.dense / gib:.1f})) against {room / gib:.1f} "
             f"({tuning.STREAMS_MEMORY_MARGIN:g} of the allocator's {budget / gib:.1f})")
    if need.total > room:
        return False, (f"pairs on two streams would not fit: {shown}; one micro-batch at a time (set "
                       "overlap.overlap_moe_expert_parallel_comm=true with train.moe_cuda_graph=true to pair anyway)")
    return True, (f"each pair's halves side by side on two CUDA streams, their MoE layers from graphs: measured "
                  f"fastest there (tuning.py); {shown}")


def describe_streams_memory(cfg: Config, layout: MeshLayout) -> list[str]:
    """``info``'s line on pairs on two streams where auto may choose them (or they are asked for): the estimate on
    the first rank, and the room auto wants on an 80 GB H100 and a 141 GB H200."""
    o = cfg.overlap
    auto = o.overlap_moe_expert_parallel_comm == "auto" and streams_off_reason(cfg) is None
    if cfg.model.num_moe_experts is None or not (auto or pairs_on_streams(cfg)) or layout.pp > 1:
        return []
    need = streams_bytes(cfg, Mesh.planned(layout, 0))
    gib = 2**30
    rooms = ", ".join(f"{name} {tuning.STREAMS_MEMORY_MARGIN * allocator_budget(total, 1.0) / gib:.1f}"
                      for name, total in (("an 80 GB H100", int(79.2 * gib)), ("an H200", int(139.8 * gib))))
    why = ("auto: where one host with peer access runs the exchange, or one GPU, and this fits" if auto
           else "asked for")
    return [f"pairs on two streams ({why}): {need.total / gib:.1f} GiB estimated per rank = state "
            f"{need.state / gib:.1f} + 2 x (graph set {need.graph_set / gib:.1f} + activations "
            f"{need.dense / gib:.1f}) (training/streams_memory.py); room: {rooms} GiB"]


@contextlib.contextmanager
def naming_streams_on_oom(on_streams: bool) -> Iterator[None]:
    """Out of memory with pairs on two streams (their second graph set is what an estimate can miss): the error
    says so first, and how to run one micro-batch at a time."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        if not on_streams:
            raise
        raise torch.OutOfMemoryError(
            "out of memory with pairs on two streams (two sets of MoE-layer graphs; auto chooses them where "
            "training/streams_memory.py's estimate fits the GPU): set overlap.overlap_moe_expert_parallel_comm=false "
            f"to run one micro-batch at a time. {err}") from err
