"""Out-of-core, distributed neighbour search of one large scope (DESIGN §4 "Large scopes", §6 "Scale").

A metric unit whose scope has at least ``[neighbors] large_scope_rows`` rows is not a task: the
client process drives it (:func:`cachescore.pipeline.unit.drive_large_unit`) through this module,
which fans the search out over the cluster's workers:

1. **Partition** (once per scope, shared by every unit of that scope):
   a sample of rows is read from the cache and normalised, and a spherical k-means gives ``C``
   centroids (``C = ceil(n / ROWS_PER_CLUSTER)``); then one task per *chunk* of the scope's rows
   (``CHUNK_BYTES`` of embeddings) reads its rows **from the cache on the worker**, checks them
   (NaN/inf name the view rows), normalises them (croma's two-step rule, spec §1.7), assigns each
   to its nearest centroid and writes them to a scratch ``.npy`` sorted by cluster, with their
   metadata (scope position and codes, :data:`INDEX_COLUMNS`) in the same order. The tasks find
   the scope's tileset rows and codes in ``rows.npy``, written once by the driver.
2. **Calibration and audit** (ANN only): two seeded query samples get their exact answers from
   one brute-force task per chunk (merged by ``(distance, index)``); the calibration sample picks
   the smallest probe fraction whose recall reaches the target plus half the margin (each true
   neighbour's cluster tells at which fraction it is probed: :func:`~cachescore.neighbors.partition.probe_levels`).
3. **Search**: one task per batch of query clusters reads its queries and the clusters they probe
   (cross-group: ``f`` of all rows; typed: ``f`` of every SO/OS target cell) from the chunk files
   in pieces of at most ``PIECE_ROWS`` rows, runs the exact kernel
   (:func:`~cachescore.neighbors.partition.topk_tiles`) and writes a part file. The driver copies
   the parts into memory-mapped ``(n, k)`` tables, which the metrics read in row blocks.
4. **Recall**: measured on the audit sample against its exact answers (tie-robust, like
   :mod:`cachescore.neighbors.ann`). Below the target, the fraction grows to the next level and
   the search reruns; ``f = 1`` probes every cluster, i.e. is an exact search (the ``exact``
   backend on large scopes runs with ``f = 1`` directly, without sampling).

Memory per task: one chunk (partition), or ``BATCH_ROWS`` queries plus one ``PIECE_ROWS`` piece
of targets with their metadata (search); a task's arguments are paths, per-chunk cluster bounds
(chunks × clusters), a batch's probe plan or a bounded query sample, never O(n) (so a worker's
memory does not grow with the scope). Memory of the driver: O(n) codes, cluster ids and
positions, the metric's per-unit values, and the memory-mapped tables' pages.

Scratch: ``<store>/scratch/large/<key>/<scope>/`` where ``key`` fingerprints the unit's inputs, design,
confounder column, seed and code version (:func:`scratch_dir`), so concurrent units of one scope (RI and MaRI share a table)
coordinate through a ``distributed.Lock`` per artefact and reuse what is complete (``done.json``
written last; parts and tables written under temporary names and renamed). A run that is killed
resumes from the completed artefacts; :func:`remove_scratch` deletes a run's folders at its end.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._threads import single_thread_blas
from ..neighbors.ann import RecallTargetError, _calibrate, _merge, _recall_counts, distance_tol
from ..neighbors.normalize import compute_dtype
from ..neighbors.partition import (
    assign_clusters,
    probe_levels,
    probe_order,
    probe_stops,
    probed_clusters,
    spherical_kmeans,
    topk_tiles,
)
from ..store.atomic import atomic_write, atomic_write_json, partial_path
from .blocked_search import _gather_or_cancel

__all__ = [
    "CHUNK_BYTES",
    "ROWS_PER_CLUSTER",
    "FRACTIONS",
    "LargeScopeSearch",
    "ScopeRows",
    "remove_scratch",
    "scratch_dir",
    "scratch_root",
]

#: Embedding bytes per partition chunk (DESIGN §2: row chunks of ~64–256 MiB).
CHUNK_BYTES = 128 * 2**20
#: Target rows per k-means cluster (``C = ceil(n / ROWS_PER_CLUSTER)``).
ROWS_PER_CLUSTER = 2048
#: Probe fractions tried by calibration and widening, ascending; 1.0 = every cluster (exact).
FRACTIONS = (1 / 256, 1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
#: Rows of the sample the centroids are trained on: ``48 · C`` clamped to
#: ``[KMEANS_MIN_SAMPLE, KMEANS_MAX_SAMPLE]`` (and to ``n``); the cap keeps the read bounded.
KMEANS_MIN_SAMPLE = 20000
KMEANS_MAX_SAMPLE = 65536
#: Query rows per search task (a batch of whole clusters; at least one cluster).
BATCH_ROWS = 16384
#: Target rows held at once by a search task.
PIECE_ROWS = 65536
#: Calibration queries (their exact answers pick the probe fraction).
CALIBRATION_QUERIES = 2000
#: Version of the scratch layout and of this engine (enters the scratch key).
ENGINE_VERSION = 1


def scratch_root(store_root) -> Path:
    """The folder holding every large-scope artefact of a results store."""
    return Path(store_root) / "scratch" / "large"


def scratch_dir(unit) -> Path:
    """The scratch folder of a work unit's scopes: shared by every unit with the same inputs,
    design, confounder column, seed and code version (RI and MaRI reuse one table)."""
    from ..store import fingerprint

    key = fingerprint({"inputs": unit.inputs, "design": unit.design, "confounder": unit.confounder_column,
                       "code": unit.code_version, "seed": int(unit.params.get("seed", 0)),
                       "engine": ENGINE_VERSION})
    return scratch_root(unit.store_root) / key


def remove_scratch(units) -> None:
    """Delete the scratch folders of ``units`` (call once none of them is running)."""
    for d in {scratch_dir(u) for u in units if u.params.get("engine") == "distributed"}:
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- small file helpers


def _meta_name(chunk_file: str) -> str:
    """The metadata file of a chunk's vector file (``chunk-00000.npy`` -> ``chunk-00000.meta.npy``)."""
    return chunk_file[: -len(".npy")] + ".meta.npy"


