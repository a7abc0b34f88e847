"""The SM push's column blocks, bytes in flight and CTAs over NVLink, both ranks pushing into each other at once
(as the exchange does), against the copy engines moving the same bytes: how close the push kernel
(kernels/push_rows.py) comes to the link.

    torchrun --nproc-per-node 2 benchmarks/push_tiling.py --json benchmarks/results/push_tiling_2xh200.json

Row kinds, each ``--mib`` MiB a rank: ``wire`` the fine bench model's wire rows as the dispatch pushes them (2,048
columns gathered from their tokens' rows, then 32 of the row's own), ``rows2048`` hidden-wide rows (the combine's),
``rows2080`` whole wire rows from one buffer. ``block``: the columns of a whole block (``rule``: the kernel's own
choice; 4,096 on rows2080 is the one block half past the row's end that every push used before 2026-12-01).
Every variant round-robin, the slowest rank's median; each row kind's landed rows checked against the sender's.
CUDA only.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import round_robin, run_header, set_run_env, write_json  # noqa: E402

KINDS = {"wire": (2048, 32), "rows2048": (0, 2048), "rows2080": (0, 2080)}  # (gathered columns, own columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="32,128", help="MiB a rank pushes (comma list)")
    parser.add_argument("--blocks", default="rule,4096,1024,512", help="whole-block columns (comma list; rule)")
    parser.add_argument("--in-flight", default="32768,65536", help="bytes a program loads a step (comma list)")
    parser.add_argument("--ctas", default="0,132,64,32", help="push programs (comma list; 0: full width)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    set_run_env()
    import torch
    import torch.distributed as dist

    from moe_overlap.distributed.symm import SymmWorkspace
    from moe_overlap.kernels.push_rows import full_width, push_rows, whole_rows

    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120))
    device = torch.device("cuda", rank)
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    sizes = [int(v) << 20 for v in args.mib.split(",")]
    ws = SymmWorkspace(dist.group.WORLD, max(sizes), device)
    bases = torch.tensor([ws.view(r, (1,), torch.uint8).data_ptr() for r in range(2)], device=device,
                         dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64, device=device)

    def rows_of(kind: str, nbytes: int, owner: int):
        """``owner``'s rows of ``kind`` (made the same way on both ranks, so either can check the other's)."""
        gathered, own = KINDS[kind]
        rows = nbytes // ((gathered + own) * 2)
        g = torch.Generator(device=device).manual_seed(1000 * owner + rows)
        src = torch.randn(rows, own, device=device, generator=g).to(torch.bfloat16)
        if not gathered:
            return src, None
        tokens = rows // 2  # a token's row read by two wire rows, as with top-8 at EP=2
        return src, (torch.randn(tokens, gathered, device=device, generator=g).to(torch.bfloat16),
                     torch.randint(0, tokens, (rows,), device=device, dtype=torch.int32, generator=g))

    results = []
    for nbytes in sizes:
        variants = {}
        for kind in KINDS:
            src, gather = rows_of(kind, nbytes, me)
            rows = src.shape[0]
            count = torch.tensor([rows], device=device)
            to_peer = torch.full((rows,), peer, device=device, dtype=torch.int32)
            at_row = torch.arange(rows, device=device)
            for block in args.blocks.split(","):
                for in_flight in (int(v) for v in args.in_flight.split(",")):
                    for ctas in (int(v) or full_width(device) for v in args.ctas.split(",")):
                        def push(src=src, gather=gather, count=count, to_peer=to_peer, at_row=at_row, ctas=ctas,
                                 in_flight=in_flight, block=None if block == "rule" else int(block)):
                            push_rows(src, zero, count, to_peer, at_row, zero, bases, ctas, gather=gather,
                                      in_flight=in_flight, block=block)
                        variants[f"{kind}/block_{block}/{in_flight // 1024}k/ctas_{ctas}"] = push
            push_rows(src, zero, count, to_peer, at_row, zero, bases, gather=gather)  # checked: the default tiling
            torch.cuda.synchronize()
            dist.barrier()
            want_src, want_gather = rows_of(kind, nbytes, peer)
            landed = ws.view(me, (rows, src.shape[1] + (gather[0].shape[1] if gather else 0)), torch.bfloat16)
            assert torch.equal(landed, whole_rows(want_src, want_gather)), f"{kind}: the pushed rows landed wrong"
            dist.barrier()
        flat = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
        to_peer_flat = ws.view(peer, (nbytes // 2,), torch.bfloat16)
        variants["copy_engine"] = lambda flat=flat, dest=to_peer_flat: dest.copy_(flat, non_blocking=True)
        ms = round_robin(variants, args.rounds, 3, device)
        for name, value in ms.items():
            results.append({"mib": nbytes >> 20, "variant": name, "ms": value,
                            "gb_per_s_each_way": nbytes / value / 1e6})
        if me == 0:
            for name, value in sorted(ms.items(), key=lambda kv: kv[1]):
                print(f"{nbytes >> 20:>4} MiB  {name:<40} {value:8.4f} ms  {nbytes / value / 1e6:7.1f} GB/s", flush=True)
    if me == 0:
        write_json(args.json, run_header(dist.get_world_size()), results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
