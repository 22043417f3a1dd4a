"""Write tilesets, embeddings and views into a cache folder (layout: :mod:`cachescore.cache.layout`).

Every write is atomic: tables and JSON go through a ``.partial`` sibling + rename, embeddings are
written into a hidden staging folder that is renamed into place only when every shard and
``meta.json`` are complete. Nothing is overwritten unless ``overwrite=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .._finite import nonfinite_rows
from .._atomic import (
    PARTIAL_SUFFIX,
    atomic_replace_dir,
    atomic_write,
    atomic_write_json,
)
from . import text
from .errors import (
    AlignmentError,
    CacheError,
    CacheNotFoundError,
    LayoutError,
    NonFiniteError,
    ViewError,
)
from .formats import StorageOptions, linked_shards, write_zarr_shard
from .layout import (
    LINKED_FORMAT,
    ZARR_FORMAT,
    FLOAT_DTYPES,
    META_FORMAT,
    META_VERSION,
    SIDECAR_VERSION,
    check_name,
    embeddings_dir,
    tiles_path,
    view_sidecar_path,
    view_table_path,
    writable_root,
)

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "write_tileset",
    "write_embeddings",
    "write_embeddings_blocks",
    "write_view",
    "delete_view",
    "StoredTable",
    "default_shard_rows",
    "normalize_ids",
    "normalized_text",
    "sample_ids_digest",
]

#: Target size of one embedding shard (and of one dask chunk when reading): 128 MiB.
DEFAULT_SHARD_BYTES = 128 << 20
#: Rows copied per step while streaming a shard to disk (bounds writer memory).
_COPY_ROWS = 65536


def default_shard_rows(dim: int, itemsize: int, target_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Rows per shard so that one shard holds about ``target_bytes`` (at least 1 row)."""
    return max(1, int(target_bytes) // max(1, int(dim) * int(itemsize)))


def normalize_ids(values, *, source: str, column: str = "sample_id") -> np.ndarray:
    """``str(v).strip()`` of every value as an object array; missing or blank values raise ``ViewError``
    naming ``source``, ``column`` and the first offending row positions (see :func:`normalized_text`)."""
    return normalized_text(values, source=source, column=column).to_numpy(dtype=object)


def normalized_text(values, *, source: str, column: str = "sample_id") -> pd.Series:
    """``str(v).strip()`` of every value as a Series (index 0..n-1): Arrow-backed text when
    ``values`` is Arrow text without missing values (no Python string is made), else Python
    objects. Missing or blank values raise ``ViewError`` naming ``source``, ``column`` and rows."""
    arr = text.arrow_text(values)
    if arr is not None:
        arr = text.strip(arr)
        bad = text.blank_positions(arr)
        out = None if bad.size else text.as_series(arr)
    else:
        series = pd.Series(values, copy=False).reset_index(drop=True)
        stripped = _strip_strings(series)
        bad = np.flatnonzero(series.isna().to_numpy() | (stripped == ""))
        out = pd.Series(stripped, dtype=object)
    if bad.size:
        raise ViewError(f"{source}: column {column!r} has missing or blank values at rows {_rows(bad)}")
    return out


def duplicate_rows(values) -> np.ndarray:
    """Positions of every value that occurs more than once (empty when all are unique)."""
    arr = text.arrow_text(values)
    if arr is not None:
        return text.duplicate_positions(arr)
    return np.flatnonzero(pd.Series(values, copy=False).duplicated(keep=False).to_numpy())


def _strip_strings(series: pd.Series) -> np.ndarray:
    """``str(v).strip()`` for every value, as an object array (missing values become ``""``)."""
    text_series = series.astype(object).where(series.notna(), "").astype(str)
    return text_series.str.strip().to_numpy(dtype=object)


def _stripped_text(series: pd.Series) -> pd.Series:
    """``str(v).strip()`` of a column that must not be blank-checked (e.g. ``image_path``): Arrow
    text stays Arrow, anything else becomes Python strings (missing values ``""``)."""
    arr = text.arrow_text(series)
    if arr is not None:
        return text.as_series(text.strip(arr), name=series.name)
    return pd.Series(_strip_strings(series), dtype=object, name=series.name)


def blank_rows(series: pd.Series) -> np.ndarray:
    """Positions whose value is missing (None/NaN/NA) or a string that is blank after stripping."""
    arr = text.arrow_text(series)
    if arr is not None:
        return text.blank_positions(text.strip(arr))
    series = series.reset_index(drop=True)
    missing = series.isna().to_numpy()
    if series.dtype == object or pd.api.types.is_string_dtype(series.dtype):
        missing = missing | (_strip_strings(series) == "")
    return np.flatnonzero(missing)


def sample_ids_digest(ids) -> str:
    """sha256 of the JSON list of normalised sample IDs (pins row alignment of embeddings). ``ids``:
    an object array, a Series or an Arrow array of strings; Arrow text is hashed from its buffers."""
    arr = text.arrow_text(ids)
    if arr is None and isinstance(ids, pd.Series):
        ids = ids.to_numpy(dtype=object)
    if arr is None and isinstance(ids, np.ndarray) and ids.dtype == object:
        try:
            arr = pa.array(ids, type=pa.large_string())
        except (pa.ArrowException, TypeError):
            arr = None
    digest = text.json_list_sha256(arr) if arr is not None and not arr.null_count else None
    if digest is not None:
        return digest
    return hashlib.sha256(json.dumps([str(v) for v in ids], separators=(",", ":")).encode("utf-8")).hexdigest()


def _rows(positions: np.ndarray, limit: int = 5) -> str:
    shown = [int(i) for i in np.asarray(positions)[:limit]]
    more = f" (and {len(positions) - limit} more)" if len(positions) > limit else ""
    return f"{shown}{more}"


class StoredTable:
    """A table as :func:`_write_parquet` serialises it: its Arrow form (``table``) and the exact
    Parquet bytes (``data``). The importer keeps the tileset's, so a view of exactly the tileset's
    rows and columns is published from the same bytes instead of being encoded again."""

    __slots__ = ("table", "data")

    def __init__(self, table: pa.Table, data: pa.Buffer):
        self.table, self.data = table, data


def parquet_bytes(frame: pd.DataFrame, *, string_columns: tuple[str, ...], source: str,
                  like: StoredTable | None = None) -> StoredTable:
    """``frame`` serialised as :func:`_write_parquet` stores it. When ``like`` holds an equal table
    (``Table.equals``: the same schema and values), its bytes are reused: they encode exactly this
    table (and, the frame laid out as the tileset's was, are the bytes encoding would give)."""
    table = parquet_table(frame, string_columns=string_columns, source=source)
    if like is not None and like.table.equals(table):
        return StoredTable(table, like.data)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return StoredTable(table, sink.getvalue())


def _write_parquet(path: Path, frame: pd.DataFrame, *, string_columns: tuple[str, ...], overwrite: bool, source: str,
                   like: StoredTable | None = None) -> StoredTable:
    """Write ``frame`` as Parquet with an explicit schema: ``string_columns`` as ``string``, the rest
    as pyarrow infers them from pandas (no index). The file is serialised in memory first (see
    :func:`parquet_bytes` for ``like``) and published atomically; returns what was written."""
    stored = parquet_bytes(frame, string_columns=string_columns, source=source, like=like)
    atomic_write(path, lambda fh: fh.write(stored.data), overwrite=overwrite)
    return stored


def parquet_table(frame: pd.DataFrame, *, string_columns: tuple[str, ...], source: str) -> pa.Table:
    """``frame`` as the Arrow table :func:`_write_parquet` stores (explicit schema, no metadata)."""
    for name in frame.columns:
        if not isinstance(name, str):
            raise CacheError(f"{source}: column names must be strings, got {name!r}")
    try:
        inferred = pa.Schema.from_pandas(frame, preserve_index=False)
    except (pa.ArrowException, TypeError, ValueError):
        inferred = None  # name the column that cannot be stored
    fields = []
    for name in frame.columns:
        if name in string_columns:
            fields.append(pa.field(name, pa.string()))
        elif inferred is not None:
            fields.append(pa.field(name, inferred.field(name).type))
        else:
            try:
                fields.append(pa.field(name, pa.Schema.from_pandas(frame[[name]], preserve_index=False).field(name).type))
            except (pa.ArrowException, TypeError, ValueError) as exc:
                raise CacheError(f"{source}: column {name!r} cannot be stored in Parquet: {exc}") from exc
    schema = pa.schema(fields)
    try:
        table = pa.Table.from_pandas(frame, schema=schema, preserve_index=False).replace_schema_metadata(None)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise CacheError(f"{source}: cannot convert to Parquet with schema {schema}: {exc}") from exc
    return table


def write_tileset(root, tileset: str, frame: pd.DataFrame, *, overwrite: bool = False) -> Path:
    """Write ``tilesets/<tileset>/tiles.parquet``.

    ``frame`` needs ``sample_id`` (unique after ``str(v).strip()``) and ``image_path``; any other
    columns are kept as metadata. Row order is the row order of every embedding of this tileset.
    Both required columns are stored as normalised strings.

    Raises ``ValueError`` (bad name), :class:`ViewError` (missing column, blank or duplicate
    sample_id, naming rows), ``FileExistsError`` (exists and not ``overwrite``). Returns the path.
    """
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"tileset {tileset!r}: frame must be a pandas DataFrame, got {type(frame).__name__}")
    store_tileset_frame(root, tileset, tileset_frame(tileset, frame), overwrite=overwrite)
    return tiles_path(writable_root(root), tileset)


