"""MaRI temperature: recommendation, fallback and scale check (spec/metrics.md §6.3).

The recommended ``tau`` is the median of the typed (SO/OS) neighbour distances inside every unit's
window at the operating ``k``. A pinned ``tau`` is *principled* when it lies in
``[median / factor, median * factor]`` (inclusive), *too sharp* below it (weights collapse onto
the nearest typed neighbour) and *too flat* above it (MaRI degenerates into RI).
"""

from __future__ import annotations

import numpy as np

from ..types import TauAssessment

__all__ = [
    "TAU_FALLBACK",
    "DEFAULT_TAU_SCALE_FACTOR",
    "assess_tau",
    "format_tau_warning",
    "no_typed_neighbour_message",
    "collapsed_message",
]

#: Temperature used when auto-tau has no distance scale (no typed neighbour, or median 0).
TAU_FALLBACK = 0.2
#: Width of the principled window around the median typed distance (a factor each way).
DEFAULT_TAU_SCALE_FACTOR = 4.0


def assess_tau(tau: float, typed_distances, *, factor: float = DEFAULT_TAU_SCALE_FACTOR) -> TauAssessment:
    """Place ``tau`` against the median of the finite ``typed_distances``.

    Returns a :class:`~cachescore.types.TauAssessment`; ``regime`` is ``"principled"``,
    ``"too_sharp"`` (``tau < median/factor``), ``"too_flat"`` (``tau > median*factor``) or
    ``"undetermined"`` (no finite typed distance; the numeric fields are then NaN and
    ``n_typed`` is 0).
    """
    tau = float(tau)
    factor = float(factor)
    d = np.asarray(typed_distances, dtype=np.float64).ravel()
    d = d[np.isfinite(d)]
    if d.size == 0:
        nan = float("nan")
        return TauAssessment(tau, 0, nan, nan, nan, nan, factor, "undetermined")
    med = float(np.median(d))
    low, high = med / factor, med * factor
    regime = "too_sharp" if tau < low else "too_flat" if tau > high else "principled"
    return TauAssessment(tau, int(d.size), med, med, low, high, factor, regime)


def format_tau_warning(a: TauAssessment) -> str:
    """The off-scale warning text: scale (3 significant digits), count, window, tau, consequence."""
    if a.regime == "too_sharp":
        effect = (
            f"tau={a.tau:.3g} is below that window (median/{a.factor:g} = {a.low:.3g}), so exp(-d/tau) "
            "puts nearly all weight on the nearest typed neighbour (winner-take-all) and MaRI "
            "becomes noisy, driven by one sample per neighbourhood."
        )
    elif a.regime == "too_flat":
        effect = (
            f"tau={a.tau:.3g} is above that window (median*{a.factor:g} = {a.high:.3g}), so exp(-d/tau) "
            "is close to 1 for every neighbour and MaRI degenerates into the count-based RI, "
            "losing the margin information."
        )
    else:
        effect = f"tau={a.tau:.3g} lies on that scale."
    return (
        "MaRI tau looks mismatched to this dataset: typed (SO/OS) neighbour cosine distances have "
        f"median {a.median_typed_distance:.3g} (n={a.n_typed}), so a principled tau lies in about "
        f"[{a.low:.3g}, {a.high:.3g}] (recommended ~ {a.recommended_tau:.3g}). {effect} "
        "Move tau towards the recommended value, or turn this check off with warn_tau=False."
    )


def no_typed_neighbour_message(k: int) -> str:
    """Auto-tau fallback warning when no unit has a typed neighbour within its top-k window."""
    return (
        f"no typed (SO/OS) neighbour within the top-{int(k)} set anywhere in the dataset, so tau "
        f"cannot be put on a distance scale; using tau={TAU_FALLBACK} instead. MaRI is undefined "
        "for every sample here, so this value does not change the score."
    )


def collapsed_message(k: int) -> str:
    """Auto-tau fallback warning when the median typed distance within the top-k window is 0."""
    return (
        f"the median typed (SO/OS) neighbour distance within the top-{int(k)} set is 0, so tau "
        f"cannot be put on a distance scale; using tau={TAU_FALLBACK} instead. Typed neighbours "
        "exist but sit at distance 0, as a collapsed embedding or a manifest with duplicated rows "
        "produces. The score is still defined and reported: exp(-0/tau) = 1 for any positive tau, "
        "so MaRI carries no margin information on these neighbours and degenerates to the "
        "count-based RI."
    )
