"""A small dispatcher for transport tests and benchmarks (no coordinator needed).

Request bodies are plain msgpack maps ``{"op": ..., ...}``; a body that is not a map
(or has no ``op``) is echoed back unchanged, which is the benchmark's fast path.

ops: ``echo`` (reply = the body), ``sleep`` (``s`` seconds: a parked wait, which a
Cancel frame ends), ``deferred`` (reply after the fake journal is durable past ``lsn``),
``fail`` (ConflictError), ``crash`` (ValueError: must come back as INTERNAL without its
text), ``sleep_deferred`` (a wait whose answer then waits for durability).

It follows the :class:`~rallypoint.transport.server.Dispatcher` protocol like the real
service: ``submit`` answers through ``sink.deliver(rid, reply, lsn)``, and a wait is
registered with ``sink.track`` so that the connection can cancel it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from .. import wire
from ..errors import ConflictError, LimitError, UnauthenticatedError

_decode = msgspec.msgpack.decode
_encode = msgspec.msgpack.Encoder().encode


class FakeJournal:
    """``wait_durable`` blocks until :meth:`advance` (or ``auto=True``: immediate);
    listeners (``add_listener``) hear each advance and :meth:`fail`."""

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto
        self.durable = 0
        self.calls: list[int] = []
        self._changed = trio.Event()
        self.listeners: list = []

    def add_listener(self, fn) -> None:
        self.listeners.append(fn)

    def remove_listener(self, fn) -> None:
        self.listeners.remove(fn)

    def advance(self, lsn: int) -> None:
        self.durable = max(self.durable, lsn)
        self._changed.set()
        self._changed = trio.Event()
        for fn in self.listeners:
            fn(self.durable, None)

    def fail(self, error: Exception) -> None:
        """The journal stops: listeners get ``error`` for everything not durable."""
        for fn in self.listeners:
            fn(self.durable, error)

    async def wait_durable(self, lsn: int) -> None:
        self.calls.append(lsn)
        if self.auto:
            self.durable = max(self.durable, lsn)
            return
        while self.durable < lsn:
            await self._changed.wait()


class TestDispatcher:
    __test__ = False  # not a pytest class

    def __init__(self, journal: FakeJournal | None = None, *, report: bool = False) -> None:
        """``report``: offer ``add_durable_listener`` (as the real service does), so the
        server releases held replies on the journal's reports instead of running a
        durability task per connection."""
        self.journal = journal or FakeJournal(auto=True)
        self.hellos: list[tuple[wire.Hello, str]] = []
        if report:
            self.add_durable_listener = self.journal.add_listener
            self.remove_durable_listener = self.journal.remove_listener

    def hello(self, hello: wire.Hello, peer: str) -> tuple[Any, wire.HelloOk]:
        if hello.api_key == "bad":
            raise UnauthenticatedError("unknown API key; check RALLYPOINT_API_KEY")
        self.hellos.append((hello, peer))
        return {"client": hello.client}, wire.HelloOk(wire.PROTOCOL_VERSION, "test", "default")

    def submit(self, session: Any, body: msgspec.Raw, sink: Any, rid: int) -> None:
        raw = bytes(body)
        if not raw or raw[0] & 0xF0 != 0x80:  # not a fixmap: echo fast path
            sink.deliver(rid, raw, 0)
            return
        req = _decode(raw)
        op = req.get("op") if isinstance(req, dict) else None
        if op is None or op == "echo":
            sink.deliver(rid, raw, 0)
        elif op == "sleep":
            self._spawn(sink, rid, req.get("s", 0.0), _encode({"slept": req.get("s", 0.0), "v": req.get("v")}), 0)
        elif op == "deferred":
            sink.deliver(rid, _encode(req["lsn"]), req["lsn"])
        elif op == "sleep_deferred":
            self._spawn(sink, rid, req.get("s", 0.0), _encode(req["lsn"]), req["lsn"])
        elif op == "fail":
            sink.deliver(rid, ConflictError("the group is closed; open a new one", retry_after=1.5,
                                            details={"group": "g1"}), 0)
        elif op == "limit":  # a refusal at a limit, with the retry_after asked
            sink.deliver(rid, LimitError("at the limit", retry_after=req.get("retry_after"),
                                         details={"limit": "runs"}), 0)
        elif op == "crash":
            raise ValueError("secret internal text: password=hunter2")
        elif op == "crash_async":
            self._spawn(sink, rid, 0.0, KeyError("secret async text"), 0)
        else:
            raise ValueError(f"unknown op {op!r}")

    def _spawn(self, sink: Any, rid: int, s: float, reply: Any, lsn: int) -> None:
        waiter = _SleepWaiter()
        sink.track(rid, waiter)
        trio.lowlevel.spawn_system_task(waiter.run, sink, rid, s, reply, lsn)

    def durable_lsn(self) -> int:
        return self.journal.durable

    async def wait_durable(self, lsn: int) -> None:
        await self.journal.wait_durable(lsn)


class _SleepWaiter:
    """A wait of the test dispatcher: sleeps, then answers; ``cancel()`` ends it with no
    answer (like a parked waiter of the real runtime)."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()

    def cancel(self) -> None:
        self.scope.cancel()

    async def run(self, sink: Any, rid: int, s: float, reply: Any, lsn: int) -> None:
        with self.scope:
            await trio.sleep(s)
            sink.untrack(rid)
            sink.deliver(rid, reply, lsn)
            sink.flush()


