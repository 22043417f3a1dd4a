"""How one work unit ended: the one value every unit task, driver and client check returns.

A :class:`UnitOutcome` travels from a worker to the client (it is a small frozen dataclass: no
arrays, picklable), feeds the progress line, the run board (``monitoring``) and the run's summary,
and is the only shape a unit's ending has: tasks (:func:`~.unit.run_unit`,
:func:`~.unit.run_probe_task`), the out-of-core driver (:func:`~.unit.drive_large_unit`), the
client's own checks (a task that erred after its retries, a unit settled from the store) and the
library entry point :func:`~.probe_unit.run_probe_and_store` all build one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["UnitOutcome", "DONE", "FAILED", "SKIPPED"]

DONE, FAILED, SKIPPED = "done", "failed", "skipped"


@dataclass(frozen=True)
class UnitOutcome:
    """The ending of one unit.

    ``status`` is ``"done"`` (its results are stored), ``"failed"`` (``error`` says why, as
    ``"<ExceptionType>: <message>"``; the failure is recorded in the store unless the store could
    not take it) or ``"skipped"`` (already stored; :func:`~.probe_unit.run_probe_and_store` only).
    ``seconds`` is wall time on the process that ran it; ``value`` / ``recall`` / ``rows`` /
    ``bytes_read`` are what the run board shows of a scored metric unit (None when not known);
    ``records`` the record fingerprints of a probe unit, ``bundle`` its evaluation bundle."""

    fingerprint: str
    label: str
    status: str
    seconds: float | None = None
    error: str | None = None
    traceback: str | None = None
    worker_pid: int | None = None
    value: float | None = None
    recall: float | None = None
    rows: int | None = None
    bytes_read: int | None = None
    records: tuple = field(default_factory=tuple)
    bundle: str | None = None

    def failure(self) -> dict:
        """``{"label", "fingerprint", "error"}``: the unit's line in a run's failures
        (:attr:`~.run.RunSummary.failures`, the provenance's ``failures``)."""
        return {"label": self.label, "fingerprint": self.fingerprint, "error": self.error}

    def board(self) -> dict:
        """What the run board (:class:`cachescore.monitoring.RunMonitor`) shows of it: a plain dict
        (it travels to the scheduler) of ``status``, ``seconds``, ``value``, ``recall``, ``rows``,
        ``bytes_read`` and ``error``."""
        return {k: getattr(self, k) for k in ("status", "seconds", "value", "recall", "rows", "bytes_read", "error")}

    @classmethod
    def failed(cls, unit, error: str, **fields) -> "UnitOutcome":
        """A failed outcome of ``unit`` (anything with ``fingerprint`` and ``label``)."""
        return cls(unit.fingerprint, unit.label, FAILED, error=error, **fields)

    @classmethod
    def done(cls, unit, **fields) -> "UnitOutcome":
        """A done outcome of ``unit``."""
        return cls(unit.fingerprint, unit.label, DONE, **fields)
