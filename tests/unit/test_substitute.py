"""Substitute: spares take the lost places, the layout kept, the state from the replicas."""

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.decider import Decider, Planning
from chameleon_ext.planning.decision import Verdict
from chameleon_ext.planning.perf_model import ModelShape
from chameleon_ext.planning.planner import Situation, candidates, choose
from chameleon_ext.planning.strategies import REGISTRY, Context
from chameleon_ext.planning.strategies.substitute import substitute
from tests.profiles import synthetic_profile

SHAPE = ModelShape(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                   micro_batch_size=1, vocab_size=512)


def synthetic():
    return synthetic_profile(SHAPE, layer_fwd_ms=1.0, layer_bwd_input_ms=1.0,
                             layer_bwd_weight_ms=1.0, p2p_alpha_ms=0.01,
                             allreduce_alpha_ms=0.01, allreduce_ms_per_mib=0.1, detect_ms=50.0,
                             rebuild_ms=400.0, load_ms_per_mib=1.0)


def pp2_dp2() -> ExecutionPlan:
    return ExecutionPlan.failure_free(4, 1, 2, 8, 1, 8)


def test_the_spare_takes_the_lost_place_and_the_layout_is_kept():
    plan = pp2_dp2()
    new = substitute(plan, {3}, spares=1)
    assert new.generation == plan.generation + 1
    # survivors 0, 1, 2 keep their numbers; the lost place is the spare's, rank 3 again
    assert [[st.ranks for st in p.stages] for p in new.pipelines] == \
        [[st.ranks for st in p.stages] for p in plan.pipelines]
    lost_first = substitute(plan, {0}, spares=1)
    assert lost_first.position(3) == plan.position(0)        # the spare: pipeline 0's stage 0
    assert lost_first.position(0) == plan.position(1)        # rank 1, renumbered densely
    assert [st.num_layers for p in lost_first.pipelines for st in p.stages] == \
        [st.num_layers for p in plan.pipelines for st in p.stages]


def test_whole_tensor_parallel_groups_are_filled():
    plan = ExecutionPlan.failure_free(8, 2, 2, 8, 1, 8)      # TP 2 x PP 2 x DP 2
    assert substitute(plan, {3}, spares=1) is None           # one spare: not a whole group
    new = substitute(plan, {3}, spares=2)
    group = plan.stage_of(3).ranks                           # rank 3's group, both shards
    assert [new.position(6 + t) for t in range(2)] == [plan.position(r) for r in group]


def test_infeasible_without_spares_or_without_a_holder_of_the_state():
    plan = pp2_dp2()
    assert substitute(plan, {3}, spares=0) is None
    assert substitute(plan, {2, 3}, spares=2) is None        # every holder of the last stage
    assert substitute(plan, set(), spares=2) is None          # nothing to fill
    ctx = Context(synthetic(), spares=1)
    found = REGISTRY["substitute"].propose(plan, {3}, ctx)
    # the filled place's whole stage: 4 layers and the output layer, 12 bytes a parameter
    assert REGISTRY["substitute"].moved_bytes(plan, found.plan, {3}, ctx) == \
        12 * (4 * SHAPE.layer_params() + SHAPE.head_params(False))


def test_auto_prefers_the_substitute_over_every_in_place_strategy():
    plan = pp2_dp2()
    situation = Situation(iteration=10, checkpoint_iteration=0, remaining_iterations=100,
                          failure_free_ms=30.0)
    ranked = candidates(plan, {3}, synthetic(), situation, spares=1)
    assert choose(ranked).strategy == "substitute"
    chosen = ranked[0]
    others = [c for c in ranked if c.strategy != "substitute" and c.feasible]
    assert others and all(chosen.iteration_ms <= c.iteration_ms for c in others)
    assert chosen.move_back_ms == 0.0 and chosen.plan.world_size == 4
    assert "substitute" not in [c.strategy for c in candidates(plan, {3}, synthetic(),
                                                                   situation)]


def test_the_decider_gives_the_lost_place_to_the_spare_and_keeps_stayers_first():
    profile = synthetic()
    planning = Planning(lambda plan, ranks: profile,
                        lambda it: Situation(it, 0, 100, failure_free_ms=30.0))
    plan = pp2_dp2()
    # launch ranks of the committed world, and a spare (launch rank 0, an earlier plan's)
    launch = [1, 2, 3, 4]
    for strategy in ("auto", "reroute", "restart"):
        verdict = Decider(strategy, planning=planning).after_failure(plan, launch, {0}, 10, [0])
        d = Verdict.from_json(verdict.to_json()).decision
        assert d.strategy == "substitute", strategy
        assert d.members == [2, 3, 4, 0]            # the spare last: the lead holds state
        assert d.plan.position(3) == plan.position(0)
    # without spares every strategy is what it was
    assert Decider("reroute", planning=planning).after_failure(
        plan, launch, {0}, 10).decision.strategy == "reroute"


def test_an_admission_places_spares_like_joiners_and_keeps_the_rest_spare():
    target = pp2_dp2()
    rerouted = REGISTRY["reroute"].propose(target, {3}, Context()).plan
    d = Decider("reroute", target=target).for_admission(rerouted, [0, 1, 2], [0, 1, 2, 5, 7],
                                                        20).decision
    assert d.members == [0, 1, 2, 5] and d.joined == [5] and d.plan.world_size == 4


def test_the_agreement_is_led_by_the_lowest_rank_holding_state():
    """A spare (launch rank 0, no applied iteration) never leads: only a rank that holds state
    knows why the generation opened."""
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from chameleon_ext.control.membership import Membership
    store = dist.HashStore()
    ranks = {0: None, 1: 7, 2: 7}      # launch rank -> its last applied iteration

    def agree(rank: int):
        members = Membership(store, rank, 3, heartbeat_timeout=5.0)
        # bounded by 10 s: three threads on one in-process store agree in milliseconds
        return members.agreements.agree(1, [0, 1, 2], 10.0, iteration=ranks[rank])

    with ThreadPoolExecutor(3) as pool:
        agreed = list(pool.map(agree, ranks))
    assert {(ag.leader, ag.iteration, tuple(ag.alive)) for ag in agreed} == {(1, 7, (0, 1, 2))}


def test_when_every_member_is_lost_the_spares_restart_from_the_checkpoint():
    target = ExecutionPlan.failure_free(8, 1, 2, 8, 1, 8)   # pipeline 2 x data 4
    d = Decider("auto", target=target).onto_spares([5, 9], generation=3).decision
    assert d.restarts and d.members == [5, 9] and d.plan.generation == 3
    assert (len(d.plan.pipelines), len(d.plan.pipelines[0].stages)) == (1, 2)
    assert "every rank of the plan was lost" in d.why
    whole = Decider("auto", target=target).onto_spares(list(range(10, 18)), 4).decision
    assert whole.plan.world_size == 8 and whole.members == list(range(10, 18))
