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
