"""Training data: byte tokenizer, token splits and a deterministic, data-parallel-sharded batch sampler.

Everything the sampler returns is a pure function of (seed, step) and the sizes, so resuming needs only
the step number, and any data-parallel layout sees the same global batch as a single process: rank d
takes the d-th contiguous slice of it, which keeps the micro-batch order of gradient accumulation. Context
parallel ranks of one data-parallel rank read the same samples and keep their local sequences (chunks r and
2*CP-1-r, distributed/context_parallel.py) of the inputs and of the labels.

Tokens come from the bundled corpus, a token file (memory-mapped) or a synthetic source (``data.path:
synthetic:uniform | synthetic:zipf:S``): a virtual stream of SYNTHETIC_TOKENS ids in which the id at each
position is a pure function of (train.seed, position), so it needs no file and every layout reads the same
windows; it is split, sampled and evaluated exactly as a file is.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from moe_overlap.config import Config, ConfigError, SyntheticSource, synthetic_source
from moe_overlap.distributed.context_parallel import split_sequence
from moe_overlap.training.token_file import TOKEN_DTYPES, check_token_index

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (input_ids, labels), int64 [micro_batch_size, seq_length]

# A synthetic source's virtual length, that of a 32 MiB uint16 file: an epoch of a bench config (4096-token
# sequences, 32K tokens a step, 5% held out) is 486 steps, data.validation_fraction holds out its tail as for a
# file, and an epoch's permutation of samples stays small (1M samples of 16 tokens).
SYNTHETIC_TOKENS = 2**24

# Where a missing token file comes from, for its error line.
_MAKE_A_TOKEN_FILE = ("make one with `moe-overlap data prepare INPUT... --tokenizer DIR --out PREFIX` (the Python "
                      "standard library as real text: `python benchmarks/prepare_stdlib_corpus.py DIR`), or use null "
                      "(the bundled corpus), synthetic:uniform or synthetic:zipf:S")
# The real-text corpus's token file, DIR/stdlib.bin, as benchmarks/prepare_stdlib_corpus.py DIR writes it (the GPU
# examples in configs/ read data/stdlib/stdlib.bin): its error line names the one command that makes it.
STDLIB_CORPUS_PREFIX = "stdlib"  # DIR/stdlib.bin, .json, .tokenizer/


def _how_to_make(file_path: Path) -> str:
    """What makes a missing token file: the command that writes the standard-library corpus there, else the ways to
    make one."""
    if file_path.name != f"{STDLIB_CORPUS_PREFIX}.bin":
        return _MAKE_A_TOKEN_FILE
    return (f"make it with `python benchmarks/prepare_stdlib_corpus.py {file_path.parent}` (the Python standard "
            "library as real text with its 32K BPE vocabulary; about 5 minutes on 2 cores, needs `tokenizers`: "
            "pip install -e '.[hf]'; copy the directory to a machine without them)")


class ByteTokenizer:
    """UTF-8 bytes as token ids: no vocabulary file, and any text round-trips."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        """Inverse of encode; bytes that do not form UTF-8 (e.g. a cut sequence) become U+FFFD."""
        id_array = np.asarray(ids, dtype=np.int64).reshape(-1)
        if id_array.size and (id_array.min() < 0 or id_array.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}) for ByteTokenizer, "
                             f"got range [{id_array.min()}, {id_array.max()}]")
        return id_array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _token_dtype(dtype: str) -> np.dtype:
    if dtype not in TOKEN_DTYPES:
        raise ConfigError("data.dtype", dtype, f"must be one of {', '.join(TOKEN_DTYPES)}")
    return TOKEN_DTYPES[dtype]


def load_bundled_corpus() -> np.ndarray:
    """The bundled public-domain text (moe_overlap/data/corpus.txt, see NOTICE.md) as byte tokens."""
    text = (resources.files("moe_overlap") / "data" / "corpus.txt").read_text(encoding="utf-8")
    return ByteTokenizer().encode(text)


class SyntheticTokens:
    """A synthetic source's virtual token stream: the id at position p is a pure function of (seed, p), drawn
    uniformly over [0, vocab_size) or by Zipf's law (id r with probability proportional to (r + 1)^-S).

    It offers what the splits and the sampler use of a token array: ``len``, slices (the splits: views of one
    stream, so train and validation windows differ) and integer-array indexing (the windows), as int64 ids.
    Each position's uniform variate is SplitMix64's output for it, a counter-based generator: any window is
    drawn on its own, in any order, on any rank, at numpy speed.
    """

    def __init__(self, source: SyntheticSource, vocab_size: int, seed: int, positions: range = range(SYNTHETIC_TOKENS)):
        self.source, self.vocab_size, self.seed, self.positions = source, vocab_size, seed, positions
        if source.distribution == "zipf":  # the inverse CDF over ids, searched by each variate
            weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -source.exponent
            self._cdf = np.cumsum(weights) / weights.sum()

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, key):
        if isinstance(key, slice):
            positions = self.positions[key]
            if positions.step != 1:
                raise ValueError(f"a synthetic token stream slices with step 1, got {key}")
            return SyntheticTokens(self.source, self.vocab_size, self.seed, positions)
        index = np.asarray(key, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"positions [{index.min()}, {index.max()}] outside a stream of {len(self)} tokens")
        variates = _uniform_variates(self.seed, index + self.positions.start)
        if self.source.distribution == "uniform":
            ids = (variates * self.vocab_size).astype(np.int64)
        else:
            ids = np.searchsorted(self._cdf, variates, side="right")
        return np.minimum(ids, self.vocab_size - 1)  # a variate within rounding of 1


_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (uint64 arithmetic wraps, as intended)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _uniform_variates(seed: int, positions: np.ndarray) -> np.ndarray:
    """Position p's variate in [0, 1): output p of a SplitMix64 stream whose state starts at mix(seed)."""
    with np.errstate(over="ignore"):
        state = _mix64(np.array([seed], dtype=np.uint64) * _GOLDEN_GAMMA + _GOLDEN_GAMMA)
        bits = _mix64(state + (positions.astype(np.uint64) + np.uint64(1)) * _GOLDEN_GAMMA)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


