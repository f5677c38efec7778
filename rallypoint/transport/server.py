"""The TCP server: handshake, request dispatch, out-of-order replies, backpressure.

The server is generic over a :class:`Dispatcher` (the coordinator implements it)::

    server = Server(dispatcher)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(server.serve, None, "127.0.0.1", 7411)
        ...
        await server.drain()          # graceful: stop accepting, finish in-flight, close

Per connection there are at most four tasks, whatever the request rate:

* the **reader** parses frames and hands each request to ``dispatcher.submit`` (which
  queues it in the inbox of the actor it runs on; it never waits);
* the **writer** sends everything that is ready in ONE ``send_all`` (replies coalesce);
* held replies (those that must not leave before the journal is durable past their
  LSN) are released by the dispatcher's durability report (``add_durable_listener``,
  the real service's) in the step that learns of the fsync; with a dispatcher that has
  none, a **durability** task per connection waits for the oldest one's LSN;
* the **pinger** (if ``idle_ping_interval``) pings idle peers and drops dead ones.

The connection is the :class:`~rallypoint.actors.runtime.ReplySink` of its requests:
actors call :meth:`_Conn.deliver` with the answer (success or error) and the LSN it
depends on. A server-side wait is parked in its actor, not in this connection: a Cancel
frame, or the connection closing, ends it (and its answer is dropped).

Backpressure: when ``max_inflight_per_conn`` requests are in flight (submitted, not yet
answered; every request of a batch frame counts), or more than ``max_outgoing_bytes`` of replies are
waiting for the peer to read them, the reader stops reading the socket until that
drops again, so a client can never make the server buffer without bound.

Logging: a peer that resets or drops its connection is routine (one DEBUG line); a
frame the server cannot decode is answered VALIDATION_FAILED and logs nothing; only
the server's own faults log at ERROR, with a traceback. Every repeated event goes
through :attr:`Server.log_limiter` (at most 5 lines per kind of event per 10 s, then
"N similar events suppressed in the last T s"), so no peer can grow the log without
bound.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import secrets
import socket
import struct
import time
from collections import deque
from typing import Any, Protocol, Sequence

import msgspec
import trio

from .. import wire
from ..errors import InternalError, LimitError, RallypointError, UnavailableError, ValidationError, shutting_down_error
from ..logutil import RateLimitedLogger
from .sockio import receive_plain
from .framing import (
    HEADER,
    HEADER_PLACEHOLDER,
    NESTING_MESSAGE,
    FrameParser,
    oversize_message,
    pack_header_into,
    pack_uint,
    salvage_request_id,
    split_batch,
)

__all__ = ["Dispatcher", "Server"]

log = logging.getLogger("rallypoint.transport")

_RECEIVE_SIZE = 65536


class Dispatcher(Protocol):
    """What the server needs from the coordinator (:class:`rallypoint.service.Service`)."""

    def hello(self, hello: wire.Hello, peer: str) -> tuple[Any, wire.HelloOk]:
        """Authenticate a connection. Returns ``(session, HelloOk)``; raises a
        RallypointError (e.g. UnauthenticatedError) to refuse it. The protocol version
        has already been checked by the transport."""
        ...

    def submit(self, session: Any, body: msgspec.Raw, sink: Any, rid: int) -> None:
        """Queue one request; its answer reaches ``sink.deliver(rid, reply, lsn)`` with
        ``reply`` the encoded reply body (bytes) or a RallypointError."""
        ...

    def durable_lsn(self) -> int:
        """The journal's durable LSN now."""
        ...

    async def wait_durable(self, lsn: int) -> None:
        """Return once the journal is durable up to and including ``lsn``."""
        ...

    # Optional: ``add_durable_listener(fn)`` / ``remove_durable_listener(fn)`` -- call
    # ``fn(durable_lsn, None)`` whenever the durable LSN advances and ``fn(durable_lsn,
    # error)`` once it never will again. With it the server (while a connection runs)
    # releases held replies in the step that learns of an fsync (no task per connection);
    # without it, each connection's task awaits wait_durable.


_encoder = msgspec.msgpack.Encoder()
_encode = _encoder.encode
_encode_into = _encoder.encode_into
_client_decoder = msgspec.msgpack.Decoder(wire.ClientFrame)


_request_decoder = msgspec.msgpack.Decoder(wire.Request)

_Request = wire.Request
_Batch = wire.Batch
_Ping = wire.Ping
_Cancel = wire.Cancel
_Pong = wire.Pong
_Hello = wire.Hello
_MAX_FRAME = wire.MAX_FRAME_BYTES


# Hand-built Ok envelope: {"t": "ok", "id": <uint32|uint64>, "body": <reply>}, prefixed
# by the frame length. Same bytes msgspec would produce except that the id always uses
# the fixed-width uint32/uint64 form (valid msgpack).
_OK_PRE32 = b"\x83\xa1t\xa2ok\xa2id\xce"
_OK_PRE64 = b"\x83\xa1t\xa2ok\xa2id\xcf"
_OK_BODY = b"\xa4body"
_ok_head32 = struct.Struct(">I10sI5s").pack
_ok_head64 = struct.Struct(">I10sQ5s").pack


# {"t": "push", "id": <id>, "cursor": <seq>, "events": [...]}
_PUSH_HEAD = b"\x84\xa1t\xa4push\xa2id"
_PUSH_CURSOR = b"\xa6cursor"
_PUSH_EVENTS = b"\xa6events"


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


from bisect import bisect_left as _bisect  # noqa: E402

from ..metrics import LATENCY_BOUNDS as _LATENCY_BOUNDS  # noqa: E402

_GONE = object()  # not in flight
_CANCELLED = object()  # the client sent Cancel before the request parked


def _new_ref() -> str:
    return secrets.token_hex(4)


_CLOSED_ERRNOS = frozenset({errno.EBADF, errno.ENOTSOCK})


def _stream_error(exc: OSError) -> trio.BrokenResourceError | trio.ClosedResourceError:
    """The error ``SocketStream.receive_some`` raises for ``exc`` (same translation)."""
    if exc.errno in _CLOSED_ERRNOS:
        return trio.ClosedResourceError("this socket was already closed")
    return trio.BrokenResourceError(f"socket connection broken: {exc}")


