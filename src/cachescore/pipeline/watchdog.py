"""Whether a run can still make progress while no unit ends: a scheduler, and workers on it."""

from __future__ import annotations

import time

from ..errors import RunAborted
from .logs import quiet_logs, restore_logs

__all__ = ["Watchdog"]


class Watchdog:
    """Checks, while no unit ends, that the run can still make progress (called about once a
    second by :func:`~.execute.execute_plan`): the scheduler is connected (else, after ``grace_s``
    of reconnect attempts, :class:`~cachescore.errors.RunAborted` ``scheduler-lost``) and has
    workers (else, after ``no_workers_timeout`` seconds, ``no-workers``; the progress line says
    "waiting for workers" meanwhile)."""

    def __init__(self, client, progress, *, no_workers_timeout: float, grace_s: float = 10.0):
        self.client, self.progress = client, progress
        self.no_workers_timeout, self.grace_s = float(no_workers_timeout), float(grace_s)
        self.address = getattr(client.scheduler, "address", None) or "?"
        self.disconnected_since = self.no_workers_since = None
        self.last_check = 0.0

    @staticmethod
    def _counts(done: int, pending: int) -> str:
        return f"{done} unit(s) done, {pending} not run"

    def connected(self) -> bool:
        return self.client.status == "running"

    def check(self, done: int, pending: int, *, force: bool = False) -> None:
        """Raise :class:`~cachescore.errors.RunAborted` when the run cannot progress any more;
        ``done`` / ``pending`` are the units ended and left (for the message). At most once a
        second unless ``force`` (which also ends the reconnect grace at once)."""
        now = time.monotonic()
        if not force and now - self.last_check < 1.0:
            return
        self.last_check = now
        if self._scheduler_lost(now, force, done, pending):
            return
        try:
            n_workers = len(self.client.nthreads())
        except Exception:  # noqa: BLE001 - the connection dropped meanwhile: the next check says so
            return
        self._check_workers(now, n_workers, done, pending)

    def _scheduler_lost(self, now: float, force: bool, done: int, pending: int) -> bool:
        """True while reconnecting (within the grace); raises past it; False when connected."""
        if self.connected():
            if self.disconnected_since is not None:
                restore_logs()
            self.disconnected_since = None
            return False
        self.disconnected_since = self.disconnected_since or now
        quiet_logs()  # the run says what happened itself (or reconnects: logs back above)
        if force or now - self.disconnected_since >= self.grace_s:
            raise RunAborted("scheduler-lost", f"lost the Dask scheduler at {self.address} "
                                               f"(client {self.client.status}): {self._counts(done, pending)}")
        return True

    def _check_workers(self, now: float, n_workers: int, done: int, pending: int) -> None:
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
