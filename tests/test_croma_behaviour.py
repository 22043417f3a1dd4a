"""CRoMa behaviour: reference fixtures, error catalogue, edge cases, backend contract, invariances.

Pins (spec/metrics.md §7, §1.8, Appendix A, §11 tests 1–30, 53–54, 118–121):
* Appendix A fixtures give croma 1.0.1's published outputs, and equal a live croma run;
* every CRoMa error-catalogue case raises croma's exception class with its message fragments, in
  catalogue order (each ordering case is checked against a live croma run);
* the empty manifest returns croma's NaN result (with numpy's empty-slice warning), one row raises;
* ``typed_knn`` equals an independent brute-force typed search; results do not depend on block
  sizes, on numpy vs dask input, or on the search schedule; ``compute_with`` honours an injected
  backend and calls it once per scope with ``max(m)``;
* ``compute_with(schedule_diagnostics=False)`` never runs the counting pass, reports
  ``k_start = k_final = retries = -1`` and leaves every other field unchanged;
* ``similarity_floor`` makes the similarity comparison of ``count_within`` bit-equivalent to the
  distance comparison.
"""

from __future__ import annotations

import inspect
import math
import warnings
from functools import partial

import dask.array as da
import numpy as np
import pandas as pd
import pytest

import croma

from cachescore.metrics.croma import CROMA_HEADLINE_M, CRoMa, CrossConfounderRobustnessMargin, croma_schedule
from cachescore.neighbors.normalize import cosine_distance_block, normalize_rows
from cachescore.neighbors.typed import count_within, typed_knn
from cachescore.types import CRoMaResult

CYCLED = [("A", "V1"), ("A", "V2"), ("B", "V1"), ("B", "V2")]


# --------------------------------------------------------------------------- fixtures (Appendix A)


def toy_manifest(cells, *, groups=None, subset=None):
    n = len(cells)
    df = pd.DataFrame(
        {
            "sample_id": [f"s{i}" for i in range(n)],
            "image_path": [f"/tmp/toy/{i}.png" for i in range(n)],
            "label": [c[0] for c in cells],
            "scanner_vendor": [c[1] for c in cells],
            "group_id": groups if groups is not None else [f"slide-{i}" for i in range(n)],
            "dataset": "toy",
        }
    )
    if subset is not None:
        df["subset"] = subset
    return df


def unit_circle(angles):
    a = np.asarray(angles, dtype=float)
    return np.stack([np.cos(a), np.sin(a)], axis=1)


def a1():
    x = np.zeros((8, 4))
    x[:4, :2] = [(1, 0), (0.95, 0.05), (0.92, 0.08), (0.90, 0.10)]
    x[4:, :2] = [(0, 1), (0.05, 0.95), (0.08, 0.92), (0.10, 0.90)]
    cells = [(lab, v) for lab in "AB" for v in ("V1", "V1", "V2", "V2")]
    return x, toy_manifest(cells)


def dominant(kind):
    rows, cells = [], []
    for a in (0, 1):
        for i in range(12):
            rows.append(np.eye(3)[a] + 0.01 * i * np.eye(3)[2])
            other = "V1" if i % 2 == 0 else "V2"
            if kind == "biology":
                cells.append(("AB"[a], other))
            else:
                cells.append(("A" if i % 2 == 0 else "B", ("V1", "V2")[a]))
    return np.asarray(rows), toy_manifest(cells)


def contested():
    corners = {("A", "V1"): (1, 0), ("A", "V2"): (0, 1), ("B", "V1"): (0, -1), ("B", "V2"): (-1, 0)}
    rows, cells = [], []
    for b in range(6):
        for cell in CYCLED:
            v = np.zeros(8)
            v[b] = 1.0
            v[6:] = 0.1 * np.asarray(corners[cell])
            rows.append(v)
            cells.append(cell)
    return np.asarray(rows), toy_manifest(cells)


def ring():
    return unit_circle(2 * np.pi * np.arange(32) / 32), toy_manifest([CYCLED[i % 4] for i in range(32)])


def two_cluster_ring(so_distance, os_distance, copies=2):
    a_so, a_os = math.acos(1 - so_distance), math.acos(1 - os_distance)
    angles = {("A", "V1"): 0.0, ("A", "V2"): a_so, ("B", "V1"): a_os, ("B", "V2"): a_os + a_so}
    cells = [cell for cell in CYCLED for _ in range(copies)]
    return unit_circle([angles[c] for c in cells]), toy_manifest(cells)


