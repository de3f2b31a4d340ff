"""A built-in real-text corpus that needs no download: the Python standard library's own sources.

``ensure_builtin_dataset(data_dir)`` returns a dataset prefix usable as ``--data-path``. On the
first call it builds, offline and deterministically, a corpus of the running interpreter's
standard-library ``.py`` files (sorted by relative path; test directories, site-packages and
``__pycache__`` skipped; whole files, taken in order until about ``max_bytes``), one document per
file, writes it as JSON lines and tokenizes it with megatron.training.preprocess's ``preprocess``
(eod appended). The result is cached under ``data_dir`` (default: ``data/`` at the repository
root) under a name that identifies the corpus (Python version and a hash of the file list and
sizes) and the tokenizer; it is rebuilt only when its .bin or .idx is missing. Building goes to
temporary names that are renamed at the end, under a lock file, so concurrent callers (several
ranks on one machine) build it once and never see a half-written dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import List, Optional, Tuple

from megatron.training.known_warnings import silence_known_warnings
from megatron.training.preprocess import preprocess

__all__ = ["ensure_builtin_dataset", "builtin_corpus_files", "builtin_dataset_prefix",
           "DEFAULT_DATA_DIR", "DEFAULT_MAX_BYTES"]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT / "data"
DEFAULT_MAX_BYTES = 6_000_000
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def builtin_corpus_files(source_dir=None, max_bytes: int = DEFAULT_MAX_BYTES) -> List[Tuple[str, Path, int]]:
    """The corpus files as (relative posix path, path, size), in corpus order.

    All non-empty ``.py`` files under ``source_dir`` (default: the running interpreter's stdlib
    directory) outside SKIP_DIRS and hidden directories, sorted by relative path, taken whole
    until their total reaches ``max_bytes`` (the file that crosses it is the last one).
    """
    root = Path(source_dir) if source_dir is not None else _stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus source directory not found: {root}")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                rel = path.relative_to(root).as_posix()
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                if size > 0:
                    found.append((rel, path, size))
    found.sort(key=lambda item: item[0])
    chosen, total = [], 0
    for item in found:
        if total >= max_bytes:
            break
        chosen.append(item)
        total += item[2]
    return chosen


def _tokenizer_tag(tokenizer) -> str:
    if tokenizer is None:
        return "ByteLevelTokenizer"
    identity = getattr(tokenizer, "unique_identifiers", None)
    kind = getattr(tokenizer, "tokenizer_type", type(tokenizer).__name__)
    if kind == "ByteLevelTokenizer":
        return kind
    digest = hashlib.md5(json.dumps(identity, default=str, sort_keys=True).encode(),
                         usedforsecurity=False).hexdigest()[:8]
    return f"{kind}-{digest}"


def builtin_dataset_prefix(data_dir, files, tokenizer=None) -> str:
    """The cached dataset's prefix for these corpus files and this tokenizer."""
    h = hashlib.md5(usedforsecurity=False)
    for rel, _, size in files:
        h.update(f"{rel}\0{size}\n".encode())
    py = f"py{sys.version_info[0]}.{sys.version_info[1]}"
    name = f"stdlib-{py}-{h.hexdigest()[:8]}-{_tokenizer_tag(tokenizer)}"
    return os.path.join(os.fspath(data_dir), name, "corpus_text_document")


def _exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def ensure_builtin_dataset(data_dir=None, tokenizer_type: str = "ByteLevelTokenizer",
                           vocab_file=None, merge_file=None, tokenizer_model=None, vocab_size=None,
                           *, tokenizer=None, source_dir=None, max_bytes: int = DEFAULT_MAX_BYTES,
                           workers: int = 1, progress: bool = True, quiet: bool = False) -> str:
    """Return the prefix of the built-in stdlib-source dataset, building it if missing.

    ``tokenizer`` (an object from build_tokenizer) wins over ``tokenizer_type`` and its files.
    ``source_dir`` replaces the stdlib directory (tests point it at a small tree). NullTokenizer
    cannot read source text and is refused.
    """
    if tokenizer is None:
        if tokenizer_type == "NullTokenizer":
            from megatron.training.tokenizer import TokenizerError

            raise TokenizerError("the built-in dataset is text; NullTokenizer reads only integer ids")
        if tokenizer_type not in (None, "ByteLevelTokenizer"):
            from megatron.training.tokenizer import build_tokenizer

            tokenizer = build_tokenizer(tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
                                        tokenizer_model=tokenizer_model, vocab_size=vocab_size)
    data_dir = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    files = builtin_corpus_files(source_dir, max_bytes)
    if not files:
        raise FileNotFoundError(f"no .py files for the built-in corpus under "
                                f"{source_dir if source_dir is not None else _stdlib_dir()}")
    prefix = builtin_dataset_prefix(data_dir, files, tokenizer)
    if _exists(prefix):
        return prefix

    out_dir = os.path.dirname(prefix)
    os.makedirs(out_dir, exist_ok=True)
    lock_path = os.path.join(out_dir, ".build.lock")
    with open(lock_path, "a+") as lock:
        try:
            import fcntl

            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        except ImportError:  # not POSIX: the atomic renames still keep readers safe
            pass
        if _exists(prefix):  # another process built it while this one waited
            return prefix
        if tokenizer is None:
            from megatron.training.tokenizer import build_tokenizer

            tokenizer = build_tokenizer("ByteLevelTokenizer")
        total = sum(size for _, _, size in files)
        if not quiet:
            print(f"building the built-in dataset: {len(files)} Python stdlib files "
                  f"({total / 1e6:.1f} MB) -> {prefix}", file=sys.stderr, flush=True)
        t0 = time.time()
        jsonl = os.path.join(out_dir, f".corpus.tmp-{os.getpid()}.jsonl")
        try:
            with open(jsonl, "w", encoding="utf-8") as f:
                for rel, path, _ in files:
                    text = path.read_bytes().decode("utf-8", errors="replace")
                    f.write(json.dumps({"text": text, "path": rel}, ensure_ascii=False))
                    f.write("\n")
            silence_known_warnings()  # preprocess imports megatron-core
            base = prefix[: -len("_text_document")]
            built = preprocess(jsonl, base, tokenizer, json_keys=("text",), workers=workers,
                               append_eod=True, progress=progress, log_interval=20)
            assert built["text"] == prefix, (built, prefix)
        finally:
            try:
                os.remove(jsonl)
            except FileNotFoundError:
                pass
        if not quiet:
            print(f"built the built-in dataset in {time.time() - t0:.1f} s", file=sys.stderr,
                  flush=True)
    return prefix


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m megatron.training.builtin_data`: build if missing, print the prefix."""
    import argparse

    p = argparse.ArgumentParser(description="Build (if missing) the built-in dataset and print "
                                            "its --data-path prefix.")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    print(ensure_builtin_dataset(args.data_dir, workers=args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
