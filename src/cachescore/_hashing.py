"""File hashing: the one sha256-of-a-file helper (cache shards and views, bundles, scratch)."""

from __future__ import annotations

import hashlib
import os

__all__ = ["sha256_file", "HASH_BLOCK"]

#: Bytes read per step when hashing a file (bounded memory whatever the file size).
HASH_BLOCK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    """Lowercase hex sha256 of the file's bytes, read in :data:`HASH_BLOCK` steps.

    ``path`` may also be a ``UPath`` (a file in object storage, read through its ``open``).
    Raises ``OSError`` (``FileNotFoundError``, ``PermissionError``, ...) as ``open`` does.
    """
    h = hashlib.sha256()
    with (open(path, "rb") if isinstance(path, (str, bytes, os.PathLike)) else path.open("rb")) as fh:
        while chunk := fh.read(HASH_BLOCK):
            h.update(chunk)
    return h.hexdigest()
