"""Planning: turn a job into fingerprinted work units and skip those already in the store.

A **work unit** is one encoder × view × design (the scope family: the whole view under ``all``,
one scope per complete 2×2 subset under ``paired_2x2``) × metric family (× ``m`` for CRoMa).
Its fingerprint is the sha256 of canonical JSON over

* the inputs: the embedding fingerprint of (encoder, tileset) and the view fingerprint
  (:meth:`Cache.embedding_fingerprint`, :meth:`Cache.view_fingerprint`: content hashes);
* the parameters: metric parameters, design, confounder column and the *resolved* neighbour
  backend (``auto`` is decided here from the largest scope's n²·d, so changing the threshold
  only invalidates units whose backend actually changes);
* the code version: ``cachescore.__version__`` plus a path-independent digest of the scoring
  sources (:func:`cachescore.fingerprint.code_version`), so edited scoring code never reuses stale
  numbers (``CACHESCORE_CODE_VERSION`` pins it).

A unit whose fingerprint the store already holds is *done* and is not executed. A unit that cannot
even be planned (missing embeddings for the view's tileset, an unreadable view, a view scope with a
single confounder value or a single label, :func:`undefined_scope`) is *invalid*: it is recorded
as a failure with its error, the rest of the job goes on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

import pandas as pd


from .._jsonsafe import json_default
from ..cache import Cache
from ..fingerprint import code_version, fingerprint
from ..jobs.schema import Job
from ..jobs.sections import as_dict
from ..metrics import families
from ..metrics.scope_counts import frame_combinations, scopes_from_combinations
from ..neighbors.registry import engine_params, is_out_of_core
from ..store import ResultsStore
from .probe_identity import probe_record_fingerprint, probe_record_keys, probe_unit_done, probe_unit_fingerprint

__all__ = ["empty_plan_hint", "undefined_scope", "UnitKind", "WorkUnit", "InvalidUnit", "Plan", "plan_job", "code_version", "unit_fingerprint"]

def _fingerprint(obj) -> str:
    return fingerprint(obj)


class UnitKind(Enum):
    """What a work unit is, hence how it runs (dispatched in one place:
    :func:`cachescore.pipeline.execute.execute_plan`)."""

    #: RI / MaRI / CRoMa of a view whose scopes fit in memory: one Dask task on a worker.
    SCORE = "score"
    #: RI / MaRI / CRoMa of a view with a large scope: driven from the client process, its
    #: searches fanned out as bounded tasks (ADR-0007).
    LARGE = "large"
    #: A probe sweep (APD / nIPD): one task that fans its replicates out as further tasks.
    PROBE = "probe"


@dataclass(frozen=True)
class WorkUnit:
    """One scheduled computation. Plain data: it travels in the task graph instead of arrays.

    ``params`` holds the metric parameters (``k_candidates``/``tau``/``warn_tau`` for RI/MaRI,
    ``m``/``alpha``/``start_k``/``k_growth_factor`` for CRoMa) and the resolved neighbour settings
    (``backend`` = ``"exact"`` | ``"ann"``; for ANN also ``recall_target``, ``recall_sample``, ``seed``).
    """

    encoder: str
    view: str
    tileset: str
    design: str
    metric: str
    confounder_column: str
    params: dict
    cache_root: str
    store_root: str
    inputs: dict
    code_version: str
    fingerprint: str

    @property
    def kind(self) -> UnitKind:
        """:class:`UnitKind` of the unit, derived from its planned ``metric`` and ``params``."""
        if self.metric == "probe":
            return UnitKind.PROBE
        return UnitKind.LARGE if is_out_of_core(self.params) else UnitKind.SCORE

    @property
    def label(self) -> str:
        """Short display name: ``encoder/view/design/metric[m=…]`` (probe units: ``encoder/view/probe``)."""
        if self.kind is UnitKind.PROBE:
            return f"{self.encoder}/{self.view}/probe"
        return f"{self.encoder}/{self.view}/{self.design}/{families.get(self.metric).tag(self.params)}"

    def describe(self) -> dict:
        """JSON-safe identity of the unit (what a failure record and the provenance store)."""
        return {
            "encoder": self.encoder,
            "view": self.view,
            "tileset": self.tileset,
            "design": self.design,
            "family": self.metric,
            "metric": self.metric,
            "confounder_column": self.confounder_column,
            "params": dict(self.params),
            "inputs": dict(self.inputs),
            "code_version": self.code_version,
            "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class InvalidUnit:
    """A unit that could not be planned; it is recorded as failed without running."""

    unit: dict
    fingerprint: str
    error: str

    @property
    def label(self) -> str:
        u = self.unit
        if u.get("metric") == "probe":  # as WorkUnit.label names probe units
            return f"{u['encoder']}/{u['view']}/probe"
        return f"{u['encoder']}/{u['view']}/{u.get('design', '?')}/{u['metric']}"


@dataclass(frozen=True)
class Plan:
    """Every unit of a job, split into ``pending`` (to execute), ``done`` (in the store) and
    ``invalid`` (failed at planning). ``inputs`` maps ``"embeddings/<enc>/<tileset>"`` and
    ``"views/<view>"`` to their content fingerprints (or an ``"error: …"`` text)."""

    job: Job
    pending: tuple[WorkUnit, ...]
    done: tuple[WorkUnit, ...]
    invalid: tuple[InvalidUnit, ...]
    inputs: dict = field(default_factory=dict)

    @property
    def units(self) -> tuple[WorkUnit, ...]:
        return self.pending + self.done

    def record_fingerprints(self) -> list[str]:
        """Store keys of every record of the plan's units, in unit order (a probe unit has one per
        matrix × reduction, :func:`~.probe_unit.probe_record_keys`)."""
        out: list[str] = []
        for u in self.units:
            if u.kind is UnitKind.PROBE:
                out.extend(probe_record_fingerprint(u.fingerprint, m, r) for m, r in probe_record_keys(u.params))
            else:
                out.append(u.fingerprint)
        return out


def unit_fingerprint(*, encoder, view, design, metric, confounder_column, params, inputs, code) -> str:
    """The work-unit fingerprint (sha256 hex of canonical JSON, see module docstring)."""
    return _fingerprint({
        "kind": "cachescore.score-unit/1",
        "encoder": encoder,
        "view": view,
        "design": design,
        "metric": metric,
        "confounder_column": confounder_column,
        "params": params,
        "inputs": inputs,
        "code": code,
    })


def _metric_params(job: Job) -> list[tuple[str, dict]]:
    """``[(family, unit parameters)]``: one entry per work unit of each requested family (in the
    job's order), expanded from its validated ``[metrics.<family>]`` section."""
    return [(name, params) for name in job.metrics.families
            for params in families.get(name).units(job.metrics.family(name))]


def _scope_columns(confounder: str, design: str) -> list[str] | None:
    """The columns planning reads of a view: ``label``, the confounder, ``group_id`` (and
    ``subset`` when paired); None when the confounder is one of the others (no lean reading)."""
    columns = ["label", confounder, "group_id"] + (["subset"] if design == "paired_2x2" else [])
    return columns if len(set(columns)) == len(columns) else None


def _lean_scopes(cache, view: str, confounder: str, design: str):
    """The view's scopes as combination counts read without building the view
    (:meth:`cachescore.cache.Cache.view_combinations`: one batch of rows at a time, so a view of
    millions of rows is planned in memory that grows with its slides, not its rows); None when
    its table cannot be read that way (a column taken from the tileset, a column of another
    type): the caller reads the view.

    Used for views of at least ``[neighbors] large_scope_rows`` rows only: the joined frame's
    own checks (sample ids known to the tileset, no blank values) then run on a worker, in the
    unit's scope task (:func:`cachescore.pipeline.large_unit.scope_task`), and fail the unit
    with the same message; smaller views are read whole and refused at planning."""
    columns = _scope_columns(confounder, design)
    found = None if columns is None else cache.view_combinations(view, columns, strip=("label", confounder, "subset"))
    if found is None:
        return None
    return scopes_from_combinations(*found, subset=design == "paired_2x2")


def _frame_scopes(frame, confounder: str, design: str):
    """The scopes of a view frame read whole (what :func:`_lean_scopes` gives of its table)."""
    if confounder not in frame.columns or "label" not in frame.columns or "group_id" not in frame.columns:
        return []  # left to the metric's own validation
    paired = design == "paired_2x2" and "subset" in frame.columns
    columns = ["label", confounder, "group_id"] + (["subset"] if paired else [])
    return scopes_from_combinations(*frame_combinations(frame, columns, strip=("label", confounder, "subset")),
                                    subset=paired)


def _scope_rows(scopes) -> int:
    """Rows of the largest scope (0 for an empty view)."""
    return max((part.n_rows for _, part in scopes), default=0)


def undefined_scope(scopes, confounder: str, view: str) -> str | None:
    """Why RI / MaRI / CRoMa cannot give a defined score on this view, or None.

    ``scopes``: ``[(name, ScopeCounts)]`` (:mod:`cachescore.metrics.scope_counts`). A scope (the
    whole view under ``all``, each subset under ``paired_2x2``) with a single value of the
    confounder column has no OS neighbour (croma stores RI = 0.0 and fails CRoMa); one with a
    single label has no SO neighbour (RI = 1.0). The message names the view, the scope, the
    column and the value. An empty view is left to the metric's own validation.
    """
    if not _scope_rows(scopes):
        return None
    for name, part in scopes:
        where = f"view {view!r}" + ("" if name == "dataset" else f", scope {name!r}")
        for column, values, lacks in ((confounder, part.confounder, "OS"), ("label", part.label, "SO")):
            distinct = pd.unique(values)
            if len(distinct) < 2:
                return (f"{where}: column {column!r} has a single value ({distinct[0]!r}), so no unit has an {lacks} "
                        f"neighbour and RI, MaRI and CRoMa are not defined here (croma would return a fallback); "
                        f"give every scope at least two {column!r} values or leave the view out of the job")
    return None


def scope_size_problem(scopes, confounder: str, design: str, view: str, metric: str, params: dict) -> str | None:
    """Why ``metric`` with ``params`` cannot be scored on ``view`` for lack of rows, or None: the
    family's own ``scope_problem`` over the view's scopes (``[(name, ScopeCounts)]``; RI /
    MaRI: some k of ``k_candidates`` below a scope's size, spec §3; CRoMa: ``m`` SO and ``m`` OS
    candidates outside its group for every row, §7.5). The message names the view, the scope,
    the parameter and the counts, so ``validate`` refuses before a cluster starts. Empty views
    are left to the metric's own validation."""
    if not _scope_rows(scopes):
        return None
    check = families.get(metric).scope_problem
    return None if check is None else check(scopes, confounder, params, view, design)


def _design_for(job: Job, hint) -> str:
    if job.design != "auto":
        return job.design
    return hint if hint in ("all", "paired_2x2") else "all"


def plan_job(job: Job, *, cache=None, store=None) -> Plan:
    """Enumerate the job's work units, fingerprint them and split them by store state.

    Parameters
    ----------
    job : Job
        A validated job (:func:`cachescore.jobs.load_job`).
    cache : cachescore.cache.Cache, optional
        The job's cache (opened from ``job.cache`` when omitted).
    store : cachescore.store.ResultsStore, optional
        The job's results store (opened/created at ``job.store`` when omitted).

    Raises
    ------
    ValueError
        An encoder or view named in the job is not in the cache (the message lists what is).
    FileNotFoundError
        The cache folder does not exist.
    """
    cache = Cache(job.cache) if cache is None else cache
    store = ResultsStore.open(job.store) if store is None else store  # planning only reads
    encoders, views = _selection(job, cache)
    planner = _Planner(job, cache, store)
    for view in views:
        planner.plan_view(view, encoders)
    if job.probe is not None:
        _plan_probe_units(job, cache, store, encoders, views, planner.code, planner.pending, planner.done,
                          planner.invalid, planner.fps)
    return Plan(job=job, pending=tuple(planner.pending), done=tuple(planner.done), invalid=tuple(planner.invalid),
                inputs=planner.inputs)


def _selection(job: Job, cache) -> tuple[list, list]:
    """The job's encoders and views (all of the cache's when it names none); raises ``ValueError``
    naming what the job asks for and the cache lacks."""
    all_encoders, all_views = cache.encoders(), cache.views()
    for kind, asked, have in (("encoder", job.encoders, all_encoders), ("view", job.views, all_views)):
        missing = [x for x in asked if x not in have]
        if missing:
            raise ValueError(f"{job.path or '<job>'}: {kind}(s) {', '.join(missing)} not in cache {job.cache} "
                             f"(it has: {', '.join(have) or 'none'})")
    return list(job.encoders) or list(all_encoders), list(job.views) or list(all_views)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class _ViewFacts:
    """What planning reads of one view: its design, tileset, confounder, fingerprint, largest
    scope, and why it (or a family on it) cannot be scored (``error``: unreadable,
    ``scope_error``: an undefined scope, ``too_small`` per family; None when it can)."""

    design: str
    tileset: str = "?"
    confounder: str = "?"
    fingerprint: str | None = None
    scope_rows: int = 0
    error: str | None = None
    scope_error: str | None = None
    too_small: list = field(default_factory=list)


class _Planner:
    """The metric units of one plan, view by view: pending / done / invalid, and the input
    fingerprints (``inputs``: ``views/<view>`` and ``embeddings/<encoder>/<tileset>``, an
    ``error: ...`` string for an input that could not be read)."""

    def __init__(self, job: Job, cache, store):
        self.job, self.cache, self.store = job, cache, store
        self.code = code_version()
        self.families = _metric_params(job)
        self.fps = _InputFingerprints(cache)
        self.inputs: dict[str, str] = {}
        self._embeddings: dict[tuple[str, str], tuple] = {}
        self.pending: list = []
        self.done: list = []
        self.invalid: list = []

    def embedding(self, enc: str, tileset: str) -> tuple[str | None, int | None, str | None]:
        """``(fingerprint, dim, error)`` of an encoder's embeddings of ``tileset`` (read once)."""
        key = (enc, tileset)
        if key not in self._embeddings:
            try:
                fp = self.fps.embedding(enc, tileset)
                self._embeddings[key] = (fp, int(self.cache.meta(enc, tileset).dim), None)
                self.inputs[f"embeddings/{enc}/{tileset}"] = fp
            except (ValueError, OSError) as exc:
                self._embeddings[key] = (None, None, _error(exc))
                self.inputs[f"embeddings/{enc}/{tileset}"] = f"error: {_error(exc)}"
        return self._embeddings[key]

    def view_facts(self, view: str) -> _ViewFacts:
        """Read ``view`` once for every encoder (the rows decide scope problems, not the encoder)."""
        job = self.job
        try:
            spec = self.cache.view_spec(view)
            view_fp = self.fps.view(view)
            design = _design_for(job, getattr(spec, "design", None))
            scopes = None
            if self.cache.view_rows(view) >= int(job.neighbors.large_scope_rows):
                scopes = _lean_scopes(self.cache, view, spec.confounder_column, design)
            if scopes is None:
                scopes = _frame_scopes(self.cache.read_view(view), spec.confounder_column, design)
        except (ValueError, OSError) as exc:
            self.inputs[f"views/{view}"] = f"error: {_error(exc)}"
            return _ViewFacts(design=job.design if job.design != "auto" else "?", error=_error(exc),
                              too_small=[None] * len(self.families))
        self.inputs[f"views/{view}"] = view_fp
        confounder = spec.confounder_column
        scope_err = undefined_scope(scopes, confounder, view)
        too_small = [None if scope_err else scope_size_problem(scopes, confounder, design, view, metric, mparams)
                     for metric, mparams in self.families]
        return _ViewFacts(design=design, tileset=spec.tileset, confounder=confounder, fingerprint=view_fp,
                          scope_rows=_scope_rows(scopes), scope_error=scope_err, too_small=too_small)

    def plan_view(self, view: str, encoders: list) -> None:
        facts = self.view_facts(view)
        for enc in encoders:
            emb_fp, dim, emb_err = self.embedding(enc, facts.tileset) if facts.fingerprint else (None, None, None)
            for (metric, mparams), too_small in zip(self.families, facts.too_small):
                err = facts.error or emb_err or facts.scope_error or too_small
                if err is not None:
                    self.invalid.append(self._invalid(enc, view, facts, metric, mparams, err))
                    continue
                unit = self._unit(enc, view, facts, metric, mparams, emb_fp, dim)
                (self.done if unit_is_stored(self.store, unit, self.job.probe) else self.pending).append(unit)

    def _invalid(self, enc, view, facts: _ViewFacts, metric, mparams, err: str) -> InvalidUnit:
        ident = {"encoder": enc, "view": view, "tileset": facts.tileset, "design": facts.design,
                 "family": metric, "metric": metric, "params": mparams}
        fp = _fingerprint({"kind": "cachescore.invalid-unit/1", **ident, "error": err, "code": self.code})
        return InvalidUnit(unit=ident, fingerprint=fp, error=err)

    def _unit(self, enc, view, facts: _ViewFacts, metric, mparams, emb_fp, dim) -> WorkUnit:
        job, nb = self.job, self.job.neighbors
        params = dict(mparams, **engine_params(nb.backend, scope_rows=facts.scope_rows, dim=dim, neighbors=as_dict(nb)))
        unit_inputs = {"embeddings": emb_fp, "view": facts.fingerprint}
        fp = unit_fingerprint(encoder=enc, view=view, design=facts.design, metric=metric,
                              confounder_column=facts.confounder, params=params, inputs=unit_inputs, code=self.code)
        return WorkUnit(encoder=enc, view=view, tileset=facts.tileset, design=facts.design, metric=metric,
                        confounder_column=facts.confounder, params=params, cache_root=str(job.cache),
                        store_root=str(job.store), inputs=unit_inputs, code_version=self.code, fingerprint=fp)


class _InputFingerprints:
    """Per-plan memo of the input fingerprints: each view's Parquet, each tileset's
    ``tiles.parquet`` and each embedding ``meta.json`` is hashed/read once per plan, however many
    encoders, metric families and probe units use it. Only successes are memoised (a failing input
    raises again, with its own error, wherever it is used)."""

    def __init__(self, cache):
        self.cache = cache
        self._views: dict[str, str] = {}
        self._emb: dict[tuple[str, str], str] = {}
        self._tiles: dict[str, str] = {}  # tiles.parquet path -> sha256, shared by the views

    def view(self, view: str) -> str:
        if view not in self._views:
            self._views[view] = self.cache.view_fingerprint(view, tiles_digests=self._tiles)
        return self._views[view]

    def embedding(self, encoder: str, tileset: str) -> str:
        key = (encoder, tileset)
        if key not in self._emb:
            self._emb[key] = self.cache.embedding_fingerprint(encoder, tileset)
        return self._emb[key]


def _plan_probe_units(job, cache, store, encoders, views, code, pending, done, invalid, fps=None) -> None:
    """Probe-sweep units (one per encoder × probe view; ``metric = design = "probe"``).

    Their fingerprint is :func:`~.probe_unit.probe_unit_fingerprint` (its own code version over
    ``probe/``, unless ``CACHESCORE_CODE_VERSION`` pins it); a unit is done when the store holds
    every one of its (matrix, reduction) records (:func:`~.probe_unit.probe_unit_done`). The
    input fingerprints come from ``fps`` (the plan's :class:`_InputFingerprints`), so a view is
    hashed once per plan, not once per encoder.
    """
    fps = _InputFingerprints(cache) if fps is None else fps

    probe_code = code_version("probe")
    params = job.probe.to_dict()
    probe_views = list(job.probe_views) or list(views)
    missing = [v for v in probe_views if v not in cache.views()]
    if missing:
        raise ValueError(f"{job.path or '<job>'}: probe view(s) {', '.join(missing)} not in cache {job.cache}")
    for view in probe_views:
        for enc in encoders:
            try:
                spec = cache.view_spec(view)
                inputs = {"embeddings": fps.embedding(enc, spec.tileset), "view": fps.view(view)}
                fp = probe_unit_fingerprint(cache, enc, view, job.probe, code_version=probe_code, inputs=inputs)
            except (ValueError, OSError) as exc:
                err = _error(exc)
                ident = {"encoder": enc, "view": view, "tileset": "?", "design": "probe", "family": "probe",
                         "metric": "probe", "params": params}
                invalid.append(InvalidUnit(unit=ident, fingerprint=_fingerprint(
                    {"kind": "cachescore.invalid-unit/1", **ident, "error": err, "code": code}), error=err))
                continue
            unit = WorkUnit(encoder=enc, view=view, tileset=spec.tileset, design="probe", metric="probe",
                            confounder_column=spec.confounder_column, params=params, cache_root=str(job.cache),
                            store_root=str(job.store), inputs=inputs, code_version=probe_code, fingerprint=fp)
            (done if unit_is_stored(store, unit, job.probe) else pending).append(unit)


def unit_is_stored(store: ResultsStore, unit: WorkUnit, probe_params=None) -> bool:
    """Whether ``unit``'s results are complete in ``store`` (what makes a planned unit ``done``):
    its record for a metric unit; every record of the sweep (:func:`probe_unit_done`, with the
    job's ``[probe]`` parameters, ``ProbeParams`` or a mapping) for a probe unit."""
    if unit.kind is UnitKind.PROBE:
        return probe_unit_done(store, unit.fingerprint, probe_params)
    return store.has(unit.fingerprint)


def empty_plan_hint(plan: Plan) -> str | None:
    """Why a plan has no unit at all, with the command that fixes it, or None (issue 24: a cache
    without views gave "0 unit(s) to run" and nothing else)."""
    if plan.units or plan.invalid:
        return None
    cache = Cache(plan.job.cache)
    if not cache.views():
        tilesets = cache.tilesets()
        return (f"cache {plan.job.cache} has no view, so there is nothing to score: write one with `cachescore view "
                f"{plan.job.cache} --tileset {tilesets[0] if tilesets else 'TILESET'} --name NAME --confounder COLUMN` "
                "(or `cachescore import ... --view NAME=COLUMN`)")
    if not cache.encoders():
        return f"cache {plan.job.cache} has no encoder: import one with `cachescore import {plan.job.cache} ...`"
    return "the job selects no unit: check [job] encoders, views and [metrics] families"


def params_json(params: dict) -> str:
    """Canonical JSON of a parameter dict (sorted keys, compact), as stored in the scores table."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"), default=json_default)
