"""The driver of the out-of-core engine (:class:`LargeScopeSearch`): runs in the client process,
holds a unit's O(n) state and submits the bounded tasks of :mod:`.tasks`."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from distributed import Lock

from ..._taskkeys import task_key
from ..._atomic import atomic_write, atomic_write_json, partial_path
from ..base import scope_aware
from ..blocked import gather_or_cancel
from ..fetch import is_capped
from ..normalize import compute_dtype
from ..partition import (
    ProbeGeometry,
    ProbeRule,
    probe_chain,
    probe_distances,
    probe_ladder,
    probed_clusters,
    spherical_kmeans,
)
from ..recall import RecallTargetError, distance_tol, recall_counts
from ..topk import merge_tables
from . import (
    files as tunables,  # the engine's tunables, read at call time (tests patch them)
)
from .files import (
    Layout,
    ScopeFiles,
    ScopeRows,
    atomic_save_npz,
    load_npz,
    meta_name,
    npy_header,
    read_row_runs,
)
from .tasks import brute_task, chunk_task, sample_task, search_task


@dataclass(frozen=True)
class Partition:
    """The driver's view of a built partition: the tasks' :class:`Layout` plus the O(n) index
    (file-order positions, every row's cluster and codes) that only the driver holds."""

    layout: Layout
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
            out[sel[srt]] = read_row_runs(lay.paths[j], runs, lay.dim, np.dtype(lay.dtype), lay.header[j])
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
        a call names its scope by the ``scope=`` reference the metrics pass (:attr:`ScopeRows.name`;
        see :meth:`_scope_for`).
    scratch : path
        This unit's scratch folder for the scope artefacts (see module docstring).
    exact : bool
        Probe every cluster (the ``exact`` backend); no sampling, recall 1.
    recall_target, n_recall_queries, random_state, max_rounds
        As :func:`cachescore.neighbors.ann.cross_group_knn_ann_with_recall`.

    Calls: ``search.cross(u, groups, kmax, scope=name) -> (idx, dist)`` and
    ``search.typed(u, labels, confounders, groups, m, scope=name) -> (so_dist, os_dist)`` honour
    the exact engines' contracts (``u`` is ignored: rows come from the cache; both are
    :func:`~cachescore.neighbors.base.scope_aware`, so the metrics pass the scope's name); tables
    are memory-mapped. Built by :func:`cachescore.neighbors.registry.searcher_for`.
    :attr:`recall` is the worst measured recall of all calls, :attr:`details` one dict per call.
    """

    def __init__(self, client, scopes: dict, scratch, *, exact=False, recall_target=0.99, n_recall_queries=1000,
                 random_state=0, max_rounds=4):
        self.client, self.scopes, self.scratch = client, dict(scopes), Path(scratch)
        self.exact, self.target = bool(exact), float(recall_target)
        self.n_recall_queries, self.seed, self.max_rounds = int(n_recall_queries), int(random_state), int(max_rounds)
        self.details: list[dict] = []
        self._by_name = {rows.name: key for key, rows in self.scopes.items() if rows.name is not None}

    @property
    def recall(self) -> float:
        vals = [d["recall"] for d in self.details]
        return min(vals) if vals else float("nan")

    # -- the metric-facing callables ------------------------------------------------------------
    @scope_aware
    def cross(self, u, groups, kmax, *, scope=None):
        key, rows = self._scope_for(scope, groups)
        if is_capped(int(kmax), rows.n, int(np.bincount(rows.groups).max())):
            # the cap rule needs every row's farthest scope row (windows.ScopeTable.far_is_cross),
            # which this engine does not compute: such a scope is tiny, score it in memory instead
            raise ValueError(
                f"{rows.source}: {rows.n} rows are within the reference's fetch cap for k = {int(kmax)} "
                "(n <= k + max(64, largest group) + 1), which the out-of-core engine does not reproduce; raise "
                "[neighbors] large_scope_rows above this view's scope sizes or use smaller k candidates")
        t = self._tables(key, rows, ("cross",), int(kmax))
        return t["cross_idx"], t["cross_dist"]

    @scope_aware
    def typed(self, u, labels, confounders, groups, m, *, scope=None):
        key, rows = self._scope_for(scope, groups)
        t = self._tables(key, rows, ("so", "os"), int(m))
        return t["so_dist"], t["os_dist"]

    def _scope_for(self, scope, groups):
        """``(key, rows)`` of the scope a metric's call names (``scope``: its
        :attr:`ScopeRows.name`; None is the only scope of a one-scope engine). Raises
        ``LookupError`` for a name it does not hold (or None with several scopes) and
        ``ValueError`` when the call's ``groups`` do not have the scope's row count."""
        if scope is None and len(self.scopes) == 1:
            key = next(iter(self.scopes))
        elif scope is not None and scope in self._by_name:
            key = self._by_name[scope]
        else:
            raise LookupError(f"no large scope named {scope!r} (holds: {sorted(map(str, self._by_name))}); "
                              "the metrics name each scope they search (scope=)")
        rows = self.scopes[key]
        if np.asarray(groups).size != rows.n:
            raise ValueError(f"{rows.source}: the call passes {np.asarray(groups).size} rows' codes, the scope has {rows.n}")
        return key, rows

    # -- artefacts --------------------------------------------------------------------------------
    def _lock(self, name):
        return Lock(f"cachescore-large-{self.scratch}-{name}", scheduler_rpc=self.client.scheduler, loop=self.client.loop)

    def _partition(self, key, rows: ScopeRows) -> Partition:
        folder = self.scratch / str(key) / "partition"
        with self._lock(f"{key}-partition"):
            if not (folder / "done.json").is_file():
                self._build_partition(folder, rows)
        meta = json.loads((folder / "done.json").read_text())
        z = load_npz(folder / "layout.npz")
        paths = tuple(str(folder / f) for f in meta["files"])
        meta_paths = tuple(str(folder / meta_name(f)) for f in meta["files"])
        cluster = np.empty(rows.n, dtype=np.int32)
        for j in range(len(paths)):
            s, e = z["chunk_start"][j], z["chunk_start"][j + 1]
            b = z["bounds"][j]
            cluster[z["order_pos"][s:e]] = np.repeat(np.arange(b.size - 1, dtype=np.int32), np.diff(b))
        codes = np.stack([np.asarray(a, dtype=np.int64) for a in (rows.groups, rows.labels, rows.confounders)])
        layout = Layout(paths=paths, meta_paths=meta_paths, header=tuple(npy_header(p)[0] for p in paths),
                         meta_header=tuple(npy_header(p)[0] for p in meta_paths), dim=int(meta["dim"]),
                         dtype=meta["dtype"], bounds=z["bounds"], n_conf=int(codes[2].max()) + 1 if rows.n else 1)
        return Partition(layout=layout, order_pos=z["order_pos"], chunk_start=z["chunk_start"], cluster=cluster,
                          codes=codes)

    def _build_partition(self, folder: Path, rows: ScopeRows) -> None:
        t0 = time.perf_counter()
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        meta = rows.embeddings.meta()
        n, dim = rows.n, int(meta.dim)
        index = np.stack([rows.tile_rows, rows.groups, rows.labels, rows.confounders], axis=1).astype(np.int64)
        atomic_write(folder / "rows.npy", lambda fh: np.save(fh, index))
        del index
        files = ScopeFiles(embeddings=rows.embeddings, source=rows.source, rows_path=str(folder / "rows.npy"))
        c = max(1, math.ceil(n / tunables.ROWS_PER_CLUSTER))
        rng = np.random.default_rng([self.seed, 17])
        sample = np.sort(rng.choice(n, size=min(n, tunables.KMEANS_MAX_SAMPLE, max(tunables.KMEANS_MIN_SAMPLE, 48 * c)), replace=False))
        x = self.client.submit(sample_task, files, sample, rows.tile_rows[sample], pure=False,
                               key=task_key("partition", "sample")).result()
        centroids = spherical_kmeans(x, c, random_state=rng)
        del x
        step = max(1, tunables.CHUNK_BYTES // (dim * 4))
        bounds = list(range(0, n, step))
        cent_f = self.client.scatter(centroids, broadcast=True, hash=False)
        names = [f"chunk-{j:05d}.npy" for j in range(len(bounds))]
        futures = [self.client.submit(chunk_task, files, s, min(n, s + step), cent_f, str(folder / f),
                                      str(folder / meta_name(f)), pure=False, key=task_key("partition", f[:-4]))
                   for s, f in zip(bounds, names)]
        parts = gather_or_cancel(self.client, futures)
        order_pos = np.concatenate([p[0] for p in parts])
        chunk_start = np.concatenate([[0], np.cumsum([p[0].size for p in parts])]).astype(np.int64)
        atomic_save_npz(folder / "layout.npz", order_pos=order_pos, chunk_start=chunk_start,
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

    def _search(self, folder: Path, part: Partition, kinds: tuple, k: int) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        layout = part.layout
        n = part.n
        c = layout.bounds.shape[1] - 1
        with np.load(folder.parent / "partition" / "layout.npz", allow_pickle=False) as z:
            geometry = ProbeGeometry(probe_distances(z["centroids"]))
        pools = self._pools(part, kinds)
        layout_f = self.client.scatter(layout, broadcast=True, hash=False)
        tol = distance_tol(np.dtype(layout.dtype), layout.dim)
        floor = k + int(np.bincount(part.codes[0]).max())  # >= k other-group candidates per query
        t0 = time.perf_counter()
        if self.exact:
            ladder, truth, audit = (ProbeRule(float("inf"), floor),), None, None
        else:
            ladder, truth, audit = self._calibrate(part, layout_f, kinds, k, geometry, pools, floor, tol)
        t_cal = time.perf_counter() - t0
        rounds = 0
        while True:
            rule = ladder[rounds]
            frac, stats = self._run_search(folder, n, layout_f, kinds, k, geometry, layout.sizes, pools, rule)
            if truth is None:
                recall, n_audit = 1.0, 0
            else:
                hits = total = 0
                for kind in kinds:
                    found = np.load(folder / f"{kind}_dist.npy", mmap_mode="r")[audit]
                    h, t = recall_counts(np.asarray(found), truth[kind][1], tol)
                    hits, total = hits + h, total + t
                recall, n_audit = (1.0 if total == 0 else hits / total), int(audit.size)
            if recall >= self.target or rule.exact:
                break
            if rounds >= self.max_rounds:
                raise RecallTargetError.after_rounds(f"large-scope ANN search ({'/'.join(kinds)}, k={k})", recall,
                                                     self.target, n_audit, rounds,
                                                     f"n={n}, probe radius {rule.radius:.4g} with at least "
                                                     f"{rule.min_rows} rows, probe fraction {frac:.4g}")
            rounds += 1
        atomic_write_json(folder / "done.json", {"recall": float(recall), "n_recall_queries": n_audit, "rounds": rounds,
                                            "probe_fraction": float(frac),
                                            # null when not finite: -inf (own clusters + floor) or exact
                                            "probe_radius": float(rule.radius) if math.isfinite(rule.radius) else None,
                                            "probe_min_rows": int(rule.min_rows),
                                            "n_clusters": int(c), "exact": bool(rule.exact), "n": int(n),
                                            **stats,
                                            "seconds_calibration": round(t_cal, 3),
                                            "seconds_search": round(time.perf_counter() - t0 - t_cal, 3)})

    @staticmethod
    def _pools(part: Partition, kinds: tuple) -> dict:
        """The pools a search probes: ``{pool: (query weights (C,), pool rows (C,))}``; the weight
        of cluster ``a`` counts its queries that search the pool. Cross-group: one pool, every row.
        Typed: one pool per target cell ``t = label * n_conf + confounder``, searched as SO pool by
        the queries of the same label and another confounder and as OS pool by those of another
        label and the same confounder."""
        layout = part.layout
        c = layout.bounds.shape[1] - 1
        sizes = layout.sizes
        if "cross" in kinds:
            return {"cross": (sizes, sizes)}
        nc = layout.n_conf
        cell = part.codes[1] * nc + part.codes[2]
        present = np.unique(cell)
        cell_sizes = {int(t): np.bincount(part.cluster[cell == t], minlength=c) for t in present}
        pools = {}
        for t, sz in cell_sizes.items():
            tl, tc = divmod(t, nc)
            users = np.zeros(c, dtype=np.int64)
            for q, cs in cell_sizes.items():
                if (q // nc == tl) != (q % nc == tc):  # SO: same label, other confounder; OS: the reverse
                    users += cs
            pools[t] = (users, sz)
        return pools

    def _calibrate(self, part: Partition, layout_f, kinds, k, geometry, pools, floor, tol):
        """Exact answers for the calibration and audit samples (one brute task per chunk, both
        samples in one pass), and the probe rules to try (:func:`probe_ladder`). Returns
        ``(rules, audit truth per kind, audit positions)``."""
        n = part.n
        rng_a = np.random.default_rng([self.seed, 1])
        rng_c = np.random.default_rng([self.seed, 2])
        audit = np.sort(rng_a.choice(n, size=min(n, self.n_recall_queries), replace=False))
        calib = np.sort(rng_c.choice(n, size=min(n, max(tunables.CALIBRATION_QUERIES, 2 * self.n_recall_queries)), replace=False))
        qpos = np.concatenate([calib, audit])
        qv = part.read_positions(qpos)
        qv_f = self.client.scatter(qv, hash=False, broadcast=True)
        q_codes = np.ascontiguousarray(part.codes[:, qpos].T)
        futures = [self.client.submit(brute_task, layout_f, j, qv_f, q_codes, kinds, k, pure=False,
                                      key=task_key("calibrate", f"chunk{j:05d}"))
                   for j in range(len(part.layout.paths))]
        merged = None
        for found in gather_or_cancel(self.client, futures):
            merged = found if merged is None else {kd: merge_tables(merged[kd], found[kd], k) for kd in kinds}
        nc = calib.size
        truth = {kd: (merged[kd][0][nc:], merged[kd][1][nc:]) for kd in kinds}
        qa = part.cluster[calib]
        found_in = {pool: ([], []) for pool in pools}  # pool -> (query clusters, neighbour clusters)
        cell = part.codes[1] * part.layout.n_conf + part.codes[2]
        for kd in kinds:
            ti, td = merged[kd][0][:nc], merged[kd][1][:nc]
            r, j = np.nonzero((ti >= 0) & np.isfinite(td))
            nb = ti[r, j]
            pool_of = np.zeros(nb.size, np.int64) if "cross" in pools else cell[nb]
            for pool in pools:
                sel = np.ones(nb.size, bool) if pool == "cross" else pool_of == pool
                found_in[pool][0].append(qa[r[sel]])
                found_in[pool][1].append(part.cluster[nb[sel]])
        calib_pools = [(w, sz, np.concatenate(found_in[pool][0]), np.concatenate(found_in[pool][1]))
                       for pool, (w, sz) in pools.items()]
        want = min(1.0, self.target + 0.5 * (1.0 - self.target))
        return probe_ladder(geometry, calib_pools, want, floor), truth, audit

    def _run_search(self, folder, n, layout_f, kinds, k, geometry, sizes, pools, rule) -> tuple[float, dict]:
        """One search under ``rule`` in every pool; writes the tables. Returns the probe fraction
        (the (query, target) pairs the search computed over those an exact search computes) and
        ``{"search_pairs", "search_task_seconds"}`` (the tasks' wall time, summed)."""
        plans, pairs = {}, 0
        for a in probe_chain(geometry.dist):
            if sizes[a] == 0:
                continue
            probed = {pool: probed_clusters(geometry.dist[a], sz, rule.radius, rule.min_rows)
                      for pool, (_, sz) in pools.items()}
            pairs += sum(int(pools[pool][0][a]) * int(pools[pool][1][cl].sum()) for pool, cl in probed.items())
            plans[int(a)] = {"cross": probed["cross"]} if "cross" in pools else {"cells": probed}
        exact_pairs = sum(int(w.sum()) * int(sz.sum()) for w, sz in pools.values())
        batches, cur, cur_rows = [], {}, 0
        for a, plan in plans.items():  # in chain order: a batch's clusters are close together
            if cur and cur_rows + sizes[a] > tunables.BATCH_ROWS:
                batches.append(cur)
                cur, cur_rows = {}, 0
            cur[a] = plan
            cur_rows += int(sizes[a])
        if cur:
            batches.append(cur)
        parts_dir = folder / "parts"
        shutil.rmtree(parts_dir, ignore_errors=True)
        parts_dir.mkdir()
        futures = []
        for i, b in enumerate(batches):
            futures.append(self.client.submit(search_task, layout_f, b, kinds, k, str(parts_dir / f"part-{i:05d}.npz"),
                                              pure=False, key=task_key("search", f"batch{i:05d}")))
        done = gather_or_cancel(self.client, futures)
        covered = sum(q for q, _ in done)
        if covered != n:
            raise RuntimeError(f"large-scope search covered {covered} of {n} rows")
        stats = {"search_pairs": int(pairs), "search_task_seconds": round(sum(t for _, t in done), 3)}
        tables = {}
        for kind in kinds:
            for what, dt in (("idx", np.int64), ("dist", np.float64)):
                tables[(kind, what)] = np.lib.format.open_memmap(partial_path(folder / f"{kind}_{what}.npy"),
                                                                 mode="w+", dtype=dt, shape=(n, k))
        for i in range(len(batches)):
            part = load_npz(parts_dir / f"part-{i:05d}.npz")
            for kind in kinds:
                tables[(kind, "idx")][part["pos"]] = part[f"{kind}_idx"]
                tables[(kind, "dist")][part["pos"]] = part[f"{kind}_dist"]
        for (kind, what), mm in tables.items():
            mm.flush()
            os.replace(mm.filename, folder / f"{kind}_{what}.npy")
        del tables, mm
        shutil.rmtree(parts_dir, ignore_errors=True)
        return (pairs / exact_pairs if exact_pairs else 1.0), stats



