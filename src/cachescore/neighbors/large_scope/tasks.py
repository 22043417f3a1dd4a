"""Worker task bodies of the out-of-core engine: centroids from a sample, partition a chunk, brute-force
exact answers per chunk, search one batch of query clusters. Every argument is bounded by
``chunks x clusters`` or a query sample, never O(n)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..._finite import nonfinite_rows
from ..._threads import single_thread_blas
from ...cache import RowSource
from ..._atomic import atomic_write
from ..normalize import normalize_rows
from ..partition import (
    assign_clusters,
    spherical_kmeans,
    topk_tiles,
)
from . import (
    files as tunables,  # the engine's tunables, read at call time (tests patch them)
)
from .files import INDEX_COLUMNS, Layout, ScopeFiles, read_row_runs, write_rows


def read_scope_rows(embeddings: RowSource, tile_rows, positions, source) -> np.ndarray:
    """Task body: normalised rows of the scope ``positions`` (their tileset rows ``tile_rows``)
    read from ``embeddings``; raises ``ValueError`` naming the scope rows that are not finite."""
    x = embeddings.load_rows(np.asarray(tile_rows, dtype=np.int64))
    bad = nonfinite_rows(x)
    if bad.size:
        shown = [int(i) for i in np.asarray(positions)[bad[:5]]]
        raise ValueError(f"{source}: embeddings contain NaN or infinite values at scope rows {shown}"
                         + (f" (and {bad.size - 5} more)" if bad.size > 5 else ""))
    return normalize_rows(x)


# ----------------------------------------------------------------------------- worker tasks
#
# Every task's arguments are O(chunks × clusters) at most (file paths, per-chunk cluster bounds, a
# batch's probe plan, a bounded query sample); rows, codes and positions are read from scratch files.


def centroid_task(files: ScopeFiles, n: int, c: int, size: int, seed: int) -> np.ndarray:
    """The partition's centroids ((c, d) float32): a seeded sample of ``size`` of the scope's ``n``
    rows read from the cache and normalised, then :func:`~cachescore.neighbors.partition.spherical_kmeans`
    with the same generator. On a worker: the sample (up to ``KMEANS_MAX_SAMPLE`` rows) and the
    k-means distance blocks never reach the driver; only the centroids go back."""
    with single_thread_blas():
        rng = np.random.default_rng([int(seed), 17])
        positions = np.sort(rng.choice(int(n), size=int(size), replace=False))
        x = read_scope_rows(files.embeddings, files.tile_rows_at(positions), positions, files.source)
        return spherical_kmeans(x, int(c), random_state=rng)


def chunk_task(files: ScopeFiles, start: int, stop: int, centroids: np.ndarray, path: str, meta_path: str,
               cluster_path: str, n_conf: int, n_cells: int):
    """Read, check, normalise and assign scope positions ``start:stop``; write them sorted by
    cluster to ``path``, their metadata ((r, 4) int64: scope position, group, label, confounder)
    to ``meta_path`` in the same order, and their cluster ids in scope order to ``cluster_path``
    ((r,) int32). Returns ``(cluster bounds (C+1,), rows per (cell, cluster) (n_cells, C))`` with
    cell code ``label * n_conf + confounder``: O(clusters), nothing per row goes back."""
    with single_thread_blas():
        index = files.index(start, stop)
        pos = np.arange(start, stop, dtype=np.int64)
        u = read_scope_rows(files.embeddings, index[:, 0], pos, files.source)
        cl = assign_clusters(u, centroids)
        c = centroids.shape[0]
        order = np.argsort(cl, kind="stable")
        bounds = np.searchsorted(cl[order], np.arange(c + 1)).astype(np.int64)
        atomic_write(Path(path), lambda fh: np.save(fh, np.ascontiguousarray(u[order])))
        del u
        atomic_write(Path(cluster_path), lambda fh: np.save(fh, np.asarray(cl, dtype=np.int32)))
        cell = index[:, 2] * int(n_conf) + index[:, 3]
        counts = np.bincount(cell * c + cl, minlength=int(n_cells) * c).reshape(int(n_cells), c).astype(np.int64)
        index[:, 0] = pos
        atomic_write(Path(meta_path), lambda fh: np.save(fh, np.ascontiguousarray(index[order])))
        return bounds, counts


def position_task(layout: Layout, step: int, positions: np.ndarray) -> np.ndarray:
    """Vectors of the scope ``positions`` (a bounded sample) as the partition stored them, in the
    given order: position ``p`` lies in chunk ``p // step`` (chunks are consecutive ranges of
    ``step`` scope rows), at the file row its metadata names."""
    positions = np.asarray(positions, dtype=np.int64)
    out = np.empty((positions.size, layout.dim), dtype=np.dtype(layout.dtype))
    chunk = positions // int(step)
    for j in np.unique(chunk).tolist():
        sel = np.flatnonzero(chunk == j)
        n_rows = int(layout.bounds[j][-1])
        file_pos = read_row_runs(layout.meta_paths[j], [(0, n_rows)], len(INDEX_COLUMNS), np.dtype(np.int64),
                                 layout.meta_header[j])[:, 0]
        where = np.empty(n_rows, dtype=np.int64)
        where[file_pos - j * int(step)] = np.arange(n_rows)
        local = where[positions[sel] - j * int(step)]
        srt = np.argsort(local)
        runs = [(int(r), int(r) + 1) for r in local[srt]]
        out[sel[srt]] = read_row_runs(layout.paths[j], runs, layout.dim, np.dtype(layout.dtype), layout.header[j])
    return out



def brute_task(layout: Layout, j: int, qv: np.ndarray, q_codes: np.ndarray, kinds: tuple, k: int) -> dict:
    """Exact top-k of each kind for the sample queries (vectors ``qv``, codes ``q_codes`` (q, 3):
    group, label, confounder) over chunk ``j`` (all its rows)."""
    with single_thread_blas():
        q = q_codes.shape[0]
        out = {kind: (np.full((q, k), -1, np.int64), np.full((q, k), np.inf)) for kind in kinds}
        Targets(layout.n_conf, *layout.read_chunk(j)).search(qv, tuple(q_codes.T), np.arange(q), k, out, None)
        return out


def search_task(layout: Layout, batch: dict, kinds: tuple, k: int, tables: dict) -> tuple[int, float]:
    """Search the query clusters of ``batch`` and write their rows of the scope-order tables
    ``tables`` (``{(kind, "idx" | "dist"): (path, data offset)}``, created by the driver; each
    query row is written by exactly one task, so a retried task rewrites the same bytes); returns
    its query count and its wall seconds (the kernel throughput figures are pairs over these).

    ``batch`` maps a query cluster ``a`` to its probe plan: ``{"cross": probed clusters}``, or for
    the typed kinds ``{"cells": {target cell: probed clusters}}`` (cell code ``label * n_conf +
    confounder``). Targets are read in pieces of at most :data:`PIECE_ROWS` rows (whole clusters)
    and searched by :meth:`Targets.search`.
    """
    t0 = time.perf_counter()
    with single_thread_blas():
        q_clusters = sorted(batch)
        qv, qmeta, qcl = layout.read_clusters(q_clusters)
        q_codes = (qmeta[:, 1], qmeta[:, 2], qmeta[:, 3])
        res = {kind: (np.full((qv.shape[0], k), -1, np.int64), np.full((qv.shape[0], k), np.inf)) for kind in kinds}
        needed = sorted({int(c) for a in q_clusters for c in plan_clusters(batch[a])})
        # targets in pieces of at most tunables.PIECE_ROWS rows (whole clusters)
        sizes = layout.sizes
        piece: list[int] = []
        rows_in_piece = 0
        pieces = []
        for c in needed:
            if piece and rows_in_piece + sizes[c] > tunables.PIECE_ROWS:
                pieces.append(piece)
                piece, rows_in_piece = [], 0
            piece.append(c)
            rows_in_piece += int(sizes[c])
        if piece:
            pieces.append(piece)
        for piece in pieces:
            target = Targets(layout.n_conf, *layout.read_clusters(piece))
            for a in q_clusters:
                target.search(qv, q_codes, np.flatnonzero(qcl == a), k, res, batch[a])
            del target
        for kind in kinds:
            for what, arr in zip(("idx", "dist"), res[kind]):
                path, offset = tables[(kind, what)]
                write_rows(path, offset, qmeta[:, 0], arr)
        return int(qv.shape[0]), time.perf_counter() - t0


class Targets:
    """One piece of target rows (vectors, scope positions, groups) and their order by (cell, cluster).

    The vectors stay as read (no sorted copy): ``order`` lists row numbers by (cell, cluster), so a
    target cell is one contiguous run of ``order``, and the kernel gathers the selected rows one
    tile at a time (:func:`~cachescore.neighbors.partition.topk_tiles` ``rows=``). The typed search
    runs per target cell, separately for the queries it serves as SO pool (same label, other
    confounder) and as OS pool (other label, same confounder): each pair is computed once, and
    only the group rule remains to be masked.
    """

    def __init__(self, n_conf: int, tv: np.ndarray, meta: np.ndarray, cluster: np.ndarray):
        self.n_conf, self.tv = n_conf, tv
        cell = meta[:, 2] * n_conf + meta[:, 3]
        self.order = np.lexsort((cluster, cell))
        self.tpos, self.t_groups = meta[:, 0], meta[:, 1]
        self.cluster = cluster[self.order]  # by position in ``order``
        cell = cell[self.order]
        cells = np.unique(cell)
        lo, hi = np.searchsorted(cell, cells), np.searchsorted(cell, cells, side="right")
        self.span = {int(c): (int(a), int(b)) for c, a, b in zip(cells, lo, hi)}

    def select(self, lo: int, hi: int, clusters) -> np.ndarray:
        """Row numbers of ``order[lo:hi]`` whose cluster is in ``clusters`` (None = all)."""
        if clusters is None:
            return self.order[lo:hi]
        return self.order[lo:hi][np.isin(self.cluster[lo:hi], clusters)]

    def search(self, qv, q_codes, qsel, k, res: dict, plan: dict | None) -> None:
        """Merge the top-k of queries ``qsel`` over this piece into ``res`` (kind -> (idx, dist)
        of all queries), probing what ``plan`` allows (see :func:`search_task`; None = all).
        ``q_codes`` = (groups, labels, confounders) of all queries."""
        if "cross" in res:
            clusters = None if plan is None else plan["cross"]
            self._run(qv, q_codes, (qsel,), self.select(0, self.tpos.size, clusters), k, (res["cross"],))
            return
        ql, qc = q_codes[1][qsel], q_codes[2][qsel]
        for tc, (lo, hi) in self.span.items():
            if plan is not None and tc not in plan["cells"]:
                continue
            tsel = self.select(lo, hi, None if plan is None else plan["cells"][tc])
            tl, tcf = divmod(tc, self.n_conf)
            # the cell is the SO pool of one query set and the OS pool of another (disjoint):
            # both searched by one kernel call, their running tables side by side
            self._run(qv, q_codes, (qsel[(ql == tl) & (qc != tcf)], qsel[(ql != tl) & (qc == tcf)]), tsel, k,
                      (res["so"], res["os"]))

    def _run(self, qv, q_codes, sets, tsel, k, tables) -> None:
        """Search targets ``tsel`` for disjoint query row sets ``sets`` (a tuple of index arrays)
        in one kernel call, merging each set into its table of ``tables`` ((idx, dist) of all
        queries, one per set)."""
        rows = np.concatenate(sets)
        if rows.size == 0 or tsel.size == 0:
            return
        sub_i = np.concatenate([bi[q] for q, (bi, _) in zip(sets, tables)])
        sub_d = np.concatenate([bd[q] for q, (_, bd) in zip(sets, tables)])
        # the targets are each query set's pool (one cell, or the probed scope): only groups mask
        topk_tiles(qv[rows], q_codes[0][rows], self.tv, self.tpos, self.t_groups, k, sub_i, sub_d, rows=tsel)
        at = 0
        for q, (bi, bd) in zip(sets, tables):
            bi[q], bd[q] = sub_i[at : at + q.size], sub_d[at : at + q.size]
            at += q.size


def plan_clusters(plan: dict):
    if "cross" in plan:
        yield from plan["cross"]
    else:
        for clus in plan["cells"].values():
            yield from clus


