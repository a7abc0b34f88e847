"""The overlapped EP pipeline and the sync-free dispatch on 2 GPUs (`pytest -m gpu`): nccl and symm
transports in bf16 against the serial path (DESIGN.md's bf16 rule), host syncs per layer, and CUDA-graph
capture in capacity mode and of the sync-free dropless layer.

Launched once under torchrun; the per-rank work is `gpu_cases` below.
"""

from __future__ import annotations

import gc
import sys
import traceback
import warnings

import pytest
import torch

from tests.gpu_launch import REPO, launch_two_ranks, write_report
T, H, F, E, K = 512, 512, 256, 8, 2
VARIANTS = [  # (backend, chunks, capacity factor or None, delay_wgrad, shared expert overlap)
    ("nccl", 1, None, False, False), ("nccl", 4, None, True, False), ("symm", 1, None, False, False),
    ("symm", 4, None, True, True), ("symm", 2, 1.5, False, False), ("nccl", 2, 1.5, True, False),
    ("sync_free", 1, None, False, False),  # dropless, SM pushes over symm
]


_SELECTORS: dict = {}


def make_layer(mesh, dtype, backend=None, chunks=1, capacity=None, delay=False, shared=False):
    from moe_overlap.config import ModelConfig, OverlapConfig
    from moe_overlap.distributed.a2a import TransportSelector
    from moe_overlap.layers.init import init_parameters
    from moe_overlap.layers.moe import MoELayer

    cfg = ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=K,
                      moe_expert_capacity_factor=capacity, moe_pad_expert_input_to_capacity=capacity is not None,
                      moe_shared_expert_intermediate_size=128, moe_shared_expert_overlap=shared)
    sync_free = backend == "sync_free"
    backend = "symm" if sync_free else backend
    overlap = OverlapConfig(moe_overlap_dispatch=backend is not None and not sync_free, moe_a2a_chunks=chunks,
                            delay_wgrad_compute=delay, moe_a2a_backend=backend or "auto",
                            moe_sync_free_dispatch=sync_free)
    # One selector per backend for the whole run, as a model shares one: freeing a symmetric workspace
    # while a CUDA graph is being captured is illegal.
    if backend and backend not in _SELECTORS:
        _SELECTORS[backend] = TransportSelector(backend, mesh.ep.group, mesh.ep.ranks, torch.device("cuda"), 4, 60)
    selector = _SELECTORS.get(backend)
    layer = MoELayer(cfg, overlap, mesh.ep, selector, "cuda", dtype)
    init_parameters(layer, seed=5, std=0.05, num_layers=1)
    return layer


def run_layer(layer, x, grad):
    x = x.clone().requires_grad_(True)
    out = layer(x)[0]
    out.backward(grad)
    return [out.float(), x.grad.float()] + [p.grad.float() for p in layer.parameters()]


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def gpu_cases(out_dir: str) -> dict:
    import torch.distributed as dist

    from moe_overlap.distributed.mesh import Mesh, MeshLayout

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    mesh = Mesh.create(MeshLayout(2, ep=2), timeout_s=60)
    g = torch.Generator(device="cuda").manual_seed(rank)
    x32 = torch.randn(1, T, H, device="cuda", generator=g)
    grad32 = torch.randn(1, T, H, device="cuda", generator=g)
    report = {"rank": rank, "equivalence": {}, "violations": [], "errors": []}
    for variant in VARIANTS:
        try:
            equivalence_case(mesh, variant, x32, grad32, report)
        except Exception:  # one GPU call should report every case
            report["errors"].append(f"{variant}: {traceback.format_exc()}"[-3000:])
    write_report(out_dir, report)  # progress, in case a later case takes the process down
    x, grad = x32.bfloat16(), grad32.bfloat16()
    # nccl last: its refused capture is the one case that may leave the process in a poor state
    for case, args in ((sync_case, ()), (graph_case, ("symm", "capacity")), (graph_case, ("sync_free", "sync_free")),
                       (graph_case, ("nccl", "capacity"))):
        try:
            case(mesh, x, grad, report, *args)
        except Exception:
            torch.cuda.set_sync_debug_mode("default")
            report["errors"].append(f"{case.__name__}{args}: {traceback.format_exc()}"[-4000:])
        write_report(out_dir, report)
    mesh.destroy()
    dist.destroy_process_group()
    write_report(out_dir, report)
    return report


def equivalence_case(mesh, variant, x32, grad32, report) -> None:
    backend, chunks, capacity, delay, shared = variant
    name = f"{backend}:chunks{chunks}:cap{capacity}:delay{int(delay)}:shared{int(shared)}"
    ref = run_layer(make_layer(mesh, torch.float32, None, 1, capacity, False, shared), x32, grad32)
    serial = run_layer(make_layer(mesh, torch.bfloat16, None, 1, capacity, False, shared),
                       x32.bfloat16(), grad32.bfloat16())
    overlapped = run_layer(make_layer(mesh, torch.bfloat16, backend, chunks, capacity, delay, shared),
                           x32.bfloat16(), grad32.bfloat16())
    errs = [(rel(o, r), rel(s, r)) for o, s, r in zip(overlapped, serial, ref)]
    report["equivalence"][name] = max(o for o, _ in errs)
    report["violations"] += [(name, i, o, s) for i, (o, s) in enumerate(errs) if o > 2 * s + 1e-6]


