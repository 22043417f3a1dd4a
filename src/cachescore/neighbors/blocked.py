"""Exact neighbour searches of one scope spread over Dask workers by query row blocks (DESIGN §4–5).

Each function here is the distributed twin of a single-process kernel and returns **exactly** the
same arrays (bit for bit), because the workers execute the very same independent blocks the
kernel is made of and the partial results are merged by order-independent reductions:

* :func:`distributed_typed_knn` ↔ :func:`cachescore.neighbors.typed.typed_knn`
  (blocks :func:`~cachescore.neighbors.typed.typed_block`, merge: per-row ``m`` largest
  similarities, a multiset that does not depend on the merge order);
* :func:`distributed_count_within` ↔ :func:`cachescore.neighbors.typed.count_within`
  (blocks :func:`~cachescore.neighbors.typed.count_block`, merge: integer sums);
* :func:`distributed_cross_group_knn` ↔ :func:`cachescore.neighbors.exact.cross_group_knn`
  (its rows are independent: one call per query row range, tables concatenated).

The scope's arrays are scattered **once** per call (``client.scatter(..., broadcast=True)``), so
task graphs only carry futures and block bounds; every task pins BLAS to one thread
(threadpoolctl), one task per query row block. :func:`make_search` wraps a client into a callable
with a backend's exact signature, for ``CRoMa.compute_with`` / ``RI.compute_with``.

Rows are the unit of distribution, not columns: a block's tiles span all its partner columns, so
the peak memory of a task is ``O(block_rows × block_rows)`` plus the scattered scope. Scopes
larger than a worker's memory need the ANN backend instead.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .._futures import gather_or_cancel
from .._taskkeys import task_key
from .._threads import single_thread_blas
from .exact import cross_group_knn
from .typed import (
    COUNT_BLOCK_ROWS,
    DEFAULT_BLOCK_ROWS,
    count_block,
    count_layout,
    count_merge,
    typed_block,
    typed_layout,
    typed_merge,
)

__all__ = [
    "SEARCH_KINDS",
    "distributed_count_within",
    "distributed_cross_group_knn",
    "distributed_typed_knn",
    "make_search",
]

#: Names accepted by :func:`make_search`, with the signature of the callable it returns.
SEARCH_KINDS = {
    "typed": "(u, labels, confounders, groups, m) -> (so_dist, os_dist)",
    "count": "(u, groups, radius) -> counts",
    "cross_group": "(u, groups, kmax) -> (idx, dist)",
}


# ----------------------------------------------------------------------------- worker tasks


def _typed_task(us, gs, layout, block, m):
    with single_thread_blas():
        return typed_block(us, gs, layout, block, m)


def _count_task(us, gs, floor, qs, block_rows):
    with single_thread_blas():
        return count_block(us, gs, floor, qs, block_rows)


def _cross_group_task(u, groups, kmax, r0, r1, kwargs):
    with single_thread_blas():
        return r0, cross_group_knn(u, groups, kmax, rows=slice(r0, r1), **kwargs)


# ----------------------------------------------------------------------------- helpers


def _rows(u) -> np.ndarray:
    u = np.asarray(u)
    if u.ndim != 2:
        raise ValueError(f"u must be a 2-D array of normalised rows (n, d), got {u.ndim}-D")
    return np.ascontiguousarray(u)


def _block_rows(block_rows, default=DEFAULT_BLOCK_ROWS) -> int:
    b = default if block_rows is None else int(block_rows)
    if b < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    return b


def _scatter(client, *arrays):
    """Broadcast each array to every worker once; futures in the same order."""
    return [client.scatter(a, broadcast=True, hash=False) for a in arrays]


def _release(*futures) -> None:
    for f in futures:
        f.release()


# ----------------------------------------------------------------------------- public API


def distributed_typed_knn(client, u, labels, confounders, groups, m, *, block_rows=None):
    """:func:`~cachescore.neighbors.typed.typed_knn` with its query blocks run on ``client``'s workers.

    Same parameters (``block_rows`` as there; the default gives the single-process default's
    tiles), same return value ``(so_dist, os_dist)`` float64 (n, m), identical bit for bit. ``u``
    is permuted by cell on the client and scattered once with the group codes and the (small)
    block layout; one task per query block of :attr:`~cachescore.neighbors.typed.TypedLayout.blocks`.

    Raises ``ValueError`` as ``typed_knn`` does (shapes, ``m < 1``, ``block_rows < 1``); a task's
    exception is re-raised here.
    """
    u = _rows(u)
    n = u.shape[0]
    for name, a in (("labels", labels), ("confounders", confounders), ("groups", groups)):
        if np.shape(a) != (n,):
            raise ValueError(f"{name} must have shape ({n},) to match u, got {np.shape(a)}")
    m = int(m)
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    layout, gs = typed_layout(labels, confounders, groups, block_rows=_block_rows(block_rows))
    if not layout.blocks:  # fewer than 2 rows, or no SO/OS cell pair: nothing to search
        return typed_merge(layout, (), m, u.dtype)
    us_f, gs_f, layout_f = _scatter(client, np.ascontiguousarray(u[layout.order]), gs, layout)
    try:
        futures = [client.submit(_typed_task, us_f, gs_f, layout_f, blk, m, pure=False, key=task_key("search", "typed")) for blk in layout.blocks]
        parts = gather_or_cancel(client, futures)
        return typed_merge(layout, parts, m, u.dtype)
    finally:
        _release(us_f, gs_f, layout_f)


def distributed_count_within(client, u, groups, radius, *, block_rows=None) -> np.ndarray:
    """:func:`~cachescore.neighbors.typed.count_within` with its query blocks run on ``client``.

    Same parameters and result (int64 (n,), identical; ``block_rows`` defaults to
    :data:`~cachescore.neighbors.typed.COUNT_BLOCK_ROWS` as there). ``u`` (sorted by group), the group codes
    and the per-row similarity floors are scattered once; one task per query block of the
    upper triangle of tiles. Raises ``ValueError`` for mismatched shapes or ``block_rows < 1``.
    """
    u = _rows(u)
    n = u.shape[0]
    groups = np.asarray(groups)
    radius = np.asarray(radius, dtype=np.float64)
    if groups.shape != (n,) or radius.shape != (n,):
        raise ValueError(f"groups and radius must have shape ({n},), got {groups.shape} and {radius.shape}")
    b = _block_rows(block_rows, COUNT_BLOCK_ROWS)
    order, gs, floor = count_layout(groups, radius, u.dtype)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    us_f, gs_f, floor_f = _scatter(client, np.ascontiguousarray(u[order]), gs, floor)
    try:
        futures = [client.submit(_count_task, us_f, gs_f, floor_f, qs, b, pure=False, key=task_key("search", "count")) for qs in range(0, n, b)]
        parts = gather_or_cancel(client, futures)
        return count_merge(n, order, parts)
    finally:
        _release(us_f, gs_f, floor_f)


def distributed_cross_group_knn(client, u, groups, kmax, *, block_rows=None, **search_kwargs):
    """:func:`cachescore.neighbors.exact.cross_group_knn` run as one task per query row range.

    Each task calls ``cross_group_knn(u, groups, kmax, rows=slice(r0, r1), **search_kwargs)``
    on the scattered scope; the tables ``(idx, dist)`` (n, kmax) are concatenated in row order and
    equal the whole-scope call (its rows are independent). ``block_rows`` is the query rows per
    task (default :data:`~cachescore.neighbors.typed.DEFAULT_BLOCK_ROWS`).

    Raises
    ------
    ValueError
        As ``cross_group_knn`` (raised by the first failing task), or ``block_rows < 1``.
    """
    u = _rows(u)
    n = u.shape[0]
    b = _block_rows(block_rows)
    if n == 0:
            return cross_group_knn(u, groups, kmax, **search_kwargs)
    u_f, g_f = _scatter(client, u, np.asarray(groups))
    try:
        futures = [
            client.submit(_cross_group_task, u_f, g_f, kmax, r0, min(r0 + b, n), search_kwargs, pure=False,
                          key=task_key("search", "cross"))
            for r0 in range(0, n, b)
        ]
        parts = sorted(gather_or_cancel(client, futures), key=lambda p: p[0])
        idx = np.concatenate([p[1][0] for p in parts], axis=0)
        dist = np.concatenate([p[1][1] for p in parts], axis=0)
        return idx, dist
    finally:
        _release(u_f, g_f)


def make_search(client, which: str, **kwargs) -> Callable:
    """A backend callable that runs on ``client``, with the exact signature the metrics expect.

    ``which``: ``"typed"`` → ``search(u, labels, confounders, groups, m)`` (for
    ``CRoMa.compute_with``), ``"count"`` → ``search(u, groups, radius)`` (CRoMa's
    ``count_search``), ``"cross_group"`` → ``search(u, groups, kmax)`` (for ``RI.compute_with`` /
    ``MaRI.compute_with``). ``kwargs`` (e.g. ``block_rows``) are passed to the distributed
    function. Raises ``ValueError`` for an unknown ``which``.
    """
    if which == "typed":

        def typed_search(u, labels, confounders, groups, m):
            return distributed_typed_knn(client, u, labels, confounders, groups, m, **kwargs)

        return typed_search
    if which == "count":

        def count_search(u, groups, radius):
            return distributed_count_within(client, u, groups, radius, **kwargs)

        return count_search
    if which == "cross_group":

        def cross_group_search(u, groups, kmax):
            return distributed_cross_group_knn(client, u, groups, kmax, **kwargs)

        return cross_group_search
    raise ValueError(f"unknown search {which!r}; expected one of {sorted(SEARCH_KINDS)}")
