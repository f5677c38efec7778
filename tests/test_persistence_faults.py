"""Journal fault injection: torn tails are cut, real corruption is refused, repair."""

from __future__ import annotations

import logging
import os

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rallypoint.persistence.journal import (
    HEADER_SIZE,
    Journal,
    JournalCorruptError,
    _frame,
    list_segments,
    read_journal,
    repair,
    scan_journal,
    segment_name,
)

REC = 100 + HEADER_SIZE


def payload(i: int) -> bytes:
    return (f"p{i:06d}" * 20).encode()[:100]


def make_journal(d, n, *, segment_bytes=64 << 20, start=1, crash=False):
    """``n`` records in a journal closed cleanly, or with ``crash`` left as a kill -9
    leaves it (every record durable, no clean end in JOURNAL_MANIFEST: only then is a
    damaged tail a torn write rather than damage)."""
    async def go():
        j = Journal(d, mode="fsync", next_lsn=start, segment_bytes=segment_bytes)
        async with trio.open_nursery() as nursery:
            await nursery.start(j.run)
            for i in range(start, start + n):
                j.append(payload(i))
            if crash:
                await j.wait_durable(start + n - 1)
                nursery.cancel_scope.cancel()
            else:
                await j.aclose()

    trio.run(go)
    return list_segments(d)


def write_raw(d, first, frames):
    jdir = d / "journal"
    jdir.mkdir(parents=True, exist_ok=True)
    p = jdir / segment_name(first)
    p.write_bytes(b"".join(frames))
    return p


def lsns(d, after=0):
    return [lsn for lsn, _ in read_journal(d, after)]


def test_torn_last_record_is_cut_and_logged(tmp_path, caplog):
    (_, path), = make_journal(tmp_path, 10, crash=True)
    size = path.stat().st_size
    assert size == 10 * REC
    with open(path, "r+b") as f:
        f.truncate(size - 50)  # cut in the middle of record 10's payload
    caplog.set_level(logging.WARNING, logger="rallypoint.persistence")
    res = scan_journal(tmp_path, 0)
    assert res.next_lsn == 10 and res.last_lsn == 9 and res.record_count == 9
    assert res.torn_tail is not None
    assert res.torn_tail.path == path and res.torn_tail.offset == 9 * REC
    assert res.torn_tail.bytes_dropped == REC - 50
    assert path.stat().st_size == 9 * REC  # truncated on disk
    msgs = [r.getMessage() for r in caplog.records if r.name == "rallypoint.persistence"]
    assert any(str(path) in m and f"offset {9 * REC}" in m for m in msgs), msgs
    # Appends continue at the right LSN.
    make_journal(tmp_path, 3, start=res.next_lsn)
    assert lsns(tmp_path) == list(range(1, 13))
    assert scan_journal(tmp_path, 0).torn_tail is None


@pytest.mark.parametrize("keep", [1, 5, 15, 16, 17])
def test_torn_header_is_cut(tmp_path, keep):
    (_, path), = make_journal(tmp_path, 4)
    with open(path, "ab") as f:
        f.write(_frame(5, payload(5))[:keep])
    res = scan_journal(tmp_path, 0)
    assert res.next_lsn == 5 and res.torn_tail.offset == 4 * REC
    assert path.stat().st_size == 4 * REC


def test_zeroed_tail_is_cut(tmp_path):
    (_, path), = make_journal(tmp_path, 7)
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)
    res = scan_journal(tmp_path, 0)
    assert res.next_lsn == 8 and res.torn_tail.offset == 7 * REC
    assert res.torn_tail.bytes_dropped == 4096
    assert path.stat().st_size == 7 * REC


def test_garbled_last_record_is_cut(tmp_path):
    (_, path), = make_journal(tmp_path, 5, crash=True)
    with open(path, "r+b") as f:
        f.seek(4 * REC + 40)
        f.write(b"XXXX")  # bad CRC in the last record, nothing good after it
    res = scan_journal(tmp_path, 0)
    assert res.next_lsn == 5 and res.torn_tail.offset == 4 * REC


