"""Build a cache from the arrays real caches hold.

Two input layouts (``layout=``):

``"per_encoder"``
    one ``.npy`` (or ``.h5``) per encoder, of shape ``(n_tiles, dim)``, row ``i`` = manifest row ``i``.
``"per_slide"``
    one ``.npy`` (or ``.h5``) per slide and encoder, rows = that slide's tiles. The manifest's
    ``slide_column`` names each tile's slide; ``tile_index_column`` (optional) gives the tile's row in
    its slide file, otherwise the slide's manifest rows are the file's rows in order and their
    count must equal the file's. Each encoder's files are given as a folder (``<slide>.npy`` /
    ``<slide>.h5`` inside), a pattern containing ``{slide}``, or a mapping slide -> path.

The manifest (DataFrame, ``.csv`` or ``.parquet``) becomes ``tiles.parquet`` (it needs
``sample_id`` unique and ``image_path``). Everything is checked (shape, dtype, alignment, files) before
anything is written; embeddings are streamed shard by shard, so memory is bounded by a copy step.
``.h5`` needs the optional ``h5py`` (``pip install cachescore[h5]``), imported only when used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd

from ..manifest import coerce_manifest
from .errors import AlignmentError, CacheError, CacheNotFoundError, LayoutError
from .layout import FLOAT_DTYPES, check_name
from .reader import Cache
from .writer import (
    _rows,
    normalize_ids,
    write_embeddings_blocks,
    write_tileset,
    write_view,
)

__all__ = ["import_cache", "LAYOUTS"]

#: Accepted values of ``layout``.
LAYOUTS = ("per_encoder", "per_slide")
#: File names tried, in order, for a slide in a per-slide folder.
_SLIDE_SUFFIXES = (".npy", ".h5", ".hdf5")


def _h5py():
    try:
        import h5py  # noqa: PLC0415 - optional extra, imported lazily
    except ImportError:
        raise ImportError("reading .h5 files needs the optional dependency h5py: pip install 'cachescore[h5]' "
                          "(or pip install h5py)") from None
    return h5py


class _Source:
    """One 2-D array on disk (``.npy`` via memmap or an ``.h5`` dataset); header read on construction.

    ``dtype`` is the native-byte-order form of the stored dtype; ``take``/``slice`` return arrays
    in it (a big-endian ``>f4`` file is read as ``float32``, never stored byte-swapped).
    """

    def __init__(self, path: Path, *, h5_dataset: str, what: str):
        self.path, self.h5_dataset, self.what = Path(path), h5_dataset, what
        if not self.path.is_file():
            raise CacheNotFoundError(f"{what}: file not found: {self.path}")
        suffix = self.path.suffix.lower()
        if suffix == ".npy":
            self.kind = "npy"
            arr = self._npy()
            shape, dtype = arr.shape, arr.dtype
        elif suffix in (".h5", ".hdf5"):
            self.kind = "h5"
            with self._h5() as fh:
                dset = self._dataset(fh)
                shape, dtype = dset.shape, dset.dtype
        else:
            raise LayoutError(f"{what}: {self.path} has unsupported suffix {suffix!r}; use .npy or .h5")
        where = f"{self.path}" + (f" dataset {h5_dataset!r}" if self.kind == "h5" else "")
        if shape is None or len(shape) != 2:
            raise LayoutError(f"{what}: {where} must hold a 2-D array (tiles, dim), got shape "
                              f"{None if shape is None else tuple(shape)}")
        if np.dtype(dtype).name not in FLOAT_DTYPES:
            raise LayoutError(f"{what}: {where} has dtype {dtype}; expected one of {list(FLOAT_DTYPES)} "
                              "(cast it explicitly)")
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(dtype).newbyteorder("=")

    def _npy(self):
        try:
            return np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise LayoutError(f"{self.what}: {self.path} is not a readable .npy file: {exc}") from exc

    def _h5(self):
        try:
            return _h5py().File(self.path, "r")
        except OSError as exc:
            raise LayoutError(f"{self.what}: {self.path} is not a readable HDF5 file: {exc}") from exc

    def _dataset(self, fh):
        h5py = _h5py()
        if self.h5_dataset not in fh:
            names = []
            fh.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
            raise LayoutError(f"{self.what}: {self.path} has no dataset {self.h5_dataset!r} (datasets: "
                              f"{sorted(names)[:10]}); pass h5_dataset=... (CLI: --h5-dataset)")
        dset = fh[self.h5_dataset]
        if not isinstance(dset, h5py.Dataset):
            raise LayoutError(f"{self.what}: {self.path}: {self.h5_dataset!r} is a {type(dset).__name__}, not a dataset")
        return dset

    def _native(self, block) -> np.ndarray:
        return np.asarray(block).astype(self.dtype, copy=False)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (int64, any order, repeats allowed) as an in-memory array of ``dtype``."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.kind == "npy":
            return self._native(self._npy()[rows])
        if rows.size == 0:
            return np.empty((0, self.shape[1]), dtype=self.dtype)
        uniq, inverse = np.unique(rows, return_inverse=True)
        with self._h5() as fh:
            dset = self._dataset(fh)
            lo, hi = int(uniq[0]), int(uniq[-1]) + 1
            if hi - lo <= 4 * uniq.size + 1024:  # dense: one hyperslab read beats a point selection
                data = np.asarray(dset[lo:hi])[uniq - lo]
            else:
                data = np.asarray(dset[uniq])  # h5py needs increasing indices
        return self._native(data[inverse])

    def slice(self, lo: int, hi: int) -> np.ndarray:
        if self.kind == "npy":
            return self._native(self._npy()[lo:hi])
        with self._h5() as fh:
            return self._native(self._dataset(fh)[lo:hi])


def _slide_paths(spec, slides: list[str], *, encoder: str) -> dict[str, Path]:
    if isinstance(spec, Mapping):
        missing = [s for s in slides if s not in spec]
        if missing:
            raise CacheNotFoundError(f"encoder {encoder!r}: no file given for slides {missing[:5]}"
                                     f"{' (and more)' if len(missing) > 5 else ''}")
        return {s: Path(spec[s]) for s in slides}
    text = os.fspath(spec)
    if "{slide}" in text:
        return {s: Path(text.format(slide=s)) for s in slides}
    folder = Path(text)
    if not folder.is_dir():
        raise CacheNotFoundError(f"encoder {encoder!r}: slide folder not found: {folder}")
    out, missing = {}, []
    for s in slides:
        for suffix in _SLIDE_SUFFIXES:
            if (folder / f"{s}{suffix}").is_file():
                out[s] = folder / f"{s}{suffix}"
                break
        else:
            missing.append(s)
    if missing:
        raise CacheNotFoundError(f"encoder {encoder!r}, slide {missing[0]!r}: file not found: none of "
                                 f"{[f'{missing[0]}{x}' for x in _SLIDE_SUFFIXES]} in {folder}; "
                                 f"{len(missing)} manifest slide(s) have no file: {missing[:5]}"
                                 f"{' (and more)' if len(missing) > 5 else ''}")
    return out


def import_cache(
    root,
    *,
    tileset: str,
    manifest,
    encoders: Mapping[str, object],
    layout: str = "per_encoder",
    slide_column: str = "group_id",
    tile_index_column: str | None = None,
    h5_dataset: str = "features",
    views: Mapping[str, Mapping] | None = None,
    shard_rows: int | None = None,
    overwrite: bool = False,
    validate: bool = True,
) -> Cache:
    """Import arrays + a tile manifest into the cache at ``root``; return the :class:`Cache`.

    Parameters
    ----------
    tileset : name of the tileset to create (one row per manifest row).
    manifest : DataFrame or path (``.csv``/``.parquet``) with ``sample_id`` (unique), ``image_path``
        and any metadata; under ``per_slide`` also ``slide_column`` (and ``tile_index_column``).
    encoders : encoder name -> ``.npy``/``.h5`` path (``per_encoder``) or folder / ``{slide}``
        pattern / mapping slide -> path (``per_slide``).
    views : optional ``{view: {"confounder_column": str, "design": str | None}}``; each view is the
        manifest's rows in order (use :func:`write_view` for views that select or repeat rows).
    validate : re-read every written array with :meth:`Cache.validate_embeddings`.

    Raises ``ValueError`` (bad layout/names), :class:`CacheNotFoundError` (a file missing),
    :class:`LayoutError` (not 2-D, non-float dtype, unreadable, dims/dtypes differ across slides),
    :class:`AlignmentError` (row counts/tile indices do not match the manifest),
    :class:`NonFiniteError` (NaN/inf rows, by manifest row), ``FileExistsError`` (exists, no ``overwrite``).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    check_name("tileset", tileset)
    if not isinstance(encoders, Mapping) or not encoders:
        raise ValueError("encoders must be a non-empty mapping encoder name -> file(s)")
    for name in encoders:
        check_name("encoder", name)
    frame = coerce_manifest(manifest).reset_index(drop=True)
    source = f"manifest {manifest}" if not isinstance(manifest, pd.DataFrame) else "manifest"
    missing = [c for c in ("sample_id", "image_path") if c not in frame.columns]
    if missing:
        raise CacheError(f"{source}: missing required columns {missing}")
    n = len(frame)

    plans: dict[str, tuple] = {}
    if layout == "per_encoder":
        for name, path in encoders.items():
            src = _Source(Path(path), h5_dataset=h5_dataset, what=f"encoder {name!r}")
            if src.shape[0] != n:
                raise AlignmentError(f"encoder {name!r}: {src.path} has {src.shape[0]} rows but the {source} has {n}; "
                                     "row i must be the embedding of manifest row i")
            plans[name] = (src.shape[1], src.dtype, src.slice)
    else:
        if slide_column not in frame.columns:
            raise CacheError(f"{source}: missing slide column {slide_column!r} (set slide_column=...)")
        slide_of = normalize_ids(frame[slide_column], source=source, column=slide_column)
        codes, slides = pd.factorize(pd.Series(slide_of))
        slides = [str(s) for s in slides]
        if tile_index_column is None:
            tile_index = pd.Series(codes).groupby(codes).cumcount().to_numpy(dtype=np.int64)
        else:
            if tile_index_column not in frame.columns:
                raise CacheError(f"{source}: missing tile index column {tile_index_column!r}")
            raw = pd.to_numeric(frame[tile_index_column], errors="coerce")
            bad = np.flatnonzero(raw.isna().to_numpy() | (raw.to_numpy() < 0) | (raw.to_numpy() % 1 != 0))
            if bad.size:
                raise CacheError(f"{source}: column {tile_index_column!r} must hold non-negative integers; bad rows {_rows(bad)}")
            tile_index = raw.to_numpy().astype(np.int64)
        counts = np.bincount(codes, minlength=len(slides))
        for name, spec in encoders.items():
            paths = _slide_paths(spec, slides, encoder=name)
            sources = [_Source(paths[s], h5_dataset=h5_dataset, what=f"encoder {name!r}, slide {s!r}") for s in slides]
            dims = {src.shape[1] for src in sources}
            dtypes = {src.dtype for src in sources}
            if len(dims) != 1 or len(dtypes) != 1:
                first = sources[0]
                odd = next(i for i, src in enumerate(sources) if (src.shape[1], src.dtype) != (first.shape[1], first.dtype))
                raise LayoutError(f"encoder {name!r}: slide files disagree on dim {sorted(dims)} or dtype "
                                  f"{sorted(str(d) for d in dtypes)}; every slide of one encoder needs the same "
                                  f"(slide {slides[0]!r}: {first.path} has dim {first.shape[1]}, {first.dtype}; "
                                  f"slide {slides[odd]!r}: {sources[odd].path} has dim {sources[odd].shape[1]}, "
                                  f"{sources[odd].dtype})")
            file_rows = np.asarray([src.shape[0] for src in sources], dtype=np.int64)
            if tile_index_column is None:
                off = np.flatnonzero(file_rows != counts)
                if off.size:
                    s = off[0]
                    raise AlignmentError(f"encoder {name!r}: slide {slides[s]!r} file {sources[s].path} has "
                                         f"{file_rows[s]} rows but the {source} lists {counts[s]} tiles for it "
                                         f"(give tile_index_column= if the manifest holds a subset of tiles)")
            else:
                over = np.flatnonzero(tile_index >= file_rows[codes])
                if over.size:
                    r = over[0]
                    raise AlignmentError(f"{source}: rows {_rows(over)} have {tile_index_column} beyond their slide "
                                         f"file (row {r}: index {tile_index[r]}, {sources[codes[r]].path} has "
                                         f"{file_rows[codes[r]]} rows)")
            plans[name] = (dims.pop(), dtypes.pop(), _slide_reader(sources, codes, tile_index))

    write_tileset(root, tileset, frame, overwrite=overwrite)
    for name, (dim, dtype, read_block) in plans.items():
        write_embeddings_blocks(root, name, tileset, n_rows=n, dim=dim, dtype=dtype, read_block=read_block,
                                shard_rows=shard_rows, overwrite=overwrite,
                                source=f"encoder {name!r} (rows are {source} rows)")
    for view, options in (views or {}).items():
        options = dict(options)
        write_view(root, view, frame, tileset=tileset, confounder_column=options.pop("confounder_column"),
                   design=options.pop("design", None), overwrite=overwrite)
        if options:
            raise ValueError(f"view {view!r}: unknown options {sorted(options)}")
    cache = Cache(root)
    if validate:
        for name in plans:
            cache.validate_embeddings(name, tileset)
    return cache


def _slide_reader(sources: list[_Source], codes: np.ndarray, tile_index: np.ndarray):
    """``read_block(lo, hi)`` over manifest rows, gathering from each touched slide file once."""

    def read_block(lo: int, hi: int) -> np.ndarray:
        c, t = codes[lo:hi], tile_index[lo:hi]
        first = sources[int(c[0])] if hi > lo else sources[0]
        out = np.empty((hi - lo, first.shape[1]), dtype=first.dtype)
        for s in np.unique(c):
            sel = np.flatnonzero(c == s)
            out[sel] = sources[int(s)].take(t[sel])
        return out

    return read_block
