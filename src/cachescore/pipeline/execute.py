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

import logging
import os
import platform
import queue
import shutil
import signal
import sys
import time
import uuid
from concurrent.futures import Future as LocalFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import dask
from distributed import performance_report

from .._taskkeys import ANNOTATION, unit_prefix
from .._version import package_versions
from ..cache import Cache
from ..cache.synthetic import make_demo_cache
from ..errors import RunAborted, RunInterrupted
from ..monitoring import RunMonitor, page_url, unit_entry
from ..monitoring.progress import RunProgress
from ..neighbors.large_scope import remove_scratch
from ..results import probe_centre_table, probe_table, publish_tables, score_table
from ..store import CorruptRecordError, ResultsStore
from ..store.lock import StoreLock, this_process
from .cluster import open_client, open_cluster_client
from .interrupts import DeferredInterrupts
from .plan import Plan, UnitKind, code_version, empty_plan_hint, plan_job, unit_is_stored
from .unit import drive_large_unit, run_probe_task, run_unit, unit_annotation
from .validate import refuse_invalid, validate_plan

__all__ = ["RunSummary", "execute_plan", "run_job", "build_results", "publish_results", "ensure_demo_cache", "new_run_id"]


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
    #: ``<dashboard>/cachescore``, the live table of this run's units (None without a dashboard).
    status_page: str | None = None
    #: Labels of pending units that never ended (an aborted or interrupted run).
    not_run: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


#: Distributions whose versions a run's provenance records.
_PROVENANCE_DISTRIBUTIONS = ("cachescore", "numpy", "pandas", "scipy", "scikit-learn", "dask", "distributed",
                             "pyarrow", "pynndescent", "numba", "threadpoolctl", "croma")


def new_run_id() -> str:
    """``YYYYmmddTHHMMSSZ-<8 hex>``: sortable by start time, unique across concurrent runs."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]


def _say(out: TextIO | None, msg: str) -> None:
    if out is not None:
        out.write(msg + "\n")
        out.flush()


def _task_key(unit, run_id: str | None) -> str:
    """``<phase>.<encoder>.<view>.<metric>-<fingerprint prefix>-<run id>`` (phase ``score`` or
    ``probe``; :mod:`cachescore._taskkeys`). The run id keeps runs apart: a key still held by
    another client (e.g. an erred task of an earlier run) would otherwise be reused, not recomputed."""
    phase = "probe" if unit.kind is UnitKind.PROBE else "score"
    return f"{unit_prefix(phase, unit.encoder, unit.view, unit.metric)}-{unit.fingerprint[:16]}-{run_id or 'adhoc'}"


def _start(unit, client, drivers, *, bundles, run_id, retries):
    """Start one unit by its kind (the one dispatch on :class:`~.plan.UnitKind`); returns its
    future (a ``distributed.Future``, or a ``concurrent.futures.Future`` for a driven unit). The
    unit's tasks carry its annotation (:func:`~.unit.unit_annotation`)."""
    if unit.kind is UnitKind.LARGE:
        return drivers.submit(drive_large_unit, unit, client, run_id, retries)
    key = _task_key(unit, run_id)
    with dask.annotate(**{ANNOTATION: unit_annotation(unit, run_id)}):
        if unit.kind is UnitKind.PROBE:
            return client.submit(run_probe_task, unit, bundles, run_id, key=key, retries=retries, pure=False,
                                 priority=10)
        return client.submit(run_unit, unit, run_id, key=key, retries=retries, pure=False)


#: Loggers whose reconnect tracebacks follow a lost scheduler; silenced once the run says so itself.
_RECONNECT_LOGGERS = ("distributed.client", "distributed.comm", "distributed.core")
#: distributed's loggers whose level its config sets explicitly (the rest inherit ``distributed``).
_DISTRIBUTED_LOGGERS = ("distributed", "distributed.client", "distributed.worker", "distributed.nanny",
                        "distributed.scheduler", "distributed.core", "distributed.comm")
_QUIETED: dict = {}


def _quiet_logs(names=_RECONNECT_LOGGERS) -> None:
    """Raise ``names`` to CRITICAL in this process until :func:`_restore_logs`."""
    for name in names:
        log = logging.getLogger(name)
        _QUIETED.setdefault(name, log.level)
        log.setLevel(logging.CRITICAL)