#: The columns stored as Arrow ``string`` in ``tiles.parquet`` (and in a view, where present).
_TILESET_TEXT = ("sample_id", "image_path")


def store_tileset_frame(root, tileset: str, out: pd.DataFrame, *, overwrite: bool = False) -> StoredTable:
    """Write a frame :func:`tileset_frame` returned (already normalised and checked: the importer
    does not normalise a manifest of millions of tiles twice); returns the table and bytes written
    (``write_view(..., tileset_table=...)`` reuses them)."""
    path = tiles_path(writable_root(root), tileset)
    return _write_parquet(path, out, string_columns=_TILESET_TEXT, overwrite=overwrite, source=f"tileset {tileset!r}")


def tileset_frame(tileset: str, frame: pd.DataFrame) -> pd.DataFrame:
    """The frame :func:`write_tileset` would store (normalised ids, checked), without writing it:
    the importer compares it with an existing tileset's. Raises like :func:`write_tileset`."""
    check_name("tileset", tileset)
    source = f"tileset {tileset!r}"
    missing = [c for c in ("sample_id", "image_path") if c not in frame.columns]
    if missing:
        raise ViewError(f"{source}: missing required columns {missing}")
    if "row" in frame.columns:
        raise ViewError(f"{source}: column 'row' is reserved (cachescore adds it when reading views)")
    ids = normalized_text(frame["sample_id"], source=source)
    where = duplicate_rows(ids)
    if where.size:
        raise ViewError(f"{source}: column 'sample_id' must be unique; duplicates at rows {_rows(where)} "
                        f"(e.g. {ids.iloc[where[0]]!r})")
    out = frame.reset_index(drop=True).copy()
    out["sample_id"] = ids
    out["image_path"] = _stripped_text(out["image_path"])
    return out


