"""What ``auto`` means for the MoE exchange's switches, resolved once when a config is validated so that every rule,
layer and log sees plain values: the measured fastest path (tuning.py says where each choice was measured), or what
a switch the user set needs to run.

    overlap.moe_pipeline=auto   the pipeline where there is an exchange (EP x expert-TP > 1) or where a field that
                                only the pipeline reads is set; otherwise (one expert rank, or
                                train.expert_wgrad_pairs, which the pipeline's chunks replace) the serial exchange
    overlap_moe_expert_parallel_comm with an exchange
                                turns the pipeline on (auto), leaves moe_planning auto to the transport (device
                                planning where sm_push runs, its pushes on the side stream beside the other
                                micro-batch under gemm_sm_carveout auto: the fastest measured, tuning.py) and runs
                                the MoE layers eager
                                (train.moe_cuda_graph: a graph cannot hold a layer split into stages)
    train.moe_cuda_graph with the pipeline
                                plans on the device (moe_planning auto: the plan a graph can replay)
    overlap.moe_dispatch_once_per_rank=auto
                                on with the pipelined exchange from router top-4 up (each token once per rank: the
                                fastest measured there, tuning.py); off below, and where it is not implemented
                                (padded capacity, expert-TP > 1)

The transport's ``auto`` follows the fabric, which only the ranks see (distributed/a2a.py).
"""

from __future__ import annotations

from moe_overlap.config.schema import Config, ModelConfig, OverlapConfig, ParallelConfig
from moe_overlap.tuning import ONCE_PER_RANK_MIN_TOPK

# The fields only the pipeline reads: setting one asks for it.
PIPELINE_FIELDS = ("moe_pipeline_chunks", "delay_wgrad_compute", "moe_planning", "moe_transport", "moe_compute_only",
                   "moe_expert_rank_capacity_factor", "moe_dispatch_once_per_rank")


def pipeline_fields_set(o: OverlapConfig) -> list[str]:
    """The pipeline-only fields this config sets: off its default, and not a switch set off (which asks for
    nothing)."""
    defaults = OverlapConfig()
    return [name for name in PIPELINE_FIELDS if getattr(o, name) != getattr(defaults, name)
            and getattr(o, name) is not False]


def once_per_rank_gap(m: ModelConfig, p: ParallelConfig) -> str | None:
    """What overlap.moe_dispatch_once_per_rank is not implemented with in this config, or None."""
    if m.moe_pad_expert_input_to_capacity:
        return "model.moe_pad_expert_input_to_capacity=true"
    if (p.expert_tensor_parallel_size or p.tensor_model_parallel_size) != 1:
        return "expert_tensor_parallel_size > 1"
    return None


def resolve_defaults(cfg: Config) -> list[str]:
    """Replace ``auto`` in the MoE exchange's switches by what runs (in place); returns one line per choice made,
    each naming the field, the value and why (config.validate logs them once the config has passed its rules)."""
    m, o, t = cfg.model, cfg.overlap, cfg.train
    exchanging = m.num_moe_experts is not None and cfg.parallel.expert_model_parallel_size * \
        cfg.expert_tensor_parallel_size > 1
    paired = o.overlap_moe_expert_parallel_comm and exchanging
    choices = []
    if o.moe_pipeline == "auto":
        asked = [f"overlap.{name}" for name in pipeline_fields_set(o)]
        if m.moe_shared_expert_overlap:
            asked.append("model.moe_shared_expert_overlap")
        if paired:
            asked.append("overlap.overlap_moe_expert_parallel_comm")
        if asked:
            o.moe_pipeline, why = True, f"{', '.join(asked)} runs on it"
        elif not exchanging:
            o.moe_pipeline, why = False, "one expert rank: nothing to exchange"
        elif t.expert_wgrad_pairs:
            o.moe_pipeline, why = False, "train.expert_wgrad_pairs=true, which the pipeline's chunks replace"
        else:
            o.moe_pipeline, why = True, "the fastest measured with an exchange (tuning.py)"
        choices.append(f"overlap.moe_pipeline=auto -> {str(o.moe_pipeline).lower()}: {why}")
    if paired and o.moe_pipeline:
        if t.moe_cuda_graph:
            t.moe_cuda_graph = False
            choices.append("train.moe_cuda_graph=true -> false: overlap_moe_expert_parallel_comm runs each MoE layer "
                           "as stages beside another micro-batch, which a graph cannot hold")
    if o.moe_dispatch_once_per_rank == "auto":
        if not (exchanging and o.moe_pipeline):
            o.moe_dispatch_once_per_rank, why = False, "no pipelined exchange"
        elif once_per_rank_gap(m, cfg.parallel):
            o.moe_dispatch_once_per_rank, why = False, f"not implemented with {once_per_rank_gap(m, cfg.parallel)}"
        elif m.moe_router_topk < ONCE_PER_RANK_MIN_TOPK:
            o.moe_dispatch_once_per_rank, why = False, (f"top-{m.moe_router_topk}: few copies share a rank (on from "
                                                        f"top-{ONCE_PER_RANK_MIN_TOPK}, tuning.py)")
        else:
            o.moe_dispatch_once_per_rank, why = True, (f"top-{m.moe_router_topk}: the fastest measured, each token "
                                                       "once per rank (tuning.py)")
        if exchanging:
            choices.append(f"overlap.moe_dispatch_once_per_rank=auto -> {str(o.moe_dispatch_once_per_rank).lower()}: "
                           f"{why}")
    if exchanging and o.moe_pipeline and t.moe_cuda_graph and o.moe_planning == "auto":
        o.moe_planning = "device"
        choices.append("overlap.moe_planning=auto -> device: train.moe_cuda_graph replays the device-planned exchange")
    return choices
