"""A checkpoint counts only once it is complete: leftovers of a killed save are never loaded."""

import pytest

from megatron.training import checkpointing


def _complete(root, it):
    d = root / f"iter_{it:07d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text("{}")


def test_no_tracker_means_no_checkpoint(tmp_path):
    assert checkpointing.latest_iteration(str(tmp_path)) is None


def test_a_killed_save_leaves_the_previous_checkpoint_current(tmp_path):
    _complete(tmp_path, 5)
    (tmp_path / checkpointing.TRACKER).write_text("5")
    (tmp_path / "iter_0000010.tmp").mkdir()  # a save killed before its rename
    assert checkpointing.latest_iteration(str(tmp_path)) == 5


def test_a_tracker_naming_an_incomplete_checkpoint_is_an_error(tmp_path):
    (tmp_path / "iter_0000010").mkdir()
    (tmp_path / checkpointing.TRACKER).write_text("10")
    with pytest.raises(checkpointing.CheckpointError, match="incomplete"):
        checkpointing.latest_iteration(str(tmp_path))


def test_a_garbled_tracker_is_an_error(tmp_path):
    (tmp_path / checkpointing.TRACKER).write_text("ten")
    with pytest.raises(checkpointing.CheckpointError, match="does not hold an iteration"):
        checkpointing.latest_iteration(str(tmp_path))
