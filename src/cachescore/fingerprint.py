"""Fingerprints and the code version: what keys every stored result.

* :func:`fingerprint` — sha256 of canonical JSON (below) over a unit's inputs, parameters and code
  version (ADR-0006);
* :func:`code_version` — ``"<package version>+<12 hex>"``, a digest of the *scoring sources* of a
  unit kind (:data:`CODE_SOURCES`), so edited scoring code never reuses stale numbers;
  ``CACHESCORE_CODE_VERSION`` pins it.

The code-version digest is **path-independent** (ADR-0008): each scoring file enters as its module
name (the last dotted component, ``__init__`` for a package) and the sha256 of its bytes, and the
pairs are hashed in sorted order. Moving a file to another package, or reordering the source list,
keeps the version; editing, adding, removing or renaming a scoring module changes it.

Canonical form: keys sorted, compact separators ``(",", ":")``, UTF-8, ``ensure_ascii=False``,
NaN/inf rejected. Before encoding, values are converted: numpy scalars -> Python scalars, numpy
arrays -> nested lists, tuples -> lists, sets/frozensets -> sorted lists, ``Path`` -> str,
dataclasses -> dicts, mapping keys (str, int, numpy ints) -> str. Anything else raises ``TypeError``
(an object without a stable content representation cannot be fingerprinted).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import os
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from ._version import __version__

__all__ = ["canonical", "canonical_json", "fingerprint", "code_version", "source_digest", "scoring_files",
           "CODE_SOURCES", "CODE_VERSION_ENV"]

#: Environment variable that pins the code version (see :func:`code_version`).
CODE_VERSION_ENV = "CACHESCORE_CODE_VERSION"

#: The scoring sources of each unit kind: dotted module or package names (a package counts with
#: every ``.py`` file below it). Their content enters the code version of that kind's units.
CODE_SOURCES: dict[str, tuple[str, ...]] = {
    "score": ("cachescore.metrics", "cachescore.neighbors", "cachescore.manifest", "cachescore.pipeline.unit",
              "cachescore._finite", "cachescore._threads", "cachescore.errors", "cachescore.types"),
    "probe": ("cachescore.probe", "cachescore.metrics.probe_reductions", "cachescore.pipeline.probe_unit",
              "cachescore.pipeline.probe_identity"),
    # the tidy tables' intervals, ranks and verdicts (their kept groups: cachescore.results.memo)
    "tables": ("cachescore.results", "cachescore.metrics"),
}


def canonical(obj: Any) -> Any:
    """Return ``obj`` converted to plain JSON types (see module docstring); raise ``TypeError``/``ValueError``."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        if not math.isfinite(value):
            raise ValueError(f"cannot fingerprint a non-finite float ({value})")
        return value
    if isinstance(obj, Enum):
        return canonical(obj.value)
    if isinstance(obj, (np.str_, os.PathLike)):
        return os.fspath(obj) if isinstance(obj, os.PathLike) else str(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype == object or obj.dtype.kind in "OV":
            return [canonical(v) for v in obj.tolist()]
        return canonical(obj.tolist())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return canonical({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    if isinstance(obj, Mapping):
        out = {}
        for key, value in obj.items():
            if isinstance(key, (bool, np.bool_)) or not isinstance(key, (str, int, np.integer, np.str_)):
                raise TypeError(f"cannot fingerprint a mapping key of type {type(key).__name__}: {key!r}")
            skey = str(int(key)) if isinstance(key, (int, np.integer)) else str(key)
            if skey in out:
                raise ValueError(f"mapping keys {key!r} and its string form collide")
            out[skey] = canonical(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [canonical(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        items = [canonical(v) for v in obj]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    raise TypeError(f"cannot fingerprint an object of type {type(obj).__name__}; pass its content as plain data")


def canonical_json(obj: Any) -> str:
    """The canonical JSON text of ``obj``."""
    return json.dumps(canonical(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def fingerprint(obj: Any) -> str:
    """sha256 hex digest (64 lowercase hex chars) of :func:`canonical_json` of ``obj``.

    Equal content gives equal fingerprints whatever the key order or numeric container
    (``np.int64(3)`` == ``3``, ``np.float32(0.5)`` == ``0.5``, ``(1, 2)`` == ``[1, 2]``).
    Note ``1`` and ``1.0`` differ (JSON ``1`` vs ``1.0``).
    """
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def _module_path(name: str, root: Path | None) -> Path:
    """The file (module) or folder (package) of a dotted ``cachescore.*`` name under ``root``
    (default: the installed package's parent folder)."""
    if root is None:
        spec = importlib.util.find_spec("cachescore")
        root = Path(spec.origin).resolve().parent.parent
    parts = name.split(".")
    folder = Path(root).joinpath(*parts)
    if folder.is_dir():
        return folder
    path = folder.with_suffix(".py")
    if not path.is_file():
        raise FileNotFoundError(f"scoring source {name!r} not found (no {folder} or {path})")
    return path


def scoring_files(sources: Iterable[str], *, root: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """``(module name, file)`` for every ``.py`` file of ``sources`` (see :data:`CODE_SOURCES`).

    The module name is the file's last dotted component (``ri`` for ``metrics/ri.py``,
    ``<package>.__init__`` for a package's ``__init__.py``). Raises ``FileNotFoundError`` for a
    source that does not exist (a stale :data:`CODE_SOURCES` entry after a move).
    """
    out = []
    for name in sources:
        path = _module_path(name, None if root is None else Path(root))
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            stem = f"{f.parent.name}.__init__" if f.name == "__init__.py" else f.stem
            out.append((stem, f))
    return out


def source_digest(sources: Iterable[str], *, root: str | os.PathLike | None = None) -> str:
    """sha256 hex over the sorted ``(module name, sha256 of bytes)`` pairs of ``sources``' files.

    Independent of where the files lie and of the order of ``sources``; a file listed twice (a
    package and one of its modules) counts once.
    """
    pairs = sorted({(stem, hashlib.sha256(f.read_bytes()).hexdigest()) for stem, f in scoring_files(sources, root=root)})
    h = hashlib.sha256()
    for stem, digest in pairs:
        h.update(stem.encode() + b"\0" + digest.encode() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _source_code_version(kind: str) -> str:
    return f"{__version__}+{source_digest(CODE_SOURCES[kind])[:12]}"


def code_version(kind: str = "score") -> str:
    """The code version that enters the fingerprints of ``kind``'s units (``"score"``: RI, MaRI,
    CRoMa; ``"probe"``: probe sweeps).

    ``"<cachescore version>+<12 hex of source_digest(CODE_SOURCES[kind])>"``. Setting
    ``CACHESCORE_CODE_VERSION`` pins it for every kind instead (a deployment that vouches for equal
    numbers across a patch, or tests that must not see concurrent edits); results are then reused
    across code changes. Raises ``KeyError`` for an unknown kind.
    """
    if kind not in CODE_SOURCES:
        raise KeyError(f"unknown unit kind {kind!r} for the code version (known: {', '.join(CODE_SOURCES)})")
    pinned = os.environ.get(CODE_VERSION_ENV, "").strip()
    return pinned if pinned else _source_code_version(kind)
