"""Build one rank's training runtime (groups, stage model, DDP, optimizer, LR schedule) for a plan.

Everything plan-dependent is built here so that a new plan (after a failure) means one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Callable

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.plan.sharding import instances_for
from chameleon_ext.planning.strategies import redundancy
from chameleon_ext.schedule.choice import choose_schedule
from chameleon_ext.schedule.ir import OpKind, Schedule, forward_only
from megatron.elastic import grad_reduction, parallel_state, stage_model, state_transfer, wgrad
from megatron.elastic.buddy_copies import BuddyCopies
from megatron.elastic.memory_meter import MemoryMeter
from megatron.elastic.emulation import Emulation
from megatron.elastic.schedules import ComputeClock, Executor, StageRuntime, StepHooks
from megatron.elastic.shadows import Shadows

# model_provider(config, pre_process, post_process, pg_collection) -> megatron-core GPTModel
# built on the plan's groups (GPTModel's pg_collection=)
ModelProvider = Callable[[TransformerConfig, bool, bool, ProcessGroupCollection], torch.nn.Module]


@dataclass(frozen=True)
class SchedulerSettings:
    """OptimizerParamScheduler's arguments; its steps count samples, as in Megatron-LM."""

    lr: float
    min_lr: float
    warmup_samples: int
    decay_samples: int
    decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_samples: int                 # the training span the weight decay changes over
    wd_incr_style: str = "constant"
    wsd_decay_samples: int | None = None  # WSD's annealing phase
    wsd_decay_style: str | None = None
    # a loaded schedule's settings against these: must be equal (neither), these (override)
    # or the checkpoint's (use_checkpoint)
    override: bool = False
    use_checkpoint: bool = False


@dataclass(frozen=True)
class DataParallel:
    """How a stage's replicas reduce gradients and hold the optimizer state: megatron-core's
    DistributedDataParallelConfig and DistributedOptimizer, from Megatron-LM's flags."""

    distributed_optimizer: bool = False  # --use-distributed-optimizer: state sharded over replicas
    instances: int = 1                   # --num-distributed-optimizer-instances (each shards once)
    overlap_grad_reduce: bool = False    # --overlap-grad-reduce: reduced in the backward's hooks
    overlap_param_gather: bool = False   # --overlap-param-gather: gathered in the next forward
    bucket_size: int | None = None       # --ddp-bucket-size (None: megatron-core's)
    buddy: bool = False                  # --chameleon-shard-redundancy buddy: shards held twice


@dataclass
class Built:
    runtime: StageRuntime
    executor: Executor
    schedule: Schedule
    eval_schedule: Schedule
    groups: parallel_state.RankGroups
    # state this rank got from peers for layers new to it, bytes per parameter name
    received: dict[str, int] = field(default_factory=dict)
    shadows: Shadows | None = None    # eager redundancy's copies (held and refreshed)

    @property
    def received_bytes(self) -> int:
        return sum(self.received.values())


@dataclass
class RuntimeSpec:
    """What every runtime of a job is built from, whatever its plan."""

    config: TransformerConfig
    model_provider: ModelProvider
    optimizer_config: OptimizerConfig
    sched: SchedulerSettings
    seed: int
    tied_embeddings: bool
    seq_length: int
    get_batch: Callable[[int, int], dict]
    forward_step: Callable
    loss_func: Callable
    timeout: timedelta | None = None   # of the plan's groups' operations (None: torch's default)
    rendezvous: timedelta | None = None  # of their creation (None: torch's default)
    storage: timedelta | None = None   # of checkpoint saves' and loads' (None: the world's)
    timers: object | None = None
    executor: str = "ir"               # or "megatron-core" (its own pipeline schedule)
    compute_clock: ComputeClock | None = None
    eager: bool = False                # keep eager redundancy's shadow copies, where planned
    measure_memory: bool = False       # count the activations autograd keeps (memory_meter)
    hooks: StepHooks = StepHooks()     # the executor's calls out (the elastic manager's)
    emulation: Emulation | None = None  # each runtime's ops padded to its emulated device
    every_stage_reads: bool = False    # the batch carries an attention mask every layer needs
    grad_reduce_in_fp32: bool = True   # not --grad-reduce-in-bf16
    per_token_loss: bool = False       # --calculate-per-token-loss
    count_zeros: bool = False          # --log-num-zeros-in-grad
    data_parallel: DataParallel = DataParallel()


