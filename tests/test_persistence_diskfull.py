"""Disk full, by fault injection (issue 12, item 9). The real-filesystem version, against a
daemon, is test_persistence_diskfull_fs.py.

A :class:`FaultyDisk` is a filesystem with ``free`` bytes: a write takes what fits (a
short write) and then fails with ENOSPC, like a real full disk. Expected: writes are
refused with UNAVAILABLE before anything is applied, reads go on, a write that did not
reach the disk is never acknowledged (and memory never shows it to anyone), snapshots
are skipped or retried, and everything resumes by itself once space is free.
"""

from __future__ import annotations

import errno
import os
from contextlib import asynccontextmanager
from pathlib import Path

import lmdb
import msgspec
import pytest
import trio
import trio.testing

import rallypoint
from rallypoint.client.api import Client
from rallypoint.client.embedded import EmbeddedTransport
from rallypoint.errors import UnavailableError
from rallypoint.node import open_node
from rallypoint.persistence import (
    Disk,
    DiskFullError,
    Journal,
    JournalClosedError,
    JournalWriteError,
    read_manifest,
    recover,
)
from rallypoint.persistence import snapshot as snapshot_mod
from rallypoint.persistence.journal import list_segments, read_journal, scan_journal

BIG = 1 << 40


class FaultyDisk(Disk):
    """A filesystem with ``free`` bytes left (shared by the journal's writes and the
    ballast). A write takes what fits and reports it (a short write); a write with
    nothing free raises ENOSPC. ``eio`` makes writes fail with EIO instead."""

    def __init__(self, free: int = BIG) -> None:
        self.free = free
        self.eio = False
        self.fsync_errno: int | None = None  # make fdatasync fail with this errno
        self.enospc = 0  # writes refused for lack of space

    def fdatasync(self, fd) -> None:
        if self.fsync_errno is not None:
            raise OSError(self.fsync_errno, os.strerror(self.fsync_errno))
        os.fdatasync(fd)

    def write(self, fd, data) -> int:
        if self.eio:
            raise OSError(errno.EIO, "Input/output error")
        if self.free <= 0:
            self.enospc += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        n = os.write(fd, bytes(data[: self.free]))
        self.free -= n
        return n

    def open_segment(self, path) -> int:
        if self.free <= 0:  # a new file needs a block for its directory entry here
            self.enospc += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().open_segment(path)

    def free_bytes(self, path) -> int:
        return max(self.free, 0)

    def allocate(self, path, size) -> None:
        if self.free < size:
            raise OSError(errno.ENOSPC, "No space left on device")
        Path(path).write_bytes(b"\0" * size)
        self.free -= size

    def remove(self, path) -> None:
        size = Path(path).stat().st_size
        os.unlink(path)
        self.free += size


def payload(i: int) -> bytes:
    return f"record-{i:05d}".encode() * 4


async def started(j: Journal, nursery) -> Journal:
    await nursery.start(j.run)
    return j


# ------------------------------------------------------------------ journal
async def test_writes_are_refused_below_the_reserve_and_resume_when_space_frees(tmp_path):
    disk = FaultyDisk(free=10_000)
    j = Journal(tmp_path, mode="fsync", next_lsn=1, min_free_bytes=1_000, space_poll_s=0.01, disk=disk)
    async with trio.open_nursery() as nursery:
        await started(j, nursery)
        j.check_writable()
        await j.wait_durable(j.append(payload(1)))
        disk.free = 500  # someone else filled the disk
        await j.wait_durable(j.append(payload(2)))  # this one fitted; the check after it trips
        assert await j.wait_refusing() == "low"
        assert not j.writable and j.refusing == "low"
        with pytest.raises(DiskFullError) as ei:
            j.check_writable()
        e = ei.value
        assert isinstance(e, UnavailableError) and e.code == "UNAVAILABLE"
        assert e.retry_after is not None and e.retry_after >= 1
        assert e.message.startswith(f"disk full at {tmp_path / 'journal'}: {disk.free} bytes free"), e.message
        assert e.details["free_bytes"] == disk.free < 1000 and e.details["reason"] == "low"
        assert j.statistics().refusing == "low" and j.statistics().refusals == 1
        disk.free = 1_000_000  # space is freed
        await j.wait_writable()
        j.check_writable()
        await j.wait_durable(j.append(payload(3)))
        await j.aclose()
    assert [lsn for lsn, _ in read_journal(tmp_path)] == [1, 2, 3]


