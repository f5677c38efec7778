"""Segmented, CRC-framed write-ahead journal with group commit.

On-disk layout
==============
``<data_dir>/journal/<first LSN, 20 digits>.wal`` -- e.g. ``00000000000000000001.wal``.
A segment holds consecutive records; the next segment's name is the LSN following the
last record of the previous one. A segment is rolled (a new file started) before a record
would take it past ``segment_bytes`` (a single larger record gets a segment of its own).

Each record is framed as (all integers little-endian)::

    u32 length      payload length in bytes
    u32 crc         CRC-32 of the 8 LSN bytes followed by the payload
    u64 lsn         log sequence number; 1, 2, 3, ... strictly consecutive
    payload         ``length`` bytes, opaque to this module

The checksum is the IEEE CRC-32 from :func:`zlib.crc32` (no CRC32C package is a
dependency; zlib's is implemented in C and fast). It covers the LSN and the payload; a
damaged length field is caught because the CRC is then computed over the wrong range.

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
A dedicated flusher thread (started by :meth:`Journal.run`) takes *everything* appended
so far, writes it with one ``write()`` per segment and one ``fdatasync``; records appended
meanwhile go out with the next one. On this class of VM a thread hop through
``trio.to_thread.run_sync`` costs ~170 us while a dedicated thread fed under a lock costs
~85 us per round trip, and keeps writing back to back under load without returning to
the event loop, hence the dedicated thread. The event loop is never blocked by I/O.
"""

from __future__ import annotations

import heapq
import logging
import os
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from zlib import crc32

import trio

from .errors import (
    JournalClosedError,
    JournalCorruptError,
    JournalWriteError,
)

__all__ = [
    "Journal",
    "JournalCorruptError",
    "JournalWriteError",
    "JournalClosedError",
    "JournalStatistics",
    "ScanResult",
    "SegmentInfo",
    "TornTail",
    "RepairReport",
    "read_journal",
    "scan_journal",
    "repair",
    "verify_journal",
    "snapshot_lsn_of",
    "segment_name",
    "list_segments",
    "HEADER_SIZE",
    "MAX_PAYLOAD",
    "MODES",
]

log = logging.getLogger("rallypoint.persistence")

_HDR = struct.Struct("<IIQ")
_Q = struct.Struct("<Q")
_II = struct.Struct("<II")
HEADER_SIZE = _HDR.size  # 16 bytes
MAX_PAYLOAD = 256 << 20  # 256 MiB; a larger length field is treated as damage
MODES = ("fsync", "interval", "memory")
_SEG_RE = re.compile(r"^(\d{20})\.wal$")


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _frame(lsn: int, payload: bytes) -> bytes:
    """Framed bytes of one record (used by tests and tools; ``append`` inlines this)."""
    lb = _Q.pack(lsn)
    return _II.pack(len(payload), crc32(payload, crc32(lb))) + lb + bytes(payload)


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
        from bisect import bisect_left

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

    ``buffered_bytes`` are appended but not yet handed to the flusher thread;
    ``waiters`` counts distinct LSNs being waited for (not tasks).
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


