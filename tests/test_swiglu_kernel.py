"""The fused SwiGLU kernels against their torch twins (interpreter, fp32) and autograd; bf16 on GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_overlap.kernels import swiglu as S


def reference(h_TF2: torch.Tensor, grad_a_TF: torch.Tensor):
    h = h_TF2.detach().double().requires_grad_(True)
    gate, up = h.chunk(2, dim=-1)
    a = F.silu(gate) * up
    a.backward(grad_a_TF.double())
    return a, h.grad


@pytest.mark.parametrize("rows,ffn", [(0, 8), (1, 8), (7, 24), (33, 72)])
def test_kernels_match_twin_and_autograd_in_the_interpreter(monkeypatch, rows, ffn):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 2 * ffn, generator=g) * 3
    grad_a = torch.randn(rows, ffn, generator=g)
    want_a, want_grad_h = reference(h, grad_a)
    for forward, backward in ((S.swiglu_forward_triton, S.swiglu_backward_triton),
                              (S.swiglu_forward_torch, S.swiglu_backward_torch)):
        a = forward(h)
        grad_h, a_again = backward(h, grad_a)
        torch.testing.assert_close(a.double(), want_a.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a_again, a, rtol=0, atol=0)
        torch.testing.assert_close(grad_h.double(), want_grad_h, rtol=1e-5, atol=1e-6)


def test_kernels_compute_only_the_counted_rows(monkeypatch):
    """A static worst-case buffer: rows past ``valid_rows`` are skipped (NaN there stays out of the rest)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(3)
    h, grad_a = torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)
    h[9:], grad_a[9:] = float("nan"), float("nan")
    valid = torch.tensor([9])
    a = S.swiglu_forward_triton(h, valid)
    grad_h, a_again = S.swiglu_backward_triton(h, grad_a, valid)
    torch.testing.assert_close(a[:9], S.swiglu_forward_torch(h[:9]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a_again[:9], a[:9], rtol=0, atol=0)
    torch.testing.assert_close(grad_h[:9], S.swiglu_backward_torch(h[:9], grad_a[:9])[0], rtol=1e-6, atol=1e-6)
    full = S.swiglu_forward_triton(h)  # no count: every row, NaN ones included
    assert full[9:].isnan().all()


def test_dispatch_picks_the_twin_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h = torch.randn(4, 16)
    assert not S.use_triton(h, "swiglu")
    torch.testing.assert_close(S.swiglu_forward(h), S.swiglu_forward_torch(h))


def fp8_matches(q, scale, q_want, scale_want) -> None:
    """Scales bit for bit; values too, but for the interpreter's own fp32 -> E4M3 cast faults (tests/test_fp8.py:
    a value rounding up into the next power of two, subnormals), excused where they can happen."""
    assert torch.equal(scale, scale_want)
    want = q_want.float().abs()
    fault = (want < 2.0 ** -6) | (torch.log2(want) == torch.log2(want).round())
    differs = q.float() != q_want.float()
    assert not (differs & ~fault).any(), int((differs & ~fault).sum())


@pytest.mark.parametrize("rows,ffn", [(0, 8), (1, 8), (7, 24), (33, 72), (5, 2100)])
def test_fp8_forward_is_the_quantized_activation_in_the_interpreter(monkeypatch, rows, ffn):
    """swiglu_forward_fp8: a's rows quantized as quantize_rows would, a row read once in registers where it fits a
    block, twice where it does not (several column blocks a row at 2100, or asked: one_block=False); rows past the
    count are left unwritten; without the interpreter on CPU it is the twin itself."""
    from moe_overlap.kernels.fp8_quant import quantize_rows_torch

    g = torch.Generator().manual_seed(rows + ffn)
    h = torch.randn(rows, 2 * ffn, generator=g) * 3
    if rows:
        h[0, :ffn] = 0  # a row of zeros: the floor's scale
    want = quantize_rows_torch(S.swiglu_forward_torch(h))
    assert all(torch.equal(a, b) for a, b in zip(S.swiglu_forward_fp8(h), want))  # the twin (no interpreter)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # the bf16 kernel's rows: the interpreter's exp may differ from torch's silu in the last bit
    want = quantize_rows_torch(S.swiglu_forward_triton(h))
    fp8_matches(*S.swiglu_forward_fp8(h), *want)
    fp8_matches(*S.swiglu_forward_fp8(h, one_block=False), *want)  # a row read twice, as rows past a block are
    if rows > 2:
        h[rows - 2:] = float("nan")
        q, scale = S.swiglu_forward_fp8(h, torch.tensor([rows - 2]))
        fp8_matches(q[:rows - 2], scale[:rows - 2], want[0][:rows - 2], want[1][:rows - 2])


@pytest.mark.parametrize("rows,ffn", [(0, 8), (1, 8), (7, 24), (33, 72), (5, 2100)])
def test_fp8_backward_adds_the_quantized_gradient_in_the_interpreter(monkeypatch, rows, ffn):
    """swiglu_backward_fp8: the backward's grad_h and a as swiglu_backward gives them, and grad_h's rows quantized
    as quantize_rows would (both halves of a row under one scale), from registers where a row fits a block, read
    back where it does not (2100, or asked: one_block=False); rows past the count left unwritten; the twin without
    the interpreter."""
    from moe_overlap.kernels.fp8_quant import quantize_rows_torch

    g = torch.Generator().manual_seed(rows + ffn + 1)
    h, grad_a = torch.randn(rows, 2 * ffn, generator=g) * 3, torch.randn(rows, ffn, generator=g)
    grad_h, a = S.swiglu_backward_torch(h, grad_a)
    got = S.swiglu_backward_fp8(h, grad_a)
    assert all(torch.equal(x, y) for x, y in zip(got, (grad_h, a, *quantize_rows_torch(grad_h))))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    grad_h, a = S.swiglu_backward_triton(h, grad_a)
    for one_block in (None, False):
        got = S.swiglu_backward_fp8(h, grad_a, one_block=one_block)
        assert torch.equal(got[0], grad_h) and torch.equal(got[1], a)
        fp8_matches(*got[2:], *quantize_rows_torch(grad_h))
    if rows > 2:
        h[rows - 2:] = float("nan")
        got = S.swiglu_backward_fp8(h, grad_a, torch.tensor([rows - 2]))
        n = rows - 2
        assert torch.equal(got[0][:n], grad_h[:n]) and torch.equal(got[1][:n], a[:n])
        fp8_matches(got[2][:n], got[3][:n], *quantize_rows_torch(grad_h[:n]))


@pytest.mark.parametrize("rows,ffn", [(0, 128), (7, 256), (5, 2176)])
def test_fp8_tiles_are_quantize_tiles_of_the_kernels_rows_in_the_interpreter(monkeypatch, rows, ffn):
    """``tiles`` (the blockwise recipe): a's rows, and in the backward grad_h's (gate's tiles, then up's), quantized
    per 1x128 tile as quantize_tiles would quantize the rows the bf16 kernels write, scales (rows, width / 128);
    from registers where a row fits a block, one pass a block where it does not (2176), rows past the count left
    unwritten; the twins without the interpreter; a width not a multiple of 128 refused."""
    from moe_overlap.kernels.fp8_blockwise import quantize_tiles_torch

    g = torch.Generator().manual_seed(rows + ffn + 2)
    h, grad_a = torch.randn(rows, 2 * ffn, generator=g) * 3, torch.randn(rows, ffn, generator=g)
    if rows:
        h[0, :128] = 0  # a tile of zeros: the floor's scale
    a, (grad_h, _) = S.swiglu_forward_torch(h), S.swiglu_backward_torch(h, grad_a)
    assert all(torch.equal(x, y) for x, y in zip(S.swiglu_forward_fp8(h, tiles=True), quantize_tiles_torch(a)))
    assert all(torch.equal(x, y) for x, y in zip(S.swiglu_backward_fp8(h, grad_a, tiles=True)[2:],
                                                 quantize_tiles_torch(grad_h)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a, (grad_h, a_again) = S.swiglu_forward_triton(h), S.swiglu_backward_triton(h, grad_a)
    for one_block in (None, False):
        q, scale = S.swiglu_forward_fp8(h, one_block=one_block, tiles=True)
        assert scale.shape == (rows, ffn // 128)
        fp8_matches(q, scale, *quantize_tiles_torch(a))
        got = S.swiglu_backward_fp8(h, grad_a, one_block=one_block, tiles=True)
        assert torch.equal(got[0], grad_h) and torch.equal(got[1], a_again) and got[3].shape == (rows, ffn // 64)
        fp8_matches(*got[2:], *quantize_tiles_torch(grad_h))
    if rows > 2:
        n = rows - 2
        h[n:] = float("nan")
        fp8_matches(*(t[:n] for t in S.swiglu_forward_fp8(h, torch.tensor([n]), tiles=True)),
                    *quantize_tiles_torch(a[:n]))
        got = S.swiglu_backward_fp8(h, grad_a, torch.tensor([n]), tiles=True)
        fp8_matches(got[2][:n], got[3][:n], *quantize_tiles_torch(grad_h[:n]))
    with pytest.raises(ValueError, match="multiple of 128, got 200"):
        S.swiglu_forward_fp8(torch.randn(2, 400), tiles=True)
    with pytest.raises(ValueError, match="FFN width a multiple of 128, got 192"):
        S.swiglu_backward_fp8(torch.randn(2, 384), torch.randn(2, 192), tiles=True)


@pytest.mark.parametrize("tile", [(2, 4), (4, 8), (8, 4)])
def test_fp8_kernels_rows_at_once_give_one_row_at_a_times_bytes(monkeypatch, tile):
    """Several rows a program at a time (``tile``: rows, warps; chosen by measurement) give the bytes of one row at
    a time, forward and backward, under the interpreter: row counts that leave a last tile part-filled, a count
    below the rows (the rest left unwritten), and rows past a block (read twice, a row at a time whatever the
    tile)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rows, ffn in ((13, 24), (5, 2100)):
        g = torch.Generator().manual_seed(rows)
        h, grad_a = torch.randn(rows, 2 * ffn, generator=g) * 3, torch.randn(rows, ffn, generator=g)
        h[1, :ffn] = 0
        for valid in (None, torch.tensor([rows - 3])):
            got = (*S.swiglu_forward_fp8(h, valid, tile=tile), *S.swiglu_backward_fp8(h, grad_a, valid, tile=tile))
            want = (*S.swiglu_forward_fp8(h, valid, tile=(1, 8)), *S.swiglu_backward_fp8(h, grad_a, valid, tile=(1, 8)))
            n = rows if valid is None else rows - 3
            for a, b in zip(got, want):
                a, b = a[:n], b[:n]
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn \
                    else torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [False, True], ids=["rows", "tiles"])
def test_bf16_fp8_forward_equals_swiglu_then_quantize_rows_on_gpu(tiles):
    """On the GPU the fused kernels give quantize_rows(swiglu_forward(h)) and swiglu_backward with
    quantize_rows(grad_h) bit for bit (all Triton, bf16); ``tiles``: quantize_tiles's. The same written over h's
    bytes (``over_h``, as the experts' backward asks), in one pass and in two."""
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    from moe_overlap.kernels.fp8_blockwise import quantize_tiles
    from moe_overlap.kernels.fp8_quant import quantize_rows

    quantize = quantize_tiles if tiles else quantize_rows
    for rows, ffn in ((8192, 14336), (4096, 1024), (5, 128 if tiles else 24)):
        h = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16) * 3
        valid = torch.tensor([max(rows - 3, 0)], device="cuda")
        q, scale = S.swiglu_forward_fp8(h, valid, tiles=tiles)
        q_want, scale_want = quantize(S.swiglu_forward(h, valid), rows_bound=valid)
        n = int(valid)
        assert torch.equal(scale[:n], scale_want[:n])
        assert torch.equal(q[:n].view(torch.uint8), q_want[:n].view(torch.uint8))
        grad_a = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
        grad_h, a, q, scale = S.swiglu_backward_fp8(h, grad_a, valid, tiles=tiles)
        grad_h_want, a_want = S.swiglu_backward(h, grad_a, valid)
        q_want, scale_want = quantize(grad_h_want, rows_bound=valid)
        assert torch.equal(grad_h[:n], grad_h_want[:n]) and torch.equal(a[:n], a_want[:n])
        assert torch.equal(scale[:n], scale_want[:n])
        assert torch.equal(q[:n].view(torch.uint8), q_want[:n].view(torch.uint8))
        for one_block in (None, False):
            mine = h.clone()
            got = S.swiglu_backward_fp8(mine, grad_a, valid, tiles=tiles, one_block=one_block, over_h=True)
            assert got[2].data_ptr() == mine.data_ptr() or (tiles and (ffn > 2048 or one_block is False))
            assert torch.equal(got[0][:n], grad_h_want[:n]) and torch.equal(got[3][:n], scale_want[:n])
            assert torch.equal(got[2][:n].view(torch.uint8), q_want[:n].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,ffn", [(8192, 14336), (4096 * 8, 2048), (5, 24)])
def test_bf16_kernels_match_the_twin_on_gpu(rows, ffn):
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    h = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16) * 3
    grad_a = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(S.swiglu_forward_triton(h), S.swiglu_forward_torch(h), rtol=1.6e-2, atol=1e-2)
    got, want = S.swiglu_backward_triton(h, grad_a), S.swiglu_backward_torch(h, grad_a)
    for g, w in zip(got, want):
        assert float((g.float() - w.float()).norm() / w.float().norm()) < 5e-3


@pytest.mark.parametrize("rows,ffn,tiles", [(0, 128, False), (7, 128, False), (5, 2176, False), (7, 256, True),
                                            (5, 2176, True)])
def test_fp8_backward_writes_its_rows_over_h_in_the_interpreter(monkeypatch, rows, ffn, tiles):
    """``over_h``: the FP8 rows lie in h's own bytes (no buffer of their own; here fp32 h, each FP8 row in the first
    2F bytes of its row) and equal the ones written apart, in the twin and in the kernel, in one pass (a row in a
    block) or two (a longer row); per tile over a row longer than a block the kernel cannot (a block's tiles would
    overwrite values not yet read): there h is left as it was."""
    g = torch.Generator().manual_seed(rows + ffn + 3)
    h, grad_a = torch.randn(rows, 2 * ffn, generator=g) * 3, torch.randn(rows, ffn, generator=g)
    for interpret, one_block in (("0", None), ("1", None), ("1", False)):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        apart = S.swiglu_backward_fp8(h, grad_a, one_block=one_block, tiles=tiles)
        mine = h.clone()
        got = S.swiglu_backward_fp8(mine, grad_a, one_block=one_block, tiles=tiles, over_h=True)
        assert all(torch.equal(x.float(), y.float()) for x, y in zip(got, apart))
        in_place = interpret == "0" or not tiles or (ffn <= 2048 and one_block is None)
        assert torch.equal(mine, h) == (not in_place or rows == 0)
        if rows:
            assert (got[2].data_ptr() == mine.data_ptr()) == in_place
