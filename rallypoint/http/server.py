"""Serving :class:`~rallypoint.http.app.HttpApi`: our accept loop, hypercorn's
per-connection server (HTTP/1.1 and h2 parsing are hypercorn's, h11's and h2's; none of
ours).

hypercorn's own Trio worker (``hypercorn.trio.serve``) is not used, for what it does
with hostile peers (issue 34, item 9):

- **A peer that closes (EOF) or resets its connection frees it at once.** hypercorn's
  ``TCPServer`` stops reading at EOF but keeps the socket until its idle timer fires
  (``keep_alive_timeout``: 75 s here), half-open, a descriptor each: 3,000 connections
  opened and closed without a request held 1,524 descriptors after 30 s, and under a
  400-descriptor limit stopped both listeners for a minute. :class:`_Connection` stops
  the idle timer once the reading ends, so the connection closes as soon as the answer in
  progress (if any) is sent.
- **A connection that sends no request is dropped after** ``first_request_s`` (the TCP
  listener's ``--handshake-timeout``), not after the keep-alive timeout; an idle
  keep-alive connection between requests still gets ``keep_alive_s``. A TLS handshake
  gets ``first_request_s`` too (hypercorn's default: 60 s).
- **At most** ``max_connections`` **connections** (``--max-connections``, as on TCP): one
  more is answered ``503`` UNAVAILABLE with ``Retry-After: 1`` and closed.
- **An answer is one write.** hypercorn writes an HTTP/1.1 response's head, its body
  and its end (an empty write, with ``content-length``) separately: three sends, two
  system calls, and a client woken to find half an answer. :class:`_Connection` holds a
  fixed-length response's head until the next bytes of the connection (its body, or
  the empty end of a response without one) and sends them together; any other event
  (the connection idle, closed) sends what is held first. A head without
  ``content-length`` (chunked, a stream) and every HTTP/2 frame go out at once.
- **Running out of descriptors stops nothing**: an ``accept`` that fails (EMFILE,
  ENFILE, ENOBUFS...) is retried after a back-off (100 ms doubling to 1 s) and logged as
  one WARNING per 10 s with the count (:class:`rallypoint.transport.guard.AcceptFailures`;
  trio's ``serve_listeners`` logged an ERROR with a traceback every 100 ms); every
  other listener of the process goes on by itself, and takes connections again once
  descriptors are free.
- **Every request passes the guard first** (:class:`~rallypoint.http.guard.HttpGuard`:
  origin-form targets only, no ``Content-Length`` with ``Transfer-Encoding``, a ``Host``
  this server was named by, no WebSocket upgrade), whatever the app: the API, a cluster
  node's forwarder, the console.
- **One connection's failure is never the listener's**: an exception out of hypercorn's
  connection server closes that connection and is logged (rate-limited); hypercorn's
  HTTP/2 protocol no longer raises on DATA for a stream it already answered
  (:class:`_H2`: such DATA is acknowledged and the stream reset with NO_ERROR), which
  ended the whole daemon.

Against clients that hold connections without using them (issue 41, item 7):

- **At most** ``max_connections_per_peer`` **connections per peer address**
  (``--max-connections-per-peer``), counted from the accept (silent ones too): one more
  from that address is answered 503 naming the limit, while other addresses connect.
- **A request's head has** ``header_s`` **seconds** (``--header-timeout``) from its first
  byte (the first request: from the accept, within ``first_request_s``), whatever the
  pace of the bytes (a slowloris client trickling a header every few seconds is cut; a
  per-read timeout, hypercorn's ``read_timeout``, would not cut it and would cut
  long polls and event streams, so it stays off). Its size is hypercorn's
  ``h11_max_incomplete_size`` (:data:`MAX_HEAD_BYTES`; past it: 400).
- **A request's body has** ``body_s`` **seconds** (``--body-timeout``) from its head:
  then it is answered ``408`` REQUEST_TIMEOUT and the connection is closed
  (:class:`_BodyDeadline`, around the application: it sees a disconnect).
- **An idle keep-alive connection** is kept ``keep_alive_s`` (``--http-keep-alive``,
  hypercorn's ``keep_alive_timeout``) between requests; and when every connection slot
  is taken, the one idle longest (for at least :data:`EVICT_MIN_IDLE_S`) is closed to
  make room for the new connection (idle keep-alives can no longer take every slot);
  failing that, the one silent longest since its accept, then the one whose request
  head has been coming longest (slowloris), each after :data:`EVICT_MIN_IDLE_S`: so
  holders from many addresses, each under its cap, cannot keep new clients out until
  their time-outs. A request (or its body) in progress is never closed for another.
"""

