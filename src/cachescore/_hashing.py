"""File hashing: the one sha256-of-a-file helper (cache shards and views, bundles, scratch)."""

from __future__ import annotations

import hashlib
import os

__all__ = ["sha256_file", "sha256_stream", "HASH_BLOCK"]

#: Bytes read per step when hashing a file (bounded memory whatever the file size).
HASH_BLOCK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    """Lowercase hex sha256 of the file's bytes, read in :data:`HASH_BLOCK` steps.

    ``path`` may also be a ``UPath`` (a file in object storage, read through its ``open``).
    Raises ``OSError`` (``FileNotFoundError``, ``PermissionError``, ...) as ``open`` does.
    """
    with (open(path, "rb") if isinstance(path, (str, bytes, os.PathLike)) else path.open("rb")) as fh:
        return sha256_stream(fh)[0]


def sha256_stream(fh) -> tuple[str, int]:
    """``(lowercase hex sha256, bytes)`` of what a binary file object holds from its position to its
    end, read in :data:`HASH_BLOCK` steps."""
    h, size = hashlib.sha256(), 0
    while chunk := fh.read(HASH_BLOCK):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size
