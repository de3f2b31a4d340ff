"""Checkpoint restart (Megatron's default): a fresh homogeneous plan over the survivors, onto
which the latest checkpoint is loaded. The global batch is unchanged, so the iterations after the
checkpoint consume the same samples under the same micro-batch ids as before.

The unit is a tensor-parallel group: the plan is made of the surviving groups, whole (each stage
one of them, by lowest rank), so a group stays on the ranks that were one (in a cluster: on one
node's links); a group that lost any rank leaves with its healthy ranks, which are not pooled
into new groups. The tensor-parallel degree stays the plan's (no re-sharding of the checkpoint).
"""

from __future__ import annotations

from chameleon_ext.plan import ExecutionPlan, Pipeline, PlanError, Stage


def restart_plan(plan: ExecutionPlan, lost: set[int] | list[int]) -> ExecutionPlan | None:
    """The homogeneous plan that uses the most of plan.survivors(lost) (ties: the pipeline
    depth closest to the old one, then the deeper); None when not even one pipeline fits.
    (The planner's `replan` chooses by predicted speed instead.)"""
    layers, mbs = plan.num_layers, plan.num_micro_batches
    groups = len(plan.surviving_groups(lost))
    old_depth = len(plan.pipelines[0].stages)
    best: tuple[tuple[int, int, int], int, int] | None = None
    for depth in range(1, layers + 1):
        for dp in range(1, groups // depth + 1):
            if mbs % dp:
                continue
            key = (depth * dp, -abs(depth - old_depth), depth)
            if best is None or key > best[0]:
                best = (key, depth, dp)
    if best is None:
        return None
    return homogeneous(plan, best[1], best[2], lost)


def homogeneous(plan: ExecutionPlan, depth: int, dp: int,
                lost: set[int] | list[int] = frozenset()) -> ExecutionPlan:
    """`dp` pipelines of `depth` stages for `plan`'s model and batch over the first depth x dp
    of plan.surviving_groups(lost), placed Megatron's way (data parallel inner, then pipeline),
    their ranks renumbered densely in their old order (plan.survivors(lost, size)), generation
    advanced: Megatron's numbering (tensor parallel fastest) when each group is consecutive
    ranks. Layers are split as evenly as the depth allows, the extra layers going to the
    stages after the first (the first and last stages also hold the embedding and the output
    layer)."""
    tp, layers, mbs = plan.tensor_parallel, plan.num_layers, plan.num_micro_batches
    groups = plan.surviving_groups(lost)[:depth * dp]
    if len(groups) < depth * dp:
        raise PlanError(f"{depth} x {dp} stages need {depth * dp} tensor-parallel groups of "
                        f"{tp}; {len(groups)} survive")
    number = {r: i for i, r in enumerate(sorted(r for g in groups for r in g))}
    base, extra = divmod(layers, depth)
    sizes = [base + (1 if 1 <= s <= extra else 0) for s in range(depth)]
    starts = [sum(sizes[:s]) for s in range(depth)]
    per_pipeline = mbs // dp
    pipelines = [
        Pipeline([Stage(starts[s], starts[s] + sizes[s], [number[r] for r in groups[d + dp * s]])
                  for s in range(depth)],
                 list(range(d * per_pipeline, (d + 1) * per_pipeline)))
        for d in range(dp)]
    new = ExecutionPlan(layers, tp, plan.micro_batch_size, mbs, pipelines,
                        generation=plan.generation + 1)
    new.validate()
    return new
