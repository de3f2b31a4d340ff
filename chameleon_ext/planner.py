"""Candidate plans after a failure, their predicted costs, and the choice among them.

Every available strategy proposes its plan over the survivors (chameleon_ext.strategies): reroute
(the lost stage's micro-batches to its replicas), takeover (a neighbour stage of the failed
pipeline absorbs the lost layers, fetched with their optimizer state from a replica),
reparallelize (pipelines of different depths over every survivor, the micro-batches split by
their speed), restart (the latest checkpoint onto the
homogeneous plan over the survivors predicted fastest, among every pipeline depth and width, its
layers split by a dynamic program over contiguous layer ranges so that the stages' predicted
costs are balanced) and the hybrid reroute+restart (reroute now, and at the next periodic
checkpoint save restart from that fresh checkpoint onto the re-planned layout). Each plan is
predicted with the performance model (chameleon_ext.perf_model.predict_plan: the simulator over
the schedule the executor would run, on the fewest pipelines that determine it exactly) and
costed as

    transition + horizon x predicted iteration time

where the horizon is the number of iterations expected before the next event: the job's remaining
iterations, or fewer when `--chameleon-mtbf` says a failure comes sooner. The hybrid, switching
after k iterations (the interrupted one, run again, included), costs

    reroute transition + k x reroute iteration + rebuild and checkpoint read
        + (horizon - k) x re-planned iteration

and is a candidate only when k is within the horizon. A candidate whose predicted memory exceeds
the device's is never chosen. The layouts of the restart search are predicted in the order of a
lower bound on their iteration time, and the search stops at the first bound above the best
prediction so far: the same choice as predicting every layout.

With tensor parallelism the unit of every strategy is a tensor-parallel group: a group with a
lost rank leaves the plan whole (its healthy ranks too), and every candidate runs on whole
surviving groups, its new rank i on plan.survivors(lost, its world size)[i]. The degree stays
the plan's: no candidate re-shards a replica to another degree.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

from chameleon_ext.perf_model import (MIB, Prediction, Profile, allreduce_ms, predict_plan,
                                      stage_param_count, switch_ms,
                                      transition_ms)
from chameleon_ext.plan import ExecutionPlan, Pipeline, Stage
from chameleon_ext.schedule_choice import choose_schedule
from chameleon_ext.schedule_ir import Schedule
from chameleon_ext.strategies.redundancy import eager_cost, shadow_pairs
from chameleon_ext.strategies.reroute import reroute
from chameleon_ext.strategies.restart import homogeneous
from chameleon_ext.strategies.reparallelize import applies as reparallelize_applies
from chameleon_ext.strategies.reparallelize import ranked_mixes, reparallelize
from chameleon_ext.strategies.takeover import takeover

STRATEGIES = ("reroute", "takeover", "reparallelize", "restart", "reroute+restart")
REPARALLELIZE_PREDICTED = 3  # mixes of pipeline depths predicted, of those estimated fastest


@dataclass
class Situation:
    """What the planner knows at a failure besides the plan and the profile."""

    iteration: int                     # the interrupted iteration (1-based)
    checkpoint_iteration: int          # of the latest checkpoint (0: none; restart from scratch)
    remaining_iterations: int          # iterations left to train, the interrupted one included
    mtbf_hours: float | None = None
    failure_free_ms: float = 0.0       # iteration time before the failure (for lost work)
    save_interval: int = 0             # a checkpoint after every multiple (0: no periodic saves)
    eager_redundancy: bool = False     # stages hold shadow copies (strategies.redundancy)


class _Scheduled:
    """`schedule`: the one the executor would run for `self.plan`, built on first use (the
    predictions do not need it whole, and at 16k ranks it takes seconds)."""

    plan: ExecutionPlan

    @cached_property
    def schedule(self) -> Schedule:
        return choose_schedule(self.plan, fuse=False)


@dataclass
class Switch(_Scheduled):
    """A hybrid's second step: after iteration `at_iteration` (a periodic checkpoint save) the
    job moves to `plan` by `strategy`, paying `transition_ms`."""

    strategy: str
    plan: ExecutionPlan
    iteration_ms: float
    transition_ms: float
    at_iteration: int


@dataclass
class Candidate(_Scheduled):
    strategy: str
    plan: ExecutionPlan
    iteration_ms: float
    transition_ms: float
    memory_bytes: int                  # the largest per-rank estimate
    feasible: bool
    total_ms: float = math.inf
    switch: Switch | None = None       # a hybrid's second step (plan etc. are the first's)

    def summary(self) -> dict:
        """The metrics file's form (ARCHITECTURE.md: recovery.candidates)."""
        out = {"strategy": self.strategy, "predicted_iter_ms": round(self.iteration_ms, 3),
               "transition_ms": round(self.transition_ms, 1),
               "memory_mib": round(self.memory_bytes / MIB, 1), "feasible": self.feasible,
               "total_ms": round(self.total_ms, 1) if math.isfinite(self.total_ms) else None,
               "world": self.plan.world_size, "layout": _layout(self.plan)}
        if self.switch is not None:
            s = self.switch
            out["switch"] = {"strategy": s.strategy, "at_iteration": s.at_iteration,
                             "predicted_iter_ms": round(s.iteration_ms, 3),
                             "transition_ms": round(s.transition_ms, 1),
                             "layout": _layout(s.plan), "world": s.plan.world_size}
        return out


