"""RI / MaRI behaviour: reference fixtures, error catalogue, warnings, tau, invariances.

Pins (spec/metrics.md): the Appendix A outputs of croma 1.0.1 (values copied from the spec's
table, which were produced by the reference — not by this code); the cap quirk example (§3.2);
the §1.8 error catalogue, each case raising the same exception class as croma, in the same order;
the support / OO warnings' exact wording (§5.5); auto-tau fallbacks and the pinned-tau scale check
(§6.3); the log path at extreme temperatures (§6.1); and invariances of this implementation:
block sizes, numpy vs dask input, manifest given as a file, one neighbour search per scope per
call through an injected backend (``compute_with``).
"""

from __future__ import annotations

import functools
import warnings

import dask.array as da
import numpy as np
import pytest

import croma
from cachescore.metrics.mari import MaRI, MarginAwareRobustnessIndex
from cachescore.metrics.ri import RI, RobustnessIndex
from cachescore.metrics.tau import assess_tau, format_tau_warning
from cachescore.neighbors.exact import cross_group_knn

from conftest import call_capturing, make_toy_manifest

CONF = "scanner_vendor"
CYCLE = [("A", "V1"), ("A", "V2"), ("B", "V1"), ("B", "V2")]
quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def cycled(x):
    cells = [CYCLE[i % 4] for i in range(len(x))]
    return x, make_toy_manifest([c[0] for c in cells], [c[1] for c in cells])


def a1():
    a = [(1, 0), (0.95, 0.05), (0.92, 0.08), (0.90, 0.10)]
    b = [(0, 1), (0.05, 0.95), (0.08, 0.92), (0.10, 0.90)]
    x = np.array([list(p) + [0, 0] for p in a + b], dtype=np.float64)
    df = make_toy_manifest(["A"] * 4 + ["B"] * 4, ["V1", "V1", "V2", "V2"] * 2)
    return x, df


def dominant(axis_owner):
    rows, labels, confs = [], [], []
    for a in range(2):
        for i in range(12):
            v = np.zeros(3)
            v[a] = 1.0
            v[2] = 0.01 * i
            rows.append(v)
            own, other = ("AB"[a], ("V1", "V2")[i % 2]) if axis_owner == "label" else ("AB"[i % 2], ("V1", "V2")[a])
            labels.append(own)
            confs.append(other)
    return np.array(rows), make_toy_manifest(labels, confs)


def contested():
    corners = [(1, 0), (0, 1), (0, -1), (-1, 0)]
    rows, cells = [], []
    for b in range(6):
        for c in range(4):
            v = np.zeros(8)
            v[b] = 1.0
            v[6:] = 0.1 * np.array(corners[c])
            rows.append(v)
            cells.append(CYCLE[c])
    return np.array(rows), make_toy_manifest([c[0] for c in cells], [c[1] for c in cells])


def ring():
    t = 2 * np.pi * np.arange(32) / 32
    return cycled(np.stack([np.cos(t), np.sin(t)], axis=1))


def isotropic(dtype=np.float64):
    x = np.random.default_rng(20260727).standard_normal((1000, 32)).astype(dtype)
    return cycled(x)


def count_matched(so_dist, os_dist):
    theta = lambda dist: np.arccos(1 - dist / 0.2)  # noqa: E731
    cells_a = [("A", "V1"), ("A", "V2"), ("A", "V2"), ("B", "V1")]
    cells_b = [("B", "V1"), ("B", "V2"), ("B", "V2"), ("A", "V1")]
    rows, cells = [], []
    for b in range(6):
        for slot, ang in enumerate([0.0, theta(so_dist), -theta(so_dist), theta(os_dist)]):
            v = np.zeros(8)
            v[b] = 1.0
            v[6:] = 0.5 * np.array([np.cos(ang), np.sin(ang)])
            rows.append(v)
            cells.append((cells_a if b % 2 == 0 else cells_b)[slot])
    return np.array(rows), make_toy_manifest([c[0] for c in cells], [c[1] for c in cells])


