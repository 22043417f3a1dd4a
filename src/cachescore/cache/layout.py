"""The on-disk layout of a cache folder (docs/cache-layout.md) and the parsers of its small files.

::

    CACHE/
      cache.json                                   # optional: cache-level notes (e.g. demo ranking)
      tilesets/<tileset>/tiles.parquet             # sample_id (unique), image_path, any metadata
      embeddings/<encoder>/<tileset>/meta.json     # shape, dtype, shards (file, rows, sha256)
      embeddings/<encoder>/<tileset>/shard-00000.npy ...
      views/<view>.parquet                         # sample_id, label, group_id, <confounder>, [subset], [split]
      views/<view>.json                            # sidecar: tileset, confounder_column, [design]

Each ``parse_*`` function validates one file and raises a :class:`~cachescore.cache.errors.CacheError`
subclass naming the file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CacheError, CacheNotFoundError, LayoutError, ViewError
from .location import access_error, cache_root, is_file, is_remote

__all__ = [
    "META_FORMAT",
    "ZARR_FORMAT",
    "LINKED_FORMAT",
    "META_FORMATS",
    "META_VERSION",
    "SIDECAR_VERSION",
    "FLOAT_DTYPES",
    "ShardInfo",
    "EmbeddingMeta",
    "ViewSpec",
    "check_name",
    "tiles_path",
    "embeddings_dir",
    "meta_path",
    "view_table_path",
    "view_sidecar_path",
    "parse_meta",
    "parse_view_spec",
]

#: ``format`` of ``meta.json``: ``.npy`` row shards (the default layout).
META_FORMAT = "cachescore.npy-shards"
#: ``format`` of ``meta.json``: each row shard a Zarr v3 array of whole-row chunks (``shard-NNNNN.zarr``).
ZARR_FORMAT = "cachescore.zarr-shards"
#: ``format`` of ``meta.json``: slide feature files read in place (``import --link``); each shard is
#: one slide's file, named by absolute path with its dataset, size, mtime and quick hash.
LINKED_FORMAT = "cachescore.linked"
#: Every ``format`` this code reads, with the suffix its shard files carry (None: any, linked files).
META_FORMATS = {META_FORMAT: ".npy", ZARR_FORMAT: ".zarr", LINKED_FORMAT: None}
#: Version of the ``meta.json`` schema this code reads and writes.
META_VERSION = 1
#: Version of the view sidecar schema this code reads and writes.
SIDECAR_VERSION = 1
#: Embedding dtypes a cache may hold (croma computes in the features' float dtype).
FLOAT_DTYPES = ("float16", "float32", "float64")
#: Names of encoders, tilesets and views: a path component, no dot prefix, no separators.
_NAME = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.+=@-]*\Z")  # \Z: no trailing newline ($ would accept one)


def check_name(kind: str, name: object) -> str:
    """Return ``name`` if it is a valid encoder/tileset/view name, else raise ``ValueError``.

    Names become path components, so they may hold letters, digits and ``_ . + = @ -`` and may not
    start with a dot or dash.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: use letters, digits and '_.+=@-', not starting with '.' or '-'"
        )
    return name


#: How a cache may be opened (zarr-style): ``"r"`` reads only; ``"a"`` reads and lets the
#: writers add to it (``write_tileset``, ``write_embeddings``, ``write_view``, ``import_cache``).
CACHE_MODES = ("r", "a")


def writable_root(root) -> Path:
    """The folder a writer writes into: ``root`` itself (a path), or a
    :class:`~cachescore.cache.Cache`'s folder when it was opened with ``mode="a"``. Raises
    :class:`~.errors.CacheError` for a cache opened read-only (``mode="r"``), naming it, and for
    a remote cache (a URL): writers write a local folder, which
    :func:`~cachescore.cache.location.remote_session` stages and publishes."""
    mode = getattr(root, "mode", None)
    if mode is not None and mode != "a":
        raise CacheError(f"cache {root.root} is open read-only (mode={mode!r}); nothing is written: open it with "
                         "Cache.open(path, mode='a') to add to it")
    folder = cache_root(root.root if mode is not None else root)
    if is_remote(folder):
        raise CacheError(f"cache {folder} is remote: the writers write a local folder; write through "
                         "cachescore.cache.location.remote_session (the import and view commands do)")
    return folder


