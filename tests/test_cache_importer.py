"""cachescore.cache.import_cache: per-encoder and per-slide inputs become a valid cache.

Pins: rows land in manifest order (also when the manifest interleaves slides or lists a subset of
each slide's tiles), every input is checked before anything is written, and each bad input gets
an error naming the encoder, slide, file and rows.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import AlignmentError, CacheError, CacheNotFoundError, LayoutError, NonFiniteError, import_cache


def manifest(n: int, n_slides: int, rng) -> pd.DataFrame:
    slides = rng.permutation(np.arange(n) % n_slides)  # interleaved, not grouped by slide
    return pd.DataFrame({
        "sample_id": [f"tile{i}" for i in range(n)],
        "image_path": [f"p/{i}.png" for i in range(n)],
        "group_id": [f"slide{s}" for s in slides],
        "label": rng.choice(["a", "b"], n),
        "centre": rng.choice(["x", "y"], n),
    })


def test_per_encoder_npy_with_csv_manifest(tmp_path):
    rng = np.random.default_rng(0)
    m = manifest(41, 5, rng)
    m.to_csv(tmp_path / "manifest.csv", index=False)
    arrays = {"uni": rng.standard_normal((41, 8)).astype("float32"), "gigapath": rng.standard_normal((41, 3))}
    for name, x in arrays.items():
        np.save(tmp_path / f"{name}.npy", x)
    cache = import_cache(tmp_path / "cache", tileset="tiles", manifest=tmp_path / "manifest.csv",
                         encoders={k: tmp_path / f"{k}.npy" for k in arrays}, shard_rows=10,
                         views={"all": {"confounder_column": "centre", "design": "all"}})
    assert cache.encoders() == ["gigapath", "uni"] and cache.views() == ["all"]
    for name, x in arrays.items():
        np.testing.assert_array_equal(cache.load_rows(name, "tiles"), x)
        assert cache.meta(name, "tiles").dtype == x.dtype
    tiles = cache.read_tileset("tiles")
    assert tiles["sample_id"].tolist() == m["sample_id"].tolist()
    view = cache.read_view("all")
    np.testing.assert_array_equal(view["row"].to_numpy(), np.arange(41))
    assert view["centre"].tolist() == m["centre"].tolist()


def test_per_encoder_errors(tmp_path):
    rng = np.random.default_rng(1)
    m = manifest(10, 2, rng)
    np.save(tmp_path / "short.npy", np.zeros((9, 4), "float32"))
    np.save(tmp_path / "ints.npy", np.zeros((10, 4), "int32"))
    np.save(tmp_path / "cube.npy", np.zeros((10, 4, 2), "float32"))
    root = tmp_path / "cache"
    with pytest.raises(AlignmentError, match=r"encoder 'e': .*short\.npy has 9 rows but the manifest has 10"):
        import_cache(root, tileset="t", manifest=m, encoders={"e": tmp_path / "short.npy"})
    with pytest.raises(LayoutError, match=r"encoder 'e': .*ints\.npy has dtype int32"):
        import_cache(root, tileset="t", manifest=m, encoders={"e": tmp_path / "ints.npy"})
    with pytest.raises(LayoutError, match=r"must hold a 2-D array .* got shape \(10, 4, 2\)"):
        import_cache(root, tileset="t", manifest=m, encoders={"e": tmp_path / "cube.npy"})
    with pytest.raises(CacheNotFoundError, match=r"encoder 'e': file not found: .*nope\.npy"):
        import_cache(root, tileset="t", manifest=m, encoders={"e": tmp_path / "nope.npy"})
    with pytest.raises(ValueError, match=r"layout must be one of"):
        import_cache(root, tileset="t", manifest=m, encoders={"e": tmp_path / "short.npy"}, layout="per_case")
    assert not root.exists() or not any(root.rglob("*.parquet")), "nothing written after a failed check"


def test_per_encoder_nan_rows_named(tmp_path):
    m = manifest(12, 3, np.random.default_rng(2))
    x = np.ones((12, 3), "float32")
    x[7, 0] = np.nan
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(NonFiniteError, match=re.escape("encoder 'e' (rows are manifest rows): NaN or infinite values at rows [7]")):
        import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": tmp_path / "x.npy"})
    assert not (tmp_path / "c" / "embeddings" / "e" / "t").exists()


def _slide_files(tmp_path, m, dim, rng, *, extra_rows=0):
    """Per-slide files whose rows are the slide's manifest rows in manifest order (+ extra rows)."""
    folder = tmp_path / "slides"
    folder.mkdir()
    expected = np.empty((len(m), dim), "float32")
    for slide, idx in m.groupby("group_id").indices.items():
        x = rng.standard_normal((len(idx) + extra_rows, dim)).astype("float32")
        np.save(folder / f"{slide}.npy", x)
        expected[idx] = x[: len(idx)]
    return folder, expected


