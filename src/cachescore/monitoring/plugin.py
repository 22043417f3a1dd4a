"""The scheduler plugin that carries a run's board to ``/metrics`` and ``/cachescore``.

:class:`CachescorePlugin` is registered by ``cachescore run`` on whatever scheduler it uses (a
LocalCluster's, a SLURM / Kubernetes deployment's, one started by hand): it holds the
:class:`~.board.RunBoard`, adds the status page's routes (:mod:`.page`) and the Prometheus
collector (:mod:`.metrics`) to the scheduler, and marks a unit ``running`` when a task annotated
with it (``dask.annotate(cachescore={"unit": fingerprint, ...})``; a batch task lists every unit it
runs under ``units``) starts processing.

:class:`RunMonitor` is the client's side: it registers the plugin (idempotent: a long-lived
scheduler keeps one) and forwards the run's events to the board with ``run_on_scheduler``. Every
call is best effort: monitoring never stops a run (a lost scheduler is the watchdog's business,
:mod:`cachescore.pipeline.execute`).
"""

from __future__ import annotations

import logging

from distributed.diagnostics.plugin import SchedulerPlugin

from .._taskkeys import ANNOTATION
from .board import RunBoard
from .metrics import register_collector
from .page import PAGE_PATH, add_routes, current_board

__all__ = ["CachescorePlugin", "RunMonitor", "ANNOTATION", "page_url"]

logger = logging.getLogger(__name__)


class CachescorePlugin(SchedulerPlugin):
    """Scheduler plugin named ``cachescore`` (see the module docstring)."""

    name = "cachescore"
    #: A scheduler that already has one keeps it (and its board) when the next run registers again.
    idempotent = True

    def __init__(self):
        self.board = None  # created on the scheduler (a board holds a lock: it does not travel)
        self.scheduler = None

    async def start(self, scheduler) -> None:
        self.board = RunBoard()
        self.scheduler = scheduler
        add_routes(scheduler)
        register_collector(lambda: current_board(scheduler))

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish != "processing" or self.board is None:
            return
        ts = self.scheduler.tasks.get(key)
        ann = (ts.annotations or {}).get(ANNOTATION) if ts is not None else None
        if isinstance(ann, dict) and ann.get("unit"):
            for fp in ann.get("units") or (ann["unit"],):  # a batch task runs several units
                self.board.mark_running(fp)


def _call_board(method: str, *args, dask_scheduler=None):
    """Run ``board.<method>(*args)`` on the scheduler (through ``client.run_on_scheduler``)."""
    board = current_board(dask_scheduler)
    if board is None:
        return None
    return getattr(board, method)(*args)


def page_url(dashboard_link: str | None) -> str | None:
    """``<dashboard>/cachescore`` from the client's dashboard link (``http://host:port/status``)."""
    if not dashboard_link:
        return None
    base = dashboard_link[: -len("/status")] if dashboard_link.endswith("/status") else dashboard_link.rstrip("/")
    return base + PAGE_PATH


class RunMonitor:
    """The client's handle on the scheduler's board (best effort, see the module docstring)."""

    def __init__(self, client):
        self.client = client
        self.ok = True
        try:
            client.register_plugin(CachescorePlugin())
        except Exception as exc:  # noqa: BLE001 - e.g. cachescore not importable on a remote scheduler
            self._disable(exc)

    def _disable(self, exc: BaseException) -> None:
        if self.ok:
            logger.warning("cachescore monitoring is off for this run (%s: %s)", type(exc).__name__, exc)
        self.ok = False

    def _call(self, method: str, *args) -> None:
        if not self.ok or self.client.status != "running":  # never wait on a scheduler that is gone
            return
        try:
            self.client.run_on_scheduler(_call_board, method, *args)
        except Exception as exc:  # noqa: BLE001 - monitoring never stops the run
            self._disable(exc)

    def start(self, run: dict, units: list[dict]) -> None:
        self._call("start", run, units)

    def finish_unit(self, fingerprint: str, status: dict) -> None:
        self.finish_units([(fingerprint, status)])

    def finish_units(self, items: list) -> None:
        """Units ended: ``[(fingerprint, status dict), ...]``, told to the board in one call."""
        self._call("finish_units", [(fp, {k: v for k, v in st.items() if k != "traceback"}) for fp, st in items])

    def end(self, state: str, reason: str | None = None) -> None:
        self._call("end", state, reason)
