"""Tokenize a corpus into megatron-core IndexedDataset files (Megatron-LM's tools/preprocess_data.py).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my \\
        --tokenizer-type ByteLevelTokenizer --append-eod --workers 2

writes ``{output_prefix}_{key}_document.bin`` and ``.idx`` for each ``--json-keys`` key, with
megatron-core's IndexedDatasetBuilder; ``{output_prefix}_{key}_document`` is a --data-path.

Input:

* JSON lines (a file ending in .json or .jsonl): one JSON object per line; each key of
  --json-keys (default: text) must name a string. Blank lines are skipped.
* anything else is plain UTF-8 text: one document per paragraph, paragraphs separated by one or
  more blank (whitespace-only) lines; a document is its lines joined by "\\n", without the
  newline that ends its last line. Plain text has one key (the first of --json-keys).

As in Megatron-LM, each document is one sequence (no sentence splitting); --append-eod adds the
tokenizer's end-of-document id to it; an empty document stays an empty document (no sequence).
Tokens are stored as uint16 when the vocabulary has fewer than 65500 ids, else int32.

Bad input (a missing file, a malformed JSON line, a missing key, a bad tokenizer option) prints
one line on stderr and exits with status 2; no output file is left behind (everything is written
under temporary names and renamed at the end).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a file: make the repository root importable
    _ROOT = str(Path(__file__).resolve().parent.parent)
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)

from megatron.training.preprocess import PreprocessError, preprocess  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2 (as argparse), without the usage block
        self.exit(2, f"{self.prog}: error: {message}\n")


def get_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = _Parser(prog="preprocess_data.py",
                description="Tokenize JSON lines or plain text into megatron-core IndexedDataset files.")
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="a .json/.jsonl file (JSON lines) or plain text")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each JSON line (default: text)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer",
                   help="ByteLevelTokenizer (default), GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: a tokenizer.json or a local directory holding one")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: number of ids")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer worker processes")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between progress updates")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args(argv)
    prog = "preprocess_data.py"
    # Fail fast on the input, before the slow megatron.core import.
    if not os.path.exists(args.input):
        print(f"{prog}: error: input file not found: {args.input}", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"{prog}: error: --workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    from megatron.training.known_warnings import silence_known_warnings
    silence_known_warnings()
    from megatron.training.tokenizer import TokenizerError, build_tokenizer

    try:
        tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                                    merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                                    vocab_size=args.vocab_size)
        t0 = time.time()
        prefixes = preprocess(args.input, args.output_prefix, tokenizer, json_keys=args.json_keys,
                              workers=args.workers, append_eod=args.append_eod,
                              log_interval=args.log_interval)
    except (PreprocessError, TokenizerError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    for key, prefix in prefixes.items():
        print(f"{key}: {prefix}.bin / {prefix}.idx ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
