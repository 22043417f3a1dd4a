"""Read-only commands create nothing (issue 23): ``status``, ``status --verify``, ``validate``,
``compare``, ``export`` (to a file outside the store) and ``report`` (likewise) open the results
store with ``ResultsStore.open(path, mode="r")``; the store tree (every path, size and mtime) is
unchanged after them (and so is the cache's), and a job whose store does not exist yet gets no
store folder. A cache opened read-only (``Cache.open(path)``, mode ``"r"``) is refused by every
writer.

Running as root (CI) makes a chmod'ed tree writable anyway, so the check is the tree's snapshot,
which also catches a write that a read-only mount would turn into an error.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import Cache, CacheError, CacheNotFoundError, import_cache, write_embeddings, write_tileset
from cachescore.cli import main
from cachescore.store import ResultsStore
from cachescore.store.results import StoreError


def _snapshot(root: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def _cli(*argv) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(list(argv))


def test_read_only_commands_leave_the_store_as_it_was(demo, tmp_path):
    job = str(demo.path)
    encoders = sorted({p.name for p in (Path(demo.cache) / "embeddings").iterdir()})
    before, cache_before = _snapshot(demo.store), _snapshot(demo.cache)
    assert before and cache_before
    codes = [
        _cli("status", job), _cli("status", job, "--verify"), _cli("validate", job),
        _cli("compare", job, encoders[0], encoders[1]),
        _cli("export", job, "-o", str(tmp_path / "scores.parquet")),
        _cli("report", job, "--out", str(tmp_path / "report.html")),
    ]
    assert codes == [0] * len(codes)
    assert (tmp_path / "report.html").is_file() and (tmp_path / "scores.parquet").exists()
    assert _snapshot(demo.store) == before and _snapshot(demo.cache) == cache_before


def test_a_job_without_a_store_gets_none_from_read_only_commands(demo, tmp_path):
    text = Path(demo.path).read_text().replace(f'store = "{demo.store}"', f'store = "{tmp_path / "nostore"}"')
    assert str(tmp_path / "nostore") in text
    (tmp_path / "job.toml").write_text(text)
    job = str(tmp_path / "job.toml")
    _cli("status", job)
    _cli("validate", job)
    _cli("export", job, "-o", str(tmp_path / "out.parquet"))
    assert not (tmp_path / "nostore").exists()


def test_a_cache_opened_read_only_refuses_the_writers_by_name(tmp_path):
    frame = pd.DataFrame({"sample_id": ["a", "b"], "image_path": ["a.png", "b.png"]})
    with pytest.raises(CacheNotFoundError, match="cache folder not found"):
        Cache.open(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()
    cache = Cache.open(tmp_path / "c", mode="a")  # creates the folder: the one write of opening
    assert cache.writable and cache.root.is_dir()
    write_tileset(cache, "ts", frame)
    ro = Cache.open(tmp_path / "c")
    assert not ro.writable and ro.tilesets() == ["ts"]
    before = _snapshot(tmp_path / "c")
    for write in (lambda: write_tileset(ro, "ts2", frame),
                  lambda: write_embeddings(ro, "enc", "ts", np.zeros((2, 3), np.float32)),
                  lambda: import_cache(ro, tileset="ts3", manifest=frame, encoders={"enc": "x.npy"})):
        with pytest.raises(CacheError, match=rf"cache {ro.root} is open read-only \(mode='r'\); nothing is written"):
            write()
    assert _snapshot(tmp_path / "c") == before
    with pytest.raises(ValueError, match="cache mode must be one of"):
        Cache(tmp_path / "c", mode="w")


def test_a_read_only_store_refuses_writes_by_name(tmp_path):
    missing = ResultsStore.open(tmp_path / "absent")
    assert not missing.has("0" * 64) and missing.fingerprints() == set() and not (tmp_path / "absent").exists()
    store = ResultsStore.create(tmp_path / "s")
    ro = ResultsStore.open(tmp_path / "s")
    with pytest.raises(StoreError, match=r"opened read-only \(mode='r'\); nothing is written"):
        ro.write_unit("0" * 64, record={"value": 1.0})
    with pytest.raises(StoreError, match="opened read-only"):
        ro.write_provenance("run-1", {})
    assert ro.mark_stale_runs() == [] and store.path == ro.path
    with pytest.raises(ValueError, match="store mode must be 'r'"):
        ResultsStore(tmp_path / "s", mode="w")
