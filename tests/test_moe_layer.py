"""The serial EP MoE layer against a naive dense formula, including skewed routing, on 1, 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from types import SimpleNamespace

from moe_overlap.config import ModelConfig, OverlapConfig
from moe_overlap.distributed.a2a import TransportSelector
from moe_overlap.distributed.mesh import GroupHandle, Mesh, MeshLayout
from moe_overlap.layers.experts import GroupedSwiGLU, expert_offsets, grouped_swiglu_reference
from moe_overlap.layers import moe as moe_module
from moe_overlap.layers.moe import MoELayer
from moe_overlap.layers.mlp import swiglu
from moe_overlap.layers.router import Routing
from tests.rankpool import RankPoolError

H, F, E, TOKENS = 16, 24, 8, 12


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-30))


def test_grouped_swiglu_matches_loop_twin_forward_and_backward():
    torch.manual_seed(0)
    rows = [3, 0, 5, 2]  # an expert with no rows too
    x = torch.randn(sum(rows), H, requires_grad=True)
    w13 = torch.randn(len(rows), H, 2 * F, requires_grad=True)
    w2 = torch.randn(len(rows), F, H, requires_grad=True)
    out = GroupedSwiGLU.apply(x, expert_offsets(torch.tensor(rows)), w13, w2)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w13, w2), grad)
    ref = grouped_swiglu_reference(x, rows, w13, w2)
    ref_grads = torch.autograd.grad(ref, (x, w13, w2), grad)
    assert rel_err(out, ref) < 1e-6
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-6
    assert grads[1][1].abs().max() == 0 and grads[2][1].abs().max() == 0  # the empty expert gets no gradient


def test_grouped_swiglu_with_no_rows_at_all():
    w13 = torch.randn(2, H, 2 * F, requires_grad=True)
    w2 = torch.randn(2, F, H, requires_grad=True)
    x = torch.zeros(0, H, requires_grad=True)
    out = GroupedSwiGLU.apply(x, expert_offsets(torch.zeros(2, dtype=torch.long)), w13, w2)
    out.sum().backward()
    assert out.shape == (0, H) and w13.grad.abs().max() == 0 and w2.grad.abs().max() == 0


# ------------------------------------------------------------------------------------------ helpers


def full_expert_weights(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, H, 2 * F, generator=g) * 0.3, torch.randn(E, F, H, generator=g) * 0.3


def naive_moe(x_TH, probs_TK, experts_TK, w13, w2):
    """Every expert on every token, then pick: the obviously-right formula."""
    h = torch.einsum("th,ehf->etf", x_TH, w13)
    gate, up = h.chunk(2, dim=-1)
    y_ETH = torch.einsum("etf,efh->eth", torch.nn.functional.silu(gate) * up, w2)
    picked = y_ETH[experts_TK, torch.arange(x_TH.shape[0]).unsqueeze(1)]  # (T, K, H)
    return (probs_TK.unsqueeze(-1) * picked).sum(1)


class FixedRouter(torch.nn.Module):
    """Stands in for the router so a test can dictate where every token goes (and, with a capacity,
    which copies are dropped: the later ones, Megatron's "position" policy)."""

    def __init__(self, probs_TK: torch.Tensor, experts_TK: torch.Tensor, capacity: int | None):
        super().__init__()
        self.probs_TK, self.experts_TK, self.capacity = probs_TK, experts_TK, capacity

    def forward(self, x_TH):
        keep_TK = None
        if self.capacity is not None:
            one_hot = torch.nn.functional.one_hot(self.experts_TK.flatten(), E)
            position = ((one_hot.cumsum(0) - 1) * one_hot).sum(1).view_as(self.experts_TK)
            keep_TK = position < self.capacity
        kept = self.experts_TK if keep_TK is None else self.experts_TK[keep_TK]
        zero = torch.zeros(())
        probs = self.probs_TK if keep_TK is None else self.probs_TK * keep_TK
        return Routing(probs, self.experts_TK, torch.bincount(kept.flatten(), minlength=E), zero, zero, keep_TK,
                       self.capacity)


def rank_inputs(rank: int, routing: str, topk: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g)
    upstream = torch.randn(TOKENS, H, generator=g)
    probs = torch.softmax(torch.randn(TOKENS, topk, generator=g), -1)
    if routing == "random":
        experts = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(TOKENS)])
    elif routing == "first_rank_only":  # experts 0..k-1: every other rank and expert receives nothing
        experts = torch.arange(topk).repeat(TOKENS, 1)
    elif routing == "last_rank_only":
        experts = (E - 1 - torch.arange(topk)).repeat(TOKENS, 1)
    elif routing == "sparse":  # some tokens' copies all on one expert, experts 2 and 5 idle
        experts = torch.stack([torch.tensor([0, 7][: topk]) if t % 2 else torch.tensor([3, 4][: topk])
                               for t in range(TOKENS)])
    else:
        raise ValueError(routing)
    if rank == 1 and routing == "random":
        x, upstream, probs, experts = x[:0], upstream[:0], probs[:0], experts[:0]  # a rank with no tokens
    return x, upstream, probs, experts


