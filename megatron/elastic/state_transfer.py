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

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron.elastic import sharded_state, stage_model
from megatron.elastic.schedules import StageRuntime


def named_parameters(rt: StageRuntime, tied_embeddings: bool) -> dict[str, torch.nn.Parameter]:
    """Global name (with the tensor-parallel shard) -> parameter, for this rank's stage (an
    interleaved plan's: its chunks')."""
    pos = rt.plan.position(rt.rank)
    stages = rt.plan.pipeline_of(rt.rank).stages
    out = {}
    for s in rt.plan.chunks(rt.rank):
        module = rt.chunks.get(s, rt.module)
        for name, p in module.named_parameters():
            if name == "output_layer.weight" and not tied_embeddings:
                gname = name
            else:
                gname = stage_model.global_name(name, stages[s].layer_start, s == 0)
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


PARAM, OPTIM = "param", "optim"


@dataclass
class Piece:
    """Elements [start, end) of one flattened parameter as a rank holds them: its values
    (kind PARAM: {"param": 1-D}) or its optimizer state (kind OPTIM: each tensor of the
    parameter's size as a 1-D slice, 0-d tensors such as Adam's step and other values whole)."""

    kind: str
    start: int
    end: int
    values: dict[str, object]


@dataclass
class CarriedState:
    """A rank's training state with no reference to any process group or module: what survives
    the teardown of a plan's runtime. `params` and `optimizer` hold whole tensors (the
    optimizer's may be empty before its first step); `pieces`, parts of them: the distributed
    optimizer's slices this rank stepped, and what it received for its next plan."""

    params: dict[str, torch.Tensor]
    optimizer: dict[str, dict]
    scheduler: dict
    pieces: dict[str, list[Piece]] = field(default_factory=dict)


def capture(rt: StageRuntime, tied_embeddings: bool) -> CarriedState:
    named = named_parameters(rt, tied_embeddings)
    if not sharded_state.is_sharded(rt.optimizer):
        return CarriedState(
            params={k: p.detach() for k, p in named.items()},
            optimizer={k: dict(v) for k, v in optimizer_state(rt, tied_embeddings).items()},
            scheduler=rt.scheduler.state_dict())
    # The distributed optimizer: this rank's slices of the moments; of the parameters too when
    # a step left the other replicas' shards ungathered (then only the slices are current).
    names = {id(p): k for k, p in named.items()}
    pieces: dict[str, list[Piece]] = {}
    for sl, state in sharded_state.slice_states(rt.optimizer):
        name, span = names[id(sl.param)], (sl.start, sl.end)
        if state:
            pieces.setdefault(name, []).append(Piece(OPTIM, *span, {
                k: v.view(-1) if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in state.items()}))
        if rt.params_behind:
            pieces.setdefault(name, []).append(
                Piece(PARAM, *span, {"param": sl.param.detach().view(-1)[sl.start:sl.end]}))
    if rt.buddy is not None and rt.buddy.ready:   # the copies of the owner's shard: current
        for name, a, b, state, values in rt.buddy.pieces():
            pieces.setdefault(name, []).append(Piece(PARAM, a, b, {"param": values}))
            if state:
                pieces[name].append(Piece(OPTIM, a, b, dict(state)))
    return CarriedState(
        params={} if rt.params_behind else {k: p.detach() for k, p in named.items()},
        optimizer={}, scheduler=rt.scheduler.state_dict(), pieces=pieces)


def holdings(state: CarriedState) -> dict[str, list[Piece]]:
    """Everything `state` holds, as pieces (whole tensors as one piece each)."""
    out: dict[str, list[Piece]] = {}
    for name, p in state.params.items():
        out.setdefault(name, []).append(Piece(PARAM, 0, p.numel(), {"param": p.reshape(-1)}))
    for name, opt in state.optimizer.items():
        if opt:
            out.setdefault(name, []).append(Piece(OPTIM, 0, state.params[name].numel(), {
                k: v.reshape(-1) if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in opt.items()}))
    for name, pieces in state.pieces.items():
        out.setdefault(name, []).extend(pieces)
    return out


def _cover(pieces: list[tuple[int, int, object]], start: int, end: int
           ) -> list[tuple[int, int, object]] | None:
    """Segments (a, b, source) covering [start, end) from `pieces` (start, end, source) in
    their order of preference, each segment from the first piece that reaches furthest at its
    start; None when some element is in no piece."""
    out, at = [], start
    while at < end:
        best = None
        for a, b, src in pieces:
            if a <= at < b and (best is None or b > best[1]):
                best = (a, b, src)
        if best is None:
            return None
        out.append((at, min(best[1], end), best[2]))
        at = min(best[1], end)
    return out


def _segment(piece: Piece, a: int, b: int) -> dict[str, object]:
    """Elements [a, b) of `piece` (within it): sliced tensors, whole scalars and values."""
    return {k: v[a - piece.start:b - piece.start]
            if isinstance(v, torch.Tensor) and v.dim() else v for k, v in piece.values.items()}


