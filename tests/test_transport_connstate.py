"""The connection state machine (transport/connstate.py) driven directly: bytes and
events in, actions and frames out; no socket, no Trio."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from rallypoint import wire
from rallypoint.errors import ConflictError, RallypointError, UnauthenticatedError, shutting_down_error
from rallypoint.transport import connstate as cs
from rallypoint.transport.connstate import (
    ABORT,
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
    ConnStateError,
    Phase,
    Reading,
    Trigger,
)
from rallypoint.transport.framing import FrameParser, encode_frame

enc = msgspec.msgpack.Encoder().encode
_server = msgspec.msgpack.Decoder(wire.ServerFrame)


def frame(msg) -> bytes:
    return encode_frame(enc(msg))


def req(rid: int, body=b"\x01") -> wire.Request:
    return wire.Request(rid, msgspec.Raw(enc(body) if not isinstance(body, bytes) else body))


HELLO = frame(wire.Hello(wire.PROTOCOL_VERSION, client="t"))
HELLO_OK = wire.HelloOk(wire.PROTOCOL_VERSION, "test")


class Durable:
    """The journal's durable LSN, set by the test."""

    def __init__(self) -> None:
        self.lsn = 0

    def __call__(self) -> int:
        return self.lsn


class Waiter:
    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


def drain_out(st: ConnState) -> list:
    """The frames queued in st.out, decoded (and taken: as if written whole)."""
    data = st.take_output()
    st.sent(len(data))
    return [_server.decode(f) for f in FrameParser().feed(bytes(data))]


def opened(durable=None, **kw) -> ConnState:
    """A ConnState past the handshake, its HelloOk taken, the reader waiting for bytes."""
    st = ConnState(durable_lsn=durable or Durable(), **kw)
    hello = st.receive_hello(HELLO)
    assert isinstance(hello, wire.Hello)
    st.accept_hello({"s": 1}, HELLO_OK)
    assert st.next_request() is NEED_DATA
    assert drain_out(st) == [HELLO_OK]
    return st


def requests_of(st: ConnState, data: bytes | None = None) -> list:
    """next_request with ``data`` (a chunk received), then without until it stops: the
    admitted requests' ids, then the stop."""
    got = []
    r = st.next_request(data)
    while True:
        if r is NEED_DATA or r is PAUSED:
            return got + [r]
        got.append(r.id)
        r = st.next_request()


# ---------------------------------------------------------------- transitions
def test_phase_table_is_total_over_its_states_and_raises_elsewhere():
    phase_triggers = [Trigger.HELLO_OK, Trigger.DRAIN, Trigger.GRACE_OVER, Trigger.CLOSE, Trigger.FINISH]
    allowed = 0
    for phase, trigger in itertools.product(Phase, phase_triggers):
        st = ConnState()
        st.phase = phase
        if (phase, trigger) in cs.PHASE_TRANSITIONS:
            st._to(trigger)
            assert st.phase is cs.PHASE_TRANSITIONS[phase, trigger]
            allowed += 1
        else:
            with pytest.raises(ConnStateError) as e:
                st._to(trigger)
            assert e.value.code == "INTERNAL"
            assert trigger.name in e.value.message and phase.name in e.value.message
            assert st.phase is phase
    assert allowed == len(cs.PHASE_TRANSITIONS) == 18
    # every phase but CLOSED can close; only CLOSING finishes
    assert {p for (p, t) in cs.PHASE_TRANSITIONS if t is Trigger.CLOSE} == set(Phase)
    assert [p for (p, t) in cs.PHASE_TRANSITIONS if t is Trigger.FINISH] == [Phase.CLOSING]


def test_reading_table_raises_on_what_it_does_not_list():
    read_triggers = [Trigger.DATA, Trigger.FULL, Trigger.ROOM, Trigger.CHUNK_DONE, Trigger.STOP]
    for reading, trigger in itertools.product(Reading, read_triggers):
        st = ConnState()
        st.reading = reading
        if (reading, trigger) in cs.READING_TRANSITIONS:
            st._read(trigger)
            assert st.reading is cs.READING_TRANSITIONS[reading, trigger]
        else:
            with pytest.raises(ConnStateError):
                st._read(trigger)
            assert st.reading is reading


