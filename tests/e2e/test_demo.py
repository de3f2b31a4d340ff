"""make demo's driver (tools/demo.py), shortened: a worker killed in iteration 5 of 12 and the job
recovered in-process, with the losses of an independent failure-free run; and its reference
cache, which a second demo reuses and any change to the inputs misses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.builtin_data import ensure_builtin_dataset
from tests.launch import REPO, assert_close, kill_group, last_losses
from tools import demo


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_recovers_from_the_kill_with_the_failure_free_losses(tmp_path):
    out = tmp_path / "demo"
    data = ensure_builtin_dataset(quiet=True, progress=False)   # make data's (a valid split)
    cmd = [sys.executable, "-m", "tools.demo", "--out", str(out), "--data-path", data,
           "--cache-dir", str(tmp_path / "cache"), "--timeout", "240"]
    # no PYTHONWARNINGS: what the user sees, the known warnings silenced and nothing else
    env = {**os.environ, "DEMO_ITERS": "12"}
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)      # the demo stops its launcher, which reaps workers
        output, _ = proc.communicate(timeout=60)
        raise AssertionError(f"the demo did not finish in 540 s\n{output[-3000:]}")
    finally:
        kill_group(proc.pid)
    assert proc.returncode == 0, output[-5000:]
    assert "--chameleon-inject kill:rank=3,iter=5,phase=backward" in output
    assert "> recovery at iteration 5: lost launch rank(s) [3]" in output
    assert "Warning" not in output, output
    job, reference = _events(out / "metrics.jsonl"), _events(out / "reference.jsonl")
    assert [e["event"] for e in reference if e["event"] in ("failure", "recovery")] == []
    assert {e["world"] for e in reference if e["event"] == "iteration"} == {4}
    assert len(last_losses(job)) == 12
    assert_close(last_losses(job), last_losses(reference), rel=1e-5)
    png = out / "losses.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    strategy = next(e["strategy"] for e in job if e["event"] == "recovery")
    summary = output[output.index("demo summary"):]
    assert f"recovered   by {strategy} in" in summary
    assert any(line.split()[0] == strategy and line.endswith("<- chosen")
               for line in summary.splitlines() if "ms/iteration" in line), summary
    assert "within 1e-05" in summary and str(png) in summary


def _inputs(tmp_path: Path, iters: int = 12) -> tuple[object, list[str]]:
    data = tmp_path / "corpus"
    for suffix, content in ((".bin", b"tokens"), (".idx", b"index")):
        Path(f"{data}{suffix}").write_bytes(content)
    args = demo.parse_args(["--iters", str(iters), "--data-path", str(data), "--out",
                            str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")])
    return args, demo.training_args(args.iters, args.data_path)


def test_reference_cache_is_reused_and_keyed_by_what_determines_the_losses(tmp_path):
    args, train = _inputs(tmp_path)
    key = demo.reference_key(train, args.data_path)
    cached = args.cache_dir / f"reference-{key[:16]}.json"
    cached.parent.mkdir()
    cached.write_text(json.dumps({"key": key, "losses": {"1": 5.0, "2": 4.5}}))
    losses, origin = demo.reference_losses(args, train)      # no run: the cache answers
    assert losses == {1: 5.0, 2: 4.5} and str(cached) in origin
    # the same dataset under another path is the same reference; anything else is not
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for suffix in (".bin", ".idx"):
        Path(f"{args.data_path}{suffix}").rename(f"{moved / 'corpus'}{suffix}")
    same = demo.training_args(args.iters, str(moved / "corpus"))
    assert demo.reference_key(same, str(moved / "corpus")) == key
    assert demo.reference_key(demo.training_args(13, str(moved / "corpus")),
                              str(moved / "corpus")) != key
    Path(f"{moved / 'corpus'}.bin").write_bytes(b"tokens, changed")
    assert demo.reference_key(same, str(moved / "corpus")) != key


def test_bad_demo_input_is_one_line_and_exit_2(tmp_path):
    for argv, env, words in [(["--iters", "5"], {}, "at least 6"),
                             ([], {"DEMO_ITERS": "many"}, "DEMO_ITERS='many'"),
                             (["--iters", "12", "--kill-iter", "12"], {}, "--kill-iter"),
                             (["--data-path", str(tmp_path / "none")], {}, "no dataset")]:
        r = subprocess.run([sys.executable, "-m", "tools.demo", *argv], cwd=REPO,
                           env={**os.environ, **env}, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
