"""The ``[probe]`` parameters of a probe-sweep unit: :class:`ProbeParams` (validated, frozen),
their documented keys (:data:`PROBE_KEYS`), :class:`RowFilter` and :class:`ProbeParamsError`.

The job schema (:mod:`cachescore.jobs.schema`) reads the ``[probe]`` table through
:meth:`ProbeParams.from_dict`; the pipeline fingerprints :meth:`ProbeParams.to_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable

import numpy as np
import pandas as pd

from ..metrics import families
from .schedule import PATHOROB_SPLITS, pathorob_schedule

__all__ = ["PROBE_KEYS", "PROBE_METRICS", "ProbeParams", "ProbeParamsError", "RowFilter"]


#: Reductions stored per matrix; the ``metric`` column of the records: the probe families of
#: :data:`cachescore.metrics.families.FAMILIES` (display: APD, nIPD).
PROBE_METRICS = families.names(families.PROBE)

_SELF = "ProbeParams"


class ProbeParamsError(ValueError):
    """Invalid probe parameters or inputs; the message names the source, the key and the rows."""


# ---------------------------------------------------------------------------------------------
# parameters


def _bad(where: str, key: str, expected: str, value: Any) -> ProbeParamsError:
    return ProbeParamsError(f"{where}: '{key}' must be {expected}, got {value!r}")


def _int(where, key, value, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < minimum:
        raise _bad(where, key, f"an integer >= {minimum}", value)
    return int(value)


def _name_list(where, key, value, *, allow_empty: bool = False) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) and not isinstance(value, np.ndarray):
        raise _bad(where, key, "a list of values", value)
    out = tuple(str(v) for v in value)
    if not out and not allow_empty:
        raise _bad(where, key, "a non-empty list", value)
    dup = sorted({v for v in out if out.count(v) > 1})
    if dup:
        raise ProbeParamsError(f"{where}: '{key}' lists {dup} more than once (values are compared as text)")
    return out


def _check_keys(where: str, prefix: str, d: Mapping, known: Sequence[str]) -> None:
    for key in d:
        if key not in known:
            raise ProbeParamsError(f"{where}: unknown key '{prefix}{key}' (known: {', '.join(known)})")


@dataclass(frozen=True)
class RowFilter:
    """Rows of a view whose ``column`` (compared as text) is one of ``values``."""

    column: str
    values: tuple[str, ...]

    @classmethod
    def parse(cls, value: Any, *, where: str, key: str) -> RowFilter:
        """From ``RowFilter`` or ``{"column": str, "value": v}`` / ``{"column": str, "values": [..]}``."""
        if isinstance(value, RowFilter):
            return value
        if not isinstance(value, Mapping):
            raise _bad(where, key, "a table {column, value} or {column, values}", value)
        _check_keys(where, f"{key}.", value, ("column", "value", "values"))
        column = value.get("column")
        if not isinstance(column, str) or not column.strip():
            raise _bad(where, f"{key}.column", "a non-empty column name", column)
        if ("value" in value) == ("values" in value):
            raise ProbeParamsError(f"{where}: '{key}' needs exactly one of 'value' or 'values'")
        if "value" in value:
            v = value["value"]
            if isinstance(v, (Mapping, list, tuple)) or v is None:
                raise _bad(where, f"{key}.value", "one scalar value", v)
            values = (str(v),)
        else:
            values = _name_list(where, f"{key}.values", value["values"])
        return cls(column=column.strip(), values=values)

    def to_dict(self) -> dict:
        return {"column": self.column, "values": list(self.values)}

    def mask(self, frame: pd.DataFrame, *, where: str) -> np.ndarray:
        """Boolean mask (len(frame),) of the selected rows; missing column -> ProbeParamsError."""
        if self.column not in frame.columns:
            raise ProbeParamsError(f"{where}: no column {self.column!r} (columns: {', '.join(map(str, frame.columns))})")
        text = frame[self.column].astype(str).to_numpy(dtype=object)
        return pd.Index(self.values).get_indexer(text) >= 0

    def describe(self) -> str:
        vals = self.values[0] if len(self.values) == 1 else list(self.values)
        return f"{self.column} {'==' if len(self.values) == 1 else 'in'} {vals!r}"


def _schedule(where: str, key: str, value: Any, rows_per_slide: int) -> str | tuple:

    if isinstance(value, str):
        if value not in PATHOROB_SPLITS:
            raise _bad(where, key, f"one of {sorted(PATHOROB_SPLITS)} or a list of splits", value)
        return value
    if isinstance(value, Mapping) or not isinstance(value, Sequence):
        raise _bad(where, key, f"one of {sorted(PATHOROB_SPLITS)} or a list of splits", value)
    if len(value) < 2:
        raise ProbeParamsError(f"{where}: '{key}' must hold the balanced split and at least one "
                               f"confounded split after it, got {len(value)} split(s)")
    out = []
    for s, split in enumerate(value):
        here = f"{key}[{s}]"
        if isinstance(split, Mapping):
            _check_keys(where, f"{here}.", split, ("split_map", "max_train_slides"))
            for k in ("split_map", "max_train_slides"):
                if k not in split:
                    raise ProbeParamsError(f"{where}: '{here}' lacks the key '{k}'")
            split_map, mts = split["split_map"], split["max_train_slides"]
        elif isinstance(split, Sequence) and not isinstance(split, str) and len(split) == 2:
            split_map, mts = split
        else:
            raise _bad(where, here, "a table {split_map, max_train_slides}", split)
        mts = _int(where, f"{here}.max_train_slides", mts, minimum=1)
        if isinstance(split_map, (str, Mapping)) or not isinstance(split_map, Sequence) or not split_map:
            raise _bad(where, f"{here}.split_map", "a non-empty list of [i, j, take]", split_map)
        entries = []
        for e, entry in enumerate(split_map):
            ehere = f"{here}.split_map[{e}]"
            if isinstance(entry, (str, Mapping)) or not isinstance(entry, Sequence) or len(entry) != 3:
                raise _bad(where, ehere, "[confounder index, class index, training rows]", entry)
            i, j, take = (_int(where, ehere, v, minimum=0) for v in entry)
            if take % rows_per_slide:
                raise ProbeParamsError(
                    f"{where}: '{ehere}' takes {take} training rows, not a multiple of rows_per_slide="
                    f"{rows_per_slide}; a partial slide would put one slide in two roles")
            entries.append((i, j, take))
        cells = [(i, j) for i, j, _ in entries]
        if len(set(cells)) != len(cells):
            raise ProbeParamsError(f"{where}: '{here}.split_map' names a cell twice")
        out.append((tuple(sorted(entries)), mts))
    return tuple(out)


@dataclass(frozen=True)
class Param:
    """One ``[probe]`` key, declared on its :class:`ProbeParams` field (``metadata["param"]``):
    its one-line ``doc``, whether it is ``required`` and ``normalise(ctx, key, value)``, which
    checks a raw value (the field's default when the table omits it) and returns it normalised, or
    raises :class:`ProbeParamsError` naming ``key`` (the dotted key). A normaliser reads other
    keys through ``ctx.value(name)`` (normalised on demand), so a key may depend on another's."""

    doc: str
    normalise: Callable[["_Context", str, Any], Any]
    required: bool = False


class _Context:
    """The raw table being validated, and the keys normalised so far (each once)."""

    def __init__(self, raw: Mapping, defaults: Mapping, *, where: str, prefix: str):
        self.raw, self.defaults, self.where, self.prefix = raw, defaults, where, prefix
        self._done: dict = {}

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def value(self, name: str):
        if name not in self._done:
            param = _PARAMS[name]
            self._done[name] = param.normalise(self, self.key(name), self.raw.get(name, self.defaults[name]))
        return self._done[name]


def _at_least(minimum: int):
    def normalise(ctx, key, v):
        return _int(ctx.where, key, v, minimum=minimum)
    return normalise


def _optional(normalise):
    """``None`` stays None; any other value goes through ``normalise``."""
    def wrapped(ctx, key, v):
        return None if v is None else normalise(ctx, key, v)
    return wrapped


def _names(ctx, key, v):
    return _name_list(ctx.where, key, v)


def _row_filter(ctx, key, v):
    return RowFilter.parse(v, where=ctx.where, key=key)


def _schedule_param(ctx, key, v):
    return _schedule(ctx.where, key, v, ctx.value("rows_per_slide"))


def _n_splits(ctx, key, v):
    n_splits = _int(ctx.where, key, v, minimum=1)
    schedule = ctx.value("schedule")
    if not isinstance(schedule, str):
        raise ProbeParamsError(f"{ctx.where}: '{key}' applies to a named schedule only; "
                               "list only the splits you want instead")
    if n_splits > PATHOROB_SPLITS[schedule]:
        raise _bad(ctx.where, key, f"at most {PATHOROB_SPLITS[schedule]} for {schedule!r}", n_splits)
    return n_splits


def _fraction(ctx, key, vf):
    if isinstance(vf, bool) or not isinstance(vf, (int, float, np.floating, np.integer)) or not 0.0 <= float(vf) < 1.0:
        raise _bad(ctx.where, key, "a number in [0, 1)", vf)
    return float(vf)


def _column(ctx, key, cc):
    if not isinstance(cc, str) or not cc.strip():
        raise _bad(ctx.where, key, "a column name", cc)
    return cc.strip()


def _pairs(ts) -> list | None:
    """A table's items, or a list of 2-sequences as pairs; None for anything else."""
    if isinstance(ts, Mapping):
        return list(ts.items())
    if isinstance(ts, Sequence) and not isinstance(ts, str) and all(
            isinstance(t, Sequence) and not isinstance(t, str) and len(t) == 2 for t in ts):
        return [tuple(t) for t in ts]
    return None


def _test_sets(ctx, key, ts):
    items = _pairs(ts or {})
    if items is None:
        raise _bad(ctx.where, key, "a table {name = {column, value}}", ts)
    tests = []
    for name, sel in items:
        if not isinstance(name, str) or not name.strip() or name in ("in_domain", "val"):
            raise _bad(ctx.where, key, "names other than 'in_domain' and 'val' (reserved roles)", name)
        tests.append((name, RowFilter.parse(sel, where=ctx.where, key=f"{key}.{name}")))
    if len({n for n, _ in tests}) != len(tests):
        raise ProbeParamsError(f"{ctx.where}: '{key}' names a test set twice")
    return tuple(tests)


def _group_levels(ctx, key, gl):
    items = list(gl.items()) if isinstance(gl, Mapping) else (list(gl) if isinstance(gl, (list, tuple)) else None)
    if not items or not all(isinstance(t, (tuple, list)) and len(t) == 2 and isinstance(t[0], str)
                            and isinstance(t[1], str) and t[0].strip() and t[1].strip() for t in items):
        raise _bad(ctx.where, key, "a table {level = column} with a 'slide' level", gl)
    levels = tuple((str(a).strip(), str(b).strip()) for a, b in items)
    if "slide" not in dict(levels):
        raise ProbeParamsError(f"{ctx.where}: '{key}' must name the 'slide' level (the view column "
                               f"whose rows form one slide), got {dict(levels)}")
    reserved = sorted({lvl for lvl, _ in levels} & {"row", "tile"})
    if reserved:
        raise ProbeParamsError(f"{ctx.where}: '{key}' uses reserved level name(s) {reserved}")
    return levels


def _protected_level(ctx, key, pl):
    levels = dict(ctx.value("group_levels"))
    if not isinstance(pl, str) or pl.strip() not in levels:
        raise _bad(ctx.where, key, f"one of the group levels {sorted(levels)}", pl)
    return pl.strip()


def _tile_key(ctx, key, tk):
    return _name_list(ctx.where, key, [tk] if isinstance(tk, str) else tk)


def _flag(ctx, key, v):
    if not isinstance(v, (bool, np.bool_)):
        raise _bad(ctx.where, key, "true or false", v)
    return bool(v)


def _param(doc: str, normalise, *, required: bool = False, **kw):
    """A :class:`ProbeParams` field declaring its ``[probe]`` key (``kw``: the field's default)."""
    return field(metadata={"param": Param(doc, normalise, required)}, **kw)


@dataclass(frozen=True, kw_only=True)
class ProbeParams:
    """Parameters of one probe-sweep work unit (see :data:`PROBE_KEYS` for every key).

    Construct directly (mappings and lists are accepted and normalised to tuples) or from a job
    file's ``[probe]`` table with :meth:`from_dict`. Values are validated on construction;
    errors are :class:`ProbeParamsError` (a ``ValueError``) naming the key.
    ``schedule`` is normalised to a PathoROB name or a tuple of ``(split_map, max_train_slides)``
    with ``split_map`` a sorted tuple of ``(i, j, take)``; ``test_sets`` / ``group_levels`` to
    tuples of pairs, in the given order.
    """

    schedule: Any = _param(
        "PathoROB name ('camelyon' | 'tcga' | 'tolkach_esca') or a list of splits, each "
        "{split_map = [[i, j, take], ...], max_train_slides = n}; take = training ROWS of "
        "cell (confounder i, class j), a multiple of rows_per_slide; balanced split first",
        _schedule_param, required=True)
    rows_per_slide: int = _param("rows (tiles) per slide; every in-domain slide must hold exactly this many rows",
                                 _at_least(1), required=True)
    n_splits: int | None = _param("walk only the first n splits of a named schedule (default: all)",
                                  _optional(_n_splits), default=None)
    iterations: int = _param("replicates (columns of the matrices), default 20", _at_least(1), default=20)
    seed: int = _param("base seed of the replicate seeds, default 1000", _at_least(0), default=1000)
    validation_fraction: float | None = _param(
        "validation rows per cell as a fraction of its training rows (default: PathoROB's take / max_train_slides)",
        _optional(_fraction), default=None)
    confounder_column: str | None = _param(
        "view column holding the confounder (default: the view's confounder column)", _optional(_column), default=None)
    confounder_order: tuple[str, ...] | None = _param(
        "confounder values in index order (default: sorted unique in-domain values)", _optional(_names), default=None)
    class_order: tuple[str, ...] | None = _param(
        "label values in index order (default: sorted unique in-domain labels)", _optional(_names), default=None)
    id_filter: RowFilter | None = _param(
        "{column, value | values}: the in-domain rows (default: every row no test set selects)",
        _optional(_row_filter), default=None)
    test_sets: Any = _param("{name = {column, value | values}}: unseen-confounder test sets scored by every probe",
                            _test_sets, default=())
    group_levels: Any = _param("{audit level = view column}; must include 'slide' (default {slide = 'group_id'})",
                               _group_levels, default=(("slide", "group_id"),))
    protected_level: str | None = _param(
        "the group level the split protects (default: the coarsest of patient > case > slide in group_levels); "
        "overlaps at coarser identity levels are warnings, not critical", _optional(_protected_level), default=None)
    tile_key: Any = _param("view columns forming a tile's identity (default ['sample_id'])", _tile_key,
                           default=("sample_id",))
    temperature: bool = _param("fit temperature scaling on each probe's validation rows (default false)", _flag,
                               default=False)
    n_bins: int = _param("calibration bins (default 15)", _at_least(2), default=15)

    def __post_init__(self):
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in _validated(raw, where=_SELF, prefix="").items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, d: Mapping, *, source: str, prefix: str = "probe") -> ProbeParams:
        """Parameters from a job file's ``[probe]`` table.

        Parameters
        ----------
        d : mapping of the keys in :data:`PROBE_KEYS` (TOML types: strings, ints, floats,
            booleans, arrays, tables).
        source : str
            Where ``d`` comes from (e.g. the job file path); starts every error message.
        prefix : str
            Dotted name of the table, used in messages (``probe`` -> ``'probe.seed'``).

        Raises
        ------
        ProbeParamsError (a ValueError)
            Not a table; an unknown key (named, with the known keys); a required key missing;
            any invalid value (named by its dotted key).
        """
        dotted = f"{prefix}." if prefix else ""
        if not isinstance(d, Mapping):
            raise ProbeParamsError(f"{source}: '{prefix or 'probe'}' must be a table, got {type(d).__name__}")
        _check_keys(source, dotted, d, tuple(PROBE_KEYS))
        for key, param in _PARAMS.items():
            if param.required and key not in d:
                raise ProbeParamsError(f"{source}: missing required key '{dotted}{key}' ({param.doc})")
        return cls(**_validated(d, where=source, prefix=dotted))

    @classmethod
    def coerce(cls, params: ProbeParams | Mapping, *, source: str = "probe parameters") -> ProbeParams:
        """``params`` itself, or :meth:`from_dict` of a mapping."""
        return params if isinstance(params, ProbeParams) else cls.from_dict(params, source=source, prefix="")

    def to_dict(self) -> dict:
        """Plain JSON-able dict of every parameter (normalised); what fingerprints and provenance hold.
        ``ProbeParams.from_dict(p.to_dict(), source=...) == p``."""
        sched = self.schedule if isinstance(self.schedule, str) else [
            {"split_map": [list(e) for e in sm], "max_train_slides": mts} for sm, mts in self.schedule]
        return {
            "schedule": sched, "rows_per_slide": self.rows_per_slide, "n_splits": self.n_splits,
            "iterations": self.iterations, "seed": self.seed, "validation_fraction": self.validation_fraction,
            "confounder_column": self.confounder_column,
            "confounder_order": None if self.confounder_order is None else list(self.confounder_order),
            "class_order": None if self.class_order is None else list(self.class_order),
            "id_filter": None if self.id_filter is None else self.id_filter.to_dict(),
            "test_sets": {n: f.to_dict() for n, f in self.test_sets},
            "group_levels": dict(self.group_levels), "protected_level": self.protected_level,
            "tile_key": list(self.tile_key),
            "temperature": self.temperature, "n_bins": self.n_bins,
        }

    def resolved_schedule(self) -> list:
        """The schedule as the sweep takes it: ``[(split_map, max_train_slides), ...]``."""

        if isinstance(self.schedule, str):
            return pathorob_schedule(self.schedule, rows_per_slide=self.rows_per_slide, n_splits=self.n_splits)
        return [([tuple(e) for e in sm], mts) for sm, mts in self.schedule]

    @property
    def matrix_names(self) -> list[str]:
        """Names of the matrices a sweep produces: ``in_domain`` then the test sets."""
        return ["in_domain", *(n for n, _ in self.test_sets)]


#: ``[probe]`` key -> its :class:`Param`, in field order (declared on :class:`ProbeParams`).
_PARAMS: dict[str, Param] = {f.name: f.metadata["param"] for f in fields(ProbeParams)}
_DEFAULTS: dict[str, Any] = {f.name: None if f.default is MISSING else f.default for f in fields(ProbeParams)}

#: Keys of the ``[probe]`` table, with their meaning (``*`` = required); read from the fields.
PROBE_KEYS: dict[str, str] = {name: ("* " if p.required else "") + p.doc for name, p in _PARAMS.items()}


def _validated(raw: Mapping, *, where: str, prefix: str) -> dict:
    """Every :class:`ProbeParams` field, normalised by its declared :class:`Param` (the one
    validator of the ``[probe]`` table; a key the table omits takes the field's default)."""
    ctx = _Context(raw, _DEFAULTS, where=where, prefix=prefix)
    return {name: ctx.value(name) for name in _PARAMS}
