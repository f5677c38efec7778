"""Snapshot store, format version, data-dir lock, recovery."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import trio

from rallypoint.persistence import (
    FORMAT_VERSION,
    DataDirLock,
    DataDirLocked,
    FormatVersionError,
    Journal,
    JournalCorruptError,
    SnapshotStore,
    check_format,
    recover,
    repair,
)


async def test_snapshot_round_trip(tmp_path):
    store = SnapshotStore(tmp_path)
    assert store.load_lsn() == 0
    assert list(store.iter_entities()) == []
    await store.write(7, [(b"b", b"2"), (b"a", b"1"), (b"c", b"3")], [])
    assert store.load_lsn() == 7
    assert list(store.iter_entities()) == [(b"a", b"1"), (b"b", b"2"), (b"c", b"3")]
    await store.write(9, [(b"a", b"1'")], [b"b", b"missing"])
    assert list(store.iter_entities()) == [(b"a", b"1'"), (b"c", b"3")]
    assert store.get(b"c") == b"3" and store.entity_count() == 2
    with pytest.raises(ValueError):
        await store.write(8, [], [])
    store.close()
    store = SnapshotStore(tmp_path)
    assert store.load_lsn() == 9
    assert dict(store.iter_entities()) == {b"a": b"1'", b"c": b"3"}
    store.close()


async def test_snapshot_write_does_not_block_the_loop(tmp_path):
    store = SnapshotStore(tmp_path)
    puts = [(f"k{i:07d}".encode(), b"v" * 200) for i in range(50_000)]
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await store.write(1, puts, [])
        nursery.cancel_scope.cancel()
    assert ticks > 10  # the loop kept running while LMDB wrote
    assert store.entity_count() == 50_000
    store.close()


def test_format_file_created_and_checked(tmp_path):
    d = tmp_path / "data"
    assert check_format(d) == FORMAT_VERSION
    assert (d / "FORMAT").read_text().strip() == str(FORMAT_VERSION)
    assert check_format(d) == FORMAT_VERSION


def test_newer_format_is_refused(tmp_path):
    (tmp_path / "FORMAT").write_text(f"{FORMAT_VERSION + 1}\n")
    with pytest.raises(FormatVersionError) as info:
        check_format(tmp_path)
    msg = str(info.value)
    assert f"version {FORMAT_VERSION + 1}" in msg and f"version {FORMAT_VERSION}" in msg
    with pytest.raises(FormatVersionError):
        recover(tmp_path)


def test_garbage_format_is_refused(tmp_path):
    (tmp_path / "FORMAT").write_text("hello")
    with pytest.raises(FormatVersionError):
        check_format(tmp_path)


def test_lock_conflict_in_same_process(tmp_path):
    a = DataDirLock(tmp_path)
    a.acquire()
    assert (tmp_path / "LOCK").read_text().strip() == str(os.getpid())
    with pytest.raises(DataDirLocked) as info:
        DataDirLock(tmp_path).acquire()
    assert info.value.pid == os.getpid()
    assert str(os.getpid()) in str(info.value) and str(tmp_path) in str(info.value)
    with pytest.raises(DataDirLocked):
        repair(tmp_path)
    a.release()
    with DataDirLock(tmp_path) as b:
        assert b.held
    assert not b.held


def test_lock_held_by_other_process(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from rallypoint.persistence.lock import DataDirLock
        DataDirLock({str(tmp_path)!r}).acquire()
        print("locked", flush=True)
        sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(DataDirLocked) as info:
            DataDirLock(tmp_path).acquire()
        assert info.value.pid == proc.pid
        assert f"process {proc.pid}" in str(info.value)
    finally:
        proc.stdin.close()
        proc.wait(10)
    # Released when the holder exits.
    lock = DataDirLock(tmp_path)
    lock.acquire()
    lock.release()


async def _append(journal_dir, next_lsn, payloads, mode="fsync"):
    j = Journal(journal_dir, mode=mode, next_lsn=next_lsn)
    async with trio.open_nursery() as nursery:
        await nursery.start(j.run)
        for p in payloads:
            j.append(p)
        await j.aclose()


async def test_recover_empty_data_dir(tmp_path):
    rec = recover(tmp_path / "d")
    assert rec.snapshot_lsn == 0 and rec.entities == [] and list(rec.records) == []
    assert rec.next_lsn == 1 and rec.torn_tail is None
    assert set(rec.timing) == {"snapshot_s", "scan_s", "total_s"}
    rec.store.close()


async def test_recover_snapshot_plus_journal_tail(tmp_path):
    await _append(tmp_path, 1, [f"r{i}".encode() for i in range(1, 9)])
    store = SnapshotStore(tmp_path)
    await store.write(5, [(b"e1", b"state@5")], [])
    store.close()
    # Torn tail on top.
    seg = sorted((tmp_path / "journal").iterdir())[-1]
    with open(seg, "ab") as f:
        f.write(b"\x05\x00\x00")
    rec = recover(tmp_path)
    assert rec.snapshot_lsn == 5
    assert rec.entities == [(b"e1", b"state@5")]
    assert list(rec.records) == [(6, b"r6"), (7, b"r7"), (8, b"r8")]
    assert len(rec.records) == rec.record_count == 3
    assert rec.next_lsn == 9 and rec.torn_tail is not None and rec.torn_tail.path == seg
    j = rec.open_journal(mode="fsync")
    assert j.append(b"r9") == 9
    await j.aclose()
    # Snapshot to 9, truncate, recover again.
    await rec.store.write(9, [(b"e1", b"state@9")], [])
    rec.store.close()
    rec2 = recover(tmp_path)
    assert rec2.snapshot_lsn == 9 and list(rec2.records) == [] and rec2.next_lsn == 10
    rec2.store.close()


async def test_recover_snapshot_with_empty_journal(tmp_path):
    store = SnapshotStore(tmp_path)
    await store.write(100, [(b"k", b"v")], [])
    store.close()
    rec = recover(tmp_path)
    assert rec.next_lsn == 101
    j = rec.open_journal(mode="fsync")
    assert j.append(b"x") == 101
    await j.aclose()
    rec.store.close()


async def test_recover_refuses_snapshot_ahead_of_journal(tmp_path):
    await _append(tmp_path, 1, [b"a", b"b", b"c"])
    store = SnapshotStore(tmp_path)
    await store.write(10, [], [])
    store.close()
    with pytest.raises(JournalCorruptError, match="snapshot LSN 10 is ahead of the journal end 3"):
        recover(tmp_path)
    report = repair(tmp_path)  # reads the snapshot LSN itself
    assert report.changed
    rec = recover(tmp_path)
    assert rec.next_lsn == 11
    rec.store.close()
