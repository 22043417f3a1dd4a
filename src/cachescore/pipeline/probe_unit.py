"""A PathoROB probe sweep as one work unit of a cache job (encoder × view × ``[probe]`` params).

Three layers, each usable alone:

* :class:`ProbeParams` -- the validated, frozen parameters of one sweep (the job file's
  ``[probe]`` table, read with :meth:`ProbeParams.from_dict`);
* :func:`select_probe_rows` / :func:`prepare_probe_inputs` -- from a view (``Cache.read_view``)
  and its embeddings to the sweep's integer arrays: class and confounder names mapped to indices,
  in-domain rows ordered so that every slide's rows are contiguous inside its (confounder, class)
  cell (the sweep's slides are ``rows_per_slide`` consecutive rows of a cell), extra test sets
  and the identities the leakage audit needs;
* :func:`run_probe_unit` -- read the view and only the embedding rows the sweep uses from the
  cache, run :func:`cachescore.probe.evaluate.evaluate_sweep` (``client`` fans replicates out),
  write the evaluation bundle atomically at ``<bundle_root>/<encoder>/<view>/<fingerprint>`` and
  return one results-store record per (matrix, reduction) -- ``apd`` and ``nipd`` of the
  in-domain matrix and of every test set;
* :func:`run_probe_and_store` -- a library entry point for one (encoder, view) outside a job:
  skip a unit whose records are all in the results store, else run it and write its records, or
  record its data error as the failure of each of its record fingerprints. (``cachescore run``
  goes through :func:`cachescore.pipeline.unit.run_probe_task` instead, which honours the
  planner's pinned code version.)

Fingerprints (:func:`probe_unit_fingerprint`) are the sha256 of canonical JSON over the input
fingerprints (embeddings of (encoder, tileset), the view), the normalised parameters and the
code version (:func:`cachescore.fingerprint.code_version` ``("probe")``: the package version plus a digest of ``probe/`` and
this file). The sweep's result does not depend on the number of workers, so the client is not
part of it. Record fingerprints are derived from the unit fingerprint
(:func:`probe_record_fingerprint`), so a planner can tell with :func:`probe_unit_done` whether a
unit is complete in the store without running anything.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .._version import package_versions
from ..fingerprint import code_version as current_code_version

#: Distributions whose versions a probe record stores.
_RECORD_DISTRIBUTIONS = ("cachescore", "numpy", "scikit-learn", "scipy", "pandas", "dask", "distributed", "pyarrow")

__all__ = [
    "PROBE_KEYS",
    "PROBE_METRICS",
    "ProbeInputs",
    "ProbeParams",
    "ProbeParamsError",
    "ProbeSelection",
    "RowFilter",
    "prepare_probe_inputs",
    "probe_record_fingerprint",
    "probe_record_keys",
    "probe_unit_done",
    "probe_unit_fingerprint",
    "run_probe_and_store",
    "run_probe_unit",
    "select_probe_rows",
    "write_probe_records",
]

#: Reductions stored per matrix; the ``metric`` column of the records (display: APD, nIPD).
PROBE_METRICS = ("apd", "nipd")

#: Keys of the ``[probe]`` table, with their meaning (``*`` = required).
PROBE_KEYS: dict[str, str] = {
    "schedule": "* PathoROB name ('camelyon' | 'tcga' | 'tolkach_esca') or a list of splits, each "
                "{split_map = [[i, j, take], ...], max_train_slides = n}; take = training ROWS of "
                "cell (confounder i, class j), a multiple of rows_per_slide; balanced split first",
    "rows_per_slide": "* rows (tiles) per slide; every in-domain slide must hold exactly this many rows",
    "n_splits": "walk only the first n splits of a named schedule (default: all)",
    "iterations": "replicates (columns of the matrices), default 20",
    "seed": "base seed of the replicate seeds, default 1000",
    "validation_fraction": "validation rows per cell as a fraction of its training rows "
                           "(default: PathoROB's take / max_train_slides)",
    "confounder_column": "view column holding the confounder (default: the view's confounder column)",
    "confounder_order": "confounder values in index order (default: sorted unique in-domain values)",
    "class_order": "label values in index order (default: sorted unique in-domain labels)",
    "id_filter": "{column, value | values}: the in-domain rows (default: every row no test set selects)",
    "test_sets": "{name = {column, value | values}}: unseen-confounder test sets scored by every probe",
    "group_levels": "{audit level = view column}; must include 'slide' (default {slide = 'group_id'})",
    "protected_level": "the group level the split protects (default: the coarsest of patient > case > slide "
                       "in group_levels); overlaps at coarser identity levels are warnings, not critical",
    "tile_key": "view columns forming a tile's identity (default ['sample_id'])",
    "temperature": "fit temperature scaling on each probe's validation rows (default false)",
    "n_bins": "calibration bins (default 15)",
}
_REQUIRED = ("schedule", "rows_per_slide")
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
    from ..probe.schedule import PATHOROB_SPLITS

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


def _normalise(d: Mapping, *, where: str, prefix: str) -> dict:
    """Validate and normalise raw parameter values (the keys of :data:`PROBE_KEYS`)."""
    k = lambda name: f"{prefix}{name}"  # noqa: E731
    out: dict = {}
    out["rows_per_slide"] = _int(where, k("rows_per_slide"), d.get("rows_per_slide"), minimum=1)
    out["schedule"] = _schedule(where, k("schedule"), d.get("schedule"), out["rows_per_slide"])
    n_splits = d.get("n_splits")
    if n_splits is not None:
        n_splits = _int(where, k("n_splits"), n_splits, minimum=1)
        if not isinstance(out["schedule"], str):
            raise ProbeParamsError(f"{where}: '{k('n_splits')}' applies to a named schedule only; "
                                   "list only the splits you want instead")
        from ..probe.schedule import PATHOROB_SPLITS

        if n_splits > PATHOROB_SPLITS[out["schedule"]]:
            raise _bad(where, k("n_splits"), f"at most {PATHOROB_SPLITS[out['schedule']]} for "
                       f"{out['schedule']!r}", n_splits)
    out["n_splits"] = n_splits
    out["iterations"] = _int(where, k("iterations"), d.get("iterations", 20), minimum=1)
    out["seed"] = _int(where, k("seed"), d.get("seed", 1000), minimum=0)
    vf = d.get("validation_fraction")
    if vf is not None:
        if isinstance(vf, bool) or not isinstance(vf, (int, float, np.floating, np.integer)) \
                or not 0.0 <= float(vf) < 1.0:
            raise _bad(where, k("validation_fraction"), "a number in [0, 1)", vf)
        vf = float(vf)
    out["validation_fraction"] = vf
    cc = d.get("confounder_column")
    if cc is not None and (not isinstance(cc, str) or not cc.strip()):
        raise _bad(where, k("confounder_column"), "a column name", cc)
    out["confounder_column"] = None if cc is None else cc.strip()
    for name in ("confounder_order", "class_order"):
        v = d.get(name)
        out[name] = None if v is None else _name_list(where, k(name), v)
    idf = d.get("id_filter")
    out["id_filter"] = None if idf is None else RowFilter.parse(idf, where=where, key=k("id_filter"))
    ts = d.get("test_sets", {}) or {}
    if isinstance(ts, Mapping):
        items = list(ts.items())
    elif isinstance(ts, Sequence) and not isinstance(ts, str) and all(
            isinstance(t, Sequence) and not isinstance(t, str) and len(t) == 2 for t in ts):
        items = [tuple(t) for t in ts]
    else:
        raise _bad(where, k("test_sets"), "a table {name = {column, value}}", ts)
    tests = []
    for name, sel in items:
        if not isinstance(name, str) or not name.strip() or name in ("in_domain", "val"):
            raise _bad(where, k("test_sets"), "names other than 'in_domain' and 'val' (reserved roles)", name)
        tests.append((name, RowFilter.parse(sel, where=where, key=f"{k('test_sets')}.{name}")))
    if len({n for n, _ in tests}) != len(tests):
        raise ProbeParamsError(f"{where}: '{k('test_sets')}' names a test set twice")
    out["test_sets"] = tuple(tests)
    gl = d.get("group_levels", {"slide": "group_id"})
    items = list(gl.items()) if isinstance(gl, Mapping) else (list(gl) if isinstance(gl, (list, tuple)) else None)
    if not items or not all(isinstance(t, (tuple, list)) and len(t) == 2 and isinstance(t[0], str)
                            and isinstance(t[1], str) and t[0].strip() and t[1].strip() for t in items):
        raise _bad(where, k("group_levels"), "a table {level = column} with a 'slide' level", gl)
    levels = tuple((str(a).strip(), str(b).strip()) for a, b in items)
    if "slide" not in dict(levels):
        raise ProbeParamsError(f"{where}: '{k('group_levels')}' must name the 'slide' level (the view column "
                               f"whose rows form one slide), got {dict(levels)}")
    reserved = sorted({lvl for lvl, _ in levels} & {"row", "tile"})
    if reserved:
        raise ProbeParamsError(f"{where}: '{k('group_levels')}' uses reserved level name(s) {reserved}")
    out["group_levels"] = levels
    pl = d.get("protected_level")
    if pl is not None and (not isinstance(pl, str) or pl.strip() not in dict(levels)):
        raise _bad(where, k("protected_level"), f"one of the group levels {sorted(dict(levels))}", pl)
    out["protected_level"] = None if pl is None else pl.strip()
    tk = d.get("tile_key", ("sample_id",))
    out["tile_key"] = _name_list(where, k("tile_key"), [tk] if isinstance(tk, str) else tk)
    temp = d.get("temperature", False)
    if not isinstance(temp, (bool, np.bool_)):
        raise _bad(where, k("temperature"), "true or false", temp)
    out["temperature"] = bool(temp)
    out["n_bins"] = _int(where, k("n_bins"), d.get("n_bins", 15), minimum=2)
    return out


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

    schedule: Any
    rows_per_slide: int
    n_splits: int | None = None
    iterations: int = 20
    seed: int = 1000
    validation_fraction: float | None = None
    confounder_column: str | None = None
    confounder_order: tuple[str, ...] | None = None
    class_order: tuple[str, ...] | None = None
    id_filter: RowFilter | None = None
    test_sets: Any = ()
    group_levels: Any = (("slide", "group_id"),)
    protected_level: str | None = None
    tile_key: Any = ("sample_id",)
    temperature: bool = False
    n_bins: int = 15

    def __post_init__(self):
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in _normalise(raw, where=_SELF, prefix="").items():
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
        for key in _REQUIRED:
            if key not in d:
                raise ProbeParamsError(f"{source}: missing required key '{dotted}{key}' ({PROBE_KEYS[key][2:]})")
        return cls(**_normalise(d, where=source, prefix=dotted))

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
        from ..probe.schedule import pathorob_schedule

        if isinstance(self.schedule, str):
            return pathorob_schedule(self.schedule, rows_per_slide=self.rows_per_slide, n_splits=self.n_splits)
        return [([tuple(e) for e in sm], mts) for sm, mts in self.schedule]

    @property
    def matrix_names(self) -> list[str]:
        """Names of the matrices a sweep produces: ``in_domain`` then the test sets."""
        return ["in_domain", *(n for n, _ in self.test_sets)]


# ---------------------------------------------------------------------------------------------
# from a view to the sweep's arrays


def _rows_text(rows: np.ndarray, limit: int = 5) -> str:
    rows = np.asarray(rows)
    head = ", ".join(str(int(r)) for r in rows[:limit])
    return f"{head}{', ...' if rows.size > limit else ''} ({rows.size} in all)"


def _map_values(values: np.ndarray, order: Sequence[str], *, where: str, what: str, view_rows: np.ndarray) -> np.ndarray:
    codes = pd.Index(list(order)).get_indexer(values)
    bad = np.flatnonzero(codes < 0)
    if bad.size:
        unknown = sorted(set(values[bad].tolist()))
        raise ProbeParamsError(f"{where}: {what} value(s) {unknown[:5]} not in the {what}_order {list(order)}, "
                               f"at view rows {_rows_text(view_rows[bad])}")
    return codes.astype(np.int64)


@dataclass(frozen=True, kw_only=True, eq=False)
class ProbeSelection:
    """Which view rows a sweep uses and how they map to its arrays (built from the view only).

    Attributes
    ----------
    id_rows : int64 (n_id,), view positions of the in-domain rows in SWEEP order (slides
        contiguous inside their cell, stable).
    confounders, labels : int64 (n_id,), cell indices per in-domain row.
    groups : {level: ids (n_id,)}; tile_ids : ids (n_id,) or a tuple of id arrays.
    test_rows : {test set: int64 view positions, view order}.
    test_labels, test_confounders : {test set: int64 codes}; unseen confounders get codes after
        ``len(confounder_order)``, in sorted order of their text.
    test_groups : {test set: {level: ids, "tile": tile ids}}.
    confounder_names : every confounder value by code (order first, then unseen values).
    class_names : label values by index; n_ignored : view rows no role selects.
    """

    id_rows: np.ndarray
    confounders: np.ndarray
    labels: np.ndarray
    groups: dict
    tile_ids: Any
    test_rows: dict
    test_labels: dict
    test_confounders: dict
    test_groups: dict
    confounder_names: tuple
    class_names: tuple
    confounder_column: str
    n_view_rows: int
    n_ignored: int

    @property
    def needed_rows(self) -> np.ndarray:
        """View positions whose embeddings the sweep reads: in-domain rows (sweep order), then each
        test set's rows. ``gather_block`` expects its block in this order."""
        return np.concatenate([self.id_rows, *self.test_rows.values()]).astype(np.int64)

    def gather(self, embeddings) -> ProbeInputs:
        """:class:`ProbeInputs` from the view-order embeddings (numpy or dask, ``(n_view_rows, D)``)."""
        shape = getattr(embeddings, "shape", None)
        if shape is None or len(shape) != 2 or shape[0] != self.n_view_rows:
            raise ProbeParamsError(f"embeddings must be a (n_view_rows={self.n_view_rows}, D) matrix in view order, "
                                   f"got shape {shape}")
        block = embeddings[self.needed_rows]
        if hasattr(block, "compute"):
            block = block.compute()
        return self.gather_block(np.asarray(block))

    def gather_block(self, block: np.ndarray) -> ProbeInputs:
        """:class:`ProbeInputs` from the rows of :attr:`needed_rows`, already gathered in that order."""
        block = np.asarray(block)
        if block.ndim != 2 or block.shape[0] != self.needed_rows.size:
            raise ProbeParamsError(f"block must hold the {self.needed_rows.size} needed rows, got shape {block.shape}")
        n_id = self.id_rows.size
        tests, o = {}, n_id
        for name, rows in self.test_rows.items():
            tests[name] = (block[o:o + rows.size], self.test_labels[name])
            o += rows.size
        return ProbeInputs(selection=self, embeddings=block[:n_id], test_sets=tests)


