"""Digest of every value a job stores, independent of fingerprints, run ids and timings.

Used to prove that a behaviour-preserving change (a move, a refactor) keeps every stored value
bit-identical: run it before and after on the same job and compare the printed digests.

    python benchmarks/stored_values_digest.py jobs/demo.toml --out /tmp/before.json
    python benchmarks/stored_values_digest.py jobs/demo.toml --out /tmp/after.json --compare /tmp/before.json

It runs the job into a fresh temporary store (a copy of the job with ``store`` redirected), then
hashes, per (encoder, view, metric, parameter label), the record's result fields and the per-unit
table's bytes (values, column order, dtypes). Fields that legitimately change with every run
(fingerprints, run ids, timestamps, durations, code version, package versions) are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from digest_compare import write_and_compare

# Keys whose values identify a run or a code state rather than a computed value.
# ``inputs`` holds content digests (kept); ``bundle`` is a path under the temporary store.
_VOLATILE = {"fingerprint", "unit_fingerprint", "run_id", "finished_at", "seconds", "seconds_load",
             "code_version", "bundle"}


def _timing(key: str) -> bool:
    """Wall-clock figures nested in a record (an out-of-core unit's ``neighbour_search``
    details: ``seconds_partition``, ``search_task_seconds``, ...)."""
    return key.startswith("seconds_") or key.endswith("_seconds")


def _strip(obj, drop=frozenset()):
    if isinstance(obj, dict):
        return {k: _strip(v, drop) for k, v in sorted(obj.items())
                if k not in _VOLATILE and k not in drop and not _timing(k)}
    if isinstance(obj, list):
        return [_strip(v, drop) for v in obj]
    return obj


def _frame_digest(df: pd.DataFrame) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([str(c) for c in df.columns]).encode())
    h.update(json.dumps([str(t) for t in df.dtypes]).encode())
    for c in df.columns:
        col = df[c]
        values = col.to_numpy()
        if values.dtype.kind in "biufcmM":  # numbers: their exact bytes
            h.update(np.ascontiguousarray(values).tobytes())
        else:  # strings, categoricals, objects: their text
            h.update(json.dumps([None if v is None else str(v) for v in values]).encode())
    return h.hexdigest()


def digest_store(store_path: Path, *, ignore=()) -> dict:
    """{unit label: {"record": sha256, "per_unit": sha256}} for every complete unit of a store;
    ``ignore``: more record keys to leave out (``inputs`` when the same rows are stored in
    another format, whose content digests differ)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from cachescore.store import ResultsStore

    store = ResultsStore(store_path)
    out = {}
    for fp in sorted(store.fingerprints()):
        rec = store.record(fp)
        label = "|".join(str(rec.get(k)) for k in ("encoder", "view", "metric", "design", "scope", "role_kind", "m"))
        body = json.dumps(_strip(rec, frozenset(ignore)), sort_keys=True, default=str)
        entry = {"record": hashlib.sha256(body.encode()).hexdigest()}
        try:
            entry["per_unit"] = _frame_digest(store.per_unit(fp))
        except Exception as exc:  # noqa: BLE001 - a unit without a table is reported as such
            entry["per_unit"] = f"none ({type(exc).__name__})"
        if label in out:
            label = f"{label}#{len(out)}"
        out[label] = entry
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare")
    ap.add_argument("--keep", help="run in this folder and keep it (default: a temporary one)")
    args = ap.parse_args(argv)
    job = Path(args.job).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.keep or tmp
        text = job.read_text()
        store = Path(tmp) / "store"
        lines = []
        for line in text.splitlines():
            if line.strip().startswith("store") and "=" in line:
                line = f'store = "{store}"'
            elif line.strip().startswith("cache") and "=" in line and not line.strip().startswith("cache_"):
                raw = line.split("=", 1)[1].split("#")[0].strip().strip('"')
                line = f'cache = "{(job.parent / raw).resolve()}"'
            lines.append(line)
        tmp_job = Path(tmp) / job.name
        tmp_job.write_text("\n".join(lines) + "\n")
        rc = subprocess.call([sys.executable, "-m", "cachescore.cli", "run", str(tmp_job)])
        if rc != 0:
            print(f"run exited {rc}", file=sys.stderr)
        digests = digest_store(store)
    compared = write_and_compare(digests, args.out, args.compare, what="units")
    return rc if compared is None else compared


if __name__ == "__main__":
    raise SystemExit(main())
