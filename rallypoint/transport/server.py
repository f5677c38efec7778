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

Each connection is a :class:`~rallypoint.transport.connstate.ConnState` (the sans-I/O
state machine: what to answer, hold, pause, close; named states and transitions tables)
inside a :class:`_Conn`, the socket loop that carries out its actions (these tasks, the
non-blocking write, TLS, the drain's timers). The connection is the
:class:`~rallypoint.actors.runtime.ReplySink` of its requests: actors call
:meth:`_Conn.deliver` with the answer (success or error) and the LSN it depends on. A
server-side wait is parked in its actor, not in this connection: a Cancel frame, or the
connection closing, ends it (and its answer is dropped).

Backpressure: when ``max_inflight_per_conn`` requests are in flight (submitted, not yet
answered; every request of a batch frame counts), or more than ``max_outgoing_bytes`` of
replies are waiting for the peer to read them (queued or in a send that has not
finished, plus the estimated replies of the requests in flight), the reader stops
reading the socket until that drops again. Replies of requests already in flight may
take it further; a connection whose unread replies pass twice ``max_outgoing_bytes``
(at least that plus one frame) is answered ``Err(0, SLOW_CONSUMER)`` and closed. So a
client that never reads holds about ``max_outgoing_bytes`` of the server's memory, and
never more than twice that (``scripts/soak_hostile.py`` measures it).

Hostile peers: a connection has ``handshake_timeout`` seconds to send its Hello; one
peer address may hold at most ``max_connections_per_peer`` connections (silent ones
included), so it cannot take every one of ``max_connections``; a full server closes
the connection that has waited longest (at least ``evict_silent_after_s``, 1 s) for its
Hello to admit a new one, so silent connections from many addresses cannot hold every
slot until their Hello time-out; a connection answered LIMIT_EXCEEDED is not read again
for its ``retry_after`` (:data:`LIMIT_PAUSE_S`, at most :data:`LIMIT_PAUSE_MAX_S`); an
``accept`` that fails
(EMFILE...) backs off and logs one line per window with a count
(:class:`~rallypoint.transport.guard.AcceptFailures`).

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
import socket
from typing import Any, Protocol, Sequence

import msgspec
import trio

from .. import wire
from ..errors import LimitError, RallypointError, UnavailableError, shutting_down_error
from ..logutil import RateLimitedLogger
from .connstate import (
    ABORT,
    DRAINING_PHASES,
    FLUSH,
    HOLD,
    IDLE,
    NEED_DATA,
    PAUSED,
    REFUSED,
    RESUME,
    WATCH,
    WRITE,
    ConnState,
    Reading,
)
from .guard import AcceptFailures, Evictable, PeerSlots, RefusalPacer, peer_address, spread
from .sockio import receive_plain

HANDLING = Reading.HANDLING

__all__ = ["Dispatcher", "Server"]

log = logging.getLogger("rallypoint.transport")
#: A client that pings while its calls wait (this SDK's: every 1.25-4.5 s) and sent
#: nothing for this long is taken as gone: its parked waits take nothing -- a receive
#: hands no delivery to a dead peer -- and its connection is closed, seconds.
GONE_AFTER_S = 10.0
_gone_log = RateLimitedLogger(log, window_s=30.0, burst=3)

_RECEIVE_SIZE = 65536
#: after a LIMIT_EXCEEDED answer a connection is not read for its ``retry_after``, at most
#: LIMIT_PAUSE_MAX_S seconds, LIMIT_PAUSE_S when it has none: a client that re-sends at
#: once is slowed to what the answer asked (the requests it already sent still run)
LIMIT_PAUSE_S = 0.25
LIMIT_PAUSE_MAX_S = 1.0


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

    # Optional: ``goodbye(session)`` -- the connection ``hello`` authenticated closed.
    # Optional: ``add_durable_listener(fn)`` / ``remove_durable_listener(fn)`` -- call
    # ``fn(durable_lsn, None)`` whenever the durable LSN advances and ``fn(durable_lsn,
    # error)`` once it never will again. With it the server (while a connection runs)
    # releases held replies in the step that learns of an fsync (no task per connection);
    # without it, each connection's task awaits wait_durable.


_encode = msgspec.msgpack.Encoder().encode


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
    """One server-side connection: the socket loop around its :class:`ConnState`.

    The state machine decides (what to answer, what to hold, when to pause, when to
    close); this wrapper does the I/O it asks for: the reader, writer, durability and
    pinger tasks, the non-blocking write at the end of an actor's batch, the drain's
    timers, and the watch for a peer that goes away while the reader is paused. It is
    the ``ReplySink`` of its requests: each sink call goes to the state machine and
    the returned action bits are carried out by :meth:`_act`.
    """

    _PEER_POLL_S = 1.0  # while paused with unread data: how often the TCP state is read

    def __init__(self, server: "Server", stream: Any, peer: str) -> None:
        self.server = server
        self.stream = stream
        self.raw = stream  # the TCP stream under TLS (set by Server._run_conn)
        # a plain TCP stream can be written with a non-blocking os.write from flush()
        self._fd: int | None = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else None
        self.peer = peer
        self._gone_dropped = False
        #: the reader reads nothing more before this instant (trio time; 0: no pause):
        #: set by a LIMIT_EXCEEDED answer (see :meth:`deliver`)
        self.penalty_until = 0.0
        #: while waiting for the Hello: its time-out's scope (the server, full, cancels
        #: the oldest one's to make room: Server._evict_silent); the accept instant
        self.hello_scope: trio.CancelScope | None = None
        self.accepted_at = trio.current_time()
        self.evicted = False
        self.addr = "?"  # the peer's address: its key in the server's PeerSlots
        dispatcher = server.dispatcher
        self.st = st = ConnState(
            peer=peer,
            durable_lsn=dispatcher.durable_lsn,
            max_inflight=server.max_inflight_per_conn,
            max_out_bytes=server.max_outgoing_bytes,
            watch_buffer_bytes=server.watch_buffer_bytes,
            metrics=server.metrics,
            log_limiter=server.log_limiter,
        )
        #: ReplySink: no more answers wanted (the actors check it; set once the
        #: connection is CLOSED)
        self.closed = False
        self.nursery: trio.Nursery | None = None
        self.send_scope: trio.CancelScope | None = None
        self.writer_event: trio.Event | None = None
        self.reader_event: trio.Event | None = None
        self.deferred_event: trio.Event | None = None
        self.idle_event = trio.Event()  # set when draining and nothing is in flight (IDLE)
        self._peer_quiet = True  # nothing unread from the peer: EOF can be seen without reading
        self._held = server._held
        self._submit = dispatcher.submit
        self._watch_wake = getattr(dispatcher, "watch_wake", None)
        self._deliver = st.deliver
        # ReplySink calls that need no I/O go straight to the state machine
        self.note_op = st.note_op
        self.untrack = st.untrack
        self.add_stream = st.add_stream
        self.push_room = st.push_room

    # ----------------------------------------------------------------- actions

    def _act(self, act: int) -> None:
        """Carry out the state machine's action bits."""
        if act & HOLD:
            held = self._held
            if held is not None:  # released by Server._on_durable
                held[self] = None
            else:
                ev = self.deferred_event
                if ev is not None:
                    self.deferred_event = None
                    ev.set()
        if act & RESUME:
            self._wake_reader()
        if act & IDLE:
            self.idle_event.set()
        if act & WRITE:
            self._wake_writer()
        if act & WATCH and self._watch_wake is not None:
            self._watch_wake()
        if act & FLUSH:
            self.flush()
        if act & ABORT:
            self.abort()

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

    # --------------------------------------------------------------- ReplySink

    def gone(self) -> bool:
        """(ReplySink) The client pings while its calls wait, yet sent nothing for
        :data:`GONE_AFTER_S` seconds: taken as gone (:meth:`ConnState.gone`)."""
        return self.st.gone(GONE_AFTER_S)

    def drop_gone(self) -> None:
        """(ReplySink) Close a connection taken as gone, once (logged, rate-limited)."""
        if not self._gone_dropped:
            self._gone_dropped = True
            _gone_log.log(logging.INFO, "peer-gone", "connection from %s sent nothing for %g s though its client "
                          "pings while it waits: taken as gone, closed (its parked waits take nothing)", self.peer,
                          GONE_AFTER_S)
            self.abort()

    def deliver(self, rid: int, reply: Any, lsn: int) -> None:
        """An actor's answer to request ``rid``: queued at once when the journal is
        durable past ``lsn`` (and written by :meth:`flush`, which the dispatcher calls
        at the end of its batch), else held until it is (:meth:`release_held`)."""
        if reply.__class__ is LimitError:
            # a client refused at a limit is not read again for its retry_after (at most
            # LIMIT_PAUSE_MAX_S): one that ignores it is slowed to it, and the other
            # tenants keep the server's time (issue 41: a noisy tenant re-sending at its
            # limits doubled a quiet tenant's p99)
            pause = min(reply.retry_after or LIMIT_PAUSE_S, LIMIT_PAUSE_MAX_S)
            self.penalty_until = max(self.penalty_until, trio.current_time() + pause)
            self.server._limit_pauses += 1
        if not isinstance(reply, BaseException):
            refusal = self._fenced()
            if refusal is not None:
                # a read (no record: nothing applied) gets the refusal; a change applied
                # past the gate may still be committed by a standby that has not seen
                # the lapse yet, so its client is told it may have been applied
                reply = refusal if not lsn else UnavailableError(
                    "this node's leadership lapsed before this answer was sent; the change may or may not "
                    "have been applied: check on the shard's leader", retry_after=0.5,
                    details={"maybe_applied": True})
                lsn = 0
        act = self._deliver(rid, reply, lsn)
        if act:
            if act == HOLD and self._held is not None:
                self._held[self] = None  # released by Server._on_durable
            else:
                self._act(act)

    def flush(self) -> None:
        """Write the queued replies now, with ONE non-blocking send: replies delivered
        during an actor's batch leave together, without waking the writer task (the
        actor runtime calls this at the end of every batch). What does not fit in the
        socket buffer, a TLS stream, or a send already in progress is left to the
        writer."""
        st = self.st
        out = st.out
        if not out or st.sending or st.reading is HANDLING:
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
        act = st.wrote(n)
        if act:
            self._act(act)

    def track(self, rid: int, waiter: Any) -> None:
        """Request ``rid`` parked a waiter: a Cancel frame or the close can end it."""
        act = self.st.track(rid, waiter)
        if act:
            self._act(act)

    def push(self, rid: int, events: list, cursor: int) -> None:
        """Queue one Push frame (hand-built: the events are already encoded; ``cursor``:
        the seq scanned up to) and send it (or, past the reply gate, end the stream)."""
        refusal = self._fenced()
        if refusal is not None:
            self.end_stream(rid, refusal)
        elif self.st.push(rid, events, cursor):
            self.flush()

    def push_encoded(self, rid: int, n: int, array: bytes, cursor: int) -> None:
        """One Push frame whose ``n`` events are already one encoded msgpack array."""
        refusal = self._fenced()
        if refusal is not None:
            self.end_stream(rid, refusal)
        elif self.st.push_encoded(rid, n, array, cursor):
            self.flush()

    def end_stream(self, rid: int, error: Any) -> None:
        act = self.st.end_stream(rid, error)
        if act:
            self._act(act)

    def release_held(self, durable: int, error: RallypointError | None) -> bool:
        """The journal is durable past ``durable`` (or, with ``error``, will not get any
        further): send every held reply it covers, in order, and ``error`` for the rest.
        True when nothing is held any more. (With a dispatcher that has
        ``add_durable_listener``; otherwise the :meth:`durability` task does this.)"""
        # (not gated: a held reply passed the gate when it was delivered, and what it
        # waited for is durable: a write acknowledged by the in-sync set is committed)
        act = self.st.release(durable, error)
        if act:
            self._act(act)
        return not self.st.deferred

    # ------------------------------------------------------------------- tasks

    async def writer(self) -> None:
        st = self.st
        stream = self.stream
        try:
            while True:
                if not st.out or st.sending:
                    if st.idle():
                        self.idle_event.set()
                    ev = self.writer_event = trio.Event()
                    await ev.wait()
                    continue
                data = st.take_output()
                # Shielded: a send cancelled half-way would corrupt the stream, and one
                # cancelled before it starts would lose replies. Closing sets a deadline.
                with trio.CancelScope(shield=True) as scope:
                    self.send_scope = scope
                    if st.closing:
                        scope.deadline = trio.current_time() + 1.0
                    await stream.send_all(data)
                self.send_scope = None
                if scope.cancelled_caught:
                    st.send_failed()
                    self.abort()
                    return
                act = st.sent(len(data))
                if act:
                    self._act(act)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            st.send_failed()
            self.abort()

    async def durability(self) -> None:
        """Without the dispatcher's durability reports: wait for the OLDEST held reply's
        LSN, then send every held reply the journal is durable past (a reply whose
        commit made the previous fsync is not held back for a newer one's: on a
        pipelined connection that coupling cost a whole group-commit cycle)."""
        wait_durable = self.server.dispatcher.wait_durable
        durable_lsn = self.server.dispatcher.durable_lsn
        st = self.st
        fifo = st.deferred
        while True:
            if not fifo:
                ev = self.deferred_event = trio.Event()
                await ev.wait()
                continue
            n = len(fifo)
            try:
                await wait_durable(fifo[0][0])
                durable = durable_lsn()
            except Exception as exc:
                act = st.fail_held(n, exc)
            else:
                act = st.release(durable, None)
            self._act(act | FLUSH)

    async def pinger(self, interval: float) -> None:
        st = self.st
        while True:
            await trio.sleep(interval)
            act = st.idle_tick()
            if act & ABORT:
                self.server.log_limiter.log(
                    logging.INFO,
                    "idle-peer",
                    "closing connection from %s: no traffic for %.0fs despite pings",
                    self.peer,
                    st.idle_ticks * interval,
                )
                self.abort()
                return
            if act:
                self._act(act)

    def stop_sending(self, grace: float) -> None:
        """Let an in-progress send finish within ``grace`` seconds."""
        scope = self.send_scope
        if scope is not None:
            scope.deadline = min(scope.deadline, trio.current_time() + grace)

    def _fenced(self) -> Any:
        """The dispatcher's reply gate (``may_reply``, e.g. a cluster leader's self-fence:
        SCALE-OUT.md §4.4, layer 2, "re-checks before each reply batch"), asked as each
        reply, push or released held reply is queued: None while it holds (or without
        a gate), else the error to answer instead (``gate_refusal()``: NOT_LEADER). A
        leader stopped past its lease (SIGSTOP, a VM stall) that resumes computes
        answers from state another leader has moved on from: a read admitted before
        the deadline is not answered after it."""
        server = self.server
        gate = server.reply_gate
        if gate is None or gate():
            return None
        server._fenced_replies += 1
        return server.gate_refusal()

    def abort(self) -> None:
        self.st.close()
        self.stop_sending(0)
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    #: After a session's end, what is in flight gets this long (seconds) to be
    #: answered and written before the connection closes anyway.
    SESSION_END_S = 5.0

    def end_session(self, error: RallypointError) -> None:
        """The session's rights ended (the dispatcher refuses it: its key revoked, open
        mode over): its subscriptions end with ``error``, ``Err(0, error)`` says why, no
        more requests are taken (:meth:`ConnState.end_session`), and once what is in
        flight is answered and written the connection closes (:meth:`_end_when_idle`)."""
        act = self.st.end_session(error)
        if not act:
            return
        self._act(act)
        if self.nursery is not None:
            self.nursery.start_soon(self._end_when_idle)

    async def _end_when_idle(self) -> None:
        """After :meth:`end_session`: wait until nothing is in flight and the output is
        written (at most :attr:`SESSION_END_S`), then end the connection: waits still
        parked are answered the session's error, the reader's receive is cancelled, what
        is left is sent and the socket closed. (Not a drain's ``shutdown(SHUT_RD)``: a
        TLS stream that reads that EOF is broken and sends nothing more -- the Err 0
        was lost.)"""
        st = self.st
        with trio.move_on_after(self.SESSION_END_S):
            while st.busy():
                ev = self.idle_event = trio.Event()
                if not st.busy():
                    break
                await ev.wait()
        self._act(st.stop(st.ended or shutting_down_error()))
        self.stop_sending(1.0)
        if self.nursery is not None:
            self.nursery.cancel_scope.cancel()

    def begin_drain(self) -> None:
        act = self.st.drain()
        if self.nursery is not None:  # past the handshake: wake the reader's receive
            try:
                self.raw.socket.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        # a reader paused at the limits (wait_capacity) stops waiting and returns: the
        # requests it has not admitted are not taken, and the drain's grace for the
        # parked waits starts (else a connection paused with unread data held the stop
        # for the whole drain timeout; found by a hostile-peer run)
        self._act(act)

    async def reader(self) -> None:
        """Read and dispatch until EOF, a fatal framing error, or drain."""
        st = self.st
        stream = self.stream
        next_request = st.next_request
        submit = self._submit
        session = st.session
        need_data = NEED_DATA
        paused = PAUSED
        fd = self._fd  # a plain TCP socket: read with receive_plain
        full = False
        req = next_request()  # the frames pipelined after the hello first
        while True:
            while req is not need_data:
                if req is paused:
                    self._wake_writer()
                    await self.wait_capacity()
                    if not st.resume():
                        return  # draining: what is not admitted yet is not taken (begin_drain)
                else:
                    try:
                        submit(session, req.body, self, req.id)
                    except Exception as exc:  # the dispatcher answers its own errors; this is a bug
                        act = st.submit_failed(req.id, exc)
                        if act:
                            self._act(act)
                req = next_request()
            if st.out:
                if st.sending or self.writer_event is None:
                    self._wake_writer()
                else:
                    # The writer is idle: send this chunk's replies ourselves, saving a
                    # task switch per round trip. (take_output / sent inline: two calls
                    # per chunk were most of what a sequential request paid for the
                    # state machine; the reader is the task RESUME would wake)
                    data = st.out
                    st.out = bytearray()
                    n = st.sending = len(data)
                    try:
                        await stream.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        st.send_failed()
                        st.close()
                        st.stop_reading()
                        return
                    st.sending = 0
                    st.bytes_out += n
                    if st.out:
                        self._wake_writer()
            if st.parser.oversize is not None:
                self._act(st.frame_too_large())
                return
            if st.phase in DRAINING_PHASES:
                st.stop_reading()
                return
            if self.penalty_until:  # refused at a limit: not read for a while (see deliver)
                until, self.penalty_until = self.penalty_until, 0.0
                if until > trio.current_time():
                    self._wake_writer()  # (the answers so far go out meanwhile)
                    await trio.sleep_until(until)  # (at most 1 s: a drain waits that much more)
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
                st.receive_eof()
                return
            self._peer_quiet = True
            req = next_request(data)

    async def wait_capacity(self) -> None:
        st = self.st
        # Replies are made later, by the actors: the requests in flight will add about
        # inflight x (the connection's average reply size) to what waits to be sent.
        watch = self._fd is not None
        while st.at_limits():
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
        if not data and self.st.draining:
            # our own shutdown(SHUT_RD) (begin_drain), not the peer: the drain woke the
            # reader, and the parked waits keep the drain's grace
            return
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

    async def handshake(self) -> bool:
        """Read the Hello and answer it. True: the connection is open (the frames
        pipelined after the Hello are the reader's first chunk); False: it must close."""
        server = self.server
        st = self.st
        hello: Any = NEED_DATA
        waiting = server._hello_waits
        # (up to 10 % shorter at random: silent holders opened together are not all cut
        # in one instant; guard.spread)
        with trio.move_on_after(spread(server.handshake_timeout)) as self.hello_scope:
            waiting.add(self.addr, self, 0, self.accepted_at)  # (Server._evict_silent)
            try:
                while hello is NEED_DATA:
                    hello = st.receive_hello(await self.stream.receive_some(_RECEIVE_SIZE))
            finally:
                waiting.discard(self)
        self.hello_scope = None
        if hello is NEED_DATA:
            st.hello_timeout(server.handshake_timeout)
            return False
        if hello is REFUSED:
            return False
        try:
            session, hello_ok = server.dispatcher.hello(hello, self.peer)
        except RallypointError as exc:
            if exc.code in ("UNAUTHENTICATED", "FORBIDDEN"):
                server.log_limiter.log(
                    logging.WARNING, "auth-failed", "authentication failed for %s (client %r): %s",
                    self.peer, hello.client, exc.message,
                    extra={"event": "auth_failed", "peer": self.peer, "client": hello.client, "code": exc.code})
            st.refuse_hello(exc)
            return False
        except Exception as exc:
            st.refuse_hello(exc)
            return False
        st.accept_hello(session, hello_ok)
        return True

    async def send_rest(self, timeout: float = 5.0) -> None:
        """Best-effort send of what is queued (used when closing)."""
        st = self.st
        with trio.move_on_after(timeout):
            while st.sending:
                await trio.sleep(0.005)
            if st.out:
                data = st.take_output()
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    st.send_failed()
                else:
                    st.sent(len(data))

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
        st = self.st
        server._listen(True)
        try:
            if not await self.handshake():
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
                await self.reader()
                if st.draining:
                    # Finish in-flight requests and send their replies.
                    # Long server-side waits get drain_wait_grace to end on their own,
                    # then are answered UNAVAILABLE (the peer retries elsewhere), so a
                    # long poll does not hold the shutdown for up to a minute.
                    self.begin_drain()
                    grace_at: float | None = trio.current_time() + server.drain_wait_grace
                    with trio.move_on_after(server._drain_timeout):
                        while st.busy():
                            self.idle_event = trio.Event()
                            if not st.busy():
                                break
                            # (a request queued now may park later: the grace is kept
                            # whether or not a wait is parked at this moment)
                            with trio.move_on_at(grace_at if grace_at is not None else math.inf):
                                await self.idle_event.wait()
                            if grace_at is not None and trio.current_time() >= grace_at:
                                grace_at = None
                                # a wait parked from now on is answered at once
                                self._act(st.grace_over())
                # Waits still parked are ended; a peer that can still hear is told so.
                self._act(st.stop(st.ended or shutting_down_error()))
                self.stop_sending(1.0)
                nursery.cancel_scope.cancel()
            # Replies of requests cancelled by the close (best effort), oversize error.
            await self.send_rest(1.0)
            if st.parser.oversize is not None:
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
            # held answers dropped, parked waits and subscriptions ended unanswered
            st.finish()
            self.closed = True
            bye = getattr(server.dispatcher, "goodbye", None)
            if bye is not None and st.session is not None:  # (its space's connections limit)
                bye(st.session)
            if server._held is not None:
                server._held.pop(self, None)
            server._listen(False)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.stream)