def _quiet_owned_cluster(client) -> None:
    """A run that ends early (Ctrl-C, SIGTERM, an abort) and started its own cluster (a
    LocalCluster, batch jobs: ``client.cluster`` is set) tears it down mid-work; its workers then
    log each cancelled task and broken transfer with a traceback (``Async instruction …
    CancelledError``, ``failed during get data``), noise after the run's own one-line ending.
    Quiet distributed's logs on those workers (best effort, at most 5 s) and in this process
    (back with :func:`_restore_logs` once the client is closed). An external scheduler's workers
    (``--scheduler``) are not the run's to quiet and are left alone."""
    if getattr(client, "cluster", None) is None:
        return
    _quiet_logs(_DISTRIBUTED_LOGGERS)
    try:
        # on the workers too (never restored there: they exit with the cluster); Client._run, as
        # Client.run has no timeout and a wedged worker must not hold the ending up
        client.sync(client._run, _quiet_logs, _DISTRIBUTED_LOGGERS, on_error="ignore", callback_timeout=5)
    except BaseException:  # noqa: BLE001 - best effort: the cluster is closed next anyway
        pass


def _restore_logs() -> None:
    while _QUIETED:
        name, level = _QUIETED.popitem()
        logging.getLogger(name).setLevel(level)


class _Watchdog:
    """Checks, while no unit ends, that the run can still make progress (called about once a
    second by :func:`execute_plan`): the scheduler is connected (else, after ``grace_s`` of
    reconnect attempts, :class:`~cachescore.errors.RunAborted` ``scheduler-lost``) and has workers
    (else, after ``no_workers_timeout`` seconds, ``no-workers``; the progress line says "waiting
    for workers" meanwhile)."""

    def __init__(self, client, progress, *, no_workers_timeout: float, grace_s: float = 10.0):
        self.client, self.progress = client, progress
        self.no_workers_timeout, self.grace_s = float(no_workers_timeout), float(grace_s)
        self.address = getattr(client.scheduler, "address", None) or "?"
        self.disconnected_since = self.no_workers_since = None
        self.last_check = 0.0

    def _counts(self, done: int, pending: int) -> str:
        return f"{done} unit(s) done, {pending} not run"

    def connected(self) -> bool:
        return self.client.status == "running"

    def check(self, done: int, pending: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_check < 1.0:
            return
        self.last_check = now
        if not self.connected():
            self.disconnected_since = self.disconnected_since or now
            _quiet_logs()  # the run says what happened itself (or reconnects: logs back below)
            if force or now - self.disconnected_since >= self.grace_s:
                raise RunAborted("scheduler-lost", f"lost the Dask scheduler at {self.address} "
                                                   f"(client {self.client.status}): {self._counts(done, pending)}")
            return
        if self.disconnected_since is not None:
            _restore_logs()
        self.disconnected_since = None
        try:
            n_workers = len(self.client.nthreads())
        except Exception:  # noqa: BLE001 - the connection dropped meanwhile: the next check says so
            return
        if n_workers:
            self.no_workers_since = None
            self.progress.set_waiting(False)
            return
        self.no_workers_since = self.no_workers_since or now
        waited = now - self.no_workers_since
        self.progress.set_waiting(True, f"scheduler {self.address} has none ({pending} unit(s) pending)")
        if waited >= self.no_workers_timeout:
            raise RunAborted("no-workers", f"no Dask worker joined the scheduler at {self.address} for "
                                           f"{waited:.0f} s ([execution] no_workers_timeout = "
                                           f"{self.no_workers_timeout:g}): {self._counts(done, pending)}")


class _AbandonedGatherFilter(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for distributed's internal ``AllExit``
    sentinel: distributed leaves it in a gather it abandons (a result re-fetched after its worker
    died, then recomputed); asyncio would print it with a traceback at exit. Nothing else is
    touched."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ == "AllExit"
                    and type(exc).__module__.startswith("distributed"))


def _ignore_abandoned_gathers() -> None:
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedGatherFilter) for f in log.filters):
        log.addFilter(_AbandonedGatherFilter())


def _result_lost(client, fut) -> bool:
    """Whether a finished task's result is held by no worker any more (its worker died after it
    finished). Fetching it then would block until the scheduler has recomputed it, with no watchdog
    and possibly no worker left; the caller waits for the recomputation instead."""
    if fut.status != "finished":
        return False
    try:
        return not client.who_has([fut]).get(fut.key)
    except Exception:  # noqa: BLE001 - the scheduler is gone: fetching fails fast and says so
        return False


