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
from ..topk import merge_similarity_tile
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



def brute_task(layout: Layout, j: int, qv: np.ndarray, q_codes: np.ndarray, widths: dict,
               start: int = 0) -> dict:
    """Exact top-k of each kind of ``widths`` (kind -> k) for sample queries ``start : start + q``
    (vectors ``qv[start : start + q]`` of all the sample's ``qv``, codes ``q_codes`` (q, 3):
    group, label, confounder) over chunk ``j`` (all its rows); the cross-group and typed kinds
    share their GEMMs (:meth:`Targets.search`). Returns ``{kind: (idx, dist)}``, (q, k) each."""
    with single_thread_blas():
        q = q_codes.shape[0]
        by = np.lexsort((q_codes[:, 2], q_codes[:, 1]))  # by (label, confounder), as in search_task
        qv = qv[int(start):int(start) + q][by]
        res = {kind: (np.full((q, k), -1, np.int64), np.full((q, k), np.inf)) for kind, k in widths.items()}
        Targets(layout.n_conf, *layout.read_chunk(j)).search(qv, tuple(q_codes[by].T), np.arange(q), res, None)
        back = np.argsort(by)  # the sample's own order again
        return {kind: (idx[back], dist[back]) for kind, (idx, dist) in res.items()}


def search_task(layout: Layout, batch: dict, widths: dict, tables: dict) -> tuple[int, float]:
    """Search the query clusters of ``batch`` and write their rows of the scope-order tables
    ``tables`` (``{(kind, "idx" | "dist"): (path, data offset)}``, created by the driver; each
    query row is written by exactly one task, so a retried task rewrites the same bytes); returns
    its query count and its wall seconds (the kernel throughput figures are pairs over these).

    ``widths`` maps each kind searched to its table width ``k``: ``{"cross": k}``, ``{"so": m,
    "os": m}``, or all three (both searches in one, ADR-0024). ``batch`` maps a query cluster
    ``a`` to its probe plan: ``{"cross": probed clusters}`` and / or, for the typed kinds,
    ``{"cells": {target cell: probed clusters}}`` (cell code ``label * n_conf + confounder``).
    Targets are read in pieces of at most :data:`PIECE_ROWS` rows (whole clusters) and searched
    by :meth:`Targets.search`.
    """
    t0 = time.perf_counter()
    with single_thread_blas():
        q_clusters = sorted(batch)
        qv, qmeta, qcl = layout.read_clusters(q_clusters)
        # each cluster's rows by (label, confounder): a typed query set is a few runs (_TypedShare)
        by = np.lexsort((qmeta[:, 3], qmeta[:, 2], qcl))
        qv, qmeta, qcl = qv[by], qmeta[by], qcl[by]
        q_codes = (qmeta[:, 1], qmeta[:, 2], qmeta[:, 3])
        res = {kind: (np.full((qv.shape[0], k), -1, np.int64), np.full((qv.shape[0], k), np.inf))
               for kind, k in widths.items()}
        needed = sorted({int(c) for a in q_clusters for c in plan_clusters(batch[a])})
        for piece in _pieces(needed, layout.sizes):
            target = Targets(layout.n_conf, *layout.read_clusters(piece))
            for a in q_clusters:
                target.search(qv, q_codes, np.flatnonzero(qcl == a), res, batch[a])
            del target
        for kind in widths:
            for what, arr in zip(("idx", "dist"), res[kind]):
                path, offset = tables[(kind, what)]
                write_rows(path, offset, qmeta[:, 0], arr)
        return int(qv.shape[0]), time.perf_counter() - t0


def _pieces(clusters: list, sizes) -> list[list]:
    """``clusters`` in consecutive pieces of at most :data:`PIECE_ROWS` rows (whole clusters; a
    larger cluster alone)."""
    pieces, piece, rows = [], [], 0
    for c in clusters:
        if piece and rows + sizes[c] > tunables.PIECE_ROWS:
            pieces.append(piece)
            piece, rows = [], 0
        piece.append(c)
        rows += int(sizes[c])
    if piece:
        pieces.append(piece)
    return pieces


