"""Reader conformance for cache embeddings and views (cachescore.cache.Cache).

Pins: embeddings are lazy dask arrays chunked along rows only, whose graphs hold paths, row ranges
and row indices but never embedding values; chunk and shard boundaries are crossed (tiny shards and
chunks) and every read equals the written array; views select, reorder and repeat rows and are
expanded by the ``row`` index; read_view returns croma's columns; fingerprints are content-based.
"""

from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import pytest

from cachescore.cache import Cache, write_embeddings, write_tileset, write_view
from cluster_utils import dask_subprocess_cluster  # noqa: F401  (pytest fixture)


def _tiles(n: int, rng) -> pd.DataFrame:
    groups = [f"slide{i % 7}" for i in range(n)]
    return pd.DataFrame({
        "sample_id": [f" t{i:04d} " if i % 5 == 0 else f"t{i:04d}" for i in range(n)],  # stripped on write
        "image_path": [f"img/{i}.png" for i in range(n)],
        "group_id": groups,
        "label": ["a" if i % 2 else "b" for i in range(n)],
        "centre": [["X", "Y", "Z"][i % 3] for i in range(n)],
        "extra_meta": np.arange(n) * 0.5,
    })


@pytest.fixture(params=["float32", "float64", "float16"])
def cache(tmp_path, request):
    rng = np.random.default_rng(123)
    n, dim = 53, 6
    tiles = _tiles(n, rng)
    write_tileset(tmp_path, "ts", tiles)
    data = {}
    for enc, shard in (("encB", 10), ("encA", 53), ("encC", 4)):
        x = rng.standard_normal((n, dim)).astype(request.param)
        write_embeddings(tmp_path, enc, "ts", x, shard_rows=shard)
        data[enc] = x
    order = np.array([52, 0, 3, 3, 3, 17, 9, 10, 11, 52, 1, 29, 30, 31, 0], dtype=np.int64)
    view = pd.DataFrame({"sample_id": [f"t{i:04d}" for i in order], "label": [f"L{i % 2}" for i in order]})
    write_view(tmp_path, "picky", view, tileset="ts", confounder_column="centre", design="all")
    write_view(tmp_path, "whole", tiles[["sample_id", "label", "group_id", "centre"]].assign(subset="s1"),
               tileset="ts", confounder_column="centre")
    return Cache(tmp_path), data, order, tiles


def test_listings_and_spec(cache):
    c, data, _, _ = cache
    assert c.encoders() == ["encA", "encB", "encC"]
    assert c.tilesets() == ["ts"]
    assert c.views() == ["picky", "whole"]
    spec = c.view_spec("picky")
    assert (spec.name, spec.tileset, spec.confounder_column, spec.design) == ("picky", "ts", "centre", "all")
    assert c.view_spec("whole").design is None


@pytest.mark.parametrize("chunk_rows", [None, 3, 7, 100])
def test_embeddings_lazy_row_chunks_equal_written(cache, chunk_rows):
    c, data, _, _ = cache
    for enc, x in data.items():
        arr = c.embeddings(enc, "ts", chunk_rows=chunk_rows)
        assert arr.shape == x.shape and arr.dtype == x.dtype
        assert len(arr.chunks[1]) == 1, "chunked along rows only"
        if chunk_rows:
            assert max(arr.chunks[0]) <= chunk_rows
        np.testing.assert_array_equal(arr.compute(scheduler="sync"), x)
        # slices that straddle chunk and shard boundaries
        np.testing.assert_array_equal(arr[8:31].compute(scheduler="sync"), x[8:31])
        np.testing.assert_array_equal(c.load_rows(enc, "ts"), x)


def _graph_arrays(arr):
    found = []
    def walk(v):
        if isinstance(v, np.ndarray):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            for w in v:
                walk(w)
    for task in dict(arr.__dask_graph__()).values():
        walk(getattr(task, "args", task) if not isinstance(task, tuple) else task)
    return found


