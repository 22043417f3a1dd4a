"""Exact blocked cross-group k-nearest-neighbour search on normalised rows (spec/metrics.md §3, §12.4a).

The search runs over row blocks × column blocks. Each block of cosine distances is one BLAS GEMM
(:func:`~cachescore.neighbors.normalize.cosine_distance_block`); entries of the query's own group
(self included) are set to ``+inf`` *before* anything is selected, and each row's running top-k is
merged with the block's surviving candidates straight away. Peak memory is a few blocks
(``block_rows × block_cols``) plus the ``(n, kmax)`` output; an ``n × n`` matrix is never built.

Order contract: each output row is sorted by ``(distance, scope row index)`` ascending, so equal
distances are broken by the smaller index (spec §3.4: the reference's own tie order is
platform-defined; ours is deterministic).

Selection works on the similarity block ``S = Q @ X.T`` with a per-row bound, so the full block
is touched only by the GEMM, one comparison and one ``flatnonzero``: once a row holds ``kmax``
entries, a later entry can enter only if its distance is strictly below the current ``kmax``-th
distance ``t`` (column blocks are visited in increasing index order, so an equal distance always
loses the index tie-break), which implies ``S > 1 - t - ulp``; in the first block the
``kmax``-th largest similarity over a column sample gives the bound. The bound keeps a small
slack (a superset of the true survivors). Exact distances ``clip(1 - S, 0, 2)`` — the same
arithmetic as :func:`~cachescore.neighbors.normalize.cosine_distance_block` — are computed for
the survivors only, and merged with the running lists by one sort on ``(row, distance, index)``.
"""

from __future__ import annotations

import numpy as np

from .normalize import cosine_distance_block

__all__ = ["cross_group_knn", "farthest_rows", "default_block_sizes"]

#: Target number of distance entries in one block (rows × columns); ~32 MiB in float32.
_BLOCK_ENTRIES = 1 << 23