def _tileset_ids(root: Path, tileset: str) -> pd.Series:
    """The stored ``sample_id`` column of ``tileset`` in row order (Parquet text as pandas reads it)."""
    path = tiles_path(root, tileset)
    if not path.is_file():
        raise CacheNotFoundError(f"tileset {tileset!r} not found: {path}; write it first with write_tileset")
    try:
        col = pq.read_table(path, columns=["sample_id"]).column("sample_id")
    except (pa.ArrowException, OSError, KeyError) as exc:
        raise LayoutError(f"{path}: cannot read column 'sample_id': {exc}") from exc
    return col.to_pandas()


class _HashingWriter:
    """File wrapper that feeds every written byte to a sha256."""

    def __init__(self, fh):
        self.fh, self.sha = fh, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.fh.write(data)


def write_embeddings_blocks(
    root,
    encoder: str,
    tileset: str,
    *,
    n_rows: int,
    dim: int,
    dtype,
    read_block: Callable[[int, int], np.ndarray],
    shard_rows: int | None = None,
    overwrite: bool = False,
    check_finite: bool = True,
    source: str | None = None,
    storage: StorageOptions | None = None,
) -> Path:
    """Stream an embedding array into row shards; ``read_block(start, stop)`` returns rows
    ``start:stop`` as an array of shape ``(stop - start, dim)`` and ``dtype``.

    This is the engine of :func:`write_embeddings`; memory is bounded by one copy step, not by
    ``n_rows``. Stages with :func:`stage_embeddings_blocks`, then publishes by rename. Raises like
    :func:`write_embeddings`.
    """
    root = writable_root(root)
    target = embeddings_dir(root, check_name("encoder", encoder), check_name("tileset", tileset))
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it")
    staging, _ = stage_embeddings_blocks(root, encoder, tileset, ids=_tileset_ids(root, tileset), n_rows=n_rows,
                                         dim=dim, dtype=dtype, read_block=read_block, shard_rows=shard_rows,
                                         check_finite=check_finite, source=source, storage=storage)
    return atomic_replace_dir(staging, target, overwrite=overwrite)


