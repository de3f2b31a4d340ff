"""The flags turned once into the job's typed configuration: each lands in its part, times in
seconds, and contradicting timeouts are refused when the configuration is built."""

import pytest

from megatron.elastic.config import ConfigError, Timeouts
from megatron.training.arguments import parse_config

BASE = ["--num-layers", "4", "--mock-data"]


def test_flags_land_in_their_parts():
    config = parse_config(BASE + [
        "--hidden-size", "32", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
        "--pipeline-model-parallel-size", "2", "--lr", "0.003", "--lr-decay-style", "cosine",
        "--distributed-timeout-minutes", "1.5", "--save", "/tmp/ckpt", "--save-interval", "5",
        "--no-progress-bar", "--chameleon", "--chameleon-metrics-file", "m.jsonl",
        "--chameleon-redundancy", "eager", "--chameleon-strategy", "takeover",
        "--chameleon-agree-timeout", "40", "--chameleon-rendezvous-timeout", "30",
        "--chameleon-progress-timeout", "12"], world_size=4)
    assert (config.model.hidden_size, config.model.tied_embeddings,
            config.model.ffn_hidden_size) == (32, False, 128)
    assert (config.parallel.pipeline_parallel, config.parallel.data_parallel,
            config.parallel.placement) == (2, 2, "spread")
    assert config.parallel.distributed_timeout_s == 90.0          # minutes, converted once
    assert (config.training.micro_batch_size, config.training.global_batch_size,
            config.training.lr, config.training.lr_decay_style,
            config.training.lr_decay_iters) == (1, 2, 0.003, "cosine", 20)
    assert (config.checkpoint.save, config.checkpoint.save_interval) == ("/tmp/ckpt", 5)
    assert (config.logging.progress_bar, config.logging.metrics_file) == (False, "m.jsonl")
    elastic = config.elastic
    assert (elastic.enabled, elastic.eager, elastic.strategy) == (True, True, "takeover")
    assert (elastic.timeouts.agree_s, elastic.timeouts.rendezvous_s,
            elastic.timeouts.progress_s, elastic.timeouts.comm_s) == (40.0, 30.0, 12.0, 5.0)


def test_the_heartbeat_timeout_comes_from_the_launcher(monkeypatch):
    monkeypatch.setenv("CHAMELEON_HEARTBEAT_TIMEOUT", "7.5")
    assert parse_config(BASE, world_size=1).elastic.timeouts.heartbeat_s == 7.5
    monkeypatch.delenv("CHAMELEON_HEARTBEAT_TIMEOUT")
    assert parse_config(BASE, world_size=1).elastic.timeouts.heartbeat_s == 5.0


@pytest.mark.parametrize("fields, message", [
    (dict(heartbeat_s=5.0, progress_s=4.0), "--chameleon-progress-timeout 4 s is below"),
    (dict(progress_s=70.0), "--chameleon-progress-timeout 70 s is not below"),
    (dict(heartbeat_s=60.0), "--heartbeat-timeout 60 s is not below --chameleon-agree-timeout"),
    (dict(comm_s=61.0), "--chameleon-comm-timeout 61 s is above --chameleon-agree-timeout"),
    (dict(save_s=4.0), "--chameleon-save-timeout 4 s is below --chameleon-comm-timeout 5 s"),
    (dict(join_s=-1.0), "--chameleon-join-timeout must be positive"),
])
def test_contradicting_timeouts_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message) as e:
        Timeouts(**fields)
    assert "\n" not in str(e.value)


def test_the_defaults_agree():
    Timeouts()
