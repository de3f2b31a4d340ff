"""Buddy copies of the distributed optimizer's shards (--chameleon-shard-redundancy buddy).

With one distributed-optimizer instance each shard of the Adam moments lives on one rank: a lost
rank takes its shard with it. Here every rank also holds a copy of the shard of the rank after
it in its replica group's ring (its owner), kept in lockstep Bamboo-style, by redundant
computation rather than by copying state after each step:

- before the step's commit, each rank sends its buddy the reduced gradient of its shard
  (point-to-point; a loss there aborts the step like any other before the commit), one bucket's
  part as soon as megatron-core's DDP has reduced that bucket: on a device the message then
  crosses the links while the next bucket is reduced, the other way than the ring reduction
  (to the previous rank), and only the last bucket's part waits (perf_model.buddy_message_ms);
- after the commit, the buddy clips that gradient by the same global norm and steps its copy
  with a twin of the owner's torch optimizer, whose hyperparameters it takes from its own param
  groups (every rank's LR schedule is the same): elementwise the same arithmetic on the same
  values, so the copy stays bit-identical to the owner's shard (the replica check compares
  them).

A copy changes only at a committed step, as its holder's own state does: it is current whenever
its holder is. It is set up as each world is entered (the trainer's _hold_copies: inside the
reconfiguration's attempt, so a world that commits holds every copy), after any restore or
load: the owner sends its slices (ranges, param groups, moments) and the buddy takes the values
from its own whole parameters, which are current then. At a recovery the copies join the holder's
carried state as pieces, from which the lost rank's shard is put together.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.elastic import optimizer_step, sharded_state, state_transfer


@dataclass
class _Copy:
    name: str                   # the parameter's global name
    start: int                  # the owner's slice of it, flattened: [start, end)
    end: int
    group: int                  # the owner's param group of the slice
    bucket: int                 # the DDP bucket group its message goes with (LATE: after all)
    param: torch.nn.Parameter   # the copy's values (its .grad: the owner's reduced gradient)


@dataclass
class _Ring:
    """One distributed optimizer's part: this rank's buddy and owner in its replica group."""

    optimizer: object           # megatron-core's DistributedOptimizer
    buddy: int
    owner: int
    copies: list[_Copy]
    # this rank's shard, each slice by its bucket group: (bucket, parameter, start, end)
    mine: list[tuple[int, torch.nn.Parameter, int, int]] | None = None
    twin: torch.optim.Optimizer | None = None
    groups: list[int] | None = None   # the twin's param group i mirrors the owner's groups[i]


LATE = -1   # a _Copy's bucket when its gradient is summed again after the DDP reduction


class BuddyCopies:
    def __init__(self, optimizer, tied_embeddings: bool) -> None:
        # Nothing here refers to the runtime (setup is handed it): a cycle through it kept the
        # plan's groups, and their sockets, alive past the runtime's teardown, and a peer
        # blocked on one waited for its timeout (5 s) instead of failing at once.
        self.tied = tied_embeddings
        self.rings = []
        for o in sharded_state.distributed(optimizer):
            ring = dist.get_process_group_ranks(o.data_parallel_group)
            if len(ring) > 1:
                i = ring.index(dist.get_rank())
                self.rings.append(_Ring(o, ring[(i - 1) % len(ring)], ring[(i + 1) % len(ring)],
                                        []))
        self.ready = False
        self._handles: list = []   # messages sent or awaited before the commit

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for r in self.rings for c in r.copies
                   for t in [c.param, *self._state(r, c).values()]
                   if isinstance(t, torch.Tensor))

    def setup(self, rt) -> None:
        """Collective over each replica group: every owner sends its buddy its slices; the
        copies' values come from the whole parameters of this rank's runtime `rt` (current:
        call it before a step leaves them behind)."""
        params = state_transfer.named_parameters(rt, self.tied)
        names = {id(p): name for name, p in params.items()}
        bucket = {id(p): k for k, g in enumerate(_bucket_groups(rt.model)) for p in g.params}
        bucket.update((i, LATE) for i in _summed_again(rt))
        for r in self.rings:
            o = r.optimizer
            mine = sharded_state.slice_states_of(o)
            r.mine = [(bucket[id(sl.param)], sl.param, sl.start, sl.end) for sl, _ in mine]
            meta = [(names[id(sl.param)], sl.start, sl.end, _group_of(o.optimizer, sl.shard),
                     bucket[id(sl.param)], bool(state)) for sl, state in mine]
            everyone: list = [None] * o.data_parallel_group.size()
            dist.all_gather_object(everyone, meta, group=o.data_parallel_group)
            theirs = everyone[dist.get_group_rank(o.data_parallel_group, r.owner)]
            r.copies = [_Copy(name, a, b, k, g, torch.nn.Parameter(
                params[name].detach().reshape(-1)[a:b].clone()))
                for name, a, b, k, g, _ in theirs]
            r.groups = sorted({c.group for c in r.copies})
            if r.copies:
                r.twin = _twin(o.optimizer, [
                    {**_hyper(o.optimizer.param_groups[k]),
                     "params": [c.param for c in r.copies if c.group == k]} for k in r.groups])
            stepped = [(sl, state) for sl, state in mine if state]
            handles = []
            if stepped:
                handles.append(dist.isend(_flat([t for _, s in stepped for t in _moments(s)]),
                                          r.buddy))
            if any(s for *_, s in theirs):
                buf = torch.empty(sum(2 * (c.end - c.start) + 1 for c in r.copies),
                                  dtype=torch.float32)
                handles.append(dist.irecv(buf, r.owner))
            for h in handles:
                h.wait()
            if any(s for *_, s in theirs):
                at = 0
                for c in r.copies:
                    n = c.end - c.start
                    r.twin.state[c.param] = {
                        "exp_avg": buf[at:at + n].clone(), "exp_avg_sq": buf[at + n:at + 2 * n]
                        .clone(), "step": buf[at + 2 * n].clone()}
                    at += 2 * n + 1
        self.ready = True

    def reduce_gradients(self, model) -> None:
        """Before the commit, in place of megatron-core's DistributedDataParallel
        .finish_grad_sync(): each bucket group's reduction is finished in DDP's order, and then
        this rank's reduced shard of it goes to its buddy while its owner's comes into the
        copies' gradients (the LATE ones' wait for send_late)."""
        self._handles = []
        for k, group in enumerate(_bucket_groups(model)):
            group.finish_grad_sync()
            self._exchange(k)

    def send_late(self) -> None:
        """After the sums that follow the DDP reduction: the LATE gradients, then every message
        is complete."""
        self._exchange(LATE)
        for h in self._handles:
            h.wait()
        self._handles = []

    def _exchange(self, bucket: int) -> None:
        for r in self.rings:
            mine = [p.main_grad.reshape(-1)[a:b] for k, p, a, b in r.mine if k == bucket]
            if mine:   # the main grads' slices, as the owner's step reads them
                self._handles.append(dist.isend(_flat(mine), r.buddy))
            theirs = [c for c in r.copies if c.bucket == bucket]
            if theirs:
                buf = torch.empty(sum(c.end - c.start for c in theirs), dtype=torch.float32)
                self._handles.append(dist.irecv(buf, r.owner))
                at = 0
                for c in theirs:
                    c.param.grad = buf[at:at + c.end - c.start]
                    at += c.end - c.start

    @torch.no_grad()
    def step(self, total_norm: float, clip_grad: float, grad_scale: float = 1.0) -> None:
        """After the commit: each copy steps as its owner does (its gradient scaled and clipped
        by the same factors, the same hyperparameters)."""
        for r in self.rings:
            if not r.copies:
                continue
            optimizer_step.scale_and_clip([c.param for c in r.copies], total_norm, clip_grad,
                                          grad_scale)
            for twin_group, k in zip(r.twin.param_groups, r.groups):
                twin_group.update(_hyper(r.optimizer.optimizer.param_groups[k]))
            r.twin.step()

    def pieces(self) -> list[tuple[str, int, int, dict, torch.Tensor]]:
        """(name, start, end, optimizer state, values) of each copy."""
        return [(c.name, c.start, c.end, self._state(r, c), c.param.detach())
                for r in self.rings for c in r.copies]

    @staticmethod
    def _state(r: _Ring, c: _Copy) -> dict:
        return r.twin.state.get(c.param, {}) if r.twin is not None else {}


def _twin(inner: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """An optimizer of `inner`'s class and settings over `groups` (its `defaults` may hold
    settings its constructor does not take, such as AdamW's decoupled_weight_decay)."""
    takes = inspect.signature(type(inner).__init__).parameters
    return type(inner)(groups, **{k: v for k, v in inner.defaults.items() if k in takes})


