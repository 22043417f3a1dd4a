"""Building blocks of the out-of-core IVF search (:mod:`cachescore.neighbors.large_scope`).

Pure numpy, no Dask: every function takes the arrays it works on, so a worker task can call it on
the rows it has read from disk and nothing here ever needs the whole scope in memory.

* :func:`spherical_kmeans` / :func:`assign_clusters`: a k-means partition on the unit sphere
  (centroids from a row sample; every row assigned by one GEMM against the centroids).
* :func:`probe_distances`, :func:`probed_clusters`, :func:`probe_chain`: cluster-level probing.
  From query cluster ``a`` every non-empty cluster whose centroid lies within a *probe radius*
  ``r`` of ``a``'s (``1 - c_a·c_b <= r``; ``a`` itself always) is probed, for all rows (the
  cross-group search) or for the rows of each target cell (the typed search), grown by the next
  nearest clusters to a floor of rows. Probe sets grow with ``r``; ``r = inf`` probes every
  non-empty cluster, which makes the search exact.
* :class:`ProbeRule`, :class:`ProbeGeometry`, :func:`calibrate_probe`, :func:`probe_ladder`: the
  (radius, floor) rule of least probe work that finds a target share of the calibration
  sample's exact neighbours, and the widening rungs after it (ADR-0013).
* :func:`topk_tiles`: the exact kernel run on probed rows: blocked similarity GEMMs, each tile
  merged into a running top-k by ``(distance, global index)`` with the exact engines' arithmetic
  (``clip(1 - s, 0, 2)``) on the surviving entries only and same-group pairs never entering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._threads import shared_blas_pin
from .topk import merge_similarity_tile

__all__ = [
    "spherical_kmeans",
    "segment_sums",
    "assign_clusters",
    "probe_distances",
    "probed_clusters",
    "probe_chain",
    "ProbeRule",
    "ProbeGeometry",
    "ProbeBlock",
    "probe_work",
    "calibrate_probe",
    "probe_ladder",
    "topk_tiles",
    "even_tile",
]

#: Query rows × target rows of one distance tile in :func:`topk_tiles`.
TILE_Q, TILE_T = 1024, 8192


def spherical_kmeans(x: np.ndarray, n_clusters: int, *, random_state=None, iters: int = 8) -> np.ndarray:
    """Centroids (C, d) float32 of unit-norm rows ``x`` (s, d): spherical k-means, ``iters`` rounds.

    ``C = min(n_clusters, s)``; initial centroids are distinct rows drawn with ``random_state``;
    an emptied cluster is reseeded with a random row. Same inputs ⇒ same centroids.
    Raises ``ValueError`` when ``x`` has no rows or ``n_clusters < 1``.
    """
    x = np.asarray(x, dtype=np.float32)
    s = x.shape[0]
    if s == 0 or int(n_clusters) < 1:
        raise ValueError(f"spherical_kmeans needs rows and n_clusters >= 1, got {s} rows, {n_clusters}")
    c = min(int(n_clusters), s)
    rng = np.random.default_rng(random_state)
    cent = x[rng.choice(s, size=c, replace=False)].copy()
    for _ in range(int(iters)):
        lab = np.argmax(x @ cent.T, axis=1)
        srt = np.argsort(lab, kind="stable")
        cnt = np.bincount(lab, minlength=c)
        new = segment_sums(x[srt], cnt)
        norms = np.linalg.norm(new, axis=1)
        empty = norms == 0
        if empty.any():
            new[empty] = x[rng.choice(s, size=int(empty.sum()), replace=False)]
            norms[empty] = np.linalg.norm(new[empty], axis=1)
        norms[norms == 0] = 1.0
        cent = new / norms[:, None]
    return np.ascontiguousarray(cent, dtype=np.float32)


def segment_sums(xs: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per segment of consecutive rows of ``xs`` (s, d) (``counts`` (c,) rows each, in order;
    zeros allowed): the sum of its rows, (c, d) in ``xs``' dtype (zero rows for empty segments).

    Bit for bit ``np.add.reduceat(xs, starts, axis=0)`` on the non-empty segments: a segment's
    first row plus numpy's pairwise sum of the others (:func:`_pairwise_rows`), but a row of d
    values at a time instead of a strided column at a time (~15x faster at 20,000 x 768 in 196
    segments), so the k-means centroids, and every partition built from them, are unchanged."""
    out = np.zeros((counts.size, xs.shape[1]), dtype=xs.dtype)
    at = 0
    for j, m in enumerate(np.asarray(counts).tolist()):
        if m:
            out[j] = xs[at]
            if m > 1:
                out[j] += _pairwise_rows(xs[at + 1 : at + m])
        at += m
    return out