def _record_client_failure(store, unit, run_id, err: str) -> None:
    """Record a failure seen by the client (a task that erred, a unit invalid at planning)."""
    ident = unit.unit if hasattr(unit, "unit") else unit.describe()  # an InvalidUnit has only its identity
    try:
        store.record_failure(unit.fingerprint, unit=dict(ident, run_id=run_id), error=err)
    except OSError:  # a full or read-only store: the run's summary reports the failure anyway
        pass


def _fetch(fut, unit, client, watchdog: _Watchdog, store, run_id, fetch_errors: dict,
           counts: tuple) -> dict | None:
    """The status dict of unit ``unit``'s completed future ``fut``, or None when the caller should
    wait for it again: its small result was lost with its worker (the scheduler recomputes it), the
    fetch timed out, or a fetch failed while the task had finished or the connection is in doubt
    (not the unit's failure unless it keeps happening: 5 tries). A task that erred after its
    retries is recorded as failed in the store here. ``counts`` = (units ended, units left), for
    the watchdog's message. Raises what the watchdog raises (:class:`RunAborted`) and interrupts."""
    if isinstance(fut, LocalFuture):
        return fut.result()  # drive_large_unit records its own failures and never raises
    if _result_lost(client, fut):
        return None  # lost with its worker (a cancelled or preempted worker job): recomputed
    status = fut.status
    try:
        return fut.result(timeout=5)  # a small status dict: seconds at most when it is held
    except TimeoutError:  # lost meanwhile (a worker died since the check): as above
        return None
    except (KeyboardInterrupt, SystemExit, RunInterrupted, RunAborted):
        raise
    except BaseException as exc:  # noqa: BLE001 - erred after its retries; CancelledError (scheduler lost)
        fetch_errors[fut] = fetch_errors.get(fut, 0) + 1
        if status == "finished" or not watchdog.connected():
            # fetching a finished result failed, or the task was cancelled with the connection
            watchdog.check(*counts, force=not watchdog.connected())
            if fetch_errors[fut] < 5:
                time.sleep(0.2)
                return None
        err = f"{type(exc).__name__}: {exc}"
        _record_client_failure(store, unit, run_id, err)
        return {"fingerprint": unit.fingerprint, "label": unit.label, "status": "failed", "error": err}
    finally:
        fut.release()


