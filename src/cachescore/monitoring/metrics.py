"""Prometheus collectors of the run board, served on the scheduler's own ``/metrics`` endpoint.

Dask serves ``/metrics`` with ``prometheus_client``'s global registry; :func:`register_collector`
adds :class:`BoardCollector` to it once per scheduler process (the scheduler plugin calls it), so
a deployed scheduler (where ``cachescore run`` is only a client) exports the same series.
Metric names (documented in the README, used by ``deploy/monitoring/``):

``cachescore_units{state,encoder}``
    Units of the current run by state, per encoder (every state of :data:`~.board.UNIT_STATES`
    for every encoder of the plan, zeros included): at most encoders × states series, whatever the
    number of views and metrics (per-unit detail is on the status page and ``units.json``).
``cachescore_unit_duration_seconds{metric}``
    Histogram of the durations of the run's finished units.
``cachescore_rows_scored_total``
    Rows (view rows) of the units scored in this run.
``cachescore_cache_bytes_read_total``
    Embedding bytes the run's finished units read from the cache (each unit's rows × dimension
    × item size once; large-scope units re-read chunks per search pass, which is not counted).
``cachescore_ann_recall{encoder,view,metric}``
    Measured ANN recall of the last unit that reported one.
``cachescore_run_info{run_id,job,store,state}``
    1 for the current (or last) run; its state is ``running``, ``finished``, ``aborted`` or
    ``interrupted``.
``cachescore_run_start_time_seconds`` / ``cachescore_last_progress_time_seconds``
    Unix times of the run's start and of the last unit that ended (``time() - last progress``
    is the "no progress" alert of ``deploy/monitoring/alerts.yaml``).
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .board import UNIT_STATES

__all__ = ["BoardCollector", "register_collector", "DURATION_BUCKETS"]

#: Upper bounds (seconds) of the unit-duration histogram.
DURATION_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0)

_REGISTERED: dict = {}
_LOCK = threading.Lock()


class BoardCollector:
    """Yields the ``cachescore_*`` families from ``board_of()`` (the current run board or None)."""

    def __init__(self, board_of):
        self.board_of = board_of

    def collect(self):
        board = self.board_of()
        snap = board.snapshot() if board is not None else None
        units = GaugeMetricFamily("cachescore_units", "Units of the current cachescore run by state",
                                  labels=["state", "encoder"])
        durations = HistogramMetricFamily("cachescore_unit_duration_seconds",
                                          "Durations of the run's finished units", labels=["metric"])
        rows = CounterMetricFamily("cachescore_rows_scored", "Rows of the units scored in this run")
        read = CounterMetricFamily("cachescore_cache_bytes_read", "Embedding bytes read from the cache by this run")
        recall = GaugeMetricFamily("cachescore_ann_recall", "Measured ANN recall of the last unit reporting one",
                                   labels=["encoder", "view", "metric"])
        info = GaugeMetricFamily("cachescore_run_info", "The current cachescore run",
                                 labels=["run_id", "job", "store", "state"])
        start = GaugeMetricFamily("cachescore_run_start_time_seconds", "Unix time the current run started")
        progress = GaugeMetricFamily("cachescore_last_progress_time_seconds", "Unix time the last unit ended")
        if snap and snap["run"]:
            counts: dict = {}
            for u in snap["units"]:
                per = counts.setdefault(str(u["encoder"]), dict.fromkeys(UNIT_STATES, 0))
                per[u["state"]] = per.get(u["state"], 0) + 1
            for enc, per in sorted(counts.items()):
                for state, n in per.items():
                    units.add_metric([state, enc], n)
            by_metric: dict = {}
            for u in snap["units"]:
                if u["state"] in ("done", "failed") and u["seconds"] is not None:
                    by_metric.setdefault(u["metric"], []).append(float(u["seconds"]))
            for metric, secs in sorted(by_metric.items()):
                buckets = [(str(b), sum(s <= b for s in secs)) for b in DURATION_BUCKETS] + [("+Inf", len(secs))]
                durations.add_metric([metric], buckets, sum(secs))
            rows.add_metric([], snap["rows_scored"])
            read.add_metric([], snap["bytes_read"])
            if snap["last_recall"]:
                r = snap["last_recall"]
                recall.add_metric([r["encoder"], r["view"], r["metric"]], r["value"])
            run = snap["run"]
            info.add_metric([run.get("run_id", ""), run.get("job", ""), run.get("store", ""), run.get("state", "")], 1)
            start.add_metric([], float(run.get("started") or 0))
            progress.add_metric([], float(snap["last_progress"] or 0))
        yield from (units, durations, rows, read, recall, info, start, progress)


def register_collector(board_of) -> BoardCollector:
    """Register one :class:`BoardCollector` in the global registry per process; later calls (a
    second scheduler in the same process, a re-registered plugin) only repoint it to ``board_of``."""
    with _LOCK:
        collector = _REGISTERED.get("collector")
        if collector is None:
            collector = _REGISTERED["collector"] = BoardCollector(board_of)
            REGISTRY.register(collector)
        else:
            collector.board_of = board_of
        return collector
