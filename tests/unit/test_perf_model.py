"""The performance model: predictions on small schedules computed by hand, parameter counts,
profiles on disk, and the fit of per-layer costs."""

import dataclasses
import json
import math

import pytest

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning import perf_model
from chameleon_ext.planning.perf_model import (MIB, ModelShape, Profile, ProfileError, allreduce_ms,
                                      analytical_profile, fit_layer_costs, predict, predict_plan,
                                      stage_params, switch_ms, transition_ms)
from chameleon_ext.planning.strategies.reroute import reroute
from chameleon_ext.schedule.choice import choose_schedule
from chameleon_ext.schedule.ir import one_f_one_b
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


def test_a_negative_overhead_never_takes_more_than_half_a_plan_s_time():
    """A calibration fitted under a plan that simulates long may carry a large negative
    overhead; a plan that simulates short is predicted at half its simulated time, never at
    zero or below (which made a restart onto fewer ranks look free)."""
    plan = pp2()
    simulated = predict(plan, one_f_one_b(plan), profile()).iteration_ms
    assert predict(plan, one_f_one_b(plan), profile(iteration_overhead_ms=-2.0)).iteration_ms \
        == pytest.approx(simulated - 2.0)
    for prediction in (predict(plan, one_f_one_b(plan), profile(iteration_overhead_ms=-1e4)),
                       predict_plan(plan, profile(iteration_overhead_ms=-1e4))):
        assert prediction.iteration_ms == pytest.approx(simulated / 2)


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
    perf_model._predicted.cache_clear()
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


def test_a_layout_on_other_gpus_is_predicted_once_and_as_itself(monkeypatch):
    """A trace meets the same layouts on other GPUs again and again: predicted once, with the
    slow GPU and the memory named after the GPUs, each the prediction of that plan afresh."""
    perf_model._predicted.cache_clear()
    simulate = perf_model.simulate
    simulated = []

    def counting(*a, **kw):
        simulated.append(1)
        return simulate(*a, **kw)

    monkeypatch.setattr(perf_model, "simulate", counting)
    plan = reroute(ExecutionPlan.failure_free(16, 1, 4, 4, 2, 8), {5})
    elsewhere = {r: 2 * r + 3 for r in plan.ranks}           # the same order of GPUs
    shuffled = {r: (7 * r) % 17 for r in plan.ranks}         # another order
    for i, names in enumerate(({r: r for r in plan.ranks}, elsewhere, shuffled)):
        moved = plan.relabelled(names)
        prof = profile(allreduce_alpha_ms=0.05, rank_slowdown={names[2]: 1.5})
        got = predict_plan(moved, prof)
        afresh = perf_model._predict_plan(moved, prof)
        assert got.iteration_ms == afresh.iteration_ms
        assert got.memory_bytes == afresh.memory_bytes
        assert got.bubble_fraction == afresh.bubble_fraction
        # afresh simulates each time; predict_plan only for a new order of the GPUs
        assert len(simulated) == (2, 3, 5)[i]


def tp_profile(**kw) -> Profile:
    """profile() with a tensor-parallel link: 0.01 ms a step, 1 ms per MiB."""
    return profile(tp_alpha_ms=0.01, tp_ms_per_mib=1.0, **kw)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_all_reduces_are_in_the_prediction(tp):
    """One pipeline of one stage, 2 micro-batches, costs of a whole layer (the profile's
    tensor_parallel 1): each shard computes 1 / tp of every op, and each layer adds 2 ring
    all-reduces of [seq, micro-batch, hidden] to the forward and 2 to the input half of the
    backward (1 to the embedding's forward, 1 to the output layer's backward)."""
    plan = ExecutionPlan.failure_free(tp, tp, 1, 4, 2, 4)
    prof = tp_profile()
    ring = 2 * (tp - 1) * (0.01 + SHAPE.message_bytes() / tp / MIB)
    per_mb = 4 * (1.0 / tp + 2 * ring) + 4 * (0.5 / tp + 2 * ring + 0.5 / tp) + ring + ring
    assert predict_plan(plan, prof).iteration_ms == pytest.approx(2 * per_mb)
    assert prof.tp_allreduce(tp) == pytest.approx(ring)


