"""--profile --use-pytorch-profiler: torch.profiler over Megatron-LM's window of iterations.

Megatron-LM profiles while its count of completed iterations goes from --profile-step-start to
--profile-step-end, so iterations start + 1 .. end (1-based), on the global ranks of
--profile-ranks (every rank when empty), and writes each rank's trace to
<--tensorboard-dir>/../torch_profile/rank-<rank>.json.gz. The window here is by iteration
number, so an iteration a failure makes run again stays inside it.
"""

from __future__ import annotations

from pathlib import Path

import torch


class StepProfiler:
    def __init__(self, start: int, end: int, tensorboard_dir: str, ranks: tuple[int, ...],
                 shapes: bool = False, stack: bool = False) -> None:
        self.start, self.end, self.ranks = start, end, ranks
        self.dir = Path(tensorboard_dir).parent / "torch_profile"
        self.shapes, self.stack = shapes, stack
        self._prof: torch.profiler.profile | None = None
        self._rank = -1
        self.written: Path | None = None

    def before(self, iteration: int, rank: int) -> None:
        """Iteration `iteration` (1-based) is about to run on global rank `rank`."""
        if self._prof is None and self.written is None and \
                self.start < iteration <= self.end and (not self.ranks or rank in self.ranks):
            self._rank = rank
            self._prof = torch.profiler.profile(record_shapes=self.shapes,
                                                with_stack=self.stack)
            self._prof.start()

    def after(self, iteration: int) -> None:
        """Iteration `iteration` was applied."""
        if self._prof is not None and iteration >= self.end:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (the job may end inside the window)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.written = self.dir / f"rank-{self._rank}.json.gz"
        prof.export_chrome_trace(str(self.written))