SHARED_F = 16


def fp8_values(t: torch.Tensor) -> torch.Tensor:
    """What an FP8 wire row carries of ``t``'s rows: each quantized to E4M3 with its scale (by the kernel the
    layer runs: interpreted Triton rounds some values another way than the twin), then dequantized."""
    from moe_overlap.kernels.fp8_quant import dequantize, quantize_rows

    return dequantize(*quantize_rows(t.detach())).to(t.dtype)


def moe_case(routing: str, topk: int, etp: int = 1, selectors: dict | None = None, **setting) -> float:
    """Runs on every rank of the pool: the EP layer's output and gradients against the naive formula (see
    :func:`layer_case` for ``selectors`` and ``setting``)."""
    return moe_cases(routing, topk, [setting], etp, selectors)[0]


def moe_cases(routing: str, topk: int, settings: list[dict], etp: int = 1,
              selectors: dict | None = None) -> list[float]:
    """Many settings on one mesh (making gloo groups is the slow part of a case), sharing one transport selector
    per planning mode, as a model's layers share one. The selectors hold the mesh's EP group, so they live and
    die with the mesh: one kept past it (a module-level cache) would hand a later case a destroyed group."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = Mesh.create(MeshLayout(world, ep=world // etp, etp=etp), timeout_s=60) if world > 1 else Mesh.single()
    selectors = {} if selectors is None else selectors
    try:
        return [layer_case(mesh, selectors, routing, topk, etp=etp, **setting) for setting in settings]
    finally:
        mesh.destroy()


def layer_case(mesh, selectors: dict, routing: str, topk: int, chunks: int = 0, planning: str = "auto",
               capacity: int | None = None, pad: bool = False, shared: str = "off", delay_wgrad: bool = False,
               etp: int = 1, force_pipeline: bool = False, once_per_rank: bool = False,
               dispatch_dtype: str = "bf16", slices: int = 1, bound: float | None = None,
               overflow: float | None = None) -> float:
    """chunks 0 is the serial path; >= 1 the pipeline with that many chunks, its sizes planned by ``planning``
    (host, or device: on CPU the gloo twin of the SM push). shared: off, serial (shared expert outside the
    pipeline), overlap (beside the combine's transfers). ``force_pipeline``: run the pipeline at EP=1 too (a one-rank
    group), instead of the local path the layer picks there. ``selectors``: the pipeline's transports per
    planning mode, made over ``mesh``'s EP group for a mode it lacks. ``once_per_rank``:
    overlap.moe_dispatch_once_per_rank (the pipeline's wire rows). ``dispatch_dtype``: overlap.moe_dispatch_dtype;
    with fp8 the formula takes what crossed, each token's hidden state and output gradient dequantized from FP8
    (no shared expert: it sees the rows as they are). ``slices``: overlap.moe_token_slices. ``bound``, ``overflow``:
    overlap.moe_expert_rank_capacity_factor and moe_overflow_capacity_factor (device planning; the overflow chunk
    must take every row past the bound: no trainer here runs a step again)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    cfg = ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=topk,
                      moe_pad_expert_input_to_capacity=pad,
                      moe_shared_expert_intermediate_size=SHARED_F if shared != "off" else None,
                      moe_shared_expert_overlap=shared == "overlap")
    overlap = OverlapConfig(moe_pipeline=chunks > 0, moe_pipeline_chunks=max(chunks, 1),
                            delay_wgrad_compute=delay_wgrad, moe_planning=planning,
                            moe_dispatch_once_per_rank=once_per_rank, moe_dispatch_dtype=dispatch_dtype,
                            moe_token_slices=slices, moe_expert_rank_capacity_factor=bound,
                            moe_overflow_capacity_factor=overflow)
    transports = None
    if chunks:
        if planning not in selectors:
            selectors[planning] = TransportSelector(planning, "auto", mesh.ep.group, mesh.ep.ranks,
                                                    torch.device("cpu"), E // mesh.ep.size, 60)
        transports = selectors[planning]
    layer = MoELayer(cfg, overlap, mesh.ep, transports, etp=mesh.etp, expert_mp=mesh.expert_mp)
    assert layer.local == (mesh.ep.size == 1 and mesh.etp.size == 1)  # nothing to exchange: the local path
    if force_pipeline:
        layer.local = False
    w13, w2 = full_expert_weights()
    ffn_slice = slice(mesh.etp.rank * F // etp, (mesh.etp.rank + 1) * F // etp)

    def my_slice(t13, t2):  # this rank's FFN slice under expert-TP: gate and up columns, fc2 rows
        return torch.cat((t13[..., :F][..., ffn_slice], t13[..., F:][..., ffn_slice]), -1), t2[:, ffn_slice]

    g = torch.Generator().manual_seed(7)
    shared_fc1, shared_fc2 = (torch.randn(2 * SHARED_F, H, generator=g) * 0.3,
                              torch.randn(H, SHARED_F, generator=g) * 0.3)
    local = slice(layer.experts.first_expert, layer.experts.first_expert + layer.experts.num_local_experts)
    with torch.no_grad():
        mine13, mine2 = my_slice(w13[local], w2[local])
        layer.experts.w13.copy_(mine13)
        layer.experts.w2.copy_(mine2)
        if layer.shared_expert is not None:
            layer.shared_expert.linear_fc1.weight.copy_(shared_fc1)
            layer.shared_expert.linear_fc2.weight.copy_(shared_fc2)
    x, upstream, probs, experts = rank_inputs(rank, routing, topk)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    layer.router = FixedRouter(probs, experts, capacity)
    out, _, tokens_per_expert = layer(x.unsqueeze(0))
    kept = FixedRouter(probs, experts, capacity)(x)
    assert torch.equal(tokens_per_expert, kept.tokens_per_expert_E)
    out.squeeze(0).backward(upstream)

    # Reference: every rank's tokens through the naive formula; expert grads sum over all of them.
    ref_w13, ref_w2 = w13.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    ref_fc1, ref_fc2 = shared_fc1.clone().requires_grad_(True), shared_fc2.clone().requires_grad_(True)
    errors = []
    world = mesh.world_size
    for r in range(world):
        rx, rup, rprobs, rexperts = rank_inputs(r, routing, topk)
        if dispatch_dtype == "fp8":
            assert shared == "off"
            rx, rup = fp8_values(rx), fp8_values(rup)
        rx.requires_grad_(True)
        rprobs.requires_grad_(True)
        rkept = FixedRouter(rprobs, rexperts, capacity)(rx)
        ref_out = naive_moe(rx, rkept.probs_TK, rexperts, ref_w13, ref_w2)
        if shared != "off":
            ref_out = ref_out + swiglu(rx @ ref_fc1.T) @ ref_fc2.T
        ref_fc1.grad, ref_fc2.grad = None, None  # the shared expert sees one rank's tokens only
        ref_out.backward(rup)
        if r == rank and rx.shape[0] > 0:
            errors += [rel_err(out.squeeze(0), ref_out), rel_err(x.grad, rx.grad), rel_err(probs.grad, rprobs.grad)]
            if shared != "off":
                errors += [rel_err(layer.shared_expert.linear_fc1.weight.grad, ref_fc1.grad),
                           rel_err(layer.shared_expert.linear_fc2.weight.grad, ref_fc2.grad)]
    want13, want2 = my_slice(ref_w13.grad[local], ref_w2.grad[local])
    for got, want in ((layer.experts.w13.grad, want13), (layer.experts.w2.grad, want2)):
        if want.norm() == 0:
            assert got.abs().max() == 0, "an expert that received nothing has a gradient"
        else:
            errors.append(rel_err(got, want))
    assert max(errors, default=0.0) < 1e-5, errors
    return max(errors, default=0.0)


def test_for_micro_batch_picks_the_graphed_copies_in_turn():
    """Without graphed copies every micro-batch runs the layer; with n - 1 copies (capture_moe_layers(copies=n),
    CUDA) micro-batch i runs copy i mod n in training, the layer itself being copy 0, and the layer in eval mode."""
    one_rank = GroupHandle(ranks=[0], group=None, rank=0, size=1)
    layer = MoELayer(ModelConfig(hidden_size=16, ffn_hidden_size=16, num_moe_experts=4, moe_router_topk=2),
                     OverlapConfig(moe_pipeline=False), one_rank)
    assert all(layer.for_micro_batch(i) is layer for i in range(4))
    copies = (torch.nn.Identity(), torch.nn.Identity())
    object.__setattr__(layer, "graph_copies", copies)
    assert [layer.for_micro_batch(i) for i in range(7)] == [layer, *copies, layer, *copies, layer]
    layer.eval()  # evaluation runs the layer eagerly: the copies' graphs replay training calls
    assert all(layer.for_micro_batch(i) is layer for i in range(7))
    layer.train()
    assert layer.for_micro_batch(1) is copies[0]


def test_each_graphed_copy_gets_its_own_static_inputs(monkeypatch):
    """capture_moe_layers(copies=n) hands every set of graphs its own sample inputs: a replay copies its input into
    them and a layer may save its input for the backward (the router's logits do), so a set's inputs must outlive
    the next set's forward (one shared set failed the bf16 rule on 4xH200 under pairing and 1F1B). CUDA graphs
    themselves are recorded here, not captured."""
    one_rank = GroupHandle(ranks=[0], group=None, rank=0, size=1)
    layers = tuple(MoELayer(ModelConfig(hidden_size=16, ffn_hidden_size=16, num_moe_experts=4, moe_router_topk=2),
                            OverlapConfig(moe_pipeline=False), one_rank) for _ in range(2))
    calls = []
    monkeypatch.setattr(moe_module, "prepare_device_clock", lambda device: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())  # each set's capture stream
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", lambda callables, samples: calls.append(samples))
    moe_module.capture_moe_layers(layers, (4, 16), copies=3)
    inputs = [sample[0] for samples in calls for sample in samples]
    assert len(calls) == 3 and len(inputs) == 6
    assert len({t.data_ptr() for t in inputs}) == 6, "two sets of graphs share a static input"
    assert all(len(layer.graph_copies) == 2 for layer in layers)


def test_each_graphed_copy_captures_on_its_replay_stream(monkeypatch):
    """Each set of graphs is captured on the stream it replays on (pairs on two streams: set i on stream i mod 2),
    else on a stream of its own, never on torch's one default capture stream: cuBLAS's workspace is torch's per
    (handle, stream) and a graph keeps the one it was captured with, so sets captured on one stream share one, and
    two replaying side by side hung (2xH200: a GEMM's blocks spinning). Recorded, not captured: the stream each
    make_graphed_callables call finds torch.cuda.graph bound to, and the capture mode."""
    one_rank = GroupHandle(ranks=[0], group=None, rank=0, size=1)
    layers = tuple(MoELayer(ModelConfig(hidden_size=16, ffn_hidden_size=16, num_moe_experts=4, moe_router_topk=2),
                            OverlapConfig(moe_pipeline=False), one_rank) for _ in range(2))
    graph, captures = torch.cuda.graph, []
    monkeypatch.setattr(moe_module, "prepare_device_clock", lambda device: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    monkeypatch.setattr(torch.cuda, "make_graphed_callables",
                        lambda callables, samples: captures.append(torch.cuda.graph.keywords))
    moe_module.capture_moe_layers(layers, (4, 16), copies=3)
    assert len(captures) == 3 and len({id(keywords["stream"]) for keywords in captures}) == 3
    pair = ("stream 0", "stream 1")
    moe_module.capture_moe_layers(layers, (4, 16), copies=4, replay_streams=pair)
    assert [keywords["stream"] for keywords in captures[3:]] == [*pair, *pair]
    assert all(keywords["capture_error_mode"] == "thread_local" for keywords in captures)
    assert torch.cuda.graph is graph, "torch.cuda.graph left patched"


@pytest.mark.parametrize("routing", ["random", "first_rank_only", "last_rank_only", "sparse"])
@pytest.mark.parametrize("topk", [1, 2])
def test_moe_layer_single_process(routing, topk):
    assert moe_case(routing, topk) < 1e-5


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("routing", ["random", "first_rank_only", "last_rank_only", "sparse"])
def test_moe_layer_expert_parallel_skewed_routing(rank_pool, world, routing):
    errors = rank_pool(world).run(moe_case, routing, 2)
    assert max(errors) < 1e-5


@pytest.mark.parametrize("world,routing,capacity", [(2, "random", None), (2, "sparse", None), (4, "random", None),
                                                    (4, "last_rank_only", None), (4, "sparse", 3)])
def test_expert_tensor_parallel_serial_dispatch(rank_pool, world, routing, capacity):
    """Expert-TP=2 (EP=1 on 2 ranks, EP=2 on 4): each expert's FFN split in two, rows gathered and the
    partial outputs summed back; with padded capacity the sizes are static."""
    errors = rank_pool(world).run(moe_case, routing, 2, capacity=capacity, pad=capacity is not None, etp=2)
    assert max(errors) < 1e-5


# The pipeline against the same formula (the serial path passes it too), every setting on one mesh per call:
# planning (host; device, the gloo twin of the SM push) x chunks x dropless / capacity with drops / padded
# capacity x shared expert (outside, or beside the combine with deferred weight gradients).
CAPACITIES = [dict(), dict(capacity=3), dict(capacity=3, pad=True)]
SHARED = [dict(), dict(shared="overlap", delay_wgrad=True), dict(shared="serial")]


def pipeline_settings(plannings=("host", "device"), chunks=(1, 2)) -> list[dict]:
    return [dict(planning=p, chunks=c, **cap, **sh) for p in plannings for c in chunks for cap in CAPACITIES
            for sh in SHARED[:2]] + [dict(planning=p, chunks=max(chunks), **SHARED[2]) for p in plannings]


@pytest.mark.parametrize("world,routing", [(2, "sparse"), (2, "first_rank_only"), (4, "last_rank_only"),
                                           (4, "sparse")])
def test_pipeline_every_planning_chunks_capacity_and_shared_expert(rank_pool, world, routing):
    """Skewed routing too: whole ranks and experts receive nothing, one rank receives everything."""
    chunks = (1, 2) if world == 4 else (1, 2, 4)
    errors = rank_pool(world).run(moe_cases, routing, 2, pipeline_settings(chunks=chunks))
    assert max(max(e) for e in errors) < 1e-5


def test_pipeline_with_expert_tensor_parallelism(rank_pool):
    """Expert-TP=2 x EP=2 (host planning: the expert-TP gather takes host sizes): each chunk's rows gathered
    over expert-TP and summed back."""
    settings = [dict(planning="host", chunks=c, **cap, **sh) for c in (1, 2) for cap in CAPACITIES
                for sh in SHARED[:2]]
    errors = rank_pool(4).run(moe_cases, "random", 2, settings, etp=2)
    assert max(max(e) for e in errors) < 1e-5


def test_host_planned_pipeline_with_a_rank_without_tokens(rank_pool):
    """Exact host sizes: one rank routes nothing (rank 1 of "random") while the other sends to every expert."""
    settings = [dict(planning="host", chunks=c, **cap) for c in (1, 4) for cap in CAPACITIES]
    assert max(max(e) for e in rank_pool(2).run(moe_cases, "random", 2, settings)) < 1e-5


def test_device_planned_pipeline_refuses_ranks_with_different_token_counts(rank_pool):
    """Its static sizes assume one micro-batch shape on every EP rank: a rank with no tokens is caught."""
    with pytest.raises(Exception, match="same micro-batch shape"):
        rank_pool(2).run(moe_cases, "random", 2, [dict(planning="device", chunks=2)])


_KEPT: list = []


def keep_a_selector_past_its_mesh() -> None:
    """What this module's selector cache did: a transport selector, and with it the EP group, outlives its mesh."""
    world = dist.get_world_size()
    mesh = Mesh.create(MeshLayout(world, ep=world), timeout_s=60)
    _KEPT.append(TransportSelector("host", "auto", mesh.ep.group, mesh.ep.ranks, torch.device("cpu"), E // world, 60))
    mesh.destroy()


def test_a_case_that_keeps_a_process_group_past_its_mesh_fails(rank_pool):
    """The suite once hung at random here: a selector cache keyed by id(mesh) handed a rank the previous case's
    destroyed EP group whenever its new mesh landed at the old one's address on that rank alone; that rank
    exchanged over the old group, its peer over the new one, until gloo's timeout. The pool fails such a case."""
    with pytest.raises(RankPoolError, match=r"destroyed process groups in module state.*_KEPT\[0\]\.group"):
        rank_pool(2).run(keep_a_selector_past_its_mesh)


class OneRankTransports:
    """A one-rank group's symmetric transport on CPU, its regions in this process's memory: the copy engine's
    copies and (interpreted) the SM push kernel, with the same routes and flow as on GPUs."""

    def __init__(self, name: str, push_ctas: int | None = None, planning: str | None = None):
        from moe_overlap.distributed.a2a_host import CopyEngineTransport
        from moe_overlap.distributed.a2a_push import PushTransport

        # the copy engine takes host sizes, or with device planning each token's wire rows in slots
        self.name, self.planning = name, planning or ("device" if name == "sm_push" else "host")
        self.kind = PushTransport if name == "sm_push" else CopyEngineTransport
        self.extra = dict(push_ctas=push_ctas) if name == "sm_push" else {}
        self.made = None

    def count_overflow(self, rows: torch.Tensor, unplaced: torch.Tensor | None = None) -> None:
        assert int(rows) == 0  # the worst-case bound (moe_expert_rank_capacity_factor=None) is never exceeded

    def transport(self, nbytes: int):
        from moe_overlap.distributed.symm import LocalRegions

        if self.made is None or self.made.regions.region_bytes < nbytes:
            self.made = self.kind(LocalRegions(nbytes, 4, 8, torch.device("cpu")), torch.device("cpu"), **self.extra)
        return self.made


@pytest.mark.parametrize("transport", ["gloo_host", "gloo_device", "copy_engine", "sm_push"])
def test_pipeline_over_one_rank_for_every_transport(monkeypatch, transport):
    """EP=1 with the pipeline forced on (the layer picks the local path there): rows move within the process,
    through the gloo group's copy, its device-planned twin, the copy engine's region, and the Triton push kernel
    and copy-out (interpreted) into a region; chunks without rows, capacity, padding, the shared expert."""
    if transport == "sm_push":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the push kernel writes through addresses: no torch twin
    shared = SHARED[1:2] if transport == "sm_push" else SHARED[:2]  # every kernel interpreted: the fewest calls
    settings = [dict(chunks=c, **cap, **sh) for c in (1, 4) for cap in CAPACITIES for sh in shared]
    planning = "device" if transport in ("sm_push", "gloo_device") else "host"
    for routing in ("first_rank_only", "sparse"):  # chunks 1..3 carry no rows at all / experts 2, 5 idle
        for setting in settings:
            selectors = None if transport.startswith("gloo") else {planning: OneRankTransports(transport)}
            assert moe_case(routing, 2, planning=planning, force_pipeline=True, selectors=selectors, **setting) < 1e-5
    if transport == "sm_push":  # wire rows: the first chunk's expanded straight from the region the kernel wrote
        selectors = {planning: OneRankTransports(transport)}
        assert moe_case("random", 4, planning=planning, force_pipeline=True, selectors=selectors, chunks=1,
                        once_per_rank=True) < 1e-5


def test_ep_comm_ctas_holds_the_pushes_no_carveout_sizes(monkeypatch):
    """``overlap.ep_comm_ctas`` with SM pushes: a push that no carve-out sizes (one chunk, where only another
    stream's GEMMs may run beside it) takes that many CTAs instead of the full chip; the same result."""
    import moe_overlap.distributed.a2a_push as a2a_push
    from moe_overlap.kernels.push_rows import full_width

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    push_rows, ctas = a2a_push.push_rows, []

    def counted(*args, **kwargs):
        if "ctas" not in kwargs:  # rows, not gather_counts' one-CTA push of the counts
            ctas.append(args[7])
        return push_rows(*args, **kwargs)

    monkeypatch.setattr(a2a_push, "push_rows", counted)
    for push_ctas, want in ((None, full_width(torch.device("cpu"))), (3, 3)):
        ctas.clear()
        selectors = {"device": OneRankTransports("sm_push", push_ctas)}
        assert moe_case("sparse", 2, planning="device", force_pipeline=True, selectors=selectors, chunks=1) < 1e-5
        assert ctas and set(ctas) == {want}


@pytest.mark.parametrize("once_per_rank,chunks,copies", [(True, 1, 0), (True, 4, 3), (False, 1, 1)])
def test_wire_rows_of_the_first_chunk_are_read_from_the_region(monkeypatch, once_per_rank, chunks, copies):
    """Wire rows (each token once per rank) are read once, to expand them: the first chunk's come straight from the
    receive region, later chunks' (their start is on the device) and grouped rows (the GEMMs keep them) are copied
    out, once per chunk each way (copies counted per direction); the layer still equals the formula."""
    import moe_overlap.distributed.a2a_push as a2a_push

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return copy_rows_out(*args, **kwargs)

    copy_rows_out = a2a_push.copy_rows_out
    monkeypatch.setattr(a2a_push, "copy_rows_out", counted)
    error = moe_case("random", 4, planning="device", force_pipeline=True, chunks=chunks, once_per_rank=once_per_rank)
    assert error < 1e-5
    assert len(calls) == 2 * copies  # the dispatch's forward and the combine's backward (both to the experts)


def test_cuda_graph_capture_refuses_layers_that_sync_with_the_host():
    from moe_overlap.layers.moe import capture_moe_layers
    two_ranks = GroupHandle(ranks=[0, 1], group=None, rank=0, size=2)  # the serial dropless dispatch syncs at EP=2
    layer = MoELayer(ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=2),
                     OverlapConfig(moe_pipeline=False), two_ranks)
    assert not layer.local
    with pytest.raises(ValueError, match="moe_planning=device"):
        capture_moe_layers((layer,), (1, TOKENS, H))


@pytest.mark.parametrize("setting", [dict(chunks=2, planning="device"), dict(chunks=2, planning="host"),
                                     dict(capacity=3), dict(capacity=3, pad=True), dict(chunks=1, shared="serial")],
                         ids=["device", "host", "capacity", "padded", "shared"])
def test_one_ep_rank_runs_the_local_path_for_every_dispatch_setting(setting):
    """EP=1: the local path (layer_case checks it) whatever the dispatch switches say, against the naive formula;
    that it runs without a host sync is test_gpu_moe.py's."""
    assert moe_case("sparse", 2, **setting) < 1e-5


@pytest.mark.parametrize("carveout,transport,chunks,ctas,want,paired,delayed", [
    (8, "nccl", 4, None, 8, False, False), (8, "sm_push", 1, None, 0, False, False),  # one chunk: nothing beside
    (8, "sm_push", 1, None, 8, True, False),  # ... but another micro-batch's GEMMs (overlap_moe_expert_parallel_comm)
    (8, "sm_push", 1, None, 8, False, True),  # ... or the delayed weight gradients (the backward's transfer back)
    ("auto", "sm_push", 1, None, "pushes", False, True),
    ("auto", "nccl", 4, 4, 8, False, False), ("auto", "nccl", 4, None, 0, False, False),
    ("auto", "copy_engine", 4, None, 0, False, False), ("auto", "sm_push", 4, None, "pushes", False, False)])
def test_pipeline_carveout_per_transport(carveout, transport, chunks, ctas, want, paired, delayed):
    from moe_overlap.tuning import auto_push_sms

    two_ranks = GroupHandle(ranks=[0, 1], group=None, rank=0, size=2)
    overlap = OverlapConfig(moe_pipeline=True, moe_dispatch_once_per_rank=False, moe_pipeline_chunks=chunks,
                            gemm_sm_carveout=carveout, ep_comm_ctas=ctas, delay_wgrad_compute=delayed)
    layer = MoELayer(ModelConfig(hidden_size=H, ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=2), overlap,
                     two_ranks, SimpleNamespace(planning="host"))
    transport_like = SimpleNamespace(name=transport, needs_sms=transport != "copy_engine")
    got = layer._overlap_sms(transport_like, 4096, H, 2, paired)
    assert got == (auto_push_sms(4096, H, F, chunks, 2) if want == "pushes" else want)


def test_auto_carveout_sizes_pushes_by_bytes_and_gemm_time():
    from moe_overlap.tuning import MAX_PUSH_CTAS, auto_push_sms

    fine = auto_push_sms(32768, 7168, 2048, 4, 2)
    assert fine == 16  # a chunk's 235 MB both ways in its 1.20 ms of forward GEMM, at 13 MB per CTA-ms
    assert auto_push_sms(32768, 7168, 1024, 4, 2) > fine  # half the GEMM time for the same bytes
    assert auto_push_sms(32768, 7168, 2048, 2, 2) == fine  # chunks change bytes and GEMM time alike
    assert auto_push_sms(32768, 7168, 65536, 4, 2) == 1 and auto_push_sms(32768, 7168, 64, 4, 2) == MAX_PUSH_CTAS


def test_dropless_plan_sizes_the_permutation_before_the_counts_arrive(monkeypatch):
    """All copies mapped: the permuted rows are known without the counts, so the permutation is queued before
    the layer's one host sync; the exchange plan waits for the counts once, on first use."""
    from moe_overlap.layers import host_plan

    ep = GroupHandle(ranks=[0, 1], group=None, rank=0, size=2)
    experts_TK = torch.tensor([[0, 3], [1, 2], [3, 0]])
    counts_SE = torch.tensor([[2, 1, 1, 2], [1, 1, 2, 2]])
    fetches = []
    monkeypatch.setattr(host_plan, "start_counts_fetch", lambda tokens_per_expert_E, group:
                        lambda: fetches.append(1) or counts_SE)  # the fetch started, waited for on first use
    routing = SimpleNamespace(experts_TK=experts_TK, keep_TK=None, capacity=None,
                              tokens_per_expert_E=torch.bincount(experts_TK.flatten(), minlength=4))
    plan = host_plan.HostPlanner(4, ep, 1, False, None, torch.device("cpu"), H * 4).plan(routing)
    assert plan.num_rows == 6 and not fetches
    assert plan.exchange.layout.send_total == 6 and plan.exchange.layout.recv_total == 5 and fetches == [1]
    plan.exchange
    assert fetches == [1]


def test_shared_expert_overlap_sits_beside_the_combine_forward_and_backward(monkeypatch):
    """model.moe_shared_expert_overlap: the shared expert runs after the expert GEMMs started their outputs back
    (beside that transfer), and autograd, which runs the latest-made ready node first, runs its backward right after
    the combine's backward started the output gradient's rows to the experts, before the experts' backward waits for
    them; the layer still equals the formula."""
    import moe_overlap.layers.dispatch_pipeline as dispatch_pipeline
    from moe_overlap.layers import mlp

    order = []

    class Mark(torch.autograd.Function):  # made first in the shared expert: its backward ends the shared expert's
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            order.append("shared backward")
            return grad

    for name in ("Experts", "Combine"):
        cls = getattr(dispatch_pipeline, name)

        def forward(ctx, *args, _original=cls.forward, _name=name):
            order.append(f"{_name} forward")
            return _original(ctx, *args)

        def backward(ctx, *grads, _original=cls.backward, _name=name):
            order.append(f"{_name} backward")
            return _original(ctx, *grads)

        monkeypatch.setattr(cls, "forward", staticmethod(forward))
        monkeypatch.setattr(cls, "backward", staticmethod(backward))
    shared_forward = mlp.SwiGLUMLP.forward

    def marked(self, x):
        order.append("shared forward")
        return shared_forward(self, Mark.apply(x))

    monkeypatch.setattr(mlp.SwiGLUMLP, "forward", marked)
    assert moe_case("random", 4, planning="device", force_pipeline=True, chunks=1, shared="overlap") < 1e-5
    assert order == ["Experts forward", "shared forward", "Combine forward", "Combine backward", "shared backward",
                     "Experts backward"]


# Token slices (overlap.moe_token_slices=2) against the same formula: both plannings, 1 and 2 chunks, each token once
# per rank or per copy, drops, the shared expert beside the combine with delayed weight gradients, FP8 on the wire.
SLICED = ([dict(planning=p, chunks=c, once_per_rank=o, slices=2) for p in ("host", "device") for c in (1, 2)
           for o in (False, True)]
          + [dict(planning="device", chunks=1, slices=2, capacity=3), dict(planning="host", chunks=2, slices=2,
                                                                          capacity=3, once_per_rank=True),
             dict(planning="device", chunks=1, slices=2, once_per_rank=True, shared="overlap", delay_wgrad=True),
             dict(planning="device", chunks=1, slices=2, once_per_rank=True, dispatch_dtype="fp8")])


@pytest.mark.parametrize("world,routing", [(2, "sparse"), (2, "first_rank_only"), (4, "last_rank_only"),
                                           (4, "sparse")])
def test_token_slices_equal_the_formula(rank_pool, world, routing):
    """Skewed routing too: a slice of a rank may route nothing to a rank, or everything."""
    errors = rank_pool(world).run(moe_cases, routing, 2, SLICED)
    assert max(max(e) for e in errors) < 1e-5


def test_token_slices_hand_each_transfer_to_the_other_slices_gemm(monkeypatch):
    """overlap.moe_token_slices=2: forward, slice 0's dispatch crosses alone, slice 1's right after slice 0's GEMM is
    launched, slice 0's combine right after slice 1's GEMM, slice 1's alone; backward (the latest-made ready node
    first), slice 1's output-gradient rows cross alone, slice 0's right after slice 1's first dgrad, and each
    slice's rows back beside its delayed weight gradients. The layer still equals the formula."""
    import moe_overlap.layers.dispatch_pipeline as dispatch_pipeline
    from moe_overlap.distributed.a2a_exchange import ToExperts

    order = []
    for name in ("experts_forward", "experts_dgrad"):
        def logged(*args, _original=getattr(dispatch_pipeline, name), _name=name, **kwargs):
            order.append("GEMM" if _name == "experts_forward" else "dgrad")
            return _original(*args, **kwargs)

        monkeypatch.setattr(dispatch_pipeline, name, logged)
    send_through = dispatch_pipeline._send

    def send_logged(handoff, send, *args, alone):
        kind = "to experts" if isinstance(send.__self__, ToExperts) else "back"

        def logged(*args, alone):
            order.append((kind, "alone" if alone else "beside"))
            return send(*args, alone=alone)

        return send_through(handoff, logged, *args, alone=alone)

    monkeypatch.setattr(dispatch_pipeline, "_send", send_logged)
    assert moe_case("random", 4, planning="device", force_pipeline=True, chunks=1, slices=2, delay_wgrad=True,
                    once_per_rank=True) < 1e-5
    assert order == [("to experts", "alone"), "GEMM", ("to experts", "beside"), "GEMM", ("back", "beside"),
                     ("back", "alone"),
                     ("to experts", "alone"), "dgrad", ("to experts", "beside"), ("back", "beside"), "dgrad",
                     ("back", "beside")]
