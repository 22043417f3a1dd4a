"""cachescore.store.fingerprint: sha256 of canonical JSON.

Pins: the digest equals hashlib's sha256 of the canonical text written out by hand; key order,
numpy scalar/array types, tuples vs lists and Paths do not change it; content does; objects with
no stable content and non-finite floats are refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cachescore.store import canonical_json, fingerprint


def test_matches_hand_written_canonical_json():
    text = '{"a":1,"b":[1,2.5,"x",null,true],"c":{"d":"é"}}'
    expected = hashlib.sha256(text.encode("utf-8")).hexdigest()
    obj = {"c": {"d": "é"}, "b": (1, 2.5, "x", None, True), "a": 1}
    assert canonical_json(obj) == text
    assert fingerprint(obj) == expected


def test_key_order_and_numpy_types_do_not_matter():
    a = {"k": [5, 11], "alpha": 0.1, "m": 5, "nested": {"z": 1, "y": [True, "s"]}, "p": "/x/y"}
    b = {"nested": {"y": (np.bool_(True), np.str_("s")), "z": np.int8(1)}, "p": Path("/x/y"),
         "m": np.int64(5), "alpha": np.float64(0.1), "k": np.array([5, 11], dtype=np.int32)}
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint({1: "a"}) == fingerprint({"1": "a"}) == fingerprint({np.int64(1): "a"})
    assert fingerprint({"s": {3, 1, 2}}) == fingerprint({"s": [1, 2, 3]})


def test_content_changes_the_fingerprint():
    base = {"encoder": "enc0", "k": [5, 11], "alpha": 0.1}
    assert fingerprint(base) != fingerprint({**base, "k": [5, 12]})
    assert fingerprint(base) != fingerprint({**base, "alpha": 0.10000001})
    assert fingerprint(1) != fingerprint(1.0)  # documented: JSON 1 vs 1.0
    assert fingerprint(np.float32(0.1)) == fingerprint(float(np.float32(0.1))) != fingerprint(0.1)


def test_dataclasses_are_fields():
    @dataclass(frozen=True)
    class P:
        k: int
        name: str

    assert fingerprint(P(3, "x")) == fingerprint({"name": "x", "k": 3})


def test_refused_inputs():
    with pytest.raises(ValueError, match="non-finite"):
        fingerprint({"tau": float("nan")})
    with pytest.raises(ValueError, match="non-finite"):
        fingerprint(np.array([1.0, np.inf]))
    with pytest.raises(TypeError, match="cannot fingerprint an object of type object"):
        fingerprint({"x": object()})
    with pytest.raises(TypeError, match="mapping key of type tuple"):
        fingerprint({(1, 2): 3})
    with pytest.raises(ValueError, match="collide"):
        fingerprint({1: "a", "1": "b"})
