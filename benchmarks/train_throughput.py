"""Training throughput of a config: tokens/s and peak memory over N steps (torchrun, one rank per GPU).

    torchrun --nproc-per-node 2 benchmarks/train_throughput.py configs/small_gpu.yaml --steps 50 \
        --json benchmarks/results/train_small_gpu_serial_2xh200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import disable_multicast, run_header, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the averages")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    disable_multicast()

    import torch.distributed as dist

    from moe_overlap.config import load_config
    from moe_overlap.training.trainer import Trainer, init_distributed

    cfg = load_config(args.config, args.overrides + [f"train.max_steps={args.steps}", "train.eval_interval=0",
                                                     "checkpoint.save_final=false", "checkpoint.save_interval=0"])
    mesh, device = init_distributed(cfg)
    history = Trainer(cfg, mesh, device).fit()
    if mesh.rank == 0:
        timed = history[args.warmup:]
        row = {
            "config": args.config, "steps": len(history), "timed_steps": len(timed),
            "tokens_per_s_median": statistics.median(m["tokens_per_s"] for m in timed),
            "step_time_s_median": statistics.median(m["step_time_s"] for m in timed),
            "peak_memory_gib": max(m.get("peak_memory_gib", 0.0) for m in history),
            "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
            "global_batch_size": cfg.train.global_batch_size, "seq_length": cfg.model.seq_length,
            "precision": cfg.train.precision, "expert_model_parallel_size": cfg.parallel.expert_model_parallel_size,
        }
        print(row)
        write_json(args.json, run_header(mesh.world_size), [row])
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
