"""Server-side transport tests, driven by a raw frame-level client."""

import itertools
import logging
import struct
import types

import msgspec
import pytest
import trio
import trio.testing

from rallypoint import wire
from rallypoint.errors import UnavailableError
from rallypoint.transport.framing import encode_frame
from rallypoint.transport.testing import FakeJournal, RawClient, TestDispatcher, running_server

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode


async def assert_alive(server) -> None:
    """A fresh connection handshakes and gets an echo back."""
    c = await RawClient.connect(server.port)
    await c.request(1, {"op": "echo", "x": "alive"})
    r = await c.recv()
    assert isinstance(r, wire.Ok) and r.id == 1 and dec(r.body) == {"op": "echo", "x": "alive"}
    await c.aclose()


async def wait_no_connections(server) -> None:
    with trio.fail_after(2):
        while server.statistics()["connections"]:
            await trio.sleep(0.01)


# ------------------------------------------------------------------ handshake

async def test_handshake_ok():
    d = TestDispatcher()
    async with running_server(d) as srv:
        c = await RawClient.connect(srv.port, hello=False)
        await c.send(wire.Hello(wire.PROTOCOL_VERSION, "key", "tester"))
        ok = await c.recv()
        assert ok == wire.HelloOk(wire.PROTOCOL_VERSION, "test", "default")
        assert d.hellos[0][0].client == "tester"
        assert d.hellos[0][1].startswith("127.0.0.1:")
        await c.aclose()


async def test_hello_and_requests_pipelined_in_one_write():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port, hello=False)
        data = encode_frame(enc(wire.Hello(wire.PROTOCOL_VERSION)))
        data += encode_frame(enc(wire.Request(1, msgspec.Raw(enc([1, 2])))))
        await c.send_raw(data)
        assert isinstance(await c.recv(), wire.HelloOk)
        r = await c.recv()
        assert r.id == 1 and dec(r.body) == [1, 2]


async def test_version_mismatch_names_both_versions_and_closes():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port, hello=False)
        await c.send(wire.Hello(99))
        err = await c.recv()
        assert isinstance(err, wire.Err) and err.id == 0 and err.code == "VALIDATION_FAILED"
        assert "version 99" in err.message and f"version {wire.PROTOCOL_VERSION}" in err.message
        assert await c.expect_eof() == []
        await assert_alive(srv)


async def test_no_hello_within_timeout_is_dropped():
    async with running_server(handshake_timeout=0.2) as srv:
        c = await RawClient.connect(srv.port, hello=False)
        with trio.fail_after(2):
            frames = await c.expect_eof()
        assert all(isinstance(f, wire.Err) for f in frames)
        await wait_no_connections(srv)
        await assert_alive(srv)


async def test_bad_api_key_refused():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port, hello=False)
        await c.send(wire.Hello(wire.PROTOCOL_VERSION, "bad"))
        err = await c.recv()
        assert err.code == "UNAUTHENTICATED" and err.id == 0
        assert await c.expect_eof() == []


async def test_first_frame_not_hello_refused():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port, hello=False)
        await c.request(1, "x")
        err = await c.recv()
        assert err.code == "VALIDATION_FAILED" and "hello" in err.message
        assert await c.expect_eof() == []


# --------------------------------------------------------------- requests

async def test_ping_pong():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        await c.send(wire.Ping(42))
        assert await c.recv() == wire.Pong(42)


async def test_replies_in_any_order():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        await c.request(1, {"op": "sleep", "s": 1.0})
        t0 = trio.current_time()
        await c.request(2, {"op": "echo"})
        r = await c.recv()
        assert r.id == 2 and trio.current_time() - t0 < 0.5
        r = await c.recv()
        assert r.id == 1 and dec(r.body)["slept"] == 1.0


async def test_batch_each_answered_in_order():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        reqs = [
            wire.Request(1, msgspec.Raw(enc({"op": "echo", "i": 1}))),
            wire.Request(2, msgspec.Raw(enc({"op": "fail"}))),
            wire.Request(3, msgspec.Raw(enc({"op": "sleep", "s": 0.05}))),
            wire.Request(4, msgspec.Raw(enc({"op": "echo", "i": 4}))),
        ]
        await c.send(wire.Batch(reqs))
        got = {}
        for _ in range(4):
            r = await c.recv()
            got[r.id] = r
        assert dec(got[1].body)["i"] == 1
        assert got[2].code == "CONFLICT" and got[2].retry_after == 1.5 and got[2].details == {"group": "g1"}
        assert dec(got[3].body)["slept"] == 0.05
        assert dec(got[4].body)["i"] == 4