def _pairwise_rows(v: np.ndarray) -> np.ndarray:
    """numpy's pairwise summation (blocks of 128, eight accumulators, halves split at a multiple
    of 8) of the rows of ``v`` (n, d), n >= 1, applied to all d columns at once: the additions
    a reduction of each column performs, in the same order."""
    n = v.shape[0]
    if n < 8:
        res = np.zeros(v.shape[1], dtype=v.dtype)
        for i in range(n):
            res += v[i]
        return res
    if n <= 128:
        r = v[:8].copy()
        for i in range(8, n - n % 8, 8):
            r += v[i : i + 8]
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        for i in range(n - n % 8, n):
            res += v[i]
        return res
    half = n // 2
    half -= half % 8
    return _pairwise_rows(v[:half]) + _pairwise_rows(v[half:])


def assign_clusters(u: np.ndarray, centroids: np.ndarray, *, block: int = 65536) -> np.ndarray:
    """Cluster code (n,) int32 of every row of ``u`` (n, d): the centroid of largest dot product."""
    out = np.empty(u.shape[0], dtype=np.int32)
    cent_t = np.ascontiguousarray(np.asarray(centroids, dtype=np.float32).T)
    for s in range(0, u.shape[0], block):
        out[s : s + block] = np.argmax(np.asarray(u[s : s + block], dtype=np.float32) @ cent_t, axis=1)
    return out


#: Query clusters whose probe distances, probe orders and cumulative pool rows are held at a time
#: (:class:`ProbeGeometry`): the geometry's memory is ``GEOMETRY_ROWS × C``, never ``C × C``.
GEOMETRY_ROWS = 64

#: Nearest clusters listed per cluster for :func:`probe_chain` (a longer walk past them computes
#: the cluster's distance row again).
CHAIN_WIDTH = 32


def probe_distances(centroids: np.ndarray) -> np.ndarray:
    """(C, C) float64 probe distances between clusters: ``1 - c_a · c_b`` of the unit centroids,
    clipped at 0, ``-inf`` on the diagonal (a query cluster always probes itself first); the rows
    of :meth:`ProbeGeometry.distance_blocks`, stacked (tests and small partitions only: the
    engine never holds the (C, C) matrix).

    From query cluster ``a`` every non-empty cluster ``b`` with ``dist[a, b] <= r`` is probed
    (:func:`probed_clusters`), for one *probe radius* ``r`` calibrated from exact answers: a
    centroid distance, so the probe set follows the data's local geometry (a query cluster in a
    small, tight tissue region probes few rows, one in a large region many) instead of a fixed
    share of the scope's rows for every cluster. ``r = +inf`` probes every cluster (exact).
    """
    geometry = ProbeGeometry(centroids)
    return np.concatenate([dist for _, _, dist in geometry.distance_blocks()], axis=0)


def probed_clusters(dist_row: np.ndarray, sizes: np.ndarray, radius: float, min_rows: int = 0) -> np.ndarray:
    """The non-empty clusters (``sizes > 0``) within ``radius`` of one query cluster, given its
    row ``dist_row`` (C,) of :func:`probe_distances`; nearest first, ties by cluster code (int64).

    When they hold fewer than ``min_rows`` rows (of ``sizes``), the next nearest non-empty
    clusters are added until they do (or none is left): with ``min_rows = k + largest group``
    every query has at least ``k`` other-group candidates however small its ball is.
    """
    d = np.asarray(dist_row)
    sizes = np.asarray(sizes)
    sel = np.flatnonzero(sizes > 0)
    sel = sel[np.argsort(d[sel], kind="stable")]
    stop = int(np.count_nonzero(d[sel] <= radius))
    if min_rows > 0 and stop < sel.size:
        cum = np.cumsum(sizes[sel])
        stop = max(stop, min(sel.size, int(np.searchsorted(cum, min_rows)) + 1))
    return sel[:stop].astype(np.int64)


