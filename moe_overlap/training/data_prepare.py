"""`moe-overlap data prepare`: text and JSONL through a Hugging Face tokenizer into the trainer's token file.

PREFIX.bin holds every document's tokens followed by the tokenizer's EOS token, documents in input order,
as the flat little-endian file the trainer memory-maps (``data.path``): uint16 when the vocabulary fits,
else uint32 (``data.dtype``). PREFIX.json indexes it: documents, tokens, dtype, the tokenizer and its
vocabulary size; the trainer checks the config against it (token_file.check_token_index).

Inputs: ``.jsonl`` files hold one JSON object per line whose ``field`` (default "text") is a document;
any other file is one document of UTF-8 text. The tokenizer loads from local files only (a directory, or
a name already in the Hugging Face cache): nothing is downloaded. Or ``train_bpe`` trains one on the inputs
first (:func:`train_bpe`), saved as PREFIX.tokenizer/. Files are tokenized in parallel, each by one worker,
into a part file that is appended to PREFIX.bin in input order.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moe_overlap.training.token_file import INDEX_FORMAT, TOKEN_DTYPES, index_path, token_dtype_for

_BATCH_DOCUMENTS = 256  # documents encoded per tokenizer call
EOS_TOKEN = "<|endoftext|>"  # the end-of-document token of a tokenizer trained here
_NEEDS_HF = "data prepare needs Hugging Face tokenizers: pip install transformers tokenizers"


def load_tokenizer(name_or_dir: str):
    """A Hugging Face tokenizer from local files (a directory, or a name in the local cache)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(_NEEDS_HF) from None
    try:
        return AutoTokenizer.from_pretrained(name_or_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"--tokenizer {name_or_dir!r}: no tokenizer there (a directory with tokenizer files, or "
                         f"a name already in the Hugging Face cache; nothing is downloaded): "
                         f"{str(err).splitlines()[0]}") from None


