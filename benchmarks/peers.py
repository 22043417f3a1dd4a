"""Neighbour tables side by side, on the same rows: ours (exact, IVF, graph, out-of-core) vs faiss
(flat, IVF, HNSW) and hnswlib.

Two tables (``--tables``), the ones the metrics need, cosine distance on doubly-normalised rows:

* ``cross`` (RI / MaRI): for every row of a scope, its ``k`` nearest rows of *other* slides (rows
  of the query's own slide, itself included, never count);
* ``typed`` (CRoMa): for every row, the ``m`` smallest distances to its SO pool (same label, other
  confounder) and to its OS pool (other label, same confounder), other slides only. Peers get one
  index per (label, confounder) cell; a query searches the cells of its SO and OS pools and their
  answers are merged (a slide lies inside one cell on these rows, so no exclusion is needed and
  peers search exactly ``m``). Recall: the tie-robust distance recall the product audits with.

Data: :func:`cachescore.cache.synthetic.make_scale_cache` (``--rows`` × ``--dim`` float32,
slides of 20..100 tiles, clustered like foundation-model tile embeddings), built once under
``--workdir`` and loaded into memory.

Contenders, each timed on its own (build + search, wall seconds, this process):

* ``ours-exact``: :func:`cachescore.neighbors.exact.cross_group_knn` /
  :func:`cachescore.neighbors.typed.typed_knn` (blocked GEMM, each pair once);
* ``ours-ivf``: :func:`cachescore.neighbors.ann.cross_group_knn_ann_with_recall` (``method="ivf"``,
  ``--target`` recall, calibrated probe fraction, exact distances on the probed rows; the
  in-memory engine, used for scopes below ``[neighbors] large_scope_rows``);
* ``ours-graph``: the same with ``method="graph"`` (pynndescent build + query, widened until the
  target; numba's JIT warm-up timed separately, once per process);
* ``ours-large``: :class:`cachescore.neighbors.large_scope.LargeScopeSearch`, the out-of-core
  engine ``cachescore run`` uses for scopes of at least ``large_scope_rows`` (100k) rows, on a
  LocalCluster of ``--threads`` single-threaded worker processes reading the cache from disk:
  partition + calibrated probe rule + search (time of the call, cluster start excluded);
* ``faiss-flat``: ``IndexFlatIP`` (exact inner products);
* ``faiss-ivf``: ``IndexIVFFlat`` with ``4·sqrt(n)`` lists, ``nprobe`` doubled until the sampled
  recall reaches ``--target``;
* ``faiss-hnsw``: ``IndexHNSWFlat(M=32)``, ``efSearch`` doubled until ``--target``;
* ``hnswlib``: ``M=32``, ``ef_construction=200``, ``ef`` doubled until ``--target``.

Cross-group: peers have no per-query exclusion, so they search ``k + g`` neighbours (``g`` =
the largest slide) and drop same-slide rows afterwards: the honest cost of the cross-group
constraint for them. Each peer's tuning loop re-searches only the ``--recall-sample`` queries; the reported time is one
build plus one full search at the chosen setting. Recall of every contender is measured against
the exact answers of the same sample (the exact kernel on the sample rows only, so 1M rows need no
full exact search; set overlap of the ``k`` indices; ours-ivf / ours-large also report their own
self-measured recall). Prints, per table, a table and the ratio of each contender's time to
ours-large's (ours-ivf's when skipped).

``--extrapolate NAME …`` times a peer's full search on ``--search-sample`` random query rows
and scales it by ``n / sample`` (its search time is linear in the queries; the index is always
built on every row): for sizes where a full search would take hours (faiss flat / IVF at 1M).
Such rows carry ``search_extrapolated_from``.

faiss-cpu's wheel bundles an OpenBLAS that may not recognise this CPU (9× slower here until
``OPENBLAS_CORETYPE=SKYLAKEX``); the script prints the variable and never sets it.

Usage::

    pip install faiss-cpu hnswlib        # benchmark-only (the ``bench`` extra)
    python benchmarks/peers.py --rows 50000 --dim 768 --k 21
    python benchmarks/peers.py --rows 200000 --skip faiss-flat   # sizes where a contender is too slow
    python benchmarks/peers.py --rows 1000000 --skip ours-exact ours-ivf faiss-flat
    python benchmarks/peers.py --rows 1000000 --tables typed --skip ours-exact ours-ivf ours-graph \
        --extrapolate faiss-flat faiss-ivf hnswlib --search-sample 20000
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cachescore.cache import Cache, RowSource  # noqa: E402
from cachescore.cache.synthetic import make_scale_cache  # noqa: E402
from cachescore.neighbors.ann import cross_group_knn_ann_with_recall  # noqa: E402
from cachescore.neighbors.exact import cross_group_knn  # noqa: E402
from cachescore.neighbors.normalize import normalize_rows  # noqa: E402
from cachescore.neighbors.recall import distance_tol, recall_counts  # noqa: E402

CONTENDERS = ("ours-exact", "ours-ivf", "ours-graph", "ours-large", "faiss-flat", "faiss-ivf", "faiss-hnsw", "hnswlib")


def load_rows(workdir: Path, rows: int, dim: int, seed: int):
    """(normalised rows (n, d) float32, codes (groups, labels, confounders) each (n,) int64, the
    cache root, the view frame)."""
    root = workdir / f"peers-{rows}x{dim}-s{seed}"
    if not (root / "cache.json").exists():
        make_scale_cache(root, rows=rows, dim=dim, seed=seed)
    cache = Cache(root)
    view = cache.read_view("scale_all")
    x = cache.load_rows("enc0", view.attrs["tileset"], view["row"].to_numpy(dtype=np.int64))
    codes = tuple(np.unique(view[col].astype(str).to_numpy(), return_inverse=True)[1].astype(np.int64)
                  for col in ("group_id", "label", "centre"))
    return normalize_rows(x).astype(np.float32, copy=False), codes, root, view


def sample_truth(u, groups, sample, k) -> np.ndarray:
    """Exact cross-group top-``k`` indices of the ``sample`` rows over every row (the exact
    kernel on the sample only: O(|sample| · n), affordable at any n)."""
    from cachescore.neighbors.partition import topk_tiles

    bi = np.full((sample.size, k), -1, np.int64)
    bd = np.full((sample.size, k), np.inf)
    topk_tiles(u[sample], groups[sample], u, np.arange(u.shape[0], dtype=np.int64), groups, k, bi, bd)
    return bi


def ours_large(root, view, codes, k, target, workers, seed, workdir, table="cross"):
    """The product's out-of-core engine (what ``cachescore run`` uses for scopes of at least
    ``[neighbors] large_scope_rows``) on a LocalCluster of ``workers`` single-threaded processes:
    partition + calibration + search of the ``table`` (``"cross"``: the cross-group top-``k``;
    ``"typed"``: CRoMa's SO / OS tables with ``m = k``), wall seconds of that call (the cluster's
    start excluded). Returns ``(seconds, idx (n, k) or (so_dist, os_dist), details)``."""
    import shutil
    import tempfile

    from distributed import Client, LocalCluster

    from cachescore.neighbors.large_scope import LargeScopeSearch, ScopeRows

    groups, labels, conf = codes
    rows = ScopeRows(embeddings=RowSource(str(root), "enc0", view.attrs["tileset"]),
                     tile_rows=view["row"].to_numpy(dtype=np.int64), groups=groups, labels=labels, confounders=conf,
                     source="peers")
    scratch = Path(tempfile.mkdtemp(prefix="peers-large-", dir=workdir))
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=None, env=env) as cluster, Client(cluster) as client:
            search = LargeScopeSearch(client, {"scope": rows}, scratch, recall_target=target, random_state=seed)
            t0 = time.perf_counter()
            if table == "cross":
                found = np.array(search.cross(None, groups, k)[0])
            else:
                found = tuple(np.array(t) for t in search.typed(None, labels, conf, groups, k))
            seconds = time.perf_counter() - t0
            return seconds, found, search.details[-1]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def cross_from_candidates(cand: np.ndarray, sims: np.ndarray, groups: np.ndarray, qrows: np.ndarray, k: int):
    """Drop same-group candidates (vectorised), keep the first ``k`` per query (candidates sorted)."""
    valid = (cand >= 0) & (groups[np.maximum(cand, 0)] != groups[qrows][:, None])
    order = np.argsort(~valid, axis=1, kind="stable")  # valid ones first, in their similarity order
    idx = np.take_along_axis(np.where(valid, cand, -1), order, axis=1)[:, :k]
    return idx


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """Cross-group recall: overlap of the found and the true ``k`` indices, over the true ones."""
    hits = sum(len(set(a[a >= 0]) & set(b[b >= 0])) for a, b in zip(found, truth))
    return hits / max(1, int((truth >= 0).sum()))


def typed_recall(found: tuple, truth: tuple, tol: float) -> float:
    """Typed recall, SO and OS pooled: the tie-robust distance recall the product audits with
    (:func:`cachescore.neighbors.recall.recall_counts`; CRoMa reads only distances)."""
    hits = total = 0
    for f, t in zip(found, truth):
        h, n = recall_counts(np.asarray(f), np.asarray(t), tol)
        hits, total = hits + h, total + n
    return hits / max(1, total)


def to_distances(sims: np.ndarray) -> np.ndarray:
    """(q, m) kept similarities (``-inf``: none) -> ascending distances ``clip(1 - s, 0, 2)``, ``+inf`` padded."""
    return np.sort(np.where(np.isfinite(sims), np.clip(1.0 - sims, 0.0, 2.0), np.inf), axis=1)


def keep_largest(best: np.ndarray, more: np.ndarray) -> np.ndarray:
    """Row-wise the ``best.shape[1]`` largest values of ``best`` and ``more`` together (unsorted)."""
    both = np.concatenate([best, more], axis=1)
    m = best.shape[1]
    return np.partition(both, both.shape[1] - m, axis=1)[:, -m:]


def typed_pools(same_label, same_conf) -> dict:
    """``{"so": same label & other confounder, "os": other label & same confounder}`` (boolean
    arrays of any matching shape): which targets are in a query's SO and OS pools."""
    return {"so": same_label & ~same_conf, "os": ~same_label & same_conf}