def test_read_journal_is_read_only_on_torn_tail(tmp_path):
    (_, path), = make_journal(tmp_path, 3)
    with open(path, "ab") as f:
        f.write(b"\0" * 100)
    assert lsns(tmp_path) == [1, 2, 3]
    assert path.stat().st_size == 3 * REC + 100


def test_bad_crc_followed_by_good_records_is_corruption(tmp_path):
    (_, path), = make_journal(tmp_path, 10)
    with open(path, "r+b") as f:
        f.seek(4 * REC + HEADER_SIZE + 10)
        f.write(b"!")  # damage record 5's payload
    with pytest.raises(JournalCorruptError) as info:
        scan_journal(tmp_path, 0)
    e = info.value
    assert e.path == str(path) and e.offset == 4 * REC
    assert "CRC" in e.reason
    assert "rallypoint repair --data-dir" in str(e) and str(path) in str(e)
    assert path.stat().st_size == 10 * REC  # nothing modified


def test_damaged_length_followed_by_good_records_is_corruption(tmp_path):
    (_, path), = make_journal(tmp_path, 10)
    with open(path, "r+b") as f:
        f.seek(3 * REC)
        f.write(b"\xff\xff\x00\x00")
    with pytest.raises(JournalCorruptError) as info:
        scan_journal(tmp_path, 0)
    assert info.value.offset == 3 * REC


def test_bad_record_at_end_of_non_last_segment_is_corruption(tmp_path):
    segs = make_journal(tmp_path, 100, segment_bytes=4096)
    assert len(segs) >= 3
    path = segs[0][1]
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(JournalCorruptError) as info:
        scan_journal(tmp_path, 0)
    assert info.value.path == str(path) and info.value.offset == size - REC


def test_missing_segment_is_corruption(tmp_path):
    segs = make_journal(tmp_path, 100, segment_bytes=4096)
    segs[1][1].unlink()
    with pytest.raises(JournalCorruptError) as info:
        scan_journal(tmp_path, 0)
    assert info.value.path == str(segs[2][1])
    assert "missing segment" in info.value.reason


def test_lsn_gap_inside_segment_is_corruption(tmp_path):
    frames = [_frame(1, b"a"), _frame(2, b"b"), _frame(4, b"d"), _frame(5, b"e")]
    path = write_raw(tmp_path, 1, frames)
    with pytest.raises(JournalCorruptError) as info:
        scan_journal(tmp_path, 0)
    assert info.value.path == str(path)
    assert info.value.offset == len(frames[0]) + len(frames[1])
    assert "expected LSN 3, found 4" in info.value.reason


def test_lsn_gap_in_last_record_is_still_corruption(tmp_path):
    write_raw(tmp_path, 1, [_frame(1, b"a"), _frame(3, b"c")])
    with pytest.raises(JournalCorruptError):
        scan_journal(tmp_path, 0)


def test_snapshot_ahead_of_journal_end_is_corruption(tmp_path):
    make_journal(tmp_path, 10)
    with pytest.raises(JournalCorruptError) as info:
        scan_journal(tmp_path, after_lsn=20)
    assert "snapshot LSN 20 is ahead of the journal end 10" in str(info.value)
    # At or behind the end is fine.
    assert scan_journal(tmp_path, after_lsn=10).next_lsn == 11
    res = scan_journal(tmp_path, after_lsn=7)
    assert list(res) == [(i, payload(i)) for i in (8, 9, 10)]


def test_empty_journal_with_snapshot_continues_after_it(tmp_path):
    assert scan_journal(tmp_path, after_lsn=0).next_lsn == 1
    res = scan_journal(tmp_path, after_lsn=42)
    assert res.next_lsn == 43 and res.record_count == 0 and list(res) == []
    j = Journal(tmp_path, mode="fsync", next_lsn=res.next_lsn)
    assert j.append(b"x") == 43
    trio.run(j.aclose)
    assert list(read_journal(tmp_path, 42)) == [(43, b"x")]


def test_journal_starting_after_snapshot_is_corruption(tmp_path):
    make_journal(tmp_path, 5, start=50)
    with pytest.raises(JournalCorruptError) as info:
        scan_journal(tmp_path, after_lsn=10)
    assert "11..49 are missing" in info.value.reason