async def test_a_journal_opened_on_a_full_disk_refuses_at_once(tmp_path):
    j = Journal(tmp_path, mode="fsync", next_lsn=1, min_free_bytes=1_000, disk=FaultyDisk(free=10))
    assert j.refusing == "low"
    with pytest.raises(DiskFullError):
        j.check_writable()
    await j.aclose()


async def test_enospc_stalls_the_write_acknowledges_nothing_and_completes_when_space_frees(tmp_path):
    disk = FaultyDisk()
    j = Journal(tmp_path, mode="fsync", next_lsn=1, space_poll_s=0.01, disk=disk)
    acked = []

    async def writer(lsn):
        await j.wait_durable(lsn)
        acked.append(lsn)

    async with trio.open_nursery() as nursery:
        await started(j, nursery)
        await j.wait_durable(j.append(payload(1)))
        disk.free = 30  # the next record (64 + 16 bytes) is written in part, then ENOSPC
        lsn = j.append(payload(2))
        nursery.start_soon(writer, lsn)
        assert await j.wait_refusing() == "stalled"
        await trio.testing.wait_all_tasks_blocked()
        assert acked == [] and j.durable_lsn == 1  # not on disk: not acknowledged
        with pytest.raises(DiskFullError, match="waits for space"):
            j.check_writable()
        assert j.statistics().stalls == 1 and disk.enospc >= 1
        disk.free = BIG
        await j.wait_writable()
        await j.wait_durable(lsn)
        await trio.testing.wait_all_tasks_blocked()  # the writer task, woken with us, runs
        assert acked == [2]
        await j.wait_durable(j.append(payload(3)))
        await j.aclose()
    # The short write was continued exactly where it stopped: every record is intact.
    assert list(read_journal(tmp_path)) == [(1, payload(1)), (2, payload(2)), (3, payload(3))]


async def test_a_segment_roll_that_hits_enospc_is_retried_where_it_stopped(tmp_path):
    disk = FaultyDisk()
    rec = len(payload(1)) + 16  # 80 bytes: 51 records per 4096-byte segment
    per = 4096 // rec
    j = Journal(tmp_path, mode="fsync", next_lsn=1, segment_bytes=4096, space_poll_s=0.01, disk=disk)
    async with trio.open_nursery() as nursery:
        await started(j, nursery)
        for n in range(1, 2 * per + 1):  # two full segments
            await j.wait_durable(j.append(payload(n)))
        assert [f for f, _ in list_segments(tmp_path)] == [1, per + 1]
        disk.free = 0
        lsn = j.append(payload(2 * per + 1))  # needs a new segment: its creation fails
        assert await j.wait_refusing() == "stalled"
        assert disk.enospc >= 1 and [f for f, _ in list_segments(tmp_path)] == [1, per + 1]
        disk.free = BIG
        await j.wait_durable(lsn)
        await j.wait_writable()
        await j.aclose()
    assert [f for f, _ in list_segments(tmp_path)] == [1, per + 1, 2 * per + 1]
    assert [lsn for lsn, _ in read_journal(tmp_path)] == list(range(1, 2 * per + 2))


