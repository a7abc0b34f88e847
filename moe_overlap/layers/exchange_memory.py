"""What the MoE exchange holds per rank, as ``moe-overlap info`` prints it: the device-planned exchange's static
sizes from the functions its planner allocates with (device_plan.py: ``chunk_bounds_rows``, ``receive_rows``,
``region_rows``; the transport's ``REGIONS``), for a bound (``overlap.moe_expert_rank_capacity_factor``) or the
worst case (null). Per layer call (one micro-batch): each chunk's receive tensor, the compact receive buffer they
are copied out of (inside a symmetric region), and the stash the backward keeps (each chunk's tensor and its fc1
output; with ``overlap.moe_overflow_capacity_factor`` the overflow chunk is one more such tensor); per model: the
transport's symmetric regions, which every MoE layer shares. A host-planned exchange sizes
its buffers exactly per call: no bound to print. With ``overlap.moe_dispatch_once_per_rank`` the regions hold wire
rows (a token once per chunk and rank, its copies' grouped rows and probs beside it: layers/wire_rows.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_overlap.config import Config
from moe_overlap.config.defaults import pairs_on_streams
from moe_overlap.distributed.a2a import REGIONS
from moe_overlap.exchange_rules import choose_exchange
from moe_overlap.layers.device_plan import (chunk_bounds_rows, overflow_chunk_rows, overflow_chunks, planned_factors,
                                            receive_rows, region_rows, wire_receive_rows)
from moe_overlap.layers.exchange_plan import chunk_bounds
from moe_overlap.layers.paged_stash import aligned_bytes, page_rows_for, stash_pages
from moe_overlap.layers.wire_rows import copies_per_wire_row, wire_row_bytes
from moe_overlap.precision import DTYPES


@dataclass(frozen=True)
class ExchangeMemory:
    """One rank's device-planned exchange sizes for one layer call of ``rows`` token copies (T x k) over ``ranks``
    EP ranks; ``factor`` None: the worst case."""

    factor: float | None
    chunk_rows: list[int]  # each chunk's receive tensor (and stashed rows), the overflow chunk's last if any
    receive_rows: int  # the compact receive buffer, its spare row included
    region_bytes: int  # each of the REGIONS symmetric regions
    row_bytes: int  # a row that moves: hidden x element size
    # a stashed row: its input and its fc1 output (hidden + 2 x expert ffn, x element size); with each token once per
    # rank also its output (hidden more: the probs' gradient is made on the expert side from it)
    stash_row_bytes: int

    @property
    def chunk_bytes(self) -> int:
        return sum(self.chunk_rows) * self.row_bytes

    @property
    def stash_bytes(self) -> int:
        return sum(self.chunk_rows) * self.stash_row_bytes


def exchange_memory(ranks: int, rows: int, chunk_experts: list[tuple[int, int]], factor: float | None,
                    hidden: int, expert_ffn: int, element_bytes: int, outputs: bool = False,
                    overflow_factor: float | None = None) -> ExchangeMemory:
    """The sizes the device planner allocates for a layer call (dropless: ``rows`` = T x k permuted rows);
    ``outputs``: the stash keeps the expert outputs too (each token once per rank); ``overflow_factor``: the
    overflow chunk's (as planned: none without a bound or with one chunk, where its room is the chunk's)."""
    configured, (factor, overflow_factor) = factor, planned_factors(len(chunk_experts), factor, overflow_factor)
    row_bytes = hidden * element_bytes
    received = receive_rows(ranks, rows, chunk_experts, factor, overflow_factor)
    stash_row = (hidden * (2 if outputs else 1) + 2 * expert_ffn) * element_bytes
    chunk_rows = chunk_bounds_rows(ranks, rows, chunk_experts, factor)
    if overflow_factor is not None:
        chunk_rows.append(overflow_chunk_rows(ranks, rows, overflow_factor))
    return ExchangeMemory(configured, chunk_rows, received, region_rows(received, rows) * row_bytes, row_bytes,
                          stash_row)


def wire_region_bytes(ranks: int, tokens: int, topk: int, chunk_experts: list[tuple[int, int]],
                      factor: float | None, hidden: int, element_bytes: int,
                      overflow_factor: float | None = None, slots: bool = False) -> int:
    """moe_dispatch_once_per_rank: each symmetric region of the device-planned exchange, in bytes: its compact
    receive buffer of wire rows, or a rank's T x min(k, chunks x EP) wire rows back (and its overflow rows, with the
    overflow chunk), of the widest wire row. ``slots`` (the copy engines, layers/device_plan.py): a slot of T rows
    from and to every (rank, chunk), whatever the bound, and the spare row."""
    factor, overflow_factor = planned_factors(len(chunk_experts), factor, overflow_factor)
    received = wire_receive_rows(ranks, tokens * topk, tokens, chunk_experts, factor, overflow_factor)
    sent = tokens * min(topk, len(chunk_experts) * ranks) + overflow_chunk_rows(ranks, tokens * topk, overflow_factor)
    if slots:
        received, sent = ranks * len(chunk_experts) * tokens + 1, ranks * len(chunk_experts) * tokens
    return region_rows(received, sent) * wire_row_bytes(hidden * element_bytes,
                                                        copies_per_wire_row(topk, chunk_experts))


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def rows_per_call(cfg: Config) -> int:
    """T x k: the token copies one rank routes in a MoE layer call (its CP rank's sequence, its TP block of it
    under sequence parallelism), which is also what a rank receives with balanced routing."""
    m, p = cfg.model, cfg.parallel
    shards = p.context_parallel_size * (p.tensor_model_parallel_size if p.sequence_parallel else 1)
    return cfg.train.micro_batch_size * m.seq_length // shards * m.moe_router_topk


def paged_stash_size(cfg: Config, calls: int) -> tuple[int, int, int, int]:
    """``overlap.moe_paged_stash_factor``'s pool for ``calls`` MoE layer calls in flight on a rank, as
    (rows, stashes, row bytes, page rows) for layers/paged_stash.PagedStash: factor x T x k rows a call; a stash per
    chunk (the overflow chunk too) and token slice; a row of the chunk's rows, their fc1 output and (each token once
    per rank) their outputs, in the training precision (FP8 rows are narrower)."""
    m, o = cfg.model, cfg.overlap
    chunks = len(chunk_bounds(m.num_moe_experts // cfg.parallel.expert_model_parallel_size, o.moe_pipeline_chunks))
    element = DTYPES[cfg.train.precision].itemsize
    widths = [m.hidden_size, 2 * m.expert_ffn_hidden_size] + ([m.hidden_size] if o.moe_dispatch_once_per_rank else [])
    rows = math.ceil(o.moe_paged_stash_factor * rows_per_call(cfg) * calls)
    stashes = calls * (chunks + overflow_chunks(o)) * o.moe_token_slices  # the overflow chunk's too
    return (rows, stashes, sum(aligned_bytes(w * element) for w in widths),
            page_rows_for(rows_per_call(cfg) // (chunks * o.moe_token_slices)))


def describe_exchange_memory(cfg: Config, device_type: str, calls: int = 1) -> list[str]:
    """``info``'s lines on the MoE exchange's memory per rank for ``cfg`` on ``device_type`` (auto planning
    resolved as there, symmetric memory assumed to run: every EP rank on one host); none for a dense model."""
    m, o, p = cfg.model, cfg.overlap, cfg.parallel
    if m.num_moe_experts is None:
        return []
    ep, etp = p.expert_model_parallel_size, cfg.expert_tensor_parallel_size
    if ep * etp == 1:
        return ["MoE exchange: one expert rank, nothing exchanged"]
    planning, transport = "host", None
    if o.moe_pipeline:
        symm_reason = None if device_type == "cuda" else "the device is the CPU"
        planning, transport, _ = choose_exchange(o.moe_planning, o.moe_transport, device_type, symm_reason, etp)
    if planning == "host":
        regions = ("; copy_engine's symmetric regions: the worst case, EP x T x k rows" if transport == "copy_engine"
                   else "")
        return [f"MoE exchange: host-planned, its buffers sized exactly per layer call (no bound){regions}"]
    if m.moe_pad_expert_input_to_capacity:
        return ["MoE exchange: device-planned, padded to capacity: every buffer exactly EP x capacity rows per "
                "local expert, no bound"]
    rows = rows_per_call(cfg)
    chunk_experts = chunk_bounds(m.num_moe_experts // ep, o.moe_pipeline_chunks)
    factors = [None] + ([o.moe_expert_rank_capacity_factor] if o.moe_expert_rank_capacity_factor else [])
    outputs = bool(o.moe_dispatch_once_per_rank)
    sizes = [exchange_memory(ep, rows, chunk_experts, factor, m.hidden_size, m.expert_ffn_hidden_size,
                             DTYPES[cfg.train.precision].itemsize, outputs, o.moe_overflow_capacity_factor)
             for factor in factors]
    layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    chunks = len(chunk_experts)
    lines = [f"MoE exchange per rank (device-planned, EP {ep}, {chunks} chunk{'s' * (chunks > 1)}): per layer call "
             f"R = {rows:,} token copies of {_size(sizes[0].row_bytes)}",
             f"  {'capacity factor':<27}{'chunk tensors':<26}{'receive buffer':<17}{'stash for backward':<21}"
             "symmetric regions"]
    for size in sizes:
        name = "null (worst case, EP x R)" if size.factor is None else f"{size.factor:g}"
        lines.append(f"  {name:<27}{f'{sum(size.chunk_rows):,} rows {_size(size.chunk_bytes)}':<26}"
                     f"{f'{size.receive_rows:,} rows':<17}{_size(size.stash_bytes):<21}"
                     f"{REGIONS} x {_size(size.region_bytes)}")
    if o.moe_overflow_capacity_factor is not None and o.moe_expert_rank_capacity_factor is not None:
        factor, overflow = o.moe_expert_rank_capacity_factor, o.moe_overflow_capacity_factor
        lines.append(f"  overlap.moe_overflow_capacity_factor={overflow:g}: the {factor:g} row holds "
                     + (f"the overflow chunk's {sizes[-1].chunk_rows[-1]:,} rows too" if chunks > 1 else
                        f"its room in the one chunk's bound too ({factor + overflow:g} x R: no overflow chunk)"))
    if o.moe_dispatch_once_per_rank:  # the chunk tensors and the stash stay the copies'
        slots = transport == "copy_engine"  # device-planned: wire rows in slots of T, whatever the bound
        regions = [_size(wire_region_bytes(ep, rows // m.moe_router_topk, m.moe_router_topk, chunk_experts, factor,
                                           m.hidden_size, DTYPES[cfg.train.precision].itemsize,
                                           o.moe_overflow_capacity_factor, slots)) for factor in factors]
        lines.append(f"  overlap.moe_dispatch_once_per_rank: symmetric regions of wire rows {REGIONS} x "
                     + " / ".join(regions) + (" (the copy engines' slots of T rows per rank and chunk)" * slots))
    lines += [f"  per layer call and micro-batch (the stash: the chunk tensors and their fc1 outputs"
              f"{', and their outputs' if outputs else ''}, {_size(sizes[0].stash_row_bytes)} a row;",
              "  the receive buffer lies in a region); the regions are shared by "
              + (f"the {layers} MoE layers" if p.pipeline_model_parallel_size == 1 else "the stage's MoE layers")]
    if pairs_on_streams(cfg):  # each graphed copy's exchange through its own regions (TransportSelector.twin)
        lines.append("  paired on two streams (graphed): the symmetric regions above once per graphed copy of the MoE "
                     "layers (2 at PP=1; under PP a stage's micro-batches in flight, rounded up to even)")
    if o.moe_paged_stash_factor is not None:
        pooled, stashes, row_bytes, page_rows = paged_stash_size(cfg, calls)
        pool_bytes = (stash_pages(pooled, stashes, page_rows) + 1) * page_rows * row_bytes
        lines.append(f"  overlap.moe_paged_stash_factor={o.moe_paged_stash_factor:g}: no stash per layer call; one "
                     f"pool of {_size(pool_bytes)} per rank instead ({pooled:,} rows of {_size(row_bytes)} for the "
                     f"{calls} MoE layer calls in flight, and a page of {page_rows} rows per stash)")
    return lines
