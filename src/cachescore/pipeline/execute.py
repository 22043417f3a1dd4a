"""Execution: submit the pending work units as Dask futures, show progress, record everything.

:func:`run_job` is the whole run (what ``cachescore run`` calls): synthesise the demo cache if the
job asks for it, plan, record units that failed at planning, open the client (LocalCluster or
``--scheduler``), start every pending unit by its kind (metric and probe-sweep tasks, large-scope drivers;
retries for transient failures), draw a
progress bar, save a Dask ``performance_report`` in the store's run folder and write the run's
provenance. Nothing is started when no unit is pending, so a second run of an unchanged job
executes no unit (``RunSummary.executed == 0``).

Tasks write their own results (atomic store writes on the worker): a client killed midway leaves a
valid store, and the next run executes only the units without a result.
"""

from __future__ import annotations

import os
import platform
import queue
import sys
import time
import uuid
from concurrent.futures import Future as LocalFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from distributed import performance_report

from .._version import package_versions
from ..cache import Cache
from ..cache.synthetic import make_demo_cache
from ..neighbors.large_scope import remove_scratch
from ..results import probe_centre_table, probe_table, publish_tables, score_table
from ..store import CorruptRecordError, ResultsStore
from .cluster import open_client, open_cluster_client
from .plan import Plan, UnitKind, code_version, plan_job
from .unit import drive_large_unit, run_probe_task, run_unit

__all__ = ["RunSummary", "execute_plan", "run_job", "build_results", "publish_results", "ensure_demo_cache", "new_run_id",
           "ProgressBar"]


@dataclass
class RunSummary:
    """What a run did. ``executed`` counts tasks submitted in this run; ``skipped`` the units
    already in the store; ``failures`` one dict per failed unit (``label``, ``fingerprint``,
    ``error``), planning failures included."""

    run_id: str
    planned: int
    executed: int
    skipped: int
    succeeded: int
    failures: list = field(default_factory=list)
    report_path: str | None = None
    dashboard: str | None = None
    seconds: float = 0.0
    plan: Plan | None = None
    #: Paths of the tidy tables written after the run (``scores``, ``probe``); empty if not written.
    tables: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures


#: Distributions whose versions a run's provenance records.
_PROVENANCE_DISTRIBUTIONS = ("cachescore", "numpy", "pandas", "scipy", "scikit-learn", "dask", "distributed",
                             "pyarrow", "pynndescent", "numba", "threadpoolctl", "croma")