async def test_the_ballast_is_given_back_so_the_write_in_flight_lands(tmp_path):
    disk = FaultyDisk(free=100_000)
    j = Journal(tmp_path, mode="fsync", next_lsn=1, ballast_bytes=8192, space_poll_s=0.01, disk=disk)
    ballast = tmp_path / "BALLAST"
    assert ballast.stat().st_size == 8192 and disk.free == 100_000 - 8192
    async with trio.open_nursery() as nursery:
        await started(j, nursery)
        disk.free = 0  # full: the ballast is all that is left
        await j.wait_durable(j.append(payload(1)))  # lands: the ballast was released
        assert not ballast.exists() and j.statistics().stalls == 0
        assert await j.wait_refusing() == "low"  # until the ballast can be made again
        with pytest.raises(DiskFullError, match="ballast"):
            j.check_writable()
        disk.free = 100_000
        await j.wait_writable()
        assert ballast.stat().st_size == 8192
        await j.aclose()
    assert [lsn for lsn, _ in read_journal(tmp_path)] == [1]


async def test_an_io_error_stays_fail_stop_and_check_writable_reports_it(tmp_path):
    disk = FaultyDisk()
    j = Journal(tmp_path, mode="fsync", next_lsn=1, disk=disk)
    with pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            await started(j, nursery)
            disk.eio = True
            with pytest.raises(JournalWriteError) as ei:
                await j.wait_durable(j.append(b"x"))
            assert ei.value.code == "UNAVAILABLE"
    assert info.group_contains(JournalWriteError)
    with pytest.raises(JournalWriteError):
        j.check_writable()


@pytest.mark.parametrize("mode,segment_bytes", [("fsync", 64 << 20), ("interval", 4096)])
async def test_a_failed_fsync_is_fail_stop_even_with_enospc(tmp_path, mode, segment_bytes):
    # After a failed fsync the kernel may have dropped the pages: never retried. In
    # interval mode with small segments the failing fsync is the one before a roll.
    disk = FaultyDisk()
    j = Journal(tmp_path, mode=mode, next_lsn=1, segment_bytes=segment_bytes, interval_ms=600_000,
                space_poll_s=0.01, disk=disk)
    with pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            await started(j, nursery)
            for i in range(1, 60):
                await j.wait_durable(j.append(payload(i)))
            disk.fsync_errno = errno.ENOSPC
            with pytest.raises(JournalWriteError, match="No space left"):
                for i in range(60, 200):
                    await j.wait_durable(j.append(payload(i)))
    assert info.group_contains(JournalWriteError)
    assert j.refusing is None and j.failed is not None


async def test_closing_while_stalled_drops_only_unacknowledged_records(tmp_path):
    disk = FaultyDisk()
    j = Journal(tmp_path, mode="fsync", next_lsn=1, space_poll_s=0.01, disk=disk)
    got = []

    async def writer(lsn):
        try:
            await j.wait_durable(lsn)
            got.append("ok")
        except JournalClosedError as exc:
            got.append(exc.code)

    async with trio.open_nursery() as nursery:
        await started(j, nursery)
        await j.wait_durable(j.append(payload(1)))
        disk.free = 20
        nursery.start_soon(writer, j.append(payload(2)))
        assert await j.wait_refusing() == "stalled"
        await j.aclose()  # one more try, then gives up: no exception
    assert got == ["UNAVAILABLE"]
    assert read_manifest(tmp_path).clean_end_lsn is None  # not a clean end
    res = scan_journal(tmp_path, 0)  # the partial record is a torn tail: cut
    assert res.next_lsn == 2 and res.torn_tail is not None
    assert [lsn for lsn, _ in res] == [1]


# ------------------------------------------------------------------ node
@asynccontextmanager
async def faulty_node(d: Path, disk: FaultyDisk, **kw):
    kw.setdefault("min_free_bytes", 100_000)
    kw.setdefault("space_poll_s", 0.01)
    async with open_node(str(d), "fsync", disk=disk, **kw) as node:
        transport = EmbeddedTransport(node.service)
        rs = Client(transport)
        rs.node = node
        try:
            yield rs
        finally:
            await transport.aclose()


def entity_dump(coord) -> dict:
    enc = msgspec.msgpack.Encoder()
    return {eid: enc.encode(ent) for table, _ in coord.entity_tables().values() for eid, ent in table.items()}


