"""The run board: what the scheduler knows about the current run's units (plain data, thread-safe).

One :class:`RunBoard` per run lives in the scheduler plugin (:mod:`.plugin`); the client fills it
(:meth:`RunBoard.start` with the plan's units, :meth:`RunBoard.finish_unit` as units end,
:meth:`RunBoard.end` with the run's final state) and the plugin marks units ``running`` when one
of their tasks starts (task annotations name the unit). The Prometheus collector (:mod:`.metrics`)
and the status page (:mod:`.page`) read :meth:`RunBoard.snapshot`.

Unit states: ``pending`` (planned, not started), ``running``, ``done``, ``failed``, ``skipped``
(up to date in the store, not run), ``not_run`` (the run ended before it started: aborted or
interrupted).
"""

from __future__ import annotations

import threading
import time

__all__ = ["RunBoard", "UNIT_STATES", "unit_entry"]

#: Every state a unit can have on the board (the ``state`` label of ``cachescore_units``).
UNIT_STATES = ("pending", "running", "done", "failed", "skipped", "not_run")


def unit_entry(unit, state: str) -> dict:
    """The board's row of a planned unit (a ``WorkUnit`` or ``InvalidUnit``-like object with
    ``fingerprint``, ``label`` and the ``encoder``/``view``/``design``/``metric`` identity)."""
    ident = unit.unit if hasattr(unit, "unit") and isinstance(unit.unit, dict) else unit.describe()
    kind = getattr(getattr(unit, "kind", None), "value", "invalid")
    return {"fingerprint": unit.fingerprint, "label": unit.label, "encoder": str(ident.get("encoder", "")),
            "view": str(ident.get("view", "")), "design": str(ident.get("design", "")),
            "metric": str(ident.get("metric", "")), "kind": kind, "state": state, "started": None,
            "seconds": None, "value": None, "recall": None, "rows": None, "bytes_read": None,
            "error": getattr(unit, "error", None)}


class RunBoard:
    """The units of one run and the run's own facts (id, job, start time, state)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.run: dict = {}
        self.units: dict[str, dict] = {}
        self.rows_scored = 0
        self.bytes_read = 0
        self.last_progress = None  # epoch seconds of the last unit that ended
        self.last_recall: dict | None = None

    def start(self, run: dict, units: list[dict]) -> None:
        """A new run: ``run`` has ``run_id``, ``job``, ``store``, ``started`` (epoch seconds);
        ``units`` are :func:`unit_entry` rows. Replaces the previous run's board."""
        with self._lock:
            self.run = dict(run, state="running", reason=None, ended=None)
            self.units = {u["fingerprint"]: dict(u) for u in units}
            self.rows_scored = self.bytes_read = 0
            self.last_progress = float(run.get("started") or time.time())
            self.last_recall = None

    def mark_running(self, fingerprint: str, at: float | None = None) -> None:
        """A task of the unit started (first one wins; ended units stay ended)."""
        with self._lock:
            u = self.units.get(fingerprint)
            if u is not None and u["state"] == "pending":
                u.update(state="running", started=time.time() if at is None else at)

    def finish_unit(self, fingerprint: str, status: dict) -> None:
        """The unit ended: ``status`` is the unit task's status dict (``status`` done | failed,
        ``seconds``, ``value``, ``recall``, ``rows``, ``bytes_read``, ``error``)."""
        with self._lock:
            u = self.units.get(fingerprint)
            if u is None:
                return
            state = "done" if status.get("status") == "done" else "failed"
            u.update(state=state, **{k: status.get(k) for k in ("seconds", "value", "recall", "rows", "bytes_read",
                                                                 "error")})
            if state == "done":
                self.rows_scored += int(status.get("rows") or 0)
                self.bytes_read += int(status.get("bytes_read") or 0)
                rec = status.get("recall")
                if rec is not None and rec == rec:
                    self.last_recall = {"value": float(rec), "encoder": u["encoder"], "view": u["view"],
                                        "metric": u["metric"]}
            self.last_progress = time.time()

    def finish_units(self, items: list) -> None:
        """Several units ended: ``[(fingerprint, status), ...]`` as for :meth:`finish_unit`."""
        for fp, status in items:
            self.finish_unit(fp, status)

    def end(self, state: str, reason: str | None = None) -> None:
        """The run ended (``finished`` | ``aborted`` | ``interrupted``); units never started are
        ``not_run`` unless the run finished."""
        with self._lock:
            self.run.update(state=state, reason=reason, ended=time.time())
            if state != "finished":
                for u in self.units.values():
                    if u["state"] in ("pending", "running"):
                        u["state"] = "not_run"

    def snapshot(self) -> dict:
        """A JSON-able copy: ``{"run", "units" (sorted by encoder, view, metric, label), "counts",
        "rows_scored", "bytes_read", "last_progress", "last_recall"}``."""
        with self._lock:
            units = sorted((dict(u) for u in self.units.values()),
                           key=lambda u: (u["encoder"], u["view"], u["metric"], u["label"]))
            counts = {s: 0 for s in UNIT_STATES}
            for u in units:
                counts[u["state"]] = counts.get(u["state"], 0) + 1
            return {"run": dict(self.run), "units": units, "counts": counts, "rows_scored": self.rows_scored,
                    "bytes_read": self.bytes_read, "last_progress": self.last_progress,
                    "last_recall": dict(self.last_recall) if self.last_recall else None}
