"""Live calibration: the profile fitted from per-rank timer samples reproduces their costs, finds
a slowed rank, and travels through the job's store."""

import json

import pytest
import torch.distributed as dist

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import ModelShape, predict
from chameleon_ext.schedule.ir import one_f_one_b
from megatron.elastic.calibration import (Calibrator, LiveCalibration, StageSample, calibrate,
                                          profile_from_samples, sample_key)
from megatron.elastic.schedules import ComputeClock
from megatron.training.planning import PredictionCheck
from tests.profiles import synthetic_profile

SHAPE = ModelShape(4, 64, 4, 64, 4, 512)
PLAN = ExecutionPlan.failure_free(4, 1, 2, 4, 4, 32)  # pipeline 2 x data 2, 4 micro-batches each
RATIO = SHAPE.head_flops() / SHAPE.layer_flops()


def samples(layer_fwd=2.0, layer_bwd=4.0, slow: dict[int, float] | None = None
            ) -> list[StageSample]:
    """What 4 ranks on 2 cores would measure for these dedicated per-layer costs: CPU time the
    cost itself, wall time twice that (and `slow` times more, sleeping)."""
    out = []
    for r in PLAN.ranks:
        n, last = PLAN.stage_of(r).num_layers, PLAN.is_last_stage(r)
        cpu = {"forward-compute": layer_fwd * (n + last * RATIO),
               "backward-compute": layer_bwd * (n + last * RATIO)}
        wall = {k: v * 2 * (slow or {}).get(r, 1.0) for k, v in cpu.items()}
        counts = {"forward-compute": 4, "backward-compute": 4}
        out.append(StageSample(r, n, PLAN.is_first_stage(r), last, 1000, 5, wall, cpu, counts,
                               400.0, sum(wall[k] * counts[k] for k in wall)))
    return out


def base():
    return synthetic_profile(SHAPE, cores=2.0)


def test_the_fit_recovers_dedicated_costs_from_ranks_sharing_cores():
    p = profile_from_samples(samples(), base())
    assert p.source == "measured" and p.rank_slowdown == {}
    assert p.layer_fwd_ms == pytest.approx(2.0)
    assert p.layer_bwd_input_ms + p.layer_bwd_weight_ms == pytest.approx(4.0)
    assert p.head_fwd_ms == pytest.approx(2.0 * RATIO)


def test_a_slowed_rank_is_found_and_left_out_of_the_fit():
    p = profile_from_samples(samples(slow={1: 2.0}), base())
    assert p.rank_slowdown == {1: pytest.approx(2.0, rel=1e-3)}
    assert p.layer_fwd_ms == pytest.approx(2.0)


def test_measured_activations_go_into_the_profile_by_part():
    measured = samples()
    for s in measured:
        s.activation_bytes = {"embedding": 300.0 if s.first else 0.0, "layers": 1000.0,
                              "head": 7000.0 if s.last else 0.0}
    p = profile_from_samples(measured, base())
    assert (p.layer_activation_bytes, p.embedding_activation_bytes,
            p.head_activation_bytes) == (1000, 300, 7000)
    assert profile_from_samples(samples(), base()).layer_activation_bytes == 0  # not measured


def test_the_overhead_makes_the_calibrated_prediction_the_measured_time():
    p = calibrate(PLAN, one_f_one_b(PLAN), samples(), base())
    assert p.iteration_overhead_ms > 0
    assert predict(PLAN, one_f_one_b(PLAN), p).iteration_ms == pytest.approx(400.0)


class FakeTimer:
    def __init__(self):
        self.total = 0.0

    def active_time(self):
        return self.total


def test_calibrator_means_skip_the_warm_up():
    timers = {n: FakeTimer() for n in ("forward-compute", "backward-compute", "optimizer")}
    clock = ComputeClock()
    cal = Calibrator(lambda name, log_level: timers[name], clock, warmup=1)
    ops = one_f_one_b(PLAN).ops[0]
    cal.start(PLAN, 0, ops, base())
    timers["forward-compute"].total = 9.0  # the warm-up iteration: not counted
    clock.add("forward-compute", 5.0)
    cal.after_iteration(500.0)
    assert cal.sample() is None
    timers["forward-compute"].total += 4 * 0.003  # 4 forwards of 3 ms, 2 of them on the CPU
    clock.add("forward-compute", 4 * 0.002)
    cal.after_iteration(120.0)
    s = cal.sample()
    assert s.op_ms["forward-compute"] == pytest.approx(3.0)
    assert s.op_cpu_ms["forward-compute"] == pytest.approx(2.0)
    assert s.op_counts["forward-compute"] == 4 and s.busy_ms == pytest.approx(12.0)
    assert s.iteration_ms == 120.0 and s.iterations == 1 and s.rank == 0


