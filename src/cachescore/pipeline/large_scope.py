"""Out-of-core, distributed neighbour search of one large scope (DESIGN §4 "Large scopes", §6 "Scale").

A metric unit whose scope has at least ``[neighbors] large_scope_rows`` rows does not load the view
into its worker. Its task (running under ``distributed.worker_client``, so it leaves the worker's
thread pool) drives this module, which fans the search out over the cluster:

1. **Partition** (once per scope, shared by every unit of that scope):
   a sample of rows is read from the cache and normalised, and a spherical k-means gives ``C``
   centroids (``C = ceil(n / ROWS_PER_CLUSTER)``); then one task per *chunk* of the scope's rows
   (``CHUNK_BYTES`` of embeddings) reads its rows **from the cache on the worker**, checks them
   (NaN/inf name the view rows), normalises them (croma's two-step rule, spec §1.7), assigns each
   to its nearest centroid and writes them to a scratch ``.npy`` sorted by cluster. The driver
   keeps only O(n) integer metadata (cluster code and chunk position of every row).
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

Memory per task: one chunk (partition), or ``batch`` queries plus one ``PIECE_ROWS`` piece of
targets (search), plus O(n) int metadata; never the scope's ``n × d`` matrix. Memory of the
driving unit: O(n) metadata and per-unit vectors, plus the memory-mapped tables' pages.

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


def _read_row_runs(path: str, runs, dim: int, dtype: np.dtype, offset: int) -> np.ndarray:
    """Rows ``[a, b)`` for each ``(a, b)`` of ``runs`` of a C-ordered 2-D ``.npy``, concatenated.

    Plain reads (``readinto``), not a memory map: the pages read are not kept mapped, so a task's
    resident memory is its own arrays only.
    """
    total = sum(b - a for a, b in runs)
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
    """Where a scope's rows live and their integer codes (everything a task needs but the vectors).

    ``tile_rows`` (n,) int64: the tileset row of each scope position (view order within the scope);
    ``groups``, ``labels``, ``confounders`` (n,) int codes; ``source`` names the scope in errors.
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


def _pinned():
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1)


# ----------------------------------------------------------------------------- worker tasks


def _sample_task(rows: ScopeRows, positions: np.ndarray) -> np.ndarray:
    with _pinned():
        return _read_scope_rows(rows.cache_root, rows.encoder, rows.tileset, rows.tile_rows[positions],
                                positions, rows.source)


def _chunk_task(rows: ScopeRows, start: int, stop: int, centroids: np.ndarray, path: str):
    """Read, check, normalise and assign scope positions ``start:stop``; write them sorted by
    cluster to ``path``. Returns ``(positions in file order (int64), cluster bounds (C+1,))``."""
    with _pinned():
        pos = np.arange(start, stop, dtype=np.int64)
        u = _read_scope_rows(rows.cache_root, rows.encoder, rows.tileset, rows.tile_rows[start:stop], pos,
                             rows.source)
        cl = assign_clusters(u, centroids)
        order = np.argsort(cl, kind="stable")
        bounds = np.searchsorted(cl[order], np.arange(centroids.shape[0] + 1)).astype(np.int64)
        atomic_write(Path(path), lambda fh: np.save(fh, np.ascontiguousarray(u[order])))
        return pos[order], bounds