async def test_batch_with_one_bad_request_answers_the_others():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        frame = {
            "t": "batch",
            "reqs": [
                {"t": "req", "id": 1, "body": {"op": "echo"}},
                {"t": "req", "id": 2},  # body missing
                {"t": "req", "id": 3, "body": {"op": "echo"}},
            ],
        }
        await c.send(frame)
        got = {}
        for _ in range(3):
            r = await c.recv()
            got[r.id] = r
        assert isinstance(got[1], wire.Ok) and isinstance(got[3], wire.Ok)
        assert got[2].code == "VALIDATION_FAILED" and "body" in got[2].message and "reqs[1]" in got[2].message


async def test_deferred_replies_wait_for_durability_and_each_leaves_once_its_own_lsn_is_durable():
    journal = FakeJournal()
    async with running_server(TestDispatcher(journal)) as srv:
        c = await RawClient.connect(srv.port)
        data = b"".join(
            encode_frame(enc(wire.Request(i, msgspec.Raw(enc({"op": "deferred", "lsn": 10 + i}))))) for i in (1, 2, 3)
        )
        await c.send_raw(data + encode_frame(enc(wire.Request(4, msgspec.Raw(enc({"op": "echo"}))))))
        r = await c.recv()
        assert r.id == 4  # a non-deferred reply is not held back
        with trio.move_on_after(0.2):
            await c.recv()
            raise AssertionError("deferred reply sent before durability")
        assert srv.statistics()["inflight"] == 3
        # One waiter for the connection, for the OLDEST held reply (LSN 11).
        assert journal.calls == [11]
        journal.advance(12)
        # 11 and 12 are durable: both leave (together), without waiting for 13.
        with trio.fail_after(1):
            got = [await c.recv()]
            if not c.frames:
                got.append(await c.recv())
        got += c.frames
        c.frames.clear()
        assert sorted(f.id for f in got) == [1, 2]
        with trio.move_on_after(0.2):
            await c.recv()
            raise AssertionError("the reply of LSN 13 was sent before durability")
        assert journal.calls == [11, 13]
        assert srv.statistics()["inflight"] == 1
        journal.advance(13)
        with trio.fail_after(1):
            assert (await c.recv()).id == 3
        assert srv.statistics()["inflight"] == 0


async def test_deferred_lsn_order_and_partial_release():
    journal = FakeJournal()
    async with running_server(TestDispatcher(journal)) as srv:
        c = await RawClient.connect(srv.port)
        await c.request(1, {"op": "deferred", "lsn": 5})
        with trio.fail_after(1):
            while journal.calls != [5]:
                await trio.sleep(0.01)
        await c.request(2, {"op": "deferred", "lsn": 9})
        await trio.sleep(0.05)
        journal.advance(5)
        r = await c.recv()
        assert r.id == 1
        with trio.move_on_after(0.2):
            await c.recv()
            raise AssertionError("lsn 9 reply sent before durability")
        journal.advance(9)
        assert (await c.recv()).id == 2
        assert journal.calls == [5, 9]


async def test_with_durability_reports_held_replies_leave_on_the_report_without_a_task():
    # The real service reports durability (add_durable_listener): the server then runs
    # no durability task per connection, and a held reply leaves in the step that
    # hears the report; one the journal will never make durable gets the error.
    journal = FakeJournal()
    async with running_server(TestDispatcher(journal, report=True)) as srv:
        c = await RawClient.connect(srv.port)
        for i in (1, 2, 3):
            await c.request(i, {"op": "deferred", "lsn": 10 + i})
        await c.request(4, {"op": "echo"})
        assert (await c.recv()).id == 4
        await trio.testing.wait_all_tasks_blocked()
        assert srv.statistics()["inflight"] == 3 and journal.calls == []  # nobody awaits the journal
        tasks = {t.name.rsplit(".", 1)[-1] for t in _server_tasks()}
        assert "durability" not in tasks and "writer" in tasks
        journal.advance(12)
        with trio.fail_after(1):
            got = {(await c.recv()).id, (await c.recv()).id}
        assert got == {1, 2} and srv.statistics()["inflight"] == 1
        journal.fail(UnavailableError("the journal stopped", retry_after=1.0))
        with trio.fail_after(1):
            r = await c.recv()
        assert r.id == 3 and r.code == "UNAVAILABLE"
        assert srv.statistics()["inflight"] == 0
        assert len(journal.listeners) == 1  # one for the server, while connections run
        await c.aclose()
        await wait_no_connections(srv)
        assert journal.listeners == []  # a server with no connection hears no reports


