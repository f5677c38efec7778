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


# ------------------------------------------------------------------ streamed snapshots
def _big_containers(n: int) -> dict[int, str]:
    """id -> type name of every GC-tracked container holding at least ``n`` items."""
    import gc

    return {id(o): type(o).__name__ for o in gc.get_objects()
            if isinstance(o, (list, set, dict, tuple, frozenset)) and len(o) >= n}


def _create_scopes(coord, n: int) -> None:
    """``n`` runs committed straight on the coordinator (one journal entry each)."""
    from rallypoint.records import ScopeCreated

    now = coord.now_ms()
    for _ in range(n):
        coord.commit([ScopeCreated(id=coord.ids.new("scp"), space="default", parent_id=None, name=None,
                                   deadline_ms=None, child_limit=1000, at_ms=now)])


async def test_a_snapshot_holds_no_gc_tracked_container_as_large_as_itself(tmp_path, monkeypatch):
    """The snapshot's encoded entities leave the loop in small packed batches: at the
    cut no new GC-tracked list, set or dict of the snapshot's size exists (a GC pass
    walking one on the event loop was the 50-80 ms stall at 1M entities), and the
    dirty ids are kept where the GC never looks."""
    import gc

    import rallypoint
    from rallypoint.node import Snapshotter, _EventCut

    n = 3000
    monkeypatch.setattr(Snapshotter, "SLICE_S", 0.0)  # a slice and a yield every SLICE entities
    async with rallypoint.open_embedded(str(tmp_path / "d"), durability="fsync") as rs:
        node = rs.node
        coord = node.coordinator
        _create_scopes(coord, n)
        assert coord.dirty_count() >= n
        assert not any(gc.is_tracked(d) for d in [coord.dirty, *coord._dirty_full])
        before = _big_containers(n // 2)
        at_cut = {}
        finish = _EventCut.finish

        def spy(self, batch):
            at_cut.update({k: v for k, v in _big_containers(n // 2).items() if k not in before})
            return finish(self, batch)

        monkeypatch.setattr(_EventCut, "finish", spy)
        lsn = await node.snapshotter.snapshot()
        assert lsn == coord.journal.last_lsn and node.snapshotter.last_stats["entities"] >= n
        assert at_cut == {}, f"containers of the snapshot's size at the cut: {at_cut}"
        assert node.snapshotter.store.entity_count() == coord.entity_count()


async def test_event_chunks_encoded_before_the_cut_keep_exactly_the_retained_events(tmp_path, monkeypatch):
    """Whole event chunks are encoded a few at a time before the cut; commits between
    two slices add events and retention drops the oldest, into the middle of a chunk
    already encoded: the store ends up with exactly the events the log keeps at the cut
    (that first chunk written again without the dropped events)."""
    import rallypoint
    from rallypoint.events import CHUNK, decode_chunk
    from rallypoint.node import Snapshotter, _EventCut

    monkeypatch.setattr(Snapshotter, "SLICE_S", 0.0)  # one chunk per slice
    monkeypatch.setattr(Snapshotter, "FINAL_EVENT_CHUNKS", 0)  # encode every whole chunk early
    async with rallypoint.open_embedded(str(tmp_path / "d"), durability="fsync", retain_events=1000) as rs:
        node = rs.node
        coord = node.coordinator
        _create_scopes(coord, 1100)  # events 1..1100; retention (in steps) keeps 64..1100
        stream = coord.events.streams["default"]
        assert stream.first_seq == 64
        at_cut = {}
        encode_chunks, finish = _EventCut.encode_chunks, _EventCut.finish

        def commit_between_slices(self, until):
            b = encode_chunks(self, until)
            if not at_cut:
                at_cut["first_encoded"] = self.first_sent["default"]
                _create_scopes(coord, 100)  # retention now keeps 190..1200
            return b

        def spy(self, batch):
            at_cut["range"] = (stream.first_seq, stream.last_seq)
            return finish(self, batch)

        monkeypatch.setattr(_EventCut, "encode_chunks", commit_between_slices)
        monkeypatch.setattr(_EventCut, "finish", spy)
        lsn = await node.snapshotter.snapshot()
        assert lsn == coord.journal.last_lsn
        first, last = at_cut["range"]
        assert at_cut["first_encoded"] == 1 and first == 190 and first % CHUNK != 1  # inside that chunk
        stored = [e.seq for _k, v in node.snapshotter.store.iter_events() for e in decode_chunk(v)]
        assert stored == list(range(first, last + 1)), (stored[:3], stored[-3:], first, last)


async def test_a_snapshot_refused_between_slices_keeps_every_unwritten_id_dirty(tmp_path, monkeypatch):
    """A snapshot refused part-way (the free-space estimate between two slices says no)
    leaves every id it had not written yet dirty: the next snapshot writes them before
    the journal below it is deleted. (The rest of the detached dirty set used to be
    dropped: the next snapshot then truncated the journal without them, and a restart
    recovered those runs as the older snapshot had them -- here, not at all.)"""
    import errno

    import rallypoint
    from rallypoint.node import Snapshotter

    n = 2000
    monkeypatch.setattr(Snapshotter, "SLICE_S", 0.0)  # a slice and a yield every SLICE entities
    monkeypatch.setattr(Snapshotter, "SPACE_CHECK", 1)  # the free-space estimate after every slice
    real_space_for = Snapshotter._space_for
    calls = 0

    def refuse_the_second(self, journal, nbytes):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(errno.ENOSPC, "test: no room for the snapshot")
        return real_space_for(self, journal, nbytes)

    data = str(tmp_path / "d")
    async with rallypoint.open_embedded(data, durability="fsync") as rs:
        coord, snap = rs.node.coordinator, rs.node.snapshotter
        _create_scopes(coord, n)
        runs = set(coord.runs.table)
        assert len(runs) == n
        monkeypatch.setattr(Snapshotter, "_space_for", refuse_the_second)
        with pytest.raises(OSError, match="no room"):
            await snap.snapshot()
        assert calls == 2 and snap.store.load_lsn() == 0
        assert runs <= set(coord.dirty_ids())
        monkeypatch.setattr(Snapshotter, "_space_for", real_space_for)
        lsn = await snap.snapshot()
        assert lsn == coord.journal.last_lsn
        assert snap.store.entity_count() == coord.entity_count()
    async with rallypoint.open_embedded(data, durability="fsync") as rs:
        assert set(rs.node.coordinator.runs.table) == runs


async def test_the_dirty_ids_are_kept_in_bounded_dicts_and_all_reach_the_snapshot(tmp_path, monkeypatch):
    """No dict of dirty ids grows past DIRTY_CHUNK (freeing a dict's table is one step on
    the loop: 2.4 ms for one of 1M ids); a snapshot writes the ids of every dict, and
    marking starts afresh after it."""
    import rallypoint
    from rallypoint.actors import coordinator as coordinator_mod
    from rallypoint.node import Snapshotter

    monkeypatch.setattr(coordinator_mod, "DIRTY_CHUNK", 100)
    monkeypatch.setattr(Snapshotter, "SLICE_S", 0.0)
    async with rallypoint.open_embedded(str(tmp_path / "d"), durability="fsync") as rs:
        coord, snap = rs.node.coordinator, rs.node.snapshotter
        _create_scopes(coord, 1000)
        chunks = [coord.dirty, *coord._dirty_full]
        assert len(chunks) >= 10 and max(map(len, chunks)) <= 100
        assert set(coord.runs.table) <= set(coord.dirty_ids()) and coord.dirty_count() >= 1000
        lsn = await snap.snapshot()
        assert lsn == coord.journal.last_lsn
        assert snap.store.entity_count() == coord.entity_count() >= 1000
        assert coord.dirty_count() == 0 and list(coord.dirty_ids()) == []
