"""The exact blocked neighbour engine (cachescore.neighbors.exact).

Pins: the ``cross_group_knn`` contract (shapes, dtypes, -1/+inf padding, same-group and self
exclusion before selection, ``(distance, index)`` order with index tie-breaks), equality with a
brute-force oracle, independence from the block sizes (tiny blocks so every block edge is
crossed), and ``farthest_rows`` (self at distance 0, ties to the largest index). The symmetric
tiling (one GEMM per tile pair, reduced along both axes) is pinned by: many tile sizes below,
at and above ``kmax`` against the oracle (including contiguous groups that mask whole chunks of
the bound's column chunks), bitwise ``d(i, j) == d(j, i)``, both merge paths (padded matrix and
flat sort) on exact ties, and ``rows=`` ranges equal to the whole-scope table.

Bitwise block invariance is checked on *dyadic* rows (entries that are multiples of 1/4 in few
dimensions), whose dot products are exact in any BLAS kernel: there, many exact ties occur, and
the order must still be identical for every block shape. On random Gaussian rows BLAS kernel
choice (gemv vs gemm, edge blocks) moves the last bit of a distance (spec §12.3), so the test
asserts identical neighbour indices on tie-free data and distances within a few ulp.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachescore.neighbors.exact import cross_group_knn, farthest_rows
from cachescore.neighbors.normalize import normalize_rows

BLOCKS = [(None, None), (3, 5), (7, 2), (2, 64), (64, 3)]


def blocks_for(n):
    """Block shapes to try; single-entry blocks only on small inputs (they are slow by design)."""
    return BLOCKS + [(1, 1)] if n <= 30 else BLOCKS


def brute_force(u, groups, kmax):
    """Oracle: full distance matrix in the rows' dtype, masked, lexsorted per row."""
    d = np.clip(1 - u @ u.T, 0, 2).astype(np.float64)
    d[np.asarray(groups)[:, None] == np.asarray(groups)[None, :]] = np.inf
    n = u.shape[0]
    idx = np.full((n, kmax), -1, dtype=np.int64)
    dist = np.full((n, kmax), np.inf)
    for i in range(n):
        order = np.lexsort((np.arange(n), d[i]))
        order = order[np.isfinite(d[i, order])][:kmax]
        idx[i, : order.size] = order
        dist[i, : order.size] = d[i, order]
    return idx, dist


def dyadic_rows(rng, n, d=3):
    return (rng.integers(-4, 5, size=(n, d)) / 4.0).astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trial", range(6))
