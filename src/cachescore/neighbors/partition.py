"""Building blocks of the out-of-core IVF search (:mod:`cachescore.neighbors.large_scope`).

Pure numpy, no Dask: every function takes the arrays it works on, so a worker task can call it on
the rows it has read from disk and nothing here ever needs the whole scope in memory.

* :func:`spherical_kmeans` / :func:`assign_clusters`: a k-means partition on the unit sphere
  (centroids from a row sample; every row assigned by one GEMM against the centroids).
* :func:`probe_order`, :func:`probe_stops`, :func:`probed_clusters`, :func:`probe_levels`:
  cluster-level probing. From query cluster ``a`` the clusters are visited by decreasing centroid
  similarity (``a`` first) until they hold a fraction ``f`` of the rows that matter (all rows for
  the cross-group search, the rows of one target cell for the typed search). Probe sets grow
  with ``f``; ``f >= 1`` probes every non-empty cluster, which makes the search exact.
* :func:`topk_tiles`: the exact kernel run on probed rows: blocked GEMMs
  (:func:`~cachescore.neighbors.normalize.cosine_distance_block`, the exact engines' arithmetic),
  same-group pairs set to ``+inf``, merged into a running top-k by ``(distance, global index)``.
"""

from __future__ import annotations

import numpy as np

from .normalize import cosine_distance_block
from .topk import merge_tile

__all__ = [
    "spherical_kmeans",
    "assign_clusters",
    "probe_order",
    "probe_stops",
    "probed_clusters",
    "probe_levels",
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


def probe_order(centroids: np.ndarray) -> np.ndarray:
    """(C, C) int32: row ``a`` lists the clusters by decreasing centroid similarity to ``a``,
    ``a`` itself first (ties by cluster code)."""
    sims = centroids @ centroids.T
    np.fill_diagonal(sims, np.inf)
    return np.argsort(-sims, axis=1, kind="stable").astype(np.int32)


def probe_stops(order: np.ndarray, sizes: np.ndarray, fractions) -> np.ndarray:
    """(C, F) int64: how many leading clusters of ``order[a]`` are probed at each fraction.

    ``sizes`` (C,) counts the rows that matter per cluster; at fraction ``f < 1`` the probe stops
    at the first cluster where the running total reaches ``f · sizes.sum()`` (that cluster
    included); at ``f >= 1`` every cluster is probed.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    c = order.shape[0]
    cum = np.cumsum(sizes[order], axis=1)  # (C, C)
    total = int(sizes.sum())
    out = np.empty((c, len(fractions)), dtype=np.int64)
    for i, f in enumerate(fractions):
        if f >= 1:
            out[:, i] = c
        else:
            out[:, i] = np.minimum(c, (cum < f * total).sum(axis=1) + 1)
    return out


def probed_clusters(order: np.ndarray, sizes: np.ndarray, a: int, stop: int) -> np.ndarray:
    """The non-empty clusters among the first ``stop`` of ``order[a]`` (see :func:`probe_stops`)."""
    sel = order[a, :stop]
    return sel[np.asarray(sizes)[sel] > 0]


def probe_levels(order: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """(C, C) int8: for query cluster ``a`` and cluster ``b``, the index of the first fraction at
    which ``b`` is probed from ``a`` (``F`` when never), given ``stops`` from :func:`probe_stops`."""
    c, f = stops.shape
    pos = np.empty_like(order)
    pos[np.arange(c)[:, None], order] = np.arange(c, dtype=order.dtype)[None, :]
    lev = np.full((c, c), f, dtype=np.int8)
    for i in range(f - 1, -1, -1):
        lev[pos < stops[:, i : i + 1]] = i
    return lev


def topk_tiles(qv, q_groups, tv, t_ids, t_groups, k, best_i, best_d, *, rows=None, tq=TILE_Q, tt=TILE_T) -> None:
    """Merge the exact top-``k`` other-group neighbours of the queries over the targets, in place.

    ``qv`` (b, d) and ``tv`` (r, d) normalised rows (one dtype); ``q_groups`` (b,) / ``t_groups``
    (r,) group codes (a same-group pair is never a neighbour); ``t_ids`` (r,) int64 global indices
    (the tie order); ``best_i`` (b, k) int64 and ``best_d`` (b, k) float64 hold the running result
    (``-1``/``+inf`` = empty), ordered by ``(distance, index)``. Distances are
    ``clip(1 - q·t, 0, 2)`` in the rows' dtype, one GEMM per ``tq × tt`` tile. The caller chooses
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
            dist = cosine_distance_block(qv[s:e], ut)
            dist[q_groups[s:e, None] == tg[None, :]] = np.inf
            merge_tile(best_i[s:e], best_d[s:e], dist, ids, k)
