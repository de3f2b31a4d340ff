"""tools/profile_model.py: analytical and measured (offline) profiles, and one-line errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chameleon_ext.planning.perf_model import DEVICES, ModelShape, Profile, analytical_profile
from tools import profile_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "profile_model.py"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--vocab-size", "128"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_analytical_writes_a_loadable_profile_marked_analytical(tmp_path):
    out = tmp_path / "h200.json"
    r = run("--mode", "analytical", "--device-name", "H200", "--bf16", "--num-layers", "24",
            "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
            "--micro-batch-size", "1", "--output", str(out))
    assert r.returncode == 0, r.stderr
    prof = Profile.load(out)
    assert prof.source == "analytical" and prof.device == "H200"
    assert any("analytical" in n for n in prof.notes)
    shape = ModelShape(24, 2048, 16, 2048, 1, 50304, bytes_per_element=2)
    assert prof.shape == shape
    ref = analytical_profile(shape, "H200")
    assert prof.layer_fwd_ms == pytest.approx(ref.layer_fwd_ms)
    assert prof.head_bwd_ms == pytest.approx(ref.head_bwd_ms)
    assert prof.device_memory_bytes == ref.device_memory_bytes
    assert "source analytical" in r.stdout and str(out) in r.stdout


def test_analytical_in_process_overrides(tmp_path, capsys):
    out = tmp_path / "a100.json"
    rc = profile_model.main(["--mode", "analytical", "--device-name", "A100", *TINY,
                             "--cores", "8", "--ranks-per-host", "4",
                             "--device-memory-gib", "2", "--output", str(out)])
    assert rc == 0
    prof = Profile.load(out)
    assert (prof.source, prof.cores, prof.ranks_per_host) == ("analytical", 8.0, 4)
    assert prof.device_memory_bytes == 2 * 2 ** 30
    assert "wrote" in capsys.readouterr().out


def test_measure_tiny_config_writes_an_offline_profile(tmp_path):
    out = tmp_path / "cpu.json"
    r = run(*TINY, "--iters", "2", "--output", str(out))
    assert r.returncode == 0, r.stderr
    prof = Profile.load(out)
    assert prof.source == "offline" and prof.device == "cpu"
    assert prof.shape == ModelShape(2, 64, 4, 32, 2, 128)
    for name in ("layer_fwd_ms", "layer_bwd_input_ms", "layer_bwd_weight_ms", "head_fwd_ms",
                 "head_bwd_ms", "embedding_fwd_ms", "embedding_bwd_ms",
                 "optimizer_ms_per_mparam", "p2p_ms_per_mib", "allreduce_ms_per_mib"):
        assert getattr(prof, name) > 0, name
    assert prof.cores == float(os.cpu_count()) and prof.device_memory_bytes == 0
    assert prof.bytes_per_param == 16
    assert any("LOOPBACK" in n for n in prof.notes)      # links are an estimate, and say so
    assert any("megatron-core GPTModel" in n for n in prof.notes)
    for part in ("layer", "embedding", "head", "optimizer", "links"):
        assert part in r.stdout
    assert "source offline" in r.stdout and str(out) in r.stdout


def test_measure_with_a_known_device_name_takes_its_links_and_the_given_host(tmp_path):
    out = tmp_path / "labelled.json"
    r = run(*TINY, "--iters", "1", "--layers-to-time", "5", "--device-name", "H100",
            "--cores", "3", "--ranks-per-host", "2", "--device-memory-gib", "1.5",
            "--output", str(out))
    assert r.returncode == 0, r.stderr
    prof = Profile.load(out)
    ref = analytical_profile(prof.shape, "H100")
    assert prof.source == "offline" and prof.device == "H100"
    assert prof.p2p_ms_per_mib == pytest.approx(ref.p2p_ms_per_mib)
    assert prof.allreduce_alpha_ms == pytest.approx(ref.allreduce_alpha_ms)
    assert (prof.cores, prof.ranks_per_host) == (3.0, 2)
    assert prof.device_memory_bytes == int(1.5 * 2 ** 30)
    assert prof.layer_fwd_ms > 0
    assert "2 layer(s)" in r.stdout              # --layers-to-time is capped at --num-layers


def test_link_device_names():
    assert profile_model.link_device("H200") == "H200"
    assert profile_model.link_device("NVIDIA H200") == "H200"
    assert profile_model.link_device("NVIDIA A100-SXM4-80GB") == "A100"
    assert profile_model.link_device("cpu") is None
    assert set(DEVICES) >= {"H200", "H100", "A100"}


@pytest.mark.parametrize("extra, fragment", [
    (["--mode", "analytical", "--device-name", "V100"], "unknown device 'V100'"),
    (["--mode", "analytical"], "needs --device-name"),
    (["--hidden-size", "0"], "--hidden-size must be positive"),
    (["--micro-batch-size", "-2"], "--micro-batch-size must be positive"),
    (["--iters", "0"], "--iters must be positive"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be positive"),
    (["--hidden-size", "66"], "not divisible by --num-attention-heads 4"),
    (["--cores", "-1"], "--cores must be >= 0"),
    (["--mode", "simulate"], "invalid choice"),
    (["--hidden-size", "big"], "invalid int value"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, extra, fragment):
    out = tmp_path / "p.json"
    r = run(*TINY, "--output", str(out), *extra, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("profile_model.py: error: "), r.stderr
    assert fragment in lines[0]
    assert "Traceback" not in r.stderr and not out.exists()


@pytest.mark.parametrize("target", ["under-a-file", "a-directory", "missing-dir"])
def test_unwritable_output_is_one_line_and_exit_2(tmp_path, target):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = {"under-a-file": blocker / "p.json", "a-directory": tmp_path,
            "missing-dir": tmp_path / "nope" / "p.json"}[target]
    r = run(*TINY, "--output", str(path), timeout=60)   # measure mode: checked before timing
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("profile_model.py: error: "), r.stderr
    assert "cannot write --output" in lines[0] or "is a directory" in lines[0]
    assert "timing" not in r.stdout and "Traceback" not in r.stderr


def test_missing_required_flag_is_one_line():
    r = run("--num-layers", "2", timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "the following arguments are required" in lines[0]
