"""Exceptions raised by the cache layer.

One hierarchy: :class:`CacheError` subclasses :class:`ValueError`, and the not-found errors also
subclass :class:`FileNotFoundError`, so callers may catch either the package type or the builtin.
Every message names the place: the cache file, the encoder/tileset/view, the column, the row or row
range, and where it helps the fix.
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "CacheNotFoundError",
    "CacheAccessError",
    "LayoutError",
    "AlignmentError",
    "ShardError",
    "ShardNotFoundError",
    "NonFiniteError",
    "ViewError",
    "ViewChecksumError",
]


class CacheError(ValueError):
    """Base class: the cache (or an input to the cache writer/importer) is not valid."""


class CacheNotFoundError(CacheError, FileNotFoundError):
    """A required cache file or folder (tileset, embeddings, view, sidecar) does not exist."""


class CacheAccessError(CacheError, PermissionError):
    """The storage holding a remote cache refused a request (wrong or missing credentials, no
    permission) or could not be reached; the message says where credentials are read from."""


class LayoutError(CacheError):
    """A cache file exists but its content breaks the layout contract (bad JSON, schema, dtype)."""


class AlignmentError(CacheError):
    """Embedding rows do not line up with ``tiles.parquet`` (row count or sample_id order)."""


class ShardError(LayoutError):
    """An embedding shard is corrupt, truncated, or differs from ``meta.json`` (shape, dtype, checksum)."""


class ShardNotFoundError(CacheNotFoundError):
    """An embedding shard listed in ``meta.json`` is missing."""


class NonFiniteError(CacheError):
    """Embedding rows contain NaN or infinite values."""


class ViewError(CacheError):
    """A view table or its sidecar is invalid (missing columns, unknown sample_id, blank values)."""


class ViewChecksumError(ViewError):
    """A view table's bytes differ from the sha256/size its sidecar records (a file changed outside
    ``write_view``, or a replacement in progress)."""
