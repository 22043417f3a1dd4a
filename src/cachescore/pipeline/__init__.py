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

from .cluster import SingleThreadBLAS, open_client
from .execute import execute_plan
from .outcome import UnitOutcome
from .plan import InvalidUnit, Plan, UnitKind, WorkUnit, code_version, plan_job
from .run import RunSummary, run_job
from .status import pending_reasons, unit_status
from .unit import run_probe_task, run_unit, score_unit
from .watch import WatchPoll, poll_job, watch_job

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
