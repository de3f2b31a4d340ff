"""Shadow copies of eager redundancy (chameleon_ext.planning.strategies.redundancy) in a rank's runtime.

Each iteration starts with a refresh: an owner sends its parameters and optimizer state (one
packed buffer per holder and dtype) to the rank that holds its shadow, which receives them into
buffers it keeps. The copies are current until the iteration's step: a failure inside the
iteration redoes it from exactly that state. A refresh that a failure interrupts, or a step
applied since the refresh (a transition at an iteration's boundary: an admission, a switch, a
failure in a checkpoint save), leaves the copies stale, and a stale copy is never used: the
layers then come from a data-parallel replica, as without redundancy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.elastic import state_transfer
from megatron.elastic.schedules import StageRuntime


class Shadows:
    """The copies `rt`'s rank holds and the holders it refreshes, for the plan's (owner,
    holder) pairs. sync() is collective over the world (every rank calls it once per
    iteration, with or without pairs of its own)."""

    def __init__(self, rt: StageRuntime, tied_embeddings: bool,
                 pairs: list[tuple[int, int]]) -> None:
        self.rt, self.tied = rt, tied_embeddings
        self.holders = [h for o, h in pairs if o == rt.rank]
        self.owners = [o for o, h in pairs if h == rt.rank]
        self.fresh = False
        self._layouts: dict[int, dict] | None = None
        self._complete = False          # every owner had its optimizer state when exchanged
        self._buffers: dict[int, dict[torch.dtype, torch.Tensor]] = {}
        self.params: dict[str, torch.Tensor] = {}
        self.optimizer: dict[str, dict] = {}

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for bufs in self._buffers.values()
                   for b in bufs.values())

    def _exchange(self, state: state_transfer.CarriedState) -> None:
        """What every owner sends (names, shapes, optimizer-state layout): the optimizer's
        moments appear after its first step, so this runs again until every owner has them."""
        mine = {name: (tuple(p.shape), str(p.dtype).removeprefix("torch."),
                       state_transfer.state_layout(state.optimizer.get(name, {})))
                for name, p in state.params.items()}
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        self._complete = all(opt for layout in everyone for _, _, opt in layout.values())
        self._layouts = {o: everyone[o] for o in self.owners}
        self._buffers, self.params, self.optimizer = {}, {}, {}
        device = next(iter(state.params.values())).device
        for owner, layout in self._layouts.items():
            templates = []
            for name, (shape, dtype, opt) in sorted(layout.items()):
                templates.append(torch.empty(shape, dtype=getattr(torch, dtype), device=device))
                templates += state_transfer.templates(opt, device)
            self._buffers[owner] = state_transfer.pack_by_dtype(templates, empty=True)
            views = iter(state_transfer.views(templates, self._buffers[owner]))
            for name, (_, _, opt) in sorted(layout.items()):
                self.params[name] = next(views)
                self.optimizer[name] = {k: next(views) if kind == "tensor" else value
                                        for k, kind, value in opt}

    def sync(self) -> None:
        state = state_transfer.capture(self.rt, self.tied)
        if self._layouts is None or not self._complete:
            self._exchange(state)
        self.fresh = False
        names = sorted(state.params)
        handles = []
        if self.holders:
            packed = state_transfer.pack_by_dtype([t for name in names
                                           for t in state_transfer.tensors_of(state, name)])
            for holder in self.holders:
                handles += [dist.isend(flat, holder) for flat in packed.values()]
        for owner in self.owners:
            handles += [dist.irecv(flat, owner) for flat in self._buffers[owner].values()]
        for h in handles:
            h.wait()
        self.fresh = True

    def stepped(self) -> None:
        """The owners applied a step: the copies are one step behind until the next refresh."""
        self.fresh = False

    def add_to(self, carried: state_transfer.CarriedState) -> None:
        """Hand the copies to the state carried into the next plan, when they are current."""
        if self.fresh:
            carried.params.update(self.params)
            carried.optimizer.update(self.optimizer)

