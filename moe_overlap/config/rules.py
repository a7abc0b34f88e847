"""The rules a configuration must keep, checked before any process group exists: ranges, the layout's
divisibility (``validate``, independent of the world size, and ``validate_for_world`` once it is known) and what is
not built yet; the overlap switches' rules are in ``overlap_rules``."""

from __future__ import annotations

import dataclasses
import logging
import math

from moe_overlap.config.defaults import resolve_defaults
from moe_overlap.config.overlap_rules import validate_overlaps
from moe_overlap.config.schema import (Config, ConfigError, DataConfig, ModelConfig, OverlapConfig, ParallelConfig,
                                       not_implemented, refuse, require, synthetic_source)
from moe_overlap.exchange_rules import device_refusal, graph_device_refusal

log = logging.getLogger(__name__)


def validate(cfg: Config) -> None:
    """Ranges, cross-field rules and not-yet-implemented features; independent of the world size. ``auto`` in the
    MoE exchange's switches is resolved first (config/defaults.py), so that the rules check what will run."""
    choices = resolve_defaults(cfg)
    m, p, o, t, d, c = cfg.model, cfg.parallel, cfg.overlap, cfg.train, cfg.data, cfg.checkpoint

    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                 "seq_length"):
        require(getattr(m, name) >= 1, f"model.{name}", getattr(m, name), "must be >= 1")
    for name in ("hidden_size", "ffn_hidden_size"):
        # torch._grouped_mm needs 16-byte row strides; multiples of 8 keep bf16 and fp32 both aligned.
        require(getattr(m, name) % 8 == 0, f"model.{name}", getattr(m, name), "must be a multiple of 8")
    if m.kv_channels is None:
        require(m.hidden_size % m.num_attention_heads == 0, "model.num_attention_heads", m.num_attention_heads,
                 f"must divide model.hidden_size={m.hidden_size} (or set model.kv_channels)")
        require(m.head_dim % 2 == 0, "model.num_attention_heads", m.num_attention_heads,
                 f"head dim hidden_size/num_attention_heads={m.head_dim} must be even for rotary embeddings")
    else:
        require(m.kv_channels >= 2 and m.kv_channels % 2 == 0, "model.kv_channels", m.kv_channels,
                 "must be a positive even number (rotary embeddings rotate channel pairs), or null")
    require(m.qk_layernorm or m.qk_layernorm_scope == "head", "model.qk_layernorm_scope", m.qk_layernorm_scope,
             "needs model.qk_layernorm=true")
    if m.num_query_groups is not None:
        require(m.num_query_groups >= 1 and m.num_attention_heads % m.num_query_groups == 0,
                 "model.num_query_groups", m.num_query_groups,
                 f"must be >= 1 and divide model.num_attention_heads={m.num_attention_heads}")
    require(m.rotary_base > 0, "model.rotary_base", m.rotary_base, "must be > 0")
    require(m.norm_epsilon > 0, "model.norm_epsilon", m.norm_epsilon, "must be > 0")
    require(m.init_method_std > 0, "model.init_method_std", m.init_method_std, "must be > 0")
    require(m.embedding_init_std is None or m.embedding_init_std > 0, "model.embedding_init_std",
             m.embedding_init_std, "must be > 0, or null (model.init_method_std)")
    _validate_moe(m)

    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        require(getattr(p, name) >= 1, f"parallel.{name}", getattr(p, name), "must be >= 1")
    if p.expert_tensor_parallel_size is not None:
        require(p.expert_tensor_parallel_size >= 1, "parallel.expert_tensor_parallel_size",
                 p.expert_tensor_parallel_size, "must be >= 1 (or null: tensor_model_parallel_size)")
    if m.num_moe_experts is not None:
        require(m.num_moe_experts % p.expert_model_parallel_size == 0, "parallel.expert_model_parallel_size",
                 p.expert_model_parallel_size, f"must divide model.num_moe_experts={m.num_moe_experts}")
    else:
        require(p.expert_model_parallel_size == 1, "parallel.expert_model_parallel_size",
                 p.expert_model_parallel_size, "must be 1 for a dense model (model.num_moe_experts is null)")
    tp = p.tensor_model_parallel_size
    require(m.num_attention_heads % tp == 0, "model.num_attention_heads", m.num_attention_heads,
             f"must be divisible by parallel.tensor_model_parallel_size={tp}")
    require(m.query_groups % tp == 0, "model.num_query_groups", m.query_groups,
             f"must be divisible by parallel.tensor_model_parallel_size={tp}")
    require(m.ffn_hidden_size % tp == 0, "model.ffn_hidden_size", m.ffn_hidden_size,
             f"must be divisible by parallel.tensor_model_parallel_size={tp}")
    require(m.vocab_size % tp == 0, "model.vocab_size", m.vocab_size,
             f"must be divisible by parallel.tensor_model_parallel_size={tp} (each TP rank holds a vocabulary block)")
    require(m.expert_ffn_hidden_size % cfg.expert_tensor_parallel_size == 0, "model.moe_ffn_hidden_size",
             m.expert_ffn_hidden_size,
             f"must be divisible by parallel.expert_tensor_parallel_size={cfg.expert_tensor_parallel_size}")
    _validate_pipeline_split(m, p)
    if p.sequence_parallel:
        require(m.seq_length % tp == 0, "model.seq_length", m.seq_length,
                 f"must be divisible by parallel.tensor_model_parallel_size={tp} under sequence_parallel")
    _validate_context_parallel(m, p, o)
    if tp > 1 and m.num_moe_experts is not None:
        require(p.sequence_parallel, "parallel.sequence_parallel", p.sequence_parallel,
                 "must be true for a MoE model with tensor_model_parallel_size > 1 (as Megatron-Core: each TP rank "
                 "routes its own sequence block)")

    validate_overlaps(cfg)
    _validate_fp8(cfg)

    for name in ("micro_batch_size", "global_batch_size", "max_steps", "eval_iters", "log_interval"):
        require(getattr(t, name) >= 1, f"train.{name}", getattr(t, name), "must be >= 1")
    require(t.global_batch_size % t.micro_batch_size == 0, "train.global_batch_size", t.global_batch_size,
             f"must be a multiple of train.micro_batch_size={t.micro_batch_size}")
    require(t.lr > 0, "train.lr", t.lr, "must be > 0")
    require(0 <= t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"must be in [0, train.lr={t.lr}]")
    require(t.lr_warmup_steps >= 0, "train.lr_warmup_steps", t.lr_warmup_steps, "must be >= 0")
    if t.lr_decay_steps is not None:
        require(t.lr_decay_steps > t.lr_warmup_steps, "train.lr_decay_steps", t.lr_decay_steps,
                 f"must be > train.lr_warmup_steps={t.lr_warmup_steps}")
    require(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        require(0 <= getattr(t, name) < 1, f"train.{name}", getattr(t, name), "must be in [0, 1)")
    require(t.adam_eps > 0, "train.adam_eps", t.adam_eps, "must be > 0")
    require(t.clip_grad >= 0, "train.clip_grad", t.clip_grad, "must be >= 0 (0 disables clipping)")
    require(t.seed >= 0, "train.seed", t.seed, "must be >= 0")
    require(t.eval_interval >= 0, "train.eval_interval", t.eval_interval, "must be >= 0 (0: never)")
    require(t.distributed_timeout_s > 0, "train.distributed_timeout_s", t.distributed_timeout_s, "must be > 0")
    if t.exit_duration_min is not None:
        require(t.exit_duration_min > 0, "train.exit_duration_min", t.exit_duration_min,
                 "must be > 0 minutes (or null: no limit)")
    require(bool(t.output_dir), "train.output_dir", t.output_dir, "must be a non-empty path")
    require(t.peak_tflops > 0, "train.peak_tflops", t.peak_tflops, "must be > 0 (TFLOP/s per GPU)")
    if t.profile_steps is not None:
        require(len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1], "train.profile_steps",
                 t.profile_steps, "must be [first, last] steps, 1 <= first <= last (or null: no profile)")
    require(all(rank >= 0 for rank in t.profile_ranks), "train.profile_ranks", t.profile_ranks,
             "must list ranks >= 0")
    require(t.init_from is None or bool(t.init_from), "train.init_from", t.init_from,
             "must be a checkpoint path, or null: initialise from train.seed")

    require(0 < d.validation_fraction <= 0.5, "data.validation_fraction", d.validation_fraction,
             "must be in (0, 0.5]")
    if synthetic_source(d.path) is not None:
        require(d.dtype == DataConfig.dtype, "data.dtype", d.dtype,
                 f"has no effect with data.path={d.path!r} (its ids are drawn, not read): leave it at "
                 f"{DataConfig.dtype!r}")
    elif d.path is not None:
        require(m.vocab_size <= (65536 if d.dtype == "uint16" else 2**32), "model.vocab_size", m.vocab_size,
                 f"must fit data.dtype={d.dtype}")
    else:
        require(m.vocab_size >= 256, "model.vocab_size", m.vocab_size,
                 "must be >= 256 for the bundled byte-level corpus (data.path is null)")

    require(c.save_interval >= 0, "checkpoint.save_interval", c.save_interval, "must be >= 0 (0: final save only)")
    require(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, "must be >= 1")
    for line in choices:  # once the config holds: a refused one says only what is wrong
        log.info("config: %s", line)


