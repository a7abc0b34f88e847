"""Typed run configuration: YAML in, dotted overrides, validated before any process group exists.

Field names follow Megatron-Core / NeMo where the meaning is the same. Every error names the field
(``section.name``), the value given and what is allowed. A field whose behaviour is not built yet is
rejected with "not implemented yet" when set to anything but its default, never accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A bad configuration value; the message names the field, the value and what is allowed."""

    def __init__(self, field_name: str, value: Any, allowed: str):
        self.field_name, self.value, self.allowed = field_name, value, allowed
        super().__init__(f"{field_name}={value!r}: {allowed}")


def _not_implemented(field_name: str, value: Any, default: Any, waits_for: str) -> ConfigError:
    return ConfigError(field_name, value, f"not implemented yet ({waits_for}); only {default!r} is supported")


@dataclass
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 128
    ffn_hidden_size: int = 384
    num_attention_heads: int = 8
    num_query_groups: Optional[int] = None  # None: multi-head attention (= num_attention_heads)
    vocab_size: int = 256
    seq_length: int = 128
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    share_embeddings_and_output_weights: bool = False
    kv_channels: Optional[int] = None  # channels per attention head; None: hidden_size / num_attention_heads
    add_qkv_bias: bool = False  # a bias on the query, key and value projections (Qwen2)
    qk_layernorm: bool = False  # RMSNorm of queries and keys before RoPE
    # its channels: each head's (one weight shared by the heads: Qwen3, Megatron) or a token's whole query /
    # key projection (a weight per channel: OLMoE)
    qk_layernorm_scope: Literal["head", "all_heads"] = "head"
    # MoE. num_moe_experts None: a dense model.
    num_moe_experts: Optional[int] = None
    # Megatron semantics: an int N makes every N-th layer (0, N, 2N, ...) MoE; a list of 0/1 per layer.
    moe_layer_freq: Union[int, list[int]] = 1
    moe_ffn_hidden_size: Optional[int] = None  # None: ffn_hidden_size
    moe_router_topk: int = 2
    # False (Mixtral): softmax over the top-k logits. True: softmax over all experts, then top-k.
    moe_router_pre_softmax: bool = False
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    # Benchmarks only (torchtitan's debug switch): copy j of token t goes to expert (t * topk + j) mod experts, the
    # weights are the router's scores there; the model does not learn routing.
    moe_router_force_load_balancing: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_overlap: bool = False
    moe_shared_expert_gate: bool = False  # the shared expert's output scaled by a per-token sigmoid gate (Qwen2-MoE)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def is_moe_layer(self, layer_index: int) -> bool:
        if self.num_moe_experts is None:
            return False
        if isinstance(self.moe_layer_freq, int):
            return layer_index % self.moe_layer_freq == 0
        return bool(self.moe_layer_freq[layer_index])


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    # How the ring attention's key-value blocks move between CP ranks (Megatron's name); only p2p is built.
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = "p2p"
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # None: tensor_model_parallel_size
    sequence_parallel: bool = False
    # Uneven pipeline split (Megatron's names): layers on the first / last pipeline rank (over all its virtual
    # stages); the other ranks share the rest evenly. None: an even split.
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None


