"""Recovery's replay (Coordinator.replay_many) and its garbage-collector handling."""

from __future__ import annotations

import gc

import msgspec
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors import Coordinator
from rallypoint.events import Entry, EventLog
from rallypoint.node import recover_coordinator
from rallypoint.persistence.journal import read_journal
from rallypoint.service import Session
from conftest import direct


def _state(coord) -> dict:
    return {eid: msgspec.structs.asdict(ent)
            for _prefix, (table, _typ) in coord.entity_tables().items() for eid, ent in table.items()}


def _events(coord) -> list:
    return [(space, e.seq, e.type, e.kind, e.id, e.run, e.at_ms, msgspec.to_builtins(e.data))
            for space, s in sorted(coord.events.streams.items()) for e in s.entries[s.start:]]


async def _busy_journal(data_dir, more=None) -> None:
    """A journal of runs, tasks delivered, completed and cancelled (then ``more(coord)``)."""
    async with rallypoint.open_embedded(str(data_dir), durability="fsync") as rs:
        coord, session = rs.node.coordinator, Session()
        roots = [await rs.scopes.create() for _ in range(4)]
        mbx = await rs.mailboxes.ensure("m")
        for r in roots:
            await mbx.submit_many(list(range(30)), scope=r)
        for i in range(60):
            r = roots[i % len(roots)]
            if coord.runs.inactive_error(r.id) is not None:
                continue
            if i % 17 == 16:
                direct(coord, session, p.ScopeCancel(scope_id=r.id))  # one commit ends many tasks
                continue
            direct(coord, session, p.ScopeCreate(parent_id=r.id))
            got = direct(coord, session, p.Receive(mailbox="m", scope_id=r.id))
            for d in got.deliveries:
                direct(coord, session, p.DeliveryComplete(task_id=d.task_id, token=d.token))
        if more is not None:
            more(coord)
        await coord.journal.wait_durable(coord.journal.last_lsn)


def test_replay_many_equals_replaying_one_entry_at_a_time(tmp_path):
    """Batched replay (events numbered several entries at a time, batch boundaries
    anywhere) gives the same entities and the same events -- numbers, instants, payloads
    -- as applying the entries one by one."""
    d = tmp_path / "d"
    trio.run(_busy_journal, d)
    payloads = [payload for _lsn, payload in read_journal(d)]
    assert len(payloads) > 100
    one = Coordinator()
    for payload in payloads:
        one.replay(payload)
    for batch in (1, 7, 256):
        many = Coordinator()
        assert many.replay_many(iter(payloads), batch=batch) == len(payloads)
        assert _state(many) == _state(one), batch
        assert _events(many) == _events(one), batch
        assert many.events.pending == [] and many.events.mark == 0 and not many.replaying


def test_an_events_instant_comes_from_its_own_entry_only():
    """While replay_many holds several entries' events, an event without an instant of
    its own takes the previous event of the same entry, else the time now -- never the
    last event of an earlier entry."""
    log = EventLog()
    log.pending.append(Entry("s", "scope.created", "scope", "scp_1", "scp_1", 1000))
    assert log.instant(5000) == 1000  # the same entry (mark 0: the live path)
    log.mark = len(log.pending)  # the next entry starts here
    assert log.instant(5000) == 5000
    log.pending.append(Entry("s", "scope.created", "scope", "scp_2", "scp_2", 2000))
    assert log.instant(5000) == 2000


def test_recovery_runs_no_gc_pass_until_the_end_and_restores_the_gc(tmp_path):
    """Recovery builds state only: the collector is off meanwhile (its passes over
    millions of new objects were a fifth of the time), one full pass runs at the end,
    and the collector is left as it was found."""
    d = tmp_path / "d"
    trio.run(_busy_journal, d)
    passes = []

    def count(phase, info):
        if phase == "start":
            passes.append(info["generation"])

    assert gc.isenabled()
    coord = Coordinator()
    gc.collect()  # generation 0 empty: no pass falls on the few allocations before recovery starts
    gc.callbacks.append(count)
    try:
        rec, info = recover_coordinator(str(d), coord)
        rec.store.close()
    finally:
        gc.callbacks.remove(count)
    assert info["snapshot_entities"] + info["replayed"] > 100
    assert passes == [2], passes  # the final full pass only
    assert gc.isenabled()
    gc.disable()
    try:
        rec, _ = recover_coordinator(str(d), Coordinator())
        rec.store.close()
        assert not gc.isenabled()  # left off when it was off
    finally:
        gc.enable()


