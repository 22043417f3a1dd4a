"""Scratch layout of the out-of-core engine: constants, scratch folders, the chunk files' format
and their readers (:class:`Layout`), the scope's row table (:class:`ScopeRows`, ``rows.npy``)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...cache import RowSource
from ...fingerprint import fingerprint
from ..._atomic import atomic_write, atomic_write_json

#: Embedding bytes per partition chunk (DESIGN §2: row chunks of ~64–256 MiB).
CHUNK_BYTES = 128 * 2**20
#: Target rows per k-means cluster (``C = ceil(n / ROWS_PER_CLUSTER)``).
ROWS_PER_CLUSTER = 2048
#: Rows of the sample the centroids are trained on: ``48 · C`` clamped to
#: ``[KMEANS_MIN_SAMPLE, KMEANS_MAX_SAMPLE]`` (and to ``n``); the cap keeps the read bounded.
KMEANS_MIN_SAMPLE = 20000
KMEANS_MAX_SAMPLE = 65536
#: Query rows per search task (a batch of whole clusters; at least one cluster). Four clusters
#: of ROWS_PER_CLUSTER: more, shorter tasks leave less of the last wave to one worker.
BATCH_ROWS = 8192
#: Target rows held at once by a search task.
PIECE_ROWS = 65536
#: Calibration queries (their exact answers pick the probe radius).
CALIBRATION_QUERIES = 2000
#: The calibration and audit queries are answered exactly in this many parts per chunk (one task
#: each): shorter tasks, so the last wave of the brute-force pass leaves less time to one worker.
CALIBRATION_PARTS = 2
#: Version of the scratch layout and of this engine (enters the scratch key).
ENGINE_VERSION = 3  # 3: tables written by the search tasks, cluster files; 2: probe radius


def scratch_root(scratch) -> Path:
    """The folder holding every large-scope artefact under a store's scratch folder ``scratch``
    (the caller's: :func:`cachescore.store.scratch_path`; this engine does not know the store)."""
    return Path(scratch) / "large"


def scratch_dir(unit, scratch) -> Path:
    """The scratch folder of a work unit's scopes under ``scratch`` (as :func:`scratch_root`):
    shared by every unit with the same inputs, design, confounder column, seed and code version
    (RI and MaRI reuse one table)."""
    key = fingerprint({"inputs": unit.inputs, "design": unit.design, "confounder": unit.confounder_column,
                       "code": unit.code_version, "seed": int(unit.params.get("seed", 0)),
                       "engine": ENGINE_VERSION})
    return scratch_root(scratch) / key


def remove_scratch(folders) -> None:
    """Delete the scratch ``folders`` of out-of-core units (:func:`scratch_dir`; call once none of
    them is running)."""
    for d in set(folders):
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------- small file helpers


def meta_name(chunk_file: str) -> str:
    """The metadata file of a chunk's vector file (``chunk-00000.npy`` -> ``chunk-00000.meta.npy``)."""
    return chunk_file[: -len(".npy")] + ".meta.npy"


def cluster_name(chunk_file: str) -> str:
    """The cluster-id file of a chunk (``chunk-00000.npy`` -> ``chunk-00000.cluster.npy``): the
    chunk's rows' clusters in scope order."""
    return chunk_file[: -len(".npy")] + ".cluster.npy"


def atomic_save_npz(path: Path, **arrays) -> None:
    atomic_write(path, lambda fh: np.savez(fh, **arrays))


def load_npz(path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def npy_header(path: str) -> tuple[int, tuple, np.dtype]:
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
        if fortran:
            raise ValueError(f"{path}: Fortran-ordered arrays are not supported")
        return fh.tell(), shape, dtype


def read_row_runs(path: str, runs, dim: int, dtype: np.dtype, offset: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``[a, b)`` for each ``(a, b)`` of ``runs`` of a C-ordered 2-D ``.npy``, concatenated
    (into ``out`` when given: shape ``(sum of run lengths, dim)``, ``dtype``).

    Plain reads (``readinto``), not a memory map: the pages read are not kept mapped, so a task's
    resident memory is its own arrays only.
    """
    total = sum(b - a for a, b in runs)
    if out is None:
        out = np.empty((total, dim), dtype=dtype)
    row_bytes = dim * dtype.itemsize
    at = 0
    with open(path, "rb", buffering=0) as fh:
        for a, b in runs:
            if b <= a:
                continue
            fh.seek(offset + a * row_bytes)
            view = memoryview(out[at : at + b - a]).cast("B")
            got = 0
            while got < view.nbytes:
                r = fh.readinto(view[got:])
                if not r:
                    raise OSError(f"{path}: truncated (wanted rows {a}:{b})")
                got += r
            at += b - a
    return out


def read_rows_at(path: str, positions, width: int, dtype) -> np.ndarray:
    """Rows ``positions`` (any order, repeats allowed) of the C-ordered ``.npy`` at ``path`` with
    ``width`` items of ``dtype`` a row, in the given order: plain reads of the distinct rows (runs
    of consecutive ones together), no memory map, so a driver reading a sample's rows of a table
    of millions holds only those rows (a map would keep every page it touched resident)."""
    positions = np.asarray(positions, dtype=np.int64)
    dtype = np.dtype(dtype)
    if positions.size == 0:
        return np.empty((0, width), dtype=dtype)
    rows, inverse = np.unique(positions, return_inverse=True)
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(rows, cuts)]
    got = read_row_runs(path, runs, width, dtype, npy_header(path)[0])
    return got[inverse]


def write_rows(path: str, offset: int, positions: np.ndarray, values: np.ndarray) -> None:
    """Write ``values[i]`` as row ``positions[i]`` of the C-ordered 2-D ``.npy`` at ``path`` (data
    at byte ``offset``, rows of ``values.shape[1]`` items of ``values.dtype``), in place.

    Positional writes (``pwrite``) of each run of consecutive rows, not a memory map: tasks on
    several hosts write disjoint rows of one table on a shared file system, and only the bytes
    of their own rows are written.
    """
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size == 0:
        return
    order = np.argsort(positions, kind="stable")
    pos = positions[order]
    data = np.ascontiguousarray(values[order])
    row_bytes = data.shape[1] * data.dtype.itemsize
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1
    starts = np.concatenate([[0], cuts])
    stops = np.concatenate([cuts, [pos.size]])
    raw = memoryview(data).cast("B")
    fd = os.open(path, os.O_WRONLY)
    try:
        for a, b in zip(starts.tolist(), stops.tolist()):
            chunk = raw[a * row_bytes : b * row_bytes]
            at = offset + int(pos[a]) * row_bytes
            while chunk.nbytes:
                done = os.pwrite(fd, chunk, at)
                chunk, at = chunk[done:], at + done
    finally:
        os.close(fd)


def create_table(path: Path, dtype, shape: tuple) -> int:
    """Create an ``.npy`` of ``shape`` and ``dtype`` whose data is not written (a sparse file, no
    memory touched); returns the byte offset of its data (for :func:`write_rows`)."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": tuple(int(x) for x in shape)}
    with open(path, "wb") as fh:
        np.lib.format.write_array_header_2_0(fh, header)
        offset = fh.tell()
        fh.truncate(offset + int(np.prod(shape)) * np.dtype(dtype).itemsize)
    return offset


# ----------------------------------------------------------------------------- scope description


@dataclass(frozen=True)
class ScopeRows:
    """Where a scope's rows live and their integer codes (everything the driver needs but the vectors).

    ``embeddings``: the encoder × tileset the rows are read from (a picklable
    :class:`~cachescore.cache.RowSource`); ``tile_rows`` (n,) int64: the tileset row of each scope
    position (view order within the scope);
    ``groups``, ``labels``, ``confounders`` (n,) int codes; ``source`` names the scope in errors;
    ``name`` is the metric's name of the scope (``manifest.Scope.subset``): the scope reference
    the metrics pass (``scope=``) to find these rows.
    Held by the driver only: tasks read what they need from the scope's ``rows.npy`` (see
    :class:`ScopeFiles`), so no task receives an O(n) argument.
    """

    embeddings: RowSource
    tile_rows: np.ndarray
    groups: np.ndarray
    labels: np.ndarray
    confounders: np.ndarray
    source: str
    name: str | None = None

    @property
    def n(self) -> int:
        return int(self.tile_rows.size)

    def write(self, folder: Path) -> "ScopeRef":
        """Write this scope's ``rows.npy`` into ``folder`` (atomically) and return its
        :class:`ScopeRef`: how the API's in-memory scope descriptions enter the engine."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        index = np.stack([self.tile_rows, self.groups, self.labels, self.confounders], axis=1).astype(np.int64)
        return write_scope(folder, index, None, embeddings=self.embeddings, source=self.source, name=self.name)


def write_scope(folder: Path, index: np.ndarray, sources: np.ndarray | None, *, embeddings: RowSource, source: str,
                name: str | None) -> "ScopeRef":
    """Write a scope's ``rows.npy`` (``index``: (n, 4) int64, :data:`INDEX_COLUMNS`) and, when
    given, ``sources.npy`` (the view row of each scope row) into ``folder``; returns its
    :class:`ScopeRef` (summary counts read off ``index``)."""
    folder = Path(folder)
    atomic_write(folder / "rows.npy", lambda fh: np.save(fh, np.ascontiguousarray(index, dtype=np.int64)))
    if sources is not None:
        atomic_write(folder / "sources.npy", lambda fh: np.save(fh, np.asarray(sources, dtype=np.int64)))
    n = int(index.shape[0])
    sizes = np.bincount(index[:, 1]) if n else np.zeros(0, np.int64)
    return ScopeRef(embeddings=embeddings, rows_path=str(folder / "rows.npy"), n=n,
                    max_group=int(sizes.max()) if n else 0, min_group=int(sizes[sizes > 0].min()) if n else 0,
                    n_labels=int(index[:, 2].max()) + 1 if n else 1,
                    n_conf=int(index[:, 3].max()) + 1 if n else 1, source=source, name=name,
                    sources_path=str(folder / "sources.npy") if sources is not None else None)


@dataclass(frozen=True)
class ScopeRef:
    """A scope whose rows are described on disk (O(1) in memory, picklable): ``rows.npy`` ((n, 4)
    int64, :data:`INDEX_COLUMNS`, scope order) and optionally ``sources.npy`` ((n,) int64, the
    view row of each scope row), with the counts the driver needs: ``n``, ``max_group`` /
    ``min_group`` (rows of the largest / smallest group), ``n_labels`` / ``n_conf`` (label and confounder codes are ``0 ..
    n - 1``). ``embeddings``, ``source`` and ``name`` as :class:`ScopeRows`."""

    embeddings: RowSource
    rows_path: str
    n: int
    max_group: int
    min_group: int
    n_labels: int
    n_conf: int
    source: str
    name: str | None = None
    sources_path: str | None = None

    def files(self) -> "ScopeFiles":
        return ScopeFiles(embeddings=self.embeddings, source=self.source, rows_path=self.rows_path)

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Column ``name`` of :data:`INDEX_COLUMNS` for scope rows ``start:stop`` (a copy)."""
        stop = self.n if stop is None else stop
        j = INDEX_COLUMNS.index(name)
        return np.ascontiguousarray(self.files().index(start, stop)[:, j])

    def codes_at(self, positions) -> np.ndarray:
        """(len(positions), 4) int64 rows of ``rows.npy`` at ``positions`` (a small sample)."""
        return read_rows_at(self.rows_path, positions, len(INDEX_COLUMNS), np.int64)

    def to_json(self) -> dict:
        return {"rows_path": self.rows_path, "n": self.n, "max_group": self.max_group, "min_group": self.min_group,
                "n_labels": self.n_labels,
                "n_conf": self.n_conf, "source": self.source, "name": self.name, "sources_path": self.sources_path}

    @classmethod
    def from_json(cls, doc: dict, embeddings: RowSource) -> "ScopeRef":
        return cls(embeddings=embeddings, **doc)


def read_refs(path: Path, embeddings: RowSource) -> dict:
    """``{key: ScopeRef}`` of a ``scopes.json`` written by :func:`write_refs`."""
    doc = json.loads(Path(path).read_text())
    return {key: ScopeRef.from_json(d, embeddings) for key, d in doc["scopes"].items()}


def write_refs(path: Path, refs: dict, **info) -> None:
    """Write ``{key: ScopeRef}`` (and ``info``) as ``scopes.json``, atomically."""
    atomic_write_json(Path(path), {"scopes": {k: r.to_json() for k, r in refs.items()}, **info})


#: Columns of a scope's ``rows.npy`` and of every chunk's ``.meta.npy`` (int64): the first is the
#: tileset row (``rows.npy``, scope order) or the scope position (chunk metadata, file order).
INDEX_COLUMNS = ("row", "group", "label", "confounder")


@dataclass(frozen=True)
class ScopeFiles:
    """What a partition task needs to read a scope's rows: the embeddings (a picklable
    :class:`~cachescore.cache.RowSource`) and the scope's ``rows.npy`` ((n, 4) int64,
    :data:`INDEX_COLUMNS`, written once by the driver)."""

    embeddings: RowSource
    source: str
    rows_path: str

    def tile_rows_at(self, positions) -> np.ndarray:
        """The tileset rows of the scope ``positions`` (a bounded sample), read off ``rows.npy``."""
        return read_rows_at(self.rows_path, positions, len(INDEX_COLUMNS), np.int64)[:, 0]

    def index(self, start: int, stop: int) -> np.ndarray:
        """``rows.npy[start:stop]``: (stop - start, 4) int64."""
        offset = npy_header(self.rows_path)[0]
        return read_row_runs(self.rows_path, [(start, stop)], len(INDEX_COLUMNS), np.dtype(np.int64), offset)



@dataclass(frozen=True)
class Layout:
    """The partition as tasks see it: per chunk, a vector file (rows sorted by cluster) and a
    metadata file ((r, 4) int64 in the same order: scope position, group, label, confounder), and
    the per-chunk cluster bounds. Size O(chunks × clusters), independent of the rows' count."""

    paths: tuple
    meta_paths: tuple
    header: tuple  # per chunk: byte offset of the vectors
    meta_header: tuple  # per chunk: byte offset of the metadata
    dim: int
    dtype: str
    bounds: np.ndarray  # (J, C+1) int64
    n_conf: int  # cell code of a row: label * n_conf + confounder

    @property
    def sizes(self) -> np.ndarray:
        """(C,) rows per cluster over all chunks."""
        return self.bounds[:, 1:].sum(axis=0) - self.bounds[:, :-1].sum(axis=0)

    def read_clusters(self, clusters) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows of ``clusters`` from every chunk: vectors (r, d), metadata (r, 4), cluster ids (r,)."""
        clusters = np.asarray(clusters, dtype=np.int64)
        plan, total = [], 0
        for j in range(len(self.paths)):
            b = self.bounds[j]
            present = clusters[b[clusters + 1] > b[clusters]]
            if present.size:
                runs = [(int(b[c]), int(b[c + 1])) for c in present]
                plan.append((j, runs, present))
                total += sum(e - a for a, e in runs)
        vecs = np.empty((total, self.dim), dtype=np.dtype(self.dtype))
        meta = np.empty((total, len(INDEX_COLUMNS)), dtype=np.int64)
        at = 0
        for j, runs, _ in plan:
            r = sum(e - a for a, e in runs)
            read_row_runs(self.paths[j], runs, self.dim, np.dtype(self.dtype), self.header[j], out=vecs[at : at + r])
            read_row_runs(self.meta_paths[j], runs, len(INDEX_COLUMNS), np.dtype(np.int64), self.meta_header[j],
                           out=meta[at : at + r])
            at += r
        cl = np.concatenate([np.zeros(0, np.int64)] + [np.repeat(present, [e - a for a, e in runs])
                                                       for _, runs, present in plan])
        return vecs, meta, cl

    def read_chunk(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every row of chunk ``j``: vectors, metadata, cluster ids (as :meth:`read_clusters`)."""
        b = self.bounds[j]
        n_rows = int(b[-1])
        vecs = read_row_runs(self.paths[j], [(0, n_rows)], self.dim, np.dtype(self.dtype), self.header[j])
        meta = read_row_runs(self.meta_paths[j], [(0, n_rows)], len(INDEX_COLUMNS), np.dtype(np.int64),
                              self.meta_header[j])
        return vecs, meta, np.repeat(np.arange(b.size - 1, dtype=np.int64), np.diff(b))


