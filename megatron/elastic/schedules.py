"""Executor of the schedule IR on a megatron-core model chunk.

Runs one rank's op list of one iteration: forward and backward of global micro-batches on the
stage model, point-to-point activations and gradients with torch.distributed (sends posted
asynchronously, receives blocking, one tag per (micro-batch, direction): the semantics the
simulator assumes), gradient reduction with megatron-core's DistributedDataParallel over the
stage's replicas plus the tied-embedding sum, and the megatron-core optimizer step.

The loss of micro-batch g is its token-mean divided by the global micro-batch count (with
--calculate-per-token-loss: the sum of its tokens' losses, the gradients divided by the global
batch's token count after the commit, as megatron-core's finalize_model_grads divides them), and
gradients are summed (not averaged) over replicas, so the update is the same under every plan.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed.finalize_model_grads import (
    _allreduce_non_tensor_model_parallel_grads,
)

from chameleon_ext.comm import packed as comm
from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.schedule.ir import COMPUTE, RECV_OF, FusedMessage, Op, OpKind, Schedule
from megatron.elastic import optimizer_step, sharded_state
from megatron.elastic.emulation import EmulatedDevice
from megatron.elastic.grad_reduction import GradReduction
from megatron.elastic.wgrad import WeightGradStore

# forward_step(batch, model) -> output; loss_func(batch, output) -> token-mean loss (scalar)
ForwardStep = Callable[[dict | None, torch.nn.Module], torch.Tensor]
LossFunc = Callable[[dict, torch.Tensor], torch.Tensor]

TIMER_OF = {
    OpKind.RECV_FWD: "forward-recv", OpKind.FWD: "forward-compute", OpKind.SEND_FWD: "forward-send",
    OpKind.RECV_BWD: "backward-recv", OpKind.BWD: "backward-compute",
    OpKind.BWD_INPUT: "backward-input", OpKind.BWD_WEIGHT: "backward-weight",
    OpKind.SEND_BWD: "backward-send", OpKind.REDUCE_GRADS: "grads-all-reduce",
    OpKind.OPT_STEP: "optimizer",
}
# The ops that run the layers (and so the tensor-parallel group's collectives).
_LAYER_COMPUTE = (OpKind.FWD, OpKind.BWD, OpKind.BWD_INPUT, OpKind.BWD_WEIGHT)
SHADOW_SYNC = "shadow-sync"  # eager redundancy's refresh, before an iteration's first op


@dataclass
class StepResult:
    loss: float              # global mean loss of the iteration (same on every rank)
    grad_norm: float | None
    update_successful: bool
    samples: int = 0         # samples the data loader delivered to the world's first stages
    num_zeros: float | None = None   # zero gradient entries (--log-num-zeros-in-grad)


@dataclass(frozen=True)
class Committed:
    """What the commit's all-reduce and vote settle for every rank."""

    loss: float              # the iteration's global mean loss
    samples: int
    grad_norm: float         # of the gradients as they are stepped (after grad_scale)
    grad_scale: float        # what the gradients still take: 1, or per token 1 / the tokens
    zeros: float | None      # zero gradient entries, when counted


class StepAborted(RuntimeError):
    """The step's commit vote failed: no rank applies this iteration's step."""


@dataclass
class ComputeClock:
    """CPU seconds of a rank's compute ops by timer name, cumulative over its runtimes: on a
    CPU host, their cost without the other ranks sharing its cores (calibration)."""

    cpu_s: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.cpu_s[name] = self.cpu_s.get(name, 0.0) + seconds


def _no_op(*_) -> None:
    pass


def _key(op: Op) -> tuple[int, int]:
    """Where an op's activations and gradients are kept: its micro-batch and its stage (a
    rank of an interleaved plan holds a micro-batch in each of its chunks)."""
    return op.microbatch, op.stage


def _every_rank_applies(iteration: int) -> bool:
    return True


