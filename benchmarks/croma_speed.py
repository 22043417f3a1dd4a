"""Benchmark: CRoMa (m=5, start_k=200, growth 2.0) on a realistic synthetic view, cachescore vs croma.

Data (DESIGN §6 issue "CRoMa >= 100x faster than croma at N = 8,000"): N rows, D = 384, float32,
2 labels x 4 confounders, slides (``group_id``) of 20 tiles; each row is a label offset + a
confounder offset + a per-slide offset + isotropic noise, so that typed neighbourhoods are neither
trivial nor degenerate. Times are wall seconds (``time.perf_counter``; our kernels run their
tiles on ``--search-threads`` Python threads, default the CPU affinity) and CPU seconds of the
process (``time.process_time``, all threads), best of ``--repeats``; the load average is printed
with every line (on a shared machine wall time depends on it).

    python benchmarks/croma_speed.py --sizes 8000                   # ours only
    python benchmarks/croma_speed.py --sizes 2000 --croma           # ours vs croma (croma is slow)
    python benchmarks/croma_speed.py --sizes 8000 --search-threads 1 2
    python benchmarks/croma_speed.py --sizes 8000 --profile         # cProfile (1 search thread)
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from metrics_vs_croma import CONF, synthetic_view  # sibling script (benchmarks/ is on sys.path)


def croma_view(n: int, dim: int = 384, *, seed: int = 0):
    """``(features float32 (n, dim), manifest DataFrame)``: the balanced view of
    ``metrics_vs_croma.py`` (2 labels x 4 confounders, slides of 20 tiles), so both benchmarks
    time the same data."""
    return synthetic_view(n, dim, seed=seed, regime="balanced")


def best_of(fn, repeats: int):
    """``(result, best CPU seconds, best wall seconds)`` over ``repeats`` calls of ``fn()``."""
    cpu, wall, out = [], [], None
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return out, min(cpu), min(wall)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--croma", action="store_true", help="also time croma 1.0.1 (one run; slow)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads outside our kernels (default 1)")
    p.add_argument(
        "--search-threads", type=int, nargs="+", default=[None],
        help="Python threads of our kernels (BLAS is pinned to 1 inside them); default: CPU affinity",
    )
    args = p.parse_args(argv)

    from threadpoolctl import threadpool_limits

    from cachescore.metrics.croma import CRoMa
    from cachescore.neighbors.typed import search_threads, typed_knn

    with threadpool_limits(args.threads):
        for n in args.sizes:
            x, df = croma_view(n)
            kw = dict(confounder_column=CONF, m=5, start_k=200, k_growth_factor=2.0)
            if args.profile:
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                CRoMa.compute_with(typed_knn, x, df, threads=1, **kw)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
            ours = None
            for threads in args.search_threads:
                ours, cpu, wall = best_of(lambda: CRoMa.compute_with(typed_knn, x, df, threads=threads, **kw), args.repeats)
                load = os.getloadavg()[0]
                print(
                    f"N={n}: cachescore {wall:.3f} s wall, {cpu:.3f} s CPU (best of {args.repeats}; "
                    f"search threads {search_threads(threads)}; load {load:.1f}); "
                    f"value={ours.value:.6f} k {ours.k_start}->{ours.k_final} retries={ours.retries}",
                    flush=True,
                )
            if args.croma:
                import croma

                ref, rcpu, rwall = best_of(lambda: croma.CRoMa.compute(x, df, **kw), 1)
                diff = float(np.max(np.abs(ref.sample_values - ours.sample_values)))
                same_diag = (ref.k_start, ref.k_final, ref.retries) == (ours.k_start, ours.k_final, ours.retries)
                print(
                    f"N={n}: croma {rwall:.2f} s wall, {rcpu:.2f} s CPU: speed-up {rwall / wall:.0f}x wall "
                    f"(last line); max |dv| {diff:.2e}; diagnostics equal: {same_diag}; load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
