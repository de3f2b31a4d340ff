"""Training logs: Megatron-style iteration lines, the JSON-lines metrics file, tensorboard."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path


class MetricsFile:
    """--chameleon-metrics-file: one JSON event per line, flushed per line so a killed job leaves
    only whole lines; each event carries its wall time (`time`). The format is in
    docs/ARCHITECTURE.md."""

    def __init__(self, path: str | None) -> None:
        self._path = path
        self._f = None

    def write(self, event: str, **fields) -> None:
        """Opened on first write: whichever rank reports (rank 0 of the current world, which
        may change after a failure) appends to the same file."""
        if not self._path:
            return
        if self._f is None:
            Path(self._path).parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self._path, "a", buffering=1)
        self._f.write(json.dumps({"event": event, **fields, "time": round(time.time(), 3)})
                      + "\n")

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


class Tensorboard:
    def __init__(self, log_dir: str | None, queue_size: int = 1000) -> None:
        self._w = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter
            self._w = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    @property
    def on(self) -> bool:
        """Whether anything is written (the lead rank, with --tensorboard-dir)."""
        return self._w is not None

    def scalars(self, step: int, **values: float) -> None:
        if self._w:
            for k, v in values.items():
                if v is not None:
                    self._w.add_scalar(k, v, step)

    def timers(self, timers, names: list[str], step: int, normalizer: float) -> None:
        """--log-timers-to-tensorboard: megatron-core's Timers.write, the max over ranks of
        each timer (collective: every rank calls it, the lead writes). Not reset: the log
        line's timers string, read after, resets them."""
        timers.write(names, self._w, step, normalizer=normalizer, reset=False)

    def close(self) -> None:
        if self._w:
            self._w.flush()
            self._w.close()


def iteration_line(*, iteration: int, train_iters: int, consumed: int, elapsed_ms: float, lr: float,
                   gbs: int, loss: float, grad_norm: float | None, tokens_per_s: float,
                   skipped: int, tflops_per_gpu: float | None = None,
                   num_zeros: float | None = None, params_norm: float | None = None) -> str:
    """The line Megatron-LM's training_log prints, with throughput in tokens/s (and, with
    --log-throughput, the model's TFLOP/s per GPU)."""
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    norm = f" grad norm: {grad_norm:.3f} |" if grad_norm is not None else ""
    if num_zeros is not None:
        norm += f" num zeros: {num_zeros:.0f} |"
    if params_norm is not None:
        norm += f" params norm: {params_norm:.3f} |"
    flops = (f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f} |"
             if tflops_per_gpu is not None else "")
    return (f" [{stamp}] iteration {iteration:8d}/{train_iters:8d} |"
            f" consumed samples: {consumed:12d} |"
            f" elapsed time per iteration (ms): {elapsed_ms:.1f} |{flops}"
            f" learning rate: {lr:.6E} | global batch size: {gbs:5d} |"
            f" lm loss: {loss:.6E} |{norm}"
            f" tokens per second: {tokens_per_s:.1f} |"
            f" number of skipped iterations: {skipped:3d} |")


class Stopwatch:
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def lap_ms(self) -> float:
        now = time.perf_counter()
        ms, self.t = (now - self.t) * 1e3, now
        return ms
