"""Substitute: spares (healthy ranks an earlier plan left out, or joiners with no place) take the
lost places, so the plan's layout is kept as it was; the lost layers' parameters and Adam moments
come from their surviving replicas, as they do for a joiner (megatron.elastic.state_transfer).

The unit is a tensor-parallel group: every group with a lost rank is filled whole (its healthy
ranks leave the plan with it and become spares in turn), so the spares must number at least the
ranks of those groups. Nothing is rebalanced and no survivor moves: the price is the rebuild and
the state of the filled places, the iteration time stays the plan's.
"""

from __future__ import annotations

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import stage_params
from chameleon_ext.planning.strategies.base import Context, Proposal, state_survives

STATE_BYTES_PER_PARAM = 12     # what a filled place receives: the parameter and two Adam moments


def substitute(plan: ExecutionPlan, lost: set[int] | list[int], spares: int,
               eager: bool = False) -> ExecutionPlan | None:
    """`plan` with the ranks of every group that lost one renamed: the survivors numbered
    densely in their old order (plan.survivors(lost)), then the filled places, group by group
    (by lowest old rank), each group in its tensor-parallel order; the generation advanced.
    None when fewer than that many `spares` wait, nothing was lost, or some lost layer has no
    surviving holder (only a checkpoint has it)."""
    lost = set(lost)
    kept = plan.survivors(lost)
    filled = [r for g in plan.tp_groups() if lost.intersection(g) for r in g]
    if not filled or len(filled) > spares or not state_survives(plan, lost, eager):
        return None
    mapping = {r: i for i, r in enumerate(kept)}
    mapping.update((r, len(kept) + i) for i, r in enumerate(filled))
    return plan.relabelled(mapping, plan.generation + 1)


class Substitute:
    """Offered where enough spares wait (`Context.spares`); its new ranks past the survivors'
    are the spares', in the order the decider lists them."""

    name, restarts = "substitute", False

    def propose(self, plan: ExecutionPlan, lost: set[int], ctx: Context) -> Proposal | None:
        new = substitute(plan, lost, ctx.spares, ctx.eager)
        return None if new is None else Proposal(new)

    def moved_bytes(self, plan: ExecutionPlan, new: ExecutionPlan, lost: set[int],
                    ctx: Context) -> int:
        """The whole state of the largest filled place (its tensor-parallel shard): the
        spares receive beside each other."""
        kept = len(plan.survivors(lost))
        return max((STATE_BYTES_PER_PARAM * stage_params(new, r, ctx.profile.shape)
                    for r in new.ranks if r >= kept), default=0)