class EchoDispatcher:
    """The trivial dispatcher of the benchmark: every body comes back as is."""

    def hello(self, hello: wire.Hello, peer: str) -> tuple[Any, wire.HelloOk]:
        return None, wire.HelloOk(wire.PROTOCOL_VERSION, "bench", "default")

    def submit(self, session: Any, body: msgspec.Raw, sink: Any, rid: int) -> None:
        sink.deliver(rid, bytes(body), 0)

    def durable_lsn(self) -> int:
        return 0

    async def wait_durable(self, lsn: int) -> None:
        return None


# ------------------------------------------------------------------ test helpers

from contextlib import asynccontextmanager  # noqa: E402
from typing import AsyncIterator  # noqa: E402

from .framing import FrameParser, encode_frame  # noqa: E402
from .server import Server  # noqa: E402

_server_decoder = msgspec.msgpack.Decoder(wire.ServerFrame)


@asynccontextmanager
async def running_server(dispatcher: Any = None, **kw: Any) -> AsyncIterator[Server]:
    """A Server on 127.0.0.1 (free port) for the duration of the block."""
    server = Server(dispatcher if dispatcher is not None else TestDispatcher(), **kw)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, None, "127.0.0.1", 0)
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()


class RawClient:
    """A bare frame-level client for robustness tests (Trio)."""

    __test__ = False

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.parser = FrameParser()
        self.frames: list[Any] = []

    @classmethod
    async def connect(cls, port: int, hello: bool = True, source: str | None = None,
                      **hello_kw: Any) -> "RawClient":
        """A connection to 127.0.0.1:``port`` (from the loopback address ``source``, e.g.
        ``127.0.8.2``, to be another peer address), with its Hello answered HelloOk
        unless ``hello`` is false."""
        c = cls(await trio.open_tcp_stream("127.0.0.1", port, local_address=source))
        if hello:
            await c.send(wire.Hello(hello_kw.pop("version", wire.PROTOCOL_VERSION), **hello_kw))
            ok = await c.recv()
            assert isinstance(ok, wire.HelloOk), ok
        return c

    async def send(self, msg: Any) -> None:
        await self.stream.send_all(encode_frame(_encode(msg)))

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def request(self, rid: int, body: Any) -> None:
        await self.send(wire.Request(rid, msgspec.Raw(_encode(body))))

    async def recv(self, timeout: float = 5.0) -> Any:
        """Next server frame (decoded); None at EOF."""
        with trio.fail_after(timeout):
            while not self.frames:
                data = await self.stream.receive_some(65536)
                if not data:
                    return None
                self.frames.extend(_server_decoder.decode(f) for f in self.parser.feed(data))
            return self.frames.pop(0)

    async def expect_eof(self, timeout: float = 5.0) -> list[Any]:
        """Read until EOF; returns the frames received on the way."""
        got = []
        while True:
            try:
                f = await self.recv(timeout)
            except trio.BrokenResourceError:
                return got
            if f is None:
                return got
            got.append(f)

    async def drain_server(self, server: Server, drain_timeout: float = 30.0, within: float = 5.0,
                           wait_grace: float | None = None) -> list[Any]:
        """Drain ``server`` (``Server.drain(drain_timeout, wait_grace)``) while reading
        this connection until EOF; returns the frames received on the way. Fails with
        TooSlowError unless the EOF comes within ``within`` seconds."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.drain, drain_timeout, wait_grace)
            with trio.fail_after(within):
                return await self.expect_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()
