"""The simulator's disk: a data dir (on tmpfs) whose journal writes, fsyncs and crashes
are decided by one seeded random source.

What is simulated and what is real:

- :class:`SimJournal` IS the production :class:`~rallypoint.persistence.journal.Journal`
  (append, framing, segment rolls, the durable/synced LSNs, waiters, truncation, close)
  with only its flusher (a Trio task and the sync helper) replaced by a Trio task that
  the seed drives: each
  group-commit round writes its bytes in one to three pieces with a (virtual) latency
  between them (a crash in between leaves a short write: a torn record), then waits a
  seeded fsync latency, then "fsyncs". A chosen write or fsync fails with ``EIO``; the
  journal then stops exactly as the real one does (fail-stop, ``JournalWriteError``).
- The bytes go to real segment files with real ``os.write``; :class:`SimDisk` remembers
  how much of each file was fsynced. A **crash** freezes the disk (nothing more is
  written), then cuts the files: a *process* crash (``kill -9``) keeps every byte
  written (the page cache survives), a *machine* crash keeps the fsynced prefix plus a
  random part of what was only written, sometimes with its last bytes damaged or a run
  of zeros appended (a torn tail). Recovery is then the real code:
  :func:`rallypoint.node.open_node` -> ``recover`` -> ``scan_journal`` (which cuts the
  torn tail) -> snapshot load -> replay -> re-arm -> lease extension.
- The LMDB snapshot store is the real one; its write runs on the event loop after a
  seeded latency (a crash during the latency leaves the previous snapshot, which is
  what LMDB's atomic commit guarantees), instead of in a worker thread (a thread would
  make the virtual clock's progress depend on real time).

The disk keeps the layout of every record (segment, offset) so that the simulator
knows, independently of the recovery code, which LSN a crash must leave as the last
one (:meth:`SimDisk.crash` returns it).
"""

from __future__ import annotations

import errno
import os
import queue
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

import trio

from ..node import Storage
from ..persistence.journal import HEADER_SIZE, Journal, list_segments, segment_name
from ..persistence.manifest import Manifest, try_write_manifest

__all__ = ["DiskFaults", "SimDisk", "SimJournal", "SimSnapshotStore", "SimStorage"]


@dataclass
class DiskFaults:
    """The disk's behaviour for one schedule (drawn from the seed).

    Latencies are virtual seconds (Trio's MockClock). ``fail_fsync_at`` /
    ``fail_write_at``: the index (0-based, counted over the whole schedule) of the
    fsync / write that fails with EIO, or None."""

    write_latency_s: float = 0.0005
    fsync_latency_s: float = 0.002
    slow_fsync_p: float = 0.1  # an fsync takes 50-500x longer
    split_write_p: float = 0.3  # a round's bytes are written in 2-3 pieces
    fail_fsync_at: int | None = None
    fail_write_at: int | None = None
    snapshot_latency_s: float = 0.003

    @classmethod
    def draw(cls, rng: random.Random, *, allow_fsync_failure: bool) -> "DiskFaults":
        """A random disk for one schedule."""
        f = cls(
            write_latency_s=rng.choice((0.0, 0.0002, 0.001, 0.005)),
            fsync_latency_s=rng.choice((0.0005, 0.002, 0.01, 0.05)),
            slow_fsync_p=rng.choice((0.0, 0.05, 0.2)),
            split_write_p=rng.choice((0.0, 0.3, 0.7)),
            snapshot_latency_s=rng.choice((0.0, 0.003, 0.2)),
        )
        if allow_fsync_failure and rng.random() < 0.06:
            f.fail_fsync_at = rng.randrange(1, 60)
        if rng.random() < 0.04:
            f.fail_write_at = rng.randrange(1, 60)
        return f


@dataclass
class _Loc:
    seg_first: int
    start: int
    end: int


