"""Routing replay on GPUs (`pytest -m gpu`, 2 GPUs): a compute-only run from other weights routes exactly as the
recorded run did when the MoE layers replay CUDA graphs, one micro-batch at a time and paired on two streams (each
graphed copy routes through its own slot, filled and read on its micro-batch's stream). Launched once under
torchrun; the per-rank work is `replay_cases` below."""

from __future__ import annotations

import gc
import sys
import traceback

import pytest
import torch

from tests.gpu_launch import REPO, launch_ranks, write_report

STEPS = 3
GRAPHED = {"overlap.moe_pipeline": "true", "overlap.moe_planning": "device", "overlap.moe_transport": "sm_push",
           "train.moe_cuda_graph": "true"}
CASES = {"graphed": {**GRAPHED, "overlap.overlap_moe_expert_parallel_comm": "false"},
         "graphed_paired_streams": {**GRAPHED, "overlap.overlap_moe_expert_parallel_comm": "true"}}


def replay_cases(output_dir: str) -> dict:
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.layers.routing_replay import RoutingReplay
    from moe_overlap.training.run_setup import init_distributed, mesh_layout
    from moe_overlap.training.trainer import Trainer
    from tests.test_master import small_config

    def config(extra: dict):
        return small_config(output_dir, 2, 8, **{"train.precision": "bf16", "train.device": "cuda", **extra})

    _, device = init_distributed(config({}))
    report = {"rank": dist.get_rank(), "cases": {}}
    for name, extra in CASES.items():
        other = {**extra, "overlap.moe_compute_only": "true", "train.seed": "7"}
        recording = RoutingReplay()
        counts, resolved = {}, {}
        try:
            for run, overrides, replay in (("recorded", extra, recording),
                                           ("replayed", other, RoutingReplay(recording.recorded)),
                                           ("own", other, None)):
                cfg = config(overrides)
                mesh = Mesh.create(mesh_layout(cfg, 2), timeout_s=120)
                try:
                    trainer = Trainer(cfg, mesh, device, routing_replay=replay)
                    counts[run] = []
                    for _ in range(STEPS):
                        trainer.train_step()
                        counts[run].append({layer: c.cpu() for layer, c in trainer.tokens_per_micro_batch.items()})
                    resolved[run] = trainer.resolved_settings()
                    del trainer
                    gc.collect()
                    torch.cuda.synchronize()
                finally:
                    mesh.destroy()
            same = {run: all(torch.equal(a[layer], b[layer]) for a, b in zip(counts["recorded"], counts[run])
                             for layer in a) for run in ("replayed", "own")}
            report["cases"][name] = {"same": same, "resolved": resolved["recorded"]}
        except Exception:  # noqa: BLE001 - one case's failure is its own, reported with its traceback
            report["cases"][name] = {"error": traceback.format_exc()[-3000:]}
    dist.destroy_process_group()
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:  # fails without a GPU, skips with one (launch_ranks)
    return launch_ranks(__file__, tmp_path_factory.mktemp("gpu_replay"), timeout_s=300, world=2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_a_graphed_compute_only_run_replays_the_recorded_routing(reports, case):
    for report in reports:
        result = report["cases"][case]
        assert "error" not in result, result["error"]
        assert result["same"] == {"replayed": True, "own": False}, result
        assert result["resolved"]["moe_cuda_graph"] is True
        paired = result["resolved"]["overlap_moe_expert_parallel_comm"]
        assert paired is (case == "graphed_paired_streams"), paired


if __name__ == "__main__":  # one rank under torchrun
    sys.path.insert(0, str(REPO))
    write_report(sys.argv[1], replay_cases(sys.argv[1]))