def _validate_context_parallel(m: ModelConfig, p: ParallelConfig, o: OverlapConfig) -> None:
    """The load-balanced split cuts each sequence into 2 x CP chunks; what CP does not compose with yet."""
    cp = p.context_parallel_size
    if p.cp_comm_type != "p2p":
        raise not_implemented("parallel.cp_comm_type", p.cp_comm_type, "p2p", "only the p2p ring is built")
    if cp == 1:
        require(not o.cp_comm_overlap, "overlap.cp_comm_overlap", True,
                 "has no effect with parallel.context_parallel_size=1 (there is no ring)")
        return
    require(m.seq_length % (2 * cp) == 0, "model.seq_length", m.seq_length,
             f"must be divisible by 2 x parallel.context_parallel_size={2 * cp} (CP rank r holds chunks r and "
             f"{2 * cp - 1}-r of every sequence)")
    if p.sequence_parallel:
        tp = p.tensor_model_parallel_size
        require(m.seq_length // cp % tp == 0, "model.seq_length", m.seq_length,
                 f"must be divisible by parallel.context_parallel_size x tensor_model_parallel_size={cp * tp} under "
                 "sequence_parallel (each TP rank holds a block of the CP rank's local sequence)")
    if p.pipeline_model_parallel_size != 1:
        raise not_implemented("parallel.context_parallel_size", cp, 1, "context parallelism with pipeline stages")