class Targets:
    """One piece of target rows (vectors, scope positions, groups) and their order by (cell, cluster).

    The vectors stay as read (no sorted copy): ``order`` lists row numbers by (cell, cluster), so a
    target cell is one contiguous run of ``order``, and the kernel gathers the selected rows one
    tile at a time (:func:`~cachescore.neighbors.partition.topk_tiles` ``rows=``). The typed search
    runs per target cell, separately for the queries it serves as SO pool (same label, other
    confounder) and as OS pool (other label, same confounder): each pair is computed once, and
    only the group rule remains to be masked. When the cross-group table is searched in the same
    call, the typed pairs inside its probed rows are merged from its similarity tiles
    (:class:`_TypedShare`); only the typed pairs outside them get GEMMs of their own.
    """

    def __init__(self, n_conf: int, tv: np.ndarray, meta: np.ndarray, cluster: np.ndarray):
        self.n_conf, self.tv = n_conf, tv
        cell = meta[:, 2] * n_conf + meta[:, 3]
        self.order = np.lexsort((cluster, cell))
        self.tpos, self.t_groups = meta[:, 0], meta[:, 1]
        self.row_cell, self.row_cluster = cell, cluster  # by row number
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

    def search(self, qv, q_codes, qsel, res: dict, plan: dict | None) -> None:
        """Merge the top-k of queries ``qsel`` over this piece into ``res`` (kind -> (idx, dist)
        of all queries; each table's width is its ``k``), probing what ``plan`` allows (see
        :func:`search_task`; None = all). ``q_codes`` = (groups, labels, confounders) of all
        queries. With ``"cross"`` and the typed kinds in ``res``, a typed pair inside the
        cross-group probe is computed once for both; the tables equal two separate calls'."""
        pools = self._typed_pools(q_codes, qsel, plan) if "so" in res else []
        if "cross" not in res:
            for _, tsel, sets in pools:
                self._run(qv, q_codes, sets, tsel, (res["so"], res["os"]))
            return
        cross = None if plan is None else plan["cross"]
        tsel = self.select(0, self.tpos.size, cross)
        share = _TypedShare(self, qsel, tsel, res, q_codes[0]) if pools else None
        for tc, cell_rows, sets in pools:
            inside = np.ones(cell_rows.size, bool) if cross is None else np.isin(self.row_cluster[cell_rows], cross)
            if not inside.all():  # typed pairs outside the cross-group probe: GEMMs of their own
                self._run(qv, q_codes, sets, cell_rows[~inside], (res["so"], res["os"]))
            if inside.any():
                share.add(tc, cell_rows[inside], sets)
        self._run(qv, q_codes, (qsel,), tsel, (res["cross"],), share=share)

    def _typed_pools(self, q_codes, qsel, plan) -> list:
        """``[(cell, its probed row numbers, (SO queries, OS queries))]`` for each target cell of
        this piece that the plan probes and some query of ``qsel`` searches (query sets as
        indices of all queries; disjoint)."""
        ql, qc = q_codes[1][qsel], q_codes[2][qsel]
        out = []
        for tc, (lo, hi) in self.span.items():
            if plan is not None and tc not in plan["cells"]:
                continue
            tl, tcf = divmod(tc, self.n_conf)
            # the cell is the SO pool of one query set and the OS pool of another
            sets = (qsel[(ql == tl) & (qc != tcf)], qsel[(ql != tl) & (qc == tcf)])
            if sets[0].size or sets[1].size:
                out.append((tc, self.select(lo, hi, None if plan is None else plan["cells"][tc]), sets))
        return out

    def _run(self, qv, q_codes, sets, tsel, tables, share=None) -> None:
        """Search targets ``tsel`` for disjoint query row sets ``sets`` (a tuple of index arrays)
        in one kernel call, merging each set into its table of ``tables`` ((idx, dist) of all
        queries, one per set, of one width). ``share``: the kernel's (a single set)."""
        rows = np.concatenate(sets)
        if rows.size == 0 or tsel.size == 0:
            return
        sub_i, sub_d = _stacked(sets, tables)
        # the targets are each query set's pool (one cell, or the probed scope): only groups mask
        topk_tiles(qv[rows], q_codes[0][rows], self.tv, self.tpos, self.t_groups, sub_i.shape[1], sub_i, sub_d,
                   rows=tsel, share=share)
        _unstack(sets, tables, sub_i, sub_d)


def _stacked(sets, tables) -> tuple[np.ndarray, np.ndarray]:
    """The running rows of disjoint query sets ``sets`` (index arrays), each from its table of
    ``tables`` ((idx, dist) of all queries, one width), stacked in set order (copies)."""
    return (np.concatenate([bi[q] for q, (bi, _) in zip(sets, tables)]),
            np.concatenate([bd[q] for q, (_, bd) in zip(sets, tables)]))


def _unstack(sets, tables, sub_i, sub_d) -> None:
    """Write rows stacked by :func:`_stacked` back into their tables."""
    at = 0
    for q, (bi, bd) in zip(sets, tables):
        bi[q], bd[q] = sub_i[at : at + q.size], sub_d[at : at + q.size]
        at += q.size


#: A typed query set of :class:`_TypedShare` in at most this many runs of consecutive query rows is
#: merged run by run from views of the similarity tile; a set in more runs is gathered once.
SHARE_RUNS = 4


