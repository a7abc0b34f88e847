"""The rules of the overlap switches and of what they compose with: TP communication overlap, the MoE pipeline and
its graphs, pairing micro-batches, pipeline schedules and their P2P, the distributed optimizer, communicator CTAs
and the GEMM carve-out. ``validate_overlaps`` checks them in one fixed order (the first broken rule is the one
reported)."""

from __future__ import annotations

import math

from moe_overlap.config.defaults import graph_gap, once_per_rank_gap, pairs_on_streams, pipeline_fields_set
from moe_overlap.config.schema import (Config, ConfigError, ModelConfig, OverlapConfig, ParallelConfig, TrainConfig,
                                       not_implemented, refuse, require)
from moe_overlap.exchange_rules import expert_tp_refusal, graph_refusal, sizes_refusal, slots_refusal

MAX_NCCL_CTAS = 64  # NCCL's MAXCHANNELS


def validate_overlaps(cfg: Config) -> None:
    m, p, o, t = cfg.model, cfg.parallel, cfg.overlap, cfg.train
    _validate_overlap(o, p, m)
    _validate_pipeline(cfg)
    _validate_moe_overlap(m, o, p)
    _validate_moe_cuda_graph(cfg)
    _validate_expert_wgrad_micro_batches(t, o, m, p)
    _validate_microbatch_overlap(cfg)
    _validate_distributed_optimizer(o, t)
    _validate_comm_resources(o)


def _validate_overlap(o: OverlapConfig, p: ParallelConfig, m: ModelConfig) -> None:
    require(o.tp_comm_num_splits >= 1, "overlap.tp_comm_num_splits", o.tp_comm_num_splits, "must be >= 1")
    require(o.moe_pipeline_chunks >= 1, "overlap.moe_pipeline_chunks", o.moe_pipeline_chunks, "must be >= 1")
    require(o.moe_token_slices >= 1, "overlap.moe_token_slices", o.moe_token_slices, "must be >= 1")
    require(o.moe_token_slices <= 2, "overlap.moe_token_slices", o.moe_token_slices,
            "must be 1 or 2: more slices are not implemented yet (more exchanges in flight than the transport's "
            "symmetric regions)")
    _validate_tp_overlap(o, p, m)


def _validate_pipeline(cfg: Config) -> None:
    """The schedule and its P2P switches: each needs PP > 1; a schedule fits the virtual stages."""
    p, o, t = cfg.parallel, cfg.overlap, cfg.train
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    for name, value in (("overlap.overlap_p2p_comm", o.overlap_p2p_comm), ("overlap.batch_p2p_comm", o.batch_p2p_comm),
                        ("train.pipeline_schedule", t.pipeline_schedule)):
        require(pp > 1 or value in (False, None), name, value,
                 "has no effect without pipeline parallelism (parallel.pipeline_model_parallel_size > 1)")
    # As Megatron: a batch ends when all its transfers have, so an early receive would hold its sends back.
    require(not (o.overlap_p2p_comm and o.batch_p2p_comm), "overlap.batch_p2p_comm", True,
             "and overlap.overlap_p2p_comm=true cannot both be set: a batched call ends with its last transfer, "
             "so a receive posted early would hold back the sends batched with it")
    schedule = t.pipeline_schedule
    if schedule == "interleaved_1f1b":
        require(vpp > 1, "train.pipeline_schedule", schedule,
                 "needs parallel.virtual_pipeline_model_parallel_size > 1")
    if schedule == "1f1b":
        require(vpp == 1, "train.pipeline_schedule", schedule,
                 f"runs one model chunk per rank; with virtual_pipeline_model_parallel_size={vpp} use "
                 "interleaved_1f1b or all_forward_all_backward")
    if schedule == "zb_h1":
        require(vpp == 1, "train.pipeline_schedule", schedule,
                 "not implemented yet over virtual stages (ZB-V); use interleaved_1f1b, or zb_h1 without "
                 "parallel.virtual_pipeline_model_parallel_size")
        require(t.recompute_granularity == "none", "train.pipeline_schedule", schedule,
                 "not implemented yet with train.recompute_granularity='full' (a deferred weight gradient would "
                 "need the recomputed activations); use 1f1b")