def test_graph_holds_no_embedding_values(tmp_path):
    n, dim = 4000, 64
    write_tileset(tmp_path, "ts", pd.DataFrame({"sample_id": [f"s{i}" for i in range(n)], "image_path": "p"}))
    x = np.random.default_rng(0).standard_normal((n, dim))
    write_embeddings(tmp_path, "e", "ts", x, shard_rows=700)
    c = Cache(tmp_path)
    arr = c.embeddings("e", "ts")
    assert arr.chunks[0] == (700,) * 5 + (500,)
    assert all(a.dtype.kind != "f" for a in _graph_arrays(arr))
    assert len(pickle.dumps(dict(arr.__dask_graph__()))) < 20_000  # the data is 2 MB
    rows = np.random.default_rng(1).integers(0, n, size=3000)
    arr2 = c.rows_embeddings("e", "ts", rows, chunk_rows=512)
    index_arrays = _graph_arrays(arr2)
    assert len(index_arrays) >= len(arr2.chunks[0]) and all(a.dtype == np.int64 for a in index_arrays)
    np.testing.assert_array_equal(arr2.compute(scheduler="sync"), x[rows])
    # same inputs give the same task names (deterministic graphs)
    assert c.embeddings("e", "ts").name == arr.name
    assert pickle.loads(pickle.dumps(c)) == c


@pytest.mark.parametrize("chunk_rows", [None, 1, 4])
def test_view_embeddings_select_reorder_repeat(cache, chunk_rows):
    c, data, order, _ = cache
    frame = c.read_view("picky")
    np.testing.assert_array_equal(frame["row"].to_numpy(), order)
    for enc, x in data.items():
        arr = c.view_embeddings(enc, "picky", chunk_rows=chunk_rows)
        assert len(arr.chunks[1]) == 1 and arr.shape == (len(order), x.shape[1])
        np.testing.assert_array_equal(arr.compute(scheduler="sync"), x[order])
        np.testing.assert_array_equal(c.load_rows(enc, "ts", frame["row"].to_numpy()), x[order])


def test_read_view_columns(cache):
    c, _, order, tiles = cache
    frame = c.read_view("picky")
    assert list(frame.columns[:5]) == ["sample_id", "image_path", "label", "group_id", "centre"]
    assert frame.columns[-1] == "row" and frame["row"].dtype == np.int64
    assert frame["sample_id"].tolist() == [f"t{i:04d}" for i in order]
    # image_path, group_id, confounder come from the tileset; label is the view's relabelling
    assert frame["image_path"].tolist() == [f"img/{i}.png" for i in order]
    assert frame["group_id"].tolist() == tiles["group_id"].to_numpy()[order].tolist()
    assert frame["centre"].tolist() == tiles["centre"].to_numpy()[order].tolist()
    assert frame["label"].tolist() == [f"L{i % 2}" for i in order]
    assert frame.attrs["tileset"] == "ts" and frame.attrs["confounder_column"] == "centre"
    whole = c.read_view("whole")
    assert list(whole.columns) == ["sample_id", "image_path", "label", "group_id", "centre", "subset", "row"]
    np.testing.assert_array_equal(whole["row"].to_numpy(), np.arange(len(tiles)))


def test_fingerprints_are_content_based(tmp_path):
    n = 20
    tiles = pd.DataFrame({"sample_id": [f"s{i}" for i in range(n)], "image_path": "p", "label": "a",
                          "group_id": [f"g{i}" for i in range(n)], "c": "x"})
    write_tileset(tmp_path / "one", "ts", tiles)
    write_tileset(tmp_path / "two", "ts", tiles)
    x = np.random.default_rng(0).standard_normal((n, 3)).astype("float32")
    write_embeddings(tmp_path / "one", "e", "ts", x, shard_rows=6)
    write_embeddings(tmp_path / "two", "e", "ts", x, shard_rows=6)
    one, two = Cache(tmp_path / "one"), Cache(tmp_path / "two")
    fp = one.embedding_fingerprint("e", "ts")
    assert len(fp) == 64 and fp == two.embedding_fingerprint("e", "ts")
    y = x.copy()
    y[13, 1] += 1.0
    write_embeddings(tmp_path / "two", "e", "ts", y, shard_rows=6, overwrite=True)
    assert two.embedding_fingerprint("e", "ts") != fp
    for root in (tmp_path / "one", tmp_path / "two"):
        write_view(root, "v", tiles[["sample_id"]], tileset="ts", confounder_column="c")
    assert one.view_fingerprint("v") == two.view_fingerprint("v")
    write_view(tmp_path / "two", "v", tiles[["sample_id"]], tileset="ts", confounder_column="c",
               design="all", overwrite=True)
    assert one.view_fingerprint("v") != two.view_fingerprint("v")
    write_view(tmp_path / "two", "v", tiles[["sample_id"]], tileset="ts", confounder_column="c", overwrite=True)
    assert one.view_fingerprint("v") == two.view_fingerprint("v")
    write_tileset(tmp_path / "two", "ts", tiles.assign(image_path="q"), overwrite=True)
    assert one.view_fingerprint("v") != two.view_fingerprint("v")


