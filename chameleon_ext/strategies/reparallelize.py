"""Dynamic re-parallelization (Oobleck-style): a new plan over every survivor, made of pipelines of
different depths, each with its layers balanced by the planner's dynamic program and a share of
the global batch in proportion to its speed, so that every iteration still consumes the same
global micro-batches. Survivors keep their places where they can: a pipeline that lost nothing
and keeps its depth keeps its ranks and layers, so only the layers new to a rank move
(megatron.elastic.state_transfer)."""

from __future__ import annotations

import copy
import heapq
from typing import Callable

from chameleon_ext.plan import ExecutionPlan, Pipeline, Stage

# (layers, first, last) -> forward + backward ms of one micro-batch on such a stage
StageCost = Callable[[int, bool, bool], float]
# (layers, depth) -> layers per stage
Balance = Callable[[int, int], list[int]]


def pipeline_time(sizes: list[int], micro_batches: int, stage_cost: StageCost) -> float:
    """1F1B over `micro_batches`: every one through the slowest stage, plus the fill and drain
    of the others."""
    costs = [stage_cost(n, s == 0, s == len(sizes) - 1) for s, n in enumerate(sizes)]
    return (micro_batches - 1) * max(costs) + sum(costs) if micro_batches else 0.0


def split_micro_batches(layouts: list[list[int]], total: int,
                        stage_cost: StageCost) -> list[int]:
    """Micro-batches per pipeline minimising the slowest one's time, each getting at least
    one: the next micro-batch always goes to the pipeline that would finish it first."""
    shape = []  # pipeline_time(layout, m) = (m - 1) * slowest + sum
    for sizes in layouts:
        costs = [stage_cost(n, s == 0, s == len(sizes) - 1) for s, n in enumerate(sizes)]
        shape.append((max(costs), sum(costs)))
    counts = [1] * len(layouts)
    heap = [(slowest + total_ms, k) for k, (slowest, total_ms) in enumerate(shape)]
    heapq.heapify(heap)
    for _ in range(total - len(layouts)):
        _, k = heapq.heappop(heap)
        counts[k] += 1
        slowest, total_ms = shape[k]
        heapq.heappush(heap, (counts[k] * slowest + total_ms, k))
    return counts


def depth_mixes(survivors: int, max_depth: int) -> list[list[int]]:
    """Pipeline depths that use every survivor: d repeated, plus pipelines of d + 1 (Oobleck's
    templates of neighbouring depths), deepest first."""
    mixes = set()
    for d in range(1, max_depth + 1):
        for deeper in range(0, survivors // (d + 1) + 1 if d < max_depth else 1):
            rest = survivors - deeper * (d + 1)
            if rest >= 0 and rest % d == 0:
                mixes.add(tuple([d + 1] * deeper + [d] * (rest // d)))
    return [list(m) for m in sorted(mixes)]


def applies(plan: ExecutionPlan) -> bool:
    """Without tensor parallelism (a lost shard's siblings would have no place) and from a
    plan whose every stage has its ranks."""
    return plan.tensor_parallel == 1 and all(st.ranks for p in plan.pipelines
                                             for st in p.stages)


def ranked_mixes(plan: ExecutionPlan, survivors: int, stage_cost: StageCost,
                 balance: Balance) -> list[list[int]]:
    """depth_mixes() fastest first by pipeline_time (its slowest pipeline, given its share of
    the micro-batches; ties to fewer pipelines): the planner predicts the first few."""
    total = plan.num_micro_batches
    by_depth: dict[int, list[int]] = {}

    def slowest(m: list[int]) -> tuple[float, int]:
        for d in set(m) - set(by_depth):
            by_depth[d] = balance(plan.num_layers, d)
        layouts = [by_depth[d] for d in m]
        counts = split_micro_batches(layouts, total, stage_cost)
        return max(pipeline_time(lay, c, stage_cost) for lay, c in zip(layouts, counts)), len(m)
    return sorted((m for m in depth_mixes(survivors, plan.num_layers) if len(m) <= total),
                  key=slowest)


def reparallelize(plan: ExecutionPlan, failed: set[int] | list[int], stage_cost: StageCost,
                  balance: Balance, mix: list[int] | None = None) -> ExecutionPlan | None:
    """The plan over every survivor with pipeline depths `mix` (default: ranked_mixes' first),
    survivors numbered densely in their old order and the generation advanced. None with
    tensor parallelism (a lost shard's siblings have no place), rerouted stages, or fewer
    micro-batches than pipelines."""
    failed = set(failed)
    if not applies(plan):
        return None
    survivors = [r for r in plan.ranks if r not in failed]
    total = plan.num_micro_batches
    if mix is None:
        options = ranked_mixes(plan, len(survivors), stage_cost, balance)
        if not options:
            return None
        mix = options[0]
    if sum(mix) != len(survivors) or len(mix) > total:
        return None
    number = {old: i for i, old in enumerate(survivors)}
    # A pipeline that lost nothing keeps its ranks when its depth is still wanted.
    wanted = sorted(mix, reverse=True)
    groups: list[list[int]] = []
    pool: list[int] = []
    for p in plan.pipelines:
        ranks = [st.ranks[0] for st in p.stages]
        if not failed & set(ranks) and len(ranks) in wanted:
            wanted.remove(len(ranks))
            groups.append(ranks)
        else:
            pool += [r for r in ranks if r not in failed]
    for d in wanted:
        groups.append(pool[:d])
        pool = pool[d:]
    layouts = [balance(plan.num_layers, len(g)) for g in groups]
    counts = split_micro_batches(layouts, total, stage_cost)
    pipelines, mb = [], 0
    for ranks, sizes, count in zip(groups, layouts, counts):
        starts = [sum(sizes[:s]) for s in range(len(sizes))]
        pipelines.append(Pipeline([Stage(a, a + n, [number[r]]) for a, n, r in
                                   zip(starts, sizes, ranks)], list(range(mb, mb + count))))
        mb += count
    new = copy.deepcopy(plan)
    new.pipelines = pipelines
    new.generation = plan.generation + 1
    new._positions = {}
    new.validate()
    return new
