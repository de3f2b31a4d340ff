"""Emulated accelerators: padding to the profile's times, overrun counting, the run's validity,
and the flags' checks."""

import json

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import MIB, ModelShape, ProfileCosts, stage_params
from chameleon_ext.planning.strategies.redundancy import eager_cost
from chameleon_ext.schedule.ir import Op, OpKind
from megatron.elastic.emulation import (STORAGE_MIB_PER_S, Emulation, OverrunCount,
                                        emulated_profile, emulation_event)
from megatron.training.config import LoggingConfig
from megatron.training.reporting import Reporter
from tests.launch import run_script
from tests.profiles import synthetic_profile

JOB = ModelShape(4, 64, 4, 64, 4, 256)
BIG = ModelShape(32, 1024, 16, 1024, 1, 50304)


class FakeTime:
    """A clock that only sleeping and `spend` move; records every sleep."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.slept.append(s)
        self.now += s

    def spend(self, s: float) -> None:
        self.now += s


def _emulation(t: FakeTime, dilation: float = 2.0, **costs) -> Emulation:
    profile = synthetic_profile(BIG, **{"layer_fwd_ms": 3.0, "layer_bwd_input_ms": 4.0,
                                        "layer_bwd_weight_ms": 5.0, **costs})
    return Emulation(profile, dilation, JOB, sleep=t.sleep, clock=t.clock)


def _plan() -> ExecutionPlan:
    """Pipeline 2 x data 2 of JOB's 4 layers: ranks 0 and 1 hold layers [0, 2) and the
    embedding."""
    return ExecutionPlan.failure_free(4, 1, 2, 4, 4, 32)


def _warm(emu: Emulation, rank: int = 0):
    """A device past its warm-up iteration (whose ops are not counted)."""
    dev = emu.device(_plan(), rank)
    dev.computed(Op(OpKind.OPT_STEP), emu.clock())
    emu.count = OverrunCount()
    return dev


def test_compute_op_waits_until_its_emulated_deadline():
    t = FakeTime()
    emu = _emulation(t)
    dev = _warm(emu)
    t.slept.clear()
    began = t.now
    t.spend(0.001)  # the real forward: 1 ms
    dev.computed(Op(OpKind.FWD, 0), began)
    # 2 layers x 3 ms, dilated 2x: the op ends 12 ms after it began, by one sleep
    assert t.now - began == pytest.approx(0.012)
    assert t.slept == [pytest.approx(0.011)]
    assert (emu.count.ops, emu.count.overruns) == (1, 0)


def test_an_op_longer_than_emulated_is_an_overrun_and_is_not_padded():
    t = FakeTime()
    emu = _emulation(t)
    dev = _warm(emu)
    began = t.now
    t.spend(0.050)
    dev.computed(Op(OpKind.BWD_INPUT, 0), began)  # emulated: 2 x 4 ms x 2 = 16 ms
    assert t.slept == []
    assert (emu.count.ops, emu.count.overruns) == (1, 1)
    assert emu.count.worst_ms == pytest.approx(34.0)


def test_the_first_iteration_under_a_plan_is_padded_but_not_counted():
    t = FakeTime()
    emu = _emulation(t)
    dev = emu.device(_plan(), 0)
    for op in (Op(OpKind.FWD, 0), Op(OpKind.BWD, 0), Op(OpKind.OPT_STEP)):
        began = t.now
        t.spend(1.0)
        dev.computed(op, began)
    assert emu.count.ops == 0
    began = t.now
    dev.computed(Op(OpKind.FWD, 1), began)
    assert emu.count.ops == 1 and t.now - began == pytest.approx(0.012)
    emu.device(_plan(), 0).computed(Op(OpKind.FWD, 0), t.now)  # a new plan warms up again
    assert emu.count.ops == 1


def test_emulated_times_are_the_simulators_costs_times_the_dilation():
    t = FakeTime()
    emu = _emulation(t, dilation=3.0, optimizer_ms_per_mparam=0.5)
    plan = _plan()
    costs = ProfileCosts(plan, emu.profile)
    for rank in plan.ranks:
        for op in (Op(OpKind.FWD, 0), Op(OpKind.BWD, 0), Op(OpKind.BWD_WEIGHT, 0),
                   Op(OpKind.OPT_STEP)):
            began = t.now
            emu.device(plan, rank).computed(op, began)
            assert t.now - began == pytest.approx(3.0 * costs.compute(rank, op) / 1e3)


def test_links_are_padded_for_the_profiles_bytes():
    t = FakeTime()
    emu = _emulation(t, dilation=2.0, p2p_alpha_ms=0.5, p2p_ms_per_mib=0.25,
                     allreduce_alpha_ms=0.1, allreduce_ms_per_mib=0.2)
    plan = _plan()
    dev = emu.device(plan, 1)
    t.spend(0.003)  # the real receive (a wait on the sender): not counted, padded after it
    before = t.now
    dev.received(Op(OpKind.RECV_BWD, 0, 3))
    want = 2.0 * (0.5 + 0.25 * BIG.message_bytes() / MIB)   # the profile's message, not JOB's
    assert (t.now - before) * 1e3 == pytest.approx(want)
    before = t.now
    dev.reduced()
    assert (t.now - before) * 1e3 == pytest.approx(
        ProfileCosts(plan, emu.device_profile).reduce(tuple(plan.replicas(1))))
    assert (t.now - before) > 0
    before = t.now
    # one of this job's layers with Adam's state, and its word embeddings': each as much of
    # the profile's model as it is there
    emu.transferred({"decoder.layers.3.mlp.linear_fc1.weight/tp0of1": JOB.layer_params() * 16,
                     "embedding.word_embeddings.weight/tp0of1":
                         JOB.vocab_size * JOB.hidden_size * 16})
    assert (t.now - before) * 1e3 == pytest.approx(2.0 * (0.5 + 0.25 * (
        BIG.layer_params() + BIG.vocab_size * BIG.hidden_size) * 16 / MIB))
    assert emu.count.ops == 0


def test_checkpoint_io_takes_the_profiles_state_over_the_storage():
    t = FakeTime()
    emu = _emulation(t, dilation=2.0)
    plan = _plan()
    dev = emu.device(plan, 0)
    began = t.now
    dev.checkpoint_io(began)
    params = BIG.embedding_params() + 2 * BIG.layer_params()
    assert t.now - began == pytest.approx(2.0 * params * 16 / MIB / STORAGE_MIB_PER_S)


def test_a_shadow_refresh_takes_what_the_planner_charges_for_it():
    """Eager redundancy on pipeline 2 x data 2: rank 0 (stage 0) and rank 2 (stage 1) hold
    each other's copies; a refresh sends its stage and receives the other's, in the profile's
    shape over its dilated link: the slowest rank's refresh of eager_cost, whose starts the
    iteration's prediction is simulated with (its factor 1 here)."""
    t = FakeTime()
    emu = _emulation(t, dilation=2.0, p2p_alpha_ms=0.5, p2p_ms_per_mib=0.01)
    plan = _plan()
    dev = emu.device(plan, 0)
    began = t.now
    t.spend(0.001)                                  # the real refresh, well inside its time
    dev.refreshed(began)
    both = stage_params(plan, 0, BIG) + stage_params(plan, 2, BIG)
    assert t.now - began == pytest.approx(2.0 * (2 * 0.5 + 0.01 * 12 * both / MIB) / 1e3)
    assert eager_cost(plan, emu.device_profile).refresh_ms == pytest.approx(1e3 * (t.now - began))


