"""Exact blocked cross-group k-nearest-neighbour search on normalised rows (spec/metrics.md §3, §12.4a).

Symmetric tiling. The scope is cut into square row blocks ``B_0, B_1, …``; for every pair
``I <= J`` one BLAS GEMM gives the similarity tile ``S = U_I @ U_J.T``, and that one tile is
reduced to top-k candidates along **both** axes: its rows feed the rows of ``B_I``, its columns
the rows of ``B_J``. Every distance is therefore computed once (for scopes of many tiles about
half the flops of a query-by-query search), and ``d(i, j) == d(j, i)`` bit for bit. Entries of a row's own group
(self included) are set to ``-inf`` in the tile before anything is selected. Peak memory is one
tile and two boolean masks of it plus the ``(n, kmax)`` lists; an ``n × n`` matrix is never built.

Order contract: each output row is sorted by ``(distance, scope row index)`` ascending, so equal
distances are broken by the smaller index (spec §3.4: the reference's own tie order is
platform-defined; ours is deterministic).

Selection works on similarities with a per-row lower bound, so a tile is touched only by the
GEMM, two comparisons, one ``or`` and one ``flatnonzero`` (the diagonal tiles: one comparison).
The pairs are visited as ``for I: for J >= I`` so every row meets its column blocks in
increasing index order; once a row holds ``kmax`` entries a later entry can enter only if its
distance is strictly below the current ``kmax``-th distance ``t`` (an equal distance loses the
index tie-break), which implies ``S > 1 - t - ulp``. A row with fewer than ``kmax`` entries takes
as bound the ``kmax``-th largest of the maxima of ``4 kmax`` disjoint column chunks of the tile:
``kmax`` chunks reaching a value hold ``kmax`` distinct rows at least that similar, so the row's
final ``kmax``-th nearest is at least that near. Bounds keep a small slack (a superset of the
true survivors). Exact distances ``clip(1 - S, 0, 2)`` — the arithmetic of
:func:`~cachescore.neighbors.normalize.cosine_distance_block` — are computed for the survivors
only. Each row's running list and its survivors are merged by one sort along the row: for
float32 distances and int32 indices (the common case) of packed int64 keys ``bits(d) << 32 |
index``, which order exactly like ``(distance, index)`` (a non-negative float's bits order like
its value); otherwise a stable sort on distance, where running entries precede the tile's and
both are in increasing index order, so stability is the index tie-break.

Bits: a distance is one entry of one GEMM whichever side of the tile uses it, so
``d(i, j) == d(j, i)`` exactly. BLAS computes an entry with the same accumulation order over
``d`` whatever the tile shape on the platforms tested (OpenBLAS), so the ``rows=`` path and the
query path of the reference give the same bits there; the contract (spec §12.3) only promises
agreement to a few ulp.

Threads: the tile pairs are shared by ``n_threads`` Python threads (default: the usable cores)
pulling from one queue in the ``I <= J`` order; each keeps its own running lists, merged at the
end by ``(distance, index)``. numpy's GEMM, comparisons, ``flatnonzero`` and sorts release the
GIL, so one thread's selection overlaps another's GEMM. BLAS is pinned to one thread for the
whole symmetric search (process-wide, threadpoolctl), whatever ``n_threads``: a two-thread
OpenBLAS dgemm was seen to round some entries differently from a one-thread one, and the tables
must not depend on the thread count (they do not: tested bit for bit).

``rows=`` restricts the search to a subset of query rows (for distributing one scope over
workers); it runs the same selection over query-row × column tiles in increasing column order.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import ThreadpoolController

from .._finite import require_finite
from .normalize import cosine_distance_block

__all__ = ["cross_group_knn", "farthest_rows", "default_block_sizes", "search_flops"]

#: Target number of distance entries in one block (rows × columns); ~32 MiB in float32.
_BLOCK_ENTRIES = 1 << 23
#: Target edge of a square tile of the symmetric search (float32; float64: half). Large tiles keep
#: BLAS efficient and the merges few; the diagonal tiles (computed whole) cost ~n·tile·d extra.
_TILE = 2688
#: Scope sizes from which the default tiling uses at least 2 / 3 row blocks (3 / 6 tile pairs).
_SPLIT_2 = 768
_SPLIT_3 = 1536
#: Padded-matrix merge unless it would exceed 4× the merged entries plus this many slots.
_FLAT_SLACK = 1 << 16


def default_block_sizes(n: int, dtype) -> tuple[int, int]:
    """Row and column block sizes of the query-row path / :func:`farthest_rows` (≤ 2048 × 4096)."""
    cols = int(min(max(n, 1), 4096))
    rows = int(max(256, min(max(n, 1), _BLOCK_ENTRIES // max(cols, 1))))
    if np.dtype(dtype) == np.float64:
        rows = max(256, rows // 2)
    return rows, cols


def _tile_size(n: int, dtype) -> int:
    """Edge of the square tiles: ≤ ``_TILE`` (float64: half), equal tiles covering ``n``.

    At least 3 blocks (6 tile pairs) from ``_SPLIT_3`` rows on and 2 from ``_SPLIT_2`` on, so
    the pairs can be shared by threads; independent of the thread count (results must be too).
    """
    target = _TILE if np.dtype(dtype) == np.float32 else _TILE // 2
    blocks = -(-max(n, 1) // target)
    blocks = max(blocks, 3 if n >= _SPLIT_3 else 2 if n >= _SPLIT_2 else 1)
    return -(-max(n, 1) // blocks)


def search_flops(n: int, d: int, dtype=np.float32, block: int | None = None) -> int:
    """Multiply-add flops (``2 × entries × d``) of the GEMMs one whole-scope :func:`cross_group_knn`
    performs: every tile pair ``I <= J`` once (about ``n² d`` instead of ``2 n² d``).

    ``dtype`` and ``block`` (``block_rows``) as the search would see them (they set the tile edge).
    """
    if n <= 0:
        return 0
    tile = int(block) if block else _tile_size(n, dtype)
    sizes = [min(n, s + tile) - s for s in range(0, n, tile)]
    entries = sum(sizes[i] * sizes[j] for i in range(len(sizes)) for j in range(i, len(sizes)))
    return 2 * entries * int(d)


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


class _Groups:
    """Rows sorted by ``(group, index)``, to find the same-group pairs of any tile by binary search
    (no (rows × cols) comparison, memory bounded by the tile whatever the group sizes)."""

    def __init__(self, groups: np.ndarray):
        if groups.size and int(groups.max()) >= groups.size:  # codes < n keep the keys in range
            groups = np.unique(groups, return_inverse=True)[1].astype(np.int64)
        self.groups = groups
        self.n = groups.size
        order = np.argsort(groups, kind="stable")
        self.keys = groups[order] * self.n + order  # ascending; groups < n, so no overflow

    def tile_pairs(self, a0: int, a1: int, b0: int, b1: int):
        """(row - a0, column - b0) of every same-group pair of the tile ``a0:a1 × b0:b1``."""
        base = self.groups[a0:a1] * self.n
        lo = np.searchsorted(self.keys, base + b0)
        sizes = np.searchsorted(self.keys, base + b1) - lo
        total = int(sizes.sum())
        if total == 0:
            return None
        local = np.repeat(np.arange(a1 - a0, dtype=np.int64), sizes)
        pos = np.arange(total, dtype=np.int64) + np.repeat(lo - (np.cumsum(sizes) - sizes), sizes)
        return local, self.keys[pos] % self.n - b0


class _Running:
    """The running ``(n, kk)`` top lists and the bound logic of the selection."""

    def __init__(self, n: int, kk: int, dtype):
        self.kk = kk
        self.f32 = np.dtype(dtype) == np.float32
        self.dtype = np.dtype(dtype)
        # lists kept in the compute dtype (distances are exactly such numbers) and the smallest
        # index type: less memory traffic in the merges; widened once at the end
        itype = np.int32 if n < np.iinfo(np.int32).max else np.int64
        self.dist = np.full((n, kk), np.inf, dtype=self.dtype)
        self.idx = np.full((n, kk), -1, dtype=itype)
        # float32 distances and int32 indices: merges sort packed int64 (distance, index) keys
        self.packed = self.f32 and itype == np.int32
        # similarity slack covering the rounding of 1 - S (a few ulp near 1) and of the bound's cast
        self.margin = 1e-6 if self.f32 else 4e-15

    def bounds(self, r0: int, r1: int, maxima_fn) -> np.ndarray:
        """Similarity lower bounds (compute dtype) for running rows ``r0:r1`` against one tile.

        A full row's bound comes from its ``kk``-th distance. A row not yet full gets the
        ``kk``-th largest of ``maxima_fn(rows)``: maxima of disjoint column chunks of the tile
        (shape (len(rows), chunks), ``chunks >= kk``; ``None`` when the tile is narrower than
        ``kk``). ``kk`` chunks reaching a value hold ``kk`` distinct rows at least as similar, so
        the row's final ``kk``-th nearest is at least that near.
        """
        t = self.dist[r0:r1, self.kk - 1].astype(np.float64)
        low = (1.0 - t) - self.margin  # -inf where the row is not full
        need = np.flatnonzero(np.isinf(t))
        if need.size:
            maxima = maxima_fn(need)
            if maxima is not None:
                chunks = maxima.shape[1]
                s_k = np.partition(maxima, chunks - self.kk, axis=1)[:, chunks - self.kk].astype(np.float64)
                # clip(1 - S, 0, 2) ties every S >= 1 at 0 and every S <= -1 at 2: keep them all
                b = np.minimum(s_k, 1.0) - self.margin
                b[s_k <= -1.0 + self.margin] = -np.inf
                low[need] = b
        return low.astype(self.dtype)

    def merge(self, r0: int, r1: int, rows: np.ndarray, cand_s: np.ndarray, cand_i: np.ndarray, grouped: bool) -> None:
        """Merge candidates (``rows`` relative to ``r0``, similarities, scope indices) into ``r0:r1``.

        The candidates of one row must come in increasing index order and have larger indices
        than that row's running entries (the visiting order guarantees both); ``grouped``: the
        candidates are already sorted by row. Each touched row's running list and candidates are
        laid side by side in one padded matrix and sorted along the row: as packed
        ``(distance, index)`` int64 keys (float32 / int32 lists), or stably by distance, so equal
        distances keep index order: the ``(distance, index)`` order either way.
        """
        if rows.size == 0:
            return
        kk = self.kk
        m = r1 - r0
        if not grouped:
            key = rows.astype(np.int16) if m <= np.iinfo(np.int16).max else rows  # int16: radix sort
            order = np.argsort(key, kind="stable")
            rows, cand_s, cand_i = rows[order], cand_s[order], cand_i[order]
        counts = np.bincount(rows, minlength=m)
        touched = np.flatnonzero(counts)
        t = touched.size
        # rows as a slice when every row is touched (the common case): no fancy indexing
        where = slice(r0, r1) if t == m else r0 + touched
        counts = counts[touched]
        width = kk + int(counts.max())
        # exactly cosine_distance_block's arithmetic, on the candidates only
        cand_d = np.clip(np.subtract(1, cand_s), 0, 2)
        cand_d += 0  # -0.0 -> +0.0 (packed keys order by bits); no other value changes
        if t * width > 4 * (t * kk + rows.size) + _FLAT_SLACK:
            self._merge_flat(r0, touched, np.repeat(np.arange(t), counts), cand_d, cand_i)
            return
        starts = np.cumsum(counts) - counts
        slot = np.repeat(np.arange(t), counts)
        col = kk + np.arange(rows.size) - np.repeat(starts, counts)
        if self.packed:
            # one int64 key per entry ordering like (distance, index): a single unstable sort
            keys = np.full((t, width), _PACKED_PAD, dtype=np.int64)
            keys[:, :kk] = _pack(self.dist[where], self.idx[where])
            keys[slot, col] = _pack(cand_d, cand_i)
            top = np.sort(keys, axis=1)[:, :kk]
            self.dist[where], self.idx[where] = _unpack(top)
            return
        dist = np.empty((t, width), dtype=self.dist.dtype)
        idx = np.empty((t, width), dtype=self.idx.dtype)
        dist[:, :kk] = self.dist[where]
        idx[:, :kk] = self.idx[where]
        dist[:, kk:] = np.inf
        idx[:, kk:] = -1
        dist[slot, col] = cand_d
        idx[slot, col] = cand_i
        perm = np.argsort(dist, axis=1, kind="stable")[:, :kk]
        self.dist[where] = np.take_along_axis(dist, perm, axis=1)
        self.idx[where] = np.take_along_axis(idx, perm, axis=1)

    def _merge_flat(self, r0: int, touched: np.ndarray, new_r: np.ndarray, new_d: np.ndarray, new_i: np.ndarray) -> None:
        """:meth:`merge` for very uneven candidate counts: one sort on ``(row, distance, index)``."""
        kk = self.kk
        old_d = self.dist[r0 + touched]
        old_i = self.idx[r0 + touched]
        keep = np.isfinite(old_d)
        all_r = np.concatenate([np.nonzero(keep)[0], new_r])
        all_d = np.concatenate([old_d[keep], new_d])
        all_i = np.concatenate([old_i[keep], new_i])
        perm = np.lexsort((all_i, all_d, all_r))
        all_r, all_d, all_i = all_r[perm], all_d[perm], all_i[perm]
        first = np.searchsorted(all_r, np.arange(touched.size))
        rank = np.arange(all_r.size) - first[all_r]
        sel = rank < kk
        out_d = np.full((touched.size, kk), np.inf, dtype=self.dist.dtype)
        out_i = np.full((touched.size, kk), -1, dtype=self.idx.dtype)
        out_d[all_r[sel], rank[sel]] = all_d[sel]
        out_i[all_r[sel], rank[sel]] = all_i[sel]
        self.dist[r0 + touched] = out_d
        self.idx[r0 + touched] = out_i


#: Packed key of the padding entry (+inf, -1): larger than every real entry's key.
_PACKED_PAD = (0x7F800000 << 32) | 0xFFFFFFFF


def _pack(dist: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """int64 keys ordering like ``(distance, index)`` for float32 distances ``>= +0`` (or +inf)
    and int32 indices (``-1`` padding only with +inf): a non-negative float's bits order like its
    value, so ``bits << 32 | index`` (index as unsigned 32 bits) orders like the pair."""
    key = dist.view(np.int32).astype(np.int64) << 32
    key |= idx.astype(np.int64) & 0xFFFFFFFF
    return key


def _unpack(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`_pack`: float32 distances and int32 indices."""
    dist = (key >> 32).astype(np.int32).view(np.float32)
    idx = (key & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    return dist, idx


def _row_maxima(sim: np.ndarray, rows: np.ndarray, kk: int):
    """Maxima of ``min(width, 4 kk)`` disjoint, interleaved column chunks for ``rows`` of ``sim``."""
    width = sim.shape[1]
    if width < kk:
        return None
    chunks = min(width, 4 * kk)
    c = width // chunks
    part = sim[:, : c * chunks] if rows.size == sim.shape[0] else sim[rows, : c * chunks]
    return part.reshape(part.shape[0], c, chunks).max(axis=1)


def _col_maxima(sim: np.ndarray, cols: np.ndarray, kk: int):
    """:func:`_row_maxima` of the columns ``cols`` of ``sim`` (chunks of its rows)."""
    height = sim.shape[0]
    if height < kk:
        return None
    chunks = min(height, 4 * kk)
    c = height // chunks
    part = sim[: c * chunks] if cols.size == sim.shape[1] else sim[: c * chunks, cols]
    return np.ascontiguousarray(part.reshape(c, chunks, part.shape[1]).max(axis=0).T)


def cross_group_knn(
    u,
    groups,
    kmax: int,
    *,
    block_rows: int | None = None,
    block_cols: int | None = None,
    rows: slice | None = None,
    n_threads: int | None = None,
):
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
        Tile sizes; the result does not depend on them wherever the BLAS computes a GEMM entry
        independently of the call's shape (OpenBLAS's native kernels; a kernel forced with
        ``OPENBLAS_CORETYPE`` can move entries by one float32 ulp between shapes, see
        ``tests/blas_equality.py``). The symmetric search uses square tiles
        of edge ``min(block_rows, block_cols)`` (whichever is given); the ``rows=`` path uses
        ``block_rows × block_cols`` tiles.
    rows : slice, optional
        Answer only for the query rows ``range(n)[rows]`` (against all ``n`` rows); the result
        then has ``len(range(n)[rows])`` rows, equal to those rows of the whole-scope call.
    n_threads : int, optional
        Python threads for the symmetric search's tile pairs (never more than there are pairs).
        Default: the usable cores (``os.sched_getaffinity``), or 1 when the loaded BLAS is
        already limited to one thread (e.g. inside a pinned Dask worker). The symmetric search
        limits BLAS to one thread **process-wide** for the duration of the call (threadpoolctl),
        whatever ``n_threads``, so the result is identical for every value. Ignored by the
        ``rows=`` path.

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
        ``u`` not 2-D, ``groups`` of the wrong length, ``kmax <= 0``, block sizes ``<= 0``,
        ``rows`` not a slice of step 1, ``n_threads <= 0``; a row holding NaN or ±inf (whole-scope
        calls; ``rows=`` calls are blocks of a search whose caller checked ``u``).
    TypeError
        ``u`` not float32/float64.
    """
    u, groups = _check_inputs(u, groups, kmax)
    if rows is None:  # the whole-scope search (a rows= call is one block of a checked search)
        require_finite(u)
    n = u.shape[0]
    k = int(kmax)
    for b in (block_rows, block_cols):
        if b is not None and int(b) <= 0:
            raise ValueError("block sizes must be positive")
    if n_threads is not None and int(n_threads) <= 0:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    if rows is not None:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise ValueError(f"rows must be a slice with step 1, got {rows!r}")
        q0, q1, _ = rows.indices(n)
        return _query_rows(u, groups, k, max(q0, 0), max(q0, q1), block_rows, block_cols)
    if n == 0:
        return np.full((0, k), -1, dtype=np.int64), np.full((0, k), np.inf)
    kk = min(k, n)  # never more than n entries can be kept
    grp = _Groups(groups)
    given = [int(b) for b in (block_rows, block_cols) if b is not None]
    tile = min(min(given), n) if given else _tile_size(n, u.dtype)
    starts = list(range(0, n, tile))
    pairs = [(a0, b0) for bi, a0 in enumerate(starts) for b0 in starts[bi:]]
    threads = _thread_count(n_threads, len(pairs))
    # BLAS on one thread for every tile, whatever n_threads: a multi-threaded dgemm may split the
    # work differently and move the last bit of an entry, and the result must not depend on the
    # thread count (the Python threads below supply the parallelism)
    with _controller().limit(limits=1, user_api="blas"):
        if threads <= 1:
            run = _Running(n, kk, u.dtype)
            work = _TileWork(u, grp, run, kk, tile)
            for a0, b0 in pairs:
                work.pair(a0, b0)
            return _widen(run, k)
        return _widen(_threaded_search(u, grp, kk, tile, pairs, threads), k)


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


_CONTROLLER: list = []


def _controller() -> ThreadpoolController:
    """One threadpoolctl controller per process (finding the libraries costs ~10 ms a call).

    numpy's BLAS is loaded before this module runs, so the pool that computes our GEMMs is in it;
    thread counts are read live from the libraries at each query.
    """
    if not _CONTROLLER:
        _CONTROLLER.append(ThreadpoolController())
    return _CONTROLLER[0]


def _blas_threads() -> int:
    """Largest thread count of the BLAS pools loaded in this process (1 when none is found)."""
    counts = [int(i.get("num_threads") or 1) for i in _controller().info() if i.get("user_api") == "blas"]
    return max(counts) if counts else 1


def _thread_count(n_threads: int | None, n_pairs: int) -> int:
    """Python threads for ``n_pairs`` tile pairs.

    Default: the usable cores, but 1 when BLAS is already pinned to one thread (a Dask worker or
    any caller that budgets its own parallelism: we do not oversubscribe behind its back).
    """
    if n_threads is None:
        want = _usable_cores() if _blas_threads() > 1 else 1
    else:
        want = int(n_threads)
        if want <= 0:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
    return max(1, min(want, n_pairs))


class _TileWork:
    """One thread's reduction of tile pairs into its running lists (its own tile buffers)."""

    def __init__(self, u: np.ndarray, grp: _Groups, run: _Running, kk: int, tile: int):
        self.u, self.grp, self.run, self.kk = u, grp, run, kk
        self.n = u.shape[0]
        self.tile = tile
        self.buf = np.empty(tile * tile, dtype=u.dtype)
        self.hit = np.empty(tile * tile, dtype=bool)
        self.hit_c = np.empty(tile * tile, dtype=bool)

    def pair(self, a0: int, b0: int) -> None:
        """Reduce the tile ``B_I × B_J`` (blocks starting at ``a0 <= b0``) along both axes."""
        u, run, kk, n, tile = self.u, self.run, self.kk, self.n, self.tile
        a1 = min(n, a0 + tile)
        b1 = min(n, b0 + tile)
        ra, cb = a1 - a0, b1 - b0
        sim = self.buf[: ra * cb].reshape(ra, cb)
        np.matmul(u[a0:a1], u[b0:b1].T, out=sim)  # one GEMM; distances only for candidates
        same = self.grp.tile_pairs(a0, a1, b0, b1)
        if same is not None:
            sim[same] = -np.inf
        diagonal = a0 == b0
        low_r = run.bounds(a0, a1, lambda r: _row_maxima(sim, r, kk))
        mask = self.hit[: ra * cb].reshape(ra, cb)
        np.greater_equal(sim, low_r[:, None], out=mask)
        if not diagonal:
            low_c = run.bounds(b0, b1, lambda r: _col_maxima(sim, r, kk))
            mask_c = self.hit_c[: ra * cb].reshape(ra, cb)
            np.greater_equal(sim, low_c[None, :], out=mask_c)
            np.logical_or(mask, mask_c, out=mask)
        flat = np.flatnonzero(mask)
        if flat.size == 0:
            return
        cand = sim.ravel()[flat]
        r, c = np.divmod(flat, cb)
        # masked (-inf) entries pass only bounds of -inf: drop them here
        on_row = cand >= low_r[r]
        on_row &= cand > -np.inf
        run.merge(a0, a1, r[on_row], cand[on_row], c[on_row] + b0, grouped=True)
        if not diagonal:
            on_col = cand >= low_c[c]
            on_col &= cand > -np.inf
            run.merge(b0, b1, c[on_col], cand[on_col], r[on_col] + a0, grouped=False)


