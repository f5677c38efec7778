"""A delivery's holder (issue 32 item 2): who received it -- the worker name the receive
gave (``holder``: runstate's worker id over HTTP, ``receive(holder=)`` / ``consume(holder=)``
natively), else the connection's ``client@peer`` -- journaled in ``TaskDelivered``, kept
in the task's state, shown in the delivery, task and ops views, the ``task.delivered``
event, over embedded, TCP and HTTP, and kept across a restart (snapshot and journal
replay); journals older than the field replay with no holder."""

from __future__ import annotations

import re
import signal

import httpx
import msgspec
import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint.actors.coordinator import Coordinator
from rallypoint.errors import ValidationError
from rallypoint.records import TaskDelivered, decode_commit, encode_commit
from rallypoint.service import Session

from sdk_compat import HttpDaemon

pytestmark = pytest.mark.timeout(300)


async def _delivered_events(rs, task_id: str) -> list:
    page = await rs.events.list(aggregate=f"task:{task_id}", types="task.delivered", limit=100)
    return page.events


# ------------------------------------------------------------------ the session's identity

def test_a_sessions_holder_is_client_at_peer_cut_to_128_characters():
    assert Session(peer="10.0.0.7:5123", client="billing-worker").holder == "billing-worker@10.0.0.7:5123"
    assert Session(peer="10.0.0.7:5123").holder == "10.0.0.7:5123"
    assert Session(client="cli").holder == "cli"
    assert Session(local=True).holder is None
    long = Session(peer="10.0.0.7:5123", client="w" * 500).holder
    assert len(long) == 128 and long.endswith("@10.0.0.7:5123") and long.startswith("w")
    assert len(Session(peer="h" * 300, client="c").holder) == 128


# ------------------------------------------------------------------ embedded

async def test_embedded_receive_records_the_named_holder_everywhere(autojump_clock, ers):
    rs = ers
    run = await rs.scopes.create(name="holders")
    q = await rs.mailboxes.ensure("hq", max_attempts=3)
    tk = await q.submit({"n": 1}, scope=run)
    d = await q.receive(run, wait=0, holder="worker-7")
    assert d.holder == "worker-7" and d.info.holder == "worker-7"
    assert (await rs.task(tk.id).status()).holder == "worker-7"
    ops = msgspec.msgpack.decode(await rs.node.service.call(Session(), p.OpsTask(task_id=tk.id)),
                                 type=p.OpsTaskView)
    assert ops.task.holder == "worker-7" and ops.delivery.holder == "worker-7"
    evs = await _delivered_events(rs, tk.id)
    assert [(e.data["attempt"], e.data["holder"]) for e in evs] == [(1, "worker-7")]

    # a retry delivered to another worker: the task shows the latest, the events both
    await d.retry(error="boom")
    await trio.sleep(60)  # past the retry backoff
    d2 = await q.receive(run, wait=5)
    assert d2.task_id == tk.id and d2.holder == "embedded"  # no name given: the session's identity
    assert (await rs.task(tk.id).status()).holder == "embedded"
    evs = await _delivered_events(rs, tk.id)
    assert [(e.data["attempt"], e.data["holder"]) for e in evs] == [(1, "worker-7"), (2, "embedded")]
    await d2.complete("ok")
    assert (await rs.task(tk.id).status()).holder == "embedded"  # the last holder stays on the finished task


async def test_ops_run_lists_each_holders_leased_tasks(autojump_clock, ers):
    rs = ers
    root = await rs.scopes.create(name="tree")
    kid = await root.child(name="kid")
    q = await rs.mailboxes.ensure("ho")
    a = await q.submit(1, scope=kid)
    b = await q.submit(2, scope=kid)
    c = await q.submit(3, scope=root)
    da = await q.receive(kid, wait=0, holder="w-a")
    await q.receive(kid, wait=0, holder="w-b")
    dc = await q.receive(root, wait=0, holder="w-a")
    assert {da.task_id, dc.task_id} == {a.id, c.id}
    await dc.complete(None)  # finished: no longer held

    async def ops(scope_id) -> p.OpsRunView:
        return msgspec.msgpack.decode(await rs.node.service.call(Session(), p.OpsRun(scope_id=scope_id)),
                                      type=p.OpsRunView)

    v = await ops(root.id)
    got = {w.holder: (w.keys, w.tasks) for w in v.workers}
    assert got == {"w-a": ([a.id], [a.id]), "w-b": ([b.id], [b.id])}
    assert v.workers[0].earliest_lease_expiry is not None


