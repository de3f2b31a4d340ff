"""The control plane's one bounded poll: the value when it comes, None at the deadline."""

import pytest

from chameleon_ext.control.poll import poll


def test_poll_returns_the_first_value_and_falsy_values_count():
    looks = iter([None, None, [], [1]])
    pauses: list[float] = []
    assert poll(lambda: next(looks), 10.0, 0.001, grow=2.0, max_interval_s=0.003,
                sleep=pauses.append) == []
    assert pauses == [0.001, 0.002]


def test_poll_gives_none_at_the_deadline_having_looked():
    looks: list[int] = []
    assert poll(lambda: looks.append(1), 0.0, 0.001, sleep=lambda s: None) is None
    assert looks


def test_poll_passes_on_what_the_look_raises():
    def look():
        raise LookupError("gone")
    with pytest.raises(LookupError, match="gone"):
        poll(look, 10.0, 0.001)
