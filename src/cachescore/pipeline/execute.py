"""Execution: submit the pending work units as Dask futures, show progress, record everything.

:func:`run_job` is the whole run (what ``cachescore run`` calls): synthesise the demo cache if the
job asks for it, plan, record units that failed at planning, open the client (LocalCluster or
``--scheduler``), submit one task per pending unit (metric and probe-sweep units together, with
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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from .._version import package_versions
from .plan import Plan, code_version, plan_job
from .unit import run_unit

__all__ = ["RunSummary", "execute_plan", "run_probe_units", "run_job", "ensure_demo_cache", "new_run_id",
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


def execute_plan(plan: Plan, client, *, store=None, retries: int = 2, out: TextIO | None = sys.stderr,
                 unit_fn=None, load_fn=None, run_id: str | None = None, probe_fn=None,
                 large_unit_drivers: int = 3) -> tuple[int, list]:
    """Run the plan's pending units on ``client``; return ``(n_succeeded, failures)``.

    One task per unit (key ``cachescore-<metric>-<fingerprint prefix>-<run id>``), ``retries``
    retries for exceptions that are not data errors: metric units run :func:`~.unit.run_unit`,
    probe-sweep units :func:`~.unit.run_probe_task` (submitted first, with a higher priority: each
    secedes from its worker's thread pool and fans its replicates out as further tasks, so metric
    units run while sweeps are in flight). Units planned out of core (``engine = "distributed"``)
    are not tasks: up to ``large_unit_drivers`` of them at a time are driven from this process
    on threads (:func:`~.unit.drive_large_unit`), and only their bounded search tasks go to the
    workers. Completions of both kinds are gathered in one loop that draws the progress bar.
    A unit whose task finally errors (retries exhausted, worker killed too often) is recorded as
    failed in the store by the client. ``unit_fn`` / ``load_fn`` / ``probe_fn`` replace
    :func:`~.unit.score_unit` / :func:`~.unit.load_unit_inputs` / ``run_probe_unit`` (tests; with
    ``unit_fn`` or ``load_fn`` large units run as tasks too).
    """
    from concurrent.futures import Future as LocalFuture
    from concurrent.futures import ThreadPoolExecutor

    from ..store import ResultsStore
    from .large_scope import remove_scratch
    from .unit import drive_large_unit, run_probe_task

    store = ResultsStore(plan.job.store) if store is None else store
    pending = sorted(plan.pending, key=lambda u: u.metric != "probe")  # probe units first (stable)
    units = {u.fingerprint: u for u in pending}
    drive_here = unit_fn is None and load_fn is None
    driven = [u for u in pending if drive_here and u.metric != "probe" and u.params.get("engine") == "distributed"]
    driven_fps = {u.fingerprint for u in driven}
    finished: queue.Queue = queue.Queue()  # futures of both kinds, as they complete
    futures = {}
    for fp, u in units.items():
        if fp in driven_fps:
            continue
        # the run id in the key keeps runs apart: a key still held by another client (e.g. an
        # erred task of an earlier run) would otherwise be reused instead of recomputed
        key = f"cachescore-{u.metric}-{fp[:32]}-{run_id or 'adhoc'}"
        if u.metric == "probe":
            fut = client.submit(run_probe_task, u, plan.job.bundles, run_id, probe_fn, key=key, retries=retries,
                                pure=False, priority=10)
        else:
            fut = client.submit(run_unit, u, unit_fn, load_fn, run_id, key=key, retries=retries, pure=False)
        futures[fut] = fp
        fut.add_done_callback(finished.put)
    drivers = ThreadPoolExecutor(max_workers=max(1, int(large_unit_drivers)), thread_name_prefix="cachescore-large")
    for u in driven:
        fut = drivers.submit(drive_large_unit, u, client, run_id, retries)
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
            elif fut.status != "finished":  # erred after its retries, or cancelled (scheduler lost)
                try:
                    exc = fut.exception()
                except BaseException as lost:  # noqa: BLE001 - CancelledError is a BaseException
                    exc = lost
                err = f"{type(exc).__name__}: {exc}"
                store.record_failure(unit.fingerprint, unit=dict(unit.describe(), run_id=run_id), error=err)
                failures.append({"label": unit.label, "fingerprint": unit.fingerprint, "error": err})
                bar.update(unit.label, "FAILED")
                fut.release()
                continue
            else:
                res = fut.result()
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
    remove_scratch(pending)  # large-scope partitions and tables: every unit of this run has ended
    return succeeded, failures


def run_probe_units(plan: Plan, client, *, store=None, retries: int = 2, out: TextIO | None = sys.stderr,
                    run_id: str | None = None, probe_fn=None) -> tuple[int, list]:
    """Run only the plan's pending probe-sweep units (:func:`execute_plan` runs them together
    with the metric units); return ``(n_succeeded, failures)``."""
    import dataclasses

    only = dataclasses.replace(plan, pending=tuple(u for u in plan.pending if u.metric == "probe"))
    return execute_plan(only, client, store=store, retries=retries, out=out, run_id=run_id, probe_fn=probe_fn)


def ensure_demo_cache(job, out: TextIO | None = sys.stderr) -> bool:
    """Synthesise the demo cache at ``job.cache`` if ``[demo] synthesise`` is set and the cache is
    not complete (``cache.json``, written last by the synthesiser, is missing: absent folder or an
    interrupted synthesis). Returns whether it was (re)created."""
    if not job.demo.get("synthesise") or (Path(job.cache) / "cache.json").exists():
        return False
    from ..cache.synthetic import make_demo_cache

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


def run_job(job, *, scheduler: str | None = None, out: TextIO | None = sys.stderr, processes: bool = True,
            unit_fn=None, load_fn=None, probe_fn=None) -> RunSummary:
    """Score a job end to end (see module docstring). ``scheduler`` overrides ``[execution] scheduler``.

    Returns a :class:`RunSummary`; it does not raise for failed units (they are in
    ``summary.failures`` and in the store). Raises for job-level problems: missing cache,
    encoder/view not in the cache, unreachable scheduler.
    """
    from ..store import ResultsStore
    from .cluster import open_client

    t0 = time.perf_counter()
    run_id = new_run_id()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ensure_demo_cache(job, out)
    if not Path(job.cache).is_dir():
        raise FileNotFoundError(f"{job.path or '<job>'}: cache folder not found: {job.cache}")
    store = ResultsStore(job.store)
    plan = plan_job(job, store=store)
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
                         succeeded=0)
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
            "dashboard": summary.dashboard,
            "seconds": time.perf_counter() - t0,
        })

    provenance("running")  # a run killed midway still leaves its provenance (state "running")
    if plan.pending:
        with open_client(scheduler, n_workers=ex["n_workers"], memory_limit=ex["memory_limit"],
                         dashboard=ex["dashboard"], processes=processes) as client:
            summary.dashboard = client.dashboard_link if (scheduler or ex["dashboard"]) else None
            if summary.dashboard:
                _say(out, f"dashboard: {summary.dashboard}")
            hardware = _hardware(client)
            kw = dict(store=store, retries=ex["retries"], out=out, unit_fn=unit_fn, load_fn=load_fn, run_id=run_id,
                      probe_fn=probe_fn, large_unit_drivers=ex["large_unit_drivers"])

            def work():
                return execute_plan(plan, client, **kw)

            if ex["performance_report"]:
                from distributed import performance_report

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
    summary.seconds = time.perf_counter() - t0
    provenance("finished")
    return summary