def _validate_tp_overlap(o: OverlapConfig, p: ParallelConfig, m: ModelConfig) -> None:
    """One switch per overlap, each under the master switch tp_comm_overlap, all only with sequence parallelism."""
    sub_switches = ("tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_bulk_dgrad",
                    "tp_comm_bulk_wgrad")
    for name in ("tp_comm_overlap",) + sub_switches:
        if getattr(o, name) and not p.sequence_parallel:
            raise ConfigError(f"overlap.{name}", True, "TP communication overlap needs parallel.sequence_parallel=true")
    for name in sub_switches:
        require(not getattr(o, name) or o.tp_comm_overlap, f"overlap.{name}", True,
                 "needs the master switch overlap.tp_comm_overlap=true")
    require(o.tp_comm_backend == "auto" or o.tp_comm_overlap, "overlap.tp_comm_backend", o.tp_comm_backend,
             "needs overlap.tp_comm_overlap=true (the serial TP path uses the process group's own collectives)")
    if o.tp_comm_overlap:
        require(any(getattr(o, name) for name in sub_switches), "overlap.tp_comm_overlap", True,
                 "turns nothing on by itself: set one or more of " + ", ".join(f"overlap.{n}" for n in sub_switches))
    require(not (o.tp_comm_bulk_wgrad and o.tp_comm_overlap_rs_dgrad), "overlap.tp_comm_bulk_wgrad", True,
             "has nothing to hide with overlap.tp_comm_overlap_rs_dgrad=true (that ring already carries the dgrad's "
             "reduce-scatter); set one of them")
    pipelined = o.tp_comm_overlap_ag or o.tp_comm_overlap_rs or o.tp_comm_overlap_rs_dgrad
    if not pipelined:
        require(o.tp_comm_num_splits == OverlapConfig().tp_comm_num_splits, "overlap.tp_comm_num_splits",
                 o.tp_comm_num_splits, "has no effect without a pipelined overlap (overlap.tp_comm_overlap_ag, "
                 "overlap.tp_comm_overlap_rs or overlap.tp_comm_overlap_rs_dgrad)")
        return
    block = m.seq_length // (p.tensor_model_parallel_size * p.context_parallel_size)
    require(block % o.tp_comm_num_splits == 0, "overlap.tp_comm_num_splits", o.tp_comm_num_splits,
             f"must divide the per-rank sequence block, model.seq_length / (parallel.tensor_model_parallel_size x "
             f"parallel.context_parallel_size) = {block}")