def test_illegal_inputs_raise():
    st = opened()
    with pytest.raises(ConnStateError):
        st.receive_hello(HELLO)  # a hello once open
    with pytest.raises(ConnStateError):
        st.accept_hello(None, HELLO_OK)  # HELLO_OK in OPEN
    with pytest.raises(ConnStateError):
        st.grace_over()  # no drain runs
    assert st.next_request(frame(req(1))).id == 1
    with pytest.raises(ConnStateError):
        st.next_request(frame(req(2)))  # the previous chunk is not handled yet
    st.close()
    st.finish()
    assert st.phase is Phase.CLOSED
    with pytest.raises(ConnStateError):
        st.finish()  # finished twice


# ------------------------------------------------------------------ handshake
def test_hello_split_across_chunks_then_pipelined_requests():
    st = ConnState()
    data = HELLO + frame(req(1)) + frame(req(2))
    assert st.receive_hello(data[:3]) is NEED_DATA
    hello = st.receive_hello(data[3:])
    assert hello == wire.Hello(wire.PROTOCOL_VERSION, client="t")
    assert st.phase is Phase.HANDSHAKE and st.bytes_in == len(data)
    assert st.accept_hello("session", HELLO_OK) == 0
    assert (st.phase, st.reading, st.session) == (Phase.OPEN, Reading.HANDLING, "session")
    assert requests_of(st) == [1, 2, NEED_DATA]
    assert st.reading is Reading.RECEIVING and st.inflight == 2
    assert drain_out(st) == [HELLO_OK]


@pytest.mark.parametrize("data, text", [
    (frame(wire.Ping(1)), "the first frame must be a hello (t='hello'), got Ping"),
    (encode_frame(b"\xc1"), "the first frame must be a hello"),
    (frame(wire.Hello(wire.PROTOCOL_VERSION + 1)), "protocol version mismatch"),
    ((wire.MAX_FRAME_BYTES + 1).to_bytes(4, "big"), "larger than the frame limit"),
])
def test_a_bad_first_frame_is_refused_with_validation_failed(data, text):
    st = ConnState()
    assert st.receive_hello(data) is REFUSED
    assert st.phase is Phase.CLOSING
    [err] = drain_out(st)
    assert (err.id, err.code) == (0, "VALIDATION_FAILED") and text in err.message


def test_eof_before_the_hello_closes_silently_and_a_timeout_answers_unavailable():
    st = ConnState()
    assert st.receive_hello(b"") is REFUSED and st.phase is Phase.CLOSING and not st.out
    st = ConnState()
    assert st.receive_hello(HELLO[:2]) is NEED_DATA
    assert st.hello_timeout(2.5) == WRITE
    [err] = drain_out(st)
    assert (err.code, err.message) == ("UNAVAILABLE", "no hello within 2.5s of connecting; closing")


def test_refused_hello_answers_the_error_or_internal(caplog):
    st = ConnState()
    st.receive_hello(HELLO)
    st.refuse_hello(UnauthenticatedError("unknown API key"))
    [err] = drain_out(st)
    assert (err.id, err.code, st.phase) == (0, "UNAUTHENTICATED", Phase.CLOSING)
    st = ConnState()
    st.receive_hello(HELLO)
    st.refuse_hello(KeyError("secret"))
    [err] = drain_out(st)
    assert err.code == "INTERNAL" and "secret" not in err.message and st.internal_errors == 1
    assert "secret" in caplog.text  # the log has it, with a reference


def test_a_drain_during_the_handshake_opens_into_draining():
    st = ConnState()
    assert st.drain() & IDLE
    assert st.phase is Phase.HANDSHAKE_DRAINING
    st.receive_hello(HELLO + frame(req(1)))
    st.accept_hello(None, HELLO_OK)
    assert st.phase is Phase.DRAINING
    assert requests_of(st) == [1, NEED_DATA]  # what came with the hello is still taken


# ---------------------------------------------------------------- requests
def test_control_frames_and_bad_ids_are_answered_in_order():
    st = opened()
    assert requests_of(st, frame(wire.Ping(7)) + frame(req(0)) + frame(req(3)) + frame(req(3))
                    + frame(wire.Hello(wire.PROTOCOL_VERSION)) + frame(wire.Pong(1))) == [3, NEED_DATA]
    got = drain_out(st)
    assert got[0] == wire.Pong(7)
    assert [(f.id, f.code) for f in got[1:]] == [(0, "VALIDATION_FAILED"), (3, "VALIDATION_FAILED"),
                                                 (0, "VALIDATION_FAILED")]
    assert "already in flight" in got[2].message and "hello sent twice" in got[3].message
    assert st.requests == 3 and st.inflight == 1 and st.errors == 3


