"""megatron.training.tokenizer: the four --tokenizer-type names, offline."""

import json
import pickle

import pytest

from megatron.training.tokenizer import TOKENIZER_TYPES, TokenizerError, build_tokenizer


def test_byte_level_round_trip():
    tok = build_tokenizer("ByteLevelTokenizer")
    assert tok.vocab_size == 257 and tok.eod == 256
    text = "héllo, wörld ✓\n\n  trailing space \n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids) == text
    assert tok.detokenize(ids + [tok.eod]) == text  # the eod is dropped
    assert build_tokenizer().tokenize(text) == ids  # the default type, deterministic
    assert pickle.loads(pickle.dumps(tok)).tokenize(text) == ids
    with pytest.raises(AttributeError):
        tok.pad  # no pad token: megatron-core's GPTDataset then pads with -1 and masks it
    assert tok.unique_identifiers["tokenizer_type"] == "ByteLevelTokenizer"


def test_detokenize_accepts_numpy_and_torch():
    import numpy
    import torch

    tok = build_tokenizer("ByteLevelTokenizer")
    ids = tok.tokenize("abc")
    assert tok.detokenize(numpy.array(ids, dtype=numpy.uint16)) == "abc"
    assert tok.detokenize(torch.tensor(ids)) == "abc"


def _tiny_gpt2_files(tmp_path):
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols of GPT-2
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file, merge_file = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab_file.write_text(json.dumps(vocab))
    merge_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab, vocab_file, merge_file


def test_gpt2_bpe_tiny_vocab(tmp_path):
    vocab, vocab_file, merge_file = _tiny_gpt2_files(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab_file), merge_file=str(merge_file))
    assert tok.vocab_size == len(vocab)
    assert tok.eod == vocab["<|endoftext|>"]
    ids = tok.tokenize("hello world")
    assert ids[:2] == [vocab["hell"], vocab["o"]]
    assert vocab["Ġw"] in ids
    text = "hello world, héllo\n  x"
    assert tok.detokenize(tok.tokenize(text)) == text
    assert pickle.loads(pickle.dumps(tok)).tokenize(text) == tok.tokenize(text)


def test_gpt2_bpe_errors(tmp_path):
    vocab, vocab_file, merge_file = _tiny_gpt2_files(tmp_path)
    with pytest.raises(TokenizerError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", merge_file=str(merge_file))
    with pytest.raises(TokenizerError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab_file))
    with pytest.raises(TokenizerError, match="not found: .*nope.json"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "nope.json"),
                        merge_file=str(merge_file))
    del vocab["<|endoftext|>"]
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps(vocab))
    with pytest.raises(TokenizerError, match="endoftext"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(no_eod), merge_file=str(merge_file))


def test_huggingface_tokenizer_from_local_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "<pad>": 2, "hello": 3, "world": 4}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["</s>", "<pad>"])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    for model in (tmp_path, tmp_path / "tokenizer.json"):
        tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(model))
        assert (tok.eod, tok.pad, tok.vocab_size) == (1, 2, 5)
        assert tok.tokenize("hello world") == [3, 4]
        assert tok.detokenize([3, 4, 1]) == "hello world"  # special tokens dropped
    with pytest.raises(TokenizerError, match="not found"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"))
    with pytest.raises(TokenizerError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("1 2  3\n99") == [1, 2, 3, 99]
    assert tok.detokenize([1, 2, 3]) == "1 2 3"
    with pytest.raises(TokenizerError, match="integer"):
        tok.tokenize("1 two")
    with pytest.raises(TokenizerError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_unknown_type_lists_valid_ones():
    with pytest.raises(TokenizerError) as info:
        build_tokenizer("SentencePieceTokenizer")
    message = str(info.value)
    assert "SentencePieceTokenizer" in message and "\n" not in message
    for name in TOKENIZER_TYPES:
        assert name in message
    assert isinstance(info.value, ValueError)
