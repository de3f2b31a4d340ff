"""Report sections: each table as markdown and CSV, its plots, the command that made it; and
REPORT.md, assembled from every section in the output folder (so tables run one at a time add
up to one report)."""

from __future__ import annotations

import csv
import math
import platform
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

SECTION = re.compile(r"table(\d+)\.md")


@dataclass
class Table:
    """Rows of values under `columns` ((header, format) pairs: a str.format spec applied to
    numbers in markdown; the CSV keeps full precision). None reads n/a."""

    name: str                          # file stem of its CSV
    columns: list[tuple[str, str]]
    rows: list[list]
    markdown: bool = True              # False: CSV only (data behind a plot)

    def write_csv(self, out: Path) -> None:
        with open(out / f"{self.name}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([h for h, _ in self.columns])
            for row in self.rows:
                w.writerow(["" if v is None else v for v in row])

    def to_markdown(self) -> str:
        def cell(v, fmt: str) -> str:
            if v is None or (isinstance(v, float) and not math.isfinite(v)):
                return "n/a"
            return fmt.format(v) if isinstance(v, (int, float)) and fmt else str(v)

        lines = ["| " + " | ".join(h for h, _ in self.columns) + " |",
                 "|" + "|".join("---" for _ in self.columns) + "|"]
        lines += ["| " + " | ".join(cell(v, fmt) for v, (_, fmt) in zip(row, self.columns)) +
                  " |" for row in self.rows]
        return "\n".join(lines)


@dataclass
class Section:
    number: int
    title: str
    command: str
    profile: str                       # the performance-model profile used (its source)
    intro: str
    tables: list[Table]
    plots: list[str] = field(default_factory=list)  # PNG file names in the output folder
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_markdown(self) -> str:
        parts = [f"## Table {self.number}: {self.title}", "",
                 f"Command: `{self.command}`  ",
                 f"Profile: {self.profile}  ",
                 f"Ran {datetime.now():%Y-%m-%d %H:%M}, {self.seconds:.0f} s.", "", self.intro]
        for t in self.tables:
            if t.markdown:
                parts += ["", t.to_markdown()]
        parts += ["", "CSV: " + ", ".join(f"[{t.name}.csv]({t.name}.csv)" for t in self.tables)]
        parts += [f"\n![{p}]({p})" for p in self.plots]
        if self.notes:
            parts += ["", *[f"- {n}" for n in self.notes]]
        return "\n".join(parts) + "\n"

    def write(self, out: Path) -> None:
        for t in self.tables:
            t.write_csv(out)
        (out / f"table{self.number}.md").write_text(self.to_markdown())


def write_report(out: Path) -> Path:
    """REPORT.md from every tableN.md in `out`, in table order."""
    sections = sorted((int(m.group(1)), p) for p in out.iterdir()
                      if (m := SECTION.fullmatch(p.name)))
    head = ["# Chameleon-Megatron: the paper's tables, reproduced", "",
            "Every number below comes from a run of this project (`python -m tools.reproduce`); "
            "the only figures typed in are the paper's own, in columns labelled *paper*. "
            "Numbers for the 32-GPU cluster come from the performance model with an "
            "*analytical* H200 profile (FLOPs over peak, bytes over link bandwidth), not from "
            "GPUs; the CPU runs are real training runs on this machine.", "",
            f"Machine: {platform.machine()}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}.", ""]
    text = "\n".join(head) + "\n" + "\n".join(p.read_text() for _, p in sections)
    path = out / "REPORT.md"
    path.write_text(text)
    return path
