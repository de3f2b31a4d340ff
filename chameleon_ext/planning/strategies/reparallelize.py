"""Dynamic re-parallelization (Oobleck-style): a new plan over every survivor, made of pipelines of
different depths, each with its layers balanced by the planner's dynamic program and a share of
the global batch in proportion to its speed, so that every iteration still consumes the same
global micro-batches. Survivors keep their places where they can: a pipeline that lost nothing
and keeps its depth keeps its ranks and layers, so only the layers new to a rank move
(megatron.elastic.state_transfer).

The unit is a tensor-parallel group: the new pipelines are built of the surviving groups, whole
(each stage one of them, its ranks the shards they were), and a group that lost any rank leaves
the plan with its healthy ranks. The tensor-parallel degree stays the plan's: re-sharding a
replica to another degree is not among the candidates."""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Callable, Sequence

from chameleon_ext.plan.execution_plan import ExecutionPlan, Pipeline, Stage
from chameleon_ext.planning.perf_model import predict_plan
from chameleon_ext.planning.strategies.base import (Context, Proposal, balanced_layers_by_depth,
                                          moved_bytes)
from chameleon_ext.planning.strategies.restart import replanned

# (layers, first, last) -> forward + backward ms of one micro-batch on such a stage
StageCost = Callable[[int, bool, bool], float]
# (layers, depth) -> layers per stage
Balance = Callable[[int, int], list[int]]
PREDICTED_MIXES = 3  # mixes of pipeline depths predicted, of those estimated fastest


def pipeline_time(sizes: list[int], micro_batches: int, stage_cost: StageCost) -> float:
    """1F1B over `micro_batches`: every one through the slowest stage, plus the fill and drain
    of the others."""
    costs = [stage_cost(n, s == 0, s == len(sizes) - 1) for s, n in enumerate(sizes)]
    return (micro_batches - 1) * max(costs) + sum(costs) if micro_batches else 0.0


def split_micro_batches(layouts: list[list[int]], total: int,
                        stage_cost: StageCost) -> list[int]:
    """Micro-batches per pipeline minimising the slowest one's time, each getting at least
    one: the next micro-batch always goes to the pipeline that would finish it first (the
    lower index on a tie)."""
    shapes: dict[tuple[int, ...], tuple[float, float]] = {}
    kinds: dict[tuple[float, float], list[int]] = {}  # (slowest, sum) -> its pipelines
    for k, sizes in enumerate(layouts):
        key = tuple(sizes)
        if key not in shapes:
            shapes[key] = _shape(sizes, stage_cost)
        kinds.setdefault(shapes[key], []).append(k)
    grouped = [(slowest, sum_ms, ks) for (slowest, sum_ms), ks in kinds.items()]
    done, last = _fill(grouped, total - len(layouts))
    counts = [0] * len(layouts)
    for n, (_, _, ks) in enumerate(grouped):
        for k in ks:
            counts[k] = 1 + done[n]
    if last is not None:
        _, level, left = last
        for k, n in sorted((k, n) for n in level for k in grouped[n][2]):
            give = left if grouped[n][0] == 0 else 1  # a time that never grows takes all
            counts[k] += give
            left -= give
            if left == 0:
                break
    return counts


def _shape(sizes: list[int], stage_cost: StageCost) -> tuple[float, float]:
    """(slowest stage, sum of stages): pipeline_time(sizes, m) = (m - 1) x slowest + sum."""
    costs = [stage_cost(n, s == 0, s == len(sizes) - 1) for s, n in enumerate(sizes)]
    return max(costs), sum(costs)


Level = tuple[float, list[int], int]


def _fill(kinds: list[tuple[float, float, Sequence[int]]],
          left: int) -> tuple[list[int], Level | None]:
    """split_micro_batches' greedy over `kinds` of pipelines [(slowest, sum, the pipelines in
    index order)] that hold one micro-batch each, `left` more to give. Pipelines of one kind
    finish their j-th extra micro-batch together, at j x slowest + sum, so the greedy runs
    level by level (every pipeline whose next one finishes soonest), not micro-batch by
    micro-batch: O(levels x kinds) for thousands of pipelines. Returns per kind the levels all
    its pipelines went through, and the level not given whole, if any: (when its micro-batches
    finish, its kinds, the micro-batches left for it, which go one each to its pipelines in
    index order, all to the first one whose time never grows)."""
    done = [0] * len(kinds)
    heap = [(slowest + sum_ms, n) for n, (slowest, sum_ms, _) in enumerate(kinds)]
    heapq.heapify(heap)
    while left > 0:
        key, n = heapq.heappop(heap)
        level = [n]
        while heap and heap[0][0] == key:
            level.append(heapq.heappop(heap)[1])
        size = sum(len(kinds[n][2]) for n in level)
        if size > left or any(kinds[n][0] == 0 for n in level):
            return done, (key, level, left)
        for n in level:
            done[n] += 1
            slowest, sum_ms, _ = kinds[n]
            heapq.heappush(heap, ((done[n] + 1) * slowest + sum_ms, n))
        left -= size
    return done, None


