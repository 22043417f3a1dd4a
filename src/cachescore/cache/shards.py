"""Embedding shards: open one ``.npy`` shard and check it against ``meta.json``; task bodies
that read rows from shards (docs/cache-layout.md). Every error names the shard file.

A local shard is memory-mapped. A shard in object storage (a URL, :mod:`.location`) is a
:class:`RemoteShard`: its ``.npy`` header is read once, then rows are fetched by ranged requests
(``fs.cat_ranges``: nearby rows in one request, several requests in flight), never the whole file.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np

from .._hashing import sha256_file
from .errors import ShardError, ShardNotFoundError
from .location import access_error, is_remote, read_errors

__all__ = ["open_shard", "read_shard_rows", "gather_rows", "shard_digest", "shard_contents", "RemoteShard", "ZarrShard", "LinkedShard",
           "link_reference", "quick_hash", "zarr_digest"]

#: Bytes of a remote shard read first: the ``.npy`` header (64-byte aligned, usually 128 bytes).
HEADER_PROBE = 4096
#: Bytes between two wanted rows of a remote shard below which one request fetches both (and the
#: rows between): about what an object store transfers in one request's latency, so fewer round
#: trips cost no more time than the extra bytes.
GAP_BYTES = 1 << 20
#: Most bytes a remote request fetches; longer runs are split.
MAX_REQUEST_BYTES = 16 << 20


def shard_reads(label: str, where: str, *, missing: str = "shard file missing: {where}", broken=(OSError,)):
    """Read errors of the shard at ``where`` (:func:`.location.read_errors`), each naming it: a
    missing file or object :class:`ShardNotFoundError` (``missing``), a refused request
    :class:`~.errors.CacheAccessError`, any other of ``broken`` :class:`ShardError`."""
    return read_errors(f"{label}: shard {where}", catch=broken,
                       missing=lambda: ShardNotFoundError(f"{label}: {missing.format(where=where)}"),
                       broken=lambda exc: ShardError(f"{label}: shard {where} cannot be read: {exc}"))


class RemoteShard:
    """A ``.npy`` shard in an fsspec file system, read by ranged requests. ``shape``, ``dtype``
    and ``ndim`` as the memmap's; ``shard[lo:hi]`` and ``shard[rows]`` (sorted int64 positions)
    return owned arrays; ``np.asarray(shard)`` reads every row.

    Raises :class:`ShardNotFoundError` for a missing object, :class:`ShardError` for a header
    that is not a C-ordered ``.npy`` array or an object shorter than its header says, and
    :class:`~.errors.CacheAccessError` when the store refuses the request."""

    def __init__(self, url: str, label: str):
        import fsspec  # deferred: only remote caches need it

        self.url, self.label = url, label
        self.fs, self.path = fsspec.core.url_to_fs(url)
        with shard_reads(label, url):
            size = int(self.fs.size(self.path))
            head = self.fs.cat_file(self.path, start=0, end=min(size, HEADER_PROBE))
        self.offset, self.shape, self.dtype = _npy_header(head, url, label)
        self.ndim = len(self.shape)
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        want = self.offset + self.shape[0] * self.row_bytes
        if size < want:
            raise ShardError(f"{label}: shard {url} is corrupt or truncated: {size} bytes, its header needs {want}")

    def _fetch(self, starts: np.ndarray, stops: np.ndarray) -> list[bytes]:
        paths = [self.path] * len(starts)
        first = (self.offset + starts * self.row_bytes).tolist()
        last = (self.offset + stops * self.row_bytes).tolist()
        with shard_reads(self.label, self.url):
            return self.fs.cat_ranges(paths, first, last, on_error="raise")

    def _rows(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty((max(hi - lo, 0),) + self.shape[1:], dtype=self.dtype)
        if hi <= lo:
            return out
        step = max(1, MAX_REQUEST_BYTES // max(self.row_bytes, 1))
        starts = np.arange(lo, hi, step, dtype=np.int64)
        stops = np.minimum(starts + step, hi)
        flat = out.reshape(out.shape[0], -1).view(np.uint8).reshape(-1)
        at = 0
        for blob in self._fetch(starts, stops):
            flat[at : at + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
            at += len(blob)
        if at != flat.size:
            raise ShardError(f"{self.label}: shard {self.url} returned {at} bytes for rows {lo}:{hi}, expected {flat.size}")
        return out

    def _take(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((rows.size,) + self.shape[1:], dtype=self.dtype)
        if rows.size == 0:
            return out
        if np.any(rows[1:] < rows[:-1]) or rows[0] < 0 or rows[-1] >= self.shape[0]:
            raise IndexError(f"{self.label}: shard {self.url}: rows must be sorted positions in [0, {self.shape[0]})")
        gap = max(1, GAP_BYTES // max(self.row_bytes, 1))
        cut = np.flatnonzero(np.diff(rows) > gap) + 1  # runs of nearby rows: one request each
        starts = rows[np.concatenate([[0], cut])]
        stops = rows[np.concatenate([cut - 1, [rows.size - 1]])] + 1
        step = max(1, MAX_REQUEST_BYTES // max(self.row_bytes, 1))
        long = stops - starts > step
        if long.any():  # split runs longer than one request
            parts = [np.arange(a, b, step, dtype=np.int64) for a, b in zip(starts, stops)]
            starts = np.concatenate(parts)
            stops = np.minimum(starts + step, np.concatenate([np.full(p.size, b) for p, b in zip(parts, stops)]))
        blobs = self._fetch(starts, stops)
        for a, b, blob in zip(starts, stops, blobs):
            if len(blob) != (b - a) * self.row_bytes:
                raise ShardError(f"{self.label}: shard {self.url} returned {len(blob)} bytes for rows {a}:{b}")
            block = np.frombuffer(blob, dtype=self.dtype).reshape((b - a,) + self.shape[1:])
            lo, hi = np.searchsorted(rows, [a, b])
            out[lo:hi] = block[rows[lo:hi] - a]
        return out

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, stride = key.indices(self.shape[0])
            if stride != 1:
                raise IndexError(f"{self.label}: shard {self.url}: only contiguous slices are read")
            return self._rows(lo, hi)
        return self._take(key)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def read_with_digest(self) -> tuple[np.ndarray, str]:
        """Every row and the sha256 of the whole object (header included), from one read: what
        a validation needs (checksum and finiteness) without fetching the object twice."""
        h, blob = hashlib.sha256(), bytearray()
        with shard_reads(self.label, self.url), self.fs.open(self.path, "rb", block_size=1 << 22) as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
                blob += chunk
        if len(blob) < self.offset + self.size * self.dtype.itemsize:
            raise ShardError(f"{self.label}: shard {self.url} is corrupt or truncated: {len(blob)} bytes")
        rows = np.frombuffer(blob, dtype=self.dtype, count=self.size, offset=self.offset)
        return rows.reshape(self.shape), h.hexdigest()

    def __array__(self, dtype=None, copy=None):
        out = self._rows(0, self.shape[0])
        return out if dtype is None else out.astype(dtype, copy=False)


def _npy_header(head: bytes, url: str, label: str) -> tuple[int, tuple, np.dtype]:
    """``(data offset, shape, dtype)`` of a ``.npy`` file from its first bytes."""
    fh = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(fh)
        reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if reader is None:
            raise ValueError(f"unsupported .npy version {version}")
        shape, fortran, dtype = reader(fh)
    except (ValueError, EOFError) as exc:
        raise ShardError(f"{label}: shard {url} is corrupt or truncated: {exc}") from None
    if fortran or dtype.hasobject:
        raise ShardError(f"{label}: shard {url} is not a C-ordered numeric array")
    return fh.tell(), tuple(int(d) for d in shape), dtype


class _RowsBase:
    """Shared row access of the non-memmap shards: ``shard[lo:hi]``, ``shard[rows]`` (sorted
    positions, repeats allowed), ``np.asarray(shard)``, ``size``; subclasses give ``_slice`` and
    ``_unique`` (increasing unique positions)."""

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, stride = key.indices(self.shape[0])
            if stride != 1:
                raise IndexError(f"{self.label}: shard {self.where}: only contiguous slices are read")
            return self._slice(lo, max(lo, hi))
        rows = np.asarray(key, dtype=np.int64)
        if rows.size == 0:
            return np.empty((0,) + tuple(self.shape[1:]), dtype=self.dtype)
        uniq, inverse = np.unique(rows, return_inverse=True)
        if uniq[0] < 0 or uniq[-1] >= self.shape[0]:
            raise IndexError(f"{self.label}: shard {self.where}: rows out of range [0, {self.shape[0]})")
        lo, hi = int(uniq[0]), int(uniq[-1]) + 1
        if hi - lo <= 4 * uniq.size + 1024:  # dense: one contiguous read beats a point selection
            return self._slice(lo, hi)[uniq - lo][inverse]
        return self._unique(uniq)[inverse]

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def __array__(self, dtype=None, copy=None):
        out = self._slice(0, self.shape[0])
        return out if dtype is None else out.astype(dtype, copy=False)


class ZarrShard(_RowsBase):
    """A shard stored as a Zarr v3 array of whole-row chunks (``shard-NNNNN.zarr``, local or at a
    URL): reads decode only the chunks holding the wanted rows."""

    def __init__(self, path: str, label: str):
        import zarr  # deferred: only Zarr shards need it

        self.where, self.label = str(path), label
        try:
            self.array = zarr.open_array(str(path), mode="r")
        except FileNotFoundError:
            raise ShardNotFoundError(f"{label}: shard file missing: {path}") from None
        except PermissionError as exc:
            raise access_error(f"{label}: shard {path}", exc) from None
        except Exception as exc:  # zarr's own errors for a store that is not an array
            if "not found" in str(exc).lower() or type(exc).__name__.endswith("NotFoundError"):
                raise ShardNotFoundError(f"{label}: shard file missing: {path}") from None
            raise ShardError(f"{label}: shard {path} is not a readable Zarr array: {exc}") from exc
        self.shape, self.dtype, self.ndim = tuple(self.array.shape), np.dtype(self.array.dtype), self.array.ndim

    def _read(self, selection) -> np.ndarray:
        with shard_reads(self.label, self.where, missing="a chunk of shard {where} is missing",
                         broken=(ValueError, RuntimeError, OSError)):
            return np.asarray(selection())

    def _slice(self, lo: int, hi: int) -> np.ndarray:
        return self._read(lambda: self.array[lo:hi])

    def _unique(self, rows: np.ndarray) -> np.ndarray:
        return self._read(lambda: self.array.get_orthogonal_selection((rows, slice(None))))


#: Separator of a linked shard's reference (``<file>::<dataset>::<size>::<mtime_ns>``).
LINK_SEP = "::"


def link_reference(path: str, dataset: str | None, size: int, mtime_ns: int) -> str:
    """The string a linked shard is read through: its file, its dataset (None for ``.npy``) and
    the size and mtime recorded when it was linked (checked on every open)."""
    return LINK_SEP.join([str(path), dataset or "", str(int(size)), str(int(mtime_ns))])


class LinkedShard(_RowsBase):
    """A slide feature file read in place (``cachescore import --link``): an ``.h5`` dataset
    (TRIDENT / CLAM) or a ``.npy`` array. Opening compares the file's size and mtime with the
    ones recorded at import and raises :class:`ShardError` when they differ ("changed since it
    was linked"), :class:`ShardNotFoundError` when the file is gone: a changed slide is never
    read silently."""

    def __init__(self, reference: str, label: str):
        path, dataset, size, mtime_ns = reference.rsplit(LINK_SEP, 3)
        self.where, self.label, self.path, self.dataset = path, label, path, dataset or None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ShardNotFoundError(f"{label}: linked slide file missing: {path} (re-import with --link once it "
                                     "is back, or import the slide's features again)") from None
        if st.st_size != int(size) or st.st_mtime_ns != int(mtime_ns):
            raise ShardError(f"{label}: linked slide file {path} changed since it was linked (size {size} -> "
                             f"{st.st_size} bytes, mtime {int(mtime_ns)} -> {st.st_mtime_ns} ns); it is not read: "
                             "re-import it with --link (or --overwrite) to score its new content")
        with shard_reads(label, path, broken=(OSError, ValueError, KeyError, EOFError)):
            if self.dataset is None:
                self._mm = np.load(path, mmap_mode="r", allow_pickle=False)
                self.shape, dtype = tuple(self._mm.shape), self._mm.dtype
            else:
                import h5py  # deferred: only linked .h5 slides need it

                self._fh = h5py.File(path, "r")
                self._ds = self._fh[self.dataset]
                self.shape, dtype = tuple(self._ds.shape), self._ds.dtype
        self.dtype = np.dtype(dtype).newbyteorder("=")
        self.ndim = len(self.shape)

    def _slice(self, lo: int, hi: int) -> np.ndarray:
        src = self._mm if self.dataset is None else self._ds
        return np.asarray(src[lo:hi]).astype(self.dtype, copy=False)

    def _unique(self, rows: np.ndarray) -> np.ndarray:
        src = self._mm if self.dataset is None else self._ds
        return np.asarray(src[rows]).astype(self.dtype, copy=False)  # h5py: increasing positions


#: Bytes of a linked file's head and tail that its quick content hash covers.
QUICK_HASH_BYTES = 64 << 10


def quick_hash(path: str) -> str:
    """sha256 of a linked slide file's size, first and last :data:`QUICK_HASH_BYTES` bytes (an
    HDF5 file's superblock, object headers and, for small slides, all of it): what a linked
    import records instead of reading every byte (its cost must stay a few % of a copy import).
    Together with the size and mtime checked on every open, it catches a replaced or rewritten
    file; a same-size in-place edit that also restores the mtime is not caught (ADR-0021)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(b"cachescore.quick-hash/1\0" + int(size).to_bytes(8, "little"))
    with open(path, "rb") as fh:
        h.update(fh.read(QUICK_HASH_BYTES))
        if size > QUICK_HASH_BYTES:
            fh.seek(max(QUICK_HASH_BYTES, size - QUICK_HASH_BYTES))
            h.update(fh.read(QUICK_HASH_BYTES))
    return h.hexdigest()


def zarr_digest(path) -> str:
    """sha256 over every file of a Zarr store (relative names in sorted order, each name, its
    length and its bytes): as strong as a ``.npy`` shard's whole-file checksum. ``path`` is a
    local path or a URL."""
    if is_remote(path):
        import fsspec  # deferred: only remote caches need it

        fs, base = fsspec.core.url_to_fs(str(path))
        names = sorted(n[len(base.rstrip("/")) + 1:] for n in fs.find(base))

        def read(name):
            return fs.cat_file(f"{base.rstrip('/')}/{name}")
    else:
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(str(root))
        names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())

        def read(name):
            return (root / name).read_bytes()
    h = hashlib.sha256(b"cachescore.zarr-digest/1\0")
    for name in names:
        data = read(name)
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def shard_digest(path: str) -> str:
    """The checksum ``meta.json`` records for a shard: sha256 of a ``.npy`` file, the store
    digest of a ``.zarr`` shard (:func:`zarr_digest`), the quick hash of a linked file
    (:func:`quick_hash`). Raises ``OSError`` as reading does."""
    text = str(path)
    if LINK_SEP in text:
        return quick_hash(text.rsplit(LINK_SEP, 3)[0])
    if text.rstrip("/").endswith(".zarr"):
        return zarr_digest(path)
    return sha256_file(path)