def tiles_path(root: Path, tileset: str) -> Path:
    return cache_root(root) / "tilesets" / tileset / "tiles.parquet"


def embeddings_dir(root: Path, encoder: str, tileset: str) -> Path:
    return cache_root(root) / "embeddings" / encoder / tileset


def meta_path(root: Path, encoder: str, tileset: str) -> Path:
    return embeddings_dir(root, encoder, tileset) / "meta.json"


def view_table_path(root: Path, view: str) -> Path:
    return cache_root(root) / "views" / f"{view}.parquet"


def view_sidecar_path(root: Path, view: str) -> Path:
    return cache_root(root) / "views" / f"{view}.json"


@dataclass(frozen=True)
class ShardInfo:
    """One row shard: ``file`` (name inside the embeddings folder; a linked slide file's absolute
    path), ``start``/``stop`` rows, ``sha256`` (of the file bytes; a Zarr store's digest; a linked
    file's quick hash). Linked shards also record their HDF5 ``dataset`` (None for ``.npy``) and
    the file's ``size`` and ``mtime_ns`` when it was linked."""

    file: str
    start: int
    stop: int
    sha256: str
    dataset: str | None = None
    size: int | None = None
    mtime_ns: int | None = None

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class EmbeddingMeta:
    """Parsed ``meta.json`` of one (encoder, tileset) embedding array of shape ``(n_rows, dim)``."""

    encoder: str
    tileset: str
    n_rows: int
    dim: int
    dtype: np.dtype
    shards: tuple[ShardInfo, ...]
    sample_ids_sha256: str
    format: str = META_FORMAT

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_rows, self.dim)

    @property
    def offsets(self) -> np.ndarray:
        """int64 array of length ``len(shards) + 1``: shard ``i`` holds rows ``offsets[i]:offsets[i+1]``."""
        return np.asarray([0] + [s.stop for s in self.shards], dtype=np.int64)


@dataclass(frozen=True)
class ViewSpec:
    """A view's sidecar: which tileset it reads, its confounder column, and an optional design hint.

    ``table_sha256``/``table_bytes``: the sha256 and size of the ``<view>.parquet`` this sidecar was
    written with (None in sidecars written before they were recorded); readers use them to refuse
    a table that does not belong to this sidecar (a replacement in progress).
    """

    name: str
    tileset: str
    confounder_column: str
    design: str | None = None
    table_sha256: str | None = None
    table_bytes: int | None = None


