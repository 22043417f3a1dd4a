"""Manifest normalisation, design resolution, scope construction and feature checks.

This is the validation boundary of the metric API (spec/metrics.md §1, §2). Everything downstream
receives a :class:`PreparedManifest` whose scopes carry integer codes, so kernels never touch
pandas or strings.

Check order matters for which error a caller sees first; the public entry points call these
helpers in the order of the spec's error catalogue (§1.8):

* :func:`coerce_manifest` / :func:`check_features` – types, ndim, row counts, emptiness;
* :func:`normalize_manifest` – confounder column name, required columns, ``group_id``;
* :func:`normalize_design` – ``all`` | ``paired_2x2``;
* :func:`build_scopes` – subset column, blank subsets, incomplete 2x2 subsets;
* :func:`check_finite_rows` – NaN/inf, raised when a scope is about to be searched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ._finite import nonfinite_rows

__all__ = [
    "GROUP_COLUMN",
    "REQUIRED_COLUMNS",
    "DESIGNS",
    "Scope",
    "PreparedManifest",
    "coerce_manifest",
    "check_features",
    "normalize_manifest",
    "normalize_design",
    "build_scopes",
    "prepare",
    "check_finite_rows",
    "dataset_name",
]

#: Independence key: candidates sharing a query's group are never its neighbours.
GROUP_COLUMN = "group_id"
#: Columns every manifest needs, besides the caller-named confounder column.
REQUIRED_COLUMNS = ("sample_id", "image_path", "label", GROUP_COLUMN)
#: Accepted evaluation designs, after strip + lower-case.
DESIGNS = ("all", "paired_2x2")
#: Subset ID reported for the single scope of the ``all`` design.
ALL_SCOPE_ID = "dataset"


@dataclass(frozen=True)
class Scope:
    """One neighbourhood: the rows that are searched against each other.

    All arrays have length ``n`` (rows of the scope, in scope order = manifest order restricted to
    the scope). Codes are ``pandas.factorize`` codes over the scope (first appearance order), so
    they are comparable only within the scope.
    """

    subset: str
    rows: np.ndarray  # int64 manifest positions
    labels: np.ndarray  # int64 label codes
    confounders: np.ndarray  # int64 confounder codes
    groups: np.ndarray  # int64 group codes (equal iff same group_id)

    @property
    def n(self) -> int:
        return int(self.rows.shape[0])

    @property
    def max_group_size(self) -> int:
        """``G``: the largest number of scope rows sharing one group (0 for an empty scope)."""
        return int(np.bincount(self.groups).max()) if self.n else 0


@dataclass(frozen=True)
class PreparedManifest:
    """A validated manifest split into scopes (spec §2)."""

    frame: pd.DataFrame
    dataset: str
    design: str
    scopes: tuple[Scope, ...]

    @property
    def unit(self) -> str:
        return "sample" if self.design == "all" else "occurrence"

    @property
    def n_units(self) -> int:
        return sum(s.n for s in self.scopes)

    @property
    def source_indices(self) -> np.ndarray:
        """Manifest position of every unit, in unit order (subset-major under paired)."""
        if not self.scopes:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([s.rows for s in self.scopes]).astype(np.int64)


def coerce_manifest(manifest, *, infer_types: bool = False, text_columns=()) -> pd.DataFrame:
    """Return ``manifest`` as a DataFrame; a path to ``.parquet`` or ``.csv`` is read.

    CSV columns are read as strings, or with ``infer_types`` as pandas infers them (integers stay
    integers) except ``text_columns``, read as strings. Raises ``TypeError`` for anything else,
    ``FileNotFoundError`` for a missing file and ``ValueError`` for a folder, an unsupported file
    suffix, a CSV that is not UTF-8 or not a table (each naming the path).
    """
    if isinstance(manifest, pd.DataFrame):
        return manifest
    if isinstance(manifest, (str, os.PathLike)):
        path = Path(manifest)
        if path.is_dir():
            raise ValueError(f"manifest {path} is a folder; give the table itself (.csv or .parquet)")
        if not path.exists():
            raise FileNotFoundError(f"manifest not found: {path}")
        suffix = path.suffix.lower()
        if suffix in {".parquet", ".pq"}:
            return pd.read_parquet(path)
        if suffix == ".csv":
            try:
                if not infer_types:
                    return pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8")
                header = pd.read_csv(path, nrows=0, encoding="utf-8").columns
                return pd.read_csv(path, encoding="utf-8", keep_default_na=False,
                                   dtype={c: str for c in header if c in set(text_columns)})
            except UnicodeDecodeError as exc:
                raise ValueError(f"manifest {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                                 "save it as UTF-8") from None
            except pd.errors.ParserError as exc:
                raise ValueError(f"manifest {path} is not a readable CSV table: {exc}") from None
        raise ValueError(f"manifest {path}: unsupported file type {suffix!r}; use .parquet or .csv")
    raise TypeError(f"manifest must be a pandas DataFrame or a path to one, got {type(manifest).__name__}")


def check_features(features, n_rows: int, *, require_units: bool):
    """Validate the embedding matrix against the manifest length (spec §1.6 checks 2–5).

    ``features`` may be a numpy array or a dask array (row-chunked); a dask array is validated
    from its metadata and computed once, here. Returns a numpy array (n_rows, d).

    Raises ``TypeError`` (not an array), ``ValueError`` (not 2-D, row count differs from the
    manifest, or no rows when ``require_units``).
    """
    if _is_dask_array(features):
        if features.ndim != 2:
            raise ValueError(f"features must be a 2-D array of shape (n_rows, n_dims), got {features.ndim}-D")
        if any(np.isnan(c) for c in features.chunks[0]):
            raise ValueError("features is a dask array with unknown row chunk sizes; call .compute_chunk_sizes() first")
        if len(features.chunks[1]) != 1:
            features = features.rechunk({1: -1})
        if features.shape[0] != n_rows:
            raise ValueError(
                f"features has {features.shape[0]} rows but the manifest has {n_rows}: "
                "row i of features must be the embedding of manifest row i"
            )
        features = np.asarray(features.compute())
    elif not isinstance(features, np.ndarray):
        raise TypeError(f"features must be a numpy ndarray or a dask array, got {type(features).__name__}")
    if features.ndim != 2:
        raise ValueError(f"features must be a 2-D array of shape (n_rows, n_dims), got {features.ndim}-D")
    if features.shape[0] != n_rows:
        raise ValueError(
            f"features has {features.shape[0]} rows but the manifest has {n_rows}: "
            "row i of features must be the embedding of manifest row i"
        )
    if require_units and n_rows == 0:
        raise ValueError("the evaluation must contain at least one evaluation unit; the manifest is empty")
    if not (np.issubdtype(features.dtype, np.number) or features.dtype == bool):
        raise TypeError(f"features must have a numeric dtype, got {features.dtype}")
    return features


def _is_dask_array(x) -> bool:
    return type(x).__module__.startswith("dask.array") and hasattr(x, "chunks")


def _strip(v: object) -> str:
    return str(v).strip()


def _strip_column(col: pd.Series, missing_as_blank: bool = False) -> pd.Series:
    """``col.map(_strip)`` (missing → ``""`` when ``missing_as_blank``), vectorised for the common
    case of a pandas string column without missing values (same values, same dtype)."""
    if isinstance(col.dtype, pd.StringDtype) and not col.isna().any():
        return col.str.strip()
    if missing_as_blank:
        return col.map(lambda v: "" if _is_missing(v) else _strip(v))
    return col.map(_strip)


def normalize_manifest(df: pd.DataFrame, *, confounder_column, source: str = "manifest") -> pd.DataFrame:
    """Return a normalised copy (spec §1.2): string-stripped columns, a canonical ``confounder``
    column, a 0..N-1 index.

    Raises ``ValueError`` for a blank confounder column name, missing required columns (with a
    ``slide_id`` → ``group_id`` hint) and blank/missing ``group_id`` values (by row position).
    """
    column = str(confounder_column).strip()
    if not column:
        raise ValueError("confounder_column must be a non-empty string naming a manifest column")
    required = (*REQUIRED_COLUMNS, column)
    missing = [c for c in required if c not in df.columns]
    if missing:
        message = f"{source} is missing required columns: {missing}"
        if GROUP_COLUMN in missing and "slide_id" in df.columns:
            message += (
                f"; it has a 'slide_id' column, which is not read: rename it to '{GROUP_COLUMN}' "
                "(the independence group of each row)"
            )
        raise ValueError(message)

    out = df.copy()
    for name in ("sample_id", "label", "image_path"):
        out[name] = _strip_column(out[name])
    groups = _strip_column(out[GROUP_COLUMN], missing_as_blank=True)
    blank = np.flatnonzero(groups.to_numpy(dtype=object) == "")
    if blank.size:
        shown = [int(i) for i in blank[:5]]
        more = f" (and {blank.size - 5} more)" if blank.size > 5 else ""
        raise ValueError(
            f"{source} has empty {GROUP_COLUMN} values at rows {shown}{more}: every row needs a "
            f"non-empty {GROUP_COLUMN} naming its independence group (slide, case, patient, ...)"
        )
    out[GROUP_COLUMN] = groups
    out["confounder"] = _strip_column(out[column])
    if "subset" in out.columns:
        out["subset"] = _strip_column(out["subset"])
    out.attrs["confounder_column"] = column
    return out.reset_index(drop=True)


def _is_missing(v: object) -> bool:
    if v is None:
        return True
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def normalize_design(evaluation_design) -> str:
    """Strip and lower-case; raise ``ValueError`` naming only the two valid designs."""
    design = str(evaluation_design).strip().lower()
    if design not in DESIGNS:
        raise ValueError("evaluation_design must be 'all' or 'paired_2x2'")
    return design


def dataset_name(frame: pd.DataFrame) -> str:
    """``result.dataset`` (spec §1.5): first row's ``dataset`` value, else ``"dataset"``."""
    if "dataset" not in frame.columns or len(frame) == 0:
        return "dataset"
    value = str(frame["dataset"].iloc[0]).strip()
    return value or "dataset"


