"""Atomic file writes: write a uniquely named ``.partial`` sibling, flush it, then rename it.

A reader never sees a half-written file: before the rename the target name does not exist (or
still holds the previous complete version); after it, the target holds the complete new bytes.
Leftover ``*.partial`` files from a crashed writer are invisible to every reader in this package
(names starting with ``.`` are skipped) and may be deleted at any time with :func:`sweep_partials`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = [
    "PARTIAL_SUFFIX",
    "partial_path",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_replace_dir",
    "sweep_partials",
]

#: Suffix of in-flight files and folders; they also start with ``.`` so listings skip them.
PARTIAL_SUFFIX = ".partial"


def partial_path(target: Path) -> Path:
    """A unique hidden sibling of ``target``: ``.<name>.<pid>-<uuid>.partial``."""
    target = Path(target)
    return target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex}{PARTIAL_SUFFIX}")


def atomic_write(target: Path, write: Callable[[BinaryIO], None], *, overwrite: bool = True) -> Path:
    """Call ``write(fileobj)`` on a fresh ``.partial`` sibling, fsync it, then rename it to ``target``.

    With ``overwrite=False`` an existing ``target`` raises ``FileExistsError`` (checked before and,
    via ``os.link``, race-free at publication; on filesystems without hard links the final check
    is best effort). On any exception the partial file is removed and
    the target is untouched.
    """
    target = Path(target)
    if not overwrite and target.exists():
        raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(target)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)  # fails with FileExistsError if another writer won the race
            except FileExistsError:
                raise
            except OSError:  # no hard links on this filesystem: best effort, check then rename
                if target.exists():
                    raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it") from None
                os.replace(tmp, target)
            else:
                os.unlink(tmp)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


def atomic_write_bytes(target: Path, data: bytes, *, overwrite: bool = True) -> Path:
    """Atomically write ``data`` to ``target`` (see :func:`atomic_write`)."""
    return atomic_write(target, lambda fh: fh.write(data), overwrite=overwrite)


def atomic_write_json(target: Path, obj, *, overwrite: bool = True) -> Path:
    """Atomically write ``obj`` as indented UTF-8 JSON (strict: NaN/inf raise ``ValueError``)."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"
    return atomic_write_bytes(target, text.encode("utf-8"), overwrite=overwrite)


def atomic_replace_dir(staging: Path, target: Path, *, overwrite: bool) -> Path:
    """Publish a fully written ``staging`` folder as ``target`` by rename.

    Without ``overwrite`` an existing ``target`` raises ``FileExistsError`` and ``staging`` is
    removed. With it, the old folder is renamed aside first, then removed after the new one is in
    place, so ``target`` is missing only for the instant between two renames.
    """
    staging, target = Path(staging), Path(target)
    if target.exists():
        if not overwrite:
            shutil.rmtree(staging, ignore_errors=True)
            raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it")
        old = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex}.old{PARTIAL_SUFFIX}")
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except OSError:
            os.rename(old, target)  # put the previous version back: never leave target missing
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            os.rename(staging, target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if target.exists():
                raise FileExistsError(f"{target} was created by another writer meanwhile") from None
            raise
    return target


def sweep_partials(folder: Path, *, older_than_s: float = 3600.0) -> int:
    """Delete ``*.partial`` files/folders under ``folder`` older than ``older_than_s``; return the count.

    Only leftovers of crashed writers match; a live writer's partial is younger than the cut-off.
    """
    folder = Path(folder)
    if not folder.exists():
        return 0
    cutoff = time.time() - older_than_s
    removed = 0
    for path in folder.rglob(f"*{PARTIAL_SUFFIX}"):
        try:
            if path.lstat().st_mtime >= cutoff:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()
            removed += 1
        except FileNotFoundError:
            continue
    return removed
