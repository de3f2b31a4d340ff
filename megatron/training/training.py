"""pretrain(): Megatron-LM's training entry, driven by an execution plan and its schedule IR."""

from __future__ import annotations

import gc
import logging
import math
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from chameleon_ext.perf_model import ProfileError, predict_plan
from chameleon_ext.strategies import redundancy
from chameleon_ext.plan import ExecutionPlan, PlanError
from chameleon_ext import comm, membership
from chameleon_ext.message_fusion import message_count
from chameleon_ext.schedule_ir import COMPUTE, OpKind
from chameleon_ext.faults import FaultSpecError, Injector, parse_injects
from megatron.elastic import cpu_compat, memory_meter, runtime, state_transfer
from megatron.elastic.calibration import LiveCalibration
from megatron.elastic.schedules import SHADOW_SYNC, ComputeClock
from megatron.elastic.recovery import PHASE_OF, NotNeeded, Planning, Recovery, Unrecoverable
from megatron.training import checkpointing, planning
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.data import DataError, MicroBatchLoader
from megatron.training.metrics import MetricsFile, Stopwatch, Tensorboard, iteration_line
from megatron.training.tokenizer import TokenizerError, build_tokenizer

log = logging.getLogger("megatron.training")


def _fail(msg: str) -> None:
    print(f"{os.path.basename(sys.argv[0])}: error: {msg}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(2)


def initialize_distributed(args) -> tuple[int, int]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.distributed_backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Under chameleon-launch the first world meets on the job's store, as later generations do
    # (env:// knows only a TCPStore; the store may be an etcd cluster).
    store = None
    if os.environ.get(membership.STORE_ENV):
        store = membership.generation_store(membership.connect_store(), 0)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(args.distributed_backend, rank=rank, world_size=world, store=store,
                            timeout=timedelta(minutes=args.distributed_timeout_minutes))
    return rank, world


def set_random_seeds(seed: int) -> None:
    from megatron.core import tensor_parallel
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def transformer_config(args):
    from megatron.core.transformer import TransformerConfig
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, normalization=args.normalization,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,  # gradients are summed over replicas, never averaged
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
    )


def optimizer_config(args):
    from megatron.core.optimizer import OptimizerConfig
    return OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=torch.float32, use_distributed_optimizer=False)


def make_plan(args, world: int) -> ExecutionPlan:
    if args.chameleon_plan:
        plan = ExecutionPlan.load(args.chameleon_plan)
        if plan.ranks != list(range(world)):
            raise PlanError(f"plan {args.chameleon_plan} uses ranks {plan.ranks}, the world is "
                            f"0..{world - 1}")
        if plan.num_layers != args.num_layers:
            raise PlanError(f"plan has {plan.num_layers} layers, --num-layers is {args.num_layers}")
        if plan.tensor_parallel != args.tensor_model_parallel_size:
            raise PlanError("plan's tensor_parallel differs from --tensor-model-parallel-size")
        if plan.micro_batch_size != args.micro_batch_size:
            raise PlanError("plan's micro_batch_size differs from --micro-batch-size")
        # Pipelines may split the layers at different points (misaligned stages): their
        # gradients are then summed per segment of layers (megatron.elastic.grad_reduction).
        args.global_batch_size = plan.global_batch_size
        return plan
    return ExecutionPlan.failure_free(world, args.tensor_model_parallel_size,
                                      args.pipeline_model_parallel_size, args.num_layers,
                                      args.micro_batch_size, args.global_batch_size)


