"""Pins the ANN neighbour backend (``cachescore.neighbors.ann``), its registry and numba set-up.

What is pinned, and against which oracle:

* the brute-force paths (recall audit, small scopes) equal a full-matrix reference on n <= 2000
  (and the exact engines ``neighbors.exact`` / ``neighbors.typed`` where they exist);
* the ANN searches return the exact contracts: shapes, dtypes, (-1, +inf) padding, (distance,
  index) order, no row of the query's own group, and distances equal to an exact recomputation;
* recall >= 0.99 against exact search on clustered data (labels x confounders x slides with
  per-slide offsets) for the cross-group and the typed search, measured on *all* rows, not on the
  backend's own audit sample;
* same ``random_state`` -> identical output;
* :func:`measure_recall` counts exactly the neighbours a perturbed table lost;
* the default ``method="ivf"`` (k-means partition, probed clusters searched exactly by GEMM):
  recall >= 0.99 on every row against the exact engines, the recall it reports equals an
  independent :func:`measure_recall` on the same rows, fallback to the exact engines, the packed
  uint64 merge equals the three-key lexsort merge (ties included), and CRoMa computed through
  ``typed_knn_ann`` equals CRoMa through the exact typed engine (regression: a contiguous
  target-row slice used to run past its cell, IndexError).

Near ties: two kernels (GEMM here, a batched dot product in the refinement) may give one pair
distances that differ by a few ulps (spec/metrics.md §12.3). Comparisons therefore allow an
index swap only between neighbours whose distances are within ``distance_tol(dtype, d)`` (= sqrt(d)·eps, see its docstring for the measured maxima) of each other, and
assert distances within that tolerance.

Tests that build pynndescent graphs (``method="graph"``) are ``slow``: numba compiles pynndescent for ~100 s in every
fresh process (most of its kernels are not cacheable).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from cachescore.neighbors import ann, recall, topk
from cachescore.neighbors.normalize import cosine_distance_block, normalize_rows
from cachescore.neighbors.registry import (
    DEFAULT_AUTO_THRESHOLD,
    choose_backend,
    in_memory_searcher,
)

from cachescore.neighbors.exact import cross_group_knn as _exact_cross_group_knn
from cachescore.neighbors.typed import typed_knn
from blas_equality import assert_same_neighbours


def clustered(n, d, *, seed=0, dtype=np.float32, n_labels=2, n_conf=4, smin=20, smax=100):
    """Rows of realistic structure: label + confounder + per-slide offset + tile noise.

    Slides (groups) of ``smin..smax`` tiles, each slide in one (label, confounder) cell.
    Returns (u, labels, confounders, groups) with ``u`` doubly normalised in ``dtype``.
    """
    rng = np.random.default_rng(seed)
    sizes = []
    while sum(sizes) < n:
        sizes.append(int(rng.integers(smin, smax + 1)))
    sizes[-1] -= sum(sizes) - n
    n_groups = len(sizes)
    groups = np.repeat(np.arange(n_groups), sizes)
    labels = rng.integers(0, n_labels, n_groups)[groups]
    conf = rng.integers(0, n_conf, n_groups)[groups]
    x = (
        rng.standard_normal((n_labels, d))[labels]
        + 0.8 * rng.standard_normal((n_conf, d))[conf]
        + 0.7 * rng.standard_normal((n_groups, d))[groups]
        + rng.standard_normal((n, d))
    )
    return normalize_rows(x.astype(dtype)), labels, conf, groups


def reference_knn(u, groups, kmax):
    """Full-matrix reference (n <= 2000): kmax nearest other-group rows by (distance, index)."""
    d = cosine_distance_block(u, u).astype(np.float64)
    d[groups[:, None] == groups[None, :]] = np.inf
    n = u.shape[0]
    cols = np.broadcast_to(np.arange(n), d.shape)
    order = np.lexsort((cols, d), axis=1)[:, :kmax]
    dist = np.take_along_axis(d, order, 1)
    idx = np.where(np.isfinite(dist), order, -1)
    pad = max(0, kmax - n)
    return (
        np.pad(idx, ((0, 0), (0, pad)), constant_values=-1),
        np.pad(dist, ((0, 0), (0, pad)), constant_values=np.inf),
    )


def reference_typed(u, labels, conf, groups, m):
    d = cosine_distance_block(u, u).astype(np.float64)
    d[groups[:, None] == groups[None, :]] = np.inf
    so = (labels[:, None] == labels[None, :]) & (conf[:, None] != conf[None, :])
    os_ = (labels[:, None] != labels[None, :]) & (conf[:, None] == conf[None, :])
    out = []
    for mask in (so, os_):
        v = np.sort(np.where(mask, d, np.inf), axis=1)[:, :m]
        out.append(np.pad(v, ((0, 0), (0, max(0, m - v.shape[1]))), constant_values=np.inf))
    return tuple(out)


def exact_oracle(u, groups, kmax):
    return _exact_cross_group_knn(u, groups, kmax)


def full_recall(dist, ref_dist, tol):
    hits, total = recall.recall_counts(dist, ref_dist, tol)
    return hits / total


def check_contract(u, groups, idx, dist, kmax):
    n = u.shape[0]
    assert idx.shape == (n, kmax) and dist.shape == (n, kmax)
    assert idx.dtype == np.int64 and dist.dtype == np.float64
    valid = idx >= 0
    np.testing.assert_array_equal(valid, np.isfinite(dist))
    rows = np.broadcast_to(np.arange(n)[:, None], idx.shape)
    # group exclusion (self included) is never violated
    assert not np.any(groups[idx[valid]] == groups[rows[valid]])
    # ordered by (distance, index), padding last
    d = np.where(valid, dist, np.inf)
    i = np.where(valid, idx, np.iinfo(np.int64).max)
    ok = (d[:, 1:] > d[:, :-1]) | ((d[:, 1:] == d[:, :-1]) & (i[:, 1:] > i[:, :-1])) | ~valid[:, 1:]
    assert ok.all()
    # no duplicates per row
    s = np.sort(np.where(valid, idx, -np.arange(1, kmax + 1)), axis=1)
    assert not np.any(s[:, 1:] == s[:, :-1])
    # distances are the exact cosine distances of the rows returned (u's dtype, clipped)
    r, c = np.nonzero(valid)
    rec = np.clip(1 - np.einsum("ij,ij->i", u[r].astype(np.float64), u[idx[r, c]].astype(np.float64)), 0, 2)
    tol = ann.distance_tol(u.dtype, u.shape[1])
    np.testing.assert_allclose(dist[r, c], rec, rtol=0, atol=tol)


# ------------------------------------------------------------------------------------------
# fast: kernels and brute-force paths


def test_topk_orders_by_distance_then_index_under_ties():
    rng = np.random.default_rng(3)
    for w, k in ((7, 3), (50, 5), (200, 10)):
        dist = rng.integers(0, 4, (40, w)).astype(np.float64)  # many exact ties
        dist[rng.random((40, w)) < 0.2] = np.inf
        idx = np.stack([rng.permutation(1000)[:w] for _ in range(40)])
        got_i, got_d = topk.topk(dist, idx, k)
        order = np.lexsort((idx, dist), axis=1)[:, :k]
        exp_d = np.take_along_axis(dist, order, 1)
        exp_i = np.where(np.isfinite(exp_d), np.take_along_axis(idx, order, 1), -1)
        np.testing.assert_array_equal(got_d, exp_d)
        np.testing.assert_array_equal(got_i, exp_i)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(3))
def test_exact_rows_match_full_matrix_reference(dtype, seed):
    u, _, _, groups = clustered(1500, 48, seed=seed, dtype=dtype, smin=5, smax=40)
    ref_i, ref_d = reference_knn(u, groups, 30)
    rows = np.arange(u.shape[0])
    idx, dist = ann._brute(u, groups, rows, rows, 30, block=512)  # block edges inside the scope
    assert_same_neighbours(idx, dist, ref_i, ref_d, ann.distance_tol(dtype, u.shape[1]))
    sub = np.array([0, 7, 499, 1499])
    si, sd = ann.exact_knn_rows(u, groups, sub, 30)
    np.testing.assert_array_equal(si, idx[sub])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exact_rows_match_exact_engine(dtype):
    u, _, _, groups = clustered(1800, 64, seed=5, dtype=dtype)
    e_i, e_d = _exact_cross_group_knn(u, groups, 50)
    idx, dist = ann.exact_knn_rows(u, groups, np.arange(u.shape[0]), 50)
    assert_same_neighbours(idx, dist, e_i, e_d, ann.distance_tol(dtype, u.shape[1]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_scope_is_exact_and_keeps_contract(dtype):
    u, _, _, groups = clustered(900, 32, seed=1, dtype=dtype, smin=3, smax=30)
    r = ann.cross_group_knn_ann_with_recall(u, groups, 40, random_state=0)
    assert r.exact and r.recall == 1.0
    check_contract(u, groups, r.idx, r.dist, 40)
    ref_i, ref_d = reference_knn(u, groups, 40)
    assert_same_neighbours(r.idx, r.dist, ref_i, ref_d, ann.distance_tol(dtype, u.shape[1]))
    idx, dist = ann.cross_group_knn_ann(u, groups, 40, random_state=0, block_rows=128, block_cols=300)
    np.testing.assert_array_equal(idx, r.idx)  # tile edges do not change the answer


def test_padding_when_fewer_eligible_rows_than_kmax():
    u, _, _, _ = clustered(60, 8, seed=2)
    groups = np.repeat(np.arange(3), 20)
    idx, dist = ann.cross_group_knn_ann(u, groups, 50, random_state=0)
    assert (idx[:, :40] >= 0).all() and (idx[:, 40:] == -1).all() and np.isinf(dist[:, 40:]).all()
    one_i, one_d = ann.cross_group_knn_ann(u[:1], groups[:1], 3)
    assert (one_i == -1).all() and np.isinf(one_d).all()


def test_refine_drops_duplicates_self_and_same_group_and_recomputes():
    u, _, _, groups = clustered(400, 16, seed=4, dtype=np.float64, smin=10, smax=10)
    rows = np.arange(400)
    rng = np.random.default_rng(0)
    cand = rng.integers(-1, 400, (400, 60))
    cand[:, :5] = rows[:, None]  # self, five times
    cand[:, 5:10] = cand[:, 10:15]  # duplicates
    idx, dist = ann._refine(u, groups, rows, cand, 20)
    check_contract(u, groups, idx, dist, 20)
    for i in (0, 123, 399):  # the top-20 of the eligible candidate set, recomputed
        c = np.unique(cand[i][(cand[i] >= 0)])
        c = c[groups[c] != groups[i]]
        d = np.clip(1 - u[c] @ u[i], 0, 2)
        o = np.lexsort((c, d))[:20]
        np.testing.assert_array_equal(idx[i, : o.size], c[o])
        np.testing.assert_allclose(dist[i, : o.size], d[o], rtol=0, atol=ann.distance_tol(u.dtype, 16))


@pytest.mark.parametrize("seed", range(3))
def test_typed_small_cells_match_typed_engine_and_reference(seed):
    u, labels, conf, groups = clustered(1600, 40, seed=seed, smin=5, smax=60)
    r = ann.typed_knn_ann_with_recall(u, labels, conf, groups, 7, random_state=0)
    assert r.exact_cells == r.n_cells and r.recall == 1.0
    so, os_ = typed_knn(u, labels, conf, groups, 7)
    tol = ann.distance_tol(u.dtype, u.shape[1])
    ref = reference_typed(u, labels, conf, groups, 7)
    for got, exp, exp2 in ((r.so_dist, so, ref[0]), (r.os_dist, os_, ref[1])):
        assert got.shape == (1600, 7) and got.dtype == np.float64
        np.testing.assert_array_equal(np.isinf(got), np.isinf(exp))
        fin = np.isfinite(exp)
        np.testing.assert_allclose(got[fin], exp[fin], rtol=0, atol=tol)
        np.testing.assert_allclose(got[fin], exp2[fin], rtol=0, atol=tol)


def test_exact_typed_rows_match_reference():
    u, labels, conf, groups = clustered(1000, 24, seed=9, dtype=np.float64, smin=5, smax=50)
    rows = np.arange(0, 1000, 3)
    (si, sd), (oi, od) = ann.exact_typed_rows(u, labels, conf, groups, rows, 5, block=256)
    ref_so, ref_os = reference_typed(u, labels, conf, groups, 5)
    tol = ann.distance_tol(u.dtype, u.shape[1])
    np.testing.assert_allclose(sd, ref_so[rows], rtol=0, atol=tol)
    np.testing.assert_allclose(od, ref_os[rows], rtol=0, atol=tol)
    v = si >= 0
    r = np.broadcast_to(rows[:, None], si.shape)
    assert (labels[si[v]] == labels[r[v]]).all() and (conf[si[v]] != conf[r[v]]).all()
    assert (groups[si[v]] != groups[r[v]]).all()


def test_measure_recall_counts_lost_neighbours():
    u, _, _, groups = clustered(1200, 32, seed=6, smin=5, smax=30)
    idx, dist = ann.exact_knn_rows(u, groups, np.arange(1200), 20)
    assert ann.measure_recall(u, groups, idx, n_queries=1200) == 1.0
    # drop the nearest neighbour of every row and append the 21st: exactly 1/20 is lost
    far_i, _ = ann.exact_knn_rows(u, groups, np.arange(1200), 21)
    worse = np.concatenate([idx[:, 1:], far_i[:, 20:21]], axis=1)
    assert ann.measure_recall(u, groups, worse, n_queries=1200) == pytest.approx(19 / 20)
    # padding is a miss, never a hit
    pad = idx.copy()
    pad[:, 10:] = -1
    assert ann.measure_recall(u, groups, pad, n_queries=500, random_state=1) == pytest.approx(0.5)


def test_measure_typed_recall_counts_lost_neighbours():
    u, labels, conf, groups = clustered(1000, 24, seed=7, smin=5, smax=40)
    so, os_ = typed_knn(u, labels, conf, groups, 4)
    assert ann.measure_typed_recall(u, labels, conf, groups, so, os_, n_queries=1000) == 1.0
    so2 = so.copy()
    so2[:, 0] = 3.0  # nearest SO distance lost (replaced by an impossible far one)
    assert ann.measure_typed_recall(u, labels, conf, groups, so2, os_, n_queries=1000) == pytest.approx(7 / 8)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(kmax=0), ValueError, "kmax must be an integer >= 1"),
        (dict(recall_target=1.5), ValueError, "recall_target must be in"),
        (dict(metric="l2"), ValueError, "metric must be"),
        (dict(groups=np.zeros(5, np.int64)), ValueError, r"groups must have shape \(50,\)"),
        (dict(groups=np.zeros(50)), TypeError, "groups must hold integer codes"),
        (dict(u=np.zeros((50, 4), np.int64)), TypeError, "float32 or float64"),
    ],
)
def test_validation_errors(kwargs, exc, match):
    args = dict(u=np.ones((50, 4), np.float32) / 2, groups=np.arange(50), kmax=3)
    args.update(kwargs)
    u, groups, kmax = args.pop("u"), args.pop("groups"), args.pop("kmax")
    with pytest.raises(exc, match=match):
        ann.cross_group_knn_ann(u, groups, kmax, **args)


def test_registry_names_and_auto_choice():
    assert type(in_memory_searcher({"backend": "ann", "seed": 0, "recall_target": 1.0, "recall_sample": 5})) is ann.AnnSearch
    assert in_memory_searcher({"backend": "exact"}).typed is typed_knn  # the kernel itself (CRoMa fuses it)
    assert choose_backend(1000, 768) == "exact"
    assert choose_backend(1_000_000, 768) == "ann"
    assert choose_backend(100, 10, threshold=100 * 100 * 10) == "exact"
    assert choose_backend(101, 10, threshold=100 * 100 * 10) == "ann"
    assert choose_backend(10, 768, DEFAULT_AUTO_THRESHOLD) == "exact"
    with pytest.raises(ValueError, match="unknown neighbour backend 'faiss'"):
        in_memory_searcher({"backend": "faiss"})
    with pytest.raises(ValueError, match="threshold must be > 0"):
        choose_backend(10, 10, threshold=0)


def test_numba_env_configure_in_fresh_process(tmp_path):
    code = (
        "import os, sys\n"
        "from cachescore.neighbors import numba_env\n"
        "assert 'numba' not in sys.modules\n"
        f"made = numba_env.configure(num_threads=1, cache_dir={str(tmp_path)!r})\n"
        "import numba\n"
        "assert numba.config.NUMBA_NUM_THREADS == 1, numba.config.NUMBA_NUM_THREADS\n"
        f"assert numba.config.CACHE_DIR == {str(tmp_path)!r}, numba.config.CACHE_DIR\n"
        "assert made == {'NUMBA_CACHE_DIR': %r, 'NUMBA_NUM_THREADS': '1'}, made\n" % str(tmp_path)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        from cachescore.neighbors import numba_env

        numba_env.configure(num_threads=0)


# ------------------------------------------------------------------------------------------
# slow: real pynndescent graphs


@pytest.fixture(scope="module")
def warm():
    from cachescore.neighbors.numba_env import warm_up

    warm_up()


@pytest.fixture(scope="module")
def data_f32():
    return clustered(6000, 96, seed=11)


@pytest.mark.slow
def test_ann_cross_group_recall_and_exact_distances(warm, data_f32):
    u, _, _, groups = data_f32
    r = ann.cross_group_knn_ann_with_recall(u, groups, 50, random_state=0, n_recall_queries=300, method="graph")
    assert not r.exact and r.recall >= 0.99
    check_contract(u, groups, r.idx, r.dist, 50)
    ref_i, ref_d = exact_oracle(u, groups, 50)
    tol = ann.distance_tol(u.dtype, u.shape[1])
    assert full_recall(r.dist, ref_d, tol) >= 0.99  # on every row, not the audit sample
    # found neighbours carry the exact engine's distances (same pair, two kernels: <= tol)
    hit = r.idx == ref_i
    np.testing.assert_allclose(r.dist[hit], ref_d[hit], rtol=0, atol=tol)
    # a second call with the same seed is identical
    again = ann.cross_group_knn_ann_with_recall(u, groups, 50, random_state=0, n_recall_queries=300, method="graph")
    np.testing.assert_array_equal(again.idx, r.idx)
    np.testing.assert_array_equal(again.dist, r.dist)
    assert again.recall == r.recall and again.rounds == r.rounds


@pytest.mark.slow
def test_ann_float64_and_zero_rows(warm):
    u, _, _, groups = clustered(3000, 64, seed=12, dtype=np.float64)
    u = u.copy()
    u[[5, 1000]] = 0.0  # zero rows: distance exactly 1 to every row
    idx, dist = ann.cross_group_knn_ann(u, groups, 30, random_state=1, n_recall_queries=200, method="graph")
    check_contract(u, groups, idx, dist, 30)
    ref_i, ref_d = exact_oracle(u, groups, 30)
    assert full_recall(dist, ref_d, ann.distance_tol(u.dtype, u.shape[1])) >= 0.99
    # a zero row's answer is the 30 lowest indices outside its group, all at distance 1
    np.testing.assert_array_equal(idx[5], ref_i[5])
    np.testing.assert_array_equal(dist[5], np.ones(30))


@pytest.mark.slow
def test_ann_typed_recall_vs_typed_engine(warm, monkeypatch):
    u, labels, conf, groups = clustered(8000, 64, seed=13)
    monkeypatch.setattr(ann, "BRUTE_MAX_ROWS", 100)  # every target cell gets a graph
    monkeypatch.setattr(ann, "TYPED_BRUTE_MAX_ROWS", 100)
    r = ann.typed_knn_ann_with_recall(u, labels, conf, groups, 10, random_state=0, n_recall_queries=300, method="graph")
    assert r.exact_cells == 0 and r.n_cells == 8 and r.recall >= 0.99
    so, os_ = typed_knn(u, labels, conf, groups, 10)
    tol = ann.distance_tol(u.dtype, u.shape[1])
    for got, exp in ((r.so_dist, so), (r.os_dist, os_)):
        assert full_recall(got, exp, tol) >= 0.99
        assert (np.diff(got, axis=1) >= 0).all()
        assert (got >= exp - tol).all()  # exact recomputation: never closer than the truth
    again = ann.typed_knn_ann(u, labels, conf, groups, 10, random_state=0, n_recall_queries=300, method="graph")
    np.testing.assert_array_equal(again[0], r.so_dist)
    np.testing.assert_array_equal(again[1], r.os_dist)


@pytest.mark.slow
def test_recall_target_error_when_widening_is_forbidden(warm, data_f32):
    u, _, _, groups = data_f32
    with pytest.raises(ann.RecallTargetError, match=r"recall 0\.\d+ < target 1\.0 .* after 0 widening"):
        ann.cross_group_knn_ann(
            u, groups, 100, recall_target=1.0, random_state=0, n_neighbors=4, epsilon=0.0,
            max_rounds=0, n_recall_queries=300, method="graph",
        )


def test_project_rows_is_a_normalised_float32_proxy():
    u, _, _, _ = clustered(3000, 48, seed=14, dtype=np.float64)
    u = u.copy()
    u[7] = 0.0
    z = ann.project_rows(u, 16, random_state=0, sample=1000, block=700)
    assert z.shape == (3000, 16) and z.dtype == np.float32
    norms = np.linalg.norm(z, axis=1)
    assert norms[7] == 0.0
    np.testing.assert_allclose(np.delete(norms, 7), 1.0, atol=1e-6)
    np.testing.assert_array_equal(z, ann.project_rows(u, 16, random_state=0, sample=1000))


# ------------------------------------------------------------------------------------------
# method="ivf" (default): no numba, fast


def test_brute_on_a_contiguous_target_slice_inside_the_scope():
    """Regression: target rows forming a slice that is not at the end of ``u`` (a target cell)."""
    u, _, _, groups = clustered(900, 16, seed=21, smin=5, smax=20)
    trows = np.arange(100, 250)
    q = np.arange(0, 900, 7)
    idx, dist = ann._brute(u, groups, q, trows, 12, block=64)
    full = cosine_distance_block(u[q], u[trows]).astype(np.float64)
    full[groups[q][:, None] == groups[trows][None, :]] = np.inf
    order = np.lexsort((np.broadcast_to(trows, full.shape), full), axis=1)[:, :12]
    exp_d = np.take_along_axis(full, order, 1)
    exp_i = np.where(np.isfinite(exp_d), trows[order], -1)
    # another tile shape may move a float32 distance by an ulp (module docstring): near-tie rule
    assert_same_neighbours(idx, dist, exp_i, exp_d, ann.distance_tol(u.dtype, u.shape[1]))
    assert set(np.unique(idx[idx >= 0])) <= set(trows)


@pytest.mark.parametrize("method", ["ivf", "graph"])
def test_croma_through_typed_knn_ann_equals_exact(method, monkeypatch):
    """CRoMa end to end with the ANN typed backend: equal to CRoMa with the exact typed engine.

    The scopes are small, so both methods answer exactly (brute force per target cell for
    "graph", the IVF exact fallback or full probing for "ivf", forced below its size threshold):
    the values must be identical, not merely close."""
    import pandas as pd

    from cachescore.metrics.croma import CRoMa

    monkeypatch.setattr(ann, "TYPED_BRUTE_MAX_ROWS", 100 if method == "ivf" else ann.TYPED_BRUTE_MAX_ROWS)
    monkeypatch.setattr(ann, "IVF_ROWS_PER_CLUSTER", 64)
    rng = np.random.default_rng(5)
    n = 600
    # rows sorted by cell: every target cell is a contiguous slice (the regression's trigger)
    labels, confs = np.sort(rng.integers(0, 2, n)), rng.integers(0, 3, n)
    confs = np.concatenate([np.sort(confs[labels == v]) for v in (0, 1)])
    groups = rng.integers(0, 90, n)
    x = (rng.standard_normal((n, 12)) + np.eye(12)[labels] + np.eye(12)[2 + confs]).astype(np.float32)
    df = pd.DataFrame({"label": labels, "center": confs, "group_id": groups, "sample_id": np.arange(n),
                       "image_path": [f"img{i}.png" for i in range(n)]})
    kw = dict(confounder_column="center", m=[3, 1], start_k=5)

    def search(*a):
        return ann.typed_knn_ann(*a, random_state=0, method=method, probe_fraction=1.0 if method == "ivf" else None)

    want = CRoMa.compute_with(typed_knn, x, df, **kw)
    got = CRoMa.compute_with(search, x, df, **kw)
    assert set(got) == set(want)
    for key in want:
        for name in ("value", "std", "q_alpha", "ltm_alpha", "f0", "k_start", "k_final", "retries", "n_pairs"):
            assert getattr(got[key], name) == getattr(want[key], name), (key, name)
        np.testing.assert_array_equal(got[key].sample_values, want[key].sample_values)


@pytest.fixture(scope="module")
def ivf_data():
    return clustered(8000, 48, seed=31, n_conf=4, smin=10, smax=60)


def test_ivf_cross_group_recall_contract_and_reported_recall(ivf_data, monkeypatch):
    monkeypatch.setattr(ann, "IVF_ROWS_PER_CLUSTER", 500)
    u, _, _, groups = ivf_data
    r = ann.cross_group_knn_ann_with_recall(u, groups, 30, random_state=0, n_recall_queries=400)
    assert r.method == "ivf" and r.n_clusters == 16 and not r.exact and r.probe_fraction < 1
    assert r.recall >= 0.99
    check_contract(u, groups, r.idx, r.dist, 30)
    ref_i, ref_d = exact_oracle(u, groups, 30)
    tol = ann.distance_tol(u.dtype, u.shape[1])
    assert full_recall(r.dist, ref_d, tol) >= 0.99  # every row, not the audit sample
    assert (r.dist >= ref_d - tol).all()  # exact distances: never closer than the truth
    # the reported recall is the measured one on the audit rows (independent recomputation)
    assert r.recall == ann.measure_recall(u, groups, r.idx, n_queries=400, random_state=0)
    again = ann.cross_group_knn_ann_with_recall(u, groups, 30, random_state=0, n_recall_queries=400)
    np.testing.assert_array_equal(again.idx, r.idx)
    np.testing.assert_array_equal(again.dist, r.dist)


def test_ivf_full_probe_falls_back_to_exact_engine(ivf_data):
    u, labels, conf, groups = ivf_data
    r = ann.cross_group_knn_ann_with_recall(u, groups, 20, random_state=0, probe_fraction=1.0)
    assert r.exact and r.recall == 1.0
    ref_i, ref_d = exact_oracle(u, groups, 20)
    np.testing.assert_array_equal(r.idx, ref_i)
    np.testing.assert_array_equal(r.dist, ref_d)
    t = ann.typed_knn_ann_with_recall(u, labels, conf, groups, 5, random_state=0, probe_fraction=1.0)
    so, os_ = typed_knn(u, labels, conf, groups, 5)
    assert t.exact_cells == t.n_cells == 8 and t.recall == 1.0
    np.testing.assert_array_equal(t.so_dist, so)
    np.testing.assert_array_equal(t.os_dist, os_)


def test_ivf_recall_target_error_on_structureless_data(monkeypatch):
    monkeypatch.setattr(ann, "IVF_ROWS_PER_CLUSTER", 250)
    x = np.random.default_rng(0).standard_normal((4000, 32)).astype(np.float32)
    u = normalize_rows(x)
    groups = np.arange(4000) // 10
    with pytest.raises(ann.RecallTargetError, match=r"\(ivf\) cross-group search reached recall 0\.\d+ < target"):
        ann.cross_group_knn_ann(u, groups, 20, random_state=0, probe_fraction=1 / 16, max_rounds=0)


@pytest.mark.parametrize("frac", [None, 0.25])
def test_ivf_typed_recall_vs_typed_engine(ivf_data, monkeypatch, frac):
    monkeypatch.setattr(ann, "TYPED_BRUTE_MAX_ROWS", 100)
    monkeypatch.setattr(ann, "IVF_ROWS_PER_CLUSTER", 500)
    u, labels, conf, groups = ivf_data
    target = 0.99 if frac is None else 0.5
    r = ann.typed_knn_ann_with_recall(u, labels, conf, groups, 8, random_state=0, n_recall_queries=400,
                                      probe_fraction=frac, recall_target=target)
    assert r.method == "ivf" and r.recall >= target
    so, os_ = typed_knn(u, labels, conf, groups, 8)
    tol = ann.distance_tol(u.dtype, u.shape[1])
    for got, exp in ((r.so_dist, so), (r.os_dist, os_)):
        assert got.shape == exp.shape and got.dtype == np.float64
        assert (np.diff(got, axis=1) >= 0).all()
        assert (got >= exp - tol).all()
    if frac is not None:
        assert r.exact_cells == 0 and r.probe_fraction == frac  # the IVF search itself ran
    # reported recall == an independent measurement on the same audit rows
    if r.exact_cells == 0:
        assert r.recall == ann.measure_typed_recall(u, labels, conf, groups, r.so_dist, r.os_dist,
                                                    n_queries=400, random_state=0)
    if frac is None:
        assert full_recall(np.concatenate([r.so_dist, r.os_dist]), np.concatenate([so, os_]), tol) >= 0.99


@pytest.mark.parametrize("seed", range(3))
def test_packed_key_merge_equals_lexsort_merge_with_ties(seed):
    rng = np.random.default_rng(seed)
    b, w, k = 50, 300, 17
    dist = (rng.integers(0, 40, (b, w)) / 32).astype(np.float32)  # many exact ties
    dist[rng.random((b, w)) < 0.2] = np.inf
    tids = rng.permutation(5000)[:w].astype(np.int64)
    acc32 = (np.full((b, k), -1, np.int64), np.full((b, k), np.inf))
    acc64 = (np.full((b, k), -1, np.int64), np.full((b, k), np.inf))
    for half in (slice(0, 150), slice(150, 300)):  # two tiles: the second merges into the first
        topk.merge_tile(*acc32, np.ascontiguousarray(dist[:, half]), tids[half], k)
        topk.merge_tile(*acc64, dist[:, half].astype(np.float64), tids[half], k)
    np.testing.assert_array_equal(acc32[0], acc64[0])
    np.testing.assert_array_equal(acc32[1], acc64[1])
    ref = np.lexsort((np.broadcast_to(tids, dist.shape), dist), axis=1)[:, :k]
    exp_d = np.take_along_axis(dist, ref, 1).astype(np.float64)
    np.testing.assert_array_equal(acc32[1], exp_d)
    np.testing.assert_array_equal(acc32[0], np.where(np.isfinite(exp_d), tids[ref], -1))
