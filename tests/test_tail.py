"""Tail summaries (spec/metrics.md §8.1, §11 tests 62–72).

Pins ``cachescore.metrics.tail`` against ``croma.metrics.tail`` on random inputs (bit-identical:
same percentile and mean on the same finite values), the properties croma's suite pins, and the
tail fields of CRoMa results.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from croma.metrics import tail as croma_tail

from cachescore.metrics.croma import CRoMa
from cachescore.metrics.tail import compute_tail_metrics, confounder_dominant_fraction
from cachescore.types import TailMetrics


def _as_tuple(t):
    return tuple(np.nan_to_num(np.asarray(getattr(t, f.name), dtype=float), nan=-999.0) for f in dataclasses.fields(t))


@pytest.mark.parametrize("seed", range(10))
def test_matches_croma_tail_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(int(rng.integers(0, 300)))
    if values.size:
        values[rng.random(values.size) < 0.1] = np.nan
        values[rng.random(values.size) < 0.05] = np.inf
    for alpha in (0.0, 0.05, 0.1, 0.25, 0.5, 1.0):
        assert _as_tuple(compute_tail_metrics(values, alpha)) == _as_tuple(croma_tail.compute_tail_metrics(values, alpha))


@pytest.fixture
def values():
    return np.random.default_rng(7).standard_normal(500)


def test_ltm_q_and_tail_size_are_non_decreasing_in_alpha(values):
    out = [compute_tail_metrics(values, a) for a in np.linspace(0.01, 1.0, 25)]
    for a, b in zip(out, out[1:]):
        assert b.ltm_alpha >= a.ltm_alpha and b.q_alpha >= a.q_alpha and b.n_tail_samples >= a.n_tail_samples


def test_ltm_at_alpha_one_is_the_mean_of_the_finite_values(values):
    padded = np.concatenate([values, [np.nan, -np.inf]])
    assert compute_tail_metrics(padded, 1.0).ltm_alpha == pytest.approx(values.mean(), abs=1e-15)


@pytest.mark.parametrize("alpha", [0.05, 0.10, 0.25, 0.50])
def test_ltm_at_most_q_at_most_median(values, alpha):
    t = compute_tail_metrics(values, alpha)
    assert t.ltm_alpha <= t.q_alpha <= np.median(values)


@pytest.mark.parametrize("alpha", [0.05, 0.10, 0.25])
def test_tail_holds_about_the_worst_alpha_fraction(values, alpha):
    t = compute_tail_metrics(values, alpha)
    assert abs(t.n_tail_samples - alpha * values.size) <= 1
    assert values.min() <= t.q_alpha < values.max()


def test_all_equal_collapses_the_tail():
    t = compute_tail_metrics(np.full(9, 0.3), 0.1)
    assert t.q_alpha == t.ltm_alpha == 0.3 and t.n_tail_samples == 9


@pytest.mark.parametrize("values", [np.array([]), np.array([np.nan, np.nan])])
def test_empty_and_all_nan(values):
    assert dataclasses.astuple(compute_tail_metrics(values, 0.2))[::3] == (0.2, 0)
    t = compute_tail_metrics(values, 0.2)
    assert np.isnan(t.q_alpha) and np.isnan(t.ltm_alpha)


def test_non_finite_values_are_dropped_not_ranked(values):
    padded = np.concatenate([[np.nan, np.inf], values, [-np.inf]])
    assert compute_tail_metrics(padded, 0.1) == compute_tail_metrics(values, 0.1)


def test_frozen_and_alpha_out_of_range():
    t = compute_tail_metrics([1.0, 2.0], 0.1)
    assert isinstance(t, TailMetrics)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.alpha = 0.2  # type: ignore[misc]
    with pytest.raises(ValueError):
        compute_tail_metrics([1.0, 2.0], 1.5)


def test_confounder_dominant_fraction_closed_boundary():
    assert confounder_dominant_fraction([-0.5, 0.0, 0.25, np.nan]) == 2 / 3
    assert np.isnan(confounder_dominant_fraction([np.nan])) and np.isnan(confounder_dominant_fraction([]))


def _gaussian_case():
    rng = np.random.default_rng(20260727)
    x = rng.standard_normal((200, 16))
    cells = [("A", "V1"), ("A", "V2"), ("B", "V1"), ("B", "V2")]
    df = pd.DataFrame(
        {
            "sample_id": [f"s{i}" for i in range(200)],
            "image_path": [f"/t/{i}" for i in range(200)],
            "label": [cells[i % 4][0] for i in range(200)],
            "scanner_vendor": [cells[i % 4][1] for i in range(200)],
            "group_id": [f"slide-{i}" for i in range(200)],
        }
    )
    return x, df


@pytest.mark.parametrize("alpha", [0.10, 0.25])
def test_croma_result_tail_fields_satisfy_the_ordering(alpha):
    x, df = _gaussian_case()
    r = CRoMa.compute(x, df, confounder_column="scanner_vendor", alpha=alpha)
    assert r.alpha == alpha
    assert r.ltm_alpha <= r.q_alpha <= np.median(r.sample_values)
    t = compute_tail_metrics(r.sample_values, alpha)
    assert (r.q_alpha, r.ltm_alpha) == (t.q_alpha, t.ltm_alpha)
    assert r.f0 == np.mean(r.sample_values <= 0)


def test_croma_result_ltm_is_non_decreasing_in_alpha():
    x, df = _gaussian_case()
    out = CRoMa.compute(x, df, confounder_column="scanner_vendor", m=[3])[3]
    ltms = [compute_tail_metrics(out.sample_values, a).ltm_alpha for a in (0.05, 0.1, 0.25, 0.5)]
    assert ltms == sorted(ltms)
