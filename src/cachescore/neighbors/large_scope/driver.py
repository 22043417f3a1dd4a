"""The driver of the out-of-core engine (:class:`LargeScopeSearch`): runs in the client process and
submits the bounded tasks of :mod:`.tasks`; it holds O(chunks × clusters) state, nothing per row."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from distributed import Lock, as_completed

from ..._taskkeys import task_key
from ..._atomic import atomic_write_json
from ..base import scope_aware
from ..._futures import gather_or_cancel, paced
from ..fetch import is_capped
from ..normalize import compute_dtype
from ..partition import (
    ProbeGeometry,
    ProbeRule,
    probe_chain,
    probe_ladder,
    probed_clusters,
)
from ..recall import RecallTargetError, distance_tol, recall_counts
from ..topk import merge_tables
from . import (
    files as tunables,  # the engine's tunables, read at call time (tests patch them)
)
from .files import (
    Layout,
    ScopeRef,
    atomic_save_npz,
    cluster_name,
    create_table,
    load_npz,
    meta_name,
    npy_header,
    read_rows_at,
)
from .tasks import brute_task, centroid_task, chunk_task, position_task, search_task


@dataclass(frozen=True)
class Partition:
    """The driver's view of a built partition: the tasks' :class:`Layout`, the chunk length
    ``step`` (chunk ``j`` holds scope rows ``j * step .. (j + 1) * step``), each chunk's cluster-id
    file (scope order) and the rows per (cell, cluster). O(chunks × clusters × cells), nothing per
    row: the driver reads the few rows it needs (calibration samples) from the files."""

    layout: Layout
    step: int
    cluster_paths: tuple
    cell_sizes: np.ndarray  # (cells, C) int64, cell = label * n_conf + confounder
    n: int

    def clusters_at(self, positions) -> np.ndarray:
        """Cluster ids of the scope ``positions`` (a bounded sample), int64."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty(positions.size, dtype=np.int64)
        chunk = positions // self.step
        for j in np.unique(chunk).tolist():
            sel = np.flatnonzero(chunk == j)
            out[sel] = read_rows_at(self.cluster_paths[j], positions[sel] - j * self.step, 1, np.int32)[:, 0]
        return out


# ----------------------------------------------------------------------------- driver


def _filling(folder: Path, kind: str, what: str) -> Path:
    """A table while its search tasks fill it (renamed to ``<kind>_<what>.npy`` once the recall
    is met; the folder is the artefact's own, under its lock, and emptied before a search)."""
    return folder / f".{kind}_{what}.npy.filling"


