"""The client side of a rallypoint connection, on anyio (works under Trio and asyncio).

Usage::

    async with connect_transport("tcp://127.0.0.1:7411", api_key=key) as conn:
        reply = await conn.call(SomeOp(...))          # msgspec.Raw of the reply body
        results = await conn.call_many([op1, op2])    # one Batch frame; Raw | RallypointError each

which is the same as::

    conn = await Connection.open("tcp://127.0.0.1:7411", api_key=key)   # connect + handshake
    async with conn:                                                     # runs the reader/writer
        ...

A Connection is pipelined: any number of tasks may ``call`` concurrently; requests are
coalesced into as few ``send`` calls as possible by one writer task and replies are
matched to their callers by request id by one reader task. The two tasks live in a
task group owned by the ``async with`` block, so a Connection must be used inside it.

Failure semantics: if the connection drops, every pending call and every later call
raises :class:`~rallypoint.errors.UnavailableError` (never hangs). A call cancelled by
its caller leaves the connection usable (the late reply is discarded). Errors the server
returns are re-raised as their RallypointError subclass (:func:`error_from_wire`).
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections import deque
from typing import Any, AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import anyio
import anyio.abc
import msgspec
# trio is installed with rallypoint (the server runs on it); only plain TCP under Trio
# reads through sockio, whose wait raises Trio's (not anyio's) ClosedResourceError
from trio import ClosedResourceError as _TrioClosed

from .. import wire
from ..errors import RallypointError, SlowConsumerError, UnavailableError, ValidationError, error_from_wire
from . import sockio
from .framing import HEADER, HEADER_PLACEHOLDER, FrameParser, encode_frame, pack_header_into, pack_uint

__all__ = ["Connection", "connect_transport", "parse_url"]

log = logging.getLogger("rallypoint.transport")

_RECEIVE_SIZE = 65536
_MAX_FRAME = wire.MAX_FRAME_BYTES
#: Requests queued for sending beyond which callers wait for the writer.
_MAX_OUTGOING = 4 * 1024 * 1024
#: A plain TCP connection sends queued requests at once (one non-blocking send from the
#: calling task) once this many bytes are queued, instead of waiting for the writer
#: task: with many calls in flight the server starts on the first ones while the client
#: is still making the rest (the writer would run only after every woken caller).
_EARLY_SEND_BYTES = 1024

_encoder = msgspec.msgpack.Encoder()
_encode = _encoder.encode
_encode_into = _encoder.encode_into
_server_decoder = msgspec.msgpack.Decoder(wire.ServerFrame)

# Hand-built envelope prefixes: {"t": "req", "id": <id>, "body": <body>}
_REQ_HEAD = b"\x83\xa1t\xa3req\xa2id"
_REQ_BODY = b"\xa4body"
# {"t": "batch", "reqs": [ ... ]}
_BATCH_HEAD = b"\x82\xa1t\xa5batch\xa4reqs"
_BYTES_LIKE = (bytes, bytearray, memoryview)

_Ok = wire.Ok
_Err = wire.Err
_Push = wire.Push


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://host:port`` or ``tls://host:port`` -> (host, port)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # out of range or not a number
        port = None
    if parts.scheme not in ("tcp", "tls") or not parts.hostname or port is None:
        raise ValidationError(
            f"bad server url {url!r}: expected tcp://host:port or tls://host:port with a port 0-65535",
            details={"field": "url"},
        )
    return parts.hostname, port


def client_ssl_context(tls_ca: str | None = None):
    """A verifying client context: the system's CAs, or only ``tls_ca`` (a PEM file)."""
    import ssl

    ctx = ssl.create_default_context(cafile=tls_ca) if tls_ca else ssl.create_default_context()
    return ctx


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _native_event_class() -> Any:
    """The running library's own Event class: anyio.Event() costs ~3 us per creation
    (backend lookup), a native one a fraction; both honour anyio cancellation."""
    try:
        import trio

        trio.lowlevel.current_task()
        return trio.Event
    except (ImportError, RuntimeError):
        pass
    try:
        import asyncio

        asyncio.get_running_loop()
        return asyncio.Event
    except RuntimeError:  # pragma: no cover
        return anyio.Event


