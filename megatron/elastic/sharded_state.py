"""The distributed optimizer's state under layout-independent names (checkpoints).

megatron-core's DistributedOptimizer (--use-distributed-optimizer) gives each rank of a replica
group one contiguous range of every DDP bucket: its Adam moments are slices of the flattened
parameters, which depend on the group's size. A checkpoint stores whole tensors under each
parameter's global name instead, the keys and shapes the plain optimizer writes, so a checkpoint
loads under any data-parallel size and either optimizer:

- `whole_state(..., gathered=True)` (collective over each replica group): every rank puts its
  slices in place in a zeroed flat buffer and one all-reduce per optimizer sums the group's
  disjoint slices into whole moments (x + 0 is exact, so the sum is the moments themselves);
- `load_slices`: after a load of the whole tensors, each rank keeps its own slices.

megatron-core's own (``sharded_state_dict``) speaks its dist_checkpointing format, not the
torch.distributed.checkpoint keys by global name that the rest of this job's checkpoints hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class _Slice:
    param: torch.nn.Parameter   # the model's parameter (whole)
    shard: torch.Tensor         # the inner optimizer's parameter: its flattened [start, end)
    start: int
    end: int


def distributed(optimizer) -> list[DistributedOptimizer]:
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(o, DistributedOptimizer)]


def is_sharded(optimizer) -> bool:
    return bool(distributed(optimizer))


def _params(o: DistributedOptimizer) -> list[torch.nn.Parameter]:
    """Every parameter `o` steps on some rank of its group, in the buffers' order (the same on
    every replica)."""
    return [p for buffer in o.buffers for p in buffer.params]


def _slices(o: DistributedOptimizer) -> list[_Slice]:
    """This rank's slices in `o`: the parameters whose flattened range meets its part of a
    bucket."""
    out = []
    for models, shards in zip(o.model_fp32_groups, o.shard_fp32_groups):
        for param, shard in zip(models, shards):
            r = o._get_model_param_range_map(param)["param"]
            out.append(_Slice(param, shard, r.start, r.end))
    return out


def whole_state(optimizer, names: dict[int, str], gathered: bool
                ) -> dict[str, dict[str, torch.Tensor]]:
    """Global name -> {"step", "exp_avg", "exp_avg_sq"} as whole tensors, for every parameter of
    this rank's stage (`names`: id of a model parameter -> its global name). `gathered`: the
    values (collective over each replica group; zeros and step 0 before the first step);
    else zeroed tensors of the right shapes, for a load to fill."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for o in distributed(optimizer):
        params = _params(o)
        sizes = [p.numel() for p in params]
        device = params[0].device if params else None
        flat = torch.zeros(len(MOMENTS), sum(sizes), dtype=torch.float32, device=device)
        steps = torch.zeros(len(params), dtype=torch.float32, device=device)
        if gathered:
            offset = dict(zip((id(p) for p in params),
                              torch.tensor([0, *sizes[:-1]]).cumsum(0).tolist()))
            index = {id(p): i for i, p in enumerate(params)}
            for s in _slices(o):
                state = o.optimizer.state.get(s.shard, {})
                if not state:
                    continue
                at = offset[id(s.param)]
                for k, key in enumerate(MOMENTS):
                    flat[k, at + s.start:at + s.end] = state[key].view(-1)
                steps[index[id(s.param)]] = float(state["step"])
            # Each slice is held by one rank of the group: the sum is the whole tensor.
            dist.all_reduce(flat, group=o.data_parallel_group)
            # Every parameter steps each iteration, so its step is the same wherever held; the
            # maximum reaches the ranks that hold no slice of it.
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=o.data_parallel_group)
        for p, row, step in zip(params, flat.split(sizes, dim=1), steps):
            state = {"step": step.clone()}
            state.update({key: row[k].view(p.shape).clone() for k, key in enumerate(MOMENTS)})
            out[names[id(p)]] = state
    return out


def load_slices(optimizer, names: dict[int, str],
                whole: dict[str, dict[str, torch.Tensor]]) -> None:
    """Each rank's slices of the whole tensors `whole` (whole_state's keys) into its
    optimizer's state."""
    for o in distributed(optimizer):
        for s in _slices(o):
            src = whole[names[id(s.param)]]
            state = o.optimizer.state[s.shard]
            state.clear()
            state["step"] = src["step"].clone()
            state.update({key: src[key].view(-1)[s.start:s.end].clone().view_as(s.shard)
                          for key in MOMENTS})


def slice_states(optimizer) -> list[tuple[_Slice, dict]]:
    """This rank's slices, each with its optimizer's state (empty before the first step; the
    dict itself, for a restore to fill)."""
    return [pair for o in distributed(optimizer) for pair in slice_states_of(o)]


def slice_states_of(o: DistributedOptimizer) -> list[tuple[_Slice, dict]]:
    """slice_states of one distributed optimizer."""
    return [(s, o.optimizer.state[s.shard]) for s in _slices(o)]


def step_locally(o: DistributedOptimizer) -> bool:
    """megatron-core's step of this rank's shard, without the all-gather of the stepped shards
    that ends DistributedOptimizer.step_with_ready_grads: after a step's commit no rank may
    wait on another (a rank lost then would leave the survivors half stepped), so the gather
    is left to whatever reads whole parameters next (gather_parameters)."""
    return super(DistributedOptimizer, o).step_with_ready_grads()


def gather_parameters(rt) -> None:
    """Bring the shards the replicas stepped into this rank's whole parameters (collective
    over each replica group), if a step left them behind (`rt.params_behind`): before the
    next iteration's forwards, an evaluation, a checkpoint or the replica check."""
    if rt.params_behind:
        rt.model.start_param_sync(force_sync=True)
        rt.params_behind = False
