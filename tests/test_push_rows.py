"""The sync-free dispatch's push kernel (kernels/push_rows.py), interpreted on CPU in fp32 against its torch
twin, with buffers of this process standing in for the peers' symmetric memory."""

import pytest
import torch

from moe_overlap.kernels.push_rows import copy_counted_rows, push_rows, push_rows_torch


@pytest.mark.parametrize("rows,hidden,counted", [(50, 37, 41), (64, 8, 64), (9, 5000, 0)])
def test_push_rows_kernel_matches_twin(monkeypatch, rows, hidden, counted):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(rows)
    src = torch.randn(rows, hidden, generator=g)
    dst_rank = torch.randint(0, 3, (rows,), generator=g, dtype=torch.int32)
    dst_row = torch.randperm(rows, generator=g)  # distinct rows: every row lands once
    got = [torch.full((rows, hidden), -7.0) for _ in range(3)]
    want = [b.clone() for b in got]
    num_rows = torch.tensor([counted])
    push_rows(src, num_rows, dst_rank, dst_row, torch.tensor([b.data_ptr() for b in got], dtype=torch.int64))
    push_rows_torch(src, num_rows, dst_rank, dst_row, want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert sum(int((b != -7.0).any(1).sum()) for b in got) == counted  # rows past the count stay put


def test_push_rows_checks_its_routes():
    with pytest.raises(ValueError, match="dst_row_R"):
        push_rows(torch.zeros(4, 2), torch.tensor([4]), torch.zeros(4, dtype=torch.int32),
                  torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("interpret", [True, False])
def test_copy_counted_rows_leaves_the_rest(monkeypatch, interpret):
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    src, out = torch.randn(10, 33), torch.full((10, 33), -1.0)
    copy_counted_rows(src, torch.tensor([6]), out)
    assert torch.equal(out[:6], src[:6]) and (out[6:] == -1.0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden,counted", [(8192, 4096, 7000), (4096, 7168, 4096), (33, 2048, 0)])
def test_bf16_push_and_counted_copy_match_the_twin_on_gpu(rows, hidden, counted):
    """One GPU, its own buffers standing in for three ranks' (the kernel reads addresses; peers' are mapped
    the same way)."""
    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(rows)
    src = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    dst_rank = torch.randint(0, 3, (rows,), device="cuda", dtype=torch.int32, generator=g)
    dst_row = torch.randperm(rows, device="cuda", generator=g)
    got = [torch.zeros(rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    want = [b.clone() for b in got]
    num_rows = torch.tensor([counted], device="cuda")
    push_rows(src, num_rows, dst_rank, dst_row, torch.tensor([b.data_ptr() for b in got], device="cuda"))
    push_rows_torch(src, num_rows, dst_rank, dst_row, want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    out = torch.full_like(src, 7.0)
    copy_counted_rows(src, num_rows, out)
    assert torch.equal(out[:counted], src[:counted]) and (out[counted:] == 7.0).all()
