"""Per-thread warning capture for work units that share a process (one concern: ``warnings`` state).

``warnings.catch_warnings`` swaps process-wide state, which breaks when units share a process:
large-scope units are driven concurrently on threads of the client process, a worker may run a
metric unit while a probe unit's orchestration (seceded) and its replicate tasks run, and in-process
clusters (tests, embedding callers) run every task in the caller's process. :func:`captured_warnings`
records the warnings of one thread; :func:`hold_capture` keeps the process-wide part installed for
the lifetime of a worker or an in-process cluster, so a library's own ``catch_warnings`` block on
another thread (scikit-learn, pandas) that starts before one unit's capture and ends during it
cannot restore the caller's filters (e.g. pytest's ``error``) under a capturing unit.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager

__all__ = ["captured_warnings", "hold_capture"]

_WARN_LOCK = threading.Lock()
_WARN_LOCAL = threading.local()
_WARN_STATE: dict = {"depth": 0, "guard": None, "show": None}


def _show_on_thread(message, category, filename, lineno, file=None, line=None):
    sink = getattr(_WARN_LOCAL, "sink", None)
    if sink is None:  # a thread that is not capturing: what was installed before
        _WARN_STATE["show"](message, category, filename, lineno, file, line)
    else:
        sink.append(warnings.WarningMessage(message, category, filename, lineno, file, line))


def _enter() -> None:
    with _WARN_LOCK:
        if _WARN_STATE["depth"] == 0:
            guard = warnings.catch_warnings()
            guard.__enter__()
            warnings.simplefilter("always")
            _WARN_STATE.update(guard=guard, show=warnings.showwarning)
            warnings.showwarning = _show_on_thread
        _WARN_STATE["depth"] += 1


def _leave() -> None:
    with _WARN_LOCK:
        _WARN_STATE["depth"] -= 1
        if _WARN_STATE["depth"] == 0:
            guard = _WARN_STATE["guard"]
            _WARN_STATE.update(guard=None, show=None)
            guard.__exit__(None, None, None)


@contextmanager
def hold_capture():
    """Keep the capture's process-wide filter (``always``) and dispatcher installed while the
    block runs; threads that are not capturing still see their warnings shown as before."""
    _enter()
    try:
        yield
    finally:
        _leave()


@contextmanager
def captured_warnings():
    """Record every warning raised **on this thread** into the yielded list (``WarningMessage``).

    ``warnings.catch_warnings`` swaps process-wide state, which breaks when units share a process:
    large-scope units are driven concurrently on threads of the client process
    (``pipeline.unit.drive_large_unit``), and a worker with several threads runs several unit tasks. One
    unit's exit would restore the filters (e.g. ``error``) while another still computes, and
    warnings would land in the wrong record. Here the first capturing thread installs an
    ``always`` filter and a dispatcher that appends to the raising thread's own list; the last
    one to leave restores the previous state. Threads that are not capturing keep the previous
    ``showwarning``.
    """
    sink: list = []
    _enter()
    previous = getattr(_WARN_LOCAL, "sink", None)
    _WARN_LOCAL.sink = sink
    try:
        yield sink
    finally:
        _WARN_LOCAL.sink = previous
        if previous is not None:
            previous.extend(sink)
        _leave()
