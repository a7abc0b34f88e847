"""model.embedding_init_std: the token embedding's own init std (null: model.init_method_std, as every other
weight). It changes the embedding's values only, keeps the init a function of the seed and logical name (a TP
rank's block and a last pipeline stage's tied copy are those of the one logical table), and a bad value is a
one-line config error naming the field."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_overlap.config import ConfigError, load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.layers.embedding import Embedding
from moe_overlap.layers.init import init_parameters
from moe_overlap.models.mixtral import build_model

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
ONE_RANK = ["parallel.expert_model_parallel_size=1", "model.vocab_size=1024"]


def tiny_model(*overrides: str, **kwargs):
    cfg = load_config(TINY, ONE_RANK + list(overrides))
    return build_model(cfg.model, Mesh.single(), "cpu", torch.float32, seed=7, **kwargs)


def test_embedding_std_follows_the_field_and_nothing_else_changes():
    default = dict(tiny_model().named_parameters())
    same = dict(tiny_model("model.embedding_init_std=null").named_parameters())
    large = dict(tiny_model("model.embedding_init_std=1.0").named_parameters())
    assert load_config(TINY, ONE_RANK).model.embedding_init_std is None
    assert default.keys() == same.keys() == large.keys()
    for name in default:
        assert torch.equal(default[name], same[name]), name  # null: today's init, bit for bit
        if name != "embedding.weight":
            assert torch.equal(default[name], large[name]), name
    assert abs(float(default["embedding.weight"].detach().std()) - 0.02) < 0.001  # model.init_method_std
    assert abs(float(large["embedding.weight"].detach().std()) - 1.0) < 0.02
    # the same draws, scaled: only the std differs
    torch.testing.assert_close(large["embedding.weight"], default["embedding.weight"] * 50)


def test_tp_block_and_tied_last_stage_copy_are_the_logical_tables():
    full = tiny_model("model.embedding_init_std=0.5").embedding.weight
    for rank in range(2):  # a TP rank's block of the vocabulary (layers/embedding.py), 2 TP ranks
        comm = SimpleNamespace(rank=rank, size=2, group=SimpleNamespace(ranks=(0, 1)))
        block = torch.nn.ModuleDict({"embedding": Embedding(1024, 128, comm)})  # its logical name: embedding.weight
        init_parameters(block, seed=7, std=0.02, num_layers=4, embedding_std=0.5)
        assert torch.equal(block["embedding"].weight, full[rank * 512:(rank + 1) * 512])
    # the last pipeline stage's copy of a tied table (it serves the output layer) starts equal to the first's
    tied = "model.share_embeddings_and_output_weights=true"
    first = tiny_model(tied, "model.embedding_init_std=0.5", layers=[0, 1], post_process=False)
    last = tiny_model(tied, "model.embedding_init_std=0.5", layers=[2, 3], pre_process=False)
    assert torch.equal(first.embedding.weight, last.embedding.weight)
    assert torch.equal(first.embedding.weight, full)


@pytest.mark.parametrize("value", ["0", "-1.0"])
def test_bad_value_is_a_one_line_error_naming_the_field(value):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ONE_RANK + [f"model.embedding_init_std={value}"])
    message = str(info.value)
    assert message.startswith("model.embedding_init_std=") and "\n" not in message
    assert "> 0" in message
