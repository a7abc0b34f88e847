"""Where a step's time goes: the profile summaries (train.profile_steps) and the metrics every step logs."""

from __future__ import annotations

import json

import pytest
import torch

from moe_overlap.config import load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.distributed.streams import EXPOSED_KINDS, HostCopy
from moe_overlap.training.profiling import host_late_idle, kernel_kind, step_breakdown, stream_summary
from moe_overlap.training.trainer import Trainer

COMPUTE, NCCL = 7, 9
SPANS = [(COMPUTE, "nvjet_hsh_256x128_gemm_a", 0.0, 6000.0), (COMPUTE, "nvjet_gemm_b", 4000.0, 10000.0),
         (COMPUTE, "_rms_norm_fwd_kernel", 12000.0, 20000.0), (NCCL, "ncclDevKernel_ReduceScatter", 5000.0, 15000.0)]


def test_stream_summary_splits_busy_idle_and_beside():
    summary = stream_summary(SPANS, steps=2)
    assert summary["window_ms"] == 10.0 and summary["compute_busy_ms"] == 9.0 and summary["compute_idle_ms"] == 1.0
    assert summary["device_idle_ms"] == 0.0  # NCCL runs through the compute stream's gap
    gap = stream_summary(SPANS + [(NCCL, "ncclDevKernel_AllGather", 24000.0, 26000.0)], steps=2)
    assert gap["window_ms"] == 13.0 and gap["device_idle_ms"] == 2.0  # 20-24 us of 26, nothing running
    assert summary["nccl_busy_ms"] == 5.0 and summary["nccl_beside_compute_ms"] == 4.0  # (5-10) + (12-15), halved
    assert summary["longest_compute_gaps"] == [{"at_ms": 10.0, "ms": 2.0, "next": "_rms_norm_fwd_kernel"}]


def test_stream_summary_names_the_kernel_after_each_gap_in_a_long_step():
    """A step of 100,000 compute-stream kernels (a fine-grained model at 4 GPUs with 32 micro-batches records
    about that many): every gap's following kernel is found, so the longest gaps name theirs. (Finding each by a
    scan from the step's start took about 20 s at 20,000 kernels and hours at this size: a profiled step that
    never finished.)"""
    spans = [(COMPUTE, f"kernel_{i}", i * 10.0, i * 10.0 + (6.0 if i % 1000 else 1.0)) for i in range(100_000)]
    gaps = stream_summary(spans, steps=1)["longest_compute_gaps"]
    assert [g["next"] for g in gaps[:3]] == ["kernel_99001", "kernel_98001", "kernel_97001"]  # after the 1-us ones
    assert all(g["ms"] == 0.009 for g in gaps[:3])


def test_host_late_idle_counts_the_gap_before_the_launch_call_only():
    """A Chrome trace's kernels joined to their launch calls by correlation id: in a gap, the time before the host
    queued the next kernel is the host's; the rest (the launch in flight, a graph's own gaps) is not. Kernel 2
    is queued 3 us into its 5-us gap; kernel 3 well before its gap (the device's wait); kernels 4 and 5 come from
    one graph launch, long before."""
    def kernel(name, ts, dur, corr, stream=7):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr, "stream": stream}}

    def call(name, ts, dur, corr):
        return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        call("cudaLaunchKernel", 0, 2, 1), kernel("gemm_a", 10, 10, 1),
        call("cudaLaunchKernel", 22, 1, 2), kernel("_quantize_rows_kernel", 25, 5, 2),  # gap 20-25, queued at 23
        call("cudaLaunchKernel", 24, 1, 3), kernel("_rope_kernel", 40, 10, 3),  # gap 30-40, queued at 25
        call("cudaGraphLaunch", 26, 4, 4), kernel("graph_gemm", 50, 20, 4), kernel("graph_sum", 80, 10, 4),
        call("cudaMemcpyAsync", 100, 1, 5), {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 104, "dur": 2,
                                            "args": {"correlation": 5, "stream": 7}},  # gap 90-104, queued at 101
        kernel("ncclDevKernel_AllReduce", 0, 200, 6, stream=9), call("cudaLaunchKernel", 0, 1, 6)]}
    report = host_late_idle(trace, steps=1)
    assert report["kernels"] == 6 and report["launches_joined"] == 6
    assert report["compute_idle_ms"] == 0.039  # 5 + 10 + 10 + 14 us
    assert report["host_late_ms"] == 0.014  # 3 (quantize) + 11 (the copy)
    assert [(g["next"], g["gaps"]) for g in report["host_late_before"]] == [("Memcpy HtoD", 1),
                                                                           ("_quantize_rows_kernel", 1)]
    assert host_late_idle({"traceEvents": []}, 1) == {"skipped": "the trace holds no device events"}


