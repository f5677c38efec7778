"""Priorities and fair shares within a queue (issue 44): exact priority order, FIFO within
a level, inheritance from the run and override, a change while queued, aging, weighted
shares (1:1:1 and 3:1), a burst key against a one-task key, bad input, and all of it
across a SIGKILL of a real daemon (journal replay) and a snapshot."""

from __future__ import annotations

import signal
from collections import Counter

import pytest
import trio

import rallypoint
from rallypoint.client.api import Run, Ticket
from rallypoint.actors.queue_ready import ReadyIndex
from rallypoint.actors.queue_state import TaskPhase, check_task_move
from rallypoint.errors import ConflictError, ValidationError
from rallypoint.fsm import IllegalTransition

from conftest import Daemon

pytestmark = pytest.mark.timeout(300)


async def _drain(m, run, n: int) -> list:
    """Receive and complete ``n`` deliveries one at a time; their inputs in order."""
    out = []
    for _ in range(n):
        d = await m.receive(run, wait=0)
        assert d is not None, f"only {len(out)} of {n} deliveries"
        out.append(d.input)
        await d.complete(None)
    return out


async def test_priority_order_is_exact_and_fifo_within_a_level(autojump_clock, ers):
    m = await ers.mailboxes.ensure("prio-order")
    run = await ers.scopes.create()
    plan = [(5, "e1"), (3, "c1"), (1, "a1"), (5, "e2"), (2, "b1"), (1, "a2"), (3, "c2"), (4, "d1"), (1, "a3")]
    for prio, name in plan:
        await m.submit(name, scope=run, priority=prio)
    got = await _drain(m, run, len(plan))
    assert got == ["a1", "a2", "a3", "b1", "c1", "c2", "d1", "e1", "e2"]
    assert await m.receive(run, wait=0) is None


async def test_a_batch_receive_takes_the_most_urgent_first(autojump_clock, ers):
    m = await ers.mailboxes.ensure("prio-batch")
    run = await ers.scopes.create()
    await m.submit_many([f"low{i}" for i in range(5)], scope=run, priority=5)
    await m.submit_many([f"high{i}" for i in range(3)], scope=run, priority=1)
    got = await m.receive(run, wait=0, max_messages=4)
    assert [d.input for d in got] == ["high0", "high1", "high2", "low0"]
    assert [d.priority for d in got] == [1, 1, 1, 5]


async def test_a_priority_is_inherited_from_the_run_and_overridden_per_task(autojump_clock, ers):
    m = await ers.mailboxes.ensure("prio-inherit")
    root = await ers.scopes.create(priority=2)
    child = await root.child()  # inherits 2
    grandchild = await child.child(priority=4)  # its own for its subtree
    plain = await ers.scopes.create()
    t_root = await m.submit("root", scope=root)
    t_child = await m.submit("child", scope=child)
    t_over = await m.submit("override", scope=child, priority=1)
    t_grand = await m.submit("grand", scope=grandchild)
    t_plain = await m.submit("plain", scope=plain)
    assert [t.info.priority for t in (t_root, t_child, t_over, t_grand, t_plain)] == [2, 2, 1, 4, 3]
    assert (await child.status()).priority == 2 and (await grandchild.status()).priority == 4
    # a receive for the root's subtree orders across its runs by priority
    got = await _drain(m, root, 4)
    assert got == ["override", "root", "child", "grand"]


async def test_a_tasks_own_run_inherits_its_priority(autojump_clock, ers):
    m = await ers.mailboxes.ensure("prio-own-run")
    sub = await ers.mailboxes.ensure("prio-own-run-sub")
    run = await ers.scopes.create()
    await m.submit("parent", scope=run, priority=1)
    d = await m.receive(run, wait=0)
    own = await d.run()
    t = await sub.submit("from inside", scope=own)
    assert t.info.priority == 1


