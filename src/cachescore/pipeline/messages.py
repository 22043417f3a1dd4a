"""What a run tells its user on the console: one line at a time, and the free space of a full store."""

from __future__ import annotations

import shutil
from typing import TextIO

__all__ = ["say", "free_space"]


def say(out: TextIO | None, msg: str) -> None:
    """Write ``msg`` and a newline to ``out`` and flush (nothing when ``out`` is None: quiet)."""
    if out is not None:
        out.write(msg + "\n")
        out.flush()


def free_space(path) -> str:
    """``"<n> MiB free"`` on the file system of ``path`` (``"free space unknown"`` if it cannot be read)."""
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MiB free"
    except OSError:
        return "free space unknown"
