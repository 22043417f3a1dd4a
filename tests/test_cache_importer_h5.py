"""cachescore.cache.import_cache with real ``.h5`` files (h5py), per slide and per encoder.

Pins: per-slide ``.h5`` files (configurable dataset name, nested paths included) land in manifest
order, also for interleaved manifests, tile-index subsets (dense hyperslab and sparse point reads),
float16 and big-endian data (stored native); every bad input is refused before anything is written,
with an error naming the encoder, slide, file, dataset and rows: missing dataset, a group instead
of a dataset, wrong ndim, disagreeing dims, integer dtype, a manifest slide without a file, tile
count mismatch, a file that is not HDF5, NaN rows.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import AlignmentError, CacheNotFoundError, LayoutError, NonFiniteError, import_cache

h5py = pytest.importorskip("h5py")


def manifest(n: int, n_slides: int, rng) -> pd.DataFrame:
    slides = rng.permutation(np.arange(n) % n_slides)  # interleaved, not grouped by slide
    return pd.DataFrame({
        "sample_id": [f"tile{i}" for i in range(n)],
        "image_path": [f"p/{i}.png" for i in range(n)],
        "group_id": [f"slide{s}" for s in slides],
        "label": rng.choice(["a", "b"], n),
        "centre": rng.choice(["x", "y"], n),
    })


def write_h5(path, data, dataset="features", **extra):
    with h5py.File(path, "w") as fh:
        fh.create_dataset(dataset, data=data)
        for name, value in extra.items():
            fh.create_dataset(name, data=value)


def slide_h5_files(folder, m, dim, rng, *, dataset="features", dtype="float32", extra_rows=0):
    """One ``<slide>.h5`` per slide whose rows are that slide's manifest rows, in manifest order."""
    folder.mkdir(exist_ok=True)
    expected = np.empty((len(m), dim), dtype)
    for slide, idx in m.groupby("group_id").indices.items():
        x = rng.standard_normal((len(idx) + extra_rows, dim)).astype(dtype)
        write_h5(folder / f"{slide}.h5", x, dataset, coords=np.zeros((len(x), 2), "int64"))
        expected[idx] = x[: len(idx)]
    return expected


def nothing_written(root) -> bool:
    return not root.exists() or not any(root.rglob("*.parquet"))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_per_slide_h5_folder_pattern_mapping_nested_dataset(tmp_path, dtype):
    rng = np.random.default_rng(11)
    m = manifest(61, 7, rng)
    folder = tmp_path / "uni"
    expected = slide_h5_files(folder, m, 6, rng, dataset="feats/uni", dtype=dtype)
    slides = sorted(m["group_id"].unique())
    forms = {"byfolder": folder, "bypattern": str(folder / "{slide}.h5"),
             "bymapping": {s: folder / f"{s}.h5" for s in slides}}
    cache = import_cache(tmp_path / "c", tileset="t", manifest=m, encoders=forms, layout="per_slide",
                         h5_dataset="feats/uni", shard_rows=9,
                         views={"all": {"confounder_column": "centre", "design": "all"}})
    for name in forms:
        assert cache.meta(name, "t").dtype == np.dtype(dtype)
        np.testing.assert_array_equal(cache.load_rows(name, "t"), expected)
        np.testing.assert_array_equal(cache.embeddings(name, "t", chunk_rows=4).compute(scheduler="sync"), expected)
    assert cache.read_view("all")["group_id"].tolist() == m["group_id"].tolist()


def test_per_slide_h5_tile_index_dense_and_sparse_reads(tmp_path):
    rng = np.random.default_rng(12)
    m = manifest(40, 2, rng)
    folder = tmp_path / "slides"
    folder.mkdir()
    files = {}
    tile_index = np.empty(len(m), dtype=np.int64)
    sizes = {"slide0": None, "slide1": 5000}  # slide0: dense permuted subset; slide1: 20 rows spread over 5000
    for slide, idx in m.groupby("group_id").indices.items():
        n_rows = sizes[slide] or len(idx) + 3
        files[slide] = rng.standard_normal((n_rows, 3)).astype("float32")
        write_h5(folder / f"{slide}.h5", files[slide])
        tile_index[idx] = rng.choice(n_rows, size=len(idx), replace=False)
    tile_index[np.flatnonzero(m["group_id"] == "slide0")[:2]] = tile_index[np.flatnonzero(m["group_id"] == "slide0")[2]]
    m["tile"] = tile_index  # slide0 now repeats one tile three times: repeats are allowed
    cache = import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": folder}, layout="per_slide",
                         tile_index_column="tile")
    expected = np.stack([files[s][t] for s, t in zip(m["group_id"], tile_index)])
    np.testing.assert_array_equal(cache.load_rows("e", "t"), expected)


def test_per_encoder_h5_big_endian_is_stored_native(tmp_path):
    m = manifest(15, 3, np.random.default_rng(13))
    x = np.random.default_rng(14).standard_normal((15, 4)).astype(">f4")
    write_h5(tmp_path / "e.h5", x, "emb")
    cache = import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": tmp_path / "e.h5"}, h5_dataset="emb")
    meta = cache.validate_embeddings("e", "t")
    assert meta.dtype == np.dtype("float32") and meta.dtype.byteorder in "=|<"
    np.testing.assert_array_equal(cache.load_rows("e", "t"), x.astype("float32"))


def test_mixed_npy_and_h5_slides_in_one_folder(tmp_path):
    rng = np.random.default_rng(15)
    m = manifest(20, 4, rng)
    folder = tmp_path / "mixed"
    expected = slide_h5_files(folder, m, 3, rng)
    (folder / "slide2.h5").unlink()
    part = expected[np.flatnonzero(m["group_id"] == "slide2")]
    np.save(folder / "slide2.npy", part)
    cache = import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": folder}, layout="per_slide")
    np.testing.assert_array_equal(cache.load_rows("e", "t"), expected)