def _server_tasks():
    """Every task of this Trio run, depth first."""
    out, stack = [], [trio.lowlevel.current_root_task()]
    while stack:
        t = stack.pop()
        out.append(t)
        for n in t.child_nurseries:
            stack.extend(n.child_tasks)
    return out


async def test_deferred_from_awaitable():
    journal = FakeJournal()
    async with running_server(TestDispatcher(journal)) as srv:
        c = await RawClient.connect(srv.port)
        await c.request(1, {"op": "sleep_deferred", "s": 0.01, "lsn": 5})
        with trio.move_on_after(0.2):
            await c.recv()
            raise AssertionError("deferred reply sent before durability")
        journal.advance(5)
        r = await c.recv()
        assert r.id == 1 and dec(r.body) == 5


async def test_internal_error_does_not_leak(caplog):
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        with caplog.at_level(logging.ERROR, logger="rallypoint.transport"):
            await c.request(1, {"op": "crash"})
            r = await c.recv()
            await c.request(2, {"op": "crash_async"})
            r2 = await c.recv()
        for e in (r, r2):
            assert e.code == "INTERNAL" and "ref " in e.message
            assert "secret" not in e.message and "hunter2" not in e.message
        ref = r.message.rsplit("ref ", 1)[1]
        assert any(ref in rec.getMessage() and rec.exc_info for rec in caplog.records)
        assert srv.statistics()["internal_errors"] == 2
        await c.request(3, {"op": "echo"})
        assert (await c.recv()).id == 3


async def test_repeated_internal_errors_are_rate_limited_in_the_log(caplog):
    """Every request still gets its INTERNAL reply with a ref; the log gets the first
    five tracebacks, and the rest are counted in one line when the server stops."""
    with caplog.at_level(logging.ERROR, logger="rallypoint.transport"):
        async with running_server() as srv:
            c = await RawClient.connect(srv.port)
            for i in range(1, 21):
                await c.request(i, {"op": "crash"})
            replies = [await c.recv() for _ in range(20)]
            assert [(r.id, r.code) for r in replies] == [(i, "INTERNAL") for i in range(1, 21)]
            assert all("ref " in r.message for r in replies)
            logged = [rec for rec in caplog.records if rec.exc_info]
            assert len(logged) == 5
            stats = srv.statistics()
            assert stats["internal_errors"] == 20 and stats["log_lines_suppressed"] == 15
            await c.aclose()
            srv.log_limiter.flush()
    summary = [rec.getMessage() for rec in caplog.records if "similar events suppressed" in rec.getMessage()]
    assert len(summary) == 1 and summary[0].startswith("internal:ValueError: 15 similar events"), summary


# ------------------------------------------------------------- robustness

async def test_garbage_frame_keeps_connection_open():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        await c.send_raw(encode_frame(b"\xc1\xc1\xc1 not msgpack"))
        err = await c.recv()
        assert err.id == 0 and err.code == "VALIDATION_FAILED" and "msgpack" in err.message
        await c.request(5, {"op": "echo"})
        assert (await c.recv()).id == 5
        await assert_alive(srv)


async def test_ill_typed_envelopes_name_the_field_and_keep_connection():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        await c.send({"t": "req", "id": "seven", "body": 1})
        err = await c.recv()
        assert err.id == 0 and err.code == "VALIDATION_FAILED" and "$.id" in err.message
        await c.send({"t": "req", "id": 7})  # body missing: id recoverable
        err = await c.recv()
        assert err.id == 7 and "body" in err.message
        await c.send({"t": "nonsense", "id": 8})  # unknown tag
        err = await c.recv()
        assert err.id == 8 and "$.t" in err.message
        await c.send(wire.Ok(9, msgspec.Raw(enc(1))))  # a server frame type from a client
        err = await c.recv()
        assert err.id == 9 and "$.t" in err.message
        await c.send([1, 2, 3])  # not even a map
        err = await c.recv()
        assert err.id == 0 and err.code == "VALIDATION_FAILED"
        await c.send({"t": "req", "id": -4, "body": 1})
        err = await c.recv()
        assert err.id == 0 and "id" in err.message
        await c.send(wire.Hello(wire.PROTOCOL_VERSION))  # hello twice
        err = await c.recv()
        assert err.id == 0 and err.code == "VALIDATION_FAILED"
        await c.request(10, {"op": "echo"})
        assert (await c.recv()).id == 10
        await assert_alive(srv)


