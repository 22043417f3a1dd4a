"""An out-of-core unit (:attr:`~.plan.UnitKind.LARGE`, a scope of at least ``[neighbors]
large_scope_rows`` rows), driven from the client process with nothing per row held there.

Data flow (ADR-0019, issue 26):

1. :func:`large_scopes` (once per scratch key, under a cluster-wide lock): one worker task
   (:func:`scope_task`) checks the embeddings' alignment, reads the view, validates it as the
   metric API does and writes each scope's integer codes (``rows.npy``) and view rows
   (``sources.npy``) to the unit's scratch folder, while shard tasks (:func:`shards_task`) check the
   shards' checksums and values in parallel on the other workers; the driver gets back a
   :class:`~cachescore.neighbors.large_scope.ScopeRef` per scope (paths and counts).
2. The engine (:class:`~cachescore.neighbors.large_scope.LargeScopeSearch`) partitions and
   searches on the workers, which write the neighbour tables in scope order to scratch.
3. The family's out-of-core computation (:attr:`cachescore.metrics.families.Family.reduce`,
   :mod:`cachescore.metrics.large`) scores row ranges on the workers and gathers reductions; a
   worker assembles the per-unit table as one Parquet file, which the store takes as it is.
4. :func:`drive_large_unit` writes the record and hands the unit's kept score entry (its
   bootstrap interval, which reads the view and the per-unit table) to a worker.

So the driver's memory holds the scope summaries, the reductions and one float64 per unit while
a unit's lower-tail statistics are taken; ``[execution] large_unit_drivers`` bounds how many units
are driven at once (their tasks share the cluster), not memory.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import dask
import numpy as np
from distributed import Lock

from .._atomic import atomic_write_bytes
from .._futures import gather_or_cancel
from .._missing import as_float
from .._taskkeys import ANNOTATION, task_key
from .._warncapture import captured_warnings
from ..cache import Cache
from ..errors import DATA_ERRORS, UnscorableError
from ..manifest import prepare
from ..metrics import families
from ..metrics.large import OutOfCore
from ..neighbors.large_scope import read_refs, write_refs, write_scope
from ..neighbors.normalize import compute_dtype
from ..neighbors.registry import searcher_for
from ..results.scores import keep_entries
from ..store import ResultsStore
from .outcome import DONE, UnitOutcome
from .plan import params_json
from .unit import record_unit_failure, score_unit, unit_annotation, unit_scratch, write_unit_result

__all__ = ["scope_task", "shards_task", "shard_groups", "ShardChecks", "large_scopes", "search_companions", "expected_tables", "score_large_unit", "drive_large_unit",
           "large_record"]


#: Shard groups per worker that :func:`large_scopes` validates in parallel: several per worker, so
#: one slow group does not leave the others idle at the end, and short, so the partition's k-means
#: (submitted after them at a higher priority) waits for at most one group on a free worker (two
#: groups per worker at 1M were 2–2.5 s each, and the k-means started 2.5 s after the scopes).
VALIDATION_GROUPS_PER_WORKER = 8


def scope_task(cache_root: str, encoder: str, tileset: str, view: str, confounder_column: str, design: str,
               folder: str, *, contents: bool = True, marker: str = "scopes.json") -> None:
    """Worker task: validate the embeddings of ``encoder`` × ``tileset`` (streamed, shard by
    shard; with ``contents=False`` only their alignment and shard headers, the caller checking
    checksums and values with :func:`shards_task`), read ``view``, validate it for ``design`` as
    the metric API does (``ValueError`` / ``RuntimeError`` naming what is wrong) and write every
    scope's ``rows.npy`` / ``sources.npy`` under ``folder/scope-NNN`` and their summary as
    ``folder/<marker>`` (written last)."""
    cache = Cache(cache_root)
    cache.validate_embeddings(encoder, tileset, checksums=contents, finite=contents)
    manifest = cache.read_view(view)
    tile_rows = manifest["row"].to_numpy(dtype=np.int64)
    prepared = prepare(manifest, confounder_column=confounder_column, evaluation_design=design, validate_subsets=True)
    del manifest
    embeddings = cache.row_source(encoder, tileset)
    label = f"{encoder}/{view}"
    refs = {}
    for i, sc in enumerate(prepared.scopes):
        key = f"scope-{i:03d}"
        index = np.stack([tile_rows[sc.rows], sc.groups, sc.labels, sc.confounders], axis=1).astype(np.int64)
        whole = sc.n == tile_rows.size and np.array_equal(sc.rows, np.arange(sc.n))
        sub = Path(folder) / key
        sub.mkdir(parents=True, exist_ok=True)
        refs[key] = write_scope(sub, index, None if whole else sc.rows, embeddings=embeddings,
                                source=f"{label} scope {sc.subset!r}", name=sc.subset)
    write_refs(Path(folder) / marker, refs, dataset=prepared.dataset, design=prepared.design,
               dtype=compute_dtype(embeddings.meta().dtype).name)


def shards_task(cache_root: str, encoder: str, tileset: str, start: int, stop: int) -> int:
    """Worker task: check shards ``start:stop`` of ``encoder`` × ``tileset`` (sha256 and values,
    :meth:`cachescore.cache.Cache.validate_shards`; errors name the shard). Returns their rows."""
    return Cache(cache_root).validate_shards(encoder, tileset, start, stop)


def shard_groups(rows, parts: int) -> list[tuple[int, int]]:
    """``parts`` (at most one per shard, at least one) consecutive ranges ``(start, stop)`` of
    shard indices whose row totals are as even as consecutive ranges allow: the split points
    are the shards where the cumulative row count crosses each ``i / parts`` of the total.
    ``rows``: each shard's row count, in order."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return []
    parts = max(1, min(int(parts), rows.size))
    ends = np.cumsum(rows)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="left") + 1
    bounds = np.unique(np.concatenate([[0], np.clip(cuts, 1, rows.size - 1), [rows.size]]))
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


