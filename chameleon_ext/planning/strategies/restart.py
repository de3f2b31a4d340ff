"""Checkpoint restart (Megatron's default): a fresh homogeneous plan over the survivors, onto
which the latest checkpoint is loaded. The global batch is unchanged, so the iterations after the
checkpoint consume the same samples under the same micro-batch ids as before.

The unit is a tensor-parallel group: the plan is made of the surviving groups, whole (each stage
one of them, by lowest rank), so a group stays on the ranks that were one (in a cluster: on one
node's links); a group that lost any rank leaves with its healthy ranks, which are not pooled
into new groups. The tensor-parallel degree stays the plan's (no re-sharding of the checkpoint).
"""

from __future__ import annotations

from chameleon_ext.plan.execution_plan import ExecutionPlan, Pipeline, PlanError, Stage
from chameleon_ext.planning.perf_model import (MIB, Prediction, Profile, allreduce_ms, predict_plan,
                                      stage_param_count)
from chameleon_ext.planning.strategies.base import (Context, Objective, Proposal,
                                                    balanced_layers_by_depth, score,
                                                    with_layers)


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


def replanned(plan: ExecutionPlan, lost: set[int], profile: Profile,
              objective: Objective | None = None) -> tuple[ExecutionPlan, Prediction] | None:
    """The fastest predicted homogeneous plan over at most plan.survivors(lost) (whole
    tensor-parallel groups, homogeneous) that fits in memory, and its prediction: every
    pipeline depth and data-parallel width that divides the micro-batches, each with its layers
    balanced (base.balanced_layers); ties go to restart_plan's order (more ranks, then the
    depth closest to the old one). With an `objective`, the one it rates cheapest instead of
    the fastest. None when not even one pipeline fits."""
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
        floor = bound if objective is None else objective.iterations * bound
        # the slack keeps a layout whose bound rounds above an equal prediction (a tie)
        if best is not None and floor > best[0] * (1 + 1e-9):
            break
        new = with_layers(homogeneous(plan, depth, dp, lost), sizes)
        pred = predict_plan(new, profile)
        if device and pred.peak_memory_bytes > device:
            continue
        key = (score(objective, new, pred.iteration_ms),
               (-depth * dp, abs(depth - old_depth), -depth))
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


class Restart:
    """With a profile, the fastest predicted homogeneous plan over the survivors (replan; with
    the context's objective, the one it rates cheapest); without one, the one that uses the
    most of them (restart_plan)."""

    name, restarts = "restart", True

    def propose(self, plan: ExecutionPlan, lost: set[int], ctx: Context) -> Proposal | None:
        if ctx.profile is None:
            new = restart_plan(plan, lost)
            return None if new is None else Proposal(new)
        found = replanned(plan, lost, ctx.after(plan, lost), ctx.objective)
        return None if found is None else Proposal(*found)

    def moved_bytes(self, plan: ExecutionPlan, new: ExecutionPlan, lost: set[int],
                    ctx: Context) -> int:
        return 0   # the state comes from the checkpoint
