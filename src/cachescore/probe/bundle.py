"""Atomic, checksummed evaluation bundles (spec ``evaluation.md`` C.6, Part D "Bundles").

Layout of a bundle folder (by default ``<results>/<encoder_id>/<run_id>/``, see
:func:`write_encoder_bundle`)::

    matrices/<i>.npy                one float64 (n_splits, iterations) matrix per name (no pickle)
    summary.json                    per (replicate, split, role) metrics and per-role aggregates,
                                    matrix names, APD, nIPD, Cramér's V, chance, seeds, warnings
    metrics.parquet                 per (replicate, split, role) metrics
    per_centre_metrics.parquet      the same metrics per centre (centre first)
    confusion.parquet               long-form confusion counts (r, s, role, true, pred, count, fraction)
    calibration.parquet             long-form calibration tables (raw, and temperature when on)
    probe_selection.parquet         validation score of every C
    predictions.parquet             held-out predictions (identities, raw + calibrated probabilities)
    split_report.json               one split report per (replicate, split) (spec C.4)
    leakage.json                    plan audit + this encoder's content audit; ``passed`` is null
                                    with a critical ``not_audited`` when an audit did not run
    manifest.json                   written LAST: schema_version, encoder_id, cache_fingerprint,
                                    split_plan_sha256, seeds, library versions, UTC creation time,
                                    sha256 + size of every other file, leakage_passed, warnings

Atomicity: everything is written into a staging sibling ``.<name>.tmp-<uuid>`` in the same parent
(same filesystem), then renamed to ``<name>`` in one step. An existing bundle is refused unless
``overwrite=True``, in which case the old folder is first renamed aside, the staging folder is
renamed into place, and only then the old one is deleted; two runs' files are never mixed. A
writer interrupted before the rename leaves at most a staging folder, which is not a bundle (the
target is untouched).

Reading verifies the schema major version, every listed file's size and sha256, and refuses
missing files and files the manifest does not list. JSON is strict (no NaN / Infinity tokens;
NaN is stored as null; sorted keys; UTF-8). Pickles are never written or loaded.

Reruns: :func:`find_bundle` / :func:`bundle_is_current` recognise a complete, verified bundle with
the same split-plan hash and cache fingerprint; :func:`run_encoder_evaluation` then skips the
work entirely (no probe is fitted).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .._hashing import sha256_file
from .._jsonsafe import json_safe
from .._version import package_versions
from .evaluate import SweepEvaluation, SweepIdentities, SweepParams, evaluate_sweep
from .plan import _prepare

__all__ = [
    "BUNDLE_SCHEMA_VERSION",
    "BundleError",
    "BundleExistsError",
    "bundle_is_current",
    "find_bundle",
    "list_bundles",
    "read_bundle",
    "read_manifest",
    "run_encoder_evaluation",
    "write_bundle",
    "write_encoder_bundle",
]

#: Distributions whose versions a bundle's provenance records.
_BUNDLE_DISTRIBUTIONS = ("numpy", "pandas", "scikit-learn", "scipy", "dask", "pyarrow", "cachescore")

#: ``major.minor``; a reader refuses an unknown major version. 2.0: C.6 layout (leakage.json with
#: plan + content audits, predictions, per-centre metrics, split reports, plan hash in the manifest).
BUNDLE_SCHEMA_VERSION = "2.0"

MANIFEST = "manifest.json"
#: SweepEvaluation frame field -> parquet file name.
_FRAMES = {
    "metrics": "metrics.parquet",
    "per_centre": "per_centre_metrics.parquet",
    "confusion": "confusion.parquet",
    "calibration": "calibration.parquet",
    "probe_selection": "probe_selection.parquet",
    "predictions": "predictions.parquet",
}


class BundleError(ValueError):
    """A bundle is missing, incomplete, tampered with, or of an unknown schema."""


class BundleExistsError(BundleError, FileExistsError):
    """The target bundle exists and ``overwrite`` was not given."""


# ---------------------------------------------------------------------------------------------
# strict JSON


def _dump_json(obj: Any, path: Path) -> None:
    text = json.dumps(json_safe(obj), sort_keys=True, indent=2, allow_nan=False, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def _reject_constant(name: str):
    raise BundleError(f"non-strict JSON token {name!r}")


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"), parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from exc


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# write


def _summary_records(metrics: pd.DataFrame) -> tuple[list, dict]:
    cols = [c for c in metrics.columns if c not in ("seed",)]
    records = metrics[cols].to_dict(orient="records")
    numeric = [c for c in metrics.columns
               if c not in ("replicate", "split", "seed", "best_C", "temperature")
               and pd.api.types.is_numeric_dtype(metrics[c]) and not pd.api.types.is_bool_dtype(metrics[c])]
    agg = {str(role): {c: float(g[c].mean()) for c in numeric}
           for role, g in metrics.groupby("role", sort=False)}
    return records, agg


def _write_files(evaluation: SweepEvaluation, stage: Path) -> list[str]:
    """Write every data file into ``stage``; return their relative paths (manifest excluded)."""
    files: list[str] = []
    (stage / "matrices").mkdir()
    names = list(evaluation.matrices)
    matrix_files = []
    for i, name in enumerate(names):
        rel = f"matrices/{i:03d}.npy"
        np.save(stage / rel, np.ascontiguousarray(evaluation.matrices[name], dtype=np.float64),
                allow_pickle=False)
        matrix_files.append(rel)
        files.append(rel)
    per_outcome, aggregates = _summary_records(evaluation.metrics)
    summary = {
        "matrices": [{"name": n, "file": f} for n, f in zip(names, matrix_files)],
        "replicate_seeds": list(evaluation.replicate_seeds),
        "cramers_v": None if evaluation.cramers_v is None else [float(v) for v in evaluation.cramers_v],
        "chance": evaluation.chance,
        "n_classes": evaluation.n_classes,
        "class_names": list(evaluation.class_names),
        "apd": evaluation.apd,
        "nipd": evaluation.nipd,
        "split_plan_sha256": evaluation.plan_sha256,
        "parameters": evaluation.parameters,
        "warnings": list(evaluation.warnings),
        "leakage_passed": evaluation.leakage["passed"],
        "metrics": per_outcome,
        "aggregates": aggregates,
    }
    _dump_json(summary, stage / "summary.json")
    files.append("summary.json")
    for name, rel in _FRAMES.items():
        getattr(evaluation, name).to_parquet(stage / rel, engine="pyarrow", index=False)
        files.append(rel)
    _dump_json(evaluation.split_reports, stage / "split_report.json")
    files.append("split_report.json")
    _dump_json(evaluation.leakage, stage / "leakage.json")
    files.append("leakage.json")
    return files


def _write_manifest(stage: Path, files: list[str], provenance: dict, evaluation: SweepEvaluation,
                    identity: dict) -> None:
    entries = {rel: {"sha256": sha256_file(stage / rel), "size": (stage / rel).stat().st_size}
               for rel in sorted(files)}
    manifest = {
        "schema_version": BUNDLE_SCHEMA_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds"),
        "encoder_id": identity.get("encoder_id"),
        "cache_fingerprint": identity.get("cache_fingerprint"),
        "run_id": identity.get("run_id"),
        "split_plan_sha256": evaluation.plan_sha256,
        "seeds": {"base": evaluation.parameters.get("seed"),
                  "replicates": list(evaluation.replicate_seeds)},
        "replicate_seeds": list(evaluation.replicate_seeds),
        "files": entries,
        "provenance": provenance,
        "library_versions": package_versions(_BUNDLE_DISTRIBUTIONS),
        "leakage_passed": evaluation.leakage["passed"],
        "warnings": list(evaluation.warnings),
    }
    _dump_json(manifest, stage / MANIFEST)


def _discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def write_bundle(
    evaluation: SweepEvaluation,
    path,
    *,
    provenance: dict,
    overwrite: bool = False,
    encoder_id: str | None = None,
    cache_fingerprint: str | None = None,
) -> Path:
    """Write ``evaluation`` as a bundle folder at ``path`` atomically; return the final path.

    Parameters
    ----------
    evaluation : SweepEvaluation
    path : folder to create (its parent must exist).
    provenance : JSON-serialisable dict (encoder id, cache fingerprint, parameters, ...),
        stored in the manifest. Values that strict JSON cannot hold raise ValueError up front.
    overwrite : replace an existing bundle (old folder moved aside, then removed after the
        new one is in place).
    encoder_id, cache_fingerprint : recorded at the top of the manifest (what
        :func:`bundle_is_current` compares, with the split-plan hash).

    Raises
    ------
    BundleExistsError (a ValueError and FileExistsError)
        ``path`` exists and ``overwrite`` is False.
    FileNotFoundError
        The parent folder does not exist.
    """
    if not isinstance(evaluation, SweepEvaluation):
        raise TypeError(f"write_bundle needs a SweepEvaluation, got {type(evaluation).__name__}")
    if not isinstance(provenance, dict):
        raise TypeError(f"provenance must be a dict, got {type(provenance).__name__}")
    try:
        json.dumps(json_safe(provenance), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"provenance must be JSON-serialisable: {exc}") from exc
    target = Path(path)
    parent = target.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"bundle parent folder {parent} does not exist")
    if target.exists() and not overwrite:
        raise BundleExistsError(f"bundle {target} already exists; pass overwrite=True to replace it")

    stage = parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    stage.mkdir()
    try:
        files = _write_files(evaluation, stage)
        identity = {"encoder_id": encoder_id, "cache_fingerprint": cache_fingerprint,
                    "run_id": target.name}
        _write_manifest(stage, files, provenance, evaluation, identity)  # the commit marker, last
        _fsync_dir(stage)
        old = None
        if target.exists():
            if not overwrite:
                raise BundleExistsError(f"bundle {target} appeared while writing; not replaced")
            old = parent / f".{target.name}.old-{uuid.uuid4().hex}"
            os.rename(target, old)
        try:
            os.rename(stage, target)  # fails if target reappeared: never merges two runs
        except OSError:
            if old is not None and not target.exists():
                os.rename(old, target)
            raise
        _fsync_dir(parent)
        if old is not None:
            _discard(old)
    except BaseException:
        _discard(stage)
        raise
    return target


# ---------------------------------------------------------------------------------------------
# read


def _verified_files(root: Path, manifest: dict) -> dict:
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise BundleError(f"{root / MANIFEST}: manifest lists no files")
    for rel, meta in files.items():
        p = root / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise BundleError(f"{root / MANIFEST}: unsafe file name {rel!r}")
        if not p.is_file():
            raise BundleError(f"{root}: file '{rel}' listed in the manifest is missing")
        if p.stat().st_size != meta.get("size"):
            raise BundleError(f"{root}: file '{rel}' has size {p.stat().st_size}, manifest says {meta.get('size')}")
        digest = sha256_file(p)
        if digest != meta.get("sha256"):
            raise BundleError(f"{root}: checksum mismatch for '{rel}' (sha256 {digest}, manifest {meta.get('sha256')})")
    present = {str(p.relative_to(root).as_posix()) for p in root.rglob("*") if p.is_file()}
    extra = sorted(present - set(files) - {MANIFEST})
    if extra:
        raise BundleError(f"{root}: files not listed in the manifest: {extra}")
    return files


def read_manifest(path) -> dict:
    """Load and check a bundle's manifest (strict JSON, known major schema version)."""
    root = Path(path)
    mpath = root / MANIFEST
    if not root.is_dir():
        raise FileNotFoundError(f"no bundle at {root}")
    if not mpath.is_file():
        raise BundleError(f"{root}: no {MANIFEST}; the bundle is incomplete (a writer did not finish)")
    manifest = _load_json(mpath)
    version = str(manifest.get("schema_version", ""))
    if version.split(".")[0] != BUNDLE_SCHEMA_VERSION.split(".")[0]:
        raise BundleError(f"{mpath}: unknown bundle schema_version {version!r}; this reader knows {BUNDLE_SCHEMA_VERSION}")
    return manifest


