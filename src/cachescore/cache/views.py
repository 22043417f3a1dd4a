"""Views from the command line: select tiles of a tileset, subsample them per slide, write the view.

:func:`make_view` is what ``cachescore view`` calls. It reads the tileset's ``tiles.parquet``,
keeps the rows matching every ``where`` condition, checks that the label, group and confounder
columns have no blank or null value (naming rows), optionally keeps exactly ``rows_per_slide`` tiles
per slide (a seeded choice that depends only on the seed and each tile's ``sample_id``: the same
call gives the same view, and adding slides does not change the tiles chosen on the others), and
writes the view with :func:`~.writer.write_view`. Slides with fewer tiles are dropped and counted,
or kept whole when they have at least ``min_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import ViewError
from .layout import check_name
from .reader import Cache
from .writer import _rows, blank_rows, write_view

__all__ = ["make_view", "ViewSummary", "parse_where"]


@dataclass(frozen=True)
class ViewSummary:
    """What :func:`make_view` wrote: the view's path, its rows and slides, and the slides it dropped
    (``dropped``: slide id -> tile count) because they had fewer than ``rows_per_slide`` tiles."""

    path: Path
    rows: int
    slides: int
    dropped: dict = field(default_factory=dict)


def parse_where(items) -> dict[str, list[str]]:
    """``["centre=A", "centre=B", "scanner=X"]`` -> ``{"centre": ["A", "B"], "scanner": ["X"]}``
    (one column's values are alternatives, columns must all match). Raises ``ValueError`` for an
    item without ``=`` or with an empty column name."""
    out: dict[str, list[str]] = {}
    for item in items or []:
        col, sep, value = str(item).partition("=")
        if not sep or not col.strip():
            raise ValueError(f"--where expects COLUMN=VALUE, got {item!r}")
        out.setdefault(col.strip(), []).append(value.strip())
    return out


def _seeded_keys(sample_ids: pd.Series, seed: int) -> np.ndarray:
    """One pseudo-random uint64 per tile from (seed, sample_id) only."""
    key = f"{int(seed) & 0xFFFFFFFFFFFF:016x}"[-16:]
    return pd.util.hash_pandas_object(sample_ids.astype(str), index=False, hash_key=key).to_numpy()


def make_view(cache_root, *, tileset: str, name: str, confounder: str, label: str = "label", group: str = "group_id",
              design: str | None = None, where: dict | None = None, rows_per_slide: int | None = None,
              seed: int = 0, min_rows: int | None = None, slide_column: str | None = None,
              overwrite: bool = False) -> ViewSummary:
    """Write view ``name`` over tileset ``tileset`` of the cache at ``cache_root`` (module docstring).

    The view's columns are ``sample_id``, ``label`` (from ``label``), ``group_id`` (from ``group``)
    and the confounder column under its own name. ``slide_column`` (default: ``group``) defines
    the slides of ``rows_per_slide``. Raises ``ValueError`` subclasses naming the tileset, column
    and rows (unknown column, blank values, nothing left after ``where``, bad numbers),
    ``FileExistsError`` (the view exists, no ``overwrite``).
    """
    check_name("view", name)
    cache = Cache(cache_root)
    tiles = cache.read_tileset(tileset)
    source = f"tileset {tileset!r} ({cache.root})"
    slide_column = slide_column or group
    needed = {"label": label, "group": group, "confounder": confounder, "slide": slide_column}
    for col in {*needed.values(), *(where or {})}:
        if col not in tiles.columns:
            raise ViewError(f"{source}: no column {col!r} (columns: {sorted(map(str, tiles.columns))})")
    keep = np.ones(len(tiles), dtype=bool)
    for col, values in (where or {}).items():
        keep &= tiles[col].astype(str).str.strip().isin(values).to_numpy()
    rows = np.flatnonzero(keep)
    if not rows.size:
        raise ViewError(f"{source}: no tile matches --where {where}")
    picked = tiles.iloc[rows].reset_index(drop=True)
    for what, col in needed.items():
        blank = blank_rows(picked[col])
        if blank.size:
            raise ViewError(f"{source}: {what} column {col!r} is blank or null at {blank.size} tile(s): tileset rows "
                            f"{_rows(rows[blank])}")
    dropped: dict = {}
    if rows_per_slide is not None:
        n = int(rows_per_slide)
        if n < 1:
            raise ValueError(f"--rows-per-slide must be a positive integer, got {rows_per_slide!r}")
        floor = n if min_rows is None else int(min_rows)
        if not 1 <= floor <= n:
            raise ValueError(f"--min-rows must be between 1 and --rows-per-slide ({n}), got {min_rows!r}")
        slide = picked[slide_column].astype(str)
        counts = slide.map(slide.value_counts())
        order = pd.DataFrame({"slide": slide, "key": _seeded_keys(picked["sample_id"], seed),
                              "pos": np.arange(len(picked))}).sort_values(["slide", "key", "pos"], kind="stable")
        rank = order.groupby("slide", sort=False).cumcount().to_numpy()
        chosen = np.zeros(len(picked), dtype=bool)
        chosen[order["pos"].to_numpy()[rank < n]] = True
        small = counts.to_numpy() < floor
        dropped = {str(s): int(c) for s, c in slide[small].value_counts().sort_index().items()}
        chosen &= ~small
        rows, picked = rows[chosen], picked[chosen].reset_index(drop=True)
        if not len(picked):
            raise ViewError(f"{source}: every slide has fewer than {floor} tiles; none is left for the view")
    frame = pd.DataFrame({"sample_id": picked["sample_id"].to_numpy(), "label": picked[label].to_numpy(),
                          "group_id": picked[group].to_numpy()})
    if confounder not in frame.columns:
        frame[confounder] = picked[confounder].to_numpy()
    path = write_view(cache.root, name, frame, tileset=tileset, confounder_column=confounder, design=design,
                      overwrite=overwrite)
    return ViewSummary(path=Path(path), rows=len(frame), slides=int(picked[slide_column].nunique()), dropped=dropped)
