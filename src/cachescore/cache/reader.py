"""Read a cache: listings, views in view order with their tileset row index, and embeddings
as lazy row-chunked dask arrays whose tasks memmap the ``.npy`` shards on the worker (or read
them by ranged requests when the cache is a URL in object storage, :mod:`.location`).

A :class:`Cache` holds only its root path, so it pickles to workers cheaply; nothing is read in
the constructor. Task graphs carry shard paths, row ranges and (for views) int64 row indices,
never embedding values.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import _combinations
from .._finite import nonfinite_rows
from .._hashing import sha256_file, sha256_stream
from .errors import (
    AlignmentError,
    CacheNotFoundError,
    LayoutError,
    NonFiniteError,
    ShardError,
    ViewChecksumError,
    ViewError,
)
from .layout import (
    CACHE_MODES,
    LINKED_FORMAT,
    META_FORMAT,
    EmbeddingMeta,
    ViewSpec,
    check_name,
    embeddings_dir,
    meta_path,
    parse_meta,
    parse_view_spec,
    tiles_path,
    view_sidecar_path,
    view_table_path,
)
from .location import (
    cache_root,
    check_cache_root,
    is_file,
    is_remote,
    open_binary,
    read_errors,
    signature,
    tree_signature,
)
from .shards import gather_rows, link_reference, open_shard, read_shard_rows, shard_contents
from .writer import (
    VIEW_REQUIRED,
    _rows,
    blank_rows,
    default_shard_rows,
    normalize_ids,
    sample_ids_digest,
)

__all__ = ["Cache"]

#: Per-process memo of successful full validations: key -> stat signature of every file involved.
_VALIDATED: dict[tuple, tuple] = {}
_VALIDATED_MAX = 256
#: Views already read in this process: (root, view, spec, sha256 of the table bytes, tiles.parquet
#: stat) -> the frame (work units of one worker read the same views for every encoder). Bounded by
#: rows, oldest out first, so a process that reads large views (an out-of-core driver) keeps none.
_VIEW_FRAMES: dict[tuple, pd.DataFrame] = {}
_VIEW_FRAMES_MAX_ROWS = 500_000


def _keep_view_frame(key: tuple, frame: pd.DataFrame) -> None:
    if len(frame) > _VIEW_FRAMES_MAX_ROWS:
        return
    _VIEW_FRAMES[key] = frame
    while sum(len(f) for f in _VIEW_FRAMES.values()) > _VIEW_FRAMES_MAX_ROWS:
        _VIEW_FRAMES.pop(next(iter(_VIEW_FRAMES)))


#: Attempts, and the pause before each retry (seconds, times the attempt number), to read a view's
#: table and sidecar as a matching pair while ``write_view(overwrite=True)`` swaps them.
VIEW_READ_ATTEMPTS = 6
#: Rows decoded at a time by :meth:`Cache.view_combinations` (its memory is one batch plus the combinations).
VIEW_CODE_BATCH = 1 << 16
VIEW_RETRY_PAUSE = 0.05


def _view_mismatch(view: str, table: Path, sidecar: Path, attempts: int) -> ViewChecksumError:
    return ViewChecksumError(
        f"view {view!r}: {table} does not match the sha256/size recorded in its sidecar {sidecar} "
        f"(checked {attempts} times): the view is being replaced right now, or one of its files was "
        "changed outside write_view; retry, or rewrite the view with write_view"
    )


def tokenize(*args) -> str:
    """dask's deterministic token of ``args`` (the lazy arrays' graph names)."""
    from dask.base import tokenize as dask_tokenize  # deferred: dask only when an array is built

    return dask_tokenize(*args)


def _dask_array(name: str, tasks: list, chunks: tuple, dtype: np.dtype):
    import dask.array as da  # deferred: a command that never builds a lazy array does not import dask
    from dask.highlevelgraph import HighLevelGraph  # deferred, as dask.array

    dsk = {(name, i, 0): task for i, task in enumerate(tasks)}
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=())
    return da.Array(graph, name, chunks=chunks, dtype=dtype)


class Cache:
    """A cache folder (``docs/cache-layout.md``). Cheap to construct and to pickle.

    Parameters
    ----------
    root : str or Path
        The cache folder. It is not read until a method needs it.
    mode : ``"r"`` (default) or ``"a"``
        ``"r"``: nothing is ever written through this object (the writers refuse it, naming the
        cache); ``"a"``: the writers (``write_tileset``, ``write_embeddings``, ``write_view``,
        ``import_cache``) may be given it to add to the cache. No mode writes on construction;
        :meth:`open` also checks the folder exists (``"r"``) or creates it (``"a"``).
    """

    def __init__(self, root, mode: str = "r"):
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be one of {list(CACHE_MODES)}, got {mode!r}")
        self.root = cache_root(root)
        self.mode = mode

    @classmethod
    def open(cls, root, mode: str = "r") -> "Cache":
        """Open the cache at ``root``: ``mode="r"`` never writes and raises
        :class:`CacheNotFoundError` when the folder does not exist; ``mode="a"`` creates the
        folder if needed (the only write) and returns a cache the writers accept."""
        cache = cls(root, mode)
        if mode == "a" and not is_remote(cache.root):
            cache.root.mkdir(parents=True, exist_ok=True)
        else:
            cache._require_root()
        return cache

    @property
    def writable(self) -> bool:
        """Whether the writers accept this cache (``mode="a"``)."""
        return self.mode == "a"

    def __repr__(self) -> str:
        return f"Cache({str(self.root)!r})" if self.mode == "r" else f"Cache({str(self.root)!r}, mode={self.mode!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Cache) and other.root == self.root

    def __hash__(self) -> int:
        return hash(("Cache", self.root))

    # -- listings -------------------------------------------------------------------------------
    def _require_root(self) -> None:
        check_cache_root(self.root)

    def tilesets(self) -> list[str]:
        """Sorted names of tilesets that have a ``tiles.parquet``."""
        self._require_root()
        base = self.root / "tilesets"
        return sorted(p.parent.name for p in base.glob("*/tiles.parquet") if not p.parent.name.startswith(".")) if base.is_dir() else []

    def encoders(self) -> list[str]:
        """Sorted names of encoders that have at least one complete embedding folder (with ``meta.json``)."""
        self._require_root()
        base = self.root / "embeddings"
        if not base.is_dir():
            return []
        return sorted({p.parent.parent.name for p in base.glob("*/*/meta.json")
                       if not p.parent.name.startswith(".") and not p.parent.parent.name.startswith(".")})

    def embedding_tilesets(self, encoder: str) -> list[str]:
        """Sorted tilesets for which ``encoder`` has complete embeddings."""
        check_name("encoder", encoder)
        base = self.root / "embeddings" / encoder
        return sorted(p.parent.name for p in base.glob("*/meta.json") if not p.parent.name.startswith(".")) if base.is_dir() else []

    def views(self) -> list[str]:
        """Sorted names of views that have both ``<view>.parquet`` and the ``<view>.json`` sidecar."""
        self._require_root()
        base = self.root / "views"
        if not base.is_dir():
            return []
        return sorted(p.stem for p in base.glob("*.json") if not p.name.startswith(".") and p.with_suffix(".parquet").is_file())

    # -- tilesets and views ---------------------------------------------------------------------
    def read_tileset(self, tileset: str, columns: list[str] | None = None) -> pd.DataFrame:
        """``tiles.parquet`` of ``tileset`` (all columns, or ``columns``), validated: ``sample_id``
        and ``image_path`` present, ``sample_id`` non-blank and unique."""
        check_name("tileset", tileset)
        path = tiles_path(self.root, tileset)
        frame = self._read_tiles(tileset, lambda fh: pq.read_table(fh, columns=columns).to_pandas())
        need = [c for c in ("sample_id", "image_path") if columns is None or c in columns]
        missing = [c for c in need if c not in frame.columns]
        if missing:
            raise ViewError(f"{path}: missing required columns {missing}")
        if "sample_id" in frame.columns:
            ids = normalize_ids(frame["sample_id"], source=str(path))
            dup = pd.Series(ids).duplicated(keep=False).to_numpy()
            if dup.any():
                raise ViewError(f"{path}: column 'sample_id' must be unique; duplicates at rows {_rows(np.flatnonzero(dup))}")
            frame["sample_id"] = ids
        return frame

    def _tileset_rows(self, tileset: str) -> int:
        return self._read_tiles(tileset, lambda fh: int(pq.read_metadata(fh).num_rows), "cannot read Parquet metadata")

    def _read_tiles(self, tileset: str, read, what: str = "cannot read"):
        """``read(file)`` of ``tiles.parquet`` of ``tileset``, its errors as the cache's: a missing
        file :class:`CacheNotFoundError`, a refused request :class:`CacheAccessError`, an
        unreadable one :class:`LayoutError`, each naming the file."""
        path = tiles_path(self.root, tileset)
        if not is_file(path):
            raise CacheNotFoundError(f"tileset {tileset!r} not found: {path}")
        with read_errors(str(path), missing=lambda: CacheNotFoundError(f"tileset {tileset!r} not found: {path}"),
                         broken=lambda exc: LayoutError(f"{path}: {what}: {exc}"), catch=(pa.ArrowException, OSError)):
            with open_binary(path) as fh:
                return read(fh)

    def view_spec(self, view: str) -> ViewSpec:
        """The view's sidecar (tileset, confounder column, design hint)."""
        check_name("view", view)
        return parse_view_spec(view_sidecar_path(self.root, view), view=view)

    def _view_pair(self, view: str) -> tuple[ViewSpec, bytes]:
        """The sidecar and the table bytes of ``view``, as a pair that belongs together.

        The table bytes must match the sidecar's ``table_sha256``/``table_bytes`` (when recorded);
        on a mismatch both are re-read (a concurrent ``write_view(overwrite=True)`` finishes its
        second rename within moments), up to :data:`VIEW_READ_ATTEMPTS` times, then
        :class:`ViewError`. The bytes returned are the bytes that were checked.
        """
        path = view_table_path(self.root, view)
        for attempt in range(1, VIEW_READ_ATTEMPTS + 1):
            spec = self.view_spec(view)
            with _view_read_errors(view, path):
                data = path.read_bytes()
            if _sidecar_matches(spec, len(data), lambda: hashlib.sha256(data).hexdigest()):
                return spec, data
            if attempt < VIEW_READ_ATTEMPTS:
                time.sleep(VIEW_RETRY_PAUSE * attempt)
        raise _view_mismatch(view, path, view_sidecar_path(self.root, view), VIEW_READ_ATTEMPTS)

    def read_view(self, view: str) -> pd.DataFrame:
        """The view's rows in view order, ready for croma's metric API.

        Columns: ``sample_id`` (normalised str), ``image_path`` (from the tileset), ``label``,
        ``group_id``, the confounder column, ``subset``/``split`` if present, any other view column,
        and ``row`` (int64: position of the sample_id in ``tiles.parquet``). ``label``, ``group_id``
        or the confounder column missing from the view are taken from the tileset.

        Raises :class:`ViewError` naming the file, column and rows for missing columns, missing or
        blank values in required columns, sample_ids unknown to the tileset, or a reserved ``row``
        column, and for a table that does not match the sha256/size its sidecar records (after
        re-reading while a ``write_view(overwrite=True)`` may be in flight: a mixed old/new pair is
        never used); :class:`CacheNotFoundError` for a missing file. A view already read in this
        process is not parsed again while its spec, its table's bytes and the tileset file's size,
        mtime and inode are unchanged (a copy of the kept frame is returned; views of up to
        500,000 rows in all are kept).
        """
        spec, data = self._view_pair(view)
        st = signature(tiles_path(self.root, spec.tileset))
        key = (str(self.root), view, repr(spec), hashlib.sha256(data).hexdigest(), st)
        kept = _VIEW_FRAMES.get(key) if st is not None else None
        if kept is None:
            kept = self._parse_view(view, spec, data)
            if st is not None:
                _keep_view_frame(key, kept)
        frame = kept.copy()
        frame.attrs = dict(kept.attrs)
        return frame

    @contextlib.contextmanager
    def _view_file(self, view: str):
        """``(sidecar, binary file object)`` of ``view``'s table, checked as :meth:`_view_pair`
        checks its bytes, without holding them: the open table is hashed in
        :data:`~cachescore._hashing.HASH_BLOCK` steps and then read through the same handle, so
        a replacement renamed in meanwhile is never mixed in (a table of millions of rows is
        planned from a few of its columns). Raises as :meth:`_view_pair`."""
        path = view_table_path(self.root, view)
        for attempt in range(1, VIEW_READ_ATTEMPTS + 1):
            spec = self.view_spec(view)
            with _view_read_errors(view, path):
                fh = path.open("rb")
            with fh:
                with _view_read_errors(view, path):
                    digest, size = sha256_stream(fh)
                    fh.seek(0)
                if _sidecar_matches(spec, size, lambda: digest):
                    yield spec, fh
                    return
            if attempt < VIEW_READ_ATTEMPTS:
                time.sleep(VIEW_RETRY_PAUSE * attempt)
        raise _view_mismatch(view, path, view_sidecar_path(self.root, view), VIEW_READ_ATTEMPTS)

    def view_rows(self, view: str) -> int:
        """Rows of ``view``'s table, from its Parquet footer (nothing else is decoded). Raises as
        :meth:`read_view` for a view that cannot be read."""
        with self._view_file(view) as (_, fh):
            try:
                return int(pq.ParquetFile(fh).metadata.num_rows)
            except (pa.ArrowException, OSError) as exc:
                raise LayoutError(f"{view_table_path(self.root, view)}: cannot read: {exc}") from exc

    def view_columns(self, view: str, columns) -> pd.DataFrame | None:
        """``columns`` of ``view``'s own table as a frame in view order, values as stored (text as
        categoricals: a few bytes a row), without the tileset join of :meth:`read_view`; None
        when the table lacks one of them (it is then taken from the tileset: use
        :meth:`read_view`). For per-row look-ups of large views (a score's interval reads
        ``group_id`` and, for a fallback, the label and confounder). Raises as :meth:`read_view`
        for a view that cannot be read."""
        columns = list(dict.fromkeys(columns))
        with self._view_file(view) as (_, fh):
            try:
                names = pq.read_schema(fh).names
                if any(c not in names for c in columns):
                    return None
                table = pq.read_table(fh, columns=columns, read_dictionary=columns)
            except (pa.ArrowException, OSError) as exc:
                raise LayoutError(f"{view_table_path(self.root, view)}: cannot read: {exc}") from exc
        return table.to_pandas()

    def view_combinations(self, view: str, columns, *, strip=()):
        """The distinct combinations of ``columns``' values over ``view``'s own table, how often
        each occurs and where it first occurs, without building its frame: ``(names, (codes,
        rows, first))`` where ``names[j]`` lists column ``j``'s distinct values sorted
        (``str(value)``, stripped for the columns in ``strip``), ``codes`` (K, m) int64 indexes
        them, ``rows`` (K,) int64 counts each combination and ``first`` (K,) int64 is its first
        row in view order (:mod:`cachescore._combinations`). Read in :data:`VIEW_CODE_BATCH`-row
        batches, text decoded straight into dictionaries: memory is one batch plus the
        combinations, not the rows, for planning views of millions of rows. None when the table
        lacks a column, holds nulls in one, or a column is neither text nor integer (the caller
        then reads the view, :meth:`read_view`). Raises as :meth:`read_view` for a view that
        cannot be read."""
        columns = list(columns)
        seen: list[dict[str, int]] = [{} for _ in columns]
        parts, at = [], 0
        with self._view_file(view) as (_, fh):
            text = _code_columns(fh, columns)
            if text is None:
                return None
            try:
                reader = pq.ParquetFile(fh, read_dictionary=[c for c in columns if text[c]])
                for batch in reader.iter_batches(batch_size=VIEW_CODE_BATCH, columns=columns, use_threads=False):
                    codes = [_batch_codes(batch.column(j), text[name], name in strip, seen[j])
                             for j, name in enumerate(columns)]
                    if any(c is None for c in codes):
                        return None
                    parts.append(_combinations.count(np.stack(codes, axis=1), offset=at))
                    at += batch.num_rows
            except (pa.ArrowException, OSError):
                return None
        codes, rows, first = _combinations.merge(parts, len(columns))
        names = []
        for j in range(len(columns)):
            sorted_names, rank = _combinations.by_sorted_names(seen[j])
            names.append(sorted_names)
            codes[:, j] = rank[codes[:, j]] if len(codes) else codes[:, j]
        return names, (codes, rows, first)

    def _parse_view(self, view: str, spec, data: bytes) -> pd.DataFrame:
        """:meth:`read_view`'s frame from the view's checked table bytes (validated, joined with the tileset)."""
        path = view_table_path(self.root, view)
        try:
            frame = pq.read_table(pa.BufferReader(data)).to_pandas()
        except (pa.ArrowException, OSError) as exc:
            raise LayoutError(f"{path}: cannot read: {exc}") from exc
        if "sample_id" not in frame.columns:
            raise ViewError(f"{path}: missing required column 'sample_id'")
        if "row" in frame.columns:
            raise ViewError(f"{path}: column 'row' is reserved (cachescore adds it when reading views)")
        tiles = self.read_tileset(spec.tileset)
        tpath = tiles_path(self.root, spec.tileset)
        ids = normalize_ids(frame["sample_id"], source=str(path))
        rows = pd.Index(tiles["sample_id"].to_numpy(dtype=object)).get_indexer(ids).astype(np.int64)
        unknown = np.flatnonzero(rows < 0)
        if unknown.size:
            raise ViewError(f"{path}: sample_id values not in tileset {spec.tileset!r} ({tpath}) at rows "
                            f"{_rows(unknown)} (e.g. {ids[unknown[0]]!r})")
        frame = frame.reset_index(drop=True)
        frame["sample_id"] = ids
        required = (*VIEW_REQUIRED, spec.confounder_column)
        for column in required:
            if column not in frame.columns:
                if column not in tiles.columns:
                    raise ViewError(f"{path}: missing required column {column!r} (not in the view nor in {tpath})")
                frame[column] = tiles[column].to_numpy()[rows]
        frame["image_path"] = tiles["image_path"].to_numpy(dtype=object)[rows]
        for column in (*required[1:], *(c for c in ("subset",) if c in frame.columns)):
            blank = blank_rows(frame[column])
            if blank.size:
                raise ViewError(f"{path}: column {column!r} has missing or blank values at rows {_rows(blank)}")
        frame["row"] = rows
        first = ["sample_id", "image_path", "label", "group_id", spec.confounder_column]
        first += [c for c in ("subset", "split") if c in frame.columns and c not in first]
        rest = [c for c in frame.columns if c not in first and c != "row"]
        frame = frame[list(dict.fromkeys(first + rest)) + ["row"]]
        frame.attrs = {"view": view, "tileset": spec.tileset, "confounder_column": spec.confounder_column, "design": spec.design}
        return frame

    # -- embeddings -----------------------------------------------------------------------------
    def meta(self, encoder: str, tileset: str) -> EmbeddingMeta:
        """Parsed ``meta.json``, with its row count checked against ``tiles.parquet``."""
        check_name("encoder", encoder)
        check_name("tileset", tileset)
        path = meta_path(self.root, encoder, tileset)
        if not path.is_file():
            known = self.embedding_tilesets(encoder) if (self.root / "embeddings" / encoder).is_dir() else []
            hint = f"; encoder {encoder!r} has tilesets {known}" if known else f"; known encoders: {self.encoders()}"
            raise CacheNotFoundError(f"no embeddings for encoder {encoder!r}, tileset {tileset!r}: {path} missing{hint}")
        meta = parse_meta(path, encoder=encoder, tileset=tileset)
        n_tiles = self._tileset_rows(tileset)
        if meta.n_rows != n_tiles:
            raise AlignmentError(f"embeddings of encoder {encoder!r}, tileset {tileset!r} have {meta.n_rows} rows "
                                 f"but {tiles_path(self.root, tileset)} has {n_tiles}")
        return meta

    def _label(self, encoder: str, tileset: str) -> str:
        return f"encoder {encoder!r}, tileset {tileset!r}"

    def _paths(self, meta: EmbeddingMeta) -> tuple[str, ...]:
        """What each shard is opened through (:func:`.shards.open_shard`): a file or store in the
        embeddings folder, or a linked slide file's reference (path, dataset, size, mtime)."""
        if meta.format == LINKED_FORMAT:
            return tuple(link_reference(s.file, s.dataset, s.size, s.mtime_ns) for s in meta.shards)
        folder = embeddings_dir(self.root, meta.encoder, meta.tileset)
        return tuple(str(folder / s.file) for s in meta.shards)

    def embeddings(self, encoder: str, tileset: str, *, chunk_rows: int | None = None):
        """Lazy ``dask.array`` of shape ``(n_tiles, dim)``, chunked along rows only.

        Chunks follow the shards; ``chunk_rows`` splits shards further (chunks never straddle two
        shards). Each task memmaps its shard on the worker and copies its rows; the graph holds
        only paths and row ranges. Shard headers are not opened here: a missing or corrupt shard
        raises :class:`ShardNotFoundError` / :class:`ShardError` when its chunk is computed (use
        :meth:`validate_embeddings` to check up front).
        """

        meta = self.meta(encoder, tileset)
        if chunk_rows is not None and int(chunk_rows) < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        paths = self._paths(meta)
        label = self._label(encoder, tileset)
        tasks, sizes = [], []
        for shard, path in zip(meta.shards, paths):
            step = int(chunk_rows) if chunk_rows else max(shard.rows, 1)
            for lo in range(0, shard.rows, step):
                hi = min(shard.rows, lo + step)
                tasks.append((read_shard_rows, path, shard.rows, meta.dim, meta.dtype.str, lo, hi, label))
                sizes.append(hi - lo)
        if not tasks:  # zero rows: one empty chunk keeps shapes well defined
            tasks.append((np.empty, (0, meta.dim), meta.dtype))
            sizes.append(0)
        name = f"cache-embeddings-{encoder}-{tileset}-" + tokenize(str(self.root), [s.sha256 for s in meta.shards], chunk_rows)
        return _dask_array(name, tasks, (tuple(sizes), (meta.dim,)), meta.dtype)

    def view_embeddings(self, encoder: str, view: str, *, chunk_rows: int | None = None):
        """Lazy ``dask.array`` of the view's embeddings in view order: row ``i`` is tileset row
        ``read_view(view)["row"][i]`` (rows may repeat). Chunked along rows only, ``chunk_rows``
        per chunk (default about 128 MiB); each task gathers its rows from the shards it touches.
        """

        spec = self.view_spec(view)
        rows = self.read_view(view)["row"].to_numpy(dtype=np.int64)
        return self._rows_array(encoder, spec.tileset, rows, chunk_rows=chunk_rows,
                                token=tokenize(view, self.view_fingerprint(view)))

    def rows_embeddings(self, encoder: str, tileset: str, rows, *, chunk_rows: int | None = None):
        """Lazy ``dask.array`` of tileset rows ``rows`` (int64 positions, any order, repeats allowed)."""

        rows = np.asarray(rows, dtype=np.int64)
        return self._rows_array(encoder, tileset, rows, chunk_rows=chunk_rows, token=tokenize(rows))

    def _rows_array(self, encoder, tileset, rows, *, chunk_rows, token):

        meta = self.meta(encoder, tileset)
        if rows.ndim != 1:
            raise ValueError(f"rows must be 1-D, got shape {rows.shape}")
        if rows.size and (rows.min() < 0 or rows.max() >= meta.n_rows):
            raise IndexError(f"rows out of range [0, {meta.n_rows}) for {self._label(encoder, tileset)}")
        step = int(chunk_rows) if chunk_rows else default_shard_rows(meta.dim, meta.dtype.itemsize)
        if step < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        paths, offsets, label = self._paths(meta), meta.offsets, self._label(encoder, tileset)
        tasks, sizes = [], []
        for lo in range(0, rows.size, step):
            part = rows[lo : lo + step].copy()
            tasks.append((gather_rows, paths, offsets, meta.dim, meta.dtype.str, part, label))
            sizes.append(part.size)
        if not tasks:
            tasks.append((np.empty, (0, meta.dim), meta.dtype))
            sizes.append(0)
        name = f"cache-rows-{encoder}-{tileset}-" + tokenize(str(self.root), [s.sha256 for s in meta.shards], step, token)
        return _dask_array(name, tasks, (tuple(sizes), (meta.dim,)), meta.dtype)

    def row_source(self, encoder: str, tileset: str) -> "RowSource":
        """A picklable :class:`RowSource` of (``encoder``, ``tileset``) in this cache (nothing is read)."""
        check_name("encoder", encoder)
        check_name("tileset", tileset)
        return RowSource(str(self.root), encoder, tileset)

    def load_rows(self, encoder: str, tileset: str, rows=None) -> np.ndarray:
        """Eager numpy array of tileset rows ``rows`` (int64 positions; None = all), for use inside a
        worker task. Shape ``(len(rows), dim)``, the cache's dtype."""
        meta = self.meta(encoder, tileset)
        paths, label = self._paths(meta), self._label(encoder, tileset)
        if rows is None:
            out = np.empty(meta.shape, dtype=meta.dtype)
            for shard, path in zip(meta.shards, paths):
                out[shard.start : shard.stop] = np.asarray(open_shard(path, shard.rows, meta.dim, meta.dtype, label))
            return out
        rows = np.asarray(rows)
        if rows.ndim != 1 or not (np.issubdtype(rows.dtype, np.integer) or rows.size == 0):
            raise ValueError(f"rows must be a 1-D integer array, got shape {rows.shape} dtype {rows.dtype}")
        return gather_rows(paths, meta.offsets, meta.dim, meta.dtype.str, rows.astype(np.int64), label)

    # -- fingerprints ---------------------------------------------------------------------------
    def embedding_fingerprint(self, encoder: str, tileset: str) -> str:
        """sha256 hex over the embedding content as recorded in ``meta.json``: shape, dtype, shard
        row counts and checksums, and the sample_id alignment digest. Cheap (no shard is read)."""
        meta = self.meta(encoder, tileset)
        payload = {"shape": list(meta.shape), "dtype": meta.dtype.name, "sample_ids_sha256": meta.sample_ids_sha256,
                   "shards": [[s.rows, s.sha256] for s in meta.shards]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def view_fingerprint(self, view: str, *, tiles_digests: dict | None = None) -> str:
        """sha256 hex over the view's Parquet bytes, its sidecar content and its tileset's
        ``tiles.parquet`` bytes (the row mapping and image paths come from there).

        The table is checked against the sha256 its sidecar records (re-read while a replacement
        is in flight, then :class:`ViewError`, as :meth:`read_view`). ``tiles_digests``: an
        optional memo ``{tiles.parquet path: sha256}`` shared by the caller across views of one
        tileset (a plan hashes each ``tiles.parquet`` once); missing entries are added."""
        table = view_table_path(self.root, view)
        for attempt in range(1, VIEW_READ_ATTEMPTS + 1):
            spec = self.view_spec(view)
            if not table.is_file():
                raise CacheNotFoundError(f"view {view!r} table not found: {table}")
            table_digest = sha256_file(table)
            if spec.table_sha256 is None or table_digest == spec.table_sha256:
                break
            if attempt < VIEW_READ_ATTEMPTS:
                time.sleep(VIEW_RETRY_PAUSE * attempt)
        else:
            raise _view_mismatch(view, table, view_sidecar_path(self.root, view), VIEW_READ_ATTEMPTS)
        tiles = tiles_path(self.root, spec.tileset)
        if not tiles.is_file():
            raise CacheNotFoundError(f"view {view!r}: tileset {spec.tileset!r} not found: {tiles}")
        if tiles_digests is None:
            tiles_digest = sha256_file(tiles)
        else:
            tiles_digest = tiles_digests.get(str(tiles))
            if tiles_digest is None:
                tiles_digest = tiles_digests[str(tiles)] = sha256_file(tiles)
        payload = {"view": table_digest, "tiles": tiles_digest,
                   "sidecar": {"tileset": spec.tileset, "confounder_column": spec.confounder_column, "design": spec.design}}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    # -- validation -----------------------------------------------------------------------------
    def _stat_signature(self, meta: EmbeddingMeta) -> tuple:
        folder = embeddings_dir(self.root, meta.encoder, meta.tileset)
        files = [meta_path(self.root, meta.encoder, meta.tileset), tiles_path(self.root, meta.tileset)]
        if meta.format == LINKED_FORMAT:
            files += [Path(s.file) for s in meta.shards]
        elif meta.format == META_FORMAT:
            files += [folder / s.file for s in meta.shards]
        out = []
        for f in files:
            sig = signature(f)
            if sig is None:
                return ()
            out.append(sig)
        if meta.format not in (LINKED_FORMAT, META_FORMAT):  # Zarr shards: every chunk file of each store
            for s in meta.shards:
                sig = tree_signature(folder / s.file)
                if sig is None:
                    return ()
                out.append(sig)
        return tuple(out)

    def validate_embeddings(self, encoder: str, tileset: str, *, checksums: bool = True, finite: bool = True,
                            reuse: bool = True) -> EmbeddingMeta:
        """Check one embedding array fully; return its meta when valid.

        In order: ``meta.json`` parses; row count equals ``tiles.parquet``; sample_id order equals
        the one the embeddings were written for; every shard exists, has the recorded shape and
        dtype, and (``checksums``) the recorded sha256; (``finite``) no NaN/inf, checked per shard
        with a cheap sum first and row indices only on failure.

        With ``reuse`` a full validation that already passed in this process is not repeated while
        the size, mtime and inode of ``meta.json``, ``tiles.parquet`` and every shard are unchanged
        (work units of one worker share an encoder's embeddings).

        Raises :class:`AlignmentError`, :class:`ShardNotFoundError`, :class:`ShardError`,
        :class:`NonFiniteError`, each naming encoder, tileset, shard file and row range.
        """
        meta = self.meta(encoder, tileset)
        key = (str(self.root if is_remote(self.root) else self.root.resolve()), encoder, tileset, checksums, finite)
        signature = self._stat_signature(meta)
        if reuse and signature and _VALIDATED.get(key) == signature:
            return meta
        label = self._label(encoder, tileset)
        tiles = self.read_tileset(tileset, columns=["sample_id"])
        if sample_ids_digest(tiles["sample_id"].to_numpy(dtype=object)) != meta.sample_ids_sha256:
            raise AlignmentError(f"{label}: {tiles_path(self.root, tileset)} sample_id order differs from the one "
                                 "these embeddings were written for; rows are no longer aligned (re-import them)")
        self._check_shards(meta, range(len(meta.shards)), checksums=checksums, finite=finite)
        if signature and signature == self._stat_signature(meta):
            if len(_VALIDATED) >= _VALIDATED_MAX:
                _VALIDATED.pop(next(iter(_VALIDATED)))
            _VALIDATED[key] = signature
        return meta

    def validate_shards(self, encoder: str, tileset: str, start: int, stop: int, *, checksums: bool = True,
                        finite: bool = True) -> int:
        """Check shards ``start:stop`` (indices into ``meta.json``'s shard list) of one embedding
        array as :meth:`validate_embeddings` checks every shard (it exists, has the recorded shape
        and dtype, its sha256, no NaN/inf), without the alignment checks and without memoising:
        a share of one validation, for a task that validates a cache's shards in parallel with
        others (:func:`cachescore.pipeline.large_unit.large_scopes`). Returns the rows checked.
        Raises as :meth:`validate_embeddings`, naming the shard and its row range; ``IndexError``
        when ``start:stop`` is not a range of the shards."""
        meta = self.meta(encoder, tileset)
        if not 0 <= int(start) <= int(stop) <= len(meta.shards):
            raise IndexError(f"{self._label(encoder, tileset)}: shards {start}:{stop} outside 0:{len(meta.shards)}")
        picked = range(int(start), int(stop))
        self._check_shards(meta, picked, checksums=checksums, finite=finite)
        return int(sum(meta.shards[i].rows for i in picked))

    def _check_shards(self, meta: EmbeddingMeta, picked: range, *, checksums: bool, finite: bool) -> None:
        """Open each shard of ``picked`` and check its header, (``checksums``) its sha256 and
        (``finite``) its values; errors name the shard and its row range."""
        label = self._label(meta.encoder, meta.tileset)
        paths = self._paths(meta)
        for i in picked:
            shard, path = meta.shards[i], paths[i]
            mm, digest = shard_contents(open_shard(path, shard.rows, meta.dim, meta.dtype, label), path,
                                        checksums=checksums, finite=finite)
            if checksums and digest != shard.sha256:
                raise ShardError(f"{label}: shard {path} (rows {shard.start}:{shard.stop}) does not match its sha256 in meta.json")
            if finite and shard.rows:
                bad = nonfinite_rows(mm)
                if bad.size:
                    raise NonFiniteError(f"{label}: shard {path} (rows {shard.start}:{shard.stop}) has NaN or "
                                         f"infinite values at tileset rows {_rows(bad + shard.start)}")

    def info(self) -> dict:
        """Cache-level ``cache.json`` content ({} when absent)."""
        path = self.root / "cache.json"
        if not is_file(path):
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise LayoutError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise LayoutError(f"{path} must hold a JSON object")
        return data


@dataclass(frozen=True)
class RowSource:
    """One encoder's embeddings of one tileset, named by location only: a small frozen value
    (three strings) that a Dask task receives and reads rows through, never an open cache. Each
    call opens the cache afresh, so it pickles to any worker and holds no file handle.
    :meth:`Cache.row_source` makes one."""

    cache_root: str
    encoder: str
    tileset: str

    def meta(self) -> EmbeddingMeta:
        """The embeddings' parsed ``meta.json`` (:meth:`Cache.meta`)."""
        return Cache(self.cache_root).meta(self.encoder, self.tileset)

    def load_rows(self, rows) -> np.ndarray:
        """Tileset rows ``rows`` (int64 positions) as an eager array (:meth:`Cache.load_rows`)."""
        return Cache(self.cache_root).load_rows(self.encoder, self.tileset, rows)


def _batch_codes(arr, is_text: bool, stripped: bool, seen: dict) -> np.ndarray | None:
    """Codes (int64, one per row) of one batch of a view column, numbering each distinct value
    (``str``, stripped when ``stripped``) in ``seen`` across batches; None when it holds nulls.
    Text is read as a dictionary, so only its distinct values become Python strings."""
    if arr.null_count:
        return None
    if not is_text:
        arr = pc.dictionary_encode(pc.cast(arr, pa.string()))
    values = arr.dictionary.to_pylist()
    local = np.fromiter((seen.setdefault(v.strip() if stripped else v, len(seen)) for v in values),
                        dtype=np.int64, count=len(values))
    return local[arr.indices.to_numpy(zero_copy_only=False)]


def _view_read_errors(view: str, path):
    """:func:`~.location.read_errors` of reading ``view``'s table at ``path``."""
    return read_errors(f"view {view!r} table {path}",
                       missing=lambda: CacheNotFoundError(f"view {view!r} table not found: {path}"),
                       broken=lambda exc: LayoutError(f"{path}: cannot read: {exc}"))


def _sidecar_matches(spec, size: int, digest) -> bool:
    """Whether a view table of ``size`` bytes whose sha256 hex is ``digest()`` is the one ``spec``
    (its sidecar) records; a sidecar without a digest matches any table."""
    return spec.table_sha256 is None or (
        (spec.table_bytes is None or size == spec.table_bytes) and digest() == spec.table_sha256)


def _code_columns(source, columns) -> dict[str, bool] | None:
    """``{column: is text}`` when the Parquet table ``source`` (a binary file object) has every
    column as text or integers, else None (a column missing or of another type, or a table that
    cannot be read)."""
    try:
        schema = pq.ParquetFile(source).schema_arrow
    except (pa.ArrowException, OSError):
        return None
    text = {}
    for name in columns:
        if name not in schema.names:
            return None
        kind = schema.field(name).type
        text[name] = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        if not (text[name] or pa.types.is_integer(kind)):
            return None
    return text