def stage_embeddings_blocks(
    root,
    encoder: str,
    tileset: str,
    *,
    ids,
    n_rows: int,
    dim: int,
    dtype,
    read_block: Callable[[int, int], np.ndarray],
    shard_rows: int | None = None,
    check_finite: bool = True,
    source: str | None = None,
    describe_rows: Callable[[np.ndarray], str] | None = None,
    storage: StorageOptions | None = None,
    linked: list | None = None,
    ids_digest: str | None = None,
) -> tuple[Path, dict]:
    """Write an encoder's shards and ``meta.json`` into a hidden staging folder beside its target
    (``embeddings/<encoder>/.<tileset>.<pid>-<uuid>.partial``) and return ``(staging, meta)``;
    the caller publishes it (``atomic_replace_dir``) or removes it. ``ids`` are the tileset's
    normalised sample ids (an object array, a text Series or an Arrow array; the tileset need not
    be written yet); ``ids_digest``, when given, is their :func:`sample_ids_digest` (an import of
    several encoders hashes them once). On any error the staging folder
    is removed and nothing else was touched. Raises like :func:`write_embeddings`; a
    :class:`NonFiniteError` names the rows, and what ``describe_rows(rows)`` says of them (e.g.
    their slide and tile) when given.

    ``storage`` (:class:`~.formats.StorageOptions`) writes Zarr shards instead of ``.npy``;
    ``linked`` (``[(path, h5 dataset or None, rows)]`` per slide, in tileset order) writes no
    rows at all: ``meta.json`` records the slide files to read in place (``read_block`` is then
    not called; their rows are checked when a unit validates the embeddings)."""
    root = writable_root(root)
    check_name("encoder", encoder)
    check_name("tileset", tileset)
    source = source or f"embeddings of encoder {encoder!r}"
    dtype = np.dtype(dtype)
    if dtype.name not in FLOAT_DTYPES:
        raise LayoutError(f"{source}: dtype must be one of {list(FLOAT_DTYPES)}, got {dtype}; cast explicitly")
    if int(n_rows) != len(ids):
        raise AlignmentError(f"{source}: has {n_rows} rows but tileset {tileset!r} has {len(ids)} tiles; "
                             "row i must be the embedding of tiles.parquet row i")
    if shard_rows is None:
        shard_rows = default_shard_rows(dim, dtype.itemsize)
    if int(shard_rows) < 1:
        raise ValueError(f"shard_rows must be a positive int, got {shard_rows!r}")
    target = embeddings_dir(root, encoder, tileset)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{tileset}.{os.getpid()}-{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
    staging.mkdir()
    storage = storage or StorageOptions()
    fmt, stored = META_FORMAT, dtype
    try:
        if linked is not None:
            fmt, shards = LINKED_FORMAT, linked_shards(linked, what=source)
            if sum(s["rows"] for s in shards) != int(n_rows):
                raise AlignmentError(f"{source}: the linked files hold {sum(s['rows'] for s in shards)} rows, the "
                                     f"tileset {n_rows}")
        else:
            if storage.format == "zarr":
                fmt, stored, suffix = ZARR_FORMAT, storage.stored_dtype(dtype), "zarr"

                def read_rows(lo: int, hi: int) -> np.ndarray:
                    block = _checked_block(read_block, lo, hi, dim, dtype, check_finite=check_finite, source=source,
                                           describe_rows=describe_rows)
                    if block.dtype != stored:  # an explicit storage dtype: what does not fit is refused
                        with np.errstate(over="ignore"):  # what overflows is refused just below
                            block = block.astype(stored)
                        _check_finite_block(block, lo, f"{source} (stored as {stored})", describe_rows)
                    return block

                def write(path: Path, start: int, stop: int) -> str:
                    return write_zarr_shard(path, start, stop, dim, storage, dtype, read_rows)
            else:
                suffix = "npy"

                def write(path: Path, start: int, stop: int) -> str:
                    return _write_shard(path, start, stop, dim, dtype, read_block, check_finite=check_finite,
                                        source=source, describe_rows=describe_rows)
            shards = []
            for index, start in enumerate(range(0, int(n_rows), int(shard_rows)) if n_rows else [0]):
                stop = min(int(n_rows), start + int(shard_rows))
                name = f"shard-{index:05d}.{suffix}"
                shards.append({"file": name, "rows": stop - start, "sha256": write(staging / name, start, stop)})
        meta = {
            "format": fmt,
            "version": META_VERSION,
            "encoder": encoder,
            "tileset": tileset,
            "shape": [int(n_rows), int(dim)],
            "dtype": stored.name,
            "shards": shards,
            "sample_ids_sha256": ids_digest or sample_ids_digest(ids),
        }
        if fmt == ZARR_FORMAT:
            meta["zarr"] = {"codec": storage.codec, "chunk_rows": storage.chunk_rows_for(int(dim), stored.itemsize)}
        atomic_write_json(staging / "meta.json", meta)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging, meta


def _write_shard(path: Path, start: int, stop: int, dim: int, dtype: np.dtype, read_block, *, check_finite: bool,
                 source: str, describe_rows=None) -> str:
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (stop - start, int(dim))}
    with open(path, "wb") as fh:
        out = _HashingWriter(fh)
        np.lib.format.write_array_header_1_0(out, header)
        for lo in range(start, stop, _COPY_ROWS):
            hi = min(stop, lo + _COPY_ROWS)
            block = _checked_block(read_block, lo, hi, dim, dtype, check_finite=check_finite, source=source,
                                   describe_rows=describe_rows)
            out.write(np.ascontiguousarray(block).tobytes(order="C"))
        fh.flush()
        os.fsync(fh.fileno())
    return out.sha.hexdigest()


