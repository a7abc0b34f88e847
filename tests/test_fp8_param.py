"""train.fp8_param on CPU (the recipe emulated): the FP8 layers' weights held only as their FP8 copies, in the
storage of their bf16 values, quantized from the fp32 masters read as bf16. The copies, the training run and a
resumed run are bit for bit those of the weights kept in bf16; the memory count has the E4M3 bytes in the weights'.
On the GPU: tests/test_gpu_fp8.py::test_gpu_fp8_param_trains_as_the_bf16_weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_overlap.config import ConfigError, load_config, validate_for_world
from moe_overlap.config.defaults import fp8_param
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.layers import fp8 as fp8_layers
from moe_overlap.layers.fp8 import Fp8, refresh_weights, weight_operand, weights_updated
from moe_overlap.layers.param_info import param_info
from moe_overlap.training.state_memory import state_bytes
from moe_overlap.training.trainer import Trainer
from tests.test_master import CPU, small_config, world_and_mesh

BF16 = {"train.device": "cpu", "train.precision": "bf16"}


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def in_storage_of(q: torch.Tensor, param: torch.Tensor) -> bool:
    return q.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()


@pytest.mark.parametrize("interpreted", [False, True])
@pytest.mark.parametrize("recipe, shape", [("rowwise", (4, 32, 48)), ("blockwise", (2, 128, 256))])
def test_fp8_param_copies_live_in_the_weight_and_equal_the_bf16_weights(monkeypatch, interpreted, recipe, shape):
    """Both orientations of the whole weight and of a run of experts, made and refreshed after an update of the
    master: each copy the bf16 weight's bit for bit (the master's values are not bf16's, so reading them unrounded
    would differ), in the weight's own storage (the run's a slice of the whole's), which the master's update leaves
    alone. Through the torch twins and the Triton kernels under the interpreter."""
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(5)
    master = torch.randn(shape) * torch.logspace(-2, 2, shape[-2])[:, None]
    held, kept = (torch.nn.Parameter(master.to(torch.bfloat16)) for _ in range(2))
    param_info(held).fp8_master = master
    views = [lambda w: w, lambda w: w[1:]]  # the weight, a run of experts

    def check() -> None:
        for view in views:
            for contract_last in (True, False):
                q, scale = weight_operand(view(held), contract_last, recipe=recipe)
                q_want, scale_want = weight_operand(view(kept), contract_last, recipe=recipe)
                assert same_fp8(q, q_want) and torch.equal(scale, scale_want)
                assert in_storage_of(q, held) and not in_storage_of(q_want, kept)

    check()
    assert param_info(held).holds_fp8 and not param_info(kept).holds_fp8
    whole, run = weight_operand(held, True, recipe=recipe)[0], weight_operand(held[1:], True, recipe=recipe)[0]
    assert run.data_ptr() == whole[1:].data_ptr()  # one place for both
    with torch.no_grad():  # an optimizer step: the master moves, the kept weight gets its bf16 values
        master.add_(torch.randn(shape) * master.abs().mean() / 3)
        kept.data.copy_(master)
    weights_updated()
    check()
    weights_updated()
    master.mul_(-1)
    kept.data.copy_(master)
    for param in (held, kept):  # a graphed layer's pre-hook refreshes every copy in place
        layer = torch.nn.Module()
        layer.w = param
        refresh_weights(layer)
    check()


def fp8_trainer(output_dir: str, held: bool, **extra) -> Trainer:
    trainer = Trainer(small_config(output_dir, 1, 4, **BF16, **extra), Mesh.single(), CPU)
    trainer.model.use_fp8(Fp8(emulate=True, min_dim=0))  # every GEMM of the decoder layers in FP8
    if held:
        trainer.optimizer.hold_fp8_weights()
    return trainer


def test_fp8_param_trains_bit_for_bit_as_the_bf16_weights(tmp_path, monkeypatch):
    """Three steps with every decoder GEMM in emulated FP8: losses, gradients and masters equal to the run that keeps
    bf16 weights; every weight of an FP8 GEMM holds its copies in its own storage (no E4M3 byte elsewhere), the
    others (embedding, output layer, routers, norms) keep their values; the checkpoint's model tensors are the
    bf16 values all the same. The held run's copies are refreshed from the maxima its optimizer steps left (one
    pass over the master: kernels/adamw.py), the kept run's from their own first pass. The memory count is what the
    run holds."""
    refreshes = []
    real = fp8_layers.quantize_rows_and_columns
    monkeypatch.setattr(fp8_layers, "quantize_rows_and_columns",
                        lambda *a, **k: refreshes.append((a[0].dtype, k.get("amax") is not None)) or real(*a, **k))
    # one run after the other: an optimizer step makes every parameter's copies stale, the other run's maxima too
    def three_steps(trainer: Trainer) -> list[tuple[float, dict]]:
        steps = []
        for _ in range(3):
            grads = {}
            steps.append((trainer.train_step(lambda opt: grads.update(opt.logical_grads()))["loss"], grads))
        return steps

    held = fp8_trainer(str(tmp_path / "held"), True)
    held_steps = three_steps(held)
    # the held run reads its fp32 masters, with the step's maxima from the second step on
    assert (torch.float32, True) in refreshes and {dtype for dtype, _ in refreshes} == {torch.float32}
    assert refreshes.count((torch.float32, False)) == 0
    refreshes.clear()
    kept = fp8_trainer(str(tmp_path / "kept"), False)
    for (loss, grads), (loss_want, grads_want) in zip(held_steps, three_steps(kept)):
        assert loss == loss_want
        assert grads.keys() == grads_want.keys() and all(torch.equal(g, grads_want[key]) for key, g in grads.items())
    assert refreshes and all(dtype == torch.bfloat16 and not given for dtype, given in refreshes)  # its own passes
    state, want_state = held.optimizer.logical_state(), kept.optimizer.logical_state()
    assert state.keys() == want_state.keys()
    assert all(torch.equal(tensor, want_state[key]) for key, tensor in state.items())
    holding = {name for name, param in held.model.named_parameters() if param_info(param).holds_fp8}
    assert any(".experts." in name for name in holding) and any("attention" in name for name in holding)
    assert not any("embedding" in name or "output_layer" in name or "router" in name or "norm" in name
                   for name in holding)
    elsewhere = sum(entry.q.numel() for param in held.model.parameters()
                    for entry in param.__dict__.get("fp8_cache", {}).values() if not in_storage_of(entry.q, param))
    assert elsewhere == 0
    scales = sum(entry.scale.numel() * 4 for param in held.model.parameters()
                 for entry in param.__dict__.get("fp8_cache", {}).values())
    scales += sum(4 * (param.fp8_maxima.record.rows_BM.numel() + param.fp8_maxima.record.columns_BK.numel())
                  for param in held.model.parameters() if "fp8_maxima" in param.__dict__)  # the step's maxima
    assert all("fp8_maxima" in param.__dict__ for param in held.model.parameters() if param_info(param).holds_fp8)
    cfg = small_config(str(tmp_path), 1, 4, **BF16)
    fp8 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8_recipe="rowwise", fp8_gemm_min_dim=0,
                                                             fp8_param=True))
    apart = dataclasses.replace(fp8, train=dataclasses.replace(fp8.train, fp8_param=False))
    assert state_bytes(fp8, Mesh.single()).fp8_copies == scales > 0
    assert state_bytes(apart, Mesh.single()).fp8_copies > scales


def test_fp8_param_resumes_bit_for_bit(tmp_path):
    """Saved after two steps, resumed into a fresh run (its weights' values before any FP8 GEMM), the third step
    equals the straight run's: the checkpoint's model tensors are the masters' bf16 values."""
    straight = fp8_trainer(str(tmp_path), True, **{"train.resume": "false"})
    for _ in range(2):
        straight.train_step()
    straight.save()
    third = straight.train_step()["loss"]
    resumed = fp8_trainer(str(tmp_path), True)
    assert resumed.resume() and resumed.step == 2
    assert resumed.train_step()["loss"] == third


def test_fp8_param_refusals_name_the_field():
    """Without a recipe; true with the distributed optimizer where it shards a weight over more than one rank (its
    all-gather moves the bf16 values), refused before any rank starts; at one rank it holds every weight."""
    with pytest.raises(ConfigError, match=r"^train\.fp8_param=True: has no effect without train\.fp8_recipe"):
        load_config(None, ["train.fp8_param=true"])
    cfg = load_config(None, ["train.device=cuda", "train.precision=bf16", "train.fp8_recipe=rowwise",
                             "train.fp8_param=true", "train.use_distributed_optimizer=true"])
    validate_for_world(cfg, 1, "cuda")
    with pytest.raises(ConfigError, match=r"^train\.fp8_param=True: with train\.use_distributed_optimizer=true is "
                                          r"not implemented yet where the optimizer shards a weight over more than "
                                          r"one rank \(data-parallel x context-parallel size 2, expert-data-parallel "
                                          r"size 1"):
        validate_for_world(dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, expert_model_parallel_size=2)), 2, "cuda")