@dataclass
class OverlapConfig:
    overlap_grad_sync: bool = False
    overlap_param_sync: bool = False
    grad_sync_dtype: Literal["fp32", "bf16"] = "fp32"
    # Distributed optimizer buckets (Megatron's ddp_bucket_size, in MB of grad_sync_dtype payload);
    # None: one Transformer layer per bucket (dense and expert parameters in separate buckets).
    bucket_size_mb: Optional[float] = None
    # CTAs (NCCL channels) of the data-parallel communicators that reduce gradients and gather parameters
    # (mesh groups dp, dp_cp, edp); null: NCCL's choice. Few CTAs leave the SMs to the GEMMs they hide under.
    dp_comm_ctas: Optional[int] = None
    # The same for the expert-parallel communicator (mesh group ep: the MoE all-to-all over nccl).
    ep_comm_ctas: Optional[int] = None
    # SMs a GEMM with communication beside it leaves free (torch's SM carve-out), so that a communication kernel
    # starts at once instead of queueing behind the GEMM's full-chip grid: the MoE pipeline's grouped GEMMs while
    # rows move beside them (an SM push takes that many CTAs), and with the distributed optimizer's overlaps the
    # GEMMs its syncs run beside (the first micro-batch's forward, the last one's backward). 0: none; auto: the
    # measured pairings (2 x ep_comm_ctas, 4 x dp_comm_ctas; 0 without a cap) and, for SM pushes, the CTAs that
    # move a chunk's rows in its GEMM's time.
    gemm_sm_carveout: Union[int, Literal["auto"]] = 0
    tp_comm_overlap: bool = False
    tp_comm_overlap_ag: bool = False
    tp_comm_overlap_rs: bool = False
    tp_comm_overlap_rs_dgrad: bool = False
    tp_comm_bulk_dgrad: bool = False
    tp_comm_bulk_wgrad: bool = False
    tp_comm_num_splits: int = 4
    tp_comm_backend: Literal["auto", "p2p", "symm"] = "auto"
    # Ring attention: the next key-value block (and a block's gradient) moves while the block in hand is computed.
    cp_comm_overlap: bool = False
    overlap_p2p_comm: bool = False
    batch_p2p_comm: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    # The MoE exchange as a pipeline of chunks (runs of local experts) beside the grouped GEMMs, forward and
    # backward; false: the serial reference (one all-to-all each way, sizes from the host).
    moe_pipeline: bool = False
    moe_pipeline_chunks: int = 1
    # Where the pipeline's exchange sizes are planned: host (one fetch of every rank's counts per layer, exact
    # buffers), device (no host sync, worst-case buffers, CUDA-graph capturable), auto (device when the
    # transport takes device sizes).
    moe_planning: Literal["auto", "host", "device"] = "auto"
    # What moves the rows: nccl, copy_engine (symmetric memory, host sizes), sm_push (Triton stores into
    # symmetric memory, device sizes), gloo (CPU); auto: sm_push or copy_engine on one host with peer access
    # (by moe_planning), else nccl; gloo on CPU.
    moe_transport: Literal["auto", "nccl", "copy_engine", "sm_push", "gloo"] = "auto"
    # A benchmark's reference, not training: every EP exchange keeps its sizes, signals and small messages (each
    # layer still waits for its slowest rank) but each rank's rows land in its own memory, so the step runs the
    # expert GEMMs on exactly the rows each rank would receive without moving them. The loss means nothing.
    moe_compute_only: bool = False


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 16
    max_steps: int = 200
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_steps: int = 10
    lr_decay_steps: Optional[int] = None  # None: max_steps
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global gradient-norm clip; 0 disables
    on_nonfinite_grad: Literal["skip", "stop"] = "skip"  # a NaN/inf gradient norm skips the step, or stops
    # Shard fp32 master weights and Adam states over data-parallel ranks (Megatron's name); false: the
    # plain all-reduce optimizer, the serial reference.
    use_distributed_optimizer: bool = False
    seed: int = 1234
    precision: Literal["fp32", "bf16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    recompute_granularity: Literal["none", "full"] = "none"
    # Pipeline schedule (PP > 1); null: 1f1b, or interleaved_1f1b with virtual stages.
    pipeline_schedule: Optional[Literal["all_forward_all_backward", "1f1b", "interleaved_1f1b", "zb_h1"]] = None
    # Replay each MoE layer's forward and backward from CUDA graphs (needs overlap.moe_planning=device).
    moe_cuda_graph: bool = False
    # Sum the experts' weight gradients of two consecutive micro-batches in one grouped kernel: main_grad is read
    # and written once per pair (fewer, larger experts gain most), one micro-batch's wgrad inputs kept per layer.
    expert_wgrad_pairs: bool = False
    # MFU's denominator, TFLOP/s per GPU: an H200's (and H100's) measured bf16 GEMM rate.
    peak_tflops: float = 788.0
    # [first, last] (1-based): profile those steps on profile_ranks into <output_dir>/profile (trace, timeline,
    # the step's time by kind of work); null: no profile.
    profile_steps: Optional[list[int]] = None
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    eval_interval: int = 50  # 0: never
    eval_iters: int = 4
    log_interval: int = 1
    output_dir: str = "runs/default"
    # auto: continue from the newest good checkpoint if there is one, else start fresh; true: the same, but a
    # missing checkpoint is a warning; required: a missing checkpoint is an error; false: start fresh (and
    # refuse a checkpoint.dir whose checkpoints this run's saves would overwrite).
    resume: Union[bool, Literal["auto", "required"]] = "auto"
    # Stop cleanly (finish the step, save, exit 0) after this many minutes of training, as Megatron's
    # --exit-duration-in-mins; null: no limit.
    exit_duration_min: Optional[float] = None
    # A checkpoint (an imported Hugging Face model, or a run's) whose model weights a fresh run starts from;
    # each rank reads its own slices. A resumable checkpoint of this run takes precedence (train.resume).
    init_from: Optional[str] = None
    distributed_timeout_s: float = 120.0


@dataclass
class DataConfig:
    # None: the bundled public-domain corpus, byte-level tokens; synthetic:uniform or synthetic:zipf:S: ids drawn
    # from a stream seeded by train.seed, no file (synthetic_source); else a flat token file.
    path: Optional[str] = None
    dtype: Literal["uint16", "uint32"] = "uint16"
    validation_fraction: float = 0.05


@dataclass
class CheckpointConfig:
    save_interval: int = 0  # steps between saves; 0: only the final save
    save_final: bool = True
    dir: Optional[str] = None  # None: <train.output_dir>/checkpoints
    keep_last: int = 2


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.train.output_dir) / "checkpoints"

    @property
    def expert_tensor_parallel_size(self) -> int:
        return self.parallel.expert_tensor_parallel_size or self.parallel.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        p = self.parallel
        return world_size // (p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size)

    def num_micro_batches(self, world_size: int) -> int:
        """Micro-batches each data-parallel rank runs per step (gradient accumulation)."""
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size(world_size))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SYNTHETIC_PREFIX = "synthetic:"


@dataclass(frozen=True)
class SyntheticSource:
    """A ``data.path`` of ``synthetic:uniform`` or ``synthetic:zipf:S``: ids over the vocabulary, no file."""

    distribution: Literal["uniform", "zipf"]
    exponent: Optional[float] = None  # Zipf's S > 0: id r is drawn with probability proportional to (r + 1)^-S


def synthetic_source(path: Optional[str]) -> Optional[SyntheticSource]:
    """The synthetic source ``data.path`` names; None for a token file or the bundled corpus (null)."""
    if path is None or not path.startswith(SYNTHETIC_PREFIX):
        return None
    parts = path[len(SYNTHETIC_PREFIX):].split(":")
    if parts == ["uniform"]:
        return SyntheticSource("uniform")
    if len(parts) == 2 and parts[0] == "zipf":
        try:
            exponent = float(parts[1])
        except ValueError:
            exponent = math.nan
        if math.isfinite(exponent) and exponent > 0:
            return SyntheticSource("zipf", exponent)
    raise ConfigError("data.path", path, "a synthetic source is synthetic:uniform or synthetic:zipf:S with a Zipf "
                                         "exponent S > 0 (e.g. synthetic:zipf:1.1)")


# --------------------------------------------------------------------------------------------- loading