def slide_trap(trap: bool):
    deg = np.pi / 180
    angles = [0, math.acos(0.99), 60 * deg, math.acos(0.80), 120 * deg, 150 * deg, 200 * deg, 250 * deg]
    cells = [("A", "V1"), ("A", "V2"), ("A", "V2"), ("B", "V1"), ("B", "V2"), ("A", "V1"), ("B", "V1"), ("B", "V2")]
    groups = [f"slide-{i}" for i in range(8)]
    if trap:
        groups[1] = groups[0]
    return unit_circle(angles), toy_manifest(cells, groups=groups)


def group_contract(same_group: bool, *, subset=None):
    deg = np.pi / 180
    x = unit_circle(np.array([0, 5, 120, 60, 130, 180]) * deg)
    cells = [("A", "V1"), ("B", "V1"), ("B", "V1"), ("A", "V2"), ("B", "V2"), ("A", "V1")]
    groups = [f"slide-{i}" for i in range(6)]
    if same_group:
        groups[1] = groups[0]
    return x, toy_manifest(cells, groups=groups, subset=subset)


def both(x, df, **kw):
    kw.setdefault("confounder_column", "scanner_vendor")
    return CRoMa.compute(x, df, **kw), croma.CRoMa.compute(x, df, **kw)


def assert_equal_results(ours, ref, atol=1e-12, schedule=True):
    for name in ("dataset", "m", "n_pairs", "evaluation_design", "evaluation_unit", "k_start", "alpha", "f0"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a == b or (np.isnan(a) and np.isnan(b)), name
    if schedule:
        assert (ours.k_final, ours.retries) == (ref.k_final, ref.retries)
    for name in ("value", "std", "q_alpha", "ltm_alpha"):
        np.testing.assert_allclose(getattr(ours, name), getattr(ref, name), rtol=0, atol=atol, err_msg=name)
    for name in ("pair_values", "sample_values", "sample_values_aligned"):
        np.testing.assert_allclose(getattr(ours, name), getattr(ref, name), rtol=0, atol=atol, err_msg=name)
    np.testing.assert_array_equal(ours.occurrence_subsets, ref.occurrence_subsets)
    np.testing.assert_array_equal(ours.occurrence_source_indices, ref.occurrence_source_indices)


# --------------------------------------------------------------------------- Appendix A values


def test_a1_so_closer_values():
    x, df = a1()
    r1, ref1 = both(x, df, m=1)
    assert abs(r1.value - 0.9971196903875937) <= 1e-12
    assert abs(r1.q_alpha - 0.9920954383574326) <= 1e-12 and abs(r1.ltm_alpha - 0.9920954383574326) <= 1e-12
    assert r1.f0 == 0.0 and (r1.k_start, r1.k_final, r1.retries) == (7, 7, 0)
    assert_equal_results(r1, ref1)
    r2, ref2 = both(x, df, m=2)
    assert abs(r2.value - 0.9924446727698555) <= 1e-12
    assert_equal_results(r2, ref2)


@pytest.mark.parametrize(
    "kind, value, ltm, f0",
    [("biology", 0.9987062633721869, 0.9967200779245162, 0.0), ("confounder", -0.9987062633721869, -0.9991065731368185, 1.0)],
)
def test_dominance_fixtures(kind, value, ltm, f0):
    x, df = dominant(kind)
    r, ref = both(x, df, m=5, start_k=3)
    assert abs(r.value - value) <= 1e-12 and abs(r.ltm_alpha - ltm) <= 1e-12 and r.f0 == f0
    assert (r.k_start, r.k_final, r.retries) == (3, 23, 3)
    assert_equal_results(r, ref)


def test_contested_sits_exactly_on_the_boundary():
    """Exact SO/OS ties by construction: margins are tie-invariant (§7.4), so compare them; the
    schedule diagnostics are tie-order dependent in croma and are not compared."""
    x, df = contested()
    r, ref = both(x, df, m=5, start_k=3)
    assert abs(r.value) <= 1e-12 and np.abs(r.sample_values).max() <= 1e-12 and r.f0 == 1.0
    assert_equal_results(r, ref, schedule=False)
    r1 = CRoMa.compute(x, df, confounder_column="scanner_vendor", m=1, alpha=0.25)
    assert abs(r1.q_alpha) <= 1e-12 and abs(r1.ltm_alpha) <= 1e-12 and r1.f0 == 1.0


def test_type_interleaved_ring():
    x, df = ring()
    r, ref = both(x, df, m=5, start_k=3)
    assert abs(r.value - 0.025433068273717146) <= 1e-12
    assert (r.k_start, r.k_final, r.retries) == (3, 31, 4)
    assert_equal_results(r, ref)


def test_four_row_cap_example_per_unit_margins():
    deg = np.pi / 180
    x = unit_circle(np.array([0, 10, 20, 90]) * deg)
    df = toy_manifest([("A", "V1"), ("B", "V1"), ("B", "V2"), ("A", "V2")])
    r, ref = both(x, df, m=1)
    np.testing.assert_allclose(r.sample_values, [-0.97007021, 0, 0.95486371, -0.20628727], rtol=0, atol=1e-8)
    assert_equal_results(r, ref)


def test_two_cluster_ring_matches_the_formula():
    x, df = two_cluster_ring(0.2, 0.8)
    r, ref = both(x, df, m=1)
    np.testing.assert_allclose(r.sample_values, 0.6, rtol=0, atol=1e-12)
    assert abs(r.value - 0.6) <= 1e-12
    assert_equal_results(r, ref)


def test_croma_rises_monotonically_as_the_os_cluster_recedes():
    values = [CRoMa.compute(*two_cluster_ring(0.2, d), confounder_column="scanner_vendor", m=1).value for d in (0.05, 0.1, 0.2, 0.4, 0.8)]
    assert all(b > a for a, b in zip(values, values[1:]))
    assert values[0] < 0 < values[-1] and all(-1 < v < 1 for v in values)


@pytest.mark.parametrize("trap, expected", [(True, -3 / 7), (False, 19 / 21)])
def test_slide_trap_excludes_the_same_group_neighbour(trap, expected):
    x, df = slide_trap(trap)
    r, ref = both(x, df, m=1)
    assert abs(r.sample_values[0] - expected) <= 1e-12
    assert_equal_results(r, ref)


@pytest.mark.parametrize("design", ["all", "paired_2x2"])
def test_group_contract_same_group_impostor_is_excluded(design):
    subset = ["p1"] * 6
    own, ref_own = both(*group_contract(False, subset=subset), m=1, start_k=1, evaluation_design=design)
    shared, ref_shared = both(*group_contract(True, subset=subset), m=1, start_k=1, evaluation_design=design)
    assert own.sample_values[0] < 0 < shared.sample_values[0]
    assert_equal_results(own, ref_own)
    assert_equal_results(shared, ref_shared)


def test_schedule_never_changes_the_margins():
    x, df = ring()
    a = CRoMa.compute(x, df, confounder_column="scanner_vendor", m=3, start_k=1, k_growth_factor=1.25)
    b = CRoMa.compute(x, df, confounder_column="scanner_vendor", m=3, start_k=25, k_growth_factor=4.0)
    assert a.value == b.value
    np.testing.assert_array_equal(a.sample_values, b.sample_values)


def test_role_swap_negates_croma():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((120, 6))
    cells = [CYCLED[i] for i in rng.integers(0, 4, 120)]
    df = toy_manifest(cells)
    swapped = df.assign(label=df["scanner_vendor"], scanner_vendor=df["label"])
    a = CRoMa.compute(x, df, confounder_column="scanner_vendor", m=2)
    b = CRoMa.compute(x, swapped, confounder_column="scanner_vendor", m=2)
    np.testing.assert_allclose(a.sample_values, -b.sample_values, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- schedule arithmetic


@pytest.mark.parametrize(
    "args, expected",
    [
        ((8, 200, 2.0, 3), (7, 7, 0)),  # start_k clamped to n-1
        ((10, 2, 1.5, math.inf), (2, 9, 4)),  # windows 2, 3, 5, 8, 9 (never resolving)
        ((2000, 200, 2.0, 1961), (200, 1999, 4)),  # rare confounder: 200, 400, 800, 1600, 1999
        ((1000, 200, 2.0, 150), (200, 400, 1)),  # resolved in round 0, reported one growth later
        ((1000, 3, 2.0, 3), (3, 6, 1)),
        ((1, 5, 2.0, 0), (0, 0, 0)),
        ((0, 5, 2.0, 0), (0, 0, 0)),
    ],
)
def test_croma_schedule_arithmetic(args, expected):
    assert croma_schedule(*args) == expected


def test_start_k_is_clamped():
    x, df = a1()
    assert CRoMa.compute(x, df, confounder_column="scanner_vendor", m=1).k_start == 7


# --------------------------------------------------------------------------- API surface


def test_api_constants_and_signature():
    assert CRoMa is CrossConfounderRobustnessMargin
    assert CROMA_HEADLINE_M == 5
    params = inspect.signature(CRoMa.compute).parameters
    assert params["m"].default == CROMA_HEADLINE_M
    assert params["k_growth_factor"].default == 2.0
    assert params["start_k"].default == 200 and params["alpha"].default == 0.10
    assert params["evaluation_design"].default == "all"
    assert list(params) == list(inspect.signature(croma.CRoMa.compute).parameters)
    x, df = a1()
    with pytest.raises(TypeError):
        CRoMa.compute(x, df, confounder_column="scanner_vendor", kmax=3)


def test_result_rejects_a_ninth_positional_argument():
    with pytest.raises(TypeError):
        CRoMaResult("d", 1, 0.0, 0.0, 1, np.zeros(1), np.zeros(1), np.zeros(1), 0.5)


def test_list_m_keys_in_first_appearance_order_and_match_single_calls():
    x, df = a1()
    out = CRoMa.compute(x, df, confounder_column="scanner_vendor", m=[2, 1, 2])
    assert list(out) == [2, 1]
    for key, res in out.items():
        single = CRoMa.compute(x, df, confounder_column="scanner_vendor", m=key)
        assert_equal_results(res, single, atol=0)
    (only,) = CRoMa.compute(x, df, confounder_column="scanner_vendor", m=(1,)).values()
    assert only.m == 1


def test_paired_repeated_sample_counts_once_per_occurrence():
    rng = np.random.default_rng(11)
    base = rng.standard_normal((15, 5))
    cells = [CYCLED[i % 4] for i in range(15)]
    rows = list(range(15)) + [0]
    df = toy_manifest([cells[i] for i in rows], groups=[f"slide-{i}" for i in rows], subset=["p1"] * 8 + ["p2"] * 7 + ["p2"])
    df["subset"] = ["p1" if i < 8 else "p2" for i in range(15)] + ["p2"]
    r, ref = both(base[rows], df, m=1, evaluation_design="paired_2x2")
    assert r.sample_values.size == 16 and r.evaluation_unit == "occurrence"
    assert_equal_results(r, ref)


# --------------------------------------------------------------------------- error catalogue


def _raises_like_croma(exc, x, df, **kw):
    kw.setdefault("confounder_column", "scanner_vendor")
    with pytest.raises(exc) as ref, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # croma's own inf/inf normalisation warning
        croma.CRoMa.compute(x, df, **kw)
    with pytest.raises(exc) as ours:
        CRoMa.compute(x, df, **kw)
    return str(ours.value), str(ref.value)


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(evaluation_design="auto"), "evaluation_design"),
        (dict(evaluation_design="dataset_wide"), "paired_2x2"),
        (dict(m=[]), "m must include at least one integer"),
        (dict(m=0), "m must be >= 1"),
        (dict(m=[1, 0]), "m must be >= 1"),
        (dict(start_k=0), "start_k must be >= 1"),
        (dict(k_growth_factor=1.0), "k_growth_factor must be > 1"),
        # order: design before m, m before start_k, start_k before the growth factor
        (dict(evaluation_design="x", m=0), "evaluation_design"),
        (dict(m=0, start_k=0), "m must be >= 1"),
        (dict(start_k=0, k_growth_factor=0.5), "start_k must be >= 1"),
    ],
)
def test_parameter_errors_in_catalogue_order(kw, fragment):
    x, df = a1()
    ours, ref = _raises_like_croma(ValueError, x, df, **kw)
    assert fragment in ours and fragment in ref
    if kw.get("evaluation_design") == "dataset_wide":
        assert "dataset_wide" not in ours and "'all'" in ours


