"""Command line: ``cachescore run | rescore | watch | status | report | import | demo | schema``.

Commands are thin: parse, call the library, format, return an exit code.

* ``cachescore run JOB [--scheduler ADDR]`` (alias ``rescore``) – score every pending unit of a job
  (:func:`cachescore.pipeline.run_job`). Exit 0 when every unit is scored, 1 when any unit
  failed (a table of failures is printed), 2 for a job-level error (bad job file, missing cache,
  unreachable scheduler).
* ``cachescore status JOB [--verify]`` – per unit (probe units: per APD/nIPD record): ``done``,
  ``failed`` (with its error), ``stale`` (a result exists for the same encoder/view/design/metric/
  params but older inputs or code; what changed is named) or ``missing`` (why it is new).
  ``--verify`` adds the cache health check (:func:`cachescore.cache.verify_cache`); exit 1 when it
  finds problems.
* ``cachescore watch JOB [--interval S] [--max-runs N]`` – poll the cache and run the job whenever
  there is new work (:func:`cachescore.pipeline.watch.watch_job`); exit 1 if a unit failed.
* ``cachescore report JOB [--out HTML]`` – the static HTML report of the job's store
  (:func:`cachescore.report.build_report`).
* ``cachescore import …`` – build a cache from ``.npy`` files (:func:`cachescore.cache.import_cache`).
* ``cachescore demo [DIR]`` – write the self-contained demo job into DIR and run it.
* ``cachescore schema`` – list every job-file key with its default and meaning.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cache import Cache, import_cache, verify_cache
from .jobs import describe_schema, load_job
from .pipeline import UnitKind, run_job, unit_status
from .pipeline.probe_unit import probe_record_fingerprint, probe_record_keys
from .pipeline.watch import watch_job
from .report import build_report
from .store import ResultsStore
from .store.atomic import atomic_write_bytes

__all__ = ["main", "build_parser", "format_table", "DEMO_JOB"]

#: The self-contained demo job (the same content as ``jobs/demo.toml`` in the repository).
DEMO_JOB = """\
# Self-contained demo: synthesises a small cache (4 encoders whose confounder strength grows
# by construction, enc0 weakest ... enc3 strongest) on first use, then scores RI, MaRI and CRoMa
# on both views and a PathoROB probe sweep (APD, nIPD) on centre_all, on a LocalCluster.
# Run: cachescore run jobs/demo.toml
schema_version = 1

[job]
name = "demo"
cache = "../demo-cache"      # relative to this file
store = "../results/demo"
encoders = []                # all: enc0 .. enc3
views = ["centre_all", "centre_paired"]
design = "auto"              # centre_all -> all, centre_paired -> paired_2x2 (the views' hints)
probe_views = ["centre_all"] # the probe sweep's view ([probe] below)

[demo]
synthesise = true
seed = 0
n_slides_per_cell = 3
tiles_per_slide = 12
dim = 32

[metrics]
families = ["ri", "mari", "croma"]

[metrics.ri]
k_candidates = [5, 11, 21]

[metrics.mari]
k_candidates = [5, 11, 21]
tau = "auto"
warn_tau = false

[metrics.croma]
m = [5]
alpha = 0.10

[neighbors]
backend = "exact"

[probe]                      # train on centres A, B; centre C is an unseen-confounder test set
rows_per_slide = 12          # = tiles_per_slide
iterations = 5
id_filter = { column = "centre", values = ["A", "B"] }

[probe.test_sets.centre_C]
column = "centre"
value = "C"

[[probe.schedule]]           # balanced split: one slide of every (centre, class) cell
split_map = [[0, 0, 12], [0, 1, 12], [1, 0, 12], [1, 1, 12]]
max_train_slides = 1

[[probe.schedule]]           # confounded split: class 0 only from centre A, class 1 only from B
split_map = [[0, 0, 12], [1, 1, 12]]
max_train_slides = 1

[execution]
n_workers = 2
retries = 1
dashboard = true
performance_report = true
"""


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Fixed-width text table (no dependency); floats with 4 decimals."""
    def cell(v):
        if isinstance(v, float):
            return "nan" if v != v else f"{v:.4f}"
        return "" if v is None else str(v)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(out)