class _TypedShare:
    """Typed merges from a cross-group search's similarity tiles (the ``share`` of
    :func:`~cachescore.neighbors.partition.topk_tiles`, whose queries are ``qsel`` and targets
    the cross selection ``tsel``). Per target cell added: which of ``tsel``'s columns the typed
    plan probes there (a run of ``tsel``, which is ordered by cell) and the positions in
    ``qsel`` of its SO and OS queries. A pair meets the same float as in a typed search of its
    own and a top-k merge does not depend on how the pairs are tiled, so the typed tables are
    the ones a separate search gives. ``qsel`` is ascending (a query cluster's rows).

    Queries ordered by (label, confounder) within their cluster (as :func:`search_task` and
    :func:`brute_task` order them) make each SO / OS set a few runs of consecutive rows: each run
    is merged from a view of the tile straight into a view of its table (no copy of the tile's
    entries or of the running rows). The merges only set same-group pairs of the tile to
    ``-inf``, which the cross-group merge that follows masks anyway."""

    def __init__(self, targets: Targets, qsel, tsel, res: dict, q_groups):
        self.t, self.qsel, self.tsel, self.q_groups = targets, qsel, tsel, q_groups
        self.tables = (res["so"], res["os"])
        self.col_cell = targets.row_cell[tsel]  # ascending: ``order`` runs by (cell, cluster)
        self.runs = []  # (first column, last column + 1, probed mask or None, SO positions, OS positions)

    def add(self, cell: int, rows, sets) -> None:
        """Target ``cell``'s probed ``rows`` (row numbers, all inside ``tsel``) for the query sets
        ``sets`` (SO, OS: indices of all queries, inside ``qsel``)."""
        lo = int(np.searchsorted(self.col_cell, cell))
        hi = int(np.searchsorted(self.col_cell, cell, side="right"))
        probed = np.isin(self.tsel[lo:hi], rows)
        pos = tuple(np.searchsorted(self.qsel, q) for q in sets)  # both ascending
        self.runs.append((lo, hi, None if probed.all() else probed, *pos))

    def __call__(self, sim, s, e, t0, t1) -> None:
        for lo, hi, probed, *positions in self.runs:
            a, b = max(lo, t0), min(hi, t1)
            if a >= b:
                continue
            keep = None if probed is None or probed[a - lo:b - lo].all() else probed[a - lo:b - lo]
            if keep is not None and not keep.any():
                continue
            t_rows = self.tsel[a:b] if keep is None else self.tsel[a:b][keep]
            cols = slice(a - t0, b - t0)
            for table, pos in zip(self.tables, positions):
                pos = pos[np.searchsorted(pos, s):np.searchsorted(pos, e)]  # in ``s:e``
                if pos.size:
                    self._merge(sim, s, cols, keep, t_rows, table, pos)

    def _merge(self, sim, s, cols, keep, t_rows, table, pos) -> None:
        """Merge the tile's pairs of query positions ``pos`` (ascending, in ``s:e``) and columns
        ``cols`` (``keep`` of them, None = all; targets ``t_rows``) into ``table``."""
        bi, bd = table
        t_groups, t_ids, k = self.t.t_groups[t_rows], self.t.tpos[t_rows], bi.shape[1]
        cuts = np.flatnonzero(np.diff(pos) != 1) + 1
        if cuts.size < SHARE_RUNS:
            for run in np.split(pos, cuts):
                q0, p0, p1 = int(self.qsel[run[0]]), int(run[0]), int(run[-1]) + 1
                block = sim[p0 - s:p1 - s, cols]
                if keep is not None:
                    block = block[:, keep]
                if self.qsel[p1 - 1] - q0 == p1 - 1 - p0:  # consecutive rows of the table too: views
                    merge_similarity_tile(bi[q0:q0 + p1 - p0], bd[q0:q0 + p1 - p0], block,
                                          self.q_groups[q0:q0 + p1 - p0], t_groups, t_ids, k)
                else:
                    self._merge_gathered(block, self.qsel[p0:p1], t_groups, t_ids, table)
            return
        block = sim[pos - s, cols]  # the cell's columns are one run of the tile: rows by slice
        self._merge_gathered(block if keep is None else block[:, keep], self.qsel[pos], t_groups, t_ids, table)

    def _merge_gathered(self, block, rows, t_groups, t_ids, table) -> None:
        """Merge ``block`` (len(rows), targets) into the table rows ``rows`` (copied out and back)."""
        sub_i, sub_d = _stacked((rows,), (table,))
        merge_similarity_tile(sub_i, sub_d, block, self.q_groups[rows], t_groups, t_ids, sub_i.shape[1])
        _unstack((rows,), (table,), sub_i, sub_d)


def plan_clusters(plan: dict):
    """Every cluster a query cluster's probe plan names (cross-group and typed; repeats possible)."""
    yield from plan.get("cross", ())
    for clus in plan.get("cells", {}).values():
        yield from clus
