"""Embedding shards: memmap one ``.npy`` shard and check it against ``meta.json``; task bodies
that read rows from shards (docs/cache-layout.md). Every error names the shard file."""

from __future__ import annotations

import numpy as np

from .errors import ShardError, ShardNotFoundError

__all__ = ["open_shard", "read_shard_rows", "gather_rows"]


def open_shard(path: str, n_rows: int, dim: int, dtype: np.dtype, label: str) -> np.ndarray:
    """Memmap one shard and check its header against ``meta.json``; errors name the shard."""
    try:
        mm = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise ShardNotFoundError(f"{label}: shard file missing: {path}") from None
    except (ValueError, OSError, EOFError) as exc:
        raise ShardError(f"{label}: shard {path} is corrupt or truncated: {exc}") from exc
    if mm.dtype != dtype:
        raise ShardError(f"{label}: shard {path} has dtype {mm.dtype}, meta.json says {dtype}")
    if mm.shape != (n_rows, dim):
        raise ShardError(f"{label}: shard {path} has shape {mm.shape}, meta.json says {(n_rows, dim)}")
    return mm


def read_shard_rows(path: str, shard_rows: int, dim: int, dtype: str, start: int, stop: int, label: str) -> np.ndarray:
    """Task body: rows ``start:stop`` (shard-local) of one shard, as an owned in-memory array."""
    mm = open_shard(path, shard_rows, dim, np.dtype(dtype), label)
    return np.array(mm[start:stop], copy=True)


def gather_rows(paths: tuple[str, ...], offsets: np.ndarray, dim: int, dtype: str, rows: np.ndarray, label: str) -> np.ndarray:
    """Task body: the tileset rows ``rows`` (any order, repeats allowed) gathered from the shards.

    ``offsets`` has ``len(paths) + 1`` entries; shard ``s`` holds rows ``offsets[s]:offsets[s+1]``.
    Each touched shard is memmapped once and read with one fancy index.
    """
    rows = np.asarray(rows, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    out = np.empty((rows.shape[0], dim), dtype=np.dtype(dtype))
    if rows.size == 0:
        return out
    if rows.min() < 0 or rows.max() >= offsets[-1]:
        raise IndexError(f"{label}: row index out of range [0, {int(offsets[-1])})")
    which = np.searchsorted(offsets, rows, side="right") - 1
    for s in np.unique(which):
        sel = np.flatnonzero(which == s)
        mm = open_shard(paths[s], int(offsets[s + 1] - offsets[s]), dim, np.dtype(dtype), label)
        local = rows[sel] - offsets[s]
        order = np.argsort(local, kind="stable")  # sorted reads are kinder to the page cache
        out[sel[order]] = mm[local[order]]
    return out
