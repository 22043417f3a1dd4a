"""A small synthetic cache whose encoders differ in confounder strength by construction.

Design: 2 labels (``tumor``, ``normal``) x 3 centres (``A``, ``B``, ``C``); each slide (group) has
one label and one centre and ``tiles_per_slide`` tiles. A tile embedding is

    x = label_scale * u[label] + s_e * v[centre] + slide_scale * w[slide] + noise

with unit directions ``u``, ``v``, ``w`` drawn once (shared by all encoders) and the confounder
scale ``s_e`` strictly increasing with the encoder index: ``enc0`` is the weakest confounder,
``enc{n-1}`` the strongest. The ranking is recorded in ``cache.json``.

Views: ``centre_all`` (every tile once, design ``all``) and ``centre_paired`` (design
``paired_2x2``: one subset per pair of centres, holding both labels of both centres, so every tile
appears in two subsets).
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from ..store.atomic import atomic_write_json
from .writer import write_embeddings, write_tileset, write_view

__all__ = ["make_demo_cache", "DEMO_TILESET", "DEMO_VIEWS"]

#: Name of the one tileset of the demo cache.
DEMO_TILESET = "demo"
#: Views of the demo cache: name -> design.
DEMO_VIEWS = {"centre_all": "all", "centre_paired": "paired_2x2"}
_LABELS = ("tumor", "normal")
_CENTRES = ("A", "B", "C")


def make_demo_cache(
    root,
    *,
    n_slides_per_cell: int = 3,
    tiles_per_slide: int = 12,
    dim: int = 32,
    encoders: int | Sequence[str] = 4,
    seed: int = 0,
    label_scale: float = 1.0,
    confounder_scales: Sequence[float] | None = None,
    slide_scale: float = 0.3,
    noise: float = 1.0,
    dtype="float32",
    overwrite: bool = False,
) -> Path:
    """Write the demo cache into ``root`` and return ``root``.

    ``encoders`` is a count (names ``enc0``…) or a list of names, at least 2, ordered from weakest
    to strongest confounder. ``confounder_scales`` (strictly increasing, one per encoder) defaults
    to ``linspace(0, 2.5 * label_scale, n)``. Same arguments ⇒ same bytes. Rows:
    ``2 * 3 * n_slides_per_cell * tiles_per_slide`` tiles.

    Raises ``ValueError`` for sizes < 1, fewer than 2 encoders or non-increasing scales, and
    ``FileExistsError`` if ``root`` already holds a cache and not ``overwrite``.
    """
    names = [f"enc{i}" for i in range(int(encoders))] if isinstance(encoders, (int, np.integer)) else [str(e) for e in encoders]
    if len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(f"encoders must name at least 2 distinct encoders, got {names}")
    for arg, value in (("n_slides_per_cell", n_slides_per_cell), ("tiles_per_slide", tiles_per_slide), ("dim", dim)):
        if int(value) < 1:
            raise ValueError(f"{arg} must be >= 1, got {value}")
    scales = (np.linspace(0.0, 2.5 * label_scale, len(names)) if confounder_scales is None
              else np.asarray(confounder_scales, dtype=np.float64))
    if scales.shape != (len(names),) or np.any(np.diff(scales) <= 0):
        raise ValueError(f"confounder_scales must be strictly increasing, one per encoder; got {list(scales)}")
    root = Path(root)
    if (root / "cache.json").exists() and not overwrite:
        raise FileExistsError(f"{root} already holds a cache; pass overwrite=True to replace it")

    rng = np.random.default_rng(seed)
    slides = [(lab, cen, f"{cen}-{lab}-s{j}") for lab in _LABELS for cen in _CENTRES for j in range(int(n_slides_per_cell))]
    t = int(tiles_per_slide)
    label = np.repeat([s[0] for s in slides], t)
    centre = np.repeat([s[1] for s in slides], t)
    group = np.repeat([s[2] for s in slides], t)
    tile = np.tile(np.arange(t), len(slides))
    sample_id = np.asarray([f"{g}-t{k:03d}" for g, k in zip(group, tile)], dtype=object)
    tiles = pd.DataFrame({
        "sample_id": sample_id,
        "image_path": [f"slides/{g}.svs#tile{k:03d}" for g, k in zip(group, tile)],
        "group_id": group, "label": label, "centre": centre,
    })
    n = len(tiles)

    def unit(rows: int) -> np.ndarray:
        m = rng.standard_normal((rows, int(dim)))
        return m / np.linalg.norm(m, axis=1, keepdims=True)

    u, v, w = unit(len(_LABELS)), unit(len(_CENTRES)), unit(len(slides))
    lab_code = pd.Index(_LABELS).get_indexer(label)
    cen_code = pd.Index(_CENTRES).get_indexer(centre)
    slide_code = np.repeat(np.arange(len(slides)), t)
    base = label_scale * u[lab_code] + slide_scale * w[slide_code]

    write_tileset(root, DEMO_TILESET, tiles, overwrite=overwrite)
    for name, scale in zip(names, scales):
        x = base + scale * v[cen_code] + noise * rng.standard_normal((n, int(dim)))
        write_embeddings(root, name, DEMO_TILESET, x.astype(dtype), overwrite=overwrite)

    view_all = tiles[["sample_id", "label", "group_id", "centre"]]
    write_view(root, "centre_all", view_all, tileset=DEMO_TILESET, confounder_column="centre",
               design="all", overwrite=overwrite)
    parts = []
    for a, b in combinations(_CENTRES, 2):
        part = view_all[view_all["centre"].isin([a, b])].copy()
        part["subset"] = f"{a}|{b}"
        parts.append(part)
    write_view(root, "centre_paired", pd.concat(parts, ignore_index=True), tileset=DEMO_TILESET,
               confounder_column="centre", design="paired_2x2", overwrite=overwrite)
    atomic_write_json(root / "cache.json", {
        "kind": "cachescore-demo",
        "seed": int(seed),
        "tileset": DEMO_TILESET,
        "views": DEMO_VIEWS,
        "encoders": names,
        "confounder_scales": {nm: float(s) for nm, s in zip(names, scales)},
        "intended_confounder_ranking": names,
        "ranking_note": "weakest to strongest confounder by construction: robustness (RI, MaRI, CRoMa) should decrease along this list",
    }, overwrite=True)
    return root
