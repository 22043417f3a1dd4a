"""Planning and Dask execution of work units (encoder × view × design × metric).

Only orchestration lives here; the engines are in :mod:`cachescore.neighbors`, the metrics in
:mod:`cachescore.metrics`, the probe sweep in :mod:`cachescore.probe`.

* :func:`plan_job` – fingerprinted work units, split into pending / done / invalid;
* :func:`run_job` – the whole run (what ``cachescore run`` does) → :class:`RunSummary`;
* :func:`execute_plan` – start the pending units on a client, each by its :class:`UnitKind`, and
  gather how each ended (a :class:`UnitOutcome`);
* :func:`open_client` – LocalCluster on 127.0.0.1 or an existing scheduler;
* :func:`score_unit` – the one place where a unit calls the metric API;
* :func:`unit_status` – done / failed / stale / missing per unit;
* :func:`watch_job` – poll the cache and re-score when there is new work (``cachescore watch``).
"""

from importlib import import_module

#: Public name -> its module; imported on first use (PEP 562), so a command that only plans or
#: reads a store (``status``, ``validate``, ``export``) does not import distributed.
_EXPORTS = {
    "SingleThreadBLAS": ".cluster", "open_client": ".cluster", "execute_plan": ".execute", "UnitOutcome": ".outcome",
    "InvalidUnit": ".plan", "Plan": ".plan", "UnitKind": ".plan", "WorkUnit": ".plan", "code_version": ".plan",
    "plan_job": ".plan", "RunSummary": ".run", "run_job": ".run", "pending_reasons": ".status",
    "unit_status": ".status", "run_probe_task": ".unit", "run_unit": ".batch", "score_unit": ".unit",
    "WatchPoll": ".watch", "poll_job": ".watch", "watch_job": ".watch",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cachescore.pipeline' has no attribute {name!r}")


__all__ = [
    "UnitKind",
    "WorkUnit",
    "InvalidUnit",
    "Plan",
    "plan_job",
    "code_version",
    "RunSummary",
    "UnitOutcome",
    "run_job",
    "execute_plan",
    "open_client",
    "SingleThreadBLAS",
    "score_unit",
    "run_unit",
    "run_probe_task",
    "unit_status",
    "pending_reasons",
    "watch_job",
    "poll_job",
    "WatchPoll",
]


def __dir__():
    return sorted(set(globals()) | set(__all__))