class ShardChecks:
    """The embedding shards' checks of one scratch folder (:func:`shards_task` futures), running
    beside the k-means and the partition. :meth:`wait` returns once every check passed, then
    writes the scopes' summary ``scopes.pending.json`` again as ``scopes.json`` (so a failed check
    is never skipped by a later run); it raises the first failure (its shard named), the others
    cancelled, and raises that same error again to every later caller. Thread-safe: the units of
    one scratch folder, driven side by side, share one object (:func:`large_scopes`)."""

    def __init__(self, client, futures: list, pending: Path, marker: Path):
        self.client, self.futures, self.pending, self.marker = client, list(futures), pending, marker
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def wait(self) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._done:
                return
            try:
                gather_or_cancel(self.client, self.futures)
                # a copy, not a rename: a unit that read the pending summary's path may still open it
                atomic_write_bytes(self.marker, self.pending.read_bytes())
            except BaseException as exc:
                self._error = exc
                raise
            else:
                self._done = True
                self.futures = []
            finally:  # settled: later units read scopes.json, or (after a failure) check again
                with _CHECKS_LOCK:
                    if _CHECKS.get(str(self.marker)) is self:
                        del _CHECKS[str(self.marker)]


#: The shard checks in flight in this process, by the ``scopes.json`` path they will write.
_CHECKS: dict[str, ShardChecks] = {}
_CHECKS_LOCK = threading.Lock()


