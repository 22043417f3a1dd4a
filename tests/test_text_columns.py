"""Text columns kept in Arrow (cache/text.py) give exactly what the Python-string path gives:
the same stripped ids, blanks, duplicates and sample-id digest."""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from cachescore.cache import text
from cachescore.cache.errors import ViewError
from cachescore.cache.importer import _joined
from cachescore.cache.writer import blank_rows, duplicate_rows, normalize_ids, normalized_text, sample_ids_digest


def _json_sha(values) -> str:
    return hashlib.sha256(json.dumps([str(v) for v in values], separators=(",", ":")).encode("utf-8")).hexdigest()


def test_arrow_strip_removes_exactly_what_python_strip_removes_over_every_code_point():
    chars = [chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000]
    values = [f"{c}a{c}" for c in chars]
    stripped = text.strip(pa.array(values, type=pa.large_string())).to_pylist()
    differ = [hex(ord(c)) for c, got, v in zip(chars, stripped, values) if got != v.strip()]
    assert differ == []
    # and the whitespace characters Python knows are really stripped (not a vacuous agreement)
    spaces = [c for c in chars if c.isspace()]
    assert len(spaces) == 29 and all(got == "a" for c, got in zip(chars, stripped) if c.isspace())


@pytest.mark.parametrize("values", [
    ["s1:0_0", "s1:224_0", "slide B:1_2"],
    ["quote\"d", "back\\slash", "tab\there", "ünïcode", "emoji 🧫", "ctrl\x01", "del\x7f"],
    [],
    ["x"],
])
def test_the_sample_id_digest_is_json_dumps_whatever_the_container(values):
    expected = _json_sha(values)
    arrow = pa.array(values, type=pa.large_string())
    assert sample_ids_digest(np.asarray(values, dtype=object)) == expected
    assert sample_ids_digest(text.as_series(arrow)) == expected
    assert sample_ids_digest(arrow) == expected
    assert sample_ids_digest(arrow.cast(pa.string())) == expected
    if values:  # a slice has an offset into the buffers
        assert sample_ids_digest(arrow.slice(1)) == _json_sha(values[1:])


def test_the_buffer_digest_declines_what_json_would_escape():
    assert text.json_list_sha256(pa.array(["ok", "fine"], type=pa.large_string())) == _json_sha(["ok", "fine"])
    for odd in ('a"b', "a\\b", "a\nb", "é"):
        assert text.json_list_sha256(pa.array(["ok", odd], type=pa.large_string())) is None


def test_normalised_text_matches_the_python_path_and_names_blank_rows():
    raw = ["  a ", "b\u3000", "\tc", "d"]
    arrow_series = pd.Series(raw, dtype="string[pyarrow]")
    object_series = pd.Series(raw, dtype=object)
    assert list(normalized_text(arrow_series, source="m")) == ["a", "b", "c", "d"]
    assert list(normalize_ids(object_series, source="m")) == ["a", "b", "c", "d"]
    assert text.arrow_text(normalized_text(arrow_series, source="m")) is not None  # stayed in Arrow
    for series in (pd.Series(["a", "  ", "b"], dtype="string[pyarrow]"), pd.Series(["a", None, "b"], dtype=object)):
        with pytest.raises(ViewError, match=r"column 'sample_id' has missing or blank values at rows \[1\]"):
            normalized_text(series, source="m")
    assert list(blank_rows(pd.Series(["x", " ", "y", "\t"], dtype="string[pyarrow]"))) == [1, 3]
    assert list(blank_rows(pd.Series(["x", None, "y", "\t"], dtype=object))) == [1, 3]


def test_duplicate_rows_are_the_same_in_arrow_and_pandas():
    values = ["a", "b", "a", "c", "b", "d"]
    assert list(duplicate_rows(pd.Series(values, dtype="string[pyarrow]"))) == [0, 1, 2, 4]
    assert list(duplicate_rows(pd.Series(values, dtype=object))) == [0, 1, 2, 4]
    assert duplicate_rows(pd.Series(["a", "b"], dtype="string[pyarrow]")).size == 0


def test_joined_ids_are_what_string_concatenation_gives():
    slides = pa.array(["s1", "s1", "s 2"], type=pa.large_string())
    ints = np.array([0, -224, 10**12], dtype=np.int64)
    floats = np.array([0.5, 2.0, 1e20])
    got = _joined(slides, ":", ints, "_", floats).to_pylist()
    expected = [f"{s}:{i}_{f}" for s, i, f in zip(slides.to_pylist(), ints.tolist(), floats.tolist())]
    assert got == expected == ["s1:0_0.5", "s1:-224_2.0", "s 2:1000000000000_1e+20"]