def typed_truth(u, codes, sample, m, block=32768) -> tuple:
    """Exact SO / OS distances ``(|sample|, m)`` of the sample rows over every row, by plain numpy
    over target blocks (an oracle independent of our kernels; O(|sample| · n), any n)."""
    groups, labels, conf = codes
    q, qg, ql, qc = u[sample], groups[sample], labels[sample], conf[sample]
    best = {kind: np.full((sample.size, m), -np.inf) for kind in ("so", "os")}
    for s0 in range(0, u.shape[0], block):
        blk = slice(s0, min(u.shape[0], s0 + block))
        sims = (q @ u[blk].T).astype(np.float64)
        sims[qg[:, None] == groups[blk][None, :]] = -np.inf
        pools = typed_pools(ql[:, None] == labels[blk][None, :], qc[:, None] == conf[blk][None, :])
        for kind, mask in pools.items():
            best[kind] = keep_largest(best[kind], np.where(mask, sims, -np.inf))
    return to_distances(best["so"]), to_distances(best["os"])


def tune(score, knob_values, target) -> tuple[object, float]:
    """Smallest knob value whose sampled recall ``score(knob)`` reaches ``target`` (the last one
    otherwise); returns ``(knob, its recall)``."""
    for v in knob_values:
        r = score(v)
        if r >= target:
            break
    return v, r


