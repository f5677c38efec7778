"""A running coordinator on a data dir: lock, recovery, journal, snapshots, shutdown.

:func:`open_node` is what both the daemon (``rallypoint serve``) and
:func:`rallypoint.open_embedded` stand on. Durability modes (SPEC §11):

- ``memory``: no files; everything is lost when the process ends.
- ``fsync``: every acknowledged change is fsynced to the journal first (group commit).
- ``interval``: the journal is fsynced at most every ``interval_ms`` ms.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import sys
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import lmdb
import msgspec
import trio

from .actors import Coordinator
from .clock import Clock
from .errors import ValidationError
from .persistence.snapshot import PutBatch, packed_items
from .nodeconfig import DEFAULT_MIN_FREE_BYTES  # (the default free-space reserve: one definition)
from .service import Service

log = logging.getLogger("rallypoint.node")

__all__ = ["Node", "Storage", "open_node", "DURABILITY_MODES"]

DURABILITY_MODES = ("memory", "interval", "fsync")


class Node:
    """A coordinator with its service and (for file modes) its persistence."""

    def __init__(self, coordinator: Coordinator, data_dir: str | None, durability: str) -> None:
        self.coordinator = coordinator
        self.service = Service(coordinator)
        self.data_dir = data_dir
        self.durability = durability
        self.recovery_info: dict = {}
        self._stop_hearing = None

    def stop_hearing(self) -> None:
        """The node stops taking requests (a SIGTERM's drain begins): from now on no
        lease holder can be heard, so the next start extends leases from this instant,
        not from the last heartbeat (:class:`~rallypoint.persistence.clockfile.ClockFile`,
        "Deaf since"). Idempotent; nothing to do without a data dir."""
        if self._stop_hearing is not None:
            self._stop_hearing()


@asynccontextmanager
async def _unwrapped() -> AsyncIterator[None]:
    """Let an exception from the caller's block leave a background nursery as itself,
    not wrapped in an ExceptionGroup of one (Trio's strict exception groups)."""
    try:
        yield
    except BaseExceptionGroup as eg:
        if len(eg.exceptions) == 1:
            exc = eg.exceptions[0]
            raise exc from exc.__cause__
        raise


class Storage:
    """How a persistent node opens its journal and its snapshot store, and a hook on its
    coordinator. The default is the production one; the deterministic simulator
    (:mod:`rallypoint.testing.sim`) passes a subclass whose journal runs on a seeded,
    fault-injecting disk instead of the sync helper, so that one seed decides every
    write, fsync and crash while recovery, replay and snapshots stay the real code."""

    def open_journal(self, recovered, mode: str, interval_ms: int, **options):
        """The journal to append to after recovery (``recovered``: the
        :class:`~rallypoint.persistence.recovery.Recovered` of the data dir; ``options``:
        the journal's disk-space arguments and ``disk``, see :func:`open_node`)."""
        return recovered.open_journal(mode=mode, interval_ms=interval_ms, **options)

    def snapshot_store(self, store):
        """The snapshot store the :class:`Snapshotter` writes to (``store``: the
        recovered :class:`~rallypoint.persistence.snapshot.SnapshotStore`)."""
        return store

    def on_coordinator(self, coordinator) -> None:
        """Called once the coordinator is made, before recovery replays into it."""


@asynccontextmanager
async def open_node(
    data_dir: str | None = None,
    durability: str | None = None,
    *,
    clock: Clock | None = None,
    interval_ms: int = 10,
    snapshot_every_records: int = 100_000,
    snapshot_every_s: float = 60.0,
    retention: dict | None = None,
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    ballast_bytes: int = 0,
    space_poll_s: float = 1.0,
    snapshot_retry_s: float = 5.0,
    preallocate_bytes: int = 1 << 20,
    sync_helper: str = "process",
    slow_sync_s: float = 1.0,
    disk=None,
    storage: Storage | None = None,
) -> AsyncIterator[Node]:
    """Open (recover) a coordinator and run its background tasks until the block ends.

    ``durability`` defaults to ``memory`` without a data dir and ``fsync`` with one.
    ``retention``: the Coordinator's ``retain_events``, ``retain_events_ms`` and
    ``retain_finished_ms`` (see :class:`~rallypoint.actors.Coordinator`); default: keep
    100,000 events per space and every finished run.
    Raises VALIDATION_FAILED for an unknown mode or a file mode without a data dir.

    Disk full (file modes): writes are refused with UNAVAILABLE while the journal's
    filesystem has less than ``min_free_bytes`` free (default 64 MiB; 0: only a failed
    write refuses), reads go on, and writes resume by themselves once space is free
    (re-checked every ``space_poll_s`` s). ``ballast_bytes`` reserves that much
    (``<data_dir>/BALLAST``) to give back when a write hits ENOSPC. A snapshot that fails
    (say ENOSPC in LMDB) is retried after ``snapshot_retry_s`` s; snapshots are skipped
    while writes are refused. ``preallocate_bytes``: zeros the journal keeps written
    ahead of its records (default 1 MiB; 0: off; see
    :mod:`rallypoint.persistence.journal`, *Preallocation*). ``sync_helper``: where the
    journal's fdatasync runs, ``"process"`` (a sync helper process, the default) or
    ``"thread"`` (see :mod:`rallypoint.persistence.syncer`). ``slow_sync_s``: an
    fdatasync this slow (seconds) is logged, one running ten times as long is reported
    while it runs (:mod:`rallypoint.persistence.journal`, *Slow and stuck disks*).
    ``disk`` replaces the journal's file operations (fault injection in tests,
    :class:`rallypoint.persistence.Disk`); ``storage`` (file modes only) replaces how the
    journal and snapshot store are opened (default :class:`Storage`: the production
    files; the deterministic simulator's is seeded).
    """
    retention = dict(retention or {})
    if durability is None:
        durability = "memory" if data_dir is None else "fsync"
    if durability not in DURABILITY_MODES:
        raise ValidationError(f"durability must be one of {', '.join(DURABILITY_MODES)} (got {durability!r})")
    if durability != "memory":
        if data_dir is None:
            raise ValidationError(f"durability {durability!r} needs a data dir")
        # lock, recover, open the journal; then re-arm, extend leases and run
        async with recovered(data_dir, durability, clock=clock, interval_ms=interval_ms, retention=retention,
                             min_free_bytes=min_free_bytes, ballast_bytes=ballast_bytes, space_poll_s=space_poll_s,
                             preallocate_bytes=preallocate_bytes, sync_helper=sync_helper, slow_sync_s=slow_sync_s,
                             disk=disk, storage=storage) as recovery, \
                serving(recovery, snapshot_every_records=snapshot_every_records, snapshot_every_s=snapshot_every_s,
                        snapshot_retry_s=snapshot_retry_s) as node:
            yield node
        return
    coord = Coordinator(clock=clock or Clock(), durability="memory", **retention)
    node = Node(coord, data_dir, "memory")
    async with _unwrapped(), trio.open_nursery() as nursery:
        await nursery.start(coord.run)
        try:
            yield node
        finally:
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------ persistence
class Snapshotter:
    """Writes the entities changed since the last snapshot to LMDB, then truncates the
    journal below the snapshot's LSN.

    The cut is consistent without stalling the event loop. The dirty set is encoded in
    slices of at most ``SLICE_S`` seconds (yielding between them), each slice handed at
    once to ONE LMDB write transaction open in a worker thread
    (:meth:`SnapshotStore.writer <rallypoint.persistence.snapshot.SnapshotStore.writer>`):
    entities touched meanwhile are dirty again and are encoded again in a later round
    (the later put wins). The events not yet stored are encoded the same way, whole
    chunks only. The last round, small (at most ``FINAL`` entities and the events'
    partial chunks), runs without a yield at LSN ``S`` = ``journal.last_lsn``: every
    entity and event written then reflects the state at ``S``. The transaction commits
    after the journal is synced past ``S``.

    Nothing proportional to the snapshot's size is held on the loop: a slice's encoded
    pairs are packed into bytearrays (:class:`PutBatch`), which the garbage collector
    never walks (a list of 1M encoded values was walked by a gen-0 collection: 50-80 ms
    at 1M entities), and freed by the writer thread batch by batch.

    Triggers: ``every_records`` journal entries or ``every_s`` seconds since the last
    snapshot (if anything changed), and :meth:`snapshot` at graceful shutdown.

    Disk full: while the journal refuses writes no snapshot is attempted (it would take
    the space the journal needs; ``skipped`` counts these); nor is one whose LMDB write
    would leave less than the journal's reserve free (estimated, every ``SPACE_CHECK``
    encoded bytes and at the cut; it fails with ENOSPC before committing). A snapshot
    that fails (that, or LMDB's own ENOSPC/EIO) changes nothing -- the journal still
    holds every change and no segment is deleted -- and is retried after ``retry_s``
    seconds (``failures``, ``last_error``). Neither stops the node.
    """

    FINAL = 256  # at most this many dirty entities are left for the round without a yield
    FINAL_EVENT_CHUNKS = 4  # ... and at most this many whole event chunks
    MAX_ROUNDS = 100  # rounds before the final one regardless (writes that outpace the encoding)
    SLICE = 32  # entities encoded between two clock reads
    SLICE_S = 0.0005  # longest stretch of encoding without a yield, seconds
    SPACE_CHECK = 16 << 20  # encoded bytes between two free-space checks
    POLL_S = 0.25  # how often run() checks whether a snapshot is due

    def __init__(self, coordinator, store, *, every_records: int, every_s: float, retry_s: float = 5.0) -> None:
        self.coordinator = coordinator
        self.store = store
        self.every_records = every_records
        self.every_s = every_s
        self.retry_s = retry_s
        self.last_lsn = store.load_lsn()
        self.last_at = trio.current_time()
        self.snapshots = 0
        self.failures = 0
        self.skipped = 0
        self.attempts = 0  # due snapshots run() attempted or skipped
        self.last_error: str | None = None
        self.last_stats: dict = {}
        self.last_stall_s = 0.0
        self.on_snapshot: list = []  # callables(stats) after each snapshot (metrics)
        #: the oldest LSN someone still reads from the journal files (a catching-up
        #: standby, ``rallypoint.replication``): segments from it on are kept
        self.hold_lsn = None
        self._retry_at: float | None = None
        self._tick: trio.Event | None = None
        self._lock = trio.Lock()
        self._encoder = msgspec.msgpack.Encoder()

    async def wait_attempts(self, n: int) -> None:
        """Return once ``attempts >= n`` (for tests and monitoring)."""
        while self.attempts < n:
            if self._tick is None:
                self._tick = trio.Event()
            await self._tick.wait()

    def _ticked(self) -> None:
        self.attempts += 1
        ev, self._tick = self._tick, None
        if ev is not None:
            ev.set()

    def _encode(self, ids, tables: dict, b: PutBatch | None = None) -> PutBatch:
        """The entities ``ids`` (an iterable of ids) added to batch ``b`` (a new one by
        default): their encoded state, or a delete for an id whose kind no longer has it
        (purged by retention)."""
        if b is None:
            b = PutBatch()
        into = self._encoder.encode_into
        keys, key_ends, values, value_ends = b.keys, b.key_ends, b.values, b.value_ends
        for eid in ids:
            t = tables.get(eid[:3])
            ent = None if t is None else t[0].get(eid)
            if ent is not None:
                keys += eid.encode()
                key_ends.append(len(keys))
                into(ent, values, -1)
                value_ends.append(len(values))
            elif t is not None:
                b.deletes.append(eid.encode())
        return b

    def _space_for(self, journal, nbytes: int) -> None:
        """Refuse (OSError ENOSPC) a snapshot whose LMDB write would eat into the
        journal's free-space reserve: the journal needs that space more (the snapshot is
        only a shortcut for recovery). Estimate: twice the encoded bytes (copy-on-write
        pages, overflow pages) plus 1 MiB."""
        free_fn = getattr(journal, "free_bytes", None)
        free = free_fn() if free_fn is not None else None
        if free is None:
            return
        need = 2 * nbytes + (1 << 20)
        reserve = getattr(journal, "min_free_bytes", 0)
        if free - need < reserve:
            raise OSError(errno.ENOSPC, f"no room for a snapshot of about {need} bytes: {free} bytes free and "
                                        f"the journal keeps {reserve}")

    async def snapshot(self) -> int | None:
        """Take a snapshot now; returns its LSN, or None when nothing changed or the
        journal refuses writes (disk full: skipped, ``skipped`` counts it).

        Raises:
            lmdb.Error, OSError: the LMDB write failed (e.g. ENOSPC). Nothing changed:
                the previous snapshot stands, no journal segment was deleted, and the
                entities stay dirty for the next attempt.
        """
        async with self._lock:
            coord = self.coordinator
            journal = coord.journal
            if coord.failed is not None:
                return None  # fail-stop: memory may be ahead of the journal; never persist it
            if not coord.dirty_count() and journal.last_lsn == self.last_lsn:
                return None
            if not getattr(journal, "writable", True):
                self.skipped += 1
                return None
            t0 = time.perf_counter()
            tables = coord.entity_tables()
            sent: list[tuple] = []  # every batch's keys: to mark its ids dirty again if the write fails
            cut = _EventCut(coord.events)
            counts = [0, 0]  # entities written, deleted
            async with self.store.writer() as w:
                def send(b: PutBatch) -> None:
                    w.send(b)
                    counts[0] += len(b)
                    counts[1] += len(b.deletes)
                    # only what names the ids: the writer thread frees the encoded values
                    sent.append((b.keys, b.key_ends, b.deletes))

                try:
                    clock = time.perf_counter
                    next_check = self.SPACE_CHECK
                    # Time-sliced rounds while much is dirty, then the final round with no yield.
                    rounds = 0
                    while (coord.dirty_count() > self.FINAL or cut.full_chunks() > self.FINAL_EVENT_CHUNKS) \
                            and rounds < self.MAX_ROUNDS:
                        rounds += 1
                        if coord.dirty_count() > self.FINAL:
                            # Detached from the coordinator (what changes meanwhile is marked
                            # afresh, for the next round), popped rather than iterated, one
                            # dict of at most DIRTY_CHUNK ids at a time: freeing an emptied
                            # dict walks its whole table in one step (2.4 ms for 1M ids).
                            left = coord.take_dirty()
                            slice_end = clock() + self.SLICE_S
                            out: PutBatch | None = None
                            try:
                                while left:
                                    batch = left[-1]
                                    pop = batch.popitem
                                    while batch:
                                        out = self._encode([pop()[0] for _ in range(min(self.SLICE, len(batch)))],
                                                           tables, out)
                                        if clock() >= slice_end:
                                            send(out)
                                            out = None
                                            if w.nbytes >= next_check:
                                                self._space_for(journal, w.nbytes)
                                                next_check = w.nbytes + self.SPACE_CHECK
                                            await trio.sleep(0)
                                            slice_end = clock() + self.SLICE_S
                                    del batch, pop
                                    left.pop()
                                if out is not None:
                                    send(out)
                            except BaseException:
                                # what was not handed to the writer is dirty again (the ids
                                # written are marked again below, from ``sent``)
                                coord.give_back_dirty(left)
                                if out is not None:
                                    sent.append((out.keys, out.key_ends, out.deletes))
                                raise
                            del left
                        budget = cut.full_chunks()  # (bounded: commits may add chunks meanwhile)
                        while budget > self.FINAL_EVENT_CHUNKS:
                            b = cut.encode_chunks(clock() + self.SLICE_S)
                            send(b)
                            budget -= max(1, len(b.events))
                            await trio.sleep(0)
                        await trio.sleep(0)
                    final = coord.take_dirty()
                    t_final = time.perf_counter()
                    try:
                        last = self._encode(itertools.chain.from_iterable(final), tables)
                        lsn = journal.last_lsn  # the cut: every entity encoded is at this LSN
                        events, ev_done = cut.finish(last)  # the events of every commit <= lsn
                    except BaseException:
                        coord.give_back_dirty(final)
                        raise
                    send(last)
                    del final
                    now = time.perf_counter()
                    self.last_stall_s = now - t_final  # the one stretch that does not yield
                    encoded_s = now - t0
                    self._space_for(journal, w.nbytes)
                    if not await _synced_unless_refused(journal, lsn):
                        # The disk filled up meanwhile: the journal may never reach lsn.
                        self.skipped += 1
                        await self._mark_dirty(sent)
                        return None
                    await w.commit(lsn, events)
                except BaseException as exc:
                    await self._mark_dirty(sent, cancelled=not isinstance(exc, Exception))  # try again next time
                    raise
            ev_done()
            keep_from = lsn + 1
            hold = self.hold_lsn() if self.hold_lsn is not None else None
            if hold is not None:
                keep_from = min(keep_from, hold)
            removed = journal.truncate_below(keep_from, unlink=False) or []
            if removed:
                await journal.remove_segments(removed)  # off the loop (the Disk's thread)
            self.last_lsn = lsn
            self.last_at = trio.current_time()
            self.snapshots += 1
            self.last_stats = {
                "lsn": lsn,
                "entities": counts[0],
                "deleted": counts[1],
                "stall_s": self.last_stall_s,
                "encode_s": encoded_s,
                "total_s": time.perf_counter() - t0,
                "segments_removed": len(removed or ()),
            }
            log.info(
                "snapshot at LSN %d: %d entities written, %d deleted, in %.3f s (longest stall %.1f ms), "
                "%d journal segments removed",
                lsn, counts[0], counts[1], self.last_stats["total_s"], self.last_stall_s * 1000,
                self.last_stats["segments_removed"],
                extra={"event": "snapshot", "lsn": lsn, "entities": counts[0], "deleted": counts[1],
                       "seconds": round(self.last_stats["total_s"], 4), "stall_ms": round(self.last_stall_s * 1000, 3),
                       "segments_removed": self.last_stats["segments_removed"]},
            )
            for hook in self.on_snapshot:
                hook(self.last_stats)
            while sent:  # a batch's keys each: freed a slice at a time (all at once: ~3 ms at 1M)
                del sent[-1024:]
                await trio.sleep(0)
            return lsn

    async def _mark_dirty(self, sent: list[tuple], *, cancelled: bool = False) -> None:
        """A snapshot that did not commit: every id it encoded is dirty again, marked a
        batch at a time with a yield between (unless cancelled: then at once)."""
        coord = self.coordinator
        with trio.CancelScope(shield=True):
            while sent:
                keys, key_ends, deletes = sent.pop()
                touch = coord.touch
                for k in packed_items(keys, key_ends):
                    touch(bytes(k).decode())
                for k in deletes:
                    touch(k.decode())
                if not cancelled:
                    await trio.sleep(0)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Take snapshots when due (see the class docstring) until cancelled. A failed
        snapshot is logged (one line) and retried after ``retry_s``; it never ends
        this task."""
        task_status.started()
        while True:
            await trio.sleep(self.POLL_S)
            journal = self.coordinator.journal
            behind = journal.last_lsn - self.last_lsn
            due = behind >= self.every_records or (
                behind > 0 and trio.current_time() - self.last_at >= self.every_s
            )
            if not due or (self._retry_at is not None and trio.current_time() < self._retry_at):
                continue
            try:
                if not getattr(journal, "writable", True):
                    self.skipped += 1
                    continue
                await self.snapshot()
                if self._retry_at is not None:
                    log.warning("snapshot written again after %d failure(s)", self.failures)
                self._retry_at = None
            except (lmdb.Error, OSError) as exc:
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._retry_at = trio.current_time() + self.retry_s
                log.warning("snapshot to %s failed (%s); nothing is lost (the journal keeps every change and "
                            "no segment was deleted); retrying in %g s", self.store.path, self.last_error,
                            self.retry_s)
            finally:
                self._ticked()


async def _synced_unless_refused(journal, lsn: int) -> bool:
    """Wait until the journal is synced past ``lsn``; False if it starts refusing writes
    first (a full disk can keep ``lsn`` from ever being written)."""
    sync = getattr(journal, "wait_synced", None)
    refusing = getattr(journal, "wait_refusing", None)
    if refusing is None:
        await (sync(lsn) if sync is not None else journal.wait_durable(lsn))
        return True
    done = False
    async with trio.open_nursery() as nursery:
        async def synced():
            nonlocal done
            await sync(lsn)
            if getattr(journal, "replica_floor", None) is not None:
                # a replicated leader: the snapshot holds nothing the in-sync standby
                # lacks, so a deposed leader never has to cut below its snapshot
                await journal.wait_durable(lsn)
            done = True
            nursery.cancel_scope.cancel()

        async def refused():
            await refusing()
            nursery.cancel_scope.cancel()

        nursery.start_soon(synced)
        nursery.start_soon(refused)
    return done


async def _final_snapshot(snap: Snapshotter) -> None:
    """The snapshot at a clean shutdown; a failure is one log line (the journal holds
    every change: the next start replays it)."""
    journal = snap.coordinator.journal
    if getattr(journal, "replica_floor", None) is not None and journal.durable_lsn < journal.last_lsn:
        # a replicated leader whose standby holds less than it wrote (none in sync under
        # --min-insync 2, say): a snapshot waits for the standby, which may never come --
        # the shutdown must not (found by the two-node simulator, seed 1)
        log.info("no snapshot at shutdown: the standby holds the journal only up to LSN %d of %d; the journal "
                 "holds every change, the next start replays it", journal.durable_lsn, journal.last_lsn)
        return
    if not getattr(journal, "writable", True):
        log.warning("no snapshot at shutdown: the disk is full (%s); the journal holds every change, the next "
                    "start replays it", journal.refusing)
        return
    try:
        await snap.snapshot()
    except (lmdb.Error, OSError) as exc:
        log.warning("snapshot at shutdown failed (%s: %s); the journal holds every change, the next start "
                    "replays it", type(exc).__name__, exc)


class _EventCut:
    """The events part of a snapshot: the chunks holding events not yet stored, encoded
    on the loop a few at a time (:meth:`encode_chunks`, whole chunks only: they no
    longer change) and the rest at the cut (:meth:`finish`: the partial last chunk, and
    the first chunk again if retention dropped events from it meanwhile); the chunks
    now wholly below what is kept are deleted."""

    def __init__(self, log) -> None:
        self.log = log
        self.sent: dict[str, int] = {}  # space -> last seq encoded (whole chunks) so far
        self.first_sent: dict[str, int] = {}  # space -> first chunk start encoded so far

    def _from(self, s) -> int:
        """The first seq of ``s`` that this snapshot has not encoded yet."""
        lo = max(s.persisted_last + 1, s.first_seq)
        done = self.sent.get(s.space)
        return lo if done is None or done < lo else done + 1

    def full_chunks(self) -> int:
        """Whole chunks not encoded yet (every space)."""
        from .events import CHUNK, chunk_start

        n = 0
        for s in self.log.streams.values():
            c = chunk_start(self._from(s))
            if s.last_seq >= c + CHUNK - 1:
                n += (s.last_seq - c + 1) // CHUNK
        return n

    def _encode(self, s, c: int, out: list) -> int:
        """Encode the chunk starting at seq ``c`` of ``s`` (the events it holds now);
        returns its last seq."""
        from .events import CHUNK, encode_chunk, event_key

        a, b = max(c, s.first_seq), min(c + CHUNK - 1, s.last_seq)
        i = s.index_after(a - 1)
        out.append((event_key(s.space, c), encode_chunk(s.entries[i: i + (b - a + 1)])))
        if s.space not in self.first_sent:
            self.first_sent[s.space] = c
        return b

    def encode_chunks(self, until: float) -> PutBatch:
        """Whole chunks encoded until ``time.perf_counter() >= until`` (one at least),
        as a batch."""
        from .events import CHUNK, chunk_start

        out: list = []
        for s in self.log.streams.values():
            c = chunk_start(self._from(s))
            while s.last_seq >= c + CHUNK - 1:
                self.sent[s.space] = self._encode(s, c, out)
                c += CHUNK
                if time.perf_counter() >= until:
                    break
            if time.perf_counter() >= until:
                break
        b = PutBatch()
        b.events = out
        return b

    def finish(self, batch: PutBatch):
        """At the cut: the remaining chunks into ``batch.events``; returns the
        :class:`EventWrite` (delete ranges, next seqs) and a function that records the
        events as stored."""
        from .events import CHUNK, chunk_start, event_key
        from .persistence.snapshot import EventWrite

        out: list = []
        ranges: list[tuple[bytes, bytes]] = []
        next_seqs: dict[str, int] = {}
        marks = []
        for space, s in self.log.streams.items():
            next_seqs[space] = s.next_seq
            first_chunk = chunk_start(s.first_seq)
            done = self.sent.get(space)
            if done is not None and done >= s.first_seq and first_chunk < s.first_seq and \
                    self.first_sent[space] <= first_chunk:
                self._encode(s, first_chunk, out)  # written again without the events dropped since
            lo = self._from(s)
            if lo <= s.last_seq:
                c = chunk_start(lo)
                while c <= s.last_seq:
                    self._encode(s, c, out)
                    c += CHUNK
            # delete what is wholly below the first chunk kept: what the last snapshot
            # stored, and what this one encoded before retention dropped it
            low = None
            if s.persisted_first <= s.persisted_last:
                low = chunk_start(s.persisted_first)
            fs = self.first_sent.get(space)
            if fs is not None and (low is None or fs < low):
                low = fs
            if low is not None and low < first_chunk:
                ranges.append((event_key(space, low), event_key(space, first_chunk)))
            marks.append((s, s.first_seq, s.last_seq))
        batch.events = out

        def done():
            for s, first, last in marks:
                s.persisted_first, s.persisted_last = first, last

        return EventWrite((), ranges, next_seqs), done


def load_events(coordinator, store) -> int:
    """Install the events a snapshot kept (before the journal tail is replayed)."""
    from .events import Stream, decode_chunk, split_event_key

    log = coordinator.events
    seqs = store.event_seqs()
    n = 0
    for key, value in store.iter_events():
        space, _first = split_event_key(key)
        for e in decode_chunk(value):
            s = log.streams.get(space)
            if s is None:
                s = log.streams[space] = Stream(space, e.seq)
            if e.seq != s.next_seq:  # a gap (not expected): the stream starts after it
                s.entries.clear()
                s.start = 0
                s.first_seq = e.seq
            s.entries.append(e)
            s.next_seq = e.seq + 1
            n += 1
    for space, next_seq in seqs.items():
        s = log.streams.get(space)
        if s is None:
            s = log.streams[space] = Stream(space, next_seq)
        elif next_seq > s.next_seq:  # every kept event was trimmed past the last ones
            s.entries.clear()
            s.start = 0
            s.first_seq = s.next_seq = next_seq
        s.persisted_first = s.first_seq
        s.persisted_last = s.next_seq - 1
    return n


def load_entities(coordinator, entities) -> int:
    """Install snapshot entities ``[(key, value)]`` into the coordinator's tables.

    Raises ValueError naming the key when an entry does not decode (the caller turns it
    into SnapshotCorruptError)."""
    tables = coordinator.entity_tables()
    decoders: dict[type, msgspec.msgpack.Decoder] = {}
    n = 0
    for key, value in entities:
        try:
            eid = bytes(key).decode()
            table, typ = tables[eid[:3]]
            dec = decoders.get(typ)
            if dec is None:
                dec = decoders[typ] = msgspec.msgpack.Decoder(typ)
            table[eid] = dec.decode(value)
        except (UnicodeDecodeError, KeyError, msgspec.DecodeError) as exc:
            raise ValueError(f"entity {bytes(key)[:40]!r} does not decode ({type(exc).__name__}: {exc})") from None
        n += 1
    coordinator.rebuild_indexes()
    return n


def recover_coordinator(data_dir: str, coordinator) -> tuple[object, dict]:
    """Snapshot + journal tail -> ``coordinator`` (indexes rebuilt, nothing armed yet).

    The garbage collector is off meanwhile: recovery only builds state (no cycles to
    find), and with it on, the passes triggered by millions of new objects were about
    a fifth of the time; one full pass at the end moves what was built out of the young
    generations (else the first pass after start-up would walk all of it on the loop).

    Returns the persistence ``Recovered`` object and a summary dict. Raises the
    persistence StartupError family (corrupt journal, newer format)."""
    import gc

    from .persistence import SnapshotCorruptError, recover

    t0 = time.perf_counter()
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        rec = recover(data_dir, stream=True)
        try:
            n_entities = load_entities(coordinator, rec.entities)
        except ValueError as exc:
            rec.store.close()
            raise SnapshotCorruptError(str(rec.store.path), str(exc), data_dir=str(data_dir)) from None
        rec.entities = []  # loaded: the 1M (key, value) pairs are not needed any more
        try:
            n_events = load_events(coordinator, rec.store)
            # One pass over the journal: each record is checked as it is read, and
            # damage raises the JournalCorruptError a separate scan would have raised,
            # after the records before it (this coordinator is then thrown away).
            replayed = coordinator.replay_many(rec.records.iter_payloads(), defer_events=True)
            rec.settle()
        except BaseException:
            rec.store.close()
            raise
        # the events of records retention drops were never derived; the rest now
        coordinator.events.recovered(coordinator.derive_deferred)
    finally:
        if gc_was_on:
            gc.enable()
            gc.collect()
    info = {
        "snapshot_lsn": rec.snapshot_lsn,
        "snapshot_entities": n_entities,
        "snapshot_events": n_events,
        "replayed": replayed,
        "next_lsn": rec.next_lsn,
        "torn_tail": rec.torn_tail,
        "seconds": time.perf_counter() - t0,
    }
    return rec, info


def _write_clock(clock_file, clock, mono_ms: int | None = None, wall_ms: int | None = None,
                 deaf_since_ms: int | None = None) -> None:
    """The heartbeat pair (and deaf mark), best effort: a full disk must not stop the
    node for it (an older pair only makes the restart's lease extension larger)."""
    try:
        clock_file.write(clock.mono_ms() if mono_ms is None else mono_ms, clock.now_ms() if wall_ms is None else wall_ms,
                         deaf_since_ms)
    except OSError as e:
        log.debug("clock heartbeat not written: %s", e)


class Recovery:
    """A data dir opened and recovered, not yet serving: the lock held, the coordinator
    rebuilt from the snapshot and the journal tail (nothing armed), its journal open.
    :func:`recovered` makes one; :func:`serving` runs it; a replicated node
    (:mod:`rallypoint.cluster`) keeps it as a standby in between."""

    def __init__(self, data_dir: str, durability: str, coordinator, rec, info: dict, clock: Clock, clock_file,
                 gap_ms: int, storage: "Storage", last_heard_ms: int | None = None) -> None:
        self.data_dir = data_dir
        self.durability = durability
        self.coordinator = coordinator
        self.rec = rec
        self.info = info
        self.clock = clock
        self.clock_file = clock_file
        #: server time that passed since the last heartbeat of this data dir (ms): the
        #: time no lease holder could be heard (extended at start)
        self.gap_ms = gap_ms
        #: server time (ms) when lease holders were last heard: the previous process's
        #: deaf mark (its drain began), else its last heartbeat; None on a first start
        self.last_heard_ms = last_heard_ms
        #: this process's deaf mark (:meth:`stop_hearing`), carried by every later write
        self.deaf_since_ms: int | None = None
        self.storage = storage
        self.snapshotter: Snapshotter | None = None
        #: the journal's options (mode, interval, disk space, sync helper), to open it
        #: again at a standby's promotion
        self.journal_options: dict = {}

    def write_clock(self, mono_ms: int | None = None, wall_ms: int | None = None) -> None:
        """Persist a (server time, wall time) pair, best effort (the heartbeat), with the
        deaf mark once :meth:`stop_hearing` was called."""
        _write_clock(self.clock_file, self.clock, mono_ms, wall_ms, self.deaf_since_ms)

    def stop_hearing(self) -> None:
        """Record that no lease holder can be heard from now (the drain began; see
        :meth:`Node.stop_hearing`): written at once, and with every later heartbeat."""
        if self.deaf_since_ms is None:
            self.deaf_since_ms = self.clock.mono_ms()
            self.write_clock()

    def unheard_ms(self) -> int:
        """Server time since lease holders were last heard (:attr:`last_heard_ms`),
        ms: what a restart gives back to every outstanding lease (0 on a first start)."""
        if self.last_heard_ms is None:
            return 0
        return max(0, self.clock.mono_ms() - self.last_heard_ms)

    async def reopen_journal(self) -> None:
        """Close the journal (flushed, fsynced, its clean end recorded) and open a new
        one at the next LSN: a standby's journal ran without the coordinator; the
        leader's runs under it (``Coordinator.run``)."""
        old = self.coordinator.journal
        await old.aclose()
        opts = dict(self.journal_options)
        mode, interval_ms = opts.pop("mode"), opts.pop("interval_ms")
        self.rec.next_lsn = old.last_lsn + 1
        self.coordinator.journal = self.storage.open_journal(self.rec, mode, interval_ms, **opts)

    def snapshotter_for(self, *, every_records: int, every_s: float, retry_s: float) -> "Snapshotter":
        if self.snapshotter is None:
            self.snapshotter = Snapshotter(self.coordinator, self.storage.snapshot_store(self.rec.store),
                                           every_records=every_records, every_s=every_s, retry_s=retry_s)
        return self.snapshotter


@asynccontextmanager
async def recovered(
    data_dir: str,
    durability: str,
    *,
    clock: Clock | None,
    interval_ms: int,
    retention: dict | None = None,
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    ballast_bytes: int = 0,
    space_poll_s: float = 1.0,
    preallocate_bytes: int = 1 << 20,
    sync_helper: str = "process",
    slow_sync_s: float = 1.0,
    disk=None,
    storage: Storage | None = None,
    segment_bytes: int = 64 << 20,
) -> AsyncIterator[Recovery]:
    """Lock ``data_dir``, recover its coordinator and open its journal (not running);
    at the end close the snapshot store, the clock file and the lock. Arguments: see
    :func:`open_node`."""
    from .persistence import DataDirLock

    from .persistence.clockfile import ClockFile

    storage = storage or Storage()
    os.makedirs(data_dir, exist_ok=True)
    lock = DataDirLock(data_dir)
    lock.acquire()
    clock_file = ClockFile(data_dir)
    try:
        clock = clock or Clock()
        last = clock_file.read_full()
        gap_ms = 0
        last_heard = None
        if last is not None:
            clock.resume(last[0], last[1])  # server time continues, never backward
            gap_ms = clock.mono_ms() - last[0]
            last_heard = last[2] if last[2] is not None and last[2] <= last[0] else last[0]
        coord = Coordinator(clock=clock, durability=durability, **(retention or {}))
        storage.on_coordinator(coord)
        rec, info = recover_coordinator(data_dir, coord)
        try:
            coord.journal = storage.open_journal(rec, durability, interval_ms,
                                                 min_free_bytes=min_free_bytes, ballast_bytes=ballast_bytes,
                                                 space_poll_s=space_poll_s,
                                                 preallocate_bytes=preallocate_bytes, sync=sync_helper,
                                                 slow_sync_s=slow_sync_s, disk=disk, segment_bytes=segment_bytes)
        except BaseException:
            rec.store.close()
            raise
        recovery = Recovery(data_dir, durability, coord, rec, info, clock, clock_file, gap_ms, storage,
                            last_heard_ms=last_heard)
        recovery.journal_options = dict(mode=durability, interval_ms=interval_ms, min_free_bytes=min_free_bytes,
                                        ballast_bytes=ballast_bytes, space_poll_s=space_poll_s,
                                        preallocate_bytes=preallocate_bytes, sync=sync_helper,
                                        slow_sync_s=slow_sync_s, disk=disk, segment_bytes=segment_bytes)
        try:
            yield recovery
        finally:
            rec.store.close()
    finally:
        clock_file.close()
        lock.release()


def _log_recovery(recovery: Recovery) -> None:
    info = recovery.info
    coord = recovery.coordinator
    torn = info["torn_tail"]
    if torn is not None:
        from .persistence.journal import ZERO_TAIL

        if torn.reason == ZERO_TAIL:  # a preallocated segment after a crash: nothing lost
            log.info("cut the journal's zero-filled tail: %s", torn)
        else:
            log.warning("cut a torn journal tail: %s", torn)
    data_dir = recovery.data_dir
    log.info(
        "recovered %d entities from %s: snapshot LSN %d, %d journal records replayed, %d events kept, in %.3f s",
        info["entities"], os.path.abspath(data_dir), info["snapshot_lsn"], info["replayed"],
        coord.events.statistics()["events"], info["seconds"],
        extra={"event": "recovery", "entities": info["entities"], "data_dir": os.path.abspath(data_dir),
               "snapshot_lsn": info["snapshot_lsn"], "replayed": info["replayed"],
               "seconds": round(info["seconds"], 4), "downtime_s": info["downtime_s"],
               "leases_extended_ms": info["leases_extended_ms"]},
    )


@asynccontextmanager
async def serving(
    recovery: Recovery,
    *,
    snapshot_every_records: int,
    snapshot_every_s: float,
    snapshot_retry_s: float = 5.0,
    gap_ms: int | None = None,
    before_rearm=None,
) -> AsyncIterator[Node]:
    """Serve a recovered data dir: re-arm every activity, extend outstanding leases by
    the time no holder could be heard (``gap_ms``; default: from the previous process's
    deaf mark -- its drain's start -- or else its last heartbeat, until now, so the
    restart's exit, start-up and recovery all count: :meth:`Recovery.unheard_ms`), run
    the coordinator and snapshots until the block ends; then a final snapshot (on a
    clean exit) and the journal closed. ``before_rearm(coord)`` runs first (a new
    leader journals its epoch there); an int it returns is the gap, ms, when
    ``gap_ms`` is None (a promoted standby's: the time since the old leader's last
    word, :func:`rallypoint.replication.take_over`)."""
    coord = recovery.coordinator
    info = recovery.info
    if before_rearm is not None:
        said = before_rearm(coord)
        if gap_ms is None and isinstance(said, int):
            gap_ms = said
    coord.rearm_all()
    # the server could not hear renewals while it was down: leases get that time back
    if gap_ms is None:
        gap_ms = recovery.unheard_ms()
    info["leases_extended_ms"] = coord.extend_leases_after_restart(gap_ms)
    coord.heartbeat = lambda mono, wall: recovery.write_clock(mono, wall)
    recovery.write_clock()  # (hearing again: the previous deaf mark is gone)
    info["entities"] = coord.entity_count()
    info["downtime_s"] = gap_ms / 1000
    _log_recovery(recovery)
    node = Node(coord, recovery.data_dir, recovery.durability)
    node.recovery_info = info
    node._stop_hearing = recovery.stop_hearing
    snap = recovery.snapshotter_for(every_records=snapshot_every_records, every_s=snapshot_every_s,
                                    retry_s=snapshot_retry_s)
    coord.background.append(snap.run)
    node.snapshotter = snap
    clean = False
    try:
        async with _unwrapped(), trio.open_nursery() as nursery:
            await nursery.start(coord.run)
            try:
                yield node
                clean = True
            finally:
                if clean and coord.failed is None:
                    with trio.CancelScope(shield=True):
                        await _final_snapshot(snap)
                        recovery.write_clock()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await coord.journal.aclose()