Tokens = np.ndarray | SyntheticTokens  # what the splits, the sampler and the evaluation batches read


def load_data(cfg: Config) -> tuple[Tokens, Tokens]:
    """The run's (train, validation) tokens, checked before any step: a token file against its index
    (:func:`check_token_index`) and the vocabulary, and room in the validation split for train.eval_iters."""
    d, m, t = cfg.data, cfg.model, cfg.train
    check_token_index(d.path, d.dtype, m.vocab_size)
    train, validation = load_token_splits(d.path, d.dtype, d.validation_fraction, seq_length=m.seq_length,
                                          vocab_size=m.vocab_size, seed=t.seed)
    if t.eval_interval:
        check_eval_fits(validation, m.seq_length, t.eval_iters, t.global_batch_size)
    return train, validation


def describe_source(cfg: Config) -> str:
    """Where the run's tokens come from, in one line (``moe-overlap info``); reads no file."""
    d = cfg.data
    held_out = f"the last {d.validation_fraction:g} held out for validation"
    synthetic = synthetic_source(d.path)
    if synthetic is not None:
        law = "uniform" if synthetic.distribution == "uniform" else f"Zipf (s={synthetic.exponent:g})"
        return (f"{d.path}: {law} ids over model.vocab_size={cfg.model.vocab_size} from train.seed={cfg.train.seed}, "
                f"{SYNTHETIC_TOKENS:,} virtual tokens, {held_out}")
    if d.path is None:
        return f"the bundled corpus (byte-level tokens), {held_out}"
    return f"{d.path} ({d.dtype} tokens), {held_out}"


