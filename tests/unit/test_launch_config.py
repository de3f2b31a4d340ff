"""chameleon-launch's settings: a bad value is one line naming its flag and exit 2, before
anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chameleon_ext.control import launcher


@pytest.mark.parametrize("flag", ["--restart-delay", "--start-ahead", "--max-restarts"])
def test_a_negative_restart_setting_is_one_line_and_exit_2(flag, capsys):
    assert launcher.main([flag, "-1", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("chameleon-launch: error: ") and flag in err


def test_the_command_line_is_read_without_torch():
    """The fork server starts once the command line is read and before the agent imports torch
    (launcher.main): its imports overlap the agent's only while reading it needs no torch."""
    code = ("import sys; from chameleon_ext.control import launcher as l; "
            "l._config(l.build_parser().parse_args(['--nproc-per-node', '2', 'train.py'])); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60)   # an interpreter's start: well under a second
    assert out.stdout.strip() == "[]"