async def test_set_priority_while_queued_moves_the_task(autojump_clock, ers):
    m = await ers.mailboxes.ensure("prio-change")
    run = await ers.scopes.create()
    tickets = [await m.submit(f"t{i}", scope=run, priority=4) for i in range(4)]
    info = await tickets[3].set_priority(1)
    assert info.priority == 1 and info.state == "QUEUED"
    await tickets[0].set_priority(5)
    got = await _drain(m, run, 2)
    assert got == ["t3", "t1"]
    # back to its old level: first in line there again by submission order, once
    await tickets[0].set_priority(4)
    assert await _drain(m, run, 2) == ["t0", "t2"]
    assert await m.receive(run, wait=0) is None
    with pytest.raises(ConflictError):  # finished: a priority orders only the waiting
        await tickets[0].set_priority(2)
    with pytest.raises(ValidationError) as ei:
        await (await m.submit("x", scope=run)).set_priority(6)
    assert ei.value.details["field"] == "priority"


async def test_aging_promotes_a_waiting_task_one_level_per_interval(autojump_clock, ers):
    m = await ers.mailboxes.ensure("prio-aging", aging_seconds=10)
    assert m.info.aging_ms == 10_000
    run = await ers.scopes.create()
    await m.submit("old-low", scope=run, priority=5)
    await trio.sleep(25)  # two levels gained: effectively 3
    await m.submit("new-3", scope=run, priority=3)
    await m.submit("new-2", scope=run, priority=2)
    assert await _drain(m, run, 3) == ["new-2", "old-low", "new-3"]
    # without aging the same schedule keeps the low task last
    plain = await ers.mailboxes.ensure("prio-no-aging")
    await plain.submit("old-low", scope=run, priority=5)
    await trio.sleep(25)
    await plain.submit("new-3", scope=run, priority=3)
    await plain.submit("new-2", scope=run, priority=2)
    assert await _drain(plain, run, 3) == ["new-2", "new-3", "old-low"]
    # turned off again by an ensure
    m2 = await ers.mailboxes.ensure("prio-aging", aging_seconds=0)
    assert m2.info.aging_ms is None


async def _shares(m, run, n: int) -> Counter:
    got = await m.receive(run, wait=0, max_messages=n) if n <= 100 else None
    if got is None:
        got = []
        while len(got) < n:
            got += await m.receive(run, wait=0, max_messages=min(100, n - len(got)))
    return Counter(d.fair_key for d in got)


async def test_equal_weights_share_equally(autojump_clock, ers):
    m = await ers.mailboxes.ensure("fair-111")
    run = await ers.scopes.create()
    for key, n in (("a", 300), ("b", 50), ("c", 120)):
        await m.submit_many([f"{key}{i}" for i in range(n)], scope=run, fair_key=key, details=False)
    c = await _shares(m, run, 90)
    assert c == {"a": 30, "b": 30, "c": 30}


async def test_weights_three_to_one_from_the_queue_and_from_the_task(autojump_clock, ers):
    m = await ers.mailboxes.ensure("fair-31", weights={"big": 3})
    run = await ers.scopes.create()
    await m.submit_many([f"b{i}" for i in range(200)], scope=run, fair_key="big", details=False)
    await m.submit_many([f"s{i}" for i in range(200)], scope=run, fair_key="small", details=False)
    assert await _shares(m, run, 80) == {"big": 60, "small": 20}
    # a task's own weight, when the queue sets none for its key
    m2 = await ers.mailboxes.ensure("fair-31-task")
    await m2.submit_many([f"b{i}" for i in range(200)], scope=run, fair_key="big", fair_weight=3, details=False)
    await m2.submit_many([f"s{i}" for i in range(200)], scope=run, fair_key="small", details=False)
    assert await _shares(m2, run, 80) == {"big": 60, "small": 20}
    info = await m.status()
    assert info.weights == {"big": 3}
    assert info.ready_by_key == {"big": 140, "small": 180}
    assert info.ready_by_priority == {"3": 320}


