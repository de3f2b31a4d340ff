"""docs/ARCHITECTURE.md's Rooms section names every module of the packages, and only those: a
newcomer reads the layout there, so a file added, moved or removed without it fails here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron/training/", "megatron/elastic/", "chameleon_ext/")
_ROOMS = re.compile(r"^## Rooms\n\n```\n(.*?)^```", re.S | re.M)
# A line of the tree starts with its names: "folder/" or "module.py", several joined by ", ";
# what follows two spaces is the description.
_NAMES = re.compile(r"\s*((?:[\w./-]+(?:, )?)*)")


def listed_modules(text: str) -> set[str]:
    """The module paths the Rooms tree names: nesting by indentation under "folder/" lines."""
    match = _ROOMS.search(text)
    assert match, "docs/ARCHITECTURE.md has no '## Rooms' section with a ``` tree"
    folders: list[tuple[int, str]] = []           # (indentation, path) of the open folders
    modules = set()
    for line in match.group(1).splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        names = [n.strip() for n in _NAMES.match(line).group(1).split(",") if n.strip()]
        if not any(n.endswith(("/", ".py")) for n in names):
            continue                               # a description's continuation line
        while folders and folders[-1][0] >= indent:
            folders.pop()
        base = folders[-1][1] if folders else ""
        for name in names:
            if name.endswith("/"):
                folders.append((indent, base + name))
            elif name.endswith(".py"):
                modules.add(base + name)
    return modules


def package_modules() -> set[str]:
    return {str(p.relative_to(REPO)) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
            if p.name != "__init__.py"}


def test_the_rooms_section_names_every_module_and_only_those():
    listed = {m for m in listed_modules((REPO / "docs" / "ARCHITECTURE.md").read_text())
              if m.startswith(PACKAGES)}
    present = package_modules()
    assert sorted(present - listed) == [], "modules missing from docs/ARCHITECTURE.md's Rooms"
    assert sorted(listed - present) == [], "Rooms names modules that do not exist"


def test_the_parser_reads_nesting_and_lists():
    text = ("## Rooms\n\n```\nchameleon_ext/  the planner\n  plan/  plans\n"
            "    execution_plan.py  one plan\n                       described here.py\n"
            "    a.py, b.py   two\n  comm/\n    packed.py\n```\n")
    assert listed_modules(text) == {"chameleon_ext/plan/execution_plan.py",
                                    "chameleon_ext/plan/a.py", "chameleon_ext/plan/b.py",
                                    "chameleon_ext/comm/packed.py"}
