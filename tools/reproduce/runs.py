"""Real training runs on this CPU: the small GPT on pipeline 2 x data 2 under chameleon-launch,
failure-free and with one worker killed in the backward of the same iteration under each
forced strategy (tests/launch.py's helpers, as tools/bench/strategies.py uses them). Run them
one after another: the machine has two cores."""

from __future__ import annotations

import math
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron.training.builtin_data import ensure_builtin_dataset
from tests.launch import SMALL_MODEL, last_losses, run_chameleon

PIPELINE, DATA_PARALLEL = 2, 2
VICTIM = 3                             # pipeline 1's last stage
WORLD = PIPELINE * DATA_PARALLEL
GLOBAL_BATCH = 16
FAILURE_FREE = "failure-free"


class RunError(RuntimeError):
    """A CPU run that did not finish cleanly; the message says which and why."""


@dataclass(frozen=True)
class Schedule:
    """How long the runs train, where the kill falls, which strategies face it."""

    iterations: int
    kill_at: int
    save_interval: int                 # a checkpoint before the kill, for restart
    strategies: tuple[str, ...]


FULL = Schedule(24, 8, 6, ("reroute", "takeover", "reparallelize", "restart", "auto"))
# The kill after the calibration's warm-up of three iterations and one measured, and followed
# by the 9 iterations the prediction event needs (the first after a recovery is not measured).
QUICK = Schedule(14, 5, 2, ("reroute", "takeover"))


@dataclass
class CpuRun:
    label: str                         # FAILURE_FREE or the forced strategy
    command: str                       # the launcher command line, metrics file included
    events: list[dict]

    def losses(self) -> list[float]:
        """One loss per iteration (the last run of an iteration a restart ran again)."""
        return last_losses(self.events)

    def event(self, kind: str) -> dict | None:
        return next((e for e in self.events if e["event"] == kind), None)


def arguments(schedule: Schedule, label: str, data: str, checkpoints: Path) -> list[str]:
    args = SMALL_MODEL + [
        "--pipeline-model-parallel-size", str(PIPELINE), "--global-batch-size", str(GLOBAL_BATCH),
        "--train-iters", str(schedule.iterations), "--lr-decay-iters", str(schedule.iterations),
        "--lr", "3e-3", "--data-path", data, "--split", "100,0,0",
        "--log-interval", str(schedule.iterations), "--chameleon",
        "--save", str(checkpoints / label), "--save-interval", str(schedule.save_interval)]
    if label != FAILURE_FREE:
        args += ["--chameleon-strategy", label, "--chameleon-inject",
                 f"kill:rank={VICTIM},iter={schedule.kill_at},phase=backward"]
    return args


def dataset() -> str:
    """The built-in dataset's prefix (built once, as `make data` does)."""
    return ensure_builtin_dataset(quiet=True, progress=False)


def run_one(schedule: Schedule, label: str, data: str, workdir: Path) -> CpuRun:
    """The failure-free run or one strategy's; its metrics file stays in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    name = label.replace("+", "-")
    with tempfile.TemporaryDirectory(prefix="reproduce-ckpt-") as tmp:
        args = arguments(schedule, label, data, Path(tmp))
        run = run_chameleon(WORLD, args, workdir, name=name, timeout=600)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RunError(f"the {label} CPU run exited with {run.returncode}: {last}")
    command = shlex.join(["python", "-m", "chameleon_ext.control.launcher", "--nproc-per-node",
                          str(WORLD), "pretrain_gpt.py", *args,
                          "--chameleon-metrics-file", str(workdir / f"{name}.jsonl")])
    return CpuRun(label, command, run.metrics)


def max_relative_difference(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference per iteration; infinite when the runs differ in
    length (a run that lost iterations is not the reference's trajectory)."""
    if len(losses) != len(reference):
        return math.inf
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
