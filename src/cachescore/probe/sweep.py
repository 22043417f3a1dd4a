"""The confounder-biased probe sweep (spec downstream §3), croma-compatible and fan-out ready.

Structure (spec §8): everything random happens on the driver, sequentially and cheaply --
validation, the cell grid, the split plans, the replicate seeds, and the replay of every
replicate's slide arrangement (which carries over from one replicate to the next). That yields,
for each (replicate, split), three integer row-index vectors. The expensive part, one probe per
(replicate, split) (:func:`cachescore.probe.fit.fit_probe`), consumes no randomness and runs
either in-process or as one Dask task per (replicate, split)
(:mod:`cachescore.probe.distributed`). Matrices are assembled centrally, so the result does not
depend on the number of workers or on completion order.

Public entry points: :func:`probe_sweep`, :func:`probe_sweep_over_test_sets` (exactly croma's
outputs, plus an optional ``client=``) and :func:`sweep_outcomes` (every probe's details).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .distributed import run_probe_jobs
from .fit import IN_DOMAIN, ProbeOutcome, ProbeTask
from .schedule import SplitPlan

__all__ = [
    "IN_DOMAIN",
    "ProbeTask",
    "ProbeOutcome",
    "SlideArrangement",
    "SweepRun",
    "probe_sweep",
    "probe_sweep_over_test_sets",
    "sweep_outcomes",
]

#: Replicate seeds are drawn without replacement from ``range(0, SEED_POOL)``.
SEED_POOL = 10000

#: ``cells[confounder][class]`` = list of slides, each slide a list of row indices.
SlideCells = Sequence[Sequence[Sequence[Sequence[int]]]]

#: ``(cells, rng) -> cells``: one replicate's reordering of every cell's slides (spec §3.9).
SlideArrangement = Callable[[Any, random.Random], Any]


@dataclass(frozen=True, kw_only=True)
class SweepRun:
    """Everything one sweep produced.

    Attributes
    ----------
    matrices : dict[str, ndarray (n_splits, iterations) float64, C-contiguous]
        ``"in_domain"`` first, then the extra test sets in the order given.
    replicate_seeds : list[int]
        Seed of each replicate (column).
    outcomes : list[ProbeOutcome]
        One per (replicate, split), sorted by ``(replicate, split)``.
    """

    matrices: dict[str, np.ndarray]
    replicate_seeds: list[int]
    outcomes: list[ProbeOutcome]


# --------------------------------------------------------------------------------------------
# validation (spec §3.2; catalogue §6) -- same checks, same order as croma


def _as_features(embeddings: ArrayLike) -> np.ndarray:
    """2-D finite float matrix; float32 is kept (upcast per slice later, exactly), others -> float64."""
    if hasattr(embeddings, "compute") and hasattr(embeddings, "chunks"):
        embeddings = embeddings.compute()  # a dask array: the probe needs it in memory anyway
    features = np.asarray(embeddings)
    if features.dtype not in (np.float32, np.float64):
        features = np.asarray(embeddings, dtype=np.float64)
    if features.ndim != 2:
        raise ValueError(
            f"embeddings must be a 2-D (n_rows, n_features) matrix, got {features.ndim}-D"
        )
    if not np.isfinite(features.sum(dtype=np.float64)) and not np.isfinite(features).all():
        bad = np.flatnonzero(~np.isfinite(features).all(axis=1))
        raise ValueError(
            f"embeddings must be finite; {len(bad)} row(s) hold NaN or inf, first rows "
            f"{bad[:5].tolist()}"
        )
    return features


def _as_indices(name: str, values: ArrayLike, n_rows: int) -> np.ndarray:
    column = np.asarray(values)
    if column.ndim != 1 or len(column) != n_rows:
        raise ValueError(
            f"{name} must be a 1-D array with one entry per embedding row ({n_rows}), "
            f"got shape {column.shape}"
        )
    if not np.issubdtype(column.dtype, np.integer):
        raise ValueError(
            f"{name} must hold integer indices into the schedule, got dtype {column.dtype}; "
            "map names to indices before calling"
        )
    if len(column) and column.min() < 0:
        raise ValueError(f"{name} must hold non-negative indices, got {column.min()}")
    return column


def _validated_test_sets(
    test_sets: Mapping[str, tuple[ArrayLike, ArrayLike]] | None, n_features: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, (test_x, test_y) in (test_sets or {}).items():
        if name == IN_DOMAIN:
            raise ValueError(
                f"{IN_DOMAIN!r} is the key the sweep's own held-out matrix comes back under; "
                "rename that test set"
            )
        x = np.asarray(test_x, dtype=np.float64)
        y = np.asarray(test_y)
        if x.ndim != 2 or x.shape[1] != n_features:
            raise ValueError(
                f"test set {name!r} must be a 2-D matrix with {n_features} features, "
                f"got shape {x.shape}"
            )
        if len(y) != len(x):
            raise ValueError(
                f"test set {name!r} must hold one label per row, got {len(y)} labels for "
                f"{len(x)} rows"
            )
        if not len(x):
            raise ValueError(f"test set {name!r} must hold at least one row")
        out[name] = (x, y)
    return out


def _cell_grid(confounders: np.ndarray, labels: np.ndarray) -> list[list[np.ndarray]]:
    """``cells[i][j]`` = int64 row indices of cell (i, j) in ascending input order."""
    n_conf = int(confounders.max()) + 1
    n_cls = int(labels.max()) + 1
    code = confounders.astype(np.int64) * n_cls + labels.astype(np.int64)
    order = np.argsort(code, kind="stable")
    bounds = np.searchsorted(code[order], np.arange(n_conf * n_cls + 1))
    return [
        [order[bounds[i * n_cls + j] : bounds[i * n_cls + j + 1]].astype(np.int64) for j in range(n_cls)]
        for i in range(n_conf)
    ]


@dataclass(frozen=True)
class _Plan:
    split_map: list[tuple[int, int, int]]
    reserves: list[int]
    first_held_out: int


def _validated_plans(
    schedule: Sequence[SplitPlan],
    cells: list[list[np.ndarray]],
    rows_per_slide: int,
    validation_fraction: float | None,
) -> list[_Plan]:
    if rows_per_slide < 1:
        raise ValueError(f"rows_per_slide must be at least 1, got {rows_per_slide}")
    if validation_fraction is not None and not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must lie in [0, 1), got {validation_fraction}")
    if len(schedule) < 2:
        raise ValueError(
            "schedule must hold the balanced baseline and at least one confounded split after "
            f"it, got {len(schedule)} split(s)"
        )
    n_conf, n_cls = len(cells), len(cells[0])
    sizes = np.array([[len(c) for c in row] for row in cells], dtype=np.int64)
    plans: list[_Plan] = []
    for s, (split_map, mts) in enumerate(schedule):
        if mts < 1:
            raise ValueError(f"split {s}: max_train_slides must be at least 1, got {mts}")
        entries = [(int(i), int(j), int(take)) for i, j, take in split_map]
        if validation_fraction is None:
            reserves = [int(take / mts) for _, _, take in entries]
            first_held_out = (mts + 1) * rows_per_slide
        else:
            reserves = [round(validation_fraction * take) for _, _, take in entries]
            first_held_out = (mts + round(validation_fraction * mts) + 1) * rows_per_slide
        max_train_rows = mts * rows_per_slide
        for (i, j, take), reserve in zip(entries, reserves):
            if not (0 <= i < n_conf and 0 <= j < n_cls):
                raise ValueError(f"split {s}: schedule names cell ({i}, {j}), which no row carries")
            if take < 0:
                raise ValueError(f"split {s}: cell ({i}, {j}) asks for {take} rows")
            if take > max_train_rows:
                raise ValueError(
                    f"split {s}: cell ({i}, {j}) asks for {take} training rows, more than "
                    f"max_train_slides allows ({max_train_rows} rows at {rows_per_slide} "
                    "row(s) per slide); build the schedule with the rows_per_slide the sweep runs at"
                )
            if take + reserve > sizes[i, j]:
                raise ValueError(
                    f"split {s}: cell ({i}, {j}) holds {sizes[i, j]} rows, too few for the "
                    f"{take} training and {reserve} validation rows the schedule asks for"
                )
        n_train = sum(take for _, _, take in entries)
        n_val = sum(reserves)
        n_test = int(np.maximum(sizes - first_held_out, 0).sum())
        for what, n in (("training", n_train), ("validation", n_val), ("test", n_test)):
            if n <= 0:
                raise ValueError(
                    f"split {s}: the schedule leaves no {what} rows -- the cells are too small "
                    "for the row counts and held-out tail it asks for"
                    + (
                        " (a slide-level sweep needs an explicit validation_fraction)"
                        if what == "validation" and validation_fraction is None
                        else ""
                    )
                )
        plans.append(_Plan(entries, reserves, first_held_out))
    return plans


# --------------------------------------------------------------------------------------------
# arrangement replay (spec §3.5, §3.9)


def _slide_bounds(n: int, rows_per_slide: int) -> list[tuple[int, int]]:
    return [(start, min(start + rows_per_slide, n)) for start in range(0, n, rows_per_slide)]


def _default_arrange(cells: list[list[np.ndarray]], rows_per_slide: int, rng: random.Random) -> None:
    """Shuffle every cell's slides, confounder-major, in place (one shared rng stream).

    ``rng.shuffle`` draws depend only on the list length, so shuffling slide *positions* and
    gathering rows with NumPy consumes the stream exactly like shuffling the slides themselves.
    """
    for row in cells:
        for j, order in enumerate(row):
            bounds = _slide_bounds(len(order), rows_per_slide)
            positions = list(range(len(bounds)))
            rng.shuffle(positions)
            if len(bounds) > 1:
                row[j] = np.concatenate([order[bounds[p][0] : bounds[p][1]] for p in positions])


def _custom_arrange(
    cells: list[list[np.ndarray]],
    rows_per_slide: int,
    arrangement: SlideArrangement,
    rng: random.Random,
) -> None:
    """Hand the slide structure to a user hook, check it is a rearrangement, adopt it."""
    slides = [
        [[order[a:b].tolist() for a, b in _slide_bounds(len(order), rows_per_slide)] for order in row]
        for row in cells
    ]
    snapshot = [[sorted(map(tuple, cell)) for cell in row] for row in slides]
    arranged = arrangement(slides, rng)
    complaint = (
        "arrange_slides must return the same slides it was handed, reordered -- one list per "
        "confounder, one per class inside it, each holding that cell's slides as lists of row "
        "indices"
    )
    try:
        n_rows_arranged = len(arranged)
    except TypeError:
        raise ValueError(f"{complaint}; got {type(arranged).__name__}") from None
    if n_rows_arranged != len(snapshot):
        raise ValueError(f"{complaint}; got {n_rows_arranged} confounder(s), not {len(snapshot)}")
    for arranged_row, row in zip(arranged, snapshot):
        if len(arranged_row) != len(row):
            raise ValueError(f"{complaint}; got {len(arranged_row)} class(es), not {len(row)}")
        for arranged_cell, cell in zip(arranged_row, row):
            if sorted(map(tuple, arranged_cell)) != cell:
                raise ValueError(complaint)
    for i, arranged_row in enumerate(arranged):
        for j, cell in enumerate(arranged_row):
            flat = [r for slide in cell for r in slide]
            cells[i][j] = np.asarray(flat, dtype=np.int64)


def _replay(
    cells: list[list[np.ndarray]],
    plans: list[_Plan],
    replicate_seeds: list[int],
    rows_per_slide: int,
    arrange_slides: SlideArrangement | None,
) -> list[ProbeTask]:
    """Run every replicate's arrangement in column order (carry-over) and cut its splits."""
    cells = [list(row) for row in cells]  # our own copy; arrays are replaced, never mutated
    jobs: list[ProbeTask] = []
    empty = np.empty(0, dtype=np.int64)
    for r, replicate_seed in enumerate(replicate_seeds):
        rng = random.Random(replicate_seed)
        if arrange_slides is None:
            _default_arrange(cells, rows_per_slide, rng)
        else:
            _custom_arrange(cells, rows_per_slide, arrange_slides, rng)
        tails: dict[int, np.ndarray] = {}  # the held-out tail is shared by splits with equal mts
        for s, plan in enumerate(plans):
            train = [cells[i][j][:take] for i, j, take in plan.split_map]
            val = [
                cells[i][j][take : take + reserve]
                for (i, j, take), reserve in zip(plan.split_map, plan.reserves)
            ]
            if plan.first_held_out not in tails:
                tail = np.concatenate(
                    [empty, *(order[plan.first_held_out :] for row in cells for order in row)]
                )
                tail.setflags(write=False)  # one array for several outcomes: read-only
                tails[plan.first_held_out] = tail
            jobs.append(
                ProbeTask(
                    replicate=r,
                    split=s,
                    seed=replicate_seed,
                    train_rows=np.concatenate([empty, *train]),
                    val_rows=np.concatenate([empty, *val]),
                    test_rows=tails[plan.first_held_out],
                )
            )
    return jobs


