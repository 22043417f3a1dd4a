"""What ``cachescore run`` prints while units finish: a tqdm bar on a terminal, lines in logs.

On a terminal (``out.isatty()``) a tqdm bar shows units done / total, the rate and the ETA, with
``waiting for workers`` while the cluster has none and the failure count; ``verbose`` adds one
line per finished unit above the bar. Elsewhere (a log file, CI) every finished unit is one line
with the same counts, rate and ETA (tqdm's own formatting), so logs stay readable.
"""

from __future__ import annotations

import time
from typing import TextIO

from tqdm import tqdm

__all__ = ["RunProgress"]

_LINE = "{n_fmt}/{total_fmt} units [{elapsed}<{remaining}, {rate_fmt}]"


class RunProgress:
    """Progress of ``total`` units written to ``out`` (None: silent)."""

    def __init__(self, total: int, out: TextIO | None, *, verbose: bool = False):
        self.total, self.out, self.verbose = int(total), out, bool(verbose)
        self.done = self.failed = 0
        self.waiting = False
        self.started = time.monotonic()
        self.tty = bool(out is not None and getattr(out, "isatty", lambda: False)())
        self.bar = (tqdm(total=self.total, file=out, unit="unit", dynamic_ncols=True, mininterval=0.2, leave=True)
                    if self.tty and self.total else None)

    def _postfix(self) -> None:
        parts = (["waiting for workers"] if self.waiting else []) + ([f"{self.failed} failed"] if self.failed else [])
        self.bar.set_postfix_str(", ".join(parts), refresh=True)

    def unit_done(self, label: str, status: str, seconds: float | None = None) -> None:
        """One unit ended with ``status`` (``done`` | ``FAILED``) after ``seconds``."""
        self.done += 1
        self.failed += status != "done"
        sec = f" {seconds:.1f}s" if seconds is not None else ""
        if self.out is None:
            return
        if self.bar is not None:
            if self.verbose:
                self.bar.write(f"{status} {label}{sec}", file=self.out)
            self.bar.update(1)
            self._postfix()
            return
        head = tqdm.format_meter(self.done, self.total, time.monotonic() - self.started, unit="unit",
                                 bar_format=_LINE)
        tail = f" ({self.failed} failed)" if self.failed else ""
        self.out.write(f"{head}{tail}  {status} {label}{sec}\n")
        self.out.flush()

    def set_waiting(self, waiting: bool, detail: str = "") -> None:
        """Show (or clear) "waiting for workers" (on a terminal: in the bar; in logs: one line)."""
        if waiting == self.waiting:
            return
        self.waiting = waiting
        if self.out is None:
            return
        if self.bar is not None:
            self._postfix()
        elif waiting:
            self.out.write(f"waiting for workers{': ' + detail if detail else ''}\n")
            self.out.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
