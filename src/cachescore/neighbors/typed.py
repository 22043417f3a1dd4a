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

__all__ = ["DEFAULT_BLOCK_ROWS", "typed_knn", "count_within", "similarity_floor"]

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


def _transpose(a: np.ndarray) -> np.ndarray:
    """C-contiguous transpose of a 2-D tile, copied in 64-row strips.

    A plain ``ascontiguousarray(a.T)`` walks the source column-wise and is several times slower
    on large tiles; strips keep both sides cache-resident."""
    out = np.empty((a.shape[1], a.shape[0]), dtype=a.dtype)
    for s in range(0, a.shape[0], 64):
        out[:, s : s + 64] = a[s : s + 64].T
    return out


def _merge_largest(buf: np.ndarray, tile: np.ndarray, m: int) -> None:
    """``buf`` (r, m) := per row the ``m`` largest of ``buf`` ∪ ``tile`` (r, w), unordered."""
    w = tile.shape[1]
    if w > m:
        tile = np.partition(tile, w - m, axis=1)[:, w - m :]
    both = np.concatenate([buf, tile], axis=1)
    buf[:] = np.partition(both, both.shape[1] - m, axis=1)[:, both.shape[1] - m :]


def _sim_to_dist(best: np.ndarray) -> np.ndarray:
    """Ascending float64 distances ``clip(1 - s, 0, 2)`` (computed in ``best``'s dtype, exactly as
    :func:`~cachescore.neighbors.normalize.cosine_distance_block`), ``-inf`` similarities → ``+inf``."""
    dist = np.clip(np.subtract(1, best), 0, 2)
    dist[np.isneginf(best)] = np.inf
    return np.sort(dist, axis=1).astype(np.float64)


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
        depend on it (up to the last-ulp effect of BLAS kernels chosen by tile shape).

    Returns
    -------
    so_dist, os_dist : float64 ndarrays of shape (n, m)
        Per row, the ``m`` smallest SO (same label, other confounder) and OS (other label, same
        confounder) cosine distances ``clip(1 - u_i·u_j, 0, 2)`` (in ``u``'s dtype) to rows of other
        groups, ascending, padded with ``+inf`` where the pool holds fewer than ``m`` rows. Ties are
        irrelevant: only values are returned.

    Raises
    ------
    ValueError
        ``u`` not 2-D, code arrays of the wrong shape, ``m < 1`` or ``block_rows < 1``.

    Notes
    -----
    Selection runs on similarities ``s = u_i·u_j``: distance is a non-increasing function of ``s``,
    so the multiset of the ``m`` largest similarities maps exactly onto the ``m`` smallest
    distances, and only the kept ``(n, m)`` values are converted. Same-group entries are set to
    ``-inf``. Cells are sorted by (label, confounder), so the later SO partners of a cell form one
    contiguous row range and are searched as one wide GEMM.
    """
    u, (labels, confounders, groups) = _check_inputs(u, labels, confounders, groups)
    m = int(m)
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    b = _block(block_rows)
    n = u.shape[0]
    if n < 2:
        return np.full((n, m), np.inf), np.full((n, m), np.inf)

    lab = np.unique(labels, return_inverse=True)[1].ravel().astype(np.int64)
    con = np.unique(confounders, return_inverse=True)[1].ravel().astype(np.int64)
    grp = np.unique(groups, return_inverse=True)[1].ravel().astype(np.int64)
    n_con = int(con.max()) + 1
    cell_ids, cell_of = np.unique(lab * n_con + con, return_inverse=True)
    cell_of = cell_of.ravel()
    cell_lab, cell_con = cell_ids // n_con, cell_ids % n_con
    order = np.lexsort((grp, cell_of))  # by cell (label-major), then group: cells are slices
    starts = np.concatenate([[0], np.cumsum(np.bincount(cell_of, minlength=len(cell_ids)))])
    us = np.ascontiguousarray(u[order])
    gs = grp[order]
    # which groups occur in each cell (boolean incidence), to know when a mask can be needed
    incidence = np.zeros((len(cell_ids), int(gs.max()) + 1), dtype=bool)
    incidence[cell_of[order], gs] = True
    neg = np.array(-np.inf, dtype=us.dtype)
    best = {"so": np.full((n, m), neg, dtype=us.dtype), "os": np.full((n, m), neg, dtype=us.dtype)}

    # Each unordered (query cell, later partner cells) pair is multiplied once; every tile is
    # reduced along its rows (for the query rows) and its columns (for the partner rows), since
    # SO and OS are symmetric relations.
    for q in range(len(cell_ids)):
        same_lab_later = np.flatnonzero((cell_lab == cell_lab[q]) & (np.arange(len(cell_ids)) > q))
        ranges = []
        if same_lab_later.size:  # contiguous: cells of one label are adjacent
            ranges.append(("so", starts[same_lab_later[0]], starts[same_lab_later[-1] + 1], same_lab_later))
        for t in np.flatnonzero((cell_con == cell_con[q]) & (cell_lab > cell_lab[q])):
            ranges.append(("os", starts[t], starts[t + 1], np.array([t])))
        for kind, t0, t1, cells in ranges:
            buf = best[kind]
            shared = bool((incidence[q] & incidence[cells].any(axis=0)).any())
            for qs in range(starts[q], starts[q + 1], b):
                qe = min(qs + b, starts[q + 1])
                for ts in range(t0, t1, b):
                    te = min(ts + b, t1)
                    sim = us[qs:qe] @ us[ts:te].T
                    if shared:
                        np.copyto(sim, neg, where=gs[qs:qe, None] == gs[None, ts:te])
                    _merge_largest(buf[qs:qe], sim, m)
                    _merge_largest(buf[ts:te], _transpose(sim), m)
    so_out = np.empty((n, m), dtype=np.float64)
    os_out = np.empty((n, m), dtype=np.float64)
    so_out[order] = _sim_to_dist(best["so"])
    os_out[order] = _sim_to_dist(best["os"])
    return so_out, os_out


def _to_key(x: np.ndarray) -> np.ndarray:
    """Order-preserving map of float32/float64 values to int64 keys."""
    bits = 31 if x.dtype == np.float32 else 63
    i = x.view(np.int32 if bits == 31 else np.int64).astype(np.int64)
    return i ^ ((i >> bits) & ((1 << bits) - 1))


def _from_key(k: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`_to_key`."""
    bits = 31 if dtype == np.float32 else 63
    i = k ^ ((k >> bits) & ((1 << bits) - 1))
    return i.astype(np.int32 if bits == 31 else np.int64).view(dtype)


def similarity_floor(radius: np.ndarray, dtype) -> np.ndarray:
    """Per row, the smallest ``s`` of ``dtype`` with ``fl(1 - s) <= radius`` (in ``dtype``).

    So ``1 - s <= r`` (distance as computed in ``dtype``, unclipped) holds exactly when
    ``s >= floor``: counting on similarities is bit-equivalent to counting on distances. ``radius``
    is cast to ``dtype`` first; ``radius >= 2`` (and ``+inf``) gives ``-inf`` (every row counts).
    Found by bisection over the ordered integer keys of ``dtype`` (the predicate is monotone).
    """
    dtype = np.dtype(dtype)
    r = np.asarray(radius, dtype=np.float64)
    big = r >= 2.0
    rt = np.where(big, 0.0, r).astype(dtype)
    one = dtype.type(1)
    # predicate false at -inf, true at +inf (radius < 2 is finite)
    lo = np.full(r.shape, _to_key(np.array([-np.inf], dtype=dtype))[0])
    hi = np.full(r.shape, _to_key(np.array([np.inf], dtype=dtype))[0])
    while True:
        open_ = hi > lo + 1
        if not open_.any():
            break
        mid = (lo & hi) + ((lo ^ hi) >> 1)  # floor midpoint without overflow
        s = _from_key(mid, dtype)
        ok = (one - s) <= rt
        hi = np.where(open_ & ok, mid, hi)
        lo = np.where(open_ & ~ok, mid, lo)
    out = _from_key(hi, dtype)
    out[big] = -np.inf
    return out


def count_within(u, groups, radius, *, block_rows=None) -> np.ndarray:
    """Per row ``i``, the number of rows of other groups at cosine distance ``<= radius[i]``.

    ``u`` (n, d) normalised rows, ``groups`` (n,) codes, ``radius`` (n,) thresholds (``+inf`` counts
    every cross-group row). Returns int64 (n,). Distances are ``1 - u_i·u_j`` in ``u``'s dtype with
    thresholds cast to it; thresholds at or above 2 count every cross-group row (the clip to [0, 2]
    is thereby implied).

    One blocked pass over the upper triangle of tiles: each similarity tile serves both its rows
    and its columns, so the GEMM work is about ``n²·d/2``. The comparison runs on similarities
    against :func:`similarity_floor` (exactly equivalent, no subtraction pass). Rows are ordered by
    group, so the same-group mask is only built for tiles whose group ranges overlap.
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
    floor = similarity_floor(radius[order], us.dtype)
    acc = np.uint16 if b < (1 << 16) else np.int64
    counts = np.zeros(n, dtype=np.int64)
    for qs in range(0, n, b):
        qe = min(qs + b, n)
        for ts in range(qs, n, b):
            te = min(ts + b, n)
            sim = us[qs:qe] @ us[ts:te].T
            overlap = gs[qe - 1] >= gs[ts]  # group codes are sorted: ranges overlap only here
            if overlap:
                # NaN compares False even against a -inf floor (radius >= 2 counts all others)
                np.copyto(sim, np.nan, where=gs[qs:qe, None] == gs[None, ts:te])
            hit = sim >= floor[qs:qe, None]
            counts[qs:qe] += hit.view(np.uint8).sum(axis=1, dtype=acc)
            if ts != qs:
                hit = np.greater_equal(sim, floor[None, ts:te], out=hit)
                counts[ts:te] += hit.view(np.uint8).sum(axis=0, dtype=acc)
    out = np.empty(n, dtype=np.int64)
    out[order] = counts
    return out
