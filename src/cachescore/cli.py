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
* ``cachescore validate JOB`` – plan without a cluster and check everything that can be checked before
  computing (:mod:`cachescore.pipeline.validate`); a table of the units; exit 0 / 2.
* ``cachescore compare JOB A B [--view V] [--metric M] [--json]`` – B − A with a paired CI and a verdict.
* ``cachescore prune JOB [--apply]`` – stale records and abandoned failures (dry run by default).
* ``cachescore export JOB [--format parquet|csv|json] [-o PATH]`` – the tidy score and probe tables.
* ``cachescore import …`` – build a cache from ``.npy`` / ``.h5`` files and a tile manifest or a slide table
  (:func:`cachescore.cache.import_cache`).
* ``cachescore view CACHE --tileset T --name V --confounder COL [--rows-per-slide N] …`` – write a view
  (:func:`cachescore.cache.views.make_view`).
* ``cachescore demo [DIR]`` – write the self-contained demo job into DIR and run it.
* ``cachescore schema`` – list every job-file key with its default and meaning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
from collections import Counter
from importlib import resources
from pathlib import Path

import pandas as pd

from .cache import Cache, CacheAccessError, CacheNotFoundError, import_cache, verify_cache
from .cache.formats import StorageOptions
from .cache.location import cache_root, check_cache_root, is_remote, remote_session
from .cache.writer import delete_view
from .cache.views import make_view, parse_where
from .errors import RunAborted, RunInterrupted
from .jobs import describe_schema, load_job
from .jobs.schema import CLUSTER_KINDS
from .jobs.sections import as_dict
from .metrics import families
from ._jsonsafe import json_safe
from .pipeline.plan import plan_job
from .pipeline.status import unit_status
from .pipeline.plan import empty_plan_hint
from .pipeline.status import damaged_units
from .pipeline.tables import plan_results
from .pipeline.prune import prune_store
from .pipeline.validate import refuse_invalid, validate_plan
from .store import REPORT_FILE, CorruptRecordError, ResultsStore, is_store
from .store.lock import StoreLock, process_alive
from .store.verify import verify_store
from .results import compare_encoders, export_tables, read_scores
from ._atomic import atomic_write_bytes

__all__ = ["main", "build_parser", "format_table", "DEMO_JOB"]

#: The self-contained demo job: the package's ``jobs/demo.toml`` (the repository's ``jobs/demo.toml``
#: links to that one file).
DEMO_JOB = (resources.files("cachescore.jobs") / "demo.toml").read_text(encoding="utf-8")


