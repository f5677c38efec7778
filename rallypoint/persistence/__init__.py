"""Durable state: the write-ahead journal, the LMDB snapshot, the data-dir lock and
start-up recovery. Generic: knows bytes and LSNs, never record types."""

from .errors import (
    DataDirLocked,
    FormatVersionError,
    JournalClosedError,
    JournalCorruptError,
    JournalWriteError,
    PersistenceError,
    StartupError,
)
from .journal import (
    Journal,
    RepairReport,
    ScanResult,
    read_journal,
    repair,
    scan_journal,
    verify_journal,
)
from .lock import DataDirLock
from .recovery import Recovered, recover
from .snapshot import FORMAT_VERSION, SnapshotStore, check_format

__all__ = [
    "PersistenceError",
    "StartupError",
    "JournalCorruptError",
    "JournalWriteError",
    "JournalClosedError",
    "FormatVersionError",
    "DataDirLocked",
    "Journal",
    "ScanResult",
    "RepairReport",
    "read_journal",
    "scan_journal",
    "repair",
    "verify_journal",
    "DataDirLock",
    "SnapshotStore",
    "FORMAT_VERSION",
    "check_format",
    "recover",
    "Recovered",
]