def load_token_splits(path: str | os.PathLike | None, dtype: str, validation_fraction: float,
                      seq_length: int = 1, vocab_size: int | None = None, seed: int = 0) -> tuple[Tokens, Tokens]:
    """(train, validation) tokens; validation is the contiguous tail of `validation_fraction`.

    path None: the bundled corpus, byte-tokenised. A synthetic source (``synthetic:...``): SYNTHETIC_TOKENS
    ids over [0, vocab_size) drawn from ``seed`` (:class:`SyntheticTokens`). Otherwise a flat file of `dtype`
    tokens, memory-mapped read-only so it is never loaded whole. Both splits must hold one sample of
    seq_length + 1 tokens; pass model.seq_length so a too-small file fails here rather than in the sampler.
    With ``vocab_size``, a file's ids are checked to lie in [0, vocab_size) (:func:`check_token_ids`).
    """
    token_dtype = _token_dtype(dtype)
    if not 0 < validation_fraction <= 0.5:
        raise ConfigError("data.validation_fraction", validation_fraction, "must be in (0, 0.5]")
    synthetic = synthetic_source(None if path is None else str(path))
    if path is None:
        tokens = load_bundled_corpus()
        source = "the bundled corpus"
    elif synthetic is not None:
        if vocab_size is None:
            raise ValueError(f"data.path={path!r} draws ids over the vocabulary: pass vocab_size")
        tokens = SyntheticTokens(synthetic, vocab_size, seed)
        source = "the synthetic stream"
    else:
        file_path = Path(path).expanduser()
        if not file_path.is_file():
            raise ConfigError("data.path", str(path), f"no such token file; {_how_to_make(file_path)}")
        size = file_path.stat().st_size
        if size == 0 or size % token_dtype.itemsize:
            raise ConfigError("data.path", str(path), f"file size {size} B must be a positive multiple of "
                              f"{token_dtype.itemsize} B (data.dtype={dtype}); is data.dtype right?")
        tokens = np.memmap(file_path, dtype=token_dtype, mode="r")
        source = "the file"
        if vocab_size is not None:
            check_token_ids(tokens, vocab_size, str(path))

    sample_tokens = seq_length + 1
    if len(tokens) < 2 * sample_tokens:  # validation_fraction <= 0.5, so the train split is never the smaller
        raise ConfigError("data.path", path, f"{source} holds {len(tokens)} tokens; a train and a validation "
                          f"sample of model.seq_length+1={sample_tokens} tokens each need {2 * sample_tokens}")
    num_validation = int(len(tokens) * validation_fraction)
    if num_validation < sample_tokens:
        raise ConfigError("data.validation_fraction", validation_fraction,
                          f"leaves {num_validation} of {len(tokens)} tokens for validation; one sample needs "
                          f"model.seq_length+1={sample_tokens}")
    split = len(tokens) - num_validation
    return tokens[:split], tokens[split:]


# Tokens scanned per numpy call: large enough to run at memory speed, small enough to stop near the first bad id.
_SCAN_CHUNK = 1 << 24


def check_token_ids(tokens: np.ndarray, vocab_size: int, source: str) -> None:
    """Fail on the first id outside [0, vocab_size), naming its position: one sequential pass over the file
    (memory-mapped, at memory bandwidth), so a bad id fails the start instead of a step hours later."""
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = np.asarray(tokens[start:start + _SCAN_CHUNK])
        if chunk.max(initial=0) >= vocab_size:
            position = start + int(np.argmax(chunk >= vocab_size))
            raise ConfigError("data.path", source, f"token {int(tokens[position])} at position {position} (byte "
                              f"{position * tokens.dtype.itemsize}) is outside the vocabulary [0, model.vocab_size="
                              f"{vocab_size}); is data.dtype right, or model.vocab_size too small?")


def write_token_file(path: str | os.PathLike, tokens, dtype: str) -> None:
    """Write tokens as the flat little-endian file load_token_splits reads; refuses ids that would wrap."""
    token_dtype = _token_dtype(dtype)
    token_array = np.asarray(tokens).reshape(-1)
    if token_array.size and not np.issubdtype(token_array.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {token_array.dtype}")
    limit = np.iinfo(token_dtype).max
    if token_array.size and (token_array.min() < 0 or token_array.max() > limit):
        raise ValueError(f"token ids span [{token_array.min()}, {token_array.max()}], "
                         f"outside [0, {limit}] of data.dtype={dtype}")
    token_array.astype(token_dtype).tofile(Path(path).expanduser())


def _windows(tokens: Tokens, sample_indices: np.ndarray, seq_length: int) -> torch.Tensor:
    """Sample i is tokens[i*S : i*S + S + 1]; one fancy-index read, so a memmap reads only those rows."""
    offsets = sample_indices.astype(np.int64)[:, None] * seq_length + np.arange(seq_length + 1)
    return torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))


def _to_micro_batches(windows: torch.Tensor, micro_batch_size: int, cp_rank: int = 0,
                      cp_size: int = 1) -> list[MicroBatch]:
    return [tuple(split_sequence(ids, 1, cp_rank, cp_size).contiguous() for ids in (chunk[:, :-1], chunk[:, 1:]))
            for chunk in windows.split(micro_batch_size)]


def _count_samples(tokens: Tokens, seq_length: int) -> int:
    if seq_length < 1:
        raise ConfigError("model.seq_length", seq_length, "must be >= 1")
    num_samples = (len(tokens) - 1) // seq_length
    if num_samples < 1:
        raise ConfigError("model.seq_length", seq_length,
                          f"a sample needs model.seq_length+1={seq_length + 1} tokens; the split holds {len(tokens)}")
    return num_samples


def _check_dp(dp_rank: int, dp_size: int) -> None:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")