def test_type_and_shape_errors():
    x, df = a1()
    with pytest.raises(TypeError):
        CRoMa.compute(x, df.to_dict("list"), confounder_column="scanner_vendor")
    with pytest.raises(TypeError):
        CRoMa.compute(x.tolist(), df, confounder_column="scanner_vendor")
    with pytest.raises(ValueError, match="2-D"):
        CRoMa.compute(x[:, 0], df, confounder_column="scanner_vendor")
    # row count is checked before manifest normalisation (missing columns)
    _raises_like_croma(ValueError, x[:5], df.drop(columns="group_id"))
    with pytest.raises(ValueError, match="5 rows"):
        CRoMa.compute(x[:5], df.drop(columns="group_id"), confounder_column="scanner_vendor")


def test_manifest_normalisation_errors():
    x, df = a1()
    ours, _ = _raises_like_croma(ValueError, x, df.drop(columns="group_id").assign(slide_id="s"))
    assert "group_id" in ours and "slide_id" in ours
    bad = df.copy()
    bad.loc[2, "group_id"] = "  "
    ours, _ = _raises_like_croma(ValueError, x, bad)
    assert "group_id" in ours and "[2]" in ours
    ours, _ = _raises_like_croma(ValueError, x, df, confounder_column=" ")


def test_paired_subset_errors():
    x, df = a1()
    ours, _ = _raises_like_croma(ValueError, x, df, evaluation_design="paired_2x2")
    assert "subset" in ours
    incomplete = df.assign(subset=["p2"] * 4 + ["p10"] * 4)
    ours, _ = _raises_like_croma(ValueError, x, incomplete, evaluation_design="paired_2x2")
    assert "p10, p2" in ours


