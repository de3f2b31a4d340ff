"""Gradient reduction for misaligned plans: pipelines that split the layers at different points.

In an aligned plan megatron-core's DDP sums a stage's gradients over its whole-stage replicas.
When pipelines cut the layers differently there are no such replicas (rank 2 holding layers
[0, 4) shares [0, 2) with one rank and [2, 4) with another), so DDP is given this rank alone as its
data-parallel group (its reduction is a no-op) and, after it, every gradient is summed here over
the ranks that hold the same parameter (parallel_state.reduction_groups):

- layers: per segment of the plan (the layers between two consecutive stage boundaries of any
  pipeline), over every rank whose stage contains the segment;
- position (and untied word) embeddings over the first stages, the final norm (and untied output
  layer) over the last stages;
- the tied word embedding over every rank holding either copy (a first stage's word embedding, a
  last stage's output-layer copy, or a single stage's one parameter that already has both
  contributions): one sum of every copy's gradient gives every copy the total.

Each group's gradients (param.main_grad, the DDP buffer's views) are packed into one flat buffer
and summed with one all-reduce; every rank issues its all-reduces in the one global order of
reduction_groups, so no two ranks wait on each other in opposite orders.

Gradient-norm clipping counts a parameter unless `param.shared` is set: here a parameter counts on
exactly one rank of the world, the lowest of its group (for the tied embedding: the lowest
first-stage rank; output-layer copies never count).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from chameleon_ext.plan.execution_plan import ExecutionPlan
from megatron.elastic.parallel_state import ReductionGroup

_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.")


def part_of(name: str, *, layer_offset: int, pre_process: bool, tied_embeddings: bool,
            segments: list[tuple[int, int]]) -> tuple:
    """The reduction part (see ReductionGroup) of a stage model's parameter `name`."""
    m = _LAYER_RE.match(name)
    if m:
        layer = int(m.group(1)) + layer_offset
        for a, b in segments:
            if a <= layer < b:
                return ("layers", a, b)
        raise ValueError(f"layer {layer} of parameter {name} is in no segment {segments}")
    if name == "embedding.word_embeddings.weight":
        return ("tied",) if tied_embeddings else ("embedding",)
    if name.startswith("embedding."):
        return ("embedding",)
    if name.startswith("decoder.final_layernorm."):
        return ("final_norm",)
    if name == "output_layer.weight":
        return ("tied",) if tied_embeddings and not pre_process else ("final_norm",)
    raise ValueError(f"parameter {name}: no gradient-reduction rule (layers, embeddings, final "
                     "norm, output layer)")


def _sort_key(name: str, part: tuple, layer_offset: int) -> str:
    """A name every holder of the parameter agrees on: the global layer index for layers, one
    name for either copy of the tied embedding."""
    if part == ("tied",):
        return "tied"
    return _LAYER_RE.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name,
                         count=1)


@dataclass
class Step:
    """One all-reduce: `params`' gradients summed over `spec.ranks` on `group`."""

    spec: ReductionGroup
    group: dist.ProcessGroup | None  # None: this rank is the only member
    params: list[torch.nn.Parameter]

    def reduce(self) -> None:
        if self.group is None or not self.params:
            return
        grads = [p.main_grad for p in self.params]
        if len(grads) == 1:
            dist.all_reduce(grads[0], group=self.group)
            return
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(summed)


class GradReduction:
    """This rank's gradient all-reduces of a misaligned plan, in the global order."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.position = 0  # the step running now (or failed); len(steps) when all are done

    @classmethod
    def build(cls, plan: ExecutionPlan, rank: int, module: torch.nn.Module,
              grad_groups: list[tuple[ReductionGroup, dist.ProcessGroup | None]],
              tied_embeddings: bool) -> "GradReduction":
        """Assign every parameter of `module` (this rank's stage model) to its group, and set
        `param.shared` so that each parameter counts once in the world's gradient norm."""
        stage = plan.stage_of(rank)
        pos = plan.position(rank)
        first = stage.layer_start == 0
        segments = plan.segments()
        by_part = {part: spec for spec, _ in grad_groups for part in spec.parts}
        named: dict[tuple, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p in module.named_parameters():
            part = part_of(name, layer_offset=stage.layer_start, pre_process=first,
                           tied_embeddings=tied_embeddings, segments=segments)
            spec = by_part.get(part)
            if spec is None:
                raise RuntimeError(f"rank {rank}: parameter {name} ({part}) belongs to no "
                                   "gradient-reduction group of this rank")
            named.setdefault(part, []).append((_sort_key(name, part, stage.layer_start), p))
            p.shared = not counts_in_norm(plan, rank, part, spec, pos.tp_rank, first)
        steps = []
        for spec, group in grad_groups:
            params = [p for part in spec.parts
                      for _, p in sorted(named.get(part, []), key=lambda kv: kv[0])]
            steps.append(Step(spec, group, params))
        return cls(steps)

    def run(self) -> None:
        """Every all-reduce, in order (REDUCE_GRADS, after DDP's own no-op reduction)."""
        self.position = 0
        for self.position, step in enumerate(self.steps):
            step.reduce()
        self.position = len(self.steps)

    def drain(self, lost: set[int], resume: bool) -> None:
        """After a failure: join the all-reduces live peers may still wait for, those not yet
        over (`resume`: the one at `position` failed on this rank, those before it are done;
        else none has run) whose group has no member in `lost` (a group with a lost member
        cannot complete). Errors are ignored: the iteration runs again."""
        for step in self.steps[self.position + 1 if resume else 0:]:
            if lost & set(step.spec.ranks):
                continue
            try:
                step.reduce()
            except RuntimeError:
                continue


def counts_in_norm(plan: ExecutionPlan, rank: int, part: tuple, spec: ReductionGroup,
                   tp_rank: int, first: bool) -> bool:
    """Whether this rank's copy of a parameter of `part` counts in the global gradient norm:
    on the lowest rank of its group; the tied embedding on the lowest first-stage rank (a last
    stage's output-layer copy never counts)."""
    if part == ("tied",):
        return first and rank == min(plan.first_stage_ranks(tp_rank))
    return rank == min(spec.ranks)
