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
    ``smallest_c``; ``calibration`` / ``per_centre`` / ``metrics`` tables (or None); in
    ``per_centre`` the ``centre`` column holds the confounder's values by name (the bundle's
    ``confounder_names``), ``confounder_column`` names the view column they come from."""

    cramers_v: list | None = None
    chance: float | None = None
    smallest_c_share: float | None = None
    smallest_c: float | None = None
    calibration: pd.DataFrame | None = None
    per_centre: pd.DataFrame | None = None
    metrics: pd.DataFrame | None = None
    confounder_column: str | None = None

    @property
    def smallest_c_warning(self) -> str:
        """The warning a reader needs when most probes took the grid's smallest C, else ``""``."""
        if self.smallest_c_share is None or self.smallest_c_share <= SMALLEST_C_WARN_SHARE:
            return ""
        return (f"in {100 * self.smallest_c_share:.0f}% of the probes the validation-selected C was the grid's "
                f"smallest ({self.smallest_c:g}): near-constant probes, their accuracies say little about "
                "robustness. The grid is fixed by the PathoROB protocol (C = 1e-8 … 1e4); check the encoder's "
                "embeddings (`cachescore status JOB --verify` checks them; a constant or collapsed encoder selects the "
                "smallest C), or give the probes more training rows per cell (larger `take` in [probe] schedule)")


def _parquet(path: Path) -> pd.DataFrame | None:
    try:
        return pd.read_parquet(path) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _named_centres(table: pd.DataFrame | None, names) -> pd.DataFrame | None:
    """``table`` with its ``centre`` codes (indices into ``names``) replaced by the names; unchanged
    when the codes are not all valid indices (then they are left for the reader to see)."""
    if table is None or "centre" not in table.columns or not isinstance(names, list) or not names:
        return table
    codes = pd.to_numeric(table["centre"], errors="coerce")
    if codes.isna().any() or not ((codes >= 0) & (codes < len(names)) & (codes == codes.round())).all():
        return table
    return table.assign(centre=[str(names[int(c)]) for c in codes])


def bundle_facts(bundle) -> BundleFacts:
    """The facts of the bundle folder ``bundle`` (see :class:`BundleFacts`)."""
    if not bundle:
        return BundleFacts()
    path = Path(bundle)
    try:
        summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    try:
        provenance = json.loads((path / "manifest.json").read_text(encoding="utf-8")).get("provenance") or {}
    except (OSError, ValueError, AttributeError):
        provenance = {}
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
                       per_centre=_named_centres(_parquet(path / "per_centre_metrics.parquet"),
                                                 provenance.get("confounder_names")),
                       metrics=_parquet(path / "metrics.parquet"),
                       confounder_column=provenance.get("confounder_column"))
