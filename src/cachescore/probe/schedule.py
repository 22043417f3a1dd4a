"""PathoROB's training schedules for the confounder-biased probe sweep (spec downstream §2).

A *schedule* is a list of :data:`SplitPlan` values, balanced baseline first. Each plan says how
many training rows every ``(confounder, class)`` cell contributes at that split, plus the
largest number of slides any cell contributes at any split (``max_train_slides``), which fixes
the validation slice and the start of the held-out tail.

The per-split slide counts below are written from the tables of spec §2.2; the fixture
``pathorob_schedule_parity.json`` (captured from PathoROB itself) pins them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["PATHOROB_SPLITS", "SplitPlan", "pathorob_schedule"]

#: Number of splits PathoROB walks for each of its three downstream datasets.
PATHOROB_SPLITS: dict[str, int] = {"camelyon": 8, "tcga": 7, "tolkach_esca": 4}

#: One split: ``(split_map, max_train_slides)`` where ``split_map`` is a sequence of
#: ``(confounder, class, training_rows)`` triples, sorted by ``(confounder, class)``.
SplitPlan = tuple[Sequence[tuple[int, int, int]], int]

#: ``max_train_slides`` of each dataset's schedule (spec §2.1).
_MAX_TRAIN_SLIDES: dict[str, int] = {"camelyon": 14, "tcga": 8, "tolkach_esca": 6}


def _camelyon_slides(i: int, j: int, s: int) -> int:
    # favourable cells (0,0) and (1,1) lose one slide per split, the others gain one
    return 7 - s if i == j else 7 + s


def _tcga_slides(i: int, j: int, s: int) -> int:
    if i == j:
        return s + 2
    if i + j == 3:
        if s % 2 == 1:
            return 1
        return 2 if s < 3 else 0
    if s < 2:
        return 2
    return 1 if s < 5 else 0


def _tolkach_slides(i: int, j: int, s: int) -> int:
    first_half = j < 3
    favourable = first_half if i == 0 else not first_half
    return 3 - s if favourable else 3 + s


_GRIDS: dict[str, tuple[int, int, Callable[[int, int, int], int]]] = {
    "camelyon": (2, 2, _camelyon_slides),
    "tcga": (4, 4, _tcga_slides),
    "tolkach_esca": (2, 6, _tolkach_slides),
}


def pathorob_schedule(
    dataset: str, *, rows_per_slide: int, n_splits: int | None = None
) -> list[SplitPlan]:
    """PathoROB's schedule for ``dataset``, croma-compatible.

    Parameters
    ----------
    dataset : {"camelyon", "tcga", "tolkach_esca"}
    rows_per_slide : int
        Multiplier from slide counts to row counts (published: 300, 30, 100; 1 for slide-level).
    n_splits : int, optional
        How many splits to walk (a prefix of the full schedule). Default: the full schedule
        (:data:`PATHOROB_SPLITS`).

    Returns
    -------
    list of SplitPlan
        ``[(split_map, max_train_slides), ...]``, one per split; each ``split_map`` is a list
        of ``(i, j, take)`` tuples sorted ascending by ``(i, j)``.

    Raises
    ------
    ValueError
        In this order: unknown dataset; ``rows_per_slide < 1``; ``n_splits < 1``;
        ``n_splits`` beyond the dataset's defined splits.
    """
    if dataset not in PATHOROB_SPLITS:
        raise ValueError(
            f"PathoROB has no schedule for {dataset!r}; it defines {sorted(PATHOROB_SPLITS)}. "
            "Build your own list of (split_map, max_train_slides) plans for any other cohort "
            "and pass it to the sweep as schedule=..."
        )
    if rows_per_slide < 1:
        raise ValueError(f"rows_per_slide must be at least 1, got {rows_per_slide}")
    defined = PATHOROB_SPLITS[dataset]
    n = defined if n_splits is None else n_splits
    if n < 1:
        raise ValueError(f"n_splits must be at least 1, got {n}")
    if n > defined:
        raise ValueError(
            f"PathoROB's {dataset!r} schedule has {defined} splits, so it cannot be walked "
            f"for {n}; past the last one the favourable cells go negative"
        )
    n_conf, n_cls, slides_of = _GRIDS[dataset]
    mts = _MAX_TRAIN_SLIDES[dataset]
    return [
        (
            [
                (i, j, slides_of(i, j, s) * rows_per_slide)
                for i in range(n_conf)
                for j in range(n_cls)
            ],
            mts,
        )
        for s in range(n)
    ]