def angles(degrees, cells, **kw):
    t = np.radians(np.asarray(degrees, dtype=float))
    return np.stack([np.cos(t), np.sin(t)], axis=1), make_toy_manifest([c[0] for c in cells], [c[1] for c in cells], **kw)


# ---------------------------------------------------------------------------------------------
# Appendix A: croma 1.0.1 outputs


@quiet
def test_a1_so_closer_toy():
    x, df = a1()
    r = RI.compute(x, df, confounder_column=CONF, k_candidates=[1, 3])
    assert (r.k, r.value, r.support) == (1, 1.0, 0.25)
    assert r.sample_undefined_types.tolist() == [1, 0, 1, 1, 1, 0, 1, 1]
    r = RI.compute(x, df, confounder_column=CONF, k_candidates=[2, 3, 4, 5])
    assert (r.k, r.value, r.support) == (2, 1.0, 1.0)
    m = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[1, 3])
    assert m.tau == pytest.approx(0.0005832347730755361, rel=1e-12) and m.value == 1.0
    m = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[2, 3, 4, 5])
    assert m.tau == pytest.approx(0.0011345324469790863, rel=1e-12) and m.value == 1.0
    df["subset"] = "pair0"
    r = RI.compute(x, df, confounder_column=CONF, k_candidates=[1, 3], evaluation_design="paired_2x2")
    assert (r.k, r.value, r.support, r.n_pairs, r.evaluation_unit) == (1, 1.0, 0.25, 1, "occurrence")


@pytest.mark.parametrize(
    "build, ri, mari, tau",
    [
        (lambda: dominant("label"), 1.0, 1.0, 4.9747259077470574e-05),
        (lambda: dominant("confounder"), 0.0, 0.0, None),
        (contested, 0.5, 0.5, 0.009900990099009688),
        (ring, 0.5, 0.7674206564300765, 0.04766759354274125),
    ],
    ids=["biology_dominant", "confounder_dominant", "contested", "type_interleaved_ring"],
)
def test_named_embeddings(build, ri, mari, tau):
    x, df = build()
    r = RI.compute(x, df, confounder_column=CONF, k_candidates=[3])
    m = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[3])
    assert r.value == pytest.approx(ri, abs=1e-12)
    assert m.value == pytest.approx(mari, abs=1e-12)
    if tau is not None:
        assert m.tau == pytest.approx(tau, rel=1e-12)


@pytest.mark.filterwarnings("ignore:.*predominantly OO-dominated:RuntimeWarning")
def test_isotropic_gaussian_all_design():
    x, df = isotropic()
    with pytest.warns(RuntimeWarning, match="support is 87.6%"):
        r3 = RI.compute(x, df, confounder_column=CONF, k_candidates=[3])
    assert r3.value == pytest.approx(0.502635046113307, rel=1e-12) and r3.support == 0.876
    with pytest.warns(RuntimeWarning, match="support"):
        m3 = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[3])
    assert m3.value == pytest.approx(0.5028257689877984, rel=1e-12)
    assert m3.tau == pytest.approx(0.5031297325047839, rel=1e-12)
    with pytest.warns(RuntimeWarning, match="support is 97.3%"):
        r = RI.compute(x, df, confounder_column=CONF, k_candidates=[21, 5, 11])
    assert r.k == 5 and r.value == pytest.approx(0.5025968837395126, rel=1e-12)
    assert (r.median_value, r.q_alpha, r.ltm_alpha, r.support) == (0.5, 0.0, 0.0, 0.973)
    assert r.ss_dominated_undefined_frac == pytest.approx(0.01)
    assert r.oo_dominated_undefined_frac == pytest.approx(0.017) and r.mixed_undefined_frac == 0.0
    with pytest.warns(RuntimeWarning):
        m = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[21, 5, 11])
    assert m.k == 5 and m.tau == pytest.approx(0.5233509956641684, rel=1e-12)
    assert m.value == pytest.approx(0.5029573408320558, rel=1e-12)
    assert m.median_value == pytest.approx(0.5042686350274731, rel=1e-12) and (m.q_alpha, m.ltm_alpha) == (0.0, 0.0)
    curve = RI.compute_curve(x, df, confounder_column=CONF, k_values=[1, 5, 11, 21])
    want = {1: 0.49173553719008267, 5: 0.5025968837395126, 11: 0.49809264305177114, 21: 0.5025606980273141}
    assert list(curve) == list(want)
    for k in want:
        assert curve[k] == pytest.approx(want[k], rel=1e-12)


