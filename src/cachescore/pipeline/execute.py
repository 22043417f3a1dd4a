"""The completion loop: start the plan's pending units on a client, gather how each ended.

:func:`execute_plan` starts every pending unit by its kind (metric and probe-sweep tasks,
out-of-core drivers on threads of this process; retries for transient failures), draws the
progress line, tells the run board and, while nothing ends, runs the :class:`~.watchdog.Watchdog`.
Every unit's ending is a :class:`~.outcome.UnitOutcome`. The run around it (store lock,
provenance, cluster, tables) is :func:`~.run.run_job`.

Tasks write their own results (atomic store writes on the worker): a client killed midway leaves a
valid store, and the next run executes only the units without a result.
"""

from __future__ import annotations

import queue
import sys
import time
from concurrent.futures import Future as LocalFuture
from concurrent.futures import ThreadPoolExecutor
from typing import TextIO

import dask

from .._taskkeys import ANNOTATION, unit_prefix
from ..errors import RunAborted, RunInterrupted
from ..jobs.sections import as_dict
from ..monitoring import RunMonitor
from ..monitoring.progress import RunProgress
from ..neighbors.large_scope import remove_scratch
from ..store import ResultsStore
from .interrupts import DeferredInterrupts
from .logs import quiet_owned_cluster
from .outcome import DONE, UnitOutcome
from .plan import Plan, UnitKind
from .batch import BatchErrors, ScoreBatch, batch_units, run_batch, stored_by_run
from .large_unit import drive_large_unit, search_companions
from .unit import run_probe_task, unit_annotation, unit_scratch
from .watchdog import Watchdog

__all__ = ["execute_plan", "record_client_failure"]


def _task_key(work, run_id: str | None) -> str:
    """``<phase>.<encoder>.<view>.<metric>-<fingerprint prefix>-<run id>`` (phase ``score`` for a
    :class:`~.batch.ScoreBatch`, whose metric is ``ri+mari+croma``, or ``probe``;
    :mod:`cachescore._taskkeys`). The run id keeps runs apart: a key still held by another client
    (e.g. an erred task of an earlier run) would otherwise be reused, not recomputed."""
    phase = "score" if isinstance(work, ScoreBatch) else "probe"
    return f"{unit_prefix(phase, work.encoder, work.view, work.metric)}-{work.fingerprint[:16]}-{run_id or 'adhoc'}"


def _work_items(pending) -> list:
    """What is started: probe units first (higher priority), then the metric units in batches
    (:func:`~.batch.batch_units`: one task per shared input), then the out-of-core units (drivers)."""
    by_kind = {kind: [u for u in pending if u.kind is kind] for kind in UnitKind}
    return [*by_kind[UnitKind.PROBE], *batch_units(by_kind[UnitKind.SCORE]), *by_kind[UnitKind.LARGE]]


def _units_of(work) -> tuple:
    return work.units if isinstance(work, ScoreBatch) else (work,)


def _start(work, client, drivers, *, bundles, run_id, retries, tables=None, large=()):
    """Start one item of work by its kind (the one dispatch on :class:`~.plan.UnitKind`); returns
    its future (a ``distributed.Future``, or a ``concurrent.futures.Future`` for a driven unit).
    Its tasks carry the annotation of its units (:func:`~.unit.unit_annotation`; a batch's lists
    every unit's fingerprint under ``units``). ``tables``: the job's table settings, for a batch
    to keep its units' score entries (:func:`~.batch.run_batch`); ``large``: the run's
    out-of-core units (a driven unit's engine searches its companions' tables with its own,
    :func:`~.large_unit.search_companions`)."""
    if isinstance(work, ScoreBatch):
        ann = dict(unit_annotation(work.first, run_id), metric=work.metric, units=list(work.fingerprints))
        with dask.annotate(**{ANNOTATION: ann}):
            return client.submit(run_batch, work, run_id, tables, key=_task_key(work, run_id), retries=retries,
                                 pure=False)
    if work.kind is UnitKind.LARGE:
        return drivers.submit(drive_large_unit, work, client, run_id, retries, tables,
                              search_companions(work, large))
    with dask.annotate(**{ANNOTATION: unit_annotation(work, run_id)}):
        return client.submit(run_probe_task, work, bundles, run_id, key=_task_key(work, run_id), retries=retries,
                             pure=False, priority=10)


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


def record_client_failure(store, unit, run_id, err: str) -> None:
    """Record a failure seen by the client (a task that erred, a unit invalid at planning)."""
    ident = unit.unit if hasattr(unit, "unit") else unit.describe()  # an InvalidUnit has only its identity
    try:
        store.record_failure(unit.fingerprint, unit=dict(ident, run_id=run_id), error=err)
    except OSError:  # a full or read-only store: the run's summary reports the failure anyway
        pass


