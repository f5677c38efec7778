"""Exclusive lock on a data directory (one rallypoint process per data dir)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import DataDirLocked

__all__ = ["DataDirLock", "DataDirLocked"]


class DataDirLock:
    """An exclusive, non-blocking ``fcntl.flock`` on ``<data_dir>/LOCK``.

    The lock belongs to the open file description, so it is released when the process
    dies (however it dies) and a second ``acquire`` -- from another process, or from
    another ``DataDirLock`` object in the same process -- fails. The holder's pid is
    written into the file so the error can name it. The file itself is never deleted
    (deleting lock files races). Usable as a (sync) context manager.

    Args:
        data_dir: the data directory; created if missing.
    """

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / "LOCK"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock and record our pid; hold it until :meth:`release` or exit.

        Raises:
            DataDirLocked: another holder; its message names the holder's pid (as
                recorded in the file) and the data dir.
            OSError: the directory or file cannot be created.
            RuntimeError: this object already holds the lock.
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this DataDirLock")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                raw = os.pread(fd, 64, 0)
            finally:
                os.close(fd)
            try:
                pid: int | None = int(raw.decode("ascii").strip())
            except ValueError:
                pid = None
            raise DataDirLocked(str(self.data_dir), pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self._fd = fd

    def release(self) -> None:
        """Release the lock (idempotent). The pid stays in the file, harmlessly."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> "DataDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