@dataclass(frozen=True)
class StepHooks:
    """What the executor calls besides its ops: the elastic manager's (failure injection,
    progress, the commit vote) and a fault injector's. The defaults do nothing and commit
    every step: a plain job's step, whose world all-reduce before the step is the commit."""

    # (op, iteration): before each op; may raise to stop an iteration that cannot complete
    before_op: Callable[[Op, int], None] = _no_op
    # (iteration): the step's commit vote; True when every rank applies the step
    commit: Callable[[int], bool] = _every_rank_applies
    # (iteration, phase, waiting): progress inside an op (the commit's collective and vote)
    tick: Callable[[int, str, bool], None] = _no_op
    # (op, iteration, seconds it took), inside the op's timer: a slowed rank stretches its ops
    after_op: Callable[[Op, int, float], None] = _no_op


@dataclass
class StageRuntime:
    """Everything one rank needs to run its ops under one plan."""

    rank: int
    plan: ExecutionPlan
    model: torch.nn.Module                # megatron-core DDP around the stage model
    module: torch.nn.Module               # the stage model itself
    optimizer: object                     # megatron-core MegatronOptimizer
    scheduler: object                     # megatron-core OptimizerParamScheduler
    get_batch: Callable[[int, int], dict]  # (iteration, global micro-batch) -> batch
    forward_step: ForwardStep
    loss_func: LossFunc
    activation_shape: tuple[int, ...]     # [seq, micro batch, hidden]
    activation_dtype: torch.dtype
    embedding_group: dist.ProcessGroup | None = None
    tied_weight: torch.nn.Parameter | None = None
    embedding_contributor: bool = True  # adds its tied-embedding gradient in its group
    before_forward: Callable[[int, int], None] | None = None  # (iteration, mb): dropout seeding
    hooks: StepHooks = field(default_factory=StepHooks)
    clip_grad: float = 0.0
    wgrad: WeightGradStore | None = None  # set when the schedule splits backwards
    timers: object | None = None
    # A misaligned plan's gradient all-reduces (per segment of layers, embeddings, final norm,
    # tied embedding), run after DDP's, whose group is then this rank alone; None: DDP over
    # the stage's replicas plus the tied-embedding sum do it all.
    grad_reduction: GradReduction | None = None
    compute_clock: ComputeClock | None = None
    shadows: object | None = None  # megatron.elastic.shadows.Shadows: refreshed first
    memory: object | None = None   # megatron.elastic.memory_meter.MemoryMeter
    emulation: EmulatedDevice | None = None  # ops padded to an emulated device's times
    # Every stage reads the batch (--reset-attention-mask: each layer needs the documents'
    # attention mask); else only the first (tokens) and the last (labels).
    every_stage_reads: bool = False
    # --calculate-per-token-loss: the iteration's loss is its tokens' mean, not the mean of
    # its micro-batches' token means
    per_token_loss: bool = False
    count_zeros: bool = False  # --log-num-zeros-in-grad
    # The distributed optimizer stepped this rank's shards after the last gather of the whole
    # parameters (sharded_state.gather_parameters brings the other replicas' shards).
    params_behind: bool = False
    buddy: object | None = None    # megatron.elastic.buddy_copies.BuddyCopies
    # An interleaved plan's model chunks: stage index -> its stage model (`module` holds them
    # all, for DDP and the optimizer); empty where the rank holds one stage
    chunks: dict[int, torch.nn.Module] = field(default_factory=dict)
    first: bool = field(init=False)
    last: bool = field(init=False)

    def __post_init__(self) -> None:
        self.first = self.plan.is_first_stage(self.rank)
        self.last = self.plan.is_last_stage(self.rank)

    def chunk(self, stage: int) -> tuple[torch.nn.Module, bool, bool]:
        """The stage model an op of `stage` runs on (-1: the rank's one stage), and whether
        it is its pipeline's first and last stage."""
        if stage < 0:
            return self.module, self.first, self.last
        return (self.chunks[stage], stage == 0,
                stage == len(self.plan.pipeline_of(self.rank).stages) - 1)


