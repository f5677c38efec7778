"""Limits per space (issue 41 item 4): one tenant cannot take the node's memory.

The issue's inputs, each a test: a tenant making root runs without end (685,000 in 20 s),
timers in one run (350,600 in 12 s), 60 KB task inputs (+1.84 GB in 15 s); and
``server.status`` showing every tenant the whole server's figures (item 10). At a
limit the operation is refused LIMIT_EXCEEDED naming the limit, its value and the use,
nothing half-applied; the use falls when entities end or are purged, and is counted
the same after a restart (snapshot or journal) as before it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import msgspec
import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors import Coordinator
from rallypoint.errors import LimitError, ValidationError
from rallypoint.http.app import HttpApi
from rallypoint.limits import DEFAULTS, NAMES, Limits, parse_limit
from rallypoint.service import Service, Session
from rallypoint.wire import PROTOCOL_VERSION, Hello

from conftest import Daemon


def limits_of(rs) -> Limits:
    return rs.node.coordinator.limits


def use(rs, space: str = "default") -> dict[str, int]:
    return limits_of(rs).use[space].as_dict()


def refused(ei, name: str, value: int, in_use: int, adding: int = 1) -> None:
    e = ei.value
    assert e.code == "LIMIT_EXCEEDED"
    assert e.details == {"limit": name, "value": value, "use": in_use, "adding": adding}, e.details
    assert name in e.message and f"--limit {name}=" in e.message


# ------------------------------------------------------------------------------ runs
async def test_root_runs_past_the_runs_limit_are_refused_until_one_ends(autojump_clock, ers):
    """The issue's input: root runs without end. At ``runs`` the next create is refused
    (retry_after: runs end); a run that ends makes room."""
    limits_of(ers).configure({"runs": 3})
    runs = [await ers.scopes.create() for _ in range(3)]
    with pytest.raises(LimitError) as ei:
        await ers.scopes.create()
    refused(ei, "runs", 3, 3)
    assert ei.value.retry_after == 1.0
    with pytest.raises(LimitError):  # a named root run too
        await ers.node.service.call(Session(), p.ScopeEnsureNamed(name="a-name"))
    assert len(await ers.scopes.list(roots_only=True)) == 3  # nothing was created
    await runs[0].cancel()
    await runs[1].complete()
    assert use(ers)["runs"] == 1
    await ers.scopes.create()
    await ers.scopes.create()
    assert use(ers)["runs"] == 3


async def test_child_runs_a_groups_gate_and_a_tasks_own_run_count_as_runs(autojump_clock, ers):
    limits_of(ers).configure({"runs": 4})
    root = await ers.scopes.create()
    await root.child()
    m = await ers.mailboxes.ensure("jobs")
    await root.groups.create(m, "ALL_TERMINAL")  # its gate run: the 3rd
    await m.submit(1, scope=root)
    d = await m.receive(root, wait=0)
    await d.run()  # the task's own run: the 4th
    assert use(ers)["runs"] == 4
    with pytest.raises(LimitError) as ei:
        await root.child()
    refused(ei, "runs", 4, 4)
    with pytest.raises(LimitError):
        await root.groups.create(m, "ALL_TERMINAL")
    assert len(await root.children()) == 3  # child, gate, task run: no fourth child made


async def test_cancelling_a_run_takes_its_whole_live_subtree_off_the_count(autojump_clock, ers):
    root = await ers.scopes.create()
    a = await root.child()
    await (await a.child()).child()
    b = await root.child()
    await b.cancel()  # b alone
    assert use(ers)["runs"] == 4
    await root.cancel()  # root, a and a's two below: b was counted off already
    assert use(ers)["runs"] == 0


async def test_a_deadline_that_passes_takes_the_run_and_its_children_off_the_count(autojump_clock, ers):
    from datetime import datetime, timedelta, timezone

    now = datetime.fromtimestamp(ers.node.coordinator.clock.now(), timezone.utc)
    root = await ers.scopes.create(deadline=now + timedelta(seconds=30))
    await root.child()
    await ers.scopes.create()
    assert use(ers)["runs"] == 3
    await trio.sleep(31)
    assert (await root.status()).effective == "INACTIVE"
    assert use(ers)["runs"] == 1


# ------------------------------------------------------------------------------ tasks
async def test_submissions_past_the_tasks_limit_are_refused_until_tasks_finish(autojump_clock, ers):
    """Queued and leased tasks count (messages too); a finished one makes room."""
    limits_of(ers).configure({"tasks": 3})
    run = await ers.scopes.create()
    m = await ers.mailboxes.ensure("jobs")
    inbox = await ers.mailboxes.ensure("inbox", mode="INBOX")
    await m.submit(1, scope=run)
    await m.submit(2, scope=run)
    await inbox.send("hello", scope=run)
    with pytest.raises(LimitError) as ei:
        await m.submit(3, scope=run)
    refused(ei, "tasks", 3, 3)
    assert ei.value.retry_after == 1.0
    d = await m.receive(run, wait=0)  # leased: still counts
    with pytest.raises(LimitError):
        await m.submit(3, scope=run)
    await d.complete("ok")
    again = await m.submit(1, key="k", scope=run)
    assert use(ers)["tasks"] == 3
    assert (await m.submit(1, key="k", scope=run)).id == again.id  # an idempotent resubmission adds nothing


async def test_submit_many_past_the_tasks_limit_is_refused_whole(autojump_clock, ers):
    """A step that would make several tasks is checked for all of them before any
    record is journaled (the group's and join set's submissions go the same path)."""
    limits_of(ers).configure({"tasks": 5})
    run = await ers.scopes.create()
    m = await ers.mailboxes.ensure("jobs")
    await m.submit_many([1, 2, 3], scope=run)
    lsn = ers.node.coordinator.journal.last_lsn
    with pytest.raises(LimitError) as ei:
        await m.submit_many([4, 5, 6], scope=run)
    refused(ei, "tasks", 5, 3, adding=3)
    assert ers.node.coordinator.journal.last_lsn == lsn  # nothing journaled
    assert (await m.status()).queued == 3
    assert len(await m.submit_many([4, 5], scope=run)) == 2


async def test_a_group_member_and_a_join_set_child_count_as_tasks(autojump_clock, ers):
    limits_of(ers).configure({"tasks": 2})
    run = await ers.scopes.create()
    m = await ers.mailboxes.ensure("jobs")
    g = await run.groups.create(m, "ALL_TERMINAL")
    await g.submit(1)
    js = await run.join_sets.create()
    await js.submit(m, 2)
    with pytest.raises(LimitError):
        await g.submit(3)
    with pytest.raises(LimitError):
        await js.submit(m, 4)
    assert use(ers)["tasks"] == 2


# ------------------------------------------------------------------------------ payload bytes
async def test_60kb_inputs_stop_at_the_payload_bytes_limit(autojump_clock, ers):
    """The issue's input: 60 KB task inputs until memory ran out. Inputs count while
    the task is kept (finished too); outcomes count once the task finished; results
    are never refused."""
    limits_of(ers).configure({"payload_bytes": 200_000})
    run = await ers.scopes.create()
    m = await ers.mailboxes.ensure("jobs")
    big = "x" * 60_000
    for _ in range(3):
        await m.submit(big, scope=run)
    before = use(ers)["payload_bytes"]
    assert 180_000 < before < 181_000  # three encoded inputs
    with pytest.raises(LimitError) as ei:
        await m.submit(big, scope=run)
    e = ei.value
    assert (e.details["limit"], e.details["value"], e.details["use"]) == ("payload_bytes", 200_000, before)
    assert e.details["adding"] > 60_000 and e.retry_after is None and "--retain-finished" in e.message
    d = await m.receive(run, wait=0)
    await d.complete("y" * 30_000)  # past the limit: a result is stored and counted all the same
    assert use(ers)["payload_bytes"] > 200_000
    with pytest.raises(LimitError):
        await m.submit("small", scope=run)


async def test_retention_purging_finished_tasks_gives_their_bytes_and_entries_back(autojump_clock):
    async with rallypoint.open_embedded(retain_finished=60) as rs:
        limits_of(rs).configure({"payload_bytes": 100_000, "stored": 10})
        run = await rs.scopes.create()
        m = await rs.mailboxes.ensure("jobs")
        await m.submit("x" * 60_000, scope=run)
        d = await m.receive(run, wait=0)
        await d.complete("done")
        with pytest.raises(LimitError):
            await m.submit("x" * 60_000, scope=run)
        assert use(rs)["stored"] == 2  # the run and its finished task
        await trio.sleep(65)  # retention purges the finished task
        assert use(rs)["payload_bytes"] == 0 and use(rs)["stored"] == 1
        await m.submit("x" * 60_000, scope=run)


async def test_the_stored_limit_counts_finished_runs_until_they_are_purged(autojump_clock):
    async with rallypoint.open_embedded(retain_finished=60) as rs:
        limits_of(rs).configure({"stored": 2})
        await (await rs.scopes.create()).cancel()
        await (await rs.scopes.create()).complete()
        assert use(rs)["runs"] == 0 and use(rs)["stored"] == 2
        with pytest.raises(LimitError) as ei:
            await rs.scopes.create()
        refused(ei, "stored", 2, 2)
        assert ei.value.retry_after is None
        await trio.sleep(65)
        assert use(rs)["stored"] == 0
        await rs.scopes.create()


# ------------------------------------------------------------------------------ timers
async def test_timers_in_one_run_stop_at_the_timers_limit_until_one_fires(autojump_clock, ers):
    """The issue's input: timers without end in one run."""
    limits_of(ers).configure({"timers": 2})
    run = await ers.scopes.create()
    await run.timers.create(after_seconds=10)
    t2 = await run.timers.create(after_seconds=3600)
    with pytest.raises(LimitError) as ei:
        await run.timers.create(after_seconds=1)
    refused(ei, "timers", 2, 2)
    await trio.sleep(11)  # the first fired
    t3 = await run.timers.create(after_seconds=3600)
    await t2.cancel()
    assert use(ers)["timers"] == 1
    await run.cancel()  # its armed timer is cancelled with it
    assert use(ers)["timers"] == 0 and t3.id


