"""The six tables of the report, each built from this invocation's runs into a Section (its
markdown, CSVs and plots)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from chameleon_ext.comm import packed as comm
from chameleon_ext.planning.perf_model import Profile, predict_plan
from chameleon_ext.planning.strategies.redundancy import eager_cost
from tools.reproduce import benches, cluster, executed, plots, runs, simulate, traces
from tools.reproduce.report import Section, Table

GIB = 2 ** 30
MIB = 2 ** 20
STRATEGY_ORDER = (*cluster.FIXED, "auto")
TRACE_MODEL = "2.7B"                   # tools/bench/plan_search.py's 32-GPU model
# with --quick, besides TRACE_MODEL: a model at its Megatron-typical tensor parallelism
QUICK_TP_MODEL = "6.7B"
# The paper's published averages (arXiv 2508.21613): the only numbers typed in.
PAPER_RATIOS = {"oobleck": 1.229, "recycle": 1.355}
# auto may trail a fixed policy by this much: it takes the best prediction at each event, which
# is not always the best over the whole trace
AUTO_TOLERANCE = 0.02


@dataclass(frozen=True)
class Options:
    out: Path
    quick: bool
    command: str                       # this invocation's command line
    span_h: float
    mtbf_h: float
    repair_h: float
    checkpoint_min: float
    restart_min: float
    seed: int
    executed_ranks: int                # of table 2's executed traces; 0: none
    seeds: int = 1                     # table 2: traces of each kind, seeds seed, seed + 1, ...
    jobs: int = 1                      # table 2: processes simulating its traces


class Context:
    """What the tables of one invocation share: the CPU runs (tables 3 and 5)."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self._runs: list[runs.CpuRun] | None = None
        self.runs_load = ""

    @property
    def finished_runs(self) -> list[runs.CpuRun] | None:
        """The CPU runs if a table of this invocation made them already."""
        return self._runs

    @property
    def schedule(self) -> runs.Schedule:
        return runs.QUICK if self.options.quick else runs.FULL

    def cpu_runs(self) -> list[runs.CpuRun]:
        if self._runs is None:
            self.runs_load = load_note()
            data = runs.dataset()
            labels = (runs.FAILURE_FREE, *self.schedule.strategies)
            self._runs = [runs.run_one(self.schedule, label, data, self.options.out / "runs")
                          for label in tqdm(labels, desc="CPU runs", unit="run")]
        return self._runs


def load_note() -> str:
    """The machine's load now: measured times grow when other processes share the cores."""
    return (f"The 1-minute load average was {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
            "when these measurements started; other processes on the machine slow measured "
            "times.")


def _profile_text(p: Profile) -> str:
    return f"`{p.source}` ({p.device}; {'; '.join(p.notes)})"


def _models(quick: bool) -> tuple[str, ...]:
    return ("1.3B", "2.7B") if quick else tuple(cluster.SHAPES)


def _setups(quick: bool) -> list[cluster.Setup]:
    """Tables 1 and 2: each model at tensor parallelism 1 and at its typical degree (quick:
    the quick models, and QUICK_TP_MODEL at its typical degree)."""
    if quick:
        return cluster.setups(_models(quick)) + [
            cluster.setup(QUICK_TP_MODEL, cluster.TYPICAL_TP[QUICK_TP_MODEL])]
    return cluster.setups(_models(quick))


def _trace_setups(quick: bool) -> list[cluster.Setup]:
    """Table 2: each model at its typical tensor-parallel degree (quick: TRACE_MODEL at tp 1
    and QUICK_TP_MODEL). Every trace event asks the planner, so the larger models' tp 1 runs
    are left to table 1."""
    if quick:
        return [cluster.setup(TRACE_MODEL),
                cluster.setup(QUICK_TP_MODEL, cluster.TYPICAL_TP[QUICK_TP_MODEL])]
    return [cluster.setup(n, tp) for n, tp in cluster.TYPICAL_TP.items()]


def _failures(quick: bool) -> tuple[int, ...]:
    return (1, 2) if quick else (1, 2, 4)


def _choice(c) -> str:
    """What auto chose, in words."""
    if c is None:
        return "nothing feasible"
    text = f"{c.strategy}: {cluster.layout(c.plan)}"
    if c.switch is not None:
        sw = c.switch
        text += (f", then {sw.strategy} onto {cluster.layout(sw.plan)} ({sw.plan.world_size} "
                 f"GPUs) after the checkpoint of iteration {sw.at_iteration}")
    return text


def _timed(build: Callable[[Context], Section]) -> Callable[[Context], Section]:
    @functools.wraps(build)
    def run(ctx: Context) -> Section:
        t0 = time.perf_counter()
        section = build(ctx)
        section.seconds = time.perf_counter() - t0
        return section
    return run


