"""The benchmarks the report reuses from tools/bench: the planner's search time by cluster size
(plan_search.py) and packed messages and fused kernels against plain torch (fused_comm.py)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

from chameleon_ext.comm import packed as comm
from tools.bench import fused_comm, plan_search


@dataclass(frozen=True)
class SearchTime:
    gpus: int
    layout: str                        # tp x pp x dp
    failed: int
    median_ms: float
    target_ms: float
    chosen: str


def search_times(sizes: list[int], failures: list[int], repeats: int,
                 on_case: Callable[[], None] | None = None) -> list[SearchTime]:
    out = []
    for gpus in sizes:
        tp, pp, _, _ = plan_search.CLUSTERS[gpus]
        for f in failures:
            found = plan_search.one(gpus, f, repeats, per_strategy=False)
            out.append(SearchTime(gpus, f"{tp} x {pp} x {gpus // (tp * pp)}", f,
                                  found.median_ms, plan_search.TARGET_MS[gpus], found.chosen))
            if on_case:
                on_case()
    return out


@dataclass(frozen=True)
class GlooStep:
    peers: int
    payload: str
    separate_ms: float                 # K isend/irecv per peer
    packed_torch_ms: float             # one message per peer, packed by torch ops
    packed_ext_ms: float               # one message per peer, packed by chameleon_ext.comm._C


@dataclass(frozen=True)
class Kernel:
    op: str
    baseline: str
    data: str
    torch_us: float
    ext_us: float


# (micro-batch activation shape, micro-batches per peer): fused_comm.py's two payloads
PAYLOADS = (((128, 2, 256), 8), ((16, 1, 256), 8))


def gloo_steps(peers: list[int], rounds: int, steps: int,
               on_case: Callable[[], None] | None = None) -> list[GlooStep]:
    """One spawned job of 1 + P processes per case, one case at a time."""
    out = []
    for p in peers:
        for shape, k in PAYLOADS:
            times = fused_comm.bench_gloo(p, shape, k, rounds, steps)
            med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            out.append(GlooStep(p, f"{k} x {list(shape)} f32", med["separate"],
                                med["packed-torch"], med["packed"]))
            if on_case:
                on_case()
    return out


def kernels(reps: int) -> list[Kernel]:
    return [Kernel(op, base, data, torch_s * 1e6, fused_s * 1e6)
            for op, base, data, fused_s, torch_s in fused_comm.bench_kernels(reps)]


def extension() -> str:
    """Which backend chameleon_ext.comm.packed uses, and why when it is not the compiled one."""
    if comm._C is not None:
        return f"{comm.backend()} (chameleon_ext.comm._C, cpu loops: {comm._C.cpu_variant()})"
    return f"{comm.backend()} ({comm._EXT_REASON})"
