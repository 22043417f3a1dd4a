"""The run lifecycle: what ``cachescore run`` does from a job to a store with fresh tables.

:func:`run_job` synthesises the demo cache if the job asks for it, plans, records units that
failed at planning, takes the store's run lock, opens the client (LocalCluster, ``--scheduler``
or a batch / Kubernetes cluster: :func:`~.cluster.client_for`), runs the completion loop
(:func:`~.execute.execute_plan`, inside a Dask ``performance_report`` when asked), rebuilds the
tidy tables (:func:`cachescore.results.publish_results`) and writes the run's provenance
(:class:`~.provenance.Provenance`). Nothing is started when no unit is pending, so a second run of
an unchanged job executes no unit (``RunSummary.executed == 0``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import pyarrow as pa
from distributed import performance_report

from ..cache.errors import CacheNotFoundError
from ..cache.location import cache_root, check_cache_root, remote_session
from ..cache.synthetic import make_demo_cache
from ..errors import RunAborted, RunInterrupted
from ..monitoring import RunMonitor, page_url, unit_entry
from ..store import ResultsStore
from ..store.lock import StoreLock
from .cluster import client_for
from .execute import execute_plan, record_client_failure
from .logs import ignore_abandoned_gathers, restore_logs
from .messages import free_space, say
from .outcome import DONE, UnitOutcome
from .plan import Plan, empty_plan_hint, plan_job, unit_is_stored
from .provenance import Provenance, hardware, new_run_id
from .tables import publish_plan_results
from .validate import refuse_invalid, validate_plan

__all__ = ["RunSummary", "run_job", "ensure_demo_cache", "require_cache"]


@dataclass
class RunSummary:
    """What a run did. ``executed`` counts tasks submitted in this run; ``skipped`` the units
    already in the store; ``failures`` one dict per failed unit (``label``, ``fingerprint``,
    ``error``: :meth:`~.outcome.UnitOutcome.failure`), planning failures included."""

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
    #: ``<dashboard>/cachescore``, the live table of this run's units (None without a dashboard).
    status_page: str | None = None
    #: Labels of pending units that never ended (an aborted or interrupted run).
    not_run: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


_SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


def ensure_demo_cache(job, out: TextIO | None = sys.stderr) -> bool:
    """Synthesise the demo cache at ``job.cache`` if ``[demo] synthesise`` is set and the cache is
    not complete (``cache.json``, written last by the synthesiser, is missing: absent folder or an
    interrupted synthesis). Returns whether it was (re)created."""
    d = job.demo
    if not d.synthesise or (cache_root(job.cache) / "cache.json").exists():
        return False
    say(out, f"synthesising demo cache at {job.cache}")
    with remote_session(job.cache) as folder:  # a URL: synthesised in a staging folder, then uploaded
        make_demo_cache(folder, n_slides_per_cell=d.n_slides_per_cell, tiles_per_slide=d.tiles_per_slide, dim=d.dim,
                        seed=d.seed, overwrite=Path(folder).exists())
    return True


def require_cache(job) -> None:
    """Raise ``FileNotFoundError`` naming the job when its cache does not exist, and
    :class:`~cachescore.cache.CacheAccessError` when its storage refuses to list it."""
    try:
        check_cache_root(job.cache)
    except CacheNotFoundError:
        raise FileNotFoundError(f"{job.path or '<job>'}: cache folder not found: {job.cache}") from None


def _store_writable(store) -> bool:
    """Whether files can be created in the store folder (a real probe: ``os.access`` says yes to
    root on a read-only mount)."""
    probe = Path(store.path) / f".write-probe-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        probe.touch()
        probe.unlink()
        return True
    except OSError:
        return False


def driver_allocator() -> None:
    """Arrow's buffers in the driving process come from the C heap (``pyarrow.system_memory_pool``)
    unless ``ARROW_DEFAULT_MEMORY_POOL`` chooses a pool (ADR-0022). The default pool (mimalloc)
    keeps its freed pages in 2 MiB huge pages on a kernel with transparent huge pages: planning
    a 2M-row view peaked 33 MiB higher with it (185 vs 152 MiB, +37 MiB over a 200k view against
    +20). The driver makes few, short-lived Arrow buffers, so the C heap costs it no time;
    workers in their own processes keep the default."""
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return
    pa.set_memory_pool(pa.system_memory_pool())


def run_job(job, *, scheduler: str | None = None, out: TextIO | None = sys.stderr, processes: bool = True,
            plan: Plan | None = None, cluster: str | None = None, verbose: bool = False) -> RunSummary:
    """Score a job end to end (see module docstring). ``scheduler`` overrides ``[execution] scheduler``.

    ``plan`` is the job's plan when the caller already made one against the same store (the CLI
    plans once, to print it); by default the job is planned here, after the demo cache exists.
    ``cluster`` (``local`` | ``slurm`` | ``pbs`` | ``kubernetes``) overrides ``[cluster] kind``; it
    and ``scheduler`` are exclusive. The cluster starts only when units are pending (plan first,
    then scale), so an up-to-date job requests no worker job. ``verbose``: a line per finished unit.

    Lifecycle: earlier runs whose provenance still says ``running`` but whose process is gone are
    marked ``interrupted``; an up-to-date job on a read-only store returns at once (nothing needed
    writing); otherwise the store's run lock is taken (:class:`~cachescore.store.lock.StoreLock`: a
    second run on the same store raises :class:`~cachescore.store.lock.StoreLockedError` at once),
    leftovers of crashed writers are swept, the provenance says ``running`` (with this process's
    host and pid) and finally one of ``finished``, ``aborted`` (with the reason) or
    ``interrupted``; the tidy tables are rebuilt from what is stored in every case.

    Returns a :class:`RunSummary` (with the ``plan`` it ran); it does not raise for failed units
    (they are in ``summary.failures`` and in the store). Raises for job-level problems: missing
    cache, encoder/view not in the cache, unreachable scheduler, a locked or unwritable store;
    :class:`~cachescore.errors.RunAborted` (scheduler lost, no workers) and
    :class:`~cachescore.errors.RunInterrupted` (SIGINT / SIGTERM; ``KeyboardInterrupt`` becomes
    it) carry the run's ``summary``.
    """
    t0 = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    driver_allocator()
    store, plan = _prepare(job, plan, out)
    scheduler = scheduler or job.execution.scheduler or None
    kind = cluster or job.cluster.kind
    if scheduler and kind != "local":
        raise ValueError(f"{job.path or '<job>'}: --scheduler and --cluster {kind} are exclusive: give one")
    n_all = len(plan.units) + len(plan.invalid)
    summary = RunSummary(run_id=new_run_id(), planned=n_all, executed=len(plan.pending), skipped=len(plan.done),
                         succeeded=0, plan=plan)
    if not _store_writable(store):
        if not plan.pending and not plan.invalid:
            say(out, f"results store {store.path} is read-only and every unit is up to date: nothing needed writing")
            summary.seconds = time.perf_counter() - t0
            return summary
        raise RunAborted("store-unwritable", f"results store {store.path} cannot be written (read-only or no "
                                             f"permission): {len(plan.pending)} unit(s) to run and "
                                             f"{len(plan.invalid)} failure(s) to record cannot be stored")
    with StoreLock(store.path, summary.run_id, stale_after_s=job.execution.stale_lock_age) as lock:
        if lock.taken_over:
            say(out or sys.stderr, f"warning: took over the stale lock of {lock.taken_over}")
        swept = store.sweep(older_than_s=60.0)
        if swept:
            say(out, f"swept {swept} leftover file(s) of interrupted writes from {store.path}")
        ledger = Provenance(store, plan, summary, started=started, t0=t0, cluster=scheduler or kind, out=out)
        return _locked_run(plan, store, summary, ledger, scheduler=scheduler, kind=kind, out=out,
                           processes=processes, verbose=verbose)


def _prepare(job, plan: Plan | None, out) -> tuple:
    """The store (stale runs marked) and the validated plan, printed in one line."""
    ensure_demo_cache(job, out)
    require_cache(job)
    store = ResultsStore(job.store)
    for stale in store.mark_stale_runs():  # warnings reach stderr even when progress is off
        say(out or sys.stderr, f"run {stale} ended without finishing (its process is gone): marked 'interrupted'")
    plan = plan_job(job, store=store) if plan is None else plan
    plan = refuse_invalid(plan, validate_plan(plan))  # a schedule mistake costs seconds, not a cluster start
    say(out, f"job {job.name}: {len(plan.units) + len(plan.invalid)} units, {len(plan.done)} up to date, "
             f"{len(plan.pending)} to run, {len(plan.invalid)} invalid")
    hint = empty_plan_hint(plan)
    if hint:
        say(out or sys.stderr, f"warning: {hint}")
    return store, plan


def _locked_run(plan, store, summary, ledger: Provenance, *, scheduler, kind, out, processes, verbose) -> RunSummary:
    """The part of :func:`run_job` that holds the store's lock: record planning failures, execute,
    publish the tables, write the final provenance."""
    failures, ended = [], {}
    for inv in plan.invalid:
        record_client_failure(store, inv, summary.run_id, inv.error)
        failures.append(UnitOutcome.failed(inv, inv.error).failure())
    ledger.write("running", failures=failures, ended=ended)
    try:
        if plan.pending:
            _run_pending(plan, store, summary, ledger, failures, ended, scheduler=scheduler, kind=kind,
                         processes=processes, out=out, verbose=verbose)
    except BaseException as exc:
        restore_logs()  # the client is closed: distributed's own logs matter again
        state, reason = ledger.ending or _ending(exc)
        _finish(plan, store, summary, failures, out=out, t0=ledger.t0)
        ledger.write(state, reason, failures=failures, ended=ended)
        if isinstance(exc, (KeyboardInterrupt, RunInterrupted)):
            raise _interrupted(exc, summary) from None
        exc.summary = summary
        raise
    _finish(plan, store, summary, failures, out=out, t0=ledger.t0)
    ledger.write("finished", failures=failures, ended=ended)
    return summary


def _run_pending(plan, store, summary, ledger, failures: list, ended: dict, *, scheduler, kind, processes, out,
                 verbose) -> None:
    """Open the client, show where to watch, execute; an early ending is noted on ``ledger.ending``
    and what the workers stored before it is counted (:func:`_settle_from_store`)."""
    job = plan.job
    with client_for(job, plan, scheduler, kind, processes) as client:
        monitor = _start_monitor(client, plan, summary, shown=bool(scheduler or kind != "local"
                                                                    or job.execution.dashboard), out=out)
        ledger.hardware = hardware(client)
        state, reason = "finished", None
        try:
            summary.succeeded, fails = _execute(plan, client, store, monitor, out=out, verbose=verbose,
                                                ended=ended, summary=summary)
            failures += fails
        except BaseException as exc:
            state, reason = ledger.ending = _ending(exc)
            _settle_from_store(plan, store, ended)
            summary.succeeded = sum(1 for o in ended.values() if o.status == DONE)
            failures += [o.failure() for o in ended.values() if o.status != DONE]
            raise
        finally:
            monitor.end(state, reason)


def _start_monitor(client, plan, summary, *, shown: bool, out) -> RunMonitor:
    """Start the run board on the scheduler and print the dashboard (and status page) link."""
    monitor = RunMonitor(client)
    ignore_abandoned_gathers()
    summary.dashboard = _dashboard_link(client) if shown else None
    summary.status_page = page_url(summary.dashboard) if monitor.ok else None
    if summary.dashboard:
        say(out, f"dashboard: {summary.dashboard}" + (f"  (this run: {summary.status_page})" if summary.status_page
                                                       else ""))
    job = plan.job
    monitor.start({"run_id": summary.run_id, "job": job.name, "store": str(job.store), "started": time.time()},
                  [unit_entry(u, "pending") for u in plan.pending] + [unit_entry(u, "skipped") for u in plan.done] +
                  [unit_entry(u, "failed") for u in plan.invalid])
    return monitor


def _interrupted(exc: BaseException, summary: RunSummary) -> RunInterrupted:
    signum = exc.signum if isinstance(exc, RunInterrupted) else int(signal.SIGINT)
    interrupted = RunInterrupted(signum)
    interrupted.summary = summary
    return interrupted


def _settle_from_store(plan: Plan, store, ended: dict) -> None:
    """A run that ends early counts what its workers stored before the end, not only the results
    this process had fetched (a worker writes a unit's record before the client hears of it): a
    pending unit whose results are now complete in the store is added to ``ended`` as done — the
    summary, the provenance's ``succeeded`` / ``not_run`` and the next run's plan then agree."""
    for unit in plan.pending:
        if unit.fingerprint not in ended and unit_is_stored(store, unit, plan.job.probe):
            ended[unit.fingerprint] = UnitOutcome.done(unit)


def _dashboard_link(client) -> str | None:
    """The scheduler's dashboard URL, or None when it serves none (a scheduler started with
    ``--no-dashboard``: the client's link would be a guess at the default port)."""
    try:
        services = client.scheduler_info().get("services", {})
    except Exception:  # noqa: BLE001 - no link is better than a wrong one
        return None
    return client.dashboard_link if "dashboard" in services else None


def _ending(exc: BaseException) -> tuple[str, str]:
    """``(state, reason)`` of a run ended by ``exc``."""
    if isinstance(exc, RunInterrupted):
        return "interrupted", f"stopped by {_SIGNAL_NAMES.get(exc.signum, f'signal {exc.signum}')}"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", f"stopped by {_SIGNAL_NAMES[signal.SIGINT]}"
    return "aborted", f"{type(exc).__name__}: {exc}" if not isinstance(exc, RunAborted) else str(exc)


def _execute(plan, client, store, monitor, *, out, verbose, ended, summary) -> tuple[int, list]:
    """execute_plan with the job's execution settings, inside a Dask performance report if asked
    (kept for what ran when the run ends early, while the scheduler is still there)."""
    ex = plan.job.execution
    kw = dict(store=store, retries=ex.retries, out=out, run_id=summary.run_id,
              large_unit_drivers=ex.large_unit_drivers, monitor=monitor,
              no_workers_timeout=ex.no_workers_timeout, verbose=verbose, ended=ended)
    if not ex.performance_report:
        return execute_plan(plan, client, **kw)
    report = Path(store.run_dir(summary.run_id)) / "dask-performance-report.html"
    recorder = performance_report(filename=str(report), mode="inline")  # bokeh inlined: opens offline
    with client.as_current():
        recorder.__enter__()
        try:
            result = execute_plan(plan, client, **kw)
        except BaseException:
            if client.status == "running":  # keep the report of what ran (not after the scheduler is gone)
                _close_report(recorder, report, summary, out=None, store=store)
            raise
        _close_report(recorder, report, summary, out=out, store=store)
    return result


def _close_report(recorder, report: Path, summary, *, out, store) -> None:
    try:
        recorder.__exit__(None, None, None)
        summary.report_path = str(report)
    except Exception as exc:  # noqa: BLE001 - disk full: the scores are stored, the report is not
        say(out, f"performance report not written: {exc} ({free_space(store.path)})")


def _finish(plan, store, summary, failures: list, *, out, t0) -> None:
    """Rebuild the tidy tables from what is stored and say what could not be written."""
    summary.failures = failures
    summary.tables = publish_plan_results(plan, store, out=out)
    summary.seconds = time.perf_counter() - t0
    unwritable = [f for f in summary.failures if "cannot write" in str(f.get("error"))]
    if unwritable:
        say(out, f"{len(unwritable)} unit(s) could not be written to the results store {store.path} "
                 f"({free_space(store.path)}); the other units were still attempted")
