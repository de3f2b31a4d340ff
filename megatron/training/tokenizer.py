"""Tokenizers by Megatron-LM's --tokenizer-type names, as megatron-core tokenizer objects.

``build_tokenizer(tokenizer_type, ...)`` returns a
``megatron.core.tokenizers.text.text_tokenizer.MegatronTokenizerText``: what megatron-core's
GPTDataset / MockGPTDataset and tools/preprocess_data.py need (``eod``, ``vocab_size``,
``tokenize(text) -> list[int]``, ``detokenize(ids) -> str``, ``unique_identifiers`` for the
dataset cache hash; ``pad`` only where the tokenizer has a pad token).

Types (all offline):

* ``ByteLevelTokenizer`` (default): ids 0..255 are the UTF-8 bytes, 256 is the end-of-document
  id; vocab_size 257; no pad token. Needs no files. detokenize drops the eod id and decodes the
  bytes (invalid UTF-8, e.g. a character cut at a sample edge, becomes U+FFFD).
* ``GPT2BPETokenizer``: GPT-2 byte-level BPE from ``vocab_file`` (vocab.json) and ``merge_file``
  (merges.txt), via the ``tokenizers`` package; eod is ``<|endoftext|>``, vocab_size is the
  number of entries in vocab.json, as in Megatron-LM. ``<|endoftext|>`` written in the text is
  tokenized as plain text, as GPT-2's original encoder does.
* ``HuggingFaceTokenizer``: a local ``tokenizer.json`` (or a directory holding one, optionally
  with tokenizer_config.json / special_tokens_map.json naming eos/pad), via ``tokenizers``.
  tokenize adds no special tokens and detokenize drops them (megatron-core's defaults).
* ``NullTokenizer``: Megatron's: the text is whitespace-separated integer ids below
  ``vocab_size``; eod is ``vocab_size`` and the tokenizer's vocab_size is ``vocab_size + 1``.

Bad input raises ``TokenizerError`` (a ValueError) with a one-line message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, List, Literal, Optional, get_args

from megatron.core.tokenizers.text.libraries.bytelevel_tokenizer import ByteLevelTokenizer as _McoreByteLevel
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as _McoreNull
from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

__all__ = ["TOKENIZER_TYPES", "TokenizerType", "TokenizerError", "build_tokenizer",
           "MegatronTokenizerText"]

TokenizerType = Literal["ByteLevelTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                        "NullTokenizer"]
TOKENIZER_TYPES: tuple[str, ...] = get_args(TokenizerType)

_TOKENIZERS_PIN = "tokenizers==0.23.3"


class TokenizerError(ValueError):
    """A tokenizer could not be built from the given type and files (one-line message)."""


def _as_id_list(ids: Any) -> List[int]:
    """ids from a list, a numpy array or a torch tensor, as a list of Python ints."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


# --------------------------------------------------------------------------------------------
# library objects (the layer megatron-core calls "libraries"; MegatronTokenizerText wraps one)
# --------------------------------------------------------------------------------------------