def _read_json(path: Path, what: str) -> dict:
    if not is_file(path):
        raise CacheNotFoundError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except PermissionError as exc:
        raise access_error(f"{what} {path}", exc) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{what} {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise LayoutError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


def parse_meta(path: Path, *, encoder: str, tileset: str) -> EmbeddingMeta:
    """Read and validate an embeddings ``meta.json``; raise :class:`LayoutError` naming the field."""
    data = _read_json(path, f"embeddings meta for encoder {encoder!r}, tileset {tileset!r}")

    def bad(msg: str) -> LayoutError:
        return LayoutError(f"{path}: {msg} (encoder {encoder!r}, tileset {tileset!r})")

    fmt = data.get("format")
    if fmt not in META_FORMATS:
        raise bad(f"'format' must be one of {list(META_FORMATS)}, got {fmt!r}")
    if data.get("version") != META_VERSION:
        raise bad(f"unsupported 'version' {data.get('version')!r}; this cachescore reads version {META_VERSION}")
    shape = data.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(v, int) and v >= 0 for v in shape)):
        raise bad(f"'shape' must be [n_rows, dim] of non-negative ints, got {shape!r}")
    dtype = data.get("dtype")
    if dtype not in FLOAT_DTYPES:
        raise bad(f"'dtype' must be one of {list(FLOAT_DTYPES)}, got {dtype!r}")
    raw = data.get("shards")
    if not isinstance(raw, list):
        raise bad("'shards' must be a list")
    shards, start = [], 0
    for i, s in enumerate(raw):
        if not (isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("rows"), int)
                and s["rows"] >= 0 and isinstance(s.get("sha256"), str)):
            raise bad(f"shards[{i}] must be an object with 'file' (str), 'rows' (int >= 0), 'sha256' (str)")
        if fmt == LINKED_FORMAT:
            shards.append(_linked_shard(s, i, start, bad))
        else:
            if "/" in s["file"] or "\\" in s["file"] or s["file"].startswith(".") or not s["file"].endswith(META_FORMATS[fmt]):
                raise bad(f"shards[{i}].file {s['file']!r} must be a plain {META_FORMATS[fmt]} file name inside the folder")
            shards.append(ShardInfo(file=s["file"], start=start, stop=start + s["rows"], sha256=s["sha256"]))
        start += s["rows"]
    if start != shape[0]:
        raise bad(f"shard row counts sum to {start} but 'shape' has {shape[0]} rows")
    ids_hash = data.get("sample_ids_sha256")
    if not isinstance(ids_hash, str):
        raise bad("'sample_ids_sha256' must be a string")
    return EmbeddingMeta(
        encoder=encoder, tileset=tileset, n_rows=shape[0], dim=shape[1], dtype=np.dtype(dtype),
        shards=tuple(shards), sample_ids_sha256=ids_hash, format=fmt,
    )


def _linked_shard(s: dict, i: int, start: int, bad) -> ShardInfo:
    """A linked slide file's shard entry: an absolute ``file``, its ``dataset`` (str, or null for
    ``.npy``), ``size`` and ``mtime_ns`` (ints)."""
    dataset, size, mtime = s.get("dataset"), s.get("size"), s.get("mtime_ns")
    if not s["file"].startswith("/") or "::" in s["file"]:
        raise bad(f"shards[{i}].file {s['file']!r} must be an absolute path (without '::') of a linked slide file")
    if not (dataset is None or isinstance(dataset, str)) or not all(isinstance(v, int) and v >= 0 for v in (size, mtime)):
        raise bad(f"shards[{i}] must record 'dataset' (str or null), 'size' and 'mtime_ns' (ints >= 0)")
    return ShardInfo(file=s["file"], start=start, stop=start + s["rows"], sha256=s["sha256"], dataset=dataset,
                     size=size, mtime_ns=mtime)


def parse_view_spec(path: Path, *, view: str) -> ViewSpec:
    """Read and validate a view sidecar ``views/<view>.json``; raise :class:`ViewError` naming the key."""
    data = _read_json(path, f"sidecar of view {view!r}")
    for key in ("tileset", "confounder_column"):
        value = data.get(key)
        if not isinstance(value, str) or not value.strip():
            raise ViewError(f"{path}: key {key!r} must be a non-empty string, got {value!r}")
    design = data.get("design")
    if design is not None:
        if not isinstance(design, str) or design.strip().lower() not in ("all", "paired_2x2"):
            raise ViewError(f"{path}: key 'design' must be 'all', 'paired_2x2' or absent, got {design!r}")
        design = design.strip().lower()
    digest, size = data.get("table_sha256"), data.get("table_bytes")
    if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        raise ViewError(f"{path}: key 'table_sha256' must be 64 lowercase hex digits or absent, got {digest!r}")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise ViewError(f"{path}: key 'table_bytes' must be an integer >= 0 or absent, got {size!r}")
    return ViewSpec(name=view, tileset=data["tileset"], confounder_column=data["confounder_column"].strip(), design=design,
                    table_sha256=digest, table_bytes=size)