def pretrain(train_valid_test_datasets_provider, model_provider, forward_step, loss_func,
             argv: list[str] | None = None) -> dict:
    """Train; returns a summary dict (rank 0 also prints it)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)  # per-bucket parameter lists
    try:
        args = parse_args(argv)
        plan = make_plan(args, args.world_size)
        tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                                    merge_file=args.merge_file,
                                    tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)
        injector = Injector(parse_injects(args.chameleon_inject), int(os.environ.get("RANK", "0")))
    except (ArgumentError, PlanError, TokenizerError, FaultSpecError) as e:
        _fail(str(e))
    if args.chameleon and not Recovery.available():
        _fail("--chameleon needs the job to run under chameleon-launch (no CHAMELEON_STORE)")
    args.padded_vocab_size = _pad_vocab(tokenizer.vocab_size, args)

    joining = args.chameleon and os.environ.get(membership.JOIN_ENV) == "1"
    if not joining:  # a restarted worker gets its world when it is admitted
        rank, world = initialize_distributed(args)
    cpu_compat.apply()
    from megatron.core.timers import Timers
    # Calibration reads the executor's per-op timers (level 2) whether or not they are logged.
    timers = Timers(max(args.timing_log_level, 2) if args.chameleon else args.timing_log_level,
                    "minmax")
    recovery = calibration = clock = None
    compute_clock = ComputeClock()
    if args.chameleon:
        try:
            base = planning.base_profile(args, args.distributed_backend == "nccl")
        except ProfileError as e:
            _fail(str(e))
        recovery = Recovery(args.distributed_backend, strategy=args.chameleon_strategy,
                            injector=injector, eager=args.chameleon_redundancy == "eager",
                            target=plan)
        calibration = LiveCalibration(recovery.members.store, recovery.launch_rank, timers,
                                      base, compute_clock)
        clock = planning.JobClock(args)
        recovery.planning = Planning(calibration.profile, clock.situation)
    try:
        train_ds, valid_ds, _ = train_valid_test_datasets_provider(args, tokenizer)
    except DataError as e:
        _fail(str(e))
    train_loader = MicroBatchLoader(train_ds, plan.micro_batch_size, plan.num_micro_batches)
    valid_loader = (MicroBatchLoader(valid_ds, plan.micro_batch_size, plan.num_micro_batches)
                    if valid_ds is not None and args.eval_interval else None)

    tied = not args.untie_embeddings_and_output_weights
    comm_timeout = timedelta(seconds=args.chameleon_comm_timeout) if args.chameleon else None

    def build(plan: ExecutionPlan, rank: int, carried=None) -> runtime.Built:
        built = runtime.build(
            plan, rank, config=transformer_config(args),
            model_provider=lambda cfg, pre, post: model_provider(args, cfg, pre, post),
            optimizer_config=optimizer_config(args),
            sched=runtime.SchedulerSettings(args.lr, args.min_lr, args.lr_warmup_iters,
                                            args.lr_decay_iters, args.lr_decay_style,
                                            args.weight_decay),
            seed=args.seed, tied_embeddings=tied, seq_length=args.seq_length,
            get_batch=train_loader.get, forward_step=forward_step, loss_func=loss_func,
            timeout=comm_timeout, timers=timers, executor=args.chameleon_executor,
            carried=carried, compute_clock=compute_clock,
            eager=args.chameleon_redundancy == "eager", measure_memory=args.chameleon)
        built.runtime.before_op = recovery.before_op if recovery else None
        built.runtime.after_op = _slowed(injector) if injector.has_slow() else None
        if calibration:
            calibration.start(plan, rank, built.schedule.ops[rank], built.shadows is not None,
                              built.runtime.memory)
        return built

    # Everything made so far (imports, data, tokenizer) lives for the whole job: out of the
    # collector's sight, so that the collections at a recovery (which close the old groups'
    # sockets) take milliseconds, not half a second.
    gc.freeze()
    start = 0
    if joining:
        try:
            out = recovery.join(timeout_s=args.chameleon_join_timeout)
        except (Unrecoverable, membership.MembershipError) as why:
            _fail(f"cannot join the job: {why}")
        plan, rank = out.plan, out.rank
        # Nothing of the model is here yet: every layer, its Adam moments, and the LR
        # schedule come from the ranks that stayed.
        built = build(plan, rank, carried=state_transfer.CarriedState(
            {}, {}, out.decision["scheduler"]))
        _world_sum(built.received_bytes)
        start = out.decision["iteration"]
        print(f"> launch rank {recovery.launch_rank} joined the job after iteration {start}: "
              f"rank {rank} of {plan.world_size}, generation {plan.generation}", flush=True)
    else:
        built = build(plan, rank)
    set_random_seeds(args.seed)
    model_meta = {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                  "tensor_parallel": plan.tensor_parallel, "global_batch_size": plan.global_batch_size,
                  "seq_length": args.seq_length}

    if args.load and not joining:
        try:
            meta = checkpointing.load(args.load, built.runtime, tied_embeddings=tied,
                                      expect=model_meta)
        except checkpointing.CheckpointError as e:
            _fail(str(e))
        if meta is None:
            _print0(rank, f"no checkpoint found under {args.load}: training from scratch")
        else:
            start = meta["iteration"]
            _print0(rank, f"loaded checkpoint from {args.load} at iteration {start}")

    metrics = MetricsFile(args.chameleon_metrics_file)
    tb = Tensorboard(args.tensorboard_dir if rank == 0 else None)
    if rank == 0:
        _print0(rank, f"> plan: {plan.world_size} ranks, {len(plan.pipelines)} pipeline(s) x "
                      f"{len(plan.pipelines[0].stages)} stage(s), tensor parallel {plan.tensor_parallel}, "
                      f"{plan.num_micro_batches} micro-batches of {plan.micro_batch_size} per iteration")
        _print0(rank, f"> backend {args.distributed_backend}, transformer impl "
                      f"{args.transformer_impl}, fused kernels: "
                      f"{'apex' if _has('apex') else 'torch fallbacks (no apex)'}, packed "
                      f"messages: {comm.backend()}")
        _print0(rank, _schedule_line(built.schedule))
        if args.chameleon:
            _print0(rank, f"> chameleon: in-process recovery on (strategy "
                          f"{args.chameleon_strategy}), {len(injector.specs)} injected fault(s)")
    bar = _progress(rank, args, start)
    tokens_per_iter = plan.global_batch_size * args.seq_length
    watch = Stopwatch()
    losses: list[float] = []
    times: list[float] = []
    events: list[tuple[int, int]] = []  # (index into times where a recovery happened, generation)
    skipped = 0
    strategy = "none"
    check: planning.PredictionCheck | None = None
    switch: dict | None = None  # a hybrid's second step: {"at_iteration", "plan", ...}
    it = start + 1
    while it <= args.train_iters:
        injector.maybe_fire(it, "between-iterations")
        error = None
        try:
            res = built.executor.run(built.schedule.ops[rank], it - 1)
        except RuntimeError as e:
            if recovery is None:
                raise
            noticed = recovery.notice()
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        if error is not None:  # outside the except block: its traceback would pin the groups
            recovery.placeholders = built.executor.drain(built.schedule.ops[rank],
                                                         recovery.lost_ranks())
            carried = _carried(built, tied)
            built.executor.reset()
            del built
            try:
                out = recovery.recover(plan, it, noticed)
            except NotNeeded as why:
                return _leave(it, why, metrics, tb, recovery)
            except (Unrecoverable, membership.MembershipError) as why:
                _fail(f"cannot recover in-process at iteration {it}: {why}")
            plan, rank = out.plan, out.rank
            switch = out.decision.get("switch")
            if out.strategy == "restart":
                del carried  # a checkpoint, not this rank's state, is the truth now
                built = build(plan, rank)
                resume = _load_for_restart(args, built.runtime, tied, model_meta)
            else:
                built = build(plan, rank, carried=carried)
                del carried
                resume = it - 1
            moved = _world_sum(built.received_bytes)
            strategy = out.strategy
            events.append((len(times), plan.generation))
            if rank == 0:
                reconfigure_ms = 1e3 * (time.time() - out.first_notice)
                _report_recovery(metrics, bar, out, it, plan, error, times, resume, reconfigure_ms,
                                 built.schedule, moved)
                calibration.measured_transition(out.detect_ms, reconfigure_ms)
                check = _prediction_check(out, it)
            if bar:
                bar.n = resume
                bar.refresh()
            it = resume + 1
            watch.lap_ms()
            continue
        ms = watch.lap_ms()
        skipped += 0 if res.update_successful else 1
        losses.append(res.loss)
        times.append(ms)
        if calibration:
            calibration.after_iteration(ms)
            clock.iteration_ms.append(ms)
        if check and check.add(ms):
            _report_prediction(metrics, bar, check)
            check = None
        if not math.isfinite(res.loss):
            _fail(f"loss is {res.loss} at iteration {it}")
        tps = tokens_per_iter / (ms / 1e3)
        lr = built.runtime.optimizer.param_groups[0]["lr"]
        if rank == 0:
            metrics.write("iteration", iteration=it, loss=res.loss,
                          consumed_samples=it * plan.global_batch_size, elapsed_ms=round(ms, 3),
                          tokens_per_s=round(tps, 1), world=plan.world_size,
                          generation=plan.generation, strategy=strategy)
        tb.scalars(it, **{"lm loss": res.loss, "learning-rate": lr, "grad-norm": res.grad_norm,
                          "iteration-time": ms / 1e3, "tokens-per-second": tps})
        if it % args.log_interval == 0:
            _write(bar, rank, iteration_line(
                iteration=it, train_iters=args.train_iters, consumed=it * plan.global_batch_size,
                elapsed_ms=ms, lr=lr, gbs=plan.global_batch_size, loss=res.loss,
                grad_norm=res.grad_norm, tokens_per_s=tps, skipped=skipped))
            if args.timing_log_level > 0:
                text = timers.get_all_timers_string(list(_OP_TIMERS), normalizer=args.log_interval)
                _write(bar, rank, text.rstrip() if text else "")
        if valid_loader and it % args.eval_interval == 0:
            vloss = built.executor.evaluate(built.eval_schedule.ops[rank], valid_loader.get,
                                            range(args.eval_iters))
            _write(bar, rank, f" validation loss at iteration {it} | lm loss value: {vloss:.6E} |"
                              f" lm loss PPL: {math.exp(min(vloss, 20)):.6E} |")
            tb.scalars(it, **{"lm loss validation": vloss})
            if rank == 0:
                metrics.write("validation", iteration=it, loss=vloss)
            watch.lap_ms()
        if args.save and args.save_interval and it % args.save_interval == 0:
            _save(args, built.runtime, it, tied, model_meta, bar, rank)
            if calibration and rank == 0:
                _save_profile(args, calibration, plan, recovery.alive)
            watch.lap_ms()
        if switch and it == switch["at_iteration"]:
            del built
            try:
                plan, rank = recovery.switch(ExecutionPlan.from_dict(switch["plan"]), it)
            except NotNeeded as why:
                return _leave(it, why, metrics, tb, recovery)
            except (Unrecoverable, membership.MembershipError) as why:
                _fail(f"cannot switch plans at iteration {it}: {why}")
            built = build(plan, rank)
            _load_for_restart(args, built.runtime, tied, model_meta)
            strategy = switch["strategy"]
            events.append((len(times), plan.generation))
            _write(bar, rank, f"> switched at iteration {it} to the {switch['strategy']} plan: "
                              f"pipeline {len(plan.pipelines[0].stages)} x data "
                              f"{len(plan.pipelines)} on {plan.world_size} ranks, generation "
                              f"{plan.generation}, from the checkpoint of iteration {it}")
            if rank == 0:
                if check and check.result():
                    _report_prediction(metrics, bar, check)
                metrics.write("switch", iteration=it, strategy=switch["strategy"],
                              generation=plan.generation, world=plan.world_size)
                check = planning.PredictionCheck(switch["predicted_iter_ms"], it,
                                                 switch["strategy"])
            switch = None
            watch.lap_ms()
        if recovery and recovery.admission_due(it):
            carried = _carried(built, tied)
            del built
            try:
                out = recovery.admit(plan, it, carried.scheduler)
            except (Unrecoverable, membership.MembershipError) as why:
                _fail(f"cannot admit the ranks that rejoined after iteration {it}: {why}")
            plan, rank = out.plan, out.rank
            built = build(plan, rank, carried=carried)
            del carried
            moved = _world_sum(built.received_bytes)
            strategy = out.strategy
            events.append((len(times), plan.generation))
            if rank == 0:
                if check and check.result():
                    _report_prediction(metrics, bar, check)
                _report_rejoin(metrics, bar, out, it, plan, moved)
                check = _prediction_check(out, it)
            watch.lap_ms()
        if bar:
            bar.update(1)
            bar.set_postfix(loss=f"{res.loss:.4f}")
        it += 1
    if bar:
        bar.close()
    if check and check.result():
        _report_prediction(metrics, None, check)
    last = args.train_iters
    if args.save and last > start and not (args.save_interval and last % args.save_interval == 0):
        _save(args, built.runtime, last, tied, model_meta, None, rank)
        if calibration and rank == 0:
            _save_profile(args, calibration, plan, recovery.alive)
    if built.shadows is not None:
        _report_shadows(built.shadows, timers, len(times), rank, metrics)
    if built.runtime.memory is not None:
        _report_memory(built, plan, calibration.profile(plan, recovery.alive) if rank == 0
                       else None, rank, metrics, bar)
    if args.chameleon:
        _check_replicas(built.runtime, tied, rank, metrics, bar)
    summary = _summary(rank, plan, args, start, losses, times, tokens_per_iter, events)
    metrics.close()
    tb.close()
    dist.barrier()
    dist.destroy_process_group()
    # Groups of earlier worlds that something still referenced go now, while the interpreter
    # is whole: gloo's threads joined at its teardown end in std::terminate (SIGABRT).
    gc.collect()
    if recovery:
        recovery.stop()
    return summary


def _carried(built, tied: bool) -> state_transfer.CarriedState:
    """What this rank carries into the next plan: its state, and its shadow copies."""
    carried = state_transfer.capture(built.runtime, tied)
    if built.shadows is not None:
        built.shadows.add_to(carried)
    return carried


def _prediction_check(out, it: int) -> planning.PredictionCheck | None:
    predicted = out.decision.get("predicted_iter_ms")
    return planning.PredictionCheck(predicted, it, out.strategy) if predicted else None


def _report_shadows(shadows, timers, iterations: int, rank: int, metrics: MetricsFile) -> None:
    """Eager redundancy's measured cost: the largest holder's copies and the slowest refresh
    (collective: every rank of a plan with shadows calls it)."""
    mine = (shadows.held_bytes, 1e3 * timers(SHADOW_SYNC, log_level=2).active_time()
            / max(iterations, 1))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        held, sync = max(b for b, _ in everyone), max(ms for _, ms in everyone)
        metrics.write("redundancy", held_bytes=held, sync_ms=round(sync, 3))
        print(f"> eager redundancy: shadow copies of {held / 2**20:.2f} MiB on the largest "
              f"holder, refreshed in {sync:.2f} ms per iteration (slowest rank)", flush=True)


def _report_memory(built, plan: ExecutionPlan, profile, rank: int, metrics: MetricsFile,
                   bar) -> None:
    """Every rank's measured memory (training state, shadow copies, the most activations held
    at once) beside the plan's estimate with the calibrated profile (collective)."""
    rt = built.runtime
    mine = {"state": memory_meter.state_bytes(rt.module,
                                              state_transfer.torch_optimizers(rt.optimizer)),
            "shadows": built.shadows.held_bytes if built.shadows is not None else 0,
            "activations": rt.memory.peak_bytes}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank != 0 or profile is None:
        return
    estimate = predict_plan(plan, profile).memory_bytes
    held = redundancy.held_bytes(plan, profile.shape) if built.shadows is not None else {}
    ranks = [{"rank": r, "measured_bytes": sum(m.values()), **{f"{k}_bytes": v
                                                               for k, v in m.items()},
              "estimated_bytes": estimate[r] + held.get(r, 0)} for r, m in enumerate(everyone)]
    metrics.write("memory", ranks=ranks)
    worst = max(ranks, key=lambda x: x["measured_bytes"] / max(x["estimated_bytes"], 1))
    most = max(x["measured_bytes"] for x in ranks) / 2**20
    planned = max(x["estimated_bytes"] for x in ranks) / 2**20
    _write(bar, 0, f"> memory per rank: measured {most:.2f} MiB at most, estimated {planned:.2f} "
                   f"MiB; measured/estimated at most "
                   f"{worst['measured_bytes'] / max(worst['estimated_bytes'], 1):.3f} (rank "
                   f"{worst['rank']})")


