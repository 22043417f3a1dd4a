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
from ..monitoring import RunMonitor
from ..monitoring.progress import RunProgress
from ..neighbors.large_scope import remove_scratch
from ..store import ResultsStore
from .interrupts import DeferredInterrupts
from .logs import quiet_owned_cluster
from .outcome import DONE, UnitOutcome
from .plan import Plan, UnitKind
from .unit import drive_large_unit, run_probe_task, run_unit, unit_annotation, unit_scratch
from .watchdog import Watchdog

__all__ = ["execute_plan", "record_client_failure"]


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
    """The loop's state: which future is which unit, what ended, how often a fetch failed."""

    def __init__(self, client, store, run_id, watchdog: Watchdog, progress: RunProgress, monitor, ended: dict):
        self.client, self.store, self.run_id = client, store, run_id
        self.watchdog, self.progress, self.monitor, self.ended = watchdog, progress, monitor, ended
        self.finished: queue.Queue = queue.Queue()  # futures of every kind, as they complete
        self.futures: dict = {}
        self.units: dict = {}
        self.fetch_errors: dict = {}

    def add(self, fut, unit) -> None:
        self.futures[fut] = unit.fingerprint
        self.units[unit.fingerprint] = unit
        fut.add_done_callback(self.finished.put)

    def counts(self) -> tuple[int, int]:
        return len(self.ended), len(self.futures) - len(self.ended)

    def outstanding(self) -> list:
        return [f for f, fp in self.futures.items() if fp not in self.ended and not isinstance(f, LocalFuture)]

    def end(self, unit, outcome: UnitOutcome) -> None:
        self.ended[unit.fingerprint] = outcome
        if self.monitor is not None:
            self.monitor.finish_unit(unit.fingerprint, outcome.board())
        self.progress.unit_done(unit.label, "done" if outcome.status == DONE else "FAILED", outcome.seconds)

    def next(self) -> None:
        """Wait up to 0.5 s for one completion and settle it (or run the watchdog)."""
        try:
            fut = self.finished.get(timeout=0.5)
        except queue.Empty:
            self.watchdog.check(*self.counts())
            return
        unit = self.units[self.futures[fut]]
        outcome = self.fetch(fut, unit)
        if outcome is None:  # put back: it completes (again) later
            fut.add_done_callback(self.finished.put)
            return
        self.end(unit, outcome)

    def fetch(self, fut, unit) -> UnitOutcome | None:
        """The outcome of unit ``unit``'s completed future ``fut``, or None when the caller should
        wait for it again: its small result was lost with its worker (the scheduler recomputes it),
        the fetch timed out, or a fetch failed while the task had finished or the connection is in
        doubt (not the unit's failure unless it keeps happening: 5 tries). A task that erred after
        its retries is recorded as failed in the store here. Raises what the watchdog raises
        (:class:`RunAborted`) and interrupts."""
        if isinstance(fut, LocalFuture):
            return fut.result()  # drive_large_unit records its own failures and never raises
        if _result_lost(self.client, fut):
            return None  # lost with its worker (a cancelled or preempted worker job): recomputed
        status = fut.status
        try:
            return fut.result(timeout=5)  # a small outcome: seconds at most when it is held
        except TimeoutError:  # lost meanwhile (a worker died since the check): as above
            return None
        except (KeyboardInterrupt, SystemExit, RunInterrupted, RunAborted):
            raise
        except BaseException as exc:  # noqa: BLE001 - erred after its retries; CancelledError (scheduler lost)
            return self._fetch_failed(fut, unit, status, exc)
        finally:
            fut.release()

    def _fetch_failed(self, fut, unit, status: str, exc: BaseException) -> UnitOutcome | None:
        self.fetch_errors[fut] = self.fetch_errors.get(fut, 0) + 1
        if status == "finished" or not self.watchdog.connected():
            # fetching a finished result failed, or the task was cancelled with the connection
            self.watchdog.check(*self.counts(), force=not self.watchdog.connected())
            if self.fetch_errors[fut] < 5:
                time.sleep(0.2)
                return None
        err = f"{type(exc).__name__}: {exc}"
        record_client_failure(self.store, unit, self.run_id, err)
        return UnitOutcome.failed(unit, err)


def execute_plan(plan: Plan, client, *, store=None, retries: int = 2, out: TextIO | None = sys.stderr,
                 run_id: str | None = None, large_unit_drivers: int = 3, monitor: RunMonitor | None = None,
                 no_workers_timeout: float = 300.0, verbose: bool = False, ended: dict | None = None
                 ) -> tuple[int, list]:
    """Run the plan's pending units on ``client``; return ``(n_succeeded, failures)`` (one
    :meth:`~.outcome.UnitOutcome.failure` dict per failed unit).

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
    pending = sorted(plan.pending, key=lambda u: u.kind is not UnitKind.PROBE)  # probe units first (stable)
    drivers = ThreadPoolExecutor(max_workers=max(1, int(large_unit_drivers)), thread_name_prefix="cachescore-large")
    progress = RunProgress(len(pending), out, verbose=verbose)
    loop = _Completions(client, store, run_id, Watchdog(client, progress, no_workers_timeout=no_workers_timeout),
                        progress, monitor, ended)
    try:
        with DeferredInterrupts() as interrupts:  # signals raise at the loop's top, not inside distributed
            for u in sorted(pending, key=lambda u: u.kind is UnitKind.LARGE):  # tasks first, then drivers
                interrupts.check()
                loop.add(_start(u, client, drivers, bundles=plan.job.bundles, run_id=run_id, retries=retries), u)
            while len(ended) < len(loop.futures):
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