def depth_mixes(groups: int, max_depth: int) -> list[list[int]]:
    """Pipeline depths (in stages, one tensor-parallel group each) that use every one of
    `groups`: d repeated, plus pipelines of d + 1 (Oobleck's templates of neighbouring
    depths), deepest first."""
    mixes = set()
    for d in range(1, max_depth + 1):
        for deeper in range(0, groups // (d + 1) + 1 if d < max_depth else 1):
            rest = groups - deeper * (d + 1)
            if rest >= 0 and rest % d == 0:
                mixes.add(tuple([d + 1] * deeper + [d] * (rest // d)))
    return [list(m) for m in sorted(mixes)]


def ranked_mixes(plan: ExecutionPlan, groups: int, stage_cost: StageCost,
                 balance: Balance) -> list[list[int]]:
    """depth_mixes() fastest first by pipeline_time (its slowest pipeline, given its share of
    the micro-batches; ties to fewer pipelines): the planner predicts the first few."""
    total = plan.num_micro_batches
    by_depth: dict[int, list[int]] = {}
    shape: dict[int, tuple[float, float]] = {}

    def slowest(m: list[int]) -> tuple[float, int]:
        # depth_mixes' pipelines of one depth are consecutive: each depth is a kind of _fill
        depths = sorted(set(m), key=m.index)
        for d in set(depths) - set(by_depth):
            by_depth[d] = balance(plan.num_layers, d)
            shape[d] = _shape(by_depth[d], stage_cost)
        kinds = [(*shape[d], range(m.index(d), m.index(d) + m.count(d))) for d in depths]
        done, last = _fill(kinds, total - len(m))
        # pipeline_time of each kind's count, and of the last level's pipelines (its finish)
        times = [n * slowest + sum_ms for n, (slowest, sum_ms, _) in zip(done, kinds)]
        return max(times + ([last[0]] if last else [])), len(m)
    return sorted((m for m in depth_mixes(groups, plan.num_layers) if len(m) <= total),
                  key=slowest)


def reparallelize(plan: ExecutionPlan, failed: set[int] | list[int], stage_cost: StageCost,
                  balance: Balance, mix: list[int] | None = None) -> ExecutionPlan | None:
    """The plan over plan.survivors(failed) with pipeline depths `mix` (default: ranked_mixes'
    first) of whole tensor-parallel groups, renumbered densely in their old order and the
    generation advanced. None with fewer micro-batches than pipelines. From a rerouted plan
    the pipelines with a stage that has no ranks are broken like those with a lost rank: their
    surviving groups join the pool (a reroute, then a loss its replicas cannot absorb as fast
    as a new layout: the re-parallelization Oobleck would have made at the first loss)."""
    failed = set(failed)
    alive = [g for g in plan.tp_groups() if not failed.intersection(g)]
    total = plan.num_micro_batches
    if mix is None:
        options = ranked_mixes(plan, len(alive), stage_cost, balance)
        if not options:
            return None
        mix = options[0]
    if sum(mix) != len(alive) or len(mix) > total:
        return None
    # A pipeline that lost nothing keeps its groups when its depth is still wanted.
    wanted = sorted(mix, reverse=True)
    chains: list[list[list[int]]] = []
    pool: list[list[int]] = []
    for p in plan.pipelines:
        groups = [st.ranks for st in p.stages]
        if all(g and not failed.intersection(g) for g in groups) and len(groups) in wanted:
            wanted.remove(len(groups))
            chains.append(groups)
        else:
            pool += [g for g in groups if g and not failed.intersection(g)]
    for d in wanted:
        chains.append(pool[:d])
        pool = pool[d:]
    layouts = [balance(plan.num_layers, len(c)) for c in chains]
    counts = split_micro_batches(layouts, total, stage_cost)
    pipelines, mb = [], 0
    for chain, sizes, count in zip(chains, layouts, counts):
        starts = [sum(sizes[:s]) for s in range(len(sizes))]
        pipelines.append(Pipeline([Stage(a, a + n, list(g)) for a, n, g in
                                   zip(starts, sizes, chain)], list(range(mb, mb + count))))
        mb += count
    return dataclasses.replace(plan, pipelines=pipelines).renumbered()


class Reparallelize:
    """With a profile, the fastest predicted of the plans built from the PREDICTED_MIXES mixes
    of depths estimated fastest, layers balanced by the profile's stage costs, and of the
    homogeneous plans over subsets of the survivors (restart's search, the state carried over
    instead of loaded): Oobleck instantiates pipeline templates on any subset and leaves the
    other GPUs idle, so a re-parallelization is never predicted slower than the restart
    re-plan. With the context's objective, the plan of those it rates cheapest. Without a
    profile, the first mix with the layers as the cost, split evenly."""

    name, restarts = "reparallelize", False

    def propose(self, plan: ExecutionPlan, lost: set[int], ctx: Context) -> Proposal | None:
        if ctx.profile is None:
            new = reparallelize(plan, lost, ctx.stage_cost(),
                                lambda layers, d: [layers // d + (i < layers % d)
                                                   for i in range(d)])
            return None if new is None else Proposal(new)
        cost = ctx.stage_cost()
        table = balanced_layers_by_depth(plan.num_layers, plan.num_layers, ctx.profile)

        def balance(layers: int, depth: int) -> list[int]:
            return table[depth - 1]

        after = ctx.after(plan, lost)
        best, least = None, math.inf
        groups = len(plan.surviving_groups(lost))
        for mix in ranked_mixes(plan, groups, cost, balance)[:PREDICTED_MIXES]:
            new = reparallelize(plan, lost, cost, balance, mix)
            if new is None:
                continue
            pred = predict_plan(new, after)
            score = ctx.score(new, pred.iteration_ms)
            if score < least:
                best, least = Proposal(new, pred), score
        subset = replanned(plan, lost, after, ctx.objective)
        # The survivors it leaves idle go with their state: the ones it uses must hold it all.
        if subset is not None and ctx.keeps_state(
                plan, set(plan.ranks) - set(plan.survivors(lost, subset[0].world_size))) and \
                ctx.score(subset[0], subset[1].iteration_ms) < least:
            best = Proposal(*subset)
        return best

    def moved_bytes(self, plan: ExecutionPlan, new: ExecutionPlan, lost: set[int],
                    ctx: Context) -> int:
        return moved_bytes(plan, new, lost, ctx.profile)
