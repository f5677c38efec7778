"""One server-side connection as a sans-I/O state machine (h11's shape).

:class:`ConnState` is told what happens to a connection and answers what the connection
must do; it never touches a socket, a Trio primitive or a timer. It calls only what it
is handed: a parked waiter's or a subscription's ``cancel()``, the log limiter (an
internal error), ``clock`` (the latency metric). The socket loop around it is
:class:`rallypoint.transport.server._Conn` (reader and writer tasks,
``sockio.receive_plain``, the non-blocking ``os.write``, TLS, the drain's and the
pinger's timers, the paused reader's watch for a peer that goes away).

**In** (methods; those that can ask for something return an int of action bits, 0 for
nothing to do):

* the handshake: :meth:`receive_hello` (bytes, or ``b""`` for EOF), :meth:`hello_timeout`,
  :meth:`accept_hello` / :meth:`refuse_hello` (the dispatcher's verdict);
* bytes received: :meth:`next_request` with them, then without until it says
  :data:`NEED_DATA` (it returns each request to submit, or :data:`PAUSED` at the
  limits; :meth:`resume` once capacity is back), :meth:`receive_eof`,
  :meth:`stop_reading`, :meth:`frame_too_large`, :meth:`submit_failed`;
* output written: :meth:`take_output` + :meth:`sent` / :meth:`send_failed` (a send of
  the whole buffer), :meth:`wrote` (a non-blocking write of part of it);
* the actors' answers (the ``ReplySink`` calls): :meth:`deliver`, :meth:`track`,
  :meth:`untrack`, :meth:`note_op`; subscriptions: :meth:`add_stream`,
  :meth:`push_room`, :meth:`push`, :meth:`push_encoded`, :meth:`end_stream`;
* durability advances: :meth:`release` (the journal is durable past an LSN, or never
  will be), :meth:`fail_held` (a durability wait failed);
* drain and timer instants: :meth:`drain`, :meth:`grace_over` (the drain's grace for
  parked waits ran out), :meth:`idle_tick` (a ping interval passed); the session's
  rights ending (its key revoked): :meth:`end_session` (a drain that says why);
* the end: :meth:`stop` (answer the parked waits, then close), :meth:`close`,
  :meth:`finish`.

**Out**: the frames to write are :attr:`ConnState.out`, a bytearray the wrapper sends
(a sender that takes it whole puts a new one in its place, sets :attr:`~ConnState.sending`
to the bytes taken while the send runs, then adds them to ``bytes_out``: what
:meth:`take_output` and :meth:`sent` do, and what the reader does inline after a chunk);
requests to submit come back from :meth:`next_request`; everything else is a bit of the
returned int: :data:`WRITE` (wake the writer), :data:`FLUSH` (write now, without
blocking), :data:`RESUME` (a paused reader may read again), :data:`HOLD` (an answer is
held until the journal is durable past its LSN), :data:`IDLE` (draining, and nothing
is left in flight or queued), :data:`WATCH` (output left: subscriptions waiting for
room may push), :data:`ABORT` (close the connection now).

**States.** Two machines, each an enum with an explicit transitions table (a trigger
the table does not list for the current state raises :class:`ConnStateError`):

* :class:`Phase`, the lifecycle::

      HANDSHAKE ──HELLO_OK──▶ OPEN ──DRAIN──▶ DRAINING ──GRACE_OVER──▶ REFUSING_WAITS
          │DRAIN                                  (every state but CLOSED) ──CLOSE──▶ CLOSING
          ▼                                                         CLOSING ──FINISH──▶ CLOSED
      HANDSHAKE_DRAINING ──HELLO_OK──▶ DRAINING

  OPEN serves requests; DRAINING reads no more requests and lets in-flight ones finish,
  parked waits having ``drain_wait_grace``; REFUSING_WAITS answers the waits still
  parked UNAVAILABLE and refuses new ones; CLOSING queues no more answers (the peer went
  away, a fatal framing error, an abort, the drain's end); CLOSED is a closed
  ``ReplySink`` (answers are dropped).
* :class:`Reading`, the reader::

      RECEIVING ──DATA──▶ HANDLING ──CHUNK_DONE──▶ RECEIVING
                           │FULL  ▲ROOM
                           ▼      │
                           PAUSED       (any) ──STOP──▶ STOPPED

  HANDLING: a received chunk is being handled, its replies accumulate and the reader
  sends them after it (no writer wake-up per reply); PAUSED: over the limits (requests
  in flight, or the bytes their replies will take), not reading.

**Where the bytes are made.** Every frame the server writes is framed by the
``_queue_*`` methods at the end of the class (one place: a reply stamp or another
answer code belongs there).
"""

from __future__ import annotations

import enum
import logging
import secrets
import struct as _struct
import time
from bisect import bisect_left as _bisect
from collections import deque
from typing import Any, Callable

import msgspec

from .. import wire
from ..errors import (
    InternalError,
    LimitError,
    RallypointError,
    SlowConsumerError,
    UnavailableError,
    ValidationError,
    shutting_down_error,
)
from ..metrics import LATENCY_BOUNDS as _LATENCY_BOUNDS
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

__all__ = [
    "ABORT",
    "FLUSH",
    "HOLD",
    "IDLE",
    "NEED_DATA",
    "PAUSED",
    "REFUSED",
    "RESUME",
    "WATCH",
    "WRITE",
    "ConnState",
    "ConnStateError",
    "Phase",
    "Reading",
    "Trigger",
]


# ----------------------------------------------------------------------------- states
class Phase(enum.Enum):
    """The lifecycle of a connection (see the module doc for the transitions)."""

    __hash__ = object.__hash__  # members are singletons: identity hash (Enum's is in Python)

    HANDSHAKE = "handshake"
    HANDSHAKE_DRAINING = "handshake-draining"
    OPEN = "open"
    DRAINING = "draining"
    REFUSING_WAITS = "refusing-waits"
    CLOSING = "closing"
    CLOSED = "closed"


