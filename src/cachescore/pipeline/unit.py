"""What one work unit does on a worker: read its inputs from the cache, score, write the store.

* :func:`score_unit` is the single place where the pipeline calls the metric API (RI, MaRI,
  CRoMa; exact or ANN neighbours). It takes numpy + pandas and returns a store record and a
  per-unit table.
* :func:`run_probe_task` is the Dask task of a probe-sweep unit: it secedes from the worker's
  thread pool (``worker_client``), fans the sweep's replicates out as further tasks, waits for them
  and writes the unit's APD/nIPD records; metric units keep running meanwhile.
* :func:`write_unit_result` / :func:`record_unit_failure` end a unit in the store (its record and
  per-unit table, or its failure) and return its :class:`~.outcome.UnitOutcome`. The Dask task of
  metric units, which reads their inputs once on the worker, is :func:`~.batch.run_batch`.
* A unit of kind :attr:`~.plan.UnitKind.LARGE` (a scope of at least ``[neighbors]
  large_scope_rows`` rows) is driven from the client process by :mod:`.large_unit`, with every
  per-row step on the workers.

Failure policy: an exception of a *data* kind (:data:`cachescore.errors.DATA_ERRORS`:
invalid/corrupt/missing input, a metric refusing the data) is recorded in the store as the unit's
failure and the task returns normally, so it is not retried. Anything else (a bug in our code, a
lost connection, out of memory, a killed worker) propagates, and Dask retries the task; the client
records it as failed, with its type and message, if retries run out.
"""

from __future__ import annotations

import errno
import os
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import dask
import numpy as np
import pandas as pd
from distributed import worker_client

from .._missing import as_float
from .._taskkeys import ANNOTATION
from ..cache import Cache
from ..errors import DATA_ERRORS, UnscorableError
from ..metrics import families
from ..neighbors.large_scope import scratch_dir
from ..neighbors.registry import searcher_for
from ..store import ResultsStore, scratch_path
from ..store.results import StoreWriteError
from .outcome import UnitOutcome
from .plan import params_json
from .probe_unit import run_probe_unit, write_probe_records

__all__ = ["score_unit", "run_probe_task", "unit_scratch",
           "load_unit_inputs", "result_record", "unit_annotation", "write_unit_result", "record_unit_failure"]


def unit_annotation(unit, run_id: str | None = None) -> dict:
    """The Dask annotation of a unit's tasks (``dask.annotate(cachescore=...)``): fingerprint,
    encoder, view, metric and run id. The scheduler plugin marks the unit running when one of its
    tasks starts; :func:`cachescore._taskkeys.task_key` names the tasks after it."""
    return {"unit": unit.fingerprint, "encoder": unit.encoder, "view": unit.view, "metric": unit.metric,
            "run_id": run_id}

def result_record(unit, result, *, recall: float = float("nan")) -> tuple[dict, pd.DataFrame]:
    """Store record + per-unit table of a family's result (``RobustnessResult``, ``CRoMaResult``, …).

    Record keys: the unit's identity (encoder, view, tileset, design, metric, params), ``value``,
    ``std``, ``q_alpha``, ``ltm_alpha``, ``recall`` (ANN), ``backend``, ``n_units``, ``n_pairs``,
    ``fingerprint``, the keys every family shares, then the family's own fields
    (:attr:`cachescore.metrics.families.Family.record`: RI/MaRI ``support``, ``n_defined``, ``k``,
    MaRI ``tau``, CRoMa ``f0``, ``k`` = ``k_final``, ``m``). ``f0``, ``tau`` and ``m`` are NaN /
    None where a family has none; missing quantities are NaN, never 0.
    Per-unit columns: ``unit`` (0..U-1, unit order), ``source_index`` (view row), ``subset``,
    ``value`` (aligned; NaN when undefined), then the family's columns (RI/MaRI: ``defined``,
    ``undefined_type`` and the per-unit evidence ``so`` / ``os``, counts for RI, weight sums for
    MaRI; the pooled value is ``sum(so) / (sum(so) + sum(os))``, which the results' cluster
    bootstrap resamples).
    """
    values = np.asarray(result.sample_values_aligned, dtype=float)
    fields, columns = families.get(unit.metric).record(result)
    record = {
        "encoder": unit.encoder,
        "view": unit.view,
        "tileset": unit.tileset,
        "design": unit.design,
        "family": unit.metric,
        "metric": unit.metric,
        "params": params_json(unit.params),
        "backend": unit.params.get("backend", "exact"),
        "value": as_float(result.value),
        "std": as_float(getattr(result, "std", None)),
        "q_alpha": as_float(getattr(result, "q_alpha", None)),
        "ltm_alpha": as_float(getattr(result, "ltm_alpha", None)),
        "f0": float("nan"),
        "support": float("nan"),
        "k": None,
        "tau": float("nan"),
        "m": None,
        "recall": float(recall),
        "n_units": int(values.size),
        "n_defined": int(np.isfinite(values).sum()),
        "n_pairs": int(getattr(result, "n_pairs", 0) or 0),
        "fingerprint": unit.fingerprint,
    }
    record.update(fields)
    sources = getattr(result, "occurrence_source_indices", None)
    subsets = getattr(result, "occurrence_subsets", None)
    per_unit = pd.DataFrame({
        "unit": np.arange(values.size, dtype=np.int64),
        "source_index": np.asarray(sources, dtype=np.int64) if sources is not None
        else np.arange(values.size, dtype=np.int64),
        "subset": np.asarray(subsets, dtype=object).astype(str) if subsets is not None
        else np.full(values.size, "dataset"),
        "value": values,
    })
    for name, column in columns.items():
        per_unit[name] = column
    return record, per_unit