async def test_truncated_frame_then_close():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        frame = encode_frame(enc(wire.Request(1, msgspec.Raw(enc("x" * 1000)))))
        await c.send_raw(frame[:500])
        await c.aclose()
        await wait_no_connections(srv)
        await assert_alive(srv)


async def test_oversize_length_header_rejected_without_reading_body():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        before = srv.statistics()["bytes_in"]
        await c.send_raw(struct.pack(">I", 0xFFFFFFFF) + b"\x00" * 16)
        frames = await c.expect_eof()
        assert len(frames) == 1
        err = frames[0]
        assert err.id == 0 and err.code == "VALIDATION_FAILED"
        assert "4294967295" in err.message and str(wire.MAX_FRAME_BYTES) in err.message
        st = srv.statistics()
        assert st["bytes_in"] - before <= 20 + 64  # nothing beyond what we sent was read
        assert st["max_parse_buffer"] < 1024  # body never allocated
        await assert_alive(srv)


async def test_oversize_during_handshake():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port, hello=False)
        await c.send_raw(struct.pack(">I", wire.MAX_FRAME_BYTES + 1))
        frames = await c.expect_eof()
        assert frames and frames[0].code == "VALIDATION_FAILED" and str(wire.MAX_FRAME_BYTES + 1) in frames[0].message


async def test_idle_peer_pinged_then_dropped():
    async with running_server(idle_ping_interval=0.1) as srv:
        c = await RawClient.connect(srv.port)
        with trio.fail_after(3):
            frames = await c.expect_eof()
        assert any(isinstance(f, wire.Ping) for f in frames)


async def test_max_connections():
    async with running_server(max_connections=1) as srv:
        c1 = await RawClient.connect(srv.port)
        c2 = await RawClient.connect(srv.port, hello=False)
        frames = await c2.expect_eof()
        assert frames[0].code == "UNAVAILABLE" and "1 connections" in frames[0].message
        await c1.request(1, {"op": "echo"})
        assert (await c1.recv()).id == 1
        assert srv.statistics()["rejected_connections"] == 1


async def test_a_full_server_closes_the_oldest_silent_connection_for_a_new_one():
    # issue 41 item 7: connections that never send their Hello, from many addresses each
    # under its cap, took every slot for the whole Hello time-out (10 s) and every new
    # client was refused; a full server now closes the one silent longest -- of the
    # biggest holder, and not for an address that just lost one (max-min fair, no
    # reconnect-evict cascade: rallypoint.transport.guard.Evictable)
    async with running_server(max_connections=2, handshake_timeout=60) as srv:
        srv.evict_silent_after_s = 0.0
        silent = [await RawClient.connect(srv.port, hello=False, source=f"127.0.8.{i + 2}") for i in range(2)]
        with trio.fail_after(10):
            while srv.statistics()["connections"] < 2:
                await trio.sleep(0.01)
        c = await RawClient.connect(srv.port)  # (asserts its HelloOk)
        await c.request(1, {"op": "echo"})
        assert (await c.recv()).id == 1
        frames = await silent[0].expect_eof()  # the oldest, told why
        assert frames and frames[0].code in ("UNAVAILABLE", "VALIDATION_FAILED", "UNAUTHENTICATED"), frames
        st = srv.statistics()
        assert st["silent_evicted"] == 1 and st["rejected_connections"] == 0, st
        # the address that lost it cannot take the other silent one's slot in turn
        again = await RawClient.connect(srv.port, hello=False, source="127.0.8.2")
        frames = await again.expect_eof()
        assert frames[0].code == "UNAVAILABLE" and "2 connections" in frames[0].message, frames
        # only a silent one gives way: a new address's silent one takes the other silent slot...
        d = await RawClient.connect(srv.port, hello=False, source="127.0.8.4")
        await silent[1].expect_eof()
        f = await RawClient.connect(srv.port, source="127.0.0.2")  # ...and a client with its Hello takes d's
        await d.expect_eof()
        # c and f sent their Hello: never closed for another; the next one is refused
        g = await RawClient.connect(srv.port, hello=False, source="127.0.8.5")
        frames = await g.expect_eof()
        assert frames[0].code == "UNAVAILABLE" and "2 connections" in frames[0].message, frames
        for i, x in enumerate((c, f), start=2):
            await x.request(i, {"op": "echo"})
            assert (await x.recv()).id == i
        st = srv.statistics()
        assert st["silent_evicted"] == 3 and st["rejected_connections"] == 2, st


# ------------------------------------------------------------ backpressure

