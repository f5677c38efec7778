"""Finalizing a group is one step (SPEC §4): no client can observe a FINALIZED group
whose gate run is still ACTIVE, nor a member still deliverable after finalization.

Many receivers (tasks in one process, and over TCP several connections) race the accept
that reaches the threshold; every observation is checked. An observation reads the
group, its gate and the group again, in order (each answered by its own actor); embedded,
an in-process observer also checks the coordinator's state at every scheduling point.
"""

from __future__ import annotations

import random

import msgspec
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.client import types as t
from rallypoint.errors import LeaseLostError, ScopeCancelledError, ScopeInactiveError

from _groups_util import UNFINISHED, uniq

MEMBERS = 40
THRESHOLD = 5


def check_observation(g1: t.GroupStatus, gate: t.RunStatus, g2: t.GroupStatus, violations: list) -> bool:
    """Three reads in order: the group, its gate, the group again (each is answered by
    its own actor, one after the other). Finalizing is one step that also ends the
    gate, and neither ever goes back, so: the group FINALIZED at the first read means
    the gate is inactive at the second; the gate inactive at the second means the group
    is FINALIZED at the third; a FINALIZED group never has a deliverable member (one
    view). Returns True when the group was seen FINALIZED."""
    if g1.state == "FINALIZED" and (gate.stored_state == "ACTIVE" or gate.effective != "INACTIVE"):
        violations.append(f"FINALIZED group {g1.id} with gate {gate.stored_state}/{gate.effective} after it")
    if gate.effective != "ACTIVE" and g2.state != "FINALIZED":
        violations.append(f"gate {gate.id} inactive while group is {g2.state} after it")
    for g in (g1, g2):
        if g.state == "FINALIZED":
            live = [m.task_id for m in g.members if m.task_state in UNFINISHED]
            if live:
                violations.append(f"FINALIZED group {g.id} with deliverable members {live}")
    return g2.state == "FINALIZED"


def check_coordinator(coord, gid: str, violations: list) -> None:
    g = coord.groups.table[gid]
    gate = coord.runs.table[g.gate_scope_id]
    if g.state == "FINALIZED":
        if gate.state == "ACTIVE":
            violations.append("coordinator: FINALIZED group, ACTIVE gate")
        for m in g.members:
            task = coord.queues.tasks[m.task_id]
            if task.state in UNFINISHED or task.id in coord.queues.ready_set:
                violations.append(f"coordinator: member {task.id} {task.state} after finalization")
    elif gate.state != "ACTIVE":
        violations.append("coordinator: gate cancelled, group not FINALIZED")


async def observe(rs, gid: str, gate_id: str, violations: list) -> bool:
    """The group, its gate, the group again, read one after the other (see
    :func:`check_observation`)."""
    tr = rs._transport
    g1 = msgspec.msgpack.decode(await tr.call(p.GroupStatus(group_id=gid)), type=t.GroupStatus)
    s = msgspec.msgpack.decode(await tr.call(p.ScopeStatus(scope_id=gate_id)), type=t.RunStatus)
    g2 = msgspec.msgpack.decode(await tr.call(p.GroupStatus(group_id=gid)), type=t.GroupStatus)
    return check_observation(g1, s, g2, violations)


