"""The run configuration's schema: typed sections (model / parallel / overlap / train / data / checkpoint), what
each field means and its default, and the error every check raises.

Field names follow Megatron-Core / NeMo where the meaning is the same. Every error names the field
(``section.name``), the value given and what is allowed. A field whose behaviour is not built yet is
rejected with "not implemented yet" when set to anything but its default, never accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union


class ConfigError(ValueError):
    """A bad configuration value; the message names the field, the value and what is allowed."""

    def __init__(self, field_name: str, value: Any, allowed: str):
        self.field_name, self.value, self.allowed = field_name, value, allowed
        super().__init__(f"{field_name}={value!r}: {allowed}")

    def __reduce__(self):  # raised inside a process pool, it crosses back to the parent pickled
        return type(self), (self.field_name, self.value, self.allowed)


def not_implemented(field_name: str, value: Any, default: Any, waits_for: str) -> ConfigError:
    return ConfigError(field_name, value, f"not implemented yet ({waits_for}); only {default!r} is supported")


def require(ok: bool, name: str, value: Any, allowed: str) -> None:
    """A rule: unless ``ok``, the field ``name`` with ``value`` fails, saying what is ``allowed``."""
    if not ok:
        raise ConfigError(name, value, allowed)


def refuse(refusal) -> None:
    """A rule of a table (moe_overlap/exchange_rules.py): its refusal, if any, as the config error."""
    if refusal is not None:
        raise ConfigError(refusal.field, refusal.value, refusal.reason)


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
    # The token embedding's init std (1.0 in the fine GPU examples: a token's own vector then outweighs the context
    # average that near-uniform attention adds at init, benchmarks/RESULTS.md, "Quick start on GPUs"); None:
    # init_method_std, as every other weight. A tied table is also the output layer's weight: its logits grow with it.
    embedding_init_std: Optional[float] = None
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
    # The routers' learning rate as a multiple of train.lr's schedule (every step of it): below 1, each step moves a
    # router's logits less, so one expert's share swings less from step to step
    moe_router_lr_scale: float = 1.0
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"
    # Benchmarks only (torchtitan's debug switch): copy j of token t goes to expert (t * topk + j) mod experts, the
    # weights are the router's scores there; the model does not learn routing.
    moe_router_force_load_balancing: bool = False
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    # The auxiliary and z losses see the router's logits of detached tokens: their gradients move the routers'
    # weights only, not the hidden states before them (the rest of the model does not learn to balance experts)
    moe_router_loss_detach_input: bool = False
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    # The shared expert beside the combine's transfers (MoELayer.run_experts): forward, while the expert outputs
    # travel back; backward, while the output gradient's rows travel to the experts. auto: on where the pipelined
    # exchange runs (measured faster there, tuning.py); false: after the combine, as Megatron-Core runs it.
    moe_shared_expert_overlap: Union[bool, Literal["auto"]] = "auto"
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
    # The same for the EP communicator (group ep: nccl's all-to-all); also an SM push's CTAs where no carve-out does.
    ep_comm_ctas: Optional[int] = None
    # SMs a GEMM with communication beside it leaves free (torch's SM carve-out), so that a communication kernel
    # starts at once instead of queueing behind the GEMM's full-chip grid: the MoE pipeline's grouped GEMMs while
    # rows move beside them (an SM push takes that many CTAs), and with the distributed optimizer's overlaps the
    # GEMMs its syncs run beside (the first micro-batch's forward, the last one's backward). 0: none (an SM push
    # then runs on the compute stream, between the GEMMs); auto, the default: the measured pairings
    # (2 x ep_comm_ctas, 4 x dp_comm_ctas; 0 without a cap) and, for SM pushes (more than one chunk, or paired
    # micro-batches), the CTAs that move a chunk's rows in its GEMM's time (tuning.py says where each was measured).
    gemm_sm_carveout: Union[int, Literal["auto"]] = "auto"
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
    # One micro-batch's MoE exchange beside another's compute (forwards paired with backwards). auto: paired over NCCL
    # (no peer copies); on one NVLink host at EP=2 on two CUDA streams, graphed, where the rank's estimate fits its GPU
    # (training/streams_memory.py); else one micro-batch at a time: the fastest measured (defaults.py, tuning.py).
    overlap_moe_expert_parallel_comm: Union[bool, Literal["auto"]] = "auto"
    # The MoE experts' weight gradients after their dgrad rows have started back, beside that transfer. auto: on
    # where measured faster, one device-planned chunk with each token once per rank (config/defaults.py, tuning.py).
    delay_wgrad_compute: Union[bool, Literal["auto"]] = "auto"
    # The MoE exchange as a pipeline of chunks (runs of local experts) beside the grouped GEMMs, forward and
    # backward; false: the serial reference (one all-to-all each way, sizes from the host). auto: the pipeline
    # wherever there is an exchange (EP x expert-TP > 1) or a pipeline field is set, as measured fastest
    # (tuning.py); the serial exchange with one rank, or with train.expert_wgrad_micro_batches > 1 (config/defaults.py).
    moe_pipeline: Union[bool, Literal["auto"]] = "auto"
    moe_pipeline_chunks: int = 1
    # The micro-batch's tokens cut into this many slices inside each pipelined MoE layer, their steps interleaved:
    # a slice's dispatch crosses beside the previous slice's expert GEMMs, its combine beside the next one's, and
    # the backward likewise, so that only one slice's rows cross with no GEMM beside them at the start and the end
    # of each direction (with one chunk: all of them). The same math. 1: off; at most 2 (more slices in flight than
    # the transport's regions: not implemented yet).
    moe_token_slices: int = 1
    # Where the pipeline's exchange sizes are planned: host (one fetch of every rank's counts per layer, exact
    # buffers), device (no host sync, worst-case buffers, CUDA-graph capturable), auto (device when the
    # transport takes device sizes).
    moe_planning: Literal["auto", "host", "device"] = "auto"
    # What moves the rows: nccl, copy_engine (symmetric memory; host sizes, or device-planned wire rows in slots),
    # sm_push (Triton stores into symmetric memory, device sizes), gloo (CPU); auto: sm_push or copy_engine on one host
    # with peer access (by moe_planning), else nccl; gloo on CPU.
    moe_transport: Literal["auto", "nccl", "copy_engine", "sm_push", "gloo"] = "auto"
    # The device-planned exchange's receive bound (Megatron's name): a rank's chunk of local experts receives at most
    # ceil(factor x T x K x its share of the local experts) rows per layer call (T x K: the copies each rank routes;
    # factor x the balanced share), so its buffers, symmetric regions and stashed activations do not grow with EP.
    # A step in which rows overflow the bound on any rank is skipped on the device and run again planned on the host
    # (unless the overflow chunk below takes them): training stays dropless. >= 1.0; null (the default): the worst
    # case (EP x T x K rows), never exceeded: on 2xH100 a bound re-ran every step of the skewed bench corpus with 4
    # chunks (benchmarks/RESULTS.md). Host planning is exact and needs no bound (with auto planning there, it has no
    # effect).
    moe_expert_rank_capacity_factor: Optional[float] = None
    # The in-graph overflow chunk (needs the bound above): a rank's rows past their chunk's bound go to one more
    # chunk over all its local experts, of ceil(factor x T x K) rows, exchanged with the chunks and computed after
    # the last one inside the same layer call (and CUDA graph), so such a step costs one more grouped GEMM instead
    # of a re-run; only rows past this chunk's bound too make the step run again planned on the host. > 0; null
    # (the default): no overflow chunk, every overflow runs the step again. Measured on one H200, one layer at 4
    # chunks (benchmarks/RESULTS.md, "The overflow chunk"): an overflowing call 1.01-1.09x the unbounded one against
    # 2.3-2.7x for a re-run, a call with nothing to take 0-4% more. With moe_dispatch_once_per_rank each copy past
    # its bound crosses again as a row of its own (at most this many rows a rank sends, too): 1.08-1.11x overflowing,
    # 4-7% with nothing to take (the fine layer).
    moe_overflow_capacity_factor: Optional[float] = None
    # The device-planned exchange's backward stash in pages (layers/paged_stash.py): each chunk's tensors the backward
    # needs (its rows and their fc1 output) are copied after its GEMMs into one pool per rank, as many pages as the
    # rows actually received, and back out by the backward, so that a layer call in flight holds its rows, not its
    # bound, and a layer's excess takes the pages another left. The pool holds factor x the balanced rows (T x K)
    # of every MoE layer call in flight; a chunk that does not fit counts its rows as overflow rows (the step runs
    # again planned on the host, as past the receive bound). >= 1.0; null (the default): each call keeps its bounded
    # tensors (no copies). Measured at EP=2 on 2xH200 (benchmarks/RESULTS.md, "The paged stash"): 87.5 -> 50.1 GiB
    # with 4 chunks eagerly, no re-runs where per-chunk bounds re-ran every step, but 9-10% slower on the default
    # graphed path.
    moe_paged_stash_factor: Optional[float] = None
    # Each token crosses to an EP rank once per chunk (as DeepEP): dispatch sends its hidden state once to each
    # (chunk, rank) holding any of its k experts, with their grouped rows and probs beside it; the receiver expands it
    # into its experts' rows, weights their outputs by the probs and sums them into one row that goes back.
    # auto: on with the pipeline where a token's copies often share a rank (top-k >= 4, as measured fastest:
    # tuning.py), off where it is not implemented (padded capacity, expert-TP > 1) (config/defaults.py).
    moe_dispatch_once_per_rank: Union[bool, Literal["auto"]] = "auto"
    # The rows that feed the experts' up- and down-projections (the forward dispatch, and the output gradient's rows
    # in the combine's backward): bf16, the rows as they are; fp8, E4M3 with one float32 scale per row (DeepSeek-V3's
    # dispatch): about half the bytes on those two of the layer's four exchanges, dequantized on arrival. The
    # combine and the dispatch's backward stay as they are. Needs each token once per rank (layers/wire_rows.py).
    moe_dispatch_dtype: Literal["bf16", "fp8"] = "bf16"
    # A benchmark's reference, not training: every EP exchange keeps its sizes, signals and small messages (each
    # layer still waits for its slowest rank) but each rank's rows land in its own memory, so the step runs the
    # expert GEMMs on as many rows as each rank would receive without moving them. The learning rate is held at
    # 0 (rows that never arrived would make the model diverge); the loss means nothing.
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
    # Replay each MoE layer's forward and backward from CUDA graphs (needs overlap.moe_planning=device). auto: where
    # the exchange is planned on the device (one host with peer access), unpaired: the fastest measured there.
    moe_cuda_graph: Union[bool, Literal["auto"]] = "auto"
    # Sum the experts' weight gradients of this many consecutive micro-batches in one grouped kernel: main_grad is
    # read and written once per group (fewer, larger experts gain most), that many less one micro-batches' wgrad
    # inputs kept per layer. 1: each micro-batch's own (2 was train.expert_wgrad_pairs=true).
    expert_wgrad_micro_batches: int = 1
    # FP8 (E4M3) GEMMs for the experts and the dense linears of the decoder layers (Megatron's names): null: bf16;
    # rowwise: one float32 scale per row of each operand (torch's scaled GEMMs); blockwise: one per 1x128
    # activation tile and 128x128 weight block (a Triton GEMM). The first / last that many layers stay bf16 (as do
    # the embedding, output layer, router, norms and attention itself).
    fp8_recipe: Optional[Literal["rowwise", "blockwise"]] = None
    # The experts' weight-gradient GEMMs in FP8 too, added in fp32 into main_grad (Megatron's fp8_wgrad); false:
    # in bf16 (the forward and input gradient stay FP8); auto: where measured faster (config/defaults.py). The dense
    # linears' weight gradients stay bf16.
    fp8_wgrad: Union[bool, Literal["auto"]] = "auto"
    # The forward and input-gradient GEMMs run in FP8 only where their contraction and output are both at least this
    # wide; narrower ones (e.g. a fine-grained expert's fc2) stay bf16. auto: where measured faster
    # (tuning.FP8_GEMM_MIN_DIM; with fast input gradients, FP8_GEMM_MIN_DIM_FAST); 0: every GEMM of the FP8
    # layers.
    fp8_gemm_min_dim: Union[int, Literal["auto"]] = "auto"
    # How the rowwise input-gradient FP8 GEMMs accumulate (the forward's always run cuBLAS's fast accumulation):
    # exact, as Transformer Engine's dgrad; fast, as torchao's rowwise FP8 grouped GEMM (torchtitan's MoE FP8) runs
    # its forward and both gradients. auto: fast with rowwise (measured faster, its convergence within the bound:
    # tuning.py), exact with blockwise, whose GEMM sums every 128-deep slice exactly (fast: not implemented there).
    fp8_dgrad_accumulation: Literal["auto", "exact", "fast"] = "auto"
    # The weights whose GEMMs run in FP8 kept only as their FP8 copies, in the memory of their bf16 values (2 bytes a
    # weight less), quantized from the fp32 masters as the bf16 values would have been (Megatron's fp8_param). auto:
    # on with the plain optimizer (config/defaults.py); the distributed optimizer: not implemented yet.
    fp8_param: Union[bool, Literal["auto"]] = "auto"
    num_layers_at_start_in_bf16: int = 0
    num_layers_at_end_in_bf16: int = 0
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
