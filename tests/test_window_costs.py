"""The neighbour windows' cost bounds keep croma's values: MaRI's log path (tiny tau) runs in row
blocks and reuses stored scope totals; a curve with k >= n never builds a table wider than a
scope's longest cross-group list.

Values are checked against croma 1.0.1 (the oracle) or the unblocked computation, and the cost
bound itself (table width) through spies, never through a wall-clock bound.
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
# MaRI's log path (tiny tau) works in row blocks and reuses stored scope totals


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
# curves with k >= n: the table is never wider than a scope's longest cross-group list


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
