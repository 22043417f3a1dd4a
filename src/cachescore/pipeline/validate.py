"""Pre-flight: everything about a job that can be checked before computing (``cachescore validate``,
and ``cachescore run`` before it starts a cluster).

:func:`validate_plan` takes a :class:`~.plan.Plan` (whose planning already refused units whose
view, encoder or scopes are unusable: one label or one confounder value in a scope, a missing
view) and checks each probe view once, as the sweep would before fitting anything: the view's
rows map onto the probe parameters (columns, filters, exactly ``rows_per_slide`` rows per slide,
slides inside one cell), every test set selects rows, the schedule's splits use the same
``max_train_slides``, and the split plan can be built (cells present, enough slides per cell for
``max_train_slides`` plus validation and test rows) and passes the identity leakage audit. Every
message carries the counts it is about (slides per cell, rows per test set).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from ..cache import Cache
from ..errors import DATA_ERRORS
from ..probe.evaluate import check_sweep_plan
from ..probe.params import ProbeParams
from ..probe.views import select_probe_rows
from .plan import InvalidUnit, Plan, UnitKind

__all__ = ["ViewCheck", "validate_plan", "refuse_invalid", "check_probe_view"]


@dataclass(frozen=True)
class ViewCheck:
    """The outcome of the probe checks of one view: ``error`` is None when it passed; ``counts``
    holds what was counted (``cells``: ``"<confounder>/<class>" -> slides``, ``test_rows``)."""

    view: str
    error: str | None
    counts: dict


def _cell_counts(selection) -> dict:
    slides = pd.Series(np.asarray(selection.groups.get("slide", np.arange(selection.id_rows.size))).astype(str))
    cells = pd.DataFrame({"c": np.asarray(selection.confounder_names, dtype=object)[selection.confounders],
                          "y": np.asarray(selection.class_names, dtype=object)[selection.labels], "s": slides})
    per = cells.drop_duplicates().groupby(["c", "y"]).size()
    return {f"{c}/{y}": int(n) for (c, y), n in per.items()}


def check_probe_view(cache: Cache, view: str, params) -> ViewCheck:
    """The probe checks of ``view`` under ``params`` (a :class:`ProbeParams` or its dict)."""
    params = ProbeParams.coerce(params)
    source = f"view {view!r} ({cache.root})"
    counts: dict = {}
    try:
        frame = cache.read_view(view)
        selection = select_probe_rows(frame, params, source=source)
        counts = {"cells": _cell_counts(selection), "in_domain_rows": int(selection.id_rows.size),
                  "test_rows": {k: int(v.size) for k, v in selection.test_rows.items()}}
        empty = [k for k, v in selection.test_rows.items() if v.size == 0]
        if empty:
            raise ValueError(f"{source}: test set(s) {empty} select no row (test rows: {counts['test_rows']})")
        mts = sorted({int(m) for _, m in params.resolved_schedule()})
        if len(mts) > 1:
            raise ValueError(f"{source}: the schedule's splits use different max_train_slides {mts}; APD and nIPD "
                             "compare splits, which needs the same number of training slides in each")
        inputs = selection.gather_block(np.zeros((selection.needed_rows.size, 1), dtype=np.float32))
        kw = inputs.evaluate_kwargs(params)
        check_sweep_plan(inputs.confounders, inputs.labels, params=kw["params"], identities=kw["identities"],
                         test_sets=kw["test_sets"])
    except DATA_ERRORS as exc:
        cells = counts.get("cells")
        detail = f" [slides per (confounder/class) cell: {cells}; test rows: {counts.get('test_rows')}]" if cells else ""
        return ViewCheck(view, f"{type(exc).__name__}: {exc}{detail}", counts)
    return ViewCheck(view, None, counts)


def validate_plan(plan: Plan, *, cache: Cache | None = None) -> dict[str, ViewCheck]:
    """Run :func:`check_probe_view` once per (probe view, params) of the plan's probe units
    (pending or done); returns ``{view: ViewCheck}``. Reads only the views."""
    cache = cache or Cache(plan.job.cache)
    checks: dict[str, ViewCheck] = {}
    for u in plan.units:
        if u.kind is UnitKind.PROBE and u.view not in checks:
            checks[u.view] = check_probe_view(cache, u.view, u.params)
    return checks


def refuse_invalid(plan: Plan, checks: dict[str, ViewCheck]) -> Plan:
    """``plan`` with every pending probe unit of a failed view moved to ``invalid`` (its error the
    view's), so ``run`` records it without starting anything for it."""
    bad = {v: c.error for v, c in checks.items() if c.error}
    if not bad:
        return plan
    moved = [u for u in plan.pending if u.kind is UnitKind.PROBE and u.view in bad]
    invalid = tuple(InvalidUnit(unit=u.describe(), fingerprint=u.fingerprint, error=bad[u.view])
                    for u in moved)
    gone = {u.fingerprint for u in moved}
    keep = tuple(u for u in plan.pending if u.fingerprint not in gone)
    return replace(plan, pending=keep, invalid=plan.invalid + invalid)
