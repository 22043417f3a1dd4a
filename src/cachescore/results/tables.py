"""Where the tidy tables live: ``<store>/scores.parquet`` and ``<store>/probe.parquet`` (atomic,
rewritten after every run) and ``cachescore export`` copies in Parquet, CSV or JSON."""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .._atomic import atomic_write, atomic_write_bytes
from ..store.results import CENTRES_FILE, PROBE_FILE, SCORES_FILE  # the store's file names

__all__ = ["SCORES_FILE", "PROBE_FILE", "CENTRES_FILE", "EXPORT_FORMATS", "publish_tables", "export_tables", "read_scores"]

#: Formats ``cachescore export`` writes.
EXPORT_FORMATS = ("parquet", "csv", "json")


def _write_parquet(path: Path, df: pd.DataFrame) -> Path:
    table = pa.Table.from_pandas(df, preserve_index=False)
    return atomic_write(path, lambda fh: pq.write_table(table, fh))


def publish_tables(store_path, scores: pd.DataFrame, probe: pd.DataFrame,
                   centres: pd.DataFrame | None = None) -> dict[str, Path]:
    """Write ``scores``, ``probe`` (and ``centres``) to ``<store>/scores.parquet``,
    ``probe.parquet`` and ``probe_centres.parquet``, each by an atomic rename (a reader sees the old
    table or the new one, never a partial file)."""
    root = Path(store_path)
    out = {"scores": _write_parquet(root / SCORES_FILE, scores), "probe": _write_parquet(root / PROBE_FILE, probe)}
    if centres is not None:
        out["probe_centres"] = _write_parquet(root / CENTRES_FILE, centres)
    return out


def read_scores(store_path) -> pd.DataFrame:
    """``<store>/scores.parquet`` (``pd.read_parquet`` works on it directly; this names the file in
    the error when a store has none yet: ``FileNotFoundError``)."""
    path = Path(store_path) / SCORES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist yet: run the job first (cachescore run JOB)")
    return pd.read_parquet(path)


def export_tables(scores: pd.DataFrame, probe: pd.DataFrame, out, *, fmt: str = "parquet",
                  centres: pd.DataFrame | None = None) -> list[Path]:
    """Write the tables next to ``out``: ``<out>`` gets the scores, ``<stem>.probe<suffix>`` the
    probe accuracies, ``<stem>.probe_centres<suffix>`` the per-centre probe metrics (``fmt``:
    parquet, csv or json records). Returns the paths written; every file is written atomically.
    Raises ``ValueError`` for an unknown format."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {', '.join(EXPORT_FORMATS)}")
    out = Path(out)
    suffix = out.suffix or "." + fmt
    pairs = [(scores, out), (probe, out.with_name(f"{out.stem}.probe{suffix}"))]
    if centres is not None:
        pairs.append((centres, out.with_name(f"{out.stem}.probe_centres{suffix}")))
    written = []
    for df, path in pairs:
        if fmt == "parquet":
            _write_parquet(path, df)
        elif fmt == "csv":
            buf = io.StringIO()
            df.to_csv(buf, index=False)
            atomic_write_bytes(path, buf.getvalue().encode("utf-8"))
        else:
            atomic_write_bytes(path, df.to_json(orient="records", date_format="iso", indent=1).encode("utf-8"))
        written.append(path)
    return written
