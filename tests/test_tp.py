"""Tensor parallelism on CPU gloo ranks: the rings against their serial twins, every TP overlap switch against
the serial path (outputs and all gradients) in a model with EP, TP without sequence parallelism, checkpoints
across TP sizes, and the benchmark's smoke run. The full-model layouts are in test_master.py."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.distributed as dist

from moe_overlap.config import load_config
from moe_overlap.distributed.mesh import GroupHandle, Mesh
from moe_overlap.distributed.ring import (P2PTransport, TPComm, TPOverlap, all_gather_matmul,
                                          matmul_reduce_scatter, ring_all_gather_matmul, ring_matmul_reduce_scatter)
from moe_overlap.models.mixtral import build_model
from moe_overlap.training.run_setup import mesh_layout
from moe_overlap.training.trainer import Trainer
from tests.test_master import CPU, TOL, rel_err, run_and_save, small_config, tp_layout, world_and_mesh


def world_group() -> GroupHandle:
    world = dist.get_world_size()
    return GroupHandle(ranks=list(range(world)), group=dist.group.WORLD, rank=dist.get_rank(), size=world)


# ----------------------------------------------------------------------------------------------- rings


def rings_case() -> float:
    """Pipelined all-gather->GEMM and GEMM->reduce-scatter equal their serial twins and the plain formula."""
    group = world_group()
    comm = TPComm(group, sequence_parallel=True)
    g = torch.Generator().manual_seed(7)
    rows, k, n = 12, 16, 8
    x_all = torch.randn(group.size, rows, k, generator=g)  # every rank's block
    b_KN = torch.randn(k, n, generator=g)
    a_all = torch.randn(group.size, group.size * rows, k, generator=g)  # every rank's partial-sum input
    worst = 0.0
    for splits in (1, 2, 3):
        y, gathered = ring_all_gather_matmul(x_all[group.rank], b_KN, group, comm.transport, splits, True)
        y_serial, gathered_serial = all_gather_matmul(x_all[group.rank], b_KN, group, True)
        assert torch.equal(gathered, x_all.flatten(0, 1)) and torch.equal(gathered_serial, gathered)
        worst = max(worst, rel_err(y, y_serial), rel_err(y, x_all.flatten(0, 1) @ b_KN))
        out = ring_matmul_reduce_scatter(a_all[group.rank], b_KN, group, comm.transport, splits)
        want = (a_all @ b_KN).sum(0)[group.rank * rows:(group.rank + 1) * rows]
        worst = max(worst, rel_err(out, matmul_reduce_scatter(a_all[group.rank], b_KN, group)), rel_err(out, want))
    return worst


@pytest.mark.parametrize("world", [2, 4])
def test_rings_match_serial(rank_pool, world):
    assert max(rank_pool(world).run(rings_case)) < 1e-6


# ------------------------------------------------------------------------------- every switch combination

class CountingTransport(P2PTransport):
    """The p2p transport, counting the ring rounds it opens (so a test knows the pipelined paths ran)."""

    rounds = 0

    def open(self, *args, **kwargs):
        self.rounds += 1
        return super().open(*args, **kwargs)


SWITCHES = ("ag", "rs", "rs_dgrad", "bulk_dgrad", "bulk_wgrad")
# rs_dgrad carries the dgrad's reduce-scatter in its ring: bulk_wgrad has nothing left to hide (a config error).
COMBINATIONS = [dict(zip(SWITCHES, on)) for on in itertools.product((False, True), repeat=len(SWITCHES))
                if not (on[2] and on[4])]


def switch_combinations_case(output_dir: str, ep: int) -> dict:
    """One TP x EP model (TP = world, sequence parallel): loss and every gradient of one micro-batch under each
    switch combination (split counts taking turns), against the serial path on the same rank."""
    world = dist.get_world_size()
    cfg = small_config(output_dir, ep, 2, **tp_layout(world), **{"model.num_query_groups": 4})
    _, mesh = world_and_mesh(cfg)
    try:
        model = build_model(cfg.model, mesh, CPU, torch.float32, seed=5, sequence_parallel=True)
        transport = model.tp_comm.transport = CountingTransport(mesh.tp)
        g = torch.Generator().manual_seed(11)
        ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length + 1), generator=g)

        def run(overlap: TPOverlap) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            model.tp_comm.overlap = overlap
            model.zero_grad(set_to_none=True)
            out = model(ids[:, :-1], ids[:, 1:])
            out.loss.backward()
            return out.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

        serial_loss, serial_grads = run(TPOverlap())
        assert transport.rounds == 0
        worst, runs = 0.0, 0
        for index, switches in enumerate(COMBINATIONS):
            splits = (1, 2, 4)[index % 3]  # divide the sequence block of 16 / 4 tokens
            loss, grads = run(TPOverlap(**switches, num_splits=splits))
            errors = [rel_err(loss, serial_loss)] + [rel_err(grads[n], serial_grads[n]) for n in serial_grads]
            assert max(errors) < TOL, (switches, splits, max(errors))
            worst, runs = max(worst, *errors), runs + 1
        return {"worst": worst, "runs": runs, "grads": len(serial_grads), "rounds": transport.rounds}
    finally:
        mesh.destroy()


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)], ids=["tp2_ep2", "tp4_ep2"])
def test_every_switch_combination_equals_serial(rank_pool, tmp_path, world, ep):
    reports = rank_pool(world).run(switch_combinations_case, str(tmp_path), ep)
    # Each switch rings exactly where it should. The model has 5 column-parallel GEMMs (3 QKV, 1 fc1, the output
    # layer) and 4 row-parallel ones (3 proj, 1 fc2). ag rings 5 forward + 4 row dgrads, in 12 combinations;
    # rs 4 forward, in 12; rs_dgrad 5 column dgrads, in 8 (never beside bulk_wgrad).
    assert all(r["runs"] == 24 and r["worst"] < TOL and r["rounds"] == 12 * 9 + 12 * 4 + 8 * 5
               for r in reports), reports


# --------------------------------------------------------------------- TP without sequence parallelism


def dense_config(output_dir: str, global_batch: int, **extra):
    overrides = {"model.num_layers": 2, "model.hidden_size": 32, "model.ffn_hidden_size": 64,
                 "model.num_attention_heads": 4, "model.num_query_groups": 2, "model.seq_length": 16,
                 "model.share_embeddings_and_output_weights": "true", "train.micro_batch_size": 2,
                 "train.global_batch_size": global_batch, "train.lr_warmup_steps": 1, "train.adam_eps": 1e-4,
                 "train.eval_interval": 0, "train.output_dir": output_dir, "checkpoint.save_final": "false", **extra}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def dense_tp_case(output_dir: str, **extra) -> float:
    """TP = world without sequence parallelism (Megatron's f/g all-reduces), tied embeddings, vs one process;
    ``extra``: overrides both runs use."""
    world = dist.get_world_size()
    cfg = dense_config(output_dir, 4, **{"parallel.tensor_model_parallel_size": world}, **extra)
    mesh = Mesh.create(mesh_layout(cfg, world), timeout_s=60)
    try:
        runs = Trainer(cfg, mesh, CPU), Trainer(dense_config(output_dir, 4, **extra), Mesh.single(), CPU)
        worst = 0.0
        for _ in range(2):
            grads = [{}, {}]
            metrics = [run.train_step(lambda opt, got=got: got.update(opt.logical_grads()))
                       for run, got in zip(runs, grads)]
            worst = max(worst, abs(metrics[0]["loss"] - metrics[1]["loss"]) / metrics[1]["loss"],
                        abs(metrics[0]["grad_norm"] - metrics[1]["grad_norm"]) / metrics[1]["grad_norm"],
                        *(rel_err(grad, grads[1][key]) for key, grad in grads[0].items()))
        return worst
    finally:
        mesh.destroy()


def test_dense_tp_without_sequence_parallel_matches_single_process(rank_pool, tmp_path):
    assert max(rank_pool(2).run(dense_tp_case, str(tmp_path))) < TOL


# --------------------------------------------------------------------------------------- checkpoints


def train_and_save(output_dir: str, layout: dict, steps: int, save_at: int | None) -> list[float]:
    """Train under ``layout`` from the latest checkpoint (or scratch) to ``steps``, saving after ``save_at``."""
    layout = dict(layout)
    return run_and_save(output_dir, int(layout.pop("ep", 1)), steps, save_at, global_batch=4,
                        **{"train.adam_eps": 1e-4, "model.num_query_groups": 4}, **layout)


def test_checkpoint_moves_between_tp_sizes(rank_pool, tmp_path):
    """Saved under TP=2 x EP=2 on 2 ranks; resumed on one process and under TP=4 x EP=4: the same next loss."""
    straight = rank_pool(2).run(train_and_save, str(tmp_path), {**tp_layout(2), "ep": 2}, 3, 2)[0]
    single = train_and_save(str(tmp_path), {}, 3, None)
    resharded = rank_pool(4).run(train_and_save, str(tmp_path), {**tp_layout(4), "ep": 4}, 3, None)[0]
    assert len(single) == len(resharded) == 1
    assert abs(single[0] - straight[2]) / straight[2] < TOL and abs(resharded[0] - straight[2]) / straight[2] < TOL


# -------------------------------------------------------------------------------------------- benchmark


def benchmark_smoke_case(json_path: str) -> int:
    from benchmarks.tp_overlap import run

    return len(run(["--smoke", "--json", json_path]))


def test_benchmark_smoke_run(rank_pool, tmp_path):
    path = tmp_path / "tp_overlap.json"
    rows = rank_pool(2).run(benchmark_smoke_case, str(path))
    result = json.loads(path.read_text())
    assert {"device", "world_size", "date", "command", "env", "rows"} <= set(result) and result["world_size"] == 2
    gemm_rows = [r for r in result["rows"] if r["shape"] != "layer"]
    assert {r["direction"] for r in gemm_rows} == {"ag", "rs"} and len(result["rows"]) == rows[0]
    for row in gemm_rows:
        assert {"serial_ms", "overlapped_ms", "limit_ms", "torch_fused_ms"} <= set(row)
    layer = [r for r in result["rows"] if r["shape"] == "layer"]
    assert len(layer) == 1 and layer[0]["serial_fwdbwd_ms"] > 0 and layer[0]["overlapped_fwdbwd_ms"] > 0


def test_bad_split_counts_fail_naming_the_field():
    group = GroupHandle(ranks=[0, 1], group=None, rank=0, size=2)
    with pytest.raises(ValueError, match="tp_comm_num_splits=3 must divide this rank's 8 rows"):
        ring_all_gather_matmul(torch.zeros(8, 4), torch.zeros(4, 4), group, None, 3, False)
    with pytest.raises(ValueError, match="reduce-scatter of 9 rows over 2 TP ranks"):
        ring_matmul_reduce_scatter(torch.zeros(9, 4), torch.zeros(4, 4), group, None, 1)