def _threaded_search(u: np.ndarray, grp: _Groups, kk: int, tile: int, pairs: list, threads: int) -> _Running:
    """The tile pairs on ``threads`` Python threads (the caller has pinned BLAS to one thread).

    Threads pull pairs from one queue in the global ``I <= J`` order, so each thread still meets
    every row's column blocks in increasing index order (the merge's tie-break invariant) and each
    thread's lists are the exact ``(distance, index)`` top of the tiles it saw. Their union's top
    is the whole-scope top whichever thread saw which tile, and a tile's GEMM bits do not depend
    on the thread that computes it (BLAS single-threaded here), so the result equals the
    single-thread path's exactly. numpy's GEMM, comparisons, ``flatnonzero`` and sorts release the
    GIL, so one thread's selection overlaps the other's GEMM.
    """
    n = u.shape[0]
    lock = threading.Lock()
    queue = iter(pairs)

    def worker() -> _Running:
        run = _Running(n, kk, u.dtype)
        work = _TileWork(u, grp, run, kk, tile)
        while True:
            with lock:
                nxt = next(queue, None)
            if nxt is None:
                return run
            work.pair(*nxt)

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cachescore-knn") as pool:
        runs = [f.result() for f in [pool.submit(worker) for _ in range(threads)]]
    return _merge_runs(runs)


