"""Job files: the versioned TOML schema that says what to score, where (see :mod:`.schema`)."""

from .schema import (
    SCHEMA,
    SCHEMA_VERSION,
    Job,
    JobError,
    describe_schema,
    load_job,
    parse_job,
)

__all__ = ["SCHEMA", "SCHEMA_VERSION", "Job", "JobError", "describe_schema", "load_job", "parse_job"]
