"""The distributed optimizer against its serial twin, plain data-parallel AdamW (MixedPrecisionAdamW).

On the gloo rank pool, with expert and data parallelism present (4 ranks, EP=2: dense shards over DP=4,
expert shards over expert-DP=2; and TP=2 x DP=2 with sequence parallelism) and 4 micro-batches of gradient
accumulation: parameters, reduced gradients and losses match the serial optimizer within 1e-6 per tensor
over 5 steps (fp32), with overlap off and on and with size-based buckets. (At DP=2 the sums are exact and
the runs agree to round-off; at DP=4 reduce-scatter and all-reduce add the four ranks' gradients in other
orders, one-ulp differences that routing and Adam grow to about 8e-7 by step 5.) The overlap really starts
reduce-scatters inside the last micro-batch's backward and waits for each all-gather just before the layer
that needs it; the optimizer holds shards, not full fp32 copies; non-finite gradients skip (or stop) the
step; checkpoints reshard over DP (2 -> 4 -> 2 ranks) and TP sizes and load across the two optimizers.
"""

from __future__ import annotations

import gc
import json
import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moe_overlap.distributed import collectives
from moe_overlap.layers.param_info import is_expert_param, param_info
from moe_overlap.training.checkpoint import _boxes, latest_step, step_dir
from moe_overlap.training.dist_optimizer import DistributedOptimizer
from moe_overlap.training.trainer import Trainer
from tests.test_master import CPU, rel_err, run_and_save, small_config, tp_layout, world_and_mesh

TOL = 1e-6
DIST = {"train.use_distributed_optimizer": "true"}
OVERLAP = dict(DIST, **{"overlap.overlap_grad_sync": "true", "overlap.overlap_param_sync": "true"})
VARIANTS = {
    "overlap_off": DIST,
    "overlap_on": OVERLAP,
    "overlap_on_8kb_buckets": dict(OVERLAP, **{"overlap.bucket_size_mb": 8 / 1024}),
}


def parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    if isinstance(trainer.optimizer, DistributedOptimizer):
        trainer.optimizer.finish_param_sync()
    return {name: param.detach().clone() for name, param in trainer.model.named_parameters()}


