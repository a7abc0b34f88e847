"""Data pipeline: tokenizer, bundled corpus, token files, and the DP-sharded deterministic sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_overlap.training.data import (BatchSampler, ByteTokenizer, eval_batches, load_token_splits,
                                       write_token_file)


def _tokens(n: int, vocab: int = 1000) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, size=n)


def _concat(micro_batches) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in micro_batches]), torch.cat([y for _, y in micro_batches])


def test_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "In the beginning — naïve café, 日本語 🙂\n"
    ids = tokenizer.encode(text)
    assert ids.dtype == np.uint16 and tokenizer.vocab_size == 256
    assert len(ids) == len(text.encode("utf-8")) and ids.max() < 256
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(torch.from_numpy(ids.astype(np.int64))) == text
    assert tokenizer.decode(ids[:-2]).endswith("\ufffd")  # a cut multi-byte sequence is replaced, not raised


def test_bundled_corpus_is_english_ascii_and_large_enough():
    train, validation = load_token_splits(None, "uint16", 0.05)
    text = ByteTokenizer().decode(np.concatenate([train, validation]))
    assert 300_000 <= len(text) <= 600_000
    assert text.isascii()
    assert text.startswith("Genesis 1\n\n1 In the beginning God created the heaven and the earth.")
    words = text.lower().split()
    assert words.count("the") > 0.03 * len(words) and words.count("and") > 0.03 * len(words)
    assert len(validation) == int(len(text) * 0.05)


@pytest.mark.parametrize("dtype, vocab", [("uint16", 65535), ("uint32", 2**32 - 1)])
def test_token_file_is_memmapped_and_validation_is_the_tail(tmp_path, dtype, vocab):
    tokens = np.random.default_rng(1).integers(0, vocab, size=10_000, endpoint=True)
    path = tmp_path / f"tokens_{dtype}.bin"
    write_token_file(path, tokens, dtype)
    assert path.stat().st_size == tokens.size * np.dtype(dtype).itemsize
    train, validation = load_token_splits(str(path), dtype, 0.1, seq_length=16)
    assert isinstance(train, np.memmap) and isinstance(validation, np.memmap)
    assert len(validation) == 1000 and len(train) == 9000
    np.testing.assert_array_equal(train, tokens[:9000])
    np.testing.assert_array_equal(validation, tokens[9000:])
    (x, y), = BatchSampler(train, 16, 4, 4, 0, 1, seed=0).micro_batches(0)
    windows = np.stack([tokens[i * 16:i * 16 + 17] for i in range((9000 - 1) // 16)])
    for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
        assert (windows == row).all(axis=1).any()  # every sample is a window of the train split


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_dp_shards_concatenate_to_the_single_process_batch(dp_size):
    tokens = _tokens(5000)
    seq_length, global_batch, micro_batch = 16, 16, 2
    reference = BatchSampler(tokens, seq_length, global_batch, micro_batch, 0, 1, seed=7)
    ranks = [BatchSampler(tokens, seq_length, global_batch, micro_batch, rank, dp_size, seed=7)
             for rank in range(dp_size)]
    for step in (0, 1, 9, 40):  # 40 is past the first epoch of 312 samples
        expected = reference.micro_batches(step)
        sharded = [mb for sampler in ranks for mb in sampler.micro_batches(step)]
        assert len(sharded) == len(expected) == global_batch // micro_batch
        for (x, y), (x_ref, y_ref) in zip(sharded, expected):
            assert x.dtype == y.dtype == torch.int64 and x.shape == (micro_batch, seq_length)
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_samples_are_shifted_windows_at_sequence_offsets():
    tokens = np.arange(1001)
    seq_length = 10
    sampler = BatchSampler(tokens, seq_length, 8, 4, 0, 1, seed=0)
    for x, y in sampler.micro_batches(3):
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert torch.all(x[:, 0] % seq_length == 0)
        assert torch.equal(x - x[:, :1], torch.arange(seq_length).expand_as(x))


def test_sampler_is_deterministic_and_steps_differ():
    tokens = _tokens(5000)
    first, second = (BatchSampler(tokens, 32, 8, 4, 0, 1, seed=3) for _ in range(2))
    for step in (5, 0, 5):  # order of calls must not matter
        assert all(torch.equal(a[0], b[0]) for a, b in zip(first.micro_batches(step), second.micro_batches(step)))
    assert not torch.equal(_concat(first.micro_batches(0))[0], _concat(first.micro_batches(1))[0])
    other_seed = BatchSampler(tokens, 32, 8, 4, 0, 1, seed=4)
    assert not torch.equal(_concat(first.micro_batches(0))[0], _concat(other_seed.micro_batches(0))[0])


def test_epochs_wrap_with_a_fresh_permutation():
    tokens = np.arange(10 * 4 + 1)  # 10 samples of seq_length 4
    sampler = BatchSampler(tokens, 4, 4, 2, 0, 1, seed=11)
    starts = [int(s) for step in range(5) for s in _concat(sampler.micro_batches(step))[0][:, 0] // 4]
    first_epoch, second_epoch = starts[:10], starts[10:]
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(10))  # step 2 straddles the boundary
    assert first_epoch != second_epoch
    # Fewer samples than one global batch: the batch wraps over several epochs.
    tiny = BatchSampler(np.arange(3 * 4 + 1), 4, 8, 2, 0, 1, seed=0)
    assert len(_concat(tiny.micro_batches(0))[0]) == 8


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_eval_batches_are_fixed_and_dp_mean_equals_single_process(dp_size):
    validation = _tokens(2000)
    reference = eval_batches(validation, 16, 2, 8, 0, 1)
    assert torch.equal(_concat(reference)[0][:, 0], torch.from_numpy(validation[np.arange(16) * 16]))
    sharded = [eval_batches(validation, 16, 2, 8, rank, dp_size) for rank in range(dp_size)]
    assert all(len(shard) == 8 // dp_size for shard in sharded)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip([mb for shard in sharded for mb in shard], reference))
    per_rank_means = [torch.stack([y.float().mean() for _, y in shard]).mean() for shard in sharded]
    single_mean = torch.stack([y.float().mean() for _, y in reference]).mean()
    assert torch.allclose(torch.stack(per_rank_means).mean(), single_mean)


def test_bad_inputs_name_their_field(tmp_path):
    good = tmp_path / "good.bin"
    write_token_file(good, np.arange(1000), "uint16")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    cases = [
        (lambda: load_token_splits(str(tmp_path / "missing.bin"), "uint16", 0.1), "data.path"),
        (lambda: load_token_splits(str(odd), "uint16", 0.1), "data.path"),
        (lambda: load_token_splits(str(good), "int8", 0.1), "data.dtype"),
        (lambda: load_token_splits(None, "float32", 0.1), "data.dtype"),
        (lambda: load_token_splits(str(good), "uint16", 0.0), "data.validation_fraction"),
        (lambda: load_token_splits(str(good), "uint16", 0.6), "data.validation_fraction"),
        (lambda: load_token_splits(str(good), "uint16", 0.01, seq_length=64), "data.validation_fraction"),
        (lambda: load_token_splits(str(good), "uint16", 0.5, seq_length=600), "data.path"),
        (lambda: write_token_file(tmp_path / "x.bin", [70_000], "uint16"), "data.dtype"),
        (lambda: BatchSampler(np.arange(1000), 16, 12, 4, 0, 2, seed=0), "train.global_batch_size"),
        (lambda: BatchSampler(np.arange(1000), 16, 0, 4, 0, 1, seed=0), "train.global_batch_size"),
        (lambda: BatchSampler(np.arange(1000), 16, 8, 0, 0, 1, seed=0), "train.micro_batch_size"),
        (lambda: BatchSampler(np.arange(10), 16, 8, 4, 0, 1, seed=0), "model.seq_length"),
        (lambda: BatchSampler(np.arange(1000), 16, 8, 4, 0, 1, seed=-1), "train.seed"),
        (lambda: eval_batches(np.arange(1000), 16, 2, 3, 0, 2), "train.eval_iters"),
        (lambda: eval_batches(np.arange(1000), 16, 2, 100, 0, 1), "data.validation_fraction"),
    ]
    for call, field in cases:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            call()
    with pytest.raises(ValueError, match="dp_rank"):
        BatchSampler(np.arange(1000), 16, 8, 4, 2, 2, seed=0)