def _put_request(out: bytearray, rid: int, body: Any) -> None:
    """Append one Request envelope ``{"t": "req", "id": rid, "body": body}`` to ``out``;
    ``body`` is a Struct (encoded in place) or already-encoded msgpack bytes."""
    out += _REQ_HEAD
    out += pack_uint(rid)
    out += _REQ_BODY
    if isinstance(body, _BYTES_LIKE):
        out += body
    else:
        _encode_into(body, out, len(out))


def _end_frame(out: bytearray, start: int, what: str, field: str) -> None:
    """Patch the length prefix of the frame begun at ``start``, or drop the frame and
    raise VALIDATION_FAILED when it is over the frame limit."""
    size = len(out) - start - HEADER
    if size > _MAX_FRAME:
        del out[start:]
        raise ValidationError(
            wire.too_large_message(f"{what} (field `{field}`)", size, _MAX_FRAME,
                                   "a frame is at most 1 MiB: send fewer items per request"),
            details={"field": field, "size": size, "limit": _MAX_FRAME},
        )
    pack_header_into(out, start, size)


def _early_send_socket(stream: Any) -> Any:
    """The stdlib socket under a plain TCP stream when the running library is Trio
    (whose stream keeps no buffer of its own, so a direct non-blocking send between the
    writer's sends keeps the byte order); None otherwise (TLS, asyncio's transports)."""
    if not isinstance(stream, anyio.abc.SocketStream):
        return None
    try:
        import sniffio

        if sniffio.current_async_library() != "trio":
            return None
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    except Exception:
        return None
    return sock if isinstance(sock, socket.socket) else None


class _Slot:
    __slots__ = ("event", "value")

    def __init__(self, event_cls: Any) -> None:
        self.event = event_cls()
        self.value: Any = None


