"""LMDB store of entity state at an LSN, and the data-dir format version.

Layout: ``<data_dir>/snapshot/`` is an LMDB environment with three named databases:

* ``entities``: key bytes -> value bytes (opaque here; the coordinator encodes them);
* ``events``: key bytes -> value bytes: the events kept at the snapshot's LSN (derived
  data: a cache of what the journal said, so that a restart still has the events whose
  records are no longer in the journal); keys sort by (space, seq);
* ``meta``: ``b"lsn"`` -> 8-byte big-endian LSN the entities are valid at,
  ``b"format_version"`` -> ASCII integer, ``b"evseq:" + space`` -> 8-byte big-endian
  next event sequence number of that space.

Durability: each :meth:`SnapshotStore.write` is one LMDB write transaction committed
with LMDB's own sync (data pages fdatasync-ed, then the meta page), so a machine crash
leaves either the previous snapshot or the new one, never a mix. (``sync=False`` plus a
later ``env.sync()`` would be one fsync cheaper but lets a crash *during* the commit
tear the environment; one snapshot every few seconds can afford the second fsync.)
``writemap`` is off for the same reason.

A failed write (a full disk: LMDB reports ENOSPC, or EIO for a short write) aborts the
transaction and leaves the previous snapshot intact; the environment is reopened before
the next write. :func:`open_store` checks the data file before LMDB maps it (a truncated
file would otherwise be a SIGBUS) and turns LMDB's errors into
:class:`~rallypoint.persistence.errors.SnapshotCorruptError`. (LMDB trusts its page
pointers: some damage inside the file can still crash the process when read; restore
from a backup then.)
"""

from __future__ import annotations

import os
import queue
import struct
from array import array
from pathlib import Path
from contextlib import asynccontextmanager
from typing import AsyncIterator, Iterator

import lmdb
import trio

from .errors import FormatVersionError, SnapshotCorruptError

__all__ = ["SnapshotStore", "SnapshotWriter", "PutBatch", "packed_items", "EventWrite", "FORMAT_VERSION", "check_format",
           "FormatVersionError", "open_store", "check_data_file"]

FORMAT_VERSION = 1
_LSN = struct.Struct(">Q")
_MDB_MAGIC = 0xBEEFC0DE