# The dispatch fields of the three paths that the MoE pipeline replaced: (their default, what to write instead).
_REPLACED = {
    "overlap.moe_overlap_dispatch": (False, "use overlap.moe_pipeline=true overlap.moe_planning=host"),
    "overlap.moe_sync_free_dispatch": (False, "use overlap.moe_pipeline=true overlap.moe_planning=device"),
    "overlap.moe_a2a_chunks": (1, "use overlap.moe_pipeline_chunks"),
    "overlap.moe_a2a_backend": ("auto", "use overlap.moe_transport (symm: copy_engine with overlap.moe_planning=host, "
                                        "sm_push with overlap.moe_planning=device; auto, nccl, gloo as before)"),
}


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-4`` and ``1.0e5`` as floats (YAML 1.2); PyYAML's YAML 1.1 rules
    need a dot and a signed exponent, and would hand ``lr: 1e-4`` over as the string '1e-4'."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """YAML file (or the defaults) plus ``section.field=value`` overrides, typed and checked field by field.

    World-size rules are checked separately by :func:`validate_for_world`, once the world size is known.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml_file(Path(path))
    for item in overrides:
        _apply_override(raw, item)
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def config_yaml(cfg: Config) -> str:
    """The whole config as YAML that :func:`load_config` reads back to the same config."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def _read_yaml_file(path: Path) -> dict:
    """The file's mapping of sections; malformed YAML is named by file, line and column."""
    if not path.is_file():
        raise ConfigError("config", str(path), "no such file")
    sections = f"the YAML must be a mapping of sections ({', '.join(f.name for f in dataclasses.fields(Config))})"
    try:
        with open(path) as f:
            raw = yaml.load(f, Loader=_YamlLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)  # 1-based, as editors
        raise ConfigError("config", where, f"not valid YAML: {_yaml_problem(err)}") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("config", str(path), f"cannot be read as a text file ({err})") from err
    if raw is None:
        raise ConfigError("config", str(path), f"is empty; {sections}")
    if not isinstance(raw, dict):
        what = "a list" if isinstance(raw, list) else f"the single value {raw!r}"
        raise ConfigError("config", str(path), f"holds {what}; {sections}")
    return raw


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's problem and its context, on one line."""
    problem = " ".join(str(getattr(err, "problem", None) or err).split())
    context = getattr(err, "context", None)
    return f"{problem} ({' '.join(str(context).split())})" if context else problem


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        why = "has no '='" if not sep else "names no section.field"
        raise ConfigError("override", item, f"{why}: expected section.field=value, e.g. "
                          "parallel.expert_model_parallel_size=2")
    section, name = parts
    if raw.get(section) is None:  # absent, or an empty section in the file (`parallel:` with no fields)
        raw[section] = {}
    if not isinstance(raw[section], dict):
        raise ConfigError(section, raw[section], "a section must be a mapping")
    # YAML parses the value, so `true`, `3`, `1e-3`, `null` and `[0,1,1]` mean what they do in the file.
    try:
        raw[section][name] = yaml.load(text, Loader=_YamlLoader) if text.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError("override", item, f"the value is not valid YAML: {_yaml_problem(err)}") from err


def _suggest(name: str, choices: list[str], kind: str = "field") -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f"unknown {kind}; did you mean {close[0]!r}?" if close else f"unknown {kind}; known: {', '.join(choices)}"


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(where, raw, "expected a mapping")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if f"{prefix}{key}" in _REPLACED:
            default, replacement = _REPLACED[f"{prefix}{key}"]
            if raw[key] != default:  # at its default (as every saved config.yaml holds it) it means the new default
                raise ConfigError(f"{prefix}{key}", raw[key], f"was replaced: {replacement}")
        elif key not in names:
            raise ConfigError(f"{prefix}{key}", raw[key], _suggest(str(key), names, "field" if prefix else "section"))
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            values[f.name] = _build(tp, raw[f.name], f"{prefix}{f.name}.")
        else:
            values[f.name] = _coerce(raw[f.name], tp, f"{prefix}{f.name}")
    return cls(**values)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, name)
            except ConfigError:
                continue
        raise ConfigError(name, value, f"expected {_describe(tp)}")
    if tp is type(None):
        if value is None:
            return None
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is list:
        if isinstance(value, list):
            return [_coerce(v, typing.get_args(tp)[0], name) for v in value]
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(name, value, f"expected {_describe(tp)}")


# ------------------------------------------------------------------------------------------ validation


MAX_NCCL_CTAS = 64  # NCCL's MAXCHANNELS


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(name, value, allowed)