async def test_client_that_never_reads_cannot_grow_server_memory():
    limit = 64 * 1024
    payload = "p" * 4000
    n = 6000  # ~24 MB of replies: far more than socket buffers + limit
    async with running_server(max_outgoing_bytes=limit) as srv:
        c = await RawClient.connect(srv.port)
        one = encode_frame(enc(wire.Request(1, msgspec.Raw(enc({"op": "echo", "p": payload})))))
        sent = 0
        done = trio.Event()

        async def sender():
            nonlocal sent
            for i in range(1, n + 1):
                await c.send_raw(encode_frame(enc(wire.Request(i, msgspec.Raw(enc({"op": "echo", "p": payload}))))))
                sent = i
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            # Wait until the sender is stuck: the server stopped reading.
            last = -1
            while sent != last:
                last = sent
                await trio.sleep(0.3)
            assert not done.is_set(), "server kept reading from a client that never reads"
            st = srv.statistics()
            reply = len(one) + 16
            assert st["outgoing_buffered"] <= 2 * (limit + reply)
            assert st["max_outgoing_buffered"] <= 2 * (limit + reply)
            # Now read everything: nothing was lost.
            seen = set()
            while len(seen) < n:
                r = await c.recv(10)
                assert isinstance(r, wire.Ok)
                seen.add(r.id)
            assert seen == set(range(1, n + 1))
        assert srv.statistics()["max_outgoing_buffered"] <= 2 * (limit + reply)


async def test_inflight_limit_pauses_reading():
    async with running_server(max_inflight_per_conn=8) as srv:
        c = await RawClient.connect(srv.port)
        data = b"".join(
            encode_frame(enc(wire.Request(i, msgspec.Raw(enc({"op": "sleep", "s": 0.02}))))) for i in range(1, 101)
        )
        await c.send_raw(data)
        ids = {(await c.recv()).id for _ in range(100)}
        assert ids == set(range(1, 101))
        st = srv.statistics()
        assert st["max_inflight_per_conn_seen"] <= 8
        assert st["backpressure_pauses"] >= 1


# ------------------------------------------------------------------ drain

async def test_drain_finishes_inflight_then_closes():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        await c.request(1, {"op": "sleep", "s": 0.3})
        await trio.sleep(0.05)
        async with trio.open_nursery() as n:
            n.start_soon(srv.drain)
            frames = await c.expect_eof()
        assert [f.id for f in frames if isinstance(f, wire.Ok)] == [1]
        assert srv.statistics()["draining"] is True
        try:
            await RawClient.connect(srv.port)
        except (OSError, trio.BrokenResourceError, AssertionError):
            pass
        else:
            raise AssertionError("server still accepting after drain")


async def test_drain_timeout_cancels_long_waits_with_unavailable():
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        await c.request(1, {"op": "sleep", "s": 30})
        await trio.sleep(0.05)
        frames = await c.drain_server(srv, 0.2)
        assert [(f.id, f.code) for f in frames] == [(1, "UNAVAILABLE")]


async def test_a_drain_without_grace_answers_parked_waits_at_once():
    """A leader's hand-over drains with ``wait_grace=0`` (issue 42 item 8: its 1 s grace
    held the resignation back and paused workers 1.2 s): a parked wait is answered
    UNAVAILABLE at once, whatever the server's own grace (30 s here)."""
    async with running_server(drain_wait_grace=30.0) as srv:
        c = await RawClient.connect(srv.port)
        await c.request(1, {"op": "sleep", "s": 60})
        await until_requests(srv, 1)
        frames = await c.drain_server(srv, 60.0, within=10, wait_grace=0.0)
        assert [(f.id, f.code) for f in frames] == [(1, "UNAVAILABLE")]


async def until_requests(srv, n: int) -> None:
    with trio.fail_after(10):
        while srv.statistics()["requests"] < n:
            await trio.sleep(0.01)


async def test_drain_of_a_connection_paused_at_its_inflight_limit_keeps_the_grace():
    """A connection paused at max_inflight (its next request read but not admitted)
    when the drain starts: the reader stops waiting for capacity, the parked waits get
    the drain's grace and are answered UNAVAILABLE, the request never admitted gets no
    answer, and the connection closes, long before the drain timeout (it waited for
    all of it before: found by a hostile-peer run)."""
    async with running_server(max_inflight_per_conn=4, drain_wait_grace=0.2) as srv:
        c = await RawClient.connect(srv.port)
        data = b"".join(encode_frame(enc(wire.Request(i, msgspec.Raw(enc({"op": "sleep", "s": 30})))))
                        for i in range(1, 6))
        await c.send_raw(data)
        with trio.fail_after(2):
            while srv.statistics()["backpressure_pauses"] < 1:
                await trio.sleep(0.01)
        t0 = trio.current_time()
        frames = await c.drain_server(srv, 20.0)
        assert sorted((f.id, f.code) for f in frames) == [(i, "UNAVAILABLE") for i in range(1, 5)]
        assert trio.current_time() - t0 < 5