class Reading(enum.Enum):
    """What the connection's reader is doing (see the module doc)."""

    __hash__ = object.__hash__

    RECEIVING = "receiving"
    HANDLING = "handling"
    PAUSED = "paused"
    STOPPED = "stopped"


class Trigger(enum.Enum):
    """What moves a :class:`Phase` or a :class:`Reading` state."""

    __hash__ = object.__hash__

    # Phase
    HELLO_OK = "hello-ok"
    DRAIN = "drain"
    GRACE_OVER = "grace-over"
    CLOSE = "close"
    FINISH = "finish"
    # Reading
    DATA = "data"
    FULL = "full"
    ROOM = "room"
    CHUNK_DONE = "chunk-done"
    STOP = "stop"


HANDSHAKE, HANDSHAKE_DRAINING, OPEN, DRAINING, REFUSING_WAITS, CLOSING, CLOSED = Phase
RECEIVING, HANDLING, PAUSED_READING, STOPPED = Reading
T = Trigger

#: (phase, trigger) -> next phase. Anything else raises ConnStateError.
PHASE_TRANSITIONS: dict[tuple[Phase, Trigger], Phase] = {
    (HANDSHAKE, T.HELLO_OK): OPEN,
    (HANDSHAKE, T.DRAIN): HANDSHAKE_DRAINING,
    (HANDSHAKE, T.CLOSE): CLOSING,
    (HANDSHAKE_DRAINING, T.HELLO_OK): DRAINING,
    (HANDSHAKE_DRAINING, T.DRAIN): HANDSHAKE_DRAINING,
    (HANDSHAKE_DRAINING, T.CLOSE): CLOSING,
    (OPEN, T.DRAIN): DRAINING,
    (OPEN, T.CLOSE): CLOSING,
    (DRAINING, T.DRAIN): DRAINING,
    (DRAINING, T.GRACE_OVER): REFUSING_WAITS,
    (DRAINING, T.CLOSE): CLOSING,
    (REFUSING_WAITS, T.DRAIN): REFUSING_WAITS,
    (REFUSING_WAITS, T.CLOSE): CLOSING,
    (CLOSING, T.DRAIN): CLOSING,  # a drain reaches every connection, closing ones too
    (CLOSING, T.CLOSE): CLOSING,
    (CLOSING, T.FINISH): CLOSED,
    (CLOSED, T.DRAIN): CLOSED,  # closed, not yet removed from the server's set
    (CLOSED, T.CLOSE): CLOSED,
}

#: (reading state, trigger) -> next reading state. Anything else raises ConnStateError.
READING_TRANSITIONS: dict[tuple[Reading, Trigger], Reading] = {
    (RECEIVING, T.DATA): HANDLING,
    (RECEIVING, T.STOP): STOPPED,
    (HANDLING, T.FULL): PAUSED_READING,
    (HANDLING, T.CHUNK_DONE): RECEIVING,
    (HANDLING, T.STOP): STOPPED,
    (PAUSED_READING, T.ROOM): HANDLING,
    (PAUSED_READING, T.STOP): STOPPED,
    (STOPPED, T.STOP): STOPPED,
}

# The tables by trigger: {trigger: {state: next state}} (a lookup keyed by a state is
# one identity-hashed dict access, cheap enough for the per-chunk transitions).
_PHASE_ON: dict[Trigger, dict[Phase, Phase]] = {}
for (_s, _t), _n in PHASE_TRANSITIONS.items():
    _PHASE_ON.setdefault(_t, {})[_s] = _n
_READING_ON: dict[Trigger, dict[Reading, Reading]] = {}
for (_s, _t), _n in READING_TRANSITIONS.items():
    _READING_ON.setdefault(_t, {})[_s] = _n
del _s, _t, _n
for _t in Trigger:
    _PHASE_ON.setdefault(_t, {})
    _READING_ON.setdefault(_t, {})
# (an Enum class attribute costs a Python-level lookup: the hot paths use these)
_HELLO_OK, _DRAIN, _GRACE_OVER, _CLOSE, _FINISH, _DATA, _FULL, _ROOM, _CHUNK_DONE, _STOP = Trigger
_ON_DATA = _READING_ON[_DATA]
_ON_FULL = _READING_ON[_FULL]
_ON_CHUNK_DONE = _READING_ON[_CHUNK_DONE]
_ON_ROOM = _READING_ON[_ROOM]

#: Phases in which nothing more is answered (the peer is gone, or we close).
NO_ANSWER_PHASES = frozenset({CLOSING, CLOSED})
#: Phases of a drain that still answers (in-flight requests finish).
DRAINING_PHASES = frozenset({DRAINING, REFUSING_WAITS})
_HANDSHAKE_PHASES = frozenset({HANDSHAKE, HANDSHAKE_DRAINING})


class ConnStateError(InternalError):
    """INTERNAL: a trigger the transitions table does not allow in the current state (a
    bug in the server's connection handling; the connection fails and logs it)."""


# ---------------------------------------------------------------------------- actions
#: Output is queued outside a received chunk: wake the writer task.
WRITE = 1
#: Output is queued (a push, released answers): write it now without blocking; the
#: writer takes what does not fit.
FLUSH = 2
#: The reader is paused and something changed (a request finished, output left): wake
#: it to re-check the limits.
RESUME = 4
#: An answer is held until the journal is durable past its LSN: have it released.
HOLD = 8
#: Draining, and nothing is in flight: the drain may end.
IDLE = 16
#: Output left the process: subscriptions waiting for room may push again.
WATCH = 32
#: Close the connection now (its peer stopped answering pings).
ABORT = 64