def check_data_file(path: str | os.PathLike[str]) -> None:
    """Check an LMDB ``data.mdb`` before it is mapped: both meta pages valid, and the
    file long enough for the newest transaction's pages (a truncated file would make
    LMDB read past its end: SIGBUS). A missing or empty file passes (a new store).

    Raises:
        ValueError: the file is damaged; the message says how.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(p, "rb") as f:
        head = f.read(4096 * 2)
    if len(head) < 160:
        raise ValueError(f"{p.name} is {size} bytes, too short for an LMDB file")
    psize = struct.unpack_from("<I", head, 40)[0]
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        raise ValueError(f"{p.name} is not an LMDB file (page size field {psize})")
    with open(p, "rb") as f:
        f.seek(psize)
        meta1 = f.read(160)
    best = None
    for i, page in enumerate((head[:160], meta1)):
        if len(page) < 160:
            raise ValueError(f"{p.name} is truncated inside its meta pages ({size} bytes)")
        magic, version = struct.unpack_from("<II", page, 16)
        if magic != _MDB_MAGIC or version != 1:
            raise ValueError(f"{p.name} is not an LMDB file (meta page {i} damaged)")
        last_pg, txnid = struct.unpack_from("<QQ", page, 136)
        if best is None or txnid > best[1]:
            best = (last_pg, txnid)
    assert best is not None
    need = (best[0] + 1) * psize
    if size < need:
        raise ValueError(f"{p.name} is truncated: {size} bytes, but its last transaction uses {need}")


def open_store(data_dir: str | os.PathLike[str], **kwargs) -> "SnapshotStore":
    """Open ``<data_dir>/snapshot`` after :func:`check_data_file`, reading its LSN once.

    Raises:
        SnapshotCorruptError: the store cannot be opened or read (one line: what is
            wrong and what to do).
    """
    path = Path(data_dir) / "snapshot"
    try:
        check_data_file(path / "data.mdb")
        store = SnapshotStore(data_dir, **kwargs)
    except (ValueError, lmdb.Error) as exc:
        raise SnapshotCorruptError(str(path), str(exc), data_dir=str(data_dir)) from None
    try:
        store.load_lsn()
    except (lmdb.Error, struct.error) as exc:
        store.close()
        raise SnapshotCorruptError(str(path), str(exc), data_dir=str(data_dir)) from None
    return store


def check_format(data_dir: str | os.PathLike[str]) -> int:
    """Check (or stamp) the on-disk format of ``data_dir``; returns the version found.

    Creates ``data_dir`` and ``<data_dir>/FORMAT`` (containing ``FORMAT_VERSION``,
    written atomically) when absent.

    Raises:
        FormatVersionError: the file names a newer version than this build understands,
            or is unreadable; the message names both versions.
    """
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "FORMAT"
    try:
        text = path.read_text("ascii").strip()
    except FileNotFoundError:
        tmp = d / "FORMAT.tmp"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(f"{FORMAT_VERSION}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return FORMAT_VERSION
    except UnicodeDecodeError:
        text = "?"
    try:
        version = int(text)
    except ValueError:
        raise FormatVersionError(
            f"{path} does not hold a format version (found {text[:40]!r}); this rallypoint "
            f"writes format version {FORMAT_VERSION}. Is {d} a rallypoint data directory?"
        ) from None
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"data directory {d} has on-disk format version {version}, but this rallypoint "
            f"understands format version {FORMAT_VERSION} at most: run a newer rallypoint "
            f"(data written by a newer version is never downgraded)"
        )
    return version


class EventWrite:
    """The events part of a snapshot write: ``puts`` (an iterable of (key, value),
    consumed in the worker thread), ``delete_ranges`` ([lo, hi) key ranges, deleted
    after the puts) and ``next_seqs`` ({space: next seq})."""

    __slots__ = ("puts", "delete_ranges", "next_seqs")

    def __init__(self, puts, delete_ranges: list[tuple[bytes, bytes]], next_seqs: dict[str, int]) -> None:
        self.puts = puts
        self.delete_ranges = delete_ranges
        self.next_seqs = next_seqs


class PutBatch:
    """One slice of a streamed snapshot (:meth:`SnapshotStore.writer`): encoded entities
    packed end to end in two ``bytearray`` s with their end offsets in two ``array``
    s, plus keys to delete. None of these is a container the garbage collector walks,
    so a snapshot of any size leaves no young list of a million objects for a GC pass
    to traverse on the event loop (that was a 50-80 ms stall at 1M entities).

    Attributes:
        keys, values: the packed key and value bytes.
        key_ends, value_ends: ``array('L')`` of end offsets, one per entity.
        deletes: keys to remove, after this batch's puts.
        events: ``[(key, value)]`` event chunk puts (encoded), or None.
    """

    __slots__ = ("keys", "key_ends", "values", "value_ends", "deletes", "events")

    def __init__(self) -> None:
        self.keys = bytearray()
        self.key_ends = array("L")
        self.values = bytearray()
        self.value_ends = array("L")
        self.deletes: list[bytes] = []
        self.events: list[tuple[bytes, bytes]] | None = None

    def __len__(self) -> int:
        return len(self.key_ends)

    @property
    def nbytes(self) -> int:
        """Encoded bytes (keys and values)."""
        return len(self.keys) + len(self.values)

    def pairs(self) -> Iterator[tuple[memoryview, memoryview]]:
        """``(key, value)`` memoryviews in order (made at C speed: no bytecode runs
        per pair, so a writer thread consuming them rarely holds the GIL)."""
        return zip(packed_items(self.keys, self.key_ends), packed_items(self.values, self.value_ends))


def packed_items(buf: bytearray, ends: array) -> Iterator[memoryview]:
    """The items packed end to end in ``buf`` whose end offsets are ``ends``, as
    memoryviews (an iterator made at C speed)."""
    starts = array("L", [0])
    starts.extend(ends[:-1])
    return map(memoryview(buf).__getitem__, map(slice, starts, ends))


_ABORT = object()


class SnapshotWriter:
    """A snapshot written while it is encoded: ONE LMDB write transaction open in a
    worker thread, fed :class:`PutBatch` es through a queue (:meth:`send` never
    blocks), committed by :meth:`commit` once the cut's LSN is known. Get one from
    :meth:`SnapshotStore.writer` (an async context manager: leaving it without a
    commit aborts the transaction; the previous snapshot stands).

    Batches are applied in order (a key put twice: the later value wins; a batch's
    deletes after its puts)."""

    def __init__(self, store: "SnapshotStore") -> None:
        self._store = store
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._done = trio.Event()
        self._outcome = None
        self._ended = False  # commit or abort sent
        self.nbytes = 0  # encoded bytes sent so far

    def _start(self) -> None:
        token = trio.lowlevel.current_trio_token()

        def deliver(outcome) -> None:
            try:
                token.run_sync_soon(self._finished, outcome)
            except trio.RunFinishedError:  # pragma: no cover - the run ended first
                pass

        trio.lowlevel.start_thread_soon(lambda: self._store._stream_sync(self._q), deliver,
                                        name="rallypoint snapshot writer")

    def _finished(self, outcome) -> None:
        self._outcome = outcome
        self._done.set()

    def _check(self) -> None:
        if self._done.is_set():
            self._outcome.unwrap()  # the thread's error (e.g. lmdb.Error), if any
            raise RuntimeError("the snapshot transaction has already ended")

    def send(self, batch: PutBatch) -> None:
        """Queue a batch for the transaction (never blocks).

        Raises:
            lmdb.Error: the transaction already failed (nothing will be written)."""
        self._check()
        self.nbytes += batch.nbytes
        self._q.put(batch)

    async def commit(self, lsn: int, events: "EventWrite | None" = None) -> None:
        """Apply ``events`` (after every batch), set the LSN and commit (synced to disk);
        returns once it is. Not cancellable once sent: a cancel waits for the commit to
        finish, then Cancelled is raised.

        Raises:
            ValueError: ``lsn`` is below the stored LSN (nothing written).
            lmdb.Error: the write failed; nothing was changed and the store is
                reopened before the next write.
        """
        self._check()
        self._ended = True
        self._q.put((lsn, events))
        try:
            await self._done.wait()
        finally:
            with trio.CancelScope(shield=True):
                await self._done.wait()
        self._outcome.unwrap()

    async def _close(self) -> None:
        if not self._ended:
            self._ended = True
            self._q.put(_ABORT)
        with trio.CancelScope(shield=True):
            await self._done.wait()


class _Aborted(Exception):
    pass


class SnapshotStore:
    """The LMDB snapshot of a data directory (``<data_dir>/snapshot/``).

    Only one ``SnapshotStore`` per data dir per process (an LMDB rule); take the
    :class:`~rallypoint.persistence.lock.DataDirLock` first.

    Args:
        data_dir: the data directory (the ``snapshot`` subdirectory is created).
        map_size: maximum size of the store in bytes (virtual; the file grows as
            needed). Default 64 GiB.

    Raises:
        lmdb.Error: the environment cannot be opened.
    """

    def __init__(self, data_dir: str | os.PathLike[str], *, map_size: int = 64 << 30) -> None:
        self.path = Path(data_dir) / "snapshot"
        self.path.mkdir(parents=True, exist_ok=True)
        self._map_size = map_size
        self._lock = trio.Lock()
        self._reopen = False
        self.failed_writes = 0
        self._open_env()
        with self._env.begin(write=True) as txn:
            if txn.get(b"format_version", db=self._meta) is None:
                txn.put(b"format_version", str(FORMAT_VERSION).encode(), db=self._meta)

    def _open_env(self) -> None:
        self._env = lmdb.open(
            str(self.path), map_size=self._map_size, max_dbs=3, subdir=True,
            sync=True, metasync=True, writemap=False, readahead=False, lock=True,
        )
        self._entities = self._env.open_db(b"entities")
        self._meta = self._env.open_db(b"meta")
        self._events = self._env.open_db(b"events")

    def load_lsn(self) -> int:
        """LSN the stored entities are valid at; 0 when no snapshot was ever written."""
        with self._env.begin() as txn:
            raw = txn.get(b"lsn", db=self._meta)
        return 0 if raw is None else _LSN.unpack(raw)[0]

    def entity_count(self) -> int:
        """Number of stored entities."""
        with self._env.begin() as txn:
            return txn.stat(self._entities)["entries"]

    def iter_entities(self) -> Iterator[tuple[bytes, bytes]]:
        """Yield ``(key, value)`` of every entity in key order, from one read
        transaction (a consistent view even while a write runs)."""
        with self._env.begin(buffers=False) as txn:
            cur = txn.cursor(db=self._entities)
            yield from cur.iternext(keys=True, values=True)

    def iter_events(self) -> Iterator[tuple[bytes, bytes]]:
        """Yield ``(key, value)`` of every stored event in key order (one read txn)."""
        with self._env.begin(buffers=False) as txn:
            cur = txn.cursor(db=self._events)
            yield from cur.iternext(keys=True, values=True)

    def event_seqs(self) -> dict[str, int]:
        """``{space: next event seq}`` as of the snapshot."""
        out: dict[str, int] = {}
        with self._env.begin(buffers=False) as txn:
            cur = txn.cursor(db=self._meta)
            if cur.set_range(b"evseq:"):
                for k, v in cur.iternext(keys=True, values=True):
                    if not k.startswith(b"evseq:"):
                        break
                    out[k[6:].decode()] = _LSN.unpack(v)[0]
        return out

    def event_count(self) -> int:
        with self._env.begin() as txn:
            return txn.stat(self._events)["entries"]

    def get(self, key: bytes) -> bytes | None:
        """The stored value of one entity, or None."""
        with self._env.begin() as txn:
            return txn.get(key, db=self._entities)

    async def write(self, lsn: int, puts: list[tuple[bytes, bytes]], deletes: list[bytes],
                    events: "EventWrite | None" = None) -> None:
        """Store ``puts``, remove ``deletes`` and set the LSN, in ONE LMDB write
        transaction run in a worker thread; returns once it is synced to disk.

        Encode the values on the event loop (consistent state) and hand them in; this
        call only does I/O off the loop. Writes are serialized. Not cancellable once
        the thread started (the transaction completes; then Cancelled is raised).

        Args:
            lsn: the journal LSN the state is valid at (every record <= lsn applied).
                Must be >= the stored LSN. In ``interval`` journal mode, await
                ``journal.wait_synced(lsn)`` first; in fsync mode ``wait_durable(lsn)``.
            puts: (key, value) pairs to insert or overwrite: any iterable (e.g. a
                ``zip`` of two lists, so the pairs are made in the worker thread, not on
                the event loop); consumed once, in order, so when a key appears twice
                the later value wins.
            deletes: keys to remove (missing keys are ignored).
            events: event puts (an iterable, consumed in the worker thread), key ranges
                to delete and the next sequence number per space (:class:`EventWrite`).

        Raises:
            ValueError: ``lsn`` is below the stored LSN.
            lmdb.Error: the write failed (a full disk, map full); nothing was changed
                and the store is reopened before the next write.
        """
        async with self._lock:
            await trio.to_thread.run_sync(self._write_sync, lsn, puts, deletes, events)

    @asynccontextmanager
    async def writer(self) -> AsyncIterator[SnapshotWriter]:
        """A streamed write (:class:`SnapshotWriter`): the transaction opens now in a
        worker thread and takes batches as they are encoded; serialized with
        :meth:`write`. Leaving the block without :meth:`SnapshotWriter.commit` (an
        error, a cancel) aborts it and waits for the thread."""
        async with self._lock:
            w = SnapshotWriter(self)
            w._start()
            try:
                yield w
            finally:
                await w._close()

    async def copy_to(self, dest_dir: str | os.PathLike[str]) -> int:
        """Write a compacted copy of the store (``dest_dir/data.mdb``; the directory
        must exist and be empty) in a worker thread, and return the LSN it is valid
        at. Serialized with :meth:`write`, so no snapshot lands between reading the LSN
        and copying. (A standby too far behind starts from such a copy:
        ``rallypoint.replication``.)"""
        async with self._lock:
            lsn = self.load_lsn()
            await trio.to_thread.run_sync(lambda: self._env.copy(str(dest_dir), compact=True))
        return lsn

    def write_sync(self, lsn: int, puts: list[tuple[bytes, bytes]], deletes: list[bytes],
                   events: "EventWrite | None" = None) -> None:
        """Blocking form of :meth:`write` (for tools and tests; never on the loop)."""
        self._write_sync(lsn, puts, deletes, events)

    def _write_sync(self, lsn: int, puts: list[tuple[bytes, bytes]], deletes: list[bytes],
                    events: "EventWrite | None" = None) -> None:
        self._guarded(self._write_txn, lsn, puts, deletes, events)

    def _stream_sync(self, q: queue.SimpleQueue) -> None:
        """The writer thread of :class:`SnapshotWriter`."""
        try:
            self._guarded(self._stream_txn, q)
        except _Aborted:
            pass

    def _guarded(self, fn, *args) -> None:
        if self._reopen:  # after a failed commit (LMDB may have flagged the env as broken)
            self._env.close()
            self._open_env()
            self._reopen = False
        try:
            fn(*args)
        except lmdb.Error:
            self._reopen = True
            self.failed_writes += 1
            raise

    def _stream_txn(self, q: queue.SimpleQueue) -> None:
        with self._env.begin(write=True) as txn:  # aborted by any exception
            cur = txn.cursor(db=self._entities)
            ecur = txn.cursor(db=self._events)
            get = q.get
            while True:
                item = get()
                if type(item) is PutBatch:
                    if item.key_ends:
                        cur.putmulti(item.pairs(), dupdata=False, overwrite=True)
                    for key in item.deletes:
                        txn.delete(key, db=self._entities)
                    if item.events:
                        ecur.putmulti(item.events, dupdata=False, overwrite=True)
                    continue
                if item is _ABORT:
                    raise _Aborted
                lsn, events = item
                self._check_lsn(txn, lsn)
                if events is not None:
                    self._write_events(txn, events)
                txn.put(b"lsn", _LSN.pack(lsn), db=self._meta)
                return

    def _check_lsn(self, txn, lsn: int) -> None:
        raw = txn.get(b"lsn", db=self._meta)
        old = 0 if raw is None else _LSN.unpack(raw)[0]
        if lsn < old:
            raise ValueError(f"snapshot LSN {lsn} is below the stored LSN {old}")

    def _write_events(self, txn, events: "EventWrite") -> None:
        ecur = txn.cursor(db=self._events)
        for k, v in events.puts:
            ecur.put(k, v, overwrite=True)
        for lo, hi in events.delete_ranges:  # [lo, hi) key ranges, after the puts
            cur = txn.cursor(db=self._events)
            if cur.set_range(lo):
                while cur.key() < hi:
                    if not cur.delete():
                        break
        for space, next_seq in events.next_seqs.items():
            txn.put(b"evseq:" + space.encode(), _LSN.pack(next_seq), db=self._meta)

    def _write_txn(self, lsn: int, puts, deletes: list[bytes], events: "EventWrite | None" = None) -> None:
        with self._env.begin(write=True) as txn:
            self._check_lsn(txn, lsn)
            if puts:
                cur = txn.cursor(db=self._entities)
                cur.putmulti(puts, dupdata=False, overwrite=True)
            for key in deletes:
                txn.delete(key, db=self._entities)
            if events is not None:
                self._write_events(txn, events)
            txn.put(b"lsn", _LSN.pack(lsn), db=self._meta)

    def close(self) -> None:
        """Close the environment (idempotent)."""
        env, self._env = self._env, None
        if env is not None:
            env.close()

    def __enter__(self) -> "SnapshotStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

