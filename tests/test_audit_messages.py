"""The leakage audit's messages format only the ids they report (no per-id Python formatting
over a million rows), and its lazy uniques equal eager formatting."""

from __future__ import annotations

import numpy as np


# ----------------------------------------------------------------------------------------------
# leakage audit: no per-id Python formatting


def test_audit_composite_key_formats_only_reported_ids(monkeypatch):
    """1M rows, composite tile key (slide, tile), no leakage: ids are formatted only when shown.

    Before the fix every one of the 1M unique composite ids was formatted in a Python loop
    (2M ``_id`` (then ``_py``) calls, ~3.5 s); now the count does not grow with the number of rows.
    """
    from types import SimpleNamespace

    from cachescore.probe import audit

    n = 1_000_000
    slide_of = np.arange(n) // 100
    slides = np.array([f"slide{v}" for v in range(n // 100)], dtype=object)[slide_of]
    tile = np.arange(n) % 100
    patient = slides  # one patient per slide is enough here
    order = np.random.default_rng(0).permutation(n // 100)
    train_slides, val_slides, test_slides = order[: n // 200], order[n // 200 : 3 * n // 400], order[3 * n // 400 :]
    rows = {name: np.flatnonzero(np.isin(slide_of, sel)) for name, sel in
            (("train", train_slides), ("val", val_slides), ("test", test_slides))}
    outcome = SimpleNamespace(replicate=0, split=0, seed=1, train_rows=rows["train"], val_rows=rows["val"],
                              test_rows=rows["test"])
    calls = []
    real = audit._id

    def counting(v):
        calls.append(1)
        return real(v)

    monkeypatch.setattr(audit, "_id", counting)
    report = audit.audit_sweep([outcome], n_rows=n, groups={"slide": slides, "patient": patient},
                               tile_ids=(slides, tile), require_class_coverage=False)
    assert report["passed"] is True
    assert len(calls) < 1000, len(calls)


def test_lazy_uniques_equal_eager_formatting():
    """The lazily formatted ids equal the eagerly built JSON-safe lists, code by code."""
    from cachescore.probe import audit

    rng = np.random.default_rng(1)
    for _ in range(20):
        n = int(rng.integers(1, 300))
        pool = [rng.integers(0, 20, n), np.array([f"s{v}" for v in rng.integers(0, 7, n)], dtype=object),
                rng.integers(0, 3, n).astype(np.int32)]
        parts = [pool[i] for i in rng.choice(3, size=int(rng.integers(1, 4)))]
        codes, uniques = audit._factorize_key(parts)
        facts = [pd_factorize(p) for p in parts]
        rows_key = np.stack([f[0] for f in facts], axis=1)
        if len(parts) == 1:
            expect_uniques = [audit._id(u) for u in facts[0][1]]
            expect_codes = facts[0][0]
        else:  # lexicographic order of the per-part first-appearance codes
            uniq_rows, expect_codes = np.unique(rows_key, axis=0, return_inverse=True)
            expect_uniques = [[audit._id(facts[j][1][r[j]]) for j in range(len(parts))] for r in uniq_rows]
        np.testing.assert_array_equal(codes, np.asarray(expect_codes).reshape(-1))
        assert len(uniques) == len(expect_uniques)
        assert [uniques[i] for i in range(len(uniques))] == expect_uniques
        assert uniques[np.int64(0)] == expect_uniques[0] and uniques[-1] == expect_uniques[-1]


def pd_factorize(p):
    import pandas as pd

    c, u = pd.factorize(pd.Series(p), sort=False)
    return c.astype(np.int64), list(u)