def _checked_block(read_block, lo: int, hi: int, dim: int, dtype: np.dtype, *, check_finite: bool, source: str,
                   describe_rows=None) -> np.ndarray:
    """Rows ``lo:hi`` from ``read_block``, refused (naming the rows) when their shape or dtype is
    not the declared one or, with ``check_finite``, when one holds NaN or inf."""
    block = np.asarray(read_block(lo, hi))
    if block.shape != (hi - lo, int(dim)):
        raise AlignmentError(f"{source}: rows {lo}:{hi} have shape {block.shape}, expected {(hi - lo, int(dim))}")
    if block.dtype != dtype:
        raise LayoutError(f"{source}: rows {lo}:{hi} have dtype {block.dtype}, expected {dtype}")
    if check_finite:
        _check_finite_block(block, lo, source, describe_rows)
    return block


def _check_finite_block(block: np.ndarray, offset: int, source: str, describe_rows=None) -> None:
    bad = nonfinite_rows(block)
    if bad.size:
        what = f" ({describe_rows(bad[:5] + offset)})" if describe_rows is not None else ""
        raise NonFiniteError(f"{source}: NaN or infinite values at rows {_rows(bad + offset)}{what}")


def write_embeddings(root, encoder: str, tileset: str, array, *, shard_rows: int | None = None,
                     overwrite: bool = False, check_finite: bool = True, storage: StorageOptions | None = None) -> Path:
    """Write ``embeddings/<encoder>/<tileset>/`` from a 2-D float array aligned with ``tiles.parquet``.

    ``array`` may be a numpy array (a memmap is streamed) or a dask array (computed one copy step at
    a time) of shape ``(n_tiles, dim)`` and dtype float16/32/64 (no silent cast). Shards hold
    ``shard_rows`` rows (default: about 128 MiB each). With ``check_finite`` rows holding NaN/inf
    raise :class:`NonFiniteError` naming them. The folder appears only once complete. ``storage``
    (:class:`~.formats.StorageOptions`) writes Zarr shards instead of ``.npy``.

    Raises :class:`CacheNotFoundError` (tileset missing), :class:`AlignmentError` (row count),
    :class:`LayoutError` (dtype, ndim), ``FileExistsError`` (exists and not ``overwrite``).
    """
    source = f"embeddings of encoder {encoder!r} for tileset {tileset!r}"
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise TypeError(f"{source}: array must be a numpy or dask array, got {type(array).__name__}")
    if len(array.shape) != 2:
        raise LayoutError(f"{source}: array must be 2-D (n_tiles, dim), got shape {tuple(array.shape)}")
    if any(isinstance(s, float) and np.isnan(s) for s in array.shape):
        raise LayoutError(f"{source}: dask array has unknown chunk sizes; call .compute_chunk_sizes() first")
    n_rows, dim = (int(s) for s in array.shape)

    def read_block(lo: int, hi: int) -> np.ndarray:
        block = array[lo:hi]
        return np.asarray(block.compute() if hasattr(block, "compute") else block)

    return write_embeddings_blocks(root, encoder, tileset, n_rows=n_rows, dim=dim, dtype=array.dtype,
                                   read_block=read_block, shard_rows=shard_rows, overwrite=overwrite,
                                   check_finite=check_finite, source=source, storage=storage)