def test_per_slide_h5_errors(tmp_path):
    rng = np.random.default_rng(16)
    m = manifest(24, 4, rng)
    folder = tmp_path / "slides"
    slide_h5_files(folder, m, 3, rng)
    first = m["group_id"].iloc[0]  # slides are checked in manifest order
    second = next(s for s in m["group_id"] if s != first)
    n_first = int((m["group_id"] == first).sum())
    root = tmp_path / "c"
    run = lambda **kw: import_cache(root, tileset="t", manifest=m, encoders={"e": folder}, layout="per_slide", **kw)

    # missing dataset: names the file, the dataset asked for, the datasets present and the option
    with pytest.raises(LayoutError, match=rf"encoder 'e', slide '{first}': .*{first}\.h5 has no dataset 'feats' "
                                          r"\(datasets: \['coords', 'features'\]\); pass h5_dataset=\.\.\."):
        run(h5_dataset="feats")

    # a group where the dataset should be
    write_h5(folder / f"{second}.h5", np.zeros((3, 3), "float32"), "features/inner")
    with pytest.raises(LayoutError, match=rf"slide '{second}': .*{second}\.h5: 'features' is a Group, not a dataset"):
        run()

    # wrong ndim
    n_second = int((m["group_id"] == second).sum())
    write_h5(folder / f"{second}.h5", np.zeros((n_second, 3, 2), "float32"))
    with pytest.raises(LayoutError, match=rf"slide '{second}': .*{second}\.h5 dataset 'features' must hold a 2-D "
                                          rf"array \(tiles, dim\), got shape \({n_second}, 3, 2\)"):
        run()

    # dims disagree across slides: both slides named with their dims
    write_h5(folder / f"{second}.h5", np.zeros((n_second, 5), "float32"))
    with pytest.raises(LayoutError, match=rf"slide files disagree on dim \[3, 5\] .*slide '{first}': .* has dim 3, "
                                          rf"float32; slide '{second}': .*{second}\.h5 has dim 5, float32"):
        run()

    # integer dtype
    write_h5(folder / f"{second}.h5", np.zeros((n_second, 3), "int32"))
    with pytest.raises(LayoutError, match=rf"slide '{second}': .*{second}\.h5 dataset 'features' has dtype int32; "
                                          r"expected one of \['float16', 'float32', 'float64'\]"):
        run()

    # tile count mismatch
    write_h5(folder / f"{second}.h5", np.zeros((n_second + 2, 3), "float32"))
    with pytest.raises(AlignmentError, match=rf"slide '{second}' file .*{second}\.h5 has {n_second + 2} rows but "
                                             rf"the manifest lists {n_second} tiles"):
        run()

    # not an HDF5 file at all
    (folder / f"{second}.h5").write_bytes(b"this is not hdf5")
    with pytest.raises(LayoutError, match=rf"slide '{second}': .*{second}\.h5 is not a readable HDF5 file"):
        run()

    # a slide in the manifest with no file: folder, pattern and mapping forms
    (folder / f"{second}.h5").unlink()
    with pytest.raises(CacheNotFoundError, match=re.escape(f"encoder 'e', slide '{second}': file not found: none of "
                                                           f"['{second}.npy', '{second}.h5', '{second}.hdf5'] in {folder}; "
                                                           f"1 manifest slide(s) have no file: ['{second}']")):
        run()
    with pytest.raises(CacheNotFoundError, match=rf"encoder 'e', slide '{second}': file not found: .*{second}\.h5"):
        import_cache(root, tileset="t", manifest=m, encoders={"e": str(folder / "{slide}.h5")}, layout="per_slide")
    with pytest.raises(CacheNotFoundError, match=rf"encoder 'e': no file given for slides \['{second}'\]"):
        import_cache(root, tileset="t", manifest=m, layout="per_slide",
                     encoders={"e": {s: folder / f"{s}.h5" for s in m["group_id"].unique() if s != second}})
    assert nothing_written(root), "nothing is written after a failed check"
    assert n_first > 0


def test_per_slide_h5_nan_rows_named_by_manifest_row(tmp_path):
    rng = np.random.default_rng(17)
    m = manifest(18, 3, rng)
    folder = tmp_path / "slides"
    slide_h5_files(folder, m, 2, rng)
    slide = m["group_id"].iloc[5]
    local = int((m["group_id"].iloc[:5] == slide).sum())  # row 5 is this slide's local tile `local`
    with h5py.File(folder / f"{slide}.h5", "r+") as fh:
        fh["features"][local, 1] = np.inf
    with pytest.raises(NonFiniteError, match=re.escape("encoder 'e' (rows are manifest rows): NaN or infinite values at rows [5]")):
        import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": folder}, layout="per_slide")
    assert not (tmp_path / "c" / "embeddings" / "e" / "t").exists()


def test_per_encoder_h5_row_count_and_dataset(tmp_path):
    m = manifest(10, 2, np.random.default_rng(18))
    write_h5(tmp_path / "short.h5", np.zeros((9, 4), "float32"))
    with pytest.raises(AlignmentError, match=r"encoder 'e': .*short\.h5 has 9 rows but the manifest has 10"):
        import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": tmp_path / "short.h5"})
    with pytest.raises(LayoutError, match=r"short\.h5 has no dataset 'emb' \(datasets: \['features'\]\)"):
        import_cache(tmp_path / "c", tileset="t", manifest=m, encoders={"e": tmp_path / "short.h5"}, h5_dataset="emb")
    assert nothing_written(tmp_path / "c")
