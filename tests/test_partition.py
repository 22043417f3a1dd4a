"""The building blocks of the out-of-core IVF search (cachescore.neighbors.partition).

Pins: probe sets are the non-empty clusters within the probe radius of the query cluster's
centroid (itself first, nearest first, growing with the radius; r = inf probes every non-empty
cluster, and grow by the next nearest ones to a floor of rows); the batching chain visits every
cluster once, nearest next; the calibrated (radius, floor) rule reaches the target on the
calibration neighbours with the least work of its grid and the ladder's rungs grow; k-means is deterministic and every row goes to its most similar centroid; the tile
kernel equals a brute-force reference (same-group pairs excluded, ties by index) whatever the
tile sizes and however the targets are split into pieces.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachescore.neighbors import partition, topk
from cachescore.neighbors.normalize import cosine_distance_block, normalize_rows
from cachescore.neighbors.partition import (
    assign_clusters,
    ProbeGeometry,
    ProbeRule,
    calibrate_probe,
    probe_chain,
    probe_distances,
    probe_ladder,
    probed_clusters,
    spherical_kmeans,
    topk_tiles,
)

@pytest.mark.parametrize("seed", range(4))
def test_probe_sets_are_centroid_balls_that_grow_with_the_radius(seed):
    rng = np.random.default_rng(seed)
    cent = normalize_rows(rng.standard_normal((23, 8)).astype(np.float32))
    dist = probe_distances(cent)
    assert np.isneginf(np.diag(dist)).all()
    off = ~np.eye(23, dtype=bool)
    np.testing.assert_allclose(dist[off], (1 - cent.astype(np.float64) @ cent.T.astype(np.float64))[off], atol=1e-12)
    sizes = rng.integers(0, 50, 23)
    empty = int(rng.integers(0, 23))
    sizes[empty] = 0  # an empty cluster is never probed
    for a in range(23):
        seen = set()
        for r in (-np.inf, 0.5, 0.9, 1.2, np.inf):
            got = probed_clusters(dist[a], sizes, r)
            probed = set(got.tolist())
            assert seen <= probed  # sets grow with the radius
            assert probed == {b for b in range(23) if sizes[b] > 0 and dist[a, b] <= r}
            assert (np.diff(dist[a][got]) >= 0).all()  # nearest first
            if sizes[a] > 0:
                assert got[0] == a  # a cluster probes itself first, at any radius
            seen = probed
        assert probed == set(np.flatnonzero(sizes).tolist())  # r = inf: every non-empty cluster
        # a floor of rows: the ball grows by the next nearest clusters until it holds min_rows
        for need in (1, 60, 200, 10**6):
            got = probed_clusters(dist[a], sizes, -np.inf, need)
            nonempty = np.flatnonzero(sizes)
            nearest = nonempty[np.argsort(dist[a][nonempty], kind="stable")]
            assert got.tolist() == nearest[: got.size].tolist()
            assert sizes[got].sum() >= min(need, sizes.sum())
            assert got.size == 1 or sizes[got[:-1]].sum() < need


def test_probe_chain_lists_every_cluster_once_nearest_next():
    rng = np.random.default_rng(3)
    cent = normalize_rows(rng.standard_normal((40, 6)).astype(np.float32))
    dist = probe_distances(cent)
    chain = probe_chain(ProbeGeometry(cent))
    assert sorted(chain.tolist()) == list(range(40)) and chain[0] == 0
    for i in range(39):
        rest = chain[i + 1 :]
        assert dist[chain[i], chain[i + 1]] == dist[chain[i], rest].min()
    # listing fewer nearest clusters (the walk then computes exhausted rows again) changes nothing
    for width in (1, 2, 5):
        np.testing.assert_array_equal(probe_chain(ProbeGeometry(cent), width=width), chain)


def test_geometry_rows_have_the_same_bits_however_they_are_asked_for():
    """Calibration, the search plan and the chain read one cluster's distance row in different
    orders: each row is computed in its aligned block, so every way gives the same bits, and a
    block's probe order lists every cluster nearest first (ties by code) with ``pos`` its inverse."""
    rng = np.random.default_rng(7)
    cent = normalize_rows(rng.standard_normal((150, 48)).astype(np.float32))
    geo = ProbeGeometry(cent)
    dist = probe_distances(cent)
    for a in rng.permutation(150):
        np.testing.assert_array_equal(geo.row(a), dist[a])
    for blk in geo.blocks():
        np.testing.assert_array_equal(blk.dist, dist[blk.start : blk.stop])
        for i in range(blk.stop - blk.start):
            np.testing.assert_array_equal(blk.order[i], np.argsort(dist[blk.start + i], kind="stable"))
            np.testing.assert_array_equal(blk.pos[i][blk.order[i]], np.arange(150))


