"""``overlap.moe_compute_only``, the benchmarks' reference without the exchange's transfers: every rank's expert
GEMMs run on exactly the rows it would receive, the sizes and signals still travel (each layer waits for its
slowest peer), rows stay on their rank, and everything stays finite."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_overlap.config import ConfigError, ModelConfig, OverlapConfig, load_config
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.mesh import Mesh, MeshLayout
from moe_overlap.distributed.streams import measuring_exposed_comm
from moe_overlap.layers import dispatch_pipeline
from moe_overlap.layers.moe import MoELayer
from moe_overlap.training.trainer import Trainer
from tests.test_master import small_config, world_and_mesh
from tests.test_moe_layer import E, F, FixedRouter, H, OneRankTransports, full_expert_weights, moe_case, rank_inputs


def compute_only_case(planning: str, chunks: int, once: bool = False, overflow: bool = False) -> dict:
    """The same layer and inputs with the exchange real and compute-only: the grouped GEMMs' row counts per
    chunk, the outputs and gradients. The receive regions start as NaN bytes, and compute-only runs again from
    bytes of 0.75: a compute-only reference must write every row it reads, so both give the same numbers (before it
    made its rows from its own, it read rows no rank wrote: fp32 words of earlier exchanges read as bf16, NaN
    losses on 2 and 4 H100s). ``once``: each token once per rank. ``overflow``: the tightest bound (1.0) and an
    overflow chunk that takes every row past it, every copy routed to rank 0's first experts (the overflow chunk's
    landing rows are made from none of this rank's own: zeros)."""
    from moe_overlap.distributed import symm

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh.create(MeshLayout(world, ep=world), timeout_s=60)
    counts, outputs, exposed = {}, {}, {}
    real_forward, real_fill = dispatch_pipeline.experts_forward, symm.fill_finite
    try:
        for compute_only, byte in ((False, 255), (True, 255), (True, 63)):  # 255: NaN, 63: 0.75 (bf16, fp32)
            symm.fill_finite = lambda buffer_B: buffer_B.fill_(byte)
            rows = counts[compute_only] = []

            def recording_forward(x_RH, offsets, *weights):
                rows.append(int(offsets[-1]) if offsets.numel() else 0)  # the rows this chunk's GEMMs run on
                return real_forward(x_RH, offsets, *weights)

            dispatch_pipeline.experts_forward = recording_forward
            selector = TransportSelector(planning, "auto", mesh.ep.group, mesh.ep.ranks, torch.device("cpu"),
                                         chunks + overflow, 60, compute_only=compute_only)
            bound = dict(moe_expert_rank_capacity_factor=1.0, moe_overflow_capacity_factor=2.0) if overflow else {}
            cfg = ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=2)
            layer = MoELayer(cfg, OverlapConfig(moe_pipeline=True, moe_dispatch_once_per_rank=once,
                                                 moe_pipeline_chunks=chunks, moe_planning=planning,
                                                 delay_wgrad_compute=False, **bound),
                             mesh.ep, selector)
            w13, w2 = full_expert_weights()
            mine = slice(layer.experts.first_expert, layer.experts.first_expert + layer.experts.num_local_experts)
            with torch.no_grad():
                layer.experts.w13.copy_(w13[mine])
                layer.experts.w2.copy_(w2[mine])
            x, upstream, probs, experts = rank_inputs(rank, "first_rank_only" if overflow else "sparse", 2)
            x.requires_grad_(True)
            layer.router = FixedRouter(probs, experts, None)
            with measuring_exposed_comm(torch.device("cpu")) as tally:
                out, _, _ = layer(x.unsqueeze(0))
                out.squeeze(0).backward(upstream)
            exposed[compute_only] = tally.totals_ms()["ep"]
            outputs[compute_only, byte] = (out.detach(), x.grad, layer.experts.w13.grad)
    finally:
        dispatch_pipeline.experts_forward, symm.fill_finite = real_forward, real_fill
        mesh.destroy()
    nan_start, other_start = outputs[True, 255], outputs[True, 63]
    return {"rank": rank, "counts": counts, "finite": all(torch.isfinite(t).all() for t in nan_start),
            "whatever_the_regions_held": all(torch.equal(a, b) for a, b in zip(nan_start, other_start)),
            "same_output": torch.equal(nan_start[0], outputs[False, 255][0]), "exposed": exposed}


