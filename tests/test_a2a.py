"""The MoE pipeline's planning and transport choice (auto, and refusals that say why) and the chunked exchange
layout, without processes."""

from __future__ import annotations

import numpy as np
import pytest

from moe_overlap.distributed.a2a_routes import exchange_layout
from moe_overlap.exchange_rules import choose_exchange


@pytest.mark.parametrize("planning,transport,device,reason,chosen", [
    ("auto", "auto", "cuda", None, ("device", "sm_push")),  # one host with peer access
    ("host", "auto", "cuda", None, ("host", "copy_engine")),
    ("device", "auto", "cuda", None, ("device", "sm_push")),
    ("auto", "auto", "cuda", "the ranks span 2 hosts", ("host", "nccl")),
    ("auto", "nccl", "cuda", None, ("host", "nccl")),
    ("auto", "copy_engine", "cuda", None, ("host", "copy_engine")),
    ("auto", "auto", "cpu", "the device is the CPU", ("host", "gloo")),
    ("device", "gloo", "cpu", None, ("device", "gloo")),  # the SM push's twin
])
def test_auto_planning_and_transport(planning, transport, device, reason, chosen):
    assert choose_exchange(planning, transport, device, reason)[:2] == chosen


@pytest.mark.parametrize("planning,transport,device,reason,fragment", [
    ("device", "auto", "cuda", "the ranks span 2 hosts", "needs overlap.moe_transport='sm_push', which cannot run: "
                                                          "the ranks span 2 hosts"),
    ("auto", "sm_push", "cuda", "GPU 0 has no peer access to GPU 1", "'sm_push' cannot run: GPU 0 has no peer"),
    ("device", "nccl", "cuda", None, "takes host sizes"),
    ("host", "sm_push", "cuda", None, "takes device sizes"),
    ("auto", "gloo", "cuda", None, "is the CPU transport"),
    ("auto", "nccl", "cpu", "the device is the CPU", "cannot run on the CPU; use 'auto' or 'gloo'"),
    ("auto", "symm", "cpu", None, "allowed auto, nccl, copy_engine, sm_push, gloo"),
    ("later", "auto", "cpu", None, "overlap.moe_planning='later': allowed auto, host, device"),
])
def test_a_pipeline_that_cannot_run_is_refused_with_the_reason(planning, transport, device, reason, fragment):
    with pytest.raises(ValueError, match="overlap.moe_") as err:
        choose_exchange(planning, transport, device, reason)
    assert fragment in str(err.value)


@pytest.mark.parametrize("peers,chunks", [(2, 1), (2, 3), (4, 2)])
def test_exchange_layout_agrees_on_both_sides_of_every_pair(peers, chunks):
    rows_SDC = np.random.default_rng(peers * 10 + chunks).integers(0, 5, (peers, peers, chunks))
    rows_SDC[0, :, 0] = 0  # a rank that sends nothing in one chunk
    layouts = [exchange_layout(rows_SDC, r) for r in range(peers)]
    for src in range(peers):
        for dst in range(peers):
            for c in range(chunks):
                sent, got = layouts[src], layouts[dst]
                assert sent.send_rows[c][dst] == got.recv_rows[c][src] == rows_SDC[src, dst, c]
                assert sent.remote_recv_offsets[c][dst] == got.recv_offsets[c][src]
                assert got.remote_send_offsets[c][src] == sent.send_offsets[c][dst]
    for lay in layouts:  # chunk-major: each chunk one contiguous region per side, regions in order
        assert lay.send_range(chunks - 1)[1] == lay.send_total and lay.recv_range(chunks - 1)[1] == lay.recv_total
        back = lay.reversed()
        assert back.send_rows == lay.recv_rows and back.reversed() == lay


def test_tp_ring_transport_choice_names_its_field_and_falls_back_to_p2p():
    from moe_overlap.distributed.ring import BACKENDS
    from moe_overlap.distributed.symm import choose_transport

    def choose(requested, reason, ranks=(0, 1), local=2):
        return choose_transport("overlap.tp_comm_backend", requested, BACKENDS, "p2p", list(ranks), local, reason)

    assert choose("auto", None) == ("symm", "every rank of the group shares one host with peer access")
    name, why = choose("auto", "the device is the CPU")
    assert name == "p2p" and "the device is the CPU" in why
    with pytest.raises(ValueError, match=r"overlap.tp_comm_backend='symm' cannot run: .*span 2 hosts"):
        choose("symm", None, ranks=(0, 1, 2, 3))
    with pytest.raises(ValueError, match=r"overlap.tp_comm_backend='nccl': allowed auto, p2p, symm"):
        choose("nccl", None)


@pytest.mark.parametrize("shape", [(2, 3), (4, 1), (1, 5), (3, 4)])
def test_block_transpose_matches_a_stable_sort_by_target_block(shape):
    from moe_overlap.layers.host_plan import block_transpose

    rows_AB = np.random.default_rng(sum(shape)).integers(0, 4, shape)
    rows_AB[0, 0] = 0  # an empty block
    key = np.repeat(np.add.outer(np.arange(shape[0]), np.arange(shape[1]) * shape[0]).ravel(), rows_AB.ravel())
    index, inverse = block_transpose(rows_AB)
    assert np.array_equal(index, np.argsort(key, kind="stable"))
    assert np.array_equal(inverse[index], np.arange(index.size))