def test_per_slide_folder_pattern_and_mapping(tmp_path):
    rng = np.random.default_rng(3)
    m = manifest(57, 6, rng)
    folder, expected = _slide_files(tmp_path, m, 5, rng)
    slides = sorted(m["group_id"].unique())
    forms = {"byfolder": folder, "bypattern": str(folder / "{slide}.npy"),
             "bymapping": {s: folder / f"{s}.npy" for s in slides}}
    cache = import_cache(tmp_path / "c", tileset="t", manifest=m, encoders=forms, layout="per_slide", shard_rows=7)
    for name in forms:
        np.testing.assert_array_equal(cache.load_rows(name, "t"), expected)
        np.testing.assert_array_equal(cache.embeddings(name, "t", chunk_rows=5).compute(scheduler="sync"), expected)


def test_per_slide_tile_index_subset(tmp_path):
    rng = np.random.default_rng(4)
    m = manifest(30, 3, rng)
    folder = tmp_path / "slides"
    folder.mkdir()
    files = {}
    tile_index = np.empty(30, dtype=np.int64)
    for slide, idx in m.groupby("group_id").indices.items():
        files[slide] = rng.standard_normal((len(idx) + 4, 2))  # the manifest lists a permuted subset
        np.save(folder / f"{slide}.npy", files[slide])
        tile_index[idx] = rng.permutation(len(idx) + 4)[: len(idx)]
    m["tile"] = tile_index
    cache = import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": folder}, layout="per_slide",
                         tile_index_column="tile")
    expected = np.stack([files[s][t] for s, t in zip(m["group_id"], tile_index)])
    np.testing.assert_array_equal(cache.load_rows("e", "t"), expected)


def test_per_slide_errors(tmp_path):
    rng = np.random.default_rng(5)
    m = manifest(20, 4, rng)
    folder, _ = _slide_files(tmp_path, m, 3, rng, extra_rows=1)
    slide = m["group_id"].iloc[0]  # slides are checked in manifest order
    n_listed = int((m["group_id"] == slide).sum())
    with pytest.raises(AlignmentError, match=rf"slide '{slide}' file .*{slide}\.npy has {n_listed + 1} rows but the manifest lists {n_listed} tiles"):
        import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": folder}, layout="per_slide")
    m2 = m.assign(tile=0)
    m2.loc[4, "tile"] = 99
    with pytest.raises(AlignmentError, match=r"rows \[4\] have tile beyond their slide file \(row 4: index 99"):
        import_cache(tmp_path / "c", tileset="t", manifest=m2, encoders={"e": folder}, layout="per_slide",
                     tile_index_column="tile")
    np.save(folder / f"{slide}.npy", np.zeros((n_listed + 1, 7), "float32"))
    with pytest.raises(LayoutError, match=r"slide files disagree on dim \[3, 7\]"):
        import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": folder}, layout="per_slide")
    (folder / f"{slide}.npy").unlink()
    with pytest.raises(CacheNotFoundError, match=rf"encoder 'e', slide '{slide}': file not found"):
        import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": folder}, layout="per_slide")
    with pytest.raises(CacheError, match=r"missing slide column 'slide'"):
        import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": folder}, layout="per_slide",
                     slide_column="slide")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*.parquet"))


def test_h5_needs_optional_h5py(tmp_path):
    try:
        import h5py  # noqa: F401
    except ImportError:
        (tmp_path / "x.h5").write_bytes(b"")
        with pytest.raises(ImportError, match=r"optional dependency h5py: pip install 'cachescore\[h5\]'"):
            import_cache(tmp_path / "c", tileset="t", manifest=manifest(3, 1, np.random.default_rng(0)),
                         encoders={"e": tmp_path / "x.h5"})
        return
    import h5py

    m = manifest(9, 3, np.random.default_rng(6))
    x = np.random.default_rng(7).standard_normal((9, 4)).astype("float32")
    with h5py.File(tmp_path / "x.h5", "w") as fh:
        fh["features"] = x
    cache = import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": tmp_path / "x.h5"})
    np.testing.assert_array_equal(cache.load_rows("e", "t"), x)
