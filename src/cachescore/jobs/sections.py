"""Typed job sections: one frozen dataclass per job-file table, built from its declared keys.

Each field of a section class carries its :class:`~cachescore._keys.Key` (type, default, doc and
value check) in ``metadata["key"]``; :func:`cachescore.jobs.schema.parse_job` is the one validator
that checks a table against those keys and builds the section, and code reads the section's
attributes (``job.execution.retries``), never a key with a fallback default. :func:`as_dict`
turns a section back into the plain table (for the layers below ``jobs``, which take settings as
mappings, and for provenance).
"""

from __future__ import annotations

import copy
from dataclasses import field, fields, is_dataclass, make_dataclass
from typing import Any

from .._keys import NUM, Key

__all__ = ["section_class", "as_dict", "key_of"]


def _annotation(types: tuple) -> Any:
    if types == NUM or types == (int, float):
        return float
    return types[0] if len(types) == 1 else Any


def _field(key: Key, table: str):
    meta = {"key": key, "table": table}
    if key.default is None:  # required: parse_job names it when missing
        return field(metadata=meta)
    if isinstance(key.default, (list, dict)):
        return field(default_factory=lambda d=key.default: copy.deepcopy(d), metadata=meta)
    return field(default=key.default, metadata=meta)


def section_class(name: str, table: str, keys: dict[str, Key], *, module: str, extra: tuple = ()) -> type:
    """A frozen, keyword-only dataclass ``name`` for the job-file table ``[table]`` with one field
    per key of ``keys`` (its :class:`Key` in the field's metadata) and the ``extra`` fields
    (``(name, type, dataclasses.field(...))``: nested sections). ``module`` is where the class is
    bound to a name, so sections pickle like any module-level class."""
    spec = [(k, _annotation(key.type), _field(key, table)) for k, key in keys.items()] + list(extra)
    cls = make_dataclass(name, spec, frozen=True, kw_only=True)
    cls.__module__ = module
    cls.__qualname__ = name
    cls.__doc__ = (f"The ``[{table}]`` table of a job file, validated (keys: "
                   + ", ".join(f"``{k}``" for k in keys) + "; each field's ``metadata['key']`` declares it).")
    return cls


def key_of(section_cls: type, name: str) -> Key:
    """The :class:`Key` declaring field ``name`` of a section class."""
    return next(f.metadata["key"] for f in fields(section_cls) if f.name == name)


def as_dict(section) -> dict:
    """The plain table of a section (nested sections as nested dicts; lists and dicts copied)."""
    out = {}
    for f in fields(section):
        v = getattr(section, f.name)
        out[f.name] = as_dict(v) if is_dataclass(v) and not isinstance(v, type) else copy.deepcopy(v)
    return out
