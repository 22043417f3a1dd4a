"""JSON-safe conversion: the one converter from numpy / pandas values to plain JSON data.

Used for store records, evaluation bundles, audit reports and parameter texts. Canonical JSON for
fingerprints is stricter (:func:`cachescore.fingerprint.canonical` rejects non-finite floats and
unknown types) and stays separate on purpose: a fingerprint must never silently change meaning.
"""

from __future__ import annotations

import dataclasses
import math
import os
from enum import Enum
from typing import Any, Literal

import numpy as np
import pandas as pd

__all__ = ["json_safe", "json_default"]

#: What a non-finite float becomes: ``null`` (strict JSON), ``"inf"``/``"-inf"`` strings (NaN
#: still null), or kept as a float (the caller's JSON writer decides).
NonFinite = Literal["null", "string", "keep"]


def json_safe(obj: Any, *, nonfinite: NonFinite = "null") -> Any:
    """``obj`` as plain JSON data: dicts (keys as ``str``), lists, str, int, float, bool, None.

    numpy scalars become Python scalars, arrays and tuples lists, ``pd.Timestamp`` ISO text,
    ``os.PathLike`` str, enums their value, dataclasses dicts, sets sorted lists; NaN / ±inf follow
    ``nonfinite``. Other objects are returned unchanged (``json.dumps`` then raises ``TypeError``
    naming the type).
    """
    if isinstance(obj, dict):
        return {str(k): json_safe(v, nonfinite=nonfinite) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v, nonfinite=nonfinite) for v in obj]
    if isinstance(obj, np.ndarray):
        return json_safe(obj.tolist(), nonfinite=nonfinite)
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        if math.isfinite(obj) or nonfinite == "keep":
            return obj
        if nonfinite == "string" and math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return None
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, pd.Timestamp):
        return obj.isoformat()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, Enum):
        return json_safe(obj.value, nonfinite=nonfinite)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return json_safe({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, nonfinite=nonfinite)
    if isinstance(obj, (set, frozenset)):
        return sorted((json_safe(v, nonfinite=nonfinite) for v in obj), key=repr)
    return obj


def json_default(obj: Any) -> Any:
    """A ``json.dumps(default=...)`` hook: numpy scalars as Python scalars; anything else raises
    ``TypeError`` naming its type."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