_TCP_INFO = getattr(socket, "TCP_INFO", None)
#: Linux TCP states (include/net/tcp_states.h) of a peer that reset (CLOSE) or sent its
#: FIN (CLOSE_WAIT): EOF, a half-close included, is the peer leaving.
_PEER_GONE_STATES = frozenset({7, 8})


def _tcp_state(sock: Any) -> int | None:
    """The kernel's TCP state of ``sock`` (Linux ``TCP_INFO``'s first byte), or None
    where it cannot be read (another OS, not a TCP socket, closed)."""
    if _TCP_INFO is None:
        return None
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 8)[0]
    except (OSError, IndexError):
        return None


#: What a peer going away looks like from inside a connection's tasks.
_DISCONNECTS = (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError)


def _disconnect_reason(exc: BaseException) -> str | None:
    """If ``exc`` (or every exception inside it, for a group) is the peer resetting or
    dropping the connection, a short reason such as ``"[Errno 104] Connection reset by
    peer"``; else None (a fault of ours)."""
    if isinstance(exc, BaseExceptionGroup):
        reasons = [_disconnect_reason(e) for e in exc.exceptions]
        if not reasons or None in reasons:
            return None
        return reasons[0]
    if not isinstance(exc, _DISCONNECTS):
        return None
    cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    return str(cause) or type(cause).__name__