FP8_NEEDS_GPU = "FP8 needs a GPU with FP8 tensor cores (Hopper or newer)"


def _validate_fp8(cfg: Config) -> None:
    """train.fp8_recipe: what the FP8 GEMMs need (bf16 activations, every GEMM dimension on each rank a multiple
    of 16 for rowwise, of 128 for blockwise's tiles and blocks) and what they do not compose with yet."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        require(getattr(t, name) >= 0, f"train.{name}", getattr(t, name), "must be >= 0")
        require(t.fp8_recipe is not None or getattr(t, name) == 0, f"train.{name}", getattr(t, name),
                "has no effect without train.fp8_recipe (every layer is bf16): leave it at 0")
    bf16_layers = t.num_layers_at_start_in_bf16 + t.num_layers_at_end_in_bf16
    require(bf16_layers <= m.num_layers, "train.num_layers_at_end_in_bf16", t.num_layers_at_end_in_bf16,
            f"plus train.num_layers_at_start_in_bf16={t.num_layers_at_start_in_bf16} must be <= "
            f"model.num_layers={m.num_layers}")
    require(t.fp8_recipe is not None or t.fp8_wgrad == "auto", "train.fp8_wgrad", t.fp8_wgrad,
            "has no effect without train.fp8_recipe (every GEMM is bf16): leave it at auto")
    require(t.fp8_recipe is not None or t.fp8_gemm_min_dim == "auto", "train.fp8_gemm_min_dim", t.fp8_gemm_min_dim,
            "has no effect without train.fp8_recipe (every GEMM is bf16): leave it at auto")
    require(t.fp8_recipe is not None or t.fp8_param == "auto", "train.fp8_param", t.fp8_param,
            "has no effect without train.fp8_recipe (every GEMM is bf16): leave it at auto")
    require(t.fp8_recipe is not None or t.fp8_dgrad_accumulation == "auto", "train.fp8_dgrad_accumulation",
            t.fp8_dgrad_accumulation, "has no effect without train.fp8_recipe (every GEMM is bf16): leave it at auto")
    require(t.fp8_recipe != "blockwise" or t.fp8_dgrad_accumulation != "fast", "train.fp8_dgrad_accumulation",
            t.fp8_dgrad_accumulation, "not implemented yet for train.fp8_recipe=blockwise (its GEMM sums every "
            "128-deep slice exactly): auto or exact, or the rowwise recipe")
    require(t.fp8_gemm_min_dim == "auto" or t.fp8_gemm_min_dim >= 0, "train.fp8_gemm_min_dim", t.fp8_gemm_min_dim,
            "must be >= 0 (0: every GEMM in FP8), or auto")
    if t.fp8_recipe is None:
        return
    require(t.device != "cpu", "train.fp8_recipe", t.fp8_recipe, f"{FP8_NEEDS_GPU}; train.device is 'cpu'")
    require(t.precision == "bf16", "train.fp8_recipe", t.fp8_recipe,
            f"needs train.precision=bf16 (the FP8 GEMMs take and give bf16), not {t.precision!r}")
    # torch's scaled GEMMs need both dimensions of every weight (contraction and output) multiples of 16 on each
    # rank, blockwise's of 128: the dimensions tensor parallelism splits divided by its size (field, its value, the
    # GEMM dimension it sets on a rank)
    tp = p.tensor_model_parallel_size
    heads, groups = m.num_attention_heads, m.query_groups
    head = ("model.kv_channels", m.kv_channels) if m.kv_channels else ("model.num_attention_heads", heads)
    dims = [("model.hidden_size", m.hidden_size, m.hidden_size),
            (*head, heads * m.head_dim // tp), (*head, (heads + 2 * groups) * m.head_dim // tp)]  # projection, QKV
    if any(not m.is_moe_layer(i) for i in range(m.num_layers)):
        dims.append(("model.ffn_hidden_size", m.ffn_hidden_size, m.ffn_hidden_size // tp))
    if m.num_moe_experts is not None:
        expert = ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size) if m.moe_ffn_hidden_size else (
            "model.ffn_hidden_size", m.ffn_hidden_size)
        dims.append((*expert, m.expert_ffn_hidden_size // cfg.expert_tensor_parallel_size))
        if m.moe_shared_expert_intermediate_size:
            size = m.moe_shared_expert_intermediate_size
            dims.append(("model.moe_shared_expert_intermediate_size", size, size))  # on the rank's own tokens
    multiple = 128 if t.fp8_recipe == "blockwise" else 16
    for name, value, size in dims:
        require(size % multiple == 0, name, value, f"train.fp8_recipe={t.fp8_recipe!r} needs every GEMM dimension "
                f"(on each rank) a multiple of {multiple}: this one is {size}")


def _validate_moe(m: ModelConfig) -> None:
    if m.num_moe_experts is None:
        defaults = ModelConfig()
        for f in dataclasses.fields(m):
            if f.name.startswith("moe_") and getattr(m, f.name) != getattr(defaults, f.name):
                raise ConfigError(f"model.{f.name}", getattr(m, f.name),
                                  "has no effect on a dense model; set model.num_moe_experts or remove it")
        return
    require(m.num_moe_experts >= 1, "model.num_moe_experts", m.num_moe_experts, "must be >= 1 (or null: dense)")
    require(1 <= m.moe_router_topk <= m.num_moe_experts, "model.moe_router_topk", m.moe_router_topk,
             f"must be in [1, model.num_moe_experts={m.num_moe_experts}]")
    if isinstance(m.moe_layer_freq, int):
        require(m.moe_layer_freq >= 1, "model.moe_layer_freq", m.moe_layer_freq, "must be >= 1 (or a list of 0/1)")
    else:
        require(len(m.moe_layer_freq) == m.num_layers and set(m.moe_layer_freq) <= {0, 1}, "model.moe_layer_freq",
                 m.moe_layer_freq, f"a list must hold one 0 or 1 per layer (model.num_layers={m.num_layers})")
    if m.moe_ffn_hidden_size is not None:
        require(m.moe_ffn_hidden_size >= 8 and m.moe_ffn_hidden_size % 8 == 0, "model.moe_ffn_hidden_size",
                 m.moe_ffn_hidden_size, "must be a positive multiple of 8")
    require(m.moe_aux_loss_coeff >= 0, "model.moe_aux_loss_coeff", m.moe_aux_loss_coeff, "must be >= 0")
    require(m.moe_z_loss_coeff >= 0, "model.moe_z_loss_coeff", m.moe_z_loss_coeff, "must be >= 0")
    if m.moe_router_loss_detach_input:
        require(m.moe_aux_loss_coeff > 0 or m.moe_z_loss_coeff > 0, "model.moe_router_loss_detach_input", True,
                "needs model.moe_aux_loss_coeff or model.moe_z_loss_coeff > 0 (it changes what their gradients reach)")
    if m.moe_router_load_balancing_type == "none":
        require(m.moe_aux_loss_coeff == 0, "model.moe_aux_loss_coeff", m.moe_aux_loss_coeff,
                 "must be 0 when model.moe_router_load_balancing_type is 'none'")
    if m.moe_expert_capacity_factor is not None:
        require(m.moe_expert_capacity_factor > 0, "model.moe_expert_capacity_factor", m.moe_expert_capacity_factor,
                 "must be > 0 (or null: dropless)")
    _validate_router_groups(m)
    if m.moe_router_enable_expert_bias:
        require(m.moe_router_score_function == "sigmoid", "model.moe_router_enable_expert_bias", True,
                 "needs model.moe_router_score_function='sigmoid' (as Megatron-Core)")
    require(m.moe_router_bias_update_rate > 0, "model.moe_router_bias_update_rate", m.moe_router_bias_update_rate,
             "must be > 0")
    require(math.isfinite(m.moe_router_lr_scale) and m.moe_router_lr_scale > 0, "model.moe_router_lr_scale",
            m.moe_router_lr_scale, "must be a finite number > 0 (1: train.lr's schedule)")
    if m.moe_pad_expert_input_to_capacity:
        require(m.moe_expert_capacity_factor is not None, "model.moe_pad_expert_input_to_capacity", True,
                 "needs model.moe_expert_capacity_factor (padding fills each expert's capacity)")
    if m.moe_shared_expert_intermediate_size is not None:
        require(m.moe_shared_expert_intermediate_size >= 8 and m.moe_shared_expert_intermediate_size % 8 == 0,
                 "model.moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size,
                 "must be a positive multiple of 8 (or null: no shared expert)")
    if m.moe_shared_expert_overlap is True:
        require(m.moe_shared_expert_intermediate_size is not None, "model.moe_shared_expert_overlap", True,
                 "needs model.moe_shared_expert_intermediate_size (there is no shared expert to overlap)")
    if m.moe_shared_expert_gate:
        require(m.moe_shared_expert_intermediate_size is not None, "model.moe_shared_expert_gate", True,
                 "needs model.moe_shared_expert_intermediate_size (there is no shared expert to gate)")


def _validate_router_groups(m: ModelConfig) -> None:
    """Group-limited top-k: groups split the experts evenly and leave at least top-k experts to choose from."""
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    require(groups is not None, "model.moe_router_num_groups", groups,
             f"must be set with model.moe_router_group_topk={group_topk}")
    require(group_topk is not None, "model.moe_router_group_topk", group_topk,
             f"must be set with model.moe_router_num_groups={groups}")
    require(groups >= 1 and m.num_moe_experts % groups == 0, "model.moe_router_num_groups", groups,
             f"must be >= 1 and divide model.num_moe_experts={m.num_moe_experts}")
    require(1 <= group_topk <= groups, "model.moe_router_group_topk", group_topk,
             f"must be in [1, model.moe_router_num_groups={groups}]")
    # Megatron scores a group by the sum of its top (topk // group_topk) scores: that must be at least one.
    require(group_topk <= m.moe_router_topk, "model.moe_router_group_topk", group_topk,
             f"must be <= model.moe_router_topk={m.moe_router_topk} (a group scores its top topk // group_topk)")
    eligible = group_topk * (m.num_moe_experts // groups)
    require(m.moe_router_topk <= eligible, "model.moe_router_topk", m.moe_router_topk,
             f"must be <= the experts of the chosen groups, moe_router_group_topk x num_moe_experts / "
             f"moe_router_num_groups = {eligible}")


def _validate_pipeline_split(m: ModelConfig, p: ParallelConfig) -> None:
    """Layers over PP x VPP virtual stages: evenly, or with the first / last pipeline rank's count given (the
    other ranks share the rest evenly); every virtual stage gets at least one layer."""
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    if vpp is not None:
        require(vpp >= 1, "parallel.virtual_pipeline_model_parallel_size", vpp, "must be >= 1 or null")
        require(pp > 1, "parallel.virtual_pipeline_model_parallel_size", vpp,
                 "needs parallel.pipeline_model_parallel_size > 1 (virtual stages interleave pipeline ranks)")
    vpp = vpp or 1
    uneven = {name: getattr(p, name) for name in ("num_layers_in_first_pipeline_stage",
                                                  "num_layers_in_last_pipeline_stage") if getattr(p, name) is not None}
    if not uneven:
        require(m.num_layers % (pp * vpp) == 0, "model.num_layers", m.num_layers,
                 f"must be divisible by pipeline_model_parallel_size x virtual_pipeline_model_parallel_size"
                 f"={pp * vpp} (or set parallel.num_layers_in_first_pipeline_stage / "
                 "num_layers_in_last_pipeline_stage)")
        return
    for name, count in uneven.items():
        require(pp > 1, f"parallel.{name}", count, "needs parallel.pipeline_model_parallel_size > 1")
        require(count >= vpp and count % vpp == 0, f"parallel.{name}", count,
                 f"must be a positive multiple of the virtual stages per rank, {vpp} (each gets an equal share)")
    rest, ranks = m.num_layers - sum(uneven.values()), pp - len(uneven)
    name, count = next(iter(uneven.items()))
    if ranks == 0:
        require(rest == 0, f"parallel.{name}", count,
                 f"with PP=2 the first and last stage hold every layer: they must add up to model.num_layers="
                 f"{m.num_layers}")
    else:
        require(rest >= ranks * vpp and rest % (ranks * vpp) == 0, f"parallel.{name}", count,
                 f"leaves {rest} of model.num_layers={m.num_layers} layers to the other {ranks} pipeline ranks x "
                 f"{vpp} virtual stages: must be a positive multiple of {ranks * vpp}")


def validate_for_world(cfg: Config, world_size: int, device_type: str) -> None:
    """Rules that need the world size and device: divisibility of the layout and the batch."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size
    require(world_size % model_parallel == 0, "world_size", world_size,
             f"must be divisible by tensor x context x pipeline parallel sizes = {model_parallel}")
    expert_ranks = p.expert_model_parallel_size * cfg.expert_tensor_parallel_size
    stage_ranks = world_size // p.pipeline_model_parallel_size
    require(stage_ranks % expert_ranks == 0, "parallel.expert_model_parallel_size", p.expert_model_parallel_size,
             f"expert_model_parallel_size x expert_tensor_parallel_size = {expert_ranks} must divide "
             f"world_size / pipeline_model_parallel_size = {stage_ranks}")
    dp = cfg.data_parallel_size(world_size)
    require(t.global_batch_size % (t.micro_batch_size * dp) == 0, "train.global_batch_size", t.global_batch_size,
             f"must be divisible by train.micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp}")
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    if cfg.overlap.overlap_moe_expert_parallel_comm is True:  # auto pairs only with micro-batches to pair
        m = cfg.num_micro_batches(world_size)
        require(m >= 2, "overlap.overlap_moe_expert_parallel_comm", True,
                 f"pairs micro-batches: train.global_batch_size={t.global_batch_size} gives {m} per data-parallel "
                 "rank, nothing to pair (raise it to at least 2 x micro_batch_size x data-parallel size)")
    if vpp > 1:
        m = cfg.num_micro_batches(world_size)
        require(m % pp == 0, "train.global_batch_size", t.global_batch_size,
                 f"gives {m} micro-batches per data-parallel rank; virtual pipeline stages take them in groups of "
                 f"parallel.pipeline_model_parallel_size={pp}: need a multiple")
    refuse(graph_device_refusal(device_type) if t.moe_cuda_graph is True else None)
    require(t.fp8_recipe is None or device_type == "cuda", "train.fp8_recipe", t.fp8_recipe,
            f"{FP8_NEEDS_GPU}; the device is {device_type!r}")
    if t.fp8_param is True and t.use_distributed_optimizer:  # hold_fp8_weights: one-rank shard groups only
        dp_cp = dp * p.context_parallel_size
        edp = stage_ranks // expert_ranks
        require(dp_cp == 1 and edp == 1, "train.fp8_param", True,
                "with train.use_distributed_optimizer=true is not implemented yet where the optimizer shards a weight "
                f"over more than one rank (data-parallel x context-parallel size {dp_cp}, expert-data-parallel size "
                f"{edp}: its all-gather moves the bf16 values): leave it at auto, which holds the weights whose shards "
                "are whole")
    cpu_values = (("dp_comm_ctas", (None,)), ("ep_comm_ctas", (None,)), ("gemm_sm_carveout", (0, "auto")))
    for name, anywhere in cpu_values:  # what sets no communicator or GEMM passes anywhere
        value = getattr(cfg.overlap, name)
        require(value in anywhere or device_type == "cuda", f"overlap.{name}", value,
                 f"sets NCCL communicators and cuBLAS GEMMs: needs train.device=cuda; the device is {device_type!r}")
    refuse(device_refusal(cfg.overlap.moe_transport, device_type))
    backend = cfg.overlap.tp_comm_backend
    wanted = {"cpu": ("auto", "p2p"), "cuda": ("auto", "p2p", "symm")}[device_type]
    require(backend in wanted, "overlap.tp_comm_backend", backend,
            f"'{backend}' cannot run on device {device_type!r}; use one of {', '.join(wanted)}")
