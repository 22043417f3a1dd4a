"""Status of a job's work units against its results store (what ``cachescore status`` prints).

States:

* ``done`` -- the store holds this fingerprint;
* ``failed`` -- the latest attempt at this fingerprint failed (or it could not be planned); the
  error is in ``detail``;
* ``stale`` -- no result for this fingerprint, but one for the same encoder/view/design/metric/
  params from other inputs or code: it will be recomputed, never reused. ``detail`` says what
  changed (``embeddings changed``, ``view changed``, ``code changed``) where the old record tells;
* ``missing`` -- never scored; ``detail`` says why it is new (``new encoder``, ``params changed``,
  ``never scored``);
* ``damaged`` -- the store holds a record for this fingerprint that cannot be trusted (envelope
  does not parse, per-unit table missing, truncated or not matching its checksum); the planner
  treats it as pending, so the next ``cachescore run`` recomputes it (``detail`` says what is wrong).

Probe-sweep units are listed per stored record (one row per (matrix, reduction): ``metric`` is
``apd`` or ``nipd``, ``scope`` the matrix), so their values show like the metric units'.
:func:`pending_reasons` gives the same explanation for a plan's pending units (``cachescore watch``).
"""

from __future__ import annotations

import json

from ..store import ResultsStore
from .plan import UnitKind, params_json, plan_job
from .probe_identity import probe_record_fingerprint, probe_record_keys

__all__ = ["unit_status", "pending_reasons", "StoreIndex", "damaged_units"]


def _first_line(text, limit: int = 160) -> str:
    lines = str(text or "").strip().splitlines()
    return lines[0][:limit] if lines else ""


def _params_text(params) -> str:
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except ValueError:
            return params
    return params_json(params or {})


class StoreIndex:
    """The store's scores and failures, indexed for status questions (read once per call)."""

    def __init__(self, store):
        scores = store.scores()
        failures = store.failures()
        self.by_fp: dict[str, dict] = {}
        self.by_key: dict[tuple, dict] = {}
        self.by_family: dict[tuple, list[dict]] = {}
        self.encoders: set[str] = set()
        rows = scores.sort_values("finished_at", na_position="first").to_dict("records") if len(scores) else []
        for r in rows:  # oldest first: the latest record of a key wins
            try:
                r["_extra"] = json.loads(r["extra"]) if isinstance(r.get("extra"), str) else {}
            except ValueError:
                r["_extra"] = {}
            r["_params"] = _params_text(r.get("params"))
            self.by_fp[r["fingerprint"]] = r
            self.by_key[self.key(r["encoder"], r["view"], r["design"], r.get("scope"), r["metric"], r["_params"])] = r
            self.by_family.setdefault((r["encoder"], r["view"], r["design"], r["metric"]), []).append(r)
            if isinstance(r.get("encoder"), str):
                self.encoders.add(r["encoder"])
        self.failed: dict[str, dict] = {r["fingerprint"]: r for r in failures.to_dict("records")} if len(failures) else {}

    @staticmethod
    def key(encoder, view, design, scope, metric, params_text) -> tuple:
        scope = scope if design == "probe" else None  # metric units: the design is the scope family
        return (encoder, view, design, scope, metric, params_text)

    def explain(self, unit, *, scope=None, metric=None) -> tuple[str, float | None, str]:
        """``(state, value, detail)`` of a unit (or of one probe record: ``scope``/``metric``)
        whose fingerprint is not in the store."""
        metric = unit.metric if metric is None else metric
        pj = params_json(unit.params)
        prev = self.by_key.get(self.key(unit.encoder, unit.view, unit.design, scope, metric, pj))
        if prev is not None:
            changed = []
            old_inputs = prev["_extra"].get("inputs")
            if isinstance(old_inputs, dict):
                changed += [f"{name} changed" for name in ("embeddings", "view")
                            if old_inputs.get(name) != unit.inputs.get(name)]
            if prev.get("code_version") not in (None, unit.code_version):
                changed.append("code changed")
            return "stale", prev.get("value"), ", ".join(changed) or "inputs or code changed"
        if unit.encoder not in self.encoders:
            return "missing", None, "new encoder"
        if self.by_family.get((unit.encoder, unit.view, unit.design, metric)):
            return "missing", None, "params changed"
        return "missing", None, "never scored"