def shard_contents(shard, path: str, *, checksums: bool, finite: bool):
    """``(rows, digest)`` of an opened shard for a validation: ``rows`` to scan for non-finite
    values (the shard itself, or its rows already read), ``digest`` its checksum
    (:func:`shard_digest`) when ``checksums``, else None. A remote ``.npy`` object is read once
    for both checks (:meth:`RemoteShard.read_with_digest`)."""
    if isinstance(shard, RemoteShard) and (checksums or finite):
        rows, digest = shard.read_with_digest()
        return rows, digest if checksums else None
    return shard, shard_digest(path) if checksums else None


def open_shard(path: str, n_rows: int, dim: int, dtype: np.dtype, label: str):
    """Open one shard and check its header against ``meta.json``; errors name the shard. A
    ``.npy`` file is memory-mapped (a :class:`RemoteShard` at a URL), a ``.zarr`` store is a
    :class:`ZarrShard`, a linked slide reference a :class:`LinkedShard`."""
    text = str(path)
    if LINK_SEP in text or text.rstrip("/").endswith(".zarr"):
        mm = LinkedShard(text, label) if LINK_SEP in text else ZarrShard(text, label)
        _check_header(mm, mm.where, n_rows, dim, dtype, label)
        return mm
    if is_remote(path):
        mm = RemoteShard(str(path), label)
        _check_header(mm, path, n_rows, dim, dtype, label)
        return mm
    try:
        mm = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise ShardNotFoundError(f"{label}: shard file missing: {path}") from None
    except (ValueError, OSError, EOFError) as exc:
        raise ShardError(f"{label}: shard {path} is corrupt or truncated: {exc}") from exc
    _check_header(mm, path, n_rows, dim, dtype, label)
    return mm


