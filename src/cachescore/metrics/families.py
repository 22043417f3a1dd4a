"""The metric families as data: one table that says, per family, everything the rest of the house asks.

A :class:`Family` holds a family's job keys (``[metrics.<name>]``, with types, defaults and
checks), how its work units are expanded from them, how a unit is computed through a neighbour
engine (:class:`cachescore.neighbors.base.Searcher`: exact, ANN or out of core, all the same
call), which fields its store record and per-unit table carry, how its interval is computed from
the stored values, its display name, its value range and its **direction** (higher is more
robust, for every family here). The job schema, the planner, the work unit, the score table, the
report, its figures and the CLI iterate :data:`FAMILIES` / :func:`get`; none of them compares a
family name.

Built-in families, in table (= scoring and display) order:

==========  =========  =========================================  ==============================
name        kind       computed by                                interval
==========  =========  =========================================  ==============================
``ri``      neighbour  :class:`.ri.RI` (``searcher.cross``)       cluster bootstrap, pooled ratio
``mari``    neighbour  :class:`.mari.MaRI` (``searcher.cross``)   cluster bootstrap, pooled ratio
``croma``   neighbour  :class:`.croma.CRoMa` (``searcher.typed``) cluster bootstrap, median
``apd``     probe      the probe sweep (``ProbeEvaluation.apd``)  percentile over replicates
``nipd``    probe      the probe sweep (``ProbeEvaluation.nipd``) percentile over replicates
==========  =========  =========================================  ==============================

Adding a neighbour family = one module with its computation plus one :class:`Family` in
:data:`_BUILTIN` (``docs/extending.md``); :func:`register` adds one at run time (a notebook, a
test: workers in other processes import this module afresh, so a registered family reaches them
only in-process, ``run_job(..., processes=False)``).

Contract of a neighbour family's ``compute(params, features, manifest, *, confounder_column,
design, searcher)``: returns a result with ``value`` (float) and ``sample_values_aligned``
(``(U,)`` float, unit order), and may have ``std``, ``q_alpha``, ``ltm_alpha``, ``n_pairs``,
``occurrence_source_indices``, ``occurrence_subsets`` (missing ones are stored as NaN / 0 / the
view order); it raises ``ValueError`` for data it cannot score and a plain ``RuntimeError`` for a
refusal of the data (both recorded as the unit's data error). ``reduce(params, ctx)`` (optional)
computes an out-of-core unit with its per-row work on the workers
(:class:`.large.OutOfCore` in, :class:`.large.LargeResult` out, equal to ``compute`` over the same
neighbour tables bit for bit; :mod:`.large`); ``tables(params, ref)`` (optional, with ``reduce``)
lists the ``(kinds, k)`` tables ``reduce`` will ask of a scope (a
:class:`~cachescore.neighbors.large_scope.ScopeRef`), so the engine searches one scope's tables
of every unit of a job together (a hint: it never changes a value); a family without one is computed by ``compute`` in
the driving process over the engine's memory-mapped tables, holding its view there. ``record(result)`` returns
``(fields, columns)``: the family's own record fields (``support``, ``n_defined``, ``k``, ``tau``,
``f0``, ``m``, anything else JSON-safe) and its extra per-unit columns (name -> ``(U,)`` array, in
order). ``replicates(per_unit, member, counts, subsets)`` returns ``(replicate values or None,
ci_method text)`` from the stored per-unit table and the view's shared cluster draw
(:func:`.bootstrap.cluster_counts`). ``scope_problem(scopes, confounder, params, view, design)``
(optional) returns why a unit with ``params`` cannot be scored on the view, or None, from its
scopes as combination counts (``[(scope name, .scope_counts.ScopeCounts)]``: no rows, so a view
of any size is checked at planning in the same memory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .._keys import NUM, Key, growth, int_list, open_unit, positive_int, tau
from .._missing import as_float, is_missing
from .bootstrap import balanced_median_replicates, pooled_ratio_replicates
from .croma import CROMA_ALPHA, CROMA_HEADLINE_M, CROMA_K_GROWTH, CROMA_START_K, CRoMa
from .mari import MaRI
from .probe_reductions import nipd
from .ri import RI

__all__ = ["NEIGHBOUR", "PROBE", "HIGHER", "Family", "FAMILIES", "get", "lookup", "names", "register",
           "unregister", "display", "order", "reading_guide", "direction_header"]

#: ``Family.kind`` of a family scored by one work unit per parameter set over a neighbour search.
NEIGHBOUR = "neighbour"
#: ``Family.kind`` of a reduction of the probe sweep's accuracy matrices (one record per matrix).
PROBE = "probe"
#: ``Family.direction`` of every built-in family.
HIGHER = "higher is more robust"


@dataclass(frozen=True)
class Family:
    """One metric family (see the module docstring for the callables' contracts).

    ``name`` is the job key and the stored ``metric`` value (never rename a built-in one: records
    and fingerprints carry it); ``label`` the display name; ``value_range`` a fixed range of the
    value (its plots' axis) or None (plots symmetric around ``neutral``, the no-effect value);
    ``has_support``: the value is a pooled ratio whose units may lack neighbours (support, the
    low-support flag and the 0.5-fallback rules apply); ``unit_param``: the parameter that makes
    one unit per value (its value is part of labels, leaderboards and the ``m`` column);
    ``margins``: the per-unit values are margins whose ECDF the report draws;
    ``evaluation_field``: for a probe family, the ``ProbeEvaluation`` attribute holding its value
    per matrix; ``reading``: how to read one value (its range and landmarks), stated wherever
    scores are shown (:func:`reading_guide`).
    """

    name: str
    label: str
    kind: str
    doc: str
    keys: Mapping[str, Key] = field(default_factory=dict)
    units: Callable[[Mapping], list[dict]] | None = None
    compute: Callable | None = None
    reduce: Callable | None = None
    tables: Callable | None = None
    record: Callable | None = None
    replicates: Callable | None = None
    scope_problem: Callable | None = None
    value_range: tuple[float, float] | None = None
    neutral: float = 0.0
    direction: str = HIGHER
    has_support: bool = False
    unit_param: str | None = None
    margins: bool = False
    evaluation_field: str | None = None
    reading: str = ""

    def tag(self, params: Mapping) -> str:
        """The family in a unit label: ``ri``, ``croma[m=5]``."""
        p = self.unit_param
        return f"{self.name}[{p}={params[p]}]" if p and p in params else self.name

    def display(self, m=None, scope=None) -> str:
        """Display name of one score: ``RI``, ``CRoMa (m=5)``, ``APD [centre_C]``."""
        out = self.label
        if self.unit_param and m is not None and not is_missing(m):
            out += f" ({self.unit_param}={int(m)})"
        if self.kind == PROBE and scope is not None and not is_missing(scope):
            out += f" [{scope}]"
        return out


# -- RI and MaRI: pooled ratios over a cross-group window ----------------------------------------
def _k_list(section: Mapping) -> list[int]:
    return [int(k) for k in section["k_candidates"]]


def _ratio_record(result) -> tuple[dict, dict]:
    fields = {"support": as_float(result.support), "n_defined": int(np.asarray(result.occurrence_defined_mask).sum()),
              "k": int(result.k)}
    columns = {"defined": np.asarray(result.occurrence_defined_mask, dtype=bool),
               "undefined_type": np.asarray(result.sample_undefined_types).astype(str)}
    if result.occurrence_so is not None:  # the pooled ratio's evidence, for its bootstrap CI
        columns["so"] = np.asarray(result.occurrence_so, dtype=np.float64)
        columns["os"] = np.asarray(result.occurrence_os, dtype=np.float64)
    return fields, columns


def _ratio_replicates(per_unit: pd.DataFrame, member, counts, subsets):
    if not {"so", "os"} <= set(per_unit.columns):
        return None, "not available: the record predates per-unit evidence (rescore to get a CI)"
    reps = pooled_ratio_replicates(per_unit["so"].to_numpy(), per_unit["os"].to_numpy(), member, counts)
    return reps, "cluster bootstrap (group_id) of the pooled ratio"


def _k_problem(name: str):
    def problem(scopes, confounder: str, params: Mapping, view: str, design: str) -> str | None:
        ks = sorted(int(k) for k in params.get("k_candidates", []))
        sizes = {scope: part.n_rows for scope, part in scopes}
        if ks and all(ks[0] >= n for n in sizes.values()):
            where = "its rows" if design != "paired_2x2" else f"its largest subset ({max(sizes, key=sizes.get)!r})"
            return (f"view {view!r} ({design}): every k in k_candidates {ks} is >= the {max(sizes.values())} rows of "
                    f"{where}; k-selection needs a candidate k < the scope size: add smaller k values to "
                    f"[metrics.{name}] k_candidates")
        return None

    return problem


def _reduce(name: str):
    """The out-of-core computation ``name`` of :mod:`.large`, imported when a large unit is
    scored (it needs distributed and pyarrow; every command starts without them)."""

    def reduce(params, ctx):
        from .large import REDUCERS  # deferred: distributed and pyarrow, for out-of-core units only

        return REDUCERS[name](params, ctx)

    reduce.__name__ = reduce.__qualname__ = name
    return reduce


def _tables(name: str):
    """The tables the out-of-core computation ``name`` of :mod:`.large` asks of a scope
    (:data:`.large.TABLES`; imported as :func:`_reduce` is)."""

    def tables(params, ref):
        from .large import TABLES  # deferred: distributed and pyarrow, for out-of-core units only

        return TABLES[name](params, ref)

    tables.__name__ = tables.__qualname__ = f"{name}_tables"
    return tables


def _ri_compute(params, features, manifest, *, confounder_column, design, searcher):
    return RI.compute_with(searcher.cross, features, manifest, confounder_column=confounder_column,
                           evaluation_design=design, k_candidates=list(params["k_candidates"]))


def _mari_units(section: Mapping) -> list[dict]:
    t = section["tau"]
    return [{"k_candidates": _k_list(section), "tau": t if t == "auto" else float(t),
             "warn_tau": bool(section["warn_tau"])}]


def _mari_compute(params, features, manifest, *, confounder_column, design, searcher):
    t = None if params["tau"] == "auto" else float(params["tau"])
    return MaRI.compute_with(searcher.cross, features, manifest, confounder_column=confounder_column,
                             evaluation_design=design, k_candidates=list(params["k_candidates"]), tau=t,
                             warn_tau=bool(params["warn_tau"]))


def _mari_record(result) -> tuple[dict, dict]:
    fields, columns = _ratio_record(result)
    return dict(fields, tau=as_float(getattr(result, "tau", None))), columns


# -- CRoMa: typed margins ------------------------------------------------------------------------
def _croma_units(section: Mapping) -> list[dict]:
    return [{"m": mm, "alpha": float(section["alpha"]), "start_k": int(section["start_k"]),
             "k_growth_factor": float(section["k_growth_factor"])} for mm in dict.fromkeys(int(x) for x in section["m"])]


def _croma_compute(params, features, manifest, *, confounder_column, design, searcher):
    # Only an engine that says so affords croma's exact schedule counting pass (an O(n^2 d)
    # GEMM pass that would cancel an ANN / out-of-core gain): elsewhere the schedule fields are
    # -1, "not computed" (ADR-0002).
    return CRoMa.compute_with(searcher.typed, features, manifest, confounder_column=confounder_column,
                              evaluation_design=design, m=int(params["m"]), alpha=float(params["alpha"]),
                              start_k=int(params["start_k"]), k_growth_factor=float(params["k_growth_factor"]),
                              schedule_diagnostics=bool(getattr(searcher, "schedule_diagnostics", False)))


def _croma_record(result) -> tuple[dict, dict]:
    values = np.asarray(result.sample_values_aligned, dtype=float)
    # CRoMa enforces total support (its result has no support field): 1.0, every unit defined.
    return {"f0": as_float(result.f0), "support": 1.0, "k": int(result.k_final), "m": int(result.m),
            "n_defined": int(values.size)}, {}


def _croma_replicates(per_unit: pd.DataFrame, member, counts, subsets):
    reps = balanced_median_replicates(per_unit["value"].to_numpy(), member, counts, subsets)
    return reps, ("cluster bootstrap (group_id) of the median of per-subset medians" if subsets is not None
                  else "cluster bootstrap (group_id) of the pooled median")


def _typed_counts(part) -> tuple[np.ndarray, np.ndarray]:
    """How many SO rows (same label, other confounder value) and OS rows (other label, same
    confounder) a row of each combination of ``part`` (a :class:`.scope_counts.ScopeCounts`) has
    outside its own ``group_id`` (spec §1: the candidates CRoMa draws its m nearest SO and OS
    neighbours from). Both depend on the row's (group, label, confounder) only: ``(so, os)``,
    (K,) int64 each, one per combination."""
    y, c, g = (pd.factorize(v)[0].astype(np.int64) for v in (part.label, part.confounder, part.group))
    rows = part.rows
    ny, nc = int(y.max()) + 1 if y.size else 1, int(c.max()) + 1 if c.size else 1

    def total(key):  # rows sharing the key value, read back per combination
        _, inv = np.unique(key, return_inverse=True)
        return np.bincount(inv.ravel(), weights=rows).astype(np.int64)[inv.ravel()]

    n_yc, n_y, n_c = total(y * nc + c), total(y), total(c)
    g_y, g_c = total(g * ny + y), total(g * nc + c)
    g_yc = rows.astype(np.int64)  # each (group, label, confounder) is one combination
    return (n_y - n_yc) - (g_y - g_yc), (n_c - n_yc) - (g_c - g_yc)


def _croma_problem(scopes, confounder: str, params: Mapping, view: str, design: str) -> str | None:
    m = int(params["m"])
    for scope, part in scopes:
        so, os_ = _typed_counts(part)
        worst = int(min(so.min(), os_.min()))
        if worst < m:
            where = f"view {view!r}" + ("" if scope == "dataset" else f", scope {scope!r}")
            kind = "SO" if so.min() <= os_.min() else "OS"
            low = np.flatnonzero((so if kind == "SO" else os_) == worst)
            at = low[np.argmin(part.first[low])]  # the first row of the view with the fewest candidates
            return (f"{where} ({part.n_rows} rows): CRoMa m={m} needs {m} SO and {m} OS neighbours outside each "
                    f"row's group, but row {int(part.first[at])} of the view (group {part.group[at]!r}, label "
                    f"{part.label[at]!r}, {confounder} {part.confounder[at]!r}) has only {worst} {kind} "
                    f"candidate(s); lower [metrics.croma] m to at most {worst} or score a larger view")
    return None


# -- APD and nIPD: reductions of the probe sweep ------------------------------------------------------
def _apd_replicates(acc: np.ndarray, cramers_v, chance):
    if (acc[0] > 0).all():
        return (acc[1:] / acc[0]).mean(axis=0) - 1, "percentile over probe replicates"  # the drops APD averages
    return None, "not available: a replicate's baseline accuracy is not positive"


def _nipd_replicates(acc: np.ndarray, cramers_v, chance):
    """nIPD of every replicate column (the schedule's Cramér's V and the chance level come from
    the bundle); a replicate whose nIPD is undefined is NaN."""
    if cramers_v is None or chance is None or len(cramers_v) != acc.shape[0]:
        return None, "not available: the bundle's Cramér's V / chance level could not be read"
    out = np.full(acc.shape[1], np.nan)
    for r in range(acc.shape[1]):  # one tiny matrix per replicate (a sweep has tens of replicates)
        try:
            out[r] = nipd(np.ascontiguousarray(acc[:, r : r + 1]), cramers_v, chance)
        except ValueError:
            pass
    return out, "percentile over probe replicates (per-replicate nIPD)"


_K_DOC = "candidate window sizes (operating k chosen by kNN balanced accuracy)."

#: The built-in families, in scoring and display order.
_BUILTIN = (
    Family(name="ri", label="RI", kind=NEIGHBOUR, value_range=(0.0, 1.0), neutral=0.5, has_support=True,
           doc="Robustness Index: share of same-label (SO) among the typed neighbours of a cross-group kNN window.",
           reading="the share of same-label (SO) neighbours among the typed ones, 0–1 (0.5 = no preference, "
                   "1 = biology only)",
           keys={"k_candidates": Key((list,), [5, 11, 21], "RI " + _K_DOC, int_list)},
           units=lambda s: [{"k_candidates": _k_list(s)}], compute=_ri_compute, reduce=_reduce("ri_reduce"), tables=_tables("ri_reduce"), record=_ratio_record,
           replicates=_ratio_replicates, scope_problem=_k_problem("ri")),
    Family(name="mari", label="MaRI", kind=NEIGHBOUR, value_range=(0.0, 1.0), neutral=0.5, has_support=True,
           doc="Margin-aware RI: the SO share weighted by exp(-distance / tau).",
           reading="RI with closer neighbours weighing more, 0–1 (0.5 = no preference)",
           keys={"k_candidates": Key((list,), [5, 11, 21], "MaRI candidate window sizes.", int_list),
                 "tau": Key((str, int, float), "auto", "MaRI temperature: 'auto' (median typed distance) or a "
                                                      "number > 0.", tau),
                 "warn_tau": Key((bool,), False, "With a pinned tau, run croma's off-scale check (a warning only).")},
           units=_mari_units, compute=_mari_compute, reduce=_reduce("mari_reduce"), tables=_tables("mari_reduce"), record=_mari_record,
           replicates=_ratio_replicates,
           scope_problem=_k_problem("mari")),
    Family(name="croma", label="CRoMa", kind=NEIGHBOUR, unit_param="m", margins=True,
           doc="Confounder-robustness margin: median over units of (mean m nearest OS - mean m nearest SO distance).",
           reading="the margin of same-confounder (OS) over same-label (SO) distance, in cosine distance "
                   "(> 0: biology closer than the confounder)",
           keys={"m": Key((list,), [CROMA_HEADLINE_M], "Typed neighbours averaged per unit; one result (one work unit) "
                          "per m.", int_list),
                 "alpha": Key(NUM, CROMA_ALPHA, "Lower-tail level for q_alpha / ltm_alpha.", open_unit),
                 "start_k": Key((int,), CROMA_START_K, "croma's initial window (recorded; the exact typed search does not "
                                             "need it).", positive_int),
                 "k_growth_factor": Key(NUM, CROMA_K_GROWTH, "croma's window growth factor (recorded, as start_k).", growth)},
           units=_croma_units, compute=_croma_compute, reduce=_reduce("croma_reduce"), tables=_tables("croma_reduce"), record=_croma_record,
           replicates=_croma_replicates,
           scope_problem=_croma_problem),
    Family(name="apd", label="APD", kind=PROBE, evaluation_field="apd", replicates=_apd_replicates,
           doc="Average performance drop of the probe under confounded training splits (0 = none).",
           reading="the probe's mean accuracy change under confounded training (0 = no drop, negative = a drop)"),
    Family(name="nipd", label="nIPD", kind=PROBE, evaluation_field="nipd", replicates=_nipd_replicates,
           doc="Normalised integrated performance degradation over the Cramér's V grid (0 = none).",
           reading="the probe's accuracy change integrated over the confounding grid, normalised (0 = no "
                   "degradation, negative = a drop)"),
)

#: name -> :class:`Family`, in table order (built-ins first, then registered ones).
FAMILIES: dict[str, Family] = {f.name: f for f in _BUILTIN}


def lookup(name) -> Family | None:
    """The family stored as ``metric = name``, or None."""
    return FAMILIES.get(str(name)) if not is_missing(name) else None


def get(name) -> Family:
    """The family ``name``. Raises ``ValueError`` naming the known ones for an unknown name."""
    fam = lookup(name)
    if fam is None:
        raise ValueError(f"unknown metric family {name!r} (known: {', '.join(FAMILIES)})")
    return fam


def names(kind: str | None = None) -> tuple[str, ...]:
    """Family names in table order, all or those of ``kind`` (:data:`NEIGHBOUR`, :data:`PROBE`)."""
    return tuple(n for n, f in FAMILIES.items() if kind is None or f.kind == kind)


def order(name) -> int:
    """Table position of ``name`` (report order); unknown names sort after every family."""
    return list(FAMILIES).index(str(name)) if lookup(name) is not None else len(FAMILIES)


def reading_guide() -> str:
    """Which end of every family's score is better and how to read a value, from the table: one
    sentence (``Higher is more robust, for every metric: RI is …; …``), what the report, the
    README and the glossary state."""
    fams = list(FAMILIES.values())
    if all(f.direction == HIGHER for f in fams):
        head = "Higher is more robust, for every metric"
        parts = [f"{f.label} is {f.reading}" if f.reading else f.label for f in fams]
    else:
        head = "How to read each metric"
        parts = [f"{f.label}: {f.direction}" + (f", {f.reading}" if f.reading else "") for f in fams]
    return f"{head}: " + "; ".join(parts) + "."


def direction_header(metrics) -> str:
    """``value (higher = more robust)`` when every family among ``metrics`` (stored names) reads
    that way, else ``value``: the header of a value column."""
    fams = [lookup(m) for m in metrics]
    return "value (higher = more robust)" if fams and all(f is not None and f.direction == HIGHER
                                                          for f in fams) else "value"


def display(metric, m=None, scope=None) -> str:
    """Display name of a stored score (``metric`` column, ``m``, probe ``scope``); an unknown or
    missing metric shows as itself / ``?``."""
    fam = lookup(metric)
    if fam is None:
        return "?" if is_missing(metric) else str(metric)
    return fam.display(m, scope)


def register(family: Family) -> Family:
    """Add ``family`` to the table (after the existing ones). Raises ``ValueError`` when its name is
    taken or a neighbour family lacks ``units`` / ``compute`` / ``record``."""
    if family.name in FAMILIES:
        raise ValueError(f"metric family {family.name!r} is already registered")
    if family.kind == NEIGHBOUR and None in (family.units, family.compute, family.record):
        raise ValueError(f"neighbour family {family.name!r} needs units, compute and record")
    if family.kind not in (NEIGHBOUR, PROBE):
        raise ValueError(f"family kind must be {NEIGHBOUR!r} or {PROBE!r}, got {family.kind!r}")
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a registered family (built-ins cannot be removed: stored records name them)."""
    if any(f.name == name for f in _BUILTIN):
        raise ValueError(f"built-in metric family {name!r} cannot be unregistered")
    FAMILIES.pop(name, None)
