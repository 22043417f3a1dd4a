"""The results store: one folder, one immutable record per work-unit fingerprint.

::

    STORE/
      store.json                              # {"format": "cachescore.results", "version": 1}
      units/<fp[:2]>/<fp>.json                # envelope: record + pointer to per-unit table
      units/<fp[:2]>/.<fp>.<uuid>.parquet     # per-unit values (written first, hidden name)
      failures/<fp[:2]>/<fp>.json             # last failure of a unit (superseded by a success)
      runs/<run_id>/provenance.json           # versions, params, recall audit, ...
      runs/<run_id>/                          # + the Dask performance report HTML
      bundles/                                # probe evaluation bundles (default [job] bundles)
      scratch/                                # transient engine artefacts (out of core: scratch/large)
      table-cache/<token>.parquet             # each leaderboard group's rows, by what they depend on

Publication protocol of :meth:`ResultsStore.write_unit`: the per-unit Parquet is written under a
unique name (atomic), then the envelope JSON, naming that file and its sha256, is written to a
``.partial`` sibling and renamed to ``<fp>.json``. The key exists only after that rename, so a crash
at any point leaves either no record or a complete one. Readers accept an envelope only if it
parses, has this code's record version (:data:`~.schema.RECORD_VERSION`; records of
another version are ignored, so their units are recomputed, never converted), names its own
fingerprint and its per-unit file exists with the recorded size and sha256 checksum; anything else
is a *damaged* record: absent for the planner (its unit is pending again and the next run
recomputes it, replacing the damaged files), listed by :meth:`ResultsStore.damaged` for readers
and ``status --verify``. Checksums are memoised per file identity (inode, size, mtime), so a
planner that asks twice hashes once.
Different processes may write different (or even the same) units concurrently: every file they
create has a unique name until the final atomic rename.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .._hashing import sha256_file, sha256_stream
from .._jsonsafe import json_safe
from .._atomic import atomic_write, atomic_write_json, sweep_partials
from .lock import process_alive
from .schema import (
    FAILURES_SCHEMA,
    RECORD_VERSION,
    SCORES_SCHEMA,
    STORE_LAYOUT_VERSION,
    failure_to_row,
    record_to_row,
    rows_to_frame,
    utc_now,
)

__all__ = ["ResultsStore", "StoreError", "CorruptRecordError", "StoreWriteError", "STORE_MARKER", "SCORES_FILE",
           "PROBE_FILE", "CENTRES_FILE", "REPORT_FILE", "BUNDLES_DIR", "SCRATCH_DIR", "TABLE_CACHE_DIR", "is_store", "scratch_path",
           "default_bundles"]

#: The files of a store's top level (the one place they are spelled; README "Reading results").
STORE_MARKER = "store.json"
SCORES_FILE = "scores.parquet"
PROBE_FILE = "probe.parquet"
CENTRES_FILE = "probe_centres.parquet"
REPORT_FILE = "report.html"
#: The store's folders besides its records: probe bundles (unless the job puts them elsewhere) and
#: engines' transient scratch.
BUNDLES_DIR = "bundles"
SCRATCH_DIR = "scratch"
#: The incremental score tables' kept groups (``cachescore.results.memo``).
TABLE_CACHE_DIR = "table-cache"


def scratch_path(store_root) -> Path:
    """The store's scratch folder (engines keep transient artefacts below it); nothing is created."""
    return Path(store_root) / SCRATCH_DIR


def default_bundles(store_root) -> Path:
    """Where a job's probe bundles go when ``[job] bundles`` is empty; nothing is created."""
    return Path(store_root) / BUNDLES_DIR


def is_store(path) -> bool:
    """Whether ``path`` holds a results store (its :data:`STORE_MARKER`); reads only."""
    return (Path(path) / STORE_MARKER).is_file()

_FP = re.compile(r"\A[0-9a-f]{16,128}\Z")
_RUN = re.compile(r"\A[A-Za-z0-9_][A-Za-z0-9_.:+=@-]*\Z")
_STORE_META = {"format": "cachescore.results", "version": STORE_LAYOUT_VERSION}


class StoreError(ValueError):
    """The results store folder is not a results store, or an argument is invalid."""


class StoreWriteError(OSError):
    """Writing a record into the store failed (disk full, read-only, I/O error); the message names
    the file. ``errno`` is the underlying error's."""