# ---- table 1 --------------------------------------------------------------------------------
@_timed
def post_recovery(ctx: Context) -> Section:
    """Post-recovery throughput on 32 GPUs, every strategy and auto."""
    quick = ctx.options.quick
    setups, failures = _setups(quick), _failures(quick)
    detail, summary = [], []
    panels: dict[str, tuple[list[str], dict[str, list], float]] = {
        f"{f} failed GPU(s)": ([s.label for s in setups], {s: [] for s in STRATEGY_ORDER},
                               (cluster.GPUS - f) / cluster.GPUS) for f in failures}
    for setup, f in tqdm([(s, f) for s in setups for f in failures], desc="table 1"):
        case = cluster.case(setup.name, f, setup.tp)
        s = case.setup
        limit = (cluster.GPUS - f) / cluster.GPUS
        ratios = {}
        for strategy in STRATEGY_ORDER:
            c = case.outcome(strategy)
            ratio = s.iteration_ms / cluster.steady_ms(c) if c is not None and c.feasible \
                else None
            ratios[strategy] = ratio
            panels[f"{f} failed GPU(s)"][1][strategy].append(ratio)
            status = "no plan" if c is None else "ok" if c.feasible else "does not fit"
            after = cluster.steady_plan(c) if c is not None else None
            detail.append([
                s.name, s.tp, f"{cluster.layout(s.plan)} ({cluster.stage_sizes(s.plan)})",
                s.iteration_ms, s.samples_per_s(s.iteration_ms), f,
                " ".join(map(str, case.failed)), strategy, c.strategy if c else None,
                cluster.layout(after) if after else None, after.world_size if after else None,
                c.iteration_ms if c else None, cluster.steady_ms(c) if c else None,
                s.samples_per_s(cluster.steady_ms(c)) if c else None, ratio, limit,
                ratio / limit if ratio is not None else None,
                c.transition_ms / 1e3 if c else None, c.memory_bytes / GIB if c else None,
                status])
        auto = case.outcome("auto")
        summary.append([s.name, s.tp,
                        f"{cluster.layout(s.plan)} ({cluster.stage_sizes(s.plan)})",
                        f, " ".join(map(str, case.failed)), *(ratios[x] for x in STRATEGY_ORDER),
                        _choice(auto), limit,
                        ratios["auto"] / limit if ratios["auto"] is not None else None])
    r = "{:.3f}"
    tables = [
        Table("table1_summary", [("model", ""), ("tp", ""),
                                 ("failure-free layout dp x pp (layers)", ""),
                                 ("failed GPUs", ""), ("failed ranks", "")] +
              [(f"{x} post/ff", r) for x in STRATEGY_ORDER] +
              [("auto chose", ""), ("limit (N-f)/N", r), ("auto / limit", r)], summary),
        Table("table1", [("model", ""), ("tp", ""), ("failure-free layout", ""),
                         ("failure-free ms/iter", ""), ("failure-free samples/s", ""),
                         ("failed GPUs", ""), ("failed ranks", ""), ("strategy", ""),
                         ("candidate", ""), ("layout after", ""), ("GPUs used", ""),
                         ("first ms/iter", ""), ("steady ms/iter", ""), ("samples/s", ""),
                         ("post/ff", ""), ("limit (N-f)/N", ""), ("post/ff / limit", ""),
                         ("transition s", ""), ("peak memory GiB", ""), ("status", "")],
              detail, markdown=False)]
    png = plots.post_recovery(ctx.options.out / "table1.png", panels)
    first = setups[0]
    return Section(
        1, "Post-recovery throughput, 32 GPUs", ctx.options.command,
        _profile_text(first.profile) + ", from `chameleon_ext.planning.perf_model.analytical_profile"
        f"(shape, \"{cluster.DEVICE}\")`: **analytical**, not measured",
        f"GPT models on {cluster.GPUS} {cluster.DEVICE} GPUs "
        f"({cluster.GPUS // cluster.GPUS_PER_NODE} nodes x {cluster.GPUS_PER_NODE}), sequence 2048, global batch "
        f"{first.global_batch}, micro-batch 1, bf16; each model at tensor parallel (tp) 1 and "
        "at the degree Megatron jobs of its size typically use ("
        + ", ".join(f"{n} tp {t}" for n, t in cluster.TYPICAL_TP.items()) + "). The "
        "failure-free plan is the fastest homogeneous layout the planner finds on all 32 GPUs "
        "at that tp (`planner.replan` seeded with Megatron's tp x pp 4 layout of "
        "`tools/bench/plan_search.py`), so that a recovery cannot beat it merely by a better "
        "layout. Failure i (0-based) takes the GPU of pipeline i mod dp at stage "
        "floor(i x pp / 4), shard i mod tp: whole GPUs, in different pipelines and at "
        "different stages (the failed ranks are listed); with tp > 1 each takes its "
        "tensor-parallel group out of the plan, its healthy GPUs idle (`GPUs used`). Every "
        "figure is computed by the performance model: a prediction. The planner ranks every "
        "strategy's plan over the survivors (`planner.candidates`) at a failure in iteration "
        f"{cluster.FAILED_AT} of {cluster.TOTAL_ITERATIONS}, the last checkpoint at "
        f"{cluster.FAILED_AT // cluster.SAVE_INTERVAL * cluster.SAVE_INTERVAL} (one every "
        f"{cluster.SAVE_INTERVAL}); auto is `planner.choose` over all of them. post/ff = "
        "failure-free iteration time / post-recovery iteration time (every plan keeps the "
        "global batch); limit = (N - f) / N.",
        tables, [png],
        ["Tensor parallelism: every strategy recovers whole tensor-parallel groups (reroute to "
         "a stage's surviving groups, takeover by a neighbouring group, pipelines of whole "
         "groups, restart onto the surviving groups), so a recovery at tp t uses at most "
         "N - f t GPUs (the limit (N - f) / N counts single GPUs). The tensor-parallel "
         "all-reduces of each layer are costed over NVLink (`perf_model.Device.tp_gbps`), and "
         "memory per shard.",
         "post/ff / limit above 1: the survivors' best layout does more per GPU than the "
         "failure-free one (the model predicts less than linear scaling from N - f to N "
         "GPUs, e.g. pipeline bubbles and all-reduce cost), not throughput beyond the GPUs'.",
         "A hybrid (reroute+restart) is shown at its steady state, after its planned switch; "
         "its first phase is the CSV's `first ms/iter`.",
         "n/a: the strategy has no plan for this failure, or its plan does not fit in the "
         "GPU's memory (CSV `status`).",
         "Measured on real GPUs: nothing here; this machine has none."])