def execute_plan(plan: Plan, client, *, store=None, retries: int = 2, out: TextIO | None = sys.stderr,
                 run_id: str | None = None, large_unit_drivers: int = 3, monitor: RunMonitor | None = None,
                 no_workers_timeout: float = 300.0, verbose: bool = False, ended: dict | None = None
                 ) -> tuple[int, list]:
    """Run the plan's pending units on ``client``; return ``(n_succeeded, failures)``.

    Each unit starts by its :class:`~.plan.UnitKind` (:func:`_start`): ``SCORE`` units are one
    task each (:func:`~.unit.run_unit`, key ``score.<encoder>.<view>.<metric>-<fingerprint
    prefix>-<run id>``); ``PROBE`` units are :func:`~.unit.run_probe_task` tasks (``probe.…``),
    submitted first with a higher priority (each secedes from its worker's thread pool and fans its
    replicates out as further tasks, so metric units run while sweeps are in flight); ``LARGE``
    units are not tasks: up to ``large_unit_drivers`` of them at a time are driven from this
    process on threads (:func:`~.unit.drive_large_unit`), and only their bounded search tasks go to
    the workers. Tasks get ``retries`` retries for exceptions that are not data errors.
    Completions of every kind are gathered in one loop that draws the progress
    (:class:`~cachescore.monitoring.progress.RunProgress`; ``verbose``: a line per unit), tells
    ``monitor`` (the scheduler's run board) and, while nothing ends, runs the watchdog. A unit
    whose task finally errors (retries exhausted, worker killed too often) is recorded as failed
    in the store by the client. ``ended`` (optional) receives ``fingerprint -> status`` of every
    unit that ended, so a caller knows what ran when this function raises.

    Raises :class:`~cachescore.errors.RunAborted` when the scheduler is lost or has no worker for
    ``no_workers_timeout`` seconds, and :class:`~cachescore.errors.RunInterrupted` for Ctrl-C or
    SIGTERM, taken at the loop's next turn (:class:`~.interrupts.DeferredInterrupts`, when called
    from the main thread). Either way the outstanding tasks are cancelled and the drivers stopped;
    what finished is in the store.
    """
    store = ResultsStore(plan.job.store) if store is None else store
    ended = {} if ended is None else ended
    pending = sorted(plan.pending, key=lambda u: u.kind is not UnitKind.PROBE)  # probe units first (stable)
    units = {u.fingerprint: u for u in pending}
    finished: queue.Queue = queue.Queue()  # futures of every kind, as they complete
    futures = {}
    drivers = ThreadPoolExecutor(max_workers=max(1, int(large_unit_drivers)), thread_name_prefix="cachescore-large")
    progress = RunProgress(len(pending), out, verbose=verbose)
    watchdog = _Watchdog(client, progress, no_workers_timeout=no_workers_timeout)

    def end(unit, status: dict) -> None:
        ended[unit.fingerprint] = status
        if monitor is not None:
            monitor.finish_unit(unit.fingerprint, status)
        progress.unit_done(unit.label, "done" if status["status"] == "done" else "FAILED", status.get("seconds"))

    succeeded, failures, fetch_errors = 0, [], {}
    try:
        with DeferredInterrupts() as interrupts:  # signals raise at the loop's top, not inside distributed
            for u in sorted(pending, key=lambda u: u.kind is UnitKind.LARGE):  # tasks first, then drivers
                interrupts.check()
                fut = _start(u, client, drivers, bundles=plan.job.bundles, run_id=run_id, retries=retries)
                futures[fut] = u.fingerprint
                fut.add_done_callback(finished.put)
            while len(ended) < len(futures):
                interrupts.check()
                try:
                    fut = finished.get(timeout=0.5)
                except queue.Empty:
                    watchdog.check(len(ended), len(futures) - len(ended))
                    continue
                unit = units[futures[fut]]
                res = _fetch(fut, unit, client, watchdog, store, run_id, fetch_errors,
                             (len(ended), len(futures) - len(ended)))
                if res is None:  # put back: it completes (again) later
                    fut.add_done_callback(finished.put)
                    continue
                if res["status"] == "done":
                    succeeded += 1
                else:
                    failures.append({"label": unit.label, "fingerprint": unit.fingerprint, "error": res["error"]})
                end(unit, res)
    except BaseException:  # interrupted or aborted: cancel what is left; drivers stop at their next cluster call
        outstanding = [f for f, fp in futures.items() if fp not in ended and not isinstance(f, LocalFuture)]
        if watchdog.connected():
            _quiet_owned_cluster(client)  # before cancelling: the cancels are what its workers log
        if outstanding and watchdog.connected():
            try:
                client.cancel(outstanding, reason="cachescore run ended early")
            except Exception:  # noqa: BLE001 - best effort: the cluster is closed next anyway
                pass
        drivers.shutdown(wait=False, cancel_futures=True)
        progress.close()
        raise
    drivers.shutdown(wait=True)
    progress.close()
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


