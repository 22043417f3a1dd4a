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

Below the groups, each metric record's *entry* (its row before ranking: value, interval, flags,
and its bootstrap replicates, the paired draws the ranks are computed from) is kept in
``<store>/table-cache/entries/`` (:class:`EntryMemo`, keyed by :func:`entry_token`: the record's
fingerprint, the bootstrap settings, ``min_support`` and the tables' code version). An entry
depends on its own record only (the draw is a function of the view's groups and the seed), so a
group that gains an encoder ranks the kept entries of its other members and computes only the
new one's. The unit task writes its record's entry on the worker right after the record
(:func:`cachescore.results.scores.keep_entries`), so a run's publication draws no replicate at all.
Entries are ``.npz`` files without pickles (``allow_pickle=False``): the entry's fields as JSON
text and the replicates as a float64 array.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd

from .._atomic import atomic_write_bytes
from ..fingerprint import code_version, fingerprint
from ..store import TABLE_CACHE_DIR

__all__ = ["TableMemo", "group_token", "EntryMemo", "entry_token", "ENTRIES_DIR"]

#: The folder of kept record entries, under the table cache.
ENTRIES_DIR = "entries"


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
        return _keep_only(self.folder, tokens, ".parquet") if self.writable else 0


def entry_token(fp: str, bootstrap: dict, min_support: float) -> str:
    """The key of one record's entry: its fingerprint, the bootstrap settings, ``min_support``
    and the code version of the tables."""
    return fingerprint({"kind": "cachescore.score-entry/1", "fingerprint": str(fp),
                        "bootstrap": {k: bootstrap[k] for k in sorted(bootstrap)}, "min_support": float(min_support),
                        "code": code_version("tables")})


class EntryMemo:
    """The record entries kept in ``<store>/table-cache/entries`` (see the module docstring).
    ``writable=False`` reads only. An entry is a dict of the score row's fields plus ``_reps``
    (a float64 array, or None without an interval)."""

    def __init__(self, store_path, *, writable: bool):
        self.folder = Path(store_path) / TABLE_CACHE_DIR / ENTRIES_DIR
        self.writable = writable

    def _path(self, token: str) -> Path:
        return self.folder / f"{token}.npz"

    def get(self, token: str) -> dict | None:
        """The entry kept under ``token``, or None (absent, unreadable or damaged: recompute)."""
        try:
            with np.load(self._path(token), allow_pickle=False) as data:
                entry = json.loads(str(data["entry"][()]))
                entry["_reps"] = np.array(data["reps"], dtype=np.float64) if bool(data["has_reps"][()]) else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return entry

    def put(self, token: str, entry: dict) -> None:
        """Keep ``entry`` under ``token`` (atomic; best effort, like :meth:`TableMemo.put`)."""
        if not self.writable:
            return
        reps = entry.get("_reps")
        fields = {k: v for k, v in entry.items() if k != "_reps"}
        buf = io.BytesIO()
        try:
            np.savez(buf, entry=np.array(json.dumps(fields)), has_reps=np.array(reps is not None),
                     reps=np.asarray(reps if reps is not None else [], dtype=np.float64))
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self._path(token), buf.getvalue(), overwrite=True)
        except (OSError, ValueError, TypeError):
            pass

    def keep_only(self, tokens) -> int:
        """Remove the kept entries not in ``tokens``; returns how many."""
        return _keep_only(self.folder, tokens, ".npz") if self.writable else 0


def _keep_only(folder: Path, tokens, suffix: str) -> int:
    """Remove the ``*<suffix>`` files of ``folder`` whose token is not in ``tokens``; how many."""
    if not folder.is_dir():
        return 0
    keep = {f"{t}{suffix}" for t in tokens}
    removed = 0
    for path in folder.glob(f"*{suffix}"):
        if path.name not in keep:
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
    return removed