async def test_a_paused_connection_keeps_the_drain_grace_for_its_parked_waits():
    """The drain's own shutdown(SHUT_RD) makes the paused reader's peek see EOF: that is
    not the peer leaving. (It was taken for it: the connection aborted and its parked
    waits were answered at once, without the grace.)"""
    async with running_server(max_inflight_per_conn=4, drain_wait_grace=0.5) as srv:
        c = await RawClient.connect(srv.port)
        data = b"".join(encode_frame(enc(wire.Request(i, msgspec.Raw(enc({"op": "sleep", "s": 30})))))
                        for i in range(1, 6))
        await c.send_raw(data)
        with trio.fail_after(2):
            while srv.statistics()["backpressure_pauses"] < 1:
                await trio.sleep(0.01)
        t0 = trio.current_time()
        frames = await c.drain_server(srv, 20.0)
        assert sorted((f.id, f.code) for f in frames) == [(i, "UNAVAILABLE") for i in range(1, 5)]
        assert trio.current_time() - t0 >= 0.5


@pytest.mark.parametrize("how", ["reset", "fin"])
async def test_peer_gone_while_paused_with_unread_data_ends_its_waits(monkeypatch, how):
    """A peer paused at max_inflight (its waits parked, more requests unread) resets or
    sends FIN: the unread data hides that from a peek, the TCP state does not; the
    connection closes and its waits end, instead of living until they expire."""
    monkeypatch.setattr(server_mod._Conn, "_PEER_POLL_S", 0.02)
    async with running_server(max_inflight_per_conn=4) as srv:
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", srv.port))
        data = encode_frame(enc(wire.Hello(wire.PROTOCOL_VERSION)))
        data += b"".join(encode_frame(enc(wire.Request(i, msgspec.Raw(enc({"op": "sleep", "s": 30})))))
                         for i in range(1, 7))
        await sock.send(data)
        with trio.fail_after(2):
            while srv.statistics()["backpressure_pauses"] < 1:
                await trio.sleep(0.01)
        # more requests now stay in the socket, unread: a peek sees them, not the close
        await sock.send(encode_frame(enc(wire.Request(99, msgspec.Raw(enc({"op": "echo"}))))))
        await trio.sleep(0.05)
        assert srv.statistics()["connections"] == 1
        if how == "reset":
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        else:
            sock.shutdown(trio.socket.SHUT_WR)
        with trio.fail_after(3):
            while srv.statistics()["connections"]:
                await trio.sleep(0.01)
        sock.close()


# ------------------------------------------------------------------ reading a plain TCP socket

from rallypoint.transport import server as server_mod  # noqa: E402
from rallypoint.transport import sockio  # noqa: E402


class _ReadCounter:
    """Wraps ``os.read`` (the server reads plain TCP sockets with it): counts the reads
    of the given fds, and those that found nothing (BlockingIOError)."""

    def __init__(self, monkeypatch, fds=None) -> None:
        self.fds = fds
        self.reads = 0
        self.empty = 0
        real = sockio.os.read

        def read(fd, n):
            if self.fds is not None and fd not in self.fds:
                return real(fd, n)
            self.reads += 1
            try:
                return real(fd, n)
            except BlockingIOError:
                self.empty += 1
                raise

        monkeypatch.setattr(sockio.os, "read", read)


async def test_receive_plain_waits_for_readability_before_reading(monkeypatch):
    a, b = trio.socket.socketpair()
    counter = _ReadCounter(monkeypatch, {a.fileno()})
    got = []

    async def reader():
        got.append(await sockio.receive_plain(a.fileno(), 65536))

    async with trio.open_nursery() as n:
        n.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert counter.reads == 0  # parked on readability, no read attempted
        await b.send(b"hello")
    assert got == [b"hello"]
    assert (counter.reads, counter.empty) == (1, 0)
    a.close()
    b.close()