async def test_a_burst_key_does_not_delay_a_single_task_key_more_than_one_round(autojump_clock, ers):
    m = await ers.mailboxes.ensure("fair-burst")
    run = await ers.scopes.create()
    for i in range(10):  # a burst of 10,000
        await m.submit_many([i * 1000 + j for j in range(1000)], scope=run, fair_key="burst", details=False)
    first = await m.receive(run, wait=0, max_messages=5)
    assert {d.fair_key for d in first} == {"burst"}
    await m.submit("mine", scope=run, fair_key="tenant-1")
    await m.submit("theirs", scope=run, fair_key="tenant-2")
    got = await m.receive(run, wait=0, max_messages=3)  # one round: each key once
    assert Counter(d.fair_key for d in got) == {"burst": 1, "tenant-1": 1, "tenant-2": 1}
    # priority comes before fairness: an urgent burst task beats every key
    await m.submit("urgent", scope=run, fair_key="burst", priority=1)
    assert (await m.receive(run, wait=0)).input == "urgent"


async def test_bad_scheduling_input_is_refused_with_the_field(autojump_clock, ers):
    m = await ers.mailboxes.ensure("fair-bad")
    run = await ers.scopes.create()
    cases = [
        (dict(priority=0), "priority"), (dict(priority=6), "priority"),
        (dict(fair_key=""), "fair_key"), (dict(fair_key="k" * 129), "fair_key"),
        (dict(fair_key="k", fair_weight=0), "fair_weight"), (dict(fair_key="k", fair_weight=1001), "fair_weight"),
        (dict(fair_weight=2), "fair_weight"),
    ]
    for kw, field in cases:
        with pytest.raises(ValidationError) as ei:
            await m.submit("x", scope=run, **kw)
        assert ei.value.code == "VALIDATION_FAILED" and ei.value.details["field"] == field, kw
    with pytest.raises(ValidationError) as ei:
        await m.submit_many(["x"], scope=run, priority=9)
    assert ei.value.details["field"] == "items[0].priority"
    with pytest.raises(ValidationError):
        await ers.scopes.create(priority=7)
    with pytest.raises(ValidationError):
        await ers.mailboxes.ensure("fair-bad", weights={"k": 0})
    with pytest.raises(ValidationError):
        await ers.mailboxes.ensure("fair-bad", aging_seconds=0.5)


def test_task_states_are_typed_and_illegal_moves_raise():
    check_task_move("QUEUED", "RUNNING")
    check_task_move("RUNNING", "QUEUED")
    for src, dst in (("SUCCEEDED", "QUEUED"), ("QUEUED", "SUCCEEDED"), ("CANCELLED", "RUNNING")):
        with pytest.raises(IllegalTransition):
            check_task_move(src, dst)
    assert TaskPhase.QUEUED == "QUEUED"  # the stored strings are unchanged


def test_ready_index_stride_keeps_a_rejoining_key_at_virtual_time():
    """A key that empties and comes back starts at the level's virtual time: it does
    not get a burst for the time it was idle."""
    from rallypoint.actors.queue_state import TaskState

    tasks: dict = {}
    idx = ReadyIndex(tasks, lambda t: 1, lambda q: None)

    def add(i, key):
        t = TaskState(id=f"t{i}", space="s", mailbox_id="q", scope_id="r", input=b"", created_at_ms=0, seq=i,
                      fair_key=key)
        tasks[t.id] = t
        idx.add(t)

    for i in range(100):
        add(i, "a")
    rr = idx.runs("q")["r"]
    got = idx.pop("q", [("r", rr)], 50, 0, lambda t: True)
    assert len(got) == 50
    for i in range(100, 110):
        add(i, "b")
    got = idx.pop("q", [("r", rr)], 20, 0, lambda t: True)
    assert Counter(t.fair_key for t in got) == {"a": 10, "b": 10}