def test_fp8_param_auto_holds_with_either_optimizer(caplog):
    gpu = ["train.device=cuda", "train.precision=bf16", "train.fp8_recipe=rowwise"]
    with caplog.at_level("INFO"):
        assert load_config(None, gpu).train.fp8_param is True
        distributed = load_config(None, gpu + ["train.use_distributed_optimizer=true"])
        assert distributed.train.fp8_param == "auto" and fp8_param(distributed.train)  # true would ask for all
        validate_for_world(dataclasses.replace(distributed, parallel=dataclasses.replace(
            distributed.parallel, expert_model_parallel_size=2)), 2, "cuda")
        assert load_config(None, []).train.fp8_param == "auto"  # no recipe: nothing to hold
    assert "train.fp8_param=auto -> true: the FP8 GEMMs' weights held only as their FP8 copies" in caplog.text
    assert ("where the distributed optimizer's shard of them is whole (a data-parallel group of one rank); the "
            "others keep their bf16 values beside the copies (not implemented yet)") in caplog.text


def test_fp8_param_with_the_distributed_optimizer_trains_and_resumes_bit_for_bit(tmp_path):
    """At one rank every bucket's shard is whole, so the distributed optimizer holds every FP8 GEMM's weights as the
    plain optimizer does: three steps' losses, gradients and checkpoint tensors equal the run with the copies kept
    apart (its step leaving the maxima of the copies' refresh), and a run resumed after two steps makes the straight
    run's third step."""
    distributed = {"train.use_distributed_optimizer": "true", "train.resume": "false"}
    runs = []
    for held in (True, False):
        trainer = fp8_trainer(str(tmp_path / str(held)), held, **distributed)
        steps = []
        for _ in range(3):
            grads = {}
            steps.append((trainer.train_step(lambda opt: grads.update(opt.logical_grads()))["loss"], grads))
        runs.append((trainer, steps))
    (held, held_steps), (kept, kept_steps) = runs
    for (loss, grads), (loss_want, grads_want) in zip(held_steps, kept_steps):
        assert loss == loss_want and all(torch.equal(g, grads_want[key]) for key, g in grads.items())
    holding = [param for param in held.model.parameters() if param_info(param).holds_fp8]
    assert holding and all("fp8_maxima" in param.__dict__ for param in holding)  # the step left their maxima
    state, want = held.optimizer.logical_state(), kept.optimizer.logical_state()
    assert state.keys() == want.keys() and all(torch.equal(t, want[key]) for key, t in state.items())

    straight = fp8_trainer(str(tmp_path / "resume"), True, **distributed)
    for _ in range(2):
        straight.train_step()
    straight.save()
    third = straight.train_step()["loss"]
    resumed = fp8_trainer(str(tmp_path / "resume"), True, **{"train.use_distributed_optimizer": "true"})
    assert resumed.resume() and resumed.step == 2
    assert resumed.train_step()["loss"] == third


