"""Failure-injection specs: where and how a worker fails on purpose.

Grammar (one spec): ``KIND:key=value,key=value,...``

=======  ===========================================  ===========================================
kind     what fire() does                             keys
=======  ===========================================  ===========================================
kill     SIGKILL itself                               rank, iter, [phase]
exit     a clean non-zero exit (os._exit(code))       rank, iter, [phase], [code=1..255, default 1]
hang     stops making progress: SIGSTOP itself        rank, iter, [phase], [mode=stop|sleep]
         (mode=stop, default: heartbeats stop too),
         or sleeps forever in the calling thread
         (mode=sleep: heartbeats go on)
slow     from iteration `iter` (default 0) on, each   rank, factor (> 1, default 2), [iter],
         matching phase takes `factor` times as long  [phase] (default: every phase)
=======  ===========================================  ===========================================

Phases (``_`` may stand for ``-``):

- in a training step: forward, backward, grad-reduce, optimizer, commit (inside the step's
  commit: after this rank's vote, before it applies the step), between-iterations (before the
  step; the default of kill, exit and hang);
- outside the steps: checkpoint (inside a save, after this rank wrote its part), eval (inside
  an evaluation), shutdown (after the last iteration, before the final save and reports);
- inside a reconfiguration (iteration: the interrupted one): recovery (after the survivors
  agreed, before the new world is built), rebuild (while the new world's groups are created),
  transfer (while the state moves to the new plan's ranks), copies (as the new world sets its
  buddy copies up, --chameleon-shard-redundancy buddy).

``rank`` is the rank the worker started with (generation 0).
Several specs are separated by ``;`` (``parse_injects``). Example:
``kill:rank=3,iter=5,phase=backward;slow:rank=1,factor=2``.

Bad specs raise FaultSpecError (a ValueError) with a one-line message naming the problem.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable
from dataclasses import dataclass

PHASES = ("forward", "backward", "grad-reduce", "optimizer", "commit", "between-iterations",
          "checkpoint", "eval", "shutdown", "recovery", "rebuild", "transfer", "copies")
KINDS = ("kill", "exit", "hang", "slow")
DEFAULT_PHASE = "between-iterations"
INJECT_ENV = "CHAMELEON_INJECT"

_KEYS = {
    "kill": {"rank", "iter", "phase"},
    "exit": {"rank", "iter", "phase", "code"},
    "hang": {"rank", "iter", "phase", "mode"},
    "slow": {"rank", "iter", "phase", "factor"},
}


class FaultSpecError(ValueError):
    """A failure-injection spec that cannot be parsed; the message names the problem."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int
    iteration: int | None = None      # kill/exit/hang: the iteration; slow: the first one
    phase: str | None = DEFAULT_PHASE  # slow: None means every phase
    code: int = 1                      # exit
    factor: float = 2.0                # slow
    mode: str = "stop"                 # hang: stop (SIGSTOP) or sleep
    text: str = ""

    def describe(self) -> str:
        if self.kind == "slow":
            where = f"from iteration {self.iteration or 0}"
            what = f"every {self.phase} phase" if self.phase else "every phase"
            return f"slow x{self.factor:g} on rank {self.rank} {where} ({what})"
        return f"{self.kind} on rank {self.rank} at iteration {self.iteration} ({self.phase})"

    def matches(self, rank: int, iteration: int, phase: str) -> bool:
        """True when this spec is due on `rank` at (`iteration`, `phase`): the phase must be the
        spec's, and the iteration the spec's or a later one (a skipped iteration still fires)."""
        if rank != self.rank:
            return False
        if self.phase is not None and _norm_phase(phase) != self.phase:
            return False
        return iteration >= (self.iteration or 0)

    def fire(self) -> None:
        """Perform the fault (for slow: only the log line; the Injector does the stretching)."""
        log(f"injecting {self.describe()}" if self.kind == "slow" else
            f"injecting {self.kind} on rank {self.rank} at iteration {self.iteration} "
            f"({self.phase})")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)   # not reached
        elif self.kind == "exit":
            os._exit(self.code)
        elif self.kind == "hang":
            if self.mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                threading.Event().wait()


def log(msg: str) -> None:
    sys.stdout.flush()
    print(f"[chameleon] {msg}", file=sys.stderr, flush=True)


def _norm_phase(p: str) -> str:
    return p.strip().lower().replace("_", "-")


