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
take the lock; ``prune --apply`` takes it like a run.

The lock file is opened with ``O_NOFOLLOW`` and must be a regular file with a single link: a
symlink, a hard link to a file elsewhere, a FIFO or a device at ``<store>/run.lock`` is refused
with :class:`LockFileError` naming it (never followed, never truncated). A failure to write the
holder (disk full) raises :class:`LockFileError` naming the store and the lock file, and the
descriptor and flock are released before it propagates.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import psutil

__all__ = ["StoreLock", "StoreLockedError", "LockFileError", "LOCK_NAME", "process_alive", "this_process",
           "lock_file_problem"]

#: The lock file's name inside the store.
LOCK_NAME = "run.lock"


class StoreLockedError(OSError):
    """Another live run holds the store's lock (the message names it)."""


class LockFileError(OSError):
    """The store's lock file is not a plain file of its own (symlink, hard link, FIFO, device), or
    it could not be written (disk full, read-only); the message names the store and the file."""


def _open_flags(write: bool) -> int:
    flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
    return flags | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def lock_file_problem(path) -> str | None:
    """Why the lock file at ``path`` must not be used (a symlink, another link to the same inode,
    not a regular file), or None when it is absent or a plain file. Follows no link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be inspected: {exc.strerror or exc}"
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"is a symbolic link (to {target!r}); a lock file is never followed: remove the link"
    return _inode_problem(st)


def _inode_problem(st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        return f"is {kind}, not a regular file: remove it"
    if st.st_nlink > 1:
        return (f"has {st.st_nlink} hard links (another name shares its content, possibly outside the store); "
                "remove it so a fresh lock file is created")
    return None


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


def _takeover_reason(holder: dict, alive: bool | None, age: float | None) -> str:
    """Why a lock file naming ``holder`` while its flock is free is taken over."""
    if alive is False:
        return "its process is gone"
    if alive:
        return (f"its process {holder.get('pid')} is alive but does not hold the lock (it ended its run without "
                "clearing the file)")
    return f"no heartbeat for {age:.0f} s" if age is not None else "no heartbeat"


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
        if lock_file_problem(self.path) is not None:
            return None, None
        try:
            fd = os.open(self.path, _open_flags(write=False))
        except OSError:
            return None, None
        try:
            st = os.fstat(fd)
            if _inode_problem(st) is not None or st.st_size > 65536:
                return None, None
            text = os.pread(fd, st.st_size, 0).decode("utf-8")
            age = time.time() - st.st_mtime
        except (OSError, UnicodeDecodeError):
            return None, None
        finally:
            os.close(fd)
        try:
            info = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            return None, None
        return (info, age) if isinstance(info, dict) else (None, None)

    def _busy(self) -> StoreLockedError:
        holder, age = self.holder()
        return StoreLockedError(
            errno.EBUSY, f"results store {self.path.parent} is in use by "
            f"{_describe(holder, age) if holder else 'another process'}; only one run per store at a time "
            f"(lock file {self.path})")

    def check(self) -> None:
        """Raise :class:`StoreLockedError` at once when a live run holds the lock (what
        :meth:`acquire` would raise for a busy lock); takes nothing and writes nothing, so a
        command can refuse before it starts any work (a stale holder is left to :meth:`acquire`)."""
        if lock_file_problem(self.path) is not None:
            return  # absent, or a file acquire() refuses by name itself
        try:
            fd = os.open(self.path, _open_flags(write=False))
        except OSError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise self._busy() from None
                return
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # -- locking ------------------------------------------------------------------------------
    def _refuse(self, why: str) -> LockFileError:
        return LockFileError(errno.EPERM, f"results store {self.path.parent}: lock file {self.path} {why}")

    def _open(self) -> int:
        """The lock file's descriptor: created if absent, never through a link (see module docstring)."""
        why = lock_file_problem(self.path)
        if why is not None:
            raise self._refuse(why)
        try:
            fd = os.open(self.path, _open_flags(write=True), 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # became a link between the check and the open
                raise self._refuse("is a symbolic link; a lock file is never followed: remove the link") from None
            raise LockFileError(exc.errno, f"results store {self.path.parent}: cannot open lock file {self.path}: "
                                           f"{exc.strerror or exc}") from None
        why = _inode_problem(os.fstat(fd))
        if why is not None:
            os.close(fd)
            raise self._refuse(why)
        return fd

    def acquire(self) -> "StoreLock":
        fd = self._open()
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise self._busy() from None
            holder, age = self.holder()
            if holder:
                alive = process_alive(holder)
                if alive is None and age is not None and age < self.stale_after_s:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    raise StoreLockedError(
                        errno.EBUSY, f"results store {self.path.parent} is in use by {_describe(holder, age)} on "
                        f"another host; its lock counts as stale after {self.stale_after_s:.0f} s without a "
                        f"heartbeat ([execution] stale_lock_age; lock file {self.path})")
                self.taken_over = f"{_describe(holder, age)}: {_takeover_reason(holder, alive, age)}"
            self._fd = fd
            try:
                self._write({"run_id": self.run_id, **this_process(), "started_at": _now(), "heartbeat_at": _now()})
            except OSError as exc:
                raise LockFileError(exc.errno, f"results store {self.path.parent}: cannot write lock file "
                                               f"{self.path}: {exc.strerror or exc}") from None
        except BaseException:
            self._fd = None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
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
            fd = self._fd
            try:
                if fd is not None:
                    os.utime(fd)  # the descriptor, never the name: a link put there later is not followed
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