def held_against_kept(output_dir: str, extra: dict) -> list[tuple[float, float]]:
    """A layout's run (bf16, every decoder GEMM in emulated FP8) with the weights held in their copies, then the same
    run with the copies kept apart (one after the other: a step stales every copy, the other run's maxima too):
    each step's (held, kept) loss, and the names of the weights that held their copies; every gradient asserted
    equal on the way."""
    cfg = small_config(output_dir, 1, 2 * 2 * torch.distributed.get_world_size(), **BF16, **extra)
    _, mesh = world_and_mesh(cfg)
    try:
        runs = []
        for held in (True, False):
            trainer = Trainer(cfg, mesh, CPU)
            trainer.model.use_fp8(Fp8(emulate=True, min_dim=0))
            if held:
                trainer.optimizer.hold_fp8_weights()
            steps = []
            for _ in range(3):
                grads = {}
                steps.append((trainer.train_step(lambda opt: grads.update(opt.logical_grads()))["loss"], grads))
            runs.append(steps)
            if held:
                holding = {name for name, param in trainer.model.named_parameters() if param_info(param).holds_fp8}
        for (_, grads), (_, grads_kept) in zip(*runs):
            assert grads.keys() == grads_kept.keys()
            assert all(torch.equal(grad, grads_kept[key]) for key, grad in grads.items()), [
                key for key, grad in grads.items() if not torch.equal(grad, grads_kept[key])][:3]
        return [(held[0], kept[0]) for held, kept in zip(*runs)], holding
    finally:
        mesh.destroy()