# ---- table 2 --------------------------------------------------------------------------------
FIXED_KIND = "fixed intervals (Oobleck's)"
BEST_FIXED = "auto / best fixed policy"


@dataclass(frozen=True)
class KindTrace:
    kind: str                          # the summary's grouping: the traces of one generator
    seed: int
    trace: traces.Trace


def trace_set(o: Options, setup: cluster.Setup) -> list[KindTrace]:
    """Every kind at o.seeds seeds: Oobleck's fixed intervals, Poisson with repair, and the
    designed traces, placed on the setup's failure-free stages."""
    intervals = (1.0, 1 / 6) if o.quick else traces.FIXED_INTERVALS_H
    stages = traces.stage_groups(setup.plan)
    out = []
    for seed in range(o.seed, o.seed + o.seeds):
        kinds = [(FIXED_KIND, traces.fixed_interval(h, cluster.GPUS, o.span_h, o.repair_h, seed))
                 for h in intervals]
        kinds += [(t.name, t) for t in (
            traces.poisson(o.mtbf_h, cluster.GPUS, o.span_h, o.repair_h, seed),
            traces.stage_outage(stages, o.span_h, seed),
            traces.alternating_stages(stages, o.span_h, seed),
            traces.around_checkpoints(cluster.GPUS, o.span_h, o.checkpoint_min / 60, o.repair_h,
                                      seed))]
        out += [KindTrace(k, seed, dataclasses.replace(t, name=f"{t.name}, seed {seed}"))
                for k, t in kinds]
    return out


def trace_outcomes(o: Options, setups: list[cluster.Setup]) -> tuple[
        dict[str, list[KindTrace]], dict[tuple[str, str, str], simulate.Outcome]]:
    """(setup label -> its traces, (setup label, trace, policy) -> its outcome); each trace's
    policies simulated in one of o.jobs processes (the same outcomes in any number)."""
    costs = simulate.Costs(o.checkpoint_min, o.restart_min)
    sets = {s.label: trace_set(o, s) for s in setups}
    tasks = [(s, k.trace) for s in setups for k in sets[s.label]]
    out = {}
    with tqdm(total=sum(len(t.events) for _, t in tasks) * len(simulate.POLICIES),
              desc="table 2: trace events") as bar:
        if o.jobs == 1:
            done = (simulate.every_policy(s, t, costs, bar.update) for s, t in tasks)
        else:
            # spawned, not forked: the parent may hold torch's threads (tables 5 and 6); a
            # child imports tools/reproduce/simulate.py, without torch
            pool = concurrent.futures.ProcessPoolExecutor(
                o.jobs, mp_context=multiprocessing.get_context("spawn"))
            done = pool.map(simulate.every_policy, *zip(*tasks), itertools.repeat(costs))
        try:
            for (s, t), outcomes in zip(tasks, done):
                for p, outcome in zip(simulate.POLICIES, outcomes):
                    out[s.label, t.name, p.name] = outcome
                if o.jobs > 1:
                    bar.update(len(t.events) * len(simulate.POLICIES))
        finally:
            if o.jobs > 1:
                pool.shutdown(cancel_futures=True)
    return sets, out


def best_fixed_line(ratios: list[float], where: str) -> str:
    """Table 2's last lines: auto over the best fixed policy of each trace."""
    return (f"auto vs the best fixed policy: min {min(ratios):.3f}, median "
            f"{statistics.median(ratios):.3f} over {len(ratios)} traces ({where})")


def _geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) \
        if xs and all(0 < x < math.inf for x in xs) else math.inf


