"""Process groups built from an ExecutionPlan, passed to megatron-core.

megatron-core's ``initialize_model_parallel`` only knows homogeneous grids. Here every group comes
from the plan: tensor-parallel groups per stage, pipeline groups per pipeline, data-parallel groups
over the ranks that hold exactly the same layers (plan.replicas), and the embedding group of each
pipeline (its first and last stage, which share the tied word embeddings). megatron-core gets them
as a ProcessGroupCollection (collection(): GPTModel, DistributedDataParallel,
get_megatron_optimizer and the pipeline schedules take one); install() sets the few globals
megatron-core 0.16.1 still reads with no way to be given them, each listed there with its reader.

A misaligned plan (pipelines that split the layers at different points, plan.misaligned_stages)
has no whole-stage replica groups: megatron-core's DDP gets this rank alone as its data-parallel
group, and its gradients are summed by grad_reduction over the groups of reduction_groups()
instead (the ranks holding each segment of layers, the first stages, the last stages, and the
holders of either copy of the tied embedding). Aligned plans (homogeneous, uneven, rerouted)
keep the replica and embedding groups above, unchanged.

The distributed optimizer (--use-distributed-optimizer) shards its state over a stage's
replica group; with N instances (--num-distributed-optimizer-instances) the replica group is cut
as megatron-core's initialize_model_parallel cuts it: N consecutive chunks, each sharding the
state once (intra_dp), and the ranks at the same place of every chunk, which all-reduce their
shards (inter_dp).

Every rank creates every group, in the same order, as torch.distributed.new_group requires.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from megatron.core import parallel_state as mps
from megatron.core.process_groups_config import ProcessGroupCollection
from torch.distributed.distributed_c10d import _set_pg_timeout

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.plan.sharding import instance_groups


@dataclass
class RankGroups:
    """The groups of one rank under one plan."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    mp: dist.ProcessGroup
    dp: dist.ProcessGroup
    tp_dp: dist.ProcessGroup
    embd: dist.ProcessGroup | None
    pos_embd: dist.ProcessGroup | None
    single: dist.ProcessGroup
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
    # The distributed optimizer's groups: dp itself with one instance; else this rank's chunk
    # of dp, the same place in every chunk, and every rank of this rank's instance.
    intra_dp: dist.ProcessGroup | None = None
    inter_dp: dist.ProcessGroup | None = None
    instance: dist.ProcessGroup | None = None
    instance_id: int = 0
    # The whole world, for checkpoint saves and loads, whose operations may wait far longer
    # than a step's (None: they run on the world itself). Made with the plan's groups, inside
    # the reconfiguration that builds them: a group made at each save connected to every rank
    # there, and survivors making it when a rank was lost stayed in gloo's set-up of the group
    # until its timeout (measured: past the agreement's 60 s, with the 300 s save timeout).
    storage: dist.ProcessGroup | None = None


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


def _pp_ranks(pipe, t: int) -> list[int]:
    """The pipeline's ranks of shard t in stage order, each once (an interleaved pipeline's
    ranks hold several stages)."""
    return list(dict.fromkeys(st.ranks[t] for st in _own_stages(pipe)))


def _instance_of(plan: ExecutionPlan, rank: int, instances: int) -> int:
    dp = sorted(plan.replicas(rank))
    return dp.index(rank) // (len(dp) // instances)