class Server:
    """A rallypoint TCP server for one :class:`Dispatcher`.

    Args:
        dispatcher: the coordinator side (see :class:`Dispatcher`).
        max_connections: connections beyond this get ``Err(0, UNAVAILABLE)`` and are closed.
        max_connections_per_peer: connections one peer address (IP) may hold open at
            once; one more from it gets ``Err(0, UNAVAILABLE)`` naming this limit and is
            closed, while other addresses still connect. 0 or None: no cap.
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
        max_connections_per_peer: int | None = None,
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
        #: asked before each reply batch is written: the dispatcher's ``may_reply`` (a
        #: cluster leader's self-fence) or None (always)
        self.reply_gate = getattr(dispatcher, "may_reply", None)
        #: the error answered instead, past the gate (the dispatcher's ``refusal()``)
        self.gate_refusal = getattr(dispatcher, "refusal", None) or (
            lambda: UnavailableError("this node may not answer now; retry", retry_after=0.5))
        self._fenced_replies = 0
        # connections holding replies until the journal is durable past them, when the
        # dispatcher reports durability (add_durable_listener): released in the step
        # that learns of it; without it, each connection's durability task waits
        self._held: dict[_Conn, None] | None = (
            {} if getattr(dispatcher, "add_durable_listener", None) is not None else None)
        self._listening = 0  # connections running: the reports are heard while any is
        self.ssl_context = ssl_context  # an ssl.SSLContext: serve TLS
        self.max_connections = max_connections
        #: connections open per peer address (the accept loop takes a slot, the
        #: connection's end gives it back)
        self.peer_slots = PeerSlots(max_connections_per_peer)
        #: refusals of an address refused again held a second (RefusalPacer)
        self.pacer = RefusalPacer()
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
        #: failed accepts (EMFILE & co): back-off, one line per window with a count
        self.accept_failures = AcceptFailures(log, "TCP listener", window_s=log_window_s)
        self._slow_consumer_closes = 0
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
        self._evicting = 0  # evicted connections not closed yet (their slots are taken)
        #: connections waiting for their Hello, per peer address in accept order: the
        #: ones a full server may close for a new one (max-min fair: Evictable)
        self._hello_waits = Evictable(self.peer_slots, 1, 1.0)
        self._limit_pauses = 0
        self._silent_evicted = 0
        #: seconds a connection must have waited for its Hello before a full server may
        #: close it for a new one (:meth:`_evict_silent`)
        self.evict_silent_after_s = 1.0
        # a grant ended (a key revoked, open mode over) in the commit of this LSN: the
        # connections' rights are judged again once it is durable (_keep_sessions)
        self._grants_lsn = 0
        self._grants_event = trio.Event()
        #: connections closed because their session's rights ended
        self.sessions_ended = 0

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
        add_sessions = getattr(self.dispatcher, "add_session_listener", None)
        if add_sessions is not None:
            add_sessions(self._grant_ended)
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
                            if add_sessions is not None:
                                accept_nursery.start_soon(self._keep_sessions)
                            task_status.started(self.listeners)
                    # Draining: no new connections; connections finish in conn_nursery.
                    for listener in self.listeners:
                        with trio.CancelScope(shield=True):
                            await listener.aclose()
        finally:
            if add_sessions is not None:
                self.dispatcher.remove_session_listener(self._grant_ended)  # type: ignore[attr-defined]
            for listener in self.listeners:
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(listener)
            self.log_limiter.flush()  # report what was suppressed: no count is lost
            self.accept_failures.flush()
            self._stopped.set()

    async def drain(self, timeout: float = 30.0, wait_grace: float | None = None) -> None:
        """Graceful stop: stop accepting, let every connection finish its in-flight
        requests (up to ``timeout`` seconds; then they are cancelled and answered
        UNAVAILABLE), then close the connections. Returns when :meth:`serve` ends.

        ``wait_grace``: seconds parked waits (long-poll receives, results, acquires)
        get to end on their own before they are answered UNAVAILABLE (None: the
        server's ``drain_wait_grace``). A leader handing its shard over passes 0: the
        waits are re-issued to the new leader, and a grace would only delay it."""
        if wait_grace is not None:
            self.drain_wait_grace = wait_grace
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

    def connection_count(self) -> int:
        """The connections open now (``statistics()["connections"]``)."""
        return len(self._conns)

    def statistics(self) -> dict[str, Any]:
        """Counters: connections (open), connections_total, rejected_connections,
        requests, errors, internal_errors, bytes_in, bytes_out, inflight (now),
        outgoing_buffered (now), max_outgoing_buffered, max_inflight_per_conn_seen,
        max_parse_buffer, backpressure_pauses, discarded_bytes, peer_resets (connections
        the peer reset or dropped), log_lines_suppressed, sessions_ended (connections
        closed because their key was revoked or open mode ended), draining; accept_errors
        (failed accepts: EMFILE...), peers / max_per_peer / refused_per_peer (see
        :class:`~rallypoint.transport.guard.PeerSlots`), slow_consumer_closes
        (connections closed with replies unread past twice ``max_outgoing_bytes``),
        silent_evicted (connections that had sent no Hello, closed by a full server for a
        new one), limit_pauses (LIMIT_EXCEEDED answers after which the connection was not
        read for a while: :data:`LIMIT_PAUSE_S`)."""
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
        internal_errors = self._internal_errors
        for conn in self._conns:
            c = conn.st
            requests += c.requests
            errors += c.errors
            internal_errors += c.internal_errors
            bytes_in += c.bytes_in
            bytes_out += c.bytes_out
            max_out = max(max_out, c.max_out)
            max_inflight = max(max_inflight, c.max_inflight_seen)
            max_parse = max(max_parse, c.parser.buffered_max)
            pauses += c.pauses
            inflight += c.inflight
            buffered += len(c.out) + c.sending
        return {
            "connections": len(self._conns),
            "connections_total": self._connections_total,
            "rejected_connections": self._rejected,
            "silent_evicted": self._silent_evicted,
            "limit_pauses": self._limit_pauses,
            "requests": requests,
            "errors": errors,
            "internal_errors": internal_errors,
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
            "sessions_ended": self.sessions_ended,
            "draining": self._draining,
            "accept_errors": self.accept_failures.total,
            **self.peer_slots.statistics(),
            **self.pacer.statistics(),
            "slow_consumer_closes": self._slow_consumer_closes,
            "fenced_replies": self._fenced_replies,
        }

    # ---------------------------------------------------------------- internal

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        failures = self.accept_failures
        slots = self.peer_slots
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE & co: back off rather than spin, one line per window
                await failures.failed(exc)
                continue
            failures.succeeded()
            try:
                stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            addr = peer_address(stream.socket)
            if (len(self._conns) - self._evicting + self._starting >= self.max_connections
                    and not self._evict_silent(addr)):
                self._rejected += 1
                self._refuse(nursery, stream, addr)
                continue
            if not slots.take(addr):
                self._rejected += 1
                self.log_limiter.log(
                    logging.WARNING, "peer-limit", "refused a connection from %s: it has %d open "
                    "(--max-connections-per-peer)", addr, slots.cap)
                self._refuse(nursery, stream, addr, (
                    f"this address ({addr}) has {slots.cap} connections open, the limit per peer address "
                    "(--max-connections-per-peer); close one or retry later"))
                continue
            self._starting += 1
            nursery.start_soon(self._run_counted, stream, addr)

    def _evict_silent(self, addr: str) -> bool:
        """The server is full: close a connection that has waited for its Hello for at
        least :attr:`evict_silent_after_s` to make room for the one just accepted from
        ``addr`` -- the oldest of the address holding the most connections, if that is at
        least two more than ``addr`` holds (max-min fair:
        :class:`~rallypoint.transport.guard.Evictable`; issue 41 item 7: silent
        connections from many addresses, each under its cap, took every slot until their
        Hello time-out, and every new client was refused; closing the oldest of any
        address then let the attackers close one another's in a loop). True when one
        was closed."""
        waits = self._hello_waits
        waits.min_age_s = self.evict_silent_after_s
        return waits.pick(addr, trio.current_time(), self._close_silent)

    def _close_silent(self, conn: "_Conn", _rank: int) -> bool:
        if conn.hello_scope is None:
            return False
        now = trio.current_time()
        conn.evicted = True
        self._evicting += 1
        self._silent_evicted += 1
        conn.hello_scope.cancel()
        self.log_limiter.log(logging.INFO, "evict-silent", "connections full: closed %s, which sent no Hello in "
                             "%.1f s, for a new one", conn.peer, now - conn.accepted_at)
        return True

    def _refuse(self, nursery: trio.Nursery, stream: trio.SocketStream, addr: str, why: str | None = None) -> None:
        """Refuse ``stream`` (from ``addr``): ``Err(0, UNAVAILABLE)`` at once, or after the
        pacer's hold for an address refused again, or a reset at once when the hold is
        full (:meth:`~rallypoint.transport.guard.RefusalPacer.refuse`)."""
        self.pacer.refuse(nursery, stream, addr, self._reject, why)

    async def _reject(self, stream: trio.SocketStream, why: str | None = None) -> None:
        err = wire.Err(
            0,
            "UNAVAILABLE",
            why or f"the server has reached its limit of {self.max_connections} connections; retry later",
            1.0,
        )
        body = _encode(err)
        with trio.move_on_after(1.0):
            try:
                await stream.send_all(len(body).to_bytes(4, "big") + body)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        await trio.aclose_forcefully(stream)

    def _grant_ended(self, lsn: int) -> None:
        """The dispatcher's report: a grant ended (a key revoked, open mode over) in the
        commit of LSN ``lsn`` (being applied: no I/O here)."""
        if lsn > self._grants_lsn:
            self._grants_lsn = lsn
        self._grants_event.set()

    async def _keep_sessions(self) -> None:
        """Re-derive the connections' rights each time a grant ended, once its commit is
        durable: every connection the dispatcher now refuses (``session_error``) is told
        why and closed (:meth:`_Conn.end_session`) -- an idle one too, not only at its
        next request."""
        dispatcher = self.dispatcher
        while True:
            await self._grants_event.wait()
            self._grants_event = trio.Event()
            try:
                await dispatcher.wait_durable(self._grants_lsn)
            except Exception:  # the journal failed: the node stops, and so do its connections
                return
            for conn in list(self._conns):
                session = conn.st.session
                if session is None:
                    continue  # (its hello is judged against the key table when it comes)
                error = dispatcher.session_error(session)  # type: ignore[attr-defined]
                if error is not None and conn.st.ended is None:
                    self.sessions_ended += 1
                    self.log_limiter.log(
                        logging.INFO, "session-ended", "closing connection from %s: %s", conn.peer, error.message,
                        extra={"event": "session_ended", "peer": conn.peer,
                               "reason": (error.details or {}).get("reason")})
                    conn.end_session(error)

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

    async def _run_counted(self, stream: trio.SocketStream, addr: str) -> None:
        """:meth:`_run_conn`, then the connection's slot of its peer address is given back."""
        try:
            await self._run_conn(stream, addr)  # (no checkpoint before it: see _run_conn)
        finally:
            self.peer_slots.give(addr)

    async def _run_conn(self, stream: trio.SocketStream, addr: str = "?") -> None:
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
        conn.addr = addr
        self._conns.add(conn)
        self._connections_total += 1
        self._no_conns = trio.Event() if self._no_conns.is_set() else self._no_conns
        if self._draining:
            conn.st.drain()  # before the handshake: nothing to wake
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)
            if conn.evicted:
                self._evicting -= 1
            c = conn.st
            self._closed_requests += c.requests
            self._closed_errors += c.errors
            self._internal_errors += c.internal_errors
            self._closed_bytes_in += c.bytes_in
            self._closed_bytes_out += c.bytes_out
            self._max_out = max(self._max_out, c.max_out)
            self._max_inflight = max(self._max_inflight, c.max_inflight_seen)
            self._max_parse_buffer = max(self._max_parse_buffer, c.parser.buffered_max)
            self._pauses += c.pauses
            if c.overflowed:
                self._slow_consumer_closes += 1
            if not self._conns:
                self._no_conns.set()