async def seed_scheduling(rs) -> dict:
    """Three queues on a daemon for a restart or failover to keep (issue 44): ``kill-prio``
    (weights big:3 on the queue, aging, rate limits that do not bind, a run of priority 4,
    an urgent task, one moved by ``set_priority``), ``kill-111`` (keys a/b/c of weight 1 with uneven backlogs, a few
    received before), ``kill-burst`` (a 2,000-task key, 5 received, then two one-task
    keys). Returns the ids :func:`check_scheduling` needs."""
    m = await rs.mailboxes.ensure("kill-prio", weights={"big": 3}, aging_seconds=3600,
                                  rate_limits={"tenant-x": 5, "*": 1000})
    run = await rs.scopes.create(priority=4)
    await m.submit_many([f"b{i}" for i in range(40)], scope=run, fair_key="big", details=False)
    await m.submit_many([f"s{i}" for i in range(40)], scope=run, fair_key="small", details=False)
    await m.submit("urgent", scope=run, priority=1)
    moved = await m.submit("moved", scope=run)  # the run's 4
    await moved.set_priority(2)
    inherited = await m.submit("inherited", scope=run, fair_key="small")
    m3 = await rs.mailboxes.ensure("kill-111")
    run3 = await rs.scopes.create()
    for key, n in (("a", 70), ("b", 25), ("c", 45)):
        await m3.submit_many([f"{key}{i}" for i in range(n)], scope=run3, fair_key=key, details=False)
    before = await m3.receive(run3, wait=0, max_messages=6)  # turns taken before the stop
    assert Counter(d.fair_key for d in before) == {"a": 2, "b": 2, "c": 2}
    mb = await rs.mailboxes.ensure("kill-burst")
    runb = await rs.scopes.create()
    for i in range(2):
        await mb.submit_many([i * 1000 + j for j in range(1000)], scope=runb, fair_key="burst", details=False)
    first = await mb.receive(runb, wait=0, max_messages=5)
    assert {d.fair_key for d in first} == {"burst"}
    await mb.submit("mine", scope=runb, fair_key="tenant-1")
    await mb.submit("theirs", scope=runb, fair_key="tenant-2")
    return {"run": run.id, "moved": moved.id, "inherited": inherited.id, "run3": run3.id, "runb": runb.id}


async def check_scheduling(rs, ids: dict) -> None:
    """What :func:`seed_scheduling` set is all there after a restart or failover: the
    queue's weights and aging, the backlog per priority and key, the run's and the tasks'
    priorities, and the order: urgent first, then the moved task, then 3:1 shares; 1:1:1
    shares; the one-task keys within one round of the burst."""
    m = await rs.mailboxes.get("kill-prio")
    assert (m.info.weights, m.info.aging_ms) == ({"big": 3}, 3_600_000)
    assert m.info.rate_limits == {"*": 1000, "tenant-x": 5}
    assert m.info.ready_by_priority == {"1": 1, "2": 1, "4": 81}
    assert m.info.ready_by_key == {"small": 41, "big": 40, "": 2}
    assert (await Run(rs, ids["run"]).status()).priority == 4
    assert (await Ticket(rs, ids["moved"]).status()).priority == 2
    assert (await Ticket(rs, ids["inherited"]).status()).priority == 4
    first = await m.receive(ids["run"], wait=0, max_messages=2)
    assert [x.input for x in first] == ["urgent", "moved"]
    got = await m.receive(ids["run"], wait=0, max_messages=40)
    assert Counter(x.fair_key for x in got) == {"big": 30, "small": 10}
    assert [x.input for x in got if x.fair_key == "big"][:3] == ["b0", "b1", "b2"]  # FIFO within a key
    m3 = await rs.mailboxes.get("kill-111")
    assert m3.info.ready_by_key == {"a": 68, "c": 43, "b": 23}
    got = await m3.receive(ids["run3"], wait=0, max_messages=60)
    assert Counter(x.fair_key for x in got) == {"a": 20, "b": 20, "c": 20}
    assert [x.input for x in got if x.fair_key == "b"][:2] == ["b2", "b3"]
    mb = await rs.mailboxes.get("kill-burst")
    got = await mb.receive(ids["runb"], wait=0, max_messages=3)  # one round: each key once
    assert Counter(d.fair_key for d in got) == {"burst": 1, "tenant-1": 1, "tenant-2": 1}
    assert [d.input for d in got if d.fair_key == "burst"] == [5]