@pytest.mark.parametrize("extra", [
    {"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": "true",
     "parallel.expert_model_parallel_size": 1, "parallel.expert_tensor_parallel_size": 1},
    {"parallel.expert_model_parallel_size": 2, "overlap.moe_pipeline": "true", "overlap.moe_planning": "host",
     "overlap.moe_pipeline_chunks": 2},
    {"parallel.expert_model_parallel_size": 2, "train.use_distributed_optimizer": "true"}],
    ids=["tp2-sp", "ep2-chunks", "ep2-distributed-optimizer"])
def test_fp8_param_layouts_train_bit_for_bit_as_the_bf16_weights(rank_pool, tmp_path, extra):
    """At TP=2 with SP the row-parallel forward's and the column-parallel dgrad's copies share their scales over the
    ranks (the maxima all-reduced, the masters read as bf16); at EP=2 with two chunks each chunk's GEMMs read a run of
    experts' copies (slices of the whole weight's place). With the distributed optimizer at EP=2 the experts' shards
    are whole (expert-data-parallel size 1), so they hold their copies; the dense weights, sharded over the 2
    data-parallel ranks, keep their bf16 values. Held or kept apart, the same bits."""
    for steps, holding in rank_pool(2).run(held_against_kept, str(tmp_path), extra):
        assert all(held == kept for held, kept in steps), steps
        assert any(".experts." in name for name in holding)
        if "train.use_distributed_optimizer" in extra:
            assert all(".experts." in name for name in holding)
        else:
            assert any("attention" in name for name in holding)


def test_fp8_param_memory_count_with_the_distributed_optimizer():
    """The model state `moe-overlap info` prints, fine bench model at EP=4 with the distributed optimizer: with auto
    the experts (expert-data-parallel size 1: their shard whole) count only their scales and maxima, the dense
    weights (sharded over 4 data-parallel ranks) their whole copies; false counts every copy whole; at one rank
    auto holds everything, as the plain optimizer does."""
    from moe_overlap.training.run_setup import mesh_layout
    from moe_overlap.training.state_memory import largest_state

    base = ["train.device=cuda", "train.precision=bf16", "train.fp8_recipe=rowwise",
            "train.use_distributed_optimizer=true"]

    def copies(world: int, *extra: str) -> int:
        cfg = load_config("configs/bench_fine_8l.yaml", base + [f"parallel.expert_model_parallel_size={world}",
                                                                 *extra])
        return largest_state(cfg, mesh_layout(cfg, world))[1].fp8_copies

    held, kept = copies(4), copies(4, "train.fp8_param=false")
    plain = load_config("configs/bench_fine_8l.yaml", base[:3] + ["parallel.expert_model_parallel_size=4"])
    all_held = largest_state(plain, mesh_layout(plain, 4))[1].fp8_copies
    assert all_held < held < kept  # the dense weights' copies whole, the experts' not
    assert kept - held > 0.9 * 2**30  # the experts' E4M3 bytes: about 1 GiB a rank here
    one = load_config("configs/bench_fine_8l.yaml", base[:3])
    assert copies(1) == largest_state(one, mesh_layout(one, 1))[1].fp8_copies
