"""Results store: fingerprints, atomic writes, explicit schemas, provenance.

Public names: :func:`fingerprint` (sha256 of canonical JSON), :class:`ResultsStore`,
:data:`SCORES_SCHEMA`, :data:`FAILURES_SCHEMA`, :class:`StoreError`, :class:`CorruptRecordError`.
"""

from ..fingerprint import canonical_json, fingerprint
from .results import CorruptRecordError, ResultsStore, StoreError
from .schema import FAILURES_SCHEMA, SCORES_SCHEMA

__all__ = ["fingerprint", "canonical_json", "ResultsStore", "StoreError", "CorruptRecordError",
           "SCORES_SCHEMA", "FAILURES_SCHEMA"]
