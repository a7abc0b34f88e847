"""Mixtral-style decoder assembled from the config: dense or MoE MLP per layer, GQA attention, RMSNorm."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_overlap.config import ModelConfig
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.layers.attention import SelfAttention
from moe_overlap.layers.embedding import Embedding, lm_cross_entropy
from moe_overlap.layers.init import init_parameters
from moe_overlap.layers.linear import Linear
from moe_overlap.layers.mlp import SwiGLUMLP
from moe_overlap.layers.moe import MoELayer
from moe_overlap.layers.norm import RMSNorm


class TransformerLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, mesh: Mesh, device=None, dtype=None):
        super().__init__()
        self.is_moe = cfg.is_moe_layer(layer_index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, device, dtype)
        self.self_attention = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups,
                                            cfg.rotary_base, device, dtype)
        self.pre_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, device, dtype)
        if self.is_moe:
            self.mlp = MoELayer(cfg, mesh.ep, device, dtype)
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.ffn_hidden_size, device, dtype)

    def forward(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Returns the output and, for a MoE layer, its auxiliary loss and tokens per expert."""
        x_BSH = x_BSH + self.self_attention(self.input_layernorm(x_BSH))
        mlp_in = self.pre_mlp_layernorm(x_BSH)
        if self.is_moe:
            mlp_out, aux_loss, tokens_per_expert = self.mlp(mlp_in)
            return x_BSH + mlp_out, aux_loss, tokens_per_expert
        return x_BSH + self.mlp(mlp_in), None, None


@dataclass
class ModelOutput:
    loss: torch.Tensor  # what backward runs on: cross-entropy + auxiliary losses
    lm_loss: torch.Tensor  # detached cross-entropy, for logging
    aux_loss: torch.Tensor  # detached sum of the MoE auxiliary losses
    tokens_per_expert: dict[int, torch.Tensor]  # layer index -> copies routed to each global expert


class MixtralModel(nn.Module):
    def __init__(self, cfg: ModelConfig, mesh: Mesh, device=None, dtype=None, recompute: bool = False):
        super().__init__()
        self.cfg, self.recompute = cfg, recompute
        self.embedding = Embedding(cfg.vocab_size, cfg.hidden_size, device, dtype)
        self.layers = nn.ModuleList(TransformerLayer(cfg, i, mesh, device, dtype) for i in range(cfg.num_layers))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, device, dtype)
        self.output_layer = (None if cfg.share_embeddings_and_output_weights
                             else Linear(cfg.hidden_size, cfg.vocab_size, device=device, dtype=dtype))

    def init_weights(self, seed: int) -> None:
        init_parameters(self, seed, self.cfg.init_method_std, self.cfg.num_layers)

    def forward(self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor) -> ModelOutput:
        x_BSH = self.embedding(input_ids_BS)
        aux_loss = x_BSH.new_zeros((), dtype=torch.float32)
        tokens_per_expert = {}
        for index, layer in enumerate(self.layers):
            if self.recompute and torch.is_grad_enabled():
                x_BSH, layer_aux, layer_tokens = checkpoint(layer, x_BSH, use_reentrant=False)
            else:
                x_BSH, layer_aux, layer_tokens = layer(x_BSH)
            if layer_aux is not None:
                aux_loss = aux_loss + layer_aux
                tokens_per_expert[index] = layer_tokens
        output_weight = self.embedding.weight if self.output_layer is None else self.output_layer.weight
        lm_loss = lm_cross_entropy(self.final_layernorm(x_BSH), output_weight, labels_BS)
        return ModelOutput(lm_loss + aux_loss, lm_loss.detach(), aux_loss.detach(), tokens_per_expert)


def build_model(cfg: ModelConfig, mesh: Mesh, device: torch.device | str, dtype: torch.dtype, seed: int,
                recompute: bool = False) -> MixtralModel:
    """This rank's part of the model, initialised from the seed and each parameter's logical name."""
    model = MixtralModel(cfg, mesh, device, dtype, recompute)
    model.init_weights(seed)
    return model


def count_parameters(cfg: ModelConfig) -> int:
    """Logical parameter count (all experts), built on the meta device: no memory, no processes."""
    model = MixtralModel(cfg, Mesh.single(), device="meta", dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())
