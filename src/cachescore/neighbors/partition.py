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

from .topk import merge_similarity_tile

__all__ = [
    "spherical_kmeans",
    "assign_clusters",
    "probe_distances",
    "probed_clusters",
    "probe_chain",
    "ProbeRule",
    "ProbeGeometry",
    "calibrate_probe",
    "probe_ladder",
    "topk_tiles",
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
        new = np.zeros_like(cent)
        nz = np.flatnonzero(cnt)
        new[nz] = np.add.reduceat(x[srt], np.concatenate([[0], np.cumsum(cnt)[:-1]])[nz], axis=0)
        norms = np.linalg.norm(new, axis=1)
        empty = norms == 0
        if empty.any():
            new[empty] = x[rng.choice(s, size=int(empty.sum()), replace=False)]
            norms[empty] = np.linalg.norm(new[empty], axis=1)
        norms[norms == 0] = 1.0
        cent = new / norms[:, None]
    return np.ascontiguousarray(cent, dtype=np.float32)


def assign_clusters(u: np.ndarray, centroids: np.ndarray, *, block: int = 65536) -> np.ndarray:
    """Cluster code (n,) int32 of every row of ``u`` (n, d): the centroid of largest dot product."""
    out = np.empty(u.shape[0], dtype=np.int32)
    cent_t = np.ascontiguousarray(np.asarray(centroids, dtype=np.float32).T)
    for s in range(0, u.shape[0], block):
        out[s : s + block] = np.argmax(np.asarray(u[s : s + block], dtype=np.float32) @ cent_t, axis=1)
    return out


def probe_distances(centroids: np.ndarray) -> np.ndarray:
    """(C, C) float64 probe distances between clusters: ``1 - c_a · c_b`` of the unit centroids,
    ``-inf`` on the diagonal (a query cluster always probes itself first).

    From query cluster ``a`` every non-empty cluster ``b`` with ``dist[a, b] <= r`` is probed
    (:func:`probed_clusters`), for one *probe radius* ``r`` calibrated from exact answers: a
    centroid distance, so the probe set follows the data's local geometry (a query cluster in a
    small, tight tissue region probes few rows, one in a large region many) instead of a fixed
    share of the scope's rows for every cluster. ``r = +inf`` probes every cluster (exact).
    """
    c = np.asarray(centroids, dtype=np.float64)
    dist = c @ c.T
    np.subtract(1.0, dist, out=dist)  # in place: one (C, C) array, not two
    np.maximum(dist, 0.0, out=dist)
    np.fill_diagonal(dist, -np.inf)
    return dist


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


#: Rows of the probe distances sorted at a time when a :class:`ProbeGeometry` is built.
_GEOMETRY_ROWS = 64


class ProbeGeometry:
    """The probe distances of a partition with every query cluster's clusters in probe order
    (nearest first, ties by code; empty clusters included, they hold no rows), so the rows a rule
    probes and the rule that finds a calibration neighbour are array lookups.

    ``dist`` (C, C) from :func:`probe_distances`. Memory: ``dist`` (float64) and two int32
    (C, C) index arrays, plus one pool's (C, C) cumulative row count at a time (int32 while a
    pool holds fewer than 2**31 rows) while a calibration runs: C = n / 2048 grows with n, so these grow as
    n² (7.6 MB per float64 array at 2M rows); integers are kept at 4 bytes for that reason.
    """

    def __init__(self, dist: np.ndarray):
        self.dist = dist
        c = dist.shape[0]
        self.order = np.empty((c, c), dtype=np.int32)  # C < 2**31
        self.pos = np.empty((c, c), dtype=np.int32)
        ranks = np.broadcast_to(np.arange(c, dtype=np.int32), (min(c, _GEOMETRY_ROWS), c))
        for s in range(0, c, _GEOMETRY_ROWS):  # a block of rows at a time: no (C, C) int64 temporaries
            e = min(c, s + _GEOMETRY_ROWS)
            self.order[s:e] = np.argsort(dist[s:e], axis=1, kind="stable")
            np.put_along_axis(self.pos[s:e], self.order[s:e], ranks[: e - s], axis=1)

    def cum_rows(self, pool_sizes) -> np.ndarray:
        """(C, C): rows of the pool in the first ``j + 1`` clusters of each probe order (int32
        when the pool's rows fit, else int64; the same values either way)."""
        sizes = np.asarray(pool_sizes, dtype=np.int64)
        dtype = np.int32 if int(sizes.sum()) < np.iinfo(np.int32).max else np.int64
        cum = sizes.astype(dtype)[self.order]  # gathered at the pool's width, summed in place
        return np.cumsum(cum, axis=1, out=cum)

    def rows_before(self, cum: np.ndarray, pool_sizes, qa, nb) -> np.ndarray:
        """Pool rows in the clusters probed before cluster ``nb`` from query cluster ``qa``
        (arrays of equal shape): a floor of ``min_rows`` reaches ``nb`` iff this is ``< min_rows``."""
        return cum[qa, self.pos[qa, nb]] - np.asarray(pool_sizes, dtype=np.int64)[nb]

    def probed_rows(self, cum: np.ndarray, rule: ProbeRule) -> np.ndarray:
        """(C,) int64: pool rows each query cluster probes under ``rule``."""
        c = cum.shape[1]
        n_r = np.count_nonzero(self.dist <= rule.radius, axis=1)  # >= 1: the own cluster (a row's count
        # over its probe order is its count over the row: the same values, permuted)
        n_f = np.minimum(np.count_nonzero(cum < rule.min_rows, axis=1) + 1, c)
        return cum[np.arange(cum.shape[0]), np.maximum(n_r, n_f) - 1]


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
    d_parts, rb_parts = [], []
    for _, sizes, qa, nb in pools:  # one pool's (C, C) cumulative counts live at a time
        d_parts.append(geometry.dist[qa, nb])
        rb_parts.append(geometry.rows_before(geometry.cum_rows(sizes), sizes, qa, nb))
    d = np.concatenate(d_parts) if d_parts else np.zeros(0)
    rb = np.concatenate(rb_parts) if rb_parts else np.zeros(0, np.int64)
    need_total = int(np.ceil(min(1.0, float(target)) * d.size - 1e-9))
    biggest = max([int(np.asarray(s).sum()) for _, s, _, _ in pools] + [int(min_rows), 1])
    floors, f = [], float(max(1, int(min_rows)))
    while f < 2 * biggest:
        floors.append(int(round(f)))
        f *= 2 ** 0.5
    rules = []
    for floor in sorted(set(floors)):
        by_floor = rb < floor
        need = need_total - int(np.count_nonzero(by_floor))
        rules.append(ProbeRule(-np.inf if need <= 0 else float(np.sort(d[~by_floor])[need - 1]), floor))
    work = [0] * len(rules)  # summed pool by pool, in pool order, for every rule
    for w, sizes, _, _ in pools:
        cum = geometry.cum_rows(sizes)
        weights = np.asarray(w, dtype=np.float64)
        work = [total + float(np.dot(weights, geometry.probed_rows(cum, rule))) for total, rule in zip(work, rules)]
    best, best_work = None, None
    for rule, total in zip(rules, work):
        if best_work is None or total < best_work:
            best, best_work = rule, total
    return best


def probe_ladder(geometry: ProbeGeometry, pools, target: float, min_rows: int) -> tuple[ProbeRule, ...]:
    """Rules to try, each probing a superset of the previous: the calibrated rule at ``target``,
    at a quarter of its misses, at every calibration neighbour, then exact (``radius = inf``)."""
    rungs = []
    for want in (float(target), 1.0 - 0.25 * (1.0 - float(target)), 1.0):
        rule = calibrate_probe(geometry, pools, want, min_rows)
        rule = rule if not rungs else rungs[-1].widened(rule)
        if not rungs or rule != rungs[-1]:
            rungs.append(rule)
    return tuple(rungs) + (ProbeRule(float("inf"), int(min_rows)),)


def probe_chain(dist: np.ndarray) -> np.ndarray:
    """(C,) int64: every cluster once, each followed by its nearest not-yet-listed cluster (a
    greedy walk from cluster 0 over :func:`probe_distances`). Consecutive clusters of the chain
    are close, so a batch of them probes overlapping clusters and a search task reads fewer rows."""
    c = dist.shape[0]
    left = np.ones(c, dtype=bool)
    out = np.empty(c, dtype=np.int64)
    at = 0
    for i in range(c):
        out[i] = at
        left[at] = False
        if i + 1 < c:
            row = np.where(left, dist[at], np.inf)
            at = int(np.argmin(row))
    return out


def topk_tiles(qv, q_groups, tv, t_ids, t_groups, k, best_i, best_d, *, rows=None, tq=TILE_Q, tt=TILE_T) -> None:
    """Merge the exact top-``k`` other-group neighbours of the queries over the targets, in place.

    ``qv`` (b, d) and ``tv`` (r, d) normalised rows (one dtype); ``q_groups`` (b,) / ``t_groups``
    (r,) group codes (a same-group pair is never a neighbour); ``t_ids`` (r,) int64 global indices
    (the tie order); ``best_i`` (b, k) int64 and ``best_d`` (b, k) float64 hold the running result
    (``-1``/``+inf`` = empty), ordered by ``(distance, index)``. Distances are
    ``clip(1 - q·t, 0, 2)`` in the rows' dtype (the exact engines' arithmetic), one GEMM per
    ``tq × tt`` tile, converted to distances only for the entries that can enter the top-k
    (:func:`~cachescore.neighbors.topk.merge_similarity_tile`). The caller chooses
    the targets: all probed rows (cross-group) or one SO/OS pool cell (typed), so the group rule is
    the only mask. ``rows`` (optional int array) selects the targets among ``tv``'s rows; they are
    gathered one ``tt`` tile at a time, so a selection never copies the whole target set.
    """
    n_t = tv.shape[0] if rows is None else len(rows)
    if qv.shape[0] == 0 or n_t == 0:
        return
    for t0 in range(0, n_t, tt):
        t1 = min(n_t, t0 + tt)
        at = slice(t0, t1) if rows is None else rows[t0:t1]
        ut, ids, tg = tv[at], t_ids[at], t_groups[at]
        for s in range(0, qv.shape[0], tq):
            e = min(qv.shape[0], s + tq)
            merge_similarity_tile(best_i[s:e], best_d[s:e], qv[s:e] @ ut.T, q_groups[s:e], tg, ids, k)