def _compute(unit, features, manifest, searcher):
    """Call the unit's family through ``searcher`` (the one place the pipeline calls the metric
    API: :attr:`cachescore.metrics.families.Family.compute`)."""
    return families.get(unit.metric).compute(unit.params, features, manifest, confounder_column=unit.confounder_column,
                                             design=unit.design, searcher=searcher)


def score_unit(unit, features: np.ndarray, manifest: pd.DataFrame, *, searcher=None) -> tuple[dict, pd.DataFrame]:
    """Score one work unit with the metric API.

    Parameters
    ----------
    unit : WorkUnit
        Metric family, design, confounder column and parameters (see :class:`~.plan.WorkUnit`).
    features : ndarray of shape (n_rows, d), float
        Embeddings in view order (row ``i`` belongs to ``manifest`` row ``i``). With a
        ``searcher`` that reads the rows itself (large scopes), an ``(n_rows, 0)`` array.
    manifest : DataFrame
        The view (croma's columns: ``sample_id``, ``image_path``, ``label``, ``group_id``, the
        confounder column, ``subset`` if present).
    searcher : cachescore.neighbors.base.Searcher, optional
        The neighbour engine (a ``LargeScopeSearch`` for large scopes). Default: the registry's
        engine for the unit's parameters (:func:`~cachescore.neighbors.registry.searcher_for`;
        an in-memory one: an out-of-core unit is given its engine by :func:`score_large_unit`).

    Returns
    -------
    (record, per_unit) as described in :func:`result_record`; with a searcher the record also
    holds ``neighbour_search`` (its per-call details, stored in the ``extra`` column).

    Raises
    ------
    ValueError, cachescore.errors.UnscorableError
        What the metric API raises for invalid data (incomplete subset, one row, …): its
        ``RuntimeError`` refusals (croma's contract) become :class:`~cachescore.errors.UnscorableError`
        with the unit's label, so the runner records them as data errors; any other exception
        (a bug) propagates unchanged.
    """
    p = unit.params
    if searcher is None:
        searcher = searcher_for(p)
    try:
        result = _compute(unit, features, manifest, searcher)
    except RuntimeError as exc:
        if type(exc) is not RuntimeError:  # RecallTargetError, RecursionError, ...: as they are
            raise
        # the metric API's (croma's) refusal of the data: a data error, not a bug
        raise UnscorableError(f"{unit.label}: {exc}") from exc
    measured = p.get("backend") == "ann"  # exact searches have no recall to measure
    record, per_unit = result_record(unit, result, recall=searcher.recall if measured else float("nan"))
    if searcher.details:
        record["neighbour_search"] = searcher.details
    return record, per_unit


def unit_scratch(unit) -> Path:
    """The scratch folder of an out-of-core unit's scopes, under its store's scratch folder."""
    return scratch_dir(unit, scratch_path(unit.store_root))


def load_unit_inputs(unit) -> tuple[np.ndarray, pd.DataFrame]:
    """Read and validate a unit's inputs from the cache (call on the worker).

    Validates the (encoder, tileset) embeddings first (shape, dtype, alignment, shard checksums,
    finite values: the cache's errors name encoder, shard and rows), then reads the view and
    gathers its rows. Returns ``(features in view order, view frame)``.
    """
    cache = Cache(unit.cache_root)
    cache.validate_embeddings(unit.encoder, unit.tileset)
    manifest = cache.read_view(unit.view)
    rows = manifest["row"].to_numpy(dtype=np.int64)
    features = cache.load_rows(unit.encoder, unit.tileset, rows)
    return features, manifest


