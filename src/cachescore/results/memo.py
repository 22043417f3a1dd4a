"""Incremental score tables: each leaderboard group's rows, kept in the store under a key of what
they were computed from, so a run with nothing new rebuilds ``scores.parquet`` without reading a
per-unit table or drawing a bootstrap replicate.

A group is one (view, design, scope, metric, m): its intervals, ranks and verdicts depend only on
its records (content-addressed by their fingerprints, so immutable), the bootstrap settings,
``min_support`` and the code that computes them. :func:`group_token` hashes exactly those; a
changed record, an added encoder (the groups it joins), other settings or edited code give another
token, hence a recomputation of that group only. Files live in ``<store>/table-cache/``
(:data:`cachescore.store.TABLE_CACHE_DIR`), one Parquet per token, written atomically; a damaged
or unreadable one is a miss, never an error.
"""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd

from .._atomic import atomic_write_bytes
from ..fingerprint import code_version, fingerprint
from ..store import TABLE_CACHE_DIR

__all__ = ["TableMemo", "group_token"]


def group_token(fingerprints, bootstrap: dict, min_support: float) -> str:
    """The key of a group's rows: its record fingerprints (as a set), the bootstrap settings,
    ``min_support`` and the code version of the tables (``code_version("tables")``)."""
    return fingerprint({"kind": "cachescore.score-group/1", "fingerprints": sorted(set(fingerprints)),
                        "bootstrap": {k: bootstrap[k] for k in sorted(bootstrap)}, "min_support": float(min_support),
                        "code": code_version("tables")})


class TableMemo:
    """The group rows kept in ``<store>/table-cache``. ``writable=False`` (read-only commands:
    ``export``, ``compare``) reads only; :meth:`put` and :meth:`keep_only` then do nothing."""

    def __init__(self, store_path, *, writable: bool):
        self.folder = Path(store_path) / TABLE_CACHE_DIR
        self.writable = writable

    def _path(self, token: str) -> Path:
        return self.folder / f"{token}.parquet"

    def get(self, token: str) -> pd.DataFrame | None:
        """The rows kept under ``token``, or None (absent, unreadable or damaged: recompute)."""
        try:
            return pd.read_parquet(self._path(token))
        except (OSError, ValueError):
            return None

    def put(self, token: str, frame: pd.DataFrame) -> None:
        """Keep ``frame`` under ``token`` (atomic; best effort: a full disk only costs a recomputation)."""
        if not self.writable:
            return
        buf = io.BytesIO()
        try:
            frame.to_parquet(buf, index=False)
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self._path(token), buf.getvalue(), overwrite=True)
        except (OSError, ValueError, TypeError):  # keeping is an optimisation: the table is still published
            pass

    def keep_only(self, tokens) -> int:
        """Remove the kept groups not in ``tokens`` (superseded by this publication); returns how many."""
        if not self.writable or not self.folder.is_dir():
            return 0
        keep = {f"{t}.parquet" for t in tokens}
        removed = 0
        for path in self.folder.glob("*.parquet"):
            if path.name not in keep:
                try:
                    path.unlink()
                    removed += 1
                except OSError:
                    pass
        return removed