from __future__ import annotations

import logging
import socket
import ssl
from typing import Any

import trio
import h2.events
from hypercorn.config import Config
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import wrap_app

from ..logutil import printable
from ..transport.guard import AcceptFailures, Evictable, PeerSlots, RefusalPacer, peer_address, spread
from .app import UNCOUNT_KEY, HttpApi, reject_body
from .guard import HostCheck, HttpGuard

log = logging.getLogger("rallypoint.http")

__all__ = ["serve_http", "HttpListener", "MAX_HEAD_BYTES"]

#: Seconds an accept waits after it failed (EMFILE & co) before it tries again (the
#: first time: it doubles while it keeps failing, up to ACCEPT_RETRY_MAX_S).
ACCEPT_RETRY_S = 0.1
ACCEPT_RETRY_MAX_S = 1.0
#: The largest request head (request line and headers), bytes: hypercorn's
#: ``h11_max_incomplete_size`` (a longer one is answered 400 and the connection closed).
MAX_HEAD_BYTES = 16 * 1024
#: An idle keep-alive connection may be closed to make room once it has been idle this
#: long, seconds (not one between two requests of a busy client).
EVICT_MIN_IDLE_S = 1.0
#: the classes of connections a full listener may close, in the order it does (Evictable ranks)
_IDLE, _SILENT, _HEAD, _BODY = 0, 1, 2, 3
#: the connection, in each request's ``scope["state"]`` (hypercorn copies the
#: connection's state dict into it): what _BodyDeadline registers a body wait under
_CONN_KEY = "rallypoint.connection"


class _BodyWait:
    """A request's body being waited for (registered as evictable, rank _BODY)."""

    __slots__ = ("scope", "conn", "evicted", "asgi_scope")

    def __init__(self, scope: trio.CancelScope, conn: "_Connection", asgi_scope: dict) -> None:
        self.scope = scope
        self.conn = conn
        self.evicted = False
        self.asgi_scope = asgi_scope


class _H2(H2Protocol):
    """hypercorn's HTTP/2 protocol, and DATA for a stream it already closed (the client
    still sends a body after an early answer, say a 401: RFC 9113 §8.1 allows it) is
    acknowledged (flow control) and the stream reset with NO_ERROR; hypercorn's own
    ``_handle_events`` raised KeyError there, which ended the connection's task group
    and, through the listener's nursery, the whole daemon."""

    async def _handle_events(self, events) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                try:
                    self.connection.reset_stream(event.stream_id, 0)
                except Exception:  # (already closed on h2's side: nothing to reset)
                    pass
                await self._flush()
                continue
            await super()._handle_events([event])


class _Protocols(ProtocolWrapper):
    """hypercorn's protocol switch, whose HTTP/2 protocol is :class:`_H2` (ALPN ``h2``,
    or prior knowledge / ``h2c`` upgrade, from the next bytes on)."""

    async def handle(self, event) -> None:
        if type(self.protocol) is H2Protocol:
            self.protocol.__class__ = _H2
        await super().handle(event)
        if type(self.protocol) is H2Protocol:
            self.protocol.__class__ = _H2


