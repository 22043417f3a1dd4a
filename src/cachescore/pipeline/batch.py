"""Metric units that share their inputs run as one task: load once, search once, store each.

The metric units of one (encoder, view) — RI, MaRI and CRoMa at every parameter set the job asks
for — read the same embeddings and the same view, and RI and MaRI ask the exact engine for the
same cross-group neighbour tables. :func:`batch_units` groups a plan's pending
:attr:`~.plan.UnitKind.SCORE` units into :class:`ScoreBatch` es by what they read (cache, encoder,
tileset, view; same store), and :func:`run_batch` is the one Dask task of a batch: it validates
and reads the inputs once on the worker, scores each unit through one
:class:`~cachescore.neighbors.shared.SharedSearch` per exact engine (each cross-group search
once), and ends every unit on its own (:func:`~.unit.write_unit_result` /
:func:`~.unit.record_unit_failure`). Each unit keeps its fingerprint, record, failure and status;
the client hears of the whole batch in one result and tells the run board in one call.

Failure policy, per unit as for a lone unit (:mod:`.unit`): a data error is recorded as that
unit's failure and the others go on. Any other exception (a bug, out of memory) is held until the
batch's other units are stored, then raised as :class:`BatchErrors` (each unit's own message), so
Dask retries the task; a retry skips the units this run already stored, and when retries run out
the client records only the units with nothing stored as failed, each with its own error.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from .._threads import single_thread_blas
from .._warncapture import captured_warnings
from ..cache import Cache
from ..errors import DATA_ERRORS
from ..neighbors.registry import searcher_for
from ..neighbors.shared import SharedSearch, shareable
from ..results.scores import keep_entries
from ..store import ResultsStore
from .outcome import DONE, UnitOutcome
from .plan import UnitKind
from .unit import load_unit_inputs, record_unit_failure, score_unit, write_unit_result

__all__ = ["ScoreBatch", "BatchErrors", "batch_units", "run_batch", "run_unit", "stored_by_run"]


@dataclass(frozen=True)
class ScoreBatch:
    """Metric units (:attr:`~.plan.UnitKind.SCORE`) that read the same inputs: one cache, encoder,
    tileset and view, one store. Plain data (it travels in the task graph). ``units`` is never empty."""

    units: tuple

    @property
    def first(self):
        return self.units[0]

    @property
    def encoder(self) -> str:
        return self.first.encoder

    @property
    def view(self) -> str:
        return self.first.view

    @property
    def metric(self) -> str:
        """The units' metric families, ``+``-joined in unit order (``ri+mari+croma``): the last
        word of the batch's task key prefix."""
        return "+".join(dict.fromkeys(u.metric for u in self.units))

    @property
    def fingerprint(self) -> str:
        """sha256 of the units' fingerprints in order (names the task; nothing is stored under it)."""
        return hashlib.sha256("\n".join(u.fingerprint for u in self.units).encode()).hexdigest()

    @property
    def fingerprints(self) -> tuple:
        return tuple(u.fingerprint for u in self.units)


def _inputs_key(unit) -> tuple:
    return (str(unit.cache_root), str(unit.store_root), unit.encoder, unit.tileset, unit.view)


def batch_units(units) -> list[ScoreBatch]:
    """Group ``units`` (all of kind ``SCORE``) into batches by the inputs they read (cache,
    encoder, tileset, view; store), in order of first appearance, units in their given order.
    Raises ``ValueError`` for a unit of another kind."""
    groups: dict = {}
    for u in units:
        if u.kind is not UnitKind.SCORE:
            raise ValueError(f"{u.label}: only metric units are batched, not a {u.kind.value} unit")
        groups.setdefault(_inputs_key(u), []).append(u)
    return [ScoreBatch(tuple(g)) for g in groups.values()]


class BatchErrors(RuntimeError):
    """Units of one batch raised exceptions that are not data errors (see the module docstring).
    ``errors`` maps each such unit's fingerprint to ``"<ExceptionType>: <message>"``."""

    def __init__(self, errors: dict, labels: dict):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{labels[fp]}: {err}" for fp, err in self.errors.items()))

    def __reduce__(self):  # travels from the worker to the client
        return _rebuild_batch_errors, (self.errors, str(self))


def _rebuild_batch_errors(errors: dict, message: str) -> "BatchErrors":
    exc = BatchErrors.__new__(BatchErrors)
    exc.errors = dict(errors)
    RuntimeError.__init__(exc, message)
    return exc


def stored_by_run(store, unit, run_id) -> UnitOutcome | None:
    """The outcome of ``unit`` if run ``run_id`` stored it (an earlier try of the same task), else
    None (also when the record cannot be read)."""
    if run_id is None:
        return None
    try:
        rec = store.record(unit.fingerprint)
    except Exception:  # noqa: BLE001 - unreadable: not known to be stored, so it is (re)computed
        return None
    if rec is None or rec.get("run_id") != run_id:
        return None
    return UnitOutcome.done(unit, seconds=rec.get("seconds"), value=rec.get("value"), recall=rec.get("recall"),
                            rows=rec.get("n_units"))


class _Engines:
    """The engines of one batch: one shared exact engine (:func:`~cachescore.neighbors.shared.shareable`
    units), a fresh one per unit otherwise."""

    def __init__(self):
        self._shared = None

    def for_unit(self, unit):
        if not shareable(unit.params):
            return searcher_for(unit.params)
        if self._shared is None:
            self._shared = SharedSearch(searcher_for(unit.params))
        return self._shared


