"""Exceptions of the persistence layer.

All of them derive from :class:`PersistenceError`. Start-up errors (format, lock,
recovery, a corrupt snapshot store) stay in the process. The three a *request* can meet
-- :class:`DiskFullError` (writes refused while the disk is full),
:class:`JournalWriteError` (fail-stop) and :class:`JournalClosedError` (shutting down) --
are also :class:`rallypoint.errors.UnavailableError`, so a client gets UNAVAILABLE with
the message, never INTERNAL. (``rallypoint.errors`` is a leaf module: importing it keeps
the persistence layer free of the coordinator.)
"""

from __future__ import annotations

from ..errors import UnavailableError

__all__ = [
    "PersistenceError",
    "StartupError",
    "JournalCorruptError",
    "JournalWriteError",
    "JournalClosedError",
    "DiskFullError",
    "FormatVersionError",
    "DataDirLocked",
    "SnapshotCorruptError",
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


class JournalWriteError(PersistenceError, UnavailableError):
    """An ``fdatasync()`` of the journal failed, or a ``write()`` failed with an error
    other than "disk full" (ENOSPC/EDQUOT; those stall and retry: :class:`DiskFullError`).

    The journal is fail-stop: after this error no record is ever acknowledged again,
    every pending and future ``wait_durable`` raises it, and ``append`` and
    ``check_writable`` raise it. The process should exit; recovery at the next start
    decides what survived. (After a failed fsync the kernel may have dropped the dirty
    pages, so retrying could report success for data that is gone: never retry.)
    Code UNAVAILABLE on the wire.
    """


class JournalClosedError(PersistenceError, UnavailableError):
    """``append`` or ``wait_durable`` was called on a journal that was closed (or whose
    flusher task ended). Code UNAVAILABLE on the wire (the server is shutting down)."""


class DiskFullError(PersistenceError, UnavailableError):
    """Writes are refused: the journal's filesystem is (nearly) full.

    Raised by ``Journal.check_writable()`` -- which the coordinator calls before it
    applies anything -- while the free space is below the journal's ``min_free_bytes``
    reserve, or while a journal ``write()`` that failed with ENOSPC/EDQUOT waits to be
    retried. Reads keep working. Code UNAVAILABLE on the wire, with ``retry_after``
    (seconds) and ``details`` ``{"path", "free_bytes", "min_free_bytes", "reason"}``
    (reason ``"low"``: below the reserve; ``"stalled"``: a write is waiting for space).
    The journal lifts the refusal by itself once space is free again.
    """


class FormatVersionError(StartupError):
    """The data directory was written by a newer (or unknown) on-disk format version."""


class DataDirLocked(StartupError):
    """Another process holds the data directory's lock.

    Attributes:
        data_dir: the directory.
        pid: the pid recorded by the holder, or None if it could not be read.

    ``option``: how the caller names the data directory in the message (``--data-dir``
    for the CLI; ``open_embedded`` says ``data_dir=``).
    """

    def __init__(self, data_dir: str, pid: int | None, option: str = "--data-dir") -> None:
        self.data_dir = str(data_dir)
        self.pid = pid
        holder = f"process {pid}" if pid is not None else "another process (pid unknown)"
        super().__init__(
            f"data directory {self.data_dir} is in use by {holder}; stop it first or use "
            f"another {option} (only one rallypoint process may use a data directory)"
        )


class SnapshotCorruptError(StartupError):
    """The LMDB snapshot store cannot be read (not an LMDB file, truncated, damaged
    pages, or an entity that does not decode). The message names the store and says what
    to do: restore it from a backup, or -- when the journal still holds every record from
    LSN 1 -- move it aside and let recovery rebuild the state from the journal.

    Attributes:
        path: the snapshot directory (``<data_dir>/snapshot``).
        detail: what was wrong (LMDB's message, or the check that failed).
    """

    def __init__(self, path: str, detail: str, *, data_dir: str | None = None) -> None:
        self.path = str(path)
        self.detail = detail
        self.data_dir = data_dir
        d = data_dir if data_dir is not None else "<data dir>"
        super().__init__(
            f"snapshot store {self.path} is unreadable ({detail}). Nothing was changed. "
            f"Restore {self.path} from a backup; or, if the journal still starts at LSN 1 "
            f"(`rallypoint repair --data-dir {d}` says whether it does), move {self.path} "
            f"aside and start again: the state is rebuilt from the journal."
        )