def test_exact_on_dyadic_rows_with_ties_for_every_block_shape(global_seed, trial, dtype):
    rng = np.random.default_rng([global_seed, trial])
    n = int(rng.integers(2, 60))
    u = dyadic_rows(rng, n).astype(dtype)  # exact products: many exact distance ties
    groups = rng.integers(0, max(1, n // 3), n)
    kmax = int(rng.integers(1, n + 10))
    want_idx, want_dist = brute_force(u, groups, kmax)
    for br, bc in blocks_for(n):
        idx, dist = cross_group_knn(u, groups, kmax, block_rows=br, block_cols=bc)
        np.testing.assert_array_equal(idx, want_idx, err_msg=f"blocks {br}x{bc}")
        np.testing.assert_array_equal(dist, want_dist, err_msg=f"blocks {br}x{bc}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trial", range(6))
def test_matches_brute_force_on_random_rows(global_seed, trial, dtype):
    rng = np.random.default_rng([global_seed, trial, 1])
    n = int(rng.integers(2, 100))
    u = normalize_rows(rng.standard_normal((n, int(rng.integers(2, 40)))).astype(dtype))
    groups = rng.integers(0, max(1, n // int(rng.integers(1, 8))), n)
    kmax = int(rng.integers(1, n + 5))
    want_idx, want_dist = brute_force(u, groups, kmax)
    ulp = 4e-7 if dtype == np.float32 else 1e-15
    for br, bc in blocks_for(n):
        idx, dist = cross_group_knn(u, groups, kmax, block_rows=br, block_cols=bc)
        assert idx.dtype == np.int64 and dist.dtype == np.float64 and idx.shape == (n, kmax)
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_allclose(dist, want_dist, rtol=0, atol=ulp)
        # values are exactly compute-dtype numbers
        finite = np.isfinite(dist)
        assert np.array_equal(dist[finite].astype(dtype).astype(np.float64), dist[finite])


def test_contract_padding_exclusion_and_order():
    rng = np.random.default_rng(3)
    u = normalize_rows(rng.standard_normal((12, 5)))
    groups = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2])  # rows 0..9 see only rows 10, 11
    idx, dist = cross_group_knn(u, groups, 4)
    for i in range(10):
        assert set(idx[i, :2].tolist()) == {10, 11}
        assert (idx[i, 2:] == -1).all() and np.isinf(dist[i, 2:]).all()
        assert dist[i, 0] <= dist[i, 1]
    assert 10 not in idx[10] and 11 not in idx[11]
    assert (idx[10] >= 0).all()  # 11 other-group rows available, 4 kept
    assert np.all(np.diff(dist[10]) >= 0)


def test_string_groups_and_kmax_beyond_n():
    u = normalize_rows(np.eye(4) + 0.1)
    idx, dist = cross_group_knn(u, np.array(["a", "b", "a", "c"]), 10)
    assert idx.shape == (4, 10)
    assert sorted(idx[0, :2].tolist()) == [1, 3] and (idx[0, 2:] == -1).all()


@pytest.mark.parametrize("bad", [0, -3])
def test_rejects_non_positive_kmax(bad):
    with pytest.raises(ValueError, match="kmax"):
        cross_group_knn(np.eye(3), np.arange(3), bad)


def test_rejects_non_float_rows():
    with pytest.raises(TypeError, match="float32 or float64"):
        cross_group_knn(np.eye(3, dtype=np.int64), np.arange(3), 1)


def test_empty_input():
    idx, dist = cross_group_knn(np.zeros((0, 3)), np.zeros(0, dtype=np.int64), 2)
    assert idx.shape == (0, 2) and dist.shape == (0, 2)


def test_farthest_rows_self_is_zero_and_ties_go_to_largest_index():
    # rows 1, 2 and 3 are all at distance 2 from row 0 (antipodal duplicates)
    u = np.array([[1.0, 0.0], [-1.0, 0.0], [-1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    np.testing.assert_array_equal(farthest_rows(u, [0]), [3])
    for br, bc in BLOCKS:
        far = farthest_rows(u, block_rows=br, block_cols=bc)
        np.testing.assert_array_equal(far, [3, 0, 0, 0, 3])
    # a single row: its own index (self at distance 0)
    np.testing.assert_array_equal(farthest_rows(np.ones((1, 3)) / np.sqrt(3)), [0])


def test_farthest_rows_matches_brute_force(global_seed):
    rng = np.random.default_rng([global_seed, 7])
    u = normalize_rows(rng.standard_normal((60, 6)))
    d = np.clip(1 - u @ u.T, 0, 2)
    np.fill_diagonal(d, 0.0)
    want = d.shape[1] - 1 - np.argmax(d[:, ::-1], axis=1)
    np.testing.assert_array_equal(farthest_rows(u, block_rows=7, block_cols=11), want)


@pytest.mark.parametrize("kind", ["dyadic", "gaussian64"])
def test_large_scope_with_sampled_first_block_bound(global_seed, kind):
    """n > 1024 columns: the first block's bound comes from a column sample (not the full row)."""
    rng = np.random.default_rng([global_seed, 11])
    n = 1400
    if kind == "dyadic":
        u = dyadic_rows(rng, n, d=4)  # heavy exact ties, including many at distance 0 and 2
    else:
        u = normalize_rows(rng.standard_normal((n, 8)))  # float64: no near-ties at ulp scale
    groups = np.repeat(np.arange(n // 7), 7)
    want_idx, want_dist = brute_force(u, groups, 15)
    for br, bc in [(None, None), (500, 1300)]:
        idx, dist = cross_group_knn(u, groups, 15, block_rows=br, block_cols=bc)
        np.testing.assert_array_equal(idx, want_idx)
        if kind == "dyadic":
            np.testing.assert_array_equal(dist, want_dist)
        else:
            np.testing.assert_allclose(dist, want_dist, rtol=0, atol=1e-15)


# --- symmetric tiling (one GEMM per tile pair I <= J, reduced along both axes) -------------------


def _grouping(rng, n, kind):
    if kind == "contiguous":  # large contiguous groups: whole chunks of a tile are masked
        return np.repeat(np.arange(n), int(rng.integers(10, 60)))[:n]
    return rng.integers(0, max(1, n // int(rng.integers(2, 9))), n)


@pytest.mark.parametrize("kind", ["random", "contiguous"])
@pytest.mark.parametrize("trial", range(4))
def test_many_tiles_match_brute_force(global_seed, trial, kind):
    """Tiles below, around and above kmax; exact ties (dyadic) and float32 Gaussian rows."""
    rng = np.random.default_rng([global_seed, trial, 21])
    n = int(rng.integers(150, 420))
    groups = _grouping(rng, n, kind)
    kmax = int(rng.integers(1, 45))
    dy = dyadic_rows(rng, n, d=4)
    ga = normalize_rows(rng.standard_normal((n, 24)).astype(np.float32))
    for u, exact in ((dy, True), (dy.astype(np.float32), True), (ga, False)):
        want_idx, want_dist = brute_force(u, groups, kmax)
        for tile in (9, max(kmax, 2), 37, n):
            idx, dist = cross_group_knn(u, groups, kmax, block_rows=tile)
            np.testing.assert_array_equal(idx, want_idx, err_msg=f"tile {tile}")
            if exact:
                np.testing.assert_array_equal(dist, want_dist, err_msg=f"tile {tile}")
            else:
                np.testing.assert_allclose(dist, want_dist, rtol=0, atol=4e-7)


def test_distances_are_bitwise_symmetric(global_seed):
    """d(i, j) and d(j, i) come from one GEMM entry, so they are equal to the last bit."""
    rng = np.random.default_rng([global_seed, 22])
    n = 700
    u = normalize_rows(rng.standard_normal((n, 48)).astype(np.float32))
    groups = np.repeat(np.arange(n // 5), 5)
    idx, dist = cross_group_knn(u, groups, 60, block_rows=128)
    rows = np.repeat(np.arange(n), 60)
    pairs = {(int(a), int(b)): float(d) for a, b, d in zip(rows, idx.ravel(), dist.ravel()) if b >= 0}
    both = [(a, b) for (a, b) in pairs if (b, a) in pairs]
    assert len(both) > 1000
    assert all(pairs[(a, b)] == pairs[(b, a)] for a, b in both)


@pytest.mark.parametrize("slack", [-(10**9), 10**9])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_both_merge_paths_keep_the_tie_order(global_seed, monkeypatch, slack, dtype):
    """The padded-matrix merge and the flat (row, distance, index) sort give the same lists."""
    from cachescore.neighbors import exact

    monkeypatch.setattr(exact, "_FLAT_SLACK", slack)
    rng = np.random.default_rng([global_seed, 23])
    n = 260
    u = dyadic_rows(rng, n, d=3).astype(dtype)  # heavy exact ties
    groups = rng.integers(0, 40, n)
    for kmax in (1, 7, 50):
        want_idx, want_dist = brute_force(u, groups, kmax)
        for tile in (9, 64, None):
            idx, dist = cross_group_knn(u, groups, kmax, block_rows=tile)
            np.testing.assert_array_equal(idx, want_idx)
            np.testing.assert_array_equal(dist, want_dist)


# --- rows= (one query-row range, for distributing a scope over workers) ------------------------


@pytest.mark.parametrize("kind", ["dyadic", "gaussian32"])
def test_row_ranges_equal_the_whole_scope(global_seed, kind):
    rng = np.random.default_rng([global_seed, 24])
    n = 500
    if kind == "dyadic":
        u = dyadic_rows(rng, n, d=4)
    else:
        u = normalize_rows(rng.standard_normal((n, 32)).astype(np.float32))
    groups = rng.integers(0, 90, n)
    want_idx, want_dist = cross_group_knn(u, groups, 17)
    for step in (1, 70, 333, n):
        parts = [cross_group_knn(u, groups, 17, rows=slice(r, r + step)) for r in range(0, n, step)]
        idx = np.concatenate([p[0] for p in parts])
        dist = np.concatenate([p[1] for p in parts])
        np.testing.assert_array_equal(idx, want_idx)
        if kind == "dyadic":
            np.testing.assert_array_equal(dist, want_dist)
        else:  # a query-row GEMM and a tile GEMM may differ in the last bit on some BLAS (§12.3)
            np.testing.assert_allclose(dist, want_dist, rtol=0, atol=4e-7)


def test_row_range_shapes_and_validation():
    u = normalize_rows(np.random.default_rng(0).standard_normal((10, 4)))
    g = np.arange(10) // 2
    idx, dist = cross_group_knn(u, g, 3, rows=slice(4, 7))
    assert idx.shape == (3, 3) and dist.shape == (3, 3)
    np.testing.assert_array_equal(idx, cross_group_knn(u, g, 3)[0][4:7])
    assert cross_group_knn(u, g, 3, rows=slice(8, 100))[0].shape == (2, 3)
    assert cross_group_knn(u, g, 3, rows=slice(5, 5))[0].shape == (0, 3)
    with pytest.raises(ValueError, match="rows must be a slice with step 1"):
        cross_group_knn(u, g, 3, rows=slice(0, 10, 2))
    with pytest.raises(ValueError, match="rows must be a slice"):
        cross_group_knn(u, g, 3, rows=[1, 2])
    with pytest.raises(ValueError, match="block sizes"):
        cross_group_knn(u, g, 3, block_rows=0)


# --- tile pairs on several Python threads -------------------------------------------------------


@pytest.mark.parametrize("kind", ["dyadic64", "dyadic32", "gaussian32", "gaussian64"])
@pytest.mark.parametrize("trial", range(2))
def test_threaded_search_equals_single_thread_bit_for_bit(global_seed, trial, kind):
    """Per-thread lists merged at the end give the same tables as one thread, ties included.

    Dyadic rows: exact ties everywhere, so the cross-thread merge's index tie-break is exercised;
    Gaussian rows: the same GEMM bits whichever thread (BLAS pinned to one thread) computes a tile.
    """
    rng = np.random.default_rng([global_seed, trial, 30])
    n = int(rng.integers(200, 600))
    groups = _grouping(rng, n, "random" if trial % 2 else "contiguous")
    kmax = int(rng.integers(1, 40))
    if kind.startswith("dyadic"):
        u = dyadic_rows(rng, n, d=4).astype(np.float64 if kind.endswith("64") else np.float32)
    else:
        u = normalize_rows(rng.standard_normal((n, 32)).astype(np.float32 if kind.endswith("32") else np.float64))
    for tile in (17, 64, 150):
        one = cross_group_knn(u, groups, kmax, block_rows=tile, n_threads=1)
        for threads in (2, 3) if tile > 17 else (2, 50):
            many = cross_group_knn(u, groups, kmax, block_rows=tile, n_threads=threads)
            np.testing.assert_array_equal(many[0], one[0], err_msg=f"tile {tile}, {threads} threads")
            np.testing.assert_array_equal(many[1], one[1], err_msg=f"tile {tile}, {threads} threads")
        if kind.startswith("dyadic"):  # exact dot products: the oracle's bits too
            want_idx, want_dist = brute_force(u, groups, kmax)
            np.testing.assert_array_equal(one[0], want_idx)
            np.testing.assert_array_equal(one[1], want_dist)


def test_threaded_search_restores_blas_threads_and_validates():
    from threadpoolctl import threadpool_info

    from cachescore.neighbors import exact

    rng = np.random.default_rng(31)
    u = normalize_rows(rng.standard_normal((300, 16)).astype(np.float32))
    groups = np.repeat(np.arange(60), 5)
    before = [i["num_threads"] for i in threadpool_info()]
    cross_group_knn(u, groups, 5, block_rows=50, n_threads=2)
    assert [i["num_threads"] for i in threadpool_info()] == before
    for bad in (0, -2):
        with pytest.raises(ValueError, match="n_threads"):
            cross_group_knn(u, groups, 5, n_threads=bad)
    assert exact._thread_count(None, 1) == 1  # one tile pair: nothing to share
    assert exact._thread_count(4, 3) == 3


def test_default_threads_respect_a_pinned_blas(monkeypatch):
    """Inside a caller that pinned BLAS to one thread (a Dask worker), the default is 1 thread."""
    from threadpoolctl import threadpool_limits

    from cachescore.neighbors import exact

    monkeypatch.setattr(exact, "_usable_cores", lambda: 4)
    with threadpool_limits(limits=1, user_api="blas"):
        assert exact._thread_count(None, 10) == 1
    if exact._blas_threads() > 1:
        assert exact._thread_count(None, 10) == 4
