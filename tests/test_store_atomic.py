"""cachescore.store.atomic: write-then-rename publication.

Pins: the target holds either its old complete bytes or the new complete bytes, never a prefix;
a failing writer leaves no file behind; ``overwrite=False`` refuses an existing target, also when
another writer publishes first; folder publication refuses or replaces as asked; sweeping removes
only old leftovers.
"""

from __future__ import annotations

import os

import pytest

from cachescore.store.atomic import atomic_replace_dir, atomic_write, atomic_write_bytes, atomic_write_json, sweep_partials


def test_failed_write_leaves_old_content_and_no_partial(tmp_path):
    target = tmp_path / "a.bin"
    atomic_write_bytes(target, b"old")

    def half_then_fail(fh):
        fh.write(b"new-but-incomp")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_refuse_overwrite_and_race(tmp_path, monkeypatch):
    target = tmp_path / "x.json"
    atomic_write_json(target, {"a": 1}, overwrite=False)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        atomic_write_json(target, {"a": 2}, overwrite=False)
    atomic_write_json(target, {"a": 3})
    assert '"a": 3' in target.read_text()

    # another writer publishes between our existence check and our publication
    other = tmp_path / "y.json"

    def racing_write(fh):
        other.write_text("theirs")
        fh.write(b"ours")

    with pytest.raises(FileExistsError):
        atomic_write(other, racing_write, overwrite=False)
    assert other.read_text() == "theirs"
    assert not list(tmp_path.glob(".*.partial"))


def test_json_is_strict(tmp_path):
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "n.json", {"x": float("nan")})
    assert not list(tmp_path.iterdir())


def test_replace_dir(tmp_path):
    target = tmp_path / "data"
    for content, overwrite in (("one", False), ("two", True)):
        staging = tmp_path / f".stage-{content}.partial"
        staging.mkdir()
        (staging / "f").write_text(content)
        atomic_replace_dir(staging, target, overwrite=overwrite)
        assert (target / "f").read_text() == content and not staging.exists()
    staging = tmp_path / ".stage-three.partial"
    staging.mkdir()
    with pytest.raises(FileExistsError):
        atomic_replace_dir(staging, target, overwrite=False)
    assert not staging.exists() and (target / "f").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_sweep_only_old_partials(tmp_path):
    old, young = tmp_path / ".a.1-x.partial", tmp_path / "sub" / ".b.2-y.partial"
    young.parent.mkdir()
    old.write_text("")
    young.mkdir()
    os.utime(old, (1, 1))
    keep = tmp_path / "keep.json"
    keep.write_text("{}")
    assert sweep_partials(tmp_path, older_than_s=60) == 1
    assert not old.exists() and young.exists() and keep.exists()


def test_replace_dir_restores_the_old_version_when_publishing_fails(tmp_path, monkeypatch):
    """overwrite=True: if renaming the new folder into place fails, the old folder is put back
    (the target is never left missing) and the staging folder is removed."""
    target, staging = tmp_path / "bundle", tmp_path / ".bundle.tmp"
    target.mkdir()
    (target / "v").write_text("old")
    staging.mkdir()
    (staging / "v").write_text("new")
    real_rename = os.rename

    def failing_publish(src, dst):
        if str(src) == str(staging):
            raise OSError("disk full")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_publish)
    with pytest.raises(OSError, match="disk full"):
        atomic_replace_dir(staging, target, overwrite=True)
    monkeypatch.undo()
    assert (target / "v").read_text() == "old"
    assert not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]
