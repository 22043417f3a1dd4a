"""What the end of a run costs with nothing new: publishing ``scores.parquet`` for ~960 metric
records of ~2,000 rows each (issue 25: "a no-op re-score takes 47 s", ~88% in recomputing every
CI), with every leaderboard group recomputed vs the groups kept in ``<store>/table-cache``.

    python benchmarks/table_publish.py            # 24 scored records (4 encoders x 2 views x 3) + 936 copies

It scores a demo-structured cache of 2,016 rows per view (RI, MaRI, CRoMa; no probe) once, then
copies each stored record under ``--copies`` more encoder names (same per-unit values: the same
work per record as a distinct encoder), and times ``publish_results`` three ways in one process:
cold (no kept groups; the copies' entries computed, the 24 scored ones kept by their tasks),
no-op (every group kept) and one new encoder (the groups it joins, re-ranked from kept entries).
Prints seconds, the per-record cost and the ratio; checks the tables are identical.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=39, help="copies of each scored record under another encoder name "
                    "(default 39: 24 scored + 936 copies = 960 records)")
    args = ap.parse_args(argv)
    from cachescore.cache import make_demo_cache
    from cachescore.jobs import load_job
    from cachescore.jobs.sections import as_dict
    from cachescore.pipeline import plan_job, run_job
    from cachescore.results import publish_results
    from cachescore.store import TABLE_CACHE_DIR, ResultsStore

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_demo_cache(root / "cache", n_slides_per_cell=14, tiles_per_slide=24, dim=32, seed=0)
        text = (REPO / "jobs" / "demo.toml").read_text(encoding="utf-8")
        text = text.replace('cache = "../demo-cache"', f'cache = "{root / "cache"}"').replace(
            'store = "../results/demo"', f'store = "{root / "store"}"').replace("synthesise = true", "synthesise = false")
        text = text[: text.index("\n[probe]")] + "\n" + text[text.index("\n[execution]"):]  # metric units only
        (root / "job.toml").write_text(text, encoding="utf-8")
        job = load_job(root / "job.toml")
        assert run_job(job, out=io.StringIO(), processes=False).ok
        store = ResultsStore(job.store)
        fps = list(plan_job(job, store=store).record_fingerprints())
        copies = []
        for fp in fps:
            rec, per_unit = store.record(fp), store.per_unit(fp)
            for c in range(args.copies):
                twin = hashlib.sha256(f"{fp}-copy-{c}".encode()).hexdigest()
                store.write_unit(twin, record=dict(rec, encoder=f"{rec['encoder']}-{c:02d}"), per_unit=per_unit)
                copies.append(twin)
        every = fps + copies
        rows = len(store.per_unit(fps[0]))
        kw = dict(bootstrap=as_dict(job.metrics.bootstrap), min_support=job.report.min_support)

        def timed() -> float:
            t = time.perf_counter()
            publish_results(store, job.cache, every, **kw)
            return time.perf_counter() - t

        for p in (Path(job.store) / TABLE_CACHE_DIR).glob("*.parquet"):
            p.unlink()
        cold = timed()
        table = pd.read_parquet(Path(job.store) / "scores.parquet")
        noop = timed()
        assert pd.read_parquet(Path(job.store) / "scores.parquet").equals(table)
        # one more encoder: copy enc0's records under a new name (joins 6 groups of 2 views x 3 metrics)
        new = []
        for fp in fps:
            rec = store.record(fp)
            if rec["encoder"] == "enc0":
                twin = hashlib.sha256(f"{fp}-new".encode()).hexdigest()
                store.write_unit(twin, record=dict(rec, encoder="enc-new"), per_unit=store.per_unit(fp))
                new.append(twin)
        every += new
        added = timed()
    n = len(every) - len(new)
    print(f"{n} metric records of {rows} rows each ({len(fps)} scored, {len(copies)} copies), "
          f"n_boot = {kw['bootstrap']['n_boot']}")
    print(f"publish, every group recomputed : {cold:7.2f} s  ({1000 * cold / n:.1f} ms per record)")
    print(f"publish, nothing new (kept)     : {noop:7.2f} s  ({1000 * noop / n:.2f} ms per record)  {cold / noop:.0f}x")
    print(f"publish, one new encoder        : {added:7.2f} s  (its {len(new)} records join {len(new)} groups, "
          "whose ranks all change: those groups are re-ranked from their kept entries plus the new ones)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