def match_serial_case(ep: int, micro_batches: int, steps: int, output_dir: str, layout: dict,
                      variants: list[str]) -> dict:
    """Serial AdamW vs distributed ``variants`` on the same layout, step by step; the worst errors."""
    dp = dist.get_world_size() // int(layout.get("parallel.tensor_model_parallel_size", 1))
    global_batch = 2 * micro_batches * dp
    cfg = small_config(output_dir, ep, global_batch, **layout)
    _, mesh = world_and_mesh(cfg)
    try:
        serial = Trainer(cfg, mesh, CPU)
        runs = {name: Trainer(small_config(output_dir, ep, global_batch, **layout, **VARIANTS[name]), mesh, CPU)
                for name in variants}
        worst = {name: 0.0 for name in runs} | {f"{name}_vs_overlap_off": 0.0 for name in runs}
        for _ in range(steps):
            want_grads: dict = {}
            want = serial.train_step(lambda opt: want_grads.update(opt.logical_grads()))
            want_params = parameters(serial)
            for name, trainer in runs.items():
                grads: dict = {}
                got = trainer.train_step(lambda opt: grads.update(opt.logical_grads()))
                errors = [abs(got["loss"] - want["loss"]) / want["loss"],
                          abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"]]
                errors += [rel_err(grads[key], grad) for key, grad in want_grads.items()]
                errors += [rel_err(param, want_params[key]) for key, param in parameters(trainer).items()]
                assert grads.keys() == want_grads.keys()
                worst[name] = max(worst[name], *errors)
            off = parameters(runs["overlap_off"])
            for name, trainer in runs.items():  # overlap on against off directly, too
                worst[f"{name}_vs_overlap_off"] = max(worst[f"{name}_vs_overlap_off"], *(
                    rel_err(param, off[key]) for key, param in parameters(trainer).items()))
        return worst
    finally:
        mesh.destroy()


@pytest.mark.parametrize("layout,variants", [
    ({}, list(VARIANTS)),  # DP=4 for dense parameters, expert-DP=2
    (tp_layout(2), ["overlap_off", "overlap_on"]),  # TP=2 (sequence parallel) x DP=2, experts over EP=2 x EDP=2
    ({"parallel.expert_tensor_parallel_size": 2}, ["overlap_off", "overlap_on"]),  # experts: EP=2 x expert-TP=2
], ids=["ep2xdp4", "tp2xep2xdp2", "ep2xetp2"])
def test_matches_plain_data_parallel_adamw_with_accumulation(rank_pool, tmp_path, layout, variants):
    worst = rank_pool(4).run(match_serial_case, 2, 4, 5, str(tmp_path), layout, variants)
    for rank_worst in worst:
        assert max(rank_worst.values()) < TOL, rank_worst


# ------------------------------------------------------------------------------- the overlap itself


class RecordingCollectives:
    """The real collectives, recording when each starts and when each all-gather is waited for."""

    def __init__(self, events: list):
        self.events = events

    def start_reduce_scatter(self, output, tensor, group):
        self.events.append(("reduce_scatter", torch._C._current_graph_task_id() != -1))  # inside backward?
        return collectives.start_reduce_scatter(output, tensor, group)

    def start_all_gather(self, output, tensor, group):
        work = collectives.start_all_gather(output, tensor, group)
        events = self.events

        class Recorded:
            def wait(self):
                events.append(("wait_all_gather",))
                return work.wait()

        self.events.append(("all_gather",))
        return Recorded()


def overlap_order_case(output_dir: str, overlap: bool) -> tuple[list, list[int], list]:
    """What happens, in order, over two steps; how many buckets each forward part uses first; and the GEMM SM
    carve-out at each micro-batch's forward and each reduce-scatter's start (overlap.gemm_sm_carveout=8)."""
    micro_batches = 4
    extra = OVERLAP if overlap else DIST
    cfg = small_config(output_dir, 2, 2 * micro_batches * dist.get_world_size(), **extra)
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        trainer.cfg.overlap.gemm_sm_carveout = 8  # a CUDA setting in a config: what is checked is where it lands
        events: list = []
        trainer.optimizer.collectives = RecordingCollectives(events)
        carveouts = []
        carveout = torch._C._get_sm_carveout_experimental
        trainer.model.register_forward_pre_hook(lambda *_: carveouts.append(("forward", carveout())))
        start = trainer.optimizer.collectives.start_reduce_scatter
        trainer.optimizer.collectives.start_reduce_scatter = (lambda *a: carveouts.append(("sync", carveout()))
                                                              or start(*a))
        modules = [module for module, _ in trainer.model.forward_units()]
        for index, module in enumerate(modules):
            module.register_forward_pre_hook(lambda *_, index=index: events.append(("forward", index)))
        trainer.model.register_forward_pre_hook(lambda *_: events.append(("micro_batch",)))
        for _ in range(2):
            trainer.train_step()
            events.append(("step_done",))
        first_used = [sum(b.first_unit == index for b in trainer.optimizer.buckets) for index in range(len(modules))]
        return events, first_used, carveouts + [("after", carveout())]
    finally:
        mesh.destroy()


def test_overlap_starts_reduce_scatter_in_last_backward_and_waits_all_gather_in_forward(rank_pool, tmp_path):
    for events, first_used, carveouts in rank_pool(2).run(overlap_order_case, str(tmp_path), True):
        second_step = events[events.index(("step_done",)) + 1:]
        micro_batch_starts = [i for i, event in enumerate(second_step) if event == ("micro_batch",)]
        assert len(micro_batch_starts) == 4
        # Every reduce-scatter starts inside the backward of the last micro-batch.
        scatters = [i for i, event in enumerate(second_step) if event[0] == "reduce_scatter"]
        assert scatters and all(second_step[i] == ("reduce_scatter", True) for i in scatters)
        assert min(scatters) > micro_batch_starts[-1]
        # The previous step's all-gathers are waited for lazily: each part's just before that part runs.
        expected = [("micro_batch",)]
        for index, buckets in enumerate(first_used):
            expected += [("wait_all_gather",)] * buckets + [("forward", index)]
        assert second_step[:micro_batch_starts[1]] == expected
        assert ("wait_all_gather",) not in second_step[micro_batch_starts[1]:]
        # The carve-out holds the GEMMs beside the syncs only: the first forward, the last backward.
        forwards = [value for phase, value in carveouts if phase == "forward"]
        assert forwards == [8, None, None, None] * 2 and carveouts[-1] == ("after", None)
        assert {value for phase, value in carveouts if phase == "sync"} == {8}


@pytest.mark.parametrize("carveout,ctas,want", [(8, None, 8), (0, 2, 0), ("auto", 2, 8), ("auto", None, 0),
                                               ("auto", 64, 32)])
def test_dp_carveout_setting(carveout, ctas, want):
    """What the GEMMs beside the DP syncs leave free: as set; auto: the measured pairing, 4 x the CTA cap."""
    from moe_overlap.config import Config, OverlapConfig
    from moe_overlap.training.run_setup import dp_gemm_sms

    assert dp_gemm_sms(Config(overlap=OverlapConfig(gemm_sm_carveout=carveout, dp_comm_ctas=ctas))) == want


def test_overlap_off_syncs_after_backward_and_in_the_step(rank_pool, tmp_path):
    events, _, carveouts = rank_pool(2).run(overlap_order_case, str(tmp_path), False)[0]
    assert {value for _, value in carveouts} == {None}  # nothing runs beside the GEMMs
    second_step = events[events.index(("step_done",)) + 1:]
    assert all(event[1] is False for event in second_step if event[0] == "reduce_scatter")
    last_forward = max(i for i, event in enumerate(second_step) if event[0] == "forward")
    waits = [i for i, event in enumerate(second_step) if event == ("wait_all_gather",)]
    assert waits and min(waits) > last_forward  # in the step, not in a forward


# ------------------------------------------------------------------------------------------- memory


def _storages(tensors) -> dict[int, int]:
    """Distinct storages of ``tensors``: data pointer -> bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _tensors_held_by(root) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, lists, tuples and dicts (not modules)."""
    found, seen, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack += list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("moe_overlap"):
            stack += list(vars(obj).values())
    return found


def memory_case(output_dir: str) -> dict:
    """Bytes the optimizer holds, and every fp32 byte in the process, against the expected shard sizes."""
    cfg = small_config(output_dir, 2, 2 * dist.get_world_size(), **{"train.precision": "bf16"}, **DIST)
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        trainer.train_step()
        params = list(trainer.model.parameters())
        dense = sum(p.numel() for p in params if not is_expert_param(p))
        expert = sum(p.numel() for p in params if is_expert_param(p))
        shard_bytes = 4 * (dense / mesh.dp_cp.size + expert / mesh.edp.size)  # one fp32 value per shard element
        grad_storages = _storages(param_info(p).main_grad for p in params)
        model_storages = _storages(params) | _storages(trainer.model.buffers())
        held = {ptr: size for ptr, size in _storages(_tensors_held_by(trainer.optimizer)).items()
                if ptr not in model_storages}
        gc.collect()
        live_fp32 = {ptr: size for ptr, size in _storages(
            obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.dtype == torch.float32
            and obj.device.type == "cpu" and not obj.is_meta).items()
            if ptr not in grad_storages and ptr not in model_storages and size > 0}
        return {
            "held": sum(held.values()),
            "held_expected": sum(grad_storages.values()) + 3 * shard_bytes,  # grads + master + two moments
            "grad_buffers": sum(grad_storages.values()),
            "grad_expected": 4 * (dense + expert),
            "fp32_outside_grads": sum(live_fp32.values()),
            "fp32_expected": 3 * shard_bytes,
            "full_fp32_model": 4 * (dense + expert),
        }
    finally:
        mesh.destroy()


def test_optimizer_holds_shards_and_no_full_fp32_copy(rank_pool, tmp_path):
    for report in rank_pool(4).run(memory_case, str(tmp_path)):
        for measured, expected in (("held", "held_expected"), ("grad_buffers", "grad_expected"),
                                   ("fp32_outside_grads", "fp32_expected")):
            assert abs(report[measured] / report[expected] - 1) < 0.05, (measured, report)


# --------------------------------------------------------------------------------------- non-finite


def nonfinite_case(output_dir: str, policy: str) -> dict:
    cfg = small_config(output_dir, 2, 4, **DIST, **{"train.on_nonfinite_grad": policy})
    _, mesh = world_and_mesh(cfg)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("moe_overlap").addHandler(handler)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        trainer.train_step()
        before = parameters(trainer)

        def poison(opt):  # one element of one rank's shard: every rank must still skip
            if mesh.rank == 0:
                opt.buckets[0].grad_shard[0] = float("nan")

        try:
            metrics = trainer.train_step(poison)
        except FloatingPointError as error:
            return {"raised": str(error)}
        unchanged = all(torch.equal(p, before[name]) for name, p in parameters(trainer).items())
        after = trainer.train_step()
        return {"skipped": metrics["skipped"], "unchanged": unchanged, "next_finite": after["grad_norm"] < 1e3,
                "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING]}
    finally:
        logging.getLogger("moe_overlap").removeHandler(handler)
        mesh.destroy()


def test_nonfinite_gradient_skips_the_step_with_a_warning(rank_pool, tmp_path):
    for report in rank_pool(2).run(nonfinite_case, str(tmp_path), "skip"):
        assert report["skipped"] and report["unchanged"] and report["next_finite"], report
        assert any("step 2" in w and "nan" in w for w in report["warnings"]), report


def test_nonfinite_gradient_stops_when_asked(rank_pool, tmp_path):
    for report in rank_pool(2).run(nonfinite_case, str(tmp_path), "stop"):
        assert "step 2" in report["raised"] and "on_nonfinite_grad=stop" in report["raised"]


# -------------------------------------------------------------------------------------- checkpoints


def resume_and_save_case(output_dir: str, extra: dict, train_steps: int) -> int:
    """Resume from the latest checkpoint (if any), train ``train_steps`` steps, save; returns the step."""
    cfg = small_config(output_dir, 2, 8, **{"train.precision": "bf16"}, **extra)
    _, mesh = world_and_mesh(cfg)
    try:
        trainer = Trainer(cfg, mesh, CPU)
        trainer.resume()
        for _ in range(train_steps):
            trainer.train_step()
        trainer.save()
        return trainer.step
    finally:
        mesh.destroy()


def read_whole(root) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint under ``root``, whole, read in this one process."""
    path = str(step_dir(root, latest_step(root)))
    metadata = dcp.FileSystemReader(path).read_metadata()
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def assert_masters_place_like_the_model(state: dict) -> None:
    """Each bf16 parameter is its fp32 master rounded: so the master's pieces, written from flat shards,
    landed where the model's whole tensors (or TP blocks) did."""
    masters = [key for key in state if key.endswith(".master")]
    assert masters
    for key in masters:
        model = state["model." + key[len("optimizer."):-len(".master")]]
        assert torch.equal(state[key].to(model.dtype), model), key


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    assert any(key.endswith(".master") for key in want)  # bf16: masters are saved apart from the model
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def test_checkpoint_reshards_2_to_4_to_2_ranks(rank_pool, tmp_path):
    two, four, back = tmp_path / "two", tmp_path / "four", tmp_path / "back"
    assert rank_pool(2).run(resume_and_save_case, str(two), DIST, 2)[0] == 2
    saved_on_two = read_whole(two / "checkpoints")
    assert_masters_place_like_the_model(saved_on_two)
    (four / "checkpoints").mkdir(parents=True)
    for item in (two / "checkpoints").iterdir():  # resume the 2-rank checkpoint on 4 ranks (DP 2 -> 4)
        item.rename(four / "checkpoints" / item.name)
    assert rank_pool(4).run(resume_and_save_case, str(four), DIST, 0)[0] == 2
    assert_same_state(read_whole(four / "checkpoints"), saved_on_two)
    (back / "checkpoints").mkdir(parents=True)
    for item in (four / "checkpoints").iterdir():  # and the 4-rank one on 2 ranks
        item.rename(back / "checkpoints" / item.name)
    assert rank_pool(2).run(resume_and_save_case, str(back), DIST, 0)[0] == 2
    assert_same_state(read_whole(back / "checkpoints"), saved_on_two)


def test_checkpoints_load_across_serial_and_distributed_optimizers(rank_pool, tmp_path):
    rank_pool(2).run(resume_and_save_case, str(tmp_path), {}, 2)  # serial, plain tensors
    saved_by_serial = read_whole(tmp_path / "checkpoints")
    rank_pool(4).run(resume_and_save_case, str(tmp_path), DIST, 0)  # distributed, 4 ranks
    assert_same_state(read_whole(tmp_path / "checkpoints"), saved_by_serial)
    rank_pool(4).run(resume_and_save_case, str(tmp_path), DIST, 1)
    saved_by_distributed = read_whole(tmp_path / "checkpoints")
    assert_masters_place_like_the_model(saved_by_distributed)
    rank_pool(2).run(resume_and_save_case, str(tmp_path), {}, 0)  # back into the serial optimizer
    assert_same_state(read_whole(tmp_path / "checkpoints"), saved_by_distributed)


def test_checkpoint_reshards_across_tensor_parallel_sizes(rank_pool, tmp_path):
    tp2 = dict(DIST, **tp_layout(2))
    rank_pool(4).run(resume_and_save_case, str(tmp_path), tp2, 2)  # TP=2 x DP=2: TP blocks of DP shards
    saved_at_tp2 = read_whole(tmp_path / "checkpoints")
    assert_masters_place_like_the_model(saved_at_tp2)
    rank_pool(2).run(resume_and_save_case, str(tmp_path), DIST, 0)  # TP=1 x DP=2
    assert_same_state(read_whole(tmp_path / "checkpoints"), saved_at_tp2)
    rank_pool(2).run(resume_and_save_case, str(tmp_path), tp2, 0)  # TP=2 x DP=1
    assert_same_state(read_whole(tmp_path / "checkpoints"), saved_at_tp2)


def resumed_losses_case(output_dir: str, steps: int) -> list[float]:
    return run_and_save(output_dir, 2, steps, steps, **DIST)


def test_training_continues_across_a_reshard(rank_pool, tmp_path):
    straight = rank_pool(2).run(resumed_losses_case, str(tmp_path / "straight"), 4)[0]
    rank_pool(2).run(resumed_losses_case, str(tmp_path / "resumed"), 2)
    resumed = rank_pool(4).run(resumed_losses_case, str(tmp_path / "resumed"), 4)[0]
    assert len(resumed) == 2
    for got, want in zip(resumed, straight[2:]):  # the step-4 loss depends on the restored Adam moments
        assert abs(got - want) / want < 1e-5


@pytest.mark.parametrize("shape,start,end", [((5, 7, 3), 0, 105), ((5, 7, 3), 4, 100), ((5, 7, 3), 22, 23),
                                             ((6, 4), 3, 21), ((9,), 2, 5), ((4, 4), 4, 12)])
def test_boxes_tile_a_flat_range_in_order(shape, start, end):
    flat = torch.arange(torch.Size(shape).numel()).view(shape)
    pieces = [flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
              for offsets, sizes in _boxes(shape, start, end)]
    assert torch.equal(torch.cat(pieces), torch.arange(start, end))
    assert len(pieces) <= 2 * len(shape) - 1


def test_benchmark_rejects_unknown_variant():
    from benchmarks.dp_overlap import Variant, parse_args

    with pytest.raises(SystemExit):
        parse_args(["--extra", "nccl_fast"])
    assert parse_args(["--extra", "nccl_hp_2ctas+carveout8"]).extra == ["nccl_hp_2ctas+carveout8"]
    args = parse_args(["overlap.dp_comm_ctas=2", "overlap.gemm_sm_carveout=4"])  # overrides with no config file
    assert args.config is None and args.overrides == ["overlap.dp_comm_ctas=2", "overlap.gemm_sm_carveout=4"]
    assert Variant.parse("nccl_hp_2ctas+carveout8") == Variant(True, "nccl_hp_2ctas", 8)
    assert Variant.parse("nccl_default") == Variant(True, "nccl_default", None)  # the configured carve-out
    assert Variant.parse("compute_only") == Variant(False, None, 0)  # the limit: the whole chip


def test_benchmark_smoke_on_gloo(rank_pool, tmp_path):
    path = tmp_path / "dp_overlap.json"
    rank_pool(2).run("benchmarks.dp_overlap:main", ["--smoke", "--probe", "--extra", "gloo", "--json",
                                                     str(path)])
    result = json.loads(path.read_text())
    assert {"device", "world_size", "date", "command", "env", "rows"} <= result.keys() and result["world_size"] == 2
    rows = result["rows"]
    steps = [row for row in rows if row["section"] == "step"]
    assert [row["variant"] for row in steps] == ["serial", "overlapped", "compute_only", "gloo"]
    assert all(row["samples"] > 0 and row["step_ms"] > 0 for row in steps)
    summary = next(row for row in rows if row["section"] == "summary")
    assert summary["buckets"] == sum(row["section"] == "buckets" for row in rows) > 1
    assert {"exposed_comm_ms", "serial_comm_ms", "largest_bucket_comm_ms"} <= summary.keys()
    probes = [row for row in rows if row["section"] == "probe"]
    assert {(row["transport"], row.get("op")) for row in probes} == {
        ("gloo", "reduce_scatter"), ("gloo", "all_gather"), ("copy_engine", None)}


def test_checkpoint_reshards_across_expert_tensor_parallel_sizes(rank_pool, tmp_path):
    """Saved at EP=2 x expert-TP=2 (expert-TP blocks of expert-DP shards), reloaded at expert-TP 1 and again
    at 2 on fewer ranks: every tensor comes back the same."""
    etp2 = dict(DIST, **{"parallel.expert_tensor_parallel_size": 2})
    rank_pool(4).run(resume_and_save_case, str(tmp_path), etp2, 2)
    saved_at_etp2 = read_whole(tmp_path / "checkpoints")
    assert_masters_place_like_the_model(saved_at_etp2)
    rank_pool(2).run(resume_and_save_case, str(tmp_path), DIST, 0)  # EP=2, expert-TP 1
    assert_same_state(read_whole(tmp_path / "checkpoints"), saved_at_etp2)
    rank_pool(4).run(resume_and_save_case, str(tmp_path), etp2, 0)
    assert_same_state(read_whole(tmp_path / "checkpoints"), saved_at_etp2)