def test_unresolved_rows_at_cap_raise_with_context():
    x = unit_circle([0, 0.3, 1.5, 1.9])
    df = toy_manifest(CYCLED, groups=["g0", "g0", "g1", "g1"])
    ours, ref = _raises_like_croma(RuntimeError, x, df, m=1)
    assert ours == ref
    for fragment in ("dataset 'toy' (all)", "subset 'dataset'", "after adaptive neighbour search reached k=3", "could not find 1 SO and 1 OS neighbour(s)"):
        assert fragment in ours
    assert "denominator" not in ours


def test_collapsed_embedding_raises_zero_denominator():
    x = np.ones((24, 8))
    df = toy_manifest([CYCLED[i % 4] for i in range(24)])
    ours, ref = _raises_like_croma(RuntimeError, x, df, m=1)
    assert ours == ref
    assert "zero margin denominator (d_OS + d_SO = 0)" in ours and "collapsed embedding" in ours
    assert "could not find" not in ours


def test_unscoreable_rows_prevent_partial_statistics():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 4))
    df = toy_manifest(CYCLED + [("C", "V3"), ("D", "V4")])
    ours, ref = _raises_like_croma(RuntimeError, x, df, m=1)
    assert ours == ref
    assert "2/6 sample(s) could not find 1 SO and 1 OS neighbour(s)" in ours
    assert "no pooled or tail statistics were computed" in ours


