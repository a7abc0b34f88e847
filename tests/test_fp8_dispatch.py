"""``overlap.moe_dispatch_dtype=fp8``: the rows that feed the experts cross as E4M3 bytes with one float32 scale per
row (layers/wire_rows.py), dequantized on arrival. Same math: the layer equals the naive formula taking what
crossed (each token's hidden state and output gradient dequantized from FP8) within 1e-5 in fp32, for host and
device planning, 1 and 2 chunks, dropless and dropping capacity, on 2 gloo ranks and through the interpreted SM
push kernel on one; the packed rows carry exactly the dequantized values; bad configs are refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap.config import ConfigError, load_config
from moe_overlap.layers.wire_rows import hidden_columns, hidden_states, packed_hidden
from tests.test_moe_layer import CAPACITIES, OneRankTransports, fp8_values, moe_case, moe_cases

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


@pytest.mark.parametrize("overrides,fragment", [
    (["model.moe_router_topk=2", "overlap.moe_dispatch_once_per_rank=false"], "without each token once per rank"),
    (["overlap.moe_pipeline=false"], "needs overlap.moe_pipeline=true"),
])
def test_fp8_dispatch_refusals_name_the_field(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config("configs/tiny.yaml", ["overlap.moe_dispatch_dtype=fp8", "model.moe_router_topk=4", *overrides])
    assert str(err.value).startswith("overlap.moe_dispatch_dtype") and fragment in str(err.value)
