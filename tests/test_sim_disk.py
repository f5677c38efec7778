"""The simulator's disk under the PRODUCTION journal (issue 28 item 4): the journal's
own flusher runs on a :class:`SimDisk` (seeded latencies on the virtual clock, short
writes, full-disk windows, crashes), and the fault points of :mod:`buggify` are off in
production and deterministic under a seed."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from rallypoint.persistence import buggify
from rallypoint.persistence.journal import Journal, scan_journal
from rallypoint.testing.disk import DiskFaults, SimDisk


def _journal(d, disk: SimDisk, mode: str = "fsync", **kw) -> Journal:
    f = disk.faults
    j = Journal(d, mode=mode, next_lsn=1, segment_bytes=f.segment_bytes, disk=disk, sync="thread",
                preallocate_bytes=f.preallocate_bytes, min_free_bytes=f.min_free_bytes,
                ballast_bytes=f.ballast_bytes, **kw)
    j.set_tap(lambda lsn, crc, payload: disk.note_append(j, lsn, payload))
    disk.start_incarnation()
    disk.note_segment(j._fd, 1)
    return j


def run(fn, *args):
    trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


def test_buggify_never_fires_unless_a_simulator_enables_it():
    assert not any(buggify.fires("journal.round.delay", 1.0) for _ in range(1000))
    assert buggify.delay() == 0.0

    def draws(seed):
        buggify.enable(random.Random(seed))
        try:
            return [buggify.fires(site, 0.5) for _ in range(200) for site in ("a", "b", "c", "d", "e", "f")]
        finally:
            buggify.disable()

    assert draws(7) == draws(7)  # a seed replays
    assert any(draws(7)) and not all(draws(7))
    # a site is active for the whole schedule or not at all (FoundationDB's rule)
    buggify.enable(random.Random(3))
    try:
        per_site = {s: sum(buggify.fires(s, 1.0) for _ in range(50)) for s in "abcdefghijkl"}
    finally:
        buggify.disable()
    assert set(per_site.values()) == {0, 50}
    assert not buggify.fires("a", 1.0)


@pytest.mark.timeout(30)  # (before the fix: a hang, shielded from fail_after)
def test_a_cancel_during_a_segment_roll_does_not_hang_the_journal(tmp_path):
    """The flusher waits for the old segment's fsync inside its shielded roll when the
    run is cancelled: the task reading the sync answers must live on until the roll
    is done (before the fix it was cancelled and the journal never stopped)."""
    disk = SimDisk(str(tmp_path), random.Random(1),
                   DiskFaults(fsync_latency_s=1.0, slow_fsync_p=0.0, split_write_p=0.0, segment_bytes=4096))

    async def main():
        j = _journal(tmp_path, disk)
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                await n.start(j.run)
                await j.wait_durable(j.append(b"a" * 3000))
                j.append(b"b" * 3000)  # does not fit: the flusher rolls to a new segment
                while not (disk.waiting and j._backlog):  # the roll waits for the old segment's fsync
                    await trio.sleep(0.001)
                n.cancel_scope.cancel()
        assert j.durable_lsn == 2  # the cancelled run still wrote and synced what it held

    run(main)
    assert scan_journal(tmp_path).last_lsn == 2


def test_a_machine_crash_keeps_the_durable_records_and_the_oracle_agrees_with_recovery(tmp_path):
    for seed in range(12):
        d = tmp_path / str(seed)
        d.mkdir()
        disk = SimDisk(str(d), random.Random(seed),
                       DiskFaults(fsync_latency_s=0.01, split_write_p=0.5, segment_bytes=4096,
                                  preallocate_bytes=(0, 1024, 4096)[seed % 3]))

        async def main():
            j = _journal(d, disk)
            async with trio.open_nursery() as n:
                await n.start(j.run)
                for i in range(60):
                    lsn = j.append(bytes([i]) * random.Random(i).randint(1, 300))
                    if i % 5 == 0:
                        j.write_now()
                    if i % 9 == 0:
                        await j.wait_durable(lsn)
                await trio.sleep(0.005)
                durable = j.durable_lsn
                last = disk.crash(machine=True)
                n.cancel_scope.cancel()
            return durable, last

        holder = []
        trio.run(lambda: _keep(holder, main), clock=trio.testing.MockClock(autojump_threshold=0))
        durable, last = holder[0]
        assert last >= durable, (seed, last, durable)  # nothing acknowledged is lost
        assert scan_journal(d).last_lsn == last, seed  # recovery keeps exactly the intact records


async def _keep(holder, fn):
    holder.append(await fn())


def test_short_writes_at_the_batch_end_still_write_every_byte(tmp_path):
    """Every write() writes only part of its bytes: the batch-end write hands the rest
    to the flusher's backlog, and nothing is lost or written twice."""
    disk = SimDisk(str(tmp_path), random.Random(5), DiskFaults(split_write_p=1.0, segment_bytes=4096))

    async def main():
        j = _journal(tmp_path, disk)
        async with trio.open_nursery() as n:
            await n.start(j.run)
            for i in range(80):
                lsn = j.append(bytes([i]) * 50)
                j.write_now()
                if i % 10 == 9:
                    await j.wait_durable(lsn)
            await j.aclose()

    run(main)
    assert [p for _, p in scan_journal(tmp_path).iter_records()] == [bytes([i]) * 50 for i in range(80)]


def test_a_full_disk_window_refuses_writes_then_they_resume(tmp_path):
    """Inside the window the journal's free-space check refuses writes (below its
    reserve) and a write hits ENOSPC (the ballast is given back first); after the
    window the refusal lifts by itself and everything appended is durable."""
    disk = SimDisk(str(tmp_path), random.Random(2),
                   DiskFaults(split_write_p=0.0, segment_bytes=4096, min_free_bytes=16384, ballast_bytes=8192,
                              full=((1.0, 5.0),), full_free=0))

    async def main():
        j = _journal(tmp_path, disk, space_poll_s=0.5)
        async with trio.open_nursery() as n:
            await n.start(j.run)
            await j.wait_durable(j.append(b"before"))
            await trio.sleep(1.5)  # inside the window
            lsn = j.append(b"x" * 9000)  # more than the ballast gives back
            j.write_now()
            assert await j.wait_refusing() in ("low", "stalled")
            assert j.durable_lsn < lsn
            await j.wait_writable()
            assert trio.current_time() >= 6.0  # only after the window
            await j.wait_durable(lsn)
            await j.aclose()

    run(main)
    assert scan_journal(tmp_path).last_lsn == 2


@pytest.mark.parametrize("seed", [0, 1])
def test_the_same_disk_seed_gives_the_same_files(tmp_path, seed):
    """Latencies, short writes and the crash's cut come from the disk's seed alone."""
    outs = []
    for k in range(2):
        d = tmp_path / f"{seed}-{k}"
        d.mkdir()
        disk = SimDisk(str(d), random.Random(seed), DiskFaults(split_write_p=0.7, segment_bytes=4096,
                                                                preallocate_bytes=1024))

        async def main():
            j = _journal(d, disk, mode="interval")
            async with trio.open_nursery() as n:
                await n.start(j.run)
                for i in range(40):
                    j.append(bytes([i]) * 120)
                    await trio.sleep(0.003)
                disk.crash(machine=True)
                n.cancel_scope.cancel()

        run(main)
        outs.append(sorted((p.name, p.read_bytes()) for p in (d / "journal").iterdir()))
    assert outs[0] == outs[1]