def test_list_m_raises_for_the_smallest_failing_m_first():
    x, df = a1()
    ours, ref = _raises_like_croma(RuntimeError, x, df, m=[5, 3])
    assert ours == ref and "m=3:" in ours


def test_non_finite_features_raise_value_error():
    x, df = a1()
    x = x.copy()
    x[3, 1] = np.nan
    _raises_like_croma(ValueError, x, df, m=1)
    x[3, 1] = np.inf
    ours, _ = _raises_like_croma(ValueError, x, df, m=1)
    assert "rows [3]" in ours


def _two_subsets(nan_in, fail_in):
    """Subsets 'a' and 'b' (4 rows each); NaN features in one, a support failure in the other."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((8, 4))
    groups = [f"slide-{i}" for i in range(8)]
    offset = {"a": 0, "b": 4}
    x[offset[nan_in] + 1, 0] = np.nan
    groups[offset[fail_in]] = groups[offset[fail_in] + 1]  # (A,V1) shares its only SO's group
    df = toy_manifest(CYCLED * 2, groups=groups, subset=["a"] * 4 + ["b"] * 4)
    return x, df


@pytest.mark.parametrize("nan_in, fail_in, exc", [("a", "b", ValueError), ("b", "a", RuntimeError)])
def test_error_order_across_subsets_follows_sorted_subsets(nan_in, fail_in, exc):
    x, df = _two_subsets(nan_in, fail_in)
    _raises_like_croma(exc, x, df, m=1, evaluation_design="paired_2x2")


def test_alpha_out_of_range_raises_after_searching():
    x, df = a1()
    _raises_like_croma(ValueError, x, df, m=1, alpha=1.5)
    # a support failure is reported before the alpha problem
    _raises_like_croma(RuntimeError, x, df, m=5, alpha=1.5)


def test_empty_manifest_returns_nan_result():
    x, df = a1()
    empty_x, empty_df = x[:0], df.iloc[:0]
    with pytest.warns(RuntimeWarning):
        ours = CRoMa.compute(empty_x, empty_df, confounder_column="scanner_vendor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref = croma.CRoMa.compute(empty_x, empty_df, confounder_column="scanner_vendor")
    assert np.isnan(ours.value) and ours.std == 0.0 and ours.n_pairs == 1
    assert np.isnan(ours.pair_values).all() and ours.pair_values.shape == (1,)
    assert ours.sample_values.size == 0 and (ours.k_start, ours.k_final, ours.retries) == (0, 0, 0)
    assert np.isnan(ours.q_alpha) and np.isnan(ours.ltm_alpha) and np.isnan(ours.f0)
    assert ours.dataset == ref.dataset == "dataset"
    assert ours.occurrence_subsets.dtype.kind == ref.occurrence_subsets.dtype.kind


def test_one_row_raises_at_k0():
    x, df = a1()
    ours, ref = _raises_like_croma(RuntimeError, x[:1], df.iloc[:1], m=1)
    assert ours == ref and "reached k=0" in ours


# --------------------------------------------------------------------------- typed search kernel


def brute_typed(u, labels, confs, groups, m):
    """Independent oracle: full distance matrix, per-type sort, first m (inf padded)."""
    d = cosine_distance_block(u, u).astype(np.float64)
    cross = groups[:, None] != groups[None, :]
    same_l = labels[:, None] == labels[None, :]
    same_c = confs[:, None] == confs[None, :]
    so = np.sort(np.where(cross & same_l & ~same_c, d, np.inf), axis=1)[:, :m]
    os_ = np.sort(np.where(cross & ~same_l & same_c, d, np.inf), axis=1)[:, :m]
    pad = lambda a: np.pad(a, ((0, 0), (0, m - a.shape[1])), constant_values=np.inf)  # noqa: E731
    return pad(so), pad(os_)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_typed_knn_equals_brute_force_for_any_block_size(seed, dtype):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 90))
    labels = rng.integers(0, 3, n)
    confs = rng.integers(0, 3, n)
    groups = rng.integers(0, max(1, n // 3), n)  # groups span cells
    u = normalize_rows(rng.standard_normal((n, 7)).astype(dtype))
    m = int(rng.integers(1, 8))
    want = brute_typed(u, labels, confs, groups, m)
    # BLAS picks different kernels for different GEMM shapes (a 1-row block may go through gemv),
    # so one pair's distance can move by an ulp or two of the dtype; +inf padding must be exact.
    ulps = 2 * np.finfo(dtype).eps
    for block in (None, 1, 3, 17):
        got = typed_knn(u, labels, confs, groups, m, block_rows=block)
        for g, w in zip(got, want):
            assert g.dtype == np.float64 and g.shape == (n, m)
            np.testing.assert_array_equal(np.isinf(g), np.isinf(w))
            finite = np.isfinite(w)
            np.testing.assert_allclose(g[finite], w[finite], rtol=0, atol=ulps)
    if dtype == np.float32:
        finite = got[0][np.isfinite(got[0])]
        np.testing.assert_array_equal(finite, finite.astype(np.float32))


def test_typed_knn_degenerate_inputs():
    so, os_ = typed_knn(np.zeros((1, 3)), [0], [0], [0], 2)
    assert so.shape == (1, 2) and np.isinf(so).all() and np.isinf(os_).all()
    so, os_ = typed_knn(np.zeros((0, 3)), np.zeros(0, int), np.zeros(0, int), np.zeros(0, int), 1)
    assert so.shape == (0, 1)
    with pytest.raises(ValueError, match="m must be >= 1"):
        typed_knn(np.zeros((2, 3)), [0, 1], [0, 1], [0, 1], 0)
    with pytest.raises(ValueError, match="labels"):
        typed_knn(np.zeros((2, 3)), [0], [0, 1], [0, 1], 1)


def test_count_within_matches_brute_force_for_any_block_size():
    rng = np.random.default_rng(2)
    u = normalize_rows(rng.standard_normal((50, 5)))
    groups = rng.integers(0, 12, 50)
    radius = rng.uniform(0, 1.5, 50)
    radius[3] = np.inf
    d = cosine_distance_block(u, u)
    want = ((d <= radius[:, None]) & (groups[:, None] != groups[None, :])).sum(axis=1)
    for block in (None, 1, 4, 13):
        np.testing.assert_array_equal(count_within(u, groups, radius, block_rows=block), want)


# --------------------------------------------------------------------------- invariances / backend


def _random_case(seed=0, n=150):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6))
    cells = [CYCLED[i] for i in rng.integers(0, 4, n)]
    df = toy_manifest(cells, groups=[f"g{v}" for v in rng.integers(0, n // 3, n)])
    return x, df


def test_tiny_blocks_and_dask_input_give_identical_results():
    x, df = _random_case()
    kw = dict(confounder_column="scanner_vendor", m=[1, 4], start_k=5)
    base = CRoMa.compute(x, df, **kw)
    tiny = CRoMa.compute_with(partial(typed_knn, block_rows=3), x, df, **kw)
    lazy = CRoMa.compute(da.from_array(x, chunks=(7, -1)), df, **kw)
    for key in base:
        # other tile shapes may move a distance by an ulp (see the kernel test above)
        assert_equal_results(tiny[key], base[key], atol=1e-15)
        assert_equal_results(lazy[key], base[key], atol=0)


def test_compute_with_calls_the_backend_once_per_scope_with_max_m():
    x, df = _random_case(1, 120)
    df["subset"] = np.where(np.arange(120) % 2, "p1", "p0")
    calls = []

    def backend(u, labels, confounders, groups, m):
        calls.append((u.shape[0], m))
        return brute_typed(u, np.asarray(labels), np.asarray(confounders), np.asarray(groups), m)

    kw = dict(confounder_column="scanner_vendor", m=[2, 3, 1], evaluation_design="paired_2x2")
    got = CRoMa.compute_with(backend, x, df, **kw)
    assert calls == [(60, 3), (60, 3)]
    want = CRoMa.compute(x, df, **kw)
    for key in want:
        assert_equal_results(got[key], want[key], atol=1e-15)  # brute force: other GEMM shapes


def test_compute_with_rejects_a_backend_with_the_wrong_shape():
    x, df = _random_case(2, 40)
    with pytest.raises(ValueError, match="typed_search returned shapes"):
        CRoMa.compute_with(lambda u, *a: (np.zeros((u.shape[0], 1)),) * 2, x, df, confounder_column="scanner_vendor", m=2)


def test_paired_empty_manifest_raises_like_croma():
    x, df = a1()
    ours, ref = _raises_like_croma(ValueError, x[:0], df.iloc[:0].assign(subset=[]), evaluation_design="paired_2x2")
    assert "does not define any subsets" in ours and "does not define any subsets" in ref


@pytest.mark.parametrize("dtype", [np.int64, np.float16])
def test_integer_and_half_precision_features_match_croma(dtype):
    """croma normalises in the input dtype (float16 stays float16 for that step, integers become
    float64) and searches in float64; tolerance: float64 distances (1e-12)."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((90, 5)) * 20).astype(dtype)
    df = toy_manifest([CYCLED[i] for i in rng.integers(0, 4, 90)], groups=[f"g{v}" for v in rng.integers(0, 30, 90)])
    r, ref = both(x, df, m=[1, 3], start_k=4)
    for key in ref:
        assert_equal_results(r[key], ref[key])


