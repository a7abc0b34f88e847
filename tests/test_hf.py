"""Hugging Face interoperability, proven against transformers' own models (tiny, random, fp32, CPU).

Import gives our model transformers' logits; export loads back in transformers with the same logits and
the same bytes; an import loads at EP=2 and TP=2 into exactly the single-process weights and trains to the
same losses and gradients; what cannot be represented is refused by name; truncated files are caught.
transformers is imported inside functions: the rank-pool workers import this module too.
"""

from __future__ import annotations

import json
import re
import shutil
import weakref
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_overlap.cli import main
from moe_overlap.config import ConfigError, load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.layers.param_info import is_expert_param
from moe_overlap.models.hf import HFConversionError, hf_config_from_model
from moe_overlap.models.mixtral import build_model
from moe_overlap.training import hf_checkpoint
from moe_overlap.training.hf_checkpoint import export_hf, import_hf, load_model_weights
from moe_overlap.training.optimizer import logical_grad_copies
from moe_overlap.training.trainer import Trainer
from tests.test_master import rel_err, world_and_mesh
from tests.test_tp import dense_tp_case

TOL = 1e-5
CPU = torch.device("cpu")
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def tiny_hf_model(arch: str):
    """A random 2-layer model of ``arch``; each exercises some of the mapping (see the comments)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, initializer_range=0.2, max_position_embeddings=64)
    if arch == "mixtral":
        config = tf.MixtralConfig(intermediate_size=16, num_local_experts=4, **common)
    elif arch == "qwen2_moe":  # q/k/v biases, a gated shared expert, weights not renormalised (pre-softmax)
        config = tf.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                   num_experts=4, norm_topk_prob=False, **common)
    elif arch == "qwen3_moe":  # per-head q/k norm, head_dim != hidden / heads, a dense first layer
        config = tf.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_experts=4, head_dim=16,
                                   norm_topk_prob=True, mlp_only_layers=[0], **common)
    else:  # olmoe: q/k norm over the whole projection, tied embeddings
        config = tf.OlmoeConfig(intermediate_size=16, num_experts=4, tie_word_embeddings=True, **common)
    return tf.AutoModelForCausalLM.from_config(config).eval()


@cache
def _imported(arch: str, root: str) -> tuple[Path, Path]:
    """(HF directory in several shards, our import of it), made once per session."""
    hf_dir, ckpt = Path(root) / f"{arch}_hf", Path(root) / f"{arch}_ckpt"
    tiny_hf_model(arch).save_pretrained(hf_dir, max_shard_size="20KB")
    import_hf(hf_dir, ckpt)
    return hf_dir, ckpt


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    return lambda arch: _imported(arch, root)


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits (its forward returns the loss): layers, final norm, output layer."""
    x = model.embedding(ids)
    for layer in model.layers.values():
        x = layer(x)[0]
    weight = model.embedding.weight if model.output_layer is None else model.output_layer.weight
    return model.final_layernorm(x) @ weight.t()


