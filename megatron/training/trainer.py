"""The training loop: one call per step and one per transition (torchtitan's Trainer in shape;
the elastic side is megatron.elastic.manager's ElasticManager, torchft's Manager in shape; a
job without --chameleon has its DisabledManager, so the loop has one path for both).

    trainer = Trainer(config, plan, tokenizer, injector, providers)   # world, data, runtime, load
    summary = trainer.train()

`train` runs steps and, at each iteration boundary, the actions due there (evaluation, a
checkpoint save, a hybrid's switch, an admission of rejoining ranks; after the last iteration,
the final save and reports). A failure anywhere in them (a step, a save, an evaluation, the
reports) becomes one `Failure`; the manager's reconfiguration transaction moves the job to a
new world, and the loop goes on from the last applied step, re-running the action the failure
interrupted. A step is atomic across ranks (the executor's commit), so every survivor resumes
from the same state.
"""

from __future__ import annotations

import gc
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from chameleon_ext.comm import packed as comm
from chameleon_ext.control.agreement import Boundary
from chameleon_ext.control.faults import Injector
from chameleon_ext.control.store import MembershipError, connect_store
from chameleon_ext.control.world import PeerLost
from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.decider import Planning
from chameleon_ext.planning.decision import Decision
from chameleon_ext.planning.perf_model import ModelShape, Profile, ProfileError, predict_plan
from chameleon_ext.planning.strategies import redundancy
from chameleon_ext.schedule.ir import COMPUTE
from megatron.elastic import (cpu_compat, memory_meter, optimizer_step, runtime, sharded_state,
                              state_transfer)
from megatron.elastic.calibration import LiveCalibration
from megatron.elastic.emulation import Emulation
from megatron.elastic.manager import (PHASE_OF, Admission, DisabledManager, ElasticManager,
                                      Enter, Entered, Failure, Handover, NotNeeded,
                                      PlannedSwitch, Spare, Unrecoverable)
from megatron.elastic.schedules import SHADOW_SYNC, ComputeClock, StepHooks
from megatron.training import checkpointing, planning
from megatron.training.config import JobConfig, ModelConfig, ParallelConfig, TrainingConfig
from megatron.training.data import DataError, MicroBatchLoader
from megatron.training.exit_conditions import ExitConditions, ExitVerdict
from megatron.training.metrics import Stopwatch
from megatron.training.profiling import StepProfiler
from megatron.training.reporting import Reporter, differing

_OP_TIMERS = ("forward-recv", "forward-compute", "forward-send", "backward-recv",
              "backward-compute", "backward-input", "backward-weight", "backward-send",
              "grads-all-reduce", "optimizer", SHADOW_SYNC)


class JobError(Exception):
    """The job cannot go on; the message says why in one line. `exit_code`: 2 for bad input
    (data, a profile), 1 for a failure no plan survives."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StepFailure(Exception):
    """A peer was lost during work between two committed steps (not a RuntimeError, so that
    nothing on the way up takes it for an ordinary failed operation)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.error)
        self.failure = failure


@dataclass
class Providers:
    """Megatron-LM's entry points, as pretrain_gpt.py defines them."""

    datasets: Callable       # (JobConfig, tokenizer) -> (train, valid, test) datasets
    model: Callable          # (ModelConfig, TransformerConfig, pre_process, post_process,
                             #  pg_collection) -> GPTModel
    forward_step: Callable   # (batch, model) -> output
    loss_func: Callable      # (batch, output) -> token-mean loss