def default_block_sizes(n: int, dtype) -> tuple[int, int]:
    """Row and column block sizes for a scope of ``n`` rows (at most 2048 × 4096 entries).

    Narrow column blocks keep the first-block ``np.partition`` cheap; later blocks only compare
    against the running threshold."""
    cols = int(min(max(n, 1), 4096))
    rows = int(max(256, min(max(n, 1), _BLOCK_ENTRIES // max(cols, 1))))
    if np.dtype(dtype) == np.float64:
        rows = max(256, rows // 2)
    return rows, cols


def _check_inputs(u: np.ndarray, groups: np.ndarray, kmax: int):
    u = np.asarray(u)
    if u.ndim != 2:
        raise ValueError(f"u must be a 2-D array of normalised rows, got {u.ndim}-D")
    if u.dtype not in (np.float32, np.float64):
        raise TypeError(f"u must be float32 or float64 (see neighbors.normalize), got {u.dtype}")
    groups = np.asarray(groups)
    if groups.shape != (u.shape[0],):
        raise ValueError(f"groups must have shape ({u.shape[0]},), got {groups.shape}")
    if int(kmax) <= 0:
        raise ValueError(f"kmax must be > 0, got {kmax}")
    if not np.issubdtype(groups.dtype, np.integer) or (groups.size and int(groups.min()) < 0):
        groups = np.unique(groups, return_inverse=True)[1]
    return np.ascontiguousarray(u), groups.astype(np.int64, copy=False)


def _same_group_pairs(groups: np.ndarray, r0: int, r1: int, order: np.ndarray, starts: np.ndarray):
    """(local row, global column) of every same-group pair for rows r0..r1, sorted by column."""
    g = groups[r0:r1]
    lo = starts[g]
    hi = starts[g + 1]
    sizes = hi - lo
    total = int(sizes.sum())
    local = np.repeat(np.arange(r1 - r0, dtype=np.int64), sizes)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    cols = order[np.repeat(lo, sizes) + offsets]
    by_col = np.argsort(cols, kind="stable")
    return local[by_col], cols[by_col]


def cross_group_knn(u, groups, kmax: int, *, block_rows: int | None = None, block_cols: int | None = None):
    """The ``kmax`` nearest cross-group rows of every row, exactly.

    Parameters
    ----------
    u : ndarray of shape (n, d), float32 or float64
        Already-normalised rows (:func:`~cachescore.neighbors.normalize.normalize_rows`).
        Distances are computed in this dtype as ``clip(1 - u_i·u_j, 0, 2)``.
    groups : array of shape (n,)
        Group key per row (integer codes, or anything ``np.unique`` accepts). Row ``j`` is never a
        neighbour of ``i`` when ``groups[j] == groups[i]`` (this covers ``j == i``).
    kmax : int
        Window width, ``>= 1``. May exceed the number of cross-group rows.
    block_rows, block_cols : int, optional
        Block sizes; the result does not depend on them.

    Returns
    -------
    idx : ndarray of shape (n, kmax), int64
        Scope row indices, padded with -1 where a row has fewer than ``kmax`` cross-group rows.
    dist : ndarray of shape (n, kmax), float64
        Distances (exactly the compute-dtype values), padded with ``+inf``. Rows are ordered by
        ``(distance, index)`` ascending.

    Raises
    ------
    ValueError
        ``u`` not 2-D, ``groups`` of the wrong length, ``kmax <= 0``.
    TypeError
        ``u`` not float32/float64.
    """
    u, groups = _check_inputs(u, groups, kmax)
    n = u.shape[0]
    k = int(kmax)
    out_idx = np.full((n, k), -1, dtype=np.int64)
    out_dist = np.full((n, k), np.inf, dtype=np.float64)
    if n == 0:
        return out_idx, out_dist
    br, bc = default_block_sizes(n, u.dtype)
    br = int(block_rows or br)
    bc = int(block_cols or bc)
    if br <= 0 or bc <= 0:
        raise ValueError("block sizes must be positive")

    # Group membership lists (CSR) to mask same-group pairs without an (rows × cols) comparison.
    order = np.argsort(groups, kind="stable")
    n_groups = int(groups.max()) + 1 if n else 0
    starts = np.zeros(n_groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(groups, minlength=n_groups), out=starts[1:])
    if block_rows is None:  # bound the same-group pair lists (rows x largest group) per row block
        br = min(br, max(64, (1 << 22) // int(np.diff(starts).max())))
    kk = min(k, n)  # never more than n entries can be kept
    # similarity slack covering the rounding of 1 - S (a few ulp near 1) and of the bound's cast
    margin = 1e-6 if u.dtype == np.float32 else 4e-15

    for r0 in range(0, n, br):
        r1 = min(n, r0 + br)
        rb = r1 - r0
        q = u[r0:r1]
        pair_rows, pair_cols = _same_group_pairs(groups, r0, r1, order, starts)
        best_d = np.full((rb, kk), np.inf, dtype=np.float64)
        best_i = np.full((rb, kk), -1, dtype=np.int64)
        thresh = np.full(rb, np.inf, dtype=np.float64)
        for c0 in range(0, n, bc):
            c1 = min(n, c0 + bc)
            sim = q @ u[c0:c1].T  # one GEMM; distances are derived only for candidates
            lo, hi = np.searchsorted(pair_cols, [c0, c1])
            if hi > lo:
                sim[pair_rows[lo:hi], pair_cols[lo:hi] - c0] = -np.inf
            width = c1 - c0
            if width > kk and np.isinf(thresh).all():
                # Nothing kept yet (first block): the kk-th largest similarity over a column
                # sample bounds the row's kk-th nearest from above.
                sample = min(width, max(16 * kk, 1024))
                if sample > kk:
                    s_k = np.partition(sim[:, :sample], sample - kk, axis=1)[:, sample - kk].astype(np.float64)
                    # clip(1 - S, 0, 2) ties every S >= 1 at 0 and every S <= -1 at 2: keep them all
                    low = np.minimum(s_k, 1.0) - margin
                    low[s_k <= -1.0 + margin] = -np.inf
                else:
                    low = np.full(rb, -np.inf)
            else:
                # d < t  implies  S > 1 - t - ulp: a superset, refined exactly in the merge
                low = (1.0 - thresh) - margin
            flat = np.flatnonzero(sim >= low.astype(sim.dtype)[:, None])
            if flat.size == 0:
                continue
            cand_s = sim.ravel()[flat]
            finite = cand_s > -np.inf  # rows without a bound also let masked entries through
            if not finite.all():
                flat, cand_s = flat[finite], cand_s[finite]
            rows, cols = np.divmod(flat, width)
            # exactly cosine_distance_block's arithmetic, on the candidates only
            cand_d = np.clip(np.subtract(1, cand_s), 0, 2).astype(np.float64)
            cand_i = cols + c0
            # Merge with the running lists (old entries first: they have smaller indices), order
            # each row by (distance, index) and keep its first kk.
            keep_old = np.isfinite(best_d)
            all_rows = np.concatenate([np.nonzero(keep_old)[0], rows])
            all_d = np.concatenate([best_d[keep_old], cand_d])
            all_i = np.concatenate([best_i[keep_old], cand_i])
            if sim.dtype == np.float32:
                # row * 4 + d is exact in float64 for float32 d in [0, 2]; the stable sort keeps
                # index order among equal distances (old before new, each already index-ordered)
                perm = np.argsort(all_rows * 4.0 + all_d, kind="stable")
            else:
                perm = np.lexsort((all_i, all_d, all_rows))
            all_rows, all_d, all_i = all_rows[perm], all_d[perm], all_i[perm]
            first = np.searchsorted(all_rows, np.arange(rb))
            rank = np.arange(all_rows.size) - first[all_rows]
            sel = rank < kk
            best_d.fill(np.inf)
            best_i.fill(-1)
            best_d[all_rows[sel], rank[sel]] = all_d[sel]
            best_i[all_rows[sel], rank[sel]] = all_i[sel]
            thresh = best_d[:, kk - 1].copy()
        out_idx[r0:r1, :kk] = best_i
        out_dist[r0:r1, :kk] = best_d
    return out_idx, out_dist


def farthest_rows(u, queries=None, *, block_rows: int | None = None, block_cols: int | None = None) -> np.ndarray:
    """Index of the farthest scope row from each query row, over **all** rows (self included).

    This is the row the reference's capped fetch never sees (spec §3.2). The self-distance is
    taken as exactly 0 (the reference's symmetric path forces the diagonal to 0). Ties at the
    maximum distance go to the **largest** index, i.e. the last row in ``(distance, index)`` order.

    ``queries``: scope row indices to answer for (default: all rows). Returns int64 of shape
    ``(len(queries),)``.
    """
    u = np.ascontiguousarray(np.asarray(u))
    n = u.shape[0]
    queries = np.arange(n, dtype=np.int64) if queries is None else np.asarray(queries, dtype=np.int64)
    out = np.zeros(queries.shape[0], dtype=np.int64)
    if n == 0 or queries.size == 0:
        return out
    br, bc = default_block_sizes(n, u.dtype)
    br = int(block_rows or br)
    bc = int(block_cols or bc)
    for r0 in range(0, queries.size, br):
        qi = queries[r0 : r0 + br]
        q = u[qi]
        best = np.full(qi.size, -np.inf)
        arg = np.zeros(qi.size, dtype=np.int64)
        for c0 in range(0, n, bc):
            c1 = min(n, c0 + bc)
            block = cosine_distance_block(q, u[c0:c1]).astype(np.float64)
            inside = (qi >= c0) & (qi < c1)
            block[np.nonzero(inside)[0], qi[inside] - c0] = 0.0
            # last maximum in the block: argmax on the reversed columns
            rev = block[:, ::-1]
            j = (c1 - c0 - 1) - np.argmax(rev, axis=1)
            m = block[np.arange(qi.size), j]
            better = m >= best
            best[better] = m[better]
            arg[better] = j[better] + c0
        out[r0 : r0 + qi.size] = arg
    return out
