"""One rule for gathering a group of Dask futures, shared by the engines and the pipeline: the
first failure cancels the rest before it is raised, so no task of a failed step keeps a worker
busy (or writes a file) after the caller has given up on it."""

from __future__ import annotations

__all__ = ["gather_or_cancel"]


def gather_or_cancel(client, futures):
    """Gather ``futures``; if one task fails, cancel the others before re-raising its error."""
    try:
        return client.gather(futures)
    except BaseException:
        client.cancel(futures)
        raise
