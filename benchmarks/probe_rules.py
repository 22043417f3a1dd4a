"""Probe work of the out-of-core search's probe rules, side by side on the same rows (ADR-0013).

For a k-means partition of ``make_scale_cache`` rows (``--rows-per-cluster``, the engine's
centroid sample) and the exact answers of ``--queries`` sampled rows (cross-group k = ``--k``,
typed SO/OS m = ``--m``), prints the share of (query, row) pairs each rule computes while finding
``--target`` of those exact neighbours:

* ``fraction``: ADR-0007's rule, one share ``f`` of the pool's rows for every query cluster (its
  nearest clusters until they hold ``f``), ``f`` the exact quantile (no grid);
* ``radius``: every cluster within a centroid distance ``r`` (the engine's rule with floor
  ``k + largest group`` only);
* ``radius+floor``: the engine's rule, :func:`cachescore.neighbors.partition.calibrate_probe`
  (least work over radius x floor).

A neighbour counts as found iff its cluster is probed (probed rows are searched exactly), so the
figures are the rules' work at equal recall, without running a search. Typed work is over the
pairs an exact typed search computes (each query against its SO and OS pool cells).

Usage::

    python benchmarks/probe_rules.py --rows 200000
    python benchmarks/probe_rules.py --rows 1000000 --workdir /tmp/bench
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from cachescore.cache import Cache  # noqa: E402
from cachescore.cache.synthetic import make_scale_cache  # noqa: E402
from cachescore.neighbors.large_scope import files as tunables  # noqa: E402
from cachescore.neighbors.normalize import normalize_rows  # noqa: E402
from cachescore.neighbors.partition import (  # noqa: E402
    ProbeBlock,
    ProbeGeometry,
    ProbeRule,
    assign_clusters,
    calibrate_probe,
    spherical_kmeans,
    topk_tiles,
)


def codes(view, col):
    return np.unique(view[col].astype(str).to_numpy(), return_inverse=True)[1].astype(np.int64)


def exact_answers(u, qs, groups, pools_of_query, kk, pool_rows):
    """(idx (q, kk)) of the sampled queries over the given pools (None: all rows)."""
    bi = np.full((qs.size, kk), -1, np.int64)
    bd = np.full((qs.size, kk), np.inf)
    ids = np.arange(u.shape[0], dtype=np.int64)
    if pools_of_query is None:
        topk_tiles(u[qs], groups[qs], u, ids, groups, kk, bi, bd)
        return bi
    for t, rows in pool_rows.items():
        sel = np.flatnonzero(pools_of_query(t))
        if sel.size:
            si, sd = bi[sel], bd[sel]
            topk_tiles(u[qs[sel]], groups[qs[sel]], u, ids, groups, kk, si, sd, rows=rows)
            bi[sel], bd[sel] = si, sd
    return bi


def whole_geometry(geometry: ProbeGeometry) -> ProbeBlock:
    """Every query cluster as one :class:`ProbeBlock` (C × C: fine for this benchmark's partitions;
    the engine holds a block at a time)."""
    blocks = list(geometry.blocks())
    return ProbeBlock(0, geometry.n_clusters, *(np.concatenate([getattr(b, f) for b in blocks]) for f in ("dist", "order", "pos")))


def fraction_work(geo, pools, target):
    """Work of the fixed-fraction rule at the exact quantile: the share f of each pool's rows."""
    need = []
    for _, sz, qa, nb in pools:
        cum = geo.cum_rows(sz)
        need.append(cum[qa, geo.pos[qa, nb]] / max(1, int(sz.sum())))
    f = float(np.quantile(np.concatenate(need), target)) if need else 0.0
    work = exact = 0.0
    for w, sz, _, _ in pools:
        cum = geo.cum_rows(sz)
        total = int(sz.sum())
        stop = np.minimum((cum < f * total).sum(axis=1) + 1, cum.shape[1])
        work += float(np.dot(w, cum[np.arange(cum.shape[0]), stop - 1]))
        exact += float(w.sum()) * total
    return work / exact, f


