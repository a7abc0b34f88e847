"""Config loading: every bad value fails early with a ConfigError naming the field and the value given;
not-yet-built features say "not implemented yet"; the shipped configs load."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_overlap.config import (
    Config,
    ConfigError,
    ModelConfig,
    OverlapConfig,
    ParallelConfig,
    TrainConfig,
    load_config,
    validate_for_world,
)
from moe_overlap.config.defaults import pairing_by_transport, pairs_on_streams

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TINY = CONFIGS / "tiny.yaml"  # MoE: 4 layers, 8 heads / 4 groups, 8 experts top-2, EP=2, micro 8 / global 32
NOT_YET = "not implemented yet"
TP_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
DEVICE_PLANNED = ["overlap.moe_pipeline=true", "overlap.moe_planning=device"]
SERIAL = "overlap.moe_pipeline=false"


def config_error(path, overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def check(message: str, field: str, value: str, *fragments: str) -> None:
    """The message starts with `field=`, shows the value given and holds every fragment."""
    assert message.startswith(f"{field}="), message
    assert value in message, message
    for fragment in fragments:
        assert fragment in message, message


# (file, overrides, field named, repr of the bad value, fragments of the explanation)
BAD: list[tuple] = [
    # --- unknown keys, with the nearest name
    (None, ["model.hiden_size=1024"], "model.hiden_size", "1024", "unknown field", "did you mean 'hidden_size'"),
    (None, ["parallel.expert_parallel_size=2"], "parallel.expert_parallel_size", "2",
     "did you mean 'expert_model_parallel_size'"),
    (None, ["train.micro_batch=2"], "train.micro_batch", "2", "did you mean 'micro_batch_size'"),
    (None, ["model.zzz=1"], "model.zzz", "1", "unknown field; known:", "hidden_size"),
    (None, ["modle.hidden_size=128"], "modle", "{'hidden_size': 128}", "unknown section", "did you mean 'model'"),
    # --- wrong types
    (None, ["model.hidden_size=abc"], "model.hidden_size", "'abc'", "expected an integer"),
    (None, ["model.hidden_size='128'"], "model.hidden_size", "'128'", "expected an integer"),
    (None, ["model.num_layers=4.5"], "model.num_layers", "4.5", "expected an integer"),
    (None, ["model.num_layers=4.0"], "model.num_layers", "4.0", "expected an integer"),
    (None, ["train.micro_batch_size=true"], "train.micro_batch_size", "True", "expected an integer"),
    (None, ["train.lr=[1, 2]"], "train.lr", "[1, 2]", "expected a number"),
    (None, ["train.lr=.nan"], "train.lr", "nan", "expected a number"),
    (None, ["train.lr="], "train.lr", "None", "expected a number"),
    (None, ["train.lr={a: 1}"], "train.lr", "{'a': 1}", "expected a number"),
    (None, ["overlap.overlap_grad_sync=maybe"], "overlap.overlap_grad_sync", "'maybe'", "expected true or false"),
    (None, ["parallel.sequence_parallel=1"], "parallel.sequence_parallel", "1", "expected true or false"),
    (None, ["train.precision=fp16"], "train.precision", "'fp16'", "one of 'fp32', 'bf16'"),
    (None, ["train.device=tpu"], "train.device", "'tpu'", "one of 'auto', 'cpu', 'cuda'"),
    (None, ["data.dtype=int8"], "data.dtype", "'int8'", "one of 'uint16', 'uint32'"),
    (None, ["model.num_moe_experts=eight"], "model.num_moe_experts", "'eight'", "expected an integer or null"),
    (None, ["model.num_query_groups=[4]"], "model.num_query_groups", "[4]", "expected an integer or null"),
    (TINY, ["model.moe_layer_freq=[0, 1, a, 1]"], "model.moe_layer_freq", "[0, 1, 'a', 1]",
     "expected an integer or a list"),
    (None, ["train.output_dir=7"], "train.output_dir", "7", "expected a string"),
    # --- out of range
    (None, ["model.num_layers=0"], "model.num_layers", "0", "must be >= 1"),
    (None, ["model.ffn_hidden_size=-8"], "model.ffn_hidden_size", "-8", "must be >= 1"),
    (None, ["model.vocab_size=0"], "model.vocab_size", "0", "must be >= 1"),
    (None, ["model.hidden_size=100"], "model.hidden_size", "100", "multiple of 8"),
    (None, ["model.ffn_hidden_size=390"], "model.ffn_hidden_size", "390", "multiple of 8"),
    (None, ["model.num_attention_heads=3"], "model.num_attention_heads", "3", "must divide model.hidden_size=128"),
    (None, ["model.hidden_size=120"], "model.num_attention_heads", "8", "head dim", "=15 must be even"),
    (None, ["model.rotary_base=0"], "model.rotary_base", "0.0", "must be > 0"),
    (None, ["model.norm_epsilon=-1e-5"], "model.norm_epsilon", "-1e-05", "must be > 0"),
    (None, ["model.init_method_std=0"], "model.init_method_std", "0.0", "must be > 0"),
    (None, ["model.vocab_size=100"], "model.vocab_size", "100", ">= 256 for the bundled byte-level corpus"),
    (None, ["model.vocab_size=70000", "data.path=tokens.bin"], "model.vocab_size", "70000",
     "must fit data.dtype=uint16"),
    (TINY, ["model.num_moe_experts=0"], "model.num_moe_experts", "0", "must be >= 1"),
    (TINY, ["model.moe_router_topk=0"], "model.moe_router_topk", "0", "must be in [1, model.num_moe_experts=8]"),
    (TINY, ["model.moe_router_topk=9"], "model.moe_router_topk", "9", "must be in [1, model.num_moe_experts=8]"),
    (TINY, ["model.moe_layer_freq=0"], "model.moe_layer_freq", "0", "must be >= 1"),
    (TINY, ["model.moe_layer_freq=[0, 1, 1]"], "model.moe_layer_freq", "[0, 1, 1]",
     "one 0 or 1 per layer (model.num_layers=4)"),
    (TINY, ["model.moe_layer_freq=[0, 1, 2, 1]"], "model.moe_layer_freq", "[0, 1, 2, 1]", "one 0 or 1 per layer"),
    (TINY, ["model.moe_ffn_hidden_size=100"], "model.moe_ffn_hidden_size", "100", "positive multiple of 8"),
    (TINY, ["model.moe_aux_loss_coeff=-0.1"], "model.moe_aux_loss_coeff", "-0.1", "must be >= 0"),
    (TINY, ["model.moe_z_loss_coeff=-1"], "model.moe_z_loss_coeff", "-1.0", "must be >= 0"),
    (TINY, ["model.moe_router_load_balancing_type=none"], "model.moe_aux_loss_coeff", "0.01",
     "must be 0 when model.moe_router_load_balancing_type is 'none'"),
    (TINY, ["model.moe_router_load_balancing_type=z_loss"], "model.moe_router_load_balancing_type", "'z_loss'",
     "one of 'aux_loss', 'seq_aux_loss', 'global_aux_loss', 'none'"),
    (TINY, ["model.moe_expert_capacity_factor=-1"], "model.moe_expert_capacity_factor", "-1.0", "must be > 0"),
    (None, ["parallel.tensor_model_parallel_size=0"], "parallel.tensor_model_parallel_size", "0", "must be >= 1"),
    (None, ["parallel.pipeline_model_parallel_size=-1"], "parallel.pipeline_model_parallel_size", "-1",
     "must be >= 1"),
    (None, ["parallel.expert_model_parallel_size=0"], "parallel.expert_model_parallel_size", "0", "must be >= 1"),
    (None, ["parallel.expert_tensor_parallel_size=0"], "parallel.expert_tensor_parallel_size", "0", "must be >= 1"),
    (None, ["parallel.virtual_pipeline_model_parallel_size=0"], "parallel.virtual_pipeline_model_parallel_size",
     "0", "must be >= 1 or null"),
    (None, ["overlap.tp_comm_num_splits=0"], "overlap.tp_comm_num_splits", "0", "must be >= 1"),
    (None, ["overlap.moe_pipeline_chunks=0"], "overlap.moe_pipeline_chunks", "0", "must be >= 1"),
    (None, ["train.micro_batch_size=0"], "train.micro_batch_size", "0", "must be >= 1"),
    (None, ["train.max_steps=0"], "train.max_steps", "0", "must be >= 1"),
    (None, ["train.lr=0"], "train.lr", "0.0", "must be > 0"),
    (None, ["train.min_lr=0.01"], "train.min_lr", "0.01", "must be in [0, train.lr=0.003]"),
    (None, ["train.lr_warmup_steps=-1"], "train.lr_warmup_steps", "-1", "must be >= 0"),
    (None, ["train.lr_decay_steps=5"], "train.lr_decay_steps", "5", "must be > train.lr_warmup_steps=10"),
    (None, ["train.weight_decay=-0.1"], "train.weight_decay", "-0.1", "must be >= 0"),
    (None, ["train.adam_beta1=1"], "train.adam_beta1", "1.0", "must be in [0, 1)"),
    (None, ["train.adam_beta2=-0.5"], "train.adam_beta2", "-0.5", "must be in [0, 1)"),
    (None, ["train.adam_eps=0"], "train.adam_eps", "0.0", "must be > 0"),
    (None, ["train.clip_grad=-1"], "train.clip_grad", "-1.0", "must be >= 0"),
    (None, ["train.seed=-1"], "train.seed", "-1", "must be >= 0"),
    (None, ["train.eval_interval=-1"], "train.eval_interval", "-1", "must be >= 0"),
    (None, ["train.distributed_timeout_s=0"], "train.distributed_timeout_s", "0.0", "must be > 0"),
    (None, ["train.output_dir=''"], "train.output_dir", "''", "non-empty"),
    (None, ["data.validation_fraction=0"], "data.validation_fraction", "0.0", "must be in (0, 0.5]"),
    (None, ["data.validation_fraction=0.6"], "data.validation_fraction", "0.6", "must be in (0, 0.5]"),
    (None, ["checkpoint.save_interval=-1"], "checkpoint.save_interval", "-1", "must be >= 0"),
    (None, ["checkpoint.keep_last=0"], "checkpoint.keep_last", "0", "must be >= 1"),
    # --- divisibility (world-independent; the layout checks come before "not implemented")
    (None, ["model.num_query_groups=3"], "model.num_query_groups", "3", "divide model.num_attention_heads=8"),
    (None, ["model.num_query_groups=0"], "model.num_query_groups", "0", "must be >= 1"),
    (TINY, ["parallel.expert_model_parallel_size=3"], "parallel.expert_model_parallel_size", "3",
     "must divide model.num_moe_experts=8"),
    (None, ["parallel.expert_model_parallel_size=2"], "parallel.expert_model_parallel_size", "2",
     "must be 1 for a dense model"),
    (None, ["parallel.tensor_model_parallel_size=3"], "model.num_attention_heads", "8",
     "divisible by parallel.tensor_model_parallel_size=3"),
    (None, ["parallel.tensor_model_parallel_size=8", "model.num_query_groups=4"], "model.num_query_groups", "4",
     "divisible by parallel.tensor_model_parallel_size=8"),
    (None, ["parallel.tensor_model_parallel_size=16", "model.num_attention_heads=16", "model.hidden_size=256",
            "model.ffn_hidden_size=392"], "model.ffn_hidden_size", "392",
     "divisible by parallel.tensor_model_parallel_size=16"),
    (TINY, ["parallel.expert_tensor_parallel_size=16", "parallel.expert_model_parallel_size=1",
            "model.moe_ffn_hidden_size=392"], "model.moe_ffn_hidden_size", "392",
     "divisible by parallel.expert_tensor_parallel_size=16"),
    (None, ["parallel.pipeline_model_parallel_size=3"], "model.num_layers", "4",
     "pipeline_model_parallel_size x virtual_pipeline_model_parallel_size=3"),
    (None, ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=3"],
     "model.num_layers", "4", "virtual_pipeline_model_parallel_size=6"),
    (None, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", "model.seq_length=129"],
     "model.seq_length", "129", "divisible by parallel.tensor_model_parallel_size=2 under sequence_parallel"),
    (None, ["parallel.context_parallel_size=2", "model.seq_length=130"], "model.seq_length", "130",
     "2 x parallel.context_parallel_size=4"),
    (None, ["train.global_batch_size=30"], "train.global_batch_size", "30", "multiple of train.micro_batch_size=4"),
    (None, ["overlap.tp_comm_overlap=true"], "overlap.tp_comm_overlap", "True", "needs parallel.sequence_parallel"),
    (None, ["overlap.tp_comm_bulk_wgrad=true"], "overlap.tp_comm_bulk_wgrad", "True",
     "needs parallel.sequence_parallel"),
    # --- tensor parallelism (TP_SP: TP=2 with sequence parallelism on the default dense model)
    (None, ["parallel.tensor_model_parallel_size=2", "model.vocab_size=257", "data.path=t.bin"], "model.vocab_size",
     "257", "divisible by parallel.tensor_model_parallel_size=2", "vocabulary block"),
    (TINY, ["parallel.tensor_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1"],
     "parallel.sequence_parallel", "False", "must be true for a MoE model with tensor_model_parallel_size > 1"),
    (None, [*TP_SP, "overlap.tp_comm_overlap_ag=true"], "overlap.tp_comm_overlap_ag", "True",
     "needs the master switch overlap.tp_comm_overlap=true"),
    (None, [*TP_SP, "overlap.tp_comm_overlap=true"], "overlap.tp_comm_overlap", "True", "turns nothing on",
     "overlap.tp_comm_bulk_wgrad"),
    (None, [*TP_SP, "overlap.tp_comm_overlap=true", "overlap.tp_comm_overlap_rs_dgrad=true",
            "overlap.tp_comm_bulk_wgrad=true"], "overlap.tp_comm_bulk_wgrad", "True", "nothing to hide"),
    (None, [*TP_SP, "overlap.tp_comm_backend=symm"], "overlap.tp_comm_backend", "'symm'",
     "needs overlap.tp_comm_overlap=true"),
    (None, [*TP_SP, "overlap.tp_comm_overlap=true", "overlap.tp_comm_overlap_ag=true",
            "overlap.tp_comm_backend=nccl"], "overlap.tp_comm_backend", "'nccl'",
     "expected one of 'auto', 'p2p', 'symm'"),
    (None, [*TP_SP, "overlap.tp_comm_num_splits=2"], "overlap.tp_comm_num_splits", "2",
     "no effect without a pipelined overlap"),
    (None, [*TP_SP, "overlap.tp_comm_overlap=true", "overlap.tp_comm_overlap_rs=true", "overlap.tp_comm_num_splits=3"],
     "overlap.tp_comm_num_splits", "3", "must divide the per-rank sequence block",
     "model.seq_length / (parallel.tensor_model_parallel_size x parallel.context_parallel_size) = 64"),
    # --- the distributed optimizer's switches need it
    (None, ["overlap.overlap_grad_sync=true"], "overlap.overlap_grad_sync", "True",
     "needs train.use_distributed_optimizer=true"),
    (None, ["overlap.overlap_param_sync=true"], "overlap.overlap_param_sync", "True",
     "needs train.use_distributed_optimizer=true"),
    (None, ["overlap.bucket_size_mb=40"], "overlap.bucket_size_mb", "40.0",
     "needs train.use_distributed_optimizer=true"),
    (None, ["train.use_distributed_optimizer=true", "overlap.bucket_size_mb=0"], "overlap.bucket_size_mb", "0.0",
     "must be > 0 (or null: one Transformer layer per bucket)"),
    (None, ["overlap.dp_comm_ctas=0"], "overlap.dp_comm_ctas", "0", "must be between 1 and 64"),
    (None, ["overlap.dp_comm_ctas=65"], "overlap.dp_comm_ctas", "65", "must be between 1 and 64"),
    (None, ["overlap.gemm_sm_carveout=-1"], "overlap.gemm_sm_carveout", "-1", "must be >= 0, or auto"),
    (None, ["overlap.gemm_sm_carveout=some"], "overlap.gemm_sm_carveout", "'some'", "an integer or one of 'auto'"),
    (TINY, ["overlap.ep_comm_ctas=0"], "overlap.ep_comm_ctas", "0", "must be between 1 and 64"),
    (None, ["overlap.ep_comm_ctas=4"], "overlap.ep_comm_ctas", "4", "expert_model_parallel_size > 1"),
    (None, ["train.on_nonfinite_grad=ignore"], "train.on_nonfinite_grad", "'ignore'", "one of 'skip', 'stop'"),
    # --- bad override syntax
    (None, ["model.hidden_size"], "override", "'model.hidden_size'", "expected section.field=value"),
    (None, ["hidden_size=128"], "override", "'hidden_size=128'", "expected section.field=value"),
    (None, ["model.attention.heads=4"], "override", "'model.attention.heads=4'", "expected section.field=value"),
    (None, [".hidden_size=128"], "override", "'.hidden_size=128'", "expected section.field=value"),
    (None, ["=3"], "override", "'=3'", "expected section.field=value"),
    # --- files
    ("does/not/exist.yaml", [], "config", "does/not/exist.yaml", "no such file"),
    # the MoE pipeline's fields need the pipeline; chunks are runs of local experts; planning and transport agree
    # (with overlap.moe_pipeline=auto, setting one of them turns the pipeline on: test_moe_pipeline_auto)
    (TINY, [SERIAL, "overlap.moe_pipeline_chunks=2"], "overlap.moe_pipeline_chunks", "2",
     "needs overlap.moe_pipeline=true"),
    (TINY, [SERIAL, "overlap.delay_wgrad_compute=true"], "overlap.delay_wgrad_compute", "True", "moe_pipeline=true"),
    (TINY, [SERIAL, "overlap.moe_transport=nccl"], "overlap.moe_transport", "'nccl'", "moe_pipeline=true"),
    (TINY, [SERIAL, "overlap.moe_planning=device"], "overlap.moe_planning", "'device'", "moe_pipeline=true"),
    (TINY, ["overlap.moe_pipeline=true", "overlap.moe_pipeline_chunks=5"], "overlap.moe_pipeline_chunks", "5",
     "local experts", "= 4"),
    # token slices: one or two, with the pipeline, unpaired, not padded, no expert-TP
    (TINY, [SERIAL, "overlap.moe_token_slices=2"], "overlap.moe_token_slices", "2", "needs overlap.moe_pipeline=true"),
    (TINY, ["overlap.moe_token_slices=0"], "overlap.moe_token_slices", "0", "must be >= 1"),
    (TINY, ["overlap.moe_token_slices=3"], "overlap.moe_token_slices", "3", "must be 1 or 2", NOT_YET,
     "symmetric regions"),
    (TINY, ["overlap.moe_token_slices=2", "overlap.overlap_moe_expert_parallel_comm=true"],
     "overlap.moe_token_slices", "2", NOT_YET, "run a layer's steps apart"),
    (TINY, ["overlap.moe_token_slices=2", "model.moe_expert_capacity_factor=1.5",
            "model.moe_pad_expert_input_to_capacity=true"], "overlap.moe_token_slices", "2", NOT_YET, "pad"),
    (TINY, ["overlap.moe_token_slices=2", "parallel.expert_tensor_parallel_size=2"], "overlap.moe_token_slices", "2",
     NOT_YET, "expert_tensor_parallel_size > 1"),
    (TINY, ["overlap.moe_pipeline=true", "overlap.moe_planning=device", "overlap.moe_transport=nccl"],
     "overlap.moe_transport", "'nccl'", "takes host sizes", "moe_planning=device"),
    (TINY, ["overlap.moe_pipeline=true", "overlap.moe_planning=device", "overlap.moe_transport=copy_engine"],
     "overlap.moe_transport", "'copy_engine'", "needs overlap.moe_dispatch_once_per_rank=true"),  # top-2: off
    (TINY, ["overlap.moe_pipeline=true", "overlap.moe_planning=host", "overlap.moe_transport=sm_push"],
     "overlap.moe_transport", "'sm_push'", "takes device sizes"),
    (TINY, ["overlap.moe_pipeline=true", "overlap.moe_planning=device", "parallel.expert_tensor_parallel_size=2"],
     "overlap.moe_planning", "'device'", "not implemented yet", "expert-TP gather takes host sizes"),
    # the fields of the three dispatch paths the pipeline replaced: refused in one line naming the new ones
    (TINY, ["overlap.moe_overlap_dispatch=true"], "overlap.moe_overlap_dispatch", "True",
     "was replaced: use overlap.moe_pipeline=true overlap.moe_planning=host"),
    (TINY, ["overlap.moe_sync_free_dispatch=true"], "overlap.moe_sync_free_dispatch", "True",
     "overlap.moe_pipeline=true overlap.moe_planning=device"),
    (TINY, ["overlap.moe_a2a_chunks=2"], "overlap.moe_a2a_chunks", "2", "use overlap.moe_pipeline_chunks"),
    (TINY, ["train.expert_wgrad_pairs=true"], "train.expert_wgrad_pairs", "True",
     "was replaced: use train.expert_wgrad_micro_batches=2"),
    (TINY, ["train.expert_wgrad_micro_batches=0"], "train.expert_wgrad_micro_batches", "0", "must be 1"),
    (TINY, ["overlap.moe_a2a_backend=symm"], "overlap.moe_a2a_backend", "'symm'", "overlap.moe_transport",
     "copy_engine with overlap.moe_planning=host", "sm_push with overlap.moe_planning=device"),
    (TINY, ["train.moe_cuda_graph=true", SERIAL], "train.moe_cuda_graph", "True", "overlap.moe_planning=device"),
    (TINY, ["train.moe_cuda_graph=true", "overlap.moe_planning=host"], "train.moe_cuda_graph", "True",
     "overlap.moe_planning=device"),
    (TINY, ["train.moe_cuda_graph=true", *DEVICE_PLANNED, "train.recompute_granularity=full"],
     "train.moe_cuda_graph", "True", "not implemented yet", "recomputation"),
    (TINY, ["train.moe_cuda_graph=true", *DEVICE_PLANNED, *TP_SP, "parallel.expert_tensor_parallel_size=1"],
     "train.moe_cuda_graph", "True", "not implemented yet", "tensor parallelism"),
    (TINY, ["model.moe_pad_expert_input_to_capacity=true"], "model.moe_pad_expert_input_to_capacity", "True",
     "moe_expert_capacity_factor"),
    (TINY, ["model.moe_shared_expert_overlap=true"], "model.moe_shared_expert_overlap", "True",
     "moe_shared_expert_intermediate_size"),
    (TINY, ["model.moe_shared_expert_intermediate_size=64", "model.moe_shared_expert_overlap=true", SERIAL],
     "model.moe_shared_expert_overlap", "True", "moe_pipeline=true"),
    (TINY, ["model.moe_shared_expert_intermediate_size=12"], "model.moe_shared_expert_intermediate_size", "12",
     "multiple of 8"),
]

# Each not-yet-built field, set to a non-default value, says "not implemented yet" and what it waits for.
NOT_IMPLEMENTED: list[tuple] = [
    (None, "parallel.cp_comm_type=a2a", "a2a", "only the p2p ring is built"),
]


@pytest.mark.parametrize("case", BAD, ids=[" ".join(c[1]) or str(c[0]) for c in BAD])
def test_bad_config(case):
    path, overrides, field, value, *fragments = case
    check(config_error(path, overrides), field, value, *fragments)


@pytest.mark.parametrize("path,override,value,waits_for", NOT_IMPLEMENTED, ids=[c[1] for c in NOT_IMPLEMENTED])
def test_not_implemented_yet(path, override, value, waits_for):
    field = override.split("=")[0]
    check(config_error(path, [override]), field, repr(value), NOT_YET, waits_for)


def test_enough_distinct_bad_configs():
    cases = [(str(c[0]), tuple(c[1])) for c in BAD] + [(str(c[0]), (c[1],)) for c in NOT_IMPLEMENTED]
    assert len(set(cases)) == len(cases) >= 30


# ------------------------------------------------------------------------------------- bad YAML files


@pytest.mark.parametrize("text,overrides,field,value,fragment", [
    ("model: 5\n", [], "model", "5", "expected a mapping"),
    ("model: 5\n", ["model.hidden_size=128"], "model", "5", "a section must be a mapping"),
    ("- model\n- train\n", [], "config", "bad.yaml", "must be a mapping of sections"),
    ("model:\n  hiden_size: 64\n", [], "model.hiden_size", "64", "did you mean 'hidden_size'"),
    ("trian:\n  lr: 0.1\n", [], "trian", "{'lr': 0.1}", "unknown section; did you mean 'train'"),
    ("train:\n  lr: fast\n", [], "train.lr", "'fast'", "expected a number"),
], ids=["section-scalar", "override-into-scalar", "top-level-list", "unknown-field", "unknown-section", "type"])
def test_bad_yaml_file(tmp_path, text, overrides, field, value, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    check(config_error(path, overrides), field, value, fragment)


# ------------------------------------------------------------------------------------ world-size rules


def _world_error(cfg: Config, world_size: int, device_type: str = "cpu") -> str:
    with pytest.raises(ConfigError) as info:
        validate_for_world(cfg, world_size, device_type)
    return str(info.value)


def test_expert_ranks_must_divide_world():
    cfg = load_config(TINY)  # EP=2
    check(_world_error(cfg, 3), "parallel.expert_model_parallel_size", "2",
          "expert_model_parallel_size x expert_tensor_parallel_size = 2",
          "world_size / pipeline_model_parallel_size = 3")


def test_global_batch_divisible_by_micro_batch_times_dp():
    cfg = load_config(TINY)  # micro 8, global 32
    check(_world_error(cfg, 8), "train.global_batch_size", "32", "train.micro_batch_size x data-parallel size = 8 x 8")


@pytest.mark.parametrize("transport,device,wanted", [("nccl", "cpu", "gloo"), ("sm_push", "cpu", "gloo"),
                                                      ("copy_engine", "cpu", "gloo"), ("gloo", "cuda", "nccl")])
def test_moe_transport_must_match_device(transport, device, wanted):
    cfg = load_config(TINY, [f"overlap.moe_transport={transport}", "overlap.moe_pipeline=true"])
    check(_world_error(cfg, 2, device), "overlap.moe_transport", repr(transport), f"device {device!r}", wanted)


def test_replaced_dispatch_fields_at_their_defaults_still_load(tmp_path):
    """A run directory's config.yaml from before the pipeline holds the old fields at their defaults: it loads,
    meaning what it meant (the serial reference)."""
    path = tmp_path / "config.yaml"
    path.write_text("overlap:\n  moe_overlap_dispatch: false\n  moe_a2a_backend: auto\n  moe_a2a_chunks: 1\n"
                    "  moe_sync_free_dispatch: false\n")
    assert load_config(path).overlap == OverlapConfig(moe_pipeline=False, moe_dispatch_once_per_rank=False,
                                                      overlap_moe_expert_parallel_comm=False,
                                                      delay_wgrad_compute=False)


def test_tp_comm_backend_symm_needs_cuda():
    cfg = load_config(TINY, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                             "overlap.tp_comm_overlap=true", "overlap.tp_comm_overlap_ag=true",
                             "overlap.tp_comm_backend=symm"])
    check(_world_error(cfg, 4, "cpu"), "overlap.tp_comm_backend", "'symm'", "device 'cpu'", "auto, p2p")


# World rules on configs built directly (no load_config): the rules do not depend on the other fields.
def _pp_config(pp: int, ep: int) -> Config:
    return Config(model=ModelConfig(num_moe_experts=8),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep),
                  train=TrainConfig(micro_batch_size=1, global_batch_size=48))


def test_world_divisible_by_model_parallel():
    check(_world_error(_pp_config(pp=2, ep=1), 3), "world_size", "3",
          "divisible by tensor x context x pipeline parallel sizes = 2")


def test_expert_ranks_divide_world_over_pp():
    # world 6, PP 2: a stage has 3 ranks, which EP=2 does not divide (though EP=2 divides 6).
    check(_world_error(_pp_config(pp=2, ep=2), 6), "parallel.expert_model_parallel_size", "2",
          "world_size / pipeline_model_parallel_size = 3")
    validate_for_world(_pp_config(pp=2, ep=2), 8, "cpu")  # 4 ranks per stage: fine


@pytest.mark.parametrize("world", [1, 2, 4])
def test_valid_worlds_for_tiny(world):
    cfg = load_config(TINY, ["parallel.expert_model_parallel_size=1"] if world == 1 else [])
    validate_for_world(cfg, world, "cpu")
    assert cfg.num_micro_batches(world) * cfg.train.micro_batch_size * cfg.data_parallel_size(world) == 32


# ------------------------------------------------------------------------------------ positive cases

SHIPPED = sorted(CONFIGS.glob("*.yaml"))


def test_shipped_configs_exist():
    names = {p.name for p in SHIPPED}
    assert {"tiny.yaml", "mixtral_8x7b.yaml", "deepseek_like.yaml", "small_gpu.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_loads(path):
    cfg = load_config(path)
    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size
    world *= p.expert_model_parallel_size
    device = "cuda" if cfg.train.device == "cuda" else "cpu"
    validate_for_world(cfg, world, device)


def test_deepseek_like_loads_and_a_small_copy_trains_a_step_with_its_router(tmp_path):
    """configs/deepseek_like.yaml waits for nothing: its router (sigmoid scores, group-limited top-k, the
    aux-loss-free expert bias, the sequence-level auxiliary loss) and shared expert are built. The file has
    the dimensions it states, and a copy shrunk to CPU size (same router and layer pattern) trains a step."""
    import math

    import torch

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.models.mixtral import count_parameters
    from moe_overlap.training.trainer import Trainer

    path = CONFIGS / "deepseek_like.yaml"
    m = load_config(path).model
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_router_score_function) == (64, 6, "sigmoid")
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_load_balancing_type) == (8, 4,
                                                                                                      "seq_aux_loss")
    assert m.moe_router_enable_expert_bias and m.moe_shared_expert_intermediate_size == 2816
    assert not m.is_moe_layer(0) and all(m.is_moe_layer(i) for i in range(1, m.num_layers))
    assert abs(count_parameters(m) - 9.0e9) <= 0.05e9  # "about 9.0B parameters", as the file says

    tokens = 4 * 16  # global batch 4 x seq_length 16
    cfg = load_config(path, [
        "model.num_layers=3", "model.moe_layer_freq=[0,1,1]", "model.hidden_size=32", "model.ffn_hidden_size=64",
        "model.num_attention_heads=4", "model.seq_length=16", "model.moe_ffn_hidden_size=16",
        "model.moe_shared_expert_intermediate_size=32", "parallel.expert_model_parallel_size=1",
        "train.device=cpu", "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=4",
        "train.eval_interval=0", f"train.output_dir={tmp_path}", "checkpoint.save_final=false"])
    trainer = Trainer(cfg, Mesh.single(), torch.device("cpu"))
    routers = trainer.model.routers()
    assert sorted(routers) == [1, 2]  # the first layer is dense
    metrics = trainer.train_step()
    assert math.isfinite(metrics["loss"]) and not metrics["skipped"]
    assert metrics["aux_loss"] > 0  # the sequence-level balance loss is in the step
    rate = cfg.model.moe_router_bias_update_rate
    for layer, router in routers.items():
        load_E = torch.tensor(metrics["tokens_per_expert"][str(layer)], dtype=torch.float32)
        assert load_E.sum() == tokens * 6  # every token's 6 copies, none dropped
        # aux-loss-free balancing: each expert's bias moved one step against its load's deviation from the mean
        assert torch.equal(router.expert_bias, rate * torch.sign(load_E.mean() - load_E))


def test_mixtral_8x7b_dimensions_and_parameter_count():
    from moe_overlap.models.mixtral import count_parameters

    cfg = load_config(CONFIGS / "mixtral_8x7b.yaml")
    m = cfg.model
    assert (m.vocab_size, m.hidden_size, m.num_layers) == (32000, 4096, 32)
    assert (m.num_attention_heads, m.query_groups) == (32, 8)
    assert (m.expert_ffn_hidden_size, m.num_moe_experts, m.moe_router_topk) == (14336, 8, 2)
    assert all(m.is_moe_layer(i) for i in range(m.num_layers)) and not m.share_embeddings_and_output_weights
    assert (m.rotary_base, m.norm_epsilon, m.seq_length, m.moe_aux_loss_coeff) == (1e6, 1e-5, 4096, 0.02)
    assert cfg.parallel.expert_model_parallel_size == 8 and cfg.train.precision == "bf16"
    assert abs(count_parameters(m) - 46.7e9) <= 0.1e9


def test_small_gpu_shape():
    from moe_overlap.models.mixtral import count_parameters

    cfg = load_config(CONFIGS / "small_gpu.yaml")
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.train.device == "cuda"
    assert cfg.train.precision == "bf16" and cfg.model.vocab_size == 256 and cfg.data.path is None
    assert not cfg.model.is_moe_layer(0) and cfg.model.is_moe_layer(1)
    assert 100e6 < count_parameters(cfg.model) < 1e9
    validate_for_world(cfg, 2, "cuda")


def test_defaults_load():
    cfg = load_config(None)
    # auto: a dense model exchanges nothing
    assert cfg == Config(overlap=OverlapConfig(moe_pipeline=False, moe_dispatch_once_per_rank=False,
                                               overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False),
                         train=TrainConfig(moe_cuda_graph=False))


CUDA = ["train.device=cuda"]
BF16 = ["train.precision=bf16"]


@pytest.mark.parametrize("overrides, pipeline, planning, graphed", [
    ([], True, "auto", False),  # TINY exchanges (EP=2): the fastest measured path (fp32: eager, below)
    (["train.precision=bf16"], True, "auto", "auto"),  # graphs where the fabric plans on the device
    (["train.device=cpu"], True, "auto", False),  # CUDA graphs need CUDA
    (["parallel.expert_model_parallel_size=1"], False, "auto", False),  # one expert rank
    (["parallel.expert_model_parallel_size=1", "overlap.moe_pipeline_chunks=2"], True, "auto", False),  # asked for
    (["train.expert_wgrad_micro_batches=2"], False, "auto", False),  # what the pipeline's chunks replace
    (["overlap.moe_pipeline=false"], False, "auto", False),  # the serial reference stays explicit
    (["train.moe_cuda_graph=true", "train.precision=bf16"], True, "device", True),  # the plan a graph replays
    # paired micro-batches turn on what they need: the pipeline and eager layers; planning is the transport's choice
    # (device planning where sm_push runs, its pushes beside the other micro-batch: faster there), at any PP
    (["overlap.overlap_moe_expert_parallel_comm=true"], True, "auto", False),
    # graphed layers asked for: each pair's halves run whole on two streams, planned on the device
    (BF16 + ["train.moe_cuda_graph=true", "overlap.overlap_moe_expert_parallel_comm=true"], True, "device", True),
    (["overlap.overlap_moe_expert_parallel_comm=true", "overlap.moe_planning=host"], True, "host", False),
    (["train.moe_cuda_graph=false", "overlap.overlap_moe_expert_parallel_comm=true",
      "parallel.pipeline_model_parallel_size=2"], True, "auto", False),
])
def test_moe_pipeline_auto(overrides, pipeline, planning, graphed):
    cfg = load_config(TINY, overrides)
    assert (cfg.overlap.moe_pipeline, cfg.overlap.moe_planning, cfg.train.moe_cuda_graph) == (pipeline, planning,
                                                                                                graphed)


@pytest.mark.parametrize("extra, field", [
    (["parallel.pipeline_model_parallel_size=2", "overlap.batch_p2p_comm=true"], "overlap.batch_p2p_comm"),
    (["overlap.moe_paged_stash_factor=1.5"], "overlap.moe_paged_stash_factor"),
    # this hung on GPUs (benchmarks/RESULTS.md, "Pairs on two streams") and has not run since its likely cause went
    (["parallel.pipeline_model_parallel_size=2"], "parallel.pipeline_model_parallel_size"),
])
def test_pairs_on_streams_refuse_what_they_do_not_implement(extra, field):
    """Paired micro-batches with graphed MoE layers run each pair's halves on two streams: batched transfers between
    pipeline stages, the paged stash and pipeline stages with an exchange between expert ranks are not implemented
    there, each refused in one line naming its field."""
    streams = BF16 + ["train.moe_cuda_graph=true", "overlap.overlap_moe_expert_parallel_comm=true"]
    with pytest.raises(ConfigError, match=f"{field}=.*not implemented yet.*two streams"):
        load_config(TINY, streams + extra)


@pytest.mark.parametrize("once_per_rank", ["true", "false"])
def test_pairs_on_streams_take_a_bounded_exchange(once_per_rank):
    """A bounded exchange (wire rows or copies) on two streams: refused while it hung on GPUs, whose cause was both
    graph sets sharing one cuBLAS workspace (layers/moe.py, capture_moe_layers); it ran on 2xH200 since."""
    streams = BF16 + ["train.moe_cuda_graph=true", "overlap.overlap_moe_expert_parallel_comm=true"]
    cfg = load_config(TINY, streams + ["overlap.moe_expert_rank_capacity_factor=1.5",
                                       f"overlap.moe_dispatch_once_per_rank={once_per_rank}"])
    assert cfg.overlap.moe_expert_rank_capacity_factor == 1.5 and pairs_on_streams(cfg)


@pytest.mark.parametrize("overrides, delayed", [
    # unpaired measured faster (tuning.py); whether auto pairs on two streams is decided when the ranks start
    (CUDA + BF16 + ["train.moe_cuda_graph=true", "model.moe_router_topk=4"], "auto"),
    (CUDA + BF16 + ["train.moe_cuda_graph=true", "model.moe_router_topk=4",
                    "overlap.overlap_moe_expert_parallel_comm=false"], True),
    (CUDA + ["overlap.moe_planning=device", "model.moe_router_topk=4"], True),
    (CUDA + BF16 + ["train.moe_cuda_graph=true"], False),  # top-2: each copy its own row, not measured
    (CUDA + ["model.moe_router_topk=4"], "auto"),  # planning left to the transport: decided when the ranks start
    (["train.device=cpu", "model.moe_router_topk=4"], False),  # the CPU plans on the host
    (CUDA + BF16 + ["train.moe_cuda_graph=true", "model.moe_router_topk=4", "overlap.moe_pipeline_chunks=2",
             "overlap.moe_expert_rank_capacity_factor=1.25"], False),  # chunks: the wgrad runs beside the next one
    (CUDA + BF16 + ["train.moe_cuda_graph=true", "model.moe_router_topk=4", "overlap.delay_wgrad_compute=false"],
     False),
    (CUDA + ["model.moe_router_topk=4", "overlap.moe_pipeline=false"], False),  # the serial reference
    (CUDA + BF16 + ["train.moe_cuda_graph=true", "model.moe_router_topk=4", "parallel.expert_model_parallel_size=1"],
     False),
])
def test_delay_wgrad_auto(overrides, delayed):
    cfg = load_config(TINY, overrides)
    assert cfg.overlap.delay_wgrad_compute is delayed


SHARED_EXPERT = ["model.moe_shared_expert_intermediate_size=64"]


@pytest.mark.parametrize("overrides, beside", [
    (SHARED_EXPERT, True),  # a pipelined exchange (the CPU too): measured faster at EP=4 (tuning.py)
    (CUDA + BF16 + SHARED_EXPERT + ["train.moe_cuda_graph=true"], True),
    (SHARED_EXPERT + ["overlap.moe_pipeline=false"], False),  # the serial reference
    (SHARED_EXPERT + ["parallel.expert_model_parallel_size=1"], False),  # nothing to exchange
    ([], False),  # no shared expert
    (SHARED_EXPERT + ["model.moe_shared_expert_overlap=false"], False),  # explicit values stay
])
def test_shared_expert_overlap_auto(overrides, beside):
    cfg = load_config(TINY, overrides)
    assert cfg.model.moe_shared_expert_overlap is beside


@pytest.mark.parametrize("overrides, paired", [
    (CUDA, "auto"),  # top-2 on CUDA with an exchange: the fabric decides when the ranks start
    ([], False),  # measured on CUDA over NCCL only
    (CUDA + ["model.moe_router_topk=4"], "auto"),  # finer models too: over NCCL paired measured faster (tuning.py)
    (CUDA + ["parallel.expert_model_parallel_size=1"], False),  # nothing to exchange
    # one GPU's graphed MoE layers: on two streams where they fit the GPU (decided when the ranks start)
    (CUDA + BF16 + ["parallel.expert_model_parallel_size=1", "train.moe_cuda_graph=true"], "auto"),
    (CUDA + ["overlap.moe_pipeline=false"], False),  # the serial reference
    # one host's graphed pipeline: on two streams where they fit the GPU (decided when the ranks start)
    (CUDA + BF16 + ["train.moe_cuda_graph=true"], "auto"),
    (CUDA + BF16 + ["train.moe_cuda_graph=true", "overlap.moe_pipeline_chunks=2"], False),  # not measured paired
    (CUDA + BF16 + ["overlap.moe_transport=copy_engine"], False),  # host-planned: no graphs, eager pairs slower
    (CUDA + ["overlap.moe_planning=device"], False),
    (CUDA + ["overlap.moe_transport=sm_push"], False),
    (CUDA + ["overlap.moe_transport=nccl"], "auto"),  # the micro-batches are counted once the world is known
    (CUDA + ["parallel.pipeline_model_parallel_size=2"], False),  # measured slower eager under PP
    (CUDA + ["overlap.moe_pipeline_chunks=2"], False),  # not measured paired
    (CUDA + ["overlap.moe_token_slices=2"], False),  # slices run in one layer call
    (CUDA + ["train.recompute_granularity=full"], False),  # not implemented paired
    (CUDA + ["overlap.overlap_moe_expert_parallel_comm=false"], False),  # explicit values stay
    (CUDA + ["overlap.overlap_moe_expert_parallel_comm=true", "model.moe_router_topk=4"], True),
])
def test_pairing_auto(overrides, paired):
    cfg = load_config(TINY, overrides)
    assert cfg.overlap.overlap_moe_expert_parallel_comm == paired
    assert cfg.overlap.overlap_moe_expert_parallel_comm is not True or cfg.overlap.moe_pipeline is True
    # auto passes the pairing rules, its micro-batches counted or not
    validate_for_world(cfg, 2 * cfg.parallel.pipeline_model_parallel_size, "cuda")


@pytest.mark.parametrize("transport, micro_batches, paired", [
    ("nccl", 8, True), ("nccl", 2, True), ("nccl", 1, False), ("sm_push", 8, False), ("copy_engine", 8, False),
    ("gloo", 8, False),
])
def test_pairing_by_transport(transport, micro_batches, paired):
    assert pairing_by_transport(transport, micro_batches)[0] is paired


@pytest.mark.parametrize("overrides, graphed", [
    (CUDA + BF16, "auto"),  # an exchange on CUDA: graphed if the fabric plans it on the device
    (CUDA, False),  # TINY's fp32: graphed layers measured and GPU-tested in bf16 only
    (["train.device=cpu"], False),
    (CUDA + ["parallel.expert_model_parallel_size=1"], False),  # measured faster only with an exchange
    (CUDA + ["overlap.overlap_moe_expert_parallel_comm=true"], False),  # stages: a graph cannot hold them
    (CUDA + ["overlap.moe_pipeline=false"], False),  # the serial exchange's host sync
    (CUDA + ["overlap.moe_planning=host"], False),
    (CUDA + ["overlap.moe_transport=nccl"], False),
    (CUDA + ["train.expert_wgrad_micro_batches=4", "overlap.moe_pipeline=false"], False),
    (CUDA + ["train.recompute_granularity=full"], False),  # not implemented graphed
    (CUDA + BF16 + ["parallel.pipeline_model_parallel_size=2", "train.pipeline_schedule=zb_h1"], False),  # unmeasured
    (CUDA + BF16 + ["parallel.pipeline_model_parallel_size=2"], "auto"),  # 1f1b: a graph set per micro-batch in flight
])
def test_moe_cuda_graph_auto(overrides, graphed):
    cfg = load_config(TINY, overrides)
    assert cfg.train.moe_cuda_graph == graphed
    validate_for_world(cfg, 2 * cfg.parallel.pipeline_model_parallel_size, cfg.train.device)  # auto passes the rules


@pytest.mark.parametrize("planning, transport, fits, graphed, delayed, paired", [
    # one host with peer access: what measured fastest there, pairs on two streams where they fit the GPU
    ("device", "sm_push", True, True, False, True),
    ("device", "sm_push", False, True, True, False),
    ("host", "copy_engine", True, False, False, False),
    ("host", "nccl", True, False, False, True),  # NCCL pairs; a paired layer is stages, eager
])
def test_graphs_and_delay_auto_follow_the_fabric(monkeypatch, planning, transport, fits, graphed, delayed, paired):
    import torch

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training import run_setup

    cfg = load_config(TINY, CUDA + BF16 + ["model.moe_router_topk=4"])  # top-4: each token once per rank, one chunk
    assert (cfg.train.moe_cuda_graph, cfg.overlap.delay_wgrad_compute) == ("auto", "auto")
    monkeypatch.setattr(run_setup, "exchange_choice", lambda *args: (planning, transport, ""))
    monkeypatch.setattr(run_setup, "streams_by_memory", lambda *args: (fits, "the estimate"))
    run_setup.resolve_by_fabric(cfg, Mesh.single(), torch.device("cuda"))  # no tensor made: one rank, no agreement
    assert (cfg.train.moe_cuda_graph, cfg.overlap.delay_wgrad_compute) == (graphed, delayed)
    assert cfg.overlap.overlap_moe_expert_parallel_comm is paired
    assert cfg.overlap.moe_planning == ("device" if graphed else "auto")
    validate_for_world(cfg, 2, "cuda")


TOP4 = ["model.moe_router_topk=4"]


@pytest.mark.parametrize("overrides, once, pipeline", [
    (TOP4, True, True),  # a token's copies often share a rank: the fastest measured
    ([], False, True),  # TINY's top-2
    (TOP4 + ["overlap.moe_pipeline=false"], False, False),  # the serial exchange has no wire rows
    (TOP4 + ["parallel.expert_model_parallel_size=1"], False, False),  # nothing to exchange
    (TOP4 + ["model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"], False, True),
    (TOP4 + ["overlap.moe_dispatch_once_per_rank=false"], False, True),  # off stays off
    # set off, it asks for nothing: one expert rank stays serial
    (["parallel.expert_model_parallel_size=1", "overlap.moe_dispatch_once_per_rank=false"], False, False),
    (["overlap.moe_dispatch_once_per_rank=true"], True, True),  # on asks for the pipeline, whatever the top-k
    (TOP4 + BF16 + ["train.moe_cuda_graph=true", "overlap.overlap_moe_expert_parallel_comm=true"], True, True),
])
def test_once_per_rank_auto(overrides, once, pipeline):
    cfg = load_config(TINY, overrides)
    assert (cfg.overlap.moe_dispatch_once_per_rank, cfg.overlap.moe_pipeline) == (once, pipeline)


@pytest.mark.parametrize("override,attr,expected", [
    ("train.max_steps=8", ("train", "max_steps"), 8),
    ("train.lr=1e-3", ("train", "lr"), 1e-3),
    ("train.lr=2.5E-3", ("train", "lr"), 2.5e-3),
    ("train.lr=1", ("train", "lr"), 1.0),  # an int where a float is expected becomes a float
    ("model.rotary_base=1.0e6", ("model", "rotary_base"), 1e6),
    ("train.resume=true", ("train", "resume"), True),
    ("checkpoint.save_final=false", ("checkpoint", "save_final"), False),
    ("model.num_query_groups=2", ("model", "num_query_groups"), 2),
    ("model.num_query_groups=null", ("model", "num_query_groups"), None),
    ("model.num_query_groups=", ("model", "num_query_groups"), None),
    ("model.moe_layer_freq=[1,0,1,0]", ("model", "moe_layer_freq"), [1, 0, 1, 0]),
    ("model.moe_layer_freq=2", ("model", "moe_layer_freq"), 2),
    ("train.precision=bf16", ("train", "precision"), "bf16"),
    ("train.use_distributed_optimizer=true", ("train", "use_distributed_optimizer"), True),
    ("overlap.bucket_size_mb=null", ("overlap", "bucket_size_mb"), None),
    ("train.output_dir=runs/x y", ("train", "output_dir"), "runs/x y"),
    ("data.path=/tmp/tokens.bin", ("data", "path"), "/tmp/tokens.bin"),
    (" train.max_steps = 7", ("train", "max_steps"), 7),
])
def test_override_types(override, attr, expected):
    cfg = load_config(TINY, [override])
    got = getattr(getattr(cfg, attr[0]), attr[1])
    assert got == expected and type(got) is type(expected)


def test_yaml_then_overrides_precedence(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 6\n  hidden_size: 64\ntrain:\n  lr: 1e-3\n  min_lr: 1e-4\nparallel:\n")
    cfg = load_config(path, ["model.num_layers=2", "model.num_layers=3", "parallel.expert_model_parallel_size=1"])
    assert cfg.model.num_layers == 3  # later override wins over earlier, and both over the file
    assert cfg.model.hidden_size == 64  # file wins over the default
    assert (cfg.train.lr, cfg.train.min_lr) == (1e-3, 1e-4)  # exponent floats in the file are numbers
    assert cfg.model.ffn_hidden_size == ModelConfig().ffn_hidden_size  # untouched: the default
    # an override may bring the file from invalid to valid, since validation runs after all overrides
    path.write_text("train:\n  micro_batch_size: 3\n")
    assert load_config(path, ["train.global_batch_size=9"]).train.global_batch_size == 9


def test_error_keeps_field_value_and_allowed():
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["model.moe_router_topk=9"])
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.field_name, err.value) == ("model.moe_router_topk", 9) and "[1," in err.allowed


@pytest.mark.parametrize("override,field,value", [("overlap.dp_comm_ctas=2", "overlap.dp_comm_ctas", "2"),
                                                  ("overlap.ep_comm_ctas=2", "overlap.ep_comm_ctas", "2"),
                                                  ("overlap.gemm_sm_carveout=8", "overlap.gemm_sm_carveout", "8")])
def test_comm_resource_fields_need_cuda(override, field, value):
    cfg = load_config(TINY, [override])
    check(_world_error(cfg, 2, "cpu"), field, value, "needs train.device=cuda")
    validate_for_world(cfg, 2, "cuda")


def test_gemm_sm_carveout_auto_by_default():
    """auto, the default, leaves SMs free only where a push or a capped communicator runs beside a GEMM (none on the
    CPU): it loads and validates there as 0 does."""
    cfg = load_config(TINY)
    assert cfg.overlap.gemm_sm_carveout == "auto"
    validate_for_world(cfg, 2, "cpu")
    validate_for_world(load_config(TINY, ["overlap.gemm_sm_carveout=0"]), 2, "cpu")


@pytest.mark.parametrize("schedule, auto", [
    ([], "auto"), (["parallel.virtual_pipeline_model_parallel_size=2"], False),
    (["train.pipeline_schedule=zb_h1"], False), (["train.pipeline_schedule=all_forward_all_backward"], False)])
def test_moe_cuda_graph_under_every_pp_schedule(schedule, auto):
    """Graphed MoE layers under PP with every schedule (a copy of the graphs per micro-batch in flight) validate on
    CUDA; auto leaves the fabric to decide under 1F1B, and stays off under the others with an exchange (not measured
    there yet)."""
    pp = ["parallel.pipeline_model_parallel_size=2", *schedule]
    validate_for_world(load_config(TINY, ["train.moe_cuda_graph=true", *DEVICE_PLANNED, *BF16, *pp]), 4, "cuda")
    assert load_config(TINY, CUDA + BF16 + pp).train.moe_cuda_graph == auto


def test_moe_cuda_graph_needs_cuda():
    cfg = load_config(TINY, ["train.moe_cuda_graph=true", *DEVICE_PLANNED, *BF16])
    check(_world_error(cfg, 2, "cpu"), "train.moe_cuda_graph", "True", "train.device=cuda")
    validate_for_world(cfg, 2, "cuda")  # and is fine there


def test_moe_cuda_graph_needs_bf16():
    """torch._grouped_mm runs fp32 through a fallback that reads its offsets on the host: no graph can hold it
    (an fp32 capture failed on 4xH100); refused in one line, and auto stays eager."""
    with pytest.raises(ConfigError, match=r"^train.moe_cuda_graph=True: not implemented yet.*graphs of MoE layers in "
                                          r"fp32: torch._grouped_mm runs fp32 through a fallback"):
        load_config(TINY, ["train.moe_cuda_graph=true", *DEVICE_PLANNED])
    assert load_config(TINY, CUDA).train.moe_cuda_graph is False
