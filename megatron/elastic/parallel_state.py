"""Process groups built from an ExecutionPlan, installed where megatron-core looks for them.

megatron-core's ``initialize_model_parallel`` only knows homogeneous grids. Here every group comes
from the plan: tensor-parallel groups per stage, pipeline groups per pipeline, data-parallel groups
over the ranks that hold exactly the same layers (plan.replicas), and the embedding group of each
pipeline (its first and last stage, which share the tied word embeddings). The groups are then
written into megatron-core's parallel_state globals, so its getters (ranks, sizes, first/last
stage, groups) and the code that calls them answer for the plan.

Every rank creates every group, in the same order, as torch.distributed.new_group requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state as mps

from chameleon_ext.plan import ExecutionPlan


@dataclass
class RankGroups:
    """The groups of one rank under one plan."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    mp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_gloo: dist.ProcessGroup
    tp_dp: dist.ProcessGroup
    embd: dist.ProcessGroup | None
    pos_embd: dist.ProcessGroup | None
    single: dist.ProcessGroup
    tp_ranks: list[int]
    pp_ranks: list[int]
    mp_ranks: list[int]
    dp_ranks: list[int]
    embd_ranks: list[int]
    pos_embd_ranks: list[int]


def _group_rank_lists(plan: ExecutionPlan) -> list[tuple[int, ...]]:
    """Every distinct group of the plan, in one deterministic order."""
    out: list[tuple[int, ...]] = []
    for r in plan.ranks:
        out.append((r,))
    for p in plan.pipelines:
        out.append(tuple(sorted(r for st in p.stages for r in st.ranks)))
        for st in p.stages:
            out.append(tuple(st.ranks))
        for t in range(plan.tensor_parallel):
            out.append(tuple(st.ranks[t] for st in p.stages))
            out.append(tuple(sorted({p.stages[0].ranks[t], p.stages[-1].ranks[t]})))
    ranges = sorted({(st.layer_start, st.layer_end) for p in plan.pipelines for st in p.stages})
    for lr in ranges:
        holders = [st for p in plan.pipelines for st in p.stages
                   if (st.layer_start, st.layer_end) == lr]
        out.append(tuple(sorted(r for st in holders for r in st.ranks)))
        for t in range(plan.tensor_parallel):
            out.append(tuple(sorted(st.ranks[t] for st in holders)))
    seen: set[tuple[int, ...]] = set()
    return [g for g in out if not (g in seen or seen.add(g))]


def build_groups(plan: ExecutionPlan, rank: int, timeout: timedelta | None = None) -> RankGroups:
    """Create all groups of `plan` (collective over the current world) and return `rank`'s."""
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in _group_rank_lists(plan):
        groups[ranks] = dist.new_group(list(ranks), timeout=timeout)
    gloo = dist.get_backend() == "gloo"
    dp_ranks = plan.replicas(rank)
    dp_gloo = groups[tuple(dp_ranks)]
    if not gloo:
        for lr in sorted({tuple(plan.replicas(r)) for r in plan.ranks}):
            g = dist.new_group(list(lr), timeout=timeout, backend="gloo")
            if lr == tuple(dp_ranks):
                dp_gloo = g
    pos = plan.position(rank)
    pipe = plan.pipelines[pos.pipeline]
    stage = pipe.stages[pos.stage]
    pp_ranks = [st.ranks[pos.tp_rank] for st in pipe.stages]
    mp_ranks = sorted(r for st in pipe.stages for r in st.ranks)
    embd_ranks = sorted({pp_ranks[0], pp_ranks[-1]})
    tp_dp = sorted(r for p in plan.pipelines for st in p.stages
                   if (st.layer_start, st.layer_end) == (stage.layer_start, stage.layer_end)
                   for r in st.ranks)
    in_embd = rank in embd_ranks
    in_pos = rank == pp_ranks[0]
    return RankGroups(
        tp=groups[tuple(stage.ranks)], pp=groups[tuple(pp_ranks)], mp=groups[tuple(mp_ranks)],
        dp=groups[tuple(dp_ranks)], dp_gloo=dp_gloo, tp_dp=groups[tuple(tp_dp)],
        embd=groups[tuple(embd_ranks)] if in_embd else None,
        pos_embd=groups[(pp_ranks[0],)] if in_pos else None,
        single=groups[(rank,)],
        tp_ranks=list(stage.ranks), pp_ranks=pp_ranks, mp_ranks=mp_ranks, dp_ranks=dp_ranks,
        embd_ranks=embd_ranks, pos_embd_ranks=[pp_ranks[0]],
    )


