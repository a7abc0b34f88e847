"""The installed Python's standard-library sources as a real-text token corpus, no download: routing as users see
it, beside the bundled byte-level corpus (72 distinct ids) and synthetic ids. Prepared through `moe-overlap data
prepare --train-bpe`: a 32K byte-level BPE trained on the same text, then each file one document.

    python benchmarks/prepare_stdlib_corpus.py data/stdlib
    moe-overlap train CONFIG data.path=data/stdlib/stdlib.bin model.vocab_size=32000

OUT_DIR receives stdlib.bin (uint16 ids, each file's tokens then <|endoftext|>), stdlib.json (its index, which the
trainer checks), stdlib.tokenizer/ (the BPE, a Hugging Face tokenizer) and manifest.json (Python version, stdlib
directory, files, bytes, tokens, vocabulary, the token file's SHA-256, the command). Files: every *.py under
sysconfig's stdlib directory outside site-packages that decodes as UTF-8, sorted, shuffled with a fixed seed (so
data.validation_fraction's tail is a sample of the library, not its alphabetical end) and taken while their bytes
add up to at most --max-mb. Deterministic: the same Python and arguments give the same bytes. Python 3.11.7's
library is 31.5 MB (all of it under the default 40 MB): 8.0M tokens, a 16 MB token file, ~5 minutes on 2 cores.
A machine without a network or `tokenizers` (a GPU host) takes a copy of OUT_DIR: training reads only
stdlib.bin and checks it against stdlib.json.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import random
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_overlap.cli import main as moe_overlap  # noqa: E402
from moe_overlap.training.data import STDLIB_CORPUS_PREFIX  # noqa: E402

SEED = 0  # the file order's shuffle


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="a new or empty directory")
    parser.add_argument("--max-mb", type=float, default=40.0,
                        help="cap on the text read, MB (1e6 bytes); at ~3.95 bytes a token, 40 MB stays under 24 MB of "
                             "uint16 tokens")
    parser.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary size (EOS included)")
    parser.add_argument("--workers", type=int, default=None, help="files tokenized in parallel (default: CPU count)")
    return parser.parse_args(argv)


def library_files(root: Path, max_bytes: int) -> tuple[list[Path], list[str]]:
    """The chosen files in corpus order, and the skipped ones (not UTF-8) relative to ``root``."""
    candidates = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in ("site-packages", "dist-packages")]
        candidates += [Path(directory) / name for name in names if name.endswith(".py")]
    candidates.sort()
    random.Random(SEED).shuffle(candidates)
    chosen, skipped, total = [], [], 0
    for path in candidates:
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(str(path.relative_to(root)))
            continue
        if total + len(data) > max_bytes:
            break
        chosen.append(path)
        total += len(data)
    return chosen, skipped


def main(argv=None) -> dict:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SystemExit(f"prepare_stdlib_corpus: {out_dir} is not empty (nothing is overwritten)")
    root = Path(sysconfig.get_paths()["stdlib"])
    files, skipped = library_files(root, int(args.max_mb * 1e6))
    if not files:
        raise SystemExit(f"prepare_stdlib_corpus: no file of {root} fits --max-mb {args.max_mb}")
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / STDLIB_CORPUS_PREFIX
    code = moe_overlap(["data", "prepare", *map(str, files), "--train-bpe", str(args.vocab), "--out", str(prefix),
                        *(["--workers", str(args.workers)] if args.workers else [])])
    if code:
        raise SystemExit(code)
    index = json.loads(prefix.with_suffix(".json").read_text())
    token_file = prefix.with_suffix(".bin")
    manifest = {
        "python": platform.python_version(), "stdlib": str(root), "seed": SEED, "max_mb": args.max_mb,
        "files": len(files), "skipped_not_utf8": skipped, "bytes": sum(path.stat().st_size for path in files),
        "documents": index["documents"], "tokens": index["tokens"], "vocab_size": index["vocab_size"],
        "dtype": index["dtype"], "token_file": token_file.name, "token_file_bytes": token_file.stat().st_size,
        "sha256": hashlib.sha256(token_file.read_bytes()).hexdigest(),
        "tokenizer": prefix.with_suffix(".tokenizer").name,
        "command": " ".join(["python benchmarks/prepare_stdlib_corpus.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.date.today().isoformat(),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"{out_dir}: {manifest['files']} files, {manifest['bytes'] / 1e6:.1f} MB of text -> {manifest['tokens']:,} "
          f"tokens ({manifest['token_file_bytes'] / 1e6:.1f} MB, vocabulary {manifest['vocab_size']}): "
          f"data.path={token_file} model.vocab_size={manifest['vocab_size']}")
    return manifest


if __name__ == "__main__":
    main()