#: Columns a view must provide (itself or through its tileset), besides the confounder column.
VIEW_REQUIRED = ("sample_id", "label", "group_id")


def write_view(root, view: str, frame: pd.DataFrame, *, tileset: str, confounder_column: str,
               design: str | None = None, overwrite: bool = False,
               tileset_table: StoredTable | None = None) -> Path:
    """Write ``views/<view>.parquet`` and its sidecar ``views/<view>.json``.

    ``frame`` lists the view's rows in order (a sample_id may repeat, e.g. once per paired subset).
    It needs ``sample_id``; ``label``, ``group_id`` and ``confounder_column`` must be in the view or
    in the tileset's ``tiles.parquet``. ``design`` (``all``/``paired_2x2``/None) is recorded as a hint.
    The sidecar is written last, so a view is listed only when both files exist.

    Replacement (``overwrite=True``) publishes the table and then the sidecar, each by an atomic
    rename; the sidecar records the sha256 and byte size of the table it belongs to
    (``table_sha256``/``table_bytes``), so a reader that meets the new table with the old sidecar
    (between the two renames) detects the mismatch and re-reads (:meth:`Cache.read_view
    <cachescore.cache.Cache.read_view>`, :meth:`Cache.view_fingerprint
    <cachescore.cache.Cache.view_fingerprint>`): no reader ever uses a mixed pair.

    ``tileset_table``: what :func:`store_tileset_frame` returned for ``tileset`` when the caller
    just wrote it (the importer): its sample ids are not read back from ``tiles.parquet``, and a
    view whose stored table equals it (an import's view of every tile) is published from its
    bytes without encoding the table again. An Arrow-backed ``image_path`` column is stored as
    ``string``, as in ``tiles.parquet`` (readers take image paths from the tileset).

    Raises :class:`ViewError` (missing columns, blank/unknown sample_id, naming rows),
    :class:`CacheNotFoundError` (tileset missing), ``FileExistsError`` (exists and not ``overwrite``).
    """
    root = writable_root(root)
    check_name("view", view)
    check_name("tileset", tileset)
    source = f"view {view!r}"
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"{source}: frame must be a pandas DataFrame, got {type(frame).__name__}")
    column = str(confounder_column).strip()
    if not column:
        raise ViewError(f"{source}: confounder_column must be a non-empty string")
    if design is not None:
        design = str(design).strip().lower()
        if design not in ("all", "paired_2x2"):
            raise ViewError(f"{source}: design must be 'all', 'paired_2x2' or None, got {design!r}")
    if "sample_id" not in frame.columns:
        raise ViewError(f"{source}: missing required column 'sample_id'")
    if "row" in frame.columns:
        raise ViewError(f"{source}: column 'row' is reserved (cachescore adds it when reading views)")
    tiles = tiles_path(root, tileset)
    if not tiles.is_file():
        raise CacheNotFoundError(f"{source}: tileset {tileset!r} not found: {tiles}")
    tile_columns = tileset_table.table.column_names if tileset_table is not None else pq.read_schema(tiles).names
    missing = [c for c in (*VIEW_REQUIRED, column) if c not in frame.columns and c not in tile_columns]
    if missing:
        raise ViewError(f"{source}: missing required columns {missing} (in neither the view nor {tiles})")
    ids = _known_view_ids(root, tileset, frame["sample_id"], tileset_table, source)
    out = frame.reset_index(drop=True).copy()
    out["sample_id"] = ids
    if view_sidecar_path(root, view).exists() and not overwrite:
        raise FileExistsError(f"{view_sidecar_path(root, view)} already exists; pass overwrite=True to replace it")
    data = _write_parquet(view_table_path(root, view), out, string_columns=_view_text(out), overwrite=True,
                          source=source, like=tileset_table).data
    digest, size = hashlib.sha256(data).hexdigest(), int(data.size)
    sidecar = {"version": SIDECAR_VERSION, "tileset": tileset, "confounder_column": column}
    if design is not None:
        sidecar["design"] = design
    sidecar["table_sha256"] = digest
    sidecar["table_bytes"] = size
    atomic_write_json(view_sidecar_path(root, view), sidecar, overwrite=True)
    return view_table_path(root, view)


