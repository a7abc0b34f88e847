"""The MoE pipeline on every GPU of the machine (`pytest -m gpu`; one rank per GPU: 1, 2, 4 or 8): each planning
mode and transport in bf16 against the serial path (the bf16 rule: each output and gradient's error against an
fp32 run at most 2x the serial bf16 path's), CUDA-graph replay of the chunked device-planned pipeline, no host
sync in it (torch.cuda.set_sync_debug_mode("error")) and at most one in the host-planned one, no NVLink multicast;
the overflow chunk taking the rows past a bound (token copies and wire rows) against the unbounded call, eager and
replayed.

On one GPU (EP=1) the layer runs its local path; the pipeline is run there too, forced over the one-rank group
(nccl: the group's copy; copy_engine and sm_push: regions in the GPU's own memory, the same kernels and streams
as between GPUs). Tests named ``with_peers`` need 2 GPUs or more (the NCCL capture refusal, symmetric memory's
multicast) and are skipped on one. Every rank holds 4 experts (8 on one GPU), so that up to 4 chunks of local
experts run at any GPU count. Launched once under torchrun; the per-rank work is ``gpu_cases`` below.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
import warnings

import pytest
import torch

from tests.gpu_launch import init_worker, launch_ranks, ranks_for_every_gpu, require_gpus, write_report

T, H, F, K = 512, 512, 256, 2  # tokens per rank, hidden, expert FFN, top-k
# (planning, transport, chunks, capacity factor or None, padded, delay_wgrad, shared expert overlap, carve-out SMs)
VARIANTS = [
    ("host", "nccl", 1, None, False, False, False, 0), ("host", "nccl", 4, None, False, True, False, 8),
    ("host", "copy_engine", 4, None, False, True, True, 0), ("host", "copy_engine", 2, 1.5, True, False, False, 0),
    ("host", "nccl", 2, 1.5, False, True, False, 0),
    ("device", "sm_push", 1, None, False, False, False, 0), ("device", "sm_push", 4, None, False, True, True, 8),
    ("device", "sm_push", 2, 1.5, True, False, False, 16), ("device", "sm_push", 2, 1.5, False, True, False, 8),
    ("device", "sm_push", 4, None, False, False, False, "auto"),
    ("device", "sm_push", 1, None, False, True, False, "auto"),  # one chunk: the transfer back beside the wgrad
]

_SELECTORS: dict = {}


def make_layer(mesh, dtype, variant=None, capacity=None, padded=False, shared=False, once=False,
               dispatch_dtype="bf16", slices=1, bound=None, overflow=None, skew=False):
    """The serial reference (the local path at EP=1) without a variant, routing like ``capacity``, ``padded`` and
    ``shared``; else the pipeline, forced at EP=1 (``once``, ``dispatch_dtype``: its wire rows, and their dtype;
    ``slices``: overlap.moe_token_slices; ``bound``, ``overflow``: moe_expert_rank_capacity_factor and
    moe_overflow_capacity_factor). ``skew``: the router's expert bias sends every token to experts 0 to K - 1."""
    from moe_overlap.config import ModelConfig, OverlapConfig
    from moe_overlap.distributed.a2a import TransportSelector
    from moe_overlap.layers.init import init_parameters
    from moe_overlap.layers.moe import MoELayer

    num_experts = max(8, 4 * mesh.ep.size)  # 4 per rank: room for 4 chunks
    overlap = OverlapConfig(moe_pipeline=False)
    if variant is not None:
        planning, transport, chunks, capacity, padded, delay, shared, sms = variant
        overlap = OverlapConfig(moe_pipeline=True, moe_dispatch_once_per_rank=once, moe_pipeline_chunks=chunks,
                                delay_wgrad_compute=delay, moe_dispatch_dtype=dispatch_dtype,
                                moe_planning=planning, moe_transport=transport, gemm_sm_carveout=sms,
                                moe_token_slices=slices, moe_expert_rank_capacity_factor=bound,
                                moe_overflow_capacity_factor=overflow)  # no trainer here runs an overflow again
        # One selector per transport for the whole run, as a model shares one: freeing a symmetric workspace
        # while a CUDA graph is being captured is illegal.
        if (planning, transport) not in _SELECTORS:
            _SELECTORS[planning, transport] = TransportSelector(planning, transport, mesh.ep.group, mesh.ep.ranks,
                                                                torch.device("cuda"), num_experts // mesh.ep.size, 60)
    cfg = ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=num_experts, moe_router_topk=K,
                      moe_expert_capacity_factor=capacity, moe_pad_expert_input_to_capacity=padded,
                      moe_shared_expert_intermediate_size=128, moe_shared_expert_overlap=shared and variant is not None,
                      moe_router_enable_expert_bias=skew, moe_router_score_function="sigmoid" if skew else "softmax")
    layer = MoELayer(cfg, overlap, mesh.ep, _SELECTORS[variant[:2]] if variant else None, "cuda", dtype)
    if variant is not None:
        layer.local = False  # EP=1: the pipeline over the one-rank group instead of the local path
    init_parameters(layer, seed=5, std=0.05, num_layers=1)
    if skew:
        with torch.no_grad():
            layer.router.expert_bias[:K] = 1.0  # above any sigmoid score: every token's top-k
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

    init_worker()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = Mesh.create(MeshLayout(world, ep=world), timeout_s=60) if world > 1 else Mesh.single()
    g = torch.Generator(device="cuda").manual_seed(rank)
    x32 = torch.randn(1, T, H, device="cuda", generator=g)
    grad32 = torch.randn(1, T, H, device="cuda", generator=g)
    report = {"rank": rank, "world": world, "equivalence": {}, "violations": [], "errors": [],
              "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                     "NVSHMEM_DISABLE_NVLS")}}
    for variant in VARIANTS:
        try:
            equivalence_case(mesh, variant, x32, grad32, report)
        except Exception:  # one GPU call should report every case
            report["errors"].append(f"{variant}: {traceback.format_exc()}"[-3000:])
    write_report(out_dir, report)  # progress, in case a later case takes the process down
    x, grad = x32.bfloat16(), grad32.bfloat16()
    cases = [(sync_case, ("host", "nccl")), (sync_case, ("device", "sm_push")), (graph_case, (0,)),
             (graph_case, (8,)), (local_case, ()), (fp8_wire_case, ()), (slices_case, ()), (overflow_case, ())]
    if world > 1:  # nccl last: its refused capture is the one case that may leave the process in a poor state
        cases += [(multicast_case, ()), (nccl_capture_case, ())]
    for case, args in cases:
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
    name = ":".join(str(v) for v in variant)
    routing = dict(capacity=variant[3], padded=variant[4], shared=variant[6])  # the reference routes the same way
    ref = run_layer(make_layer(mesh, torch.float32, **routing), x32, grad32)
    serial = run_layer(make_layer(mesh, torch.bfloat16, **routing), x32.bfloat16(), grad32.bfloat16())
    piped = run_layer(make_layer(mesh, torch.bfloat16, variant), x32.bfloat16(), grad32.bfloat16())
    errs = [(rel(p, r), rel(s, r)) for p, s, r in zip(piped, serial, ref)]
    report["equivalence"][name] = max(p for p, _ in errs)
    report["violations"] += [(name, i, p, s) for i, (p, s) in enumerate(errs) if p > 2 * s + 1e-6]


class _HeldRouting(torch.nn.Module):
    """Stands in for a router: the same routing whatever the input (probs detached)."""

    def __init__(self, routing):
        super().__init__()
        self.routing = routing

    def forward(self, _x_TH):
        return self.routing


def fp8_wire_case(mesh, x, grad, report) -> None:
    """overlap.moe_dispatch_dtype=fp8 equals the bf16 dispatch of the dequantized rows, bit for bit: the layer fed
    x and grad against the same layer fed what crossed (each row quantized by the same kernel, then dequantized),
    the routing held and the shared expert zeroed (it sees the rows as they are). Then both with FP8 GEMMs
    (train.fp8_recipe): the FP8-wire layer feeds the rows as they crossed."""
    import dataclasses

    from tests.test_moe_layer import fp8_values

    def crossed(t):
        return fp8_values(t.reshape(-1, H)).view_as(t)

    from moe_overlap.layers import dispatch_pipeline
    from moe_overlap.layers.fp8 import Fp8, Fp8Rows

    variant = ("device", "sm_push", 1, None, False, False, False, "auto")
    fp8, bf16 = (make_layer(mesh, torch.bfloat16, variant, once=True, dispatch_dtype=d) for d in ("fp8", "bf16"))
    routing = fp8.router(x.reshape(-1, H))
    routing = dataclasses.replace(routing, probs_TK=routing.probs_TK.detach())
    arrived_rows, fed = dispatch_pipeline.arrived_rows, []

    def arrived(*args, **kwargs):  # which rows reached the experts as FP8 (train.fp8_recipe's straight feed)
        rows = arrived_rows(*args, **kwargs)
        fed.append(isinstance(rows.x_WH, Fp8Rows))
        return rows

    for recipe in (None, Fp8()):  # bf16 GEMMs, then the FP8 ones (fed the rows as they crossed)
        results = []
        for layer, x_in, grad_in in ((fp8, x, grad), (bf16, crossed(x), crossed(grad))):
            layer.router = _HeldRouting(routing)
            layer.experts.fp8 = recipe
            layer.zero_grad()
            with torch.no_grad():
                for param in layer.shared_expert.parameters():
                    param.zero_()
            x_in = x_in.clone().requires_grad_(True)
            dispatch_pipeline.arrived_rows = arrived
            try:
                out = layer(x_in)[0]
                out.backward(grad_in)
            finally:
                dispatch_pipeline.arrived_rows = arrived_rows
            results.append([out, x_in.grad, layer.experts.w13.grad, layer.experts.w2.grad])
        key = "fp8_wire" if recipe is None else "fp8_feed"
        report[f"{key}_equal"] = [bool(torch.equal(a, b)) for a, b in zip(*results)]
        report[f"{key}_rel"] = [rel(a.float(), b.float()) for a, b in zip(*results)]
        report[f"{key}_fed_fp8"], fed[:] = list(fed), []
    report["fp8_wire_vs_rows_as_they_are"] = rel(crossed(x).float(), x.float())
    # The FP8-wire layer's expert weight gradients into fp32 main_grad (as under an optimizer: the crossed rows
    # dequantized up to the last offset, then the grouped kernel into main_grad); against the bf16 gradients above
    from moe_overlap.layers.param_info import param_info

    experts = (fp8.experts.w13, fp8.experts.w2)
    for param in experts:
        param_info(param).main_grad = torch.zeros_like(param, dtype=torch.float32)
    fp8.zero_grad()
    x_in = x.clone().requires_grad_(True)
    fp8(x_in)[0].backward(grad)
    report["fp8_feed_main_grad_rel"] = [rel(param_info(param).main_grad, g.float())
                                        for param, g in zip(experts, results[0][2:])]
    for param in experts:
        param_info(param).main_grad = None


def sync_case(mesh, x, grad, report, planning: str, transport: str) -> None:
    """Host-planned (dropless): at most one device-to-host sync per layer call, in the forward; device-planned:
    none at all (an error under set_sync_debug_mode), forward and backward, chunks on a side stream."""
    layer = make_layer(mesh, torch.bfloat16, (planning, transport, 2, None, False, True, True, 8))
    if planning == "device":
        report["device_nosync"] = runs_without_host_sync(layer, x, grad)
        return
    run_layer(layer, x, grad)  # sizes the regions
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        out = layer(x.clone().requires_grad_(True))[0]
        forward_syncs = sum("synchroniz" in str(w.message) for w in caught)
        out.backward(grad)
        torch.cuda.set_sync_debug_mode("default")
    report["host_syncs_forward"] = forward_syncs
    report["host_syncs_total"] = sum("synchroniz" in str(w.message) for w in caught)


def runs_without_host_sync(layer, x, grad) -> bool:
    """A forward+backward after a first one (which sizes the regions) raises on any host sync."""
    run_layer(layer, x, grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_layer(layer, x, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return True


def local_case(mesh, x, grad, report) -> None:
    """EP=1's local path (what training runs on one GPU): no host sync either."""
    if mesh.ep.size == 1:
        report["local_nosync"] = runs_without_host_sync(make_layer(mesh, torch.bfloat16), x, grad)


def replayed_error(graph_layer, eager: list, x, grad) -> float:
    """``graph_layer`` captured as training captures it and replayed twice, each from zeroed gradients: the largest
    relative error of its output and gradients against the eager run's."""
    from moe_overlap.layers.moe import capture_moe_layers

    gc.collect()
    capture_moe_layers((graph_layer,), tuple(x.shape))
    for _ in range(2):
        graph_layer.zero_grad(set_to_none=True)
        replayed = run_layer(graph_layer, x, grad)
    torch.cuda.synchronize()
    return max(rel(r, e) for r, e in zip(replayed, eager))


def graph_case(mesh, x, grad, report, sms: int) -> None:
    """The chunked device-planned pipeline (4 chunks, deferred wgrad, shared expert in the gap; with a carve-out
    its pushes on a side stream) captured as training captures it, replayed, against eager."""
    variant = ("device", "sm_push", 4, None, False, True, True, sms)
    eager_layer, graph_layer = make_layer(mesh, torch.bfloat16, variant), make_layer(mesh, torch.bfloat16, variant)
    graph_layer.load_state_dict(eager_layer.state_dict())
    eager = run_layer(eager_layer, x, grad)
    report[f"graph_sms{sms}_err"] = replayed_error(graph_layer, eager, x, grad)


def slices_case(mesh, x, grad, report) -> None:
    """overlap.moe_token_slices=2 on the default path (one device-planned chunk, each token once per rank, delayed
    weight gradients, the shared expert beside the combine, carve-out auto): eager against the serial path under the
    bf16 rule, and replayed from a CUDA graph against eager."""
    variant = ("device", "sm_push", 1, None, False, True, True, "auto")
    ref = run_layer(make_layer(mesh, torch.float32, shared=True), x.float(), grad.float())
    serial = run_layer(make_layer(mesh, torch.bfloat16, shared=True), x, grad)
    eager_layer = make_layer(mesh, torch.bfloat16, variant, once=True, slices=2)
    graph_layer = make_layer(mesh, torch.bfloat16, variant, once=True, slices=2)
    graph_layer.load_state_dict(eager_layer.state_dict())
    eager = run_layer(eager_layer, x, grad)
    errs = [(rel(e, r), rel(s, r)) for e, s, r in zip(eager, serial, ref)]
    report["slices_err"] = max(e for e, _ in errs)
    report["slices_violations"] = [(i, e, s) for i, (e, s) in enumerate(errs) if e > 2 * s + 1e-6]
    report["slices_graph_err"] = replayed_error(graph_layer, eager, x, grad)


def overflow_case(mesh, x, grad, report) -> None:
    """The bounded device-planned pipeline past its bound: factor 1.0, every token routed to experts 0 and 1 (rank
    0's first chunk: EP x its bound), 2 chunks, token copies and wire rows. The overflow chunk (EP x R rows: never
    past) takes every row past the bound inside the call: the call equals the unbounded one within bf16's rounding,
    replays from a CUDA graph, and after a first call runs with no host sync."""
    variant = ("device", "sm_push", 2, None, False, True, False, 8)
    bounded = dict(bound=1.0, overflow=float(mesh.ep.size))
    for once in (False, True):
        unbounded = make_layer(mesh, torch.bfloat16, variant, once=once, skew=True)
        eager_layer, graph_layer = (make_layer(mesh, torch.bfloat16, variant, once=once, skew=True, **bounded)
                                    for _ in range(2))
        for layer in (eager_layer, graph_layer):
            layer.load_state_dict(unbounded.state_dict())
        want = run_layer(unbounded, x, grad)
        selector = _SELECTORS["device", "sm_push"]
        selector.zero_counters()
        eager = run_layer(eager_layer, x, grad)
        overflow, unplaced, _ = selector.counters()
        report[f"overflow_rows_{once}"], report[f"overflow_unplaced_{once}"] = int(overflow), int(unplaced)
        report[f"overflow_err_{once}"] = max(rel(e, w) for e, w in zip(eager, want))
        report[f"overflow_nosync_{once}"] = runs_without_host_sync(eager_layer, x, grad)
        report[f"overflow_graph_err_{once}"] = replayed_error(graph_layer, eager, x, grad)


def multicast_case(mesh, x, grad, report) -> None:
    """Symmetric memory made without an NVLink multicast object (SymmWorkspace refuses one; this reads it)."""
    report["multicast_ptrs"] = [int(getattr(t.regions.workspace.handle, "multicast_ptr", 0) or 0)
                                for t in (s._transport for s in _SELECTORS.values()) if hasattr(t, "regions")]


def nccl_capture_case(mesh, x, grad, report) -> None:
    """A host-planned NCCL pipeline cannot be captured: the layer says so (padded capacity: no host sync before)."""
    layer = make_layer(mesh, torch.bfloat16, ("host", "nccl", 2, 1.5, True, False, False, 0))
    static_x = x.clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(static_x)[0].backward(grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            layer(static_x)
    except RuntimeError as err:
        report["nccl_capture_refusal"] = str(err)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """Every case runs in one torchrun launch; each test below reads its part of the ranks' reports."""
    return launch_ranks(__file__, tmp_path_factory.mktemp("gpu_moe"), timeout_s=180, world=ranks_for_every_gpu())


def _errors(report: dict, prefix: str) -> list[str]:
    return [e for e in report["errors"] if e.startswith(prefix)]


@pytest.mark.gpu
def test_every_planning_and_transport_equals_serial_in_bf16(reports):
    for report in reports:
        assert len(report["equivalence"]) == len(VARIANTS), _errors(report, "(")
        assert not report["violations"], report["violations"]


@pytest.mark.gpu
def test_device_planned_pipeline_never_syncs_and_host_planned_once(reports):
    for report in reports:
        assert not _errors(report, "sync_case"), _errors(report, "sync_case")
        assert report["device_nosync"]
        assert report["host_syncs_forward"] <= 1 and report["host_syncs_total"] <= 1


@pytest.mark.gpu
def test_local_path_never_syncs_on_one_gpu(reports):
    for report in reports:
        if report["world"] == 1:
            assert not _errors(report, "local_case"), _errors(report, "local_case")
            assert report["local_nosync"]


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [0, 8])
def test_chunked_device_planned_pipeline_replays_from_a_cuda_graph(reports, sms):
    for report in reports:
        assert not _errors(report, f"graph_case(({sms},)"), _errors(report, "graph_case")
        assert report[f"graph_sms{sms}_err"] < 1e-2


@pytest.mark.gpu
def test_fp8_dispatch_equals_bf16_dispatch_of_the_dequantized_rows(reports):
    for report in reports:
        assert not _errors(report, "fp8_wire_case"), _errors(report, "fp8_wire_case")
        assert all(report["fp8_wire_equal"]), report["fp8_wire_rel"]  # out, x grad, w13 grad, w2 grad
        assert 0 < report["fp8_wire_vs_rows_as_they_are"] < 0.05  # the rows did cross as FP8


@pytest.mark.gpu
def test_fp8_dispatch_feeds_the_fp8_gemms_the_rows_as_they_crossed(reports):
    """Under train.fp8_recipe the FP8 dispatch's rows reach the first expert GEMM as their E4M3 bytes and scales
    (the FP8-wire layer's arrivals; the bf16-wire layer's are bf16); against the bf16 dispatch of the dequantized
    rows, whose GEMM quantizes them again (the same bytes, scales off by bf16's rounding), within 1e-2."""
    for report in reports:
        assert not _errors(report, "fp8_wire_case"), _errors(report, "fp8_wire_case")
        fed = report["fp8_feed_fed_fp8"]
        assert fed and any(fed) and not all(fed), fed  # the FP8-wire layer's chunks only
        assert not any(report["fp8_wire_fed_fp8"]), report["fp8_wire_fed_fp8"]  # bf16 GEMMs: dequantized on arrival
        assert max(report["fp8_feed_rel"]) < 1e-2, report["fp8_feed_rel"]


@pytest.mark.gpu
def test_fp8_dispatch_rows_reach_the_weight_gradient_kernel_as_they_crossed(reports):
    """The FP8-wire layer's expert weight gradients accumulated into fp32 main_grad (the crossed rows dequantized,
    then our grouped kernel) against its bf16 gradients without main_grad (torch's grouped GEMM), within bf16's
    rounding of the latter."""
    for report in reports:
        assert not _errors(report, "fp8_wire_case"), _errors(report, "fp8_wire_case")
        assert max(report["fp8_feed_main_grad_rel"]) < 1e-2, report["fp8_feed_main_grad_rel"]


@pytest.mark.gpu
def test_token_slices_equal_serial_in_bf16_and_replay_from_a_cuda_graph(reports):
    for report in reports:
        assert not _errors(report, "slices_case"), _errors(report, "slices_case")
        assert not report["slices_violations"], report["slices_violations"]
        assert report["slices_graph_err"] < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("once", [False, True], ids=["copies", "wire_rows"])
def test_overflow_chunk_takes_the_rows_past_the_bound_in_bf16_and_in_a_cuda_graph(reports, once):
    assert sum(report[f"overflow_rows_{once}"] for report in reports) > 0  # rank 0's first chunk overflowed
    for report in reports:
        assert not _errors(report, "overflow_case"), _errors(report, "overflow_case")
        assert report[f"overflow_unplaced_{once}"] == 0 and report[f"overflow_nosync_{once}"]
        assert report[f"overflow_err_{once}"] < 1e-2 and report[f"overflow_graph_err_{once}"] < 1e-2, report


@pytest.mark.gpu
def test_no_multicast(reports):
    for report in reports:
        assert report["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                 "NVSHMEM_DISABLE_NVLS": "1"}
        assert not any(report.get("multicast_ptrs", [])), report.get("multicast_ptrs")


@pytest.mark.gpu
def test_with_peers_graph_capture_of_nccl_is_refused_clearly(reports):
    require_gpus(2)  # one GPU's host-planned pipeline makes no NCCL call
    for report in reports:
        assert "moe_planning=device" in report["nccl_capture_refusal"]


@pytest.mark.gpu
def test_with_peers_symmetric_memory_is_checked_for_multicast(reports):
    require_gpus(2)  # one GPU's regions are its own memory
    for report in reports:
        assert report["multicast_ptrs"] and not any(report["multicast_ptrs"])


if __name__ == "__main__":  # one rank under torchrun (PYTHONPATH = the repository)
    gpu_cases(sys.argv[1])
