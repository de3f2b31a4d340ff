"""Executor of the schedule IR on a megatron-core model chunk.

Runs one rank's op list of one iteration: forward and backward of global micro-batches on the
stage model, point-to-point activations and gradients with torch.distributed (sends posted
asynchronously, receives blocking, one tag per (micro-batch, direction): the semantics the
simulator assumes), gradient reduction with megatron-core's DistributedDataParallel over the
stage's replicas plus the tied-embedding sum, and the megatron-core optimizer step.

The loss of micro-batch g is its token-mean divided by the global micro-batch count, and gradients
are summed (not averaged) over replicas, so the update is the same under every plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from chameleon_ext.plan import ExecutionPlan
from chameleon_ext.schedule_ir import Op, OpKind
from megatron.elastic.wgrad import WeightGradStore

# forward_step(batch, model) -> output; loss_func(batch, output) -> token-mean loss (scalar)
ForwardStep = Callable[[dict | None, torch.nn.Module], torch.Tensor]
LossFunc = Callable[[dict, torch.Tensor], torch.Tensor]

_TIMER_OF = {
    OpKind.RECV_FWD: "forward-recv", OpKind.FWD: "forward-compute", OpKind.SEND_FWD: "forward-send",
    OpKind.RECV_BWD: "backward-recv", OpKind.BWD: "backward-compute",
    OpKind.BWD_INPUT: "backward-input", OpKind.BWD_WEIGHT: "backward-weight",
    OpKind.SEND_BWD: "backward-send", OpKind.REDUCE_GRADS: "grads-all-reduce",
    OpKind.OPT_STEP: "optimizer",
}


@dataclass
class StepResult:
    loss: float              # global mean loss of the iteration (same on every rank)
    grad_norm: float | None
    update_successful: bool


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
    before_op: Callable[[Op, int], None] | None = None  # (op, iteration): failure injection
    wgrad: WeightGradStore | None = None  # set when the schedule splits backwards
    timers: object | None = None
    first: bool = field(init=False)
    last: bool = field(init=False)

    def __post_init__(self) -> None:
        self.first = self.plan.is_first_stage(self.rank)
        self.last = self.plan.is_last_stage(self.rank)


class Executor:
    def __init__(self, rt: StageRuntime) -> None:
        self.rt = rt
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._out_grads: dict[int, torch.Tensor] = {}
        self._in_grads: dict[int, torch.Tensor] = {}
        self._pending: list = []
        self._position = 0
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=_device())

    def run(self, ops: list[Op], iteration: int) -> StepResult:
        rt = self.rt
        rt.model.zero_grad_buffer()
        rt.optimizer.zero_grad()
        self._loss_sum.zero_()
        result: tuple = (True, None)
        loss = float("nan")
        for self._position, op in enumerate(ops):
            if rt.before_op:
                rt.before_op(op, iteration)
            timer = rt.timers(_TIMER_OF[op.kind], log_level=2) if rt.timers else None
            if timer:
                timer.start()
            if op.kind is OpKind.OPT_STEP:
                self._check_finished()
                # The loss sum over the world is the iteration's last collective before any
                # parameter changes: a rank lost before it fails it on every survivor, so no
                # survivor steps and the iteration can be run again from its start.
                loss = self._global_loss()
                result = self._optimizer_step()
            else:
                self._DISPATCH[op.kind](self, op, iteration)
            if timer:
                timer.stop()
        ok, norm = result
        return StepResult(loss=loss, grad_norm=norm, update_successful=bool(ok))

    def _check_finished(self) -> None:
        if (self._inputs or self._outputs or self._out_grads or self._in_grads
                or (self.rt.wgrad and self.rt.wgrad.pending)):
            raise RuntimeError(f"rank {self.rt.rank}: micro-batches left unfinished by the "
                               f"schedule: {sorted(set(self._inputs) | set(self._outputs))}")

    def drain(self, ops: list[Op], timeout_s: float, lost: set[int] = frozenset()) -> None:
        """After a failure at op `_position`: take part in the rest of the iteration's
        communication without computing, so that live peers do not wait on this rank until a
        timeout (gloo cannot interrupt a blocked operation). Every send still owed gets a
        placeholder (but those to `lost` ranks), every collective is joined, receives are
        skipped; errors (from the lost rank) are expected and ignored. The world loss sum before the optimizer step contains
        the lost rank, so it fails on every survivor and no one steps. The placeholders' values
        never matter: the iteration runs again."""
        works = []
        for op in ops[self._position + 1:]:
            try:
                if op.kind in (OpKind.SEND_FWD, OpKind.SEND_BWD) and op.peer not in lost:
                    buf = torch.zeros(self.rt.activation_shape, dtype=self.rt.activation_dtype,
                                      device=_device())
                    works.append(dist.isend(buf, dst=op.peer, tag=op.message_tag()))
                elif op.kind is OpKind.REDUCE_GRADS:
                    self._reduce_grads(op, -1)
                elif op.kind is OpKind.OPT_STEP:
                    self._global_loss()
            except RuntimeError:
                continue
        deadline = time.monotonic() + timeout_s
        for work in works:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                work.wait(timeout=timedelta(seconds=left))
            except RuntimeError:
                pass

    def reset(self) -> None:
        """Drop everything of an interrupted iteration (activations, received tensors, sends)."""
        for buf in (self._inputs, self._outputs, self._out_grads, self._in_grads):
            buf.clear()
        self._pending.clear()
        if self.rt.wgrad:
            self.rt.wgrad.clear()

    def evaluate(self, ops: list[Op], get_batch: Callable[[int, int], dict],
                 iterations) -> float:
        """Mean loss of forward-only `ops` over the given iterations of `get_batch`'s data."""
        rt = self.rt
        train_get, rt.get_batch = rt.get_batch, get_batch
        rt.model.eval()
        total, n = 0.0, 0
        try:
            with torch.no_grad():
                for it in iterations:
                    self._loss_sum.zero_()
                    for op in ops:
                        self._DISPATCH[op.kind](self, op, it)
                    self._outputs.clear()
                    self._inputs.clear()
                    self._wait_sends()
                    total += self._global_loss()
                    n += 1
        finally:
            rt.get_batch = train_get
            rt.model.train()
        return total / max(n, 1)

    def _global_loss(self) -> float:
        rt = self.rt
        # One SUM over the world turns the last stages' partial sums into the global mean loss.
        mine = rt.last and rt.plan.position(rt.rank).tp_rank == 0
        loss = self._loss_sum.clone() if mine else torch.zeros_like(self._loss_sum)
        dist.all_reduce(loss)
        return float(loss) / rt.plan.num_micro_batches

    def _wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # ---- ops ----------------------------------------------------------------------------------
    def _recv(self, op: Op) -> torch.Tensor:
        buf = torch.empty(self.rt.activation_shape, dtype=self.rt.activation_dtype,
                          device=_device())
        dist.recv(buf, src=op.peer, tag=op.message_tag())
        return buf

    def _send(self, tensor: torch.Tensor, op: Op) -> None:
        self._pending.append((dist.isend(tensor.contiguous(), dst=op.peer, tag=op.message_tag()),
                              tensor))

    def _recv_fwd(self, op: Op, iteration: int) -> None:
        self._inputs[op.microbatch] = self._recv(op).requires_grad_()

    def _fwd(self, op: Op, iteration: int) -> None:
        rt = self.rt
        mb = op.microbatch
        batch = to_device(rt.get_batch(iteration, mb)) if (rt.first or rt.last) else None
        if rt.before_forward:
            rt.before_forward(iteration, mb)
        rt.module.set_input_tensor(self._inputs.get(mb))
        out = rt.forward_step(batch, rt.model)
        if rt.last:
            loss = rt.loss_func(batch, out)
            self._loss_sum += loss.detach().double()
            out = loss / rt.plan.num_micro_batches
        self._outputs[mb] = out

    def _send_fwd(self, op: Op, iteration: int) -> None:
        self._send(self._outputs[op.microbatch].detach(), op)

    def _recv_bwd(self, op: Op, iteration: int) -> None:
        self._out_grads[op.microbatch] = self._recv(op)

    def _bwd(self, op: Op, iteration: int) -> None:
        mb = op.microbatch
        out = self._outputs.pop(mb)
        torch.autograd.backward(out, grad_tensors=self._out_grads.pop(mb, None))
        inp = self._inputs.pop(mb, None)
        if inp is not None and not self.rt.first:
            self._in_grads[mb] = inp.grad

    def _bwd_input(self, op: Op, iteration: int) -> None:
        self.rt.wgrad.deferring = op.microbatch
        try:
            self._bwd(op, iteration)
        finally:
            self.rt.wgrad.deferring = None

    def _bwd_weight(self, op: Op, iteration: int) -> None:
        self.rt.wgrad.compute(op.microbatch)

    def _send_bwd(self, op: Op, iteration: int) -> None:
        self._send(self._in_grads.pop(op.microbatch), op)

    def _reduce_grads(self, op: Op, iteration: int) -> None:
        rt = self.rt
        rt.model.finish_grad_sync()
        if rt.embedding_group is not None:
            # Replicas hold identical summed gradients now; one first-stage and one last-stage
            # rank per group contribute, so every copy gets embedding + output gradient once.
            grad = rt.tied_weight.main_grad
            if not rt.embedding_contributor:
                grad.zero_()
            dist.all_reduce(grad, group=rt.embedding_group)

    def _optimizer_step(self) -> tuple:
        self._wait_sends()
        ok, grad_norm, _ = self.rt.optimizer.step()
        if ok:
            self.rt.scheduler.step(increment=self.rt.plan.global_batch_size)
        return ok, grad_norm

    _DISPATCH = {
        OpKind.RECV_FWD: _recv_fwd, OpKind.FWD: _fwd, OpKind.SEND_FWD: _send_fwd,
        OpKind.RECV_BWD: _recv_bwd, OpKind.BWD: _bwd, OpKind.SEND_BWD: _send_bwd,
        OpKind.BWD_INPUT: _bwd_input, OpKind.BWD_WEIGHT: _bwd_weight,
        OpKind.REDUCE_GRADS: _reduce_grads,
    }


def to_device(batch: dict) -> dict:
    dev = _device()
    return {k: v.to(dev, non_blocking=True) for k, v in batch.items()} if dev.type != "cpu" \
        else batch


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
