"""Every bad input of a training run is one line on stderr naming what is wrong and what is allowed, exit code 2,
no traceback (``--debug`` raises instead); with ``--nproc`` the data (token file, synthetic source, room for
train.eval_iters) and resume checks fail before any rank starts."""

from __future__ import annotations

import numpy as np
import pytest

from moe_overlap.cli import main
from moe_overlap.config import ConfigError
from moe_overlap.training.data import write_token_file
from tests.long_run import train_argv


def one_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("text,value,fragment", [
    ("model:\n  hidden_size: 64\n bad: 1\n", "c.yaml:3:2'", "not valid YAML: expected <block end>"),
    ("train:\n  lr: [0.1, 0.2\n", "c.yaml:3:1'", "not valid YAML: expected ',' or ']'"),
    ("model:\n\thidden_size: 64\n", "c.yaml:2:1'", "not valid YAML: found character '\\t'"),
    ("- model\n- train\n", "c.yaml'", "holds a list; the YAML must be a mapping of sections (model, parallel"),
    ("42\n", "c.yaml'", "holds the single value 42; the YAML must be a mapping of sections"),
    ("", "c.yaml'", "is empty; the YAML must be a mapping of sections"),
    ("# nothing but a comment\n", "c.yaml'", "is empty"),
], ids=["indent", "unclosed-list", "tab", "list", "scalar", "empty", "comment-only"])
def test_bad_config_file(tmp_path, capsys, text, value, fragment):
    (tmp_path / "c.yaml").write_text(text)
    assert main(["train", str(tmp_path / "c.yaml")]) == 2
    line = one_line(capsys)
    assert line.startswith(f"moe-overlap: config error: config='{tmp_path}/{value}: {fragment}"), line
    with pytest.raises(ConfigError):  # --debug: the exception itself, with its traceback
        main(["train", str(tmp_path / "c.yaml"), "--debug"])


@pytest.mark.parametrize("override,fragment", [
    ("train.max_steps", "override='train.max_steps': has no '=': expected section.field=value"),
    ("train.lr=[1,", "override='train.lr=[1,': the value is not valid YAML"),
    ("train.resume=maybe", "train.resume='maybe': expected true or false or one of 'auto', 'required'"),
    ("train.exit_duration_min=0", "train.exit_duration_min=0.0: must be > 0 minutes (or null: no limit)"),
])
def test_bad_override(tmp_path, capsys, override, fragment):
    assert main(train_argv(tmp_path, override)) == 2
    assert one_line(capsys).startswith(f"moe-overlap: config error: {fragment}")


def _token_file(path, tokens) -> str:
    write_token_file(path, np.asarray(tokens), "uint16")
    return str(path)


@pytest.mark.parametrize("make,fragment", [
    (lambda d: str(d / "missing.bin"), "no such token file; make one with `moe-overlap data prepare INPUT... "
                                       "--tokenizer DIR --out PREFIX` (the Python standard library as real text: "
                                       "`python benchmarks/prepare_stdlib_corpus.py DIR`), or use null (the bundled "
                                       "corpus), synthetic:uniform or synthetic:zipf:S"),
    (lambda d: _token_file(d / "empty.bin", []), "file size 0 B must be a positive multiple of 2 B"),
    (lambda d: _token_file(d / "short.bin", range(20)), "the file holds 20 tokens; a train and a validation sample of "
                                                        "model.seq_length+1=17 tokens each need 34"),
    (lambda d: _token_file(d / "vocab.bin", [7] * 1000 + [300] + [7] * 99),
     "token 300 at position 1000 (byte 2000) is outside the vocabulary [0, model.vocab_size=256)"),
], ids=["missing", "empty", "shorter-than-a-sequence", "outside-the-vocabulary"])
def test_bad_data_fails_before_any_rank_starts(tmp_path, capsys, make, fragment):
    path = make(tmp_path)
    assert main(train_argv(tmp_path, f"data.path={path}", "--nproc", "2")) == 2
    line = one_line(capsys)
    assert line.startswith(f"moe-overlap: config error: data.path='{path}': {fragment}"), line