@dataclass(frozen=True, kw_only=True, eq=False)
class ProbeInputs:
    """The sweep's inputs: ``embeddings`` (n_id, D) in sweep order, ``test_sets`` {name: (X, y)},
    and the :class:`ProbeSelection` carrying the integer arrays and identities."""

    selection: ProbeSelection
    embeddings: np.ndarray
    test_sets: dict

    @property
    def confounders(self) -> np.ndarray:
        return self.selection.confounders

    @property
    def labels(self) -> np.ndarray:
        return self.selection.labels

    def sweep_kwargs(self, params: ProbeParams) -> dict:
        """Keyword arguments of :func:`cachescore.probe.sweep.probe_sweep_over_test_sets` (all but the
        three positional arrays)."""
        return {"schedule": params.resolved_schedule(), "test_sets": self.test_sets or None,
                "rows_per_slide": params.rows_per_slide, "iterations": params.iterations, "seed": params.seed,
                "validation_fraction": params.validation_fraction}

    def evaluate_kwargs(self, params: ProbeParams) -> dict:
        """Keyword arguments of :func:`cachescore.probe.evaluate.evaluate_sweep` (no ``client``)."""
        s = self.selection
        n_classes = 1 + max([int(s.labels.max())] + [int(y.max()) for _, y in self.test_sets.values()])
        return {**self.sweep_kwargs(params), "groups": s.groups, "tile_ids": s.tile_ids,
                "test_set_groups": s.test_groups or None, "test_set_confounders": s.test_confounders or None,
                "temperature_scaling": params.temperature, "n_bins": params.n_bins,
                "class_names": list(s.class_names[:n_classes]), "protected_level": params.protected_level}


