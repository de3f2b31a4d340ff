"""The data room: preprocessing (and tools/preprocess_data.py), the built-in corpus, build_gpt_datasets, MicroBatchLoader."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.builtin_data import builtin_corpus_files, ensure_builtin_dataset
from megatron.training.data import (DataError, DatasetExhaustedError, MicroBatchLoader,
                                    build_gpt_datasets, parse_data_path)
from megatron.training.preprocess import PreprocessError, preprocess
from megatron.training.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("ByteLevelTokenizer")


def _documents(prefix):
    ds = IndexedDataset(prefix)
    docs = [ds[i].tolist() for i in range(len(ds))]
    return docs, ds.document_indices.tolist()


# ---------------------------------------------------------------------------- preprocess


def test_preprocess_jsonl_round_trip(tmp_path, tok):
    rows = [{"text": "hello world", "title": "a"}, {"text": "second\ndoc ✓", "title": "bb"},
            {"text": "", "title": "c"}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a trailing blank line
    out = preprocess(src, tmp_path / "out" / "corpus", tok, json_keys=("text", "title"),
                     append_eod=True, progress=False)
    assert out == {key: str(tmp_path / "out" / "corpus") + f"_{key}_document" for key in ("text", "title")}
    docs, doc_index = _documents(out["text"])
    # Megatron's layout: one sequence per document; an empty document has no sequence.
    assert doc_index == [0, 1, 2, 2]
    assert [tok.detokenize(d[:-1]) for d in docs] == ["hello world", "second\ndoc ✓"]
    assert all(d[-1] == tok.eod for d in docs)
    docs, _ = _documents(out["title"])
    assert [tok.detokenize(d) for d in docs] == ["a", "bb", "c"]
    assert IndexedDataset(out["text"]).index.dtype.__name__ == "uint16"
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        f"corpus_{k}_document.{e}" for k in ("text", "title") for e in ("bin", "idx"))


def test_preprocess_plain_text_paragraphs(tmp_path, tok):
    src = tmp_path / "in.txt"
    src.write_text("para one\nline two\n\n\n  para two \n\nlast")
    out = preprocess(src, tmp_path / "t", tok, append_eod=False, progress=False)
    docs, _ = _documents(out["text"])
    assert [tok.detokenize(d) for d in docs] == ["para one\nline two", "  para two ", "last"]


def test_preprocess_null_tokenizer(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=1000)
    src = tmp_path / "ids.jsonl"
    src.write_text(json.dumps({"text": "5 6 7"}) + "\n")
    out = preprocess(src, tmp_path / "n", tok, progress=False)
    assert _documents(out["text"])[0] == [[5, 6, 7, 1000]]


def test_preprocess_bad_input_leaves_nothing(tmp_path, tok):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"other": "b"}) + "\n")
    with pytest.raises(PreprocessError, match="line 2: missing key 'text'"):
        preprocess(src, tmp_path / "out" / "x", tok, progress=False)
    assert os.listdir(tmp_path / "out") == []
    with pytest.raises(PreprocessError, match="not found"):
        preprocess(tmp_path / "missing.jsonl", tmp_path / "out" / "x", tok, progress=False)


def test_cli_malformed_json_exits_2_with_one_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "oops\n')
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(src),
         "--output-prefix", str(out_dir / "x"), "--append-eod", "--workers", "1"],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "line 2" in lines[0] and "malformed JSON" in lines[0]
    assert "Traceback" not in proc.stderr
    assert os.listdir(out_dir) == []


def test_cli_missing_input_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
         str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"preprocess_data.py: error: input file not found: {tmp_path / 'nope.jsonl'}"]


# ---------------------------------------------------------------------------- built-in corpus


def _tiny_stdlib(root: Path) -> Path:
    src = root / "stdlib"
    (src / "pkg").mkdir(parents=True)
    (src / "test").mkdir()
    (src / "site-packages").mkdir()
    (src / "zeta.py").write_text("def zeta():\n    return 'ζ'\n")
    (src / "pkg" / "alpha.py").write_text("ALPHA = 1\n")
    (src / "pkg" / "empty.py").write_text("")
    (src / "test" / "test_x.py").write_text("skipped = True\n")
    (src / "site-packages" / "third.py").write_text("skipped = True\n")
    (src / "notes.txt").write_text("not python\n")
    return src


def test_builtin_dataset_builds_once(tmp_path, tok, capsys):
    src = _tiny_stdlib(tmp_path)
    assert [rel for rel, _, _ in builtin_corpus_files(src)] == ["pkg/alpha.py", "zeta.py"]
    prefix = ensure_builtin_dataset(tmp_path / "data", source_dir=src)
    assert "building the built-in dataset" in capsys.readouterr().err
    docs, _ = _documents(prefix)
    assert [tok.detokenize(d[:-1]) for d in docs] == ["ALPHA = 1\n", "def zeta():\n    return 'ζ'\n"]
    assert all(d[-1] == tok.eod for d in docs)
    mtimes = [os.stat(prefix + e).st_mtime_ns for e in (".bin", ".idx")]
    assert ensure_builtin_dataset(tmp_path / "data", source_dir=src) == prefix
    assert "building" not in capsys.readouterr().err
    assert [os.stat(prefix + e).st_mtime_ns for e in (".bin", ".idx")] == mtimes
    leftovers = [n for n in os.listdir(os.path.dirname(prefix)) if ".tmp" in n]
    assert leftovers == []


def test_builtin_corpus_of_the_real_stdlib_is_sized():
    files = builtin_corpus_files()  # lists only; building is timed in the CLI, not here
    total = sum(size for _, _, size in files)
    assert 2_000_000 <= total <= 8_000_000
    assert not any("/test/" in "/" + rel or "site-packages" in rel for rel, _, _ in files)
    assert [rel for rel, _, _ in files] == sorted(rel for rel, _, _ in files)


# ---------------------------------------------------------------------------- datasets


@pytest.fixture(scope="module")
def real_prefix(tmp_path_factory):
    tok = build_tokenizer("ByteLevelTokenizer")
    root = tmp_path_factory.mktemp("corpus")
    src = root / "docs.jsonl"
    with open(src, "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor " * (i % 7 + 1)}) + "\n")
    return preprocess(src, root / "docs", tok, progress=False)["text"]


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_data_path("1 a 3 b") == (["a", "b"], [1.0, 3.0])
    with pytest.raises(DataError, match="positive"):
        parse_data_path(["0", "a"])


def test_build_gpt_datasets_real_prefix(real_prefix, tok, tmp_path):
    train, valid, test = build_gpt_datasets(
        data_path=[real_prefix], mock_data=False, split="80,20,0", seq_length=16, seed=1234,
        tokenizer=tok, train_samples=64, valid_samples=8, test_samples=0,
        data_cache_path=str(tmp_path / "cache"))
    assert len(train) >= 64 and len(valid) >= 8 and test is None
    sample = train[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["tokens"].shape == (16,) and sample["tokens"].dtype == torch.int64
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert any(n.endswith("GPTDataset-train-shuffle_index.npy") for n in os.listdir(tmp_path / "cache"))
    # a second build (a cache hit) gives the same samples
    again, _, _ = build_gpt_datasets(
        data_path=[real_prefix], mock_data=False, split="80,20,0", seq_length=16, seed=1234,
        tokenizer=tok, train_samples=64, valid_samples=8, test_samples=0,
        data_cache_path=str(tmp_path / "cache"))
    assert torch.equal(again[5]["tokens"], train[5]["tokens"])


def test_build_gpt_datasets_blend_with_cache_single_process(real_prefix, tok, tmp_path):
    # megatron-core's BlendedDataset asks torch.distributed for the rank on a cache miss
    for _ in range(2):  # miss, then hit
        train, valid, _ = build_gpt_datasets(
            data_path=["0.25", real_prefix, "0.75", real_prefix], mock_data=False, split="1,0,0",
            seq_length=8, seed=1, tokenizer=tok, train_samples=40, valid_samples=0,
            test_samples=0, data_cache_path=str(tmp_path / "cache"))
        assert len(train) == 40 and valid is None
        assert set(MicroBatchLoader(train, 2, 2).get(0, 1)) == {"tokens", "labels", "loss_mask",
                                                                 "position_ids"}


def test_build_gpt_datasets_mock(tok):
    train, valid, test = build_gpt_datasets(
        data_path=None, mock_data=True, split="969,30,1", seq_length=32, seed=1234, tokenizer=tok,
        train_samples=100, valid_samples=10, test_samples=0)
    assert len(train) >= 100 and len(valid) >= 10
    batch = MicroBatchLoader(train, 4, 2).get(1, 1)
    assert batch["tokens"].shape == (4, 32) and int(batch["tokens"].max()) < tok.vocab_size


def test_build_gpt_datasets_errors(real_prefix, tok, tmp_path):
    common = dict(mock_data=False, split="969,30,1", seq_length=16, seed=1, tokenizer=tok,
                  train_samples=10, valid_samples=0, test_samples=0)
    missing = str(tmp_path / "nowhere" / "data_text_document")
    with pytest.raises(DataError, match="nowhere/data_text_document") as info:
        build_gpt_datasets(data_path=[missing], **common)
    assert "\n" not in str(info.value)
    with pytest.raises(DataError):
        build_gpt_datasets(data_path=None, **common)
    with pytest.raises(DataError, match="split"):
        build_gpt_datasets(data_path=[real_prefix], **{**common, "split": "a,b"})
    # 40 documents: the 1/1000 test split is empty; asking it for samples is an error
    with pytest.raises(DataError, match="test split"):
        build_gpt_datasets(data_path=[real_prefix], **{**common, "test_samples": 4})
    # ... and asking it for none gives no test dataset (megatron-core would loop forever)
    _, _, test = build_gpt_datasets(data_path=[real_prefix], **common)
    assert test is None


# ---------------------------------------------------------------------------- loader


def test_micro_batch_loader_order_and_identity(real_prefix, tok, tmp_path):
    kwargs = dict(data_path=[real_prefix], mock_data=False, split="1,0,0", seq_length=16, seed=7,
                  tokenizer=tok, train_samples=48, valid_samples=0, test_samples=0,
                  data_cache_path=str(tmp_path / "cache"))
    ds_a, _, _ = build_gpt_datasets(**kwargs)
    ds_b, _, _ = build_gpt_datasets(**kwargs)
    a, b = MicroBatchLoader(ds_a, 3, 4), MicroBatchLoader(ds_b, 3, 4)
    for iteration, mb in [(0, 0), (1, 3), (2, 1), (1, 3)]:
        x, y = a.get(iteration, mb), b.get(iteration, mb)
        assert set(x) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert x["tokens"].dtype == torch.int64 and x["labels"].dtype == torch.int64
        assert x["position_ids"].dtype == torch.int64 and x["loss_mask"].dtype == torch.float32
        assert x["tokens"].shape == (3, 16)
        for key in x:
            assert torch.equal(x[key], y[key])
        for j in range(3):
            sample = ds_a[(iteration * 4 + mb) * 3 + j]
            for key in x:
                assert torch.equal(x[key][j], sample[key])
    assert list(a.sample_indices(2, 1)) == [27, 28, 29]
    with pytest.raises(DatasetExhaustedError, match="dataset has"):
        a.get(len(ds_a) // 12 + 1, 0)
    with pytest.raises(DataError, match="micro-batch 4"):
        a.get(0, 4)
    with pytest.raises(DataError):
        MicroBatchLoader(None, 1, 1)