async def test_a_holder_not_1_to_128_characters_is_refused_before_anything_is_leased(autojump_clock, ers):
    rs = ers
    run = await rs.scopes.create()
    q = await rs.mailboxes.ensure("hv")
    tk = await q.submit(1, scope=run)
    for bad in ("", "x" * 129):
        with pytest.raises(ValidationError) as ei:
            await q.receive(run, wait=0, holder=bad)
        assert ei.value.details == {"field": "holder"}
    with pytest.raises(ValidationError):
        await rallypoint.consume(rs, q, run, lambda d: None, holder="", handle_signals=False)
    info = await rs.task(tk.id).status()
    assert info.state == "QUEUED" and info.holder is None


async def test_consume_records_its_holder(autojump_clock, ers):
    rs = ers
    run = await rs.scopes.create()
    q = await rs.mailboxes.ensure("hc")
    tks = [await q.submit(i, scope=run) for i in range(3)]
    seen = []

    async def handler(d):
        seen.append(d.holder)
        return d.input

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: rallypoint.consume(rs, q, run, handler, holder="consumer-a",
                                                      handle_signals=False, wait=1))
        while [(await rs.task(t.id).status()).state for t in tks] != ["SUCCEEDED"] * 3:
            await trio.sleep(0.1)
        await run.cancel()
    assert seen == ["consumer-a"] * 3
    assert [(await rs.task(t.id).status()).holder for t in tks] == ["consumer-a"] * 3


# ------------------------------------------------------------------ replay

async def test_the_holder_survives_a_restart_from_the_snapshot(tmp_path):
    async with rallypoint.open_embedded(str(tmp_path), sync_helper="thread") as rs:
        run = await rs.scopes.create()
        q = await rs.mailboxes.ensure("hs")
        tk = await q.submit(1, scope=run)
        await q.receive(run, wait=0, holder="before-restart")
    async with rallypoint.open_embedded(str(tmp_path), sync_helper="thread") as rs:
        info = await rs.task(tk.id).status()
        assert (info.state, info.holder) == ("RUNNING", "before-restart")
        evs = await _delivered_events(rs, tk.id)
        assert [e.data.get("holder") for e in evs] == ["before-restart"]


async def test_journal_replay_keeps_the_holder_and_an_older_record_has_none(autojump_clock):
    async with rallypoint.open_embedded() as rs:
        coord = rs.node.coordinator
        entries: list[bytes] = []
        append = coord.journal.append

        def capture(payload: bytes) -> int:
            entries.append(payload)
            return append(payload)

        coord.journal.append = capture
        run = await rs.scopes.create()
        q = await rs.mailboxes.ensure("hj")
        tk = await q.submit(1, scope=run)
        await q.receive(run, wait=0, holder="journaled")
        live = msgspec.msgpack.encode(coord.queues.tasks[tk.id])
    recs = [r for e in entries for r in decode_commit(e)]
    assert [r.holder for r in recs if isinstance(r, TaskDelivered)] == ["journaled"]

    fresh = Coordinator()
    fresh.replaying = True
    for rec in recs:
        fresh._apply[type(rec)](rec)
    assert msgspec.msgpack.encode(fresh.queues.tasks[tk.id]) == live
    assert fresh.queues.tasks[tk.id].holder == "journaled"

    # a TaskDelivered journaled before the field existed: the same bytes minus `holder`
    old_bytes = [e for e in entries if any(isinstance(r, TaskDelivered) for r in decode_commit(e))][0]
    generic = msgspec.msgpack.decode(old_bytes)
    for r in generic:
        r.pop("holder", None)
    old = decode_commit(msgspec.msgpack.encode(generic))
    assert [r.holder for r in old if isinstance(r, TaskDelivered)] == [None]
    older = Coordinator()
    older.replaying = True
    for e in entries:
        for rec in (old if e is old_bytes else decode_commit(e)):
            older._apply[type(rec)](rec)
    assert older.queues.tasks[tk.id].state == "RUNNING" and older.queues.tasks[tk.id].holder is None
    assert encode_commit(old) != old_bytes  # it really was another encoding