@_timed
def traces_table(ctx: Context) -> Section:
    """Average throughput under failure traces, every policy; auto's ratios beside the paper's."""
    o = ctx.options
    setups = _trace_setups(o.quick)
    sets, outcomes = trace_outcomes(o, setups)
    policies = simulate.POLICIES
    fixed = [p for p in policies if p.name != "auto"]
    rows, ratio_rows = [], []
    series: dict[str, list[float]] = {p.label: [] for p in policies}
    groups = []
    # kind -> ratio -> auto / that policy over each (setup, trace) of the kind
    by_kind: dict[str, dict[str, list[float]]] = {}
    for s in setups:
        ff = s.samples_per_s(s.iteration_ms)
        ratios: dict[str, list[float]] = {p.name: [] for p in policies}
        for kt in sets[s.label]:
            t = kt.trace
            if kt.seed == o.seed:       # the plot shows one seed: a bar group per trace
                groups.append(f"{s.label}: {t.name}")
            tputs = {p.name: outcomes[s.label, t.name, p.name].samples_per_s(s.global_batch)
                     for p in policies}
            auto = tputs["auto"]
            kind = by_kind.setdefault(kt.kind, {})
            for p in policies:
                out = outcomes[s.label, t.name, p.name]
                tput = tputs[p.name]
                if kt.seed == o.seed:
                    series[p.label].append(tput / ff)
                ratios[p.name].append(auto / tput if tput > 0 else math.inf)
                if p.name != "auto":
                    kind.setdefault(f"auto / {p.label}", []).append(ratios[p.name][-1])
                rows.append([s.name, s.tp, cluster.layout(s.plan), t.name, t.failures, p.label,
                             tput, tput / ff,
                             ", ".join(f"{k} {v}" for k, v in out.recoveries.most_common()),
                             out.fallbacks, out.replans, out.transition_h, out.stalled_h])
            best = max(tputs[p.name] for p in fixed)
            kind.setdefault(BEST_FIXED, []).append(auto / best if best > 0 else math.inf)
            ratio_rows.append([s.name, s.tp, t.name, ratios["oobleck"][-1],
                               PAPER_RATIOS["oobleck"], ratios["recycle"][-1],
                               PAPER_RATIOS["recycle"], ratios["bamboo"][-1],
                               ratios["megatron"][-1]])
        ratio_rows.append([s.name, s.tp, "all traces (geometric mean)",
                           _geomean(ratios["oobleck"]), PAPER_RATIOS["oobleck"],
                           _geomean(ratios["recycle"]), PAPER_RATIOS["recycle"],
                           _geomean(ratios["bamboo"]), _geomean(ratios["megatron"])])
    every = {name: [x for kind in by_kind.values() for x in kind[name]]
             for name in next(iter(by_kind.values()))}
    summary = [[kind, name, len(xs), min(xs), statistics.median(xs), max(xs)]
               for kind, named in [*by_kind.items(), ("all traces", every)]
               for name, xs in named.items()]
    r = "{:.3f}"
    # with several seeds the per-trace tables are CSV only; the summary gives their spread
    per_trace = o.seeds == 1
    tables = [
        Table("table2_summary", [("trace kind", ""), ("ratio", ""), ("traces", ""),
                                 ("min", r), ("median", r), ("max", r)], summary),
        Table("table2_ratios", [("model", ""), ("tp", ""), ("trace", ""),
                                ("auto / Oobleck-like", r), ("paper: auto / Oobleck", r),
                                ("auto / ReCycle-like", r), ("paper: auto / ReCycle", r),
                                ("auto / Bamboo-like (state replication)", r),
                                ("auto / Megatron restart", r)],
              ratio_rows, markdown=per_trace),
        Table("table2", [("model", ""), ("tp", ""), ("failure-free layout", ""), ("trace", ""),
                         ("failures", ""), ("policy", ""), ("samples/s", "{:.1f}"),
                         ("/ failure-free", r), ("recoveries", ""),
                         ("fallbacks to restart", ""),
                         ("planned moves (rejoins, switches)", ""), ("in transition h", "{:.2f}"),
                         ("stalled h", "{:.2f}")], rows, markdown=per_trace)]
    png = plots.trace_throughput(o.out / "table2.png", groups, series)
    lines = [best_fixed_line(every[BEST_FIXED], "simulated")]
    if o.executed_ranks:
        measured, measured_notes, executed_best = _executed_traces(o)
        lines.append(best_fixed_line(executed_best, "executed"))
    else:
        measured, measured_notes = [], ["Executed traces: none (--executed-ranks 0)."]
    tables += measured
    first = setups[0]
    upkeep = eager_cost(first.plan, first.profile)
    peak = predict_plan(first.plan, first.profile).peak_memory_bytes
    return Section(
        2, "Average throughput under failure traces, 32 GPUs", o.command,
        _profile_text(first.profile) + ": **analytical**",
        "GPT " + ", ".join(f"{s.label} (failure-free {cluster.layout(s.plan)}, "
                           f"{s.iteration_ms:.1f} ms/iteration, "
                           f"{s.samples_per_s(s.iteration_ms):.1f} samples/s)" for s in setups)
        + f" on {cluster.GPUS} {cluster.DEVICE} GPUs, {o.span_h:g} h of training simulated "
        "event by event (`tools/reproduce/simulate.py`) with the planner's predicted iteration "
        "and transition times: every figure is computed by the performance model, a "
        "prediction. With tensor parallelism (tp) a failed GPU takes its group out of the plan; "
        "its healthy GPUs idle until a rejoin re-plans. Whole groups a plan leaves out wait as "
        "spares, which auto may substitute for a lost group (as the job's decider offers "
        "them). The work a recovery loses (the interrupted iteration; for a restart, every "
        "iteration since the checkpoint) is trained again on the new plan: an event during "
        "the recovery does not give it back. Traces, each kind at "
        f"{o.seeds} seed(s) from {o.seed}: a failure at fixed intervals (Oobleck's), and "
        f"Poisson failures with an MTBF of {o.mtbf_h:g} h, the failed GPU drawn among those "
        f"up and back after {o.repair_h:g} h; and three designed traces "
        "(`tools/reproduce/traces.py`), each a case where one fixed policy is wrong: three "
        "losses of one stage's replicas within minutes, back after 3 h (rerouting); a loss "
        "every hour in alternating stages, back after 5 min (restarting); "
        "losses 2 min after and 2 min before a checkpoint (restarting). The summary gives "
        "auto's ratio to each policy over each kind's traces and models (min, median, max); "
        "*best fixed policy* is the fastest of the four on each trace. With every GPU back the "
        "job returns to the failure-free plan; with some back it moves to the policy's plan "
        "over the GPUs up when that pays within the next interval. Policies: **auto** (the "
        "planner's choice among every strategy and the reroute+restart hybrid), "
        "**Oobleck-like** (reparallelize only), **ReCycle-like** (reroute only), "
        "**Bamboo-like, state replication** (takeover with eager redundancy: each stage's "
        "parameters and Adam moments copied to its neighbour every iteration, "
        "`strategies.redundancy.eager_cost`; Bamboo itself recomputes the neighbour's layers "
        "on the same micro-batches instead, which is not modelled), "
        f"**Megatron restart** (checkpoint every {o.checkpoint_min:g} min, each recovery "
        f"relaunches the job over the GPUs up: {o.restart_min:g} min, plus the work since "
        "the checkpoint; a GPU back waits for the next relaunch, as a running Megatron job "
        "cannot grow). A "
        "policy whose strategy has no feasible plan falls back to restart (counted). The "
        "columns labelled *paper* are the paper's published averages, not computed here.",
        tables, [png],
        [f"Bamboo-like upkeep on {first.label}: {upkeep.sync_ms:.1f} ms added to each "
         f"failure-free iteration ({100 * upkeep.sync_ms / first.iteration_ms:.0f}%), "
         f"{upkeep.memory_bytes / GIB:.1f} GiB more per GPU (peak "
         f"{(peak + upkeep.memory_bytes) / GIB:.1f} of "
         f"{first.profile.device_memory_bytes / GIB:.0f} GiB).",
         f"auto takes the best prediction at each event, which is not always best over the "
         f"whole trace (it costs the next failure one step ahead, not the plans after it); the "
         f"test allows it to trail a fixed policy by {100 * AUTO_TOLERANCE:.0f}% on the fixed-interval and "
         "Poisson traces; on the designed ones it may trail more (the summary's min).",
         *measured_notes,
         *lines])


