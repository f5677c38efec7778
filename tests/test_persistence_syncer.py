"""The journal's sync helper: a process (default) or a thread doing the fdatasyncs.

What it must do: answer in order, coalesce the requests waiting for it into one call,
report the call's errno, survive the signals a process group gets, die with the daemon,
and make the journal fail-stop when it is gone."""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
import trio
import trio.testing

from rallypoint.persistence import Disk, Journal, JournalWriteError
from rallypoint.persistence.journal import HEADER_SIZE, list_segments, read_journal
from rallypoint.persistence.syncer import SyncHelperGone, Syncer


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


class _BlockingDisk(Disk):
    """A Disk whose ``nth`` fdatasync waits for ``go`` (at most ``timeout`` seconds);
    ``n`` counts the calls."""

    def __init__(self, nth: int, go: threading.Event, timeout: float) -> None:
        self.n = 0
        self._nth, self._go, self._timeout = nth, go, timeout

    def fdatasync(self, fd) -> None:
        self.n += 1
        if self.n == self._nth:
            self._go.wait(self._timeout)
        os.fdatasync(fd)


@pytest.fixture
def datafile(tmp_path):
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o644)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("kind", ["process", "thread", "inline"])
async def test_a_request_is_answered_with_its_id(kind, datafile):
    s = await Syncer.start(kind)
    try:
        key = s.register(datafile)
        os.write(datafile, b"x" * 5000)
        rid = s.request(key)
        got, seconds = await s.next_answer()
        assert got == rid and 0 <= seconds < 5
        assert (s.pid is not None) == (kind == "process")
    finally:
        await s.aclose()


async def test_requests_waiting_for_the_helper_are_done_by_one_call(datafile):
    calls = []
    go = threading.Event()

    def slow_fdatasync(fd):
        calls.append(fd)
        if len(calls) == 1:
            go.wait(5)  # the first call blocks: the next requests queue up meanwhile
        os.fdatasync(fd)

    s = await Syncer.start("thread", slow_fdatasync)
    try:
        key = s.register(datafile)
        first = s.request(key)
        while not calls:
            await trio.sleep(0.001)
        later = [s.request(key) for _ in range(3)]  # in the helper's socket when request() returns
        go.set()
        assert (await s.next_answer())[0] == first
        assert (await s.next_answer())[0] == later[-1]  # one answer, for the last of them
        assert len(calls) == 2
    finally:
        await s.aclose()


@pytest.mark.parametrize("kind", ["process", "inline"])
async def test_a_failed_call_answers_its_errno(kind):
    s = await Syncer.start(kind)
    r, w = os.pipe()
    try:
        key = s.register(r)  # fdatasync on a pipe: EINVAL
        s.request(key)
        with pytest.raises(OSError) as info:
            await s.next_answer()
        assert info.value.errno == errno.EINVAL
        s.request(key + 100)  # a key never registered
        with pytest.raises(OSError) as info:
            await s.next_answer()
        assert info.value.errno == errno.EBADF
    finally:
        os.close(r)
        os.close(w)
        await s.aclose()


async def test_unregister_closes_the_helpers_copy(datafile):
    s = await Syncer.start("process")
    try:
        s.request(999)  # an answer (EBADF: no such key) means its loop runs: start-up is over
        with pytest.raises(OSError):
            await s.next_answer()
        before = len(os.listdir(f"/proc/{s.pid}/fd"))
        key = s.register(datafile)
        s.request(key)
        await s.next_answer()
        assert len(os.listdir(f"/proc/{s.pid}/fd")) == before + 1
        s.unregister(key)
        s.request(key)
        with pytest.raises(OSError) as info:
            await s.next_answer()
        assert info.value.errno == errno.EBADF
        assert len(os.listdir(f"/proc/{s.pid}/fd")) == before
    finally:
        await s.aclose()


