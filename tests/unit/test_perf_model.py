"""The performance model: predictions on small schedules computed by hand, parameter counts,
profiles on disk, and the fit of per-layer costs."""

import dataclasses
import json

import pytest

from chameleon_ext import perf_model
from chameleon_ext.perf_model import (MIB, ModelShape, Profile, ProfileError, allreduce_ms,
                                      analytical_profile, fit_layer_costs, predict, predict_plan,
                                      stage_params, switch_ms, transition_ms)
from chameleon_ext.plan import ExecutionPlan
from chameleon_ext.schedule_choice import choose_schedule
from chameleon_ext.schedule_ir import one_f_one_b
from chameleon_ext.strategies.reroute import reroute
from tests.profiles import synthetic_profile

SHAPE = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                   micro_batch_size=2, vocab_size=512)


def profile(**kw) -> Profile:
    """One layer: forward 1 ms, backward 0.5 + 0.5 ms; everything else free."""
    return synthetic_profile(SHAPE, **{"layer_fwd_ms": 1.0, "layer_bwd_input_ms": 0.5,
                                       "layer_bwd_weight_ms": 0.5, **kw})


def pp2() -> ExecutionPlan:
    return ExecutionPlan.failure_free(2, 1, 2, 4, 2, 4)  # 2 layers per stage, 2 micro-batches


def test_1f1b_prediction_matches_the_hand_computed_time():
    """Stage costs: forward 2, backward 2. Rank 0: F0 [0,2] F1 [2,4] B0 [6,8] B1 [10,12];
    rank 1: F0 [2,4] B0 [4,6] F1 [6,8] B1 [8,10]."""
    plan = pp2()
    assert predict(plan, one_f_one_b(plan), profile()).iteration_ms == 12.0


def test_message_latency_is_paid_by_a_waiting_receiver():
    """With 0.5 ms per message: rank 1 starts at 2.5, its B0 gradient reaches rank 0 at 7, and
    B1 (rank 1 at [8.5, 10.5]) at 11: rank 0 ends at 13."""
    plan = pp2()
    assert predict(plan, one_f_one_b(plan), profile(p2p_alpha_ms=0.5)).iteration_ms == 13.0


def test_ranks_sharing_cores_compute_slower_while_both_compute():
    """Pipeline 2 on one core: each rank's ops stretch while the other computes too, so the
    iteration lies between the work of both on one core (16 ms) and everything at half speed
    (24 ms); on two cores nothing stretches. A lone rank on half a core takes twice as long."""
    plan = pp2()
    shared = predict(plan, one_f_one_b(plan), profile(cores=1.0)).iteration_ms
    assert 16.0 <= shared < 24.0
    assert predict(plan, one_f_one_b(plan), profile(cores=2.0)).iteration_ms == 12.0
    one = ExecutionPlan.failure_free(1, 1, 1, 4, 2, 4)
    alone = predict(one, one_f_one_b(one), profile()).iteration_ms
    assert predict(one, one_f_one_b(one), profile(cores=0.5)).iteration_ms == \
        pytest.approx(2 * alone)


def test_overhead_and_optimizer_add_to_the_iteration():
    plan = pp2()
    params = stage_params(plan, 0, SHAPE)
    prof = profile(iteration_overhead_ms=3.0, optimizer_ms_per_mparam=1e6 / params)
    # rank 0 steps for 1 ms after its last backward and ends at 13; rank 1 (about as many
    # parameters) ends near 11.
    got = predict(plan, one_f_one_b(plan), prof).iteration_ms
    assert got == pytest.approx(13.0 + 3.0)


def test_ring_allreduce_cost():
    prof = profile(allreduce_alpha_ms=0.01, allreduce_ms_per_mib=2.0)
    assert allreduce_ms(prof, 1, MIB) == 0.0
    assert allreduce_ms(prof, 4, 4 * MIB) == pytest.approx(6 * (0.01 + 2.0))


