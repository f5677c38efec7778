"""Rights decided per request from the current key table, and a key's end reaching what
is open (issue 41 items 1-3; docs/architecture.md, "Access").

Each test is named after the input the issue found getting through, over TCP and HTTP
where both apply:

1. a TCP connection opened in open mode kept every permission after the first key was
   created (``keys create --connect ... --force``): it made an admin key for another
   space, listed every space's keys and revoked the operator's;
2. ``idempotency.record`` needed only "any key": a ``coordination_read`` key stored a
   forged answer under a writer's Idempotency-Key and fingerprint (the writer's POST was
   answered 200 ``idempotent-replayed`` and never ran), squatted keys, stored 1 MB blobs;
3. after ``keys revoke K``: K's ``events.watch`` kept streaming events numbered after
   ``key.revoked``, the console's ``/stream`` kept streaming, and a receive parked before
   the revocation (TCP, HTTP ``recv``, ``POST /tasks/admit``) was handed a task submitted
   after it while a live worker's receive got nothing.

The daemon here is an embedded coordinator served over real TCP (``running_server``)
and HTTP (the ASGI app through httpx): the same Service, sessions and connections as
``rallypoint serve``. The console's stream in a real Chromium is in tests/test_console.py.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from contextlib import asynccontextmanager

import httpx
import msgspec
import pytest
import trio
import trio.testing

import rallypoint
from rallypoint import protocol as p
from rallypoint import wire
from rallypoint.actors.api import REPLY_TYPES
from rallypoint.actors.keys import hash_secret
from rallypoint.console import ConsoleApp
from rallypoint.errors import ForbiddenError, UnauthenticatedError
from rallypoint.http.app import HttpApi
from rallypoint.service import CallSink, Session
from rallypoint.transport.testing import RawClient, running_server

from conftest import wait_parked

pytestmark = pytest.mark.timeout(120)

RW = ["coordination_read", "coordination_write", "resource_config"]
ADMIN = Session(space="s", local=True)  # the local operator: revokes without a connection of its own


def enc(v) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(v))


async def call(rs, op):
    return await rs._call(op, REPLY_TYPES[type(op)])


async def until(pred, timeout: float = 10.0) -> None:
    """Until ``pred()`` holds (polled after every task blocked); TooSlowError after ``timeout`` s."""
    with trio.fail_after(timeout):
        while not pred():
            await trio.testing.wait_all_tasks_blocked()
            if not pred():
                await trio.sleep(0.01)


@asynccontextmanager
async def served():
    """``(node, tcp url, server, http client for space s)``: an embedded coordinator
    behind a real TCP listener and the HTTP API."""
    async with rallypoint.open_embedded() as rs:
        node = rs.node
        async with running_server(node.service) as srv:
            api = HttpApi(node.service)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://rp/v1/spaces/s",
                                         timeout=30) as http:
                yield node, f"tcp://127.0.0.1:{srv.port}", srv, http


def key(node, perms, space: str = "s", name: str | None = None) -> tuple[str, str]:
    """A new key ``(id, secret)`` (made before anything waits on the node)."""
    k, secret = node.coordinator.keys.create_key(space, perms, name)
    return k.id, secret


async def revoke(node, key_id: str) -> None:
    """``key.revoke`` as the local operator (``rallypoint keys revoke --data-dir``'s path)."""
    await node.service.call(ADMIN, p.KeyRevoke(key_id=key_id))


def bearer(secret: str) -> dict:
    return {"authorization": f"Bearer {secret}"}


# ============================================================================ item 1
async def test_an_open_mode_connection_after_keys_create_connect_force_loses_every_permission():
    """The input: a TCP connection opened in open mode, then ``rallypoint keys create
    --connect URL --force`` (the first key). On the old connection KeyCreate(space=
    "victim", permissions=["admin"]), KeyList() and KeyRevoke(the operator's key) were
    accepted. Now each is UNAUTHENTICATED (reason open_mode_ended), the idle connection
    is told so (Err 0) and closed, a receive it had parked ends UNAUTHENTICATED, and an
    HTTP long poll parked in open mode answers 401 -- while the new key works."""
    async with served() as (node, url, srv, http):
        coord = node.coordinator
        async with rallypoint.connect(url) as old:  # open mode: no key
            await call(old, p.MailboxEnsure(name="jobs"))
            run = await call(old, p.ScopeCreate(name="open"))
            idle = await RawClient.connect(srv.port)  # another open-mode connection that just sits
            parked: list = []

            async def tcp_receive():
                try:
                    await call(old, p.Receive(mailbox="jobs", scope_id=run.id, wait_ms=30_000))
                except Exception as e:
                    parked.append(e)

            async def http_recv():
                mbx = (await call(old, p.MailboxGet(name="jobs"))).id
                parked.append(await http.post(f"http://rp/v1/spaces/default/mailboxes/{mbx}/recv",
                                              json={"scopeId": run.id, "waitMs": 30_000}))

            async with trio.open_nursery() as n:
                n.start_soon(tcp_receive)
                n.start_soon(http_recv)
                await wait_parked(coord, 2)
                out = await trio.to_thread.run_sync(lambda: subprocess.run(
                    [sys.executable, "-m", "rallypoint", "keys", "create", "--connect", url, "--force", "--space",
                     "default", "--permission", "admin", "--name", "operator", "--json"],
                    capture_output=True, text=True, timeout=60))
                assert out.returncode == 0, out.stderr
                made = msgspec.json.decode(out.stdout)
            # the waits parked in open mode ended, told why
            tcp_err, http_ans = sorted(parked, key=lambda x: isinstance(x, httpx.Response))
            assert isinstance(tcp_err, UnauthenticatedError) and tcp_err.details == {"reason": "open_mode_ended"}
            assert http_ans.status_code == 401 and "open mode ended" in http_ans.json()["error"]["message"]
            assert coord.runtime.n_waiters == 0
            # the old connection can no longer do anything, the escalation above included
            for op in (p.KeyCreate(space="victim", permissions=["admin"]), p.KeyList(),
                       p.KeyRevoke(key_id=made["id"]), p.ScopeCreate()):
                with pytest.raises(UnauthenticatedError):
                    await old._transport.call(op)
        # the idle one was told (Err 0) and closed
        err = await idle.recv()
        assert isinstance(err, wire.Err) and err.id == 0 and err.code == "UNAUTHENTICATED", err
        assert err.details == {"reason": "open_mode_ended"} and await idle.recv() is None
        await idle.stream.aclose()
        assert srv.statistics()["sessions_ended"] >= 2
        keys = coord.keys
        assert [k.space for k in keys.table.values()] == ["default"] and not keys.is_revoked(made["id"])
        # an open-mode HTTP request is refused too; the new key works over both
        assert (await http.get("http://rp/v1/spaces/default/mailboxes")).status_code == 401
        assert (await http.get("http://rp/v1/spaces/default/mailboxes", headers=bearer(made["secret"]))).status_code \
            == 200
        async with rallypoint.connect(url, api_key=made["secret"]) as op_rs:
            assert [k.id for k in (await call(op_rs, p.KeyList())).keys] == [made["id"]]


async def test_a_request_queued_before_its_keys_revocation_is_refused_when_its_actor_handles_it():
    """Rights are judged when the request runs, not only when it arrives: a receive
    submitted (queued in its run's inbox) before the key is revoked in the same step is
    refused UNAUTHENTICATED and parks nothing."""
    async with rallypoint.open_embedded() as rs:
        node = rs.node
        coord, service = node.coordinator, node.service
        kid, secret = key(node, RW)
        session, _ = service.hello(wire.Hello(wire.PROTOCOL_VERSION, secret), "t")
        await service.call(session, p.MailboxEnsure(name="jobs"))
        run = msgspec.msgpack.decode(await service.call(session, p.ScopeCreate()), type=p.ScopeView)
        sink = CallSink()
        service.submit(session, p.encoder.encode(p.Receive(mailbox="jobs", scope_id=run.id, wait_ms=30_000)), sink, 1)
        assert not sink.replies  # queued for its actor, not answered
        coord.keys.revoke_key(kid)  # before the actor runs
        with trio.fail_after(5):
            await sink._event.wait()
        err = sink.replies[1]
        assert isinstance(err, UnauthenticatedError) and err.details == {"reason": "key_revoked", "key_id": kid}
        assert coord.runtime.n_waiters == 0


# ============================================================================ item 2
async def test_a_read_key_recording_a_writers_idempotency_answer_is_forbidden_and_the_writers_post_runs():
    """The input: a coordination_read key sends ``idempotency.record`` with the writer's
    Idempotency-Key and fingerprint (sha256("POST <path>\\n" + body)), and 1 MB blobs
    under fresh keys. Now FORBIDDEN, whatever the key holds (the op is the node's own:
    LOCAL), nothing stored; the writer's POST runs (no replay) and its own retry is the
    one replayed."""
    async with served() as (node, url, srv, http):
        coord = node.coordinator
        _, reader = key(node, ["coordination_read"])
        _, writer = key(node, RW)
        _, admin = key(node, ["admin"])
        body = b'{"name":"payroll"}'
        path = "/v1/spaces/s/scopes"
        fp = hashlib.sha256(b"POST " + path.encode() + b"\n" + body).hexdigest()[:32]
        forged = b'{"id":"scp_forged","state":"ACTIVE"}'
        for secret in (reader, admin):
            async with rallypoint.connect(url, api_key=secret) as rs:
                for op in (p.IdempotencyRecord(key="pay-1", fingerprint=fp, status=200, body=forged),
                           p.IdempotencyRecord(key="squat", fingerprint="x", status=200, body=b"x" * ((1 << 20) - 512)),  # (a frame is at most 1 MiB)
                           p.IdempotencyLookup(key="pay-1", fingerprint=fp)):
                    with pytest.raises(ForbiddenError) as e:
                        await call(rs, op)
                    assert "not a client's" in e.value.message
        assert not coord.idempotency.table  # nothing stored: no forged answer, no blob
        headers = {**bearer(writer), "idempotency-key": "pay-1", "content-type": "application/json"}
        r = await http.post("/scopes", content=body, headers=headers)
        assert r.status_code == 200 and "idempotent-replayed" not in r.headers, r.text
        run_id = r.json()["id"]
        assert run_id in coord.runs.table and run_id != "scp_forged"
        again = await http.post("/scopes", content=body, headers=headers)
        assert again.headers["idempotent-replayed"] == "true" and again.json()["id"] == run_id
        # the key is the writer's own: another request under it is a conflict, not a squat
        other = await http.post("/scopes", content=b'{"name":"other"}', headers=headers)
        assert other.status_code == 409 and other.json()["error"]["code"] == "IDEMPOTENCY_CONFLICT"


# ============================================================================ item 3
async def test_events_watch_of_a_revoked_key_ends_unauthenticated_with_nothing_after_key_revoked():
    """The input: K's TCP ``events.watch`` open while ``keys revoke K`` runs, events
    committed after it. The watch now ends UNAUTHENTICATED; every event it was pushed is
    numbered before ``key.revoked``; its connection is closed; a watch of another key of
    the same space goes on and sees what came after."""
    async with served() as (node, url, srv, http):
        coord = node.coordinator
        kid, victim = key(node, RW)
        _, other = key(node, RW)
        got: dict[str, list] = {"victim": [], "other": []}
        ended: dict = {}

        async def watch(name: str, secret: str):
            async with rallypoint.connect(url, api_key=secret) as rs:
                try:
                    async with rs.events.watch(start="now") as stream:
                        async for ev in stream:
                            got[name].append(ev)
                except Exception as e:
                    ended[name] = e

        async with rallypoint.connect(url, api_key=other) as writer, trio.open_nursery() as n:
            n.start_soon(watch, "victim", victim)
            n.start_soon(watch, "other", other)
            await until(lambda: len(coord.watchers) == 2)
            for i in range(5):
                await call(writer, p.ScopeCreate(name=f"before-{i}"))
            await until(lambda: len(got["victim"]) >= 5)
            await revoke(node, kid)
            for i in range(20):
                await call(writer, p.ScopeCreate(name=f"after-{i}"))
            await until(lambda: "victim" in ended and any(e.type == "scope.created" and e.data.get("name") ==
                                                          "after-19" for e in got["other"]))
            n.cancel_scope.cancel()
        err = ended["victim"]
        assert isinstance(err, UnauthenticatedError) and err.details["reason"] == "key_revoked", err
        revoked_seq = next(e.seq for e in got["other"] if e.type == "key.revoked")
        assert got["victim"] and all(e.seq < revoked_seq for e in got["victim"])
        assert not [e for e in got["victim"] if str(e.data).find("after-") >= 0]
        assert coord.watchers.ended_by_grant == 1


async def test_receives_parked_before_a_revocation_end_and_a_later_task_goes_to_the_live_worker():
    """The input: K's receives parked before ``keys revoke K`` -- over TCP, HTTP ``POST
    /mailboxes/{id}/recv`` and ``POST /tasks/admit`` -- then a task submitted after it. K's
    three receives end UNAUTHENTICATED (401 over HTTP) in the revocation's step, none
    leases anything; the task goes to the live worker's receive at attempt 1; K's TCP
    connection is closed."""
    async with served() as (node, url, srv, http):
        coord = node.coordinator
        kid, victim = key(node, RW)
        _, live = key(node, RW)
        async with rallypoint.connect(url, api_key=live) as worker:
            run = await call(worker, p.ScopeCreate(name="jobs"))
            mbx = await call(worker, p.MailboxEnsure(name="jobs"))
            answers: dict = {}

            async def tcp_receive():
                async with rallypoint.connect(url, api_key=victim) as rs:
                    try:
                        answers["tcp"] = await call(rs, p.Receive(mailbox="jobs", scope_id=run.id, wait_ms=30_000,
                                                                  holder="victim"))
                    except Exception as e:
                        answers["tcp"] = e

            async def http_post(name: str, path: str, body: dict):
                answers[name] = await http.post(path, json=body, headers=bearer(victim))

            async with trio.open_nursery() as n:
                n.start_soon(tcp_receive)
                n.start_soon(http_post, "recv", f"/mailboxes/{mbx.id}/recv",
                             {"scopeId": run.id, "waitMs": 30_000, "holder": "victim"})
                n.start_soon(http_post, "admit", "/tasks/admit",
                             {"scopeId": run.id, "mailboxId": mbx.id, "waitMs": 30_000, "holder": "victim"})
                await wait_parked(coord, 3)
                await revoke(node, kid)
            assert coord.runtime.n_waiters == 0
            err = answers["tcp"]
            assert isinstance(err, UnauthenticatedError) and err.details == {"reason": "key_revoked", "key_id": kid}
            for name in ("recv", "admit"):
                r = answers[name]
                assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED", (name, r.text)
            # the live worker's receive gets the task submitted after the revocation, first attempt
            async with trio.open_nursery() as n:
                got: list = []

                async def live_receive():
                    got.append(await call(worker, p.Receive(mailbox="jobs", scope_id=run.id, wait_ms=30_000,
                                                            holder="live")))

                n.start_soon(live_receive)
                await wait_parked(coord, 1)
                task = await call(worker, p.TaskSubmit(mailbox="jobs", scope_id=run.id, input=enc("after")))
            (d,) = got[0].deliveries
            assert d.task_id == task.id and d.attempt == 1
            t = await call(worker, p.TaskStatus(task_id=task.id))
            assert t.state == "RUNNING" and t.holder == "live"
        await until(lambda: srv.statistics()["sessions_ended"] >= 1)


async def test_every_kind_of_wait_of_a_revoked_key_ends_unauthenticated_in_one_step():
    """One mechanism for every server-side wait: K's task result wait (TCP, and HTTP
    ``GET /tasks/{id}?waitMs``), claim and pool acquires queued behind a holder, a quota
    take waiting for its window, a barrier wait, a timer wait, a group wait, a join_next,
    a once wait and an HTTP ``/watch`` long poll -- all parked, then ``keys revoke K``:
    every one ends UNAUTHENTICATED (401 over HTTP), none is left parked, and the other
    key's waits on the same things are untouched."""
    async with served() as (node, url, srv, http):
        coord = node.coordinator
        kid, victim = key(node, RW)
        _, live = key(node, RW)
        async with rallypoint.connect(url, api_key=live) as rs:
            run = await call(rs, p.ScopeCreate(name="w"))
            await call(rs, p.MailboxEnsure(name="jobs"))
            task = await call(rs, p.TaskSubmit(mailbox="jobs", scope_id=run.id, input=enc(1)))
            await call(rs, p.ClaimAcquire(scope_id=run.id, key="leader", holder="live", lease_ms=60_000))
            await call(rs, p.PoolEnsure(name="gpu", units_total=1))
            await call(rs, p.PoolAcquire(pool="gpu", scope_id=run.id, units=1, lease_ms=60_000))
            await call(rs, p.QuotaEnsure(name="calls", units_limit=1, window_ms=3_600_000))
            await call(rs, p.QuotaTake(quota="calls", scope_id=run.id, units=1))
            bar = await call(rs, p.BarrierCreate(scope_id=run.id, target=2))
            tmr = await call(rs, p.TimerCreate(scope_id=run.id, after_ms=3_600_000))
            js = await call(rs, p.JoinSetCreate(scope_id=run.id))
            await call(rs, p.JoinSetSubmit(joinset_id=js.id, mailbox="jobs"))
            grp = await call(rs, p.GroupCreate(scope_id=run.id, mailbox="jobs", condition="ALL_TERMINAL"))
            await call(rs, p.GroupSubmit(group_id=grp.id, input=enc(2)))
            await call(rs, p.OnceAcquire(scope_id=run.id, key="once", lease_ms=60_000))
            waits = [
                p.TaskResult(task_id=task.id, wait_ms=30_000),
                p.ClaimAcquire(scope_id=run.id, key="leader", wait_ms=30_000, holder="victim"),
                p.PoolAcquire(pool="gpu", scope_id=run.id, units=1, wait_ms=30_000),
                p.QuotaTake(quota="calls", scope_id=run.id, units=1, ttl_ms=60_000, wait_ms=30_000, key="t1"),
                p.BarrierWait(barrier_id=bar.id, wait_ms=30_000),
                p.TimerWait(timer_id=tmr.id, wait_ms=30_000),
                p.GroupWait(group_id=grp.id, wait_ms=30_000),
                p.JoinNext(joinset_id=js.id, wait_ms=30_000),
                p.OnceGet(scope_id=run.id, key="once", wait_ms=30_000),
            ]
            answers: dict = {}
            survivor: list = []

            async def tcp_wait(op):
                async with rallypoint.connect(url, api_key=victim) as v:
                    try:
                        answers[type(op).__name__] = await call(v, op)
                    except Exception as e:
                        answers[type(op).__name__] = e

            async def http_get(name: str, path: str):
                answers[name] = await http.get(path, headers=bearer(victim))

            async def other_keys_wait():
                survivor.append(await call(rs, p.TaskResult(task_id=task.id, wait_ms=30_000)))

            async with trio.open_nursery() as n:
                n.start_soon(other_keys_wait)
                for op in waits:
                    n.start_soon(tcp_wait, op)
                n.start_soon(http_get, "http-result", f"/tasks/{task.id}?waitMs=30000")
                await wait_parked(coord, len(waits) + 2)
                # a watch whose filter matches nothing that happens: held as a subscription
                n.start_soon(http_get, "http-watch", "/watch?waitSeconds=30&types=timer.fired")
                await until(lambda: len(coord.watchers) == 1)
                await revoke(node, kid)
                await until(lambda: len(answers) == len(waits) + 2)
                assert coord.runtime.n_waiters == 1 and not coord.watchers  # only the other key's
                d = (await call(rs, p.Receive(mailbox="jobs", scope_id=run.id, max_messages=1))).deliveries[0]
                await call(rs, p.DeliveryComplete(task_id=d.task_id, token=d.token, outcome=enc("ok")))
        for op in waits:
            e = answers[type(op).__name__]
            assert isinstance(e, UnauthenticatedError) and e.details["key_id"] == kid, (type(op).__name__, e)
        for name in ("http-result", "http-watch"):
            r = answers[name]
            assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED", (name, r.text)
        assert survivor[0].id == task.id  # the other key's wait went on and got its answer


async def test_the_console_stream_of_a_revoked_key_ends_signed_out():
    """The input: the console's ``GET /stream`` of a login whose key is then revoked,
    events committed after it. The stream ends at once with ``gone`` and ``signedOut``
    (the page reloads to the sign-in form), no event after the revocation in it."""
    async with rallypoint.open_embedded() as rs:
        node = rs.node
        coord = node.coordinator
        kid, secret = key(node, ["coordination_read"])
        writer = Session(space="s", permissions=frozenset(RW), key_id=key(node, RW)[0])
        app = ConsoleApp(node.service)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://console.test",
                                     timeout=30) as client:
            assert (await client.post("/login", data={"key": secret})).status_code == 303
            answer: list = []

            async def stream():
                answer.append(await client.get("/stream?mode=events"))

            with trio.fail_after(20):  # (before: the stream never ended)
                async with trio.open_nursery() as n:
                    n.start_soon(stream)
                    await until(lambda: len(coord.watchers) == 1)
                    await node.service.call(writer, p.ScopeCreate(name="before"))
                    await revoke(node, kid)
                    for i in range(5):
                        await node.service.call(writer, p.ScopeCreate(name=f"after-{i}"))
            text = answer[0].text
            assert "event: gone" in text and '"signedOut":true' in text, text
            assert "after-" not in text and "key.revoked" not in text
            assert (await client.get("/runs")).status_code == 303  # signed out: to the login form
            assert not app.streams