@pytest.mark.parametrize("planning,chunks,once,overflow", [
    ("host", 1, False, False), ("host", 2, False, False), ("device", 2, False, False), ("device", 1, True, False),
    ("device", 2, True, False), ("host", 2, True, False), ("device", 2, False, True), ("device", 2, True, True)])
def test_compute_only_runs_the_gemms_on_the_rows_each_rank_would_receive(rank_pool, planning, chunks, once, overflow):
    for result in rank_pool(2).run(compute_only_case, planning, chunks, once, overflow):
        assert result["counts"][True] == result["counts"][False]
        assert (sum(result["counts"][True]) > 0) == (not overflow or result["rank"] == 0)  # overflow: rank 0 only
        if overflow:  # rank 0's overflow chunk ran its GEMMs on rows (the counts: per chunk, then its)
            assert len(result["counts"][True]) == 3 and (result["counts"][True][-1] > 0) == (result["rank"] == 0)
        assert result["finite"] and result["whatever_the_regions_held"]
        # rows from peers never arrived (overflow: rank 0's tokens stay on rank 0, and wire rows carry their copies'
        # places, so rank 0's own output may be exact; rank 1's rows never came back)
        assert not result["same_output"] or (once and overflow and result["rank"] == 0)
        assert result["exposed"][True] > 0  # the sizes and the per-chunk messages still wait for the peer


class _ComputeOnlyOneRank(OneRankTransports):
    """A one-rank group's SM push transport, compute-only: the rows that would land are this rank's own (there, the
    same rows), made by the repeat kernel, which gathers wire rows' hidden columns from their tokens' rows."""

    def transport(self, nbytes: int):
        made = super().transport(nbytes)
        made.compute_only = True
        return made


def test_compute_only_over_one_rank_lands_exactly_the_rows_a_push_would(monkeypatch):
    """On one rank every row that would land is the rank's own: compute-only's repeat kernel (interpreted; wire
    rows gathered from their tokens' rows, each token once per rank) must give the formula's output and
    gradients, as the real push does."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for once in (False, True):
        assert moe_case("sparse", 2, planning="device", force_pipeline=True,
                        selectors={"device": _ComputeOnlyOneRank("sm_push")}, chunks=1,
                        once_per_rank=once) < 1e-5


def trainer_case(output_dir: str) -> dict:
    cfg = small_config(output_dir, 2, 8, **{"overlap.moe_pipeline": "true", "overlap.moe_compute_only": "true"})
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, torch.device("cpu"))
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        metrics = [trainer.train_step() for _ in range(2)]
        return {"unchanged": all(torch.equal(p.detach(), before[name]) for name, p in trainer.model.named_parameters()),
                "grad_norm": [m["grad_norm"] for m in metrics]}
    finally:
        mesh.destroy()


def test_compute_only_trains_at_learning_rate_0(rank_pool, tmp_path):
    """The step does every piece of work (the gradients are there) but moves no weight: rows that never arrived
    made a real-text GPU run diverge within 4 steps."""
    for result in rank_pool(2).run(trainer_case, str(tmp_path)):
        assert result["unchanged"] and all(norm > 0 for norm in result["grad_norm"]), result


@pytest.mark.parametrize("overrides,fragment", [
    (["overlap.moe_compute_only=true", "overlap.moe_pipeline=false"], "needs overlap.moe_pipeline=true"),
    (["overlap.moe_pipeline=true", "overlap.moe_compute_only=true", "parallel.expert_model_parallel_size=1"],
     "one EP rank exchanges nothing"),
    (["overlap.moe_pipeline=true", "overlap.moe_compute_only=true", "parallel.tensor_model_parallel_size=2",
      "parallel.sequence_parallel=true", "parallel.expert_model_parallel_size=2"], "not implemented yet"),
])
def test_compute_only_is_refused_where_it_would_mean_nothing(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config("configs/tiny.yaml", overrides)
