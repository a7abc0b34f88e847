"""What ``auto`` means for the MoE exchange's switches, resolved once when a config is validated so that every rule,
layer and log sees plain values: the measured fastest path (tuning.py says where each choice was measured), or what
a switch the user set needs to run.

    overlap.moe_pipeline=auto   the pipeline where there is an exchange (EP x expert-TP > 1) or where a field that
                                only the pipeline reads is set; otherwise (one expert rank, or
                                train.expert_wgrad_micro_batches > 1, which the pipeline's chunks replace) the
                                serial exchange
    overlap_moe_expert_parallel_comm=auto
                                off where the config alone rules pairing out or measured it slower (one expert
                                rank, PP > 1, ...); otherwise the fabric decides when the ranks start
                                (training/run_setup.py, :func:`pairing_by_transport`): paired where the exchange runs
                                over NCCL, with at least 2 micro-batches; through one host's peer memory (sm_push),
                                or on one GPU with train.moe_cuda_graph=true, on two streams with graphed MoE layers
                                where :func:`streams_off_reason` allows and the estimate fits (streams_memory.py)
    overlap_moe_expert_parallel_comm with an exchange
                                turns the pipeline on (auto), leaves moe_planning auto to the transport (device
                                planning where sm_push runs, its pushes on the side stream beside the other
                                micro-batch under gemm_sm_carveout auto: the fastest measured, tuning.py) and runs
                                the MoE layers eager, as stages (train.moe_cuda_graph auto stays off); with
                                train.moe_cuda_graph=true each pair's halves run whole on two CUDA streams
    train.moe_cuda_graph=auto   off where the config alone rules graphs out (one expert rank, the CPU, pairing,
                                host sizes, PP schedules but 1f1b (unmeasured), what graphs are not implemented
                                with); otherwise the fabric decides when the ranks start (:func:`graphs_by_planning`):
                                graphed where the exchange is planned on the device (sm_push: one host with peer
                                access), unpaired
    train.moe_cuda_graph=true with the pipeline
                                plans on the device (moe_planning auto: the plan a graph can replay)
    overlap.moe_dispatch_once_per_rank=auto
                                on with the pipelined exchange from router top-4 up (each token once per rank: the
                                fastest measured there, tuning.py); off below, and where it is not implemented
                                (padded capacity, expert-TP > 1)
    model.moe_shared_expert_overlap=auto
                                on where the pipelined exchange runs and the model has a shared expert: it then
                                runs beside the combine's transfers (the fastest measured, tuning.py); off elsewhere
    overlap.delay_wgrad_compute=auto
                                on with one device-planned chunk, unpaired, each token once per rank: the
                                backward's transfer back then runs on the side stream beside the experts' weight
                                gradients (the fastest measured there, tuning.py); off elsewhere; with planning
                                left to the transport, decided when the ranks start (:func:`delay_by_planning`)

    train.fp8_wgrad=auto        with train.fp8_recipe, the experts' weight gradients in FP8 where measured faster:
                                rowwise, wide experts, many rows per expert (tuning.py); bf16 elsewhere
    train.fp8_param=auto        with train.fp8_recipe, on: the FP8 weights held only as their FP8 copies (with the
                                distributed optimizer, those whose shard is whole: not implemented for the others)
    train.fp8_dgrad_accumulation=auto
                                with train.fp8_recipe=rowwise, fast: the input gradients in cuBLAS's fast FP8
                                accumulation (measured faster, convergence within the bound: tuning.py); exact
                                with blockwise
    train.fp8_gemm_min_dim=auto with train.fp8_recipe, tuning.FP8_GEMM_MIN_DIM (FP8_GEMM_MIN_DIM_FAST with fast
                                input gradients): the forward and input-gradient GEMMs narrower than that in the
                                contraction or the output stay bf16 (measured slower in FP8)

The transport's ``auto`` follows the fabric, which only the ranks see (distributed/a2a.py).
"""

from __future__ import annotations