def test_parameter_counts_are_megatron_cores():
    """Counted on megatron-core's GPTModel (hidden 64, 4 heads, vocab 512, 32 positions):
    49,984 per layer; 34,816 in the embeddings; 128 in the final layer norm."""
    assert SHAPE.layer_params() == 49_984
    assert SHAPE.embedding_params() == 34_816
    plan = pp2()
    assert stage_params(plan, 0, SHAPE) == 2 * 49_984 + 34_816
    assert stage_params(plan, 1, SHAPE) == 2 * 49_984 + 128 + 512 * 64
    one = ExecutionPlan.failure_free(1, 1, 1, 4, 2, 4)
    assert stage_params(one, 0, SHAPE) == 4 * 49_984 + 34_816 + 128


def test_memory_counts_state_and_in_flight_activations():
    plan = pp2()
    pred = predict(plan, one_f_one_b(plan), profile())
    # stage 0 holds two micro-batches' activations at its peak, stage 1 one
    assert pred.memory_bytes[0] == stage_params(plan, 0, SHAPE) * 16 + \
        2 * 2 * SHAPE.layer_activation_bytes()
    assert pred.memory_bytes[1] == stage_params(plan, 1, SHAPE) * 16 + \
        1 * 2 * SHAPE.layer_activation_bytes()


def test_measured_activation_bytes_replace_the_formula_and_add_embedding_and_head():
    plan = pp2()
    prof = profile(layer_activation_bytes=1000, embedding_activation_bytes=300,
                   head_activation_bytes=7000)
    pred = predict(plan, one_f_one_b(plan), prof)
    assert pred.memory_bytes[0] == stage_params(plan, 0, SHAPE) * 16 + 2 * (2 * 1000 + 300)
    assert pred.memory_bytes[1] == stage_params(plan, 1, SHAPE) * 16 + 1 * (2 * 1000 + 7000)


def test_transition_cost_adds_its_parts():
    prof = profile(detect_ms=10.0, rebuild_ms=100.0, p2p_ms_per_mib=2.0, load_ms_per_mib=5.0)
    assert transition_ms(prof) == 110.0
    assert transition_ms(prof, moved_bytes=MIB, loaded_bytes=2 * MIB, lost_iterations=3,
                         iteration_ms=7.0) == 110.0 + 2.0 + 10.0 + 21.0


def test_profile_round_trips_through_a_file(tmp_path):
    prof = analytical_profile(SHAPE, "H200")
    path = tmp_path / "profile.json"
    prof.save(path)
    assert Profile.load(path) == prof
    assert not (tmp_path / "profile.json.tmp").exists()


def test_bad_profiles_are_refused(tmp_path):
    with pytest.raises(ProfileError, match="cannot read profile"):
        Profile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ProfileError, match="is not JSON"):
        Profile.load(tmp_path / "bad.json")
    (tmp_path / "partial.json").write_text(json.dumps({"source": "measured"}))
    with pytest.raises(ProfileError, match="not a Chameleon profile"):
        Profile.load(tmp_path / "partial.json")
    with pytest.raises(ProfileError, match="unknown device"):
        analytical_profile(SHAPE, "TPU")
    with pytest.raises(ProfileError, match="source"):
        dataclasses.replace(profile(), source="guessed")


def test_analytical_profile_is_marked_and_scales_with_flops():
    a100, h200 = analytical_profile(SHAPE, "A100"), analytical_profile(SHAPE, "H200")
    assert a100.source == "analytical" and "analytical" in a100.notes[0]
    assert h200.layer_fwd_ms < a100.layer_fwd_ms
    assert a100.head_fwd_ms / a100.layer_fwd_ms == pytest.approx(
        SHAPE.head_flops() / SHAPE.layer_flops())