def _probe_rows(unit, index: StoreIndex, damaged: dict) -> list[dict]:
    unit_failed = index.failed.get(unit.fingerprint)
    rows = []
    for matrix, metric in probe_record_keys(unit.params):
        fp = probe_record_fingerprint(unit.fingerprint, matrix, metric)
        row = {"encoder": unit.encoder, "view": unit.view, "design": "probe", "metric": metric, "scope": matrix,
               "params": params_json(unit.params), "fingerprint": fp, "unit_fingerprint": unit.fingerprint,
               "value": None, "detail": ""}
        failed = index.failed.get(fp) or unit_failed
        if fp in index.by_fp:
            row.update(state="done", value=index.by_fp[fp].get("value"))
        elif fp in damaged:
            row.update(state="damaged", detail=f"damaged record: {damaged[fp]} (the next run recomputes it)")
        elif failed is not None:
            row.update(state="failed", detail=_first_line(failed.get("error")))
        else:
            state, value, detail = index.explain(unit, scope=matrix, metric=metric)
            row.update(state=state, value=value, detail=detail)
        rows.append(row)
    return rows


def unit_status(job, *, cache=None, store=None) -> list[dict]:
    """One row per work unit (probe units: per record; invalid units included).

    Keys: ``encoder, view, design, metric, scope`` (probe matrix, else None), ``params`` (canonical
    JSON), ``fingerprint``, ``state`` (``done | failed | stale | missing | damaged``), ``value`` (the stored
    value; for ``stale`` the old one) and ``detail`` (the error of a failed unit, what changed
    for a stale one, why a missing one is new).

    Raises what :func:`~.plan.plan_job` raises for job-level problems (missing cache, unknown
    encoder or view).
    """
    store = ResultsStore.open(job.store) if store is None else store
    plan = plan_job(job, cache=cache, store=store)
    index = StoreIndex(store)
    damaged = {d["fingerprint"]: d["problem"] for d in damaged_units(plan, store)}
    rows = []
    for u in plan.units:
        if u.kind is UnitKind.PROBE:
            rows.extend(_probe_rows(u, index, damaged))
            continue
        row = {"encoder": u.encoder, "view": u.view, "design": u.design, "metric": u.metric, "scope": None,
               "params": params_json(u.params), "fingerprint": u.fingerprint, "value": None, "detail": ""}
        if u.fingerprint in index.by_fp:
            row.update(state="done", value=index.by_fp[u.fingerprint].get("value"))
        elif u.fingerprint in damaged:
            row.update(state="damaged", detail=f"damaged record: {damaged[u.fingerprint]} (the next run recomputes it)")
        elif u.fingerprint in index.failed:
            row.update(state="failed", detail=_first_line(index.failed[u.fingerprint].get("error")))
        else:
            state, value, detail = index.explain(u)
            row.update(state=state, value=value, detail=detail)
        rows.append(row)
    for inv in plan.invalid:
        u = inv.unit
        rows.append({"encoder": u["encoder"], "view": u["view"], "design": u.get("design"), "metric": u["metric"],
                     "scope": None, "params": params_json(u.get("params", {})), "fingerprint": inv.fingerprint,
                     "value": None, "state": "failed", "detail": _first_line(inv.error)})
    return rows


def pending_reasons(plan, *, store=None) -> list[dict]:
    """Why each pending unit of ``plan`` is pending: ``[{"label", "fingerprint", "reason"}]``.

    ``reason`` is one of ``new encoder``, ``embeddings changed``, ``view changed``, ``code changed``
    (comma-joined when several), ``params changed``, ``never scored``, or ``failed before: <error>``
    (the same fingerprint failed in an earlier run: its inputs did not change).
    """
    store = ResultsStore.open(plan.job.store) if store is None else store
    index = StoreIndex(store)
    out = []
    for u in plan.pending:
        if u.fingerprint in index.failed:
            reason = "failed before: " + _first_line(index.failed[u.fingerprint].get("error"), 100)
        elif u.kind is UnitKind.PROBE:
            matrix, metric = probe_record_keys(u.params)[0]
            reason = index.explain(u, scope=matrix, metric=metric)[2]
        else:
            reason = index.explain(u)[2]
        out.append({"label": u.label, "fingerprint": u.fingerprint, "reason": reason})
    return out


def damaged_units(plan, store) -> list[dict]:
    """Records of the plan's units that exist in ``store`` but are damaged (an envelope that does
    not parse, a per-unit table missing, truncated or not matching its checksum): ``[{"label",
    "fingerprint", "problem"}]``, in plan order. The planner treats those units as pending (one
    predicate: :meth:`~cachescore.store.ResultsStore.damaged`), so ``cachescore run`` repairs them."""
    labels = {}
    for u in plan.units:
        if u.kind is UnitKind.PROBE:
            for matrix, metric in probe_record_keys(u.params):
                labels[probe_record_fingerprint(u.fingerprint, matrix, metric)] = f"{u.label}/{matrix}/{metric}"
        else:
            labels[u.fingerprint] = u.label
    return [{"label": labels[fp], "fingerprint": fp, "problem": why} for fp, why in store.damaged(labels)]