class _ByteLevelLibrary(_McoreByteLevel):
    """megatron-core's ByteLevelTokenizer with 256 byte ids and eod = 256, and an exact round trip
    (megatron-core's ids_to_text strips trailing whitespace and decodes special ids as bytes)."""

    EOD = 256

    def __init__(self) -> None:
        super().__init__(special_tokens=None, vocab_size=self.EOD + 1, _eos_id=self.EOD,
                         _pad_id=None, _bos_id=None)
        self._built = True

    def text_to_ids(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def ids_to_text(self, ids) -> str:
        return bytes(i for i in _as_id_list(ids) if 0 <= i < self.EOD).decode("utf-8", errors="replace")

    @property
    def pad_id(self):
        if not self.__dict__.get("_built"):  # megatron-core's __init__ reads it
            return None
        raise AttributeError("ByteLevelTokenizer has no pad token")

    @property
    def unk_id(self):
        raise AttributeError("ByteLevelTokenizer has no unk token")


class _NullLibrary(_McoreNull):
    """megatron-core's NullTokenizer, splitting on any whitespace and checking the ids."""

    def text_to_ids(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            try:
                i = int(word)
            except ValueError:
                raise TokenizerError(
                    f"NullTokenizer takes whitespace-separated integer ids, got {word[:40]!r}") from None
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"NullTokenizer id {i} is outside [0, {self.vocab_size})")
            ids.append(i)
        return ids

    def ids_to_text(self, ids) -> str:
        return " ".join(str(i) for i in _as_id_list(ids))

    # Unused by this library; megatron-core's MegatronTokenizerText asks for them by name.
    eos_id = property(lambda self: self._eod_id)


def _import_tokenizers():
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise TokenizerError(
            f"this tokenizer type needs the 'tokenizers' package: pip install {_TOKENIZERS_PIN}") from None
    return tokenizers


class _HFTokenizersLibrary:
    """A ``tokenizers.Tokenizer`` with megatron-core's library interface."""

    def __init__(self, tok, eod: int, vocab_size: int, pad: Optional[int] = None,
                 bos: Optional[int] = None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tok
        self._eod = int(eod)
        self._vocab_size = int(vocab_size)
        self._pad = pad
        self._bos = bos
        self._skip_special = skip_special_tokens

    def text_to_ids(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def ids_to_text(self, ids) -> str:
        return self.tokenizer.decode(_as_id_list(ids), skip_special_tokens=self._skip_special)

    def text_to_tokens(self, text: str) -> List[str]:
        return self.tokenizer.encode(text, add_special_tokens=False).tokens

    def tokens_to_ids(self, tokens: Iterable[str]) -> List[int]:
        return [self.tokenizer.token_to_id(t) for t in tokens]

    def ids_to_tokens(self, ids) -> List[str]:
        return [self.tokenizer.id_to_token(i) for i in _as_id_list(ids)]

    def tokens_to_text(self, tokens) -> str:
        return self.ids_to_text(self.tokens_to_ids(tokens))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict:
        return {v: k for k, v in self.vocab.items()}

    @property
    def eod(self) -> int:
        return self._eod

    eos_id = eod

    @property
    def pad_id(self) -> int:
        if self._pad is None:
            raise AttributeError("this tokenizer has no pad token")
        return self._pad

    @property
    def bos_id(self):
        return self._bos

    @property
    def additional_special_tokens_ids(self) -> list:
        return []


# --------------------------------------------------------------------------------------------
# the megatron-core tokenizer object
# --------------------------------------------------------------------------------------------


class _ChameleonTextTokenizer(MegatronTokenizerText):
    """megatron-core's MegatronTokenizerText around one of the libraries above.

    ``identity`` (file paths, options; strings) goes into ``unique_identifiers``, which
    megatron-core hashes into the names of its dataset index caches.
    """

    def __init__(self, tokenizer_type: str, library, path: Optional[str], **identity: str) -> None:
        self._library = library
        self.tokenizer_type = tokenizer_type
        super().__init__(path, {"library": tokenizer_type, "tokenizer_type": tokenizer_type,
                                "class_name": type(self).__name__, "class_path": __name__},
                         tokenizer_type=tokenizer_type, **identity)

    def _restore_model(self, **kwargs):  # called by MegatronTokenizerText.__init__
        return self._library

    def tokenize(self, text: str) -> List[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"tokenize takes a str, got {type(text).__name__}")
        return list(self._tokenizer.text_to_ids(text))

    def detokenize(self, ids) -> str:
        return self._tokenizer.ids_to_text(_as_id_list(ids))

    def offsets(self, ids, text: str) -> List[int]:
        raise NotImplementedError(f"{self.tokenizer_type} has no offsets")

    def __repr__(self) -> str:
        return f"<{self.tokenizer_type} vocab_size={self.vocab_size} eod={self.eod}>"

    # pickling (tools/preprocess_data.py workers under the spawn start method)
    def __getstate__(self):
        return self.__dict__.copy()

    def __setstate__(self, state):
        self.__dict__.update(state)


def _need_file(flag: str, value, tokenizer_type: str) -> str:
    if not value:
        raise TokenizerError(f"{tokenizer_type} needs {flag}")
    path = os.fspath(value)
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} file not found: {path}")
    return os.path.abspath(path)


def _build_gpt2(vocab_file, merge_file) -> _ChameleonTextTokenizer:
    if not vocab_file and not merge_file:
        raise TokenizerError("GPT2BPETokenizer needs --vocab-file (vocab.json) and --merge-file (merges.txt)")
    vocab_path = _need_file("--vocab-file", vocab_file, "GPT2BPETokenizer")
    merge_path = _need_file("--merge-file", merge_file, "GPT2BPETokenizer")
    try:
        with open(vocab_path, encoding="utf-8") as f:
            encoder = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"--vocab-file {vocab_path} is not a JSON vocabulary: "
                             f"{str(e).splitlines()[0]}") from None
    if not isinstance(encoder, dict) or not encoder:
        raise TokenizerError(f"--vocab-file {vocab_path} must hold a JSON object token -> id")
    if "<|endoftext|>" not in encoder:
        raise TokenizerError(f"--vocab-file {vocab_path} has no <|endoftext|> token (the eod)")
    _import_tokenizers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        bpe = models.BPE.from_file(vocab_path, merge_path)
    except Exception as e:  # tokenizers raises its own Exception type
        raise TokenizerError(f"cannot read GPT-2 BPE from {vocab_path} and {merge_path}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    library = _HFTokenizersLibrary(tok, eod=encoder["<|endoftext|>"], vocab_size=len(encoder),
                                   skip_special_tokens=False)
    return _ChameleonTextTokenizer("GPT2BPETokenizer", library, None,
                                   vocab_file=vocab_path, merges_file=merge_path)


_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


def _special_token(config: dict, name: str) -> Optional[str]:
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _build_hf(tokenizer_model) -> _ChameleonTextTokenizer:
    if not tokenizer_model:
        raise TokenizerError("HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or "
                             "a local directory holding one)")
    path = Path(os.fspath(tokenizer_model))
    if path.is_dir():
        directory, file = path, path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"--tokenizer-model directory has no tokenizer.json: {path}")
    elif path.is_file():
        directory, file = path.parent, path
    else:
        raise TokenizerError(f"--tokenizer-model not found: {path} (only local files; no hub downloads)")
    _import_tokenizers()
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:
        raise TokenizerError(f"cannot read tokenizer {file}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        cfg_path = directory / name
        if cfg_path.is_file():
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    loaded = json.load(f)
            except (OSError, ValueError) as e:
                raise TokenizerError(f"cannot read {cfg_path}: {str(e).splitlines()[0]}") from None
            if isinstance(loaded, dict):
                config.update(loaded)

    def token_id(token: Optional[str]) -> Optional[int]:
        return None if token is None else tok.token_to_id(token)

    eod = token_id(_special_token(config, "eos_token"))
    if eod is None:
        for candidate in _EOD_CANDIDATES:
            eod = token_id(candidate)
            if eod is not None:
                break
    if eod is None:
        raise TokenizerError(f"tokenizer {file} has no end-of-document token (no eos_token in "
                             f"tokenizer_config.json and none of {', '.join(_EOD_CANDIDATES)})")
    pad = token_id(_special_token(config, "pad_token"))
    bos = token_id(_special_token(config, "bos_token"))
    library = _HFTokenizersLibrary(tok, eod=eod, vocab_size=tok.get_vocab_size(with_added_tokens=True),
                                   pad=pad, bos=bos, skip_special_tokens=True)
    return _ChameleonTextTokenizer("HuggingFaceTokenizer", library, str(file.resolve()))


def build_tokenizer(tokenizer_type: str = "ByteLevelTokenizer", vocab_file=None, merge_file=None,
                    tokenizer_model=None, vocab_size=None) -> MegatronTokenizerText:
    """Build a tokenizer by Megatron-LM's --tokenizer-type name (see the module docstring)."""
    if tokenizer_type is None:
        tokenizer_type = "ByteLevelTokenizer"
    if tokenizer_type == "ByteLevelTokenizer":
        return _ChameleonTextTokenizer("ByteLevelTokenizer", _ByteLevelLibrary(), None)
    if tokenizer_type == "GPT2BPETokenizer":
        return _build_gpt2(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return _build_hf(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise TokenizerError("NullTokenizer needs --vocab-size")
        try:
            n = int(vocab_size)
        except (TypeError, ValueError):
            raise TokenizerError(f"--vocab-size must be an integer, got {vocab_size!r}") from None
        if n < 1:
            raise TokenizerError(f"--vocab-size must be positive, got {n}")
        return _ChameleonTextTokenizer("NullTokenizer", _NullLibrary(n), None, vocab_size=str(n))
    raise TokenizerError(f"unknown tokenizer type {tokenizer_type!r}; valid types: "
                         f"{', '.join(TOKENIZER_TYPES)}")