def validate(cfg: Config) -> None:
    """Ranges, cross-field rules and not-yet-implemented features; independent of the world size."""
    m, p, o, t, d, c = cfg.model, cfg.parallel, cfg.overlap, cfg.train, cfg.data, cfg.checkpoint

    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                 "seq_length"):
        _require(getattr(m, name) >= 1, f"model.{name}", getattr(m, name), "must be >= 1")
    for name in ("hidden_size", "ffn_hidden_size"):
        # torch._grouped_mm needs 16-byte row strides; multiples of 8 keep bf16 and fp32 both aligned.
        _require(getattr(m, name) % 8 == 0, f"model.{name}", getattr(m, name), "must be a multiple of 8")
    if m.kv_channels is None:
        _require(m.hidden_size % m.num_attention_heads == 0, "model.num_attention_heads", m.num_attention_heads,
                 f"must divide model.hidden_size={m.hidden_size} (or set model.kv_channels)")
        _require(m.head_dim % 2 == 0, "model.num_attention_heads", m.num_attention_heads,
                 f"head dim hidden_size/num_attention_heads={m.head_dim} must be even for rotary embeddings")
    else:
        _require(m.kv_channels >= 2 and m.kv_channels % 2 == 0, "model.kv_channels", m.kv_channels,
                 "must be a positive even number (rotary embeddings rotate channel pairs), or null")
    _require(m.qk_layernorm or m.qk_layernorm_scope == "head", "model.qk_layernorm_scope", m.qk_layernorm_scope,
             "needs model.qk_layernorm=true")
    if m.num_query_groups is not None:
        _require(m.num_query_groups >= 1 and m.num_attention_heads % m.num_query_groups == 0,
                 "model.num_query_groups", m.num_query_groups,
                 f"must be >= 1 and divide model.num_attention_heads={m.num_attention_heads}")
    _require(m.rotary_base > 0, "model.rotary_base", m.rotary_base, "must be > 0")
    _require(m.norm_epsilon > 0, "model.norm_epsilon", m.norm_epsilon, "must be > 0")
    _require(m.init_method_std > 0, "model.init_method_std", m.init_method_std, "must be > 0")
    _validate_moe(m)

    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        _require(getattr(p, name) >= 1, f"parallel.{name}", getattr(p, name), "must be >= 1")
    if p.expert_tensor_parallel_size is not None:
        _require(p.expert_tensor_parallel_size >= 1, "parallel.expert_tensor_parallel_size",
                 p.expert_tensor_parallel_size, "must be >= 1 (or null: tensor_model_parallel_size)")
    if m.num_moe_experts is not None:
        _require(m.num_moe_experts % p.expert_model_parallel_size == 0, "parallel.expert_model_parallel_size",
                 p.expert_model_parallel_size, f"must divide model.num_moe_experts={m.num_moe_experts}")
    else:
        _require(p.expert_model_parallel_size == 1, "parallel.expert_model_parallel_size",
                 p.expert_model_parallel_size, "must be 1 for a dense model (model.num_moe_experts is null)")
    tp = p.tensor_model_parallel_size
    _require(m.num_attention_heads % tp == 0, "model.num_attention_heads", m.num_attention_heads,
             f"must be divisible by parallel.tensor_model_parallel_size={tp}")
    _require(m.query_groups % tp == 0, "model.num_query_groups", m.query_groups,
             f"must be divisible by parallel.tensor_model_parallel_size={tp}")
    _require(m.ffn_hidden_size % tp == 0, "model.ffn_hidden_size", m.ffn_hidden_size,
             f"must be divisible by parallel.tensor_model_parallel_size={tp}")
    _require(m.vocab_size % tp == 0, "model.vocab_size", m.vocab_size,
             f"must be divisible by parallel.tensor_model_parallel_size={tp} (each TP rank holds a vocabulary block)")
    _require(m.expert_ffn_hidden_size % cfg.expert_tensor_parallel_size == 0, "model.moe_ffn_hidden_size",
             m.expert_ffn_hidden_size,
             f"must be divisible by parallel.expert_tensor_parallel_size={cfg.expert_tensor_parallel_size}")
    _validate_pipeline_split(m, p)
    if p.sequence_parallel:
        _require(m.seq_length % tp == 0, "model.seq_length", m.seq_length,
                 f"must be divisible by parallel.tensor_model_parallel_size={tp} under sequence_parallel")
    _validate_context_parallel(m, p, o, t)
    if tp > 1 and m.num_moe_experts is not None:
        _require(p.sequence_parallel, "parallel.sequence_parallel", p.sequence_parallel,
                 "must be true for a MoE model with tensor_model_parallel_size > 1 (as Megatron-Core: each TP rank "
                 "routes its own sequence block)")

    _validate_overlap(o, p, m)
    _validate_pipeline(cfg)
    _validate_moe_overlap(m, o, p)
    _validate_moe_cuda_graph(t, o, p)
    _validate_expert_wgrad_pairs(t, o, m, p)
    _validate_microbatch_overlap(cfg)
    _validate_distributed_optimizer(o, t)
    _validate_comm_resources(o)

    for name in ("micro_batch_size", "global_batch_size", "max_steps", "eval_iters", "log_interval"):
        _require(getattr(t, name) >= 1, f"train.{name}", getattr(t, name), "must be >= 1")
    _require(t.global_batch_size % t.micro_batch_size == 0, "train.global_batch_size", t.global_batch_size,
             f"must be a multiple of train.micro_batch_size={t.micro_batch_size}")
    _require(t.lr > 0, "train.lr", t.lr, "must be > 0")
    _require(0 <= t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"must be in [0, train.lr={t.lr}]")
    _require(t.lr_warmup_steps >= 0, "train.lr_warmup_steps", t.lr_warmup_steps, "must be >= 0")
    if t.lr_decay_steps is not None:
        _require(t.lr_decay_steps > t.lr_warmup_steps, "train.lr_decay_steps", t.lr_decay_steps,
                 f"must be > train.lr_warmup_steps={t.lr_warmup_steps}")
    _require(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        _require(0 <= getattr(t, name) < 1, f"train.{name}", getattr(t, name), "must be in [0, 1)")
    _require(t.adam_eps > 0, "train.adam_eps", t.adam_eps, "must be > 0")
    _require(t.clip_grad >= 0, "train.clip_grad", t.clip_grad, "must be >= 0 (0 disables clipping)")
    _require(t.seed >= 0, "train.seed", t.seed, "must be >= 0")
    _require(t.eval_interval >= 0, "train.eval_interval", t.eval_interval, "must be >= 0 (0: never)")
    _require(t.distributed_timeout_s > 0, "train.distributed_timeout_s", t.distributed_timeout_s, "must be > 0")
    if t.exit_duration_min is not None:
        _require(t.exit_duration_min > 0, "train.exit_duration_min", t.exit_duration_min,
                 "must be > 0 minutes (or null: no limit)")
    _require(bool(t.output_dir), "train.output_dir", t.output_dir, "must be a non-empty path")
    _require(t.peak_tflops > 0, "train.peak_tflops", t.peak_tflops, "must be > 0 (TFLOP/s per GPU)")
    if t.profile_steps is not None:
        _require(len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1], "train.profile_steps",
                 t.profile_steps, "must be [first, last] steps, 1 <= first <= last (or null: no profile)")
    _require(all(rank >= 0 for rank in t.profile_ranks), "train.profile_ranks", t.profile_ranks,
             "must list ranks >= 0")
    _require(t.init_from is None or bool(t.init_from), "train.init_from", t.init_from,
             "must be a checkpoint path, or null: initialise from train.seed")

    _require(0 < d.validation_fraction <= 0.5, "data.validation_fraction", d.validation_fraction,
             "must be in (0, 0.5]")
    if synthetic_source(d.path) is not None:
        _require(d.dtype == DataConfig.dtype, "data.dtype", d.dtype,
                 f"has no effect with data.path={d.path!r} (its ids are drawn, not read): leave it at "
                 f"{DataConfig.dtype!r}")
    elif d.path is not None:
        _require(m.vocab_size <= (65536 if d.dtype == "uint16" else 2**32), "model.vocab_size", m.vocab_size,
                 f"must fit data.dtype={d.dtype}")
    else:
        _require(m.vocab_size >= 256, "model.vocab_size", m.vocab_size,
                 "must be >= 256 for the bundled byte-level corpus (data.path is null)")

    _require(c.save_interval >= 0, "checkpoint.save_interval", c.save_interval, "must be >= 0 (0: final save only)")
    _require(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, "must be >= 1")


