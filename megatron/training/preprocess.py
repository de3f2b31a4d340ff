"""Tokenizing a corpus into megatron-core IndexedDataset files: the library behind
tools/preprocess_data.py (Megatron-LM's script; its docstring describes the input formats) and
the built-in dataset (megatron.training.builtin_data).

``preprocess(input_path, output_prefix, tokenizer, json_keys)`` writes
``{output_prefix}_{key}_document.bin`` and ``.idx`` per key: JSON lines (.json, .jsonl; each
key names a string) or plain UTF-8 text (one document per paragraph, the first key only). Each
document is one sequence; ``append_eod`` adds the tokenizer's end-of-document id; tokens are
uint16 below 65500 ids, else int32. Bad input raises PreprocessError (one line) and leaves no
file behind.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import sys
import time
from typing import Dict, Iterator, List, Sequence, Tuple

_JSON_SUFFIXES = (".json", ".jsonl")


class PreprocessError(ValueError):
    """The input cannot be preprocessed (one-line message; the CLI exits with status 2)."""


def is_jsonl(path) -> bool:
    """Whether ``path`` is read as JSON lines (by its suffix) rather than plain text."""
    return os.fspath(path).lower().endswith(_JSON_SUFFIXES)


def output_prefix_for(output_prefix, key: str) -> str:
    """Megatron-LM's name of the dataset prefix for one JSON key."""
    return f"{os.fspath(output_prefix)}_{key}_document"


# --------------------------------------------------------------------------------------------
# reading (main process): items of (line number, payload)
# --------------------------------------------------------------------------------------------


def _jsonl_items(f: io.BufferedReader) -> Iterator[Tuple[int, bytes, int]]:
    for lineno, raw in enumerate(f, start=1):
        yield lineno, raw, len(raw)


def _text_items(f: io.BufferedReader) -> Iterator[Tuple[int, bytes, int]]:
    """Paragraphs: (first line number, the paragraph's bytes, bytes consumed)."""
    lines: List[bytes] = []
    start, consumed = 0, 0
    for lineno, raw in enumerate(f, start=1):
        consumed += len(raw)
        if raw.strip():
            if not lines:
                start = lineno
            lines.append(raw)
        elif lines:
            yield start, b"".join(lines), consumed
            lines, consumed = [], 0
    if lines:
        yield start, b"".join(lines), consumed