def write_unit_result(store, unit, record: dict, per_unit, *, started: float, loaded: float, caught, run_id,
                  bytes_read: int | None = None) -> UnitOutcome:
    """Complete a unit's record (timings, versions, inputs, warnings), write it atomically with
    its per-unit table and return the unit's outcome (with ``value``, ``recall``, ``rows``:
    the unit's scored rows, ``bytes_read``: embedding bytes it loaded, for the run board). A store
    that cannot be written (disk full, read-only: :class:`~cachescore.store.results.StoreWriteError`
    naming the file) makes the unit ``failed``, not retried: the other units are still attempted."""
    record = dict(record)
    record.setdefault("fingerprint", unit.fingerprint)
    record["seconds"] = time.perf_counter() - started
    record["seconds_load"] = loaded - started
    record["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record["code_version"] = unit.code_version
    record["inputs"] = dict(unit.inputs)  # lets ``status`` say which input changed since
    record["run_id"] = run_id
    record["warnings"] = "\n".join(sorted({f"{w.category.__name__}: {w.message}" for w in caught}))
    try:
        store.write_unit(unit.fingerprint, record=record, per_unit=per_unit)
    except StoreWriteError as exc:
        return record_unit_failure(store, unit, exc, run_id=run_id, started=started)
    return UnitOutcome.done(unit, seconds=record["seconds"], worker_pid=os.getpid(), value=record.get("value"),
                            recall=record.get("recall"), rows=record.get("n_units"), bytes_read=bytes_read)


def record_unit_failure(store, unit, exc: BaseException, *, run_id, started: float) -> UnitOutcome:
    """Record ``exc`` as the unit's failure and return its ``failed`` outcome.

    Must be called from inside the ``except`` block (the traceback is the current exception's).
    Recording is best effort: a store that cannot take the failure file either (disk full) still
    gets the outcome back to the client, which reports it.
    """
    err = f"{type(exc).__name__}: {exc}"
    try:
        store.record_failure(unit.fingerprint, unit=dict(unit.describe(), run_id=run_id), error=err)
    except OSError:
        pass
    return UnitOutcome.failed(unit, err, traceback=traceback.format_exc(limit=5),
                              seconds=time.perf_counter() - started, worker_pid=os.getpid())


#: errnos of a destination that cannot take more bytes: recorded as the unit's failure, not retried.
_FULL_OR_READ_ONLY = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def run_probe_task(unit, bundle_root, run_id: str | None = None) -> UnitOutcome:
    """The Dask task for one probe-sweep unit (:attr:`UnitKind.PROBE`). Returns its
    :class:`~.outcome.UnitOutcome` like :func:`~.batch.run_batch` (``records``: the record fingerprints written).

    Runs :func:`~.probe_unit.run_probe_unit` inside ``distributed.worker_client()``: the task
    leaves the worker's thread pool while the sweep's (replicate, split) tasks run on the cluster,
    so metric units and other probe units proceed concurrently; the evaluation bundle goes under
    ``bundle_root`` and one record per (matrix, reduction) into the unit's store. The planned input
    fingerprints (``unit.inputs``) are used as they are: the view is not hashed again on the worker.
    Same failure policy as :func:`~.batch.run_batch`.
    """
    store = ResultsStore(unit.store_root)
    t0 = time.perf_counter()
    try:
        with worker_client() as client, dask.annotate(**{ANNOTATION: unit_annotation(unit, run_id)}):
            records, _ = run_probe_unit(unit.cache_root, unit.encoder, unit.view, unit.params, bundle_root=bundle_root,
                                        client=client, code_version=unit.code_version, inputs=unit.inputs)
    except DATA_ERRORS as exc:
        return record_unit_failure(store, unit, exc, run_id=run_id, started=t0)
    except OSError as exc:
        if exc.errno not in _FULL_OR_READ_ONLY:
            raise  # an I/O fault reading the cache: retried like any transient error
        err = StoreWriteError(exc.errno, f"cannot write the evaluation bundle under {bundle_root}: "
                                         f"{exc.strerror or exc}")
        try:
            raise err from exc
        except StoreWriteError:
            return record_unit_failure(store, unit, err, run_id=run_id, started=t0)
    try:
        written = write_probe_records(store, records, run_id=run_id)
        store.clear_failure(unit.fingerprint)  # success lives under per-record fingerprints
    except StoreWriteError as exc:
        return record_unit_failure(store, unit, exc, run_id=run_id, started=t0)
    return UnitOutcome.done(unit, records=tuple(written), seconds=time.perf_counter() - t0, worker_pid=os.getpid())
