"""What one work unit does on a worker: read its inputs from the cache, score, write the store.

* :func:`score_unit` is the single place where the pipeline calls the metric API (RI, MaRI,
  CRoMa; exact or ANN neighbours). It takes numpy + pandas and returns a store record and a
  per-unit table.
* :func:`run_probe_task` is the Dask task of a probe-sweep unit: it secedes from the worker's
  thread pool (``worker_client``), fans the sweep's replicates out as further tasks, waits for them
  and writes the unit's APD/nIPD records; metric units keep running meanwhile.
* :func:`run_unit` is the Dask task of a metric unit. It receives only a :class:`~.plan.WorkUnit` (paths and
  parameters, no arrays), reads the embeddings **on the worker**, pins BLAS to one thread, calls
  the unit function and writes the result atomically to the store.

Failure policy: an exception of a *data* kind (:data:`DATA_ERRORS`: invalid/corrupt/missing
input, a metric refusing the data) is recorded in the store as the unit's failure and the task
returns normally, so it is not retried. Anything else (lost connection, out of memory, a killed
worker) propagates, and Dask retries the task; the client records it as failed if retries run out.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from datetime import datetime, timezone

import numpy as np
import pandas as pd

__all__ = ["DATA_ERRORS", "score_unit", "run_unit", "run_probe_task", "load_unit_inputs", "result_record"]

#: Exceptions that mean "this unit's data cannot be scored" (recorded, never retried). The cache's
#: errors subclass ValueError / FileNotFoundError; the metric API raises ValueError/RuntimeError.
DATA_ERRORS = (ValueError, TypeError, LookupError, RuntimeError, ArithmeticError, FileNotFoundError)


def _nan(x) -> float:
    try:
        return float(x) if x is not None else float("nan")
    except (TypeError, ValueError):
        return float("nan")


class _RecordingAnnSearch:
    """An ANN neighbour backend for ``compute_with`` that keeps the recall it measured.

    Wraps the ANN backend's ``*_with_recall`` searches (IVF-style candidate clusters, or
    pynndescent graphs with ``method="graph"``, refined with exact distances; recall measured
    against exact search on ``recall_sample`` seeded queries per call). The metric
    may call it once per scope (and more than once per scope); :attr:`recall` is the worst
    measured recall over all calls (NaN if it was never called).
    """

    def __init__(self, kind: str, params: dict):
        self.kind, self.params, self.recalls = kind, params, []

    def __call__(self, *args, **kwargs):
        from ..neighbors import ann

        fn = ann.typed_knn_ann_with_recall if self.kind == "typed" else ann.cross_group_knn_ann_with_recall
        kwargs.setdefault("random_state", int(self.params["seed"]))
        kwargs.setdefault("recall_target", float(self.params["recall_target"]))
        kwargs.setdefault("n_recall_queries", int(self.params["recall_sample"]))
        r = fn(*args, **kwargs)
        self.recalls.append(float(r.recall))
        return (r.so_dist, r.os_dist) if self.kind == "typed" else (r.idx, r.dist)

    @property
    def recall(self) -> float:
        return min(self.recalls) if self.recalls else float("nan")


def result_record(unit, result, *, recall: float = float("nan")) -> tuple[dict, pd.DataFrame]:
    """Store record + per-unit table from a ``RobustnessResult`` or ``CRoMaResult``.

    Record keys: the unit's identity (encoder, view, tileset, design, metric, params), ``value``,
    ``std``, ``q_alpha``, ``ltm_alpha``, ``f0`` (CRoMa), ``support`` (float64 fraction of defined
    units, ``RobustnessResult.support``; 1.0 for CRoMa), ``n_defined`` (their count), ``k`` (operating k;
    CRoMa: ``k_final``), ``tau`` (MaRI), ``m`` (CRoMa), ``recall`` (ANN), ``backend``,
    ``n_units``, ``n_pairs``, ``fingerprint``. Missing quantities are NaN, never 0.
    Per-unit columns: ``unit`` (0..U-1, unit order), ``source_index`` (view row), ``subset``,
    ``value`` (aligned; NaN when undefined) and, for RI/MaRI, ``defined`` and ``undefined_type``.
    """
    from .plan import params_json

    is_croma = unit.metric == "croma"
    values = np.asarray(result.sample_values_aligned, dtype=float)
    record = {
        "encoder": unit.encoder,
        "view": unit.view,
        "tileset": unit.tileset,
        "design": unit.design,
        "family": unit.metric,
        "metric": unit.metric,
        "params": params_json(unit.params),
        "backend": unit.params.get("backend", "exact"),
        "value": _nan(result.value),
        "std": _nan(result.std),
        "q_alpha": _nan(result.q_alpha),
        "ltm_alpha": _nan(result.ltm_alpha),
        "f0": _nan(result.f0) if is_croma else float("nan"),
        # ``support`` is RobustnessResult.support (fraction of defined units); CRoMa enforces
        # total support (its result has no support field): 1.0. The count is ``n_defined``.
        "support": 1.0 if is_croma else _nan(result.support),
        "k": int(result.k_final) if is_croma else int(result.k),
        "tau": _nan(getattr(result, "tau", None)) if unit.metric == "mari" else float("nan"),
        "m": int(result.m) if is_croma else None,
        "recall": float(recall),
        "n_units": int(values.size),
        "n_defined": int(np.asarray(result.occurrence_defined_mask).sum()) if not is_croma else int(values.size),
        "n_pairs": int(result.n_pairs),
        "fingerprint": unit.fingerprint,
    }
    per_unit = pd.DataFrame({
        "unit": np.arange(values.size, dtype=np.int64),
        "source_index": np.asarray(result.occurrence_source_indices, dtype=np.int64)
        if result.occurrence_source_indices is not None else np.arange(values.size, dtype=np.int64),
        "subset": np.asarray(result.occurrence_subsets, dtype=object).astype(str)
        if result.occurrence_subsets is not None else np.full(values.size, "dataset"),
        "value": values,
    })
    if not is_croma:
        per_unit["defined"] = np.asarray(result.occurrence_defined_mask, dtype=bool)
        per_unit["undefined_type"] = np.asarray(result.sample_undefined_types).astype(str)
    return record, per_unit


def score_unit(unit, features: np.ndarray, manifest: pd.DataFrame) -> tuple[dict, pd.DataFrame]:
    """Score one work unit with the metric API.

    Parameters
    ----------
    unit : WorkUnit
        Metric family, design, confounder column and parameters (see :class:`~.plan.WorkUnit`).
    features : ndarray of shape (n_rows, d), float
        Embeddings in view order (row ``i`` belongs to ``manifest`` row ``i``).
    manifest : DataFrame
        The view (croma's columns: ``sample_id``, ``image_path``, ``label``, ``group_id``, the
        confounder column, ``subset`` if present).

    Returns
    -------
    (record, per_unit) as described in :func:`result_record`.

    Raises
    ------
    ValueError, RuntimeError
        Whatever the metric API raises for invalid data (incomplete subset, one row, …).
    """
    p = unit.params
    ann = p.get("backend") == "ann"
    search = _RecordingAnnSearch("typed" if unit.metric == "croma" else "cross", p) if ann else None
    common = dict(confounder_column=unit.confounder_column, evaluation_design=unit.design)
    if unit.metric == "ri":
        from ..metrics.ri import RI

        kw = dict(common, k_candidates=list(p["k_candidates"]))
        result = RI.compute_with(search, features, manifest, **kw) if ann else RI.compute(features, manifest, **kw)
    elif unit.metric == "mari":
        from ..metrics.mari import MaRI

        tau = None if p["tau"] == "auto" else float(p["tau"])
        kw = dict(common, k_candidates=list(p["k_candidates"]), tau=tau, warn_tau=bool(p["warn_tau"]))
        result = (MaRI.compute_with(search, features, manifest, **kw) if ann
                  else MaRI.compute(features, manifest, **kw))
    elif unit.metric == "croma":
        from ..metrics.croma import CRoMa

        kw = dict(common, m=int(p["m"]), alpha=float(p["alpha"]), start_k=int(p["start_k"]),
                  k_growth_factor=float(p["k_growth_factor"]))
        # On ANN scopes croma's schedule diagnostics would need an exact O(n^2 d) counting pass
        # that cancels the ANN gain: they are reported as -1 ("not computed", ADR-0002).
        result = (CRoMa.compute_with(search, features, manifest, schedule_diagnostics=False, **kw) if ann
                  else CRoMa.compute(features, manifest, **kw))
    else:
        raise ValueError(f"unknown metric family {unit.metric!r} (known: ri, mari, croma)")
    return result_record(unit, result, recall=search.recall if ann else float("nan"))


def load_unit_inputs(unit) -> tuple[np.ndarray, pd.DataFrame]:
    """Read and validate a unit's inputs from the cache (call on the worker).

    Validates the (encoder, tileset) embeddings first (shape, dtype, alignment, shard checksums,
    finite values: the cache's errors name encoder, shard and rows), then reads the view and
    gathers its rows. Returns ``(features in view order, view frame)``.
    """
    from ..cache import Cache

    cache = Cache(unit.cache_root)
    cache.validate_embeddings(unit.encoder, unit.tileset)
    manifest = cache.read_view(unit.view)
    rows = manifest["row"].to_numpy(dtype=np.int64)
    features = cache.load_rows(unit.encoder, unit.tileset, rows)
    return features, manifest


def _pin_threads():
    """Single-threaded BLAS/OpenMP for the duration of a task (a context manager)."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1)


def run_unit(unit, unit_fn=None, load_fn=None, run_id: str | None = None) -> dict:
    """The Dask task for one work unit. Returns a small status dict (never arrays).

    ``{"fingerprint", "label", "status": "done" | "failed", "seconds", "error"?, "worker_pid"}``.
    Data errors are recorded in the store and returned as ``failed``; other exceptions propagate
    (Dask retries them). ``unit_fn`` (default :func:`score_unit`) and ``load_fn`` (default
    :func:`load_unit_inputs`) are injectable for tests; ``run_id`` is stored with the record.
    Warnings raised while scoring are stored in the record (``warnings``); capturing them is
    process-wide, so workers should run one thread each (what :func:`~.cluster.open_client`
    starts, and what ``deploy/README.md`` asks of deployed workers).
    """
    from ..store import ResultsStore

    unit_fn = score_unit if unit_fn is None else unit_fn
    load_fn = load_unit_inputs if load_fn is None else load_fn
    store = ResultsStore(unit.store_root)
    t0 = time.perf_counter()
    with _pin_threads(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            features, manifest = load_fn(unit)
            t1 = time.perf_counter()
            record, per_unit = unit_fn(unit, features, manifest)
        except DATA_ERRORS as exc:
            return _record_data_failure(store, unit, exc, run_id=run_id, started=t0)
    t2 = time.perf_counter()
    record = dict(record)
    record.setdefault("fingerprint", unit.fingerprint)
    record["seconds"] = t2 - t0
    record["seconds_load"] = t1 - t0
    record["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record["code_version"] = unit.code_version
    record["inputs"] = dict(unit.inputs)  # lets ``status`` say which input changed since
    record["run_id"] = run_id
    record["warnings"] = "\n".join(sorted({f"{w.category.__name__}: {w.message}" for w in caught}))
    store.write_unit(unit.fingerprint, record=record, per_unit=per_unit)
    return {"fingerprint": unit.fingerprint, "label": unit.label, "status": "done",
            "seconds": record["seconds"], "worker_pid": os.getpid()}


def _record_data_failure(store, unit, exc: BaseException, *, run_id, started: float) -> dict:
    """Record a data error as the unit's failure (not retried) and return the task's status dict.

    Must be called from inside the ``except`` block (the traceback is the current exception's).
    """
    err = f"{type(exc).__name__}: {exc}"
    store.record_failure(unit.fingerprint, unit=dict(unit.describe(), run_id=run_id), error=err)
    return {"fingerprint": unit.fingerprint, "label": unit.label, "status": "failed", "error": err,
            "traceback": traceback.format_exc(limit=5), "seconds": time.perf_counter() - started,
            "worker_pid": os.getpid()}


def run_probe_task(unit, bundle_root, run_id: str | None = None, probe_fn=None) -> dict:
    """The Dask task for one probe-sweep unit (``unit.metric == "probe"``). Returns a status dict
    like :func:`run_unit` (``{"fingerprint", "label", "status", "seconds", "error"?, "records"?}``).

    Runs :func:`~.probe_unit.run_probe_unit` inside ``distributed.worker_client()``: the task
    leaves the worker's thread pool while the sweep's (replicate, split) tasks run on the cluster,
    so metric units and other probe units proceed concurrently; the evaluation bundle goes under
    ``bundle_root`` and one record per (matrix, reduction) into the unit's store. Same failure
    policy as :func:`run_unit`: a data error (:data:`DATA_ERRORS`: unfit view, leakage, corrupt
    embeddings) is recorded as the unit's failure and returned as ``failed`` (not retried);
    anything else propagates and Dask retries the task. ``probe_fn`` replaces ``run_probe_unit``
    (same signature; tests).
    """
    from distributed import worker_client

    from ..store import ResultsStore
    from .probe_unit import run_probe_unit, write_probe_records

    probe_fn = run_probe_unit if probe_fn is None else probe_fn
    store = ResultsStore(unit.store_root)
    t0 = time.perf_counter()
    try:
        with worker_client() as client:
            records, _ = probe_fn(unit.cache_root, unit.encoder, unit.view, unit.params, bundle_root=bundle_root,
                                  client=client, code_version=unit.code_version)
    except DATA_ERRORS as exc:
        return _record_data_failure(store, unit, exc, run_id=run_id, started=t0)
    written = write_probe_records(store, records, run_id=run_id)
    store.clear_failure(unit.fingerprint)  # success lives under per-record fingerprints
    return {"fingerprint": unit.fingerprint, "label": unit.label, "status": "done", "records": written,
            "seconds": time.perf_counter() - t0, "worker_pid": os.getpid()}