from moe_overlap.config.schema import Config, ModelConfig, OverlapConfig, ParallelConfig, TrainConfig
from moe_overlap.exchange_rules import host_sized
from moe_overlap.tuning import (FP8_GEMM_MIN_DIM, FP8_GEMM_MIN_DIM_FAST, FP8_WGRAD_MIN_DIM, FP8_WGRAD_MIN_ROWS,
                                FP8_WGRAD_RECIPES, ONCE_PER_RANK_MIN_TOPK, STREAMS_EXPERT_RANKS)

PAIRED, GRAPH, DELAY = "overlap.overlap_moe_expert_parallel_comm", "train.moe_cuda_graph", "overlap.delay_wgrad_compute"
SHARED = "model.moe_shared_expert_overlap"

# The fields only the pipeline reads: setting one asks for it.
PIPELINE_FIELDS = ("moe_pipeline_chunks", "moe_token_slices", "delay_wgrad_compute", "moe_planning", "moe_transport",
                   "moe_compute_only", "moe_expert_rank_capacity_factor", "moe_overflow_capacity_factor",
                   "moe_paged_stash_factor", "moe_dispatch_once_per_rank", "moe_dispatch_dtype")


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


def pairing_off_reason(cfg: Config, exchanging: bool) -> str | None:
    """Why ``overlap_moe_expert_parallel_comm: auto`` stays off whatever the fabric, or None (it pairs where the
    exchange runs over NCCL: measured faster there, tuning.py)."""
    p, o, t = cfg.parallel, cfg.overlap, cfg.train
    if not exchanging:  # graphed MoE layers asked for on one expert rank pair on two streams where they fit
        streams = t.device == "cuda" and t.moe_cuda_graph is True and streams_off_reason(cfg) is None
        return None if streams else "one expert rank: nothing to exchange"
    if t.device != "cuda":
        return f"measured on CUDA over NCCL only; the device is {t.device!r}"
    if o.moe_pipeline is False:
        return "overlap.moe_pipeline=false: the serial exchange"
    if t.moe_cuda_graph is True or o.moe_planning == "device" or o.moe_transport in ("sm_push", "copy_engine"):
        off = streams_off_reason(cfg)  # host-planned sizes among its reasons
        if off is not None:
            return ("the exchange through one host's peer memory (device planning, CUDA graphs or the transport asked "
                    f"for), where eager pairs measured slower and pairs on two streams are not chosen: {off} "
                    "(tuning.py)")
    if p.pipeline_model_parallel_size > 1:
        return "pipeline parallelism: paired measured there only eager and slower (tuning.py)"
    if o.moe_pipeline_chunks > 1 or o.delay_wgrad_compute is True:
        return "chunks or delayed wgrad: not measured paired"
    if o.moe_token_slices > 1:
        return "overlap.moe_token_slices > 1: token slices run in one layer call, not beside another micro-batch"
    if t.expert_wgrad_micro_batches > 1:
        return f"train.expert_wgrad_micro_batches={t.expert_wgrad_micro_batches}: the serial exchange"
    if t.recompute_granularity != "none":
        return f"train.recompute_granularity={t.recompute_granularity!r}: not implemented paired"
    return None


def streams_off_reason(cfg: Config) -> str | None:
    """Why ``overlap_moe_expert_parallel_comm: auto`` does not pair on two CUDA streams with graphed MoE layers
    through one host's peer memory, whatever the memory; None: it does where the rank's estimate fits its GPU
    (training/streams_memory.py)."""
    p, o, t, gap = cfg.parallel, cfg.overlap, cfg.train, graph_gap(cfg)
    ep, ranks = p.expert_model_parallel_size, " or ".join(map(str, STREAMS_EXPERT_RANKS))
    return next((why for off, why in (
        (ep not in STREAMS_EXPERT_RANKS, f"parallel.expert_model_parallel_size={ep}: measured and run at {ranks}"),
        (cfg.expert_tensor_parallel_size > 1, "expert-TP > 1: no device-planned exchange for graphs to replay"),
        (t.moe_cuda_graph is False, "train.moe_cuda_graph=false: eager pairs measured slower there"),
        (p.pipeline_model_parallel_size > 1, "PP > 1 with an exchange: refused on streams (it hung on GPUs)"),
        (gap is not None, f"not implemented: {gap}"),
        (host_sized(o.moe_planning, o.moe_transport), "host-planned sizes, which a graph cannot hold"),
        (t.expert_wgrad_micro_batches > 1, "train.expert_wgrad_micro_batches > 1: a graph replays one backward"),
        (o.moe_pipeline_chunks > 1 or o.delay_wgrad_compute is True,
         "chunks or delayed weight gradients: slower on streams (tuning.py)"),
        (o.moe_token_slices > 1, "overlap.moe_token_slices > 1: not measured on streams"),
        (o.moe_paged_stash_factor is not None, "overlap.moe_paged_stash_factor: not implemented on streams"),
    ) if off), None)


