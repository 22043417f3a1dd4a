"""Quieting distributed's logs while a run ends the way it says itself.

A run that loses its scheduler, or tears its own cluster down early, would otherwise print
distributed's reconnect and cancellation tracebacks after its own one-line ending. Levels raised
here come back with :func:`restore_logs`; nothing but the named loggers (and one asyncio record of
distributed's internal ``AllExit`` sentinel) is touched.
"""

from __future__ import annotations

import logging

__all__ = ["quiet_logs", "quiet_owned_cluster", "restore_logs", "ignore_abandoned_gathers",
           "RECONNECT_LOGGERS", "DISTRIBUTED_LOGGERS"]

#: Loggers whose reconnect tracebacks follow a lost scheduler; silenced once the run says so itself.
RECONNECT_LOGGERS = ("distributed.client", "distributed.comm", "distributed.core")
#: distributed's loggers whose level its config sets explicitly (the rest inherit ``distributed``).
DISTRIBUTED_LOGGERS = ("distributed", "distributed.client", "distributed.worker", "distributed.nanny",
                       "distributed.scheduler", "distributed.core", "distributed.comm")
_QUIETED: dict = {}


def quiet_logs(names=RECONNECT_LOGGERS) -> None:
    """Raise ``names`` to CRITICAL in this process until :func:`restore_logs`."""
    for name in names:
        log = logging.getLogger(name)
        _QUIETED.setdefault(name, log.level)
        log.setLevel(logging.CRITICAL)


def restore_logs() -> None:
    """Put back every level :func:`quiet_logs` raised in this process."""
    while _QUIETED:
        name, level = _QUIETED.popitem()
        logging.getLogger(name).setLevel(level)


def quiet_owned_cluster(client) -> None:
    """A run that ends early (Ctrl-C, SIGTERM, an abort) and started its own cluster (a
    LocalCluster, batch jobs: ``client.cluster`` is set) tears it down mid-work; its workers then
    log each cancelled task and broken transfer with a traceback (``Async instruction …
    CancelledError``, ``failed during get data``), noise after the run's own one-line ending.
    Quiet distributed's logs on those workers (best effort, at most 5 s) and in this process
    (back with :func:`restore_logs` once the client is closed). An external scheduler's workers
    (``--scheduler``) are not the run's to quiet and are left alone."""
    if getattr(client, "cluster", None) is None:
        return
    quiet_logs(DISTRIBUTED_LOGGERS)
    try:
        # on the workers too (never restored there: they exit with the cluster); Client._run, as
        # Client.run has no timeout and a wedged worker must not hold the ending up
        client.sync(client._run, quiet_logs, DISTRIBUTED_LOGGERS, on_error="ignore", callback_timeout=5)
    except BaseException:  # noqa: BLE001 - best effort: the cluster is closed next anyway
        pass


class _AbandonedGatherFilter(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for distributed's internal ``AllExit``
    sentinel: distributed leaves it in a gather it abandons (a result re-fetched after its worker
    died, then recomputed); asyncio would print it with a traceback at exit. Nothing else is
    touched."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ == "AllExit"
                    and type(exc).__module__.startswith("distributed"))


def ignore_abandoned_gathers() -> None:
    """Install :class:`_AbandonedGatherFilter` on asyncio's logger (once)."""
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedGatherFilter) for f in log.filters):
        log.addFilter(_AbandonedGatherFilter())
