"""Execution plans: which ranks run which layers of which pipeline, on which micro-batches.

A plan is the single description of a parallel layout that every other part reads: the schedule
generators, the simulator, the process-group builder and the executor. Plans are plain data and
round-trip through JSON so that the planner can publish them on the store and users can write them.
"""

from __future__ import annotations

import copy

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn


class PlanError(ValueError):
    """A plan that cannot run; the message says what is wrong."""


def _where(at: tuple[int, int, int]) -> str:
    return f"pipeline {at[0]} stage {at[1]}"


def stage_bounds(num_layers: int, stages: int, first: int | None = None,
                 last: int | None = None) -> list[int]:
    """The layer boundaries [0, b1, ..., num_layers] of `stages` pipeline stages: `first` and
    `last` layers on the end stages where given, the rest split evenly over the others, as
    Megatron-LM splits them (the even split has to come out whole)."""
    def fail(msg: str) -> NoReturn:
        raise PlanError(msg)

    fixed = [n for n in (first, last) if n is not None]
    if any(n < 1 for n in fixed):
        fail("the first and last stages' layers must be at least 1")
    ends = len(fixed)
    if ends and stages < 2:
        fail("uneven first or last stages need a pipeline of at least 2 stages")
    rest, middle = num_layers - sum(fixed), stages - ends
    given = " and ".join(f"{n} on the {end} stage" for n, end in ((first, "first"),
                                                                  (last, "last"))
                         if n is not None)
    if rest < middle or (middle == 0 and rest != 0):
        fail(f"{num_layers} layers do not fill {stages} stages with {given}")
    if middle and rest % middle:
        fail(f"number of layers {num_layers} is not divisible by pipeline parallel size "
             f"{stages}" if not ends else
             f"with {given}, the other {middle} stage(s) cannot split the {rest} layers left "
             "evenly")
    sizes = [rest // middle if middle else 0] * stages
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return bounds


@dataclass
class Stage:
    """Layers [layer_start, layer_end) of one pipeline, held by `ranks` (one per tensor-parallel rank).

    A stage whose ranks are lost has `ranks == []` and `hosts`: for each micro-batch of its
    pipeline, the ranks of a surviving stage with the same layers (in another pipeline) that run
    those layers for it (data rerouting)."""

    layer_start: int
    layer_end: int
    ranks: list[int]
    hosts: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass
class Pipeline:
    """A chain of stages that together hold every layer once, and the global micro-batches it runs.

    In an interleaved pipeline (Megatron-LM's virtual pipeline stages) a rank group holds
    several stages of its pipeline, none next to another: each of them is one of its model
    chunks."""

    stages: list[Stage]
    micro_batches: list[int]


@dataclass(frozen=True)
class RankPosition:
    pipeline: int
    stage: int
    tp_rank: int


@dataclass
class ExecutionPlan:
    num_layers: int
    tensor_parallel: int
    micro_batch_size: int
    num_micro_batches: int
    pipelines: list[Pipeline]
    generation: int = 0
    _positions: dict[int, RankPosition] = field(default_factory=dict, init=False, repr=False,
                                                compare=False)
    _chunks: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False,
                                          compare=False)
    _interleaved: bool = field(default=False, init=False, repr=False, compare=False)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def failure_free(cls, world_size: int, tensor_parallel: int, pipeline_parallel: int,
                     num_layers: int, micro_batch_size: int, global_batch_size: int,
                     first_stage_layers: int | None = None,
                     last_stage_layers: int | None = None,
                     virtual_stages: int = 1) -> "ExecutionPlan":
        """Megatron's homogeneous layout, in its rank order (tp fastest, then dp, then pp);
        with `first_stage_layers` / `last_stage_layers` (Megatron-LM's
        --decoder-first/last-pipeline-num-layers) those stages hold that many layers and the
        stages between split the rest evenly. With `virtual_stages` V > 1 (Megatron-LM's
        interleaved pipeline) each pipeline has V x pipeline_parallel stages, stage k held by
        the rank group of position k mod pipeline_parallel."""
        if tensor_parallel < 1 or pipeline_parallel < 1:
            raise PlanError("tensor and pipeline parallel sizes must be at least 1")
        if world_size < 1 or micro_batch_size < 1:
            raise PlanError(f"world size ({world_size}) and micro batch size ({micro_batch_size})"
                            " must be at least 1")
        if world_size % (tensor_parallel * pipeline_parallel) != 0:
            raise PlanError(
                f"world size {world_size} is not divisible by tensor parallel size {tensor_parallel}"
                f" x pipeline parallel size {pipeline_parallel}")
        dp = world_size // (tensor_parallel * pipeline_parallel)
        if virtual_stages > 1 and (pipeline_parallel < 2 or first_stage_layers is not None
                                   or last_stage_layers is not None):
            raise PlanError("an interleaved pipeline needs at least 2 stages, evenly split")
        bounds = stage_bounds(num_layers, pipeline_parallel * virtual_stages,
                              first_stage_layers, last_stage_layers)
        if global_batch_size % (micro_batch_size * dp) != 0:
            raise PlanError(f"global batch size {global_batch_size} is not divisible by micro batch "
                            f"size {micro_batch_size} x data parallel size {dp}")
        num_mb = global_batch_size // micro_batch_size
        per_pipeline = num_mb // dp
        pipelines = []
        for d in range(dp):
            stages = [
                Stage(bounds[s], bounds[s + 1],
                      [t + tensor_parallel * (d + dp * (s % pipeline_parallel))
                       for t in range(tensor_parallel)])
                for s in range(pipeline_parallel * virtual_stages)
            ]
            pipelines.append(Pipeline(stages, list(range(d * per_pipeline, (d + 1) * per_pipeline))))
        plan = cls(num_layers, tensor_parallel, micro_batch_size, num_mb, pipelines)
        plan.validate()
        return plan

    # ---- queries ------------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return sorted(self._index())

    @property
    def world_size(self) -> int:
        return len(self._index())

    @property
    def global_batch_size(self) -> int:
        return self.num_micro_batches * self.micro_batch_size

    def position(self, rank: int) -> RankPosition:
        try:
            return self._index()[rank]
        except KeyError:
            raise PlanError(f"rank {rank} has no place in the plan") from None

    def stage_of(self, rank: int) -> Stage:
        """The rank's stage (in an interleaved plan, its first chunk's)."""
        pos = self.position(rank)
        return self.pipelines[pos.pipeline].stages[pos.stage]

    def chunks(self, rank: int) -> list[int]:
        """The indices in its pipeline of the stages `rank` holds, ascending: one, or its model
        chunks in an interleaved plan."""
        self.position(rank)
        return self._chunks[rank]

    @property
    def interleaved(self) -> bool:
        """Some rank holds more than one stage (Megatron-LM's virtual pipeline stages)."""
        self._index()
        return self._interleaved

    def pipeline_of(self, rank: int) -> Pipeline:
        return self.pipelines[self.position(rank).pipeline]

    def is_first_stage(self, rank: int) -> bool:
        """Whether `rank` holds its pipeline's first stage (the embeddings)."""
        return self.chunks(rank)[0] == 0

    def is_last_stage(self, rank: int) -> bool:
        """Whether `rank` holds its pipeline's last stage (the output layer and the loss)."""
        return self.chunks(rank)[-1] == len(self.pipeline_of(rank).stages) - 1

    def next_rank(self, rank: int, stage: int | None = None) -> int | None:
        """The rank of the same tensor-parallel shard after stage `stage` (default: the rank's
        first) of its pipeline; None after the last."""
        pos = self.position(rank)
        s = pos.stage if stage is None else stage
        stages = self.pipelines[pos.pipeline].stages
        return None if s + 1 == len(stages) else stages[s + 1].ranks[pos.tp_rank]

    def prev_rank(self, rank: int, stage: int | None = None) -> int | None:
        pos = self.position(rank)
        s = pos.stage if stage is None else stage
        stages = self.pipelines[pos.pipeline].stages
        return None if s == 0 else stages[s - 1].ranks[pos.tp_rank]

    def path(self, microbatch: int) -> list[list[int]]:
        """The tensor-parallel rank groups a micro-batch passes through, first layer to last."""
        for p in self.pipelines:
            if microbatch in p.micro_batches:
                return [st.ranks or st.hosts[microbatch] for st in p.stages]
        raise PlanError(f"micro-batch {microbatch} is owned by no pipeline")

    @property
    def rerouted(self) -> bool:
        return any(not st.ranks for p in self.pipelines for st in p.stages)

    def replicas(self, rank: int) -> list[int]:
        """Ranks holding exactly the same layers and tensor-parallel shard: the gradient-reduction group."""
        mine = self.stage_of(rank)
        tp = self.position(rank).tp_rank
        out = []
        for p in self.pipelines:
            for st in p.stages:
                if st.ranks and (st.layer_start, st.layer_end) == (mine.layer_start,
                                                                   mine.layer_end):
                    out.append(st.ranks[tp])
        return sorted(out)

    def misaligned_stages(self) -> tuple[Stage, Stage] | None:
        """Two stages whose layer ranges overlap without being equal, if any: their gradients
        cannot be reduced by whole-stage replica groups."""
        ranges = sorted({(st.layer_start, st.layer_end) for p in self.pipelines for st in p.stages})
        for (a0, a1), (b0, b1) in zip(ranges, ranges[1:]):
            if b0 < a1:
                find = {(st.layer_start, st.layer_end): st for p in self.pipelines for st in p.stages}
                return find[(a0, a1)], find[(b0, b1)]
        return None

    def segments(self) -> list[tuple[int, int]]:
        """The layer ranges [a, b) that the stage boundaries of all pipelines together cut the
        model into, first to last. In an aligned plan they are the stages' own ranges; in a
        misaligned one every stage is a union of consecutive segments, and a segment's
        gradients are summed over every rank whose stage contains it (segment_ranks)."""
        cuts = sorted({0, self.num_layers} | {st.layer_start for p in self.pipelines
                                              for st in p.stages})
        return list(zip(cuts, cuts[1:]))

    def segment_ranks(self, layer_start: int, layer_end: int, tp_rank: int) -> list[int]:
        """Ranks of tensor-parallel shard `tp_rank` whose stage holds all of layers
        [layer_start, layer_end), sorted."""
        return sorted(st.ranks[tp_rank] for p in self.pipelines for st in p.stages
                      if st.ranks and st.layer_start <= layer_start
                      and layer_end <= st.layer_end)

    def first_stage_ranks(self, tp_rank: int) -> list[int]:
        """Ranks of shard `tp_rank` that hold a first stage (word and position embeddings)."""
        return sorted(p.stages[0].ranks[tp_rank] for p in self.pipelines if p.stages[0].ranks)

    def last_stage_ranks(self, tp_rank: int) -> list[int]:
        """Ranks of shard `tp_rank` that hold a last stage (final norm, output layer)."""
        return sorted(p.stages[-1].ranks[tp_rank] for p in self.pipelines if p.stages[-1].ranks)

    # ---- tensor-parallel groups: the unit that fails and recovers ------------------------------
    def tp_groups(self) -> list[list[int]]:
        """The ranks of each stage that has ranks (one tensor-parallel group each, once however
        many chunks it holds), ordered by their lowest rank."""
        groups = {tuple(st.ranks) for p in self.pipelines for st in p.stages if st.ranks}
        return sorted((list(g) for g in groups), key=min)

    def surviving_groups(self, lost: set[int] | list[int]) -> list[list[int]]:
        """The tensor-parallel groups none of whose ranks is in `lost`, by lowest rank."""
        lost = set(lost)
        return [g for g in self.tp_groups() if not lost.intersection(g)]

    def survivors(self, lost: set[int] | list[int], size: int | None = None) -> list[int]:
        """The ranks a plan over the survivors of losing `lost` runs on, in the order of their
        new numbers (new rank i is the i-th): the ranks of surviving_groups(lost). A group is
        the unit that fails: its healthy ranks leave with a lost one (no group can run without
        one of its shards). With `size` (a plan that uses fewer, such as a restart's), the
        first size // tensor_parallel of those groups."""
        groups = self.surviving_groups(lost)
        if size is not None:
            groups = groups[:size // self.tensor_parallel]
        return sorted(r for g in groups for r in g)

    # ---- derived plans ------------------------------------------------------------------------
    def with_micro_batches(self, num_micro_batches: int) -> "ExecutionPlan":
        """This layout running `num_micro_batches` per iteration, split into equal contiguous
        blocks over its pipelines as failure_free splits them (a batch ramp's next batch)."""
        dp = len(self.pipelines)
        if num_micro_batches % dp:
            raise PlanError(f"{num_micro_batches} micro-batches do not split over {dp} pipelines")
        k = num_micro_batches // dp
        plan = ExecutionPlan(self.num_layers, self.tensor_parallel, self.micro_batch_size,
                             num_micro_batches,
                             [Pipeline([copy.deepcopy(st) for st in p.stages],
                                       list(range(i * k, (i + 1) * k)))
                              for i, p in enumerate(self.pipelines)], self.generation)
        plan.validate()
        return plan

    def relabelled(self, mapping: dict[int, int], generation: int | None = None
                   ) -> "ExecutionPlan":
        """A new plan: this one with every rank r (of its stages and hosts) named mapping[r],
        at `generation` (default: this one's), validated."""
        def names(ranks: list[int]) -> list[int]:
            return [mapping[r] for r in ranks]

        pipelines = [Pipeline([Stage(st.layer_start, st.layer_end, names(st.ranks),
                                     {mb: names(rs) for mb, rs in st.hosts.items()})
                               for st in p.stages], list(p.micro_batches))
                     for p in self.pipelines]
        new = ExecutionPlan(self.num_layers, self.tensor_parallel, self.micro_batch_size,
                            self.num_micro_batches, pipelines,
                            self.generation if generation is None else generation)
        new.validate()
        return new

    def renumbered(self) -> "ExecutionPlan":
        """This plan as the successor of the one its ranks come from: its ranks numbered
        densely in their order (as a recovery numbers its new world: new rank i is the i-th
        rank it keeps, survivors()), the generation advanced, validated."""
        return self.relabelled({r: i for i, r in enumerate(self.ranks)}, self.generation + 1)

    def _index(self) -> dict[int, RankPosition]:
        """Each rank's position (its first stage's) and its stages, built once."""
        if not self._positions:
            for pi, p in enumerate(self.pipelines):
                for si, st in enumerate(p.stages):
                    for t, r in enumerate(st.ranks):
                        self._positions.setdefault(r, RankPosition(pi, si, t))
                        self._chunks.setdefault(r, []).append(si)
            self._interleaved = any(len(c) > 1 for c in self._chunks.values())
        return self._positions

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise PlanError naming the first thing that makes this plan unrunnable."""
        if self.num_layers < 1:
            raise PlanError("num_layers must be at least 1")
        if self.tensor_parallel < 1 or self.micro_batch_size < 1 or self.num_micro_batches < 1:
            raise PlanError("tensor_parallel, micro_batch_size and num_micro_batches must be >= 1")
        if not self.pipelines:
            raise PlanError("plan has no pipelines")
        seen: dict[int, tuple[int, int, int]] = {}
        owners: dict[int, int] = {}
        for pi, p in enumerate(self.pipelines):
            if not p.stages:
                raise PlanError(f"pipeline {pi} has no stages")
            expect = 0
            for si, st in enumerate(p.stages):
                where = f"pipeline {pi} stage {si}"
                if st.layer_start != expect:
                    raise PlanError(f"{where} starts at layer {st.layer_start}, expected {expect}: "
                                    "stages must cover contiguous layer ranges")
                if st.layer_end <= st.layer_start:
                    raise PlanError(f"{where} has an empty layer range "
                                    f"[{st.layer_start}, {st.layer_end})")
                if not st.ranks:
                    self._validate_hosts(pi, si, p, where)
                elif st.hosts:
                    raise PlanError(f"{where} has ranks and hosts: only a stage without ranks is "
                                    "hosted")
                elif len(st.ranks) != self.tensor_parallel:
                    raise PlanError(f"{where} has {len(st.ranks)} ranks, tensor parallel size is "
                                    f"{self.tensor_parallel}")
                for t, r in enumerate(st.ranks):
                    if not isinstance(r, int) or r < 0:
                        raise PlanError(f"{where} names an invalid rank {r!r}")
                    if r in seen and not self._another_chunk(seen[r], (pi, si, t)):
                        raise PlanError(f"rank {r} appears in {_where(seen[r])} and {where}")
                    seen[r] = (pi, si, t)
                expect = st.layer_end
            if expect != self.num_layers:
                raise PlanError(f"pipeline {pi} covers layers [0, {expect}), the model has "
                                f"{self.num_layers}")
            for mb in p.micro_batches:
                if not 0 <= mb < self.num_micro_batches:
                    raise PlanError(f"pipeline {pi} owns micro-batch {mb}, outside "
                                    f"[0, {self.num_micro_batches})")
                if mb in owners:
                    raise PlanError(f"micro-batch {mb} is owned by pipelines {owners[mb]} and {pi}")
                owners[mb] = pi
        missing = sorted(set(range(self.num_micro_batches)) - set(owners))
        if missing:
            raise PlanError(f"micro-batches {missing} are owned by no pipeline")

    def _another_chunk(self, before: tuple[int, int, int], now: tuple[int, int, int]) -> bool:
        """Whether a rank's stage `now` (pipeline, stage, tensor-parallel index) after its stage
        `before` is a further model chunk of an interleaved pipeline: the same pipeline and
        shard, not the next stage (a rank never sends to itself), neither stage hosted."""
        (pb, sb, tb), (pn, sn, tn) = before, now
        stages = self.pipelines[pn].stages
        return (pb, tb) == (pn, tn) and sn > sb + 1 and \
            all(not st.hosts for st in (stages[sb], stages[sn]))

    def _validate_hosts(self, pi: int, si: int, p: Pipeline, where: str) -> None:
        st = p.stages[si]
        if sorted(st.hosts) != sorted(p.micro_batches):
            raise PlanError(f"{where} has no ranks, so each of its pipeline's micro-batches needs "
                            f"a host; hosts cover {sorted(st.hosts)}, the pipeline owns "
                            f"{sorted(p.micro_batches)}")
        replicas = [q.ranks for qi, other in enumerate(self.pipelines) if qi != pi
                    for q in other.stages
                    if q.ranks and (q.layer_start, q.layer_end) == (st.layer_start, st.layer_end)]
        for mb, ranks in st.hosts.items():
            if list(ranks) not in replicas:
                raise PlanError(f"{where}: micro-batch {mb} is hosted by ranks {ranks}, which do "
                                f"not hold layers [{st.layer_start}, {st.layer_end}) in another "
                                "pipeline")

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The inverse of from_dict, built field by field: dataclasses.asdict's deep copies
        were most of the time of a cached prediction, whose key this is (perf_model.layout_key)."""
        def stage(st: Stage) -> dict:
            d = {"layer_start": st.layer_start, "layer_end": st.layer_end,
                 "ranks": list(st.ranks)}
            if st.hosts:
                d["hosts"] = {str(mb): list(r) for mb, r in sorted(st.hosts.items())}
            return d

        return {"num_layers": self.num_layers, "tensor_parallel": self.tensor_parallel,
                "micro_batch_size": self.micro_batch_size,
                "num_micro_batches": self.num_micro_batches,
                "pipelines": [{"stages": [stage(st) for st in p.stages],
                               "micro_batches": list(p.micro_batches)} for p in self.pipelines],
                "generation": self.generation}

    @classmethod
    def from_dict(cls, d: dict) -> "ExecutionPlan":
        try:
            plan = cls(
                num_layers=int(d["num_layers"]),
                tensor_parallel=int(d["tensor_parallel"]),
                micro_batch_size=int(d["micro_batch_size"]),
                num_micro_batches=int(d["num_micro_batches"]),
                pipelines=[
                    Pipeline([Stage(int(s["layer_start"]), int(s["layer_end"]), list(s["ranks"]),
                                    {int(mb): list(r) for mb, r in s.get("hosts", {}).items()})
                              for s in p["stages"]], [int(m) for m in p["micro_batches"]])
                    for p in d["pipelines"]
                ],
                generation=int(d.get("generation", 0)),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise PlanError(f"malformed plan: {type(e).__name__}: {e}") from None
        plan.validate()
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ExecutionPlan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise PlanError("plan JSON must be an object")
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "ExecutionPlan":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlanError(f"cannot read plan file {path}: {e.strerror}") from None
        return cls.from_json(text)
