"""Cluster bootstrap utilities (spec/metrics.md §8.2, §11 tests 93–106).

Pins ``cachescore.metrics.bootstrap`` against ``croma.metrics.bootstrap`` (same PCG64 stream, so
the same replicates): pooled-median and paired-delta CIs are bit-identical (medians are exact
order statistics); rank stability is identical field by field; Spearman CIs agree to 1e-12 (our
replicate correlations are vectorised, croma calls ``scipy.stats.spearmanr`` per replicate, so
the last bits of each replicate may differ). Also the pinned behaviours of croma's suite.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from croma.metrics import bootstrap as ref

from cachescore.metrics import bootstrap as ours
from cachescore.types import BootstrapCI, RankStability


def _ci(ci):
    return tuple(getattr(ci, f) for f in ("point", "lo", "hi", "level", "n_boot"))


def _same_ci(a, b, atol=0.0):
    ta, tb = _ci(a), _ci(b)
    assert ta[3:] == tb[3:]
    np.testing.assert_allclose(np.asarray(ta[:3], float), np.asarray(tb[:3], float), rtol=0, atol=atol)


def _case(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 160))
    values = rng.standard_normal(n)
    values[rng.random(n) < 0.1] = np.nan
    ids = rng.integers(0, max(1, n // int(rng.integers(1, 8))), n)
    clusters = ids.astype(str) if seed % 2 else ids
    return rng, values, clusters


@pytest.mark.parametrize("seed", range(12))
def test_pooled_median_matches_croma(seed):
    rng, values, clusters = _case(seed)
    kw = dict(n_boot=int(rng.integers(1, 400)), level=float(rng.choice([0.5, 0.9, 0.95])), seed=seed)
    _same_ci(ours.bootstrap_pooled_median(values, clusters, **kw), ref.bootstrap_pooled_median(values, clusters, **kw))


@pytest.mark.parametrize("seed", range(12))
def test_paired_delta_matches_croma(seed):
    rng, values, clusters = _case(seed)
    canonical = np.nan_to_num(values, nan=0.25)
    alternative = canonical + 0.3 * rng.standard_normal(canonical.size)
    subsets = None if seed % 3 == 0 else np.asarray([f"p{v}" for v in rng.integers(0, 4, canonical.size)])
    kw = dict(subset_ids=subsets, n_boot=int(rng.integers(1, 300)), level=0.9, seed=seed)
    _same_ci(
        ours.paired_cluster_bootstrap_delta(canonical, alternative, clusters, **kw),
        ref.paired_cluster_bootstrap_delta(canonical, alternative, clusters, **kw),
    )


@pytest.mark.parametrize("seed", range(8))
def test_rank_stability_matches_croma(seed):
    rng, values, clusters = _case(seed)
    models = {f"m{j}": values + 0.2 * j * rng.standard_normal(values.size) for j in range(int(rng.integers(1, 5)))}
    if seed % 4 == 1:
        models["all_nan"] = np.full(values.size, np.nan)
    kw = dict(n_boot=int(rng.integers(1, 300)), level=0.9, seed=seed)
    a, b = ours.paired_rank_stability(models, clusters, **kw), ref.paired_rank_stability(models, clusters, **kw)
    assert isinstance(a, RankStability)
    assert list(a.models) == list(b.models) and a.n_boot == b.n_boot
    np.testing.assert_array_equal([a.point_value[m] for m in b.models], [b.point_value[m] for m in b.models])
    for name in ("point_rank", "mean_rank", "rank_lo", "rank_hi", "pairwise_win"):
        assert getattr(a, name) == getattr(b, name), name
    for m in b.models:
        _same_ci(a.value_ci[m], b.value_ci[m])


@pytest.mark.parametrize("seed", range(8))
def test_spearman_matches_croma(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 25))
    x = rng.standard_normal(n)
    y = x * rng.uniform(-1, 1) + rng.standard_normal(n)
    if seed % 2:
        x = np.round(x)  # ties and degenerate replicates
        x[0] = np.nan
    kw = dict(n_boot=int(rng.integers(1, 300)), level=0.95, seed=seed)
    _same_ci(ours.bootstrap_spearman(x, y, **kw), ref.bootstrap_spearman(x, y, **kw), atol=1e-12)


def test_pinned_shared_group_delta():
    got = ours.paired_cluster_bootstrap_delta(np.array([0.0, 0.0]), np.array([1.0, 3.0]), np.array(["a", "b"]), n_boot=4, level=0.5, seed=0)
    assert got == BootstrapCI(point=2.0, lo=1.0, hi=2.25, level=0.5, n_boot=4)


def test_delta_preserves_subset_balancing():
    canonical = np.zeros(4)
    alternative = np.array([0.0, 10.0, 10.0, 10.0])
    got = ours.paired_cluster_bootstrap_delta(canonical, alternative, np.array(["a", "b", "c", "d"]), subset_ids=np.array(["s1", "s1", "s2", "s2"]), n_boot=10)
    assert got.point == 7.5  # median(median(0, 10), median(10, 10))
    got = ours.paired_cluster_bootstrap_delta(np.zeros(3), np.array([0.0, 10.0, 10.0]), np.array(["a", "b", "c"]), subset_ids=np.array(["s1", "s2", "s2"]), n_boot=4)
    assert got.point == 5.0


def test_pooled_median_properties():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(300)
    values[::17] = np.nan
    clusters = np.repeat(np.arange(30), 10)
    ci = ours.bootstrap_pooled_median(values, clusters, n_boot=300)
    assert ci.lo <= ci.point <= ci.hi and ci.point == np.nanmedian(values)
    assert ci == ours.bootstrap_pooled_median(values, clusters, n_boot=300)
    # clustering (correlated rows) widens the interval compared with singletons
    shared = np.repeat(rng.standard_normal(30), 10)
    wide = ours.bootstrap_pooled_median(shared, clusters, n_boot=300)
    narrow = ours.bootstrap_pooled_median(shared, np.arange(300), n_boot=300)
    assert wide.hi - wide.lo > narrow.hi - narrow.lo
    with pytest.raises(dataclasses.FrozenInstanceError):
        ci.lo = 0.0  # type: ignore[misc]
    empty = ours.bootstrap_pooled_median(np.array([]), np.array([]))
    assert np.isnan(empty.point) and empty.n_boot == 0


def test_rank_stability_separated_and_tied_models():
    rng = np.random.default_rng(1)
    clusters = np.repeat(np.arange(20), 5)
    base = rng.standard_normal(100) * 0.01
    rs = ours.paired_rank_stability({"low": base, "high": base + 10, "mid": base + 5}, clusters, n_boot=200)
    assert rs.point_rank == {"high": 1, "mid": 2, "low": 3}
    assert rs.mean_rank["high"] == 1.0 and rs.pairwise_win[("high", "low")] == 1.0 and rs.pairwise_win[("low", "high")] == 0.0
    assert set(rs.value_ci) == {"low", "high", "mid"}
    tied = ours.paired_rank_stability({"a": base, "b": base[::-1].copy()}, clusters, n_boot=200)
    want = ref.paired_rank_stability({"a": base, "b": base[::-1].copy()}, clusters, n_boot=200)
    assert tied.pairwise_win == want.pairwise_win
    assert 0.0 < tied.pairwise_win[("a", "b")] < 1.0 and 0.0 < tied.pairwise_win[("b", "a")] < 1.0


def test_spearman_extremes_and_small_inputs():
    x = np.arange(10.0)
    assert ours.bootstrap_spearman(x, 2 * x, n_boot=100).point == pytest.approx(1.0, abs=1e-12)
    assert ours.bootstrap_spearman(x, 2 * x, n_boot=100).hi == 1.0
    assert ours.bootstrap_spearman(x, -x, n_boot=100).point == pytest.approx(-1.0, abs=1e-12)
    small = ours.bootstrap_spearman([1.0, 2.0], [2.0, 1.0])
    assert np.isnan(small.point) and small.n_boot == 0
    rng = np.random.default_rng(4)
    y = x + rng.standard_normal(10) * 3
    ci = ours.bootstrap_spearman(x, y, n_boot=300)
    assert -1 <= ci.lo <= ci.point <= ci.hi <= 1


def test_errors():
    with pytest.raises(ValueError, match="same length"):
        ours.bootstrap_pooled_median(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match="one-dimensional"):
        ours.paired_cluster_bootstrap_delta(np.zeros((2, 2)), np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError, match="same length"):
        ours.paired_cluster_bootstrap_delta(np.zeros(3), np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError, match="subset_ids"):
        ours.paired_cluster_bootstrap_delta(np.zeros(2), np.zeros(2), np.zeros(2), subset_ids=np.zeros(3))
    with pytest.raises(ValueError, match="finite"):
        ours.paired_cluster_bootstrap_delta(np.array([0.0, np.nan]), np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError, match="independence group"):
        ours.paired_cluster_bootstrap_delta(np.zeros(0), np.zeros(0), np.zeros(0))
    with pytest.raises(ValueError, match="non-empty"):
        ours.paired_rank_stability({}, np.zeros(2))
    with pytest.raises(ValueError):
        ours.paired_rank_stability({"a": np.zeros(2), "b": np.zeros(3)}, np.zeros(2))
    with pytest.raises(ValueError):
        ours.paired_rank_stability({"a": np.zeros(2)}, np.zeros(3))
    with pytest.raises(ValueError, match="same shape"):
        ours.bootstrap_spearman(np.zeros(3), np.zeros(4))


def test_counts_drawn_in_blocks_equal_one_draw():
    """Issue 26: the (replicates x clusters) counts are drawn a block of replicates at a time, so
    a view of 10^4+ slides never holds the whole pick matrix; the stream and the counts are those
    of one draw (croma's rule)."""
    from cachescore.metrics import bootstrap as b

    for k in (1, 5, 300, 4099):
        for n_boot in (1, 7, b._REPLICATE_BLOCK, b._REPLICATE_BLOCK + 1, 2000):
            whole = b._multiplicities(b._draw(np.random.default_rng(3), n_boot, k), k)
            np.testing.assert_array_equal(b._drawn_multiplicities(np.random.default_rng(3), n_boot, k), whole)
