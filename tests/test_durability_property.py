"""Durable state, as a property: whatever sequence of commands a client sends, a
coordinator recovered from the data dir (journal only, or snapshot + journal tail) holds
exactly the live coordinator's state, entity by entity, and the same derived indexes
(ready queues, idempotency keys, counts).

Each example drives an embedded coordinator (``durability="fsync"``) through the public
``rs`` API with a random command sequence; at random points it forces a snapshot or
recovers a copy of the data dir (the live node holds the LOCK) and compares. At the end
it closes the node (graceful: final snapshot) and reopens the data dir itself.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import msgspec
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rallypoint
from rallypoint.actors import Coordinator
from rallypoint.clock import Clock
from rallypoint.errors import RallypointError
from rallypoint.node import recover_coordinator
from conftest import SLOW, direct  # SLOW (RALLYPOINT_SLOW=1): the long form's examples

# ----------------------------------------------------------------------------- compare


def state_of(coord) -> dict:
    """Every entity, as plain data, keyed by id (what a snapshot must preserve)."""
    out = {}
    for _prefix, (table, _typ) in coord.entity_tables().items():
        for eid, ent in table.items():
            out[eid] = msgspec.structs.asdict(ent)
    return out


def indexes_of(coord) -> dict:
    """The derived indexes that decide behaviour after a restart."""
    queued = {tid for tid, t in coord.queues.tasks.items() if t.state == "QUEUED"}
    return {
        "queued": queued,
        # QUEUED tasks a receiver can get now (ready heaps / ready_set), per mailbox+run
        "ready": {
            (coord.queues.tasks[tid].mailbox_id, coord.queues.tasks[tid].scope_id, tid)
            for tid in coord.queues.ready_set
        },
        "ready_in_heaps": {
            (mbx, sid, tid)
            for mbx, per in coord.queues.ready_index.entries().items()
            for sid, ids in per.items()
            for tid in ids
        },
        "task_keys": dict(coord.queues.task_keys),
        "mailbox_by_name": dict(coord.queues.by_name),
        "scope_children": {k: sorted(v) for k, v in coord.runs.children.items() if v},
        "scope_task_counts": {k: dict(v) for k, v in coord.queues.run_counts.items() if v},
        "scope_unfinished": {k: set(v) for k, v in coord.queues.run_unfinished.items() if v},
        "scope_leased": {k: set(v) for k, v in coord.queues.run_leased.items()},
        "mailbox_counts": {k: list(v) for k, v in coord.queues.queue_counts.items() if any(v)},
        "group_members": {
            gid: {tid: msgspec.structs.asdict(m) for tid, m in idx.items()}
            for gid, idx in coord.groups.member_index.items()
        },
    }


def assert_same(live, recovered, where: str, lease_shift_ms: int = 0) -> None:
    """``lease_shift_ms``: the extension a restart gave outstanding leases (the time
    the node was down); it is taken off the recovered leases before comparing."""
    a, b = state_of(live), state_of(recovered)
    if lease_shift_ms:
        for ent in b.values():
            if ent.get("state") == "RUNNING" and "lease_expires_ms" in ent:
                ent["lease_expires_ms"] -= lease_shift_ms
    missing = sorted(set(a) - set(b))
    extra = sorted(set(b) - set(a))
    assert not missing and not extra, f"{where}: missing {missing[:5]}, extra {extra[:5]}"
    for eid in a:
        assert a[eid] == b[eid], f"{where}: entity {eid} differs:\nlive      {a[eid]}\nrecovered {b[eid]}"
    ia, ib = indexes_of(live), indexes_of(recovered)
    for name in ia:
        assert ia[name] == ib[name], f"{where}: index {name} differs:\nlive      {ia[name]}\nrecovered {ib[name]}"


async def recover_copy(node, scratch: Path, clock: Clock):
    """Recover a copy of the live node's data dir into a fresh coordinator (armed)."""
    journal = node.coordinator.journal
    await journal.wait_durable(journal.last_lsn)
    dst = scratch / f"copy{len(list(scratch.iterdir()))}"
    shutil.copytree(node.data_dir, dst)
    coord = Coordinator(clock=clock)
    rec, info = recover_coordinator(str(dst), coord)
    rec.store.close()
    coord.rearm_all()
    shutil.rmtree(dst)
    return coord, info


