"""build_checkpoint_dir: readers never see half a checkpoint, failures leave nothing, a concurrent winner is kept."""

import pytest

from hybridcache.util.paths import build_checkpoint_dir


def test_builds_into_place_and_reuses_a_complete_one(tmp_path):
    target = tmp_path / "a" / "ckpt"
    calls = []

    def build(tmp):
        calls.append(tmp)
        assert not target.exists()  # built beside the target, not in it
        (tmp / "config.json").write_text("{}")
        (tmp / "w.bin").write_bytes(b"1")

    assert build_checkpoint_dir(target, build) == target
    assert (target / "w.bin").read_bytes() == b"1"
    assert build_checkpoint_dir(target, build) == target and len(calls) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["ckpt"]


def test_a_failed_build_leaves_nothing(tmp_path):
    target = tmp_path / "ckpt"

    def build(tmp):
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        build_checkpoint_dir(target, build)
    assert list(tmp_path.iterdir()) == []


def test_another_builder_that_finished_first_wins(tmp_path):
    target = tmp_path / "ckpt"

    def build(tmp):  # meanwhile another process renames its complete checkpoint into place
        (tmp / "config.json").write_text('{"mine": true}')
        target.mkdir()
        (target / "config.json").write_text('{"theirs": true}')
        (target / "extra").write_text("x")  # a non-empty directory: our rename fails

    assert build_checkpoint_dir(target, build) == target
    assert (target / "config.json").read_text() == '{"theirs": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_rename_failure_without_a_winner_is_raised(tmp_path):
    target = tmp_path / "ckpt"

    def build(tmp):
        (tmp / "config.json").write_text("{}")
        target.mkdir()
        (target / "junk").write_text("x")  # occupied by something incomplete: not a finished checkpoint

    with pytest.raises(OSError):
        build_checkpoint_dir(target, build)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