def run_batch(batch: ScoreBatch, run_id: str | None = None, tables: dict | None = None) -> tuple[UnitOutcome, ...]:
    """The Dask task of a :class:`ScoreBatch`: one :class:`~.outcome.UnitOutcome` per unit, in order.

    Reads the inputs once (:func:`~.unit.load_unit_inputs`, on the worker; a data error there is
    every unit's failure), scores each unit (:func:`~.unit.score_unit`, BLAS pinned to one thread,
    warnings captured per unit) and stores it at once (atomic, so a worker lost midway loses only
    the unit it was computing). Timings: the shared load is counted on the batch's first unit
    (``seconds_load``, and in its ``seconds``; the other units' ``seconds_load`` is 0, so the units'
    ``seconds`` add up to the task's wall time), as are the embedding bytes read. ``tables``
    (``{"bootstrap": {...}, "min_support": x}``, the job's): the stored units' score entries are
    computed here too and kept in the store (:func:`cachescore.results.scores.keep_entries`; best
    effort: what is not kept, the publication computes). Raises
    :class:`BatchErrors` after the other units are stored when a unit raised something that is not
    a data error; ``ValueError`` for a unit that is not a metric unit.
    """
    _require_metric_units(batch)
    store = ResultsStore(batch.first.store_root)
    t0 = time.perf_counter()
    with single_thread_blas():
        with captured_warnings() as load_warnings:
            try:
                features, manifest = load_unit_inputs(batch.first)
            except DATA_ERRORS as exc:
                return tuple(record_unit_failure(store, u, exc, run_id=run_id, started=t0) for u in batch.units)
        outcomes, errors, stored = _score_all(store, batch, features, manifest, run_id=run_id, started=t0,
                                              loaded=time.perf_counter(), load_warnings=load_warnings)
        if tables is not None:
            _keep_entries(store, batch, {o.fingerprint: stored.get(o.fingerprint) for o in outcomes
                                         if o.status == DONE}, manifest, tables)
    if errors:
        raise BatchErrors(errors, {u.fingerprint: u.label for u in batch.units})
    return tuple(outcomes)


def _require_metric_units(batch: ScoreBatch) -> None:
    for u in batch.units:
        if u.kind is not UnitKind.SCORE:
            raise ValueError(f"{u.label}: a {u.kind.value} unit is not run as a metric task (a large-scope unit "
                             "is driven from the client by drive_large_unit; a probe unit runs as run_probe_task)")


def _score_all(store, batch: ScoreBatch, features, manifest, *, run_id, started: float, loaded: float,
               load_warnings) -> tuple[list, dict, dict]:
    """Every unit of the batch scored and stored in order (the shared load counted on the first):
    ``(outcomes, errors, per-unit tables)`` (see :func:`_score_one`)."""
    outcomes, errors, engines, stored = [], {}, _Engines(), {}
    for i, unit in enumerate(batch.units):
        begun = started if i == 0 else time.perf_counter()
        outcome = stored_by_run(store, unit, run_id) or _score_one(
            store, unit, features, manifest, engines, run_id=run_id, started=begun,
            loaded=loaded if i == 0 else begun, warnings_before=load_warnings if i == 0 else (),
            bytes_read=int(features.nbytes) if i == 0 else 0, errors=errors, stored=stored)
        if outcome is not None:
            outcomes.append(outcome)
    return outcomes, errors, stored


def _keep_entries(store, batch: ScoreBatch, per_units: dict, manifest, tables: dict) -> None:
    """The stored units' score entries (``per_units``: fingerprint -> per-unit table, or None for
    a unit an earlier try stored), kept for the publication (best effort: never a unit's failure)."""
    if not per_units:
        return
    try:
        keep_entries(store, Cache(batch.first.cache_root, mode="r"), list(per_units), bootstrap=tables.get("bootstrap"),
                     min_support=float(tables.get("min_support", 0.5)), view_frame=manifest,
                     per_units={fp: t for fp, t in per_units.items() if t is not None})
    except Exception:  # noqa: BLE001 - an optimisation: the publication computes what is not kept
        pass


def _score_one(store, unit, features, manifest, engines: _Engines, *, run_id, started: float, loaded: float,
               warnings_before, bytes_read: int, errors: dict, stored: dict) -> UnitOutcome | None:
    """Score and store one unit of a batch (its per-unit table goes to ``stored[fingerprint]``);
    None (and ``errors[fingerprint]``) when it raised something that is not a data error."""
    with captured_warnings() as caught:
        try:
            record, per_unit = score_unit(unit, features, manifest, searcher=engines.for_unit(unit))
        except DATA_ERRORS as exc:
            return record_unit_failure(store, unit, exc, run_id=run_id, started=started)
        except Exception as exc:  # noqa: BLE001 - raised for the batch once the others are stored
            errors[unit.fingerprint] = f"{type(exc).__name__}: {exc}"
            return None
    stored[unit.fingerprint] = per_unit
    return write_unit_result(store, unit, record, per_unit, started=started, loaded=loaded,
                             caught=[*warnings_before, *caught], run_id=run_id, bytes_read=bytes_read)


def run_unit(unit, run_id: str | None = None) -> UnitOutcome:
    """Run one metric unit as a batch of its own (:func:`run_batch`); its outcome. Raises as
    :func:`run_batch` (a unit's non-data exception as itself is :class:`BatchErrors`)."""
    return run_batch(ScoreBatch((unit,)), run_id)[0]
