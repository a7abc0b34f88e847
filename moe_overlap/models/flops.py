"""Model FLOPs per trained token, by Megatron-Core's formula (as torchtitan counts them too): every GEMM's
2 x multiply-adds, attention over the whole sequence (not halved for causality), forward + backward = 3 x the
forward. MFU divides what the model needs by the time a step took, so work that does not count here
(recomputation, padding, the dense layers' idle experts) makes a step slower, not the count larger.
"""

from __future__ import annotations

from moe_overlap.config import ModelConfig


def flops_per_token(cfg: ModelConfig) -> float:
    """Forward + backward FLOPs per token of a training step."""
    h, d, s = cfg.hidden_size, cfg.head_dim, cfg.seq_length
    heads, groups = cfg.num_attention_heads, cfg.query_groups
    attention = 2 * h * (heads + 2 * groups) * d + 2 * 2 * s * heads * d + 2 * heads * d * h  # qkv, scores+AV, proj
    forward = 2 * h * cfg.vocab_size  # output layer
    for layer in range(cfg.num_layers):
        forward += attention
        if cfg.is_moe_layer(layer):
            forward += cfg.moe_router_topk * 6 * h * cfg.expert_ffn_hidden_size + 2 * h * cfg.num_moe_experts
            if cfg.moe_shared_expert_intermediate_size:
                forward += 6 * h * cfg.moe_shared_expert_intermediate_size
        else:
            forward += 6 * h * cfg.ffn_hidden_size
    return 3.0 * forward