class _Conn:
    """One server-side connection."""

    def __init__(self, server: "Server", stream: trio.SocketStream, peer: str) -> None:
        self.server = server
        self.stream = stream
        # a plain TCP stream can be written with a non-blocking os.write from flush()
        self._fd: int | None = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
        self.peer = peer
        self.session: Any = None
        self.parser = FrameParser()
        self.out = bytearray()
        self.sending = 0
        # True while the reader handles a received chunk: replies accumulate and the
        # reader sends them itself afterwards (no writer wake-up per reply).
        self.batching = False
        self.inflight = 0
        self.reply_size = 4096  # moving average of this connection's reply sizes, bytes (a cautious start)
        self.closed = False  # no more answers wanted (ReplySink)
        self.refuse_waits = False  # draining past the grace: no new wait is held
        self.deferred: deque[tuple[int, int, Any]] = deque()
        self.nursery: trio.Nursery | None = None
        self.send_scope: trio.CancelScope | None = None
        self.writer_event: trio.Event | None = None
        self.reader_event: trio.Event | None = None
        self.deferred_event: trio.Event | None = None
        self.idle_event = trio.Event()  # set when inflight == 0 and nothing queued (drain)
        # request id -> None (queued or being handled), its parked Waiter, or _CANCELLED
        # (the client sent Cancel before it parked): every request not yet answered
        self.live: dict[int, Any] = {}
        # subscriptions (events.watch) of this connection: request id -> Watcher
        self.streams: dict[int, Any] = {}
        # metrics: request id -> (receipt time (perf_counter), op tag, op Struct), while
        # it is answered
        self.req_meta: dict[int, tuple] = {}
        self.t_rx = time.perf_counter()
        self.backlog: deque = deque()  # requests of a batch frame not admitted yet
        self.closing = False
        self.draining = False
        self.rx_count = 0
        # statistics
        self.requests = 0
        self.errors = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.max_out = 0
        self.max_inflight = 0
        self.pauses = 0
        self.pushes = 0
        dispatcher = server.dispatcher
        self._submit = dispatcher.submit
        self._watch_wake = getattr(dispatcher, "watch_wake", None)
        self._metrics = server.metrics
        self._durable_lsn = dispatcher.durable_lsn
        self._max_inflight = server.max_inflight_per_conn
        self._max_out = server.max_outgoing_bytes

    # ------------------------------------------------------------------ output

    def _wake_writer(self) -> None:
        ev = self.writer_event
        if ev is not None:
            self.writer_event = None
            ev.set()

    def _wake_reader(self) -> None:
        ev = self.reader_event
        if ev is not None:
            self.reader_event = None
            ev.set()

    def queue_msg(self, msg: msgspec.Struct, wake: bool = True) -> None:
        out = self.out
        start = len(out)
        out += HEADER_PLACEHOLDER
        _encode_into(msg, out, start + HEADER)
        pack_header_into(out, start, len(out) - start - HEADER)
        n = len(out) + self.sending
        if n > self.max_out:
            self.max_out = n
        if wake and not self.batching:
            self._wake_writer()

    def send_ok(self, rid: int, reply: bytes, wake: bool = True) -> None:
        """Queue ``Ok(rid, Raw(reply))``. The envelope is built by hand (one struct pack
        and two appends, no Struct/Raw objects): ``reply`` must be ``bytes``."""
        if 0 < rid <= 0xFFFFFFFF:
            size = 19 + len(reply)
            head = _ok_head32(size, _OK_PRE32, rid, _OK_BODY)
        else:
            size = 23 + len(reply)
            head = _ok_head64(size, _OK_PRE64, rid, _OK_BODY)
        if size > _MAX_FRAME:
            self.send_error(
                rid,
                LimitError(
                    f"the reply is {size} bytes, larger than the frame limit of {_MAX_FRAME} bytes; "
                    "ask for less per request (smaller page / limit)"
                ),
            )
            return
        out = self.out
        out += head
        out += reply
        self.reply_size = (self.reply_size * 7 + size) >> 3  # moving average, bytes
        n = len(out) + self.sending
        if n > self.max_out:
            self.max_out = n
        if wake and not self.batching:
            ev = self.writer_event
            if ev is not None:
                self.writer_event = None
                ev.set()

    def send_error(self, rid: int, exc: RallypointError, wake: bool = True) -> None:
        self.errors += 1
        details = exc.details
        if details is not None and not isinstance(details, dict):
            details = {"value": details}
        msg = wire.Err(rid, exc.code, exc.message, exc.retry_after, details)
        try:
            self.queue_msg(msg, wake)
        except Exception as enc_exc:  # details not encodable
            self.send_internal(rid, enc_exc)

    def send_internal(self, rid: int, exc: BaseException) -> None:
        ref = _new_ref()
        self.server.log_limiter.log(
            logging.ERROR,
            f"internal:{type(exc).__name__}",
            "request %d from %s failed with an unexpected error (ref %s)",
            rid,
            self.peer,
            ref,
            exc_info=exc,
        )
        self.server._internal_errors += 1
        self.errors += 1
        self.queue_msg(wire.Err(rid, "INTERNAL", f"internal error; the server logged it as ref {ref}"))

    # ---------------------------------------------------------------- requests

    def handle_frame(self, frame: memoryview) -> None:
        try:
            msg = _client_decoder.decode(frame)
        except (msgspec.MsgspecError, RecursionError) as exc:
            self.bad_frame(frame, exc)
            return
        t = type(msg)
        if t is _Request:
            self.handle_request(msg.id, msg.body)
        elif t is _Batch:
            # each request of a batch counts against the limits like a single one: the
            # reader admits them one by one (see reader), pausing when full
            self.backlog.extend(msg.reqs)
        elif t is _Cancel:
            self.cancel_wait(msg.id)
        elif t is _Ping:
            self.queue_msg(_Pong(msg.nonce))
        elif t is _Hello:
            self.send_error(0, ValidationError("hello sent twice: the connection is already open; field `t`"))
        # Pong: nothing to do (receiving it counted as traffic)

    def bad_frame(self, frame: memoryview, exc: msgspec.MsgspecError | RecursionError) -> None:
        """A frame with intact framing but a bad envelope (ill-typed, not msgpack, or
        nested too deeply for the decoder): answer VALIDATION_FAILED, keep the
        connection. A batch's requests are answered each on its own."""
        if isinstance(exc, (msgspec.ValidationError, RecursionError)):
            reqs = split_batch(frame)  # iterative: no recursion however deep the data
            if reqs is not None:
                for i, raw in enumerate(reqs):
                    try:
                        req = _request_decoder.decode(raw)
                    except (msgspec.MsgspecError, RecursionError) as rexc:
                        self.reject(raw, rexc, prefix=f"$.reqs[{i}]")
                    else:
                        self.handle_request(req.id, req.body)
                return
        self.reject(frame, exc)

    def reject(self, data: Any, exc: msgspec.MsgspecError | RecursionError, prefix: str = "") -> None:
        """Answer a frame (or a batch's request at ``prefix``) that failed to decode with
        ``Err(id, VALIDATION_FAILED)``, the id salvaged from it when it has one (else 0)."""
        rid = salvage_request_id(data)
        if isinstance(exc, RecursionError):
            where = f" at `{prefix}`" if prefix else ""
            self.send_error(rid, ValidationError(f"invalid frame{where}: {NESTING_MESSAGE}"))
            return
        text = str(exc)
        if prefix:
            if "`$" in text:
                text = text.replace("`$", "`" + prefix)
            else:
                text = f"{text} - at `{prefix}`"
        if isinstance(exc, msgspec.ValidationError):
            message = f"invalid frame: {text}"
        else:
            message = f"undecodable frame (not valid msgpack): {text}"
        self.send_error(rid, ValidationError(message))

    def handle_request(self, rid: int, body: msgspec.Raw) -> None:
        self.requests += 1
        if rid <= 0:
            self.send_error(0, ValidationError(f"request id must be > 0, got {rid}; field `$.id`"))
            return
        if rid in self.live:
            self.send_error(rid, ValidationError(f"request id {rid} is already in flight on this connection; "
                                                 "use a new id per request; field `$.id`"))
            return
        self.live[rid] = None
        self.inflight += 1
        if self.inflight > self.max_inflight:
            self.max_inflight = self.inflight
        try:
            self._submit(self.session, body, self, rid)
        except Exception as exc:  # the dispatcher answers its own errors; this is a bug
            if self.live.pop(rid, _GONE) is not _GONE:
                self.send_internal(rid, exc)
                self.request_done()

    # ReplySink -------------------------------------------------------------------
    def note_op(self, rid: int, tag: str, request: Any = None) -> None:
        """The dispatcher decoded request ``rid``: operation ``tag``, the Struct
        ``request`` (for the metrics: receipt time and operation, until it is answered;
        the Struct tells the slow-request log whether its client asked it to wait)."""
        if self._metrics is not None:
            self.req_meta[rid] = (self.t_rx, tag, request)

    def _observe(self, rid: int, reply: Any) -> None:
        m = self.req_meta.pop(rid, None)
        if m is not None:
            seconds = time.perf_counter() - m[0]
            metrics = self._metrics
            h = metrics.latency.get(m[1])
            if h is not None and type(reply) is bytes and seconds < metrics.fast_s:
                h.counts[_bisect(_LATENCY_BOUNDS, seconds)] += 1  # the common case, inline
                h.sum += seconds
            else:
                metrics.observe(m[1], "OK" if type(reply) is bytes else getattr(reply, "code", "INTERNAL"),
                                seconds, self.peer, m[2])

    def deliver(self, rid: int, reply: Any, lsn: int) -> None:
        """An actor's answer to request ``rid``: queued at once when the journal is
        durable past ``lsn`` (and written by :meth:`flush`, which the dispatcher calls
        at the end of its batch), else held until it is (:meth:`release_held`)."""
        state = self.live.pop(rid, _GONE)
        if state is _GONE:
            return  # already answered (e.g. a wait answered UNAVAILABLE at drain)
        if state is _CANCELLED or self.closing:
            if self.req_meta:
                self.req_meta.pop(rid, None)
            self.request_done()
            return
        if lsn <= self._durable_lsn():
            self._queue_reply(rid, reply)
            self.request_done()
            return
        self.deferred.append((lsn, rid, reply))
        held = self.server._held
        if held is not None:  # released by Server._on_durable
            held[self] = None
            return
        ev = self.deferred_event
        if ev is not None:
            self.deferred_event = None
            ev.set()

    def _queue_reply(self, rid: int, reply: Any) -> None:
        """Queue the answer to ``rid`` (encoded bytes, a RallypointError, or another
        exception: INTERNAL) for the next write, and record its latency."""
        if type(reply) is bytes:
            self.send_ok(rid, reply, False)
        elif isinstance(reply, RallypointError):
            self.send_error(rid, reply, False)
        else:
            self.send_internal(rid, reply)
        if self.req_meta:
            self._observe(rid, reply)

    def flush(self) -> None:
        """Write the queued replies now, with ONE non-blocking send: replies delivered
        during an actor's batch leave together, without waking the writer task (the
        actor runtime calls this at the end of every batch). What does not fit in the
        socket buffer, a TLS stream, or a send already in progress is left to the
        writer."""
        out = self.out
        if not out or self.sending or self.batching:
            return
        fd = self._fd
        if fd is None:
            self._wake_writer()
            return
        try:
            n = os.write(fd, out)
        except BlockingIOError:
            n = 0
        except OSError:
            self._wake_writer()  # the writer meets the error and closes the connection
            return
        if n:
            self.bytes_out += n
            if n == len(out):
                self.out = bytearray()
            else:
                del out[:n]
            self._wake_reader()
            if self.streams:
                self._sent()
        if self.out:
            self._wake_writer()
        elif self.draining and self.inflight == 0:
            self.idle_event.set()

    def track(self, rid: int, waiter: Any) -> None:
        """Request ``rid`` parked a waiter: a Cancel frame or the close can end it."""
        if self.live.get(rid, _GONE) is _CANCELLED or self.closing or self.refuse_waits:
            waiter.cancel()
            if self.live.pop(rid, _GONE) is not _GONE:
                if self.refuse_waits and not self.closing:
                    self.send_error(rid, shutting_down_error())
                self.request_done()
            return
        if rid in self.live:
            self.live[rid] = waiter

    def untrack(self, rid: int) -> None:
        if self.live.get(rid) is not None and self.live.get(rid) is not _CANCELLED:
            self.live[rid] = None

    def request_done(self, n: int = 1) -> None:
        self.inflight -= n
        self._wake_reader()
        if self.inflight == 0 and self.draining:
            self.idle_event.set()

    # subscriptions -------------------------------------------------------------------
    def add_stream(self, rid: int, watcher: Any) -> bool:
        if self.closing:
            return False
        self.streams[rid] = watcher
        return True

    def push_room(self, rid: int) -> int:
        """What pushes may still queue: the watch buffer minus this connection's unsent
        output (replies and pushes alike)."""
        if self.closing:
            return 0
        return self.server.watch_buffer_bytes - len(self.out) - self.sending

    def push(self, rid: int, events: list, cursor: int) -> None:
        """Queue one Push frame (hand-built: the events are already encoded; ``cursor``:
        the seq scanned up to) and send it."""
        self._push(rid, _array_header(len(events)), events, cursor)

    def push_encoded(self, rid: int, n: int, array: bytes, cursor: int) -> None:
        """One Push frame whose ``n`` events are already one encoded msgpack array."""
        self._push(rid, array, (), cursor)

    def _push(self, rid: int, head: bytes, items, cursor: int) -> None:
        """Queue ``Push(rid, events, cursor)`` with the events' array as ``head``
        followed by ``items`` (encoded bytes, appended in order), and send it."""
        if self.closing or rid not in self.streams:
            return
        out = self.out
        start = len(out)
        out += HEADER_PLACEHOLDER
        out += _PUSH_HEAD
        out += pack_uint(rid)
        out += _PUSH_CURSOR
        out += pack_uint(cursor)
        out += _PUSH_EVENTS
        out += head
        for raw in items:
            out += raw
        pack_header_into(out, start, len(out) - start - HEADER)
        self.pushes += 1
        size = len(out) + self.sending
        if size > self.max_out:
            self.max_out = size
        self.flush()

    def end_stream(self, rid: int, error: Any) -> None:
        if self.streams.pop(rid, None) is not None and not self.closing:
            self.send_error(rid, error)

    def _sent(self) -> None:
        """Output left: a watcher waiting for room may go on."""
        if self.streams and self._watch_wake is not None:
            self._watch_wake()

    def cancel_wait(self, rid: int) -> None:
        """A Cancel frame: end request ``rid``'s server-side wait, or subscription
        ``rid``; no answer is sent."""
        w = self.streams.pop(rid, None)
        if w is not None:
            w.cancel()
            return
        state = self.live.get(rid, _GONE)
        if state is _GONE or state is _CANCELLED:
            return
        if state is None:  # not parked (yet): ends when it parks; its answer is dropped
            self.live[rid] = _CANCELLED
            return
        del self.live[rid]
        self.req_meta.pop(rid, None)
        state.cancel()
        self.request_done()

    def end_waits(self, answer: RallypointError | None) -> None:
        """End every parked wait of this connection (closing, or a drain's grace ran
        out); ``answer`` it when the peer can still hear (None: no answer)."""
        for rid, state in list(self.live.items()):
            if state is None or state is _CANCELLED:
                continue
            del self.live[rid]
            state.cancel()
            if answer is not None:
                self.send_error(rid, answer)
                if self.req_meta:
                    self._observe(rid, answer)
            else:
                self.req_meta.pop(rid, None)
            self.request_done()

    # ------------------------------------------------------------------- tasks

    async def writer(self) -> None:
        stream = self.stream
        try:
            while True:
                if not self.out or self.sending:
                    if self.draining and self.inflight == 0 and not self.out and not self.sending:
                        self.idle_event.set()
                    ev = self.writer_event = trio.Event()
                    await ev.wait()
                    continue
                data = self.out
                self.out = bytearray()
                n = len(data)
                self.sending = n
                # Shielded: a send cancelled half-way would corrupt the stream, and one
                # cancelled before it starts would lose replies. Closing sets a deadline.
                with trio.CancelScope(shield=True) as scope:
                    self.send_scope = scope
                    if self.closing:
                        scope.deadline = trio.current_time() + 1.0
                    await stream.send_all(data)
                self.send_scope = None
                self.sending = 0
                if scope.cancelled_caught:
                    self.abort()
                    return
                self.bytes_out += n
                self._wake_reader()
                if self.streams:
                    self._sent()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.sending = 0
            self.abort()

    def release_held(self, durable: int, error: RallypointError | None) -> bool:
        """The journal is durable past ``durable`` (or, with ``error``, will not get any
        further): send every held reply it covers, in order, and ``error`` for the rest.
        True when nothing is held any more. (With a dispatcher that has
        ``add_durable_listener``; otherwise the :meth:`durability` task does this.)"""
        fifo = self.deferred
        if self.closing:
            fifo.clear()  # as the durability task, cancelled at the close: dropped
            return True
        n = 0
        while fifo and (fifo[0][0] <= durable or error is not None):
            lsn, rid, reply = fifo.popleft()
            n += 1
            self._queue_reply(rid, reply if lsn <= durable else error)
        if n:
            self.request_done(n)
            self.flush()
        return not fifo

    async def durability(self) -> None:
        wait_durable = self.server.dispatcher.wait_durable
        fifo = self.deferred
        while True:
            if not fifo:
                ev = self.deferred_event = trio.Event()
                await ev.wait()
                continue
            # Wait for the OLDEST held reply only, then send every held reply the
            # journal is durable past: a reply whose commit made the previous fsync is
            # not held back for a newer one's (on a pipelined connection that coupling
            # cost a whole group-commit cycle).
            target = fifo[0][0]
            n = len(fifo)
            try:
                await wait_durable(target)
                durable = self._durable_lsn()
                n = 0
                for e in fifo:
                    if e[0] > durable:
                        break
                    n += 1
            except RallypointError as exc:
                for _ in range(n):
                    _, rid, _ = fifo.popleft()
                    self.send_error(rid, exc)
            except Exception as exc:
                first = True
                for _ in range(n):
                    _, rid, _ = fifo.popleft()
                    if first:
                        self.send_internal(rid, exc)
                        first = False
                    else:
                        self.send_error(rid, InternalError("internal error; the server logged it (durability wait)"))
            else:
                popleft = fifo.popleft
                for _ in range(n):
                    _, rid, reply = popleft()
                    self._queue_reply(rid, reply)
            self.request_done(n)
            self.flush()

    async def pinger(self, interval: float) -> None:
        last = self.rx_count
        idle = 0
        nonce = 0
        while True:
            await trio.sleep(interval)
            if self.rx_count != last or self.reader_event is not None:
                # traffic, or we are the ones not reading (backpressure): not idle
                last = self.rx_count
                idle = 0
                continue
            idle += 1
            if idle >= 3:
                self.server.log_limiter.log(
                    logging.INFO,
                    "idle-peer",
                    "closing connection from %s: no traffic for %.0fs despite pings",
                    self.peer,
                    idle * interval,
                )
                self.abort()
                return
            nonce += 1
            self.queue_msg(_Ping(nonce))

    def stop_sending(self, grace: float) -> None:
        """Let an in-progress send finish within ``grace`` seconds."""
        scope = self.send_scope
        if scope is not None:
            scope.deadline = min(scope.deadline, trio.current_time() + grace)

    def abort(self) -> None:
        self.closing = True
        self.stop_sending(0)
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    def begin_drain(self) -> None:
        self.draining = True
        if self.nursery is not None:  # past the handshake: wake the reader's receive
            try:
                getattr(self, "raw", self.stream).socket.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        if self.inflight == 0 and not self.out and not self.sending:
            self.idle_event.set()
        self._wake_writer()
        # a reader paused at the limits (wait_capacity) stops waiting and returns: the
        # requests it has not admitted are not taken, and the drain's grace for the
        # parked waits starts (else a connection paused with unread data held the stop
        # for the whole drain timeout; found by a hostile-peer run)
        self._wake_reader()

    async def reader(self, pending: list[memoryview]) -> None:
        """Read and dispatch until EOF, a fatal framing error, or drain."""
        stream = self.stream
        parser = self.parser
        handle = self.handle_frame
        max_inflight = self._max_inflight
        max_out = self._max_out
        frames = pending
        backlog = self.backlog
        fd = self._fd  # a plain TCP socket: read with receive_plain
        full = False
        while True:
            self.batching = True
            for frame in frames:
                handle(frame)
                while True:
                    if self.inflight >= max_inflight or len(self.out) + self.inflight * self.reply_size > max_out:
                        self.batching = False
                        self._wake_writer()
                        await self.wait_capacity()
                        if self.draining:
                            return  # what is not admitted yet is not taken (begin_drain)
                        self.batching = True
                    if not backlog:
                        break
                    req = backlog.popleft()
                    self.handle_request(req.id, req.body)
            self.batching = False
            if self.out:
                if self.sending or self.writer_event is None:
                    self._wake_writer()
                else:
                    # The writer is idle: send this chunk's replies ourselves, saving a
                    # task switch per round trip.
                    data = self.out
                    self.out = bytearray()
                    n = len(data)
                    self.sending = n
                    try:
                        await stream.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        self.sending = 0
                        self.closing = True
                        return
                    self.sending = 0
                    self.bytes_out += n
                    if self.out:
                        self._wake_writer()
            if parser.oversize is not None:
                self.send_error(0, ValidationError(oversize_message(parser.oversize)))
                self.closing = True
                return
            if self.draining:
                return
            # No cancel scope here (it would cost more than the rest of a request):
            # drain wakes this receive with shutdown(SHUT_RD), which makes it return b"".
            if fd is None:
                data = await stream.receive_some(_RECEIVE_SIZE)
            else:
                try:
                    data = await receive_plain(fd, _RECEIVE_SIZE, ready=full)
                except OSError as exc:
                    raise _stream_error(exc) from exc
                full = len(data) == _RECEIVE_SIZE
            if not data:
                return
            self._peer_quiet = True
            self.rx_count += 1
            self.bytes_in += len(data)
            if self._metrics is not None:
                self.t_rx = time.perf_counter()
            frames = parser.feed(data)

    async def wait_capacity(self) -> None:
        max_inflight = self._max_inflight
        max_out = self._max_out
        self.pauses += 1
        # Replies are made later, by the actors: the requests in flight will add about
        # inflight x (the connection's average reply size) to what waits to be sent.
        watch = self._fd is not None
        while not self.draining and (
                self.inflight >= max_inflight or len(self.out) + self.inflight * self.reply_size > max_out):
            ev = self.reader_event = trio.Event()
            if not watch:
                await ev.wait()
                continue
            # Not reading now, but a peer that goes away must still end its waits (their
            # answers would go nowhere): watch the socket for EOF or a reset meanwhile.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_for_close, nursery.cancel_scope)
                await ev.wait()
                nursery.cancel_scope.cancel()
            watch = self._peer_quiet

    _peer_quiet = True  # nothing unread from the peer: EOF can be seen without reading
    _PEER_POLL_S = 1.0  # while paused with unread data: how often the TCP state is read

    async def _watch_for_close(self, done: trio.CancelScope) -> None:
        """While the reader pauses: peek at the socket; EOF or a reset closes the
        connection (and so ends its parked waits). Data waiting to be read hides a close
        from ``recv``; the kernel's TCP state still shows it (Linux ``TCP_INFO``): polled
        every ``_PEER_POLL_S`` seconds while paused. Where that cannot be read, stop
        watching until the reader reads again."""
        sock = self.stream.socket
        try:
            data = await sock.recv(1, socket.MSG_PEEK)
        except OSError:
            data = b""
        while data:  # the peer's unread data hides its close from the peek
            state = _tcp_state(sock)
            if state is None:
                self._peer_quiet = False
                return
            if state in _PEER_GONE_STATES:
                break
            await trio.sleep(self._PEER_POLL_S)
        log.debug("connection from %s closed by the peer while its requests wait", self.peer)
        self.abort()
        done.cancel()

    async def handshake(self) -> list[memoryview] | None:
        """Read the Hello; answer it. Returns frames pipelined after the Hello, or None
        if the connection must close."""
        server = self.server
        stream = self.stream
        frames: list[memoryview] = []
        with trio.move_on_after(server.handshake_timeout):
            while not frames:
                data = await stream.receive_some(_RECEIVE_SIZE)
                if not data:
                    return None
                self.bytes_in += len(data)
                frames = self.parser.feed(data)
                if self.parser.oversize is not None and not frames:
                    self.send_error(0, ValidationError(oversize_message(self.parser.oversize)))
                    return None
        if not frames:
            self.send_error(
                0, UnavailableError(f"no hello within {server.handshake_timeout:g}s of connecting; closing")
            )
            return None
        first = frames[0]
        try:
            hello = _client_decoder.decode(first)
        except msgspec.MsgspecError as exc:
            self.send_error(0, ValidationError(f"the first frame must be a hello: {exc}"))
            return None
        except RecursionError:
            self.send_error(0, ValidationError(f"the first frame must be a hello: {NESTING_MESSAGE}"))
            return None
        if type(hello) is not _Hello:
            self.send_error(
                0,
                ValidationError(
                    f"the first frame must be a hello (t='hello'), got {type(hello).__name__}; field `$.t`"
                ),
            )
            return None
        if hello.version != wire.PROTOCOL_VERSION:
            self.send_error(
                0,
                ValidationError(
                    f"protocol version mismatch: the client speaks version {hello.version}, this server "
                    f"speaks version {wire.PROTOCOL_VERSION}; upgrade the older side",
                    details={"client_version": hello.version, "server_version": wire.PROTOCOL_VERSION},
                ),
            )
            return None
        try:
            self.session, hello_ok = server.dispatcher.hello(hello, self.peer)
        except RallypointError as exc:
            if exc.code in ("UNAUTHENTICATED", "FORBIDDEN"):
                server.log_limiter.log(
                    logging.WARNING, "auth-failed", "authentication failed for %s (client %r): %s",
                    self.peer, hello.client, exc.message,
                    extra={"event": "auth_failed", "peer": self.peer, "client": hello.client, "code": exc.code})
            self.send_error(0, exc)
            return None
        except Exception as exc:
            self.send_internal(0, exc)
            return None
        self.queue_msg(hello_ok)
        return frames[1:]

    async def send_rest(self, timeout: float = 5.0) -> None:
        """Best-effort send of what is queued (used when closing)."""
        with trio.move_on_after(timeout):
            while self.sending:
                await trio.sleep(0.005)
            if self.out:
                data = self.out
                self.out = bytearray()
                try:
                    await self.stream.send_all(data)
                    self.bytes_out += len(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass

    async def linger(self, timeout: float = 1.0, max_bytes: int = 4 << 20) -> None:
        """Half-close, then discard what the peer still sends (bounded in time and bytes)
        so that closing does not reset the connection and destroy our last reply (an
        error saying why we close) before the peer has read it."""
        with trio.move_on_after(timeout):
            try:
                await self.stream.send_eof()
                discarded = 0
                while discarded < max_bytes:
                    data = await self.stream.receive_some(_RECEIVE_SIZE)
                    if not data:
                        break
                    discarded += len(data)
                self.server._discarded_bytes += discarded
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError):
                pass

    async def run(self) -> None:
        server = self.server
        server._listen(True)
        try:
            pending = await self.handshake()
            if pending is None:
                await self.send_rest(1.0)
                await self.linger()
                return
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self.writer)
                if server._held is None:  # else Server._on_durable releases held replies
                    nursery.start_soon(self.durability)
                if server.idle_ping_interval:
                    nursery.start_soon(self.pinger, server.idle_ping_interval)
                await self.reader(pending)
                if self.draining and not self.closing:
                    # Finish in-flight requests and send their replies.
                    # Long server-side waits get drain_wait_grace to end on their own,
                    # then are answered UNAVAILABLE (the peer retries elsewhere), so a
                    # long poll does not hold the shutdown for up to a minute.
                    self.begin_drain()
                    grace_at: float | None = trio.current_time() + server.drain_wait_grace
                    with trio.move_on_after(server._drain_timeout):
                        while self.inflight or self.out or self.sending:
                            self.idle_event = trio.Event()
                            if not (self.inflight or self.out or self.sending):
                                break
                            # (a request queued now may park later: the grace is kept
                            # whether or not a wait is parked at this moment)
                            with trio.move_on_at(grace_at if grace_at is not None else math.inf):
                                await self.idle_event.wait()
                            if grace_at is not None and trio.current_time() >= grace_at:
                                grace_at = None
                                self.refuse_waits = True  # a wait parked from now on is answered at once
                                self.end_waits(shutting_down_error())
                # Waits still parked are ended; a peer that can still hear is told so.
                self.end_waits(shutting_down_error())
                self.closing = True
                self.stop_sending(1.0)
                nursery.cancel_scope.cancel()
            # Replies of requests cancelled by the close (best effort), oversize error.
            await self.send_rest(1.0)
            if self.parser.oversize is not None:
                await self.linger()
        except Exception as exc:
            reason = _disconnect_reason(exc)
            if reason is not None:  # the peer reset or dropped the connection: routine
                server._peer_resets += 1
                server.log_limiter.log(
                    logging.DEBUG, "peer-reset", "connection from %s closed by the peer: %s", self.peer, reason
                )
            else:
                server.log_limiter.log(
                    logging.ERROR,
                    f"connection:{type(exc).__name__}",
                    "connection from %s failed",
                    self.peer,
                    exc_info=exc,
                )
        finally:
            self.closing = True
            self.closed = True
            if server._held is not None:
                server._held.pop(self, None)
                self.deferred.clear()
            server._listen(False)
            self.end_waits(None)  # a client's waits end when it goes away
            for w in self.streams.values():  # and its subscriptions
                w.cancel()
            self.streams.clear()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)


