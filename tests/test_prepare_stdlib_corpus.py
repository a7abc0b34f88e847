"""benchmarks/prepare_stdlib_corpus.py on a slice of this Python's standard library: the manifest says what was
read and written, the token file is what it says, and a second run writes the same bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.prepare_stdlib_corpus import main


def test_prepares_a_deterministic_corpus_with_its_manifest(tmp_path):
    argv = ["--max-mb", "0.15", "--vocab", "600", "--workers", "1"]
    manifest = main([str(tmp_path / "a"), *argv])
    assert manifest == {**manifest, "files": manifest["files"], "vocab_size": 600, "dtype": "uint16",
                        "token_file": "stdlib.bin", "tokenizer": "stdlib.tokenizer", "max_mb": 0.15}
    assert 0 < manifest["bytes"] <= 150_000 and manifest["files"] == manifest["documents"] > 1
    tokens = np.fromfile(tmp_path / "a" / "stdlib.bin", dtype="<u2")
    assert manifest["tokens"] == len(tokens) and manifest["token_file_bytes"] == 2 * len(tokens)
    assert tokens.max() < 600 and (tokens == 0).sum() == manifest["files"]  # EOS (id 0) after each file
    assert manifest["bytes"] / manifest["tokens"] > 1.5  # merges happened: fewer tokens than bytes
    index = json.loads((tmp_path / "a" / "stdlib.json").read_text())
    assert not any("site-packages" in path for path in index["inputs"])
    again = main([str(tmp_path / "b"), *argv])
    assert again["sha256"] == manifest["sha256"] and json.loads((tmp_path / "b" / "stdlib.json").read_text())[
        "inputs"] == index["inputs"]
    with pytest.raises(SystemExit, match="is not empty"):
        main([str(tmp_path / "a"), *argv])
