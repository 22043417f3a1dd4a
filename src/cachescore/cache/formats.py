"""How an embedding's rows are stored: ``.npy`` shards (the default), Zarr v3 shards, or slide
files linked in place. What each writes and records in ``meta.json``; reading is in
:mod:`.shards` (ADR-0021 says when to pick which).

* **npy** (``cachescore.npy-shards``): uncompressed C-order row shards, memory-mapped locally,
  ranged requests remotely; a checksum per file.
* **zarr** (``cachescore.zarr-shards``): each shard a Zarr v3 array of whole-row chunks with a
  codec (zstd by default) and an optional storage dtype (``float16`` halves the bytes; an
  explicit choice, recorded as the cache's dtype); a digest over every file of the store.
* **linked** (``cachescore.linked``): no rows are written. Each slide's own ``.h5`` (TRIDENT /
  CLAM) or ``.npy`` file is one shard, recorded by absolute path, dataset, size, mtime and a
  quick content hash; reads check size and mtime first and refuse a changed file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CacheError, LayoutError
from .shards import LINK_SEP, quick_hash, zarr_digest

__all__ = ["StorageOptions", "STORAGE_FORMATS", "CODECS", "write_zarr_shard", "linked_shards"]

#: ``cachescore import --format`` values.
STORAGE_FORMATS = ("npy", "zarr")
#: Zarr codecs a cache may use (``none``: uncompressed chunks).
CODECS = ("zstd", "blosc", "none")
#: Bytes of one Zarr chunk by default (whole rows): what one ranged request fetches and decodes.
DEFAULT_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class StorageOptions:
    """How an import stores rows: ``format`` (``npy`` | ``zarr``); for Zarr the ``codec``, the
    rows per chunk (``chunk_rows``; default about 4 MiB of rows) and an optional
    ``storage_dtype`` (rows are cast to it; values that do not fit, e.g. beyond float16's
    range, are refused as non-finite). ``link``: record per-slide files in place instead."""

    format: str = "npy"
    codec: str = "zstd"
    chunk_rows: int | None = None
    storage_dtype: str | None = None
    link: bool = False

    def __post_init__(self):
        if self.format not in STORAGE_FORMATS:
            raise ValueError(f"storage format must be one of {list(STORAGE_FORMATS)}, got {self.format!r}")
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {list(CODECS)}, got {self.codec!r}")
        if self.chunk_rows is not None and int(self.chunk_rows) < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {self.chunk_rows!r}")
        if self.storage_dtype not in (None, "float16", "float32", "float64"):
            raise ValueError(f"storage dtype must be float16, float32 or float64, got {self.storage_dtype!r}")
        if self.format != "zarr" and (self.storage_dtype or self.chunk_rows):
            raise ValueError("a storage dtype and chunk rows apply to --format zarr only")
        if self.link and self.format != "npy":
            raise ValueError("--link reads the slide files in place: it takes no --format")

    def stored_dtype(self, dtype) -> np.dtype:
        return np.dtype(self.storage_dtype) if self.storage_dtype else np.dtype(dtype)

    def chunk_rows_for(self, dim: int, itemsize: int) -> int:
        return int(self.chunk_rows) if self.chunk_rows else max(1, DEFAULT_CHUNK_BYTES // max(1, dim * itemsize))


def _compressors(codec: str):
    import zarr  # deferred: only Zarr shards need it

    if codec == "none":
        return None
    if codec == "zstd":
        return zarr.codecs.ZstdCodec(level=3)
    return zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")


def write_zarr_shard(path: Path, start: int, stop: int, dim: int, options: StorageOptions, dtype: np.dtype,
                     read_rows) -> str:
    """Write rows ``start:stop`` as a Zarr v3 array at ``path`` (a new folder) in whole-row chunks;
    ``read_rows(lo, hi)`` returns checked rows of ``dtype`` (cast here to the storage dtype, whose
    result is checked for non-finite values by the caller's ``read_rows`` contract). Returns the
    store's digest (:func:`.shards.zarr_digest`)."""
    import zarr  # deferred: only Zarr shards need it

    stored = options.stored_dtype(dtype)
    rows = max(stop - start, 0)
    chunk = min(options.chunk_rows_for(dim, stored.itemsize), max(rows, 1))
    array = zarr.create_array(store=str(path), shape=(rows, int(dim)), chunks=(chunk, int(dim)), dtype=stored,
                              compressors=_compressors(options.codec), zarr_format=3, fill_value=0)
    step = max(chunk, (65536 // chunk) * chunk)  # whole chunks per write: no read-modify-write
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        array[lo - start : hi - start] = read_rows(lo, hi)
    return zarr_digest(path)


def linked_shards(files: list[tuple[str, str | None, int]], *, what: str) -> list[dict]:
    """The ``meta.json`` shard entries of slide files linked in place: ``files`` is
    ``[(path, h5 dataset or None for .npy, rows)]`` in tileset order. Records each file's
    absolute path, dataset, rows, size, mtime (ns) and quick hash (:func:`.shards.quick_hash`:
    its size and first and last 64 KiB, so a link costs a few reads per slide, not a copy)."""
    out = []
    for path, dataset, rows in files:
        full = os.path.abspath(path)
        if LINK_SEP in full:
            raise CacheError(f"{what}: {full} contains {LINK_SEP!r}; a linked slide file's path must not")
        try:
            st = os.stat(full)
            digest = quick_hash(full)
        except OSError as exc:
            raise LayoutError(f"{what}: cannot read {full} to link it: {exc}") from exc
        out.append({"file": full, "dataset": dataset, "rows": int(rows), "size": int(st.st_size),
                    "mtime_ns": int(st.st_mtime_ns), "sha256": digest})
    return out
