"""tools/gpu_check.sh --dry-run (the GPU check's own logic on the CPU) and tools/compare_profiles.py."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import compare_profiles

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
COMPARE = ROOT / "tools" / "compare_profiles.py"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--vocab-size", "128"]


def _analytical(path: Path, device: str = "H200", *extra: str) -> Path:
    from tools import profile_model
    assert profile_model.main(["--mode", "analytical", "--device-name", device, *TINY, *extra,
                               "--output", str(path)]) == 0
    return path


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and coreutils' timeout")
def test_dry_run_trains_profiles_and_prints_the_ratio_table(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable,
           "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    out = r.stdout
    # the GPU run's commands, printed
    assert "pip --isolated install --no-index --find-links" in out
    assert "--bf16 --transformer-impl local" in out
    assert "--bf16 --transformer-impl transformer_engine" in out
    assert "--mode analytical --device-name H200" in out
    # what ran here: the training job, both profiles, the table
    summary = (tmp_path / "out" / "summary.txt").read_text()
    for step in ("versions", "train_local", "profile_tiny_measured", "profile_tiny_analytical",
                 "compare_tiny"):
        assert f"{step}: ok" in summary, summary
    assert "train_transformer_engine: skipped" in summary
    assert "measured/analytical" in out and "layer bwd weight" in out and "optimizer" in out
    assert "result: PASS" in out
    log = (tmp_path / "out" / "train_local.log").read_text()
    assert re.search(r"iteration\s+2/\s*2\b", log), log[-2000:]
    assert (tmp_path / "out" / "compare_tiny.txt").is_file()


def test_compare_prints_one_row_per_op(tmp_path, capsys):
    m = _analytical(tmp_path / "h100.json", "H100")
    a = _analytical(tmp_path / "h200.json", "H200")
    capsys.readouterr()
    assert compare_profiles.main([str(m), str(a), "--output", str(tmp_path / "t.txt")]) == 0
    out = capsys.readouterr().out
    assert "measured/analytical" in out
    for label, _, _ in compare_profiles.OPS:
        assert f"  {label} " in out
    assert (tmp_path / "t.txt").read_text() == out


def test_compare_missing_file_is_one_line_and_exit_2(tmp_path):
    a = _analytical(tmp_path / "h200.json")
    r = subprocess.run([sys.executable, str(COMPARE), str(tmp_path / "none.json"), str(a)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compare_profiles.py: error: cannot read profile")


def test_compare_different_shapes_is_an_error(tmp_path, capsys):
    a = _analytical(tmp_path / "a.json")
    b = _analytical(tmp_path / "b.json", "H200", "--bf16")
    capsys.readouterr()
    assert compare_profiles.main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bytes_per_element 4 vs 2" in err
