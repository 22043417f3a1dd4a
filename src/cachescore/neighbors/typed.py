"""Exact typed-neighbour search restricted to (label, confounder) cells (spec/metrics.md §7.10).

CRoMa's margin needs, for every row ``i`` of a scope, only the ``m`` smallest distances to its
**SO** pool (rows of cells ``(l_i, c)``, ``c != c_i``) and to its **OS** pool (rows of cells
``(l, c_i)``, ``l != l_i``), both minus ``i``'s own group. Searching those cells directly is exact,
needs no growing window, and never scans SS/OO rows.

Layout of the computation (no per-row Python loop, no N×N matrix):

* rows are permuted once (by cell, then group) so that every cell is a contiguous slice and
  same-group masks are only built for tiles whose group ranges overlap;
* for each pair of cells in an SO or OS relation, row blocks of one cell × row blocks of the
  other are multiplied as one GEMM (:func:`~cachescore.neighbors.normalize.cosine_distance_block`,
  in the rows' dtype: float32 stays float32); same-group entries are set to ``+inf``; the tile is
  reduced to the ``m`` smallest values per row *and* per column with ``np.partition`` (the
  relations are symmetric, so each pair distance is computed once) and merged into running
  ``(n, m)`` buffers;
* the buffers are sorted once at the end.

Peak extra memory is one permuted copy of ``u``, two ``(n, m)`` buffers and ``O(block_rows²)``
per tile.

:func:`count_within` is the companion counting pass used to reproduce croma's search-schedule
diagnostics (``k_final``, ``retries``) without growing a window.
"""

from __future__ import annotations

import numpy as np

from .normalize import cosine_distance_block

__all__ = ["DEFAULT_BLOCK_ROWS", "typed_knn", "count_within"]

#: Edge of the square distance tiles (query rows × target columns) when ``block_rows`` is None.
#: 2048² float64 entries = 32 MiB per tile.
DEFAULT_BLOCK_ROWS = 2048


def _check_inputs(u, labels, confounders, groups):
    u = np.asarray(u)
    if u.ndim != 2:
        raise ValueError(f"u must be a 2-D array of normalised rows (n, d), got {u.ndim}-D")
    n = u.shape[0]
    arrays = []
    for name, a in (("labels", labels), ("confounders", confounders), ("groups", groups)):
        a = np.asarray(a)
        if a.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) to match u, got {a.shape}")
        arrays.append(a)
    return u, arrays


def _block(block_rows) -> int:
    b = DEFAULT_BLOCK_ROWS if block_rows is None else int(block_rows)
    if b < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    return b


def _keep_smallest(buf: np.ndarray, m: int) -> np.ndarray:
    """Per row, the ``m`` smallest values of ``buf`` (unordered); all of them if fewer columns."""
    if buf.shape[1] <= m:
        return buf
    return np.partition(buf, m - 1, axis=1)[:, :m]


