"""Top-k merge kernels shared by every neighbour engine (numpy in, numpy out).

Every table is ``(idx, dist)`` of shape ``(b, k)``: int64 target indices (``-1`` pads) and float64
distances (``+inf`` pads), sorted per row by ``(dist, idx)`` (ADR-0001: ties broken by the smaller
index). Each kernel is exact under ties.

* :func:`topk` — the k best of a candidate matrix;
* :func:`merge_tables` — two tables of disjoint candidates into one;
* :func:`merge_tile` — a distance tile into a running table, in place (float32 fast path
  :func:`merge_keys`);
* :func:`merge_similarity_tile` — the same for a similarity tile, converting only the candidates
  and applying the group rule sparsely (:func:`same_group_pairs`): the out-of-core kernel.
"""

from __future__ import annotations

import numpy as np

__all__ = ["topk", "merge_tables", "merge_tile", "merge_similarity_tile", "same_group_pairs", "merge_keys",
           "MERGE_CANDIDATES", "ROW_CANDIDATES"]


def topk(dist: np.ndarray, idx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the k entries smallest by ``(dist, idx)``; +inf entries come out as (-1, +inf).

    ``dist`` (b, w) float64 with +inf for invalid entries, ``idx`` (b, w) int64. Returns (b, k).
    Exact under ties: the partition threshold keeps every entry equal to the k-th value.
    """
    b, w = dist.shape
    out_i = np.full((b, k), -1, dtype=np.int64)
    out_d = np.full((b, k), np.inf, dtype=np.float64)
    if b == 0 or w == 0:
        return out_i, out_d
    if w > 4 * k:
        thr = np.partition(dist, k - 1, axis=1)[:, k - 1 : k]
        r, c = np.nonzero(dist <= thr)
        d = dist[r, c]
        i = idx[r, c]
    else:
        r = np.repeat(np.arange(b), w)
        d = dist.ravel()
        i = idx.ravel()
    order = np.lexsort((i, d, r))
    r, d, i = r[order], d[order], i[order]
    start = np.searchsorted(r, np.arange(b))
    rank = np.arange(r.size) - start[r]
    keep = (rank < k) & np.isfinite(d)
    out_i[r[keep], rank[keep]] = i[keep]
    out_d[r[keep], rank[keep]] = d[keep]
    return out_i, out_d


def merge_tables(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], k: int):
    """Merge two (idx, dist) top lists of disjoint candidates into one top-k by (dist, idx)."""
    return topk(np.concatenate([a[1], b[1]], axis=1), np.concatenate([a[0], b[0]], axis=1), k)


#: :func:`merge_tile` tightens its per-row threshold when more than this many × k entries per
#: row (on average) would pass it, bounding its candidate arrays by the tile's rows × k.
MERGE_CANDIDATES = 4

#: :func:`merge_similarity_tile` tightens the threshold of a row from which more than this many ×
#: k entries of a tile would pass it (a selection for those rows only). Sorting up to 16 k
#: candidates of a row costs less than selecting its k-th of a 8,192-wide tile row: a brute task
#: of the calibration (1,500 queries × 32,768 rows, cross-group k = 21 with the typed m = 5) took
#: 1.27 s with the whole-tile selection at 4 k per row on average, 1.03 s with this rule.
ROW_CANDIDATES = 16


def merge_tile(bi, bd, dist, tids, k):
    """Merge a distance tile ``dist`` (b, w) (+inf = not eligible) over target rows ``tids`` (w,)
    into the running top-k ``bi`` / ``bd`` (b, k) by (dist, idx), in place. An entry farther than
    the row's current k-th distance is dropped before any sort (ties with it are kept), and so is
    every ``+inf`` entry (a row with fewer than k eligible entries so far has threshold ``+inf``,
    and ``inf <= inf`` must not turn its whole masked row into candidates)."""
    thr = bd[:, k - 1].astype(dist.dtype)
    if dist.shape[1] > k and not np.isfinite(thr).all():
        thr = np.minimum(thr, np.partition(dist, k - 1, axis=1)[:, k - 1])
    np.minimum(thr, np.finfo(dist.dtype).max, out=thr)
    b, w = dist.shape
    passing = dist <= thr[:, None]
    if w > k and np.count_nonzero(passing) > MERGE_CANDIDATES * b * k:
        # a tile much closer than the rows' current k-th neighbours: keep each row's own k best
        # (ties included) so the candidate arrays stay O(b k), not O(b w)
        thr = np.minimum(thr, np.partition(dist, k - 1, axis=1)[:, k - 1])
        passing = dist <= thr[:, None]
    flat = np.flatnonzero(passing)
    del passing
    if flat.size == 0:
        return
    r = flat // w
    _merge_candidates(bi, bd, np.ravel(dist)[flat], r, tids[flat - r * w], k)


def _merge_candidates(bi, bd, new_d, new_r, new_i, k) -> None:
    """Merge candidate entries (distances ``new_d`` in the tile's dtype, rows ``new_r``, indices
    ``new_i``) into the running top-k ``bi`` / ``bd`` by (dist, idx), in place: one packed-key
    sort for float32 when the keys fit 64 bits (:func:`merge_keys`), else a three-key lexsort."""
    b = bi.shape[0]
    if new_d.dtype == np.float32:
        ib = max(int(new_i.max(initial=0)), int(bi.max(initial=0)), 1).bit_length() + 1
        rb = max(1, (b - 1).bit_length())
        if rb + 31 + ib <= 64:
            merge_keys(bi, bd, new_d, new_r, new_i, k, ib)
            return
    rows = np.concatenate([np.repeat(np.arange(b), k), new_r])
    dd = np.concatenate([bd.ravel(), new_d.astype(np.float64)])
    ii = np.concatenate([bi.ravel(), new_i])
    order = np.lexsort((ii, dd, rows))
    rows, dd, ii = rows[order], dd[order], ii[order]
    rank = np.arange(rows.size) - np.searchsorted(rows, np.arange(b))[rows]
    keep = (rank < k) & np.isfinite(dd)
    bi[:] = -1
    bd[:] = np.inf
    bi[rows[keep], rank[keep]] = ii[keep]
    bd[rows[keep], rank[keep]] = dd[keep]


def same_group_pairs(q_groups: np.ndarray, t_groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(r, c)`` int64 of every pair with ``q_groups[r] == t_groups[c]``, without a (b, w)
    comparison: targets sorted by group once, each query's equal range found by binary search."""
    order = np.argsort(t_groups, kind="stable")
    srt = t_groups[order]
    lo = np.searchsorted(srt, q_groups, side="left")
    cnt = np.searchsorted(srt, q_groups, side="right") - lo
    total = int(cnt.sum())
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    r = np.repeat(np.arange(q_groups.size, dtype=np.int64), cnt)
    start = np.cumsum(cnt) - cnt
    pos = np.arange(total, dtype=np.int64) - np.repeat(start, cnt) + np.repeat(lo, cnt)
    return r, order[pos].astype(np.int64)


def merge_similarity_tile(bi, bd, sim, q_groups, t_groups, tids, k, *, margin=None) -> None:
    """:func:`merge_tile` for a *similarity* tile ``sim`` (b, w) of unit rows (``q · t``), with the
    group rule applied here: the distance ``clip(1 - sim, 0, 2)`` (in ``sim``'s dtype, the exact
    engines' arithmetic) is computed for the few entries that can enter the running top-k only, and
    same-group pairs (``q_groups[r] == t_groups[c]``) never enter. Same result as masking,
    converting the whole tile and calling :func:`merge_tile`, in place; ``sim`` (contiguous or a
    view of a larger tile) is written only where a pair is same-group (set to ``-inf``).

    Per row a similarity bound ``low`` keeps every entry whose distance can be ``<=`` the row's
    k-th (ties kept): ``1 - thr - margin`` (``margin`` 1e-6 for float32, 4e-15 for float64 covers
    the subtraction's rounding), ``-inf`` where the row holds fewer than k entries. Such rows
    first get a bound from this tile: its same-group entries set to ``-inf`` (found by
    :func:`same_group_pairs`, no dense comparison), the k-th largest of the maxima of
    :data:`BOUND_BLOCKS` column blocks (k distinct entries at least that similar: a distance no
    valid k-th can exceed; one pass over the tile instead of a selection per row, and nearly as
    tight as the row's own k-th). A row from which more than :data:`ROW_CANDIDATES` · k entries
    would still pass is bounded by its own k-th of the tile (a selection for those rows only).
    """
    b, w = sim.shape
    if b == 0 or w == 0:
        return
    if margin is None:
        margin = 1e-6 if sim.dtype == np.float32 else 4e-15
    r_same, c_same = same_group_pairs(np.asarray(q_groups), np.asarray(t_groups))
    sim[r_same, c_same] = -np.inf
    thr = bd[:, k - 1].astype(np.float64)
    open_rows = np.flatnonzero(~np.isfinite(thr))
    if open_rows.size and w >= k:
        sub = sim if open_rows.size == b else sim[open_rows]
        s_k = _kth_block_max(sub, k)
        thr[open_rows] = np.where(np.isfinite(s_k), np.clip(np.subtract(1, s_k), 0, 2), np.inf)

    def bound(t):
        low = (1.0 - t) - margin  # -inf where t is inf
        low[t >= 2.0 - margin] = -np.inf  # every S <= -1 ties at distance 2
        return low.astype(sim.dtype)[:, None]

    passing = sim >= bound(thr)
    if w > k:
        _bound_flooded_rows(sim, passing, thr, k, bound)
    flat = np.flatnonzero(passing)
    del passing
    r = flat // w
    c = flat - r * w
    cand_s = sim[r, c]  # ``sim`` may be a view of a larger tile (no ravel copy)
    valid = cand_s > -np.inf  # not a same-group pair
    d = np.clip(np.subtract(1, cand_s), 0, 2)
    keep = valid & (d <= thr[r])
    if not keep.any():
        return
    _merge_candidates(bi, bd, d[keep], r[keep], tids[c[keep]], k)


def _bound_flooded_rows(sim, passing, thr, k, bound) -> None:
    """Rows of a similarity tile ``sim`` (b, w), w > k, much closer than their current k-th
    neighbours (more than :data:`ROW_CANDIDATES` · k entries ``passing``): each such row's own k
    best of the tile (ties included) bound it, so no row hands more than that to the sort. A
    selection for those rows only, not the whole tile; ``thr`` (b,) float64 distance bounds and
    ``passing`` (b, w) are updated in place (``bound(t)`` gives a (rows, 1) similarity bound)."""
    w = sim.shape[1]
    heavy = np.flatnonzero(_row_counts(passing) > ROW_CANDIDATES * k)
    if heavy.size == 0:
        return
    sub = sim[heavy]
    s_k = np.partition(sub, w - k, axis=1)[:, w - k]
    own = np.where(np.isfinite(s_k), np.clip(np.subtract(1, s_k), 0, 2).astype(np.float64), np.inf)
    thr[heavy] = np.minimum(thr[heavy], own)
    passing[heavy] = sub >= bound(thr[heavy])


def _row_counts(mask: np.ndarray) -> np.ndarray:
    """True entries per row of a boolean (b, w) array: its bytes summed in a narrow integer
    (~6x faster than ``np.count_nonzero(mask, axis=1)``, which converts to intp first)."""
    acc = np.uint16 if mask.shape[1] < np.iinfo(np.uint16).max else np.uint64
    return np.ascontiguousarray(mask).view(np.uint8).sum(axis=1, dtype=acc)


#: Column blocks per row whose maxima bound a row without k entries (:func:`merge_similarity_tile`).
BOUND_BLOCKS = 128


def _kth_block_max(sim: np.ndarray, k: int) -> np.ndarray:
    """Per row of ``sim`` (b, w), w >= k: the k-th largest of the maxima of ``nb = max(k,
    BOUND_BLOCKS)`` disjoint column blocks, a lower bound of the row's k-th largest entry (each of
    those maxima is a different entry); the k-th largest itself when the blocks are single
    columns. Block ``j`` holds columns ``j, j + nb, j + 2 nb, ...`` of the first ``(w // nb) · nb``
    (strided: an element-wise maximum of contiguous column runs, ~2.6x faster than a
    ``reduceat`` over consecutive blocks of a 1,024 x 8,192 tile; the bound is as valid)."""
    b, w = sim.shape
    nb = max(k, BOUND_BLOCKS)
    size = w // nb
    if size <= 1:
        return np.partition(sim, w - k, axis=1)[:, w - k]
    maxima = sim[:, : size * nb].reshape(b, size, nb).max(axis=1)
    return np.partition(maxima, nb - k, axis=1)[:, nb - k]


def merge_keys(bi, bd, new_d, new_r, new_i, k, ib):
    """float32 fast path of :func:`merge_tile`: (row, distance, index) packed into one uint64
    (row · 2^(31+ib) + float32 bits · 2^ib + index; the bits of a non-negative float32 order like
    its value), so one ``np.sort`` replaces a three-key ``lexsort``. Exact: same result."""
    b = bi.shape[0]
    u64 = np.uint64
    sh_d, sh_r = u64(ib), u64(31 + ib)
    pad = (1 << ib) - 1
    acc_bits = bd.astype(np.float32).view(np.uint32).astype(u64) & u64(0x7FFFFFFF)
    acc = (np.repeat(np.arange(b, dtype=u64), bi.shape[1]) << sh_r) | (acc_bits.ravel() << sh_d) | np.where(
        bi < 0, pad, bi
    ).astype(u64).ravel()
    new = (new_r.astype(u64) << sh_r) | ((new_d.view(np.uint32).astype(u64) & u64(0x7FFFFFFF)) << sh_d) | new_i.astype(u64)
    keys = np.concatenate([acc, new])
    keys.sort()
    rows = (keys >> sh_r).astype(np.int64)
    rank = np.arange(rows.size) - np.searchsorted(rows, np.arange(b))[rows]
    keep = rank < k
    keys, rows, rank = keys[keep], rows[keep], rank[keep]
    d = ((keys >> sh_d) & u64(0x7FFFFFFF)).astype(np.uint32).view(np.float32)
    fin = np.isfinite(d)
    bi[:] = -1
    bd[:] = np.inf
    bi[rows[fin], rank[fin]] = (keys[fin] & u64(pad)).astype(np.int64)
    bd[rows[fin], rank[fin]] = d[fin]