# The executed traces: --quick runs one kill on a short job, under auto, an in-process fixed
# policy and Megatron's relaunches (the others are in-process strategies like it), at a
# dilation too small to be a valid emulation on 2 cores (it shows the machinery, the table
# says so); the full version runs every policy on three traces with rejoins (fixed intervals,
# Poisson, the stage outage) at a dilation valid at 8 ranks here. The quick job's 9 iterations
# are the fewest around its kill at 6: the calibration's warm-up before it (executed.FIRST_KILL),
# the margin to recover after it (LAST_MARGIN).
EXECUTED_QUICK = dict(iterations=9, every=6, repair=None, dilation=3.0, poisson=False,
                      outage=False, policies=("auto", "recycle", "megatron"))
EXECUTED_FULL = dict(iterations=48, every=12, repair=executed.default_repair(12), dilation=33.0,
                     poisson=True, outage=True, policies=tuple(p.name for p in simulate.POLICIES))


def _executed_traces(o: Options) -> tuple[list[Table], list[str], list[float]]:
    """Table 2's measured part: the traces executed by real jobs on emulated devices, every
    policy (--quick: three; tools/reproduce/executed.py), auto's measured ratios beside the predicted and the
    paper's; and auto's measured ratio over the best fixed policy of each trace."""
    e = EXECUTED_QUICK if o.quick else EXECUTED_FULL
    work = o.out / "runs" / "traces"
    work.mkdir(parents=True, exist_ok=True)
    c = executed.Config(o.executed_ranks, 2, e["dilation"],
                        executed.default_profile(work / "device.json"), runs.dataset(),
                        e["every"])
    trs = executed.trace_set(e["iterations"], e["every"], e["every"] if e["poisson"] else None,
                             c.plan, e["repair"], o.seed, outage=e["outage"])
    load = load_note()
    policies = [p for p in simulate.POLICIES if p.name in e["policies"]]
    with tqdm(total=1 + len(trs) * len(policies), desc="table 2: executed runs",
              unit="run") as bar:
        cmp = executed.compare(c, trs, policies, 1, work, on_run=lambda _: bar.update())
    ff = cmp.failure_free_samples_per_s
    reference = cmp.failure_free[0].losses
    rows, ratio_rows = [], []
    best: dict[str, float] = {}
    for t in trs:
        kills = ", ".join(f"rank {k.rank} at {k.iteration}" for k in t.kills)
        for p in policies:
            [m] = cmp.runs[t.name, p.name]
            rows.append([t.name, kills, p.label, m.samples_per_s, m.samples_per_s / ff,
                         cmp.predicted_samples_per_s(t.name, p.name),
                         cmp.predicted_samples_per_s(t.name, p.name) / cmp.predicted_failure_free,
                         ", ".join(f"{k} {v}" for k, v in m.recoveries.most_common()),
                         m.rejoins, runs.max_relative_difference(m.losses, reference),
                         100 * m.overrun_share, "yes" if m.valid else "NO"])
            if p.name != "auto":
                # auto / the best fixed policy: the least of auto / each
                best[t.name] = min(best.get(t.name, math.inf), cmp.ratio(t.name, p.name))
                ratio_rows.append([t.name, f"auto / {p.label}", cmp.ratio(t.name, p.name),
                                   cmp.predicted_ratio(t.name, p.name),
                                   PAPER_RATIOS.get(p.name)])
    r = "{:.3f}"
    tables = [
        Table("table2_executed_ratios", [("trace", ""), ("ratio", ""), ("measured", r),
                                         ("predicted (model)", r), ("paper", r)], ratio_rows),
        Table("table2_executed", [("trace", ""), ("kills (launch rank at iteration)", ""),
                                  ("policy", ""), ("measured samples/s", "{:.2f}"),
                                  ("measured / failure-free", r),
                                  ("predicted samples/s (model)", "{:.2f}"),
                                  ("predicted / failure-free (model)", r), ("recoveries", ""),
                                  ("rejoins", ""), ("loss vs failure-free", "{:.1e}"),
                                  ("overrun %", "{:.2f}"), ("valid emulation", "")], rows)]
    repair = "; ".join(
        f"{t.name}: each killed slot started again {t.repair} iterations of failure-free time "
        "after its kill, joining the job" if t.repair else f"{t.name}: no rejoins" for t in trs)
    notes = [
        f"**Executed traces (measured):** {c.ranks} ranks on this machine, pipeline 2 x data "
        f"{c.ranks // 2} (layers {cluster.stage_sizes(c.plan)}: the planner's balance), each "
        f"emulating an {executed.DEFAULT_SHAPE.num_layers}-layer-shaped GPT (micro-batches of "
        f"{executed.DEFAULT_SHAPE.micro_batch_size}) layer per layer on an analytical H200 "
        f"(`--chameleon-emulate`, dilation "
        f"{c.dilation:g}; `tools/reproduce/executed.py`). Traces of {trs[0].iterations} "
        f"iterations: {', '.join(t.name for t in trs)}, each loss a SIGKILL from outside "
        "(`tools/inject_failure.py --trace`) at a wall-clock instant, the middle of its "
        f"iteration on the failure-free clock, whatever the job does then; {repair}. One "
        "trace interval "
        f"({c.interval:g} iterations) stands for an hour: a checkpoint every "
        f"{c.save_interval} iterations (30 min), a Megatron relaunch of "
        f"{c.relaunch_wall_s:.1f} s of wall time (5 min) of which the real relaunch here "
        f"already takes the start-up ({cmp.failure_free[0].startup_s:.1f} s in the "
        "failure-free run), and the checkpoint storage compressed alike. Measured: samples "
        "per second of wall time from the end of iteration 1 (a warm-up every policy shares) "
        "to the end of the last, transitions included; failure-free "
        f"{ff:.2f} samples/s. *predicted (model)* is tools/reproduce/simulate.py on the same "
        "trace and emulated device, the time it takes to train the same iterations: a "
        "prediction, its host costs calibrated from the runs (a recovery's rebuild: the "
        "policy's median measured; Megatron's relaunch: its mean measured, kill to the "
        "next launch's first iteration). The *paper* column is the paper's "
        "published 32-GPU average, not computed here. " + load,
        "A run whose *valid emulation* is NO had more than 1% of its ops overrun their "
        "emulated time: its timing is this host's, not the profile's (raise the dilation)."]
    return tables, notes, list(best.values())