async def test_a_revocation_adopted_from_the_cluster_key_store_ends_the_keys_waits():
    """In a cluster the revocation arrives from etcd as ``key.adopt`` (the shard's own
    step, ``cluster/member.py``): the same apply ends the key's parked receive and its
    watch, and closes its connection."""
    async with served() as (node, url, srv, http):
        coord = node.coordinator
        local = Session(local=True)
        adopt = p.KeyAdopt(id="key_01jzzzzzzzzzzzzzzzzzzzzzzz", space="s", permissions=RW,
                           secret_sha256=hash_secret("rpk_cluster"), created_at_ms=1_700_000_000_000)
        await node.service.call(local, adopt)
        ended: dict = {}
        async with rallypoint.connect(url, api_key="rpk_cluster") as rs:
            run = await call(rs, p.ScopeCreate())
            await call(rs, p.MailboxEnsure(name="jobs"))

            async def receive():
                try:
                    await call(rs, p.Receive(mailbox="jobs", scope_id=run.id, wait_ms=30_000))
                except Exception as e:
                    ended["receive"] = e

            async def watch():
                try:
                    async with rs.events.watch(start="now") as stream:
                        async for _ in stream:
                            pass
                except Exception as e:
                    ended["watch"] = e

            async with trio.open_nursery() as n:
                n.start_soon(receive)
                n.start_soon(watch)
                await wait_parked(coord, 1)
                await until(lambda: len(coord.watchers) == 1)
                await node.service.call(local, msgspec.structs.replace(adopt, revoked_at_ms=1_700_000_001_000))
                await until(lambda: len(ended) == 2)
        for e in ended.values():
            assert isinstance(e, UnauthenticatedError) and e.details["reason"] == "key_revoked", e
        assert coord.runtime.n_waiters == 0 and not coord.watchers
        await until(lambda: srv.statistics()["sessions_ended"] == 1)


