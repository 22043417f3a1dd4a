"""A whole cache of small units (issue 25): ``cachescore run`` vs a plain in-process loop over
the public metric API on the same data, first run, no-op re-run and one added encoder.

    python benchmarks/many_units.py                  # 40 encoders x 8 views x (RI, MaRI, CRoMa) = 960 units
    python benchmarks/many_units.py --encoders 8     # a quicker 192-unit version

The cache is synthesised (``make_demo_cache``: 2,016 rows x 64 dims per encoder, float32; 8 views
of the one tileset: the demo's two and six more of 7/8 of the slides each, designs ``all`` and
``paired_2x2``), the job scores RI, MaRI and CRoMa exactly with the demo's parameters, with the
job defaults otherwise (a LocalCluster of 2 one-thread workers, dashboard, performance report).

Timed, in one process (each ``cachescore`` command is a fresh subprocess, process start included):

1. the API loop: ``RI.compute`` / ``MaRI.compute`` / ``CRoMa.compute`` for every (encoder, view),
   embeddings read with ``Cache.load_rows``, one process, no cluster;
2. ``cachescore run JOB`` on an empty store (values checked equal to the loop's, every unit);
3. ``cachescore run JOB`` again (nothing new: the no-op re-run);
4. ``cachescore status JOB`` on that store and ``cachescore --help``;
5. one more encoder written into the cache, then ``cachescore run JOB`` (only its units run);
   compared with the loop's time for that encoder's units.

Prints seconds, the per-unit overhead of the run over the loop, and the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cachescore.cache.synthetic import DEMO_TILESET

REPO = Path(__file__).resolve().parents[1]
RI_K = [5, 11, 21]
CROMA_M, CROMA_ALPHA = 5, 0.10


def _views(root: Path, n_extra: int, seed: int = 1) -> dict:
    """Write ``n_extra`` more views (7/8 of the slides of every (label, centre) cell each,
    alternating designs ``all`` and ``paired_2x2``); return ``view -> design`` of every view."""
    from cachescore.cache import Cache
    from cachescore.cache.synthetic import _CENTRES, _paired_view
    from cachescore.cache.writer import write_view

    full = Cache(root).read_view("centre_all")[["sample_id", "label", "group_id", "centre"]]
    out = {"centre_all": "all", "centre_paired": "paired_2x2"}
    rng = np.random.default_rng(seed)
    for i in range(n_extra):
        keep = []
        for _, cell in full.groupby(["label", "centre"])["group_id"]:
            ids = cell.unique()
            drop = set(rng.choice(ids, size=max(1, len(ids) // 8), replace=False))
            keep += [s for s in ids if s not in drop]
        sub = full[full["group_id"].isin(keep)]
        design = ("all", "paired_2x2")[i % 2]
        name = f"centre_{design}_s{i}"
        write_view(root, name, sub if design == "all" else _paired_view(sub, _CENTRES), tileset=DEMO_TILESET,
                   confounder_column="centre", design=design)
        out[name] = design
    return out


def _job(folder: Path, views: dict) -> Path:
    path = folder / "job.toml"
    path.write_text(
        "schema_version = 1\n[job]\nname = \"many\"\ncache = \"cache\"\nstore = \"store\"\nencoders = []\n"
        f"views = {list(views)!r}\ndesign = \"auto\"\n".replace("'", '"') +
        "[metrics]\nfamilies = [\"ri\", \"mari\", \"croma\"]\n"
        f"[metrics.ri]\nk_candidates = {RI_K}\n[metrics.mari]\nk_candidates = {RI_K}\ntau = \"auto\"\nwarn_tau = false\n"
        f"[metrics.croma]\nm = [{CROMA_M}]\nalpha = {CROMA_ALPHA}\n[neighbors]\nbackend = \"exact\"\n"
        "[execution]\nn_workers = 2\n", encoding="utf-8")
    return path


def _loop(cache_root: Path, encoders, views: dict) -> tuple[float, dict]:
    """The API loop: ``(seconds, {(encoder, view, metric): value})``."""
    import warnings

    from cachescore import RI, CRoMa, MaRI
    from cachescore.cache import Cache

    cache = Cache(cache_root, mode="r")
    values = {}
    t = time.perf_counter()
    for enc in encoders:
        for view, design in views.items():
            manifest = cache.read_view(view)
            x = cache.load_rows(enc, DEMO_TILESET, manifest["row"].to_numpy(dtype=np.int64))
            kw = dict(confounder_column="centre", evaluation_design=design)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                values[(enc, view, "ri")] = RI.compute(x, manifest, k_candidates=RI_K, **kw).value
                values[(enc, view, "mari")] = MaRI.compute(x, manifest, k_candidates=RI_K, tau=None, warn_tau=False,
                                                           **kw).value
                values[(enc, view, "croma")] = CRoMa.compute(x, manifest, m=CROMA_M, alpha=CROMA_ALPHA, **kw).value
    return time.perf_counter() - t, values


def _cli(*args, env) -> float:
    t = time.perf_counter()
    exe = shutil.which("cachescore", path=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    proc = subprocess.run([exe, *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"cachescore {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall


def _stored(store_root: Path) -> dict:
    from cachescore.store import ResultsStore

    store = ResultsStore.open(store_root, mode="r")
    out = {}
    for fp in store.fingerprints():
        r = store.record(fp)
        out[(r["encoder"], r["view"], r["metric"])] = r["value"]
    return out


def _last_run_executed(store_root: Path) -> int:
    """Units the newest run of the store executed (its provenance)."""
    import json

    runs = sorted((store_root / "runs").glob("*/provenance.json"), key=lambda p: p.stat().st_mtime)
    return int(json.loads(runs[-1].read_text())["units"]["executed"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--encoders", type=int, default=40)
    ap.add_argument("--views", type=int, default=8, help="views (>= 2: the demo's two, then 7/8-slide subsets)")
    args = ap.parse_args(argv)
    from cachescore.cache import Cache, make_demo_cache
    from cachescore.cache.writer import write_embeddings

    env = dict(os.environ, NUMBA_CACHE_DIR=os.environ.get("NUMBA_CACHE_DIR", "/tmp/cachescore-numba-cache"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cache_root = folder / "cache"
        names = [f"enc{i:02d}" for i in range(args.encoders)]
        make_demo_cache(cache_root, n_slides_per_cell=14, tiles_per_slide=24, dim=64, encoders=names, seed=0)
        views = _views(cache_root, args.views - 2)
        job = _job(folder, views)
        units = len(names) * len(views) * 3
        print(f"{len(names)} encoders x {len(views)} views x 3 metrics = {units} units, "
              f"{len(Cache(cache_root).read_view('centre_all'))} rows x 64 dims per full view", flush=True)

        loop_s, loop_values = _loop(cache_root, names, views)
        print(f"API loop (one process)         {loop_s:7.1f} s   {1000 * loop_s / units:6.1f} ms/unit", flush=True)
        run_s = _cli("run", str(job), "--quiet", env=env)
        stored = _stored(folder / "store")
        same = sum(stored.get(k) == v or (v != v and stored.get(k) != stored.get(k)) for k, v in loop_values.items())
        print(f"cachescore run (2 workers)     {run_s:7.1f} s   {1000 * (run_s - loop_s) / units:+6.1f} ms/unit over "
              f"the loop   run/loop {run_s / loop_s:.2f}x   values identical {same}/{units}", flush=True)
        noop_s = _cli("run", str(job), "--quiet", env=env)
        print(f"no-op re-run                   {noop_s:7.1f} s   units executed {_last_run_executed(folder / 'store')}",
              flush=True)
        status_s = _cli("status", str(job), env=env)
        help_s = _cli("--help", env=env)
        print(f"cachescore status              {status_s:7.2f} s\ncachescore --help              {help_s:7.2f} s",
              flush=True)

        rng = np.random.default_rng(7)
        cache = Cache(cache_root)
        base = cache.load_rows(names[0], DEMO_TILESET, np.arange(len(cache.read_tileset(DEMO_TILESET))))
        write_embeddings(cache_root, "enc-new", DEMO_TILESET, (base + 0.05 * rng.standard_normal(base.shape)).astype("float32"))
        new_loop_s, _ = _loop(cache_root, ["enc-new"], views)
        add_s = _cli("run", str(job), "--quiet", env=env)
        n_new = len(views) * 3
        executed = _last_run_executed(folder / "store")
        print(f"one more encoder ({n_new} units): run {add_s:.1f} s, units executed {executed}, vs their API loop "
              f"{new_loop_s:.1f} s (limit 2x + 5 s = {2 * new_loop_s + 5:.1f} s)", flush=True)
        if executed != n_new:
            print(f"the added encoder's run executed {executed} units, not {n_new}", file=sys.stderr)
            return 1
        if same != units:
            print("VALUES DIFFER", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
