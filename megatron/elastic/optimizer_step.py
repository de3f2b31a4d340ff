"""megatron-core's optimizer step, split at the step's commit point.

`MegatronOptimizer.step()` all-reduces the gradient norm inside itself (to clip by it), so a
rank lost during that all-reduce can leave one survivor stepped and another not. Here the step
has three parts, and only the middle one talks to other ranks:

1. `prepare`: local. The main gradients are made ready (megatron-core's `prepare_grads`) and
   this rank's part of the squared gradient norm is summed over the gradients megatron-core
   counts in the norm (`get_main_grads_for_grad_norm`: no shared copy, no tensor-parallel
   duplicate, so every parameter of the model counts once over the world); with
   --log-num-zeros-in-grad so are their zeros, as megatron-core's count_zeros counts them.
2. the commit (the executor's): one all-reduce over the world carries the norm parts with the
   loss, then every rank votes on the store (chameleon_ext.control.step_vote.StepVote.commit).
3. `apply`: local. Scale the gradients where the loss was a sum (--calculate-per-token-loss:
   by one over the batch's tokens, known at the commit), clip by the global norm and step
   (`step_with_ready_grads`). The distributed optimizer steps this rank's shard only:
   megatron-core's all-gather of the stepped shards waits for the next iteration
   (sharded_state.step_locally, gather_parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron.elastic import sharded_state


@dataclass(frozen=True)
class GradParts:
    """This rank's parts of the step's gradient statistics, summed over the world at the
    commit."""

    norm_sq: float        # of the squared gradient norm
    zeros: float = 0.0    # of the zero gradient entries (--log-num-zeros-in-grad)


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@torch.no_grad()
def params_norm_part(optimizer) -> float:
    """This rank's part of the squared norm of the parameters as stepped (--log-params-norm):
    the main parameters (the distributed optimizer's: this rank's shard) chosen as the
    gradient norm's are, so that each parameter counts once over the world."""
    params = [p for o in _optimizers(optimizer) for p in o.get_parameters()
              if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    if not params:
        return 0.0
    return float(torch.stack(torch._foreach_norm(params, 2.0)).double().square().sum())


@torch.no_grad()
def prepare(optimizer, count_zeros: bool = False) -> GradParts:
    """Ready the main gradients; returns this rank's parts of the squared gradient norm and
    (`count_zeros`) of the zero entries."""
    if optimizer.prepare_grads():
        # Only a dynamic loss scaler finds inf/nan, and --fp16 is refused where steps must be
        # atomic: its scaler is updated inside prepare_grads, before the commit.
        raise RuntimeError("inf/nan gradients found by the loss scaler")
    grads = [g for o in _optimizers(optimizer) for g in o.get_main_grads_for_grad_norm()]
    if not grads:
        return GradParts(0.0)
    norms = torch._foreach_norm(grads, 2.0)
    zeros = float(sum(g.numel() - int(torch.count_nonzero(g)) for g in grads)) \
        if count_zeros else 0.0
    return GradParts(float(torch.stack(norms).double().square().sum()), zeros)


@torch.no_grad()
def scale_and_clip(params: list, total_norm: float, clip_grad: float, grad_scale: float,
                   use_decoupled_grad: bool = False) -> None:
    """The gradients of `params` times `grad_scale`, then clipped by the global norm
    `total_norm` of the scaled gradients (when `clip_grad` > 0): an owner's step and its buddy
    copies' alike."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    if grad_scale != 1.0:
        grads = [getattr(p, attr) for p in params if getattr(p, attr, None) is not None]
        if grads:
            torch._foreach_mul_(grads, grad_scale)
    if clip_grad > 0.0 and params:
        # looked up at the call: cpu_compat replaces megatron-core's CUDA-only version
        mcore_optimizer.clip_grad_by_total_norm_fp32(params, clip_grad, total_norm,
                                                     use_decoupled_grad)


@torch.no_grad()
def apply(optimizer, total_norm: float, clip_grad: float, grad_scale: float = 1.0) -> bool:
    """Scale every gradient by `grad_scale`, clip it by the global norm `total_norm` (of the
    scaled gradients; when `clip_grad` > 0) and step."""
    for o in _optimizers(optimizer):
        if not getattr(o, "is_stub_optimizer", False):
            scale_and_clip(o.get_parameters(), total_norm, clip_grad, grad_scale,
                           o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    ok = True
    for o in _optimizers(optimizer):
        ok &= sharded_state.step_locally(o) if isinstance(o, DistributedOptimizer) \
            else o.step_with_ready_grads()
    return ok