async def test_priorities_keys_and_weights_survive_a_sigkill(tmp_path):
    d = Daemon(str(tmp_path / "data"), durability="fsync").start()
    try:
        async with rallypoint.connect(d.url) as rs:
            ids = await seed_scheduling(rs)
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL
        d.start()
        async with rallypoint.connect(d.url) as rs:
            await check_scheduling(rs, ids)
    finally:
        d.stop()


def test_http_and_cli_take_priority_and_key_and_status_shows_the_backlog(tmp_path):
    """HTTP ``POST /tasks`` takes the extension fields ``priority``/``fairKey``/
    ``fairWeight`` and shows ``priority``/``fairKey``; ``rallypoint tasks submit`` takes
    ``--priority``/``--fair-key``; ``rallypoint status`` shows the ready backlog per
    priority and per key; a bad priority is VALIDATION_FAILED over HTTP."""
    import json
    import subprocess
    import sys

    import httpx

    from sdk_compat import HttpDaemon

    d = HttpDaemon(str(tmp_path / "h"), durability="fsync", open_mode=True).start()
    try:
        with httpx.Client(base_url=f"{d.base_url}/v1/spaces/default", timeout=30) as c:
            run = c.post("/scopes", json={"name": "prio-http"}).json()["id"]
            mbx = c.put("/mailboxes/by-name/prio-http", json={}).json()["id"]
            r = c.post("/tasks", json={"scopeId": run, "mailboxId": mbx, "input": {"n": 1}, "priority": 1,
                                       "fairKey": "tenant-a", "fairWeight": 2})
            assert r.status_code == 200, r.text
            assert (r.json()["priority"], r.json()["fairKey"]) == (1, "tenant-a")
            bad = c.post("/tasks", json={"scopeId": run, "mailboxId": mbx, "priority": 0})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "VALIDATION_FAILED", bad.text
        env_cmd = [sys.executable, "-m", "rallypoint"]
        out = subprocess.run([*env_cmd, "tasks", "submit", "prio-http", '{"n": 2}', "--run", run, "--priority", "4",
                              "--fair-key", "tenant-b", "--connect", d.tcp_url, "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        view = json.loads(out.stdout)
        assert (view["priority"], view["fair_key"]) == (4, "tenant-b")
        st = subprocess.run([*env_cmd, "status", "--connect", d.tcp_url], capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        assert "mailbox     prio-http: ready p1 1  p4 1; by key tenant-a 1  tenant-b 1" in st.stdout, st.stdout
    finally:
        d.stop()


async def test_events_carry_the_priority_and_the_fairness_key(autojump_clock, ers):
    """``task.submitted``, ``task.priority_set`` and ``task.delivered`` carry the task's
    priority and fairness key as they were at that moment."""
    m = await ers.mailboxes.ensure("prio-events")
    run = await ers.scopes.create(priority=4)
    tk = await m.submit("x", scope=run, fair_key="tenant-a")
    await tk.set_priority(2)
    d = await m.receive(run, wait=0)
    assert d.priority == 2
    evs = [e for e in (await ers.events.list(limit=1000)).events if e.id == tk.id]
    got = {e.type: (e.data["priority"], e.data["fair_key"]) for e in evs
           if e.type in ("task.submitted", "task.priority_set", "task.delivered")}
    assert got == {"task.submitted": (4, "tenant-a"), "task.priority_set": (2, "tenant-a"),
                   "task.delivered": (2, "tenant-a")}