@pytest.mark.parametrize("design", ["all", "paired_2x2"])
def test_result_shape_and_pooled_statistics(design):
    x, df = _random_case(4, 160)
    df["subset"] = "p1"
    r = CRoMa.compute(x, df, confounder_column="scanner_vendor", evaluation_design=design, m=2)
    assert r.dataset == "toy" and r.n_pairs == 1 and np.isfinite(r.value)
    assert r.sample_values_aligned.shape == (160,)
    assert not hasattr(r, "occurrence_defined_mask") and not hasattr(r, "undefined_frac") and not hasattr(r, "support")
    assert r.value == np.median(r.sample_values)
    assert r.q_alpha == np.percentile(r.sample_values, 10)
    assert r.evaluation_unit == ("sample" if design == "all" else "occurrence")
    assert np.all((r.sample_values > -1) & (r.sample_values < 1))


def test_schedule_bounds_shortcut_agrees_with_counting():
    """When every unit's pool is tiny relative to start_k the bounds decide the schedule without a
    counting pass; the result must equal croma's either way."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((60, 4))
    df = toy_manifest([CYCLED[i % 4] for i in range(60)], groups=[f"g{i // 2}" for i in range(60)])
    for start_k in (1, 10, 40, 57, 58, 59, 200):
        r, ref = both(x, df, m=2, start_k=start_k, k_growth_factor=1.5)
        assert (r.k_start, r.k_final, r.retries) == (ref.k_start, ref.k_final, ref.retries)


# --------------------------------------------------------------------------- schedule_diagnostics


@pytest.mark.parametrize("design", ["all", "paired_2x2"])
def test_schedule_diagnostics_off_skips_counting_and_reports_not_computed(design, monkeypatch):
    """``compute_with(schedule_diagnostics=False)``: no counting pass, ``k_* = retries = -1``, every
    other field equal to the default call (which itself equals croma)."""
    import cachescore.metrics.croma as croma_mod
    from cachescore.metrics.croma import SCHEDULE_NOT_COMPUTED

    x, df = _random_case(5, 240)
    df["subset"] = np.where(np.arange(240) % 2, "p1", "p0")
    kw = dict(confounder_column="scanner_vendor", m=[3, 1], start_k=4, evaluation_design=design)
    want = CRoMa.compute(x, df, **kw)
    assert all(r.k_final > r.k_start > 0 for r in want.values())  # the counting pass had work to do

    def no_counting(*args, **kwargs):
        raise AssertionError("count_within must not run with schedule_diagnostics=False")

    monkeypatch.setattr(croma_mod, "count_within", no_counting)
    got = CRoMa.compute_with(typed_knn, x, df, schedule_diagnostics=False, **kw)
    assert list(got) == list(want)
    for key in want:
        assert (got[key].k_start, got[key].k_final, got[key].retries) == (SCHEDULE_NOT_COMPUTED,) * 3 == (-1, -1, -1)
        for name in ("value", "std", "q_alpha", "ltm_alpha", "f0", "n_pairs", "alpha", "dataset", "m"):
            a, b = getattr(got[key], name), getattr(want[key], name)
            assert a == b or (np.isnan(a) and np.isnan(b)), name
        for name in ("pair_values", "sample_values", "sample_values_aligned", "occurrence_subsets", "occurrence_source_indices"):
            np.testing.assert_array_equal(getattr(got[key], name), getattr(want[key], name), err_msg=name)
    # small scopes where no counting is ever needed also report "not computed", never a real value
    small = CRoMa.compute_with(typed_knn, x[:40], df.iloc[:40], schedule_diagnostics=False, confounder_column="scanner_vendor", m=1)
    assert (small.k_start, small.k_final, small.retries) == (-1, -1, -1)
    assert "schedule_diagnostics" not in inspect.signature(CRoMa.compute).parameters


def test_schedule_diagnostics_off_keeps_croma_error_message():
    """An unresolved scope's schedule runs to the cap (no counting), so the error still quotes croma's k."""
    x = unit_circle([0, 0.3, 1.5, 1.9])
    df = toy_manifest(CYCLED, groups=["g0", "g0", "g1", "g1"])
    with pytest.raises(RuntimeError) as ours:
        CRoMa.compute_with(typed_knn, x, df, confounder_column="scanner_vendor", m=1, schedule_diagnostics=False)
    with pytest.raises(RuntimeError) as ref:
        croma.CRoMa.compute(x, df, confounder_column="scanner_vendor", m=1)
    assert str(ours.value) == str(ref.value)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_similarity_floor_is_bit_equivalent_to_the_distance_comparison(dtype):
    from cachescore.neighbors.typed import similarity_floor

    rng = np.random.default_rng(3)
    radius = rng.uniform(0, 2.2, 500)
    radius[:6] = [0.0, np.inf, 1e-12, 2.0, 1.9999999, 0.5]
    floor = similarity_floor(radius, dtype)
    r = np.where(radius >= 2.0, np.inf, radius).astype(dtype)
    sims = rng.uniform(-1.01, 1.01, 3000).astype(dtype)
    finite = np.isfinite(floor)
    # include every row's floor and its predecessor: the boundary itself is tested
    sims = np.concatenate([sims, floor[finite], np.nextafter(floor[finite], dtype(-np.inf))])
    by_distance = (dtype(1) - sims[None, :]) <= r[:, None]
    np.testing.assert_array_equal(sims[None, :] >= floor[:, None], by_distance)
    assert floor.dtype == dtype and np.isneginf(floor[[1, 3]]).all() and floor[0] == 1.0


@pytest.mark.parametrize("seed", range(8))
def test_fused_typed_search_and_count_equal_the_separate_passes(seed):
    """``typed_knn_and_counts`` (typed tiles kept and re-used for the count, or not when over the
    memory budget) gives ``typed_knn``'s distances bit for bit and ``count_within``'s counts, with
    groups spanning cells, any block size, radii of 0 / >= 2 / inf. Counts could differ only for a
    distance within an ulp of its radius (other GEMM shapes); the random radii here avoid that."""
    from cachescore.neighbors.typed import typed_knn_and_counts

    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 260))
    labels, confs = rng.integers(0, int(rng.integers(1, 4)), n), rng.integers(0, int(rng.integers(1, 4)), n)
    groups = rng.integers(0, max(1, n // int(rng.integers(1, 6))), n)
    radius = rng.uniform(0, 2.5, n)
    radius[:2] = [np.inf, 0.0]
    for dtype in (np.float32, np.float64):
        u = normalize_rows(rng.standard_normal((n, 6)).astype(dtype))
        want_count = count_within(u, groups, radius)
        for block in (None, 7):
            want = typed_knn(u, labels, confs, groups, 3, block_rows=block)
            for tile_bytes in (None, 0):
                seen = []

                def radius_for(so, os_):
                    seen.append((so, os_))
                    return radius

                so, os_, counts = typed_knn_and_counts(
                    u, labels, confs, groups, 3, radius_for, block_rows=block, tile_bytes=tile_bytes
                )
                np.testing.assert_array_equal(so, want[0])
                np.testing.assert_array_equal(os_, want[1])
                np.testing.assert_array_equal(seen[0][0], want[0])
                np.testing.assert_array_equal(counts, want_count)
        assert typed_knn_and_counts(u, labels, confs, groups, 2, lambda so, os_: None)[2] is None