def test_segments_wholly_below_snapshot_are_skipped(tmp_path):
    segs = make_journal(tmp_path, 100, segment_bytes=4096)
    # Damage an old segment that the snapshot covers completely: not even read.
    with open(segs[0][1], "r+b") as f:
        f.write(b"garbage!")
    after = segs[2][0] - 1
    res = scan_journal(tmp_path, after_lsn=after)
    assert [l for l, _ in res] == list(range(after + 1, 101))
    assert segs[0][1] in res.skipped_segments


def test_repair_truncates_at_last_good_record(tmp_path):
    segs = make_journal(tmp_path, 100, segment_bytes=4096)
    bad = segs[1][1]
    first = segs[1][0]
    with open(bad, "r+b") as f:
        f.seek(2 * REC + HEADER_SIZE + 3)
        f.write(b"#")
    with pytest.raises(JournalCorruptError):
        scan_journal(tmp_path, 0)
    report = repair(tmp_path, snapshot_lsn=0)
    assert report.file == bad and report.offset == 2 * REC
    assert report.last_lsn == first + 1
    assert [p for p in report.deleted_segments] == [p for _, p in segs[2:]]
    assert report.records_dropped_estimate == pytest.approx(100 - (first + 1), abs=2)
    assert report.bytes_dropped > 0 and report.changed
    res = scan_journal(tmp_path, 0)
    assert res.next_lsn == first + 2 and res.torn_tail is None
    assert repair(tmp_path).changed is False  # idempotent


def test_repair_missing_segment_keeps_prefix(tmp_path):
    segs = make_journal(tmp_path, 100, segment_bytes=4096)
    segs[2][1].unlink()
    report = repair(tmp_path)
    assert report.last_lsn == segs[2][0] - 1
    assert scan_journal(tmp_path, 0).next_lsn == segs[2][0]


def test_repair_snapshot_ahead_drops_journal(tmp_path):
    make_journal(tmp_path, 10)
    report = repair(tmp_path, snapshot_lsn=20)
    assert report.changed and report.last_lsn == 20
    assert scan_journal(tmp_path, after_lsn=20).next_lsn == 21


def test_repair_lsn_gap(tmp_path):
    write_raw(tmp_path, 1, [_frame(1, b"a"), _frame(2, b"b"), _frame(4, b"d")])
    report = repair(tmp_path)
    assert report.last_lsn == 2
    assert list(read_journal(tmp_path, 0)) == [(1, b"a"), (2, b"b")]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=20 * REC),
       junk=st.sampled_from([b"", b"\0" * 37, b"\xff" * 5, b"\0" * 4096]))
def test_any_truncation_point_yields_a_prefix(tmp_path_factory, cut, junk):
    d = tmp_path_factory.mktemp("j")
    frames = [_frame(i, payload(i)) for i in range(1, 21)]
    blob = b"".join(frames)[:cut] + junk
    write_raw(d, 1, [blob])
    res = scan_journal(d, 0)
    complete = cut // REC
    assert res.next_lsn == complete + 1
    assert [l for l, _ in res] == list(range(1, complete + 1))
    assert (res.torn_tail is None) == (cut % REC == 0 and not junk)
    assert os.path.getsize(d / "journal" / segment_name(1)) == complete * REC


def test_verify_journal_uses_snapshot_lsn_and_is_read_only(tmp_path):
    from rallypoint.persistence import SnapshotStore, StartupError, verify_journal

    segs = make_journal(tmp_path, 100, segment_bytes=4096)
    store = SnapshotStore(tmp_path)
    store.write_sync(segs[2][0] - 1, [], [])
    store.close()
    for _, p in segs[:2]:
        p.unlink()  # what truncate_below does after the snapshot
    with pytest.raises(JournalCorruptError):
        scan_journal(tmp_path, 0)  # without the snapshot LSN the start looks missing
    last = segs[-1][1]
    with open(last, "ab") as f:
        f.write(b"\0" * 10)
    res = verify_journal(tmp_path)
    assert res.next_lsn == 101 and res.torn_tail is not None
    assert last.stat().st_size == res.torn_tail.offset + 10  # not cut
    assert issubclass(JournalCorruptError, StartupError)
