"""Planning and Dask execution of work units (encoder × view × design × metric).

* :func:`plan_job` – fingerprinted work units, split into pending / done / invalid;
* :func:`run_job` – the whole run (what ``cachescore run`` does) → :class:`RunSummary`;
* :func:`execute_plan` – submit pending metric units to a client;
* :func:`run_probe_units` – run pending probe-sweep units (replicates fanned out on the client);
* :func:`open_client` – LocalCluster on 127.0.0.1 or an existing scheduler;
* :func:`score_unit` – the one place where a unit calls the metric API;
* :func:`unit_status` – done / failed / stale / missing per unit;
* :func:`watch_job` – poll the cache and re-score when there is new work (``cachescore watch``).
"""

from .cluster import SingleThreadBLAS, open_client
from .execute import RunSummary, execute_plan, run_job, run_probe_units
from .plan import InvalidUnit, Plan, WorkUnit, code_version, plan_job
from .status import pending_reasons, unit_status
from .watch import WatchPoll, poll_job, watch_job
from .unit import run_probe_task, run_unit, score_unit

__all__ = [
    "WorkUnit",
    "InvalidUnit",
    "Plan",
    "plan_job",
    "code_version",
    "RunSummary",
    "run_job",
    "execute_plan",
    "run_probe_units",
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