def new_run_id() -> str:
    """``YYYYmmddTHHMMSSZ-<8 hex>``: sortable by start time, unique across concurrent runs."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]


class ProgressBar:
    """A dependency-free text progress bar: redraws in place on a terminal, one line per
    finished unit otherwise (logs, CI)."""

    def __init__(self, total: int, out: TextIO | None, width: int = 30):
        self.total, self.out, self.width = total, out, width
        self.done = self.failed = 0
        self.tty = bool(out is not None and getattr(out, "isatty", lambda: False)())

    def update(self, label: str, status: str, seconds: float | None = None) -> None:
        self.done += 1
        self.failed += status != "done"
        if self.out is None:
            return
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(round(frac * self.width))
        sec = f" {seconds:.1f}s" if seconds is not None else ""
        head = f"[{bar:<{self.width}}] {self.done}/{self.total} units"
        tail = f" ({self.failed} failed)" if self.failed else ""
        if self.tty:
            self.out.write(f"\r{head}{tail}  {status} {label}{sec}\033[K")
            if self.done == self.total:
                self.out.write("\n")
        else:
            self.out.write(f"{head}{tail}  {status} {label}{sec}\n")
        self.out.flush()


def _say(out: TextIO | None, msg: str) -> None:
    if out is not None:
        out.write(msg + "\n")
        out.flush()


def _task_key(unit, run_id: str | None) -> str:
    # the run id in the key keeps runs apart: a key still held by another client (e.g. an erred
    # task of an earlier run) would otherwise be reused instead of recomputed
    return f"cachescore-{unit.metric}-{unit.fingerprint[:32]}-{run_id or 'adhoc'}"


def _start(unit, client, drivers, *, bundles, run_id, retries):
    """Start one unit by its kind (the one dispatch on :class:`~.plan.UnitKind`); returns its
    future (a ``distributed.Future``, or a ``concurrent.futures.Future`` for a driven unit)."""
    if unit.kind is UnitKind.LARGE:
        return drivers.submit(drive_large_unit, unit, client, run_id, retries)
    key = _task_key(unit, run_id)
    if unit.kind is UnitKind.PROBE:
        return client.submit(run_probe_task, unit, bundles, run_id, key=key, retries=retries, pure=False, priority=10)
    return client.submit(run_unit, unit, run_id, key=key, retries=retries, pure=False)


def execute_plan(plan: Plan, client, *, store=None, retries: int = 2, out: TextIO | None = sys.stderr,
                 run_id: str | None = None, large_unit_drivers: int = 3) -> tuple[int, list]:
    """Run the plan's pending units on ``client``; return ``(n_succeeded, failures)``.

    Each unit starts by its :class:`~.plan.UnitKind` (:func:`_start`): ``SCORE`` units are one
    task each (:func:`~.unit.run_unit`, key ``cachescore-<metric>-<fingerprint prefix>-<run id>``);
    ``PROBE`` units are :func:`~.unit.run_probe_task` tasks, submitted first with a higher
    priority (each secedes from its worker's thread pool and fans its replicates out as further
    tasks, so metric units run while sweeps are in flight); ``LARGE`` units are not tasks: up to
    ``large_unit_drivers`` of them at a time are driven from this process on threads
    (:func:`~.unit.drive_large_unit`), and only their bounded search tasks go to the workers.
    Tasks get ``retries`` retries for exceptions that are not data errors. Completions of every
    kind are gathered in one loop that draws the progress bar. A unit whose task finally errors
    (retries exhausted, worker killed too often) is recorded as failed in the store by the client.
    """
    store = ResultsStore(plan.job.store) if store is None else store
    pending = sorted(plan.pending, key=lambda u: u.kind is not UnitKind.PROBE)  # probe units first (stable)
    units = {u.fingerprint: u for u in pending}
    finished: queue.Queue = queue.Queue()  # futures of every kind, as they complete
    futures = {}
    drivers = ThreadPoolExecutor(max_workers=max(1, int(large_unit_drivers)), thread_name_prefix="cachescore-large")
    for u in sorted(pending, key=lambda u: u.kind is UnitKind.LARGE):  # tasks first, then drivers
        fut = _start(u, client, drivers, bundles=plan.job.bundles, run_id=run_id, retries=retries)
        futures[fut] = u.fingerprint
        fut.add_done_callback(finished.put)
    bar = ProgressBar(len(futures), out)
    succeeded, failures = 0, []
    try:
        for _ in range(len(futures)):
            fut = finished.get()
            unit = units[futures[fut]]
            if isinstance(fut, LocalFuture):
                res = fut.result()  # drive_large_unit records its own failures and never raises
            else:
                try:
                    # a finished task whose small result was lost with its worker (a cancelled or
                    # preempted worker job) is recomputed by the scheduler: wait for it
                    res = fut.result()
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # noqa: BLE001 - erred after its retries; CancelledError (scheduler lost)
                    err = f"{type(exc).__name__}: {exc}"
                    store.record_failure(unit.fingerprint, unit=dict(unit.describe(), run_id=run_id), error=err)
                    failures.append({"label": unit.label, "fingerprint": unit.fingerprint, "error": err})
                    bar.update(unit.label, "FAILED")
                    continue
                finally:
                    fut.release()
            if res["status"] == "done":
                succeeded += 1
            else:
                failures.append({"label": unit.label, "fingerprint": unit.fingerprint, "error": res["error"]})
            bar.update(unit.label, res["status"] if res["status"] == "done" else "FAILED", res.get("seconds"))
    except BaseException:  # interrupted: drivers stop at their next cluster call once the client closes
        drivers.shutdown(wait=False, cancel_futures=True)
        raise
    drivers.shutdown(wait=True)
    remove_scratch([u for u in pending if u.kind is UnitKind.LARGE])  # every unit of this run has ended
    return succeeded, failures


def ensure_demo_cache(job, out: TextIO | None = sys.stderr) -> bool:
    """Synthesise the demo cache at ``job.cache`` if ``[demo] synthesise`` is set and the cache is
    not complete (``cache.json``, written last by the synthesiser, is missing: absent folder or an
    interrupted synthesis). Returns whether it was (re)created."""
    if not job.demo.get("synthesise") or (Path(job.cache) / "cache.json").exists():
        return False
    _say(out, f"synthesising demo cache at {job.cache}")
    d = job.demo
    make_demo_cache(job.cache, n_slides_per_cell=d["n_slides_per_cell"], tiles_per_slide=d["tiles_per_slide"],
                    dim=d["dim"], seed=d["seed"], overwrite=Path(job.cache).exists())
    return True


def _hardware(client=None) -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(), "client_cpus": os.cpu_count()}
    try:
        info["client_memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        info["client_memory_bytes"] = None
    if client is not None:
        workers = client.scheduler_info(n_workers=-1).get("workers", {})
        info["scheduler"] = client.scheduler.address
        info["workers"] = [{"address": a, "nthreads": w.get("nthreads"), "memory_limit": w.get("memory_limit")}
                           for a, w in sorted(workers.items())]
    return info


def plan_parallelism(plan: Plan) -> int:
    """Tasks the plan's pending work can run at once: one per metric unit, one per probe replicate
    × split, a few per large unit (its search batches); the bound of adaptive scaling."""
    n = 0
    for u in plan.pending:
        if u.kind is UnitKind.PROBE and plan.job.probe is not None:
            n += int(plan.job.probe.iterations) * len(plan.job.probe.resolved_schedule())
        else:
            n += 4 if u.kind is UnitKind.LARGE else 1
    return max(1, n)


def maximum_jobs(job, plan: Plan, kind: str | None = None) -> int:
    """``[cluster] maximum_jobs``, or (0) the plan's parallelism over the processes per job of
    ``kind`` (default the job's ``[cluster] kind``), at most 32."""
    c = job.cluster
    kind = kind or c.get("kind")
    if int(c.get("maximum_jobs", 0)) > 0:
        return int(c["maximum_jobs"])
    per_job = int(c.get(kind, {}).get("processes", 1)) if kind in ("slurm", "pbs") else 1
    return max(1, min(32, -(-plan_parallelism(plan) // max(1, per_job))))


def _client_for(job, plan: Plan, scheduler: str | None, cluster_kind: str, processes: bool):
    """The one place a run gets its client: an existing scheduler, a batch / Kubernetes cluster
    scaled adaptively, or a LocalCluster."""
    ex = job.execution
    if scheduler:
        return open_client(scheduler)
    if cluster_kind != "local":
        return open_cluster_client({**job.cluster, "kind": cluster_kind},
                                   maximum_jobs=maximum_jobs(job, plan, cluster_kind))
    return open_client(None, n_workers=ex["n_workers"], memory_limit=ex["memory_limit"], dashboard=ex["dashboard"],
                       processes=processes)


def run_job(job, *, scheduler: str | None = None, out: TextIO | None = sys.stderr, processes: bool = True,
            plan: Plan | None = None, cluster: str | None = None) -> RunSummary:
    """Score a job end to end (see module docstring). ``scheduler`` overrides ``[execution] scheduler``.

    ``plan`` is the job's plan when the caller already made one against the same store (the CLI
    plans once, to print it); by default the job is planned here, after the demo cache exists.
    ``cluster`` (``local`` | ``slurm`` | ``pbs`` | ``kubernetes``) overrides ``[cluster] kind``; it
    and ``scheduler`` are exclusive. The cluster starts only when units are pending (plan first,
    then scale), so an up-to-date job requests no worker job.

    Returns a :class:`RunSummary` (with the ``plan`` it ran); it does not raise for failed units
    (they are in ``summary.failures`` and in the store). Raises for job-level problems: missing
    cache, encoder/view not in the cache, unreachable scheduler.
    """
    t0 = time.perf_counter()
    run_id = new_run_id()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ensure_demo_cache(job, out)
    if not Path(job.cache).is_dir():
        raise FileNotFoundError(f"{job.path or '<job>'}: cache folder not found: {job.cache}")
    store = ResultsStore(job.store)
    plan = plan_job(job, store=store) if plan is None else plan
    failures = []
    for inv in plan.invalid:
        store.record_failure(inv.fingerprint, unit=dict(inv.unit, run_id=run_id), error=inv.error)
        failures.append({"label": inv.label, "fingerprint": inv.fingerprint, "error": inv.error})
    n_all = len(plan.units) + len(plan.invalid)
    _say(out, f"job {job.name}: {n_all} units, {len(plan.done)} up to date, {len(plan.pending)} to run, "
              f"{len(plan.invalid)} invalid")
    ex = job.execution
    scheduler = scheduler or ex["scheduler"] or None
    summary = RunSummary(run_id=run_id, planned=n_all, executed=len(plan.pending), skipped=len(plan.done),
                         succeeded=0, plan=plan)
    hardware = None

    def provenance(state: str) -> None:
        store.write_provenance(run_id, {
            "run_id": run_id,
            "state": state,
            "started_at": started,
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds") if state == "finished" else None,
            "job_path": str(job.path) if job.path else None,
            "job": job.document,
            "cache": str(job.cache),
            "store": str(job.store),
            "code_version": code_version(),
            "versions": package_versions(_PROVENANCE_DISTRIBUTIONS, python=True),
            "hardware": hardware or _hardware(),
            "input_fingerprints": plan.inputs,
            "units": {"planned": n_all, "executed": summary.executed, "skipped": summary.skipped,
                      "succeeded": summary.succeeded, "failed": len(failures)},
            "executed_fingerprints": sorted(u.fingerprint for u in plan.pending),
            "failures": failures,
            "performance_report": summary.report_path,
            "tables": summary.tables,
            "dashboard": summary.dashboard,
            "cluster": scheduler or kind,
            "seconds": time.perf_counter() - t0,
        })

    kind = cluster or job.cluster.get("kind", "local")
    if scheduler and kind != "local":
        raise ValueError(f"{job.path or '<job>'}: --scheduler and --cluster {kind} are exclusive: give one")
    provenance("running")  # a run killed midway still leaves its provenance (state "running")
    if plan.pending:
        with _client_for(job, plan, scheduler, kind, processes) as client:
            summary.dashboard = client.dashboard_link if (scheduler or kind != "local" or ex["dashboard"]) else None
            if summary.dashboard:
                _say(out, f"dashboard: {summary.dashboard}")
            hardware = _hardware(client)
            kw = dict(store=store, retries=ex["retries"], out=out, run_id=run_id,
                      large_unit_drivers=ex["large_unit_drivers"])

            def work():
                return execute_plan(plan, client, **kw)

            if ex["performance_report"]:
                report = Path(store.run_dir(run_id)) / "dask-performance-report.html"
                report.parent.mkdir(parents=True, exist_ok=True)
                with client.as_current(), performance_report(filename=str(report)):
                    ok, fails = work()
                summary.report_path = str(report)
            else:
                ok, fails = work()
        summary.succeeded = ok
        failures += fails
    summary.failures = failures
    summary.tables = publish_results(plan, store, out=out)
    summary.seconds = time.perf_counter() - t0
    provenance("finished")
    return summary


def build_results(plan: Plan, store) -> tuple:
    """``(scores, probe, probe_centres)``: the tidy tables of the plan's current records (:mod:`cachescore.results`
    with the job's ``[metrics] bootstrap`` and ``[report] min_support``). Records the store lacks
    are left out; nothing is written."""
    job = plan.job
    fps = plan.record_fingerprints()
    scores = score_table(store, Cache(job.cache), fps, bootstrap=job.metrics.get("bootstrap"),
                         min_support=float(job.report.get("min_support", 0.5)))
    return scores, probe_table(store, fps), probe_centre_table(store, fps)


def publish_results(plan: Plan, store, *, out: TextIO | None = None) -> dict:
    """Rebuild ``<store>/scores.parquet`` and ``<store>/probe.parquet`` from the plan's current
    records (scores with CIs, flags, ranks; :mod:`cachescore.results`) and write them atomically.
    Returns ``{"scores": path, "probe": path}``, or ``{}`` when a table could not be built (the
    reason is printed; the stored records are untouched and the next run tries again)."""
    try:
        scores, probe, centres = build_results(plan, store)
        return {k: str(v) for k, v in publish_tables(store.path, scores, probe, centres).items()}
    except (ValueError, OSError, CorruptRecordError) as exc:  # bad inputs or a damaged record: say so, go on
        _say(out, f"results tables not written: {type(exc).__name__}: {exc}")
        return {}