def test_the_probe_geometry_never_holds_a_cluster_by_cluster_array():
    """C = n / 2048 grows with the scope: calibration and the chain hold GEOMETRY_ROWS x C at a
    time (a (C, C) geometry was ~1.2 GB at 10M rows). Traced peak < a quarter of one (C, C) float64."""
    import tracemalloc

    rng = np.random.default_rng(0)
    c = 3000
    cent = normalize_rows(rng.standard_normal((c, 8)).astype(np.float32))
    geo = ProbeGeometry(cent)
    pools = [_pool(rng, c, 2000), _pool(rng, c, 2000)]
    tracemalloc.start()
    try:
        ladder = probe_ladder(geo, pools, 0.95, 5)
        chain = probe_chain(geo)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sorted(chain.tolist()) == list(range(c)) and ladder[-1].exact
    assert peak < c * c * 8 / 4, peak


def _pool(rng, c, n_nb):
    sizes = rng.integers(0, 60, c)
    sizes[rng.integers(0, c)] = 0
    qa = rng.integers(0, c, n_nb)
    nb = rng.choice(np.flatnonzero(sizes), n_nb)
    return rng.integers(0, 40, c), sizes, qa, nb


@pytest.mark.parametrize("seed,block", [(0, 64), (1, 64), (2, 64), (0, 7), (1, 1)])
def test_calibrated_probe_rule_reaches_the_target_with_least_work(seed, block, monkeypatch):
    """The rule's recall on the calibration neighbours (found iff their cluster is probed by
    probed_clusters) reaches the target; no rule of the radius x floor grid with less work does;
    the ladder's rungs grow (superset probe sets) and end exact. ``block``: query clusters per
    geometry block (several blocks must give the rules one block gives)."""
    monkeypatch.setattr(partition, "GEOMETRY_ROWS", block)
    rng = np.random.default_rng(seed)
    c = 30
    cent = normalize_rows(rng.standard_normal((c, 5)).astype(np.float32))
    geo = ProbeGeometry(cent)
    dist = probe_distances(cent)
    pools = [_pool(rng, c, 400), _pool(rng, c, 300)]

    def probe_sets(rule):
        return [[set(probed_clusters(dist[a], sz, rule.radius, rule.min_rows).tolist()) for a in range(c)]
                for _, sz, _, _ in pools]

    def recall_and_work(rule):
        sets = probe_sets(rule)
        hits = sum(int(nb_ in sets[p][a_]) for p, (_, _, qa, nb) in enumerate(pools) for a_, nb_ in zip(qa, nb))
        work = sum(int(w[a]) * int(sz[list(sets[p][a])].sum()) for p, (w, sz, _, _) in enumerate(pools)
                   for a in range(c))
        return hits / sum(qa.size for _, _, qa, _ in pools), work

    for target in (0.8, 0.95, 1.0):
        rule = calibrate_probe(geo, pools, target, 5)
        rec, work = recall_and_work(rule)
        assert rec >= target - 1e-12 and rule.min_rows >= 5
        # the geometry's row count is what probed_clusters probes
        for (w, sz, _, _), sets in zip(pools, probe_sets(rule)):
            got = np.concatenate([blk.probed_rows(blk.cum_rows(sz), [rule])[:, 0] for blk in geo.blocks()])
            np.testing.assert_array_equal(got, [sz[list(s)].sum() for s in sets])
        # no cheaper rule among finite radii of the neighbours and the floors tried
        radii = sorted({float(dist[a_, nb_]) for _, _, qa, nb in pools for a_, nb_ in zip(qa, nb)})
        for floor in (5, 7, 10, 14, 20):
            for r in radii[:: max(1, len(radii) // 25)]:
                rr, ww = recall_and_work(ProbeRule(r, floor))
                assert not (rr >= target and ww < work - 1e-9), (target, r, floor, ww, work)
    ladder = probe_ladder(geo, pools, 0.9, 5)
    assert ladder[-1].exact and not ladder[0].exact
    for lo, hi in zip(ladder, ladder[1:]):
        assert all(x <= y for xs, ys in zip(probe_sets(lo), probe_sets(hi)) for x, y in zip(xs, ys))
    assert all(s == set(np.flatnonzero(sz).tolist()) for (_, sz, _, _), sets in zip(pools, probe_sets(ladder[-1]))
               for s in sets)


def test_kmeans_is_deterministic_and_assignment_is_nearest_centroid():
    rng = np.random.default_rng(0)
    x = normalize_rows(rng.standard_normal((3000, 16)).astype(np.float32))
    a = spherical_kmeans(x, 12, random_state=5)
    b = spherical_kmeans(x, 12, random_state=5)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1, atol=1e-6)
    cl = assign_clusters(x, a, block=700)
    np.testing.assert_array_equal(cl, np.argmax(x @ a.T, axis=1))
    with pytest.raises(ValueError, match="n_clusters"):
        spherical_kmeans(x, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_segment_sums_are_reduceat_bit_for_bit(dtype):
    """segment_sums (the k-means' centroid sums) equals np.add.reduceat over the non-empty
    segments bit for bit: empty and one-row segments, -0.0 entries, lengths across numpy's
    pairwise block (below 8, up to 128, split halves past it) and magnitudes far apart."""
    rng = np.random.default_rng(3)
    counts = np.array([0, 1, 2, 7, 8, 9, 15, 16, 17, 127, 128, 129, 130, 0, 255, 256, 257, 1000, 1031, 1, 0])
    xs = (rng.standard_normal((counts.sum(), 24)) * rng.uniform(1e-3, 1e3, (counts.sum(), 1))).astype(dtype)
    xs[rng.integers(0, counts.sum(), 40)] = -0.0
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    nz = np.flatnonzero(counts)
    want = np.zeros((counts.size, 24), dtype)
    want[nz] = np.add.reduceat(xs, starts[nz], axis=0)
    got = partition.segment_sums(xs, counts)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # sign of zero included


def test_kmeans_centroids_equal_the_reduceat_formulation():
    """spherical_kmeans' centroids bit for bit as summing the clusters with np.add.reduceat (the
    formulation the partitions and the stored ann values before segment_sums were built with)."""
    rng = np.random.default_rng(1)
    x = normalize_rows(rng.standard_normal((5000, 32)).astype(np.float32))
    x[:40] = x[40:80]  # duplicates: an emptied cluster is reseeded
    r = np.random.default_rng(9)
    cent = x[r.choice(x.shape[0], size=50, replace=False)].copy()
    for _ in range(8):
        lab = np.argmax(x @ cent.T, axis=1)
        srt = np.argsort(lab, kind="stable")
        cnt = np.bincount(lab, minlength=50)
        new = np.zeros_like(cent)
        nz = np.flatnonzero(cnt)
        new[nz] = np.add.reduceat(x[srt], np.concatenate([[0], np.cumsum(cnt)[:-1]])[nz], axis=0)
        norms = np.linalg.norm(new, axis=1)
        empty = norms == 0
        if empty.any():
            new[empty] = x[r.choice(x.shape[0], size=int(empty.sum()), replace=False)]
            norms[empty] = np.linalg.norm(new[empty], axis=1)
        norms[norms == 0] = 1.0
        cent = new / norms[:, None]
    np.testing.assert_array_equal(spherical_kmeans(x, 50, random_state=np.random.default_rng(9)), cent)


@pytest.mark.parametrize("dtype, k, tt, n_t, n_groups", [(np.float32, 7, 33, 301, 9), (np.float64, 7, 33, 301, 9),
                                                       (np.float32, 7, 1000, 3001, 9), (np.float32, 21, 3001, 3001, 3),
                                                       (np.float64, 1, 2999, 3001, 40), (np.float32, 5, 3001, 3001, 2)])
def test_topk_tiles_equals_brute_force(dtype, k, tt, n_t, n_groups):
    """Small and wide tiles (a wide one bounds its rows without k entries by column-block maxima,
    some of whose blocks hold only same-group entries): the brute-force top-k, ties included."""
    rng = np.random.default_rng(1)
    # small dyadic entries: every dot product is exact in any summation order (so tile shapes
    # cannot move a bit), and many distances tie, so the (distance, index) order is exercised
    q = (rng.integers(-2, 3, (37, 6)) / 8).astype(dtype)
    t = (rng.integers(-2, 3, (n_t, 6)) / 8).astype(dtype)
    qg, tg = rng.integers(0, n_groups, 37), rng.integers(0, n_groups, n_t)
    tg[:400] = np.sort(tg[:400])  # long runs of one group: whole column blocks masked for its queries
    ids = rng.permutation(5 * n_t)[:n_t].astype(np.int64)
    d = cosine_distance_block(q, t).astype(np.float64)
    d[qg[:, None] == tg[None, :]] = np.inf
    want_i = np.full((37, k), -1)
    want_d = np.full((37, k), np.inf)
    for r in range(37):
        order = np.lexsort((ids, d[r]))[:k]
        ok = np.isfinite(d[r, order])
        want_i[r, : ok.sum()] = ids[order][ok]
        want_d[r, : ok.sum()] = d[r, order][ok]
    got_i, got_d = np.full((37, k), -1), np.full((37, k), np.inf)
    for lo, hi in ((0, 120), (120, 121), (121, n_t)):  # targets in pieces
        topk_tiles(q, qg, t[lo:hi], ids[lo:hi], tg[lo:hi], k, got_i, got_d, tq=10, tt=tt)
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_d, want_d)
    # the same targets selected by row numbers (shuffled, in two selections), gathered per tile
    perm = rng.permutation(n_t)
    sel_i, sel_d = np.full((37, k), -1), np.full((37, k), np.inf)
    for rows in (perm[:150], perm[150:]):
        topk_tiles(q, qg, t, ids, tg, k, sel_i, sel_d, rows=rows, tq=10, tt=tt)
    np.testing.assert_array_equal(sel_i, want_i)
    np.testing.assert_array_equal(sel_d, want_d)


def test_merge_of_a_tile_closer_than_every_current_neighbour_keeps_o_bk_candidates(monkeypatch):
    """A tile whose entries all beat the rows' current k-th distance takes the tightened path
    (each row's own k best of the tile, ties kept): same result as a brute-force merge, and the
    candidate arrays handed to the sort are O(b k), not O(b w)."""
    rng = np.random.default_rng(5)
    b, w, k = 40, 500, 6
    bi = np.tile(np.arange(10_000, 10_000 + k, dtype=np.int64), (b, 1))
    bd = np.full((b, k), 1.5)  # every current neighbour is far
    dist = (rng.integers(0, 40, (b, w)) / 64).astype(np.float32)  # < 1.5 everywhere, many ties
    tids = rng.permutation(5000)[:w].astype(np.int64)
    want_i, want_d = np.empty((b, k), np.int64), np.empty((b, k))
    for r in range(b):
        d = np.concatenate([bd[r], dist[r].astype(np.float64)])
        i = np.concatenate([bi[r], tids])
        o = np.lexsort((i, d))[:k]
        want_i[r], want_d[r] = i[o], d[o]
    sizes = []
    real = topk.merge_keys
    monkeypatch.setattr(topk, "merge_keys", lambda bi_, bd_, nd, *a: (sizes.append(nd.size), real(bi_, bd_, nd, *a))[1])
    topk.merge_tile(bi, bd, dist, tids, k)
    np.testing.assert_array_equal(bi, want_i)
    np.testing.assert_array_equal(bd, want_d)
    assert sizes and sizes[0] <= topk.MERGE_CANDIDATES * b * k < b * w



@pytest.mark.parametrize("n", [1, 7, 80, 1023, 1024, 1025, 1104, 3006, 23020])
@pytest.mark.parametrize("most", [1, 3, 1024, 8192])
def test_even_tiles_are_as_few_as_the_cap_allows_and_never_thin(n, most):
    """even_tile: the fewest tiles of at most ``most`` rows (ceil(n / most)), all of one length
    but the last, which is at most one tile's length shorter than the others."""
    t = partition.even_tile(n, most)
    assert 1 <= t <= most
    lengths = [min(t, n - s) for s in range(0, n, t)]
    assert len(lengths) == -(-n // most)
    assert max(lengths) - min(lengths) < len(lengths)


def test_similarity_merge_tightens_only_the_rows_a_tile_floods(monkeypatch):
    """merge_similarity_tile selects a row's own k-th of the tile only for the rows from which
    more than ROW_CANDIDATES · k entries would pass their current bound: the other rows keep their
    bound and pass their few entries as they are. The sort sees at most ROW_CANDIDATES · k entries
    per row, and the result is the brute-force merge's, row for row."""
    rng = np.random.default_rng(11)
    b, w, k = 24, 900, 5
    sim = rng.uniform(-0.5, 0.9, (b, w)).astype(np.float32)  # continuous: no ties
    qg, tg = rng.integers(0, 3, b), rng.integers(0, 3, w)
    tids = rng.permutation(10 * w)[:w].astype(np.int64)
    bi = np.tile(np.arange(100_000, 100_000 + k, dtype=np.int64), (b, 1))
    bd = np.empty((b, k))
    bd[: b // 2] = 1.9  # flooded: every entry of the tile is closer than their k-th
    bd[b // 2 :] = 0.2  # quiet: only entries of similarity >= 0.8 can enter
    dist = np.clip(np.subtract(1, sim), 0, 2).astype(np.float64)
    dist[qg[:, None] == tg[None, :]] = np.inf
    want_i, want_d = np.empty((b, k), np.int64), np.empty((b, k))
    for r in range(b):
        d = np.concatenate([bd[r], dist[r]])
        i = np.concatenate([bi[r], tids])
        o = np.lexsort((i, d))[:k]
        want_i[r], want_d[r] = i[o], d[o]
    seen = []
    real = topk._merge_candidates
    monkeypatch.setattr(topk, "_merge_candidates",
                        lambda bi_, bd_, nd, nr, *a: (seen.append(np.bincount(nr, minlength=b)), real(bi_, bd_, nd, nr, *a))[1])
    selected = []
    real_partition = np.partition
    monkeypatch.setattr(topk.np, "partition", lambda a, *x, **kw: (selected.append(a.shape[0]), real_partition(a, *x, **kw))[1])
    topk.merge_similarity_tile(bi, bd, sim.copy(), qg, tg, tids, k)
    np.testing.assert_array_equal(bi, want_i)
    np.testing.assert_array_equal(bd, want_d)
    assert selected == [b // 2]  # the flooded rows only
    assert seen and seen[0].max() <= topk.ROW_CANDIDATES * k
    assert seen[0][b // 2 :].sum() > 0  # the quiet rows passed entries without a selection


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(3))
def test_similarity_tile_merge_equals_masked_distance_merge(dtype, seed):
    """merge_similarity_tile (distances for survivors only, group rule applied sparsely) gives the
    same running table as masking the dense distance tile and calling merge_tile, tile after tile:
    ties by index, rows with fewer than k eligible entries, similarities beyond ±1 (distances
    clipped to 0 and 2, where every entry ties), and a tile closer than every current neighbour.
    The tile is a view into a wider array (as the typed merges pass it): only its same-group
    entries are written (to -inf), nothing around it. Wide tiles bound their open rows by block
    maxima (:func:`~cachescore.neighbors.topk._kth_block_max`), narrow ones by a selection."""
    rng = np.random.default_rng(seed)
    b, k = 29, 6
    acc_ref = (np.full((b, k), -1, np.int64), np.full((b, k), np.inf))
    acc_new = (acc_ref[0].copy(), acc_ref[1].copy())
    qg = rng.integers(0, 4, b)
    seen, saw_open = 0, False
    for w in (3, 40, 200, 7, 120, 1500):
        if w == 1500:  # a fresh table: every row open on a tile of 128 blocks of 11 columns
            acc_ref = (np.full((b, k), -1, np.int64), np.full((b, k), np.inf))
            acc_new = (acc_ref[0].copy(), acc_ref[1].copy())
        # dyadic similarities with many ties, some beyond [-1, 1]
        sim = (rng.integers(-20, 21, (b, w)) / 16).astype(dtype)
        if w == 120:
            sim[:] = (rng.integers(15, 20, (b, w)) / 16).astype(dtype)  # closer than everything so far
        tg = rng.integers(0, 4, w)
        tids = (rng.permutation(10_000)[:w] + seen).astype(np.int64)
        seen += 10_000
        dist = np.clip(np.subtract(1, sim), 0, 2)
        dist[qg[:, None] == tg[None, :]] = np.inf
        topk.merge_tile(*acc_ref, dist, tids, k)
        wide = np.full((b + 2, w + 5), 7.0, dtype)
        wide[1:-1, 2:-3] = sim
        topk.merge_similarity_tile(*acc_new, wide[1:-1, 2:-3], qg, tg, tids, k)
        want = np.full_like(wide, 7.0)
        want[1:-1, 2:-3] = np.where(qg[:, None] == tg[None, :], -np.inf, sim)
        np.testing.assert_array_equal(wide, want)
        np.testing.assert_array_equal(acc_new[0], acc_ref[0])
        np.testing.assert_array_equal(acc_new[1], acc_ref[1])
        saw_open |= bool(np.isinf(acc_ref[1]).any())
    assert saw_open  # rows with fewer than k eligible entries were merged
    assert (acc_ref[1] == 0).any()  # similarities >= 1 (distance clipped to 0, all tied) entered


def test_same_group_pairs_lists_exactly_the_equal_pairs():
    rng = np.random.default_rng(2)
    qg, tg = rng.integers(0, 12, 50), rng.integers(0, 12, 300)
    r, c = topk.same_group_pairs(qg, tg)
    want = set(zip(*np.nonzero(qg[:, None] == tg[None, :])))
    assert set(zip(r.tolist(), c.tolist())) == {(int(a), int(b)) for a, b in want} and r.size == len(want)
    r, c = topk.same_group_pairs(np.array([1, 2]), np.array([3, 4]))
    assert r.size == c.size == 0


@pytest.mark.parametrize("d", [16, 768])
def test_a_pairs_similarity_does_not_depend_on_the_tile_it_is_computed_in(d):
    """:func:`similarity` pads small products, which this BLAS computes with other kernels (one
    row, one column, or M·N up to ~1,200: an ulp apart), so every entry equals the same entry of a
    large product."""
    from blas_equality import shape_invariant
    from threadpoolctl import threadpool_limits
    from cachescore.neighbors.partition import similarity

    rng = np.random.default_rng(d)
    a = rng.standard_normal((300, d)).astype(np.float32)
    b = rng.standard_normal((400, d)).astype(np.float32)
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    with threadpool_limits(limits=1, user_api="blas"):
        full = similarity(a, b)
        for (r0, r1), (c0, c1) in [((3, 4), (0, 400)), ((0, 300), (7, 8)), ((5, 7), (9, 11)), ((10, 42), (20, 57)),
                                   ((0, 2), (0, 300)), ((100, 300), (390, 400))]:
            got = similarity(a[r0:r1], b[c0:c1])
            assert got.flags.c_contiguous and got.shape == (r1 - r0, c1 - c0)
            if shape_invariant():  # else (a BLAS forced onto another kernel) an ulp: blas_equality.py
                np.testing.assert_array_equal(got, full[r0:r1, c0:c1])
            else:
                np.testing.assert_allclose(got, full[r0:r1, c0:c1], rtol=0, atol=4e-7)
