"""The simulator's disk: the storage device under the PRODUCTION journal, driven by one
seeded random source.

What is simulated and what is real:

- The journal is the production :class:`~rallypoint.persistence.journal.Journal`,
  flusher included (group commit, the batch-end write, preallocation, segment rolls,
  disk-full handling, the sync requests and their answers). The simulator swaps only
  its :class:`~rallypoint.persistence.journal.Disk` for :class:`SimDisk`, and with it
  the sync helper (:meth:`SimDisk.start_syncer`: :class:`SimSyncer`, which answers on
  the event loop after a seeded virtual latency instead of in a process or a thread)
  and what runs off the loop (:meth:`SimDisk.run_blocking`: inline, after a seeded
  latency). A thread or a process would make the virtual clock's progress depend on
  real time.
- The seed decides: short writes; a write or an fdatasync that fails with ``EIO``
  (the journal then stops exactly as on real hardware: fail-stop,
  ``JournalWriteError``); fsync latencies (some 10-100x slower); windows of a full
  disk (free space below the journal's reserve, ``ENOSPC`` from writes,
  preallocations, segment creations and the ballast, which a deletion of the ballast
  eases); the journal's preallocation, reserve and ballast sizes; and the fault points
  of the production code (:mod:`rallypoint.persistence.buggify`).
- The bytes go to real segment files (on tmpfs) with real ``os.write``. The disk
  remembers, per file, which prefix is durable (fsynced and not written over since)
  and the durable size. A **crash** freezes the disk (nothing more reaches it; the
  dead process's syncs are answered at once so its shutdown ends), then cuts the
  files: a *process* crash (``kill -9``) keeps every byte written (the page cache
  survives), a *machine* crash keeps the durable prefix plus a random part of what was
  only written, sometimes with its last bytes damaged or a run of zeros appended (a
  torn tail), and zeros up to the durable size (a preallocated tail whose records had
  not reached the disk). Recovery is then the real code:
  :func:`rallypoint.node.open_node` -> ``recover`` -> ``scan_journal`` (which cuts the
  torn tail) -> snapshot load -> replay -> re-arm -> lease extension.
- The LMDB snapshot store is the real one; its write runs on the event loop after a
  seeded latency (a crash during the latency leaves the previous snapshot, which is
  what LMDB's atomic commit guarantees), instead of in a worker thread.

The disk keeps the layout of every record (segment, offset; from the journal's tap)
so that the simulator knows, independently of the recovery code, which LSN a crash
must leave as the last one (:meth:`SimDisk.crash` returns it).
"""

from __future__ import annotations

import errno
import os
import queue
import random
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import trio

from ..node import Storage
from ..persistence.journal import HEADER_SIZE, Disk, Journal, list_segments

__all__ = ["DiskFaults", "SimDisk", "SimSyncer", "SimSnapshotStore", "SimStorage"]

#: free bytes the simulated disk reports outside a full-disk window
ROOMY = 1 << 30


