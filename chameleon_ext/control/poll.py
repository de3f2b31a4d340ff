"""The one bounded poll of the control plane: look until something is there or a deadline passes.

Every wait on the store (an agreement, a vote, a publication, a rendezvous key) and every wait of
an agent on its workers is such a poll: the store has no notifications that survive a broken
peer, so looking again is the only way to wait for it while also noticing that it is gone.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def poll(look: Callable[[], T | None], timeout_s: float, interval_s: float, *,
         grow: float = 1.0, max_interval_s: float | None = None,
         sleep: Callable[[float], object] = time.sleep) -> T | None:
    """Call `look` until it returns something other than None and return that; None once
    `timeout_s` has passed (it looks at least once, and again after every pause).

    `interval_s` is the first pause between looks; each later one is `grow` times the previous,
    up to `max_interval_s` (default: no growth beyond the first). `sleep` pauses (an agent
    passes one that wakes on signals). `look` may raise to give up early."""
    deadline = time.monotonic() + timeout_s
    cap = interval_s if max_interval_s is None else max_interval_s
    interval = interval_s
    while True:
        found = look()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            return None
        sleep(interval)
        interval = min(interval * grow, cap)