def pairing_by_transport(transport: str, micro_batches: int) -> tuple[bool, str]:
    """``overlap_moe_expert_parallel_comm: auto`` once the exchange's transport is known (the fabric: NCCL without
    peer copies): paired over NCCL with micro-batches to pair; and why."""
    if transport != "nccl":
        return False, (f"the exchange runs over {transport}, where eager pairs measured slower than one micro-batch "
                       "at a time (tuning.py)")
    if micro_batches < 2:
        return False, f"{micro_batches} micro-batch per step: nothing to pair"
    return True, "the exchange runs over NCCL, where another micro-batch's compute hid it best (tuning.py)"


def graph_gap(cfg: Config) -> str | None:
    """What graphed MoE layers are not implemented with in this config, or None: train.moe_cuda_graph=true is
    refused with it (config/overlap_rules.py), auto stays off."""
    p, t = cfg.parallel, cfg.train
    if p.tensor_model_parallel_size != 1:
        return "graphs of MoE layers under tensor parallelism"
    if t.recompute_granularity != "none":
        return "graphs of MoE layers with recomputation"
    if p.context_parallel_size > 1:
        return "graphs of MoE layers under context parallelism: the router gathers over the CP group"
    if t.precision != "bf16":  # the capture fails: tiny.yaml at EP=4 on 4xH100, 2026-11-27
        return (f"graphs of MoE layers in {t.precision}: torch._grouped_mm runs {t.precision} through a fallback that "
                "reads its group offsets on the host (ATen's _grouped_mm_fallback), which a graph cannot hold; use "
                "train.precision=bf16")
    return None


def graphs_off_reason(cfg: Config, exchanging: bool, paired: bool) -> str | None:
    """Why ``train.moe_cuda_graph: auto`` stays off whatever the fabric, or None (graphed where the exchange is
    planned on the device: measured fastest there, tuning.py)."""
    o, t, p = cfg.overlap, cfg.train, cfg.parallel
    if not exchanging:
        return "one expert rank: graphs measured faster only with an exchange (tuning.py); true replays them"
    if t.device == "cpu":
        return "CUDA graphs need CUDA"
    if paired:
        return "overlap_moe_expert_parallel_comm runs each MoE layer as stages, which a graph cannot hold"
    if not o.moe_pipeline:
        return "overlap.moe_pipeline=false: the serial exchange's host sync, which a graph cannot hold"
    if host_sized(o.moe_planning, o.moe_transport):
        return "host-planned sizes, whose host sync a graph cannot hold"
    if t.expert_wgrad_micro_batches > 1:
        return f"train.expert_wgrad_micro_batches={t.expert_wgrad_micro_batches}: a graph replays one backward"
    schedule = t.pipeline_schedule or ("interleaved_1f1b" if (p.virtual_pipeline_model_parallel_size or 1) > 1
                                       else "1f1b")
    if p.pipeline_model_parallel_size > 1 and schedule != "1f1b":  # GPU-tested at one expert rank only
        return f"train.pipeline_schedule={schedule} with an exchange: graphed not yet measured there; true runs it"
    gap = graph_gap(cfg)
    return None if gap is None else f"not implemented: {gap}"


def pairs_on_streams(cfg: Config) -> bool:
    """Paired micro-batches with graphed MoE layers: each pair's forward and backward run whole, side by side on
    two CUDA streams (training/microbatch_overlap.PairStreams), each graphed copy of the MoE layers exchanging
    through symmetric regions of its own; not as stages, which a graph cannot hold."""
    return cfg.overlap.overlap_moe_expert_parallel_comm is True and cfg.train.moe_cuda_graph is True