class LargeScopeSearch:
    """Neighbour backend for the metrics that searches scopes out of core on ``client``'s workers.

    Parameters
    ----------
    client : distributed.Client
        The run's client (the unit is driven from the client process).
    scopes : dict
        ``{key: ScopeRef or ScopeRows}`` for each scope the metric will ask for, in the metric's
        scope order; a call names its scope by the ``scope=`` reference the metrics pass
        (``name``; see :meth:`_scope_for`). A :class:`ScopeRows` (arrays in memory, the API's
        form) is written to the scratch folder on first use; the pipeline passes
        :class:`ScopeRef` objects whose ``rows.npy`` a worker wrote, so the driver holds nothing per row.
    scratch : path
        This unit's scratch folder for the scope artefacts (see module docstring).
    exact : bool
        Probe every cluster (the ``exact`` backend); no sampling, recall 1.
    recall_target, n_recall_queries, random_state, max_rounds
        As :func:`cachescore.neighbors.ann.cross_group_knn_ann_with_recall`.
    expected : callable, optional
        ``expected(ref) -> [(kinds, k)]``: the tables the job's units will ask of the scope
        ``ref`` (:attr:`cachescore.metrics.families.Family.tables`). A search of one of them also
        searches the others of the same scope that are not complete yet, the cross-group and the
        typed tables in one pass over the probed rows (ADR-0024). A hint: a table in it that
        nobody asks for costs time, never a value.
    gate : callable, optional
        Called (no arguments) before a partition is marked complete (its ``done.json``); it
        raises to keep the partition from being reused. The pipeline passes the wait for the
        embedding shards' checks, which run beside the k-means and the partition's chunk tasks
        (:func:`cachescore.pipeline.large_unit.large_scopes`).

    Calls: ``search.cross(u, groups, kmax, scope=name) -> (idx, dist)`` and
    ``search.typed(u, labels, confounders, groups, m, scope=name) -> (so_dist, os_dist)`` honour
    the exact engines' contracts (``u`` is ignored: rows come from the cache; both are
    :func:`~cachescore.neighbors.base.scope_aware`, so the metrics pass the scope's name); tables
    are memory-mapped. :meth:`table_files` gives the same tables as files, for reductions that
    run on the workers (:mod:`cachescore.metrics.large`). Built by
    :func:`cachescore.neighbors.registry.searcher_for`. :attr:`recall` is the worst measured
    recall of all calls, :attr:`details` one dict per call.
    """

    def __init__(self, client, scopes: dict, scratch, *, exact=False, recall_target=0.99, n_recall_queries=1000,
                 random_state=0, max_rounds=4, expected=None, gate=None):
        self.client, self.scopes, self.scratch = client, dict(scopes), Path(scratch)
        self.expected, self.gate = expected, gate
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
        key = self._scope_for(scope, groups)
        t = self._tables(key, ("cross",), int(kmax))
        return t["cross_idx"], t["cross_dist"]

    @scope_aware
    def typed(self, u, labels, confounders, groups, m, *, scope=None):
        key = self._scope_for(scope, groups)
        t = self._tables(key, ("so", "os"), int(m))
        return t["so_dist"], t["os_dist"]

    def table_files(self, scope, kinds: tuple, k: int) -> dict:
        """The scope's tables of ``kinds`` at ``k`` as files (searched on first use):
        ``{f"{kind}_{idx|dist}": path}`` of ``(n, k)`` ``.npy`` tables in scope order (int64 /
        float64, ``-1`` / ``+inf`` padded). Raises as :meth:`cross`."""
        key = self._scope_for(scope, None)
        if "cross" in kinds:
            self._check_cap(key, int(k))
        folder = self._ensure(key, tuple(kinds), int(k))
        return {f"{kind}_{what}": str(folder / f"{kind}_{what}.npy") for kind in kinds for what in ("idx", "dist")}

    def ref(self, scope) -> ScopeRef:
        """The :class:`ScopeRef` of the scope a metric names (``name``; None: the only one)."""
        return self._ref(self._scope_for(scope, None))

    def _scope_for(self, scope, groups):
        """The key of the scope a metric's call names (``scope``: its ``name``; None is the
        only scope of a one-scope engine). Raises ``LookupError`` for a name it does not hold
        (or None with several scopes) and ``ValueError`` when the call's ``groups`` (unless None)
        do not have the scope's row count."""
        if scope is None and len(self.scopes) == 1:
            key = next(iter(self.scopes))
        elif scope is not None and scope in self._by_name:
            key = self._by_name[scope]
        else:
            raise LookupError(f"no large scope named {scope!r} (holds: {sorted(map(str, self._by_name))}); "
                              "the metrics name each scope they search (scope=)")
        rows = self.scopes[key]
        if groups is not None and np.asarray(groups).size != rows.n:
            raise ValueError(f"{rows.source}: the call passes {np.asarray(groups).size} rows' codes, the scope has {rows.n}")
        return key

    def _check_cap(self, key, kmax: int) -> None:
        ref = self._ref(key)
        if is_capped(int(kmax), ref.n, ref.max_group):
            # the cap rule needs every row's farthest scope row (windows.ScopeTable.far_is_cross),
            # which this engine does not compute: such a scope is tiny, score it in memory instead
            raise ValueError(
                f"{ref.source}: {ref.n} rows are within the reference's fetch cap for k = {int(kmax)} "
                "(n <= k + max(64, largest group) + 1), which the out-of-core engine does not reproduce; raise "
                "[neighbors] large_scope_rows above this view's scope sizes or use smaller k candidates")

    def _ref(self, key) -> ScopeRef:
        rows = self.scopes[key]
        if isinstance(rows, ScopeRef):
            return rows
        folder = self.scratch / str(key)
        with self._lock(f"{key}-rows"):
            ref = rows.write(folder)
        self.scopes[key] = ref
        return ref

    # -- artefacts --------------------------------------------------------------------------------
    def _lock(self, name):
        return Lock(f"cachescore-large-{self.scratch}-{name}", scheduler_rpc=self.client.scheduler, loop=self.client.loop)

    def _partition(self, key) -> Partition:
        ref = self._ref(key)
        folder = self.scratch / str(key) / "partition"
        with self._lock(f"{key}-partition"):
            if not (folder / "done.json").is_file():
                self._build_partition(folder, ref)
        meta = json.loads((folder / "done.json").read_text())
        z = load_npz(folder / "layout.npz")
        paths = tuple(str(folder / f) for f in meta["files"])
        meta_paths = tuple(str(folder / meta_name(f)) for f in meta["files"])
        layout = Layout(paths=paths, meta_paths=meta_paths, header=tuple(npy_header(p)[0] for p in paths),
                         meta_header=tuple(npy_header(p)[0] for p in meta_paths), dim=int(meta["dim"]),
                         dtype=meta["dtype"], bounds=z["bounds"], n_conf=ref.n_conf)
        return Partition(layout=layout, step=int(meta["step"]), n=ref.n, cell_sizes=z["cell_sizes"],
                         cluster_paths=tuple(str(folder / cluster_name(f)) for f in meta["files"]))

    def _build_partition(self, folder: Path, ref: ScopeRef) -> None:
        t0 = time.perf_counter()
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        meta = ref.embeddings.meta()
        n, dim = ref.n, int(meta.dim)
        files = ref.files()
        c = max(1, math.ceil(n / tunables.ROWS_PER_CLUSTER))
        size = min(n, tunables.KMEANS_MAX_SAMPLE, max(tunables.KMEANS_MIN_SAMPLE, 48 * c))
        # before the shard checks queued beside it (priority 0): the k-means is the one task the
        # partition waits for, the checks only the partition's done.json (at 1M a free worker
        # took a 2.5-s check first while the other ran the last check: the k-means began 2.5 s late)
        centroids = self.client.submit(centroid_task, files, n, c, size, self.seed, pure=False, priority=1,
                                       key=task_key("partition", "centroids")).result()
        step = max(1, tunables.CHUNK_BYTES // (dim * 4))
        bounds = list(range(0, n, step))
        cent_f = self.client.scatter(centroids, broadcast=True, hash=False)
        names = [f"chunk-{j:05d}.npy" for j in range(len(bounds))]
        n_cells = ref.n_labels * ref.n_conf
        futures = [self.client.submit(chunk_task, files, s, min(n, s + step), cent_f, str(folder / f),
                                      str(folder / meta_name(f)), str(folder / cluster_name(f)), ref.n_conf, n_cells,
                                      pure=False, key=task_key("partition", f[:-4]))
                   for s, f in zip(bounds, names)]
        parts = gather_or_cancel(self.client, futures)
        cell_sizes = np.zeros((n_cells, c), dtype=np.int64)
        for _, counts in parts:
            cell_sizes += counts
        atomic_save_npz(folder / "layout.npz", bounds=np.stack([p[0] for p in parts]), cell_sizes=cell_sizes,
                        centroids=centroids)
        if self.gate is not None:
            self.gate()  # e.g. the shards' checks: a partition of rows that fail one is never reused
        atomic_write_json(folder / "done.json", {"files": names, "dim": dim, "dtype": compute_dtype(meta.dtype).name,
                                                 "n": n, "clusters": int(c), "step": int(step),
                                                 "seconds": round(time.perf_counter() - t0, 3)})

    def _folder(self, key, kinds: tuple, k: int) -> Path:
        name = f"{'-'.join(kinds)}-{k}-{'exact' if self.exact else f'ann{self.target:g}-{self.n_recall_queries}'}"
        return self.scratch / str(key) / name

    def _ensure(self, key, kinds: tuple, k: int) -> Path:
        """The folder of the scope's complete tables of ``kinds`` at ``k`` (searched if absent,
        together with the expected tables of the scope not searched yet, :meth:`_companions`);
        appends the call's details to :attr:`details`."""
        folder = self._folder(key, kinds, k)
        with self._lock(f"{key}-search"):  # one search of a scope at a time: it may fill several folders
            if not (folder / "done.json").is_file():
                self._search(key, [(tuple(kinds), int(k)), *self._companions(key, tuple(kinds), int(k))])
        info = json.loads((folder / "done.json").read_text())
        part = json.loads((self.scratch / str(key) / "partition" / "done.json").read_text())
        self.details.append(dict(info, scope=str(key), kinds=list(kinds), k=k,
                                 seconds_partition=part["seconds"], n_chunks=len(part["files"])))
        return folder

    def _companions(self, key, kinds: tuple, k: int) -> list:
        """The expected requests ``(kinds, k)`` of the scope to search with ``(kinds, k)``: not
        complete, no kind twice, and only the pair a search task computes together (the
        cross-group table with the typed ones)."""
        if self.expected is None:
            return []
        ref, taken, out = self._ref(key), set(kinds), []
        for other, kk in self.expected(ref):
            other, kk = tuple(other), int(kk)
            if set(other) & taken or set(other) not in ({"cross"}, {"so", "os"}):
                continue
            if "cross" in other and is_capped(kk, ref.n, ref.max_group):
                continue  # refused by the call itself (:meth:`_check_cap`)
            if (self._folder(key, other, kk) / "done.json").is_file():
                continue
            taken |= set(other)
            out.append((other, kk))
        return out

    def _tables(self, key, kinds: tuple, k: int) -> dict:
        if "cross" in kinds:
            self._check_cap(key, k)
        folder = self._ensure(key, kinds, k)
        return {f"{kind}_{what}": np.load(folder / f"{kind}_{what}.npy", mmap_mode="r")
                for kind in kinds for what in ("idx", "dist")}

    def _search(self, key, requests: list) -> None:
        """Search the scope's tables of every ``(kinds, k)`` of ``requests`` (the first is the
        call's own; the others its companions) and complete their folders. Each request has its
        own calibration, probe ladder and recall audit; the rounds of the requests still below
        their target run as one search (:meth:`_run_search`). A companion that misses its target
        after every round is left incomplete (its own call searches it again and raises)."""
        part, ref = self._partition(key), self._ref(key)
        layout = part.layout
        with np.load(self.scratch / str(key) / "partition" / "layout.npz", allow_pickle=False) as z:
            geometry = ProbeGeometry(z["centroids"])  # distances and probe orders a block at a time, never (C, C)
        layout_f = self.client.scatter(layout, broadcast=True, hash=False)
        tol = distance_tol(np.dtype(layout.dtype), layout.dim)
        t0 = time.perf_counter()
        samples = None if self.exact else self._exact_samples(part, layout_f, {kd: k for kinds, k in requests
                                                                               for kd in kinds}, ref)
        t_exact = time.perf_counter() - t0
        jobs = []
        for kinds, k in requests:
            folder = self._folder(key, kinds, k)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            pools = self._pools(part, kinds)
            floor = k + ref.max_group  # >= k other-group candidates per query
            t0 = time.perf_counter()
            if samples is None:
                ladder, truth, audit = (ProbeRule(float("inf"), floor),), None, None
            else:
                ladder, truth, audit = self._calibrate(part, kinds, geometry, pools, floor, ref, *samples)
            jobs.append(dict(folder=folder, kinds=kinds, k=k, pools=pools, ladder=ladder, truth=truth, audit=audit,
                             rounds=0, seconds_calibration=t_exact + time.perf_counter() - t0))
        active = list(jobs)
        while active:
            t0 = time.perf_counter()
            searched = self._run_search(part.n, layout_f, geometry, layout.sizes, active)
            seconds = time.perf_counter() - t0
            again = []
            for job, (frac, stats) in zip(active, searched):
                rule = job["ladder"][job["rounds"]]
                recall, n_audit = self._audit(job, tol)
                if recall >= self.target or rule.exact:
                    self._complete(job, part.n, layout, rule, recall, n_audit, frac, stats, seconds)
                elif job["rounds"] < self.max_rounds:
                    job["rounds"] += 1
                    job["seconds_search"] = job.get("seconds_search", 0.0) + seconds
                    again.append(job)
                elif job is jobs[0]:
                    raise RecallTargetError.after_rounds(
                        f"large-scope ANN search ({'/'.join(job['kinds'])}, k={job['k']})", recall, self.target,
                        n_audit, job["rounds"], f"n={part.n}, probe radius {rule.radius:.4g} with at least "
                        f"{rule.min_rows} rows, probe fraction {frac:.4g}")
            active = again

    @staticmethod
    def _audit(job: dict, tol: float) -> tuple[float, int]:
        """``(recall, audited queries)`` of a request's tables as its last round left them."""
        if job["truth"] is None:
            return 1.0, 0
        hits = total = 0
        for kind in job["kinds"]:
            found = read_rows_at(str(_filling(job["folder"], kind, "dist")), job["audit"], job["k"], np.float64)
            h, t = recall_counts(found, job["truth"][kind][1], tol)
            hits, total = hits + h, total + t
        return (1.0 if total == 0 else hits / total), int(job["audit"].size)

    @staticmethod
    def _complete(job: dict, n: int, layout: Layout, rule, recall, n_audit, frac, stats, seconds) -> None:
        """Rename a request's tables to their final names and write its ``done.json`` (last)."""
        folder = job["folder"]
        for kind in job["kinds"]:
            for what in ("idx", "dist"):
                os.replace(_filling(folder, kind, what), folder / f"{kind}_{what}.npy")
        atomic_write_json(folder / "done.json", {"recall": float(recall), "n_recall_queries": n_audit,
                                                 "rounds": job["rounds"], "probe_fraction": float(frac),
                                                 # null when not finite: -inf (own clusters + floor) or exact
                                                 "probe_radius": float(rule.radius) if math.isfinite(rule.radius) else None,
                                                 "probe_min_rows": int(rule.min_rows),
                                                 "n_clusters": int(layout.bounds.shape[1] - 1), "exact": bool(rule.exact),
                                                 "n": int(n), **stats,
                                                 "seconds_calibration": round(job["seconds_calibration"], 3),
                                                 "seconds_search": round(job.get("seconds_search", 0.0) + seconds, 3)})

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
        present = np.flatnonzero(part.cell_sizes.sum(axis=1) > 0)
        cell_sizes = {int(t): part.cell_sizes[t] for t in present}
        pools = {}
        for t, sz in cell_sizes.items():
            tl, tc = divmod(t, nc)
            users = np.zeros(c, dtype=np.int64)
            for q, cs in cell_sizes.items():
                if (q // nc == tl) != (q % nc == tc):  # SO: same label, other confounder; OS: the reverse
                    users += cs
            pools[t] = (users, sz)
        return pools

    def _exact_samples(self, part: Partition, layout_f, widths: dict, ref: ScopeRef):
        """Exact answers of every kind in ``widths`` (kind -> k) for the calibration and audit
        samples: one brute task per chunk and part of the queries (:data:`CALIBRATION_PARTS`),
        both samples and every kind in one pass (the kinds share their GEMMs,
        :meth:`~.tasks.Targets.search`), merged per part as the tasks finish. Returns
        ``(calibration positions, audit positions, {kind: (idx, dist)})``, the tables' rows being
        the calibration sample and then the audit sample. The samples' vectors are read by a
        task and handed to the brute tasks on the cluster; the driver reads only codes."""
        n = part.n
        rng_a = np.random.default_rng([self.seed, 1])
        rng_c = np.random.default_rng([self.seed, 2])
        audit = np.sort(rng_a.choice(n, size=min(n, self.n_recall_queries), replace=False))
        calib = np.sort(rng_c.choice(n, size=min(n, max(tunables.CALIBRATION_QUERIES, 2 * self.n_recall_queries)), replace=False))
        qpos = np.concatenate([calib, audit])
        # a task group of its own: from this 20-ms read the scheduler would expect the brute tasks
        # to be as short, and queue them all behind one another on the worker holding the sample
        qv_f = self.client.submit(position_task, layout_f, part.step, qpos, pure=False,
                                  key=task_key("calibrate", "queries", group="sample"))
        q_codes = np.ascontiguousarray(ref.codes_at(qpos)[:, 1:])
        step = -(-qpos.size // max(1, int(tunables.CALIBRATION_PARTS)))
        starts = list(range(0, qpos.size, step))
        # larger chunks first, each submitted when a worker thread is free for it (:func:`paced`),
        # so the last wave is short and no task waits behind another on a busy worker
        by_rows = np.argsort([-int(b[-1]) for b in part.layout.bounds], kind="stable").tolist()

        def submit(j, s):
            return lambda: self.client.submit(brute_task, layout_f, j, qv_f, q_codes[s:s + step], widths, s,
                                              pure=False, key=task_key("calibrate", f"chunk{j:05d}-{s}"))

        # the sample first: a task submitted while it is pending goes to the worker that will hold it
        for _ in as_completed([qv_f], loop=self.client.loop):  # this client's, not a default one
            pass
        merged = dict.fromkeys(starts)
        # merged as they finish (a (distance, index) merge: any order gives the same top-k), so
        # the driver holds one chunk's answers per part at a time, not one per chunk
        for s, found in paced(self.client, ((s, submit(j, s)) for j in by_rows for s in starts)):
            merged[s] = found if merged[s] is None else {kd: merge_tables(merged[s][kd], found[kd], k)
                                                         for kd, k in widths.items()}
            del found
        whole = {kd: tuple(np.concatenate([merged[s][kd][w] for s in starts]) for w in (0, 1)) for kd in widths}
        return calib, audit, whole

    def _calibrate(self, part: Partition, kinds, geometry, pools, floor, ref: ScopeRef, calib, audit, merged):
        """The probe rules to try for ``kinds`` (:func:`probe_ladder`) from the exact answers of
        :meth:`_exact_samples`. Returns ``(rules, audit truth per kind, audit positions)``.
        ``geometry``: the partition's :class:`~cachescore.neighbors.partition.ProbeGeometry`
        (a block of query clusters at a time)."""
        nc = calib.size
        truth = {kd: (merged[kd][0][nc:], merged[kd][1][nc:]) for kd in kinds}
        qa = part.clusters_at(calib)
        found_in = {pool: ([], []) for pool in pools}  # pool -> (query clusters, neighbour clusters)
        for kd in kinds:
            ti, td = merged[kd][0][:nc], merged[kd][1][:nc]
            r, j = np.nonzero((ti >= 0) & np.isfinite(td))
            nb = ti[r, j]
            if "cross" in pools:
                pool_of = np.zeros(nb.size, np.int64)
            else:
                nb_codes = ref.codes_at(nb)
                pool_of = nb_codes[:, 2] * part.layout.n_conf + nb_codes[:, 3]
            nb_cluster = part.clusters_at(nb)
            for pool in pools:
                sel = np.ones(nb.size, bool) if pool == "cross" else pool_of == pool
                found_in[pool][0].append(qa[r[sel]])
                found_in[pool][1].append(nb_cluster[sel])
        calib_pools = [(w, sz, np.concatenate(found_in[pool][0]), np.concatenate(found_in[pool][1]))
                       for pool, (w, sz) in pools.items()]
        want = min(1.0, self.target + 0.5 * (1.0 - self.target))
        return probe_ladder(geometry, calib_pools, want, floor), truth, audit

    def _run_search(self, n, layout_f, geometry, sizes, jobs: list) -> list:
        """One search under each job's current rule (``job["ladder"][job["rounds"]]``) in every
        pool of the job: one task per batch of query clusters fills every job's tables (under
        their partial names, renamed by :meth:`_complete` once the recall is met); with a
        cross-group and a typed job, a typed pair inside the cross-group probe is computed once.
        Returns per job ``(probe fraction, stats)``: the fraction is the (query, target) pairs its
        rule probes over those an exact search computes; ``stats`` = ``{"search_pairs",
        "search_gemm_pairs"`` (the pairs the tasks computed for all jobs together), ``"search_task_seconds"``
        (the tasks' wall time, summed, for all jobs), ``"searched_with"`` (the other jobs' kinds)``}``."""
        plans, pairs, gemm_pairs = _probe_plans(geometry, sizes, jobs)
        tables, widths = {}, {}
        for job in jobs:
            for kind in job["kinds"]:
                widths[kind] = job["k"]
                for what, dt in (("idx", np.int64), ("dist", np.float64)):
                    path = _filling(job["folder"], kind, what)
                    tables[(kind, what)] = (str(path), create_table(path, dt, (n, job["k"])))
        batches = _batches(plans, sizes)
        work = [sum(gemm_pairs[a] for a in b) for b in batches]
        # the most work first (dask runs higher priorities first): the last wave is short tasks
        rank = _priorities(work)
        futures = [self.client.submit(search_task, layout_f, b, widths, tables, pure=False, priority=int(rank[i]),
                                      key=task_key("search", f"batch{i:05d}"))
                   for i, b in enumerate(batches)]
        done = gather_or_cancel(self.client, futures)
        covered = sum(q for q, _ in done)
        if covered != n:
            raise RuntimeError(f"large-scope search covered {covered} of {n} rows")
        seconds = round(sum(t for _, t in done), 3)
        out = []
        for j, job in enumerate(jobs):
            exact_pairs = sum(int(w.sum()) * int(sz.sum()) for w, sz in job["pools"].values())
            stats = {"search_pairs": int(pairs[j]), "search_gemm_pairs": int(sum(gemm_pairs.values())),
                     "search_task_seconds": seconds,
                     "searched_with": ["/".join(o["kinds"]) for o in jobs if o is not job]}
            out.append(((pairs[j] / exact_pairs if exact_pairs else 1.0), stats))
        return out


def _priorities(work) -> list[int]:
    """Dask priorities (higher runs first) that order tasks by ``work``, most first: each task's
    rank in ``work`` (of equal work, the later one ranks higher)."""
    return np.argsort(np.argsort(work, kind="stable"), kind="stable").tolist()


def _probe_plans(geometry, sizes, jobs: list) -> tuple[dict, list, dict]:
    """Every non-empty query cluster's probe plan under the jobs' current rules, in chain order
    (:func:`probe_chain`): ``({cluster: {"cross": clusters} and / or {"cells": {cell: clusters}}},
    pairs probed per job, {cluster: pairs the tasks compute for it, for all jobs})``."""
    by_cluster, pairs, gemm_pairs = {}, [0] * len(jobs), {}
    rules = [job["ladder"][job["rounds"]] for job in jobs]
    for start, stop, dist in geometry.distance_blocks():  # a block of query clusters at a time
        for a in range(start, stop):
            if sizes[a] == 0:
                continue
            plan = {}
            for j, (job, rule) in enumerate(zip(jobs, rules)):
                pools = job["pools"]
                probed = {pool: probed_clusters(dist[a - start], sz, rule.radius, rule.min_rows)
                          for pool, (_, sz) in pools.items()}
                pairs[j] += sum(int(pools[pool][0][a]) * int(pools[pool][1][cl].sum()) for pool, cl in probed.items())
                plan.update({"cross": probed["cross"]} if "cross" in pools else {"cells": probed})
            gemm_pairs[a] = _gemm_pairs(a, plan, jobs)
            by_cluster[a] = plan
    return {int(a): by_cluster[int(a)] for a in probe_chain(geometry) if int(a) in by_cluster}, pairs, gemm_pairs


def _batches(plans: dict, sizes) -> list[dict]:
    """Consecutive plans (chain order: a batch's clusters are close together) in batches of at
    most ``BATCH_ROWS`` query rows (a larger cluster alone)."""
    batches, cur, cur_rows = [], {}, 0
    for a, plan in plans.items():
        if cur and cur_rows + sizes[a] > tunables.BATCH_ROWS:
            batches.append(cur)
            cur, cur_rows = {}, 0
        cur[a] = plan
        cur_rows += int(sizes[a])
    if cur:
        batches.append(cur)
    return batches


def _gemm_pairs(a: int, plan: dict, jobs: list) -> int:
    """The (query, target) pairs the search tasks compute for query cluster ``a`` under ``plan``
    (:meth:`~.tasks.Targets.search`): the cross-group probe's rows for every query, and the
    typed probe's rows outside it for the queries of each pool."""
    cross = next((job["pools"]["cross"] for job in jobs if "cross" in job["pools"]), None)
    typed = next((job["pools"] for job in jobs if "cross" not in job["pools"]), None)
    total = 0
    if cross is not None:
        total += int(cross[0][a]) * int(cross[1][plan["cross"]].sum())
    if typed is not None:
        for pool, clusters in plan["cells"].items():
            users, sz = typed[pool]
            if cross is not None:
                clusters = np.setdiff1d(clusters, plan["cross"], assume_unique=True)
            total += int(users[a]) * int(sz[clusters].sum())
    return total