def large_scopes(unit, client, scratch: Path) -> tuple[dict, dict, ShardChecks | None]:
    """``({key: ScopeRef}, {"dataset", "design", "dtype"}, checks)`` of a large unit's view,
    written once per scratch folder (units of one encoder and view share it): :func:`scope_task`
    reads the view and writes the scopes while :func:`shards_task` checks the embeddings' shards
    in groups (:data:`VALIDATION_GROUPS_PER_WORKER` per worker). This returns once the scopes are
    written (a scope task's failure raises, the checks cancelled); ``checks``
    (:class:`ShardChecks`, None when an earlier run's checks passed) must be waited for before a
    result is used: the engine does so before it marks a partition complete (its ``gate``), and
    :func:`score_large_unit` before it returns."""
    marker, pending = scratch / "scopes.json", scratch / "scopes.pending.json"
    with Lock(f"cachescore-large-{scratch}-scopes", scheduler_rpc=client.scheduler, loop=client.loop):
        with _CHECKS_LOCK:
            checks = _CHECKS.get(str(marker))
        if checks is None and not marker.is_file():
            args = (str(unit.cache_root), unit.encoder, unit.tileset)
            scope = client.submit(scope_task, *args, unit.view, unit.confounder_column, unit.design, str(scratch),
                                  contents=False, marker=pending.name, pure=False, priority=1,
                                  key=task_key("partition", "scopes"))
            shards = Cache(unit.cache_root).meta(unit.encoder, unit.tileset).shards
            parts = VALIDATION_GROUPS_PER_WORKER * max(1, len(client.scheduler_info().get("workers", {})))
            futures = [client.submit(shards_task, *args, a, b, pure=False, key=task_key("partition", "shards"))
                       for a, b in shard_groups([s.rows for s in shards], parts)]
            try:
                scope.result()
            except BaseException:  # the checks are not gathered here: they run on past this call
                client.cancel([scope, *futures])
                raise
            checks = ShardChecks(client, futures, pending, marker)
            with _CHECKS_LOCK:
                _CHECKS[str(marker)] = checks
    source = marker if checks is None or marker.is_file() else pending
    embeddings = Cache(unit.cache_root).row_source(unit.encoder, unit.tileset)
    info = json.loads(source.read_text())
    return read_refs(source, embeddings), {k: info[k] for k in ("dataset", "design", "dtype")}, checks


def large_record(unit, result, *, recall: float = float("nan")) -> dict:
    """The store record of an out-of-core unit's :class:`~cachescore.metrics.large.LargeResult`:
    the keys and types of :func:`~.unit.result_record`'s record (the per-unit table is a file)."""
    record = {
        "encoder": unit.encoder, "view": unit.view, "tileset": unit.tileset, "design": unit.design,
        "family": unit.metric, "metric": unit.metric, "params": params_json(unit.params),
        "backend": unit.params.get("backend", "exact"), "value": as_float(result.value), "std": as_float(result.std),
        "q_alpha": as_float(result.q_alpha), "ltm_alpha": as_float(result.ltm_alpha), "f0": float("nan"),
        "support": float("nan"), "k": None, "tau": float("nan"), "m": None, "recall": float(recall),
        "n_units": int(result.n_units), "n_defined": int(result.n_defined), "n_pairs": int(result.n_pairs),
        "fingerprint": unit.fingerprint,
    }
    record.update(result.fields)
    return record


def search_companions(unit, units) -> tuple:
    """The units of ``units`` (this one excluded) whose searches ``unit``'s engine may run with its
    own: out of core, the same scratch folder (inputs, design, confounder column, seed) and the
    same engine settings."""
    settings = ("engine", "backend", "recall_target", "recall_sample", "seed")
    mine = unit_scratch(unit), tuple(unit.params.get(k) for k in settings)
    return tuple(u for u in units if u is not unit and u.kind is unit.kind
                 and (unit_scratch(u), tuple(u.params.get(k) for k in settings)) == mine)


def expected_tables(units):
    """``expected(ref) -> [(kinds, k)]`` for :class:`~cachescore.neighbors.large_scope.LargeScopeSearch`:
    the tables the out-of-core computations of ``units`` will ask of a scope
    (:attr:`~cachescore.metrics.families.Family.tables`; a family without it asks for none here)."""

    def expected(ref) -> list:
        out = []
        for u in units:
            family = families.get(u.metric)
            if family.tables is not None:
                out.extend(family.tables(u.params, ref))
        return out

    return expected


def score_large_unit(unit, client, companions: tuple = ()):
    """Score an out-of-core unit: ``(record, per-unit table)`` where the table is a Parquet file's
    path (the family's :attr:`~cachescore.metrics.families.Family.reduce`), or a DataFrame for a
    family without one (registered at run time: it is computed by the metric API in this process,
    over the engine's memory-mapped tables, and holds the view here). ``companions``
    (:func:`search_companions`): units whose tables the engine searches with this unit's. Errors
    as :func:`~.unit.score_unit`."""
    scratch = unit_scratch(unit)
    refs, info, checks = large_scopes(unit, client, scratch)
    gate = None if checks is None else checks.wait
    try:  # every path waits for the checks: none is left in flight for a later run in this process
        searcher = searcher_for(unit.params, client=client, scopes=refs, scratch=scratch,
                                expected=expected_tables((unit, *companions)), gate=gate)
        out = _score_with(unit, searcher, refs, info, scratch)
    except BaseException:
        if gate is not None:
            gate()  # a shard that failed its check is the cause to report (its shard named)
        raise
    if gate is not None:
        gate()  # no result from rows whose checks have not passed
    return out


