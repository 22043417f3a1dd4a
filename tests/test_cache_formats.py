"""The three ways a cache stores an encoder's rows pass the same conformance checks (issue 27,
parts 2 and 3): ``.npy`` shards, Zarr v3 shards (``import --format zarr``) and TRIDENT-style
slide files read in place (``import --link``). Each: values equal the source, ``verify`` healthy
and a tampered file found, NaN refused naming the rows, the sample-id order hash enforced, views
read and scored to the same values."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import (
    AlignmentError,
    Cache,
    CacheError,
    NonFiniteError,
    ShardError,
    ShardNotFoundError,
    verify_cache,
)
from cachescore.cache.formats import StorageOptions
from cachescore.cache.importer import import_cache
from cachescore.cache.layout import tiles_path

h5py = pytest.importorskip("h5py")
pytest.importorskip("zarr")

REPO = Path(__file__).resolve().parents[1]
FORMATS = {"npy": StorageOptions(), "zarr": StorageOptions(format="zarr", chunk_rows=32),
           "linked": StorageOptions(link=True)}


def _slides(folder: Path, *, n_slides=12, dim=16, seed=0, nan_at=None) -> tuple[pd.DataFrame, np.ndarray]:
    """A TRIDENT-like folder: one ``<slide>.h5`` per slide with ``features`` and ``coords``; the
    slide table; the rows in tileset order."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    slides, parts = [f"S{i:02d}" for i in range(n_slides)], []
    for i, s in enumerate(slides):
        n = 18 + 3 * i
        x = (rng.standard_normal((n, dim)) + (i % 3) * 0.5).astype(np.float32)
        if nan_at is not None and i == nan_at[0]:
            x[nan_at[1], 2] = np.nan
        with h5py.File(folder / f"{s}.h5", "w") as fh:
            fh["features"] = x
            fh["coords"] = np.stack([np.arange(n) * 224, np.full(n, 224 * i)], axis=1)
        parts.append(x)
    table = pd.DataFrame({"group_id": slides, "label": ["tumour", "normal"] * (n_slides // 2),
                          "centre": ["c1", "c2", "c3"] * (n_slides // 3)})
    return table, np.concatenate(parts)


def _import(root: Path, feats: Path, table: pd.DataFrame, fmt: str, **kw) -> Cache:
    return import_cache(root, tileset="tiles", manifest=table, encoders={"enc": feats}, layout="per_slide",
                        views={"v": {"confounder_column": "centre", "design": "all"}}, storage=FORMATS[fmt],
                        shard_rows=100, **kw)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rows_views_and_verify_are_the_same_for_every_format(tmp_path, fmt):
    table, rows = _slides(tmp_path / "feats")
    cache = _import(tmp_path / "cache", tmp_path / "feats", table, fmt)
    meta = cache.validate_embeddings("enc", "tiles", reuse=False)
    assert meta.format == {"npy": "cachescore.npy-shards", "zarr": "cachescore.zarr-shards",
                           "linked": "cachescore.linked"}[fmt]
    np.testing.assert_array_equal(cache.load_rows("enc", "tiles"), rows)
    pick = np.array([7, 7, 0, len(rows) - 1, 150, 3])
    np.testing.assert_array_equal(cache.load_rows("enc", "tiles", pick), rows[pick])
    np.testing.assert_array_equal(np.asarray(cache.embeddings("enc", "tiles", chunk_rows=40)), rows)
    view = cache.read_view("v")
    np.testing.assert_array_equal(np.asarray(cache.view_embeddings("enc", "v")), rows[view["row"].to_numpy()])
    assert verify_cache(cache) == []
    if fmt == "linked":  # nothing copied: the cache holds meta.json and the tables only
        assert not list((tmp_path / "cache" / "embeddings").rglob("*.npy"))


def _tamper(tmp_path: Path, fmt: str) -> None:
    folder = tmp_path / "cache" / "embeddings" / "enc" / "tiles"
    if fmt == "npy":
        victim = folder / "shard-00001.npy"
    elif fmt == "zarr":
        victim = sorted(p for p in (folder / "shard-00001.zarr").rglob("*") if p.is_file() and p.name != "zarr.json")[0]
    else:
        victim = tmp_path / "feats" / "S03.h5"
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0xFF
    st = victim.stat()
    victim.write_bytes(bytes(data))
    if fmt != "linked":
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # even a same-mtime edit is caught by the checksum
    else:  # an edit moves the mtime on (set explicitly: file clocks tick in milliseconds)
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_tampered_file_is_found_by_verify_and_refused_by_validation(tmp_path, fmt):
    table, _ = _slides(tmp_path / "feats")
    cache = _import(tmp_path / "cache", tmp_path / "feats", table, fmt)
    cache.validate_embeddings("enc", "tiles")
    _tamper(tmp_path, fmt)
    problems = verify_cache(Cache(tmp_path / "cache"))
    assert [p.kind for p in problems] == (["shard_corrupt"] if fmt == "linked" else ["checksum"])
    expect = r"S03\.h5 changed since it was linked" if fmt == "linked" else r"does not match its sha256"
    with pytest.raises(ShardError, match=expect):
        Cache(tmp_path / "cache").validate_embeddings("enc", "tiles", reuse=False)


def test_a_touched_or_missing_slide_file_is_refused_before_it_is_read(tmp_path, capsys):
    """``--link``: touching a slide file (same bytes, new mtime) or removing it stops every read of
    that encoder with a message naming the file; a unit of a job fails with it, the others run."""
    from cachescore.cli import main

    table, _ = _slides(tmp_path / "feats")
    table.to_csv(tmp_path / "slides.csv", index=False)
    argv = ["import", str(tmp_path / "cache"), "--tileset", "tiles", "--manifest", str(tmp_path / "slides.csv"),
            "--layout", "per_slide", "--view", "v=centre:all"]
    assert main(argv + ["--encoder", f"linked={tmp_path / 'feats'}", "--link"]) == 0
    shutil.copytree(tmp_path / "feats", tmp_path / "feats2")
    assert main(argv[:-2] + ["--encoder", f"copied={tmp_path / 'feats2'}"]) == 0
    capsys.readouterr()
    cache = Cache(tmp_path / "cache")
    cache.validate_embeddings("linked", "tiles")
    later = os.stat(tmp_path / "feats" / "S05.h5").st_mtime_ns + 5_000_000_000
    os.utime(tmp_path / "feats" / "S05.h5", ns=(later, later))
    with pytest.raises(ShardError, match=rf"{re.escape(str(tmp_path / 'feats' / 'S05.h5'))} changed since it was "
                                         r"linked \(size \d+ -> \d+ bytes, mtime"):
        cache.load_rows("linked", "tiles", np.arange(125, 135))
    with pytest.raises(ShardError, match="changed since it was linked"):
        cache.validate_embeddings("linked", "tiles")  # the memo does not hide it: the file's signature changed

    job = tmp_path / "job.toml"
    job.write_text(f'schema_version = 1\n[job]\nname = "l"\ncache = "{tmp_path / "cache"}"\nstore = "{tmp_path / "store"}"\n'
                   '[metrics]\nfamilies = ["ri"]\n[metrics.ri]\nk_candidates = [5]\n'
                   '[execution]\nn_workers = 1\ndashboard = false\nperformance_report = false\n')
    os.environ.setdefault("CACHESCORE_CODE_VERSION", "test-pinned")
    assert main(["run", str(job), "--quiet"]) == 1
    assert "succeeded 1, failed 1" in capsys.readouterr().out
    main(["status", str(job), "--json"])
    units = {u["encoder"]: u for u in json.loads(capsys.readouterr().out)["units"]}
    assert units["copied"]["state"] == "done" and units["linked"]["state"] == "failed"
    from cachescore.store import ResultsStore

    (error,) = ResultsStore(tmp_path / "store").failures()["error"].tolist()  # the whole message (status cuts it)
    assert f"{tmp_path / 'feats' / 'S05.h5'} changed since it was linked" in error, error

    (tmp_path / "feats" / "S05.h5").unlink()
    with pytest.raises(ShardNotFoundError, match=r"linked slide file missing: .*S05\.h5"):
        Cache(tmp_path / "cache").load_rows("linked", "tiles", np.arange(125, 135))
    kinds = {p.kind for p in verify_cache(Cache(tmp_path / "cache"))}
    assert kinds == {"shard_missing"}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_nan_rows_are_refused_naming_them(tmp_path, fmt):
    table, rows = _slides(tmp_path / "feats", nan_at=(4, 6))
    bad_row = int(np.flatnonzero(np.isnan(rows).any(axis=1))[0])
    if fmt == "linked":  # nothing is read at a linked import: the rows are refused when a unit reads them
        cache = _import(tmp_path / "cache", tmp_path / "feats", table, fmt)
        with pytest.raises(NonFiniteError, match=rf"S04\.h5.*NaN or infinite values at tileset rows \[{bad_row}\]"):
            cache.validate_embeddings("enc", "tiles")
        assert [p.kind for p in verify_cache(cache)] == ["non_finite"]
    else:
        with pytest.raises(NonFiniteError, match=rf"NaN or infinite values at rows \[{bad_row}\]"):
            _import(tmp_path / "cache", tmp_path / "feats", table, fmt)
        assert not (tmp_path / "cache" / "embeddings" / "enc" / "tiles").exists()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_sample_id_order_hash_is_enforced(tmp_path, fmt):
    table, _ = _slides(tmp_path / "feats")
    cache = _import(tmp_path / "cache", tmp_path / "feats", table, fmt)
    path = tiles_path(tmp_path / "cache", "tiles")
    tiles = pd.read_parquet(path)
    tiles.iloc[::-1].reset_index(drop=True).to_parquet(path, index=False)
    with pytest.raises(AlignmentError, match="sample_id order differs"):
        Cache(tmp_path / "cache").validate_embeddings("enc", "tiles", reuse=False)
    assert [p.kind for p in verify_cache(cache)] == ["alignment"]


def test_zarr_storage_dtype_and_codecs(tmp_path):
    table, rows = _slides(tmp_path / "feats")
    for codec in ("zstd", "blosc", "none"):
        cache = import_cache(tmp_path / codec, tileset="tiles", manifest=table, encoders={"enc": tmp_path / "feats"},
                             layout="per_slide", storage=StorageOptions(format="zarr", codec=codec,
                                                                        storage_dtype="float16"))
        meta = cache.validate_embeddings("enc", "tiles")
        assert meta.dtype == np.float16
        np.testing.assert_array_equal(cache.load_rows("enc", "tiles"), rows.astype(np.float16))
    big = tmp_path / "big"
    table, _ = _slides(big)
    with h5py.File(big / "S02.h5", "a") as fh:
        fh["features"][3, 1] = 1e6  # finite in float32, inf in float16
    with pytest.raises(NonFiniteError, match=r"stored as float16.*NaN or infinite values at rows \["):
        import_cache(tmp_path / "c16", tileset="tiles", manifest=table, encoders={"enc": big}, layout="per_slide",
                     storage=StorageOptions(format="zarr", storage_dtype="float16"))
    with pytest.raises(ValueError, match="apply to --format zarr only"):
        StorageOptions(storage_dtype="float16")


def test_link_needs_slide_runs_and_per_slide(tmp_path):
    table, _ = _slides(tmp_path / "feats", n_slides=6)
    with pytest.raises(CacheError, match="needs --layout per_slide"):
        import_cache(tmp_path / "c", tileset="tiles", manifest=table, encoders={"enc": tmp_path / "feats" / "S00.h5"},
                     storage=StorageOptions(link=True))
    from cachescore.cache.importer import tiles_from_slides

    tiles = tiles_from_slides(table, slide_column="group_id", encoders={"enc": tmp_path / "feats"},
                              h5_dataset="features", source="t")
    shuffled = tiles.sample(frac=1.0, random_state=0).reset_index(drop=True)
    with pytest.raises(CacheError, match=r"--link reads each slide file's rows in order"):
        import_cache(tmp_path / "c", tileset="tiles", manifest=shuffled, encoders={"enc": tmp_path / "feats"},
                     layout="per_slide", tile_index_column="tile_index", storage=StorageOptions(link=True))


def test_every_format_scores_identically(tmp_path, capsys):
    """The same slides imported three ways score to the same stored values, bit for bit."""
    from cachescore.cli import main

    sys.path.insert(0, str(REPO / "benchmarks"))
    from stored_values_digest import digest_store

    table, _ = _slides(tmp_path / "feats", n_slides=18)
    os.environ.setdefault("CACHESCORE_CODE_VERSION", "test-pinned")
    digests = {}
    for fmt in FORMATS:
        _import(tmp_path / f"cache-{fmt}", tmp_path / "feats", table, fmt)
        job = tmp_path / f"{fmt}.toml"
        job.write_text(f'schema_version = 1\n[job]\nname = "f"\ncache = "{tmp_path / f"cache-{fmt}"}"\n'
                       f'store = "{tmp_path / f"store-{fmt}"}"\n[metrics]\nfamilies = ["ri", "mari", "croma"]\n'
                       '[metrics.ri]\nk_candidates = [5, 11]\n[metrics.mari]\nk_candidates = [5, 11]\n'
                       '[metrics.croma]\nm = [3]\n'
                       '[execution]\nn_workers = 1\ndashboard = false\nperformance_report = false\n')
        assert main(["run", str(job), "--quiet"]) == 0, capsys.readouterr()
        digests[fmt] = digest_store(tmp_path / f"store-{fmt}", ignore=("inputs",))  # input digests differ by format
    assert len(digests["npy"]) == 3 and digests["npy"] == digests["zarr"] == digests["linked"]


def test_linked_npy_slide_files_are_read_in_place(tmp_path):
    """``--link`` takes per-slide ``.npy`` files too (a slide table gives their tiles in order)."""
    rng = np.random.default_rng(5)
    (tmp_path / "feats").mkdir()
    slides, parts = [f"P{i}" for i in range(6)], []
    for i, s in enumerate(slides):
        x = rng.standard_normal((10 + i, 8)).astype(np.float32)
        np.save(tmp_path / "feats" / f"{s}.npy", x)
        parts.append(x)
    table = pd.DataFrame({"group_id": slides, "label": ["a", "b"] * 3, "centre": ["x", "y", "z"] * 2})
    cache = import_cache(tmp_path / "cache", tileset="tiles", manifest=table, encoders={"enc": tmp_path / "feats"},
                         layout="per_slide", storage=StorageOptions(link=True))
    meta = cache.validate_embeddings("enc", "tiles")
    assert meta.format == "cachescore.linked" and all(s.dataset is None for s in meta.shards)
    np.testing.assert_array_equal(cache.load_rows("enc", "tiles"), np.concatenate(parts))
    before = os.stat(tmp_path / "feats" / "P2.npy").st_mtime_ns
    np.save(tmp_path / "feats" / "P2.npy", parts[2] + 1)  # rewritten: same size, a later mtime
    os.utime(tmp_path / "feats" / "P2.npy", ns=(before + 10**9, before + 10**9))  # on any clock resolution
    with pytest.raises(ShardError, match=r"P2\.npy changed since it was linked"):
        Cache(tmp_path / "cache").load_rows("enc", "tiles", np.arange(25, 30))
