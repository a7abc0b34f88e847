"""A symmetric workspace's set-up, without GPUs: torch's symmetric-memory module replaced by a stand-in."""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist


def test_a_workspace_zeroes_its_signal_pad_before_peers_may_signal(monkeypatch):
    """A signal pad handed on from a freed workspace may hold signals that no claim consumed (its last releases'):
    the new workspace zeroes its own pad before the barrier after which peers may raise signals in it."""
    from moe_overlap.distributed import symm

    pad = torch.ones(16, dtype=torch.int32)  # the stale signals
    at_barrier = []

    class Handle:
        signal_pad_size = pad.numel() * pad.element_size()
        multicast_ptr = 0

        def get_signal_pad(self, rank, shape, dtype):
            assert (rank, shape, dtype) == (1, (16,), torch.int32)
            return pad

    stand_in = types.ModuleType("torch.distributed._symmetric_memory")
    stand_in.empty = lambda nbytes, dtype, device: torch.empty(nbytes, dtype=dtype)
    stand_in.rendezvous = lambda buffer, group_name: Handle()
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", stand_in)
    monkeypatch.setattr(torch.distributed, "_symmetric_memory", stand_in, raising=False)
    monkeypatch.setattr(dist, "get_rank", lambda group: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(dist, "barrier", lambda group: at_barrier.append(pad.clone()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)

    workspace = symm.SymmWorkspace(types.SimpleNamespace(group_name="ep"), 64, torch.device("cpu"))
    assert workspace.nbytes == 64
    assert len(at_barrier) == 1 and not at_barrier[0].any(), at_barrier
