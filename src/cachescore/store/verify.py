"""Health check of a results store (``cachescore status JOB --verify``); reads only.

:func:`verify_store` walks the store and reports, without changing anything:

* ``corrupt``: an envelope under ``units/`` that does not parse, names another fingerprint, has
  another record version, or whose per-unit table is missing, of another size or checksum;
* ``orphan``: a per-unit table no envelope references, or a ``*.partial`` leftover of a crashed
  writer (``cachescore run`` sweeps those it can prove unreferenced);
* ``provenance``: a run provenance that does not parse, has no known ``state``, or says
  ``running`` while its process is gone (``cachescore run`` / ``status`` mark those
  ``interrupted``);
* ``lock``: a lock file naming a holder whose process is gone, or one that is not a plain file of
  its own (a symlink, a hard link, a FIFO: ``run`` refuses it);
* ``table``: a tidy table at the store's top level (``scores.parquet``, ``probe.parquet``, ...)
  that Parquet cannot read (truncated, damaged footer); the next ``cachescore run`` rewrites it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .._atomic import PARTIAL_SUFFIX
from .lock import LOCK_NAME, StoreLock, lock_file_problem, process_alive
from .results import _FP, ResultsStore

__all__ = ["StoreProblem", "verify_store", "RUN_STATES"]

#: Every state a run's provenance can have; only ``running`` is not final.
RUN_STATES = ("running", "finished", "aborted", "interrupted")


@dataclass(frozen=True)
class StoreProblem:
    """One finding of :func:`verify_store`: ``kind`` (corrupt | orphan | provenance | lock), the
    file, and what is wrong with it."""

    kind: str
    path: str
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


def _referenced_tables(units: Path) -> set[Path]:
    """Per-unit tables any envelope names (a damaged envelope's table is not an orphan: the
    envelope is reported instead)."""
    found = set()
    for env_path in units.glob("*/*.json"):
        try:
            pu = json.loads(env_path.read_text(encoding="utf-8")).get("per_unit")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            continue
        if isinstance(pu, dict) and isinstance(pu.get("file"), str):
            found.add(env_path.parent / pu["file"])
    return found


def verify_store(store_path) -> list[StoreProblem]:
    """Every problem found in the results store at ``store_path`` (empty list: healthy); see the
    module docstring. A missing store has no problems (nothing was scored yet)."""
    root = Path(store_path)
    problems: list[StoreProblem] = []
    units = root / "units"
    if units.is_dir():
        store = ResultsStore(root)  # an existing store: nothing is written
        for env_path in sorted(units.glob("*/*.json")):
            if env_path.name.startswith("."):
                continue
            if not _FP.match(env_path.stem) or env_path.parent.name != env_path.stem[:2]:
                problems.append(StoreProblem("corrupt", str(env_path), "not named <fingerprint>.json in its "
                                             "<fingerprint[:2]> folder: no reader will find it"))
                continue
            _, why = store.inspect_envelope(env_path.stem, checksum=True)
            if why:
                problems.append(StoreProblem("corrupt", str(env_path), why))
        referenced = _referenced_tables(units)
        for table in sorted(units.glob("*/.*.parquet")):
            if table not in referenced:
                problems.append(StoreProblem("orphan", str(table), "per-unit table referenced by no envelope"))
    if root.is_dir():
        for leftover in sorted(root.rglob(f"*{PARTIAL_SUFFIX}")):
            problems.append(StoreProblem("orphan", str(leftover), "leftover of an interrupted write"))
    for prov in sorted((root / "runs").glob("*/provenance.json")) if (root / "runs").is_dir() else []:
        try:
            info = json.loads(prov.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            problems.append(StoreProblem("provenance", str(prov), f"does not parse: {exc}"))
            continue
        state = info.get("state") if isinstance(info, dict) else None
        if state not in RUN_STATES:
            problems.append(StoreProblem("provenance", str(prov), f"unknown run state {state!r}"))
        elif state == "running" and process_alive(info.get("process") or {}) is False:
            problems.append(StoreProblem("provenance", str(prov), "says 'running' but its process "
                                         f"{(info.get('process') or {}).get('pid')} is gone (an interrupted run)"))
    lock_why = lock_file_problem(root / LOCK_NAME)
    if lock_why is not None:
        problems.append(StoreProblem("lock", str(root / LOCK_NAME), f"cachescore run refuses it: {lock_why}"))
    elif (root / LOCK_NAME).is_file():
        holder, _ = StoreLock(root, "verify").holder()
        if holder and process_alive(holder) is False:
            problems.append(StoreProblem("lock", str(root / LOCK_NAME), f"names run {holder.get('run_id')} whose "
                                         f"process {holder.get('pid')} is gone (the next run takes it over)"))
    problems += _table_problems(root)
    return problems


def _table_problems(root: Path) -> list[StoreProblem]:
    """The store's top-level Parquet tables that do not read back (footer, schema and every page)."""
    out = []
    for table in sorted(root.glob("*.parquet")) if root.is_dir() else []:
        try:
            pq.read_table(table)
        except (OSError, pa.ArrowException, ValueError) as exc:
            out.append(StoreProblem("table", str(table), f"does not read as Parquet ({_one_line(exc)}); the next "
                                                         "`cachescore run` rewrites it"))
    return out


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200]