def _free_space(path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MiB free"
    except OSError:
        return "free space unknown"


_SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


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
    run_id = new_run_id()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ensure_demo_cache(job, out)
    if not Path(job.cache).is_dir():
        raise FileNotFoundError(f"{job.path or '<job>'}: cache folder not found: {job.cache}")
    store = ResultsStore(job.store)
    for stale in store.mark_stale_runs():  # warnings reach stderr even when progress is off
        _say(out or sys.stderr, f"run {stale} ended without finishing (its process is gone): marked 'interrupted'")
    plan = plan_job(job, store=store) if plan is None else plan
    plan = refuse_invalid(plan, validate_plan(plan))  # a schedule mistake costs seconds, not a cluster start
    n_all = len(plan.units) + len(plan.invalid)
    _say(out, f"job {job.name}: {n_all} units, {len(plan.done)} up to date, {len(plan.pending)} to run, "
              f"{len(plan.invalid)} invalid")
    hint = empty_plan_hint(plan)
    if hint:
        _say(out or sys.stderr, f"warning: {hint}")
    ex = job.execution
    scheduler = scheduler or ex["scheduler"] or None
    kind = cluster or job.cluster.get("kind", "local")
    if scheduler and kind != "local":
        raise ValueError(f"{job.path or '<job>'}: --scheduler and --cluster {kind} are exclusive: give one")
    summary = RunSummary(run_id=run_id, planned=n_all, executed=len(plan.pending), skipped=len(plan.done),
                         succeeded=0, plan=plan)
    if not _store_writable(store):
        if not plan.pending and not plan.invalid:
            _say(out, f"results store {store.path} is read-only and every unit is up to date: nothing needed writing")
            summary.seconds = time.perf_counter() - t0
            return summary
        raise RunAborted("store-unwritable", f"results store {store.path} cannot be written (read-only or no "
                                             f"permission): {len(plan.pending)} unit(s) to run and "
                                             f"{len(plan.invalid)} failure(s) to record cannot be stored")
    with StoreLock(store.path, run_id, stale_after_s=ex["stale_lock_age"]) as lock:
        if lock.taken_over:
            _say(out or sys.stderr, f"warning: took over the stale lock of {lock.taken_over}")
        swept = store.sweep(older_than_s=60.0)
        if swept:
            _say(out, f"swept {swept} leftover file(s) of interrupted writes from {store.path}")
        return _locked_run(job, plan, store, summary, scheduler=scheduler, kind=kind, out=out, processes=processes,
                           verbose=verbose, started=started, t0=t0)


def _locked_run(job, plan, store, summary, *, scheduler, kind, out, processes, verbose, started, t0) -> RunSummary:
    """The part of :func:`run_job` that holds the store's lock: record planning failures, execute,
    publish the tables, write the final provenance."""
    run_id, ex = summary.run_id, job.execution
    failures, ended, hardware = [], {}, None
    for inv in plan.invalid:
        _record_client_failure(store, inv, run_id, inv.error)
        failures.append({"label": inv.label, "fingerprint": inv.fingerprint, "error": inv.error})

    def provenance(state: str, reason: str | None = None) -> None:
        not_run = sorted(u.label for u in plan.pending if u.fingerprint not in ended) if state != "running" else []
        summary.not_run = not_run
        info = {
            "run_id": run_id,
            "state": state,
            "reason": reason,
            "process": process,
            "started_at": started,
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds") if state != "running" else None,
            "job_path": str(job.path) if job.path else None,
            "job": job.document,
            "cache": str(job.cache),
            "store": str(job.store),
            "code_version": code_version(),
            "versions": package_versions(_PROVENANCE_DISTRIBUTIONS, python=True),
            "hardware": hardware or _hardware(),
            "input_fingerprints": plan.inputs,
            "units": {"planned": summary.planned, "executed": summary.executed, "skipped": summary.skipped,
                      "succeeded": summary.succeeded, "failed": len(failures), "not_run": len(not_run)},
            "executed_fingerprints": sorted(u.fingerprint for u in plan.pending),
            "not_run": not_run,
            "failures": failures,
            "performance_report": summary.report_path,
            "tables": summary.tables,
            "dashboard": summary.dashboard,
            "status_page": summary.status_page,
            "cluster": scheduler or kind,
            "seconds": time.perf_counter() - t0,
        }
        try:
            store.write_provenance(run_id, info)
        except OSError as exc:  # disk full: keep at least the final state (never a run that seems to run forever)
            compact = {k: info[k] for k in ("run_id", "state", "reason", "process", "started_at", "finished_at",
                                            "store", "units", "cluster", "seconds")}
            compact["note"] = f"compact provenance: the full one could not be written ({exc})"
            try:
                store.overwrite_provenance_in_place(run_id, compact)
                _say(out, f"provenance of run {run_id}: only its final state could be written ({exc}; "
                          f"{_free_space(store.path)})")
            except OSError as again:
                _say(out, f"provenance of run {run_id} not written: {again} ({_free_space(store.path)})")

    process = this_process()
    provenance("running")  # a run killed by SIGKILL leaves this; the next run / status marks it interrupted
    state, reason = "finished", None
    try:
        if plan.pending:
            with _client_for(job, plan, scheduler, kind, processes) as client:
                monitor = RunMonitor(client)
                _ignore_abandoned_gathers()
                summary.dashboard = _dashboard_link(client) if (scheduler or kind != "local" or ex["dashboard"]) else None
                summary.status_page = page_url(summary.dashboard) if monitor.ok else None
                if summary.dashboard:
                    _say(out, f"dashboard: {summary.dashboard}" +
                         (f"  (this run: {summary.status_page})" if summary.status_page else ""))
                hardware = _hardware(client)
                monitor.start({"run_id": run_id, "job": job.name, "store": str(job.store), "started": time.time()},
                              [unit_entry(u, "pending") for u in plan.pending] +
                              [unit_entry(u, "skipped") for u in plan.done] +
                              [unit_entry(u, "failed") for u in plan.invalid])
                try:
                    summary.succeeded, fails = _execute(plan, client, store, monitor, out=out, verbose=verbose,
                                                        ended=ended, run_id=run_id, summary=summary)
                    failures += fails
                except BaseException as exc:
                    state, reason = _ending(exc)
                    _settle_from_store(plan, store, ended)
                    summary.succeeded = sum(1 for s in ended.values() if s.get("status") == "done")
                    failures += [{"label": s.get("label"), "fingerprint": fp, "error": s.get("error")}
                                 for fp, s in ended.items() if s.get("status") != "done"]
                    raise
                finally:
                    monitor.end(state, reason)
    except BaseException as exc:
        _restore_logs()  # the client is closed: distributed's own logs matter again
        if state == "finished":  # raised outside execution (cluster start, client close)
            state, reason = _ending(exc)
        summary.failures = failures
        _finish(plan, store, summary, out=out, t0=t0)
        provenance(state, reason)
        if isinstance(exc, (KeyboardInterrupt, RunInterrupted)):
            signum = exc.signum if isinstance(exc, RunInterrupted) else int(signal.SIGINT)
            interrupted = RunInterrupted(signum)
            interrupted.summary = summary
            raise interrupted from None
        exc.summary = summary
        raise
    summary.failures = failures
    _finish(plan, store, summary, out=out, t0=t0)
    provenance("finished")
    return summary


def _settle_from_store(plan: Plan, store, ended: dict) -> None:
    """A run that ends early counts what its workers stored before the end, not only the results
    this process had fetched (a worker writes a unit's record before the client hears of it): a
    pending unit whose results are now complete in the store is added to ``ended`` as done — the
    summary, the provenance's ``succeeded`` / ``not_run`` and the next run's plan then agree."""
    for unit in plan.pending:
        if unit.fingerprint not in ended and unit_is_stored(store, unit, plan.job.probe):
            ended[unit.fingerprint] = {"fingerprint": unit.fingerprint, "label": unit.label, "status": "done"}


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


def _execute(plan, client, store, monitor, *, out, verbose, ended, run_id, summary) -> tuple[int, list]:
    """execute_plan with the job's execution settings, inside a Dask performance report if asked."""
    ex = plan.job.execution
    kw = dict(store=store, retries=ex["retries"], out=out, run_id=run_id, large_unit_drivers=ex["large_unit_drivers"],
              monitor=monitor, no_workers_timeout=ex["no_workers_timeout"], verbose=verbose, ended=ended)
    if not ex["performance_report"]:
        return execute_plan(plan, client, **kw)
    report = Path(store.run_dir(run_id)) / "dask-performance-report.html"
    recorder = performance_report(filename=str(report))
    with client.as_current():
        recorder.__enter__()
        try:
            result = execute_plan(plan, client, **kw)
        except BaseException:
            if client.status == "running":  # keep the report of what ran (not after the scheduler is gone)
                try:
                    recorder.__exit__(None, None, None)
                    summary.report_path = str(report)
                except Exception:  # noqa: BLE001 - the run's own error matters more
                    pass
            raise
        try:
            recorder.__exit__(None, None, None)
            summary.report_path = str(report)
        except OSError as exc:  # disk full: the scores are stored, the report is not
            _say(out, f"performance report not written: {exc} ({_free_space(store.path)})")
    return result


def _finish(plan, store, summary, *, out, t0) -> None:
    """Rebuild the tidy tables from what is stored and say what could not be written."""
    summary.tables = publish_results(plan, store, out=out)
    summary.seconds = time.perf_counter() - t0
    unwritable = [f for f in summary.failures if "cannot write" in str(f.get("error"))]
    if unwritable:
        _say(out, f"{len(unwritable)} unit(s) could not be written to the results store {store.path} "
                  f"({_free_space(store.path)}); the other units were still attempted")


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