def make_scheduler(optimizer, sched: SchedulerSettings) -> OptimizerParamScheduler:
    """megatron-core's LR and weight-decay scheduler over `optimizer`'s param groups."""
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if sched.warmup_samples else sched.lr, max_lr=sched.lr,
        min_lr=sched.min_lr, lr_warmup_steps=sched.warmup_samples,
        lr_decay_steps=sched.decay_samples, lr_decay_style=sched.decay_style,
        start_wd=sched.start_wd, end_wd=sched.end_wd, wd_incr_steps=sched.wd_incr_samples,
        wd_incr_style=sched.wd_incr_style, wsd_decay_steps=sched.wsd_decay_samples,
        lr_wsd_decay_style=sched.wsd_decay_style,
        use_checkpoint_opt_param_scheduler=sched.use_checkpoint,
        override_opt_param_scheduler=sched.override)


def build(plan: ExecutionPlan, rank: int, spec: RuntimeSpec,
          carried: state_transfer.CarriedState | None = None,
          on_transfer: Callable[[], None] | None = None) -> Built:
    """`carried`: this rank's parameters, optimizer state and LR schedule under the plan
    before (after a failure), restored into the new runtime; the layers it did not hold
    come from the peers that do (collective: every rank of the new world passes its state).
    `on_transfer`: called just before that transfer (failure injection)."""
    config, seed, tied_embeddings = spec.config, spec.seed, spec.tied_embeddings
    timeout, timers = spec.timeout, spec.timers
    sharding = spec.data_parallel
    schedule = choose_schedule(plan, whole_backwards=sharding.overlap_grad_reduce)
    split = any(op.kind is OpKind.BWD_WEIGHT for ops in schedule.ops.values() for op in ops)
    if sharding.distributed_optimizer:
        sharding = replace(sharding, instances=instances_for(plan, sharding.instances))
    groups = parallel_state.initialize(plan, rank, timeout, spec.rendezvous, sharding.instances,
                                      spec.storage)
    pos = plan.position(rank)
    first, last = plan.is_first_stage(rank), plan.is_last_stage(rank)
    pgs = parallel_state.collection(groups)
    stages = plan.pipeline_of(rank).stages
    # one stage model per stage this rank holds (an interleaved plan's chunks), each with its
    # layers' global initial weights
    parts: dict[int, torch.nn.Module] = {}
    for s in plan.chunks(rank):
        part = spec.model_provider(stage_model.stage_config(config, stages[s]), s == 0,
                                   s == len(stages) - 1, pgs)
        stage_model.init_parameters(
            part, seed=seed, layer_offset=stages[s].layer_start, pre_process=s == 0,
            total_layers=plan.num_layers, init_std=config.init_method_std,
            tp_rank=pos.tp_rank, tp_size=plan.tensor_parallel, tied_output=tied_embeddings)
        parts[s] = part
    module = next(iter(parts.values())) if len(parts) == 1 else stage_model.ModelChunks(parts)
    cfg = stage_model.stage_config(config, plan.stage_of(rank))
    reduction = None
    if groups.misaligned:
        # Pipelines split the layers differently: DDP's group is this rank alone, and
        # grad_reduction sums each segment over its holders (and sets each parameter's shared
        # flag so that it counts once in the world's grad norm).
        reduction = grad_reduction.GradReduction.build(plan, rank, module, groups.grad_groups,
                                                       tied_embeddings)
    elif sharding.distributed_optimizer:
        # Each replica steps (and counts in the grad norm) its own shard; with several
        # instances each shard is held once per instance, and the first instance counts it.
        for p in module.parameters():
            p.shared = groups.instance_id > 0
    elif not groups.representative:
        for p in module.parameters():
            p.shared = True  # a replica's twin counts these in the global grad norm
    tied = stage_model.mark_tied_output(parts[max(parts)])
    if tied is None and first and not last and tied_embeddings:
        tied = parts[0].embedding.word_embeddings.weight
        # Its own DDP bucket, as the last stage's copy has: the distributed optimizer then
        # shards both copies alike, so the embedding all-reduce after the reduce-scatter
        # sums matching shards (megatron-core's LanguageModule marks it so under pipelining).
        tied.shared_embedding = True
    seeder = None
    if config.hidden_dropout > 0 or config.attention_dropout > 0:
        seeder = stage_model.DropoutSeeder(seed)
        for s, part in parts.items():
            seeder.attach(part, stages[s].layer_start, s == 0, pos.tp_rank,
                          plan.tensor_parallel, config.sequence_parallel)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=spec.grad_reduce_in_fp32,
        overlap_grad_reduce=sharding.overlap_grad_reduce,
        use_distributed_optimizer=sharding.distributed_optimizer,
        num_distributed_optimizer_instances=sharding.instances,
        overlap_param_gather=sharding.overlap_param_gather, bucket_size=sharding.bucket_size)
    store = wgrad.install(module) if split else None
    model = DistributedDataParallel(cfg, ddp_config, module, pg_collection=pgs)
    # megatron-core's gloo groups serve only its own checkpoint formats of the distributed
    # optimizer's state (checkpointing.py gathers that state itself)
    optimizer = get_megatron_optimizer(
        replace(spec.optimizer_config, use_distributed_optimizer=sharding.distributed_optimizer),
        [model], use_gloo_process_groups=False, pg_collection=pgs)
    scheduler = make_scheduler(optimizer, spec.sched)

    if config.num_moe_experts:
        # The router's aux loss enters each micro-batch's backward at this scale; the main loss
        # is the mean over the global batch's micro-batches (Executor._fwd), so is this (with
        # --calculate-per-token-loss the sum, its gradient divided by the batch's tokens after
        # the commit, as megatron-core scales it). Under sequence parallelism megatron-core
        # weighs each rank's part of the aux loss by the rank's own tokens
        # (calculate_per_token_loss), 1/tp of the sequence: tp makes it whole.
        shards = plan.tensor_parallel if config.sequence_parallel else 1
        MoEAuxLossAutoScaler.set_loss_scale(
            torch.ones(1) * shards / (1 if spec.per_token_loss else plan.num_micro_batches))
    rt = StageRuntime(
        rank=rank, plan=plan, model=model, module=module, optimizer=optimizer,
        scheduler=scheduler, get_batch=spec.get_batch, forward_step=spec.forward_step,
        loss_func=spec.loss_func,
        # under sequence parallelism a stage sends its rows of the sequence, [s/tp, b, h]
        activation_shape=(spec.seq_length // (plan.tensor_parallel if config.sequence_parallel
                                              else 1), plan.micro_batch_size, config.hidden_size),
        activation_dtype=config.params_dtype,
        embedding_group=groups.embd if tied is not None else None, tied_weight=tied,
        embedding_contributor=groups.embedding_contributor,
        before_forward=seeder.at if seeder else None, timers=timers,
        compute_clock=spec.compute_clock, wgrad=store, grad_reduction=reduction,
        clip_grad=spec.optimizer_config.clip_grad, hooks=spec.hooks,
        emulation=spec.emulation.device(plan, rank) if spec.emulation else None,
        every_stage_reads=spec.every_stage_reads, per_token_loss=spec.per_token_loss,
        count_zeros=spec.count_zeros, chunks=parts if len(parts) > 1 else {})
    if spec.measure_memory and len(parts) == 1:   # the meter knows one stage model
        rt.memory = MemoryMeter(module, first, last)
    if sharding.buddy and sharding.distributed_optimizer:
        rt.buddy = BuddyCopies(optimizer, tied_embeddings)
    pairs = redundancy.shadow_pairs(plan) if spec.eager else []
    if pairs:
        rt.shadows = Shadows(rt, tied_embeddings, pairs)
    received: dict[str, int] = {}
    if carried is not None:
        if on_transfer:
            on_transfer()
        named = state_transfer.named_parameters(rt, tied_embeddings)
        received = state_transfer.fetch_missing(
            carried, state_transfer.wanted(rt, tied_embeddings),
            {name: p.dtype for name, p in named.items()}, next(module.parameters()).device)
        state_transfer.restore(carried, rt, tied_embeddings)
    if spec.executor == "megatron-core":
        from megatron.elastic.mcore_executor import MegatronCoreExecutor
        return Built(rt, MegatronCoreExecutor(rt), schedule, forward_only(plan), groups,
                     received)
    return Built(rt, Executor(rt, schedule), schedule, forward_only(plan), groups, received,
                 rt.shadows)


def rebatch(built: Built, plan: ExecutionPlan) -> Built:
    """`built` running `plan`, which differs from its own only in its micro-batches (a batch
    ramp): the schedules and the executor are rebuilt, nothing else."""
    if built.shadows is not None or built.runtime.emulation is not None:
        raise ValueError("a batch ramp runs without shadows and emulation")
    schedule = choose_schedule(plan)
    executor = type(built.executor)(built.runtime, schedule) if isinstance(
        built.executor, Executor) else type(built.executor)(built.runtime)
    return replace(built, executor=executor, schedule=schedule, eval_schedule=forward_only(plan))
