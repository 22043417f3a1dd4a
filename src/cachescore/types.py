"""Result records returned by the metric API.

Field names, order and meaning follow croma 1.0.1 (spec/metrics.md §10) so that a croma user can
swap the import. Every record is frozen; fields after the positional block are keyword-only, and
no default makes missing evidence look complete (``support`` has none).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import numpy as np

__all__ = ["RobustnessResult", "CRoMaResult", "TailMetrics", "TauAssessment", "BootstrapCI", "RankStability"]


@dataclass(frozen=True)
class RobustnessResult:
    """An RI or MaRI evaluation (spec §5, §6).

    Per-unit arrays have length ``U`` (one entry per evaluation unit, in unit order: manifest order
    under ``all``, subset-major under ``paired_2x2``). ``sample_values`` holds only the defined
    units. ``pair_values`` holds one pooled value per scope (0.5 for a scope without support).
    """

    dataset: str
    k: int
    value: float
    std: float
    n_pairs: int
    pair_values: np.ndarray
    sample_values: np.ndarray
    sample_values_aligned: np.ndarray
    occurrence_defined_mask: np.ndarray
    sample_undefined_types: np.ndarray
    occurrence_subsets: np.ndarray
    occurrence_source_indices: np.ndarray
    _: KW_ONLY
    #: Fraction of units with at least one SO or OS neighbour in their window. Required.
    support: float
    ss_dominated_undefined_frac: float = 0.0
    oo_dominated_undefined_frac: float = 0.0
    mixed_undefined_frac: float = 0.0
    evaluation_design: str = "all"
    evaluation_unit: str = "sample"
    alpha: float = 0.10
    median_value: float = float("nan")
    q_alpha: float = float("nan")
    ltm_alpha: float = float("nan")
    #: Temperature MaRI scored with (pinned or resolved); NaN for RI.
    tau: float = float("nan")
    #: Per-unit evidence, in unit order: the SO / OS neighbour counts (RI) or weight sums (MaRI)
    #: of each unit's window (0 where undefined), so that the pooled value is
    #: ``sum(so) / (sum(so) + sum(os))`` (spec §5.3, §6.2). cachescore only (croma's result has no
    #: such field): what the cluster bootstrap of the pooled ratio resamples (ADR-0009).
    occurrence_so: np.ndarray | None = None
    occurrence_os: np.ndarray | None = None


@dataclass(frozen=True)
class CRoMaResult:
    """A CRoMa evaluation for one ``m`` (spec §7.6).

    CRoMa requires total support, so there is no support field: a result exists only when every
    unit was scoreable. ``f0`` is the fraction of units with margin ``<= 0``.
    """

    dataset: str
    m: int
    value: float
    std: float
    n_pairs: int
    pair_values: np.ndarray
    sample_values: np.ndarray
    sample_values_aligned: np.ndarray
    _: KW_ONLY
    evaluation_design: str = "all"
    evaluation_unit: str = "sample"
    occurrence_subsets: np.ndarray | None = None
    occurrence_source_indices: np.ndarray | None = None
    k_start: int = 0
    k_final: int = 0
    retries: int = 0
    alpha: float = 0.10
    q_alpha: float = float("nan")
    ltm_alpha: float = float("nan")
    f0: float = float("nan")


@dataclass(frozen=True)
class TailMetrics:
    """Lower-tail summary of finite per-unit values (spec §8.1)."""

    alpha: float
    q_alpha: float
    ltm_alpha: float
    n_tail_samples: int


@dataclass(frozen=True)
class TauAssessment:
    """Where a MaRI temperature sits against the typed-distance scale (spec §6.3)."""

    tau: float
    n_typed: int
    median_typed_distance: float
    recommended_tau: float
    low: float
    high: float
    factor: float
    regime: str

    @property
    def is_principled(self) -> bool:
        return self.regime == "principled"


@dataclass(frozen=True)
class BootstrapCI:
    """Percentile bootstrap interval (spec §8.2). ``n_boot`` is the requested replicate count."""

    point: float
    lo: float
    hi: float
    level: float
    n_boot: int


@dataclass(frozen=True)
class RankStability:
    """Cluster-bootstrap stability of a model ranking (spec §8.2)."""

    models: list
    point_value: dict
    point_rank: dict
    mean_rank: dict
    rank_lo: dict
    rank_hi: dict
    value_ci: dict
    pairwise_win: dict
    n_boot: int