def test_a_profile_measured_at_a_tensor_parallel_degree_is_used_as_measured_there():
    """Timers of a TP 2 job include its all-reduces: at TP 2 its costs are taken as they are;
    at TP 4 the measured all-reduce (the calibration hook) is taken out before the compute is
    split, and the TP 4 ring added."""
    measured = tp_profile(tensor_parallel=2, tp_allreduce_ms=0.2)
    assert measured.at_tensor_parallel(2) is measured
    at4 = measured.at_tensor_parallel(4)
    assert at4.tensor_parallel == 4 and at4.tp_allreduce_ms == pytest.approx(
        measured.tp_allreduce(4))
    assert at4.layer_fwd_ms == pytest.approx((1.0 - 2 * 0.2) / 2 + 2 * at4.tp_allreduce_ms)
    assert at4.layer_bwd_weight_ms == pytest.approx(0.5 / 2)
    # without a measurement, the link's ring at the profile's own degree is taken out
    assert tp_profile(tensor_parallel=2).at_tensor_parallel(4).layer_fwd_ms == pytest.approx(
        (1.0 - 2 * tp_profile().tp_allreduce(2)) / 2 + 2 * tp_profile().tp_allreduce(4))


def test_memory_is_per_tensor_parallel_shard():
    """Parameters, gradients, optimizer state and activations of a stage are split over its
    shards; measured activations are a shard's at the profile's degree."""
    one, four = (ExecutionPlan.failure_free(tp, tp, 1, 4, 2, 4) for tp in (1, 4))
    whole = predict_plan(one, tp_profile()).memory_bytes[0]
    shard = predict_plan(four, tp_profile()).memory_bytes
    assert set(shard) == {0, 1, 2, 3}
    assert all(whole // 4 - 4 <= m <= whole // 4 + 4 for m in shard.values())
    measured = tp_profile(tensor_parallel=4, layer_activation_bytes=1000)
    at4 = predict_plan(four, measured).memory_bytes[0]
    at1 = predict_plan(one, measured).memory_bytes[0]
    def state(tp: int) -> int:
        return perf_model.stage_param_count(SHAPE, 4, True, True, tp) * measured.bytes_per_param
    assert at1 - state(1) == 4 * (at4 - state(4))  # the measured shard's activations, x 4


def test_a_tensor_parallel_group_runs_at_its_slowest_ranks_pace():
    plan = ExecutionPlan.failure_free(4, 2, 2, 4, 2, 4)
    lead, sibling = plan.pipelines[0].stages[1].ranks
    slow_lead = predict_plan(plan, profile(rank_slowdown={lead: 2.0}))
    slow_sibling = predict_plan(plan, profile(rank_slowdown={sibling: 2.0}))
    assert slow_lead.iteration_ms == slow_sibling.iteration_ms > predict_plan(
        plan, profile()).iteration_ms
    assert perf_model.lockstep_slowdown(plan, {sibling: 2.0}) == {lead: 2.0, sibling: 2.0}


@pytest.mark.parametrize("tp", [1, 2])
def test_predict_plan_of_misaligned_plans_equals_the_whole_plans_prediction(tp, monkeypatch):
    """A takeover and a re-parallelization split the layers differently across pipelines, so
    their gradient all-reduces chain stages of several pipelines: predicted from their
    representatives all the same, each chain costed and waited for whole."""
    from chameleon_ext.planning.strategies.reparallelize import reparallelize
    from chameleon_ext.planning.strategies.takeover import takeover
    base = ExecutionPlan.failure_free(8 * tp, tp, 4, 8, 2, 32)
    lost = {base.pipelines[1].stages[2].ranks[-1]}
    plans = [takeover(base, lost), reparallelize(
        base, lost, lambda n, first, last: float(n),
        lambda layers, d: [layers // d + (i < layers % d) for i in range(d)], mix=[4, 3])]
    prof = tp_profile(p2p_alpha_ms=0.1, allreduce_alpha_ms=0.05, allreduce_ms_per_mib=0.5,
                      optimizer_ms_per_mparam=2.0)
    for plan in plans:
        assert plan.misaligned_stages() is not None
        whole = predict(plan, choose_schedule(plan, fuse=False), prof)
        fast = predict_plan(plan, prof)
        assert fast.iteration_ms == pytest.approx(whole.iteration_ms, rel=1e-12)
        assert fast.memory_bytes == whole.memory_bytes


# ---- Megatron-LM's model flags: Llama-style shapes, MoE, activation recompute -----------------
NEW_FIELDS = ("num_query_groups", "kv_channels", "gated_linear_unit", "add_bias_linear",
              "tied_embeddings", "learned_positions", "max_position_embeddings", "normalization",
              "qk_layernorm", "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "recompute")
LLAMA3_8B = ModelShape(32, 4096, 32, 8192, 1, 128256, ffn_hidden_size=14336, bytes_per_element=2,
                       num_query_groups=8, gated_linear_unit=True, add_bias_linear=False,
                       tied_embeddings=False, learned_positions=False, normalization="RMSNorm")


def test_a_profile_written_before_the_model_flags_loads_with_its_meaning(tmp_path):
    old = analytical_profile(SHAPE, "A100").to_dict()
    for name in NEW_FIELDS:
        del old["shape"][name]
    (tmp_path / "old.json").write_text(json.dumps(old))
    prof = Profile.load(tmp_path / "old.json")
    assert prof.shape == SHAPE and prof == analytical_profile(SHAPE, "A100")


@pytest.mark.parametrize("shape", [SHAPE, ModelShape(24, 2048, 16, 2048, 1, 50304,
                                                     ffn_hidden_size=5000, bytes_per_element=2)])
def test_gpt_shapes_cost_what_they_did(shape):
    """GPT-2's shapes: the formulas from before the model flags (Korthikanti et al.)."""
    s, b, h, a, f = (shape.seq_length, shape.micro_batch_size, shape.hidden_size,
                     shape.num_attention_heads, shape.ffn)
    assert shape.layer_params() == 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    assert shape.embedding_params() == (shape.vocab_size + s) * h
    assert shape.layer_flops() == 2.0 * s * b * (4 * h * h + 2 * h * f) + 4.0 * b * s * s * h
    if f == 4 * h:
        assert shape.layer_activation_bytes() == int(
            s * b * h * (34 + 5 * a * s / h) * shape.bytes_per_element / 2)
    assert shape.layer_recompute_flops() == 0.0


def test_a_default_given_explicitly_is_the_same_shape():
    """The job passes its derived sizes, a profile may leave them out: the same model."""
    explicit = ModelShape(4, 64, 4, 32, 2, 512, ffn_hidden_size=256, num_query_groups=4,
                          kv_channels=16, max_position_embeddings=32, moe_router_topk=2,
                          moe_ffn_hidden_size=96)
    assert explicit == SHAPE
    moe = ModelShape(4, 64, 4, 32, 2, 512, num_experts=4, moe_router_topk=2,
                     moe_ffn_hidden_size=256)
    assert moe.moe_ffn_hidden_size == 0 and moe.moe_ffn == 256


def test_llama_parameter_counts():
    """Llama 3 8B: Meta's published 8,030,261,248 parameters; no position embeddings, and the
    untied output layer is on the last stage even when it is also the first."""
    h, v = 4096, 128256
    assert perf_model.stage_param_count(LLAMA3_8B, 32, True, True, 1) == 8_030_261_248
    assert LLAMA3_8B.layer_params() == h * (h + 2 * 8 * 128) + h * h + 3 * h * 14336 + 2 * h
    assert LLAMA3_8B.embedding_params() == v * h
    assert LLAMA3_8B.head_params(first=True) == LLAMA3_8B.head_params(first=False) == h + v * h
    assert SHAPE.head_params(first=True) == 128
    assert SHAPE.head_params(first=False) == 128 + 512 * 64


def test_layer_flops_of_gqa_swiglu_and_moe():
    s, b, h, q = 32, 2, 64, 4 * 8
    gqa = ModelShape(1, h, 4, s, b, 512, ffn_hidden_size=96, kv_channels=8, num_query_groups=2,
                     gated_linear_unit=True)
    # QKV h x (q + 2 g kv), the projection q x h, three FFN matrices; scores over q
    assert gqa.layer_flops() == 2.0 * s * b * (h * (q + 2 * 2 * 8) + q * h + 3 * h * 96) \
        + 4.0 * b * s * s * q
    moe = ModelShape(1, h, 4, s, b, 512, num_experts=8, moe_router_topk=2,
                     moe_ffn_hidden_size=48)
    # the router (h x experts), then each token through its top 2 experts' two matrices
    assert moe.layer_flops() == 2.0 * s * b * (4 * h * h + h * 8 + 2 * 2 * h * 48) \
        + 4.0 * b * s * s * h
    assert moe.layer_params() == 4 * h * h + 4 * h + 8 * (h + 1 + 2 * h * 48 + 48 + h) + 4 * h
    shared = dataclasses.replace(moe, moe_shared_ffn=32)
    # and every token through the shared expert's MLP
    assert shared.layer_flops() - moe.layer_flops() == 2.0 * s * b * 2 * h * 32
    assert shared.layer_params() - moe.layer_params() == 2 * h * 32 + 32 + h
    assert dataclasses.replace(shared, num_experts=0).moe_shared_ffn == 0


def test_recompute_trades_activations_for_a_second_forward():
    s, b, h, a = SHAPE.seq_length, SHAPE.micro_batch_size, SHAPE.hidden_size, \
        SHAPE.num_attention_heads
    full = dataclasses.replace(SHAPE, recompute="full")
    selective = dataclasses.replace(SHAPE, recompute="selective")
    # full keeps the layer's input; selective drops the 5as/h attention-score terms
    assert full.layer_activation_bytes() == s * b * h * 4
    assert selective.layer_activation_bytes() == 34 * s * b * h * 4 // 2
    assert SHAPE.layer_activation_bytes() - selective.layer_activation_bytes() == \
        5 * a * s * s * b * 4 // 2
    # the backward's input half runs the forward (or its core attention) again
    plain, again = analytical_profile(SHAPE), analytical_profile(full)
    assert again.layer_fwd_ms == plain.layer_fwd_ms
    assert again.layer_bwd_input_ms == pytest.approx(2 * plain.layer_bwd_input_ms)
    assert again.layer_bwd_weight_ms == plain.layer_bwd_weight_ms
    assert analytical_profile(selective).layer_bwd_input_ms == pytest.approx(
        plain.layer_fwd_ms * (1 + 4.0 * b * s * s * h / SHAPE.layer_flops()))


def test_fit_of_forward_and_backward_costs_counts_the_recomputed_forward():
    """Forward + backward: a layer 3 forwards and 1 recomputed, the head 3 forwards."""
    full = dataclasses.replace(SHAPE, recompute="full")
    ratio = 3 * full.head_flops() / (4 * full.layer_flops())
    stages = [(2, True, False, 2 * 4.0), (2, False, True, (2 + ratio) * 4.0)]
    layer, head = fit_layer_costs(stages, full, with_backward=True)
    assert layer == pytest.approx(4.0) and head == pytest.approx(4.0 * ratio)
    assert fit_layer_costs(stages, SHAPE, with_backward=True) == fit_layer_costs(stages, SHAPE)


@pytest.mark.parametrize("field, value", [("normalization", "BatchNorm"), ("recompute", "half")])
def test_unknown_model_kinds_are_refused(tmp_path, field, value):
    d = analytical_profile(SHAPE).to_dict()
    d["shape"][field] = value
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=field):
        Profile.load(tmp_path / "p.json")


def test_with_overlapped_reduction_only_the_last_buckets_buddy_message_waits():
    """--overlap-grad-reduce cuts a stage's gradients into megatron-core's buckets (40M
    parameters at data 4); a buddy's message of one bucket crosses the links while the next is
    reduced, so the reduction waits for one bucket's part of it (here larger than the tied
    embedding's, which goes last), not the whole shard's."""
    big = dataclasses.replace(profile(), shape=dataclasses.replace(SHAPE, hidden_size=4096),
                              optimizer_instances=1, buddy_copies=True)
    plan = ExecutionPlan.failure_free(8, 1, 2, 8, 1, 8)
    params = perf_model.stage_params(plan, 0, big.shape)
    buckets = perf_model.grad_buckets(params, 4, True)
    assert buckets == math.ceil(params / 40e6) > 1
    whole = perf_model.buddy_message_ms(big, params, 4)
    overlapped = dataclasses.replace(big, overlap_grad_reduce=True)
    assert perf_model.buddy_message_ms(overlapped, params, 4) == pytest.approx(
        big.p2p_alpha_ms + (whole - big.p2p_alpha_ms) / buckets)
    # a tied embedding's gradient, summed over the first and last stages after the reduction,
    # goes after it: as large as the whole shard, it waits whole
    assert perf_model.buddy_message_ms(overlapped, params, 4, late=params) == \
        pytest.approx(whole)
    group = tuple(plan.replicas(0))
    assert perf_model.ProfileCosts(plan, big).reduce(group) - \
        perf_model.ProfileCosts(plan, overlapped).reduce(group) == \
        pytest.approx(whole - perf_model.buddy_message_ms(overlapped, params, 4))


@pytest.mark.parametrize("buddy", [False, True], ids=["sharded", "buddy-copies"])
def test_the_distributed_optimizer_holds_and_steps_a_shard(buddy):
    """Pipeline 2 x data 4 with one instance: each rank holds 1/4 of the moments (8 of its 16
    bytes a parameter) and steps 1/4 of its stage's parameters; a buddy copy holds and steps
    its owner's quarter too, and the gradient reduction waits for the owner's shard gradient.
    Two instances halve the shard count; a rerouted plan keeps the instances that divide its
    replica groups."""
    plan = ExecutionPlan.failure_free(8, 1, 2, 4, 1, 8)
    plain = profile(optimizer_ms_per_mparam=2.0)
    sharded = dataclasses.replace(plain, optimizer_instances=1, buddy_copies=buddy)
    params = perf_model.stage_params(plan, 0, SHAPE)
    step = perf_model.Op(perf_model.OpKind.OPT_STEP)
    opt = perf_model.ProfileCosts(plan, sharded).compute(0, step)
    assert opt == pytest.approx(2.0 * params / 1e6 / 4 * (2 if buddy else 1))
    message = plain.p2p_alpha_ms + plain.p2p_ms_per_mib * 4 * params / 4 / MIB
    group = tuple(plan.replicas(0))
    assert perf_model.ProfileCosts(plan, sharded).reduce(group) == pytest.approx(
        perf_model.ProfileCosts(plan, plain).reduce(group) + (message if buddy else 0.0))
    mem_plain = predict_plan(plan, plain).memory_bytes[0]
    mem = predict_plan(plan, sharded).memory_bytes[0]
    assert mem_plain - mem == params * 8 * 3 // 4 - (params * 16 // 4 if buddy else 0)
    assert perf_model.optimizer_params(plan, 0, sharded) == params / 4 * (2 if buddy else 1)
    two = dataclasses.replace(sharded, optimizer_instances=2)
    assert perf_model.optimizer_params(plan, 0, two) == params / 2 * (2 if buddy else 1)
    assert perf_model.optimizer_params(reroute(plan, {3}), 0, two) == \
        params / 3 * (2 if buddy else 1)


def test_an_interleaved_plan_is_predicted_per_chunk():
    """Pipeline 2 of 4 one-layer chunks (2 per rank), 2 micro-batches: each chunk's op costs
    its one layer, so the iteration is shorter than the plain pipeline's by half of its
    bubble; each rank holds its two chunks' parameters (as many as a plain stage's)."""
    from chameleon_ext.schedule.ir import interleaved_1f1b
    plain = pp2()
    plan = ExecutionPlan.failure_free(2, 1, 2, 4, 2, 4, virtual_stages=2)
    plain_ms = predict(plain, one_f_one_b(plain), profile()).iteration_ms
    assert plain_ms == 12.0           # 2 micro-batches x (2 + 2) ms + a bubble of 4 ms
    assert predict(plan, interleaved_1f1b(plan), profile()).iteration_ms == 10.0
    assert predict_plan(plan, profile()).iteration_ms == 10.0
    assert [stage_params(plan, r, SHAPE) for r in (0, 1)] == \
        [stage_params(plain, r, SHAPE) for r in (0, 1)]
