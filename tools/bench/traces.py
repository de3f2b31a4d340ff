"""Failure traces executed by real jobs on emulated devices, every policy side by side.

One failure-free run and one job per policy and trace (tools/reproduce/executed.py: SIGKILLs
from outside at wall-clock instants, the middle of set iterations on the failure-free clock,
each killed slot started again `--repair` iterations later; the trace's interval between
failures stands for an hour, and a checkpoint every 30 minutes, a 5-minute relaunch and the
checkpoint storage are compressed with it). Prints each run's measured average throughput
(samples per second of wall time, transitions included) beside the simulator's prediction
for the same trace (the time it takes to train the run's iterations, its host costs
calibrated from the runs: each op's host time, a recovery's rebuild, Megatron's relaunch;
printed with the recoveries it simulated), the spread over
repeats ((largest - smallest) / mean), the host seconds of its in-process transitions
(detection to resume, real here, not compressed), and auto / each policy, measured and
predicted, beside the paper's 1.229 (Oobleck) and 1.355 (ReCycle).

    python tools/bench/traces.py [--ranks 8] [--iters 48] [--every 12] [--poisson 12]
        [--repair 9] [--dilation 33] [--profile PROFILE.json] [--repeats 1]
        [--save-runs RUNS.json] [--workdir DIR]
    python tools/bench/traces.py --from-runs RUNS.json    # the same runs, predicted again
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.training.builtin_data import ensure_builtin_dataset  # noqa: E402
from tools.reproduce import executed, runs, simulate  # noqa: E402
from tools.reproduce.tables import PAPER_RATIOS  # noqa: E402

PROG = "traces.py"


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8, help="emulated devices (8 to 32, even)")
    p.add_argument("--pipeline", type=int, default=2, help="pipeline depth (default 2)")
    p.add_argument("--iters", type=int, default=48, help="iterations each job trains")
    p.add_argument("--every", type=int, default=12,
                   help="the fixed-interval trace: a kill every this many iterations")
    p.add_argument("--poisson", type=float, default=None, metavar="MEAN",
                   help="also a Poisson trace of this mean interval, in iterations")
    p.add_argument("--stage-outage", action="store_true",
                   help="also table 2's designed trace: three of one stage's replicas lost "
                        "minutes apart, each back after 3 trace hours")
    p.add_argument("--skip-fixed", action="store_true",
                   help="leave the fixed-interval trace out (--every still sets the trace hour)")
    p.add_argument("--repair", type=int, default=None,
                   help="iterations until a killed slot starts again (default: 3/4 of "
                        "--every); 0: never")
    p.add_argument("--dilation", type=float, default=33.0,
                   help="--chameleon-emulate-dilation (default 33: valid at 8 ranks here)")
    p.add_argument("--profile", type=Path, default=None,
                   help="the emulated device (default: the analytical H200 of a 1.3B GPT)")
    p.add_argument("--policies", nargs="+", default=[q.name for q in simulate.POLICIES],
                   choices=[q.name for q in simulate.POLICIES])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="of the traces' victims and gaps")
    p.add_argument("--save-runs", type=Path, default=None, metavar="FILE",
                   help="write the runs' measurements there (JSON), to predict them again")
    p.add_argument("--from-runs", type=Path, default=None, metavar="FILE",
                   help="run nothing: the measurements --save-runs wrote, predicted again "
                        "(the other options are then those runs')")
    p.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                   help="keep the runs' plans and metrics (JSON lines) there (default: a "
                        "temporary directory, removed at the end)")
    a = p.parse_args(argv)
    if not 4 <= a.ranks <= 32 or a.ranks % a.pipeline:
        return _fail(f"--ranks {a.ranks}: 4 to 32, a multiple of --pipeline {a.pipeline}")
    if a.every < 2 or a.iters < executed.FIRST_KILL + executed.LAST_MARGIN or a.repeats < 1:
        return _fail("--every must be at least 2, --iters at least "
                     f"{executed.FIRST_KILL + executed.LAST_MARGIN}, --repeats at least 1")
    if a.dilation <= 0 or (a.poisson is not None and a.poisson <= 0):
        return _fail("--dilation and --poisson must be positive")
    if a.skip_fixed and a.poisson is None and not a.stage_outage:
        return _fail("--skip-fixed leaves no trace: add --poisson or --stage-outage")
    if a.profile is not None and not a.profile.is_file():
        return _fail(f"--profile {a.profile}: no such file")
    if a.from_runs is not None and not a.from_runs.is_file():
        return _fail(f"--from-runs {a.from_runs}: no such file")
    if a.workdir is not None and a.workdir.exists() and any(a.workdir.iterdir()):
        return _fail(f"--workdir {a.workdir}: not empty (the runs' files would mix)")
    with tempfile.TemporaryDirectory(prefix="traces-") as tmp:
        work = Path(tmp) if a.workdir is None else a.workdir
        work.mkdir(parents=True, exist_ok=True)
        if a.from_runs is not None:
            try:
                cmp = executed.Comparison.from_json(a.from_runs.read_text(), work)
            except (ValueError, KeyError, TypeError) as e:
                return _fail(f"--from-runs {a.from_runs}: not a file --save-runs wrote "
                             f"({type(e).__name__}: {e})")
            print(f"the runs of {a.from_runs}, predicted again")
            cmp.predict()
        else:
            if "auto" not in a.policies:
                return _fail("--policies must include auto (the ratios are auto over each)")
            try:
                cmp = _run(a, work)
            except executed.TraceSetError as e:
                return _fail(str(e))
            if a.save_runs is not None:
                a.save_runs.write_text(cmp.to_json())
        _report(cmp)
    return 0


def _run(a: argparse.Namespace, work: Path) -> executed.Comparison:
    repair = executed.default_repair(a.every) if a.repair is None else (a.repair or None)
    data = ensure_builtin_dataset(quiet=True, progress=False)
    profile = a.profile or executed.default_profile(work / "device.json")
    c = executed.Config(a.ranks, a.pipeline, a.dilation, profile, data, a.every)
    trs = executed.trace_set(a.iters, a.every, a.poisson, c.plan, repair, a.seed,
                             fixed=not a.skip_fixed, outage=a.stage_outage)
    policies = [q for q in simulate.POLICIES if q.name in a.policies]
    print(f"{a.ranks} emulated ranks, pipeline {a.pipeline}, dilation {a.dilation:g}; "
          f"one trace hour = {a.every} iterations (compression {c.compression:.0f}x): "
          f"checkpoint every {c.save_interval} iterations, relaunch "
          f"{c.relaunch_wall_s:.1f} s of wall time")
    for t in trs:
        print(f"  {t.name}: " + ", ".join(f"rank {k.rank} at iteration {k.iteration}"
                                          for k in t.kills)
              + (f"; each back after {t.repair} iterations" if t.repair else "; no rejoin"),
              flush=True)
    return executed.compare(c, trs, policies, a.repeats, work,
                            on_run=lambda label: print(f"  ran {label}", flush=True))


def _report(cmp: executed.Comparison) -> None:
    trs, policies = cmp.traces, cmp.policies
    ff = cmp.failure_free_samples_per_s
    print(f"\nfailure-free: {ff:.2f} samples/s (iteration {cmp.failure_free[0].median_iteration_ms:.0f} ms)")
    print(f"the prediction's host costs, calibrated from these runs: decided on "
          f"{cmp.iteration_overhead_ms:.0f} ms an iteration (the job's calibration), timed at "
          f"{cmp.op_overhead_ms:.2f} ms per forward or backward op; relaunch " + ", ".join(
              f"{cmp.relaunch_s(t.name):.1f} s ({t.name})" for t in trs))
    print(f"{'trace':>30} | {'policy':>9} | {'samples/s':>9} | {'spread':>6} | {'/ ff':>5} | "
          f"{'predicted':>9} | {'recoveries':>22} | rejoins | host s | loss diff | overruns | "
          f"rebuild ms | simulated recoveries (moves)")
    for t in trs:
        for q in policies:
            ms = cmp.runs[t.name, q.name]
            diff = max(runs.max_relative_difference(m.losses, cmp.failure_free[0].losses)
                       for m in ms)
            rec = ", ".join(f"{k} {v}" for k, v in ms[-1].recoveries.most_common())
            share = max(m.overrun_share for m in ms)
            valid = "" if all(m.valid for m in ms) else " INVALID"
            tput = cmp.samples_per_s(t.name, q.name)
            sim = cmp.predicted[t.name, q.name]
            # a relaunch is not an in-process transition: its time is the trace's relaunch
            host = "-" if q.name == executed.MEGATRON else \
                f"{statistics.fmean(m.transition_s for m in ms):.1f}"
            print(f"{t.name:>30} | {q.name:>9} | {tput:9.2f} | "
                  f"{100 * cmp.spread(t.name, q.name):5.1f}% | {tput / ff:5.2f} | "
                  f"{cmp.predicted_samples_per_s(t.name, q.name):9.2f} | {rec:>22} | "
                  f"{sum(m.rejoins for m in ms):7d} | {host:>6} | {diff:9.1e} | "
                  f"{100 * share:7.2f}%{valid} | {cmp.device(t.name, q.name).rebuild_ms:10.0f} | "
                  + ", ".join(f"{k} {v}" for k, v in sim.recoveries.most_common())
                  + f" ({sim.replans})")
    print(f"\n{'trace':>30} | {'auto / policy':>13} | {'measured':>8} | {'predicted':>9} | paper")
    for t in trs:
        for q in policies:
            if q.name == "auto":
                continue
            print(f"{t.name:>30} | {q.name:>13} | {cmp.ratio(t.name, q.name):8.3f} | "
                  f"{cmp.predicted_ratio(t.name, q.name):9.3f} | "
                  + (f"{PAPER_RATIOS[q.name]:.3f}" if q.name in PAPER_RATIOS else "-"))


if __name__ == "__main__":
    sys.exit(main())
