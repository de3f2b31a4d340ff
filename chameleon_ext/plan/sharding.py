"""Where the distributed optimizer's shards live in a plan (--use-distributed-optimizer).

megatron-core's DistributedOptimizer shards a stage's optimizer state over the stage's replica
group. With N instances (--num-distributed-optimizer-instances) the replica group is cut as
megatron-core's initialize_model_parallel cuts it: N consecutive chunks, each sharding the state
once, so the shard at place i of a chunk is held by the rank at place i of every chunk. A shard
whose every holder is lost is gone: only a checkpoint has it. With buddy copies
(--chameleon-shard-redundancy buddy) the previous rank of the same chunk, in a ring, holds a copy
too (the message that keeps it then runs against the ring reduction's direction).

A plan keeps the instances it was asked for only where they divide every replica group (a
recovery that leaves a stage 3 replicas of 4 cannot cut it in 2); else the most that do, down to
1. A misaligned plan (pipelines that split the layers differently) reduces gradients outside
megatron-core's replica groups: each rank is its own group and holds its state whole.
"""

from __future__ import annotations

from math import gcd

from chameleon_ext.plan.execution_plan import ExecutionPlan


def replica_groups(plan: ExecutionPlan) -> list[list[int]]:
    """Each distinct replica group of `plan` (one per stage and tensor-parallel shard), as
    megatron-core's distributed optimizer shards over it."""
    if plan.misaligned_stages() is not None:
        return [[r] for r in plan.ranks]
    seen: dict[tuple[int, ...], list[int]] = {}
    for r in plan.ranks:
        dp = sorted(plan.replicas(r))   # torch numbers a group's ranks in ascending order
        seen.setdefault(tuple(dp), dp)
    return list(seen.values())


def instances_for(plan: ExecutionPlan, instances: int) -> int:
    """The distributed-optimizer instances `plan` runs with when `instances` are asked for:
    the most, up to that, that divide every replica group."""
    width = 0
    for group in replica_groups(plan):
        width = gcd(width, len(group))
    return max(k for k in range(1, instances + 1) if width % k == 0)


def optimizer_shards(plan: ExecutionPlan, instances: int) -> dict[int, int]:
    """rank -> over how many ranks its optimizer state is sharded, with `instances` asked for
    (0: the optimizer's state is not sharded: 1 for every rank)."""
    if not instances:
        return {r: 1 for r in plan.ranks}
    k = instances_for(plan, instances)
    return {r: len(dp) // k for dp in replica_groups(plan) for r in dp}


def instance_groups(dp: list[int], rank: int, instances: int) -> tuple[list[int], list[int]]:
    """`rank`'s distributed-optimizer groups within its replica group `dp`: its chunk of
    `instances` consecutive chunks (intra) and the ranks at its place in every chunk (inter:
    the holders of its shard)."""
    if len(dp) % instances:
        raise ValueError(f"{instances} distributed-optimizer instances do not divide the "
                         f"replica group {dp}")
    size = len(dp) // instances
    i = dp.index(rank)
    return dp[i // size * size:(i // size + 1) * size], dp[i % size::size]


def shard_holders(plan: ExecutionPlan, instances: int, buddy: bool = False
                  ) -> list[tuple[int, ...]]:
    """Every shard of `plan`'s optimizer state, as the ranks that hold it (its owners first),
    with `instances` asked for (instances_for applies) and, with `buddy`, buddy copies."""
    k = instances_for(plan, instances)
    out = []
    for dp in replica_groups(plan):
        size = len(dp) // k
        for i in range(size):
            owners = dp[i::size]
            buddies = [dp[c + (i - 1) % size] for c in range(0, len(dp), size)] \
                if buddy and size > 1 else []
            out.append(tuple(owners + buddies))
    return out


def lost_shards(plan: ExecutionPlan, lost: set[int], instances: int, buddy: bool = False
                ) -> list[tuple[int, ...]]:
    """The shards every holder of which is in `lost`, by their holders; a replica group lost
    whole is left out (its layers are gone with it, whatever the optimizer)."""
    whole_groups_lost = {r for dp in replica_groups(plan) if set(dp) <= lost for r in dp}
    return [h for h in shard_holders(plan, instances, buddy)
            if set(h) <= lost and h[0] not in whole_groups_lost]
