"""One connection, many things at once: long waits do not hold up other requests,
batch frames through the SDK, and the client under asyncio (all against the daemon)."""

import time

import anyio
import msgspec
import pytest
import trio

import rallypoint
from rallypoint import protocol as p
from rallypoint import wire
from rallypoint.client import types as t
from rallypoint.errors import (
    ConflictError,
    NotFoundError,
    ScopeCancelledError,
    UnavailableError,
    ValidationError,
    WaitTimeout,
)
from rallypoint.transport.testing import RawClient

from conftest import parked_waits, wait_parked_remote


async def test_long_waits_do_not_delay_status_on_the_same_connection(daemon):
    async with rallypoint.connect(daemon.url) as rs:
        run = await rs.scopes.create()
        mbx = await rs.mailboxes.ensure("spine-conc-wait")
        empty = await rs.mailboxes.ensure("spine-conc-empty")
        ticket = await mbx.submit(1, scope=run)
        done = {}

        async def wait_result():
            done["result"] = (await ticket.result(timeout=20)).state
            done["result_at"] = time.monotonic()

        async def wait_receive():
            done["receive"] = await empty.receive(run, wait=20)

        base = await parked_waits(rs)
        async with trio.open_nursery() as n:
            n.start_soon(wait_result)
            n.start_soon(wait_receive)
            await wait_parked_remote(rs, 2, base=base)  # both waits are parked on the server
            t0 = time.monotonic()
            for _ in range(20):
                st = await run.status()
            took = time.monotonic() - t0
            assert st.tasks == {"QUEUED": 1}
            assert not done, done  # the waits are still pending...
            assert took < 1.0, f"20 status calls took {took:.3f}s behind the waits"
            t1 = time.monotonic()
            await ticket.cancel()  # ...and end when the task does
            await empty.submit("wake", scope=run)
        assert done["result"] == "CANCELLED" and done["result_at"] - t1 < 2
        assert done["receive"] is not None and done["receive"].input == "wake"


async def test_wait_timeout_changes_nothing(daemon):
    async with rallypoint.connect(daemon.url) as rs:
        run = await rs.scopes.create()
        mbx = await rs.mailboxes.ensure("spine-conc-timeout")
        ticket = await mbx.submit(1, scope=run)
        t0 = time.monotonic()
        with pytest.raises(WaitTimeout):
            await ticket.result(timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 2
        assert (await ticket.status()).state == "QUEUED"


async def test_batch_frame_through_the_sdk_mixes_success_and_errors(daemon):
    async with rallypoint.connect(daemon.url) as rs:
        cancelled = await rs.scopes.create()
        await cancelled.cancel()
        ops = [
            p.ScopeCreate(name="batch-1"),
            p.ScopeStatus(scope_id="scp_missing"),
            p.ScopeCreate(name="bad\nname"),
            p.ScopeCreate(parent_id=cancelled.id),
            p.ScopeStatus(scope_id=cancelled.id),
            p.ScopeComplete(scope_id=cancelled.id),
            p.ScopeCreate(name="batch-2"),
        ]
        res = await rs._call_many(ops, t.RunStatus)
        kinds = [type(r) for r in res]
        assert kinds == [
            t.RunStatus, NotFoundError, ValidationError, ScopeCancelledError, t.RunStatus, ConflictError, t.RunStatus
        ]
        assert res[0].name == "batch-1" and res[6].name == "batch-2"
        assert res[4].stored_state == "CANCELLED"
        # dispatched in order: the second create's id sorts after the first's
        assert res[0].id < res[6].id
        # raw form: Raw reply bodies and exceptions
        raw = await rs._transport.call_many([p.ServerStatus(), p.ScopeStatus(scope_id="nope")])
        assert isinstance(raw[0], msgspec.Raw) and isinstance(raw[1], NotFoundError)
        # a 100-op batch is answered in full
        many = await rs._call_many([p.ScopeCreate(name=f"b{i}") for i in range(100)], t.RunStatus)
        assert [r.name for r in many] == [f"b{i}" for i in range(100)]


async def test_batch_frame_with_a_malformed_member(daemon):
    # One frame: a good request, one whose body is not an op, one with a bad envelope.
    port = int(daemon.url.rsplit(":", 1)[1])
    c = await RawClient.connect(port)
    enc = msgspec.msgpack.encode
    frame = enc(
        {
            "t": "batch",
            "reqs": [
                {"t": "req", "id": 1, "body": {"op": "server.status"}},
                {"t": "req", "id": 2, "body": {"op": "scope.create", "child_limit": "x"}},
                {"t": "req", "id": 3},
                {"t": "req", "id": 4, "body": {"op": "scope.create", "name": "after-bad"}},
            ],
        }
    )
    await c.send_raw(len(frame).to_bytes(4, "big") + frame)
    got = {}
    while len(got) < 4:
        f = await c.recv()
        got[f.id if f.id else "conn"] = f
    assert isinstance(got[1], wire.Ok) and isinstance(got[4], wire.Ok)
    assert got[2].code == "VALIDATION_FAILED" and "$.child_limit" in got[2].message
    assert "conn" in got or 3 in got  # the member without a body is answered too
    bad = got.get(3) or got["conn"]
    assert bad.code == "VALIDATION_FAILED" and "reqs[2]" in bad.message
    await c.aclose()


def test_client_under_asyncio(daemon):
    async def main():
        import asyncio

        asyncio.get_running_loop()  # really asyncio
        async with rallypoint.connect(daemon.url) as rs:
            run = await rs.scopes.create(name="from-asyncio")
            child = await run.child()
            st = await run.status()
            assert (st.name, st.children, st.effective) == ("from-asyncio", 1, "ACTIVE")
            mbx = await rs.mailboxes.ensure("spine-asyncio")
            ticket = await mbx.submit({"x": 1}, scope=child)
            # a long wait and other calls concurrently, under asyncio
            base = await parked_waits(rs)
            async with anyio.create_task_group() as tg:
                got = {}

                async def wait():
                    got["r"] = (await ticket.result(timeout=10)).state

                tg.start_soon(wait)
                with anyio.fail_after(30):  # (conftest's helpers are Trio's)
                    while await parked_waits(rs) < base + 1:  # the wait is parked on the server
                        await anyio.sleep(0.005)
                st = await run.cancel(reason="done")
            assert got["r"] == "CANCELLED"
            assert (st.stored_state, st.effective) == ("CANCELLED", "INACTIVE")
            with pytest.raises(ScopeCancelledError):
                await run.child()
            with pytest.raises(NotFoundError):
                await rs.scope("scp_nope").status()
            res = await rs._call_many([p.ScopeStatus(scope_id=run.id), p.ScopeStatus(scope_id="x")], t.RunStatus)
            assert res[0].stored_state == "CANCELLED" and isinstance(res[1], NotFoundError)
        return "ok"

    assert anyio.run(main, backend="asyncio") == "ok"


def test_asyncio_client_unreachable_is_unavailable():
    async def main():
        with pytest.raises(UnavailableError):
            async with rallypoint.connect("tcp://127.0.0.1:1", connect_timeout=3):
                pass

    anyio.run(main, backend="asyncio")