def timed_search(name, args, n, search_rows) -> tuple[float, int | None]:
    """Wall seconds of ``search_rows(every row)``. For contenders named in ``--extrapolate``: the
    seconds of ``--search-sample`` random query rows times ``n / sample`` (a peer's search time is
    linear in its queries; the index is always built on every row). Returns ``(seconds, sample
    size or None)``."""
    if name in args.extrapolate and args.search_sample < n:
        q = np.sort(np.random.default_rng([args.seed, 3]).choice(n, size=args.search_sample, replace=False))
        t0 = time.perf_counter()
        search_rows(q)
        return (time.perf_counter() - t0) * n / q.size, int(q.size)
    t0 = time.perf_counter()
    search_rows(np.arange(n))
    return time.perf_counter() - t0, None


def peer_engines(faiss, hnswlib, threads, seed) -> dict:
    """``{name: (build(x) -> index, search(index, q, knob, over) -> (cand, sims), knobs(rows, over))}``:
    ``cand`` (b, over) positions in the index (``-1``: none), ``sims`` their inner products."""

    def faiss_search(attr):
        def search(index, q, v, over):
            if attr == "nprobe":
                index.nprobe = v
            elif attr == "efSearch":
                index.hnsw.efSearch = v
            sims, cand = index.search(q, min(over, index.ntotal))
            return cand, sims
        return search

    def hnsw_build(x):
        index = hnswlib.Index(space="ip", dim=x.shape[1])
        index.init_index(max_elements=x.shape[0], M=32, ef_construction=200, random_seed=seed)
        index.add_items(x, np.arange(x.shape[0]), num_threads=threads)
        return index

    def hnsw_search(index, q, v, over):
        kk = min(over, index.get_current_count())
        index.set_ef(max(v, kk))
        labels, dist = index.knn_query(q, k=kk, num_threads=threads)
        return labels.astype(np.int64), 1.0 - dist  # space "ip": distance = 1 - inner product

    def ivf_knobs(rows, over):
        nlist = _nlist(rows)
        return [p for p in (1, 2, 4, 8, 16, 32, 64, 128, 256) if p < nlist] + [nlist]

    return {
        "faiss-flat": (lambda x: _flat(faiss, x), faiss_search(None), lambda rows, over: [None]),
        "faiss-ivf": (lambda x: _ivf(faiss, x, _nlist(x.shape[0])), faiss_search("nprobe"), ivf_knobs),
        "faiss-hnsw": (lambda x: _hnsw(faiss, x), faiss_search("efSearch"),
                       lambda rows, over: [max(over, e) for e in (64, 128, 256, 512, 1024)]),
        "hnswlib": (hnsw_build, hnsw_search, lambda rows, over: [64, 128, 256, 512, 1024]),
    }