@quiet
def test_isotropic_gaussian_float32_and_paired():
    x, df = isotropic(np.float32)
    r = RI.compute(x, df, confounder_column=CONF, k_candidates=[21, 5, 11])
    assert r.k == 5 and r.value == pytest.approx(0.5025968837395126, rel=1e-12)
    m = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[21, 5, 11])
    assert m.tau == pytest.approx(0.5233510136604309, abs=4e-7)
    assert m.value == pytest.approx(0.5029573406909398, abs=1e-6)
    x, df = isotropic()
    df["subset"] = [f"s{(i // 4) % 3}" for i in range(len(df))]
    r = RI.compute(x, df, confounder_column=CONF, k_candidates=[21, 5, 11], evaluation_design="paired_2x2")
    assert r.k == 21 and r.value == pytest.approx(0.5024255683439551, rel=1e-12)
    assert r.std == pytest.approx(0.007598639216755705, rel=1e-12)
    np.testing.assert_allclose(r.pair_values, [0.49618536309692, 0.5131278538812786, 0.4979827089337176], rtol=1e-12)
    m = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[21, 5, 11], evaluation_design="paired_2x2")
    assert m.tau == pytest.approx(0.6738673486235927, rel=1e-12)
    assert m.value == pytest.approx(0.5022309866879615, rel=1e-12)


def test_count_matched_pair():
    for so, os_, mari, tau in [(0.05, 0.30, 0.9966423383734974, 0.050000000000000044), (0.30, 0.05, 0.4650107442440992, 0.30000000000000004)]:
        x, df = count_matched(so, os_)
        assert RI.compute(x, df, confounder_column=CONF, k_candidates=[3]).value == pytest.approx(2 / 3, abs=1e-12)
        m = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[3])
        assert m.value == pytest.approx(mari, rel=1e-12) and m.tau == pytest.approx(tau, rel=1e-12)


@quiet
def test_cap_quirk_hides_the_farthest_row():
    x, df = angles([0, 10, 20, 90], [("A", "V1"), ("B", "V1"), ("B", "V2"), ("A", "V2")])
    r = RI.compute(x, df, confounder_column=CONF, k_candidates=[3])
    assert r.value == pytest.approx(0.4, abs=1e-15)
    np.testing.assert_array_equal(r.sample_values_aligned, [0.0, 0.5, 1.0, 0.0])


# ---------------------------------------------------------------------------------------------
# Error catalogue (§1.8): same class as croma, and our message names the problem.


def _frame(n=8, **kw):
    cells = [CYCLE[i % 4] for i in range(n)]
    return make_toy_manifest([c[0] for c in cells], [c[1] for c in cells], **kw)


def _x(n=8, d=4):
    return np.random.default_rng(n).standard_normal((n, d))


def _missing_group():
    df = _frame()
    return df.rename(columns={"group_id": "slide_id"})


def _blank_group():
    df = _frame()
    df.loc[2, "group_id"] = "  "
    df.index = [f"r{i}" for i in range(len(df))]
    return df


def _nan_x():
    x = _x()
    x[3, 1] = np.nan
    return x


def _one_group():
    return _frame(groups=["g"] * 8)


def _paired(subsets):
    return _frame(subsets=subsets)


