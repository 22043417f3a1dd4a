"""Peak memory and time of an out-of-core calibration's probe geometry (issue 26: the driver's n² term).

    python benchmarks/probe_geometry_memory.py --rows 2000000 4000000 10000000

For each scope size n it builds the partition geometry of C = n / ROWS_PER_CLUSTER clusters
(random unit centroids) from the centroids, runs :func:`cachescore.neighbors.partition.probe_ladder`
over 8 typed pools (what a 2-label × 4-centre scope has) and :func:`~cachescore.neighbors.partition.probe_chain`,
and prints the peak traced by ``tracemalloc`` (numpy's allocations included) with what one (C, C)
float64 array would take, so a geometry that grows as n² shows as a ratio near or above 1. The
ladder is printed too: a memory change must not change a rule (compare it with the same command
on the code before).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from cachescore.neighbors.large_scope import ROWS_PER_CLUSTER
from cachescore.neighbors.partition import ProbeGeometry, probe_chain, probe_ladder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[2_000_000, 4_000_000])
    p.add_argument("--pools", type=int, default=8)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    for n in a.rows:
        c = max(1, n // ROWS_PER_CLUSTER)
        x = rng.standard_normal((c, 16))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        pools = [(rng.integers(0, 600, c), rng.integers(0, 600, c), rng.integers(0, c, 4000), rng.integers(0, c, 4000))
                 for _ in range(a.pools)]
        tracemalloc.start()
        t0 = time.perf_counter()
        geometry = ProbeGeometry(x)
        ladder = probe_ladder(geometry, pools, 0.99, 50)
        t1 = time.perf_counter()
        probe_chain(geometry)
        t2 = time.perf_counter()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        full = c * c * 8
        print(f"n={n:>11,} C={c:6d}: peak {peak / 2**20:8.1f} MiB = {peak / full:.3f} x one (C, C) float64 "
              f"({full / 2**20:.1f} MiB); ladder {t1 - t0:.2f} s, chain {t2 - t1:.2f} s; "
              f"ladder {[(round(r.radius, 6), r.min_rows) for r in ladder[:2]]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
