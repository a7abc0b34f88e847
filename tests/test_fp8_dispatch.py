"""``overlap.moe_dispatch_dtype=fp8``: the rows that feed the experts cross as E4M3 bytes with one float32 scale per
row (layers/wire_rows.py), dequantized on arrival. Same math: the layer equals the naive formula taking what
crossed (each token's hidden state and output gradient dequantized from FP8) within 1e-5 in fp32, for host and
device planning, 1 and 2 chunks, dropless and dropping capacity, on 2 gloo ranks and through the interpreted SM
push kernel on one; the packed rows carry exactly the dequantized values; bad configs are refused in one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_overlap.config import ConfigError, ModelConfig, OverlapConfig, load_config
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.layers import dispatch_pipeline
from moe_overlap.layers.fp8 import Fp8, Fp8Rows
from moe_overlap.layers.moe import MoELayer
from moe_overlap.layers.wire_rows import hidden_columns, hidden_states, packed_hidden
from tests.test_moe_layer import (CAPACITIES, E, F, H, FixedRouter, OneRankTransports, fp8_values,
                                  full_expert_weights, moe_case, moe_cases, rank_inputs, rel_err)

FP8_WIRE = dict(once_per_rank=True, dispatch_dtype="fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_carry_exactly_the_dequantized_values(dtype):
    """Packed, then read back: bit for bit what the row quantized to, in half the bytes (or a quarter in fp32)."""
    g = torch.Generator().manual_seed(0)
    x_TH = (torch.randn(5, 64, generator=g) * torch.logspace(-3, 3, 5).unsqueeze(1)).to(dtype)
    packed_TX = packed_hidden(x_TH, fp8=True)
    assert packed_TX.dtype == dtype and packed_TX.shape == (5, hidden_columns(64, dtype, fp8=True))
    assert packed_TX.element_size() * packed_TX.shape[1] == 80  # 64 bytes, the scale, padded to 16 bytes
    assert torch.equal(hidden_states(packed_TX, 64, fp8=True), fp8_values(x_TH))
    assert not torch.equal(fp8_values(x_TH), x_TH)  # the quantization is real: 3 mantissa bits
    assert float((fp8_values(x_TH) - x_TH).norm() / x_TH.norm()) < 0.05
    assert torch.equal(hidden_states(x_TH, 64, fp8=False), x_TH)  # bf16: the rows as they are


@pytest.mark.parametrize("routing", ["sparse", "first_rank_only"])
def test_fp8_dispatch_equals_the_formula_on_what_crossed(rank_pool, routing):
    settings = [dict(planning=p, chunks=c, **cap, **FP8_WIRE) for p in ("host", "device") for c in (1, 2)
                for cap in CAPACITIES[:2]]
    errors = rank_pool(2).run(moe_cases, routing, 2, settings)
    assert max(max(e) for e in errors) < 1e-5


def test_fp8_dispatch_through_the_interpreted_push_kernel(monkeypatch):
    """FP8 bytes as raw bits through a symmetric region, the SM push kernel and the first chunk's rows read from
    the region (interpreted): bit-exact, or the math would be off."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert moe_case("random", 4, planning="device", force_pipeline=True,
                    selectors={"device": OneRankTransports("sm_push")}, chunks=1, **FP8_WIRE) < 1e-5


def fp8_recipe_layer_run(mesh, selector, routing: str, chunks: int, straight: bool) -> tuple[list, list[bool]]:
    """The pipelined layer with FP8 on the wire and emulated FP8 GEMMs (train.fp8_recipe's math in fp32): its
    output and gradients, and for each chunk whether its rows reached the experts as FP8 (``straight``; else
    dequantized on arrival and quantized again by the GEMM, as before the straight feed)."""
    cfg = ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=2)
    overlap = OverlapConfig(moe_pipeline=True, moe_pipeline_chunks=chunks, moe_planning=selector.planning,
                            moe_dispatch_once_per_rank=True, moe_dispatch_dtype="fp8",
                            delay_wgrad_compute=chunks == 1,  # the weight gradients after the dgrads, or each beside
                            moe_expert_rank_capacity_factor=None)
    layer = MoELayer(cfg, overlap, mesh.ep, selector)
    layer.experts.fp8 = Fp8(emulate=True)
    w13, w2 = full_expert_weights()
    local = slice(layer.experts.first_expert, layer.experts.first_expert + layer.experts.num_local_experts)
    with torch.no_grad():
        layer.experts.w13.copy_(w13[local])
        layer.experts.w2.copy_(w2[local])
    x, upstream, probs, experts = rank_inputs(dist.get_rank(), routing, 2)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    layer.router = FixedRouter(probs, experts, None)
    fed, arrived_rows = [], dispatch_pipeline.arrived_rows

    def arrived(*args, keep_fp8: bool = False):
        rows = arrived_rows(*args, keep_fp8=keep_fp8 and straight)
        fed.append(isinstance(rows.x_WH, Fp8Rows))
        return rows

    dispatch_pipeline.arrived_rows = arrived
    try:
        out = layer(x.unsqueeze(0))[0].squeeze(0)
        out.backward(upstream)
    finally:
        dispatch_pipeline.arrived_rows = arrived_rows
    return [out, x.grad, probs.grad, layer.experts.w13.grad, layer.experts.w2.grad], fed


def straight_feed_case(routing: str) -> tuple[float, list[bool]]:
    mesh = Mesh.create(MeshLayout(dist.get_world_size(), ep=dist.get_world_size()), timeout_s=60)
    try:
        errors, fed = [], []
        for planning in ("host", "device"):
            selector = TransportSelector(planning, "auto", mesh.ep.group, mesh.ep.ranks, torch.device("cpu"), E, 60)
            for chunks in (1, 2):
                (straight, fed_straight), (requantized, fed_requantized) = (
                    fp8_recipe_layer_run(mesh, selector, routing, chunks, s) for s in (True, False))
                errors += [rel_err(a, b) for a, b in zip(straight, requantized) if b.norm() > 0]
                fed.append(all(fed_straight) and fed_straight and not any(fed_requantized))
        return max(errors), fed
    finally:
        mesh.destroy()


@pytest.mark.parametrize("routing", ["sparse", "first_rank_only"])
def test_fp8_dispatch_feeds_the_fp8_gemm_the_rows_as_they_crossed(rank_pool, routing):
    """Under train.fp8_recipe the dispatched rows reach the experts' first GEMM as the E4M3 bytes and scales that
    crossed (Fp8Rows), not dequantized and quantized again; the math is that of the requantized path (the bytes
    requantize to themselves) within fp32's round-off of the scales, host and device planning, 1 chunk with delayed
    weight gradients (the rows dequantized for them after every dgrad) and 2 chunks, 2 gloo ranks."""
    for error, fed in rank_pool(2).run(straight_feed_case, routing):
        assert all(fed), fed
        assert error < 1e-6, error


@pytest.mark.parametrize("overrides,fragment", [
    (["model.moe_router_topk=2", "overlap.moe_dispatch_once_per_rank=false"], "without each token once per rank"),
    (["overlap.moe_pipeline=false"], "needs overlap.moe_pipeline=true"),
])
def test_fp8_dispatch_refusals_name_the_field(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", ["overlap.moe_dispatch_dtype=fp8", "model.moe_router_topk=4", *overrides])
    assert str(err.value).startswith("overlap.moe_dispatch_dtype") and fragment in str(err.value)