CASES = {
    "manifest not a frame": (dict(features=_x(), manifest=[1, 2]), TypeError, "manifest"),
    "features a list": (dict(features=_x().tolist(), manifest=_frame()), TypeError, "features"),
    "features 1-D": (dict(features=np.zeros(8), manifest=_frame()), ValueError, "2-D"),
    "row count": (dict(features=_x(7), manifest=_frame()), ValueError, "rows"),
    "empty": (dict(features=np.zeros((0, 3)), manifest=_frame(0)), ValueError, "at least one evaluation unit"),
    "blank confounder name": (dict(features=_x(), manifest=_frame(), confounder_column="  "), ValueError, "confounder_column"),
    "missing columns": (dict(features=_x(), manifest=_frame().drop(columns=["label"])), ValueError, "label"),
    "slide_id hint": (dict(features=_x(), manifest=_missing_group()), ValueError, "slide_id"),
    "blank group_id": (dict(features=_x(), manifest=_blank_group()), ValueError, "group_id values at rows [2]"),
    "bad design": (dict(features=_x(), manifest=_frame(), evaluation_design="dataset_wide"), ValueError, "'all' or 'paired_2x2'"),
    "no subset column": (dict(features=_x(), manifest=_frame(), evaluation_design="paired_2x2"), ValueError, "subset"),
    "blank subset": (dict(features=_x(), manifest=_paired(["p"] * 7 + [" "]), evaluation_design="paired_2x2"), ValueError, "blank subset"),
    "incomplete subset": (dict(features=_x(), manifest=_paired(["p1"] * 4 + ["p0", "p0", "p0", "p1"]), evaluation_design="paired_2x2"), ValueError, "p0"),
    "k <= 0": (dict(features=_x(), manifest=_frame(), k=[3, 0]), ValueError, "strictly positive"),
    "k empty": (dict(features=_x(), manifest=_frame(), k=[]), ValueError, "at least one candidate"),
    # RI scores first (search needs 2 rows); MaRI selects k first (no candidate below n = 1)
    "one row": (dict(features=_x(1), manifest=_frame(1), k=[1]), RuntimeError, {"RI": "at least two samples", "MaRI": "no valid k candidates"}),
    "no k < n": (dict(features=_x(), manifest=_frame(), k=[8, 9]), RuntimeError, "no valid k candidates remain"),
    "paired no k < size": (dict(features=_x(), manifest=_paired(["p"] * 4 + ["q"] * 4), evaluation_design="paired_2x2", k=[4]), RuntimeError, "subset k-selection failed on all subsets"),
    "one group": (dict(features=_x(), manifest=_one_group()), RuntimeError, "no sample has any cross-group neighbor"),
    "nan features": (dict(features=_nan_x(), manifest=_frame()), ValueError, "NaN"),
}


def _call(cls, case, **extra):
    kw = dict(case)
    features, manifest = kw.pop("features"), kw.pop("manifest")
    k = kw.pop("k", [1, 3])
    kw.setdefault("confounder_column", CONF)
    return call_capturing(cls.compute, features, manifest, k_candidates=k, **kw, **extra)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("metric", ["RI", "MaRI"])
def test_error_catalogue_matches_croma(name, metric):
    case, cls_expected, fragment = CASES[name]
    ours, _ = _call({"RI": RI, "MaRI": MaRI}[metric], case)
    ref, _ = _call(getattr(croma, metric), case)
    assert isinstance(ref, Exception), f"croma did not raise for {name}"
    assert type(ours) is type(ref) is cls_expected, (ours, ref)
    assert (fragment if isinstance(fragment, str) else fragment[metric]) in str(ours)
    if name == "one group":
        assert "slide" not in str(ours)
    if name == "bad design":
        assert "dataset_wide" not in str(ours)


def test_design_is_stripped_and_lower_cased():
    x, df = a1()
    r = RI.compute(x, df, confounder_column=CONF, k_candidates=[2], evaluation_design=" ALL ")
    assert r.evaluation_design == "all"


@pytest.mark.parametrize("tau", [0, -1.0])
def test_non_positive_tau_rejected_before_anything_else(tau):
    with pytest.raises(ValueError, match="tau must be > 0"):
        MaRI.compute("not features", "not a manifest", confounder_column=CONF, k_candidates=[1], tau=tau)
    with pytest.raises(ValueError, match="tau must be > 0"):
        MaRI.compute_curve("not features", "not a manifest", confounder_column=CONF, k_values=[1], tau=tau)