def test_a_run_state_holds_no_gc_tracked_object():
    """A run's state (one per run, millions in a big journal) is not walked by the GC:
    neither it nor its default fields are tracked."""
    from rallypoint.actors.run import ScopeState

    s = ScopeState(id="scp_1", space="s", parent_id=None, name=None, deadline_ms=None, child_limit=10,
                   created_at_ms=0)
    assert not gc.is_tracked(s) and not gc.is_tracked(s.links)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=ScopeState) == s


def test_iter_payloads_are_the_records_payloads(tmp_path):
    """ScanResult.iter_payloads (what recovery replays) yields exactly the payloads of
    iter_records, in order, past the snapshot's LSN."""
    from rallypoint.persistence.journal import scan_journal

    d = tmp_path / "d"
    trio.run(_busy_journal, d)
    for after in (0, 50):
        scan = scan_journal(d, after, cut_torn_tail=False)
        records = list(scan.iter_records())
        assert records and records[0][0] == after + 1
        assert list(scan.iter_payloads()) == [payload for _lsn, payload in records]


def _journal_only(src, dst) -> None:
    """``dst``: a data dir holding ``src``'s journal records and no snapshot (so that
    recovery replays every one)."""
    from rallypoint.persistence.journal import Journal

    async def go():
        j = Journal(dst, mode="fsync", next_lsn=1)
        async with trio.open_nursery() as nursery:
            await nursery.start(j.run)
            for _lsn, payload in read_journal(src):
                j.append(payload)
            await j.aclose()

    trio.run(go)


def _corrupt_middle(d) -> tuple:
    """Damage a record in the middle of the journal (a bad CRC, good records after it):
    returns (its LSN, the JournalCorruptError scan_journal raises, the payloads as
    they were)."""
    import pytest

    from rallypoint.persistence.journal import HEADER_SIZE, JournalCorruptError, list_segments, scan_journal

    records = list(read_journal(d))
    (_, path), = list_segments(d)
    mid = len(records) // 2
    off = sum(HEADER_SIZE + len(payload) for _lsn, payload in records[: mid - 1])
    data = bytearray(path.read_bytes())
    data[off + HEADER_SIZE] ^= 0xFF  # record `mid`'s payload
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorruptError) as info:
        scan_journal(d, 0, cut_torn_tail=False)
    return mid, info.value, [payload for _lsn, payload in records]


def test_recovery_refuses_a_corrupt_middle_with_the_scans_error(tmp_path):
    """Recovery reads the journal once, checking each record as it replays it: damage
    in the middle still fails recovery with the error a separate validation pass gives,
    no record at or past the damage is applied, the snapshot store is closed, and the
    data dir is left as it was."""
    import pytest

    from rallypoint.persistence.journal import JournalCorruptError

    src, d = tmp_path / "src", tmp_path / "d"
    trio.run(_busy_journal, src)
    _journal_only(src, d)
    mid, expected, payloads = _corrupt_middle(d)
    before = {p: p.read_bytes() for p in d.rglob("*.wal")}
    coord = Coordinator()
    applied = []
    real = coord.replay_many

    def spy(payloads, **kw):
        def seen():
            for x in payloads:
                applied.append(bytes(x))
                yield x
        return real(seen(), **kw)

    coord.replay_many = spy
    with pytest.raises(JournalCorruptError) as info:
        recover_coordinator(str(d), coord)
    assert str(info.value) == str(expected)
    assert (info.value.path, info.value.offset, info.value.reason) == (expected.path, expected.offset, expected.reason)
    assert applied == payloads[: mid - 1]  # LSN 1 .. mid - 1: none at or past the damage
    assert {p: p.read_bytes() for p in d.rglob("*.wal")} == before
    # The store was closed: the same data dir opens again (and refuses again).
    with pytest.raises(JournalCorruptError):
        recover_coordinator(str(d), Coordinator())


async def _two_space_journal(data_dir) -> None:
    """The busy journal, then runs (pure events) and tasks (not) interleaved in two
    spaces."""

    def more(coord):
        a, b = Session(), Session(space="other")
        for i in range(40):
            if i % 3:
                direct(coord, b, p.ScopeCreate())
                continue
            r = direct(coord, a, p.ScopeCreate())
            direct(coord, a, p.ScopeCreate(parent_id=r.id))
            if i % 2 == 0:
                direct(coord, a, p.ScopeCancel(scope_id=r.id))  # the child's end: implied events

    await _busy_journal(data_dir, more)