@dataclass(frozen=True)
class ProbeRule:
    """What a query cluster probes in one pool (all rows, or one typed target cell): every
    non-empty cluster within ``radius`` of its centroid, and the next nearest ones until they
    hold ``min_rows`` rows of the pool (:func:`probed_clusters`). ``radius = inf`` is exact."""

    radius: float
    min_rows: int

    @property
    def exact(self) -> bool:
        return math.isinf(self.radius) and self.radius > 0

    def widened(self, other: "ProbeRule") -> "ProbeRule":
        """The rule probing both rules' sets (their union, per query cluster and pool)."""
        return ProbeRule(max(self.radius, other.radius), max(self.min_rows, other.min_rows))


@dataclass(frozen=True)
class ProbeBlock:
    """The probe geometry of query clusters ``start:stop``: their distance rows ``dist``
    (b, C) float64 and their probe orders ``order`` (b, C) int32 (every cluster, nearest first,
    ties by code; empty clusters included, they hold no rows) with each cluster's place in them
    ``pos`` (b, C) int32, so the rows a rule probes and the rule that finds a neighbour are array
    lookups."""

    start: int
    stop: int
    dist: np.ndarray
    order: np.ndarray
    pos: np.ndarray

    def cum_rows(self, pool_sizes) -> np.ndarray:
        """(b, C): rows of the pool in the first ``j + 1`` clusters of each probe order (int32
        when the pool's rows fit, else int64; the same values either way)."""
        sizes = np.asarray(pool_sizes, dtype=np.int64)
        dtype = np.int32 if int(sizes.sum()) < np.iinfo(np.int32).max else np.int64
        cum = sizes.astype(dtype)[self.order]  # gathered at the pool's width, summed in place
        return np.cumsum(cum, axis=1, out=cum)

    def rows_before(self, cum: np.ndarray, pool_sizes, qa, nb) -> np.ndarray:
        """Pool rows in the clusters probed before cluster ``nb`` from query cluster ``qa`` (arrays
        of equal shape, ``qa`` in this block): a floor of ``min_rows`` reaches ``nb`` iff this is
        ``< min_rows``."""
        r = np.asarray(qa, dtype=np.int64) - self.start
        return cum[r, self.pos[r, nb]] - np.asarray(pool_sizes, dtype=np.int64)[nb]

    def probed_rows(self, cum: np.ndarray, rules) -> np.ndarray:
        """(b, len(rules)) int64: pool rows each query cluster of the block probes under each rule."""
        b, c = cum.shape
        radii = np.array([r.radius for r in rules], dtype=np.float64)
        floors = np.array([r.min_rows for r in rules], dtype=np.int64)
        near = np.take_along_axis(self.dist, self.order.astype(np.intp), axis=1)  # each row ascending
        # clusters within the radius / before the floor is reached, row by row (a row's counts over
        # its probe order are its counts over the row: the same values, permuted)
        n_r = np.stack([np.searchsorted(near[i], radii, side="right") for i in range(b)]) if b else np.zeros((0, radii.size), np.int64)
        n_f = np.stack([np.searchsorted(cum[i], floors, side="left") for i in range(b)]) if b else np.zeros((0, radii.size), np.int64)
        last = np.maximum(n_r, np.minimum(n_f + 1, c)) - 1
        return np.take_along_axis(cum, last, axis=1).astype(np.int64)


