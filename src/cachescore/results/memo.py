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
An entry file is one line of JSON (the entry's fields and the replicate count, -1 for none), a
newline, then the replicates as raw little-endian float64: nothing is unpickled, and a truncated
file is a miss.
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

#: The folder of kept record entries, under the table cache, and their files' suffix.
ENTRIES_DIR = "entries"
ENTRY_SUFFIX = ".entry"


def _token(kind: str, subject: dict, bootstrap: dict, min_support: float) -> str:
    """A kept file's key: ``subject`` (what it was computed from) with the bootstrap settings,
    ``min_support`` and the code version of the tables (``code_version("tables")``)."""
    return fingerprint({"kind": kind, **subject, "bootstrap": {k: bootstrap[k] for k in sorted(bootstrap)},
                        "min_support": float(min_support), "code": code_version("tables")})


def group_token(fingerprints, bootstrap: dict, min_support: float) -> str:
    """The key of a group's rows: its record fingerprints (as a set), the bootstrap settings,
    ``min_support`` and the code version of the tables (``code_version("tables")``)."""
    return _token("cachescore.score-group/1", {"fingerprints": sorted(set(fingerprints))}, bootstrap, min_support)


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
    return _token("cachescore.score-entry/1", {"fingerprint": str(fp)}, bootstrap, min_support)


class EntryMemo:
    """The record entries kept in ``<store>/table-cache/entries`` (see the module docstring).
    ``writable=False`` reads only. An entry is a dict of the score row's fields plus ``_reps``
    (a float64 array, or None without an interval)."""

    def __init__(self, store_path, *, writable: bool):
        self.folder = Path(store_path) / TABLE_CACHE_DIR / ENTRIES_DIR
        self.writable = writable

    def _path(self, token: str) -> Path:
        return self.folder / f"{token}{ENTRY_SUFFIX}"

    def get(self, token: str) -> dict | None:
        """The entry kept under ``token``, or None (absent, unreadable or damaged: recompute)."""
        try:
            head, _, body = self._path(token).read_bytes().partition(b"\n")
            entry = json.loads(head)
            n = int(entry.pop("_n_reps"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if n >= 0 and len(body) != 8 * n:
            return None  # truncated: recompute
        entry["_reps"] = np.frombuffer(body, dtype="<f8").astype(np.float64) if n >= 0 else None
        return entry

    def put(self, token: str, entry: dict) -> None:
        """Keep ``entry`` under ``token`` (atomic; best effort, like :meth:`TableMemo.put`)."""
        if not self.writable:
            return
        reps = entry.get("_reps")
        fields = {k: v for k, v in entry.items() if k != "_reps"}
        try:
            values = np.ascontiguousarray(reps, dtype="<f8") if reps is not None else None
            fields["_n_reps"] = -1 if values is None else int(values.size)
            data = json.dumps(fields).encode() + b"\n" + (b"" if values is None else values.tobytes())
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self._path(token), data, overwrite=True)
        except (OSError, ValueError, TypeError):
            pass

    def keep_only(self, tokens) -> int:
        """Remove the kept entries not in ``tokens``; returns how many."""
        return _keep_only(self.folder, tokens, ENTRY_SUFFIX) if self.writable else 0


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
