"""The MoE exchange's rules table (moe_overlap/exchange_rules.py): each rule refuses what it should, in its one
message, whoever reads it (the transport choice, graph capture, the layer, config validation), and README's
"What runs where" is its rendering."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_overlap.exchange_rules import (
    NEEDS,
    PLANNING,
    PLANNINGS,
    TRANSPORT,
    TRANSPORTS,
    choose_exchange,
    config_refusal,
    device_planning_refusal,
    device_refusal,
    expert_tp_refusal,
    graph_device_refusal,
    graph_refusal,
    host_sized,
    one_host_refusal,
    sizes_refusal,
    slots_refusal,
    value_refusal,
    what_runs_where,
    world_refusal,
)

REPO = Path(__file__).resolve().parents[1]
PEERS = "GPU 0 has no peer access to GPU 1"

# (rule's refusal, its one message)
MESSAGES = [
    (value_refusal(PLANNING, "later", PLANNINGS), "overlap.moe_planning='later': allowed auto, host, device"),
    (value_refusal(TRANSPORT, "symm", TRANSPORTS),
     "overlap.moe_transport='symm': allowed auto, nccl, copy_engine, sm_push, gloo"),
    (device_refusal("nccl", "cpu"),
     "overlap.moe_transport='nccl': needs CUDA: it cannot run on the CPU; use 'auto' or 'gloo' on device 'cpu'"),
    (device_refusal("gloo", "cuda"), "overlap.moe_transport='gloo': is the CPU transport: it cannot run on CUDA; "
                                     "use 'auto', 'nccl', 'copy_engine' or 'sm_push' on device 'cuda'"),
    (one_host_refusal("sm_push", PEERS), "overlap.moe_transport='sm_push': moves rows through symmetric memory, so "
                                         f"'sm_push' cannot run: {PEERS}; use 'auto' or 'nccl'"),
    (sizes_refusal("device", "nccl"), "overlap.moe_transport='nccl': takes host sizes: it cannot run with "
                                      "overlap.moe_planning=device (use overlap.moe_planning=host or auto, or "
                                      "overlap.moe_transport=copy_engine or sm_push or gloo or auto)"),
    (slots_refusal("device", "copy_engine", once_per_rank=False, overflow_chunk=False),
     "overlap.moe_transport='copy_engine': with overlap.moe_planning=device needs "
     "overlap.moe_dispatch_once_per_rank=true (the copy engines move each token's wire rows in slots)"),
    (slots_refusal("device", "copy_engine", once_per_rank=True, overflow_chunk=True),
     "overlap.moe_transport='copy_engine': with overlap.moe_planning=device: not implemented yet with the overflow "
     "chunk (overlap.moe_overflow_capacity_factor and more than one chunk)"),
    (sizes_refusal("host", "sm_push"), "overlap.moe_transport='sm_push': takes device sizes: it cannot run with "
                                       "overlap.moe_planning=host (use overlap.moe_planning=device or auto, or "
                                       "overlap.moe_transport=nccl or copy_engine or gloo or auto)"),
    (device_planning_refusal("the ranks span 2 hosts"), "overlap.moe_planning='device': needs "
     "overlap.moe_transport='sm_push', which cannot run: the ranks span 2 hosts; use overlap.moe_planning=auto "
     "or host"),
    (expert_tp_refusal("device", 2), "overlap.moe_planning='device': not implemented yet with "
     "parallel.expert_tensor_parallel_size > 1 (the expert-TP gather takes host sizes); use overlap.moe_planning=host "
     "or auto"),
    (graph_refusal(False, "host", True), "train.moe_cuda_graph=True: needs overlap.moe_pipeline=true with "
     "overlap.moe_planning=device, or one EP rank (a graph cannot hold the host-planned paths' host sync or an NCCL "
     "all-to-all)"),
    (graph_device_refusal("cpu"), "train.moe_cuda_graph=True: CUDA graphs need train.device=cuda; the device is 'cpu'"),
]


@pytest.mark.parametrize("refusal,message", MESSAGES, ids=[m[:40] for _, m in MESSAGES])
def test_each_rule_refuses_in_one_line_naming_field_and_value(refusal, message):
    assert str(refusal) == message and "\n" not in message
    assert message.startswith(f"{refusal.field}={refusal.value!r}: ") and refusal.label


def test_the_rules_let_every_runnable_setting_through():
    assert all(value_refusal(PLANNING, p, PLANNINGS) is None for p in PLANNINGS)
    assert all(device_refusal(t, NEEDS[t].device) is None for t in NEEDS) and device_refusal("auto", "cpu") is None
    assert device_refusal("copy_engine", "cpu") is not None and device_refusal("sm_push", "cpu") is not None
    assert one_host_refusal("nccl", "the ranks span 2 hosts") is None  # NCCL crosses hosts
    assert one_host_refusal("copy_engine", None) is None and one_host_refusal("auto", PEERS) is None
    assert one_host_refusal("copy_engine", PEERS) is not None
    assert [(p, t) for p in PLANNINGS[1:] for t in TRANSPORTS[1:] if sizes_refusal(p, t) is not None] == [
        ("host", "sm_push"), ("device", "nccl")]  # gloo and copy_engine (wire rows in slots) take both
    assert slots_refusal("device", "copy_engine", once_per_rank=True, overflow_chunk=False) is None
    assert slots_refusal("device", "sm_push", once_per_rank=False, overflow_chunk=True) is None
    assert slots_refusal("host", "copy_engine", once_per_rank=False, overflow_chunk=True) is None
    assert host_sized("auto", "copy_engine") and host_sized("host", "auto") and host_sized("auto", "nccl")
    assert not host_sized("device", "copy_engine") and not host_sized("auto", "sm_push")
    assert not host_sized("auto", "auto")  # the fabric decides when the ranks start
    assert sizes_refusal("auto", "nccl") is None and sizes_refusal("device", "auto") is None
    assert device_planning_refusal(None) is None
    assert expert_tp_refusal("device", 1) is None and expert_tp_refusal("host", 2) is None
    assert expert_tp_refusal("auto", 4) is None  # auto plans on the host there (below)
    assert graph_refusal(True, "device", True) is None and graph_refusal(False, "host", False) is None  # no exchange
    assert graph_refusal(True, "host", True) is not None and graph_refusal(True, "auto", True) is not None
    assert graph_device_refusal("cuda") is None


@pytest.mark.parametrize("args,refusal", [
    (("later", "auto", "cpu", None), value_refusal(PLANNING, "later", PLANNINGS)),
    (("auto", "symm", "cpu", None), value_refusal(TRANSPORT, "symm", TRANSPORTS)),
    (("auto", "nccl", "cpu", "the device is the CPU"), device_refusal("nccl", "cpu")),
    (("auto", "gloo", "cuda", None), device_refusal("gloo", "cuda")),
    (("auto", "sm_push", "cuda", PEERS), one_host_refusal("sm_push", PEERS)),
    (("host", "copy_engine", "cuda", "the ranks span 2 hosts"),
     one_host_refusal("copy_engine", "the ranks span 2 hosts")),
    (("device", "nccl", "cuda", None), sizes_refusal("device", "nccl")),
    (("host", "sm_push", "cuda", None), sizes_refusal("host", "sm_push")),
    (("device", "auto", "cuda", "the ranks span 2 hosts"), device_planning_refusal("the ranks span 2 hosts")),
    (("device", "auto", "cuda", None, 2), expert_tp_refusal("device", 2)),
    (("device", "gloo", "cpu", None, 2), expert_tp_refusal("device", 2)),
])
def test_the_transport_choice_refuses_with_the_rules_message(args, refusal):
    with pytest.raises(ValueError) as err:
        choose_exchange(*args)
    assert str(err.value) == str(refusal)


@pytest.mark.parametrize("args,chosen", [
    (("auto", "auto", "cuda", None, 2), ("host", "copy_engine")),  # expert-TP > 1 takes host sizes
    (("auto", "auto", "cuda", None, 1), ("device", "sm_push")),
    (("auto", "auto", "cuda", "the ranks span 2 hosts", 2), ("host", "nccl")),
    (("auto", "auto", "cpu", "the device is the CPU", 2), ("host", "gloo")),
    (("host", "auto", "cuda", None, 2), ("host", "copy_engine")),
])
def test_auto_follows_expert_tp_to_host_planning(args, chosen):
    planning, transport, why = choose_exchange(*args)
    assert (planning, transport) == chosen and why


def test_config_rules_in_order_and_the_world_rules():
    assert config_refusal(True, "device", "nccl", 2, True, True) == sizes_refusal("device", "nccl")
    assert config_refusal(True, "device", "auto", 2, True, True) == expert_tp_refusal("device", 2)
    assert config_refusal(True, "auto", "auto", 1, True, True) == graph_refusal(True, "auto", True)
    assert config_refusal(True, "auto", "auto", 1, True, False) is None  # no graphs asked for
    assert config_refusal(False, "auto", "auto", 1, False, True) is None  # one EP rank: graphs run
    assert config_refusal(True, "device", "auto", 1, True, True) is None
    assert world_refusal("nccl", "cpu", True) == device_refusal("nccl", "cpu")
    assert world_refusal("auto", "cpu", True) == graph_device_refusal("cpu")
    assert world_refusal("auto", "cpu", False) is None and world_refusal("sm_push", "cuda", True) is None


# What tests/test_config.py asserts of config validation's messages for these rules (field, value, fragments):
# the table's messages carry them, so config validation can raise them unchanged.
CONFIG_CASES = [
    (config_refusal(True, "device", "nccl", 1, True, False), "overlap.moe_transport", "'nccl'", "takes host sizes",
     "moe_planning=device"),
    (config_refusal(True, "host", "sm_push", 1, True, False), "overlap.moe_transport", "'sm_push'",
     "takes device sizes"),
    (config_refusal(True, "device", "auto", 2, True, False), "overlap.moe_planning", "'device'", "not implemented yet",
     "expert-TP gather takes host sizes"),
    (config_refusal(False, "auto", "auto", 1, True, True), "train.moe_cuda_graph", "True",
     "overlap.moe_planning=device"),
    (config_refusal(True, "auto", "auto", 1, True, True), "train.moe_cuda_graph", "True",
     "overlap.moe_planning=device"),
    (world_refusal("nccl", "cpu", False), "overlap.moe_transport", "'nccl'", "device 'cpu'", "gloo"),
    (world_refusal("sm_push", "cpu", False), "overlap.moe_transport", "'sm_push'", "device 'cpu'", "gloo"),
    (world_refusal("gloo", "cuda", False), "overlap.moe_transport", "'gloo'", "device 'cuda'", "nccl"),
    (world_refusal("auto", "cpu", True), "train.moe_cuda_graph", "True", "train.device=cuda"),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[str(c[0])[:40] for c in CONFIG_CASES])
def test_the_table_carries_what_config_validation_promises(case):
    refusal, field, value, *fragments = case
    message = str(refusal)
    assert message.startswith(f"{field}=") and value in message
    assert all(fragment in message for fragment in fragments), message


@pytest.mark.parametrize("overrides,fragment", [
    (["overlap.moe_dispatch_once_per_rank=false"], "needs overlap.moe_dispatch_once_per_rank=true"),
    (["overlap.moe_dispatch_once_per_rank=true", "overlap.moe_pipeline_chunks=2",
      "overlap.moe_expert_rank_capacity_factor=1.25", "overlap.moe_overflow_capacity_factor=0.5"],
     "not implemented yet with the overflow chunk"),
])
def test_config_refuses_copy_engines_with_device_planning_it_cannot_slot(overrides, fragment):
    """Also: the paged stash, which follows the SM pushes' device routes, is refused with the copy engines."""
    from moe_overlap.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "tiny.yaml", ["overlap.moe_pipeline=true", "overlap.moe_planning=device",
                                                     "overlap.moe_transport=copy_engine", *overrides])
    message = str(err.value)
    assert message.startswith("overlap.moe_transport='copy_engine': with overlap.moe_planning=device")
    assert fragment in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"^overlap.moe_paged_stash_factor=1.5: not implemented yet \(with "
                                          "overlap.moe_transport=copy_engine: the pages follow"):
        load_config(REPO / "configs" / "tiny.yaml", ["overlap.moe_pipeline=true", "overlap.moe_planning=device",
                                                     "overlap.moe_transport=copy_engine", "model.moe_router_topk=4",
                                                     "overlap.moe_paged_stash_factor=1.5"])