class _Sentinel:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: :meth:`ConnState.next_request`: the received bytes are handled; read more.
NEED_DATA = _Sentinel("NEED_DATA")
#: :meth:`ConnState.next_request`: at the limits; wait for capacity, then :meth:`~ConnState.resume`.
PAUSED = _Sentinel("PAUSED")
#: :meth:`ConnState.receive_hello`: the connection must close (an error may be queued).
REFUSED = _Sentinel("REFUSED")

_GONE = object()  # not in flight
_CANCELLED = object()  # the client sent Cancel before the request parked

# ---------------------------------------------------------------------------- framing
_encoder = msgspec.msgpack.Encoder()
_encode_into = _encoder.encode_into
_client_decode = msgspec.msgpack.Decoder(wire.ClientFrame).decode
_request_decode = msgspec.msgpack.Decoder(wire.Request).decode

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
_ok_head32 = _struct.Struct(">I10sI5s").pack
_ok_head64 = _struct.Struct(">I10sQ5s").pack

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


def _new_ref() -> str:
    return secrets.token_hex(4)


_log = logging.getLogger("rallypoint.transport")


class ConnState:
    """The state of one server-side connection, with no I/O (see the module doc).

    Args:
        peer: ``"host:port"`` of the peer (log lines, metrics).
        durable_lsn: ``() -> int``, the journal's durable LSN now (a read, no I/O): an
            answer whose LSN is above it is held (:data:`HOLD`).
        max_inflight: requests in flight (admitted, not yet answered; each request of a
            batch frame counts) before :meth:`next_request` says :data:`PAUSED`.
        max_out_bytes: bytes of output, queued or being sent plus what the requests in
            flight will add (in flight x the reply size estimate: the largest recent
            reply, decaying towards the average), before it says :data:`PAUSED`. The
            replies of requests already in flight may take the unsent output past it;
            past :attr:`hard_out_bytes` (twice it, and at least it plus one frame) the
            peer is not reading what it asked for: the queued replies are dropped, the
            connection is answered ``Err(0, SLOW_CONSUMER)`` and closed (:data:`ABORT`).
        watch_buffer_bytes: unsent output up to which subscriptions may push
            (:meth:`push_room`).
        metrics: a :class:`rallypoint.metrics.Metrics` (latency per operation), or None.
        log_limiter: where internal errors are logged (a
            :class:`rallypoint.logutil.RateLimitedLogger`); None logs to the module logger.
        clock: ``() -> float`` seconds, read only for the latency metric (receipt and
            reply instants); default ``time.perf_counter``.

    Raises:
        ConnStateError: (code INTERNAL) from any input the current state does not allow.
    """

    def __init__(
        self,
        *,
        peer: str = "?",
        durable_lsn: Callable[[], int] = lambda: 0,
        max_inflight: int = 256,
        max_out_bytes: int = 4 * 1024 * 1024,
        watch_buffer_bytes: int = 1 << 20,
        metrics: Any = None,
        log_limiter: Any = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.peer = peer
        self.phase: Phase = HANDSHAKE
        self.reading: Reading = RECEIVING
        self.session: Any = None
        self.parser = FrameParser()
        #: Frames to write (the wrapper sends them; see take_output / wrote).
        self.out = bytearray()
        #: Bytes taken by take_output and not yet reported sent.
        self.sending = 0
        # Received, not yet handled: frames (memoryview), requests of a batch frame
        # (wire.Request), and the undecodable requests of a bad batch ((raw, exc, prefix)),
        # in the order they are handled.
        self.pending: deque = deque()
        self.inflight = 0
        self.max_inflight = max_inflight
        self.max_out_bytes = max_out_bytes
        #: unsent output past which the connection is closed (see max_out_bytes)
        self.hard_out_bytes = max(2 * max_out_bytes, max_out_bytes + _MAX_FRAME)
        self.watch_buffer_bytes = watch_buffer_bytes
        self.reply_size = 4096  # estimate of this connection's reply sizes, bytes (a cautious start; _queue_ok)
        # request id -> None (queued or being handled), its parked Waiter, or _CANCELLED
        # (the client sent Cancel before it parked): every request not yet answered
        self.live: dict[int, Any] = {}
        # subscriptions (events.watch) of this connection: request id -> Watcher
        self.streams: dict[int, Any] = {}
        #: the error that ended this connection's session (its key revoked, open mode
        #: over: :meth:`end_session`), its last answer; None otherwise
        self.ended: RallypointError | None = None
        # answers held until the journal is durable: (lsn, rid, reply), in LSN order
        self.deferred: deque[tuple[int, int, Any]] = deque()
        # metrics: request id -> (receipt time, op), while it is answered
        self.req_meta: dict[int, Any] = {}
        self._durable_lsn = durable_lsn
        self._metrics = metrics
        self._log_limiter = log_limiter
        self._clock = clock
        self.t_rx = clock()
        # pings (idle_tick); the peer's own pings (a client that checks its link
        # sends one while its calls wait: gone())
        self.pings_in = 0
        self.rx_count = 0
        self._rx_seen = 0
        self.idle_ticks = 0
        self._ping_nonce = 0
        # statistics
        self.requests = 0
        self.errors = 0
        self.internal_errors = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.max_out = 0
        self.max_inflight_seen = 0
        self.pauses = 0
        self.pushes = 0
        self.overflowed = 0  # bytes of unsent output when closed past hard_out_bytes (0: never)

    def __repr__(self) -> str:
        return (f"<ConnState {self.peer} {self.phase.name} reading={self.reading.name} inflight={self.inflight} "
                f"out={len(self.out)} held={len(self.deferred)}>")

    # ------------------------------------------------------------- transitions
    def _to(self, trigger: Trigger) -> None:
        try:
            self.phase = _PHASE_ON[trigger][self.phase]
        except KeyError:
            raise ConnStateError(
                f"connection {self.peer}: {trigger.name} is not allowed in phase {self.phase.name} "
                "(a bug in the server; report it)") from None

    def _read(self, trigger: Trigger) -> None:
        try:
            self.reading = _READING_ON[trigger][self.reading]
        except KeyError:
            raise ConnStateError(
                f"connection {self.peer}: {trigger.name} is not allowed while the reader is "
                f"{self.reading.name} (a bug in the server; report it)") from None

    @property
    def draining(self) -> bool:
        """A drain runs and answers still go out (DRAINING or REFUSING_WAITS)."""
        return self.phase in DRAINING_PHASES

    @property
    def closing(self) -> bool:
        """Nothing more is answered (CLOSING or CLOSED)."""
        return self.phase in NO_ANSWER_PHASES

    def busy(self) -> bool:
        """Requests in flight, or output not yet written."""
        return bool(self.inflight or self.out or self.sending)

    def idle(self) -> bool:
        """Draining with nothing in flight, queued or being sent: the drain may end."""
        return (self.phase in DRAINING_PHASES and self.inflight == 0 and not self.out
                and not self.sending)

    def _wake(self) -> int:
        """WRITE, unless the reader is handling a chunk (it sends the chunk's output)."""
        return 0 if self.reading is HANDLING else WRITE

    def _done(self, n: int = 1) -> int:
        """``n`` requests finished."""
        self.inflight -= n
        act = RESUME if self.reading is PAUSED_READING else 0
        if self.inflight == 0 and self.phase in DRAINING_PHASES:
            act |= IDLE
        return act

    # --------------------------------------------------------------- handshake
    def receive_hello(self, data: bytes) -> Any:
        """Bytes received before the Hello was answered (``b""``: EOF). Returns the
        :class:`wire.Hello` to authenticate (then :meth:`accept_hello` or
        :meth:`refuse_hello`), :data:`NEED_DATA`, or :data:`REFUSED`: close (an answer
        saying why may be queued). Frames pipelined after the Hello are kept and handled
        once it is accepted."""
        if self.phase not in _HANDSHAKE_PHASES:
            raise ConnStateError(f"connection {self.peer}: a hello is not expected in phase {self.phase.name}")
        if not data:
            self._to(_CLOSE)
            return REFUSED
        self.bytes_in += len(data)
        parser = self.parser
        frames = parser.feed(data)
        if not frames:
            if parser.oversize is None:
                return NEED_DATA
            return self._refuse(ValidationError(oversize_message(parser.oversize)))
        try:
            hello = _client_decode(frames[0])
        except msgspec.MsgspecError as exc:
            return self._refuse(ValidationError(f"the first frame must be a hello: {exc}"))
        except RecursionError:
            return self._refuse(ValidationError(f"the first frame must be a hello: {NESTING_MESSAGE}"))
        if type(hello) is not _Hello:
            return self._refuse(ValidationError(
                f"the first frame must be a hello (t='hello'), got {type(hello).__name__}; field `$.t`"))
        if hello.version != wire.PROTOCOL_VERSION:
            return self._refuse(ValidationError(
                f"protocol version mismatch: the client speaks version {hello.version}, this server "
                f"speaks version {wire.PROTOCOL_VERSION}; upgrade the older side",
                details={"client_version": hello.version, "server_version": wire.PROTOCOL_VERSION},
            ))
        self.pending.extend(frames[1:])
        return hello

    def _refuse(self, exc: BaseException) -> Any:
        self.refuse_hello(exc)
        return REFUSED

    def hello_timeout(self, seconds: float) -> int:
        """No Hello within ``seconds`` of connecting: answer UNAVAILABLE and close."""
        self.refuse_hello(UnavailableError(f"no hello within {seconds:g}s of connecting; closing"))
        return WRITE

    def accept_hello(self, session: Any, hello_ok: msgspec.Struct) -> int:
        """The dispatcher accepted the Hello: answer ``hello_ok``; the frames pipelined
        after the Hello are the reader's first chunk (:meth:`next_request`)."""
        self._to(_HELLO_OK)
        self.session = session
        self._queue_msg(hello_ok)
        self._read(_DATA)
        return 0

    def refuse_hello(self, exc: BaseException) -> int:
        """The Hello is refused with ``exc`` (a RallypointError is the answer; any
        other exception is answered INTERNAL and logged): close."""
        if isinstance(exc, RallypointError):
            self._queue_error(0, exc)
        else:
            self._queue_internal(0, exc)
        self._to(_CLOSE)
        return WRITE

    # ----------------------------------------------------------------- reading
    def next_request(self, data: bytes | None = None) -> Any:
        """Handle what was received, up to the next request to submit. ``data``: a chunk
        just received from the peer (not empty: EOF is :meth:`receive_eof`), handled
        after what is left; None: go on. Returns:

        * a :class:`wire.Request`: admitted (in flight); submit it, and on an exception
          from the dispatcher call :meth:`submit_failed`;
        * :data:`PAUSED`: at the limits, nothing more is admitted; wait until a request
          finishes or output leaves (:data:`RESUME`), then call :meth:`resume`;
        * :data:`NEED_DATA`: everything received is handled; send the output, read more.

        The limits are checked after each frame and each request of a batch frame (a
        request may be answered while it is submitted), so before every call but the
        one that brings a chunk. Control frames (Ping, Cancel, a batch frame, a second
        Hello, an undecodable frame) are handled here and answered in :attr:`out`."""
        pending = self.pending
        if data is not None:
            if self.reading is RECEIVING:  # the table's one DATA transition, inline
                self.reading = HANDLING
            else:
                self._read(_DATA)  # raises
            self.rx_count += 1
            self.bytes_in += len(data)
            self.t_rx = self._clock()  # (also: is the peer still there? gone())
            pending.extend(self.parser.feed(data))
        else:
            inflight = self.inflight
            if inflight >= self.max_inflight or len(self.out) + self.sending + inflight * self.reply_size > self.max_out_bytes:
                return self._pause()
        while True:
            if not pending:
                if self.reading is HANDLING:  # the table's one CHUNK_DONE transition, inline
                    self.reading = RECEIVING
                else:
                    self._read(_CHUNK_DONE)  # raises
                return NEED_DATA
            req = pending.popleft()
            t = type(req)
            if t is memoryview:
                try:
                    req = _client_decode(req)
                except (msgspec.MsgspecError, RecursionError) as exc:
                    self._bad_frame(req, exc)
                    req = None
                else:
                    t = type(req)
                    if t is not _Request:
                        self._control(req, t)
                        req = None
            elif t is tuple:  # an undecodable request of a bad batch
                self._reject(*req)
                req = None
            if req is not None:  # a request: admit it
                rid = req.id
                self.requests += 1
                live = self.live
                if rid <= 0:
                    self._queue_error(0, ValidationError(f"request id must be > 0, got {rid}; field `$.id`"))
                elif rid in live:
                    self._queue_error(rid, ValidationError(
                        f"request id {rid} is already in flight on this connection; use a new id per request; "
                        "field `$.id`"))
                else:
                    live[rid] = None
                    inflight = self.inflight = self.inflight + 1
                    if inflight > self.max_inflight_seen:
                        self.max_inflight_seen = inflight
                    return req
            # handled without a request to submit: the limits, as after a request
            inflight = self.inflight
            if inflight >= self.max_inflight or len(self.out) + self.sending + inflight * self.reply_size > self.max_out_bytes:
                return self._pause()

    def _pause(self) -> Any:
        self._read(_FULL)
        self.pauses += 1
        return PAUSED

    def resume(self) -> bool:
        """The paused reader got capacity back (or a drain began). True: go on with
        :meth:`next_request`; False: reading stopped (a drain takes no more requests)."""
        if self.phase in DRAINING_PHASES:
            self._read(_STOP)
            return False
        self._read(_ROOM)
        return True

    def at_limits(self) -> bool:
        """A paused reader must stay paused: over a limit, and not draining."""
        inflight = self.inflight
        return self.phase not in DRAINING_PHASES and (
            inflight >= self.max_inflight or len(self.out) + self.sending + inflight * self.reply_size > self.max_out_bytes)

    def submit_failed(self, rid: int, exc: BaseException) -> int:
        """The dispatcher raised while taking request ``rid`` (it answers its own errors,
        so this is a bug): answer INTERNAL (logged with a reference)."""
        if self.live.pop(rid, _GONE) is _GONE:
            return 0
        self._queue_internal(rid, exc)
        return self._wake() | self._done(1)

    def receive_eof(self) -> None:
        """The peer sent EOF (a half-close included): no more requests are read."""
        self._read(_STOP)

    def stop_reading(self) -> None:
        """The reader stops (a drain reads no more requests; its send failed)."""
        self._read(_STOP)

    def frame_too_large(self) -> int:
        """The parser met a length header over the frame limit: framing is lost. Answer
        VALIDATION_FAILED (id 0) and close."""
        self._queue_error(0, ValidationError(oversize_message(self.parser.oversize or 0)))
        self._to(_CLOSE)
        self._read(_STOP)
        return WRITE

    def _control(self, msg: Any, t: type) -> None:
        if t is _Batch:
            # each request of a batch counts against the limits like a single one:
            # next_request admits them one by one, before the next frame
            self.pending.extendleft(reversed(msg.reqs))
        elif t is _Cancel:
            self._cancel_wait(msg.id)
        elif t is _Ping:
            self.pings_in += 1
            self._queue_msg(_Pong(msg.nonce))
        elif t is _Hello:
            self._queue_error(0, ValidationError("hello sent twice: the connection is already open; field `t`"))
        # Pong: nothing to do (receiving it counted as traffic)

    def _bad_frame(self, frame: memoryview, exc: BaseException) -> None:
        """A frame with intact framing but a bad envelope (ill-typed, not msgpack, or
        nested too deeply for the decoder): answer VALIDATION_FAILED, keep the
        connection. A batch's requests are answered each on its own, in order."""
        if isinstance(exc, (msgspec.ValidationError, RecursionError)):
            reqs = split_batch(frame)  # iterative: no recursion however deep the data
            if reqs is not None:
                items = []
                for i, raw in enumerate(reqs):
                    try:
                        items.append(_request_decode(raw))
                    except (msgspec.MsgspecError, RecursionError) as rexc:
                        items.append((raw, rexc, f"$.reqs[{i}]"))
                self.pending.extendleft(reversed(items))
                return
        self._reject(frame, exc)

    def _reject(self, data: Any, exc: BaseException, prefix: str = "") -> None:
        """Answer a frame (or a batch's request at ``prefix``) that failed to decode with
        ``Err(id, VALIDATION_FAILED)``, the id salvaged from it when it has one (else 0)."""
        rid = salvage_request_id(data)
        if isinstance(exc, RecursionError):
            where = f" at `{prefix}`" if prefix else ""
            self._queue_error(rid, ValidationError(f"invalid frame{where}: {NESTING_MESSAGE}"))
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
        self._queue_error(rid, ValidationError(message))

    # ------------------------------------------------------------------ output
    def take_output(self) -> bytearray:
        """Take every queued frame to send it whole; report :meth:`sent` or
        :meth:`send_failed`."""
        data = self.out
        self.out = bytearray()
        self.sending = len(data)
        return data

    def sent(self, n: int) -> int:
        """The ``n`` bytes of :meth:`take_output` were sent."""
        self.sending = 0
        self.bytes_out += n
        act = RESUME if self.reading is PAUSED_READING else 0
        if self.streams:
            act |= WATCH
        return act

    def send_failed(self) -> None:
        """The send of :meth:`take_output`'s bytes failed (the wrapper closes)."""
        self.sending = 0

    def wrote(self, n: int) -> int:
        """A non-blocking write took the first ``n`` bytes of :attr:`out`."""
        act = 0
        if n:
            self.bytes_out += n
            out = self.out
            if n == len(out):
                self.out = bytearray()
            else:
                del out[:n]
            if self.reading is PAUSED_READING:
                act = RESUME
            if self.streams:
                act |= WATCH
        if self.out:
            act |= WRITE
        elif self.inflight == 0 and self.phase in DRAINING_PHASES:
            act |= IDLE
        return act

    # --------------------------------------------------------------- ReplySink
    def note_op(self, rid: int, tag: str, request: Any = None) -> None:
        """The dispatcher decoded request ``rid``: operation ``tag``, the Struct
        ``request`` (for the metrics: receipt time and operation, until it is answered;
        the Struct tells the slow-request log whether its client asked it to wait)."""
        if self._metrics is not None:
            self.req_meta[rid] = (self.t_rx, tag, request)

    def deliver(self, rid: int, reply: Any, lsn: int) -> int:
        """An actor's answer to request ``rid`` (encoded reply bytes, a RallypointError,
        or another exception: INTERNAL), depending on the journal being durable past
        ``lsn``: queued at once when it is (the dispatcher flushes at the end of its
        batch), else held (:data:`HOLD`, then :meth:`release`). Dropped when the
        request is no longer in flight, was cancelled, or the connection is closing."""
        state = self.live.pop(rid, _GONE)
        if state is _GONE:
            return 0  # already answered (e.g. a wait answered UNAVAILABLE at drain)
        if state is _CANCELLED or self.phase in NO_ANSWER_PHASES:
            if self.req_meta:
                self.req_meta.pop(rid, None)
            return self._done(1)
        if lsn <= self._durable_lsn():
            if type(reply) is bytes:
                self._queue_ok(rid, reply)
            else:
                self._queue_failure(rid, reply)
            if self.req_meta:
                self._observe(rid, reply)
            # _done(1), inline: this is the path of every answer
            inflight = self.inflight = self.inflight - 1
            act = RESUME if self.reading is PAUSED_READING else 0
            if inflight == 0 and self.phase in DRAINING_PHASES:
                act |= IDLE
            if len(self.out) + self.sending > self.hard_out_bytes:
                return act | self._overflow()
            return act
        self.deferred.append((lsn, rid, reply))
        return HOLD

    def track(self, rid: int, waiter: Any) -> int:
        """Request ``rid`` parked ``waiter`` (``waiter.cancel()`` ends it unanswered):
        a Cancel frame or the close ends it. Refused (cancelled at once) when the
        client already cancelled it, when closing, and past the drain's grace (then
        answered UNAVAILABLE)."""
        live = self.live
        phase = self.phase
        if live.get(rid, _GONE) is _CANCELLED or phase in NO_ANSWER_PHASES or phase is REFUSING_WAITS:
            waiter.cancel()
            if live.pop(rid, _GONE) is _GONE:
                return 0
            act = 0
            if phase is REFUSING_WAITS:
                self._queue_error(rid, self._stop_answer())
                act = self._wake()
            return act | self._done(1)
        if rid in live:
            live[rid] = waiter
        return 0

    def untrack(self, rid: int) -> None:
        """Request ``rid``'s wait is over (its answer follows)."""
        state = self.live.get(rid)
        if state is not None and state is not _CANCELLED:
            self.live[rid] = None

    def _cancel_wait(self, rid: int) -> int:
        """A Cancel frame: end request ``rid``'s server-side wait, or subscription
        ``rid``; no answer is sent."""
        w = self.streams.pop(rid, None)
        if w is not None:
            w.cancel()
            return 0
        state = self.live.get(rid, _GONE)
        if state is _GONE or state is _CANCELLED:
            return 0
        if state is None:  # not parked (yet): ends when it parks; its answer is dropped
            self.live[rid] = _CANCELLED
            return 0
        del self.live[rid]
        self.req_meta.pop(rid, None)
        state.cancel()
        # (handled inside next_request: the reader is not paused, and no drain waits
        # for IDLE while the reader runs -- it re-checks busy() when it starts)
        return self._done(1)

    def _end_waits(self, answer: RallypointError | None) -> int:
        """End every parked wait; ``answer`` it (None: no answer)."""
        act = 0
        live = self.live
        for rid, state in list(live.items()):
            if state is None or state is _CANCELLED:
                continue
            del live[rid]
            state.cancel()
            if answer is not None:
                self._queue_error(rid, answer)
                act |= self._wake()
                if self.req_meta:
                    self._observe(rid, answer)
            else:
                self.req_meta.pop(rid, None)
            act |= self._done(1)
        return act

    # subscriptions ------------------------------------------------------------
    def add_stream(self, rid: int, watcher: Any) -> bool:
        """Request ``rid`` became a subscription (``watcher.cancel()`` ends it). False
        when closing."""
        if self.phase in NO_ANSWER_PHASES:
            return False
        self.streams[rid] = watcher
        return True

    def push_room(self, rid: int) -> int:
        """Bytes that pushes may still queue: the watch buffer minus this connection's
        unsent output (replies and pushes alike); 0 when closing."""
        if self.phase in NO_ANSWER_PHASES:
            return 0
        return self.watch_buffer_bytes - len(self.out) - self.sending

    def push(self, rid: int, events: list, cursor: int) -> int:
        """Queue one Push frame of ``events`` (encoded bytes each; ``cursor``: the seq
        scanned up to): :data:`FLUSH`."""
        return self._queue_push(rid, _array_header(len(events)), events, cursor)

    def push_encoded(self, rid: int, n: int, array: bytes, cursor: int) -> int:
        """One Push frame whose ``n`` events are already one encoded msgpack array."""
        return self._queue_push(rid, array, (), cursor)

    def end_stream(self, rid: int, error: Any) -> int:
        """The server ends subscription ``rid`` with ``error`` (its final answer)."""
        if self.streams.pop(rid, None) is not None and self.phase not in NO_ANSWER_PHASES:
            self._queue_error(rid, error)
            return self._wake()
        return 0

    # -------------------------------------------------------------- durability
    def release(self, durable: int, error: RallypointError | None) -> int:
        """The journal is durable past ``durable`` (or, with ``error``, will get no
        further): queue every held answer it covers, in order, and ``error`` for the
        rest. When closing, held answers are dropped."""
        fifo = self.deferred
        if self.phase in NO_ANSWER_PHASES:
            fifo.clear()
            return 0
        n = 0
        while fifo and (fifo[0][0] <= durable or error is not None):
            lsn, rid, reply = fifo.popleft()
            n += 1
            reply = reply if lsn <= durable else error
            if type(reply) is bytes:
                self._queue_ok(rid, reply)
            else:
                self._queue_failure(rid, reply)
            if self.req_meta:
                self._observe(rid, reply)
        if n:
            act = self._done(n) | FLUSH
            if len(self.out) + self.sending > self.hard_out_bytes:
                act |= self._overflow()
            return act
        return 0

    def _overflow(self) -> int:
        """The unsent output passed :attr:`hard_out_bytes`: the peer does not read the
        replies it asked for. Drop the queued ones (not what is being sent), queue
        ``Err(0, SLOW_CONSUMER)`` and close: :data:`ABORT`."""
        n = len(self.out) + self.sending
        self.overflowed = n
        self.out = bytearray()
        self._queue_error(0, SlowConsumerError(
            f"closing the connection: {n} bytes of replies were waiting for it to read them (the limit is "
            f"{self.hard_out_bytes}; the server stops reading requests at {self.max_out_bytes}, "
            "--max-outgoing-bytes): read replies as they come, or pipeline fewer large requests",
            details={"unsent_bytes": n, "limit": self.hard_out_bytes}))
        if self._log_limiter is not None:
            self._log_limiter.log(logging.WARNING, "slow-consumer-conn",
                                  "closing connection from %s: %d bytes of replies unread (limit %d)",
                                  self.peer, n, self.hard_out_bytes)
        self._to(_CLOSE)
        return ABORT

    def fail_held(self, n: int, exc: BaseException) -> int:
        """Waiting for the durability of the first ``n`` held answers failed with
        ``exc``: a RallypointError answers each of them; another exception answers the
        first INTERNAL (logged) and the others INTERNAL without a log line each."""
        fifo = self.deferred
        if isinstance(exc, RallypointError):
            for _ in range(n):
                _, rid, _ = fifo.popleft()
                self._queue_error(rid, exc)
        else:
            for i in range(n):
                _, rid, _ = fifo.popleft()
                if i == 0:
                    self._queue_internal(rid, exc)
                else:
                    self._queue_error(rid, InternalError("internal error; the server logged it (durability wait)"))
        return self._wake() | self._done(n) | FLUSH

    # --------------------------------------------------------------- lifecycle
    def drain(self) -> int:
        """A graceful stop began: no more requests are read (a paused reader stops
        waiting: :data:`RESUME`); in-flight ones finish. :data:`IDLE` when nothing is
        in flight or queued already."""
        self._to(_DRAIN)
        act = WRITE
        if self.reading is PAUSED_READING:
            act |= RESUME
        if self.inflight == 0 and not self.out and not self.sending:
            act |= IDLE
        return act

    def end_session(self, error: RallypointError) -> int:
        """The session's rights ended (its key was revoked, open mode is over: the
        dispatcher refuses it now): every subscription ends with ``error``, ``Err(0,
        error)`` says why, and the connection drains (DRAINING: the reader stops after
        the chunk it holds; requests in flight are answered, each refused with ``error``
        by the dispatcher; waits that are still parked when it closes get ``error``
        too, :meth:`stop`); the socket loop closes it once that is written. 0 (nothing)
        when it is draining or closing already, or not open yet."""
        if self.phase is not OPEN:
            return 0
        self.ended = error
        act = 0
        for rid, w in list(self.streams.items()):
            w.cancel()
            act |= self.end_stream(rid, error)
        self._queue_error(0, error)
        return act | self.drain()

    def _stop_answer(self) -> RallypointError:
        """What waits ended by a drain or a close are told: the session's end
        (:meth:`end_session`), else UNAVAILABLE (the server is stopping)."""
        return self.ended if self.ended is not None else shutting_down_error()

    def grace_over(self) -> int:
        """The drain's grace for parked waits ran out: answer them UNAVAILABLE (or the
        session's end); a wait parked from now on is answered at once (REFUSING_WAITS)."""
        self._to(_GRACE_OVER)
        return self._end_waits(self._stop_answer())

    def stop(self, answer: RallypointError) -> int:
        """The connection ends (EOF, the drain done or out of time, a fatal error):
        waits still parked are answered ``answer`` (a peer that half-closed can still
        hear it), then CLOSING."""
        act = self._end_waits(answer)
        self._to(_CLOSE)
        return act

    def close(self) -> None:
        """Close now: nothing more is answered (CLOSING)."""
        self._to(_CLOSE)

    def finish(self) -> None:
        """The connection is gone (CLOSED): held answers are dropped, parked waits and
        subscriptions end unanswered."""
        self._to(_CLOSE)
        self._to(_FINISH)
        self.deferred.clear()
        self._end_waits(None)
        for w in self.streams.values():
            w.cancel()
        self.streams.clear()

    def gone(self, silent_s: float) -> bool:
        """The peer is taken as gone: it pings while its calls wait (this SDK's clients
        do: :meth:`rallypoint.transport.connection.Connection.watch_liveness`), yet
        nothing came from it for ``silent_s`` seconds (a NAT entry dropped, a host gone:
        TCP would notice only much later). A peer that never pinged is never taken as
        gone here (the idle pinger finds it)."""
        return self.pings_in > 0 and self._clock() - self.t_rx > silent_s

    def idle_tick(self) -> int:
        """A ping interval passed. Traffic since the last tick, or a reader paused by
        us, is not idleness. The 1st and 2nd silent ticks in a row queue a Ping
        (:data:`WRITE`); the 3rd is :data:`ABORT`."""
        if self.rx_count != self._rx_seen or self.reading is PAUSED_READING:
            self._rx_seen = self.rx_count
            self.idle_ticks = 0
            return 0
        self.idle_ticks += 1
        if self.idle_ticks >= 3:
            return ABORT
        self._ping_nonce += 1
        self._queue_msg(_Ping(self._ping_nonce))
        return self._wake()

    # ----------------------------------------------------------------- metrics
    def _observe(self, rid: int, reply: Any) -> None:
        m = self.req_meta.pop(rid, None)
        if m is not None:
            seconds = self._clock() - m[0]
            metrics = self._metrics
            h = metrics.latency.get(m[1])
            if h is not None and type(reply) is bytes and seconds < metrics.fast_s:
                h.counts[_bisect(_LATENCY_BOUNDS, seconds)] += 1  # the common case, inline
                h.sum += seconds
            else:
                metrics.observe(m[1], "OK" if type(reply) is bytes else getattr(reply, "code", "INTERNAL"),
                                seconds, self.peer, m[2])

    # ------------------------------------------------------------------ framing
    # Every frame the server writes is made below, appended to self.out.
    def _queue_msg(self, msg: msgspec.Struct) -> None:
        """Frame any server message Struct (HelloOk, Err, Ping, Pong)."""
        out = self.out
        start = len(out)
        out += HEADER_PLACEHOLDER
        _encode_into(msg, out, start + HEADER)
        pack_header_into(out, start, len(out) - start - HEADER)
        n = len(out) + self.sending
        if n > self.max_out:
            self.max_out = n

    def _queue_ok(self, rid: int, reply: bytes) -> None:
        """Frame ``Ok(rid, Raw(reply))``. The envelope is built by hand (one struct pack
        and two appends, no Struct/Raw objects): ``reply`` must be ``bytes``."""
        if 0 < rid <= 0xFFFFFFFF:
            size = 19 + len(reply)
            head = _ok_head32(size, _OK_PRE32, rid, _OK_BODY)
        else:
            size = 23 + len(reply)
            head = _ok_head64(size, _OK_PRE64, rid, _OK_BODY)
        if size > _MAX_FRAME:
            self._queue_error(rid, LimitError(
                f"the reply is {size} bytes, larger than the frame limit of {_MAX_FRAME} bytes; "
                "ask for less per request (smaller page / limit)"))
            return
        out = self.out
        out += head
        out += reply
        est = self.reply_size
        # up at once to a larger reply, down slowly (a moving average): requests admitted
        # after a large reply are counted at its size, so a client pipelining large
        # replies it never reads is paused near max_out_bytes, not at many times it
        self.reply_size = size if size > est else (est * 7 + size) >> 3
        n = len(out) + self.sending
        if n > self.max_out:
            self.max_out = n

    def _queue_failure(self, rid: int, reply: Any) -> None:
        """An answer that is not reply bytes: a RallypointError, or INTERNAL."""
        if isinstance(reply, RallypointError):
            self._queue_error(rid, reply)
        else:
            self._queue_internal(rid, reply)

    def _queue_error(self, rid: int, exc: RallypointError) -> None:
        """Frame ``Err(rid, code, message, retry_after, details)``."""
        self.errors += 1
        details = exc.details
        if details is not None and not isinstance(details, dict):
            details = {"value": details}
        msg = wire.Err(rid, exc.code, exc.message, exc.retry_after, details)
        try:
            self._queue_msg(msg)
        except Exception as enc_exc:  # details not encodable
            self._queue_internal(rid, enc_exc)

    def _queue_internal(self, rid: int, exc: BaseException) -> None:
        """Frame INTERNAL for ``exc`` (a fault of ours), logged with a reference; the
        answer carries the reference, never the exception's text."""
        ref = _new_ref()
        args = ("request %d from %s failed with an unexpected error (ref %s)", rid, self.peer, ref)
        if self._log_limiter is not None:
            self._log_limiter.log(logging.ERROR, f"internal:{type(exc).__name__}", *args, exc_info=exc)
        else:
            _log.error(*args, exc_info=exc)
        self.internal_errors += 1
        self.errors += 1
        self._queue_msg(wire.Err(rid, "INTERNAL", f"internal error; the server logged it as ref {ref}"))

    def _queue_push(self, rid: int, head: bytes, items: Any, cursor: int) -> int:
        """Frame ``Push(rid, events, cursor)``: the events' array is ``head`` followed by
        ``items`` (encoded bytes, appended in order). :data:`FLUSH`, or 0 when the
        subscription is gone or the connection closing."""
        if self.phase in NO_ANSWER_PHASES or rid not in self.streams:
            return 0
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
        return FLUSH
