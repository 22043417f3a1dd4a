"""Explicit pyarrow schemas of the results store tables, and record <-> row conversion.

A unit record (one JSON file per fingerprint) becomes one row of :data:`SCORES_SCHEMA`. Keys of
the record that are not columns are kept, as canonical JSON, in the ``extra`` column; ``params``
is stored as canonical JSON text. Missing keys are null (never a made-up default).
"""

from __future__ import annotations

from datetime import datetime, timezone

import pandas as pd
import pyarrow as pa

from ..fingerprint import canonical_json

__all__ = [
    "RECORD_VERSION",
    "STORE_LAYOUT_VERSION",
    "SCORES_SCHEMA",
    "FAILURES_SCHEMA",
    "STRING_FIELDS",
    "FLOAT_FIELDS",
    "INT_FIELDS",
    "record_to_row",
    "rows_to_frame",
    "failure_to_row",
    "utc_now",
]

#: Version of the unit/failure record envelope written by this code; records of any other version
#: are ignored (their units are recomputed, never converted). 2: ``support`` became the fraction of
#: defined units (float64; it was an integer count in version 1).
RECORD_VERSION = 2

#: Version of the store folder layout (``store.json``); independent of :data:`RECORD_VERSION`, so a
#: record-version bump recomputes units inside an existing store instead of refusing the folder.
STORE_LAYOUT_VERSION = 1

#: Text columns of the scores table.
STRING_FIELDS = ("encoder", "view", "tileset", "scope", "design", "family", "metric", "params",
                 "unit", "fingerprint", "run_id", "code_version", "backend", "extra")
#: Float columns of the scores table.
#: ``support`` is the fraction of defined units in [0, 1] (``RobustnessResult.support``; 1.0 for
#: CRoMa, which enforces total support); the count of defined units is ``n_defined``.
FLOAT_FIELDS = ("value", "std", "q_alpha", "ltm_alpha", "f0", "support", "tau", "recall", "seconds")
#: Integer columns of the scores table.
INT_FIELDS = ("k", "m", "n_units", "n_defined")

_ORDER = ("fingerprint", "encoder", "view", "tileset", "scope", "design", "family", "metric", "params",
          "value", "std", "q_alpha", "ltm_alpha", "f0", "support", "k", "tau", "m", "recall",
          "n_units", "n_defined", "unit", "backend", "run_id", "code_version", "seconds", "finished_at", "extra")


def _type(name: str) -> pa.DataType:
    if name in STRING_FIELDS:
        return pa.string()
    if name in FLOAT_FIELDS:
        return pa.float64()
    if name in INT_FIELDS:
        return pa.int64()
    if name == "finished_at":
        return pa.timestamp("us", tz="UTC")
    raise KeyError(name)


#: Schema of :meth:`ResultsStore.scores` (one row per stored unit record).
SCORES_SCHEMA = pa.schema([pa.field(name, _type(name)) for name in _ORDER])

#: Schema of :meth:`ResultsStore.failures` (one row per failed unit without a later success).
FAILURES_SCHEMA = pa.schema([
    pa.field("fingerprint", pa.string()),
    pa.field("encoder", pa.string()),
    pa.field("view", pa.string()),
    pa.field("scope", pa.string()),
    pa.field("family", pa.string()),
    pa.field("metric", pa.string()),
    pa.field("unit", pa.string()),
    pa.field("error", pa.string()),
    pa.field("run_id", pa.string()),
    pa.field("failed_at", pa.timestamp("us", tz="UTC")),
])


def utc_now() -> str:
    """Current UTC time as ISO 8601 with microseconds and ``+00:00``."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _ts(value) -> datetime | None:
    if value is None:
        return None
    ts = pd.Timestamp(value)
    ts = ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")
    return ts.to_pydatetime()


def _text(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return canonical_json(value)


def _float(value) -> float | None:
    if value is None:
        return None
    return float(value)  # NaN allowed in the table (e.g. an undefined metric value)


def _int(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, bool) or int(value) != value:
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def record_to_row(record: dict, *, fingerprint: str, finished_at: str) -> dict:
    """One scores row from a unit record (raises ``ValueError``/``TypeError`` on a wrong type)."""
    row: dict = {}
    extra = {}
    for key, value in record.items():
        if key in ("fingerprint", "finished_at"):
            continue
        if key in STRING_FIELDS and key != "extra":
            row[key] = _text(value)
        elif key in FLOAT_FIELDS:
            row[key] = _float(value)
            if key == "support" and row[key] is not None and not (0.0 <= row[key] <= 1.0 or row[key] != row[key]):
                raise ValueError(f"support must be a fraction in [0, 1] (the count goes in n_defined), got {value!r}")
        elif key in INT_FIELDS:
            row[key] = _int(value)
        else:
            extra[key] = value
    row["fingerprint"] = fingerprint
    row["finished_at"] = _ts(record.get("finished_at", finished_at))
    row["extra"] = canonical_json(extra) if extra else None
    return row


def failure_to_row(envelope: dict) -> dict:
    unit = envelope.get("unit") or {}
    return {
        "fingerprint": envelope["fingerprint"],
        **{k: (None if unit.get(k) is None else str(unit.get(k))) for k in ("encoder", "view", "scope", "family", "metric")},
        "unit": canonical_json(unit),
        "error": str(envelope.get("error")),
        "run_id": None if unit.get("run_id") is None else str(unit.get("run_id")),
        "failed_at": _ts(envelope.get("failed_at")),
    }


def _mapper(t: pa.DataType):
    return pd.Int64Dtype() if pa.types.is_integer(t) else None


def rows_to_frame(rows: list[dict], schema: pa.Schema) -> pd.DataFrame:
    """A DataFrame with exactly ``schema``'s columns, also when empty: strings as ``str``, floats
    as ``float64`` (null -> NaN), ints as nullable ``Int64``, timestamps as ``datetime64[us, UTC]``."""
    table = pa.Table.from_pylist(rows, schema=schema)
    return table.to_pandas(types_mapper=_mapper)