class _Connection(TCPServer):
    """hypercorn's per-connection server (as of hypercorn 0.18: ``_read_data``,
    ``_idle_timeout``, ``protocol_send`` and ``idle_task`` are its; the tests in
    tests/test_http_hostile.py pin what this relies on), changed in these ways (see the
    module doc): the reading's end (EOF, reset, closed) stops the idle timer and lets no
    later "idle" restart it, so the connection closes once what is in progress is
    answered; until its first request the idle timer is ``first_request_s``, not the
    keep-alive timeout; the head of a request must be complete ``header_s`` seconds
    after its first byte arrived (HTTP/1.1; the idle timer is shortened to that); an
    idle keep-alive connection is known to ``listener`` (which may :meth:`evict` it)."""

    def __init__(self, app, config, context, state, stream, *, first_request_s: float,
                 header_s: float | None = None, listener: "HttpListener | None" = None) -> None:
        super().__init__(app, config, context, state, stream)
        self.first_request_s = first_request_s
        self.header_s = header_s  # None: no head deadline but the idle timers
        #: this connection's head deadline, seconds: ``header_s`` shortened by up to 10 %
        #: (guard.spread: holders admitted together are not all cut in one instant)
        self._head_s = spread(header_s) if header_s is not None else None
        self.listener = listener
        self.requested = False  # a request arrived: later idle periods are keep-alive
        self.peer_gone = False  # the reading ended: nothing more will come
        self.held = b""  # a fixed-length HTTP/1.1 response head, sent with the next bytes
        self.idle = True  # no request in progress (hypercorn's Updated(idle=...))
        self.head_at: float | None = None  # when the first byte of the head in progress came
        self.evicted = False  # closed to make room (HttpListener._make_room)
        self.addr = "?"  # the peer's address (its PeerSlots key), set by the listener
        self._idle_scope: trio.CancelScope | None = None  # the idle timer's, while it runs

    @property
    def protocol(self):
        return self._protocol

    @protocol.setter
    def protocol(self, value) -> None:
        # (TCPServer.run builds hypercorn's ProtocolWrapper: made a _Protocols here)
        if type(value) is ProtocolWrapper:
            value.__class__ = _Protocols
            if type(value.protocol) is H2Protocol:
                value.protocol.__class__ = _H2
        self._protocol = value

    async def protocol_send(self, event) -> None:
        if type(event) is RawData:
            data = event.data
            if self.held:
                data, self.held = self.held + data, b""
            elif _fixed_length_head(data):
                self.held = data
                return
            if data:
                await self._send_raw(data)
            return
        if self.held:  # idle, closed...: what is held goes first
            data, self.held = self.held, b""
            await self._send_raw(data)
        if isinstance(event, Updated):
            self.idle = event.idle
            self.head_at = None
            if not event.idle:
                self.requested = True
                self._not_idle()
            elif self.peer_gone:
                return  # no idle timer for a connection that can get no more requests
            elif self.listener is not None and self.requested:
                self.listener._idle_since(self)  # an idle keep-alive connection
        await super().protocol_send(event)

    async def _send_raw(self, data: bytes) -> None:
        """hypercorn's send of ``data`` (under its send lock), where the connection being
        closed meanwhile ends the send: hypercorn's ``_close`` sends EOF outside that
        lock, and a send racing it (an error answer of the reading task while the
        application's answer closes the connection: a slow body closed to make room,
        its client gone) raised BusyResourceError out of the connection, a traceback
        in the log. The bytes are moot: the connection is closing."""
        try:
            await super().protocol_send(RawData(data=data))
        except trio.BusyResourceError:
            await self.protocol.handle(Closed())

    def _not_idle(self) -> None:
        if self.listener is not None:
            self.listener._evictable.discard(self)

    def _head_started(self) -> None:
        """Bytes arrived while no request is in progress: the head of the next one has
        ``header_s`` seconds from now (HTTP/1.1; an HTTP/2 connection sends frames of
        its own while idle)."""
        self.head_at = now = trio.current_time()
        self._not_idle()
        if self.listener is not None and not self.peer_gone:
            self.listener._evictable.add(self.addr, self, _HEAD, now)
        scope = self._idle_scope
        if scope is not None and self.header_s is not None and self.protocol_is_h11():
            scope.deadline = min(scope.deadline, now + self._head_s)

    def protocol_is_h11(self) -> bool:
        return type(getattr(self.protocol, "protocol", None)).__name__ == "H11Protocol"

    def evict(self, head: bool = False) -> bool:
        """Close this idle keep-alive connection now (its slot is wanted); ``head``: also
        when a request head is in progress (not complete: no request yet). False when
        it is no longer idle (nothing done)."""
        scope = self._idle_scope
        if scope is None or not self.idle or (self.head_at is not None and not head):
            return False
        self.evicted = True
        scope.cancel()
        return True

    async def _read_data(self) -> None:
        # hypercorn's TCPServer._read_data (no read timeout: see the module doc), telling
        # when the head of a request begins
        try:
            while True:
                try:
                    data = await self.stream.receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break
                if data and self.idle and self.head_at is None:
                    self._head_started()
                await self.protocol.handle(RawData(bytes(data)))
                if data == b"":
                    break
            await self.protocol.handle(Closed())
        finally:
            self.peer_gone = True
            self._not_idle()
            with trio.CancelScope(shield=True):
                await self.idle_task.stop()

    async def _idle_timeout(self) -> None:
        timeout = self.config.keep_alive_timeout if self.requested else self.first_request_s
        with trio.move_on_after(timeout) as scope:
            if self.head_at is not None and self.header_s is not None and self.protocol_is_h11():
                scope.deadline = min(scope.deadline, self.head_at + self._head_s)
            self._idle_scope = scope
            try:
                await self.context.terminated.wait()
            finally:
                self._idle_scope = None
        self._not_idle()
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()


