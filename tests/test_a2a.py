"""Transport choice (auto, and refusals that say why) and the chunked exchange layout, without processes."""

from __future__ import annotations

import numpy as np
import pytest

from moe_overlap.distributed.a2a import choose_backend, exchange_layout


def test_auto_picks_symm_on_one_host_and_nccl_across_a_simulated_second_host():
    assert choose_backend("auto", "cuda", [0, 1], 8, None)[0] == "symm"
    name, why = choose_backend("auto", "cuda", [0, 1, 2, 3], local_world_size=2, symm_reason=None)
    assert name == "nccl" and "span 2 hosts" in why
    name, why = choose_backend("auto", "cuda", [0, 1], 8, "GPU 0 has no peer access to GPU 1")
    assert name == "nccl" and "peer access" in why
    assert choose_backend("auto", "cpu", [0, 1], 2, "the device is the CPU")[0] == "gloo"


@pytest.mark.parametrize("requested,device,ranks,local,reason,fragment", [
    ("symm", "cuda", [0, 1, 2, 3], 2, None, "span 2 hosts"),
    ("symm", "cpu", [0, 1], 2, "the device is the CPU", "the device is the CPU"),
    ("gloo", "cuda", [0, 1], 2, None, "use 'nccl'"),
    ("nccl", "cpu", [0, 1], 2, "the device is the CPU", "use 'gloo'"),
    ("mpi", "cpu", [0, 1], 2, None, "allowed auto, nccl, symm, gloo"),
])
def test_a_transport_that_cannot_run_is_refused_with_the_reason(requested, device, ranks, local, reason, fragment):
    with pytest.raises(ValueError, match="overlap.moe_a2a_backend") as err:
        choose_backend(requested, device, ranks, local, reason)
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
    from moe_overlap.layers.dispatcher import block_transpose

    rows_AB = np.random.default_rng(sum(shape)).integers(0, 4, shape)
    rows_AB[0, 0] = 0  # an empty block
    key = np.repeat(np.add.outer(np.arange(shape[0]), np.arange(shape[1]) * shape[0]).ravel(), rows_AB.ravel())
    index, inverse = block_transpose(rows_AB)
    assert np.array_equal(index, np.argsort(key, kind="stable"))
    assert np.array_equal(inverse[index], np.arange(index.size))
