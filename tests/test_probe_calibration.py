"""Pins cachescore.probe.calibration: probabilities, bins, ECE, calibration tables, temperature.

Oracles: hand-computed cases, scikit-learn (calibration_curve for the (lo, hi] bin convention,
log_loss, brier_score_loss, confusion_matrix, LogisticRegression.predict_proba) and scipy.
No expected value is taken from our own output.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from scipy.special import softmax
from sklearn.calibration import calibration_curve
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score, brier_score_loss, log_loss

from cachescore.probe import calibration as cal

SEEDS = range(12)


# --------------------------------------------------------------------------- probabilities


def test_vector_and_column_expand_to_two_columns():
    p = np.array([0.1, 0.75, 1.0, 0.0])
    for given in (p, p[:, None]):
        out = cal.normalize_probabilities(given)
        np.testing.assert_array_equal(out, np.column_stack([1 - p, p]))
        np.testing.assert_allclose(out.sum(axis=1), 1.0)


def test_rows_are_normalised_and_a_new_array_is_returned():
    p = np.array([[0.2, 0.2], [0.1, 0.3]])
    out = cal.normalize_probabilities(p)
    assert out is not p and not np.shares_memory(out, p)
    np.testing.assert_allclose(out, [[0.5, 0.5], [0.25, 0.75]])
    np.testing.assert_array_equal(p, [[0.2, 0.2], [0.1, 0.3]])  # caller's array untouched
    q = np.array([[0.4, 0.6]])
    assert cal.normalize_probabilities(q) is not q


@pytest.mark.parametrize(
    "p, kwargs, match",
    [
        (np.array([[0.5, np.nan]]), {}, "finite"),
        (np.array([[0.5, np.inf]]), {}, "finite"),
        (np.array([[-0.1, 0.5]]), {}, "negative"),
        (np.array([[0.5, 1.5]]), {}, "exceed 1"),
        (np.array([[0.0, 0.0]]), {}, "positive sum"),
        (np.array([[0.5, 0.5]]), {"n_classes": 3}, "n_classes is 3"),
        (np.zeros((2, 2, 2)), {}, "2-D"),
    ],
)
def test_each_bad_probability_input_has_its_own_message(p, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cal.normalize_probabilities(p, **kwargs)


@pytest.mark.parametrize("seed", SEEDS)
def test_softmax_of_expanded_binary_decision_is_predict_proba(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(60, 4))
    y = (x[:, 0] + rng.normal(size=60) > 0).astype(int)
    model = LogisticRegression().fit(x, y)
    z = model.decision_function(x)
    np.testing.assert_allclose(cal.decision_to_probabilities(z), model.predict_proba(x), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(
        cal.decision_to_probabilities(np.column_stack([np.zeros_like(z), z])), model.predict_proba(x),
        rtol=1e-12, atol=1e-15,
    )


def test_softmax_multiclass_is_predict_proba():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(90, 5))
    y = np.argmax(x[:, :3] + rng.normal(size=(90, 3)), axis=1)
    model = LogisticRegression().fit(x, y)
    np.testing.assert_allclose(
        cal.decision_to_probabilities(model.decision_function(x)), model.predict_proba(x), rtol=1e-12
    )


# --------------------------------------------------------------------------- bins and ECE


def test_bin_edges_follow_the_lower_closed_upper_open_rule():
    # linspace(0, 1, 6) edges are exact: 0.2, 0.4, 0.6, 0.8.
    scores = np.array([0.0, 0.2, np.nextafter(0.2, 1), 0.4, 0.99, 1.0])
    np.testing.assert_array_equal(cal.bin_indices(scores, 5), [0, 0, 1, 1, 4, 4])


def test_ece_hand_computed():
    # confidences 0.9 (correct), 0.8 (wrong), 0.6 (correct), 0.55 (correct); 5 bins of width 0.2
    p = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.45, 0.55]])
    y = np.array([0, 0, 0, 1])
    # bins: (0.4,0.6] -> {0.6, 0.55}: acc 1, conf 0.575 ; (0.6,0.8] -> {0.8}: acc 0 ;
    # (0.8,1] -> {0.9}: acc 1.  ECE = 0.5*0.425 + 0.25*0.8 + 0.25*0.1 = 0.4375
    assert cal.expected_calibration_error(y, p, n_bins=5) == pytest.approx(0.4375, abs=1e-15)
    # one bin-width-0.5 pair of bins: all in (0.5, 1]: |0.75 - 0.7125|
    assert cal.expected_calibration_error(y, p, n_bins=2) == pytest.approx(0.0375, abs=1e-15)


def test_ece_is_zero_when_bin_accuracy_equals_confidence():
    # 10 rows at confidence 0.7 with 7 correct, 4 rows at 0.75 with 3 correct
    p = np.array([[0.3, 0.7]] * 10 + [[0.75, 0.25]] * 4)
    y = np.array([1] * 7 + [0] * 3 + [0] * 3 + [1])
    assert cal.expected_calibration_error(y, p, n_bins=10) == pytest.approx(0.0, abs=1e-12)


def test_confidence_one_lands_in_the_top_bin_and_counts():
    p = np.array([[0.0, 1.0], [1.0, 0.0]])
    y = np.array([1, 1])  # one correct at confidence 1, one wrong at confidence 1
    assert cal.expected_calibration_error(y, p, n_bins=4) == pytest.approx(0.5)
    tab = cal.calibration_table(y, p, n_bins=4)
    assert tab["bin"].max() == 4 and tab["bin"].min() == 1


def test_ece_empty_is_nan_and_small_n_bins_refused():
    assert np.isnan(cal.expected_calibration_error(np.zeros(0, int), np.zeros((0, 2))))
    for bad in (1, 0, -3, 2.5, True):
        with pytest.raises(ValueError, match="n_bins"):
            cal.expected_calibration_error([0], [[0.6, 0.4]], n_bins=bad)


def test_ece_refuses_label_outside_columns_and_length_mismatch():
    with pytest.raises(ValueError, match=r"rows \[1\].*2 probability columns"):
        cal.expected_calibration_error([0, 2], [[0.6, 0.4], [0.5, 0.5]])
    with pytest.raises(ValueError, match="3 entries"):
        cal.expected_calibration_error([0, 1, 1], [[0.6, 0.4], [0.5, 0.5]])


@pytest.mark.parametrize("seed", SEEDS)
def test_ece_matches_an_independent_loop_over_bins(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 5))
    n = int(rng.integers(1, 300))
    n_bins = int(rng.integers(2, 20))
    p = softmax(rng.normal(size=(n, k)) * rng.uniform(0.1, 4), axis=1)
    # snap some confidences onto bin edges
    y = rng.integers(0, k, size=n)
    conf = p.max(axis=1)
    pred = p.argmax(axis=1)
    edges = np.linspace(0, 1, n_bins + 1)
    total = 0.0
    for b in range(n_bins):
        lo, hi = edges[b], edges[b + 1]
        inb = (conf > lo) & (conf <= hi) if b > 0 else (conf >= lo) & (conf <= hi)
        if inb.any():
            total += inb.sum() / n * abs((pred[inb] == y[inb]).mean() - conf[inb].mean())
    assert cal.expected_calibration_error(y, p, n_bins=n_bins) == pytest.approx(total, abs=1e-12)


# --------------------------------------------------------------------------- calibration table


def test_table_has_nonempty_bins_numbered_from_one_and_gap_sign():
    p = np.array([[0.95, 0.05], [0.85, 0.15], [0.1, 0.9]])
    y = np.array([0, 1, 1])
    tab = cal.calibration_table(y, p, classes=["a", "b"], n_bins=10)
    assert list(tab.columns) == list(cal.CALIBRATION_COLUMNS)
    assert (tab["n"] > 0).all()
    a = tab[tab.class_index == 0].set_index("bin")
    # class a: scores 0.95 (y!=a... y=0 -> a), 0.85 (y=1), 0.1 (y=1)
    assert set(a.index) == {10, 9, 1}
    assert a.loc[10, "observed_frequency"] == 1.0 and a.loc[9, "observed_frequency"] == 0.0
    np.testing.assert_allclose(tab["calibration_gap"], tab["observed_frequency"] - tab["mean_confidence"])
    assert a.loc[10, "class_name"] == "a"
    np.testing.assert_allclose(a.loc[9, ["bin_lower", "bin_upper"]].to_numpy(float), [0.8, 0.9])
    assert tab.groupby("class_index")["n"].sum().tolist() == [3, 3]


def test_empty_table_has_every_column():
    tab = cal.calibration_table(np.zeros(0, int), np.zeros((0, 3)))
    assert list(tab.columns) == list(cal.CALIBRATION_COLUMNS) and len(tab) == 0


def test_table_refusals():
    p = np.array([[0.6, 0.4], [0.5, 0.5], [0.2, 0.8]])
    with pytest.raises(ValueError, match=r"rows \[0, 2\].*2 probability columns"):
        cal.calibration_table([5, 1, -1], p)
    with pytest.raises(ValueError, match="3 class names given for 2"):
        cal.calibration_table([0, 1, 1], p, classes=["a", "b", "c"])
    default = cal.calibration_table([0, 1, 1], p, classes=[])
    assert set(default["class_name"]) == {"class_0", "class_1"}
    with pytest.raises(ValueError, match="n_bins"):
        cal.calibration_table([0, 1, 1], p, n_bins=1)


@pytest.mark.parametrize("seed", SEEDS)
def test_binary_table_equals_sklearn_calibration_curve(seed):
    rng = np.random.default_rng(seed)
    n_bins = int(rng.integers(2, 16))
    n = int(rng.integers(5, 400))
    # half the scores on a grid that hits the bin edges exactly
    p = np.where(rng.random(n) < 0.5, rng.integers(0, n_bins + 1, n) / n_bins, rng.random(n))
    y = (rng.random(n) < p).astype(int)
    y[:2] = [0, 1]
    tab = cal.calibration_table(y, p, n_bins=n_bins)
    pos = tab[tab.class_index == 1]
    prob_true, prob_pred = calibration_curve(y, p, n_bins=n_bins, strategy="uniform")
    np.testing.assert_allclose(pos["observed_frequency"].to_numpy(), prob_true, rtol=0, atol=1e-12)
    np.testing.assert_allclose(pos["mean_confidence"].to_numpy(), prob_pred, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_multiclass_one_vs_rest_equals_sklearn_per_class(seed):
    rng = np.random.default_rng(100 + seed)
    k = int(rng.integers(3, 6))
    n = int(rng.integers(20, 300))
    p = softmax(rng.normal(size=(n, k)) * 2, axis=1)
    y = rng.integers(0, k, size=n)
    y[:k] = np.arange(k)
    tab = cal.calibration_table(y, p, n_bins=7)
    for c in range(k):
        sub = tab[tab.class_index == c]
        pt, pp = calibration_curve((y == c).astype(int), p[:, c], n_bins=7)
        np.testing.assert_allclose(sub["observed_frequency"], pt, atol=1e-12)
        np.testing.assert_allclose(sub["mean_confidence"], pp, atol=1e-12)
        assert sub["n"].sum() == n


# --------------------------------------------------------------------------- scalar metrics


@pytest.mark.parametrize("seed", SEEDS)
def test_nll_and_brier_equal_sklearn(seed):
    rng = np.random.default_rng(200 + seed)
    k = int(rng.integers(2, 5))
    n = int(rng.integers(3, 100))
    p = softmax(rng.normal(size=(n, k)) * 3, axis=1)
    y = rng.integers(0, k, size=n)
    labels = list(range(k))
    assert cal.negative_log_likelihood(y, p) == pytest.approx(log_loss(y, p, labels=labels), rel=1e-12)
    # oracle available on every supported scikit-learn (>= 1.5): the multiclass Brier is the sum
    # over classes of the binary one-vs-rest Brier scores
    ovr = sum(brier_score_loss((y == c).astype(int), p[:, c], pos_label=1) for c in range(k))
    assert cal.multiclass_brier(y, p) == pytest.approx(ovr, rel=1e-12)
    if "scale_by_half" in inspect.signature(brier_score_loss).parameters:  # scikit-learn >= 1.7
        brier = brier_score_loss(y, p, labels=labels, scale_by_half=False) if k > 2 else \
            brier_score_loss(y, p[:, 1], scale_by_half=False)
        assert cal.multiclass_brier(y, p) == pytest.approx(brier, rel=1e-12)


def test_nll_uses_every_class_column_even_when_a_class_is_absent():
    p = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]])
    y = np.array([0, 1])  # class 2 absent
    assert cal.negative_log_likelihood(y, p) == pytest.approx(log_loss(y, p, labels=[0, 1, 2]))


def test_confusion_counts_and_zero_support_rows():
    y = np.array([0, 0, 1, 1, 1])
    pred = np.array([0, 2, 1, 1, 0])
    cm = cal.confusion_counts(y, pred, 3)
    np.testing.assert_array_equal(cm, [[1, 0, 1], [1, 2, 0], [0, 0, 0]])
    assert cm.sum() == 5
    norm = cal.confusion_counts(y, pred, 3, normalize=True)
    np.testing.assert_allclose(norm.sum(axis=1), [1, 1, 0])


# --------------------------------------------------------------------------- temperature


def _sample(rng, z, t):
    p = softmax(z / t, axis=1)
    u = rng.random(len(z))[:, None]
    return (u > np.cumsum(p, axis=1)).sum(axis=1)


@pytest.mark.parametrize("true_t", [0.4, 1.0, 2.5, 6.0])
def test_temperature_recovers_a_known_temperature(true_t):
    rng = np.random.default_rng(7)
    z = rng.normal(size=(20000, 3)) * 4
    y = _sample(rng, z, true_t)
    t = cal.fit_temperature(y, z)
    assert t == pytest.approx(true_t, rel=0.06)
    assert cal.TEMPERATURE_BOUNDS[0] <= t <= cal.TEMPERATURE_BOUNDS[1]


def test_temperature_stays_within_bounds_at_the_extremes():
    z = np.array([[0.0, 1.0], [1.0, 0.0]] * 20)
    perfect = np.array([1, 0] * 20)
    inverse = 1 - perfect
    lo, hi = cal.TEMPERATURE_BOUNDS
    assert lo <= cal.fit_temperature(perfect, z) <= lo * 1.01
    t_inv = cal.fit_temperature(inverse, z)  # anti-informative: wants T -> infinity
    assert hi * 0.99 <= t_inv <= hi


def test_temperature_refusals():
    with pytest.raises(ValueError, match="at least 2 rows"):
        cal.fit_temperature([0], [[0.0, 1.0]])
    with pytest.raises(ValueError, match="2 distinct labels"):
        cal.fit_temperature([1, 1, 1], [[0.0, 1.0], [0.0, 2.0], [0.0, -1.0]])
    with pytest.raises(ValueError, match="finite"):
        cal.fit_temperature([0, 1], [[0.0, np.nan], [0.0, 1.0]])
    with pytest.raises(ValueError, match="temperature must be finite and positive"):
        cal.apply_temperature([[0.0, 1.0]], 0.0)


def test_temperature_reduces_nll_of_a_miscalibrated_probe_and_keeps_argmax():
    rng = np.random.default_rng(11)
    z_true = rng.normal(size=(4000, 4)) * 1.5
    y = _sample(rng, z_true, 1.0)
    overconfident = z_true * 5.0
    val, test = slice(0, 2000), slice(2000, None)
    t = cal.fit_temperature(y[val], overconfident[val])
    assert t == pytest.approx(5.0, rel=0.15)
    raw = cal.decision_to_probabilities(overconfident[test])
    scaled = cal.apply_temperature(overconfident[test], t)
    assert cal.negative_log_likelihood(y[test], scaled) < cal.negative_log_likelihood(y[test], raw)
    assert cal.expected_calibration_error(y[test], scaled) < cal.expected_calibration_error(y[test], raw)
    np.testing.assert_array_equal(raw.argmax(axis=1), scaled.argmax(axis=1))
    assert balanced_accuracy_score(y[test], raw.argmax(1)) == balanced_accuracy_score(y[test], scaled.argmax(1))


def test_temperature_objective_is_sklearn_log_loss_at_the_optimum():
    rng = np.random.default_rng(3)
    z = rng.normal(size=(500, 3)) * 3
    y = _sample(rng, z, 2.0)
    t = cal.fit_temperature(y, z)
    best = log_loss(y, softmax(z / t, axis=1), labels=[0, 1, 2])
    for other in (t * 0.9, t * 1.1, 1.0):
        assert best <= log_loss(y, softmax(z / other, axis=1), labels=[0, 1, 2]) + 1e-9


def test_fit_uses_only_the_rows_it_is_given():
    rng = np.random.default_rng(5)
    z = rng.normal(size=(300, 2)) * 2
    y = _sample(rng, z, 1.7)
    t1 = cal.fit_temperature(y[:200], z[:200])
    z2 = z.copy()
    z2[200:] = rng.normal(size=(100, 2)) * 50  # perturb rows that are not passed
    assert cal.fit_temperature(y[:200], z2[:200]) == t1