def test_validate_and_empty_tileset(tmp_path):
    write_tileset(tmp_path, "ts", pd.DataFrame({"sample_id": pd.Series([], dtype=str), "image_path": pd.Series([], dtype=str)}))
    write_embeddings(tmp_path, "e", "ts", np.zeros((0, 4), dtype="float32"))
    c = Cache(tmp_path)
    meta = c.validate_embeddings("e", "ts")
    assert meta.shape == (0, 4)
    assert c.embeddings("e", "ts").compute(scheduler="sync").shape == (0, 4)
    assert c.load_rows("e", "ts", np.zeros(0, dtype=np.int64)).shape == (0, 4)


@pytest.mark.cluster
def test_reads_on_real_worker_processes(tmp_path, dask_subprocess_cluster):
    """Workers in other processes read the shards by path: the graph ships no data."""
    import distributed

    n = 300
    write_tileset(tmp_path, "ts", pd.DataFrame({"sample_id": [f"s{i}" for i in range(n)], "image_path": "p"}))
    x = np.random.default_rng(5).standard_normal((n, 16)).astype("float32")
    write_embeddings(tmp_path, "e", "ts", x, shard_rows=64)
    write_view(tmp_path, "v", pd.DataFrame({"sample_id": [f"s{i}" for i in range(n - 1, -1, -3)] * 2, "label": "a",
                                            "group_id": "g", "c": "x"}), tileset="ts", confounder_column="c")
    c = Cache(tmp_path)
    rows = c.read_view("v")["row"].to_numpy()
    with distributed.Client(dask_subprocess_cluster.address) as client:
        np.testing.assert_array_equal(client.compute(c.view_embeddings("e", "v", chunk_rows=37)).result(), x[rows])
        np.testing.assert_array_equal(client.compute(c.embeddings("e", "ts", chunk_rows=50)).result(), x)
        np.testing.assert_array_equal(client.submit(c.load_rows, "e", "ts", rows[:10]).result(), x[rows[:10]])


def test_write_from_dask_and_memmap_inputs(tmp_path):
    import dask.array as da

    n = 47
    write_tileset(tmp_path, "ts", pd.DataFrame({"sample_id": [f"s{i}" for i in range(n)], "image_path": "p"}))
    x = np.random.default_rng(9).standard_normal((n, 5))
    write_embeddings(tmp_path, "fromdask", "ts", da.from_array(x, chunks=(7, 2)), shard_rows=10)
    np.save(tmp_path / "x.npy", x.astype("float16"))
    write_embeddings(tmp_path, "frommemmap", "ts", np.load(tmp_path / "x.npy", mmap_mode="r"), shard_rows=13)
    c = Cache(tmp_path)
    np.testing.assert_array_equal(c.load_rows("fromdask", "ts"), x)
    np.testing.assert_array_equal(c.load_rows("frommemmap", "ts"), x.astype("float16"))
    assert [s.rows for s in c.meta("fromdask", "ts").shards] == [10, 10, 10, 10, 7]
    c.validate_embeddings("fromdask", "ts")


def test_a_view_read_again_is_the_kept_frame_until_its_files_change(tmp_path):
    """``read_view`` keeps parsed views per process (issue 25: a worker reads each view once per
    encoder): a caller's edits never reach the next read, and a rewritten view or tileset is read anew."""
    from cachescore.cache import make_demo_cache

    root = make_demo_cache(tmp_path / "c", n_slides_per_cell=2, tiles_per_slide=3, dim=4, encoders=2, seed=0)
    cache = Cache(root)
    first = cache.read_view("centre_all")
    first.loc[0, "label"] = "edited"
    second = cache.read_view("centre_all")
    assert second.loc[0, "label"] != "edited" and second.attrs["view"] == "centre_all"
    pd.testing.assert_frame_equal(second, Cache(root).read_view("centre_all"))
    frame = second.drop(columns=["row", "image_path"])
    write_view(root, "centre_all", frame.iloc[: len(frame) // 2], tileset="demo", confounder_column="centre",
               design="all", overwrite=True)
    assert len(cache.read_view("centre_all")) == len(frame) // 2
