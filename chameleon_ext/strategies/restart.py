"""Checkpoint restart (Megatron's default): a fresh homogeneous plan over the survivors, onto
which the latest checkpoint is loaded. The global batch is unchanged, so the iterations after the
checkpoint consume the same samples under the same micro-batch ids as before."""

from __future__ import annotations

from chameleon_ext.plan import ExecutionPlan, Pipeline, Stage


def restart_plan(plan: ExecutionPlan, survivors: int) -> ExecutionPlan | None:
    """The homogeneous plan that uses the most of `survivors` ranks (ties: the pipeline depth
    closest to the old one, then the deeper); None when not even one pipeline fits. (The
    planner's `replan` chooses by predicted speed instead.)"""
    tp, layers, mbs = plan.tensor_parallel, plan.num_layers, plan.num_micro_batches
    old_depth = len(plan.pipelines[0].stages)
    best: tuple[tuple[int, int, int], int, int] | None = None
    for depth in range(1, layers + 1):
        for dp in range(1, survivors // (tp * depth) + 1):
            if mbs % dp:
                continue
            key = (depth * dp, -abs(depth - old_depth), depth)
            if best is None or key > best[0]:
                best = (key, depth, dp)
    if best is None:
        return None
    return homogeneous(plan, best[1], best[2])


def homogeneous(plan: ExecutionPlan, depth: int, dp: int) -> ExecutionPlan:
    """`dp` pipelines of `depth` stages for `plan`'s model and batch, ranks numbered Megatron's
    way (tensor parallel fastest, then data, then pipeline), generation advanced. Layers are
    split as evenly as the depth allows, the extra layers going to the stages after the first
    (the first and last stages also hold the embedding and the output layer)."""
    tp, layers, mbs = plan.tensor_parallel, plan.num_layers, plan.num_micro_batches
    base, extra = divmod(layers, depth)
    sizes = [base + (1 if 1 <= s <= extra else 0) for s in range(depth)]
    starts = [sum(sizes[:s]) for s in range(depth)]
    per_pipeline = mbs // dp
    pipelines = [
        Pipeline([Stage(starts[s], starts[s] + sizes[s],
                        [t + tp * (d + dp * s) for t in range(tp)]) for s in range(depth)],
                 list(range(d * per_pipeline, (d + 1) * per_pipeline)))
        for d in range(dp)]
    new = ExecutionPlan(layers, tp, plan.micro_batch_size, mbs, pipelines,
                        generation=plan.generation + 1)
    new.validate()
    return new
