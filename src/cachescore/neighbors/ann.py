"""Approximate neighbour search with exact distances and a measured recall (spec/metrics.md §12.4).

Same return contracts as the exact engines, so the metrics can swap backends:

* :func:`cross_group_knn_ann` ↔ :func:`cachescore.neighbors.exact.cross_group_knn`;
* :func:`typed_knn_ann` ↔ :func:`cachescore.neighbors.typed.typed_knn`.

Two methods (``method=``):

``"ivf"`` (default; no numba)
    1. A spherical k-means partition of the scope (``ceil(n / IVF_ROWS_PER_CLUSTER)`` clusters,
       centroids from a sample, every row assigned by one GEMM).
    2. The rows of each cluster ``A`` are searched **exactly** (blocked GEMMs, same-group rows
       excluded, top-k by (distance, index)) over the rows of the clusters nearest to ``A``'s
       centroid, taken until they hold a *probe fraction* ``f`` of the searched rows (typed search:
       per target cell, ``f`` of that cell). Work ``≈ f · n² · d``, all in BLAS.
    3. ``f`` is calibrated before the search: the exact answers of a calibration sample (its own
       seed) tell, for each candidate fraction of :data:`IVF_FRACTIONS`, how many true neighbours
       the probed clusters hold; the smallest ``f`` reaching the target (plus half the remaining
       margin) is used. When none does below :data:`IVF_EXACT_FRACTION` the exact engine answers
       (recall 1; on isotropic data the partition cannot prune).
    4. The recall is then **measured** on a separate audit sample against brute-force search;
       below the target ``f`` doubles (at most ``max_rounds`` times), then
       :class:`RecallTargetError`.

``"graph"`` (pynndescent)
    A pynndescent graph per scope (per target cell for the typed search) proposes ``k + G + 1``
    candidates per query (``G`` = largest group), widened (query width, ``epsilon``, graph
    neighbours of kept rows) while the measured recall is below the target. Candidate distances are
    recomputed as ``clip(1 - u_i·u_j, 0, 2)`` in ``u``'s dtype; pynndescent's own are never used.

Recall, as measured here, is tie-robust: for a sampled query with exact k-th distance ``r`` the
number of returned neighbours at distance ``<= r + tol`` (at most k) over k, summed over queries.
``tol`` (:func:`distance_tol`) absorbs the rounding difference between two kernels computing one
pair (a few float32 ulps; spec §12.3). Rows returned are always valid (other group, exact
distance); a miss only means a farther row took a slot.

Memory: no ``n × n`` array; distance tiles are ``IVF_TILE_Q × IVF_TILE_T`` (ivf) and candidate
tables are processed in query blocks of bounded size (graph: :data:`GATHER_BYTES`); pynndescent
holds a float32 copy of the searched rows. The recall audit costs ``n_recall_queries × n × d``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._finite import require_finite
from .exact import cross_group_knn
from .normalize import cosine_distance_block
from .partition import (
    spherical_kmeans,  # partition imports this module's merge kernel
)
from .recall import (
    RecallTargetError,
    calibrate_fraction,
    check_positive_int,
    distance_tol,
    recall_counts,
    sample_queries,
    seed_of,
)
from .topk import merge_tables, merge_tile, topk
from .typed import typed_knn

__all__ = [
    "AnnSearch",
    "distance_tol",
    "GATHER_BYTES",
    "RecallTargetError",
    "AnnKnnResult",
    "AnnTypedResult",
    "auto_n_neighbors",
    "project_rows",
    "cross_group_knn_ann",
    "cross_group_knn_ann_with_recall",
    "typed_knn_ann",
    "typed_knn_ann_with_recall",
    "exact_knn_rows",
    "exact_typed_rows",
    "measure_recall",
    "measure_typed_recall",
]

#: Upper bound (bytes) of the gathered candidate rows ``u[cand]`` held at once in a query block.
GATHER_BYTES = 64 * 2**20

#: Edge of the square distance tiles used by the brute-force paths (audit and small scopes).
BRUTE_BLOCK = 2048

#: Target cells with at most this many rows are searched by brute force in the typed search: a
#: per-cell graph costs a fixed ~10 s (numba compiles each index's query closure) plus the build.
TYPED_BRUTE_MAX_ROWS = 32768

#: Query rows handled at once by a graph search (bounds the candidate tables).
QUERY_BLOCK = 16384

#: Scopes with at most this many rows are searched by brute force (a graph would not pay off).
BRUTE_MAX_ROWS = 2048


@dataclass(frozen=True, kw_only=True)
class AnnKnnResult:
    """Cross-group neighbours from :func:`cross_group_knn_ann_with_recall`.

    ``idx`` (n, kmax) int64 padded -1 and ``dist`` (n, kmax) float64 padded +inf follow the exact
    contract; ``recall`` is the value measured on ``n_recall_queries`` sampled rows after
    ``rounds`` widenings (0 = first pass), with ``candidate_width`` candidates per query in the
    last pass. ``exact`` is True when the scope was small enough to be searched by brute force.
    """

    idx: np.ndarray
    dist: np.ndarray
    recall: float
    recall_target: float
    n_recall_queries: int
    rounds: int
    candidate_width: int
    exact: bool
    method: str = "graph"
    probe_fraction: float = 1.0
    n_clusters: int = 0


@dataclass(frozen=True, kw_only=True)
class AnnTypedResult:
    """Typed neighbour distances from :func:`typed_knn_ann_with_recall`.

    ``so_dist`` / ``os_dist`` (n, m) float64 ascending, +inf padded, as ``typed_knn``; ``recall``
    pools SO and OS over ``n_recall_queries`` sampled rows; ``rounds`` widenings were needed;
    ``exact_cells`` of the ``n_cells`` target cells were small enough for brute force.
    """

    so_dist: np.ndarray
    os_dist: np.ndarray
    recall: float
    recall_target: float
    n_recall_queries: int
    rounds: int
    n_cells: int
    exact_cells: int
    method: str = "graph"
    probe_fraction: float = 1.0


# --------------------------------------------------------------------------------------------
# validation


def _check_u(u) -> np.ndarray:
    if not isinstance(u, np.ndarray):
        u = np.asarray(u)
    if u.ndim != 2:
        raise ValueError(f"u must be a 2-D array of normalised rows (n, d), got {u.ndim}-D")
    if u.dtype not in (np.float32, np.float64):
        raise TypeError(f"u must be float32 or float64 normalised rows, got dtype {u.dtype}")
    return u


def _check_codes(name: str, a, n: int) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) to match u, got {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must hold integer codes, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def _check_target(recall_target) -> float:
    t = float(recall_target)
    if not 0.0 < t <= 1.0:
        raise ValueError(f"recall_target must be in (0, 1], got {recall_target!r}")
    return t


# --------------------------------------------------------------------------------------------
# kernels (numpy in, numpy out)


def _refine(u, groups, qrows, cand, k):
    """Exact top-k of candidates for queries ``qrows``: dedupe, drop same-group, recompute, rank.

    ``cand`` (b, w) global row indices, -1 = none. Distances are ``clip(1 - u_q·u_j, 0, 2)`` in u's
    dtype (a batched dot product), returned as float64. Processed in blocks of bounded memory.
    """
    nq, w = cand.shape
    out_i = np.empty((nq, k), dtype=np.int64)
    out_d = np.empty((nq, k), dtype=np.float64)
    step = max(1, GATHER_BYTES // max(1, w * u.shape[1] * u.itemsize))
    for s in range(0, nq, step):
        c = np.sort(cand[s : s + step], axis=1)
        q = qrows[s : s + step]
        bad = c < 0
        bad[:, 1:] |= c[:, 1:] == c[:, :-1]
        safe = np.where(bad, 0, c)
        bad |= groups[safe] == groups[q][:, None]
        uq = np.asarray(u[q])
        dots = np.matmul(np.asarray(u[safe.ravel()]).reshape(c.shape + (u.shape[1],)), uq[:, :, None])[..., 0]
        np.subtract(1, dots, out=dots)
        np.clip(dots, 0, 2, out=dots)
        d = dots.astype(np.float64)
        d[bad] = np.inf
        out_i[s : s + step], out_d[s : s + step] = topk(d, safe, k)
    return out_i, out_d


def _brute(u, groups, qrows, trows, k, *, block=BRUTE_BLOCK):
    """Exact top-k by (dist, idx) of ``qrows`` over target rows ``trows`` (1-D global indices),
    excluding same-group targets; blocked GEMMs of ``block × 4·block`` tiles (no |q|×|t| array).
    Returns global indices (|q|, k) int64 and distances float64, (-1, +inf) padded."""
    qrows = np.asarray(qrows, dtype=np.int64)
    trows = np.asarray(trows, dtype=np.int64)
    best_i = np.full((qrows.size, k), -1, np.int64)
    best_d = np.full((qrows.size, k), np.inf)
    _knn_into(u, groups, qrows, trows, k, best_i, best_d, tq=block, tt=4 * block)
    return best_i, best_d


# --------------------------------------------------------------------------------------------
# a searched scope: a graph over some rows, or brute force when small


def project_rows(u, dim, *, random_state=None, sample=10000, block=65536) -> np.ndarray:
    """float32 (n, dim) search proxy of ``u``: the rows projected on the top-``dim`` right
    singular vectors of a sample of rows (uncentred, so dot products are what is kept), then
    L2-normalised (zero rows stay zero). Only proposes candidates; every distance that is
    returned is recomputed from ``u``. Memory: ``n × dim`` float32 plus one block.
    """
    n, d = u.shape
    rng = np.random.default_rng(random_state)
    pick = np.sort(rng.choice(n, size=min(n, int(sample)), replace=False))
    x = np.asarray(u[pick], dtype=np.float64)
    _, vecs = np.linalg.eigh(x.T @ x)  # ascending eigenvalues
    basis = np.ascontiguousarray(vecs[:, ::-1][:, :dim], dtype=np.float64)
    z = np.empty((n, dim), dtype=np.float32)
    for s in range(0, n, block):  # float64 products rounded once to float32: the same proxy for any block
        zb = np.asarray(u[s : s + block], dtype=np.float64) @ basis
        norms = np.linalg.norm(zb, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        z[s : s + block] = zb / norms
    return z


def auto_n_neighbors(gmax: int) -> int:
    """Default graph degree for a scope whose largest group has ``gmax`` rows: 30, raised to
    ``0.6 * gmax`` (at most 96) so that the graph keeps edges between groups."""
    return int(min(96, max(30, math.ceil(0.6 * gmax))))


class _Scope:
    """The rows one graph is built on (``rows``, sorted global indices) and how to query it."""

    def __init__(self, u, groups, rows, *, n_neighbors, seed, n_jobs, metric, brute, z=None):
        self.u, self.groups, self.rows = u, groups, rows
        self.z = u if z is None else z  # what the graph is built on and queried with
        _, counts = np.unique(groups[rows], return_counts=True)
        self.gmax = int(counts.max()) if counts.size else 0
        if n_neighbors is None:
            n_neighbors = auto_n_neighbors(self.gmax)
        self.brute = brute or rows.size <= max(BRUTE_MAX_ROWS, 2 * n_neighbors)
        self.index = None
        if not self.brute:
            from pynndescent import NNDescent  # deferred: importing pynndescent compiles numba kernels (seconds)

            if rows.size == self.z.shape[0] and self.z.dtype == np.float32:
                data = self.z  # pynndescent makes its own normalised float32 copy
            else:
                data = np.ascontiguousarray(self.z[rows], dtype=np.float32)
            self.index = NNDescent(
                data,
                metric=metric,
                n_neighbors=int(min(n_neighbors, rows.size - 1)),
                random_state=seed,
                n_jobs=n_jobs,
                low_memory=True,
                verbose=False,
            )
            self._graph = None

    def graph(self) -> np.ndarray:
        """The pynndescent k-NN graph in global row indices (-1 padded)."""
        if self._graph is None:
            local = self.index.neighbor_graph[0].astype(np.int64)
            self._graph = np.where(local < 0, -1, self.rows[np.maximum(local, 0)])
        return self._graph

    def candidates(self, qrows, width, epsilon, *, block=QUERY_BLOCK):
        """(|q|, width) global candidate indices from a graph query (-1 = none)."""
        width = int(min(width, self.rows.size))
        out = np.empty((qrows.size, width), dtype=np.int64)
        for s in range(0, qrows.size, block):
            q = np.ascontiguousarray(self.z[qrows[s : s + block]], dtype=np.float32)
            local, _ = self.index.query(q, k=width, epsilon=epsilon)
            local = local.astype(np.int64)
            out[s : s + block] = np.where(local < 0, -1, self.rows[np.maximum(local, 0)])
        return out

    def neighbours_of(self, kept, n_expand):
        """Graph neighbours of the first ``n_expand`` kept neighbours (global, -1 padded)."""
        g = self.graph()
        local_pos = np.searchsorted(self.rows, np.maximum(kept[:, :n_expand], 0))
        local_pos = np.minimum(local_pos, self.rows.size - 1)
        nb = g[local_pos]  # (b, n_expand, nn) in global indices
        nb[kept[:, :n_expand] < 0] = -1
        return nb.reshape(kept.shape[0], -1)

    def search(self, qrows, k, *, width, epsilon, kept=None, n_expand=0, block=QUERY_BLOCK):
        """Exact-refined top-k of ``qrows`` within this scope; ``kept`` (from a previous round)
        and its graph neighbours are added to the candidates. Queries run in blocks of ``block``
        rows, so candidate tables never exceed ``block × (width + kmax·(1 + n_neighbors))``."""
        if self.brute:
            return _brute(self.u, self.groups, qrows, self.rows, k)
        out_i = np.empty((qrows.size, k), dtype=np.int64)
        out_d = np.empty((qrows.size, k), dtype=np.float64)
        for s in range(0, qrows.size, block):
            q = qrows[s : s + block]
            parts = [self.candidates(q, width, epsilon)]
            if kept is not None:
                parts.append(kept[s : s + block])
                if n_expand > 0:
                    parts.append(self.neighbours_of(kept[s : s + block], n_expand))
            zero = _zero_rows(self.u, q)
            if zero.any():
                # A zero row is at distance exactly 1 from every row: its answer is the lowest
                # indices outside its group, which the graph cannot propose.
                first = self.rows[: min(self.rows.size, k + self.gmax + 1)]
                extra = np.full((q.size, first.size), -1, dtype=np.int64)
                extra[zero] = first
                parts.append(extra)
            out_i[s : s + block], out_d[s : s + block] = _refine(
                self.u, self.groups, q, np.concatenate(parts, axis=1), k
            )
        return out_i, out_d


def _zero_rows(u, rows, block=65536) -> np.ndarray:
    out = np.empty(rows.size, dtype=bool)
    for s in range(0, rows.size, block):
        x = np.asarray(u[rows[s : s + block]])
        out[s : s + block] = ~np.any(x != 0, axis=1)
    return out


# --------------------------------------------------------------------------------------------
# exact references for the audit


def exact_knn_rows(u, groups, rows, kmax):
    """Exact cross-group top-``kmax`` of the query ``rows`` over the whole scope.

    Same ordering and padding as ``exact.cross_group_knn`` restricted to ``rows``: returns
    ``(idx, dist)`` of shape (len(rows), kmax), int64 / float64, by (distance, index).
    Cost ``len(rows) × n × d`` flops in blocked GEMMs.
    """
    u = _check_u(u)
    groups = _check_codes("groups", groups, u.shape[0])
    kmax = check_positive_int("kmax", kmax)
    return _brute(u, groups, np.asarray(rows, dtype=np.int64), np.arange(u.shape[0]), kmax)


def exact_typed_rows(u, labels, confounders, groups, rows, m, *, block=BRUTE_BLOCK):
    """Exact SO and OS top-``m`` (idx, dist) of the query ``rows`` (brute force over the scope).

    Returns ``((so_idx, so_dist), (os_idx, os_dist))``, each of shape (len(rows), m), ordered by
    (distance, index), padded (-1, +inf), same-group rows excluded.
    """
    u = _check_u(u)
    n = u.shape[0]
    labels = _check_codes("labels", labels, n)
    confounders = _check_codes("confounders", confounders, n)
    groups = _check_codes("groups", groups, n)
    m = check_positive_int("m", m)
    rows = np.asarray(rows, dtype=np.int64)
    so = (np.full((rows.size, m), -1, np.int64), np.full((rows.size, m), np.inf))
    os_ = (np.full((rows.size, m), -1, np.int64), np.full((rows.size, m), np.inf))
    for t in range(0, n, 4 * block):
        sl = slice(t, min(n, t + 4 * block))
        ut = np.asarray(u[sl])
        ids = np.arange(sl.start, sl.stop, dtype=np.int64)
        lab, con, grp = labels[sl][None, :], confounders[sl][None, :], groups[sl][None, :]
        for s in range(0, rows.size, block):
            q = rows[s : s + block]
            d = cosine_distance_block(np.asarray(u[q]), ut)
            d[groups[q][:, None] == grp] = np.inf
            lq, cq = labels[q][:, None], confounders[q][:, None]
            same_l, same_c = lab == lq, con == cq
            merge_tile(so[0][s : s + block], so[1][s : s + block], np.where(same_l & ~same_c, d, np.inf), ids, m)
            merge_tile(os_[0][s : s + block], os_[1][s : s + block], np.where(~same_l & same_c, d, np.inf), ids, m)
    return so, os_


def measure_recall(u, groups, idx, *, n_queries=1000, random_state=0, search=None) -> float:
    """Recall of a cross-group neighbour table ``idx`` (n, kmax) on ``n_queries`` sampled rows.

    ``search(u, groups, rows, kmax) -> (idx, dist)`` gives the exact answer for the sampled rows
    (default :func:`exact_knn_rows`). The distances of ``idx`` are recomputed exactly, so the
    measure is tie-robust (module docstring); entries in the query's own group never count.
    Returns 1.0 when no sampled row has any eligible neighbour.
    """
    u = _check_u(u)
    n = u.shape[0]
    groups = _check_codes("groups", groups, n)
    idx = np.asarray(idx)
    if idx.ndim != 2 or idx.shape[0] != n:
        raise ValueError(f"idx must have shape ({n}, kmax), got {idx.shape}")
    rows = sample_queries(n, n_queries, random_state)
    search = exact_knn_rows if search is None else search
    _, true_d = search(u, groups, rows, idx.shape[1])
    _, found_d = _refine(u, groups, rows, np.asarray(idx[rows], dtype=np.int64), idx.shape[1])
    hits, total = recall_counts(found_d, np.asarray(true_d, dtype=np.float64), distance_tol(u.dtype, u.shape[1]))
    return 1.0 if total == 0 else hits / total


def measure_typed_recall(
    u, labels, confounders, groups, so_dist, os_dist, *, n_queries=1000, random_state=0
) -> float:
    """Pooled SO+OS recall of typed distance tables (n, m) on ``n_queries`` sampled rows.

    A sampled row's true SO (OS) neighbour counts as found when the table holds a distance
    ``<= r + tol``, r being its exact m-th SO (OS) distance; exact answers by
    :func:`exact_typed_rows`. Returns 1.0 when no sampled row has any eligible neighbour.
    """
    u = _check_u(u)
    so_dist, os_dist = np.asarray(so_dist), np.asarray(os_dist)
    if so_dist.shape != os_dist.shape or so_dist.ndim != 2 or so_dist.shape[0] != u.shape[0]:
        raise ValueError(f"so_dist and os_dist must both have shape ({u.shape[0]}, m)")
    rows = sample_queries(u.shape[0], n_queries, random_state)
    (_, t_so), (_, t_os) = exact_typed_rows(u, labels, confounders, groups, rows, so_dist.shape[1])
    tol = distance_tol(u.dtype, u.shape[1])
    h1, n1 = recall_counts(so_dist[rows], t_so, tol)
    h2, n2 = recall_counts(os_dist[rows], t_os, tol)
    return 1.0 if n1 + n2 == 0 else (h1 + h2) / (n1 + n2)


# --------------------------------------------------------------------------------------------
# GEMM-IVF: a spherical k-means partition, cluster-to-cluster probing, exact blocked GEMMs


#: Rows per k-means cluster of the IVF partition (``n_clusters = ceil(n / IVF_ROWS_PER_CLUSTER)``).
IVF_ROWS_PER_CLUSTER = 4096

#: Probe fractions tried, in order, by the calibration (fraction of the searched rows probed).
IVF_FRACTIONS = (1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2)

#: Above this probe fraction the IVF search costs more than the symmetric exact engines (which
#: compute each pair once for both rows), so the exact engine answers instead (recall 1).
IVF_EXACT_FRACTION = 0.5

#: The typed search answers exactly (:func:`cachescore.neighbors.typed.typed_knn`) above this
#: probe fraction: that engine computes each related pair once for both rows, so an IVF search
#: probing a fraction ``f`` of every target cell (``f · n² · d / 2``, one direction at a time)
#: only pays off for small ``f`` (measured break-even ~0.3 at 60k × 768).
IVF_TYPED_EXACT_FRACTION = 0.25

#: Query rows × target rows handled in one distance tile of :func:`_knn_into`.
IVF_TILE_Q, IVF_TILE_T = 1024, 8192


class _Partition:
    """Spherical k-means partition of the rows: ``cluster`` (n,) int64 codes, ``members[c]`` the
    sorted global rows of cluster ``c``, ``order[c]`` the clusters by decreasing centroid
    similarity to ``c`` (``c`` itself first)."""

    def __init__(self, u, n_clusters, seed, *, sample=None, iters=8, block=65536, keep_scores=False):
        n, d = u.shape
        c = int(max(1, min(n_clusters, n)))

        rng = np.random.default_rng(seed)
        size = min(n, int(sample) if sample else max(20000, 40 * c))
        pick = np.sort(rng.choice(n, size=size, replace=False))
        cent = spherical_kmeans(np.asarray(u[pick], dtype=np.float32), c, random_state=rng, iters=iters)
        self.centroids = cent
        cl = np.empty(n, dtype=np.int64)
        #: (n, C) float32 centroid scores ``u · centroid`` when ``keep_scores`` (typed preselection)
        self.scores = np.empty((n, c), dtype=np.float32) if keep_scores else None
        for s in range(0, n, block):
            sc = np.asarray(u[s : s + block], dtype=np.float32) @ cent.T
            cl[s : s + block] = np.argmax(sc, axis=1)
            if keep_scores:
                self.scores[s : s + block] = sc
        self.cluster = cl
        srt = np.argsort(cl, kind="stable")
        bounds = np.searchsorted(cl[srt], np.arange(c + 1))
        self.members = [srt[bounds[i] : bounds[i + 1]] for i in range(c)]
        sims = cent @ cent.T
        np.fill_diagonal(sims, np.inf)
        self.order = np.argsort(-sims, axis=1, kind="stable")
        self.n_clusters = c

    def probe(self, a, frac, sizes, total):
        """Clusters probed from cluster ``a``: the most similar ones (``a`` first) until they hold
        at least ``frac · total`` rows, counted by ``sizes`` (rows of each cluster that matter)."""
        o = self.order[a]
        if frac >= 1:
            return o[sizes[o] > 0]
        cum = np.cumsum(sizes[o])
        stop = int(np.searchsorted(cum, frac * total)) + 1
        sel = o[:stop]
        return sel[sizes[sel] > 0]


def _knn_into(u, groups, qrows, trows, k, best_i, best_d, *, tq=IVF_TILE_Q, tt=IVF_TILE_T):
    """Merge the exact top-k by (dist, idx) of ``qrows`` over ``trows`` (other-group rows only)
    into ``best_i`` / ``best_d`` (|q|, k), in place, by blocked GEMMs (:func:`merge_tile`)."""
    if qrows.size == 0 or trows.size == 0:
        return
    gq_all = groups[qrows]
    uq_all = np.asarray(u[qrows]) if qrows.size <= 4 * tq else None
    for t0 in range(0, trows.size, tt):
        tids = trows[t0 : t0 + tt]
        ut = np.asarray(u[tids])
        gt = groups[tids]
        for s in range(0, qrows.size, tq):
            uq = uq_all[s : s + tq] if uq_all is not None else np.asarray(u[qrows[s : s + tq]])
            dist = cosine_distance_block(uq, ut)
            dist[gq_all[s : s + tq, None] == gt[None, :]] = np.inf
            merge_tile(best_i[s : s + tq], best_d[s : s + tq], dist, tids, k)


def _ivf_cross(u, groups, part, frac, k, queries=None):
    """Cross-group top-k of ``queries`` (default all rows, sorted) probing ``frac`` of the rows."""
    n = u.shape[0]
    qsel = None if queries is None else np.zeros(n, dtype=bool)
    if qsel is not None:
        qsel[queries] = True
    nq = n if queries is None else queries.size
    pos = None if queries is None else np.full(n, -1, np.int64)
    if pos is not None:
        pos[queries] = np.arange(queries.size)
    out_i = np.full((nq, k), -1, np.int64)
    out_d = np.full((nq, k), np.inf)
    sizes = np.array([m.size for m in part.members])
    for a in range(part.n_clusters):
        q = part.members[a] if qsel is None else part.members[a][qsel[part.members[a]]]
        if q.size == 0:
            continue
        trows = np.sort(np.concatenate([part.members[b] for b in part.probe(a, frac, sizes, n)]))
        at = q if pos is None else pos[q]
        bi, bd = out_i[at], out_d[at]
        _knn_into(u, groups, q, trows, k, bi, bd)
        out_i[at], out_d[at] = bi, bd
    return out_i, out_d


def _typed_thresholds(scores, cell_members, fractions):
    """``(C, T, F)`` float32: for query cluster ``a`` and target cell ``t``, the score
    ``u_x · centroid_a`` of the ``ceil(f · |t|)``-th best row of ``t`` (each fraction ``f``);
    rows of ``t`` scoring at least that are searched (ties included), so the kept set grows with
    ``f`` and ``f = 1`` keeps every row."""
    c = scores.shape[1]
    thr = np.full((c, len(cell_members), len(fractions)), -np.inf, dtype=np.float32)
    for t, rows in enumerate(cell_members):
        if rows.size == 0:
            continue
        desc = -np.sort(-scores[rows], axis=0)  # (|t|, C), best first per cluster
        for i, f in enumerate(fractions):
            if f < 1:
                thr[:, t, i] = desc[min(rows.size, max(1, math.ceil(f * rows.size))) - 1]
    return thr


def _cells(labels, confounders):
    keys, cell_of = np.unique(np.stack([labels, confounders], axis=1), axis=0, return_inverse=True)
    cell_of = cell_of.ravel()
    srt = np.argsort(cell_of, kind="stable")
    bounds = np.searchsorted(cell_of[srt], np.arange(len(keys) + 1))
    return keys, cell_of, [srt[bounds[t] : bounds[t + 1]] for t in range(len(keys))]


def _ivf_typed(u, groups, part, cells, thr, m, queries=None):
    """Typed (SO, OS) top-m (idx, dist) of ``queries`` (default all rows). Rows of query
    cluster ``a`` and cell ``qc`` are searched exactly over the rows of each related target cell
    ``t`` whose centroid score ``u_x · centroid_a`` reaches ``thr[a, t]`` (row-level
    preselection: the part of a query shared with its cluster ranks the target rows)."""
    keys, cell_of, members = cells
    n = u.shape[0]
    queries = np.arange(n, dtype=np.int64) if queries is None else queries
    pos = np.full(n, -1, np.int64)
    pos[queries] = np.arange(queries.size)
    so = (np.full((queries.size, m), -1, np.int64), np.full((queries.size, m), np.inf))
    os_ = (np.full((queries.size, m), -1, np.int64), np.full((queries.size, m), np.inf))
    qclus = part.cluster[queries]
    for a in range(part.n_clusters):
        in_a = queries[qclus == a]
        if in_a.size == 0:
            continue
        for qc in np.unique(cell_of[in_a]):
            q = in_a[cell_of[in_a] == qc]
            lq, cq = keys[qc]
            for t, (lt, ct) in enumerate(keys):
                is_so = lt == lq and ct != cq
                if not (is_so or (lt != lq and ct == cq)):
                    continue
                rows = members[t]
                tr = rows[part.scores[rows, a] >= thr[a, t]]
                acc = so if is_so else os_
                at = pos[q]
                bi = np.full((q.size, m), -1, np.int64)
                bd = np.full((q.size, m), np.inf)
                _knn_into(u, groups, q, tr, m, bi, bd)
                acc[0][at], acc[1][at] = merge_tables((acc[0][at], acc[1][at]), (bi, bd), m)
    return so, os_


def _probe_levels(part, fractions, sizes):
    """``(C, C)`` int: for query cluster ``a`` and target cluster ``b``, the index of the first
    fraction of ``fractions`` (ascending) at which ``b`` is probed from ``a`` for the row counts
    ``sizes`` (C,); ``len(fractions)`` when it never is. Probe sets grow with the fraction."""
    c = part.n_clusters
    lev = np.full((c, c), len(fractions), dtype=np.int64)
    for i in range(len(fractions) - 1, -1, -1):
        for a in range(c):
            lev[a, part.probe(a, fractions[i], sizes, sizes.sum())] = i
    return lev


def _ivf_cross_search(u, groups, kmax, *, target, seed, n_recall_queries, n_clusters, probe_fraction,
                      max_rounds, brute_block):
    n = u.shape[0]
    part = _Partition(u, n_clusters or math.ceil(n / IVF_ROWS_PER_CLUSTER), seed)
    tol = distance_tol(u.dtype, u.shape[1])
    audit = sample_queries(n, n_recall_queries, seed)
    calib_seed = None if seed is None else seed + 1
    if probe_fraction is None:
        calib = sample_queries(n, max(2 * n_recall_queries, 2000), calib_seed)
        # calibrate to a margin above the target: the audit is a different, independent sample
        want = min(1.0, target + 0.5 * (1.0 - target))
        c_idx, c_dist = _brute(u, groups, calib, np.arange(n, dtype=np.int64), kmax, block=brute_block)
        sizes = np.array([mb.size for mb in part.members])
        lev = _probe_levels(part, IVF_FRACTIONS, sizes)[part.cluster[calib][:, None], part.cluster[np.maximum(c_idx, 0)]]
        frac = calibrate_fraction([lev], [c_idx], [c_dist], tol, want, IVF_FRACTIONS)
    else:
        frac = float(probe_fraction)
    rounds = 0
    while True:
        if frac > IVF_EXACT_FRACTION:

            idx, dist = cross_group_knn(u, groups, kmax)
            return idx, dist, 1.0, 0, rounds, 1.0, True, part.n_clusters
        idx, dist = _ivf_cross(u, groups, part, frac, kmax)
        _, true_d = _brute(u, groups, audit, np.arange(n, dtype=np.int64), kmax, block=brute_block)
        hits, total = recall_counts(dist[audit], true_d, tol)
        recall = 1.0 if total == 0 else hits / total
        if recall >= target:
            return idx, dist, recall, int(audit.size), rounds, frac, False, part.n_clusters
        if rounds >= int(max_rounds):
            raise RecallTargetError.after_rounds("ANN (ivf) cross-group search", recall, target, audit.size, rounds,
                                                 f"n={n}, kmax={kmax}, probe fraction {frac:g}")
        rounds, frac = rounds + 1, 2 * frac


def _ivf_typed_search(u, labels, confounders, groups, m, *, target, seed, n_recall_queries, n_clusters,
                      probe_fraction, max_rounds):
    n = u.shape[0]
    part = _Partition(u, n_clusters or math.ceil(n / IVF_ROWS_PER_CLUSTER), seed, keep_scores=True)
    tol = distance_tol(u.dtype, u.shape[1])
    audit = sample_queries(n, n_recall_queries, seed)
    calib_seed = None if seed is None else seed + 1
    cells = _cells(labels, confounders)
    _, cell_of, members = cells
    if probe_fraction is None:
        calib = sample_queries(n, max(2 * n_recall_queries, 2000), calib_seed)
        want = min(1.0, target + 0.5 * (1.0 - target))
        thr = _typed_thresholds(part.scores, members, IVF_FRACTIONS)
        (s_i, s_d), (o_i, o_d) = exact_typed_rows(u, labels, confounders, groups, calib, m)
        qa = part.cluster[calib][:, None]
        levels = []
        for ti in (s_i, o_i):
            x = np.maximum(ti, 0)
            # level = number of fractions whose threshold the true neighbour misses
            levels.append((part.scores[x, qa][..., None] < thr[qa, cell_of[x]]).sum(axis=-1))
        frac = calibrate_fraction(levels, [s_i, o_i], [s_d, o_d], tol, want, IVF_FRACTIONS)
    else:
        frac = float(probe_fraction)
    rounds = 0
    while True:
        if frac > IVF_TYPED_EXACT_FRACTION:

            so_d, os_d = typed_knn(u, labels, confounders, groups, m)
            return so_d, os_d, 1.0, 0, rounds, 1.0, True
        thr = _typed_thresholds(part.scores, members, [frac])[:, :, 0]
        so, os_ = _ivf_typed(u, groups, part, cells, thr, m)
        (_, t_so), (_, t_os) = exact_typed_rows(u, labels, confounders, groups, audit, m)
        h1, n1 = recall_counts(so[1][audit], t_so, tol)
        h2, n2 = recall_counts(os_[1][audit], t_os, tol)
        recall = 1.0 if n1 + n2 == 0 else (h1 + h2) / (n1 + n2)
        if recall >= target:
            return so[1], os_[1], recall, int(audit.size), rounds, frac, False
        if rounds >= int(max_rounds):
            raise RecallTargetError.after_rounds("ANN (ivf) typed search", recall, target, audit.size, rounds,
                                                 f"n={n}, m={m}, probe fraction {frac:g}")
        rounds, frac = rounds + 1, 2 * frac


# --------------------------------------------------------------------------------------------
# public ANN searches


def _check_method(method, n_clusters, probe_fraction):
    if method not in ("ivf", "graph"):
        raise ValueError(f"method must be 'ivf' or 'graph', got {method!r}")
    if n_clusters is not None:
        check_positive_int("n_clusters", n_clusters)
    if probe_fraction is not None and not 0.0 < float(probe_fraction) <= 1.0:
        raise ValueError(f"probe_fraction must be in (0, 1], got {probe_fraction!r}")


def _proxy(u, proxy_dim, seed):
    if proxy_dim is None:
        return None
    proxy_dim = check_positive_int("proxy_dim", proxy_dim)
    if proxy_dim >= u.shape[1]:
        return None
    return project_rows(u, proxy_dim, random_state=seed)


def cross_group_knn_ann_with_recall(
    u,
    groups,
    kmax,
    *,
    recall_target=0.99,
    random_state=None,
    n_jobs=1,
    n_neighbors=None,
    epsilon=0.1,
    max_rounds=4,
    n_recall_queries=1000,
    n_expand=8,
    metric="cosine",
    proxy_dim=None,
    block_rows=None,
    block_cols=None,
    method="ivf",
    n_clusters=None,
    probe_fraction=None,
) -> AnnKnnResult:
    """Cross-group kNN from an approximate candidate search (``method``: IVF cells or a pynndescent
    graph) refined with exact distances, with its measured recall.

    Parameters
    ----------
    u : ndarray (n, d), float32 or float64
        Doubly-normalised rows (:func:`~cachescore.neighbors.normalize.normalize_rows`); may be a
        ``np.memmap``. Distances are recomputed in this dtype.
    groups : int array (n,)
        Group codes; rows of the query's group (itself included) are never neighbours.
    kmax : int >= 1
        Neighbours kept per row.
    recall_target : float in (0, 1]
        Widen the candidate set until the measured recall reaches it.
    random_state : int, Generator or None
        Seeds the graph and the audit sample; an int gives identical results on every call
        (with ``n_jobs=1``).
    n_jobs : int
        numba threads for the graph (restored afterwards by pynndescent).
    n_neighbors : int, optional
        Graph degree; default :func:`auto_n_neighbors` of the largest group (a graph whose degree
        is well below the group size links mostly rows of one group and searches badly).
    epsilon : float
        pynndescent query ``epsilon`` of the first pass (+0.1 per widening, at most 0.5).
    max_rounds : int >= 0
        Widening rounds allowed after the first pass.
    n_recall_queries : int >= 1
        Size of the audit sample (exact search for these rows).
    n_expand : int >= 0
        Neighbours of the first ``n_expand`` kept rows are added in each widening round.
    metric : "cosine" or "dot" (pynndescent metric; both only propose candidates).
    proxy_dim : int or None
        Build and query the graph on :func:`project_rows` of this width instead of ``u``
        (cheaper graph, smaller float32 copy). Candidates only: distances always come from
        ``u`` and the recall audit still applies. Off by default: on the benchmark's synthetic
        views (isotropic noise, one random offset per slide) a 128-wide proxy of 768-wide rows
        gave a first-pass recall of 0.27, so it only suits embeddings with a fast-decaying
        spectrum.
    block_rows, block_cols : int, optional
        Accepted for signature compatibility with the exact engines: the edge of the brute-force
        distance tiles (small scopes, the recall audit); results do not depend on them.
    method : "ivf" (default) or "graph"
        See the module docstring. ``n_neighbors``, ``epsilon``, ``n_expand``, ``metric``,
        ``proxy_dim`` and ``n_jobs`` only apply to ``"graph"``.
    n_clusters : int, optional
        ivf: k-means clusters (default ``ceil(n / IVF_ROWS_PER_CLUSTER)``).
    probe_fraction : float in (0, 1], optional
        ivf: fraction of the rows probed per query cluster; default: calibrated (module
        docstring). Above :data:`IVF_EXACT_FRACTION` the exact engine answers (``exact=True``).

    Returns
    -------
    AnnKnnResult
        ``idx`` (n, kmax) int64 padded -1 and ``dist`` (n, kmax) float64 padded +inf, ordered
        by (distance, index), plus ``recall`` and diagnostics. Scopes of at most
        ``BRUTE_MAX_ROWS`` rows are searched exactly (``exact=True``, recall 1.0).

    Raises
    ------
    ValueError / TypeError
        Bad shapes, dtypes or parameters.
    RecallTargetError
        Recall still below ``recall_target`` after ``max_rounds`` widenings.
    """
    u = _check_u(u)
    n = u.shape[0]
    groups = _check_codes("groups", groups, n)
    kmax = check_positive_int("kmax", kmax)
    target = _check_target(recall_target)
    if n_neighbors is not None:
        n_neighbors = check_positive_int("n_neighbors", n_neighbors)
    if int(max_rounds) < 0 or int(n_expand) < 0:
        raise ValueError("max_rounds and n_expand must be >= 0")
    if metric not in ("cosine", "dot"):
        raise ValueError(f"metric must be 'cosine' or 'dot', got {metric!r}")
    _check_method(method, n_clusters, probe_fraction)
    seed = seed_of(random_state)
    given = [check_positive_int(k, v) for k, v in (("block_rows", block_rows), ("block_cols", block_cols)) if v is not None]
    brute_block = min(given) if given else BRUTE_BLOCK
    rows = np.arange(n, dtype=np.int64)
    if n <= 1:
        return AnnKnnResult(
            idx=np.full((n, kmax), -1, np.int64), dist=np.full((n, kmax), np.inf), recall=1.0,
            recall_target=target, n_recall_queries=0, rounds=0, candidate_width=0, exact=True,
        )
    if method == "ivf":
        if n <= BRUTE_MAX_ROWS:  # the exact engine itself: bit-identical to backend "exact" whatever the BLAS kernel
            idx, dist = cross_group_knn(u, groups, kmax, block_rows=block_rows, block_cols=block_cols)
            return AnnKnnResult(
                idx=idx, dist=dist, recall=1.0, recall_target=target, n_recall_queries=0, rounds=0,
                candidate_width=n - 1, exact=True, method="ivf",
            )
        idx, dist, recall, nq, rounds, frac, exact, ncl = _ivf_cross_search(
            u, groups, kmax, target=target, seed=seed, n_recall_queries=check_positive_int("n_recall_queries", n_recall_queries),
            n_clusters=n_clusters, probe_fraction=probe_fraction, max_rounds=max_rounds, brute_block=brute_block,
        )
        return AnnKnnResult(
            idx=idx, dist=dist, recall=recall, recall_target=target, n_recall_queries=nq, rounds=rounds,
            candidate_width=int(round(frac * n)), exact=exact, method="ivf", probe_fraction=frac, n_clusters=ncl,
        )
    width = min(n, kmax + int(np.unique(groups, return_counts=True)[1].max()) + 1)
    z = None
    if width < n and n > BRUTE_MAX_ROWS:
        z = _proxy(u, proxy_dim, seed)
    scope = _Scope(
        u, groups, rows, n_neighbors=n_neighbors, seed=seed, n_jobs=n_jobs, metric=metric,
        brute=width >= n, z=z,
    )
    if scope.brute:
        idx, dist = _brute(u, groups, rows, rows, kmax, block=brute_block)
        return AnnKnnResult(
            idx=idx, dist=dist, recall=1.0, recall_target=target, n_recall_queries=0,
            rounds=0, candidate_width=n - 1, exact=True,
        )
    audit = sample_queries(n, n_recall_queries, seed)
    _, true_d = _brute(u, groups, audit, rows, kmax, block=brute_block)
    tol = distance_tol(u.dtype, u.shape[1])
    kept, rounds, eps = None, 0, float(epsilon)
    while True:
        idx, dist = scope.search(rows, kmax, width=width, epsilon=eps, kept=kept, n_expand=min(n_expand, kmax) if kept is not None else 0)
        hits, total = recall_counts(dist[audit], true_d, tol)
        recall = 1.0 if total == 0 else hits / total
        if recall >= target:
            break
        if rounds >= int(max_rounds):
            raise RecallTargetError.after_rounds("ANN cross-group search", recall, target, audit.size, rounds,
                                                 f"n={n}, kmax={kmax}, candidate width {width}",
                                                 "n_neighbors / max_rounds")
        kept, rounds = idx, rounds + 1
        width, eps = min(n, 2 * width), min(0.5, eps + 0.1)
    return AnnKnnResult(
        idx=idx, dist=dist, recall=recall, recall_target=target, n_recall_queries=int(audit.size),
        rounds=rounds, candidate_width=int(width), exact=False,
    )


def cross_group_knn_ann(u, groups, kmax, *, recall_target=0.99, random_state=None, n_jobs=1, **options):
    """:func:`cross_group_knn_ann_with_recall` returning only ``(idx, dist)`` (exact contract)."""
    r = cross_group_knn_ann_with_recall(
        u, groups, kmax, recall_target=recall_target, random_state=random_state, n_jobs=n_jobs, **options
    )
    return r.idx, r.dist


def typed_knn_ann_with_recall(
    u,
    labels,
    confounders,
    groups,
    m,
    *,
    recall_target=0.99,
    random_state=None,
    n_jobs=1,
    n_neighbors=None,
    epsilon=0.1,
    max_rounds=4,
    n_recall_queries=1000,
    n_expand=4,
    metric="cosine",
    proxy_dim=None,
    block_rows=None,
    method="ivf",
    n_clusters=None,
    probe_fraction=None,
) -> AnnTypedResult:
    """Typed (SO / OS) neighbour distances with a measured recall.

    ``method="ivf"`` (default): scopes of at most ``TYPED_BRUTE_MAX_ROWS`` rows, or whose
    calibrated probe fraction exceeds :data:`IVF_TYPED_EXACT_FRACTION`, are answered by the exact
    typed engine (recall 1, ``exact_cells == n_cells``). Otherwise the rows of each k-means cluster
    ``a`` are searched exactly, per related target cell ``t``, over the rows of ``t`` that score
    best against ``a``'s centroid (the ``probe_fraction`` share of ``t``, ties included); the
    fraction is calibrated and the recall audited as in :func:`cross_group_knn_ann_with_recall`.

    ``method="graph"``: for each (label, confounder) target cell ``t`` a graph is built over its rows and queried by
    every row whose SO or OS pool contains ``t`` (same label xor same confounder), asking for
    ``m + G_t + 1`` candidates (``G_t`` = largest group inside ``t``). Candidates are refined
    exactly (same-group dropped, distances recomputed in u's dtype, ranked by (distance, index)),
    the per-cell top-m lists are merged per type, and the pooled SO+OS recall is measured on
    ``n_recall_queries`` sampled rows against :func:`exact_typed_rows`; below ``recall_target``
    every cell query is widened as in :func:`cross_group_knn_ann_with_recall`. Cells of at most
    ``TYPED_BRUTE_MAX_ROWS`` rows are searched by brute force (blocked GEMM, exact).

    Parameters are those of :func:`cross_group_knn_ann_with_recall`, with ``labels`` and
    ``confounders`` integer codes of shape (n,) and ``m >= 1`` in place of ``kmax``
    (``block_rows`` is accepted for signature compatibility with ``typed_knn`` and ignored).

    Returns
    -------
    AnnTypedResult
        ``so_dist`` / ``os_dist`` (n, m) float64 ascending, +inf padded (``typed_knn`` contract).

    Raises
    ------
    ValueError / TypeError, RecallTargetError
        As :func:`cross_group_knn_ann_with_recall`.
    """
    u = _check_u(u)
    n = u.shape[0]
    labels = _check_codes("labels", labels, n)
    confounders = _check_codes("confounders", confounders, n)
    groups = _check_codes("groups", groups, n)
    m = check_positive_int("m", m)
    target = _check_target(recall_target)
    if n_neighbors is not None:
        n_neighbors = check_positive_int("n_neighbors", n_neighbors)
    if int(max_rounds) < 0 or int(n_expand) < 0:
        raise ValueError("max_rounds and n_expand must be >= 0")
    if metric not in ("cosine", "dot"):
        raise ValueError(f"metric must be 'cosine' or 'dot', got {metric!r}")
    _check_method(method, n_clusters, probe_fraction)
    seed = seed_of(random_state)
    if block_rows is not None:
        check_positive_int("block_rows", block_rows)

    if n <= TYPED_BRUTE_MAX_ROWS:
        # small scope: the exact typed engine (symmetric tiles) is faster than any probing and, being
        # the exact engine itself, bit-identical to it whatever the BLAS kernel (both methods)

        so_d, os_d = typed_knn(u, labels, confounders, groups, m)
        nc = len(np.unique(np.stack([labels, confounders], axis=1), axis=0)) if n else 0
        return AnnTypedResult(
            so_dist=so_d, os_dist=os_d, recall=1.0, recall_target=target, n_recall_queries=0,
            rounds=0, n_cells=nc, exact_cells=nc, method=method, probe_fraction=1.0,
        )
    if method == "ivf":
        so_d, os_d, recall, nq, rounds, frac, exact = _ivf_typed_search(
            u, labels, confounders, groups, m, target=target, seed=seed,
            n_recall_queries=check_positive_int("n_recall_queries", n_recall_queries),
            n_clusters=n_clusters, probe_fraction=probe_fraction, max_rounds=max_rounds,
        )
        nc = len(np.unique(np.stack([labels, confounders], axis=1), axis=0))
        return AnnTypedResult(
            so_dist=so_d, os_dist=os_d, recall=recall, recall_target=target, n_recall_queries=nq,
            rounds=rounds, n_cells=nc, exact_cells=nc if exact else 0, method="ivf", probe_fraction=frac,
        )
    pairs = np.stack([labels, confounders], axis=1)
    keys, cell_of = np.unique(pairs, axis=0, return_inverse=True)
    cell_of = cell_of.ravel()
    sizes = np.bincount(cell_of, minlength=len(keys))
    z = _proxy(u, proxy_dim, seed) if sizes.max(initial=0) > TYPED_BRUTE_MAX_ROWS else None
    cells = []  # (scope, query rows, query is SO (bool per query))
    for t, (lt, ct) in enumerate(keys):
        trows = np.flatnonzero(cell_of == t)
        q_so = (labels == lt) & (confounders != ct)
        q_os = (labels != lt) & (confounders == ct)
        qrows = np.flatnonzero(q_so | q_os)
        if qrows.size == 0:
            continue
        cell_seed = None if seed is None else seed + 7919 * t
        scope = _Scope(
            u, groups, trows, n_neighbors=n_neighbors, seed=cell_seed, n_jobs=n_jobs, metric=metric,
            brute=trows.size <= TYPED_BRUTE_MAX_ROWS, z=z,
        )
        cells.append((scope, qrows, q_so[qrows]))

    audit = sample_queries(n, n_recall_queries, seed) if n else np.empty(0, np.int64)
    (_, t_so), (_, t_os) = exact_typed_rows(u, labels, confounders, groups, audit, m)
    tol = distance_tol(u.dtype, u.shape[1])
    kept = [None] * len(cells)
    rounds, eps, mult = 0, float(epsilon), 1
    while True:
        so = (np.full((n, m), -1, np.int64), np.full((n, m), np.inf))
        os_ = (np.full((n, m), -1, np.int64), np.full((n, m), np.inf))
        for j, (scope, qrows, is_so) in enumerate(cells):
            if scope.brute and kept[j] is not None:
                res = kept[j]
            else:
                width = mult * (m + scope.gmax + 1)
                res = scope.search(
                    qrows, m, width=width, epsilon=eps, kept=kept[j],
                    n_expand=min(n_expand, m) if kept[j] is not None else 0,
                )
            kept[j] = res
            for acc, sel in ((so, is_so), (os_, ~is_so)):
                r = qrows[sel]
                merged = merge_tables((acc[0][r], acc[1][r]), (res[0][sel], res[1][sel]), m)
                acc[0][r], acc[1][r] = merged
        h1, n1 = recall_counts(so[1][audit], t_so, tol)
        h2, n2 = recall_counts(os_[1][audit], t_os, tol)
        recall = 1.0 if n1 + n2 == 0 else (h1 + h2) / (n1 + n2)
        if recall >= target:
            break
        if rounds >= int(max_rounds):
            raise RecallTargetError.after_rounds("ANN typed search", recall, target, audit.size, rounds,
                                                 f"n={n}, m={m}", "n_neighbors / max_rounds")
        rounds, mult, eps = rounds + 1, 2 * mult, min(0.5, eps + 0.1)
    return AnnTypedResult(
        so_dist=so[1], os_dist=os_[1], recall=recall, recall_target=target,
        n_recall_queries=int(audit.size), rounds=rounds, n_cells=len(cells),
        exact_cells=sum(1 for c in cells if c[0].brute),
    )


def typed_knn_ann(u, labels, confounders, groups, m, *, recall_target=0.99, random_state=None, n_jobs=1, **options):
    """:func:`typed_knn_ann_with_recall` returning only ``(so_dist, os_dist)`` (typed contract)."""
    r = typed_knn_ann_with_recall(
        u, labels, confounders, groups, m, recall_target=recall_target, random_state=random_state,
        n_jobs=n_jobs, **options,
    )
    return r.so_dist, r.os_dist


class AnnSearch:
    """The in-memory ANN engine as a :class:`~.base.Searcher`: keeps the recall it measured.

    ``params``: a work unit's neighbour parameters (``seed``, ``recall_target``, ``recall_sample``).

    :meth:`cross` / :meth:`typed` wrap the ANN backend's ``*_with_recall`` searches (IVF-style
    candidate clusters, or pynndescent graphs with ``method="graph"``, refined with exact
    distances; recall measured against exact search on ``recall_sample`` seeded queries per call).
    The metric may call them once per scope (and more than once per scope); :attr:`recall` is the
    worst measured recall over all calls (NaN if never called). Same interface as
    :class:`~.large_scope.LargeScopeSearch`.
    """

    def __init__(self, params: dict):
        self.params, self.recalls = params, []

    def _options(self, kwargs) -> dict:
        kwargs.setdefault("random_state", int(self.params["seed"]))
        kwargs.setdefault("recall_target", float(self.params["recall_target"]))
        kwargs.setdefault("n_recall_queries", int(self.params["recall_sample"]))
        return kwargs

    def cross(self, u, *args, **kwargs):
        require_finite(u)
        r = cross_group_knn_ann_with_recall(u, *args, **self._options(kwargs))
        self.recalls.append(float(r.recall))
        return r.idx, r.dist

    def typed(self, u, *args, **kwargs):
        require_finite(u)
        r = typed_knn_ann_with_recall(u, *args, **self._options(kwargs))
        self.recalls.append(float(r.recall))
        return r.so_dist, r.os_dist

    @property
    def recall(self) -> float:
        return min(self.recalls) if self.recalls else float("nan")

    @property
    def details(self) -> list:
        return []