async def test_receive_plain_ready_reads_first_and_still_yields(monkeypatch):
    a, b = trio.socket.socketpair()
    counter = _ReadCounter(monkeypatch, {a.fileno()})
    waits = []
    real_wait = sockio._wait_readable

    async def wait(fd):
        waits.append(fd)
        await real_wait(fd)

    monkeypatch.setattr(sockio, "_wait_readable", wait)
    await b.send(b"more")
    await trio.testing.wait_all_tasks_blocked()
    with trio.testing.assert_checkpoints():  # yields even though no wait was needed
        data = await sockio.receive_plain(a.fileno(), 65536, ready=True)
    assert data == b"more" and waits == [] and counter.reads == 1
    # ready, but nothing there: one empty read, then the wait
    async with trio.open_nursery() as n:
        n.start_soon(b.send, b"x")
        assert await sockio.receive_plain(a.fileno(), 65536, ready=True) == b"x"
    assert counter.empty == 1 and waits == [a.fileno()]
    a.close()
    b.close()


async def test_receive_plain_eof_shutdown_and_errors():
    a, b = trio.socket.socketpair()
    b.close()
    assert await sockio.receive_plain(a.fileno(), 65536) == b""
    a.close()
    c, d = trio.socket.socketpair()
    c.shutdown(trio.socket.SHUT_RD)  # how a drain wakes a reader
    assert await sockio.receive_plain(c.fileno(), 65536) == b""
    c.close()
    d.close()
    import errno

    assert isinstance(server_mod._stream_error(OSError(errno.EBADF, "bad fd")), trio.ClosedResourceError)
    broken = server_mod._stream_error(ConnectionResetError(errno.ECONNRESET, "reset"))
    assert isinstance(broken, trio.BrokenResourceError) and "reset" in str(broken)


async def test_receive_plain_is_cancellable():
    a, b = trio.socket.socketpair()
    with trio.move_on_after(0.05) as scope:
        await sockio.receive_plain(a.fileno(), 65536)
    assert scope.cancelled_caught
    a.close()
    b.close()


async def test_sequential_requests_never_meet_an_empty_read(monkeypatch):
    """A sequential client's next request cannot arrive before its reply left: the server
    waits for readability instead of trying a read that finds nothing (one failed
    syscall and a raised BlockingIOError per request before)."""
    counter = _ReadCounter(monkeypatch)
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        for i in range(1, 51):
            await c.request(i, {"op": "echo", "i": i})
            r = await c.recv()
            assert r.id == i and dec(r.body) == {"op": "echo", "i": i}
        await c.aclose()
    assert counter.reads >= 50
    assert counter.empty == 0


async def test_a_full_read_is_followed_by_a_read_without_a_wait(monkeypatch):
    """A read that fills the buffer is followed by a read attempt without a wait (more
    is likely there); a 1 MiB pipelined burst arrives intact."""
    counter = _ReadCounter(monkeypatch)
    full_then_read = []
    real = server_mod.receive_plain

    async def receive(fd, n, *, ready=False):
        data = await real(fd, n, ready=ready)
        full_then_read.append((ready, len(data)))
        return data

    monkeypatch.setattr(server_mod, "receive_plain", receive)
    async with running_server() as srv:
        c = await RawClient.connect(srv.port)
        blob = "x" * 4096
        data = b"".join(encode_frame(enc(wire.Request(i, msgspec.Raw(enc({"op": "echo", "b": blob})))))
                        for i in range(1, 257))
        ids = set()
        async with trio.open_nursery() as n:
            n.start_soon(c.send_raw, data)
            for _ in range(256):
                r = await c.recv()
                assert dec(r.body)["b"] == blob
                ids.add(r.id)
        assert ids == set(range(1, 257))
        await c.aclose()
    assert counter.reads >= (1 << 20) // server_mod._RECEIVE_SIZE
    # after every read that filled the buffer, the next one was asked to read first
    for (_, n_prev), (ready, _) in itertools.pairwise(full_then_read):
        assert ready == (n_prev == server_mod._RECEIVE_SIZE)
    assert any(ready for ready, _ in full_then_read)


async def test_receive_plain_on_a_closed_socket_is_closed_resource_error():
    """``fileno()`` of a socket closed meanwhile is -1: a ClosedResourceError, not the
    ValueError Trio's wait would raise (found by a hostile-client run)."""
    for ready in (False, True):
        with pytest.raises(trio.ClosedResourceError):
            await sockio.receive_plain(-1, 65536, ready=ready)


