"""The same iteration run by megatron-core's own pipeline schedules, for side-by-side checks.

`--chameleon-executor megatron-core` swaps the IR executor for this one: identical model, data,
gradient reduction and optimizer step, but the forward/backward order and the point-to-point
traffic are megatron-core's (forward_backward_no_pipelining with one stage, the non-interleaved
1F1B otherwise). Only homogeneous plans have a megatron-core schedule.
"""

from __future__ import annotations

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from chameleon_ext.schedule.ir import Op
from megatron.elastic import optimizer_step
from megatron.elastic.schedules import Executor, StageRuntime, StepResult, to_device


class MegatronCoreExecutor(Executor):
    def __init__(self, rt: StageRuntime) -> None:
        super().__init__(rt)
        cfg = rt.module.config
        cfg.pipeline_dtype = rt.activation_dtype
        cfg.batch_p2p_sync = False  # a CUDA-only synchronize after batched p2p
        # the plan's groups, as the stage model was built on them (GPTModel keeps them)
        self._groups = rt.module.pg_collection
        self._p2p = P2PCommunicator(pp_group=self._groups.pp, config=cfg)
        self._forward_backward = get_forward_backward_func(pp_size=self._groups.pp.size(),
                                                           vp_size=None)

    def run(self, ops: list[Op], iteration: int) -> StepResult:
        rt = self.rt
        self.refresh()
        mbs = rt.plan.pipeline_of(rt.rank).micro_batches
        seq, mbsize, _ = rt.activation_shape
        if rt.module.config.sequence_parallel:
            seq *= rt.plan.tensor_parallel  # megatron-core's schedule divides it by TP itself

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            reads = rt.first or rt.last or rt.every_stage_reads
            batch = to_device(rt.get_batch(iteration, mb)) if reads else None
            if rt.first and rt.plan.position(rt.rank).tp_rank == 0:
                self._samples += int(batch["tokens"].shape[0])
            if rt.before_forward:
                rt.before_forward(iteration, mb)
            out = rt.forward_step(batch, model)

            def loss_func(output):
                # megatron-core's per-token-loss mode (the config's always) divides by nothing
                loss = self._weighted_loss(rt.loss_func(batch, output), batch)
                return loss, torch.tensor(1), {"lm loss": loss}
            return out, loss_func

        self._forward_backward(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[rt.model],
            num_microbatches=len(mbs), seq_length=seq, micro_batch_size=mbsize,
            forward_only=False, p2p_communicator=self._p2p, pg_collection=self._groups)
        self._reduce_grads(None, iteration)
        # the same step as the IR executor's: prepare, commit, apply
        done = self._commit(iteration, optimizer_step.prepare(rt.optimizer, rt.count_zeros))
        return self._result(done, self._apply_step(done))