def _leaderboard(store, fingerprints: set[str]) -> str:
    scores = store.scores()
    if scores is None or len(scores) == 0:
        return ""
    scores = scores[scores["fingerprint"].isin(fingerprints)]
    if len(scores) == 0:
        return ""
    scores = scores.sort_values(["view", "metric", "scope", "m", "value"], ascending=[True, True, True, True, False],
                                na_position="last")
    rows = []
    for r in scores.to_dict("records"):
        metric = r["metric"] + (f"(m={int(r['m'])})" if r["metric"] == "croma" and r.get("m") == r.get("m")
                                and r.get("m") is not None else "")
        if r.get("design") == "probe":
            metric = f"{r['metric']}[{r.get('scope')}]"
        rows.append({"view": r["view"], "design": r["design"], "metric": metric, "encoder": r["encoder"],
                     "value": r.get("value"), "k": r.get("k"), "support": r.get("support"),
                     "tau": r.get("tau"), "f0": r.get("f0"), "ltm_alpha": r.get("ltm_alpha")})
    return format_table(rows, ["view", "design", "metric", "encoder", "value", "k", "support", "tau", "f0",
                               "ltm_alpha"])


def _record_fingerprints(plan) -> set[str]:
    """Store keys of every record of the plan's units (a probe unit has one per matrix × reduction)."""
    out = set()
    for u in plan.units:
        if u.kind is UnitKind.PROBE:
            out.update(probe_record_fingerprint(u.fingerprint, m, r) for m, r in probe_record_keys(u.params))
        else:
            out.add(u.fingerprint)
    return out


def _cmd_run(args) -> int:
    job = load_job(args.job)
    out = None if args.quiet else sys.stderr
    summary = run_job(job, scheduler=args.scheduler, out=out)
    print(f"run {summary.run_id}: {summary.planned} units, executed {summary.executed}, "
          f"skipped {summary.skipped} (up to date), succeeded {summary.succeeded}, failed {len(summary.failures)} "
          f"in {summary.seconds:.1f}s")
    if summary.report_path:
        print(f"performance report: {summary.report_path}")
    board = _leaderboard(ResultsStore(job.store), _record_fingerprints(summary.plan))
    if board and not args.quiet:
        print(board)
    if summary.failures:
        print(f"\n{len(summary.failures)} unit(s) failed:", file=sys.stderr)
        print(format_table(summary.failures, ["label", "error"]), file=sys.stderr)
        return 1
    return 0


def _short(text, width: int = 48) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def _cmd_status(args) -> int:
    job = load_job(args.job)
    if not Path(job.cache).is_dir():
        print(f"cache not found: {job.cache} (run: cachescore run {args.job})", file=sys.stderr)
        return 2
    rows = unit_status(job)
    shown = [dict(r, params=_short(r["params"]), scope=r.get("scope") or "") for r in rows]
    print(format_table(shown, ["encoder", "view", "design", "metric", "scope", "params", "state", "value", "detail"]))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    if not args.verify:
        return 0
    problems = verify_cache(Cache(job.cache))
    if not problems:
        print(f"cache {job.cache}: healthy (verify found no problem)")
        return 0
    print(f"\ncache {job.cache}: {len(problems)} problem(s)")
    print(format_table([{"kind": p.kind, "encoder": p.encoder, "tileset": p.tileset, "view": p.view,
                         "message": _short(p.message, 160)} for p in problems],
                       ["kind", "encoder", "tileset", "view", "message"]))
    return 1


def _cmd_watch(args) -> int:
    polls = watch_job(args.job, interval=args.interval, max_runs=args.max_runs, scheduler=args.scheduler,
                      out=sys.stderr, progress=not args.quiet)
    failed = sum(len(p.summary.failures) for p in polls if p.summary is not None)
    runs = [p for p in polls if p.summary is not None]
    print(f"watch: {len(polls)} poll(s), {len(runs)} run(s), executed "
          f"{sum(p.summary.executed for p in runs)}, failed {failed}")
    return 1 if failed else 0


def _cmd_import(args) -> int:
    def pairs(items, flag, sep):
        out = {}
        for item in items or []:
            name, _, rest = item.partition(sep)
            if not name or not rest:
                raise ValueError(f"{flag} expects NAME{sep}VALUE, got {item!r}")
            out[name] = rest
        return out

    encoders = pairs(args.encoder, "--encoder", "=")
    if not encoders:
        raise ValueError("cachescore import needs at least one --encoder NAME=PATH")
    views = {}
    for name, spec in pairs(args.view, "--view", "=").items():
        confounder, _, design = spec.partition(":")
        views[name] = {"confounder_column": confounder, "design": design or None}
    cache = import_cache(args.cache, tileset=args.tileset, manifest=args.manifest, encoders=encoders,
                         layout=args.layout, slide_column=args.slide_column,
                         tile_index_column=args.tile_index_column, h5_dataset=args.h5_dataset,
                         views=views or None, shard_rows=args.shard_rows, overwrite=args.overwrite)
    print(f"imported {', '.join(encoders)} into {cache.root} (tileset {args.tileset}; "
          f"views: {', '.join(cache.views()) or 'none'})")
    return 0


