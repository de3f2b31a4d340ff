"""Bad flags and plans: one line on stderr naming the problem, exit code 2, no traceback."""

import json

import pytest

from megatron.elastic.config import ConfigError
from megatron.training.arguments import parse_config
from tests.launch import run_script

BASE = ["--num-layers", "4", "--mock-data"]


@pytest.mark.parametrize("world, flags, message", [
    (3, ["--pipeline-model-parallel-size", "2"], "world size 3 is not divisible"),
    (4, ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
         "--global-batch-size", "6"], "--global-batch-size 6 is not divisible"),
    (1, ["--tokenizer-type", "SentencePieceMagic"], "unknown --tokenizer-type"),
    (1, ["--pipeline-model-parallel-size", "3"], "world size 1 is not divisible"),
    (1, ["--hidden-size", "66"], "--hidden-size 66 is not divisible by --num-attention-heads"),
    (1, ["--bf16"], "need CUDA"),
    (2, ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "99"],
     "--ffn-hidden-size 99 is not divisible by --tensor-model-parallel-size 2"),
    (4, ["--tensor-model-parallel-size", "4", "--make-vocab-size-divisible-by", "2"],
     "--make-vocab-size-divisible-by 2 is not divisible by --tensor-model-parallel-size 4"),
])
def test_bad_flags_are_refused_in_one_line(world, flags, message):
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + flags, world_size=world)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_flag_exits_2_with_one_line():
    """What the cases above raise reaches the user as one line and exit code 2."""
    r = run_script(BASE + ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                           "--global-batch-size", "6"], env={"WORLD_SIZE": "4"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "pretrain_gpt.py: error: --global-batch-size 6 is not divisible by --micro-batch-size 2 "
        "x data parallel size 2"]


def test_missing_data_path(tmp_path):
    r = run_script(["--num-layers", "4"])
    assert r.returncode == 2 and "give --data-path" in r.stderr
    r = run_script(["--data-path", str(tmp_path / "nothing")])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"pretrain_gpt.py: error: --data-path {tmp_path / 'nothing'}: "
        f"{tmp_path / 'nothing'}.bin does not exist"]


def test_unknown_flag():
    r = run_script(BASE + ["--pipeline-parallel", "2"])
    assert r.returncode == 2 and "unrecognized arguments: --pipeline-parallel" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("content, message", [
    ("{not json", "plan is not valid JSON"),
    (json.dumps({"num_layers": 4}), "malformed plan"),
    (json.dumps({"num_layers": 4, "tensor_parallel": 1, "micro_batch_size": 2,
                 "num_micro_batches": 2, "pipelines": [
                     {"stages": [{"layer_start": 0, "layer_end": 3, "ranks": [0]}],
                      "micro_batches": [0, 1]}]}), "covers layers [0, 3)"),
    (json.dumps({"num_layers": 4, "tensor_parallel": 1, "micro_batch_size": 2,
                 "num_micro_batches": 2, "pipelines": [
                     {"stages": [{"layer_start": 0, "layer_end": 4, "ranks": [5]}],
                      "micro_batches": [0, 1]}]}), "the world is 0..0"),
])
def test_bad_plan_file(tmp_path, content, message):
    plan = tmp_path / "plan.json"
    plan.write_text(content)
    r = run_script(BASE + ["--chameleon-plan", str(plan)])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_help_groups_chameleon_flags():
    r = run_script(["--help"])
    assert r.returncode == 0
    section = r.stdout.split("chameleon:")[1]
    for flag in ("--chameleon ", "--chameleon-metrics-file", "--chameleon-plan"):
        assert flag in section
    assert "--pipeline-model-parallel-size" not in section


def test_placement_is_spread_with_chameleon_and_megatron_without():
    from megatron.training.arguments import parse_config
    assert parse_config(BASE + ["--chameleon"], world_size=1).parallel.placement == "spread"
    assert parse_config(BASE, world_size=1).parallel.placement == "megatron"
    assert parse_config(BASE + ["--chameleon-placement", "spread"],
                        world_size=1).parallel.placement == "spread"
    r = run_script(BASE + ["--chameleon-placement", "round-robin"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--chameleon-placement: invalid choice: 'round-robin'" in r.stderr


@pytest.mark.parametrize("flags, heartbeat, message", [
    (["--chameleon-progress-timeout", "2"], "5",
     "--chameleon-progress-timeout 2 s is below chameleon-launch's --heartbeat-timeout 5 s"),
    (["--chameleon-progress-timeout", "60"], "5",
     "--chameleon-progress-timeout 60 s is not below --chameleon-agree-timeout 60 s"),
    (["--chameleon-agree-timeout", "20"], "30",
     "chameleon-launch's --heartbeat-timeout 30 s is not below --chameleon-agree-timeout 20 s"),
    (["--chameleon-comm-timeout", "90"], "5",
     "--chameleon-comm-timeout 90 s is above --chameleon-agree-timeout 60 s"),
    (["--chameleon-save-timeout", "4"], "5",
     "--chameleon-save-timeout 4 s is below --chameleon-comm-timeout 5 s"),
    (["--chameleon-rendezvous-timeout", "0"], "5",
     "--chameleon-rendezvous-timeout must be positive"),
])
def test_timeouts_that_contradict_each_other_are_refused_in_one_line(flags, heartbeat, message,
                                                                     monkeypatch):
    monkeypatch.setenv("CHAMELEON_HEARTBEAT_TIMEOUT", heartbeat)
    with pytest.raises(ConfigError) as e:
        parse_config(BASE + flags, world_size=1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_inject_takes_specs_separated_by_semicolons_and_repeated_flags():
    config = parse_config(BASE + ["--chameleon-inject", "kill:rank=1,iter=3;exit:rank=0,iter=4",
                                  "--chameleon-inject", "hang:rank=2,iter=5"], world_size=1)
    assert [(s.kind, s.rank, s.iteration) for s in config.elastic.inject] == [
        ("kill", 1, 3), ("exit", 0, 4), ("hang", 2, 5)]
    r = run_script(BASE + ["--chameleon-inject", "kill:rank=1,iter=3;kill:rank=1"])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--chameleon-inject: fault spec 'kill:rank=1': missing iter=" \
        in lines[0], r.stderr
