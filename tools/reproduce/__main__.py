"""python -m tools.reproduce TABLE... [--out DIR] [--quick] [trace options]

TABLE: table1 (post-recovery throughput), table2 (failure traces: simulated, and executed by
real jobs on emulated devices), table3 (convergence),
table4 (memory), table5 (model accuracy, search time), table6 (fused communication), or all.
Each writes its section, CSVs and plots to DIR (default results/), and DIR/REPORT.md gathers
every section there. --quick: the small version (fewer models, failures and traces, shorter
CPU runs), for tests.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path

from tools.reproduce import executed
from tools.reproduce.report import write_report
from tools.reproduce.runs import RunError
from tools.reproduce.tables import TABLES, Context, Options

PROG = "python -m tools.reproduce"


class _Parser(argparse.ArgumentParser):
    """Errors on one line, no usage block: exit 2."""

    def error(self, message: str) -> None:
        print(f"{PROG}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _number(minimum: float, strict: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(
                f"{text!r} must be {'above' if strict else 'at least'} {minimum:g}")
        return value
    return parse


def parser() -> _Parser:
    p = _Parser(prog=PROG, description=__doc__.splitlines()[0],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("tables", nargs="+", metavar="TABLE", help=f"{', '.join(TABLES)} or all")
    p.add_argument("--out", type=Path, default=Path("results"), help="default: results")
    p.add_argument("--quick", action="store_true", help="the small version the tests run")
    g = p.add_argument_group("table 2 (failure traces)")
    g.add_argument("--span-h", type=_number(0, True), default=None,
                   help="hours of training simulated (default 48, the paper's; 3 with --quick)")
    g.add_argument("--mtbf-h", type=_number(0, True), default=1.0,
                   help="mean time between failures of the Poisson trace (default 1)")
    g.add_argument("--repair-h", type=_number(0, False), default=1.0,
                   help="hours until a failed GPU is back (default 1)")
    g.add_argument("--checkpoint-min", type=_number(0, True), default=30.0,
                   help="minutes between checkpoints (default 30)")
    g.add_argument("--restart-min", type=_number(0, False), default=5.0,
                   help="minutes a relaunch of the job takes, Megatron's restart (default 5)")
    g.add_argument("--seed", type=int, default=0, help="of the traces' failed GPUs")
    g.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="simulated traces of each kind, seeds SEED to SEED + N - 1 (default "
                        "20, the paper's; 1 with --quick)")
    g.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="processes simulating the traces (default: one per core, "
                        f"{os.cpu_count() or 1} here)")
    g.add_argument("--executed-ranks", type=int, default=8, metavar="N",
                   help="ranks of the traces executed by real jobs on emulated devices "
                        "(4 to 32, even; default 8; 0: the simulated traces only)")
    return p


def _command(argv: list[str]) -> str:
    """This invocation, as it could be typed again from the repository root."""
    exe = Path(sys.executable)
    try:
        exe = exe.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join([str(exe), "-m", "tools.reproduce", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    names = list(TABLES) if "all" in args.tables else args.tables
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        p.error(f"unknown table {unknown[0]!r} (choose from {', '.join(TABLES)}, all)")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out} exists and is not a folder")
    if args.executed_ranks and not (4 <= args.executed_ranks <= 32
                                    and args.executed_ranks % 2 == 0):
        p.error(f"--executed-ranks {args.executed_ranks}: 0, or an even number from 4 to 32")
    if args.seeds is not None and args.seeds < 1:
        p.error(f"--seeds {args.seeds}: at least 1")
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    options = Options(args.out, args.quick, _command(argv),
                      args.span_h or (3.0 if args.quick else 48.0), args.mtbf_h, args.repair_h,
                      args.checkpoint_min, args.restart_min, args.seed,
                      args.executed_ranks, args.seeds or (1 if args.quick else 20), args.jobs)
    ctx = Context(options)
    try:
        for name in dict.fromkeys(names):
            TABLES[name](ctx).write(args.out)
            report = write_report(args.out)  # after each table: a later failure keeps it
    except (RunError, executed.TraceError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