def _layout(plan: ExecutionPlan) -> str:
    depths = [len(p.stages) for p in plan.pipelines]
    if len(set(depths)) == 1:
        return f"{len(depths)} pipeline(s) x {depths[0]} stage(s)"
    counts = {d: depths.count(d) for d in sorted(set(depths), reverse=True)}
    return f"{len(depths)} pipelines of " + " + ".join(f"{n} x {d}" for d, n in counts.items()) \
        + " stages"


def horizon_iterations(situation: Situation, iteration_ms: float) -> float:
    """Iterations expected before the next event, at `iteration_ms` each. The candidates are
    compared on one such count (the same work): with a horizon in time instead, every plan
    would fill it exactly and only the transitions would differ."""
    n = float(situation.remaining_iterations)
    if situation.mtbf_hours and iteration_ms > 0:
        n = min(n, situation.mtbf_hours * 3.6e6 / iteration_ms)
    return n


def candidates(plan: ExecutionPlan, lost: set[int], profile: Profile, situation: Situation,
               strategies: tuple[str, ...] = STRATEGIES) -> list[Candidate]:
    """Every strategy's plan over the survivors of `plan` without the ranks `lost`, predicted,
    costed over the horizon, cheapest first (infeasible ones last). The profile's slow ranks
    are those of `plan`. The unit is a tensor-parallel group: every strategy removes each
    group with a lost rank whole and numbers the ranks it keeps densely in their old order,
    so a candidate's new rank i is plan.survivors(lost, its world size)[i]."""
    kept = plan.survivors(lost)
    if not kept:
        return []
    lost_ms = situation.failure_free_ms
    hybrid = "reroute+restart" in strategies
    rerouted = restarted = None
    profile = profile.at_tensor_parallel(plan.tensor_parallel)
    after = profile.for_survivors(set(plan.ranks) - set(kept))
    if "reroute" in strategies or hybrid:
        new = reroute(plan, lost, profile.rank_slowdown)
        if new is not None:
            rerouted = _candidate("reroute", new, after,
                                  transition_ms(profile, lost_iterations=1, iteration_ms=lost_ms))
    took = took_all = None
    if "takeover" in strategies:
        eager = situation.eager_redundancy
        new = takeover(plan, lost, lambda n, first, last: stage_cost_ms(profile, n, first, last),
                       eager)
        if new is not None:
            took = _candidate("takeover", new, after, transition_ms(
                profile, moved_bytes=moved_bytes(plan, new, lost, profile, eager),
                lost_iterations=1, iteration_ms=lost_ms))
    if "reparallelize" in strategies:
        took_all = _reparallelized(plan, lost, profile, after, transition_ms(
            profile, lost_iterations=1, iteration_ms=lost_ms))
    if "restart" in strategies or hybrid:
        found = _replan(plan, lost, after)
        if found is not None:
            new, pred = found
            lost_its = situation.iteration - situation.checkpoint_iteration
            restarted = _candidate("restart", new, after, transition_ms(
                profile, loaded_bytes=_loaded_bytes(new, profile), lost_iterations=lost_its,
                iteration_ms=lost_ms), pred)
    out = [c for c in (rerouted, took, took_all, restarted)
           if c is not None and c.strategy in strategies]
    if situation.eager_redundancy:
        for c in (c for c in (took, took_all, restarted) if c is not None):
            _add_upkeep(c, after)
    pace = situation.failure_free_ms or min((c.iteration_ms for c in out if c.feasible),
                                            default=0.0)
    horizon = horizon_iterations(situation, pace)
    for c in out:
        if c.feasible:
            c.total_ms = c.transition_ms + horizon * c.iteration_ms
    if hybrid and rerouted is not None and restarted is not None:
        both = _hybrid(rerouted, restarted, profile, situation, horizon)
        if both is not None:
            out.append(both)
    return sorted(out, key=lambda c: (not c.feasible, c.total_ms))


