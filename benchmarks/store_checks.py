"""What the store-safety checks cost (issue 22), and whether this BLAS is shape-invariant.

1. Planning cost of the checksum predicate (ADR-0014): a store of ``--units`` records with per-unit
   tables of ``--rows`` rows (RI-like columns) is written, then every record is asked
   ``has(fp)`` twice in a fresh ``ResultsStore`` — once with the old predicate (envelope + size,
   ``inspect_envelope(checksum=False)``) and once with today's (sha256 too) — and the per-unit
   overhead is printed with the ratio.
2. GEMM shape dependence (tests/blas_equality.py): entries of ``A[:m] @ B.T`` that differ from the
   same rows of ``A @ B.T``, float32 and float64, one BLAS thread (``OPENBLAS_CORETYPE`` as set
   by the environment).

    python benchmarks/store_checks.py --units 960 --rows 2000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import pandas as pd
from threadpoolctl import threadpool_limits

from cachescore.store import ResultsStore, fingerprint


def checksum_cost(units: int, rows: int) -> None:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as root:
        store = ResultsStore(root)
        fps = [fingerprint({"unit": i}) for i in range(units)]
        for fp in fps:
            table = pd.DataFrame({"source_index": np.arange(rows), "subset": "dataset",
                                  "so": rng.integers(0, 20, rows), "os": rng.integers(0, 20, rows),
                                  "value": rng.random(rows)})
            store.write_unit(fp, record={"encoder": "e", "view": "v", "metric": "ri", "value": 0.5}, per_unit=table)
        size = sum(os.path.getsize(p) for p in store.path.glob("units/*/.*.parquet")) / units
        times = {}
        for name, check in (("size only (before)", False), ("sha256 (now)", True)):
            fresh = ResultsStore(root)  # no memo
            t0 = time.perf_counter()
            ok = sum(fresh.inspect_envelope(fp, checksum=check)[0] is not None for fp in fps)
            times[name] = time.perf_counter() - t0
            assert ok == units
        base, now = times["size only (before)"], times["sha256 (now)"]
        print(f"store: {units} records, per-unit tables of {rows} rows ({size / 1024:.1f} KiB each)")
        for name, t in times.items():
            print(f"  {name:20s} {t:7.3f} s  {1e3 * t / units:6.3f} ms/unit")
        print(f"  checksum overhead: {1e3 * (now - base) / units:.3f} ms/unit, ratio {now / base:.2f}x")


def gemm_shape_dependence() -> None:
    rng = np.random.default_rng(0)
    print(f"GEMM shape dependence (OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '<unset>')}):")
    with threadpool_limits(limits=1, user_api="blas"):
        for dtype in (np.float32, np.float64):
            a = rng.standard_normal((260, 16)).astype(dtype)
            b = rng.standard_normal((260, 16)).astype(dtype)
            full = a @ b.T
            for m in (70, 64, 16):
                rows = int((a[:m] @ b.T != full[:m]).sum())
                cols = int((a @ b[:m].T != full[:, :m]).sum())
                print(f"  {np.dtype(dtype).name}  m={m:3d}: {rows:5d} of {m * 260} entries differ by rows, "
                      f"{cols:5d} by columns")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--units", type=int, default=960)
    p.add_argument("--rows", type=int, default=2000)
    args = p.parse_args()
    checksum_cost(args.units, args.rows)
    gemm_shape_dependence()


if __name__ == "__main__":
    main()