def _bucket_groups(model) -> list:
    """megatron-core DDP's bucket groups, in the order its finish_grad_sync finishes them."""
    return model.bucket_groups + model.expert_parallel_bucket_groups


def _summed_again(rt) -> set[int]:
    """ids of the parameters whose gradients the executor sums again after the DDP reduction:
    the tied embedding over its first and last stages, and with tensor parallelism those that
    megatron-core's _allreduce_non_tensor_model_parallel_grads picks (its own rule, repeated:
    it offers no list)."""
    out = {id(rt.tied_weight)} if rt.embedding_group is not None else set()
    config = rt.module.config
    if rt.module.pg_collection.tp.size() > 1:
        out |= {id(p) for name, p in rt.model.named_parameters() if p.requires_grad and (
            getattr(p, "average_gradients_across_tp_domain", False)
            or (config.sequence_parallel and getattr(p, "sequence_parallel", False))
            or (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)))}
    return out


def _group_of(inner: torch.optim.Optimizer, shard: torch.Tensor) -> int:
    return next(k for k, g in enumerate(inner.param_groups) if any(p is shard for p in g["params"]))


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _moments(state: dict) -> list[torch.Tensor]:
    return [state["exp_avg"].reshape(-1), state["exp_avg_sq"].reshape(-1),
            state["step"].reshape(1).float()]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().float() for t in tensors])