def _check_replicas(rt, tied: bool, rank: int, metrics: MetricsFile, bar) -> None:
    """Every copy of every parameter (replicas, and the tied embedding's two ends) must be
    bit-identical: gathered digests, compared on rank 0."""
    mine = state_transfer.parameter_digests(rt, tied)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return
    seen: dict[str, set[str]] = {}
    for digests in everyone:
        for name, d in digests.items():
            seen.setdefault(name, set()).add(d)
    differ = sorted(n for n, ds in seen.items() if len(ds) > 1)
    metrics.write("replicas", parameters=len(seen), identical=not differ, differing=differ[:10])
    _write(bar, 0, f"> replicas: {len(seen)} parameters, "
                   + ("all copies bit-identical" if not differ else f"{len(differ)} DIFFER: {differ[:3]}"))


def _load_for_restart(args, rt, tied: bool, model_meta: dict) -> int:
    """Load the latest checkpoint (of --save, else --load) into the restarted runtime; returns
    its iteration, 0 when there is none (the initial weights are a function of the seed)."""
    root = args.save or args.load
    meta = None
    if root:
        try:
            meta = checkpointing.load(root, rt, tied_embeddings=tied, expect=model_meta)
        except checkpointing.CheckpointError as e:
            _fail(f"cannot restart from a checkpoint: {e}")
    return meta["iteration"] if meta else 0


