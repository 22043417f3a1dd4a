"""Content fingerprints: sha256 of canonical JSON.

Canonical form: keys sorted, compact separators ``(",", ":")``, UTF-8, ``ensure_ascii=False``,
NaN/inf rejected. Before encoding, values are converted: numpy scalars -> Python scalars, numpy
arrays -> nested lists, tuples -> lists, sets/frozensets -> sorted lists, ``Path`` -> str,
dataclasses -> dicts, mapping keys (str, int, numpy ints) -> str. Anything else raises ``TypeError``
(an object without a stable content representation cannot be fingerprinted).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from enum import Enum
from typing import Any, Mapping

import numpy as np

__all__ = ["canonical", "canonical_json", "fingerprint"]


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
