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

:func:`make_scale_cache` writes caches of any size (1,000,000 × 768 included) with the structure
of real foundation-model embeddings (morphology clusters shared across slides, low intrinsic
dimension), streamed to disk with bounded memory; see its docstring.
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from .._threads import single_thread_blas
from .._atomic import atomic_write_json
from .writer import write_embeddings, write_embeddings_blocks, write_tileset, write_view

__all__ = ["make_demo_cache", "DEMO_TILESET", "DEMO_VIEWS", "make_scale_cache", "SCALE_TILESET", "SCALE_VIEWS"]

#: Name of the one tileset of the demo cache.
DEMO_TILESET = "demo"
#: Views of the demo cache: name -> design.
DEMO_VIEWS = {"centre_all": "all", "centre_paired": "paired_2x2"}
_LABELS = ("tumor", "normal")
_CENTRES = ("A", "B", "C")


def _paired_view(view_all: pd.DataFrame, centres) -> pd.DataFrame:
    """``paired_2x2`` rows: one subset ``"a|b"`` per pair of centres, holding every row of both
    (a row appears once per subset it belongs to)."""
    parts = []
    for a, b in combinations(centres, 2):
        part = view_all[view_all["centre"].isin([a, b])].copy()
        part["subset"] = f"{a}|{b}"
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


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
    write_view(root, "centre_paired", _paired_view(view_all, _CENTRES), tileset=DEMO_TILESET,
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


# --------------------------------------------------------------------------------------------
# Scale cache: realistic (clustered, low intrinsic dimension) structure, streamed to disk

#: Name of the one tileset of a scale cache.
SCALE_TILESET = "tiles"
#: Views of a scale cache: name -> design (``paired_2x2`` only with ``paired_view=True``).
SCALE_VIEWS = {"scale_all": "all", "paired_2x2": "paired_2x2"}
#: Rows drawn per random stream. Every random draw of a tile comes from the stream of the fixed
#: block of :data:`_GEN_BLOCK` rows that holds it (seeded by ``(seed, stream, block)``), so a row's
#: bytes never depend on how the writer chunks the array.
_GEN_BLOCK = 4096
#: Norms of the components of a tile embedding (before the encoder-dependent confounder factor).
#: Prototypes are unit vectors (~1.1 apart within a family, ~1.4 across); within-morphology
#: variation, label effect, confounder shift, slide offset and noise are chosen so that a tile's
#: nearest cross-group neighbours are same-morphology tiles of other slides and label and
#: confounder compete. Measured on 5,000 x 768 (seed 0, scale 1): 99.8% of cross-group 10-NN share
#: the query's morphology; RI 0.70, MaRI 0.70, CRoMa 0.15 with 17% negative margins.
_SCALE_NORMS = {"within": 0.45, "label": 0.12, "confounder": 0.18, "slide": 0.10, "noise": 0.12}
#: Weight of the family direction in a morphology prototype (morphologies of one family are
#: ``sqrt(2 (1 - w^2))`` apart, of different families ~``sqrt(2)``).
_FAMILY_WEIGHT = 0.6
# random stream ids (the first element after the seed)
_S_GLOBAL, _S_TILE, _S_SLIDE, _S_NOISE = 0, 1, 2, 3


def _unit_rows(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    m = rng.standard_normal((rows, dim))
    return m / np.linalg.norm(m, axis=1, keepdims=True)


class _ScaleModel:
    """The generative model of :func:`make_scale_cache` (global parameters, O(morphologies · dim));
    :meth:`block` draws the rows of one fixed generation block."""

    def __init__(self, *, rows, dim, n_labels, n_confounders, slide_min, slide_max, n_morphologies,
                 intrinsic_dim, seed, confounder_scales):
        self.rows, self.dim, self.seed = int(rows), int(dim), int(seed)
        rng = np.random.default_rng([self.seed, _S_GLOBAL])
        # slides (groups): sizes, one label and one confounder each
        sizes = rng.integers(slide_min, slide_max + 1, size=self.rows // slide_min + 1)
        ends = np.cumsum(sizes)
        n_slides = int(np.searchsorted(ends, self.rows) + 1)
        sizes = sizes[:n_slides].copy()
        sizes[-1] -= int(ends[n_slides - 1] - self.rows)
        self.slide_sizes = sizes
        self.slide_start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.slide_label = rng.integers(0, n_labels, n_slides)
        self.slide_conf = rng.integers(0, n_confounders, n_slides)
        # morphologies: unit prototypes shared by every slide, an orthonormal intrinsic_dim-basis
        # each for the within-morphology variation, label-dependent composition weights
        r = int(min(intrinsic_dim, dim))
        # prototypes are hierarchical, as tissue types split into morphologies: a family direction
        # (ceil(sqrt(M)) families) plus the morphology's own direction, unit norm
        n_fam = int(np.ceil(np.sqrt(n_morphologies)))
        fam = _unit_rows(rng, n_fam, dim)[np.arange(n_morphologies) % n_fam]
        proto = _FAMILY_WEIGHT * fam + np.sqrt(1 - _FAMILY_WEIGHT**2) * _unit_rows(rng, n_morphologies, dim)
        self.prototypes = proto / np.linalg.norm(proto, axis=1, keepdims=True)
        basis = rng.standard_normal((n_morphologies, dim, r))
        self.bases = np.linalg.qr(basis)[0].transpose(0, 2, 1).copy()  # (M, r, dim), orthonormal rows
        self.intrinsic_dim = r
        weights = rng.dirichlet(np.full(n_morphologies, 0.7), size=n_labels)
        self.cdf = np.cumsum(weights, axis=1)
        self.cdf[:, -1] = 1.0
        self.label_dirs = _unit_rows(rng, n_labels, dim)
        self.conf_dirs = _unit_rows(rng, n_confounders, dim)
        self.confounder_scales = np.asarray(confounder_scales, dtype=np.float64)

    def slides_of(self, lo: int, hi: int) -> np.ndarray:
        """Slide index of rows ``lo:hi``."""
        return np.searchsorted(self.slide_start, np.arange(lo, hi), side="right") - 1

    def latent(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Encoder-independent draws of block ``b``: (slide, morphology, within-morphology coordinates)."""
        lo, hi = b * _GEN_BLOCK, min(self.rows, (b + 1) * _GEN_BLOCK)
        slide = self.slides_of(lo, hi)
        rng = np.random.default_rng([self.seed, _S_TILE, b])
        u = rng.random(hi - lo)
        cdf = self.cdf[self.slide_label[slide]]
        morph = np.minimum((u[:, None] > cdf).sum(axis=1), self.cdf.shape[1] - 1)
        z = rng.standard_normal((hi - lo, self.intrinsic_dim)) * (_SCALE_NORMS["within"] / np.sqrt(self.intrinsic_dim))
        return slide, morph, z

    def block(self, b: int, encoder: int, dtype) -> np.ndarray:
        """Rows of block ``b`` for encoder number ``encoder`` as ``dtype`` (computed in float32,
        float64 for a float64 cache)."""
        slide, morph, z = self.latent(b)
        n, d = slide.size, self.dim
        work = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        x = np.empty((n, d), dtype=work)
        order = np.argsort(morph, kind="stable")
        bounds = np.searchsorted(morph[order], np.arange(self.cdf.shape[1] + 1))
        for m in np.flatnonzero(np.diff(bounds)):  # one small GEMM per morphology present
            rows = order[bounds[m] : bounds[m + 1]]
            x[rows] = self.prototypes[m] + z[rows] @ self.bases[m]
        shift = (_SCALE_NORMS["label"] * self.label_dirs[:, None, :]
                 + (_SCALE_NORMS["confounder"] * self.confounder_scales[encoder]) * self.conf_dirs[None, :, :])
        x += shift.astype(work)[self.slide_label[slide], self.slide_conf[slide]]
        present = np.unique(slide)
        offs = np.stack([np.random.default_rng([self.seed, _S_SLIDE, int(s)]).standard_normal(d, dtype=work)
                         for s in present])
        x += work(_SCALE_NORMS["slide"] / np.sqrt(d)) * offs[np.searchsorted(present, slide)]
        noise = np.random.default_rng([self.seed, _S_NOISE, int(encoder), b]).standard_normal((n, d), dtype=work)
        noise *= work(_SCALE_NORMS["noise"] / np.sqrt(d))
        x += noise
        return x.astype(dtype, copy=False)

    def rows_between(self, lo: int, hi: int, encoder: int, dtype) -> np.ndarray:
        """Rows ``lo:hi`` (any range), assembled from the generation blocks covering them."""
        out = np.empty((hi - lo, self.dim), dtype=dtype)
        for b in range(lo // _GEN_BLOCK, (hi - 1) // _GEN_BLOCK + 1 if hi > lo else lo // _GEN_BLOCK):
            s, e = max(lo, b * _GEN_BLOCK), min(hi, (b + 1) * _GEN_BLOCK)
            out[s - lo : e - lo] = self.block(b, encoder, dtype)[s - b * _GEN_BLOCK : e - b * _GEN_BLOCK]
        return out

    def morphology(self) -> np.ndarray:
        """Morphology of every row (int32; O(rows) memory, like the tile table)."""
        out = np.empty(self.rows, dtype=np.int32)
        for b in range((self.rows + _GEN_BLOCK - 1) // _GEN_BLOCK):
            out[b * _GEN_BLOCK : b * _GEN_BLOCK + _GEN_BLOCK] = self.latent(b)[1]
        return out


def make_scale_cache(
    root,
    *,
    rows: int,
    dim: int = 768,
    encoders: Sequence[str] = ("enc0",),
    n_labels: int = 2,
    n_confounders: int = 4,
    slide_min: int = 20,
    slide_max: int = 100,
    n_morphologies: int = 64,
    intrinsic_dim: int = 24,
    seed: int = 0,
    paired_view: bool = False,
    chunk_rows: int = 32768,
    dtype="float32",
    confounder_scales: Sequence[float] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a large synthetic cache of realistic structure into ``root`` and return ``root``.

    Structure (what foundation-model embeddings of pathology tiles look like: strongly clustered,
    low intrinsic dimension, morphologies shared across slides):

    * Slides (``group_id``) of ``slide_min..slide_max`` tiles, each with one label (``class0``…)
      and one confounder value (column ``centre``: ``c0``…), drawn uniformly.
    * ``n_morphologies`` prototypes (unit vectors in ``dim`` dims), shared by all slides and
      grouped in ``ceil(sqrt(n_morphologies))`` families (tissue types: a shared family direction
      plus the morphology's own, so coarse clusters are meaningful too). Each tile
      picks a morphology from label-dependent mixing weights (Dirichlet(0.7) per label), so labels
      differ in composition. The tile's morphology is stored in ``tiles.parquet`` (``morphology``).
    * A tile embedding is ``x = prototype[m] + B_m z + label effect + s_e · confounder shift +
      slide offset + noise``, where ``B_m`` is an orthonormal ``intrinsic_dim``-basis of
      morphology ``m`` and ``z`` its Gaussian coordinates (total norm ~0.45); label effect
      (norm 0.12) and confounder shift (norm 0.18 · ``s_e``) are one direction per label /
      confounder value; the slide offset (norm 0.10) is isotropic per slide; the noise (norm 0.12)
      isotropic per tile. So a tile's nearest cross-group neighbours are mostly same-morphology
      tiles of other slides, and within a morphology label and confounder compete (RI inside
      (0.5, 1), CRoMa margins of both signs).
    * Several ``encoders`` (names, in order) share every tile's morphology, coordinates and slide
      offset and differ in noise and in the confounder factor ``s_e``: ``confounder_scales``
      (one per encoder; default ``1.0`` for one encoder, ``linspace(0.5, 1.5, n)`` otherwise, i.e.
      weakest to strongest confounder).

    Views: ``scale_all`` (every tile once, design ``all``) and, with ``paired_view``,
    ``paired_2x2`` (one subset per pair of confounder values, both labels of both values; every
    tile appears in ``n_confounders - 1`` subsets).

    Embeddings are streamed: ``chunk_rows`` rows per shard and per generation step, so writer
    memory is O(``chunk_rows · dim``) plus the tile table (O(``rows``) strings); 1,000,000 × 768
    float32 works (measured here: 200,000 x 768 in 13 s, peak RSS 0.54 GB; the 1,000,000-row tile
    table alone 7 s, 0.73 GB). Same arguments ⇒ same bytes on one platform; rows do not depend on
    ``chunk_rows`` (every draw comes from a stream seeded by ``(seed, kind, block of 4096 rows |
    slide)``; a ``chunk_rows`` multiple of 4096 wastes no generation work). Slide sizes and so
    every tile depend on ``rows``: a cache is not a prefix of a larger one.

    Raises ``ValueError`` for bad sizes (``rows < 2 * slide_max``, fewer than 2 labels or
    confounder values, ``slide_min > slide_max``, ...), ``FileExistsError`` if ``root`` already
    holds a cache and not ``overwrite``.
    """
    names = [str(e) for e in ([encoders] if isinstance(encoders, str) else encoders)]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"encoders must name at least one encoder, all distinct; got {names}")
    for arg, value, low in (("rows", rows, 1), ("dim", dim, 2), ("n_labels", n_labels, 2),
                            ("n_confounders", n_confounders, 2), ("slide_min", slide_min, 1),
                            ("n_morphologies", n_morphologies, 1), ("intrinsic_dim", intrinsic_dim, 1),
                            ("chunk_rows", chunk_rows, 1)):
        if not isinstance(value, (int, np.integer)) or int(value) < low:
            raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")
    if not isinstance(slide_max, (int, np.integer)) or int(slide_max) < int(slide_min):
        raise ValueError(f"slide_max must be an int >= slide_min ({slide_min}), got {slide_max!r}")
    if int(rows) < 2 * int(slide_max):
        raise ValueError(f"rows must be >= 2 * slide_max = {2 * int(slide_max)}, got {rows}")
    if confounder_scales is None:
        scales = np.ones(1) if len(names) == 1 else np.linspace(0.5, 1.5, len(names))
    else:
        scales = np.asarray(confounder_scales, dtype=np.float64)
        if scales.shape != (len(names),) or not np.all(np.isfinite(scales)) or np.any(scales < 0):
            raise ValueError(f"confounder_scales must hold one finite value >= 0 per encoder; got {confounder_scales!r}")
    dtype = np.dtype(dtype)
    root = Path(root)
    if (root / "cache.json").exists() and not overwrite:
        raise FileExistsError(f"{root} already holds a cache; pass overwrite=True to replace it")

    # many small BLAS calls: one thread avoids oversubscription (measured 4x faster on 2 busy cores)
    with single_thread_blas():
        return _write_scale_cache(root, names=names, scales=scales, dtype=dtype, rows=int(rows), dim=int(dim),
                                  n_labels=int(n_labels), n_confounders=int(n_confounders),
                                  slide_min=int(slide_min), slide_max=int(slide_max),
                                  n_morphologies=int(n_morphologies), intrinsic_dim=int(intrinsic_dim),
                                  seed=int(seed), paired_view=bool(paired_view), chunk_rows=int(chunk_rows),
                                  overwrite=overwrite)


def _write_scale_cache(root: Path, *, names, scales, dtype, rows, dim, n_labels, n_confounders, slide_min,
                       slide_max, n_morphologies, intrinsic_dim, seed, paired_view, chunk_rows, overwrite) -> Path:
    model = _ScaleModel(rows=int(rows), dim=int(dim), n_labels=int(n_labels), n_confounders=int(n_confounders),
                        slide_min=int(slide_min), slide_max=int(slide_max), n_morphologies=int(n_morphologies),
                        intrinsic_dim=int(intrinsic_dim), seed=int(seed), confounder_scales=scales)
    n_slides = model.slide_sizes.size
    slide_of_row = np.repeat(np.arange(n_slides), model.slide_sizes)
    tile_in_slide = np.arange(int(rows)) - np.repeat(model.slide_start, model.slide_sizes)
    slide_names = pd.Series([f"slide{s:06d}" for s in range(n_slides)], dtype=object)
    group = slide_names.to_numpy()[slide_of_row]
    tile_txt = pd.Series(tile_in_slide).astype(str).str.zfill(4)
    group_s = pd.Series(group, dtype=object)
    label_names = np.asarray([f"class{i}" for i in range(int(n_labels))], dtype=object)
    conf_names = np.asarray([f"c{i}" for i in range(int(n_confounders))], dtype=object)
    tiles = pd.DataFrame({
        "sample_id": (group_s + "-t" + tile_txt).to_numpy(dtype=object),
        "image_path": ("slides/" + group_s + ".svs#tile" + tile_txt).to_numpy(dtype=object),
        "group_id": group,
        "label": label_names[model.slide_label[slide_of_row]],
        "centre": conf_names[model.slide_conf[slide_of_row]],
        "morphology": model.morphology(),
        "tile": tile_in_slide.astype(np.int32),
    })
    del slide_of_row, tile_in_slide, tile_txt, group_s
    write_tileset(root, SCALE_TILESET, tiles, overwrite=overwrite)
    for e, name in enumerate(names):
        write_embeddings_blocks(
            root, name, SCALE_TILESET, n_rows=int(rows), dim=int(dim), dtype=dtype,
            read_block=lambda lo, hi, e=e: model.rows_between(lo, hi, e, dtype),
            shard_rows=int(chunk_rows), overwrite=overwrite,
            source=f"synthetic embeddings of encoder {name!r}",
        )
    view_all = tiles[["sample_id", "label", "group_id", "centre"]]
    write_view(root, "scale_all", view_all, tileset=SCALE_TILESET, confounder_column="centre",
               design="all", overwrite=overwrite)
    views = {"scale_all": "all"}
    if paired_view:
        write_view(root, "paired_2x2", _paired_view(view_all, conf_names), tileset=SCALE_TILESET,
                   confounder_column="centre", design="paired_2x2", overwrite=overwrite)
        views["paired_2x2"] = "paired_2x2"
    atomic_write_json(root / "cache.json", {
        "kind": "cachescore-scale",
        "seed": int(seed),
        "tileset": SCALE_TILESET,
        "views": views,
        "encoders": names,
        "shape": [int(rows), int(dim)],
        "dtype": dtype.name,
        "n_slides": int(n_slides),
        "params": {"n_labels": int(n_labels), "n_confounders": int(n_confounders),
                   "slide_min": int(slide_min), "slide_max": int(slide_max),
                   "n_morphologies": int(n_morphologies), "intrinsic_dim": int(intrinsic_dim),
                   "norms": dict(_SCALE_NORMS)},
        "confounder_scales": {nm: float(s) for nm, s in zip(names, scales)},
    }, overwrite=True)
    return root
