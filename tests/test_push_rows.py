"""The device-planned exchange's kernels: the row push and copy-out (kernels/push_rows.py) and the route fill
(kernels/routes.py), interpreted on CPU in fp32 against their torch twins, with buffers of this process standing
in for the peers' symmetric memory; in bf16 on one GPU (`-m gpu`)."""

import contextlib

import pytest
import torch

from moe_overlap.kernels.push_rows import copy_rows_out, push_rows, push_rows_torch, repeat_rows, whole_rows
from moe_overlap.kernels.routes import fill_routes, fill_routes_torch


@contextlib.contextmanager
def no_host_sync(device):
    """On CUDA: any host sync inside the block is an error."""
    if device != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _push_case(rows, hidden, first, counted, ctas, device, dtype, gathered=0, in_flight=16384):
    """``gathered``: a row's first columns come from a source row of their own (a wire row's token), the rest
    from src (the row's extra columns; none when gathered is the whole width). ``in_flight``: bytes a program
    moves per step."""
    g = torch.Generator(device=device).manual_seed(rows + hidden)
    src = torch.randn(rows, hidden - gathered, device=device, generator=g).to(dtype)
    gather = None
    if gathered:
        sources = rows // 2 + 1
        gather = (torch.randn(sources, gathered, device=device, generator=g).to(dtype),
                  torch.randint(0, sources, (rows,), device=device, dtype=torch.int32, generator=g))
    dst_rank = torch.randint(0, 3, (rows + 5,), device=device, dtype=torch.int32, generator=g)
    dst_row = torch.randperm(rows + 5, device=device, generator=g)  # distinct rows: every row lands once
    got = [torch.full((rows + 5, hidden), -7.0, device=device, dtype=dtype) for _ in range(3)]
    want = [b.clone() for b in got]
    start, count, route_start = (torch.tensor([v], device=device) for v in (first, counted, 3))
    bases = torch.tensor([b.data_ptr() for b in got], dtype=torch.int64, device=device)
    out = torch.full((rows, hidden), 5.0, device=device, dtype=dtype)
    with no_host_sync(device):
        push_rows(src, start, count, dst_rank, dst_row, route_start, bases, ctas, gather=gather, in_flight=in_flight)
        if gather is None:
            copy_rows_out(src, start, count, out, ctas)
    push_rows_torch(whole_rows(src, gather), start, count, dst_rank, dst_row, route_start, want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert sum(int((b != -7.0).any(1).sum()) for b in got) == counted  # rows past the count stay put
    if gather is None:
        assert torch.equal(out[:counted], src[first:first + counted]) and (out[counted:] == 5.0).all()
    else:  # the twin gathers the same way
        twin = [torch.full_like(b, -7.0) for b in got]
        push_rows_torch(src, start, count, dst_rank, dst_row, route_start, twin, gather=gather)
        assert all(torch.equal(a, b) for a, b in zip(got, twin))


@pytest.mark.parametrize("rows,hidden,first,counted,ctas,gathered,in_flight", [
    (50, 37, 4, 41, 3, 0, 16384), (64, 8, 0, 64, 1, 0, 16384), (9, 5000, 2, 0, 2, 0, 16384),
    (40, 16, 7, 33, 64, 0, 16384), (50, 37, 4, 41, 3, 29, 16384), (40, 16, 7, 33, 64, 16, 16384),
    (9, 600, 2, 7, 2, 512, 16384), (50, 1024, 4, 41, 3, 0, 65536), (50, 600, 4, 41, 2, 512, 65536)])
def test_push_and_copy_out_match_the_twin(monkeypatch, rows, hidden, first, counted, ctas, gathered, in_flight):
    """Any number of CTAs (more than rows too), rows not 16-byte multiples, an empty count, a device start; the
    first columns gathered from source rows (with extra columns or none); more rows a step (64 KiB)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _push_case(rows, hidden, first, counted, ctas, "cpu", torch.float32, gathered, in_flight)


def test_push_rows_checks_its_routes():
    with pytest.raises(ValueError, match="dst_row_Q"):
        push_rows(torch.zeros(4, 2), 0, 4, torch.zeros(4, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), 0,
                  torch.zeros(1, dtype=torch.int64))


def test_copy_out_without_triton_reads_its_sizes_on_the_host(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    src, out = torch.randn(10, 33), torch.full((10, 33), -1.0)
    copy_rows_out(src, torch.tensor([3]), torch.tensor([6]), out)
    assert torch.equal(out[:6], src[3:9]) and (out[6:] == -1.0).all()


def _repeat_case(device, dtype, hidden=24, gathered=0):
    """dst rows [dst_start, + count) = src rows [src_start, + src_count) repeated; zeros with no source rows; the
    rest of dst untouched; every value on the device; ``gathered`` as for _push_case."""
    src = torch.randn(10, hidden - gathered, device=device).to(dtype)
    gather = None if not gathered else (torch.randn(4, gathered, device=device).to(dtype),
                                        torch.randint(0, 4, (10,), device=device, dtype=torch.int32))
    out = torch.full((12, hidden), float("nan"), device=device, dtype=dtype)
    at = [torch.tensor([v], device=device) for v in (2, 3, 1, 7, 0, 0, 8, 3)]
    with no_host_sync(device):
        repeat_rows(src, at[0], at[1], out, at[2], at[3], 2, gather=gather)
        repeat_rows(src, at[4], at[5], out, at[6], at[7], 2, gather=gather)
    assert out[0].isnan().all() and out[11].isnan().all()
    whole = whole_rows(src, gather)
    assert torch.equal(out[1:8], whole[[2, 3, 4, 2, 3, 4, 2]]) and (out[8:11] == 0).all()


@pytest.mark.parametrize("interpreted", [True, False])
@pytest.mark.parametrize("gathered", [0, 16, 24])
def test_repeat_rows_makes_a_compute_only_references_rows_from_its_own(monkeypatch, interpreted, gathered):
    """Triton (interpreted) and the torch path (host reads) alike, the first columns gathered or not."""
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _repeat_case("cpu", torch.float32, gathered=gathered)


def _route_case(sizes, total, device):
    rows_B = torch.tensor(sizes, device=device)
    start_B = torch.cumsum(rows_B, 0) - rows_B
    rank_B = torch.arange(len(sizes), device=device, dtype=torch.int32) % 3
    dst_start_B = torch.tensor([100 * b for b in range(len(sizes))], device=device)
    outs = []
    for fill in (fill_routes, fill_routes_torch):
        rank_Q = torch.full((total,), -1, dtype=torch.int32, device=device)
        row_Q = torch.full((total,), -1, dtype=torch.int64, device=device)
        with no_host_sync(device):
            fill(start_B, rows_B, rank_B, dst_start_B, rank_Q, row_Q)
        outs.append((rank_Q, row_Q))
    (rank, row), (rank_twin, row_twin) = outs
    assert torch.equal(rank, rank_twin) and torch.equal(row, row_twin)
    return rank.cpu(), row.cpu()


@pytest.mark.parametrize("sizes,total", [([3, 0, 5, 1], 12), ([0, 0], 4), ([2000, 1, 0, 7], 2008), ([], 3)])
def test_fill_routes_kernel_matches_twin(monkeypatch, sizes, total):
    """Empty blocks, a block longer than the kernel's step, entries past the last block left alone."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rank, row = _route_case(sizes, total, "cpu")
    q = 0
    for b, n in enumerate(sizes):
        assert (rank[q:q + n] == b % 3).all() and torch.equal(row[q:q + n], 100 * b + torch.arange(n))
        q += n
    assert (rank[q:] == -1).all() and (row[q:] == -1).all()


def test_unpermute_copies_the_rows_it_reads(monkeypatch):
    """The copy-out of a received region fused with the unpermute: every row a copy maps to, and only those."""
    from moe_overlap.kernels.permute import unpermute, unpermute_torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(3)
    y = torch.randn(12, 24, generator=g)
    rows = torch.tensor([[0, 5], [7, -1], [3, 11]], dtype=torch.int32)
    probs = torch.rand(3, 2, generator=g)
    for fn in (unpermute, unpermute_torch):
        copy = torch.zeros_like(y)
        out = fn(y, rows, probs, copy)
        assert torch.allclose(out, unpermute_torch(y, rows, probs))
        read = [0, 3, 5, 7, 11]
        assert torch.equal(copy[read], y[read]) and (copy[[1, 2, 4, 6, 8, 9, 10]] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden,first,counted,ctas", [(8192, 4096, 100, 7000, 8), (4096, 7168, 0, 4096, 32),
                                                             (33, 2048, 0, 0, 4), (1000, 24, 3, 900, 2)])
def test_bf16_push_copy_out_and_routes_match_the_twins_on_gpu(rows, hidden, first, counted, ctas):
    """One GPU, its own buffers standing in for three ranks' (the kernel reads addresses; peers' are mapped
    the same way); no host sync in the kernels; the pushes with 16 and 64 KiB a program's step."""
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    for in_flight in (16384, 65536):
        _push_case(rows, hidden, first, counted, ctas, "cuda", torch.bfloat16, in_flight=in_flight)
        _push_case(rows, hidden + 32, first, counted, ctas, "cuda", torch.bfloat16, gathered=hidden,
                   in_flight=in_flight)  # wire rows
    _route_case([3, 0, 5000, 1], 6000, "cuda")
    _repeat_case("cuda", torch.bfloat16, hidden)
    _repeat_case("cuda", torch.bfloat16, hidden + 32, gathered=hidden)
