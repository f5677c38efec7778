"""Client-side transport tests: rallypoint.transport.Connection against the real Server."""

import itertools
import queue
import random
import threading

import anyio
import msgspec
import pytest
import trio

from rallypoint import wire
from rallypoint.errors import (
    ConflictError,
    InternalError,
    UnauthenticatedError,
    UnavailableError,
    ValidationError,
)
from rallypoint.transport import Connection, Server, connect_transport
from rallypoint.transport.testing import TestDispatcher, running_server

enc = msgspec.msgpack.encode
dec = msgspec.msgpack.decode


class Echo(msgspec.Struct, tag_field="op", tag="echo"):
    """Stands in for a coordinator operation Struct (tagged, unknown to the transport)."""

    value: int
    text: str = ""


def url(server) -> str:
    return f"tcp://127.0.0.1:{server.port}"


async def test_call_bytes_and_struct():
    async with running_server() as srv, connect_transport(url(srv), client_name="t") as conn:
        assert conn.server_info.server_version == "test"
        assert dec(await conn.call(enc({"op": "echo", "x": 1}))) == {"op": "echo", "x": 1}
        r = await conn.call(Echo(7, "hi"))
        assert msgspec.msgpack.decode(r, type=Echo) == Echo(7, "hi")


async def test_errors_are_reraised_as_their_class():
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        with pytest.raises(ConflictError) as ei:
            await conn.call(enc({"op": "fail"}))
        assert ei.value.retry_after == 1.5 and ei.value.details == {"group": "g1"}
        with pytest.raises(InternalError) as ei:
            await conn.call(enc({"op": "crash"}))
        assert "secret" not in str(ei.value) and "ref" in ei.value.message
        assert dec(await conn.call(enc([1]))) == [1]  # still usable


async def test_call_many_in_order():
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        res = await conn.call_many(
            [enc({"op": "echo", "i": 0}), enc({"op": "fail"}), Echo(2), enc({"op": "sleep", "s": 0.01, "v": 3})]
        )
        assert dec(res[0])["i"] == 0
        assert isinstance(res[1], ConflictError)
        assert msgspec.msgpack.decode(res[2], type=Echo) == Echo(2)
        assert dec(res[3])["v"] == 3
        assert await conn.call_many([]) == []


async def test_many_concurrent_callers_on_one_connection():
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        seen = 0

        async def worker(w: int) -> None:
            nonlocal seen
            for i in range(50):
                if random.random() < 0.1:
                    r = dec(await conn.call(enc({"op": "sleep", "s": 0.001, "v": [w, i]})))
                    assert r["v"] == [w, i]
                else:
                    assert dec(await conn.call(enc({"op": "echo", "w": w, "i": i}))) == {"op": "echo", "w": w, "i": i}
                seen += 1

        async with trio.open_nursery() as n:
            for w in range(100):
                n.start_soon(worker, w)
        assert seen == 5000


async def test_many_calls_in_flight_start_leaving_before_the_writer_runs():
    """Under Trio on plain TCP, once 1 KiB of requests is queued the calling task sends
    it at once (the writer task would run only after every woken caller): the server
    starts on the first requests while the client makes the rest. Byte order is kept:
    every caller gets its own answer, also with large frames that fill the socket."""
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        assert conn._sock is not None
        early = 0
        real = conn._send_now

        def spy():
            nonlocal early
            early += 1
            real()

        conn._send_now = spy
        got = {}

        async def one(i: int) -> None:
            body = {"op": "echo", "i": i, "pad": "x" * (30 if i % 7 else 70_000)}
            got[i] = dec(await conn.call(enc(body)))["i"]

        for _ in range(3):
            async with trio.open_nursery() as n:
                for i in range(64):
                    n.start_soon(one, i)
        assert got == {i: i for i in range(64)}
        assert early > 0


async def test_long_call_does_not_block_others():
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        async with trio.open_nursery() as n:
            n.start_soon(conn.call, enc({"op": "sleep", "s": 1.0}))
            await trio.sleep(0.01)
            with trio.fail_after(0.5):  # fails the test if the echo waits behind the sleep
                reply = dec(await conn.call(enc({"op": "echo", "v": "fast"})))
            assert reply["v"] == "fast"
            n.cancel_scope.cancel()


async def test_cancelled_call_leaves_connection_usable():
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        with trio.move_on_after(0.05):
            await conn.call(enc({"op": "sleep", "s": 0.2, "v": "late"}))
            raise AssertionError("not cancelled")
        await trio.sleep(0.3)  # the late reply arrives and is discarded
        assert dec(await conn.call(enc({"op": "echo", "v": "now"})))["v"] == "now"
        assert not conn._pending


