"""Every bad cache input gets a precise error (cachescore.cache.errors).

Pins: the error type (a CacheError subclass, itself a ValueError; not-found errors are also
FileNotFoundError) and that the message names the file/encoder/tileset/shard, the column and the
offending rows or row range.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cachescore.cache import (
    AlignmentError,
    Cache,
    CacheError,
    CacheNotFoundError,
    LayoutError,
    NonFiniteError,
    ShardError,
    ShardNotFoundError,
    ViewError,
    write_embeddings,
    write_tileset,
    write_view,
)

N, DIM = 30, 4


@pytest.fixture
def root(tmp_path):
    tiles = pd.DataFrame({"sample_id": [f"s{i:02d}" for i in range(N)], "image_path": [f"p{i}" for i in range(N)],
                          "group_id": [f"g{i % 6}" for i in range(N)], "centre": [f"c{i % 2}" for i in range(N)]})
    write_tileset(tmp_path, "ts", tiles)
    x = np.random.default_rng(0).standard_normal((N, DIM)).astype("float32")
    write_embeddings(tmp_path, "enc", "ts", x, shard_rows=8)  # shards: 0:8 8:16 16:24 24:30
    return tmp_path


def shard(root, i):
    return root / "embeddings" / "enc" / "ts" / f"shard-{i:05d}.npy"


def test_hierarchy():
    assert issubclass(CacheError, ValueError)
    assert issubclass(CacheNotFoundError, FileNotFoundError) and issubclass(ShardNotFoundError, FileNotFoundError)
    assert issubclass(ShardError, CacheError) and issubclass(NonFiniteError, ValueError)


# -- alignment ---------------------------------------------------------------------------------

def test_write_misaligned_rows(root):
    with pytest.raises(AlignmentError, match=r"has 29 rows but tileset 'ts' has 30 tiles"):
        write_embeddings(root, "enc2", "ts", np.zeros((N - 1, DIM), "float32"))
    assert not (root / "embeddings" / "enc2" / "ts").exists()


def test_tiles_grew_after_embeddings(root):
    tiles = pd.read_parquet(root / "tilesets" / "ts" / "tiles.parquet")
    extra = pd.concat([tiles, tiles.iloc[:1].assign(sample_id="new")], ignore_index=True)
    write_tileset(root, "ts", extra, overwrite=True)
    with pytest.raises(AlignmentError, match=r"encoder 'enc', tileset 'ts' have 30 rows but .*tiles.parquet has 31"):
        Cache(root).embeddings("enc", "ts")


def test_tiles_reordered_after_embeddings(root):
    tiles = pd.read_parquet(root / "tilesets" / "ts" / "tiles.parquet")
    write_tileset(root, "ts", tiles.iloc[::-1], overwrite=True)
    with pytest.raises(AlignmentError, match=r"sample_id order differs"):
        Cache(root).validate_embeddings("enc", "ts")


# -- non-finite --------------------------------------------------------------------------------

def test_nan_rows_rejected_on_write(root):
    x = np.ones((N, DIM), "float32")
    x[[3, 17], 1] = np.nan
    x[25, 0] = np.inf
    with pytest.raises(NonFiniteError, match=re.escape("at rows [3, 17, 25]")):
        write_embeddings(root, "bad", "ts", x, shard_rows=100)


def test_nan_rows_found_by_validate(root):
    x = np.ones((N, DIM), "float32")
    x[[9, 14], 2] = -np.inf
    write_embeddings(root, "bad", "ts", x, shard_rows=8, check_finite=False)
    c = Cache(root)
    with pytest.raises(NonFiniteError, match=r"shard-00001\.npy \(rows 8:16\) has NaN or infinite values at tileset rows \[9, 14\]"):
        c.validate_embeddings("bad", "ts")
    c.validate_embeddings("bad", "ts", finite=False)


def test_finite_overflowing_sum_is_not_an_error(root):
    x = np.full((N, DIM), 6e4, "float16")  # the float64 sum is finite, but float16 would overflow
    write_embeddings(root, "big", "ts", x)
    Cache(root).validate_embeddings("big", "ts")


# -- shards ------------------------------------------------------------------------------------

def test_truncated_shard(root):
    path = shard(root, 2)
    path.write_bytes(path.read_bytes()[:-10])
    c = Cache(root)
    with pytest.raises(ShardError, match=r"encoder 'enc', tileset 'ts': shard .*shard-00002\.npy is corrupt or truncated"):
        c.validate_embeddings("enc", "ts")
    arr = c.embeddings("enc", "ts")
    arr[:16].compute(scheduler="sync")  # untouched shards still read
    with pytest.raises(ShardError, match=r"shard-00002\.npy"):
        arr.compute(scheduler="sync")
    with pytest.raises(ShardError, match=r"shard-00002\.npy"):
        c.load_rows("enc", "ts", np.array([1, 20]))


def test_garbage_shard(root):
    shard(root, 0).write_bytes(b"not a numpy file at all" * 10)
    with pytest.raises(ShardError, match=r"shard-00000\.npy is corrupt"):
        Cache(root).load_rows("enc", "ts")


def test_flipped_byte_fails_checksum(root):
    path = shard(root, 3)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"shard-00003\.npy \(rows 24:30\) does not match its sha256"):
        Cache(root).validate_embeddings("enc", "ts")


def test_missing_shard(root):
    shard(root, 1).unlink()
    c = Cache(root)
    with pytest.raises(ShardNotFoundError, match=r"encoder 'enc', tileset 'ts': shard file missing: .*shard-00001\.npy"):
        c.validate_embeddings("enc", "ts")
    with pytest.raises(FileNotFoundError, match=r"shard-00001\.npy"):
        c.embeddings("enc", "ts").compute(scheduler="sync")


def test_wrong_dtype_shard(root):
    np.save(shard(root, 1), np.zeros((8, DIM), "float64"))
    with pytest.raises(ShardError, match=r"shard-00001\.npy has dtype float64, meta.json says float32"):
        Cache(root).validate_embeddings("enc", "ts", checksums=False)


def test_wrong_shape_shard(root):
    np.save(shard(root, 1), np.zeros((7, DIM), "float32"))
    with pytest.raises(ShardError, match=r"shard-00001\.npy has shape \(7, 4\), meta.json says \(8, 4\)"):
        Cache(root).load_rows("enc", "ts")


def test_write_rejects_non_float_and_bad_shape(root):
    with pytest.raises(LayoutError, match=r"dtype must be one of .* got int64; cast explicitly"):
        write_embeddings(root, "e2", "ts", np.zeros((N, DIM), "int64"))
    with pytest.raises(LayoutError, match=r"must be 2-D"):
        write_embeddings(root, "e2", "ts", np.zeros((N, DIM, 1), "float32"))


def test_malformed_meta(root):
    meta = root / "embeddings" / "enc" / "ts" / "meta.json"
    good = json.loads(meta.read_text())
    meta.write_text("{not json")
    with pytest.raises(LayoutError, match=r"meta.json is not valid JSON"):
        Cache(root).embeddings("enc", "ts")
    meta.write_text(json.dumps({**good, "dtype": "int8"}))
    with pytest.raises(LayoutError, match=r"'dtype' must be one of"):
        Cache(root).embeddings("enc", "ts")
    meta.write_text(json.dumps({**good, "shape": [31, DIM]}))
    with pytest.raises(LayoutError, match=r"shard row counts sum to 30 but 'shape' has 31 rows"):
        Cache(root).embeddings("enc", "ts")


def test_overwrite_refused(root):
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_embeddings(root, "enc", "ts", np.zeros((N, DIM), "float32"))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_tileset(root, "ts", pd.DataFrame({"sample_id": ["a"], "image_path": ["b"]}))


# -- not found ---------------------------------------------------------------------------------

def test_not_found(root, tmp_path):
    c = Cache(root)
    with pytest.raises(CacheNotFoundError, match=r"no embeddings for encoder 'nope', tileset 'ts'.*known encoders: \['enc'\]"):
        c.embeddings("nope", "ts")
    with pytest.raises(CacheNotFoundError, match=r"encoder 'enc' has tilesets \['ts'\]"):
        c.embeddings("enc", "other")
    with pytest.raises(CacheNotFoundError, match=r"sidecar of view 'v' not found"):
        c.read_view("v")
    with pytest.raises(FileNotFoundError, match=r"cache folder not found"):
        Cache(tmp_path / "missing").encoders()
    with pytest.raises(ValueError, match=r"invalid encoder name '\.\./x'"):
        c.embeddings("../x", "ts")


# -- tilesets and views ------------------------------------------------------------------------

def test_tileset_errors(tmp_path):
    with pytest.raises(ViewError, match=r"tileset 't': missing required columns \['image_path'\]"):
        write_tileset(tmp_path, "t", pd.DataFrame({"sample_id": ["a"]}))
    with pytest.raises(ViewError, match=r"'sample_id' must be unique; duplicates at rows \[1, 2\]"):
        write_tileset(tmp_path, "t", pd.DataFrame({"sample_id": ["a", "b", " b"], "image_path": "p"}))
    with pytest.raises(ViewError, match=r"'sample_id' has missing or blank values at rows \[0, 2\]"):
        write_tileset(tmp_path, "t", pd.DataFrame({"sample_id": [None, "b", "  "], "image_path": "p"}))


def test_view_unknown_sample_id(root, monkeypatch):
    frame = pd.DataFrame({"sample_id": ["s01", "zz", "s02", "yy"], "label": "a"})
    with pytest.raises(ViewError, match=r"view 'v': sample_id values not in tileset 'ts' at rows \[1, 3\] \(e.g. 'zz'\)"):
        write_view(root, "v", frame, tileset="ts", confounder_column="centre")
    # a table edited by hand no longer matches the sha256 its sidecar records: refused on read
    import cachescore.cache.reader as reader_mod

    monkeypatch.setattr(reader_mod, "VIEW_RETRY_PAUSE", 0.0)
    write_view(root, "v", frame.iloc[[0, 2]], tileset="ts", confounder_column="centre")
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), root / "views" / "v.parquet")
    with pytest.raises(ViewError, match=r"v\.parquet does not match the sha256/size recorded in its sidecar"):
        Cache(root).read_view("v")
    # with a sidecar that records no table hash (written before they were recorded), the bad
    # sample_ids are caught on read
    side = root / "views" / "v.json"
    side.write_text(json.dumps({k: v for k, v in json.loads(side.read_text()).items() if not k.startswith("table_")}))
    with pytest.raises(ViewError, match=r"v\.parquet: sample_id values not in tileset 'ts' .*at rows \[1, 3\]"):
        Cache(root).read_view("v")


def test_view_missing_columns(root):
    with pytest.raises(ViewError, match=r"view 'v': missing required columns \['label'\]"):
        write_view(root, "v", pd.DataFrame({"sample_id": ["s01"]}), tileset="ts", confounder_column="centre")
    with pytest.raises(ViewError, match=r"missing required columns \['label', 'scanner'\]"):
        write_view(root, "v", pd.DataFrame({"sample_id": ["s01"]}), tileset="ts", confounder_column="scanner")
    write_view(root, "v", pd.DataFrame({"sample_id": ["s01"], "label": ["a"]}), tileset="ts", confounder_column="centre")
    (root / "views" / "v.json").write_text(json.dumps({"tileset": "ts", "confounder_column": "scanner"}))
    with pytest.raises(ViewError, match=r"v\.parquet: missing required column 'scanner' \(not in the view nor in .*tiles\.parquet\)"):
        Cache(root).read_view("v")


def test_view_blank_values(root):
    frame = pd.DataFrame({"sample_id": ["s01", "s02", "s03"], "label": ["a", None, "b"], "group_id": ["g", "g", " "]})
    write_view(root, "v", frame, tileset="ts", confounder_column="centre")
    with pytest.raises(ViewError, match=r"column 'label' has missing or blank values at rows \[1\]"):
        Cache(root).read_view("v")
    write_view(root, "v", frame.assign(label="a"), tileset="ts", confounder_column="centre", overwrite=True)
    with pytest.raises(ViewError, match=r"column 'group_id' has missing or blank values at rows \[2\]"):
        Cache(root).read_view("v")


def test_bad_sidecar(root):
    write_view(root, "v", pd.DataFrame({"sample_id": ["s01"], "label": ["a"]}), tileset="ts", confounder_column="centre")
    (root / "views" / "v.json").write_text(json.dumps({"tileset": "ts"}))
    with pytest.raises(ViewError, match=r"v\.json: key 'confounder_column' must be a non-empty string"):
        Cache(root).view_spec("v")
    (root / "views" / "v.json").write_text(json.dumps({"tileset": "ts", "confounder_column": "centre", "design": "pairs"}))
    with pytest.raises(ViewError, match=r"key 'design' must be 'all', 'paired_2x2' or absent"):
        Cache(root).read_view("v")


def test_reserved_row_column(root):
    with pytest.raises(ViewError, match=r"column 'row' is reserved"):
        write_view(root, "v", pd.DataFrame({"sample_id": ["s01"], "label": ["a"], "row": [0]}),
                   tileset="ts", confounder_column="centre")


def test_row_index_out_of_range(root):
    with pytest.raises(IndexError, match=r"out of range \[0, 30\)"):
        Cache(root).load_rows("enc", "ts", np.array([0, 30]))


def test_damage_after_a_passed_validation_is_caught(root):
    c = Cache(root)
    c.validate_embeddings("enc", "ts")
    c.validate_embeddings("enc", "ts")  # memoised: same files, same stats
    path = shard(root, 0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"shard-00000\.npy \(rows 0:8\) does not match its sha256"):
        c.validate_embeddings("enc", "ts")