@functools.cache
def graph_warm_up() -> float:
    """pynndescent's numba JIT, paid once per process (the workers do the same); seconds."""
    from cachescore.neighbors import numba_env

    numba_env.configure()
    t0 = time.perf_counter()
    numba_env.warm_up()
    return round(time.perf_counter() - t0, 1)


class Bench:
    """One run's data and bookkeeping: the rows, their codes, the recall sample, the results."""

    def __init__(self, args, u, codes, root, view, engines):
        self.args, self.u, self.codes, self.root, self.view, self.engines = args, u, codes, root, view, engines
        self.n = u.shape[0]
        self.sample = np.sort(np.random.default_rng(args.seed).choice(self.n, size=min(self.n, args.recall_sample),
                                                                       replace=False))
        self.results: dict = {}

    def record(self, name, seconds, rec, **extra):
        self.results[name] = {"seconds": seconds, "recall": rec, **extra}
        print(f"  {name:11s} {seconds:9.1f} s  recall {rec:.4f}  {extra}", flush=True)

    def peer(self, name, build, answer, score, knobs):
        """Build a peer's index (``build() -> index``), tune its knob on the recall sample
        (``score(answer(index, sample, knob))``, :func:`tune`), time its full search at that knob
        (:func:`timed_search`) and record build + search seconds."""
        t0 = time.perf_counter()
        index = build()
        built = time.perf_counter() - t0
        knob, rec = tune(lambda v: score(answer(index, self.sample, v)), knobs, self.args.target)
        searched, from_q = timed_search(name, self.args, self.n, lambda q: answer(index, q, knob))
        self.record(name, built + searched, rec, knob=knob, build_s=round(built, 1), search_s=round(searched, 1),
                    **({"search_extrapolated_from": from_q} if from_q else {}))

    def summary(self, table):
        ref = next(c for c in ("ours-large", "ours-ivf", "ours-exact", *CONTENDERS) if c in self.results)
        base = self.results[ref]["seconds"]
        print(f"\n{table}: contender   seconds   recall   time / {ref}")
        for name, r in self.results.items():
            print(f"{name:11s} {r['seconds']:9.1f}   {r['recall']:.4f}   {r['seconds'] / base:6.2f}x")
        return {"results": self.results, "reference": ref}