def graphs_by_planning(planning: str, device_type: str, paired: bool) -> tuple[bool, str]:
    """``train.moe_cuda_graph: auto`` once the exchange's planning is known (the fabric): graphed where it is
    planned on the device (sm_push), unpaired; and why."""
    if device_type != "cuda":
        return False, f"CUDA graphs need CUDA; the device is {device_type!r}"
    if paired:
        return False, "paired micro-batches run each MoE layer as stages, which a graph cannot hold"
    if planning != "device":
        return False, f"the exchange is planned on the {planning}, whose host sync a graph cannot hold"
    return True, ("the exchange is planned on the device: its layers replayed from graphs measured fastest "
                  "(tuning.py)")


def delay_by_planning(planning: str, paired: bool) -> tuple[bool, str]:
    """``overlap.delay_wgrad_compute: auto`` left to the fabric (the config's planning auto, one chunk, each token
    once per rank): on where the exchange is planned on the device, unpaired; and why."""
    if paired or planning != "device":
        return False, "measured faster only with one device-planned chunk, unpaired (tuning.py)"
    return True, ("one device-planned chunk, each token once per rank: the backward's transfer back beside the "
                  "weight gradients measured fastest (tuning.py)")


def resolve_defaults(cfg: Config) -> list[str]:
    """Replace ``auto`` in the MoE exchange's switches by what runs (in place); returns one line per choice made,
    each naming the field, the value and why (config.validate logs them once the config has passed its rules)."""
    m, o, t = cfg.model, cfg.overlap, cfg.train
    exchanging = m.num_moe_experts is not None and cfg.parallel.expert_model_parallel_size * \
        cfg.expert_tensor_parallel_size > 1
    choices = []
    if o.overlap_moe_expert_parallel_comm == "auto":
        off = pairing_off_reason(cfg, exchanging)
        if off is not None:
            o.overlap_moe_expert_parallel_comm = False
            if exchanging:
                choices.append(f"{PAIRED}=auto -> false: {off}")
        else:  # the trainer decides once the ranks see the fabric and the micro-batches (pairing_by_transport)
            streams = "" if streams_off_reason(cfg) else "on two streams if they fit the GPU"
            choices.append(f"{PAIRED}=auto: paired " + (f"if the exchange runs over NCCL, or {streams}" if exchanging
                                                        else streams) + " (decided at start)")
    paired = o.overlap_moe_expert_parallel_comm is True and exchanging
    if o.moe_pipeline == "auto":
        asked = [f"overlap.{name}" for name in pipeline_fields_set(o)]
        if m.moe_shared_expert_overlap is True:
            asked.append("model.moe_shared_expert_overlap")
        if paired:
            asked.append(PAIRED)
        if asked:
            o.moe_pipeline, why = True, f"{', '.join(asked)} runs on it"
        elif not exchanging:
            o.moe_pipeline, why = False, "one expert rank: nothing to exchange"
        elif t.expert_wgrad_micro_batches > 1:
            o.moe_pipeline, why = False, (f"train.expert_wgrad_micro_batches={t.expert_wgrad_micro_batches}, which "
                                          "the pipeline's chunks replace")
        else:
            o.moe_pipeline, why = True, "the fastest measured with an exchange (tuning.py)"
        choices.append(f"overlap.moe_pipeline=auto -> {str(o.moe_pipeline).lower()}: {why}")
    if paired and o.moe_pipeline and t.moe_cuda_graph is True:
        choices.append(f"{PAIRED}=true with {GRAPH}=true: each pair's forward and backward run whole, side by side on "
                       "two CUDA streams, their MoE layers from graphs (not as stages, which a graph cannot hold)")
    if m.moe_shared_expert_overlap == "auto" and m.num_moe_experts is not None:  # dense: MoE fields stay as given
        m.moe_shared_expert_overlap = bool(exchanging and o.moe_pipeline and m.moe_shared_expert_intermediate_size)
        if exchanging and m.moe_shared_expert_intermediate_size:
            why = ("the shared expert beside the combine's transfers measured fastest (tuning.py)"
                   if m.moe_shared_expert_overlap else "no pipelined exchange to run beside")
            choices.append(f"{SHARED}=auto -> {str(m.moe_shared_expert_overlap).lower()}: {why}")
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
    if t.moe_cuda_graph == "auto":
        off = graphs_off_reason(cfg, exchanging, paired)
        if off is not None:
            t.moe_cuda_graph = False
            if exchanging:
                choices.append(f"{GRAPH}=auto -> false: {off}")
        else:  # the trainer decides once the ranks see the fabric (graphs_by_planning)
            choices.append(f"{GRAPH}=auto: graphed if the exchange is planned on the device (decided when the ranks "
                           "start)")
    if exchanging and o.moe_pipeline and t.moe_cuda_graph is True and o.moe_planning == "auto":
        o.moe_planning = "device"
        choices.append("overlap.moe_planning=auto -> device: train.moe_cuda_graph replays the device-planned exchange")
    if o.delay_wgrad_compute == "auto":
        candidate = (exchanging and o.moe_pipeline and not paired and o.moe_pipeline_chunks == 1
                     and o.moe_dispatch_once_per_rank is True)
        undecided = o.moe_planning == "auto" or o.overlap_moe_expert_parallel_comm == "auto"  # by the fabric
        if candidate and undecided and t.device != "cpu":  # delay_by_planning
            choices.append(f"{DELAY}=auto: on if the exchange is planned on the device, unpaired (decided when the "
                           "ranks start)")
        else:
            o.delay_wgrad_compute = bool(candidate and o.moe_planning == "device")
            if exchanging and o.moe_pipeline:
                why = ("one device-planned chunk, each token once per rank: the backward's transfer back beside the "
                       "weight gradients measured fastest (tuning.py)" if o.delay_wgrad_compute else
                       "measured faster only with one device-planned chunk and each token once per rank (tuning.py)")
                choices.append(f"{DELAY}=auto -> {str(o.delay_wgrad_compute).lower()}: {why}")
    if t.fp8_wgrad == "auto" and t.fp8_recipe is not None:
        off = fp8_wgrad_off_reason(cfg)
        t.fp8_wgrad = off is None
        if m.num_moe_experts is not None:
            why = "measured faster there" if off is None else f"measured slower {off}"
            choices.append(f"train.fp8_wgrad=auto -> {str(t.fp8_wgrad).lower()}: the experts' weight gradients in "
                           f"{'FP8' if t.fp8_wgrad else 'bf16'}, {why} (tuning.py)")
    if t.fp8_param == "auto" and t.fp8_recipe is not None:
        # with the distributed optimizer it stays auto: true would ask for every weight (validate_for_world)
        t.fp8_param = "auto" if t.use_distributed_optimizer else True
        choices.append("train.fp8_param=auto -> true: the FP8 GEMMs' weights held only as their FP8 copies (2 bytes a "
                       "weight less)" + (", where the distributed optimizer's shard of them is whole (a data-parallel "
                       "group of one rank); the others keep their bf16 values beside the copies (not implemented "
                       "yet)" if t.use_distributed_optimizer else ""))
    if t.fp8_dgrad_accumulation == "auto" and t.fp8_recipe is not None:
        t.fp8_dgrad_accumulation = "fast" if fp8_fast_dgrad(t) else "exact"
        choices.append(f"train.fp8_dgrad_accumulation=auto -> {t.fp8_dgrad_accumulation}: " + (
            "the input gradients in the forward's fast FP8 accumulation, measured faster with its convergence within "
            "the bound (tuning.py)" if t.fp8_dgrad_accumulation == "fast" else
            "the blockwise GEMM sums every 128-deep slice exactly"))
    if t.fp8_gemm_min_dim == "auto" and t.fp8_recipe is not None:
        t.fp8_gemm_min_dim = fp8_gemm_min_dim(t)
        narrow = narrow_gemms(cfg, t.fp8_gemm_min_dim)
        choices.append(f"train.fp8_gemm_min_dim=auto -> {t.fp8_gemm_min_dim}: " + (
            "every GEMM of the FP8 layers in FP8, measured fastest with fast input gradients (tuning.py)"
            if t.fp8_gemm_min_dim == 0 else "GEMMs narrower in the contraction or the output stay bf16, measured "
            f"slower in FP8 (tuning.py): {', '.join(narrow) if narrow else 'none here'}"))
    return choices


