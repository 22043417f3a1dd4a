"""Cross-group kNN side by side: ours (exact, IVF) vs faiss (flat, IVF, HNSW) and hnswlib, on the same rows.

The task is the one RI / MaRI need: for every row of a scope, its ``k`` nearest rows of *other*
slides (rows of the query's own slide, itself included, never count), cosine distance on
doubly-normalised rows. Data: :func:`cachescore.cache.synthetic.make_scale_cache` (``--rows`` ×
``--dim`` float32, slides of 20..100 tiles, clustered like foundation-model tile embeddings),
built once under ``--workdir`` and loaded into memory.

Contenders, each timed on its own (build + search, wall seconds, this process):

* ``ours-exact``: :func:`cachescore.neighbors.exact.cross_group_knn` (blocked GEMM, each pair once);
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

Peers have no per-query exclusion, so they search ``k + g`` neighbours (``g`` = the largest slide)
and drop same-slide rows afterwards: the honest cost of the cross-group constraint for them. Each
peer's tuning loop re-searches only the ``--recall-sample`` queries; the reported time is one
build plus one full search at the chosen setting. Recall of every contender is measured against
the exact answers of the same sample (the exact kernel on the sample rows only, so 1M rows need no
full exact search; set overlap of the ``k`` indices; ours-ivf / ours-large also report their own
self-measured recall). Prints a table and the ratio of each contender's time to ours-large's
(ours-ivf's when skipped).

faiss-cpu's wheel bundles an OpenBLAS that may not recognise this CPU (9× slower here until
``OPENBLAS_CORETYPE=SKYLAKEX``); the script prints the variable and never sets it.

Usage::

    pip install faiss-cpu hnswlib        # benchmark-only (the ``bench`` extra)
    python benchmarks/peers.py --rows 50000 --dim 768 --k 21
    python benchmarks/peers.py --rows 200000 --skip faiss-flat   # sizes where a contender is too slow
    python benchmarks/peers.py --rows 1000000 --skip ours-exact ours-ivf faiss-flat
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cachescore.cache import Cache  # noqa: E402
from cachescore.cache.synthetic import make_scale_cache  # noqa: E402
from cachescore.neighbors.ann import cross_group_knn_ann_with_recall  # noqa: E402
from cachescore.neighbors.exact import cross_group_knn  # noqa: E402
from cachescore.neighbors.normalize import normalize_rows  # noqa: E402

CONTENDERS = ("ours-exact", "ours-ivf", "ours-graph", "ours-large", "faiss-flat", "faiss-ivf", "faiss-hnsw", "hnswlib")


def load_rows(workdir: Path, rows: int, dim: int, seed: int):
    """(normalised rows (n, d) float32, group codes (n,), the cache root, the view frame)."""
    root = workdir / f"peers-{rows}x{dim}-s{seed}"
    if not (root / "cache.json").exists():
        make_scale_cache(root, rows=rows, dim=dim, seed=seed)
    cache = Cache(root)
    view = cache.read_view("scale_all")
    x = cache.load_rows("enc0", view.attrs["tileset"], view["row"].to_numpy(dtype=np.int64))
    groups = np.unique(view["group_id"].astype(str).to_numpy(), return_inverse=True)[1].astype(np.int64)
    return normalize_rows(x).astype(np.float32, copy=False), groups, root, view


def sample_truth(u, groups, sample, k) -> np.ndarray:
    """Exact cross-group top-``k`` indices of the ``sample`` rows over every row (the exact
    kernel on the sample only: O(|sample| · n), affordable at any n)."""
    from cachescore.neighbors.partition import topk_tiles

    bi = np.full((sample.size, k), -1, np.int64)
    bd = np.full((sample.size, k), np.inf)
    topk_tiles(u[sample], groups[sample], u, np.arange(u.shape[0], dtype=np.int64), groups, k, bi, bd)
    return bi


def ours_large(root, view, groups, k, target, workers, seed, workdir):
    """The product's out-of-core engine (what ``cachescore run`` uses for scopes of at least
    ``[neighbors] large_scope_rows``) on a LocalCluster of ``workers`` single-threaded processes:
    partition + calibration + search of the cross-group table, wall seconds of that call (the
    cluster's start excluded). Returns ``(seconds, idx (n, k), details)``."""
    import shutil
    import tempfile

    from distributed import Client, LocalCluster

    from cachescore.neighbors.large_scope import LargeScopeSearch, ScopeRows

    labels = np.unique(view["label"].astype(str).to_numpy(), return_inverse=True)[1].astype(np.int64)
    conf = np.unique(view["centre"].astype(str).to_numpy(), return_inverse=True)[1].astype(np.int64)
    rows = ScopeRows(cache_root=str(root), encoder="enc0", tileset=view.attrs["tileset"],
                     tile_rows=view["row"].to_numpy(dtype=np.int64), groups=groups, labels=labels, confounders=conf,
                     source="peers")
    scratch = Path(tempfile.mkdtemp(prefix="peers-large-", dir=workdir))
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=None, env=env) as cluster, Client(cluster) as client:
            search = LargeScopeSearch(client, {"scope": rows}, scratch, recall_target=target, random_state=seed)
            t0 = time.perf_counter()
            idx, _ = search.cross(None, groups, k)
            seconds = time.perf_counter() - t0
            return seconds, np.array(idx), search.details[-1]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def cross_from_candidates(cand: np.ndarray, sims: np.ndarray, groups: np.ndarray, qrows: np.ndarray, k: int):
    """Drop same-group candidates (vectorised), keep the first ``k`` per query (candidates sorted)."""
    valid = (cand >= 0) & (groups[np.maximum(cand, 0)] != groups[qrows][:, None])
    order = np.argsort(~valid, axis=1, kind="stable")  # valid ones first, in their similarity order
    idx = np.take_along_axis(np.where(valid, cand, -1), order, axis=1)[:, :k]
    return idx


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    hits = sum(len(set(a[a >= 0]) & set(b[b >= 0])) for a, b in zip(found, truth))
    return hits / max(1, int((truth >= 0).sum()))