# ---- table 3 --------------------------------------------------------------------------------
@_timed
def convergence(ctx: Context) -> Section:
    """Loss curves of real CPU runs: failure-free and one kill under each strategy."""
    cpu = ctx.cpu_runs()
    reference = cpu[0].losses()
    curves = {run.label: run.losses() for run in cpu}
    long_rows = [[run.label, i + 1, loss, abs(loss - reference[i]) / abs(reference[i])]
                 for run in cpu for i, loss in enumerate(curves[run.label])]
    summary = []
    for run in cpu[1:]:
        rec = run.event("recovery") or {}
        summary.append([run.label, rec.get("strategy"), len(curves[run.label]),
                        curves[run.label][-1],
                        runs.max_relative_difference(curves[run.label], reference),
                        rec.get("reconfigure_ms"), rec.get("lost_iterations")])
    png = plots.loss_curves(ctx.options.out / "table3.png", curves, runs.FAILURE_FREE,
                            ctx.schedule.kill_at)
    sched = ctx.schedule
    return Section(
        3, "Convergence: the loss trajectory through a failure (CPU runs)", ctx.options.command,
        "none for the losses (measured); each recovery's planner used the job's live "
        f"`{_recovery_profile(cpu)}` profile",
        f"Real training runs on this machine's CPU: GPT with 4 layers, hidden 64 "
        f"(`tests/launch.py` SMALL_MODEL) on pipeline {runs.PIPELINE} x data "
        f"{runs.DATA_PARALLEL} under chameleon-launch, global batch {runs.GLOBAL_BATCH}, "
        f"{sched.iterations} iterations, a checkpoint every {sched.save_interval}; in each "
        f"failure run rank {runs.VICTIM} is killed in the backward of iteration "
        f"{sched.kill_at} and the strategy is forced (`--chameleon-strategy`). The CSV holds "
        "every run's loss per iteration and its relative difference from the failure-free run.",
        [Table("table3_summary", [("forced strategy", ""), ("recovery ran", ""),
                                  ("iterations", ""), ("final loss", "{:.5f}"),
                                  ("max relative loss difference vs failure-free", "{:.2e}"),
                                  ("reconfigure ms", "{:.0f}"), ("iterations lost", "")],
               summary),
         Table("table3", [("run", ""), ("iteration", ""), ("loss", ""),
                          ("relative difference vs failure-free", "")], long_rows,
               markdown=False)],
        [png], [ctx.runs_load] + [f"{run.label}: `{run.command}`" for run in cpu])


