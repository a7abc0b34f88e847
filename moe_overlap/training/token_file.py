"""The token file on disk, as `moe-overlap data prepare` writes it and the trainer reads it: PREFIX.bin, every
token as a flat little-endian integer (so a file moves between machines unchanged), and PREFIX.json, its index
(documents, tokens, dtype, the tokenizer and its vocabulary size), which the config is checked against."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from moe_overlap.config import ConfigError, synthetic_source

TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

INDEX_FORMAT = "moe_overlap token file v1"


def index_path(bin_path: str | os.PathLike) -> Path:
    """PREFIX.json beside PREFIX.bin."""
    path = Path(bin_path)
    return path.with_suffix(".json") if path.suffix == ".bin" else path.with_name(path.name + ".json")


def token_dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def check_token_index(path: str | None, dtype: str, vocab_size: int) -> None:
    """With PREFIX.json beside a token file: the file is whole, data.dtype is its dtype and the model's
    vocabulary holds the tokenizer's."""
    if path is None or synthetic_source(path) is not None or not index_path(Path(path).expanduser()).is_file():
        return  # the bundled corpus, a synthetic source, or a token file without an index
    index_file = index_path(Path(path).expanduser())
    index = json.loads(index_file.read_text())
    if index.get("format") != INDEX_FORMAT:
        return  # not ours: nothing to check against
    if index["dtype"] != dtype:
        raise ConfigError("data.dtype", dtype, f"{path} holds {index['dtype']} tokens (its index {index_file})")
    if index["vocab_size"] > vocab_size:
        raise ConfigError("model.vocab_size", vocab_size, f"must be >= {index['vocab_size']}, the vocabulary of "
                          f"tokenizer {index['tokenizer']!r} that wrote {path}")
    size = Path(path).expanduser().stat().st_size
    if size != index["tokens"] * np.dtype(dtype).itemsize:
        raise ConfigError("data.path", path, f"{size} bytes, its index {index_file} promises {index['tokens']} "
                          f"{dtype} tokens: truncated or rewritten?")