def tune(search, knob_values, sample, truth, target) -> tuple[object, float]:
    """Smallest knob value whose sampled recall reaches ``target`` (the last one otherwise)."""
    best = (knob_values[-1], 0.0)
    for v in knob_values:
        r = recall(search(sample, v), truth)
        best = (v, r)
        if r >= target:
            break
    return best


def run(args) -> dict:
    import faiss  # noqa: PLC0415 - benchmark-only
    import hnswlib  # noqa: PLC0415

    faiss.omp_set_num_threads(args.threads)
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '<unset>')}  threads={args.threads}")
    u, groups, root, view = load_rows(Path(args.workdir), args.rows, args.dim, args.seed)
    n, d, k = u.shape[0], u.shape[1], args.k
    gmax = int(np.bincount(groups).max())
    over = k + gmax
    rng = np.random.default_rng(args.seed)
    sample = np.sort(rng.choice(n, size=min(n, args.recall_sample), replace=False))
    print(f"rows {n} x {d}, k {k}, largest slide {gmax} (peers search {over}), recall sample {sample.size}")
    out: dict = {"rows": n, "dim": d, "k": k, "results": {}}

    t0 = time.perf_counter()
    truth = sample_truth(u, groups, sample, k)
    print(f"  exact answers of the sample: {time.perf_counter() - t0:.1f} s")

    def record(name, seconds, idx_sample, **extra):
        out["results"][name] = {"seconds": seconds, "recall": recall(idx_sample, truth), **extra}
        print(f"  {name:11s} {seconds:9.1f} s  recall {out['results'][name]['recall']:.4f}  {extra}", flush=True)

    if "ours-exact" not in args.skip:
        t0 = time.perf_counter()
        exact_idx, _ = cross_group_knn(u, groups, k, n_threads=args.threads)
        record("ours-exact", time.perf_counter() - t0, exact_idx[sample])
        del exact_idx
    if "ours-graph" not in args.skip:
        from cachescore.neighbors import numba_env

        numba_env.configure()
        t0 = time.perf_counter()
        numba_env.warm_up()  # pynndescent's JIT, paid once per process (the workers do the same)
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = cross_group_knn_ann_with_recall(u, groups, k, recall_target=args.target, random_state=args.seed,
                                              method="graph", n_jobs=args.threads)
        record("ours-graph", time.perf_counter() - t0, np.asarray(res.idx)[sample],
               self_recall=round(float(res.recall), 5), rounds=res.rounds, warm_up_s=round(warm, 1))
    if "ours-large" not in args.skip:
        sec, idx, det = ours_large(root, view, groups, k, args.target, args.threads, args.seed, args.workdir)
        record("ours-large", sec, idx[sample], self_recall=round(float(det["recall"]), 5),
               probe_fraction=round(det["probe_fraction"], 4), clusters=det["n_clusters"],
               partition_s=det["seconds_partition"], calibration_s=det["seconds_calibration"],
               search_s=det["seconds_search"])
        del idx
    if "ours-ivf" not in args.skip:
        t0 = time.perf_counter()
        res = cross_group_knn_ann_with_recall(u, groups, k, recall_target=args.target, random_state=args.seed,
                                              method="ivf")
        record("ours-ivf", time.perf_counter() - t0, np.asarray(res.idx)[sample],
               self_recall=round(float(res.recall), 5), probe_fraction=res.probe_fraction, clusters=res.n_clusters)

    def peer(name, build, search, knobs):
        if name in args.skip:
            return
        t0 = time.perf_counter()
        index = build()
        built = time.perf_counter() - t0
        knob, _ = tune(lambda q, v: cross_from_candidates(*search(index, q, v), groups, q, k), knobs, sample, truth,
                       args.target)
        t1 = time.perf_counter()
        cand, _ = search(index, np.arange(n), knob)
        searched = time.perf_counter() - t1
        record(name, built + searched, cross_from_candidates(cand[sample], None, groups, sample, k),
               knob=knob, build_s=round(built, 1), search_s=round(searched, 1))

    def faiss_search(index, q, v, attr=None):
        if attr:
            setattr(index if attr != "efSearch" else index.hnsw, attr, v)
        sims, cand = index.search(u[q], over)
        return cand, sims

    peer("faiss-flat", lambda: _flat(faiss, u), lambda ix, q, v: faiss_search(ix, q, v), [None])
    nlist = int(4 * np.sqrt(n))
    peer("faiss-ivf", lambda: _ivf(faiss, u, nlist), lambda ix, q, v: faiss_search(ix, q, v, "nprobe"),
         [1, 2, 4, 8, 16, 32, 64, 128, 256, nlist])
    peer("faiss-hnsw", lambda: _hnsw(faiss, u), lambda ix, q, v: faiss_search(ix, q, v, "efSearch"),
         [max(over, e) for e in (64, 128, 256, 512, 1024)])

    def hnsw_search(index, q, v):
        index.set_ef(max(v, over))
        labels, dist = index.knn_query(u[q], k=over, num_threads=args.threads)
        return labels.astype(np.int64), -dist

    def hnsw_build():
        index = hnswlib.Index(space="ip", dim=d)
        index.init_index(max_elements=n, M=32, ef_construction=200, random_seed=args.seed)
        index.add_items(u, np.arange(n), num_threads=args.threads)
        return index

    peer("hnswlib", hnsw_build, hnsw_search, [64, 128, 256, 512, 1024])

    ref = next(c for c in ("ours-large", "ours-ivf", "ours-exact", *CONTENDERS) if c in out["results"])
    base = out["results"][ref]["seconds"]
    print(f"\ncontender     seconds   recall   time / {ref}")
    for name, r in out["results"].items():
        print(f"{name:11s} {r['seconds']:9.1f}   {r['recall']:.4f}   {r['seconds'] / base:6.2f}x")
    return out


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
    p.add_argument("--skip", nargs="*", default=[], choices=CONTENDERS)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