def _fixed_length_head(data: bytes) -> bool:
    """Whether ``data`` is the head of a final (status >= 200) HTTP/1.1 response that
    declares a ``content-length``: its body (or, for none, the end of the response)
    follows at once."""
    if not data.startswith(b"HTTP/1.1 ") or data[9:10] == b"1" or not data.endswith(b"\r\n\r\n"):
        return False
    return b"\r\ncontent-length:" in data.lower()


class _BodyDeadline:
    """ASGI middleware: a request's body must have arrived ``body_s`` seconds after the
    application was called (its head complete). Past that, the request is answered
    ``408`` REQUEST_TIMEOUT with ``connection: close`` (hypercorn then closes the
    connection: the rest of the body is never read) and the application's pending and
    later ``receive()`` get ``http.disconnect`` (it ends as for a client gone); whatever
    it sends after that is dropped. ``on_timeout(scope)`` is called once per such
    request (logging, counting)."""

    def __init__(self, app, body_s: float, on_timeout=None) -> None:
        self.app = app
        self.body_s = body_s
        self.on_timeout = on_timeout
        # what the listener reads from the application it serves
        self.log_limiter = getattr(app, "log_limiter", None)

    def __getattr__(self, name: str):  # listener, metrics, flush_logs... of the app
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        began = trio.current_time()
        deadline = began + self.body_s
        state = {"body_done": False, "timed_out": False, "started": False}
        conn = (scope.get("state") or {}).get(_CONN_KEY)
        listener = conn.listener if conn is not None else None

        async def timed_receive():
            if state["timed_out"]:
                return {"type": "http.disconnect"}
            if state["body_done"]:
                return await receive()
            wait = None
            with trio.move_on_at(deadline) as cancel:
                if listener is not None:  # a full listener may close it for another (oldest first)
                    wait = _BodyWait(cancel, conn, scope)
                    listener._evictable.add(conn.addr, wait, _BODY, began)
                try:
                    msg = await receive()
                finally:
                    if wait is not None:
                        listener._evictable.discard(wait)
                if msg.get("type") != "http.request" or not msg.get("more_body", False):
                    state["body_done"] = True
                return msg
            state["timed_out"] = True
            evicted = wait is not None and wait.evicted
            if self.on_timeout is not None and not evicted:
                self.on_timeout(scope)
            if not state["started"]:
                state["started"] = True
                if evicted:
                    status, body = 503, reject_body(
                        "the server has reached its limit of HTTP connections and this request's body was "
                        "still coming: closed to make room; retry", code="UNAVAILABLE")
                else:
                    status, body = 408, reject_body(
                        f"the request body did not arrive within {self.body_s:g} s of its head "
                        "(--body-timeout); closing the connection", code="REQUEST_TIMEOUT")
                headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                           (b"content-length", b"%d" % len(body))]
                if evicted:
                    headers.append((b"retry-after", b"1"))
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            return {"type": "http.disconnect"}

        async def guarded_send(msg):
            if state["timed_out"]:
                return  # answered 408 already
            if msg.get("type") == "http.response.start":
                state["started"] = True
            await send(msg)

        await self.app(scope, timed_receive, guarded_send)