def typed_knn(u, labels, confounders, groups, m, *, block_rows=None):
    """Exact SO/OS neighbour distances of every row, searched per (label, confounder) cell.

    Parameters
    ----------
    u : ndarray of shape (n, d)
        Rows already normalised by :func:`~cachescore.neighbors.normalize.normalize_rows` (float32
        or float64; distances are computed in this dtype).
    labels, confounders, groups : int arrays of shape (n,)
        Codes of the scope. Two rows are in the same cell iff label and confounder codes are
        equal; a target in the query's group is never a neighbour (this excludes the row itself).
    m : int
        Number of nearest distances kept per type (``>= 1``).
    block_rows : int, optional
        Edge of the square distance tiles (default :data:`DEFAULT_BLOCK_ROWS`). Results do not
        depend on it.

    Returns
    -------
    so_dist, os_dist : float64 ndarrays of shape (n, m)
        Per row, the ``m`` smallest SO (same label, other confounder) and OS (other label, same
        confounder) cosine distances to rows of other groups, ascending, padded with ``+inf``
        where the pool holds fewer than ``m`` rows. Ties are irrelevant: only values are returned.

    Raises
    ------
    ValueError
        ``u`` not 2-D, code arrays of the wrong shape, ``m < 1`` or ``block_rows < 1``.
    """
    u, (labels, confounders, groups) = _check_inputs(u, labels, confounders, groups)
    m = int(m)
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    b = _block(block_rows)
    n = u.shape[0]
    so_out = np.full((n, m), np.inf, dtype=np.float64)
    os_out = np.full((n, m), np.inf, dtype=np.float64)
    if n < 2:
        return so_out, os_out

    lab = np.unique(labels, return_inverse=True)[1].ravel().astype(np.int64)
    con = np.unique(confounders, return_inverse=True)[1].ravel().astype(np.int64)
    n_con = int(con.max()) + 1
    cell_ids, cell_of = np.unique(lab * n_con + con, return_inverse=True)
    cell_of = cell_of.ravel()
    cell_keys = np.stack([cell_ids // n_con, cell_ids % n_con], axis=1)  # (label, confounder) per cell
    order = np.lexsort((np.asarray(groups), cell_of))  # by cell, then group: cells are slices
    starts = np.concatenate([[0], np.cumsum(np.bincount(cell_of, minlength=len(cell_keys)))])
    us = np.ascontiguousarray(u[order])
    gs = np.asarray(groups)[order]
    cell_groups = [np.unique(gs[starts[c] : starts[c + 1]]) for c in range(len(cell_keys))]
    inf = np.array(np.inf, dtype=us.dtype)
    best = {"so": np.full((n, m), inf, dtype=us.dtype), "os": np.full((n, m), inf, dtype=us.dtype)}

    # SO and OS are symmetric relations between cells, so each unordered cell pair is multiplied
    # once and every tile is reduced along both axes (rows for the first cell, columns for the
    # second): the GEMM work is half of a per-query search.
    for q in range(len(cell_keys)):
        for t in range(q + 1, len(cell_keys)):
            same_label = cell_keys[q, 0] == cell_keys[t, 0]
            same_conf = cell_keys[q, 1] == cell_keys[t, 1]
            if same_label == same_conf:
                continue  # SS pairs never occur between distinct cells; OO pairs are untyped
            buf = best["so" if same_label else "os"]
            shared = np.intersect1d(cell_groups[q], cell_groups[t]).size > 0
            for qs in range(starts[q], starts[q + 1], b):
                qe = min(qs + b, starts[q + 1])
                for ts in range(starts[t], starts[t + 1], b):
                    te = min(ts + b, starts[t + 1])
                    dist = cosine_distance_block(us[qs:qe], us[ts:te])
                    # groups are sorted inside each cell, so a tile can hold a same-group pair
                    # only when the two group ranges overlap
                    if shared and gs[qe - 1] >= gs[ts] and gs[te - 1] >= gs[qs]:
                        np.copyto(dist, inf, where=gs[qs:qe, None] == gs[None, ts:te])
                    buf[qs:qe] = _keep_smallest(np.concatenate([buf[qs:qe], _keep_smallest(dist, m)], axis=1), m)
                    cols = np.ascontiguousarray(dist.T)
                    buf[ts:te] = _keep_smallest(np.concatenate([buf[ts:te], _keep_smallest(cols, m)], axis=1), m)
    so_out[order] = np.sort(best["so"], axis=1)
    os_out[order] = np.sort(best["os"], axis=1)
    return so_out, os_out

    lab = np.unique(labels, return_inverse=True)[1].ravel().astype(np.int64)
    con = np.unique(confounders, return_inverse=True)[1].ravel().astype(np.int64)
    n_con = int(con.max()) + 1
    cell_ids, cell_of = np.unique(lab * n_con + con, return_inverse=True)
    cell_of = cell_of.ravel()
    cell_keys = np.stack([cell_ids // n_con, cell_ids % n_con], axis=1)  # (label, confounder) per cell
    order = np.lexsort((np.asarray(groups), cell_of))  # by cell, then group: cells are slices
    starts = np.concatenate([[0], np.cumsum(np.bincount(cell_of, minlength=len(cell_keys)))])
    us = np.ascontiguousarray(u[order])
    gs = np.asarray(groups)[order]
    cell_groups = [np.unique(gs[starts[c] : starts[c + 1]]) for c in range(len(cell_keys))]
    inf = np.array(np.inf, dtype=us.dtype)

    for q, (lq, cq) in enumerate(cell_keys):
        so_cells = np.flatnonzero((cell_keys[:, 0] == lq) & (cell_keys[:, 1] != cq))
        os_cells = np.flatnonzero((cell_keys[:, 0] != lq) & (cell_keys[:, 1] == cq))
        for out, targets in ((so_out, so_cells), (os_out, os_cells)):
            if targets.size == 0:
                continue
            shared = {int(t): np.intersect1d(cell_groups[q], cell_groups[t]).size > 0 for t in targets}
            for qs in range(starts[q], starts[q + 1], b):
                qe = min(qs + b, starts[q + 1])
                queries, gq = us[qs:qe], gs[qs:qe]
                best = np.full((qe - qs, m), inf, dtype=us.dtype)
                for t in targets:
                    for ts in range(starts[t], starts[t + 1], b):
                        te = min(ts + b, starts[t + 1])
                        dist = cosine_distance_block(queries, us[ts:te])
                        # groups are sorted inside each cell, so a tile can hold a same-group
                        # pair only when the two group ranges overlap
                        if shared[int(t)] and gq[-1] >= gs[ts] and gs[te - 1] >= gq[0]:
                            np.copyto(dist, inf, where=gq[:, None] == gs[None, ts:te])
                        best = _keep_smallest(np.concatenate([best, _keep_smallest(dist, m)], axis=1), m)
                out[order[qs:qe]] = np.sort(best, axis=1)
    return so_out, os_out


def count_within(u, groups, radius, *, block_rows=None) -> np.ndarray:
    """Per row ``i``, the number of rows of other groups at cosine distance ``<= radius[i]``.

    ``u`` (n, d) normalised rows, ``groups`` (n,) codes, ``radius`` (n,) thresholds (``+inf`` counts
    every cross-group row). Returns int64 (n,).

    One blocked pass over the upper triangle of tiles: each distance tile serves both its rows
    (row counts) and its columns (column counts), so the GEMM work is about ``n²·d/2``. Rows are
    ordered by group first, so the same-group mask is only built for tiles whose group ranges
    overlap. Distances are ``1 - u_i·u_j`` in ``u``'s dtype (thresholds are cast to it); the clip to
    [0, 2] is implied because thresholds at or above 2 are treated as ``+inf``.
    """
    u, (groups, _, _) = _check_inputs(u, groups, groups, groups)
    radius = np.asarray(radius, dtype=np.float64)
    n = u.shape[0]
    if radius.shape != (n,):
        raise ValueError(f"radius must have shape ({n},), got {radius.shape}")
    b = _block(block_rows)
    order = np.argsort(groups, kind="stable")
    us = np.ascontiguousarray(u[order])
    gs = np.asarray(groups)[order]
    thr = np.where(radius >= 2.0, np.inf, radius)[order].astype(us.dtype)
    counts = np.zeros(n, dtype=np.int64)
    for qs in range(0, n, b):
        qe = min(qs + b, n)
        for ts in range(qs, n, b):
            te = min(ts + b, n)
            dist = us[qs:qe] @ us[ts:te].T
            np.subtract(1, dist, out=dist)
            overlap = gs[qe - 1] >= gs[ts]  # group codes are sorted: ranges overlap only here
            same = (gs[qs:qe, None] == gs[None, ts:te]) if overlap else None
            hit = dist <= thr[qs:qe, None]
            if same is not None:
                hit &= ~same
            counts[qs:qe] += np.count_nonzero(hit, axis=1)
            if ts != qs:
                hit = dist <= thr[None, ts:te]
                if same is not None:
                    hit &= ~same
                counts[ts:te] += np.count_nonzero(hit, axis=0)
    out = np.empty(n, dtype=np.int64)
    out[order] = counts
    return out
