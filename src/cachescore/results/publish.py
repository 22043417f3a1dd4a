"""The run's tidy tables, built from what is stored and published in the store (ADR-0009).

``cachescore run`` publishes after every run (whatever its ending) and ``cachescore scores`` builds
the same tables without writing: both go through :func:`build_results`, so the leaderboard and
``<store>/scores.parquet`` never disagree.
"""

from __future__ import annotations

from typing import TextIO

from ..cache import Cache
from ..store import CorruptRecordError
from .memo import EntryMemo, TableMemo
from .scores import probe_centre_table, probe_table, score_table
from .tables import publish_tables

__all__ = ["build_results", "publish_results"]


def build_results(store, cache_root, fingerprints, *, bootstrap: dict | None, min_support: float,
                  keep: bool = False) -> tuple:
    """``(scores, probe, probe_centres)``: the tidy tables of the records ``fingerprints`` (a
    job's current records) in ``store``, scored against the cache at ``cache_root`` with the job's
    ``[metrics] bootstrap`` and ``[report] min_support``. Records the store lacks are left out;
    nothing is written. Raises what the tables raise for bad inputs (``ValueError``) or a damaged
    record (:class:`~cachescore.store.CorruptRecordError`). Groups unchanged since they were last
    kept in the store (:class:`~.memo.TableMemo`) are read from there, and a changed group ranks
    its members' kept entries (:class:`~.memo.EntryMemo`: computed by the unit tasks, or here);
    ``keep`` (publication only: read-only commands never write) keeps the recomputed ones."""
    store = _RecordsReadOnce(store)  # the three tables read the same records
    memo, entries = TableMemo(store.path, writable=keep), EntryMemo(store.path, writable=keep)
    scores = score_table(store, Cache(cache_root), fingerprints, bootstrap=bootstrap, min_support=float(min_support),
                         memo=memo, entries=entries)
    return scores, probe_table(store, fingerprints), probe_centre_table(store, fingerprints)


class _RecordsReadOnce:
    """``store`` whose :meth:`record` reads each record once (for one :func:`build_results`)."""

    def __init__(self, store):
        self._store, self._records = store, {}

    def record(self, fp: str):
        if fp not in self._records:
            self._records[fp] = self._store.record(fp)
        return self._records[fp]

    def __getattr__(self, name):
        return getattr(self._store, name)


def publish_results(store, cache_root, fingerprints, *, bootstrap: dict | None, min_support: float,
                    out: TextIO | None = None) -> dict:
    """Rebuild ``<store>/scores.parquet`` and ``<store>/probe.parquet`` (and the per-centre probe
    table) from :func:`build_results` and write them atomically. Returns ``{"scores": path,
    "probe": path, ...}``, or ``{}`` when a table could not be built or written (the reason is
    printed on ``out``; the stored records are untouched and the next run tries again)."""
    try:
        tables = build_results(store, cache_root, fingerprints, bootstrap=bootstrap, min_support=min_support,
                               keep=True)
        return {k: str(v) for k, v in publish_tables(store.path, *tables).items()}
    except (ValueError, OSError, CorruptRecordError) as exc:  # bad inputs or a damaged record: say so, go on
        if out is not None:
            print(f"results tables not written: {type(exc).__name__}: {exc}", file=out, flush=True)
        return {}