def test_a_batch_is_admitted_one_request_at_a_time_against_the_limit():
    st = opened(max_inflight=2)
    assert requests_of(st, frame(wire.Batch([req(1), req(2), req(3)])) + frame(req(4))) == [1, 2, PAUSED]
    assert (st.reading, st.pauses) == (Reading.PAUSED, 1)
    assert st.at_limits()
    assert st.deliver(1, b"\x01", 0) == RESUME  # a paused reader is told
    assert not st.at_limits()
    assert st.resume() is True and st.reading is Reading.HANDLING
    assert requests_of(st) == [3, PAUSED]  # the batch's last request before the next frame
    st.deliver(2, b"\x01", 0)
    st.resume()
    assert requests_of(st) == [4, PAUSED]  # checked after the chunk's last request too
    st.deliver(3, b"\x01", 0)
    st.resume()
    assert requests_of(st) == [NEED_DATA] and st.reading is Reading.RECEIVING


def test_the_bytes_the_replies_will_take_pause_the_reader():
    st = opened(max_out_bytes=10_000)
    assert st.reply_size == 4096  # a cautious start
    assert requests_of(st, b"".join(frame(req(i)) for i in range(1, 5))) == [1, 2, 3, PAUSED]  # 3 x 4096 > 10000


def test_an_undecodable_frame_and_a_bad_batch_keep_the_connection():
    st = opened()
    bad_batch = enc({"t": "batch", "reqs": [{"t": "req", "id": 5, "body": 1}, {"t": "req", "id": "x"},
                                            {"t": "req", "id": 6, "body": 2}]})
    assert requests_of(st, encode_frame(enc({"t": "req", "id": 9, "body": 1, "x": []})[:-1] + b"\xc1")
                    + encode_frame(bad_batch)) == [5, 6, NEED_DATA]
    errs = drain_out(st)
    assert [(e.id, e.code) for e in errs] == [(9, "VALIDATION_FAILED"), (0, "VALIDATION_FAILED")]
    assert "$.reqs[1]" in errs[1].message


def test_a_frame_over_the_limit_closes_after_an_answer():
    st = opened()
    assert requests_of(st, frame(req(1)) + (wire.MAX_FRAME_BYTES + 1).to_bytes(4, "big")) == [1, NEED_DATA]
    assert st.parser.oversize is not None
    assert st.frame_too_large() == WRITE
    assert (st.phase, st.reading) == (Phase.CLOSING, Reading.STOPPED)
    [err] = drain_out(st)
    assert (err.id, err.code) == (0, "VALIDATION_FAILED")


def test_submit_failed_answers_internal_once():
    st = opened()
    [rid, _] = requests_of(st, frame(req(1)))
    assert st.submit_failed(rid, ValueError("password=hunter2")) == WRITE  # the chunk is handled
    assert st.submit_failed(rid, ValueError("again")) == 0  # no longer in flight
    [err] = drain_out(st)
    assert err.code == "INTERNAL" and "hunter2" not in err.message and st.inflight == 0


# ------------------------------------------------------------------ answers
def test_answers_wait_for_durability_in_lsn_order():
    durable = Durable()
    st = opened(durable)
    requests_of(st, b"".join(frame(req(i)) for i in (1, 2, 3)))
    assert st.deliver(1, b"\xa1a", 5) == HOLD
    assert st.deliver(2, ConflictError("no"), 7) == HOLD
    assert st.deliver(3, b"\xa1c", 0) == 0  # depends on no state: at once
    assert [f.id for f in drain_out(st)] == [3]
    durable.lsn = 5
    assert st.release(5, None) == FLUSH  # (no reader paused, not draining)
    assert [(f.id, bytes(f.body)) for f in drain_out(st)] == [(1, b"\xa1a")]
    err = RallypointError("journal stopped")
    assert st.release(5, err) == FLUSH
    [e] = drain_out(st)
    assert (e.id, e.message) == (2, "journal stopped") and st.inflight == 0 and not st.deferred