def assemble(held: list[Piece], name: str, kind: str, start: int, end: int
             ) -> dict[str, object] | None:
    """Elements [start, end) of `name`'s `kind` from `held`, what a rank holds of it
    (holdings(state)[name]), as new tensors; None when it holds no piece of that kind, raises
    StateLost when it holds only part."""
    pieces = [pc for pc in held if pc.kind == kind]
    if not pieces:
        return None
    segments = _cover([(pc.start, pc.end, pc) for pc in pieces], start, end)
    if segments is None:
        raise StateLost(f"{name}: elements [{start}, {end}) of its {kind} state are not all "
                        "held here")
    parts = [_segment(pc, a, b) for a, b, pc in segments]
    return {k: torch.cat([p[k] for p in parts]) if isinstance(v, torch.Tensor) and v.dim()
            else (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in parts[0].items()}


def wanted(rt: StageRuntime, tied_embeddings: bool) -> dict[str, list[tuple[str, int, int]]]:
    """What the runtime `rt` needs of each parameter: the whole values, and its optimizer's
    state whole or, under the distributed optimizer, the slices it steps."""
    named = named_parameters(rt, tied_embeddings)
    out = {name: [(PARAM, 0, p.numel())] for name, p in named.items()}
    if sharded_state.is_sharded(rt.optimizer):
        names = {id(p): k for k, p in named.items()}
        for sl, _ in sharded_state.slice_states(rt.optimizer):
            out[names[id(sl.param)]].append((OPTIM, sl.start, sl.end))
    else:
        for name, p in named.items():
            out[name].append((OPTIM, 0, p.numel()))
    return out


def fetch_missing(state: CarriedState, needed: dict[str, list[tuple[str, int, int]]],
                  dtypes: dict[str, torch.dtype], device: torch.device) -> dict[str, int]:
    """Collective over the current world: every rank receives, as pieces added to `state`,
    the parts of `needed` (wanted()'s) that it does not hold, each part from the lowest rank
    that holds it, reaching furthest. Nothing is dropped from `state`: a later attempt of the
    same transition finds everything a rank held. Optimizer state is wanted only once some rank
    holds any (before the first step there is none). `dtypes`: each parameter's. Returns the
    bytes this rank received, per parameter name (an emulated device scales each by what that
    parameter is in its model)."""
    world = dist.get_world_size()
    me = dist.get_rank()
    held = holdings(state)
    gaps = []
    for name, parts in sorted(needed.items()):
        for kind, a, b in parts:
            gaps += [(name, kind, x, y) for x, y in _uncovered(held.get(name, []), kind, a, b)]
    offers: list = [None] * world
    dist.all_gather_object(offers, (
        [(name, pc.kind, pc.start, pc.end) for name, pcs in sorted(held.items()) for pc in pcs],
        gaps,
        {name: state_layout(next(pc.values for pc in pcs if pc.kind == OPTIM))
         for name, pcs in held.items() if any(pc.kind == OPTIM for pc in pcs)}))
    stepped = any(layouts for _, _, layouts in offers)
    holders: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
    for r, (pieces, _, _) in enumerate(offers):
        for name, kind, a, b in pieces:
            holders.setdefault((name, kind), []).append((a, b, r))
    pairs: dict[tuple[int, int], list[tuple[str, str, int, int]]] = {}  # (src, dst) -> parts
    for dst, (_, missing, _) in enumerate(offers):
        for name, kind, a, b in missing:
            if kind == OPTIM and not stepped:
                continue
            segments = _cover(holders.get((name, kind), []), a, b)
            if segments is None:
                raise StateLost(f"rank {dst} needs elements [{a}, {b}) of {name}'s {kind} "
                                "state, which no surviving rank holds")
            for x, y, src in segments:
                pairs.setdefault((src, dst), []).append((name, kind, x, y))
    if not pairs:
        return {}
    handles, incoming = [], []
    for (src, dst), parts in sorted(pairs.items()):
        if src == me:
            tensors = [t for name, kind, a, b in parts
                       for t in _tensors(assemble(held.get(name, []), name, kind, a, b))]
            handles += [dist.isend(flat, dst) for flat in pack_by_dtype(tensors).values()]
        elif dst == me:
            layouts = offers[src][2]
            empties = [_templates(kind, layouts.get(name), b - a, dtypes[name], device)
                       for name, kind, a, b in parts]
            buffers = pack_by_dtype([t for e in empties for t in _tensors(e)], empty=True)
            handles += [dist.irecv(flat, src) for flat in buffers.values()]
            incoming.append((parts, empties, buffers))
    for h in handles:
        h.wait()
    received: dict[str, int] = {}
    for parts, empties, buffers in incoming:
        tensors = iter(v.clone() for v in views([t for e in empties for t in _tensors(e)],
                                                buffers))
        for (name, kind, a, b), empty in zip(parts, empties):
            values = {k: next(tensors) if isinstance(v, torch.Tensor) else v
                      for k, v in sorted(empty.items())}
            received[name] = received.get(name, 0) + sum(
                v.numel() * v.element_size() for v in values.values()
                if isinstance(v, torch.Tensor))
            state.pieces.setdefault(name, []).append(Piece(kind, a, b, values))
    return received


def _uncovered(pieces: list[Piece], kind: str, a: int, b: int) -> list[tuple[int, int]]:
    """The sub-ranges of [a, b) that no piece of `kind` covers."""
    out, at = [], a
    for pc in sorted((pc for pc in pieces if pc.kind == kind), key=lambda pc: pc.start):
        if pc.end <= at or pc.start >= b:
            continue
        if pc.start > at:
            out.append((at, pc.start))
        at = max(at, pc.end)
    if at < b:
        out.append((at, b))
    return out


def _tensors(values: dict[str, object]) -> list[torch.Tensor]:
    """The tensors of a part, in the order both ends pack them (by key)."""
    return [v for _, v in sorted(values.items()) if isinstance(v, torch.Tensor)]


def _templates(kind: str, layout, n: int, dtype: torch.dtype, device: torch.device
               ) -> dict[str, object]:
    """Uninitialised tensors for n elements of a part: the parameter's values, or its
    optimizer state as the sender's `layout` (state_layout) describes it."""
    if kind == PARAM:
        return {"param": torch.empty(n, dtype=dtype, device=device)}
    out: dict[str, object] = {}
    for key, what, value in layout:
        if what == "tensor":
            shape, dt = value
            out[key] = torch.empty(n if shape else (), dtype=getattr(torch, dt), device=device)
        else:
            out[key] = value
    return out


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
    """`state` (after fetch_missing) into the runtime `rt`: the whole parameters, and the
    optimizer's state whole or, under the distributed optimizer, the slices it steps."""
    named = named_parameters(rt, tied_embeddings)
    held = holdings(state)
    with torch.no_grad():
        for name, p in named.items():
            values = assemble(held.get(name, []), name, PARAM, 0, p.numel())
            if values is None:
                raise RuntimeError(f"rank {rt.rank} lacks {name} for its new stage; "
                                   "fetch_missing() brings it from its holders")
            p.copy_(values["param"].view(p.shape))
        if sharded_state.is_sharded(rt.optimizer):
            names = {id(p): k for k, p in named.items()}
            for sl, opt in sharded_state.slice_states(rt.optimizer):
                name = names[id(sl.param)]
                _fill(opt, assemble(held.get(name, []), name, OPTIM, sl.start, sl.end),
                      sl.shard.shape)
        else:
            for name, opt in optimizer_state(rt, tied_embeddings).items():
                _fill(opt, assemble(held.get(name, []), name, OPTIM, 0, named[name].numel()),
                      named[name].shape)
    rt.scheduler.load_state_dict(state.scheduler)


def _fill(opt: dict, values: dict[str, object] | None, shape: torch.Size) -> None:
    """An optimizer's state of one parameter (or slice) from assembled `values` (None: no rank
    had stepped: the state stays empty)."""
    opt.clear()
    if values is not None:
        opt.update({k: v.view(shape) if isinstance(v, torch.Tensor) and v.dim() else v
                    for k, v in values.items()})


def state_digests(rt: StageRuntime, tied_embeddings: bool) -> dict[str, str]:
    """sha256 of each parameter's bytes and of each of its optimizer-state tensors (Adam's
    moments and step), by global name ("name" and "name#exp_avg", ...): replicas must agree
    bit for bit."""
    import hashlib

    def digest(t: torch.Tensor) -> str:
        return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()

    named = named_parameters(rt, tied_embeddings)
    out = {name: digest(p) for name, p in named.items()}
    if sharded_state.is_sharded(rt.optimizer):
        # Each slice against its copies in the other instances (the same range of the name).
        names = {id(p): k for k, p in named.items()}
        slices = [(names[id(sl.param)], sl.start, sl.end, opt,
                   sl.param.detach().reshape(-1)[sl.start:sl.end])
                  for sl, opt in sharded_state.slice_states(rt.optimizer)]
        if rt.buddy is not None and rt.buddy.ready:
            slices += rt.buddy.pieces()      # against the owner's slices, bit for bit
        for name, a, b, opt, values in slices:
            out[f"{name}#param[{a}:{b}]"] = digest(values)
            out.update({f"{name}#{k}[{a}:{b}]": digest(v)
                        for k, v in opt.items() if isinstance(v, torch.Tensor)})
        return out
    for name, opt in optimizer_state(rt, tied_embeddings).items():
        out.update({f"{name}#{k}": digest(v) for k, v in opt.items()
                    if isinstance(v, torch.Tensor)})
    return out
