"""Benchmark: RI / MaRI / CRoMa, croma 1.0.1 vs cachescore, same data, same process.

Synthetic float32 view (spec DESIGN §6): N rows, D = 384, 2 labels x 4 confounders (cycled per
slide), slides of 20 tiles (``group_id``), label and confounder offsets plus noise. For each N in
``--sizes`` it times

- ``RI.compute(k_candidates=[5, 11, 21])``,
- ``MaRI.compute(k_candidates=[5, 11, 21])`` (auto tau),
- ``CRoMa.compute(m=5)`` (cachescore's from ``cachescore.metrics.croma``; skipped with a message
  when that module is not importable yet),

for croma (skipped above ``--skip-croma-above``) and cachescore, prints the time per metric, the
speed-up, and the largest absolute difference of value / per-unit values / tau against croma.

It also measures this machine's float32 GEMM throughput (``--gemm`` n x n x D products into a
preallocated output, best of 3, GFLOP/s) and, for one whole-scope ``cross_group_knn`` call at each
N (best of 2), two effective throughputs:

- *performed*: the flops of the GEMMs the search really runs (the symmetric search computes each
  tile pair I <= J once, ``cachescore.neighbors.exact.search_flops``), divided by its wall time;
  its ratio to the GEMM figure is the share of the machine's GEMM throughput the search reaches
  (the rest of its time is selection and merging);
- *n^2 D equivalent*: ``2 n^2 D / time``, the flops a query-by-query search over all pairs would
  need (what a search without the symmetry must spend).

Every line carries the 1-minute load average (``/proc/loadavg``): on a shared machine, compare
figures taken at similar load only.

    python benchmarks/metrics_vs_croma.py --sizes 2000            # quick check (~1-2 min)
    python benchmarks/metrics_vs_croma.py --sizes 2000 4000 8000  # the full table (quiet machine)
    python benchmarks/metrics_vs_croma.py --regime confounded --sizes 8000
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings

import numpy as np
import pandas as pd

K_CANDIDATES = [5, 11, 21]
CONF = "center"


#: (label offset, confounder offset) standard deviations per regime.
REGIMES = {"balanced": (0.35, 0.35), "confounded": (0.15, 0.6)}


def synthetic_view(n: int, dim: int = 384, tiles_per_slide: int = 20, seed: int = 0, regime: str = "balanced"):
    """Float32 features and a croma manifest: 2 labels x 4 confounders, slides of 20 tiles.

    ``regime``: ``balanced`` (label and confounder offsets of equal scale) or ``confounded``
    (the confounder offset 4x the label offset: other-label same-confounder neighbours are near,
    same-label other-confounder ones far, the case CRoMa exists to detect).
    """
    rng = np.random.default_rng(seed)
    slide = np.arange(n) // tiles_per_slide
    label = slide % 2
    conf = (slide // 2) % 4
    lab_sd, conf_sd = REGIMES[regime]
    lab_off = rng.normal(0, lab_sd, size=(2, dim))
    conf_off = rng.normal(0, conf_sd, size=(4, dim))
    slide_off = rng.normal(0, 0.2, size=(int(slide.max()) + 1, dim))
    x = lab_off[label] + conf_off[conf] + slide_off[slide] + rng.standard_normal((n, dim))
    df = pd.DataFrame(
        {
            "sample_id": [f"t{i}" for i in range(n)],
            "image_path": [f"/cache/tiles/{i}.png" for i in range(n)],
            "label": [f"class{v}" for v in label],
            CONF: [f"centre{v}" for v in conf],
            "group_id": [f"slide{v}" for v in slide],
            "dataset": "synthetic",
        }
    )
    return x.astype(np.float32), df


def load_average() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return fh.read().split()[0]
    except OSError:  # not Linux
        return "n/a"


def gemm_gflops(n: int, dim: int, repeats: int = 3) -> float:
    """Best-of-``repeats`` float32 ``(n, dim) @ (dim, n)`` into a preallocated output, GFLOP/s."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, dim)).astype(np.float32)
    b = rng.standard_normal((n, dim)).astype(np.float32)
    out = np.empty((n, n), dtype=np.float32)
    np.matmul(a, b.T, out=out)  # warm-up
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        np.matmul(a, b.T, out=out)
        best = min(best, time.perf_counter() - t)
    return 2.0 * n * n * dim / best / 1e9


def search_gflops(x: np.ndarray, groups: np.ndarray, kmax: int) -> tuple[float, float, float, float]:
    """``(seconds, performed GFLOP, performed GFLOP/s, 2 n^2 D GFLOP/s)`` of one exact search."""
    from cachescore.neighbors.exact import cross_group_knn, search_flops
    from cachescore.neighbors.normalize import normalize_rows

    u = normalize_rows(x)
    el = np.inf
    for _ in range(2):  # best of two: the first call also pays for page faults
        t = time.perf_counter()
        cross_group_knn(u, groups, kmax)
        el = min(el, time.perf_counter() - t)
    n, d = u.shape
    flops = search_flops(n, d, u.dtype)
    return el, flops / 1e9, flops / el / 1e9, 2.0 * n * n * d / el / 1e9


