"""A PathoROB probe sweep as one work unit of a cache job (encoder × view × ``[probe]`` params).

The parameters (:class:`cachescore.probe.params.ProbeParams`) and the view-to-arrays adaptor
(:func:`cachescore.probe.views.select_probe_rows`) live in :mod:`cachescore.probe`; this module
fingerprints a unit and runs it:

* :func:`run_probe_unit` -- read the view and only the embedding rows the sweep uses from the
  cache, run :func:`cachescore.probe.evaluate.evaluate_sweep` (``client`` fans replicates out),
  write the evaluation bundle atomically at ``<bundle_root>/<encoder>/<view>/<fingerprint>`` and
  return one results-store record per (matrix, reduction) -- ``apd`` and ``nipd`` of the
  in-domain matrix and of every test set;
* :func:`run_probe_and_store` -- a library entry point for one (encoder, view) outside a job:
  skip a unit whose records are all in the results store, else run it and write its records, or
  record its data error as the failure of each of its record fingerprints. (``cachescore run``
  goes through :func:`cachescore.pipeline.unit.run_probe_task` instead, which honours the
  planner's pinned code version and input fingerprints.)

Fingerprints (:func:`probe_unit_fingerprint`) are the sha256 of canonical JSON over the input
fingerprints (embeddings of (encoder, tileset), the view), the normalised parameters and the
code version (:func:`cachescore.fingerprint.code_version` ``("probe")``: the package version plus a
digest of ``probe/`` and this file). The sweep's result does not depend on the number of workers,
so the client is not part of it. Record fingerprints are derived from the unit fingerprint
(:func:`probe_record_fingerprint`), so a planner can tell with :func:`probe_unit_done` whether a
unit is complete in the store without running anything.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .._version import package_versions
from ..errors import DATA_ERRORS
from ..fingerprint import fingerprint
from ..metrics import families
from ..probe.bundle import BundleError, read_bundle, write_bundle
from ..probe.evaluate import evaluate_sweep, role_kind
from ..probe.params import ProbeParams
from ..probe.views import ProbeSelection, select_probe_rows
from ..store import ResultsStore
from .outcome import DONE, FAILED, SKIPPED, UnitOutcome
from .probe_identity import (
    _cache,
    _unit_identity,
    probe_record_fingerprint,
    probe_record_keys,
    probe_unit_done,
    probe_unit_fingerprint,
)

#: Distributions whose versions a probe record stores.
_RECORD_DISTRIBUTIONS = ("cachescore", "numpy", "scikit-learn", "scipy", "pandas", "dask", "distributed", "pyarrow")

__all__ = [
    "probe_record_fingerprint",
    "probe_record_keys",
    "probe_unit_done",
    "probe_unit_fingerprint",
    "run_probe_and_store",
    "run_probe_unit",
    "write_probe_records",
]

# ---------------------------------------------------------------------------------------------
# the unit


def _records(evaluation, *, identity: dict, unit_fp: str, params: ProbeParams, bundle: Path,
             seconds: float, reused: bool, selection: ProbeSelection) -> list[dict]:
    records = []
    for name, matrix in evaluation.matrices.items():
        for metric in families.names(families.PROBE):
            v = getattr(evaluation, families.get(metric).evaluation_field).get(name)
            records.append({
                "fingerprint": probe_record_fingerprint(unit_fp, name, metric),
                "encoder": identity["encoder"], "view": identity["view"], "tileset": identity["tileset"],
                "scope": name, "design": "probe", "family": "probe", "metric": metric,
                "params": params.to_dict(),
                "value": math.nan if v is None else float(v),
                "n_units": int(matrix.size), "n_defined": int(np.isfinite(matrix).sum()),
                "code_version": identity["code"], "seconds": float(seconds),
                "unit_fingerprint": unit_fp, "role_kind": role_kind(name), "bundle": str(bundle),
                "matrix": np.asarray(matrix, dtype=np.float64).tolist(),
                "replicate_seeds": [int(s) for s in evaluation.replicate_seeds],
                "split_plan_sha256": evaluation.plan_sha256,
                "leakage_passed": bool(evaluation.leakage["passed"]),
                "reused_bundle": bool(reused),
                "n_rows": int(selection.id_rows.size if name == "in_domain" else selection.test_rows[name].size),
                "warnings": "\n".join(evaluation.warnings),
            })
    return records


def run_probe_unit(cache_root, encoder: str, view: str, params: ProbeParams | Mapping, *, bundle_root,
                   client=None, code_version: str | None = None, inputs: Mapping | None = None) -> tuple[list[dict], Path]:
    """Run one probe-sweep unit: read the cache, evaluate the sweep, write the bundle, make records.

    Parameters
    ----------
    cache_root : cache folder (or a :class:`~cachescore.cache.Cache`).
    encoder, view : names in the cache; the embeddings are those of (encoder, the view's tileset).
    params : ProbeParams (or a mapping of its keys).
    bundle_root : folder under which the bundle goes, at ``<bundle_root>/<encoder>/<view>/<fp>``
        (``fp`` = :func:`probe_unit_fingerprint`; folders are created).
    client : distributed.Client, optional
        Passed to ``evaluate_sweep``: one task per (replicate, split). Call this function from the
        client process (it submits its own tasks), not from inside a task.
    code_version : overrides :func:`cachescore.fingerprint.code_version` ``("probe")`` in the fingerprint.
    inputs : the planned input fingerprints (``{"embeddings", "view"}``, :func:`probe_unit_fingerprint`);
        when given, the view and embeddings are not hashed again here.

    Returns
    -------
    (records, bundle_path)
        ``records``: one dict per (matrix, reduction) in :func:`probe_record_keys` order, ready
        for ``ResultsStore.write_unit(record["fingerprint"], record=record)`` (or
        :func:`write_probe_records`). Columns: ``encoder, view, tileset, scope`` (= matrix name:
        ``in_domain`` or a test set), ``design = family = "probe"``, ``metric`` (``apd`` |
        ``nipd``), ``params``, ``value`` (NaN when the reduction is undefined), ``n_units``
        (probes), ``n_defined``, ``code_version``, ``seconds``, ``fingerprint``; extras:
        ``unit_fingerprint, role_kind, bundle, matrix`` (n_splits × iterations, lists),
        ``replicate_seeds, split_plan_sha256, leakage_passed, reused_bundle, n_rows, warnings``.

    A complete bundle already at the target path (checksums verified) is reused: nothing is
    fitted and the records are rebuilt from it (``reused_bundle`` True). An incomplete or
    tampered one is replaced.

    Raises
    ------
    ProbeParamsError, cachescore.cache errors, LeakageError, ValueError
        Invalid params or view (see :func:`select_probe_rows`); missing / corrupt / non-finite
        embeddings; a failing leakage audit (raised before any probe is fitted); the sweep's own
        validation (cells too small for the schedule, ...). All are ``ValueError`` subclasses
        (or ``FileNotFoundError``): data errors for the pipeline.
    """
    t0 = time.perf_counter()
    params = ProbeParams.coerce(params)
    cache = _cache(cache_root)
    identity = _unit_identity(cache, encoder, view, params, code_version, inputs)
    unit_fp = fingerprint(identity)
    path = Path(bundle_root) / encoder / view / unit_fp
    frame = cache.read_view(view)
    selection = select_probe_rows(frame, params, source=f"view {view!r} ({cache.root})")

    evaluation = _reusable_bundle(path)
    reused = evaluation is not None
    if evaluation is None:
        evaluation = _evaluate_and_bundle(cache, encoder, frame, selection, params, identity, unit_fp, path,
                                          client=client)
    seconds = time.perf_counter() - t0
    records = _records(evaluation, identity=identity, unit_fp=unit_fp, params=params, bundle=path,
                       seconds=seconds, reused=reused, selection=selection)
    return records, path


def _reusable_bundle(path: Path):
    """The evaluation of the complete bundle at ``path`` (checksums verified), or None when there
    is none or it is incomplete or tampered (it is then replaced)."""
    if not path.exists():
        return None
    try:
        return read_bundle(path)
    except (BundleError, OSError, KeyError, ValueError):  # a damaged bundle is recomputed, not an error
        return None


def _evaluate_and_bundle(cache, encoder: str, frame, selection, params: ProbeParams, identity: dict, unit_fp: str,
                         path: Path, *, client):
    """Read the selected rows, evaluate the sweep (on ``client`` when given) and write its bundle
    at ``path`` with the unit's provenance; returns the evaluation."""
    tileset = identity["tileset"]
    cache.validate_embeddings(encoder, tileset)
    tile_rows = frame["row"].to_numpy(dtype=np.int64)[selection.needed_rows]
    inputs = selection.gather_block(cache.load_rows(encoder, tileset, tile_rows))
    evaluation = evaluate_sweep(inputs.embeddings, inputs.confounders, inputs.labels, client=client,
                                **inputs.evaluate_kwargs(params))
    provenance = {
        "unit_fingerprint": unit_fp, **{k: identity[k] for k in ("kind", "encoder", "view", "tileset", "inputs")},
        "code_version": identity["code"], "cache_root": str(cache.root), "params": params.to_dict(),
        "confounder_column": selection.confounder_column,
        "confounder_names": list(selection.confounder_names), "class_names": list(selection.class_names),
        "rows": {"in_domain": int(selection.id_rows.size),
                 **{n: int(r.size) for n, r in selection.test_rows.items()}, "ignored": selection.n_ignored},
        "versions": package_versions(_RECORD_DISTRIBUTIONS),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bundle(evaluation, path, provenance=provenance, overwrite=path.exists(), encoder_id=encoder,
                 cache_fingerprint=fingerprint(identity["inputs"]))
    return evaluation


def write_probe_records(store, records: Sequence[dict], *, run_id: str | None = None) -> list[str]:
    """Write each record with ``store.write_unit`` under its own fingerprint; return the fingerprints.
    ``run_id`` (optional) is stored in every record."""
    out = []
    for rec in records:
        rec = dict(rec, run_id=run_id) if run_id is not None else rec
        store.write_unit(rec["fingerprint"], record=rec)
        out.append(rec["fingerprint"])
    return out


def run_probe_and_store(cache_root, store, encoder: str, view: str, params: ProbeParams | Mapping, *,
                        bundle_root, client=None, run_id: str | None = None, force: bool = False) -> UnitOutcome:
    """The pipeline's entry point for one probe unit: skip, run and store, or record the failure.

    ``store`` is a :class:`~cachescore.store.ResultsStore` (or its folder). When every record of
    the unit is already stored (:func:`probe_unit_done`) and not ``force``, nothing runs. A data
    error (``ValueError``, ``LookupError``, ``FileNotFoundError``, ``RuntimeError``, ... as
    :data:`cachescore.errors.DATA_ERRORS`: bad params or view, leakage, a cell too small
    for the schedule, corrupt embeddings) is recorded as the failure of every record
    fingerprint of the unit (so a later success supersedes it) and returned, not raised.

    Returns the unit's :class:`~.outcome.UnitOutcome`: ``status`` done | skipped | failed,
    ``records`` the record fingerprints, ``bundle`` the bundle's path (done only), ``error``.
    """
    t0 = time.perf_counter()
    store = store if isinstance(store, ResultsStore) else ResultsStore(store)
    params = ProbeParams.coerce(params)
    unit_fp = probe_unit_fingerprint(cache_root, encoder, view, params)
    record_fps = [probe_record_fingerprint(unit_fp, m, r) for m, r in probe_record_keys(params)]
    label = f"{encoder}/{view}/probe"
    ident = {"fingerprint": unit_fp, "label": label, "records": tuple(record_fps)}
    if not force and probe_unit_done(store, unit_fp, params):
        return UnitOutcome(**ident, status=SKIPPED, seconds=time.perf_counter() - t0)
    try:
        records, path = run_probe_unit(cache_root, encoder, view, params, bundle_root=bundle_root, client=client)
    except DATA_ERRORS as exc:
        err = f"{type(exc).__name__}: {exc}"
        for (matrix, metric), fp in zip(probe_record_keys(params), record_fps):
            store.record_failure(fp, unit={"encoder": encoder, "view": view, "scope": matrix, "design": "probe",
                                           "family": "probe", "metric": metric, "params": params.to_dict(),
                                           "unit_fingerprint": unit_fp, "run_id": run_id}, error=err)
        return UnitOutcome(**ident, status=FAILED, error=err, seconds=time.perf_counter() - t0)
    write_probe_records(store, records, run_id=run_id)
    return UnitOutcome(**ident, status=DONE, bundle=str(path), seconds=time.perf_counter() - t0)