def choose(ranked: list[Candidate]) -> Candidate | None:
    return ranked[0] if ranked and ranked[0].feasible else None


def _candidate(strategy: str, plan: ExecutionPlan, profile: Profile, transition: float,
               pred: Prediction | None = None) -> Candidate:
    """`plan` as a candidate, predicted unless `pred` is its prediction already."""
    pred = pred or predict_plan(plan, profile)
    fits = profile.device_memory_bytes <= 0 or pred.peak_memory_bytes <= profile.device_memory_bytes
    return Candidate(strategy, plan, pred.iteration_ms, transition, pred.peak_memory_bytes, fits)


def _add_upkeep(c: Candidate, profile: Profile) -> None:
    """Eager redundancy: a plan that keeps shadow copies pays for them in time and memory."""
    upkeep = eager_cost(c.plan, profile)
    c.iteration_ms += upkeep.sync_ms
    c.memory_bytes += upkeep.memory_bytes
    c.feasible = c.feasible and (profile.device_memory_bytes <= 0 or
                                 c.memory_bytes <= profile.device_memory_bytes)


def _reparallelized(plan: ExecutionPlan, lost: set[int], profile: Profile, after: Profile,
                    transition: float) -> Candidate | None:
    """The fastest predicted of the re-parallelized plans over every survivor built from the
    mixes of pipeline depths estimated fastest; its transition adds the state it moves."""
    def cost(n: int, first: bool, last: bool) -> float:
        return stage_cost_ms(profile, n, first, last)

    table = balanced_layers_by_depth(plan.num_layers, plan.num_layers, profile)

    def balance(layers: int, depth: int) -> list[int]:
        return table[depth - 1]

    if not reparallelize_applies(plan):
        return None
    best = None
    groups = len(plan.surviving_groups(lost))
    for mix in ranked_mixes(plan, groups, cost, balance)[:REPARALLELIZE_PREDICTED]:
        new = reparallelize(plan, lost, cost, balance, mix)
        if new is None:
            continue
        c = _candidate("reparallelize", new, after, transition)
        if best is None or c.iteration_ms < best.iteration_ms:
            best = c
    if best is not None:
        best.transition_ms += transition_ms(
            profile, moved_bytes=moved_bytes(plan, best.plan, lost, profile)) - \
            transition_ms(profile)
    return best


