"""Segmented, CRC-framed write-ahead journal with group commit.

On-disk layout
==============
``<data_dir>/journal/<first LSN, 20 digits>.wal`` -- e.g. ``00000000000000000001.wal``.
A segment holds consecutive records; the next segment's name is the LSN following the
last record of the previous one. A segment is rolled (a new file started) before a record
would take it past ``segment_bytes`` (a single larger record gets a segment of its own).
``<data_dir>/JOURNAL_MANIFEST`` names the newest segment and, after a clean close, the
last LSN (:mod:`.manifest`): it lets recovery notice a deleted or shortened last segment.
``<data_dir>/BALLAST`` (optional, ``ballast_bytes``) is reserved space, see *Disk full*.
``journal/`` itself holds segment files only.

Each record is framed as (all integers little-endian)::

    u32 length      payload length in bytes
    u32 crc         CRC-32 of the 8 LSN bytes followed by the payload
    u64 lsn         log sequence number; 1, 2, 3, ... strictly consecutive
    payload         ``length`` bytes, opaque to this module

The checksum is the IEEE CRC-32 from :func:`zlib.crc32` (no CRC32C package is a
dependency; zlib's is implemented in C and fast). It covers the LSN and the payload; a
damaged length field is caught because the CRC is then computed over the wrong range.

The *active* (last) segment may end in zeros written ahead of its records (see
*Preallocation*); an all-zero header is never a record (there is no LSN 0). A rolled
segment, and the last one after a clean close, end exactly at their last record.

Durability modes
================
``fsync`` (daemon default)
    A record is acknowledged (``durable_lsn`` passes it, ``wait_durable`` returns) only
    after it was written and ``os.fdatasync``-ed. Survives a process kill and a machine
    crash / power loss.
``interval``
    A record is acknowledged once it was ``write()``-n to the segment file (handed to
    the OS page cache): it survives a process crash (SIGKILL). ``fdatasync`` runs at
    most every ``interval_ms`` ms and at the latest ``interval_ms`` ms after the first
    unsynced write, so a *machine* crash loses at most the records acknowledged during
    the last ``interval_ms`` ms plus one fsync duration. ``synced_lsn`` says what is on
    stable storage; ``wait_synced`` forces and awaits an fsync (use it before a snapshot).
``memory``
    No files. ``append`` makes a record "durable" at once; nothing survives the process.

Group commit
============
The flusher (:meth:`Journal.run`, a Trio task) takes *everything* appended so far,
writes it with one ``write()`` per segment (into the page cache: microseconds, on the
event loop) and has it made durable by one ``fdatasync``; records appended meanwhile go
out with the next round. The ``fdatasync`` runs outside the event loop's thread, in the
*sync helper*, a small child process (:mod:`.syncer`): the loop sends it a duplicate of
the segment's descriptor and waits for its answer like for any socket, so nothing
blocks the loop and no Python thread has to win the GIL back after every system call
(on this project's 2-core VM that hand-over cost more than the fsync itself:
docs/performance.md, "A sync helper process"). ``sync="thread"`` runs it in a worker
thread instead (also the fallback when the helper cannot be started).

The deterministic simulator runs this flusher as it is, on a seeded :class:`Disk`
(``rallypoint.testing.disk.SimDisk``: its :meth:`Disk.start_syncer` answers fsyncs on
the event loop, its :meth:`Disk.run_blocking` runs inline); fault points
(:mod:`.buggify`: the batch-end write left to the next round, a round delayed, a sync
request held back, a preallocation failed) fire only under its seed.

Preallocation
=============
An ``fdatasync`` after an append that grew the file must also commit the file's new
size (on ext4 a journal commit of the filesystem's own); after a write into blocks
that already exist it writes the data only. The flusher therefore keeps
``preallocate_bytes`` (1 MiB) of real zeros written ahead of the write position
(``posix_fallocate`` would not do: writing into its unwritten extents is a metadata
change again); the zeros ride along with the next fdatasync, once per
``preallocate_bytes``. Measured on this project's 2-core VM (ext4): a 50 KB
append + fdatasync takes 0.21 ms growing the file and 0.14 ms with the zeros ahead
(docs/performance.md). A roll and a clean close cut the zero tail first; after a crash
the zero tail of the last segment is cut by recovery like a torn tail (logged at INFO,
it is not damage). A page of zeros where a record should start, in the last segment, is
a page of an unsynced write that did not reach the disk before the machine stopped
(pages of one write can reach the disk in any order when no size change orders them):
the records after it were never fsynced (in ``fsync`` mode never acknowledged; in
``interval`` mode within the loss the mode allows) and are cut with it.

Disk full
=========
The coordinator applies a commit in memory *before* it appends it, so the journal must
refuse a commit before it is applied, not fail it afterwards. :meth:`Journal.check_writable`
is that gate (O(1), no I/O); it raises :class:`DiskFullError` (UNAVAILABLE, with
``retry_after``) while

* the free space of the journal's filesystem is below ``min_free_bytes`` (checked by the
  flusher after every write, and every ``space_poll_s`` while refusing), or
* a ``write()`` failed with ENOSPC/EDQUOT. The flusher first deletes ``BALLAST``
  (``ballast_bytes`` reserved at open) and retries at once, which normally lets the
  records already applied in memory reach the disk; if that is not enough it keeps them
  and retries every ``space_poll_s`` ("stalled"). Nothing about them is acknowledged
  meanwhile: ``durable_lsn`` does not move, so no reply that depends on them leaves.

Once space is free again (and the ballast re-made) the refusal lifts by itself. A failed
``fdatasync`` (any errno) and any other write error stay fail-stop
(:class:`JournalWriteError`): after a failed fsync the kernel may have dropped the pages,
and retrying could report success for data that is gone.

Replication hooks
=================
A replicated node (``rallypoint.replication``) uses three hooks and nothing else:
:meth:`Journal.set_tap` sees each appended record (LSN, CRC, payload: the bytes of its
frame) to ship it to the standby; :meth:`Journal.set_replica_floor` caps
``durable_lsn`` at what the in-sync standby acknowledged, so that "durable" -- and
every reply held for it -- means durable here *and* there; :meth:`Journal.set_write_gate`
refuses writes that could not be acknowledged. With none of them set (a single node)
nothing changes.

Slow and stuck disks
====================
A slow fdatasync is not an error (the disk may recover), but every acknowledgement
waits for it, so an operator must be able to see it: one that took ``slow_sync_s``
(1 s) or more is logged at WARNING, at most once per 10 s with the count since the last
line; one still running after ``10 * slow_sync_s`` (10 s) is reported while it runs
(then every 30 s) and again when it returns. :attr:`Journal.sync_pending_s` (the
Prometheus gauge ``journal_sync_pending_seconds``, read without waiting for the disk)
is how long the oldest request has been in flight. Nothing is failed or given up: a stuck fdatasync
that never returns leaves writes waiting, and a SIGTERM's drain waits for it; a second
SIGTERM ends the daemon at once, which loses nothing that was acknowledged.
"""

from __future__ import annotations

from bisect import bisect_left
import errno
import heapq
from collections import deque
import logging
import os
import re
import math
import mmap
import struct
import time
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator
from zlib import crc32

import trio

from .errors import (
    DiskFullError,
    JournalClosedError,
    JournalCorruptError,
    JournalWriteError,
)
from . import buggify
from .manifest import Manifest, read_manifest, try_write_manifest
from .syncer import MAX_OUTSTANDING, SYNC_MODES, Syncer, SyncHelperGone

if TYPE_CHECKING:  # repair.py imports this module
    from .repair import RepairPlan, RepairReport

__all__ = [
    "Journal",
    "Disk",
    "JournalCorruptError",
    "JournalWriteError",
    "JournalClosedError",
    "DiskFullError",
    "JournalStatistics",
    "ScanResult",
    "JournalStream",
    "SegmentInfo",
    "TornTail",
    "read_journal",
    "scan_journal",
    "plan_repair",
    "repair",
    "verify_journal",
    "snapshot_lsn_of",
    "segment_name",
    "list_segments",
    "HEADER_SIZE",
    "MAX_PAYLOAD",
    "MODES",
    "BALLAST_NAME",
]

log = logging.getLogger("rallypoint.persistence")

_HDR = struct.Struct("<IIQ")
_Q = struct.Struct("<Q")
_II = struct.Struct("<II")
HEADER_SIZE = _HDR.size  # 16 bytes
MAX_PAYLOAD = 256 << 20  # 256 MiB; a larger length field is treated as damage
MODES = ("fsync", "interval", "memory")
_SEG_RE = re.compile(r"^(\d{20})\.wal$")
BALLAST_NAME = "BALLAST"
#: write() errors that mean "no space": retried, not fail-stop.
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class _FsyncFailed(Exception):
    """An fdatasync failed inside a write step: fail-stop even for ENOSPC."""


def segment_name(first_lsn: int) -> str:
    """File name of the segment whose first record has LSN ``first_lsn``."""
    return f"{first_lsn:020d}.wal"


