"""One run per results store at a time: an OS file lock plus a lock file naming its holder.

``<store>/run.lock`` is locked with ``fcntl.flock`` (exclusive, non-blocking) for the whole run and
holds, while held, one JSON object naming the holder: ``run_id``, ``host``, ``pid``,
``pid_started`` (the process's start time, so a reused pid is not mistaken for the holder),
``started_at`` and ``heartbeat_at``. A heartbeat thread touches the file every
``heartbeat_s`` seconds; its modification time is the holder's last sign of life.

Acquiring (:meth:`StoreLock.acquire`):

* the flock is held by another process → :class:`StoreLockedError` at once, naming the holder;
* the flock is free but the file still names a holder → that holder is gone (a process killed
  with SIGKILL, a crashed host): on this host when its pid is not alive (or is another process);
  on another host when its heartbeat is older than ``stale_after_s`` (some shared filesystems do
  not propagate flocks between hosts, so a fresh heartbeat from another host is honoured and
  refused like a held flock). The stale lock is taken over and ``taken_over`` names it (the
  caller prints a warning).

Releasing empties the file and drops the flock; the file itself stays (unlinking it would let
two processes lock two different inodes). Readers (``status``, ``report``, ``export``) never
take the lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil

__all__ = ["StoreLock", "StoreLockedError", "LOCK_NAME", "process_alive", "this_process"]

#: The lock file's name inside the store.
LOCK_NAME = "run.lock"


class StoreLockedError(OSError):
    """Another live run holds the store's lock (the message names it)."""


def this_process() -> dict:
    """``{"host", "pid", "pid_started"}`` of the calling process (``pid_started``: its start time,
    seconds since the epoch, as psutil reports it)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_started": psutil.Process(pid).create_time()}


def process_alive(info: dict) -> bool | None:
    """Whether the process ``info`` names (``host``, ``pid``, optional ``pid_started``) still runs:
    ``True`` / ``False`` on this host, ``None`` (unknown) for another host."""
    if info.get("host") != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(info["pid"]))
        started = info.get("pid_started")
        if started is not None and abs(proc.create_time() - float(started)) > 1.0:
            return False  # the pid was reused by another process
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False
    except psutil.AccessDenied:  # pragma: no cover - exists, owned by someone else
        return True


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _describe(holder: dict, age: float | None) -> str:
    seen = f", last heartbeat {age:.0f} s ago" if age is not None else ""
    return (f"run {holder.get('run_id', '?')} (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"started {holder.get('started_at', '?')}{seen})")


class StoreLock:
    """The run lock of the store at ``store_path`` (see the module docstring).

    Use as a context manager or call :meth:`acquire` / :meth:`release`. ``stale_after_s``: age of a
    heartbeat from another host after which its lock counts as abandoned. Raises
    :class:`StoreLockedError` when held by a live run, ``OSError`` (e.g. ``EROFS``) when the lock
    file cannot be created.
    """

    def __init__(self, store_path, run_id: str, *, stale_after_s: float = 600.0, heartbeat_s: float = 30.0):
        self.path = Path(store_path) / LOCK_NAME
        self.run_id = run_id
        self.stale_after_s = float(stale_after_s)
        self.heartbeat_s = float(heartbeat_s)
        self.taken_over: str | None = None  # description of a stale holder replaced by acquire()
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- reading ------------------------------------------------------------------------------
    def holder(self) -> tuple[dict | None, float | None]:
        """``(holder info, seconds since its heartbeat)`` from the lock file, or ``(None, None)``."""
        try:
            text = self.path.read_text(encoding="utf-8")
            age = time.time() - self.path.stat().st_mtime
        except (OSError, UnicodeDecodeError):
            return None, None
        try:
            info = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            return None, None
        return (info, age) if isinstance(info, dict) else (None, None)

    # -- locking ------------------------------------------------------------------------------
    def acquire(self) -> "StoreLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                holder, age = self.holder()
                raise StoreLockedError(
                    errno.EBUSY, f"results store {self.path.parent} is in use by "
                    f"{_describe(holder, age) if holder else 'another process'}; only one run per store at a time "
                    f"(lock file {self.path})") from None
            holder, age = self.holder()
            if holder:
                alive = process_alive(holder)
                if alive is None and age is not None and age < self.stale_after_s:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    raise StoreLockedError(
                        errno.EBUSY, f"results store {self.path.parent} is in use by {_describe(holder, age)} on "
                        f"another host; its lock counts as stale after {self.stale_after_s:.0f} s without a "
                        f"heartbeat ([execution] stale_lock_age; lock file {self.path})")
                why = "its process is gone" if alive is False else f"no heartbeat for {age:.0f} s"
                self.taken_over = f"{_describe(holder, age)}: {why}"
            self._fd = fd
            self._write({"run_id": self.run_id, **this_process(), "started_at": _now(), "heartbeat_at": _now()})
        except BaseException:
            if self._fd is None:
                os.close(fd)
            raise
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="cachescore-store-lock", daemon=True)
        self._beat.start()
        return self

    def _write(self, info: dict) -> None:
        data = json.dumps(info, sort_keys=True).encode("utf-8")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:  # a full or vanished filesystem: the run reports its own write errors
                pass

    def release(self) -> None:
        """Empty the lock file and drop the flock (idempotent)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
            self._beat = None
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        finally:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