def _validate_context_parallel(m: ModelConfig, p: ParallelConfig, o: OverlapConfig, t: TrainConfig) -> None:
    """The load-balanced split cuts each sequence into 2 x CP chunks; what CP does not compose with yet."""
    cp = p.context_parallel_size
    if p.cp_comm_type != "p2p":
        raise _not_implemented("parallel.cp_comm_type", p.cp_comm_type, "p2p", "only the p2p ring is built")
    if cp == 1:
        _require(not o.cp_comm_overlap, "overlap.cp_comm_overlap", True,
                 "has no effect with parallel.context_parallel_size=1 (there is no ring)")
        return
    _require(m.seq_length % (2 * cp) == 0, "model.seq_length", m.seq_length,
             f"must be divisible by 2 x parallel.context_parallel_size={2 * cp} (CP rank r holds chunks r and "
             f"{2 * cp - 1}-r of every sequence)")
    if p.sequence_parallel:
        tp = p.tensor_model_parallel_size
        _require(m.seq_length // cp % tp == 0, "model.seq_length", m.seq_length,
                 f"must be divisible by parallel.context_parallel_size x tensor_model_parallel_size={cp * tp} under "
                 "sequence_parallel (each TP rank holds a block of the CP rank's local sequence)")
    if p.pipeline_model_parallel_size != 1:
        raise _not_implemented("parallel.context_parallel_size", cp, 1, "context parallelism with pipeline stages")
    if t.moe_cuda_graph:
        raise _not_implemented("train.moe_cuda_graph", True, False,
                               "graphs of MoE layers under context parallelism: the router gathers over the CP group")


def _validate_moe(m: ModelConfig) -> None:
    if m.num_moe_experts is None:
        defaults = ModelConfig()
        for f in dataclasses.fields(m):
            if f.name.startswith("moe_") and getattr(m, f.name) != getattr(defaults, f.name):
                raise ConfigError(f"model.{f.name}", getattr(m, f.name),
                                  "has no effect on a dense model; set model.num_moe_experts or remove it")
        return
    _require(m.num_moe_experts >= 1, "model.num_moe_experts", m.num_moe_experts, "must be >= 1 (or null: dense)")
    _require(1 <= m.moe_router_topk <= m.num_moe_experts, "model.moe_router_topk", m.moe_router_topk,
             f"must be in [1, model.num_moe_experts={m.num_moe_experts}]")
    if isinstance(m.moe_layer_freq, int):
        _require(m.moe_layer_freq >= 1, "model.moe_layer_freq", m.moe_layer_freq, "must be >= 1 (or a list of 0/1)")
    else:
        _require(len(m.moe_layer_freq) == m.num_layers and set(m.moe_layer_freq) <= {0, 1}, "model.moe_layer_freq",
                 m.moe_layer_freq, f"a list must hold one 0 or 1 per layer (model.num_layers={m.num_layers})")
    if m.moe_ffn_hidden_size is not None:
        _require(m.moe_ffn_hidden_size >= 8 and m.moe_ffn_hidden_size % 8 == 0, "model.moe_ffn_hidden_size",
                 m.moe_ffn_hidden_size, "must be a positive multiple of 8")
    _require(m.moe_aux_loss_coeff >= 0, "model.moe_aux_loss_coeff", m.moe_aux_loss_coeff, "must be >= 0")
    _require(m.moe_z_loss_coeff >= 0, "model.moe_z_loss_coeff", m.moe_z_loss_coeff, "must be >= 0")
    if m.moe_router_load_balancing_type == "none":
        _require(m.moe_aux_loss_coeff == 0, "model.moe_aux_loss_coeff", m.moe_aux_loss_coeff,
                 "must be 0 when model.moe_router_load_balancing_type is 'none'")
    if m.moe_expert_capacity_factor is not None:
        _require(m.moe_expert_capacity_factor > 0, "model.moe_expert_capacity_factor", m.moe_expert_capacity_factor,
                 "must be > 0 (or null: dropless)")
    _validate_router_groups(m)
    if m.moe_router_enable_expert_bias:
        _require(m.moe_router_score_function == "sigmoid", "model.moe_router_enable_expert_bias", True,
                 "needs model.moe_router_score_function='sigmoid' (as Megatron-Core)")
    _require(m.moe_router_bias_update_rate > 0, "model.moe_router_bias_update_rate", m.moe_router_bias_update_rate,
             "must be > 0")
    if m.moe_pad_expert_input_to_capacity:
        _require(m.moe_expert_capacity_factor is not None, "model.moe_pad_expert_input_to_capacity", True,
                 "needs model.moe_expert_capacity_factor (padding fills each expert's capacity)")
    if m.moe_shared_expert_intermediate_size is not None:
        _require(m.moe_shared_expert_intermediate_size >= 8 and m.moe_shared_expert_intermediate_size % 8 == 0,
                 "model.moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size,
                 "must be a positive multiple of 8 (or null: no shared expert)")
    if m.moe_shared_expert_overlap:
        _require(m.moe_shared_expert_intermediate_size is not None, "model.moe_shared_expert_overlap", True,
                 "needs model.moe_shared_expert_intermediate_size (there is no shared expert to overlap)")
    if m.moe_shared_expert_gate:
        _require(m.moe_shared_expert_intermediate_size is not None, "model.moe_shared_expert_gate", True,
                 "needs model.moe_shared_expert_intermediate_size (there is no shared expert to gate)")


