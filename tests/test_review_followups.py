"""Review follow-ups (task B): MaRI's blocked log path, curve table width, planning fingerprints
computed once, atomic view replacement, and the vectorised leakage-audit messages.

Each test pins what its fix guarantees: values against croma 1.0.1 (the oracle) or against the
unblocked computation, and the cost bound itself (table width, number of file hashes, number of
per-id formatting calls) through spies, never through a wall-clock bound.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import croma
from cachescore.metrics import windows
from cachescore.metrics.mari import MaRI
from cachescore.metrics.ri import RI
from cachescore.neighbors.exact import cross_group_knn
from cachescore.neighbors.normalize import normalize_rows

from conftest import make_toy_manifest
from test_ri_mari_parity import _min_boundary_gap, _paired_case, _scopes

CONF = "scanner_vendor"


# ----------------------------------------------------------------------------------------------
# 1. MaRI's log path (tiny tau) works in row blocks and reuses stored scope totals


def _tiny_tau_case(seed):
    """A tie-free paired dataset and a tau so small that every typed weight underflows to 0.

    With ``tau = min typed distance / 800`` every weight ``exp(-d / tau) <= exp(-800) = 0`` in
    float64, so every unit's evidence and every scope's pooled evidence go through the log path.
    """
    for attempt in range(25):
        rng = np.random.default_rng([seed, attempt])
        x, df = _paired_case(rng, np.float64)
        ks = [1, 3, 7]
        if _min_boundary_gap(x, df, "paired_2x2", ks) > 1e-12:
            break
    else:  # pragma: no cover - bounded search
        pytest.fail("no tie-free dataset")
    dmin = np.inf
    for rows in _scopes(df, "paired_2x2"):
        u = normalize_rows(x[rows]).astype(np.float64)
        d = np.clip(1.0 - u @ u.T, 0.0, 2.0)
        g = df["group_id"].to_numpy()[rows]
        d[g[:, None] == g[None, :]] = np.inf
        dmin = min(dmin, float(d.min()))
    assert dmin > 0.0
    return x, df, ks, dmin / 800.0


@pytest.mark.parametrize("seed", range(4))
def test_tiny_tau_log_path_blocked_matches_croma_and_unblocked(seed, monkeypatch):
    x, df, ks, tau = _tiny_tau_case(seed)
    kw = dict(confounder_column=CONF, tau=tau, evaluation_design="paired_2x2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # support warnings are not the subject here
        ref_curve = croma.MaRI.compute_curve(x, df, k_values=ks, **kw)
        ref = croma.MaRI.compute(x, df, k_candidates=ks, warn_tau=False, **kw)
        whole_curve = MaRI.compute_curve(x, df, k_values=ks, **kw)
        whole = MaRI.compute(x, df, k_candidates=ks, warn_tau=False, **kw)
        # blocks of 3 rows: many blocks per scope, totals folded block by block
        monkeypatch.setattr(windows, "BLOCK_ENTRIES", 3 * max(ks))
        blocked_curve = MaRI.compute_curve(x, df, k_values=ks, **kw)
        blocked = MaRI.compute(x, df, k_candidates=ks, warn_tau=False, **kw)
    assert blocked_curve == whole_curve  # bit-identical: same left-to-right logaddexp sequence
    assert blocked.value == whole.value
    np.testing.assert_array_equal(blocked.sample_values_aligned, whole.sample_values_aligned)
    np.testing.assert_array_equal(blocked.pair_values, whole.pair_values)
    for k in ks:
        assert whole_curve[k] == pytest.approx(ref_curve[k], rel=1e-15, abs=0)
    assert whole.k == ref.k and whole.value == pytest.approx(ref.value, rel=1e-15, abs=0)
    np.testing.assert_allclose(whole.sample_values_aligned, ref.sample_values_aligned, rtol=1e-15, equal_nan=True)
    np.testing.assert_allclose(whole.pair_values, ref.pair_values, rtol=1e-15)


def test_scope_log_totals_blocked_equals_single_reduction(monkeypatch):
    x, df, ks, tau = _tiny_tau_case(7)
    rows = _scopes(df, "paired_2x2")[0]
    frame = df.iloc[rows].reset_index(drop=True)
    frame["subset"] = "only"
    from cachescore.metrics.ri import _Evaluation

    ev = _Evaluation.open(cross_group_knn, x[rows], frame, confounder_column=CONF, evaluation_design="all")
    ev.build_scopes(validate_subsets=True)
    ev.width = max(ks)
    table = ev.table(ev.scopes[0])
    valid = windows.valid_counts(table, max(ks))
    for k in ks:
        l_so, l_os = windows._unit_log_evidence(table, valid, k, tau, np.arange(table.n))
        expect = (np.logaddexp.reduce(l_so), np.logaddexp.reduce(l_os))  # one sequential reduction
        for block_rows in (1, 2, 5, table.n):
            monkeypatch.setattr(windows, "BLOCK_ENTRIES", block_rows * table.width)
            got = windows.scope_log_totals(table, valid, k, tau)
            assert got[0] == expect[0] and got[1] == expect[1], block_rows
            assert got[0].dtype == np.longdouble


def test_pooled_reuses_stored_scope_log_totals(monkeypatch):
    """Paired pooling below tiny must not recompute the totals score_scope already stored."""
    x, df, ks, tau = _tiny_tau_case(3)
    kw = dict(confounder_column=CONF, tau=tau, evaluation_design="paired_2x2")
    expect = MaRI.compute_curve(x, df, k_values=ks, **kw)
    import cachescore.metrics.ri as ri_mod

    calls = []
    real = ri_mod.scope_log_totals

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ri_mod, "scope_log_totals", spy)
    assert MaRI.compute_curve(x, df, k_values=ks, **kw) == expect
    assert calls == []


# ----------------------------------------------------------------------------------------------
# 2. curves with k >= n: the table is never wider than a scope's longest cross-group list


def _width_spy():
    widths = []

    def search(u, groups, kmax):
        widths.append(int(kmax))
        return cross_group_knn(u, groups, kmax)

    return search, widths


def _groups_case(seed, n):
    """Tie-free ``all`` data with groups of 3–12 rows (so n - smallest group < n - 1)."""
    for attempt in range(25):
        rng = np.random.default_rng([seed, 11, attempt])
        labels = rng.integers(0, 2, n)
        confs = rng.integers(0, 3, n)
        sizes = rng.integers(3, 13, n)
        groups = np.repeat(np.arange(n), sizes)[:n]
        x = rng.standard_normal((2, 12))[labels] + 0.7 * rng.standard_normal((3, 12))[confs] + rng.standard_normal((n, 12))
        df = make_toy_manifest([f"L{v}" for v in labels], [f"V{v}" for v in confs], [f"g{v}" for v in groups])
        if _min_boundary_gap(x, df, "all", [1, 5, n - 1]) > 1e-12:
            return x, df, groups
    pytest.fail("no tie-free dataset")  # pragma: no cover


@pytest.mark.parametrize("seed", range(2))
def test_curve_huge_k_table_width_bounded_and_matches_croma(seed):
    """k far beyond n: croma's own cost grows with k (its curve at k = 10**5 on 240 rows takes
    seconds), so croma is asked at k = 20 n (already > every window) and our k = 10**6 curve must
    equal our k = 20 n curve exactly, with a table no wider than the longest cross-group list."""
    x, df, groups = _groups_case(seed, n=120)
    n = len(df)
    longest = n - int(np.bincount(groups).min())  # the longest cross-group list of the scope
    big = 20 * n
    ks = [5, big, n - 1, 40]
    huge = [5, 10**6, n - 1, 40]
    search, widths = _width_spy()
    ri = RI.compute_curve_with(search, x, df, confounder_column=CONF, k_values=ks)
    ri_huge = RI.compute_curve_with(search, x, df, confounder_column=CONF, k_values=huge)
    assert widths == [longest, longest]
    assert ri == croma.RI.compute_curve(x, df, confounder_column=CONF, k_values=ks)  # RI: exact
    assert list(ri_huge.values()) == list(ri.values())
    for tau in (0.3, None):
        search, widths = _width_spy()
        m = MaRI.compute_curve_with(search, x, df, confounder_column=CONF, k_values=ks, tau=tau)
        m_huge = MaRI.compute_curve_with(search, x, df, confounder_column=CONF, k_values=huge, tau=tau)
        assert widths == [longest, longest]
        m_ref = croma.MaRI.compute_curve(x, df, confounder_column=CONF, k_values=ks, tau=tau)
        assert list(m) == list(m_ref)
        for k in ks:
            assert m[k] == pytest.approx(m_ref[k], rel=1e-12, abs=0)
        assert list(m_huge.values()) == list(m.values())


def test_table_width_singleton_groups_is_n_minus_1():
    rng = np.random.default_rng(5)
    n = 50
    labels, confs = rng.integers(0, 2, n), rng.integers(0, 2, n)
    x = rng.standard_normal((n, 8))
    df = make_toy_manifest([f"L{v}" for v in labels], [f"V{v}" for v in confs])
    search, widths = _width_spy()
    huge = RI.compute_curve_with(search, x, df, confounder_column=CONF, k_values=[3, 10**9])
    assert widths == [n - 1]  # one row per group: the longest cross-group list is n - 1
    # croma allocates (n, k) at k = 10**9, so it is asked at k = 20 n (> every window)
    ref = croma.RI.compute_curve(x, df, confounder_column=CONF, k_values=[3, 20 * n])
    assert list(huge.values()) == list(ref.values())


# ----------------------------------------------------------------------------------------------
# 3. planning hashes each view / tileset file once, whatever the number of encoders


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
# 4. write_view(overwrite=True): a reader never uses a (new table, old sidecar) pair


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
    for call in ("read_view", "view_fingerprint"):
        t.write_bytes(new_t)
        s.write_bytes(old_s)  # the in-flight state
        pauses = []

        def finish_rename(seconds):  # the writer's second rename lands during the reader's pause
            pauses.append(seconds)
            s.write_bytes(new_s)

        monkeypatch.setattr(reader_mod.time, "sleep", finish_rename)
        got = getattr(cache, call)("v")
        monkeypatch.undo()
        assert len(pauses) == 1
        if call == "read_view":
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


# ----------------------------------------------------------------------------------------------
# 5. leakage audit: no per-id Python formatting


def test_audit_composite_key_formats_only_reported_ids(monkeypatch):
    """1M rows, composite tile key (slide, tile), no leakage: ids are formatted only when shown.

    Before the fix every one of the 1M unique composite ids was formatted in a Python loop
    (2M ``_id`` (then ``_py``) calls, ~3.5 s); now the count does not grow with the number of rows.
    """
    from types import SimpleNamespace

    from cachescore.probe import audit

    n = 1_000_000
    slide_of = np.arange(n) // 100
    slides = np.array([f"slide{v}" for v in range(n // 100)], dtype=object)[slide_of]
    tile = np.arange(n) % 100
    patient = slides  # one patient per slide is enough here
    order = np.random.default_rng(0).permutation(n // 100)
    train_slides, val_slides, test_slides = order[: n // 200], order[n // 200 : 3 * n // 400], order[3 * n // 400 :]
    rows = {name: np.flatnonzero(np.isin(slide_of, sel)) for name, sel in
            (("train", train_slides), ("val", val_slides), ("test", test_slides))}
    outcome = SimpleNamespace(replicate=0, split=0, seed=1, train_rows=rows["train"], val_rows=rows["val"],
                              test_rows=rows["test"])
    calls = []
    real = audit._id

    def counting(v):
        calls.append(1)
        return real(v)

    monkeypatch.setattr(audit, "_id", counting)
    report = audit.audit_sweep([outcome], n_rows=n, groups={"slide": slides, "patient": patient},
                               tile_ids=(slides, tile), require_class_coverage=False)
    assert report["passed"] is True
    assert len(calls) < 1000, len(calls)


def test_lazy_uniques_equal_eager_formatting():
    """The lazily formatted ids equal the eagerly built JSON-safe lists, code by code."""
    from cachescore.probe import audit

    rng = np.random.default_rng(1)
    for _ in range(20):
        n = int(rng.integers(1, 300))
        pool = [rng.integers(0, 20, n), np.array([f"s{v}" for v in rng.integers(0, 7, n)], dtype=object),
                rng.integers(0, 3, n).astype(np.int32)]
        parts = [pool[i] for i in rng.choice(3, size=int(rng.integers(1, 4)))]
        codes, uniques = audit._factorize_key(parts)
        facts = [pd_factorize(p) for p in parts]
        rows_key = np.stack([f[0] for f in facts], axis=1)
        if len(parts) == 1:
            expect_uniques = [audit._id(u) for u in facts[0][1]]
            expect_codes = facts[0][0]
        else:  # lexicographic order of the per-part first-appearance codes
            uniq_rows, expect_codes = np.unique(rows_key, axis=0, return_inverse=True)
            expect_uniques = [[audit._id(facts[j][1][r[j]]) for j in range(len(parts))] for r in uniq_rows]
        np.testing.assert_array_equal(codes, np.asarray(expect_codes).reshape(-1))
        assert len(uniques) == len(expect_uniques)
        assert [uniques[i] for i in range(len(uniques))] == expect_uniques
        assert uniques[np.int64(0)] == expect_uniques[0] and uniques[-1] == expect_uniques[-1]


def pd_factorize(p):
    import pandas as pd

    c, u = pd.factorize(pd.Series(p), sort=False)
    return c.astype(np.int64), list(u)
