"""The MoE exchange's memory as `moe-overlap info` prints it (layers/exchange_memory.py) is what the device-planned
exchange allocates: checked against a layer call at 8 gloo ranks (the chunk tensors, the receive buffer, the stash
the backward keeps, the symmetric regions' bytes), unbounded and bounded; and `info`'s lines for the fine bench
model: bounded, the same at every EP; unbounded, growing with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_overlap.cli import main
from moe_overlap.config import ModelConfig, OverlapConfig
from moe_overlap.distributed.a2a import REGIONS, TransportSelector
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.layers.exchange_memory import exchange_memory, wire_region_bytes
from moe_overlap.layers.exchange_plan import chunk_bounds
from moe_overlap.layers.moe import MoELayer

FINE = str(Path(__file__).resolve().parents[1] / "configs" / "bench_fine_8l.yaml")
# H x fp32 = 256 bytes a row: the regions' 256-byte alignment adds nothing, so their bytes compare exactly
E, K, T, H, F = 16, 2, 12, 64, 8


def allocated_sizes(settings: list[tuple[float | None, int, float | None, bool]]) -> list[dict]:
    """Per (factor, chunks, overflow chunk's factor, each token once per rank): one device-planned layer call on this
    rank (the gloo twin of sm_push), what it allocated, and what exchange_memory says it allocates (with wire rows,
    the regions: wire_region_bytes)."""
    world = dist.get_world_size()
    mesh = Mesh.create(MeshLayout(world, ep=world), timeout_s=60)
    out = []
    try:
        for factor, chunks, overflow, once in settings:
            selector = TransportSelector("device", "auto", mesh.ep.group, mesh.ep.ranks, torch.device("cpu"),
                                         chunks + (overflow is not None), 60)
            overlap = OverlapConfig(moe_pipeline=True, moe_dispatch_once_per_rank=once, moe_pipeline_chunks=chunks,
                                    moe_planning="device", delay_wgrad_compute=False,
                                    moe_expert_rank_capacity_factor=factor, moe_overflow_capacity_factor=overflow)
            layer = MoELayer(ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=K),
                             overlap, mesh.ep, selector, etp=mesh.etp, expert_mp=mesh.expert_mp)
            x_TH = torch.randn(T, H, generator=torch.Generator().manual_seed(dist.get_rank()))
            routing, token, state = layer.start_dispatch(x_TH)
            token, shared_TH = layer.run_experts(x_TH, token, state)
            stash = [(rows.shape[0], rows.nbytes + fc1.nbytes + (0 if y is None else y.nbytes))
                     for (rows, fc1, y), _ in state.saved]
            layer.finish_combine(x_TH, token, routing.probs_TK, state, shared_TH)
            regions = selector.transport(0).regions  # the twin's regions: a private buffer of REGIONS regions
            want = exchange_memory(world, routing.experts_TK.numel(), chunk_bounds(E // world, chunks), factor, H, F,
                                   x_TH.element_size(), once, overflow)
            wire = wire_region_bytes(world, T, K, chunk_bounds(E // world, chunks), factor, H, x_TH.element_size(),
                                     overflow)
            out.append({"chunk_rows": [rows for rows, _ in stash], "stash_bytes": sum(b for _, b in stash),
                        "receive_rows": state.plan.routes.recv_rows, "regions_bytes": regions.local.buffer.nbytes,
                        "want": want, "wire_region_bytes": wire})
    finally:
        mesh.destroy()
    return out


def test_info_exchange_memory_is_what_a_layer_call_allocates(rank_pool):
    settings = [(None, 1, None, False), (None, 2, None, False), (1.5, 1, None, False), (1.5, 2, None, False),
                (1.25, 2, 0.5, False), (1.25, 2, 0.5, True), (1.25, 1, 0.5, False)]
    for rank_sizes in rank_pool(8).run(allocated_sizes, settings):
        for (factor, chunks, overflow, once), got in zip(settings, rank_sizes):
            want = got["want"]
            assert got["chunk_rows"] == want.chunk_rows and sum(want.chunk_rows) * H * 4 == want.chunk_bytes
            assert got["stash_bytes"] == want.stash_bytes
            if once:  # the regions hold wire rows (a token once per chunk and rank, its copies' places beside)
                assert got["regions_bytes"] == REGIONS * (-(-got["wire_region_bytes"] // 256) * 256)  # aligned
                continue
            assert got["receive_rows"] == want.receive_rows
            assert got["regions_bytes"] == REGIONS * want.region_bytes
            if factor is None:  # the worst case: every rank's copies per chunk
                assert want.chunk_rows == [8 * T * K] * chunks
            elif overflow is not None:  # and the overflow chunk's 0.5 x R rows, in the receive buffer too
                if chunks == 1:  # no overflow chunk: its room in the chunk's bound
                    assert want.chunk_rows == [1.75 * T * K] and want.factor == factor
                else:
                    assert want.chunk_rows[-1] == 0.5 * T * K and len(want.chunk_rows) == chunks + 1
                assert sum(want.chunk_rows) == 1.75 * T * K and want.receive_rows == 1.75 * T * K + 1
            else:  # factor x the balanced share, split by the chunks' experts
                assert sum(want.chunk_rows) == 1.5 * T * K and want.receive_rows == 1.5 * T * K + 1


def _info_rows(capsys, world: int, *overrides: str) -> dict[str, list[str]]:
    """`info`'s exchange table for the fine bench model at EP = ``world``: its rows by capacity factor."""
    assert main(["info", FINE, "--world-size", str(world), f"parallel.expert_model_parallel_size={world}",
                 "overlap.moe_pipeline=true", "overlap.moe_planning=device", *overrides]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("MoE exchange per rank"))
    assert f"EP {world}" in lines[at] and "R = 65,536 token copies of 4 KiB" in lines[at]
    cells = [re.split(r"\s{2,}", row.strip()) for row in lines[at + 2:at + 4]]  # the table: the rows under its header
    return {cell[0]: cell[1:] for cell in cells if cell[0].split()[0] in ("null", "1.25")}


def test_info_prints_the_exchange_memory_bounded_alike_at_every_ep(capsys):
    rows = {world: _info_rows(capsys, world, "overlap.moe_expert_rank_capacity_factor=1.25") for world in (2, 4)}
    # the stash 12 KiB a row: each token once per rank (auto, top-8) keeps the expert outputs too
    bounded = ["81,920 rows 320 MiB", "81,921 rows", "960 MiB", f"{REGIONS} x 320 MiB"]
    assert rows[2]["1.25"] == rows[4]["1.25"] == bounded
    # null grows with EP: EP x R rows per chunk, the regions EP x R + 1 rows of 4 KiB
    assert rows[2]["null (worst case, EP x R)"] == ["131,072 rows 512 MiB", "131,073 rows", "1.50 GiB",
                                                    f"{REGIONS} x 512 MiB"]
    assert rows[4]["null (worst case, EP x R)"] == ["262,144 rows 1.00 GiB", "262,145 rows", "3.00 GiB",
                                                    f"{REGIONS} x 1.00 GiB"]
    # without it, 8 KiB a row (the rows and their fc1 outputs)
    plain = _info_rows(capsys, 4, "overlap.moe_expert_rank_capacity_factor=1.25",
                       "overlap.moe_dispatch_once_per_rank=false")
    assert plain["1.25"][2] == "640 MiB" and plain["null (worst case, EP x R)"][2] == "2.00 GiB"


def test_info_says_a_host_planned_exchange_has_no_bound(capsys):
    assert main(["info", FINE, "--world-size", "2", "parallel.expert_model_parallel_size=2",
                 "overlap.moe_pipeline=true", "overlap.moe_planning=host", "train.moe_cuda_graph=false"]) == 0
    out = capsys.readouterr().out
    assert "MoE exchange: host-planned, its buffers sized exactly per layer call (no bound)" in out
    assert "MoE exchange per rank" not in out


@pytest.mark.parametrize("factor,rows,stash_gib", [(None, 4 * 65_536, 8.0), (1.25, 81_920, 0.625)])
def test_info_exchange_memory_of_the_fine_model_matches_the_readme_table(factor, rows, stash_gib):
    """README's bound section, 4 chunks at EP=4: R = 65,536 rows of 4 KiB, the stash 8 KiB a row, each region the
    receive buffer (its rows and the spare one)."""
    size = exchange_memory(4, 2 * 4096 * 8, chunk_bounds(16, 4), factor, 2048, 1024, 2)
    assert size.stash_bytes == stash_gib * 2 ** 30 and size.region_bytes == (rows + 1) * 4096


def test_info_says_pairs_on_streams_hold_the_regions_once_per_graphed_copy(capsys):
    """Paired with graphed MoE layers, each graphed copy exchanges through regions of its own (TransportSelector.twin):
    `info` says so under the table; unpaired it does not."""
    for paired, said in (("true", True), ("false", False)):
        assert main(["info", FINE, "--world-size", "2", "parallel.expert_model_parallel_size=2",
                     f"overlap.overlap_moe_expert_parallel_comm={paired}", "train.moe_cuda_graph=true"]) == 0
        out = capsys.readouterr().out
        assert ("the symmetric regions above once per graphed copy of the MoE layers" in out) is said, out
