"""The paged stash of the device-planned MoE exchange (``overlap.moe_paged_stash_factor``, layers/paged_stash.py):
a chunk's tensors go into pages of one pool and come back equal in their counted rows, in any order of take; pages
taken are the rows' and go back; a stash that does not fit takes none and counts its rows as overflow. The Triton
path (interpreted) and the torch twin keep the same rows. Names of the tests that overflow contain ``overflow``."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.layers.fp8 import Fp8Rows
from moe_overlap.layers.paged_stash import PagedStash, stash_pages
from tests.test_overflow import BALANCED, _check, overflow_case

H, F2 = 24, 40  # a row: 24 bf16 + 40 bf16


class _Counter:
    def __init__(self):
        self.rows = torch.zeros((), dtype=torch.int64)

    def __call__(self, rows: torch.Tensor) -> None:
        self.rows += rows


def _pool(rows: int, stashes: int, row_bytes: int = 2 * (H + F2), page_rows: int = 8):
    counter = _Counter()
    return PagedStash(rows, stashes, row_bytes, torch.device("cpu"), counter, page_rows), counter


def _chunk(bound: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(bound, H, generator=g).bfloat16(), torch.randn(bound, F2, generator=g).bfloat16()]


@pytest.mark.parametrize("interpret", [False, True], ids=["twin", "triton_interpreted"])
def test_paged_stash_keeps_the_counted_rows_in_any_order(monkeypatch, interpret):
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pool, counter = _pool(rows=100, stashes=4)
    counts, bounds = [13, 0, 40, 29], [40, 40, 64, 30]
    stashed, chunks = [], []
    for i, (n, bound) in enumerate(zip(counts, bounds)):
        chunks.append(_chunk(bound, i))
        stashed.append(pool.put(chunks[-1], torch.tensor([n], dtype=torch.int32)))
        assert int(stashed[-1].taken) == -(-n // 8)
    assert int(pool.top) == pool.pages - sum(-(-n // 8) for n in counts) and int(counter.rows) == 0
    taken = [set(s.table_M[:int(s.taken)].tolist()) for s in stashed]
    assert all(not (a & b) for i, a in enumerate(taken) for b in taken[i + 1:])  # no page twice
    for i in (2, 0, 3, 1):  # not the reverse of the puts
        back = pool.take(stashed[i])
        n = counts[i]
        for got, want in zip(back, chunks[i]):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert torch.equal(got[:n], want[:n])
            if not interpret and n < got.shape[0]:  # the twin poisons the rows past the count
                assert torch.isnan(got[n:].float()).all()
    assert int(pool.top) == pool.pages and sorted(pool.free_P[:pool.pages].tolist()) == list(range(pool.pages))
    # the pages back on the stack serve the next stashes
    again = pool.put(_chunk(64, 9), torch.tensor([64], dtype=torch.int32))
    assert int(again.taken) == 8 and int(counter.rows) == 0


def test_paged_stash_fp8_rows_and_absent_tensors_come_back():
    pool, _ = _pool(rows=64, stashes=2, row_bytes=32 + 16 + 2 * F2 + 2 * H)  # each part at 16 bytes
    q = torch.randint(0, 255, (16, H), dtype=torch.uint8).view(torch.float8_e4m3fn)
    rows = Fp8Rows(q, torch.rand(16), torch.bfloat16)
    h, y = _chunk(16, 1)[1], torch.randn(16, H).bfloat16()
    stashed = pool.put([rows, h, None, y], torch.tensor([11], dtype=torch.int32))
    got_rows, got_h, none, got_y = pool.take(stashed)
    assert none is None and isinstance(got_rows, Fp8Rows) and got_rows.dtype == torch.bfloat16
    assert torch.equal(got_rows.q_RK[:11].view(torch.uint8), q[:11].view(torch.uint8))
    assert torch.equal(got_rows.scales[:11], rows.scales[:11])
    assert torch.equal(got_h[:11], h[:11]) and torch.equal(got_y[:11], y[:11])


def test_paged_stash_overflow_takes_no_page_and_counts_the_rows():
    """A pool of 3 pages (16 rows + 1 spare page for 1 stash): a stash of 30 rows fits, the next one's 20 rows do
    not (they are counted), one of 8 still fits the page left; taking the one that overflowed returns nothing."""
    pool, counter = _pool(rows=16, stashes=1)
    assert pool.pages == stash_pages(16, 1, 8) == 3
    first = pool.put(_chunk(32, 0), torch.tensor([17], dtype=torch.int32))
    assert int(first.taken) == 3 and int(pool.top) == 0
    pool.take(first)
    first = pool.put(_chunk(32, 0), torch.tensor([9], dtype=torch.int32))
    over = pool.put(_chunk(32, 1), torch.tensor([20], dtype=torch.int32))
    assert int(over.taken) == 0 and int(counter.rows) == 20 and (over.table_M == pool.spare).all()
    last = pool.put(_chunk(32, 2), torch.tensor([8], dtype=torch.int32))
    assert int(last.taken) == 1 and int(pool.top) == 0
    chunk = _chunk(32, 0)
    assert torch.equal(pool.take(first)[1][:9], chunk[1][:9])
    pool.take(over)
    pool.take(last)
    assert int(pool.top) == 3 and sorted(pool.free_P[:3].tolist()) == [0, 1, 2]
    pool.put(_chunk(32, 0), torch.tensor([24], dtype=torch.int32))
    pool.reset()
    assert int(pool.top) == 3


def test_paged_stash_refuses_a_row_wider_than_its_pool():
    pool, _ = _pool(rows=16, stashes=1, row_bytes=2 * H)
    with pytest.raises(ValueError, match="does not fit the pool's rows"):
        pool.put(_chunk(8, 0), torch.tensor([8], dtype=torch.int32))


# ------------------------------------------------------------------ training steps, gloo ranks
PAGED = "overlap.moe_paged_stash_factor"


@pytest.mark.parametrize("world,both", [
    (2, {}),
    (2, {"overlap.moe_pipeline_chunks": 2, "overlap.delay_wgrad_compute": "true",
         "overlap.moe_dispatch_once_per_rank": "false"}),
    (2, {"overlap.overlap_moe_expert_parallel_comm": "true", "overlap.moe_pipeline_chunks": 2}),
    (4, {"overlap.moe_token_slices": 2}),
    (4, {"parallel.pipeline_model_parallel_size": 2, "model.num_layers": 4, "model.moe_layer_freq": "[1,0,1,1]"}),
    (2, {"overlap.moe_dispatch_dtype": "fp8", "overlap.moe_dispatch_once_per_rank": "true"}),
], ids=["ep2", "ep2_chunks2_delay_wgrad_copies", "ep2_paired_chunks2", "ep4_slices2_bounded", "pp2_ep2",
        "ep2_fp8_wire"])
def test_paged_stash_steps_equal_host_planned(rank_pool, tmp_path, world, both):
    """A pool of twice the balanced rows (forced balance routes exactly them: nothing overflows): every step's
    losses and gradients are the host-planned run's (fp32, 1e-5), the backward reading each chunk's tensors back
    out of the pages (the twin poisons the rows past the count, so none of them is read)."""
    both = {**BALANCED, **both}
    ep = world // int(both.get("parallel.pipeline_model_parallel_size", 1))
    bounded = {PAGED: 2.0, **({"overlap.moe_expert_rank_capacity_factor": 2.0} if ep == 4 else {})}
    _check(rank_pool(world).run(overflow_case, str(tmp_path), ep, 2, bounded, both), False)


def test_paged_stash_overflow_runs_again_and_equals_host_planned(rank_pool, tmp_path):
    """A pool of exactly the balanced rows with learned routing: the most loaded rank's stashes overflow it, so
    every step is skipped and run again planned on the host, its losses and gradients the host-planned run's."""
    _check(rank_pool(2).run(overflow_case, str(tmp_path), 2, 2, {PAGED: 1.0}), True)


