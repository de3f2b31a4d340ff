"""tools/inject_failure.py started beside a job that is not up yet (started by
tests.launch._BesideJob.start).

The tool's own start-up (torch's import, about 1 s idle and several on a loaded 2-core host)
is paid here before the job's store exists: a job whose workers are forked in milliseconds
could otherwise work past the tool's --after-iteration, and end, while the tool still imports.
The tool is then run in this process, again while the store or the worker's record is not up
yet.

    python tests/inject_beside.py WAIT_S [--epochs FILE] STORE TOOL_ARGS...

--epochs FILE: a JSON list of [epoch seconds, rank]: each try first writes the tool's --trace
file with them as seconds from then (the instants already past: at once).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import inject_failure  # noqa: E402  (the checkout's, run as a script)

# the tool's lines for a job not up yet
NO_STORE, NOT_REGISTERED = "no store at", "is not in the store"


def main(argv: list[str]) -> int:
    wait_s, argv = float(argv[0]), argv[1:]
    epochs = None
    if argv[0] == "--epochs":
        epochs, argv = json.loads(Path(argv[1]).read_text()), argv[2:]
    store, args = argv[0], argv[1:]
    deadline = time.monotonic() + wait_s
    reached = False           # the store was up once: gone again, the job has ended
    while time.monotonic() < deadline:
        if epochs is not None:
            now = time.time()
            Path(args[args.index("--trace") + 1]).write_text(
                "".join(f"{max(0.0, t - now):.3f} {r}\n" for t, r in epochs))
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = inject_failure.main(["--store", store, *args])
        said = err.getvalue()
        if not (NOT_REGISTERED in said or NO_STORE in said and not reached):
            sys.stderr.write(said)
            return rc
        reached = reached or NO_STORE not in said
        time.sleep(0.2)
    print(f"inject_beside.py: the job on {store} was not up within {wait_s:g} s",
          file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