class Trainer:
    def __init__(self, config: JobConfig, plan: ExecutionPlan, tokenizer, injector: Injector,
                 providers: Providers, transformer_config, optimizer_config,
                 placement_line: str | None = None) -> None:
        self.config, self.injector = config, injector
        self.placement_line = placement_line    # placement.describe's, when the plan was placed
        self.tied = config.model.tied_embeddings
        elastic, log = config.elastic, config.logging
        self.plan, self.rank = plan, 0
        cpu_compat.apply()
        from megatron.core.timers import Timers
        # Calibration reads the executor's per-op timers (level 2) whether or not they are
        # logged.
        self.timers = Timers(max(log.timing_log_level, 2) if elastic.enabled
                             else log.timing_log_level, log.timing_log_option)
        compute_clock = ComputeClock()
        shape = planning.model_shape(config.model, config.training.micro_batch_size)
        # How this job holds its optimizer state, for every profile it plans or emulates with.
        held = {"optimizer_instances": config.parallel.optimizer_instances
                if config.parallel.distributed_optimizer else 0,
                "buddy_copies": elastic.shard_redundancy == "buddy",
                "overlap_grad_reduce": config.parallel.overlap_grad_reduce}
        self.emulation = Emulation(replace(Profile.load(elastic.emulate), **held),
                                   elastic.emulate_dilation, shape,
                                   elastic.emulate_storage_mib_per_s) \
            if elastic.emulate else None
        # The live profile the leader plans with, and the job's situation at a failure.
        self.calibration: LiveCalibration | None = None
        self.clock: planning.JobClock | None = None
        self.elastic: ElasticManager | DisabledManager
        if elastic.enabled:
            try:
                # Emulating: plan as on the emulated devices (calibration refines it from
                # the padded timers).
                base = self.emulation.device_profile if self.emulation else replace(
                    planning.base_profile(shape, elastic.profile,
                                          config.parallel.backend == "nccl"), **held)
            except ProfileError as e:
                raise JobError(str(e), exit_code=2) from None
            store = connect_store()
            # chameleon-launch's rank of this worker, as the manager's membership reads it
            self.calibration = LiveCalibration(store, int(os.environ["RANK"]), self.timers,
                                               base, compute_clock)
            self.clock = planning.JobClock(config.checkpoint, config.training.train_iters,
                                           elastic.mtbf_hours, elastic.eager,
                                           elastic.repair_minutes, elastic.restart_delay_s)
            self.elastic = ElasticManager(
                elastic, store, injector, Planning(self.calibration.profile, self.clock.situation,
                                                  self.clock.outlook),
                target=plan, backend=config.parallel.backend, placement=config.parallel.placement,
                sharded=config.parallel.optimizer_instances
                if config.parallel.distributed_optimizer else 0)
        else:
            self.elastic = DisabledManager(config.parallel.backend)
        joining = self.elastic.joining
        if not joining:  # a restarted worker gets its world when it is admitted
            self.rank = _initialize_distributed(config.parallel, self.elastic)
        self.elastic.start()
        try:
            train_ds, valid_ds, _ = providers.datasets(config, tokenizer)
        except DataError as e:
            raise JobError(str(e), exit_code=2) from None
        if not joining:
            # Until here the world's collectives had --distributed-timeout-minutes, as in
            # Megatron: megatron-core's dataset builder holds every rank in a barrier while
            # rank 0 writes the index cache, seconds on a loaded host.
            self.elastic.bound_world_ops()
        data = config.data
        reading = dict(num_workers=data.num_workers,
                       cyclic_seed=config.training.seed if data.dataloader_type == "cyclic"
                       else None)
        ramp = config.training.ramp
        self.train_loader = MicroBatchLoader(
            train_ds, plan.micro_batch_size, plan.num_micro_batches, **reading,
            first_samples=ramp.first_samples(config.training.train_iters
                                             * config.training.global_batch_size)
            if ramp else None)
        self.valid_loader = (MicroBatchLoader(valid_ds, plan.micro_batch_size,
                                              plan.num_micro_batches, **reading)
                             if valid_ds is not None and config.training.evaluates
                             else None)
        if config.training.skip_train and self.valid_loader is None:
            raise JobError("--skip-train: no validation data (give --split a validation part)",
                           exit_code=2)
        training = config.training
        self.spec = runtime.RuntimeSpec(
            config=transformer_config, model_provider=lambda cfg, pre, post, pgs: providers.model(
                config.model, cfg, pre, post, pgs),
            optimizer_config=optimizer_config,
            sched=scheduler_settings(training),
            seed=training.seed, tied_embeddings=self.tied, seq_length=config.model.seq_length,
            get_batch=self.train_loader.get, forward_step=providers.forward_step,
            loss_func=providers.loss_func,
            timeout=timedelta(seconds=elastic.timeouts.comm_s) if elastic.enabled else None,
            rendezvous=(timedelta(seconds=elastic.timeouts.rendezvous_s) if elastic.enabled
                        else None),
            storage=timedelta(seconds=elastic.timeouts.save_s) if elastic.enabled else None,
            timers=self.timers, executor=elastic.executor, compute_clock=compute_clock,
            # every job reports its memory at its end (with --chameleon beside the estimate)
            eager=elastic.eager, measure_memory=True,
            hooks=self._step_hooks(), emulation=self.emulation,
            every_stage_reads=config.data.reset_attention_mask,
            grad_reduce_in_fp32=not training.grad_reduce_in_bf16,
            per_token_loss=training.per_token_loss, count_zeros=log.log_num_zeros_in_grad,
            data_parallel=runtime.DataParallel(
                distributed_optimizer=config.parallel.distributed_optimizer,
                instances=config.parallel.optimizer_instances,
                overlap_grad_reduce=config.parallel.overlap_grad_reduce,
                overlap_param_gather=config.parallel.overlap_param_gather,
                bucket_size=config.parallel.ddp_bucket_size,
                buddy=elastic.shard_redundancy == "buddy"))
        # What a checkpoint must match to be loaded, and how long its collectives may wait.
        self.model_meta = {"num_layers": config.model.num_layers,
                           "hidden_size": config.model.hidden_size,
                           "tensor_parallel": plan.tensor_parallel,
                           "global_batch_size": config.training.global_batch_size,
                           "seq_length": config.model.seq_length}
        self.iteration = 0          # the last iteration whose step this rank applied
        self.consumed = 0           # samples the data loader delivered to committed steps
        self.start = 0
        self.strategy = "none"
        self.switch = None          # a hybrid's planned second step (decision.Switch)
        # The actions at iteration boundaries, by name: a rank entering without state takes the
        # names of those the stayers still run (manager.Handover).
        self.actions: dict[str, Callable[[], None]] = {
            "eval": self._evaluate, "checkpoint": self._save, "gc": gc.collect,
            "exit-check": self._check_exit, "switch": self._switch, "admit": self._admit,
            "shutting-down": self._shutting_down, "shadows": self._report_shadows,
            "memory": self._report_memory, "replicas": self._check_replicas,
            "weight-hash": self._check_weight_hash,
            "emulation": self._report_emulation}
        self.pending: list[str] = []   # the actions due at this iteration boundary, by name
        self.finishing = False      # the final actions were scheduled
        self.watch = Stopwatch()
        self.profiler = StepProfiler(log.profile_start, log.profile_end, log.tensorboard_dir,
                                     log.profile_ranks, log.profile_shapes,
                                     log.profile_stack) if log.profile else None
        self.built = None
        self.left: NotNeeded | None = None   # a joiner that came after the last iteration
        # Everything made so far (imports, data, tokenizer) lives for the whole job: out of the
        # collector's sight, so that the collections at a recovery (which close the old
        # groups' sockets) take milliseconds, not half a second.
        gc.freeze()
        if training.manual_gc:      # --manual-gc: collections only where _collect runs them
            gc.disable()
        self.exits = ExitConditions(training, elastic.enabled)
        self.stopped: ExitVerdict | None = None   # an exit condition ended training early
        self.reporter = Reporter(log, training.train_iters, config.model.seq_length,
                                 lead=self.rank == 0 and not joining,
                                 flops_per_sample=_flops_per_sample(shape, config.model)
                                 if log.log_throughput else 0.0)
        if joining:
            self._join()
        else:
            try:
                self.built = self._build(plan, self.rank)
            except PeerLost as e:   # generation 0 has no earlier world to go back to
                raise JobError(f"a rank was lost while the job started: {e}") from None
            _set_random_seeds(training.seed, plan.position(self.rank).tp_rank)
            if config.checkpoint.load:
                self._load_initial()
            try:
                self._hold_copies(self.built)
            except RuntimeError as e:
                raise JobError(f"a rank was lost while the job started: {e}") from None

    def _step_hooks(self) -> StepHooks:
        """The manager's calls in a step, and a slowed rank's stretching of its ops."""
        hooks = self.elastic.step_hooks()
        if self.injector.has_slow():
            hooks = replace(hooks, after_op=_slowed(self.injector))
        return hooks

    # ---- the loop ----------------------------------------------------------------------------
    def train(self) -> dict:
        if self.left is not None:
            return self._leave(self.left)
        if self.built is None:      # a joiner its admission gave no place: a spare from the start
            try:
                self._stand_by()
            except NotNeeded as why:
                return self._leave(why)
        c = self.config
        self.reporter.start(self.plan, self.placement_line, self.built.schedule, self.start,
                            f"backend {c.parallel.backend}, transformer impl "
                            f"{c.model.transformer_impl}, fused kernels: "
                            f"{'apex' if _has('apex') else 'torch fallbacks (no apex)'}, packed "
                            f"messages: {comm.backend()}"
                            + (", sequence parallel" if c.parallel.sequence_parallel else ""),
                            c.elastic.strategy if c.elastic.enabled else None,
                            len(self.injector.job_specs))
        if c.training.skip_train:
            self.reporter.line(f"> --skip-train: evaluating iteration {self.iteration}, no "
                               "training")
            self.pending, self.stopped = ["eval"], ExitVerdict("--skip-train")
        while True:
            failure = None
            try:
                self._advance()
                break
            except StepFailure as f:
                failure = f.failure
            except NotNeeded as why:        # a planned leave
                return self._leave(why)
            except Spare:                   # a switch or an admission left this rank out
                pass
            # Outside the except block: its traceback would pin the broken groups (and the
            # state a spare dropped).
            try:
                if failure is None or not self._recover(failure):
                    self._stand_by()
            except NotNeeded as why:
                return self._leave(why)
        return self._finish()

    def _advance(self) -> None:
        """Steps and their boundaries' actions up to the end of the job; raises StepFailure."""
        while True:
            while self.pending:
                self.actions[self.pending[0]]()
                self.pending.pop(0)
            if self.iteration >= self.config.training.train_iters or self.stopped is not None:
                if self.finishing:
                    return
                self.finishing = True
                if self.reporter.lead:
                    self.elastic.trained(self.iteration)
                self.pending = self._final_actions()
                continue
            self.train_step(self.iteration + 1)
            self.pending = self._actions_after(self.iteration)

    def train_step(self, it: int) -> None:
        """Iteration `it` (1-based): run this rank's ops; the step is applied everywhere or
        nowhere (the executor's commit)."""
        ramp = self.config.training.ramp
        if ramp and ramp.global_batch(self.consumed) != self.plan.global_batch_size:
            self._rebatch(ramp.global_batch(self.consumed))
        self.injector.maybe_fire(it, "between-iterations")
        self.elastic.tick(it, "between-iterations",
                          allow_s=self.elastic.progress_allowance(self.reporter.times))
        ops = self.built.schedule.ops[self.rank]
        if self.profiler is not None:
            self.profiler.before(it, self.rank)
        failure = None
        try:
            res = self.built.executor.run(ops, it - 1)
        except RuntimeError as e:
            failure = self.elastic.notice(e, it)
        if failure is not None:  # outside the except block: its traceback would pin the groups
            self.elastic.drained(self.built.executor.drain(ops, self.elastic.lost_ranks(),
                                                             it - 1))
            self.built.executor.reset()
            raise StepFailure(failure)
        if self.config.training.empty_unused_memory_level and torch.cuda.is_available():
            torch.cuda.empty_cache()
        ms = self.watch.lap_ms()
        self.iteration, self.consumed = it, self.consumed + res.samples
        self.elastic.applied_step(it)
        if self.profiler is not None:
            self.profiler.after(it)
        if self.calibration is not None:
            self.calibration.after_iteration(ms)
            self.clock.iteration_ms.append(ms)
        if self.config.training.check_for_nan and not math.isfinite(res.loss):
            raise JobError(f"loss is {res.loss} at iteration {it}")
        log = self.config.logging
        if log.log_timers_to_tensorboard and it % log.log_interval == 0:
            self.reporter.tb.timers(self.timers, list(_OP_TIMERS), it, log.log_interval)
        params_norm, failure = None, None
        if log.log_params_norm and (it % log.log_interval == 0
                                    or it % log.tensorboard_log_interval == 0):
            try:
                params_norm = self._params_norm()
            except StepFailure as f:
                failure = f   # after this iteration's record: its step was applied everywhere
        self.reporter.iteration(
            it, res, ms, self.consumed, self.plan, self.strategy,
            _logged_lr(self.built.runtime.optimizer.param_groups),
            lambda: self.timers.get_all_timers_string(list(_OP_TIMERS),
                                                      normalizer=log.log_interval)
            if log.timing_log_level > 0 else "",
            lambda: float(self.built.runtime.optimizer.get_loss_scale()), params_norm)
        if failure is not None:
            raise failure

    def _params_norm(self) -> float:
        """--log-params-norm: the norm of the parameters as just stepped, an all-reduce of each
        rank's part over the world at the iteration's boundary (a peer lost in it is a failure
        of the next iteration, as in an evaluation)."""
        with self._boundary("between-iterations"):
            part = torch.tensor([optimizer_step.params_norm_part(
                self.built.runtime.optimizer)], dtype=torch.float64, device=_collective_device())
            dist.all_reduce(part)
        return math.sqrt(float(part))

    def _actions_after(self, it: int) -> list[str]:
        ckpt = self.config.checkpoint
        due = []
        if self.valid_loader and self.config.training.eval_interval and \
                it % self.config.training.eval_interval == 0:
            due.append("eval")
        if ckpt.save and ckpt.save_interval and it % ckpt.save_interval == 0:
            due.append("checkpoint")
        training = self.config.training
        if training.manual_gc and training.manual_gc_interval and \
                it % training.manual_gc_interval == 0:
            due.append("gc")
        if training.check_replicas_interval and it % training.check_replicas_interval == 0:
            due.append("weight-hash")
        if training.exit_interval or self.exits.voting:
            due.append("exit-check")
        if self.switch is not None and it == self.switch.at_iteration:
            due.append("switch")
        if self.elastic.admission_due(it, self.plan):
            due.append("admit")
        if self.reporter.lead:
            lost, left = self.elastic.lost_spares()
            for rank in lost:
                self.reporter.spare_lost(it, rank, left)
        return due

    def _final_actions(self) -> list[str]:
        ckpt = self.config.checkpoint
        due = ["shutting-down"]
        last = self.iteration
        if ckpt.save and last > self.start and \
                not (ckpt.save_interval and last % ckpt.save_interval == 0):
            due.append("checkpoint")
        if self.built.shadows is not None:
            due.append("shadows")
        if self.built.runtime.memory is not None:
            due.append("memory")
        if self.elastic.enabled:   # the promise a plan change keeps: replicas identical
            due.append("replicas")
        if self.emulation is not None:
            due.append("emulation")
        return due

    # ---- actions at iteration boundaries -----------------------------------------------------
    @contextmanager
    def _boundary(self, during: str, allow_s: float | None = None):
        """Work between steps whose collectives may fail: a lost peer becomes a Failure of the
        next iteration, and the work is done again in the new world."""
        self.elastic.tick(self.iteration, during, allow_s=allow_s)
        try:
            yield
        except RuntimeError as e:
            raise StepFailure(self.elastic.notice(e, self.iteration + 1, during)) from None

    def _shutting_down(self) -> None:
        self.injector.maybe_fire(self.iteration, "shutdown")
        self.reporter.prediction()

    def _evaluate(self) -> None:
        eval_iters = self.config.training.eval_iters
        allow = eval_iters * self.elastic.progress_allowance(self.reporter.times)
        with self._boundary("eval", allow):
            self.injector.maybe_fire(self.iteration, "eval")
            loss = self.built.executor.evaluate(self.built.eval_schedule.ops[self.rank],
                                                self.valid_loader.get,
                                                range(eval_iters))
        self.reporter.validation(self.iteration, loss)
        self._collect()
        self.watch.lap_ms()

    def _save(self) -> None:
        root, it = self.config.checkpoint.save, self.iteration
        with self._boundary("checkpoint", self.config.elastic.timeouts.save_s), \
                self._emulated_io(self.built.runtime):
            path = checkpointing.save(
                root, it, self.built.runtime, tied_embeddings=self.tied,
                group=self.built.groups.storage,
                meta={**self.model_meta, "consumed_samples": self.consumed,
                      "plan": self.plan.to_dict(),
                      "model_args": self.config.model.shape_args()},
                written=lambda: self.injector.maybe_fire(it, "checkpoint"),
                retain_interval=self.config.checkpoint.retain_interval)
        self.reporter.saved(it, path)
        self._collect()
        if self.calibration is not None and self.rank == 0:
            profile = self.calibration.profile(self.plan, self.elastic.alive)
            if profile is not None:
                profile.save(os.path.join(root, "profile.json"))
        self.watch.lap_ms()

    def _rebatch(self, global_batch: int) -> None:
        """--rampup-batch-size: the same layout, groups, model and optimizer with more
        micro-batches per iteration; only the schedules and the loaders change."""
        plan = self.plan.with_micro_batches(global_batch // self.plan.micro_batch_size)
        self.plan = self.built.runtime.plan = plan
        for loader in (self.train_loader, self.valid_loader):
            if loader is not None:
                loader.num_micro_batches = plan.num_micro_batches
        self.built = runtime.rebatch(self.built, plan)
        self.reporter.line(f"> global batch size {global_batch} from iteration "
                           f"{self.iteration + 1} ({plan.num_micro_batches} micro-batches)")

    def _collect(self) -> None:
        """--manual-gc: the garbage of evaluations and saves, collected after them."""
        if self.config.training.manual_gc:
            gc.collect()

    def _check_exit(self) -> None:
        """--exit-interval, --exit-duration-in-mins, --exit-signal-handler: stop the job (its
        final save follows), or this rank's planned leave (the others recover without it)."""
        with self._boundary("between-iterations"):
            verdict = self.exits.check(self.iteration)
        if verdict is None:
            return
        if not verdict.leavers:
            self.reporter.line(f"exiting after iteration {self.iteration}: {verdict.reason}")
            self.stopped = verdict
            return
        world = dist.get_rank()
        if world in verdict.leavers:
            raise NotNeeded(f"{verdict.reason}: a planned leave")
        gone = [self.elastic.alive[r] for r in verdict.leavers]
        raise StepFailure(self.elastic.notice(
            RuntimeError(f"launch rank(s) {gone} left on {verdict.reason}"), self.iteration + 1,
            "between-iterations"))

    def _switch(self) -> None:
        it, switch = self.iteration, self.switch
        self.switch = None
        t = self._transition(PlannedSwitch(switch), self.pending[1:])
        if not self._lost_during(t, "switch"):
            self.reporter.switched(t, it)

    def _admit(self) -> None:
        before = {*self.elastic.alive, *self.elastic.spares}
        t = self._transition(Admission(self.iteration), self.pending[1:])
        lost = self._lost_during(t, "admission")
        # Reported also when every joiner stands by as a spare (the world was rebuilt), unless
        # a loss made it a recovery, reported as one.
        if t.decision.joined or not lost:
            self.reporter.rejoined(t, self.iteration)
        # The planner's repair time, measured: each joiner back, in the plan or a spare,
        # repairs the oldest loss.
        self.clock.rejoined(len({*self.elastic.alive, *self.elastic.spares} - before))

    def _lost_during(self, t, during: str) -> bool:
        """Ranks lost during a planned transition make it a recovery: reported as one."""
        if not t.failed:
            return False
        self._record_loss(t)
        self.reporter.recovery(t, Failure(self.iteration + 1, t.first_notice,
                                          f"lost during the {during}", during),
                               self.iteration, self.built.schedule)
        return True

    def _record_loss(self, t) -> None:
        """The ranks transition `t` lost: each to be repaired by a joiner, and one failure in
        the planner's record."""
        if t.failed and self.clock is not None:
            self.clock.lost(time.time() - t.first_notice, len(t.failed))

    def _report_shadows(self) -> None:
        mine = (self.built.shadows.held_bytes,
                1e3 * self.timers(SHADOW_SYNC, log_level=2).active_time()
                / max(len(self.reporter.times), 1))
        with self._boundary("shutdown"):
            self.reporter.shadows(_gather(mine))

    def _report_emulation(self) -> None:
        with self._boundary("shutdown"):
            everyone = _gather(self.emulation.count)
        self.reporter.emulation(self.emulation.event(everyone))

    @staticmethod
    @contextmanager
    def _emulated_io(rt):
        """A checkpoint save or load of `rt`, padded to its emulated device's storage time."""
        began = time.perf_counter()
        yield
        if rt.emulation is not None:
            rt.emulation.checkpoint_io(began)

    def _report_memory(self) -> None:
        """Every rank's measured memory (training state, of it the optimizer's, shadow copies,
        the most activations held at once) beside the plan's estimate with the calibrated
        profile (none in a job without --chameleon: it measures only)."""
        rt = self.built.runtime
        optimizers = state_transfer.torch_optimizers(rt.optimizer)
        mine = {"state": memory_meter.state_bytes(rt.module, optimizers),
                # copies held for redundancy: eager's shadows, or the buddy shards
                "shadows": self.built.shadows.held_bytes if self.built.shadows else
                rt.buddy.held_bytes if rt.buddy else 0,
                "activations": rt.memory.peak_bytes,
                "optimizer": memory_meter.optimizer_bytes(optimizers)}  # part of state
        with self._boundary("shutdown"):
            everyone = _gather(mine)
        if self.rank != 0:
            return
        profile = self.calibration.profile(self.plan, self.elastic.alive) \
            if self.calibration is not None else None
        if profile is None and self.elastic.enabled:
            return
        estimate = predict_plan(self.plan, profile).memory_bytes if profile else {}
        held = redundancy.held_bytes(self.plan, profile.shape) \
            if profile and self.built.shadows else {}
        self.reporter.memory([
            {"rank": r, "measured_bytes": m["state"] + m["shadows"] + m["activations"],
             **{f"{k}_bytes": v for k, v in m.items()},
             "estimated_bytes": estimate[r] + held.get(r, 0) if profile else None}
            for r, m in enumerate(everyone)])

    def _check_replicas(self) -> None:
        with self._boundary("shutdown"):
            self.reporter.replicas(self._digests())

    def _digests(self) -> list[dict[str, str]]:
        """Every rank's digest of each tensor of its state, by global name (collective)."""
        # the distributed optimizer's last step left the other replicas' shards ungathered
        sharded_state.gather_parameters(self.built.runtime)
        return _gather(state_transfer.state_digests(self.built.runtime, self.tied))

    def _check_weight_hash(self) -> None:
        """--check-weight-hash-across-dp-replicas-interval: every rank sees every digest, so
        all stop together where a copy differs (Megatron-LM asserts)."""
        with self._boundary("between-iterations"):
            everyone = self._digests()
        differ = differing(everyone)
        self.reporter.weight_hash(self.iteration, len(everyone[0]), differ)
        if differ:
            raise JobError(f"the copies of {len(differ)} tensor(s) differ across replicas after "
                           f"iteration {self.iteration}: {', '.join(differ[:3])}")

    # ---- transitions -------------------------------------------------------------------------
    def _recover(self, failure: Failure) -> bool:
        """The transition after `failure`; False when it left this rank out (a spare)."""
        before = self.iteration
        try:
            t = self._transition(failure, list(self.pending))
        except Spare:
            return False
        self._record_loss(t)
        # Every stayer resumes the boundary where the least advanced one stood (Decision.pending)
        self.pending, self.finishing = list(t.decision.pending), t.decision.finishing
        resume = self.iteration
        if resume < before:   # a restart went back to its checkpoint: so do the actions
            self.pending, self.finishing = [], False
        self.reporter.recovery(t, failure, resume, self.built.schedule)
        self.reporter.moved_to(resume)
        if self.rank == 0:
            self.calibration.measured_transition(t.detect_ms,
                                                 1e3 * (time.time() - t.first_notice))
        return True

    def _transition(self, trigger, pending: list[str]):
        """The manager's transaction from the current world; this rank's state is captured
        once and entered by every attempt. `pending`: the actions this boundary still runs
        after it (a rank entering without state runs them too). Raises Spare."""
        carried = self._capture()
        handover = Handover(self.built.runtime.scheduler.state_dict(), self.consumed,
                            Boundary(tuple(pending), self.finishing))
        self.built = None
        try:
            t = self.elastic.reconfigure(trigger, self.plan, self._enter_with(carried),
                                         handover)
        except (Unrecoverable, MembershipError, state_transfer.StateLost,
                checkpointing.CheckpointError) as why:
            raise JobError(f"cannot go on in-process after iteration {self.iteration}: {why}") \
                from None
        self._entered(t)
        return t

    def _join(self) -> None:
        try:
            t = self.elastic.join(self._enter_with(None), self.config.elastic.timeouts.join_s)
        except NotNeeded as why:   # the job trained its last iteration before the admission
            self.left = why
            return
        except Spare:              # admitted, but the plan has no place for it: train() waits
            return
        except (Unrecoverable, MembershipError, state_transfer.StateLost) as why:
            raise JobError(f"cannot join the job: {why}") from None
        self._entered(t)
        self.start = self.iteration
        self.reporter.line(f"> launch rank {self.elastic.launch_rank} joined the job after iteration "
              f"{self.iteration}: rank {t.rank} of {t.plan.world_size}, generation "
              f"{t.plan.generation}")

    def _stand_by(self) -> None:
        """This rank is a spare: out of the world, its state dropped, alive until a transition
        gives it a place (it enters without state, like a joiner, and runs what the stayers
        still run at that boundary) or the job trained its last iteration (NotNeeded)."""
        self.built = None
        gc.collect()    # the dropped runtime's memory goes back while it waits
        print(f"> launch rank {self.elastic.launch_rank} stands by as a spare after iteration "
              f"{self.iteration}", flush=True)
        while True:
            try:
                t = self.elastic.stand_by(self._enter_with(None))
                break
            except Spare:
                continue
            except (Unrecoverable, MembershipError, state_transfer.StateLost) as why:
                raise JobError(f"cannot go on in-process as a spare: {why}") from None
        self._entered(t)
        self.pending, self.finishing = list(t.decision.pending), t.decision.finishing
        print(f"> launch rank {self.elastic.launch_rank} left the spares for the "
              f"{t.decision.strategy} plan after iteration {self.iteration}: rank {t.rank} of "
              f"{t.plan.world_size}, generation {t.plan.generation}"
              + (f" ({t.decision.why})" if t.decision.why else ""), flush=True)

    def _entered(self, t) -> None:
        self.plan, self.rank, self.iteration = t.plan, t.rank, t.entered.applied
        was_lead, self.reporter.lead = self.reporter.lead, t.rank == 0
        if self.reporter.lead and not was_lead:
            self.reporter.took_over(self.iteration)
        self.strategy = t.decision.strategy
        self.switch = t.decision.switch
        self.watch.lap_ms()

    def _capture(self) -> state_transfer.CarriedState | None:
        """What this rank carries into the next plan: its state, and its shadow copies."""
        if self.built is None:
            return None
        carried = state_transfer.capture(self.built.runtime, self.tied)
        if self.built.shadows is not None:
            self.built.shadows.add_to(carried)
        return carried

    def _enter_with(self, carried: state_transfer.CarriedState | None) -> Enter:
        def enter(decision: Decision, rank: int, agreed: int | None) -> Entered:
            if decision.restarts:
                built = self._build(decision.plan, rank)
                meta = self._load(built)
                applied = meta["iteration"] if meta else 0
                consumed = meta["consumed_samples"] if meta else 0
            else:
                # A joiner carries nothing: every layer, its Adam moments and the LR schedule
                # come from the ranks that stayed.
                state = carried if carried is not None else state_transfer.CarriedState(
                    {}, {}, decision.scheduler)
                built = self._build(decision.plan, rank, state, lambda: self.injector.maybe_fire(
                    self.iteration + 1, "transfer"))
                applied = agreed if agreed is not None else self.iteration
                consumed = self.consumed if carried is not None else decision.consumed_samples
            moved = _world_sum(built.received_bytes)   # the new world's first collective
            self._hold_copies(built)
            self.built, self.consumed = built, consumed
            return Entered(applied, moved)
        return enter

    def _hold_copies(self, built) -> None:
        """Buddy copies set up as a world is entered (collective over each replica group),
        while the whole parameters are current (initial, loaded or restored): a world that a
        transition commits always holds them, and a loss during their setup fails the attempt,
        which the transaction retries from the state carried in (the old world's copies
        included)."""
        if built.runtime.buddy is not None:
            self.injector.maybe_fire(self.iteration + 1, "copies")
            built.runtime.buddy.setup(built.runtime)

    def _build(self, plan: ExecutionPlan, rank: int, carried=None, on_transfer=None):
        built = runtime.build(plan, rank, self.spec, carried, on_transfer)
        if self.emulation is not None:
            self.emulation.transferred(built.received)
        if self.calibration is not None:
            self.calibration.start(plan, rank, built.schedule.ops[rank],
                                   built.shadows is not None, built.runtime.memory)
        return built

    def _load(self, built) -> dict | None:
        """The latest checkpoint of --save (else --load, unless it is --finetune's start) into
        `built`'s runtime (collective)."""
        ckpt = self.config.checkpoint
        root = ckpt.save or (None if ckpt.finetune else ckpt.load)
        if not root:
            return None
        with self._emulated_io(built.runtime):
            return checkpointing.load(root, built.runtime, tied_embeddings=self.tied,
                                      expect=self.model_meta, group=built.groups.storage)

    def _load_initial(self) -> None:
        ckpt = self.config.checkpoint
        root = ckpt.load
        try:
            with self._emulated_io(self.built.runtime):
                meta = checkpointing.load(root, self.built.runtime, tied_embeddings=self.tied,
                                          expect=self.model_meta, optimizer=ckpt.load_optim,
                                          scheduler=not ckpt.finetune)
        except checkpointing.CheckpointError as e:
            raise JobError(str(e), exit_code=2) from None
        if meta is None:
            self.reporter.line(f"no checkpoint found under {root}: training from scratch")
            return
        if ckpt.finetune:
            self.reporter.line(f"loaded the parameters of {root} (iteration "
                               f"{meta['iteration']}) to fine-tune from iteration 0")
            return
        self.start = self.iteration = meta["iteration"]
        self.consumed = meta.get("consumed_samples", self.iteration * self.plan.global_batch_size)
        self.elastic.applied_step(self.iteration)
        self.reporter.line(f"loaded checkpoint from {root} at iteration {self.start}")

    # ---- the end -----------------------------------------------------------------------------
    def _finish(self) -> dict:
        if self.profiler is not None:
            self.profiler.close()
        summary = self.reporter.summary(self.plan, self.start)
        self.reporter.close()
        self.built = None
        self.elastic.leave()
        return summary

    def _leave(self, why: NotNeeded) -> dict:
        """A survivor the new plan has no place for: it closes its logs and exits cleanly."""
        print(f"> leaving the job after iteration {self.iteration}: {why}", flush=True)
        if self.profiler is not None:
            self.profiler.close()
        self.reporter.close()
        self.elastic.leave()
        return {}


def _flops_per_sample(shape: ModelShape, model: ModelConfig) -> float:
    """The model's training FLOPs for one sample, as Megatron-LM's --log-throughput counts
    them: the forward three times (forward, and a backward of twice its cost), four with full
    recompute (the forward again)."""
    passes = 4 if model.recompute_granularity == "full" else 3
    forward = shape.num_layers * shape.layer_flops() + shape.head_flops()
    return passes * forward / shape.micro_batch_size


def _initialize_distributed(parallel: ParallelConfig,
                            manager: ElasticManager | DisabledManager) -> int:
    if parallel.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        return manager.initialize_world(parallel.distributed_timeout_s)
    except PeerLost as e:
        raise JobError(f"a rank was lost while the job started: {e}") from None


def scheduler_settings(training: TrainingConfig) -> runtime.SchedulerSettings:
    """The LR and weight-decay schedule of the flags, in samples as megatron-core counts."""
    return runtime.SchedulerSettings(
        training.lr, training.min_lr, *training.schedule_samples(), training.lr_decay_style,
        training.start_weight_decay, training.end_weight_decay, training.wd_incr_samples,
        training.weight_decay_incr_style, training.wsd_samples, training.lr_wsd_decay_style,
        override=training.override_schedule, use_checkpoint=training.checkpoint_schedule)


def _logged_lr(param_groups: list[dict]) -> float:
    """The learning rate Megatron-LM logs: a group on the default schedule's (not
    --decoupled-lr's, which only the embedding and output layer follow)."""
    return next((g["lr"] for g in param_groups if g.get("default_config", True)),
                param_groups[0]["lr"])


def _set_random_seeds(seed: int, tp_rank: int) -> None:
    import random

    import numpy as np
    from megatron.core import tensor_parallel
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # The ranks given, not read from megatron-core's globals (the plan's groups are passed to
    # megatron-core, never installed); no expert parallelism: its tensor-parallel rank is ours.
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0,
                                                    etp_rank=tp_rank, force_reset_rng=True)


def _gather(mine) -> list:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _collective_device() -> str:
    """Where a tensor the world's backend reduces lives."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _world_sum(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t)
    return int(t.item())


def _slowed(injector: Injector):
    """after_op of a rank with a `slow` fault: its compute ops take `factor` times as long."""
    def after_op(op, iteration: int, elapsed_s: float) -> None:
        if op.kind in COMPUTE:
            injector.maybe_fire(iteration + 1, PHASE_OF[op.kind], elapsed_s=elapsed_s)
    return after_op


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None