# ------------------------------------------------------------------------------ watchers
async def test_a_subscription_past_the_watchers_limit_is_refused_until_one_closes(autojump_clock, ers):
    limits_of(ers).configure({"watchers": 1})
    async with ers.events.watch(start="now"):
        assert use(ers)["watchers"] == 1
        with pytest.raises(LimitError) as ei:
            async with ers.events.watch(start="now"):
                pass
        refused(ei, "watchers", 1, 1)
    while use(ers)["watchers"]:  # (the close reaches the server on its next batch)
        await trio.sleep(0.01)
    async with ers.events.watch(start="now"):
        pass


# ------------------------------------------------------------------------------ connections
def test_hello_past_the_connections_limit_is_refused_and_goodbye_frees_it():
    """The count is taken where the session's space becomes known (Service.hello) and
    given back when the transport reports the connection closed (goodbye)."""
    coord = Coordinator(limits={"connections": 2})
    service = Service(coord)
    a, _ = service.hello(Hello(version=PROTOCOL_VERSION, space="a"), "p1")
    service.hello(Hello(version=PROTOCOL_VERSION, space="a"), "p2")
    with pytest.raises(LimitError) as ei:
        service.hello(Hello(version=PROTOCOL_VERSION, space="a"), "p3")
    assert ei.value.details == {"limit": "connections", "value": 2, "use": 2, "adding": 1}
    service.hello(Hello(version=PROTOCOL_VERSION, space="b"), "p4")  # another space has its own
    service.goodbye(a)
    service.goodbye(a)  # twice: counted once
    assert coord.limits.use["a"].connections == 1
    service.hello(Hello(version=PROTOCOL_VERSION, space="a"), "p5")


