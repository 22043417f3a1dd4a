"""Embedding caches: layout, lazy readers, writers, importer and a synthetic demo cache.

See ``docs/cache-layout.md``. Public names:

* :class:`Cache` – read a cache (a folder, or an fsspec URL such as ``s3://bucket/prefix``) (listings, views, lazy dask embeddings, fingerprints, validation);
* :class:`RowSource` – one encoder × tileset by location: what a Dask task reads rows through;
* :class:`ViewSpec`, :class:`EmbeddingMeta` – parsed sidecar / ``meta.json``;
* :func:`write_tileset`, :func:`write_embeddings`, :func:`write_view` – atomic writers;
* :func:`import_cache` – build a cache from per-encoder or per-slide arrays;
* :func:`make_demo_cache` – a small cache with a known confounder ranking;
* :func:`verify_cache` – a whole-cache health check returning every :class:`Problem`;
* the :mod:`~cachescore.cache.errors` hierarchy rooted at :class:`CacheError` (a ``ValueError``).
"""

from .errors import (
    AlignmentError,
    CacheAccessError,
    CacheError,
    CacheNotFoundError,
    LayoutError,
    NonFiniteError,
    ShardError,
    ShardNotFoundError,
    ViewChecksumError,
    ViewError,
)
from .importer import import_cache
from .layout import EmbeddingMeta, ViewSpec
from .reader import Cache, RowSource
from .synthetic import make_demo_cache
from .verify import PROBLEM_KINDS, Problem, verify_cache
from .writer import write_embeddings, write_tileset, write_view

__all__ = [
    "Cache",
    "RowSource",
    "ViewSpec",
    "EmbeddingMeta",
    "write_tileset",
    "write_embeddings",
    "write_view",
    "import_cache",
    "make_demo_cache",
    "verify_cache",
    "Problem",
    "PROBLEM_KINDS",
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
