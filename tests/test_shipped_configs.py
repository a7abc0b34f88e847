"""Every shipped config passes the checks of the command its header gives, for the GPU count it is meant for (the
``--nproc N``, ``--world-size N`` or ``--nproc-per-node N`` there, else the product of its parallel sizes), on the
device it names; CUDA need not be present. A config that its header trains (`moe-overlap train`, a benchmark
script) passes what `moe-overlap train` checks before any rank starts (moe_overlap.cli's check_before_launch: the
layout and batch for that world size, the data, the resume setting); one that its header only describes
(`moe-overlap info`, real model dimensions for the user's own data) passes what `info` checks (the layout and
batch). A config that reads the real-text corpus is checked against a stand-in of the corpus's size (its
validation windows must hold the evaluation batch), and without the file fails in one line naming the command
that makes it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from moe_overlap.cli import check_before_launch
from moe_overlap.config import ConfigError, load_config, validate_for_world

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))
EXAMPLES = sorted(CONFIGS.glob("gpu*.yaml"))  # the GPU examples of the README's quick start
CORPUS = "data/stdlib/stdlib.bin"  # benchmarks/prepare_stdlib_corpus.py data/stdlib
CORPUS_TOKENS = 7_974_397  # its size from Python 3.11.7's standard library (README), uint16 ids of a 32K BPE
_WORLD_IN_HEADER = re.compile(r"--(?:nproc|world-size|nproc-per-node)[ =](\d+)")
_TRAINS = re.compile(r"moe-overlap train |benchmarks/\w+\.py ")


def header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))])


def world_size(path: Path) -> int:
    """The GPU count a config is meant for: its header's command, else its parallel sizes' product."""
    found = {int(n) for n in _WORLD_IN_HEADER.findall(header(path))}
    assert len(found) <= 1, f"{path.name}: its header names several world sizes {sorted(found)}"
    if found:
        return found.pop()
    p = load_config(path).parallel
    return (p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size
            * p.expert_model_parallel_size)


@pytest.fixture(scope="module")
def corpus_stand_in(tmp_path_factory) -> Path:
    """A token file with the corpus's size, dtype and index (its ids all 0)."""
    path = tmp_path_factory.mktemp("stdlib") / "stdlib.bin"
    np.zeros(CORPUS_TOKENS, dtype="<u2").tofile(path)
    path.with_suffix(".json").write_text(json.dumps({
        "format": "moe_overlap token file v1", "dtype": "uint16", "documents": 1, "tokens": CORPUS_TOKENS,
        "tokenizer": "stand-in", "vocab_size": 32000}))
    return path


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_passes_the_checks_before_launch_for_its_gpu_count(path, corpus_stand_in, tmp_path):
    cfg = load_config(path)
    overrides = [f"train.output_dir={tmp_path}"]  # train.resume is checked against this run's own directory
    if cfg.data.path == CORPUS:
        overrides.append(f"data.path={corpus_stand_in}")
    cfg = load_config(path, overrides)
    device = "cuda" if cfg.train.device == "cuda" else "cpu"
    if _TRAINS.search(header(path)):
        check_before_launch(cfg, world_size(path), device)
    else:
        validate_for_world(cfg, world_size(path), device)


H100_BYTES, H200_BYTES = int(79.2 * 2**30), int(139.8 * 2**30)  # what torch reports for an 80 GB H100, an H200


@pytest.mark.parametrize("gpu_bytes", [H100_BYTES, H200_BYTES], ids=["h100", "h200"])
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_gpu_example_is_what_the_quick_start_promises(path, gpu_bytes, monkeypatch):
    """gpuN_FAMILY.yaml: N GPUs in its command, Hopper-sized GEMMs, the real-text corpus and its vocabulary, the
    fast path (auto's: on one host with peer access a device-planned exchange and graphed MoE layers, their
    micro-batches paired on two streams at 2 GPUs where the estimate fits: an H200, not an 80 GB H100; the
    distributed optimizer with both syncs overlapped) and learned balancing (expert bias or the auxiliary loss), and
    a header that says what it measured."""
    import types

    import torch

    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training import run_setup
    from moe_overlap.training.run_setup import mesh_layout

    cfg = load_config(path)
    m, o, t = cfg.model, cfg.overlap, cfg.train
    assert world_size(path) == int(re.match(r"gpu(\d+)_", path.name).group(1))
    assert f"moe-overlap train configs/{path.name} --nproc {world_size(path)}" in header(path)
    assert "Measured:" in header(path)
    assert m.hidden_size >= 2048 and t.precision == "bf16" and t.device == "cuda"
    assert (cfg.data.path, cfg.data.dtype, m.vocab_size) == (CORPUS, "uint16", 32000)
    assert o.moe_pipeline and (o.moe_planning, t.moe_cuda_graph) == ("auto", "auto")  # the fabric decides
    monkeypatch.setattr(run_setup, "exchange_choice", lambda *args: ("device", "sm_push", ""))  # one NVLink host
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        total_memory=gpu_bytes))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    run_setup.resolve_by_fabric(cfg, Mesh.planned(mesh_layout(cfg, world_size(path)), 0), torch.device("cuda"))
    on_streams = world_size(path) == 2 and gpu_bytes == H200_BYTES
    assert (o.moe_planning, t.moe_cuda_graph, o.overlap_moe_expert_parallel_comm) == ("device", True, on_streams)
    # unpaired with each token once per rank (the fine ones), the backward's transfer back beside the wgrads
    assert o.delay_wgrad_compute is (not on_streams and o.moe_dispatch_once_per_rank)
    assert t.use_distributed_optimizer and o.overlap_grad_sync and o.overlap_param_sync
    assert not m.moe_router_force_load_balancing
    assert m.moe_router_enable_expert_bias or m.moe_aux_loss_coeff > 0


def test_a_missing_corpus_fails_in_one_line_naming_the_command_that_makes_it(tmp_path):
    missing = tmp_path / "corpus" / "stdlib.bin"
    cfg = load_config(EXAMPLES[0], [f"data.path={missing}", f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        check_before_launch(cfg, world_size(EXAMPLES[0]), "cuda")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"data.path='{missing}': no such token file; ")
    assert f"`python benchmarks/prepare_stdlib_corpus.py {missing.parent}`" in message


def test_a_missing_token_file_of_another_name_names_the_ways_to_make_one(tmp_path):
    cfg = load_config(EXAMPLES[0], [f"data.path={tmp_path / 'mine.bin'}", f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"no such token file; make one with `moe-overlap data prepare "):
        check_before_launch(cfg, world_size(EXAMPLES[0]), "cuda")


def test_the_world_size_is_checked_before_launch(tmp_path, corpus_stand_in):
    cfg = load_config(EXAMPLES[0], [f"data.path={corpus_stand_in}", f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^parallel.expert_model_parallel_size="):
        check_before_launch(cfg, 3, "cuda")


def test_train_nproc_beyond_the_visible_gpus_fails_before_launch(monkeypatch, capsys):
    import torch

    from moe_overlap.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["train", str(EXAMPLES[0]), "--nproc", "2"]) == 2
    assert capsys.readouterr().err == ("moe-overlap: config error: --nproc=2: needs a GPU per rank "
                                       "(train.device=cuda): 1 visible\n")