async def fill_disk(rs, disk: FaultyDisk, free: int) -> None:
    """Leave ``free`` bytes; a write (that still fits) lets the journal notice."""
    disk.free = free
    await rs.scopes.create(name="trips-the-check")
    await rs.node.coordinator.journal.wait_refusing()


async def test_node_refuses_writes_before_applying_serves_reads_and_resumes(tmp_path):
    disk = FaultyDisk()
    async with faulty_node(tmp_path, disk) as rs:
        coord = rs.node.coordinator
        run = await rs.scopes.create(name="work")
        jobs = await rs.mailboxes.ensure("jobs")
        ticket = await jobs.submit({"n": 1}, scope=run)
        await fill_disk(rs, disk, 50_000)
        before = entity_dump(coord)
        lsn = coord.journal.last_lsn
        for write in (lambda: rs.scopes.create(name="refused"),
                      lambda: jobs.submit({"n": 2}, scope=run),
                      lambda: run.cancel(),
                      lambda: jobs.receive(run, wait=0)):
            with pytest.raises(UnavailableError) as ei:
                await write()
            assert ei.value.message.startswith("disk full at ") and ei.value.retry_after >= 1
        assert entity_dump(coord) == before and coord.journal.last_lsn == lsn  # nothing applied
        # Reads are answered.
        assert (await run.status()).name == "work"
        assert (await rs.task(ticket.id).status()).state == "QUEUED"
        assert (await rs.status()).last_lsn == lsn
        # Space comes back: writes resume by themselves, and the refused receive did not
        # lose the queued task.
        disk.free = BIG
        await coord.journal.wait_writable()
        got = await jobs.receive(run, wait=0)
        assert got is not None and got.task_id == ticket.id
        await rs.scopes.create(name="after")


async def test_a_write_stalled_on_enospc_after_apply_is_never_acknowledged(tmp_path):
    # No reserve, no ballast: the write is applied in memory, then its journal write
    # fails. Its caller waits; nothing reveals it; closing drops it; recovery lacks it.
    disk = FaultyDisk()
    outcome = []
    async with faulty_node(tmp_path / "d", disk, min_free_bytes=0) as rs:
        coord = rs.node.coordinator
        kept = await rs.scopes.create(name="kept")

        async def create():
            try:
                run = await rs.scopes.create(name="stalled")
                outcome.append(run.id)
            except UnavailableError as exc:
                outcome.append(exc.code)

        disk.free = 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(create)
            assert await coord.journal.wait_refusing() == "stalled"
            await trio.testing.wait_all_tasks_blocked()
            assert outcome == []  # not acknowledged
            with pytest.raises(UnavailableError, match="disk full"):
                await rs.scopes.create(name="refused")
            # A read that would see the stalled run waits too (it is not durable).
            listed = []

            async def read():
                listed.append(await rs.scopes.list(None))

            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert listed == []
            nursery.cancel_scope.cancel()
    assert outcome == [] or outcome == ["UNAVAILABLE"]
    rec = recover(tmp_path / "d")
    names = set()
    from rallypoint.actors import Coordinator
    from rallypoint.node import load_entities

    c = Coordinator(durability="fsync")
    load_entities(c, rec.entities)
    for _, payload_ in rec.records:
        c.replay(payload_)
    names = {s.name for s in c.runs.table.values()}
    rec.store.close()
    assert "kept" in names and "stalled" not in names and "refused" not in names
    assert kept.id in c.runs.table


