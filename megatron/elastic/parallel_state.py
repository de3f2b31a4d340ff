"""Process groups built from an ExecutionPlan, installed where megatron-core looks for them.

megatron-core's ``initialize_model_parallel`` only knows homogeneous grids. Here every group comes
from the plan: tensor-parallel groups per stage, pipeline groups per pipeline, data-parallel groups
over the ranks that hold exactly the same layers (plan.replicas), and the embedding group of each
pipeline (its first and last stage, which share the tied word embeddings). The groups are then
written into megatron-core's parallel_state globals, so its getters (ranks, sizes, first/last
stage, groups) and the code that calls them answer for the plan.

A misaligned plan (pipelines that split the layers at different points, plan.misaligned_stages)
has no whole-stage replica groups: megatron-core's DDP gets this rank alone as its data-parallel
group, and its gradients are summed by grad_reduction over the groups of reduction_groups()
instead (the ranks holding each segment of layers, the first stages, the last stages, and the
holders of either copy of the tied embedding). Aligned plans (homogeneous, uneven, rerouted)
keep the replica and embedding groups above, unchanged.

Every rank creates every group, in the same order, as torch.distributed.new_group requires.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state as mps
from torch.distributed.distributed_c10d import _set_pg_timeout

from chameleon_ext.plan.execution_plan import ExecutionPlan


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
    # One rank of each replica group counts its gradients in the global norm, so every layer
    # is counted exactly once in any plan.
    representative: bool
    embedding_contributor: bool
    # A misaligned plan: DDP's group (dp) is this rank alone, and grad_groups are this rank's
    # gradient-reduction groups, in the global order (reduction_groups), each with its process
    # group (None where this rank is the group's only member: nothing to sum).
    misaligned: bool = False
    grad_groups: list[tuple["ReductionGroup", dist.ProcessGroup | None]] = field(
        default_factory=list)


@dataclass(frozen=True)
class ReductionGroup:
    """One gradient all-reduce of a misaligned plan: the gradients of `parts` summed over
    `ranks` (one tensor-parallel shard). Parts: ("layers", a, b) for the segment of layers
    [a, b); ("embedding",) the first stages' embeddings (position, and the word embedding when
    untied); ("final_norm",) the last stages' final norm (and the untied output layer);
    ("tied",) the tied word embedding, over every rank holding either copy."""

    ranks: tuple[int, ...]
    parts: tuple[tuple, ...]


def _own_stages(p) -> list:
    return [st for st in p.stages if st.ranks]


def _layout(plan: ExecutionPlan, rank: int) -> dict[str, list[int]]:
    """The rank lists of `rank`'s groups.

    Gradient norms are summed over the whole world with one representative per replica group
    (model-parallel group = world), and the tied-embedding groups adopt the ends of pipelines
    that lost a stage: both stay right when a lost stage's micro-batches run elsewhere."""
    pos = plan.position(rank)
    pipe = plan.pipelines[pos.pipeline]
    stage = pipe.stages[pos.stage]
    t = pos.tp_rank
    if plan.misaligned_stages() is not None:
        # DDP reduces over this rank alone; grad_reduction sums over reduction_groups().
        return {"tp": list(stage.ranks), "pp": [st.ranks[t] for st in _own_stages(pipe)],
                "mp": plan.ranks, "dp": [rank], "tp_dp": list(stage.ranks), "embd": [],
                "single": [rank]}
    embd = next((g for g in embedding_groups(plan, t) if rank in g), [])
    return {
        "tp": list(stage.ranks),
        "pp": [st.ranks[t] for st in _own_stages(pipe)],
        "mp": plan.ranks,
        "dp": plan.replicas(rank),
        "tp_dp": sorted(r for p in plan.pipelines for st in _own_stages(p)
                        if (st.layer_start, st.layer_end) == (stage.layer_start, stage.layer_end)
                        for r in st.ranks),
        "embd": embd,
        "single": [rank],
    }


def embedding_groups(plan: ExecutionPlan, t: int) -> list[list[int]]:
    """Groups that sum the tied embedding's gradient, for tensor-parallel rank t: Megatron's
    (first stage, last stage) pair of each pipeline; the first- or last-stage rank of a pipeline
    that lost its other end joins the first pair. Within a group, the lowest first-stage rank
    and the lowest last-stage rank contribute, the others add zeros (embedding_contributor)."""
    ends: list[tuple[int | None, int | None]] = []
    for p in plan.pipelines:
        if len(p.stages) < 2:
            return []  # one stage holds both ends: the weight is one parameter
        first, last = p.stages[0].ranks, p.stages[-1].ranks
        ends.append((first[t] if first else None, last[t] if last else None))
    groups = [[f, l] for f, l in ends if f is not None and l is not None]
    orphans = [r for f, l in ends if f is None or l is None for r in (f, l) if r is not None]
    if not groups:
        return [sorted(orphans)] if orphans else []
    groups[0] += orphans
    return [sorted(g) for g in groups]