def read_bundle(path) -> SweepEvaluation:
    """Read a bundle written by :func:`write_bundle`, verifying every checksum.

    Raises
    ------
    FileNotFoundError
        ``path`` is not a folder.
    BundleError (a ValueError)
        No manifest; unknown schema major version; a listed file missing, resized or with a
        different sha256 (the file is named); an unlisted file present; non-strict JSON.
    """
    root = Path(path)
    manifest = read_manifest(root)
    _verified_files(root, manifest)
    summary = _load_json(root / "summary.json")
    leakage = _load_json(root / "leakage.json")
    matrices = {}
    for entry in summary["matrices"]:
        arr = np.load(root / entry["file"], allow_pickle=False)
        matrices[entry["name"]] = np.ascontiguousarray(arr, dtype=np.float64)
    frames = {name: pd.read_parquet(root / rel, engine="pyarrow") for name, rel in _FRAMES.items()}
    cv = summary["cramers_v"]
    return SweepEvaluation(
        matrices=matrices,
        replicate_seeds=tuple(int(x) for x in summary["replicate_seeds"]),
        cramers_v=None if cv is None else np.asarray(cv, dtype=np.float64),
        chance=float(summary["chance"]),
        n_classes=int(summary["n_classes"]),
        class_names=tuple(summary["class_names"]),
        apd={k: (None if v is None else float(v)) for k, v in summary["apd"].items()},
        nipd={k: (None if v is None else float(v)) for k, v in summary["nipd"].items()},
        split_reports=_load_json(root / "split_report.json"),
        plan_sha256=summary["split_plan_sha256"],
        audit=leakage["plan"],
        content_audit=leakage["content"],
        parameters=summary["parameters"],
        warnings=tuple(summary["warnings"]),
        **frames,
    )


