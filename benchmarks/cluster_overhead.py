"""The same job on a LocalCluster of 2 workers and on 2 SLURM worker jobs (dask-jobqueue), in one
process, fresh stores each; prints wall seconds and the ratio (the SLURM overhead is job start).

    bash deploy/slurm/dev-cluster.sh          # a one-node SLURM here (root)
    python benchmarks/cluster_overhead.py     # the demo job; --job JOB for another one
    python benchmarks/cluster_overhead.py --scale-rows 100000   # a 100k x 768 scale view (ri, mari, croma; ann)

Checks that both runs store the same values.
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _job_file(src: Path, folder: Path, store: str) -> Path:
    text = src.read_text()
    text = text.replace('cache = "../demo-cache"', f'cache = "{folder / "cache"}"').replace(
        'store = "../results/demo"', f'store = "{folder / store}"')
    text += '\n[cluster]\nmaximum_jobs = 2\nminimum_jobs = 2\n[cluster.slurm]\nmemory = "5GiB"\nwalltime = "00:30:00"\n'
    path = folder / f"{store}.toml"
    path.write_text(text)
    return path


def _scale_job(folder: Path, rows: int) -> Path:
    """A job over ``make_scale_cache`` (rows × 768, view scale_all, ann backend) in ``folder``."""
    from cachescore.cache.synthetic import make_scale_cache

    make_scale_cache(folder / "cache", rows=rows, dim=768)
    path = folder / "scale.toml"
    path.write_text('schema_version = 1\n[job]\ncache = "../demo-cache"\nstore = "../results/demo"\n'
                    'views = ["scale_all"]\n[neighbors]\nbackend = "ann"\n'
                    '[execution]\nn_workers = 2\ndashboard = false\nperformance_report = false\n')
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default=str(REPO / "jobs" / "demo.toml"))
    ap.add_argument("--scale-rows", type=int, default=0, help="score a make_scale_cache view of this many rows")
    args = ap.parse_args(argv)
    from cachescore.jobs import load_job
    from cachescore.pipeline import run_job
    from cachescore.store import ResultsStore

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.scale_rows:
            args.job = str(_scale_job(folder, args.scale_rows))
        times, values = {}, {}
        for kind in ("local", "slurm"):
            job = load_job(_job_file(Path(args.job), folder, kind))
            if kind == "local" and not args.scale_rows:
                run_job(job, out=None)  # synthesise the cache and warm the imports once
                job = load_job(_job_file(Path(args.job), folder, "local2"))
            t = time.perf_counter()
            summary = run_job(job, out=io.StringIO(), cluster=kind)
            times[kind] = time.perf_counter() - t
            assert summary.ok, summary.failures
            store = ResultsStore(job.store)
            values[kind] = {fp: store.record(fp).get("value") for fp in store.fingerprints()}
        assert values["local"] == values["slurm"], "the two runs stored different values"
        print(f"{len(values['local'])} stored values identical")
        print(f"local (2 workers) {times['local']:.1f} s   slurm (2 worker jobs) {times['slurm']:.1f} s   "
              f"ratio {times['slurm'] / times['local']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