def _recovery_profile(cpu: list[runs.CpuRun]) -> str:
    found = {(run.event("recovery") or {}).get("profile") for run in cpu[1:]} - {None}
    return ", ".join(sorted(found)) or "none"


# ---- table 4 --------------------------------------------------------------------------------
@_timed
def memory(ctx: Context) -> Section:
    """Peak memory per GPU under each strategy: estimated on the 32-GPU cluster, measured on
    the CPU runs when this invocation made them."""
    quick = ctx.options.quick
    models, failures = _models(quick), _failures(quick)
    rows = []
    series: dict[str, list[float | None]] = {"failure-free": [], **{s: [] for s in
                                                                    STRATEGY_ORDER},
                                             "failure-free + eager shadows": []}
    device = 0
    for name in models:
        s = cluster.setup(name)
        device = s.profile.device_memory_bytes
        base = predict_plan(s.plan, s.profile).peak_memory_bytes
        shadows = base + eager_cost(s.plan, s.profile).memory_bytes
        for f in failures:
            case = cluster.case(name, f)
            gib = {x: (case.outcome(x).memory_bytes / GIB if case.outcome(x) else None)
                   for x in STRATEGY_ORDER}
            over = [x for x in cluster.FIXED if gib[x] is not None and
                    gib[x] * GIB > device]
            rows.append([name, f, base / GIB, *(gib[x] for x in STRATEGY_ORDER),
                         shadows / GIB, device / GIB, ", ".join(over) or "none"])
            if f == failures[0]:
                series["failure-free"].append(base / GIB)
                for x in STRATEGY_ORDER:
                    series[x].append(gib[x])
                series["failure-free + eager shadows"].append(shadows / GIB)
    g = "{:.1f}"
    png = plots.memory(ctx.options.out / "table4.png", list(models), series, device / GIB)
    first = cluster.setup(models[0])
    tables = [Table("table4", [("model", ""), ("failed GPUs", ""), ("failure-free GiB", g)] +
                    [(f"{x} GiB", g) for x in STRATEGY_ORDER] +
                    [("failure-free + eager shadows GiB", g), ("device GiB", "{:.0f}"),
                     ("over device memory", "")], rows)]
    measured, note = _measured_memory(ctx.finished_runs)
    if measured:
        mib = "{:.2f}"
        tables.append(Table("table4_cpu", [
            ("run", ""), ("rank", ""), ("measured MiB", mib), ("state MiB", mib),
            ("shadows MiB", mib), ("activations MiB", mib), ("estimated MiB", mib),
            ("measured / estimated", "{:.3f}")], measured))
    return Section(
        4, "Memory per GPU per strategy", ctx.options.command,
        _profile_text(first.profile) + ": **analytical**" + (
            f"; the CPU runs' estimates: their live `{_recovery_profile(ctx.finished_runs)}` "
            "profile" if measured else ""),
        "The planner's estimate of the largest per-GPU memory (`Candidate.memory_bytes`: "
        "parameters, gradients, optimizer state and the most activations held at once, from "
        "the simulated schedule) for the cases of table 1, beside the failure-free plan's "
        "(`perf_model.predict_plan(...).peak_memory_bytes`) and, for Bamboo-style eager "
        "redundancy, the failure-free plan plus its shadow copies "
        "(`strategies.redundancy.eager_cost(...).memory_bytes`): **estimated**. " + note,
        tables, [png],
        [f"The plot shows {failures[0]} failed GPU; the CSV every failure count."])


def _measured_memory(cpu: list[runs.CpuRun] | None) -> tuple[list[list], str]:
    """Rows of measured against estimated memory per rank from the CPU runs' `memory` events
    (logged at the end of a run), and a sentence saying where they come from or why none."""
    if cpu is None:
        return [], ("Measured memory: none in this invocation; it comes from the CPU runs of "
                    "table 3, so run `table3 table4` (or `all`) for it.")
    rows = []
    for run in cpu:
        event = run.event("memory")
        for r in event["ranks"] if event else []:
            rows.append([run.label, r["rank"], r["measured_bytes"] / MIB,
                         r.get("state_bytes", 0) / MIB, r.get("shadows_bytes", 0) / MIB,
                         r.get("activations_bytes", 0) / MIB, r["estimated_bytes"] / MIB,
                         r["measured_bytes"] / r["estimated_bytes"]])
    if not rows:
        return [], ("Measured memory: none. The CPU runs' metrics files hold no `memory` event "
                    "and their output no measured figure, only the planner's estimates "
                    "(`memory_mib` of each recovery candidate), so nothing measured is shown.")
    return rows, ("Measured: the CPU runs of table 3 (the metrics file's `memory` event at the "
                  "end of each run, every rank of its last plan: training state, shadow copies "
                  "and the most activations held at once) beside the plan's estimate with the "
                  "run's calibrated profile.")


