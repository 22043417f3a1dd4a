"""Exact typed-neighbour search restricted to (label, confounder) cells (spec/metrics.md §7.10).

CRoMa's margin needs, for every row ``i`` of a scope, only the ``m`` smallest distances to its
**SO** pool (rows of cells ``(l_i, c)``, ``c != c_i``) and to its **OS** pool (rows of cells
``(l, c_i)``, ``l != l_i``), both minus ``i``'s own group. Searching those cells directly is exact,
needs no growing window, and never scans SS/OO rows.

Layout of the computation (no per-row Python loop, no N×N matrix):

* rows are permuted once (by cell, label-major, then group) so that every cell is a contiguous
  slice; the later SO partners of a cell (same label) are then one contiguous range, searched as
  one wide GEMM;
* selection runs on similarities ``s = u_i·u_j`` (distance ``clip(1 - s, 0, 2)`` is
  non-increasing in ``s``, so the ``m`` largest similarities *are* the ``m`` smallest distances);
  only the kept ``(n, m)`` values are converted, with the arithmetic of
  :func:`~cachescore.neighbors.normalize.cosine_distance_block`;
* SO and OS are symmetric relations, so each unordered cell pair is multiplied once and each tile
  is reduced to its ``m`` largest per row *and* per column (in-place ``partition``; the column
  side through a cache-friendly strip transpose) into ``(rows, m)`` partials; same-group entries
  are set to ``-inf`` only in tiles where a group occurs on both sides;
* the work is cut into independent tiles (:func:`typed_tiles`, :func:`typed_tile`), grouped in
  query blocks (:func:`typed_layout`, :func:`typed_block`), whose partials are merged by an
  order-independent reduction (:func:`typed_merge`), so
  :mod:`cachescore.neighbors.blocked` runs the same blocks on Dask workers and returns the
  same bits.

Peak extra memory is one permuted copy of ``u``, two ``(n, m)`` buffers and ``O(block_rows²)``
per tile and thread.

Threads: the single-process kernels run their tiles (typed search: :func:`typed_tiles`; counting:
query blocks or untyped tiles) on :func:`search_threads` Python threads (the CPU affinity, 1 inside
a Dask worker task) with BLAS pinned to one thread for the whole call (:func:`_parallel`). numpy's
GEMMs, comparisons, copies and partitions release the GIL, so tiles run in parallel; tasks are
fixed by the layout (never by the thread count) and partials are merged by order-independent
reductions, so results are bit-identical for every thread count. Scopes under
:data:`PARALLEL_MIN_WORK` run on the calling thread. A multithreaded BLAS on these tiles was the
main cost on a loaded machine: N = 2,000 took 0.39 s with 2 BLAS threads vs 0.04 s pinned
(another process holding one of the 2 cores).

:func:`count_within` is the companion counting pass used to reproduce croma's search-schedule
diagnostics (``k_final``, ``retries``) without growing a window. It compares similarities with a
per-row :func:`similarity_floor`, which is exactly equivalent to comparing the distance
``1 - s`` (in the compute dtype) with the radius, and is likewise cut into independent blocks
(:func:`count_block`, :func:`count_merge`).

:func:`typed_knn_and_counts` fuses the two: the typed tiles are kept (within
:data:`FUSED_TILE_BYTES`) and only compared with the radii once they are known, so the counting
pass multiplies only the untyped cell pairs (same cell; other label and other confounder). Every
pairwise distance of the scope is then computed once (~n²·d/2 multiply-adds in all).

Cost at N = 8,000, D = 384, float32, 2 labels × 4 confounders (``benchmarks/croma_speed.py``): the
typed search is ~12 GFLOP of GEMM, the separate counting pass ~25 GFLOP, the fused pair ~25 GFLOP
in total; CRoMa.compute takes ~0.38 s of CPU there (about 2/3 GEMM; the rest mostly partitions
and tile transposes), ~0.2–0.26 s wall on 2 threads of an otherwise idle 2-core machine.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .._finite import require_finite
from .._threads import shared_blas_pin

__all__ = [
    "COUNT_BLOCK_ROWS",
    "DEFAULT_BLOCK_ROWS",
    "FUSED_TILE_BYTES",
    "PARALLEL_MIN_WORK",
    "TypedLayout",
    "count_block",
    "count_layout",
    "count_merge",
    "count_within",
    "search_threads",
    "similarity_floor",
    "typed_block",
    "typed_knn",
    "typed_knn_and_counts",
    "typed_layout",
    "typed_merge",
    "typed_tile",
    "typed_tiles",
]

#: Edge of the square distance tiles (query rows × target columns) when ``block_rows`` is None.
#: 2048² float64 entries = 32 MiB per tile.
DEFAULT_BLOCK_ROWS = 2048

#: Edge of the square tiles of the counting pass when ``block_rows`` is None. Smaller than
#: :data:`DEFAULT_BLOCK_ROWS` because the diagonal tiles of the upper triangle are computed in
#: full: 512 keeps that waste near 6 % at N = 8,000 while the GEMMs stay at full speed (measured
#: 0.27 s vs 0.41 s with 2048 for the benchmark view of ``benchmarks/croma_speed.py``).
COUNT_BLOCK_ROWS = 512


def _check_inputs(u, labels, confounders, groups):
    u = np.asarray(u)
    if u.ndim != 2:
        raise ValueError(f"u must be a 2-D array of normalised rows (n, d), got {u.ndim}-D")
    require_finite(u)
    n = u.shape[0]
    arrays = []
    for name, a in (("labels", labels), ("confounders", confounders), ("groups", groups)):
        a = np.asarray(a)
        if a.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},) to match u, got {a.shape}")
        arrays.append(a)
    return u, arrays


def _block(block_rows, default=DEFAULT_BLOCK_ROWS) -> int:
    b = default if block_rows is None else int(block_rows)
    if b < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    return b


def _transpose(a: np.ndarray) -> np.ndarray:
    """C-contiguous transpose of a 2-D tile, copied in 256-row strips (both sides stay
    cache-resident; measured ~1.7 ms for a 2048 × 1000 float32 tile vs ~2.7 ms for
    ``ascontiguousarray(a.T)`` and ~10 ms with 64-row strips)."""
    out = np.empty((a.shape[1], a.shape[0]), dtype=a.dtype)
    for s in range(0, a.shape[0], 256):
        out[:, s : s + 256] = a[s : s + 256].T
    return out


def _top(tile: np.ndarray, m: int) -> np.ndarray:
    """Per row the ``m`` largest values of ``tile`` (r, w), unordered, ``-inf`` padded: a new
    (r, m) array. ``tile`` is partitioned **in place** (its rows reordered, their multisets kept)."""
    r, w = tile.shape
    if w > m:
        tile.partition(w - m, axis=1)
        return tile[:, w - m :].copy()
    out = np.full((r, m), -np.inf, dtype=tile.dtype)
    out[:, :w] = tile
    return out


def _in_dask_worker() -> bool:
    dist = sys.modules.get("distributed")  # not imported: certainly not inside a worker
    if dist is None:
        return False
    try:
        dist.get_worker()
    except (ValueError, AttributeError):
        return False
    return True


def search_threads(threads=None) -> int:
    """Number of Python threads the single-process kernels of this module run their tiles on.

    ``threads=None``: the CPUs this process may run on (``os.sched_getaffinity``), or 1 inside a
    Dask worker task (the worker's own threads already fill the machine). Raises ``ValueError``
    for ``threads < 1``. Results never depend on it (see :func:`_parallel`)."""
    if threads is not None:
        t = int(threads)
        if t < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        return t
    if _in_dask_worker():
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


#: Below this many multiply-adds (about n²·d/2 for a scope) a kernel runs its tiles on the calling
#: thread: starting a pool costs more than it saves (results are the same either way).
PARALLEL_MIN_WORK = 50_000_000


@contextmanager
def _parallel(threads, work=None) -> Iterator[Callable]:
    """Context yielding ``run(fn, tasks) -> [fn(t) for t in tasks]`` (results in task order),
    executed on ``search_threads(threads)`` Python threads with BLAS pinned to one thread for the
    whole context (:func:`shared_blas_pin`).

    numpy's GEMMs, comparisons, reductions, copies and partitions release the GIL, so the tiles
    run truly in parallel. BLAS is pinned to one thread whatever the thread count: every tile's
    GEMM then runs the same single-threaded kernel, and because tasks are fixed independently of
    the thread count and partial results are merged by order-independent reductions, the results
    are bit-identical for any ``threads``. ``work`` (multiply-adds, optional): below
    :data:`PARALLEL_MIN_WORK` the tasks run on the calling thread; the pool is only started
    for a ``run`` with more than one task.
    """
    t = search_threads(threads)
    if work is not None and work < PARALLEL_MIN_WORK:
        t = 1
    pool = []

    def run(fn, tasks):
        tasks = list(tasks)
        if t == 1 or len(tasks) < 2:
            return [fn(x) for x in tasks]
        if not pool:
            pool.append(ThreadPoolExecutor(max_workers=t, thread_name_prefix="cachescore-typed"))
        return list(pool[0].map(fn, tasks))

    with shared_blas_pin():
        try:
            yield run
        finally:
            if pool:
                pool[0].shutdown(wait=True)


def _merge_largest(buf: np.ndarray, tile: np.ndarray, m: int) -> None:
    """``buf`` (r, m) := per row the ``m`` largest of ``buf`` ∪ ``tile`` (r, w), unordered.

    ``tile`` is partitioned **in place** (its rows are reordered, their multisets kept): no copy
    of the tile is made."""
    w = tile.shape[1]
    if w > m:
        tile.partition(w - m, axis=1)
        tile = tile[:, w - m :]
    both = np.concatenate([buf, tile], axis=1)
    buf[:] = np.partition(both, both.shape[1] - m, axis=1)[:, both.shape[1] - m :]


def _sim_to_dist(best: np.ndarray) -> np.ndarray:
    """Ascending float64 distances ``clip(1 - s, 0, 2)`` (computed in ``best``'s dtype, exactly as
    :func:`~cachescore.neighbors.normalize.cosine_distance_block`), ``-inf`` similarities → ``+inf``."""
    dist = np.clip(np.subtract(1, best), 0, 2)
    dist[np.isneginf(best)] = np.inf
    return np.sort(dist, axis=1).astype(np.float64)


@dataclass(frozen=True)
class TypedLayout:
    """How a scope's typed search is cut into independent query blocks (small; cheap to ship).

    Rows are permuted by ``order`` (cell, label-major, then group), so every (label, confounder)
    cell is the slice ``starts[c]:starts[c+1]`` of the permuted rows. ``ranges[c]`` lists the later
    partner ranges of cell ``c`` as ``(kind, t0, t1, shared)``: ``kind`` is ``"so"`` (all later cells
    of the same label, one contiguous range) or ``"os"`` (one later cell of another label and the
    same confounder); ``shared`` says whether a group occurs on both sides (only then is a
    same-group mask built). ``blocks`` are the query blocks ``(cell, qs, qe)``; each block's tiles
    are its rows × its partner ranges, in tiles of ``block_rows`` columns.
    """

    n: int
    block_rows: int
    order: np.ndarray
    starts: np.ndarray
    ranges: tuple
    blocks: tuple
    oo_pairs: tuple = ()


def typed_layout(labels, confounders, groups, *, block_rows=None):
    """``(layout, sorted_groups)`` for :func:`typed_block`; ``sorted_groups`` (n,) int64 are the
    dense group codes in ``layout.order``. Raises ``ValueError`` for mismatched shapes or
    ``block_rows < 1``."""
    labels, confounders, groups = (np.asarray(a).ravel() for a in (labels, confounders, groups))
    n = labels.shape[0]
    if confounders.shape != (n,) or groups.shape != (n,):
        raise ValueError(f"labels, confounders and groups must have one shape, got {n}, {confounders.shape}, {groups.shape}")
    b = _block(block_rows)
    if n == 0:
        return TypedLayout(0, b, np.zeros(0, np.int64), np.zeros(1, np.int64), (), ()), np.zeros(0, np.int64)
    lab = np.unique(labels, return_inverse=True)[1].ravel().astype(np.int64)
    con = np.unique(confounders, return_inverse=True)[1].ravel().astype(np.int64)
    grp = np.unique(groups, return_inverse=True)[1].ravel().astype(np.int64)
    n_con = int(con.max()) + 1
    cell_ids, cell_of = np.unique(lab * n_con + con, return_inverse=True)
    cell_of = cell_of.ravel()
    n_cells = len(cell_ids)
    cell_lab, cell_con = cell_ids // n_con, cell_ids % n_con
    order = np.lexsort((grp, cell_of))
    starts = np.concatenate([[0], np.cumsum(np.bincount(cell_of, minlength=n_cells))]).astype(np.int64)
    gs = grp[order]
    cell_groups = [np.unique(gs[starts[c] : starts[c + 1]]) for c in range(n_cells)]

    def shares(q, cells):
        return any(np.intersect1d(cell_groups[q], cell_groups[t], assume_unique=True).size for t in cells)

    ranges, blocks = [], []
    oo_pairs = tuple(
        (q, int(t), shares(q, [t]))
        for q in range(n_cells)
        for t in np.flatnonzero((cell_lab != cell_lab[q]) & (cell_con != cell_con[q]) & (np.arange(n_cells) > q))
    )
    for q in range(n_cells):
        mine = []
        later_so = np.flatnonzero((cell_lab == cell_lab[q]) & (np.arange(n_cells) > q))
        if later_so.size:  # cells of one label are adjacent, so the later ones are contiguous
            shared = shares(q, later_so)
            mine.append(("so", int(starts[later_so[0]]), int(starts[later_so[-1] + 1]), shared))
        for t in np.flatnonzero((cell_con == cell_con[q]) & (cell_lab > cell_lab[q])):
            mine.append(("os", int(starts[t]), int(starts[t + 1]), shares(q, [t])))
        ranges.append(tuple(mine))
        if mine:
            blocks.extend((q, qs, min(qs + b, int(starts[q + 1]))) for qs in range(int(starts[q]), int(starts[q + 1]), b))
    return TypedLayout(n, b, order, starts, tuple(ranges), tuple(blocks), oo_pairs), gs


def typed_tiles(layout: TypedLayout, blocks=None) -> list:
    """The tiles of ``blocks`` (default all of ``layout.blocks``), largest first: tuples
    ``(kind, qs, qe, ts, te, shared)`` (query rows ``qs:qe`` × partner rows ``ts:te`` of a
    ``kind`` range). They depend on the layout only, never on a thread count."""
    b = layout.block_rows
    tiles = []
    for q, qs, qe in layout.blocks if blocks is None else blocks:
        for kind, t0, t1, shared in layout.ranges[q]:
            tiles.extend((kind, qs, qe, ts, min(ts + b, t1), shared) for ts in range(t0, t1, b))
    tiles.sort(key=lambda t: (t[2] - t[1]) * (t[4] - t[3]), reverse=True)
    return tiles


def typed_tile(us, gs, tile, m, *, keep_tiles=None) -> list:
    """Partial typed search of one tile of :func:`typed_tiles`: ``[(kind, qs, rows), (kind, ts,
    cols)]`` with ``rows`` (qe-qs, m) / ``cols`` (te-ts, m) the ``m`` largest similarities
    (unordered, ``-inf`` padded) of each query / partner row within the tile. ``keep_tiles``: see
    :func:`typed_block`. Thread-safe (only reads ``us``/``gs``; ``list.append`` is atomic)."""
    kind, qs, qe, ts, te, shared = tile
    sim = us[qs:qe] @ us[ts:te].T
    if shared:
        np.copyto(sim, np.array(-np.inf, dtype=sim.dtype), where=gs[qs:qe, None] == gs[None, ts:te])
    cols = _transpose(sim)
    parts = [(kind, qs, _top(sim, m)), (kind, ts, _top(cols, m))]  # each reorders its tile's rows
    if keep_tiles is not None:
        keep_tiles.append((qs, qe, ts, te, sim, cols))
    return parts


def typed_block(us, gs, layout: TypedLayout, block, m, *, keep_tiles=None):
    """Partial typed search of one query block ``(cell, qs, qe)`` of ``layout.blocks``.

    ``us`` (n, d) are the normalised rows in ``layout.order``, ``gs`` their group codes. Returns a
    list of ``(kind, start, sims)``: ``sims`` (r, m) holds, for permuted rows ``start:start+r``,
    the ``m`` largest similarities (unordered, ``-inf`` padded) seen in this block's tiles. The
    final result is the per-row ``m`` largest over all blocks' partials (:func:`typed_merge`),
    which does not depend on the order the partials are merged in.

    ``keep_tiles``: a list to which every masked similarity tile is appended as
    ``(qs, qe, ts, te, rows, cols)``: ``rows`` (qe-qs, te-ts) holds each query row's values and
    ``cols`` (te-ts, qe-qs) each target row's, both in an arbitrary order within a row (used by
    :func:`typed_knn_and_counts` to count without a second GEMM).
    """
    out = []
    for tile in typed_tiles(layout, [block]):
        out.extend(typed_tile(us, gs, tile, m, keep_tiles=keep_tiles))
    return out


def typed_merge(layout: TypedLayout, partials, m, dtype):
    """Merge :func:`typed_block` / :func:`typed_tile` partials (an iterable of their lists) into ``typed_knn``'s
    ``(so_dist, os_dist)``, float64 (n, m), ascending, ``+inf`` padded, in the caller's row order."""
    n = layout.n
    best = {k: np.full((n, m), -np.inf, dtype=dtype) for k in ("so", "os")}
    for part in partials:
        for kind, start, sims in part:
            _merge_largest(best[kind][start : start + sims.shape[0]], sims, m)
    so_out = np.empty((n, m), dtype=np.float64)
    os_out = np.empty((n, m), dtype=np.float64)
    so_out[layout.order] = _sim_to_dist(best["so"])
    os_out[layout.order] = _sim_to_dist(best["os"])
    return so_out, os_out