# --------------------------------------------------------------------------------------------
# entry points


def sweep_outcomes(
    embeddings: ArrayLike,
    confounders: ArrayLike,
    labels: ArrayLike,
    *,
    schedule: Sequence[SplitPlan],
    test_sets: Mapping[str, tuple[ArrayLike, ArrayLike]] | None = None,
    rows_per_slide: int = 1,
    iterations: int = 20,
    seed: int = 1000,
    validation_fraction: float | None = None,
    arrange_slides: SlideArrangement | None = None,
    client: Any = None,
    keep_predictions: bool = False,
) -> SweepRun:
    """Run the sweep and keep every probe's outcome.

    Parameters are those of :func:`probe_sweep_over_test_sets`, plus ``keep_predictions`` (store
    decision scores and labels of every probe's validation and test rows in its outcome).

    Parameters
    ----------
    embeddings : array-like (n_rows, D)
        Float rows (float32 is kept and upcast per slice, exactly; anything else -> float64);
        a dask array is computed first. Slides are ``rows_per_slide`` consecutive rows of a cell.
    confounders, labels : array-like (n_rows,) of non-negative integers
        Cell indices ``i`` and ``j``.
    schedule : sequence of ``(split_map, max_train_slides)``, balanced baseline first (>= 2).
    test_sets : mapping name -> (X (n, D), y (n,)), optional
        Extra test sets scored by every probe.
    rows_per_slide, iterations, seed, validation_fraction, arrange_slides
        As croma (spec §3).
    client : distributed.Client, optional
        ``None`` runs in-process; otherwise one task per (replicate, split) on the cluster.
    keep_predictions : bool

    Returns
    -------
    SweepRun

    Raises
    ------
    ValueError
        Spec §6 #1-#22, in croma's order (the hook check #22 runs during the replay, before
        any probe is fitted), and whatever scikit-learn raises while fitting or scoring.
    """
    features = _as_features(embeddings)
    n_rows = features.shape[0]
    conf = _as_indices("confounders", confounders, n_rows)
    lab = _as_indices("labels", labels, n_rows)
    if not n_rows:
        raise ValueError("embeddings must hold at least one row")
    named_tests = _validated_test_sets(test_sets, features.shape[1])
    cells = _cell_grid(conf, lab)
    plans = _validated_plans(schedule, cells, rows_per_slide, validation_fraction)
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    if iterations > SEED_POOL:
        raise ValueError(f"iterations must be at most {SEED_POOL}, got {iterations}")

    replicate_seeds = random.Random(seed).sample(range(0, SEED_POOL), iterations)
    jobs = _replay(cells, plans, replicate_seeds, rows_per_slide, arrange_slides)

    outcomes = run_probe_jobs(
        jobs, features, lab, named_tests, client=client, keep_predictions=keep_predictions
    )
    outcomes = sorted(outcomes, key=lambda o: (o.replicate, o.split))
    names = [IN_DOMAIN, *named_tests]
    matrices = {name: np.full((len(plans), iterations), math.nan) for name in names}
    for outcome in outcomes:
        for name in names:
            matrices[name][outcome.split, outcome.replicate] = outcome.scores[name]
    return SweepRun(matrices=matrices, replicate_seeds=list(replicate_seeds), outcomes=outcomes)


