"""`moe-overlap data prepare` with a tokenizer built here (nothing downloaded), the trainer's checks of its
index, and the README's path end to end: import a Hugging Face model, train it on the prepared text, export
the run, and transformers computes the trained model's logits."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_overlap.cli import main
from moe_overlap.config import ConfigError, load_config
from moe_overlap.distributed.mesh import Mesh
from moe_overlap.training.token_file import check_token_index
from moe_overlap.training.trainer import Trainer
from tests.test_hf import our_logits, rel_err, tiny_hf_model


def corpus_lines() -> list[str]:
    text = (resources.files("moe_overlap") / "data" / "corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A 200-token BPE trained here on the bundled corpus, saved as a transformers tokenizer with an EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(corpus_lines()[:2000], trainers.BpeTrainer(vocab_size=200,
                                                                            special_tokens=["<unk>", "<eos>"]))
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def prepared(tokenizer_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """Tokens of a text file (one document) and a JSONL file (a document per record's "body"), in two
    workers; returns the prefix and the documents in order."""
    root = tmp_path_factory.mktemp("data")
    lines = corpus_lines()
    text, records = "\n".join(lines[:3000]), lines[3000:3400]
    (root / "book.txt").write_text(text)
    (root / "verses.jsonl").write_text("".join(json.dumps({"body": r, "id": i}) + "\n" for i, r in enumerate(records)))
    prefix = root / "corpus"
    assert main(["data", "prepare", str(root / "book.txt"), str(root / "verses.jsonl"), "--tokenizer",
                 str(tokenizer_dir), "--out", str(prefix), "--field", "body", "--workers", "2"]) == 0
    return prefix, [text, *records]


def test_prepare_writes_each_document_then_eos_with_an_index(tokenizer_dir, prepared):
    from transformers import AutoTokenizer

    prefix, documents = prepared
    index = json.loads(prefix.with_suffix(".json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = np.fromfile(prefix.with_suffix(".bin"), dtype="<u2")
    want = np.concatenate([np.array(ids + [tokenizer.eos_token_id]) for ids in tokenizer(documents)["input_ids"]])
    assert np.array_equal(tokens, want)
    assert index["documents"] == len(documents) == 401 and index["tokens"] == len(tokens)
    assert (index["dtype"], index["vocab_size"], index["eos_token_id"]) == ("uint16", 200, 1)


def test_prepare_refuses_bad_input_in_one_line(tokenizer_dir, prepared, tmp_path, capsys):
    prefix, _ = prepared
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    for argv, message in (
            ([str(bad), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "x")], f"{bad}:2: no text field"),
            ([str(bad), "--tokenizer", str(tmp_path / "none"), "--out", str(tmp_path / "y")], "no tokenizer there"),
            ([str(bad), "--tokenizer", str(tokenizer_dir), "--out", str(prefix)], "already exists")):
        assert main(["data", "prepare", *argv]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("moe-overlap:")]  # beside the progress bar
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


def test_prepare_trains_a_byte_level_bpe_deterministically(tmp_path):
    """--train-bpe: a BPE trained on the inputs (saved as PREFIX.tokenizer/, which transformers loads), the
    same bytes from the same inputs, and every document decodes back exactly, indentation included."""
    from transformers import AutoTokenizer

    documents = ["def f(x):\n    return x + 1\n", "\n".join(corpus_lines()[:400]), "class A:\n\tpass  # tab\n"]
    inputs = []
    for i, document in enumerate(documents):
        (tmp_path / f"doc{i}.txt").write_text(document)
        inputs.append(str(tmp_path / f"doc{i}.txt"))
    for run in ("a", "b"):
        assert main(["data", "prepare", *inputs, "--train-bpe", "400", "--out", str(tmp_path / run),
                     "--workers", "1"]) == 0
    tokens = (tmp_path / "a.bin").read_bytes()
    assert tokens == (tmp_path / "b.bin").read_bytes()
    assert (tmp_path / "a.tokenizer" / "tokenizer.json").read_text() == \
        (tmp_path / "b.tokenizer" / "tokenizer.json").read_text()
    index = json.loads((tmp_path / "a.json").read_text())
    assert (index["vocab_size"], index["documents"], index["tokenizer"]) == (400, 3, str(tmp_path / "a.tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a.tokenizer")
    ids = np.frombuffer(tokens, dtype="<u2").tolist()
    eos = tokenizer.eos_token_id
    assert tokenizer.eos_token == "<|endoftext|>" and ids.count(eos) == 3 and ids[-1] == eos
    ends = [i for i, token in enumerate(ids) if token == eos]
    decoded = [tokenizer.decode(ids[start + 1 if start else 0:end]) for start, end in zip([0] + ends, ends)]
    assert decoded == documents


def test_prepare_refuses_a_tokenizer_and_a_trained_one_together(tmp_path, capsys):
    (tmp_path / "doc.txt").write_text("text")
    with pytest.raises(SystemExit):  # argparse: one of --tokenizer, --train-bpe
        main(["data", "prepare", str(tmp_path / "doc.txt"), "--tokenizer", "x", "--train-bpe", "300", "--out", "y"])
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["data", "prepare", str(tmp_path / "doc.txt"), "--train-bpe", "100", "--out", str(tmp_path / "z")]) == 2
    assert "--train-bpe 100: a byte-level vocabulary holds the 256 bytes and <|endoftext|>: give 257" in \
        capsys.readouterr().err


def test_trainer_checks_the_index(prepared, tmp_path):
    prefix, _ = prepared
    path = str(prefix.with_suffix(".bin"))
    check_token_index(path, "uint16", 256)
    with pytest.raises(ConfigError, match="model.vocab_size=128: must be >= 200"):
        check_token_index(path, "uint16", 128)
    with pytest.raises(ConfigError, match="data.dtype='uint32'"):
        check_token_index(path, "uint32", 256)
    cut = tmp_path / "cut.bin"
    cut.write_bytes(Path(path).read_bytes()[:-2])
    (tmp_path / "cut.json").write_text(prefix.with_suffix(".json").read_text())
    with pytest.raises(ConfigError, match="truncated"):
        check_token_index(str(cut), "uint16", 256)


def test_train_an_imported_model_on_prepared_text_and_export_it(prepared, tmp_path):
    """The README's path: hf import, train on your text from it, hf export of the run (its latest checkpoint)."""
    import transformers as tf

    prefix, _ = prepared
    tiny_hf_model("mixtral").save_pretrained(tmp_path / "hf")
    assert main(["hf", "import", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--config-out",
                 str(tmp_path / "train.yaml")]) == 0
    run = tmp_path / "run"
    cfg = load_config(tmp_path / "train.yaml", [
        f"data.path={prefix}.bin", "model.seq_length=32", "train.micro_batch_size=4", "train.global_batch_size=8",
        "train.max_steps=8", "train.lr=0.01", "train.lr_warmup_steps=1", "train.eval_interval=0",
        f"train.output_dir={run}"])
    trainer = Trainer(cfg, Mesh.single(), torch.device("cpu"))
    history = trainer.fit()
    assert history[-1]["loss"] < history[0]["loss"]
    assert main(["hf", "export", str(run), str(tmp_path / "exported")]) == 0
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = our_logits(trainer.model.eval(), ids)
        got = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()(ids).logits
    assert rel_err(got, want) < 1e-5
