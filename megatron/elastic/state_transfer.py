"""Carry a rank's training state from the runtime of one plan to the runtime of the next.

The old runtime must be gone before the old process groups are destroyed (its modules, DDP
buffers and optimizer hold the groups, and a group still referenced keeps its sockets open, so
peers blocked on it would wait for the timeout): capture() keeps only tensors and numbers.

Parameters and Adam moments are matched by their layout-independent global names, so a rank that
keeps its layers across a re-plan (rerouting) keeps them bit for bit, whatever was rebuilt around
them (process groups, DDP buffers, optimizer objects). Layers a rank does not have yet (a stage
that took over a lost neighbour's layers, a re-parallelized plan) come from a rank that holds
them, by point-to-point over the new world (`fetch_missing`): one packed buffer per pair of ranks
and dtype, never through disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

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


class StateLost(Exception):
    """A new plan needs state that no rank holds any more (a planning error, not a failure
    to retry)."""


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


def fetch_missing(state: CarriedState, needed: dict[str, torch.Tensor]) -> int:
    """Collective over the current world: every rank receives, into `state`, the parameters
    named in `needed` (name -> a tensor of its shape and dtype) that it does not carry, with
    their optimizer state, each from the lowest rank that carries it. Returns the bytes this
    rank received."""
    world = dist.get_world_size()
    me = dist.get_rank()
    want = sorted(set(needed) - set(state.params))
    offers: list = [None] * world
    dist.all_gather_object(offers, (sorted(state.params), want))
    holder: dict[str, int] = {}
    for r, (held, _) in enumerate(offers):
        for name in held:
            holder.setdefault(name, r)
    pairs: dict[tuple[int, int], list[str]] = {}  # (src, dst) -> names, sorted
    for dst, (_, missing) in enumerate(offers):
        for name in missing:
            if name not in holder:
                raise StateLost(f"rank {dst} needs {name}, which no surviving rank holds")
            pairs.setdefault((holder[name], dst), []).append(name)
    if not pairs:
        return 0
    # What each sender's optimizer state looks like, so receivers can size their buffers.
    layouts: list = [None] * world
    dist.all_gather_object(layouts, {name: state_layout(state.optimizer.get(name, {}))
                                     for (src, _), names in pairs.items() if src == me
                                     for name in names})
    handles, incoming = [], []
    for (src, dst), names in sorted(pairs.items()):
        if src == me:
            packed = pack_by_dtype([t for name in names for t in tensors_of(state, name)])
            for flat in packed.values():
                handles.append(dist.isend(flat, dst))
        elif dst == me:
            layout = {name: layouts[src][name] for name in names}
            empties = [t for name in names for t in
                       [needed[name], *templates(layout[name], needed[name].device)]]
            buffers = pack_by_dtype(empties, empty=True)
            handles += [dist.irecv(flat, src) for flat in buffers.values()]
            incoming.append((names, layout, empties, buffers))
    for h in handles:
        h.wait()
    received = 0
    for names, layout, empties, buffers in incoming:
        received += sum(b.numel() * b.element_size() for b in buffers.values())
        tensors = iter(v.clone() for v in views(empties, buffers))
        for name in names:
            state.params[name] = next(tensors)
            state.optimizer[name] = {k: next(tensors) if kind == "tensor" else value
                                     for k, kind, value in layout[name]}
    return received


def state_layout(opt: dict) -> list[tuple[str, str, object]]:
    """(key, "tensor", (shape, dtype)) or (key, "value", the value) for each entry."""
    return [(k, "tensor", (tuple(v.shape), str(v.dtype).removeprefix("torch.")))
            if isinstance(v, torch.Tensor) else (k, "value", v) for k, v in sorted(opt.items())]


def templates(layout, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for _, kind, v in layout
            if kind == "tensor" for shape, dtype in [v]]


def tensors_of(state: CarriedState, name: str) -> list[torch.Tensor]:
    opt = state.optimizer.get(name, {})
    return [state.params[name], *(v for _, v in sorted(opt.items())
                                  if isinstance(v, torch.Tensor))]


def pack_by_dtype(tensors: list[torch.Tensor],
                  empty: bool = False) -> dict[torch.dtype, torch.Tensor]:
    """One flat buffer per dtype, in the tensors' order (uninitialised when `empty`)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    if empty:
        return {d: torch.empty(sum(t.numel() for t in ts), dtype=d, device=ts[0].device)
                for d, ts in sorted(by_dtype.items(), key=lambda x: str(x[0]))}
    return {d: torch.cat([t.detach().reshape(-1) for t in ts])
            for d, ts in sorted(by_dtype.items(), key=lambda x: str(x[0]))}


def views(templates: list[torch.Tensor], buffers: dict[torch.dtype, torch.Tensor]
          ) -> list[torch.Tensor]:
    """Each template's place in pack_by_dtype's buffers, as a view of them."""
    offsets = {d: 0 for d in buffers}
    out = []
    for t in templates:
        o = offsets[t.dtype]
        out.append(buffers[t.dtype][o:o + t.numel()].view(t.shape))
        offsets[t.dtype] = o + t.numel()
    return out


def restore(state: CarriedState, rt: StageRuntime, tied_embeddings: bool) -> None:
    new_params = named_parameters(rt, tied_embeddings)
    missing = sorted(set(new_params) - set(state.params))
    if missing:
        raise RuntimeError(f"rank {rt.rank} lacks {len(missing)} parameters for its new stage "
                           f"(first: {missing[0]}); fetch_missing() brings them from their holders")
    new_state = optimizer_state(rt, tied_embeddings)
    with torch.no_grad():
        for name, p in new_params.items():
            p.copy_(state.params[name])
            opt = new_state[name]
            opt.clear()
            opt.update({k: v.clone() if isinstance(v, torch.Tensor) else v
                        for k, v in state.optimizer[name].items()})
    rt.scheduler.load_state_dict(state.scheduler)


def state_digests(rt: StageRuntime, tied_embeddings: bool) -> dict[str, str]:
    """sha256 of each parameter's bytes and of each of its optimizer-state tensors (Adam's
    moments and step), by global name ("name" and "name#exp_avg", ...): replicas must agree
    bit for bit."""
    import hashlib

    def digest(t: torch.Tensor) -> str:
        return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()

    out = {name: digest(p) for name, p in named_parameters(rt, tied_embeddings).items()}
    for name, opt in optimizer_state(rt, tied_embeddings).items():
        out.update({f"{name}#{k}": digest(v) for k, v in opt.items()
                    if isinstance(v, torch.Tensor)})
    return out