# ---- table 5 --------------------------------------------------------------------------------
@_timed
def accuracy(ctx: Context) -> Section:
    """Performance-model accuracy on the CPU runs, and plan-search time by cluster size."""
    quick = ctx.options.quick
    cpu = ctx.cpu_runs()
    acc = []
    for run in cpu[1:]:
        p = run.event("prediction")
        acc.append([run.label, p["strategy"] if p else None,
                    p["predicted_iter_ms"] if p else None, p["measured_iter_ms"] if p else None,
                    p["iterations"] if p else None, p["relative_error"] if p else None])
    errors = [row[-1] for row in acc if row[-1] is not None]
    sizes = [32, 1024] if quick else sorted(benches.plan_search.CLUSTERS)
    failures = [1] if quick else [1, 2, 4, 8]
    with tqdm(total=len(sizes) * len(failures), desc="table 5: plan search") as bar:
        found = benches.search_times(sizes, failures, 1 if quick else 3, bar.update)
    search_rows = [[x.gpus, x.layout, x.failed, x.median_ms, x.target_ms, x.chosen]
                   for x in found]
    by_failures = {f: ([x.gpus for x in found if x.failed == f],
                       [x.median_ms for x in found if x.failed == f]) for f in failures}
    measured = [row for row in acc if row[2] is not None]
    pngs = [plots.accuracy(ctx.options.out / "table5_accuracy.png",
                           [row[0] for row in measured], [row[2] for row in measured],
                           [row[3] for row in measured]),
            plots.search_time(ctx.options.out / "table5_search.png", by_failures,
                              {x.gpus: x.target_ms for x in found})]
    search_profile = cluster.setup(TRACE_MODEL).profile
    summary = (f"median relative error {100 * statistics.median(errors):.1f}%, maximum "
               f"{100 * max(errors):.1f}% over {len(errors)} recoveries") if errors else \
        "no recovery logged a prediction"
    return Section(
        5, "Performance-model accuracy and plan-search time", ctx.options.command,
        f"(a) the job's live `{_recovery_profile(cpu)}` profile (calibrated from its Megatron "
        f"timers); (b) {_profile_text(search_profile)}: **analytical**",
        "(a) The CPU runs of table 3: after each recovery rank 0 logs the predicted iteration "
        "time of the new plan beside the median of the iterations measured after it (the "
        f"metrics file's `prediction` event): {summary}. (b) The planner's search time (every "
        "candidate predicted and the choice made) for the clusters of "
        "`tools/bench/plan_search.py` (median of its repetitions), failed GPUs spread over "
        "pipelines and stages.",
        [Table("table5_accuracy", [("forced strategy", ""), ("recovery ran", ""),
                                   ("predicted ms/iter", "{:.1f}"),
                                   ("measured ms/iter", "{:.1f}"),
                                   ("iterations measured", ""),
                                   ("relative error", "{:.3f}")], acc),
         Table("table5_search", [("GPUs", ""), ("layout tp x pp x dp", ""),
                                 ("failed GPUs", ""), ("search ms", "{:.1f}"),
                                 ("target ms", "{:.0f}"), ("chosen", "")], search_rows)],
        pngs, [ctx.runs_load] + (["n/a in (a): that run logged no prediction event."]
                                 if len(measured) < len(acc) else []))


# ---- table 6 --------------------------------------------------------------------------------
@_timed
def fused_comm(ctx: Context) -> Section:
    """Packed messages and the csrc kernels against plain torch."""
    quick = ctx.options.quick
    load = load_note()
    peers = [2] if quick else [2, 4]
    with tqdm(total=len(peers) * len(benches.PAYLOADS), desc="table 6: gloo jobs") as bar:
        steps = benches.gloo_steps(peers, 2 if quick else 10, 5 if quick else 20, bar.update)
    kernels = benches.kernels(5 if quick else 21)
    built = comm._C is not None
    ext = "csrc" if built else "csrc NOT BUILT: torch"
    gloo_rows = [[x.peers, x.payload, x.separate_ms, x.packed_torch_ms, x.packed_ext_ms,
                  x.separate_ms / x.packed_ext_ms, x.packed_torch_ms / x.packed_ext_ms]
                 for x in steps]
    kernel_rows = [[k.op, k.baseline, k.data, k.torch_us, k.ext_us, k.torch_us / k.ext_us]
                   for k in kernels]
    ms, us, x = "{:.3f}", "{:.1f}", "{:.2f}"
    return Section(
        6, "Fused communication: with and without the csrc kernels", ctx.options.command,
        "none (measured directly: gloo on 127.0.0.1 and this CPU)",
        "`tools/bench/fused_comm.py`'s measurements, called from here. (a) A rerouted step on "
        "gloo: rank 0 sends K micro-batch activations to each of P peers, as K separate "
        "messages or one packed message per peer, packed by the torch fallback or by the "
        "compiled kernels; the slowest rank's median step time. (b) The kernels against the "
        f"torch ops a caller would write otherwise (median per call). chameleon_ext.comm.packed "
        f"backend: {benches.extension()}.",
        [Table("table6_gloo", [("peers", ""), ("payload per peer", ""),
                               ("separate messages ms", ms), ("packed, torch ms", ms),
                               (f"packed, {ext} ms", ms), ("separate / packed " + ext, x),
                               ("torch / " + ext, x)], gloo_rows),
         Table("table6_kernels", [("op", ""), ("torch baseline", ""), ("data", ""),
                                  ("torch us", us), (f"{ext} us", us),
                                  ("torch / " + ext, x)], kernel_rows)],
        [],
        [load] + ([] if built else ["The compiled extension is not built here, so the columns "
                                    "marked as csrc ran the torch fallback too."]))


TABLES: dict[str, Callable[[Context], Section]] = {
    "table1": post_recovery, "table2": traces_table, "table3": convergence,
    "table4": memory, "table5": accuracy, "table6": fused_comm}