def _search_threads(n: int) -> int:
    """Python threads the default whole-scope search uses at this N (tile pairs shared)."""
    from cachescore.neighbors import exact

    tile = exact._tile_size(n, np.float32)
    blocks = -(-n // tile)
    return exact._thread_count(None, blocks * (blocks + 1) // 2)


def timed(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        return out, time.perf_counter() - t


def max_diff(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    both = np.isfinite(a) & np.isfinite(b)
    if not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return float("inf")
    return float(np.max(np.abs(a[both] - b[both]))) if both.any() else 0.0


def compare(ours, ref) -> str:
    parts = [f"|dvalue|={abs(ours.value - ref.value):.2e}", f"max|dunit|={max_diff(ours.sample_values_aligned, ref.sample_values_aligned):.2e}"]
    if hasattr(ref, "k"):
        parts.append(f"k {ours.k}/{ref.k}")
    tau = getattr(ref, "tau", float("nan"))
    if np.isfinite(tau):
        parts.append(f"|dtau|={abs(ours.tau - tau):.2e}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 4000, 8000])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--skip-croma-above", type=int, default=8000, help="run croma only for N <= this")
    parser.add_argument("--gemm", type=int, default=4096, help="size n of the n x n x D GEMM probe")
    parser.add_argument("--m", type=int, default=5)
    parser.add_argument("--regime", choices=sorted(REGIMES), default="balanced",
                        help="synthetic data: balanced offsets, or a confounder offset above the label offset")
    args = parser.parse_args(argv)

    import croma

    from cachescore.metrics.mari import MaRI
    from cachescore.metrics.ri import RI

    try:
        from cachescore.metrics.croma import CRoMa
    except Exception as exc:  # noqa: BLE001 - report and continue without CRoMa
        CRoMa = None
        print(f"# cachescore.metrics.croma not importable ({exc!r}); CRoMa rows skipped")

    lab_sd, conf_sd = REGIMES[args.regime]
    print(f"# regime {args.regime}: label offset sd {lab_sd}, confounder offset sd {conf_sd}")
    print(f"# python {platform.python_version()}, numpy {np.__version__}, croma {croma.__version__}, {platform.machine()}")
    gemm = gemm_gflops(args.gemm, args.dim)
    print(f"# float32 GEMM {args.gemm}x{args.gemm}x{args.dim}: {gemm:.1f} GFLOP/s (load {load_average()})")
    # warm-up (imports, allocator, BLAS threads) so the first timed call is not penalised
    xw, dfw = synthetic_view(200, args.dim, seed=1)
    for fn in (croma.RI.compute, RI.compute, croma.MaRI.compute, MaRI.compute):
        timed(fn, xw, dfw, confounder_column=CONF, k_candidates=K_CANDIDATES)
    if CRoMa is not None:
        timed(CRoMa.compute, xw, dfw, confounder_column=CONF, m=args.m)
        timed(croma.CRoMa.compute, xw, dfw, confounder_column=CONF, m=args.m)
    xs, dfs = synthetic_view(1600, args.dim, seed=1)  # multi-tile: starts the search's thread pool path
    timed(RI.compute, xs, dfs, confounder_column=CONF, k_candidates=K_CANDIDATES)
    print(f"{'N':>6} {'metric':<6} {'croma s':>9} {'ours s':>8} {'speed-up':>9} {'load':>5}  agreement")
    sys.stdout.flush()
    for n in args.sizes:
        x, df = synthetic_view(n, args.dim, regime=args.regime)
        groups = pd.factorize(df["group_id"])[0]
        el, done, gf, gf_full = search_gflops(x, groups, max(K_CANDIDATES))
        threads = _search_threads(n)
        print(
            f"# N={n}: exact cross_group_knn (kmax={max(K_CANDIDATES)}, {threads} threads) {el:.3f} s; performed {done:.2f} GFLOP "
            f"-> {gf:.1f} GFLOP/s = {gf / gemm:.0%} of GEMM; 2n^2D equivalent {2.0 * n * n * args.dim / 1e9:.2f} "
            f"GFLOP -> {gf_full:.1f} GFLOP/s = {gf_full / gemm:.0%} of GEMM (load {load_average()})"
        )
        run_croma = n <= args.skip_croma_above
        jobs = [
            ("RI", croma.RI.compute, RI.compute, dict(k_candidates=K_CANDIDATES)),
            ("MaRI", croma.MaRI.compute, MaRI.compute, dict(k_candidates=K_CANDIDATES)),
        ]
        if CRoMa is not None:
            jobs.append(("CRoMa", croma.CRoMa.compute, CRoMa.compute, dict(m=args.m)))
        for name, ref_fn, our_fn, kw in jobs:
            ours, t_ours = timed(our_fn, x, df, confounder_column=CONF, **kw)
            if run_croma:
                ref, t_ref = timed(ref_fn, x, df, confounder_column=CONF, **kw)
                print(f"{n:>6} {name:<6} {t_ref:>9.2f} {t_ours:>8.2f} {t_ref / t_ours:>8.1f}x {load_average():>5}  {compare(ours, ref)}")
            else:
                print(f"{n:>6} {name:<6} {'-':>9} {t_ours:>8.2f} {'-':>9} {load_average():>5}  (croma skipped)")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
