"""Prune a results store: forget what the job's current plan has superseded.

A stored record belongs to the job's **scope** when the job's current plan has a unit with the
same identity (encoder, view, design, probe matrix, metric, canonical params — the key
``cachescore status`` uses to call a unit ``stale``). Within that scope a record is *stale* when
no current fingerprint names it (another code version, other inputs); a failure is *abandoned*
when it is neither a current unit's nor a current invalid unit's. Records and failures outside
the scope — another job sharing the store, an encoder or view the job no longer names (or whose
folder is momentarily unreadable), other parameters — are listed and **kept** unless
``all_jobs=True`` (CLI ``--all-jobs``), which prunes everything no unit of *this* job names.

Safety (ADR-0014): a prune refuses (:class:`PruneRefused`) while any input of the job cannot be
read or verified (an encoder's ``meta.json``, a view or its sidecar checksum): a record of an
input that is transiently unavailable is never judged stale. ``apply=True`` takes the store's run
lock (:class:`~cachescore.store.lock.StoreLock`), so it never deletes beside a running ``run``
(:class:`~cachescore.store.lock.StoreLockedError` at once). Bundles, runs and the cache are not
touched.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ..store.lock import StoreLock
from .plan import UnitKind, params_json
from .probe_identity import probe_record_keys

__all__ = ["PruneReport", "PruneRefused", "prune_store", "scope_keys"]


class PruneRefused(ValueError):
    """The job's inputs cannot all be read or verified: nothing was judged stale, nothing deleted."""


@dataclass
class PruneReport:
    """What a prune found (and, when applied, removed): fingerprints and bytes.

    ``stale_records`` / ``abandoned_failures``: in the job's scope (removed by ``apply``);
    ``outside_records`` / ``outside_failures``: no unit of the job has their identity (kept unless
    ``all_jobs``; then they are counted in the first two lists as well)."""

    stale_records: list = field(default_factory=list)
    abandoned_failures: list = field(default_factory=list)
    outside_records: list = field(default_factory=list)
    outside_failures: list = field(default_factory=list)
    bytes_freed: int = 0
    applied: bool = False
    all_jobs: bool = False


def _key(encoder, view, design, scope, metric, params) -> tuple:
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except ValueError:
            pass
    text = params if isinstance(params, str) else params_json(params or {})
    return (encoder, view, design, scope if design == "probe" else None, metric, text)


def scope_keys(plan) -> set[tuple]:
    """Identities of every record and failure the plan's units and invalid units can have."""
    keys = set()
    for u in plan.units:
        keys.add(_key(u.encoder, u.view, u.design, None, u.metric, u.params))
        if u.kind is UnitKind.PROBE:
            keys.update(_key(u.encoder, u.view, "probe", m, r, u.params) for m, r in probe_record_keys(u.params))
    for inv in plan.invalid:
        i = inv.unit
        keys.add(_key(i.get("encoder"), i.get("view"), i.get("design"), None, i.get("metric"), i.get("params")))
    return keys


def _identity(doc: dict | None) -> tuple | None:
    if not isinstance(doc, dict):
        return None
    try:
        return _key(doc.get("encoder"), doc.get("view"), doc.get("design"), doc.get("scope"), doc.get("metric"),
                    doc.get("params"))
    except (TypeError, ValueError):
        return None


def unreadable_inputs(plan) -> dict[str, str]:
    """``{input: error}`` of every input of the plan that could not be read or verified."""
    return {k: str(v)[len("error: "):] for k, v in plan.inputs.items() if str(v).startswith("error:")}


def prune_store(plan, store, *, apply: bool = False, all_jobs: bool = False) -> PruneReport:
    """Find (``apply=False``) or remove (``apply=True``, under the store lock) the records and
    failures of ``store`` that ``plan`` has superseded (see the module docstring). Returns a
    :class:`PruneReport` (sorted fingerprints).

    Raises :class:`PruneRefused` when an input of the job is unreadable (the message names each),
    :class:`~cachescore.store.lock.StoreLockedError` when ``apply`` and a run holds the store."""
    bad = unreadable_inputs(plan)
    if bad:
        listed = "; ".join(f"{k}: {v}" for k, v in sorted(bad.items())[:5])
        raise PruneRefused(f"prune refused: {len(bad)} input(s) of job {plan.job.name!r} cannot be read or verified, "
                           f"so their stored results cannot be judged ({listed}); restore them (or drop them from the "
                           "job) and prune again — nothing was deleted")
    if not apply:
        return _find(plan, store, all_jobs)
    with StoreLock(store.path, f"prune-{uuid.uuid4().hex[:12]}"):
        report = _find(plan, store, all_jobs)  # judged under the lock: no run writes meanwhile
        report.applied = True
        for fp in report.stale_records:
            report.bytes_freed += store.delete_unit(fp)
        for fp in report.abandoned_failures:
            store.clear_failure(fp)
    return report


def _find(plan, store, all_jobs: bool) -> PruneReport:
    current = set(plan.record_fingerprints()) | {u.fingerprint for u in plan.units}
    current |= {i.fingerprint for i in plan.invalid}
    keys = scope_keys(plan)
    report = PruneReport(all_jobs=all_jobs)
    report.stale_records, report.outside_records = _split(
        sorted(store.stored_fingerprints() - current), lambda fp: store.raw_record(fp), keys, all_jobs)
    report.abandoned_failures, report.outside_failures = _split(
        sorted(store.failure_fingerprints() - current), lambda fp: store.failure_unit(fp), keys, all_jobs)
    return report


def _split(fps: list[str], identity_doc, keys: set, all_jobs: bool) -> tuple[list, list]:
    """``(to prune, outside the scope)`` of non-current fingerprints; with ``all_jobs`` the
    outside ones are pruned too (and still listed as outside)."""
    outside = [fp for fp in fps if _identity(identity_doc(fp)) not in keys]
    gone = set(outside)
    return (fps if all_jobs else [fp for fp in fps if fp not in gone]), outside