def _known_view_ids(root: Path, tileset: str, values, tileset_table: StoredTable | None, source: str) -> pd.Series:
    """A view's normalised sample ids, every one of them in ``tileset`` (else :class:`ViewError`
    naming the rows). The tileset's ids come from ``tileset_table`` when given, else from disk; a
    view of every tile in order (what an import writes) needs no lookup."""
    ids = normalized_text(values, source=source)
    if tileset_table is not None:
        known = text.as_series(text.arrow_text(tileset_table.table.column("sample_id")))
    else:
        known = _tileset_ids(root, tileset)
    if not _same_text(ids, known):
        unknown = np.flatnonzero(pd.Index(known).get_indexer(ids) < 0)
        if unknown.size:
            raise ViewError(f"{source}: sample_id values not in tileset {tileset!r} at rows {_rows(unknown)} "
                            f"(e.g. {ids.iloc[unknown[0]]!r})")
    return ids


def _view_text(out: pd.DataFrame) -> tuple[str, ...]:
    """The columns a view stores as ``string``: ``sample_id``, and an Arrow-text ``image_path`` as
    ``tiles.parquet`` stores it (pandas infers ``string`` for Python strings anyway)."""
    return _TILESET_TEXT if "image_path" in out and text.arrow_text(out["image_path"]) is not None else ("sample_id",)


def _same_text(a: pd.Series, b: pd.Series) -> bool:
    """Whether two text columns hold the same values in the same order (compared in Arrow when both
    are Arrow text; False, not an error, otherwise)."""
    x, y = text.arrow_text(a), text.arrow_text(b)
    return x is not None and y is not None and x.equals(y)


def delete_view(root, view: str) -> list[Path]:
    """Remove the view ``view`` (``views/<view>.json`` and ``views/<view>.parquet``) from the cache
    at ``root`` (a path or a :class:`~cachescore.cache.Cache` opened with ``mode="a"``). The
    sidecar goes first, so the view stops being listed before its table is removed; a crash between
    the two leaves an orphan table that no reader lists. Tilesets, embeddings and other views are
    untouched; stored results of the view stay in the results store (``cachescore prune`` lists
    them once no job names the view). Returns the removed paths. Raises
    :class:`~.errors.CacheNotFoundError` naming the cache's views when ``view`` is not one of them.
    """
    root = writable_root(root)
    check_name("view", view)
    if not root.is_dir():
        raise CacheNotFoundError(f"cache folder not found: {root}")
    sidecar, table = view_sidecar_path(root, view), view_table_path(root, view)
    if not sidecar.is_file():
        base = root / "views"
        known = sorted(p.stem for p in base.glob("*.json") if not p.name.startswith(".")) if base.is_dir() else []
        raise CacheNotFoundError(f"no view {view!r} in cache {root} (views: {', '.join(known) or 'none'})")
    removed = []
    for path in (sidecar, table):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
