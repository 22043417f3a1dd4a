"""Pins cachescore.neighbors.shared: one exact engine shared by a score batch's units (ADR-0018).

A repeated cross-group search (same rows, codes, kmax: what RI and MaRI of one view ask) is
answered from the first call; anything else is searched afresh; answers equal the kernel's and
are the caller's own copies; ``typed`` is the exact kernel itself (CRoMa fuses its schedule count).
"""

from __future__ import annotations

import numpy as np
import pytest

from cachescore import RI, MaRI
from cachescore.cache import Cache, make_demo_cache
from cachescore.neighbors.exact import cross_group_knn
from cachescore.neighbors.exact_search import ExactSearch
from cachescore.neighbors.shared import SharedSearch, shareable
from cachescore.neighbors.typed import typed_knn


def _rows(seed: int, n: int = 120, d: int = 8):
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((n, d)).astype(np.float32)
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    return u, rng.integers(0, 12, n)


def test_a_repeated_search_is_answered_once_and_others_are_searched_afresh():
    u, g = _rows(0)
    shared = SharedSearch(ExactSearch())
    idx, dist = shared.cross(u, g, 7)
    ref_idx, ref_dist = cross_group_knn(u, g, 7)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(dist, ref_dist)
    idx[:] = -5  # the caller's copy: the next caller still gets the kernel's answer
    again, _ = shared.cross(u.copy(), g.copy(), 7)  # equal content, other objects: a hit
    assert shared.hits == 1
    np.testing.assert_array_equal(again, ref_idx)
    for other in ((u, g, 5), (u, (g + 1) % 12, 7), (_rows(1)[0], g, 7)):  # kmax, codes, rows differ
        got, got_d = shared.cross(*other)
        want, want_d = cross_group_knn(*other)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_d, want_d)
    assert shared.hits == 1
    assert shared.typed is typed_knn and shared.schedule_diagnostics
    assert np.isnan(shared.recall) and shared.details == []


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # low support on a tiny cache
def test_ri_and_mari_through_one_shared_engine_equal_their_own_compute(tmp_path):
    root = make_demo_cache(tmp_path / "cache", n_slides_per_cell=3, tiles_per_slide=8, dim=16, encoders=2, seed=3)
    cache = Cache(root)
    for view, design in (("centre_all", "all"), ("centre_paired", "paired_2x2")):
        frame = cache.read_view(view)
        x = cache.load_rows("enc1", "demo", frame["row"].to_numpy())
        kw = dict(confounder_column="centre", k_candidates=[3, 5], evaluation_design=design)
        shared = SharedSearch(ExactSearch())
        ri = RI.compute_with(shared.cross, x, frame, **kw)
        mari = MaRI.compute_with(shared.cross, x, frame, tau=None, warn_tau=False, **kw)
        assert shared.hits >= 1  # MaRI's searches were RI's
        assert ri.value == RI.compute(x, frame, **kw).value
        assert mari.value == MaRI.compute(x, frame, tau=None, warn_tau=False, **kw).value


def test_only_in_memory_exact_engines_are_shared():
    assert shareable({"backend": "exact"}) and shareable({})
    assert not shareable({"backend": "ann", "recall_target": 0.9})
    assert not shareable({"backend": "exact", "engine": "distributed", "seed": 0})