def select_probe_rows(view_frame: pd.DataFrame, params: ProbeParams, *, source: str = "view") -> ProbeSelection:
    """Map a view to the sweep's rows and integer arrays (no embeddings are read).

    Parameters
    ----------
    view_frame : DataFrame
        The view in view order (``Cache.read_view``: ``label``, ``group_id``, the confounder column
        named in ``attrs["confounder_column"]`` unless ``params.confounder_column`` is set, and
        the columns of the filters, group levels and tile key).
    params : ProbeParams
    source : str
        Names the view in messages.

    Rules: in-domain rows are those of ``params.id_filter`` (default: every row no test set
    selects); a row may not be both in-domain and in a test set. Values are compared as text.
    Each in-domain slide (``group_levels["slide"]``) must lie in one (confounder, class) cell and
    hold exactly ``rows_per_slide`` rows. In-domain rows are ordered by (first view position of
    their slide, view position) -- each slide contiguous, slides in order of first appearance.

    Raises
    ------
    ProbeParamsError (a ValueError)
        A missing column; a filter selecting no row; a row in-domain and in a test set; a label or
        in-domain confounder outside ``class_order`` / ``confounder_order`` (values and view rows
        named); a slide spanning several cells or holding a number of rows other than
        ``rows_per_slide`` (slides named with their row counts).
    """
    frame = view_frame
    where = source
    n = len(frame)
    conf_col = params.confounder_column or frame.attrs.get("confounder_column")
    if not conf_col:
        raise ProbeParamsError(f"{where}: no confounder column: set 'confounder_column' (the frame's attrs do not name one)")
    levels = dict(params.group_levels)
    need = dict.fromkeys(["label", conf_col, *levels.values(), *params.tile_key])
    missing = [c for c in need if c not in frame.columns]
    if missing:
        raise ProbeParamsError(f"{where}: missing column(s) {missing} needed by the probe sweep "
                               f"(columns: {', '.join(map(str, frame.columns))})")
    positions = np.arange(n, dtype=np.int64)
    test_masks = {}
    for name, flt in params.test_sets:
        m = flt.mask(frame, where=f"{where}, test set {name!r}")
        if not m.any():
            raise ProbeParamsError(f"{where}: test set {name!r} ({flt.describe()}) selects no row")
        test_masks[name] = m
    if params.id_filter is not None:
        id_mask = params.id_filter.mask(frame, where=f"{where}, id_filter")
        what = params.id_filter.describe()
    else:
        id_mask = ~np.logical_or.reduce([np.zeros(n, bool), *test_masks.values()])
        what = "rows no test set selects"
    if not id_mask.any():
        raise ProbeParamsError(f"{where}: no in-domain row ({what})")
    for name, m in test_masks.items():
        both = np.flatnonzero(id_mask & m)
        if both.size:
            raise ProbeParamsError(f"{where}: view rows {_rows_text(both)} are both in-domain ({what}) and in "
                                   f"test set {name!r}; the filters must not overlap")
    any_role = id_mask | np.logical_or.reduce([np.zeros(n, bool), *test_masks.values()])

    label_text = frame["label"].astype(str).to_numpy(dtype=object)
    conf_text = frame[conf_col].astype(str).to_numpy(dtype=object)
    p = positions[id_mask]
    class_order = params.class_order or tuple(sorted(set(label_text[p].tolist())))
    conf_order = params.confounder_order or tuple(sorted(set(conf_text[p].tolist())))
    lab = _map_values(label_text[p], class_order, where=f"{where}, in-domain rows", what="class", view_rows=p)
    conf = _map_values(conf_text[p], conf_order, where=f"{where}, in-domain rows", what="confounder", view_rows=p)

    # slides: contiguous inside their cell, in order of first appearance (stable)
    slide_col = levels["slide"]
    slide_vals = frame[slide_col].to_numpy()[p]
    slide_code, slide_uniq = pd.factorize(pd.Series(slide_vals, dtype=object), sort=False)
    if (slide_code < 0).any():
        bad = p[slide_code < 0]
        raise ProbeParamsError(f"{where}: column {slide_col!r} (slide) is missing at view rows {_rows_text(bad)}")
    cell = conf * len(class_order) + lab
    n_slides = len(slide_uniq)
    cell_min = np.full(n_slides, np.iinfo(np.int64).max)
    cell_max = np.full(n_slides, -1)
    np.minimum.at(cell_min, slide_code, cell)
    np.maximum.at(cell_max, slide_code, cell)
    split = np.flatnonzero(cell_min != cell_max)
    if split.size:
        names = [str(slide_uniq[s]) for s in split[:5]]
        raise ProbeParamsError(f"{where}: slide(s) {names} ({split.size} in all, column {slide_col!r}) hold rows of "
                               f"more than one (confounder, class) cell; a slide must carry one label and one "
                               f"{conf_col!r} value")
    counts = np.bincount(slide_code, minlength=n_slides)
    wrong = np.flatnonzero(counts != params.rows_per_slide)
    if wrong.size:
        detail = ", ".join(f"{slide_uniq[s]!s} ({counts[s]} rows)" for s in wrong[:5])
        raise ProbeParamsError(f"{where}: every in-domain slide must hold rows_per_slide={params.rows_per_slide} "
                               f"rows; {wrong.size} of {n_slides} slides (column {slide_col!r}) do not: "
                               f"{detail}{', ...' if wrong.size > 5 else ''}")
    order = np.argsort(slide_code, kind="stable")  # codes are numbered by first appearance
    id_rows = p[order]
    lab, conf = lab[order], conf[order]

    def ids(col: str, rows: np.ndarray) -> np.ndarray:
        return frame[col].to_numpy()[rows]

    def tile(rows: np.ndarray):
        parts = [ids(c, rows) for c in params.tile_key]
        return parts[0] if len(parts) == 1 else tuple(parts)

    groups = {lvl: ids(col, id_rows) for lvl, col in levels.items()}
    # test sets
    unseen = sorted({v for name, m in test_masks.items() for v in conf_text[m].tolist()} - set(conf_order))
    all_conf = (*conf_order, *unseen)
    test_rows, test_labels, test_conf, test_groups = {}, {}, {}, {}
    for name, m in test_masks.items():
        rows = positions[m]
        test_rows[name] = rows
        test_labels[name] = _map_values(label_text[rows], class_order, where=f"{where}, test set {name!r}",
                                        what="class", view_rows=rows)
        test_conf[name] = pd.Index(list(all_conf)).get_indexer(conf_text[rows]).astype(np.int64)
        test_groups[name] = {**{lvl: ids(col, rows) for lvl, col in levels.items()}, "tile": tile(rows)}
    return ProbeSelection(
        id_rows=id_rows, confounders=conf, labels=lab, groups=groups, tile_ids=tile(id_rows),
        test_rows=test_rows, test_labels=test_labels, test_confounders=test_conf, test_groups=test_groups,
        confounder_names=tuple(all_conf), class_names=tuple(class_order), confounder_column=str(conf_col),
        n_view_rows=n, n_ignored=int(n - any_role.sum()),
    )