@dataclass
class DiskFaults:
    """The disk's behaviour for one schedule (drawn from the seed).

    Latencies are virtual seconds (Trio's MockClock). ``fail_fsync_at`` /
    ``fail_write_at``: the index (0-based, counted over the whole schedule) of the
    fdatasync / write that fails with EIO, or None. ``full``: windows ``(start, length)``
    of virtual seconds in which the disk is full (``full_free`` bytes free, ENOSPC).
    The journal's ``segment_bytes``, ``preallocate_bytes``, ``min_free_bytes`` and
    ``ballast_bytes`` are drawn here too."""

    write_latency_s: float = 0.0005
    fsync_latency_s: float = 0.002
    slow_fsync_p: float = 0.1  # an fsync takes 10-100x longer
    split_write_p: float = 0.3  # a write() writes only part of its bytes
    fail_fsync_at: int | None = None
    fail_write_at: int | None = None
    snapshot_latency_s: float = 0.003
    segment_bytes: int = 4096
    preallocate_bytes: int = 0
    min_free_bytes: int = 0
    ballast_bytes: int = 0
    full: tuple[tuple[float, float], ...] = ()
    full_free: int = 0

    @classmethod
    def draw(cls, rng: random.Random, *, allow_fsync_failure: bool,
             space: random.Random | None = None) -> "DiskFaults":
        """A random disk for one schedule. ``space`` draws the journal's sizes and the
        full-disk windows (a source of their own: a new knob there does not move the
        schedule's other draws)."""
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
        if space is not None:
            f.segment_bytes = space.choice((4096, 4096, 16384))
            f.preallocate_bytes = space.choice((0, 0, 1024, 4096, 65536))
            f.min_free_bytes = space.choice((0, 16384))
            f.ballast_bytes = space.choice((0, 0, 8192))
            if space.random() < 0.12:
                f.full = tuple(sorted((space.uniform(1.0, 60.0), space.choice((0.3, 2.0, 8.0)))
                                      for _ in range(space.randint(1, 2))))
                f.full_free = space.choice((0, f.min_free_bytes // 2))
        return f

    def describe(self) -> str:
        """The knobs that differ from a plain disk, for a profile's one-line summary."""
        bits = [f"seg={self.segment_bytes}"]
        if self.preallocate_bytes:
            bits.append(f"prealloc={self.preallocate_bytes}")
        if self.min_free_bytes:
            bits.append(f"reserve={self.min_free_bytes}")
        if self.ballast_bytes:
            bits.append(f"ballast={self.ballast_bytes}")
        if self.full:
            bits.append("full@" + ",".join(f"{a:.1f}+{b}s" for a, b in self.full))
        return " ".join(bits)


@dataclass
class _Loc:
    seg_first: int
    start: int
    end: int


@dataclass
class _File:
    """What a crash keeps of one file: ``clean``, the prefix that is durable (fsynced
    and not written over since); ``size``, the durable file size; ``data_end``: the end
    of the records written (the file may be longer: preallocated zeros); ``low``: while
    an fdatasync runs, the lowest offset written since it started (None: none runs)."""

    clean: int
    size: int
    data_end: int = 0
    low: int | None = None


@dataclass
class SimDisk(Disk):
    """The disk of one simulated data dir (for a whole schedule, across restarts): a
    :class:`~rallypoint.persistence.journal.Disk` the production journal runs on.

    Args:
        data_dir: the directory (on tmpfs).
        rng: the disk's own random source (derived from the seed).
        faults: latencies, sizes and injected failures.
    """

    data_dir: str
    rng: random.Random
    faults: DiskFaults
    crashed: bool = False
    #: per file (inode number): its durable prefix and size
    files: dict[int, _File] = field(default_factory=dict)
    layout: dict[int, _Loc] = field(default_factory=dict)
    #: first LSNs of every segment file ever created (one missing now was deleted by a
    #: snapshot's truncation: it held only records the snapshot has)
    created: set[int] = field(default_factory=set)
    n_writes: int = 0
    n_fsyncs: int = 0
    #: bytes of space a deleted ballast gave back inside a full-disk window
    credit: int = 0
    #: called with (lsn, payload) for every record appended (the simulator's mirror)
    on_append: Callable[[int, bytes], None] | None = None
    #: called with the new durable LSN whenever it advances (the simulator's shadow)
    on_durable: Callable[[int], None] | None = None
    #: called before every snapshot write with its LSN (a check: never after fail-stop)
    on_snapshot: Callable[[int], None] | None = None
    log: list[str] = field(default_factory=list)
    #: set by :meth:`crash`: the disk's own waits (fsync, write latencies) end at once
    #: (a dead process waits for nothing; the simulator does not move time to stop it)
    stopped: trio.Event | None = None
    #: how many of the disk's waits are in progress (an fsync, a file write)
    waiting: int = 0

    async def pause(self, seconds: float) -> None:
        """Wait ``seconds`` of virtual time, or less if the disk crashes meanwhile."""
        if self.stopped is None:
            self.stopped = trio.Event()
        self.waiting += 1
        try:
            with trio.move_on_after(seconds):
                await self.stopped.wait()
        finally:
            self.waiting -= 1

    @property
    def segment_bytes(self) -> int:
        return self.faults.segment_bytes

    # ----------------------------------------------------------------- space
    def full_now(self) -> bool:
        """Inside one of the schedule's full-disk windows (virtual time)?"""
        if not self.faults.full:
            return False
        now = trio.current_time()
        return any(a <= now < a + b for a, b in self.faults.full)

    def _room(self, n: int, *, partial: bool = False) -> int:
        """How many of ``n`` bytes fit now (all outside a full window); raises
        OSError(ENOSPC) when none do (or, without ``partial``, not all)."""
        if not self.full_now():
            self.credit = 0
            return n
        if self.credit >= n or (partial and self.credit > 0):
            m = min(n, self.credit)
            self.credit -= m
            return m
        raise OSError(errno.ENOSPC, "simulated disk full")

    # ----------------------------------------------------------------- the Disk
    def _state(self, fd: int) -> _File:
        st = os.fstat(fd)
        f = self.files.get(st.st_ino)
        if f is None:
            f = self.files[st.st_ino] = _File(0, 0)
        return f

    def _wrote(self, fd: int, offset: int) -> None:
        f = self._state(fd)
        if offset < f.clean:
            f.clean = offset
        if f.low is not None and offset < f.low:
            f.low = offset

    def write(self, fd: int, data) -> int:
        """``os.write`` of all or (seeded) part of ``data``; EIO when this is the
        failing write, ENOSPC in a full window (part of it with some credit left)."""
        if self.crashed:
            return len(data)  # the process is dead: nothing reaches the disk
        i = self.n_writes
        self.n_writes += 1
        if self.faults.fail_write_at is not None and i == self.faults.fail_write_at:
            self.log.append(f"write #{i} fails (EIO)")
            raise OSError(errno.EIO, "simulated write failure")
        n = self._room(len(data), partial=True)
        if n > 1 and self.rng.random() < self.faults.split_write_p:
            n = self.rng.randint(1, n - 1)  # a short write: the journal writes the rest
        off = os.lseek(fd, 0, os.SEEK_CUR)
        self._wrote(fd, off)
        n = os.write(fd, memoryview(data)[:n])
        f = self._state(fd)
        if off + n > f.data_end:
            f.data_end = off + n
        return n

    def fdatasync(self, fd: int) -> None:
        """Mark the file durable as it is now (the simulated sync helper does the
        same in two halves, :meth:`sync_begin` / :meth:`sync_end`)."""
        if not self.crashed:
            f = self._state(fd)
            f.clean = f.size = os.fstat(fd).st_size

    def open_segment(self, path: Path) -> int:
        if self.crashed:
            return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        self._room(1)
        fd = super().open_segment(path)
        self.files[os.fstat(fd).st_ino] = _File(0, 0)
        self.created.add(int(Path(path).name.split(".")[0]))
        return fd

    def preallocate(self, fd: int, offset: int, size: int) -> None:
        if self.crashed:
            return
        self._room(size)
        self._wrote(fd, offset)
        super().preallocate(fd, offset, size)

    def truncate(self, fd: int, size: int) -> None:
        if self.crashed:
            return
        self._wrote(fd, size)
        os.ftruncate(fd, size)

    def free_bytes(self, path: Path) -> int:
        if self.full_now():
            return self.faults.full_free + self.credit
        return ROOMY

    def remove(self, path: Path) -> None:
        size = os.stat(path).st_size
        os.unlink(path)
        if self.full_now():
            self.credit += size

    def allocate(self, path: Path, size: int) -> None:
        self._room(size)
        with open(path, "wb") as f:
            f.truncate(size)

    async def start_syncer(self, kind: str) -> "SimSyncer":
        """A :class:`SimSyncer` (whatever ``kind``): answers on the event loop."""
        syncer = SimSyncer(self)
        trio.lowlevel.spawn_system_task(syncer._serve, name="sim-sync-helper")
        return syncer

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the loop after a seeded latency; nothing once crashed."""
        dt = self.write_latency()
        if dt and not self.crashed:
            await self.pause(dt)
        if self.crashed:
            await trio.lowlevel.checkpoint()
            return None
        return fn(*args)

    # ----------------------------------------------------------------- fsync, in halves
    def sync_begin(self, fd: int) -> tuple[_File, int]:
        """An fdatasync starts: it will make durable what the file holds now."""
        f = self._state(fd)
        f.low = size = os.fstat(fd).st_size
        return f, size

    def sync_end(self, started: tuple[_File, int]) -> None:
        """The fdatasync returns (raises OSError(EIO) when it is the failing one):
        what it covered is durable, except what was written over meanwhile."""
        i = self.n_fsyncs
        self.n_fsyncs += 1
        f, size = started
        low = f.low if f.low is not None else size
        f.low = None
        if self.faults.fail_fsync_at is not None and i == self.faults.fail_fsync_at:
            self.log.append(f"fsync #{i} fails (EIO)")
            raise OSError(errno.EIO, "simulated fsync failure")
        f.clean = max(f.clean, min(size, low))
        f.size = size

    def write_latency(self) -> float:
        return self.faults.write_latency_s * self.rng.random()

    def fsync_latency(self) -> float:
        base = self.faults.fsync_latency_s * (0.5 + self.rng.random())
        if self.rng.random() < self.faults.slow_fsync_p:
            base *= self.rng.choice((10, 50, 100))
        return base

    # ----------------------------------------------------------------- incarnations
    def start_incarnation(self) -> None:
        """A node opened the data dir: every byte on disk now counts as durable (it
        survived the crash, or recovery fsynced its cut)."""
        self.crashed = False
        self.stopped = None
        self.credit = 0
        self.files = {}
        for first, p in list_segments(self.data_dir):
            st = p.stat()
            self.files[st.st_ino] = _File(st.st_size, st.st_size, st.st_size)
            self.created.add(first)

    def forget_after(self, last_lsn: int) -> None:
        """Recovery kept records up to ``last_lsn``: later LSNs will be written anew."""
        for lsn in [k for k in self.layout if k > last_lsn]:
            del self.layout[lsn]

    def note_segment(self, fd: int, first_lsn: int) -> None:
        """A journal opened (or reused) segment ``first_lsn`` at open, outside the
        Disk: what it holds now is durable (recovery made it so, or it is new)."""
        size = os.fstat(fd).st_size
        self.files[os.fstat(fd).st_ino] = _File(size, size, size)
        self.created.add(first_lsn)

    def note_append(self, journal: Journal, lsn: int, payload) -> None:
        """The journal's tap: where record ``lsn`` lies (the production append has
        just placed it at the end of its segment), and the simulator's mirror."""
        end = journal._seg_bytes
        self.layout[lsn] = _Loc(journal._segment_firsts[-1], end - len(payload) - HEADER_SIZE, end)
        if self.on_append is not None:
            self.on_append(lsn, bytes(payload))

    def crash(self, machine: bool) -> int:
        """Freeze the disk and cut the journal like a crash would. Returns the last LSN
        the cut leaves intact (every LSN up to it survives, none after it).

        A record survives when it was written whole and its bytes on disk after the cut
        are the ones written: the cut is judged by the bytes, not by the offset, since
        a cut inside a record's trailing zero bytes, followed by the zeros of a durable
        file size, leaves that record exactly as written (seed 25723: recovery kept it,
        rightly, and an offset rule called that a violation)."""
        self.crashed = True
        if self.stopped is not None:
            self.stopped.set()
        rng = self.rng
        written: dict[int, int] = {}  # segment first LSN -> end of what was written whole
        changed: dict[int, tuple[int, bytes, bytes]] = {}  # first LSN -> (durable, before, after)
        for first, path in list_segments(self.data_dir):
            st = path.stat()
            size = st.st_size
            f = self.files.get(st.st_ino)
            clean = size if f is None else min(f.clean, size)
            written[first] = size if f is None else min(size, f.data_end)  # (past it: preallocated zeros)
            if machine and size > clean:
                before = path.read_bytes()
                keep = clean + rng.randint(0, size - clean)
                with open(path, "r+b") as fh:
                    fh.truncate(keep)
                    if keep > clean and rng.random() < 0.3:  # the last bytes kept are damaged
                        n = rng.randint(1, min(64, keep - clean))
                        fh.seek(keep - n)
                        old = fh.read(n)
                        fh.seek(keep - n)
                        fh.write(bytes(b ^ rng.randint(1, 255) for b in old))
                    durable_size = f.size if f is not None else 0
                    if durable_size > keep:  # the size was durable: zeros where the writes went
                        fh.truncate(durable_size)
                    elif rng.random() < 0.2:  # a run of zeros past the end (delayed allocation)
                        fh.seek(0, 2)
                        fh.write(b"\0" * rng.randint(1, 200))
                changed[first] = (clean, before, path.read_bytes())
                self.log.append(f"machine crash: {path.name} cut from {size} to {keep} bytes (durable {clean})")
        # which LSNs survive: contiguous from the start; a segment deleted by a snapshot's
        # truncation held only records below the snapshot (they count as surviving); a
        # segment never created holds nothing
        last = 0
        for lsn in sorted(self.layout):
            loc = self.layout[lsn]
            if lsn != last + 1 and last != 0:
                break
            if loc.seg_first in written:
                if loc.end > written[loc.seg_first]:
                    break
                cut = changed.get(loc.seg_first)
                if cut is not None and loc.end > cut[0] and cut[1][loc.start:loc.end] != cut[2][loc.start:loc.end]:
                    break
            elif loc.seg_first not in self.created:
                break
            last = lsn
        return last


class SimSyncer:
    """The sync helper of a :class:`SimDisk` (the interface of
    :class:`~rallypoint.persistence.syncer.Syncer`), on the event loop: a task takes
    the requests waiting, in order, and does them with one fdatasync per file that
    takes a seeded virtual latency (what it makes durable is what the file held when
    it started), then answers with the last request's id -- as the real helper does.
    Once the disk crashed it answers at once and nothing is made durable."""

    kind = "sim"
    pid = None

    def __init__(self, disk: SimDisk) -> None:
        self._disk = disk
        self._next_id = 1
        self._next_key = 1
        self._fds: dict[int, int] = {}
        self._queue: deque[tuple[int, int, bool, bool]] = deque()  # (rid, key, full, unregister)
        self._answers: deque[tuple[int, int, float]] = deque()  # (rid, errno, seconds)
        self._work = trio.Event()
        self._readable = trio.Event()
        self._scope = trio.CancelScope()
        self._closed = False

    def register(self, fd: int) -> int:
        key = self._next_key
        self._next_key += 1
        self._fds[key] = os.dup(fd)
        return key

    def unregister(self, key: int) -> None:
        self._queue.append((0, key, False, True))
        self._work.set()

    def request(self, key: int, *, full: bool = False) -> int:
        rid = self._next_id
        self._next_id += 1
        self._queue.append((rid, key, full, False))
        self._work.set()
        return rid

    async def next_answer(self) -> tuple[int, float]:
        while not self._answers:
            self._readable = trio.Event()
            await self._readable.wait()
        return self._pop()

    def poll_answer(self) -> tuple[int, float] | None:
        return self._pop() if self._answers else None

    def _pop(self) -> tuple[int, float]:
        rid, err, seconds = self._answers.popleft()
        if err:
            raise OSError(err, os.strerror(err))
        return rid, seconds

    async def _serve(self) -> None:
        d = self._disk
        with self._scope:
            while True:
                while not self._queue:
                    self._work = trio.Event()
                    await self._work.wait()
                batch = list(self._queue)
                self._queue.clear()
                last = 0
                started = []
                for rid, key, full, unreg in batch:
                    if unreg:
                        continue
                    last = rid
                    if not full and not d.crashed and key in self._fds and \
                            all(k != key for k, _ in started):
                        started.append((key, d.sync_begin(self._fds[key])))
                err = 0
                dt = 0.0
                if last:
                    if not d.crashed:
                        dt = d.fsync_latency()
                        await d.pause(dt)
                    if not d.crashed:
                        try:
                            for _, s in started:
                                d.sync_end(s)
                        except OSError as exc:
                            err = exc.errno or errno.EIO
                    self._answers.append((last, err, dt))
                    self._readable.set()
                for rid, key, full, unreg in batch:
                    if unreg:
                        fd = self._fds.pop(key, None)
                        if fd is not None:
                            os.close(fd)

    async def aclose(self) -> None:
        """Stop the task and close the descriptors. Never raises; shielded (as
        :meth:`Syncer.aclose <rallypoint.persistence.syncer.Syncer.aclose>`)."""
        self._scope.cancel()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        with trio.CancelScope(shield=True):
            await trio.lowlevel.checkpoint()


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
        self.journal: Journal | None = None
        self.recovered_next_lsn = 0

    def open_journal(self, recovered, mode: str, interval_ms: int, **options) -> Journal:
        """The production :class:`Journal` at the recovered ``next_lsn`` on the
        simulated disk, its sizes (segment, preallocation, free-space reserve,
        ballast) from the seed (``options``, the daemon's, are ignored). Its tap
        tells the disk where each record lies; its durable listener feeds the
        simulator's shadow (until the disk crashed: a dead process tells nobody)."""
        d = self.disk
        f = d.faults
        self.recovered_next_lsn = recovered.next_lsn
        j = self.journal = Journal(
            recovered.data_dir, mode=mode, next_lsn=recovered.next_lsn, interval_ms=interval_ms,
            segment_bytes=f.segment_bytes, min_free_bytes=f.min_free_bytes, ballast_bytes=f.ballast_bytes,
            space_poll_s=1.0, preallocate_bytes=f.preallocate_bytes, disk=d, sync="thread", slow_sync_s=5.0)
        d.note_segment(j._fd, recovered.next_lsn)  # the segment it appends to (made just now, or empty)

        def note(lsn: int, crc: int, payload) -> None:
            d.note_append(j, lsn, payload)

        def set_tap(fn) -> None:  # (a journal has one tap: a replication leader's sees every record too)
            Journal.set_tap(j, note if fn is None else (lambda lsn, crc, p: (note(lsn, crc, p), fn(lsn, crc, p))))

        j.set_tap = set_tap  # type: ignore[method-assign]
        set_tap(None)

        def durable(lsn: int, err) -> None:
            if err is None and not d.crashed and d.on_durable is not None:
                d.on_durable(lsn)

        j.add_durable_listener(durable)
        return j

    def snapshot_store(self, store) -> SimSnapshotStore:
        return SimSnapshotStore(store, self.disk)

    def on_coordinator(self, coordinator) -> None:
        if self.hook is not None:
            self.hook(coordinator)
