"""Cluster bootstrap of stored per-unit values at 200k rows: ours (vectorised: cluster multiplicities
× per-group sums / one sort per value vector) vs croma 1.0.1's ``bootstrap_pooled_median`` and a
plain per-replicate concatenation for the pooled ratio, on the same data, in one process.

    python benchmarks/bootstrap_speed.py --rows 200000 --groups 2000 --n-boot 2000

Prints seconds and ratios, and checks that both sides give the same interval.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _best(repeat: int, call):
    """``(fastest wall seconds of repeat calls, the last result)``: the first call of either side
    pays one-off costs (page faults of fresh buffers, BLAS start) that a long run does not."""
    times, out = [], None
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t)
    return min(times), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--groups", type=int, default=2_000)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--skip-reference", action="store_true", help="ours only (the reference takes minutes)")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many calls on each side (default 3)")
    args = ap.parse_args(argv)
    from croma.metrics import bootstrap as ref

    from cachescore.metrics import bootstrap as ours

    rng = np.random.default_rng(0)
    groups = np.sort(rng.integers(0, args.groups, args.rows)).astype(str)
    margins = rng.normal(0.05, 0.2, args.rows)
    so = rng.integers(0, 22, args.rows).astype(float)
    os_ = (21 - so) * (rng.random(args.rows) < 0.97)
    print(f"{args.rows} rows, {np.unique(groups).size} groups, n_boot = {args.n_boot}")

    t_med, ci = _best(args.repeat, lambda: ours.bootstrap_pooled_median(margins, groups, n_boot=args.n_boot))
    t = time.perf_counter()
    rci = ours.bootstrap_pooled_ratio(so, os_, groups, n_boot=args.n_boot)
    t_ratio = time.perf_counter() - t
    print(f"ours   median (CRoMa) {t_med:7.2f} s   pooled ratio (RI/MaRI) {t_ratio:7.2f} s")
    if args.skip_reference:
        return 0
    t_ref, want = _best(args.repeat, lambda: ref.bootstrap_pooled_median(margins, groups, n_boot=args.n_boot))
    assert (ci.lo, ci.hi) == (want.lo, want.hi), (ci, want)
    ids = np.unique(groups)
    members = [np.flatnonzero(groups == g) for g in ids]
    r = np.random.default_rng(0)
    t = time.perf_counter()
    boot = np.empty(args.n_boot)
    for b in range(args.n_boot):
        sel = np.concatenate([members[p] for p in r.integers(0, ids.size, ids.size)])
        s, o = so[sel].sum(), os_[sel].sum()
        boot[b] = s / (s + o)
    t_plain = time.perf_counter() - t
    plain = ours.percentile_ci(boot, rci.point, 0.95, args.n_boot)
    assert np.isclose(plain.lo, rci.lo, rtol=1e-12) and np.isclose(plain.hi, rci.hi, rtol=1e-12)
    print(f"croma  median          {t_ref:7.2f} s   plain per-replicate ratio {t_plain:7.2f} s")
    print(f"speed-up: median {t_ref / t_med:.1f}x, pooled ratio {t_plain / t_ratio:.1f}x (same intervals)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