# ------------------------------------------------------------------ a daemon: TCP and HTTP

@pytest.fixture(scope="module")
def hd(tmp_path_factory):
    d = HttpDaemon(str(tmp_path_factory.mktemp("holder")), durability="fsync").start()
    yield d
    assert d.stop() == 0, d.log.read_text()[-3000:]


def _base(d: HttpDaemon) -> str:
    return f"{d.base_url}/v1/spaces/{d.space}"


def _h(d: HttpDaemon, **more) -> dict:
    return {"authorization": f"Bearer {d.secret}", **more}


async def test_tcp_receive_records_the_client_name_and_peer_or_the_named_holder(hd):
    async with rallypoint.connect(hd.tcp_url, api_key=hd.secret, client_name="billing-worker") as rs:
        run = await rs.scopes.create()
        q = await rs.mailboxes.ensure("ht")
        a = await q.submit(1, scope=run)
        b = await q.submit(2, scope=run)
        d = await q.receive(run, wait=0)
        assert d.task_id == a.id and re.fullmatch(r"billing-worker@127\.0\.0\.1:\d+", d.holder), d.holder
        d2 = await q.receive(run, wait=0, holder="named-worker")
        assert d2.task_id == b.id and d2.holder == "named-worker"
        assert (await rs.task(a.id).status()).holder == d.holder
        evs = await _delivered_events(rs, b.id)
        assert [e.data["holder"] for e in evs] == ["named-worker"]


def test_http_recv_and_admit_record_runstates_holder_and_a_restart_keeps_it(hd):
    b = _base(hd)
    run = httpx.post(f"{b}/scopes", json={"name": "http-holder"}, headers=_h(hd), timeout=30).json()["id"]
    assert httpx.put(f"{b}/mailboxes/by-name/hh", json={}, headers=_h(hd), timeout=30).status_code == 200
    ids = [httpx.post(f"{b}/tasks", json={"scopeId": run, "mailboxId": "hh", "input": i}, headers=_h(hd),
                      timeout=30).json()["id"] for i in range(3)]
    # runstate 0.3's worker admits with its worker id as `holder`
    got = httpx.post(f"{b}/tasks/admit", json={"scopeId": run, "mailboxId": "hh", "holder": "rs-worker-1",
                                               "holderSession": "s1"}, headers=_h(hd), timeout=30).json()
    assert got["taskId"] == ids[0] and got["holder"] == "rs-worker-1"
    # 0.2's recv, likewise
    assert httpx.post(f"{b}/mailboxes/hh/recv", json={"scopeId": run, "holder": "rs-worker-2"},
                      headers=_h(hd), timeout=30).status_code == 200
    # no holder: the client's user agent and address
    got = httpx.post(f"{b}/tasks/admit", json={"scopeId": run, "mailboxId": "hh"},
                     headers=_h(hd, **{"user-agent": "my-agent/1.0"}), timeout=30).json()
    assert re.fullmatch(r"my-agent/1\.0@127\.0\.0\.1:\d+", got["holder"]), got
    anon = got["holder"]
    bad = httpx.post(f"{b}/tasks/admit", json={"scopeId": run, "mailboxId": "hh", "holder": 7},
                     headers=_h(hd), timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["details"]["field"] == "holder"

    def holders():
        return [httpx.get(f"{b}/tasks/{t}", headers=_h(hd), timeout=30).json()["holder"] for t in ids]

    assert holders() == ["rs-worker-1", "rs-worker-2", anon]
    evs = httpx.get(f"{b}/events", params={"aggregate": f"task:{ids[0]}", "types": "task.delivered"},
                    headers=_h(hd), timeout=30).json()["events"]
    assert [e["payload"]["holder"] for e in evs] == ["rs-worker-1"]

    # a crash: the next start replays the journal (fsync durability: every answer was on disk)
    assert hd.stop(signal.SIGKILL) == -signal.SIGKILL
    hd.start()
    b = _base(hd)
    assert holders() == ["rs-worker-1", "rs-worker-2", anon]