def _int(spec: str, key: str, value: str, lo: int, hi: int | None = None) -> int:
    try:
        n = int(value)
    except ValueError:
        raise FaultSpecError(f"fault spec {spec!r}: {key}={value!r} is not an integer") from None
    if n < lo or (hi is not None and n > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise FaultSpecError(f"fault spec {spec!r}: {key}={n} must be {rng}")
    return n


def parse_inject(spec: str) -> FaultSpec:
    """Parse one spec such as ``kill:rank=3,iter=5,phase=backward``."""
    text = spec.strip()
    if not text:
        raise FaultSpecError("empty fault spec")
    kind, sep, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise FaultSpecError(f"fault spec {text!r}: unknown kind {kind!r} "
                             f"(one of {', '.join(KINDS)})")
    fields: dict[str, str] = {}
    for item in (rest.split(",") if sep and rest.strip() else []):
        key, eq, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or not key or not value:
            raise FaultSpecError(f"fault spec {text!r}: {item.strip()!r} is not key=value")
        if key not in _KEYS[kind]:
            raise FaultSpecError(f"fault spec {text!r}: unknown key {key!r} for {kind} "
                                 f"(allowed: {', '.join(sorted(_KEYS[kind]))})")
        if key in fields:
            raise FaultSpecError(f"fault spec {text!r}: {key} is given twice")
        fields[key] = value
    if "rank" not in fields:
        raise FaultSpecError(f"fault spec {text!r}: missing rank=")
    rank = _int(text, "rank", fields["rank"], 0)
    if kind != "slow" and "iter" not in fields:
        raise FaultSpecError(f"fault spec {text!r}: missing iter= (the iteration to {kind} at)")
    iteration = _int(text, "iter", fields["iter"], 0) if "iter" in fields else None
    phase: str | None = DEFAULT_PHASE if kind != "slow" else None
    if "phase" in fields:
        phase = _norm_phase(fields["phase"])
        if phase not in PHASES:
            raise FaultSpecError(f"fault spec {text!r}: bad phase {fields['phase']!r} "
                                 f"(one of {', '.join(PHASES)})")
    code = _int(text, "code", fields["code"], 1, 255) if "code" in fields else 1
    factor = 2.0
    if "factor" in fields:
        try:
            factor = float(fields["factor"])
        except ValueError:
            raise FaultSpecError(f"fault spec {text!r}: factor={fields['factor']!r} is not a "
                                 "number") from None
        if not factor >= 1.0 or factor == float("inf"):
            raise FaultSpecError(f"fault spec {text!r}: factor={fields['factor']} must be a "
                                 "finite number >= 1")
    mode = fields.get("mode", "stop").lower()
    if mode not in ("stop", "sleep"):
        raise FaultSpecError(f"fault spec {text!r}: bad mode {mode!r} (stop or sleep)")
    return FaultSpec(kind, rank, iteration, phase, code, factor, mode, text)


def parse_injects(specs: str | list[str] | tuple[str, ...] | None) -> list[FaultSpec]:
    """Several specs: a ';'-separated string, or a list of strings (each may contain ';')."""
    if not specs:
        return []
    items = [specs] if isinstance(specs, str) else list(specs)
    return [parse_inject(s) for item in items for s in item.split(";") if s.strip()]


class Injector:
    """The faults of one rank. Call maybe_fire(iteration, phase) at each phase boundary; each
    kill/exit/hang spec fires exactly once, the first time it is due. Slow specs stretch the
    phase: pass the phase's elapsed seconds and the injector sleeps (factor - 1) times as long."""

    def __init__(self, specs: list[FaultSpec] | str | list[str] | None, rank: int):
        if specs and (isinstance(specs, str) or isinstance(specs[0], str)):
            specs = parse_injects(specs)
        self.rank = rank
        self.job_specs = list(specs or [])     # every rank's, for the job's log line
        self.specs = [s for s in self.job_specs if s.rank == rank]
        self._fired: set[int] = set()
        self.announce: Callable[[], None] | None = None  # told just before a kill, exit or hang

    @classmethod
    def from_env(cls, rank: int | None = None) -> "Injector":
        """Specs from $CHAMELEON_INJECT, for $RANK unless given."""
        r = int(os.environ.get("RANK", "0")) if rank is None else rank
        return cls(parse_injects(os.environ.get(INJECT_ENV, "")), r)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def has_slow(self) -> bool:
        return any(s.kind == "slow" and s.rank == self.rank for s in self.specs)

    def slow_factor(self, iteration: int, phase: str) -> float:
        f = 1.0
        for s in self.specs:
            if s.kind == "slow" and s.matches(self.rank, iteration, phase):
                f *= s.factor
        return f

    def maybe_fire(self, iteration: int, phase: str = DEFAULT_PHASE,
                   elapsed_s: float | None = None) -> list[FaultSpec]:
        """Fire what is due now; returns the specs that fired for the first time (a kill or a
        stopping hang does not return, of course)."""
        fired = []
        for i, s in enumerate(self.specs):
            if not s.matches(self.rank, iteration, phase):
                continue
            if s.kind == "slow":
                if i not in self._fired:
                    self._fired.add(i)
                    fired.append(s)
                    s.fire()
                if elapsed_s:
                    time.sleep(elapsed_s * (s.factor - 1.0))
            elif i not in self._fired:
                self._fired.add(i)
                fired.append(s)
                if self.announce:
                    self.announce()
                s.fire()
        return fired
