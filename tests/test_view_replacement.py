"""Replacing a view (``write_view(overwrite=True)``): a reader never uses a (new table, old
sidecar) pair; the sidecar records the table's digest, a mixed pair is refused or retried until the
replacement completes, and a sidecar without a digest still reads."""

from __future__ import annotations

import pytest


# ----------------------------------------------------------------------------------------------
# write_view(overwrite=True): a reader never uses a (new table, old sidecar) pair


def _view_cache(root):
    import pandas as pd

    from cachescore.cache import write_tileset, write_view

    ids = [f"t{i}" for i in range(6)]
    write_tileset(root, "ts", pd.DataFrame({"sample_id": ids, "image_path": [f"{i}.png" for i in ids],
                                            "group_id": ["g0", "g0", "g1", "g1", "g2", "g2"],
                                            "centre": list("ABABAB")}))
    old = pd.DataFrame({"sample_id": ids[:4], "label": ["a", "b", "a", "b"]})
    write_view(root, "v", old, tileset="ts", confounder_column="centre", design="all")
    return old


def _mixed_state(root):
    """Replace the view and return the bytes of (old table, old sidecar, new table, new sidecar)."""
    import pandas as pd

    from cachescore.cache import write_view

    t, s = root / "views" / "v.parquet", root / "views" / "v.json"
    old = (t.read_bytes(), s.read_bytes())
    new_frame = pd.DataFrame({"sample_id": ["t5", "t4", "t0"], "label": ["x", "y", "x"], "centre": ["Q", "R", "Q"]})
    write_view(root, "v", new_frame, tileset="ts", confounder_column="centre", design="paired_2x2", overwrite=True)
    return old + (t.read_bytes(), s.read_bytes())


def test_sidecar_records_table_digest(tmp_path):
    import hashlib
    import json

    _view_cache(tmp_path)
    side = json.loads((tmp_path / "views" / "v.json").read_text())
    data = (tmp_path / "views" / "v.parquet").read_bytes()
    assert side["table_sha256"] == hashlib.sha256(data).hexdigest() and side["table_bytes"] == len(data)


def test_mixed_view_pair_is_refused(tmp_path, monkeypatch):
    import cachescore.cache.reader as reader_mod
    from cachescore.cache import Cache, ViewError

    monkeypatch.setattr(reader_mod, "VIEW_RETRY_PAUSE", 0.0)
    _view_cache(tmp_path)
    old_t, old_s, new_t, new_s = _mixed_state(tmp_path)
    t, s = tmp_path / "views" / "v.parquet", tmp_path / "views" / "v.json"
    cache = Cache(tmp_path)
    new_frame, new_fp = cache.read_view("v"), cache.view_fingerprint("v")
    for table, sidecar in ((new_t, old_s), (old_t, new_s)):  # both mixed orders
        t.write_bytes(table)
        s.write_bytes(sidecar)
        with pytest.raises(ViewError, match=r"v\.parquet does not match the sha256/size recorded in its sidecar"):
            cache.read_view("v")
        with pytest.raises(ViewError, match=r"does not match the sha256/size recorded in its sidecar"):
            cache.view_fingerprint("v")
        for read in (lambda: cache.view_rows("v"), lambda: cache.view_columns("v", ["label"]),
                     lambda: cache.view_combinations("v", ["label"])):  # the readers that stream the table
            with pytest.raises(ViewError, match=r"does not match the sha256/size recorded in its sidecar"):
                read()
    t.write_bytes(old_t)
    s.write_bytes(old_s)
    old_frame = cache.read_view("v")
    assert len(old_frame) == 4 and old_frame.attrs["design"] == "all"
    assert len(new_frame) == 3 and new_frame.attrs["design"] == "paired_2x2"
    assert list(new_frame["centre"]) == ["Q", "R", "Q"] and cache.view_fingerprint("v") != new_fp


def test_reader_retries_until_the_replacement_completes(tmp_path, monkeypatch):
    """Between the writer's two renames the reader sees (new table, old sidecar): it re-reads and
    returns the complete new pair, never the mixed one."""
    import cachescore.cache.reader as reader_mod
    from cachescore.cache import Cache

    _view_cache(tmp_path)
    old_t, old_s, new_t, new_s = _mixed_state(tmp_path)
    t, s = tmp_path / "views" / "v.parquet", tmp_path / "views" / "v.json"
    cache = Cache(tmp_path)
    expect = cache.read_view("v")
    expect_fp = cache.view_fingerprint("v")
    expect_rows, expect_labels = cache.view_rows("v"), cache.view_combinations("v", ["label"])[0]
    for call in ("read_view", "view_fingerprint", "view_rows", "view_combinations"):
        t.write_bytes(new_t)
        s.write_bytes(old_s)  # the in-flight state
        pauses = []

        def finish_rename(seconds):  # the writer's second rename lands during the reader's pause
            pauses.append(seconds)
            s.write_bytes(new_s)

        monkeypatch.setattr(reader_mod.time, "sleep", finish_rename)
        got = cache.view_combinations("v", ["label"])[0] if call == "view_combinations" else getattr(cache, call)("v")
        monkeypatch.undo()
        assert len(pauses) == 1
        if call == "view_rows":
            assert got == expect_rows == 3
        elif call == "view_combinations":
            assert got == expect_labels == [["x", "y"]]
        elif call == "read_view":
            import pandas.testing as pdt

            pdt.assert_frame_equal(got, expect)
            assert got.attrs == expect.attrs
        else:
            assert got == expect_fp


def test_sidecar_without_digest_still_reads(tmp_path):
    """Sidecars written before the digest was recorded are read as before (no check possible)."""
    import json

    from cachescore.cache import Cache

    _view_cache(tmp_path)
    s = tmp_path / "views" / "v.json"
    side = json.loads(s.read_text())
    fp = Cache(tmp_path).view_fingerprint("v")
    s.write_text(json.dumps({k: v for k, v in side.items() if not k.startswith("table_")}))
    assert len(Cache(tmp_path).read_view("v")) == 4
    assert Cache(tmp_path).view_fingerprint("v") == fp  # the digest is not part of the fingerprint
    s.write_text(json.dumps(dict(side, table_sha256="xyz")))
    from cachescore.cache import ViewError

    with pytest.raises(ViewError, match=r"key 'table_sha256' must be 64 lowercase hex digits"):
        Cache(tmp_path).view_spec("v")