def test_fit_recovers_layer_and_head_costs():
    ratio = SHAPE.head_flops() / SHAPE.layer_flops()
    stages = [(2, True, False, 2 * 0.7), (2, False, True, (2 + ratio) * 0.7),
              (1, False, True, (1 + ratio) * 0.7)]
    layer, head = fit_layer_costs(stages, SHAPE)
    assert layer == pytest.approx(0.7) and head == pytest.approx(0.7 * ratio)


def test_a_planned_switch_costs_the_rebuild_and_the_read_only():
    prof = profile(detect_ms=10.0, rebuild_ms=100.0, load_ms_per_mib=5.0)
    assert switch_ms(prof, loaded_bytes=2 * MIB) == 110.0


# (world, tensor parallel, pipeline depth, global batch, lost ranks, ranks simulated):
# failure_free numbers rank t + tp (d + dp s) for shard t of pipeline d's stage s (pp 4 x dp 4:
# rank 5 is pipeline 1's stage 1); a global batch of 2 x dp gives each pipeline one micro-batch.
REROUTED = [
    (6, 1, 2, 6, {1}, 5),            # pp 2 x dp 3: a first stage; its one untouched pipeline
    (16, 1, 4, 8, {5}, 11),          # pp 4 x dp 4: a middle stage; one of two untouched left out
    (16, 1, 4, 8, {15}, 11),         # a last stage
    (16, 1, 4, 8, {1, 9}, 10),       # two stages of one pipeline, hosted by one other
    (16, 1, 4, 8, {0, 7}, 14),       # two pipelines, and a third hosts: one untouched
    (16, 1, 4, 16, {2, 6, 11}, 13),  # three failures, two in one pipeline, two micro-batches each
    (16, 1, 2, 32, {3}, 7),          # pp 2 x dp 8, two micro-batches each: two hosts
    (16, 1, 2, 16, {3, 4, 12}, 7),   # a pipeline without any rank left
    (16, 2, 2, 8, {3}, 5),           # tp 2 x pp 2 x dp 4: one shard of each stage simulated
    (16, 2, 2, 8, set(), 2),         # nothing lost: one shard of one pipeline
]


@pytest.mark.parametrize("world, tp, depth, batch, lost, simulated_ranks", REROUTED)
def test_predict_plan_equals_the_whole_plans_prediction(world, tp, depth, batch, lost,
                                                        simulated_ranks, monkeypatch):
    """Only the rerouted pipelines, their hosts and one untouched pipeline of each kind are
    simulated, one tensor-parallel shard of each stage, with every reduction costed for its
    whole group: the same time and memory."""
    plan = reroute(ExecutionPlan.failure_free(world, tp, depth, 4, 2, batch), lost)
    simulate = perf_model.simulate
    simulated = []

    def counting(plan, schedule, costs, **kw):
        simulated.append(len(schedule.ops))
        return simulate(plan, schedule, costs, **kw)

    # slow ranks 2 and 9 make their pipelines kinds of their own
    for prof in (profile(p2p_alpha_ms=0.1, allreduce_alpha_ms=0.05, allreduce_ms_per_mib=0.5,
                         embedding_fwd_ms=0.2, embedding_bwd_ms=0.3, head_fwd_ms=0.7,
                         head_bwd_ms=1.1, optimizer_ms_per_mparam=2.0,
                         iteration_overhead_ms=1.5),
                 profile(allreduce_alpha_ms=0.05, rank_slowdown={2: 1.5, 9: 1.25})):
        whole = predict(plan, choose_schedule(plan, fuse=False), prof)
        monkeypatch.setattr(perf_model, "simulate", counting)
        fast = predict_plan(plan, prof)
        monkeypatch.setattr(perf_model, "simulate", simulate)
        assert fast.iteration_ms == whole.iteration_ms
        assert fast.memory_bytes == whole.memory_bytes
        assert fast.bubble_fraction == pytest.approx(whole.bubble_fraction, rel=1e-9)
    assert simulated[0] == simulated_ranks
