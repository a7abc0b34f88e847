"""Data pipeline: tokenizer, bundled corpus, token files, synthetic sources, and the DP-sharded deterministic
sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_overlap.config import ConfigError, load_config, synthetic_source
from moe_overlap.training.data import (SYNTHETIC_TOKENS, BatchSampler, ByteTokenizer, SyntheticTokens, eval_batches,
                                       load_data, load_token_splits, write_token_file)
from tests.test_master import run_and_save


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


def _synthetic(spec: str = "synthetic:zipf:1.1", vocab: int = 1000, seed: int = 0) -> SyntheticTokens:
    return SyntheticTokens(synthetic_source(spec), vocab, seed)


@pytest.mark.parametrize("source", ["file", "synthetic"])
@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_dp_shards_concatenate_to_the_single_process_batch(dp_size, source):
    tokens = _tokens(5000) if source == "file" else _synthetic()[:5000]
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
    reference = eval_batches(validation, 16, 2, 2, 8, 0, 1)  # 2 evaluation iterations of 8 samples
    assert torch.equal(_concat(reference)[0][:, 0], torch.from_numpy(validation[np.arange(16) * 16]))
    sharded = [eval_batches(validation, 16, 2, 2, 8, rank, dp_size) for rank in range(dp_size)]
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
        (lambda: eval_batches(np.arange(1000), 16, 2, 1, 6, 0, 2), "train.global_batch_size"),
        (lambda: eval_batches(np.arange(1000), 16, 2, 10, 8, 0, 1), "train.eval_iters"),
        (lambda: load_token_splits("synthetic:uniform", "uint16", 0.1, seq_length=16), "vocab_size"),
    ]
    for call, field in cases:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            call()
    with pytest.raises(ValueError, match="dp_rank"):
        BatchSampler(np.arange(1000), 16, 8, 4, 2, 2, seed=0)


# ---------------------------------------------------------------------------------------- synthetic sources


def test_synthetic_ids_are_a_pure_function_of_seed_and_position():
    stream = _synthetic()
    window = np.arange(1000, 1017)
    assert np.array_equal(stream[window], _synthetic()[window])  # another instance (another rank) reads the same
    assert np.array_equal(stream[window[::-1]], stream[window][::-1])  # in any order
    assert np.array_equal(stream[900:1100][window - 900], stream[window])  # a split is a view of one stream
    assert not np.array_equal(stream[window], _synthetic(seed=1)[window])
    assert not np.array_equal(stream[window], stream[window + 17])  # the next window is other tokens
    assert stream[window].dtype == np.int64 and len(stream) == SYNTHETIC_TOKENS
    with pytest.raises(IndexError):
        stream[500:600][np.array([100])]


def test_synthetic_distributions_over_the_vocabulary():
    ids = np.arange(2_000_000)
    uniform = np.bincount(_synthetic("synthetic:uniform", 100)[ids], minlength=100)
    assert uniform.sum() == len(ids) and abs(uniform / 20_000 - 1).max() < 0.05  # 20,000 each, sampling error ~0.7%
    for exponent in (0.7, 1.3):
        counts = np.bincount(_synthetic(f"synthetic:zipf:{exponent}", 1000)[ids], minlength=1000)
        assert counts.argmax() == 0 and counts[-1] > 0
        for rank in (2, 4, 8):  # P(id r - 1) is proportional to r^-S
            assert abs(counts[0] / counts[rank - 1] / rank**exponent - 1) < 0.05, (exponent, rank)


def test_synthetic_splits_sampler_and_evaluation(tmp_path):
    cfg = load_config(None, ["data.path=synthetic:zipf:1.2", "model.vocab_size=500", "model.seq_length=32",
                             "train.eval_iters=3", "train.eval_interval=5", "train.global_batch_size=16"])
    train, validation = load_data(cfg)
    assert len(validation) == int(SYNTHETIC_TOKENS * 0.05) and len(train) + len(validation) == SYNTHETIC_TOKENS
    batches = eval_batches(validation, 32, 4, 3, 16, 0, 1)
    assert len(batches) == 12 and int(_concat(batches)[0].max()) < 500
    sampler = BatchSampler(train, 32, 16, 4, 0, 1, seed=cfg.train.seed)
    train_windows = set(map(tuple, _concat(sampler.micro_batches(0))[0].tolist()))
    assert not train_windows & set(map(tuple, _concat(batches)[0].tolist()))  # train and validation windows differ
    resampled = BatchSampler(*load_data(cfg)[:1], 32, 16, 4, 0, 1, seed=cfg.train.seed)
    assert torch.equal(_concat(resampled.micro_batches(0))[0], _concat(sampler.micro_batches(0))[0])


@pytest.mark.parametrize("spec", ["synthetic:zipf", "synthetic:zipf:-1", "synthetic:zipf:0", "synthetic:zipf:inf",
                                  "synthetic:zipf:x", "synthetic:foo", "synthetic:uniform:2"])
def test_malformed_synthetic_source_names_the_field(spec):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"data.path={spec}"])
    assert str(info.value) == (f"data.path={spec!r}: a synthetic source is synthetic:uniform or synthetic:zipf:S with "
                               "a Zipf exponent S > 0 (e.g. synthetic:zipf:1.1)")
    with pytest.raises(ConfigError, match=r"data\.dtype='uint32': has no effect with data.path='synthetic:uniform'"):
        load_config(None, ["data.path=synthetic:uniform", "data.dtype=uint32"])


def test_resume_on_synthetic_data_is_bit_for_bit(tmp_path):
    """The sampler's position is the step: a resumed run reads the windows the straight run read."""
    synthetic = {"data.path": "synthetic:zipf:1.1"}
    straight = run_and_save(str(tmp_path / "straight"), 1, 4, None, 4, **synthetic)
    first = run_and_save(str(tmp_path / "resumed"), 1, 2, 2, 4, **synthetic)
    assert first + run_and_save(str(tmp_path / "resumed"), 1, 4, None, 4, **synthetic) == straight
    assert straight != run_and_save(str(tmp_path / "uniform"), 1, 4, None, 4, **{"data.path": "synthetic:uniform"})