def test_a_failed_durability_wait_answers_the_first_internal_and_the_rest_without_a_log():
    st = opened()
    requests_of(st, b"".join(frame(req(i)) for i in (1, 2)))
    st.deliver(1, b"\x01", 3)
    st.deliver(2, b"\x01", 4)
    assert st.fail_held(2, OSError("disk")) == WRITE | FLUSH
    got = drain_out(st)
    assert [(f.id, f.code) for f in got] == [(1, "INTERNAL"), (2, "INTERNAL")]
    assert "ref" in got[0].message and st.internal_errors == 1


def test_answers_of_a_closing_connection_are_dropped():
    st = opened()
    requests_of(st, b"".join(frame(req(i)) for i in (1, 2)))
    st.deliver(2, b"\x01", 9)
    st.close()
    assert st.deliver(1, b"\x01", 0) == 0 and st.inflight == 1
    assert st.release(9, None) == 0 and not st.deferred
    assert st.deliver(77, b"\x01", 0) == 0  # not in flight
    assert not st.out


def test_a_reply_over_the_frame_limit_is_answered_limit_exceeded():
    st = opened()
    requests_of(st, frame(req(1)))
    st.deliver(1, b"\x00" * wire.MAX_FRAME_BYTES, 0)
    [err] = drain_out(st)
    assert (err.id, err.code) == (1, "LIMIT_EXCEEDED")


# ------------------------------------------------------------ parked waits
def test_cancel_before_and_after_the_wait_parks():
    st = opened()
    requests_of(st, frame(req(1)) + frame(req(2)))
    w1, w2 = Waiter(), Waiter()
    assert st.track(1, w1) == 0
    assert requests_of(st, frame(wire.Cancel(1)) + frame(wire.Cancel(2))) == [NEED_DATA]
    assert w1.cancelled == 1 and st.inflight == 1  # parked: ended, no answer
    assert st.track(2, w2) == 0 and w2.cancelled == 1  # cancelled before it parked
    assert st.inflight == 0 and not st.out


def test_untrack_lets_the_answer_through():
    st = opened()
    requests_of(st, frame(req(1)))
    st.track(1, Waiter())
    st.untrack(1)
    st.deliver(1, b"\x01", 0)
    assert [f.id for f in drain_out(st)] == [1]


def test_drain_grace_then_unavailable_and_refused_waits():
    st = opened()
    requests_of(st, b"".join(frame(req(i)) for i in (1, 2, 3)))
    w1 = Waiter()
    st.track(1, w1)
    act = st.drain()
    assert st.phase is Phase.DRAINING and act == WRITE  # requests in flight: not idle
    assert st.grace_over() == WRITE  # (no reader paused; requests 2 and 3 still in flight)
    assert st.phase is Phase.REFUSING_WAITS and w1.cancelled == 1
    w2 = Waiter()
    assert st.track(2, w2) == WRITE and w2.cancelled == 1  # a wait parked now is refused
    assert st.deliver(3, b"\x01", 0) == IDLE  # the last one in flight
    got = drain_out(st)
    assert [(f.id, getattr(f, "code", "OK")) for f in got] == [(1, "UNAVAILABLE"), (2, "UNAVAILABLE"), (3, "OK")]
    assert got[0].details == {"reason": "shutting_down"}
    assert st.idle()


def test_stop_answers_parked_waits_and_finish_ends_everything_silently():
    st = opened()
    requests_of(st, b"".join(frame(req(i)) for i in (1, 2, 3)))
    w1, w2, watcher = Waiter(), Waiter(), Waiter()
    st.track(1, w1)
    assert st.stop(shutting_down_error()) == WRITE
    assert st.phase is Phase.CLOSING and w1.cancelled == 1
    assert [(f.id, f.code) for f in drain_out(st)] == [(1, "UNAVAILABLE")]
    st.track(2, w2)  # closing: cancelled at once, no answer
    assert w2.cancelled == 1
    st.streams[3] = watcher
    st.deliver(3, b"\x01", 5)
    st.finish()
    assert st.phase is Phase.CLOSED and watcher.cancelled == 1 and not st.streams and not st.out


def test_a_drain_wakes_a_paused_reader_which_then_stops():
    st = opened(max_inflight=1)
    assert requests_of(st, frame(req(1)) + frame(req(2))) == [1, PAUSED]
    assert st.drain() == WRITE | RESUME
    assert not st.at_limits()  # a draining reader waits no more
    assert st.resume() is False and st.reading is Reading.STOPPED