async def test_a_revocation_not_yet_durable_tells_the_revoked_key_nothing():
    """The answers a revocation gives -- a parked receive's and a watch's UNAUTHENTICATED,
    the connection's Err 0 and its close -- wait until the revocation is durable (a crash
    could take it back): before, K's connection hears nothing and stays open; once
    durable, all of them, then EOF."""
    from rallypoint.actors import Coordinator
    from rallypoint.service import Service

    from test_reply_durability import HeldJournal, _answer

    coord = Coordinator()
    journal = coord.journal = HeldJournal()
    body = lambda op: msgspec.msgpack.decode(p.encoder.encode(op))  # noqa: E731
    async with trio.open_nursery() as n:
        await n.start(coord.run)
        service = Service(coord)
        async with running_server(service) as srv:
            k, secret = coord.keys.create_key("s", RW)
            kid = k.id
            journal.release()
            c = await RawClient.connect(srv.port, api_key=secret)
            await c.request(1, body(p.ScopeCreate()))
            await c.request(2, body(p.MailboxEnsure(name="jobs")))
            await trio.testing.wait_all_tasks_blocked()
            journal.release()
            run_id = msgspec.msgpack.decode((await _answer(c, 1, 5)).body)["id"]
            assert isinstance(await _answer(c, 2, 5), wire.Ok)
            await c.request(3, body(p.Receive(mailbox="jobs", scope_id=run_id, wait_ms=30_000)))
            await c.request(4, body(p.EventsWatch(start="now")))
            assert isinstance(await _answer(c, 4, 5), wire.Ok)  # subscribed (its Ok reveals nothing)
            await wait_parked(coord, 1)
            sink = CallSink()
            service.submit(ADMIN, p.encoder.encode(p.KeyRevoke(key_id=kid)), sink, 1)
            await until(lambda: coord.keys.is_revoked(kid))
            assert coord.runtime.n_waiters == 0 and journal.durable_lsn < journal.last_lsn
            await trio.testing.wait_all_tasks_blocked()
            (conn,) = srv._conns  # nothing sent to K yet: the receive's answer held, the watch and connection open
            assert conn.st.phase.name == "OPEN" and not conn.st.out and [r for _, r, _ in conn.st.deferred] == [3]
            assert list(conn.st.streams) == [4] and not c.frames
            journal.release()
            got = {}
            with trio.fail_after(5):
                while (f := await c.recv()) is not None:
                    got[f.id] = f
            assert set(got) == {0, 3, 4}, got  # then EOF
            for f in got.values():
                assert isinstance(f, wire.Err) and f.code == "UNAUTHENTICATED", f
                assert f.details == {"reason": "key_revoked", "key_id": kid}
        n.cancel_scope.cancel()


