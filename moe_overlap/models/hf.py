"""Hugging Face MoE checkpoints <-> this model: the config translation and the tensor mapping.

The model's checkpoints hold logical tensors (one per expert, TP blocks assembled), so converting is a
renaming plus a few exact reshapes, both ways:

  Hugging Face (per layer N, ``model.layers.N.``)              ours (``layers.N.``)
  self_attn.{q,k,v}_proj.{weight,bias}                          self_attention.linear_qkv.weight / qkv_bias,
                                                                Megatron's grouped rows: per KV group its
                                                                queries, its key, its value
  self_attn.o_proj.weight                                       self_attention.linear_proj.weight
  self_attn.{q,k}_norm.weight                                   self_attention.{q,k}_layernorm.weight
  input_layernorm / post_attention_layernorm                    input_layernorm / pre_mlp_layernorm
  {block_sparse_moe,mlp}.gate.weight                            mlp.router.weight
  experts.E.{w1,gate_proj} + {w3,up_proj}  (F, H) each          mlp.experts.E.w13 (H, 2, F): transposed, stacked
  experts.E.{w2,down_proj} (H, F)                               mlp.experts.E.w2 (F, H): transposed
  mlp.{gate,up}_proj, mlp.down_proj  (dense layer)              mlp.linear_fc1.weight (2, F, H), mlp.linear_fc2
  mlp.shared_expert.*, mlp.shared_expert_gate.weight            mlp.shared_expert.linear_fc1/2, .gate_weight
  model.embed_tokens / model.norm / lm_head                     embedding / final_layernorm / output_layer

RoPE: Hugging Face's q/k projections are stored for ``rotate_half``, which rotates channel pairs
(i, i + D/2) of each head, the same pairs as layers/attention.apply_rotary: the conversion of the rotary
layout is the identity on these checkpoints (Meta's original interleaved-pair checkpoints would need a row
permutation; transformers' converters apply it before writing the Hugging Face format). The logits tests
prove it against ``transformers``' own forward.

Architectures (``model_type``): mixtral, qwen2_moe, qwen3_moe, olmoe. Anything our model cannot compute
the same way is refused with the config key or tensor name that asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from moe_overlap.config import ModelConfig


class HFConversionError(ValueError):
    """A checkpoint or config that cannot be converted; the message names the key."""


ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}

# Tensors some checkpoints carry that the config determines (old transformers saved the RoPE frequencies).
DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


# ------------------------------------------------------------------------------------------------ config


def _refuse(key: str, value: Any, why: str) -> HFConversionError:
    return HFConversionError(f"config.json: {key}={value!r}: {why}")


def _rope_theta(hf: dict) -> float:
    """RoPE base from transformers 5's ``rope_parameters`` or 4's ``rope_theta`` + ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _refuse("rope_parameters.rope_type", rope_type, "only plain RoPE ('default') is implemented")
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) != "default":
        raise _refuse("rope_scaling", scaling, "RoPE scaling is not implemented; only plain RoPE (null)")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise _refuse("rope_theta", None, "the RoPE base is missing (rope_parameters.rope_theta or rope_theta)")
    return float(theta)


def _moe_layers(hf: dict, arch: str) -> list[int]:
    """0/1 per layer: which layers have a MoE MLP."""
    layers = hf["num_hidden_layers"]
    if arch in ("mixtral", "olmoe"):
        return [1] * layers
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def _check_attention(hf: dict, arch: str) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf["hidden_act"], "the MLPs are SwiGLU: only 'silu' is implemented")
    if hf.get("attention_dropout", 0.0):
        raise _refuse("attention_dropout", hf["attention_dropout"], "attention has no dropout here: only 0")
    if hf.get("attention_bias"):  # qwen3_moe / olmoe: a bias on q, k, v and o
        raise _refuse("attention_bias", True, "self_attn.o_proj.bias has no counterpart (model.add_qkv_bias "
                      "adds one on q, k and v only)")
    if hf.get("clip_qkv") is not None:
        raise _refuse("clip_qkv", hf["clip_qkv"], "clamping q, k and v is not implemented: only null")
    if hf.get("router_jitter_noise", 0.0):
        raise _refuse("router_jitter_noise", hf["router_jitter_noise"], "router jitter is not implemented: only 0")
    if hf.get("quantization_config"):
        raise _refuse("quantization_config", hf["quantization_config"], "quantized weights are not implemented")
    if arch in ("qwen2_moe", "qwen3_moe"):
        sliding = hf.get("use_sliding_window", False) or any(
            kind != "full_attention" for kind in hf.get("layer_types") or [])
        if sliding:
            raise _refuse("use_sliding_window", True, "attention here is full causal: only false")
    elif hf.get("sliding_window") is not None:
        raise _refuse("sliding_window", hf["sliding_window"], "attention here is full causal: only null")