async def pending_sleep(conn, errors: list) -> None:
    """A call the server answers only after 30 s; the UnavailableError it ends with
    (the connection dropped) is appended to ``errors``."""
    try:
        await conn.call(enc({"op": "sleep", "s": 30}))
    except UnavailableError as exc:
        errors.append(exc)


async def test_dropped_connection_fails_pending_and_later_calls():
    async with trio.open_nursery() as outer:
        srv = Server(TestDispatcher())
        scope = trio.CancelScope()

        async def run_server(task_status=trio.TASK_STATUS_IGNORED):
            with scope:
                await srv.serve(None, "127.0.0.1", 0, task_status=task_status)

        await outer.start(run_server)
        async with connect_transport(url(srv)) as conn:
            errors = []
            with trio.fail_after(5):
                async with trio.open_nursery() as n:
                    for i in range(5):
                        n.start_soon(pending_sleep, conn, errors)
                    await trio.sleep(0.1)
                    scope.cancel()  # kill the server side mid-call
            assert len(errors) == 5
            with pytest.raises(UnavailableError):
                await conn.call(enc({"op": "echo"}))
            with pytest.raises(UnavailableError):
                await conn.call_many([enc(1)])
            assert conn.closed


async def test_open_unreachable_and_refused_handshake():
    with trio.socket.socket() as s:  # a port with nothing listening
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UnavailableError) as ei:
        await Connection.open(f"tcp://127.0.0.1:{port}", connect_timeout=2)
    assert "cannot connect" in ei.value.message
    with pytest.raises(ValidationError):
        await Connection.open("http://x:1")
    async with running_server() as srv:
        with pytest.raises(UnauthenticatedError):
            await Connection.open(url(srv), api_key="bad")


async def test_handshake_timeout_on_silent_server():
    async with trio.open_nursery() as n:
        listeners = await n.start(trio.serve_tcp, lambda s: trio.sleep_forever(), 0)
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(UnavailableError):
            await Connection.open(f"tcp://127.0.0.1:{port}", connect_timeout=0.2)
        n.cancel_scope.cancel()


async def test_client_answers_server_pings():
    async with running_server(idle_ping_interval=0.05) as srv, connect_transport(url(srv)) as conn:
        await trio.sleep(0.5)  # ten idle intervals: a silent peer would be dropped after three
        assert dec(await conn.call(enc([1]))) == [1]


async def test_body_exception_propagates_unwrapped():
    async with running_server() as srv:
        with pytest.raises(KeyError):
            async with connect_transport(url(srv)) as conn:
                await conn.call(enc(1))
                raise KeyError("mine")


async def test_oversize_request_rejected_client_side():
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        with pytest.raises(ValidationError) as ei:
            await conn.call(b"\xc6" + (wire.MAX_FRAME_BYTES + 10).to_bytes(4, "big") + b"x" * (wire.MAX_FRAME_BYTES + 10))
        assert str(wire.MAX_FRAME_BYTES) in ei.value.message
        assert dec(await conn.call(enc(2))) == 2


async def test_large_pipelined_payloads():
    # 40 requests of 60 KB in flight at once: every reply comes back whole, to its caller.
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        blob = "b" * 60000
        got: dict[int, dict] = {}

        async def one(i):
            got[i] = dec(await conn.call(enc({"op": "echo", "blob": blob, "i": i})))

        async with trio.open_nursery() as n:
            for i in range(40):
                n.start_soon(one, i)
        assert sorted(got) == list(range(40))
        assert all(r["i"] == i and r["blob"] == blob for i, r in got.items())


# ---------------------------------------------------------------- asyncio client

def _server_thread(q: "queue.Queue") -> None:
    async def main():
        srv = Server(TestDispatcher())
        async with trio.open_nursery() as n:
            await n.start(srv.serve, None, "127.0.0.1", 0)
            q.put((srv.port, trio.lowlevel.current_trio_token(), n.cancel_scope))
            await trio.sleep_forever()

    trio.run(main)