async def test_tcp_connections_past_the_limit_are_refused_until_one_closes():
    d = Daemon(None, "memory", extra=["--limit", "connections=2"]).start()
    try:
        async with rallypoint.connect(d.url, reconnect=False) as first:
            async with rallypoint.connect(d.url, reconnect=False) as second:
                await second.status()
                with pytest.raises(LimitError) as ei:
                    async with rallypoint.connect(d.url, reconnect=False):
                        pass
                assert ei.value.details["limit"] == "connections" and ei.value.details["value"] == 2
            assert (await first.status()).space_use["default"]["connections"] >= 1
            with trio.fail_after(20):  # the closed one is counted off when its connection ends
                while (await first.status()).space_use["default"]["connections"] != 1:
                    await trio.sleep(0.05)
            async with rallypoint.connect(d.url, reconnect=False) as third:
                await third.status()
    finally:
        d.stop()


# ------------------------------------------------------------------------------ HTTP
async def test_http_answers_429_with_retry_after_and_a_keyed_request_is_refused_before_its_effect(autojump_clock):
    async with rallypoint.open_embedded() as rs:
        api = HttpApi(rs.node.service)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api),
                                     base_url="http://rp/v1/spaces/default") as c:
            run = (await c.post("/scopes", json={})).json()["id"]
            mbx = (await c.put("/mailboxes/by-name/jobs", json={})).json()["id"]
            limits_of(rs).configure({"tasks": 1})
            req = {"scopeId": run, "mailboxId": mbx, "input": {"n": 1}}
            assert (await c.post("/tasks", json=req)).status_code == 200
            r = await c.post("/tasks", json=req)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert err["code"] == "LIMIT_EXCEEDED" and err["details"]["limit"] == "tasks"
            # at the payload_bytes limit a keyed request is refused at its start: no effect
            limits_of(rs).configure({"payload_bytes": use(rs)["payload_bytes"]})
            lsn = rs.node.coordinator.journal.last_lsn
            r = await c.post("/scopes", json={}, headers={"idempotency-key": "k1"})
            assert r.status_code == 429 and r.json()["error"]["details"]["limit"] == "payload_bytes"
            assert rs.node.coordinator.journal.last_lsn == lsn
            limits_of(rs).configure({})
            r = await c.post("/scopes", json={}, headers={"idempotency-key": "k1"})
            assert r.status_code == 200
            assert use(rs)["payload_bytes"] > 8  # the stored answers count