@dataclass(frozen=True)
class _Layout:
    """The partition as tasks see it: chunk files, per-chunk cluster bounds, file-order positions,
    and every row's codes. ``order_pos`` (n,) lists scope positions in (chunk, file row) order;
    ``chunk_start[j]`` is chunk ``j``'s first entry in it."""

    paths: tuple
    header: tuple  # per chunk: byte offset of the data
    dim: int
    dtype: str
    bounds: np.ndarray  # (J, C+1) int64
    chunk_start: np.ndarray  # (J+1,) int64
    order_pos: np.ndarray  # (n,) int64
    cluster: np.ndarray  # (n,) int32 by scope position
    codes: np.ndarray  # (3, n) int64: groups, labels, confounders by scope position
    n_conf: int  # cell code of a row: label * n_conf + confounder

    def read_clusters(self, clusters) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``clusters`` from every chunk: (vectors (r, d), scope positions (r,))."""
        clusters = np.asarray(clusters, dtype=np.int64)
        vecs, pos = [], []
        for j, path in enumerate(self.paths):
            b = self.bounds[j]
            runs = [(int(b[c]), int(b[c + 1])) for c in clusters if b[c + 1] > b[c]]
            if not runs:
                continue
            vecs.append(_read_row_runs(path, runs, self.dim, np.dtype(self.dtype), self.header[j]))
            base = int(self.chunk_start[j])
            pos.append(np.concatenate([self.order_pos[base + a : base + e] for a, e in runs]))
        if not vecs:
            return np.empty((0, self.dim), dtype=np.dtype(self.dtype)), np.empty(0, dtype=np.int64)
        return np.concatenate(vecs), np.concatenate(pos)

    def read_positions(self, positions) -> np.ndarray:
        """Vectors of the given scope positions (small samples), in the given order."""
        positions = np.asarray(positions, dtype=np.int64)
        where = np.empty(self.order_pos.size, dtype=np.int64)
        where[self.order_pos] = np.arange(self.order_pos.size)
        at = where[positions]
        out = np.empty((positions.size, self.dim), dtype=np.dtype(self.dtype))
        chunk = np.searchsorted(self.chunk_start, at, side="right") - 1
        for j in np.unique(chunk):
            sel = np.flatnonzero(chunk == j)
            local = at[sel] - self.chunk_start[j]
            srt = np.argsort(local)
            runs = [(int(r), int(r) + 1) for r in local[srt]]
            out[sel[srt]] = _read_row_runs(self.paths[j], runs, self.dim, np.dtype(self.dtype), self.header[j])
        return out


def _meta(codes: np.ndarray, pos: np.ndarray) -> tuple:
    return codes[0][pos], codes[1][pos], codes[2][pos]


def _brute_task(layout: _Layout, j: int, qv: np.ndarray, qpos: np.ndarray, kinds: tuple, k: int) -> dict:
    """Exact top-k of each kind for the sample queries over chunk ``j`` (all its rows)."""
    with _pinned():
        n_rows = int(layout.chunk_start[j + 1] - layout.chunk_start[j])
        tv = _read_row_runs(layout.paths[j], [(0, n_rows)], layout.dim, np.dtype(layout.dtype), layout.header[j])
        tpos = layout.order_pos[layout.chunk_start[j] : layout.chunk_start[j + 1]]
        out = {kind: (np.full((qpos.size, k), -1, np.int64), np.full((qpos.size, k), np.inf)) for kind in kinds}
        _Targets(layout, tv, tpos).search(qv, _meta(layout.codes, qpos), np.arange(qpos.size), k, out, None)
        return out


def _search_task(layout: _Layout, batch: dict, kinds: tuple, k: int, path: str) -> int:
    """Search the query clusters of ``batch`` and write a part file; returns its query count.

    ``batch`` maps a query cluster ``a`` to its probe plan: ``{"cross": probed clusters}``, or for
    the typed kinds ``{"cells": {target cell: probed clusters}}`` (cell code ``label * n_conf +
    confounder``). Targets are read in pieces of at most :data:`PIECE_ROWS` rows (whole clusters)
    and searched by :meth:`_Targets.search`.
    """
    with _pinned():
        q_clusters = sorted(batch)
        qv, qpos = layout.read_clusters(q_clusters)
        qcl = layout.cluster[qpos]
        q_meta = _meta(layout.codes, qpos)
        res = {kind: (np.full((qpos.size, k), -1, np.int64), np.full((qpos.size, k), np.inf)) for kind in kinds}
        needed = sorted({int(c) for a in q_clusters for c in _plan_clusters(batch[a])})
        # targets in pieces of at most PIECE_ROWS rows (whole clusters)
        sizes = layout.bounds[:, 1:].sum(axis=0) - layout.bounds[:, :-1].sum(axis=0)
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
            target = _Targets(layout, *layout.read_clusters(piece))
            for a in q_clusters:
                target.search(qv, q_meta, np.flatnonzero(qcl == a), k, res, batch[a])
        arrays = {"pos": qpos}
        for kind in kinds:
            arrays[f"{kind}_idx"], arrays[f"{kind}_dist"] = res[kind]
        _atomic_save_npz(Path(path), **arrays)
        return int(qpos.size)


class _Targets:
    """One piece of target rows (vectors, scope positions, codes), sorted by (cell, cluster).

    A target cell is then one contiguous slice, read by the kernel without a copy when all its
    clusters are probed. The typed search runs per target cell, separately for the queries it
    serves as SO pool (same label, other confounder) and as OS pool (other label, same
    confounder): each pair is computed once, and only the group rule remains to be masked.
    """

    def __init__(self, layout: _Layout, tv: np.ndarray, tpos: np.ndarray):
        self.n_conf = layout.n_conf
        groups, labels, confs = _meta(layout.codes, tpos)
        cell = labels * self.n_conf + confs
        srt = np.lexsort((layout.cluster[tpos], cell))
        self.tv, self.tpos, cell = tv[srt], tpos[srt], cell[srt]
        self.t_meta = (groups[srt], labels[srt], confs[srt])
        self.cluster = layout.cluster[self.tpos]
        cells = np.unique(cell)
        lo, hi = np.searchsorted(cell, cells), np.searchsorted(cell, cells, side="right")
        self.span = {int(c): (int(a), int(b)) for c, a, b in zip(cells, lo, hi)}

    def select(self, lo: int, hi: int, clusters) -> slice | np.ndarray:
        """Rows ``lo:hi`` whose cluster is in ``clusters`` (None = all): a slice when all are."""
        if clusters is None:
            return slice(lo, hi)
        keep = np.isin(self.cluster[lo:hi], clusters)
        return slice(lo, hi) if keep.all() else lo + np.flatnonzero(keep)

    def search(self, qv, q_meta, qsel, k, res: dict, plan: dict | None) -> None:
        """Merge the top-k of queries ``qsel`` over this piece into ``res`` (kind -> (idx, dist)
        of all queries), probing what ``plan`` allows (see :func:`_search_task`; None = all)."""
        if "cross" in res:
            clusters = None if plan is None else plan["cross"]
            self._run(qv, q_meta, qsel, self.select(0, self.tpos.size, clusters), k, res["cross"])
            return
        ql, qc = q_meta[1][qsel], q_meta[2][qsel]
        for tc, (lo, hi) in self.span.items():
            if plan is not None and tc not in plan["cells"]:
                continue
            tsel = self.select(lo, hi, None if plan is None else plan["cells"][tc])
            tl, tcf = divmod(tc, self.n_conf)
            self._run(qv, q_meta, qsel[(ql == tl) & (qc != tcf)], tsel, k, res["so"])
            self._run(qv, q_meta, qsel[(ql != tl) & (qc == tcf)], tsel, k, res["os"])

    def _run(self, qv, q_meta, qsel, tsel, k, table) -> None:
        if qsel.size == 0 or (isinstance(tsel, np.ndarray) and tsel.size == 0) or (
                isinstance(tsel, slice) and tsel.stop <= tsel.start):
            return
        bi, bd = table
        sub_i, sub_d = bi[qsel], bd[qsel]
        # the targets are this query set's pool (one cell, or the probed scope): only groups mask
        topk_tiles(qv[qsel], q_meta[0][qsel], self.tv[tsel], self.tpos[tsel], self.t_meta[0][tsel], k, sub_i, sub_d)
        bi[qsel], bd[qsel] = sub_i, sub_d


def _plan_clusters(plan: dict):
    if "cross" in plan:
        yield from plan["cross"]
    else:
        for clus in plan["cells"].values():
            yield from clus


# ----------------------------------------------------------------------------- driver


class LargeScopeSearch:
    """Neighbour backend for the metrics that searches scopes out of core on ``client``'s workers.

    Parameters
    ----------
    client : distributed.Client
        Usually ``distributed.worker_client()`` of the unit's task.
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

    def _partition(self, key, rows: ScopeRows) -> _Layout:
        folder = self.scratch / str(key) / "partition"
        with self._lock(f"{key}-partition"):
            if not (folder / "done.json").is_file():
                self._build_partition(folder, rows)
        meta = json.loads((folder / "done.json").read_text())
        z = _load_npz(folder / "layout.npz")
        paths = tuple(str(folder / f) for f in meta["files"])
        headers = tuple(_npy_header(p)[0] for p in paths)
        cluster = np.empty(rows.n, dtype=np.int32)
        for j in range(len(paths)):
            s, e = z["chunk_start"][j], z["chunk_start"][j + 1]
            b = z["bounds"][j]
            cluster[z["order_pos"][s:e]] = np.repeat(np.arange(b.size - 1, dtype=np.int32), np.diff(b))
        codes = np.stack([np.asarray(a, dtype=np.int64) for a in (rows.groups, rows.labels, rows.confounders)])
        return _Layout(paths=paths, header=headers, dim=int(meta["dim"]), dtype=meta["dtype"], bounds=z["bounds"],
                       chunk_start=z["chunk_start"], order_pos=z["order_pos"], cluster=cluster, codes=codes,
                       n_conf=int(codes[2].max()) + 1 if rows.n else 1)

    def _build_partition(self, folder: Path, rows: ScopeRows) -> None:
        from ..cache import Cache

        t0 = time.perf_counter()
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        meta = Cache(rows.cache_root).meta(rows.encoder, rows.tileset)
        n, dim = rows.n, int(meta.dim)
        c = max(1, math.ceil(n / ROWS_PER_CLUSTER))
        rng = np.random.default_rng([self.seed, 17])
        sample = np.sort(rng.choice(n, size=min(n, KMEANS_MAX_SAMPLE, max(KMEANS_MIN_SAMPLE, 48 * c)), replace=False))
        rows_f = self.client.scatter(rows, broadcast=True, hash=False)
        x = self.client.submit(_sample_task, rows_f, sample, pure=False).result()
        centroids = spherical_kmeans(x, c, random_state=rng)
        del x
        step = max(1, CHUNK_BYTES // (dim * 4))
        bounds = list(range(0, n, step))
        cent_f = self.client.scatter(centroids, broadcast=True, hash=False)
        files = [f"chunk-{j:05d}.npy" for j in range(len(bounds))]
        futures = [self.client.submit(_chunk_task, rows_f, s, min(n, s + step), cent_f, str(folder / f), pure=False)
                   for s, f in zip(bounds, files)]
        parts = _gather_or_cancel(self.client, futures)
        order_pos = np.concatenate([p[0] for p in parts])
        chunk_start = np.concatenate([[0], np.cumsum([p[0].size for p in parts])]).astype(np.int64)
        _atomic_save_npz(folder / "layout.npz", order_pos=order_pos, chunk_start=chunk_start,
                         bounds=np.stack([p[1] for p in parts]), centroids=centroids)
        atomic_write_json(folder / "done.json", {"files": files, "dim": dim, "dtype": compute_dtype(meta.dtype).name, "n": n, "clusters": int(c),
                                            "seconds": round(time.perf_counter() - t0, 3)})

    def _tables(self, key, rows: ScopeRows, kinds: tuple, k: int) -> dict:
        name = f"{'-'.join(kinds)}-{k}-{'exact' if self.exact else f'ann{self.target:g}-{self.n_recall_queries}'}"
        folder = self.scratch / str(key) / name
        with self._lock(f"{key}-{name}"):
            if not (folder / "done.json").is_file():
                layout = self._partition(key, rows)
                self._search(folder, layout, kinds, k)
        info = json.loads((folder / "done.json").read_text())
        part = json.loads((self.scratch / str(key) / "partition" / "done.json").read_text())
        self.details.append(dict(info, scope=str(key), kinds=list(kinds), k=k,
                                 seconds_partition=part["seconds"], n_chunks=len(part["files"])))
        out = {}
        for kind in kinds:
            for what in ("idx", "dist"):
                out[f"{kind}_{what}"] = np.load(folder / f"{kind}_{what}.npy", mmap_mode="r")
        return out

    def _search(self, folder: Path, layout: _Layout, kinds: tuple, k: int) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        n = layout.order_pos.size
        c = layout.bounds.shape[1] - 1
        sizes = layout.bounds[:, 1:].sum(axis=0) - layout.bounds[:, :-1].sum(axis=0)
        with np.load(folder.parent / "partition" / "layout.npz", allow_pickle=False) as z:
            order = probe_order(z["centroids"])
        cell = layout.codes[1] * layout.n_conf + layout.codes[2]
        cells = np.unique(cell)
        cell_sizes = {int(t): np.bincount(layout.cluster[cell == t], minlength=c) for t in cells}
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
            level, truth, audit = self._calibrate(layout, layout_f, kinds, k, order, stops, cell, tol)
        t_cal = time.perf_counter() - t0
        rounds = 0
        while True:
            frac = FRACTIONS[level]
            self._run_search(folder, layout, layout_f, kinds, k, order, sizes, cell_sizes, stops, level)
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

    def _calibrate(self, layout, layout_f, kinds, k, order, stops, cell, tol):
        """Exact answers for the calibration and audit samples (one brute task per chunk), and the
        calibrated starting level. Returns ``(level, audit truth per kind, audit positions)``."""
        n = layout.order_pos.size
        rng_a = np.random.default_rng([self.seed, 1])
        rng_c = np.random.default_rng([self.seed, 2])
        audit = np.sort(rng_a.choice(n, size=min(n, self.n_recall_queries), replace=False))
        calib = np.sort(rng_c.choice(n, size=min(n, max(CALIBRATION_QUERIES, 2 * self.n_recall_queries)), replace=False))
        qpos = np.concatenate([calib, audit])
        qv = layout.read_positions(qpos)
        qv_f = self.client.scatter(qv, hash=False, broadcast=True)
        futures = [self.client.submit(_brute_task, layout_f, j, qv_f, qpos, kinds, k, pure=False)
                   for j in range(len(layout.paths))]
        merged = None
        for part in _gather_or_cancel(self.client, futures):
            merged = part if merged is None else {kd: _merge(merged[kd], part[kd], k) for kd in kinds}
        nc = calib.size
        truth = {kd: (merged[kd][0][nc:], merged[kd][1][nc:]) for kd in kinds}
        levels, t_idx, t_dist = [], [], []
        qa = layout.cluster[calib][:, None]
        for kd in kinds:
            ti, td = merged[kd][0][:nc], merged[kd][1][:nc]
            x = np.maximum(ti, 0)
            if kd == "cross":
                lev = probe_levels(order, stops["cross"])[qa, layout.cluster[x]]
            else:
                lev = np.empty(ti.shape, dtype=np.int64)
                tcell = cell[x]
                for t in np.unique(tcell):
                    sel = tcell == t
                    lv = probe_levels(order, stops[int(t)])
                    lev[sel] = lv[np.broadcast_to(qa, ti.shape)[sel], layout.cluster[x][sel]]
            levels.append(lev)
            t_idx.append(ti)
            t_dist.append(td)
        want = min(1.0, self.target + 0.5 * (1.0 - self.target))
        frac = _calibrate(levels, t_idx, t_dist, tol, want, FRACTIONS)
        return FRACTIONS.index(frac) if frac in FRACTIONS else len(FRACTIONS) - 1, truth, audit

    def _run_search(self, folder, layout, layout_f, kinds, k, order, sizes, cell_sizes, stops, level):
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
        n = layout.order_pos.size
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


