"""Journal preallocation: zeros written ahead of the records, cut at a roll and a clean
close, a crashed segment's zero tail cut by recovery, and an unwritten page (what a
machine crash can leave in a preallocated segment) cut rather than called corruption.
See rallypoint/persistence/journal.py, *Preallocation*."""

from __future__ import annotations

import errno
import logging
import shutil

import pytest
import trio

from rallypoint.persistence.journal import (
    HEADER_SIZE,
    ZERO_TAIL,
    Disk,
    Journal,
    JournalCorruptError,
    _frame,
    list_segments,
    read_journal,
    scan_journal,
    segment_name,
)

from test_persistence_faults import REC, payload


def is_zero(b: bytes) -> bool:
    return b.count(0) == len(b)


async def test_zeros_are_kept_ahead_of_the_records_and_cut_at_close(tmp_path):
    j = Journal(tmp_path, mode="fsync", next_lsn=1, preallocate_bytes=64 << 10)
    path = tmp_path / "journal" / segment_name(1)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        for i in range(1, 11):
            j.append(payload(i))
        await j.wait_durable(10)
        raw = path.read_bytes()
        assert len(raw) == 10 * REC + (64 << 10)  # the records, then 64 KiB of zeros
        assert is_zero(raw[10 * REC:])
        # More than half of the zeros used: another 64 KiB are written ahead.
        for i in range(11, 11 + (40 << 10) // REC):
            j.append(payload(i))
        last = j.last_lsn
        await j.wait_durable(last)
        assert path.stat().st_size > 10 * REC + (64 << 10) and is_zero(path.read_bytes()[last * REC:])
        await j.aclose()
    assert path.stat().st_size == last * REC  # a clean close leaves no zeros
    res = scan_journal(tmp_path, 0)
    assert res.torn_tail is None and res.last_lsn == last


async def test_a_roll_cuts_the_zero_tail_of_the_segment_it_leaves(tmp_path):
    j = Journal(tmp_path, mode="fsync", next_lsn=1, segment_bytes=8192, preallocate_bytes=4096)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        for i in range(1, 401):
            await j.wait_durable(j.append(payload(i)))  # one write + fdatasync each
        segs = list_segments(tmp_path)
        assert len(segs) > 3
        for first, p in segs[:-1]:  # rolled: exactly their records, no zeros
            raw = p.read_bytes()
            assert len(raw) % REC == 0 and not is_zero(raw[-REC:]), p
        # the active one has zeros ahead, never past segment_bytes
        active = segs[-1][1].read_bytes()
        assert len(active) <= 8192 and active.endswith(b"\0" * 64)
        await j.aclose()
    assert [lsn for lsn, _ in read_journal(tmp_path, 0)] == list(range(1, 401))
    assert scan_journal(tmp_path, 0).torn_tail is None


async def test_a_crash_leaves_a_zero_tail_that_recovery_cuts_quietly(tmp_path, caplog):
    live, crashed = tmp_path / "live", tmp_path / "crashed"
    j = Journal(live, mode="fsync", next_lsn=1, preallocate_bytes=64 << 10)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        for i in range(1, 21):
            j.append(payload(i))
        await j.wait_durable(20)
        shutil.copytree(live, crashed)  # what kill -9 leaves: records, zeros, no clean end
        await j.aclose()
    (_, path), = list_segments(crashed)
    assert path.stat().st_size == 20 * REC + (64 << 10)
    caplog.set_level(logging.INFO, logger="rallypoint.persistence")
    res = scan_journal(crashed, 0)
    assert res.last_lsn == 20 and res.next_lsn == 21
    assert res.torn_tail is not None and res.torn_tail.reason == ZERO_TAIL
    assert res.torn_tail.offset == 20 * REC and res.torn_tail.bytes_dropped == 64 << 10
    assert path.stat().st_size == 20 * REC
    logged = [r for r in caplog.records if r.name == "rallypoint.persistence"]
    assert logged and all(r.levelno == logging.INFO for r in logged), [r.getMessage() for r in logged]
    # it reopens and appends after LSN 20
    j2 = Journal.open(crashed, preallocate_bytes=64 << 10)
    async with trio.open_nursery() as nursery:
        await nursery.start(j2.run)
        await j2.wait_durable(j2.append(payload(21)))
        await j2.aclose()
    assert [lsn for lsn, _ in read_journal(crashed, 0)] == list(range(1, 22))


def _hole_segment(d, *, first=1):
    """Records 1-60 whose page 1 ends in record 36's header: that page never written
    past record 35 (zeros from record 36 to the page boundary), the next page (records
    37 on) intact, then the preallocated zeros: what a machine crash during the
    fdatasync of records 36-60 can leave when their pages reached the disk out of
    order. Record 37 is intact after the hole, so this is not an ordinary torn tail."""
    frames = b"".join(_frame(i, payload(i)) for i in range(first, first + 60))
    raw = bytearray(frames + bytes(16384))
    hole = 35 * REC
    page_end = (hole // 4096 + 1) * 4096
    assert HEADER_SIZE <= page_end - hole < REC
    raw[hole:page_end] = bytes(page_end - hole)
    jdir = d / "journal"
    jdir.mkdir(parents=True, exist_ok=True)
    p = jdir / segment_name(first)
    p.write_bytes(bytes(raw))
    return p, hole


def test_an_unwritten_page_in_the_last_segment_is_cut_with_what_follows(tmp_path):
    p, hole = _hole_segment(tmp_path)
    res = scan_journal(tmp_path, 0)
    assert res.last_lsn == 35 and res.next_lsn == 36
    assert res.torn_tail.offset == hole and "zeros where LSN 36 should start" in res.torn_tail.reason
    assert p.stat().st_size == hole


def test_an_unwritten_page_before_a_later_segment_is_corruption(tmp_path):
    p, hole = _hole_segment(tmp_path)
    later = tmp_path / "journal" / segment_name(61)
    later.write_bytes(_frame(61, payload(61)))
    with pytest.raises(JournalCorruptError):
        scan_journal(tmp_path, 0)
    assert p.stat().st_size == 60 * REC + 16384  # nothing modified


def test_garbage_before_good_records_is_still_corruption_in_the_last_segment(tmp_path):
    p, hole = _hole_segment(tmp_path)
    raw = bytearray(p.read_bytes())
    raw[hole:hole + 4] = b"XXXX"  # not an unwritten page: damage
    p.write_bytes(bytes(raw))
    with pytest.raises(JournalCorruptError):
        scan_journal(tmp_path, 0)


class NoRoomForZeros(Disk):
    def __init__(self) -> None:
        self.calls = 0

    def preallocate(self, fd, offset, size) -> None:
        self.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_failed_preallocation_only_stops_preallocating(tmp_path, caplog):
    disk = NoRoomForZeros()
    caplog.set_level(logging.WARNING, logger="rallypoint.persistence")
    j = Journal(tmp_path, mode="fsync", next_lsn=1, preallocate_bytes=4096, disk=disk)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        for i in range(1, 31):
            await j.wait_durable(j.append(payload(i)))
        await j.aclose()
    assert disk.calls == 1  # not retried within the segment
    assert any("cannot preallocate" in r.getMessage() for r in caplog.records)
    assert [lsn for lsn, _ in read_journal(tmp_path, 0)] == list(range(1, 31))
    (_, p), = list_segments(tmp_path)
    assert p.stat().st_size == 30 * REC


async def test_preallocation_off_writes_appends_only(tmp_path):
    j = Journal(tmp_path, mode="fsync", next_lsn=1, preallocate_bytes=0)
    path = tmp_path / "journal" / segment_name(1)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        for i in range(1, 6):
            j.append(payload(i))
        await j.wait_durable(5)
        assert path.stat().st_size == 5 * REC
        await j.aclose()


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="preallocate_bytes"):
        Journal(None, mode="memory", next_lsn=1, preallocate_bytes=-1)