# ----------------------------------------------------------------- output
def test_output_written_in_parts_and_whole():
    st = opened(max_inflight=1)
    requests_of(st, frame(req(1)) + frame(req(2)))  # paused
    st.deliver(1, b"\x01" * 10, 0)
    n = len(st.out)
    before = st.bytes_out
    assert st.wrote(5) == RESUME | WRITE  # part left: the writer takes the rest
    assert len(st.out) == n - 5 and st.bytes_out == before + 5
    assert st.wrote(0) == WRITE
    data = st.take_output()
    assert st.sending == n - 5 and not st.out
    assert st.push_room(1) == st.watch_buffer_bytes - (n - 5)
    assert st.sent(len(data)) == RESUME and st.sending == 0 and st.bytes_out == before + n
    st.send_failed()
    assert st.sending == 0


def test_a_drained_connection_reports_idle_when_its_output_left():
    st = opened()
    requests_of(st, frame(req(1)))
    st.drain()
    assert st.deliver(1, b"\x01", 0) == IDLE
    assert not st.idle()  # the reply is still queued
    assert st.wrote(len(st.out)) == IDLE and st.idle()


# -------------------------------------------------------------- subscriptions
def test_pushes_and_the_end_of_a_subscription():
    st = opened()
    requests_of(st, frame(req(4)))
    w = Waiter()
    assert st.add_stream(4, w)
    st.deliver(4, b"\x80", 0)
    assert st.push(4, [enc({"seq": 1}), enc({"seq": 2})], 2) == FLUSH
    assert st.push_encoded(4, 1, enc([{"seq": 3}]), 7) == FLUSH
    assert st.push(5, [enc(1)], 1) == 0  # no such subscription
    ok, p1, p2 = drain_out(st)
    assert ok.id == 4 and (p1.id, [msgspec.msgpack.decode(e) for e in p1.events]) == (4, [{"seq": 1}, {"seq": 2}])
    assert [msgspec.msgpack.decode(e) for e in p2.events] == [{"seq": 3}] and st.pushes == 2
    assert (p1.cursor, p2.cursor) == (2, 7)
    data = st.take_output()
    assert st.sent(len(data)) == WATCH  # output left: a watcher waiting for room may go on
    assert st.end_stream(4, ConflictError("slow")) == WRITE
    assert st.end_stream(4, ConflictError("slow")) == 0
    [err] = drain_out(st)
    assert (err.id, err.code) == (4, "CONFLICT")
    st.add_stream(6, w)
    requests_of(st, frame(wire.Cancel(6)))
    assert w.cancelled == 1 and 6 not in st.streams
    st.close()
    assert not st.add_stream(7, w) and st.push_room(7) == 0 and st.push(6, [b"\x01"], 1) == 0


# -------------------------------------------------------------------- pings
def test_idle_ticks_ping_twice_then_abort_and_traffic_resets_them():
    st = opened()
    assert st.idle_tick() == WRITE
    assert st.idle_tick() == WRITE
    assert [f.nonce for f in drain_out(st)] == [1, 2]
    requests_of(st, frame(wire.Pong(2)))
    assert st.idle_tick() == 0 and st.idle_ticks == 0  # traffic
    assert st.idle_tick() == WRITE
    assert st.idle_tick() == WRITE
    assert st.idle_tick() == ABORT


def test_a_paused_reader_is_not_an_idle_peer():
    st = opened(max_inflight=1)
    requests_of(st, frame(req(1)) + frame(req(2)))
    st.idle_tick()  # the chunk was traffic
    for _ in range(5):
        assert st.idle_tick() == 0


# ------------------------------------------------------------------ metrics
def test_latency_is_observed_from_receipt_to_answer_with_the_given_clock():
    from rallypoint.metrics import Metrics

    now = [100.0]
    m = Metrics(None)
    st = opened(metrics=m, clock=lambda: now[0])
    requests_of(st, frame(req(1)))
    st.note_op(1, "scope.status")
    now[0] = 100.25
    st.deliver(1, b"\x01", 0)
    h = m.latency["scope.status"]
    assert sum(h.counts) == 1 and h.sum == pytest.approx(0.25)
