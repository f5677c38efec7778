"""Exceptions of the persistence layer (local to the process; never sent on the wire).

All of them derive from :class:`PersistenceError`. They are raised at start-up
(format, lock, recovery) or when the disk fails under the journal (fail-stop).
"""

from __future__ import annotations

__all__ = [
    "PersistenceError",
    "StartupError",
    "JournalCorruptError",
    "JournalWriteError",
    "JournalClosedError",
    "FormatVersionError",
    "DataDirLocked",
]


class PersistenceError(Exception):
    """Base class of every persistence error."""


class StartupError(PersistenceError):
    """The data directory cannot be opened: its message says why and what to do.
    Base of JournalCorruptError, FormatVersionError and DataDirLocked."""


class JournalCorruptError(StartupError):
    """The journal is damaged somewhere other than a torn tail.

    A torn or zeroed *last* record of the *last* segment is normal after a crash and is
    cut silently (with a log warning). Anything else -- a bad CRC followed by good
    records, a missing segment, an LSN gap, a snapshot ahead of the journal end -- means
    acknowledged data may be lost, so the server refuses to start.

    Attributes:
        path: the segment file (or the journal directory) where the damage was found.
        offset: byte offset inside ``path`` of the first bad record (0 for a whole file).
        reason: a short description of what is wrong.
    """

    def __init__(self, path: str, offset: int, reason: str, *, data_dir: str | None = None) -> None:
        self.path = str(path)
        self.offset = int(offset)
        self.reason = reason
        self.data_dir = data_dir
        d = data_dir if data_dir is not None else "<data dir>"
        super().__init__(
            f"journal corrupt in {self.path} at byte offset {self.offset}: {reason}. "
            f"Nothing was changed. If the damage cannot be undone (e.g. restore the file "
            f"from a backup), run `rallypoint repair --data-dir {d}` to truncate the "
            f"journal at the last good record (losing what follows)."
        )


class JournalWriteError(PersistenceError):
    """A write() or fdatasync() of the journal failed.

    The journal is fail-stop: after this error no record is ever acknowledged again,
    every pending and future ``wait_durable`` raises it, and ``append`` raises it. The
    process should exit; recovery at the next start decides what survived.
    """


class JournalClosedError(PersistenceError):
    """``append`` or ``wait_durable`` was called on a journal that was closed (or whose
    flusher task ended)."""


class FormatVersionError(StartupError):
    """The data directory was written by a newer (or unknown) on-disk format version."""


class DataDirLocked(StartupError):
    """Another process holds the data directory's lock.

    Attributes:
        data_dir: the directory.
        pid: the pid recorded by the holder, or None if it could not be read.
    """

    def __init__(self, data_dir: str, pid: int | None) -> None:
        self.data_dir = str(data_dir)
        self.pid = pid
        holder = f"process {pid}" if pid is not None else "another process (pid unknown)"
        super().__init__(
            f"data directory {self.data_dir} is in use by {holder}; stop it first or use "
            f"another --data-dir (only one rallypoint process may use a data directory)"
        )