class _Completions:
    """The loop's state: which future runs which units, what ended, how often a fetch failed."""

    def __init__(self, client, store, run_id, watchdog: Watchdog, progress: RunProgress, monitor, ended: dict):
        self.client, self.store, self.run_id = client, store, run_id
        self.watchdog, self.progress, self.monitor, self.ended = watchdog, progress, monitor, ended
        self.finished: queue.Queue = queue.Queue()  # futures of every kind, as they complete
        self.futures: dict = {}  # future -> the units it runs (a batch's, or one)
        self.units: dict = {}
        self.fetch_errors: dict = {}

    def add(self, fut, units: tuple) -> None:
        self.futures[fut] = units
        for u in units:
            self.units[u.fingerprint] = u
        fut.add_done_callback(self.finished.put)

    def counts(self) -> tuple[int, int]:
        """``(units ended, units outstanding)``."""
        return len(self.ended), len(self.units) - len(self.ended)

    def outstanding(self) -> list:
        return [f for f, units in self.futures.items()
                if not isinstance(f, LocalFuture) and any(u.fingerprint not in self.ended for u in units)]

    def end(self, outcomes) -> None:
        """Settle ``outcomes`` (one future's units): the loop's record, one run-board call, the progress."""
        for o in outcomes:
            self.ended[o.fingerprint] = o
        if self.monitor is not None:
            self.monitor.finish_units([(o.fingerprint, o.board()) for o in outcomes])
        for o in outcomes:
            self.progress.unit_done(o.label, "done" if o.status == DONE else "FAILED", o.seconds)

    def next(self) -> None:
        """Wait up to 0.5 s for one completion and settle it (or run the watchdog)."""
        try:
            fut = self.finished.get(timeout=0.5)
        except queue.Empty:
            self.watchdog.check(*self.counts())
            return
        outcomes = self.fetch(fut, self.futures[fut])
        if outcomes is None:  # put back: it completes (again) later
            fut.add_done_callback(self.finished.put)
            return
        self.end(outcomes)

    def fetch(self, fut, units: tuple) -> tuple | None:
        """The outcomes of the units of completed future ``fut``, or None when the caller should
        wait for it again: its small result was lost with its worker (the scheduler recomputes it),
        the fetch timed out, or a fetch failed while the task had finished or the connection is in
        doubt (not the units' failure unless it keeps happening: 5 tries). A task that erred after
        its retries is settled here (:meth:`_fetch_failed`). Raises what the watchdog raises
        (:class:`RunAborted`) and interrupts."""
        if isinstance(fut, LocalFuture):
            return (fut.result(),)  # drive_large_unit records its own failures and never raises
        if _result_lost(self.client, fut):
            return None  # lost with its worker (a cancelled or preempted worker job): recomputed
        status = fut.status
        try:
            result = fut.result(timeout=5)  # small outcomes: seconds at most when they are held
        except TimeoutError:  # lost meanwhile (a worker died since the check): as above
            return None
        except (KeyboardInterrupt, SystemExit, RunInterrupted, RunAborted):
            raise
        except BaseException as exc:  # noqa: BLE001 - erred after its retries; CancelledError (scheduler lost)
            return self._fetch_failed(fut, units, status, exc)
        finally:
            fut.release()
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

    def _fetch_failed(self, fut, units: tuple, status: str, exc: BaseException) -> tuple | None:
        """Settle the units of a task that erred: each unit this run stored before the error is
        done (a batch stores its units one by one); the others are recorded as failed, each with
        its own error when the task says (:class:`~.batch.BatchErrors`)."""
        self.fetch_errors[fut] = self.fetch_errors.get(fut, 0) + 1
        if status == "finished" or not self.watchdog.connected():
            # fetching a finished result failed, or the task was cancelled with the connection
            self.watchdog.check(*self.counts(), force=not self.watchdog.connected())
            if self.fetch_errors[fut] < 5:
                time.sleep(0.2)
                return None
        err = f"{type(exc).__name__}: {exc}"
        own = exc.errors if isinstance(exc, BatchErrors) else {}
        outcomes = []
        for unit in units:
            stored = None if unit.fingerprint in own else stored_by_run(self.store, unit, self.run_id)
            if stored is not None:
                outcomes.append(stored)
                continue
            record_client_failure(self.store, unit, self.run_id, own.get(unit.fingerprint, err))
            outcomes.append(UnitOutcome.failed(unit, own.get(unit.fingerprint, err)))
        return tuple(outcomes)