def test_graph_capture_and_the_layer_refuse_with_the_rules_message():
    from moe_overlap.config import ModelConfig, OverlapConfig
    from moe_overlap.distributed.mesh import GroupHandle
    from moe_overlap.layers.moe import MoELayer, capture_moe_layers

    cfg = ModelConfig(hidden_size=16, ffn_hidden_size=24, num_moe_experts=8, moe_router_topk=2)
    two_ranks = GroupHandle(ranks=[0, 1], group=None, rank=0, size=2)
    serial = MoELayer(cfg, OverlapConfig(moe_pipeline=False), two_ranks)
    with pytest.raises(ValueError) as err:
        capture_moe_layers((serial,), (1, 4, 16))
    assert str(err.value) == str(graph_refusal(False, "host", True))
    device_planned = SimpleNamespace(planning="device")  # a selector made for expert-TP = 1
    with pytest.raises(ValueError) as err:
        MoELayer(cfg, OverlapConfig(moe_pipeline=True, moe_dispatch_once_per_rank=False,
                                   delay_wgrad_compute=False), two_ranks, device_planned,
                 etp=two_ranks, expert_mp=two_ranks)
    assert str(err.value) == str(expert_tp_refusal("device", 2))


def test_readme_prints_the_table_from_the_rules():
    table = what_runs_where()
    assert table in (REPO / "README.md").read_text()
    rows = table.splitlines()[2:]
    assert len(rows) == (len(PLANNINGS) - 1) * (len(TRANSPORTS) - 1)  # every planning x transport, once
    assert "| device | sm_push | refused: needs CUDA | the local path" in table
    assert f"| host | copy_engine | {device_refusal('copy_engine', 'cpu').label} |" in table
    assert f"| device | nccl | {sizes_refusal('device', 'nccl').label} |" in table
