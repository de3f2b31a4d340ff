"""What ReCycle's staggered optimizer would gain on rerouted schedules, by simulation.

For each layout and each loss (one GPU of every stage in turn, then two GPUs of one stage in two
pipelines), the rerouted plan's schedule (the one the executor runs) is timed two ways under the
analytical H200 profile: with the synchronous step the executor runs (every rank waits for the
commit, so the iteration time is the simulated makespan) and with each rank stepping on its own
(chameleon_ext.schedule.staggered: back-to-back iterations coupled only by messages and replica
reductions). Prints both and the gain, then min / median / max of the gain over the cases. Every
figure is computed by the performance model; nothing here runs a job.

    python tools/bench/staggered_optimizer.py [--iterations 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from chameleon_ext.plan.execution_plan import ExecutionPlan  # noqa: E402
from chameleon_ext.planning.perf_model import (ModelShape, ProfileCosts,  # noqa: E402
                                               analytical_profile, planned_schedule)
from chameleon_ext.planning.strategies.reroute import reroute  # noqa: E402
from chameleon_ext.schedule.simulator import simulate  # noqa: E402
from chameleon_ext.schedule.staggered import DEFAULT_ITERATIONS, staggered_period  # noqa: E402

PROG = "staggered_optimizer.py"
GPT_1_3B = ModelShape(24, 2048, 16, 2048, 1, 50304)
GPT_2_7B = ModelShape(32, 2560, 32, 2048, 1, 51200, bytes_per_element=2)
# (name, GPUs, pipeline depth, micro-batches per pipeline, model): the executed traces' layout,
# the post-recovery benchmark's, and the paper's 32 GPUs (plan_search.py's 32-GPU cluster).
LAYOUTS = [
    ("1.3B pipeline 2 x data 4", 8, 2, 4, GPT_1_3B),
    ("1.3B pipeline 4 x data 4", 16, 4, 8, GPT_1_3B),
    ("2.7B pipeline 4 x data 8", 32, 4, 16, GPT_2_7B),
]


def losses(plan: ExecutionPlan) -> list[tuple[str, set[int]]]:
    """One GPU of each stage (pipeline 1's), then two of each stage (pipelines 1 and 2's)."""
    depth = len(plan.pipelines[0].stages)
    one = [(f"stage {s}", {plan.pipelines[1].stages[s].ranks[0]}) for s in range(depth)]
    two = [(f"stage {s} x2", {plan.pipelines[p].stages[s].ranks[0] for p in (1, 2)})
           for s in range(depth)] if len(plan.pipelines) > 2 else []
    return one + two


def _hosts(plan: ExecutionPlan, rank: int) -> bool:
    """Whether `rank` runs rerouted micro-batches."""
    return any(rank in ranks for p in plan.pipelines for st in p.stages
               for ranks in st.hosts.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS,
                   help="back-to-back iterations simulated for the staggered period (>= 2)")
    a = p.parse_args(argv)
    if a.iterations < 2:
        print(f"{PROG}: error: --iterations {a.iterations}: at least 2", file=sys.stderr)
        return 2
    gains = []
    print(f"{'layout':>26} | {'lost':>10} | {'synchronous ms':>14} | {'staggered ms':>12} | "
          f"{'gain (simulated)':>16} | last to finish")
    for name, gpus, depth, per_pipeline, shape in LAYOUTS:
        profile = analytical_profile(shape, "H200")
        dp = gpus // depth
        ff = ExecutionPlan.failure_free(gpus, 1, depth, shape.num_layers, 1, per_pipeline * dp)
        for label, lost in losses(ff):
            plan = reroute(ff, lost)
            schedule = planned_schedule(plan)
            costs = ProfileCosts(plan, profile)
            res = simulate(plan, schedule, costs, validate=False, timeline=False)
            stag = staggered_period(plan, schedule, costs, a.iterations)
            gain = res.iteration_time / stag - 1
            gains.append(0.0 if abs(gain) < 1e-9 else gain)  # rounding, not a loss
            last = max(res.rank_finish, key=res.rank_finish.get)
            print(f"{name:>26} | {label:>10} | {res.iteration_time:14.1f} | {stag:12.1f} | "
                  f"{100 * gains[-1]:+15.2f}% | stage {plan.position(last).stage}"
                  + (" (hosts)" if _hosts(plan, last) else ""), flush=True)
    print(f"\nstaggered over synchronous step, rerouted schedules: min {100 * min(gains):+.2f}%, "
          f"median {100 * statistics.median(gains):+.2f}%, max {100 * max(gains):+.2f}% "
          f"over {len(gains)} cases (simulated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