def test_step_breakdown_by_kind_of_work():
    report = step_breakdown(SPANS, steps=2)
    assert report["step_ms"] == 10.0
    kinds = report["compute_stream_ms"]
    assert kinds["GEMM"] == 6.0 and kinds["elementwise"] == 4.0 and kinds["idle"] == 1.0  # GEMMs overlap 4-6
    assert report["other_streams_ms"] == {"communication": 5.0}
    assert report["top_kernels"][0]["kernel"] == "_rms_norm_fwd_kernel"


@pytest.mark.parametrize("name,kind", [
    ("ncclDevKernel_AllGather_RING_LL", "communication"), ("_adamw_kernel", "optimizer"),
    ("pytorch_flash::flash_bwd_kernel", "attention"), ("_grouped_wgrad_kernel", "grouped GEMM"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", "GEMM"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda", "copies"),
    ("_swiglu_bwd_kernel", "elementwise")])
def test_kernel_kinds(name, kind):
    assert kernel_kind(name) == kind


def test_every_step_logs_throughput_mfu_and_exposed_communication(tmp_path):
    """On CPU (one process): MFU from the config's FLOPs and the step time, exposed communication per kind,
    and a profile of the asked steps written where the README says."""
    cfg = load_config("configs/tiny.yaml", ["parallel.expert_model_parallel_size=1", "train.max_steps=3",
                                            "train.eval_interval=0", "checkpoint.save_final=false",
                                            "train.global_batch_size=8", "train.micro_batch_size=4",
                                            "train.profile_steps=[2,3]", f"train.output_dir={tmp_path}"])
    history = Trainer(cfg, Mesh.single(), torch.device("cpu")).fit()
    assert [m["step"] for m in history] == [1, 2, 3]
    for m in history:
        assert m["tokens_per_s"] > 0 and 0 < m["mfu"] < 1
        assert m["mfu"] == pytest.approx(m["tflops_per_gpu"] / cfg.train.peak_tflops)
        assert set(m["exposed_comm_ms"]) == set(EXPOSED_KINDS)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3] and "mfu" in logged[0]
    report = json.loads((tmp_path / "profile" / "breakdown_rank0.json").read_text())
    assert report["steps"] == [2, 3]
    assert (tmp_path / "profile" / "trace_rank0.json").stat().st_size > 0


def exposed_case(output_dir: str, layout: list[str]) -> dict[str, float]:
    import torch.distributed as dist

    from moe_overlap.training.run_setup import mesh_layout

    cfg = load_config("configs/tiny.yaml", layout + ["train.max_steps=1", "train.eval_interval=0",
                                                     "checkpoint.save_final=false", f"train.output_dir={output_dir}",
                                                     "train.global_batch_size=8", "train.micro_batch_size=4"])
    mesh = Mesh.create(mesh_layout(cfg, dist.get_world_size()), timeout_s=60)
    try:
        return Trainer(cfg, mesh, torch.device("cpu")).train_step()["exposed_comm_ms"]
    finally:
        mesh.destroy()


def test_exposed_communication_is_counted_per_kind(rank_pool, tmp_path):
    """Two ranks: EP=2 over DP=2 waits for the experts' exchange and the gradient all-reduce; TP=2 with EP=2
    folded over it for the TP collectives and the exchange; nothing is counted where a kind has no group."""
    dp_ep = rank_pool(2).run(exposed_case, str(tmp_path / "a"), ["parallel.expert_model_parallel_size=2"])
    tp_ep = rank_pool(2).run(exposed_case, str(tmp_path / "b"), [
        "parallel.expert_model_parallel_size=2", "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true", "parallel.expert_tensor_parallel_size=1"])
    for exposed in dp_ep:
        assert exposed["ep"] > 0 and exposed["dp"] > 0 and exposed["tp"] == exposed["pp"] == exposed["cp"] == 0
    for exposed in tp_ep:
        assert exposed["ep"] > 0 and exposed["tp"] > 0 and exposed["dp"] == exposed["pp"] == 0


