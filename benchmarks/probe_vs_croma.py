"""Benchmark: PathoROB camelyon probe sweep, croma 1.0.1 vs cachescore's Dask fan-out.

Synthetic camelyon-shaped cohort (spec downstream §8): 2 confounders x 2 classes, 17 slides per
cell, ``--rps`` rows per slide, D = ``--dim`` Gaussian features stored as float32 with class and
confounder offsets plus a per-slide effect; camelyon schedule (8 splits), ``--iterations``
replicates, default seed 1000, in-domain matrix only.

- croma runs as a user runs it: ``croma.probe_sweep`` in this process, default BLAS threads.
- cachescore runs ``probe_sweep(..., client=...)`` on a ``LocalCluster`` of N single-threaded
  worker processes for each N in ``--workers`` (0 = in-process, no cluster). Cluster start-up is
  timed separately and not included in the sweep time.

Prints wall times, the speed-up over croma and whether every matrix is bit-identical to croma's.
Full size (rps 300, D 768, 20 iterations) takes ~20 minutes for croma on 2 cores; a quick check:

    python benchmarks/probe_vs_croma.py --iterations 1 --rps 30
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings

import numpy as np


def synthetic_camelyon(rps: int, dim: int, slides: int = 17, seed: int = 0):
    rng = np.random.default_rng(seed)
    xs, cs, ys = [], [], []
    for i in range(2):
        for j in range(2):
            n = slides * rps
            offset = np.zeros(dim, dtype=np.float64)
            offset[: dim // 8] += 0.35 * (1 if j else -1)  # biology
            offset[dim // 8 : dim // 4] += 0.35 * (1 if i else -1)  # confounder (centre)
            slide_effect = np.repeat(rng.normal(0, 0.3, size=(slides, dim)), rps, axis=0)
            xs.append((offset + slide_effect + rng.normal(0, 1.0, size=(n, dim))).astype(np.float32))
            cs.append(np.full(n, i, dtype=np.int64))
            ys.append(np.full(n, j, dtype=np.int64))
    return np.concatenate(xs), np.concatenate(cs), np.concatenate(ys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--rps", type=int, default=300, help="rows per slide (published: 300)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="worker-process counts to run (0 = in-process, no cluster)")
    parser.add_argument("--skip-croma", action="store_true", help="do not run croma (no parity check)")
    parser.add_argument("--croma-iterations", type=int, default=None,
                        help="run croma for only the first K replicates (default: --iterations); its time "
                             "is extrapolated linearly to --iterations and labelled so, and parity is checked "
                             "on those K columns (a sweep's first K columns do not depend on the total, "
                             "spec downstream.md section 3.4)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    import sklearn
    from distributed import Client, LocalCluster
    from sklearn.exceptions import ConvergenceWarning

    from cachescore.downstream import pathorob_schedule, probe_sweep

    x, c, y = synthetic_camelyon(args.rps, args.dim)
    schedule = pathorob_schedule("camelyon", rows_per_slide=args.rps)
    kwargs = dict(schedule=schedule, rows_per_slide=args.rps, iterations=args.iterations, seed=args.seed)
    print(f"camelyon synthetic: {x.shape[0]} rows x {x.shape[1]} (float32), rps {args.rps}, "
          f"{len(schedule)} splits x {args.iterations} iterations; python {platform.python_version()}, "
          f"numpy {np.__version__}, scikit-learn {sklearn.__version__}")  # fmt: skip
    results: dict = {"rows": int(x.shape[0]), "dim": args.dim, "rps": args.rps,
                     "iterations": args.iterations, "runs": []}  # fmt: skip

    reference = None
    croma_s = None
    if not args.skip_croma:
        import croma

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            k = args.croma_iterations or args.iterations
            start = time.perf_counter()
            reference = croma.probe_sweep(x, c, y, **{**kwargs, "iterations": k})
            measured_s = time.perf_counter() - start
        croma_s = measured_s * args.iterations / k
        note = "" if k == args.iterations else f" (measured {measured_s:.2f} s for {k} replicates, extrapolated)"
        print(f"croma {croma.__version__} (default BLAS threads): {croma_s:9.2f} s{note}")
        results.update(croma_s=croma_s, croma_measured_s=measured_s, croma_iterations=k)

    all_identical = True
    for n in args.workers:
        if n == 0:
            start = time.perf_counter()
            matrix = probe_sweep(x, c, y, **kwargs)
            sweep_s, startup_s = time.perf_counter() - start, 0.0
            label = "cachescore in-process (1 BLAS thread)"
        else:
            start = time.perf_counter()
            with LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                              dashboard_address=None) as cluster, Client(cluster) as client:  # fmt: skip
                client.wait_for_workers(n)
                startup_s = time.perf_counter() - start
                start = time.perf_counter()
                matrix = probe_sweep(x, c, y, client=client, **kwargs)
                sweep_s = time.perf_counter() - start
            label = f"cachescore LocalCluster {n} x 1-thread worker(s)"
        identical = None if reference is None else bool(np.array_equal(matrix[:, : reference.shape[1]], reference))
        all_identical &= identical is not False
        ratio = f"{croma_s / sweep_s:6.2f}x vs croma" if croma_s else ""
        same = "" if identical is None else f"identical to croma: {identical}"
        print(f"{label}: {sweep_s:9.2f} s (+{startup_s:.1f} s cluster start)  {ratio}  {same}")
        results["runs"].append({"workers": n, "sweep_s": sweep_s, "startup_s": startup_s,
                                "speedup_vs_croma": (croma_s / sweep_s) if croma_s else None,
                                "identical_to_croma": identical})  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
