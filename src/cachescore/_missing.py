"""Missing values across numpy, pandas and JSON: one test and one float conversion (layer 0)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

__all__ = ["is_missing", "as_float"]


def is_missing(value) -> bool:
    """Whether ``value`` is None, ``pd.NA``, ``pd.NaT`` or a float NaN (numpy's included); any other
    value (a string, a number, a container) is not missing."""
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    try:
        return bool(isinstance(value, (float, np.floating)) and math.isnan(value))
    except TypeError:
        return False


def as_float(value) -> float:
    """``float(value)``, NaN for None or a value that is not a number."""
    try:
        return float(value) if value is not None else float("nan")
    except (TypeError, ValueError):
        return float("nan")