class HttpListener:
    """The HTTP listener: accepts on ``listeners`` and runs each connection with
    hypercorn's protocol handling over ``api``.

    Args:
        api: the ASGI application (:class:`HttpApi`).
        config: a ``hypercorn.config.Config`` (keep-alive timeout, h11/h2 limits, the
            error log).
        ssl_context: wrap accepted sockets in TLS (ALPN h2 and http/1.1), or None.
        max_connections: connections open at once; one more is answered 503, unless an
            idle keep-alive connection can be closed to make room (the oldest idle).
        max_connections_per_peer: connections one peer address may hold open at once
            (one more from it is answered 503; 0 or None: no cap).
        first_request_s: seconds a new connection has to complete its TLS handshake
            and send the head of its first request (> 0).
        header_s: seconds a request's head has from its first byte (HTTP/1.1; None:
            only the idle timers).
        body_s: seconds a request's body has from its head (then 408; None: no limit).
        graceful_s: on stop, seconds the connections get to finish their requests.
        hosts: the ``Host`` names and addresses answered
            (:class:`~rallypoint.http.guard.HostCheck`; default: loopback names and
            the address a connection reached).

    A connection whose handling raises (a bug of ours or hypercorn's) is closed and
    logged (rate-limited: a traceback for the first of a window); the listener and every
    other connection go on.
    """

    def __init__(self, api: HttpApi, config, *, ssl_context: ssl.SSLContext | None = None,
                 max_connections: int = 1024, max_connections_per_peer: int | None = None,
                 first_request_s: float = 10.0, header_s: float | None = None, body_s: float | None = None,
                 graceful_s: float = 5.0, hosts: HostCheck | None = None) -> None:
        self.api = api
        self.config = config
        #: what every request passes before ``api`` sees it (rallypoint.http.guard)
        self.guard = HttpGuard(api, hosts=hosts)
        self.body_s = body_s
        self.body_timeouts = 0
        served = _BodyDeadline(self.guard, body_s, self._body_timed_out) if body_s is not None else self.guard
        self.app = wrap_app(served, config.wsgi_max_body_size, "asgi")
        self.context = WorkerContext(None)
        self.ssl_context = ssl_context
        self.max_connections = max_connections
        self.peer_slots = PeerSlots(max_connections_per_peer)
        #: refusals of an address refused again held a second (RefusalPacer)
        self.pacer = RefusalPacer()
        self.first_request_s = first_request_s
        self.header_s = header_s
        self.graceful_s = graceful_s
        #: accept failures and refused connections: a few lines and a count per 10 s
        self.log_limiter = api.log_limiter
        self.accept_failures = AcceptFailures(log, "HTTP listener", first_s=ACCEPT_RETRY_S,
                                              max_s=ACCEPT_RETRY_MAX_S)
        #: connections not handed to hypercorn yet (no bytes yet): ended on stop
        #: (-> the slot's release)
        self._waiting: dict[trio.CancelScope, Any] = {}
        #: what may be closed to make room, per peer address (max-min fair: Evictable):
        #: idle keep-alive connections (since when idle), connections silent since their
        #: accept (their wait's scope), connections whose request head is in progress
        #: (since its first byte: a head is one packet for a real client, so one still
        #: coming after EVICT_MIN_IDLE_S when every slot is taken is a slowloris client's)
        self._evictable = Evictable(self.peer_slots, 4, EVICT_MIN_IDLE_S)
        self.connections = 0
        self.connections_total = 0
        self.rejected = 0
        self.connection_errors = 0
        self.evicted = 0
        self.evicted_silent = 0
        self.evicted_slow_heads = 0
        self.evicted_slow_bodies = 0

    @property
    def accept_errors(self) -> int:
        return self.accept_failures.total

    def statistics(self) -> dict[str, int]:
        """``connections`` (open now), ``connections_total`` (accepted and served),
        ``rejected_connections`` (over ``max_connections`` or the cap per peer),
        ``accept_errors`` (failed accepts, e.g. EMFILE), ``idle_closed`` (idle keep-alive
        connections closed to make room), ``silent_closed`` / ``slow_heads_closed``
        (connections silent since their accept, or whose request head was still coming,
        closed to make room), ``slow_bodies_closed`` (requests whose body was still
        coming, answered 503 to make room), ``body_timeouts`` (408s), and the per-peer
        counts (``peers``, ``max_per_peer``, ``refused_per_peer``), ``refused_requests``
        (refused by the guard: a bad request-target, framing, Host, a WebSocket upgrade),
        ``connection_errors`` (connections ended by an unexpected error)."""
        return {"connections": self.connections, "connections_total": self.connections_total,
                "rejected_connections": self.rejected, "accept_errors": self.accept_errors,
                "idle_closed": self.evicted, "silent_closed": self.evicted_silent,
                "slow_heads_closed": self.evicted_slow_heads, "slow_bodies_closed": self.evicted_slow_bodies,
                "body_timeouts": self.body_timeouts,
                "refused_requests": sum(self.guard.refused.values()), "connection_errors": self.connection_errors,
                **self.peer_slots.statistics(), **self.pacer.statistics()}

    def _body_timed_out(self, scope) -> None:
        self.body_timeouts += 1
        client = scope.get("client") or ("?", 0)
        self.log_limiter.log(logging.INFO, "http-body-timeout",
                             "HTTP client %s:%s sent its request body too slowly (%s %s): answered 408 after %g s",
                             client[0], client[1], scope.get("method"), scope.get("path"), self.body_s)

    def _idle_since(self, conn: _Connection) -> None:
        """``conn`` became an idle keep-alive connection (the newest idle)."""
        self._evictable.add(conn.addr, conn, _IDLE, trio.current_time())

    def _make_room(self, addr: str) -> bool:
        """Every slot is taken: close, to make room for a new connection from ``addr``,
        one of the connections of the address holding the most (and at least two more
        than ``addr``: max-min fair, :class:`~rallypoint.transport.guard.Evictable`):
        the one idle longest between requests, else the one silent longest since its
        accept, else the one whose request head has been coming longest (a slowloris
        client), else the one whose request body has been coming longest (answered 503:
        a slow body, from the biggest holder, past ``EVICT_MIN_IDLE_S``: without it, slow
        bodies from many addresses held every slot for ``--body-timeout``), each only if
        that has lasted :data:`EVICT_MIN_IDLE_S` at least; True when one was (its slot is
        free at once). A request being handled (its body in) is never closed for
        another."""
        return self._evictable.pick(addr, trio.current_time(), self._evict)

    def _evict(self, item: Any, rank: int) -> bool:
        if rank == _BODY:  # answered 503 by _BodyDeadline, then closed
            item.evicted = True
            item.scope.cancel()
            self.evicted_slow_bodies += 1
            release = getattr(item.conn, "release", None)
            if release is not None:
                release()
            uncount = item.asgi_scope.get(UNCOUNT_KEY)  # (its request slot too: HttpApi.max_requests)
            if uncount is not None:
                uncount()
            return True
        if rank == _SILENT:
            release = self._waiting.pop(item, None)
            if release is None:
                return False
            item.cancel()
            release()
            self.evicted_silent += 1
            return True
        if not item.evict(head=rank == _HEAD):
            return False
        if rank == _IDLE:
            self.evicted += 1
        else:
            self.evicted_slow_heads += 1
        release = getattr(item, "release", None)
        if release is not None:
            release()
        return True

    async def serve(self, listeners: list[trio.SocketListener], stop: trio.Event) -> None:
        """Accept on ``listeners`` until ``stop`` is set (or cancelled); then stop
        accepting, close idle connections and give the others ``graceful_s`` seconds."""
        try:
            async with trio.open_nursery() as conn_nursery:
                async with trio.open_nursery() as accept_nursery:
                    for listener in listeners:
                        accept_nursery.start_soon(self._accept_loop, listener, conn_nursery)
                    await stop.wait()
                    accept_nursery.cancel_scope.cancel()
                for listener in listeners:
                    await trio.aclose_forcefully(listener)
                # idle connections close (their idle timer waits for this; the ones that
                # sent nothing yet at once); busy ones close once answered, or at the deadline
                for scope in list(self._waiting):
                    scope.cancel()
                await self.context.terminated.set()
                conn_nursery.cancel_scope.deadline = trio.current_time() + self.graceful_s
        finally:
            for listener in listeners:
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(listener)
            self.api.flush_logs()
            self.guard.flush_logs()
            self.accept_failures.flush()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        failures = self.accept_failures
        slots = self.peer_slots
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE & co: back off rather than spin; never stop
                await failures.failed(exc)
                continue
            failures.succeeded()
            addr = peer_address(stream.socket)
            if slots.cap and slots.count(addr) >= slots.cap:
                slots.take(addr)  # (refused: counted)
                self.rejected += 1
                self.log_limiter.log(logging.WARNING, "http-peer-limit",
                                     "HTTP listener: %s has %d connections open (--max-connections-per-peer); "
                                     "refused one", addr, slots.cap)
                self._refuse(nursery, stream, addr, (
                    f"this address ({addr}) has {slots.cap} HTTP connections open, the limit per peer address "
                    "(--max-connections-per-peer); close one or retry shortly"))
                continue
            if self.connections >= self.max_connections and not self._make_room(addr):
                self.rejected += 1
                self.log_limiter.log(logging.WARNING, "http-limit",
                                     "HTTP listener: %d connections open (--max-connections); refused one",
                                     self.connections)
                self._refuse(nursery, stream, addr)
                continue
            slots.take(addr)
            self.connections += 1  # counted before the task starts: a burst cannot overshoot
            nursery.start_soon(self._run, stream, addr)

    async def _run(self, stream: trio.SocketStream, addr: str = "?") -> None:
        counted = [True]  # the slot is still this connection's (an eviction gives it back first)
        try:
            self.connections_total += 1
            # Wait for the first bytes (peeked: they stay for hypercorn) before building
            # hypercorn's connection: a peer that closes or resets first, or sends nothing
            # for first_request_s, costs an accept and a close (this doubles the rate at
            # which a flood of empty connections is drained).
            deadline = trio.current_time() + self.first_request_s
            first = b""
            with trio.move_on_at(deadline) as waiting:
                self._waiting[waiting] = lambda: self._release(counted, addr)
                self._evictable.add(addr, waiting, _SILENT, trio.current_time())
                try:
                    first = await stream.socket.recv(1, socket.MSG_PEEK)
                except OSError:  # reset by the peer
                    pass
                finally:
                    self._waiting.pop(waiting, None)
                    self._evictable.discard(waiting)
            if not first or self.context.terminated.is_set():
                return
            s: Any = stream
            if self.ssl_context is not None:
                s = trio.SSLStream(stream, self.ssl_context, server_side=True, https_compatible=True)
            state: dict = {}  # (hypercorn copies it into each request's scope["state"])
            conn = _Connection(self.app, self.config, self.context, state, s,
                               first_request_s=max(0.0, deadline - trio.current_time()),
                               header_s=self.header_s, listener=self)
            conn.release = lambda: self._release(counted, addr)
            conn.addr = addr
            state[_CONN_KEY] = conn
            try:
                await conn.run()
            except Exception as exc:  # one connection's failure is never the listener's
                self.connection_errors += 1
                peer = "?"
                try:
                    peer = "%s:%s" % stream.socket.getpeername()[:2]
                except OSError:
                    pass
                self.log_limiter.log(logging.WARNING, "http-connection-error",
                                     "HTTP listener: the connection from %s ended by an error: %s", peer,
                                     printable(repr(exc), 300), exc_info=exc)
        finally:
            self._release(counted, addr)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    def _release(self, counted: list, addr: str) -> None:
        """Give back a connection's slot (once: an evicted connection gives it back as it
        is evicted, so the new one can take it at once)."""
        if counted[0]:
            counted[0] = False
            self.connections -= 1
            self.peer_slots.give(addr)

    def _refuse(self, nursery: trio.Nursery, stream: trio.SocketStream, addr: str, why: str | None = None) -> None:
        """Refuse ``stream`` (from ``addr``): a 503 at once, or after the pacer's hold for
        an address refused again, or a reset at once when the hold is full
        (:meth:`~rallypoint.transport.guard.RefusalPacer.refuse`)."""
        self.pacer.refuse(nursery, stream, addr, self._reject, why)

    async def _reject(self, stream: trio.SocketStream, why: str | None = None) -> None:
        """Answer 503 UNAVAILABLE (``Retry-After: 1``) and close; at most ~2 s."""
        body = reject_body(why or f"the server has reached its limit of {self.max_connections} HTTP connections "
                           "(--max-connections); retry shortly")
        head = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body))
        s: Any = stream
        try:
            with trio.move_on_after(1.0):
                if self.ssl_context is not None:
                    s = trio.SSLStream(stream, self.ssl_context, server_side=True, https_compatible=True)
                    await s.do_handshake()
                    if s.selected_alpn_protocol() == "h2":
                        return  # no HTTP/1.1 answer to an h2 peer: closing is the answer
                await s.send_all(head + body)
                if self.ssl_context is None:
                    await s.send_eof()
            with trio.move_on_after(1.0):  # read what the peer sent, so closing sends no RST
                while await s.receive_some(65536):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)


