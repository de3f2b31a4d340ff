"""Carry a rank's training state from the runtime of one plan to the runtime of the next.

The old runtime must be gone before the old process groups are destroyed (its modules, DDP
buffers and optimizer hold the groups, and a group still referenced keeps its sockets open, so
peers blocked on it would wait for the timeout): capture() keeps only tensors and numbers.

Parameters and Adam moments are matched by their layout-independent global names, so a rank that
keeps its layers across a re-plan (rerouting) keeps them bit for bit, whatever was rebuilt around
them (process groups, DDP buffers, optimizer objects). Layers a rank does not have yet must come
from a replica (a later issue); asking for them here is an error that names them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.elastic import stage_model
from megatron.elastic.schedules import StageRuntime


def named_parameters(rt: StageRuntime, tied_embeddings: bool) -> dict[str, torch.nn.Parameter]:
    """Global name (with the tensor-parallel shard) -> parameter, for this rank's stage."""
    stage = rt.plan.stage_of(rt.rank)
    pos = rt.plan.position(rt.rank)
    out = {}
    for name, p in rt.module.named_parameters():
        if name == "output_layer.weight" and not tied_embeddings:
            gname = name
        else:
            gname = stage_model.global_name(name, stage.layer_start, rt.first)
        out[f"{gname}/tp{pos.tp_rank}of{rt.plan.tensor_parallel}"] = p
    return out


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron-core (chained) optimizer."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def optimizer_state(rt: StageRuntime, tied_embeddings: bool) -> dict[str, dict[str, torch.Tensor]]:
    by_id = {id(p): k for k, p in named_parameters(rt, tied_embeddings).items()}
    out = {}
    for opt in torch_optimizers(rt.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                out[by_id[id(p)]] = opt.state[p]
    return out


@dataclass
class CarriedState:
    """A rank's training state with no reference to any process group or module: what survives
    the teardown of a plan's runtime."""

    params: dict[str, torch.Tensor]
    optimizer: dict[str, dict]
    scheduler: dict


def capture(rt: StageRuntime, tied_embeddings: bool) -> CarriedState:
    return CarriedState(
        params={k: p.detach() for k, p in named_parameters(rt, tied_embeddings).items()},
        optimizer={k: dict(v) for k, v in optimizer_state(rt, tied_embeddings).items()},
        scheduler=rt.scheduler.state_dict())


def restore(state: CarriedState, rt: StageRuntime, tied_embeddings: bool) -> None:
    new_params = named_parameters(rt, tied_embeddings)
    missing = sorted(set(new_params) - set(state.params))
    if missing:
        raise RuntimeError(f"rank {rt.rank} lacks {len(missing)} parameters for its new stage "
                           f"(first: {missing[0]}); moving layers between ranks is not supported")
    new_state = optimizer_state(rt, tied_embeddings)
    with torch.no_grad():
        for name, p in new_params.items():
            p.copy_(state.params[name])
            opt = new_state[name]
            opt.clear()
            opt.update({k: v.clone() if isinstance(v, torch.Tensor) else v
                        for k, v in state.optimizer[name].items()})
    rt.scheduler.load_state_dict(state.scheduler)


def parameter_digests(rt: StageRuntime, tied_embeddings: bool) -> dict[str, str]:
    """sha256 of each parameter's bytes, by global name: replicas must agree bit for bit."""
    import hashlib
    return {name: hashlib.sha256(p.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            for name, p in named_parameters(rt, tied_embeddings).items()}