def run_cross(b: Bench) -> dict:
    """The cross-group table (RI / MaRI): every row's ``k`` nearest rows of other slides."""
    args, u, n, k, sample = b.args, b.u, b.n, b.args.k, b.sample
    groups = b.codes[0]
    over = k + int(np.bincount(groups).max())
    print(f"cross-group: k {k}, peers search {over} (k + largest slide)")
    t0 = time.perf_counter()
    truth = sample_truth(u, groups, sample, k)
    print(f"  exact answers of the sample: {time.perf_counter() - t0:.1f} s")
    if "ours-exact" not in args.skip:
        t0 = time.perf_counter()
        exact_idx, _ = cross_group_knn(u, groups, k, n_threads=args.threads)
        b.record("ours-exact", time.perf_counter() - t0, recall(exact_idx[sample], truth))
        del exact_idx
    for method in ("graph", "ivf"):
        if f"ours-{method}" in args.skip:
            continue
        warm = graph_warm_up() if method == "graph" else None
        t0 = time.perf_counter()
        res = cross_group_knn_ann_with_recall(u, groups, k, recall_target=args.target, random_state=args.seed,
                                              method=method, **({"n_jobs": args.threads} if warm else {}))
        extra = ({"rounds": res.rounds, "warm_up_s": warm} if warm else
                 {"probe_fraction": res.probe_fraction, "clusters": res.n_clusters})
        b.record(f"ours-{method}", time.perf_counter() - t0, recall(np.asarray(res.idx)[sample], truth),
                 self_recall=round(float(res.recall), 5), **extra)
    if "ours-large" not in args.skip:
        sec, idx, det = ours_large(b.root, b.view, b.codes, k, args.target, args.threads, args.seed, args.workdir)
        b.record("ours-large", sec, recall(idx[sample], truth), **_large_extra(det))
        del idx
    for name, (build, search, knobs) in b.engines.items():
        if name in args.skip:
            continue

        def answer(index, q, v, search=search):
            return cross_from_candidates(*search(index, u[q], v, over), groups, q, k)

        b.peer(name, lambda build=build: build(u), answer, lambda idx: recall(idx, truth), knobs(n, over))
    return b.summary("cross-group")


def run_typed(b: Bench) -> dict:
    """The typed tables (CRoMa): every row's ``m`` nearest SO and OS distances (other slides).
    Peers get one index per (label, confounder) cell and search, for each query, the cells of its
    SO and OS pools, merging their answers (the natural way to restrict a general index)."""
    from cachescore.neighbors.ann import typed_knn_ann_with_recall
    from cachescore.neighbors.typed import typed_knn

    args, u, m, sample = b.args, b.u, b.args.m, b.sample
    groups, labels, conf = b.codes
    n_conf = int(conf.max()) + 1
    cell = labels * n_conf + conf
    cells = {int(t): np.flatnonzero(cell == t) for t in np.unique(cell)}
    # a slide inside one cell is never in its own SO / OS pools: peers then need no exclusion
    spans = np.unique(np.stack([groups, cell]), axis=1).shape[1] > np.unique(groups).size
    over = m + (int(np.bincount(groups).max()) if spans else 0)
    tol = distance_tol(u.dtype, u.shape[1])
    print(f"typed: m {m}, {len(cells)} cells, slides {'span' if spans else 'within'} cells, peers search {over}")
    t0 = time.perf_counter()
    truth = typed_truth(u, b.codes, sample, m)
    print(f"  exact answers of the sample: {time.perf_counter() - t0:.1f} s")

    def rec_of(so, os_):
        return typed_recall((so[sample], os_[sample]), truth, tol)

    if "ours-exact" not in args.skip:
        t0 = time.perf_counter()
        so, os_ = typed_knn(u, labels, conf, groups, m, threads=args.threads)
        b.record("ours-exact", time.perf_counter() - t0, rec_of(so, os_))
        del so, os_
    for method in ("graph", "ivf"):
        if f"ours-{method}" in args.skip:
            continue
        warm = graph_warm_up() if method == "graph" else None
        t0 = time.perf_counter()
        res = typed_knn_ann_with_recall(u, labels, conf, groups, m, recall_target=args.target,
                                        random_state=args.seed, method=method,
                                        **({"n_jobs": args.threads} if warm else {}))
        b.record(f"ours-{method}", time.perf_counter() - t0, rec_of(res.so_dist, res.os_dist),
                 self_recall=round(float(res.recall), 5), rounds=res.rounds,
                 **({"warm_up_s": warm} if warm else {}))
    if "ours-large" not in args.skip:
        sec, (so, os_), det = ours_large(b.root, b.view, b.codes, m, args.target, args.threads, args.seed,
                                         args.workdir, table="typed")
        b.record("ours-large", sec, rec_of(so, os_), **_large_extra(det))
        del so, os_
    smallest = min(rows.size for rows in cells.values())
    for name, (build, search, knobs) in b.engines.items():
        if name in args.skip:
            continue

        def build_cells(build=build):
            return {t: build(np.ascontiguousarray(u[rows])) for t, rows in cells.items()}

        def answer(indexes, q, v, search=search):
            best = {kind: np.full((q.size, m), -np.inf) for kind in ("so", "os")}
            for t, rows in cells.items():
                tl, tc = divmod(t, n_conf)
                for kind, sel in typed_pools(labels[q] == tl, conf[q] == tc).items():
                    qi = np.flatnonzero(sel)
                    for s0 in range(0, qi.size, 65536):  # bounded query blocks
                        blk = qi[s0:s0 + 65536]
                        cand, sims = search(indexes[t], u[q[blk]], v, over)
                        ok = cand >= 0
                        if spans:
                            ok &= groups[rows[np.maximum(cand, 0)]] != groups[q[blk]][:, None]
                        best[kind][blk] = keep_largest(best[kind][blk], np.where(ok, sims.astype(np.float64), -np.inf))
            return to_distances(best["so"]), to_distances(best["os"])

        b.peer(name, build_cells, answer, lambda found: typed_recall(found, truth, tol), knobs(smallest, over))
    return b.summary("typed")