class Subscription:
    """The client side of a subscription (``events.watch``) on a connection: ``start``
    (the encoded WatchView), ``await next_batch()`` (the encoded events that arrived,
    in order; raises the error that ended it once they are read), ``close()``.

    The connection's reader never waits for the application: a Push that arrives when
    ``max_events`` are already buffered ends the subscription here (a Cancel is sent)
    with SLOW_CONSUMER (``details["client_side"]``), after the events already buffered
    (so the buffer holds at most ``max_events`` plus one frame, <= 512 events).
    ``scanned``: the newest cursor the server pushed (``wire.Push.cursor``; None before
    the first, or from a server that does not send it)."""

    def __init__(self, conn: "Connection", rid: int, max_events: int) -> None:
        self.conn = conn
        self.rid = rid
        self.max_events = max_events
        self.start: Any = None
        self.error: RallypointError | None = None
        self._buf: deque = deque()
        self._event = anyio.Event()
        self.scanned: int | None = None
        self._returned: int | None = None  # ``scanned`` when next_batch last returned

    def _wake(self) -> None:
        self._event.set()

    def _feed(self, events: list, cursor: int | None = None) -> None:
        if self.error is not None:
            return
        if not events:  # only the position moved
            if cursor is not None:
                self.scanned = cursor
                self._wake()
            return
        if len(self._buf) >= self.max_events:  # (one frame more is taken: a frame never overflows alone)
            self.error = SlowConsumerError(
                f"the application did not read this watch fast enough: its client buffer of {self.max_events} "
                "events filled, so the subscription was ended; resume from the last event read",
                details={"client_side": True},
            )
            self.conn._drop_stream(self.rid, cancel=True)
        else:
            self._buf.extend(events)
            if cursor is not None:
                self.scanned = cursor
        self._wake()

    def _end(self, error: RallypointError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    async def next_batch(self) -> list:
        """Every event buffered (encoded) -- none when only ``scanned`` moved --, waiting
        for either; raises the error that ended the subscription once it is empty."""
        while not self._buf and self.error is None and self.scanned == self._returned:
            await self._event.wait()
            self._event = anyio.Event()
        self._returned = self.scanned
        if self._buf or self.error is None:
            out = list(self._buf)
            self._buf.clear()
            return out
        raise self.error  # type: ignore[misc]

    def close(self) -> None:
        """End the subscription (a Cancel frame; events still in flight are dropped)."""
        self.conn._drop_stream(self.rid, cancel=True)
        self._end(UnavailableError("the watch was closed"))


class Connection:
    """A pipelined connection to a rallypoint server. See the module docstring."""

    server_info: wire.HelloOk

    def __init__(self, stream: anyio.abc.ByteStream, url: str, server_info: wire.HelloOk, parser: FrameParser,
                 leftover: list[memoryview]) -> None:
        self.url = url
        self.server_info = server_info
        self._stream = stream
        self._parser = parser
        self._leftover = leftover
        self._pending: dict[int, _Slot] = {}
        self._streams: dict[int, Subscription] = {}
        self._next_id = 1
        self._out = bytearray()
        self._writer_event: anyio.Event | None = None
        self._drained_event: anyio.Event | None = None
        self._closed: str | None = None  # reason, once closed
        self._conn_error: str | None = None  # last Err(id=0) from the server
        self._tg: anyio.abc.TaskGroup | None = None
        self._started = False
        self._event_cls: Any = anyio.Event
        self._closed_event: anyio.Event | None = None
        # the raw socket of a plain TCP stream under Trio (see __aenter__): early sends
        # go straight to it
        self._sock: Any = None
        self._writing = False  # the writer task holds bytes it has not finished sending
        #: close the connection when the server sends nothing for this long (seconds)
        #: while calls wait; pinged at half of it (None: never; see :meth:`watch_liveness`)
        self.liveness_s: float | None = None
        self._last_recv = 0.0

    # ------------------------------------------------------------------ opening

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        api_key: str | None = None,
        client_name: str = "",
        connect_timeout: float = 10.0,
        tls_ca: str | None = None,
        ssl_context: Any = None,
        space: str | None = None,
    ) -> "Connection":
        """Connect and handshake. Use the result as ``async with conn:`` (that runs its
        reader and writer tasks). Raises UnavailableError if the server cannot be
        reached in ``connect_timeout`` seconds (or a TLS handshake fails), or the
        server's error (e.g. UnauthenticatedError, ValidationError on a version
        mismatch) if it refuses. ``tls://`` URLs verify the server against
        ``ssl_context``, else the CA file ``tls_ca``, else the system's CAs. ``space``:
        the space an open-mode server gives this connection (ignored once keys exist)."""
        host, port = parse_url(url)
        use_tls = url.startswith("tls://")
        if use_tls and ssl_context is None:
            ssl_context = client_ssl_context(tls_ca)
        stream: anyio.abc.SocketStream | None = None
        try:
            with anyio.fail_after(connect_timeout):
                if use_tls:
                    stream = await anyio.connect_tcp(
                        host, port, tls=True, ssl_context=ssl_context, tls_hostname=host,
                        tls_standard_compatible=False,
                    )
                else:
                    stream = await anyio.connect_tcp(host, port)
                try:
                    import socket

                    stream.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(
                        socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
                    )
                except Exception:
                    pass
                hello = wire.Hello(wire.PROTOCOL_VERSION, api_key, client_name, space)
                await stream.send(encode_frame(_encode(hello)))
                parser = FrameParser()
                frames: list[memoryview] = []
                while not frames:
                    data = await stream.receive(_RECEIVE_SIZE)
                    frames = parser.feed(data)
                    if parser.oversize is not None and not frames:
                        raise UnavailableError(f"{url}: the server sent a malformed handshake reply")
                first = _server_decoder.decode(frames[0])
        except RallypointError:
            if stream is not None:
                await anyio.aclose_forcefully(stream)
            raise
        except TimeoutError:
            if stream is not None:
                await anyio.aclose_forcefully(stream)
            raise UnavailableError(
                f"cannot connect to {url}: no answer within {connect_timeout:g}s; is the server running?",
                retry_after=1.0,
            ) from None
        except ssl.SSLError as exc:  # an OSError too, but the server is running: say what failed
            if stream is not None:
                await anyio.aclose_forcefully(stream)
            if isinstance(exc, ssl.SSLCertVerificationError):
                raise UnavailableError(
                    f"cannot connect to {url}: the server's TLS certificate failed verification "
                    f"({exc.verify_message or exc.reason}); give the CA file that signed it (tls_ca=...)",
                    details={"tls": "certificate_verify_failed", "reason": exc.verify_message or exc.reason},
                ) from None
            raise UnavailableError(
                f"cannot connect to {url}: the TLS handshake failed ({exc.reason or exc}); "
                "is the server serving TLS? (tcp:// for a plain server)",
                details={"tls": "handshake_failed", "reason": exc.reason},
            ) from None
        except (OSError, anyio.EndOfStream, anyio.BrokenResourceError) as exc:
            connected = stream is not None
            if stream is not None:
                await anyio.aclose_forcefully(stream)
            if connected:  # TCP worked, the handshake did not
                hint = ("the server closed the connection during the handshake "
                        + ("(a TLS certificate problem?)" if use_tls else "(is it a TLS server? then use tls://)"))
            else:
                hint = f"{exc or type(exc).__name__}; is the server running?"
            raise UnavailableError(
                f"cannot connect to {url}: {hint}", retry_after=1.0
            ) from None
        except msgspec.MsgspecError as exc:
            await anyio.aclose_forcefully(stream)  # type: ignore[arg-type]
            raise UnavailableError(f"{url}: the server sent an invalid handshake reply: {exc}") from None
        if type(first) is _Err:
            await anyio.aclose_forcefully(stream)
            raise error_from_wire(first.code, first.message, first.retry_after, first.details)
        if type(first) is not wire.HelloOk:
            await anyio.aclose_forcefully(stream)
            raise UnavailableError(f"{url}: expected hello_ok from the server, got {type(first).__name__}")
        return cls(stream, url, first, parser, frames[1:])

    async def __aenter__(self) -> "Connection":
        if self._started:
            raise RuntimeError("a Connection can be entered only once")
        self._started = True
        self._event_cls = _native_event_class()
        self._sock = _early_send_socket(self._stream)
        self._closed_event = anyio.Event()
        if self._closed is not None:
            self._closed_event.set()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._reader)
        tg.start_soon(self._writer)
        if self.liveness_s is not None:
            tg.start_soon(self._liveness)
        return self

    def watch_liveness(self, seconds: float | None) -> None:
        """Before entering: close this connection when, while a call or a subscription
        waits, the server sends nothing for ``seconds`` (it is pinged at half of that;
        any frame counts, a Pong included). A server that is stopped (SIGSTOP, a VM
        pause) or cut off behind a live TCP connection is then left like a dropped one
        -- a replicated shard's client goes on to the new leader -- instead of being
        waited for as long as it is gone. A server-side wait does not count: the
        server answers pings while it parks a request. None: never."""
        self.liveness_s = seconds

    #: the start of :attr:`close_reason` when the liveness check closed the connection
    SILENT_REASON = "the server stopped answering"

    @property
    def went_silent(self) -> bool:
        """True when :meth:`watch_liveness` closed this connection (the server sent
        nothing while calls waited: stopped, frozen or cut off)."""
        return (self._closed or "").startswith(self.SILENT_REASON)

    async def _liveness(self) -> None:
        limit = self.liveness_s
        assert limit is not None
        half = limit / 2
        nonce = 0
        self._last_recv = anyio.current_time()
        while self._closed is None:
            await anyio.sleep(half / 2)
            if not self._pending and not self._streams:
                self._last_recv = anyio.current_time()  # nothing waits: idle is fine
                continue
            quiet = anyio.current_time() - self._last_recv
            if quiet >= limit:
                log.warning("%s: the server sent nothing for %.1f s while calls waited; closing the connection",
                            self.url, quiet)
                self._shutdown(f"{self.SILENT_REASON} ({quiet:.1f} s without a frame)")
                with anyio.CancelScope(shield=True):
                    await anyio.aclose_forcefully(self._stream)
                return
            if quiet >= half:
                nonce += 1
                self._out += encode_frame(_encode(wire.Ping(nonce)))
                self._wake_writer()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._shutdown("the connection was closed by the client")
        tg = self._tg
        assert tg is not None
        tg.cancel_scope.cancel()
        # The body's own exception (if any) propagates unchanged: the task group only
        # has to reap the reader and writer, which never raise.
        try:
            await tg.__aexit__(None, None, None)
        finally:
            # Also when the caller is being cancelled (tg.__aexit__ then raises
            # Cancelled): else the socket stays open until garbage collection.
            with anyio.CancelScope(shield=True):
                await anyio.aclose_forcefully(self._stream)
        return False

    async def aclose(self) -> None:
        """Close the connection: pending and later calls raise UnavailableError."""
        self._shutdown("the connection was closed by the client")
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(self._stream)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def close_reason(self) -> str | None:
        """Why the connection closed (e.g. "the server closed the connection"), or None."""
        return self._closed

    async def wait_closed(self) -> None:
        """Return once the connection is closed (by either side, or lost). Use inside
        ``async with conn``."""
        if self._closed is not None:
            return
        if self._closed_event is None:
            raise RuntimeError("use the Connection inside `async with` (see connect_transport)")
        await self._closed_event.wait()

    # -------------------------------------------------------------------- calls

    def _unavailable(self) -> UnavailableError:
        reason = self._closed or "the connection is closed"
        if self._conn_error:
            reason = f"{reason} (server said: {self._conn_error})"
        return UnavailableError(f"{self.url}: {reason}", retry_after=1.0)

    async def _wait_room(self) -> None:
        while len(self._out) > _MAX_OUTGOING and self._closed is None:
            ev = self._drained_event
            if ev is None:
                ev = self._drained_event = anyio.Event()
            await ev.wait()

    def _append_request(self, rid: int, body: Any) -> None:
        out = self._out
        start = len(out)
        out += HEADER_PLACEHOLDER
        try:
            _put_request(out, rid, body)
        except BaseException:
            del out[start:]
            raise
        _end_frame(out, start, "the request", "body")

    def _wake_writer(self) -> None:
        ev = self._writer_event
        if ev is not None:
            self._writer_event = None
            ev.set()

    async def call(self, body: msgspec.Struct | bytes) -> msgspec.Raw:
        """Send one request and wait for its reply body. ``body`` is an operation
        Struct (encoded here) or already-encoded msgpack bytes. Raises the server's
        RallypointError subclass, or UnavailableError if the connection drops."""
        if self._closed is not None:
            raise self._unavailable()
        if not self._started:
            raise RuntimeError("use the Connection inside `async with` (see connect_transport)")
        if len(self._out) > _MAX_OUTGOING:
            await self._wait_room()
            if self._closed is not None:
                raise self._unavailable()
        rid = self._next_id
        self._next_id = rid + 1
        self._append_request(rid, body)
        slot = _Slot(self._event_cls)
        self._pending[rid] = slot
        if len(self._out) >= _EARLY_SEND_BYTES and self._sock is not None and not self._writing:
            self._send_now()
        ev = self._writer_event
        if ev is not None:
            self._writer_event = None
            ev.set()
        try:
            await slot.event.wait()
        except BaseException:
            # The caller gave up (cancelled): tell the server to end a wait it may be
            # running for this request, so e.g. a receive leases nothing to nobody.
            if slot.value is None and self._closed is None:
                self._send_cancel(rid)
            raise
        finally:
            self._pending.pop(rid, None)
        value = slot.value
        if type(value) is msgspec.Raw:
            return value
        raise value

    def _send_now(self) -> None:
        """One non-blocking send of the queued bytes from the calling task (plain TCP,
        the writer idle): what does not fit is left to the writer, errors too."""
        out = self._out
        try:
            n = self._sock.send(out)
        except OSError:  # BlockingIOError (full buffer), or an error the writer will meet
            return
        if n == len(out):
            self._out = bytearray()
        else:
            del out[:n]

    async def subscribe(self, body: Any, max_events: int = 10_000) -> Subscription:
        """Send a subscribing request (``events.watch``) and return its
        :class:`Subscription` once its Ok arrived. Raises the server's error (e.g.
        CursorExpiredError), or UnavailableError if the connection drops."""
        if self._closed is not None:
            raise self._unavailable()
        if not self._started:
            raise RuntimeError("use the Connection inside `async with` (see connect_transport)")
        rid = self._next_id
        self._next_id = rid + 1
        sub = Subscription(self, rid, max_events)
        self._streams[rid] = sub  # pushes may follow the Ok in the same read
        self._append_request(rid, body)
        slot = _Slot(self._event_cls)
        self._pending[rid] = slot
        self._wake_writer()
        try:
            await slot.event.wait()
        except BaseException:
            self._drop_stream(rid, cancel=self._closed is None)
            raise
        finally:
            self._pending.pop(rid, None)
        value = slot.value
        if type(value) is msgspec.Raw:
            sub.start = value
            return sub
        self._streams.pop(rid, None)
        raise value

    def _drop_stream(self, rid: int, cancel: bool) -> None:
        if self._streams.pop(rid, None) is not None and cancel and self._closed is None:
            self._send_cancel(rid)

    def _send_cancel(self, rid: int) -> None:
        """Queue a Cancel(rid) frame (no await; the writer sends it)."""
        self._out += encode_frame(_encode(wire.Cancel(rid)))
        self._wake_writer()

    async def call_many(self, bodies: list[Any]) -> list[msgspec.Raw | RallypointError]:
        """Send several requests in one Batch frame; the server dispatches them in order.
        Returns, in order, each reply body or the RallypointError it failed with.
        Raises UnavailableError if the connection drops."""
        if not bodies:
            return []
        if self._closed is not None:
            raise self._unavailable()
        if not self._started:
            raise RuntimeError("use the Connection inside `async with` (see connect_transport)")
        if len(self._out) > _MAX_OUTGOING:
            await self._wait_room()
            if self._closed is not None:
                raise self._unavailable()
        n = len(bodies)
        first = self._next_id
        self._next_id = first + n
        out = self._out
        start = len(out)
        out += HEADER_PLACEHOLDER
        out += _BATCH_HEAD
        out += _array_header(n)
        try:
            for i, body in enumerate(bodies):
                _put_request(out, first + i, body)
        except BaseException:
            del out[start:]
            raise
        _end_frame(out, start, "the batch", "bodies")
        event_cls = self._event_cls
        slots = [_Slot(event_cls) for _ in range(n)]
        pending = self._pending
        for i, slot in enumerate(slots):
            pending[first + i] = slot
        self._wake_writer()
        results: list[Any] = []
        try:
            for slot in slots:
                await slot.event.wait()
                value = slot.value
                if type(value) is not msgspec.Raw and value.code == "UNAVAILABLE" and self._closed is not None:
                    raise self._unavailable()
                results.append(value)
        finally:
            for i in range(n):
                pending.pop(first + i, None)
        return results

    # -------------------------------------------------------------------- tasks

    def _shutdown(self, reason: str) -> None:
        if self._closed is not None:
            return
        self._closed = reason
        if self._closed_event is not None:
            self._closed_event.set()
        pending = self._pending
        self._pending = {}
        for slot in pending.values():
            slot.value = self._unavailable()
            slot.event.set()
        streams = self._streams
        self._streams = {}
        for sub in streams.values():
            sub._end(self._unavailable())
        self._wake_writer()
        ev = self._drained_event
        if ev is not None:
            self._drained_event = None
            ev.set()

    async def _reader(self) -> None:
        reason = "the connection was closed"
        stream = self._stream
        parser = self._parser
        decode = _server_decoder.decode
        frames = self._leftover
        self._leftover = []
        receive = stream.receive
        if self._sock is not None:  # plain TCP under Trio: wait first, then read (sockio)
            receive = self._receive_plain
        try:
            while True:
                pending = self._pending
                for frame in frames:
                    msg = decode(frame)
                    t = type(msg)
                    if t is _Ok:
                        slot = pending.pop(msg.id, None)
                        if slot is not None:
                            slot.value = msg.body
                            slot.event.set()
                    elif t is _Push:
                        sub = self._streams.get(msg.id)
                        if sub is not None:
                            sub._feed(msg.events, msg.cursor)
                    elif t is _Err:
                        if msg.id == 0:
                            self._conn_error = f"{msg.code}: {msg.message}"
                            log.warning("%s: connection error from the server: %s", self.url, self._conn_error)
                        else:
                            slot = pending.pop(msg.id, None)
                            if slot is not None:
                                slot.value = error_from_wire(msg.code, msg.message, msg.retry_after, msg.details)
                                slot.event.set()
                            else:
                                sub = self._streams.pop(msg.id, None)
                                if sub is not None:
                                    sub._end(error_from_wire(msg.code, msg.message, msg.retry_after, msg.details))
                    elif t is wire.Ping:
                        self._out += encode_frame(_encode(wire.Pong(msg.nonce)))
                        self._wake_writer()
                    # (a Pong answers our liveness ping: its arrival is all it says)
                if parser.oversize is not None:
                    reason = f"protocol error: the server announced a {parser.oversize}-byte frame"
                    break
                data = await receive(_RECEIVE_SIZE)
                if self.liveness_s is not None:
                    self._last_recv = anyio.current_time()
                frames = parser.feed(data)
        except anyio.EndOfStream:
            reason = "the server closed the connection"
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            reason = f"the connection was lost ({str(exc) or type(exc).__name__})"
        except msgspec.MsgspecError as exc:
            reason = f"protocol error: the server sent an invalid frame ({exc})"
        except anyio.get_cancelled_exc_class():
            reason = "the connection was closed by the client"
            raise
        except Exception as exc:  # never let the task group (the caller's scope) die
            log.exception("%s: reader failed", self.url)
            reason = f"the connection failed ({type(exc).__name__})"
        finally:
            self._shutdown(reason)
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(stream)

    _full = False  # the last plain read filled its buffer

    async def _receive_plain(self, max_bytes: int) -> bytes:
        """``stream.receive`` for a plain TCP socket under Trio, without the failed read
        per reply that ``receive`` makes (it tries before it waits; a caller's reply is
        never there yet right after its request left): :func:`sockio.receive_plain`.
        Same results and errors as ``receive``: EndOfStream at EOF, OSError, and
        anyio's ClosedResourceError if the writer closed the stream meanwhile."""
        try:
            data = await sockio.receive_plain(self._sock.fileno(), max_bytes, ready=self._full)
        except _TrioClosed:
            raise anyio.ClosedResourceError from None
        if not data:
            raise anyio.EndOfStream
        self._full = len(data) == max_bytes
        return data

    async def _writer(self) -> None:
        stream = self._stream
        try:
            while True:
                if not self._out:
                    if self._closed is not None:
                        return
                    ev = self._writer_event = anyio.Event()
                    await ev.wait()
                    continue
                if self._closed is not None:
                    return
                data = self._out
                self._out = bytearray()
                self._writing = True
                try:
                    await stream.send(data)
                finally:
                    self._writing = False
                ev = self._drained_event
                if ev is not None:
                    self._drained_event = None
                    ev.set()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self._shutdown(f"the connection was lost while sending ({str(exc) or type(exc).__name__})")
            with anyio.CancelScope(shield=True):
                await anyio.aclose_forcefully(stream)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            log.exception("%s: writer failed", self.url)
            self._shutdown(f"the connection failed ({type(exc).__name__})")
            with anyio.CancelScope(shield=True):
                await anyio.aclose_forcefully(stream)


@asynccontextmanager
async def connect_transport(
    url: str,
    *,
    api_key: str | None = None,
    client_name: str = "",
    connect_timeout: float = 10.0,
    tls_ca: str | None = None,
    ssl_context: Any = None,
) -> AsyncIterator[Connection]:
    """Open a :class:`Connection` and run it for the duration of the block."""
    conn = await Connection.open(url, api_key=api_key, client_name=client_name, connect_timeout=connect_timeout,
                                 tls_ca=tls_ca, ssl_context=ssl_context)
    async with conn:
        yield conn
