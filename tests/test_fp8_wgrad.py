"""The FP8 weight gradient on CPU (train.fp8_wgrad; kernels/fp8_wgrad.py): the operands quantized along the tokens
(the twin's chunks, padding, scales per chunk and per group), the Triton quantize and GEMM kernels under the
interpreter against the twins (the GEMM on float32 holding E4M3 values: the interpreter's own E4M3 cast is wrong
on powers of two, tests/test_fp8_blockwise.py says how), the result against fp32, and the config field."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.config.schema import ConfigError
from moe_overlap.kernels import fp8_wgrad as W
from moe_overlap.kernels.fp8_quant import AMAX_FLOOR, FP8_MAX
from tests.test_fp8 import GEMM_TOL, rel_err

COUNTS = (0, 130, 7, 256, 0, 1)  # empty groups, a group of one chunk and a bit, exact chunks, one row


def grouped(counts=COUNTS, columns=48, seed=0, tail=5) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by int32 end offsets, with ``tail`` rows past the last offset that hold NaN (never read)."""
    torch.manual_seed(seed)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(int(offsets[-1]) + tail, columns) * torch.logspace(-2, 1, columns)
    x[int(offsets[-1]):] = float("nan")
    return x, offsets


def fp32_wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    ends = offsets.tolist()
    return torch.stack([a[s:e].t() @ b[s:e] for s, e in zip([0] + ends[:-1], ends)])


def test_fp8_wgrad_token_chunks_and_bound():
    offsets = torch.tensor([0, 130, 137, 393, 393, 394], dtype=torch.int32)
    assert W.token_chunks(offsets).tolist() == [0, 2, 3, 5, 5, 6]
    assert W.chunks_bound(394, 6) == 4 + 6 >= 6


@pytest.mark.parametrize("per_chunk", [True, False], ids=["per-chunk", "per-group"])
def test_fp8_wgrad_quantize_along_tokens_twin(per_chunk):
    """Each group's rows start at a multiple of 128 tokens, transposed, padded with zeros; one scale per (chunk,
    column) from that chunk's amax (blockwise) or the group's (rowwise), as the rowwise quantizer makes one; the
    rows past the last offset (NaN) are never read."""
    x, offsets = grouped()
    got = W.quantize_along_tokens_torch(x, offsets, per_chunk)
    chunk_ends = got.chunk_ends_E.tolist()
    assert got.q_MP.shape == (48, W.chunks_bound(x.shape[0], len(COUNTS)) * 128)
    assert torch.isfinite(got.q_MP.float()).all()
    values = got.dequantized()
    start, first = 0, 0
    for end, chunk_end in zip(offsets.tolist(), chunk_ends):
        rows = end - start
        block = values[:, first * 128:chunk_end * 128]
        assert torch.equal(block[:, rows:], torch.zeros_like(block[:, rows:]))  # padding
        if rows:
            assert rel_err(block[:, :rows].t(), x[start:end]) < 0.04
            amax = x[start:end].abs()
            scales = got.scale_CM[first:chunk_end]
            if per_chunk:
                padded = torch.zeros((chunk_end - first) * 128, 48)
                padded[:rows] = amax
                want = padded.reshape(-1, 128, 48).amax(1)
            else:
                want = amax.amax(0, keepdim=True).expand(chunk_end - first, 48)
            assert torch.equal(scales, want.clamp(min=AMAX_FLOOR) / FP8_MAX)
        start, first = end, chunk_end


@pytest.mark.parametrize("per_chunk, one_pass", [(True, True), (False, True), (False, False)],
                         ids=["per-chunk", "per-group", "per-group-two-launches"])