def _url(scheme: str, sockname) -> str:
    host, port = sockname[0], sockname[1]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def serve_http(
    service,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    max_requests: int = 1024,
    max_connections: int = 1024,
    max_connections_per_peer: int | None = None,
    first_request_s: float = 10.0,
    header_s: float | None = 10.0,
    body_s: float | None = 30.0,
    keep_alive_s: float = 30.0,
    graceful_s: float = 5.0,
    metrics: Any = None,
    shutdown: trio.Event | None = None,
    api: Any = None,
    listeners: list | None = None,
    hosts: Any = (),
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the HTTP API on ``host:port`` (0: any free port) until ``shutdown`` is set
    (or the task is cancelled).

    ``task_status.started`` gets ``(api, urls)``: the app and the bound addresses
    (``["http://127.0.0.1:8080"]``). TLS with ``ssl_context``, or ``certfile``/``keyfile``
    (the TCP listener's ``--tls-cert``/``--tls-key``). ``max_requests``: requests in
    progress at once (then 429); ``max_connections``: connections open at once (then
    503, unless an idle keep-alive connection is closed to make room);
    ``max_connections_per_peer``: connections one peer address may hold (then 503; None:
    no cap); ``first_request_s``: seconds a connection has to send its first request;
    ``header_s``: seconds a request's head has from its first byte (None: no limit but
    the idle timers); ``body_s``: seconds its body has from its head (then 408; None: no
    limit); ``keep_alive_s``: seconds an idle connection is kept between requests;
    ``graceful_s``: seconds in-flight requests get on shutdown; ``metrics``: a
    :class:`rallypoint.metrics.Metrics` that counts every operation (None: not counted);
    ``api``: another ASGI application with ``HttpApi``'s ``log_limiter``/``listener``/
    ``metrics`` attributes instead (a cluster node's, :mod:`rallypoint.cluster.forward`;
    ``service`` is then unused); ``listeners``: ``trio.SocketListener``s already bound
    (``rallypoint serve`` binds before it recovers; None: bind ``host:port`` here);
    ``hosts``: names (or addresses) the server is reached by besides ``localhost``,
    ``host`` and the address a connection reached (``--http-host``; the ``Host`` check of
    :mod:`rallypoint.http.guard`).

    Raises OSError (EADDRINUSE...) if the address cannot be bound, before ``started``;
    ValueError for a name of ``hosts`` that is not a host name or address.
    """
    host_check = HostCheck(hosts, listen_host=host)
    if api is None:
        api = HttpApi(service, max_requests=max_requests)
    api.metrics = metrics
    cfg = Config()
    cfg.keep_alive_timeout = keep_alive_s
    cfg.h11_max_incomplete_size = MAX_HEAD_BYTES
    cfg.graceful_timeout = graceful_s
    cfg.ssl_handshake_timeout = first_request_s
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("rallypoint.http.hypercorn")
    cfg.include_server_header = False
    if ssl_context is None and certfile:
        cfg.certfile = certfile
        cfg.keyfile = keyfile
        ssl_context = cfg.create_ssl_context()
    if listeners is None:
        listeners = await trio.open_tcp_listeners(port, host=host)
    scheme = "https" if ssl_context is not None else "http"
    urls = [_url(scheme, ln.socket.getsockname()) for ln in listeners]
    server = HttpListener(api, cfg, ssl_context=ssl_context, max_connections=max_connections,
                          max_connections_per_peer=max_connections_per_peer, first_request_s=first_request_s,
                          header_s=header_s, body_s=body_s, graceful_s=graceful_s, hosts=host_check)
    api.listener = server
    for u in urls:
        log.debug("HTTP listener on %s", u)
    task_status.started((api, urls))
    await server.serve(listeners, shutdown if shutdown is not None else trio.Event())

