"""Aligning deduplicated embeddings with evaluation manifests (spec/metrics.md §9, §1.2).

A row's identity for alignment is the tuple of ``str(v).strip()`` over
:data:`EMBEDDING_SOURCE_COLUMNS` (``sample_id``, ``image_path``, ``label``, ``confounder``,
``group_id``); the column must literally be called ``confounder`` (as produced by
:func:`load_manifest` or metric normalisation). Keys are matched with one vectorised pandas join, not
a per-row Python lookup.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .manifest import GROUP_COLUMN, normalize_manifest

__all__ = [
    "EMBEDDING_SOURCE_COLUMNS",
    "build_embedding_source_manifest",
    "manifest_row_to_embedding_index",
    "expand_features_to_manifest",
    "load_manifest",
]

#: Columns whose normalised values identify an embedded row.
EMBEDDING_SOURCE_COLUMNS = ("sample_id", "image_path", "label", "confounder", GROUP_COLUMN)


def _require_columns(df: pd.DataFrame, source: str) -> None:
    missing = [c for c in EMBEDDING_SOURCE_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{source} is missing required columns for embedding alignment: {missing}")


def _keys(df: pd.DataFrame) -> pd.DataFrame:
    """The five key columns as stripped strings, with a 0..n-1 index."""
    return pd.DataFrame(
        {c: [str(v).strip() for v in df[c].to_numpy(dtype=object)] for c in EMBEDDING_SOURCE_COLUMNS},
        columns=list(EMBEDDING_SOURCE_COLUMNS),
    )


def build_embedding_source_manifest(manifest: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """Deduplicate ``manifest`` by the five-column key, in first-appearance order.

    Returns ``(embedding_manifest, row_to_source)``: the unique keys as a DataFrame with exactly
    :data:`EMBEDDING_SOURCE_COLUMNS` (normalised strings, index 0..K-1), and for every manifest row
    the int index of its key in it. Raises ``ValueError`` naming missing key columns.
    """
    _require_columns(manifest, "manifest")
    keys = _keys(manifest)
    codes, uniques = pd.MultiIndex.from_frame(keys).factorize()
    embedding_manifest = pd.DataFrame(list(uniques), columns=list(EMBEDDING_SOURCE_COLUMNS))
    if len(uniques) == 0:
        embedding_manifest = pd.DataFrame({c: pd.Series([], dtype=object) for c in EMBEDDING_SOURCE_COLUMNS})
    return embedding_manifest, np.asarray(codes, dtype=int)


def manifest_row_to_embedding_index(manifest: pd.DataFrame, embedding_manifest: pd.DataFrame) -> np.ndarray:
    """For each evaluation-manifest row, the row of ``embedding_manifest`` with the same key.

    Raises ``ValueError``: missing key columns (evaluation manifest first), a duplicate key in the
    embedding manifest, or an evaluation row whose key is absent (named by 0-based position).
    """
    _require_columns(manifest, "evaluation manifest")
    _require_columns(embedding_manifest, "embedding manifest")
    emb = _keys(embedding_manifest)
    dup = emb.duplicated(keep=False).to_numpy()
    if dup.any():
        rows = np.flatnonzero(dup)[:5].tolist()
        raise ValueError(f"embedding manifest contains duplicate source rows (rows {rows} share a key)")
    emb["_embedding_row"] = np.arange(len(emb), dtype=np.int64)
    joined = _keys(manifest).merge(emb, how="left", on=list(EMBEDDING_SOURCE_COLUMNS), sort=False)
    target = joined["_embedding_row"].to_numpy(dtype=float)
    missing = np.flatnonzero(np.isnan(target))
    if missing.size:
        more = f" (and {missing.size - 1} more)" if missing.size > 1 else ""
        raise ValueError(f"evaluation manifest row {int(missing[0])} is missing from embedding manifest{more}")
    return target.astype(int)


def expand_features_to_manifest(*, features, manifest: pd.DataFrame, embedding_manifest: pd.DataFrame) -> np.ndarray:
    """Rows of ``features`` (one per ``embedding_manifest`` row) in evaluation-manifest order.

    ``features`` is anything ``np.asarray`` accepts, shape (K, ...). Returns a new array of the same
    dtype with one row per ``manifest`` row (repeated keys repeat the row).

    Raises ``ValueError``, in this order: ``features`` rows differ from ``embedding_manifest`` rows;
    key columns missing from the evaluation manifest, then from the embedding manifest; a duplicate
    key in the embedding manifest; an evaluation row whose key is absent.
    """
    array = np.asarray(features)
    if int(array.shape[0]) != int(len(embedding_manifest)):
        raise ValueError(
            f"embeddings rows must match embedding manifest rows (features has {array.shape[0]}, "
            f"embedding manifest has {len(embedding_manifest)})"
        )
    return array[manifest_row_to_embedding_index(manifest, embedding_manifest)]


def load_manifest(csv_path, *, confounder_column) -> pd.DataFrame:
    """Read a manifest CSV (every column as string), normalise it, set ``dataset`` to the file stem.

    Raises ``FileNotFoundError`` for a missing file and the normalisation ``ValueError``s (spec §1.2)
    with the file named as the source. Empty cells are read as missing, so a blank ``group_id`` is
    reported by row position.
    """
    path = Path(csv_path)
    if not path.exists():
        raise FileNotFoundError(f"Manifest not found: {csv_path}")
    frame = pd.read_csv(path, dtype=str)
    out = normalize_manifest(frame, confounder_column=confounder_column, source=f"manifest {csv_path}")
    out["dataset"] = path.stem
    return out.reset_index(drop=True)
