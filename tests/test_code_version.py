"""Pins the code version (cachescore.fingerprint): it follows the scoring code's *content*.

A pure move of a scoring module (same bytes, another package) keeps the version; an edit, an added
module or a renamed module changes it; ``CACHESCORE_CODE_VERSION`` pins it; every source named in
``CODE_SOURCES`` exists (a move that forgets to update the list fails here, not silently).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import cachescore
from cachescore import fingerprint as fpmod
from cachescore._version import __version__

PKG = Path(cachescore.__file__).resolve().parent


@pytest.fixture()
def tree(tmp_path):
    """A copy of the package's sources under ``tmp_path/cachescore``; returns the root."""
    shutil.copytree(PKG, tmp_path / "cachescore", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.parametrize("kind", sorted(fpmod.CODE_SOURCES))
def test_every_source_exists_and_the_copy_digests_alike(kind, tree):
    sources = fpmod.CODE_SOURCES[kind]
    files = fpmod.scoring_files(sources)
    assert files and all(f.is_file() for _, f in files)
    assert fpmod.source_digest(sources, root=tree) == fpmod.source_digest(sources)


@pytest.mark.parametrize("kind", sorted(fpmod.CODE_SOURCES))
def test_code_version_is_the_package_version_plus_the_source_digest(kind, monkeypatch):
    monkeypatch.delenv(fpmod.CODE_VERSION_ENV, raising=False)
    v = fpmod.code_version(kind)
    assert re.fullmatch(re.escape(__version__) + r"\+[0-9a-f]{12}", v)
    assert v.endswith("+" + fpmod.source_digest(fpmod.CODE_SOURCES[kind])[:12])


def test_a_pure_move_keeps_the_version(tree):
    sources = ("cachescore.metrics", "cachescore.neighbors", "cachescore.pipeline.unit", "cachescore.types")
    before = fpmod.source_digest(sources, root=tree)
    # move pipeline/unit.py into neighbors/ (byte-identical) and metrics/ri.py into a new sub-folder
    (tree / "cachescore/pipeline/unit.py").rename(tree / "cachescore/neighbors/unit.py")
    (tree / "cachescore/metrics/sub").mkdir()
    (tree / "cachescore/metrics/ri.py").rename(tree / "cachescore/metrics/sub/ri.py")
    moved = ("cachescore.types", "cachescore.neighbors", "cachescore.metrics")  # other order, too
    assert fpmod.source_digest(moved, root=tree) == before


def test_edits_additions_and_renames_change_the_version(tree):
    sources = ("cachescore.metrics", "cachescore.types")
    before = fpmod.source_digest(sources, root=tree)
    ri = tree / "cachescore/metrics/ri.py"
    text = ri.read_bytes()
    ri.write_bytes(text + b"\n")
    assert fpmod.source_digest(sources, root=tree) != before
    ri.write_bytes(text)
    assert fpmod.source_digest(sources, root=tree) == before
    ri.rename(tree / "cachescore/metrics/ri2.py")
    assert fpmod.source_digest(sources, root=tree) != before
    (tree / "cachescore/metrics/ri2.py").rename(ri)
    (tree / "cachescore/metrics/extra.py").write_text("X = 1\n")
    assert fpmod.source_digest(sources, root=tree) != before


def test_a_missing_source_is_an_error_naming_it(tree):
    with pytest.raises(FileNotFoundError, match="cachescore.pipeline.nope"):
        fpmod.source_digest(("cachescore.pipeline.nope",), root=tree)
    with pytest.raises(KeyError, match="unknown unit kind 'nope'"):
        fpmod.code_version("nope")


def test_the_environment_pins_every_kind(monkeypatch):
    monkeypatch.setenv(fpmod.CODE_VERSION_ENV, "pinned")
    assert {fpmod.code_version(k) for k in fpmod.CODE_SOURCES} == {"pinned"}