def prepare_probe_inputs(view_frame: pd.DataFrame, embeddings, params: ProbeParams, *,
                         source: str = "view") -> ProbeInputs:
    """The sweep's inputs from a view and its view-order embeddings ``(len(view_frame), D)``.

    ``select_probe_rows(view_frame, params).gather(embeddings)``; see :func:`select_probe_rows`
    for the rules and errors. Then::

        inputs = prepare_probe_inputs(frame, x, params)
        probe_sweep_over_test_sets(inputs.embeddings, inputs.confounders, inputs.labels,
                                   **inputs.sweep_kwargs(params))
    """
    return select_probe_rows(view_frame, ProbeParams.coerce(params), source=source).gather(embeddings)


# ---------------------------------------------------------------------------------------------
# fingerprints


def _cache(cache):
    from ..cache import Cache

    return cache if isinstance(cache, Cache) else Cache(cache)


def _unit_identity(cache, encoder: str, view: str, params: ProbeParams, code_version: str | None,
                   inputs: Mapping | None = None) -> dict:
    spec = cache.view_spec(view)
    if inputs is None:
        inputs = {"embeddings": cache.embedding_fingerprint(encoder, spec.tileset),
                  "view": cache.view_fingerprint(view)}
    else:
        inputs = {"embeddings": str(inputs["embeddings"]), "view": str(inputs["view"])}
    return {
        "kind": "cachescore.probe-unit/1",
        "encoder": encoder,
        "view": view,
        "tileset": spec.tileset,
        "params": params.to_dict(),
        "inputs": inputs,
        "code": current_code_version("probe") if code_version is None else str(code_version),
    }