# ---------------------------------------------------------------------------------------------
# results tree: <results>/<encoder_id>/<run_id>/, discovery, reruns


def _check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not value or value in (".", "..") or "/" in value or "\\" in value \
            or value.startswith("."):
        raise ValueError(f"{what} must be a non-empty folder name without '/' or a leading '.', got {value!r}")
    return value


def write_encoder_bundle(
    evaluation: SweepEvaluation,
    results,
    *,
    encoder_id: str,
    cache_fingerprint: str,
    run_id: str | None = None,
    provenance: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``evaluation`` to ``<results>/<encoder_id>/<run_id>/`` atomically; return the path.

    ``run_id`` defaults to ``<UTC yyyymmddTHHMMSS.ffffff>Z-<first 12 hex of the plan hash>``.
    The encoder folder is created when missing. Raises as :func:`write_bundle`, and ValueError
    for an unusable ``encoder_id`` / ``run_id``.
    """
    _check_name(encoder_id, "encoder_id")
    if not isinstance(cache_fingerprint, str) or not cache_fingerprint:
        raise ValueError(f"cache_fingerprint must be a non-empty string, got {cache_fingerprint!r}")
    if run_id is None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        run_id = f"{stamp}-{(evaluation.plan_sha256 or 'unplanned')[:12]}"
    _check_name(run_id, "run_id")
    folder = Path(results) / encoder_id
    folder.mkdir(parents=True, exist_ok=True)
    return write_bundle(evaluation, folder / run_id, provenance=dict(provenance or {}),
                        overwrite=overwrite, encoder_id=encoder_id, cache_fingerprint=cache_fingerprint)


def list_bundles(root) -> list[Path]:
    """Every folder under ``root`` holding a manifest.json, newest manifest mtime first.

    Staging folders (names starting with ``.``) are skipped. A missing root raises
    FileNotFoundError. Completeness is NOT verified here (see :func:`bundle_is_current`).
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no results folder at {root}")
    found = [m.parent for m in root.rglob(MANIFEST)
             if not any(part.startswith(".") for part in m.parent.relative_to(root).parts)]
    return sorted(found, key=lambda p: ((p / MANIFEST).stat().st_mtime_ns, str(p)), reverse=True)


def bundle_is_current(path, *, split_plan_sha256: str, cache_fingerprint: str,
                      encoder_id: str | None = None) -> bool:
    """True when ``path`` is a complete, checksum-verified bundle of the same plan and cache.

    A missing, incomplete or tampered bundle, an unknown schema, or any mismatch gives False
    (it is then recomputed, never trusted or converted).
    """
    try:
        manifest = read_manifest(path)
        _verified_files(Path(path), manifest)
    except (BundleError, OSError):
        return False
    return (
        manifest.get("split_plan_sha256") == split_plan_sha256
        and manifest.get("cache_fingerprint") == cache_fingerprint
        and (encoder_id is None or manifest.get("encoder_id") == encoder_id)
    )


def find_bundle(results, encoder_id: str, *, split_plan_sha256: str, cache_fingerprint: str) -> Path | None:
    """Newest current bundle of ``encoder_id`` under ``results`` (see :func:`bundle_is_current`)."""
    folder = Path(results) / _check_name(encoder_id, "encoder_id")
    if not folder.is_dir():
        return None
    for path in list_bundles(folder):
        if bundle_is_current(path, split_plan_sha256=split_plan_sha256,
                             cache_fingerprint=cache_fingerprint, encoder_id=encoder_id):
            return path
    return None


def run_encoder_evaluation(
    embeddings,
    confounders,
    labels,
    *,
    results,
    encoder_id: str,
    cache_fingerprint: str,
    run_id: str | None = None,
    overwrite: bool = False,
    provenance: dict | None = None,
    params: SweepParams,
    identities: SweepIdentities,
    test_sets=None,
    client=None,
) -> tuple[Path, bool]:
    """Plan, skip if a current bundle exists, else audit + fit + evaluate + write one bundle.

    ``params``, ``identities``, ``test_sets`` and ``client`` are those of
    :func:`cachescore.probe.evaluate.evaluate_sweep`. The plan
    (and its hash) is built first, without fitting; when :func:`find_bundle` finds a complete
    bundle with that hash and ``cache_fingerprint`` nothing else runs.

    Returns ``(bundle path, skipped)``.
    """

    prepared = _prepare(embeddings, confounders, labels, test_sets=test_sets, **params.plan_kwargs())
    existing = find_bundle(results, encoder_id, split_plan_sha256=prepared[0].sha256,
                           cache_fingerprint=cache_fingerprint)
    if existing is not None and not overwrite:
        return existing, True
    evaluation = evaluate_sweep(embeddings, confounders, labels, params=params, identities=identities,
                                test_sets=test_sets, client=client, prepared=prepared)
    path = write_encoder_bundle(evaluation, results, encoder_id=encoder_id,
                                cache_fingerprint=cache_fingerprint, run_id=run_id,
                                provenance=provenance, overwrite=overwrite)
    return path, False
