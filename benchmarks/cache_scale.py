"""Large-scale neighbour-search benchmark: exact (blocked GEMM) vs ANN (``--method ivf``: k-means
partition + exact GEMMs over probed rows, the default; ``--method graph``: pynndescent + exact
refinement).

What it does
------------
1. Synthesises a view of realistic structure as a row-chunked ``.npy`` on disk (memmap), written
   chunk by chunk so memory stays bounded: ``--labels`` × ``--confounders`` cells, slides (groups)
   of ``--slide-min``..``--slide-max`` tiles, each slide in one cell, rows = label centre +
   confounder shift + per-slide offset + tile noise, doubly L2-normalised in float32
   (``normalize_rows``), i.e. exactly what the metrics hand to the neighbour backends.
2. Times the neighbour searches one scoring of RI + MaRI + CRoMa needs: the cross-group top-``kmax``
   (RI, MaRI, k-selection and tau all read windows of it) and the typed SO/OS top-``m`` (CRoMa):

   * ``exact``: ``neighbors.exact.cross_group_knn`` and ``neighbors.typed.typed_knn``.
     ``--exact full`` runs them on all rows; ``--exact sample`` (default) runs them on the first
     ``--exact-rows`` rows and **extrapolates quadratically** (cost ∝ n² · d), printing both the
     measured and the extrapolated time; ``--exact skip`` skips them.
   * ``ann``: ``cross_group_knn_ann_with_recall`` / ``typed_knn_ann_with_recall`` with their
     measured recall (against exact search on ``--recall-queries`` sampled rows), the method, the
     calibrated probe fraction and whether the exact engine answered (``exact_path`` /
     ``exact_cells``: the ivf typed search falls back to it when probing cannot prune).
3. Prints wall time, peak RSS of this process during each phase (Linux: ``VmHWM`` reset through
   ``/proc/self/clear_refs``; elsewhere the process-lifetime ``ru_maxrss``), recall and the
   exact/ANN speed ratio; ``--json`` also writes them to a file.

``--rows 1000000`` (with ``--exact skip``) is the 1M-row ANN-only scope: watch ``peak RSS`` against
the size of the data (``n·d·4`` bytes, which pynndescent holds once as its own float32 copy).

Examples::

    python benchmarks/cache_scale.py --rows 20000 --dim 768              # quick check
    python benchmarks/cache_scale.py --rows 200000 --exact sample        # the 200k view
    python benchmarks/cache_scale.py --rows 1000000 --exact skip         # 1M ANN-only scope

With ``--method graph`` the numba JIT of pynndescent (~100 s on a cold process) is paid in a
separate ``warm_up`` phase and reported, so it does not pollute the ANN timings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from contextlib import contextmanager

import numpy as np


def _peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


@contextmanager
def phase(name: str, results: dict):
    resettable = _peak_rss_reset()
    t0 = time.perf_counter()
    entry: dict = {}
    yield entry
    entry["wall_s"] = time.perf_counter() - t0
    entry["peak_rss_mib"] = _peak_rss_bytes() / 2**20
    entry["peak_rss_scope"] = "phase" if resettable else "process"
    results[name] = entry
    extra = " ".join(f"{k}={v}" for k, v in entry.items() if k not in ("wall_s", "peak_rss_mib", "peak_rss_scope"))
    print(
        f"[{name:<22}] wall {entry['wall_s']:9.2f} s   peak RSS {entry['peak_rss_mib']:9.1f} MiB "
        f"({entry['peak_rss_scope']})   {extra}",
        flush=True,
    )


def synthesise(path: str, n: int, d: int, *, n_labels: int, n_conf: int, smin: int, smax: int,
               seed: int, chunk_rows: int):
    """Write the normalised float32 view (n, d) to ``path`` (.npy memmap) chunk by chunk.

    Returns (memmap, labels, confounders, groups); codes are int64 arrays of shape (n,).
    """
    from cachescore.neighbors.normalize import normalize_rows

    rng = np.random.default_rng(seed)
    sizes = rng.integers(smin, smax + 1, size=n // smin + 1)
    ends = np.cumsum(sizes)
    n_groups = int(np.searchsorted(ends, n) + 1)
    sizes = sizes[:n_groups]
    sizes[-1] -= int(ends[n_groups - 1] - n)
    groups = np.repeat(np.arange(n_groups), sizes)
    g_label = rng.integers(0, n_labels, n_groups)
    g_conf = rng.integers(0, n_conf, n_groups)
    labels, conf = g_label[groups], g_conf[groups]
    centres = rng.standard_normal((n_labels, d)).astype(np.float32)
    shifts = 0.8 * rng.standard_normal((n_conf, d)).astype(np.float32)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, d))
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        g = groups[s:e]
        # per-slide offsets drawn from a slide-seeded stream: independent of the chunking
        offs = np.stack([np.random.default_rng([seed, int(k)]).standard_normal(d) for k in np.unique(g)])
        offs = offs.astype(np.float32)[np.searchsorted(np.unique(g), g)]
        noise = np.random.default_rng([seed, 10**9 + s]).standard_normal((e - s, d), dtype=np.float32)
        x = centres[labels[s:e]] + shifts[conf[s:e]] + 0.7 * offs + noise
        out[s:e] = normalize_rows(x)
    out.flush()
    del out
    return np.load(path, mmap_mode="r"), labels, conf, groups


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--labels", type=int, default=2)
    p.add_argument("--confounders", type=int, default=4)
    p.add_argument("--slide-min", type=int, default=20)
    p.add_argument("--slide-max", type=int, default=100)
    p.add_argument("--kmax", type=int, default=100, help="cross-group window (RI/MaRI)")
    p.add_argument("--m", type=int, default=20, help="typed neighbours per type (CRoMa m_max)")
    p.add_argument("--exact", choices=("full", "sample", "skip"), default="sample")
    p.add_argument("--exact-rows", type=int, default=20_000, help="rows for --exact sample")
    p.add_argument("--recall-target", type=float, default=0.99)
    p.add_argument("--recall-queries", type=int, default=1000)
    p.add_argument("--chunk-rows", type=int, default=32768, help="rows per synthesis chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where the .npy goes (default: a temp dir)")
    p.add_argument("--n-jobs", type=int, default=1, help="numba threads for pynndescent")
    p.add_argument("--proxy-dim", type=int, default=None, help="ANN graph on a projection (see ann.project_rows)")
    p.add_argument("--method", choices=("ivf", "graph"), default="ivf", help="ANN method (see neighbors.ann)")
    p.add_argument("--skip-typed", action="store_true", help="only the cross-group search")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    a = p.parse_args(argv)

    from threadpoolctl import threadpool_info

    from cachescore.neighbors import ann
    from cachescore.neighbors.numba_env import configure, warm_up

    configure()
    results: dict = {}
    n, d = a.rows, a.dim
    print(f"cache_scale: n={n} d={d} cells={a.labels}x{a.confounders} slides {a.slide_min}-{a.slide_max} "
          f"kmax={a.kmax} m={a.m} exact={a.exact} cpus={os.cpu_count()} "
          f"blas={[(i.get('internal_api'), i.get('num_threads')) for i in threadpool_info()]}", flush=True)
    workdir = a.workdir or tempfile.mkdtemp(prefix="cachescore-bench-")
    path = os.path.join(workdir, f"view_{n}x{d}.npy")

    with phase("synthesise", results) as e:
        u, labels, conf, groups = synthesise(
            path, n, d, n_labels=a.labels, n_conf=a.confounders, smin=a.slide_min,
            smax=a.slide_max, seed=a.seed, chunk_rows=a.chunk_rows,
        )
        e["data_mib"] = round(n * d * 4 / 2**20, 1)
        e["groups"] = int(groups.max() + 1)

    if a.method == "graph":
        with phase("warm_up (numba JIT)", results):
            warm_up()

    if a.exact != "skip":
        from cachescore.neighbors.exact import cross_group_knn
        from cachescore.neighbors.typed import typed_knn

        ne = n if a.exact == "full" else min(n, a.exact_rows)
        ue = u if ne == n else np.ascontiguousarray(u[:ne])
        scale = (n / ne) ** 2
        with phase("exact cross_group_knn", results) as e:
            cross_group_knn(ue, groups[:ne], a.kmax)
            e["rows"] = ne
        results["exact cross_group_knn"]["est_full_s"] = results["exact cross_group_knn"]["wall_s"] * scale
        if not a.skip_typed:
            with phase("exact typed_knn", results) as e:
                typed_knn(ue, labels[:ne], conf[:ne], groups[:ne], a.m)
                e["rows"] = ne
            results["exact typed_knn"]["est_full_s"] = results["exact typed_knn"]["wall_s"] * scale
        if ne < n:
            print(f"  exact timings measured on the first {ne} rows; est_full_s = measured × (n/{ne})² "
                  f"= ×{scale:.1f} (cost ∝ n²·d)", flush=True)
        del ue

    with phase("ann cross_group_knn", results) as e:
        r = ann.cross_group_knn_ann_with_recall(
            u, groups, a.kmax, recall_target=a.recall_target, random_state=a.seed,
            n_recall_queries=a.recall_queries, n_jobs=a.n_jobs, proxy_dim=a.proxy_dim, method=a.method,
        )
        e.update(recall=round(r.recall, 5), rounds=r.rounds, method=r.method, probe_fraction=r.probe_fraction,
                 clusters=r.n_clusters, exact_path=r.exact)
        del r
    if not a.skip_typed:
        with phase("ann typed_knn", results) as e:
            t = ann.typed_knn_ann_with_recall(
                u, labels, conf, groups, a.m, recall_target=a.recall_target, random_state=a.seed,
                n_recall_queries=a.recall_queries, n_jobs=a.n_jobs, proxy_dim=a.proxy_dim, method=a.method,
            )
            e.update(recall=round(t.recall, 5), rounds=t.rounds, method=t.method, probe_fraction=t.probe_fraction,
                     exact_cells=t.exact_cells, cells=t.n_cells)
            del t

    print("summary:")
    for kind in ("cross_group_knn", "typed_knn"):
        ex, an = results.get(f"exact {kind}"), results.get(f"ann {kind}")
        if ex and an:
            est = ex.get("est_full_s", ex["wall_s"])
            label = "measured" if ex.get("rows") == n else f"extrapolated from {ex.get('rows')} rows"
            print(f"  {kind}: exact {est:.1f} s ({label}) vs ann {an['wall_s']:.1f} s "
                  f"→ speed ratio ×{est / an['wall_s']:.2f}; ann recall {an['recall']}")
        elif an:
            print(f"  {kind}: ann {an['wall_s']:.1f} s, recall {an['recall']}, peak RSS "
                  f"{an['peak_rss_mib']:.0f} MiB (data {results['synthesise']['data_mib']} MiB)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=2)
    if a.workdir is None:
        os.remove(path)
        os.rmdir(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