def _atomic_save_npz(path: Path, **arrays) -> None:
    atomic_write(path, lambda fh: np.savez(fh, **arrays))


def _load_npz(path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _npy_header(path: str) -> tuple[int, tuple, np.dtype]:
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
        if fortran:
            raise ValueError(f"{path}: Fortran-ordered arrays are not supported")
        return fh.tell(), shape, dtype


def _read_row_runs(path: str, runs, dim: int, dtype: np.dtype, offset: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``[a, b)`` for each ``(a, b)`` of ``runs`` of a C-ordered 2-D ``.npy``, concatenated
    (into ``out`` when given: shape ``(sum of run lengths, dim)``, ``dtype``).

    Plain reads (``readinto``), not a memory map: the pages read are not kept mapped, so a task's
    resident memory is its own arrays only.
    """
    total = sum(b - a for a, b in runs)
    if out is None:
        out = np.empty((total, dim), dtype=dtype)
    row_bytes = dim * dtype.itemsize
    at = 0
    with open(path, "rb", buffering=0) as fh:
        for a, b in runs:
            if b <= a:
                continue
            fh.seek(offset + a * row_bytes)
            view = memoryview(out[at : at + b - a]).cast("B")
            got = 0
            while got < view.nbytes:
                r = fh.readinto(view[got:])
                if not r:
                    raise OSError(f"{path}: truncated (wanted rows {a}:{b})")
                got += r
            at += b - a
    return out


# ----------------------------------------------------------------------------- scope description


@dataclass(frozen=True)
class ScopeRows:
    """Where a scope's rows live and their integer codes (everything the driver needs but the vectors).

    ``tile_rows`` (n,) int64: the tileset row of each scope position (view order within the scope);
    ``groups``, ``labels``, ``confounders`` (n,) int codes; ``source`` names the scope in errors.
    Held by the driver only: tasks read what they need from the scope's ``rows.npy`` (see
    :class:`_ScopeFiles`), so no task receives an O(n) argument.
    """

    cache_root: str
    encoder: str
    tileset: str
    tile_rows: np.ndarray
    groups: np.ndarray
    labels: np.ndarray
    confounders: np.ndarray
    source: str

    @property
    def n(self) -> int:
        return int(self.tile_rows.size)


#: Columns of a scope's ``rows.npy`` and of every chunk's ``.meta.npy`` (int64): the first is the
#: tileset row (``rows.npy``, scope order) or the scope position (chunk metadata, file order).
INDEX_COLUMNS = ("row", "group", "label", "confounder")


@dataclass(frozen=True)
class _ScopeFiles:
    """What a partition task needs to read a scope's rows: the cache location and the scope's
    ``rows.npy`` ((n, 4) int64, :data:`INDEX_COLUMNS`, written once by the driver)."""

    cache_root: str
    encoder: str
    tileset: str
    source: str
    rows_path: str

    def index(self, start: int, stop: int) -> np.ndarray:
        """``rows.npy[start:stop]``: (stop - start, 4) int64."""
        offset = _npy_header(self.rows_path)[0]
        return _read_row_runs(self.rows_path, [(start, stop)], len(INDEX_COLUMNS), np.dtype(np.int64), offset)


def _read_scope_rows(cache_root, encoder, tileset, tile_rows, positions, source) -> np.ndarray:
    """Task body: normalised rows of the scope ``positions`` (their tileset rows ``tile_rows``)."""
    from .._finite import nonfinite_rows
    from ..cache import Cache
    from ..neighbors.normalize import normalize_rows

    x = Cache(cache_root).load_rows(encoder, tileset, np.asarray(tile_rows, dtype=np.int64))
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


def _sample_task(files: _ScopeFiles, positions: np.ndarray, tile_rows: np.ndarray) -> np.ndarray:
    with single_thread_blas():
        return _read_scope_rows(files.cache_root, files.encoder, files.tileset, tile_rows, positions, files.source)


def _chunk_task(files: _ScopeFiles, start: int, stop: int, centroids: np.ndarray, path: str, meta_path: str):
    """Read, check, normalise and assign scope positions ``start:stop``; write them sorted by
    cluster to ``path`` and their metadata ((r, 4) int64: scope position, group, label, confounder)
    to ``meta_path`` in the same order. Returns ``(positions in file order (int64), cluster bounds (C+1,))``."""
    with single_thread_blas():
        index = files.index(start, stop)
        pos = np.arange(start, stop, dtype=np.int64)
        u = _read_scope_rows(files.cache_root, files.encoder, files.tileset, index[:, 0], pos, files.source)
        cl = assign_clusters(u, centroids)
        order = np.argsort(cl, kind="stable")
        bounds = np.searchsorted(cl[order], np.arange(centroids.shape[0] + 1)).astype(np.int64)
        atomic_write(Path(path), lambda fh: np.save(fh, np.ascontiguousarray(u[order])))
        del u
        index[:, 0] = pos
        atomic_write(Path(meta_path), lambda fh: np.save(fh, np.ascontiguousarray(index[order])))
        return pos[order], bounds


@dataclass(frozen=True)
class _Layout:
    """The partition as tasks see it: per chunk, a vector file (rows sorted by cluster) and a
    metadata file ((r, 4) int64 in the same order: scope position, group, label, confounder), and
    the per-chunk cluster bounds. Size O(chunks × clusters), independent of the rows' count."""

    paths: tuple
    meta_paths: tuple
    header: tuple  # per chunk: byte offset of the vectors
    meta_header: tuple  # per chunk: byte offset of the metadata
    dim: int
    dtype: str
    bounds: np.ndarray  # (J, C+1) int64
    n_conf: int  # cell code of a row: label * n_conf + confounder

    @property
    def sizes(self) -> np.ndarray:
        """(C,) rows per cluster over all chunks."""
        return self.bounds[:, 1:].sum(axis=0) - self.bounds[:, :-1].sum(axis=0)

    def read_clusters(self, clusters) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows of ``clusters`` from every chunk: vectors (r, d), metadata (r, 4), cluster ids (r,)."""
        clusters = np.asarray(clusters, dtype=np.int64)
        plan, total = [], 0
        for j in range(len(self.paths)):
            b = self.bounds[j]
            present = clusters[b[clusters + 1] > b[clusters]]
            if present.size:
                runs = [(int(b[c]), int(b[c + 1])) for c in present]
                plan.append((j, runs, present))
                total += sum(e - a for a, e in runs)
        vecs = np.empty((total, self.dim), dtype=np.dtype(self.dtype))
        meta = np.empty((total, len(INDEX_COLUMNS)), dtype=np.int64)
        at = 0
        for j, runs, _ in plan:
            r = sum(e - a for a, e in runs)
            _read_row_runs(self.paths[j], runs, self.dim, np.dtype(self.dtype), self.header[j], out=vecs[at : at + r])
            _read_row_runs(self.meta_paths[j], runs, len(INDEX_COLUMNS), np.dtype(np.int64), self.meta_header[j],
                           out=meta[at : at + r])
            at += r
        cl = np.concatenate([np.zeros(0, np.int64)] + [np.repeat(present, [e - a for a, e in runs])
                                                       for _, runs, present in plan])
        return vecs, meta, cl

    def read_chunk(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every row of chunk ``j``: vectors, metadata, cluster ids (as :meth:`read_clusters`)."""
        b = self.bounds[j]
        n_rows = int(b[-1])
        vecs = _read_row_runs(self.paths[j], [(0, n_rows)], self.dim, np.dtype(self.dtype), self.header[j])
        meta = _read_row_runs(self.meta_paths[j], [(0, n_rows)], len(INDEX_COLUMNS), np.dtype(np.int64),
                              self.meta_header[j])
        return vecs, meta, np.repeat(np.arange(b.size - 1, dtype=np.int64), np.diff(b))


def _brute_task(layout: _Layout, j: int, qv: np.ndarray, q_codes: np.ndarray, kinds: tuple, k: int) -> dict:
    """Exact top-k of each kind for the sample queries (vectors ``qv``, codes ``q_codes`` (q, 3):
    group, label, confounder) over chunk ``j`` (all its rows)."""
    with single_thread_blas():
        q = q_codes.shape[0]
        out = {kind: (np.full((q, k), -1, np.int64), np.full((q, k), np.inf)) for kind in kinds}
        _Targets(layout.n_conf, *layout.read_chunk(j)).search(qv, tuple(q_codes.T), np.arange(q), k, out, None)
        return out


def _search_task(layout: _Layout, batch: dict, kinds: tuple, k: int, path: str) -> int:
    """Search the query clusters of ``batch`` and write a part file; returns its query count.

    ``batch`` maps a query cluster ``a`` to its probe plan: ``{"cross": probed clusters}``, or for
    the typed kinds ``{"cells": {target cell: probed clusters}}`` (cell code ``label * n_conf +
    confounder``). Targets are read in pieces of at most :data:`PIECE_ROWS` rows (whole clusters)
    and searched by :meth:`_Targets.search`.
    """
    with single_thread_blas():
        q_clusters = sorted(batch)
        qv, qmeta, qcl = layout.read_clusters(q_clusters)
        q_codes = (qmeta[:, 1], qmeta[:, 2], qmeta[:, 3])
        res = {kind: (np.full((qv.shape[0], k), -1, np.int64), np.full((qv.shape[0], k), np.inf)) for kind in kinds}
        needed = sorted({int(c) for a in q_clusters for c in _plan_clusters(batch[a])})
        # targets in pieces of at most PIECE_ROWS rows (whole clusters)
        sizes = layout.sizes
        piece: list[int] = []
        rows_in_piece = 0
        pieces = []
        for c in needed:
            if piece and rows_in_piece + sizes[c] > PIECE_ROWS:
                pieces.append(piece)
                piece, rows_in_piece = [], 0
            piece.append(c)
            rows_in_piece += int(sizes[c])
        if piece:
            pieces.append(piece)
        for piece in pieces:
            target = _Targets(layout.n_conf, *layout.read_clusters(piece))
            for a in q_clusters:
                target.search(qv, q_codes, np.flatnonzero(qcl == a), k, res, batch[a])
            del target
        arrays = {"pos": qmeta[:, 0]}
        for kind in kinds:
            arrays[f"{kind}_idx"], arrays[f"{kind}_dist"] = res[kind]
        _atomic_save_npz(Path(path), **arrays)
        return int(qv.shape[0])


class _Targets:
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
        of all queries), probing what ``plan`` allows (see :func:`_search_task`; None = all).
        ``q_codes`` = (groups, labels, confounders) of all queries."""
        if "cross" in res:
            clusters = None if plan is None else plan["cross"]
            self._run(qv, q_codes, qsel, self.select(0, self.tpos.size, clusters), k, res["cross"])
            return
        ql, qc = q_codes[1][qsel], q_codes[2][qsel]
        for tc, (lo, hi) in self.span.items():
            if plan is not None and tc not in plan["cells"]:
                continue
            tsel = self.select(lo, hi, None if plan is None else plan["cells"][tc])
            tl, tcf = divmod(tc, self.n_conf)
            self._run(qv, q_codes, qsel[(ql == tl) & (qc != tcf)], tsel, k, res["so"])
            self._run(qv, q_codes, qsel[(ql != tl) & (qc == tcf)], tsel, k, res["os"])

    def _run(self, qv, q_codes, qsel, tsel, k, table) -> None:
        if qsel.size == 0 or tsel.size == 0:
            return
        bi, bd = table
        sub_i, sub_d = bi[qsel], bd[qsel]
        # the targets are this query set's pool (one cell, or the probed scope): only groups mask
        topk_tiles(qv[qsel], q_codes[0][qsel], self.tv, self.tpos, self.t_groups, k, sub_i, sub_d, rows=tsel)
        bi[qsel], bd[qsel] = sub_i, sub_d


def _plan_clusters(plan: dict):
    if "cross" in plan:
        yield from plan["cross"]
    else:
        for clus in plan["cells"].values():
            yield from clus


@dataclass(frozen=True)
class _Partition:
    """The driver's view of a built partition: the tasks' :class:`_Layout` plus the O(n) index
    (file-order positions, every row's cluster and codes) that only the driver holds."""

    layout: _Layout
    order_pos: np.ndarray  # (n,) int64: scope positions in (chunk, file row) order
    chunk_start: np.ndarray  # (J+1,) int64: chunk j's first entry in order_pos
    cluster: np.ndarray  # (n,) int32 by scope position
    codes: np.ndarray  # (3, n) int64: groups, labels, confounders by scope position

    @property
    def n(self) -> int:
        return int(self.order_pos.size)

    def read_positions(self, positions) -> np.ndarray:
        """Vectors of the given scope positions (small samples), in the given order."""
        lay = self.layout
        positions = np.asarray(positions, dtype=np.int64)
        where = np.empty(self.n, dtype=np.int64)
        where[self.order_pos] = np.arange(self.n)
        at = where[positions]
        out = np.empty((positions.size, lay.dim), dtype=np.dtype(lay.dtype))
        chunk = np.searchsorted(self.chunk_start, at, side="right") - 1
        for j in np.unique(chunk):
            sel = np.flatnonzero(chunk == j)
            local = at[sel] - self.chunk_start[j]
            srt = np.argsort(local)
            runs = [(int(r), int(r) + 1) for r in local[srt]]
            out[sel[srt]] = _read_row_runs(lay.paths[j], runs, lay.dim, np.dtype(lay.dtype), lay.header[j])
        return out


# ----------------------------------------------------------------------------- driver


class LargeScopeSearch:
    """Neighbour backend for the metrics that searches scopes out of core on ``client``'s workers.

    Parameters
    ----------
    client : distributed.Client
        The run's client (the unit is driven from the client process).
    scopes : dict
        ``{key: ScopeRows}`` for each scope the metric will ask for, in the metric's scope order;
        a call is matched to its scope by the ``groups`` codes it passes (see :meth:`_scope_for`).
    scratch : path
        This unit's scratch folder for the scope artefacts (see module docstring).
    exact : bool
        Probe every cluster (the ``exact`` backend); no sampling, recall 1.
    recall_target, n_recall_queries, random_state, max_rounds
        As :func:`cachescore.neighbors.ann.cross_group_knn_ann_with_recall`.

    Calls: ``search.cross(u, groups, kmax) -> (idx, dist)`` and
    ``search.typed(u, labels, confounders, groups, m) -> (so_dist, os_dist)`` honour the exact
    engines' contracts (``u`` is ignored: rows come from the cache); tables are memory-mapped.
    :attr:`recall` is the worst measured recall of all calls, :attr:`details` one dict per call.
    """

    def __init__(self, client, scopes: dict, scratch, *, exact=False, recall_target=0.99, n_recall_queries=1000,
                 random_state=0, max_rounds=4):
        self.client, self.scopes, self.scratch = client, dict(scopes), Path(scratch)
        self.exact, self.target = bool(exact), float(recall_target)
        self.n_recall_queries, self.seed, self.max_rounds = int(n_recall_queries), int(random_state), int(max_rounds)
        self.details: list[dict] = []
        self._served: dict[str, set] = {}

    @property
    def recall(self) -> float:
        vals = [d["recall"] for d in self.details]
        return min(vals) if vals else float("nan")

    # -- the metric-facing callables ------------------------------------------------------------
    def cross(self, u, groups, kmax):
        from ..metrics.windows import is_capped

        key, rows = self._scope_for(groups, "cross")
        if is_capped(int(kmax), rows.n, int(np.bincount(rows.groups).max())):
            # the cap rule needs every row's farthest scope row (windows.ScopeTable.far_is_cross),
            # which this engine does not compute: such a scope is tiny, score it in memory instead
            raise ValueError(
                f"{rows.source}: {rows.n} rows are within the reference's fetch cap for k = {int(kmax)} "
                "(n <= k + max(64, largest group) + 1), which the out-of-core engine does not reproduce; raise "
                "[neighbors] large_scope_rows above this view's scope sizes or use smaller k candidates")
        t = self._tables(key, rows, ("cross",), int(kmax))
        return t["cross_idx"], t["cross_dist"]

    def typed(self, u, labels, confounders, groups, m):
        key, rows = self._scope_for(groups, "typed")
        t = self._tables(key, rows, ("so", "os"), int(m))
        return t["so_dist"], t["os_dist"]

    def _scope_for(self, groups, kind: str):
        """The scope a metric's call is about. Scopes are matched by their codes; paired subsets
        can share identical codes, so among equal ones the first not yet served for ``kind`` is
        taken (the metrics search their scopes once each, in scope order). Raises ``LookupError``
        when nothing matches or an ambiguous scope is asked for again."""
        groups = np.asarray(groups)
        same = [key for key, rows in self.scopes.items()
                if rows.n == groups.size and np.array_equal(rows.groups, groups)]
        if not same:
            raise LookupError(f"no large scope of {groups.size} rows matches the metric's scope")
        served = self._served.setdefault(kind, set())
        fresh = [key for key in same if key not in served]
        if not fresh and len(same) > 1:
            raise LookupError(f"{len(same)} large scopes share these codes and all were served already")
        key = fresh[0] if fresh else same[0]
        served.add(key)
        return key, self.scopes[key]

    # -- artefacts --------------------------------------------------------------------------------
    def _lock(self, name):
        from distributed import Lock

        return Lock(f"cachescore-large-{self.scratch}-{name}", scheduler_rpc=self.client.scheduler, loop=self.client.loop)

    def _partition(self, key, rows: ScopeRows) -> _Partition:
        folder = self.scratch / str(key) / "partition"
        with self._lock(f"{key}-partition"):
            if not (folder / "done.json").is_file():
                self._build_partition(folder, rows)
        meta = json.loads((folder / "done.json").read_text())
        z = _load_npz(folder / "layout.npz")
        paths = tuple(str(folder / f) for f in meta["files"])
        meta_paths = tuple(str(folder / _meta_name(f)) for f in meta["files"])
        cluster = np.empty(rows.n, dtype=np.int32)
        for j in range(len(paths)):
            s, e = z["chunk_start"][j], z["chunk_start"][j + 1]
            b = z["bounds"][j]
            cluster[z["order_pos"][s:e]] = np.repeat(np.arange(b.size - 1, dtype=np.int32), np.diff(b))
        codes = np.stack([np.asarray(a, dtype=np.int64) for a in (rows.groups, rows.labels, rows.confounders)])
        layout = _Layout(paths=paths, meta_paths=meta_paths, header=tuple(_npy_header(p)[0] for p in paths),
                         meta_header=tuple(_npy_header(p)[0] for p in meta_paths), dim=int(meta["dim"]),
                         dtype=meta["dtype"], bounds=z["bounds"], n_conf=int(codes[2].max()) + 1 if rows.n else 1)
        return _Partition(layout=layout, order_pos=z["order_pos"], chunk_start=z["chunk_start"], cluster=cluster,
                          codes=codes)

    def _build_partition(self, folder: Path, rows: ScopeRows) -> None:
        from ..cache import Cache

        t0 = time.perf_counter()
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        meta = Cache(rows.cache_root).meta(rows.encoder, rows.tileset)
        n, dim = rows.n, int(meta.dim)
        index = np.stack([rows.tile_rows, rows.groups, rows.labels, rows.confounders], axis=1).astype(np.int64)
        atomic_write(folder / "rows.npy", lambda fh: np.save(fh, index))
        del index
        files = _ScopeFiles(cache_root=str(rows.cache_root), encoder=rows.encoder, tileset=rows.tileset,
                            source=rows.source, rows_path=str(folder / "rows.npy"))
        c = max(1, math.ceil(n / ROWS_PER_CLUSTER))
        rng = np.random.default_rng([self.seed, 17])
        sample = np.sort(rng.choice(n, size=min(n, KMEANS_MAX_SAMPLE, max(KMEANS_MIN_SAMPLE, 48 * c)), replace=False))
        x = self.client.submit(_sample_task, files, sample, rows.tile_rows[sample], pure=False).result()
        centroids = spherical_kmeans(x, c, random_state=rng)
        del x
        step = max(1, CHUNK_BYTES // (dim * 4))
        bounds = list(range(0, n, step))
        cent_f = self.client.scatter(centroids, broadcast=True, hash=False)
        names = [f"chunk-{j:05d}.npy" for j in range(len(bounds))]
        futures = [self.client.submit(_chunk_task, files, s, min(n, s + step), cent_f, str(folder / f),
                                      str(folder / _meta_name(f)), pure=False)
                   for s, f in zip(bounds, names)]
        parts = _gather_or_cancel(self.client, futures)
        order_pos = np.concatenate([p[0] for p in parts])
        chunk_start = np.concatenate([[0], np.cumsum([p[0].size for p in parts])]).astype(np.int64)
        _atomic_save_npz(folder / "layout.npz", order_pos=order_pos, chunk_start=chunk_start,
                         bounds=np.stack([p[1] for p in parts]), centroids=centroids)
        atomic_write_json(folder / "done.json", {"files": names, "dim": dim, "dtype": compute_dtype(meta.dtype).name,
                                                 "n": n, "clusters": int(c),
                                                 "seconds": round(time.perf_counter() - t0, 3)})

    def _tables(self, key, rows: ScopeRows, kinds: tuple, k: int) -> dict:
        name = f"{'-'.join(kinds)}-{k}-{'exact' if self.exact else f'ann{self.target:g}-{self.n_recall_queries}'}"
        folder = self.scratch / str(key) / name
        with self._lock(f"{key}-{name}"):
            if not (folder / "done.json").is_file():
                self._search(folder, self._partition(key, rows), kinds, k)
        info = json.loads((folder / "done.json").read_text())
        part = json.loads((self.scratch / str(key) / "partition" / "done.json").read_text())
        self.details.append(dict(info, scope=str(key), kinds=list(kinds), k=k,
                                 seconds_partition=part["seconds"], n_chunks=len(part["files"])))
        out = {}
        for kind in kinds:
            for what in ("idx", "dist"):
                out[f"{kind}_{what}"] = np.load(folder / f"{kind}_{what}.npy", mmap_mode="r")
        return out

    def _search(self, folder: Path, part: _Partition, kinds: tuple, k: int) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        layout = part.layout
        n = part.n
        c = layout.bounds.shape[1] - 1
        sizes = layout.sizes
        with np.load(folder.parent / "partition" / "layout.npz", allow_pickle=False) as z:
            order = probe_order(z["centroids"])
        cell = part.codes[1] * layout.n_conf + part.codes[2]
        cells = np.unique(cell)
        cell_sizes = {int(t): np.bincount(part.cluster[cell == t], minlength=c) for t in cells}
        stops = {"cross": probe_stops(order, sizes, FRACTIONS)} if "cross" in kinds else {}
        for t, sz in cell_sizes.items():
            if "so" in kinds:
                stops[t] = probe_stops(order, sz, FRACTIONS)
        layout_f = self.client.scatter(layout, broadcast=True, hash=False)
        tol = distance_tol(np.dtype(layout.dtype), layout.dim)
        t0 = time.perf_counter()
        if self.exact:
            level, truth, audit = len(FRACTIONS) - 1, None, None
        else:
            level, truth, audit = self._calibrate(part, layout_f, kinds, k, order, stops, cell, tol)
        t_cal = time.perf_counter() - t0
        rounds = 0
        while True:
            frac = FRACTIONS[level]
            self._run_search(folder, n, layout_f, kinds, k, order, sizes, cell_sizes, stops, level)
            if truth is None:
                recall, n_audit = 1.0, 0
            else:
                hits = total = 0
                for kind in kinds:
                    found = np.load(folder / f"{kind}_dist.npy", mmap_mode="r")[audit]
                    h, t = _recall_counts(np.asarray(found), truth[kind][1], tol)
                    hits, total = hits + h, total + t
                recall, n_audit = (1.0 if total == 0 else hits / total), int(audit.size)
            if recall >= self.target or frac >= 1:
                break
            if rounds >= self.max_rounds:
                raise RecallTargetError.after_rounds(f"large-scope ANN search ({'/'.join(kinds)}, k={k})", recall,
                                                     self.target, n_audit, rounds, f"n={n}, probe fraction {frac:g}")
            rounds, level = rounds + 1, level + 1
        atomic_write_json(folder / "done.json", {"recall": float(recall), "n_recall_queries": n_audit, "rounds": rounds,
                                            "probe_fraction": float(frac), "n_clusters": int(c),
                                            "exact": bool(frac >= 1), "n": int(n),
                                            "seconds_calibration": round(t_cal, 3),
                                            "seconds_search": round(time.perf_counter() - t0 - t_cal, 3)})

    def _calibrate(self, part: _Partition, layout_f, kinds, k, order, stops, cell, tol):
        """Exact answers for the calibration and audit samples (one brute task per chunk), and the
        calibrated starting level. Returns ``(level, audit truth per kind, audit positions)``."""
        n = part.n
        rng_a = np.random.default_rng([self.seed, 1])
        rng_c = np.random.default_rng([self.seed, 2])
        audit = np.sort(rng_a.choice(n, size=min(n, self.n_recall_queries), replace=False))
        calib = np.sort(rng_c.choice(n, size=min(n, max(CALIBRATION_QUERIES, 2 * self.n_recall_queries)), replace=False))
        qpos = np.concatenate([calib, audit])
        qv = part.read_positions(qpos)
        qv_f = self.client.scatter(qv, hash=False, broadcast=True)
        q_codes = np.ascontiguousarray(part.codes[:, qpos].T)
        futures = [self.client.submit(_brute_task, layout_f, j, qv_f, q_codes, kinds, k, pure=False)
                   for j in range(len(part.layout.paths))]
        merged = None
        for found in _gather_or_cancel(self.client, futures):
            merged = found if merged is None else {kd: _merge(merged[kd], found[kd], k) for kd in kinds}
        nc = calib.size
        truth = {kd: (merged[kd][0][nc:], merged[kd][1][nc:]) for kd in kinds}
        levels, t_idx, t_dist = [], [], []
        qa = part.cluster[calib][:, None]
        for kd in kinds:
            ti, td = merged[kd][0][:nc], merged[kd][1][:nc]
            x = np.maximum(ti, 0)
            if kd == "cross":
                lev = probe_levels(order, stops["cross"])[qa, part.cluster[x]]
            else:
                lev = np.empty(ti.shape, dtype=np.int64)
                tcell = cell[x]
                for t in np.unique(tcell):
                    sel = tcell == t
                    lv = probe_levels(order, stops[int(t)])
                    lev[sel] = lv[np.broadcast_to(qa, ti.shape)[sel], part.cluster[x][sel]]
            levels.append(lev)
            t_idx.append(ti)
            t_dist.append(td)
        want = min(1.0, self.target + 0.5 * (1.0 - self.target))
        frac = _calibrate(levels, t_idx, t_dist, tol, want, FRACTIONS)
        return FRACTIONS.index(frac) if frac in FRACTIONS else len(FRACTIONS) - 1, truth, audit

    def _run_search(self, folder, n, layout_f, kinds, k, order, sizes, cell_sizes, stops, level):
        c = sizes.size
        plans = {}
        for a in range(c):
            if sizes[a] == 0:
                continue
            if "cross" in kinds:
                plan = {"cross": probed_clusters(order, sizes, a, int(stops["cross"][a, level]))}
            else:
                plan = {"cells": {t: probed_clusters(order, sz, a, int(stops[t][a, level]))
                                  for t, sz in cell_sizes.items()}}
            plans[a] = plan
        batches, cur, cur_rows = [], {}, 0
        for a in sorted(plans):
            if cur and cur_rows + sizes[a] > BATCH_ROWS:
                batches.append(cur)
                cur, cur_rows = {}, 0
            cur[a] = plans[a]
            cur_rows += int(sizes[a])
        if cur:
            batches.append(cur)
        parts_dir = folder / "parts"
        shutil.rmtree(parts_dir, ignore_errors=True)
        parts_dir.mkdir()
        futures = []
        for i, b in enumerate(batches):
            futures.append(self.client.submit(_search_task, layout_f, b, kinds, k, str(parts_dir / f"part-{i:05d}.npz"),
                                              pure=False))
        counts = _gather_or_cancel(self.client, futures)
        if sum(counts) != n:
            raise RuntimeError(f"large-scope search covered {sum(counts)} of {n} rows")
        tables = {}
        for kind in kinds:
            for what, dt in (("idx", np.int64), ("dist", np.float64)):
                tables[(kind, what)] = np.lib.format.open_memmap(partial_path(folder / f"{kind}_{what}.npy"),
                                                                 mode="w+", dtype=dt, shape=(n, k))
        for i in range(len(batches)):
            part = _load_npz(parts_dir / f"part-{i:05d}.npz")
            for kind in kinds:
                tables[(kind, "idx")][part["pos"]] = part[f"{kind}_idx"]
                tables[(kind, "dist")][part["pos"]] = part[f"{kind}_dist"]
        for (kind, what), mm in tables.items():
            mm.flush()
            os.replace(mm.filename, folder / f"{kind}_{what}.npy")
        del tables, mm
        shutil.rmtree(parts_dir, ignore_errors=True)