def probe_sweep_over_test_sets(
    embeddings: ArrayLike,
    confounders: ArrayLike,
    labels: ArrayLike,
    *,
    schedule: Sequence[SplitPlan],
    test_sets: Mapping[str, tuple[ArrayLike, ArrayLike]] | None = None,
    rows_per_slide: int = 1,
    iterations: int = 20,
    seed: int = 1000,
    validation_fraction: float | None = None,
    arrange_slides: SlideArrangement | None = None,
    client: Any = None,
) -> dict[str, np.ndarray]:
    """croma's ``probe_sweep_over_test_sets``: one sweep scored on the in-domain tail and on
    extra test sets.

    Returns
    -------
    dict[str, ndarray (len(schedule), iterations) float64]
        ``"in_domain"`` first, then ``test_sets`` in mapping order; element ``[s, r]`` is the
        balanced accuracy of the probe trained at split ``s`` in replicate ``r``. Bit-identical
        to croma 1.0.1 for the same inputs (same numeric stack), whatever ``client`` is.

    Raises
    ------
    ValueError
        See :func:`sweep_outcomes`.
    """
    return sweep_outcomes(
        embeddings,
        confounders,
        labels,
        schedule=schedule,
        test_sets=test_sets,
        rows_per_slide=rows_per_slide,
        iterations=iterations,
        seed=seed,
        validation_fraction=validation_fraction,
        arrange_slides=arrange_slides,
        client=client,
    ).matrices


def probe_sweep(
    embeddings: ArrayLike,
    confounders: ArrayLike,
    labels: ArrayLike,
    *,
    schedule: Sequence[SplitPlan],
    rows_per_slide: int = 1,
    iterations: int = 20,
    seed: int = 1000,
    validation_fraction: float | None = None,
    client: Any = None,
) -> np.ndarray:
    """croma's ``probe_sweep``: the ``(len(schedule), iterations)`` in-domain accuracy matrix.

    Row 0 is the first (balanced) split, column ``r`` the replicate seeded by
    ``random.Random(seed).sample(range(10000), iterations)[r]``. ``client`` (a
    ``distributed.Client``) fans the probes out; the matrix is the same either way.
    """
    return probe_sweep_over_test_sets(
        embeddings,
        confounders,
        labels,
        schedule=schedule,
        rows_per_slide=rows_per_slide,
        iterations=iterations,
        seed=seed,
        validation_fraction=validation_fraction,
        client=client,
    )[IN_DOMAIN]
