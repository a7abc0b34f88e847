"""Exposed communication that is true (`pytest -m gpu`, 2 GPUs): rank 1's GPU is held back by a known time before
every MoE layer's forward; rank 0 waits for it at that layer's exchange and must report at least that much
exposed EP time, for the serial path, the default path, every pipeline transport (nccl, copy_engine, sm_push) and
MoE layers replayed from CUDA graphs (whose waits only the device clock can see). Launched once under torchrun;
the per-rank work is `exposed_cases` below, each case reported on its own."""

from __future__ import annotations

import gc
import sys
import traceback

import pytest
import torch

from tests.gpu_launch import REPO, launch_ranks, require_gpus, write_report

DELAY_MS = 20.0
HELD_STEPS = 3
CASES = {
    "serial_nccl": {"overlap.moe_pipeline": "false"},
    "default": {"train.moe_cuda_graph": "auto"},  # what a user gets: device planning, sm_push on this host, graphed
    # one micro-batch at a time (over NCCL, auto would pair: its MoE layers would run as stages, past the hook)
    "pipeline_nccl": {"overlap.moe_pipeline": "true", "overlap.moe_planning": "host", "overlap.moe_transport": "nccl",
                      "overlap.overlap_moe_expert_parallel_comm": "false"},
    "pipeline_copy_engine": {"overlap.moe_pipeline": "true", "overlap.moe_planning": "host",
                             "overlap.moe_transport": "copy_engine"},
    "pipeline_sm_push": {"overlap.moe_pipeline": "true", "overlap.moe_planning": "device",
                         "overlap.moe_transport": "sm_push", "overlap.moe_pipeline_chunks": 2},
    "pipeline_sm_push_graphed": {"overlap.moe_pipeline": "true", "overlap.moe_planning": "device",
                                 "overlap.moe_transport": "sm_push", "train.moe_cuda_graph": "true"},
    # paired micro-batches on two streams: the graphs' clock is added to by both at once (atomically); rank 1 is held
    # back before the first graphed copy's layers only (the hook is the layer's), the even micro-batches
    "paired_streams_graphed": {"overlap.moe_pipeline": "true", "overlap.moe_planning": "device",
                               "overlap.moe_transport": "sm_push", "train.moe_cuda_graph": "true",
                               "overlap.overlap_moe_expert_parallel_comm": "true"},
}


