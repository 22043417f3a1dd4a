"""Ctrl-C and SIGTERM during a run, taken at a safe point.

Python runs a signal handler in the main thread between any two bytecodes, so an exception raised
from it (``KeyboardInterrupt``, or the CLI's :class:`~cachescore.errors.RunInterrupted` for
SIGTERM) can land inside distributed's own synchronous machinery — half way into
``Client.sync`` it leaves distributed logging a ``NameError`` traceback from its cancel callback,
or a future half registered. While the run's completion loop waits, :class:`DeferredInterrupts`
instead records the signal and the loop raises it at the top of its next turn (within its poll
interval, 0.5 s). A second signal while one is pending raises at once: a user who presses Ctrl-C
twice is never ignored.
"""

from __future__ import annotations

import signal
import threading

from ..errors import RunInterrupted

__all__ = ["DeferredInterrupts"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DeferredInterrupts:
    """Context manager: while inside, SIGINT and SIGTERM are recorded, not raised; call
    :meth:`check` at a safe point to raise :class:`~cachescore.errors.RunInterrupted` (``signum``
    of the first signal). A second signal before ``check`` raises immediately. The previous
    handlers are restored on exit, and a signal not yet raised is raised then (unless another
    exception is already leaving the block). A signal the caller set to ``SIG_IGN`` stays ignored.
    Outside the main thread (an embedding caller's worker thread) it changes nothing and
    :meth:`check` never raises: signals are not this thread's to take."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.signum is not None:
            raise RunInterrupted(self.signum)
        self.signum = int(signum)

    def __enter__(self) -> "DeferredInterrupts":
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                previous = signal.signal(sig, self._handler)
                if previous is signal.SIG_IGN:  # ignored by the caller (nohup, a batch wrapper): stays so
                    signal.signal(sig, previous)
                else:
                    self._previous[sig] = previous
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        while self._previous:
            sig, handler = self._previous.popitem()
            signal.signal(sig, handler)
        if exc_type is None:
            self.check()  # a signal after the last check is not lost

    def check(self) -> None:
        """Raise :class:`~cachescore.errors.RunInterrupted` if a signal came since entry."""
        if self.signum is not None:
            raise RunInterrupted(self.signum)
