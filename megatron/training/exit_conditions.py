"""When a job stops before --train-iters, as Megatron-LM's --exit-interval,
--exit-duration-in-mins and --exit-signal-handler: the job saves a checkpoint (with --save) and
every worker exits 0.

The three are decided at a step boundary, by every rank alike: the interval from the iteration
alone; the duration and a SIGTERM by one all-gather over the world of each rank's flags, as
Megatron-LM all-reduces them (a rank's clock or signal must not stop it alone, in the middle of
its peers' collectives). With --chameleon a SIGTERM that reaches some workers but not all (a
scheduler preempting one GPU or one node) is their planned leave: they exit 0 at the boundary and
the others recover without them, with no iteration lost; a SIGTERM of every worker (the agent's,
on its own SIGTERM) stops the job.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.training.config import TrainingConfig


@dataclass(frozen=True)
class ExitVerdict:
    """What the boundary after an iteration decided."""

    reason: str                          # for the log line: the flag, or the signal
    leavers: tuple[int, ...] = ()        # world ranks leaving alone; () the whole job stops


class ExitConditions:
    def __init__(self, training: TrainingConfig, elastic: bool) -> None:
        self.interval = training.exit_interval
        self.duration_s = training.exit_duration_s
        self.handler = training.exit_signal_handler
        self.elastic = elastic
        self.started = time.monotonic()
        self.signalled = False
        if self.handler:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    @property
    def voting(self) -> bool:
        """A collective runs at every boundary (the duration or the signal handler is on)."""
        return self.duration_s is not None or self.handler

    def check(self, iteration: int) -> ExitVerdict | None:
        """After `iteration`'s step; collective over the world when `voting`."""
        if self.interval and iteration % self.interval == 0:
            return ExitVerdict(f"--exit-interval {self.interval}")
        if not self.voting:
            return None
        over = self.duration_s is not None and time.monotonic() - self.started > self.duration_s
        mine = torch.tensor([float(over), float(self.signalled)])
        flags = [torch.zeros(2) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, mine)
        if any(f[0] > 0 for f in flags):
            return ExitVerdict(f"--exit-duration-in-mins {self.duration_s / 60:g}")
        signalled = tuple(r for r, f in enumerate(flags) if f[1] > 0)
        if not signalled:
            return None
        if self.elastic and len(signalled) < len(flags):
            return ExitVerdict("SIGTERM", signalled)
        return ExitVerdict("SIGTERM")