def fp8_param(t: TrainConfig) -> bool:
    """``train.fp8_param`` as the optimizer and the memory count take it (auto, if not resolved yet: as resolved)."""
    return t.fp8_recipe is not None and t.fp8_param is not False


def fp8_gemm_min_dim(t: TrainConfig) -> int:
    """``train.fp8_gemm_min_dim`` as the layers take it (auto, if not resolved yet: the measured default for the
    input gradients' accumulation)."""
    if t.fp8_gemm_min_dim != "auto":
        return t.fp8_gemm_min_dim
    return FP8_GEMM_MIN_DIM_FAST if fp8_fast_dgrad(t) else FP8_GEMM_MIN_DIM


def fp8_fast_dgrad(t: TrainConfig) -> bool:
    """Whether the input-gradient FP8 GEMMs run the fast accumulation (``train.fp8_dgrad_accumulation``; auto, if not
    resolved yet: as resolved)."""
    if t.fp8_dgrad_accumulation == "auto":
        return t.fp8_recipe == "rowwise"
    return t.fp8_recipe is not None and t.fp8_dgrad_accumulation == "fast"


def narrow_gemms(cfg: Config, min_dim: int) -> list[str]:
    """The FP8 layers' weights whose GEMMs ``train.fp8_gemm_min_dim=min_dim`` leaves in bf16: those with a
    dimension (on a tensor-parallel rank: its part) narrower than ``min_dim``. A weight's forward and input-gradient
    GEMMs contract along one of its dimensions each and output the other, so both stay bf16 or neither."""
    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    q_width = m.num_attention_heads * m.head_dim
    kv_width = 2 * (m.num_query_groups or m.num_attention_heads) * m.head_dim
    weights = {"attention QKV": (m.hidden_size, (q_width + kv_width) // tp),
               "attention projection": (q_width // tp, m.hidden_size)}
    if m.num_moe_experts is None or not all(m.is_moe_layer(i) for i in range(m.num_layers)):
        weights.update({"dense MLP fc1": (m.hidden_size, 2 * m.ffn_hidden_size // tp),
                        "dense MLP fc2": (m.ffn_hidden_size // tp, m.hidden_size)})
    if m.num_moe_experts is not None:
        ffn = m.expert_ffn_hidden_size // cfg.expert_tensor_parallel_size  # expert-TP splits it, as the layers see
        weights.update({"experts' fc1": (m.hidden_size, 2 * ffn), "experts' fc2": (ffn, m.hidden_size)})
        if m.moe_shared_expert_intermediate_size:
            shared = m.moe_shared_expert_intermediate_size
            weights.update({"shared expert fc1": (m.hidden_size, 2 * shared),
                            "shared expert fc2": (shared, m.hidden_size)})
    return [name for name, dims in weights.items() if min(dims) < min_dim]


def fp8_wgrad_off_reason(cfg: Config) -> str | None:
    """Why ``train.fp8_wgrad: auto`` keeps the experts' weight gradients in bf16, or None: the recipe, the experts'
    width, and the rows per expert that one read-modify-write of main_grad sums (balanced routing: each of the EP
    ranks' tokens of a micro-batch, top-k copies over the experts; as many micro-batches' as
    train.expert_wgrad_micro_batches)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if t.fp8_recipe not in FP8_WGRAD_RECIPES or m.num_moe_experts is None:
        return f"with fp8_recipe={t.fp8_recipe}"
    narrow = min(m.hidden_size, m.expert_ffn_hidden_size)
    if narrow < FP8_WGRAD_MIN_DIM:
        return f"for experts {narrow} wide (from {FP8_WGRAD_MIN_DIM} on: the quantization costs what the GEMM saves)"
    tokens = t.micro_batch_size * m.seq_length // (p.context_parallel_size * (
        p.tensor_model_parallel_size if p.sequence_parallel else 1))
    rows = p.expert_model_parallel_size * tokens * m.moe_router_topk // m.num_moe_experts * \
        t.expert_wgrad_micro_batches
    if rows < FP8_WGRAD_MIN_ROWS:
        return f"at {rows} rows per expert per weight-gradient call (from {FP8_WGRAD_MIN_ROWS} on)"
    return None