# ----------------------------------------------------------------------------- commands

OPS = st.one_of(
    st.tuples(st.just("root"), st.booleans()),
    st.tuples(st.just("child"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("complete_run"), st.integers(0, 50)),
    st.tuples(st.just("ensure"), st.integers(0, 1), st.sampled_from([1, 2, 3])),
    st.tuples(st.just("submit"), st.integers(0, 1), st.integers(0, 50), st.sampled_from([None, "a", "b"]), st.integers(0, 1)),
    st.tuples(st.just("submit"), st.integers(0, 1), st.integers(0, 50), st.none(), st.integers(0, 1)),
    st.tuples(st.just("receive"), st.integers(0, 1), st.integers(0, 50)),
    st.tuples(st.just("receive"), st.integers(0, 1), st.integers(0, 50)),
    st.tuples(st.just("submit"), st.integers(0, 1), st.integers(0, 50), st.none(), st.integers(0, 1)),
    st.tuples(st.just("settle"), st.integers(0, 50), st.sampled_from(["complete", "retry", "retry_later", "reject", "renew"])),
    st.tuples(st.just("settle"), st.integers(0, 50), st.sampled_from(["complete", "retry", "retry_later", "reject", "renew"])),
    st.tuples(st.just("cancel_task"), st.integers(0, 50)),
    st.tuples(st.just("group"), st.integers(0, 50), st.integers(0, 1),
              st.sampled_from([("FIRST_ACCEPTED", None), ("N_ACCEPTED", 2), ("ALL_TERMINAL", None)])),
    st.tuples(st.just("gsubmit"), st.integers(0, 50), st.sampled_from(["m1", "m2", "m3"])),
    st.tuples(st.just("verdict"), st.integers(0, 50), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("gclose"), st.integers(0, 50)),
    st.tuples(st.just("snapshot")),
    st.tuples(st.just("check")),
)


#: every example starts with something to work on (two mailboxes, two runs, tasks)
PREAMBLE = [
    ("ensure", 0, 2), ("ensure", 1, 3), ("root", False), ("root", True), ("child", 0),
    ("submit", 0, 0, None, 0), ("submit", 1, 2, "a", 0), ("submit", 0, 1, "b", 1),
]


def pick(seq, i):
    return seq[i % len(seq)] if seq else None


async def run_sequence(ops) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, scratch = tmp / "data", tmp / "scratch"
        scratch.mkdir()
        clock = Clock()
        runs, mailboxes, tickets, deliveries, groups, members = [], [], [], [], [], []
        checks = 0
        done: dict[str, int] = {}
        refused: dict[str, str] = {}
        async with rallypoint.open_embedded(str(data), durability="fsync", clock=clock) as rs:
            node = rs.node
            seen: set[str] = set()
            commit = node.coordinator.commit

            def spy(records, _commit=commit):
                lsn = _commit(records)
                seen.update(type(r).__name__ for r in records)
                return lsn

            node.coordinator.commit = spy
            for op in ops:
                kind = op[0]
                try:
                    if kind == "root":
                        runs.append(await rs.scopes.create(name="r", deadline="2999-01-01T00:00:00Z" if op[1] else None))
                    elif kind == "child" and runs:
                        runs.append(await pick(runs, op[1]).child())
                    elif kind == "cancel" and runs:
                        await pick(runs, op[1]).cancel(reason="because")
                    elif kind == "complete_run" and runs:
                        await pick(runs, op[1]).complete()
                    elif kind == "ensure":
                        mailboxes.append(await rs.mailboxes.ensure(f"mb{op[1]}", max_attempts=op[2]))
                    elif kind == "submit" and runs and mailboxes:
                        tickets.append(await pick(mailboxes, op[1]).submit({"v": op[4]}, key=op[3], scope=pick(runs, op[2])))
                    elif kind == "receive" and runs and mailboxes:
                        d = await pick(mailboxes, op[1]).receive(pick(runs, op[2]), lease_seconds=600, wait=0)
                        if d is not None:
                            deliveries.append(d)
                    elif kind == "settle" and deliveries:
                        d = pick(deliveries, op[1])
                        what = op[2]
                        if what == "complete":
                            await d.complete({"ok": d.task_id})
                        elif what == "retry":
                            await d.retry("again")
                        elif what == "retry_later":
                            await d.retry("later", delay=3600)
                        elif what == "reject":
                            await d.reject("no")
                        else:
                            await d.renew(600)
                    elif kind == "cancel_task" and tickets:
                        await pick(tickets, op[1]).cancel()
                    elif kind == "group" and runs and mailboxes:
                        cond, threshold = op[3]
                        groups.append(await pick(runs, op[1]).groups.create(pick(mailboxes, op[2]), cond, threshold=threshold))
                    elif kind == "gsubmit" and groups:
                        g = pick(groups, op[1])
                        t = await g.submit({"m": op[2]}, key=op[2])
                        members.append((g, t))
                        tickets.append(t)
                    elif kind == "verdict" and members:
                        g, t = pick(members, op[1])
                        await (g.accept(t) if op[3] else g.reject(t))
                    elif kind == "gclose" and groups:
                        await pick(groups, op[1]).close()
                    elif kind == "snapshot":
                        await node.snapshotter.snapshot()
                    elif kind == "check":
                        coord, info = await recover_copy(node, scratch, clock)
                        assert_same(node.coordinator, coord, f"after {checks} checks (snapshot LSN {info['snapshot_lsn']})")
                        checks += 1
                except RallypointError as e:
                    refused[kind] = e.code  # refused: must have changed nothing (the comparison shows it)
                else:
                    done[kind] = done.get(kind, 0) + 1
            # Always finish with a crash-style recovery of the final state ...
            coord, _ = await recover_copy(node, scratch, clock)
            assert_same(node.coordinator, coord, "final copy")
            live = node.coordinator
        # ... and a graceful close + reopen of the data dir itself.
        async with rallypoint.open_embedded(str(data), durability="fsync", clock=clock) as rs2:
            assert rs2.node.recovery_info["replayed"] == 0
            assert_same(live, rs2.node.coordinator, "after graceful close and reopen",
                        rs2.node.recovery_info["leases_extended_ms"])
        return {"done": done, "refused": refused, "checks": checks, "entities": live.entity_count(),
                "record_types": seen}


@settings(max_examples=200 if SLOW else 30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(OPS, min_size=10, max_size=80))
def test_recovered_state_equals_live_state(ops):
    trio.run(run_sequence, PREAMBLE + ops)


def test_recovery_after_a_busy_fixed_sequence():
    """A deterministic sequence that touches every record type at least once."""
    ops = [
        ("ensure", 0, 2), ("ensure", 1, 1), ("root", True), ("root", False), ("child", 0), ("child", 2),
        # a group decided by the reaction: two members done and accepted -> GroupFinalized
        ("group", 0, 0, ("N_ACCEPTED", 2)), ("gsubmit", 0, "m1"), ("gsubmit", 0, "m2"), ("gclose", 0),
        ("receive", 0, 0), ("receive", 0, 0), ("settle", 0, "complete"), ("settle", 1, "complete"),
        ("verdict", 0, 0, True), ("verdict", 1, 1, True), ("verdict", 1, 1, False), ("check",),
        ("submit", 0, 0, "a", 0), ("submit", 0, 0, "a", 0), ("submit", 0, 2, "b", 1), ("submit", 1, 1, None, 0),
        ("submit", 0, 3, None, 1), ("receive", 0, 0), ("receive", 0, 0), ("receive", 1, 1),
        ("settle", 2, "renew"), ("settle", 2, "retry"), ("receive", 0, 0), ("settle", 4, "complete"),
        ("snapshot",), ("settle", 3, "reject"), ("settle", 5, "retry_later"), ("check",),
        ("group", 1, 0, ("FIRST_ACCEPTED", None)), ("gsubmit", 1, "m3"), ("cancel", 1), ("submit", 1, 0, "z", 1),
        ("cancel_task", -1), ("snapshot",), ("cancel", 0), ("complete_run", 2), ("check",),
    ]
    summary = trio.run(run_sequence, ops)
    assert summary["checks"] == 3, summary
    assert {"ScopeCreated", "ScopeEnded", "MailboxCreated", "TaskSubmitted", "TaskDelivered", "LeaseRenewed",
            "TaskCompleted", "TaskRetried", "TaskRejected", "TaskCancelled", "GroupCreated", "GroupMemberJoined",
            "GroupSealed", "GroupVerdict", "GroupFinalized"} <= summary["record_types"], summary


def test_the_comparison_sees_a_divergence():
    """Guard against a vacuous property: a recovered state that differs in one field,
    or in the ready queue alone, fails assert_same."""
    import pytest

    async def main():
        with tempfile.TemporaryDirectory() as tmp:
            scratch = Path(tmp) / "scratch"
            scratch.mkdir()
            clock = Clock()
            async with rallypoint.open_embedded(str(Path(tmp) / "d"), durability="fsync", clock=clock) as rs:
                run = await rs.scopes.create()
                mbx = await rs.mailboxes.ensure("m")
                t = await mbx.submit(1, scope=run)
                coord, _ = await recover_copy(rs.node, scratch, clock)
                assert_same(rs.node.coordinator, coord, "untouched")
                coord.queues.tasks[t.id].attempt += 1
                with pytest.raises(AssertionError, match="differs"):
                    assert_same(rs.node.coordinator, coord, "tampered entity")
                coord.queues.tasks[t.id].attempt -= 1
                coord.queues.ready_set.discard(t.id)
                with pytest.raises(AssertionError, match="index ready"):
                    assert_same(rs.node.coordinator, coord, "tampered ready queue")

    trio.run(main)


def test_a_snapshot_taken_under_concurrent_writes_is_a_consistent_cut(monkeypatch):
    """More dirty entities than one round (the Snapshotter yields between slices) while
    another task keeps changing them: snapshot + journal tail recovers the live state,
    and a later snapshot of the same entities overwrites the earlier values."""
    from rallypoint.node import Snapshotter

    monkeypatch.setattr(Snapshotter, "SLICE_S", 0.0)  # yield after every slice

    async def main():
        with tempfile.TemporaryDirectory() as tmp:
            scratch = Path(tmp) / "scratch"
            scratch.mkdir()
            clock = Clock()
            async with rallypoint.open_embedded(str(Path(tmp) / "d"), durability="fsync", clock=clock) as rs:
                node = rs.node
                roots = [await rs.scopes.create() for _ in range(20)]
                mbx = await rs.mailboxes.ensure("m")
                for r in roots:
                    await mbx.submit_many(list(range(200)), scope=r)  # 4000 tasks, all dirty
                assert node.coordinator.dirty_count() > Snapshotter.FINAL
                done = trio.Event()
                writes = []

                from rallypoint import protocol as p
                from rallypoint.service import Session

                coord, session = node.coordinator, Session()

                async def writer():
                    # Commits straight on the coordinator (no durability wait per step)
                    # and a yield after each: the writer interleaves with every slice.
                    i = 0
                    while not done.is_set():
                        writes.append(i)
                        r = roots[i % len(roots)]
                        if coord.runs.inactive_error(r.id) is None:
                            if i % 7 == 3:  # touches 200 tasks in one commit
                                direct(coord, session, p.ScopeCancel(scope_id=r.id))
                            else:
                                direct(coord, session, p.ScopeCreate(parent_id=r.id))
                                got = direct(coord, session, p.Receive(mailbox="m", scope_id=r.id))
                                for d in got.deliveries:
                                    direct(coord, 
                                        session, p.DeliveryComplete(task_id=d.task_id, token=d.token)
                                    )
                        i += 1
                        await trio.sleep(0)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(writer)
                    lsn = await node.snapshotter.snapshot()
                    done.set()
                assert lsn is not None and node.snapshotter.last_stats["entities"] >= 4000
                assert len(writes) >= 2, "the writer never ran during the snapshot"
                coord, info = await recover_copy(node, scratch, clock)
                assert info["snapshot_lsn"] == lsn
                assert_same(node.coordinator, coord, "snapshot under concurrent writes")
                await node.snapshotter.snapshot()
                coord, info = await recover_copy(node, scratch, clock)
                assert info["replayed"] == 0
                assert_same(node.coordinator, coord, "second snapshot")

    trio.run(main)