def test_recovery_derives_only_the_events_retention_keeps(tmp_path):
    """Recovery derives the event of a run's creation (a ``pure`` source: the record
    alone says it) only if retention keeps it; the events it holds afterwards -- types,
    ids, instants, payloads, sequence numbers, order, in every space -- and the counts
    emitted and dropped are those of replaying every entry with every event derived."""
    src, d = tmp_path / "src", tmp_path / "d"
    trio.run(_two_space_journal, src)
    _journal_only(src, d)
    payloads = [payload for _lsn, payload in read_journal(d)]
    derived = []
    for retain in (1, 7, 60, 100_000):
        one = Coordinator(retain_events=retain)
        for payload in payloads:
            one.replay(payload)
        one.events.recovered()
        coord = Coordinator(retain_events=retain)
        real = coord.derive_deferred
        coord.derive_deferred = lambda rec: derived.append(rec) or real(rec)
        rec, info = recover_coordinator(str(d), coord)
        rec.store.close()
        assert info["replayed"] == len(payloads)
        assert _events(coord) == _events(one), retain
        assert {sp: (s.first_seq, s.next_seq, s.durable_seq) for sp, s in coord.events.streams.items()} == \
            {sp: (s.first_seq, s.next_seq, s.durable_seq) for sp, s in one.events.streams.items()}
        assert coord.events.statistics() == one.events.statistics()
        assert set(coord.events.streams) == {"default", "other"}
        assert all(type(e) is Entry and e.lsn == 0 for s in coord.events.streams.values() for e in s.entries[s.start:])
        assert _state(coord) == _state(one)
        kept = sum(len(s) for s in coord.events.streams.values())
        assert 0 < len(derived) <= kept, (retain, len(derived), kept)  # derived: kept ones only
        if retain < 100_000:
            assert coord.events.statistics()["dropped"] > 0
        derived.clear()


def test_a_wrongly_pure_event_source_is_caught():
    """An event source marked ``pure`` that returns anything but one event in the
    record's space fails recovery loudly instead of keeping a wrong event."""
    import pytest

    from rallypoint.events import EventLog
    from rallypoint.records import ScopeCreated

    log = EventLog(retain_count=10)
    r = ScopeCreated(id="scp_1", space="s", parent_id=None, name=None, deadline_ms=None, child_limit=1, at_ms=0)
    log.pending.append(r)
    log.publish_replayed(0)
    with pytest.raises(RuntimeError):
        log.recovered(lambda rec: Entry("elsewhere", "scope.created", "scope", rec.id, rec.id, 0))
    log2 = EventLog(retain_count=10)
    log2.pending.append(r)
    log2.publish_replayed(0)
    log2.recovered(lambda rec: Entry("s", "scope.created", "scope", rec.id, rec.id, 0))
    (e,) = log2.streams["s"].entries
    assert e.seq == 1 and e.id == "scp_1"


def test_scope_createds_written_out_apply_equals_add():
    """``Runs._apply_created`` is :meth:`Runs.add` written out (the most common record,
    replayed a million times in a recovery): for roots, named roots, children and runs
    with deadlines it leaves exactly what ``add`` of the same run leaves -- the tables,
    counts, tree, names, dirty ids and armed deadlines -- so the two cannot drift."""
    from rallypoint.actors.run import ScopeState
    from rallypoint.records import ScopeCreated

    async def main():
        a, b = Coordinator(durability="interval"), Coordinator(durability="interval")
        now = a.now_ms()
        recs = [ScopeCreated(id="scp_root1", space="default", parent_id=None, name="r", deadline_ms=None,
                             child_limit=10, at_ms=now),
                ScopeCreated(id="scp_root2", space="other", parent_id=None, name=None, deadline_ms=now + 5000,
                             child_limit=3, at_ms=now),
                ScopeCreated(id="scp_kid1", space="default", parent_id="scp_root1", name=None,
                             deadline_ms=now + 1000, child_limit=2, at_ms=now, group_id="grp_x"),
                ScopeCreated(id="scp_kid2", space="default", parent_id="scp_kid1", name="k", deadline_ms=None,
                             child_limit=1, at_ms=now)]
        for r in recs:
            a.runs._apply_created(r)
            b.runs.add(ScopeState(id=r.id, space=r.space, parent_id=r.parent_id, name=r.name,
                                  deadline_ms=r.deadline_ms, child_limit=r.child_limit, created_at_ms=r.at_ms,
                                  group_id=r.group_id))

        def seen(c):
            runs = c.runs
            return ({k: msgspec.structs.asdict(v) for k, v in runs.table.items()}, runs.counts, runs.roots,
                    runs.named_roots, runs.children, list(c.dirty_ids()),
                    # (the due instants: each coordinator's own clock turns the deadline into Trio time)
                    sorted((prio, f.__name__, arg) for _d, prio, _s, f, arg in c.heap.entries()))

        assert seen(a) == seen(b)
        assert len(seen(a)[6]) == 2  # the two deadlines armed

    trio.run(main)
