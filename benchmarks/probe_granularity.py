"""Would finer query groups probe less? The engine's rule (one probe set per query *cluster*)
against its lower bound (one probe set per *query*), same partition, same recall.

The out-of-core search probes, from each query cluster of ~2,048 rows, every target cluster
within a centroid distance ``r`` of the *query cluster's* centroid, grown to a floor of rows
(ADR-0013); all the cluster's queries share that probe set. Probing from each query's own
position instead (``1 - q·c_b <= r``, the same floor rule per query) is the finest query-side
grouping there is: no split of the query clusters can probe fewer rows at equal recall. This
script calibrates both rules exactly as the engine does (least work over radius × floor, the
calibration neighbours of ``--queries`` sampled rows, cross-group k = ``--k``) and prints the
share of (query, row) pairs each computes. A small gap says the work is set by how far the true
neighbours spread over the target clusters, not by how coarsely queries are grouped.

Usage::

    python benchmarks/probe_granularity.py --rows 1000000 --workdir /work/bench
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from probe_rules import codes, exact_answers  # noqa: E402

from cachescore.cache import Cache  # noqa: E402
from cachescore.neighbors.large_scope import files as tunables  # noqa: E402
from cachescore.neighbors.normalize import normalize_rows  # noqa: E402
from cachescore.neighbors.partition import ProbeGeometry, assign_clusters, calibrate_probe, spherical_kmeans  # noqa: E402


def per_query_work(u, cent, sizes, q_rows, nb_cluster, target, floor0, block=4096):
    """(work, radius, floor) of the least-work rule when every query probes from its own position."""
    c = cent.shape[0]
    cent64 = cent.astype(np.float64)
    dq = np.maximum(1.0 - u[q_rows].astype(np.float64) @ cent64.T, 0.0)
    order = np.argsort(dq, axis=1, kind="stable")
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.broadcast_to(np.arange(c), order.shape), axis=1)
    cum = np.cumsum(sizes[order], axis=1)
    i = np.arange(q_rows.size)
    d, rows_before = dq[i, nb_cluster], cum[i, pos[i, nb_cluster]] - sizes[nb_cluster]
    need_total = int(np.ceil(target * d.size - 1e-9))
    floors, f = [], float(floor0)
    while f < 2 * sizes.sum():
        floors.append(int(round(f)))
        f *= 2 ** 0.5
    rules = []
    for fl in sorted(set(floors)):
        by_floor = rows_before < fl
        need = need_total - int(by_floor.sum())
        rules.append((-np.inf if need <= 0 else float(np.sort(d[~by_floor])[need - 1]), fl))
    work = np.zeros(len(rules))
    for s in range(0, u.shape[0], block):  # every row is a query: its own probe set
        db = np.maximum(1.0 - u[s:s + block].astype(np.float64) @ cent64.T, 0.0)
        o = np.argsort(db, axis=1, kind="stable")
        near, cm = np.take_along_axis(db, o, axis=1), np.cumsum(sizes[o], axis=1)
        for j, (r, fl) in enumerate(rules):
            last = np.maximum((near <= r).sum(axis=1), np.minimum((cm < fl).sum(axis=1) + 1, c)) - 1
            work[j] += float(cm[np.arange(cm.shape[0]), last].sum())
    best = int(np.argmin(work))
    return work[best], rules[best][0], rules[best][1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--k", type=int, default=21)
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--target", type=float, default=0.995)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="/tmp/cachescore-bench")
    a = p.parse_args(argv)
    root = Path(a.workdir) / (f"scale-cache-{a.rows}x{a.dim}-s{a.seed}-e1-L2C4-M64r24-sl20_100")
    if not (root / "cache.json").exists():
        from cachescore.cache.synthetic import make_scale_cache
        make_scale_cache(root, rows=a.rows, dim=a.dim, seed=a.seed)
    cache = Cache(root)
    view = cache.read_view("scale_all")
    u = normalize_rows(cache.load_rows("enc0", view.attrs["tileset"], view["row"].to_numpy(dtype=np.int64)))
    n, groups = u.shape[0], codes(view, "group_id")
    rng = np.random.default_rng([a.seed, 2])
    qs = np.sort(rng.choice(n, size=min(n, a.queries), replace=False))
    t0 = time.perf_counter()
    cross = exact_answers(u, qs, groups, None, a.k, None)
    c = max(1, -(-n // tunables.ROWS_PER_CLUSTER))
    srng = np.random.default_rng([a.seed, 17])
    size = min(n, tunables.KMEANS_MAX_SAMPLE, max(tunables.KMEANS_MIN_SAMPLE, 48 * c))
    cent = spherical_kmeans(u[np.sort(srng.choice(n, size=size, replace=False))], c, random_state=srng)
    cl = assign_clusters(u, cent)
    sizes = np.bincount(cl, minlength=c).astype(np.int64)
    r, j = np.nonzero(cross >= 0)
    floor0 = a.k + int(np.bincount(groups).max())
    print(f"rows {n} x {u.shape[1]}, {c} clusters, {qs.size} queries x k={a.k}, target recall {a.target} "
          f"({time.perf_counter() - t0:.1f} s)")
    rule = calibrate_probe(ProbeGeometry(cent), [(sizes, sizes, cl[qs[r]], cl[cross[r, j]])], a.target, floor0)
    geometry = ProbeGeometry(cent)
    w_cluster = sum(int(blk.probed_rows(blk.cum_rows(sizes), [rule])[:, 0] @ sizes[blk.start:blk.stop])
                    for blk in geometry.blocks())
    t0 = time.perf_counter()
    w_query, r_q, f_q = per_query_work(u, cent, sizes, qs[r], cl[cross[r, j]], a.target, floor0)
    print(f"  per query cluster (engine): work {w_cluster / n / n:.4f} of n^2 (radius {rule.radius:.4f}, floor {rule.min_rows})")
    print(f"  per query (lower bound):    work {w_query / n / n:.4f} of n^2 (radius {r_q:.4f}, floor {f_q}) "
          f"[{time.perf_counter() - t0:.1f} s]")
    print(f"  the finest query grouping would compute {w_query / w_cluster:.3f}x the engine's pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