class _Required(dict):
    """A config.json whose missing keys fail by name."""

    def __missing__(self, key: str):
        raise HFConversionError(f"config.json: {key} is missing")


def model_fields_from_hf(hf: dict) -> dict[str, Any]:
    """ModelConfig fields equivalent to a Hugging Face config.json (a dict); refuses what we cannot compute."""
    hf = _Required(hf)
    arch = hf.get("model_type")
    if arch not in ARCHITECTURES:
        raise _refuse("model_type", arch, f"supported: {', '.join(ARCHITECTURES)}")
    _check_attention(hf, arch)
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    experts = hf["num_local_experts" if "num_local_experts" in hf else "num_experts"]  # transformers 5's name
    moe_layers = _moe_layers(hf, arch)
    fields = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=None if head_dim * heads == hidden else head_dim,
        vocab_size=hf["vocab_size"], seq_length=min(hf.get("max_position_embeddings", 4096), 4096),
        rotary_base=_rope_theta(hf), norm_epsilon=float(hf["rms_norm_eps"]),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        num_moe_experts=experts, moe_layer_freq=1 if all(moe_layers) else moe_layers,
        moe_router_topk=hf["num_experts_per_tok"],
        # Softmax over every expert then top-k: renormalised (norm_topk_prob, Mixtral always) it equals a
        # softmax over the k largest logits, our default; not renormalised it is moe_router_pre_softmax.
        moe_router_pre_softmax=arch != "mixtral" and not hf.get("norm_topk_prob", False),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
    )
    if arch in ("mixtral", "olmoe"):
        fields.update(ffn_hidden_size=hf["intermediate_size"], moe_ffn_hidden_size=hf["intermediate_size"])
    else:
        fields.update(ffn_hidden_size=hf["intermediate_size"], moe_ffn_hidden_size=hf["moe_intermediate_size"])
    if arch == "qwen2_moe":
        shared = hf.get("shared_expert_intermediate_size", 0)
        fields.update(add_qkv_bias=bool(hf.get("qkv_bias", True)),
                      moe_shared_expert_intermediate_size=shared or None, moe_shared_expert_gate=bool(shared))
    if arch in ("qwen3_moe", "olmoe"):
        fields.update(qk_layernorm=True, qk_layernorm_scope="head" if arch == "qwen3_moe" else "all_heads")
    return fields


def hf_config_from_model(cfg: ModelConfig, arch: str, base: dict | None = None, dtype: str | None = None) -> dict:
    """A config.json for ``arch`` describing ``cfg``; ``base`` (the imported model's config) keeps the
    fields the model does not hold (token ids, context length). Refuses what ``arch`` cannot express."""
    check_exportable(cfg, arch)
    hf = dict(base or {})
    moe_layers = [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]
    hf.update(
        architectures=[ARCHITECTURES[arch]], model_type=arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.query_groups, head_dim=cfg.head_dim, hidden_act="silu",
        rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
        tie_word_embeddings=cfg.share_embeddings_and_output_weights, num_experts_per_tok=cfg.moe_router_topk,
        router_aux_loss_coef=cfg.moe_aux_loss_coeff, attention_dropout=0.0, attention_bias=False,
    )
    hf.setdefault("max_position_embeddings", cfg.seq_length)
    hf.pop("rope_scaling", None)
    if dtype is not None:
        hf["torch_dtype"] = hf["dtype"] = dtype
    if arch in ("mixtral", "olmoe"):
        hf["intermediate_size"] = cfg.expert_ffn_hidden_size
    else:
        hf.update(intermediate_size=cfg.ffn_hidden_size, moe_intermediate_size=cfg.expert_ffn_hidden_size,
                  decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(moe_layers) if not moe],
                  use_sliding_window=False, layer_types=["full_attention"] * cfg.num_layers)
    if arch == "mixtral":
        hf.update(num_local_experts=cfg.num_moe_experts, sliding_window=None, router_jitter_noise=0.0)
    else:
        hf.update(num_experts=cfg.num_moe_experts, norm_topk_prob=not cfg.moe_router_pre_softmax)
        if "num_local_experts" in hf:  # transformers 5's name for it, from the imported config
            hf["num_local_experts"] = cfg.num_moe_experts
    if arch == "qwen2_moe":
        hf.update(qkv_bias=cfg.add_qkv_bias,
                  shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or 0)
    if arch == "olmoe":
        hf["clip_qkv"] = None
    return hf