def safetensors_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_import_equals_transformers_and_export_round_trips(imported, tmp_path, arch):
    import transformers as tf

    hf_dir, ckpt = imported(arch)
    cfg = load_config(ckpt / "config.yaml")
    model = build_model(cfg.model, Mesh.single(), CPU, torch.float32, seed=7).eval()
    load_model_weights(model, str(ckpt))
    reference = tf.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
        assert rel_err(our_logits(model, ids), want) < TOL

    out = tmp_path / "exported"
    export_hf(ckpt, out, max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    original, exported = safetensors_tensors(hf_dir), safetensors_tensors(out)
    assert exported.keys() == original.keys()
    for name, tensor in original.items():  # bit-exact round trip
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    with torch.no_grad():
        assert rel_err(tf.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits, want) < TOL


def test_bf16_round_trip_keeps_dtype_and_bits(tmp_path):
    hf_dir = tmp_path / "hf"
    tiny_hf_model("mixtral").to(torch.bfloat16).save_pretrained(hf_dir)
    import_hf(hf_dir, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    original, exported = safetensors_tensors(hf_dir), safetensors_tensors(tmp_path / "out")
    assert all(t.dtype == torch.bfloat16 and torch.equal(exported[k], t) for k, t in original.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_import_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The import's writer asks for tensors one by one and drops each before the next: never the model."""
    live, seen_alive = weakref.WeakSet(), []
    make = hf_checkpoint._LazySavePlanner.resolve_data

    def spy(self, write_item):
        seen_alive.append(len(live))
        tensor = make(self, write_item)
        live.add(tensor)
        return tensor

    monkeypatch.setattr(hf_checkpoint._LazySavePlanner, "resolve_data", spy)
    tiny_hf_model("mixtral").save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert len(seen_alive) > 20 and max(seen_alive) <= 1


# ------------------------------------------------------------------------------------------ layouts


def logical_weights(model, mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's parameters by logical key, TP blocks gathered (a collective over TP / expert-TP)."""
    return {key: tensor for name, param in model.named_parameters()
            for key, tensor in logical_grad_copies(name, param, param.data,
                                                   mesh.etp if is_expert_param(param) else mesh.tp).items()}


def import_layout_case(ckpt: str, output_dir: str, layout: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """A run from the import under ``layout``: its slices are the single-process import's, bit for bit, and
    two steps give the single-process losses and gradients; then it saves. Returns the worst error and this
    rank's trained weights."""
    world = dist.get_world_size()
    dp = world // int(layout.get("parallel.tensor_model_parallel_size", 1))
    common = {"model.seq_length": 16, "train.micro_batch_size": 2, "train.global_batch_size": 4 * dp,
              "train.lr_warmup_steps": 1, "train.adam_eps": 1e-4, "train.eval_interval": 0,
              "train.output_dir": output_dir, "checkpoint.save_final": "false"}
    config = Path(ckpt) / "config.yaml"
    cfg = load_config(config, [f"{k}={v}" for k, v in {**common, **layout}.items()])
    _, mesh = world_and_mesh(cfg)
    try:
        run, reference = Trainer(cfg, mesh, CPU), Trainer(load_config(config, [f"{k}={v}" for k, v in common.items()]),
                                                          Mesh.single(), CPU)
        single = logical_weights(reference.model, Mesh.single())
        for key, tensor in logical_weights(run.model, mesh).items():
            assert torch.equal(tensor, single[key]), key
        worst = 0.0
        for _ in range(2):
            grads = [{}, {}]
            metrics = [r.train_step(lambda opt, got=got: got.update(opt.logical_grads()))
                       for r, got in zip((run, reference), grads)]
            worst = max(worst, abs(metrics[0]["loss"] - metrics[1]["loss"]) / metrics[1]["loss"],
                        *(rel_err(grad, grads[1][key]) for key, grad in grads[0].items()))
        run.save()
        return worst, logical_weights(run.model, mesh)
    finally:
        mesh.destroy()


def tp2(**extra) -> dict:
    return {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": "true", **extra}


@pytest.mark.parametrize("arch,layout", [
    ("mixtral", {"parallel.expert_model_parallel_size": 2}),
    ("mixtral", tp2()),  # expert-TP 2: each expert's FFN split
    ("qwen2_moe", {"parallel.expert_model_parallel_size": 2}),
    ("qwen2_moe", tp2()),  # q/k/v bias blocks, shared-expert gate summed over TP
    ("qwen3_moe", tp2(**{"parallel.expert_model_parallel_size": 2, "parallel.expert_tensor_parallel_size": 1})),
    ("olmoe", tp2()),  # the whole-projection q/k norm across TP ranks
], ids=["mixtral_ep2", "mixtral_tp2", "qwen2_ep2", "qwen2_tp2", "qwen3_tp2_ep2", "olmoe_tp2"])
def test_import_at_layouts_equals_single_process_and_exports(rank_pool, imported, tmp_path, arch, layout):
    _, ckpt = imported(arch)
    results = rank_pool(2).run(import_layout_case, str(ckpt), str(tmp_path), layout)
    assert max(worst for worst, _ in results) < TOL
    # The layout's checkpoint (its checkpoints root, with the import's config) exports the weights it trained.
    trained = {key: tensor for _, weights in results for key, tensor in weights.items()}
    export_hf(tmp_path / "checkpoints", tmp_path / "exported", config=ckpt / "config.yaml")
    import_hf(tmp_path / "exported", tmp_path / "reimported")
    model = build_model(load_config(ckpt / "config.yaml").model, Mesh.single(), CPU, torch.float32, seed=7)
    load_model_weights(model, str(tmp_path / "reimported"))
    exported = logical_weights(model, Mesh.single())
    assert exported.keys() == trained.keys()
    assert all(torch.equal(tensor, trained[key]) for key, tensor in exported.items())


def test_qk_norm_and_bias_under_tp_without_sequence_parallel(rank_pool, tmp_path):
    """Dense TP=2 without sequence parallelism: each rank's heads add to the per-head q/k norm's gradient."""
    extra = {"model.qk_layernorm": "true", "model.add_qkv_bias": "true", "model.kv_channels": 16}
    assert max(rank_pool(2).run(dense_tp_case, str(tmp_path), **extra)) < TOL


def test_export_of_a_running_job_follows_its_newest_checkpoint(imported, tmp_path, monkeypatch, caplog):
    """The job rotates the step being read away (keep_last): export starts again from the newest one."""
    _, ckpt = imported("mixtral")
    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(ckpt, root / "step_00000001")
    shutil.copy(ckpt / "config.yaml", tmp_path / "run" / "config.yaml")
    (root / "latest").write_text('{"step": 1}')
    read = hf_checkpoint.checkpoint_metadata

    def rotate_then_read(step: Path):
        if step.name == "step_00000001":  # the job saves step 2 and removes step 1 under us
            shutil.copytree(step, root / "step_00000002")
            (root / "latest").write_text('{"step": 2}')
            shutil.rmtree(step)
        return read(step)

    monkeypatch.setattr(hf_checkpoint, "checkpoint_metadata", rotate_then_read)
    export_hf(tmp_path / "run", tmp_path / "out")
    assert "was removed while reading it" in caplog.text
    assert safetensors_tensors(tmp_path / "out").keys() == safetensors_tensors(imported("mixtral")[0]).keys()


# ------------------------------------------------------------------------------------------ refusals


def _hf_copy(imported, arch: str, tmp_path: Path) -> Path:
    hf_dir = tmp_path / arch
    shutil.copytree(imported(arch)[0], hf_dir)
    return hf_dir


@pytest.mark.parametrize("arch,key,value", [
    ("mixtral", "sliding_window", 8),
    ("mixtral", "hidden_act", "gelu"),
    ("mixtral", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
    ("mixtral", "model_type", "deepseek_v3"),
    ("qwen3_moe", "attention_bias", True),
    ("olmoe", "clip_qkv", 8.0),
    ("qwen2_moe", "use_sliding_window", True),
], ids=lambda v: str(v)[:12])
def test_import_refuses_config_naming_the_key(imported, tmp_path, arch, key, value):
    hf_dir = _hf_copy(imported, arch, tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(HFConversionError, match=re.escape(f"config.json: {key}")):
        import_hf(hf_dir, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_import_refuses_unknown_or_missing_tensors_and_truncated_shards(imported, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    hf_dir = _hf_copy(imported, "mixtral", tmp_path)
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = hf_dir / index["weight_map"][name]
    tensors = load_file(shard)
    save_file({**tensors, "model.layers.0.self_attn.o_proj.bias": torch.zeros(32)}, shard)
    with pytest.raises(HFConversionError, match="o_proj.bias: a bias on an attention projection"):
        import_hf(hf_dir, tmp_path / "ckpt")
    save_file({k: v for k, v in tensors.items() if k != name}, shard)
    with pytest.raises(HFConversionError, match=f"{name} is listed in model.safetensors.index.json but in none"):
        import_hf(hf_dir, tmp_path / "ckpt")
    index_file = hf_dir / "model.safetensors.index.json"
    index_file.write_text(json.dumps({**index, "weight_map": {k: v for k, v in index["weight_map"].items()
                                                             if k != name}}))
    with pytest.raises(HFConversionError, match=f"{name} is missing"):
        import_hf(hf_dir, tmp_path / "ckpt")
    save_file(tensors, shard)
    shard.write_bytes(shard.read_bytes()[:-100])  # an interrupted download
    assert main(["hf", "import", str(hf_dir), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert f"{shard}: truncated" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_export_refuses_what_the_architecture_cannot_express_and_truncated_checkpoints(imported, tmp_path):
    _, ckpt = imported("mixtral")
    cfg = load_config(ckpt / "config.yaml")
    with pytest.raises(HFConversionError, match="model.qk_layernorm=False"):
        export_hf(ckpt, tmp_path / "out", arch="qwen3_moe")
    sigmoid = load_config(ckpt / "config.yaml", ["model.moe_router_score_function=sigmoid"])
    with pytest.raises(HFConversionError, match="model.moe_router_score_function='sigmoid'"):
        hf_config_from_model(sigmoid.model, "mixtral")
    dense_first = load_config(ckpt / "config.yaml", ["model.moe_layer_freq=[0,1]"])
    with pytest.raises(HFConversionError, match="model.moe_layer_freq"):
        hf_config_from_model(dense_first.model, "mixtral")
    assert hf_config_from_model(dense_first.model, "qwen2_moe")["mlp_only_layers"] == [0]
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    data_file = max(copy.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data_file.write_bytes(data_file.read_bytes()[:-10])
    with pytest.raises(HFConversionError, match=f"{data_file}: truncated"):
        export_hf(copy, tmp_path / "out2")
    with pytest.raises(ConfigError, match="train.init_from"):  # the model config must match the checkpoint
        bigger = load_config(ckpt / "config.yaml", ["model.num_layers=3"])
        load_model_weights(build_model(bigger.model, Mesh.single(), CPU, torch.float32, 0), str(ckpt))
    assert cfg.model.num_moe_experts == 4