def execute_plan(plan: Plan, client, *, store=None, retries: int = 2, out: TextIO | None = sys.stderr,
                 run_id: str | None = None, large_unit_drivers: int = 3, monitor: RunMonitor | None = None,
                 no_workers_timeout: float = 300.0, verbose: bool = False, ended: dict | None = None
                 ) -> tuple[int, list]:
    """Run the plan's pending units on ``client``; return ``(n_succeeded, failures)`` (one
    :meth:`~.outcome.UnitOutcome.failure` dict per failed unit).

    Each unit starts by its :class:`~.plan.UnitKind` (:func:`_start`): ``SCORE`` units are one
    task per shared input (:func:`~.batch.run_batch` of a :class:`~.batch.ScoreBatch`: the units
    of one encoder and view; key ``score.<encoder>.<view>.<ri+mari+croma>-<fingerprint
    prefix>-<run id>``); ``PROBE`` units are :func:`~.unit.run_probe_task` tasks (``probe.…``),
    submitted first with a higher priority (each secedes from its worker's thread pool and fans its
    replicates out as further tasks, so metric units run while sweeps are in flight); ``LARGE``
    units are not tasks: up to ``large_unit_drivers`` of them at a time are driven from this
    process on threads (:func:`~.large_unit.drive_large_unit`), and only their bounded search tasks go to
    the workers. Tasks get ``retries`` retries for exceptions that are not data errors.
    Completions of every kind are gathered in one loop that draws the progress
    (:class:`~cachescore.monitoring.progress.RunProgress`; ``verbose``: a line per unit), tells
    ``monitor`` (the scheduler's run board) and, while nothing ends, runs the watchdog. A unit
    whose task finally errors (retries exhausted, worker killed too often) is recorded as failed
    in the store by the client. ``ended`` (optional) receives ``fingerprint -> UnitOutcome`` of
    every unit that ended, so a caller knows what ran when this function raises.

    Raises :class:`~cachescore.errors.RunAborted` when the scheduler is lost or has no worker for
    ``no_workers_timeout`` seconds, and :class:`~cachescore.errors.RunInterrupted` for Ctrl-C or
    SIGTERM, taken at the loop's next turn (:class:`~.interrupts.DeferredInterrupts`, when called
    from the main thread). Either way the outstanding tasks are cancelled and the drivers stopped;
    what finished is in the store.
    """
    store = ResultsStore(plan.job.store) if store is None else store
    ended = {} if ended is None else ended
    pending = list(plan.pending)
    large = tuple(u for u in pending if u.kind is UnitKind.LARGE)
    tables = {"bootstrap": as_dict(plan.job.metrics.bootstrap), "min_support": float(plan.job.report.min_support)}
    drivers = ThreadPoolExecutor(max_workers=max(1, int(large_unit_drivers)), thread_name_prefix="cachescore-large")
    progress = RunProgress(len(pending), out, verbose=verbose)
    loop = _Completions(client, store, run_id, Watchdog(client, progress, no_workers_timeout=no_workers_timeout),
                        progress, monitor, ended)
    try:
        with DeferredInterrupts() as interrupts:  # signals raise at the loop's top, not inside distributed
            for work in _work_items(pending):  # tasks first, then drivers
                interrupts.check()
                loop.add(_start(work, client, drivers, bundles=plan.job.bundles, run_id=run_id, retries=retries,
                                tables=tables, large=large), _units_of(work))
            while len(ended) < len(loop.units):
                interrupts.check()
                loop.next()
    except BaseException:  # interrupted or aborted: cancel what is left; drivers stop at their next cluster call
        _cancel(client, loop)
        drivers.shutdown(wait=False, cancel_futures=True)
        progress.close()
        raise
    drivers.shutdown(wait=True)
    progress.close()
    remove_scratch([unit_scratch(u) for u in pending if u.kind is UnitKind.LARGE])  # every unit has ended
    outcomes = [ended[u.fingerprint] for u in pending]
    return sum(o.status == DONE for o in outcomes), [o.failure() for o in outcomes if o.status != DONE]


def _cancel(client, loop: _Completions) -> None:
    """Cancel the loop's outstanding tasks (best effort), quieting an owned cluster's workers first."""
    if not loop.watchdog.connected():
        return
    quiet_owned_cluster(client)  # before cancelling: the cancels are what its workers log
    outstanding = loop.outstanding()
    if outstanding:
        try:
            client.cancel(outstanding, reason="cachescore run ended early")
        except Exception:  # noqa: BLE001 - best effort: the cluster is closed next anyway
            pass