def _schedule_line(schedule) -> str:
    kinds = {op.kind for ops in schedule.ops.values() for op in ops}
    messages, packed = message_count(schedule)
    return (f"> schedule: {'backward split, ' if OpKind.BWD_WEIGHT in kinds else ''}"
            f"{messages} point-to-point messages per iteration, {packed} of them packed")


def _leave(it: int, why: NotNeeded, metrics, tb, recovery) -> dict:
    """A survivor the new plan has no place for: it closes its logs and exits cleanly."""
    print(f"> leaving the job at iteration {it}: {why}", flush=True)
    metrics.close()
    tb.close()
    recovery.stop()
    return {}


def _world_sum(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return int(t.item())


def _report_recovery(metrics, bar, out, it, plan, error: str, times, resume: int,
                     reconfigure_ms: float, schedule, moved_bytes: int) -> None:
    cause = ", ".join(f"rank {r}: {c}" for r, c in out.causes.items())
    before = sorted(times[-10:])[len(times[-10:]) // 2] if times else None
    metrics.write("failure", generation=out.old_generation, ranks=out.failed,
                  cause=",".join(sorted(set(out.causes.values()))),
                  detect_ms=None if out.detect_ms is None else round(max(out.detect_ms, 0.0), 1))
    lost = it - resume
    decision = out.decision
    metrics.write("recovery", generation=plan.generation, strategy=out.strategy,
                  candidates=decision["candidates"], profile=decision["profile"],
                  predicted_iter_ms=decision["predicted_iter_ms"], switch=None if not
                  decision["switch"] else {k: v for k, v in decision["switch"].items()
                                           if k != "plan"},
                  reconfigure_ms=round(reconfigure_ms, 1), lost_iterations=lost,
                  resume_iteration=resume + 1, world=plan.world_size, moved_bytes=moved_bytes)
    if out.strategy == "restart":
        what = (f"checkpoint of iteration {resume}" if resume else "no checkpoint: the initial "
                "weights") + (f" loaded onto pipeline {len(plan.pipelines[0].stages)} x data "
                              f"{len(plan.pipelines)}")
    elif out.strategy in ("takeover", "reparallelize"):
        what = "; ".join(f"pipeline {pi} now {len(p.stages)} stage(s): " + ", ".join(
            f"layers [{st.layer_start}, {st.layer_end}) on rank(s) {st.ranks}" for st in p.stages)
            + f", {len(p.micro_batches)} micro-batch(es)" for pi, p in enumerate(plan.pipelines)) + f"; {moved_bytes / 2**20:.2f} MiB of " \
            "parameters and optimizer state moved from replicas"
    else:
        what = "; ".join(f"micro-batch(es) of pipeline {pi} stage {si} now on rank(s) "
                         f"{sorted({r for rs in st.hosts.values() for r in rs})}"
                         for pi, p in enumerate(plan.pipelines) for si, st in enumerate(p.stages)
                         if not st.ranks)
    detect = "" if out.detect_ms is None else f", detected {max(out.detect_ms, 0.0):.0f} ms after it"
    lines = [
        f"> recovery at iteration {it}: lost launch rank(s) {out.failed} ({cause}){detect}",
        f"  ({error})",
        f"  strategy {out.strategy}: {what}",
        "  " + _schedule_line(schedule)[2:],
        f"  new world {plan.world_size} ranks, generation {plan.generation}, reconfigured in "
        f"{reconfigure_ms:.0f} ms; training goes on from iteration {resume + 1} "
        f"({lost} iteration(s) lost)"
        + (f" (before: {before:.1f} ms/iteration)" if before else ""),
    ]
    for c in decision["candidates"]:
        chosen = "  <- chosen" if c["strategy"] == out.strategy else ""
        lines.append(
            f"  candidate {c['strategy']:<16} {c['layout']:<28} predicted "
            f"{c['predicted_iter_ms']:8.1f} ms/iteration, transition {c['transition_ms']:8.1f} ms, "
            f"memory {c['memory_mib']:8.1f} MiB" + ("" if c["feasible"] else ", DOES NOT FIT")
            + chosen)
    if decision["switch"]:
        sw = decision["switch"]
        lines.append(f"  then {sw['strategy']} after the checkpoint of iteration "
                     f"{sw['at_iteration']} (predicted {sw['predicted_iter_ms']:.1f} ms/iteration)")
    for line in lines:
        _write(bar, 0, line)


def _report_rejoin(metrics, bar, out, it: int, plan: ExecutionPlan, moved_bytes: int) -> None:
    reconfigure_ms = 1e3 * (time.time() - out.first_notice)
    joined = out.decision["joined"]
    metrics.write("rejoin", iteration=it, joined=joined, strategy=out.strategy,
                  generation=plan.generation, world=plan.world_size, moved_bytes=moved_bytes,
                  reconfigure_ms=round(reconfigure_ms, 1),
                  predicted_iter_ms=out.decision["predicted_iter_ms"], plan=plan.to_dict())
    _write(bar, 0, f"> rejoin after iteration {it}: launch rank(s) {joined} admitted; "
                   f"{out.strategy} plan {_layout_text(plan)} on {plan.world_size} ranks, "
                   f"generation {plan.generation}; {moved_bytes / 2**20:.2f} MiB of parameters "
                   f"and optimizer state moved to them; reconfigured in {reconfigure_ms:.0f} ms")


def _report_prediction(metrics, bar, check) -> None:
    metrics.write("prediction", **check.result())
    _write(bar, 0, check.line())


def _save_profile(args, calibration, plan, launch_ranks) -> None:
    """The live profile beside the checkpoints (loadable with --chameleon-profile)."""
    profile = calibration.profile(plan, launch_ranks)
    if profile is not None:
        profile.save(Path(args.save) / "profile.json")


def _slowed(injector: Injector):
    """after_op of a rank with a `slow` fault: its compute ops take `factor` times as long."""
    def after_op(op, iteration: int, elapsed_s: float) -> None:
        if op.kind in COMPUTE:
            injector.maybe_fire(iteration + 1, PHASE_OF[op.kind], elapsed_s=elapsed_s)
    return after_op


_OP_TIMERS = ("forward-recv", "forward-compute", "forward-send", "backward-recv",
              "backward-compute", "backward-input", "backward-weight", "backward-send",
              "grads-all-reduce", "optimizer", SHADOW_SYNC)


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _pad_vocab(vocab_size: int, args) -> int:
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def _save(args, rt, it, tied, model_meta, bar, rank) -> None:
    path = checkpointing.save(args.save, it, rt, tied_embeddings=tied,
                              meta={**model_meta, "consumed_samples": it * rt.plan.global_batch_size,
                                    "plan": rt.plan.to_dict()})
    _write(bar, rank, f"  successfully saved checkpoint at iteration {it} to {path}")


def _summary(rank, plan, args, start, losses, times, tokens_per_iter, events) -> dict:
    steady = sorted(times[1:] or times)
    median_ms = steady[len(steady) // 2] if steady else float("nan")
    summary = {
        "iterations": len(losses), "first_iteration": start + 1,
        "final_loss": losses[-1] if losses else None,
        "median_iteration_ms": median_ms,
        "tokens_per_s": tokens_per_iter / (median_ms / 1e3) if steady else None,
        "world": plan.world_size, "pipelines": len(plan.pipelines),
        "stages": len(plan.pipelines[0].stages),
    }
    if rank == 0:
        print("-" * 72)
        print(f" training summary: {summary['iterations']} iterations "
              f"({summary['first_iteration']}..{args.train_iters}) on {plan.world_size} ranks "
              f"({_layout_text(plan)})")
        if losses:
            print(f"   loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
            print(f"   median iteration time: {median_ms:.1f} ms, "
                  f"throughput: {summary['tokens_per_s']:.0f} tokens/s")
        if events:
            cut = events[-1][0]
            pre, post = sorted(times[1:events[0][0]]), sorted(times[cut + 1:])
            if pre and post:
                b, a = pre[len(pre) // 2], post[len(post) // 2]
                print(f"   {len(events)} recovery(ies); iteration time {b:.1f} ms before the first "
                      f"failure, {a:.1f} ms after the last ({a / b:.2f}x)")
                summary.update(before_ms=b, after_ms=a)
        print("-" * 72, flush=True)
    return summary


def _layout_text(plan: ExecutionPlan) -> str:
    depths = [len(p.stages) for p in plan.pipelines]
    if len(set(depths)) == 1:
        return f"pipeline {depths[0]} x data {len(depths)}"
    return f"{len(depths)} pipelines of {'+'.join(map(str, depths))} stages"


def _progress(rank: int, args, start: int):
    if rank != 0 or args.no_progress_bar:
        return None
    from tqdm import tqdm
    return tqdm(total=args.train_iters, initial=start, desc="training", unit="it",
                file=sys.stderr, dynamic_ncols=True)


def _write(bar, rank: int, line: str) -> None:
    if rank != 0:
        return
    if bar is not None:
        bar.write(line, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(line, flush=True)


def _print0(rank: int, line: str) -> None:
    if rank == 0:
        print(line, flush=True)