def _validate_moe_overlap(m: ModelConfig, o: OverlapConfig, p: ParallelConfig) -> None:
    """The MoE pipeline's fields: each needs the pipeline; planning and transport must agree on where sizes are;
    chunks are runs of local experts."""
    for name in pipeline_fields_set(o):
        require(o.moe_pipeline, f"overlap.{name}", getattr(o, name),
                "needs overlap.moe_pipeline=true (the serial reference has one chunk, no deferred wgrad, host "
                "sizes and the process group's own all-to-all)")
    refuse(sizes_refusal(o.moe_planning, o.moe_transport)
           or expert_tp_refusal(o.moe_planning, p.expert_tensor_parallel_size or p.tensor_model_parallel_size)
           or slots_refusal(o.moe_planning, o.moe_transport, o.moe_dispatch_once_per_rank is True,
                            o.moe_overflow_capacity_factor is not None and o.moe_pipeline_chunks > 1))
    # the device-planned exchange's factors of the balanced rows: what each holds at least, what null means, and what
    # it sizes (host planning sizes that exactly)
    for name, least, null, sizes in (
            ("moe_expert_rank_capacity_factor", "a rank receives its balanced share", "the worst case",
             "bounds the device-planned exchange only; with overlap.moe_planning=host every buffer is sized exactly"),
            ("moe_paged_stash_factor", "the pool holds the balanced rows", "no pages",
             "pages the device-planned exchange's stash only; with overlap.moe_planning=host it is sized exactly")):
        factor = getattr(o, name)
        if factor is not None:
            require(math.isfinite(factor) and factor >= 1.0, f"overlap.{name}", factor,
                    f"must be >= 1.0 ({least} at least) or null ({null})")
            require(o.moe_planning != "host", f"overlap.{name}", factor,
                    f"{sizes} (use overlap.moe_planning=device or auto)")
    if o.moe_paged_stash_factor is not None and o.moe_transport == "copy_engine":
        raise not_implemented("overlap.moe_paged_stash_factor", o.moe_paged_stash_factor, None, "with "
                              "overlap.moe_transport=copy_engine: the pages follow the SM pushes' device routes")
    overflow = o.moe_overflow_capacity_factor
    if overflow is not None:
        require(math.isfinite(overflow) and overflow > 0, "overlap.moe_overflow_capacity_factor", overflow,
                "must be > 0 (rows of the overflow chunk, a factor of the balanced share) or null (no overflow chunk)")
        require(o.moe_expert_rank_capacity_factor is not None, "overlap.moe_overflow_capacity_factor", overflow,
                "needs overlap.moe_expert_rank_capacity_factor (without a bound no row overflows)")
    if o.moe_compute_only:
        require(p.expert_model_parallel_size > 1, "overlap.moe_compute_only", True,
                 "needs parallel.expert_model_parallel_size > 1 (one EP rank exchanges nothing)")
        if (p.expert_tensor_parallel_size or p.tensor_model_parallel_size) != 1:
            raise not_implemented("overlap.moe_compute_only", True, False,
                                   "with expert_tensor_parallel_size > 1 (the expert-TP gather would still move rows)")
    if o.moe_dispatch_once_per_rank and once_per_rank_gap(m, p):
        raise not_implemented("overlap.moe_dispatch_once_per_rank", True, False, f"with {once_per_rank_gap(m, p)}")
    if o.moe_dispatch_dtype == "fp8":
        if o.moe_dispatch_once_per_rank is not True:
            raise not_implemented("overlap.moe_dispatch_dtype", "fp8", "bf16", "without each token once per rank: "
                                  "set overlap.moe_dispatch_once_per_rank=true")
        require(m.hidden_size % 4 == 0, "overlap.moe_dispatch_dtype", "fp8",
                f"needs model.hidden_size divisible by 4 (FP8 rows packed into the activations' columns), got "
                f"{m.hidden_size}")
    if o.moe_token_slices > 1:
        gap = ("with model.moe_pad_expert_input_to_capacity=true (each slice would pad to the micro-batch's capacity)"
               if m.moe_pad_expert_input_to_capacity else
               "with expert_tensor_parallel_size > 1" if (p.expert_tensor_parallel_size or
                                                          p.tensor_model_parallel_size) != 1 else None)
        if gap is not None:
            raise not_implemented("overlap.moe_token_slices", o.moe_token_slices, 1, gap)
    if m.moe_shared_expert_overlap is True:
        require(o.moe_pipeline, "model.moe_shared_expert_overlap", True,
                 "needs overlap.moe_pipeline=true (the shared expert runs beside the combine's transfers)")
    if o.ep_comm_ctas is not None:
        require(1 <= o.ep_comm_ctas <= MAX_NCCL_CTAS, "overlap.ep_comm_ctas", o.ep_comm_ctas,
                 f"must be between 1 and {MAX_NCCL_CTAS} (or null: NCCL's choice)")
        require(p.expert_model_parallel_size > 1, "overlap.ep_comm_ctas", o.ep_comm_ctas,
                 "needs parallel.expert_model_parallel_size > 1 (one EP rank has no EP communicator)")
    if m.num_moe_experts is not None:
        local = m.num_moe_experts // p.expert_model_parallel_size
        require(o.moe_pipeline_chunks <= local, "overlap.moe_pipeline_chunks", o.moe_pipeline_chunks,
                 f"must be <= the local experts, model.num_moe_experts / parallel.expert_model_parallel_size "
                 f"= {local} (a chunk is a run of local experts)")


def _validate_moe_cuda_graph(cfg: Config) -> None:
    o, p = cfg.overlap, cfg.parallel
    if cfg.train.moe_cuda_graph is not True:  # auto is resolved by the same rules (config/defaults.py)
        return
    expert_ranks = p.expert_model_parallel_size * (p.expert_tensor_parallel_size or p.tensor_model_parallel_size)
    refuse(graph_refusal(o.moe_pipeline, o.moe_planning, exchanging=expert_ranks > 1))
    gap = graph_gap(cfg)
    if gap is not None:
        raise not_implemented("train.moe_cuda_graph", True, False, gap)