@dataclass
class SimDisk:
    """The disk of one simulated data dir (for a whole schedule, across restarts).

    Args:
        data_dir: the directory (on tmpfs).
        rng: the disk's own random source (derived from the seed).
        faults: latencies and injected failures.
        segment_bytes: journal segment size (small, so segments roll and get truncated).
    """

    data_dir: str
    rng: random.Random
    faults: DiskFaults
    segment_bytes: int = 4096
    crashed: bool = False
    synced: dict[str, int] = field(default_factory=dict)
    layout: dict[int, _Loc] = field(default_factory=dict)
    #: first LSNs of the segments a snapshot's truncation deleted
    truncated: set[int] = field(default_factory=set)
    n_writes: int = 0
    n_fsyncs: int = 0
    #: called with (lsn, payload) for every record appended (the simulator's mirror)
    on_append: Callable[[int, bytes], None] | None = None
    #: called with the new durable LSN whenever it advances (the simulator's shadow)
    on_durable: Callable[[int], None] | None = None
    #: called before every snapshot write with its LSN (a check: never after fail-stop)
    on_snapshot: Callable[[int], None] | None = None
    log: list[str] = field(default_factory=list)

    # ----------------------------------------------------------------- syscalls
    def write(self, fd: int, path: str, data) -> None:
        """``os.write`` all of ``data`` (raises OSError(EIO) when this is the failing write)."""
        i = self.n_writes
        self.n_writes += 1
        if self.faults.fail_write_at is not None and i == self.faults.fail_write_at:
            self.log.append(f"write #{i} fails (EIO)")
            raise OSError(errno.EIO, "simulated write failure")
        mv = memoryview(data)
        n = 0
        while n < len(mv):
            n += os.write(fd, mv[n:])

    def fdatasync(self, fd: int, path: str) -> None:
        """Mark ``path`` synced up to its current size (raises OSError(EIO) when this is
        the failing fsync: nothing is marked)."""
        i = self.n_fsyncs
        self.n_fsyncs += 1
        if self.faults.fail_fsync_at is not None and i == self.faults.fail_fsync_at:
            self.log.append(f"fsync #{i} fails (EIO)")
            raise OSError(errno.EIO, "simulated fsync failure")
        self.synced[path] = os.fstat(fd).st_size

    def pieces(self, n: int) -> list[int]:
        """Split ``n`` bytes into the sizes of 1-3 write() calls."""
        if n < 2 or self.rng.random() >= self.faults.split_write_p:
            return [n]
        cuts = sorted(self.rng.sample(range(1, n), min(n - 1, self.rng.randint(1, 2))))
        out, prev = [], 0
        for c in cuts + [n]:
            out.append(c - prev)
            prev = c
        return out

    def write_latency(self) -> float:
        return self.faults.write_latency_s * self.rng.random()

    def fsync_latency(self) -> float:
        base = self.faults.fsync_latency_s * (0.5 + self.rng.random())
        if self.rng.random() < self.faults.slow_fsync_p:
            base *= self.rng.choice((10, 50, 100))
        return base

    # ----------------------------------------------------------------- incarnations
    def start_incarnation(self) -> None:
        """A node is opening the data dir: every byte on disk now counts as synced
        (it survived the crash, or recovery fsynced its cut)."""
        self.crashed = False
        self.synced = {str(p): p.stat().st_size for _, p in list_segments(self.data_dir)}

    def forget_after(self, last_lsn: int) -> None:
        """Recovery kept records up to ``last_lsn``: later LSNs will be written anew."""
        for lsn in [k for k in self.layout if k > last_lsn]:
            del self.layout[lsn]

    def crash(self, machine: bool) -> int:
        """Freeze the disk and cut the journal like a crash would. Returns the last LSN
        the cut leaves intact (every LSN up to it survives, none after it)."""
        self.crashed = True
        rng = self.rng
        damage: dict[int, int] = {}  # segment first LSN -> first damaged byte offset
        for first, path in list_segments(self.data_dir):
            size = path.stat().st_size
            synced = self.synced.get(str(path), size)
            keep = size
            bad = size
            if machine and size > synced:
                keep = synced + rng.randint(0, size - synced)
                bad = keep
                with open(path, "r+b") as f:
                    f.truncate(keep)
                    if keep > synced and rng.random() < 0.3:  # the last bytes kept are damaged
                        n = rng.randint(1, min(64, keep - synced))
                        f.seek(keep - n)
                        old = f.read(n)
                        f.seek(keep - n)
                        f.write(bytes(b ^ rng.randint(1, 255) for b in old))
                        bad = keep - n
                    if rng.random() < 0.2:  # a run of zeros past the end (delayed allocation)
                        f.seek(0, 2)
                        f.write(b"\0" * rng.randint(1, 200))
                self.log.append(f"machine crash: {path.name} cut from {size} to {keep} bytes (synced {synced})")
            damage[first] = bad
        # which LSNs survive: contiguous from the start; a segment deleted by a snapshot's
        # truncation held only records below the snapshot (they count as surviving); a
        # segment never created holds nothing
        last = 0
        for lsn in sorted(self.layout):
            loc = self.layout[lsn]
            if lsn != last + 1 and last != 0:
                break
            if loc.seg_first in damage:
                if loc.end > damage[loc.seg_first]:
                    break
            elif loc.seg_first not in self.truncated:
                break
            last = lsn
        return last