def rule_work(geo, pools, rule):
    work = sum(float(np.dot(w, geo.probed_rows(geo.cum_rows(sz), [rule])[:, 0])) for w, sz, _, _ in pools)
    exact = sum(float(w.sum()) * int(sz.sum()) for w, sz, _, _ in pools)
    return work / exact


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--k", type=int, default=21)
    p.add_argument("--m", type=int, default=5)
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--target", type=float, default=0.995, help="recall the rules must reach (the engine's "
                   "calibration aim for a 0.99 target)")
    p.add_argument("--rows-per-cluster", type=int, nargs="+", default=[tunables.ROWS_PER_CLUSTER])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "cachescore-bench"))
    a = p.parse_args(argv)
    root = Path(a.workdir) / f"peers-{a.rows}x{a.dim}-s{a.seed}"  # the same cache as peers.py
    if not (root / "cache.json").exists():
        make_scale_cache(root, rows=a.rows, dim=a.dim, seed=a.seed)
    cache = Cache(root)
    view = cache.read_view("scale_all")
    u = normalize_rows(cache.load_rows("enc0", view.attrs["tileset"], view["row"].to_numpy(dtype=np.int64)))
    n = u.shape[0]
    groups, lab, conf = codes(view, "group_id"), codes(view, "label"), codes(view, "centre")
    nc = int(conf.max()) + 1
    cell = lab * nc + conf
    rng = np.random.default_rng([a.seed, 2])
    qs = np.sort(rng.choice(n, size=min(n, a.queries), replace=False))
    t0 = time.perf_counter()
    cross = exact_answers(u, qs, groups, None, a.k, None)
    cells = {int(t): np.flatnonzero(cell == t) for t in np.unique(cell)}
    ql, qc = lab[qs], conf[qs]
    so = exact_answers(u, qs, groups, lambda t: (ql == t // nc) & (qc != t % nc), a.m, cells)
    os_ = exact_answers(u, qs, groups, lambda t: (ql != t // nc) & (qc == t % nc), a.m, cells)
    print(f"rows {n} x {u.shape[1]}, {qs.size} queries, exact answers in {time.perf_counter() - t0:.1f} s; "
          f"target recall {a.target}")
    floor_c = a.k + int(np.bincount(groups).max())
    floor_t = a.m + int(np.bincount(groups).max())
    for rpc in a.rows_per_cluster:
        c = max(1, -(-n // rpc))
        srng = np.random.default_rng([a.seed, 17])
        size = min(n, tunables.KMEANS_MAX_SAMPLE, max(tunables.KMEANS_MIN_SAMPLE, 48 * c))
        sample = np.sort(srng.choice(n, size=size, replace=False))
        t0 = time.perf_counter()
        cent = spherical_kmeans(u[sample], c, random_state=srng)
        cl = assign_clusters(u, cent)
        geometry = ProbeGeometry(cent)
        geo = whole_geometry(geometry)
        sizes = np.bincount(cl, minlength=c)
        qa = cl[qs]
        r, j = np.nonzero(cross >= 0)
        pools_c = [(sizes, sizes, qa[r], cl[cross[r, j]])]
        cell_sizes = {t: np.bincount(cl[rows], minlength=c) for t, rows in cells.items()}
        pools_t = []
        for t, sz in cell_sizes.items():
            users = sum(cs for q, cs in cell_sizes.items() if (q // nc == t // nc) != (q % nc == t % nc))
            nbq, nbc = [], []
            for tbl in (so, os_):
                rr, jj = np.nonzero((tbl >= 0) & (cell[np.maximum(tbl, 0)] == t))
                nbq.append(qa[rr])
                nbc.append(cl[tbl[rr, jj]])
            pools_t.append((np.asarray(users, dtype=np.int64), sz, np.concatenate(nbq), np.concatenate(nbc)))
        print(f"\n{rpc} rows per cluster: {c} clusters (k-means + assignment {time.perf_counter() - t0:.1f} s)")
        print(f"  {'table':6s} {'fraction':>22s} {'radius':>22s} {'radius+floor':>30s}")
        for name, pools, floor in (("cross", pools_c, floor_c), ("typed", pools_t, floor_t)):
            wf, f = fraction_work(geo, pools, a.target)
            best = calibrate_probe(geometry, pools, a.target, floor)
            # radius only: the floor fixed at its minimum, the smallest radius reaching the target
            d = np.concatenate([geo.dist[q, b] for _, _, q, b in pools])
            rb = np.concatenate([geo.rows_before(geo.cum_rows(s_), s_, q, b) for _, s_, q, b in pools])
            by_floor = rb < floor
            need = int(np.ceil(a.target * d.size - 1e-9)) - int(by_floor.sum())
            r0 = -np.inf if need <= 0 else float(np.sort(d[~by_floor])[need - 1])
            wr = rule_work(geo, pools, ProbeRule(r0, floor))
            wb = rule_work(geo, pools, best)
            print(f"  {name:6s} {wf:10.4f} (f {f:.4f}) {wr:10.4f} (r {r0:7.4f}) {wb:10.4f} "
                  f"(r {best.radius:7.4f}, floor {best.min_rows})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