def train_bpe(paths: list[Path], field: str, vocab_size: int, out_dir: Path) -> None:
    """A byte-level BPE (GPT-2's pre-tokenizer: any text round-trips, whitespace and indentation included) of at
    most ``vocab_size`` tokens, EOS_TOKEN among them, trained on the documents of ``paths`` and saved to
    ``out_dir`` as a Hugging Face tokenizer. Deterministic: the same documents give the same tokenizer (the
    trainer draws nothing at random; ties between merges go by the pair's bytes)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise ImportError(_NEEDS_HF) from None
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if not len(alphabet) + 1 <= vocab_size <= 2**32:
        raise ValueError(f"--train-bpe {vocab_size}: a byte-level vocabulary holds the {len(alphabet)} bytes and "
                         f"{EOS_TOKEN}: give {len(alphabet) + 1} to {2**32}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator((document for path in paths for document in read_documents(path, field)), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN).save_pretrained(out_dir)


def read_documents(path: Path, field: str):
    """The documents of one input file, in order."""
    if path.suffix != ".jsonl":
        yield path.read_text(encoding="utf-8")
        return
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(f"{path}:{number}: no text field {field!r} (choose the field with --field)")
            yield record[field]


_worker_tokenizer = None  # the fast tokenizer's Rust backend, rebuilt in each worker from its JSON


def _init_worker(tokenizer_json: str) -> None:
    from tokenizers import Tokenizer

    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)
    _worker_tokenizer.no_truncation()  # whole documents, whatever the saved tokenizer was set to
    _worker_tokenizer.no_padding()


def _tokenize_file(job: tuple[int, str, str, str, str, int]) -> tuple[int, int, int]:
    """Tokenize one input into its part file; returns (job index, documents, tokens)."""
    index, path, field, part, dtype, eos = job
    documents = tokens = 0
    batch: list[str] = []

    def flush(out) -> int:
        written = 0
        for encoding in _worker_tokenizer.encode_batch(batch):
            ids = encoding.ids if encoding.ids and encoding.ids[-1] == eos else encoding.ids + [eos]
            np.asarray(ids, dtype=dtype).tofile(out)
            written += len(ids)
        batch.clear()
        return written

    with open(part, "wb") as out:
        for document in read_documents(Path(path), field):
            batch.append(document)
            documents += 1
            if len(batch) == _BATCH_DOCUMENTS:
                tokens += flush(out)
        tokens += flush(out) if batch else 0
    return index, documents, tokens


def prepare(inputs: list[str], tokenizer: str | None, out: str, field: str = "text", workers: int | None = None,
            train_bpe_vocab: int | None = None) -> dict:
    """Tokenize ``inputs`` into OUT.bin and OUT.json (neither may exist); returns the index. With
    ``train_bpe_vocab`` instead of ``tokenizer``: first train a BPE of that many tokens on the inputs
    (:func:`train_bpe`), saved as OUT.tokenizer/, and tokenize with it."""
    if (tokenizer is None) == (train_bpe_vocab is None):
        raise ValueError("give one of a tokenizer (--tokenizer) and a vocabulary size to train one (--train-bpe)")
    paths = [Path(p).expanduser() for p in inputs]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such input file")
    bin_path = Path(out + ".bin").expanduser()
    trained_dir = bin_path.with_suffix(".tokenizer")
    for target in (bin_path, index_path(bin_path)) + ((trained_dir,) if train_bpe_vocab is not None else ()):
        if target.exists():
            raise FileExistsError(f"{target}: already exists; choose another --out (nothing is overwritten)")

    if train_bpe_vocab is not None:
        train_bpe(paths, field, train_bpe_vocab, trained_dir)
        tokenizer = str(trained_dir)
    hf_tokenizer = load_tokenizer(tokenizer)  # before any worker starts: a bad name fails once
    vocab_size, eos = len(hf_tokenizer), hf_tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"--tokenizer {tokenizer!r} defines no EOS token (eos_token in its tokenizer_config.json); "
                         "documents are separated by it")
    if not hf_tokenizer.is_fast:
        raise ValueError(f"--tokenizer {tokenizer!r} has no fast (Rust) version: tokenizer.json is needed")
    tokenizer_json = hf_tokenizer.backend_tokenizer.to_str()
    dtype = token_dtype_for(vocab_size)
    parts_dir = bin_path.with_name(bin_path.name + ".parts")
    shutil.rmtree(parts_dir, ignore_errors=True)  # left by an interrupted run
    parts_dir.mkdir(parents=True)
    parts = [parts_dir / f"{i:06d}.bin" for i in range(len(paths))]
    jobs = [(i, str(path), field, str(part), TOKEN_DTYPES[dtype].str, eos)
            for i, (path, part) in enumerate(zip(paths, parts))]
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    counts: dict[int, tuple[int, int]] = {}
    try:
        with tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, desc="tokenize",
                  dynamic_ncols=True) as bar, contextlib.ExitStack() as stack:
            if workers == 1:
                _init_worker(tokenizer_json)
                results = map(_tokenize_file, jobs)
            else:  # spawned: a forked tokenizer's own threads would deadlock
                pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(workers, _init_worker,
                                                                                     (tokenizer_json,)))
                results = pool.imap_unordered(_tokenize_file, jobs)
            for index, documents, tokens in results:
                counts[index] = (documents, tokens)
                bar.update(paths[index].stat().st_size)
        tmp = bin_path.with_name(bin_path.name + ".tmp")
        with open(tmp, "wb") as merged:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, merged)
        os.replace(tmp, bin_path)
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)
    index = {"format": INDEX_FORMAT, "dtype": dtype, "documents": sum(d for d, _ in counts.values()),
             "tokens": sum(t for _, t in counts.values()), "tokenizer": tokenizer, "vocab_size": vocab_size,
             "eos_token_id": eos, "field": field, "inputs": [str(p) for p in paths]}
    index_path(bin_path).write_text(json.dumps(index, indent=2) + "\n")
    return index
