"""The reference's neighbour fetch rule (spec §3.2), shared by the metrics and the engines.

croma fetches ``kmax + B`` neighbours per row, ``B = max(MIN_NEIGHBOR_BUFFER, largest group)``;
when that reaches ``n - 1`` the fetch is *capped* (every row of the scope is fetched) and the
metric's windows follow the cap rule. Engines that cannot reproduce a capped fetch (the
out-of-core engine) refuse such scopes with :func:`is_capped`.
"""

from __future__ import annotations

__all__ = ["MIN_NEIGHBOR_BUFFER", "is_capped"]

#: The reference's minimum fetch buffer beyond ``kmax`` (``B = max(64, G)``).
MIN_NEIGHBOR_BUFFER = 64


def is_capped(kmax: int, n: int, max_group_size: int) -> bool:
    """True when the reference's fetch for ``kmax`` hits ``n - 1`` (spec §3.2)."""
    return int(kmax) + max(MIN_NEIGHBOR_BUFFER, int(max_group_size)) >= int(n) - 1
