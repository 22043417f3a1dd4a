"""cachescore.cache.make_demo_cache: the demo cache's structure and its ranking by construction.

Pins: >= 4 encoders, one tileset, views ``centre_all`` (design all) and ``centre_paired``
(complete 2x2 subsets, tiles repeated across subsets), the intended ranking in ``cache.json``,
determinism for a seed, and that the oracle (croma 1.0.1) ranks the encoders as intended.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachescore.cache import Cache, make_demo_cache


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return Cache(make_demo_cache(tmp_path_factory.mktemp("demo") / "cache"))


def test_structure(demo):
    assert demo.encoders() == ["enc0", "enc1", "enc2", "enc3"]
    assert demo.tilesets() == ["demo"]
    assert demo.views() == ["centre_all", "centre_paired"]
    info = demo.info()
    assert info["intended_confounder_ranking"] == ["enc0", "enc1", "enc2", "enc3"]
    scales = [info["confounder_scales"][e] for e in info["intended_confounder_ranking"]]
    assert scales == sorted(scales) and len(set(scales)) == 4
    assert demo.view_spec("centre_all").design == "all"
    assert demo.view_spec("centre_paired").design == "paired_2x2"
    for enc in demo.encoders():
        demo.validate_embeddings(enc, "demo")

    full = demo.read_view("centre_all")
    assert len(full) == 2 * 3 * 3 * 12 and full["sample_id"].is_unique
    paired = demo.read_view("centre_paired")
    assert paired["sample_id"].duplicated().any(), "tiles repeat across subsets"
    for subset, part in paired.groupby("subset"):
        cells = part.groupby(["label", "centre"]).size()
        assert len(cells) == 4 and part["label"].nunique() == 2 and part["centre"].nunique() == 2, subset
        assert part["sample_id"].is_unique


def test_deterministic(tmp_path):
    a = Cache(make_demo_cache(tmp_path / "a", seed=3, n_slides_per_cell=2, tiles_per_slide=4, dim=8))
    b = Cache(make_demo_cache(tmp_path / "b", seed=3, n_slides_per_cell=2, tiles_per_slide=4, dim=8))
    c = Cache(make_demo_cache(tmp_path / "c", seed=4, n_slides_per_cell=2, tiles_per_slide=4, dim=8))
    for enc in a.encoders():
        assert a.embedding_fingerprint(enc, "demo") == b.embedding_fingerprint(enc, "demo")
        assert a.embedding_fingerprint(enc, "demo") != c.embedding_fingerprint(enc, "demo")
    assert a.view_fingerprint("centre_paired") == b.view_fingerprint("centre_paired")
    with pytest.raises(FileExistsError):
        make_demo_cache(tmp_path / "a")
    with pytest.raises(ValueError, match="strictly increasing"):
        make_demo_cache(tmp_path / "d", confounder_scales=[0, 1, 1, 2])


@pytest.mark.filterwarnings("ignore:.*support is.*:RuntimeWarning")  # croma warns on partial RI support
@pytest.mark.parametrize(("view", "design"), [("centre_all", "all"), ("centre_paired", "paired_2x2")])
def test_oracle_ranks_encoders_as_intended(demo, view, design):
    import croma

    frame = demo.read_view(view)
    values = []
    for enc in demo.info()["intended_confounder_ranking"]:
        x = demo.view_embeddings(enc, view).compute(scheduler="sync")
        values.append(croma.RI.compute(x, frame, confounder_column="centre", k_candidates=[5, 11, 21],
                                       evaluation_design=design).value)
    assert all(np.diff(values) < 0), values