class Journal:
    """Append-only write-ahead log (see the module docstring for format and modes).

    Use::

        journal = Journal(data_dir, mode="fsync", next_lsn=recovered.next_lsn)
        async with trio.open_nursery() as n:
            await n.start(journal.run)          # the group-commit flusher
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
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"journal mode must be one of {MODES}, not {mode!r}")
        if next_lsn < 1:
            raise ValueError(f"next_lsn must be >= 1, not {next_lsn}")
        if interval_ms <= 0:
            raise ValueError(f"interval_ms must be > 0, not {interval_ms}")
        if segment_bytes < 4096:
            raise ValueError(f"segment_bytes must be >= 4096, not {segment_bytes}")
        if mode != "memory" and data_dir is None:
            raise ValueError(f"mode {mode!r} needs a data_dir")
        self.mode = mode
        self.data_dir = None if data_dir is None else Path(data_dir)
        self.interval_s = interval_ms / 1000.0
        self.segment_bytes = int(segment_bytes)
        self._memory = mode == "memory"
        self._fsync_each = mode == "fsync"

        self._next_lsn = next_lsn
        self._opened_next = next_lsn
        self._durable_lsn = next_lsn - 1
        self._synced_lsn = next_lsn - 1
        # Buffer shared with the flusher thread, guarded by _cv's lock.
        self._cv = threading.Condition(threading.Lock())
        self._buf = bytearray()
        self._buf_seg: int | None = None  # first LSN of a new segment this chunk starts
        self._chunks: list[tuple[int | None, bytearray]] = []  # completed chunks (rolls)
        self._buf_upto = next_lsn - 1  # last LSN included in _buf/_chunks
        self._seg_bytes = 0  # bytes assigned to the active segment (written + buffered)
        self._thread_idle = False
        self._stop = False
        self._force_sync = False
        # Waiters: heap of LSNs plus one Event per LSN.
        self._waiter_heap: list[int] = []
        self._waiters: dict[int, trio.Event] = {}
        self._sync_waiters: list[tuple[int, trio.Event]] = []
        self._error: JournalWriteError | None = None
        self._closed = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._thread_done: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        # Counters (written by the flusher thread, read anywhere).
        self._n_bytes = 0
        self._n_writes = 0
        self._n_fsyncs = 0
        #: fdatasync latency (s) and records per fdatasync (group-commit size)
        self.fsync_seconds = Histogram(FSYNC_BOUNDS)
        self.commit_records = Histogram(BATCH_BOUNDS)
        self._segment_firsts: list[int] = []
        self._fd: int | None = None
        self._jdir: Path | None = None
        if not self._memory:
            self._open_active_segment(next_lsn)

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
    ) -> "Journal":
        """Open a journal for appending (sync; does file I/O).

        If ``next_lsn`` is None it is determined here by :func:`scan_journal` with
        ``after_lsn=snapshot_lsn`` (which cuts a torn tail). Pass ``next_lsn`` from
        ``recover()`` when recovery already ran. In ``memory`` mode ``data_dir`` is
        ignored and ``next_lsn`` defaults to ``snapshot_lsn + 1``.

        Raises: JournalCorruptError, ValueError, OSError (see :class:`Journal`).
        """
        if mode == "memory":
            return cls(None, mode=mode, next_lsn=next_lsn or snapshot_lsn + 1,
                       interval_ms=interval_ms, segment_bytes=segment_bytes)
        if next_lsn is None:
            next_lsn = scan_journal(data_dir, after_lsn=snapshot_lsn).next_lsn  # type: ignore[arg-type]
        return cls(data_dir, mode=mode, next_lsn=next_lsn, interval_ms=interval_ms,
                   segment_bytes=segment_bytes)

    def _open_active_segment(self, next_lsn: int) -> None:
        assert self.data_dir is not None
        jdir = self.data_dir / "journal"
        jdir.mkdir(parents=True, exist_ok=True)
        self._jdir = jdir
        segs = list_segments(self.data_dir)
        if segs:
            first, path = segs[-1]
            size = path.stat().st_size
            if size == 0 and first != next_lsn:
                path.unlink()  # an empty leftover carries nothing
                segs.pop()
            elif first >= next_lsn and size > 0:
                raise ValueError(
                    f"journal segment {path} starts at LSN {first} and holds records, but "
                    f"next_lsn is {next_lsn}: run recovery (scan_journal) first"
                )
        self._segment_firsts = [f for f, _ in segs if f != next_lsn]
        path = jdir / segment_name(next_lsn)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
        if path.exists():
            self._fd = os.open(path, flags)
        else:
            self._fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            _fsync_dir(jdir)
        self._segment_firsts.append(next_lsn)
        self._seg_bytes = 0

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

    # ----------------------------------------------------------------- append

    def append(self, payload: bytes | bytearray | memoryview) -> int:
        """Frame ``payload`` and buffer it; return its LSN. Synchronous, never blocks on
        I/O (it takes a lock shared with the flusher thread for a few hundred ns).

        The record is *not* durable yet: await :meth:`wait_durable` with the returned
        LSN before telling anyone about it.

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
        head = _II.pack(n, crc32(payload, crc32(lb)))
        reclen = n + HEADER_SIZE
        with self._cv:
            if self._seg_bytes + reclen > self.segment_bytes and self._seg_bytes:
                self._roll(lsn)
            self._seg_bytes += reclen
            buf = self._buf
            buf += head
            buf += lb
            buf += payload
            self._buf_upto = lsn
            self._next_lsn = lsn + 1
            if self._thread_idle:
                self._thread_idle = False
                self._cv.notify()
        return lsn

    def _roll(self, first_lsn: int) -> None:
        # Called with the lock held: close the current chunk, start a new segment.
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
        that matters). In memory mode returns at once.

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
        with self._cv:
            self._force_sync = True
            if self._thread_idle:
                self._thread_idle = False
                self._cv.notify()
        await ev.wait()
        if self._synced_lsn >= lsn:
            return
        if self._error is not None:
            self._raise_failed()
        raise JournalClosedError(f"journal stopped; LSN {lsn} is not synced")

    # --- callbacks run on the event loop (via TrioToken.run_sync_soon)

    def _on_progress(self, durable: int, synced: int) -> None:
        if durable > self._durable_lsn:
            self._durable_lsn = durable
        if synced > self._synced_lsn:
            self._synced_lsn = synced
        heap = self._waiter_heap
        waiters = self._waiters
        while heap and heap[0] <= durable:
            waiters.pop(heapq.heappop(heap)).set()
        if self._sync_waiters:
            keep = []
            for lsn, ev in self._sync_waiters:
                if lsn <= self._synced_lsn:
                    ev.set()
                else:
                    keep.append((lsn, ev))
            self._sync_waiters = keep

    def _wake_all(self) -> None:
        for ev in self._waiters.values():
            ev.set()
        self._waiters.clear()
        self._waiter_heap.clear()
        for _, ev in self._sync_waiters:
            ev.set()
        self._sync_waiters.clear()

    def _on_error(self, exc: BaseException) -> None:
        if self._error is None:
            err = JournalWriteError(
                f"journal write/fsync failed ({type(exc).__name__}: {exc}); the journal "
                f"is stopped and acknowledges nothing more (fail-stop). Durable LSN "
                f"{self._durable_lsn}. Check the disk, then restart: recovery keeps what "
                f"reached the disk."
            )
            err.__cause__ = exc
            self._error = err
            log.error("%s", err)
        self._wake_all()

    def _on_thread_exit(self) -> None:
        self._running = False
        if self._thread_done is not None:
            self._thread_done.set()
        self._wake_all()

    # ----------------------------------------------------------------- flusher

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The group-commit flusher. Start it once with ``await nursery.start(journal.run)``.

        Starts the flusher thread and returns when the journal is closed
        (:meth:`aclose`). If cancelled, it first lets the thread write and fsync what is
        buffered (shielded; bounded by one fsync), then the journal counts as closed.

        Raises:
            JournalWriteError: a write or fsync failed. Treat it as fatal (fail-stop):
                every pending waiter has already been woken with the same error.
            RuntimeError: run() was already started.
        """
        if self._running or self._thread is not None:
            raise RuntimeError("Journal.run() was already started")
        if self._closed:
            raise JournalClosedError("journal is closed")
        self._running = True
        if self._memory:
            self._thread_done = trio.Event()
            task_status.started()
            try:
                await self._thread_done.wait()  # set by aclose()
            finally:
                self._running = False
                self._closed = True
            return
        self._token = trio.lowlevel.current_trio_token()
        self._thread_done = trio.Event()
        self._thread = threading.Thread(
            target=self._thread_main, name=f"rallypoint-journal-{self.data_dir}", daemon=True
        )
        self._thread.start()
        task_status.started()
        try:
            await self._thread_done.wait()
        finally:
            if not self._thread_done.is_set():
                # Cancelled: let the thread flush what is buffered, then stop.
                self._closed = True
                self._request_stop()
                with trio.CancelScope(shield=True):
                    await self._thread_done.wait()
            self._closed = True
        if self._error is not None:
            self._raise_failed()

    def _request_stop(self) -> None:
        with self._cv:
            self._stop = True
            self._thread_idle = False
            self._cv.notify()

    def _take(self) -> tuple[list[tuple[int | None, bytearray]], int]:
        # Lock held.
        chunks = self._chunks
        if self._buf or self._buf_seg is not None:
            chunks.append((self._buf_seg, self._buf))
            self._buf = bytearray()
            self._buf_seg = None
        self._chunks = []
        return chunks, self._buf_upto

    def _thread_main(self) -> None:
        token = self._token
        assert token is not None
        interval = self.interval_s
        fsync_each = self._fsync_each
        written = synced = self._synced_lsn
        next_sync_at = None  # monotonic deadline for the pending interval fsync
        try:
            while True:
                with self._cv:
                    while True:
                        has_data = bool(self._chunks) or bool(self._buf) or self._buf_seg is not None
                        if has_data or self._stop or self._force_sync:
                            break
                        if next_sync_at is not None:
                            remaining = next_sync_at - time.monotonic()
                            if remaining <= 0:
                                break
                            self._thread_idle = True
                            self._cv.wait(remaining)
                        else:
                            self._thread_idle = True
                            self._cv.wait()
                        self._thread_idle = False
                    chunks, upto = self._take()
                    stop = self._stop
                    force = self._force_sync
                    self._force_sync = False
                if chunks:
                    self._write_chunks(chunks)
                    written = upto
                now = time.monotonic()
                if written > synced:
                    if fsync_each or stop or force:
                        do_sync = True
                    else:
                        if next_sync_at is None:
                            next_sync_at = now + interval
                        do_sync = now >= next_sync_at
                    if do_sync:
                        t_sync = time.perf_counter()
                        os.fdatasync(self._fd)  # type: ignore[arg-type]
                        self.fsync_seconds.observe(time.perf_counter() - t_sync)
                        self.commit_records.observe(written - synced)
                        self._n_fsyncs += 1
                        synced = written
                        next_sync_at = None
                if chunks or force or synced == written:
                    try:
                        token.run_sync_soon(self._on_progress, written, synced)
                    except trio.RunFinishedError:
                        return
                if stop:
                    break
        except BaseException as exc:  # noqa: BLE001 - reported to the loop, fail-stop
            try:
                token.run_sync_soon(self._on_error, exc)
            except trio.RunFinishedError:
                pass
        finally:
            try:
                token.run_sync_soon(self._on_thread_exit)
            except trio.RunFinishedError:
                pass

    def _write_chunks(self, chunks: list[tuple[int | None, bytearray]]) -> None:
        """Flusher thread: write chunks, rolling segments as marked."""
        for seg_first, data in chunks:
            if seg_first is not None:
                self._roll_file(seg_first)
            if data:
                self._write_all(data)
                self._n_writes += 1
                self._n_bytes += len(data)

    def _roll_file(self, first_lsn: int) -> None:
        assert self._jdir is not None and self._fd is not None
        os.fdatasync(self._fd)  # the old segment must be complete before a newer exists
        self._n_fsyncs += 1
        os.close(self._fd)
        self._fd = None
        self._fd = os.open(
            self._jdir / segment_name(first_lsn),
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
            0o644,
        )
        _fsync_dir(self._jdir)

    def _write_all(self, data: bytearray) -> None:
        fd = self._fd
        assert fd is not None
        n = os.write(fd, data)
        if n != len(data):
            mv = memoryview(data)
            while n < len(data):
                n += os.write(fd, mv[n:])

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

    async def aclose(self) -> None:
        """Write and fdatasync everything buffered (in every disk mode), stop the
        flusher and close the segment file. Idempotent. Shielded from cancellation
        (bounded by one write + fsync). After it, ``append`` raises JournalClosedError
        and ``run`` returns.

        Raises:
            JournalWriteError: the final write/fsync failed (or the journal had failed).
        """
        if self._memory:
            self._closed = True
            if self._thread_done is not None:
                self._thread_done.set()
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True):
            self._closed = True
            if self._thread is not None and self._thread_done is not None:
                self._request_stop()
                await self._thread_done.wait()
            elif self._fd is not None and self._error is None:
                # run() never started: flush here.
                with self._cv:
                    chunks, upto = self._take()
                try:
                    await trio.to_thread.run_sync(self._flush_sync, chunks)
                except OSError as exc:
                    self._on_error(exc)
                else:
                    self._on_progress(upto, upto)
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._wake_all()
        if self._error is not None:
            self._raise_failed()

    def _flush_sync(self, chunks: list[tuple[int | None, bytearray]]) -> None:
        if chunks:
            self._write_chunks(chunks)
        os.fdatasync(self._fd)  # type: ignore[arg-type]
        self._n_fsyncs += 1

    # ----------------------------------------------------------------- stats

    def stats(self) -> dict[str, int]:
        """``{"fsyncs", "records", "bytes", "writes"}`` since this object was created:
        fdatasync calls, records appended, framed bytes written (appended, in memory
        mode), write() calls."""
        return {"fsyncs": self._n_fsyncs, "records": self._next_lsn - self._opened_next,
                "bytes": self._n_bytes, "writes": self._n_writes}

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
        )

    def __repr__(self) -> str:
        return (f"<Journal {self.mode} {self.data_dir} last={self.last_lsn} "
                f"durable={self._durable_lsn}>")


# --------------------------------------------------------------------------- reading


@dataclass
class SegmentInfo:
    """One validated segment: records ``first_lsn .. last_lsn`` live in bytes
    ``[0, end_offset)``; the first record with LSN > after_lsn starts at
    ``start_offset`` (== end_offset when none)."""

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
    """

    after_lsn: int
    segments: list[SegmentInfo]
    last_lsn: int
    next_lsn: int
    record_count: int
    torn_tail: TornTail | None = None
    skipped_segments: list[Path] = field(default_factory=list)

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

    def __len__(self) -> int:
        return self.record_count


