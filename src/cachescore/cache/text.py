"""Text columns of tile manifests and views, kept in Arrow.

A manifest of 10⁵–10⁶ tiles holds as many sample ids and image paths. Turning each into a Python
``str`` to strip it, check it for blanks, hash it and turn it back into Arrow for Parquet costs
~0.1 µs per value per round trip, and the importer made several. These helpers keep a text column
that has no missing values (what Parquet and CSV text read as: pandas' ``str`` dtype, Arrow
backed) in Arrow from end to end:

- :func:`arrow_text`: the column as one Arrow ``large_string`` array (zero-copy), or ``None`` when
  it is not such a column (missing values, Python objects): callers then take their object path.
- :func:`strip`: ``str.strip()`` of every value. Arrow's ``utf8_trim_whitespace`` removes exactly
  the characters Python's ``str.isspace`` names (checked over every code point by
  ``tests/test_text_columns.py``), so the normalised ids, and their digest, are the same.
- :func:`blank_positions`, :func:`duplicate_positions`: row positions, for error messages.
- :func:`json_list_sha256`: sha256 of ``json.dumps(list, separators=(",", ":"))`` computed from the
  Arrow buffers when no value needs escaping (ASCII without ``"``, ``\\`` or control characters),
  else ``None`` (the caller serialises with :mod:`json`).
- :func:`as_series`: an Arrow array as a pandas ``str`` Series (no copy).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["arrow_text", "as_series", "blank_positions", "duplicate_positions", "json_list_sha256", "strip"]


def arrow_text(values) -> pa.LargeStringArray | None:
    """``values`` (a pandas Series / array of text, or an Arrow string array) as one Arrow
    ``large_string`` array, or ``None`` when it is not text without missing values."""
    if isinstance(values, pd.Series):
        values = values.array
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        arr = values
    elif isinstance(getattr(values, "dtype", None), pd.StringDtype) and values.dtype.storage in ("pyarrow", "pyarrow_numpy"):
        arr = pa.array(values)
    else:
        return None
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)) or arr.null_count:
        return None
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    return arr.cast(pa.large_string()) if pa.types.is_string(arr.type) else arr


def strip(arr: pa.Array) -> pa.LargeStringArray:
    """``str.strip()`` of every value (the same characters as Python's)."""
    return pc.utf8_trim_whitespace(arr)


def blank_positions(stripped: pa.Array) -> np.ndarray:
    """Positions of empty values in an already stripped array (int64)."""
    return np.flatnonzero(pc.equal(pc.binary_length(stripped), 0).to_numpy(zero_copy_only=False))


def duplicate_positions(arr: pa.Array) -> np.ndarray:
    """Positions of every value that occurs more than once (empty when all are unique)."""
    if len(pc.unique(arr)) == len(arr):  # the usual answer, a quarter cheaper than encoding every row
        return np.empty(0, dtype=np.int64)
    codes = pc.dictionary_encode(arr).indices.to_numpy()
    counts = np.bincount(codes)
    if counts.size == len(arr):
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(counts[codes] > 1)


def json_list_sha256(arr: pa.Array) -> str | None:
    """sha256 hex of ``json.dumps([...values], separators=(",", ":"))`` (ASCII escaping, as json's
    default), from the Arrow buffers; ``None`` when a value would need escaping."""
    n = len(arr)
    if n == 0:
        return hashlib.sha256(b"[]").hexdigest()
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset: arr.offset + n + 1]
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)[offsets[0]: offsets[-1]]
    if np.any((data < 0x20) | (data >= 0x80) | (data == 0x22) | (data == 0x5C)):
        return None
    joined = pc.binary_join(pa.LargeListArray.from_arrays(pa.array([0, n], pa.int64()), arr),
                            pa.scalar('","', pa.large_string()))[0].as_buffer()
    sha = hashlib.sha256(b'["')
    sha.update(joined)
    sha.update(b'"]')
    return sha.hexdigest()


def as_series(arr: pa.Array, name: str | None = None) -> pd.Series:
    """An Arrow string array as the pandas Series Parquet text reads as (pandas 3: the Arrow-backed
    ``str`` dtype, no copy; older pandas: Python objects)."""
    out = arr.to_pandas()
    out.name = name
    return out
