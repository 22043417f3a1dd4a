"""Declared configuration keys: a :class:`Key` (type, default, doc, value check) and the checks.

Layer 0: the job schema (:mod:`cachescore.jobs.schema`) and the metric-family table
(:mod:`cachescore.metrics.families`, whose families declare their own ``[metrics.<name>]`` keys)
share these, so a family's keys are validated exactly like every other key of a job file.

A check takes the value (already of one of ``Key.type``) and returns ``None`` when it is fine, or
the text of what was expected ("a positive integer"), which the validator puts into its error
message together with the file and the dotted key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Key", "NUM", "positive_int", "non_negative_int", "int_list", "str_list", "one_of", "tau", "open_unit",
           "half_open_unit", "growth", "positive_number", "non_empty"]

#: ``Key.type`` of a number key (an integer is accepted where a float is meant).
NUM = (int, float)


@dataclass(frozen=True)
class Key:
    """One configuration key: expected type(s), default (``None`` = required), a one-line
    description and an optional value check (see the module docstring)."""

    type: tuple
    default: Any
    doc: str
    check: Callable[[Any], str | None] | None = None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def positive_int(v):
    return None if _is_int(v) and v > 0 else "a positive integer"


def non_negative_int(v):
    return None if _is_int(v) and v >= 0 else "an integer >= 0"


def int_list(v):
    if not isinstance(v, list) or not v or any(not _is_int(x) or x <= 0 for x in v):
        return "a non-empty list of positive integers"
    return None


def str_list(v):
    if not isinstance(v, list) or any(not isinstance(x, str) or not x.strip() for x in v):
        return "a list of non-empty strings"
    if len(set(v)) != len(v):
        return "a list without duplicates"
    return None


def one_of(options):
    """A check accepting exactly ``options``."""
    def check(v):
        return None if v in options else "one of " + ", ".join(repr(o) for o in options)

    return check


def tau(v):
    if v == "auto":
        return None
    return None if _is_num(v) and math.isfinite(v) and v > 0 else "'auto' or a finite number > 0"


def open_unit(v):
    return None if _is_num(v) and 0 < v < 1 else "a number in (0, 1)"


def half_open_unit(v):
    return None if _is_num(v) and 0 < v <= 1 else "a number in (0, 1]"


def growth(v):
    return None if _is_num(v) and math.isfinite(v) and v > 1 else "a finite number > 1"


def positive_number(v):
    return None if _is_num(v) and math.isfinite(v) and v > 0 else "a finite number > 0"


def non_empty(v):
    return None if isinstance(v, str) and v.strip() else "a non-empty string"