@dataclass
class _Problem:
    kind: str  # "torn" | "corrupt" | "gap" | "start_gap" | "ahead"
    seg_index: int  # index into the segment list (relevant part), -1 for dir-level
    path: Path
    offset: int
    reason: str


def _validate(data: bytes, lsn: int, after_lsn: int) -> tuple[int, int, int, str | None, bool]:
    """Walk records from offset 0 expecting ``lsn`` first.

    Returns ``(good_end, next_lsn, start_offset, problem, definite)``: problem is None
    when the whole buffer is good; ``definite`` is True when the problem cannot be a
    torn write (a record with a valid CRC but the wrong LSN).
    """
    size = len(data)
    mv = memoryview(data)
    unpack = _HDR.unpack_from
    off = 0
    start = -1
    limit = size - HEADER_SIZE
    while off <= limit:
        n, crc, rlsn = unpack(data, off)
        end = off + HEADER_SIZE + n
        if end > size or n > MAX_PAYLOAD:
            return off, lsn, (off if start < 0 else start), (
                f"record header at LSN {lsn} claims {n} payload bytes past the end of the file"), False
        if crc32(mv[off + 8:end]) != crc:
            return off, lsn, (off if start < 0 else start), f"bad CRC in the record expected to be LSN {lsn}", False
        if rlsn != lsn:
            return off, lsn, (off if start < 0 else start), f"LSN gap: expected LSN {lsn}, found {rlsn}", True
        if start < 0 and rlsn > after_lsn:
            start = off
        lsn += 1
        off = end
    if start < 0:
        start = off
    if off != size:
        return off, lsn, start, f"{size - off} trailing bytes: a truncated record header", False
    return off, lsn, start, None, False


