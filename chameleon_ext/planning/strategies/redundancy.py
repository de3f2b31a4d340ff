"""Eager redundancy (`--chameleon-redundancy eager`, Bamboo-style): every stage's parameters and
optimizer state are also held, as a shadow copy, by an adjacent stage of the same pipeline, so a
takeover of a lost stage by that neighbour moves no state.

Stages pair up (0 with 1, 2 with 3, ...) and hold each other; in a pipeline of odd depth the last
stage is held by the one before it. Only plans whose every stage has its ranks keep shadows (a
rerouted stage has no owner to mirror). The owner refreshes its holder's copy with its updated
parameters and Adam moments once per iteration, before the next iteration's first op, so a copy
is always the state at the start of the iteration a failure interrupts.
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import MIB, Profile, predict_plan, stage_params

SHADOW_BYTES_PER_PARAM = 12     # fp32 parameter and two Adam moments: no gradient is mirrored


def holder_stage(depth: int, stage: int) -> int | None:
    """The stage of a `depth`-stage pipeline that holds `stage`'s shadow (None: depth 1)."""
    if depth < 2:
        return None
    pair = stage ^ 1
    return pair if pair < depth else stage - 1


def shadow_pairs(plan: ExecutionPlan) -> list[tuple[int, int]]:
    """(owner rank, holder rank) of every shadow copy of `plan`, tensor-parallel shard by shard."""
    if plan.rerouted:
        return []
    pairs = []
    for p in plan.pipelines:
        depth = len(p.stages)
        for s, st in enumerate(p.stages):
            h = holder_stage(depth, s)
            if h is not None:
                pairs += list(zip(st.ranks, p.stages[h].ranks))
    return pairs


@dataclass
class EagerCost:
    sync_ms: float          # what the refreshes add to an iteration of the plan
    memory_bytes: int       # the largest extra memory of a rank (the shadows it holds)
    refresh_ms: float = 0.0  # the slowest rank's refresh


def held_bytes(plan: ExecutionPlan, shape) -> dict[int, int]:
    """Per rank: the bytes of the shadow copies it holds (ranks holding none left out)."""
    held: dict[int, int] = {}
    for owner, holder in shadow_pairs(plan):
        held[holder] = held.get(holder, 0) + stage_params(plan, owner, shape) * \
            SHADOW_BYTES_PER_PARAM
    return held


def refresh_ms(plan: ExecutionPlan, profile: Profile) -> dict[int, float]:
    """Per rank of `plan` that keeps shadows: its refresh over the profile's point-to-point
    link (it sends its state to its holder and receives the states it holds, one message
    each), before the calibrated shadow_sync_factor."""
    shape = profile.shape
    sent: dict[int, int] = {}
    messages: dict[int, int] = {}
    for owner, holder in shadow_pairs(plan):
        sent[owner] = sent.get(owner, 0) + stage_params(plan, owner, shape) * \
            SHADOW_BYTES_PER_PARAM
        for r in (owner, holder):
            messages[r] = messages.get(r, 0) + 1
    held = held_bytes(plan, shape)
    return {r: messages[r] * profile.p2p_alpha_ms + profile.p2p_ms_per_mib *
            (sent.get(r, 0) + held.get(r, 0)) / MIB for r in messages}


def eager_cost(plan: ExecutionPlan, profile: Profile) -> EagerCost:
    """What keeping the shadows of `plan` costs per iteration and per rank. Each rank refreshes
    before its first op (refresh_ms, scaled by the calibrated shadow_sync_factor) and starts
    its schedule then, as the executor runs it: the iteration is simulated with those starts,
    so a rank that refreshes less (none, in a pipeline of one stage) starts at once and the
    first waits of a pipeline absorb part of its neighbours' refresh; `sync_ms` is what that
    adds to the plan's iteration."""
    refresh = {r: ms * profile.shadow_sync_factor for r, ms in refresh_ms(plan, profile).items()}
    if not refresh:
        return EagerCost(0.0, 0)
    added = predict_plan(plan, profile, start=refresh).iteration_ms - \
        predict_plan(plan, profile).iteration_ms
    return EagerCost(added, max(held_bytes(plan, profile.shape).values(), default=0),
                     max(refresh.values()))
