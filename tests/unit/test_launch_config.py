"""chameleon-launch's settings: a bad value is one line naming its flag and exit 2, before
anything starts."""

from __future__ import annotations

import pytest

from chameleon_ext.control import launcher


@pytest.mark.parametrize("flag", ["--restart-delay", "--start-ahead", "--max-restarts"])
def test_a_negative_restart_setting_is_one_line_and_exit_2(flag, capsys):
    assert launcher.main([flag, "-1", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("chameleon-launch: error: ") and flag in err
