"""Set a measured Chameleon profile beside an analytical one of the same GPT shape, per op.

    python tools/compare_profiles.py MEASURED.json ANALYTICAL.json [--output table.txt]

Both files are chameleon_ext.planning.perf_model.Profile JSONs, as tools/profile_model.py writes
them (--mode measure and --mode analytical, with the same model flags). Prints one table: for
each op the profile costs (a transformer layer's forward, its backward's input and weight halves,
the embedding's forward and backward, the head's forward and backward, the optimizer per million
parameters) the measured value, the analytical one and measured / analytical. The links are left
out: a measured profile of a named device copies the analytical ones (profile_model.py).

Bad input (a missing or unreadable file, not a profile, two different shapes) prints one line on
stderr (``compare_profiles.py: error: ...``) and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

try:
    from chameleon_ext.planning.perf_model import Profile, ProfileError
except ImportError:          # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from chameleon_ext.planning.perf_model import Profile, ProfileError

PROG = "compare_profiles.py"

# (label, Profile field, unit)
OPS = (
    ("layer fwd", "layer_fwd_ms", "ms"),
    ("layer bwd input", "layer_bwd_input_ms", "ms"),
    ("layer bwd weight", "layer_bwd_weight_ms", "ms"),
    ("embedding fwd", "embedding_fwd_ms", "ms"),
    ("embedding bwd", "embedding_bwd_ms", "ms"),
    ("head fwd", "head_fwd_ms", "ms"),
    ("head bwd", "head_bwd_ms", "ms"),
    ("optimizer", "optimizer_ms_per_mparam", "ms/Mparam"),
)


class InputError(Exception):
    """Bad input: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):       # one line, no usage block
        raise InputError(message)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog=PROG, description="Measured / analytical per op of two Chameleon profiles "
                "of the same GPT shape.")
    p.add_argument("measured", help="the measured profile (tools/profile_model.py --mode measure)")
    p.add_argument("analytical",
                   help="the reference profile (tools/profile_model.py --mode analytical)")
    p.add_argument("--output", help="also write the table to this file")
    return p.parse_args(argv)


def _ratio(m: float, a: float) -> str:
    if a > 0 and math.isfinite(a) and math.isfinite(m):
        return f"{m / a:.3g}"
    return "n/a"


def table(measured: Profile, analytical: Profile) -> str:
    sh = measured.shape
    head = (f"measured ({measured.source}, {measured.device}) / analytical ({analytical.source}, "
            f"{analytical.device}): GPT hidden {sh.hidden_size}, {sh.num_attention_heads} heads, "
            f"seq {sh.seq_length}, micro-batch {sh.micro_batch_size}, vocab {sh.vocab_size}, "
            f"{sh.bytes_per_element}-byte elements")
    rows = [("op", "measured", "analytical", "measured/analytical", "unit")]
    for label, field, unit in OPS:
        m, a = getattr(measured, field), getattr(analytical, field)
        rows.append((label, f"{m:.4g}", f"{a:.4g}", _ratio(m, a), unit))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head]
    for i, r in enumerate(rows):
        lines.append("  " + "  ".join(c.ljust(w) if j in (0, 4) else c.rjust(w)
                                      for j, (c, w) in enumerate(zip(r, widths))).rstrip())
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        profiles = []
        for path in (args.measured, args.analytical):
            try:
                profiles.append(Profile.load(path))
            except ProfileError as e:
                raise InputError(str(e)) from None
        measured, analytical = profiles
        if measured.shape != analytical.shape:
            diff = ", ".join(f"{f.name} {getattr(measured.shape, f.name)} vs "
                             f"{getattr(analytical.shape, f.name)}"
                             for f in dataclasses.fields(measured.shape)
                             if getattr(measured.shape, f.name) != getattr(analytical.shape, f.name))
            raise InputError(f"the profiles describe different shapes ({diff})")
        text = table(measured, analytical)
        if args.output:
            try:
                Path(args.output).write_text(text + "\n")
            except OSError as e:
                raise InputError(f"cannot write --output {args.output}: {e.strerror or e}") \
                    from None
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