def probe_unit_fingerprint(cache, encoder: str, view: str, params: ProbeParams | Mapping,
                           code_version: str | None = None, *, inputs: Mapping | None = None) -> str:
    """sha256 hex of the unit's canonical identity: encoder, view, tileset, normalised params,
    input fingerprints (``Cache.embedding_fingerprint`` of (encoder, the view's tileset),
    ``Cache.view_fingerprint``) and the code version (default :func:`cachescore.fingerprint.code_version` ``("probe")``).

    ``cache`` is a :class:`~cachescore.cache.Cache` or its folder. ``inputs``: the input
    fingerprints ``{"embeddings": ..., "view": ...}`` when the caller already has them (a plan
    computes each once); they must be exactly those two ``Cache`` values, and then only the view
    sidecar is read. Without ``inputs`` the view's Parquet and ``tiles.parquet`` are hashed here.
    Raises what the cache raises for a missing encoder / view (``CacheError`` subclasses),
    ``KeyError`` when ``inputs`` lacks a key.
    """
    from ..store import fingerprint

    return fingerprint(_unit_identity(_cache(cache), encoder, view, ProbeParams.coerce(params), code_version, inputs))


def probe_record_fingerprint(unit_fingerprint: str, matrix: str, metric: str) -> str:
    """Store key of the record of reduction ``metric`` (``apd`` | ``nipd``) of ``matrix``."""
    from ..store import fingerprint

    return fingerprint({"kind": "cachescore.probe-record/1", "unit": unit_fingerprint,
                        "matrix": matrix, "metric": metric})


