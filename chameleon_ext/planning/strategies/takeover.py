"""Stage takeover (Bamboo-style): a neighbour stage of the failed pipeline absorbs the lost stage's
layers, so that pipeline runs one stage fewer on the micro-batches it always ran; the layers'
weights and optimizer state come from a data-parallel replica (megatron.elastic.state_transfer).

The unit is a tensor-parallel group: a stage that loses any of its ranks is lost whole, its
healthy ranks leave the plan with it, and the neighbouring group takes over the lost layers shard
by shard (each of its ranks the same tensor-parallel shard of them)."""

from __future__ import annotations

import dataclasses

from chameleon_ext.plan.execution_plan import ExecutionPlan, Pipeline, Stage
from chameleon_ext.planning.strategies.base import Context, Proposal, moved_bytes
from chameleon_ext.planning.strategies.redundancy import holder_stage


def takeover(plan: ExecutionPlan, failed: set[int] | list[int],
             stage_cost=None, eager: bool = False) -> ExecutionPlan | None:
    """The plan over plan.survivors(failed) in which, in every pipeline that lost stages, each
    lost stage's layers join a surviving neighbour in the same pipeline, ranks renumbered
    densely in their old order and the generation advanced. `stage_cost(layers, first, last)`
    picks the neighbour that ends up cheaper (default: the one with fewer layers; ties to the
    earlier).
    None when a pipeline lost every stage (nothing in it survives to take over) or when the
    plan has rerouted stages (takeover starts from a plan where every stage has its ranks).
    `eager`: a lost stage whose shadow holder (redundancy.holder_stage) survives goes to it,
    which already has its state."""
    failed = set(failed)
    if any(not st.ranks for p in plan.pipelines for st in p.stages):
        return None
    pipelines = [Pipeline([Stage(st.layer_start, st.layer_end, list(st.ranks))
                           for st in p.stages], list(p.micro_batches)) for p in plan.pipelines]
    for p in pipelines:
        alive = [st for st in p.stages if not failed & set(st.ranks)]
        if not alive:
            return None
        if len(alive) == len(p.stages):
            continue
        stages: list[Stage] = list(p.stages)

        def is_lost(st: Stage) -> bool:
            return bool(failed & set(st.ranks))

        def merged_cost(host: Stage, lost: Stage) -> float:
            start = min(host.layer_start, lost.layer_start)
            end = max(host.layer_end, lost.layer_end)
            if stage_cost is None:
                return end - start
            return stage_cost(end - start, start == 0, end == plan.num_layers)

        if eager:
            held = {i: holder_stage(len(stages), i) for i, st in enumerate(stages)
                    if is_lost(st)}
            held = {i: h for i, h in held.items() if h is not None and not is_lost(stages[h])}
            for i, h in held.items():
                stages[h].layer_start = min(stages[h].layer_start, stages[i].layer_start)
                stages[h].layer_end = max(stages[h].layer_end, stages[i].layer_end)
            stages = [st for i, st in enumerate(stages) if i not in held]
        # Repeatedly fold a lost stage into a surviving neighbour (one always exists while a
        # lost stage is left, since some stage of the pipeline survives).
        while any(is_lost(st) for st in stages):
            moves = [(merged_cost(stages[j], stages[i]), j, i) for i, st in enumerate(stages)
                     if is_lost(st) for j in (i - 1, i + 1)
                     if 0 <= j < len(stages) and not is_lost(stages[j])]
            _, j, i = min(moves)
            host, lost = stages[j], stages[i]
            host.layer_start = min(host.layer_start, lost.layer_start)
            host.layer_end = max(host.layer_end, lost.layer_end)
            del stages[i]
        p.stages = stages
    return dataclasses.replace(plan, pipelines=pipelines).renumbered()


class Takeover:
    name, restarts = "takeover", False

    def propose(self, plan: ExecutionPlan, lost: set[int], ctx: Context) -> Proposal | None:
        new = takeover(plan, lost, ctx.stage_cost() if ctx.profile else None, ctx.eager)
        return None if new is None else Proposal(new)

    def moved_bytes(self, plan: ExecutionPlan, new: ExecutionPlan, lost: set[int],
                    ctx: Context) -> int:
        return moved_bytes(plan, new, lost, ctx.profile, ctx.eager)
