"""A rank killed while its peers wait for it on the GPU (`pytest -m gpu`, one rank per GPU: 2, 4 or 8; skipped on
one GPU, where a dead rank has no peer): in a symmetric-memory signal wait of the device-planned MoE pipeline,
which runs on the device and which no collective timeout reaches (eager, and inside a MoE layer replayed from its
CUDA graph, the default), and inside an NCCL all-reduce. The others exit
within train.distributed_timeout_s with one line naming the dead rank and its phase: the heartbeat monitor ends
them while their host threads are blocked behind the device. (On CPU, test_fault.py blocks a rank in a wait that
never fails to the same end.)
"""

from __future__ import annotations

import signal

import pytest

from benchmarks.common import MULTICAST_OFF
from tests.gpu_launch import ranks_for_every_gpu, require_gpus
from tests.long_run import finish, launch_ranks, train_argv

TIMEOUT_S = 20


@pytest.mark.gpu
@pytest.mark.parametrize("fault, extra", [
    ("symm", ["train.moe_cuda_graph=false"]),  # eager: the push it strikes in runs in Python
    ("collective", []),  # tiny.yaml's fp32: auto leaves the layers eager
    # graphed (as auto runs bf16 layers): the peers wait on the device inside a replayed MoE layer
    ("forward", ["train.precision=bf16", "train.moe_cuda_graph=true"]),
])
def test_rank_killed_while_peers_wait_on_the_gpu(tmp_path, fault, extra):
    require_gpus(2)
    world = ranks_for_every_gpu()  # 2, 4 or 8: divides the 8 experts
    argv = train_argv(tmp_path / "run", "train.device=cuda", f"parallel.expert_model_parallel_size={world}",
                      f"train.global_batch_size={4 * world}", "overlap.moe_pipeline=true",
                      "overlap.moe_planning=device", *extra, f"train.distributed_timeout_s={TIMEOUT_S}")
    codes, outputs, ended = finish(launch_ranks(argv, tmp_path, f"{fault}:1:3", world_size=world, env=MULTICAST_OFF),
                                   tmp_path, timeout_s=300)
    assert codes[1] == -signal.SIGKILL and codes[0] == 3 and set(codes[2:]) <= {3}, [o[-2000:] for o in outputs]
    for rank in [0, *range(2, world)]:
        line = next(line for line in outputs[rank].splitlines() if f"moe-overlap: rank {rank}" in line)
        assert "rank 1 is gone" in line and "(it was in train step 3)" in line, line
        assert ended[rank] - ended[1] < TIMEOUT_S, line