def default_arch(cfg: ModelConfig) -> str:
    """The Hugging Face architecture that expresses ``cfg``: by its query/key norm, else Mixtral when every
    layer is MoE with Mixtral's router and nothing more, else Qwen2-MoE (dense layers, biases, shared experts)."""
    if cfg.qk_layernorm:
        return "qwen3_moe" if cfg.qk_layernorm_scope == "head" else "olmoe"
    plain = not (cfg.add_qkv_bias or cfg.moe_shared_expert_intermediate_size or cfg.moe_router_pre_softmax)
    all_moe = cfg.num_moe_experts is not None and all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    return "mixtral" if plain and all_moe else "qwen2_moe"


def check_exportable(cfg: ModelConfig, arch: str) -> None:
    """Refuse, naming our config field, what ``arch``'s forward would compute differently."""
    def refuse(name: str, why: str) -> HFConversionError:
        return HFConversionError(f"model.{name}={getattr(cfg, name)!r}: {why} ({arch} cannot express it)")

    if arch not in ARCHITECTURES:
        raise HFConversionError(f"--arch {arch!r}: supported: {', '.join(ARCHITECTURES)}")
    if cfg.num_moe_experts is None:
        raise refuse("num_moe_experts", "a dense model is not a MoE architecture")
    for name in ("moe_router_enable_expert_bias", "moe_router_num_groups"):
        if getattr(cfg, name) not in (False, None):
            raise refuse(name, "the router's choice depends on it")
    if cfg.moe_router_score_function != "softmax":
        raise refuse("moe_router_score_function", "Hugging Face routers score with a softmax")
    want_norm = {"qwen3_moe": "head", "olmoe": "all_heads"}.get(arch)
    if (cfg.qk_layernorm and cfg.qk_layernorm_scope) != (want_norm or False):
        raise refuse("qk_layernorm", f"{arch} has " + (f"a query/key norm over {want_norm}" if want_norm else
                                                         "no query/key norm"))
    if cfg.add_qkv_bias and arch != "qwen2_moe":
        raise refuse("add_qkv_bias", "only qwen2_moe has a bias on q, k and v alone")
    if cfg.moe_shared_expert_intermediate_size and not (arch == "qwen2_moe" and cfg.moe_shared_expert_gate):
        raise refuse("moe_shared_expert_intermediate_size", "only qwen2_moe has a shared expert, and always gated "
                     "(model.moe_shared_expert_gate)")
    if arch in ("mixtral", "olmoe") and not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        raise refuse("moe_layer_freq", "every layer's MLP must be MoE")
    if arch == "mixtral" and cfg.moe_router_pre_softmax:
        raise refuse("moe_router_pre_softmax", "Mixtral renormalises the top-k weights")


# ------------------------------------------------------------------------------------------------ tensors


@dataclass(frozen=True)
class TensorMap:
    """One logical tensor of ours and the Hugging Face tensors it is made of; ``kind`` names the exact
    rearrangement between them (see :data:`_CONVERSIONS`)."""

    ours: str
    hf: tuple[str, ...]
    kind: str = "same"


def _qkv_to_ours(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    q, k, v = parts
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def _qkv_to_hf(fused: torch.Tensor, groups: int, head_dim: int) -> list[torch.Tensor]:
    rest = fused.shape[1:]
    per_group = fused.reshape(groups, -1, *rest)
    q, k, v = per_group.split([per_group.shape[1] - 2 * head_dim, head_dim, head_dim], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


# kind -> (to ours: HF tensors -> our tensor, to HF: our tensor -> HF tensors); ``groups`` and ``head_dim``
# from the config. All are exact (copies and reshapes).
_CONVERSIONS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., list[torch.Tensor]]]] = {
    "same": (lambda parts, **_: parts[0], lambda t, **_: [t]),
    "qkv": (lambda parts, groups, **_: _qkv_to_ours(parts, groups),
            lambda t, groups, head_dim: _qkv_to_hf(t, groups, head_dim)),
    # dense fc1 (2, F, H) = [gate; up]
    "gate_up": (lambda parts, **_: torch.stack(parts), lambda t, **_: [t[0].contiguous(), t[1].contiguous()]),
    # expert w13 (H, 2, F) from gate and up (F, H) each
    "expert_fc1": (lambda parts, **_: torch.stack([p.t() for p in parts], dim=1).contiguous(),
                   lambda t, **_: [t[:, 0].t().contiguous(), t[:, 1].t().contiguous()]),
    # expert w2 (F, H) from down (H, F)
    "transpose": (lambda parts, **_: parts[0].t().contiguous(), lambda t, **_: [t.t().contiguous()]),
}


