"""Status of a job's work units against its results store (what ``cachescore status`` prints).

States: ``done`` (the store holds this fingerprint), ``failed`` (the latest attempt at this
fingerprint failed; the error is in ``detail``), ``stale`` (no result for this fingerprint, but
one for the same encoder/view/design/metric/params from other inputs or code: it will be
recomputed, never reused), ``missing`` (never scored).
"""

from __future__ import annotations

from .plan import params_json, plan_job

__all__ = ["unit_status"]


def unit_status(job, *, cache=None, store=None) -> list[dict]:
    """One row per work unit (invalid units included) with ``state``, ``value`` and ``detail``.

    Raises what :func:`~.plan.plan_job` raises for job-level problems (missing cache, unknown
    encoder or view).
    """
    from ..store import ResultsStore

    store = ResultsStore(job.store) if store is None else store
    plan = plan_job(job, cache=cache, store=store)
    scores = store.scores()
    failures = store.failures()
    by_fp = {r["fingerprint"]: r for r in scores.to_dict("records")} if len(scores) else {}
    old = {}
    for r in (scores.to_dict("records") if len(scores) else []):
        old[(r["encoder"], r["view"], r["design"], r["metric"], r["params"])] = r
    failed = {}
    if len(failures):
        for r in failures.to_dict("records"):
            failed[r["fingerprint"]] = r
    rows = []
    for u in plan.units:
        pj = params_json(u.params)
        row = {"encoder": u.encoder, "view": u.view, "design": u.design, "metric": u.metric, "params": pj,
               "fingerprint": u.fingerprint, "value": None, "detail": ""}
        if u.metric == "probe":
            done = u in plan.done
            row.update(state="done" if done else ("failed" if u.fingerprint in failed else "missing"))
            if not done and u.fingerprint in failed:
                row["detail"] = str(failed[u.fingerprint].get("error", "")).splitlines()[0][:120]
        elif u.fingerprint in by_fp:
            row.update(state="done", value=by_fp[u.fingerprint].get("value"))
        elif u.fingerprint in failed:
            row.update(state="failed", detail=str(failed[u.fingerprint].get("error", "")).splitlines()[0][:120])
        elif (u.encoder, u.view, u.design, u.metric, pj) in old:
            prev = old[(u.encoder, u.view, u.design, u.metric, pj)]
            row.update(state="stale", value=prev.get("value"), detail="inputs or code changed since scored")
        else:
            row.update(state="missing")
        rows.append(row)
    for inv in plan.invalid:
        u = inv.unit
        rows.append({"encoder": u["encoder"], "view": u["view"], "design": u.get("design"), "metric": u["metric"],
                     "params": params_json(u.get("params", {})), "fingerprint": inv.fingerprint, "value": None,
                     "state": "failed", "detail": inv.error.splitlines()[0][:120]})
    return rows
