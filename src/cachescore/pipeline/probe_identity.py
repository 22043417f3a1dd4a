"""Which probe unit and records a job has: their identities and fingerprints, and whether the store
holds them (what planning and ``status`` need; running the sweep is :mod:`.probe_unit`, which
imports the probe machinery and scikit-learn, so planning does not).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..cache import Cache
from ..fingerprint import code_version as current_code_version
from ..fingerprint import fingerprint
from ..metrics import families
from ..probe.params import ProbeParams

__all__ = ["probe_unit_fingerprint", "probe_record_fingerprint", "probe_record_keys", "probe_unit_done"]


def _cache(cache):
    return cache if isinstance(cache, Cache) else Cache(cache)


def _unit_identity(cache, encoder: str, view: str, params: ProbeParams, code_version: str | None,
                   inputs: Mapping | None = None) -> dict:
    spec = cache.view_spec(view)
    if inputs is None:
        inputs = {"embeddings": cache.embedding_fingerprint(encoder, spec.tileset),
                  "view": cache.view_fingerprint(view)}
    else:
        inputs = {"embeddings": str(inputs["embeddings"]), "view": str(inputs["view"])}
    return {
        "kind": "cachescore.probe-unit/1",
        "encoder": encoder,
        "view": view,
        "tileset": spec.tileset,
        "params": params.to_dict(),
        "inputs": inputs,
        "code": current_code_version("probe") if code_version is None else str(code_version),
    }


def probe_unit_fingerprint(cache, encoder: str, view: str, params: ProbeParams | Mapping,
                           code_version: str | None = None, *, inputs: Mapping | None = None) -> str:
    """sha256 hex of the unit's canonical identity: encoder, view, tileset, normalised params,
    input fingerprints (``Cache.embedding_fingerprint`` of (encoder, the view's tileset),
    ``Cache.view_fingerprint``) and the code version (default :func:`cachescore.fingerprint.code_version` ``("probe")``).

    ``cache`` is a :class:`~cachescore.cache.Cache` or its folder. ``inputs``: the input
    fingerprints ``{"embeddings": ..., "view": ...}`` when the caller already has them (a plan
    computes each once); they must be exactly those two ``Cache`` values, and then only the view
    sidecar is read. Without ``inputs`` the view's Parquet and ``tiles.parquet`` are hashed here.
    Raises what the cache raises for a missing encoder / view (``CacheError`` subclasses),
    ``KeyError`` when ``inputs`` lacks a key.
    """
    return fingerprint(_unit_identity(_cache(cache), encoder, view, ProbeParams.coerce(params), code_version, inputs))


def probe_record_fingerprint(unit_fingerprint: str, matrix: str, metric: str) -> str:
    """Store key of the record of reduction ``metric`` (``apd`` | ``nipd``) of ``matrix``."""
    return fingerprint({"kind": "cachescore.probe-record/1", "unit": unit_fingerprint,
                        "matrix": matrix, "metric": metric})


def probe_record_keys(params: ProbeParams | Mapping) -> list[tuple[str, str]]:
    """``[(matrix, metric), ...]`` a unit with ``params`` produces, in record order."""
    return [(m, r) for m in ProbeParams.coerce(params).matrix_names for r in families.names(families.PROBE)]


def probe_unit_done(store, unit_fingerprint: str, params: ProbeParams | Mapping) -> bool:
    """True when ``store`` (a ``ResultsStore``) holds every record of the unit (skip it)."""
    return all(store.has(probe_record_fingerprint(unit_fingerprint, m, r)) for m, r in probe_record_keys(params))
