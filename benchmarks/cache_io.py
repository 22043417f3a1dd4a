"""Cache I/O side by side (issue 27): the same rows stored four ways, read by a worker and scored.

    python benchmarks/cache_io.py --rows 200000 --dim 768 --workdir /work/bench --json io.json

Layouts, all holding the same ``--rows`` × ``--dim`` float32 rows of the synthetic scale cache
(:func:`cachescore.cache.synthetic.make_scale_cache`; reused when present):

* ``npy``       — the default ``.npy`` shards on local disk (memory-mapped reads);
* ``zarr``      — Zarr v3 shards on local disk (zstd, whole-row chunks);
* ``zarr-s3``   — the same Zarr cache in S3 (moto's standalone server on 127.0.0.1, s3fs);
* ``npy-s3``    — the ``.npy`` cache in S3 (ranged requests);
* ``linked``    — a TRIDENT-like folder (one ``.h5`` per slide: ``features``, ``coords``) imported
  with ``--link`` (read in place).

For each it prints rows/s and MB/s of (a) contiguous blocks (``--block-rows`` at a time, what a
chunk task reads) and (b) a sorted random gather (``--gather-rows``, what a view or a calibration
reads), both through :class:`cachescore.cache.RowSource` as a worker does; and (``--run``) the
wall time of a full-view run (RI, MaRI, CRoMa, out-of-core ann, ``--workers``) with a digest of
every stored value, which must equal the local ``npy`` run's (bit-identical values from S3).
It also times the TRIDENT folder's copy import (``.npy`` shards) against its ``--link`` import
and compares their disk use. Loopback S3 here measures request overhead, not a network: compare
ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def scale_cache(a) -> Path:
    from cachescore.cache.synthetic import make_scale_cache

    root = Path(a.workdir) / f"io-cache-{a.rows}x{a.dim}"
    if not (root / "cache.json").is_file():
        print(f"writing {a.rows} x {a.dim} scale cache to {root}", flush=True)
        make_scale_cache(root, rows=a.rows, dim=a.dim, encoders=["enc0"], seed=0, overwrite=True)
    return root


def zarr_copy(src: Path, dst: Path) -> float:
    """The npy cache rewritten with Zarr shards (same tables); returns the write seconds."""
    from cachescore.cache import Cache, write_embeddings
    from cachescore.cache.formats import StorageOptions

    if (dst / "cache.json").is_file():
        return float("nan")
    shutil.rmtree(dst, ignore_errors=True)
    for part in ("tilesets", "views"):
        shutil.copytree(src / part, dst / part)
    cache = Cache(src)
    t0 = time.perf_counter()
    for tileset in cache.tilesets():
        for enc in cache.encoders():
            rows = cache.load_rows(enc, tileset)  # the whole array (rows x dim float32) in memory
            write_embeddings(dst, enc, tileset, rows, storage=StorageOptions(format="zarr"))
    shutil.copy(src / "cache.json", dst / "cache.json")
    return time.perf_counter() - t0


def trident_folder(src: Path, dst: Path, tiles_per_slide: int | None = None) -> Path:
    """One ``<slide>.h5`` per slide (``features``, ``coords``) from the scale cache, and the slide
    table (``slides.csv``: group_id, label, centre). ``tiles_per_slide``: regroup the rows into
    slides of that many tiles (a whole-slide image at 20x has thousands; the scale cache's
    slides have 20-100, for its metrics); their label and centre are their first row's."""
    import h5py
    from cachescore.cache import Cache

    if (dst / "slides.csv").is_file():
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    (dst / "feats").mkdir(parents=True)
    cache = Cache(src)
    tiles = cache.read_tileset("tiles")
    rows = cache.load_rows("enc0", "tiles")
    if tiles_per_slide:
        tiles["group_id"] = [f"slide{i // tiles_per_slide:05d}" for i in range(len(tiles))]
    g = tiles["group_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    stops = np.r_[starts[1:], len(g)]
    for lo, hi in zip(starts, stops):
        with h5py.File(dst / "feats" / f"{g[lo]}.h5", "w") as fh:
            fh["features"] = rows[lo:hi]
            fh["coords"] = np.stack([np.arange(hi - lo) * 224, np.zeros(hi - lo, np.int64)], axis=1)
    tiles.iloc[starts][["group_id", "label", "centre"]].to_csv(dst / "slides.csv", index=False)
    return dst


def imports(folder: Path, workdir: Path, tag: str = "", encoders: int = 1) -> dict:
    """Copy import (``.npy`` shards) vs ``--link`` import of the TRIDENT folder as ``encoders``
    encoders (the same files under each name: what a cache of several encoders of one dim
    costs): seconds and bytes."""
    from cachescore.cli import main

    out = {"encoders": encoders}
    names = [arg for i in range(encoders) for arg in ("--encoder", f"enc{i}={folder / 'feats'}")]
    for kind, extra in (("copy", []), ("link", ["--link"])):
        root = workdir / f"io-trident-{kind}{tag}"
        shutil.rmtree(root, ignore_errors=True)
        t0 = time.perf_counter()
        rc = main(["import", str(root), "--tileset", "tiles", "--manifest", str(folder / "slides.csv"),
                   "--layout", "per_slide", "--view", "scale_all=centre:all"] + names + extra)
        assert rc == 0, kind
        out[kind] = {"seconds": time.perf_counter() - t0, "bytes": _du(root), "root": str(root)}
    out["time_ratio"] = out["link"]["seconds"] / out["copy"]["seconds"]
    out["disk_ratio"] = out["link"]["bytes"] / out["copy"]["bytes"]
    return out


def read_rates(root: str, a) -> dict:
    """Rows/s and MB/s of contiguous blocks and of a sorted random gather through a RowSource."""
    from cachescore.cache import Cache

    cache = Cache(root)
    tileset = cache.tilesets()[0]
    meta = cache.validate_embeddings("enc0", tileset, checksums=False, finite=False)
    src = cache.row_source("enc0", tileset)
    n, row_bytes = meta.n_rows, meta.dim * meta.dtype.itemsize
    t0 = time.perf_counter()
    done = 0
    for lo in range(0, n, a.block_rows):
        done += src.load_rows(np.arange(lo, min(n, lo + a.block_rows))).shape[0]
    t_block = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    pick = np.sort(rng.choice(n, size=min(n, a.gather_rows), replace=False))
    t0 = time.perf_counter()
    src.load_rows(pick)
    t_gather = time.perf_counter() - t0
    return {"block_rows_s": done / t_block, "block_mb_s": done * row_bytes / t_block / 1e6,
            "gather_rows_s": pick.size / t_gather, "gather_mb_s": pick.size * row_bytes / t_gather / 1e6,
            "block_s": t_block, "gather_s": t_gather}


def run_view(cache: str, workdir: Path, name: str, a, env: dict) -> dict:
    from stored_values_digest import digest_store

    store = workdir / f"io-store-{name}"
    shutil.rmtree(store, ignore_errors=True)
    job = workdir / f"io-job-{name}.toml"
    job.write_text("\n".join([
        "schema_version = 1", "[job]", f'name = "io-{name}"', f'cache = "{cache}"', f'store = "{store}"',
        'views = ["scale_all"]', "[metrics]", 'families = ["ri", "mari", "croma"]',
        "[metrics.ri]", "k_candidates = [5, 11, 21]", "[metrics.mari]", "k_candidates = [5, 11, 21]",
        "[metrics.croma]", "m = [5]", "[neighbors]", 'backend = "ann"', "recall_target = 0.99",
        "recall_sample = 1000", "seed = 0", "[execution]", f"n_workers = {a.workers}", "dashboard = false",
        "performance_report = false", ""]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "cachescore.cli", "run", str(job), "--quiet"], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return {"wall_s": wall, "digest": digest_store(store, ignore=("inputs",)), "out": proc.stdout.strip()[-300:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--workdir", default="/tmp/cachescore-io")
    p.add_argument("--block-rows", type=int, default=65_536)
    p.add_argument("--gather-rows", type=int, default=20_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tiles-per-slide", type=int, default=5000,
                   help="tiles per slide of the second TRIDENT folder, for the import comparison")
    p.add_argument("--import-encoders", type=int, default=8,
                   help="encoders of the multi-encoder import comparison (the same files under each name)")
    p.add_argument("--imports-only", action="store_true", help="only the copy vs --link import comparison")
    p.add_argument("--no-run", dest="run", action="store_false", help="reads and imports only")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    import s3_endpoint as se

    result: dict = {"rows": a.rows, "dim": a.dim}
    npy = scale_cache(a)
    zroot = work / f"io-zarr-{a.rows}x{a.dim}"
    zsec = zarr_copy(npy, zroot)
    result["zarr_write_s"], result["bytes"] = zsec, {"npy": _du(npy), "zarr": _du(zroot)}
    folder = trident_folder(npy, work / f"io-trident-{a.rows}x{a.dim}")
    result["imports"] = imp = imports(folder, work)
    big = trident_folder(npy, work / f"io-trident-{a.rows}x{a.dim}-t{a.tiles_per_slide}", a.tiles_per_slide)
    result["imports_wsi"] = imports(big, work, tag=f"-t{a.tiles_per_slide}")
    result["imports_wsi_many"] = imports(big, work, tag=f"-t{a.tiles_per_slide}-e{a.import_encoders}",
                                         encoders=a.import_encoders)
    for what, r in (("the scale cache's slides (20-100 tiles), 1 encoder", imp),
                    (f"slides of {a.tiles_per_slide} tiles, 1 encoder", result["imports_wsi"]),
                    (f"slides of {a.tiles_per_slide} tiles, {a.import_encoders} encoders", result["imports_wsi_many"])):
        print(f"import, {what}: copy {r['copy']['seconds']:.2f} s / {r['copy']['bytes'] / 2**20:.0f} MiB, link "
              f"{r['link']['seconds']:.2f} s / {r['link']['bytes'] / 2**20:.2f} MiB -> time "
              f"{100 * r['time_ratio']:.2f} %, disk {100 * r['disk_ratio']:.3f} %", flush=True)

    if a.imports_only:
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1, default=str))
        return 0
    server, ep = se.start_endpoint()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ep.key, AWS_SECRET_ACCESS_KEY=ep.secret, AWS_ENDPOINT_URL=ep.url,
               AWS_DEFAULT_REGION="us-east-1")
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                                           "AWS_DEFAULT_REGION")})
    try:
        bucket = se.new_bucket()
        t0 = time.perf_counter()
        se.upload_folder(npy, f"s3://{bucket}/npy")
        se.upload_folder(zroot, f"s3://{bucket}/zarr")
        result["upload_s"] = time.perf_counter() - t0
        layouts = {"npy": str(npy), "zarr": str(zroot), "npy-s3": f"s3://{bucket}/npy",
                   "zarr-s3": f"s3://{bucket}/zarr", "linked": imp["link"]["root"]}
        result["reads"], result["runs"] = {}, {}
        print(f"{'layout':8s} {'block rows/s':>13s} {'MB/s':>8s} {'gather rows/s':>14s} {'MB/s':>8s}", flush=True)
        for name, root in layouts.items():
            r = result["reads"][name] = read_rates(root, a)
            print(f"{name:8s} {r['block_rows_s']:13.0f} {r['block_mb_s']:8.1f} {r['gather_rows_s']:14.0f} "
                  f"{r['gather_mb_s']:8.1f}", flush=True)
        if a.run:
            base = None
            for name, root in layouts.items():
                r = result["runs"][name] = run_view(root, work, name, a, env)
                base = r["digest"] if base is None else base
                r["identical_to_npy"] = r["digest"] == base
                print(f"run {name:8s} {r['wall_s']:7.1f} s  values identical to npy: {r['identical_to_npy']} "
                      f"({len(r['digest'])} units)", flush=True)
    finally:
        server.stop()
    if a.json:
        for r in result.get("runs", {}).values():
            r.pop("digest", None)
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