def _check_header(mm, path, n_rows: int, dim: int, dtype: np.dtype, label: str) -> None:
    if mm.dtype != dtype:
        raise ShardError(f"{label}: shard {path} has dtype {mm.dtype}, meta.json says {dtype}")
    if mm.shape != (n_rows, dim):
        raise ShardError(f"{label}: shard {path} has shape {mm.shape}, meta.json says {(n_rows, dim)}")


def read_shard_rows(path: str, shard_rows: int, dim: int, dtype: str, start: int, stop: int, label: str) -> np.ndarray:
    """Task body: rows ``start:stop`` (shard-local) of one shard, as an owned in-memory array."""
    mm = open_shard(path, shard_rows, dim, np.dtype(dtype), label)
    rows = mm[start:stop]
    return np.array(rows, copy=True) if isinstance(mm, np.ndarray) else rows  # other shards' reads are owned


def gather_rows(paths: tuple[str, ...], offsets: np.ndarray, dim: int, dtype: str, rows: np.ndarray, label: str) -> np.ndarray:
    """Task body: the tileset rows ``rows`` (any order, repeats allowed) gathered from the shards.

    ``offsets`` has ``len(paths) + 1`` entries; shard ``s`` holds rows ``offsets[s]:offsets[s+1]``.
    Each touched shard is opened once and read with one fancy index (sorted positions: ranged
    requests of nearby rows for a remote shard).
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