class Executor:
    """`schedule`: the training schedule whose fused messages run() packs (evaluation sends
    every tensor on its own)."""

    def __init__(self, rt: StageRuntime, schedule: Schedule | None = None) -> None:
        self.rt = rt
        fused = schedule or Schedule({})
        self._fused_sends = fused.fused_sends(rt.rank)
        self._fused_recvs = fused.fused_recvs(rt.rank)
        self._sends: dict[Op, FusedMessage] = {}    # those in use by the op list running now
        self._recvs: dict[Op, FusedMessage] = {}
        self._outbox: dict[FusedMessage, list[torch.Tensor]] = {}
        self._inbox: dict[Op, torch.Tensor] = {}    # receive op -> its tensor, already here
        # by (micro-batch, stage): _key
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._out_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._in_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._pending: list = []
        self._position = 0
        self._started = False  # whether the op at _position began (before_op may refuse it)
        self._grads_synced = False
        self._tp_sum_began = False
        self._draining = False  # computing a drained op (see drain): nothing is measured
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=_device())
        self._tokens = 0.0  # counted in this rank's losses (--calculate-per-token-loss)
        self._samples = 0  # delivered to this rank's first-stage forwards in this iteration

    def run(self, ops: list[Op], iteration: int) -> StepResult:
        rt = self.rt
        self._sends, self._recvs = self._fused_sends, self._fused_recvs
        self._position, self._started = 0, False  # a failed refresh drains the whole list
        self.refresh()
        ok = True
        done = Committed(float("nan"), 0, float("nan"), 1.0, None)
        for self._position, op in enumerate(ops):
            self._started = False
            rt.hooks.before_op(op, iteration)
            self._started = True
            timer = rt.timers(TIMER_OF[op.kind], log_level=2) if rt.timers else None
            if op.kind is OpKind.OPT_STEP:
                self._check_finished()
                parts = self._timed(timer, iteration, optimizer_step.prepare, rt.optimizer,
                                    rt.count_zeros)
                # The commit: outside the optimizer's timer (it waits for the slowest rank).
                done = self._commit(iteration, parts)
                ok = self._timed(timer, iteration, self._apply_step, done)
                continue
            if timer:
                timer.start()
            began, cpu_began = time.perf_counter(), time.thread_time()
            try:
                self._DISPATCH[op.kind](self, op, iteration)
                if rt.compute_clock and op.kind in COMPUTE:
                    rt.compute_clock.add(TIMER_OF[op.kind], time.thread_time() - cpu_began)
                if rt.emulation and op.kind in COMPUTE:
                    rt.emulation.computed(op, began)
                rt.hooks.after_op(op, iteration, time.perf_counter() - began)
            finally:  # a failed op must not leave its timer running into the re-run
                if timer:
                    timer.stop()
        return self._result(done, ok)

    @staticmethod
    def _result(done: Committed, ok: bool) -> StepResult:
        return StepResult(loss=done.loss, grad_norm=None if math.isnan(done.grad_norm)
                          else done.grad_norm, update_successful=bool(ok),
                          samples=done.samples, num_zeros=done.zeros)

    def refresh(self) -> None:
        """What an iteration needs before its first op, collectives included: the whole
        parameters (the distributed optimizer's shards stepped last iteration; with
        --overlap-param-gather the forwards' hooks gather them), zeroed gradients, and eager
        redundancy's shadow copies."""
        rt = self.rt
        if not rt.model.ddp_config.overlap_param_gather:
            sharded_state.gather_parameters(rt)
        rt.model.zero_grad_buffer()
        rt.optimizer.zero_grad()
        self._loss_sum.zero_()
        self._tokens = 0.0
        self._samples = 0
        if rt.shadows is not None:
            timer = rt.timers(SHADOW_SYNC, log_level=2) if rt.timers else None
            if timer:
                timer.start()
            began = time.perf_counter()
            try:
                rt.shadows.sync()
                if rt.emulation:
                    rt.emulation.refreshed(began)
            finally:
                if timer:
                    timer.stop()

    def _timed(self, timer, iteration: int, fn, *args):
        rt = self.rt
        if timer:
            timer.start()
        began, cpu_began = time.perf_counter(), time.thread_time()
        try:
            out = fn(*args)
            if rt.compute_clock:
                rt.compute_clock.add(TIMER_OF[OpKind.OPT_STEP], time.thread_time() - cpu_began)
            rt.hooks.after_op(Op(OpKind.OPT_STEP), iteration, time.perf_counter() - began)
            return out
        finally:
            if timer:
                timer.stop()

    def _commit(self, iteration: int, parts: optimizer_step.GradParts) -> Committed:
        """The step's commit point. One all-reduce over the world sums the last stages' losses
        (and the tokens they counted), the ranks' parts of the squared gradient norm (and of
        its zeros) and the samples delivered: the iteration's last collective, after which no
        rank talks to another before it applies the step. Then the vote (rt.hooks.commit):
        every rank applies the step iff all voted, so a rank lost at any instant leaves the
        survivors all stepped or all not. Raises StepAborted."""
        rt = self.rt
        rt.hooks.tick(iteration, "commit collective", True)
        mine = rt.last and rt.plan.position(rt.rank).tp_rank == 0
        t = torch.tensor([float(self._loss_sum) if mine else 0.0, parts.norm_sq,
                          float(self._samples), self._tokens if mine else 0.0, parts.zeros],
                         dtype=torch.float64, device=_device())
        self._wait_sends()
        dist.all_reduce(t)
        loss_sum, total_sq, samples, tokens, zeros = t.tolist()
        rt.hooks.tick(iteration, "commit vote", True)
        if not rt.hooks.commit(iteration):
            raise StepAborted(f"the step of iteration {iteration + 1} was not committed: a "
                              "rank did not vote")
        rt.hooks.tick(iteration, "optimizer step", False)
        total, count = self._loss_total(loss_sum, tokens)
        scale = 1.0 / count if rt.per_token_loss else 1.0
        return Committed(total / count, round(samples), math.sqrt(total_sq) * scale, scale,
                         zeros if rt.count_zeros else None)

    def _loss_total(self, loss_sum: float, tokens: float) -> tuple[float, float]:
        """The world's sums of the last stages' losses and tokens as (a loss total, what it
        totals): (the token losses' sum, the tokens) with --calculate-per-token-loss, else
        (the micro-batches' mean, 1)."""
        if self.rt.per_token_loss:
            return loss_sum, max(tokens, 1.0)
        return loss_sum / self.rt.plan.num_micro_batches, 1.0

    def _check_finished(self) -> None:
        if (self._inputs or self._outputs or self._out_grads or self._in_grads
                or self._outbox or self._inbox or (self.rt.wgrad and self.rt.wgrad.pending)):
            left = sorted({mb for mb, _ in set(self._inputs) | set(self._outputs)})
            raise RuntimeError(f"rank {self.rt.rank}: micro-batches left unfinished by the "
                               f"schedule: {left}")

    def drain(self, ops: list[Op], lost: set[int], iteration: int) -> list:
        """After a failure at op `_position` of `iteration` (0-based; or before it began: a
        peer's failure seen on the store): take part in the rest of the iteration's
        communication, so that live peers do not wait on this rank until a timeout (gloo
        cannot interrupt a blocked operation). Every send still owed to a live peer gets a
        placeholder; a gradient collective is joined only when none of its members is in `lost`
        (else it cannot complete, and joining it would hold this rank, and the peers waiting
        for it elsewhere, until the timeout); receives are skipped, and so is the world loss
        sum, which contains the lost rank: it fails on every survivor, so no one steps.

        Forwards and backwards are skipped too, except in a tensor-parallel group with no lost
        member: there they hold the group's own collectives, and its members stop at different
        ops (each sees a peer's failure on the store at its own moment; one's receive fails on
        a lost pipeline peer while its sibling's peer sends a placeholder). A member that
        skipped them would meet its sibling's next forward or backward collective with the
        gradient sum over the group, and gloo aborts the process on the size mismatch (seen
        under load: "4096 vs 768", a sequence-parallel gather against that sum). So such a
        group's members compute every remaining forward and backward, on placeholders, without
        the data-parallel hooks. Errors are expected and ignored. The placeholders' values
        never matter: the iteration runs again. Returns the placeholder sends: they must stay
        referenced until the groups are destroyed (a dropped gloo send is withdrawn before it
        is delivered)."""
        rt = self.rt
        sends = []
        # DDP's group: the stage's replicas, or this rank alone in a misaligned plan (whose
        # segment groups are joined one by one below, each only when it has no lost member).
        ddp_ok = not lost & set([rt.rank] if rt.grad_reduction is not None
                                else rt.plan.replicas(rt.rank))
        embd_ok = rt.embedding_group is not None and \
            not lost & set(dist.get_process_group_ranks(rt.embedding_group))
        tp_ranks = set(dist.get_process_group_ranks(rt.module.pg_collection.tp))
        tp_ok = not lost & tp_ranks
        failed_op = ops[self._position] if self._started else None
        reduce_op = failed_op is not None and failed_op.kind is OpKind.REDUCE_GRADS
        # A forward or backward that failed midway left the group's collectives at an unknown
        # point: none is computed after it.
        compute = tp_ok and len(tp_ranks) > 1 and \
            not (failed_op is not None and failed_op.kind in _LAYER_COMPUTE)
        # The replicas' first forward gathers the stepped shards in its hooks: joined if this
        # rank's had not finished (after it, a group not dispatched is next iteration's).
        first_fwd = next((i for i, op in enumerate(ops) if op.kind is OpKind.FWD), -1)
        if ddp_ok and rt.model.ddp_config.overlap_param_gather and self._position <= first_fwd:
            try:
                _join_param_sync(rt.model)
            except RuntimeError:
                pass
        for op in ops[self._position + (1 if self._started and not reduce_op else 0):]:
            if compute and op.kind in _LAYER_COMPUTE:
                try:
                    self._compute_placeholder(op, iteration)
                except RuntimeError:
                    compute = False   # a member was lost meanwhile: nothing more to pair up
                continue
            try:
                if op.kind in (OpKind.SEND_FWD, OpKind.SEND_BWD) and op.peer not in lost:
                    msg = self._sends.get(op)
                    if msg is not None and op != msg.members[-1]:
                        continue  # one placeholder per fused message, at its last member
                    n = len(msg.members) if msg else 1
                    zeros = [self._placeholder() for _ in range(n)]
                    buf = comm.pack(zeros) if msg else zeros[0]
                    tag = msg.tag() if msg else op.message_tag()
                    sends.append(dist.isend(buf, dst=op.peer, tag=tag))
                elif op.kind is OpKind.REDUCE_GRADS:
                    # The failed op itself, if it is this one: its replica-group part is over.
                    if ddp_ok and op is not failed_op:
                        _join_grad_sync(rt.model)
                    if rt.grad_reduction is not None:
                        rt.grad_reduction.drain(lost, resume=op is failed_op
                                                and self._grads_synced)
                    elif embd_ok and not (op is failed_op and self._grads_synced):
                        self._reduce_embedding()
                    if tp_ok and not (op is failed_op and self._tp_sum_began):
                        self._sum_over_tensor_parallel()
            except RuntimeError:
                continue
        # Not waited for: a receiver still blocked gets either its placeholder or, once this
        # rank drops its groups, a closed connection; one that drains never asks for it.
        return sends

    def _placeholder(self) -> torch.Tensor:
        """Zeros in the shape of an activation message: what a drain sends, or computes on
        where it skipped a receive."""
        return torch.zeros(self.rt.activation_shape, dtype=self.rt.activation_dtype,
                           device=_device())

    def _compute_placeholder(self, op: Op, iteration: int) -> None:
        """A drained forward or backward: its inputs or output gradients zeros where their
        receives were skipped, no data-parallel collective dispatched from its hooks (DDP's
        gradient hooks counting nothing under no_sync, the parameter gathers' forward hooks
        off: `drain` joins those groups itself, or not at all), no memory measured."""
        rt, key = self.rt, _key(op)
        _, first, last = rt.chunk(op.stage)
        if op.kind is OpKind.FWD and not first and key not in self._inputs:
            self._inputs[key] = self._placeholder().requires_grad_()
        if op.kind in (OpKind.BWD, OpKind.BWD_INPUT) and not last and \
                key not in self._out_grads:
            self._out_grads[key] = self._placeholder()
        hooks_on = bool(getattr(rt.model, "remove_forward_pre_hook_handles", None))
        if hooks_on:
            rt.model.disable_forward_pre_hook(param_sync=False)
        self._draining = True
        try:
            with rt.model.no_sync():
                self._DISPATCH[op.kind](self, op, iteration)
        finally:
            self._draining = False
            if hooks_on:
                rt.model.enable_forward_pre_hook()

    def reset(self) -> None:
        """Drop everything of an interrupted iteration (activations, received tensors, sends)."""
        for buf in (self._inputs, self._outputs, self._out_grads, self._in_grads, self._outbox,
                    self._inbox):
            buf.clear()
        self._pending.clear()
        if self.rt.wgrad:
            self.rt.wgrad.clear()
        if self.rt.memory:
            self.rt.memory.reset()

    def evaluate(self, ops: list[Op], get_batch: Callable[[int, int], dict],
                 iterations) -> float:
        """Mean loss of forward-only `ops` over the given iterations of `get_batch`'s data."""
        rt = self.rt
        sharded_state.gather_parameters(rt)
        train_get, rt.get_batch = rt.get_batch, get_batch
        self._sends, self._recvs = {}, {}
        rt.model.eval()
        total, n = 0.0, 0.0
        try:
            with torch.no_grad():
                for it in iterations:
                    self._loss_sum.zero_()
                    self._tokens = 0.0
                    for op in ops:
                        self._DISPATCH[op.kind](self, op, it)
                    self._outputs.clear()
                    self._inputs.clear()
                    self._wait_sends()
                    loss_sum, count = self._global_loss()
                    total += loss_sum
                    n += count
        finally:
            rt.get_batch = train_get
            rt.model.train()
        return total / max(n, 1.0)

    def _global_loss(self) -> tuple[float, float]:
        """One SUM over the world of the last stages' partial sums, as _loss_total."""
        rt = self.rt
        mine = rt.last and rt.plan.position(rt.rank).tp_rank == 0
        t = torch.tensor([float(self._loss_sum), self._tokens] if mine else [0.0, 0.0],
                         dtype=torch.float64, device=_device())
        dist.all_reduce(t)
        return self._loss_total(*t.tolist())

    def _wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # ---- ops ----------------------------------------------------------------------------------
    def _recv(self, op: Op) -> torch.Tensor:
        msg = self._recvs.get(op)
        if msg is None:
            buf = torch.empty(self.rt.activation_shape, dtype=self.rt.activation_dtype,
                              device=_device())
            dist.recv(buf, src=op.peer, tag=op.message_tag())
            if self.rt.emulation:
                self.rt.emulation.received(op)
            return buf
        if op not in self._inbox:  # the message's first member: all of them arrive now
            spec = (self.rt.activation_shape, self.rt.activation_dtype)
            buf = torch.empty(comm.packed_nbytes([spec] * len(msg.members)), dtype=torch.uint8,
                              device=_device())
            dist.recv(buf, src=msg.src, tag=msg.tag())
            if self.rt.emulation:
                self.rt.emulation.received(op)
            for member, tensor in zip(msg.members, comm.unpack(buf)):
                self._inbox[Op(RECV_OF[member.kind], member.microbatch, msg.src)] = tensor
        return self._inbox.pop(op)

    def _send(self, tensor: torch.Tensor, op: Op) -> None:
        msg = self._sends.get(op)
        if msg is None:
            self._pending.append((dist.isend(tensor.contiguous(), dst=op.peer,
                                             tag=op.message_tag()), tensor))
            return
        box = self._outbox.setdefault(msg, [])
        box.append(tensor)
        if len(box) == len(msg.members):  # its last member: the whole message leaves now
            del self._outbox[msg]
            buf = comm.pack(box)
            self._pending.append((dist.isend(buf, dst=msg.dst, tag=msg.tag()), buf))

    def _recv_fwd(self, op: Op, iteration: int) -> None:
        self._inputs[_key(op)] = self._recv(op).requires_grad_()

    def _fwd(self, op: Op, iteration: int) -> None:
        rt = self.rt
        mb, key = op.microbatch, _key(op)
        module, first, last = rt.chunk(op.stage)
        reads = first or last or rt.every_stage_reads
        batch = to_device(rt.get_batch(iteration, mb)) if reads else None
        if first and rt.model.training and rt.plan.position(rt.rank).tp_rank == 0:
            self._samples += int(batch["tokens"].shape[0])
        if rt.before_forward:
            rt.before_forward(iteration, mb)
        module.set_input_tensor(self._inputs.get(key))
        measured = rt.memory and rt.model.training and not self._draining and \
            rt.memory.measuring(iteration)
        with rt.memory.forward(mb) if measured else nullcontext():
            # a chunk's own forward (DDP's forward calls its module's; an interleaved rank's
            # module holds every chunk)
            out = rt.forward_step(batch, rt.model if op.stage < 0 else module)
            if last:
                out = self._weighted_loss(rt.loss_func(batch, out), batch)
        self._outputs[key] = out

    def _weighted_loss(self, mean: torch.Tensor, batch: dict) -> torch.Tensor:
        """A micro-batch's token-mean `mean` added to the sums the commit reduces (the mean, or
        with --calculate-per-token-loss its tokens' sum and their count), and returned as the
        tensor its backward starts from: the mean over the micro-batch count, or the tokens'
        sum (the commit divides the gradients by the batch's tokens)."""
        rt = self.rt
        if rt.per_token_loss:
            count = batch["loss_mask"].sum()
            mean = mean * count
            self._tokens += float(count)
        self._loss_sum += mean.detach().double()
        return mean if rt.per_token_loss else mean / rt.plan.num_micro_batches

    def _send_fwd(self, op: Op, iteration: int) -> None:
        self._send(self._outputs[_key(op)].detach(), op)

    def _recv_bwd(self, op: Op, iteration: int) -> None:
        self._out_grads[_key(op)] = self._recv(op)

    def _bwd(self, op: Op, iteration: int) -> None:
        mb, key = op.microbatch, _key(op)
        if self.rt.before_forward:  # activation recompute runs this micro-batch's forward again
            self.rt.before_forward(iteration, mb)
        out = self._outputs.pop(key)
        torch.autograd.backward(out, grad_tensors=self._out_grads.pop(key, None))
        if self.rt.memory and op.kind is OpKind.BWD:
            self.rt.memory.backward_done(mb)
        inp = self._inputs.pop(key, None)
        if inp is not None and not self.rt.chunk(op.stage)[1]:
            self._in_grads[key] = inp.grad

    def _bwd_input(self, op: Op, iteration: int) -> None:
        self.rt.wgrad.deferring = op.microbatch
        try:
            self._bwd(op, iteration)
        finally:
            self.rt.wgrad.deferring = None

    def _bwd_weight(self, op: Op, iteration: int) -> None:
        self.rt.wgrad.compute(op.microbatch)
        if self.rt.memory:
            self.rt.memory.backward_done(op.microbatch)

    def _send_bwd(self, op: Op, iteration: int) -> None:
        self._send(self._in_grads.pop(_key(op)), op)

    def _reduce_grads(self, op: Op, iteration: int) -> None:
        self._grads_synced = self._tp_sum_began = False
        if self.rt.buddy is not None:
            self.rt.buddy.reduce_gradients(self.rt.model)  # and the buddies' messages
        else:
            self.rt.model.finish_grad_sync()
        self._grads_synced = True
        if self.rt.grad_reduction is not None:
            self.rt.grad_reduction.run()  # misaligned plan: sums per segment, in global order
        else:
            self._reduce_embedding()
        self._tp_sum_began = True
        self._sum_over_tensor_parallel()
        if self.rt.buddy is not None:
            self.rt.buddy.send_late()   # the gradients summed again; all messages complete
        if self.rt.emulation:
            self.rt.emulation.reduced()

    def _reduce_embedding(self) -> None:
        rt = self.rt
        if rt.embedding_group is not None:
            # Replicas hold identical summed gradients now; one first-stage and one last-stage
            # rank per group contribute, so every copy gets embedding + output gradient once.
            grad = rt.tied_weight.main_grad
            if not rt.embedding_contributor:
                grad.zero_()
            dist.all_reduce(grad, group=rt.embedding_group)

    def _sum_over_tensor_parallel(self) -> None:
        # megatron-core's finalize_model_grads step that DDP lacks: the parameters every TP rank
        # holds whole but computes from part of the data (under sequence parallelism the norms,
        # row-parallel biases and MoE routers see this rank's rows; q/k norms this rank's heads)
        # get the sum over the TP group, so that every rank steps them alike.
        _allreduce_non_tensor_model_parallel_grads([self.rt.model], self.rt.module.config,
                                                   self.rt.module.pg_collection.tp)

    def _apply_step(self, done: Committed) -> bool:
        began = time.perf_counter()
        ok = optimizer_step.apply(self.rt.optimizer, done.grad_norm, self.rt.clip_grad,
                                  done.grad_scale)
        self.rt.params_behind = sharded_state.is_sharded(self.rt.optimizer)
        if self.rt.buddy is not None:
            self.rt.buddy.step(done.grad_norm, self.rt.clip_grad, done.grad_scale)
        if self.rt.shadows is not None:
            self.rt.shadows.stepped()
        if ok:
            self.rt.scheduler.step(increment=self.rt.plan.global_batch_size)
        if self.rt.emulation:
            # The step's emulated cost is here: its preparation (the local grad norm) is
            # short, and the commit between the two is a wait on the other ranks.
            self.rt.emulation.computed(Op(OpKind.OPT_STEP), began)
        return ok

    _DISPATCH = {
        OpKind.RECV_FWD: _recv_fwd, OpKind.FWD: _fwd, OpKind.SEND_FWD: _send_fwd,
        OpKind.RECV_BWD: _recv_bwd, OpKind.BWD: _bwd, OpKind.SEND_BWD: _send_bwd,
        OpKind.BWD_INPUT: _bwd_input, OpKind.BWD_WEIGHT: _bwd_weight,
        OpKind.REDUCE_GRADS: _reduce_grads,
    }


