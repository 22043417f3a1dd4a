"""Where a cache lives: a local folder, or an fsspec URL (``s3://``, ``gs://``, ``az://``, ...).

A local cache root is a :class:`pathlib.Path` (``file://`` URLs become one), read with memory maps
as always. Any other URL becomes a ``universal_pathlib`` :class:`upath.UPath`: the same path
interface (``/``, ``is_file``, ``glob``, ``read_bytes``, ``open``) over the URL's fsspec file
system, so the reader and the layout helpers need no second code path; embedding shards are read
with ranged requests (:mod:`.shards`), never downloaded whole or memory-mapped.

Credentials come only from where fsspec and the storage's own client look for them (for S3: the
``AWS_*`` environment variables, ``~/.aws``, ``FSSPEC_S3_*`` / fsspec's config files), on every
process that reads, the workers included. A URL carrying credentials (``s3://key:secret@bucket``)
is refused, so none can reach a job file, the results store or provenance: the cache is recorded
by its URL alone.

Writes to a remote cache go through :func:`remote_session`: the command writes into a local
staging copy of the cache's small files (tables, views, ``meta.json`` and ``cache.json``; never the
shards), and the objects it created or changed are uploaded in publication order: shards first,
then tables, then the ``.json`` files that make an embedding or a view complete, each a single
object write (atomic on object stores: a reader sees the old object or the new one).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from .errors import CacheAccessError, CacheError, CacheNotFoundError

__all__ = ["cache_root", "is_remote", "is_file", "signature", "tree_signature", "read_errors", "open_binary", "access_error", "check_cache_root",
           "remote_session"]

#: File suffixes read into a remote cache's local staging copy (everything but the shards).
STAGED_SUFFIXES = (".json", ".parquet")


def _as_text(root) -> str | None:
    if isinstance(root, Path):
        return None
    if isinstance(root, (str, os.PathLike)):
        return os.fspath(root)
    return None


def is_remote(path) -> bool:
    """Whether ``path`` (a cache root or a path inside one) is in an fsspec file system other
    than the local one (a ``UPath``, or a URL string other than ``file://``)."""
    if isinstance(path, Path):
        return False
    if isinstance(path, str):
        return "://" in path and not path.startswith("file://")
    return hasattr(path, "protocol") and getattr(path, "protocol", "") not in ("", "file", "local")


def cache_root(root):
    """``root`` as the path object the cache code works with: a :class:`pathlib.Path` for a
    folder or a ``file://`` URL, a ``UPath`` for any other URL (returned as given when it is
    one already).

    Raises ``ValueError`` for a URL that carries credentials (``user:secret@``) or a query, and
    :class:`CacheAccessError` when the URL's protocol has no fsspec implementation installed
    (naming the package to install, e.g. ``s3fs`` for ``s3://``)."""
    text = _as_text(root)
    if text is None:
        return root
    if "://" not in text:
        return Path(text)
    if text.startswith("file://"):
        return Path(text[len("file://"):])
    parts = urlsplit(text)
    if "@" in parts.netloc or parts.password or parts.username:
        raise ValueError(f"cache URL {_redact(text)}: credentials in the URL are not accepted (they would be "
                         "recorded in provenance); give them through the environment or the fsspec config")
    if parts.query or parts.fragment:
        raise ValueError(f"cache URL {text}: a query or fragment is not accepted; storage options come from the "
                         "environment or the fsspec config")
    try:
        from upath import UPath  # deferred: only a remote cache needs it

        path = UPath(text.rstrip("/"))
        path.fs  # noqa: B018 - made now, so a missing package is said here, not at the first read
        return path
    except (ImportError, ValueError) as exc:
        raise CacheAccessError(f"cache URL {text}: no fsspec file system for {parts.scheme!r} ({exc}); install its "
                               "package (s3fs for s3://, gcsfs for gs://, adlfs for az://)") from None


def _redact(text: str) -> str:
    parts = urlsplit(text)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://***@{host}{parts.path}"


def open_binary(path):
    """``path`` opened for binary reading (a local file, or an fsspec file doing ranged reads)."""
    return path.open("rb") if is_remote(path) else open(path, "rb")


def signature(path) -> tuple | None:
    """What identifies the current content of the file at ``path`` without reading it: size,
    mtime (ns) and inode for a local file; size and ETag (or modification time) for an object.
    None when the file does not exist."""
    if not is_remote(path):
        try:
            st = Path(path).stat()
        except FileNotFoundError:
            return None
        return (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    try:
        info = path.fs.info(path.path)
    except FileNotFoundError:
        return None
    return (str(path), int(info.get("size") or 0), str(info.get("ETag") or info.get("etag") or info.get("mtime")
                                                       or info.get("LastModified") or info.get("last_modified")))


def tree_signature(folder) -> tuple | None:
    """:func:`signature` of every file under ``folder`` (a Zarr store), in name order, from one
    listing for a remote folder; None when the folder does not exist."""
    if not is_remote(folder):
        root = Path(folder)
        if not root.is_dir():
            return None
        return tuple(signature(p) for p in sorted(root.rglob("*")) if p.is_file())
    try:
        found = folder.fs.find(folder.path, detail=True)
    except FileNotFoundError:
        return None
    return tuple((name, int(info.get("size") or 0), str(info.get("ETag") or info.get("mtime") or ""))
                 for name, info in sorted(found.items())) or None


def access_error(where: str, exc: BaseException) -> CacheAccessError:
    """A :class:`CacheAccessError` for an object store that refused ``where`` (wrong or missing
    credentials, no permission), saying where credentials are read from."""
    return CacheAccessError(f"{where}: access denied ({type(exc).__name__}: {exc}); check the credentials the "
                            "storage client reads (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
                            "AWS_ENDPOINT_URL for a non-AWS endpoint, or the fsspec config); none are read from the "
                            "job or the cache")


def _kind(path) -> str | None:
    """``"file"``, ``"directory"`` or None (absent) for a remote path; unlike fsspec's ``isfile``
    / ``isdir``, a refused request raises (``PermissionError``) instead of reading as absent."""
    try:
        return path.fs.info(path.path).get("type")
    except FileNotFoundError:
        return None


def is_file(path) -> bool:
    """Whether ``path`` is an existing file; a remote store's refusal raises
    :class:`CacheAccessError` rather than reading as "missing"."""
    if not is_remote(path):
        return Path(path).is_file()
    try:
        return _kind(path) == "file"
    except PermissionError as exc:
        raise access_error(str(path), exc) from None


@contextmanager
def read_errors(where: str, *, missing, broken, catch=(OSError,)):
    """Errors of a read of ``where`` as the cache's: a missing file or object raises
    ``missing()``, a refused request :class:`CacheAccessError`, any other of ``catch``
    ``broken(exc)``; the cache's own errors pass through."""
    try:
        yield
    except CacheError:
        raise
    except FileNotFoundError:
        raise missing() from None
    except PermissionError as exc:
        raise access_error(where, exc) from None
    except catch as exc:
        raise broken(exc) from exc


def check_cache_root(root) -> None:
    """Raise :class:`CacheNotFoundError` when the cache at ``root`` does not exist (a missing
    folder, or no object under a URL's prefix), :class:`CacheAccessError` when the store refuses
    to list it."""
    root = cache_root(root)
    try:
        found = _kind(root) == "directory" if is_remote(root) else root.is_dir()
    except PermissionError as exc:
        raise access_error(f"cache {root}", exc) from None
    except OSError as exc:
        raise CacheAccessError(f"cache {root}: cannot be listed ({type(exc).__name__}: {exc})") from None
    if not found:
        raise CacheNotFoundError(f"cache folder not found: {root}")


def _staged_files(root) -> list[str]:
    """The cache's files a staging copy holds (relative paths): tables, views, ``*.json``."""
    base = root.path.rstrip("/")
    out = []
    try:
        listing = root.fs.find(base)
    except PermissionError as exc:
        raise access_error(f"cache {root}", exc) from None
    for name in listing:
        rel = name[len(base):].lstrip("/")
        if rel.endswith(STAGED_SUFFIXES) and not any(p.startswith(".") for p in rel.split("/")):
            out.append(rel)
    return out


def _snapshot(folder: Path) -> dict[str, tuple]:
    out = {}
    for path in folder.rglob("*"):
        if path.is_file():
            st = path.stat()
            out[path.relative_to(folder).as_posix()] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def _publication_rank(rel: str) -> int:
    """Upload order: shards and chunks, then tables and a Zarr shard's own ``zarr.json``, then the
    documents that make something complete (an embedding's ``meta.json``, a view's sidecar,
    ``cache.json``), so a reader never finds one naming a file not yet there."""
    if rel.endswith("meta.json") or rel == "cache.json" or (rel.startswith("views/") and rel.endswith(".json")):
        return 2
    return 0 if rel.endswith(".npy") or "/c/" in rel else 1


@contextmanager
def remote_session(root):
    """Yield a local folder to write a cache into; for a remote ``root``, publish what changed.

    A local root is yielded as it is (the writers' own atomic renames apply). For a remote one the
    yielded folder is a temporary staging copy of its small files (:data:`STAGED_SUFFIXES`; the
    shards stay in the store); when the block returns, ``.json`` objects that were removed or
    changed are deleted first (an embedding or a view stops being complete), then new and changed
    files are uploaded (:func:`_publication_rank`: shards and chunks, tables, then ``meta.json``,
    sidecars and ``cache.json``), then objects whose files were removed, and what a rewritten
    embedding folder no longer holds, are deleted. When the block raises, nothing is uploaded (the exception's message names the URL,
    not the staging folder). The staging folder is removed either way.
    """
    root = cache_root(root)
    if not is_remote(root):
        yield root
        return
    fs, base = root.fs, root.path.rstrip("/")
    stage = Path(tempfile.mkdtemp(prefix="cachescore-stage-"))
    try:
        exists = fs.exists(base)
        for rel in (_staged_files(root) if exists else []):
            target = stage / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{base}/{rel}", str(target))
        before = _snapshot(stage)
        try:
            yield stage
        except Exception as exc:  # messages name the cache, not the staging folder
            exc.args = tuple(arg.replace(str(stage), str(root)) if isinstance(arg, str) else arg for arg in exc.args)
            raise
        after = _snapshot(stage)
        changed = sorted((rel for rel, sig in after.items() if before.get(rel) != sig), key=_publication_rank)
        removed = [rel for rel in before if rel not in after]
        for rel in [r for r in before if r.endswith(".json") and (r in removed or r in changed)]:
            fs.rm_file(f"{base}/{rel}")
        for rel in changed:
            fs.put_file(str(stage / rel), f"{base}/{rel}")
        stale = [rel for rel in removed if not rel.endswith(".json")]
        stale += _orphan_shards(fs, base, stage, changed)
        for rel in stale:
            fs.rm_file(f"{base}/{rel}")
    except PermissionError as exc:
        raise access_error(f"cache {root}", exc) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _orphan_shards(fs, base: str, stage: Path, changed: list[str]) -> list[str]:
    """Objects left in the store by an embedding folder whose ``meta.json`` was rewritten and that
    the new folder no longer holds (a re-import with fewer shards, or in another format): the
    staging copy holds such a folder whole, so what the store has beyond it is not referenced."""
    out = []
    for rel in changed:
        if not rel.endswith("/meta.json"):
            continue
        folder = rel[: -len("/meta.json")]
        local = {p.relative_to(stage).as_posix() for p in (stage / folder).rglob("*") if p.is_file()}
        try:
            remote = fs.find(f"{base}/{folder}")
        except FileNotFoundError:
            continue
        out += [r for r in (name[len(base):].lstrip("/") for name in remote) if r not in local]
    return out