async def test_a_stalled_write_is_acknowledged_once_space_frees(tmp_path):
    disk = FaultyDisk()
    async with faulty_node(tmp_path, disk, min_free_bytes=0) as rs:
        coord = rs.node.coordinator
        disk.free = 0
        result = []

        async def create():
            result.append(await rs.scopes.create(name="late"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(create)
            await coord.journal.wait_refusing()
            await trio.testing.wait_all_tasks_blocked()
            assert result == []
            disk.free = BIG
        assert (await result[0].status()).name == "late"
        assert coord.journal.durable_lsn == coord.journal.last_lsn
    async with rallypoint.open_embedded(str(tmp_path)) as rs:
        assert (await rs.scope(result[0].id).status()).name == "late"


async def test_a_refused_activity_is_retried_as_soon_as_space_frees(tmp_path):
    """An activity refused for a full disk (a timer falling due) is held and tried again
    at the refusal's retry_after -- or at once when the journal accepts writes again,
    whichever is first (a deadline in a full-disk window fires as the window ends, not
    up to a second later: the simulator's seed 4333 saw a run's deadline fire late).
    It is applied once."""
    from conftest import until

    disk = FaultyDisk()
    async with faulty_node(tmp_path, disk) as rs:
        coord = rs.node.coordinator
        journal = coord.journal
        refusal = journal._refusal_error

        def an_hour():  # the timed retry out of the way: only the journal's word can fire it
            err = refusal()
            err.retry_after = 3600.0
            return err

        journal._refusal_error = an_hour
        run = await rs.scopes.create(name="t")
        timer = await run.timers.create(after_seconds=7200)
        t = coord.timers.table[timer.id]
        await fill_disk(rs, disk, 50_000)
        heap = coord.heap
        now = trio.current_time()
        heap.arm(now, coord.timers._on_fire, timer.id)  # the timer falls due while the disk is full
        heap.fire_due()
        assert t.state == "ARMED"  # refused, nothing applied
        (token,) = [k for k, (fn, arg, _) in heap._held.items() if fn == coord.timers._on_fire and arg == timer.id]
        timed = [e[0] for e in heap.entries() if e[3] == heap._retry_held and e[4] == token]
        assert len(timed) == 1 and timed[0] >= now + 3600  # the refusal's retry_after
        disk.free = BIG
        await journal.wait_writable()
        await until(lambda: t.state == "FIRED")  # the journal told the heap as the refusal lifted
        assert token not in heap._held and trio.current_time() < now + 3600
        lsn = journal.last_lsn
        heap._retry_held(token)  # the timed retry, when it comes, finds nothing to do
        assert journal.last_lsn == lsn and t.state == "FIRED"


# ------------------------------------------------------------------ snapshots
class FlakyStore:
    """Wraps a SnapshotStore: the next ``fail`` writes (whole, or streamed: at the
    commit) raise like LMDB on a full disk; with ``break_env`` the failure also leaves
    the environment unusable (as LMDB's MDB_PANIC does after a failed meta-page write),
    so only a reopen helps."""

    def __init__(self, store, fail: int, *, break_env: bool = False) -> None:
        self._store = store
        self.fail = fail

        def failing() -> bool:
            if self.fail > 0:
                self.fail -= 1
                if break_env:
                    store._env.close()
                return True
            return False

        def write_txn(lsn, puts, deletes, events=None):
            if failing():
                raise lmdb.DiskError("mdb_txn_commit: No space left on device")
            return type(store)._write_txn(store, lsn, puts, deletes, events)

        def stream_txn(q):
            if self.fail <= 0:
                return type(store)._stream_txn(store, q)
            item = q.get()
            while type(item) is not tuple and item is not snapshot_mod._ABORT:  # every batch, up to the end
                item = q.get()
            failing()
            raise lmdb.DiskError("mdb_txn_commit: No space left on device")

        store._write_txn = write_txn
        store._stream_txn = stream_txn


async def test_a_failed_snapshot_changes_nothing_and_the_next_one_succeeds(tmp_path):
    disk = FaultyDisk()
    async with faulty_node(tmp_path, disk, snapshot_every_records=10**9, snapshot_every_s=3600) as rs:
        coord = rs.node.coordinator
        snap = rs.node.snapshotter
        for i in range(5):
            await rs.scopes.create(name=f"r{i}")
        FlakyStore(snap.store, fail=1, break_env=True)
        dirty = set(coord.dirty_ids())
        segments = list_segments(tmp_path)
        with pytest.raises(lmdb.Error):
            await snap.snapshot()
        assert set(coord.dirty_ids()) >= dirty
        assert list_segments(tmp_path) == segments  # no segment deleted
        lsn = await snap.snapshot()  # the store was reopened; this one goes through
        assert lsn == coord.journal.last_lsn and snap.store.load_lsn() == lsn


async def test_the_snapshotter_survives_failures_and_skips_while_full(tmp_path, caplog):
    disk = FaultyDisk()
    async with faulty_node(tmp_path, disk, snapshot_every_records=1, snapshot_retry_s=0.0) as rs:
        coord = rs.node.coordinator
        snap = rs.node.snapshotter
        snap.POLL_S = 0.01
        FlakyStore(snap.store, fail=2)
        await rs.scopes.create(name="a")
        await snap.wait_attempts(snap.attempts + 3)
        assert snap.failures == 2 and "No space left" in snap.last_error
        assert snap.snapshots >= 1 and snap.store.load_lsn() == coord.journal.last_lsn  # third try
        # While the journal refuses writes, no snapshot is attempted.
        await fill_disk(rs, disk, 50_000)
        n, skipped = snap.snapshots, snap.skipped
        await snap.wait_attempts(snap.attempts + 2)
        assert snap.snapshots == n and snap.skipped >= skipped + 1
        disk.free = BIG
        await coord.journal.wait_writable()
        await rs.scopes.create(name="b")
        target = coord.journal.last_lsn
        while snap.store.load_lsn() < target:  # one attempt or two (a snapshot may precede "b")
            await snap.wait_attempts(snap.attempts + 1)
        assert snap.store.load_lsn() == target
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "snapshot to" in text and "nothing is lost" in text


async def test_shutdown_on_a_full_disk_is_clean_and_the_journal_replays(tmp_path, caplog):
    disk = FaultyDisk()
    async with faulty_node(tmp_path, disk) as rs:
        run = await rs.scopes.create(name="before")
        await fill_disk(rs, disk, 50_000)
    assert "no snapshot at shutdown: the disk is full" in caplog.text
    async with rallypoint.open_embedded(str(tmp_path)) as rs:
        assert (await rs.scope(run.id).status()).name == "before"
        assert rs.node.recovery_info["replayed"] >= 2


# ------------------------------------------------------------------ fail-stop daemon
_EIO_DAEMON = """
import errno, os, sys
real = os.fdatasync
def fdatasync(fd):
    if os.path.exists(sys.argv[1]):
        raise OSError(errno.EIO, "Input/output error")
    return real(fd)
os.fdatasync = fdatasync
from rallypoint.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _helper_pids(pid: int) -> list[int]:
    """The daemon's child processes (its sync helper)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


@pytest.mark.parametrize("how", ["eio-in-thread", "helper-killed"])
def test_a_failed_fsync_stops_the_daemon_with_one_line_and_clients_get_unavailable(tmp_path, how):
    """An fsync that fails (EIO, with ``--sync-helper thread`` where the daemon's own
    ``os.fdatasync`` is the broken one) or cannot be done any more (the sync helper
    process was killed) stops the daemon: one line, exit 1, clients told UNAVAILABLE."""
    import signal
    import subprocess
    import sys

    from rallypoint.sync import connect

    marker = tmp_path / "break-the-disk"
    extra = ["--sync-helper", "thread"] if how == "eio-in-thread" else []
    proc = subprocess.Popen(
        [sys.executable, "-c", _EIO_DAEMON, str(marker), "serve", "--listen", "127.0.0.1:0",
         "--data-dir", str(tmp_path / "d"), "--min-free-mb", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("READY "):
                url = line.split()[1]
                break
        assert url, proc.stderr.read()
        with connect(url, reconnect=False) as rs:
            run = rs.scopes.create(name="before")
            helpers = _helper_pids(proc.pid)
            if how == "eio-in-thread":
                assert helpers == []  # no helper process with --sync-helper thread
                marker.touch()
                expect = "fail-stop"
            else:
                assert len(helpers) == 1
                os.kill(helpers[0], signal.SIGKILL)
                # the helper's end is seen at once: if the daemon stopped before the
                # request reached it, the client sees its connection closed instead
                expect = "fail-stop|connection"
            with pytest.raises(UnavailableError, match=expect):
                rs.scopes.create(name="lost")
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert code == 1, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rallypoint: stopped: journal write/fsync failed at "), err
    if how == "helper-killed":  # the disk is fine: the message does not send the operator there
        assert "sync helper process" in last and "killed by signal 9 (SIGKILL)" in last, last
        assert "Check why the sync helper ended" in last and "Check the disk" not in last, last
    else:
        assert "Check the disk, then restart" in last
    del run


async def test_a_snapshot_that_fails_at_shutdown_is_one_line_and_the_journal_replays(tmp_path, caplog):
    disk = FaultyDisk()
    async with faulty_node(tmp_path, disk) as rs:
        run = await rs.scopes.create(name="kept")
        FlakyStore(rs.node.snapshotter.store, fail=1)
    assert "snapshot at shutdown failed (DiskError: mdb_txn_commit: No space left on device)" in caplog.text
    async with rallypoint.open_embedded(str(tmp_path)) as rs:
        assert (await rs.scope(run.id).status()).name == "kept"
        assert rs.node.recovery_info["replayed"] >= 1


async def test_a_snapshot_stops_waiting_for_the_journal_when_it_starts_refusing():
    from rallypoint.node import _synced_unless_refused

    class Stuck:
        async def wait_synced(self, lsn):
            await trio.sleep_forever()  # a stalled write: lsn never becomes durable

        async def wait_refusing(self):
            await trio.lowlevel.checkpoint()
            return "stalled"

    assert await _synced_unless_refused(Stuck(), 7) is False


async def test_an_entity_that_does_not_decode_is_a_corrupt_snapshot(tmp_path):
    from rallypoint.persistence import SnapshotCorruptError, SnapshotStore

    async with rallypoint.open_embedded(str(tmp_path)) as rs:
        run = await rs.scopes.create(name="x")
    store = SnapshotStore(tmp_path)
    store.write_sync(store.load_lsn(), [(run.id.encode(), b"\xc1 not msgpack")], [])
    store.close()
    with pytest.raises(SnapshotCorruptError, match="does not decode"):
        async with rallypoint.open_embedded(str(tmp_path)):
            pass


async def test_a_stalls_lease_extension_refused_for_a_full_disk_is_owed_and_journaled_first(tmp_path):
    """A stall's lease extension that the journal refuses (a full disk) is not lost and
    does not escape the batch's start: it is owed, and journaled first thing when writes
    are accepted again, before the expiries held meanwhile are tried (they are then
    stale). It used to raise out of the batch's start -- the extension lost and, in the
    activity heap's task, that task ended: a claim stayed HELD seconds past its lease
    (the simulator's seed 12915)."""
    disk = FaultyDisk()
    async with faulty_node(tmp_path, disk) as rs:
        coord = rs.node.coordinator
        run = await rs.scopes.create(name="s")
        lease = await run.claims.acquire("k", lease_seconds=30, holder="w1")
        c = next(c for c in coord.claims.table.values() if c.state == "HELD")
        expires = c.lease_expires_ms
        await fill_disk(rs, disk, 50_000)
        coord._on_stall(6.0)  # refused: owed, not raised
        assert coord._stall_owed_ms == 6000 and c.lease_expires_ms == expires
        disk.free = BIG
        await coord.journal.wait_writable()
        assert coord._stall_owed_ms == 0 and c.lease_expires_ms == expires + 6000
        assert (await lease.status()).state == "HELD"
    async with rallypoint.open_embedded(str(tmp_path)) as rs:  # the extension was journaled
        c = next(c for c in rs.node.coordinator.claims.table.values() if c.key == "k")
        assert c.lease_expires_ms >= expires + 6000
