"""`moe-overlap info`'s model state per rank (weights, fp32 gradients, optimizer state, the FP8 weight copies)
against what a trainer actually allocates, for the plain optimizer in one process and the distributed optimizer at 2
gloo ranks (EP=2, PP=2, TP=2); and the shipped GPU configs' headers quote it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from moe_overlap.config import load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.layers.fp8 import Fp8
from moe_overlap.training.state_memory import StateBytes, describe_state_memory, state_bytes
from moe_overlap.training.run_setup import mesh_layout
from moe_overlap.training.trainer import Trainer
from tests.test_master import CPU, small_config, world_and_mesh

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def allocated(trainer: Trainer) -> tuple[StateBytes, int]:
    """(what the trainer holds, counting only the parameters' own elements of each optimizer shard, and the
    optimizer's bytes per element); the distributed optimizer's bucket padding is left out."""
    params = list(trainer.model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    optimizer = trainer.optimizer
    if hasattr(optimizer, "buckets"):
        gradients = sum(b.grad_data.numel() - (b.numel - b.slots[-1].end) for b in optimizer.buckets) * 4
        per_element = 4 * (2 + any(b.has_separate_master for b in optimizer.buckets))
        elements = sum(part.stop - part.start for b in optimizer.buckets for _, part, _ in b.shard_parts)
    else:
        gradients = sum(e.main_grad.numel() * 4 for e in optimizer.entries)
        per_element = 4 * (2 + any(e.master is not e.param for e in optimizer.entries))
        elements = sum(e.exp_avg.numel() for e in optimizer.entries)
    return StateBytes(weights, gradients, elements * per_element), per_element


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_process_counts_what_the_plain_optimizer_allocates(tmp_path, precision):
    cfg = small_config(str(tmp_path), 1, 4, **{"train.device": "cpu", "train.precision": precision})
    trainer = Trainer(cfg, Mesh.single(), CPU)
    held, per_element = allocated(trainer)
    assert per_element == (8 if precision == "fp32" else 12)  # fp32 weights are their own master
    assert state_bytes(cfg, Mesh.single()) == held


def test_fp8_copies_count_what_the_recipe_caches(tmp_path):
    """train.fp8_recipe's weight copies (E4M3 in both orientations, with their scales) as state_bytes counts them
    for the config against the caches a trainer's step leaves on the parameters (the recipe emulated: the same
    copies), the first layer in bf16 (train.num_layers_at_start_in_bf16=1: none of its own), every GEMM in FP8
    (train.fp8_gemm_min_dim=0), the copies apart from the weights (train.fp8_param=false; held in them:
    tests/test_fp8_param.py); with auto's bound and exact input gradients, wider than this model, none; with auto's
    bound and fast ones (rowwise's default), every GEMM's."""
    cfg = small_config(str(tmp_path), 1, 4, **{"train.device": "cpu", "train.precision": "bf16"})
    trainer = Trainer(cfg, Mesh.single(), CPU)
    trainer.model.use_fp8(Fp8(emulate=True), bf16_at_start=1)
    trainer.train_step()
    cached = sum(entry.q.numel() * entry.q.element_size() + entry.scale.numel() * entry.scale.element_size()
                 for param in trainer.model.parameters() for entry in param.__dict__.get("fp8_cache", {}).values())
    fp8 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8_recipe="rowwise", fp8_gemm_min_dim=0,
                                                             num_layers_at_start_in_bf16=1, fp8_param=False))
    planned = state_bytes(fp8, Mesh.single())
    assert planned.fp8_copies == cached > 0
    assert planned.total == state_bytes(cfg, Mesh.single()).total + cached
    every_layer = dataclasses.replace(fp8, train=dataclasses.replace(fp8.train, num_layers_at_start_in_bf16=0))
    assert state_bytes(every_layer, Mesh.single()).fp8_copies > cached
    assert " + FP8 copies " in describe_state_memory(fp8, mesh_layout(fp8, 1))[0]
    auto = dataclasses.replace(fp8, train=dataclasses.replace(fp8.train, fp8_gemm_min_dim="auto"))
    assert state_bytes(auto, Mesh.single()).fp8_copies == cached
    exact = dataclasses.replace(auto, train=dataclasses.replace(auto.train, fp8_dgrad_accumulation="exact"))
    assert state_bytes(exact, Mesh.single()).fp8_copies == 0


LAYOUTS = {
    "ep2": {"parallel.expert_model_parallel_size": 2},
    "pp2": {"parallel.pipeline_model_parallel_size": 2, "parallel.expert_model_parallel_size": 1,
            "model.num_layers": 4, "model.moe_layer_freq": "[1,0,1,1]"},
    "tp2": {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": "true",
            "parallel.expert_model_parallel_size": 1},
}


def layout_case(output_dir: str, layout: str) -> dict:
    cfg = small_config(output_dir, 1, 8, **{"train.device": "cpu", "train.precision": "bf16",
                                            "train.use_distributed_optimizer": "true", **LAYOUTS[layout]})
    _, mesh = world_and_mesh(cfg)
    try:
        held, _ = allocated(Trainer(cfg, mesh, CPU))
        planned = state_bytes(cfg, Mesh.planned(mesh.layout, mesh.rank))  # as each rank checks its own
        return {"held": held, "planned": planned}
    finally:
        mesh.destroy()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_ranks_count_what_the_distributed_optimizer_allocates(rank_pool, tmp_path, layout):
    """Weights and gradients exactly on each rank; the optimizer's shards over the two ranks together (a bucket's
    contiguous shards split a parameter unevenly; each rank counts its even share)."""
    ranks = rank_pool(2).run(layout_case, str(tmp_path), layout)
    for rank in ranks:
        assert (rank["planned"].weights, rank["planned"].gradients) == (rank["held"].weights, rank["held"].gradients)
    planned, held = (sum(r[side].optimizer for r in ranks) for side in ("planned", "held"))
    assert abs(planned - held) <= 12 * 64, (planned, held)  # integer halves: at most a few bytes per parameter
    if layout == "pp2":  # each stage holds its own layers
        assert ranks[0]["planned"].weights != ranks[1]["planned"].weights


def test_the_gpu_configs_quote_their_model_state():
    for path in sorted(CONFIGS.glob("gpu[248]_*.yaml")):
        quoted = re.search(r"Memory per GPU: ([\d.]+) GiB", path.read_text())
        assert quoted, path.name
        world = int(path.name[3])
        line = describe_state_memory(load_config(path, []), mesh_layout(load_config(path, []), world))[0]
        assert f"{float(quoted.group(1)):.1f} GiB = weights" in line, (path.name, line)


def test_a_launch_whose_model_state_cannot_fit_a_gpu_fails_in_one_line(tmp_path, monkeypatch, capsys):
    """`moe-overlap train --nproc N` on GPUs refuses, before any rank starts, a layout whose model state alone exceeds
    the smallest local GPU (nvidia-smi's memory.total); one that fits goes on to torchrun."""
    from moe_overlap import cli
    from moe_overlap.training.state_memory import check_state_fits, largest_state

    cfg = small_config(str(tmp_path), 2, 8)
    rank, state = largest_state(cfg, mesh_layout(cfg, 2))
    check_state_fits(rank, state, state.total)  # exactly the state: no error
    monkeypatch.setattr(cli, "launch_device_type", lambda cfg, nproc: "cuda")
    monkeypatch.setattr(cli, "check_before_launch", lambda cfg, world, device: None)
    monkeypatch.setattr(cli, "local_gpu_bytes", lambda: state.total - 1)
    launched = []
    monkeypatch.setattr("torch.distributed.run.main", lambda argv: launched.append(argv))
    argv = ["train", str(tmp_path / "cfg.yaml"), "--nproc", "2"]
    (tmp_path / "cfg.yaml").write_text(cli.config_yaml(cfg))
    assert cli.main(argv) == cli.EXIT_BAD_INPUT and not launched
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"moe-overlap: config error: model state (GiB, rank {rank})="
                                               f"{float(f'{state.total / 2**30:.2g}')}: weights ")  # tiny: 2 digits
    assert "need more than a GPU here holds" in err and "train.use_distributed_optimizer" in err
    monkeypatch.setattr(cli, "local_gpu_bytes", lambda: state.total)
    assert cli.main(argv) == 0 and len(launched) == 1
