"""The package version and the versions of the distributions a result depends on.

Lives apart from ``cachescore/__init__`` so that no sub-package imports the package root (which
imports the metric API, and through it most of the package).
"""

from __future__ import annotations

import platform
from importlib import metadata

__all__ = ["__version__", "package_versions"]

__version__ = "0.1.0"


def package_versions(distributions, *, python: bool = False) -> dict:
    """``{distribution: installed version or None}`` for each name, in the given order.

    ``python=True`` puts the interpreter's version first under ``"python"``. A distribution that is
    not installed maps to ``None`` (provenance records what was missing; nothing raises).
    """
    out = {"python": platform.python_version()} if python else {}
    for dist in distributions:
        try:
            out[dist] = __version__ if dist == "cachescore" else metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out
