"""What every recovery strategy shares: the protocol, the context it plans in, and the helpers
of more than one strategy (layer balancing, the state a new plan moves).

A strategy turns a plan and its lost ranks into a plan over the survivors (`propose`). The
planner predicts every strategy's proposal under `auto`; a forced --chameleon-strategy takes
its strategy's proposal; both find it in `chameleon_ext.planning.strategies.REGISTRY`. With a calibrated
profile a strategy may search (reparallelize's mixes of depths, restart's layouts) and return
the prediction it made on the way; without one (a failure before any calibration) it uses its
rules of thumb (layers as the cost).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Protocol

from chameleon_ext.plan.execution_plan import ExecutionPlan, Pipeline, Stage
from chameleon_ext.plan.sharding import instances_for, lost_shards, replica_groups
from chameleon_ext.planning.perf_model import (Prediction, Profile, sharded_bytes_per_param,
                                               stage_params)
from chameleon_ext.planning.strategies.redundancy import shadow_pairs


@dataclass(frozen=True)
class Objective:
    """Under auto, what a strategy that searches layouts (reparallelize, restart) minimises
    among them: `cost(plan, iteration_ms)`, the planner's charge for running the plan over the
    window (planner.running_ms: N iterations, and the expected cost of the next failure, a
    restart's where a group's loss leaves a layer no other group holds). The fastest layout is
    often a single pipeline, which every next loss forces to restart, where a slightly slower
    replicated one absorbs it in place. The cost is at least `iterations` (N) x the iteration
    time, so a search in the order of a lower bound on that time can stop early."""

    iterations: float
    cost: Callable[[ExecutionPlan, float], float]


def score(objective: Objective | None, plan: ExecutionPlan, iteration_ms: float) -> float:
    """What a search over layouts minimises for `plan` predicted at `iteration_ms`: the
    objective's cost, or without one the iteration time (the fastest layout)."""
    return iteration_ms if objective is None else objective.cost(plan, iteration_ms)


@dataclass(frozen=True)
class Context:
    """`profile`: calibrated for the plan as it runs (at its tensor-parallel degree; its slow
    ranks are the plan's), or None before any calibration; `eager`: stages hold eager
    redundancy's shadow copies; `spares`: the ranks out of the plan that wait to take a place
    (strategies.substitute); `objective`: what a search over layouts minimises (None: the
    iteration time, the fastest layout, as a forced strategy takes it)."""

    profile: Profile | None = None
    eager: bool = False
    spares: int = 0
    objective: Objective | None = None

    def score(self, plan: ExecutionPlan, iteration_ms: float) -> float:
        return score(self.objective, plan, iteration_ms)

    def after(self, plan: ExecutionPlan, lost: set[int]) -> Profile | None:
        """The profile for a plan over the survivors (slow ranks renumbered as they are)."""
        if self.profile is None:
            return None
        return self.profile.for_survivors(set(plan.ranks) - set(plan.survivors(lost)))

    def keeps_state(self, plan: ExecutionPlan, gone: set[int]) -> bool:
        """Whether the ranks of `plan` outside `gone` (lost, or left idle: a spare drops its
        state) hold every layer's state and, under the distributed optimizer
        (profile.optimizer_instances), a copy of every shard."""
        if not state_survives(plan, gone, self.eager):
            return False
        p = self.profile
        return p is None or not p.optimizer_instances or \
            not lost_shards(plan, gone, p.optimizer_instances, p.buddy_copies)

    def stage_cost(self):
        """(layers, first, last) -> the stage's forward + backward ms; layers as the cost
        without a profile."""
        if self.profile is None:
            return lambda n, first, last: float(n)
        return lambda n, first, last: stage_cost_ms(self.profile, n, first, last)


@dataclass
class Proposal:
    """A strategy's plan over the survivors, with its prediction when the strategy's search
    made one already (under the profile for the survivors)."""

    plan: ExecutionPlan
    prediction: Prediction | None = None


