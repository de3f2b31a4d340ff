"""tools/profile_model.py: analytical and measured (offline) profiles, and one-line errors."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chameleon_ext.planning.perf_model import (DEVICES, ModelShape, Profile, analytical_profile,
                                               stage_param_count)
from megatron.training.config import ModelConfig
from tools import profile_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "profile_model.py"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--vocab-size", "128"]
LLAMA = ["--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type",
         "rope", "--untie-embeddings-and-output-weights"]


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
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--num-experts", "4", "--moe-router-topk", "5", "--disable-bias-linear"],
     "--moe-router-topk 5 must be in 1..--num-experts 4"),
    (["--moe-ffn-hidden-size", "32"], "--moe-ffn-hidden-size needs --num-experts"),
    (["--num-experts", "4"], "--num-experts needs --disable-bias-linear"),
    (["--kv-channels", "0"], "--kv-channels must be positive"),
    (["--hidden-size", "16", "--swiglu"], "--swiglu's default --ffn-hidden-size is 0"),
    (["--normalization", "BatchNorm"], "invalid choice"),
    (["--recompute-granularity", "some"], "invalid choice"),
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


def test_analytical_takes_the_model_flags(tmp_path):
    out = tmp_path / "llama.json"
    assert profile_model.main(["--mode", "analytical", "--device-name", "H100", *TINY, *LLAMA,
                               "--qk-layernorm", "--kv-channels", "8",
                               "--recompute-granularity", "selective",
                               "--output", str(out)]) == 0
    shape = Profile.load(out).shape
    # --swiglu's default FFN is Megatron-LM's: 2/3 of 4 x 64, down to a multiple of 64
    assert shape == ModelShape(2, 64, 4, 32, 2, 128, ffn_hidden_size=128, num_query_groups=2,
                               kv_channels=8, gated_linear_unit=True, add_bias_linear=False,
                               tied_embeddings=False, learned_positions=False,
                               normalization="RMSNorm", qk_layernorm=True,
                               recompute="selective")
    assert Profile.load(out).layer_fwd_ms == pytest.approx(
        analytical_profile(shape, "H100").layer_fwd_ms)


def test_measure_a_llama_shape_with_full_recompute(tmp_path):
    """RoPE's frequencies reach the timed layers, each checkpointed as the decoder would."""
    out = tmp_path / "llama.json"
    r = run(*TINY, *LLAMA, "--recompute-granularity", "full", "--iters", "1",
            "--output", str(out))
    assert r.returncode == 0, r.stderr
    prof = Profile.load(out)
    assert (prof.shape.gated_linear_unit, prof.shape.recompute) == (True, "full")
    assert prof.layer_fwd_ms > 0 and prof.layer_bwd_input_ms > 0
    assert "SwiGLU, 2 query groups, no biases, RoPE, RMSNorm, untied output layer, full " \
        "recompute" in r.stdout


# The same model as tool flags and as pretrain_gpt.py's ModelConfig (fields beyond the sizes)
COUNTED = {
    "gpt": ([], {}),
    "llama": (LLAMA, dict(swiglu=True, num_query_groups=2, add_bias_linear=False,
                          normalization="RMSNorm", position_embedding_type="rope",
                          tied_embeddings=False)),
    "qk-layernorm": (["--qk-layernorm", "--kv-channels", "8"],
                     dict(qk_layernorm=True, kv_channels=8)),
    "moe": (["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96"],
            dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96)),
    "shared-expert": (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "64",
                       "--quick-geglu", "--disable-bias-linear"],
                      dict(num_experts=4, moe_shared_expert_intermediate_size=64,
                           quick_geglu=True, add_bias_linear=False)),
    "squared-relu": (["--squared-relu"], dict(squared_relu=True)),
    "quick-geglu": (["--quick-geglu"], dict(quick_geglu=True)),
}


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process world with megatron-core's parallel state, as the tool sets it up."""
    import torch
    owned = profile_model._setup_megatron(torch, cuda=False)
    yield torch
    profile_model._teardown_megatron(owned)


def _counts(model) -> dict[str, int]:
    """Parameters of the first layer, the embedding, and the final norm with the output layer."""
    out = {"layer": 0, "embedding": 0, "head": 0, "total": 0}
    for name, p in model.named_parameters():
        part = "layer" if name.startswith("decoder.layers.0.") else \
            "embedding" if name.startswith("embedding.") else \
            "head" if name.startswith(("decoder.final_layernorm.", "output_layer.")) else None
        if part:
            out[part] += p.numel()
        out["total"] += p.numel()
    return out


def _shape_counts(shape: ModelShape, layers: int) -> dict[str, int]:
    return {"layer": shape.layer_params(), "embedding": shape.embedding_params(),
            "head": shape.head_params(first=True),
            "total": stage_param_count(shape, layers, True, True, 1)}


@pytest.mark.parametrize("name", COUNTED)
def test_parameter_counts_are_megatron_cores(megatron_world, name, tmp_path):
    """ModelShape's counts equal the GPTModel the tool times and the one pretrain_gpt.py
    trains, layer by layer (megatron-core 0.16.1, local spec, CPU)."""
    import pretrain_gpt
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.planning import model_shape
    from megatron.training.training import transformer_config
    torch = megatron_world
    flags, fields = COUNTED[name]
    args = profile_model.parse(["--mode", "analytical", "--device-name", "H100", *TINY, *flags,
                                "--output", str(tmp_path / "p.json")])
    shape = profile_model.model_shape(args)
    timed = profile_model._build_model(torch, args, 2, False, torch.float32)
    assert _counts(timed) == _shape_counts(shape, 2)

    job = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                      ffn_hidden_size=128 if fields.get("swiglu") else 256, seq_length=32,
                      max_position_embeddings=48, make_vocab_size_divisible_by=128,
                      padded_vocab_size=128, **fields)
    trained = pretrain_gpt.model_provider(job, transformer_config(job, 1), True, True,
                                          ProcessGroupCollection.use_mpu_process_groups())
    job_shape = model_shape(job, 2)
    assert _counts(trained) == _shape_counts(job_shape, 2)
    assert job_shape == dataclasses.replace(shape, max_position_embeddings=48)