class Server:
    """A rallypoint TCP server for one :class:`Dispatcher`.

    Args:
        dispatcher: the coordinator side (see :class:`Dispatcher`).
        max_connections: connections beyond this get ``Err(0, UNAVAILABLE)`` and are closed.
        max_inflight_per_conn: requests in flight (submitted, not yet answered; each
            request of a batch frame counts) per connection before the server stops
            reading that connection.
        handshake_timeout: seconds a new connection has to send its Hello.
        idle_ping_interval: ping a connection idle this long (seconds); drop it after
            three silent intervals. ``None`` or 0 disables pings.
        max_outgoing_bytes: replies waiting for a slow reader before the server stops
            reading that connection's requests.
        drain_wait_grace: on :meth:`drain`, seconds that parked server-side waits get
            to finish before they are answered UNAVAILABLE; other requests and replies
            waiting for durability still get the full timeout.
        watch_buffer_bytes: unsent output a connection may hold before its
            subscriptions wait for it to drain (see :mod:`rallypoint.actors.watch`:
            one that cannot drain for ``--watch-stall`` seconds is cut off).
        log_window_s, log_burst: the rate limit of repeated log events
            (:attr:`log_limiter`): at most ``log_burst`` lines per kind of event per
            ``log_window_s`` seconds, the rest counted and reported in one line.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        max_connections: int = 1024,
        max_inflight_per_conn: int = 256,
        handshake_timeout: float = 10.0,
        idle_ping_interval: float | None = 30.0,
        max_outgoing_bytes: int = 4 * 1024 * 1024,
        drain_wait_grace: float = 1.0,
        watch_buffer_bytes: int = 1 << 20,
        ssl_context: Any = None,
        log_window_s: float = 10.0,
        log_burst: int = 5,
    ) -> None:
        self.dispatcher = dispatcher
        # connections holding replies until the journal is durable past them, when the
        # dispatcher reports durability (add_durable_listener): released in the step
        # that learns of it; without it, each connection's durability task waits
        self._held: dict[_Conn, None] | None = (
            {} if getattr(dispatcher, "add_durable_listener", None) is not None else None)
        self._listening = 0  # connections running: the reports are heard while any is
        self.ssl_context = ssl_context  # an ssl.SSLContext: serve TLS
        self.max_connections = max_connections
        self.max_inflight_per_conn = max_inflight_per_conn
        self.handshake_timeout = handshake_timeout
        self.idle_ping_interval = idle_ping_interval
        self.max_outgoing_bytes = max_outgoing_bytes
        self.drain_wait_grace = drain_wait_grace
        self.watch_buffer_bytes = watch_buffer_bytes
        #: a rallypoint.metrics.Metrics (``observe(op, code, seconds, peer)`` per reply), or None
        self.metrics: Any = None
        #: Every repeated log event of the server goes through this (see the module doc).
        self.log_limiter = RateLimitedLogger(log, window_s=log_window_s, burst=log_burst)
        self.listeners: list[trio.SocketListener] = []
        self._conns: set[_Conn] = set()
        self._accept_scope: trio.CancelScope | None = None
        self._serve_scope: trio.CancelScope | None = None
        self._draining = False
        self._drain_timeout = math.inf
        self._stopped = trio.Event()
        self._no_conns = trio.Event()
        self._no_conns.set()
        # statistics of closed connections + server-wide
        self._connections_total = 0
        self._rejected = 0
        self._closed_requests = 0
        self._closed_errors = 0
        self._closed_bytes_in = 0
        self._closed_bytes_out = 0
        self._max_out = 0
        self._max_inflight = 0
        self._max_parse_buffer = 0
        self._pauses = 0
        self._internal_errors = 0
        self._discarded_bytes = 0
        self._peer_resets = 0
        # Accepted connections whose task has not registered in _conns yet: a burst of
        # accepts must count them, else max_connections is overshot.
        self._starting = 0

    # ------------------------------------------------------------------ public

    @property
    def port(self) -> int:
        """The port of the first listener (handy with port 0)."""
        return self.listeners[0].socket.getsockname()[1]

    async def serve(
        self,
        listeners: Sequence[trio.SocketListener] | None = None,
        host: str | None = "127.0.0.1",
        port: int = 7411,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept and serve connections until :meth:`drain` completes or cancelled.

        Pass ``listeners`` (e.g. from ``trio.open_tcp_listeners``) or ``host``/``port``
        (port 0 picks a free one; see :attr:`port`). ``task_status.started`` gets the
        listeners.
        """
        if listeners is None:
            listeners = await trio.open_tcp_listeners(port, host=host)
        self.listeners = list(listeners)
        try:
            with trio.CancelScope() as serve_scope:
                self._serve_scope = serve_scope
                async with trio.open_nursery() as conn_nursery:
                    with trio.CancelScope() as accept_scope:
                        self._accept_scope = accept_scope
                        if self._draining:
                            accept_scope.cancel()
                        async with trio.open_nursery() as accept_nursery:
                            for listener in self.listeners:
                                accept_nursery.start_soon(self._accept_loop, listener, conn_nursery)
                            task_status.started(self.listeners)
                    # Draining: no new connections; connections finish in conn_nursery.
                    for listener in self.listeners:
                        with trio.CancelScope(shield=True):
                            await listener.aclose()
        finally:
            for listener in self.listeners:
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(listener)
            self.log_limiter.flush()  # report what was suppressed: no count is lost
            self._stopped.set()

    async def drain(self, timeout: float = 30.0) -> None:
        """Graceful stop: stop accepting, let every connection finish its in-flight
        requests (up to ``timeout`` seconds; then they are cancelled and answered
        UNAVAILABLE), then close the connections. Returns when :meth:`serve` ends."""
        self._draining = True
        self._drain_timeout = timeout
        if self._accept_scope is not None:
            self._accept_scope.cancel()
        for conn in list(self._conns):
            conn.begin_drain()
        with trio.move_on_after(timeout + 2.0):
            await self._no_conns.wait()
        if self._serve_scope is not None and not self._stopped.is_set():
            self._serve_scope.cancel()
        if self._serve_scope is not None:
            await self._stopped.wait()

    def statistics(self) -> dict[str, Any]:
        """Counters: connections (open), connections_total, rejected_connections,
        requests, errors, internal_errors, bytes_in, bytes_out, inflight (now),
        outgoing_buffered (now), max_outgoing_buffered, max_inflight_per_conn_seen,
        max_parse_buffer, backpressure_pauses, discarded_bytes, peer_resets (connections
        the peer reset or dropped), log_lines_suppressed, draining."""
        requests = self._closed_requests
        errors = self._closed_errors
        bytes_in = self._closed_bytes_in
        bytes_out = self._closed_bytes_out
        max_out = self._max_out
        max_inflight = self._max_inflight
        max_parse = self._max_parse_buffer
        pauses = self._pauses
        inflight = 0
        buffered = 0
        for c in self._conns:
            requests += c.requests
            errors += c.errors
            bytes_in += c.bytes_in
            bytes_out += c.bytes_out
            max_out = max(max_out, c.max_out)
            max_inflight = max(max_inflight, c.max_inflight)
            max_parse = max(max_parse, c.parser.buffered_max)
            pauses += c.pauses
            inflight += c.inflight
            buffered += len(c.out) + c.sending
        return {
            "connections": len(self._conns),
            "connections_total": self._connections_total,
            "rejected_connections": self._rejected,
            "requests": requests,
            "errors": errors,
            "internal_errors": self._internal_errors,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "inflight": inflight,
            "outgoing_buffered": buffered,
            "max_outgoing_buffered": max_out,
            "max_inflight_per_conn_seen": max_inflight,
            "max_parse_buffer": max_parse,
            "backpressure_pauses": pauses,
            "discarded_bytes": self._discarded_bytes,
            "peer_resets": self._peer_resets,
            "log_lines_suppressed": self.log_limiter.suppressed,
            "draining": self._draining,
        }

    # ---------------------------------------------------------------- internal

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE & co: back off rather than spin
                self.log_limiter.log(logging.WARNING, "accept", "accept failed: %s; retrying in 100 ms", exc)
                await trio.sleep(0.1)
                continue
            try:
                stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            if len(self._conns) + self._starting >= self.max_connections:
                self._rejected += 1
                nursery.start_soon(self._reject, stream)
                continue
            self._starting += 1
            nursery.start_soon(self._run_conn, stream)

    async def _reject(self, stream: trio.SocketStream) -> None:
        err = wire.Err(
            0,
            "UNAVAILABLE",
            f"the server has reached its limit of {self.max_connections} connections; retry later",
            1.0,
        )
        body = _encode(err)
        with trio.move_on_after(1.0):
            try:
                await stream.send_all(len(body).to_bytes(4, "big") + body)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        await trio.aclose_forcefully(stream)

    def _listen(self, on: bool) -> None:
        """A connection starts (``on``) or ends: hear the dispatcher's durability
        reports while any connection runs, so a server that serves no more is not kept
        by its journal."""
        if self._held is None:
            return
        self._listening += 1 if on else -1
        if on and self._listening == 1:
            self.dispatcher.add_durable_listener(self._on_durable)  # type: ignore[attr-defined]
        elif not on and self._listening == 0:
            self.dispatcher.remove_durable_listener(self._on_durable)  # type: ignore[attr-defined]

    def _on_durable(self, durable: int, error: Exception | None) -> None:
        """The dispatcher's durability report: release what it covers."""
        held = self._held
        if not held:
            return
        if error is not None and not isinstance(error, RallypointError):
            error = UnavailableError(
                "the server's journal stopped before this answer was durable (the server is stopping); "
                "the change may or may not have been applied: check once the server restarted",
                retry_after=1.0, details={"maybe_applied": True})
        for conn in list(held):
            if conn.release_held(durable, error):
                del held[conn]

    async def _run_conn(self, stream: trio.SocketStream) -> None:
        # No checkpoint from here to _conns.add(conn): the connection stays counted.
        self._starting -= 1
        try:
            host, port = stream.socket.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        raw = stream
        if self.ssl_context is not None:
            # The TLS handshake happens on the first receive, inside the Hello timeout.
            stream = trio.SSLStream(raw, self.ssl_context, server_side=True, https_compatible=False)
        conn = _Conn(self, stream, peer)
        conn.raw = raw
        self._conns.add(conn)
        self._connections_total += 1
        self._no_conns = trio.Event() if self._no_conns.is_set() else self._no_conns
        if self._draining:
            conn.draining = True
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)
            self._closed_requests += conn.requests
            self._closed_errors += conn.errors
            self._closed_bytes_in += conn.bytes_in
            self._closed_bytes_out += conn.bytes_out
            self._max_out = max(self._max_out, conn.max_out)
            self._max_inflight = max(self._max_inflight, conn.max_inflight)
            self._max_parse_buffer = max(self._max_parse_buffer, conn.parser.buffered_max)
            self._pauses += conn.pauses
            if not self._conns:
                self._no_conns.set()