async def test_the_helper_process_ignores_a_process_groups_signals(datafile):
    s = await Syncer.start("process")
    try:
        assert os.getpgid(s.pid) != os.getpgid(0)  # a signal to our group does not reach it
        key = s.register(datafile)
        s.request(key)
        await s.next_answer()  # it runs (its handlers are set)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            os.kill(s.pid, sig)
        await trio.sleep(0.1)
        rid = s.request(key)
        assert (await s.next_answer())[0] == rid
    finally:
        await s.aclose()
    assert not _alive(s.pid)  # aclose: EOF, it exited and was reaped


async def test_a_killed_helper_is_reported_as_gone(datafile):
    s = await Syncer.start("process")
    try:
        key = s.register(datafile)
        os.kill(s.pid, signal.SIGKILL)  # reaped or not yet when the loop sees it: the same words
        with pytest.raises(SyncHelperGone, match=r"sync helper process \(pid \d+, killed by signal 9 \(SIGKILL\)\)"):
            s.request(key)
            await s.next_answer()
    finally:
        await s.aclose()


def test_a_helper_whose_socket_closed_before_it_was_reaped_is_reported_as_killed():
    """The kernel closes a killed helper's socket before the process can be reaped: the
    loop may read the EOF while ``poll()`` still says "running". The report waits for
    the reap and says how it ended (a busy machine made that window long enough to
    change the daemon's last line)."""
    import socket

    class Dying:  # a process seen exiting: reaped only on the third look
        pid = 4242

        def __init__(self) -> None:
            self.looks = 0

        def poll(self):
            self.looks += 1
            return None if self.looks < 3 else -signal.SIGKILL

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    theirs.close()  # the helper's end, closed by its exit
    proc = Dying()
    s = Syncer("process", ours, proc, None)
    try:
        with pytest.raises(SyncHelperGone) as info:
            s.poll_answer()
        assert "(pid 4242, killed by signal 9 (SIGKILL)): it closed its socket" in str(info.value), info.value
        assert proc.looks == 3
    finally:
        ours.close()


def test_a_helper_that_stopped_reading_is_not_waited_for():
    """A helper that only stopped reading (its socket is full, not closed) is alive:
    reported as still running, at once."""
    import socket

    class Stuck:
        pid = 4243
        looks = 0

        def poll(self):
            self.looks += 1
            return None

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    proc = Stuck()
    s = Syncer("process", ours, proc, None)
    try:
        with pytest.raises(SyncHelperGone, match=r"pid 4243, still running\): a request could not be sent"):
            for _ in range(100_000):  # until its socket buffer is full
                s.request(1)
        assert proc.looks == 1
    finally:
        ours.close()
        theirs.close()


_DIES = """
import os, signal, sys, trio
from rallypoint.persistence.syncer import Syncer
async def main():
    s = await Syncer.start("process")
    print(s.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
trio.run(main)
"""


