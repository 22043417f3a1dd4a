"""Results store: fingerprints, atomic writes, explicit schemas, provenance.

Public names: :func:`fingerprint` (sha256 of canonical JSON), :class:`ResultsStore`,
:data:`SCORES_SCHEMA`, :data:`FAILURES_SCHEMA`, :class:`StoreError`, :class:`CorruptRecordError`.
"""

from ..fingerprint import canonical_json, fingerprint
from .results import (
    BUNDLES_DIR,
    CENTRES_FILE,
    SCRATCH_DIR,
    TABLE_CACHE_DIR,
    PROBE_FILE,
    REPORT_FILE,
    SCORES_FILE,
    STORE_MARKER,
    CorruptRecordError,
    ResultsStore,
    StoreError,
    default_bundles,
    is_store,
    scratch_path,
)
from .schema import FAILURES_SCHEMA, SCORES_SCHEMA

__all__ = ["fingerprint", "canonical_json", "ResultsStore", "StoreError", "CorruptRecordError",
           "SCORES_SCHEMA", "FAILURES_SCHEMA", "STORE_MARKER", "SCORES_FILE", "PROBE_FILE", "CENTRES_FILE",
           "REPORT_FILE", "BUNDLES_DIR", "SCRATCH_DIR", "TABLE_CACHE_DIR", "is_store", "scratch_path", "default_bundles"]
