"""From a view to a probe sweep's arrays (the view-to-arrays adaptor of a probe unit).

:func:`select_probe_rows` / :func:`prepare_probe_inputs` map a view (``Cache.read_view``) and its
embeddings to the sweep's integer arrays: class and confounder names mapped to indices, in-domain
rows ordered so that every slide's rows are contiguous inside its (confounder, class) cell (the
sweep's slides are ``rows_per_slide`` consecutive rows of a cell), extra test sets and the
identities the leakage audit needs. Errors are :class:`~.params.ProbeParamsError` naming the view,
column and rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .evaluate import sweep_arguments
from .params import ProbeParams, ProbeParamsError

__all__ = ["ProbeInputs", "ProbeSelection", "prepare_probe_inputs", "select_probe_rows"]


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
        """Keyword arguments of :func:`cachescore.probe.evaluate.evaluate_sweep` (no ``client``):
        ``params`` (a :class:`~cachescore.probe.evaluate.SweepParams`), ``identities`` and
        ``test_sets``."""
        s = self.selection
        n_classes = 1 + max([int(s.labels.max())] + [int(y.max()) for _, y in self.test_sets.values()])
        return sweep_arguments(**self.sweep_kwargs(params), groups=s.groups, tile_ids=s.tile_ids,
                               test_set_groups=s.test_groups or None, test_set_confounders=s.test_confounders or None,
                               temperature_scaling=params.temperature, n_bins=params.n_bins,
                               class_names=list(s.class_names[:n_classes]), protected_level=params.protected_level)


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