async def test_a_revoked_keys_tls_connection_is_told_why_and_closed(tmp_path):
    """The same over TLS (``--tls-cert``): K's parked receive ends UNAUTHENTICATED, and
    the connection's close carries the reason (``Err 0``: the client's next call says
    "server said: UNAUTHENTICATED")."""
    import ssl

    import trustme

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca_pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    async with rallypoint.open_embedded() as rs:
        node = rs.node
        kid, secret = key(node, RW)
        async with running_server(node.service, ssl_context=server_ctx) as srv:
            url = f"tls://127.0.0.1:{srv.port}"
            async with rallypoint.connect(url, api_key=secret, tls_ca=str(ca_pem), reconnect=False) as c:
                run = await call(c, p.ScopeCreate())
                await call(c, p.MailboxEnsure(name="jobs"))
                got: list = []

                async def receive():
                    try:
                        await call(c, p.Receive(mailbox="jobs", scope_id=run.id, wait_ms=30_000))
                    except Exception as e:
                        got.append(e)

                async with trio.open_nursery() as n:
                    n.start_soon(receive)
                    await wait_parked(node.coordinator, 1)
                    await revoke(node, kid)
                    await until(lambda: got)
                assert isinstance(got[0], UnauthenticatedError) and got[0].details["key_id"] == kid
                await until(lambda: srv.statistics()["sessions_ended"] == 1)
                with pytest.raises(Exception) as e:
                    await call(c, p.ScopeCreate())
                assert "server said: UNAUTHENTICATED" in str(e.value), e.value