# --------------------------------------------------------------------------------------------
# encoding (worker processes)
# --------------------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(tokenizer, keys: Tuple[str, ...], jsonl: bool, append_eod: bool, dtype) -> None:
    _WORKER.update(tokenizer=tokenizer, keys=keys, jsonl=jsonl, append_eod=append_eod, dtype=dtype)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _encode(item: Tuple[int, bytes, int]):
    """-> (lineno, {key: ndarray} or None for a skipped line, error message or None, nbytes)."""
    import numpy

    lineno, raw, nbytes = item
    w = _WORKER
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return lineno, None, f"line {lineno}: not valid UTF-8 ({e.reason} at byte {e.start})", nbytes
    if w["jsonl"]:
        if not text.strip():
            return lineno, None, None, nbytes
        try:
            obj = json.loads(text.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            return lineno, None, f"line {lineno}: malformed JSON ({e.msg} at column {e.colno})", nbytes
        except ValueError as e:
            return lineno, None, f"line {lineno}: malformed JSON ({str(e).splitlines()[0]})", nbytes
        if not isinstance(obj, dict):
            return lineno, None, f"line {lineno}: expected a JSON object, got {type(obj).__name__}", nbytes
        texts = {}
        for key in w["keys"]:
            if key not in obj:
                return lineno, None, f"line {lineno}: missing key {key!r}", nbytes
            if not isinstance(obj[key], str):
                return lineno, None, (f"line {lineno}: key {key!r} is a "
                                      f"{type(obj[key]).__name__}, not a string"), nbytes
            texts[key] = obj[key]
    else:
        if text.endswith("\n"):
            text = text[:-1]
        if text.endswith("\r"):
            text = text[:-1]
        texts = {w["keys"][0]: text}
    out = {}
    tok = w["tokenizer"]
    for key, value in texts.items():
        try:
            ids = tok.tokenize(value)
        except ValueError as e:
            return lineno, None, f"line {lineno}: key {key!r}: {str(e).splitlines()[0]}", nbytes
        if w["append_eod"] and len(ids) > 0:
            ids = list(ids) + [tok.eod]
        out[key] = numpy.asarray(ids, dtype=w["dtype"])
    return lineno, out, None, nbytes


# --------------------------------------------------------------------------------------------
# the library function
# --------------------------------------------------------------------------------------------


def _remove(paths) -> None:
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def preprocess(input_path, output_prefix, tokenizer, json_keys: Sequence[str] = ("text",),
               workers: int = 1, append_eod: bool = True, log_interval: int = 1000,
               progress: bool = True, chunksize: int = 16) -> Dict[str, str]:
    """Tokenize ``input_path`` into ``{output_prefix}_{key}_document.{bin,idx}`` per key.

    Returns ``{key: dataset prefix}``. Raises PreprocessError on bad input; then no output file
    (nor temporary file) is left behind. ``workers`` > 1 tokenizes in a multiprocessing Pool
    (imap in chunks of ``chunksize`` items; order kept). ``log_interval`` is the number of
    documents between progress-bar updates.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    input_path = os.fspath(input_path)
    keys = tuple(json_keys) if not isinstance(json_keys, str) else (json_keys,)
    if not keys:
        raise PreprocessError("no --json-keys given")
    if len(set(keys)) != len(keys):
        raise PreprocessError(f"--json-keys has duplicates: {' '.join(keys)}")
    if not os.path.exists(input_path):
        raise PreprocessError(f"input file not found: {input_path}")
    if not os.path.isfile(input_path):
        raise PreprocessError(f"input is not a file: {input_path}")
    if not os.access(input_path, os.R_OK):
        raise PreprocessError(f"input file is not readable: {input_path}")
    jsonl = is_jsonl(input_path)
    if not jsonl:
        keys = keys[:1]
    workers = max(1, int(workers))
    log_interval = max(1, int(log_interval))

    prefixes = {key: output_prefix_for(output_prefix, key) for key in keys}
    out_dir = os.path.dirname(os.path.abspath(prefixes[keys[0]]))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise PreprocessError(f"cannot create output directory {out_dir}: {e.strerror}") from None
    tag = f".tmp-{os.getpid()}-{time.time_ns()}"
    tmp = {key: (p + tag + ".bin", p + tag + ".idx") for key, p in prefixes.items()}
    all_tmp = [path for pair in tmp.values() for path in pair]

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    if append_eod:
        tokenizer.eod  # fails early where the tokenizer has none

    total = os.path.getsize(input_path)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, dynamic_ncols=True,
                   desc=f"tokenizing {os.path.basename(input_path)}", mininterval=0.5,
                   delay=0.5)  # small inputs and early errors print no bar
    pool = None
    source = None
    builders = {}
    ok = False
    try:
        try:
            for key, (bin_path, _) in tmp.items():
                builders[key] = IndexedDatasetBuilder(bin_path, dtype=dtype)
        except OSError as e:
            raise PreprocessError(f"cannot write {e.filename}: {e.strerror}") from None
        init_args = (tokenizer, keys, jsonl, append_eod, dtype)
        source = open(input_path, "rb")
        items = _jsonl_items(source) if jsonl else _text_items(source)
        if workers > 1:
            pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=init_args)
            results = pool.imap(_encode, items, chunksize)
        else:
            _init_worker(*init_args)
            results = map(_encode, items)
        docs, pending = 0, 0
        for lineno, out, error, nbytes in results:
            pending += nbytes
            if error is not None:
                raise PreprocessError(f"{input_path}: {error}")
            if out is not None:
                for key, ids in out.items():
                    builders[key].add_document(ids, [int(ids.size)] if ids.size > 0 else [])
                docs += 1
                if bar is not None and docs % log_interval == 0:
                    bar.update(pending)
                    pending = 0
        if bar is not None:
            bar.update(pending)
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        try:
            for key, (_, idx_path) in tmp.items():
                builders[key].finalize(idx_path)
            for key, (bin_path, idx_path) in tmp.items():
                os.replace(bin_path, prefixes[key] + ".bin")
                os.replace(idx_path, prefixes[key] + ".idx")
        except OSError as e:
            raise PreprocessError(f"cannot write {e.filename or out_dir}: {e.strerror}") from None
        ok = True
    finally:
        if pool is not None:  # stop the workers (and imap's feeder) before closing the input
            pool.terminate()
            pool.join()
        if source is not None:
            source.close()
        if bar is not None:
            if not ok:
                bar.leave = False  # the error message is the one line left on stderr
            bar.close()
        if not ok:
            for b in builders.values():
                try:
                    b.data_file.close()
                except Exception:
                    pass
            _remove(all_tmp)
        _WORKER.clear()
    return prefixes