def to_ours(tensor_map: TensorMap, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Our logical tensor from its Hugging Face parts (in ``tensor_map.hf`` order)."""
    return _CONVERSIONS[tensor_map.kind][0](parts, groups=cfg.query_groups, head_dim=cfg.head_dim).contiguous()


def to_hf(tensor_map: TensorMap, tensor: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    """The Hugging Face tensors (in ``tensor_map.hf`` order) of our logical tensor."""
    return _CONVERSIONS[tensor_map.kind][1](tensor, groups=cfg.query_groups, head_dim=cfg.head_dim)


def tensor_maps(cfg: ModelConfig, arch: str) -> list[TensorMap]:
    """Every parameter of the model ``cfg`` describes, with its Hugging Face tensors under ``arch``."""
    maps = [TensorMap("embedding.weight", ("model.embed_tokens.weight",))]
    for n in range(cfg.num_layers):
        hf, ours = f"model.layers.{n}.", f"layers.{n}."
        attn = hf + "self_attn."
        maps += [
            TensorMap(ours + "input_layernorm.weight", (hf + "input_layernorm.weight",)),
            TensorMap(ours + "self_attention.linear_qkv.weight",
                      tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv"),
            TensorMap(ours + "self_attention.linear_proj.weight", (attn + "o_proj.weight",)),
            TensorMap(ours + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)),
        ]
        if cfg.add_qkv_bias:
            maps.append(TensorMap(ours + "self_attention.qkv_bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"),
                                  "qkv"))
        if cfg.qk_layernorm:
            maps += [TensorMap(f"{ours}self_attention.{p}_layernorm.weight", (f"{attn}{p}_norm.weight",))
                     for p in "qk"]
        mlp = hf + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        if not cfg.is_moe_layer(n):
            maps += [TensorMap(ours + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                               "gate_up"),
                     TensorMap(ours + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",))]
            continue
        maps.append(TensorMap(ours + "mlp.router.weight", (mlp + "gate.weight",)))
        names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(cfg.num_moe_experts):
            gate, up, down = (f"{mlp}experts.{e}.{name}.weight" for name in names)
            maps += [TensorMap(f"{ours}mlp.experts.{e}.w13", (gate, up), "expert_fc1"),
                     TensorMap(f"{ours}mlp.experts.{e}.w2", (down,), "transpose")]
        if cfg.moe_shared_expert_intermediate_size:
            shared = mlp + "shared_expert."
            maps += [TensorMap(ours + "mlp.shared_expert.linear_fc1.weight",
                               (shared + "gate_proj.weight", shared + "up_proj.weight"), "gate_up"),
                     TensorMap(ours + "mlp.shared_expert.linear_fc2.weight", (shared + "down_proj.weight",))]
            if cfg.moe_shared_expert_gate:
                maps.append(TensorMap(ours + "mlp.shared_expert.gate_weight", (mlp + "shared_expert_gate.weight",)))
    maps.append(TensorMap("final_layernorm.weight", ("model.norm.weight",)))
    if not cfg.share_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",)))
    return maps


def zero_tensors(cfg: ModelConfig, arch: str) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensors that exist without a counterpart here because they multiply nothing: qwen2_moe
    keeps an empty shared expert (intermediate size 0) and its gate when a model has none. Import skips
    them; export writes them (zeros), as transformers does."""
    if arch != "qwen2_moe" or cfg.moe_shared_expert_intermediate_size:
        return {}
    hidden, shapes = cfg.hidden_size, {}
    for n in range(cfg.num_layers):
        if cfg.is_moe_layer(n):
            shared = f"model.layers.{n}.mlp.shared_expert"
            shapes.update({f"{shared}.gate_proj.weight": (0, hidden), f"{shared}.up_proj.weight": (0, hidden),
                           f"{shared}.down_proj.weight": (hidden, 0), f"{shared}_gate.weight": (1, hidden)})
    return shapes


def unmapped_tensor_hint(name: str) -> str:
    """Why a Hugging Face tensor has no place in the model, for the refusal message."""
    hints = {"_proj.bias": "a bias on an attention projection: only q, k and v, with model.add_qkv_bias",
             "_norm.weight": "a query/key norm the config does not describe",
             "shared_expert": "a shared expert the config does not describe"}
    return next((hint for part, hint in hints.items() if part in name),
                "no counterpart in this model (its config.json describes no such tensor)")