def list_segments(data_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``[(first_lsn, path), ...]`` of the journal's segment files, sorted by LSN.

    Files in ``<data_dir>/journal/`` that do not look like segments are ignored. Returns
    an empty list when the directory does not exist.
    """
    jdir = Path(data_dir) / "journal"
    try:
        names = os.listdir(jdir)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _SEG_RE.match(name)
        if m:
            out.append((int(m.group(1)), jdir / name))
    out.sort()
    return out


def _unlink_all(paths: list[Path]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_ZEROS = bytes(1 << 20)


def _zeros(n: int) -> memoryview:
    """A read-only view of ``n`` <= 1 MiB zero bytes (shared)."""
    return memoryview(_ZEROS)[:n]


def _frame(lsn: int, payload: bytes) -> bytes:
    """Framed bytes of one record (used by tests and tools; ``append`` inlines this)."""
    lb = _Q.pack(lsn)
    return _II.pack(len(payload), crc32(payload, crc32(lb))) + lb + bytes(payload)


# --------------------------------------------------------------------------- disk


class Disk:
    """The journal's raw file operations, one method each, so that tests can inject
    faults (subclass it and pass ``disk=`` to :class:`Journal`).

    Called by the flusher on the event loop, except :meth:`fdatasync`, which the sync
    helper process carries out (``os.fdatasync``) -- or, when a subclass overrides
    it, a worker thread calls the subclass's method. :meth:`start_syncer` (where the
    fdatasyncs run) and :meth:`run_blocking` (what runs off the loop) are the seams
    the deterministic simulator's disk (:class:`rallypoint.testing.disk.SimDisk`)
    replaces, so that the production flusher runs under its seeds unchanged. Errors
    are ``OSError`` as from ``os``: ENOSPC/EDQUOT from
    :meth:`write` or :meth:`open_segment` stall and retry; any error from
    :meth:`preallocate` only stops preallocating in that segment; anything else, and
    any error from :meth:`fdatasync` or :meth:`truncate`, is fail-stop.
    """

    def write(self, fd: int, data: bytes | bytearray | memoryview) -> int:
        """``os.write``: returns the number of bytes written (may be short)."""
        return os.write(fd, data)

    def fdatasync(self, fd: int) -> None:
        """``os.fdatasync``."""
        os.fdatasync(fd)

    def open_segment(self, path: Path) -> int:
        """Create a new segment file (O_EXCL) and return its fd. The journal writes it
        sequentially from offset 0 with :meth:`write` (not O_APPEND: a preallocated
        zero tail lies beyond the write position)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

    def preallocate(self, fd: int, offset: int, size: int) -> None:
        """Write ``size`` zero bytes at ``offset`` (``os.pwrite``; the file position is
        not moved). Raises OSError (ENOSPC when the space is not there)."""
        zeros = _zeros(min(size, 1 << 20))
        end = offset + size
        while offset < end:
            offset += os.pwrite(fd, zeros[: end - offset], offset)

    async def start_syncer(self, kind: str) -> Syncer:
        """Start the sync helper that makes this disk's files durable (see
        :mod:`.syncer`): ``kind`` ``"process"``, ``"thread"`` (whose thread calls
        :meth:`fdatasync`) or ``"inline"`` (the event loop calls it). Raises OSError
        when a process cannot be started."""
        return await Syncer.start(kind, self.fdatasync)

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the blocking file operation ``fn(*args)`` (a manifest write, segment
        deletions) off the event loop, in a worker thread; returns its result."""
        return await trio.to_thread.run_sync(fn, *args)

    def truncate(self, fd: int, size: int) -> None:
        """``os.ftruncate``: drop the file's bytes from ``size`` on."""
        os.ftruncate(fd, size)

    def free_bytes(self, path: Path) -> int:
        """Bytes available to this (unprivileged) process on ``path``'s filesystem."""
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    def remove(self, path: Path) -> None:
        """Delete ``path`` (the ballast). Raises FileNotFoundError when it is gone."""
        os.unlink(path)

    def allocate(self, path: Path, size: int) -> None:
        """Create ``path`` holding ``size`` really allocated bytes (the ballast).
        Raises OSError (ENOSPC) when the space is not there."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                # No fallocate on this filesystem: write zeros (a sparse file frees nothing).
                block = b"\0" * (1 << 20)
                os.lseek(fd, 0, os.SEEK_SET)
                left = size
                while left > 0:
                    left -= os.write(fd, block[: min(left, len(block))])
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- writer


class Histogram:
    """Bucket counts of observations (``counts[i]``: values <= ``bounds[i]``, not
    cumulative; the last bucket is +Inf), their ``sum`` and ``n``. Written by one
    thread, read by another: each read sees whole numbers (a scrape may be one
    observation behind)."""

    __slots__ = ("bounds", "counts", "sum", "n")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.n += 1


#: fdatasync latency buckets, seconds
FSYNC_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: records made durable by one fdatasync (group commit)
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


@dataclass(frozen=True)
class JournalStatistics:
    """Snapshot of a journal's counters (see :meth:`Journal.statistics`).

    ``buffered_bytes`` are appended but not yet taken by the flusher;
    ``waiters`` counts distinct LSNs being waited for (not tasks). ``refusing`` is None
    while writes are accepted, else ``"low"`` (free space below the reserve) or
    ``"stalled"`` (a write waits for space); ``free_bytes`` is the last free-space
    reading (None before the first); ``refusals`` counts how often writes started being
    refused, ``stalls`` how often a write hit ENOSPC.
    """

    mode: str
    last_lsn: int
    durable_lsn: int
    synced_lsn: int
    buffered_bytes: int
    waiters: int
    records: int
    bytes: int
    writes: int
    fsyncs: int
    segments: int
    failed: bool
    closed: bool
    refusing: str | None = None
    free_bytes: int | None = None
    refusals: int = 0
    stalls: int = 0


class Journal:
    """Append-only write-ahead log (see the module docstring for format and modes).

    Use::

        journal = Journal(data_dir, mode="fsync", next_lsn=recovered.next_lsn)
        async with trio.open_nursery() as n:
            await n.start(journal.run)          # the group-commit flusher
            journal.check_writable()            # DiskFullError before changing anything
            lsn = journal.append(b"...")        # sync, a few microseconds
            await journal.wait_durable(lsn)     # shared fsync
            ...
            await journal.aclose()              # flush, fsync, close; run() returns

    Args:
        data_dir: the data directory (segments live in ``<data_dir>/journal/``); may be
            None in ``memory`` mode.
        mode: ``"fsync"``, ``"interval"`` or ``"memory"``.
        next_lsn: LSN the next appended record gets. It MUST come from recovery
            (:func:`scan_journal` / ``recover``): the last LSN in the journal + 1, or
            snapshot LSN + 1 when the journal is empty. >= 1.
        interval_ms: fsync period in ``interval`` mode, milliseconds (> 0).
        segment_bytes: roll to a new segment file before a segment would exceed this many
            bytes (default 64 MiB).
        min_free_bytes: refuse writes (:meth:`check_writable`) while the filesystem of
            the journal has fewer free bytes than this (0: only a failed write refuses).
        ballast_bytes: size of ``BALLAST``, space reserved at open and given
            back when a write hits ENOSPC, so the records already applied in memory can
            still be written (0: none). Re-made once space is free again.
        space_poll_s: while writes are refused, how often (seconds) free space is
            re-checked and a stalled write retried; also the ``retry_after`` hint
            (at least 1 s).
        preallocate_bytes: keep this many bytes of zeros written ahead of the write
            position in the active segment (never past ``segment_bytes``; default
            1 MiB; 0: off), so that an fdatasync writes data only instead of also
            committing the file's new size (see *Preallocation*).
        disk: the file operations (:class:`Disk`); tests pass a faulty one.
        sync: where ``fdatasync`` runs: ``"process"`` (default: the sync helper
            process) or ``"thread"`` (a worker thread); see :mod:`.syncer`. A ``disk``
            that overrides :meth:`Disk.fdatasync` always gets the thread.
        slow_sync_s: an fdatasync that takes this many seconds or more is logged at
            WARNING (at most one line per 10 s, with a count), and one still running
            after ten times as long is reported while it runs, every 30 s, and when it
            returns (see *Slow and stuck disks*). Default 1 s, the threshold etcd warns
            at.

    Raises:
        ValueError: bad mode / arguments, or the journal already holds a segment that
            starts at or after ``next_lsn`` with records in it (recovery was skipped).
        OSError: the journal directory or segment cannot be created.

    Opening always appends to a fresh segment named ``next_lsn`` (an empty segment with
    that name is reused; an empty last segment with another name is removed), so a
    reopen never writes into a file whose tail it has not validated.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None,
        *,
        mode: str,
        next_lsn: int,
        interval_ms: float = 10,
        segment_bytes: int = 64 << 20,
        min_free_bytes: int = 0,
        ballast_bytes: int = 0,
        space_poll_s: float = 1.0,
        preallocate_bytes: int = 1 << 20,
        disk: Disk | None = None,
        sync: str = "process",
        slow_sync_s: float = 1.0,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"journal mode must be one of {MODES}, not {mode!r}")
        if next_lsn < 1:
            raise ValueError(f"next_lsn must be >= 1, not {next_lsn}")
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be > 0, not {interval_ms}")
        if segment_bytes < 4096:
            raise ValueError(f"segment_bytes must be >= 4096, not {segment_bytes}")
        if min_free_bytes < 0 or ballast_bytes < 0 or preallocate_bytes < 0:
            raise ValueError("min_free_bytes, ballast_bytes and preallocate_bytes must be >= 0")
        if not space_poll_s > 0:
            raise ValueError(f"space_poll_s must be > 0, not {space_poll_s}")
        if mode != "memory" and data_dir is None:
            raise ValueError(f"mode {mode!r} needs a data_dir")
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, not {sync!r}")
        self.mode = mode
        self.data_dir = None if data_dir is None else Path(data_dir)
        self.interval_s = interval_ms / 1000.0
        self.segment_bytes = int(segment_bytes)
        self.min_free_bytes = int(min_free_bytes)
        self.ballast_bytes = int(ballast_bytes)
        self.space_poll_s = float(space_poll_s)
        self.preallocate_bytes = int(preallocate_bytes)
        self._disk = disk if disk is not None else Disk()
        self._memory = mode == "memory"
        self._fsync_each = mode == "fsync"

        self._next_lsn = next_lsn
        self._opened_next = next_lsn
        self._durable_lsn = next_lsn - 1
        self._synced_lsn = next_lsn - 1
        # Replication (see *Replication hooks*): what this node alone made durable, the
        # in-sync standby's acknowledged LSN that caps ``durable_lsn`` (None: no
        # standby counts), the tap that sees every appended record, and a refusal of
        # writes the node imposes (no in-sync standby under ``--min-insync 2``).
        self._local_durable = next_lsn - 1
        self._replica_floor: int | None = None
        self._tap: Callable[[int, int, bytes], None] | None = None
        self._write_gate: Callable[[], Exception] | None = None
        #: called (on the loop, synchronously) when writes are accepted again: the disk
        #: has space again, or the write gate lifted (:meth:`add_writable_listener`)
        self._writable_listeners: list[Callable[[], None]] = []
        # Appended, not yet taken by the flusher (all of this lives on the event loop).
        self._buf = bytearray()
        self._buf_seg: int | None = None  # first LSN of a new segment this chunk starts
        self._chunks: list[tuple[int | None, bytearray]] = []  # completed chunks (rolls)
        self._buf_upto = next_lsn - 1  # last LSN included in _buf/_chunks
        self._seg_bytes = 0  # bytes assigned to the active segment (written + buffered)
        self._wake: trio.Event | None = None  # the flusher waits for work on it
        # called with (durable LSN, None) when it advances, (durable LSN, error) when it
        # never will again (see add_durable_listener)
        self._listeners: list[Callable[[int, Exception | None], None]] = []
        self._stop = False
        self._force_sync = False
        # Waiters: heap of LSNs plus one Event per LSN.
        self._waiter_heap: list[int] = []
        self._waiters: dict[int, trio.Event] = {}
        self._sync_waiters: list[tuple[int, trio.Event]] = []
        self._error: JournalWriteError | None = None
        self._closed = False
        self._running = False
        self._done: trio.Event | None = None  # set when run() ends (memory mode: by aclose)
        self.sync = sync
        if not slow_sync_s > 0:
            raise ValueError(f"slow_sync_s must be > 0, not {slow_sync_s!r}")
        self.slow_sync_s = float(slow_sync_s)
        # Slow fdatasyncs: how many since the last warning, when that was (trio time),
        # and whether the one in progress was reported as stuck.
        self._slow_syncs = 0
        self._slow_logged_at: float | None = None
        self._stuck_reported = False
        self._syncer: Syncer | None = None
        # Flusher progress: last LSN taken into the backlog, last LSN written to the file;
        # its deadlines (trio time): the pending interval fsync, the retry of a stalled
        # write, the next free-space check while refusing.
        self._taken = next_lsn - 1
        self._written = next_lsn - 1
        # Sync requests in flight, in order: (request id, the LSN it makes synced or
        # None, when it was sent: trio time); the last LSN requested; the last request
        # id answered.
        self._key: int | None = None  # the active segment's key in the sync helper
        self._outstanding: deque[tuple[int, int | None, float]] = deque()
        self._requested_lsn = next_lsn - 1
        self._answered = 0
        self._answer_event: trio.Event | None = None
        self._sync_wanted = False
        self._next_sync_at: float | None = None
        self._retry_at: float | None = None
        self._poll_at: float | None = None
        # Counters (written by the flusher, read anywhere).
        self._n_bytes = 0
        self._n_writes = 0
        self._n_fsyncs = 0
        #: fdatasync latency (s) and records per fdatasync (group-commit size)
        self.fsync_seconds = Histogram(FSYNC_BOUNDS)
        self.commit_records = Histogram(BATCH_BOUNDS)
        #: what a reply waits for durability (s): from a record's append to the event
        #: loop learning it is durable; sampled, one record per durability step (the
        #: first appended since the previous step: the group's oldest)
        self.commit_wait_seconds = Histogram(FSYNC_BOUNDS)
        self._wait_probe: tuple[int, float] | None = None
        self._segment_firsts: list[int] = []
        self._fd: int | None = None
        self._jdir: Path | None = None
        self._file_first = next_lsn  # first LSN of the open segment file (flusher's)
        # Flusher side: the active segment's write position (bytes of records written)
        # and the end of the zeros written ahead of it (_zend > _wpos: a zero tail).
        self._wpos = 0
        self._zend = 0
        self._prealloc_ok = True  # False after a failed preallocation, until the next roll
        # Disk space: the refusal in force; the backlog of chunks a failed write left,
        # what the flusher last reported, the ballast.
        self._refusal: str | None = None  # None | "low" | "stalled"
        self._refused_since = 0.0
        self._space_event: trio.Event | None = None
        self._free_bytes: int | None = None
        self._refusals = 0
        self._stalls = 0
        self._backlog: list[list] = []
        self._backlog_lsns: tuple[int, int] | None = None
        self._reported: str | None = None
        self._ballast_ok = True
        self._abandoned: tuple[int, int] | None = None
        if not self._memory:
            self._open_active_segment(next_lsn)
            self._init_space()

    # ----------------------------------------------------------------- construction

    @classmethod
    def open(
        cls,
        data_dir: str | os.PathLike[str] | None,
        *,
        mode: str = "fsync",
        snapshot_lsn: int = 0,
        next_lsn: int | None = None,
        interval_ms: float = 10,
        segment_bytes: int = 64 << 20,
        **options: Any,
    ) -> "Journal":
        """Open a journal for appending (sync; does file I/O).

        If ``next_lsn`` is None it is determined here by :func:`scan_journal` with
        ``after_lsn=snapshot_lsn`` (which cuts a torn tail). Pass ``next_lsn`` from
        ``recover()`` when recovery already ran. In ``memory`` mode ``data_dir`` is
        ignored and ``next_lsn`` defaults to ``snapshot_lsn + 1``. ``options`` are the
        disk-space arguments of :class:`Journal` (``min_free_bytes``, ...).

        Raises: JournalCorruptError, ValueError, OSError (see :class:`Journal`).
        """
        if mode == "memory":
            return cls(None, mode=mode, next_lsn=next_lsn or snapshot_lsn + 1,
                       interval_ms=interval_ms, segment_bytes=segment_bytes, **options)
        if next_lsn is None:
            next_lsn = scan_journal(data_dir, after_lsn=snapshot_lsn).next_lsn  # type: ignore[arg-type]
        return cls(data_dir, mode=mode, next_lsn=next_lsn, interval_ms=interval_ms,
                   segment_bytes=segment_bytes, **options)

    def _open_active_segment(self, next_lsn: int) -> None:
        assert self.data_dir is not None
        jdir = self.data_dir / "journal"
        jdir.mkdir(parents=True, exist_ok=True)
        self._jdir = jdir
        segs = list_segments(self.data_dir)
        leftover: Path | None = None
        if segs:
            first, path = segs[-1]
            size = path.stat().st_size
            if size == 0 and first != next_lsn:
                leftover = path  # an empty leftover carries nothing: removed below
                segs.pop()
            elif first >= next_lsn and size > 0:
                raise ValueError(
                    f"journal segment {path} starts at LSN {first} and holds records, but "
                    f"next_lsn is {next_lsn}: run recovery (scan_journal) first"
                )
        self._segment_firsts = [f for f, _ in segs if f != next_lsn]
        path = jdir / segment_name(next_lsn)
        flags = os.O_WRONLY | os.O_CLOEXEC  # written from offset 0 on, see Disk.open_segment
        if path.exists():
            self._fd = os.open(path, flags)
        else:
            self._fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            _fsync_dir(jdir)
        self._segment_firsts.append(next_lsn)
        self._seg_bytes = 0
        self._file_first = next_lsn
        self._wpos = self._zend = 0
        self._prealloc_ok = True
        # Name the new segment before removing the old one: a crash in between must not
        # leave a manifest naming a segment that is gone.
        try_write_manifest(self.data_dir, Manifest(active_segment=next_lsn))
        if leftover is not None:
            leftover.unlink()

    def _init_space(self) -> None:
        """At open: make the ballast, read the free space, refuse writes at once if it
        is already below the reserve (a daemon started on a full disk)."""
        assert self._jdir is not None
        if self.ballast_bytes:
            self._ballast_ok = self._make_ballast()
        if self.min_free_bytes or self.ballast_bytes:
            self._space_check()  # no loop yet: a refusal is applied here directly

    # ----------------------------------------------------------------- properties

    @property
    def last_lsn(self) -> int:
        """LSN of the last appended record (next_lsn - 1 before any append)."""
        return self._next_lsn - 1

    @property
    def durable_lsn(self) -> int:
        """Every record with LSN <= this is acknowledged durable (see the mode docs)."""
        return self._durable_lsn

    @property
    def synced_lsn(self) -> int:
        """Every record with LSN <= this has been fdatasync-ed (== durable_lsn in fsync
        mode; == last_lsn in memory mode)."""
        return self._synced_lsn

    @property
    def sync_due(self) -> bool:
        """Something written is not fdatasync-ed yet and nothing will sync it: no sync
        request in flight, none wanted (a forced one, a roll's), no interval deadline
        armed, no write waiting to be retried. Never true of a journal that works (the
        deterministic simulator checks it at rest: an interval journal that stops
        syncing loses more than ``--interval-ms`` to a machine crash); False while the
        journal has failed or is not running."""
        if self._memory or not self._running or self._error is not None or self._stop:
            return False
        return (self._written > self._synced_lsn and not self._outstanding and self._next_sync_at is None
                and not self._force_sync and not self._backlog and self._retry_at is None)

    def _raise_failed(self) -> None:
        # A fresh instance per raise: one exception object must not travel through
        # several tasks' tracebacks at once.
        err = self._error
        assert err is not None
        new = JournalWriteError(*err.args)
        raise new from err.__cause__

    @property
    def failed(self) -> JournalWriteError | None:
        """The write error that stopped the journal, or None."""
        return self._error

    # ----------------------------------------------------------------- disk space

    @property
    def writable(self) -> bool:
        """True when :meth:`check_writable` would not raise."""
        return self._refusal is None and self._error is None

    @property
    def refusing(self) -> str | None:
        """Why writes are refused: None (they are not), ``"low"`` (free space below
        ``min_free_bytes``) or ``"stalled"`` (a write failed with ENOSPC and waits)."""
        return self._refusal

    def free_bytes(self) -> int | None:
        """Free bytes on the journal's filesystem now (one statvfs, about 1 us; None in
        memory mode or when it cannot be read)."""
        if self._jdir is None:
            return None
        try:
            return self._disk.free_bytes(self._jdir)
        except OSError:
            return None

    def check_writable(self) -> None:
        """Raise unless a new record may be applied and appended now (O(1), no I/O).

        The coordinator calls this before it applies a commit in memory, so a refused
        write changes nothing. Reads need not call it.

        Raises:
            DiskFullError: (UNAVAILABLE, ``retry_after`` seconds) the disk is full, see
                the module docstring; lifts by itself once space is freed.
            JournalWriteError: (UNAVAILABLE) the journal failed (fail-stop).
        """
        if self._refusal is not None:
            raise self._refusal_error()
        if self._error is not None:
            self._raise_failed()
        gate = self._write_gate
        if gate is not None:
            raise gate()

    def _refusal_error(self) -> DiskFullError:
        where = self._jdir
        free = self._free_bytes
        free_s = "?" if free is None else f"{free}"
        if self._refusal == "stalled":
            lsns = self._backlog_lsns
            what = f" (LSN {lsns[0]}..{lsns[1]})" if lsns else ""
            msg = (f"disk full at {where}: a journal write failed (no space left on device) and "
                   f"waits for space{what}, {free_s} bytes free; writes are refused until space is "
                   f"freed there, then they resume by themselves")
        else:
            msg = (f"disk full at {where}: {free_s} bytes free, below the {self.min_free_bytes}-byte "
                   f"reserve the journal keeps"
                   + ("" if self._ballast_ok else f" (plus its {self.ballast_bytes}-byte ballast to re-make)")
                   + "; writes are refused until space is freed there (reads still work), then "
                   "they resume by themselves")
        return DiskFullError(
            msg,
            retry_after=max(1.0, self.space_poll_s),
            details={"path": str(where), "free_bytes": free, "min_free_bytes": self.min_free_bytes,
                     "reason": self._refusal},
        )

    async def wait_writable(self) -> None:
        """Return once writes are accepted (at once if they are). Raises
        JournalWriteError if the journal failed meanwhile."""
        while self._refusal is not None and self._error is None:
            if self._space_event is None:
                self._space_event = trio.Event()
            await self._space_event.wait()
        await trio.lowlevel.checkpoint()
        if self._error is not None:
            self._raise_failed()

    async def wait_refusing(self) -> str:
        """Return once writes are refused; returns the reason (``"low"`` or
        ``"stalled"``). For tests and monitoring."""
        while self._refusal is None:
            if self._space_event is None:
                self._space_event = trio.Event()
            await self._space_event.wait()
        await trio.lowlevel.checkpoint()
        return self._refusal

    def _on_space(self, kind: str | None, free: int | None, lsns: tuple[int, int] | None) -> None:
        if free is not None:
            self._free_bytes = free
        self._backlog_lsns = lsns
        if kind == self._refusal:
            return
        was = self._refusal
        self._refusal = kind
        if kind is None:
            log.warning("journal: disk space at %s is back (%s bytes free): writes are accepted again "
                        "after %.1f s", self._jdir, free, time.monotonic() - self._refused_since)
            if self.writable:
                self._writable_again()
        else:
            if was is None:
                self._refused_since = time.monotonic()
                self._refusals += 1
            log.error("%s", self._refusal_error().message)
        ev, self._space_event = self._space_event, None
        if ev is not None:
            ev.set()

    # ----------------------------------------------------------------- append

    def append(self, payload: bytes | bytearray | memoryview) -> int:
        """Frame ``payload`` and buffer it; return its LSN. Synchronous, never blocks on
        I/O (the flusher task takes the buffer at its next round).

        The record is *not* durable yet: await :meth:`wait_durable` with the returned
        LSN before telling anyone about it. ``append`` does not check disk space: call
        :meth:`check_writable` before changing anything the record describes.

        Raises:
            JournalWriteError: the journal failed earlier (fail-stop).
            JournalClosedError: the journal was closed.
            ValueError: payload larger than MAX_PAYLOAD (256 MiB).
        """
        if self._error is not None:
            self._raise_failed()
        if self._closed:
            raise JournalClosedError("journal is closed")
        lsn = self._next_lsn
        n = len(payload)
        if self._memory:
            self._next_lsn = lsn + 1
            self._durable_lsn = self._synced_lsn = lsn
            self._n_bytes += n + HEADER_SIZE
            return lsn
        if n > MAX_PAYLOAD:
            raise ValueError(f"journal payload of {n} bytes exceeds {MAX_PAYLOAD}")
        lb = _Q.pack(lsn)
        crc = crc32(payload, crc32(lb))
        head = _II.pack(n, crc)
        reclen = n + HEADER_SIZE
        if self._seg_bytes + reclen > self.segment_bytes and self._seg_bytes:
            self._roll(lsn)
        self._seg_bytes += reclen
        buf = self._buf
        buf += head
        buf += lb
        buf += payload
        self._buf_upto = lsn
        self._next_lsn = lsn + 1
        tap = self._tap
        if tap is not None:
            tap(lsn, crc, payload)
        if self._wait_probe is None:
            self._wait_probe = (lsn, time.perf_counter())
        ev = self._wake
        if ev is not None:
            self._wake = None
            ev.set()
        return lsn

    def _roll(self, first_lsn: int) -> None:
        # From append: close the current chunk, start a new segment.
        if self._buf or self._buf_seg is not None:
            self._chunks.append((self._buf_seg, self._buf))
        self._buf = bytearray()
        self._buf_seg = first_lsn
        self._seg_bytes = 0
        self._segment_firsts.append(first_lsn)

    # ----------------------------------------------------------------- waiting

    async def wait_durable(self, lsn: int) -> None:
        """Return once ``durable_lsn >= lsn``. Many waiters share one fsync.

        Always a checkpoint. Cancellation-safe (a cancelled waiter leaves nothing behind
        that matters). In memory mode returns at once. While a write is stalled on a
        full disk this waits (nothing is acknowledged before it is on disk).

        Raises:
            JournalWriteError: the journal failed before ``lsn`` became durable.
            JournalClosedError: the journal stopped before ``lsn`` became durable.
            ValueError: ``lsn`` was never appended (``lsn > last_lsn``).
        """
        if lsn <= self._durable_lsn:
            await trio.lowlevel.checkpoint()
            return
        if self._error is not None:
            await trio.lowlevel.checkpoint()
            self._raise_failed()
        if lsn >= self._next_lsn:
            raise ValueError(f"LSN {lsn} was never appended (last_lsn is {self._next_lsn - 1})")
        if self._closed and not self._running:
            await trio.lowlevel.checkpoint()
            raise JournalClosedError(f"journal is closed; LSN {lsn} is not durable")
        ev = self._waiters.get(lsn)
        if ev is None:
            ev = self._waiters[lsn] = trio.Event()
            heapq.heappush(self._waiter_heap, lsn)
        await ev.wait()
        if self._durable_lsn >= lsn:
            return
        if self._error is not None:
            self._raise_failed()
        raise JournalClosedError(f"journal stopped; LSN {lsn} is not durable")

    async def wait_synced(self, lsn: int | None = None) -> None:
        """Force an fdatasync if needed and return once ``synced_lsn >= lsn`` (default:
        ``last_lsn``). Use before writing a snapshot in ``interval`` mode so the snapshot
        is never ahead of what the journal has on stable storage. Same errors as
        :meth:`wait_durable`."""
        if lsn is None:
            lsn = self._next_lsn - 1
        if self._memory or lsn <= self._synced_lsn:
            await trio.lowlevel.checkpoint()
            return
        if self._error is not None:
            self._raise_failed()
        if lsn >= self._next_lsn:
            raise ValueError(f"LSN {lsn} was never appended (last_lsn is {self._next_lsn - 1})")
        ev = trio.Event()
        self._sync_waiters.append((lsn, ev))
        self._force_sync = True
        self._kick()
        await ev.wait()
        if self._synced_lsn >= lsn:
            return
        if self._error is not None:
            self._raise_failed()
        raise JournalClosedError(f"journal stopped; LSN {lsn} is not synced")

    def add_durable_listener(self, fn: Callable[[int, Exception | None], None]) -> None:
        """Call ``fn(durable_lsn, None)`` on the event loop each time the durable LSN
        advances, and ``fn(durable_lsn, error)`` when it stops for good (the journal
        failed: a JournalWriteError; or closed: JournalClosedError; possibly more than
        once: what was answered then is not held any more). ``fn`` must not block or
        raise. The TCP server releases the replies it holds
        for durability this way, in the step that learns of the fsync, instead of
        waking a task per connection."""
        self._listeners.append(fn)

    def remove_durable_listener(self, fn: Callable[[int, Exception | None], None]) -> None:
        """Stop calling ``fn`` (no-op if it was not added)."""
        try:
            self._listeners.remove(fn)
        except ValueError:
            pass

    # ----------------------------------------------------------------- replication hooks

    def set_tap(self, fn: Callable[[int, int, bytes], None] | None) -> None:
        """Call ``fn(lsn, crc, payload)`` synchronously for every record appended from now
        on, in LSN order (``crc``: the frame's CRC-32, see the module docstring), or stop
        (None). The replication sender keeps the records for its standby this way; ``fn``
        must not block or raise. Not in memory mode (nothing is framed there)."""
        if fn is not None and self._memory:
            raise ValueError("a memory-mode journal frames nothing to replicate")
        self._tap = fn

    @property
    def oldest_lsn(self) -> int | None:
        """The first LSN of the oldest segment still on disk (None in memory mode): the
        oldest record a reader of the files can find (a snapshot's truncation moves it)."""
        firsts = self._segment_firsts
        return firsts[0] if firsts and not self._memory else None

    @property
    def local_durable_lsn(self) -> int:
        """What this node alone made durable (``durable_lsn`` before the replica floor)."""
        return self._local_durable

    @property
    def replica_floor(self) -> int | None:
        """The in-sync standby's acknowledged LSN capping ``durable_lsn`` (None: none)."""
        return self._replica_floor

    def set_replica_floor(self, lsn: int | None) -> None:
        """Cap ``durable_lsn`` at ``lsn`` (the last LSN every in-sync standby has made
        durable), or lift the cap (None: acknowledged = durable here). ``durable_lsn``
        is then ``min(local durable LSN, lsn)``, and everything that waits on it --
        ``wait_durable``, the durable listeners that release replies -- waits for the
        standby too. The cap never takes ``durable_lsn`` back; raising or lifting it
        releases at once what it held."""
        self._replica_floor = lsn
        self._on_progress(self._local_durable, self._synced_lsn)

    def set_write_gate(self, error: Callable[[], Exception] | None) -> None:
        """Make :meth:`check_writable` raise ``error()`` (an UNAVAILABLE error saying
        why) until called with None: the node refuses writes it cannot acknowledge,
        e.g. with no in-sync standby under ``--min-insync 2``."""
        was = self._write_gate
        self._write_gate = error
        if was is not None and error is None and self.writable:
            self._writable_again()

    def add_writable_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` each time refused writes are accepted again (space freed after
        a full disk, the write gate lifted): the coordinator retries at once what it
        could not journal meanwhile (due deadlines, lease expiries, timers)."""
        self._writable_listeners.append(fn)

    def _writable_again(self) -> None:
        for fn in self._writable_listeners:
            fn()

    def write_now(self) -> None:
        """Write what was appended, and ask for its fsync, now (on the event loop, in
        the caller's step) instead of at the flusher's next round: the coordinator calls
        this at the end of each actor batch, so a batch's commits reach the page cache
        and the sync helper one scheduling hop earlier. No-op in memory mode, and
        whenever the flusher has anything else to do first (a roll, a backlog, a write
        waiting for disk space, the stop): then the flusher's round does it.

        Then it takes in the sync helper's answers already waiting in its socket
        (:meth:`poll_answers`): a step that ends sees an fsync that ended during it.
        (After the write, so that a sync asked for on an answer covers this step's
        records too.)"""
        if not buggify.fires("journal.write_now.skip"):  # else the flusher's round writes it
            self._write_now()
        if self._outstanding:
            self.poll_answers()

    def _write_now(self) -> None:
        if (not self._buf or self._chunks or self._buf_seg is not None or self._backlog
                or self._retry_at is not None or self._stop or self._error is not None
                or self._key is None or self._syncer is None):
            return
        data = self._buf
        self._buf = bytearray()
        upto = self._buf_upto
        try:
            n = self._disk.write(self._fd, data)  # type: ignore[arg-type]
        except OSError:  # ENOSPC, or a real error: the flusher's round retries and decides
            n = 0
        if n:
            self._wpos += n
            self._n_bytes += n
        if n < len(data):
            self._backlog.append([None, data, n])  # the flusher continues where this stopped
            self._taken = upto
            self._kick()
            return
        self._n_writes += 1
        self._taken = self._written = upto
        self._preallocate_ahead()
        if self.min_free_bytes or self.ballast_bytes:
            if self._space_check() is not None and self._poll_at is None:
                self._poll_at = trio.current_time() + self.space_poll_s
                self._kick()
        if self._fsync_each:
            self._want_sync()
        else:
            self._on_progress(upto, self._synced_lsn)  # interval: durable once written
            if self._next_sync_at is None:
                # Armed here, as the flusher's round arms it for what it writes, and the
                # flusher woken to wait for it. (Only kicked, the flusher found nothing to
                # take and slept on without a deadline: in interval mode a serving node
                # never fsynced until a snapshot, a roll or the stop forced one -- a
                # machine crash lost up to a snapshot interval, not --interval-ms.)
                self._next_sync_at = trio.current_time() + self.interval_s
                self._kick()

    # --- the flusher's reports (on the event loop)

    def _on_progress(self, durable: int, synced: int) -> None:
        probe = self._wait_probe
        if probe is not None and probe[0] <= durable:
            self._wait_probe = None
            self.commit_wait_seconds.observe(time.perf_counter() - probe[1])
        if durable > self._local_durable:
            self._local_durable = durable
        floor = self._replica_floor
        if floor is not None and floor < durable:
            durable = floor
        advanced = durable > self._durable_lsn
        if advanced:
            self._durable_lsn = durable
        if synced > self._synced_lsn:
            self._synced_lsn = synced
        heap = self._waiter_heap
        waiters = self._waiters
        while heap and heap[0] <= durable:
            waiters.pop(heapq.heappop(heap)).set()
        if advanced and self._listeners:
            for fn in self._listeners:
                fn(durable, None)
        if self._sync_waiters:
            keep = []
            for lsn, ev in self._sync_waiters:
                if lsn <= self._synced_lsn:
                    ev.set()
                else:
                    keep.append((lsn, ev))
            self._sync_waiters = keep

    def _wake_all(self) -> None:
        if self._listeners:
            err: Exception
            if self._error is not None:
                err = JournalWriteError(*self._error.args)
            else:
                err = JournalClosedError(f"journal stopped; nothing past LSN {self._durable_lsn} is durable")
            for fn in self._listeners:
                fn(self._durable_lsn, err)
        for ev in self._waiters.values():
            ev.set()
        self._waiters.clear()
        self._waiter_heap.clear()
        for _, ev in self._sync_waiters:
            ev.set()
        self._sync_waiters.clear()
        ev = self._space_event
        self._space_event = None
        if ev is not None:
            ev.set()

    def _on_error(self, exc: BaseException) -> None:
        if self._error is None:
            check = ("Check why the sync helper ended (the OOM killer? a kill?), then restart"
                     if isinstance(exc, SyncHelperGone) else "Check the disk, then restart")
            err = JournalWriteError(
                f"journal write/fsync failed at {self._jdir} ({type(exc).__name__}: {exc}); the "
                f"journal is stopped and acknowledges nothing more (fail-stop). Durable LSN "
                f"{self._durable_lsn}. {check}: recovery keeps what reached the disk."
            )
            err.__cause__ = exc
            self._error = err
            log.error("%s", err.message)
        self._wake_all()

    # ----------------------------------------------------------------- flusher

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The group-commit flusher. Start it once with ``await nursery.start(journal.run)``.

        A Trio task: it takes everything appended, writes it into the segment (on the
        event loop: a write into the page cache) and asks the sync helper
        (:mod:`.syncer`) to fdatasync it; the helper's answer marks it durable. Records
        appended meanwhile go out with the next round. Returns when the journal is
        closed (:meth:`aclose`). If cancelled, it first writes and fsyncs what is
        buffered (shielded; bounded by one fsync, or by one more write attempt when the
        disk is full), then the journal counts as closed.

        Raises:
            JournalWriteError: a write or fsync failed. Treat it as fatal (fail-stop):
                every pending waiter has already been woken with the same error. A full
                disk is not such a failure (see the module docstring).
            RuntimeError: run() was already started.
        """
        if self._running or self._done is not None:
            raise RuntimeError("Journal.run() was already started")
        if self._closed:
            raise JournalClosedError("journal is closed")
        self._running = True
        self._done = trio.Event()
        if self._memory:
            task_status.started()
            try:
                await self._done.wait()  # set by aclose()
            finally:
                self._running = False
                self._closed = True
            return
        try:
            await self._start_syncer()
            task_status.started()
            try:
                await self._serve()
            except* trio.Cancelled:  # (a nursery's: in a group)
                # Cancelled while waiting for work or for the last answers (every other
                # await of the flusher is shielded): write and fsync what is buffered.
                self._closed = True
                self._stop = True
                with trio.CancelScope(shield=True):
                    await self._serve()
                raise
        finally:
            await self._stop_syncer()
            self._running = False
            self._closed = True
            self._done.set()
            self._wake_all()
        if self._error is not None:
            self._raise_failed()

    async def _start_syncer(self, kind: str | None = None) -> None:
        """Start the sync helper (``kind`` or ``self.sync``) and hand it the segment. A
        Disk that overrides ``fdatasync`` gets the thread helper instead of the process
        (its method must be the one called; the inline one calls it too); a process that
        cannot be started falls back to the thread, with a warning."""
        kind = kind or self.sync
        if type(self._disk).fdatasync is not Disk.fdatasync and kind == "process":
            kind = "thread"
        try:
            self._syncer = await self._disk.start_syncer(kind)
        except OSError as exc:
            log.warning("journal: cannot start the sync helper process (%s); fdatasync runs in a "
                        "thread of this process instead (slower under load)", exc)
            self._syncer = await self._disk.start_syncer("thread")
        if self._fd is not None:
            self._key = self._syncer.register(self._fd)

    async def _stop_syncer(self) -> None:
        syncer, self._syncer = self._syncer, None
        if syncer is not None:
            await syncer.aclose()

    async def _serve(self) -> None:
        """The flusher and the task that reads the helper's answers, until the flusher
        returns (stop, or fail-stop)."""
        # The answers are read under a shield of their own, lifted only when the
        # flusher returns: a cancellation that finds the flusher in a shielded step
        # (a roll waiting for its fsync) must not take away the task that tells it the
        # fsync is done (it did: the flusher waited forever and the daemon's shutdown
        # hung -- found by the simulator once it ran this flusher, seed 127).
        answers_scope = trio.CancelScope(shield=True)

        async def answers() -> None:
            with answers_scope:
                await self._answers()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answers)
            nursery.start_soon(self._watch_syncs)
            try:
                await self._flusher()
            finally:
                answers_scope.cancel()
                nursery.cancel_scope.cancel()

    def _request_stop(self) -> None:
        self._stop = True
        self._kick()

    def _kick(self) -> None:
        ev = self._wake
        if ev is not None:
            self._wake = None
            ev.set()

    def _has_data(self) -> bool:
        return bool(self._chunks) or bool(self._buf) or self._buf_seg is not None

    def _take(self) -> tuple[list[tuple[int | None, bytearray]], int]:
        """Everything appended and not yet taken, as chunks ``(segment to roll to first |
        None, bytes)``, and the last LSN in them."""
        chunks = self._chunks
        if self._buf or self._buf_seg is not None:
            chunks.append((self._buf_seg, self._buf))
            self._buf = bytearray()
            self._buf_seg = None
        self._chunks = []
        return chunks, self._buf_upto

    # --- sync requests and their answers (the helper answers in order)

    def _request(self, key: int, lsn: int | None, *, full: bool = False) -> int:
        """Send a sync request for ``key`` that makes the records up to ``lsn`` (None:
        none, a directory or a segment's close) synced once answered; its id."""
        rid = self._syncer.request(key, full=full)  # type: ignore[union-attr]
        self._outstanding.append((rid, lsn, trio.current_time()))
        if lsn is not None:
            self._requested_lsn = lsn
        return rid

    def _want_sync(self) -> None:
        """Have everything written so far synced: a request now, or as soon as one of
        the :data:`~.syncer.MAX_OUTSTANDING` in flight is answered."""
        out = self._outstanding
        if (len(out) < MAX_OUTSTANDING and self._key is not None  # None: mid-roll
                and not (out and buggify.fires("journal.sync.defer"))):  # (asked again on an answer)
            self._sync_wanted = False
            self._request(self._key, self._written)  # type: ignore[arg-type]
        else:
            self._sync_wanted = True

    def poll_answers(self) -> None:
        """Handle every answer of the sync helper already received (non-blocking), as
        :meth:`_answers` would when it next runs: records become durable and their
        replies go out now, not after the scheduler's round. A failed sync or a helper
        gone stops the journal here (fail-stop), as in :meth:`_answers`."""
        syncer = self._syncer
        if syncer is None or self._error is not None:
            return
        try:
            while self._outstanding:
                got = syncer.poll_answer()
                if got is None:
                    return
                self._on_answer(*got)
        except OSError as exc:
            self._sync_failed(exc)

    async def _answers(self) -> None:
        """Read the helper's answers: each makes every request up to its id done."""
        try:
            while True:
                rid, seconds = await self._syncer.next_answer()  # type: ignore[union-attr]
                self._on_answer(rid, seconds)
        except OSError as exc:
            self._sync_failed(exc)

    def _sync_failed(self, exc: OSError) -> None:
        """A failed fsync, or the helper gone: fail-stop, and wake what waits for it."""
        self._on_error(exc)
        self._kick()
        self._set_answered()

    @property
    def sync_pending_s(self) -> float:
        """Seconds (trio time) since the oldest sync request not yet answered was sent
        (0.0: none in flight): what a stuck disk makes grow."""
        out = self._outstanding
        return trio.current_time() - out[0][2] if out else 0.0

    async def _watch_syncs(self) -> None:
        """Report a stuck fdatasync while it runs: once the oldest request in flight is
        ``10 * slow_sync_s`` old, then every 30 s (checked every ``slow_sync_s``). Its
        end is reported by :meth:`_on_answer`."""
        next_report = 0.0
        stuck_s = 10 * self.slow_sync_s
        while True:
            await trio.sleep(self.slow_sync_s)
            pending = self.sync_pending_s
            if pending < stuck_s:
                continue
            now = trio.current_time()
            if self._stuck_reported and now < next_report:
                continue
            self._stuck_reported = True
            next_report = now + 30.0
            log.warning("journal: an fdatasync of %s has been running for %.1f s; every write and "
                        "its reply wait for it (a slow or stuck disk? %d records not yet durable)",
                        self._jdir, pending, max(self.last_lsn - self._durable_lsn, 0))

    def _note_slow(self, seconds: float) -> None:
        """An fdatasync took ``seconds`` >= :attr:`slow_sync_s`: a WARNING, at most one
        per 10 s (with how many since the last), except the end of one reported stuck."""
        self._slow_syncs += 1
        now = trio.current_time()
        if self._stuck_reported:
            self._stuck_reported = False
            log.warning("journal: the fdatasync reported running returned after %.1f s", seconds)
        elif self._slow_logged_at is None or now - self._slow_logged_at >= 10.0:
            log.warning("journal: a slow fdatasync of %s took %.2f s (%d of %g s or more since the "
                        "last warning); replies waited for it", self._jdir, seconds, self._slow_syncs,
                        self.slow_sync_s)
        else:
            return
        self._slow_logged_at = now
        self._slow_syncs = 0

    def _on_answer(self, rid: int, seconds: float) -> None:
        self._answered = rid
        self._n_fsyncs += 1
        self.fsync_seconds.observe(seconds)
        if seconds >= self.slow_sync_s or self._stuck_reported:
            self._note_slow(seconds)
        out = self._outstanding
        synced = None
        while out and out[0][0] <= rid:
            lsn = out.popleft()[1]
            if lsn is not None:
                synced = lsn
        if synced is not None and synced > self._synced_lsn:
            self.commit_records.observe(synced - self._synced_lsn)
            self._on_progress(synced if self._fsync_each else self._durable_lsn, synced)
        if self._sync_wanted and self._error is None:
            self._want_sync()
        self._set_answered()

    def _set_answered(self) -> None:
        ev = self._answer_event
        if ev is not None:
            self._answer_event = None
            ev.set()

    async def _wait_answered(self, rid: int) -> None:
        """Until request ``rid`` is answered; raises the journal's error if it failed."""
        while self._answered < rid and self._error is None:
            if self._answer_event is None:
                self._answer_event = trio.Event()
            await self._answer_event.wait()
        if self._error is not None:
            self._raise_failed()

    async def _flusher(self) -> None:
        """The flusher's rounds (see :meth:`run`). Its only unshielded checkpoints are
        the wait for work and, at the stop, the wait for the last answers, so a
        cancellation leaves no round half done. An error other than a full disk is
        reported with :meth:`_on_error` (fail-stop) and ends it."""
        interval = self.interval_s
        fsync_each = self._fsync_each
        backlog = self._backlog
        watch = bool(self.min_free_bytes or self.ballast_bytes)
        if self._refusal is not None and self._poll_at is None:  # refused from the start
            self._reported = self._refusal
            self._poll_at = trio.current_time() + self.space_poll_s
        try:
            while self._error is None:
                while not (self._has_data() or (backlog and self._retry_at is None) or self._stop
                           or self._force_sync or self._error is not None):
                    deadline = min((t for t in (self._next_sync_at, self._retry_at, self._poll_at)
                                    if t is not None), default=math.inf)
                    if deadline <= trio.current_time():
                        break
                    self._wake = trio.Event()
                    with trio.move_on_at(deadline):
                        await self._wake.wait()
                    self._wake = None
                if self._error is not None:
                    return
                if not self._stop and buggify.fires("journal.round.delay"):
                    await trio.sleep(buggify.delay())  # (nothing taken yet: cancellable here)
                chunks, upto = self._take()
                stop = self._stop
                force = self._force_sync
                self._force_sync = False
                if chunks:
                    backlog.extend([seg, data, 0] for seg, data in chunks)
                    self._taken = upto
                now = trio.current_time()
                wrote = False
                if backlog and (self._retry_at is None or now >= self._retry_at or stop):
                    if await self._drain(backlog):
                        wrote = True
                        self._written = self._taken
                        if not stop:
                            self._preallocate_ahead()
                        if self._retry_at is not None:
                            self._retry_at = None
                            log.warning("journal: the write that waited for disk space at %s went "
                                        "through (LSN up to %d)", self._jdir, self._written)
                    else:
                        lsns = (self._written + 1, self._taken)
                        try:
                            self._free_bytes = self._disk.free_bytes(self._jdir)  # type: ignore[arg-type]
                        except OSError:
                            pass
                        if self._retry_at is None:
                            self._stalls += 1
                        self._retry_at = now + self.space_poll_s
                        self._report_space("stalled", lsns)
                        if stop:
                            self._abandoned = lsns
                            log.error("journal: closing with LSN %d..%d never written (disk full at %s); "
                                      "they were never acknowledged", lsns[0], lsns[1], self._jdir)
                            return
                        continue
                # Closing with everything written: the file ends at its last record
                # (the cut is made durable by the final fdatasync below).
                trimmed = stop and not backlog and self._trim_zero_tail()
                # The space check goes first: a refusal it finds is in force before any
                # reply that this round releases can leave.
                if (watch and wrote) or (self._poll_at is not None and now >= self._poll_at) or \
                        (self._reported is not None and wrote):
                    kind = self._space_check()
                    self._poll_at = None if kind is None else trio.current_time() + self.space_poll_s
                written = self._written
                if not fsync_each and wrote:
                    self._on_progress(written, self._synced_lsn)  # interval: durable once written
                if written > self._requested_lsn or trimmed or (force and written > self._synced_lsn):
                    if fsync_each or stop or force:
                        do_sync = True
                    else:
                        if self._next_sync_at is None:
                            self._next_sync_at = now + interval
                        do_sync = now >= self._next_sync_at
                    if do_sync:
                        self._next_sync_at = None
                        if stop or trimmed or force:  # now, not after the requests in flight
                            self._request(self._key, written)  # type: ignore[arg-type]
                        else:
                            self._want_sync()
                elif self._next_sync_at is not None:
                    # a sync asked for meanwhile (a forced one, a roll's) covers what the
                    # interval's was armed for: disarm it, or its past deadline would end
                    # every wait for work at once and this loop would spin without yielding
                    self._next_sync_at = None
                if force and written <= self._synced_lsn and not self._outstanding:
                    self._on_progress(self._durable_lsn, self._synced_lsn)  # nothing to sync
                if stop:
                    if self._outstanding:
                        await self._wait_answered(self._outstanding[-1][0])
                    return
        except Exception as exc:  # noqa: BLE001 - a write, fsync or bug: fail-stop
            self._on_error(exc)

    def _report_space(self, kind: str | None, lsns: tuple[int, int] | None = None) -> None:
        """Flusher: put the refusal state in force when it changes."""
        if kind != self._reported or (kind == "stalled" and lsns != self._backlog_lsns):
            self._reported = kind
            self._on_space(kind, self._free_bytes, lsns)

    def _space_check(self) -> str | None:
        """Read the free space; re-make the ballast when there is room; report and
        return the refusal kind (None: writes may go on). Never raises."""
        assert self._jdir is not None
        try:
            free = self._disk.free_bytes(self._jdir)
        except OSError as exc:
            log.warning("journal: cannot read the free space of %s (%s)", self._jdir, exc)
            return self._reported
        self._free_bytes = free
        kind: str | None = None
        if free < self.min_free_bytes:
            kind = "low"
        elif not self._ballast_ok:
            if free >= self.min_free_bytes + self.ballast_bytes and self._make_ballast():
                self._ballast_ok = True
                try:
                    self._free_bytes = self._disk.free_bytes(self._jdir)
                except OSError:
                    pass
            else:
                kind = "low"
        self._report_space(kind)
        return kind

    def _ballast_path(self) -> Path:
        assert self.data_dir is not None
        return self.data_dir / BALLAST_NAME

    def _make_ballast(self) -> bool:
        path = self._ballast_path()
        try:
            if path.exists() and path.stat().st_size >= self.ballast_bytes:
                return True
            self._disk.allocate(path, self.ballast_bytes)
            return True
        except OSError as exc:
            log.warning("journal: cannot reserve the %d-byte ballast %s (%s)", self.ballast_bytes, path, exc)
            try:
                path.unlink()
            except OSError:
                pass
            return False

    def _release_ballast(self) -> bool:
        """Flusher, on ENOSPC: delete the ballast to make room; True if it did."""
        if not self.ballast_bytes or not self._ballast_ok:
            return False
        self._ballast_ok = False
        path = self._ballast_path()
        try:
            self._disk.remove(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("journal: cannot delete the ballast %s (%s)", path, exc)
            return False
        log.warning("journal: disk full at %s: released the %d-byte ballast to write the records "
                    "already taken; writes are refused until space is freed", self._jdir, self.ballast_bytes)
        return True

    async def _drain(self, backlog: list[list]) -> bool:
        """Flusher: write the backlog ``[[seg_first|None, data, offset], ...]`` in
        order, rolling segments as marked. Returns False when a write failed for lack of
        space (progress is kept in the items, so the next call continues exactly where
        this one stopped); raises any other error."""
        released = False
        disk = self._disk
        while backlog:
            item = backlog[0]
            try:
                if item[0] is not None:
                    await self._roll_file(item[0])
                    item[0] = None
                data = item[1]
                off = item[2]
                size = len(data)
                if off < size:
                    with memoryview(data) as mv:
                        while off < size:
                            n = disk.write(self._fd, mv[off:] if off else data)  # type: ignore[arg-type]
                            off += n
                            item[2] = off
                            self._wpos += n
                            self._n_bytes += n
                    self._n_writes += 1
            except OSError as exc:
                if exc.errno not in SPACE_ERRNOS:
                    raise
                if not released and self._release_ballast():
                    released = True
                    continue
                return False
            backlog.pop(0)
        return True

    async def _roll_file(self, first_lsn: int) -> None:
        """Flusher: close the current segment (fsynced), open the next. Can be called
        again after an ENOSPC from the open (the old file is then closed). Shielded: a
        roll is never left half done."""
        assert self._jdir is not None
        syncer = self._syncer
        assert syncer is not None
        with trio.CancelScope(shield=True):
            if self._fd is not None:
                try:  # the old segment must be complete (and exact: no zero tail) before a newer exists
                    self._trim_zero_tail()
                    await self._wait_answered(self._request(self._key, self._written))  # type: ignore[arg-type]
                except (OSError, JournalWriteError) as exc:  # any errno, ENOSPC too: fail-stop
                    raise _FsyncFailed(f"closing the segment before LSN {first_lsn} (cutting its zero "
                                       f"tail, fdatasync) failed: {exc}") from exc
                syncer.unregister(self._key)  # type: ignore[arg-type]
                self._key = None
                os.close(self._fd)
                self._fd = None
            self._fd = self._disk.open_segment(self._jdir / segment_name(first_lsn))  # ENOSPC: retried
            self._key = syncer.register(self._fd)
            self._wpos = self._zend = 0
            self._prealloc_ok = True
            self._file_first = first_lsn
            try:
                dfd = os.open(self._jdir, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    dkey = syncer.register(dfd)
                finally:
                    os.close(dfd)
                rid = self._request(dkey, None, full=True)
                syncer.unregister(dkey)
                await self._wait_answered(rid)
            except (OSError, JournalWriteError) as exc:  # an fsync: fail-stop, whatever the errno
                raise _FsyncFailed(f"fsync of {self._jdir} after creating {segment_name(first_lsn)} "
                                   f"failed: {exc}") from exc
            assert self.data_dir is not None
            # a small file written, fsynced and renamed: off the loop
            await self._disk.run_blocking(try_write_manifest, self.data_dir, Manifest(active_segment=first_lsn))

    def _preallocate_ahead(self) -> None:
        """Flusher, after a write: when less than half of ``preallocate_bytes`` of
        zeros is left ahead of the write position, write ``preallocate_bytes`` more (up to
        ``segment_bytes``). They reach the disk with the next fdatasync (which then also
        commits the new file size, once per ``preallocate_bytes``); the fdatasyncs after
        it write data only. A failure (ENOSPC, anything) only stops preallocating in this
        segment: nothing depends on the zeros, the records are then written as appends."""
        want = self.preallocate_bytes
        wpos = self._wpos
        if not want or not self._prealloc_ok or self._zend - wpos >= want >> 1:
            return
        start = max(self._zend, wpos)
        size = min(want, self.segment_bytes - start)
        if size <= 0:
            return
        try:
            if buggify.fires("journal.preallocate.fail", 0.1):
                raise OSError(errno.ENOSPC, "buggify: preallocation fails")
            self._disk.preallocate(self._fd, start, size)  # type: ignore[arg-type]
        except OSError as exc:
            self._prealloc_ok = False
            self._zend = start + size  # some of it may be there: trimmed at the roll/close
            log.warning("journal: cannot preallocate %d bytes in %s at offset %d (%s); this "
                        "segment is written without preallocation", size,
                        segment_name(self._file_first), start, exc)
            return
        self._zend = start + size

    def _trim_zero_tail(self) -> bool:
        """Flusher (or with it stopped): cut the active segment's zero tail so
        that the file ends at its last record (before the roll's or the close's final
        fdatasync). True if it cut. Raises OSError (fail-stop at the callers)."""
        if self._fd is None or self._zend <= self._wpos:
            return False
        self._disk.truncate(self._fd, self._wpos)
        self._zend = self._wpos
        return True

    # ----------------------------------------------------------------- maintenance

    def truncate_below(self, lsn: int, *, unlink: bool = True) -> list[Path]:
        """Delete segment files all of whose records have LSN < ``lsn`` (sync).

        Call it after a snapshot valid at LSN ``S`` was written and synced, with
        ``lsn = S + 1`` (every record <= S is then in the snapshot). The active
        segment is never deleted, nor a segment whose successor holds no durable record
        yet. Returns the deleted paths. The directory is not fsynced: a deletion undone
        by a crash only leaves garbage that the next scan skips and the next call
        removes. No-op in memory mode.

        With ``unlink=False`` the segments are only dropped from the journal's list and
        returned: the caller deletes the files off the event loop (unlinking a 64 MiB
        segment takes tens of ms). Files left behind are garbage, as above.
        """
        if self._memory or self._jdir is None:
            return []
        firsts = self._segment_firsts
        limit = min(lsn, self._durable_lsn)
        deleted: list[Path] = []
        i = 0
        while i + 1 < len(firsts) and firsts[i + 1] <= limit:
            path = self._jdir / segment_name(firsts[i])
            if unlink:
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
            deleted.append(path)
            i += 1
        if i:
            del firsts[:i]
        return deleted

    async def remove_segments(self, paths: list[Path]) -> None:
        """Delete the segment files :meth:`truncate_below` returned with
        ``unlink=False``, off the event loop (:meth:`Disk.run_blocking`). A file
        already gone is skipped. Raises OSError from the deletion."""
        if paths:
            await self._disk.run_blocking(_unlink_all, list(paths))

    async def aclose(self) -> None:
        """Write and fdatasync everything buffered (in every disk mode), stop the
        flusher and close the segment file; then record the clean end in
        ``JOURNAL_MANIFEST``. Idempotent. Shielded from cancellation (bounded by one
        write + fsync). After it, ``append`` raises JournalClosedError and ``run``
        returns.

        On a full disk it tries the write once more; records that still cannot be
        written are dropped (they were never acknowledged; their waiters get
        JournalClosedError) and logged, and no clean end is recorded.

        Raises:
            JournalWriteError: the final write/fsync failed (or the journal had failed).
        """
        if self._memory:
            self._closed = True
            if self._done is not None:
                self._done.set()
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True):
            already = self._closed and self._fd is None
            self._closed = True
            if self._done is not None:
                if self._running:
                    self._request_stop()
                await self._done.wait()
            elif self._fd is not None and self._error is None:
                # run() never started: one last flusher round here (a worker thread
                # fsyncs; on a full disk the write is tried once, then abandoned).
                self._stop = True
                try:
                    await self._start_syncer("thread")
                    await self._serve()
                finally:
                    await self._stop_syncer()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._wake_all()
            if (not already and self._error is None and self._abandoned is None
                    and self._synced_lsn == self._next_lsn - 1 and self.data_dir is not None):
                await self._disk.run_blocking(
                    try_write_manifest, self.data_dir,
                    Manifest(active_segment=self._file_first, clean_end_lsn=self._next_lsn - 1))
        if self._error is not None:
            self._raise_failed()

    # ----------------------------------------------------------------- stats

    def stats(self) -> dict[str, int]:
        """``{"fsyncs", "records", "bytes", "writes"}`` since this object was created:
        fdatasync calls, records appended, framed bytes written (appended, in memory
        mode), write() calls."""
        return {"fsyncs": self._n_fsyncs, "records": self._next_lsn - self._opened_next,
                "bytes": self._n_bytes, "writes": self._n_writes}

    @property
    def sync_helper(self) -> str:
        """Where this journal's fdatasync runs now: ``"process <pid>"`` (the sync helper
        process), ``"thread"`` (a worker thread: ``sync="thread"``, a Disk that overrides
        ``fdatasync``, or the fallback when no process could start), ``"inline"`` (on the
        event loop: ``sync="inline"``), or ``""`` (none running: not started yet, or
        stopped)."""
        syncer = self._syncer
        if syncer is None:
            return ""
        if syncer.pid is not None:
            return f"process {syncer.pid}"
        return "inline" if syncer.kind == "inline" else "thread"

    def statistics(self) -> JournalStatistics:
        """Trio-style statistics object (see :class:`JournalStatistics`)."""
        s = self.stats()
        return JournalStatistics(
            mode=self.mode,
            last_lsn=self.last_lsn,
            durable_lsn=self._durable_lsn,
            synced_lsn=self._synced_lsn,
            buffered_bytes=len(self._buf) + sum(len(c) for _, c in self._chunks),
            waiters=len(self._waiters),
            records=s["records"],
            bytes=s["bytes"],
            writes=s["writes"],
            fsyncs=s["fsyncs"],
            segments=len(self._segment_firsts),
            failed=self._error is not None,
            closed=self._closed,
            refusing=self._refusal,
            free_bytes=self._free_bytes,
            refusals=self._refusals,
            stalls=self._stalls,
        )

    def __repr__(self) -> str:
        return (f"<Journal {self.mode} {self.data_dir} last={self.last_lsn} "
                f"durable={self._durable_lsn}>")


# --------------------------------------------------------------------------- reading


@dataclass
class SegmentInfo:
    """One validated segment: records ``first_lsn .. last_lsn`` live in bytes
    ``[0, end_offset)``; the first record with LSN > after_lsn starts at
    ``start_offset`` (== end_offset when none). Bytes before ``start_offset`` may hold
    damage in records the snapshot already covers (skipped, see :func:`scan_journal`)."""

    path: Path
    first_lsn: int
    last_lsn: int  # first_lsn - 1 when empty
    end_offset: int
    start_offset: int


@dataclass
class TornTail:
    """A torn/zeroed tail that was (or, read-only, would be) cut: ``path`` is cut at
    byte ``offset``, dropping ``bytes_dropped`` bytes."""

    path: Path
    offset: int
    bytes_dropped: int
    reason: str


@dataclass
class CoveredDamage:
    """Damage in records the snapshot already holds (LSN <= after_lsn): ignored.

    ``path``/``offset``: where; ``reason``: what; ``resumed_at``: byte offset of the
    record ``after_lsn + 1`` found past it (None: the segment holds nothing newer)."""

    path: Path
    offset: int
    reason: str
    resumed_at: int | None


@dataclass
class ScanResult:
    """Outcome of :func:`scan_journal`.

    Attributes:
        after_lsn: the LSN scanning started after (usually the snapshot LSN).
        segments: validated segments holding records > after_lsn (in order).
        last_lsn: last LSN in the journal (after_lsn when it holds nothing newer).
        next_lsn: the LSN to open the journal with.
        record_count: number of records with LSN > after_lsn.
        torn_tail: the tail that was cut, or None.
        skipped_segments: segments wholly <= after_lsn, not read (garbage awaiting
            ``truncate_below``).
        covered_damage: damage found in records <= after_lsn and ignored (logged).
    """

    after_lsn: int
    segments: list[SegmentInfo]
    last_lsn: int
    next_lsn: int
    record_count: int
    torn_tail: TornTail | None = None
    skipped_segments: list[Path] = field(default_factory=list)
    covered_damage: list[CoveredDamage] = field(default_factory=list)

    def iter_records(self) -> Iterator[tuple[int, bytes]]:
        """Yield ``(lsn, payload)`` for every record with LSN > after_lsn, in order.
        Re-reads the (already validated) segments, one at a time in memory, so it can
        be iterated more than once. Raises OSError if a segment vanished meanwhile."""
        unpack = _HDR.unpack_from
        for seg in self.segments:
            with open(seg.path, "rb") as f:
                data = f.read(seg.end_offset)
            off = seg.start_offset
            end = seg.end_offset
            while off < end:
                n, _, lsn = unpack(data, off)
                b = off + HEADER_SIZE
                off = b + n
                yield lsn, data[b:off]

    __iter__ = iter_records

    def iter_payloads(self) -> Iterator[bytes]:
        """The payloads of :meth:`iter_records` alone (recovery's replay: no tuple per
        record)."""
        for seg in self.segments:
            with open(seg.path, "rb") as f:
                data = f.read(seg.end_offset)
            yield from _payloads_between(data, seg.start_offset, seg.end_offset)

    def __len__(self) -> int:
        return self.record_count


@dataclass
class _Problem:
    kind: str  # "torn" | "corrupt" | "gap" | "start_gap" | "ahead" | "missing_tail" | "short_tail"
    seg_index: int  # index into the relevant segments; -1 when not about one segment
    path: Path
    offset: int
    reason: str
    lsn: int  # the first LSN the damage takes away (the journal is intact before it)
    missing: tuple[int, int | None] | None = None  # LSNs already gone (no file holds them)


@dataclass
class _Analysis:
    segs: list[tuple[int, Path]]  # every segment file
    start: int  # index in segs of the first relevant segment (the rest are skipped)
    infos: list[SegmentInfo]  # validated relevant segments, up to the problem
    problem: _Problem | None
    expected: int  # LSN after the last good record (after_lsn + 1 at least when covered)
    records_present: bool
    count: int
    covered: list[CoveredDamage]
    manifest: Manifest | None

    @property
    def relevant(self) -> list[tuple[int, Path]]:
        return self.segs[self.start:]

    @property
    def skipped(self) -> list[Path]:
        return [p for _, p in self.segs[: self.start]]


def _validate(data: bytes, lsn: int, after_lsn: int, off: int = 0) -> tuple[int, int, int, str | None, bool]:
    """Walk records from byte ``off`` expecting ``lsn`` first.

    Returns ``(good_end, next_lsn, start_offset, problem, definite)``: problem is None
    when the rest of the buffer is good; ``definite`` is True when the problem cannot be
    a torn write (a record with a valid CRC but the wrong LSN).
    """
    return _validate_collect(data, memoryview(data), lsn, after_lsn, off, -1, None, 0)[:5]


def _validate_collect(data: bytes, mv: memoryview, lsn: int, after_lsn: int, off: int, start: int,
                      out: list | None, limit: int) -> tuple[int, int, int, str | None, bool, bool]:
    """:func:`_validate` that also appends the payload of every record with LSN >
    ``after_lsn`` to ``out`` as it checks it (one pass: the replay's read), stopping
    after ``limit`` payloads (``out`` None: it collects nothing and never stops early).
    ``start`` is the offset of the first such record found so far (-1: none yet).

    Returns ``(good_end, next_lsn, start_offset, problem, definite, more)``: the first
    five as :func:`_validate` (``start_offset`` is -1 while ``more``); ``more`` is True
    when it stopped at ``limit`` with bytes left (call again from ``good_end``)."""
    size = len(data)
    unpack = _HDR.unpack_from
    collect = out is not None
    append = out.append if collect else None
    limit_lsn = (lsn + limit if lsn > after_lsn else after_lsn + 1 + limit) if collect else -1  # (-1: never)
    end_hdr = size - HEADER_SIZE
    while off <= end_hdr:
        n, crc, rlsn = unpack(data, off)
        b = off + HEADER_SIZE
        end = b + n
        if end > size or n > MAX_PAYLOAD:
            return off, lsn, (off if start < 0 else start), (
                f"record header at LSN {lsn} claims {n} payload bytes past the end of the file"), False, False
        if crc32(mv[off + 8:end]) != crc:
            return off, lsn, (off if start < 0 else start), f"bad CRC in the record expected to be LSN {lsn}", False, False
        if rlsn != lsn:
            return off, lsn, (off if start < 0 else start), f"LSN gap: expected LSN {lsn}, found {rlsn}", True, False
        if rlsn > after_lsn:
            if start < 0:
                start = off
            if collect:
                append(data[b:end])
        lsn += 1
        off = end
        if lsn == limit_lsn and off < size:
            return off, lsn, start, None, False, True
    if start < 0:
        start = off
    if off != size:
        return off, lsn, start, f"{size - off} trailing bytes: a truncated record header", False, False
    return off, lsn, start, None, False, False


def _map_segment(f) -> "bytes | mmap.mmap":
    """The segment file ``f`` mapped read-only, its pages populated at once (no copy,
    no page fault a page); ``b""`` when empty. Only while the data-dir lock is held:
    a file shortened under a mapping would fault the process. Close with
    :func:`_unmap`."""
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        return b""
    return mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                     prot=mmap.PROT_READ)


def _unmap(data) -> None:
    if type(data) is mmap.mmap:
        data.close()


def _payloads_between(data: bytes, off: int, end: int) -> Iterator[bytes]:
    """The payloads of the (already validated) records in ``data[off:end]``."""
    unpack = _HDR.unpack_from
    while off < end:
        b = off + HEADER_SIZE
        off = b + unpack(data, off)[0]
        yield data[b:off]


def _find_valid(data: bytes, from_off: int, lsns) -> tuple[int, int] | None:
    """``(offset, lsn)`` of the first (lowest offset) record at or after ``from_off``
    that has one of the LSNs ``lsns`` and a valid CRC, or None. Searches for the LSN
    bytes (at most 10000 candidates per LSN), so it is fast on any file."""
    size = len(data)
    mv = memoryview(data)
    best: tuple[int, int] | None = None
    for target in lsns:
        pat = _Q.pack(target)
        pos = from_off + 8
        tries = 0
        while tries < 10000:
            p = data.find(pat, pos)
            if p < 0 or (best is not None and p - 8 >= best[0]):
                break
            tries += 1
            h = p - 8
            pos = p + 1
            if h + HEADER_SIZE > size:
                continue
            n, crc, _ = _HDR.unpack_from(data, h)
            end = h + HEADER_SIZE + n
            if n <= MAX_PAYLOAD and end <= size and crc32(mv[h + 8:end]) == crc:
                best = (h, target)
                break
    return best


_PAGE = 4096
#: TornTail.reason of a zero tail: what a crash leaves in a preallocated segment
ZERO_TAIL = "the unused zero-filled (preallocated) tail"


def _is_zero(data: bytes, start: int, end: int) -> bool:
    """Are ``data[start:end]`` all zero bytes? (C speed: bytes.count)"""
    return data.count(0, start, end) == end - start


def _unwritten_page_at(data: bytes, off: int) -> bool:
    """Does a never-written page start at ``off``: zeros from ``off`` (at least a
    record header's worth) up to the next page boundary? Where a record should begin,
    in a preallocated segment, that is a page of an unsynced write that did not reach
    the disk (see *Preallocation*), not damage."""
    end = max(off + HEADER_SIZE, (off // _PAGE + 1) * _PAGE)
    return end <= len(data) and _is_zero(data, off, end)


def _good_record_follows(data: bytes, bad_off: int, lsn: int) -> bool:
    """Is there a valid record (CRC ok, LSN lsn..lsn+2) starting after ``bad_off``?"""
    return _find_valid(data, bad_off + 1, (lsn, lsn + 1, lsn + 2)) is not None


def _last_valid_lsn(data: bytes, off: int, lsn: int) -> int | None:
    """The highest LSN of a valid record at or after ``off`` (records ``lsn`` onwards
    expected; damage is skipped by searching for the next of 3 LSNs), or None."""
    best = None
    while True:
        found = _find_valid(data, off, (lsn, lsn + 1, lsn + 2))
        if found is None:
            return best
        h, flsn = found
        good_end, nxt, _, problem, _ = _validate(data, flsn, 0, h)
        best = nxt - 1
        if problem is None or good_end <= off:
            return best
        off, lsn = good_end + 1, nxt


def _validate_segment(data: bytes, first: int, path: Path, after_lsn: int):
    """Validate one segment. Damage in records <= after_lsn (the snapshot holds them) is
    skipped when record ``after_lsn + 1`` is found past it, or when no record past the
    snapshot follows at all (the segment then ends at after_lsn for our purposes).

    Returns ``(info, next_lsn, problem, definite, problem_lsn, covered)``.
    """
    good_end, nxt, start_off, problem, definite = _validate(data, first, after_lsn)
    if problem is None or nxt > after_lsn:
        return SegmentInfo(path, first, nxt - 1, good_end, start_off), nxt, problem, definite, nxt, None
    target = after_lsn + 1
    found = _find_valid(data, good_end, (target,))
    if found is not None:
        h = found[0]
        covered = CoveredDamage(path, good_end, problem, h)
        g2, n2, s2, p2, d2 = _validate(data, target, after_lsn, h)
        return SegmentInfo(path, first, n2 - 1, g2, s2), n2, p2, d2, n2, covered
    if _find_valid(data, good_end, range(target + 1, target + 8)) is None:
        covered = CoveredDamage(path, good_end, problem, None)
        return SegmentInfo(path, first, after_lsn, good_end, good_end), target, None, False, target, covered
    # Records past the snapshot follow, but not LSN after_lsn + 1: real damage from there.
    return (SegmentInfo(path, first, nxt - 1, good_end, good_end), nxt,
            f"{problem} (records past the snapshot follow, but not LSN {target})", True, target, None)


def _analyse(data_dir: str | os.PathLike[str], after_lsn: int) -> _Analysis:
    """Validate without modifying anything (see :func:`scan_journal`)."""
    g = _analyse_gen(data_dir, after_lsn, False)
    while True:
        try:
            next(g)
        except StopIteration as stop:
            return stop.value


#: payloads per batch a :class:`JournalStream` hands out (a segment is read whole; its
#: payloads are cut and checked this many at a time)
STREAM_BATCH = 4096


def _analyse_gen(data_dir: str | os.PathLike[str], after_lsn: int, collect: bool):
    """:func:`_analyse` as a generator: with ``collect``, it yields the payloads of the
    records with LSN > ``after_lsn`` in batches (lists of bytes) as it validates them --
    each record checked (length, CRC, LSN) before it is handed out, none after the first
    damage -- and returns the same :class:`_Analysis` (``StopIteration.value``).
    Without ``collect`` it yields nothing."""
    segs = list_segments(data_dir)
    jdir = Path(data_dir) / "journal"
    manifest = read_manifest(data_dir)
    start = 0
    for i, (first, _) in enumerate(segs):
        if first <= after_lsn + 1:
            start = i
    records_present = False
    for _, p in segs[:start]:
        try:
            if p.stat().st_size > 0:
                records_present = True
                break
        except FileNotFoundError:
            pass
    infos: list[SegmentInfo] = []
    covered: list[CoveredDamage] = []
    expected: int | None = None
    count = 0
    relevant = segs[start:]

    def result(problem: _Problem | None, exp: int) -> _Analysis:
        return _Analysis(segs, start, infos, problem, exp, records_present, count, covered, manifest)

    for idx, (first, path) in enumerate(relevant):
        with open(path, "rb") as f:
            if collect:  # mapped, not copied: the stream reads each byte once
                data = _map_segment(f)
            else:
                data = f.read()
        if expected is not None and first != expected:
            prev = infos[-1].path if infos else path
            records_present = records_present or bool(data)
            _unmap(data)
            return result(_Problem(
                "gap", idx, path, 0,
                f"missing segment: {prev.name} ends before LSN {expected} but the next "
                f"segment starts at LSN {first}", expected, (expected, first - 1)), expected)
        if expected is None and first > after_lsn + 1 and data:
            _unmap(data)
            records_present = True
            return result(_Problem(
                "start_gap", idx, path, 0,
                f"the journal starts at LSN {first} but the snapshot is at LSN "
                f"{after_lsn}: records {after_lsn + 1}..{first - 1} are missing"
                + (" (was the snapshot store deleted?)" if after_lsn == 0 else ""),
                after_lsn + 1, (after_lsn + 1, first - 1)), first)
        if data:
            records_present = True
        if collect:
            mv = memoryview(data)
            problem = None
            try:
                off, lsn, first_off, more = 0, first, -1, True
                while more:
                    batch: list[bytes] = []
                    off, lsn, first_off, problem, definite, more = _validate_collect(
                        data, mv, lsn, after_lsn, off, first_off, batch, STREAM_BATCH)
                    if batch:
                        yield batch
            finally:
                mv.release()
                mapped, data = data, (data[:] if problem is not None else b"")  # (damage: looked at below)
                _unmap(mapped)
            if problem is None or lsn > after_lsn:  # what _validate_segment's first case returns
                info = SegmentInfo(path, first, lsn - 1, off, first_off)
                nxt, plsn, cov = lsn, lsn, None
            else:  # damage in records the snapshot holds: nothing was handed out yet
                info, nxt, problem, definite, plsn, cov = _validate_segment(data, first, path, after_lsn)
                if info.start_offset < info.end_offset:
                    yield list(_payloads_between(data, info.start_offset, info.end_offset))
        else:
            info, nxt, problem, definite, plsn, cov = _validate_segment(data, first, path, after_lsn)
        if cov is not None:
            covered.append(cov)
        infos.append(info)
        count += max(0, info.last_lsn - max(first, after_lsn + 1) + 1)
        expected = nxt
        if problem is not None:
            is_last = idx == len(relevant) - 1
            clean = manifest.clean_end_lsn if manifest is not None else None
            if not definite and is_last and (not _good_record_follows(data, info.end_offset, nxt)
                                             or _unwritten_page_at(data, info.end_offset)):
                if clean is None or clean < nxt:
                    return result(_Problem("torn", idx, path, info.end_offset, problem, plsn), nxt)
                problem = (f"{problem}; the journal was closed cleanly at LSN {clean}, so this is "
                           f"damage, not a write torn by a crash")
            return result(_Problem("corrupt", idx, path, info.end_offset, problem, plsn), nxt)
    if expected is None:
        expected = after_lsn + 1
    end = expected - 1
    present_end = max(end, after_lsn)
    if manifest is not None:
        clean = manifest.clean_end_lsn
        active = manifest.active_segment
        if active is not None and not any(f >= active for f, _ in segs):
            if clean is None or clean > present_end:
                # Segment `active` was created for record `active`: every record from
                # the journal's present end up to it existed too.
                lost_from = present_end + 1
                upto = f"{lost_from}..{clean}" if clean is not None else f"from LSN {lost_from} on"
                return result(_Problem(
                    "missing_tail", -1, jdir / segment_name(active), 0,
                    f"segment {segment_name(active)}, the journal's newest segment (JOURNAL_MANIFEST), "
                    f"is missing and the journal ends at LSN {present_end}: records {upto} are lost",
                    lost_from, (lost_from, clean)), expected)
        elif clean is not None and clean > present_end:
            last = infos[-1] if infos else None
            return result(_Problem(
                "short_tail", len(infos) - 1, last.path if last else jdir, last.end_offset if last else 0,
                f"the journal ends at LSN {present_end} but was closed cleanly at LSN {clean}: records "
                f"{present_end + 1}..{clean} are missing (the last segment was shortened or deleted)",
                present_end + 1, (present_end + 1, clean)), expected)
    if records_present and end < after_lsn:
        last = infos[-1] if infos else None
        return result(_Problem(
            "ahead", len(infos) - 1, last.path if last else jdir, last.end_offset if last else 0,
            f"snapshot LSN {after_lsn} is ahead of the journal end {end}: the journal's last "
            f"segment(s) are missing; records after LSN {after_lsn}, if there were any, are lost",
            after_lsn + 1, (after_lsn + 1, None)), expected)
    return result(None, expected)


def _log_covered(covered: list[CoveredDamage], after_lsn: int) -> None:
    for c in covered:
        then = (f"resumed at LSN {after_lsn + 1} (byte offset {c.resumed_at})" if c.resumed_at is not None
                else "nothing newer follows in that segment")
        log.warning("journal: %s is damaged at byte offset %d (%s) in records the snapshot (LSN %d) "
                    "already holds: ignored, %s", c.path, c.offset, c.reason, after_lsn, then)


def scan_journal(
    data_dir: str | os.PathLike[str], after_lsn: int = 0, *, cut_torn_tail: bool = True
) -> ScanResult:
    """Validate the journal and describe the records with LSN > ``after_lsn``.

    Every segment holding such records is read and each record's length, CRC and LSN
    checked (a 1M-record journal takes well under a second). Segments wholly at or below
    ``after_lsn`` are skipped unread. Then iterate the result
    (:meth:`ScanResult.iter_records`) to get the payloads.

    A torn, half-written or zeroed tail of the *last* segment (no valid record after the
    damage) is normal after a crash: with ``cut_torn_tail`` the file is truncated at the
    last good record and fsynced, and a warning naming file and offset is logged on
    ``rallypoint.persistence``; without it, reading just stops there (read-only). After
    a clean close (``JOURNAL_MANIFEST``) there is no such thing as a torn tail: it is
    damage.

    Damage in records at or below ``after_lsn`` (the snapshot holds them) is skipped
    with a warning when record ``after_lsn + 1`` is found past it (or nothing newer
    follows in that segment): nothing of it is needed.

    When the journal holds no records (or none past its start) the next LSN is
    ``after_lsn + 1``.

    Raises:
        JournalCorruptError: damage before the tail: a bad record followed by good ones,
            a missing segment, an LSN gap, records missing between ``after_lsn`` and
            the first segment, the newest segment named by the manifest missing, a
            journal shorter than its recorded clean end, or ``after_lsn`` (the
            snapshot) ahead of the journal's last record while records are present.
            Nothing is modified.
        OSError: reading/truncating failed.
    """
    return _scan_result(data_dir, _analyse(data_dir, after_lsn), after_lsn, cut_torn_tail)


def _scan_result(data_dir: str | os.PathLike[str], a: _Analysis, after_lsn: int, cut_torn_tail: bool) -> ScanResult:
    """What :func:`scan_journal` makes of an analysis: raises for damage, cuts (or
    reports) a torn tail, logs covered damage, builds the :class:`ScanResult`."""
    _log_covered(a.covered, after_lsn)
    problem = a.problem
    expected = a.expected
    torn = None
    if problem is not None:
        if problem.kind != "torn":
            raise JournalCorruptError(str(problem.path), problem.offset, problem.reason,
                                      data_dir=str(data_dir))
        with open(problem.path, "rb") as f:
            f.seek(problem.offset)
            tail = f.read()
        zero = _is_zero(tail, 0, len(tail))
        if zero:
            reason = ZERO_TAIL
        elif len(tail) >= HEADER_SIZE and _is_zero(tail, 0, min(len(tail), max(HEADER_SIZE, _PAGE - problem.offset % _PAGE))):
            reason = (f"zeros where LSN {expected} should start: a page of unsynced records that had "
                      f"not reached the disk when the machine stopped; what follows was never fsynced")
        else:
            reason = problem.reason
        torn = TornTail(problem.path, problem.offset, len(tail), reason)
        if cut_torn_tail:
            _truncate_file(problem.path, problem.offset)
            if zero:  # what a crash leaves in a preallocated segment: nothing was lost
                log.info("journal: cut the zero-filled tail of %s at byte offset %d (%d bytes); "
                         "the last record is LSN %d", problem.path, problem.offset, len(tail), expected - 1)
            else:
                log.warning(
                    "journal: cut a torn tail of %s at byte offset %d (%d bytes dropped: %s); "
                    "the last good record is LSN %d. This is normal after a crash.",
                    problem.path, problem.offset, torn.bytes_dropped, reason, expected - 1)
    last = expected - 1
    next_lsn = expected if expected - 1 >= after_lsn else after_lsn + 1
    infos = [s for s in a.infos if s.start_offset < s.end_offset]
    return ScanResult(after_lsn=after_lsn, segments=infos, last_lsn=max(last, after_lsn),
                      next_lsn=next_lsn, record_count=a.count, torn_tail=torn,
                      skipped_segments=a.skipped, covered_damage=a.covered)


class JournalStream:
    """The records with LSN > ``after_lsn``, validated *as they are read*: one pass over
    each segment (recovery's replay), where :func:`scan_journal` followed by
    :meth:`ScanResult.iter_payloads` reads and walks every segment twice.

    :meth:`iter_payloads` hands out each record's payload only once its frame checked
    out (length, CRC, the LSN that must come next), never one past damage. The verdict
    on the journal as a whole comes when the iteration ends, exactly as
    :func:`scan_journal` gives it: a torn tail of the last segment is cut (with
    ``cut_torn_tail``) and logged, and :attr:`result` is then the same
    :class:`ScanResult`; any other damage (a bad record followed by good ones, a
    missing segment, an LSN gap, a missing or shortened newest segment, a snapshot
    ahead of the journal) raises the same :class:`JournalCorruptError` *at the end of
    the records before it* -- so the caller has applied those, and only those, and must
    throw that state away (recovery fails). Nothing is modified then.

    Args:
        data_dir: the data directory.
        after_lsn: hand out the records past this LSN (the snapshot's).
        cut_torn_tail: as :func:`scan_journal`.
    """

    def __init__(self, data_dir: str | os.PathLike[str], after_lsn: int = 0, *, cut_torn_tail: bool = True) -> None:
        self.data_dir = data_dir
        self.after_lsn = after_lsn
        self.cut_torn_tail = cut_torn_tail
        #: the :class:`ScanResult`, once :meth:`iter_payloads` ran to its end
        self.result: ScanResult | None = None
        self._started = False

    def batches(self) -> Iterator[list[bytes]]:
        """The payloads in LSN order, in lists of up to :data:`STREAM_BATCH`. Once only.

        Raises: JournalCorruptError (after the last batch before the damage), OSError,
        RuntimeError when iterated a second time."""
        if self._started:
            raise RuntimeError("a JournalStream is read once")
        self._started = True
        a = yield from _analyse_gen(self.data_dir, self.after_lsn, True)
        self.result = _scan_result(self.data_dir, a, self.after_lsn, self.cut_torn_tail)

    def iter_payloads(self) -> Iterator[bytes]:
        """The payloads one by one (:meth:`batches` flattened, at C speed). Once only;
        raises as :meth:`batches`."""
        return chain.from_iterable(self.batches())


def read_journal(data_dir: str | os.PathLike[str], after_lsn: int = 0) -> Iterator[tuple[int, bytes]]:
    """Yield ``(lsn, payload)`` for records with LSN > ``after_lsn`` in order.

    Read-only: validates like :func:`scan_journal` but never truncates (a torn tail just
    ends the iteration), so it is safe on a journal another process appends to.

    Raises: JournalCorruptError, OSError (before the first record is yielded).
    """
    return scan_journal(data_dir, after_lsn, cut_torn_tail=False).iter_records()


def _truncate_file(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def snapshot_lsn_of(data_dir: str | os.PathLike[str]) -> int:
    """LSN stored in ``<data_dir>/snapshot`` (0 without a snapshot). Opens the LMDB
    environment briefly: do not call it in a process that holds a SnapshotStore of the
    same data dir.

    Raises: SnapshotCorruptError (the store cannot be read), OSError."""
    if not (Path(data_dir) / "snapshot").exists():
        return 0
    from .snapshot import open_store

    store = open_store(data_dir)
    try:
        return store.load_lsn()
    finally:
        store.close()


def verify_journal(data_dir: str | os.PathLike[str], *, snapshot_lsn: int | None = None) -> ScanResult:
    """Read-only check of a stopped server's journal against its snapshot (for
    ``rallypoint repair``/status tools): like :func:`scan_journal` with
    ``after_lsn`` = the snapshot LSN (read from the data dir when None) and
    ``cut_torn_tail=False``. A torn tail is reported in ``torn_tail``, not cut.

    Raises: JournalCorruptError, SnapshotCorruptError, OSError.
    """
    if snapshot_lsn is None:
        snapshot_lsn = snapshot_lsn_of(data_dir)
    return scan_journal(data_dir, snapshot_lsn, cut_torn_tail=False)


# --------------------------------------------------------------------------- repair
# (in repair.py; re-exported here for the callers that import it from the journal)


def plan_repair(data_dir: str | os.PathLike[str], *, snapshot_lsn: int | None = None) -> "RepairPlan":
    """See :func:`rallypoint.persistence.repair.plan_repair`."""
    from .repair import plan_repair as _plan

    return _plan(data_dir, snapshot_lsn=snapshot_lsn)


def repair(data_dir: str | os.PathLike[str], *, snapshot_lsn: int | None = None, lock: bool = True) -> "RepairReport":
    """See :func:`rallypoint.persistence.repair.repair`."""
    from .repair import repair as _repair

    return _repair(data_dir, snapshot_lsn=snapshot_lsn, lock=lock)


def __getattr__(name: str):  # RepairPlan / RepairReport live in repair.py
    if name in ("RepairPlan", "RepairReport"):
        import importlib

        return getattr(importlib.import_module(".repair", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