def test_the_helper_process_does_not_outlive_a_killed_parent():
    p = subprocess.run([sys.executable, "-c", _DIES], capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr
    pid = int(p.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(pid)


# ------------------------------------------------------------------ the journal's use
async def test_the_journal_syncs_through_a_helper_process_by_default(tmp_path):
    j = Journal(tmp_path, mode="fsync", next_lsn=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        await j.wait_durable(j.append(b"a"))
        assert j._syncer.kind == "process" and j._syncer.pid in _children(os.getpid())
        pid = j._syncer.pid
        assert j.sync_helper == f"process {pid}"
        await j.aclose()
    assert not _alive(pid)
    assert j.sync_helper == ""  # stopped: none running
    assert j.stats()["fsyncs"] >= 1


async def test_sync_thread_and_a_disk_with_its_own_fdatasync_get_the_thread(tmp_path):
    class Counting(Disk):
        calls = 0

        def fdatasync(self, fd) -> None:
            Counting.calls += 1
            os.fdatasync(fd)

    for d, kwargs in ((tmp_path / "a", {"sync": "thread"}), (tmp_path / "b", {"disk": Counting()})):
        j = Journal(d, mode="fsync", next_lsn=1, **kwargs)
        async with trio.open_nursery() as nursery:
            await nursery.start(j.run)
            await j.wait_durable(j.append(b"a"))
            assert j._syncer.kind == "thread" and j._syncer.pid is None and j.sync_helper == "thread"
            await j.aclose()
    assert Counting.calls >= 1
    with pytest.raises(ValueError, match="sync must be one of"):
        Journal(tmp_path / "c", mode="fsync", next_lsn=1, sync="fork")


async def test_inline_the_loop_itself_fdatasyncs_before_the_ack(tmp_path):
    """``sync="inline"``: the fdatasync is the event loop's own call (its thread, a
    Disk's method included), made after the record was written and before
    ``wait_durable`` returns; its answer is taken in the same step (no other task or
    process woken); no helper process runs."""
    calls = []

    class Recording(Disk):
        def fdatasync(self, fd):
            calls.append((threading.get_ident(), os.lseek(fd, 0, os.SEEK_CUR)))
            os.fdatasync(fd)

    j = Journal(tmp_path, mode="fsync", next_lsn=1, preallocate_bytes=0, sync="inline", disk=Recording())
    before = set(_children(os.getpid()))  # (a test worker may have children of its own)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        assert j.sync_helper == "inline" and j._syncer.pid is None
        assert set(_children(os.getpid())) <= before  # no helper process started
        lsn = j.append(b"x" * 100)
        j.write_now()  # the batch's end: written, synced, the answer taken in -- in this step
        assert j.durable_lsn == lsn and calls
        tid, synced_upto = calls[-1]
        assert tid == threading.get_ident() and synced_upto == j._wpos
        await j.wait_durable(j.append(b"y"))  # and through the flusher's round
        assert calls[-1][1] == j._wpos
        await j.aclose()
    assert j.sync_helper == "" and j.stats()["fsyncs"] >= 2


async def test_inline_across_segment_rolls_keeps_every_record(tmp_path):
    """Rolls wait for the old segment's fsync and hand the new segment to the syncer
    (register/unregister): inline, every record of 4 KiB segments is durable when
    acknowledged and read back in order; the inline helper's copies of the descriptors
    are closed when the journal closes."""
    j = Journal(tmp_path, mode="fsync", next_lsn=1, segment_bytes=4096, sync="inline")
    fds_before = len(os.listdir("/proc/self/fd"))
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        for i in range(300):
            lsn = j.append(b"%04d" % i + b"x" * 96)
            if i % 7 == 0:
                await j.wait_durable(lsn)
        await j.wait_durable(lsn)
        assert j.durable_lsn == 300 and len(list_segments(tmp_path)) >= 5
        await j.aclose()
    assert [p[:4] for _, p in read_journal(tmp_path)] == [b"%04d" % i for i in range(300)]
    assert len(os.listdir("/proc/self/fd")) <= fds_before


async def test_a_failed_inline_fdatasync_stops_the_journal(tmp_path):
    fail = []

    class FailingDisk(Disk):
        def fdatasync(self, fd):
            if fail:
                raise OSError(errno.EIO, "I/O error")
            os.fdatasync(fd)

    j = Journal(tmp_path, mode="fsync", next_lsn=1, preallocate_bytes=0, sync="inline", disk=FailingDisk())
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        await j.wait_durable(j.append(b"a"))
        fail.append(1)
        lsn = j.append(b"b")
        j.write_now()  # the EIO answer, taken in here: fail-stop, nothing acknowledged
        assert isinstance(j._error, JournalWriteError)
        with pytest.raises(JournalWriteError):
            await j.wait_durable(lsn)
        assert j.durable_lsn == lsn - 1
        nursery.cancel_scope.cancel()


async def test_the_flusher_asks_again_before_the_previous_answer(tmp_path):
    go = threading.Event()
    slow = _BlockingDisk(2, go, 5)
    j = Journal(tmp_path, mode="fsync", next_lsn=1, disk=slow)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        await j.wait_durable(j.append(b"a"))
        j.append(b"b")  # its fdatasync blocks in the helper
        while slow.n < 2:
            await trio.sleep(0.001)
        j.append(b"c")  # written and asked for while b's is not answered
        await trio.testing.wait_all_tasks_blocked()
        assert len(j._outstanding) == 2 and j.durable_lsn == 1
        go.set()
        await j.wait_durable(3)
        await j.aclose()


async def test_a_helper_that_dies_stops_the_journal(tmp_path):
    j = Journal(tmp_path, mode="fsync", next_lsn=1)
    with pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            await nursery.start(j.run)
            await j.wait_durable(j.append(b"a"))
            os.kill(j._syncer.pid, signal.SIGKILL)  # seen before or after its reap: the same words
            with pytest.raises(JournalWriteError, match="sync helper process .* killed by signal 9"):
                await j.wait_durable(j.append(b"b"))
    assert info.group_contains(JournalWriteError)
    assert j.durable_lsn == 1
    with pytest.raises(JournalWriteError):
        j.append(b"c")


# ------------------------------------------------------------------ the batch-end write
async def test_write_now_writes_and_asks_for_the_sync_in_the_callers_step(tmp_path):
    j = Journal(tmp_path, mode="fsync", next_lsn=1, preallocate_bytes=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        await j.wait_durable(j.append(b"a" * 100))
        (_, path), = list_segments(tmp_path)
        size = path.stat().st_size
        lsn = j.append(b"b" * 100)
        j.write_now()  # no checkpoint between: the flusher task has not run
        assert path.stat().st_size == size + HEADER_SIZE + 100
        # asked for in this step (its answer may even be polled in it already: the
        # helper is another process, and write_now takes an answer that is there)
        assert j._requested_lsn == lsn and j.durable_lsn in (lsn - 1, lsn)
        await j.wait_durable(lsn)
        await j.aclose()
    assert [r for _, r in read_journal(tmp_path, 0)] == [b"a" * 100, b"b" * 100]


async def test_poll_answer_takes_an_answer_already_there_and_never_blocks(datafile):
    s = await Syncer.start("process")
    try:
        key = s.register(datafile)
        assert s.poll_answer() is None  # nothing asked: None at once, no wait
        rid = s.request(key)
        select.select([s._sock], [], [], 5)  # the answer is in the socket (no checkpoint)
        got, seconds = s.poll_answer()
        assert got == rid and 0 <= seconds < 5
        assert s.poll_answer() is None
    finally:
        await s.aclose()


async def test_write_now_takes_in_the_answers_that_came_during_the_step(tmp_path):
    """An fsync that ended while an actor's step ran is seen at the step's end
    (``write_now`` polls the helper's socket): the records are durable, and their
    replies can go, without waiting for the answers task's turn in the scheduler."""
    j = Journal(tmp_path, mode="fsync", next_lsn=1, preallocate_bytes=0)
    heard = []
    j.add_durable_listener(lambda lsn, err: heard.append(lsn))
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        await j.wait_durable(j.append(b"a" * 100))
        lsn = j.append(b"b" * 100)
        j.write_now()  # written, its sync asked for
        select.select([j._syncer._sock], [], [], 5)  # answered; no checkpoint since
        assert j.durable_lsn == lsn - 1
        j.write_now()  # the next step's end: nothing to write, the answer taken in
        assert j.durable_lsn == lsn and heard[-1] == lsn
        await j.aclose()
    assert [r for _, r in read_journal(tmp_path, 0)] == [b"a" * 100, b"b" * 100]


async def test_a_failed_sync_seen_by_write_now_stops_the_journal(tmp_path):
    fail = []

    class FailingDisk(Disk):
        def fdatasync(self, fd):
            if fail:
                raise OSError(errno.EIO, "I/O error")
            os.fdatasync(fd)

    disk = FailingDisk()
    j = Journal(tmp_path, mode="fsync", next_lsn=1, preallocate_bytes=0, disk=disk)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        assert j.sync_helper == "thread"  # a Disk of its own: the helper thread calls it
        await j.wait_durable(j.append(b"a"))
        fail.append(1)
        lsn = j.append(b"b")
        j.write_now()
        select.select([j._syncer._sock], [], [], 5)
        j.write_now()  # the EIO answer, taken in here: fail-stop, nothing acknowledged
        assert isinstance(j._error, JournalWriteError)  # (no checkpoint since)
        with pytest.raises(JournalWriteError):
            await j.wait_durable(lsn)
        assert j.durable_lsn == lsn - 1
        nursery.cancel_scope.cancel()


async def test_write_now_on_a_full_disk_leaves_the_rest_to_the_flusher(tmp_path):
    from test_persistence_diskfull import FaultyDisk

    disk = FaultyDisk()
    j = Journal(tmp_path, mode="fsync", next_lsn=1, space_poll_s=0.01, preallocate_bytes=0, disk=disk)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        await j.wait_durable(j.append(b"a" * 100))
        disk.free = 40  # a short write, then ENOSPC
        lsn = j.append(b"b" * 100)
        j.write_now()
        assert await j.wait_refusing() == "stalled"
        assert j.durable_lsn == 1
        disk.free = 1 << 40
        await j.wait_durable(lsn)  # the flusher went on from where write_now stopped
        await j.aclose()
    assert [r for _, r in read_journal(tmp_path, 0)] == [b"a" * 100, b"b" * 100]


async def test_durable_listeners_hear_each_advance_and_the_stop(tmp_path):
    heard = []
    j = Journal(tmp_path, mode="fsync", next_lsn=1)
    j.add_durable_listener(lambda lsn, err: heard.append((lsn, type(err).__name__ if err else None)))
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        await j.wait_durable(j.append(b"a"))
        j.append(b"b")
        await j.wait_durable(j.append(b"c"))
        await j.aclose()
    assert [lsn for lsn, err in heard if err is None] in ([1, 3], [1, 2, 3])
    assert heard[-1] == (3, "JournalClosedError")


async def test_durable_listeners_hear_a_failure(tmp_path):
    heard = []
    j = Journal(tmp_path, mode="fsync", next_lsn=1)
    j.add_durable_listener(lambda lsn, err: heard.append((lsn, err)))
    with pytest.raises(BaseExceptionGroup):
        async with trio.open_nursery() as nursery:
            await nursery.start(j.run)
            await j.wait_durable(j.append(b"a"))
            os.kill(j._syncer.pid, signal.SIGKILL)
            j.append(b"b")
            j.write_now()
            with pytest.raises(JournalWriteError):
                await j.wait_durable(2)
    assert heard[0] == (1, None)
    assert heard[-1][0] == 1 and isinstance(heard[-1][1], JournalWriteError)


async def test_the_coordinator_writes_a_batchs_commits_at_its_end(tmp_path):
    """After an actor's batch the coordinator hands the journal its commits
    (``write_now``): a commit needs no flusher round to reach the file and the helper."""
    import rallypoint

    async with rallypoint.open_embedded(str(tmp_path)) as rs:
        journal = rs.node.coordinator.journal
        wrote = []
        real = journal.write_now

        def write_now():
            before = journal.statistics().buffered_bytes
            real()
            wrote.append(before - journal.statistics().buffered_bytes)

        journal.write_now = write_now
        run = await rs.scopes.create(name="written-at-batch-end")
        assert (await run.status()).name == "written-at-batch-end"
        assert any(n > 0 for n in wrote)  # the batch's commit, written at its end
        assert journal.durable_lsn == journal.last_lsn


_FORKS = """
import os, signal, sys, time, trio
from rallypoint.persistence.syncer import Syncer
async def main():
    s = await Syncer.start("process")
    print(s.pid, flush=True)
    if os.fork() == 0:  # a plain fork (multiprocessing's default): lives on for a while
        time.sleep(20)
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL)
trio.run(main)
"""


def test_a_forked_child_does_not_keep_the_helper_alive():
    """A child made by fork() closes its copy of the helper's socket at once, so the
    helper still ends when its daemon is killed (found by a new-user review: an
    embedding program that forked kept the helper, and the segment, open)."""
    p = subprocess.Popen([sys.executable, "-c", _FORKS], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pid = int(p.stdout.readline())
        p.wait(30)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(pid)
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the forked child too
        p.wait()


async def test_open_embedded_takes_the_sync_helper_kind(tmp_path):
    import rallypoint
    from rallypoint.errors import ValidationError

    async with rallypoint.open_embedded(str(tmp_path / "t"), sync_helper="thread") as rs:
        await rs.scopes.create(name="via-thread")
        assert rs.node.coordinator.journal._syncer.kind == "thread"
    async with rallypoint.open_embedded(str(tmp_path / "p")) as rs:
        await rs.scopes.create(name="via-process")
        assert rs.node.coordinator.journal._syncer.kind == "process"
    with pytest.raises(ValidationError, match="sync_helper must be one of process, thread"):
        async with rallypoint.open_embedded(str(tmp_path / "x"), sync_helper="fork"):
            pass


@pytest.mark.parametrize("mode", ["process", "thread", "inline"])
def test_status_says_where_the_fsync_runs(tmp_path, mode):
    """``rallypoint status`` names the sync helper (its pid: the daemon's child) or the
    thread, with the fdatasync count and mean, so an operator sees which one a daemon
    really uses (a process that cannot start falls back to the thread)."""
    import json
    import re

    from conftest import Daemon

    from rallypoint.sync import connect

    d = Daemon(str(tmp_path / "d"), "fsync", ["--sync-helper", mode]).start()
    try:
        with connect(d.url) as rs:
            rs.scopes.create(name="synced")  # a write: acknowledged once fdatasync'd
        cli = [sys.executable, "-m", "rallypoint", "status", "--connect", d.url]
        out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        m = re.search(r"^fsync\s+in (.*); ([\d,]+) fdatasync calls?(, mean [\d.]+ ms)?$", out.stdout, re.M)
        assert m, out.stdout
        st = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True, timeout=60).stdout)
        if mode == "process":
            (pid,) = _children(d.proc.pid)
            assert m.group(1) == f"the sync helper process, pid {pid}" and st["sync_helper"] == f"process {pid}"
        elif mode == "inline":
            assert m.group(1) == "the event loop (inline)" and st["sync_helper"] == "inline"
            assert _children(d.proc.pid) == []
        else:
            assert m.group(1) == "a thread of the daemon" and st["sync_helper"] == "thread"
            assert _children(d.proc.pid) == []
        assert st["fsyncs"] >= 1 and st["fsync_seconds"] > 0 and m.group(3)
    finally:
        d.stop()


# ------------------------------------------------------------------ slow and stuck disks
async def test_a_stuck_fdatasync_is_reported_while_it_runs_and_when_it_returns(tmp_path, caplog):
    """An fdatasync that does not return is reported once it ran ten times
    ``slow_sync_s`` (with the records waiting for it), ``sync_pending_s`` grows while it
    runs, and its return is reported too; nothing is failed meanwhile."""
    import logging

    go = threading.Event()
    caplog.set_level(logging.WARNING, "rallypoint.persistence")
    j = Journal(tmp_path, mode="fsync", next_lsn=1, disk=_BlockingDisk(2, go, 60), slow_sync_s=0.02)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        await j.wait_durable(j.append(b"a"))
        assert j.sync_pending_s == 0.0
        j.append(b"b")  # its fdatasync does not return
        lsn = j.append(b"c")
        with trio.fail_after(30):
            while "has been running for" not in caplog.text:
                await trio.sleep(0.01)
        assert j.sync_pending_s >= 0.2 and j.durable_lsn == 1 and not j.statistics().failed
        assert "2 records not yet durable" in caplog.text, caplog.text
        assert "returned after" not in caplog.text
        go.set()
        await j.wait_durable(lsn)
        assert "the fdatasync reported running returned after" in caplog.text
        assert j.sync_pending_s == 0.0
        await j.aclose()


async def test_slow_fdatasyncs_are_logged_at_most_once_per_10_s_with_a_count(tmp_path, caplog):
    import logging

    class Slow(Disk):
        def fdatasync(self, fd) -> None:
            time.sleep(0.03)
            os.fdatasync(fd)

    caplog.set_level(logging.WARNING, "rallypoint.persistence")
    j = Journal(tmp_path, mode="fsync", next_lsn=1, disk=Slow(), slow_sync_s=0.02)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        for i in range(4):
            await j.wait_durable(j.append(b"x%d" % i))
        await j.aclose()
    slow = [r.getMessage() for r in caplog.records if "slow fdatasync" in r.getMessage()]
    assert len(slow) == 1 and "(1 of 0.02 s or more since the last warning)" in slow[0], slow
    assert j.stats()["fsyncs"] >= 4 and j._slow_syncs >= 3  # counted, for the next line
    with pytest.raises(ValueError, match="slow_sync_s"):
        Journal(tmp_path / "b", mode="fsync", next_lsn=1, slow_sync_s=0)


def test_a_stuck_disk_is_visible_and_a_second_sigterm_ends_the_daemon(tmp_path):
    """A real daemon whose sync helper is stopped (SIGSTOP: an fdatasync that does not
    return): writes wait, the metrics gauge shows how long, the log reports it; SIGTERM
    starts a drain that cannot finish (the final flush waits for the disk), and a second
    SIGTERM ends the daemon at once. Nothing acknowledged is lost: a restart has it."""
    import re
    import urllib.request

    from conftest import Daemon
    from rallypoint.errors import RallypointError
    from rallypoint.sync import connect

    data = str(tmp_path / "d")
    d = Daemon(data, "fsync", ["--slow-fsync-s", "0.05", "--metrics", "127.0.0.1:0", "--drain-timeout", "1"]).start()
    helper = None
    try:
        with connect(d.url) as rs:
            kept = rs.scopes.create(name="acknowledged").id
        (helper,) = _children(d.proc.pid)
        os.kill(helper, signal.SIGSTOP)
        outcome: list = []

        def write():
            try:
                with connect(d.url) as rs2:
                    outcome.append(rs2.scopes.create(name="waits"))
            except (RallypointError, OSError) as exc:
                outcome.append(exc)

        t = threading.Thread(target=write, daemon=True)
        t.start()
        pending = 0.0
        deadline = time.monotonic() + 30
        while pending < 0.5 and time.monotonic() < deadline:
            text = urllib.request.urlopen(d.metrics_url, timeout=10).read().decode()
            pending = float(re.search(r"^rallypoint_journal_sync_pending_seconds (\S+)$", text, re.M).group(1))
            time.sleep(0.05)
        assert pending >= 0.5, text
        assert outcome == []  # not acknowledged: the disk has not said it is durable
        d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            d.proc.wait(3)  # the drain's final flush waits for the stuck fdatasync
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == -signal.SIGTERM
        t.join(10)
        assert outcome and isinstance(outcome[0], (RallypointError, OSError)), outcome  # never acknowledged
    finally:
        d.kill()
        if helper is not None:
            os.kill(helper, signal.SIGCONT)  # it sees the daemon's end (EOF) and exits
    deadline = time.monotonic() + 10
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(helper)
    err = d.proc.stderr.read()  # (the helper shared the pipe: read once it is gone)
    assert "journal: an fdatasync of" in err and "has been running for" in err, err
    d2 = Daemon(data, "fsync").start()
    try:
        with connect(d2.url) as rs:
            assert rs.scope(kept).status().name == "acknowledged"
    finally:
        assert d2.stop() == 0
