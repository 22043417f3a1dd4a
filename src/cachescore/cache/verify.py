"""Health check of a whole cache folder that reports every problem instead of stopping at the first.

:func:`verify_cache` walks every tileset, every ``embeddings/<encoder>/<tileset>/`` folder and every
view, and returns a list of :class:`Problem` (empty when the cache is healthy). Each problem names
its kind, the encoder / tileset / view, the file and, where rows are concerned, the tileset row range
of the shard and the offending row positions. Nothing is written; hidden in-flight files of
writers (``.*.partial``) are ignored, as every reader of the cache ignores them.

Use it for a ``status``-style report; the metric pipeline keeps using
:meth:`Cache.validate_embeddings`, which raises on the first problem.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .._finite import nonfinite_rows
from .errors import CacheError, ShardNotFoundError, ViewChecksumError
from .layout import (
    LINKED_FORMAT,
    check_name,
    embeddings_dir,
    meta_path,
    parse_meta,
    tiles_path,
    view_sidecar_path,
    view_table_path,
)
from .reader import Cache
from .shards import open_shard, shard_contents
from .writer import _rows, sample_ids_digest

__all__ = ["Problem", "PROBLEM_KINDS", "verify_cache"]

#: Every value of :attr:`Problem.kind`, with its meaning.
PROBLEM_KINDS = {
    "cache_missing": "the cache folder does not exist",
    "tileset": "a tiles.parquet cannot be read or breaks the contract (columns, blank/duplicate sample_id)",
    "bad_name": "a folder under embeddings/ is not a valid encoder or tileset name",
    "incomplete": "an embeddings folder has no meta.json (an import that never finished)",
    "meta": "a meta.json cannot be parsed or breaks its schema",
    "alignment": "embeddings do not line up with tiles.parquet (tileset missing, row count, sample_id order)",
    "shard_missing": "a shard listed in meta.json does not exist",
    "shard_corrupt": "a shard is unreadable or its shape/dtype differs from meta.json",
    "checksum": "a shard's sha256 differs from the one recorded in meta.json",
    "non_finite": "a shard holds NaN or infinite values",
    "view": "a view's sidecar or table is invalid (columns, blank values, unknown sample_id, tileset)",
    "view_incomplete": "a view table has no sidecar (or a sidecar no table)",
    "view_checksum": "a view table's sha256/size differs from the one recorded in its sidecar",
}

#: At most this many row positions are kept in :attr:`Problem.rows` (``n_rows`` has the full count).
MAX_ROWS = 1000


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One problem found by :func:`verify_cache`.

    ``kind`` is a key of :data:`PROBLEM_KINDS`; ``message`` a readable sentence naming the place.
    ``encoder``/``tileset``/``view``/``file`` are None where they do not apply. ``row_range`` is the
    ``(start, stop)`` tileset rows of the shard concerned; ``rows`` the offending tileset row
    positions (first :data:`MAX_ROWS`), ``n_rows`` their total count (0 when rows do not apply).
    """

    kind: str
    message: str
    encoder: str | None = None
    tileset: str | None = None
    view: str | None = None
    file: str | None = None
    row_range: tuple[int, int] | None = None
    rows: tuple[int, ...] = ()
    n_rows: int = 0

    def __post_init__(self):
        if self.kind not in PROBLEM_KINDS:
            raise ValueError(f"unknown problem kind {self.kind!r}; known: {sorted(PROBLEM_KINDS)}")

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"

    def to_dict(self) -> dict:
        """Plain JSON-able dict (tuples become lists)."""
        out = asdict(self)
        out["row_range"] = None if self.row_range is None else list(self.row_range)
        out["rows"] = list(self.rows)
        return out


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")) if folder.is_dir() else []


def _check_tilesets(cache, problems: list) -> dict[str, np.ndarray | None]:
    """sample_ids of every readable tileset (None when unreadable); problems appended."""
    ids = {}
    for folder in _visible_dirs(cache.root / "tilesets"):
        name = folder.name
        path = tiles_path(cache.root, name)
        if not path.is_file():
            problems.append(Problem(kind="tileset", tileset=name, file=str(path),
                                    message=f"tileset {name!r}: {path} is missing (folder without tiles.parquet)"))
            continue
        try:
            check_name("tileset", name)
            ids[name] = cache.read_tileset(name, columns=["sample_id", "image_path"])["sample_id"].to_numpy(dtype=object)
        except (CacheError, ValueError, OSError) as exc:
            problems.append(Problem(kind="tileset", tileset=name, file=str(path), message=f"tileset {name!r}: {exc}"))
            ids[name] = None
    return ids


