"""Repair and damage detection (issue 12, item 8).

``rallypoint repair`` keeps every intact record before the damage, says exactly what it
cuts (LSN range, files, count) and one run is enough; damage in records the snapshot
already holds does not stop start-up; a deleted or shortened last segment is noticed
(``JOURNAL_MANIFEST``); a corrupt LMDB file is a one-line error.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import rallypoint
from rallypoint.errors import NotFoundError
from rallypoint.persistence import (
    Journal,
    JournalCorruptError,
    SnapshotCorruptError,
    SnapshotStore,
    plan_repair,
    recover,
    repair,
)
from rallypoint.persistence.journal import HEADER_SIZE, list_segments, scan_journal

from conftest import Daemon
from test_persistence_faults import REC, lsns, make_journal, payload


def snapshot_at(d: Path, lsn: int) -> None:
    store = SnapshotStore(d)
    store.write_sync(lsn, [], [])
    store.close()


def damage_record(path: Path, index: int) -> None:
    """Flip a payload byte of the ``index``-th record (0-based) of a segment of
    ``make_journal`` records (all REC bytes long)."""
    with open(path, "r+b") as f:
        f.seek(index * REC + HEADER_SIZE + 7)
        b = f.read(1)
        f.seek(index * REC + HEADER_SIZE + 7)
        f.write(bytes([b[0] ^ 0xFF]))


def crashed_journal(d: Path, n: int, *, segment_bytes: int = 64 << 20) -> list:
    """``n`` durable records in a journal that was never closed (as after a kill -9)."""

    async def go():
        j = Journal(d, mode="fsync", next_lsn=1, segment_bytes=segment_bytes)
        async with trio.open_nursery() as nursery:
            await nursery.start(j.run)
            for i in range(1, n + 1):
                j.append(payload(i))
            await j.wait_durable(n)
            nursery.cancel_scope.cancel()  # no aclose(): no clean end in the manifest

    trio.run(go)
    return list_segments(d)


def rp(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rallypoint", *args], capture_output=True, text=True,
                          timeout=60, input=stdin)


# ------------------------------------------------------------------ missing middle segment
def test_missing_middle_segment_repair_keeps_the_segments_before_the_gap(tmp_path):
    segs = make_journal(tmp_path, 100, segment_bytes=4096)
    assert [f for f, _ in segs] == [1, 36, 71]
    segs[1][1].unlink()
    with pytest.raises(JournalCorruptError, match="missing segment"):
        scan_journal(tmp_path, 0)
    plan = plan_repair(tmp_path)
    assert plan.needed and plan.truncate is None
    assert plan.delete == [segs[2][1]]
    assert (plan.lost_first, plan.lost_last, plan.lost_count) == (36, 100, 65)
    assert plan.keep_last_lsn == 35
    text = plan.describe()
    assert "LSN 36..100" in text and "65 records" in text and segs[2][1].name in text, text
    report = repair(tmp_path)
    assert report.last_lsn == 35 and report.deleted_segments == [segs[2][1]]
    assert lsns(tmp_path) == list(range(1, 36))  # the intact prefix is still there
    assert plan_repair(tmp_path).needed is False  # one run is enough
    assert scan_journal(tmp_path, 0).next_lsn == 36


def test_corrupt_record_plan_names_the_lsn_range_the_files_and_the_count(tmp_path, caplog):
    segs = make_journal(tmp_path, 100, segment_bytes=4096)
    bad = segs[1][1]
    damage_record(bad, 2)  # LSN 38; good records follow
    size = bad.stat().st_size
    plan = plan_repair(tmp_path)
    assert plan.truncate == (bad, 2 * REC, size - 2 * REC)
    assert plan.delete == [segs[2][1]]
    assert (plan.lost_first, plan.lost_last, plan.lost_count) == (38, 100, 63)
    assert plan.keep_last_lsn == 37 and plan.covered_count == 0
    caplog.set_level(logging.WARNING, logger="rallypoint.persistence")
    report = repair(tmp_path)
    assert report.last_lsn == 37 and report.records_dropped_estimate == 63
    log_text = "\n".join(r.getMessage() for r in caplog.records)
    assert "cut None" not in log_text and "LSN 38..100" in log_text, log_text
    assert lsns(tmp_path) == list(range(1, 38))
    assert plan_repair(tmp_path).needed is False


# ------------------------------------------------------------------ damage the snapshot covers
def test_damage_in_records_the_snapshot_holds_does_not_stop_start_up(tmp_path, caplog):
    (_, path), = make_journal(tmp_path, 100)
    damage_record(path, 29)  # LSN 30
    before = path.read_bytes()
    caplog.set_level(logging.WARNING, logger="rallypoint.persistence")
    res = scan_journal(tmp_path, after_lsn=100)  # the snapshot holds every record
    assert res.next_lsn == 101 and res.record_count == 0 and list(res) == []
    # A snapshot at 60: LSN 61 is found past the damage and 61..100 replay.
    res = scan_journal(tmp_path, after_lsn=60)
    assert [lsn for lsn, _ in res] == list(range(61, 101)) and res.next_lsn == 101
    assert list(res)[0][1] == payload(61)
    assert path.read_bytes() == before  # nothing cut
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert str(path) in text and "snapshot" in text, text
    # The same through recover() with a real snapshot store.
    snapshot_at(tmp_path, 60)
    rec = recover(tmp_path)
    assert rec.next_lsn == 101 and rec.record_count == 40
    rec.store.close()
    assert plan_repair(tmp_path).needed is False


def test_repair_of_damage_past_the_snapshot_keeps_covered_records_and_runs_once(tmp_path):
    (_, path), = make_journal(tmp_path, 100)
    damage_record(path, 29)  # LSN 30: in the snapshot
    damage_record(path, 79)  # LSN 80: past it, good records follow
    snapshot_at(tmp_path, 60)
    with pytest.raises(JournalCorruptError) as ei:
        recover(tmp_path)
    assert ei.value.offset == 79 * REC
    plan = plan_repair(tmp_path)
    assert (plan.lost_first, plan.lost_last, plan.lost_count) == (80, 100, 21)
    assert plan.truncate == (path, 79 * REC, 21 * REC) and plan.delete == []
    report = repair(tmp_path)
    assert report.last_lsn == 79
    rec = recover(tmp_path)  # starts: one repair was enough
    assert [lsn for lsn, _ in rec.records] == list(range(61, 80)) and rec.next_lsn == 80
    rec.store.close()


def test_repair_that_drops_only_records_the_snapshot_holds_says_nothing_is_lost(tmp_path):
    segs = make_journal(tmp_path, 100, segment_bytes=4096)  # [1..35] [36..70] [71..100]
    snapshot_at(tmp_path, 100)
    segs[2][1].unlink()  # the last segment; the snapshot holds all of it
    for _, p in segs[:2]:
        damage_record(p, 3)
    plan = plan_repair(tmp_path)
    # The manifest says the journal ended cleanly at 100; the snapshot is at 100.
    assert plan.lost_count == 0 or not plan.needed
    if plan.needed:
        assert "nothing is lost" in plan.describe()
        repair(tmp_path)
    rec = recover(tmp_path)
    assert rec.next_lsn == 101 and rec.record_count == 0
    rec.store.close()


# ------------------------------------------------------------------ deleted / shortened last segment
def test_a_deleted_last_segment_is_detected_after_a_clean_close(tmp_path):
    segs = make_journal(tmp_path, 100, segment_bytes=4096)
    segs[-1][1].unlink()
    with pytest.raises(JournalCorruptError) as ei:
        scan_journal(tmp_path, 0)
    assert segs[-1][1].name in str(ei.value) and "missing" in ei.value.reason
    plan = plan_repair(tmp_path)
    assert (plan.lost_first, plan.lost_last, plan.lost_count) == (71, 100, 30)
    assert plan.truncate is None and plan.delete == [] and plan.keep_last_lsn == 70
    repair(tmp_path)
    assert scan_journal(tmp_path, 0).next_lsn == 71
    assert plan_repair(tmp_path).needed is False


def test_a_deleted_last_segment_is_detected_after_a_crash(tmp_path):
    segs = crashed_journal(tmp_path, 100, segment_bytes=4096)
    segs[-1][1].unlink()
    with pytest.raises(JournalCorruptError, match="missing"):
        scan_journal(tmp_path, 0)
    plan = plan_repair(tmp_path)
    assert plan.lost_first == 71 and plan.lost_last is None and plan.lost_count is None
    assert "from LSN 71 on" in plan.describe()
    repair(tmp_path)
    assert scan_journal(tmp_path, 0).next_lsn == 71


def test_the_last_two_segments_deleted_lose_everything_after_the_first(tmp_path):
    segs = crashed_journal(tmp_path, 100, segment_bytes=4096)  # [1..35] [36..70] [71..100]
    segs[1][1].unlink()
    segs[2][1].unlink()
    with pytest.raises(JournalCorruptError, match="records from LSN 36 on are lost"):
        scan_journal(tmp_path, 0)
    plan = plan_repair(tmp_path)
    assert plan.lost_first == 36 and plan.lost_count is None and plan.keep_last_lsn == 35
    repair(tmp_path)
    assert lsns(tmp_path) == list(range(1, 36))


def test_the_only_segment_deleted_is_detected(tmp_path):
    crashed_journal(tmp_path, 5)
    for _, p in list_segments(tmp_path):
        p.unlink()
    with pytest.raises(JournalCorruptError, match="missing"):
        scan_journal(tmp_path, 0)


def test_a_journal_shortened_after_a_clean_close_is_refused(tmp_path):
    (_, path), = make_journal(tmp_path, 10)
    with open(path, "r+b") as f:
        f.truncate(7 * REC)  # at a record boundary: looks complete
    with pytest.raises(JournalCorruptError, match="closed cleanly at LSN 10"):
        scan_journal(tmp_path, 0)
    with open(path, "r+b") as f:
        f.truncate(7 * REC - 5)  # mid-record: would be cut as a torn tail after a crash
    with pytest.raises(JournalCorruptError, match="closed cleanly at LSN 10"):
        scan_journal(tmp_path, 0)
    assert path.stat().st_size == 7 * REC - 5  # not cut
    plan = plan_repair(tmp_path)
    assert (plan.lost_first, plan.lost_last, plan.lost_count) == (7, 10, 4)
    repair(tmp_path)
    assert lsns(tmp_path) == list(range(1, 7))


def test_reopening_after_a_clean_close_is_not_damage(tmp_path):
    make_journal(tmp_path, 10)
    make_journal(tmp_path, 5, start=11)
    assert lsns(tmp_path) == list(range(1, 16))
    crashed_journal(tmp_path / "c", 3)
    assert scan_journal(tmp_path / "c", 0).next_lsn == 4


# ------------------------------------------------------------------ the CLI and the daemon
async def _daemon_dir_with_runs(tmp_path: Path, n: int) -> tuple[Path, list[str]]:
    d = tmp_path / "data"
    daemon = Daemon(str(d), "fsync").start()
    try:
        async with rallypoint.connect(daemon.url) as rs:
            ids = [(await rs.scopes.create(name=f"r{i}")).id for i in range(n)]
    finally:
        daemon.kill()  # kill -9: no snapshot, no clean close
    return d, ids


async def test_a_crashed_daemons_zero_tail_is_not_damage_to_repair(tmp_path):
    # kill -9 leaves the last segment ending in the zeros the journal wrote ahead of
    # its records (preallocation): repair says intact, names them, and changes nothing.
    d, ids = await _daemon_dir_with_runs(tmp_path, 3)
    (_, seg), = list_segments(d)
    from test_durability_faults import record_offsets

    raw = seg.read_bytes()
    off, length, _ = record_offsets(seg)[-1]
    end = off + HEADER_SIZE + length
    assert len(raw) - end >= 4096 and raw[end:].count(0) == len(raw) - end  # the zeros are there
    r = rp("repair", "--data-dir", str(d))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "intact" in r.stdout and f"ends in {len(raw) - end} zero bytes" in r.stdout, r.stdout
    assert seg.read_bytes() == raw
    daemon = Daemon(str(d), "fsync").start()  # and the daemon starts and cuts them
    try:
        async with rallypoint.connect(daemon.url) as rs:
            assert (await rs.scope(ids[-1]).status()).name == "r2"
    finally:
        assert daemon.stop() == 0, daemon.stderr()


async def test_deleted_last_segment_stops_the_daemon_until_one_repair(tmp_path):
    d, ids = await _daemon_dir_with_runs(tmp_path, 3)
    segs = list_segments(d)
    segs[-1][1].unlink()
    p = rp("serve", "--listen", "127.0.0.1:0", "--data-dir", str(d))
    assert p.returncode == 2, p.stderr
    assert "missing" in p.stderr and "rallypoint repair" in p.stderr and "Traceback" not in p.stderr
    r = rp("repair", "--data-dir", str(d), stdin="y\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"from LSN {segs[-1][0]} on" in r.stdout and segs[-1][1].name in r.stdout, r.stdout
    r = rp("repair", "--data-dir", str(d))
    assert r.returncode == 0 and "intact" in r.stdout, r.stdout  # one run was enough
    daemon = Daemon(str(d), "fsync").start()
    try:
        async with rallypoint.connect(daemon.url) as rs:
            await rs.scopes.create(name="after-repair")
    finally:
        assert daemon.stop() == 0, daemon.stderr()


async def test_cli_repair_prints_the_plan_and_keeps_the_prefix(tmp_path):
    d, ids = await _daemon_dir_with_runs(tmp_path, 6)
    (_, seg), = [s for s in list_segments(d) if s[1].stat().st_size > 0][-1:]
    from test_durability_faults import record_offsets

    recs = record_offsets(seg)
    off, length, lsn = recs[-3]  # a run's record; two good records follow
    raw = bytearray(seg.read_bytes())
    raw[off + HEADER_SIZE + length // 2] ^= 0xFF
    seg.write_bytes(bytes(raw))
    last = recs[-1][2]
    r = rp("repair", "--data-dir", str(d), stdin="n\n")
    assert r.returncode == 1 and seg.read_bytes() == bytes(raw)
    out = r.stdout
    assert f"LSN {lsn}..{last}" in out and f"{last - lsn + 1} records" in out and seg.name in out, out
    assert f"byte {off}" in out
    r = rp("repair", "--data-dir", str(d), "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"ends at LSN {lsn - 1}" in r.stdout
    daemon = Daemon(str(d), "fsync").start()
    try:
        async with rallypoint.connect(daemon.url) as rs:
            assert (await rs.scope(ids[0]).status()).name == "r0"
            with pytest.raises(NotFoundError):
                await rs.scope(ids[-1]).status()
    finally:
        assert daemon.stop() == 0, daemon.stderr()


# ------------------------------------------------------------------ corrupt LMDB
def _corrupt(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "garbage":
        raw[:64] = b"X" * 64
    elif how == "truncated":
        raw = raw[: len(raw) // 2]
    elif how == "zeroed-pages":
        for i in range(2 * 4096, len(raw)):
            raw[i] = 0xA5
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["garbage", "truncated", "zeroed-pages"])
async def test_a_corrupt_snapshot_store_is_a_one_line_error(tmp_path, how):
    d = tmp_path / "data"
    async with rallypoint.open_embedded(str(d)) as rs:
        for i in range(300):
            await rs.scopes.create(name=f"r{i}")
    # the clean close wrote a snapshot
    mdb = d / "snapshot" / "data.mdb"
    _corrupt(mdb, how)
    with pytest.raises(SnapshotCorruptError):
        async with rallypoint.open_embedded(str(d)):
            pass
    p = rp("serve", "--listen", "127.0.0.1:0", "--data-dir", str(d))
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("rallypoint: snapshot store") and str(d / "snapshot") in last, p.stderr
    r = rp("repair", "--data-dir", str(d), "--yes")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "snapshot store" in r.stderr and "backup" in r.stderr, r.stderr
    # The journal still starts at LSN 1 here, and repair says so: following its advice
    # (move the store aside) loses nothing.
    assert "holds every record from LSN 1" in r.stderr and "loses nothing" in r.stderr, r.stderr
    (d / "snapshot").rename(d / "snapshot.corrupt")
    async with rallypoint.open_embedded(str(d)) as rs:
        names = {r.name for r in await rs.scopes.list(None, limit=1000)}
    assert names == {f"r{i}" for i in range(300)}


def test_a_corrupt_snapshot_store_whose_journal_was_truncated_says_restore_from_backup(tmp_path):
    from rallypoint.persistence import check_format

    check_format(tmp_path)
    snapshot_at(tmp_path, 50)
    make_journal(tmp_path, 5, start=51)  # segments below the snapshot were deleted
    _corrupt(tmp_path / "snapshot" / "data.mdb", "garbage")
    r = rp("repair", "--data-dir", str(tmp_path), "--yes")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "starts at LSN 51, not 1" in r.stderr and "restore the snapshot from a backup" in r.stderr, r.stderr