async def race_round(clients: list, seed: int, violations: list, coord=None) -> dict:
    rnd = random.Random(seed)
    rs0 = clients[0]
    mbx = await rs0.mailboxes.ensure(uniq("race"))
    run = await rs0.scopes.create()
    g = await run.groups.create(mbx, "N_ACCEPTED", threshold=THRESHOLD)
    for i in range(MEMBERS):
        await g.submit({"i": i}, key=f"m{i}")
    # THRESHOLD - 1 accepted already; one more succeeded member waits for the deciding accept
    first = await mbx.receive(g.scope_id, wait=0, max_messages=THRESHOLD)
    for d in first:
        await d.complete("ok")
    for d in first[:-1]:
        await g.accept(d.task_id)
    deciding = first[-1].task_id
    gate = g.scope_id
    delivered: list[tuple[str, str]] = []  # (task_id, how it ended for the receiver)
    finalized_seen = trio.Event()
    stop = trio.Event()

    async def gate_receiver(rs):
        while True:
            saw_final = await observe(rs, g.id, gate, violations)
            if saw_final:
                finalized_seen.set()
            try:
                d = await rs.mailbox(mbx.name).receive(gate, wait=2, lease_seconds=30)
            except ScopeCancelledError:
                return
            if saw_final:
                violations.append("a receive on the gate was answered after FINALIZED was observed")
            if d is None:
                continue
            for _ in range(rnd.randrange(3)):
                await trio.sleep(0)
            try:
                await d.complete({"by": id(rs)})
                delivered.append((d.task_id, "completed"))
            except (ScopeInactiveError, LeaseLostError):
                delivered.append((d.task_id, "refused"))

    async def parent_receiver(rs):
        # a receiver on the parent run competes for the same members while the gate is open
        while not stop.is_set():
            saw_final = await observe(rs, g.id, gate, violations)
            d = await rs.mailbox(mbx.name).receive(run.id, wait=0, lease_seconds=30)
            if d is not None:
                if saw_final:
                    violations.append(f"member {d.task_id} delivered on the parent after FINALIZED")
                try:
                    await d.complete("parent")
                    delivered.append((d.task_id, "completed"))
                except (ScopeInactiveError, LeaseLostError):
                    delivered.append((d.task_id, "refused"))
            await trio.sleep(0.001)

    async def acceptor():
        for _ in range(rnd.randrange(1, 30)):
            await trio.sleep(0)
        v = await rs0.group(g.id).accept(deciding)
        assert (v.group_state, v.outcome, v.outcome_reason) == ("FINALIZED", "SUCCESS", "threshold_reached")

    async def coordinator_observer():
        while not stop.is_set():
            check_coordinator(coord, g.id, violations)
            await trio.sleep(0)

    with trio.fail_after(20):
        async with trio.open_nursery() as outer:
            if coord is not None:
                outer.start_soon(coordinator_observer)
            for rs in clients:
                outer.start_soon(parent_receiver, rs)
            async with trio.open_nursery() as n:
                for rs in clients:
                    for _ in range(3):
                        n.start_soon(gate_receiver, rs)
                n.start_soon(acceptor)
            # every gate receiver returned: each was refused with SCOPE_CANCELLED
            stop.set()

    st = await g.status()
    assert (st.state, st.outcome, st.outcome_reason) == ("FINALIZED", "SUCCESS", "threshold_reached")
    states = {m.task_id: m.task_state for m in st.members}
    assert not UNFINISHED & set(states.values())
    for task_id, how in delivered:
        assert states[task_id] == ("SUCCEEDED" if how == "completed" else "CANCELLED"), (task_id, how)
    completed = {tid for tid, how in delivered if how == "completed"}
    assert {tid for tid, s in states.items() if s == "SUCCEEDED"} == completed | {d.task_id for d in first}
    return states


async def test_finalization_is_atomic_for_many_receivers_embedded():
    async with rallypoint.open_embedded() as rs:
        coord = rs.node.coordinator
        violations: list = []
        cancelled = 0
        for seed in range(8):
            states = await race_round([rs, rs, rs], seed, violations, coord=coord)
            cancelled += sum(s == "CANCELLED" for s in states.values())
        assert violations == []
        assert cancelled > 0  # the race really left members behind to cancel


async def test_finalization_is_atomic_for_receivers_on_several_tcp_connections(daemon):
    violations: list = []
    async with rallypoint.connect(daemon.url) as a, rallypoint.connect(daemon.url) as b, \
            rallypoint.connect(daemon.url) as c, rallypoint.connect(daemon.url) as d:
        for seed in range(4):
            await race_round([a, b, c, d], 100 + seed, violations)
    assert violations == []