def sleep_cycles_per_ms() -> float:
    """torch.cuda._sleep spins for a number of GPU clock cycles: how many make a millisecond here."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # the first launch pays for loading the kernel
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def exposed_cases(output_dir: str) -> dict:
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training.run_setup import init_distributed, mesh_layout
    from moe_overlap.training.trainer import Trainer
    from tests.test_master import small_config

    def config(extra: dict):
        return small_config(output_dir, 2, 8, **{"train.precision": "bf16", "train.device": "cuda", **extra})

    _, device = init_distributed(config({}))
    rank, cycles_per_ms = dist.get_rank(), sleep_cycles_per_ms()
    report = {"rank": rank, "cases": {}}
    for name, extra in CASES.items():
        cfg = config(extra)
        mesh = Mesh.create(mesh_layout(cfg, 2), timeout_s=120)
        try:
            trainer = Trainer(cfg, mesh, device)
            for _ in range(2):  # warm-up: symmetric regions, graphs, NCCL communicators
                trainer.train_step()
            calm = [trainer.train_step()["exposed_comm_ms"]["ep"] for _ in range(2)]
            holds = []  # the spin's own start and end on rank 1's stream: its clock may not be the calibration's

            def hold_back(*_):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(int(DELAY_MS * cycles_per_ms))
                end.record()
                holds.append((start, end))

            if rank == 1:
                for layer in trainer.model.layers.values():
                    if layer.is_moe:
                        layer.mlp.register_forward_pre_hook(hold_back)
            held = [trainer.train_step()["exposed_comm_ms"]["ep"] for _ in range(HELD_STEPS)]
            torch.cuda.synchronize()
            delayed = torch.tensor([sum(s.elapsed_time(e) for s, e in holds) / HELD_STEPS], dtype=torch.float64,
                                   device=device)
            dist.broadcast(delayed, src=1)  # rank 1's GPU was held back this long per step
            report["cases"][name] = {"calm_ep_ms": calm, "held_ep_ms": held, "delay_per_step_ms": float(delayed),
                                     "resolved": trainer.resolved_settings()}
            del trainer
            gc.collect()  # its symmetric workspaces freed now, not by a collection inside the next case's capture
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - one case's failure is its own, reported with its traceback
            report["cases"][name] = {"error": traceback.format_exc()[-3000:]}
        finally:
            mesh.destroy()
    dist.destroy_process_group()
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    require_gpus(2)
    return launch_ranks(__file__, tmp_path_factory.mktemp("gpu_exposed"), timeout_s=300, world=2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_a_held_back_peer_shows_as_exposed_ep_time(reports, case):
    by_rank = {report["rank"]: report["cases"][case] for report in reports}
    for result in by_rank.values():
        assert "error" not in result, result["error"]
    waiting, held = by_rank[0], by_rank[1]
    delay = waiting["delay_per_step_ms"]
    assert delay >= 2 * 0.5 * DELAY_MS  # two MoE layers x micro-batches per step were held back
    # Rank 0 waits out every hold-back at the held layer's exchange, less what it queued before the wait (the
    # router, the permutation, a host-planned layer's count exchange), which ran during the hold (2xH100: 0.89 x
    # the delay, host-planned copy engine); the held rank itself barely waits.
    for ms in waiting["held_ep_ms"]:
        assert ms >= 0.8 * delay, (ms, delay, waiting)
    # The held rank's median step: on 4xH100 (2026-11-27, the default path) one of its two steps waited 191 ms and the
    # other 0.6 ms; the cause of that one step's wait was not found.
    assert sorted(held["held_ep_ms"])[HELD_STEPS // 2] < 0.5 * delay, held
    if case.endswith("graphed") or case == "default":  # auto graphs the device-planned layers
        assert waiting["resolved"]["moe_cuda_graph"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("wait_ms,compute_ms", [(20.0, 8.0), (5.0, 20.0)])
def test_a_pairs_wait_counts_only_where_neither_stream_computes(wait_ms, compute_ms):
    """One GPU, two streams as a pair runs them (streams.pair_stream_work): stream B computes for ``compute_ms`` in
    its block while stream A, in its own, waits ``wait_ms`` (a spin standing in for a peer's signal). The wait is
    exposed only once B is done: wait - compute, not the wait's own length, which the waits' sum would give."""
    from moe_overlap.distributed.streams import exposed_wait, measuring_exposed_comm, pair_stream_work, use_stream

    if not torch.cuda.is_available():
        pytest.fail("needs CUDA")
    device, cycles_per_ms = torch.device("cuda"), sleep_cycles_per_ms()
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    got = []
    for _ in range(3):  # the first pays for loading the kernels
        with measuring_exposed_comm(device) as tally:
            for stream in (first, second):
                stream.wait_stream(torch.cuda.current_stream())
            with use_stream(second), pair_stream_work(device):
                torch.cuda._sleep(int(compute_ms * cycles_per_ms))
            with use_stream(first), pair_stream_work(device), exposed_wait("ep"):
                torch.cuda._sleep(int(wait_ms * cycles_per_ms))
            for stream in (first, second):
                torch.cuda.current_stream().wait_stream(stream)
        got.append(tally.totals_ms()["ep"])
    want = max(0.0, wait_ms - compute_ms)
    assert abs(got[-1] - want) < 0.1 * wait_ms, (got, want)


if __name__ == "__main__":  # one rank under torchrun
    sys.path.insert(0, str(REPO))
    write_report(sys.argv[1], exposed_cases(sys.argv[1]))