def pool_case(output_dir: str, both: dict) -> dict:
    """The pool a trainer makes against info's formula, and its pages around one step."""
    from moe_overlap.cli import _moe_calls_in_flight
    from moe_overlap.layers.exchange_memory import paged_stash_size
    from moe_overlap.training.trainer import Trainer
    from tests.test_master import CPU, small_config, world_and_mesh

    world = torch.distributed.get_world_size()
    cfg = small_config(output_dir, world, 4 * world, **{"overlap.moe_pipeline": "true", "overlap.moe_planning":
                                                       "device", PAGED: 1.5, **BALANCED, **both})
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        stash = trainer._stash
        rows, stashes, row_bytes, page_rows = paged_stash_size(cfg, _moe_calls_in_flight(cfg, world))
        taken = []
        for layer in trainer._moe_layers:  # pages in use after each MoE layer's forward
            layer.register_forward_hook(lambda *_: taken.append(stash.pages - int(stash.top)))
        trainer.train_step()
        return {"nbytes": stash.nbytes, "formula": (stash_pages(rows, stashes, page_rows) + 1) * page_rows * row_bytes,
                "taken": taken, "free_after": int(stash.top), "pages": stash.pages,
                "layers": len(trainer._moe_layers), "micro_batches": trainer.num_micro_batches}
    finally:
        mesh.destroy()