def _validate_router_groups(m: ModelConfig) -> None:
    """Group-limited top-k: groups split the experts evenly and leave at least top-k experts to choose from."""
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    _require(groups is not None, "model.moe_router_num_groups", groups,
             f"must be set with model.moe_router_group_topk={group_topk}")
    _require(group_topk is not None, "model.moe_router_group_topk", group_topk,
             f"must be set with model.moe_router_num_groups={groups}")
    _require(groups >= 1 and m.num_moe_experts % groups == 0, "model.moe_router_num_groups", groups,
             f"must be >= 1 and divide model.num_moe_experts={m.num_moe_experts}")
    _require(1 <= group_topk <= groups, "model.moe_router_group_topk", group_topk,
             f"must be in [1, model.moe_router_num_groups={groups}]")
    # Megatron scores a group by the sum of its top (topk // group_topk) scores: that must be at least one.
    _require(group_topk <= m.moe_router_topk, "model.moe_router_group_topk", group_topk,
             f"must be <= model.moe_router_topk={m.moe_router_topk} (a group scores its top topk // group_topk)")
    eligible = group_topk * (m.num_moe_experts // groups)
    _require(m.moe_router_topk <= eligible, "model.moe_router_topk", m.moe_router_topk,
             f"must be <= the experts of the chosen groups, moe_router_group_topk x num_moe_experts / "
             f"moe_router_num_groups = {eligible}")


def _validate_overlap(o: OverlapConfig, p: ParallelConfig, m: ModelConfig) -> None:
    _require(o.tp_comm_num_splits >= 1, "overlap.tp_comm_num_splits", o.tp_comm_num_splits, "must be >= 1")
    _require(o.moe_pipeline_chunks >= 1, "overlap.moe_pipeline_chunks", o.moe_pipeline_chunks, "must be >= 1")
    _validate_tp_overlap(o, p, m)


def _validate_pipeline_split(m: ModelConfig, p: ParallelConfig) -> None:
    """Layers over PP x VPP virtual stages: evenly, or with the first / last pipeline rank's count given (the
    other ranks share the rest evenly); every virtual stage gets at least one layer."""
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    if vpp is not None:
        _require(vpp >= 1, "parallel.virtual_pipeline_model_parallel_size", vpp, "must be >= 1 or null")
        _require(pp > 1, "parallel.virtual_pipeline_model_parallel_size", vpp,
                 "needs parallel.pipeline_model_parallel_size > 1 (virtual stages interleave pipeline ranks)")
    vpp = vpp or 1
    uneven = {name: getattr(p, name) for name in ("num_layers_in_first_pipeline_stage",
                                                  "num_layers_in_last_pipeline_stage") if getattr(p, name) is not None}
    if not uneven:
        _require(m.num_layers % (pp * vpp) == 0, "model.num_layers", m.num_layers,
                 f"must be divisible by pipeline_model_parallel_size x virtual_pipeline_model_parallel_size"
                 f"={pp * vpp} (or set parallel.num_layers_in_first_pipeline_stage / "
                 "num_layers_in_last_pipeline_stage)")
        return
    for name, count in uneven.items():
        _require(pp > 1, f"parallel.{name}", count, "needs parallel.pipeline_model_parallel_size > 1")
        _require(count >= vpp and count % vpp == 0, f"parallel.{name}", count,
                 f"must be a positive multiple of the virtual stages per rank, {vpp} (each gets an equal share)")
    rest, ranks = m.num_layers - sum(uneven.values()), pp - len(uneven)
    name, count = next(iter(uneven.items()))
    if ranks == 0:
        _require(rest == 0, f"parallel.{name}", count,
                 f"with PP=2 the first and last stage hold every layer: they must add up to model.num_layers="
                 f"{m.num_layers}")
    else:
        _require(rest >= ranks * vpp and rest % (ranks * vpp) == 0, f"parallel.{name}", count,
                 f"leaves {rest} of model.num_layers={m.num_layers} layers to the other {ranks} pipeline ranks x "
                 f"{vpp} virtual stages: must be a positive multiple of {ranks * vpp}")


def _validate_pipeline(cfg: Config) -> None:
    """The schedule and its P2P switches: each needs PP > 1; a schedule fits the virtual stages."""
    p, o, t = cfg.parallel, cfg.overlap, cfg.train
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    for name, value in (("overlap.overlap_p2p_comm", o.overlap_p2p_comm), ("overlap.batch_p2p_comm", o.batch_p2p_comm),
                        ("train.pipeline_schedule", t.pipeline_schedule)):
        _require(pp > 1 or value in (False, None), name, value,
                 "has no effect without pipeline parallelism (parallel.pipeline_model_parallel_size > 1)")
    # As Megatron: a batch ends when all its transfers have, so an early receive would hold its sends back.
    _require(not (o.overlap_p2p_comm and o.batch_p2p_comm), "overlap.batch_p2p_comm", True,
             "and overlap.overlap_p2p_comm=true cannot both be set: a batched call ends with its last transfer, "
             "so a receive posted early would hold back the sends batched with it")
    schedule = t.pipeline_schedule
    if schedule == "interleaved_1f1b":
        _require(vpp > 1, "train.pipeline_schedule", schedule,
                 "needs parallel.virtual_pipeline_model_parallel_size > 1")
    if schedule == "1f1b":
        _require(vpp == 1, "train.pipeline_schedule", schedule,
                 f"runs one model chunk per rank; with virtual_pipeline_model_parallel_size={vpp} use "
                 "interleaved_1f1b or all_forward_all_backward")
    if schedule == "zb_h1":
        _require(vpp == 1, "train.pipeline_schedule", schedule,
                 "not implemented yet over virtual stages (ZB-V); use interleaved_1f1b, or zb_h1 without "
                 "parallel.virtual_pipeline_model_parallel_size")
        _require(t.recompute_granularity == "none", "train.pipeline_schedule", schedule,
                 "not implemented yet with train.recompute_granularity='full' (a deferred weight gradient would "
                 "need the recomputed activations); use 1f1b")
    if pp > 1 and t.moe_cuda_graph:
        raise _not_implemented("train.moe_cuda_graph", True, False,
                               "graphed MoE layers under pipeline parallelism (a graph keeps one micro-batch's "
                               "activations; a pipeline holds several)")


def _validate_tp_overlap(o: OverlapConfig, p: ParallelConfig, m: ModelConfig) -> None:
    """One switch per overlap, each under the master switch tp_comm_overlap, all only with sequence parallelism."""
    sub_switches = ("tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_bulk_dgrad",
                    "tp_comm_bulk_wgrad")
    for name in ("tp_comm_overlap",) + sub_switches:
        if getattr(o, name) and not p.sequence_parallel:
            raise ConfigError(f"overlap.{name}", True, "TP communication overlap needs parallel.sequence_parallel=true")
    for name in sub_switches:
        _require(not getattr(o, name) or o.tp_comm_overlap, f"overlap.{name}", True,
                 "needs the master switch overlap.tp_comm_overlap=true")
    _require(o.tp_comm_backend == "auto" or o.tp_comm_overlap, "overlap.tp_comm_backend", o.tp_comm_backend,
             "needs overlap.tp_comm_overlap=true (the serial TP path uses the process group's own collectives)")
    if o.tp_comm_overlap:
        _require(any(getattr(o, name) for name in sub_switches), "overlap.tp_comm_overlap", True,
                 "turns nothing on by itself: set one or more of " + ", ".join(f"overlap.{n}" for n in sub_switches))
    _require(not (o.tp_comm_bulk_wgrad and o.tp_comm_overlap_rs_dgrad), "overlap.tp_comm_bulk_wgrad", True,
             "has nothing to hide with overlap.tp_comm_overlap_rs_dgrad=true (that ring already carries the dgrad's "
             "reduce-scatter); set one of them")
    pipelined = o.tp_comm_overlap_ag or o.tp_comm_overlap_rs or o.tp_comm_overlap_rs_dgrad
    if not pipelined:
        _require(o.tp_comm_num_splits == OverlapConfig().tp_comm_num_splits, "overlap.tp_comm_num_splits",
                 o.tp_comm_num_splits, "has no effect without a pipelined overlap (overlap.tp_comm_overlap_ag, "
                 "overlap.tp_comm_overlap_rs or overlap.tp_comm_overlap_rs_dgrad)")
        return
    block = m.seq_length // (p.tensor_model_parallel_size * p.context_parallel_size)
    _require(block % o.tp_comm_num_splits == 0, "overlap.tp_comm_num_splits", o.tp_comm_num_splits,
             f"must divide the per-rank sequence block, model.seq_length / (parallel.tensor_model_parallel_size x "
             f"parallel.context_parallel_size) = {block}")


def _validate_moe_overlap(m: ModelConfig, o: OverlapConfig, p: ParallelConfig) -> None:
    """The MoE pipeline's fields: each needs the pipeline; planning and transport must agree on where sizes are;
    chunks are runs of local experts."""
    defaults = OverlapConfig()
    for name in ("moe_pipeline_chunks", "delay_wgrad_compute", "moe_planning", "moe_transport", "moe_compute_only"):
        if getattr(o, name) != getattr(defaults, name):
            _require(o.moe_pipeline, f"overlap.{name}", getattr(o, name),
                     "needs overlap.moe_pipeline=true (the serial reference has one chunk, no deferred wgrad, host "
                     "sizes and the process group's own all-to-all)")
    host_sized = ("nccl", "copy_engine")
    _require(not (o.moe_planning == "device" and o.moe_transport in host_sized), "overlap.moe_transport",
             o.moe_transport, "takes host sizes: it cannot run with overlap.moe_planning=device (use sm_push, or "
             "auto)")
    _require(not (o.moe_planning == "host" and o.moe_transport == "sm_push"), "overlap.moe_transport", "sm_push",
             "takes device sizes: it cannot run with overlap.moe_planning=host (use device, or auto)")
    if o.moe_planning == "device" and (p.expert_tensor_parallel_size or p.tensor_model_parallel_size) != 1:
        raise _not_implemented("overlap.moe_planning", "device", "host or auto",
                               "device planning with expert_tensor_parallel_size > 1: the expert-TP gather takes "
                               "host sizes")
    if o.moe_compute_only:
        _require(p.expert_model_parallel_size > 1, "overlap.moe_compute_only", True,
                 "needs parallel.expert_model_parallel_size > 1 (one EP rank exchanges nothing)")
        if (p.expert_tensor_parallel_size or p.tensor_model_parallel_size) != 1:
            raise _not_implemented("overlap.moe_compute_only", True, False,
                                   "with expert_tensor_parallel_size > 1 (the expert-TP gather would still move rows)")
    if m.moe_shared_expert_overlap:
        _require(o.moe_pipeline, "model.moe_shared_expert_overlap", True,
                 "needs overlap.moe_pipeline=true (the shared expert fills the dispatch gap)")
    if o.ep_comm_ctas is not None:
        _require(1 <= o.ep_comm_ctas <= MAX_NCCL_CTAS, "overlap.ep_comm_ctas", o.ep_comm_ctas,
                 f"must be between 1 and {MAX_NCCL_CTAS} (or null: NCCL's choice)")
        _require(p.expert_model_parallel_size > 1, "overlap.ep_comm_ctas", o.ep_comm_ctas,
                 "needs parallel.expert_model_parallel_size > 1 (one EP rank has no EP communicator)")
    if m.num_moe_experts is not None:
        local = m.num_moe_experts // p.expert_model_parallel_size
        _require(o.moe_pipeline_chunks <= local, "overlap.moe_pipeline_chunks", o.moe_pipeline_chunks,
                 f"must be <= the local experts, model.num_moe_experts / parallel.expert_model_parallel_size "
                 f"= {local} (a chunk is a run of local experts)")


def _validate_moe_cuda_graph(t: TrainConfig, o: OverlapConfig, p: ParallelConfig) -> None:
    if not t.moe_cuda_graph:
        return
    _require((o.moe_pipeline and o.moe_planning == "device")
             or (p.expert_model_parallel_size == 1 and p.tensor_model_parallel_size == 1),
             "train.moe_cuda_graph", True, "needs overlap.moe_pipeline=true with overlap.moe_planning=device, or one "
             "EP rank (a graph cannot hold the host-planned paths' host sync)")
    if p.tensor_model_parallel_size != 1:
        raise _not_implemented("train.moe_cuda_graph", True, False, "graphs of MoE layers under tensor parallelism")
    if t.recompute_granularity != "none":
        raise _not_implemented("train.moe_cuda_graph", True, False, "graphs of MoE layers with recomputation")


def _validate_microbatch_overlap(cfg: Config) -> None:
    """``overlap.overlap_moe_expert_parallel_comm``: a schedule with forwards beside backwards, an exchange that can
    be split into stages."""
    m, p, o, t = cfg.model, cfg.parallel, cfg.overlap, cfg.train
    if not o.overlap_moe_expert_parallel_comm:
        return
    name = "overlap.overlap_moe_expert_parallel_comm"
    _require(m.num_moe_experts is not None, name, True, "needs MoE layers (model.num_moe_experts)")
    _require(t.pipeline_schedule != "all_forward_all_backward", name, True,
             "needs a schedule that runs forwards beside backwards: train.pipeline_schedule=all_forward_all_backward "
             "has none to pair; use 1f1b, interleaved_1f1b or zb_h1")
    if t.recompute_granularity != "none":
        raise _not_implemented(name, True, False, "with train.recompute_granularity='full': a layer's stages "
                                                  "would each recompute on their own")
    exchanging = p.expert_model_parallel_size * cfg.expert_tensor_parallel_size > 1
    _require(not exchanging or o.moe_pipeline, name, True, "needs overlap.moe_pipeline=true with more than one "
             "EP or expert-TP rank: the serial exchange blocks, so nothing could run beside it")
    if exchanging and t.moe_cuda_graph:
        raise _not_implemented(name, True, False, "with train.moe_cuda_graph and an exchange: a graphed layer is one "
                                                  "stage, its exchange cannot be split (one EP rank: graphs run)")


def _validate_expert_wgrad_pairs(t: TrainConfig, o: OverlapConfig, m: ModelConfig, p: ParallelConfig) -> None:
    if not t.expert_wgrad_pairs:
        return
    _require(m.num_moe_experts is not None, "train.expert_wgrad_pairs", True, "needs MoE layers (model.num_moe_experts)")
    if t.moe_cuda_graph:
        raise _not_implemented("train.expert_wgrad_pairs", True, False,
                               "with train.moe_cuda_graph: a graph replays one backward, not alternating ones")
    if o.moe_pipeline:
        raise _not_implemented("train.expert_wgrad_pairs", True, False,
                               "with overlap.moe_pipeline, whose chunks schedule their own weight gradients")
    if p.pipeline_model_parallel_size > 1:
        raise _not_implemented("train.expert_wgrad_pairs", True, False,
                               "under pipeline parallelism, whose schedule interleaves other micro-batches' backwards")


def _validate_comm_resources(o: OverlapConfig) -> None:
    if o.dp_comm_ctas is not None:
        _require(1 <= o.dp_comm_ctas <= MAX_NCCL_CTAS, "overlap.dp_comm_ctas", o.dp_comm_ctas,
                 f"must be between 1 and {MAX_NCCL_CTAS} (or null: NCCL's choice)")
    _require(o.gemm_sm_carveout == "auto" or o.gemm_sm_carveout >= 0, "overlap.gemm_sm_carveout",
             o.gemm_sm_carveout, "must be >= 0, or auto")


def _validate_distributed_optimizer(o: OverlapConfig, t: TrainConfig) -> None:
    if o.bucket_size_mb is not None:
        _require(o.bucket_size_mb > 0, "overlap.bucket_size_mb", o.bucket_size_mb,
                 "must be > 0 (or null: one Transformer layer per bucket)")
    if t.use_distributed_optimizer:
        return
    needs = "needs train.use_distributed_optimizer=true (the plain all-reduce optimizer has no buckets)"
    for name in ("overlap_grad_sync", "overlap_param_sync"):
        _require(not getattr(o, name), f"overlap.{name}", getattr(o, name), needs)
    _require(o.bucket_size_mb is None, "overlap.bucket_size_mb", o.bucket_size_mb, needs)


def validate_for_world(cfg: Config, world_size: int, device_type: str) -> None:
    """Rules that need the world size and device: divisibility of the layout and the batch."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size
    _require(world_size % model_parallel == 0, "world_size", world_size,
             f"must be divisible by tensor x context x pipeline parallel sizes = {model_parallel}")
    expert_ranks = p.expert_model_parallel_size * cfg.expert_tensor_parallel_size
    stage_ranks = world_size // p.pipeline_model_parallel_size
    _require(stage_ranks % expert_ranks == 0, "parallel.expert_model_parallel_size", p.expert_model_parallel_size,
             f"expert_model_parallel_size x expert_tensor_parallel_size = {expert_ranks} must divide "
             f"world_size / pipeline_model_parallel_size = {stage_ranks}")
    dp = cfg.data_parallel_size(world_size)
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0, "train.global_batch_size", t.global_batch_size,
             f"must be divisible by train.micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp}")
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    if cfg.overlap.overlap_moe_expert_parallel_comm:
        m = cfg.num_micro_batches(world_size)
        _require(m >= 2, "overlap.overlap_moe_expert_parallel_comm", True,
                 f"pairs micro-batches: train.global_batch_size={t.global_batch_size} gives {m} per data-parallel "
                 "rank, nothing to pair (raise it to at least 2 x micro_batch_size x data-parallel size)")
    if vpp > 1:
        m = cfg.num_micro_batches(world_size)
        _require(m % pp == 0, "train.global_batch_size", t.global_batch_size,
                 f"gives {m} micro-batches per data-parallel rank; virtual pipeline stages take them in groups of "
                 f"parallel.pipeline_model_parallel_size={pp}: need a multiple")
    _require(not t.moe_cuda_graph or device_type == "cuda", "train.moe_cuda_graph", True,
             f"CUDA graphs need train.device=cuda; the device is {device_type!r}")
    for name, default in (("dp_comm_ctas", None), ("ep_comm_ctas", None), ("gemm_sm_carveout", 0)):
        value = getattr(cfg.overlap, name)
        _require(value == default or device_type == "cuda", f"overlap.{name}", value,
                 f"sets NCCL communicators and cuBLAS GEMMs: needs train.device=cuda; the device is {device_type!r}")
    for field, wanted in (("moe_transport", {"cpu": ("auto", "gloo"),
                                             "cuda": ("auto", "nccl", "copy_engine", "sm_push")}),
                          ("tp_comm_backend", {"cpu": ("auto", "p2p"), "cuda": ("auto", "p2p", "symm")})):
        backend = getattr(cfg.overlap, field)
        _require(backend in wanted[device_type], f"overlap.{field}", backend,
                 f"'{backend}' cannot run on device {device_type!r}; use one of {', '.join(wanted[device_type])}")
