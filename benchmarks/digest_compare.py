"""Writing and comparing the digest files of ``stored_values_digest.py`` and ``parity_values_digest.py``."""

from __future__ import annotations

import json
from pathlib import Path


def write_and_compare(digests: dict, out: str, compare: str | None, *, what: str) -> int | None:
    """Write ``digests`` to ``out``; with ``compare`` (an earlier file) print every differing key
    and return 1 if any differs, else 0. Without ``compare`` return None."""
    Path(out).write_text(json.dumps(digests, indent=1, sort_keys=True))
    print(f"{len(digests)} {what} digested -> {out}")
    if not compare:
        return None
    before = json.loads(Path(compare).read_text())
    diff = sorted(k for k in set(before) | set(digests) if before.get(k) != digests.get(k))
    for k in diff:
        print(f"DIFFERENT {k}: {before.get(k)} -> {digests.get(k)}")
    print("identical" if not diff else f"{len(diff)} {what} differ")
    return 1 if diff else 0
