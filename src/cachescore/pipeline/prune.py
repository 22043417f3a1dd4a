"""Prune a results store: forget what no current fingerprint of the job refers to.

A record is *stale* when no unit of the job's current plan (its fingerprints, and a probe unit's
per-record fingerprints) names it — the result of another code version, other inputs or an
abandoned parameter set. A failure is *abandoned* when it is neither a current unit's nor a
current invalid unit's. Stale records are never reused (fingerprints differ), so removing them
loses nothing the job can still show; ``cachescore prune`` lists them and deletes only with
``--apply``. Bundles, runs and the cache are not touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PruneReport", "prune_store"]


@dataclass
class PruneReport:
    """What a prune found (and, when applied, removed): fingerprints and bytes."""

    stale_records: list = field(default_factory=list)
    abandoned_failures: list = field(default_factory=list)
    bytes_freed: int = 0
    applied: bool = False


def prune_store(plan, store, *, apply: bool = False) -> PruneReport:
    """Find (``apply=False``) or remove (``apply=True``) the records and failures of ``store`` that
    no unit of ``plan`` refers to. Returns a :class:`PruneReport` (sorted fingerprints)."""
    current = set(plan.record_fingerprints()) | {u.fingerprint for u in plan.units}
    current |= {i.fingerprint for i in plan.invalid}
    report = PruneReport(stale_records=sorted(store.stored_fingerprints() - current),
                         abandoned_failures=sorted(store.failure_fingerprints() - current), applied=apply)
    if apply:
        for fp in report.stale_records:
            report.bytes_freed += store.delete_unit(fp)
        for fp in report.abandoned_failures:
            store.clear_failure(fp)
    return report
