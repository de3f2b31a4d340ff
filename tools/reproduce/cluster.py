"""The paper's 32-GPU cluster, analytically: 4 nodes of 8 H200s, GPT models of 1.3B to 13B
parameters, and the planner's recovery candidates after some of the GPUs are lost.

The model conventions (sequence 2048, vocabulary 51200, micro-batch 1, global batch 128, bf16,
Megatron's layout tp 1 x pp 4) are tools/bench/plan_search.py's 32-GPU cluster; the other sizes
take GPT-3's shapes (Brown et al. 2020; 13B with hidden 5120, as Megatron-LM configures it).

Each model runs at tensor parallelism 1 and at the degree Megatron jobs of its size typically
use (TYPICAL_TP). A lost GPU takes its whole tensor-parallel group: every strategy plans whole
groups, and the group's healthy GPUs leave the plan.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from chameleon_ext.plan.execution_plan import ExecutionPlan
from chameleon_ext.planning.perf_model import ModelShape, Profile, analytical_profile, predict_plan
from chameleon_ext.planning.planner import STRATEGIES, Candidate, Situation, candidates, choose, replan
from tools.bench.plan_search import CLUSTERS

GPUS = 32
GPUS_PER_NODE = 8
DEVICE = "H200"
# (layers, hidden, attention heads)
SHAPES = {"1.3B": (24, 2048, 16), "2.7B": (32, 2560, 32), "6.7B": (32, 4096, 32),
          "13B": (40, 5120, 40)}
# Megatron-LM's usual tensor-parallel degree for a GPT of each size on 80-141 GB GPUs
TYPICAL_TP = {"1.3B": 1, "2.7B": 1, "6.7B": 2, "13B": 4}
FIXED = ("reroute", "takeover", "reparallelize", "restart")
# Failed GPUs are placed for up to this many failures (failed_ranks).
MAX_FAILED = 4
# A failure in the middle of a 10,000-iteration job checkpointed every 100 iterations.
TOTAL_ITERATIONS, FAILED_AT, SAVE_INTERVAL = 10_000, 5_050, 100


@dataclass
class Setup:
    """One model on the cluster at one tensor-parallel degree, failure-free."""

    name: str
    tp: int
    profile: Profile
    megatron: ExecutionPlan            # plan_search's layout, layers split evenly
    plan: ExecutionPlan                # the fastest homogeneous plan the planner finds
    iteration_ms: float

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch_size

    def samples_per_s(self, iteration_ms: float) -> float:
        return self.global_batch / iteration_ms * 1e3

    @property
    def label(self) -> str:
        return f"{self.name} tp {self.tp}"


def model_shape(name: str) -> ModelShape:
    layers, hidden, heads = SHAPES[name]
    return dataclasses.replace(CLUSTERS[GPUS][3], num_layers=layers, hidden_size=hidden,
                               num_attention_heads=heads)


@functools.cache
def setup(name: str, tp: int = 1) -> Setup:
    """The failure-free plan is the planner's fastest homogeneous layout over all 32 GPUs at
    tensor parallelism `tp` (planner.replan, seeded with Megatron's layout): a recovery can
    then not look faster than failure-free merely by finding a better layout than the
    baseline's."""
    shape = model_shape(name)
    profile = analytical_profile(shape, DEVICE)
    _, pp, gbs, _ = CLUSTERS[GPUS]
    megatron = ExecutionPlan.failure_free(GPUS, tp, pp, shape.num_layers,
                                          shape.micro_batch_size, gbs)
    plan = replan(megatron, set(), profile)
    return Setup(name, tp, profile, megatron, plan, predict_plan(plan, profile).iteration_ms)


def setups(names: tuple[str, ...]) -> list[Setup]:
    """Each model at tensor parallelism 1 and at its TYPICAL_TP."""
    return [setup(n, tp) for n in names for tp in sorted({1, TYPICAL_TP[n]})]


def layout(plan: ExecutionPlan) -> str:
    """`dp x pp`, or the depths of a heterogeneous plan's pipelines; `(tp t)` with tensor
    parallelism."""
    depths = [len(p.stages) for p in plan.pipelines]
    tp = f" (tp {plan.tensor_parallel})" if plan.tensor_parallel > 1 else ""
    if len(set(depths)) == 1:
        return f"{len(depths)} x {depths[0]}{tp}"
    counts = {d: depths.count(d) for d in sorted(set(depths), reverse=True)}
    return " + ".join(f"{n} x {d}" for d, n in counts.items()) + tp


def stage_sizes(plan: ExecutionPlan) -> str:
    return "/".join(str(st.num_layers) for st in plan.pipelines[0].stages)


def failed_ranks(plan: ExecutionPlan, count: int) -> list[int]:
    """Failure i (0-based) takes the GPU of pipeline i mod dp at stage floor(i x pp / 4),
    tensor-parallel shard i mod tp: whole GPUs in different pipelines and at different stages
    (each of another group), and each set holds the smaller ones."""
    if not 0 < count <= MAX_FAILED:
        raise ValueError(f"between 1 and {MAX_FAILED} failed GPUs are placed, not {count}")
    pipelines = plan.pipelines
    depth = len(pipelines[0].stages)
    return [pipelines[i % len(pipelines)].stages[i * depth // MAX_FAILED].ranks[
        i % plan.tensor_parallel] for i in range(count)]


def situation(s: Setup) -> Situation:
    return Situation(iteration=FAILED_AT, checkpoint_iteration=FAILED_AT // SAVE_INTERVAL *
                     SAVE_INTERVAL, remaining_iterations=TOTAL_ITERATIONS - FAILED_AT + 1,
                     failure_free_ms=s.iteration_ms, save_interval=SAVE_INTERVAL)


@dataclass
class Case:
    """Every candidate after `failed` GPUs of `setup` are lost."""

    setup: Setup
    failed: list[int]
    ranked: list[Candidate]

    def outcome(self, strategy: str) -> Candidate | None:
        """The strategy's candidate (None: it has no plan); `auto`: the planner's choice."""
        if strategy == "auto":
            return choose(self.ranked)
        return next((c for c in self.ranked if c.strategy == strategy), None)


@functools.cache
def case(name: str, count: int, tp: int = 1) -> Case:
    s = setup(name, tp)
    lost = failed_ranks(s.plan, count)
    return Case(s, lost, candidates(s.plan, set(lost), s.profile, situation(s), STRATEGIES))


def steady_ms(c: Candidate) -> float:
    """The iteration time a recovery settles on (a hybrid's after its planned switch)."""
    return c.switch.iteration_ms if c.switch is not None else c.iteration_ms


def steady_plan(c: Candidate) -> ExecutionPlan:
    return c.switch.plan if c.switch is not None else c.plan