def _large_extra(det: dict) -> dict:
    return {"self_recall": round(float(det["recall"]), 5), "probe_fraction": round(det["probe_fraction"], 4),
            "clusters": det["n_clusters"], "partition_s": det["seconds_partition"],
            "calibration_s": det["seconds_calibration"], "search_s": det["seconds_search"]}


def run(args) -> dict:
    import faiss  # noqa: PLC0415 - benchmark-only
    import hnswlib  # noqa: PLC0415

    faiss.omp_set_num_threads(args.threads)
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '<unset>')}  threads={args.threads}")
    u, codes, root, view = load_rows(Path(args.workdir), args.rows, args.dim, args.seed)
    print(f"rows {u.shape[0]} x {u.shape[1]}, recall sample {min(u.shape[0], args.recall_sample)}")
    out: dict = {"rows": u.shape[0], "dim": u.shape[1], "k": args.k, "m": args.m, "tables": {}}
    engines = peer_engines(faiss, hnswlib, args.threads, args.seed)
    for table in args.tables:
        b = Bench(args, u, codes, root, view, engines)
        out["tables"][table] = run_cross(b) if table == "cross" else run_typed(b)
    return out


def _nlist(rows: int) -> int:
    return max(1, int(4 * np.sqrt(rows)))


def _flat(faiss, u):
    index = faiss.IndexFlatIP(u.shape[1])
    index.add(u)
    return index


def _ivf(faiss, u, nlist):
    quant = faiss.IndexFlatIP(u.shape[1])
    index = faiss.IndexIVFFlat(quant, u.shape[1], nlist, faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(0)
    index.train(u[rng.choice(u.shape[0], size=min(u.shape[0], 64 * nlist), replace=False)])
    index.add(u)
    return index


def _hnsw(faiss, u):
    index = faiss.IndexHNSWFlat(u.shape[1], 32, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 200
    index.add(u)
    return index


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=50000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--k", type=int, default=21)
    p.add_argument("--target", type=float, default=0.99, help="recall every approximate contender must reach")
    p.add_argument("--recall-sample", type=int, default=1000)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cachescore-bench"))
    p.add_argument("--m", type=int, default=5, help="typed neighbours per type (CRoMa's m; pipeline default 5)")
    p.add_argument("--tables", nargs="+", default=["cross", "typed"], choices=["cross", "typed"])
    p.add_argument("--skip", nargs="*", default=[], choices=CONTENDERS)
    p.add_argument("--extrapolate", nargs="*", default=[], choices=CONTENDERS,
                   help="peers whose full search is timed on --search-sample query rows and scaled to n")
    p.add_argument("--search-sample", type=int, default=50000)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