def test_client_under_asyncio():
    q: queue.Queue = queue.Queue()
    t = threading.Thread(target=_server_thread, args=(q,), daemon=True)
    t.start()
    port, token, scope = q.get(timeout=10)
    u = f"tcp://127.0.0.1:{port}"

    async def client():
        import asyncio

        asyncio.get_running_loop()  # really asyncio
        async with connect_transport(u) as conn:
            assert conn._sock is None  # asyncio's transport buffers: no direct sends
            assert dec(await conn.call(enc({"op": "echo", "a": 1}))) == {"op": "echo", "a": 1}
            assert msgspec.msgpack.decode(await conn.call(Echo(3)), type=Echo) == Echo(3)
            with pytest.raises(ConflictError):
                await conn.call(enc({"op": "fail"}))
            res = await conn.call_many([enc(1), enc({"op": "fail"})])
            assert dec(res[0]) == 1 and isinstance(res[1], ConflictError)
            results = []

            async def one(i):
                results.append(dec(await conn.call(enc({"op": "sleep", "s": 0.01, "v": i})))["v"])

            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(one, i)
            assert sorted(results) == list(range(50))
            with anyio.move_on_after(0.05):
                await conn.call(enc({"op": "sleep", "s": 0.2}))
            assert dec(await conn.call(enc(5))) == 5

            # the server goes away mid-call: pending call fails with UnavailableError
            async def kill_soon():
                await anyio.sleep(0.1)
                token.run_sync_soon(scope.cancel)

            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_soon)
                with anyio.fail_after(5):
                    with pytest.raises(UnavailableError):
                        await conn.call(enc({"op": "sleep", "s": 30}))
            with pytest.raises(UnavailableError):
                await conn.call(enc(1))

    anyio.run(client, backend="asyncio")
    t.join(5)
    assert not t.is_alive()


# ------------------------------------------------------------------ reading under Trio

from rallypoint.transport import sockio  # noqa: E402


async def test_sequential_calls_never_meet_an_empty_read(monkeypatch):
    """Under Trio on plain TCP both readers (client and server) wait for readability
    before they read: a reply is never there right after its request left, and trying
    first costs a failed read (EAGAIN) and a raised BlockingIOError per call."""
    real = sockio.os.read
    counts = {"reads": 0, "empty": 0}

    def read(fd, n):
        counts["reads"] += 1
        try:
            return real(fd, n)
        except BlockingIOError:
            counts["empty"] += 1
            raise

    monkeypatch.setattr(sockio.os, "read", read)
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        for i in range(50):
            assert dec(await conn.call(enc({"op": "echo", "v": i})))["v"] == i
    assert counts["reads"] >= 100  # 50 requests read by the server, 50 replies by the client
    assert counts["empty"] == 0


async def test_stream_closed_under_a_waiting_reader_fails_calls_as_lost(caplog):
    """The stream closed while the reader waits for readability (what the writer does on
    a send error): pending calls fail UNAVAILABLE 'connection was lost', and the reader
    does not log itself as failed."""
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        errors = []
        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                n.start_soon(pending_sleep, conn, errors)
                await trio.testing.wait_all_tasks_blocked(0.01)
                await conn._stream.aclose()
        assert len(errors) == 1 and "lost" in str(errors[0])
        assert not [r for r in caplog.records if "reader failed" in r.getMessage()]


async def test_large_replies_arrive_whole_with_back_to_back_reads(monkeypatch):
    """Replies larger than the read buffer: after a read that filled it the client reads
    again before waiting (``ready``); every byte arrives in order."""
    real = sockio.receive_plain
    calls = []

    async def receive(fd, n, *, ready=False):
        data = await real(fd, n, ready=ready)
        calls.append((fd, ready, len(data), n))
        return data

    monkeypatch.setattr(sockio, "receive_plain", receive)
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        blob = "y" * (200 * 1024)
        async with trio.open_nursery() as nursery:
            got = {}

            async def one(i):
                got[i] = dec(await conn.call(enc({"op": "echo", "i": i, "b": blob})))

            for i in range(4):
                nursery.start_soon(one, i)
        assert sorted(got) == list(range(4)) and all(v["b"] == blob and v["i"] == i for i, v in got.items())
        fd = conn._sock.fileno()
    mine = [c for c in calls if c[0] == fd]
    for (_, _, got_n, size), (_, ready, _, _) in itertools.pairwise(mine):
        assert ready == (got_n == size)
    assert any(ready for _, ready, _, _ in mine)


async def test_reader_after_its_socket_closed_raises_anyio_closed(caplog):
    """The writer closes the stream (a failed send) while the reader is between two
    reads: the next read is anyio's ClosedResourceError (the reader's 'connection was
    lost'), not a ValueError from waiting on fd -1 (logged as a reader failure)."""
    async with running_server() as srv, connect_transport(url(srv)) as conn:
        await conn._stream.aclose()
        with trio.fail_after(2):
            while not conn.closed:
                await trio.sleep(0.001)
        for full in (False, True):
            conn._full = full
            with pytest.raises(anyio.ClosedResourceError):
                await conn._receive_plain(65536)
    assert not [r for r in caplog.records if "reader failed" in r.getMessage()]
