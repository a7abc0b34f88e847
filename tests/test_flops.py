"""FLOPs per trained token (the numerator of MFU) against a hand count for the two benchmark models.

Megatron-Core's formula: every GEMM counts 2 FLOPs per multiply-add, attention scores and their use over the
whole sequence (not halved for causality), a training step is 3 x the forward (forward + 2 x backward). With
h hidden, d head dim, s sequence, V vocab, and per layer:
  attention   QKV 2*h*(heads + 2*groups)*d   scores + AV 2*2*s*heads*d   output projection 2*heads*d*h
  MoE         top-k experts of 3 GEMMs (gate, up, down) 2*3*h*F each   router 2*h*E   shared expert 2*3*h*F_s
plus the output layer 2*h*V once (the embedding is a lookup).
"""

from __future__ import annotations

from pathlib import Path

from moe_overlap.config import load_config
from moe_overlap.models.flops import flops_per_token

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_mixtral_like_two_layers():
    # h 4096, 32 heads / 8 KV groups of d 128, s 4096, V 32000; 8 experts of F 14336, top-2, no shared expert
    qkv = 2 * 4096 * (32 + 2 * 8) * 128  # 50,331,648
    scores_and_av = 2 * 2 * 4096 * 32 * 128  # 67,108,864
    projection = 2 * 32 * 128 * 4096  # 33,554,432
    experts = 2 * 2 * 3 * 4096 * 14336  # top-2: 704,643,072
    router = 2 * 4096 * 8  # 65,536
    layer = qkv + scores_and_av + projection + experts + router  # 855,703,552
    output = 2 * 4096 * 32000  # 262,144,000
    forward = 2 * layer + output  # 1,973,551,104
    assert 3 * forward == 5_920_653_312
    assert flops_per_token(load_config(CONFIGS / "bench_mixtral_2l.yaml").model) == 5_920_653_312


def test_fine_grained_eight_layers():
    # h 2048, 16 heads / 4 KV groups of d 128, s 4096, V 32000; 64 experts of F 1024, top-8, a shared expert of 1024
    qkv = 2 * 2048 * (16 + 2 * 4) * 128  # 12,582,912
    scores_and_av = 2 * 2 * 4096 * 16 * 128  # 33,554,432
    projection = 2 * 16 * 128 * 2048  # 8,388,608
    experts = 8 * 2 * 3 * 2048 * 1024  # top-8: 100,663,296
    router = 2 * 2048 * 64  # 262,144
    shared = 2 * 3 * 2048 * 1024  # 12,582,912
    layer = qkv + scores_and_av + projection + experts + router + shared  # 168,034,304
    output = 2 * 2048 * 32000  # 131,072,000
    forward = 8 * layer + output  # 1,475,346,432
    assert 3 * forward == 4_426_039_296
    assert flops_per_token(load_config(CONFIGS / "bench_fine_8l.yaml").model) == 4_426_039_296


def test_dense_layers_count_their_ffn_not_the_experts():
    """A dense layer (moe_layer_freq 0) counts its own FFN, 2*3*h*ffn, in place of the routed experts."""
    cfg = load_config(CONFIGS / "bench_fine_8l.yaml").model
    first_dense = load_config(CONFIGS / "bench_fine_8l.yaml", ["model.moe_layer_freq=[0,1,1,1,1,1,1,1]"]).model
    moe_layer = 8 * 2 * 3 * 2048 * 1024 + 2 * 2048 * 64 + 2 * 3 * 2048 * 1024  # experts + router + shared
    dense_layer = 2 * 3 * 2048 * 1024  # ffn_hidden_size 1024
    assert flops_per_token(cfg) - flops_per_token(first_dense) == 3 * (moe_layer - dense_layer)