class SimJournal(Journal):
    """The production journal with a seeded Trio flusher instead of its own (see the
    module docstring). Same constructor as :class:`Journal` plus ``disk``."""

    def __init__(self, data_dir, *, mode: str, next_lsn: int, interval_ms: float, disk: SimDisk) -> None:
        # no free-space reserve, no ballast: the simulated disk never fills up (the
        # free space of the host's tmpfs must not decide anything)
        super().__init__(data_dir, mode=mode, next_lsn=next_lsn, interval_ms=interval_ms,
                         segment_bytes=disk.segment_bytes, min_free_bytes=0, ballast_bytes=0,
                         preallocate_bytes=0)  # the seeded flusher below writes appends only
        self._sim = disk
        self._sim_kick = trio.Event()
        self._round: list[list] = []
        self._active = str(self._jdir / segment_name(next_lsn)) if self._jdir is not None else ""

    def free_bytes(self) -> int | None:
        """None: the simulated disk has no size (snapshots skip their space check)."""
        return None

    # ----------------------------------------------------------------- append
    def append(self, payload) -> int:
        lsn = super().append(payload)
        d = self._sim
        if not self._memory:
            end = self._seg_bytes
            d.layout[lsn] = _Loc(self._segment_firsts[-1], end - len(payload) - HEADER_SIZE, end)
        if d.on_append is not None:
            d.on_append(lsn, bytes(payload))
        self._sim_kick.set()
        return lsn

    def write_now(self) -> None:
        """Nothing: the seeded flusher writes (in pieces, with latencies)."""

    def _on_progress(self, durable: int, synced: int) -> None:
        if self._sim.crashed:
            return
        before = self._durable_lsn
        super()._on_progress(durable, synced)
        if self._durable_lsn > before and self._sim.on_durable is not None:
            self._sim.on_durable(self._durable_lsn)

    async def wait_synced(self, lsn: int | None = None) -> None:
        self._sim_kick.set()  # the flusher sees _force_sync once this call blocks
        await super().wait_synced(lsn)

    def truncate_below(self, lsn: int, *, unlink: bool = True) -> list:
        for path in super().truncate_below(lsn, unlink=True):  # tmpfs: unlinked here, no thread
            self._sim.truncated.add(int(path.name.split(".")[0]))
        return []

    # ----------------------------------------------------------------- the flusher
    def _roll_file(self, first_lsn: int) -> None:
        d = self._sim
        d.fdatasync(self._fd, self._active)  # the old segment is complete before a newer exists
        self._n_fsyncs += 1
        os.close(self._fd)
        self._fd = None
        path = self._jdir / segment_name(first_lsn)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._active = str(path)
        self._file_first = first_lsn
        d.synced[self._active] = 0
        # as the production roll: the manifest names the newest segment (durably)
        try_write_manifest(self.data_dir, Manifest(active_segment=first_lsn))

    async def _write_round(self, chunks, *, latency: bool) -> None:
        """Write a round's chunks, in seeded pieces with latencies between them. What is
        not written yet stays in ``_round`` (a cancelled flusher finishes it, as the
        production flusher finishes its round before it stops)."""
        d = self._sim
        self._round = [[seg_first, data, 0] for seg_first, data in chunks]
        while self._round:
            item = self._round[0]
            seg_first, data, off = item
            if seg_first is not None:
                self._roll_file(seg_first)
                item[0] = None
            for n in (d.pieces(len(data) - off) if latency else [len(data) - off]):
                if n <= 0:
                    continue
                if latency:
                    dt = d.write_latency()
                    if dt:
                        await trio.sleep(dt)
                    if d.crashed:
                        return
                d.write(self._fd, self._active, memoryview(data)[item[2]:item[2] + n])
                item[2] += n
                self._n_writes += 1
                self._n_bytes += n
            self._round.pop(0)

    def _has_work(self) -> bool:
        return bool(self._chunks) or bool(self._buf) or self._buf_seg is not None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The flusher (a Trio task, driven by the seed): the same rounds as the
        production flusher -- take everything appended, write it, fsync (every round in
        ``fsync`` mode; at most every ``interval_ms`` in ``interval`` mode), report
        progress -- with seeded latencies and failures."""
        if self._running:
            raise RuntimeError("Journal.run() was already started")
        if self._memory:
            await super().run(task_status=task_status)
            return
        self._running = True
        self._done = trio.Event()
        task_status.started()
        d = self._sim
        written = synced = self._synced_lsn
        next_sync_at: float | None = None
        try:
            while True:
                while not (self._has_work() or self._stop or self._force_sync):
                    if next_sync_at is not None and trio.current_time() >= next_sync_at:
                        break
                    self._sim_kick = trio.Event()
                    with trio.move_on_at(next_sync_at if next_sync_at is not None else float("inf")):
                        await self._sim_kick.wait()
                if d.crashed:
                    await trio.sleep_forever()
                chunks, upto = self._take()
                stop = self._stop
                force = self._force_sync
                self._force_sync = False
                if chunks:
                    await self._write_round(chunks, latency=not stop)
                    if d.crashed:
                        await trio.sleep_forever()
                    written = upto
                if written > synced:
                    now = trio.current_time()
                    if self._fsync_each or stop or force:
                        do_sync = True
                    else:
                        if next_sync_at is None:
                            next_sync_at = now + self.interval_s
                        do_sync = now >= next_sync_at
                    if do_sync:
                        if not stop:
                            await trio.sleep(d.fsync_latency())
                            if d.crashed:
                                await trio.sleep_forever()
                        d.fdatasync(self._fd, self._active)
                        self._n_fsyncs += 1
                        synced = written
                        next_sync_at = None
                if chunks or force or synced == written:
                    self._on_progress(written, synced)
                if stop:
                    break
        except trio.Cancelled:
            # like the production run(): cancelled, it writes and fsyncs what is buffered
            # first (shielded), unless the process "died" (the disk is frozen)
            self._closed = True
            if not d.crashed and self._error is None:
                with trio.CancelScope(shield=True):
                    try:
                        chunks, upto = self._take()
                        await self._write_round([(a, b[c:]) for a, b, c in self._round] + chunks, latency=False)
                        d.fdatasync(self._fd, self._active)
                        self._n_fsyncs += 1
                        self._on_progress(upto, upto)
                    except OSError as exc:
                        self._on_error(exc)
            raise
        except OSError as exc:  # fail-stop, as the production flusher reports it
            self._on_error(exc)
        finally:
            self._running = False
            self._done.set()
            self._wake_all()
            self._closed = True
        if self._error is not None:
            self._raise_failed()

    async def aclose(self) -> None:
        if self._memory:
            await super().aclose()
            return
        with trio.CancelScope(shield=True):
            self._closed = True
            if self._running:
                self._stop = True
                self._sim_kick.set()
                await self._done.wait()
            elif self._fd is not None and self._error is None and not self._sim.crashed:
                chunks, upto = self._take()
                try:
                    await self._write_round(chunks, latency=False)
                    self._sim.fdatasync(self._fd, self._active)
                except OSError as exc:
                    self._on_error(exc)
                else:
                    self._on_progress(upto, upto)
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._wake_all()
            # as the production close: a clean end (everything synced) is recorded in the
            # manifest, which makes a torn tail past it damage at the next start
            if (not self._sim.crashed and self._error is None and self._abandoned is None
                    and self._synced_lsn == self._next_lsn - 1 and self.data_dir is not None):
                try_write_manifest(self.data_dir, Manifest(active_segment=self._file_first,
                                                           clean_end_lsn=self._next_lsn - 1))
        if self._error is not None:
            self._raise_failed()


class SimSnapshotStore:
    """The real LMDB store; :meth:`write` runs on the loop after a seeded latency."""

    def __init__(self, store, disk: SimDisk) -> None:
        self._store = store
        self._disk = disk

    def load_lsn(self) -> int:
        return self._store.load_lsn()

    async def write(self, lsn: int, puts, deletes, events=None) -> None:
        d = self._disk
        dt = d.faults.snapshot_latency_s * d.rng.random()
        if dt:
            await trio.sleep(dt)  # a crash now leaves the previous snapshot (atomic commit)
        if d.crashed:
            await trio.sleep_forever()
        if d.on_snapshot is not None:
            d.on_snapshot(lsn)
        self._store._write_sync(lsn, list(puts), deletes, events)

    @asynccontextmanager
    async def writer(self):
        """A streamed write (:meth:`SnapshotStore.writer`): the batches are kept, then
        written on the loop at the commit, after the seeded latency (a crash before
        then leaves the previous snapshot)."""
        w = _SimWriter(self)
        yield w

    def __getattr__(self, name):
        return getattr(self._store, name)


class _SimWriter:
    def __init__(self, store: SimSnapshotStore) -> None:
        self._sim = store
        self._batches: list = []
        self.nbytes = 0

    def send(self, batch) -> None:
        self.nbytes += batch.nbytes
        self._batches.append(batch)

    async def commit(self, lsn: int, events=None) -> None:
        sim = self._sim
        d = sim._disk
        dt = d.faults.snapshot_latency_s * d.rng.random()
        if dt:
            await trio.sleep(dt)  # a crash now leaves the previous snapshot (atomic commit)
        if d.crashed:
            await trio.sleep_forever()
        if d.on_snapshot is not None:
            d.on_snapshot(lsn)
        q = queue.SimpleQueue()
        for b in self._batches:
            q.put(b)
        q.put((lsn, events))
        self._batches = []
        sim._store._guarded(sim._store._stream_txn, q)


class SimStorage(Storage):
    """What :func:`rallypoint.node.open_node` opens on the simulated disk.

    ``on_coordinator`` is forwarded to ``hook`` (the simulator seeds the coordinator's
    id generator and installs fault injection there)."""

    def __init__(self, disk: SimDisk, hook: Callable | None = None) -> None:
        self.disk = disk
        self.hook = hook
        self.journal: SimJournal | None = None
        self.recovered_next_lsn = 0

    def open_journal(self, recovered, mode: str, interval_ms: int, **options) -> SimJournal:
        """A :class:`SimJournal` at the recovered ``next_lsn`` (``options``, the
        free-space arguments, are ignored: the simulated disk never fills up)."""
        self.recovered_next_lsn = recovered.next_lsn
        self.journal = SimJournal(recovered.data_dir, mode=mode, next_lsn=recovered.next_lsn,
                                  interval_ms=interval_ms, disk=self.disk)
        return self.journal

    def snapshot_store(self, store) -> SimSnapshotStore:
        return SimSnapshotStore(store, self.disk)

    def on_coordinator(self, coordinator) -> None:
        if self.hook is not None:
            self.hook(coordinator)
