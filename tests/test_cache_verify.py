"""cachescore.cache.verify_cache: a whole-cache health check that never stops early.

Pins: a healthy cache gives no problem; a cache broken in many places at once gives one structured
problem per fault (kind, encoder, tileset, view, file, shard row range, offending tileset rows),
in a stable order, and nothing is raised; writers' hidden ``.partial`` leftovers are ignored;
``checksums``/``finite`` switch those checks off; problems serialise to JSON.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cachescore.cache import Cache, Problem, import_cache, verify_cache, write_view


def build(root, tmp_path, n=30, encoders=("e1", "e2", "e3")):
    rng = np.random.default_rng(0)
    m = pd.DataFrame({"sample_id": [f"t{i}" for i in range(n)], "image_path": [f"p{i}" for i in range(n)],
                      "group_id": [f"s{i % 5}" for i in range(n)], "label": ["a", "b"] * (n // 2),
                      "centre": ["x", "y", "y"] * (n // 3)})
    for e in encoders:
        np.save(tmp_path / f"{e}.npy", rng.standard_normal((n, 3)).astype("float32"))
    return import_cache(root, tileset="t", manifest=m, encoders={e: tmp_path / f"{e}.npy" for e in encoders},
                        shard_rows=7, views={"v_ok": {"confounder_column": "centre", "design": "all"}}), m


def test_healthy_cache_has_no_problem(tmp_path):
    cache, _ = build(tmp_path / "c", tmp_path)
    assert verify_cache(tmp_path / "c") == []
    (cache.root / "embeddings" / "e1" / ".t.123-abc.partial").mkdir()  # a live writer's staging folder
    (cache.root / "views" / ".v_new.parquet.1-x.partial").write_bytes(b"partial")
    assert verify_cache(cache) == []
    problems = verify_cache(tmp_path / "missing")
    assert [p.kind for p in problems] == ["cache_missing"] and "cache folder not found" in problems[0].message


def test_every_fault_is_reported_with_its_place(tmp_path):
    cache, m = build(tmp_path / "c", tmp_path, encoders=("e1", "e2", "e3", "e5"))
    root = cache.root
    emb = root / "embeddings"
    # e1: shard 1 missing; shard 3 (rows 21:28) rewritten with NaN/inf at local rows 1 and 4 (same shape)
    (emb / "e1" / "t" / "shard-00001.npy").unlink()
    x = np.load(emb / "e1" / "t" / "shard-00003.npy")
    x[1, 0], x[4, 2] = np.nan, np.inf
    np.save(emb / "e1" / "t" / "shard-00003.npy", x)
    # e2: shard 0 truncated
    data = (emb / "e2" / "t" / "shard-00000.npy").read_bytes()
    (emb / "e2" / "t" / "shard-00000.npy").write_bytes(data[: len(data) - 10])
    # e3: meta.json is not JSON
    (emb / "e3" / "t" / "meta.json").write_text("{not json")
    # e4: an import that never finished
    (emb / "e4" / "t").mkdir(parents=True)
    # e5: a copy of its folder under a tileset that does not exist, and a shard with a flipped byte
    shutil.copytree(emb / "e5" / "t", emb / "e5" / "gone")
    raw = bytearray((emb / "e5" / "t" / "shard-00004.npy").read_bytes())
    raw[-1] ^= 0x01
    (emb / "e5" / "t" / "shard-00004.npy").write_bytes(bytes(raw))
    # a tileset with duplicate sample_ids
    (root / "tilesets" / "dup").mkdir()
    pq.write_table(pa.table({"sample_id": ["a", "b", "a"], "image_path": ["p", "p", "p"]}), root / "tilesets" / "dup" / "tiles.parquet")
    # views: one table without sidecar, one sidecar naming a missing tileset
    shutil.copy(root / "views" / "v_ok.parquet", root / "views" / "v_orphan.parquet")
    write_view(root, "v_bad", m, tileset="t", confounder_column="centre")
    side = json.loads((root / "views" / "v_bad.json").read_text())
    (root / "views" / "v_bad.json").write_text(json.dumps(dict(side, tileset="nope")))

    problems = verify_cache(Cache(root))
    got = [(p.kind, p.encoder, p.tileset, p.view) for p in problems]
    assert got == [
        ("tileset", None, "dup", None),
        ("shard_missing", "e1", "t", None),
        ("checksum", "e1", "t", None),
        ("non_finite", "e1", "t", None),
        ("shard_corrupt", "e2", "t", None),
        ("meta", "e3", "t", None),
        ("incomplete", "e4", "t", None),
        ("alignment", "e5", "gone", None),
        ("checksum", "e5", "t", None),
        ("view", None, "nope", "v_bad"),
        ("view_incomplete", None, None, "v_orphan"),
    ]
    by = {(p.kind, p.encoder): p for p in problems}
    assert "duplicates at rows [0, 2]" in by[("tileset", None)].message
    missing = by[("shard_missing", "e1")]
    assert missing.file.endswith("e1/t/shard-00001.npy") and missing.row_range == (7, 14)
    nf = by[("non_finite", "e1")]
    assert nf.rows == (22, 25) and nf.n_rows == 2 and nf.row_range == (21, 28)
    assert "encoder 'e1', tileset 't': shard" in nf.message and "at 2 tileset rows [22, 25]" in nf.message
    assert by[("checksum", "e1")].row_range == (21, 28)
    assert "corrupt or truncated" in by[("shard_corrupt", "e2")].message
    assert "is not valid JSON" in by[("meta", "e3")].message
    assert "has no meta.json" in by[("incomplete", "e4")].message
    assert "tileset 'gone' does not exist" in by[("alignment", "e5")].message
    assert by[("checksum", "e5")].row_range == (28, 30) and by[("checksum", "e5")].file.endswith("shard-00004.npy")
    assert "tileset 'nope' not found" in by[("view", None)].message
    assert "v_orphan.json does not" in by[("view_incomplete", None)].message
    # switches and serialisation
    kinds = [p.kind for p in verify_cache(root, checksums=False, finite=False)]
    assert "checksum" not in kinds and "non_finite" not in kinds and "shard_missing" in kinds
    json.dumps([p.to_dict() for p in problems])
    assert str(nf).startswith("[non_finite] encoder 'e1'")


def test_row_order_and_count_changes_are_alignment_problems(tmp_path):
    cache, m = build(tmp_path / "c", tmp_path, encoders=("e1", "e2"))
    path = cache.root / "tilesets" / "t" / "tiles.parquet"
    table = pq.read_table(path)
    pq.write_table(table.take(np.arange(table.num_rows)[::-1]), path)  # same rows, reversed order
    problems = verify_cache(cache.root, checksums=False)
    assert [(p.kind, p.encoder) for p in problems] == [("alignment", "e1"), ("alignment", "e2")]
    assert all("sample_id order" in p.message for p in problems)
    pq.write_table(table.slice(0, 29), path)  # one row fewer: the view also loses a sample_id
    problems = verify_cache(cache.root, checksums=False)
    assert [(p.kind, p.encoder, p.view) for p in problems] == [("alignment", "e1", None), ("alignment", "e2", None),
                                                              ("view", None, "v_ok")]
    assert "embeddings have 30 rows but" in problems[0].message and "has 29" in problems[0].message


def test_a_view_table_changed_outside_write_view_is_a_view_checksum_problem(tmp_path):
    """The sidecar records the table's sha256 and size; a table rewritten behind its back (still a
    valid Parquet file with the same columns) is reported as such, not as a generic view problem."""
    cache, m = build(tmp_path / "c", tmp_path)
    path = cache.root / "views" / "v_ok.parquet"
    table = pq.read_table(path)
    pq.write_table(table.take(np.arange(table.num_rows)[::-1]), path)
    problems = verify_cache(cache.root, checksums=False)
    assert [(p.kind, p.view, p.file) for p in problems] == [("view_checksum", "v_ok", str(path))]
    assert "does not match the sha256/size recorded in its sidecar" in problems[0].message
    assert problems[0].message.count("view 'v_ok'") == 1


def test_problem_kind_is_checked():
    with pytest.raises(ValueError, match="unknown problem kind 'oops'"):
        Problem(kind="oops", message="x")
    with pytest.raises(TypeError):
        Problem("checksum", "positional")  # keyword-only
