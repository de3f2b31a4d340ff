"""The agent's one line per event on stderr, under the launcher's name."""

from __future__ import annotations

import sys

PROG = "chameleon-launch"


def log(msg: str) -> None:
    print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)