# ------------------------------------------------------------------------------ exact across restarts
async def _fill(rs) -> None:
    run = await rs.scopes.create()
    child = await run.child()
    await (await rs.scopes.create()).cancel()
    m = await rs.mailboxes.ensure("jobs")
    await m.submit_many(["a" * 100, "b" * 200, "c"], scope=run)
    d = await m.receive(run, wait=0)
    await d.complete({"r": "z" * 50})
    d = await m.receive(run, wait=0)
    await d.reject("no")
    await child.timers.create(after_seconds=3600)
    await (await run.timers.create(after_seconds=3600)).cancel()


@pytest.mark.parametrize("snapshot", [True, False])
async def test_the_use_is_the_same_after_a_restart(tmp_path, snapshot):
    """Counted in apply, so a replay counts the same; a snapshot restores it
    (recounted from the state it loads)."""
    data = str(tmp_path / "d")
    async with rallypoint.open_embedded(data, durability="interval") as rs:
        await _fill(rs)
        before = limits_of(rs).derived()
        if snapshot:
            await rs.node.snapshotter.snapshot()
        else:
            async def no_snapshot():
                return None
            rs.node.snapshotter.snapshot = no_snapshot
        assert before["default"]["runs"] == 2 and before["default"]["tasks"] == 1 and before["default"]["timers"] == 1
    async with rallypoint.open_embedded(data, durability="interval") as rs:
        assert (rs.node.recovery_info["snapshot_lsn"] > 0) is snapshot
        assert limits_of(rs).derived() == before
        counted = {s: d for s, d in Limits.recount(rs.node.coordinator).items() if any(d.values())}
        assert counted == before