async def test_a_limit_refusal_pauses_reading_that_connection_for_its_retry_after(autojump_clock):
    # issue 41: a noisy tenant re-sending at once at its limits (ignoring retry_after)
    # doubled a quiet tenant's p99 (scripts/bench_noisy_tenant.py); the server now does
    # not read a refused connection again for its retry_after (virtual time here)
    async with running_server() as srv:
        noisy = await RawClient.connect(srv.port)
        quiet = await RawClient.connect(srv.port)
        await noisy.request(1, {"op": "limit", "retry_after": 0.8})
        refused = await noisy.recv(60)
        assert refused.code == "LIMIT_EXCEEDED"
        t0 = trio.current_time()
        await noisy.request(2, {"op": "echo"})
        await quiet.request(3, {"op": "echo"})
        assert (await quiet.recv(60)).id == 3
        quiet_at = trio.current_time() - t0
        assert (await noisy.recv(60)).id == 2  # answered, after the pause
        noisy_at = trio.current_time() - t0
        assert noisy_at >= 0.8 > quiet_at, (noisy_at, quiet_at)
        # no retry_after: a short pause still (LIMIT_PAUSE_S), never more than LIMIT_PAUSE_MAX_S
        await noisy.request(4, {"op": "limit"})
        assert (await noisy.recv(60)).code == "LIMIT_EXCEEDED"
        t1 = trio.current_time()
        await noisy.request(5, {"op": "echo"})
        assert (await noisy.recv(60)).id == 5
        assert 0.25 <= trio.current_time() - t1 < 0.8
        assert srv.statistics()["limit_pauses"] == 2


# ------------------------------------------------------------ the reply gate (a leader's self-fence)


class _GatedDispatcher(TestDispatcher):
    """``may_reply`` as a cluster leader's self-fence answers it; ``park`` requests wait
    for the test to answer them (a read admitted in time, answered later)."""

    def __init__(self) -> None:
        super().__init__()
        self.leading = True
        self.parked: list = []

    def may_reply(self) -> bool:
        return self.leading

    def refusal(self):
        from rallypoint.errors import NotLeaderError

        return NotLeaderError("no longer leads", retry_after=0.5)

    def submit(self, session, body, sink, rid) -> None:
        req = msgspec.msgpack.decode(bytes(body))
        if isinstance(req, dict) and req.get("op") == "park":
            self.parked.append((sink, rid, req.get("lsn", 0)))
            return
        super().submit(session, body, sink, rid)


async def test_a_reply_computed_past_the_reply_gate_is_refused_not_sent():
    """SCALE-OUT §4.4 layer 2 ("re-checks before each reply batch"): a request admitted
    while the node led and answered after its leadership lapsed (a SIGSTOP past the
    lease, then resumed) gets NOT_LEADER, not the answer (a read: nothing applied) --
    or UNAVAILABLE maybe_applied for a change with a journal record (a standby that has
    not seen the lapse may still commit it) -- and a watch's next push ends the stream;
    the gate was checked at admission only before."""
    d = _GatedDispatcher()
    async with running_server(d) as srv:
        c = await RawClient.connect(srv.port)
        await c.request(1, {"op": "echo"})
        assert isinstance(await c.recv(), wire.Ok)
        await c.request(2, {"op": "park"})
        await c.request(3, {"op": "park", "lsn": 7})
        await c.request(4, {"op": "park"})
        with trio.fail_after(10):
            while len(d.parked) < 3:
                await trio.sleep(0.01)
        d.leading = False  # the lease lapsed meanwhile
        (s2, r2, _), (s3, r3, _), (s4, r4, _) = d.parked
        s2.deliver(r2, msgspec.msgpack.encode({"stale": "read"}), 0)
        s2.flush()
        got = await c.recv()
        assert isinstance(got, wire.Err) and got.id == 2 and got.code == "NOT_LEADER", got
        s3.deliver(r3, msgspec.msgpack.encode({"applied": "maybe"}), 7)
        s3.flush()
        got = await c.recv()
        assert isinstance(got, wire.Err) and got.id == 3 and got.code == "UNAVAILABLE", got
        assert got.details == {"maybe_applied": True}
        assert s4.add_stream(r4, types.SimpleNamespace(cancel=lambda: None))  # (a watch)
        s4.push(r4, [], 0)  # a watch's push past the gate: the stream ends, nothing pushed
        got = await c.recv()
        assert isinstance(got, wire.Err) and got.id == 4 and got.code == "NOT_LEADER", got
        assert srv.statistics()["fenced_replies"] == 3
        d.leading = True
        await c.request(5, {"op": "echo"})
        assert (await c.recv()).id == 5  # the gate is asked each time, not latched
        await c.aclose()