def moved_bytes(plan: ExecutionPlan, new: ExecutionPlan, lost: set[int],
                profile: Profile, eager: bool = False) -> int:
    """Parameters and Adam moments (12 bytes a parameter) of the layers each survivor holds
    under `new` but did not under `plan` (plan.survivors(lost) numbered densely in their old
    order), its tensor-parallel shard of them; `eager`: a rank also held the stages it kept
    shadow copies of."""
    survivors = plan.survivors(lost, new.world_size)
    shape = profile.shape
    shadowed: dict[int, list[int]] = {}
    for owner, holder in shadow_pairs(plan) if eager else ():
        shadowed.setdefault(holder, []).append(owner)
    total = 0
    for p in new.pipelines:  # a group's shards move alike: costed once per stage
        for s, st in enumerate(p.stages):
            if not st.ranks:
                continue
            old = survivors[st.ranks[0]]
            held = [old, *shadowed.get(old, [])]  # adjacent stages: one range of layers
            start = min(plan.stage_of(r).layer_start for r in held)
            end = max(plan.stage_of(r).layer_end for r in held)
            overlap = max(0, min(end, st.layer_end) - max(start, st.layer_start))
            extra = (st.num_layers - overlap) * shape.layer_params()
            first, last = s == 0, s == len(p.stages) - 1
            if first and not any(plan.is_first_stage(r) for r in held):
                extra += shape.embedding_params()
            if last and not any(plan.is_last_stage(r) for r in held):
                extra += shape.vocab_size * shape.hidden_size * (not first)
            total += len(st.ranks) * (12 * extra // plan.tensor_parallel)
    return total


def _loaded_bytes(plan: ExecutionPlan, profile: Profile) -> int:
    """The checkpoint read of a restart onto `plan`: its largest rank's state."""
    return max(stage_param_count(profile.shape, st.num_layers, s == 0, s == len(p.stages) - 1,
                                 plan.tensor_parallel)
               for p in plan.pipelines for s, st in enumerate(p.stages)) * \
        profile.bytes_per_param


def _hybrid(now: Candidate, then: Candidate, profile: Profile,
            situation: Situation, horizon: float) -> Candidate | None:
    """Reroute now (`now`), and restart onto `then`'s plan from the next periodic checkpoint,
    written after k iterations counted from the interrupted one (run again); None without
    periodic saves or when the switch would come after the `horizon` (iterations). (A
    rerouted plan always differs from a re-planned one: it has a stage without ranks.)"""
    every = situation.save_interval
    if every <= 0:
        return None
    at = -(-situation.iteration // every) * every
    k = at - situation.iteration + 1
    if k >= horizon:
        return None
    switch = Switch("restart", then.plan, then.iteration_ms,
                    switch_ms(profile, loaded_bytes=_loaded_bytes(then.plan, profile)), at)
    both = Candidate("reroute+restart", now.plan, now.iteration_ms, now.transition_ms,
                     max(now.memory_bytes, then.memory_bytes), now.feasible and then.feasible,
                     switch=switch)
    if both.feasible:
        both.total_ms = now.transition_ms + k * now.iteration_ms + switch.transition_ms + \
            (horizon - k) * then.iteration_ms
    return both


def replan(plan: ExecutionPlan, lost: set[int], profile: Profile) -> ExecutionPlan | None:
    """The fastest predicted homogeneous plan over at most plan.survivors(lost) (whole
    tensor-parallel groups, restart.homogeneous) that fits in memory: every pipeline depth and
    data-parallel width that divides the micro-batches, each with its layers balanced
    (balanced_layers); ties go to restart_plan's order (more ranks, then the depth closest to
    the old one). None when not even one pipeline fits."""
    found = _replan(plan, lost, profile)
    return found[0] if found else None


def _replan(plan: ExecutionPlan, lost: set[int],
            profile: Profile) -> tuple[ExecutionPlan, Prediction] | None:
    """replan's plan and its prediction."""
    tp, old_depth, mbs = plan.tensor_parallel, len(plan.pipelines[0].stages), \
        plan.num_micro_batches
    profile = profile.at_tensor_parallel(tp)
    device = profile.device_memory_bytes
    groups = len(plan.surviving_groups(lost))
    max_depth = min(plan.num_layers, groups)
    layouts = []
    for depth, sizes in enumerate(balanced_layers_by_depth(plan.num_layers, max_depth,
                                                           profile), 1):
        # parameters, gradients and optimizer state alone: a lower bound on the memory
        state = max(stage_param_count(profile.shape, n, s == 0, s == depth - 1, tp)
                    for s, n in enumerate(sizes)) * profile.bytes_per_param
        if device and state > device:
            continue
        for dp in range(1, groups // depth + 1):
            if mbs % dp == 0:
                layouts.append((_iteration_bound(profile, sizes, dp, mbs // dp, tp),
                                depth, dp, sizes))
    best: tuple[float, tuple, ExecutionPlan, Prediction] | None = None
    for bound, depth, dp, sizes in sorted(layouts, key=lambda x: x[0]):
        # the slack keeps a layout whose bound rounds above an equal prediction (a tie)
        if best is not None and bound > best[0] * (1 + 1e-9):
            break
        new = with_layers(homogeneous(plan, depth, dp, lost), sizes)
        pred = predict_plan(new, profile)
        if device and pred.peak_memory_bytes > device:
            continue
        key = (pred.iteration_ms, (-depth * dp, abs(depth - old_depth), -depth))
        if best is None or key < best[:2]:
            best = (*key, new, pred)
    return (best[2], best[3]) if best else None


def _iteration_bound(profile: Profile, sizes: list[int], dp: int, m: int, tp: int) -> float:
    """A lower bound on the predicted iteration time of `dp` pipelines whose stages hold `sizes`
    layers, `m` micro-batches each: a stage starts when the first forward reaches it, then runs
    all m forwards and backwards, and the gradient of its last backward still passes every
    earlier stage before the first stage's reduction and optimizer step; each stage also ends
    with its own. Compute at the speed of the fastest rank (shared cores only slow it), a
    shard of `tp` with its tensor-parallel all-reduces."""
    p = profile.at_tensor_parallel(tp)
    speed = min([1.0, *p.rank_slowdown.values()])
    msg = p.p2p_alpha_ms + p.p2p_ms_per_mib * p.shape.message_bytes() / MIB
    reach = back = first_tail = bound = 0.0
    for s, n in enumerate(sizes):
        first, last = s == 0, s == len(sizes) - 1
        fwd = (n * p.layer_fwd_ms + first * p.embedding_fwd_ms + last * p.head_fwd_ms) * speed
        bwd = (n * (p.layer_bwd_input_ms + p.layer_bwd_weight_ms) + first * p.embedding_bwd_ms
               + last * p.head_bwd_ms) * speed
        params = stage_param_count(p.shape, n, first, last, tp)
        tail = allreduce_ms(p, dp, params * 4) + p.optimizer_ms_per_mparam * params / 1e6 * speed
        if first:
            first_tail = tail
        done = reach + m * (fwd + bwd)
        bound = max(bound, done + tail, done + back + first_tail)
        reach += fwd + msg
        back += bwd + msg
    # The overhead grows with the sharing of cores (perf_model.overhead_ms): at its least
    # when positive, at the most the layout's ranks can share when negative.
    ranks = dp * tp * len(sizes)
    most = p.sharing(min(p.ranks_per_host or ranks, ranks))
    return bound + p.iteration_overhead_ms * (most if p.iteration_overhead_ms < 0 else 1.0)


def stage_cost_ms(profile: Profile, layers: int, first: bool, last: bool) -> float:
    """Forward plus backward of one micro-batch on a stage of `layers` layers (a shard at the
    profile's tensor-parallel degree, Profile.at_tensor_parallel)."""
    p = profile
    per_layer = p.layer_fwd_ms + p.layer_bwd_input_ms + p.layer_bwd_weight_ms
    return layers * per_layer + first * (p.embedding_fwd_ms + p.embedding_bwd_ms) + \
        last * (p.head_fwd_ms + p.head_bwd_ms)


def balanced_layers(num_layers: int, depth: int, profile: Profile) -> list[int]:
    """Layers per stage (contiguous ranges, each at least one) minimising the costliest stage:
    a dynamic program over (stages used, layers used); ties keep earlier stages smaller."""
    return balanced_layers_by_depth(num_layers, depth, profile)[-1]


def balanced_layers_by_depth(num_layers: int, max_depth: int,
                             profile: Profile) -> list[list[int]]:
    """balanced_layers for every depth 1..max_depth. The dynamic program's rows for the stages
    before the last do not depend on the depth, so they are computed once: O(max_depth x L^2)
    for all depths rather than for each."""
    inf = math.inf
    total = num_layers
    # cost[first][n]: a stage of n layers that is not the last; end[first][n]: one that is
    cost = [[stage_cost_ms(profile, n, f, False) for n in range(total + 1)] for f in (0, 1)]
    end = [[stage_cost_ms(profile, n, f, True) for n in range(total + 1)] for f in (0, 1)]
    # best[s][n]: the smallest max-stage cost of the first n layers on the first s stages (none
    # of them the last), cut[s][n] where the s-th of them starts; a strict improvement by more
    # than 1e-12 is needed to move a cut, so ties keep earlier stages smaller
    best = [[0.0] + [inf] * total]
    cut = [[0] * (total + 1)]
    for s in range(1, max_depth):
        prev, stage = best[s - 1], cost[s == 1]
        row, row_cut = [inf] * (total + 1), [0] * (total + 1)
        for n in range(s, total):  # a layer at least is left for the last stage
            b, at = inf, 0
            for k in range(s - 1, n):  # this stage holds layers [k, n)
                c = max(prev[k], stage[n - k])
                if c < b - 1e-12:
                    b, at = c, k
            row[n], row_cut[n] = b, at
        best.append(row)
        cut.append(row_cut)
    out = []
    for depth in range(1, max_depth + 1):
        prev, stage = best[depth - 1], end[depth == 1]
        b, at = inf, 0
        for k in range(depth - 1, total):
            c = max(prev[k], stage[total - k])
            if c < b - 1e-12:
                b, at = c, k
        sizes, n = [total - at], at
        for s in range(depth - 1, 0, -1):
            k = cut[s][n]
            sizes.append(n - k)
            n = k
        out.append(sizes[::-1])
    return out


def with_layers(plan: ExecutionPlan, sizes: list[int]) -> ExecutionPlan:
    """`plan` (homogeneous) with every pipeline's stages holding `sizes` layers."""
    depth = len(sizes)
    starts = [sum(sizes[:s]) for s in range(depth)]
    pipelines = [Pipeline([Stage(starts[s], starts[s] + sizes[s], list(st.ranks))
                           for s, st in enumerate(p.stages)], list(p.micro_batches))
                 for p in plan.pipelines]
    new = dataclasses.replace(plan, pipelines=pipelines)
    new.validate()
    return new


def predicted(strategy: str, new: ExecutionPlan, plan: ExecutionPlan, lost: set[int],
              profile: Profile, eager: bool = False) -> Candidate:
    """A forced strategy's plan `new` over the survivors of `plan` without `lost`, predicted
    (its transition cost is what the recovery measures; none is estimated here)."""
    after = profile.for_survivors(set(plan.ranks) - set(plan.survivors(lost)))
    c = _candidate(strategy, new, after, 0.0)
    if eager:
        _add_upkeep(c, after)
    return c