def _first_appearance_codes(x: np.ndarray) -> np.ndarray:
    """``pandas.factorize`` codes of an int array (0, 1, 2, ... in order of first appearance)."""
    if x.size == 0:
        return np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(x, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)
    return rank[inverse.ravel()]


def _scope(subset: str, rows: np.ndarray, labels: np.ndarray, confounders: np.ndarray, groups: np.ndarray) -> Scope:
    """Build a scope from manifest-wide integer codes restricted to ``rows``."""
    return Scope(
        subset=subset,
        rows=rows.astype(np.int64),
        labels=_first_appearance_codes(labels[rows]),
        confounders=_first_appearance_codes(confounders[rows]),
        groups=_first_appearance_codes(groups[rows]),
    )


def _is_complete_2x2(labels: np.ndarray, confounders: np.ndarray) -> bool:
    """Exactly 2 labels, exactly 2 confounders, and all 4 cells occupied."""
    n_labels = np.unique(labels).size
    n_confounders = np.unique(confounders).size
    if n_labels != 2 or n_confounders != 2:
        return False
    cells = np.unique(labels.astype(np.int64) * (int(confounders.max()) + 1) + confounders)
    return cells.size == 4


def build_scopes(frame: pd.DataFrame, design: str, *, validate_subsets: bool = True) -> tuple[Scope, ...]:
    """Split a normalised manifest into scopes (spec §2, §1.4).

    ``all``: one scope of every row. ``paired_2x2``: one scope per subset, in sorted string order;
    with ``validate_subsets`` (the public ``compute`` paths) any subset that is not a complete 2x2
    raises ``ValueError`` listing the subset IDs; without it (``recommend_tau``) such subsets are
    skipped. Codes are computed once manifest-wide and re-factorised per scope with numpy, so
    thousands of subsets cost milliseconds.
    """
    labels = pd.factorize(frame["label"])[0].astype(np.int64)
    confounders = pd.factorize(frame["confounder"])[0].astype(np.int64)
    groups = pd.factorize(frame[GROUP_COLUMN])[0].astype(np.int64)
    if design == "all":
        return (_scope(ALL_SCOPE_ID, np.arange(len(frame)), labels, confounders, groups),)
    if "subset" not in frame.columns:
        raise ValueError("the paired_2x2 design needs a 'subset' column defining subset membership")
    subsets = frame["subset"].to_numpy(dtype=object)
    blank = np.flatnonzero(subsets == "")
    if blank.size:
        shown = [int(i) for i in blank[:5]]
        raise ValueError(f"manifest contains blank subset values at rows {shown}")
    codes, uniques = pd.factorize(frame["subset"])
    order = np.argsort(codes, kind="stable")
    bounds = np.cumsum(np.bincount(codes, minlength=len(uniques)))[:-1]
    by_subset = dict(zip((str(u) for u in uniques), np.split(order, bounds)))
    scopes, invalid = [], []
    for subset in sorted(by_subset):
        rows = by_subset[subset]
        if not _is_complete_2x2(labels[rows], confounders[rows]):
            invalid.append(subset)
            continue
        scopes.append(_scope(subset, rows, labels, confounders, groups))
    if invalid and validate_subsets:
        raise ValueError(
            "paired_2x2 needs every subset to be a complete 2x2 (exactly 2 labels x 2 confounders, "
            f"every cell non-empty); invalid subsets: {', '.join(invalid)}"
        )
    return tuple(scopes)


def prepare(manifest: pd.DataFrame, *, confounder_column, evaluation_design, validate_subsets: bool = True) -> PreparedManifest:
    """Normalise, resolve the design and build scopes, in the catalogue's order."""
    frame = normalize_manifest(manifest, confounder_column=confounder_column)
    design = normalize_design(evaluation_design)
    scopes = build_scopes(frame, design, validate_subsets=validate_subsets)
    return PreparedManifest(frame=frame, dataset=dataset_name(frame), design=design, scopes=scopes)


def check_finite_rows(features: np.ndarray, rows: np.ndarray | None = None, *, source: str = "features") -> None:
    """Raise ``ValueError`` naming the first offending rows if any entry is NaN or ±inf.

    A cheap sum is tried first; the element-wise scan runs only to build the message. ``rows``
    restricts the check to those manifest positions (a scope).
    """
    block = features if rows is None else features[rows]
    bad = nonfinite_rows(block)
    if bad.size == 0:
        return
    positions = bad if rows is None else np.asarray(rows)[bad]
    shown = [int(i) for i in positions[:5]]
    more = f" (and {bad.size - 5} more)" if bad.size > 5 else ""
    raise ValueError(f"{source} contains NaN or infinite values at rows {shown}{more}")