class BatchSampler:
    """Shuffled, epoch-wrapping training batches, sharded over data-parallel ranks.

    Samples are windows of seq_length+1 tokens at offsets i*seq_length (neighbours share one token, the
    label of the last position). Each epoch is a permutation of the sample indices drawn from (seed, epoch);
    step s's global batch is positions [s*G, (s+1)*G) of the concatenated epoch permutations, so a batch
    may straddle an epoch boundary and a corpus smaller than G samples simply wraps. DP rank d takes the
    d-th contiguous G/dp slice and cuts it into micro-batches, so the ranks' micro-batches in rank order
    are the dp_size=1 micro-batches. CP rank c keeps its local sequence of each.
    """

    def __init__(self, tokens: Tokens, seq_length: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, cp_rank: int = 0, cp_size: int = 1):
        self.num_samples = _count_samples(tokens, seq_length)
        if micro_batch_size < 1:
            raise ConfigError("train.micro_batch_size", micro_batch_size, "must be >= 1")
        _check_dp(dp_rank, dp_size)
        if global_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
            raise ConfigError("train.global_batch_size", global_batch_size,
                              f"must be a positive multiple of train.micro_batch_size x data-parallel size "
                              f"= {micro_batch_size} x {dp_size}")
        if seed < 0:
            raise ConfigError("train.seed", seed, "must be >= 0")
        self.tokens, self.seq_length, self.seed = tokens, seq_length, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.num_micro_batches = global_batch_size // (micro_batch_size * dp_size)
        self._permutations: dict[int, np.ndarray] = {}  # only the epochs the last step touched

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """Sample order of one epoch; depends on (seed, epoch) only."""
        return np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.num_samples)

    def sample_indices(self, step: int) -> np.ndarray:
        """Indices of this rank's samples at `step`, in micro-batch order."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        per_rank = self.global_batch_size // self.dp_size
        first = step * self.global_batch_size + self.dp_rank * per_rank
        positions = np.arange(first, first + per_rank, dtype=np.int64)
        epochs, within_epoch = np.divmod(positions, self.num_samples)
        self._permutations = {int(e): self._permutations[e] if e in self._permutations
                              else self.epoch_permutation(int(e)) for e in np.unique(epochs).tolist()}
        indices = np.empty_like(positions)
        for epoch, permutation in self._permutations.items():
            in_epoch = epochs == epoch
            indices[in_epoch] = permutation[within_epoch[in_epoch]]
        return indices

    def micro_batches(self, step: int) -> list[MicroBatch]:
        """This rank's (input_ids, labels) micro-batches of `step`; int64 CPU tensors [mbs, seq_length / CP]."""
        windows = _windows(self.tokens, self.sample_indices(step), self.seq_length)
        return _to_micro_batches(windows, self.micro_batch_size, self.cp_rank, self.cp_size)


def check_eval_fits(validation: Tokens, seq_length: int, eval_iters: int, global_batch_size: int) -> int:
    """The validation windows an evaluation reads, train.eval_iters global batches of them; they must fit the
    validation split. Returns their number."""
    available = _count_samples(validation, seq_length)
    needed = eval_iters * global_batch_size
    if needed > available:
        raise ConfigError("train.eval_iters", eval_iters,
                          f"evaluates {eval_iters} x train.global_batch_size={global_batch_size} = {needed} samples of "
                          f"model.seq_length+1={seq_length + 1} tokens; the validation split holds {available}: lower "
                          "train.eval_iters, or raise data.validation_fraction")
    return needed


def eval_batches(tokens: Tokens, seq_length: int, micro_batch_size: int, eval_iters: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, cp_rank: int = 0, cp_size: int = 1) -> list[MicroBatch]:
    """This rank's share of a fixed validation set: the first eval_iters * global_batch_size windows.

    Each data-parallel rank gets an equal contiguous share, so the mean of the ranks' mean losses is the
    single-process mean loss over the same windows.
    """
    if micro_batch_size < 1:
        raise ConfigError("train.micro_batch_size", micro_batch_size, "must be >= 1")
    _check_dp(dp_rank, dp_size)
    if global_batch_size % (micro_batch_size * dp_size):
        raise ConfigError("train.global_batch_size", global_batch_size,
                          f"must be a positive multiple of train.micro_batch_size x data-parallel size "
                          f"= {micro_batch_size} x {dp_size}")
    per_rank = check_eval_fits(tokens, seq_length, eval_iters, global_batch_size) // dp_size
    rank_indices = np.arange(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return _to_micro_batches(_windows(tokens, rank_indices, seq_length), micro_batch_size, cp_rank, cp_size)