def _score_with(unit, searcher, refs: dict, info: dict, scratch: Path):
    """:func:`score_large_unit` once its scopes and engine are there."""
    family = families.get(unit.metric)
    if family.reduce is None:
        manifest = Cache(unit.cache_root).read_view(unit.view)
        features = np.zeros((len(manifest), 0), dtype=np.dtype(info["dtype"]))
        return score_unit(unit, features, manifest, searcher=searcher)
    ctx = OutOfCore(engine=searcher, scopes=list(refs.values()), dataset=info["dataset"], design=info["design"],
                    folder=scratch / "units" / unit.fingerprint)
    try:
        result = family.reduce(unit.params, ctx)
    except RuntimeError as exc:
        if type(exc) is not RuntimeError:
            raise
        raise UnscorableError(f"{unit.label}: {exc}") from exc
    record = large_record(unit, result, recall=searcher.recall if unit.params.get("backend") == "ann" else float("nan"))
    if searcher.details:
        record["neighbour_search"] = searcher.details
    return record, result.per_unit


def _keep_entry(store_root: str, cache_root: str, fingerprint: str, tables: dict) -> int:
    """Worker task: compute and keep the stored unit's score entry (its interval reads the view's
    ``group_id``, label and confounder, :meth:`cachescore.cache.Cache.view_columns`, and the
    per-unit table; :func:`cachescore.results.scores.keep_entries`)."""
    store, cache = ResultsStore(store_root), Cache(cache_root, mode="r")
    record = store.record(fingerprint) or {}
    view = record.get("view")
    frame = None
    if view is not None:  # the columns the interval reads, not the joined view (millions of rows)
        frame = cache.view_columns(view, ["group_id", "label", cache.view_spec(view).confounder_column])
    return keep_entries(store, cache, [fingerprint], bootstrap=tables.get("bootstrap"),
                        min_support=float(tables.get("min_support", 0.5)), view_frame=frame)


def drive_large_unit(unit, client, run_id: str | None = None, retries: int = 0, tables: dict | None = None,
                     companions: tuple = ()) -> UnitOutcome:
    """Score a unit planned out of core from the calling process, normally the client's
    (:func:`~.execute.execute_plan` runs several on threads); every per-row step runs on
    ``client``'s workers (module docstring). Returns the unit's :class:`~.outcome.UnitOutcome`
    (``worker_pid`` is this process). Never raises: a data error is recorded as the unit's
    failure at once; any other exception (a lost worker, a cancelled task) is retried
    ``retries`` times (completed scratch artefacts are reused), then recorded as the failure.
    ``tables`` (the job's ``{"bootstrap", "min_support"}``): the stored unit's score entry is
    computed on a worker and kept (best effort: the publication computes what is not kept).
    ``companions``: as :func:`score_large_unit`.
    """
    store = ResultsStore(unit.store_root)
    t0 = time.perf_counter()
    for attempt in range(retries + 1):
        try:
            with captured_warnings() as caught, dask.annotate(**{ANNOTATION: unit_annotation(unit, run_id)}):
                record, per_unit = score_large_unit(unit, client, companions)
            break
        except DATA_ERRORS as exc:
            return record_unit_failure(store, unit, exc, run_id=run_id, started=t0)
        except Exception as exc:  # noqa: BLE001 - recorded, the other units go on (a cancelled task too)
            if attempt == retries:
                return record_unit_failure(store, unit, exc, run_id=run_id, started=t0)
    outcome = write_unit_result(store, unit, record, per_unit, started=t0, loaded=t0, caught=caught, run_id=run_id)
    if tables is not None and outcome.status == DONE:
        try:
            with dask.annotate(**{ANNOTATION: unit_annotation(unit, run_id)}):
                client.submit(_keep_entry, str(unit.store_root), str(unit.cache_root), unit.fingerprint, tables,
                              pure=False, key=task_key("reduce", "entry")).result()
        except Exception:  # noqa: BLE001 - an optimisation: the publication computes what is not kept
            pass
    return outcome