def typed_knn(u, labels, confounders, groups, m, *, block_rows=None, threads=None):
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
        Edge of the distance tiles (default :data:`DEFAULT_BLOCK_ROWS`). Results do not depend on
        it (up to the last-ulp effect of the BLAS kernel chosen for a tile shape).
    threads : int, optional
        Python threads the tiles run on (default :func:`search_threads`); BLAS is pinned to one
        thread for the call. Results are bit-identical for every value.

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
        ``u`` not 2-D, code arrays of the wrong shape, ``m < 1``, ``block_rows < 1`` or
        ``threads < 1``.

    Notes
    -----
    Selection runs on similarities ``s = u_i·u_j``: distance is a non-increasing function of ``s``,
    so the multiset of the ``m`` largest similarities maps exactly onto the ``m`` smallest
    distances, and only the kept ``(n, m)`` values are converted. Same-group entries are set to
    ``-inf``. The work is cut into the independent query blocks of :func:`typed_layout`
    (``typed_block``), merged by :func:`typed_merge`; a distributed run executes the same blocks
    (:mod:`cachescore.neighbors.blocked`) and gets bit-identical results.
    """
    u, (labels, confounders, groups) = _check_inputs(u, labels, confounders, groups)
    m = int(m)
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    layout, gs = typed_layout(labels, confounders, groups, block_rows=block_rows)
    n = u.shape[0]
    if n < 2:
        return np.full((n, m), np.inf), np.full((n, m), np.inf)
    us = np.ascontiguousarray(u[layout.order])
    with _parallel(threads, work=n * n * u.shape[1] // 2) as run:
        parts = run(lambda tile: typed_tile(us, gs, tile, m), typed_tiles(layout))
    return typed_merge(layout, parts, m, us.dtype)


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


def count_layout(groups, radius, dtype):
    """``(order, sorted_groups, floor)`` for :func:`count_block`: rows sorted by group (stable),
    their group codes, and their :func:`similarity_floor` (in ``dtype``) in that order."""
    groups = np.asarray(groups)
    order = np.argsort(groups, kind="stable")
    return order, groups[order], similarity_floor(np.asarray(radius, dtype=np.float64)[order], dtype)


def count_block(us, gs, floor, qs, block_rows):
    """Counts contributed by query block ``qs:qs+block_rows`` of the upper triangle of tiles.

    ``us``, ``gs``, ``floor`` are in :func:`count_layout` order. Returns ``(qs, row_counts,
    col_counts)``: int64 counts for rows ``qs:qe`` (tiles ``qs..n``) and for rows ``qs:n`` (as
    columns of the tiles right of the diagonal tile). Summing every block's contributions gives
    :func:`count_within`, whatever the order.
    """
    n = us.shape[0]
    b = int(block_rows)
    qe = min(qs + b, n)
    acc = np.uint16 if b < (1 << 16) else np.int64
    rows = np.zeros(qe - qs, dtype=np.int64)
    cols = np.zeros(n - qs, dtype=np.int64)
    for ts in range(qs, n, b):
        te = min(ts + b, n)
        sim = us[qs:qe] @ us[ts:te].T
        if gs[qe - 1] >= gs[ts]:  # group codes are sorted: ranges overlap only here
            # NaN compares False even against a -inf floor (radius >= 2 counts all others)
            np.copyto(sim, np.nan, where=gs[qs:qe, None] == gs[None, ts:te])
        hit = sim >= floor[qs:qe, None]
        rows += hit.view(np.uint8).sum(axis=1, dtype=acc)
        if ts != qs:
            hit = np.greater_equal(sim, floor[None, ts:te], out=hit)
            cols[ts - qs : te - qs] += hit.view(np.uint8).sum(axis=0, dtype=acc)
    return qs, rows, cols


def count_merge(n, order, parts):
    """Sum :func:`count_block` results into per-row counts (int64 (n,), caller's row order)."""
    counts = np.zeros(n, dtype=np.int64)
    for qs, rows, cols in parts:
        counts[qs : qs + rows.size] += rows
        counts[qs:] += cols
    out = np.empty(n, dtype=np.int64)
    out[order] = counts
    return out


def count_within(u, groups, radius, *, block_rows=None, threads=None) -> np.ndarray:
    """Per row ``i``, the number of rows of other groups at cosine distance ``<= radius[i]``.

    ``u`` (n, d) normalised rows, ``groups`` (n,) codes, ``radius`` (n,) thresholds (``+inf`` counts
    every cross-group row). Returns int64 (n,). Distances are ``1 - u_i·u_j`` in ``u``'s dtype with
    thresholds cast to it; thresholds at or above 2 count every cross-group row (the clip to [0, 2]
    is thereby implied). ``block_rows``: tile edge (default :data:`COUNT_BLOCK_ROWS`; the result
    does not depend on it beyond a last-ulp GEMM effect at exactly ``radius``). ``threads``: Python
    threads the blocks run on (default :func:`search_threads`; BLAS pinned to one thread; the
    counts do not depend on it). Raises ``ValueError`` for mismatched shapes, ``block_rows < 1`` or
    ``threads < 1``.

    One blocked pass over the upper triangle of tiles: each similarity tile serves both its rows
    and its columns, so the GEMM work is about ``n²·d/2``. The comparison runs on similarities
    against :func:`similarity_floor` (exactly equivalent, no subtraction pass). Rows are ordered by
    group, so the same-group mask is only built for tiles whose group ranges overlap. The pass is
    cut into independent query blocks (:func:`count_block`), which a distributed run executes
    unchanged.
    """
    u, (groups, _, _) = _check_inputs(u, groups, groups, groups)
    radius = np.asarray(radius, dtype=np.float64)
    n = u.shape[0]
    if radius.shape != (n,):
        raise ValueError(f"radius must have shape ({n},), got {radius.shape}")
    b = _block(block_rows, COUNT_BLOCK_ROWS)
    order, gs, floor = count_layout(groups, radius, u.dtype)
    us = np.ascontiguousarray(u[order])
    with _parallel(threads, work=n * n * u.shape[1] // 2) as run:  # blocks shrink along the triangle
        parts = run(lambda qs: count_block(us, gs, floor, qs, b), list(range(0, n, b)))
    return count_merge(n, order, parts)


#: Largest total size (bytes) of the typed similarity tiles that :func:`typed_knn_and_counts` keeps
#: in memory (each tile twice: row-wise and column-wise) to count on them without recomputing
#: their GEMMs (128 MiB at N = 8,000, D any, float32, 2 labels × 4 confounders). Above it the counting pass runs
#: separately (:func:`count_within`), so memory stays bounded whatever the scope size.
FUSED_TILE_BYTES = 256 * 2**20


def _tile_counts(sim, floor, qs, qe, ts, te, *, rows_only=False) -> list:
    """``[(qs, row_hits), (ts, col_hits)]``: int64 numbers of entries ``sim >= floor`` of one tile
    per row (floors ``qs:qe``) and, unless ``rows_only``, per column (floors ``ts:te``)."""
    acc = np.uint16 if max(qe - qs, te - ts) < (1 << 16) else np.int64
    hit = sim >= floor[qs:qe, None]
    out = [(qs, hit.view(np.uint8).sum(axis=1, dtype=acc))]
    if not rows_only:
        hit = np.greater_equal(sim, floor[None, ts:te], out=hit)
        out.append((ts, hit.view(np.uint8).sum(axis=0, dtype=acc)))
    return out


def _count_tasks(layout: TypedLayout, block_rows: int) -> list:
    """The untyped tiles of the fused counting pass, largest first: ``(qs, qe, ts, te, mask,
    rows_only)`` for the upper triangle of every cell's own tiles (``mask``: groups may overlap;
    diagonal tiles count rows only) and every pair of cells differing in label and confounder."""
    cb, starts, tasks = block_rows, layout.starts, []
    for c in range(len(starts) - 1):
        c0, c1 = int(starts[c]), int(starts[c + 1])
        for qs in range(c0, c1, cb):
            qe = min(qs + cb, c1)
            tasks.extend((qs, qe, ts, min(ts + cb, c1), None, ts == qs) for ts in range(qs, c1, cb))
    for q, t, shared in layout.oo_pairs:
        for qs in range(int(starts[q]), int(starts[q + 1]), cb):
            qe = min(qs + cb, int(starts[q + 1]))
            tasks.extend(
                (qs, qe, ts, min(ts + cb, int(starts[t + 1])), shared, False)
                for ts in range(int(starts[t]), int(starts[t + 1]), cb)
            )
    tasks.sort(key=lambda t: (t[1] - t[0]) * (t[3] - t[2]), reverse=True)
    return tasks


def typed_knn_and_counts(
    u, labels, confounders, groups, m, radius_for, *, block_rows=None, tile_bytes=None, threads=None
):
    """:func:`typed_knn`, then :func:`count_within` with a radius derived from its result, sharing GEMMs.

    ``radius_for(so_dist, os_dist)`` receives :func:`typed_knn`'s result (in the caller's row
    order) and returns the (n,) radius to count within, or ``None`` when no count is needed.
    Returns ``(so_dist, os_dist, counts)`` with ``counts`` int64 (n,) or ``None``.

    Every distance of a typed (SO/OS) cell pair is computed once: when the typed tiles fit in
    ``tile_bytes`` (default :data:`FUSED_TILE_BYTES`) they are kept and the counting pass only
    compares them with the radii, and multiplies only the untyped pairs (same cell, and cells
    differing in both label and confounder). Otherwise the count is :func:`count_within` itself.
    The counts equal :func:`count_within`'s except where a distance lies within the last ulp of
    its row's radius (the tiles have other GEMM shapes), which the caller's slack absorbs.

    Both passes run their tiles on ``threads`` Python threads (default :func:`search_threads`)
    with BLAS pinned to one thread for the whole call; results are bit-identical for every value.
    Raises ``ValueError`` as :func:`typed_knn`, or when ``radius_for`` returns a wrong shape.
    """
    u, (labels, confounders, groups) = _check_inputs(u, labels, confounders, groups)
    m = int(m)
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    search_threads(threads)  # validate before any work
    layout, gs = typed_layout(labels, confounders, groups, block_rows=block_rows)
    n = u.shape[0]
    if n < 2:
        so, os_ = np.full((n, m), np.inf), np.full((n, m), np.inf)
        radius = radius_for(so, os_)
        return so, os_, (None if radius is None else count_within(u, groups, radius, threads=threads))
    budget = FUSED_TILE_BYTES if tile_bytes is None else int(tile_bytes)
    typed_entries = sum((qe - qs) * sum(t1 - t0 for _, t0, t1, _ in layout.ranges[q]) for q, qs, qe in layout.blocks)
    keep = [] if 2 * typed_entries * u.dtype.itemsize <= budget else None  # row and column copies
    us = np.ascontiguousarray(u[layout.order])
    with _parallel(threads, work=n * n * u.shape[1] // 2) as run:
        parts = run(lambda tile: typed_tile(us, gs, tile, m, keep_tiles=keep), typed_tiles(layout))
        so, os_ = typed_merge(layout, parts, m, us.dtype)
        del parts
        radius = radius_for(so, os_)
        if radius is None:
            return so, os_, None
        if keep is None:
            return so, os_, count_within(u, groups, radius, threads=threads)

        radius = np.asarray(radius, dtype=np.float64)
        if radius.shape != (n,):
            raise ValueError(f"radius_for returned shape {radius.shape}; expected ({n},)")
        # -inf marks same-group entries; a floor of -inf (radius >= 2: count all) becomes the lowest
        # finite value so those entries still compare False
        floor = np.maximum(similarity_floor(radius[layout.order], us.dtype), np.finfo(us.dtype).min)
        neg = np.array(-np.inf, dtype=us.dtype)

        def kept(tile):  # typed pairs: compare only
            qs, qe, ts, te, rows, cols = tile
            return _tile_counts(rows, floor, qs, qe, ts, te, rows_only=True) + _tile_counts(
                cols, floor, ts, te, qs, qe, rows_only=True
            )

        def untyped(task):  # same cell (groups sorted inside) or other label and other confounder
            qs, qe, ts, te, shared, rows_only = task
            sim = us[qs:qe] @ us[ts:te].T
            if shared or (shared is None and gs[qe - 1] >= gs[ts]):
                np.copyto(sim, neg, where=gs[qs:qe, None] == gs[None, ts:te])
            return _tile_counts(sim, floor, qs, qe, ts, te, rows_only=rows_only)

        hits = run(kept, keep)
        keep.clear()
        hits += run(untyped, _count_tasks(layout, COUNT_BLOCK_ROWS))
    counts = np.zeros(n, dtype=np.int64)
    for part in hits:  # integer sums: order-independent
        for start, c in part:
            counts[start : start + c.size] += c
    out = np.empty(n, dtype=np.int64)
    out[layout.order] = counts
    return so, os_, out