def test_the_planner_sees_the_dilated_profile_on_dedicated_devices():
    profile = synthetic_profile(BIG, layer_fwd_ms=3.0, p2p_ms_per_mib=0.1, cores=2.0,
                                ranks_per_host=4)
    dev = emulated_profile(profile, 5.0)
    assert dev.layer_fwd_ms == 15.0 and dev.p2p_ms_per_mib == pytest.approx(0.5)
    assert dev.cores == 0 and dev.ranks_per_host == 0 and dev.shape == BIG
    assert dev.load_ms_per_mib == pytest.approx(5.0 * 1e3 / STORAGE_MIB_PER_S)


def test_a_run_with_more_than_one_percent_overruns_is_invalid():
    ok = emulation_event([OverrunCount(500, 5), OverrunCount(500, 5)], 4.0)
    assert ok["valid"] and ok["share"] == 0.01 and ok["ops"] == 1000
    bad = emulation_event([OverrunCount(500, 6, 2.5), OverrunCount(500, 5, 1.0)], 4.0)
    assert not bad["valid"] and bad["overruns"] == 11 and bad["worst_overrun_ms"] == 2.5


def test_an_invalid_run_says_so_in_one_line_and_in_its_event(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    reporter = Reporter(LoggingConfig(metrics_file=str(path)), train_iters=1, seq_length=32,
                        lead=True)
    reporter.emulation(emulation_event([OverrunCount(100, 0)], 4.0))
    reporter.emulation(emulation_event([OverrunCount(100, 2)], 4.0))
    reporter.close()
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "WARNING" in line] == [
        "WARNING: this run is invalid as an emulation: 2.0% of its ops overran their emulated "
        "time (over 1%); raise --chameleon-emulate-dilation"]
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["valid"], e["overruns"]) for e in events] == [
        ("emulation", True, 0), ("emulation", False, 2)]


@pytest.mark.parametrize("flags, message", [
    (["--chameleon-emulate-dilation", "0"], "--chameleon-emulate-dilation 0 must be positive"),
    (["--chameleon-emulate", "/nonexistent/h200.json"],
     "--chameleon-emulate: cannot read profile /nonexistent/h200.json"),
    (["--chameleon-emulate", "BAD_JSON"], "is not JSON"),
    (["--chameleon-emulate", "NOT_PROFILE"], "not a Chameleon profile"),
])
def test_bad_emulation_flags_exit_2_with_one_line(tmp_path, flags, message):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"source": "analytical"}))
    flags = [{"BAD_JSON": str(tmp_path / "bad.json"),
              "NOT_PROFILE": str(tmp_path / "other.json")}.get(f, f) for f in flags]
    r = run_script(["--num-layers", "4", "--mock-data", *flags])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr
