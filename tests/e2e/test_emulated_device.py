"""A job on emulated accelerators: 4 ranks (pipeline 2 x data 2) whose ops take a profile's
times run at the iteration time the simulator predicts for that profile, with the losses of a
run that emulates nothing, and report how many ops overran their emulated time."""

import statistics

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import ModelShape, predict_plan
from megatron.elastic.emulation import emulated_profile
from tests.launch import SMALL_MODEL, assert_close, run_chameleon, run_job
from tests.profiles import synthetic_profile

pytestmark = pytest.mark.slow
ITERS = 10
DILATION = 20.0
# A GPT layer of hidden 1024 on a device some 20x slower than an H200, so that with the
# dilation one iteration of 2 micro-batches per pipeline takes ~530 ms: long beside what the
# emulation does not cover (Python between ops, the step's commit, data loading), short enough
# for a quick test, and each op 40-100 ms, several times the real op's time on a host whose
# 2 cores run other jobs too (at dilation 10, ops of 20-50 ms overran by up to 23 ms there).
SHAPE = ModelShape(24, 1024, 16, 1024, 1, 50304)
PROFILE = synthetic_profile(SHAPE, layer_fwd_ms=1.0, layer_bwd_input_ms=1.0,
                            layer_bwd_weight_ms=1.5, head_fwd_ms=0.5, head_bwd_ms=1.0,
                            optimizer_ms_per_mparam=0.02, p2p_alpha_ms=0.01,
                            p2p_ms_per_mib=0.05, allreduce_alpha_ms=0.01,
                            allreduce_ms_per_mib=0.002)


def test_emulated_run_takes_the_predicted_time_with_unchanged_losses(small_data, tmp_path):
    args = SMALL_MODEL + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                          "--train-iters", str(ITERS), "--lr-decay-iters", str(ITERS),
                          "--lr", "3e-3", "--data-path", small_data, "--split", "100,0,0",
                          "--log-interval", "1"]
    profile_path = tmp_path / "device.json"
    PROFILE.save(profile_path)
    # Each run's deadline bounds a 4-process job of 10 short iterations on a loaded 2-core
    # host (start-up ~20 s); far beyond it, something hangs.
    ref = run_job(4, args, tmp_path, name="ref", timeout=120)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = run_chameleon(4, args + ["--chameleon", "--chameleon-emulate", str(profile_path),
                                   "--chameleon-emulate-dilation", str(DILATION)],
                        tmp_path, name="emulated", timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_close(run.losses(), ref.losses())
    [event] = [e for e in run.metrics if e["event"] == "emulation"]
    # 4 ranks x 9 iterations past the warm-up x (2 forwards + 2 backwards (or their halves) +
    # the step)
    assert event["ops"] >= 4 * (ITERS - 1) * 5 and event["dilation"] == DILATION
    assert 0 <= event["overruns"] <= event["ops"]
    assert "padded ops overran" in run.stdout
    if not event["valid"]:
        assert "invalid as an emulation" in run.stdout
        # Its iteration time is then the host's, not the profile's: nothing to compare.
        pytest.skip(f"host too loaded for dilation {DILATION:g}: {event['overruns']} of "
                    f"{event['ops']} ops overran their emulated time")

    plan = ExecutionPlan.failure_free(4, 1, 2, 4, 2, 8)
    predicted = predict_plan(plan, emulated_profile(PROFILE, DILATION)).iteration_ms
    assert 400 < predicted < 700  # the profile above means what its comment says
    iters = [e["elapsed_ms"] for e in run.metrics if e["event"] == "iteration"]
    measured = statistics.median(iters[2:])  # the first ones warm up groups and allocators
    assert abs(measured - predicted) / predicted < 0.10, (measured, predicted, iters)
