"""Errors that mean *bad input*, as opposed to a bug, and the tuple the runner records as such.

Every package's own errors subclass the matching builtin (``CacheError``, ``JobError``,
``LeakageError``, ``ProbeParamsError``, ``BundleError``, ``StoreError`` are ``ValueError``\\s;
``CacheNotFoundError`` is a ``FileNotFoundError``). A metric that cannot score its data raises
:class:`UnscorableError`, a ``RuntimeError`` as croma's own refusals are, so ``except
RuntimeError`` keeps working for croma-style callers.

:data:`DATA_ERRORS` is what a work unit records as its failure without retrying (ADR-0008).
Anything else — ``TypeError``, ``KeyError``, ``AttributeError``, an internal consistency
``RuntimeError``, a lost worker — is a bug or a transient fault: retried, then reported with its
traceback, never filed as bad data.
"""

from __future__ import annotations

__all__ = ["UnscorableError", "DATA_ERRORS", "RunAborted", "RunInterrupted"]


class UnscorableError(RuntimeError):
    """The data cannot be scored by this metric (too few rows, no valid k, no cross-group or typed
    neighbour, a zero margin denominator, a probe fit that does not converge, a recall target that
    no probe fraction reaches). The message names the dataset, scope or subset and the cause."""


#: Exceptions that mean "this unit's input cannot be scored": recorded as the unit's failure,
#: never retried. ``ValueError`` covers every validation error and the packages' error classes.
DATA_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, UnscorableError)


class RunAborted(OSError):
    """A run could not go on: the scheduler was lost, no worker joined for ``[execution]
    no_workers_timeout``, the store cannot be written. ``reason`` is one of ``scheduler-lost``,
    ``no-workers``, ``store-unwritable``; the message names the scheduler or store and how many units
    were done and not run. The run's provenance says ``aborted`` with this message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    def __str__(self) -> str:
        return str(self.args[0])


class RunInterrupted(BaseException):
    """The run was stopped by a signal (Ctrl-C: ``SIGINT``, ``SIGTERM``). A ``BaseException``, like
    ``KeyboardInterrupt``, so no ``except Exception`` swallows it; ``signum`` gives the exit code
    ``128 + signum`` (130, 143)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)
