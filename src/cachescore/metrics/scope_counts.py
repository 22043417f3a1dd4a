"""A view's scopes as counts of their rows' (group, label, confounder) combinations.

Planning refuses units whose scope cannot give a defined score (a single confounder value or
label, :func:`cachescore.pipeline.plan.undefined_scope`) or is too small for a family's
parameters (``Family.scope_problem``: k below the scope size, CRoMa's ``m`` SO and OS candidates
outside each row's group). Every one of these facts depends on a row only through its group,
label and confounder value, so a scope is described by its distinct combinations of the three
and how many rows hold each: :class:`ScopeCounts`. A view of millions of rows has tens of
thousands of combinations (one or a few per slide), so planning holds those, never the rows.

:func:`scopes_from_combinations` builds them from the output of
:meth:`cachescore.cache.Cache.view_combinations` (a large view, read in batches) or
:func:`frame_combinations` (a view frame already in memory): both give the same scopes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .. import _combinations

__all__ = ["ScopeCounts", "frame_combinations", "scopes_from_combinations"]


@dataclass(frozen=True, eq=False)
class ScopeCounts:
    """One scope (the whole view, or one subset of a paired view) as K combinations.

    ``group``, ``label``, ``confounder``: (K,) object arrays of text (label and confounder
    stripped, as the metrics compare them; ``group_id`` as stored), each (group, label,
    confounder) once; ``rows``: (K,) int64, the scope's rows holding it (>= 1); ``first``: (K,)
    int64, the first of those rows as a position in the view (for messages).
    """

    group: np.ndarray
    label: np.ndarray
    confounder: np.ndarray
    rows: np.ndarray
    first: np.ndarray

    @property
    def n_rows(self) -> int:
        """Rows of the scope."""
        return int(self.rows.sum())


def frame_combinations(frame: pd.DataFrame, columns, *, strip=()):
    """What :meth:`cachescore.cache.Cache.view_combinations` returns, from a frame in view order
    (values as ``str``, stripped for the columns in ``strip``)."""
    codes, seen = [], []
    for name in columns:
        text = frame[name].astype(str)
        values = text.str.strip() if name in strip else text
        c, uniques = pd.factorize(values.to_numpy(dtype=object))
        codes.append(c.astype(np.int64))
        seen.append(list(uniques))
    combos = _combinations.count(np.stack(codes, axis=1) if codes else np.zeros((len(frame), 0), np.int64))
    names = []
    for j, values in enumerate(seen):
        sorted_names, rank = _combinations.by_sorted_names(values)
        names.append(sorted_names)
        if len(combos[0]):
            combos[0][:, j] = rank[combos[0][:, j]]
    return names, combos


def scopes_from_combinations(names, combos, *, subset: bool) -> list[tuple[str, ScopeCounts]]:
    """``[(scope name, ScopeCounts)]`` from combinations of the columns ``label``, confounder,
    ``group_id`` (and ``subset`` last when ``subset``): the whole view as ``"dataset"``, or each
    subset in sorted order of its (stripped) name."""
    codes, rows, first = combos
    values = [np.asarray(n, dtype=object) for n in names]

    def scope(sel) -> ScopeCounts:
        return ScopeCounts(group=values[2][codes[sel, 2]], label=values[0][codes[sel, 0]],
                           confounder=values[1][codes[sel, 1]], rows=rows[sel], first=first[sel])

    if not subset:
        return [("dataset", scope(np.arange(len(rows))))]
    return [(str(values[3][s]), scope(np.flatnonzero(codes[:, 3] == s)))
            for s in range(len(values[3])) if np.any(codes[:, 3] == s)]
