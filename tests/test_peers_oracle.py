"""benchmarks/peers.py's sample oracles agree with the product's exact engines.

The peers benchmark scores every contender (ours and faiss / hnswlib) against exact answers of a
query sample computed by the script itself; these tests pin those answers to the exact engines
(:func:`~cachescore.neighbors.exact.cross_group_knn`, :func:`~cachescore.neighbors.typed.typed_knn`)
on random scopes, so a wrong oracle cannot flatter or punish a contender. faiss and hnswlib are
not needed (the script imports them only to run).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from cachescore.neighbors.exact import cross_group_knn
from cachescore.neighbors.normalize import normalize_rows
from cachescore.neighbors.recall import distance_tol
from cachescore.neighbors.typed import typed_knn

_SPEC = importlib.util.spec_from_file_location("peers_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py")
peers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(peers)


def _scope(seed, n=700, d=24, slides=40, spans=False):
    rng = np.random.default_rng(seed)
    u = normalize_rows(rng.normal(size=(n, d)) + 0.6 * rng.normal(size=(5, d))[rng.integers(0, 5, n)]).astype(np.float32)
    groups = rng.integers(0, slides, n)
    if spans:  # slides with rows in several cells: the typed oracle must exclude same-slide rows
        labels, conf = rng.integers(0, 2, n), rng.integers(0, 3, n)
    else:  # one label and one confounder per slide, as make_scale_cache writes them
        labels, conf = rng.integers(0, 2, slides)[groups], rng.integers(0, 3, slides)[groups]
    return u, (groups.astype(np.int64), labels.astype(np.int64), conf.astype(np.int64))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spans", [False, True])
def test_typed_truth_equals_typed_knn(seed, spans):
    u, codes = _scope(seed, spans=spans)
    groups, labels, conf = codes
    sample = np.sort(np.random.default_rng(seed + 10).choice(u.shape[0], 90, replace=False))
    so, os_ = typed_knn(u, labels, conf, groups, 4)
    t_so, t_os = peers.typed_truth(u, codes, sample, 4, block=128)  # several target blocks
    tol = distance_tol(np.float32, u.shape[1])
    for got, want in ((t_so, so[sample]), (t_os, os_[sample])):
        assert np.array_equal(np.isinf(got), np.isinf(want))
        fin = np.isfinite(want)
        assert np.abs(got[fin] - want[fin]).max() <= tol
    assert peers.typed_recall((so[sample], os_[sample]), (t_so, t_os), tol) == 1.0
    # a table missing its nearest SO distance loses exactly those hits
    worse = np.sort(np.where(np.arange(4) == 0, 2.0, so[sample]), axis=1)
    expect = 1.0 - np.isfinite(so[sample][:, 0]).sum() / (np.isfinite(so[sample]).sum() + np.isfinite(os_[sample]).sum())
    assert peers.typed_recall((worse, os_[sample]), (t_so, t_os), tol) == pytest.approx(expect)


@pytest.mark.parametrize("seed", range(3))
def test_cross_sample_truth_equals_cross_group_knn(seed):
    u, (groups, _, _) = _scope(seed)
    sample = np.arange(0, u.shape[0], 7)
    idx, _ = cross_group_knn(u, groups, 6)
    truth = peers.sample_truth(u, groups, sample, 6)
    assert peers.recall(idx[sample], truth) == 1.0
    assert peers.recall(np.where(np.arange(6) == 5, -1, idx[sample]), truth) == pytest.approx(5 / 6)