def test_samples_travel_through_the_store_for_their_generation_only():
    store = dist.HashStore()
    for s in samples():
        store.set(sample_key(10 + s.rank), json.dumps({"generation": 0, "sample": s.to_dict()}))
    live = LiveCalibration(store, 10, None, base())
    got = live.samples(PLAN, [10, 11, 12, 13, 14])
    assert sorted(s.rank for s in got) == [0, 1, 2, 3]
    later = ExecutionPlan.from_dict({**PLAN.to_dict(), "generation": 1})
    assert live.samples(later, [10, 11, 12, 13]) == []
    assert live.profile(later, [10, 11, 12, 13]) is None  # nothing measured, no base costs
    assert live.profile(PLAN, [10, 11, 12, 13]).layer_fwd_ms == pytest.approx(2.0)


def test_a_plan_not_measured_yet_is_predicted_with_the_latest_calibration():
    """A loss a few iterations after the last recovery: the plan it interrupts has no samples
    yet, so the leader (another process: the same store) predicts with the profile fitted
    under the plan before, its slow rank renamed from launch rank 12 to its new number."""
    store = dist.HashStore()
    for s in samples(slow={2: 3.0}):
        store.set(sample_key(10 + s.rank), json.dumps({"generation": 0, "sample": s.to_dict()}))
    fitted = LiveCalibration(store, 10, None, base()).profile(PLAN, [10, 11, 12, 13])
    assert fitted.rank_slowdown.keys() == {2}
    leader = LiveCalibration(store, 11, None, base())
    leader.measured_transition(None, 900.0)
    later = ExecutionPlan.from_dict({**PLAN.to_dict(), "generation": 1})
    latest = leader.profile(later, [11, 12, 13, 14])   # launch rank 10 lost, 14 joined
    assert latest.layer_fwd_ms == pytest.approx(fitted.layer_fwd_ms)
    assert latest.iteration_overhead_ms == pytest.approx(fitted.iteration_overhead_ms)
    assert latest.rank_slowdown == {1: fitted.rank_slowdown[2]}
    assert latest.rebuild_ms == 900.0    # this job's own transitions, measured since


def test_prediction_check_leaves_out_the_first_iteration():
    check = PredictionCheck(100.0, 5, "reroute", wanted=2)
    assert not check.add(400.0)
    assert not check.add(110.0)
    assert check.add(90.0)
    r = check.result()
    assert r["measured_iter_ms"] == 100.0 and r["relative_error"] == 0.0
    assert "0.0% off" in check.line()


def test_a_profile_calibrated_under_tensor_parallelism_is_a_shards():
    """The timers of a TP 2 job measure a shard's ops, their all-reduces included: the fitted
    profile says so, and predicts that plan from its measured costs as they are."""
    from chameleon_ext.planning.perf_model import analytical_profile
    shape = ModelShape(4, 64, 4, 32, 2, 128)
    plan = ExecutionPlan.failure_free(4, 2, 2, 4, 2, 8)
    schedule = one_f_one_b(plan)
    base = analytical_profile(shape, "A100")
    samples = [StageSample(r, 2, plan.is_first_stage(r), plan.is_last_stage(r), 1000, 5,
                           {"forward-compute": 2.0, "backward-compute": 4.0, "optimizer": 0.5},
                           {}, {"forward-compute": 2, "backward-compute": 2, "optimizer": 1},
                           60.0, 12.5) for r in plan.ranks]
    fitted = calibrate(plan, schedule, samples, base)
    assert fitted.tensor_parallel == 2 and fitted.tp_allreduce_ms == -1.0
    assert fitted.at_tensor_parallel(2) is fitted
    assert predict(plan, schedule, fitted).iteration_ms == pytest.approx(60.0)
