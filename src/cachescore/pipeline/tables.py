"""The tidy tables of a plan's current records: built (``cachescore export``) or published in the
store (every run's ending), with the job's ``[metrics] bootstrap`` and ``[report] min_support``."""

from __future__ import annotations

from typing import TextIO

from ..jobs.sections import as_dict
from ..results import build_results, publish_results
from .plan import Plan

__all__ = ["plan_results", "publish_plan_results"]


def _tables_of(plan: Plan) -> dict:
    """The arguments of :mod:`cachescore.results`' table builders for the plan's current records."""
    job = plan.job
    return dict(cache_root=job.cache, fingerprints=plan.record_fingerprints(),
                bootstrap=as_dict(job.metrics.bootstrap), min_support=job.report.min_support)


def plan_results(plan: Plan, store) -> tuple:
    """``(scores, probe, probe_centres)`` of the plan's current records
    (:func:`cachescore.results.build_results` with the job's ``[metrics] bootstrap`` and
    ``[report] min_support``); nothing is written."""
    return build_results(store, **_tables_of(plan))


def publish_plan_results(plan: Plan, store, *, out: TextIO | None = None) -> dict:
    """:func:`cachescore.results.publish_results` of the plan's current records (as :func:`plan_results`)."""
    return publish_results(store, **_tables_of(plan), out=out)