def _validate_microbatch_overlap(cfg: Config) -> None:
    """``overlap.overlap_moe_expert_parallel_comm``: a schedule with forwards beside backwards, an exchange that can
    be split into segments."""
    m, p, o, t = cfg.model, cfg.parallel, cfg.overlap, cfg.train
    if o.overlap_moe_expert_parallel_comm is False:  # auto, left to the fabric, may pair: its rules hold too
        return
    name = "overlap.overlap_moe_expert_parallel_comm"
    require(m.num_moe_experts is not None, name, True, "needs MoE layers (model.num_moe_experts)")
    require(t.pipeline_schedule != "all_forward_all_backward", name, True,
            "needs a schedule that runs forwards beside backwards: train.pipeline_schedule=all_forward_all_backward "
            "has none to pair; use 1f1b, interleaved_1f1b or zb_h1")
    if t.recompute_granularity != "none":
        raise not_implemented(name, True, False, "with train.recompute_granularity='full': a layer's stages "
                                                  "would each recompute on their own")
    exchanging = p.expert_model_parallel_size * cfg.expert_tensor_parallel_size > 1
    # (with an exchange, config/defaults.py has turned on what the pairing needs: the pipeline, eager layers)
    require(not exchanging or o.moe_pipeline, name, True, "needs overlap.moe_pipeline=true with more than one "
             "EP or expert-TP rank: the serial exchange blocks, so nothing could run beside it")
    if o.overlap_moe_expert_parallel_comm is True and o.moe_token_slices > 1:
        raise not_implemented("overlap.moe_token_slices", o.moe_token_slices, 1,
                              "with overlap_moe_expert_parallel_comm, whose stages run a layer's steps apart")
    if pairs_on_streams(cfg):
        streams = "with overlap_moe_expert_parallel_comm and train.moe_cuda_graph, whose pairs run on two streams"
        if o.batch_p2p_comm:
            raise not_implemented("overlap.batch_p2p_comm", True, False,
                                  f"{streams}: each transfer queues on its own micro-batch's stream")
        if o.moe_paged_stash_factor is not None:
            raise not_implemented("overlap.moe_paged_stash_factor", o.moe_paged_stash_factor, None,
                                  f"{streams}: both would take and return pages of one pool at once")
        if p.pipeline_model_parallel_size > 1 and exchanging:
            # 4xH200, 2026-11-29 (benchmarks/RESULTS.md, "Pairs on two streams"): the fine bench model at PP=2 x EP=2
            # hung in its fifth step, the stages' sends and receives never completing; with
            # CUDA_DEVICE_MAX_CONNECTIONS=1 it ran, at 0.987x the unpaired step's tokens/s. The bounded exchange's
            # hang on streams had its cause in the graphs' shared cuBLAS workspace (layers/moe.py, capture_moe_layers),
            # likely this one's too, but no 4-GPU machine has run it since
            raise not_implemented("parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size, 1,
                                  f"{streams}, with an exchange between expert ranks: the stages' transfers hung on "
                                  "GPUs (with CUDA_DEVICE_MAX_CONNECTIONS=1 they ran, slower than unpaired)")


def _validate_expert_wgrad_micro_batches(t: TrainConfig, o: OverlapConfig, m: ModelConfig,
                                         p: ParallelConfig) -> None:
    n, name = t.expert_wgrad_micro_batches, "train.expert_wgrad_micro_batches"
    require(n >= 1, name, n, "must be 1 (each micro-batch's own) or more")
    if n == 1:
        return
    require(m.num_moe_experts is not None, name, n, "needs MoE layers (model.num_moe_experts)")
    if t.moe_cuda_graph is True:
        raise not_implemented(name, n, 1, "with train.moe_cuda_graph: a graph replays one backward, not alternating "
                                          "ones")
    if o.moe_pipeline:
        raise not_implemented(name, n, 1, "with overlap.moe_pipeline, whose chunks schedule their own weight gradients")
    if p.pipeline_model_parallel_size > 1:
        raise not_implemented(name, n, 1, "under pipeline parallelism, whose schedule interleaves other micro-batches' "
                                          "backwards")


def _validate_comm_resources(o: OverlapConfig) -> None:
    if o.dp_comm_ctas is not None:
        require(1 <= o.dp_comm_ctas <= MAX_NCCL_CTAS, "overlap.dp_comm_ctas", o.dp_comm_ctas,
                 f"must be between 1 and {MAX_NCCL_CTAS} (or null: NCCL's choice)")
    require(o.gemm_sm_carveout == "auto" or o.gemm_sm_carveout >= 0, "overlap.gemm_sm_carveout",
             o.gemm_sm_carveout, "must be >= 0, or auto")


def _validate_distributed_optimizer(o: OverlapConfig, t: TrainConfig) -> None:
    if o.bucket_size_mb is not None:
        require(o.bucket_size_mb > 0, "overlap.bucket_size_mb", o.bucket_size_mb,
                 "must be > 0 (or null: one Transformer layer per bucket)")
    if t.use_distributed_optimizer:
        return
    needs = "needs train.use_distributed_optimizer=true (the plain all-reduce optimizer has no buckets)"
    for name in ("overlap_grad_sync", "overlap_param_sync"):
        require(not getattr(o, name), f"overlap.{name}", getattr(o, name), needs)
    require(o.bucket_size_mb is None, "overlap.bucket_size_mb", o.bucket_size_mb, needs)