def test_mari_paired_with_only_incomplete_subsets_raises_like_croma():
    """MaRI resolves k before validating subsets (RuntimeError); RI validates first (ValueError)."""
    df = _paired(["p0", "p0", "p0", "p1", "p1", "p1", "p2", "p2"])
    for metric, cls in (("RI", RI), ("MaRI", MaRI)):
        ours, _ = call_capturing(cls.compute, _x(), df, confounder_column=CONF, k_candidates=[1], evaluation_design="paired_2x2")
        ref, _ = call_capturing(getattr(croma, metric).compute, _x(), df, confounder_column=CONF, k_candidates=[1], evaluation_design="paired_2x2")
        assert type(ours) is type(ref), (metric, ours, ref)


def test_signatures_take_no_extra_keywords():
    with pytest.raises(TypeError):
        RI.compute(*a1(), confounder_column=CONF, k_candidates=[1], kmax=3)
    assert RobustnessIndex is RI and MarginAwareRobustnessIndex is MaRI


# ---------------------------------------------------------------------------------------------
# Warnings (§5.5) and tau (§6.3)


def test_support_and_oo_warnings_have_croma_wording():
    # rows 0-3: each unit's only cross-group neighbours are OO (label and confounder differ)
    x, df = angles([0, 1, 90, 91], [("A", "V1"), ("B", "V2"), ("A", "V1"), ("B", "V2")], groups=["g0", "g1", "g0", "g1"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RI.compute(x, df, confounder_column=CONF, k_candidates=[1])
    msgs = [str(w.message) for w in caught]
    assert "toy: RI/MaRI support is 0.0% across samples." in msgs
    assert "toy: undefined RI/MaRI samples are predominantly OO-dominated (100.0%)." in msgs
    ref, ref_msgs = call_capturing(croma.RI.compute, x, df, confounder_column=CONF, k_candidates=[1])
    assert sorted(m for m in ref_msgs if "RI/MaRI" in m) == sorted(msgs)


@pytest.mark.filterwarnings("ignore:.*predominantly OO-dominated:RuntimeWarning")
def test_paired_support_warning_names_subset_occurrences():
    x, df = angles([0, 1, 90, 91], [("A", "V1"), ("B", "V2"), ("A", "V2"), ("B", "V1")], groups=["g0", "g1", "g0", "g1"], subsets=["p"] * 4)
    with pytest.warns(RuntimeWarning, match="across subset occurrences"):
        RI.compute(x, df, confounder_column=CONF, k_candidates=[1], evaluation_design="paired_2x2")


def test_auto_tau_without_typed_neighbours_falls_back():
    # label and confounder perfectly aligned: no SO or OS pair exists anywhere
    x, df = angles(np.arange(8) * 20.0, [("A", "V1"), ("B", "V2")] * 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[3])
    tau_msgs = [str(w.message) for w in caught if "tau" in str(w.message)]
    assert len(tau_msgs) == 1 and "tau cannot be put on a distance scale" in tau_msgs[0]
    assert m.tau == 0.2 and m.support == 0.0 and m.value == 0.5
    assert np.isnan(MaRI.recommend_tau(x, df, confounder_column=CONF, k=3))


def test_auto_tau_on_collapsed_embedding_names_the_collapse():
    x, df = cycled(np.ones((24, 8)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[3])
    tau_msgs = [str(w.message) for w in caught if "tau" in str(w.message)]
    assert len(tau_msgs) == 1
    msg = tau_msgs[0]
    assert "distance 0" in msg and "collapsed" in msg and "RI" in msg
    assert "no typed" not in msg and "undefined" not in msg
    assert m.tau == 0.2 and np.isfinite(m.value) and m.support == 1.0


def test_assess_tau_regimes_and_message():
    typed = [0.2, 0.3, 0.4]
    a = assess_tau(0.3, typed)
    assert (a.regime, a.median_typed_distance, a.low, a.high, a.n_typed) == ("principled", 0.3, 0.075, 1.2, 3)
    assert a.is_principled
    assert assess_tau(0.05, typed).regime == "too_sharp"
    assert assess_tau(2.0, typed).regime == "too_flat"
    assert assess_tau(0.075, typed).regime == assess_tau(1.2, typed).regime == "principled"
    u = assess_tau(0.3, [np.nan])
    assert u.regime == "undetermined" and u.n_typed == 0
    sharp = format_tau_warning(assess_tau(0.05, typed))
    assert "0.3" in sharp and "0.05" in sharp and "winner-take-all" in sharp and "warn_tau=False" in sharp
    assert "RI" in format_tau_warning(assess_tau(2.0, typed))


def test_pinned_tau_scale_check():
    x, df = isotropic()
    x, df = x[:200], df.iloc[:200].reset_index(drop=True)
    kw = dict(confounder_column=CONF, k_candidates=[5])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MaRI.compute(x, df, tau=1e-3, **kw)
        MaRI.compute(x, df, tau=50.0, **kw)
        MaRI.compute(x, df, tau=1e-3, warn_tau=False, **kw)
        auto = MaRI.compute(x, df, **kw)
        pinned = MaRI.compute(x, df, tau=auto.tau, **kw)
    tau_msgs = [str(w.message) for w in caught if "tau" in str(w.message)]
    assert len(tau_msgs) == 2
    assert "winner-take-all" in tau_msgs[0] and "degenerates into the count-based RI" in tau_msgs[1]
    assert pinned.value == auto.value and pinned.tau == auto.tau
    np.testing.assert_array_equal(pinned.sample_values_aligned, auto.sample_values_aligned)


@quiet
def test_tau_and_k_relations():
    x, df = isotropic()
    x, df = x[:300], df.iloc[:300].reset_index(drop=True)
    kw = dict(confounder_column=CONF)
    r = RI.compute(x, df, k_candidates=[21, 5, 11], **kw)
    m = MaRI.compute(x, df, k_candidates=[21, 5, 11], **kw)
    assert r.k == m.k and np.isnan(r.tau)
    assert m.tau == MaRI.recommend_tau(x, df, k=m.k, **kw)
    curve_auto = MaRI.compute_curve(x, df, k_values=[21, 5, 11], **kw)
    assert curve_auto == MaRI.compute_curve(x, df, k_values=[21, 5, 11], tau=m.tau, **kw)
    flat = MaRI.compute_curve(x, df, k_values=[1, 5, 40], tau=1e12, **kw)
    ri = RI.compute_curve(x, df, k_values=[1, 5, 40], **kw)
    for k in ri:
        assert flat[k] == pytest.approx(ri[k], abs=1e-9)  # spec §6.4 pins "within 1e-9 at tau = 1e12"
    assert MaRI.compute(x, df, k_candidates=[5], tau=0.37, warn_tau=False, **kw).tau == 0.37


def test_log_path_at_extreme_temperatures():
    # unit 0: SO at distance 0.744, OS at 0.745 (groups keep everything else out of its window)
    d_so, d_os = 0.744, 0.745
    x, df = angles(
        [0.0, np.degrees(np.arccos(1 - d_so)), -np.degrees(np.arccos(1 - d_os)), 180.0],
        [("A", "V1"), ("A", "V2"), ("B", "V1"), ("B", "V2")],
    )  # row 3 is everyone's farthest row, so the cap hides it and not row 1 or 2
    m = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[2], tau=0.001, warn_tau=False)
    # weights exp(-744) are subnormal: the log path must still give 1/(1+e^-(d_os-d_so)/tau) ~ 0.731
    # (the realised distances differ from 0.744/0.745 in the last bits, hence the formula)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    real = 1 - u[0] @ u[1:3].T
    assert m.sample_values_aligned[0] == pytest.approx(1 / (1 + np.exp(-(real[1] - real[0]) / 0.001)), abs=1e-12)
    assert m.sample_values_aligned[0] == pytest.approx(0.7310585786300049, abs=1e-12)
    ref = croma.MaRI.compute(x, df, confounder_column=CONF, k_candidates=[2], tau=0.001, warn_tau=False)
    np.testing.assert_allclose(m.sample_values_aligned, ref.sample_values_aligned, rtol=1e-15, equal_nan=True)
    assert m.value == pytest.approx(ref.value, rel=1e-15)
    x, df = a1()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[2, 3, 4, 5], tau=5e-324, warn_tau=False)
        df["subset"] = "p"
        p = MaRI.compute(x, df, confounder_column=CONF, k_candidates=[2, 3, 4, 5], tau=5e-324, warn_tau=False, evaluation_design="paired_2x2")
    for res in (s, p):
        assert res.value == 1.0 and res.occurrence_defined_mask.all()
        assert set(res.sample_values.tolist()) == {1.0}


# ---------------------------------------------------------------------------------------------
# Invariances of this implementation


def _random_case(seed, n=150, dtype=np.float64):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    confs = rng.integers(0, 2, n)
    x = (rng.standard_normal((2, 16))[labels] + rng.standard_normal((n, 16))).astype(dtype)
    df = make_toy_manifest([f"L{v}" for v in labels], [f"V{v}" for v in confs], [f"g{v}" for v in rng.integers(0, n // 4, n)])
    df["subset"] = np.where(np.arange(n) % 2, "p1", "p0")
    return x, df


@quiet
@pytest.mark.parametrize("design", ["all", "paired_2x2"])
def test_block_sizes_do_not_change_results(global_seed, design):
    x, df = _random_case(global_seed)
    tiny = functools.partial(cross_group_knn, block_rows=7, block_cols=5)
    kw = dict(confounder_column=CONF, k_candidates=[3, 9, 30, 200], evaluation_design=design)
    a, b = RI.compute(x, df, **kw), RI.compute_with(tiny, x, df, **kw)
    for f in ("k", "value", "support"):
        assert getattr(a, f) == getattr(b, f)
    np.testing.assert_array_equal(a.sample_values_aligned, b.sample_values_aligned)
    np.testing.assert_array_equal(a.sample_undefined_types, b.sample_undefined_types)
    ma, mb = MaRI.compute(x, df, **kw), MaRI.compute_with(tiny, x, df, **kw)
    assert ma.k == mb.k
    # BLAS may move the last bit of a distance between block shapes (spec §12.3)
    assert mb.tau == pytest.approx(ma.tau, rel=1e-14) and mb.value == pytest.approx(ma.value, rel=1e-12)


@quiet
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dask_input_equals_numpy_input(dtype):
    x, df = _random_case(5, dtype=dtype)
    xd = da.from_array(x, chunks=(7, -1))
    kw = dict(confounder_column=CONF, k_candidates=[3, 9])
    for cls in (RI, MaRI):
        a, b = cls.compute(x, df, **kw), cls.compute(xd, df, **kw)
        assert a.value == b.value and a.k == b.k
        np.testing.assert_array_equal(a.sample_values_aligned, b.sample_values_aligned)
    assert MaRI.recommend_tau(xd, df, confounder_column=CONF, k=5) == MaRI.recommend_tau(x, df, confounder_column=CONF, k=5)


@quiet
def test_manifest_may_be_a_file(tmp_path):
    x, df = _random_case(6)
    path = tmp_path / "view.parquet"
    df.to_parquet(path)
    kw = dict(confounder_column=CONF, k_candidates=[3, 9])
    assert RI.compute(x, path, **kw).value == RI.compute(x, df, **kw).value


@quiet
def test_one_search_per_scope_per_call():
    x, df = _random_case(7, n=120)
    calls = []

    def spy(u, groups, kmax, **kw):
        calls.append((u.shape[0], kmax))
        return cross_group_knn(u, groups, kmax, **kw)

    kw = dict(confounder_column=CONF, k_candidates=[3, 9, 200])
    RI.compute_with(spy, x, df, **kw)
    MaRI.compute_with(spy, x, df, tau=0.1, **kw)
    MaRI.compute_with(spy, x, df, **kw)
    assert calls == [(120, 119)] * 3
    calls.clear()
    RI.compute_with(spy, x, df, evaluation_design="paired_2x2", **kw)
    assert calls == [(60, 59), (60, 59)]
