"""Durable state: the write-ahead journal, the LMDB snapshot, the data-dir lock and
start-up recovery. Generic: knows bytes and LSNs, never record types."""

from .errors import (
    DataDirLocked,
    DiskFullError,
    FormatVersionError,
    JournalClosedError,
    JournalCorruptError,
    JournalWriteError,
    PersistenceError,
    SnapshotCorruptError,
    StartupError,
)
from .journal import (
    Disk,
    Journal,
    ScanResult,
    read_journal,
    scan_journal,
    verify_journal,
)
from .lock import DataDirLock
from .manifest import Manifest, read_manifest
from .recovery import Recovered, recover
from .repair import RepairPlan, RepairReport, apply_repair, plan_repair, repair
from .snapshot import FORMAT_VERSION, SnapshotStore, check_format, open_store

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
    "Journal",
    "Disk",
    "ScanResult",
    "RepairPlan",
    "RepairReport",
    "read_journal",
    "scan_journal",
    "plan_repair",
    "apply_repair",
    "repair",
    "verify_journal",
    "DataDirLock",
    "Manifest",
    "read_manifest",
    "SnapshotStore",
    "open_store",
    "FORMAT_VERSION",
    "check_format",
    "recover",
    "Recovered",
]