def test_pipeline_and_context_parallel_waits_are_counted(rank_pool, tmp_path):
    """PP=2: the stage's receives and sends; CP=2: the ring attention's key-value exchange and the sequence
    gather of the router's input."""
    pp = rank_pool(2).run(exposed_case, str(tmp_path / "pp"), [
        "parallel.expert_model_parallel_size=1", "parallel.pipeline_model_parallel_size=2"])
    cp = rank_pool(2).run(exposed_case, str(tmp_path / "cp"), [
        "parallel.expert_model_parallel_size=1", "parallel.context_parallel_size=2"])
    for exposed in pp:
        assert exposed["pp"] > 0 and exposed["ep"] == exposed["cp"] == 0
    for exposed in cp:
        assert exposed["cp"] > 0 and exposed["pp"] == 0


def test_a_wait_inside_another_counts_once_and_groups_carry_their_kind():
    import time

    from moe_overlap.distributed.streams import exposed_kind, exposed_wait, measuring_exposed_comm, set_exposed_kind

    with measuring_exposed_comm(torch.device("cpu")) as tally:
        with exposed_wait("ep"):
            time.sleep(0.02)
            with exposed_wait("dp"):  # e.g. a blocking collective inside an exchange's wait
                time.sleep(0.02)
        with exposed_wait(None):  # a group no mesh named: not timed
            time.sleep(0.01)
    totals = tally.totals_ms()
    assert totals["ep"] >= 40 and totals["dp"] == 0 and sum(totals.values()) == totals["ep"]
    group = object()
    assert exposed_kind(group) is None
    set_exposed_kind(group, "dp")
    assert exposed_kind(group) == "dp"
    set_exposed_kind(group, None)  # destroyed with its mesh
    assert exposed_kind(group) is None
    with pytest.raises(ValueError, match="allowed ep, tp, dp, pp, cp"):
        set_exposed_kind(group, "moe")


def test_a_pairs_exposed_time_is_shared_among_the_kinds_as_its_waits_were():
    """The device clock's step difference (streams.ExposedComm): waits inside graphs off a pair's streams count whole
    per kind; on a pair's streams only the time both were held counts, shared as the pair's own waits were."""
    from moe_overlap.distributed.streams import _PAIR_EXPOSED, _PAIR_STATE, _PAIR_WAITS, ExposedComm

    clock_ns = torch.zeros(_PAIR_STATE + 1, dtype=torch.int64)
    clock_ns[EXPOSED_KINDS.index("dp")] = 3_000_000  # a graph's wait off the pair's streams
    clock_ns[_PAIR_WAITS + EXPOSED_KINDS.index("ep")] = 30_000_000  # the pair's waits, mostly hidden
    clock_ns[_PAIR_WAITS + EXPOSED_KINDS.index("pp")] = 10_000_000
    clock_ns[_PAIR_EXPOSED] = 8_000_000  # both streams held with a wait open
    tally = ExposedComm(torch.device("cpu"))
    tally._graph_waits_ns = HostCopy(clock_ns)
    assert tally.totals_ms() == pytest.approx({"ep": 6.0, "tp": 0.0, "dp": 3.0, "pp": 2.0, "cp": 0.0})


class _Event:
    """A kineto event as torch 2.11 hands it over: no activity type, no annotation flag."""

    def __init__(self, name: str):
        self._name = name

    def name(self) -> str:
        return self._name


def test_annotations_are_told_from_kernels_without_torch_2_13s_fields():
    from moe_overlap.training.profiling import _is_annotation

    assert _is_annotation(_Event("nccl:all_to_all")) and not _is_annotation(_Event("ncclDevKernel_SendRecv"))
    assert not _is_annotation(_Event("c10d::symmetric_memory::wait_signal_kernel"))


def test_gradients_from_other_streams_are_expected_without_the_autograd_warning():
    """Graph captures and pairs on two streams hand parameters gradients made on another stream: autograd's warning
    about it is filtered, other warnings are not."""
    import warnings

    from moe_overlap.distributed.streams import expect_gradients_from_other_streams

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expect_gradients_from_other_streams()
        warnings.warn("The AccumulateGrad node's stream does not match the stream of the node that produced the "
                      "incoming gradient.", UserWarning)
        warnings.warn("another warning", UserWarning)
    assert [str(w.message) for w in caught] == ["another warning"]