class Strategy(Protocol):
    name: str
    restarts: bool     # its world loads the latest checkpoint; else the ranks carry their state

    def propose(self, plan: ExecutionPlan, lost: set[int], ctx: Context) -> Proposal | None:
        """The plan over plan.survivors(lost), ranks numbered densely in their old order and
        the generation advanced; None where the strategy cannot absorb the loss."""

    def moved_bytes(self, plan: ExecutionPlan, new: ExecutionPlan, lost: set[int],
                    ctx: Context) -> int:
        """The state that moves between ranks to enter `new`: the bytes of the rank that
        receives the most (each rank receives over its own link, beside the others: the
        move's critical path; a holder sending to several is not modelled as slower)."""


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


def moved_bytes(plan: ExecutionPlan, new: ExecutionPlan, lost: set[int],
                profile: Profile, eager: bool = False) -> int:
    """Parameters and Adam moments (12 bytes a parameter) of the layers a survivor holds
    under `new` but did not under `plan` (plan.survivors(lost) numbered densely in their old
    order), its tensor-parallel shard of them, for the survivor that lacks the most (the ranks
    receive beside each other: Strategy.moved_bytes); `eager`: a rank also held the stages it
    kept shadow copies of."""
    survivors = plan.survivors(lost, new.world_size)
    shape = profile.shape
    shadowed: dict[int, list[int]] = {}
    for owner, holder in shadow_pairs(plan) if eager else ():
        shadowed.setdefault(holder, []).append(owner)
    largest = 0
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
                extra += shape.output_params(first)
            largest = max(largest, 12 * extra // plan.tensor_parallel)
    return largest


def repartition_bytes(plan: ExecutionPlan, new: ExecutionPlan, lost: set[int],
                      profile: Profile) -> int:
    """Under the distributed optimizer (profile.optimizer_instances): the sharded state
    (perf_model.sharded_bytes_per_param) a survivor that keeps its layers receives for the
    part of its new shard its old shard did not cover, when its replica group or its place in
    it changed (a layer new to a rank is moved_bytes' to count), for the survivor that
    receives the most (Strategy.moved_bytes)."""
    if not profile.optimizer_instances:
        return 0

    def spans(p: ExecutionPlan) -> dict[int, tuple[float, float]]:
        """rank -> the part of its stage's flattened state its shard covers."""
        k = instances_for(p, profile.optimizer_instances)
        out = {}
        for dp in replica_groups(p):
            size = len(dp) // k
            out.update((r, (i % size / size, (i % size + 1) / size)) for i, r in enumerate(dp))
        return out

    was, now = spans(plan), spans(new)
    survivors = plan.survivors(lost, new.world_size)
    largest = 0.0
    for r in new.ranks:
        old = survivors[r]
        if (plan.stage_of(old).layer_start, plan.stage_of(old).layer_end) != \
                (new.stage_of(r).layer_start, new.stage_of(r).layer_end):
            continue
        (a, b), (c, d) = was[old], now[r]
        fresh = (d - c) - max(0.0, min(b, d) - max(a, c))
        largest = max(largest, fresh * stage_params(new, r, profile.shape)
                      * sharded_bytes_per_param(profile))
    return round(largest)


def state_survives(plan: ExecutionPlan, lost: set[int], eager: bool) -> bool:
    """Whether the ranks of `plan` not in `lost` still hold every layer's state (each
    tensor-parallel shard of it): on their own stages, or as eager redundancy's shadow copies."""
    held: set[tuple[int, int]] = set()

    def hold(rank: int) -> None:
        st, t = plan.stage_of(rank), plan.position(rank).tp_rank
        held.update((layer, t) for layer in range(st.layer_start, st.layer_end))

    for r in plan.ranks:
        if r not in lost:
            hold(r)
    if eager:
        for owner, holder in shadow_pairs(plan):
            if holder not in lost:
                hold(owner)
    return all((layer, t) in held for layer in range(plan.num_layers)
               for t in range(plan.tensor_parallel))