def _layout(plan: ExecutionPlan, rank: int, instances: int = 1) -> dict[str, list[int]]:
    """The rank lists of `rank`'s groups.

    Gradient norms are summed over the whole world with one representative per replica group
    (model-parallel group = world), and the tied-embedding groups adopt the ends of pipelines
    that lost a stage: both stay right when a lost stage's micro-batches run elsewhere."""
    pos = plan.position(rank)
    pipe = plan.pipelines[pos.pipeline]
    stage = pipe.stages[pos.stage]
    t = pos.tp_rank
    if plan.misaligned_stages() is not None:
        if instances > 1:
            raise ValueError("distributed-optimizer instances need whole-stage replicas; "
                             "this plan's pipelines split the layers differently")
        # DDP reduces over this rank alone; grad_reduction sums over reduction_groups().
        return {"tp": list(stage.ranks), "pp": _pp_ranks(pipe, t),
                "mp": plan.ranks, "dp": [rank], "tp_dp": list(stage.ranks), "embd": [],
                "single": [rank]}
    embd = next((g for g in embedding_groups(plan, t) if rank in g), [])
    # ascending, as torch numbers a group's ranks: the distributed optimizer's shard i is the
    # group's rank i, and its instances are chunks in this order (as in sharding.py)
    dp = sorted(plan.replicas(rank))
    sharding = {}
    if instances > 1:
        intra, inter = instance_groups(dp, rank, instances)
        mine = _instance_of(plan, rank, instances)
        sharding = {"intra_dp": intra, "inter_dp": inter,
                    "instance": [r for r in plan.ranks
                                 if _instance_of(plan, r, instances) == mine]}
    return {
        **sharding,
        "tp": list(stage.ranks),
        "pp": _pp_ranks(pipe, t),
        "mp": plan.ranks,
        "dp": dp,
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
    firsts = [r for r in group if plan.is_first_stage(r)]
    lasts = [r for r in group if plan.is_last_stage(r)]
    return rank in (min(firsts, default=None), min(lasts, default=None))


def _group_rank_lists(plan: ExecutionPlan, instances: int = 1) -> list[tuple[int, ...]]:
    """Every distinct group of the plan, in one deterministic order (the same on every rank)."""
    seen: set[tuple[int, ...]] = set()
    out: list[tuple[int, ...]] = []
    for r in plan.ranks:
        for ranks in _layout(plan, r, instances).values():
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


def bound_operations(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Let `group`'s operations wait at most `timeout` from now on.

    The one use of torch's private ``_set_pg_timeout``: a gloo group takes a single timeout
    at creation, and it bounds both the group's rendezvous (every member connecting, which on a
    loaded host can trail the first by seconds) and each of its operations (which must fail
    within --chameleon-comm-timeout to start a recovery). The world is in the same position:
    its rendezvous, and megatron-core's dataset builder's barrier on it, need Megatron's long
    timeout, the training collectives on it the short one. torch 2.13 has no public way to
    give the two different bounds (tests/dist/test_process_groups.py shows both needs)."""
    _set_pg_timeout(timeout, group)


def build_groups(plan: ExecutionPlan, rank: int, timeout: timedelta | None = None,
                 rendezvous: timedelta | None = None, instances: int = 1,
                 storage: timedelta | None = None) -> RankGroups:
    """Create all groups of `plan` (collective over the current world) and return `rank`'s:
    their creation waits at most `rendezvous`, their operations `timeout` (None: torch's
    default for both); `instances`: of the distributed optimizer; `storage`: the bound on the
    operations of a world group for checkpoints (None: no such group)."""
    # A group's rendezvous waits for every member to create it; on a loaded host one may lag
    # the others by seconds, so the connect never gets less than an operation.
    connect = None if timeout is None else max(timeout, rendezvous or timeout)
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks in _group_rank_lists(plan, instances):
        g = dist.new_group(list(ranks), timeout=connect)
        if timeout is not None and rank in ranks:
            bound_operations(g, timeout)
        groups[ranks] = g
    store_group = None
    if storage is not None:
        store_group = dist.new_group(timeout=rendezvous or storage)
        bound_operations(store_group, storage)
    mine = _layout(plan, rank, instances)
    embd = mine["embd"]
    misaligned = plan.misaligned_stages() is not None
    t = plan.position(rank).tp_rank
    grad_groups = [(spec, groups[spec.ranks] if len(spec.ranks) > 1 else None)
                   for spec in (reduction_groups(plan, t) if misaligned else [])
                   if rank in spec.ranks]
    return RankGroups(
        tp=groups[tuple(mine["tp"])], pp=groups[tuple(mine["pp"])], mp=groups[tuple(mine["mp"])],
        dp=groups[tuple(mine["dp"])], tp_dp=groups[tuple(mine["tp_dp"])],
        embd=groups[tuple(embd)] if len(embd) > 1 else None,
        pos_embd=groups[(rank,)] if plan.stage_of(rank).layer_start == 0 else None,
        single=groups[(rank,)],
        representative=rank == mine["dp"][0],
        embedding_contributor=bool(embd) and embedding_contributor(plan, rank, embd),
        misaligned=misaligned, grad_groups=grad_groups,
        intra_dp=groups[tuple(mine.get("intra_dp", mine["dp"]))],
        inter_dp=groups[tuple(mine["inter_dp"])] if "inter_dp" in mine else None,
        instance=groups[tuple(mine.get("instance", mine["mp"]))],
        instance_id=mine["inter_dp"].index(rank) if "inter_dp" in mine else 0,
        storage=store_group,
    )


def collection(g: RankGroups) -> ProcessGroupCollection:
    """`g` as megatron-core takes groups: GPTModel, DistributedDataParallel,
    get_megatron_optimizer and the pipeline schedules read every group from it. A plan has no
    context or expert parallelism: those groups are this rank alone, or the groups they
    coincide with at size 1 (as megatron-core's own initialize_model_parallel makes them).
    The distributed optimizer's: intra_dp_cp shards its state, inter_dist_opt (with several
    instances) all-reduces the shards, intra_dist_opt is the instance's ranks."""
    pgs = ProcessGroupCollection(
        tp=g.tp, pp=g.pp, mp=g.mp, embd=g.embd, pos_embd=g.pos_embd, cp=g.single, tp_cp=g.tp,
        dp=g.dp, dp_cp=g.dp, intra_dp_cp=g.intra_dp, tp_dp_cp=g.tp_dp, ep=g.single,
        expt_tp=g.tp, tp_ep=g.tp, tp_ep_pp=g.mp, expt_dp=g.dp, intra_expt_dp=g.intra_dp,
        intra_dist_opt=g.instance)
    if g.inter_dp is not None:
        pgs.inter_dist_opt = g.inter_dp
    return pgs


def install(g: RankGroups) -> None:
    """Set what megatron-core 0.16.1 reads from its parallel_state globals with no way to be
    given it, on the code paths this runtime takes (tests/dist/test_process_groups.py fails
    each path without its global):

    - ``_TENSOR_MODEL_PARALLEL_GROUP``: the unfused cross entropy
      (``tensor_parallel.vocab_parallel_cross_entropy``, which GPTModel's loss calls unless
      cross_entropy_loss_fusion is on) all-reduces over ``get_tensor_model_parallel_group()``
      and takes its vocabulary range from that group's rank and size;
    - the global memory buffer (``_set_global_memory_buffer``): DotProductAttention's forward
      takes its baddbmm input from ``get_global_memory_buffer()``, which asserts that
      initialize_model_parallel made one.
    """
    mps.destroy_model_parallel()
    mps._TENSOR_MODEL_PARALLEL_GROUP = g.tp
    mps._set_global_memory_buffer()


def initialize(plan: ExecutionPlan, rank: int, timeout: timedelta | None = None,
               rendezvous: timedelta | None = None, instances: int = 1,
               storage: timedelta | None = None) -> RankGroups:
    """The plan's groups, created within `rendezvous`, whose operations wait at most
    `timeout`; `instances`: of the distributed optimizer; `storage`: of the checkpoints'
    group."""
    g = build_groups(plan, rank, timeout, rendezvous, instances, storage)
    install(g)
    return g


def destroy() -> None:
    """Forget what install() set in megatron-core's globals; the caller drops its own
    references to the plan's groups."""
    mps.destroy_model_parallel()