def test_fp8_wgrad_quantize_kernel_under_the_interpreter(monkeypatch, per_chunk, one_pass):
    """The Triton quantizer (per group: the one-launch kernel, and the two launches over the chunks): the twin's
    scales exactly, its values but where the interpreter's E4M3 cast is wrong (fp32 in; bf16 in: the scales only,
    the interpreter's E4M3 cast of those values is off by a step or more on 1% of them: on GPU they are equal,
    tests/test_gpu_fp8_wgrad.py); columns not a multiple of its block."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, offsets = grouped(columns=70)
    for rows in (x, x.bfloat16()):
        got, twin = W.quantize_along_tokens(rows, offsets, per_chunk, one_pass=one_pass), \
            W.quantize_along_tokens_torch(rows, offsets, per_chunk)
        used = int(twin.chunk_ends_E[-1])
        assert torch.equal(got.chunk_ends_E, twin.chunk_ends_E)
        assert torch.equal(got.scale_CM[:used], twin.scale_CM[:used])
        q, q_twin = got.q_MP[:, :used * 128].float(), twin.q_MP[:, :used * 128].float()
        interpreter_fault = (q_twin.abs() < 2.0 ** -6) | (torch.log2(q_twin.abs()) == torch.log2(q_twin.abs()).round())
        if rows.dtype == torch.float32:
            assert not ((q != q_twin) & ~interpreter_fault).any()


def as_float(t: W.TokenQuantized) -> W.TokenQuantized:
    """The same operand with its E4M3 values held as float32 (what the interpreter's tl.dot takes)."""
    return W.TokenQuantized(t.q_MP.float(), t.scale_CM, t.chunk_ends_E)


@pytest.mark.parametrize("per_chunk, fast_accum, segments", [
    (True, False, 1), (True, False, 2), (False, False, 1), (False, False, 2), (False, True, 1), (False, True, 4),
    (True, False, 3), (False, True, 6)],
    ids=["per-chunk", "per-chunk-pair", "per-group", "per-group-pair", "per-group-fast", "per-group-fast-four",
         "per-chunk-three", "per-group-fast-six"])
def test_fp8_wgrad_kernel_under_the_interpreter(monkeypatch, per_chunk, fast_accum, segments):
    """The Triton GEMM against its twin (fp32 sums in another order): groups empty and uneven, output dimensions
    not multiples of the tile (the TMA's zero fill past them), one to six segments (micro-batches' rows, each with
    its own chunks; past four, a second launch), added onto what the output held; and against fp32 within an FP8
    GEMM's tolerance."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pairs, exact = [], torch.zeros(len(COUNTS), 40, 36)
    for seed in range(segments):
        counts = COUNTS if seed == 0 else (3, 0, 200, 1, 60 + seed, 0)
        a, offsets = grouped(counts, 40, seed)
        b, _ = grouped(counts, 36, seed + 10)
        pairs.append((W.quantize_along_tokens_torch(a, offsets, per_chunk),
                      W.quantize_along_tokens_torch(b, offsets, per_chunk)))
        exact += fp32_wgrad(a, b, offsets)
    start = torch.randn(len(COUNTS), 40, 36)
    got, twin = start.clone(), start.clone()
    W.fp8_wgrad_accumulate_triton([(as_float(a), as_float(b)) for a, b in pairs], got, per_chunk, fast_accum)
    W.fp8_wgrad_accumulate_torch(pairs, twin)
    assert rel_err(got - start, twin - start) < 1e-5
    assert 1e-3 < rel_err(twin - start, exact) < GEMM_TOL


def test_fp8_wgrad_kernel_refuses_what_does_not_fit():
    a, offsets = grouped()
    q = W.quantize_along_tokens_torch(a, offsets, True)
    with pytest.raises(ValueError, match="do not fit"):
        W.fp8_wgrad_accumulate_triton([(q, q)], torch.zeros(len(COUNTS), 48, 40), True)
    with pytest.raises(ValueError, match="float32"):
        W.fp8_wgrad_accumulate_triton([(q, q)], torch.zeros(len(COUNTS), 48, 48, dtype=torch.bfloat16), True)
    with pytest.raises(ValueError, match="one or more segments"):
        W.fp8_wgrad_accumulate_triton([], torch.zeros(len(COUNTS), 48, 48), True)


def test_fp8_wgrad_field_needs_a_recipe():
    from moe_overlap.config import load_config

    for value in ("false", "true"):
        with pytest.raises(ConfigError, match=r"^train\.fp8_wgrad=(True|False): has no effect without train\.fp8_rec"):
            load_config(None, [f"train.fp8_wgrad={value}"])
    assert load_config(None, []).train.fp8_wgrad == "auto"


@pytest.mark.parametrize("config, overrides, fp8_wgrad", [
    ("bench_mixtral_2l", [], True),  # 1,024 rows per expert a micro-batch, in fours: 4,096 per call
    ("bench_mixtral_2l", ["train.expert_wgrad_micro_batches=2"], True),  # in pairs: 2,048
    ("bench_mixtral_2l", ["train.expert_wgrad_micro_batches=1"], False),  # 1,024
    ("bench_mixtral_2l", ["train.expert_wgrad_micro_batches=1", "parallel.expert_model_parallel_size=4"], True),  # 4096
    ("bench_fine_8l", ["parallel.expert_model_parallel_size=4"], False),  # experts 1,024 wide
    ("bench_mixtral_2l", ["train.fp8_recipe=blockwise"], False),  # its per-chunk scaling: slower
    ("bench_mixtral_2l", ["train.fp8_wgrad=false"], False), ("bench_fine_8l", ["train.fp8_wgrad=true"], True)])
def test_fp8_wgrad_auto_where_measured_faster(config, overrides, fp8_wgrad):
    """train.fp8_wgrad=auto: FP8 for the rowwise recipe's wide experts with many rows per weight-gradient call
    (tuning.py's measurements); a value set is kept."""
    from moe_overlap.config import load_config

    cfg = load_config(f"configs/{config}.yaml", ["train.device=cuda", "train.precision=bf16",
                                                 "train.fp8_recipe=rowwise", *overrides])
    assert cfg.train.fp8_wgrad is fp8_wgrad
