"""Planning hashes each view and tileset file once, whatever the number of encoders, and a probe
unit's fingerprint from the planned inputs equals the one computed from the cache (counted by
spies on the hashing, not timed)."""

from __future__ import annotations


# ----------------------------------------------------------------------------------------------
# planning hashes each view / tileset file once, whatever the number of encoders


def _demo_job(tmp_path):
    import tomllib
    from pathlib import Path

    from cachescore.cache import make_demo_cache
    from cachescore.jobs import parse_job

    make_demo_cache(tmp_path / "cache")
    doc = tomllib.loads((Path(__file__).resolve().parents[1] / "jobs" / "demo.toml").read_text())
    doc["job"]["cache"] = str(tmp_path / "cache")
    doc["job"]["store"] = str(tmp_path / "store")
    doc.pop("demo", None)
    return parse_job(doc)


def test_plan_hashes_each_view_and_tileset_once(tmp_path, monkeypatch):
    from collections import Counter

    import cachescore.cache.reader as reader_mod
    from cachescore.cache import Cache
    from cachescore.pipeline import plan_job
    from cachescore.pipeline.probe_unit import probe_unit_fingerprint

    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "pinned-for-test")
    job = _demo_job(tmp_path)
    hashed = Counter()
    real = reader_mod.sha256_file

    def counting(path):
        hashed[str(path)] += 1
        return real(path)

    monkeypatch.setattr(reader_mod, "sha256_file", counting)
    plan = plan_job(job)
    cache = Cache(job.cache)
    probe_units = [u for u in plan.units if u.metric == "probe"]
    assert len(probe_units) == len(cache.encoders()) == 4  # the demo: 4 encoders x 1 probe view
    views = set(job.views) | set(job.probe_views)
    tilesets = {cache.view_spec(v).tileset for v in views}
    assert len(hashed) == len(views) + len(tilesets)
    assert set(hashed.values()) == {1}, hashed  # each file once per plan (was 20 reads for 3 files)
    # fingerprints unchanged: the probe units' equal the ones computed from scratch per unit, and
    # the metric units' inputs equal the cache's own fingerprints
    monkeypatch.setattr(reader_mod, "sha256_file", real)
    for u in probe_units:
        assert u.fingerprint == probe_unit_fingerprint(cache, u.encoder, u.view, job.probe, code_version="pinned-for-test")
        assert u.inputs == {"embeddings": cache.embedding_fingerprint(u.encoder, u.tileset),
                            "view": cache.view_fingerprint(u.view)}
    for v in job.views:
        assert plan.inputs[f"views/{v}"] == cache.view_fingerprint(v)
    assert plan_job(job).units == plan.units


def test_probe_unit_fingerprint_with_given_inputs_equals_computed(tmp_path):
    from cachescore.cache import Cache
    from cachescore.pipeline.probe_unit import probe_unit_fingerprint

    job = _demo_job(tmp_path)
    cache = Cache(job.cache)
    view = job.probe_views[0]
    enc = cache.encoders()[0]
    inputs = {"embeddings": cache.embedding_fingerprint(enc, cache.view_spec(view).tileset),
              "view": cache.view_fingerprint(view)}
    a = probe_unit_fingerprint(cache, enc, view, job.probe, code_version="x")
    assert probe_unit_fingerprint(cache, enc, view, job.probe, code_version="x", inputs=inputs) == a
    assert probe_unit_fingerprint(cache, enc, view, job.probe, code_version="x",
                                  inputs=dict(inputs, view="0" * 64)) != a


# ----------------------------------------------------------------------------------------------
# planning reads a view's code columns, not the joined frame (issue 26: a lean driver)


def _messy_views(root):
    """A tileset and views whose labels / centres differ only by spaces, one paired view with an
    undefined subset (a single centre) and one view too small for CRoMa m = 5."""
    import numpy as np
    import pandas as pd

    from cachescore.cache import write_embeddings, write_view
    from cachescore.cache.writer import write_tileset

    rng = np.random.default_rng(0)
    n = 600
    g = np.arange(n) // 12
    tiles = pd.DataFrame({"sample_id": [f"t{i}" for i in range(n)], "image_path": [f"t{i}.png" for i in range(n)],
                          "group_id": [f"s{k}" for k in g],
                          "label": np.where(rng.random(n) < 0.5, "L0", " L0 ")[: n],
                          "centre": [f"C{k % 3}" + (" " if k % 2 else "") for k in g]})
    tiles.loc[tiles.index % 5 == 0, "label"] = "L1"
    write_tileset(root, "ts", tiles)
    write_embeddings(root, "enc", "ts", rng.standard_normal((n, 8)).astype(np.float32))
    view = tiles[["sample_id", "label", "group_id", "centre"]]
    write_view(root, "all", view, tileset="ts", confounder_column="centre", design="all")
    parts = []
    for name, keep in (("a+b", ["C0", "C1", "C1 "]), ("c_only", ["C2", "C2 "])):
        p = view[view["centre"].isin(keep)].copy()
        p["subset"] = name
        parts.append(p)
    write_view(root, "paired", pd.concat(parts, ignore_index=True), tileset="ts", confounder_column="centre",
               design="paired_2x2")
    write_view(root, "tiny", view.iloc[:40], tileset="ts", confounder_column="centre", design="all")


def test_planning_reads_code_columns_and_finds_what_the_frame_finds(tmp_path, monkeypatch):
    from cachescore.cache import Cache
    from cachescore.jobs import parse_job
    from cachescore.pipeline import plan as plan_mod

    monkeypatch.setenv("CACHESCORE_CODE_VERSION", "pinned-for-test")
    _messy_views(tmp_path / "cache")
    doc = {"schema_version": 1,
           "job": {"cache": str(tmp_path / "cache"), "store": str(tmp_path / "store"),
                   "views": ["all", "paired", "tiny"]},
           "metrics": {"families": ["ri", "mari", "croma"], "ri": {"k_candidates": [5, 50]},
                       "croma": {"m": [5, 9]}},
           "neighbors": {"large_scope_rows": 40}}  # every view is planned as a large one
    job = parse_job(doc)

    def facts(lean: bool):
        planner = plan_mod._Planner(job, Cache(tmp_path / "cache"), None)
        return {v: planner.view_facts(v) for v in ("all", "paired", "tiny")}

    def no_frame(self, view):
        raise AssertionError(f"planning built the frame of view {view!r}")

    with monkeypatch.context() as m:
        m.setattr(Cache, "read_view", no_frame)
        lean = facts(True)
    with monkeypatch.context() as m:
        m.setattr(plan_mod, "_lean_scopes", lambda *a: None)  # the frame path, as before
        full = facts(False)
    assert lean == full
    assert lean["paired"].scope_error and "c_only" in lean["paired"].scope_error
    assert any(t and "tiny" in t for t in lean["tiny"].too_small)  # CRoMa m = 9 on 40 rows
    assert lean["all"].scope_error is None and lean["all"].scope_rows == 600
