"""Split backward on megatron-core linear layers: input gradients now, weight gradients later.

A BWD_INPUT op runs autograd as usual, but the column- and row-parallel linear layers of the
stage return no weight gradient: they keep (grad_output, input) of the micro-batch instead, and
the BWD_WEIGHT op of that micro-batch computes the weight gradients from them into the
parameters' `main_grad` (where megatron-core's DDP hooks would have put them). Small parameters
(layer norms, biases, embeddings) still get their gradients in the input half: deferring them
would save nothing.

The layers' own autograd function (LinearWithGradAccumulationAndAsyncCommunication) computes both
halves in one backward and has no hook between them, so the linear layers' `_forward_impl` is
replaced on the instances with one that can defer. Same matmuls, same shapes: the gradients are
those of the fused path up to the order of summation over micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class WeightGradStore:
    deferring: int | None = None  # micro-batch whose input half is running, if any
    pending: dict[int, list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]]] = \
        field(default_factory=dict)

    def defer(self, weight: torch.nn.Parameter, grad_output: torch.Tensor,
              inp: torch.Tensor) -> None:
        self.pending.setdefault(self.deferring, []).append((weight, grad_output, inp))

    def compute(self, microbatch: int) -> None:
        """The weight half of `microbatch`: accumulate its linear layers' weight gradients."""
        with torch.no_grad():
            for weight, grad_output, inp in self.pending.pop(microbatch, []):
                weight.main_grad.add_(grad_output.t().matmul(inp))

    def clear(self) -> None:
        self.deferring = None
        self.pending.clear()


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, allreduce_dgrad, tp_group, store):
        ctx.save_for_backward(inp, weight)
        # The parameter itself (its main_grad takes the deferred gradient): a saved tensor
        # comes back from saved-tensor hooks (memory_meter) as another tensor object.
        ctx.weight = weight
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        ctx.store = store
        out = torch.matmul(inp, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=ctx.tp_group)
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        inp = inp.reshape(-1, inp.shape[-1])
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        if ctx.store.deferring is not None:
            ctx.store.defer(ctx.weight, grad_output.detach(), inp.detach())
            grad_weight = None
        else:
            grad_weight = grad_output.t().matmul(inp)
        return grad_input, grad_weight, grad_bias, None, None, None


def install(module: torch.nn.Module) -> WeightGradStore:
    """Make every megatron-core column/row-parallel linear layer of `module` deferrable."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    store = WeightGradStore()
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m._forward_impl = _deferrable_impl(m._forward_impl, store)
    return store


def _deferrable_impl(original, store: WeightGradStore):
    def forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False,
                     allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                     wgrad_deferral_limit=None, tp_group=None, **kwargs):
        if (not weight.requires_grad or gradient_accumulation_fusion or sequence_parallel
                or grad_output_buffer is not None or kwargs):
            # Paths this split does not cover (sequence parallelism's gathered input among them)
            # keep megatron-core's fused backward; by keyword: a deprecated argument of its
            # function comes before tp_group.
            return original(input, weight, bias,
                            gradient_accumulation_fusion=gradient_accumulation_fusion,
                            allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                            grad_output_buffer=grad_output_buffer,
                            wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group, **kwargs)
        return _DeferrableLinear.apply(input, weight, bias, allreduce_dgrad, tp_group, store)
    return forward_impl
