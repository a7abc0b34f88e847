"""Copy-engine peer copies through symmetric memory: bandwidth by size, copy streams and direction.

    torchrun --nproc-per-node 2 benchmarks/peer_copy.py --json benchmarks/results/peer_copy_2xh200.json

Each rank pushes a block into the other's registered buffer (what the symm transports do) with the block
split over 1, 2 or 4 copy streams (each its own cudaMemcpyAsync, so the driver may spread them over copy
engines); "both" has both ranks push at once (as in a ring or an all-to-all), "one" only rank 0. Also: the
same push beside a full-chip GEMM launched after or before it (how much of it the GEMM hides, and what it
costs the GEMM). ``--sm-push-ctas`` adds the same bytes moved by the exchange's SM push kernel (kernels/push_rows.py,
wire rows of ``--row-bytes``) at each CTA count, alone and beside the GEMM, into the same buffer, every transfer
"both" ways: what the copy engines would save a GEMM beside the exchange over the SM pushes it runs today.
``--gemm`` sets the GEMM's M,N,K (default 8192,8192,8192). CUDA only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_header, set_run_env, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="8,32,128", help="block sizes in MiB (comma list)")
    parser.add_argument("--streams", default="1,2,4", help="copy streams a block is split over (comma list)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sm-push-ctas", default="", help="SM push CTA counts to compare (comma list; 0: full width)")
    parser.add_argument("--row-bytes", type=int, default=4160,
                        help="bytes of an SM-pushed row (4160: a fine bench wire row, 2048 bf16 and 16 words)")
    parser.add_argument("--gemm", default="8192,8192,8192", help="M,N,K of the bf16 GEMM beside the transfers")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    set_run_env()
    import torch
    import torch.distributed as dist

    from moe_overlap.distributed.symm import SymmWorkspace
    from moe_overlap.kernels.push_rows import full_width, push_rows

    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120))
    device = torch.device("cuda", rank)
    sizes = [int(v) << 20 for v in args.sizes_mb.split(",")]
    stream_counts = [int(v) for v in args.streams.split(",")]
    ws = SymmWorkspace(dist.group.WORLD, max(sizes), device)
    peer = 1 - dist.get_rank()
    streams = [torch.cuda.Stream(device) for _ in range(max(stream_counts))]
    src = torch.randn(max(sizes) // 2, device=device, dtype=torch.bfloat16)
    m, n, k = (int(v) for v in args.gemm.split(","))
    a, b = (torch.randn(rows, cols, device=device, dtype=torch.bfloat16) for rows, cols in ((m, k), (k, n)))
    row_h = args.row_bytes // 2  # bf16 columns of a pushed row
    bases = torch.tensor([ws.view(r, (1,), torch.uint8).data_ptr() for r in range(2)], device=device,
                         dtype=torch.int64)

    def sm_push(nbytes: int, ctas: int, beside=None, beside_first: bool = False) -> None:
        """The same bytes as whole rows pushed into the peer's buffer by the exchange's kernel on a side stream,
        ``ctas`` programs (0: full width), with ``beside`` on the main stream as in :func:`push`."""
        rows = nbytes // args.row_bytes
        src_RH = src[:rows * row_h].view(rows, row_h)
        count, zero = device_ints[rows], device_ints[0]  # made before: no host-to-device copy in the timed call
        main, stream = torch.cuda.current_stream(), streams[0]
        stream.wait_stream(main)
        if beside is not None and beside_first:
            beside()
        with torch.cuda.stream(stream):
            push_rows(src_RH, zero, count, route_rank[:rows], route_row[:rows], zero, bases, ctas or full_width(device))
        if beside is not None and not beside_first:
            beside()
        main.wait_stream(stream)

    def push(nbytes: int, count: int, beside=None, beside_first: bool = False) -> None:
        """The push over ``count`` copy streams, with ``beside`` (a GEMM) on the main stream meanwhile,
        launched before or after the copies."""
        dest = ws.view(peer, (nbytes // 2,), torch.bfloat16)
        main = torch.cuda.current_stream()
        ready = torch.cuda.Event()
        ready.record(main)
        if beside is not None and beside_first:
            beside()
        for part, stream in zip(range(count), streams):
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                dest.chunk(count)[part].copy_(src[:nbytes // 2].chunk(count)[part], non_blocking=True)
        if beside is not None and not beside_first:
            beside()
        for stream in streams[:count]:
            main.wait_stream(stream)

    def timed(fn) -> float:
        samples = []
        for index in range(args.rounds + 3):
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if index >= 3:
                samples.append(start.elapsed_time(end))
        ms = torch.tensor([statistics.median(samples)], device=device, dtype=torch.float64)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        return float(ms)

    def gemm() -> None:
        torch.mm(a, b)

    rows = []
    gemm_ms = timed(gemm)
    for nbytes in sizes:
        for count in stream_counts:
            for direction in ("one", "both"):
                active = direction == "both" or dist.get_rank() == 0
                ms = timed(lambda: push(nbytes, count) if active else None)
                beside, gemm_first = (timed(lambda: push(nbytes, count, gemm, first) if active else gemm())
                                      for first in (False, True))
                rows.append({"mib": nbytes >> 20, "streams": count, "direction": direction, "push_ms": ms,
                             "gb_per_s": nbytes / ms / 1e6, "gemm_ms": gemm_ms, "push_beside_gemm_ms": beside,
                             "hidden_fraction": max(0.0, min(1.0, (ms + gemm_ms - beside) / ms)),
                             "gemm_launched_first_ms": gemm_first,
                             "hidden_fraction_gemm_first": max(0.0, min(1.0, (ms + gemm_ms - gemm_first) / ms))})
    route_rank = torch.full((max(sizes) // args.row_bytes,), peer, device=device, dtype=torch.int32)
    route_row = torch.arange(route_rank.numel(), device=device, dtype=torch.int32)
    device_ints = {v: torch.tensor([v], device=device) for v in [0] + [size // args.row_bytes for size in sizes]}
    for nbytes in sizes if args.sm_push_ctas else ():
        for ctas in (int(v) for v in args.sm_push_ctas.split(",")):
            ms = timed(lambda: sm_push(nbytes, ctas))
            beside, gemm_first = (timed(lambda: sm_push(nbytes, ctas, gemm, first)) for first in (False, True))
            rows.append({"mib": nbytes >> 20, "streams": f"sm_push:{ctas or full_width(device)}", "direction": "both",
                         "push_ms": ms, "gb_per_s": nbytes / ms / 1e6, "gemm_ms": gemm_ms,
                         "push_beside_gemm_ms": beside,
                         "hidden_fraction": max(0.0, min(1.0, (ms + gemm_ms - beside) / ms)),
                         "gemm_launched_first_ms": gemm_first,
                         "hidden_fraction_gemm_first": max(0.0, min(1.0, (ms + gemm_ms - gemm_first) / ms))})
    if dist.get_rank() == 0:
        print(f"{'MiB':>5}{'streams':>13}{'dir':>6}{'push ms':>9}{'GB/s':>8}{'gemm':>8}{'beside':>8}{'hidden':>8}"
              f"{'gemm 1st':>9}{'hidden':>8}")
        for r in rows:
            print(f"{r['mib']:>5}{r['streams']!s:>13}{r['direction']:>6}{r['push_ms']:>9.3f}{r['gb_per_s']:>8.0f}"
                  f"{r['gemm_ms']:>8.3f}{r['push_beside_gemm_ms']:>8.3f}{r['hidden_fraction']:>8.2f}"
                  f"{r['gemm_launched_first_ms']:>9.3f}{r['hidden_fraction_gemm_first']:>8.2f}")
        write_json(args.json, run_header(dist.get_world_size()), rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
