"""Scratch layout of the out-of-core engine: constants, scratch folders, the chunk files' format
and their readers (:class:`Layout`), the scope's row table (:class:`ScopeRows`, ``rows.npy``)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...cache import RowSource
from ...fingerprint import fingerprint
from ..._atomic import atomic_write

#: Embedding bytes per partition chunk (DESIGN §2: row chunks of ~64–256 MiB).
CHUNK_BYTES = 128 * 2**20
#: Target rows per k-means cluster (``C = ceil(n / ROWS_PER_CLUSTER)``).
ROWS_PER_CLUSTER = 2048
#: Rows of the sample the centroids are trained on: ``48 · C`` clamped to
#: ``[KMEANS_MIN_SAMPLE, KMEANS_MAX_SAMPLE]`` (and to ``n``); the cap keeps the read bounded.
KMEANS_MIN_SAMPLE = 20000
KMEANS_MAX_SAMPLE = 65536
#: Query rows per search task (a batch of whole clusters; at least one cluster).
BATCH_ROWS = 16384
#: Target rows held at once by a search task.
PIECE_ROWS = 65536
#: Calibration queries (their exact answers pick the probe radius).
CALIBRATION_QUERIES = 2000
#: Version of the scratch layout and of this engine (enters the scratch key).
ENGINE_VERSION = 2  # 2: probe radius (was: probe fraction)


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