def install(plan: ExecutionPlan, rank: int, g: RankGroups) -> None:
    """Point megatron-core's parallel_state at the plan's groups for `rank`."""
    mps.destroy_model_parallel()
    pos = plan.position(rank)
    values = {
        "_TENSOR_MODEL_PARALLEL_GROUP": g.tp,
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": g.tp_ranks,
        "_PIPELINE_MODEL_PARALLEL_GROUP": g.pp,
        "_PIPELINE_GLOBAL_RANKS": g.pp_ranks,
        "_MODEL_PARALLEL_GROUP": g.mp,
        "_MODEL_PARALLEL_GLOBAL_RANKS": g.mp_ranks,
        "_EMBEDDING_GROUP": g.embd,
        "_EMBEDDING_GLOBAL_RANKS": g.embd_ranks,
        "_POSITION_EMBEDDING_GROUP": g.pos_embd,
        "_POSITION_EMBEDDING_GLOBAL_RANKS": g.pos_embd_ranks,
        "_DATA_PARALLEL_GROUP": g.dp,
        "_DATA_PARALLEL_GROUP_GLOO": g.dp_gloo,
        "_DATA_PARALLEL_GLOBAL_RANKS": g.dp_ranks,
        "_DATA_PARALLEL_GROUP_WITH_CP": g.dp,
        "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": g.dp_gloo,
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": g.dp_ranks,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": g.dp,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": g.dp_gloo,
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": g.dp,
        "_TENSOR_AND_DATA_PARALLEL_GROUP": g.tp_dp,
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": g.tp_dp,
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": g.tp,
        "_CONTEXT_PARALLEL_GROUP": g.single,
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": [rank],
        "_EXPERT_MODEL_PARALLEL_GROUP": g.single,
        "_EXPERT_MODEL_PARALLEL_RANKS": [rank],
        "_EXPERT_TENSOR_PARALLEL_GROUP": g.tp,
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": g.tp,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": g.mp,
        "_EXPERT_DATA_PARALLEL_GROUP": g.dp,
        "_EXPERT_DATA_PARALLEL_GROUP_GLOO": g.dp_gloo,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": g.dp,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": g.dp_gloo,
        "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": plan.tensor_parallel,
        "_MPU_TENSOR_MODEL_PARALLEL_RANK": pos.tp_rank,
        "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": len(g.pp_ranks),
        "_MPU_PIPELINE_MODEL_PARALLEL_RANK": pos.stage,
        "_MPU_DATA_PARALLEL_WORLD_SIZE": len(g.dp_ranks),
        "_MPU_DATA_PARALLEL_RANK": g.dp_ranks.index(rank),
    }
    for name, value in values.items():
        if not hasattr(mps, name):
            raise RuntimeError(f"megatron-core parallel_state has no {name}: version mismatch")
        setattr(mps, name, value)
    mps._set_global_memory_buffer()  # attention's scratch buffer, normally made by initialize


def initialize(plan: ExecutionPlan, rank: int, timeout: timedelta | None = None) -> RankGroups:
    g = build_groups(plan, rank, timeout)
    install(plan, rank, g)
    return g


def destroy() -> None:
    """Forget the plan's groups (megatron-core's globals); the caller drops its own references."""
    mps.destroy_model_parallel()