def probe_record_keys(params: ProbeParams | Mapping) -> list[tuple[str, str]]:
    """``[(matrix, metric), ...]`` a unit with ``params`` produces, in record order."""
    return [(m, r) for m in ProbeParams.coerce(params).matrix_names for r in PROBE_METRICS]


def probe_unit_done(store, unit_fingerprint: str, params: ProbeParams | Mapping) -> bool:
    """True when ``store`` (a ``ResultsStore``) holds every record of the unit (skip it)."""
    return all(store.has(probe_record_fingerprint(unit_fingerprint, m, r)) for m, r in probe_record_keys(params))


# ---------------------------------------------------------------------------------------------
# the unit


def _records(evaluation, *, identity: dict, unit_fp: str, params: ProbeParams, bundle: Path,
             seconds: float, reused: bool, selection: ProbeSelection) -> list[dict]:
    from ..probe.evaluate import role_kind

    records = []
    for name, matrix in evaluation.matrices.items():
        for metric, values in (("apd", evaluation.apd), ("nipd", evaluation.nipd)):
            v = values.get(name)
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
                   client=None, code_version: str | None = None) -> tuple[list[dict], Path]:
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
    from ..probe.bundle import BundleError, read_bundle, write_bundle
    from ..probe.evaluate import evaluate_sweep
    from ..store import fingerprint

    t0 = time.perf_counter()
    params = ProbeParams.coerce(params)
    cache = _cache(cache_root)
    identity = _unit_identity(cache, encoder, view, params, code_version)
    unit_fp = fingerprint(identity)
    tileset = identity["tileset"]
    path = Path(bundle_root) / encoder / view / unit_fp
    frame = cache.read_view(view)
    selection = select_probe_rows(frame, params, source=f"view {view!r} ({cache.root})")

    evaluation, reused = None, False
    if path.exists():
        try:
            evaluation, reused = read_bundle(path), True
        except (BundleError, OSError, KeyError, ValueError):
            evaluation = None
    if evaluation is None:
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
    seconds = time.perf_counter() - t0
    records = _records(evaluation, identity=identity, unit_fp=unit_fp, params=params, bundle=path,
                       seconds=seconds, reused=reused, selection=selection)
    return records, path


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
                        bundle_root, client=None, run_id: str | None = None, force: bool = False) -> dict:
    """The pipeline's entry point for one probe unit: skip, run and store, or record the failure.

    ``store`` is a :class:`~cachescore.store.ResultsStore` (or its folder). When every record of
    the unit is already stored (:func:`probe_unit_done`) and not ``force``, nothing runs. A data
    error (``ValueError``, ``LookupError``, ``FileNotFoundError``, ``RuntimeError``, ... as
    :data:`cachescore.pipeline.unit.DATA_ERRORS`: bad params or view, leakage, a cell too small
    for the schedule, corrupt embeddings) is recorded as the failure of every record
    fingerprint of the unit (so a later success supersedes it) and returned, not raised.

    Returns ``{"fingerprint", "label", "status": "done" | "skipped" | "failed", "seconds",
    "records": [record fingerprints], "bundle": path or None, "error"?}``.
    """
    from ..store import ResultsStore
    from .unit import DATA_ERRORS

    t0 = time.perf_counter()
    store = store if isinstance(store, ResultsStore) else ResultsStore(store)
    params = ProbeParams.coerce(params)
    unit_fp = probe_unit_fingerprint(cache_root, encoder, view, params)
    record_fps = [probe_record_fingerprint(unit_fp, m, r) for m, r in probe_record_keys(params)]
    label = f"{encoder}/{view}/probe"
    status = {"fingerprint": unit_fp, "label": label, "records": record_fps, "bundle": None}
    if not force and probe_unit_done(store, unit_fp, params):
        return {**status, "status": "skipped", "seconds": time.perf_counter() - t0}
    try:
        records, path = run_probe_unit(cache_root, encoder, view, params, bundle_root=bundle_root, client=client)
    except DATA_ERRORS as exc:
        err = f"{type(exc).__name__}: {exc}"
        for (matrix, metric), fp in zip(probe_record_keys(params), record_fps):
            store.record_failure(fp, unit={"encoder": encoder, "view": view, "scope": matrix, "design": "probe",
                                           "family": "probe", "metric": metric, "params": params.to_dict(),
                                           "unit_fingerprint": unit_fp, "run_id": run_id}, error=err)
        return {**status, "status": "failed", "error": err, "seconds": time.perf_counter() - t0}
    write_probe_records(store, records, run_id=run_id)
    return {**status, "status": "done", "bundle": str(path), "seconds": time.perf_counter() - t0}