class ProbeGeometry:
    """The probe geometry of a partition, from its centroids (C, d), ``GEOMETRY_ROWS`` query
    clusters at a time (:class:`ProbeBlock`): memory O(``GEOMETRY_ROWS`` · C) whatever C (C = n /
    2048 grows with the scope; a (C, C) geometry would grow as n²: ~1.2 GB at 10M rows).

    Distance rows are computed in blocks aligned on multiples of ``GEOMETRY_ROWS`` with BLAS on
    one thread, so a cluster's row has the same bits however often and in whatever order it is
    asked for (calibration, the search plan, the chain): a rule calibrated on a distance probes by
    that same distance.
    """

    def __init__(self, centroids: np.ndarray):
        self.centroids = np.ascontiguousarray(np.asarray(centroids, dtype=np.float64))
        self.n_clusters = int(self.centroids.shape[0])
        self._last: tuple[int, np.ndarray] | None = None

    def _distances(self, start: int) -> np.ndarray:
        """Distance rows of the aligned block starting at ``start`` (b, C) float64."""
        c = self.centroids
        stop = min(self.n_clusters, start + GEOMETRY_ROWS)
        with shared_blas_pin():
            dist = c[start:stop] @ c.T
        np.subtract(1.0, dist, out=dist)
        np.maximum(dist, 0.0, out=dist)
        dist[np.arange(stop - start), np.arange(start, stop)] = -np.inf
        return dist

    def distance_blocks(self):
        """``(start, stop, dist)`` for every aligned block of query clusters, in order."""
        for s in range(0, self.n_clusters, GEOMETRY_ROWS):
            yield s, min(self.n_clusters, s + GEOMETRY_ROWS), self._distances(s)

    def blocks(self):
        """Every :class:`ProbeBlock`, in order of query cluster."""
        c = self.n_clusters
        for s, e, dist in self.distance_blocks():
            order = np.argsort(dist, axis=1, kind="stable").astype(np.int32)  # C < 2**31
            pos = np.empty_like(order)
            np.put_along_axis(pos, order.astype(np.intp), np.broadcast_to(np.arange(c, dtype=np.int32), order.shape), axis=1)
            yield ProbeBlock(s, e, dist, order, pos)

    def row(self, a: int) -> np.ndarray:
        """(C,) distance row of query cluster ``a`` (its block is kept until another is asked for)."""
        start = (int(a) // GEOMETRY_ROWS) * GEOMETRY_ROWS
        if self._last is None or self._last[0] != start:
            self._last = (start, self._distances(start))
        return self._last[1][int(a) - start]


def _neighbour_reach(geometry: ProbeGeometry, pools) -> tuple[np.ndarray, np.ndarray]:
    """For every calibration neighbour (pools concatenated in order): its cluster's distance from
    its query cluster, and the pool rows probed before that cluster (:meth:`ProbeBlock.rows_before`)."""
    sizes_of = [np.asarray(sz) for _, sz, _, _ in pools]
    qas = [np.asarray(qa, dtype=np.int64) for _, _, qa, _ in pools]
    nbs = [np.asarray(nb, dtype=np.int64) for _, _, _, nb in pools]
    d = [np.empty(qa.size, dtype=np.float64) for qa in qas]
    rb = [np.empty(qa.size, dtype=np.int64) for qa in qas]
    by_query = [np.argsort(qa, kind="stable") for qa in qas]
    for blk in geometry.blocks():
        for p, (sz, qa, nb, srt) in enumerate(zip(sizes_of, qas, nbs, by_query)):
            lo, hi = np.searchsorted(qa[srt], [blk.start, blk.stop])
            sel = srt[lo:hi]
            if sel.size == 0:
                continue
            d[p][sel] = blk.dist[qa[sel] - blk.start, nb[sel]]
            rb[p][sel] = blk.rows_before(blk.cum_rows(sz), sz, qa[sel], nb[sel])
    return (np.concatenate(d) if d else np.zeros(0)), (np.concatenate(rb) if rb else np.zeros(0, np.int64))


def probe_work(geometry: ProbeGeometry, pools, rules) -> np.ndarray:
    """(len(rules),) int64: the probe work ``sum_p sum_a query_weights[a] · probed_rows_p[a]`` of
    each rule over ``pools`` (see :func:`calibrate_probe`), in one pass over the geometry."""
    work = np.zeros(len(rules), dtype=np.int64)
    if not rules:
        return work
    for blk in geometry.blocks():
        for w, sz, _, _ in pools:
            weights = np.asarray(w, dtype=np.int64)[blk.start : blk.stop]
            work += weights @ blk.probed_rows(blk.cum_rows(sz), rules)
    return work


def _floors(pools, min_rows: int) -> list[int]:
    """The floor grid ``min_rows · 2^(j/2)`` up to twice the largest pool."""
    biggest = max([int(np.asarray(s).sum()) for _, s, _, _ in pools] + [int(min_rows), 1])
    floors, f = [], float(max(1, int(min_rows)))
    while f < 2 * biggest:
        floors.append(int(round(f)))
        f *= 2 ** 0.5
    return sorted(set(floors))


def _least_work_rules(geometry: ProbeGeometry, pools, targets, min_rows: int) -> list[ProbeRule]:
    """:func:`calibrate_probe` for several targets: one pass over the geometry for the
    neighbours' reach, one for the work of every candidate rule."""
    d, rb = _neighbour_reach(geometry, pools)
    floors = _floors(pools, min_rows)
    candidates = []
    for target in targets:
        need_total = int(np.ceil(min(1.0, float(target)) * d.size - 1e-9))
        rules = []
        for floor in floors:
            by_floor = rb < floor
            need = need_total - int(np.count_nonzero(by_floor))
            rules.append(ProbeRule(-np.inf if need <= 0 else float(np.sort(d[~by_floor])[need - 1]), floor))
        candidates.append(rules)
    unique = list(dict.fromkeys(r for rules in candidates for r in rules))
    work = dict(zip(unique, probe_work(geometry, pools, unique).tolist()))
    # the first rule of least work, in floor order (exact integer totals: no rounding decides)
    return [min(rules, key=lambda r: work[r]) for rules in candidates]


def calibrate_probe(geometry: ProbeGeometry, pools, target: float, min_rows: int) -> ProbeRule:
    """The rule of least probe work whose recall on the calibration neighbours reaches ``target``.

    ``pools``: one ``(query_weights, pool_sizes, qa, nb)`` per pool: ``query_weights`` (C,) how
    many queries of each cluster search the pool, ``pool_sizes`` (C,) its rows per cluster,
    ``qa``/``nb`` (N_p,) the query cluster and the cluster of each valid true neighbour in the
    pool. A neighbour is found (exactly: probed rows are searched exhaustively) iff its cluster is
    within the radius or reached by the floor. For each floor of a geometric grid (``min_rows``
    · 2^(j/2)) the smallest radius reaching ``target`` follows from the neighbours the floor
    misses; the pair of least work ``sum_p sum_a query_weights[a] · probed_rows_p[a]`` wins.
    Every rule has ``min_rows >=`` the given floor.
    """
    return _least_work_rules(geometry, pools, [target], min_rows)[0]


def probe_ladder(geometry: ProbeGeometry, pools, target: float, min_rows: int) -> tuple[ProbeRule, ...]:
    """Rules to try, each probing a superset of the previous: the calibrated rule at ``target``,
    at a quarter of its misses, at every calibration neighbour, then exact (``radius = inf``)."""
    wants = (float(target), 1.0 - 0.25 * (1.0 - float(target)), 1.0)
    rungs = []
    for rule in _least_work_rules(geometry, pools, wants, min_rows):
        rule = rule if not rungs else rungs[-1].widened(rule)
        if not rungs or rule != rungs[-1]:
            rungs.append(rule)
    return tuple(rungs) + (ProbeRule(float("inf"), int(min_rows)),)


def probe_chain(geometry: ProbeGeometry, *, width: int = CHAIN_WIDTH) -> np.ndarray:
    """(C,) int64: every cluster once, each followed by its nearest not-yet-listed cluster (ties
    by code; a greedy walk from cluster 0 over the probe distances). Consecutive clusters of the
    chain are close, so a batch of them probes overlapping clusters and a search task reads fewer
    rows. Each cluster's ``width`` nearest are listed once (C × width); a cluster whose listed
    ones are all taken gets its distance row again (:meth:`ProbeGeometry.row`)."""
    c = geometry.n_clusters
    width = max(1, min(int(width), c))
    near = np.empty((c, width), dtype=np.int32)
    for blk in geometry.blocks():
        near[blk.start : blk.stop] = blk.order[:, :width]
    left = np.ones(c, dtype=bool)
    out = np.empty(c, dtype=np.int64)
    at = 0
    for i in range(c):
        out[i] = at
        left[at] = False
        if i + 1 < c:
            listed = near[at][left[near[at]]]
            at = int(listed[0]) if listed.size else int(np.argmin(np.where(left, geometry.row(at), np.inf)))
    return out


#: A GEMM with fewer rows or columns than this is padded with zero rows up to it: this BLAS
#: computes small products (M·N up to ~1,200, or one row or column) with other kernels, whose
#: entries differ by an ulp from the same entries of a larger product (tests/blas_equality.py).
GEMM_MIN_SIDE = 64


def similarity(qv: np.ndarray, tv: np.ndarray) -> np.ndarray:
    """``qv @ tv.T`` ((b, d) by (w, d) rows of one dtype -> (b, w), C-contiguous), each entry the
    same float whatever ``b`` and ``w`` (both padded to :data:`GEMM_MIN_SIDE` when smaller), so a
    pair's similarity does not depend on the tile it is computed in."""
    b, w = qv.shape[0], tv.shape[0]
    if b >= GEMM_MIN_SIDE and w >= GEMM_MIN_SIDE:
        return qv @ tv.T

    def padded(x):
        if x.shape[0] >= GEMM_MIN_SIDE:
            return x
        return np.concatenate([x, np.zeros((GEMM_MIN_SIDE - x.shape[0], x.shape[1]), dtype=x.dtype)])

    return np.ascontiguousarray((padded(qv) @ padded(tv).T)[:b, :w])


def even_tile(n: int, most: int) -> int:
    """The tile length that cuts ``n`` rows into as few tiles of at most ``most`` rows as
    possible, of equal length but the last: 1,104 query rows in tiles of 552, not 1,024 and a
    thin 80-row tile whose GEMM runs at a fraction of the rate (the tiling changes no value: a
    pair's similarity does not depend on its tile, :func:`similarity`)."""
    n, most = int(n), max(1, int(most))
    return max(1, -(-n // -(-n // most))) if n > 0 else most


def topk_tiles(qv, q_groups, tv, t_ids, t_groups, k, best_i, best_d, *, rows=None, tq=TILE_Q, tt=TILE_T,
               share=None) -> None:
    """Merge the exact top-``k`` other-group neighbours of the queries over the targets, in place.

    ``qv`` (b, d) and ``tv`` (r, d) normalised rows (one dtype); ``q_groups`` (b,) / ``t_groups``
    (r,) group codes (a same-group pair is never a neighbour); ``t_ids`` (r,) int64 global indices
    (the tie order); ``best_i`` (b, k) int64 and ``best_d`` (b, k) float64 hold the running result
    (``-1``/``+inf`` = empty), ordered by ``(distance, index)``. Distances are
    ``clip(1 - q·t, 0, 2)`` in the rows' dtype (the exact engines' arithmetic), one GEMM per
    tile of at most ``tq × tt`` (equal tiles, :func:`even_tile`), converted to distances only for
    the entries that can enter the top-k (:func:`~cachescore.neighbors.topk.merge_similarity_tile`). The caller chooses
    the targets: all probed rows (cross-group) or one SO/OS pool cell (typed), so the group rule is
    the only mask. ``rows`` (optional int array) selects the targets among ``tv``'s rows; they are
    gathered one ``tt`` tile at a time, so a selection never copies the whole target set.
    ``share`` (optional) is called as ``share(sim, s, e, t0, t1)`` with each similarity tile
    before this merge overwrites it: queries ``s:e`` of ``qv`` by targets ``t0:t1`` of the
    selection, so another search over a subset of the same pairs reuses the GEMM (it may set
    same-group pairs of ``sim`` to ``-inf``, as this merge does, and must write nothing else).
    """
    n_t = tv.shape[0] if rows is None else len(rows)
    if qv.shape[0] == 0 or n_t == 0:
        return
    tq, tt = even_tile(qv.shape[0], tq), even_tile(n_t, tt)
    for t0 in range(0, n_t, tt):
        t1 = min(n_t, t0 + tt)
        at = slice(t0, t1) if rows is None else rows[t0:t1]
        ut, ids, tg = tv[at], t_ids[at], t_groups[at]
        for s in range(0, qv.shape[0], tq):
            e = min(qv.shape[0], s + tq)
            sim = similarity(qv[s:e], ut)
            if share is not None:
                share(sim, s, e, t0, t1)
            merge_similarity_tile(best_i[s:e], best_d[s:e], sim, q_groups[s:e], tg, ids, k)
