"""A run's provenance: who ran what, on which inputs and code, and how it ended.

:class:`Provenance` writes ``<store>/runs/<run id>/provenance.json`` once with state
``running`` (a run killed by SIGKILL leaves that; the next run or ``status`` marks it
``interrupted``) and once more with its final state (``finished`` | ``aborted`` |
``interrupted``). A full disk keeps at least the final state (a compact record written in place),
never a run that seems to run forever.
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from datetime import datetime, timezone
from typing import TextIO

from .._version import package_versions
from ..store.lock import this_process
from .messages import free_space, say
from .plan import code_version

__all__ = ["Provenance", "new_run_id", "hardware", "PROVENANCE_DISTRIBUTIONS"]

#: Distributions whose versions a run's provenance records.
PROVENANCE_DISTRIBUTIONS = ("cachescore", "numpy", "pandas", "scipy", "scikit-learn", "dask", "distributed",
                            "pyarrow", "pynndescent", "numba", "threadpoolctl", "croma")
#: The fields a compact (disk full) provenance keeps.
_COMPACT = ("run_id", "state", "reason", "process", "started_at", "finished_at", "store", "units", "cluster",
            "seconds")


def new_run_id() -> str:
    """``YYYYmmddTHHMMSSZ-<8 hex>``: sortable by start time, unique across concurrent runs."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def hardware(client=None) -> dict:
    """This host's platform, CPUs and memory; with ``client``, the scheduler and its workers."""
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


class Provenance:
    """The provenance of one run of ``plan`` into ``store``, described by ``summary`` (a
    :class:`~.run.RunSummary`, read at each write). ``cluster`` names where it ran (a scheduler
    address or a cluster kind); ``hardware`` may be replaced once a client is connected."""

    def __init__(self, store, plan, summary, *, started: str, t0: float, cluster: str, out: TextIO | None):
        self.store, self.plan, self.summary = store, plan, summary
        self.started, self.t0, self.cluster, self.out = started, t0, cluster, out
        self.process = this_process()
        self.hardware = None
        #: ``(state, reason)`` once the execution ended early (set where the client saw it end).
        self.ending: tuple[str, str] | None = None

    def record(self, state: str, reason: str | None, *, failures: list, ended: dict) -> dict:
        """The provenance document for ``state``; sets ``summary.not_run`` (pending units that
        never ended, empty while running)."""
        plan, summary, job = self.plan, self.summary, self.plan.job
        running = state == "running"
        not_run = [] if running else sorted(u.label for u in plan.pending if u.fingerprint not in ended)
        summary.not_run = not_run
        return {
            "run_id": summary.run_id, "state": state, "reason": reason, "process": self.process,
            "started_at": self.started, "finished_at": None if running else _now(),
            "job_path": str(job.path) if job.path else None, "job": job.document,
            "cache": str(job.cache), "store": str(job.store),
            "code_version": code_version(), "versions": package_versions(PROVENANCE_DISTRIBUTIONS, python=True),
            "hardware": self.hardware or hardware(), "input_fingerprints": plan.inputs,
            "units": {"planned": summary.planned, "executed": summary.executed, "skipped": summary.skipped,
                      "succeeded": summary.succeeded, "failed": len(failures), "not_run": len(not_run)},
            "executed_fingerprints": sorted(u.fingerprint for u in plan.pending),
            "not_run": not_run, "failures": failures,
            "performance_report": summary.report_path, "tables": summary.tables, "dashboard": summary.dashboard,
            "status_page": summary.status_page, "cluster": self.cluster, "seconds": time.perf_counter() - self.t0,
        }

    def write(self, state: str, reason: str | None = None, *, failures: list, ended: dict) -> None:
        """Write the provenance for ``state``; on a full disk, the compact final state in place
        (what could not be written is said on ``out``; never raises ``OSError``)."""
        info = self.record(state, reason, failures=failures, ended=ended)
        run_id = self.summary.run_id
        try:
            self.store.write_provenance(run_id, info)
            return
        except OSError as exc:
            compact = {k: info[k] for k in _COMPACT}
            compact["note"] = f"compact provenance: the full one could not be written ({exc})"
            first = exc
        try:
            self.store.overwrite_provenance_in_place(run_id, compact)
            say(self.out, f"provenance of run {run_id}: only its final state could be written ({first}; "
                          f"{free_space(self.store.path)})")
        except OSError as again:
            say(self.out, f"provenance of run {run_id} not written: {again} ({free_space(self.store.path)})")