@pytest.mark.parametrize("spec", ["synthetic:zipf", "synthetic:zipf:-1", "synthetic:foo"])
def test_malformed_synthetic_source_fails_before_any_rank_starts(tmp_path, capsys, spec):
    assert main(train_argv(tmp_path, f"data.path={spec}", "--nproc", "2")) == 2
    assert one_line(capsys) == (f"moe-overlap: config error: data.path={spec!r}: a synthetic source is "
                                "synthetic:uniform or synthetic:zipf:S with a Zipf exponent S > 0 (e.g. "
                                "synthetic:zipf:1.1)")


@pytest.mark.parametrize("launch", [["--nproc", "2"], ["parallel.expert_model_parallel_size=1"]],
                         ids=["before-any-rank", "single-process"])
def test_validation_split_too_small_for_eval_iters(tmp_path, capsys, launch):
    """The bundled corpus's validation tail (5%) holds 1,575 samples of 16 + 1 tokens; 200 evaluation iterations
    of 8 samples need 1,600."""
    assert main(train_argv(tmp_path, "train.eval_interval=4", "train.eval_iters=200", *launch)) == 2
    assert one_line(capsys) == ("moe-overlap: config error: train.eval_iters=200: evaluates 200 x "
                                "train.global_batch_size=8 = 1600 samples of model.seq_length+1=17 tokens; the "
                                "validation split holds 1575: lower train.eval_iters, or raise "
                                "data.validation_fraction")


def test_resume_settings_against_the_checkpoint_directory(tmp_path, capsys):
    argv = train_argv(tmp_path, "parallel.expert_model_parallel_size=1", "train.max_steps=1")
    assert main([*argv, "train.resume=required", "--nproc", "2"]) == 2
    assert one_line(capsys) == (f"moe-overlap: config error: train.resume='required': no checkpoint under "
                                f"{tmp_path / 'checkpoints'} to resume from")
    assert main(argv) == 0  # auto: no checkpoint, starts fresh and saves step 1
    capsys.readouterr()
    assert main([*argv, "train.resume=false"]) == 2
    assert one_line(capsys) == (f"moe-overlap: config error: train.resume=False: {tmp_path / 'checkpoints'} holds "
                                "checkpoints up to step 1, which this run's saves would overwrite: use "
                                "train.resume=auto to continue from them, or another checkpoint.dir")


def test_checkpoint_of_another_model_names_every_mismatch(tmp_path, capsys):
    argv = train_argv(tmp_path, "parallel.expert_model_parallel_size=1", "train.max_steps=1")
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv[:-1], "train.max_steps=2", "model.num_layers=2", "model.moe_layer_freq=[0,1]",
                 "model.ffn_hidden_size=128"]) == 2
    line = one_line(capsys)
    assert line.startswith(f"moe-overlap: config error: checkpoint.dir='{tmp_path / 'checkpoints' / 'step_00000001'}'"
                           ": holds a checkpoint of another model ("), line
    assert "(27 mismatches)" in line, line  # 6 shapes (fc1, fc2 and their moments), 21 tensors of layer 2
    for fragment in ("model.layers.0.mlp.linear_fc1.weight is [2, 64, 32] there, [2, 128, 32] here",
                     "optimizer.layers.0.mlp.linear_fc2.weight.exp_avg is [32, 64] there, [32, 128] here",
                     "model.layers.2.mlp.experts.7.w2 is there, not in this model",
                     "resume it with the model it was saved with, or point checkpoint.dir elsewhere"):
        assert fragment in line, line


def test_the_trainer_checks_the_data_before_it_builds_a_model(monkeypatch, tmp_path):
    """A plain torchrun launch skips --nproc's checks: the trainer's own data check comes before the model (and
    its graphs, which take minutes on a GPU)."""
    import torch

    from moe_overlap.config import load_config
    from moe_overlap.distributed.mesh import Mesh
    from moe_overlap.training import trainer

    def built_first(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(trainer, "build_model", built_first)
    from tests.long_run import REPO

    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [f"data.path={tmp_path / 'missing.bin'}",
                                            "parallel.expert_model_parallel_size=1"])
    with pytest.raises(ConfigError, match="missing.bin"):
        trainer.Trainer(cfg, Mesh.single(), torch.device("cpu"))