def _merge_runs(runs: list) -> _Running:
    """The exact ``(distance, index)`` top ``kk`` of several threads' running lists."""
    out = runs[0]
    if len(runs) == 1:
        return out
    kk = out.kk
    dist = np.concatenate([r.dist for r in runs], axis=1)
    idx = np.concatenate([r.idx for r in runs], axis=1)
    # padding is (inf, -1) and real distances are finite (<= 2): padding never outranks an entry
    if out.packed:
        out.dist, out.idx = _unpack(np.sort(_pack(dist, idx), axis=1)[:, :kk])
        return out
    order = np.lexsort((idx, dist), axis=1)[:, :kk]
    out.dist = np.take_along_axis(dist, order, axis=1)
    out.idx = np.take_along_axis(idx, order, axis=1)
    return out


def _widen(run: _Running, k: int):
    """The ``(n, k)`` int64 / float64 output tables from the running lists (padded to ``k``)."""
    n, kk = run.idx.shape
    out_idx = np.full((n, k), -1, dtype=np.int64)
    out_dist = np.full((n, k), np.inf, dtype=np.float64)
    out_idx[:, :kk] = run.idx
    out_dist[:, :kk] = run.dist
    return out_idx, out_dist


def _query_rows(u, groups, k, q0, q1, block_rows, block_cols):
    """``cross_group_knn`` for the query rows ``q0:q1`` only: query-row × column tiles."""
    n = u.shape[0]
    m = q1 - q0
    out_idx = np.full((m, k), -1, dtype=np.int64)
    out_dist = np.full((m, k), np.inf, dtype=np.float64)
    if m == 0 or n == 0:
        return out_idx, out_dist
    kk = min(k, n)
    grp = _Groups(groups)
    br, bc = default_block_sizes(n, u.dtype)
    br = int(block_rows or br)
    bc = int(block_cols or bc)
    run = _Running(m, kk, u.dtype)
    for r0 in range(q0, q1, br):
        r1 = min(q1, r0 + br)
        q = u[r0:r1]
        for c0 in range(0, n, bc):
            c1 = min(n, c0 + bc)
            sim = q @ u[c0:c1].T
            same = grp.tile_pairs(r0, r1, c0, c1)
            if same is not None:
                sim[same] = -np.inf
            low = run.bounds(r0 - q0, r1 - q0, lambda r: _row_maxima(sim, r, kk))
            flat = np.flatnonzero(sim >= low[:, None])
            if flat.size == 0:
                continue
            cand = sim.ravel()[flat]
            keep = cand > -np.inf
            flat, cand = flat[keep], cand[keep]
            r, c = np.divmod(flat, c1 - c0)
            run.merge(r0 - q0, r1 - q0, r, cand, c + c0, grouped=True)
    return _widen(run, k)


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