@pytest.mark.parametrize("both", [{}, {"overlap.overlap_moe_expert_parallel_comm": "true"}], ids=["plain", "paired"])
def test_paged_stash_pool_is_info_formula_and_pages_come_back(rank_pool, tmp_path, both):
    """The pool the trainer allocates is what ``info`` prints (the same formula and calls in flight); each MoE
    layer's forward takes pages (forced balance: as many as its rows), and every page is free after the step."""
    for result in rank_pool(2).run(pool_case, str(tmp_path), both):
        assert result["nbytes"] == result["formula"], result
        assert result["free_after"] == result["pages"], result
        if not both:  # plain accumulation: micro-batch i's forward of layer l holds pages of layers 0..l
            per_layer = result["taken"][0]
            assert per_layer > 0 and result["taken"][:result["layers"]] == [
                per_layer * (i + 1) for i in range(result["layers"])], result


@pytest.mark.gpu
def test_paged_stash_triton_on_gpu_keeps_the_counted_rows():
    """The Triton row kernels on CUDA (strided pool rows, 16-byte columns): bf16 and FP8 rows come back equal in
    their counted rows; pages back on the stack."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.device("cuda")
    counter = lambda rows: None  # noqa: E731
    pool = PagedStash(4096, 4, 2 * 1024 + 2 * 2048 + 2 * 1024, device, counter, page_rows=128)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3000, 1024, device=device, generator=g).bfloat16()
    h = torch.randn(3000, 2048, device=device, generator=g).bfloat16()
    q = Fp8Rows(x.float().clamp(-400, 400).to(torch.float8_e4m3fn), torch.rand(3000, device=device), torch.bfloat16)
    for tensors, n in (([x[:, :], h, None], 2999), ([q, h, x], 1234)):
        stashed = pool.put(tensors, torch.tensor([n], dtype=torch.int32, device=device))
        back = pool.take(stashed)
        for got, want in zip(back, tensors):
            if want is None:
                assert got is None
            elif isinstance(want, Fp8Rows):
                assert torch.equal(got.q_RK[:n].view(torch.uint8), want.q_RK[:n].view(torch.uint8))
                assert torch.equal(got.scales[:n], want.scales[:n])
            else:
                assert torch.equal(got[:n], want[:n])
    assert int(pool.top) == pool.pages


def test_paged_stash_keeps_fp8_rows_as_they_crossed(rank_pool, tmp_path):
    """FP8 on the wire feeding emulated FP8 GEMMs: the experts' rows stay FP8 with their scales (layers/fp8.Fp8Rows),
    and the pool keeps them so (bytes and scales side by side); the steps equal the host-planned FP8 run's."""
    both = {**BALANCED, "overlap.moe_dispatch_dtype": "fp8", "overlap.moe_dispatch_once_per_rank": "true"}
    _check(rank_pool(2).run(overflow_case, str(tmp_path), 2, 2, {PAGED: 2.0}, both, fp8=True), False)


def test_paged_stash_factor_rules_are_one_line():
    from moe_overlap.config import ConfigError, load_config

    for extra, fragment in ((["overlap.moe_paged_stash_factor=0.5"], "must be >= 1.0"),
                            (["overlap.moe_planning=host", "overlap.moe_paged_stash_factor=1.5"],
                             "pages the device-planned exchange's stash only")):
        with pytest.raises(ConfigError, match=fragment) as err:
            load_config(None, ["overlap.moe_pipeline=true", *extra])
        assert str(err.value).startswith(f"{PAGED}=") and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="needs overlap.moe_pipeline=true"):
        load_config(None, [f"{PAGED}=1.25", "overlap.moe_pipeline=false"])