def _check_embeddings(cache, encoder: str, tileset: str, tileset_ids: dict, problems: list, *,
                      checksums: bool, finite: bool) -> None:
    label = f"encoder {encoder!r}, tileset {tileset!r}"
    folder = embeddings_dir(cache.root, encoder, tileset)
    mpath = meta_path(cache.root, encoder, tileset)
    where = dict(encoder=encoder, tileset=tileset)
    if not mpath.is_file():
        problems.append(Problem(kind="incomplete", file=str(folder), **where,
                                message=f"{label}: {folder} has no meta.json (an unfinished import?); re-import "
                                        "it or delete the folder"))
        return
    try:
        meta = parse_meta(mpath, encoder=encoder, tileset=tileset)
    except (CacheError, OSError) as exc:
        problems.append(Problem(kind="meta", file=str(mpath), **where, message=f"{label}: {exc}"))
        return
    ids = tileset_ids.get(tileset, "absent")
    if isinstance(ids, str):
        problems.append(Problem(kind="alignment", file=str(tiles_path(cache.root, tileset)), **where,
                                message=f"{label}: tileset {tileset!r} does not exist "
                                        f"({tiles_path(cache.root, tileset)} missing)"))
    elif ids is not None:  # an unreadable tileset is already reported
        if len(ids) != meta.n_rows:
            problems.append(Problem(kind="alignment", file=str(mpath), **where,
                                    message=f"{label}: embeddings have {meta.n_rows} rows but "
                                            f"{tiles_path(cache.root, tileset)} has {len(ids)}"))
        elif sample_ids_digest(ids) != meta.sample_ids_sha256:
            problems.append(Problem(kind="alignment", file=str(mpath), **where,
                                    message=f"{label}: the sample_id order of {tiles_path(cache.root, tileset)} "
                                            "differs from the one these embeddings were written for (re-import them)"))
    for shard, ref in zip(meta.shards, cache._paths(meta)):
        path = Path(shard.file) if meta.format == LINKED_FORMAT else folder / shard.file
        rng = (shard.start, shard.stop)
        at = dict(file=str(path), row_range=rng, **where)
        try:
            mm = open_shard(ref, shard.rows, meta.dim, meta.dtype, label)
        except ShardNotFoundError as exc:
            problems.append(Problem(kind="shard_missing", message=str(exc), **at))
            continue
        except CacheError as exc:
            problems.append(Problem(kind="shard_corrupt", message=str(exc), **at))
            continue
        try:
            mm, digest = shard_contents(mm, ref, checksums=checksums, finite=finite)
        except CacheError as exc:
            problems.append(Problem(kind="shard_corrupt", message=str(exc), **at))
            continue
        if checksums and digest != shard.sha256:
            problems.append(Problem(kind="checksum", **at,
                                    message=f"{label}: shard {path} (rows {shard.start}:{shard.stop}) does not match "
                                            "its sha256 in meta.json"))
        if finite and shard.rows:
            bad = nonfinite_rows(mm) + shard.start
            if bad.size:
                problems.append(Problem(kind="non_finite", rows=tuple(int(r) for r in bad[:MAX_ROWS]), n_rows=int(bad.size),
                                        message=f"{label}: shard {path} (rows {shard.start}:{shard.stop}) has NaN or "
                                                f"infinite values at {bad.size} tileset rows {_rows(bad)}", **at))
        del mm


def _check_views(cache, problems: list) -> None:
    base = cache.root / "views"
    if not base.is_dir():
        return
    tables = {p.stem for p in base.glob("*.parquet") if not p.name.startswith(".")}
    sidecars = {p.stem for p in base.glob("*.json") if not p.name.startswith(".")}
    for view in sorted(tables | sidecars):
        if (view in tables) != (view in sidecars):
            have, lack = (view_table_path, view_sidecar_path) if view in tables else (view_sidecar_path, view_table_path)
            problems.append(Problem(kind="view_incomplete", view=view, file=str(have(cache.root, view)),
                                    message=f"view {view!r}: {have(cache.root, view)} exists but "
                                            f"{lack(cache.root, view)} does not; the view is not listed "
                                            "(rewrite it with write_view)"))
            continue
        try:
            check_name("view", view)
            cache.read_view(view)
        except (CacheError, ValueError, OSError) as exc:
            tileset = None
            try:
                tileset = cache.view_spec(view).tileset
            except (CacheError, ValueError, OSError):
                pass
            mismatch = isinstance(exc, ViewChecksumError)  # its message names the view and both files
            problems.append(Problem(kind="view_checksum" if mismatch else "view", view=view, tileset=tileset,
                                    file=str(view_table_path(cache.root, view)),
                                    message=str(exc) if mismatch else f"view {view!r}: {exc}"))


def verify_cache(root, *, checksums: bool = True, finite: bool = True) -> list[Problem]:
    """Check every tileset, encoder × tileset embedding folder and view of the cache at ``root``.

    Unlike :meth:`Cache.validate_embeddings` nothing raises for a data problem: every problem found
    is returned, in the order tilesets, embeddings (by encoder, then tileset, then shard), views.
    Per embedding folder: ``meta.json`` present and valid; tileset exists; row count and sample_id
    order match it; per shard: exists, header matches ``meta.json``, (``checksums``) sha256 matches,
    (``finite``) no NaN/inf rows (all such rows counted, the first :data:`MAX_ROWS` listed). Per view:
    sidecar and table both present, and :meth:`Cache.read_view` accepts them.

    Returns an empty list for a healthy cache. Reads every shard once for the checksum and once for
    finiteness (the second read comes from the page cache); memory is bounded by a 64 MiB block.
    """
    cache = root if isinstance(root, Cache) else Cache(root)
    problems: list[Problem] = []
    if not cache.root.is_dir():
        return [Problem(kind="cache_missing", file=str(cache.root), message=f"cache folder not found: {cache.root}")]
    tileset_ids = _check_tilesets(cache, problems)
    for enc_dir in _visible_dirs(cache.root / "embeddings"):
        for ts_dir in _visible_dirs(enc_dir):
            try:
                check_name("encoder", enc_dir.name)
                check_name("tileset", ts_dir.name)
            except ValueError as exc:
                problems.append(Problem(kind="bad_name", file=str(ts_dir), message=f"{ts_dir}: {exc}"))
                continue
            _check_embeddings(cache, enc_dir.name, ts_dir.name, tileset_ids, problems, checksums=checksums, finite=finite)
    _check_views(cache, problems)
    return problems