def sync_case(mesh, x, grad, report) -> None:
    """Dropless: at most one device-to-host sync per layer call (forward), none in the backward."""
    layer = make_layer(mesh, torch.bfloat16, "symm", 2)
    run_layer(layer, x, grad)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        out = layer(x.clone().requires_grad_(True))[0]
        forward_syncs = sum("synchroniz" in str(w.message) for w in caught)
        out.backward(grad)
        torch.cuda.set_sync_debug_mode("default")
    report["dropless_syncs_forward"] = forward_syncs
    report["dropless_syncs_total"] = sum("synchroniz" in str(w.message) for w in caught)


def graph_case(mesh, x, grad, report, backend: str, mode: str) -> None:
    """Capacity (padded), or dropless with the sync-free dispatch: no sync at all, and forward+backward
    captured in a CUDA graph."""
    layer = (make_layer(mesh, torch.bfloat16, backend, 2, capacity=1.5) if mode == "capacity"
             else make_layer(mesh, torch.bfloat16, backend))
    static_x = x.clone().requires_grad_(True)
    side = torch.cuda.Stream()  # warm-up and the eager reference off the legacy stream, as capture wants
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer.zero_grad(set_to_none=True)
            layer(static_x)[0].backward(grad)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        static_x.grad = None
        eager = layer(static_x)[0]
        eager.backward(grad)
        eager_grad = static_x.grad.clone()
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    report[f"{mode}_nosync_{backend}"] = True
    layer.zero_grad(set_to_none=True)  # gradients the capture allocates itself, from the graph's pool
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    if backend == "nccl":  # ProcessGroupNCCL collectives do not replay from a graph: the layer says so
        try:
            with torch.cuda.graph(graph):
                layer(static_x)
        except RuntimeError as err:
            report["capacity_graph_nccl_refusal"] = str(err)
        return
    # thread_local: NCCL's watchdog thread queries events while we capture, which the default "global" mode
    # counts as an illegal call from another thread (the layer itself launches no NCCL work here).
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = layer(static_x)[0]
        captured.backward(grad)
    graph.replay()
    torch.cuda.synchronize()
    report[f"{mode}_graph_{backend}_err"] = rel(captured.float(), eager.float())
    report[f"{mode}_graph_{backend}_grad_err"] = rel(static_x.grad.float(), eager_grad.float())


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """Every case runs in one torchrun launch; each test below reads its part of the ranks' reports."""
    return launch_two_ranks(__file__, tmp_path_factory.mktemp("gpu_moe"), timeout_s=400)


def _errors(report: dict, prefix: str) -> list[str]:
    return [e for e in report["errors"] if e.startswith(prefix)]


@pytest.mark.gpu
def test_overlapped_equals_serial_in_bf16_for_nccl_and_symm(reports):
    for report in reports:
        assert len(report["equivalence"]) == len(VARIANTS), _errors(report, "(")
        assert not report["violations"], report["violations"]


@pytest.mark.gpu
def test_dropless_layer_syncs_with_the_host_at_most_once(reports):
    for report in reports:
        assert not _errors(report, "sync_case"), _errors(report, "sync_case")
        assert report["dropless_syncs_forward"] <= 1 and report["dropless_syncs_total"] <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "symm"])
def test_capacity_mode_never_syncs(reports, backend):
    assert all(report.get(f"capacity_nosync_{backend}") for report in reports)


@pytest.mark.gpu
def test_capacity_mode_forward_backward_replays_from_a_cuda_graph_with_symm(reports):
    for report in reports:
        assert not _errors(report, "graph_case('symm'"), _errors(report, "graph_case('symm'")
        assert report["capacity_graph_symm_err"] < 1e-2


@pytest.mark.gpu
def test_sync_free_dispatch_never_syncs_and_replays_from_a_cuda_graph(reports):
    for report in reports:
        assert not _errors(report, "graph_case('sync_free'"), _errors(report, "graph_case('sync_free'")
        assert report["sync_free_nosync_sync_free"]
        assert report["sync_free_graph_sync_free_err"] < 1e-2
        assert report["sync_free_graph_sync_free_grad_err"] < 1e-2


@pytest.mark.gpu
def test_graph_capture_with_nccl_is_refused_clearly(reports):
    for report in reports:
        assert "moe_a2a_backend='symm'" in report["capacity_graph_nccl_refusal"]


if __name__ == "__main__":  # one rank under torchrun
    sys.path.insert(0, str(REPO))
    gpu_cases(sys.argv[1])