_CONTROL = {i: f"\\x{i:02x}" for i in range(32)} | {10: "\\n", 13: "\\r", 9: "\\t", 127: "\\x7f"}


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Fixed-width text table (no dependency); floats with 4 decimals; control characters in a
    cell (a newline in a name or a message) are shown escaped (``\\n``), so every row is one line."""
    def cell(v):
        if isinstance(v, float):
            return "nan" if v != v else f"{v:.4f}"
        return "" if v is None else str(v).translate(_CONTROL)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(out)


def _metric_label(r: dict) -> str:
    return families.display(r["metric"], r.get("m"), r.get("scope") if r.get("design") == "probe" else None)


def _flags(r: dict, notes: dict | None = None) -> str:
    """What a reader must know before using a score: undefined (why), low support, warnings. With
    ``notes`` (warning kind -> [number, count, example], filled here) a warning is a short mark
    (``W1``) explained once under the table (:func:`_warning_notes`); without, its first line, cut
    with an ellipsis."""
    if not r.get("defined", True):
        return f"UNDEFINED: {r.get('undefined_reason')}"
    out = []
    if r.get("low_support"):
        out.append(f"low support ({r.get('support'):.3f})")
    for warn in str(r.get("warnings") or "").strip().splitlines():
        if notes is None:
            out.append("warning: " + _short(warn, 90))
            continue
        note = notes.setdefault(_warning_kind(warn), [len(notes) + 1, 0, warn])
        note[1] += 1
        out.append(f"W{note[0]}")
    return "; ".join(dict.fromkeys(out))


def _warning_kind(text: str) -> str:
    """A warning with its numbers blanked: the same warning about 96.8% and 98.6% is one kind."""
    return re.sub(r"\d+(\.\d+)?", "#", text)


def _warning_notes(notes: dict) -> str:
    """The warnings of a table, once each with how many scores carry them."""
    return "\n".join(f"W{n}: {count} score(s), e.g. {example}" for n, count, example in
                     sorted(notes.values()))


def _interval(lo, hi) -> str:
    return "" if lo is None or hi is None or lo != lo or hi != hi else f"[{lo:.4f}, {hi:.4f}]"


def _rank_text(r: dict) -> str:
    rank, lo, hi = r.get("rank"), r.get("rank_low"), r.get("rank_high")
    if rank is None or rank != rank:
        return "-"
    if lo is None or lo != lo:
        return str(int(rank))
    return f"{int(rank)} ({int(lo)}-{int(hi)})" if lo != hi else str(int(rank))


def _leaderboard(scores) -> str:
    """The run's scores (``<store>/scores.parquet`` rows): per view × metric, ranked, with the CI,
    the rank interval and the flags; undefined scores are listed last and never ranked."""
    if scores is None or len(scores) == 0:
        return ""
    rows, notes = [], {}
    header = families.direction_header(scores["metric"].unique())
    for r in scores.to_dict("records"):
        r = {k: (None if v is pd.NA else v) for k, v in r.items()}
        rows.append({"view": r["view"], "design": r["design"], "metric": _metric_label(r), "rank": _rank_text(r),
                     "encoder": r["encoder"], header: r.get("value"),
                     f"{int(round(100 * (r.get('ci_level') or 0.95)))}% CI": _interval(r.get("ci_low"), r.get("ci_high")),
                     "vs best": _versus_best(r), "support": r.get("support"), "k": r.get("k"),
                     "flags": _flags(r, notes)})
    table = format_table(rows, list(rows[0]))
    return table + ("\n" + _warning_notes(notes) if notes else "")


def _versus_best(r: dict) -> str:
    """The score's paired verdict against its group's best (``best``, ``worse``, ``≈ best``)."""
    verdict = str(r.get("verdict") or "")
    if verdict.startswith("worse"):
        return f"worse ({_interval(r.get('delta_ci_low'), r.get('delta_ci_high'))})"
    if verdict.startswith("no detectable"):
        return "≈ best"
    return verdict


def _run_line(summary) -> str:
    return (f"run {summary.run_id}: {summary.planned} units, executed {summary.executed}, "
            f"skipped {summary.skipped} (up to date), succeeded {summary.succeeded}, failed {len(summary.failures)} "
            f"in {summary.seconds:.1f}s")


def _cmd_run(args) -> int:
    job = load_job(args.job)
    if is_store(job.store):
        StoreLock(job.store, "run").check()  # a busy store is refused now, before any cluster or heavy import
    from .pipeline.run import run_job  # deferred: distributed is imported only by a run that will start

    out = None if args.quiet else sys.stderr
    try:
        summary = run_job(job, scheduler=args.scheduler, out=out, cluster=getattr(args, "cluster", None),
                          verbose=getattr(args, "verbose", False))
    except RunAborted as exc:
        done = getattr(exc, "summary", None)
        print(f"error: run aborted: {exc}", file=sys.stderr)
        if done is not None:
            print(f"provenance: {Path(job.store) / 'runs' / done.run_id / 'provenance.json'} (state 'aborted'); "
                  f"the next run resumes with the units not stored", file=sys.stderr)
        return 2
    print(_run_line(summary))
    if summary.report_path:
        print(f"performance report: {summary.report_path}")
    board = _leaderboard(read_scores(job.store)) if summary.tables else ""
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


def _with_scores(rows: list[dict], job) -> list[dict]:
    """Status rows with the CI, rank and flags of ``<store>/scores.parquet`` (when it exists)."""
    try:
        table = read_scores(job.store)
    except FileNotFoundError:
        return rows
    except (OSError, ValueError) as exc:  # a damaged tidy table: the units' own states still show
        print(f"warning: {Path(job.store) / 'scores.parquet'} cannot be read ({' '.join(str(exc).split())[:160]}); "
              f"CIs and ranks are not shown; `cachescore run {job.path}` rewrites it", file=sys.stderr)
        return rows
    by_fp = {r["fingerprint"]: {k: (None if v is pd.NA else v) for k, v in r.items()}
             for r in table.to_dict("records")}
    out = []
    for r in rows:
        s = by_fp.get(r.get("fingerprint"))
        extra = {} if s is None else {k: s.get(k) for k in ("ci_low", "ci_high", "ci_level", "defined",
                                                           "undefined_reason", "low_support", "rank", "rank_low",
                                                           "rank_high", "support", "warnings")}
        if s is not None:
            extra["flags"] = _flags(s)
        out.append(dict(r, **extra))
    return out


def _json_rows(rows: list[dict]) -> str:
    return json.dumps(json_safe(rows), indent=1, sort_keys=True, default=str)


def _runs_line(store: ResultsStore) -> str:
    """The store's lock holder and run states, e.g. ``runs: 3 finished, 1 interrupted; in use by run …``."""
    states = Counter()
    for run_id in store.runs():
        try:
            states[store.read_provenance(run_id).get("state", "?")] += 1
        except (OSError, ValueError):
            states["unreadable"] += 1
    holder, age = StoreLock(store.path, "status").holder()
    text = "runs: " + (", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "none")
    if holder:
        who = f"run {holder.get('run_id')} (host {holder.get('host')}, pid {holder.get('pid')}"
        alive = process_alive(holder)
        if alive is False:
            text += f"; lock file left by {who}, process gone): the next run takes it over"
        else:
            text += f"; in use by {who}, heartbeat {age:.0f} s ago)" + ("" if alive else " on another host")
    return text


def _refuse_damaged(job_path, plan, store) -> bool:
    """Print an ``error:`` line per damaged record of the plan (unit, fingerprint, what is wrong,
    the repair; at most 10, then a count); True if any."""
    lines = [f"damaged record in results store {store.path}: unit {d['label']} (fingerprint {d['fingerprint'][:16]}): "
             f"{d['problem']}; `cachescore run {job_path}` recomputes it" for d in damaged_units(plan, store)]
    for line in lines[:10]:
        print(f"error: {line}", file=sys.stderr)
    if len(lines) > 10:
        print(f"error: ... and {len(lines) - 10} more damaged record(s)", file=sys.stderr)
    return bool(lines)


def _cache_missing(job, hint: str = "") -> bool:
    """Print why the job's cache cannot be read (missing, or refused by its storage) and say so."""
    try:
        check_cache_root(job.cache)
    except CacheNotFoundError:
        print(f"cache not found: {job.cache}{hint}", file=sys.stderr)
        return True
    except CacheAccessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return True
    return False


def _cmd_status(args) -> int:
    job = load_job(args.job)
    if _cache_missing(job, f" (run: cachescore run {args.job})"):
        return 2
    store = ResultsStore.open(job.store)  # reads only: works on a read-only store, creates nothing
    marker = ResultsStore.create if is_store(job.store) and os.access(job.store, os.W_OK) else None
    for stale in (marker(job.store).mark_stale_runs() if marker else []):  # a SIGKILLed run could not say so
        print(f"run {stale} ended without finishing (its process is gone): marked 'interrupted'", file=sys.stderr)
    rows = _with_scores(unit_status(job, store=store), job)
    problems = verify_cache(Cache(job.cache)) if args.verify else []
    store_problems = verify_store(job.store) if args.verify else []
    if args.json:
        doc = {"job": str(job.path), "store": str(job.store), "units": rows,
               "counts": dict(sorted(Counter(r["state"] for r in rows).items()))}
        if args.verify:
            doc["cache_problems"] = [p.to_dict() for p in problems]
            doc["store_problems"] = [p.to_dict() for p in store_problems]
        print(_json_rows(doc))
        return 1 if problems or store_problems else 0
    shown = [dict(r, params=_short(r["params"]), scope=r.get("scope") or "", ci=_interval(r.get("ci_low"), r.get("ci_high")),
                  flags=_short(r.get("flags") or "", 60)) for r in rows]
    print(_runs_line(store))
    print(format_table(shown, ["encoder", "view", "design", "metric", "scope", "params", "state", "value", "ci", "flags",
                               "detail"]))
    counts = Counter(r["state"] for r in rows)
    print(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    if not args.verify:
        return 0
    if not problems:
        print(f"cache {job.cache}: healthy (verify found no problem)")
    else:
        print(f"\ncache {job.cache}: {len(problems)} problem(s)")
        print(format_table([{"kind": p.kind, "encoder": p.encoder, "tileset": p.tileset, "view": p.view,
                             "message": _short(p.message, 160)} for p in problems],
                           ["kind", "encoder", "tileset", "view", "message"]))
    if not store_problems:
        print(f"results store {job.store}: healthy (verify found no problem)")
    else:
        print(f"\nresults store {job.store}: {len(store_problems)} problem(s)")
        print(format_table([{"kind": p.kind, "path": p.path, "message": _short(p.message, 120)} for p in store_problems],
                           ["kind", "path", "message"]))
    return 1 if problems or store_problems else 0


def _cmd_validate(args) -> int:
    job = load_job(args.job)
    if _cache_missing(job):
        return 2
    store = ResultsStore.open(job.store)  # read-only: validate creates nothing
    plan = plan_job(job, store=store)
    checks = validate_plan(plan)
    refused = refuse_invalid(plan, checks)
    done = {u.fingerprint for u in plan.done}
    rows = [{"encoder": u.encoder, "view": u.view, "design": u.design, "metric": u.metric,
             "state": "up to date" if u.fingerprint in done else "to run"} for u in refused.pending + refused.done]
    rows += [{"encoder": i.unit.get("encoder"), "view": i.unit.get("view"), "design": i.unit.get("design"),
              "metric": i.unit.get("metric"), "state": "INVALID", "problem": _short(i.error, 140)} for i in refused.invalid]
    print(format_table(rows, ["encoder", "view", "design", "metric", "state", "problem"]))
    for view, check in checks.items():
        cells = check.counts.get("cells")
        tail = f": {check.error}" if check.error else ""
        print(f"probe view {view}: {'FAILED' if check.error else 'ok'} (slides per confounder/class cell: {cells}; "
              f"test rows: {check.counts.get('test_rows')}){tail}")
    n_bad = len(refused.invalid)
    print(f"{len(refused.pending)} unit(s) to run, {len(refused.done)} up to date, {n_bad} invalid")
    hint = empty_plan_hint(plan)
    if hint:
        print(f"warning: {hint}", file=sys.stderr)
    return 2 if n_bad else 0


def _cmd_compare(args) -> int:
    job = load_job(args.job)
    store = ResultsStore.open(job.store)
    plan = plan_job(job, store=store)
    if _refuse_damaged(args.job, plan, store):
        return 2
    rows = compare_encoders(store, Cache(job.cache), plan.record_fingerprints(), args.encoder_a, args.encoder_b,
                            view=args.view, metric=args.metric, bootstrap=as_dict(job.metrics.bootstrap))
    if args.json:
        print(_json_rows(rows))
        return 0
    shown = [dict(r, metric=_metric_label(r), ci=_interval(r["ci_low"], r["ci_high"]),
                  win=r["win_fraction"]) for r in rows]
    print(format_table(shown, ["view", "design", "metric", "value_a", "value_b", "delta", "ci", "win", "verdict"]))
    print(f"delta = {args.encoder_b} - {args.encoder_a}; ci: paired cluster bootstrap over group_id "
          f"({job.metrics.bootstrap.n_boot} replicates, level {job.metrics.bootstrap.level}); "
          f"win: share of replicates where {args.encoder_b} scores higher")
    return 0


def _cmd_prune(args) -> int:
    job = load_job(args.job)
    store = ResultsStore(job.store)
    plan = plan_job(job, store=store)
    report = prune_store(plan, store, apply=args.apply, all_jobs=args.all_jobs)  # PruneRefused: exit 2 in main
    encoders = sorted({u.encoder for u in plan.units})
    views = sorted({u.view for u in plan.units})
    print(f"scope: job {job.name!r} ({args.job}): {len(plan.units)} unit(s) over {len(encoders)} encoder(s) x "
          f"{len(views)} view(s)" + ("; --all-jobs: also everything no unit of this job names" if args.all_jobs else ""))
    verb = "removed" if report.applied else "would remove"
    print(f"{verb} {len(report.stale_records)} stale record(s) and {len(report.abandoned_failures)} abandoned "
          f"failure(s) from {job.store}" + (f" ({report.bytes_freed} bytes freed)" if report.applied else ""))
    for fp in report.stale_records[:20]:
        print(f"  record  {fp}")
    for fp in report.abandoned_failures[:20]:
        print(f"  failure {fp}")
    if not args.all_jobs and (report.outside_records or report.outside_failures):
        print(f"kept {len(report.outside_records)} record(s) and {len(report.outside_failures)} failure(s) outside this "
              "job's scope (another job sharing the store, or encoders / views / params this job does not name); "
              "--all-jobs prunes them too")
    if not report.applied and (report.stale_records or report.abandoned_failures):
        print(f"dry run: nothing was deleted; run `cachescore prune {args.job} --apply` to delete")
    return 0


def _cmd_export(args) -> int:
    job = load_job(args.job)
    store = ResultsStore.open(job.store)
    plan = plan_job(job, store=store)
    if _refuse_damaged(args.job, plan, store):
        return 2
    scores, probe, centres = plan_results(plan, store)
    out = Path(args.output) if args.output else Path(job.store) / "export" / f"scores.{args.format}"
    for path in export_tables(scores, probe, out, fmt=args.format, centres=centres):
        print(f"wrote {path}")
    return 0


def _cmd_watch(args) -> int:
    from .pipeline.watch import watch_job  # deferred: distributed is imported only when watching

    polls = watch_job(args.job, interval=args.interval, max_runs=args.max_runs, scheduler=args.scheduler,
                      cluster=args.cluster, out=sys.stderr, progress=not args.quiet, verbose=args.verbose)
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
    if args.link and is_remote(cache_root(args.cache)):
        raise ValueError("--link records slide files on this file system: the cache must be a folder the workers "
                         "share with them, not a URL")
    with remote_session(args.cache) as root:  # a URL: written to a staging copy, then uploaded
        cache = import_cache(root, tileset=args.tileset, manifest=args.manifest, encoders=encoders,
                             layout=args.layout, slide_column=args.slide_column,
                             tile_index_column=args.tile_index_column, h5_dataset=args.h5_dataset,
                             views=views or None, shard_rows=args.shard_rows, overwrite=args.overwrite,
                             follow_symlinks=args.follow_symlinks,
                             storage=StorageOptions(format=args.format, codec=args.codec, chunk_rows=args.chunk_rows,
                                                    storage_dtype=args.storage_dtype, link=args.link))
        listed = ", ".join(cache.views()) or "none"
    print(f"imported {', '.join(encoders)} into {cache_root(args.cache)} (tileset {args.tileset}; views: {listed})")
    return 0


def _cmd_view(args) -> int:
    if args.delete:
        with remote_session(args.cache) as root:
            removed = delete_view(Cache(root, mode="a"), args.delete)
        print(f"view {args.delete} deleted from {args.cache} ({', '.join(p.name for p in removed)}); its stored "
              "results stay in the results store (`cachescore prune JOB` lists them)")
        return 0
    missing = [f"--{k}" for k in ("tileset", "name", "confounder") if not getattr(args, k)]
    if missing:
        print(f"error: cachescore view: {', '.join(missing)} required to write a view (or --delete NAME to remove one)",
              file=sys.stderr)
        return 2
    with remote_session(args.cache) as root:
        summary = make_view(root, tileset=args.tileset, name=args.name, confounder=args.confounder, label=args.label,
                            group=args.group, design=args.design, where=parse_where(args.where),
                            rows_per_slide=args.rows_per_slide, seed=args.seed, min_rows=args.min_rows,
                            slide_column=args.slide_column, overwrite=args.overwrite)
    if is_remote(cache_root(args.cache)):  # the staged path is gone: name the object
        summary = dataclasses.replace(summary, path=cache_root(args.cache) / "views" / f"{args.name}.parquet")
    dropped = ""
    if summary.dropped:
        few = ", ".join(f"{s} ({n})" for s, n in list(summary.dropped.items())[:5])
        dropped = (f"; dropped {len(summary.dropped)} slide(s) with fewer than "
                   f"{args.min_rows or args.rows_per_slide} tiles: {few}{' ...' if len(summary.dropped) > 5 else ''}")
    print(f"view {args.name}: {summary.rows} rows from {summary.slides} slide(s){dropped} -> {summary.path}")
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
    info = json.loads((cache_root(job.cache) / "cache.json").read_text(encoding="utf-8"))
    print("intended ranking (most robust first): " + " > ".join(info.get("intended_confounder_ranking", [])))
    return rc


def _cmd_report(args) -> int:
    job = load_job(args.job)
    out = Path(args.out) if args.out else Path(job.store) / REPORT_FILE
    try:
        check_cache_root(job.cache)
        cache = Cache(job.cache)
    except CacheNotFoundError:
        cache = None
    if cache is not None and is_store(job.store):
        store = ResultsStore.open(job.store)
        if _refuse_damaged(args.job, plan_job(job, cache=cache, store=store), store):
            return 2
    from .report import build_report  # deferred: matplotlib is imported only to draw a report

    path = build_report(job.store, out, cache=cache)
    print(f"report: {path}")
    return 0


def _cmd_schema(args) -> int:
    print(describe_schema())
    return 0


def _where(parser) -> None:
    """``--scheduler ADDR`` | ``--cluster KIND`` (exclusive): where the run's workers are."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--scheduler", default=None, help="address of a running Dask scheduler (tcp://host:port); "
                                                     "default: the job's [cluster] (a LocalCluster on 127.0.0.1)")
    g.add_argument("--cluster", default=None, choices=list(CLUSTER_KINDS),
                   help="start the workers here: local, slurm / pbs (worker jobs via dask-jobqueue, adaptive) or "
                        "kubernetes (dask-kubernetes operator); settings in the job's [cluster] table")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cachescore", description="Robustness scoring of embedding caches on Dask.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", aliases=["rescore"],
                       help="score every pending work unit of a job (only what is new or changed)")
    r.add_argument("job", help="job file (TOML)")
    _where(r)
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar or leaderboard")
    r.add_argument("-v", "--verbose", action="store_true", help="also one line per finished unit")
    r.set_defaults(func=_cmd_run)

    s = sub.add_parser("status", help="what is scored, stale, missing or failed")
    s.add_argument("job")
    s.add_argument("--verify", action="store_true",
                   help="also check the cache (checksums, alignment, NaN rows, views) and the results store "
                        "(per-unit files and checksums, orphans, run states); exit 1 on problems")
    s.add_argument("--json", action="store_true", help="machine-readable status (units with CI, rank and flags)")
    s.set_defaults(func=_cmd_status)

    va = sub.add_parser("validate", help="check a job before computing (views, scopes, probe schedules; counts); "
                                         "exit 0 when every unit can run, 2 otherwise")
    va.add_argument("job")
    va.set_defaults(func=_cmd_validate)

    cp = sub.add_parser("compare", help="difference B - A per view x metric with a paired bootstrap CI and a verdict")
    cp.add_argument("job")
    cp.add_argument("encoder_a")
    cp.add_argument("encoder_b")
    cp.add_argument("--view", default=None, help="only this view")
    cp.add_argument("--metric", default=None, help="only this metric (ri, mari, croma, apd, nipd)")
    cp.add_argument("--json", action="store_true", help="machine-readable rows")
    cp.set_defaults(func=_cmd_compare)

    pr = sub.add_parser("prune", help="list (or with --apply delete) stored results and failures no current "
                                      "fingerprint of the job refers to")
    pr.add_argument("job")
    pr.add_argument("--apply", action="store_true", help="delete them (default: a dry run that only lists); takes "
                                                         "the store's run lock")
    pr.add_argument("--all-jobs", action="store_true",
                    help="also prune records outside this job's scope (other jobs sharing the store, encoders, "
                         "views or params the job does not name); default: they are listed and kept")
    pr.set_defaults(func=_cmd_prune)

    ex = sub.add_parser("export", help="write the tidy score and probe tables (with CIs, flags, ranks)")
    ex.add_argument("job")
    ex.add_argument("--format", default="parquet", choices=["parquet", "csv", "json"])
    ex.add_argument("-o", "--output", default=None,
                    help="scores file to write (default <store>/export/scores.<format>); the probe table goes "
                         "beside it as <stem>.probe.<format>")
    ex.set_defaults(func=_cmd_export)

    w = sub.add_parser("watch", help="poll the cache and re-score whenever there is new work "
                                     "(new encoder, changed shard or view, changed params)")
    w.add_argument("job")
    w.add_argument("--interval", type=float, default=300.0, help="seconds between polls (default 300)")
    w.add_argument("--max-runs", type=int, default=None, metavar="N",
                   help="stop after N polls (each runs the job at most once); default: forever")
    _where(w)
    w.add_argument("-q", "--quiet", action="store_true", help="no per-unit progress (the poll lines still print)")
    w.add_argument("-v", "--verbose", action="store_true", help="also one line per finished unit")
    w.set_defaults(func=_cmd_watch)

    i = sub.add_parser("import", help="build a cache from .npy/.h5 files and a tile manifest or slide table",
                       description="Import embeddings into a cache. With --layout per_slide and a slide table (one row "
                                   "per slide, no sample_id column; e.g. TRIDENT / CLAM feature folders with one .h5 per "
                                   "slide holding 'features' and 'coords') the tiles are derived from each slide's "
                                   "file: x, y from coords, sample_id = <slide>:<x>_<y>, slide columns repeated per "
                                   "tile. Importing into an existing tileset with the identical manifest adds the "
                                   "given encoders (a new encoder needs no flag; identical bytes are a no-op). Every "
                                   "input is checked before anything is written: a failed import leaves the cache "
                                   "as it was.")
    i.add_argument("cache", help="cache folder to create or extend")
    i.add_argument("--tileset", required=True, help="tileset to create, or to add encoders to (identical manifest)")
    i.add_argument("--manifest", required=True,
                   help="tile manifest (CSV or Parquet: sample_id, image_path, ...) or, with --layout per_slide, a "
                        "slide table (one row per --slide-column value; label, centre, patient, ... per slide)")
    i.add_argument("--encoder", action="append", metavar="NAME=PATH",
                   help="per_encoder: one .npy/.h5 aligned with the manifest; per_slide: a folder of <slide>.h5 / "
                        "<slide>.npy files or a '{slide}' pattern (repeatable)")
    i.add_argument("--layout", default="per_encoder", choices=["per_encoder", "per_slide"])
    i.add_argument("--slide-column", default="group_id", help="per_slide: manifest column naming the slide")
    i.add_argument("--tile-index-column", default=None, help="per_slide: row of each tile in its slide file")
    i.add_argument("--h5-dataset", default="features", help=".h5 dataset holding the features")
    i.add_argument("--view", action="append", metavar="NAME=CONFOUNDER[:DESIGN]",
                   help="also write a view over all manifest rows (repeatable)")
    i.add_argument("--follow-symlinks", action="store_true",
                   help="per_slide: read slide files that are symbolic links leaving the slide folder (default: "
                        "refused, naming the slide)")
    i.add_argument("--shard-rows", type=int, default=None, help="rows per shard (default: ~64-256 MiB)")
    i.add_argument("--format", default="npy", choices=["npy", "zarr"],
                   help="how rows are stored: .npy shards (memory-mapped; default) or Zarr v3 shards (chunked, "
                        "compressed; docs/adr/0021)")
    i.add_argument("--codec", default="zstd", choices=["zstd", "blosc", "none"], help="--format zarr: chunk codec")
    i.add_argument("--chunk-rows", type=int, default=None, help="--format zarr: rows per chunk (default ~4 MiB)")
    i.add_argument("--storage-dtype", default=None, choices=["float16", "float32", "float64"],
                   help="--format zarr: store rows in this dtype (float16 halves the bytes; values out of its "
                        "range are refused)")
    i.add_argument("--link", action="store_true",
                   help="per_slide: read each slide's .h5/.npy file in place (nothing copied); the cache records "
                        "path, size, mtime, tile count and a quick content hash, and a changed or missing file is "
                        "refused before it is read")
    i.add_argument("--overwrite", action="store_true",
                   help="replace the given encoders' existing arrays of this tileset (never another encoder's) and "
                        "the given views")
    i.set_defaults(func=_cmd_import)

    v = sub.add_parser("view", help="write a view over a tileset: filter tiles, subsample N per slide (seeded); "
                                    "or --delete one")
    v.add_argument("cache", help="cache folder")
    v.add_argument("--delete", metavar="NAME", default=None,
                   help="remove the view NAME from the cache (its table and sidecar; nothing else) instead of writing one")
    v.add_argument("--tileset", help="tileset the view selects from (required to write a view)")
    v.add_argument("--name", help="name of the view to write (required to write a view)")
    v.add_argument("--confounder", help="tileset column the scores are robust to (centre, scanner, ...; required to "
                                        "write a view)")
    v.add_argument("--label", default="label", help="tileset column of the biological label (default: label)")
    v.add_argument("--group", default="group_id",
                   help="tileset column of the independence group (default: group_id): the unit the bootstrap "
                        "resamples and the probe splits keep whole — the patient when a patient has several slides, "
                        "else the slide (docs/cache-layout.md)")
    v.add_argument("--design", default=None, choices=["all", "paired_2x2"], help="design hint stored with the view")
    v.add_argument("--where", action="append", metavar="COL=VAL",
                   help="keep tiles with COL == VAL (repeatable: values of one column are alternatives, columns all "
                        "must match)")
    v.add_argument("--rows-per-slide", type=int, default=None, metavar="N",
                   help="keep exactly N tiles per slide (seeded choice); slides with fewer are dropped and counted")
    v.add_argument("--seed", type=int, default=0, help="seed of the per-slide choice (default 0)")
    v.add_argument("--min-rows", type=int, default=None, metavar="M",
                   help="with --rows-per-slide: keep slides with at least M (< N) tiles whole instead of dropping them")
    v.add_argument("--slide-column", default=None, help="column naming the slide of --rows-per-slide (default: --group)")
    v.add_argument("--overwrite", action="store_true", help="replace an existing view of that name")
    v.set_defaults(func=_cmd_view)

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


def _raise_interrupted(signum, frame) -> None:
    raise RunInterrupted(signum)


def _interrupted_line(exc: BaseException, signum: int) -> str:
    summary = getattr(exc, "summary", None)
    name = signal.Signals(signum).name
    if summary is None:
        return f"interrupted by {name}"
    return (f"interrupted by {name}: run {summary.run_id} stopped with {summary.succeeded} unit(s) done, "
            f"{len(summary.failures)} failed, {len(summary.not_run)} not run (provenance state 'interrupted'; the "
            "next run resumes)")


def _error_text(exc: BaseException) -> str:
    """The message of a job-level error: an ``OSError`` built as ``(errno, our message)`` without
    its ``[Errno N]`` prefix (the message already says what and where); others as ``str``."""
    if isinstance(exc, OSError) and exc.filename is None and len(exc.args) == 2 and isinstance(exc.args[1], str) \
            and exc.args[1] != os.strerror(exc.errno or 0):
        return exc.args[1]
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cachescore`` command; returns the exit code (0 ok, 1 unit failures,
    2 job-level error or an aborted run, 130 / 143 interrupted by SIGINT / SIGTERM)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, _raise_interrupted)  # SIGTERM ends a run like Ctrl-C
    except ValueError:  # not the main thread (an embedding caller): leave signals alone
        pass
    try:
        return int(args.func(args))
    except (ValueError, OSError) as exc:  # job-level errors (ours subclass these); a bug shows its traceback
        print(f"error: {_error_text(exc)}", file=sys.stderr)
        return 2
    except CorruptRecordError as exc:  # a record damaged while being read (readers check before they read)
        print(f"error: {exc} (`cachescore run {getattr(args, 'job', 'JOB')}` recomputes it)", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, RunInterrupted) as exc:
        signum = exc.signum if isinstance(exc, RunInterrupted) else int(signal.SIGINT)
        print(_interrupted_line(exc, signum), file=sys.stderr)
        return 128 + signum
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
