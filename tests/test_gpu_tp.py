"""The TP ring's copy-engine transport over every GPU (`pytest -m gpu`; TP = 2, 4 or 8, skipped on one GPU):
pipelined and bulk, in bf16, against the serial NCCL path and the p2p ring; many rounds of changing shapes (flow
control, workspace growth).

Launched once under torchrun; the per-rank work is `gpu_cases` below.
"""

from __future__ import annotations

import sys
import traceback

import pytest
import torch

from tests.gpu_launch import init_worker, launch_ranks, ranks_for_every_gpu, require_gpus, write_report

ROWS, K, N = 1024, 512, 768  # rows per rank; the GEMM's inner and outer sizes
SPLITS = (1, 2, 4)
BF16_REL = 1e-2  # a bf16 GEMM's rounding, summed in another order


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def gpu_cases(out_dir: str) -> dict:
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import GroupHandle
    from moe_overlap.distributed.ring import P2PTransport, SymmRingTransport, TPComm, TPOverlap

    device = init_worker()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = GroupHandle(ranks=list(range(world)), group=dist.group.WORLD, rank=rank, size=world)
    report = {"rank": rank, "errors": [], "cases": {}}
    symm = SymmRingTransport(group, device, max_steps=(world - 1) * max(SPLITS),
                             timeout_ms=20_000)  # a stuck signal fails in 20 s
    comms = {"symm": symm, "p2p": P2PTransport(group)}
    g = torch.Generator(device="cuda").manual_seed(rank)
    for splits in SPLITS:
        for name, transport in comms.items():
            try:
                comm = TPComm(group, sequence_parallel=True, overlap=TPOverlap(num_splits=splits), transport=transport)
                x_RK = torch.randn(ROWS, K, device=device, dtype=torch.bfloat16, generator=g)
                w_KN = torch.randn(K, N, device=device, dtype=torch.bfloat16, generator=g) / K ** 0.5
                a_SK = torch.randn(world * ROWS, K, device=device, dtype=torch.bfloat16, generator=g)
                serial_y, serial_x = comm.gather_matmul(x_RK, w_KN, overlap=False, keep_gathered=True)
                ring_y, ring_x = comm.gather_matmul(x_RK, w_KN, overlap=True, keep_gathered=True)
                serial_rs = comm.matmul_scatter(a_SK, w_KN, overlap=False)
                ring_rs = comm.matmul_scatter(a_SK, w_KN, overlap=True)
                report["cases"][f"{name}:splits{splits}"] = {
                    "ag_gemm": rel(ring_y, serial_y), "ag_gathered_exact": bool(torch.equal(ring_x, serial_x)),
                    "rs_gemm": rel(ring_rs, serial_rs)}
            except Exception:
                report["errors"].append(f"{name}:splits{splits}: {traceback.format_exc()}"[-3000:])
            torch.cuda.synchronize()
            write_report(out_dir, report)  # progress, in case a later case takes the process down
    for name, case in (("bulk", bulk_case), ("many_rounds", many_rounds_case)):
        try:
            report[name] = case(symm, group, device, g)
        except Exception:
            report["errors"].append(traceback.format_exc()[-3000:])
        torch.cuda.synchronize()
        write_report(out_dir, report)
    report["multicast_ptrs"] = [int(getattr(regions.workspace.handle, "multicast_ptr", 0) or 0)
                                for regions in symm.retired + [symm.regions] if regions is not None]
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return report


def bulk_case(symm, group, device, g) -> dict:
    """Two bulk collectives in flight at once beside a GEMM (as tp_comm_bulk_dgrad and _wgrad run), waited
    in order and out of order; against NCCL's."""
    from moe_overlap.distributed.ring import gather_rows, scatter_rows

    x_RK = torch.randn(ROWS, K, device=device, dtype=torch.bfloat16, generator=g)
    y_SK = torch.randn(group.size * ROWS, K, device=device, dtype=torch.bfloat16, generator=g)
    gathered, scattered = symm.start_all_gather(x_RK), symm.start_reduce_scatter(y_SK)
    busy = torch.mm(y_SK, y_SK.t())  # the GEMM the collectives run under
    out = {"all_gather_exact": bool(torch.equal(gathered.wait(), gather_rows(x_RK, group))),
           "reduce_scatter": rel(scattered.wait(), scatter_rows(y_SK, group))}
    first, second = symm.start_all_gather(x_RK), symm.start_reduce_scatter(y_SK)  # waited out of order
    out["out_of_order"] = rel(second.wait(), scatter_rows(y_SK, group)) + rel(first.wait(), gather_rows(x_RK, group))
    del busy
    return out


def many_rounds_case(symm, group, device, g) -> dict:
    """60 rounds, shapes growing then shrinking (the workspace grows twice), every region reused many times."""
    from moe_overlap.distributed.ring import TPComm, TPOverlap

    comm = TPComm(group, sequence_parallel=True, overlap=TPOverlap(num_splits=2), transport=symm)
    worst = 0.0
    for i in range(60):
        rows = (256, 2048, 512)[i % 3] if i > 2 else 128 * (i + 1)
        x_RK = torch.randn(rows, K, device=device, dtype=torch.bfloat16, generator=g)
        w_KN = torch.randn(K, N, device=device, dtype=torch.bfloat16, generator=g) / K ** 0.5
        worst = max(worst, rel(comm.gather_matmul(x_RK, w_KN, overlap=True)[0],
                               comm.gather_matmul(x_RK, w_KN, overlap=False)[0]))
        y_SK = torch.randn(group.size * rows, K, device=device, dtype=torch.bfloat16, generator=g)
        worst = max(worst, rel(comm.start_scatter(y_SK, overlap=True).wait(), comm.scatter(y_SK)))
    torch.cuda.synchronize()
    return {"worst": worst, "workspaces": len(symm.retired) + 1}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    require_gpus(2)
    return launch_ranks(__file__, tmp_path_factory.mktemp("gpu_tp"), timeout_s=300, world=ranks_for_every_gpu())


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["symm", "p2p"])
@pytest.mark.parametrize("splits", SPLITS)
def test_pipelined_ring_equals_serial_in_bf16(reports, transport, splits):
    for report in reports:
        assert not report["errors"], report["errors"]
        case = report["cases"][f"{transport}:splits{splits}"]
        assert case["ag_gathered_exact"], case  # the gathered rows are moved, never computed
        assert case["ag_gemm"] < BF16_REL and case["rs_gemm"] < BF16_REL, case


@pytest.mark.gpu
def test_symm_bulk_collectives_in_flight_together_equal_nccl(reports):
    for report in reports:
        bulk = report["bulk"]
        assert bulk["all_gather_exact"] and bulk["reduce_scatter"] < BF16_REL, bulk
        assert bulk["out_of_order"] < BF16_REL, bulk


@pytest.mark.gpu
def test_symm_ring_stays_correct_over_many_rounds_and_growth_without_multicast(reports):
    for report in reports:
        assert report["many_rounds"]["worst"] < BF16_REL, report["many_rounds"]
        assert report["many_rounds"]["workspaces"] >= 2  # it did grow
        assert report["multicast_ptrs"] and not any(report["multicast_ptrs"]), report["multicast_ptrs"]


if __name__ == "__main__":  # one rank under torchrun (PYTHONPATH = the repository)
    write_report(sys.argv[1], gpu_cases(sys.argv[1]))