# ------------------------------------------------------------------------------ status (item 10)
async def _status(service, session) -> p.ServerStatusView:
    return msgspec.msgpack.decode(await service.call(session, p.ServerStatus()), type=p.ServerStatusView)


async def test_a_tenants_status_shows_its_own_space_not_the_servers(autojump_clock):
    """Item 10's input: server.status showed every tenant server-wide counts. A key of
    one space sees its space's connections, entities and use of each limit; the
    operator sees the server and every space."""
    async with rallypoint.open_embedded() as rs:
        service = rs.node.service

        async def key(space: str, *perms: str) -> Session:
            k = msgspec.msgpack.decode(await service.call(Session(local=True), p.KeyCreate(
                space=space, permissions=list(perms))), type=p.KeyView)
            return Session(space=space, permissions=frozenset(perms), key_id=k.id)

        other = await key("other", "coordination_write")
        mine = await key("mine", "coordination_write", "admin")
        operator = await key("mine", "operator")
        for _ in range(3):
            await service.call(other, p.ScopeCreate())
        await service.call(mine, p.ScopeCreate())
        st = await _status(service, mine)
        assert st.view == "space"
        assert set(st.space_use) == {"mine"} and st.space_use["mine"]["runs"] == 1
        assert st.entities == 1 and st.runs["ACTIVE"] == 1
        assert st.actors == {} and st.last_lsn == st.durable_lsn == 0 and st.cluster is None
        assert st.limits == {n: DEFAULTS[n] for n in NAMES}
        op = await _status(service, operator)
        assert op.view == "server" and {"mine", "other"} <= set(op.space_use)
        assert op.space_use["other"]["runs"] == 3 and op.entities >= 4 and op.last_lsn > 0 and op.actors


def test_status_prints_each_spaces_use_against_its_limits():
    d = Daemon(None, "memory", extra=["--limit", "runs=10", "--limit", "payload_bytes=1MiB"]).start()
    try:
        async def make():
            async with rallypoint.connect(d.url) as rs:
                for _ in range(4):
                    await rs.scopes.create()
        trio.run(make)
        out = subprocess.run([sys.executable, "-m", "rallypoint", "status", "--connect", d.url],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "limits      per space: runs 10  tasks 500,000" in out.stdout
        assert "payload_bytes 1MiB" in out.stdout
        line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("default"))
        assert "runs 4/10" in line and "(highest 40%)" in line
    finally:
        d.stop()


# ------------------------------------------------------------------------------ configuration
def test_limit_flags_parse_and_bad_ones_are_one_clear_line():
    assert parse_limit("runs=100") == ("runs", 100)
    assert parse_limit("payload_bytes=512MiB") == ("payload_bytes", 512 << 20)
    assert parse_limit("payload-bytes=2G") == ("payload_bytes", 2 << 30)
    assert parse_limit("timers=none") == ("timers", None)
    for bad, says in (("runs", "NAME=VALUE"), ("rune=1", "no limit named 'rune'"), ("runs=0", "at least 1"),
                      ("runs=1k", "positive integer"), ("tasks=-3", "positive integer")):
        with pytest.raises(ValidationError, match=says):
            parse_limit(bad)
    out = subprocess.run([sys.executable, "-m", "rallypoint", "serve", "--durability", "memory", "--limit", "rune=1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "rallypoint: --limit: no limit named 'rune'; the limits are " + ", ".join(NAMES)]


def test_no_limit_means_none_is_refused():
    lim = Limits({"runs": None})
    lim.of("s").runs = 10 ** 9
    lim.check_runs("s")
    with pytest.raises(ValidationError):
        Limits({"runs": 0})
