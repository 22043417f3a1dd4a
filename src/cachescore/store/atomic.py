"""The store's atomic writes: :mod:`cachescore._atomic` (layer 0, shared with the cache and the
out-of-core engine's scratch files, which need not import the store), re-exported here."""

from .._atomic import (
    PARTIAL_SUFFIX,
    atomic_replace_dir,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    partial_path,
    sweep_partials,
)

__all__ = ["PARTIAL_SUFFIX", "partial_path", "atomic_write", "atomic_write_bytes", "atomic_write_json",
           "atomic_replace_dir", "sweep_partials"]