def _join_param_sync(model) -> None:
    """Take part in the replica group's gather of the stepped shards (--overlap-param-gather)
    from wherever this rank's forwards stopped. DDP's forward pre-hooks finish each bucket
    group's all-gather as the first forward reaches it and dispatch the next one's; here every
    group is finished in that chain's order (megatron-core's next_param_gather_bucket_group),
    which for a group already gathered does nothing, so the replicas' collectives pair up."""
    groups = model.bucket_groups + model.expert_parallel_bucket_groups
    followers = {id(g.next_param_gather_bucket_group) for g in groups}
    for group in groups:
        if id(group) in followers:
            continue
        while group is not None:   # a chain's head, then its followers
            group.finish_param_sync()
            group = group.next_param_gather_bucket_group


def _join_grad_sync(model) -> None:
    """Take part in the replica group's gradient reduction from wherever this rank's backward
    stopped. With --overlap-grad-reduce DDP's backward hooks dispatch each bucket once every
    gradient of it is in as often as in the first iteration (megatron-core's golden counts);
    the buckets an interrupted backward never dispatched are dispatched here, in bucket order,
    which is the order a backward dispatches them (megatron-core fills buckets from the last
    parameters), so the replicas' collectives pair up; then all are waited for. (In the first
    iteration every bucket is reduced by finish_grad_sync itself.)"""
    if model.ddp_config.overlap_grad_reduce:
        for group in model.bucket_groups + model.expert_parallel_bucket_groups:
            if not group.is_first_batch and \
                    group.per_param_grad_ready_counts != group.golden_per_param_grad_ready_counts:
                group.start_grad_sync()
    model.finish_grad_sync()


def to_device(batch: dict) -> dict:
    dev = _device()
    return {k: v.to(dev, non_blocking=True) for k, v in batch.items()} if dev.type != "cpu" \
        else batch


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