def reduction_groups(plan: ExecutionPlan, t: int) -> list[ReductionGroup]:
    """The gradient all-reduces of a misaligned plan for tensor-parallel shard t, in the one
    global order every rank issues them in: segments by layer index, then the embeddings, the
    final norm and the tied embedding. Parts with the same ranks share one all-reduce, at the
    place of the first of them (the order stays one total order, the same on every rank, so no
    two ranks can wait on each other in opposite orders). Single-rank groups are included
    (their rank sums nothing)."""
    parts: dict[tuple[int, ...], list[tuple]] = {}
    for a, b in plan.segments():
        parts.setdefault(tuple(plan.segment_ranks(a, b, t)), []).append(("layers", a, b))
    first, last = plan.first_stage_ranks(t), plan.last_stage_ranks(t)
    parts.setdefault(tuple(first), []).append(("embedding",))
    parts.setdefault(tuple(last), []).append(("final_norm",))
    parts.setdefault(tuple(sorted(set(first) | set(last))), []).append(("tied",))
    return [ReductionGroup(ranks, tuple(ps)) for ranks, ps in parts.items() if ranks]


def embedding_contributor(plan: ExecutionPlan, rank: int, group: list[int]) -> bool:
    firsts = [r for r in group if plan.stage_of(r).layer_start == 0]
    lasts = [r for r in group if plan.stage_of(r).layer_end == plan.num_layers]
    return rank in (min(firsts, default=None), min(lasts, default=None))


def _group_rank_lists(plan: ExecutionPlan) -> list[tuple[int, ...]]:
    """Every distinct group of the plan, in one deterministic order (the same on every rank)."""
    seen: set[tuple[int, ...]] = set()
    out: list[tuple[int, ...]] = []
    for r in plan.ranks:
        for ranks in _layout(plan, r).values():
            g = tuple(ranks)
            if g and g not in seen:
                seen.add(g)
                out.append(g)
    if plan.misaligned_stages() is not None:
        for t in range(plan.tensor_parallel):
            for spec in reduction_groups(plan, t):
                if len(spec.ranks) > 1 and spec.ranks not in seen:
                    seen.add(spec.ranks)
                    out.append(spec.ranks)
    return out


RENDEZVOUS = timedelta(seconds=60)


def build_groups(plan: ExecutionPlan, rank: int, timeout: timedelta | None = None) -> RankGroups:
    """Create all groups of `plan` (collective over the current world) and return `rank`'s."""
    # A group's rendezvous waits for every member to create it; on a loaded host one may lag
    # the others by seconds, so the connect gets at least RENDEZVOUS, the operations `timeout`.
    connect = None if timeout is None else max(timeout, RENDEZVOUS)

    def new_group(ranks, **kw) -> dist.ProcessGroup:
        g = dist.new_group(list(ranks), timeout=connect, **kw)
        if timeout is not None and rank in ranks:
            _set_pg_timeout(timeout, g)
        return g

    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in _group_rank_lists(plan):
        groups[ranks] = new_group(ranks)
    mine = _layout(plan, rank)
    dp_gloo = groups[tuple(mine["dp"])]
    if dist.get_backend() != "gloo":
        for lr in sorted({tuple(_layout(plan, r)["dp"]) for r in plan.ranks}):
            g = new_group(lr, backend="gloo")
            if lr == tuple(mine["dp"]):
                dp_gloo = g
    first = plan.stage_of(rank).layer_start == 0
    embd = mine["embd"]
    misaligned = plan.misaligned_stages() is not None
    t = plan.position(rank).tp_rank
    grad_groups = [(spec, groups[spec.ranks] if len(spec.ranks) > 1 else None)
                   for spec in (reduction_groups(plan, t) if misaligned else [])
                   if rank in spec.ranks]
    return RankGroups(
        tp=groups[tuple(mine["tp"])], pp=groups[tuple(mine["pp"])], mp=groups[tuple(mine["mp"])],
        dp=groups[tuple(mine["dp"])], dp_gloo=dp_gloo, tp_dp=groups[tuple(mine["tp_dp"])],
        embd=groups[tuple(embd)] if len(embd) > 1 else None,
        pos_embd=groups[(rank,)] if first else None,
        single=groups[(rank,)],
        tp_ranks=mine["tp"], pp_ranks=mine["pp"], mp_ranks=mine["mp"], dp_ranks=mine["dp"],
        embd_ranks=embd, pos_embd_ranks=[rank] if first else [],
        representative=rank == mine["dp"][0],
        embedding_contributor=bool(embd) and embedding_contributor(plan, rank, embd),
        misaligned=misaligned, grad_groups=grad_groups,
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
        "_MPU_PIPELINE_MODEL_PARALLEL_RANK": g.pp_ranks.index(rank),
        "_MPU_DATA_PARALLEL_WORLD_SIZE": len(g.dp_ranks),
        "_MPU_DATA_PARALLEL_RANK": g.dp_ranks.index(rank),
    }
    for name, value in values.items():
        if not hasattr(mps, name):
            raise RuntimeError(f"megatron-core parallel_state has no {name}: version mismatch")
        setattr(mps, name, value)
    mps._set_global_memory_buffer()  # attention's scratch buffer, normally made by initialize


def initialize(plan: ExecutionPlan, rank: int, timeout: timedelta | None = None) -> RankGroups:
    """The plan's groups, whose operations wait at most `timeout`."""
    g = build_groups(plan, rank, timeout)
    install(plan, rank, g)
    return g


def destroy() -> None:
    """Forget the plan's groups (megatron-core's globals); the caller drops its own references.
    destroy_model_parallel() leaves some globals set (megatron-core 0.16.1: the
    _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP pair, which install() sets to the data-parallel
    groups); a group still referenced keeps its sockets open and its peers blocked until their
    timeout, so every group left is dropped too."""
    mps.destroy_model_parallel()
    for name, value in list(vars(mps).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(mps, name, None)