def _cmd_demo(args) -> int:
    workdir = Path(args.dir).resolve()
    (workdir / "jobs").mkdir(parents=True, exist_ok=True)
    job_path = workdir / "jobs" / "demo.toml"
    if not job_path.exists():
        atomic_write_bytes(job_path, DEMO_JOB.encode("utf-8"), overwrite=False)
    print(f"demo job: {job_path}")
    ns = argparse.Namespace(job=str(job_path), scheduler=args.scheduler, quiet=False)
    rc = _cmd_run(ns)
    job = load_job(job_path)
    info = json.loads((Path(job.cache) / "cache.json").read_text(encoding="utf-8"))
    print("intended ranking (most robust first): " + " > ".join(info.get("intended_confounder_ranking", [])))
    return rc


def _cmd_report(args) -> int:
    job = load_job(args.job)
    out = Path(args.out) if args.out else Path(job.store) / "report.html"
    cache = Cache(job.cache) if Path(job.cache).is_dir() else None
    path = build_report(job.store, out, cache=cache)
    print(f"report: {path}")
    return 0


def _cmd_schema(args) -> int:
    print(describe_schema())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cachescore", description="Robustness scoring of embedding caches on Dask.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", aliases=["rescore"],
                       help="score every pending work unit of a job (only what is new or changed)")
    r.add_argument("job", help="job file (TOML)")
    r.add_argument("--scheduler", default=None, help="address of a running Dask scheduler (tcp://host:port); "
                                                     "default: a LocalCluster on 127.0.0.1")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar or leaderboard")
    r.set_defaults(func=_cmd_run)

    s = sub.add_parser("status", help="what is scored, stale, missing or failed")
    s.add_argument("job")
    s.add_argument("--verify", action="store_true",
                   help="also run the cache health check (checksums, alignment, NaN rows, views); exit 1 on problems")
    s.set_defaults(func=_cmd_status)

    w = sub.add_parser("watch", help="poll the cache and re-score whenever there is new work "
                                     "(new encoder, changed shard or view, changed params)")
    w.add_argument("job")
    w.add_argument("--interval", type=float, default=300.0, help="seconds between polls (default 300)")
    w.add_argument("--max-runs", type=int, default=None, metavar="N",
                   help="stop after N polls (each runs the job at most once); default: forever")
    w.add_argument("--scheduler", default=None, help="address of a running Dask scheduler (default: LocalCluster)")
    w.add_argument("-q", "--quiet", action="store_true", help="no per-unit progress (the poll lines still print)")
    w.set_defaults(func=_cmd_watch)

    i = sub.add_parser("import", help="build a cache from .npy/.h5 files and a tile manifest")
    i.add_argument("cache", help="cache folder to create or extend")
    i.add_argument("--tileset", required=True, help="name of the tileset to create")
    i.add_argument("--manifest", required=True, help="tile manifest (CSV or Parquet): sample_id, image_path, ...")
    i.add_argument("--encoder", action="append", metavar="NAME=PATH",
                   help="per_encoder: one .npy/.h5 aligned with the manifest; per_slide: a folder or "
                        "'{slide}' pattern (repeatable)")
    i.add_argument("--layout", default="per_encoder", choices=["per_encoder", "per_slide"])
    i.add_argument("--slide-column", default="group_id", help="per_slide: manifest column naming the slide")
    i.add_argument("--tile-index-column", default=None, help="per_slide: row of each tile in its slide file")
    i.add_argument("--h5-dataset", default="features", help=".h5 dataset holding the features")
    i.add_argument("--view", action="append", metavar="NAME=CONFOUNDER[:DESIGN]",
                   help="also write a view over all manifest rows (repeatable)")
    i.add_argument("--shard-rows", type=int, default=None, help="rows per shard (default: ~64-256 MiB)")
    i.add_argument("--overwrite", action="store_true", help="replace existing arrays")
    i.set_defaults(func=_cmd_import)

    rp = sub.add_parser("report", help="write the HTML report (leaderboards, distributions, failures, provenance)")
    rp.add_argument("job")
    rp.add_argument("--out", default=None, help="HTML file to write (default: <store>/report.html)")
    rp.set_defaults(func=_cmd_report)

    d = sub.add_parser("demo", help="synthesise and score the demo cache")
    d.add_argument("dir", nargs="?", default="cachescore-demo", help="work folder (default ./cachescore-demo)")
    d.add_argument("--scheduler", default=None)
    d.set_defaults(func=_cmd_demo)

    sc = sub.add_parser("schema", help="list every job-file key, its default and meaning")
    sc.set_defaults(func=_cmd_schema)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cachescore`` command; returns the exit code (0 ok, 1 unit failures,
    2 job-level error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, OSError) as exc:  # job-level errors (ours subclass these); a bug shows its traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