def _good_record_follows(data: bytes, bad_off: int, lsn: int) -> bool:
    """Is there a valid record (CRC ok, LSN lsn..lsn+2) starting after ``bad_off``?"""
    size = len(data)
    mv = memoryview(data)
    for target in (lsn, lsn + 1, lsn + 2):
        pat = _Q.pack(target)
        pos = bad_off + 9
        tries = 0
        while tries < 10000:
            p = data.find(pat, pos)
            if p < 0:
                break
            tries += 1
            h = p - 8
            pos = p + 1
            if h <= bad_off or h + HEADER_SIZE > size:
                continue
            n, crc, _ = _HDR.unpack_from(data, h)
            end = h + HEADER_SIZE + n
            if end <= size and crc32(mv[h + 8:end]) == crc:
                return True
    return False


def _analyse(data_dir: str | os.PathLike[str], after_lsn: int):
    """Validate without modifying anything.

    Returns ``(segments, skipped, problem, expected, records_present, record_count)``
    where ``segments`` are the SegmentInfo of the relevant segments up to (and
    including) the one with the problem, ``expected`` the LSN after the last good record.
    """
    segs = list_segments(data_dir)
    jdir = Path(data_dir) / "journal"
    start = 0
    for i, (first, _) in enumerate(segs):
        if first <= after_lsn + 1:
            start = i
    skipped = [p for _, p in segs[:start]]
    records_present = False
    for p in skipped:
        try:
            if p.stat().st_size > 0:
                records_present = True
                break
        except FileNotFoundError:
            pass
    infos: list[SegmentInfo] = []
    expected: int | None = None
    count = 0
    relevant = segs[start:]
    for idx, (first, path) in enumerate(relevant):
        with open(path, "rb") as f:
            data = f.read()
        if expected is not None and first != expected:
            prev = infos[-1].path if infos else path
            return infos, skipped, _Problem(
                "gap", idx, path, 0,
                f"missing segment: {prev.name} ends before LSN {expected} but the next "
                f"segment starts at LSN {first}"), expected, records_present or bool(data), count
        if expected is None and first > after_lsn + 1 and data:
            return infos, skipped, _Problem(
                "start_gap", idx, path, 0,
                f"the journal starts at LSN {first} but the snapshot is at LSN "
                f"{after_lsn}: records {after_lsn + 1}..{first - 1} are missing"), first, True, count
        if data:
            records_present = True
        good_end, nxt, start_off, problem, definite = _validate(data, first, after_lsn)
        info = SegmentInfo(path, first, nxt - 1, good_end, start_off)
        infos.append(info)
        count += max(0, nxt - max(first, after_lsn + 1))
        expected = nxt
        if problem is not None:
            is_last = idx == len(relevant) - 1
            if not definite and is_last and not _good_record_follows(data, good_end, nxt):
                return infos, skipped, _Problem("torn", idx, path, good_end, problem), nxt, records_present, count
            return infos, skipped, _Problem("corrupt", idx, path, good_end, problem), nxt, records_present, count
    if expected is None:
        expected = after_lsn + 1
    if records_present and expected - 1 < after_lsn:
        last = infos[-1].path if infos else jdir
        return infos, skipped, _Problem(
            "ahead", len(infos) - 1, last, infos[-1].end_offset if infos else 0,
            f"snapshot LSN {after_lsn} is ahead of the journal end {expected - 1}"), expected, True, count
    return infos, skipped, None, expected, records_present, count


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
    ``rallypoint.persistence``; without it, reading just stops there (read-only).

    When the journal holds no records (or none past its start) the next LSN is
    ``after_lsn + 1``.

    Raises:
        JournalCorruptError: damage before the tail: a bad record followed by good ones,
            a missing segment, an LSN gap, records missing between ``after_lsn`` and
            the first segment, or ``after_lsn`` (the snapshot) ahead of the journal's
            last record while records are present. Nothing is modified.
        OSError: reading/truncating failed.
    """
    infos, skipped, problem, expected, _present, count = _analyse(data_dir, after_lsn)
    torn = None
    if problem is not None:
        if problem.kind != "torn":
            raise JournalCorruptError(str(problem.path), problem.offset, problem.reason,
                                      data_dir=str(data_dir))
        size = problem.path.stat().st_size
        torn = TornTail(problem.path, problem.offset, size - problem.offset, problem.reason)
        if cut_torn_tail:
            _truncate_file(problem.path, problem.offset)
            log.warning(
                "journal: cut a torn tail of %s at byte offset %d (%d bytes dropped: %s); "
                "the last good record is LSN %d. This is normal after a crash.",
                problem.path, problem.offset, torn.bytes_dropped, problem.reason, expected - 1)
    last = expected - 1
    next_lsn = expected if expected - 1 >= after_lsn else after_lsn + 1
    infos = [s for s in infos if s.start_offset < s.end_offset]
    return ScanResult(after_lsn=after_lsn, segments=infos, last_lsn=max(last, after_lsn),
                      next_lsn=next_lsn, record_count=count, torn_tail=torn,
                      skipped_segments=skipped)


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


# --------------------------------------------------------------------------- repair


@dataclass
class RepairReport:
    """What :func:`repair` cut.

    Attributes:
        file: the segment truncated (None when nothing was cut or only whole segments
            were deleted).
        offset: byte offset it was truncated at.
        bytes_dropped: total bytes removed (truncated tail + deleted segments).
        records_dropped_estimate: rough number of records lost (bytes / mean record size).
        deleted_segments: whole segment files deleted.
        reason: the damage found, or None when the journal was fine.
        last_lsn: last LSN kept.
    """

    file: Path | None
    offset: int
    bytes_dropped: int
    records_dropped_estimate: int
    deleted_segments: list[Path]
    reason: str | None
    last_lsn: int

    @property
    def changed(self) -> bool:
        """True when anything was cut."""
        return self.bytes_dropped > 0 or bool(self.deleted_segments)


def repair(
    data_dir: str | os.PathLike[str], *, snapshot_lsn: int | None = None, lock: bool = True
) -> RepairReport:
    """Truncate the journal at the last good record, deleting later segments.

    Loses every record after the first damage: use only after
    :class:`JournalCorruptError`, with the server stopped. ``snapshot_lsn`` defaults to
    the LSN stored in ``<data_dir>/snapshot`` (0 without a snapshot); when the snapshot
    is ahead of the journal end every segment is deleted (all their records are in the
    snapshot). With ``lock`` the data-dir lock is taken for the duration.

    Raises: DataDirLocked (server running), OSError.
    """
    from .lock import DataDirLock

    dlock = DataDirLock(data_dir) if lock else None
    if dlock is not None:
        dlock.acquire()
    try:
        if snapshot_lsn is None:
            snapshot_lsn = snapshot_lsn_of(data_dir)
        return _repair(Path(data_dir), snapshot_lsn)
    finally:
        if dlock is not None:
            dlock.release()


def snapshot_lsn_of(data_dir: str | os.PathLike[str]) -> int:
    """LSN stored in ``<data_dir>/snapshot`` (0 without a snapshot). Opens the LMDB
    environment briefly: do not call it in a process that holds a SnapshotStore of the
    same data dir. Raises lmdb.Error."""
    if not (Path(data_dir) / "snapshot").exists():
        return 0
    from .snapshot import SnapshotStore

    store = SnapshotStore(data_dir)
    try:
        return store.load_lsn()
    finally:
        store.close()


def verify_journal(data_dir: str | os.PathLike[str], *, snapshot_lsn: int | None = None) -> ScanResult:
    """Read-only check of a stopped server's journal against its snapshot (for
    ``rallypoint repair``/status tools): like :func:`scan_journal` with
    ``after_lsn`` = the snapshot LSN (read from the data dir when None) and
    ``cut_torn_tail=False``. A torn tail is reported in ``torn_tail``, not cut.

    Raises: JournalCorruptError, OSError, lmdb.Error.
    """
    if snapshot_lsn is None:
        snapshot_lsn = snapshot_lsn_of(data_dir)
    return scan_journal(data_dir, snapshot_lsn, cut_torn_tail=False)


def _repair(data_dir: Path, after_lsn: int) -> RepairReport:
    infos, _skipped, problem, expected, _present, _count = _analyse(data_dir, after_lsn)
    if problem is None:
        return RepairReport(None, 0, 0, 0, [], None, expected - 1)
    segs = list_segments(data_dir)
    good_bytes = sum(s.end_offset for s in infos)
    good_recs = sum(max(0, s.last_lsn - s.first_lsn + 1) for s in infos)
    mean = good_bytes / good_recs if good_recs else 64.0
    deleted: list[Path] = []
    dropped = 0
    cut_file: Path | None = None
    cut_off = 0
    if problem.kind == "ahead" or problem.kind == "start_gap":
        # Nothing in the journal can be replayed on top of the snapshot: drop it all
        # (records <= snapshot are in the snapshot anyway).
        doomed = [p for _, p in segs]
        last = after_lsn
    else:
        if problem.kind in ("torn", "corrupt"):
            cut_file, cut_off = problem.path, problem.offset
            size = cut_file.stat().st_size
            dropped += size - cut_off
            _truncate_file(cut_file, cut_off)
            later = False
        else:  # gap: keep up to the previous segment's end
            later = True
        doomed = []
        for _, p in segs:
            if later:
                doomed.append(p)
            elif p == problem.path:
                later = True
        last = expected - 1
    for p in doomed:
        try:
            dropped += p.stat().st_size
            p.unlink()
            deleted.append(p)
        except FileNotFoundError:
            pass
    jdir = data_dir / "journal"
    if jdir.exists():
        _fsync_dir(jdir)
    est = int(round(dropped / mean)) if dropped else 0
    log.warning("journal repair: %s; cut %s at %d, deleted %d segment(s), %d bytes dropped "
                "(~%d records); journal now ends at LSN %d", problem.reason, cut_file, cut_off,
                len(deleted), dropped, est, last)
    return RepairReport(cut_file, cut_off, dropped, est, deleted, problem.reason, last)
