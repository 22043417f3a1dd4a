"""What the results tables read from a probe unit's evaluation bundle (``cachescore.probe.bundle``):
the schedule's Cramér's V per split, the chance level, which regularisation the probes selected,
and the per-centre and calibration tables. A missing or unreadable bundle gives ``None`` fields
(the tables then say "not available"), never an exception."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

__all__ = ["BundleFacts", "bundle_facts", "SMALLEST_C_WARN_SHARE"]

#: Share of probes whose validation-selected C is the grid's smallest above which a sweep is flagged.
SMALLEST_C_WARN_SHARE = 0.5


@dataclass(frozen=True)
class BundleFacts:
    """``cramers_v`` (one per split), ``chance``; ``smallest_c_share`` of the selected C values;
    ``smallest_c``; ``calibration`` / ``per_centre`` / ``metrics`` tables (or None)."""

    cramers_v: list | None = None
    chance: float | None = None
    smallest_c_share: float | None = None
    smallest_c: float | None = None
    calibration: pd.DataFrame | None = None
    per_centre: pd.DataFrame | None = None
    metrics: pd.DataFrame | None = None

    @property
    def smallest_c_warning(self) -> str:
        """The warning a reader needs when most probes took the grid's smallest C, else ``""``."""
        if self.smallest_c_share is None or self.smallest_c_share <= SMALLEST_C_WARN_SHARE:
            return ""
        return (f"in {100 * self.smallest_c_share:.0f}% of the probes the validation-selected C was the grid's "
                f"smallest ({self.smallest_c:g}): near-constant probes, their accuracies say little about "
                "robustness (check the embeddings or widen the C grid)")


def _parquet(path: Path) -> pd.DataFrame | None:
    try:
        return pd.read_parquet(path) if path.is_file() else None
    except (OSError, ValueError):
        return None


def bundle_facts(bundle) -> BundleFacts:
    """The facts of the bundle folder ``bundle`` (see :class:`BundleFacts`)."""
    if not bundle:
        return BundleFacts()
    path = Path(bundle)
    try:
        summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    selection = _parquet(path / "probe_selection.parquet")
    share = smallest = None
    if selection is not None and len(selection) and {"selected", "C_index", "C"} <= set(selection.columns):
        chosen = selection[selection["selected"]]
        if len(chosen):
            share = float((chosen["C_index"] == 0).mean())
            smallest = float(selection.loc[selection["C_index"] == 0, "C"].iloc[0])
    v = summary.get("cramers_v")
    chance = summary.get("chance")
    return BundleFacts(cramers_v=[float(x) for x in v] if isinstance(v, list) else None,
                       chance=float(chance) if isinstance(chance, (int, float)) else None,
                       smallest_c_share=share, smallest_c=smallest,
                       calibration=_parquet(path / "calibration.parquet"),
                       per_centre=_parquet(path / "per_centre_metrics.parquet"),
                       metrics=_parquet(path / "metrics.parquet"))
