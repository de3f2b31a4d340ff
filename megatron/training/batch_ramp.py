"""--rampup-batch-size START INCREMENT SAMPLES, as Megatron-LM counts it: the global batch starts at
START and grows by INCREMENT every SAMPLES / ((final - START) / INCREMENT) consumed samples until it
reaches --global-batch-size. The plan keeps its layout; only its number of micro-batches changes
(Trainer._rebatch), and each iteration reads the samples after those consumed before it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRamp:
    start: int
    increment: int
    ramp_samples: int
    final: int                       # --global-batch-size

    def problem(self, unit: int) -> str | None:
        """Why the ramp cannot run with micro-batches of `unit` samples per data-parallel step
        (micro batch size x data-parallel size), or None."""
        if self.start < 1 or self.increment < 1 or self.ramp_samples < 0:
            return "--rampup-batch-size takes a start >= 1, an increment >= 1 and samples >= 0"
        if self.start > self.final or (self.final - self.start) % self.increment:
            return (f"--rampup-batch-size {self.start} {self.increment}: --global-batch-size "
                    f"{self.final} is not the start plus a whole number of increments")
        if self.start % unit or self.increment % unit:
            return (f"--rampup-batch-size {self.start} {self.increment}: every batch of the ramp "
                    f"must be a multiple of --micro-batch-size x data parallel size ({unit})")
        return None

    def global_batch(self, consumed: int) -> int:
        """The global batch of the iteration after `consumed` samples."""
        steps = (self.final - self.start) // self.increment
        if steps == 0 or consumed >= self.ramp_samples:
            return self.final
        per_step = self.ramp_samples / steps
        return min(self.final, self.start + int(consumed / per_step) * self.increment)

    def first_samples(self, train_samples: int) -> list[int]:
        """Samples consumed before each iteration (0-based) of a run of `train_samples`; its
        length is the number of iterations."""
        firsts, consumed = [], 0
        while consumed < train_samples:
            firsts.append(consumed)
            consumed += self.global_batch(consumed)
        return firsts
