"""Digest of every value the parity suites' datasets give through our public API (no croma).

Proves that a behaviour-preserving change keeps the numbers of the parity corpora bit-identical:
run it against the tree before and after and compare the digests (one run per tree, each in its
own process, because each imports its own ``cachescore``).

    python benchmarks/parity_values_digest.py --src /path/to/old/src --out /tmp/parity-before.json
    python benchmarks/parity_values_digest.py --src src --out /tmp/parity-after.json --compare /tmp/parity-before.json

Datasets: ``tests/test_ri_mari_parity.make_case`` (seeds 0-2 × its cases) and
``tests/test_croma_parity.all_design_case`` / ``paired_case`` with ``_params`` (seeds 0-19 / 0-9),
the generators of the suites themselves (taken from *this* checkout's tests, so both trees see
the same data). Per dataset and metric: every field of the result (value, std, k, tau, per-unit
values, masks, curves, schedule, ...) as exact bytes, or the exception's type and message. RI and
MaRI are also run through the in-memory ANN engine (``cross_group_knn_ann``) at recall target 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import warnings
from pathlib import Path

import numpy as np
from digest_compare import write_and_compare

HERE = Path(__file__).resolve().parents[1]


def _bytes(value) -> bytes:
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return json.dumps([None if v is None else str(v) for v in value.ravel().tolist()]).encode()
        return str(value.dtype).encode() + str(value.shape).encode() + np.ascontiguousarray(value).tobytes()
    if isinstance(value, dict):
        return b"{" + b",".join(str(k).encode() + b":" + _bytes(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + b"}"
    if isinstance(value, (list, tuple)):
        return b"[" + b",".join(_bytes(v) for v in value) + b"]"
    if isinstance(value, float):
        return np.float64(value).tobytes()
    return repr(value).encode()


def _digest(result) -> str:
    h = hashlib.sha256()
    if isinstance(result, BaseException):
        h.update(f"{type(result).__name__}:{result}".encode())
        return "raised " + h.hexdigest()
    if isinstance(result, dict):  # CRoMa with a list of m
        return "|".join(f"{k}={_digest(v)}" for k, v in result.items())
    for f in dataclasses.fields(result):
        h.update(f.name.encode() + b"=" + _bytes(getattr(result, f.name)) + b";")
    return h.hexdigest()


def _run(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the exception is part of the digest
            return exc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True, help="the src/ folder whose cachescore is measured")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(args.src).resolve()))
    sys.path.insert(1, str(HERE / "tests"))
    import cachescore
    from cachescore import CRoMa, MaRI, RI
    from cachescore.neighbors.ann import cross_group_knn_ann

    assert Path(cachescore.__file__).resolve().is_relative_to(Path(args.src).resolve()), cachescore.__file__
    import test_croma_parity as cp
    import test_ri_mari_parity as rp

    out = {}
    for seed in range(3):
        for case in range(rp.N_CASES):
            try:
                x, df, design, ks, _ = rp.make_case(seed, case)
            except BaseException:  # noqa: BLE001 - pytest.fail when no tie-free draw: skipped alike
                continue
            kw = dict(confounder_column=rp.CONF, evaluation_design=design, k_candidates=ks)
            ann = lambda u, g, k: cross_group_knn_ann(u, g, k, recall_target=1.0, random_state=0)  # noqa: E731
            out[f"ri/{seed}/{case}"] = _digest(_run(RI.compute, x, df, **kw))
            out[f"mari/{seed}/{case}"] = _digest(_run(MaRI.compute, x, df, **kw))
            out[f"ri-ann/{seed}/{case}"] = _digest(_run(RI.compute_with, ann, x, df, **kw))
            out[f"mari-ann/{seed}/{case}"] = _digest(_run(MaRI.compute_with, ann, x, df, **kw))
    for design, make, seeds in (("all", cp.all_design_case, range(20)), ("paired_2x2", cp.paired_case, range(10))):
        for seed in seeds:
            x, df = make(seed)
            params = cp._params(np.random.default_rng([seed, 99]))
            out[f"croma-{design}/{seed}"] = _digest(_run(CRoMa.compute, x, df, confounder_column="center",
                                                       evaluation_design=design, **params))
    print(f"measured {cachescore.__file__}")
    return write_and_compare(out, args.out, args.compare, what="results") or 0


if __name__ == "__main__":
    raise SystemExit(main())
