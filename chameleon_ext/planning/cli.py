"""chameleon-plan: the planner's ranked candidates for a failure, without training.

    chameleon-plan --profile run/profile.json --world-size 32 --pipeline-parallel 4 \\
        --global-batch-size 128 --fail 5 [--iteration 100 --checkpoint-iteration 50] [--json]
    chameleon-plan --device H200 --num-layers 32 --hidden-size 2560 --num-attention-heads 32 \\
        --seq-length 2048 --micro-batch-size 1 --vocab-size 51200 --world-size 32 \\
        --pipeline-parallel 4 --global-batch-size 128 --fail 5,6 --mtbf 6 --repair-minutes 30

The profile is a measured one (saved by a run as profile.json next to its checkpoints, or by
tools/profile_model.py) or, with --device, the analytical one of that device (labelled so).
With --tensor-parallel > 1 a lost rank takes its whole tensor-parallel group out: the plans run
on the other groups, the new rank i on the i-th rank of `members` (JSON). With --repair-minutes
each candidate is costed over the failure-repair cycle (planner's module docstring): its window
cost, its move back when the slot returns and its cost of absorbing the next failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

from chameleon_ext.plan.execution_plan import ExecutionPlan, PlanError
from chameleon_ext.planning.perf_model import DEVICES, ModelShape, Profile, ProfileError, \
    analytical_profile, predict
from chameleon_ext.planning.planner import STRATEGIES, Situation, candidates, choose, window
from chameleon_ext.schedule.choice import choose_schedule


class UsageError(ValueError):
    pass


@dataclass(frozen=True)
class Query:
    """What the command line asks: a profile, the plan before the failure, the lost ranks."""

    profile_file: str | None            # --profile, or else
    device: str | None                  # --device, with the model's shape below
    num_layers: int | None
    hidden_size: int | None
    num_attention_heads: int | None
    seq_length: int | None
    micro_batch_size: int | None
    vocab_size: int | None
    bf16: bool
    plan_file: str | None               # --plan, or else the layout below
    world_size: int | None
    tensor_parallel: int
    pipeline_parallel: int
    global_batch_size: int | None       # in samples
    fail: str                           # the lost ranks, comma-separated (checked on the plan)
    iteration: int                      # the interrupted one
    checkpoint_iteration: int
    train_iters: int
    mtbf_hours: float | None            # the planner's horizon
    repair_hours: float | None          # when the lost slot is back (None: the horizon rule)
    strategies: tuple[str, ...]
    json: bool                          # machine-readable output


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own errors: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r} is not positive")
    return value


def parse(argv: list[str] | None) -> Query:
    p = _Parser(prog="chameleon-plan", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="a profile JSON (measured, offline or analytical)")
    src.add_argument("--device", choices=sorted(DEVICES), help="the analytical profile of it")
    m = p.add_argument_group("model (with --device)")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--micro-batch-size", "--vocab-size"):
        m.add_argument(flag, type=int)
    m.add_argument("--bf16", action="store_true", help="2-byte activations (analytical)")
    c = p.add_argument_group("cluster and failure")
    c.add_argument("--plan", help="the plan before the failure (JSON); else the flags below")
    c.add_argument("--world-size", type=int)
    c.add_argument("--tensor-parallel", type=int, default=1)
    c.add_argument("--pipeline-parallel", type=int, default=1)
    c.add_argument("--global-batch-size", type=int, help="in samples")
    c.add_argument("--fail", required=True, help="lost ranks, comma-separated")
    c.add_argument("--iteration", type=int, default=100, help="the interrupted iteration")
    c.add_argument("--checkpoint-iteration", type=int, default=0)
    c.add_argument("--train-iters", type=int, default=10_000)
    c.add_argument("--mtbf", type=_positive, help="hours between failures (the horizon)")
    c.add_argument("--repair-minutes", type=_positive,
                   help="minutes until a lost slot is back (the failure-repair cycle)")
    c.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    a = p.parse_args(argv)
    return Query(
        profile_file=a.profile, device=a.device, num_layers=a.num_layers,
        hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        seq_length=a.seq_length, micro_batch_size=a.micro_batch_size, vocab_size=a.vocab_size,
        bf16=a.bf16, plan_file=a.plan, world_size=a.world_size,
        tensor_parallel=a.tensor_parallel, pipeline_parallel=a.pipeline_parallel,
        global_batch_size=a.global_batch_size, fail=a.fail, iteration=a.iteration,
        checkpoint_iteration=a.checkpoint_iteration, train_iters=a.train_iters,
        mtbf_hours=a.mtbf,
        repair_hours=None if a.repair_minutes is None else a.repair_minutes / 60,
        strategies=tuple(s.strip() for s in a.strategies.split(",")),
        json=a.json)


def _profile(q: Query) -> Profile:
    if q.profile_file:
        return Profile.load(q.profile_file)
    need = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
            "vocab_size")
    missing = [f"--{n.replace('_', '-')}" for n in need if getattr(q, n) is None]
    if missing:
        raise UsageError(f"--device needs the model: {' '.join(missing)}")
    shape = ModelShape(*(getattr(q, n) for n in need), bytes_per_element=2 if q.bf16 else 4)
    return analytical_profile(shape, q.device)


def _plan(q: Query, profile: Profile) -> ExecutionPlan:
    if q.plan_file:
        return ExecutionPlan.load(q.plan_file)
    if q.world_size is None or q.global_batch_size is None:
        raise UsageError("give --plan, or --world-size and --global-batch-size")
    return ExecutionPlan.failure_free(q.world_size, q.tensor_parallel, q.pipeline_parallel,
                                      profile.shape.num_layers, profile.shape.micro_batch_size,
                                      q.global_batch_size)


def _lost(text: str, plan: ExecutionPlan) -> set[int]:
    try:
        lost = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise UsageError(f"--fail {text!r}: not a comma-separated list of ranks") from None
    bad = sorted(lost - set(plan.ranks))
    if not lost or bad:
        raise UsageError(f"--fail {text!r}: ranks {bad or '(none)'} are not in the "
                         f"{plan.world_size}-rank plan")
    return lost


def main(argv: list[str] | None = None) -> int:
    q = parse(argv)
    try:
        profile = _profile(q)
        plan = _plan(q, profile)
        lost = _lost(q.fail, plan)
        unknown = sorted(set(q.strategies) - set(STRATEGIES))
        if unknown:
            raise UsageError(f"--strategies: unknown {', '.join(unknown)} "
                             f"(known: {', '.join(STRATEGIES)})")
        t0 = time.perf_counter()
        before = predict(plan, choose_schedule(plan, fuse=False), profile).iteration_ms
        situation = Situation(q.iteration, q.checkpoint_iteration,
                              q.train_iters - q.iteration + 1, q.mtbf_hours, before,
                              repair_hours=q.repair_hours)
        ranked = candidates(plan, lost, profile, situation, q.strategies)
        win = window(situation, before)
        search_ms = (time.perf_counter() - t0) * 1e3
    except (ProfileError, PlanError, UsageError) as e:
        print(f"chameleon-plan: error: {e}", file=sys.stderr)
        return 2
    best = choose(ranked)
    if q.json:
        print(json.dumps({"profile": {"source": profile.source, "device": profile.device},
                          "failure_free_iter_ms": round(before, 3), "search_ms": round(search_ms, 1),
                          "window": {"iterations": round(win.iterations, 1),
                                     "repair_first": round(win.repair_first, 4),
                                     "failure_first": round(win.failure_first, 4)},
                          "candidates": [c.summary() for c in ranked],
                          "chosen": best.summary() if best else None,
                          "plan": best.plan.to_dict() if best else None,
                          "members": plan.survivors(lost, best.plan.world_size) if best
                          else None}, indent=1))
        return 0 if best else 1
    print(f"profile: {profile.source} ({profile.device}); {plan.world_size} ranks, "
          f"{len(plan.pipelines)} pipeline(s) x {len(plan.pipelines[0].stages)} stage(s); "
          f"failure-free {before:.1f} ms/iteration; lost rank(s) {sorted(lost)}")
    leaving = sorted(set(plan.ranks) - lost - set(plan.survivors(lost)))
    if leaving:
        print(f"tensor parallel {plan.tensor_parallel}: rank(s) {leaving} leave with their "
              "groups")
    print(f"window: {win.iterations:.0f} iteration(s) of {before:.1f} ms; the repair first "
          f"{win.repair_first:.3f}, the next failure first {win.failure_first:.3f}"
          + ("" if q.repair_hours else " (no --repair-minutes: the horizon rule)"))
    print(f"{'strategy':<15} | {'layout':<36} | {'ranks':>5} | {'iter ms':>9} | "
          f"{'transition ms':>13} | {'move back ms':>12} | {'next failure ms':>15} | "
          f"{'memory MiB':>10} | {'window cost s':>13}")
    for c in ranked:
        s = c.summary()
        total = f"{s['total_ms'] / 1e3:.1f}" if s["total_ms"] is not None else "infeasible"
        print(f"{c.strategy:<15} | {s['layout']:<36} | {s['world']:>5} | "
              f"{c.iteration_ms:9.1f} | {c.transition_ms:13.1f} | {c.move_back_ms:12.1f} | "
              f"{c.next_failure_ms:15.1f} | {s['memory_mib']:10.1f} | {total:>13}")
    print(f"chosen: {best.strategy if best else 'none (no feasible plan)'}; search took "
          f"{search_ms:.1f} ms")
    return 0 if best else 1


if __name__ == "__main__":
    sys.exit(main())