class CorruptRecordError(KeyError):
    """A stored unit exists but its per-unit table does not match its envelope (recompute it)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ResultsStore:
    """A results store folder. See the module docstring for the layout.

    Parameters
    ----------
    path : str or Path
        The store folder. An existing non-empty folder must carry this store's ``store.json``.
    mode : ``"a"`` (default) or ``"r"``
        ``"a"``: read and write; the folder and ``store.json`` are created if missing. ``"r"``:
        never writes anything (a missing store reads as empty; the write methods raise
        :class:`StoreError`): what ``status``, ``report``, ``export``, ``compare`` and ``validate``
        use, so they work on a read-only mount and create nothing. Zarr-style
        :meth:`open` / :meth:`create` name the two.
    """

    def __init__(self, path, mode: str = "a"):
        if mode not in ("r", "a"):
            raise ValueError(f"store mode must be 'r' (read only) or 'a' (read and write, created if missing), got {mode!r}")
        self.path = Path(path)
        self.read_only = mode == "r"
        marker = self.path / STORE_MARKER
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"results store path {self.path} exists and is not a folder")
        if not self.read_only:
            self.path.mkdir(parents=True, exist_ok=True)
        if marker.is_file():
            try:
                meta = json.loads(marker.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise StoreError(f"{marker} is not valid JSON: {exc}") from exc
            if meta.get("format") != _STORE_META["format"]:
                raise StoreError(f"{self.path} is not a cachescore results store ({marker} says {meta!r})")
            if meta.get("version") != STORE_LAYOUT_VERSION:
                raise StoreError(f"{self.path}: store layout version {meta.get('version')!r} is not supported "
                                 f"(this cachescore writes version {STORE_LAYOUT_VERSION}); use a new store folder")
        elif self.path.is_dir():
            if any(p.name not in ("units", "failures", "runs") and not p.name.startswith(".") for p in self.path.iterdir()):
                raise StoreError(f"{self.path} is not empty and has no store.json: refusing to use it as a results store")
            if not self.read_only:
                try:
                    atomic_write_json(marker, _STORE_META, overwrite=False)
                except FileExistsError:
                    pass  # another process created it meanwhile

    @classmethod
    def open(cls, path, mode: str = "r") -> "ResultsStore":
        """Open the store at ``path``: ``mode="r"`` never writes (a missing store reads as empty,
        every write method raises :class:`StoreError`), ``"a"`` creates it if missing."""
        return cls(path, mode)

    @classmethod
    def create(cls, path) -> "ResultsStore":
        """The store at ``path`` for reading and writing, created (folder and ``store.json``) if missing."""
        return cls(path, "a")

    def _writable(self) -> None:
        if self.read_only:
            raise StoreError(f"{self.path}: the results store was opened read-only (mode='r'); nothing is written")

    def __repr__(self) -> str:
        return f"ResultsStore({str(self.path)!r})"

    def _digest(self, f: Path, st: os.stat_result) -> str:
        """sha256 of file ``f`` (``st``: its stat), memoised by identity (inode, size, mtime); read
        in steps, never whole (an out-of-core unit's per-unit table holds millions of rows)."""
        memo = self.__dict__.setdefault("_digests", {})
        key = (str(f), st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in memo:
            memo[key] = sha256_file(f)
        return memo[key]

    # -- paths --------------------------------------------------------------------------------
    @staticmethod
    def _check_fp(fp) -> str:
        if not isinstance(fp, str) or not _FP.match(fp):
            raise StoreError(f"fingerprint must be 16-128 lowercase hex characters, got {fp!r}")
        return fp

    def _unit_json(self, fp: str) -> Path:
        return self.path / "units" / fp[:2] / f"{fp}.json"

    def _failure_json(self, fp: str) -> Path:
        return self.path / "failures" / fp[:2] / f"{fp}.json"

    # -- reading ------------------------------------------------------------------------------
    def _envelope(self, fp: str) -> dict | None:
        """The unit's envelope if it is complete and trustworthy (checksum included), else None."""
        return self.inspect_envelope(fp, checksum=True)[0]

    def damaged(self, fps) -> list[tuple[str, str]]:
        """``(fingerprint, what is wrong)`` of each of ``fps`` whose envelope file exists but is not
        a complete, trustworthy record (see the module docstring); the planner treats those units
        as pending, so ``cachescore run`` recomputes them."""
        out = []
        for fp in fps:
            if not self._unit_json(self._check_fp(fp)).exists():
                continue
            env, why = self.inspect_envelope(fp, checksum=True)
            if env is None and why != "missing":
                out.append((fp, why))
        return out

    @staticmethod
    def _raw_json(path: Path) -> dict | None:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return doc if isinstance(doc, dict) else None

    def raw_record(self, fp: str) -> dict | None:
        """The record dict an envelope holds, trustworthy or not (its per-unit table unchecked), or
        None when the envelope is absent or does not parse: what a record *claims* to be (used to
        tell which job's scope it belongs to, never to report a value)."""
        rec = (self._raw_json(self._unit_json(self._check_fp(fp))) or {}).get("record")
        return rec if isinstance(rec, dict) else None

    def failure_unit(self, fp: str) -> dict | None:
        """The unit identity a failure file records (``encoder``, ``view``, ``metric``, ...), or None."""
        unit = (self._raw_json(self._failure_json(self._check_fp(fp))) or {}).get("unit")
        return unit if isinstance(unit, dict) else None

    def _raw_table_name(self, fp: str) -> str | None:
        """The per-unit table file an envelope names, whether or not the record is trustworthy."""
        pu = (self._raw_json(self._unit_json(fp)) or {}).get("per_unit")
        name = pu.get("file") if isinstance(pu, dict) else None
        ok = isinstance(name, str) and Path(name).name == name and name.startswith(f".{fp}.")
        return name if ok else None

    def inspect_envelope(self, fp: str, *, checksum: bool = False) -> tuple[dict | None, str | None]:
        """``(envelope, None)`` when the stored unit ``fp`` is complete and trustworthy, else
        ``(None, what is wrong)`` (``"missing"`` when there is no envelope). ``checksum`` also
        hashes the per-unit table (memoised; every reader of this class does, so the planner,
        the readers and ``status --verify`` share one predicate)."""
        path = self._unit_json(fp)
        try:
            env = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None, "missing"
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return None, f"envelope does not parse: {exc}"
        if not isinstance(env, dict):
            return None, "envelope is not a JSON object"
        if env.get("version") != RECORD_VERSION:
            return None, f"record version {env.get('version')!r} (this cachescore reads {RECORD_VERSION}); it is recomputed"
        if env.get("fingerprint") != fp:
            return None, f"envelope names fingerprint {env.get('fingerprint')!r}, not its file name"
        if not (isinstance(env.get("record"), dict) and isinstance(env.get("finished_at"), str)):
            return None, "envelope has no record or finished_at"
        pu = env.get("per_unit")
        if pu is not None:
            if not (isinstance(pu, dict) and isinstance(pu.get("file"), str) and isinstance(pu.get("sha256"), str)
                    and isinstance(pu.get("bytes"), int)) or Path(pu["file"]).name != pu["file"]:
                return None, "per_unit pointer is malformed"
            f = path.parent / pu["file"]
            if not f.is_file():
                return None, f"per-unit table {f.name} is missing"
            st = f.stat()
            if st.st_size != pu["bytes"]:
                return None, f"per-unit table {f.name} has {st.st_size} bytes, the envelope says {pu['bytes']}"
            if checksum and self._digest(f, st) != pu["sha256"]:
                return None, f"per-unit table {f.name} does not match its sha256 checksum"
        try:
            record_to_row(env["record"], fingerprint=fp, finished_at=env["finished_at"])
        except (TypeError, ValueError, OverflowError) as exc:
            return None, f"record does not fit the scores schema: {exc}"
        return env, None

    def has(self, fp: str) -> bool:
        """True iff a complete, well-formed record for ``fp`` is stored (a malformed one counts as absent)."""
        return self._envelope(self._check_fp(fp)) is not None

    def record(self, fp: str) -> dict | None:
        """The stored record dict of ``fp`` (as written, JSON types; NaN stored as null), or None."""
        env = self._envelope(self._check_fp(fp))
        return None if env is None else env["record"]

    def _complete(self):
        """``(fp, envelope)`` of every complete record, in fingerprint order."""
        base = self.path / "units"
        if not base.is_dir():
            return
        found = sorted({p.stem for p in base.glob("*/*.json") if not p.name.startswith(".") and _FP.match(p.stem)})
        for fp in found:
            env = self._envelope(fp)
            if env is not None:
                yield fp, env

    def fingerprints(self) -> set[str]:
        """Fingerprints of all complete records."""
        return {fp for fp, _ in self._complete()}

    def _score_rows(self) -> list[dict]:
        rows = [record_to_row(env["record"], fingerprint=fp, finished_at=env["finished_at"]) for fp, env in self._complete()]
        key = lambda r: tuple((r.get(c) is not None, r.get(c) or "") for c in ("encoder", "view", "scope", "metric", "fingerprint"))
        return sorted(rows, key=key)

    def scores_table(self) -> pa.Table:
        """:meth:`scores` as a ``pyarrow.Table`` with exactly :data:`~cachescore.store.schema.SCORES_SCHEMA`
        (e.g. to write a Parquet export)."""
        return pa.Table.from_pylist(self._score_rows(), schema=SCORES_SCHEMA)

    def scores(self) -> pd.DataFrame:
        """One row per complete record, with exactly the columns of
        :data:`cachescore.store.schema.SCORES_SCHEMA` (record keys outside it are in ``extra``,
        ``params`` is canonical JSON text). Sorted by encoder, view, scope, metric, fingerprint
        (missing values first). Malformed records are skipped. Dtypes: ``str``, ``float64``
        (null -> NaN), nullable ``Int64``, ``datetime64[us, UTC]``."""
        return rows_to_frame(self._score_rows(), SCORES_SCHEMA)

    def per_unit(self, fp: str, *, text_as_categories: bool = False) -> pd.DataFrame:
        """The per-unit table stored with ``fp`` (an empty frame if none was stored).
        ``text_as_categories``: text columns come back as categoricals (a few bytes a row: what
        a score's interval reads of a table of millions of units), values unchanged.

        Raises ``KeyError`` if no record exists and :class:`CorruptRecordError` (a ``KeyError``)
        if it is damaged (its table missing, truncated or off its checksum).
        """
        env, why = self.inspect_envelope(self._check_fp(fp), checksum=True)
        if env is None and why != "missing":
            raise CorruptRecordError(f"record {fp} in {self.path} is damaged ({why}); recompute the unit")
        if env is None:
            raise KeyError(f"no complete record for fingerprint {fp} in {self.path}")
        pu = env.get("per_unit")
        if pu is None:
            return pd.DataFrame()
        data = (self._unit_json(fp).parent / pu["file"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != pu["sha256"]:
            raise CorruptRecordError(f"per-unit table of {fp} in {self.path} does not match its checksum; recompute the unit")
        if not text_as_categories:
            return pq.read_table(io.BytesIO(data)).to_pandas()
        schema = pq.read_schema(io.BytesIO(data))
        text = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
        return pq.read_table(io.BytesIO(data), read_dictionary=text).to_pandas()

    def failures(self) -> pd.DataFrame:
        """Failed units without a later success, with :data:`~cachescore.store.schema.FAILURES_SCHEMA` columns."""
        base = self.path / "failures"
        rows = []
        if base.is_dir():
            for path in sorted(base.glob("*/*.json")):
                if path.name.startswith(".") or not _FP.match(path.stem):
                    continue
                try:
                    env = json.loads(path.read_text(encoding="utf-8"))
                    if env.get("version") != RECORD_VERSION or env.get("fingerprint") != path.stem:
                        continue
                    if self.has(path.stem):
                        continue
                    rows.append(failure_to_row(env))
                except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                    continue
        return rows_to_frame(rows, FAILURES_SCHEMA)

    # -- writing ------------------------------------------------------------------------------
    def write_unit(self, fp: str, *, record: dict, per_unit: pd.DataFrame | None = None) -> None:
        """Store the result of one unit atomically (see the module docstring).

        ``record`` is a dict of JSON-able values (numpy scalars/arrays accepted; NaN stored as
        null); the keys of :data:`~cachescore.store.schema.SCORES_SCHEMA` become columns of
        :meth:`scores`. ``per_unit`` (optional) is stored as Parquet without its index; a path
        names a finished Parquet file (an out-of-core unit's, assembled on a worker), stored as it
        is, never read whole into memory. Rewriting
        an existing fingerprint replaces it atomically (and the replaced record's per-unit table is
        deleted once unreferenced). A stored failure of ``fp`` is removed.

        Raises :class:`StoreError` (bad fingerprint), ``TypeError`` (record not a dict or not
        JSON-able, per_unit not a DataFrame), ``ValueError`` (record does not fit the schema),
        :class:`StoreWriteError` (an ``OSError`` naming the file that could not be written: disk
        full, read-only store; nothing is published and no new file is left behind).
        """
        self._writable()
        self._check_fp(fp)
        if not isinstance(record, dict):
            raise TypeError(f"record must be a dict, got {type(record).__name__}")
        body = json_safe(record, nonfinite="string")
        finished_at = utc_now()
        record_to_row(body, fingerprint=fp, finished_at=finished_at)  # schema check before publishing
        target = self._unit_json(fp)
        data = source = None
        if isinstance(per_unit, (str, Path)):
            source = Path(per_unit)
        elif per_unit is not None:
            if not isinstance(per_unit, pd.DataFrame):
                raise TypeError(f"per_unit must be a pandas DataFrame, a Parquet file's path or None, "
                                f"got {type(per_unit).__name__}")
            buf = io.BytesIO()
            pq.write_table(pa.Table.from_pandas(per_unit, preserve_index=False), buf)
            data = buf.getvalue()
        previous = self._raw_table_name(fp)  # unreferenced once this one is published (damaged or not)
        written, pointer = target, None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if data is not None:
                name = f".{fp}.{uuid.uuid4().hex}.parquet"
                written = target.parent / name
                atomic_write(written, lambda fh: fh.write(data), overwrite=False)
                pointer = {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                           "rows": len(per_unit)}
            elif source is not None:
                name = f".{fp}.{uuid.uuid4().hex}.parquet"
                written = target.parent / name
                pointer = self._take_table(source, written)
            envelope = {"version": RECORD_VERSION, "fingerprint": fp, "finished_at": finished_at,
                        "record": body, "per_unit": pointer}
            written = target
            atomic_write_json(target, envelope, overwrite=True)
        except OSError as exc:
            if written == target and pointer is not None:  # the envelope failed: its new table is unreferenced
                (target.parent / pointer["file"]).unlink(missing_ok=True)
            raise StoreWriteError(exc.errno, f"cannot write {written}: {exc.strerror or exc}") from exc
        if previous and previous != (pointer or {}).get("file"):
            (target.parent / previous).unlink(missing_ok=True)
        try:
            self._failure_json(fp).unlink()
        except FileNotFoundError:
            pass

    @staticmethod
    def _take_table(source: Path, dest: Path) -> dict:
        """Move (or, across file systems, copy) the finished Parquet file ``source`` to ``dest``
        (a new name in the store) and return its per-unit pointer; read in 1 MiB blocks, so a
        table of any size costs no memory. Raises ``ValueError`` for a file that is not Parquet."""
        rows = pq.ParquetFile(source).metadata.num_rows
        with open(source, "rb") as fh:
            digest, size = sha256_stream(fh)
        try:
            os.link(source, dest)  # same file system: no copy; the scratch name goes with the scratch
        except OSError:
            def copy(out):
                with open(source, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)

            atomic_write(dest, copy, overwrite=False)
        return {"file": dest.name, "sha256": digest, "bytes": size, "rows": int(rows)}

    def record_failure(self, fp: str, *, unit: dict, error: str) -> None:
        """Record that unit ``fp`` failed with ``error``; a later :meth:`write_unit` supersedes it.
        A failure never hides an existing success (it is listed only while ``has(fp)`` is False)."""
        self._writable()
        self._check_fp(fp)
        if not isinstance(unit, dict):
            raise TypeError(f"unit must be a dict, got {type(unit).__name__}")
        envelope = {"version": RECORD_VERSION, "fingerprint": fp, "failed_at": utc_now(),
                    "unit": json_safe(unit, nonfinite="string"), "error": str(error)}
        path = self._failure_json(fp)
        try:
            atomic_write_json(path, envelope, overwrite=True)
        except OSError as exc:
            raise StoreWriteError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from exc

    def stored_fingerprints(self) -> set[str]:
        """Every fingerprint with an envelope file under ``units/`` (complete or not)."""
        base = self.path / "units"
        return {p.stem for p in base.glob("*/*.json") if _FP.match(p.stem)} if base.is_dir() else set()

    def failure_fingerprints(self) -> set[str]:
        """Every fingerprint with a failure file under ``failures/`` (superseded ones included)."""
        base = self.path / "failures"
        return {p.stem for p in base.glob("*/*.json") if _FP.match(p.stem)} if base.is_dir() else set()

    def delete_unit(self, fp: str) -> int:
        """Remove a stored unit: its envelope first (the key disappears at once, readers then
        ignore the rest), then every per-unit table written for it. Returns the bytes freed;
        missing files are not an error."""
        self._writable()
        env_path = self._unit_json(self._check_fp(fp))
        freed = env_path.stat().st_size if env_path.is_file() else 0
        env_path.unlink(missing_ok=True)
        for table in env_path.parent.glob(f".{fp}.*.parquet"):
            freed += table.stat().st_size
            table.unlink(missing_ok=True)
        return freed

    def clear_failure(self, fp: str) -> None:
        """Forget a recorded failure of ``fp`` (for units whose success is stored under other
        fingerprints, e.g. a probe unit's per-record results). Missing is not an error."""
        self._writable()
        self._failure_json(self._check_fp(fp)).unlink(missing_ok=True)

    # -- runs ---------------------------------------------------------------------------------
    @staticmethod
    def _check_run(run_id) -> str:
        if not isinstance(run_id, str) or not _RUN.match(run_id):
            raise StoreError(f"run_id must be a plain name (letters, digits, '_.:+=@-'), got {run_id!r}")
        return run_id

    def run_dir(self, run_id: str) -> Path:
        """``runs/<run_id>/`` (created): where provenance and the Dask performance report go."""
        self._writable()
        path = self.path / "runs" / self._check_run(run_id)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def write_provenance(self, run_id: str, info: dict) -> Path:
        """Atomically write ``runs/<run_id>/provenance.json`` (replacing an earlier version for the
        same run, e.g. start then finish). ``info`` must be JSON-able (numpy accepted)."""
        self._writable()
        if not isinstance(info, dict):
            raise TypeError(f"info must be a dict, got {type(info).__name__}")
        return atomic_write_json(self.run_dir(run_id) / "provenance.json", json_safe(info, nonfinite="string"), overwrite=True)

    def overwrite_provenance_in_place(self, run_id: str, info: dict) -> Path:
        """Last resort when :meth:`write_provenance` fails for lack of space: overwrite the run's
        existing ``provenance.json`` in place with ``info`` (a compact final state, smaller than the
        ``running`` version it replaces, so no new blocks are needed). Not atomic: a crash midway can
        leave a torn file, which readers report (``status --verify``) instead of a run that seems
        to run forever."""
        self._writable()
        path = self.path / "runs" / self._check_run(run_id) / "provenance.json"
        data = (json.dumps(json_safe(info, nonfinite="string"), indent=1, sort_keys=True) + "\n").encode("utf-8")
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        return path

    def read_provenance(self, run_id: str) -> dict:
        """The provenance dict of ``run_id``; ``KeyError`` if none was written."""
        path = self.path / "runs" / self._check_run(run_id) / "provenance.json"
        if not path.is_file():
            raise KeyError(f"no provenance for run {run_id!r} in {self.path}")
        return json.loads(path.read_text(encoding="utf-8"))

    def mark_stale_runs(self) -> list[str]:
        """Rewrite the provenance of every run that says ``running`` but whose process (its
        ``process``: host, pid, start time) is gone on this host as ``interrupted`` (a run killed
        by SIGKILL or a crash could write nothing). Returns those run ids; runs of other hosts
        and unwritable stores (or one opened read-only) are left as they are."""
        if self.read_only:
            return []
        marked = []
        for run_id in self.runs():
            try:
                info = self.read_provenance(run_id)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue
            proc = info.get("process") if isinstance(info, dict) else None
            if info.get("state") != "running" or not isinstance(proc, dict) or process_alive(proc) is not False:
                continue
            info.update(state="interrupted", reason=f"process {proc.get('pid')} on {proc.get('host')} ended without "
                                                     f"finishing the run (killed or crashed); noticed {utc_now()}")
            try:
                self.write_provenance(run_id, info)
            except OSError:
                continue
            marked.append(run_id)
        return marked

    def runs(self) -> list[str]:
        """Sorted run ids that have a provenance file."""
        base = self.path / "runs"
        return sorted(p.parent.name for p in base.glob("*/provenance.json")) if base.is_dir() else []

    def sweep(self, *, older_than_s: float = 3600.0) -> int:
        """Delete leftovers of crashed writers (``*.partial``) and per-unit tables no envelope
        references, older than ``older_than_s``; return how many were removed."""
        self._writable()
        removed = sweep_partials(self.path, older_than_s=older_than_s)
        base = self.path / "units"
        if base.is_dir():

            cutoff = time.time() - older_than_s
            for f in base.glob("*/.*.parquet"):
                fp = f.name[1:].split(".", 1)[0]
                env = self._envelope(fp) if _FP.match(fp) else None
                if (env is None or (env.get("per_unit") or {}).get("file") != f.name) and f.stat().st_mtime < cutoff:
                    f.unlink(missing_ok=True)
                    removed += 1
        return removed
