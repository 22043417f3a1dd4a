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

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..manifest import coerce_manifest
from .._atomic import atomic_replace_dir
from .errors import AlignmentError, CacheError, CacheNotFoundError, LayoutError
from . import text
from .formats import StorageOptions
from .layout import FLOAT_DTYPES, check_name, embeddings_dir, tiles_path, view_sidecar_path, writable_root
from .reader import Cache
from .writer import (
    VIEW_REQUIRED,
    _rows,
    blank_rows,
    normalize_ids,
    normalized_text,
    parquet_table,
    sample_ids_digest,
    stage_embeddings_blocks,
    store_tileset_frame,
    tileset_frame,
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
            kind = _not_regular(self.path)
            if kind:
                raise LayoutError(f"{what}: {self.path} is {kind}, not a regular file; give the feature file itself")
            raise CacheNotFoundError(f"{what}: file not found: {self.path}")
        suffix = self.path.suffix.lower()
        if suffix == ".npy":
            self.kind = "npy"
            arr = self._npy()
            shape, dtype = arr.shape, arr.dtype
        elif suffix in (".h5", ".hdf5"):
            self.kind = "h5"
            with self._h5() as fh:  # one open: the header and the (small) coords a slide table needs
                dset = self._dataset(fh)
                shape, dtype = dset.shape, dset.dtype
                self._coords = np.asarray(fh["coords"]) if "coords" in fh else None
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

    def coords(self) -> np.ndarray | None:
        """The ``coords`` dataset of an ``.h5`` slide file (TRIDENT / CLAM: ``(n_tiles, 2)`` level-0
        x, y), as int64 when integral; None for ``.npy`` files or h5 files without one."""
        if self.kind != "h5" or self._coords is None:
            return None
        raw = self._coords
        if raw.ndim != 2 or raw.shape[1] != 2 or raw.shape[0] != self.shape[0]:
            raise LayoutError(f"{self.what}: {self.path} dataset 'coords' has shape {raw.shape}; expected "
                              f"({self.shape[0]}, 2), one (x, y) per row of {self.h5_dataset!r}")
        if np.issubdtype(raw.dtype, np.floating) and np.all(np.isfinite(raw)) and np.all(raw == np.round(raw)):
            raw = raw.astype(np.int64)
        return raw.astype(np.int64) if np.issubdtype(raw.dtype, np.integer) else raw

    def slice(self, lo: int, hi: int) -> np.ndarray:
        if self.kind == "npy":
            return self._native(self._npy()[lo:hi])
        with self._h5() as fh:
            return self._native(self._dataset(fh)[lo:hi])


def _not_regular(path: Path) -> str | None:
    """What ``path`` is when it exists but is not a regular file (``"a device"``, ...), else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")


def _plain_slide_id(slide: str, encoder: str) -> str:
    """``slide`` if it can name a file inside a slide folder (one path component), else raise."""
    if not slide or slide in (".", "..") or any(c in slide for c in "/\\\0") or Path(slide).name != slide \
            or any(ord(c) < 32 for c in slide):
        raise CacheError(f"encoder {encoder!r}: slide id {slide!r} is not a plain file name (no '/', '\\', '..', "
                         "control characters): the slide table decides which file is opened, so slide ids must "
                         "name files inside the slide folder")
    return slide


def _inside(folder: Path, path: Path, *, slide: str, encoder: str, follow_symlinks: bool) -> Path:
    """``path`` (a slide file found in ``folder``) if it stays inside the folder, else raise: a
    symlink leaving the folder is refused unless ``follow_symlinks``; non-regular files always."""
    kind = _not_regular(path)
    if kind:
        raise LayoutError(f"encoder {encoder!r}, slide {slide!r}: {path} is {kind}, not a regular file")
    if not follow_symlinks:
        real, base = path.resolve(), folder.resolve()
        if base not in real.parents:
            raise CacheError(f"encoder {encoder!r}, slide {slide!r}: {path} is a symbolic link to {real}, outside the "
                             f"slide folder {folder}; refused (pass --follow-symlinks / follow_symlinks=True to read "
                             "linked files)")
    return path


def _slide_paths(spec, slides: list[str], *, encoder: str, follow_symlinks: bool = False) -> dict[str, Path]:
    """Each slide's feature file for one encoder: ``spec`` is a mapping slide -> path (used as
    given), a ``{slide}`` pattern or a folder of ``<slide>.npy|.h5|.hdf5`` files (slide ids must
    be plain names and the files stay inside the folder, :func:`_inside`)."""
    if isinstance(spec, Mapping):
        missing = [s for s in slides if s not in spec]
        if missing:
            raise CacheNotFoundError(f"encoder {encoder!r}: no file given for slides {missing[:5]}"
                                     f"{' (and more)' if len(missing) > 5 else ''}")
        return {s: Path(spec[s]) for s in slides}
    text = os.fspath(spec)
    for s in slides:
        _plain_slide_id(s, encoder)
    if "{slide}" in text:
        return _pattern_paths(text, slides, encoder=encoder, follow_symlinks=follow_symlinks)
    return _folder_paths(Path(text), slides, encoder=encoder, follow_symlinks=follow_symlinks)


def _pattern_paths(text: str, slides: list[str], *, encoder: str, follow_symlinks: bool) -> dict[str, Path]:
    prefix = text[: text.index("{slide}")]
    base = Path(prefix) if prefix.endswith(("/", os.sep)) or not prefix else Path(prefix).parent
    out = {s: Path(text.replace("{slide}", s)) for s in slides}
    for s, path in out.items():
        if path.exists() or path.is_symlink():
            _inside(base, path, slide=s, encoder=encoder, follow_symlinks=follow_symlinks)
    return out


def _folder_paths(folder: Path, slides: list[str], *, encoder: str, follow_symlinks: bool) -> dict[str, Path]:
    if not folder.is_dir():
        raise CacheNotFoundError(f"encoder {encoder!r}: slide folder not found: {folder}")
    out, missing = {}, []
    for s in slides:
        found = next((folder / f"{s}{x}" for x in _SLIDE_SUFFIXES
                      if (folder / f"{s}{x}").exists() or (folder / f"{s}{x}").is_symlink()), None)
        if found is None:
            missing.append(s)
        else:
            out[s] = _inside(folder, found, slide=s, encoder=encoder, follow_symlinks=follow_symlinks)
    if missing:
        raise CacheNotFoundError(f"encoder {encoder!r}, slide {missing[0]!r}: file not found: none of "
                                 f"{[f'{missing[0]}{x}' for x in _SLIDE_SUFFIXES]} in {folder}; "
                                 f"{len(missing)} manifest slide(s) have no file: {missing[:5]}"
                                 f"{' (and more)' if len(missing) > 5 else ''}")
    return out


#: Columns a slide table must not have: the importer derives them from the slide files.
_DERIVED = ("sample_id", "tile_index", "x", "y")


def read_manifest(manifest, *, text_columns=("sample_id", "image_path")) -> tuple[pd.DataFrame, str]:
    """``(frame, source)`` of a manifest given as a DataFrame or a ``.csv`` / ``.parquet`` path
    (:func:`cachescore.manifest.coerce_manifest` with inferred CSV types: integer columns stay
    integers, e.g. ``x``, ``y``, ``tile_index``; ``text_columns`` are read as text). Raises what it
    raises (a folder, a non-UTF-8 CSV: ``ValueError`` naming the path)."""
    source = "manifest" if isinstance(manifest, pd.DataFrame) else f"manifest {manifest}"
    return coerce_manifest(manifest, infer_types=True, text_columns=text_columns), source


def is_slide_table(frame: pd.DataFrame, slide_column: str) -> bool:
    """A manifest with one row per slide (no ``sample_id``; ``slide_column`` unique), as opposed to a
    tile manifest."""
    return ("sample_id" not in frame.columns and slide_column in frame.columns
            and not frame[slide_column].astype(str).str.strip().duplicated().any())


def _slide_coords(first: _Source, other: _Source, slide: str, encoder: str, first_name: str):
    if other.shape[0] != first.shape[0]:
        raise AlignmentError(f"slide {slide!r}: encoder {encoder!r} has {other.shape[0]} tiles ({other.path}) but "
                             f"encoder {first_name!r} has {first.shape[0]} ({first.path}); every encoder needs the "
                             "same tiles per slide")
    a, b = first.coords(), other.coords()
    if a is not None and b is not None and not np.array_equal(a, b):
        bad = int(np.flatnonzero(np.any(a != b, axis=1))[0])
        raise AlignmentError(f"slide {slide!r}: encoder {encoder!r} ({other.path}) has coords {b[bad].tolist()} at "
                             f"tile {bad}, encoder {first_name!r} ({first.path}) has {a[bad].tolist()}; the "
                             "encoders' tiles must be the same tiles in the same order")


class _Opened:
    """The slide files of one import, each located and opened once (the manifest's expansion and
    the read plans both need them): every encoder's slide paths, every file's :class:`_Source`."""

    def __init__(self, h5_dataset: str, follow_symlinks: bool):
        self.h5_dataset, self.follow_symlinks = h5_dataset, follow_symlinks
        self._paths: dict = {}
        self._sources: dict = {}

    def paths(self, name: str, spec, slides: list[str]) -> dict[str, Path]:
        key = (name, tuple(slides))
        if key not in self._paths:
            self._paths[key] = _slide_paths(spec, slides, encoder=name, follow_symlinks=self.follow_symlinks)
        return self._paths[key]

    def source(self, path: Path, what: str) -> _Source:
        if str(path) not in self._sources:
            self._sources[str(path)] = _Source(path, h5_dataset=self.h5_dataset, what=what)
        return self._sources[str(path)]


def tiles_from_slides(frame: pd.DataFrame, *, slide_column: str, encoders: Mapping[str, object], h5_dataset: str,
                      source: str, follow_symlinks: bool = False, opened: _Opened | None = None) -> pd.DataFrame:
    """The tile manifest of a slide table: one row per tile of each slide's feature file.

    The first encoder's file of each slide gives the tiles: ``tile_index`` (row in the file),
    ``x``, ``y`` (its ``coords``, when every slide file has them), ``sample_id`` =
    ``<slide>:<x>_<y>`` (or ``<slide>:<tile_index>`` without coords) and ``image_path`` =
    ``<slide's image_path, else the slide id>#<tile_index>`` (encoder-independent, so adding an
    encoder later finds the identical manifest); every slide column is repeated on its
    tiles, dtypes kept. Every other encoder must have the same tile count and coords per slide.
    Raises :class:`CacheError` (a derived column already in the table), :class:`CacheNotFoundError`
    (a slide file missing, naming slide and encoder), :class:`AlignmentError` (tile counts or coords
    differ, naming slide and encoders), :class:`LayoutError` (unreadable files).
    """
    clash = [c for c in _DERIVED if c in frame.columns]
    if clash:
        raise CacheError(f"{source}: a slide table must not have columns {clash}: the importer derives them from "
                         "the slide files (give a tile manifest with sample_id instead to set them yourself)")
    slides = [str(s) for s in normalize_ids(frame[slide_column], source=source, column=slide_column)]
    names = list(encoders)
    opened = opened or _Opened(h5_dataset, follow_symlinks)
    paths = {name: opened.paths(name, encoders[name], slides) for name in names}
    counts, coords = [], []
    for s in slides:
        first = opened.source(paths[names[0]][s], f"encoder {names[0]!r}, slide {s!r}")
        for name in names[1:]:
            other = opened.source(paths[name][s], f"encoder {name!r}, slide {s!r}")
            _slide_coords(first, other, s, name, names[0])
        counts.append(first.shape[0])
        coords.append(first.coords())
    counts = np.asarray(counts, dtype=np.int64)
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise AlignmentError(f"{source}: slide {slides[empty[0]]!r} has no tiles in {paths[names[0]][slides[empty[0]]]}")
    codes = np.repeat(np.arange(len(slides)), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    tile_index = np.arange(int(counts.sum()), dtype=np.int64) - starts[codes]
    tiles = frame.iloc[codes].reset_index(drop=True)
    slide_ids = pa.array(slides, type=pa.large_string()).take(codes)
    tiles["tile_index"] = tile_index
    if all(c is not None for c in coords):
        xy = np.concatenate(coords)
        tiles["x"], tiles["y"] = xy[:, 0], xy[:, 1]
        sample_id = _joined(slide_ids, ":", xy[:, 0], "_", xy[:, 1])
    else:
        sample_id = _joined(slide_ids, ":", tile_index)
    # the slide's image file when the table names it, else the slide id: never an encoder's feature file,
    # so the manifest (and its checksum) is the same whichever encoders are imported with it
    base = _text_of(tiles["image_path"]) if "image_path" in frame.columns else slide_ids
    tiles["image_path"] = text.as_series(_joined(base, "#", tile_index))
    tiles.insert(0, "sample_id", text.as_series(sample_id))
    return tiles


def _text_of(series: pd.Series) -> pa.Array:
    """``series.astype(str)`` as an Arrow ``large_string`` array (Arrow text is taken as it is)."""
    arr = text.arrow_text(series)
    return arr if arr is not None else pa.array(series.astype(str).to_numpy(dtype=object), type=pa.large_string())


def _joined(*parts) -> pa.Array:
    """Element-wise concatenation of Arrow text arrays, numpy arrays (as ``str`` writes them) and
    literal strings, as one ``large_string`` array: what ``a + ":" + b.astype(str)`` gives, with no
    Python string made for integers."""
    def as_text(part):
        if isinstance(part, str):
            return pa.scalar(part, pa.large_string())
        if isinstance(part, np.ndarray) and np.issubdtype(part.dtype, np.integer):
            return pa.array(part).cast(pa.large_string())  # the same decimal digits as str(int)
        if isinstance(part, np.ndarray):  # e.g. non-integral coords: Python's float formatting
            return pa.array(pd.Series(part).astype(str).to_numpy(dtype=object), type=pa.large_string())
        return part
    return pc.binary_join_element_wise(*(as_text(p) for p in parts), pa.scalar("", pa.large_string()))


def _same_table(path: Path, table: pa.Table) -> str | None:
    """None if the Parquet file at ``path`` holds exactly ``table``, else what differs first."""
    try:
        old = pq.read_table(path).replace_schema_metadata(None)
    except (pa.ArrowException, OSError) as exc:
        return f"the existing {path.name} cannot be read: {exc}"
    if old.equals(table):
        return None
    if old.column_names != table.column_names:
        return f"columns {old.column_names} vs {table.column_names}"
    if old.num_rows != table.num_rows:
        return f"{old.num_rows} tiles vs {table.num_rows}"
    for name in table.column_names:
        a, b = old.column(name), table.column(name)
        if not a.equals(b):
            if a.type != b.type:
                return f"column {name!r} is {a.type} there, {b.type} here"
            diff = np.flatnonzero(np.asarray(a.to_pandas() != b.to_pandas()))
            row = int(diff[0]) if diff.size else 0
            return f"column {name!r} differs first at row {row} ({a[row].as_py()!r} vs {b[row].as_py()!r})"
    return "the schemas differ"


def _same_arrays(target: Path, meta: dict) -> bool:
    """Whether the published embeddings at ``target`` hold the same bytes as a staged ``meta``."""
    try:
        old = json.loads((target / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    keys = ("shape", "dtype", "sample_ids_sha256")
    return all(old.get(k) == meta.get(k) for k in keys) and [
        (sh.get("rows"), sh.get("sha256")) for sh in old.get("shards", [])] == [
        (sh["rows"], sh["sha256"]) for sh in meta["shards"]]


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
    follow_symlinks: bool = False,
    storage: StorageOptions | None = None,
) -> Cache:
    """Import arrays + a tile (or slide) manifest into the cache at ``root``; return the :class:`Cache`.

    Parameters
    ----------
    tileset : the tileset to create, or to add encoders to (its tile manifest must then be identical).
    manifest : DataFrame or path (``.csv``/``.parquet``). A **tile manifest** has ``sample_id``
        (unique), ``image_path`` and any metadata; under ``per_slide`` also ``slide_column`` (and
        ``tile_index_column``). A **slide table** (``per_slide``, no ``sample_id``, one row per
        ``slide_column`` value) is expanded into tiles from each slide's feature file
        (:func:`tiles_from_slides`: ``coords`` give ``x``, ``y``, slide columns are repeated).
    encoders : encoder name -> ``.npy``/``.h5`` path (``per_encoder``) or folder / ``{slide}``
        pattern / mapping slide -> path (``per_slide``).
    views : optional ``{view: {"confounder_column": str, "design": str | None}}``; each view is the
        manifest's rows in order (use :func:`write_view` for views that select or repeat rows).
    overwrite : replace the given encoders' existing arrays of this tileset (never another
        encoder's, never a different tile manifest) and the given views.
    validate : re-read every written array with :meth:`Cache.validate_embeddings` (not for linked
        slide files: their rows are validated, NaN refusal included, when a unit first reads them).
    storage : :class:`~.formats.StorageOptions`: ``.npy`` shards (default), Zarr shards (codec,
        chunk rows, storage dtype), or ``link=True``: ``per_slide`` files read in place (each
        slide's tiles must be its file's rows in order, as a slide table gives), nothing copied.
    follow_symlinks : ``per_slide`` folders / ``{slide}`` patterns: read slide files that are
        symbolic links to files outside the folder (default: refused, naming the slide). Slide ids
        must always be plain file names (no ``/``, ``..``); devices, FIFOs and folders are refused.

    Atomic: every input is read and checked (NaN rows included) into staging folders inside the
    cache before anything is published; a failure removes them and leaves the cache as it was, so a
    retry needs no flag. Adding an encoder to an existing tileset with an identical manifest just
    adds it; re-importing identical bytes is a no-op.

    Raises ``ValueError`` (bad layout/names; a manifest that is a folder or not UTF-8),
    :class:`CacheNotFoundError` (a file missing), :class:`CacheError` (a different manifest for an
    existing tileset, a folder given where an encoder file is expected), :class:`LayoutError` (not 2-D, non-float dtype, unreadable,
    dims/dtypes differ across slides), :class:`AlignmentError` (row counts, tile indices or coords do
    not match), :class:`NonFiniteError` (NaN/inf rows, by manifest row), ``FileExistsError`` (an
    encoder's different arrays or a view exist, no ``overwrite``).
    """
    root = writable_root(root)  # a Cache opened read-only is refused before anything is read
    _check_names(layout, tileset, encoders, views)
    frame, source = read_manifest(manifest, text_columns=("sample_id", "image_path", slide_column))
    opened = _Opened(h5_dataset, follow_symlinks)  # each slide file located and opened once
    frame, tile_index_column = _tile_frame(frame.reset_index(drop=True), source, encoders, layout=layout,
                                           slide_column=slide_column, tile_index_column=tile_index_column,
                                           h5_dataset=h5_dataset, follow_symlinks=follow_symlinks, opened=opened)
    storage = storage or StorageOptions()
    if storage.link and layout != "per_slide":
        raise CacheError("--link reads per-slide feature files in place: it needs --layout per_slide")
    plans = _read_plans(frame, source, encoders, layout=layout, slide_column=slide_column,
                        tile_index_column=tile_index_column, h5_dataset=h5_dataset, follow_symlinks=follow_symlinks,
                        link=storage.link, opened=opened)
    out = tileset_frame(tileset, frame)
    tiles_file = tiles_path(root, tileset)
    _check_targets(root, tileset, out, tiles_file, frame, views, source, overwrite=overwrite)
    staged = _stage_all(root, tileset, plans, out["sample_id"], len(frame), source,
                        shard_rows=shard_rows, overwrite=overwrite, storage=storage,
                        describe_rows=_row_describer(frame, slide_column, tile_index_column),
                        rows_are=(f"the tiles of {source}'s slides" if tile_index_column == "tile_index"
                                  and layout == "per_slide" else f"{source} rows"))
    # publication: every input has been read and checked; the manifest first, then each encoder by rename
    stored = None if tiles_file.is_file() else store_tileset_frame(root, tileset, out)  # normalised once
    for name, staging in staged.items():
        atomic_replace_dir(staging, embeddings_dir(root, name, tileset), overwrite=True)
    for view, options in (views or {}).items():
        options = dict(options)
        confounder, design = options.pop("confounder_column"), options.pop("design", None)
        if options:
            raise ValueError(f"view {view!r}: unknown options {sorted(options)}")
        # the manifest's rows as stored in tiles.parquet: a view of them is published from the tileset's bytes
        write_view(root, view, out, tileset=tileset, confounder_column=confounder, design=design,
                   overwrite=overwrite, tileset_table=stored)
    cache = Cache(root)
    if validate and not storage.link:
        for name in staged:
            cache.validate_embeddings(name, tileset)
    return cache


def _check_names(layout: str, tileset: str, encoders, views) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    check_name("tileset", tileset)
    if not isinstance(encoders, Mapping) or not encoders:
        raise ValueError("encoders must be a non-empty mapping encoder name -> file(s)")
    for name in encoders:
        check_name("encoder", name)
    for view in views or {}:
        check_name("view", view)


def _tile_frame(frame: pd.DataFrame, source: str, encoders, *, layout, slide_column, tile_index_column, h5_dataset,
                follow_symlinks, opened: _Opened | None = None) -> tuple[pd.DataFrame, str | None]:
    """The tile manifest (a ``per_slide`` slide table expanded into tiles) and its tile-index
    column; raises :class:`CacheError` when ``sample_id`` or ``image_path`` is missing."""
    if layout == "per_slide" and "sample_id" not in frame.columns:
        _check_slide_table(frame, slide_column, source)
    if layout == "per_slide" and is_slide_table(frame, slide_column):
        frame = tiles_from_slides(frame, slide_column=slide_column, encoders=encoders, h5_dataset=h5_dataset,
                                  source=source, follow_symlinks=follow_symlinks, opened=opened)
        tile_index_column = "tile_index"
    missing = [c for c in ("sample_id", "image_path") if c not in frame.columns]
    if missing:
        hint = (f" (a slide table needs --layout per_slide and a unique --slide-column, here {slide_column!r})"
                if "sample_id" in missing else "")
        raise CacheError(f"{source}: missing required columns {missing}{hint}")
    return frame, tile_index_column


def _check_targets(root: Path, tileset: str, out: pd.DataFrame, tiles_file: Path, frame, views, source: str, *,
                   overwrite: bool) -> None:
    """An existing tileset must have the identical manifest; an existing view needs ``overwrite``;
    each view's confounder column must be usable."""
    if tiles_file.is_file():
        diff = _same_table(tiles_file, parquet_table(out, string_columns=("sample_id", "image_path"),
                                                     source=f"tileset {tileset!r}"))
        if diff:
            raise CacheError(f"tileset {tileset!r} already exists in {root} with a different tile manifest ({diff}); "
                             "encoders can be added only with the identical manifest: import into a new tileset")
    for view, options in (views or {}).items():
        if view_sidecar_path(root, view).exists() and not overwrite:
            raise FileExistsError(f"view {view!r} already exists in {root}; pass --overwrite to replace it")
        _check_view_columns(frame, view, str(dict(options).get("confounder_column", "")).strip(), source)


def _row_describer(frame: pd.DataFrame, slide_column: str, tile_index_column: str | None):
    """``rows -> "slide 'S07' tile 12, ..."`` (or ``sample_id 't3'`` without slide columns): what a
    NaN message says of the tile-manifest rows it names."""
    by_slide = slide_column in frame.columns and bool(tile_index_column) and tile_index_column in frame.columns

    def describe(rows) -> str:  # reads only the named rows: a manifest of millions is not turned into strings
        rows = [int(r) for r in rows]
        if by_slide:
            slides, tiles = frame[slide_column].iloc[rows], frame[tile_index_column].iloc[rows]
            return ", ".join(f"slide {str(s)!r} tile {t}" for s, t in zip(slides, tiles))
        return ", ".join(f"sample_id {str(v)!r}" for v in frame["sample_id"].iloc[rows])

    return describe


def _stage_all(root: Path, tileset: str, plans: dict, ids, n: int, source: str, *, shard_rows, overwrite: bool,
               describe_rows=None, rows_are: str | None = None, storage: StorageOptions | None = None) -> dict[str, Path]:
    """Stage every encoder's arrays inside the cache (read and checked, not yet published);
    returns ``encoder -> staging folder`` of those that change. Identical bytes are dropped; on
    any failure every staging folder is removed and the cache is as it was."""
    staged: dict[str, Path] = {}
    digest = sample_ids_digest(ids) if plans else None  # once, whatever the number of encoders
    try:
        for name, (dim, dtype, read_block, linked) in plans.items():
            staging, meta = stage_embeddings_blocks(root, name, tileset, ids=ids, ids_digest=digest, n_rows=n,
                                                    dim=dim, dtype=dtype,
                                                    read_block=read_block, shard_rows=shard_rows, storage=storage,
                                                    linked=linked,
                                                    source=f"encoder {name!r} (rows are {rows_are or source + ' rows'})",
                                                    describe_rows=describe_rows)
            target = embeddings_dir(root, name, tileset)
            if target.exists() and _same_arrays(target, meta):
                shutil.rmtree(staging, ignore_errors=True)  # identical bytes: nothing to do
                continue
            staged[name] = staging
            if target.exists() and not overwrite:
                raise FileExistsError(f"encoder {name!r} already has different embeddings for tileset {tileset!r} "
                                      f"({target}); pass --overwrite to replace this encoder's arrays (no other "
                                      "encoder is touched)")
    except BaseException:
        for staging in staged.values():
            shutil.rmtree(staging, ignore_errors=True)
        _remove_empty_folders(root, list(plans))
        raise
    return staged


def _check_slide_table(frame: pd.DataFrame, slide_column: str, source: str) -> None:
    """A ``per_slide`` manifest without ``sample_id`` is a slide table: its slide column must exist
    and name each slide once (the message names the column, the repeated slides and their rows)."""
    if slide_column not in frame.columns:
        raise CacheError(f"{source}: no column {slide_column!r} (--slide-column) to name the slides, and no sample_id "
                         f"column (so it is not a tile manifest either); its columns are {list(frame.columns)[:12]}")
    ids = frame[slide_column].astype(str).str.strip()
    dup = ids.duplicated(keep=False).to_numpy()
    if dup.any():
        repeated = list(dict.fromkeys(ids[dup]))
        raise CacheError(f"{source}: a slide table has one row per slide, but column {slide_column!r} repeats "
                         f"{len(repeated)} slide id(s), e.g. {repeated[0]!r} at rows {_rows(np.flatnonzero(ids.to_numpy() == repeated[0]))}"
                         f" (all: {repeated[:5]}{' ...' if len(repeated) > 5 else ''}); remove the duplicates, or give a "
                         "tile manifest with sample_id and image_path")


def _remove_empty_folders(root: Path, encoders: list[str]) -> None:
    """After a failed import: remove ``embeddings/<encoder>/`` folders (and ``embeddings/``) that the
    import left empty; folders holding anything are kept."""
    for name in encoders:
        for folder in (Path(root) / "embeddings" / name, Path(root) / "embeddings"):
            try:
                folder.rmdir()
            except OSError:  # not empty, or absent
                pass


def _check_view_columns(frame: pd.DataFrame, view: str, confounder: str, source: str) -> None:
    """A view over every manifest row needs ``label``, ``group_id`` and its confounder column,
    none blank or null: checked before anything is written (rows named)."""
    for column in (*VIEW_REQUIRED[1:], confounder):
        if not column or column not in frame.columns:
            raise CacheError(f"view {view!r}: the {source} has no column {column!r} (a view needs "
                             f"{list(VIEW_REQUIRED[1:])} and its confounder column)")
        blank = blank_rows(frame[column])
        if blank.size:
            raise CacheError(f"view {view!r}: column {column!r} of the {source} is blank or null at {blank.size} "
                             f"row(s): {_rows(blank)}")


def _read_plans(frame: pd.DataFrame, source: str, encoders: Mapping[str, object], *, layout: str, slide_column: str,
                tile_index_column: str | None, h5_dataset: str, follow_symlinks: bool = False,
                link: bool = False, opened: _Opened | None = None) -> dict[str, tuple]:
    """Per encoder ``(dim, dtype, read_block, linked)`` after checking every file against the
    manifest; ``linked`` (with ``link``) lists ``(path, h5 dataset or None, rows)`` per slide."""
    n = len(frame)
    plans: dict[str, tuple] = {}
    if layout == "per_encoder":
        for name, path in encoders.items():
            if Path(path).is_dir():
                raise CacheError(f"encoder {name!r}: {path} is a folder; per-slide feature folders (one file per "
                                 "slide, e.g. TRIDENT or CLAM output) need --layout per_slide and --slide-column")
            src = _Source(Path(path), h5_dataset=h5_dataset, what=f"encoder {name!r}")
            if src.shape[0] != n:
                raise AlignmentError(f"encoder {name!r}: {src.path} has {src.shape[0]} rows but the {source} has {n}; "
                                     "row i must be the embedding of manifest row i")
            plans[name] = (src.shape[1], src.dtype, src.slice, None)
        return plans
    if slide_column not in frame.columns:
        raise CacheError(f"{source}: missing slide column {slide_column!r} (set slide_column=...)")
    slide_of = normalized_text(frame[slide_column], source=source, column=slide_column)
    codes, slides = pd.factorize(slide_of)
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
        opened = opened or _Opened(h5_dataset, follow_symlinks)
        paths = opened.paths(name, spec, slides)
        sources = [opened.source(paths[s], f"encoder {name!r}, slide {s!r}") for s in slides]
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
        linked = _linked_files(sources, codes, tile_index, slides, name) if link else None
        plans[name] = (dims.pop(), dtypes.pop(), _slide_reader(sources, codes, tile_index), linked)
    return plans
def _linked_files(sources: list[_Source], codes: np.ndarray, tile_index: np.ndarray, slides: list[str],
                  encoder: str) -> list[tuple[str, str | None, int]]:
    """The slide files of a linked import in tileset order. Refused (naming the first row out of
    place) unless each slide's tiles are one run of rows holding its file's rows in order: a
    linked shard is read as the file's rows 0..n-1."""
    order = np.flatnonzero(np.diff(codes) != 0) + 1
    starts = np.concatenate([[0], order]) if codes.size else np.empty(0, np.int64)
    run_codes = codes[starts] if codes.size else codes
    expected = np.arange(codes.size, dtype=np.int64) - np.repeat(starts, np.diff(np.append(starts, codes.size)))
    rows = np.asarray([src.shape[0] for src in sources], dtype=np.int64)
    bad = np.flatnonzero(tile_index != expected)
    if len(set(run_codes.tolist())) != run_codes.size or bad.size or np.any(rows[run_codes] != np.diff(np.append(starts, codes.size))):
        at = int(bad[0]) if bad.size else 0
        raise CacheError(f"encoder {encoder!r}: --link reads each slide file's rows in order, so every slide's tiles "
                         f"must be one run of manifest rows holding all of its file's rows in order (row {at}, slide "
                         f"{slides[int(codes[at])]!r} is not); give a slide table (one row per slide), or import "
                         "without --link")
    return [(str(sources[int(c)].path), sources[int(c)].h5_dataset if sources[int(c)].kind == "h5" else None,
             int(rows[int(c)])) for c in run_codes]


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
